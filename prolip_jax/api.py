"""`prolip_jax.load(path)`: a ready-to-use model from a CKPT directory or a Hugging Face folder.

    model = prolip_jax.load(path)
    mu, logvar = model.encode_image(images)     # float32 [N, H, W, 3], already normalised
    mu, logvar = model.encode_text(token_ids)   # int32 [N, L]

mu is L2-normalised and log sigma^2 raw, both float32 numpy [N, D]. Encoding goes through
`prolip_jax.encode.Encoder`: fixed-size batches (any N compiles one shape per tower), split
over this host's devices.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax import checkpoint, convert
from prolip_jax.encode import Encoder
from prolip_jax.models.config import ProLIPConfig
from prolip_jax.models.prolip import ProLIP


@dataclasses.dataclass
class PretrainedProLIP:
    config: ProLIPConfig
    params: Any
    dtype: Any = jnp.float32
    batch_size: int = 256
    step: int | None = None  # the checkpoint step it was loaded from (None: a Hugging Face folder)

    def __post_init__(self):
        self.module = ProLIP(self.config, dtype=self.dtype)
        self.encoder = Encoder(self.module, batch_size=self.batch_size)

    @property
    def logit_scale(self) -> float:
        """a = exp(logit_scale)."""
        return float(np.exp(self.params["logit_scale"]))

    @property
    def logit_bias(self) -> float:
        return float(self.params["logit_bias"])

    def encode_image(self, images: Any) -> tuple[np.ndarray, np.ndarray]:
        """images float [N, H, W, 3] (normalised) -> (mu [N, D] unit-norm, log sigma^2 [N, D])."""
        images = np.asarray(images)
        s = self.config.vision.image_size
        if images.ndim != 4 or images.shape[1:] != (s, s, 3):
            raise ValueError(f"images must be [N, {s}, {s}, 3] (NHWC, normalised), got {images.shape}")
        if not np.issubdtype(images.dtype, np.floating):
            raise ValueError(f"images must be floating point (already normalised), got {images.dtype}")
        return self.encoder.images(self.params, images.astype(np.float32))

    def encode_text(self, token_ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """token_ids int [N, L], L <= context_length -> (mu [N, D] unit-norm, log sigma^2 [N, D])."""
        tokens = np.asarray(token_ids)
        t = self.config.text
        if tokens.ndim != 2 or not 0 < tokens.shape[1] <= t.context_length:
            raise ValueError(f"token_ids must be [N, L] with 0 < L <= {t.context_length}, got {tokens.shape}")
        if not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(f"token_ids must be integers, got {tokens.dtype}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= t.vocab_size):
            raise ValueError(f"token ids must lie in [0, {t.vocab_size}), got [{tokens.min()}, {tokens.max()}]")
        return self.encoder.texts(self.params, tokens.astype(np.int32))


def load(path: str | os.PathLike, dtype: Any = jnp.float32, step: int | None = None,
         batch_size: int = 256) -> PretrainedProLIP:
    """Loads a prolip_jax checkpoint directory (CKPT) or a Hugging Face folder (config.json +
    model.safetensors, e.g. a downloaded `SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B`), or a
    training workdir (its `checkpoints/` folder; the latest step unless `step` is given)."""
    trainer_ckpts = Path(path) / "checkpoints"
    if not checkpoint.is_checkpoint(path) and checkpoint.is_checkpoint(trainer_ckpts):
        path = trainer_ckpts
    if convert.is_hf_dir(path):
        params, config = convert.load_hf(path)
        params = jax.device_put(params)
        step = None
    elif checkpoint.is_checkpoint(path):
        params, config, step = checkpoint.load_params(path, step=step)
    else:
        raise FileNotFoundError(
            f"{path} is neither a prolip_jax checkpoint (<step>/params + <step>/config), a training "
            f"workdir (checkpoints/<step>/...) nor a Hugging Face folder ({convert.CONFIG_NAME} + "
            f"{convert.WEIGHTS_NAME})")
    return PretrainedProLIP(config, params, dtype=dtype, batch_size=batch_size, step=step)
