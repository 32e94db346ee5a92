"""Cross-modal retrieval: image->text and text->image R@K, RSUM, R-Precision, mAP@R.

What the reference computes (naver-ai/prolip src/prolip_train/zero_shot_unc.py, `run_ret`): normalised mu, per-item uncertainty
u = sum_d sigma_d^2, `i2t = mu_i @ mu_t.T - u_t/2` (and t2i likewise) -- -CSD/2 up to per-query
constants, so the same ranking as -CSD -- then a stable argsort and `eccv_caption` metrics.
Here the scores come from `common.blocked_scores` ("csd": -CSD, the paper's protocol; "dot":
mu.mu, the reference's training-time validation), and each block of query rows is reduced at once
to the 0-based rank of every positive of the query (ties broken as a stable descending argsort:
the lower gallery index first), plus, only when `eccv_caption` is used, the top-k gallery indices.
The full [Q, M] matrix never exists. Every metric follows from the positives' ranks:

  R@K (%)          100 * mean_q [min rank of q's positives < K]
  R-Precision (%)  100 * mean_q |{positives with rank < R_q}| / R_q,     R_q = #positives of q
  mAP@R (%)        100 * mean_q 1/R_q sum_{r<=R_q} P@r * [item at rank r is a positive]
                   (Musgrave et al. 2020; exactly eccv_caption's `compute_eccv_metrics`)
  RSUM             i2t R@1+R@5+R@10 + t2i R@1+R@5+R@10 (max 600)

COCO: metrics on the full 5K test set (`.../5k/...`) and the mean over 5 folds of 1,000 images
(`.../1k/...`, the COCO 1K protocol; RSUM is reported on both). With `eccv_caption` installed
and the data being the COCO 5K test set with real ids (COCO image ids, COCO caption annotation
ids), the ECCV Caption and CxC metrics too, through `eccv_caption.Metrics` as the reference does.
On every protocol, optionally: PMRP (COCO instances file), ASP with a TF-IDF semantic score, and
class-level positives (CUB) -- evaluators/caption_metrics.py, on the same score blocks.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Iterator, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from evaluators import caption_metrics, retrieval_data
from evaluators.common import Encoder, blocked_scores, parse_config, tokenizer_from, uncertainty
from evaluators.ranks import PAD, full_ranks, num_positives, pad_positives, r_precision_per_query
from input_pipeline import eval_data
from input_pipeline.eval_data import EvalSet

log = logging.getLogger(__name__)

KS = (1, 5, 10)
_WARNED: set[tuple[str, str]] = set()   # (data set, direction) without same-modality positives
_MANY_POSITIVES = 32   # above this many positives per query, rank by one full sort per row


@dataclasses.dataclass(frozen=True)
class PairedSet:
    """An image-caption set and how it is encoded: the fields every evaluator of paired data
    shares (this one and evaluators/modality_gap.py); `load_data` reads the set."""
    # --- the data (`load_data`; a dataset's required fields are checked when it is read)
    dataset: Literal["demo", "karpathy", "cub", "tfds", "tar"] = "demo"
    demo: dict = dataclasses.field(default_factory=dict)  # demo: kwargs of input_pipeline.demo.get_demo
    karpathy_json: str = ""          # karpathy: dataset_coco.json / dataset_flickr30k.json
    image_root: str = ""             # karpathy: image_root/filepath/filename (or image_root/filename)
    split: str = "test"              # karpathy / tfds split; cub: <split_dir or root>/<split>classes.txt
    captions_per_image: int | None = None   # karpathy: the first k captions; None: 5 for COCO, else all
    # karpathy: captions_*2014.json path(s) (a sequence or comma-separated) for real COCO caption
    # ids (ECCV Caption / CxC); "" = none
    coco_annotations: str | tuple[str, ...] = ()
    root: str = ""                   # cub: images/ + text_c10/ (as the training source data.source='cub')
    split_dir: str = ""              # cub: where <split>classes.txt is; "" = root
    tfds_name: str = "coco_captions"   # tfds: the captions data set
    data_dir: str = ""               # tfds: its data_dir ("" = tfds' default)
    path: str | tuple[str, ...] = ""   # tar: shards in the training layout (files, globs, braces)
    num_images: int = 0              # tar: the first N samples (0 = all)
    name: str = ""                   # data set name in the metric names; "": demo / coco / flickr30k ...
    tokenizer: dict = dataclasses.field(default_factory=dict)  # kwargs of build_tokenizer (kind,
    #                                  path, ...), when no tokenizer is passed in (not for demo)
    # --- encoding
    batch_size: int = 256            # images per batch, per host
    image_size: int | None = None    # None: the model's vision.image_size
    normalization: str = "openai"    # image normalisation of the encoder
    num_threads: int = 8             # image reading threads per host

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ValueError("retrieval evaluator: batch_size must be >= 1")


@dataclasses.dataclass(frozen=True)
class Config(PairedSet):
    """The retrieval evaluator's knobs: config.evals.<name> with type="retrieval" (the set and
    its encoding: PairedSet's fields)."""
    # --- scoring
    scores: tuple[Literal["csd", "dot"], ...] = ("csd", "dot")   # -CSD (mu alone for a
    #                                  deterministic model) and/or mu.mu
    ks: tuple[int, ...] = KS         # the K of R@K
    block: int = 1024                # query rows per device block
    # --- protocols
    num_folds: int | None = None     # the 1K protocol's folds; None: 5 for COCO, else 0
    fold_size: int = 1000            # images per fold
    eccv: bool = True                # ECCV Caption + CxC (eccv_caption installed, COCO 5K ids)
    eccv_topk: int = 50              # ranked list length given to eccv_caption (>= 48 positives)
    unc_bins: int = 10               # R@1 / mAP@R per query-uncertainty bin, corr, rho (0: off)
    same_modality: tuple[Literal["i2i", "t2t"], ...] = ("i2i", "t2t")   # image->image, text->text
    positives: Literal["caption", "class"] = "caption"   # "class": every pair of the same class
    #                                  (data.info["class_ids"]; CUB's protocol)
    # --- PMRP (COCO instances_*2014.json path(s), a sequence or comma-separated; needs COCO image
    # ids) and ASP (TF-IDF semantic score): evaluators/caption_metrics.py
    instances: str | tuple[str, ...] = ()
    pmrp_zetas: tuple[int, ...] = caption_metrics.PMRP_ZETAS   # Hamming distances that count as
    #                                  plausible matches (the metric averages over them)
    pmrp_unannotated: Literal["drop", "zero"] = "drop"   # images without instances: left out
    #                                  (PCME's script) | kept with an all-zero vector
    asp: bool = False                # ASP with the TF-IDF semantic score
    asp_captions_per_image: int = 5  # P of DAA Eq. 7

    def validate(self) -> None:
        super().validate()
        if not self.ks or min(self.ks) < 1:
            raise ValueError(f"retrieval evaluator: ks={self.ks}; give K >= 1")
        if self.block < 1:
            raise ValueError("retrieval evaluator: block must be >= 1")


# =====================================================================================
# Metrics on the ranks of the positives (pure numpy).
# =====================================================================================
def positive_ranks(scores: np.ndarray, positives: np.ndarray) -> np.ndarray:
    """0-based rank of each positive in each query's ranking (higher score first).

    scores: [Q, M]; positives: int [Q, P] gallery indices, -1 = padding.
    Returns int64 [Q, P] (padding -> a huge value). Ties are broken like
    `np.argsort(-scores, kind="stable")` (naver-ai/prolip src/prolip_train/zero_shot_unc.py): an equal score at a lower gallery
    index ranks first, so rank = #{s > s_p} + #{j < p : s_j == s_p}.
    """
    scores = np.asarray(scores)
    positives = np.asarray(positives, np.int64)
    m = scores.shape[1]
    if positives.shape[1] > _MANY_POSITIVES:   # class-level positives (CUB): one sort per row
        full = full_ranks(scores)
        valid = positives >= 0
        got = np.take_along_axis(full, np.where(valid, positives, 0), 1)
        return np.where(valid, got, PAD).astype(np.int64)
    ranks = np.full(positives.shape, PAD, np.int64)
    cols = np.arange(m)[None, :]
    for j in range(positives.shape[1]):
        pos = positives[:, j]
        ranks[:, j] = np.where(pos >= 0, _rank_of(np, scores, pos, cols), PAD)
    return ranks


def _rank_of(xp: Any, scores: Any, pos: Any, cols: Any) -> Any:
    """The tie rule, once for the host (xp=numpy) and the device (jax.numpy): the 0-based rank
    of gallery item pos[i] in row i, #{s > s_p} + #{j < p : s_j == s_p}. pos [b] (-1: any
    value, masked by the caller), cols [1, M] the gallery indices."""
    sp = xp.take_along_axis(scores, xp.maximum(pos, 0)[:, None], 1)
    return (scores > sp).sum(1) + ((scores == sp) & (cols < pos[:, None])).sum(1)


def top_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """int64 [Q, k]: the first k of `np.argsort(-scores, kind="stable")` per row, without a
    full sort (partition, then a stable sort of the candidates >= the k-th score)."""
    scores = np.asarray(scores)
    k = min(k, scores.shape[1])
    neg = -scores
    kth = np.partition(neg, k - 1, axis=1)[:, k - 1]
    out = np.empty((len(scores), k), np.int64)
    for i in range(len(scores)):
        cand = np.flatnonzero(neg[i] <= kth[i])            # ascending indices: ties stay in order
        out[i] = cand[np.argsort(neg[i, cand], kind="stable")[:k]]
    return out


def recall_at_k(ranks: np.ndarray, k: int) -> float:
    """% of queries with at least one positive in the top k. ranks: [Q, P]."""
    return 100.0 * float(np.mean(np.min(ranks, 1) < k))


def r_precision(ranks: np.ndarray) -> float:
    """% mean over queries of |top-R ∩ positives| / R, R = the query's number of positives."""
    return 100.0 * float(np.mean(r_precision_per_query(ranks)))


def map_at_r(ranks: np.ndarray) -> float:
    """% mAP@R: mean over queries of (1/R) sum over the positives ranked within the top R of
    P@(rank+1), where P@n = (#positives in the top n) / n (Musgrave et al. 2020)."""
    r = num_positives(ranks)
    srt = np.sort(ranks, 1)                               # the j-th best positive has j+1 hits
    hits = np.arange(1, ranks.shape[1] + 1)[None, :]
    prec = np.where(srt < r[:, None], hits / (np.minimum(srt, PAD - 1) + 1.0), 0.0)
    return 100.0 * float(np.mean(prec.sum(1) / r))


def ranking_metrics(i2t_ranks: np.ndarray, t2i_ranks: np.ndarray,
                    ks: Sequence[int] = KS) -> dict[str, float]:
    """All metrics of one protocol: {i2t,t2i}_R@K, rsum, {i2t,t2i}_rprecision, {..}_map_at_r."""
    out: dict[str, float] = {}
    for d, ranks in (("i2t", i2t_ranks), ("t2i", t2i_ranks)):
        for k in ks:
            out[f"{d}_R@{k}"] = recall_at_k(ranks, k)
        out[f"{d}_rprecision"] = r_precision(ranks)
        out[f"{d}_map_at_r"] = map_at_r(ranks)
    out["rsum"] = sum(out[f"{d}_R@{k}"] for d in ("i2t", "t2i") for k in ks)
    return out


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson correlation of two equal-length vectors; 0.0 (not nan) when either is constant
    or has fewer than 2 entries."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    if len(x) < 2 or np.std(x) == 0 or np.std(y) == 0:
        return 0.0
    return float(np.corrcoef(x, y)[0, 1])


def binned_ranking(ranks: np.ndarray, unc: np.ndarray, bins: int = 10) -> dict[str, float]:
    """R@1 and mAP@R (%) of the queries in `bins` equal-count bins of increasing query
    uncertainty, and two bin-level Pearson correlations with each:
      unc_corr_*: with the bin index (the reference's `eval_ret_unc`, naver-ai/prolip src/prolip_train/zero_shot_unc.py);
      unc_rho_*:  with the bin's mean uncertainty -- PCME++ Fig. 3 / Table C.5's rho
                  ("the correlation coefficient between the uncertainty and the average R@1";
                  the paper names no estimator: the bin-level Pearson reading of its Fig. 3; -1 is ideal).
    Negative = uncertain queries are retrieved worse.
    Names: unc_bin{i}_R1, unc_bin{i}_map_at_r, unc_corr_{R1,map_at_r}, unc_rho_{R1,map_at_r}."""
    if len(ranks) == 0:
        raise ValueError("binned_ranking needs at least one query")
    unc = np.asarray(unc, np.float64)
    bins = min(bins, len(ranks))      # no empty bins
    groups = np.array_split(np.argsort(unc, kind="stable"), bins)
    mean_unc = np.array([unc[g].mean() for g in groups])
    out: dict[str, float] = {}
    for metric, fn in (("R1", lambda r: recall_at_k(r, 1)), ("map_at_r", map_at_r)):
        values = np.array([fn(ranks[g]) for g in groups])
        for i, v in enumerate(values):
            out[f"unc_bin{i}_{metric}"] = float(v)
        out[f"unc_corr_{metric}"] = pearson(np.arange(bins), values)
        out[f"unc_rho_{metric}"] = pearson(mean_unc, values)
    return out


def same_modality_positives(cap_img: np.ndarray, captions: Sequence[str] | None = None
                            ) -> dict[str, list[np.ndarray]]:
    """Positives of same-modality retrieval (the query itself is never a positive):
    t2t: the other captions of the query caption's image;
    i2i: the other images that have a caption identical to one of the query's (after lower-case
         and whitespace normalisation) -- "caption-sharing" images, the only image-image
         relation a captioned set defines (none on COCO-like sets with unique captions)."""
    cap_img = np.asarray(cap_img, np.int64)
    n = int(cap_img.max()) + 1 if len(cap_img) else 0
    by_img = [np.flatnonzero(cap_img == i) for i in range(n)]
    t2t = [by_img[cap_img[c]][by_img[cap_img[c]] != c] for c in range(len(cap_img))]
    i2i: list[np.ndarray] = [np.zeros(0, np.int64)] * n
    if captions is not None:
        images_of: dict[str, set[int]] = {}
        for c, text in enumerate(captions):
            images_of.setdefault(" ".join(str(text).lower().split()), set()).add(int(cap_img[c]))
        shared: list[set[int]] = [set() for _ in range(n)]
        for imgs in images_of.values():
            for i in imgs:
                shared[i] |= imgs
        i2i = [np.array(sorted(s - {i}), np.int64) for i, s in enumerate(shared)]
    return {"i2i": i2i, "t2t": t2t}


def _device_ranks(scores: jax.Array, positives: jax.Array, exclude: jax.Array | None = None) -> jax.Array:
    """`positive_ranks` on the device (same ties: rank = #{s > s_p} + #{j < p : s_j == s_p}),
    with `exclude` scored -inf first as the host path does; padding (-1) -> -1.
    scores [b, M] float; positives int32 [b, P]; exclude int32 [b] or None. Returns int32 [b, P]."""
    cols = jnp.arange(scores.shape[1], dtype=jnp.int32)[None, :]
    if exclude is not None:
        scores = jnp.where(cols == exclude[:, None], -jnp.inf, scores)

    def one(p: jax.Array) -> jax.Array:   # [b]: one positive per query
        return jnp.where(p >= 0, _rank_of(jnp, scores, p, cols).astype(jnp.int32), -1)

    return jax.vmap(one, in_axes=1, out_axes=1)(positives)


def blocked_ranks(q_mu: np.ndarray, q_lv: np.ndarray, g_mu: np.ndarray, g_lv: np.ndarray,
                  positives: np.ndarray, kind: str = "csd", block: int = 1024, topk: int = 0,
                  exclude: np.ndarray | None = None,
                  extras: Sequence[Callable[[np.ndarray, int], Any]] = ()
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """positive_ranks (and top_indices when topk > 0) of queries [Q, D] against a gallery
    [M, D], computed block by block on the devices: only [Q, P] (+ [Q, topk]) is kept.
    exclude: int [Q], a gallery item left out of each query's ranking (the query itself in
    same-modality retrieval). extras: more reductions `fn(scores [b, M], start)` of the same
    score blocks (PMRP, ASP: evaluators/caption_metrics.py), so the scores are computed once.
    With ranks alone (no topk, no extras, at most _MANY_POSITIVES per query) the ranks are
    counted on the device and only [b, P] comes back (`_device_ranks`, same values)."""
    positives = np.asarray(positives, np.int64)
    if not topk and not extras and positives.shape[1] <= _MANY_POSITIVES and len(g_mu) < 2 ** 31:
        rows = (positives.astype(np.int32),) + (() if exclude is None else (np.asarray(exclude, np.int32),))
        parts = [r for _, r in blocked_scores(q_mu, q_lv, g_mu, g_lv, kind=kind, block=block,
                                               device_reduce=_device_ranks, rows=rows)]
        got = np.concatenate(parts).astype(np.int64) if parts else np.empty(positives.shape, np.int64)
        return np.where(got < 0, PAD, got), None
    ranks = np.empty(positives.shape, np.int64)
    tops = np.empty((len(q_mu), min(topk, len(g_mu))), np.int64) if topk else None

    def reduce(s: np.ndarray, start: int) -> None:
        if exclude is not None:
            s = s.copy()
            s[np.arange(len(s)), exclude[start:start + len(s)]] = -np.inf   # never ranked
        ranks[start:start + len(s)] = positive_ranks(s, positives[start:start + len(s)])
        if tops is not None:
            tops[start:start + len(s)] = top_indices(s, topk)
        for fn in extras:
            fn(s, start)

    for _ in blocked_scores(q_mu, q_lv, g_mu, g_lv, kind=kind, block=block, reduce=reduce):
        pass
    return ranks, tops


# =====================================================================================
# Data: evaluators/retrieval_data.py readers, input_pipeline.eval_data demo sets (images read
# sharded over the hosts, captions known to all).
# =====================================================================================
def load_data(c: PairedSet) -> EvalSet:
    kind = c.dataset
    if kind == "demo":
        data = eval_data.demo("retrieval", c.demo)
    elif kind == "karpathy":
        for key in ("karpathy_json", "image_root"):
            if not getattr(c, key):
                raise ValueError(f"retrieval evaluator: dataset='karpathy' needs {key!r}")
        data = retrieval_data.karpathy(c.karpathy_json, c.image_root, c.split, c.captions_per_image,
                                       paths(c.coco_annotations))
    elif kind == "cub":
        if not c.root:
            raise ValueError("retrieval evaluator: dataset='cub' needs 'root' (images/ and text_c10/)")
        data = retrieval_data.cub_captions(c.root, c.split, c.split_dir)
    elif kind == "tfds":
        data = retrieval_data.tfds_captions(c.tfds_name, c.split, c.data_dir or None)
    else:
        if not c.path:
            raise ValueError("retrieval evaluator: dataset='tar' needs 'path' (tar shards: files, "
                             "globs or a brace pattern)")
        data = retrieval_data.image_text_tars(c.path, limit=c.num_images)
    if c.name:
        data.name = c.name
    return data


def paths(value: Any) -> tuple[str, ...]:
    """A list of file paths from a sequence or a comma-separated string ("" -> ())."""
    if isinstance(value, str):
        return tuple(p.strip() for p in value.split(",") if p.strip())
    return tuple(str(p) for p in (value or ()) if str(p))


# =====================================================================================
# Evaluator.
# =====================================================================================
class Evaluator:
    """Retrieval evaluator; `run(params)` yields ("retrieval/<name>/<score>/<metric>", value).

    Config: `Config` (the data set, scores, protocols, PMRP / ASP, encoding knobs).
    Metric names (values in %; rsum is a sum of six %):
      <prefix>/{i2t,t2i}_R@{1,5,10}, rsum, {i2t,t2i}_rprecision, {i2t,t2i}_map_at_r, where
      prefix = retrieval/<name>/<score> (or .../5k and .../1k for COCO);
      retrieval/<name>/<score>/eccv/{i2t,t2i,mean}_{r1,map_at_r,rprecision};
      retrieval/<name>/<score>/cxc/{i2t,t2i}_R@{1,5,10};
      <prefix>/{i2t,t2i}_pmrp, {i2t,t2i}_pmrp_zeta{0,1,2} (with instances);
      <prefix>/{i2t,t2i}_asp_tfidf (with asp);
      <prefix>/{i2t,t2i}/unc_bin{0..B-1}_{R1,map_at_r}, {i2t,t2i}/unc_corr_{R1,map_at_r},
        {i2t,t2i}/unc_rho_{R1,map_at_r} (bin 0 = least uncertain queries; corr: with the bin
        index, rho: with the bin's mean sigma^2, PCME++ Table C.5; .../5k/... for COCO on the
        full set, and .../1k/... on the queries of the folds ranked within their fold, the
        R@1 of PCME++ Fig. 3);
      <prefix>/{i2i,t2t}_R@{1,5,10}, {i2i,t2t}_rprecision, {i2i,t2t}_map_at_r,
        {i2i,t2t}_num_queries (those with >= 1 positive), and with unc_bins {i2i,t2t}/unc_bin...
    """
    HEADLINE = (r"(^|/)(i2t|t2i)_R@1$",)  # the metrics the trainer's console line shows (regexes)

    def __init__(self, config: Any, model: Any, tokenizer: Any = None, data: EvalSet | None = None):
        """data: an already opened set (else the config's, loaded on first use)."""
        self.config = c = parse_config(Config, config, "retrieval")
        self.model = model
        mcfg = model.config
        self.image_size = int(c.image_size or mcfg.vision.image_size)
        self.context_length = int(mcfg.text.context_length)
        self.scores = c.scores
        self.ks = c.ks
        self.block = c.block
        self.positives = c.positives
        self.threads = c.num_threads
        self.encoder = Encoder(model, c.batch_size, c.normalization)
        self._tokenizer = tokenizer
        self._data = data
        self.last_throughput: dict[str, float] = {}

    # ---- data ------------------------------------------------------------------------
    def data(self) -> EvalSet:
        if self._data is None:
            self._data = load_data(self.config)
        return self._data

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            make = self.data().info.get("tokenizer")   # the demo's own
            self._tokenizer = (make(self.context_length) if make else
                               tokenizer_from(self.config.tokenizer, self.context_length, "retrieval evaluator"))
        return self._tokenizer

    def encode(self, params: Any, data: EvalSet, progress: Callable[[int], None] | None = None
               ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, np.ndarray | None]:
        """(image mu [N, D], image logvar, text mu [M, D], text logvar); logvar None for a
        deterministic model."""
        batches = data.batches(self.encoder.batch_size * jax.process_count(), self.image_size,
                               self.encoder.normalization, self.threads)
        img = self.encoder.dataset(params, batches, len(data), progress)
        self.last_throughput["images"] = self.encoder.last_throughput
        t_mu, t_lv = self.encoder.texts(params, self.tokenizer()(data.captions), progress)
        self.last_throughput["texts"] = self.encoder.last_throughput
        return img["mu"], img.get("logvar"), t_mu, t_lv

    # ---- metrics ----------------------------------------------------------------------
    def _protocol(self, i_mu, i_lv, t_mu, t_lv, cap_img: np.ndarray, kind: str,
                  topk: int = 0, images: Any = None, caps: Any = None
                  ) -> tuple[dict[str, float], Any, tuple[np.ndarray, np.ndarray]]:
        """Metrics of one image set with its captions (cap_img: int [M] into the images),
        the top-k lists and the positives' ranks (i2t, t2i). images / caps: the set's rows in
        the full data (slice / indices; None = all), for the per-item extras (PMRP, ASP)."""
        if self.positives == "class":
            i2t_pos, t2i_pos = caption_metrics.class_positives(
                self._class_ids[_all(images)], cap_img)
        else:
            i2t_pos = pad_positives([np.flatnonzero(cap_img == i) for i in range(len(i_mu))])
            t2i_pos = cap_img[:, None]
        extras, finish = self._extras(_all(images), _all(caps), cap_img)
        i2t, i2t_top = blocked_ranks(i_mu, i_lv, t_mu, t_lv, i2t_pos, kind, self.block, topk,
                                     extras=extras["i2t"])
        t2i, t2i_top = blocked_ranks(t_mu, t_lv, i_mu, i_lv, t2i_pos, kind, self.block,
                                     topk, extras=extras["t2i"])
        metrics = ranking_metrics(i2t, t2i, self.ks)
        metrics.update(finish())
        return metrics, (i2t_top, t2i_top), (i2t, t2i)

    # ---- PMRP / ASP / class positives: per-item data of the whole set, sliced per protocol --
    def _prepare(self, data: EvalSet) -> None:
        """Category codes (PMRP), TF-IDF vectors (ASP) and class ids of the whole set; once per
        set (the trainer evaluates the same set again and again)."""
        if getattr(self, "_prepared_for", None) is data:
            return
        cm = caption_metrics
        c = self.config
        self._class_ids = self._codes = self._tfidf = None
        if self.positives == "class":
            if data.info.get("class_ids") is None:
                raise ValueError(f"retrieval/{data.name}: positives='class' needs class ids "
                                 "(dataset='cub')")
            self._class_ids = np.asarray(data.info["class_ids"])
        files = paths(c.instances)
        if files:
            if data.info.get("image_ids") is None:
                raise ValueError(f"retrieval/{data.name}: PMRP (instances=...) needs COCO image "
                                 "ids (a COCO Karpathy or tfds set)")
            codes, annotated = retrieval_data.coco_category_codes(files, data.info["image_ids"])
            rule = c.pmrp_unannotated
            if not annotated.all():
                log.info("retrieval/%s: %d of %d images have no instance annotation (PMRP: %s)",
                         data.name, int((~annotated).sum()), len(annotated), rule)
            self._codes = (codes, annotated if rule == "drop" else np.ones(len(codes), bool))
        elif data.name == "coco" and (data.name, "pmrp") not in _WARNED:
            _WARNED.add((data.name, "pmrp"))
            log.warning("retrieval/coco: PMRP skipped: no COCO instances file named "
                        "(config instances=.../instances_val2014.json)")
        if c.asp:
            vectors = cm.tfidf_vectors(data.captions)
            cap_img = np.asarray(data.caption_record, np.int64)
            gt = cm.ground_truth_mean(vectors, cap_img, len(data),
                                      c.asp_captions_per_image)
            self._tfidf = (vectors, gt)
        self._prepared_for = data

    def _extras(self, images: np.ndarray, caps: np.ndarray, cap_img: np.ndarray
                ) -> tuple[dict[str, list], Callable[[], dict[str, float]]]:
        """blocked_ranks extras of one protocol (images, caps: its rows in the whole set)."""
        cm = caption_metrics
        extras: dict[str, list] = {"i2t": [], "t2i": []}
        done: list[tuple[str, Any]] = []
        if getattr(self, "_codes", None) is not None:
            codes, keep = self._codes
            zetas = self.config.pmrp_zetas
            ic, ik = codes[images], keep[images]
            tc, tk = ic[cap_img], ik[cap_img]
            for d, acc in (("i2t", cm.PMRP(ic, tc, zetas, ik, tk)), ("t2i", cm.PMRP(tc, ic, zetas, tk, ik))):
                extras[d].append(acc)
                done.append((d, acc))
        if getattr(self, "_tfidf", None) is not None:
            vectors, gt = self._tfidf
            for d, acc in zip(("i2t", "t2i"), cm.asp_pair(vectors[caps], gt[images])):
                extras[d].append(acc)
                done.append((d, acc))

        def finish() -> dict[str, float]:
            out: dict[str, float] = {}
            for d, acc in done:
                out.update(acc.result(d))
            return out
        return extras, finish

    def _uncertainty_aware(self, data: EvalSet, i_mu, i_lv, t_mu, t_lv, cap_img: np.ndarray,
                           kind: str, ranks: tuple[np.ndarray, np.ndarray]
                           ) -> Iterator[tuple[str, float]]:
        """Recall per query-uncertainty bin (cross-modal and same-modality) and i2i / t2t."""
        bins = self.config.unc_bins
        probabilistic = i_lv is not None and t_lv is not None
        if bins and probabilistic:
            for d, r, lv in (("i2t", ranks[0], i_lv), ("t2i", ranks[1], t_lv)):
                for k, v in binned_ranking(r, uncertainty(lv), bins).items():
                    yield f"{d}/{k}", v
        wanted = self.config.same_modality
        if not wanted:
            return
        positives = same_modality_positives(cap_img, data.captions)
        emb = {"i2i": (i_mu, i_lv), "t2t": (t_mu, t_lv)}
        for d in wanted:
            has = np.flatnonzero([len(p) > 0 for p in positives[d]])
            if len(has) == 0:
                if (data.name, d) in _WARNED:   # once per data set, not at every evaluation
                    continue
                _WARNED.add((data.name, d))
                log.warning("retrieval/%s: no %s query has a positive (%s); %s metrics skipped",
                            data.name, d, "no two images share a caption" if d == "i2i"
                            else "one caption per image", d)
                continue
            mu, lv = emb[d]
            r, _ = blocked_ranks(mu[has], _rows(lv, has), mu, lv,
                                 pad_positives([positives[d][q] for q in has]), kind,
                                 self.block, exclude=has)
            for k in self.ks:
                yield f"{d}_R@{k}", recall_at_k(r, k)
            yield f"{d}_rprecision", r_precision(r)
            yield f"{d}_map_at_r", map_at_r(r)
            yield f"{d}_num_queries", float(len(has))
            if bins and lv is not None:
                for k, v in binned_ranking(r, uncertainty(lv[has]), bins).items():
                    yield f"{d}/{k}", v

    def _fold_bins(self, fold_ranks: list, i_lv, t_lv) -> Iterator[tuple[str, float]]:
        """Recall per query-uncertainty bin over the queries of all folds, each ranked within
        its fold (COCO 1K R@1 per bin: PCME++ Fig. 3, rho of Table C.5)."""
        bins = self.config.unc_bins
        if not bins or i_lv is None or t_lv is None:
            return
        for d, j, lv in (("i2t", 0, i_lv), ("t2i", 1, t_lv)):
            rows = np.concatenate([fr[j] for fr in fold_ranks])
            width = max(fr[2][j].shape[1] for fr in fold_ranks)
            ranks = np.concatenate([np.pad(fr[2][j], ((0, 0), (0, width - fr[2][j].shape[1])),
                                           constant_values=PAD) for fr in fold_ranks])
            for k, v in binned_ranking(ranks, uncertainty(lv[rows]), bins).items():
                yield f"{d}/{k}", v

    def _eccv_ready(self, data: EvalSet) -> Any:
        image_ids, caption_ids = data.info.get("image_ids"), data.info.get("caption_ids")
        if not self.config.eccv or image_ids is None or caption_ids is None:
            if (self.config.eccv and data.name == "coco"
                    and (data.name, "eccv") not in _WARNED):
                _WARNED.add((data.name, "eccv"))
                log.warning("retrieval/coco: ECCV Caption / CxC skipped: no COCO caption ids "
                            "(config coco_annotations=.../captions_val2014.json)")
            return None
        try:
            import eccv_caption  # optional dependency (pip install eccv_caption): imported where used
        except ImportError:
            if data.name == "coco" and (data.name, "eccv") not in _WARNED:
                _WARNED.add((data.name, "eccv"))
                log.warning("retrieval/coco: ECCV Caption / CxC skipped: eccv_caption is not "
                            "installed (pip install eccv_caption)")
            return None
        metrics = eccv_caption.Metrics()
        if (set(caption_ids.tolist()) != set(metrics.coco_ids.tolist())
                or set(image_ids.tolist()) != set(metrics.coco_gts["i2t"])):
            log.warning("retrieval: ids are not COCO 5K test ids; ECCV/CxC metrics skipped")
            return None
        return metrics

    def run(self, params: Any, progress: Callable[[int], None] | None = None
            ) -> Iterator[tuple[str, float]]:
        data = self.data()
        self._prepare(data)   # before encoding: a bad instances file fails fast
        i_mu, i_lv, t_mu, t_lv = self.encode(params, data, progress)
        cap_img = np.asarray(data.caption_record, np.int64)
        is_coco = data.name == "coco"
        folds = (5 if is_coco else 0) if self.config.num_folds is None else self.config.num_folds
        fold_size = self.config.fold_size
        eccv = self._eccv_ready(data)
        topk = self.config.eccv_topk if eccv is not None else 0
        for kind in self.scores:
            prefix = f"retrieval/{data.name}/{kind}"
            full, (i2t_top, t2i_top), ranks = self._protocol(i_mu, i_lv, t_mu, t_lv, cap_img,
                                                             kind, topk)
            full_prefix = f"{prefix}/5k" if is_coco else prefix
            yield from ((f"{full_prefix}/{k}", v) for k, v in full.items())
            for k, v in self._uncertainty_aware(data, i_mu, i_lv, t_mu, t_lv, cap_img, kind, ranks):
                yield f"{full_prefix}/{k}", v
            if folds:   # COCO 1K: folds of `fold_size` consecutive images and their captions
                per_fold, fold_ranks = [], []
                for f in range(folds):
                    lo, hi = f * fold_size, (f + 1) * fold_size
                    caps = np.flatnonzero((cap_img >= lo) & (cap_img < hi))
                    m, _, r = self._protocol(i_mu[lo:hi], _rows(i_lv, slice(lo, hi)), t_mu[caps],
                                             _rows(t_lv, caps), cap_img[caps] - lo, kind,
                                             images=slice(lo, hi), caps=caps)
                    per_fold.append(m)
                    fold_ranks.append((np.arange(lo, hi), caps, r))
                for k in per_fold[0]:
                    yield f"{prefix}/1k/{k}", float(np.mean([m[k] for m in per_fold]))
                for k, v in self._fold_bins(fold_ranks, i_lv, t_lv):
                    yield f"{prefix}/1k/{k}", v
            if eccv is not None:
                yield from self._eccv(eccv, data, i2t_top, t2i_top, prefix)

    def _eccv(self, metrics: Any, data: EvalSet, i2t_top: np.ndarray,
              t2i_top: np.ndarray, prefix: str) -> Iterator[tuple[str, float]]:
        """ECCV Caption and CxC metrics by eccv_caption on the top-k lists (naver-ai/prolip src/prolip_train/zero_shot_unc.py)."""
        image_ids, caption_ids = data.info["image_ids"], data.info["caption_ids"]
        i2t = {int(image_ids[q]): caption_ids[row].tolist() for q, row in enumerate(i2t_top)}
        t2i = {int(caption_ids[q]): image_ids[row].tolist() for q, row in enumerate(t2i_top)}
        res = metrics.compute_all_metrics(
            i2t, t2i, target_metrics=("eccv_r1", "eccv_map_at_r", "eccv_rprecision",
                                      "cxc_recalls"), Ks=self.ks, verbose=False)
        for m in ("r1", "map_at_r", "rprecision"):
            v = res[f"eccv_{m}"]
            for d in ("i2t", "t2i"):
                yield f"{prefix}/eccv/{d}_{m}", 100.0 * float(v[d])
            yield f"{prefix}/eccv/mean_{m}", 50.0 * float(v["i2t"] + v["t2i"])
        for k in self.ks:
            for d in ("i2t", "t2i"):
                yield f"{prefix}/cxc/{d}_R@{k}", 100.0 * float(res[f"cxc_r{k}"][d])


def _rows(x: np.ndarray | None, rows: Any) -> np.ndarray | None:
    return None if x is None else x[rows]


def _all(rows: Any) -> Any:
    """None (the whole set) -> slice(None) for indexing."""
    return slice(None) if rows is None else rows
