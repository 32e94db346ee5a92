"""Shared evaluator plumbing: batched encoding sharded over all local devices, and metric helpers.

Every evaluator module exposes `Evaluator(config, model, ...)` whose `run(params)` yields
`(name, value)` pairs (big_vision style). They all encode through `prolip_jax.encode.Encoder`
(re-exported here), which pads inputs to a fixed batch, splits each batch over the local
devices and returns float32 numpy arrays.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax.encode import Encoder  # noqa: F401  (the evaluators' encoder, re-exported)


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
