"""Image normalisation: the mean/std a model was trained with, on the host or inside the step.

One table for everything that normalises pixels or records how: the input pipeline (host,
float32 batches), the train step and the encoder (on device, from uint8 batches), and the
Hugging Face export (`preprocessor_config.json`). OpenAI CLIP's mean/std is the reference's
(the authors' ProLIP code, through open_clip); "0.5" is SigLIP's.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
NORMALIZATIONS = {
    "openai": (OPENAI_MEAN, OPENAI_STD),
    "0.5": ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
}
NORMALIZATIONS["siglip"] = NORMALIZATIONS["0.5"]


def mean_std(normalization: str | tuple[Sequence[float], Sequence[float]]
             ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """A NORMALIZATIONS name or a (mean, std) pair -> (mean, std) as float tuples."""
    if isinstance(normalization, str):
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"Unknown normalization {normalization!r}; expected one of {sorted(NORMALIZATIONS)}.")
        normalization = NORMALIZATIONS[normalization]
    mean, std = normalization
    return tuple(float(x) for x in mean), tuple(float(x) for x in std)


def name_of(mean: Sequence[float], std: Sequence[float]) -> str | tuple[tuple[float, ...], tuple[float, ...]]:
    """The NORMALIZATIONS name with this mean/std (to 1e-6), else the (mean, std) pair."""
    pair = mean_std((mean, std))
    return next((name for name, (m, s) in NORMALIZATIONS.items()
                 if np.allclose(m, pair[0], atol=1e-6) and np.allclose(s, pair[1], atol=1e-6)), pair)


def _arrays(normalization: Any) -> tuple[np.ndarray, np.ndarray]:
    mean, std = mean_std(normalization)
    return np.asarray(mean, np.float32), np.asarray(std, np.float32)


def normalize(images: np.ndarray, normalization: Any = "openai",
              out: np.ndarray | None = None) -> np.ndarray:
    """uint8 [..., 3] in 0..255 -> float32 (x/255 - mean) / std, on the host (into `out`).
    normalization: a NORMALIZATIONS name or a (mean, std) pair."""
    mean, std = _arrays(normalization)
    scale, offset = 1.0 / (255.0 * std), -mean / std
    if out is None:
        out = np.empty(images.shape, np.float32)
    np.multiply(images, scale, out=out, dtype=np.float32)
    out += offset
    return out


def normalize_on_device(images: Any, normalization: str = "openai", dtype: Any = None) -> Any:
    """uint8 images [B, H, W, 3] -> normalised float (jnp), for `image_dtype="uint8"` batches.

    Call it inside the jitted step: it fuses into the first conv, and uint8 batches are 4x
    cheaper to build, move between processes and copy to the device.
    """
    # jax loads here, not at the top: grain's worker processes import this module for the host
    # `normalize` and have no use for jax.
    import jax.numpy as jnp

    mean, std = _arrays(normalization)
    dtype = dtype or jnp.float32
    x = jnp.asarray(images).astype(jnp.float32)
    return ((x * (1.0 / (255.0 * std)) - mean / std)).astype(dtype)
