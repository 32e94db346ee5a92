"""data.source = "coco_karpathy", "flickr30k", "cub": caption datasets with several captions per
image, read from their usual files (input_pipeline/captions.py: the readers, the index, noisy
correspondence), by random access."""
from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from input_pipeline import captions
from input_pipeline.sources import get
from input_pipeline.sources.base import DataSource, Records


def _karpathy(cfg: Any, splits: Sequence[str], captions_per_image: int | None
              ) -> captions.CaptionIndex:
    return captions.read_karpathy(cfg.caption_file, cfg.image_root, splits, cfg.source,
                                  captions_per_image)


def _cub(cfg: Any, splits: Sequence[str], captions_per_image: int | None
         ) -> captions.CaptionIndex:
    return captions.read_cub(cfg.image_root, splits, cfg.class_split_dir, captions_per_image)


class CaptionDataSource(DataSource):
    """One caption dataset: its splits, the fields it needs, its reader."""

    def __init__(self, name: str, needs: tuple[str, ...], reader: Callable[..., Any],
                 captions_per_image: int | None = None, has_classes: bool = False,
                 evaluate_with: Callable[[Any], tuple[str, str]] | None = None):
        self.name, self.needs, self.reader = name, needs, reader
        self.splits, self.default_splits = captions.CAPTION_SPLITS[name], captions.DEFAULT_SPLITS[name]
        self.captions_per_image = captions_per_image   # when data.captions_per_image is None
        self.has_classes = has_classes   # class labels: data.positive_level="class" works
        self._evaluate_with = evaluate_with

    def check(self, cfg: Any) -> None:
        for split in cfg.splits:
            if split not in self.splits:
                raise ValueError(f"data.splits: unknown split {split!r} for data.source="
                                 f"{self.name!r}; known: {self.splits}.")
        if cfg.positive_level == "class" and not self.has_classes:
            raise ValueError(f"data.positive_level='class' needs class labels, which only "
                             f"data.source='cub' has (got {self.name!r}).")
        for name in self.needs:
            if not getattr(cfg, name):
                raise ValueError(f"data.source={self.name!r} needs data.{name}.")

    def load_index(self, cfg: Any) -> captions.CaptionIndex:
        """The CaptionIndex of `cfg`, noise applied."""
        per_image = self.captions_per_image if cfg.captions_per_image is None else cfg.captions_per_image
        index = self.reader(cfg, tuple(cfg.splits) or self.default_splits, per_image)
        index.positive_ids(cfg.positive_level)   # checks the level
        if cfg.noise_ratio:
            index.add_noise(cfg.noise_ratio, cfg.noise_seed)
        return index

    def read(self, cfg: Any, **order: Any) -> Records:
        items = captions.CaptionSource(self.load_index(cfg), cfg.caption_iteration,
                                       cfg.positive_level)
        settings = json.dumps({
            "splits": list(cfg.splits), "class_split_dir": cfg.class_split_dir,
            "captions_per_image": cfg.captions_per_image, "iteration": cfg.caption_iteration,
            "positive_level": cfg.positive_level, "noise_ratio": cfg.noise_ratio,
            "noise_seed": cfg.noise_seed})
        return Records(files=[cfg.caption_file, cfg.image_root], settings=[settings], items=items,
                       to_raw=captions.ToRaw())

    def evaluate_with(self, cfg: Any) -> tuple[str, str]:
        return self._evaluate_with(cfg) if self._evaluate_with else super().evaluate_with(cfg)


def load_index(cfg: Any) -> captions.CaptionIndex:
    """The CaptionIndex of a DataConfig with a caption source, noise applied."""
    return get(cfg.source).load_index(cfg)


# COCO: the first 5 captions by default (the 5-caption protocol, as the retrieval evaluator).
COCO_KARPATHY = CaptionDataSource(
    "coco_karpathy", ("caption_file", "image_root"), _karpathy, captions_per_image=5,
    evaluate_with=lambda cfg: ("coco.py", f" --config.karpathy_json={cfg.caption_file} "
                                          f"--config.image_root={cfg.image_root}"))
FLICKR30K = CaptionDataSource("flickr30k", ("caption_file", "image_root"), _karpathy)
CUB = CaptionDataSource("cub", ("image_root",), _cub, has_classes=True,
                        evaluate_with=lambda cfg: ("cub.py", f" --config.root={cfg.image_root}"))
