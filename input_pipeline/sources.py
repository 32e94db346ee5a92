"""Random-access sources (ArrayRecord, tfds) and the exact global order over epochs and hosts.

`EpochOrderDataset` is the heart of exact resumption: element i of host h is a pure function
of (seed, h, P, i), so a grain iterator state (the next index) pins the data order exactly.

    epoch e = i // L,  L = N // P records per host per epoch (the last N % P records of each
    epoch's permutation are dropped so every host has the same number of steps);
    global position p = (i % L) * P + h   (hosts interleave, so they are disjoint and the
    union over hosts covers positions 0 .. L*P-1 of the epoch);
    record r = permutation_e(p)           (grain's index_shuffle: O(1) memory, any N).
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Sequence

import numpy as np
import grain

from input_pipeline.records import Skip, raw_from_record_bytes

_EPOCH_SEED_TAG = 0xE90C


@functools.lru_cache(maxsize=64)
def _epoch_seed(seed: int, epoch: int) -> int:
    """A 32-bit seed per epoch (index_shuffle takes 32 bits), well mixed from (seed, epoch)."""
    return int(np.random.SeedSequence((seed, _EPOCH_SEED_TAG, epoch)).generate_state(1)[0])


class EpochOrderDataset(grain.MapDataset):
    """MapDataset over a random-access source: element i -> (epoch, record index, element)."""

    def __init__(self, parent: grain.MapDataset, *, seed: int, shuffle: bool,
                 process_index: int, process_count: int, num_epochs: int | None):
        super().__init__(parent)
        self._n = len(parent)
        if self._n < process_count:
            raise ValueError(f"The source has {self._n} records, fewer than the "
                             f"{process_count} hosts reading it.")
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index {process_index} is not in [0, {process_count}).")
        self._seed, self._shuffle = seed, shuffle
        self._h, self._p = process_index, process_count
        self._per_epoch = self._n // process_count
        self._num_epochs = num_epochs

    @property
    def records_per_epoch(self) -> int:
        """Records this host reads per epoch."""
        return self._per_epoch

    def __len__(self) -> int:
        if self._num_epochs is None:
            return sys.maxsize
        return self._per_epoch * self._num_epochs

    def record_index(self, index: int) -> tuple[int, int]:
        """Host-local element index -> (epoch, index into the source)."""
        epoch, j = divmod(index, self._per_epoch)
        position = j * self._p + self._h
        if not self._shuffle:
            return epoch, position
        return epoch, int(grain.experimental.index_shuffle(
            position, max_index=self._n - 1, seed=_epoch_seed(self._seed, epoch), rounds=4))

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        if index >= len(self):
            raise IndexError(index)
        epoch, r = self.record_index(index)
        return epoch, r, self._parent[r]

    def __str__(self) -> str:
        return (f"EpochOrderDataset(N={self._n}, host {self._h}/{self._p}, "
                f"shuffle={self._shuffle})")


class ToRaw:
    """(epoch, record index, source element) -> raw record (see records.py) or Skip.

    `kind` is "array_record" (bytes in this project's record format) or "tfds" (a feature
    dict; `text_key` may be a "/"-path into nested features, e.g. "captions/text").
    """

    def __init__(self, kind: str, image_key: str = "image", text_key: str = "caption",
                 label_key: str | None = None):
        self.kind, self.image_key, self.text_key = kind, image_key, text_key
        self.label_key = label_key

    def __call__(self, item: tuple[int, int, Any] | Skip) -> dict[str, Any] | Skip:
        if isinstance(item, Skip):
            return item
        epoch, index, element = item
        rng_key = (epoch, index)
        if self.kind == "array_record":
            return raw_from_record_bytes(element, rng_key)
        txt: Any = element
        for part in self.text_key.split("/"):
            txt = txt.get(part) if isinstance(txt, dict) else None
        label = element.get(self.label_key) if self.label_key else None
        return {"image": element.get(self.image_key), "txt": txt, "key": str(index),
                "label": None if label is None else int(np.asarray(label)),
                "rng_key": rng_key}


def array_record_source(paths: Sequence[str]) -> Any:
    """grain's ArrayRecordDataSource over the files (records in `records.py` format)."""
    return grain.sources.ArrayRecordDataSource(list(paths))


def tfds_source(name: str, split: str, data_dir: str | None) -> Any:
    """`tfds.data_source(...)`: random access to a tfds dataset prepared as array_record.

    Needs the optional extra (`pip install 'prolip_jax[tfds]'`); TensorFlow is not needed.
    """
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise ImportError("data.source='tfds' needs tensorflow-datasets: pip install "
                          "'prolip_jax[tfds]' (TensorFlow itself is not needed).") from e
    return tfds.data_source(name, split=split, data_dir=data_dir)
