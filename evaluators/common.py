"""Shared evaluator plumbing: config parsing, the -CSD / dot scores in blocks, metric helpers.

Every evaluator encodes through `prolip_jax.core.encode.Encoder` (re-exported here) and reads its
images through `input_pipeline.eval_data` sets, so it runs sharded over all hosts' devices and
every host computes the same metrics.

Units (docs/metrics.md): every proportion an evaluator yields -- accuracy, recall, precision,
R-Precision, mAP, F1, a share of items ("..._rate") -- is in % (0-100, `percent`), as open_clip
and the papers report them; correlations are in [-1, 1]; sigma^2 is tr(Sigma) (`uncertainty`).

Each evaluator declares its knobs once, in a frozen `Config` dataclass beside its code, parsed
by `parse_config` (prolip_jax/runtime/schema.py): a mistyped key is an error naming the nearest field.
"""
from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterator, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from input_pipeline.tokenizers import build_tokenizer
from prolip_jax.runtime import schema
from prolip_jax.core.encode import Encoder  # noqa: F401  (the evaluators' encoder, re-exported)
from prolip_jax.core.objectives.distances import csd

log = logging.getLogger(__name__)


def parse_config(cls: type, config: Any, kind: str) -> Any:
    """An evaluator's `Config` (frozen dataclass) from its section of `config.evals` (a dict or
    ConfigDict, without the trainer's type / log_steps / prefix): an unknown key is an error
    naming the nearest field, an ill-typed value is refused, then `Config.validate()` runs.
    A `type` key naming this evaluator (a whole config.evals section) is accepted."""
    section = dict(config.to_dict() if hasattr(config, "to_dict") else config)
    if section.get("type", kind) != kind:
        raise ValueError(f"config.evals.<name>: a type={section['type']!r} section given to the "
                         f"{kind!r} evaluator")
    section.pop("type", None)
    return schema.parse(cls, section, f"config.evals.<name> (type={kind!r})")


def tokenizer_from(kwargs: Mapping[str, Any] | None, context_length: int, what: str) -> Callable:
    """input_pipeline.tokenizers.build_tokenizer(**kwargs) (an evaluator's `tokenizer` field),
    or a clear error when it names no file."""
    kw = dict(kwargs or {})
    if not kw.get("path"):
        raise ValueError(f"{what}: pass a tokenizer or set config.tokenizer=dict(kind=..., path=...)")
    kw.setdefault("context_length", context_length)
    return build_tokenizer(**kw)


def tokenize_checked(tokenizer: Callable, texts: list[str], what: str) -> np.ndarray:
    """tokenizer(texts); logs a warning naming the texts cut at the context length (a prompt
    whose class word falls past the cut scores as a prompt without it, silently otherwise).
    Tokenizers without `encode_with_truncation` are called as they are."""
    if not hasattr(tokenizer, "encode_with_truncation"):
        return tokenizer(texts)
    tokens, cut = tokenizer.encode_with_truncation(texts)
    if cut.any():
        examples = [texts[i] for i in np.flatnonzero(cut)[:3]]
        log.warning(
            "%s: %d of %d texts are longer than the tokenizer's context length (%d tokens) and were "
            "cut, e.g. %s; use a longer context or shorter templates / class names.", what,
            int(cut.sum()), len(texts), tokenizer.context_length, examples)
    return tokens


def _score_block(q_mu: jax.Array, q_lv: jax.Array | None, g_mu: jax.Array, g_lv: jax.Array | None,
                 kind: str) -> jax.Array:
    if kind == "dot":
        return q_mu @ g_mu.T
    return -csd(q_mu, q_lv, g_mu, g_lv)   # paper eq. 2 / PCME++; None log sigma^2: mu only


@functools.lru_cache(maxsize=None)
def _jitted(kind: str, device_reduce: Callable | None) -> Callable:
    """One program per (kind, device reduction): the scores and their reduction fuse, and
    the [block, M] scores never leave the device when a reduction is given."""
    if device_reduce is None:
        return jax.jit(functools.partial(_score_block, kind=kind))
    return jax.jit(lambda q_mu, q_lv, g_mu, g_lv, *rows: device_reduce(
        _score_block(q_mu, q_lv, g_mu, g_lv, kind), *rows))


def blocked_scores(query_mu: np.ndarray, query_logvar: np.ndarray | None, gallery_mu: np.ndarray,
                   gallery_logvar: np.ndarray | None, kind: str = "csd", block: int = 4096,
                   reduce: Callable[[np.ndarray, int], Any] | None = None,
                   device_reduce: Callable | None = None, rows: tuple[np.ndarray, ...] = ()
                   ) -> Iterator[tuple[int, Any]]:
    """Scores of query blocks against the whole gallery, computed on device block by block.

    kind: "csd" -> -CSD (higher is closer; the ranking of the paper's protocol), "dot" -> mu.mu.
    Yields (start row, reduce(scores [b, M], start) or the scores themselves) so that
    5k x 25k (and larger) never has to sit in memory at once. The last block is padded, so one
    compiled program serves every block of a given gallery size.
    device_reduce: a jax function `fn(scores [block, M], *row_blocks)` applied on the device
    before anything comes to the host (then `reduce` gets its output); `rows` are per-query
    arrays [Q, ...] sliced and padded with the queries into `row_blocks`. A 1M gallery's
    float32 scores are 4 GB per 1024 queries: ranking them on the host is what limits a large
    evaluation, not the device.
    """
    if kind not in ("csd", "dot"):
        raise ValueError(f"unknown score kind {kind!r}; use 'csd' or 'dot'")
    g_mu = jnp.asarray(gallery_mu)
    g_lv = None if gallery_logvar is None else jnp.asarray(gallery_logvar)
    fn = _jitted(kind, device_reduce)
    n = len(query_mu)
    block = max(1, min(block, n))
    for start in range(0, n, block):
        q = [x if x is None else x[start:start + block] for x in (query_mu, query_logvar, *rows)]
        k = len(q[0])
        q = [x if x is None or k == block else np.concatenate([x, np.repeat(x[-1:], block - k, 0)])
             for x in q]
        out = fn(*(None if x is None else jnp.asarray(x) for x in q[:2]), g_mu, g_lv,
                 *(jnp.asarray(x) for x in q[2:]))
        s = jax.tree.map(lambda a: np.asarray(a)[:k], out)
        yield start, (reduce(s, start) if reduce is not None else s)


def percent(fraction: Any) -> float:
    """A fraction in [0, 1] as the % every evaluator reports (docs/metrics.md)."""
    return 100.0 * float(fraction)


def uncertainty(logvar: np.ndarray) -> np.ndarray:
    """Per-item uncertainty tr(Sigma) = sum_d sigma_d^2 = sum_d exp(log sigma_d^2), as the
    reference logs it; metric names call it `sigma2_trace` (docs/metrics.md)."""
    # The trace, not the per-dimension mean: the paper's sigma_v^2 / sigma_t^2 are tr(Sigma) (§4.3).
    return np.exp(np.asarray(logvar, np.float64)).sum(-1)


def binned_accuracy(correct: np.ndarray, unc: np.ndarray, bins: int = 10) -> tuple[np.ndarray, float]:
    """Accuracy (%) in `bins` equal-count bins of increasing uncertainty, and the Pearson
    correlation between bin index and accuracy (naver-ai/prolip src/prolip/zero_shot_classifier.py `eval_clsf_unc`; negative = the
    model knows when it is wrong)."""
    if len(correct) == 0:
        raise ValueError("binned_accuracy needs at least one item")
    bins = min(bins, len(correct))  # no empty bins (their mean would be NaN)
    order = np.argsort(unc, kind="stable")
    accs = np.array([percent(np.mean(correct[idx])) for idx in np.array_split(order, bins)])
    if np.std(accs) == 0:
        return accs, 0.0
    return accs, float(np.corrcoef(np.arange(bins), accs)[0, 1])
