"""data.source="csv": image-text pairs listed in a CSV/TSV or Parquet file, open_clip's
`--dataset-type csv` convention (its CsvDataset): a column of image paths, a column of captions.

    --config.data.source=csv --config.data.path=/data/train.csv
    (defaults as open_clip's: --config.data.csv_img_key=filepath --config.data.csv_caption_key=title,
     --config.data.csv_separator=<tab> for .csv/.tsv; .parquet by its extension, with pyarrow)

An image path is absolute (or a URL) or relative to the listing's folder. The listing is read
once, the same on every host; the images are read by the reading threads / worker processes,
so the records are random access: exact resumption on any host and worker layout, as ArrayRecord.
A sample of up to 32 listed images is checked at start (a wrong folder fails there, naming the
file); one that is missing later is skipped and counted ("missing_image"), as in the caption
sources (stat-ing every file of a large listing costs minutes on network storage).
"""
from __future__ import annotations

import csv
import io
import json
import os
from typing import Any, Sequence

from input_pipeline.captions import ToRaw
from input_pipeline.sources.base import DataSource, Records
from prolip_jax.runtime import paths as fs

_SAMPLE_CHECKED = 32


def _columns_csv(path: str, separator: str) -> dict[str, list[Any]]:
    with io.TextIOWrapper(fs.open(path, "rb"), encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter=separator)
        header = next(reader, [])
        rows = list(reader)
    return {name: [row[i] if i < len(row) else None for row in rows]
            for i, name in enumerate(header)}


def _columns_parquet(path: str, keys: Sequence[str]) -> dict[str, list[Any]]:
    try:   # an optional dependency: only Parquet listings need it
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"data.path={path} is a Parquet file, which needs pyarrow: "
                          "pip install pyarrow") from None
    with fs.open(path, "rb") as f:
        table = pq.read_table(f)
    return {name: table.column(name).to_pylist() if name in keys else []
            for name in table.column_names}


def read_listing(path: str, img_key: str, caption_key: str, separator: str
                 ) -> tuple[list[str], list[Any]]:
    """(image paths as read, captions) of the listing; ValueError naming a missing column."""
    if path.lower().endswith(".parquet"):
        columns = _columns_parquet(path, (img_key, caption_key))
    else:
        columns = _columns_csv(path, separator)
    for key, flag in ((img_key, "csv_img_key"), (caption_key, "csv_caption_key")):
        if key not in columns:
            found = ", ".join(repr(c) for c in list(columns)[:8]) or "none"
            found += f" and {len(columns) - 8} more" if len(columns) > 8 else ""
            if not path.lower().endswith(".parquet"):   # a wrong separator reads one column
                found += f"; split at {separator!r}, --config.data.csv_separator"
            raise ValueError(f"data.path={path} has no column {key!r} (its columns: {found}): "
                             f"set --config.data.{flag}")
    return ["" if p is None else str(p) for p in columns[img_key]], columns[caption_key]


class Listing:
    """Random-access records: [i] -> {"path", "txt", "key"}, no I/O (ToRaw reads the image)."""

    def __init__(self, path: str, image_paths: Sequence[str], captions: Sequence[Any]):
        self.name, self.image_paths, self.captions = os.path.basename(path), list(image_paths), list(captions)

    def __len__(self) -> int:
        return len(self.image_paths)

    def __getitem__(self, i: int) -> dict[str, Any]:
        txt = self.captions[i]
        return {"path": self.image_paths[i], "txt": None if txt is None else str(txt),
                "key": f"{self.name} row {i}"}


def _resolved(listing: str, image: str) -> str:
    if not image or fs.is_url(image) or os.path.isabs(image):
        return image
    folder = listing.rsplit("/", 1)[0] if fs.is_url(listing) else os.path.dirname(listing)
    return fs.join(folder, image) if folder else image


def open_listing(cfg: Any) -> Listing:
    """The Listing of data.path with its image paths resolved; one-line errors for an empty
    listing and a sampled image that does not exist."""
    path = os.fspath(cfg.path)
    if not fs.is_url(path):
        path = fs.local(path)
    if not fs.isfile(path):
        raise FileNotFoundError(f"data.path={path} does not exist (data.source='csv' reads one "
                                "listing file: --config.data.path)")
    images, captions = read_listing(path, cfg.csv_img_key, cfg.csv_caption_key, cfg.csv_separator)
    if not images:
        raise ValueError(f"data.path={path} lists no image-text pairs (an empty listing)")
    images = [_resolved(path, p) for p in images]
    step = max(1, len(images) // _SAMPLE_CHECKED)
    for i in range(0, len(images), step)[:_SAMPLE_CHECKED]:
        if not fs.isfile(images[i]):
            raise FileNotFoundError(
                f"data.path={path}: the image of row {i}, {images[i]}, does not exist (column "
                f"{cfg.csv_img_key!r}: paths absolute or relative to the listing's folder)")
    return Listing(path, images, captions)


class CsvSource(DataSource):
    name = "csv"
    path_hint = "a .csv, .tsv or .parquet file listing image paths and captions"

    def check(self, cfg: Any) -> None:
        super().check(cfg)
        if len(cfg.csv_separator) != 1:
            raise ValueError(f"data.csv_separator must be one character, got "
                             f"{cfg.csv_separator!r}: set --config.data.csv_separator")
        if not cfg.csv_img_key or not cfg.csv_caption_key:
            raise ValueError("data.source='csv' needs column names: set "
                             "--config.data.csv_img_key and --config.data.csv_caption_key")

    def read(self, cfg: Any, **order: Any) -> Records:
        listing = open_listing(cfg)
        settings = json.dumps({"img_key": cfg.csv_img_key, "caption_key": cfg.csv_caption_key,
                               "separator": cfg.csv_separator})
        return Records(files=[os.fspath(cfg.path)], settings=[settings], items=listing, to_raw=ToRaw())


SOURCE = CsvSource()
