"""DAA: the differentiable ASP approximation (DAA §4.2; DAA's criterions/DAA.py), as a
regulariser on a base objective: "pcme_daa" (PCME + DAA, the paper's PCME-bert + DAA) and
"vse_daa" (the VSE-infinity hardest-negative triplet + DAA, PCME++'s DAA baseline).

ASP (DAA §4.1, eq. 4) of a query q over the retrieved set Omega compares each item's rank
under the model's similarity list S with its rank under a semantic list C:
    ASP_q = 1/|Omega| sum_i min(R(i, C), R(i, S)) / max(R(i, C), R(i, S)),
    R(i, U) = 1 + sum_{j != i} 1{u_j > u_i}                                 (eq. 8, 10)
DAA (eq. 11, 12) replaces the indicator with phi(x) = 1 / (1 + exp(clip(-x / tau, -50, 50))),
tau = 0.01 and the clamp as DAA.py `sigmoid`, and minimises L = mean_q (1 - ASP~_q). The
self-pair j = i is masked as the code does (eq. 11 as printed would add phi(0) = 1/2). C is a
constant (stop_gradient): gradients flow only through the ranks of S.

In-batch (as the code): the queries are the batch's B_img * J image samples (i2t) or B_txt * J
caption samples (t2i), the retrieved set every sample of the other modality; S is the raw dot
product of samples (not eq. 5's cosine; our mu are unit-norm, samples are not), C is the B x B
semantic map repeated over the samples. Both directions are weighted by `daa_beta`.

Two code quirks, each behind a knob (defaults follow the paper's text):
  daa_similarity  "cross": S = image-sample . caption-sample (the paper). "same_modality":
                  DAA.py `coco_DAA` overwrites input2 with input1, so S is image . image for
                  the i2t term and caption . caption for t2i (what the released PCME-DAA trains).
  daa_rank_index  "query": R over each query's own row, 1 + sum_{a != c} phi(U[q, a] - U[q, c]).
                  "code": DAA.py's broadcast computes 1 + sum_{a != c} phi(U[a, q] - U[q, c]),
                  which is the same for a symmetric U (same-modality S, a one-caption-per-image
                  C) and reads the transposed list otherwise (SGRAF-DAA's model.py Loss.DAA
                  does the same on cross-modal scores).
With daa_similarity="same_modality", daa_rank_index="code" this is DAA.py's coco_DAA exactly.

Semantic map C. The paper's SEM (eq. 7) is CIDEr between a caption and the 5 GT captions of an
image, averaged over the 5. DAA's code uses instead the cosine of unigram TF-IDF vectors
(sklearn CountVectorizer + TfidfTransformer, smooth idf, L2 rows) fitted on all captions of the
split. We have only the batch's token ids (out["text"] [B_txt, L]), so:
  * documents are captions as bags of token ids (subword pieces, not sklearn's words); ids in
    `daa_ignore_ids` (pad/EOS/BOS) are dropped. Default (0, 1): pad = EOS = 1 for the SigLIP
    SentencePiece and the demo tokenizers (0 is their unused <pad>); with OpenAI's CLIP BPE set
    (0, 49406, 49407) (pad, <start_of_text>, <end_of_text>);
  * tf = raw counts, idf = ln((1 + n) / (1 + df)) + 1 with n = B_txt and df the in-batch
    document frequencies (sklearn's smooth_idf=True, fitted on the batch, not the split);
    rows L2-normalised; K = X X^T is the B_txt x B_txt caption-caption cosine;
  * C[i, j] = mean over image i's GT captions g of K[g, j], the GT captions being the batch's
    positives of image i (targets row i, weights normalised; the identity = its one caption).
    The code averages over the image's 5 annotated captions, most of which are not in a batch.
Memory: a [B_txt, B_txt * L] float count matrix (no [B, vocab]); 4 MB at B = 128, L = 64.

Cost: the soft ranks of S are O(Q N^2) with Q = N = B J (the code materialises [N, N, N]). We sum
over the retrieved items in chunks of at most 2^26 elements of [Q, N, chunk] (2^20 on CPU, where
slabs that fit in cache are ~10x faster), rematerialised in
the backward pass, so memory is O(Q N) plus one chunk; the scan runs over the item axis, so
the query axis can stay sharded.
Compute is 2.6e8 sigmoids per direction at B = 128, J = 5; DAA is not meant for B in the
thousands. The C ranks are computed on the B x B map (identical to ranking the repeated map).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import types
from typing import Literal

import jax
import jax.numpy as jnp

from prolip_jax.core.objectives import pcme

CLAMP = 50.0  # DAA.py sigmoid: exponent clamped to [-50, 50]
CHUNK_ELEMENTS = 2 ** 26  # max elements of one [Q, N, chunk] slab of the soft-rank sum
# On CPU at most this many (4 MiB of float32, cache-sized): the soft-ASP gradient runs an order of
# magnitude faster in cache-sized slabs than in one large one (docs/performance.md, "Levers and
# defaults").
CPU_CHUNK_ELEMENTS = 2 ** 20


@dataclasses.dataclass(frozen=True)
class Knobs:
    """The DAA knobs, shared by every base objective (each combined Config inherits them)."""

    daa_beta: float = 1000.0  # weight of each direction's 1 - ASP~ (DAA's config/coco/pcme_coco.yaml)
    daa_tau: float = 0.01  # sigmoid temperature (DAA.py coco_DAA)
    daa_similarity: Literal["cross", "same_modality"] = "cross"
    daa_rank_index: Literal["query", "code"] = "query"
    daa_ignore_ids: tuple[int, ...] = (0, 1)  # token ids left out of the TF-IDF bags

    def validate_daa(self) -> None:
        if self.daa_beta < 0:
            raise ValueError(f"config.loss.daa_beta must be >= 0, got {self.daa_beta}")
        if not self.daa_tau > 0:
            raise ValueError(f"config.loss.daa_tau must be > 0, got {self.daa_tau}")


# ----------------------------------------------------------------------------------- soft ranks
def sigmoid_tau(x: jax.Array, tau: float) -> jax.Array:
    """DAA.py `sigmoid`: 1 / (1 + exp(clip(-x / tau, -50, 50)))."""
    return 1.0 / (1.0 + jnp.exp(jnp.clip(-x / tau, -CLAMP, CLAMP)))


def _partial_rank(u: jax.Array, v: jax.Array, w: jax.Array | None, a_idx: jax.Array, tau: float,
                  n: int) -> jax.Array:
    """sum over the items a of this chunk (a != c, a < n) of [w[q, a]] phi(v[q, a] - u[q, c])."""
    p = sigmoid_tau(v[:, None, :] - u[:, :, None], tau)  # [Q, N (c), k (a)]
    if w is not None:
        p = p * w[:, None, :]
    keep = (a_idx[None, :] != jnp.arange(u.shape[1])[:, None]) & (a_idx[None, :] < n)
    return jnp.sum(jnp.where(keep[None], p, 0.0), -1)


def masked_rank_sum(u: jax.Array, v: jax.Array, tau: float, weights: jax.Array | None = None,
                    chunk_elements: int | None = None) -> jax.Array:
    """M[q, c] = sum_{a != c} w[q, a] phi(v[q, a] - u[q, c]) for u, v, w [Q, N] (w = 1 if None);
    the soft rank is 1 + M.

    v = u gives each query's own ranking; v = u.T the code's index pattern. The sum over a runs
    in chunks (a scan over the item axis, so the query axis can stay sharded), each chunk
    rematerialised in the backward pass."""
    if chunk_elements is None:
        # Chosen by the platform the program is compiled for (an ahead-of-time TPU compile on a
        # CPU host gets the TPU size), not by the host's default backend.
        return jax.lax.platform_dependent(
            u, v, weights, cpu=lambda u, v, w: masked_rank_sum(u, v, tau, w, CPU_CHUNK_ELEMENTS),
            default=lambda u, v, w: masked_rank_sum(u, v, tau, w, CHUNK_ELEMENTS))
    q, n = u.shape
    k = int(max(1, min(n, chunk_elements // max(q * n, 1))))
    part = jax.checkpoint(functools.partial(_partial_rank, tau=tau, n=n))
    if k >= n:
        return part(u, v, weights, jnp.arange(n))
    chunks = math.ceil(n / k)

    def split(x):  # [Q, N] -> [chunks, Q, k], zero-padded
        return jnp.pad(x, ((0, 0), (0, chunks * k - n))).reshape(q, chunks, k).transpose(1, 0, 2)

    idx = jnp.arange(chunks * k).reshape(chunks, k)
    if weights is None:
        body = lambda acc, xs: (acc + part(u, xs[0], None, xs[1]), None)
        xs = (split(v), idx)
    else:
        body = lambda acc, xs: (acc + part(u, xs[0], xs[1], xs[2]), None)
        xs = (split(v), split(weights), idx)
    acc, _ = jax.lax.scan(body, jnp.zeros_like(u), xs)
    return acc


def soft_asp(s: jax.Array, c_rank: jax.Array, tau: float, index: str = "query") -> jax.Array:
    """Per-query ASP~ [Q] of the similarity list s [Q, N] against given semantic ranks [Q, N]."""
    v = s if index == "query" else s.T
    s_rank = 1.0 + masked_rank_sum(s, v, tau)
    return jnp.mean(jnp.minimum(s_rank, c_rank) / jnp.maximum(s_rank, c_rank), -1)


def semantic_ranks(c: jax.Array, num_samples: int, tau: float, index: str = "query") -> jax.Array:
    """Soft ranks [Bq J, Bi J] of the B x B semantic map c repeated over J samples per item.

    Ranking the repeated map: each other item a contributes J identical terms, the query's own
    item c contributes J - 1 (its other samples), so
        R = 1 + J sum_{a != c} phi(v[b, a] - c[b, c]) + (J - 1) phi(v[b, c] - c[b, c])."""
    v = c if index == "query" else c.T
    m = masked_rank_sum(c, v, tau)
    rank = 1.0 + num_samples * m + (num_samples - 1) * sigmoid_tau(v - c, tau)
    return jnp.repeat(jnp.repeat(rank, num_samples, 0), num_samples, 1)


def asp_loss(zq: jax.Array, zi: jax.Array, c: jax.Array, tau: float, similarity: str = "cross",
             index: str = "query") -> jax.Array:
    """1 - mean_q ASP~_q for queries zq [Bq, J, D] against items zi [Bi, J, D], semantic map c
    [Bq, Bi] (rows = queries). similarity="same_modality" scores queries against themselves."""
    bq, j, d = zq.shape
    flat_q = zq.reshape(bq * j, d)
    flat_i = flat_q if similarity == "same_modality" else zi.reshape(-1, d)
    if flat_i.shape[0] != c.shape[1] * j or (index == "code" and flat_q.shape[0] != flat_i.shape[0]):
        raise ValueError(f"DAA with daa_similarity={similarity!r}, daa_rank_index={index!r}: queries "
                         f"{zq.shape}, items {zi.shape} and semantic map {c.shape} do not fit (the "
                         f"same_modality and code variants need as many images as captions)")
    s = flat_q @ flat_i.T
    c_rank = jax.lax.stop_gradient(semantic_ranks(jax.lax.stop_gradient(c), j, tau, index))
    return 1.0 - jnp.mean(soft_asp(s, c_rank, tau, index))


def daa_terms(zv: jax.Array, zt: jax.Array, c: jax.Array, cfg: Knobs) -> dict[str, jax.Array]:
    """Weighted DAA terms, i2t (image queries, c) and t2i (caption queries, c.T)."""
    kw = {"tau": cfg.daa_tau, "similarity": cfg.daa_similarity, "index": cfg.daa_rank_index}
    return {"daa_i2t": cfg.daa_beta * asp_loss(zv, zt, c, **kw),
            "daa_t2i": cfg.daa_beta * asp_loss(zt, zv, c.T, **kw)}


# ---------------------------------------------------------------------------------- semantics
def tfidf_vectors(text: jax.Array, ignore_ids: tuple[int, ...] = (0, 1)) -> jax.Array:
    """[B, B L] L2-normalised TF-IDF rows of the captions' token-id bags (columns: the batch's
    distinct ids, via a static-size unique; unused columns are zero)."""
    b, length = text.shape
    flat = text.reshape(-1).astype(jnp.int32)
    valid = jnp.ones(flat.shape, bool)
    for t in ignore_ids:
        valid &= flat != t
    flat = jnp.where(valid, flat, -1)
    _, inv = jnp.unique(flat, size=b * length, fill_value=-1, return_inverse=True)
    rows = jnp.repeat(jnp.arange(b), length)
    counts = jnp.zeros((b, b * length), jnp.float32).at[rows, inv.reshape(-1)].add(valid.astype(jnp.float32))
    df = jnp.sum(counts > 0, 0)
    idf = jnp.log((1.0 + b) / (1.0 + df)) + 1.0  # sklearn TfidfTransformer(smooth_idf=True)
    x = counts * idf
    norm = jnp.sqrt(jnp.sum(x ** 2, -1, keepdims=True))
    return x / jnp.where(norm > 0, norm, 1.0)


def tfidf_cosine(text: jax.Array, ignore_ids: tuple[int, ...] = (0, 1)) -> jax.Array:
    """[B, B] caption-caption TF-IDF cosine (DAA's CIDEr stand-in, fitted on the batch)."""
    x = tfidf_vectors(text, ignore_ids)
    return x @ x.T


def semantic_map(text: jax.Array, targets: jax.Array | None = None,
                 ignore_ids: tuple[int, ...] = (0, 1)) -> jax.Array:
    """C [B_img, B_txt]: mean over image i's GT captions (targets row i) of their TF-IDF cosine
    with caption j; the caption-caption cosine itself for identity targets. A constant."""
    k = tfidf_cosine(text, ignore_ids)
    if targets is not None:
        w = targets.astype(k.dtype)
        k = (w @ k) / jnp.maximum(jnp.sum(w, -1, keepdims=True), 1e-12)
    return jax.lax.stop_gradient(k)


# ----------------------------------------------------------------------------------- objectives
def _validate(base_cls):
    def validate(self) -> None:
        if hasattr(base_cls, "validate"):
            base_cls.validate(self)
        self.validate_daa()
    return validate


@dataclasses.dataclass(frozen=True)
class PcmeDaaConfig(pcme.Config, Knobs):
    """PCME's knobs (pcme.Config) + the DAA knobs, defaults from DAA's COCO config."""

    validate = _validate(pcme.Config)


def _pcme_daa_loss(out, cfg: PcmeDaaConfig, *, targets=None, masked=None, masked_rows=None, rng=None,
                   mesh=None):
    # DAA ranks the same samples PCME scores (probemb.py _compute_loss).
    zv, zt = pcme.sample_outputs(out, cfg, rng)
    terms = pcme.terms_from_samples(out, cfg, zv, zt, targets)
    if cfg.daa_beta > 0:
        terms.update(daa_terms(zv, zt, semantic_map(out["text"], targets, cfg.daa_ignore_ids), cfg))
    return sum(terms.values()), terms


pcme_daa = types.SimpleNamespace(
    Config=PcmeDaaConfig, loss=_pcme_daa_loss, NEEDS_LOGVAR=True, USES_MASKED=False,
    SOFT_TARGETS=False,  # the binary-positive semantic map; MSDA's mixed images are untested here
    __doc__="PCME + DAA (DAA §4.2; DAA's criterions/probemb.py with daa_beta).")


@functools.cache
def _vse_daa():
    from prolip_jax.core import objectives

    base = objectives.get("vse")

    @dataclasses.dataclass(frozen=True)
    class VseDaaConfig(base.Config, Knobs):
        """VSE's knobs + the DAA knobs. On a deterministic similarity DAA's authors use weight
        50 and tau = 0.001 (SGRAF-DAA's model.py Loss.DAA: `50 * (1 - ASP)`, temp 0.001)."""

        daa_beta: float = 50.0
        daa_tau: float = 0.001
        validate = _validate(base.Config)

    def loss(out, cfg, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None, step=None):
        _, terms = base.loss(out, cfg, targets=targets, masked=masked, masked_rows=masked_rows,
                             rng=rng, mesh=mesh, step=step)  # step: VSE∞'s sum warm-up
        terms = dict(terms)
        if cfg.daa_beta > 0:
            # S = mu_v . mu_t, the cosine of eq. 5 (mu are unit-norm): one "sample" per input.
            zv, zt = out["image_mean"][:, None, :], out["text_mean"][:, None, :]
            terms.update(daa_terms(zv, zt, semantic_map(out["text"], targets, cfg.daa_ignore_ids), cfg))
        return sum(terms.values()), terms

    return types.SimpleNamespace(
        Config=VseDaaConfig, loss=loss, NEEDS_LOGVAR=base.NEEDS_LOGVAR, USES_MASKED=base.USES_MASKED,
        SOFT_TARGETS=False, USES_STEP=True, __doc__="VSE-infinity triplet + DAA (PCME++'s DAA baseline, PCME++).")


def __getattr__(name: str):
    # vse_daa is built on first use: importing this module never imports (or needs) "vse".
    if name == "vse_daa":
        return _vse_daa()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
