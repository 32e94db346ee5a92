"""data.source="tfds": a tfds dataset prepared as array_record, by random access
(`tfds.data_source`; the optional extra `pip install 'prolip_jax[tfds]'`, no TensorFlow)."""
from __future__ import annotations

from typing import Any

import numpy as np

from input_pipeline.records import Skip
from input_pipeline.sources.base import DataSource, Records
from prolip_jax.runtime import paths as fs


def tfds_source(name: str, split: str, data_dir: str | None) -> Any:
    """`tfds.data_source(...)`: random access to a tfds dataset prepared as array_record.

    Needs the optional extra (`pip install 'prolip_jax[tfds]'`); TensorFlow is not needed.
    """
    if data_dir:
        fs.require_local(data_dir, "data.tfds_data_dir",
                         "tfds.data_source reads array_record files, which must be local: copy the "
                         f"prepared dataset (gcloud storage cp -r '{data_dir}' /local/dir) and point "
                         "data.tfds_data_dir there")
    try:   # an optional extra: imported only by the runs that read tfds
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError("data.source='tfds' needs tensorflow-datasets: pip install "
                          "'prolip_jax[tfds]' (TensorFlow itself is not needed).") from e
    return tfds.data_source(name, split=split, data_dir=data_dir)


class ToRaw:
    """(epoch, record index, tfds feature dict) -> raw record (records.py) or Skip.
    `text_key` may be a "/"-path into nested features, e.g. "captions/text"."""

    def __init__(self, image_key: str = "image", text_key: str = "caption",
                 label_key: str | None = None):
        self.image_key, self.text_key, self.label_key = image_key, text_key, label_key

    def __call__(self, item: tuple[int, int, Any] | Skip) -> dict[str, Any] | Skip:
        if isinstance(item, Skip):
            return item
        epoch, index, element = item
        txt: Any = element
        for part in self.text_key.split("/"):
            txt = txt.get(part) if isinstance(txt, dict) else None
        label = element.get(self.label_key) if self.label_key else None
        return {"image": element.get(self.image_key), "txt": txt, "key": str(index),
                "label": None if label is None else int(np.asarray(label)),
                "rng_key": (epoch, index)}


class TfdsSource(DataSource):
    name = "tfds"

    def check(self, cfg: Any) -> None:
        if not cfg.tfds_name:
            raise ValueError("data.source='tfds' needs data.tfds_name, e.g. 'coco_captions'.")
        super().check(cfg)

    def read(self, cfg: Any, **order: Any) -> Records:
        items = tfds_source(cfg.tfds_name, cfg.tfds_split, cfg.tfds_data_dir)
        return Records(files=[f"tfds:{cfg.tfds_name}/{cfg.tfds_split}"], items=items,
                       to_raw=ToRaw(cfg.image_key, cfg.text_key, cfg.label_key), relocatable=False)


SOURCE = TfdsSource()
