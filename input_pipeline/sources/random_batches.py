"""data.source="random": random pixels and tokens that need no files (smoke tests, benchmarks of
the step without the input pipeline), drawn for the *global* batch from (seed, step) and sliced
to this host's rows, so a run gives the same global batches on any number of hosts."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from input_pipeline.sources.base import DataSource


class RandomBatches:
    """{"image": uint8 [B/P, S, S, 3], "text": int32 [B/P, L]} for this host, with the
    input pipeline's iterator interface (next, get_state/set_state, stats, close).

    uint8 pixels, as the tar pipeline delivers them (the step normalises on device): drawing
    float32 normals for a whole batch costs the host far more than the step it feeds, and uint8
    is a quarter of the bytes to send to the device (docs/performance.md has the numbers)."""

    def __init__(self, global_batch: int, image_size: int, context_length: int, vocab_size: int,
                 seed: int = 0, pad_id: int = 1, process_index: int | None = None,
                 process_count: int | None = None):
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        if global_batch % self.process_count:
            raise ValueError(f"batch {global_batch} is not divisible by {self.process_count} hosts")
        self.global_batch, self.image_size = global_batch, image_size
        self.context_length, self.vocab_size, self.seed, self.pad_id = context_length, vocab_size, seed, pad_id
        self.position = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.position])
        b, s, length = self.global_batch, self.image_size, self.context_length
        images = rng.integers(0, 256, size=(b, s, s, 3), dtype=np.uint8)
        tokens = rng.integers(2, self.vocab_size, size=(b, length), dtype=np.int32)
        lengths = rng.integers(1, length + 1, size=b)
        tokens[np.arange(length)[None, :] >= lengths[:, None]] = self.pad_id  # pad == EOS tail
        self.position += 1
        rows = slice(self.process_index * b // self.process_count, (self.process_index + 1) * b // self.process_count)
        return {"image": images[rows], "text": tokens[rows]}

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "global_batch": self.global_batch}

    def set_state(self, state: dict[str, Any]) -> None:
        if (state["seed"], state["global_batch"]) != (self.seed, self.global_batch):
            raise ValueError(f"random data state {state} does not match seed {self.seed}, "
                             f"batch {self.global_batch}")
        self.position = int(state["position"])

    @property
    def stats(self) -> dict[str, int]:
        return {"batches": self.position, "skipped": 0}

    def close(self) -> None:
        pass


class RandomSource(DataSource):
    name = "random"
    draws_batches = True

    def batches(self, global_batch: int, image_size: int, context_length: int, vocab_size: int,
                seed: int) -> RandomBatches:
        return RandomBatches(global_batch, image_size, context_length, vocab_size, seed=seed)

    def evaluate_with(self, cfg: Any) -> tuple[str, str]:
        return "demo.py", ""   # nothing of its own to evaluate on: the demo's benchmark


SOURCE = RandomSource()
