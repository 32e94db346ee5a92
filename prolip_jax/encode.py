"""Batched encoding sharded over this host's devices: `Encoder`.

Inputs are cut into fixed-size batches (the last one padded with copies of its final row), so
each tower compiles one shape whatever N is; every batch is split over the local devices and
the result comes back as float32 numpy arrays. `prolip_jax.load` and every evaluator encode
through it.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prolip_jax.models.prolip import ProLIP


class Encoder:
    """(mu [N, D] unit-norm, log sigma^2 [N, D]) for images or token ids, in fixed-size batches
    (log sigma^2 None for a deterministic tower, `embed_unc=False`).

    images: float32 normalised or uint8 (normalised here with `normalization`) [N, S, S, 3].
    tokens: int32 [N, L]. `last_throughput` holds the items/s of the latest call.
    """

    def __init__(self, model: ProLIP, batch_size: int = 256, normalization: str = "openai",
                 devices: list[jax.Device] | None = None):
        self.model = model
        devices = devices or jax.local_devices()
        self.mesh = Mesh(np.array(devices), ("batch",))
        n = len(devices)
        self.batch_size = max(n, batch_size // n * n)  # divisible over the devices
        self.normalization = normalization
        self.last_throughput = 0.0
        self._placed = None  # (params given, params placed on this encoder's devices)
        shard = NamedSharding(self.mesh, P("batch"))
        self._shard = shard

        def image_fn(params, images):
            if images.dtype == jnp.uint8:
                from input_pipeline.transforms import normalize_on_device

                images = normalize_on_device(images, normalization)
            return model.apply({"params": params}, images, method=ProLIP.encode_image)

        def text_fn(params, tokens):
            return model.apply({"params": params}, tokens, method=ProLIP.encode_text)

        # One sharding for every output leaf: log sigma^2 is None for a tower without [UNC].
        self._image_fn = jax.jit(image_fn, out_shardings=shard)
        self._text_fn = jax.jit(text_fn, out_shardings=shard)

    def images(self, params: Any, images: np.ndarray, progress: Callable[[int], None] | None = None
               ) -> tuple[np.ndarray, np.ndarray]:
        return self._run(self._image_fn, params, images, progress)

    def texts(self, params: Any, tokens: np.ndarray, progress: Callable[[int], None] | None = None
              ) -> tuple[np.ndarray, np.ndarray]:
        return self._run(self._text_fn, params, np.asarray(tokens, np.int32), progress)

    def place(self, params: Any) -> Any:
        """Parameters on this encoder's devices: replicated, unless already spread over exactly
        them (e.g. the trainer's sharded state on the same host's devices)."""
        if self._placed is not None and self._placed[0] is params:
            return self._placed[1]
        devices = set(self.mesh.devices.flat)
        leaves = jax.tree.leaves(params)
        placed = params
        if not all(isinstance(x, jax.Array) and x.sharding.device_set == devices for x in leaves):
            placed = jax.device_put(params, NamedSharding(self.mesh, P()))
        self._placed = (params, placed)
        return placed

    def _run(self, fn, params, x: np.ndarray, progress) -> tuple[np.ndarray, np.ndarray | None]:
        params = self.place(params)
        n, bs = len(x), self.batch_size
        mus, lvs = [], []
        start = time.perf_counter()
        for i in range(0, n, bs):
            chunk = x[i:i + bs]
            k = len(chunk)
            if k < bs:  # pad with copies of the last row: one compiled shape per tower
                chunk = np.concatenate([chunk, np.repeat(chunk[-1:], bs - k, axis=0)])
            mu, lv = fn(params, jax.device_put(chunk, self._shard))
            mus.append(np.asarray(mu)[:k])
            lvs.append(None if lv is None else np.asarray(lv)[:k])
            if progress is not None:
                progress(k)
        self.last_throughput = n / max(time.perf_counter() - start, 1e-9)
        d = self.model.config.embed_dim
        if not mus:
            return np.zeros((0, d), np.float32), np.zeros((0, d), np.float32)
        return np.concatenate(mus), None if lvs[0] is None else np.concatenate(lvs)
