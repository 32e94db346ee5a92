"""Shared evaluator plumbing: batched encoding sharded over all local devices, and metric helpers.

Every evaluator module exposes `Evaluator(config, model, ...)` whose `run(params)` yields
`(name, value)` pairs (big_vision style). They all encode through `Encoder`, which pads inputs
to a fixed batch (one compiled shape per tower), splits each batch over the local devices, and
returns float32 numpy arrays.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prolip_jax.models.prolip import ProLIP


class Encoder:
    """(mu [N, D] unit-norm, log sigma^2 [N, D]) for images or token ids, in fixed-size batches.

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

        self._image_fn = jax.jit(image_fn, out_shardings=(shard, shard))
        self._text_fn = jax.jit(text_fn, out_shardings=(shard, shard))

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

    def _run(self, fn, params, x: np.ndarray, progress) -> tuple[np.ndarray, np.ndarray]:
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
            lvs.append(np.asarray(lv)[:k])
            if progress is not None:
                progress(k)
        self.last_throughput = n / max(time.perf_counter() - start, 1e-9)
        if not mus:
            d = self.model.config.embed_dim
            return np.zeros((0, d), np.float32), np.zeros((0, d), np.float32)
        return np.concatenate(mus), np.concatenate(lvs)


@functools.partial(jax.jit, static_argnames="kind")
def _scores(q_mu: jax.Array, q_lv: jax.Array, g_mu: jax.Array, g_tr: jax.Array, kind: str) -> jax.Array:
    dot = q_mu @ g_mu.T
    if kind == "dot":
        return dot
    # -CSD = -(|q - g|^2 + tr(S_q) + tr(S_g)), paper eq. 2 / PCME++.
    sq = jnp.sum(q_mu ** 2, -1)[:, None] + jnp.sum(g_mu ** 2, -1)[None, :] - 2.0 * dot
    return -(sq + jnp.sum(jnp.exp(q_lv), -1)[:, None] + g_tr[None, :])


def blocked_scores(query_mu: np.ndarray, query_logvar: np.ndarray, gallery_mu: np.ndarray,
                   gallery_logvar: np.ndarray, kind: str = "csd", block: int = 4096,
                   reduce: Callable[[np.ndarray, int], Any] | None = None) -> Iterator[tuple[int, Any]]:
    """Scores of query blocks against the whole gallery, computed on device block by block.

    kind: "csd" -> -CSD (higher is closer; the ranking of the paper's protocol), "dot" -> mu.mu.
    Yields (start row, reduce(scores [b, M], start) or the scores themselves) so that
    5k x 25k (and larger) never has to sit in memory at once. The last block is padded, so one
    compiled program serves every block of a given gallery size.
    """
    if kind not in ("csd", "dot"):
        raise ValueError(f"unknown score kind {kind!r}; use 'csd' or 'dot'")
    g_mu = jnp.asarray(gallery_mu)
    g_tr = jnp.sum(jnp.exp(jnp.asarray(gallery_logvar)), -1)
    n = len(query_mu)
    block = max(1, min(block, n))
    for start in range(0, n, block):
        q_mu, q_lv = query_mu[start:start + block], query_logvar[start:start + block]
        k = len(q_mu)
        if k < block:
            q_mu = np.concatenate([q_mu, np.repeat(q_mu[-1:], block - k, axis=0)])
            q_lv = np.concatenate([q_lv, np.repeat(q_lv[-1:], block - k, axis=0)])
        s = np.asarray(_scores(jnp.asarray(q_mu), jnp.asarray(q_lv), g_mu, g_tr, kind))[:k]
        yield start, (reduce(s, start) if reduce is not None else s)


def uncertainty(logvar: np.ndarray) -> np.ndarray:
    """Per-item uncertainty as the reference logs it: sum_d sigma_d^2 = sum exp(log sigma^2)."""
    return np.exp(np.asarray(logvar, np.float64)).sum(-1)


def binned_accuracy(correct: np.ndarray, unc: np.ndarray, bins: int = 10) -> tuple[np.ndarray, float]:
    """Accuracy in `bins` equal-count bins of increasing uncertainty, and the Pearson correlation
    between bin index and accuracy (REFERENCE §3.1 `eval_clsf_unc`; negative = the model knows
    when it is wrong)."""
    if len(correct) == 0:
        raise ValueError("binned_accuracy needs at least one item")
    bins = min(bins, len(correct))  # no empty bins (their mean would be NaN)
    order = np.argsort(unc, kind="stable")
    accs = np.array([np.mean(correct[idx]) for idx in np.array_split(order, bins)])
    if np.std(accs) == 0:
        return accs, 0.0
    return accs, float(np.corrcoef(np.arange(bins), accs)[0, 1])
