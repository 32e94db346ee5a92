"""Caption-set files read by both the training sources (input_pipeline/captions.py) and the
evaluators' readers (evaluators/retrieval_data.py, evaluators/zeroshot.py): Karpathy split
files, one-item-per-line / JSON lists, and which file names are images.

It imports only the core's path layer (local folders or buckets), so everything that reads these
files can import it.
"""
from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from prolip_jax.runtime import paths as fs

IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".webp")


def need(path: str, what: str, who: str = "retrieval evaluator") -> str:
    """`path`, or FileNotFoundError "<who>: <what> not found: <path>"."""
    if not fs.exists(path):
        raise FileNotFoundError(f"{who}: {what} not found: {path}")
    return path


def read_list(path: str, what: str) -> list[str]:
    """A JSON list or a text file, one item per line."""
    if not fs.exists(path):
        raise FileNotFoundError(f"{what} file {path!r} does not exist")
    with fs.open(path, "r") as f:
        if path.endswith(".json"):
            out = json.load(f)
            if not isinstance(out, list):
                raise ValueError(f"{what} file {path!r} must hold a JSON list")
            return [str(x) for x in out]
        return [line.rstrip("\n") for line in f if line.strip()]


def read_karpathy(json_path: str, splits: Sequence[str], who: str = "Karpathy split"
                  ) -> tuple[str, list[dict[str, Any]]]:
    """(dataset name, the entries of `splits` in file order) of a Karpathy split file
    (dataset_coco.json / dataset_flickr30k.json: {"dataset", "images": [{"filepath"?,
    "filename", "split", "cocoid" | "imgid", "sentences": [{"raw"}, ...]}, ...]}).
    Shared by the retrieval evaluator (karpathy) and the training source (captions.py);
    errors name the file and, for a malformed entry, the entry."""
    with fs.open(need(json_path, "Karpathy split file", who), "r") as f:
        meta = json.load(f)
    if not isinstance(meta, dict) or not isinstance(meta.get("images"), list):
        raise ValueError(f"{who}: {json_path} is not a Karpathy split file (no 'images' list)")
    name = meta.get("dataset", os.path.splitext(os.path.basename(json_path))[0])
    entries = []
    for i, e in enumerate(meta["images"]):
        if not isinstance(e, dict) or "filename" not in e or "sentences" not in e:
            raise ValueError(f"{who}: {json_path} entry {i} lacks 'filename' or 'sentences': "
                             f"{str(e)[:200]}")
        if e.get("split") in splits:
            entries.append(e)
    if not entries:
        raise ValueError(f"{who}: no images with split {' or '.join(map(repr, splits))} in "
                         f"{json_path}")
    return name, entries


def karpathy_image_path(image_root: str, entry: Mapping[str, Any], flat: bool = False) -> str:
    """image_root/filepath/filename (COCO's train2014/, val2014/), or image_root/filename
    (flat=True; Flickr30K, or COCO images gathered in one folder)."""
    if flat:
        return fs.join(image_root, entry["filename"])
    return fs.join(image_root, entry.get("filepath", ""), entry["filename"])
