"""Record format, raw records and the skip-reason bookkeeping shared by every source.

Every source turns its elements into a *raw record*, a plain dict:

    {"image": bytes | np.ndarray | None,    encoded image (or decoded HWC uint8 from tfds)
     "txt": str | bytes | list | None,      one caption or several (one is drawn per epoch)
     "key": str,                            for messages only
     "label": int | None,                   passed through to eval batches when present
     "rng_key": tuple[int, ...]}            position in the data: per-record randomness
                                            comes from (seed, *rng_key), so a resumed run
                                            augments every record exactly as before.

ArrayRecord files written by this project (`scripts/tar_to_array_record.py`, the demo) hold one
record per image-text pair in a small self-describing format: the magic `PLR1`, a uint32 header
length, a UTF-8 JSON header `{"key", "txt", "meta"}`, then the encoded image bytes unchanged
(no re-encoding: the converter is lossless and fast). JSON, not pickle, so reading untrusted
files cannot run code.
"""
from __future__ import annotations

import json
import struct
from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np

MAGIC = b"PLR1"

# Why a record was dropped. The order is the layout of the per-batch count vector.
SKIP_REASONS = (
    "missing_image",           # a caption with no image member / field
    "missing_caption",         # an image with no caption
    "empty_caption",           # caption is empty or whitespace only
    "bad_text_encoding",       # caption bytes are not valid UTF-8
    "empty_image",             # zero-byte image
    "corrupt_image",           # undecodable or truncated image data
    "image_too_large",         # over the decompression-bomb pixel limit
    "image_too_small",         # a side below the minimum
    "unsupported_image_mode",  # e.g. float images (mode "F") whose range is unknown
    "unpaired_member",         # a tar member group with neither image nor caption (e.g. json)
    "corrupt_record",          # an ArrayRecord record that is not in the format above
    "corrupt_shard",           # a tar shard that stops being readable (rest of it skipped)
)
REASON_INDEX = {r: i for i, r in enumerate(SKIP_REASONS)}


class Skip(NamedTuple):
    """Flows through the pipeline in place of a record that must be dropped."""
    reason: str
    key: str = ""


def encode_record(image: bytes, txt: str | Sequence[str], key: str = "",
                  meta: Mapping[str, Any] | None = None) -> bytes:
    """One image-text pair -> bytes for an ArrayRecord file."""
    header = json.dumps({"key": key, "txt": txt if isinstance(txt, str) else list(txt),
                         "meta": dict(meta or {})}, ensure_ascii=False).encode("utf-8")
    return MAGIC + struct.pack("<I", len(header)) + header + bytes(image)


def decode_record(data: bytes) -> dict[str, Any]:
    """Bytes from `encode_record` -> {"key", "txt", "meta", "image"}; ValueError if malformed."""
    if len(data) < 8 or data[:4] != MAGIC:
        raise ValueError("not a PLR1 record (bad magic)")
    (n,) = struct.unpack("<I", data[4:8])
    if 8 + n > len(data):
        raise ValueError("record header runs past the end of the record")
    header = json.loads(data[8:8 + n].decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError("record header is not a JSON object")
    header["image"] = data[8 + n:]
    return header


def raw_from_record_bytes(data: bytes, rng_key: tuple[int, ...]) -> dict[str, Any] | Skip:
    """ArrayRecord element -> raw record (or Skip("corrupt_record"))."""
    try:
        rec = decode_record(data)
    except (ValueError, UnicodeDecodeError, struct.error):
        return Skip("corrupt_record", f"record {rng_key[-1]}")
    meta = rec.get("meta") or {}
    label = meta.get("label") if isinstance(meta, dict) else None
    return {"image": rec["image"], "txt": rec.get("txt"), "key": str(rec.get("key", "")),
            "label": label, "rng_key": rng_key}


def count_vector(counts: Mapping[str, int] | None = None) -> np.ndarray:
    """Skip counts as an int64 vector ordered like SKIP_REASONS (the in-batch format)."""
    out = np.zeros(len(SKIP_REASONS), np.int64)
    for reason, n in (counts or {}).items():
        out[REASON_INDEX[reason]] += n
    return out
