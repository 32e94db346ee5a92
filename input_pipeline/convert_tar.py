"""Tar shards -> ArrayRecord files (one per shard), validated, resumable and atomic.

Each shard `.../NAME.tar` becomes `OUT/NAME.array_record` (records in `records.py` format:
the original image bytes, the UTF-8 caption, the key and the `.json` metadata) plus
`OUT/NAME.stats.json` (counts written / skipped per reason). Records the pipeline would drop
(`records.SKIP_REASONS`) are dropped here already and counted, so the ArrayRecord data is clean
and its random access order is exact.

Atomicity: a shard is written under a temporary name `.NAME.array_record.tmp-*` and renamed
when complete, after its stats file. The final name therefore only ever exists complete; a
killed run leaves at most temporary files (cleaned by the next run) and re-running skips the
shards already converted.
"""
from __future__ import annotations

import collections
import concurrent.futures
import glob
import json
import multiprocessing
import os
import time
import uuid
from typing import Any, Sequence

from input_pipeline import shards as paths_lib
from input_pipeline.decode import decode_captions, load_rgb
from input_pipeline.records import SKIP_REASONS, Skip, encode_record
from input_pipeline.tar_source import iter_shard

SUMMARY_FILE = "conversion_summary.json"


def shard_name(path: str) -> str:
    base = os.path.basename(path.rstrip("/"))
    for suffix in (".tar.gz", ".tgz", ".tar"):
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base


def convert_shard(src: str, output_dir: str, check_images: bool = True,
                  max_image_pixels: int = 50_000_000, min_image_side: int = 8
                  ) -> dict[str, Any]:
    """Converts one shard (or returns the stats of an earlier run); counts per outcome."""
    from array_record.python.array_record_module import ArrayRecordWriter
    name = shard_name(src)
    final = os.path.join(output_dir, f"{name}.array_record")
    stats_path = os.path.join(output_dir, f"{name}.stats.json")
    if os.path.exists(final) and os.path.exists(stats_path):
        with open(stats_path) as f:
            return {**json.load(f), "resumed": True}
    tag = f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = os.path.join(output_dir, f".{name}.array_record.{tag}")
    counts: collections.Counter = collections.Counter()
    writer = ArrayRecordWriter(tmp, "group_size:1")
    open_writer = True
    try:
        for _, raw in iter_shard(src, 0, 0):
            if isinstance(raw, Skip):
                counts[raw.reason] += 1
                continue
            captions = decode_captions(raw["txt"])
            if isinstance(captions, Skip):
                counts[captions.reason] += 1
                continue
            if check_images:   # a full decode: catches truncation, not just a bad header
                img = load_rgb(raw["image"], max_image_pixels, min_image_side)
                if isinstance(img, Skip):
                    counts[img.reason] += 1
                    continue
            meta = {}
            if raw.get("json"):
                try:
                    meta["json"] = json.loads(raw["json"].decode("utf-8"))
                except (UnicodeDecodeError, ValueError):
                    counts["bad_json_dropped"] += 1   # optional metadata: the record is kept
            writer.write(encode_record(raw["image"], captions[0] if len(captions) == 1
                                       else captions, raw["key"], meta))
            counts["written"] += 1
        writer.close()
        open_writer = False
        stats = {"shard": src, "output": final, "written": counts.pop("written", 0),
                 "skipped": {r: counts.get(r, 0) for r in SKIP_REASONS},
                 "bad_json_dropped": counts.get("bad_json_dropped", 0)}
        with open(f"{stats_path}.{tag}", "w") as f:
            json.dump(stats, f, indent=1)
        os.replace(f"{stats_path}.{tag}", stats_path)
        os.replace(tmp, final)   # last: the final name appears only when complete
        return {**stats, "resumed": False}
    finally:   # on any error: no partial output under any name
        if open_writer:
            writer.close()
        for path in (tmp, f"{stats_path}.{tag}"):
            if os.path.exists(path):
                os.remove(path)


def _remove_stale_temporaries(output_dir: str, min_age_s: float = 3600) -> int:
    """Deletes temporaries of killed runs (old enough not to belong to a live one)."""
    stale = glob.glob(os.path.join(output_dir, ".*.array_record.tmp-*")) + glob.glob(
        os.path.join(output_dir, "*.stats.json.tmp-*"))
    now, removed = time.time(), 0
    for path in stale:
        if now - os.path.getmtime(path) > min_age_s:
            os.remove(path)
            removed += 1
    return removed


def convert(inputs: str | Sequence[str], output_dir: str, num_workers: int = 0,
            check_images: bool = True, progress: bool = True) -> dict[str, Any]:
    """Converts all shards matching `inputs` (brace patterns, globs) into `output_dir`.

    Returns (and writes to OUT/conversion_summary.json) the totals over all shards.
    """
    files = paths_lib.expand_paths(inputs)
    names = collections.Counter(shard_name(f) for f in files)
    dupes = [n for n, c in names.items() if c > 1]
    if dupes:
        raise ValueError(f"Several input shards share the name {dupes[0]!r}; their outputs "
                         "would collide. Convert them into different output folders.")
    os.makedirs(output_dir, exist_ok=True)
    _remove_stale_temporaries(output_dir)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(files), unit="shard", desc="tar -> array_record")
    results = []

    def _done(stats: dict[str, Any]) -> None:
        results.append(stats)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(written=sum(r["written"] for r in results),
                            skipped=sum(sum(r["skipped"].values()) for r in results))

    if num_workers > 0:
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(num_workers, mp_context=ctx) as pool:
            futures = [pool.submit(convert_shard, f, output_dir, check_images) for f in files]
            for fut in concurrent.futures.as_completed(futures):
                _done(fut.result())
    else:
        for f in files:
            _done(convert_shard(f, output_dir, check_images))
    if bar is not None:
        bar.close()
    results.sort(key=lambda r: r["output"])
    summary = {
        "num_shards": len(results), "resumed_shards": sum(r["resumed"] for r in results),
        "written": sum(r["written"] for r in results),
        "skipped": {k: sum(r["skipped"].get(k, 0) for r in results) for k in SKIP_REASONS},
        "outputs": [os.path.basename(r["output"]) for r in results]}
    summary["skipped_total"] = sum(summary["skipped"].values())
    tmp = os.path.join(output_dir, f"{SUMMARY_FILE}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(tmp, os.path.join(output_dir, SUMMARY_FILE))
    return summary
