"""Input pipeline: grain sources, image/text transforms, tokenizers, demo data.

    from input_pipeline import build_train_iterator
    it = build_train_iterator(config.data, tokenizer)     # per-host batches, see pipeline.py

Modules: config (DataConfig), pipeline (builders, InputIterator), sources/ (one module per
data.source and the REGISTRY of them: tar, array_record, tfds, demo, the caption datasets, csv
listings, auto, random), epoch_order (the exact order of random-access records), captions (COCO /
Flickr30K Karpathy and CUB readers, noisy correspondence), tar_source (streaming webdataset
shards), decode + transforms (images, captions, augmentation), records (record format, skip
reasons), convert_tar (tar -> ArrayRecord), tokenizers, demo, synthetic (test/benchmark data).

The names below are imported lazily, so `import input_pipeline.tokenizers` stays light (grain,
PIL and the rest load on first use).
"""
import importlib

_LAZY = {
    "DataConfig": "input_pipeline.config",
    "build_train_iterator": "input_pipeline.pipeline",
    "build_eval_iterator": "input_pipeline.pipeline",
    "build_dataset": "input_pipeline.pipeline",
    "InputIterator": "input_pipeline.pipeline",
    "SKIP_REASONS": "input_pipeline.records",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'input_pipeline' has no attribute {name!r}")
