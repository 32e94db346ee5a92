"""Analytic FLOPs of a ProLIP training step, peak FLOP/s per device kind, and MFU.

What is counted (the usual MFU convention, PaLM appendix B / MaxText): matrix-multiply FLOPs
only, 2*m*n*k per [m, k] @ [k, n]; LayerNorm, GELU, softmax, residual adds, the losses'
elementwise terms and the text embedding lookup (a gather) count 0. Rematerialisation does not
add FLOPs here: this is model FLOPs, not hardware FLOPs.

One tower forward on `b` samples, `t` tokens, width `d`, MLP width `m`, `L` blocks, output E:

    per block      qkv 3*2btd^2 + scores 2bt^2d + weighted sum 2bt^2d + out 2btd^2 + MLP 2*2btdm
    vision extra   patch embedding 2*b*N*(3p^2)*d  (on all N patches, even in the masked
                   forward: `vit.py` embeds every patch, then gathers the kept ones)
                   + proj 2bdE + uncertainty_proj 2bdE
    text extra     text_projection 2bdE + text_uncertainty_projection 2bE^2

Tokens: vision t = N + 2 ([CLS], [UNC]); masked vision t = int(N * keep_ratio) + 2; text
t = L_text + 2 ([UNC], [CLS]), the masked text forward keeps the full length (masked tokens
are replaced in place, naver-ai/prolip src/prolip_train/train.py). The other papers' heads (models/heads.py) are counted
the same way: PCME++'s duplicated blocks, its projections on every token and GPO's BiGRU and
pooling, Pishdad et al.'s second projection; μ-only towers drop the uncertainty matmuls.

A training step on global batch B with M = int(B * masked_fraction) masked samples:

    3 * (forward(B) + masked_forward(M) + 2*B*B*E)

the last term being the PPCL logits mu_img @ mu_txt^T; x3 because the backward pass costs two
matmuls per forward matmul (gradients w.r.t. the input and w.r.t. the weight).
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from prolip_jax.core.models.config import ProLIPConfig, TextConfig, VisionConfig


# --------------------------------------------------------------------------- per-component counts
def block_flops(batch: int, tokens: int, width: int, mlp_dim: int) -> dict[str, float]:
    """Matmul FLOPs of one pre-norm residual block (forward) by component.

    heads * head_dim == width, so the per-head attention matmuls sum to the width.
    """
    b, t, d, m = batch, tokens, width, mlp_dim
    return {
        "qkv": 3 * 2.0 * b * t * d * d,
        "attn_scores": 2.0 * b * t * t * d,   # q @ k^T, all heads
        "attn_values": 2.0 * b * t * t * d,   # softmax(scores) @ v
        "attn_out": 2.0 * b * t * d * d,
        "mlp": 2 * 2.0 * b * t * d * m,       # c_fc and c_proj
    }


def gpo_flops(batch: int, tokens: int, features: int, dim: int) -> float:
    """GPO pooling (models/heads.py): a BiGRU of hidden `dim` over the positional encodings of
    `tokens` positions (input and recurrent matmuls, 3 gates, both directions), its score
    Linear(dim, 1), and the weighted sum of the sorted [tokens, features]."""
    b, k, h = batch, tokens, dim
    gru = 2 * (2.0 * b * k * h * 3 * h + k * 2.0 * b * h * 3 * h)  # x W_ih over all steps, h W_hh per step
    return gru + 2.0 * b * k * h + 2.0 * b * k * features


def _unc_out(c: VisionConfig | TextConfig, embed_dim: int) -> int:
    return 1 if c.covariance == "spherical" else embed_dim  # spherical: one variance per input


def _pooling_and_heads(c: VisionConfig | TextConfig, embed_dim: int, batch: int, tokens: int,
                       proj: bool) -> dict[str, float]:
    """What follows the trunk: the extra blocks of the block head, pooling, the projections."""
    b, d = batch, c.width
    out: dict[str, float] = {}
    if c.embed_unc and c.unc_head == "block":  # PCME++: the last unc_layers blocks duplicated
        out["unc_blocks"] = c.unc_layers * sum(block_flops(b, tokens, d, c.mlp_dim).values())
    e_mu = embed_dim if proj else d
    if c.pool == "gpo":  # projections on every token, then GPO per branch
        out["proj"] = 2.0 * b * tokens * d * embed_dim if proj else 0.0
        out["gpo"] = gpo_flops(b, tokens, e_mu, c.gpo_dim)
        if c.embed_unc:
            out["unc_projection"] = 2.0 * b * tokens * d * _unc_out(c, embed_dim)
            out["unc_gpo"] = gpo_flops(b, tokens, embed_dim, c.gpo_dim)
        return out
    if getattr(c, "pool", "") == "map":  # SigLIP's attention pooling: one probe query over all tokens
        out["map_head"] = (2.0 * b * d * d + 2 * 2.0 * b * tokens * d * d + 2 * 2.0 * b * tokens * d
                           + 2.0 * b * d * d + 2 * 2.0 * b * d * c.mlp_dim)
    out["proj"] = 2.0 * b * d * embed_dim if proj else 0.0
    if c.embed_unc and c.unc_head != "unc_token":  # its own Linear(width, E) on one pooled token
        out["unc_projection"] = 2.0 * b * d * _unc_out(c, embed_dim)
    return out


def vision_tokens(c: VisionConfig, keep_ratio: float | None = None) -> int:
    """Tokens through the vision blocks: the kept patches ([CLS], [UNC] besides); None keeps all."""
    kept = c.num_patches if keep_ratio is None else int(c.num_patches * keep_ratio)
    return kept + int(c.class_token) + int(c.unc_token)


def text_tokens(c: TextConfig, length: int | None = None) -> int:
    """Tokens through the text blocks: `length` (default context_length), ProLIP's [UNC], [CLS] besides."""
    return (c.context_length if length is None else length) + 2 * (c.pool == "prolip")


def vision_forward_flops(config: VisionConfig, embed_dim: int, batch: int,
                         keep_ratio: float | None = None) -> dict[str, float]:
    """Vision tower forward on `batch` images; keep_ratio=None is the full (unmasked) forward."""
    c = config
    tokens = vision_tokens(c, keep_ratio)
    out = {
        "patch_embed": 2.0 * batch * c.num_patches * (3 * c.patch_size ** 2) * c.width,
        "blocks": c.layers * sum(block_flops(batch, tokens, c.width, c.mlp_dim).values()),
        **_pooling_and_heads(c, embed_dim, batch, tokens, c.proj),
    }
    if c.unc_token:
        out["uncertainty_proj"] = 2.0 * batch * c.width * _unc_out(c, embed_dim)
    return out


def text_forward_flops(config: TextConfig, embed_dim: int, batch: int,
                       length: int | None = None) -> dict[str, float]:
    """Text tower forward on `batch` sequences of `length` tokens (default context_length)."""
    c = config
    tokens = text_tokens(c, length)
    out = {
        "embedding": 0.0,  # a gather, no multiply-adds
        "blocks": c.layers * sum(block_flops(batch, tokens, c.width, c.mlp_dim).values()),
        **_pooling_and_heads(c, embed_dim, batch, tokens, True),
    }
    out["text_projection"] = out.pop("proj")
    if c.pool == "prolip":
        # Applied to the projected [CLS] embedding (naver-ai/prolip src/prolip/transformer.py TextTransformer): E -> E.
        out["text_uncertainty_projection"] = 2.0 * batch * embed_dim * _unc_out(c, embed_dim)
    return out


# ------------------------------------------------------------------------------- model and step
def forward_flops(config: ProLIPConfig, batch: int, text_length: int | None = None,
                  image_keep_ratio: float | None = None) -> float:
    """Matmul FLOPs of one two-tower forward (`ProLIP.__call__`) on `batch` image-text pairs."""
    v = vision_forward_flops(config.vision, config.embed_dim, batch, image_keep_ratio)
    t = text_forward_flops(config.text, config.embed_dim, batch, text_length)
    return sum(v.values()) + sum(t.values())


def train_step_flops(config: ProLIPConfig, global_batch: int, masked_fraction: float = 0.125,
                     image_keep_ratio: float = 0.75, text_length: int | None = None,
                     num_masked: int | None = None, locked_towers: tuple[str, ...] = ()) -> float:
    """FLOPs of one optimizer step on `global_batch` pairs (all devices together).

    num_masked overrides int(global_batch * masked_fraction) when the trainer rounds per shard.
    locked_towers: towers ("visual", "text") whose parameters are all locked (`optim.locked`):
    nothing upstream of their output is differentiated, so their forward counts once, not x3.
    """
    if num_masked is None:
        num_masked = int(global_batch * masked_fraction)
    times = {tower: 1.0 if tower in locked_towers else 3.0 for tower in ("visual", "text")}

    def both_towers(batch: int, keep_ratio: float | None) -> float:
        v = vision_forward_flops(config.vision, config.embed_dim, batch, keep_ratio)
        t = text_forward_flops(config.text, config.embed_dim, batch, text_length)
        return times["visual"] * sum(v.values()) + times["text"] * sum(t.values())

    total = both_towers(global_batch, None)
    if num_masked > 0:
        total += both_towers(num_masked, image_keep_ratio)
    # PPCL logits [B, B]: the forward matmul plus one gradient matmul per differentiated side.
    logit_times = 1.0 + sum(tower not in locked_towers for tower in ("visual", "text"))
    return total + logit_times * 2.0 * global_batch * global_batch * config.embed_dim


# The share of each block matmul (block_flops' components) a remat policy (models/transformer.py
# REMAT_POLICIES) runs a second time in the backward: "dots_no_batch" saves the dots without batch
# dimensions and recomputes the attention's per-example dots; "full" saves nothing, yet the
# backward never needs the output of the block's last matmul (c_proj: only its input and weight,
# the block's output is the next block's saved input), so that one is not run again; "dots"
# saves every dot.
RECOMPUTED = {"none": {}, "dots": {}, "dots_no_batch": {"attn_scores": 1.0, "attn_values": 1.0},
              "full": {"qkv": 1.0, "attn_scores": 1.0, "attn_values": 1.0, "attn_out": 1.0,
                       "mlp": 0.5}}  # mlp: c_fc of c_fc and c_proj


def recompute_flops(config: ProLIPConfig, global_batch: int, remat: str, masked_fraction: float = 0.125,
                    image_keep_ratio: float = 0.75, text_length: int | None = None,
                    num_masked: int | None = None, locked_towers: tuple[str, ...] = ()) -> float:
    """The matmul FLOPs rematerialisation adds to `train_step_flops` (which, like MFU, counts
    none): the trunk blocks' forward matmuls `RECOMPUTED[remat]` names once more, in the full
    and the masked forward of every tower that is differentiated."""
    if num_masked is None:
        num_masked = int(global_batch * masked_fraction)
    again = RECOMPUTED[remat]

    def tower(c, batch: int, tokens: int) -> float:
        return c.layers * sum(again.get(k, 0.0) * v for k, v in block_flops(batch, tokens, c.width, c.mlp_dim).items())

    def both(batch: int, keep_ratio: float | None) -> float:
        v, t = config.vision, config.text
        total = 0.0
        if "visual" not in locked_towers:
            total += tower(v, batch, vision_tokens(v, keep_ratio))
        if "text" not in locked_towers:
            total += tower(t, batch, text_tokens(t, text_length))
        return total

    return both(global_batch, None) + (both(num_masked, image_keep_ratio) if num_masked > 0 else 0.0)


# ------------------------------------------------------------------------------- peaks and MFU
# Dense (no sparsity) peak matmul FLOP/s per chip from vendor datasheets, keyed by a lower-case
# substring of `jax.devices()[0].device_kind`; the first match wins, so specific keys go first.
# Columns: 16-bit (bf16/fp16), float32. NVIDIA float32 is the TF32 tensor-core peak, because
# XLA:GPU's default matmul precision runs f32 dots in TF32 on Ampere and later. On TPU the
# default precision runs f32 matmuls as one bf16 pass, so the bf16 peak is used for both.
_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("h100 pcie", 756e12, 378e12),
    ("h100 nvl", 835e12, 418e12),
    ("h100", 989e12, 494e12),      # SXM: "NVIDIA H100 80GB HBM3"
    ("h200", 989e12, 494e12),      # "NVIDIA H200", also matches "NVIDIA GH200 480GB"
    ("a100", 312e12, 156e12),      # "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe", ...
    ("tpu v6 lite", 918e12, 918e12),  # v6e (Trillium)
    ("tpu v5 lite", 197e12, 197e12),  # v5e
    ("tpu v5p", 459e12, 459e12),
    ("tpu v5", 459e12, 459e12),    # v5p reports "TPU v5" on some runtimes
    ("tpu v4", 275e12, 275e12),
    ("tpu v3", 123e12, 123e12),
)


def peak_flops_per_device(device_kind: str, dtype: Any) -> float | None:
    """Peak dense matmul FLOP/s of one device for compute `dtype`, or None if unknown (CPU).

    device_kind as JAX reports it, e.g. "NVIDIA H100 80GB HBM3", "TPU v5 lite", "cpu".
    """
    name = jnp.dtype(dtype).name
    if name in ("bfloat16", "float16"):
        column = 1
    elif name == "float32":
        column = 2
    else:
        return None
    kind = device_kind.lower()
    for key, *peaks in _PEAKS:
        if key in kind:
            return peaks[column - 1]
    return None


def tflops_per_device(flops_per_step: float, step_time_s: float, n_devices: int) -> float:
    """Achieved TFLOP/s per device (model FLOPs, see the module docstring)."""
    return flops_per_step / (step_time_s * n_devices) / 1e12


def mfu(flops_per_step: float, step_time_s: float, n_devices: int, device_kind: str,
        dtype: Any) -> float | None:
    """Model FLOPs utilisation in [0, 1]: achieved FLOP/s over the devices' peak; None if unknown."""
    peak = peak_flops_per_device(device_kind, dtype)
    if peak is None or step_time_s <= 0:
        return None
    return flops_per_step / (step_time_s * n_devices * peak)
