"""The exact global order of a random-access source over epochs and hosts.

`EpochOrderDataset` is the heart of exact resumption: element i of host h is a pure function
of (seed, h, P, i, origin), so a grain iterator state (the next index) pins the data order.

    The global stream g = 0, 1, 2, ... runs through epoch after epoch: epoch e = g // N,
    record = permutation_e(g % N) (grain's index_shuffle: O(1) memory, any N).
    The stream left to read is R = {g >= base} minus `done` (a short sorted list of positions
    already read past base); origin (base, done) = (0, []) in a fresh run.
    Host h of P reads R[i * P + h] for i = 0, 1, ... (hosts interleave: disjoint, complete),
    so without skipped records global batch n is R[n * B : (n + 1) * B] on any number of hosts.

Resuming on another host or worker count (`resplit_origin`) turns what every old host and
worker had read into a new origin: base = the first position no one had read, done = what was
read beyond it. Nothing is read twice or skipped.
"""
from __future__ import annotations

import bisect
import functools
import sys
from typing import Any, Sequence

import numpy as np
import grain


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
        self._num_epochs = num_epochs
        self.set_origin(0, [])

    def set_origin(self, base: int, done: Sequence[int]) -> None:
        """Where the stream left to read starts (see the module docstring)."""
        self.origin = {"base": int(base), "done": sorted(int(g) for g in done if g >= base)}
        self._map = _StreamMap(self.origin["base"], self.origin["done"])
        if self._num_epochs is None:
            self._len = sys.maxsize
        else:   # every host gets the same count, so all run the same number of steps
            self._len = max(0, self._map.remaining(self._num_epochs * self._n)) // self._p

    # The resume interface the pipeline's iterator uses, shared with the streaming order of tar
    # shards (tar_source.TarStreamDataset): origin, initial_origin, restore_origin, resplit.
    @staticmethod
    def initial_origin() -> dict[str, Any]:
        return {"base": 0, "done": []}

    def restore_origin(self, origin: dict[str, Any]) -> None:
        self.set_origin(origin["base"], origin["done"])

    def resplit(self, process_count: int, num_workers: int,
                worker_states: Sequence[Sequence[dict[str, Any]]]) -> tuple[dict[str, Any], str]:
        """(the origin for a new layout, what the change costs) from every old host's worker
        states (worker_states[h][w])."""
        cursors = [[int(w["next_index"]) for w in per_host] for per_host in worker_states]
        return (resplit_origin(self.origin, process_count, num_workers, cursors),
                "exact: no record lost or repeated")

    def __len__(self) -> int:
        return self._len

    def record_index(self, index: int) -> tuple[int, int]:
        """Host-local element index -> (epoch, index into the source)."""
        epoch, position = divmod(self._map(index * self._p + self._h), self._n)
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


class _StreamMap:
    """k -> R[k], the k-th position of the stream left to read, R = {g >= base} - done."""

    def __init__(self, base: int, done: Sequence[int]):
        self.base, self.done = base, list(done)
        # R[k] = base + k + #{j : done[j] - base - j <= k}: done[j] has done[j]-base-j
        # unread positions before it.
        self._gaps = [g - base - j for j, g in enumerate(self.done)]

    def __call__(self, k: int) -> int:
        return self.base + k + bisect.bisect_right(self._gaps, k)

    def remaining(self, end: int) -> int:
        """How many positions of R lie below `end`."""
        return end - self.base - bisect.bisect_left(self.done, end)


def resplit_origin(origin: dict[str, Any], process_count: int, num_workers: int,
                   cursors: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The origin for a new host/worker layout, from the old one and what each old host h,
    worker w had read: cursors[h][w] = the next index into that worker's share of host h's
    elements (worker w of W reads host elements w, w + W, ...; W = 1 without workers)."""
    old = _StreamMap(origin["base"], origin["done"])
    w_count = max(1, num_workers)
    streams = []   # (first unread stream index k, indices k read so far), per worker
    for h, per_worker in enumerate(cursors):
        for w, c in enumerate(per_worker):
            streams.append(((w + w_count * c) * process_count + h, h, w, c))
    first = min(k for k, *_ in streams)
    read = []
    for _, h, w, c in streams:
        # Read elements w + W*m (m < c) at stream index (w + W*m) * P + h; keep those >= first.
        t = -(-(first - h) // process_count)
        m0 = max(0, -(-(t - w) // w_count))
        read += [old((w + w_count * m) * process_count + h) for m in range(m0, c)]
    base = old(first)
    return {"base": base, "done": sorted(set(read + [g for g in origin["done"] if g > base]))}
