"""ProLIP: the two towers plus the learnable PPCL scale and bias (naver-ai/prolip src/prolip/model.py, §2.3).

Every input becomes N(mu, diag sigma^2): mu is L2-normalised here (as the reference's
`encode_*(normalize=True)`), log sigma^2 is returned raw. A tower configured without [UNC]
(`embed_unc=False`: the deterministic CLIP / SigLIP models) returns None for log sigma^2. `logit_scale` stores log a
(a = exp(logit_scale), init from the config: the paper's a = 10 by default) and
`logit_bias` stores b (init -10).

`train=True` turns on the training-only input/token augmentation the config asks for
(SizeAugment, `size_augment > 0`; models/heads.py), which draws from the flax rng stream
"augment": `model.apply(variables, images, tokens, train=True, rngs={"augment": key})`.
At the default train=False the forward is deterministic and needs no rng.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax.core import param_init
from prolip_jax.core.models.config import ProLIPConfig
from prolip_jax.core.models.layout import to_layout
from prolip_jax.core.models.text import TextTower
from prolip_jax.core.models.transformer import BlockLevers, constant
from prolip_jax.core.models.vit import VisionTower


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
    """torch.nn.functional.normalize: x / max(||x||, eps)."""
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


class ProLIP(nn.Module):
    config: ProLIPConfig
    dtype: Any = jnp.float32  # compute dtype; parameters stay float32
    attention_impl: str = "auto"  # 'auto' | 'xla' | 'cudnn'
    remat: str = "none"  # see transformer.REMAT_POLICIES
    scan_layers: bool = False  # each tower's blocks as one nn.scan (models/layout.py: the params' layout)
    levers: BlockLevers = BlockLevers()  # how the blocks compute: GPU speed levers (transformer.BlockLevers)

    def setup(self):
        c = self.config
        self.visual = VisionTower(c.vision, c.embed_dim, c.quick_gelu, self.dtype, self.attention_impl, self.remat,
                                  self.scan_layers, self.levers)
        self.text = TextTower(c.text, c.embed_dim, c.quick_gelu, self.dtype, self.attention_impl, self.remat,
                              self.scan_layers, self.levers)
        self.logit_scale = self.param(
            "logit_scale", nn.with_logical_partitioning(constant(c.init_logit_scale), ()), ())
        self.logit_bias = self.param(
            "logit_bias", nn.with_logical_partitioning(constant(c.init_logit_bias), ()), ())

    def encode_image(self, images: jax.Array, keep_idx: jax.Array | None = None, train: bool = False
                     ) -> tuple[jax.Array, jax.Array | None]:
        """images [B, H, W, 3] -> (mu [B, E] unit-norm, log sigma^2 [B, E] or None), float32."""
        mu, logvar = self.visual(images, keep_idx, train)
        return l2_normalize(mu), logvar

    def encode_text(self, tokens: jax.Array, train: bool = False) -> tuple[jax.Array, jax.Array | None]:
        """tokens int [B, L] -> (mu [B, E] unit-norm, log sigma^2 [B, E] or None), float32."""
        mu, logvar = self.text(tokens, train)
        return l2_normalize(mu), logvar

    def __call__(self, images: jax.Array | None, tokens: jax.Array | None,
                 image_keep_idx: jax.Array | None = None, train: bool = False) -> dict[str, jax.Array]:
        """Either modality may be None (its outputs are then absent), as in the reference.
        `*_logvar` is None for a mu-only tower (embed_unc=False). `train`: SizeAugment on
        (rng stream "augment"), see the module docstring."""
        out = {"logit_scale": jnp.exp(self.logit_scale), "logit_bias": self.logit_bias}
        if images is not None:
            out["image_mean"], out["image_logvar"] = self.encode_image(images, image_keep_idx, train)
        if tokens is not None:
            out["text_mean"], out["text_logvar"] = self.encode_text(tokens, train)
        return out


def init_params(config: ProLIPConfig, rng: jax.Array, **model_kw) -> dict:
    """Float32 parameters with logical-axis boxes removed (see `nn.unbox`), on the default device:
    `jax.jit(model.init)`'s values, drawn by prolip_jax/core/param_init.py (one small program per
    distinct draw, kept for the process, and no forward pass compiled); `jax.jit(model.init)`
    itself where param_init cannot follow the model (scanned blocks, remat), or under a trace
    (`jax.jit(init_params)`, `jax.eval_shape`: param_init draws concrete keys)."""
    model = ProLIP(config, **model_kw)
    images, tokens = dummy_inputs(config)
    draws, variables = (None, None) if isinstance(rng, jax.core.Tracer) else param_init.trace(model, images, tokens)
    if draws is not None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        params = param_init.draw_params(draws, rng, jax.tree.map(lambda _: device, nn.unbox(variables["params"])))
        if params is not None:
            return params
    # jit: op-by-op initialisation of even a tiny model takes seconds on CPU.
    return jax.jit(lambda r: nn.unbox(model.init(r, images, tokens))["params"])(rng)


def dummy_inputs(config: ProLIPConfig, batch: int = 1) -> tuple[jax.Array, jax.Array]:
    s = config.vision.image_size
    return (jnp.zeros((batch, s, s, 3), jnp.float32),
            jnp.ones((batch, config.text.context_length), jnp.int32))


def abstract_params(config: ProLIPConfig, scan_layers: bool = False) -> dict:
    """Parameter shapes/dtypes without allocating (for counting and shape checks), in the
    unrolled or the scanned layout (models/layout.py). A deep model is traced scanned either way,
    one block per tower whatever the depth (several times quicker for ViT-H/14; docs/performance.md),
    then unrolled by `to_layout`, its dicts' keys sorted as jax gives a traced tree's; up to
    SCAN_TRACE_MIN_LAYERS - 1 blocks the unrolled trace is the quicker (nn.scan's own tracing
    costs about what four small blocks do)."""
    if scan_layers or max(config.vision.layers, config.text.layers) < SCAN_TRACE_MIN_LAYERS:
        model = ProLIP(config, scan_layers=scan_layers)
        inputs = dummy_inputs(config)
        return jax.eval_shape(lambda r: nn.unbox(model.init(r, *inputs))["params"], jax.random.key(0))
    scanned = abstract_params(config, scan_layers=True)
    return jax.tree.map(lambda x: x, to_layout(scanned, False))


SCAN_TRACE_MIN_LAYERS = 5


def count_params(params: Any) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


# ----------------------------------------------------------------------------------------
# Masked inputs for the inclusion loss (naver-ai/prolip src/prolip_train/train.py).
# ----------------------------------------------------------------------------------------
def num_kept_patches(num_patches: int, keep_ratio: float) -> int:
    """The reference keeps `int(N * image_mask_ratio)` patches (0.75 is a *keep* ratio)."""
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    kept = int(num_patches * keep_ratio)
    if kept < 1:
        raise ValueError(f"keep_ratio {keep_ratio} keeps no patch out of {num_patches}")
    return kept


def random_keep_indices(rng: jax.Array, num_patches: int, keep_ratio: float,
                        batch: int | None = None) -> jax.Array:
    """Sorted random patch indices to keep: int32 [K], or [batch, K] for one subset per sample.

    The reference draws one permutation shared by the whole masked sub-batch (batch=None).
    """
    k = num_kept_patches(num_patches, keep_ratio)
    if batch is None:
        return jnp.sort(jax.random.permutation(rng, num_patches)[:k]).astype(jnp.int32)
    keys = jax.random.split(rng, batch)
    perm = jax.vmap(lambda r: jax.random.permutation(r, num_patches)[:k])(keys)
    return jnp.sort(perm, axis=-1).astype(jnp.int32)


def mask_text_tokens(rng: jax.Array, tokens: jax.Array, mask_id: int, prob: float,
                     protected_ids: tuple[int, ...] = (1,)) -> jax.Array:
    """Replace each token not in `protected_ids` by `mask_id` with probability `prob`.

    tokens int [B, L]. The reference protects id 1 (pad == EOS for the SigLIP vocab) and uses
    [MASK] = 32000 (`<extra_id_99>`) with prob 0.75; masked tokens stay in place.
    """
    if not 0.0 <= prob <= 1.0:
        raise ValueError(f"mask probability must be in [0, 1], got {prob}")
    replace = jax.random.uniform(rng, tokens.shape) < prob
    protected = jnp.isin(tokens, jnp.asarray(protected_ids, tokens.dtype))
    return jnp.where(replace & ~protected, jnp.asarray(mask_id, tokens.dtype), tokens)
