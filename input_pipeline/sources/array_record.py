"""data.source="array_record": local ArrayRecord files of this project's record format
(records.py; scripts/tar_to_array_record.py writes them), read by random access."""
from __future__ import annotations

from typing import Any, Sequence

import grain

from input_pipeline import shards as paths_lib
from input_pipeline.records import Skip, raw_from_record_bytes
from input_pipeline.sources.base import SHARDS_HINT, DataSource, Records
from prolip_jax.runtime import paths as fs


def require_local_array_records(paths: Sequence[str]) -> None:
    """array_record's C++ reader (riegeli) opens local files only (the open-source build has no
    GCS reader): a bucket path is refused at start-up, saying what to do (docs/buckets.md)."""
    remote = [p for p in paths if fs.is_url(p)]
    if remote:
        fs.require_local(remote[0], "array_record shards",
                         f"copy them to local disk (gcloud storage cp -r '{remote[0].rsplit('/', 1)[0]}' "
                         "/local/dir) and point data.path there, or use tar shards "
                         "(data.source='tar'), which stream from a bucket")


def array_record_source(paths: Sequence[str]) -> Any:
    """grain's ArrayRecordDataSource over the local files (records in `records.py` format)."""
    require_local_array_records(paths)
    return grain.sources.ArrayRecordDataSource(list(paths))


class ToRaw:
    """(epoch, record index, record bytes) -> raw record (records.py) or Skip."""

    def __call__(self, item: tuple[int, int, Any] | Skip) -> dict[str, Any] | Skip:
        if isinstance(item, Skip):
            return item
        epoch, index, element = item
        return raw_from_record_bytes(element, (epoch, index))


def read_files(files: Sequence[str]) -> Records:
    """Records of ArrayRecord files (also the demo's)."""
    return Records(files=list(files), items=array_record_source(files), to_raw=ToRaw())


class ArrayRecordSource(DataSource):
    name = "array_record"
    path_hint = SHARDS_HINT

    def read(self, cfg: Any, **order: Any) -> Records:
        patterns = paths_lib.split_patterns(cfg.path)
        paths_lib.check_shard_kind(patterns, self.name)  # before globbing a bucket
        require_local_array_records(patterns)
        files = paths_lib.expand_paths(cfg.path)
        paths_lib.check_shard_kind(files, self.name)
        return read_files(files)


SOURCE = ArrayRecordSource()
