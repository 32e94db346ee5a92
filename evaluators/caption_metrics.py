"""Caption-benchmark metrics beyond R@K: PMRP, ASP (TF-IDF), class-level positives (CUB).

All of them rank with evaluators.ranks' tie rule (a stable descending argsort: an equal
score at a lower gallery index ranks first) and reuse its R-Precision; they run on the score
blocks of `retrieval.blocked_ranks` (`extras=`), so no [Q, M] matrix is ever whole.

PMRP -- Plausible-Match R-Precision (PCME; Pishdad et al. §4.3; DAA
  §5.1.2). Every COCO image, and each of its captions, has a binary vector of the COCO object
  categories present (`evaluators.retrieval_data.coco_category_codes`: the 90 category-id slots
  `code[category_id - 1]`, as PCME's evaluate_pmrp_coco.py and DAA's code build them; the 10
  never-used ids are 0 in every vector, so the Hamming distance equals the one on the 80 present
  categories). (query, item) is a plausible match when the vectors differ in <= zeta positions;
  PMRP = R-Precision with these positives (R = their number in the whole gallery), averaged over
  zeta in {0, 1, 2}. Images without any instance annotation: "drop" (default) leaves them out as
  queries and out of every gallery, as PCME's evaluate_pmrp_coco.py does (its `iid_to_cls` has
  only annotated images; queries and retrieved items outside it are skipped); "zero" keeps them
  with an all-zero vector (then they match each other at zeta = 0). The query's own image /
  captions are positives (distance 0), as in PCME's script.

ASP -- Average Semantic Precision (DAA §4.1, Eq. 4-8): per query q, over the WHOLE
  gallery Omega, mean_i min(R(i,C), R(i,S)) / max(R(i,C), R(i,S)) with 1-based ranks R of item i
  in the model's ranking S and in the semantic ranking C; dataset ASP = mean over queries, in %.
  The semantic score is DAA's code's (engine/eval_coco.py `coco_cider_compute`), not CIDEr-D:
  TF-IDF vectors of the captions (sklearn CountVectorizer defaults: lowercase, unigrams of the
  token regex (?u)\\b\\w\\w+\\b; TfidfTransformer defaults: raw counts x smooth idf
  ln((1+n)/(1+df)) + 1, rows L2-normalised), fit on all captions of the split;
  psi(a, b) = tfidf(a) . tfidf(b); SEM(image, caption) = mean over the image's P ground-truth
  captions (the first P; the first repeated when it has fewer) of psi(gt, caption) -- the same
  number for i2t and t2i (Eq. 7). Hence the name `asp_tfidf`: true CIDEr-D (1-4-grams, x10,
  length penalty, clipping) would give other absolute values. Ties in either ranking: a stable
  descending argsort (DAA's code takes torch's sort order; the stable order of this evaluator's other ranks is used here).
"""
from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np
import scipy.sparse as sp

from evaluators.ranks import PAD, full_ranks, pad_positives, r_precision_per_query

TOKEN = re.compile(r"(?u)\b\w\w+\b")   # sklearn CountVectorizer's default token_pattern
PMRP_ZETAS = (0, 1, 2)
CHUNK = 256   # query rows ranked at once (a [256, 25000] int64 rank block is 51 MB)


# =====================================================================================
# Whole-gallery rank metrics on one block of queries.
# =====================================================================================
def hamming(q_codes: np.ndarray, g_codes: np.ndarray) -> np.ndarray:
    """int [Q, M]: number of positions where the binary vectors differ."""
    q = np.asarray(q_codes, np.int32)
    g = np.asarray(g_codes, np.int32)
    return q.sum(1)[:, None] + g.sum(1)[None, :] - 2 * (q @ g.T)


def plausible_r_precision(ranks: np.ndarray, dist: np.ndarray,
                          zetas: Sequence[int] = PMRP_ZETAS) -> np.ndarray:
    """float64 [len(zetas), Q]: R-Precision per query with the items at distance <= zeta as
    positives. ranks: full_ranks of the queries [Q, M]; dist: hamming [Q, M]."""
    return np.stack([r_precision_per_query(np.where(dist <= z, ranks, PAD)) for z in zetas])


def asp_per_query(scores: np.ndarray, semantic: np.ndarray) -> np.ndarray:
    """float64 [Q]: DAA Eq. 4 -- mean over the gallery of min/max of the 1-based ranks of each
    item by the model's scores and by the semantic scores (both stable descending)."""
    rs = full_ranks(scores) + 1
    rc = full_ranks(semantic) + 1
    return (np.minimum(rs, rc) / np.maximum(rs, rc)).mean(1)


# =====================================================================================
# TF-IDF semantic scores (DAA's code's stand-in for CIDEr).
# =====================================================================================
def tokenize(text: str) -> list[str]:
    """sklearn CountVectorizer's default analyzer: lowercase, tokens of 2+ word characters."""
    return TOKEN.findall(str(text).lower())


def tfidf_vectors(captions: Sequence[str]) -> sp.csr_matrix:
    """float64 CSR [M, V]: sklearn CountVectorizer() + TfidfTransformer() defaults, fit on
    `captions` (raw counts x idf, idf = ln((1+n)/(1+df)) + 1, rows L2-normalised; a caption
    without any token is a zero row). Columns: the vocabulary in sorted order."""
    docs = [tokenize(c) for c in captions]
    vocab = {w: j for j, w in enumerate(sorted({w for d in docs for w in d}))}
    rows, cols = [], []
    for i, d in enumerate(docs):
        rows += [i] * len(d)
        cols += [vocab[w] for w in d]
    counts = sp.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(docs), len(vocab)))
    counts.sum_duplicates()
    n = len(docs)
    df = np.bincount(counts.indices, minlength=len(vocab))
    idf = np.log((1.0 + n) / (1.0 + df)) + 1.0
    x = counts @ sp.diags(idf)
    norms = np.sqrt(np.asarray(x.multiply(x).sum(1)).ravel())
    inv = np.zeros_like(norms)
    inv[norms > 0] = 1.0 / norms[norms > 0]
    return sp.csr_matrix(sp.diags(inv) @ x)


def ground_truth_mean(vectors: sp.csr_matrix, cap_img: np.ndarray, num_images: int,
                      per_image: int = 5) -> sp.csr_matrix:
    """[N, V]: per image, the mean of its first `per_image` captions' vectors, the first caption
    repeated when it has fewer (DAA's tfidf_GT). Since psi is a dot product,
    SEM(image, caption) = ground_truth_mean[image] . vectors[caption] (Eq. 7)."""
    cap_img = np.asarray(cap_img, np.int64)
    order = np.argsort(cap_img, kind="stable")           # captions grouped by image, in order
    ends = np.cumsum(np.bincount(cap_img, minlength=num_images))
    rows, cols, vals = [], [], []
    for i in range(num_images):
        caps = order[ends[i - 1] if i else 0:ends[i]]
        if len(caps) == 0:
            raise ValueError(f"ASP: image {i} has no caption")
        picked = list(caps[:per_image]) + [caps[0]] * max(0, per_image - len(caps))
        for c in picked:
            rows.append(i)
            cols.append(c)
            vals.append(1.0 / per_image)
    avg = sp.csr_matrix((vals, (rows, cols)), shape=(num_images, len(cap_img)))
    avg.sum_duplicates()
    return sp.csr_matrix(avg @ vectors)


def semantic_block(query_vectors: sp.csr_matrix, gallery_vectors: sp.csr_matrix) -> np.ndarray:
    """float64 [Q, M] dense dot products of sparse rows (one query chunk at a time)."""
    return np.asarray((gallery_vectors @ query_vectors.toarray().T).T)


# =====================================================================================
# Accumulators: `fn(scores [b, M], start)` for blocked_ranks(extras=...), then result().
# =====================================================================================
class PMRP:
    """Per-query plausible-match R-Precision of one direction and protocol.

    q_codes [Q, K], g_codes [M, K]: binary category vectors of queries and gallery items;
    q_keep [Q], g_keep [M]: False = left out (the "drop" rule for unannotated images)."""

    def __init__(self, q_codes: np.ndarray, g_codes: np.ndarray, zetas: Sequence[int] = PMRP_ZETAS,
                 q_keep: np.ndarray | None = None, g_keep: np.ndarray | None = None):
        self.q_codes, self.zetas = np.asarray(q_codes, bool), tuple(int(z) for z in zetas)
        self.q_keep = np.ones(len(q_codes), bool) if q_keep is None else np.asarray(q_keep, bool)
        self.g_cols = None if g_keep is None or np.all(g_keep) else np.flatnonzero(g_keep)
        g = np.asarray(g_codes, bool)
        self.g_codes = g if self.g_cols is None else g[self.g_cols]
        self.values = np.full((len(self.zetas), len(q_codes)), np.nan)

    def __call__(self, scores: np.ndarray, start: int) -> None:
        for a in range(0, len(scores), CHUNK):
            s = scores[a:a + CHUNK]
            rows = np.arange(start + a, start + a + len(s))
            if self.g_cols is not None:
                s = s[:, self.g_cols]
            dist = hamming(self.q_codes[rows], self.g_codes)
            self.values[:, rows] = plausible_r_precision(full_ranks(s), dist, self.zetas)

    def result(self, direction: str) -> dict[str, float]:
        """{d}_pmrp (mean over zetas) and {d}_pmrp_zeta{z}, in %, over the kept queries."""
        kept = self.values[:, self.q_keep]
        if kept.shape[1] == 0:
            raise ValueError("PMRP: no query with category annotations")
        per = 100.0 * kept.mean(1)
        out = {f"{direction}_pmrp_zeta{z}": float(v) for z, v in zip(self.zetas, per)}
        out[f"{direction}_pmrp"] = float(per.mean())
        return out


class ASP:
    """Per-query ASP of one direction and protocol; semantic(rows) -> dense [len(rows), M]."""

    def __init__(self, semantic: Callable[[np.ndarray], np.ndarray], num_queries: int):
        self.semantic = semantic
        self.values = np.full(num_queries, np.nan)

    def __call__(self, scores: np.ndarray, start: int) -> None:
        for a in range(0, len(scores), CHUNK):
            s = scores[a:a + CHUNK]
            rows = np.arange(start + a, start + a + len(s))
            self.values[rows] = asp_per_query(s, self.semantic(rows))

    def result(self, direction: str) -> dict[str, float]:
        return {f"{direction}_asp_tfidf": 100.0 * float(self.values.mean())}


def asp_pair(vectors: sp.csr_matrix, gt: sp.csr_matrix) -> tuple[ASP, ASP]:
    """(i2t, t2i) ASP accumulators of a protocol: vectors = its captions' TF-IDF rows [M, V],
    gt = its images' ground-truth means [N, V] (both in the protocol's gallery order)."""
    return (ASP(lambda rows: semantic_block(gt[rows], vectors), gt.shape[0]),
            ASP(lambda rows: semantic_block(vectors[rows], gt), vectors.shape[0]))


# =====================================================================================
# Class-level positives (CUB Captions: every image-caption pair of the same class).
# =====================================================================================
def class_positives(image_class: np.ndarray, cap_img: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(i2t [N, P], t2i [M, P']) padded gallery indices (ranks.pad_positives) of the
    class-level protocol of PCME / DAA (DAA §5.1.1): an image's positives are all captions
    of images of its class, a caption's all images of its image's class."""
    image_class = np.asarray(image_class)
    cap_class = image_class[np.asarray(cap_img, np.int64)]
    imgs_of = {c: np.flatnonzero(image_class == c) for c in np.unique(image_class)}
    caps_of = {c: np.flatnonzero(cap_class == c) for c in np.unique(image_class)}
    return (pad_positives([caps_of[c] for c in image_class]),
            pad_positives([imgs_of[c] for c in cap_class]))
