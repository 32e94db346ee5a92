"""`DataConfig`: every knob of the input pipeline, built from a config-like mapping.

The trainer passes `config.data` (an ml_collections ConfigDict or a plain dict); unknown keys
are an error that lists the valid ones, so a typo in `--config.data.x=...` is caught at start.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from input_pipeline import transforms

SOURCES = ("array_record", "tar", "tfds", "demo")
IMAGE_DTYPES = ("float32", "uint8")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Input pipeline configuration (field comments give the meaning and the default's origin)."""
    source: str = "array_record"        # one of SOURCES
    path: str | Sequence[str] = ""      # tar / array_record: files, globs, brace patterns
    batch_size: int = 256               # GLOBAL batch size; each host yields batch/P rows
    image_size: int = 224
    seed: int = 0
    shuffle: bool = True                # train only; eval never shuffles
    num_epochs: int | None = None       # None: repeat forever (what a step-based trainer wants)
    # Parallelism: grain worker processes per host, each with `read_threads` threads
    # (array_record / tfds) that overlap I/O and decoding (PIL releases the GIL).
    num_workers: int = 0
    per_worker_buffer_size: int = 2     # batches each worker prepares ahead
    read_threads: int = 2
    read_buffer_size: int = 64          # records each process reads ahead
    shuffle_buffer_size: int = 2_000    # tar: records per shuffle window, per worker
    # Augmentation (REFERENCE §5). `augment=False` trains on the eval transform.
    augment: bool = True
    crop_scale: tuple[float, float] = (0.8, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    color_jitter: tuple[float, float, float, float] = (0.32, 0.32, 0.32, 0.08)
    color_jitter_prob: float = 0.8
    grayscale_prob: float = 0.2
    color_jitter_impl: str = "fast"     # "fast" (one colour matrix) or "torchvision"
    normalization: str = "openai"       # "openai" (reference) or "0.5" (SigLIP)
    # float32: normalised on the host. uint8: raw pixels, 4x less to move; call
    # `input_pipeline.transforms.normalize_on_device(images, normalization)` in the step.
    image_dtype: str = "float32"
    # Bad-input limits.
    max_image_pixels: int = 50_000_000  # decompression-bomb guard (checked before decoding)
    min_image_side: int = 8
    # tfds (optional extra `tfds`): tfds.data_source(tfds_name, split=..., data_dir=...).
    tfds_name: str = ""
    tfds_split: str = "train"
    tfds_data_dir: str | None = None
    image_key: str = "image"
    text_key: str = "caption"           # "/"-separated path into nested features
    label_key: str | None = None
    # demo: keyword arguments of `input_pipeline.demo.DemoConfig` (+ "cache_dir").
    demo: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Used when no tokenizer object is passed to the builder:
    # kwargs of `input_pipeline.tokenizers.build_tokenizer(kind, path, context_length, ...)`.
    tokenizer: Mapping[str, Any] | None = None
    # Train: the share of captions cut at the tokenizer's context length (counted as the stat
    # "truncated") above which a warning is logged, once; None: never warn.
    max_truncated_share: float | None = 0.01

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {SOURCES}, got {self.source!r}.")
        if self.image_dtype not in IMAGE_DTYPES:
            raise ValueError(f"data.image_dtype must be one of {IMAGE_DTYPES}, got "
                             f"{self.image_dtype!r}.")
        if self.normalization not in transforms.NORMALIZATIONS:
            raise ValueError(f"data.normalization must be one of "
                             f"{sorted(transforms.NORMALIZATIONS)}, got {self.normalization!r}.")
        for name in ("batch_size", "image_size", "shuffle_buffer_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("num_workers", "read_threads", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"data.{name} must be >= 0, got {getattr(self, name)}.")
        if self.max_truncated_share is not None and not 0 <= self.max_truncated_share <= 1:
            raise ValueError(f"data.max_truncated_share must be None or in [0, 1], got "
                             f"{self.max_truncated_share}.")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"data.num_epochs must be None or >= 1, got {self.num_epochs}.")
        if self.source in ("tar", "array_record") and not self.path:
            raise ValueError(f"data.source={self.source!r} needs data.path (files, globs or a "
                             "brace pattern such as 'shards/{00000..00009}.tar').")
        if self.source == "tfds" and not self.tfds_name:
            raise ValueError("data.source='tfds' needs data.tfds_name, e.g. 'coco_captions'.")
        self.augment_config()   # validates the augmentation fields

    @classmethod
    def from_mapping(cls, config: "Mapping[str, Any] | DataConfig") -> "DataConfig":
        if isinstance(config, DataConfig):
            return config
        if hasattr(config, "to_dict"):   # ml_collections.ConfigDict
            config = config.to_dict()
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"Unknown data config keys {unknown}; valid keys: {sorted(known)}.")
        kwargs = dict(config)
        for name in ("crop_scale", "crop_ratio", "color_jitter"):
            if name in kwargs:
                kwargs[name] = tuple(kwargs[name])
        return cls(**kwargs)

    def replace(self, **kwargs: Any) -> "DataConfig":
        return dataclasses.replace(self, **kwargs)

    def augment_config(self) -> transforms.AugmentConfig | None:
        if not self.augment:
            return None
        return transforms.AugmentConfig(
            crop_scale=tuple(self.crop_scale), crop_ratio=tuple(self.crop_ratio),
            color_jitter=tuple(self.color_jitter), color_jitter_prob=self.color_jitter_prob,
            grayscale_prob=self.grayscale_prob, color_jitter_impl=self.color_jitter_impl)
