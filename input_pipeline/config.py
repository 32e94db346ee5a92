"""`DataConfig`: every knob of the input pipeline, built from a config-like mapping.

`from_mapping` parses `config.data` (an ml_collections ConfigDict or a plain dict) like every
other section (prolip_jax/runtime/schema.py): an unknown key names the nearest field and an
ill-typed value its type, so a typo in `--config.data.x=...` is caught at start. What the
source needs (data.path, ...) is asked by `check_source` when the data is read, not at parse
time: a config may leave its paths to the command line or to a later step.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from input_pipeline import sources, transforms
from prolip_jax.core.normalization import NORMALIZATIONS
from prolip_jax.runtime import schema

ITERATIONS = ("per_caption", "per_image")
POSITIVE_LEVELS = ("image", "class")
IMAGE_DTYPES = ("float32", "uint8")


def _check_weights(weights: Any, what: str, n: int) -> None:
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence) or len(weights) != n:
        raise ValueError(f"{what}: {weights!r} is not one weight per source ({n} sources in data.mixture).")
    if any(not isinstance(w, (int, float)) or isinstance(w, bool) or not w >= 0 for w in weights):
        raise ValueError(f"{what}: {list(weights)} has a negative or non-numeric weight; weights are >= 0.")
    if not sum(weights) > 0:
        raise ValueError(f"{what} are all zero: give at least one source a positive weight.")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Input pipeline configuration (field comments give the meaning and the default's origin)."""
    # A name in input_pipeline/sources REGISTRY; "auto" becomes the one data.path's names say.
    source: str = dataclasses.field(default="array_record",
                                    metadata={"choices": tuple(sources.REGISTRY)})
    path: str | Sequence[str] = ""      # tar / array_record: files, globs, brace patterns;
                                        # csv: the listing file
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
    # Augmentation (naver-ai/prolip scripts/*.sh and src/prolip_train/params.py). `augment=False` trains on the eval transform.
    augment: bool = True
    crop_scale: tuple[float, float] = (0.8, 1.0)
    crop_ratio: tuple[float, float] = (3 / 4, 4 / 3)
    color_jitter: tuple[float, float, float, float] = (0.32, 0.32, 0.32, 0.08)
    color_jitter_prob: float = 0.8
    grayscale_prob: float = 0.2
    color_jitter_impl: str = "fast"     # "fast" (one colour matrix) or "torchvision"
    normalization: str = "openai"       # "openai" (reference) or "0.5" (SigLIP)
    # float32: normalised on the host. uint8: raw pixels, 4x less to move; call
    # `prolip_jax.core.normalization.normalize_on_device(images, normalization)` in the step.
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
    # Caption sources (coco_karpathy, flickr30k, cub; input_pipeline/captions.py).
    caption_file: str = ""              # Karpathy dataset_coco.json / dataset_flickr30k.json
    image_root: str = ""                # COCO root (<filepath>/<filename>: train2014/...),
                                        # Flickr30K image folder, or CUB root (images/, text_c10/)
    splits: Sequence[str] = ()          # of captions.CAPTION_SPLITS; () = DEFAULT_SPLITS: train+restval
                                        # (COCO, 113,287 images), train (Flickr30K), trainval (CUB)
    class_split_dir: str = ""           # cub: folder of <split>classes.txt; "" = image_root
    # The first k captions of each image; None: 5 for COCO (the 5-caption protocol, as the
    # retrieval evaluator), all otherwise (Flickr30K has 5, CUB 10); 0: all.
    captions_per_image: int | None = None
    # per_caption: every (image, caption) pair once per epoch; per_image: every image once per
    # epoch with a caption drawn from (seed, epoch, image). Both resume exactly.
    caption_iteration: str = "per_caption"
    # What batch["image_id"] holds: "image" (the dataset's image id: captions of one image are
    # positives) or "class" (cub only: DAA §5.1.1, all pairs of a class are positives).
    positive_level: str = "image"
    # Noisy correspondence (PCME++ §3.2, after NCR): the share of training pairs whose
    # captions are shuffled among themselves (the papers use 0.2 and 0.5); in [0, 1).
    noise_ratio: float = 0.0
    noise_seed: int = 0                 # which pairs; apart from `seed` (same noise, any order)
    # csv (sources/csv_listing.py): the listing's columns, as open_clip's --csv-img-key,
    # --csv-caption-key and --csv-separator (its defaults; the separator for .csv/.tsv only).
    csv_img_key: str = "filepath"
    csv_caption_key: str = "title"
    csv_separator: str = "\t"
    # Mixtures (input_pipeline/mixture.py): several sources, each a mapping of the data fields it
    # sets over this section's (source, path, caption_file, ...) plus "weight" (>= 0) and an
    # optional "name" (its metrics: data/<name>/...); () reads the one source above.
    mixture: Sequence[Mapping[str, Any]] = ()
    # Weights that change during training: ((step, (w_0, w_1, ...)), ...), steps increasing;
    # the batches from `step` on (0-based batch index) draw with these weights.
    mixture_stages: Sequence[tuple[int, Sequence[float]]] = ()
    # The chunks of a batch; each comes from one source (the proportions' granularity).
    mixture_chunks: int = 16

    def __post_init__(self):
        if self.source not in sources.REGISTRY:
            raise ValueError(f"data.source={self.source!r} is not one of {tuple(sources.REGISTRY)}")
        if self.path:   # without one, check_source says what is missing
            object.__setattr__(self, "source", self.data_source().resolve(self))
        if self.image_dtype not in IMAGE_DTYPES:
            raise ValueError(f"data.image_dtype must be one of {IMAGE_DTYPES}, got "
                             f"{self.image_dtype!r}.")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"data.normalization must be one of "
                             f"{sorted(NORMALIZATIONS)}, got {self.normalization!r}.")
        for name in ("batch_size", "image_size", "shuffle_buffer_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}.")
        for name in ("num_workers", "read_threads", "seed", "noise_seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"data.{name} must be >= 0, got {getattr(self, name)}.")
        if self.max_truncated_share is not None and not 0 <= self.max_truncated_share <= 1:
            raise ValueError(f"data.max_truncated_share must be None or in [0, 1], got "
                             f"{self.max_truncated_share}.")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ValueError(f"data.num_epochs must be None or >= 1, got {self.num_epochs}.")
        self._check_captions()
        self._check_mixture()
        self.augment_config()   # validates the augmentation fields

    def check_source(self) -> None:
        """ValueError, one line naming the field, for what the source needs (data.path, ...) and
        refuses; asked by whoever reads the data, before any I/O."""
        if self.source == sources.AUTO:
            self.data_source().resolve(self)   # raises: it has no data.path to go by
        source = self.data_source()
        if source.draws_batches:
            raise ValueError(f"data.source={self.source!r} draws its batches itself: the input "
                             "pipeline reads no records for it.")
        source.check(self)

    def data_source(self) -> sources.DataSource:
        """The registered source of `source` (input_pipeline/sources/)."""
        return sources.get(self.source)

    def _check_mixture(self) -> None:
        """The mixture's weights and stages (each source's own fields are parsed when it is read,
        input_pipeline/mixture.py `parts`)."""
        if not self.mixture:
            if self.mixture_stages:
                raise ValueError("data.mixture_stages needs data.mixture (the sources whose weights it sets).")
            return
        n = len(self.mixture)
        for i, entry in enumerate(self.mixture):
            if not isinstance(entry, Mapping) or "weight" not in entry:
                raise ValueError(f"data.mixture[{i}] must be a mapping of data fields with a 'weight', got {entry!r}.")
            if "mixture" in entry or "mixture_stages" in entry:
                raise ValueError(f"data.mixture[{i}] sets a mixture of its own: mixtures do not nest.")
        names = [str(e.get("name") or "") for e in self.mixture]
        if len({x for x in names if x}) != len([x for x in names if x]):
            raise ValueError(f"data.mixture names its sources {names}: each name once (they name the metrics).")
        _check_weights([e["weight"] for e in self.mixture], "data.mixture weights", n)
        steps = [s[0] if isinstance(s, Sequence) and len(s) == 2 else None for s in self.mixture_stages]
        if None in steps or any(not isinstance(x, int) or x < 0 for x in steps):
            raise ValueError(f"data.mixture_stages must be ((step, (w_0, ..., w_{n - 1})), ...) with steps >= 0, "
                             f"got {self.mixture_stages!r}.")
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"data.mixture_stages steps {steps} are out of order: list the stages by increasing step.")
        for step, weights in self.mixture_stages:
            _check_weights(weights, f"data.mixture_stages weights at step {step}", n)
        if self.mixture_chunks < 1 or self.batch_size % self.mixture_chunks:
            raise ValueError(f"data.mixture_chunks={self.mixture_chunks} must divide data.batch_size="
                             f"{self.batch_size}: set --config.data.mixture_chunks to one of its divisors.")

    def _check_captions(self) -> None:
        if self.caption_iteration not in ITERATIONS:
            raise ValueError(f"data.caption_iteration must be one of {ITERATIONS}, got "
                             f"{self.caption_iteration!r}.")
        if self.positive_level not in POSITIVE_LEVELS:
            raise ValueError(f"data.positive_level must be one of {POSITIVE_LEVELS}, got "
                             f"{self.positive_level!r}.")
        if not 0 <= self.noise_ratio < 1:
            raise ValueError(f"data.noise_ratio must be in [0, 1), got {self.noise_ratio}.")
        if self.captions_per_image is not None and self.captions_per_image < 0:
            raise ValueError(f"data.captions_per_image must be None or >= 0, got "
                             f"{self.captions_per_image}.")

    @classmethod
    def from_mapping(cls, config: "Mapping[str, Any] | DataConfig", where: str = "data"
                     ) -> "DataConfig":
        """`config` parsed against the fields above (`where` names it in messages)."""
        if isinstance(config, DataConfig):
            return config
        values = schema.plain(config)
        if isinstance(values.get("splits"), str):   # --config.data.splits=train,restval
            values["splits"] = tuple(s for s in values["splits"].split(",") if s)
        return schema.parse(cls, values, where)

    def replace(self, **kwargs: Any) -> "DataConfig":
        return dataclasses.replace(self, **kwargs)

    def augment_config(self) -> transforms.AugmentConfig | None:
        if not self.augment:
            return None
        return transforms.AugmentConfig(
            crop_scale=tuple(self.crop_scale), crop_ratio=tuple(self.crop_ratio),
            color_jitter=tuple(self.color_jitter), color_jitter_prob=self.color_jitter_prob,
            grayscale_prob=self.grayscale_prob, color_jitter_impl=self.color_jitter_impl)
