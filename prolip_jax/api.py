"""`prolip_jax.load(path)`: a ready-to-use model from a CKPT directory or a Hugging Face folder.

    model = prolip_jax.load(path)
    mu, logvar = model.encode_image(images)     # float32 [N, H, W, 3], already normalised
    mu, logvar = model.encode_text(token_ids)   # int32 [N, L]

mu is L2-normalised and log sigma^2 raw, both float32 [N, D]. Inputs are encoded in
fixed-size chunks (the last one padded) so any N compiles at most one shape per tower.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax import checkpoint, convert
from prolip_jax.models.config import ProLIPConfig
from prolip_jax.models.prolip import ProLIP


@dataclasses.dataclass
class PretrainedProLIP:
    config: ProLIPConfig
    params: Any
    dtype: Any = jnp.float32
    batch_size: int = 256

    def __post_init__(self):
        self.module = ProLIP(self.config, dtype=self.dtype)
        apply = self.module.apply
        self._image_fn = jax.jit(lambda p, x: apply({"params": p}, x, method=ProLIP.encode_image))
        self._text_fn = jax.jit(lambda p, t: apply({"params": p}, t, method=ProLIP.encode_text))

    @property
    def logit_scale(self) -> float:
        """a = exp(logit_scale)."""
        return float(np.exp(self.params["logit_scale"]))

    @property
    def logit_bias(self) -> float:
        return float(self.params["logit_bias"])

    def encode_image(self, images: Any) -> tuple[jax.Array, jax.Array]:
        """images float [N, H, W, 3] (normalised) -> (mu [N, D] unit-norm, log sigma^2 [N, D])."""
        images = np.asarray(images)
        s = self.config.vision.image_size
        if images.ndim != 4 or images.shape[1:] != (s, s, 3):
            raise ValueError(f"images must be [N, {s}, {s}, 3] (NHWC, normalised), got {images.shape}")
        if not np.issubdtype(images.dtype, np.floating):
            raise ValueError(f"images must be floating point (already normalised), got {images.dtype}")
        return self._chunked(self._image_fn, images.astype(np.float32))

    def encode_text(self, token_ids: Any) -> tuple[jax.Array, jax.Array]:
        """token_ids int [N, L], L <= context_length -> (mu [N, D] unit-norm, log sigma^2 [N, D])."""
        tokens = np.asarray(token_ids)
        t = self.config.text
        if tokens.ndim != 2 or not 0 < tokens.shape[1] <= t.context_length:
            raise ValueError(f"token_ids must be [N, L] with 0 < L <= {t.context_length}, got {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got {tokens.dtype}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= t.vocab_size):
            raise ValueError(f"token ids must lie in [0, {t.vocab_size}), got [{tokens.min()}, {tokens.max()}]")
        return self._chunked(self._text_fn, tokens.astype(np.int32))

    def _chunked(self, fn: Callable, x: np.ndarray) -> tuple[jax.Array, jax.Array]:
        n = x.shape[0]
        if n == 0:
            e = self.config.embed_dim
            return jnp.zeros((0, e), jnp.float32), jnp.zeros((0, e), jnp.float32)
        bs = min(self.batch_size, n)
        mus, lvs = [], []
        for start in range(0, n, bs):
            chunk = x[start:start + bs]
            pad = bs - chunk.shape[0]
            if pad:
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], pad, axis=0)])
            mu, lv = fn(self.params, chunk)
            mus.append(mu[:bs - pad])
            lvs.append(lv[:bs - pad])
        return jnp.concatenate(mus), jnp.concatenate(lvs)


def load(path: str | os.PathLike, dtype: Any = jnp.float32, step: int | None = None,
         batch_size: int = 256) -> PretrainedProLIP:
    """Loads a prolip_jax checkpoint directory (CKPT) or a Hugging Face folder (config.json +
    model.safetensors, e.g. a downloaded `SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B`)."""
    if convert.is_hf_dir(path):
        params, config = convert.load_hf(path)
        params = jax.device_put(params)
    elif checkpoint.is_checkpoint(path):
        params, config, _ = checkpoint.load_params(path, step=step)
    else:
        raise FileNotFoundError(
            f"{path} is neither a prolip_jax checkpoint (<step>/params + <step>/config) nor a Hugging "
            f"Face folder ({convert.CONFIG_NAME} + {convert.WEIGHTS_NAME})")
    return PretrainedProLIP(config, params, dtype=dtype, batch_size=batch_size)
