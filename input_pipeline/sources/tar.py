"""data.source="tar": webdataset shards streamed in shard order (tar_source.py), from local disk
or a bucket. Not random access: resuming on another layout re-deals the shards left to read
(TarStreamDataset.resplit), and the shuffle window's size is part of the data order."""
from __future__ import annotations

from typing import Any

from input_pipeline import shards as paths_lib
from input_pipeline import tar_source
from input_pipeline.sources.base import SHARDS_HINT, DataSource, Records


class TarSource(DataSource):
    name = "tar"
    path_hint = SHARDS_HINT

    def read(self, cfg: Any, *, shuffle: bool, num_epochs: int | None, process_index: int,
             process_count: int) -> Records:
        p, workers = process_count, max(1, cfg.num_workers)
        paths_lib.check_shard_kind(paths_lib.split_patterns(cfg.path), self.name)  # before globbing a bucket
        files = paths_lib.expand_paths(cfg.path)
        paths_lib.check_shard_kind(files, self.name)
        if len(files) < p * workers:
            fix = (f"set --config.data.num_workers={len(files) // p} or fewer, or split the data into "
                   f"{p * workers}+ shards" if len(files) >= p else f"split the data into {p}+ shards")
            raise ValueError(f"{len(files)} tar shards cannot feed {p} hosts x {workers} "
                             f"worker processes (each needs at least one shard): {fix}.")
        stream = tar_source.TarStreamDataset(
            files, seed=cfg.seed, shuffle=shuffle, process_index=process_index, process_count=p,
            num_epochs=num_epochs, shuffle_buffer_size=cfg.shuffle_buffer_size)
        return Records(files=files, stream=stream)

    def spec(self, cfg: Any) -> dict[str, Any]:
        return {"shuffle_buffer_size": cfg.shuffle_buffer_size}


SOURCE = TarSource()
