"""Image transforms (PIL in, numpy out) matching the reference's torchvision pipeline.

Train (naver-ai/prolip scripts/*.sh and src/prolip_train/params.py, open_clip 2.24 `image_transform(is_train=True)` as ProLIP configures it):
    RandomResizedCrop(size, scale=(0.8, 1.0), ratio=(3/4, 4/3), bicubic)
    RandomApply([ColorJitter(0.32, 0.32, 0.32, 0.08)], p=0.8)
    RandomGrayscale(p=0.2)
Eval (naver-ai/prolip src/prolip/tokenizer.py): bicubic resize of the shortest side to `size`, then CenterCrop(size).
Normalisation: OpenAI CLIP mean/std (the reference's) or 0.5/0.5 (SigLIP's), by config.

Transforms return HWC uint8; `prolip_jax.core.normalization.normalize` turns a batch into float32. The crop geometry is
torchvision's `RandomResizedCrop.get_params` algorithm, drawn from a numpy Generator that the
caller seeds per record, so a resumed run augments every record exactly as before.

ColorJitter has two implementations (`color_jitter_impl`):
  "fast" (default): brightness, contrast and saturation are linear blends (exactly as in
      torchvision: with black, with the grey mean, with the greyscale image), so the four
      ops in torchvision's random order, the hue shift and the grayscale step fold into ONE
      3x4 colour matrix applied by PIL in C (~0.3 ms at 224 px). Differences from torchvision:
      the hue shift is a rotation of the YIQ chroma plane (as NVIDIA DALI does) instead of an
      HSV hue shift, and values are clipped once at the end instead of after every op.
  "torchvision": torchvision's PIL code path op by op (ImageEnhance + HSV hue shift), ~4x
      slower; for parity checks.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np
from PIL import Image, ImageEnhance, ImageStat


# ITU-R 601-2 luma, as PIL's convert("L") and torchvision's rgb_to_grayscale use.
_LUMA = np.array([0.299, 0.587, 0.114])
_RGB_TO_YIQ = np.array([[0.299, 0.587, 0.114],
                        [0.596, -0.274, -0.322],
                        [0.211, -0.523, 0.312]])
_YIQ_TO_RGB = np.linalg.inv(_RGB_TO_YIQ)


@dataclasses.dataclass(frozen=True)
class AugmentConfig:
    """Training augmentation; the defaults are the reference's (naver-ai/prolip scripts/*.sh and src/prolip_train/params.py)."""
    crop_scale: tuple[float, float] = (0.8, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    color_jitter: tuple[float, float, float, float] = (0.32, 0.32, 0.32, 0.08)  # b, c, s, hue
    color_jitter_prob: float = 0.8
    grayscale_prob: float = 0.2
    color_jitter_impl: str = "fast"

    def __post_init__(self):
        if self.color_jitter_impl not in ("fast", "torchvision"):
            raise ValueError(f"color_jitter_impl must be 'fast' or 'torchvision', got "
                             f"{self.color_jitter_impl!r}.")
        lo, hi = self.crop_scale
        if not 0 < lo <= hi <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < lo <= hi <= 1, got {self.crop_scale}.")
        if not 0 < self.crop_ratio[0] <= self.crop_ratio[1]:
            raise ValueError(f"crop_ratio must be (lo, hi) with 0 < lo <= hi, got "
                             f"{self.crop_ratio}.")


def random_resized_crop_box(rng: np.random.Generator, width: int, height: int,
                            scale: tuple[float, float] = (0.8, 1.0),
                            ratio: tuple[float, float] = (3 / 4, 4 / 3)
                            ) -> tuple[int, int, int, int]:
    """torchvision `RandomResizedCrop.get_params` -> (left, top, w, h) of the crop box."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    # Fallback: central crop at the clamped aspect ratio (as torchvision).
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        w, h = int(round(height * ratio[1])), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def _jitter_params(rng: np.random.Generator, jitter: tuple[float, float, float, float]):
    """torchvision `ColorJitter.get_params`: op order, then the factors."""
    b, c, s, h = jitter
    order = rng.permutation(4)
    factors = (rng.uniform(max(0.0, 1 - b), 1 + b), rng.uniform(max(0.0, 1 - c), 1 + c),
               rng.uniform(max(0.0, 1 - s), 1 + s), rng.uniform(-h, h))
    return order, factors


def _hue_matrix(hue: float) -> np.ndarray:
    """Rotation of the YIQ chroma plane by `hue` turns. The sign is chosen so that a positive
    factor moves hue the same way as torchvision's HSV shift (red -> yellow -> green)."""
    theta = -2 * math.pi * hue
    rot = np.array([[1, 0, 0],
                    [0, math.cos(theta), -math.sin(theta)],
                    [0, math.sin(theta), math.cos(theta)]])
    return _YIQ_TO_RGB @ rot @ _RGB_TO_YIQ


def color_matrix(rng: np.random.Generator, mean_rgb: np.ndarray | Callable[[], np.ndarray],
                 aug: AugmentConfig) -> np.ndarray | None:
    """Draws ColorJitter (p) and Grayscale (p) and folds them into a 3x4 affine colour matrix
    [A | t] acting on 0..255 RGB, or None when neither op fires. `mean_rgb` [3] is the image's
    mean colour, or a function computing it (only called if the jitter fires): the contrast
    op blends towards the grey mean of the *current* image, an affine function of it."""
    a, t = np.eye(3), np.zeros(3)
    if rng.uniform() < aug.color_jitter_prob:
        order, (bf, cf, sf, hf) = _jitter_params(rng, aug.color_jitter)
        for op in order:
            if op == 0:    # brightness: blend with black
                a, t = bf * a, bf * t
            elif op == 1:  # contrast: blend with the grey mean of the current image
                if callable(mean_rgb):
                    mean_rgb = mean_rgb()
                m = _LUMA @ (a @ mean_rgb + t)
                a, t = cf * a, cf * t + (1 - cf) * m
            elif op == 2:  # saturation: blend with the greyscale image
                s = sf * np.eye(3) + (1 - sf) * np.outer(np.ones(3), _LUMA)
                a, t = s @ a, s @ t
            else:
                hm = _hue_matrix(hf)
                a, t = hm @ a, hm @ t
        jittered = True
    else:
        jittered = False
    if rng.uniform() < aug.grayscale_prob:
        g = np.outer(np.ones(3), _LUMA)
        a, t = g @ a, g @ t
    elif not jittered:
        return None
    return np.concatenate([a, t[:, None]], axis=1)


def _color_jitter_torchvision(img: Image.Image, rng: np.random.Generator,
                              aug: AugmentConfig) -> Image.Image:
    """torchvision's PIL path, op by op (ImageEnhance; hue via HSV with uint8 wrap-around)."""
    if rng.uniform() < aug.color_jitter_prob:
        order, (bf, cf, sf, hf) = _jitter_params(rng, aug.color_jitter)
        for op in order:
            if op == 0:
                img = ImageEnhance.Brightness(img).enhance(bf)
            elif op == 1:
                img = ImageEnhance.Contrast(img).enhance(cf)
            elif op == 2:
                img = ImageEnhance.Color(img).enhance(sf)
            else:
                h, s, v = img.convert("HSV").split()
                shifted = (np.asarray(h, np.int64) + int(hf * 255)) % 256
                img = Image.merge("HSV", (Image.fromarray(shifted.astype(np.uint8), "L"), s, v)
                                  ).convert("RGB")
    if rng.uniform() < aug.grayscale_prob:
        img = img.convert("L").convert("RGB")
    return img


def _mean_rgb(img: Image.Image) -> np.ndarray:
    """Mean colour [3]; of an 8x box-reduced copy when possible (2x faster, equal to ~0.01)."""
    if min(img.size) >= 32:
        return np.asarray(img.reduce(8), np.float64).reshape(-1, 3).mean(0)
    return np.asarray(ImageStat.Stat(img).mean)


def train_transform(img: Image.Image, size: int, rng: np.random.Generator,
                    aug: AugmentConfig = AugmentConfig()) -> np.ndarray:
    """RGB PIL image -> augmented uint8 [size, size, 3]."""
    left, top, w, h = random_resized_crop_box(rng, img.width, img.height, aug.crop_scale,
                                              aug.crop_ratio)
    # resize(box=...) reads the crop straight from the full image: one pass, no copy.
    out = img.resize((size, size), Image.Resampling.BICUBIC, box=(left, top, left + w, top + h))
    if aug.color_jitter_impl == "torchvision":
        out = _color_jitter_torchvision(out, rng, aug)
    else:
        m = color_matrix(rng, lambda: _mean_rgb(out), aug)
        if m is not None:
            out = out.convert("RGB", matrix=tuple(float(v) for v in m.ravel()))
    return np.asarray(out, np.uint8)


def eval_resize_hw(width: int, height: int, size: int) -> tuple[int, int]:
    """torchvision `Resize(size)` output (w, h): the short side becomes `size`."""
    if width <= height:
        return size, int(size * height / width)
    return int(size * width / height), size


def eval_transform(img: Image.Image, size: int) -> np.ndarray:
    """RGB PIL image -> uint8 [size, size, 3]: bicubic shortest-side resize + centre crop."""
    w, h = eval_resize_hw(img.width, img.height, size)
    if (w, h) != img.size:
        img = img.resize((w, h), Image.Resampling.BICUBIC)
    left, top = int(round((w - size) / 2.0)), int(round((h - size) / 2.0))
    return np.asarray(img.crop((left, top, left + size, top + size)), np.uint8)
