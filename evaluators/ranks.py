"""Rank helpers shared by the retrieval evaluator (evaluators/retrieval.py) and its caption
metrics (evaluators/caption_metrics.py): the padding rank, whole-gallery ranks, padded
positive lists and per-query R-Precision. Ties follow a stable descending argsort (an equal
score at a lower gallery index ranks first) everywhere.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

PAD = np.iinfo(np.int64).max // 2   # rank of a padding "positive": never < any K or R


def full_ranks(scores: np.ndarray) -> np.ndarray:
    """int64 [Q, M]: the 0-based rank of EVERY gallery item in each query's ranking, with
    retrieval.positive_ranks' tie rule (the inverse permutation of
    `np.argsort(-scores, kind="stable")`). For metrics over the whole gallery (PMRP, ASP:
    evaluators/caption_metrics.py)."""
    scores = np.asarray(scores)
    order = np.argsort(-scores, axis=1, kind="stable")
    ranks = np.empty(order.shape, np.int64)
    np.put_along_axis(ranks, order, np.arange(scores.shape[1])[None, :], 1)
    return ranks


def pad_positives(lists: Sequence[Sequence[int]]) -> np.ndarray:
    """Ragged lists of gallery indices -> int64 [Q, max len] padded with -1."""
    width = max((len(x) for x in lists), default=0)
    out = np.full((len(lists), max(width, 1)), -1, np.int64)
    for i, x in enumerate(lists):
        out[i, :len(x)] = x
    return out


def num_positives(ranks: np.ndarray) -> np.ndarray:
    """[Q] number of (non-padding) positives per query, from positive_ranks' output."""
    return (np.asarray(ranks) < PAD).sum(1)


def r_precision_per_query(ranks: np.ndarray) -> np.ndarray:
    """float64 [Q]: |top-R ∩ positives| / R per query, R = the query's number of positives
    (nan for a query without one)."""
    r = num_positives(ranks)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.asarray(ranks) < r[:, None]).sum(1) / r
