"""The train state drawn parameter by parameter (prolip_jax/core/param_init.py) is the one-program
`jax.jit(model.init)` state bit for bit, laid out the same, on a sharded mesh; models it cannot
follow (scanned layers) fall back to that program."""
import flax.core.scope as flax_scope
import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import OPTIMIZED

from prolip_jax.core import optim, param_init, sharding
from prolip_jax.core import step as S
from prolip_jax.core.models import ProLIP, dummy_inputs, get_config

MICRO = get_config("micro")  # its q, k and v kernels (one shape, one initialiser) share a program
OPTIM = dict(lr=1e-3, warmup_steps=2, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.2)


@pytest.fixture(scope="module")
def setup():
    tx, _ = optim.make_optimizer(optim.OptimConfig.of(OPTIM), 10)
    devices = jax.devices()  # the suite's eight CPU devices; one GPU when run there to check its draws
    shape = (2, 2, 2) if len(devices) >= 8 else (1, len(devices), 1)
    mesh = sharding.make_mesh(shape, ("data", "fsdp", "tensor"), devices[:int(np.prod(shape))])
    return tx, mesh


def assert_same_state(state, reference):
    assert jax.tree.structure(state) == jax.tree.structure(reference)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(reference)):
        assert x.sharding == y.sharding, jax.tree_util.keystr(path)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def one_program(model, tx, shardings, seed, options=None):
    key = jax.random.key(seed)
    options = options if jax.default_backend() == "cpu" else None  # OPTIMIZED names XLA:CPU options
    return jax.jit(S._init_fn(model, tx), out_shardings=shardings).lower(key).compile(options)(key)


@pytest.mark.parametrize("flags", ["suite", "none"])
def test_state_matches_one_program(setup, flags, monkeypatch):
    """With the suite's XLA_FLAGS (-O0) the draws compile as everything else does; without any,
    at param_init.CPU_COMPILE_OPTIONS, against one program at XLA's defaults (what a run gets)."""
    tx, mesh = setup
    if flags == "none":
        monkeypatch.setenv("XLA_FLAGS", "")
    model = ProLIP(MICRO, attention_impl="xla")
    draws = param_init.record(model, *dummy_inputs(model.config))
    state, shardings = S.create_train_state(model, tx, mesh, "fsdp", seed=3)
    reference = one_program(model, tx, shardings, 3, options=OPTIMIZED if flags == "none" else None)
    assert_same_state(state, reference)
    assert draws is not None and len(draws) == len(jax.tree.leaves(state.params))
    if mesh.shape["fsdp"] > 1:  # sharded for real: the fsdp rules split some kernel over the mesh
        assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(state.params))


def test_a_second_state_compiles_no_draw(setup):
    """The compiled draws are kept for the process (param_init._PROGRAMS); the key is their input,
    so another seed draws other values from the same programs."""
    tx, mesh = setup
    model = ProLIP(MICRO, attention_impl="xla")
    first, _ = S.create_train_state(model, tx, mesh, "fsdp", seed=5)
    programs = len(param_init._PROGRAMS)
    second, _ = S.create_train_state(model, tx, mesh, "fsdp", seed=6)
    assert len(param_init._PROGRAMS) == programs
    kernel = lambda state: np.asarray(state.params["visual"]["transformer"]["resblocks_0"]["c_fc"]["kernel"])  # noqa: E731
    assert not np.array_equal(kernel(first), kernel(second))


@pytest.mark.parametrize("variant", [dict(scan_layers=True), dict(remat="full")])
def test_lifted_transforms_fall_back(setup, variant):
    """nn.scan splits the rng and nn.remat passes it through jax.checkpoint: record cannot tell
    the key of a parameter from the root's, so the state comes from the one program."""
    tx, mesh = setup
    model = ProLIP(MICRO, attention_impl="xla", **variant)
    assert param_init.record(model, *dummy_inputs(model.config)) is None
    state, shardings = S.create_train_state(model, tx, mesh, "fsdp", seed=3)
    assert_same_state(state, one_program(model, tx, shardings, 3))


class _Fails(nn.Module):
    @nn.compact
    def __call__(self, x):
        self.param("w", nn.initializers.normal(), (2,))
        raise ZeroDivisionError


def test_record_restores_flax_after_an_error():
    original = flax_scope.Scope.param
    with pytest.raises(ZeroDivisionError):
        param_init.record(_Fails(), np.zeros(2))
    assert flax_scope.Scope.param is original
