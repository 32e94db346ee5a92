"""data.source="demo": the synthetic shapes dataset (input_pipeline/demo), built and cached on
first use from `data.demo` (DemoConfig fields + "cache_dir", + "split", default "train"), with
its own word-level tokenizer."""
from __future__ import annotations

from typing import Any

from input_pipeline import demo
from input_pipeline.sources.array_record import read_files
from input_pipeline.sources.base import DataSource, Records


def open_demo(cfg: Any) -> tuple[Any, str]:
    """(the DemoDataset of data.demo, the split to read)."""
    kwargs = dict(cfg.demo)
    split = kwargs.pop("split", "train")
    return demo.get_demo(**kwargs), split


def run_kwargs(cfg: Any, context_length: int) -> dict[str, Any]:
    """`demo.get_demo` kwargs of a run: `data.demo` with the model's context length (part of
    the cache key), so whoever else opens the run's dataset finds the same cache folder."""
    return {"context_length": context_length, **(cfg.demo or {})}


class DemoSource(DataSource):
    name = "demo"
    own_tokenizer = True

    def read(self, cfg: Any, **order: Any) -> Records:
        ds, split = open_demo(cfg)
        return read_files([ds.split_path(split)])

    def tokenizer(self, cfg: Any) -> Any:
        return open_demo(cfg)[0].tokenizer()

    def for_model(self, cfg: Any, context_length: int) -> Any:
        return cfg.replace(tokenizer=None, demo=run_kwargs(cfg, context_length))

    def evaluate_with(self, cfg: Any) -> tuple[str, str]:
        return "demo.py", ""


SOURCE = DemoSource()
