"""Match targets of a training batch: which captions are positives of which images, and MSDA.

`config.targets` (TargetsConfig) chooses them:

- positives: "diagonal" (caption i belongs to image i, as the reference ProLIP code assumes);
  "same_caption" (every image whose caption is token-for-token identical to caption j is a
  positive of caption j too: "a shape" is true of every image that carries it, so treating
  the other copies as negatives, as the diagonal does, pushes apart what matches);
  "image_id" (rows with equal `batch["image_id"]`: several captions of one image, COCO-style);
  "both" (either).
- MSDA (PCME++, PCME++ §2.4; pcmepp/augmentation.py): each image is mixed, with probability
  `mix_fraction`, with its partner in the reversed batch (row B-1-i), by Mixup or CutMix
  (`cutmix_prob`, drawn per element as the code does, not per batch as the paper says), with
  lambda ~ Beta(mix_alpha, mix_alpha); CutMix's lambda is corrected to the pasted box's area
  (timm's rand_bbox). The mixed image's targets are lambda * its row + (1 - lambda) * the
  partner's row, so a pairwise objective sees soft labels.

Everything runs on device inside the jitted step, on the global batch (mesh-independent).
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

POSITIVES = ("diagonal", "same_caption", "image_id", "both")
BY_IMAGE_ID = ("image_id", "both")  # the positives read from batch["image_id"]


@dataclasses.dataclass(frozen=True)
class TargetsConfig:
    positives: Literal["diagonal", "same_caption", "image_id", "both"] = "diagonal"
    mix_fraction: float = 0.0  # share of images mixed with their reversed partner; PCME++: 0.25
    mix_alpha: float = 2.0  # lambda ~ Beta(alpha, alpha); PCME++: 2
    cutmix_prob: float = 0.5  # CutMix instead of Mixup, per element; PCME++ code: 0.5

    def validate(self) -> None:
        if not 0.0 <= self.mix_fraction <= 1.0:
            raise ValueError(f"config.targets.mix_fraction must be in [0, 1], got {self.mix_fraction}")
        if not 0.0 <= self.cutmix_prob <= 1.0:
            raise ValueError(f"config.targets.cutmix_prob must be in [0, 1], got {self.cutmix_prob}")
        if self.mix_alpha <= 0:
            raise ValueError(f"config.targets.mix_alpha must be > 0, got {self.mix_alpha}")

    @property
    def identity(self) -> bool:
        """True when the targets are the identity (the objective may take its fast path)."""
        return self.positives == "diagonal" and self.mix_fraction == 0.0

    @property
    def needs_image_id(self) -> bool:
        """The batch must carry `image_id` (several captions of one image)."""
        return self.positives in BY_IMAGE_ID

    @property
    def soft(self) -> bool:
        return self.mix_fraction > 0.0


def positive_matrix(tokens: jax.Array, image_ids: jax.Array | None, positives: str) -> jax.Array:
    """float32 [B, B]: 1 where caption j is a positive of image i (the diagonal always is)."""
    b = tokens.shape[0]
    pos = jnp.eye(b, dtype=bool)
    if positives in ("same_caption", "both"):
        pos = pos | jnp.all(tokens[:, None, :] == tokens[None, :, :], axis=-1)
    if positives in BY_IMAGE_ID:
        if image_ids is None:
            raise ValueError("config.targets.positives needs batch['image_id'], which this data source "
                             "does not provide; use 'diagonal' or 'same_caption'")
        pos = pos | (image_ids[:, None] == image_ids[None, :])
    elif positives not in ("diagonal", "same_caption"):
        raise ValueError(f"config.targets.positives={positives!r} is not one of {POSITIVES}")
    return pos.astype(jnp.float32)


def cutmix_box(lam: jax.Array, cy: jax.Array, cx: jax.Array, h: int, w: int
               ) -> tuple[jax.Array, jax.Array]:
    """(bool [B, H, W] box to paste, corrected lambda [B]) as timm's `rand_bbox`: a box of
    sides int(H sqrt(1-lam)), int(W sqrt(1-lam)) centred at (cy, cx), clipped to the image;
    lambda becomes 1 - box area / image area."""
    cut = jnp.sqrt(1.0 - lam)
    ch, cw = (h * cut).astype(jnp.int32), (w * cut).astype(jnp.int32)
    y0, y1 = jnp.clip(cy - ch // 2, 0, h), jnp.clip(cy + ch // 2, 0, h)
    x0, x1 = jnp.clip(cx - cw // 2, 0, w), jnp.clip(cx + cw // 2, 0, w)
    ys, xs = jnp.arange(h)[None, :, None], jnp.arange(w)[None, None, :]
    box = ((ys >= y0[:, None, None]) & (ys < y1[:, None, None]) & (xs >= x0[:, None, None])
           & (xs < x1[:, None, None]))
    return box, 1.0 - ((y1 - y0) * (x1 - x0)).astype(jnp.float32) / (h * w)


def mix(rng: jax.Array, images: jax.Array, targets: jax.Array, cfg: TargetsConfig
        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(mixed images [B, H, W, C], soft targets [B, B], lambda [B]) for float images."""
    b, h, w, _ = images.shape
    k_mix, k_cut, k_lam, k_y, k_x = jax.random.split(rng, 5)
    mixed = jax.random.bernoulli(k_mix, cfg.mix_fraction, (b,))
    cutmix = jax.random.bernoulli(k_cut, cfg.cutmix_prob, (b,))
    lam = jax.random.beta(k_lam, cfg.mix_alpha, cfg.mix_alpha, (b,))
    box, lam_box = cutmix_box(lam, jax.random.randint(k_y, (b,), 0, h), jax.random.randint(k_x, (b,), 0, w), h, w)
    partner = images[::-1]
    mixup_img = lam[:, None, None, None] * images + (1.0 - lam[:, None, None, None]) * partner
    cutmix_img = jnp.where(box[..., None], partner, images)
    new = jnp.where(cutmix[:, None, None, None], cutmix_img, mixup_img)
    lam = jnp.where(mixed, jnp.where(cutmix, lam_box, lam), 1.0)
    images = jnp.where(mixed[:, None, None, None], new.astype(images.dtype), images)
    soft = lam[:, None] * targets + (1.0 - lam[:, None]) * targets[::-1]
    return images, soft, lam


def batch_targets(rng: jax.Array, images: jax.Array, tokens: jax.Array, image_ids: jax.Array | None,
                  cfg: TargetsConfig) -> tuple[jax.Array, jax.Array | None]:
    """(images, targets) for the step: targets None when they are the identity."""
    if cfg.identity:
        return images, None
    targets = positive_matrix(tokens, image_ids, cfg.positives)
    if cfg.soft:
        images, targets, _ = mix(rng, images, targets, cfg)
    return images, targets
