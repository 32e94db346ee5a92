"""Data sources: one module each, one line in `REGISTRY`.

    from input_pipeline import sources
    source = sources.get(config.data.source)     # a base.DataSource
    records = source.read(cfg, shuffle=..., num_epochs=..., process_index=h, process_count=p)

A new source is a module here with a `base.DataSource` subclass (its config checks, its
records, its fingerprint parts, its evaluation config; see base.py) and one line below; the
fields it reads are declared in input_pipeline.config.DataConfig beside the others.
"""
from __future__ import annotations

from input_pipeline.sources.base import DataSource, Records
from prolip_jax.runtime import registry

# "module:attribute", imported by `get` when a config names it (as evaluators.REGISTRY): a run
# loads only its own source's dependencies.
REGISTRY: dict[str, str] = {
    "array_record": "input_pipeline.sources.array_record:SOURCE",
    "tar": "input_pipeline.sources.tar:SOURCE",
    "tfds": "input_pipeline.sources.tfds:SOURCE",
    "demo": "input_pipeline.sources.demo:SOURCE",
    "coco_karpathy": "input_pipeline.sources.captions:COCO_KARPATHY",
    "flickr30k": "input_pipeline.sources.captions:FLICKR30K",
    "cub": "input_pipeline.sources.captions:CUB",
    "csv": "input_pipeline.sources.csv_listing:SOURCE",
    "auto": "input_pipeline.sources.auto:SOURCE",
    "random": "input_pipeline.sources.random_batches:SOURCE",
}
AUTO = "auto"        # picks one of the others from data.path's names
RANDOM = "random"    # the trainer's batches of random pixels and tokens: no input pipeline
# The sources the input pipeline reads (the values data.source takes in DataConfig).
READ_BY_THE_PIPELINE = tuple(n for n in REGISTRY if n not in (AUTO, RANDOM))

__all__ = ["AUTO", "DataSource", "RANDOM", "READ_BY_THE_PIPELINE", "REGISTRY", "Records", "get"]


def get(name: str) -> DataSource:
    """The source registered as `name`; ValueError listing the known names."""
    return registry.load(REGISTRY, name, f"unknown data.source {name!r}")
