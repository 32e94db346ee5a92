"""Beyond one slice, on 8 fake CPU devices split into 2 "slices" (a stand-in for TPU devices'
`slice_index`: devices 0-3 and 4-7): the hybrid mesh lays only the data axis across slices,
the ring PPCL loss crosses DCN once and equals the formula, the compiled step's DCN bytes
are what the maths needs, and training on 2 slices equals training on 1 (and resumes across).
"""
from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import max_rel_err
from prolip_jax import train
from prolip_jax.core import checkpoint, sharding, traffic
from prolip_jax.core.objectives.prolip import ppcl
from test_train import tiny_config

TOL = 1e-5
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # compile_tpu.build_step: the trainer's step, compiled


@pytest.fixture
def two_slices(monkeypatch):
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    monkeypatch.setattr(sharding, "slice_index", lambda d: d.id // 4)


@pytest.fixture
def uncached():
    """XLA:CPU can deadlock running a program read back from the persistent compilation cache
    whose devices may reach two independent collectives in either order (the ring's gathered
    texts' permute, the gradients' all-reduce): such programs are never written there."""
    old = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e12)
    yield
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old)


def _slices(mesh) -> np.ndarray:
    return np.vectorize(sharding.slice_index)(mesh.devices)


def test_only_the_data_axis_crosses_slices(two_slices):
    mesh = sharding.make_mesh((-1, 2, 1), ("data", "fsdp", "tensor"), dcn_shape=(2, 1, 1))
    assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}
    s = _slices(mesh)
    assert (s[:2] == 0).all() and (s[2:] == 1).all()  # slice-major along data
    assert all(len(set(s[d].flat)) == 1 for d in range(4))  # every fsdp group within a slice
    assert ppcl.ring_slices(mesh, ("data", "fsdp")) == 2
    assert ppcl.ring_slices(mesh, ("fsdp", "data")) == 1  # positions alternate slices: the plain ring
    flat = sharding.make_mesh((-1, 1, 1), ("data", "fsdp", "tensor"))  # no dcn_shape: as before
    assert sharding.mesh_slices(flat) == 1 and ppcl.ring_slices(flat, ("data",)) == 1


@pytest.mark.parametrize("dcn, message", [
    ((1, 2, 1), "puts the 'fsdp' axis across slices; only 'data' may cross them"),
    ((1, 1, 2), "puts the 'tensor' axis across slices"),
    ((4, 1, 1), r"dcn_shape \(4, 1, 1\) spans 4 slices; the devices are in 2"),
    ((2, 1), "differ in length"),
    ((0, 1, 1), "every entry is a slice count >= 1"),
])
def test_a_wrong_dcn_shape_is_one_line(two_slices, dcn, message):
    with pytest.raises(ValueError, match=message):
        sharding.make_mesh((-1, 1, 1), ("data", "fsdp", "tensor"), dcn_shape=dcn)
    with pytest.raises(ValueError, match="per slice"):  # 3 does not divide a slice's 4 devices
        sharding.make_mesh((3, 1, 1), ("data", "fsdp", "tensor"), dcn_shape=(2, 1, 1))


def _inputs(batch=32, dim=8):
    k = jax.random.split(jax.random.key(0), 4)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    return (unit(jax.random.normal(k[0], (batch, dim))), -4.0 + jax.random.normal(k[1], (batch, dim)),
            unit(jax.random.normal(k[2], (batch, dim))), -4.0 + jax.random.normal(k[3], (batch, dim)),
            jnp.float32(4.0), jnp.float32(0.5))


def _ring(mesh, args):
    rows = NamedSharding(mesh, P(sharding.batch_axes(mesh)))
    sharded = [jax.device_put(x, rows) for x in args[:4]] + list(args[4:])
    fn = jax.jit(jax.value_and_grad(ppcl.make_ppcl_loss("ring", mesh), argnums=range(6)))
    return fn(*sharded), fn.lower(*sharded).compile()


@pytest.mark.parametrize("ici", [(-1, 1, 1), (-1, 2, 1)])
def test_the_ring_over_slices_is_exact_and_crosses_dcn_once(two_slices, uncached, ici):
    mesh = sharding.make_mesh(ici, ("data", "fsdp", "tensor"), dcn_shape=(2, 1, 1))
    args = _inputs()
    (loss, grads), compiled = _ring(mesh, args)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(ppcl.ppcl_loss, argnums=range(6)))(*args)
    assert max_rel_err(loss, ref_loss) <= TOL
    for g, r in zip(grads, ref_grads):
        assert max_rel_err(g, r) <= TOL
    # DCN: the forward pass sends every text block [4 rows: mu 8 + trace 1 floats] to the other
    # slice once (8 positions x 1 block), the backward pass returns its gradient once.
    t = traffic.program_traffic(compiled, mesh)
    block = 4 * (8 + 1) * 4
    assert t.by_kind["collective-permute"] == 2 * 8 * block, t
    # The plain ring, on a mesh of one slice whose positions alternate between the stand-in's
    # slices: every hop crosses.
    devices = jax.devices()[:8]
    plain = sharding.make_mesh((-1, 1, 1), ("data", "fsdp", "tensor"), devices=devices[0::4] + devices[1::4]
                               + devices[2::4] + devices[3::4])
    (plain_loss, _), plain_compiled = _ring(plain, args)
    assert max_rel_err(plain_loss, ref_loss) <= TOL
    plain_bytes = traffic.program_traffic(plain_compiled, plain).by_kind["collective-permute"]
    # Forward 7 hops of a block; backward 7 hops of a block and its gradient, one hop home.
    assert plain_bytes == (7 + 2 * 7 + 1) * 8 * block, plain_bytes


def test_replica_groups_in_every_form():
    assert traffic.replica_groups("x, replica_groups={{0,1},{2,3}}, y", 4) == [[0, 1], [2, 3]]
    assert traffic.replica_groups("replica_groups=[2,2]<=[4]", 4) == [[0, 1], [2, 3]]
    assert traffic.replica_groups("replica_groups=[2,2]<=[2,2]T(1,0)", 4) == [[0, 2], [1, 3]]
    assert traffic.replica_groups("no groups", 3) == [[0, 1, 2]]


def _config(tmp_path, slices: int, steps: int = 4):
    # Dense PPCL: run on fake CPU devices, the ring's independent collectives (its texts' permute,
    # the gradients' all-reduce) can deadlock XLA:CPU under load (docs/performance.md, "Test
    # suite time"); its loss over slices is tested on its own above and compiled into the step below.
    return tiny_config(tmp_path, **{"data.source": "random", "total_steps": steps, "checkpoint_steps": 2,
                                    "mesh.dcn_shape": (slices, 1, 1)})


def test_two_slices_train_as_one_and_resume_across(two_slices, tmp_path):
    """Steps 1-2 on 2 slices, step 3 on 1 (resumed), step 4 on 2 again == 4 steps on 1 slice
    straight: the loss over the global batch and so the parameters, to float32 rounding."""
    train.train(_config(tmp_path, 1), str(tmp_path / "one"))
    w = str(tmp_path / "elastic")
    for slices, stop in ((2, 2), (1, 3), (2, None)):
        train.train(_config(tmp_path, slices), w, stop_at_step=stop)
    ref, _, _ = checkpoint.load_params(tmp_path / "one" / "checkpoints")
    params, _, step = checkpoint.load_params(tmp_path / "elastic" / "checkpoints")
    assert step == 4
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(ref)):
        if "key_bias" in jax.tree_util.keystr(path):  # zero true gradient: see test_step.py
            continue
        x, y = np.asarray(x), np.asarray(y)
        assert np.abs(x - y).max() <= 1e-5 * max(np.abs(y).max(), 1e-12), jax.tree_util.keystr(path)


def test_fsdp_stays_in_a_slice_and_the_gradient_crosses_once(two_slices, uncached):
    """The compiled train step on 2 slices x (data 2, fsdp 2), FSDP rules: the parameters'
    gathers and reduce-scatters stay in a slice; what crosses is the gradient's all-reduce
    (2 (S - 1) x the parameters' bytes, S = 2; XLA:CPU all-reduces the whole gradient in each
    FSDP group, so up to 2x that here), the loss's text blocks, and two activation
    gathers XLA lays over the whole batch (the token embedding's scatter-add backward and the
    masked rows', 12 KB here: far below one copy of the parameters, which a parameter gather
    would move)."""
    import compile_tpu as ct

    config = ct.load_config(str(ROOT / "configs" / "tiny.py") + ":data=random,size=micro",
                            ["--config.mesh.shape=(-1,2,1)", "--config.mesh.dcn_shape=(2,1,1)",
                             "--config.sharding_rules=fsdp", "--config.loss.ppcl_impl=ring"])
    jitted, args, facts = ct.build_step(config, jax.devices()[:8])
    mesh = args[1]["image"].sharding.mesh
    assert sharding.mesh_slices(mesh) == 2 and dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}
    t = traffic.program_traffic(jitted.lower(*args).compile(), mesh)
    param_bytes = 4 * facts["params"]
    assert t.by_kind["reduce-scatter"] == t.by_kind["all-to-all"] == 0, t
    assert t.by_kind["all-gather"] < param_bytes / 10, (t, param_bytes)
    assert 2 * param_bytes <= t.by_kind["all-reduce"] <= 2 * 2 * param_bytes * 1.02 + 4096, (t, param_bytes)
    assert t.by_kind["collective-permute"] == 2 * 8 * 2 * (32 + 1) * 4  # the ring's: 2 rows a position


def test_a_parameter_that_does_not_divide_over_its_axes_is_one_line(two_slices):
    import flax.linen as nn

    mesh = sharding.make_mesh((-1, 4, 1), ("data", "fsdp", "tensor"), dcn_shape=(2, 1, 1))
    boxed = {"tower": {"w": nn.LogicallyPartitioned(jax.ShapeDtypeStruct((1152, 8), jnp.float32), ("embed", None))}}
    sharding.check_divisible(boxed, mesh, "replicated")  # nothing split
    boxed["tower"]["w"] = nn.LogicallyPartitioned(jax.ShapeDtypeStruct((1154, 8), jnp.float32), ("embed", None))
    with pytest.raises(ValueError, match=r"parameter tower/w \(1154, 8\): its dimension 1154 does not divide over "
                                         r"mesh axes fsdp \(4 devices\); change config.mesh.shape"):
        sharding.check_divisible(boxed, mesh, "fsdp")
