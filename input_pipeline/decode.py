"""Raw record -> training/eval example, or a `Skip` naming why not.

Bad input never crashes the pipeline and never reaches the model: each failure maps to one
reason in `records.SKIP_REASONS`. Images are converted to RGB *correctly* rather than skipped
when that is possible: CMYK, palette, greyscale and YCbCr via PIL; 16-bit greyscale scaled to
8 bits (PIL's plain convert would clip it to white); alpha (RGBA, LA, palette transparency)
composited over white, since the colour under a transparent pixel is arbitrary, often black.
"""
from __future__ import annotations

import dataclasses
import io
import os
import warnings
from typing import Any, Sequence

import numpy as np
from PIL import Image

from input_pipeline import transforms
from input_pipeline.records import Skip

# We enforce our own pixel limit (`max_image_pixels`) before decoding, so PIL's own warning
# for large images is redundant; PIL's hard error (at 2x its limit) is caught below.
warnings.filterwarnings("ignore", category=Image.DecompressionBombWarning)

_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_16BIT_MODES = ("I;16", "I;16B", "I;16L", "I;16N")
# PIL draft (DCT-domain downscaling) is only used when the JPEG is this many times larger than
# needed, so the result stays visually identical to a full decode followed by the resize.
_DRAFT_MARGIN = 2.0
# PIL hands every freed image buffer back to malloc, which returns buffers of this size (a
# decoded photo, its resized crop) to the OS; the next record faults the pages in again: ~200
# page faults and ~15% of the time per record. PIL keeps up to this many freed blocks for reuse
# instead (PILLOW_BLOCKS_MAX, which takes precedence when set; blocks are <= 16 MB). Memory
# reuse only: the pixels are the same.
_PIL_BLOCKS_MAX = 8
_pil_blocks_set = False


def keep_pil_blocks() -> None:
    """Lets PIL reuse freed image buffers in this process (once; see _PIL_BLOCKS_MAX)."""
    global _pil_blocks_set
    if not _pil_blocks_set:
        _pil_blocks_set = True
        if "PILLOW_BLOCKS_MAX" not in os.environ and Image.core.get_blocks_max() < _PIL_BLOCKS_MAX:
            Image.core.set_blocks_max(_PIL_BLOCKS_MAX)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    image_size: int = 224
    train: bool = True
    augment: transforms.AugmentConfig | None = transforms.AugmentConfig()
    max_image_pixels: int = 50_000_000
    min_image_side: int = 8
    seed: int = 0


def to_rgb(img: Image.Image) -> Image.Image | Skip:
    mode = img.mode
    if mode == "RGB":
        return img
    if mode in _16BIT_MODES or mode == "I":
        a = np.asarray(img)
        if mode == "I" and a.max(initial=0) <= 255:   # 8-bit data that PIL widened
            a8 = np.clip(a, 0, 255).astype(np.uint8)
        else:                                           # 16-bit range -> 8 bits, rounded
            a16 = np.clip(a.astype(np.int64), 0, 65535)
            a8 = ((a16 * 255 + 32767) // 65535).astype(np.uint8)
        return Image.fromarray(a8, "L").convert("RGB")
    if mode == "F":
        return Skip("unsupported_image_mode")
    if mode == "P" and "transparency" in img.info:
        img, mode = img.convert("RGBA"), "RGBA"
    if mode in _ALPHA_MODES:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return img.convert("RGB")


def load_rgb(data: bytes | np.ndarray | None, max_pixels: int, min_side: int,
             needed_short_side: int = 0) -> Image.Image | Skip:
    """Encoded bytes (or a decoded HWC/HW uint8 array) -> decoded RGB PIL image, or Skip."""
    if data is None:
        return Skip("missing_image")
    if isinstance(data, np.ndarray):
        if data.ndim == 3 and data.shape[-1] == 1:
            data = data[..., 0]
        if data.dtype != np.uint8 or data.ndim not in (2, 3) or (
                data.ndim == 3 and data.shape[-1] not in (3, 4)):
            return Skip("unsupported_image_mode")
        img = Image.fromarray(data)
    else:
        if len(data) == 0:
            return Skip("empty_image")
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError:
            return Skip("image_too_large")
        except Exception:  # pylint: disable=broad-except  (PIL raises many kinds)
            return Skip("corrupt_image")
    w, h = img.size
    if w * h > max_pixels:
        return Skip("image_too_large")
    if min(w, h) < min_side:
        return Skip("image_too_small")
    try:
        if img.format == "JPEG" and needed_short_side and img.mode in ("RGB", "L"):
            scale = min(w, h) / (_DRAFT_MARGIN * needed_short_side)
            if scale >= 2:
                img.draft(img.mode, (int(w / scale) + 1, int(h / scale) + 1))
        img.load()   # decode now, so truncated data fails here and not in a transform
        return to_rgb(img)
    except Image.DecompressionBombError:
        return Skip("image_too_large")
    except Exception:
        return Skip("corrupt_image")


def pick_caption(txt: Any, rng: np.random.Generator | None) -> str | Skip:
    """str | bytes | list of either -> one caption (uniform over the list; the first one if
    rng is None, as in eval), or Skip."""
    if txt is None:
        return Skip("missing_caption")
    if isinstance(txt, np.ndarray):
        txt = txt.tolist()
    if isinstance(txt, (list, tuple)):
        if not txt:
            return Skip("missing_caption")
        txt = txt[int(rng.integers(len(txt)))] if rng is not None and len(txt) > 1 else txt[0]
    if isinstance(txt, (bytes, np.bytes_)):
        try:
            txt = bytes(txt).decode("utf-8")
        except UnicodeDecodeError:
            return Skip("bad_text_encoding")
    if not isinstance(txt, str):
        return Skip("missing_caption")
    txt = txt.strip()
    # A caption of only control characters or NULs carries nothing for the tokenizer either.
    if not txt or not any(ch.isprintable() and not ch.isspace() for ch in txt):
        return Skip("empty_caption")
    return txt


def record_rng(seed: int, rng_key: Sequence[int]) -> np.random.Generator:
    """np.random.default_rng((seed, *rng_key)): the same stream, ~25% cheaper to make.

    A tuple seed goes through numpy's per-int Python conversion into 32-bit words; words that
    are already a uint32 array give the same SeedSequence without it (numpy's
    `_coerce_to_uint32_array`). Values >= 2**32 take more than one word: the tuple path."""
    words = (seed, *rng_key)
    if all(0 <= w < 2**32 for w in words):
        words = np.array(words, np.uint32)
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(words)))


class ExampleDecoder:
    """Callable raw record -> {"image": uint8 [S, S, 3], "caption": str, ["label": int]} | Skip.

    Train: the randomness (caption choice, crop, colour) comes from a Generator seeded with
    (seed, *record["rng_key"]) = (seed, epoch, record): a record gets the same augmentation
    in every run (resumed or not) and on any number of hosts and worker processes.
    Eval: no randomness; the first caption of a record, the eval resize + centre crop.
    """

    def __init__(self, config: DecodeConfig):
        self.config = config

    def __call__(self, raw: dict[str, Any] | Skip) -> dict[str, Any] | Skip:
        if isinstance(raw, Skip):
            return raw
        keep_pil_blocks()   # here, not at construction: this runs in the worker processes
        cfg = self.config
        rng = record_rng(cfg.seed, raw["rng_key"]) if cfg.train else None
        caption = pick_caption(raw.get("txt"), rng)
        if isinstance(caption, Skip):
            return caption._replace(key=raw.get("key", ""))
        img = load_rgb(raw.get("image"), cfg.max_image_pixels, cfg.min_image_side,
                       needed_short_side=int(cfg.image_size * 1.3) if cfg.train else
                       cfg.image_size)
        if isinstance(img, Skip):
            return img._replace(key=raw.get("key", ""))
        if cfg.train and cfg.augment is not None:
            image = transforms.train_transform(img, cfg.image_size, rng, cfg.augment)
        else:   # eval, or training without augmentation (augment=None)
            image = transforms.eval_transform(img, cfg.image_size)
        out = {"image": image, "caption": caption}
        if raw.get("label") is not None:
            out["label"] = int(raw["label"])
        return out


def decode_captions(txt: Any) -> Sequence[str] | Skip:
    """All captions of a raw record, validated (for the converter and eval splits)."""
    items = list(txt) if isinstance(txt, (list, tuple, np.ndarray)) else [txt]
    out = []
    for item in items:
        c = pick_caption(item, None)
        if isinstance(c, Skip):
            return c
        out.append(c)
    return out if out else Skip("missing_caption")
