"""The step's speed levers compute the step they replace (issue: faster than PyTorch on a GPU).

Each lever runs three real train steps of the micro model from the same state and is compared
with the default step:
- `model.flat_tokens` (the blocks on [B*T, D] matrices), `model.ln_saved_stats` (the LayerNorms'
  backward reads the forward's statistics), `model.pallas_kernels` (LayerNorm and bias + GELU as
  Pallas kernels, interpreted on the CPU; each kernel alone: tests/test_kernels.py) and
  `step.finite_guard="fused"`: the same arithmetic
  in another layout or order, so loss and parameters agree to float32 rounding (relative 1e-5,
  the sharded-step tolerance of tests/test_step.py);
- `step.cast_params_once` in float32 compute is the identity (bit-identical), and in bfloat16
  the loss after three steps agrees to bfloat16 rounding (relative 1e-2): the two forwards'
  weight gradients then add in bfloat16 (step.StepOptions).
The fused guard also still catches what the per-leaf one catches.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from prolip_jax.core import optim, sharding
from prolip_jax.core import step as S
from prolip_jax.core.models import ProLIP, get_config
from prolip_jax.core.models.transformer import BlockLevers
from prolip_jax.core.objectives import prolip as prolip_objective

B = 16
CFG = S.StepConfig(masking=S.MaskingConfig(fraction=0.5, group=4, mask_token_id=63),
                   loss=prolip_objective.Config(alpha_image_text=1e-3))


@pytest.fixture(scope="module")
def batch():
    rng = np.random.default_rng(0)
    b = {"image": rng.normal(size=(B, 16, 16, 3)).astype(np.float32),
         "text": rng.integers(2, 64, size=(B, 8)).astype(np.int32)}
    b["text"][:, 5:] = 1
    return b


def train(batch, dtype=jnp.float32, levers=BlockLevers(), steps=3, **options):
    model = ProLIP(get_config("micro"), dtype=dtype, attention_impl="xla", levers=levers)
    tx, schedule = optim.make_optimizer(optim.OptimConfig.of(dict(lr=1e-3, warmup_steps=1)), 10)
    mesh = sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1])
    state, _ = S.create_train_state(model, tx, mesh, "replicated", seed=0)
    cfg = dataclasses.replace(CFG, options=S.StepOptions(**options))
    step = jax.jit(S.make_train_step(model, tx, schedule, cfg, mesh, B))
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return jax.device_get(state), losses


@pytest.fixture(scope="module")
def default_f32(batch):
    return train(batch)


def rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / max(np.abs(b).max(), 1e-12))


def test_layout_levers_give_the_default_step(batch, default_f32):
    """The four together in one step (a training per lever costs ~10 CPU s of compiling here)."""
    ref_state, ref_losses = default_f32
    state, losses = train(batch, levers=BlockLevers(flat_tokens=True, ln_saved_stats=True, pallas_kernels=True),
                          finite_guard="fused")
    assert np.allclose(losses, ref_losses, rtol=1e-5, atol=0)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(ref_state.params)):
        if "key_bias" in jax.tree_util.keystr(path):  # softmax-invariant: its gradient is rounding noise
            continue
        assert rel(a, b) <= 1e-5, jax.tree_util.keystr(path)
    assert int(state.skipped) == 0 and int(state.step) == 3


def test_cast_params_once_is_the_identity_in_float32(batch, default_f32):
    state, losses = train(batch, cast_params_once=True)
    assert losses == default_f32[1]
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(default_f32[0].params)):
        np.testing.assert_array_equal(a, b)


def test_cast_params_once_in_bfloat16(batch):
    _, ref = train(batch, dtype=jnp.bfloat16)
    _, losses = train(batch, dtype=jnp.bfloat16, cast_params_once=True)
    assert np.allclose(losses, ref, rtol=1e-2, atol=0)


def test_compute_copy_casts_only_kernels():
    params = {"attn": {"query_kernel": jnp.ones((4, 2, 2)), "query_bias": jnp.ones((2, 2))},
              "ln_1": {"scale": jnp.ones(4)}, "logit_scale": jnp.zeros(())}
    out = S.compute_copy(params, jnp.bfloat16)
    assert out["attn"]["query_kernel"].dtype == jnp.bfloat16
    assert {out["attn"]["query_bias"].dtype, out["ln_1"]["scale"].dtype, out["logit_scale"].dtype} == {jnp.dtype("float32")}


@pytest.mark.parametrize("fused", [False, True])
def test_finite_guard(fused):
    big = jnp.full((3,), 3e38, jnp.float32)  # finite, but their plain sum overflows
    assert bool(S.all_finite({"a": big, "b": jnp.arange(3)}, fused))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        tree = {"a": big, "b": jnp.ones((2, 2), jnp.bfloat16).at[1, 0].set(bad)}
        assert not bool(S.all_finite(tree, fused))
    assert bool(S.all_finite({"i": jnp.arange(2)}, fused))


def test_step_options_come_from_the_config():
    from prolip_jax.trainer.build import build_model, model_config, step_config
    from prolip_jax.trainer.config import parse_config

    config = ml_collections.ConfigDict({"total_steps": 10, "batch_size": 8,
                                        "step": {"finite_guard": "fused", "cast_params_once": True},
                                        "model": {"flat_tokens": True, "ln_saved_stats": True}})
    tc = parse_config(config)
    assert step_config(tc).options == S.StepOptions(cast_params_once=True, finite_guard="fused")
    assert build_model(tc, model_config(tc)).levers == BlockLevers(flat_tokens=True, ln_saved_stats=True)
    config.step.finite_guard = "fast"
    with pytest.raises(ValueError, match="finite_guard"):
        parse_config(config)


def test_nonfinite_step_is_skipped_with_the_fused_guard(batch):
    """A NaN learning rate makes every update NaN: the fused guard keeps the old state."""
    model = ProLIP(get_config("micro"), attention_impl="xla")
    tx = optax.adamw(lambda _: jnp.nan)
    mesh = sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1])
    state, _ = S.create_train_state(model, tx, mesh, "replicated", seed=0)
    cfg = dataclasses.replace(CFG, options=S.StepOptions(finite_guard="fused"))
    step = jax.jit(S.make_train_step(model, tx, lambda _: jnp.nan, cfg, mesh, B))
    new, metrics = step(state, batch)
    assert int(new.skipped) == 1 and int(metrics["nonfinite"]) == 1
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(a, b)
