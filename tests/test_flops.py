"""Analytic FLOP counts: hand-derived numbers, the model's own matmuls, XLA's cost analysis."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest

from prolip_jax.core import flops
from prolip_jax.core.objectives.prolip import Config, prolip_loss
from prolip_jax.core.models import get_config, with_overrides
from prolip_jax.core.models.prolip import ProLIP, abstract_params, dummy_inputs, random_keep_indices


# ------------------------------------------------------------------------- hand-derived numbers
# 'micro': embed E=32. Vision 16x16 image, patch 8 -> N=4 patches, width 32, 1 layer, MLP 128.
# Text context 8, width 32, 1 layer, MLP 128. Batch b=2.
#   vision t = 4+2 = 6: qkv 3*2*2*6*32*32 = 73728, scores = values 2*2*6*6*32 = 4608,
#     out 2*2*6*32*32 = 24576, MLP 2*2*2*6*32*128 = 196608 -> block 304128;
#     patch embedding 2*2*4*(3*8*8)*32 = 98304; proj = uncertainty_proj 2*2*32*32 = 4096.
#   text t = 8+2 = 10: qkv 122880, scores = values 12800, out 40960, MLP 327680 -> block 517120;
#     text_projection = text_uncertainty_projection 4096.
#   masked vision (keep 0.75 -> 3 patches, t = 5): qkv 61440, scores = values 3200, out 20480,
#     MLP 163840 -> block 252160, + patch embedding on all 4 patches 98304 + 8192.
MICRO_VISION = {"patch_embed": 98304, "blocks": 304128, "proj": 4096, "uncertainty_proj": 4096}
MICRO_TEXT = {"embedding": 0, "blocks": 517120, "text_projection": 4096,
              "text_uncertainty_projection": 4096}


def test_block_flops_by_hand():
    assert flops.block_flops(2, 6, 32, 128) == {
        "qkv": 73728, "attn_scores": 4608, "attn_values": 4608, "attn_out": 24576, "mlp": 196608}


def test_tower_flops_by_hand():
    cfg = get_config("micro")
    assert flops.vision_forward_flops(cfg.vision, cfg.embed_dim, 2) == MICRO_VISION
    assert flops.text_forward_flops(cfg.text, cfg.embed_dim, 2) == MICRO_TEXT
    masked = flops.vision_forward_flops(cfg.vision, cfg.embed_dim, 2, keep_ratio=0.75)
    assert masked == {"patch_embed": 98304, "blocks": 252160, "proj": 4096, "uncertainty_proj": 4096}
    assert flops.forward_flops(cfg, 2) == 410624 + 525312


def test_train_step_flops_by_hand():
    cfg = get_config("micro")
    # B = 8, M = int(8 * 0.25) = 2: forward(8) = 4 * 935936; masked forward(2) =
    # 358656 + 525312; PPCL logits 2*8*8*32 = 4096; times 3 for forward + backward.
    expected = 3 * (4 * 935936 + 358656 + 525312 + 4096)
    assert flops.train_step_flops(cfg, 8, masked_fraction=0.25) == expected == 13895424
    assert flops.train_step_flops(cfg, 8, num_masked=2) == expected
    assert flops.train_step_flops(cfg, 8, masked_fraction=0.0) == 3 * (4 * 935936 + 4096)


def test_b16_magnitude():
    # ViT-B/16 forward per image-text pair: about 2 * params * tokens -> ~35 GFLOP vision
    # (86M params x 198 tokens) + ~11 GFLOP text (85M non-embedding params x 66 tokens).
    cfg = get_config("B/16")
    per_pair = flops.forward_flops(cfg, 1)
    assert 44e9 < per_pair < 48e9
    # The paper's run: global batch 16,384 -> about 2.5 PFLOP per step.
    step = flops.train_step_flops(cfg, 16384)
    assert 2.3e15 < step < 2.6e15


# ----------------------------------------------------------------- the model's own matmuls
def _dot_flops(jaxpr) -> float:
    """Sum of 2 * (output size) * (contracted size) over every dot_general, sub-jaxprs included
    (of a cond, the costliest branch)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "cond":  # one branch runs: lax.platform_dependent's CPU/default forms
            total += max(_dot_flops(branch.jaxpr) for branch in eqn.params["branches"])
            continue
        if eqn.primitive.name == "dot_general":
            (lhs_contract, _), _ = eqn.params["dimension_numbers"]
            k = math.prod(eqn.invars[0].aval.shape[d] for d in lhs_contract)
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * k
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1  # GPO's BiGRU
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(inner, "eqns"):
                    total += times * _dot_flops(inner)
    return total


@pytest.fixture(scope="module")
def tiny():
    cfg = get_config("tiny")
    model = ProLIP(cfg, attention_impl="xla")
    return cfg, model, abstract_params(cfg)


def test_forward_matches_model_matmuls_exactly(tiny):
    cfg, model, params = tiny
    images, tokens = dummy_inputs(cfg, batch=3)
    keep = random_keep_indices(jax.random.key(0), cfg.vision.num_patches, 0.75)
    full = jax.make_jaxpr(lambda p: model.apply({"params": p}, images, tokens))(params)
    masked = jax.make_jaxpr(lambda p: model.apply({"params": p}, images, tokens, keep))(params)
    short = jax.make_jaxpr(lambda p: model.apply({"params": p}, images, tokens[:, :10]))(params)
    assert _dot_flops(full.jaxpr) == flops.forward_flops(cfg, 3)
    assert _dot_flops(masked.jaxpr) == flops.forward_flops(cfg, 3, image_keep_ratio=0.75)
    assert _dot_flops(short.jaxpr) == flops.forward_flops(cfg, 3, text_length=10)


def _clip_like(cfg):
    return with_overrides(cfg, vision={"embed_unc": False}, text={"embed_unc": False, "pool": "argmax",
                                                                 "causal": True, "proj_bias": False})


@pytest.mark.parametrize("name,build", [
    ("pcme++ heads (block, GPO)", lambda: get_config("tiny_pcmepp")),
    ("pishdad heads (embedding)", lambda: get_config("tiny_pishdad")),
    ("spherical covariance", lambda: get_config("tiny_pishdad", vision={"covariance": "spherical"},
                                                text={"covariance": "spherical"})),
    ("mu-only CLIP towers", lambda: _clip_like(get_config("tiny"))),
    ("SigLIP MAP pooling", lambda: with_overrides(_clip_like(get_config("tiny")), vision={
        "pool": "map", "class_token": False, "proj": False, "ln_pre": False, "patch_bias": True},
        embed_dim=64)),
])
def test_forward_of_other_heads_matches_model_matmuls_exactly(name, build):
    cfg = build()
    model = ProLIP(cfg, attention_impl="xla")
    images, tokens = dummy_inputs(cfg, batch=3)
    full = jax.make_jaxpr(lambda p: model.apply({"params": p}, images, tokens))(abstract_params(cfg))
    assert _dot_flops(full.jaxpr) == flops.forward_flops(cfg, 3), name


def test_train_step_matches_gradient_matmuls(tiny):
    """value_and_grad of the full loss (forward + masked forward) vs train_step_flops.

    The backward has two matmuls per forward matmul except where no input gradient is needed:
    the patch embedding (images are not differentiated). So the exact count is the analytic
    one minus one patch-embedding forward per image forward.
    """
    cfg, model, params = tiny
    b, m = 8, 2
    images, tokens = dummy_inputs(cfg, batch=b)
    keep = random_keep_indices(jax.random.key(0), cfg.vision.num_patches, 0.75)

    def loss_fn(p):
        out = model.apply({"params": p}, images, tokens)
        masked = model.apply({"params": p}, images[:m], tokens[:m], keep)
        return prolip_loss(out, masked, config=Config())[0]

    counted = _dot_flops(jax.make_jaxpr(jax.value_and_grad(loss_fn))(params).jaxpr)
    patch = lambda n: flops.vision_forward_flops(cfg.vision, cfg.embed_dim, n)["patch_embed"]  # noqa: E731
    assert counted == flops.train_step_flops(cfg, b, num_masked=m) - patch(b) - patch(m)


@pytest.mark.parametrize("remat", ["full", "dots_no_batch", "dots"])
def test_recomputed_matmuls_of_each_remat_policy(tiny, remat):
    """What a remat policy adds to the gradient's matmuls (the forward's part it computes again in
    the backward) is recompute_flops: exactly the jaxpr's count above the unrematerialised one."""
    cfg, _, params = tiny
    b, m = 8, 2
    images, tokens = dummy_inputs(cfg, batch=b)
    keep = random_keep_indices(jax.random.key(0), cfg.vision.num_patches, 0.75)

    def counted(model):
        def loss_fn(p):
            out = model.apply({"params": p}, images, tokens)
            masked = model.apply({"params": p}, images[:m], tokens[:m], keep)
            return prolip_loss(out, masked, config=Config())[0]
        return _dot_flops(jax.make_jaxpr(jax.value_and_grad(loss_fn))(params).jaxpr)

    extra = counted(ProLIP(cfg, attention_impl="xla", remat=remat)) - counted(ProLIP(cfg, attention_impl="xla"))
    assert extra == flops.recompute_flops(cfg, b, remat, num_masked=m)
    assert (extra > 0) == (remat != "dots")


def test_train_step_flops_with_a_locked_tower(tiny):
    """With the image tower locked (`optim.locked=("^visual/",)`, the step differentiates only
    the rest) the image tower and its patch embedding run forward only, and the PPCL logits
    get one gradient matmul instead of two: exactly the jaxpr's count."""
    cfg, model, params = tiny
    b, m = 8, 2
    images, tokens = dummy_inputs(cfg, batch=b)
    keep = random_keep_indices(jax.random.key(0), cfg.vision.num_patches, 0.75)

    def loss_fn(trainable, locked):
        p = {**trainable, **locked}
        out = model.apply({"params": p}, images, tokens)
        masked = model.apply({"params": p}, images[:m], tokens[:m], keep)
        return prolip_loss(out, masked, config=Config())[0]

    locked = {"visual": params["visual"]}
    trainable = {k: v for k, v in params.items() if k != "visual"}
    counted = _dot_flops(jax.make_jaxpr(jax.value_and_grad(loss_fn))(trainable, locked).jaxpr)
    assert counted == flops.train_step_flops(cfg, b, num_masked=m, locked_towers=("visual",))
    assert counted < flops.train_step_flops(cfg, b, num_masked=m)


# ------------------------------------------------------------------- XLA's own cost analysis
def test_forward_against_xla_cost_analysis(tiny):
    """XLA counts every op, elementwise ones included (LayerNorm, GELU, softmax, adds), so its
    count is at least the matmul-only one. Measured ratio for 'tiny' on CPU: 1.034 since GELU
    uses erf (one op in XLA's count; 1.175 with jax.nn.gelu's erfc expansion), 1.016 for B/16.
    The band fails if a tower's matmuls were overcounted at all or undercounted by ~20%."""
    cfg, model, params = tiny
    images, tokens = dummy_inputs(cfg, batch=4)
    compiled = jax.jit(lambda p, i, t: model.apply({"params": p}, i, t)).lower(params, images, tokens).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    ratio = cost["flops"] / flops.forward_flops(cfg, 4)
    assert 1.0 < ratio < 1.25, ratio


# -------------------------------------------------------------------------------- peaks, MFU
@pytest.mark.parametrize("kind,dtype,peak", [
    ("NVIDIA H100 80GB HBM3", jnp.bfloat16, 989e12),
    ("NVIDIA H100 80GB HBM3", jnp.float32, 494e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H200", jnp.bfloat16, 989e12),
    ("NVIDIA A100-SXM4-80GB", jnp.float16, 312e12),
    ("NVIDIA A100-SXM4-40GB", jnp.float32, 156e12),
    ("TPU v4", jnp.bfloat16, 275e12),
    ("TPU v5 lite", jnp.bfloat16, 197e12),
    ("TPU v5p", jnp.bfloat16, 459e12),
    ("TPU v5", jnp.bfloat16, 459e12),
    ("TPU v6 lite", jnp.bfloat16, 918e12),
    ("cpu", jnp.float32, None),
    ("NVIDIA H100 80GB HBM3", jnp.int8, None),
])
def test_peak_table(kind, dtype, peak):
    assert flops.peak_flops_per_device(kind, dtype) == peak


def test_mfu():
    # 8 H100s, 2.5 PFLOP per step in 0.5 s -> 625 TFLOP/s per device -> 63.2% of 989.
    assert flops.tflops_per_device(2.5e15, 0.5, 8) == pytest.approx(625.0)
    assert flops.mfu(2.5e15, 0.5, 8, "NVIDIA H100 80GB HBM3", jnp.bfloat16) == pytest.approx(625 / 989)
    assert flops.mfu(2.5e15, 0.5, 8, "cpu", jnp.float32) is None
