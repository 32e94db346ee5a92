"""Synthetic webdataset shards for tests and the benchmark (no downloads anywhere).

Images are smooth colour fields plus texture noise, so their JPEGs have realistic sizes and
decode times (a 400x300 one is ~40-60 KB at quality 90, like web photos), unlike flat
colours (tiny files) or white noise (huge ones).
"""
from __future__ import annotations

import io
import os
import tarfile
from typing import Iterable, Mapping

import numpy as np
from PIL import Image

WORDS = ("a", "the", "photo", "of", "dog", "cat", "red", "blue", "small", "large", "on",
         "tree", "car", "beach", "at", "night", "with", "two", "people", "street", "in")


def natural_image(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """uint8 [height, width, 3]: low-frequency colour field + gradient + mild noise."""
    coarse = rng.integers(0, 256, (max(2, height // 40), max(2, width // 40), 3), np.uint8)
    field = np.asarray(Image.fromarray(coarse).resize((width, height),
                                                      Image.Resampling.BILINEAR), np.int16)
    ramp = np.linspace(-30, 30, width).astype(np.int16)[None, :, None]
    noise = rng.integers(-12, 13, (height, width, 3), np.int16)
    return np.clip(field + ramp + noise, 0, 255).astype(np.uint8)


def encode_image(array: np.ndarray, fmt: str = "JPEG", **kwargs) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt, **kwargs)
    return buf.getvalue()


def random_caption(rng: np.random.Generator, min_words: int = 4, max_words: int = 12) -> str:
    n = int(rng.integers(min_words, max_words + 1))
    return " ".join(WORDS[i] for i in rng.integers(len(WORDS), size=n))


def write_tar(path: str, members: Iterable[tuple[str, bytes]]) -> str:
    """Writes (name, data) members to a tar file, atomically (temp name, then rename)."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with tarfile.open(tmp, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 0   # reproducible bytes
            tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)
    return path


def record_members(key: str, parts: Mapping[str, bytes]) -> list[tuple[str, bytes]]:
    return [(f"{key}.{ext}", data) for ext, data in parts.items()]


def make_jpeg_shards(directory: str, num_shards: int, per_shard: int, width: int = 400,
                     height: int = 300, seed: int = 0, quality: int = 90) -> list[str]:
    """img2dataset-style shards `{directory}/{00000..}.tar` of JPEG + caption (+ json) records.

    Keys are globally unique ("{shard:05d}{i:04d}") and each caption starts with its key, so a
    test can tell exactly which records came out.
    """
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    out = []
    for s in range(num_shards):
        members = []
        for i in range(per_shard):
            key = f"{s:05d}{i:04d}"
            members += record_members(key, {
                "jpg": encode_image(natural_image(rng, width, height), "JPEG", quality=quality),
                "txt": f"{key} {random_caption(rng)}".encode(),
                "json": b'{"key": "%s"}' % key.encode()})
        out.append(write_tar(os.path.join(directory, f"{s:05d}.tar"), members))
    return out


# ---------------------------------------------------------------------------------------------
# Image variants for bad-input tests: what web data contains besides clean RGB JPEGs.
# ---------------------------------------------------------------------------------------------
# Decodable ones: the pipeline must convert these, and the colour must survive.
GOOD_IMAGE_KINDS = ("jpeg", "png", "webp", "cmyk_jpeg", "gray16_png", "palette_png",
                    "palette_alpha_png", "rgba_png", "la_png", "gray_png")
# Undecodable or unacceptable ones -> the Skip reason they must produce.
BAD_IMAGE_KINDS = {"truncated_jpeg": "corrupt_image", "garbage": "corrupt_image",
                   "zero_bytes": "empty_image", "bomb_png": "image_too_large",
                   "huge_png": "image_too_large", "tiny_png": "image_too_small",
                   "float_tiff": "unsupported_image_mode"}


def png_with_size(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (the pixel data is a 1x1 image): opening it
    reads the size only, so a test can reach any 'decompression bomb' size for free."""
    import struct
    import zlib
    data = bytearray(encode_image(np.zeros((1, 1), np.uint8), "PNG"))
    # Signature (8) + IHDR length (4) + b"IHDR" (4) + width, height (4 + 4) ...; CRC after 13.
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    return bytes(data)


def image_variant(kind: str, rgb: tuple[int, int, int], size: int = 20) -> bytes:
    """Encoded image of one solid colour `rgb` (grey kinds use rgb[0] as the grey level)."""
    solid = np.empty((size, size, 3), np.uint8)
    solid[...] = rgb
    grey = np.full((size, size), rgb[0], np.uint8)
    if kind == "jpeg":
        return encode_image(solid, "JPEG", quality=95)
    if kind == "png":
        return encode_image(solid, "PNG")
    if kind == "webp":
        return encode_image(solid, "WEBP", lossless=True)
    if kind == "cmyk_jpeg":
        buf = io.BytesIO()
        Image.fromarray(solid).convert("CMYK").save(buf, "JPEG", quality=95)
        return buf.getvalue()
    if kind == "gray16_png":   # 16-bit: PIL mode I;16; value v*257 maps back to v
        buf = io.BytesIO()
        Image.fromarray(grey.astype(np.uint16) * 257).save(buf, "PNG")
        return buf.getvalue()
    if kind in ("palette_png", "palette_alpha_png"):
        img = Image.fromarray(solid).convert("P", palette=Image.Palette.ADAPTIVE, colors=4)
        buf = io.BytesIO()
        if kind == "palette_alpha_png":   # a transparent palette entry that is never used
            img.putpalette(img.getpalette()[:6] + [0, 0, 0] * 254)
            img.save(buf, "PNG", transparency=200)
        else:
            img.save(buf, "PNG")
        return buf.getvalue()
    if kind == "rgba_png":   # opaque alpha: the colour must come out unchanged
        return encode_image(np.dstack([solid, np.full((size, size), 255, np.uint8)]), "PNG")
    if kind == "la_png":
        buf = io.BytesIO()
        Image.fromarray(np.dstack([grey, np.full_like(grey, 255)]), "LA").save(buf, "PNG")
        return buf.getvalue()
    if kind == "gray_png":
        return encode_image(grey, "PNG")
    if kind == "truncated_jpeg":
        rng = np.random.default_rng(sum(rgb))
        full = encode_image(rng.integers(0, 256, (64, 64, 3), np.uint8), "JPEG", quality=90)
        return full[: len(full) // 2]
    if kind == "garbage":
        return b"\xff\xd8\xff\xe0" + bytes(np.random.default_rng(sum(rgb)).integers(
            0, 256, 300, np.uint8))
    if kind == "zero_bytes":
        return b""
    if kind == "bomb_png":    # over PIL's own hard limit (2 x 89M pixels): PIL raises
        return png_with_size(20_000, 20_000)
    if kind == "huge_png":    # over our default 50M-pixel limit, under PIL's
        return png_with_size(8_000, 8_000)
    if kind == "tiny_png":
        return encode_image(solid[:4, :4], "PNG")
    if kind == "float_tiff":
        buf = io.BytesIO()
        Image.fromarray(grey.astype(np.float32) / 255.0, "F").save(buf, "TIFF")
        return buf.getvalue()
    raise ValueError(f"unknown image kind {kind!r}")


def expected_rgb(kind: str, rgb: tuple[int, int, int]) -> tuple[int, int, int]:
    """The colour a correct decoder gives for image_variant(kind, rgb)."""
    if kind in ("gray16_png", "la_png", "gray_png"):
        return (rgb[0],) * 3
    return rgb
