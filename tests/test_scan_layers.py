"""Scanned blocks (config.model.scan_layers): the same model as the unrolled one, and checkpoints,
exports and warm starts that take and give either parameter layout (models/layout.py).

Tolerance: outputs and gradients of the scanned model equal the unrolled model's to float32
rounding: |scanned - unrolled| <= 1e-5 x |unrolled| + 1e-6 x (the largest gradient of the model)
per element. The absolute term is for the attention *key* biases: softmax is invariant to them,
so their true gradient is exactly zero and both models give rounding noise (~1e-8 against
gradients of ~1e2). Layout conversions and restores are exact.
"""
from __future__ import annotations

import dataclasses
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from configs import tiny as tiny_config
from prolip_jax.core import checkpoint, optim, sharding
from prolip_jax.core import convert
from prolip_jax.core import step as S
from prolip_jax.trainer import build as trainer_build, config as trainer_config, state as trainer_state
from prolip_jax.core.models import ProLIP, abstract_params, get_config
from prolip_jax.core.models.layout import layout_of, to_layout
from prolip_jax.core.models.transformer import REMAT_POLICIES
from prolip_jax.core.objectives import prolip as prolip_objective
from prolip_jax.core.pretrained import warm_start


def assert_tree_close(scanned, unrolled, rtol=1e-5, atol_frac=1e-6):
    scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(unrolled))
    assert jax.tree.structure(scanned) == jax.tree.structure(unrolled)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(scanned), jax.tree.leaves(unrolled)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=atol_frac * scale,
                                   err_msg=jax.tree_util.keystr(path))


def assert_tree_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def inputs(golden_config):
    rng = np.random.default_rng(0)
    s, v = golden_config.vision.image_size, golden_config.vision
    images = rng.normal(size=(3, s, s, 3)).astype(np.float32)
    tokens = rng.integers(2, golden_config.text.vocab_size, size=(3, golden_config.text.context_length)).astype(np.int32)
    keep = np.sort(rng.permutation(v.num_patches)[: v.num_patches // 2]).astype(np.int32)
    return images, tokens, keep


def loss_and_grads(model, params, images, tokens, keep):
    """Every output of the full forward and of the masked image forward (`image_keep_idx`), and
    the gradient of a scalar that depends on all of them."""
    def loss(p):
        out = model.apply({"params": p}, images, tokens)
        masked = model.apply({"params": p}, images, None, image_keep_idx=keep)
        out = {**out, **{f"masked_{k}": v for k, v in masked.items()}}
        return sum(jnp.sum(jnp.sin(v)) for v in out.values()), out

    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.fixture(scope="module")
def unrolled(golden_config, golden_params, inputs):
    return loss_and_grads(ProLIP(golden_config, attention_impl="xla"), golden_params, *inputs)


@pytest.mark.parametrize("remat", sorted(REMAT_POLICIES))
def test_scanned_model_equals_unrolled(golden_config, golden_params, inputs, unrolled, remat):
    """The golden fixture's model, scanned under each remat policy, against the unrolled one."""
    (loss_u, out_u), grads_u = unrolled
    model = ProLIP(golden_config, attention_impl="xla", remat=remat, scan_layers=True)
    (loss_s, out_s), grads_s = loss_and_grads(model, to_layout(golden_params, True), *inputs)
    assert_tree_close(out_s, out_u)
    assert layout_of(grads_s) is True
    assert_tree_close(to_layout(grads_s, False), grads_u)
    assert float(loss_s) == pytest.approx(float(loss_u), rel=1e-6)


def test_scanned_init_and_fork(inputs):
    """The scanned model's own parameters (stacked, `layers` first) and PCME++'s split stream (the
    duplicated last block forks off inside the scan) on a causal text tower."""
    cfg = get_config("tiny_pcmepp")
    model = ProLIP(cfg, attention_impl="xla")
    shapes_u, shapes_s = abstract_params(cfg), abstract_params(cfg, scan_layers=True)
    assert jax.tree.map(lambda a: a.shape, to_layout(shapes_s, False)) == jax.tree.map(lambda a: a.shape, shapes_u)
    assert shapes_s["visual"]["transformer"]["resblocks"]["ln_1"]["scale"].shape == (cfg.vision.layers, cfg.vision.width)
    assert shapes_s["text"]["unc_transformer"]["resblocks"]["c_fc"]["kernel"].shape[0] == 1
    boxed = jax.eval_shape(lambda: model.clone(scan_layers=True).init(jax.random.key(0), *inputs[:2])["params"])
    assert nn_spec(boxed)["visual"]["transformer"]["resblocks"]["c_fc"]["kernel"] == ("layers", "embed", "mlp")
    assert ("layers", None) in sharding.resolve_rules("fsdp")
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda a: (0.05 * rng.normal(size=a.shape)).astype(np.float32), shapes_u)
    images, tokens, _ = inputs
    out_u = jax.jit(model.apply)({"params": params}, images, tokens)
    out_s = jax.jit(model.clone(scan_layers=True).apply)({"params": to_layout(params, True)}, images, tokens)
    assert_tree_close(out_s, out_u)


@pytest.mark.parametrize("variant", ["B/16", "tiny_pcmepp", "tiny_pishdad"])
def test_deep_abstract_params_are_the_unrolled_trace(variant):
    """`abstract_params` traces a deep model scanned and unrolls the shapes: the same tree as the
    unrolled trace, key order included (the heads' forks and duplicated blocks at depth 6)."""
    from flax import traverse_util
    from prolip_jax.core.models.prolip import SCAN_TRACE_MIN_LAYERS, dummy_inputs

    cfg = get_config(variant)
    deep = max(SCAN_TRACE_MIN_LAYERS, 6)
    cfg = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, layers=max(cfg.vision.layers, deep)),
                              text=dataclasses.replace(cfg.text, layers=max(cfg.text.layers, deep)))
    unrolled = jax.eval_shape(lambda r: nn.unbox(ProLIP(cfg).init(r, *dummy_inputs(cfg)))["params"], jax.random.key(0))
    got, want = traverse_util.flatten_dict(abstract_params(cfg)), traverse_util.flatten_dict(unrolled)
    assert list(got) == list(want)
    assert all((got[k].shape, got[k].dtype) == (want[k].shape, want[k].dtype) for k in want)


def nn_spec(boxed):
    return jax.tree.map(lambda b: tuple(b.names), boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))


# ------------------------------------------------------------------------------ train steps
B = 8
MICRO2 = get_config("micro", vision={"layers": 2}, text={"layers": 2})
OPTIM = dict(lr=1e-3, warmup_steps=2, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.2)
STEP_CFG = S.StepConfig(masking=S.MaskingConfig(fraction=0.25, group=4, mask_token_id=63),
                        loss=prolip_objective.Config(alpha_image_text=1e-3))


@pytest.fixture(scope="module")
def steps_setup():
    model = ProLIP(MICRO2, attention_impl="xla")
    tx, schedule = optim.make_optimizer(optim.OptimConfig.of(OPTIM), 10)
    mesh = sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1])
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(B, 16, 16, 3)).astype(np.float32),
             "text": rng.integers(2, 64, size=(B, 8)).astype(np.int32)}
    batch = sharding.global_batch(batch, mesh)
    state, _ = S.create_train_state(model, tx, mesh, "replicated", seed=0)
    runs = {}
    for scan in (False, True):
        m = model.clone(scan_layers=scan)
        step = jax.jit(S.make_train_step(m, tx, schedule, STEP_CFG, mesh, B))
        s = state.replace(params=to_layout(state.params, scan), opt_state=to_layout(state.opt_state, scan))
        for _ in range(3):
            s, metrics = step(s, batch)
        runs[scan] = jax.device_get((s, metrics))
    return model, tx, mesh, state, runs


def test_train_steps_equal(steps_setup):
    *_, runs = steps_setup
    (state_u, metrics_u), (state_s, metrics_s) = runs[False], runs[True]
    assert float(metrics_s["loss"]) == pytest.approx(float(metrics_u["loss"]), rel=1e-5)
    params_s = to_layout(state_s.params, False)
    # Adam turns the key biases' noise-sized gradients into +-lr steps: compared apart (see test_step.py).
    drop_key_bias = lambda t: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda p, x: np.zeros_like(x) if "key_bias" in jax.tree_util.keystr(p) else x, t)
    assert_tree_close(drop_key_bias(params_s), drop_key_bias(state_u.params))
    assert int(state_s.step) == int(state_u.step) == 3


def test_layout_round_trip_exact(golden_params):
    scanned = to_layout(golden_params, True)
    assert layout_of(golden_params) is False and layout_of(scanned) is True
    assert "resblocks_0" not in scanned["visual"]["transformer"]
    assert_tree_equal(to_layout(scanned, False), golden_params)
    assert_tree_equal(to_layout(scanned, True), scanned)  # already scanned: unchanged
    # Optimiser state with masked holes (a locked tower): moments convert with the params.
    cfg = optim.OptimConfig.of({**OPTIM, "locked": ("^visual/",)})
    tx, _ = optim.make_optimizer(cfg, 10, golden_params)
    opt = tx.init(jax.tree.map(jnp.asarray, golden_params))
    opt = jax.tree.map(lambda x: x + 1.5, opt)
    both = to_layout((golden_params, opt), True)
    tx_s, _ = optim.make_optimizer(cfg, 10, both[0])
    assert jax.tree.structure(both[1]) == jax.tree.structure(tx_s.init(both[0]))
    back = to_layout(both, False)
    assert_tree_equal(back[1], opt)


def test_export_and_import_either_layout(golden_config, golden_params, golden_state_dict):
    scanned = to_layout(golden_params, True)
    exported = convert.flax_to_torch(scanned, golden_config)
    reference = convert.flax_to_torch(golden_params, golden_config)
    assert sorted(exported) == sorted(reference)
    for k in reference:
        np.testing.assert_array_equal(exported[k], reference[k], err_msg=k)
    assert_tree_equal(convert.torch_to_flax(golden_state_dict, golden_config, scan_layers=True), scanned)


def test_warm_start_into_scanned_model(golden_config, golden_params):
    fresh = to_layout(jax.tree.map(np.asarray, abstract_zeros(golden_config)), True)
    check = abstract_params(golden_config, scan_layers=True)
    warm_start.check_fit(golden_config, check, golden_config, golden_params)
    params, report = warm_start.warm_start(golden_config, fresh, golden_config, golden_params, source="golden")
    assert layout_of(params) is True
    assert report.counts()["loaded"] == len(jax.tree.leaves(golden_params))
    assert_tree_equal(params, to_layout(golden_params, True))
    # ... and from a scanned source into an unrolled model.
    params_u, _ = warm_start.warm_start(golden_config, to_layout(fresh, False), golden_config, params)
    assert_tree_equal(params_u, golden_params)


def abstract_zeros(config):
    return jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params(config))


# ------------------------------------------------------------------------ checkpoint resume
class NoData:
    """A stand-in data iterator for the checkpoint's data item."""

    def get_state(self):
        return {"position": 3}

    def set_state(self, state):
        assert state == {"position": 3}


def test_checkpoint_resumes_across_layouts(steps_setup, tmp_path):
    """An unrolled train checkpoint resumes into a scanned model and a scanned one into an unrolled
    model (trainer_state.restore: params and Adam moments converted), exactly; load_params gives either."""
    model, tx, mesh, _, runs = steps_setup
    tc = types.SimpleNamespace(optim=optim.OptimConfig.of(OPTIM),
                               run=types.SimpleNamespace(total_steps=10, sharding_rules="replicated"))
    for saved_scan in (False, True):
        state = runs[saved_scan][0]
        directory = tmp_path / f"scan_{saved_scan}"
        meta = {"model": {"scan_layers": saved_scan}, "optim": dict(OPTIM)}
        with ocp.CheckpointManager(directory, item_names=checkpoint.TRAIN_ITEMS) as mngr:
            checkpoint.save_train_state(mngr, 3, jax.device_put(state), MICRO2, meta, NoData())
            mngr.wait_until_finished()
            target = model.clone(scan_layers=not saved_scan)
            traced = S.trace_params(target)
            shardings = S.state_shardings(traced.boxed, tx, mesh, "replicated")
            restored = trainer_state.restore(mngr, 3, target, tx, shardings, mesh, tc, traced, NoData())
        assert layout_of(restored.params) is (not saved_scan)
        assert_tree_equal(restored.params, to_layout(state.params, not saved_scan))
        assert_tree_equal(restored.opt_state, to_layout((state.params, state.opt_state), not saved_scan)[1])
        assert int(restored.step) == 3
        params, _, _ = checkpoint.load_params(directory)  # unrolled by default, whatever was saved
        assert_tree_equal(params, to_layout(state.params, False))
        params, _, _ = checkpoint.load_params(directory, scan_layers=True)
        assert_tree_equal(params, to_layout(state.params, True))


def test_validate_refuses_per_block_optimizers():
    config = trainer_config.with_defaults(tiny_config.get_config())
    config.model.scan_layers = True
    config.optim.layer_decay = 0.75
    tc = trainer_config.parse_config(config)
    with pytest.raises(ValueError, match="scan_layers=False"):
        trainer_build.validate(tc, sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1]),
                       trainer_build.model_config(tc))


@pytest.mark.parametrize("fork_after", [0, 1, 2])
def test_encoder_fork_points(fork_after):
    """The stream after block fork_after - 1 (the input itself for 0: unc_layers == layers)."""
    from prolip_jax.core.models.transformer import Encoder, block_init

    enc = Encoder(2, 2, 32, 1e-5, "gelu", block_init(16, 2, 32, "torch"), attention_impl="xla")
    x = np.random.default_rng(2).normal(size=(2, 5, 16)).astype(np.float32)
    # (the field `init` shadows Module.init on an Encoder)
    params = nn.unbox(nn.Module.init(enc, jax.random.key(0), x, fork_after=fork_after)["params"])
    out_u, fork_u = enc.apply({"params": params}, x, fork_after=fork_after)
    out_s, fork_s = enc.clone(scan=True).apply({"params": to_layout(params, True)}, x, fork_after=fork_after)
    assert_tree_close((out_s, fork_s), (out_u, fork_u))
    if fork_after == 0:
        np.testing.assert_array_equal(np.asarray(fork_s), x)
    if fork_after == 2:
        np.testing.assert_array_equal(np.asarray(fork_u), np.asarray(out_u))
