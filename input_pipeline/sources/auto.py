"""data.source="auto": the source data.path's names say (paths.source_of_paths: .tar shards,
.array_record shards, or one .csv/.tsv/.parquet listing); the config holds the name resolved."""
from __future__ import annotations

from typing import Any

from input_pipeline import shards as paths_lib
from input_pipeline.sources.base import SHARDS_HINT, DataSource


class AutoSource(DataSource):
    name = "auto"
    path_hint = SHARDS_HINT

    def resolve(self, cfg: Any) -> str:
        if not cfg.path:
            raise ValueError("data.source='auto' needs data.path (tar or array_record shards).")
        return paths_lib.source_of_paths(cfg.path)


SOURCE = AutoSource()
