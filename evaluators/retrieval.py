"""Cross-modal retrieval: image->text and text->image R@K, RSUM, R-Precision, mAP@R.

What the reference computes (REFERENCE §3.3, `run_ret`): normalised mu, per-item uncertainty
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
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np

from evaluators.common import Encoder, blocked_scores

log = logging.getLogger(__name__)

KS = (1, 5, 10)
_PAD = np.iinfo(np.int64).max // 2   # rank of a padding "positive": never < any K or R


# =====================================================================================
# Metrics on the ranks of the positives (pure numpy).
# =====================================================================================
def positive_ranks(scores: np.ndarray, positives: np.ndarray) -> np.ndarray:
    """0-based rank of each positive in each query's ranking (higher score first).

    scores: [Q, M]; positives: int [Q, P] gallery indices, -1 = padding.
    Returns int64 [Q, P] (padding -> a huge value). Ties are broken like
    `np.argsort(-scores, kind="stable")` (REFERENCE §3.3): an equal score at a lower gallery
    index ranks first, so rank = #{s > s_p} + #{j < p : s_j == s_p}.
    """
    scores = np.asarray(scores)
    positives = np.asarray(positives, np.int64)
    q, m = scores.shape
    ranks = np.full(positives.shape, _PAD, np.int64)
    cols = np.arange(m)[None, :]
    rows = np.arange(q)
    for j in range(positives.shape[1]):
        pos = positives[:, j]
        valid = pos >= 0
        sp = scores[rows, np.where(valid, pos, 0)][:, None]
        r = (scores > sp).sum(1) + ((scores == sp) & (cols < pos[:, None])).sum(1)
        ranks[:, j] = np.where(valid, r, _PAD)
    return ranks


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


def num_positives(ranks: np.ndarray) -> np.ndarray:
    """[Q] number of (non-padding) positives per query, from positive_ranks' output."""
    return (np.asarray(ranks) < _PAD).sum(1)


def recall_at_k(ranks: np.ndarray, k: int) -> float:
    """% of queries with at least one positive in the top k. ranks: [Q, P]."""
    return 100.0 * float(np.mean(np.min(ranks, 1) < k))


def r_precision(ranks: np.ndarray) -> float:
    """% mean over queries of |top-R ∩ positives| / R, R = the query's number of positives."""
    r = num_positives(ranks)
    return 100.0 * float(np.mean((ranks < r[:, None]).sum(1) / r))


def map_at_r(ranks: np.ndarray) -> float:
    """% mAP@R: mean over queries of (1/R) sum over the positives ranked within the top R of
    P@(rank+1), where P@n = (#positives in the top n) / n (Musgrave et al. 2020)."""
    r = num_positives(ranks)
    srt = np.sort(ranks, 1)                               # the j-th best positive has j+1 hits
    hits = np.arange(1, ranks.shape[1] + 1)[None, :]
    prec = np.where(srt < r[:, None], hits / (np.minimum(srt, _PAD - 1) + 1.0), 0.0)
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


def pad_positives(lists: Sequence[Sequence[int]]) -> np.ndarray:
    """Ragged lists of gallery indices -> int64 [Q, max len] padded with -1."""
    width = max((len(x) for x in lists), default=0)
    out = np.full((len(lists), max(width, 1)), -1, np.int64)
    for i, x in enumerate(lists):
        out[i, :len(x)] = x
    return out


def blocked_ranks(q_mu: np.ndarray, q_lv: np.ndarray, g_mu: np.ndarray, g_lv: np.ndarray,
                  positives: np.ndarray, kind: str = "csd", block: int = 1024, topk: int = 0
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """positive_ranks (and top_indices when topk > 0) of queries [Q, D] against a gallery
    [M, D], computed block by block on the devices: only [Q, P] (+ [Q, topk]) is kept."""
    ranks = np.empty(positives.shape, np.int64)
    tops = np.empty((len(q_mu), min(topk, len(g_mu))), np.int64) if topk else None

    def reduce(s: np.ndarray, start: int) -> None:
        ranks[start:start + len(s)] = positive_ranks(s, positives[start:start + len(s)])
        if tops is not None:
            tops[start:start + len(s)] = top_indices(s, topk)

    for _ in blocked_scores(q_mu, q_lv, g_mu, g_lv, kind=kind, block=block, reduce=reduce):
        pass
    return ranks, tops


# =====================================================================================
# Data.
# =====================================================================================
@dataclass
class RetrievalData:
    """An image-caption test set.

    images: [N, S, S, 3] (uint8 or float32 normalised), or a callable (start, stop) -> such a
    chunk (decoded lazily). captions: [M] str; caption_image: int [M], the image of each caption.
    image_ids / caption_ids: COCO image ids / caption annotation ids when known (eccv_caption).
    """
    name: str
    num_images: int
    images: np.ndarray | Callable[[int, int], np.ndarray]
    captions: list[str]
    caption_image: np.ndarray
    image_ids: np.ndarray | None = None
    caption_ids: np.ndarray | None = None
    text: np.ndarray | None = None          # pre-tokenised [M, L] (demo)

    def image_chunk(self, start: int, stop: int) -> np.ndarray:
        if callable(self.images):
            return self.images(start, stop)
        return self.images[start:stop]


def _get(config: Mapping[str, Any], key: str, default: Any = None) -> Any:
    return config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)


def _need(path: str, what: str) -> str:
    if not os.path.exists(path):
        raise FileNotFoundError(f"retrieval evaluator: {what} not found: {path}")
    return path


def _norm_text(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().lower())


def _coco_caption_ids(files: Sequence[str]) -> dict[tuple[int, str], int]:
    """(COCO image id, normalised caption) -> caption annotation id, from captions_*.json."""
    table: dict[tuple[int, str], int] = {}
    for f in files:
        with open(_need(f, "COCO captions annotation file")) as fh:
            for a in json.load(fh)["annotations"]:
                table[(int(a["image_id"]), _norm_text(a["caption"]))] = int(a["id"])
    return table


def _coco_5k_ids() -> tuple[set[int], set[int]] | None:
    """(image ids, caption ids) of the COCO 5K test set as eccv_caption ships them, or None."""
    try:
        import eccv_caption
    except ImportError:
        return None
    data = os.path.join(os.path.dirname(eccv_caption.__file__), "data")
    with open(os.path.join(data, "original_image_to_caption.json")) as f:
        images = {int(k) for k in json.load(f)}
    return images, set(np.load(os.path.join(data, "coco_test_ids.npy")).tolist())


def _load_images(paths: list[str], size: int) -> Callable[[int, int], np.ndarray]:
    from input_pipeline.decode import load_rgb
    from input_pipeline.transforms import eval_transform

    def chunk(start: int, stop: int) -> np.ndarray:
        out = []
        for p in paths[start:stop]:
            with open(p, "rb") as f:
                img = load_rgb(f.read(), max_pixels=1 << 30, min_side=1)
            if not hasattr(img, "size"):
                raise ValueError(f"retrieval evaluator: cannot decode image {p} ({img})")
            out.append(eval_transform(img, size))
        return np.stack(out)
    return chunk


def load_karpathy(json_path: str, image_root: str, image_size: int, split: str = "test",
                  captions_per_image: int | None = None,
                  coco_annotations: Sequence[str] = ()) -> RetrievalData:
    """A Karpathy-split file (dataset_coco.json / dataset_flickr30k.json) + its image folder.

    Images at `image_root/filepath/filename` (COCO) or `image_root/filename` (Flickr30k).
    COCO caption annotation ids (for eccv_caption) come from a sentence's "id" field or from
    `coco_annotations` (captions_{train,val}2014.json) matched on (cocoid, text). For COCO with
    known ids and eccv_caption installed, the captions kept are the 5K protocol's (its ids);
    otherwise the first `captions_per_image` (default 5 for COCO, all otherwise).
    """
    with open(_need(json_path, "Karpathy split file")) as f:
        meta = json.load(f)
    name = meta.get("dataset", os.path.splitext(os.path.basename(json_path))[0])
    entries = [e for e in meta["images"] if e.get("split") == split]
    if not entries:
        raise ValueError(f"retrieval evaluator: no images with split {split!r} in {json_path}")
    is_coco = name == "coco"
    if captions_per_image is None and is_coco:
        captions_per_image = 5
    ann = _coco_caption_ids(coco_annotations) if coco_annotations else {}
    coco_5k = _coco_5k_ids() if is_coco else None

    paths, captions, cap_img, image_ids, cap_ids = [], [], [], [], []
    for i, e in enumerate(entries):
        p = os.path.join(image_root, e.get("filepath", ""), e["filename"])
        if not os.path.exists(p):
            p = _need(os.path.join(image_root, e["filename"]), "image")
        paths.append(p)
        image_ids.append(int(e.get("cocoid", e.get("imgid", i))))
        sents = []
        for s in e["sentences"]:
            cid = s.get("id", ann.get((image_ids[-1], _norm_text(s["raw"]))))
            sents.append((s["raw"], None if cid is None else int(cid)))
        known = all(c is not None for _, c in sents)
        if known and coco_5k is not None and image_ids[-1] in coco_5k[0]:
            sents = [x for x in sents if x[1] in coco_5k[1]]   # the 5K protocol's 5 captions
        elif captions_per_image:
            sents = sents[:captions_per_image]
        for raw, cid in sents:
            captions.append(raw)
            cap_img.append(i)
            cap_ids.append(cid)
    ids_known = all(c is not None for c in cap_ids)
    return RetrievalData(name=name, num_images=len(paths), images=_load_images(paths, image_size),
                         captions=captions, caption_image=np.asarray(cap_img, np.int64),
                         image_ids=np.asarray(image_ids, np.int64) if is_coco else None,
                         caption_ids=np.asarray(cap_ids, np.int64) if ids_known else None)


def load_tfds(name: str, split: str, data_dir: str | None, image_size: int) -> RetrievalData:
    """tfds `coco_captions` (its "test" split is the Karpathy 5K test set; real COCO ids)."""
    from input_pipeline.decode import load_rgb
    from input_pipeline.sources import tfds_source
    from input_pipeline.transforms import eval_transform

    src = tfds_source(name, split, data_dir)
    captions, cap_img, cap_ids, image_ids = [], [], [], []
    for i in range(len(src)):
        ex = src[i]
        image_ids.append(int(ex["image/id"]))
        for t, cid in zip(ex["captions"]["text"], ex["captions"]["id"]):
            captions.append(t.decode() if isinstance(t, bytes) else str(t))
            cap_img.append(i)
            cap_ids.append(int(cid))

    def chunk(start: int, stop: int) -> np.ndarray:
        return np.stack([eval_transform(load_rgb(np.asarray(src[i]["image"]), 1 << 30, 1),
                                        image_size) for i in range(start, stop)])
    return RetrievalData(name="coco" if "coco" in name else name, num_images=len(src),
                         images=chunk, captions=captions, caption_image=np.asarray(cap_img),
                         image_ids=np.asarray(image_ids), caption_ids=np.asarray(cap_ids))


def load_demo(demo_kwargs: Mapping[str, Any], image_size: int, context_length: int
              ) -> tuple[RetrievalData, Any]:
    """The demo dataset's "retrieval" split (one caption per image) and its tokenizer."""
    from input_pipeline.demo import get_demo

    ds = get_demo(**dict(demo_kwargs))
    split = ds.load_split("retrieval", image_size=image_size, context_length=context_length)
    n = len(split["image"])
    data = RetrievalData(name="demo", num_images=n, images=split["image"],
                         captions=list(split["captions"]), caption_image=np.arange(n),
                         text=split["text"])
    return data, ds.tokenizer(context_length)


# =====================================================================================
# Evaluator.
# =====================================================================================
class Evaluator:
    """Retrieval evaluator; `run(params)` yields ("retrieval/<name>/<score>/<metric>", value).

    Config keys:
      dataset: "demo" | "karpathy" | "tfds".
        demo: demo=dict(cache_dir=..., <DemoConfig fields>).
        karpathy: karpathy_json, image_root, split ("test"), captions_per_image (5 for COCO),
          coco_annotations (captions_*2014.json paths, optional: real caption ids).
        tfds: tfds_name ("coco_captions"), split ("test"), data_dir.
      tokenizer: dict(kind=..., path=..., **kw) for input_pipeline.tokenizers.build_tokenizer
        (not for demo, or pass `tokenizer=` to the constructor).
      name: dataset name in metric names (default demo / coco / flickr30k).
      scores: ("csd", "dot"); ks: (1, 5, 10); batch_size: 256; block: 1024 (query rows per
      device block); image_size (the model's); normalization ("openai"); image_chunk: 1024.
      num_folds: the 1K protocol's folds (5 for COCO, else 0); fold_size: 1000.
      eccv: True (ECCV Caption + CxC when eccv_caption is importable and the ids are COCO 5K);
      eccv_topk: 50 (ranked list length given to eccv_caption; >= max #ECCV positives = 48).
    Metric names (values in %; rsum is a sum of six %):
      <prefix>/{i2t,t2i}_R@{1,5,10}, rsum, {i2t,t2i}_rprecision, {i2t,t2i}_map_at_r, where
      prefix = retrieval/<name>/<score> (or .../5k and .../1k for COCO);
      retrieval/<name>/<score>/eccv/{i2t,t2i,mean}_{r1,map_at_r,rprecision};
      retrieval/<name>/<score>/cxc/{i2t,t2i}_R@{1,5,10}.
    """

    def __init__(self, config: Mapping[str, Any], model: Any, tokenizer: Any = None):
        self.config, self.model = config, model
        mcfg = model.config
        self.image_size = int(_get(config, "image_size", mcfg.vision.image_size))
        self.context_length = int(mcfg.text.context_length)
        self.scores = tuple(_get(config, "scores", ("csd", "dot")))
        self.ks = tuple(int(k) for k in _get(config, "ks", KS))
        self.block = int(_get(config, "block", 1024))
        self.image_chunk = int(_get(config, "image_chunk", 1024))
        self.encoder = Encoder(model, int(_get(config, "batch_size", 256)),
                               _get(config, "normalization", "openai"))
        self._tokenizer = tokenizer
        self._data: RetrievalData | None = None
        self.last_throughput: dict[str, float] = {}

    # ---- data ------------------------------------------------------------------------
    def data(self) -> RetrievalData:
        if self._data is None:
            c, kind = self.config, _get(self.config, "dataset", "demo")
            if kind == "demo":
                self._data, tok = load_demo(_get(c, "demo", {}) or {}, self.image_size,
                                            self.context_length)
                self._tokenizer = self._tokenizer or tok
            elif kind == "karpathy":
                for key in ("karpathy_json", "image_root"):
                    if not _get(c, key):
                        raise ValueError(f"retrieval evaluator: dataset='karpathy' needs {key!r}")
                self._data = load_karpathy(_get(c, "karpathy_json"), _get(c, "image_root"),
                                           self.image_size, _get(c, "split", "test"),
                                           _get(c, "captions_per_image"),
                                           tuple(_get(c, "coco_annotations", ()) or ()))
            elif kind == "tfds":
                self._data = load_tfds(_get(c, "tfds_name", "coco_captions"),
                                       _get(c, "split", "test"), _get(c, "data_dir"),
                                       self.image_size)
            else:
                raise ValueError(f"retrieval evaluator: unknown dataset {kind!r}; "
                                 "use 'demo', 'karpathy' or 'tfds'")
            if _get(c, "name"):
                self._data.name = _get(c, "name")
        return self._data

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            spec = dict(_get(self.config, "tokenizer", None) or {})
            if not spec:
                raise ValueError("retrieval evaluator: config.tokenizer=dict(kind=..., path=...) "
                                 "is needed for this dataset")
            from input_pipeline.tokenizers import build_tokenizer
            self._tokenizer = build_tokenizer(spec.pop("kind"), spec.pop("path"),
                                              self.context_length, **spec)
        return self._tokenizer

    def encode(self, params: Any, data: RetrievalData
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(image mu [N, D], image logvar, text mu [M, D], text logvar), images in chunks."""
        mus, lvs = [], []
        for s in range(0, data.num_images, self.image_chunk):
            mu, lv = self.encoder.images(params, data.image_chunk(s, min(s + self.image_chunk,
                                                                         data.num_images)))
            mus.append(mu)
            lvs.append(lv)
        self.last_throughput["images"] = self.encoder.last_throughput
        tokens = data.text if data.text is not None else self.tokenizer()(data.captions)
        t_mu, t_lv = self.encoder.texts(params, tokens)
        self.last_throughput["texts"] = self.encoder.last_throughput
        return np.concatenate(mus), np.concatenate(lvs), t_mu, t_lv

    # ---- metrics ----------------------------------------------------------------------
    def _protocol(self, i_mu, i_lv, t_mu, t_lv, cap_img: np.ndarray, kind: str,
                  topk: int = 0) -> tuple[dict[str, float], Any]:
        """Metrics of one image set with its captions (cap_img: int [M] into the images)."""
        i2t_pos = pad_positives([np.flatnonzero(cap_img == i) for i in range(len(i_mu))])
        i2t, i2t_top = blocked_ranks(i_mu, i_lv, t_mu, t_lv, i2t_pos, kind, self.block, topk)
        t2i, t2i_top = blocked_ranks(t_mu, t_lv, i_mu, i_lv, cap_img[:, None], kind, self.block,
                                     topk)
        return ranking_metrics(i2t, t2i, self.ks), (i2t_top, t2i_top)

    def _eccv_ready(self, data: RetrievalData) -> Any:
        if not _get(self.config, "eccv", True) or data.image_ids is None or data.caption_ids is None:
            return None
        try:
            import eccv_caption
        except ImportError:
            return None
        metrics = eccv_caption.Metrics()
        if (set(data.caption_ids.tolist()) != set(metrics.coco_ids.tolist())
                or set(data.image_ids.tolist()) != set(metrics.coco_gts["i2t"])):
            log.warning("retrieval: ids are not COCO 5K test ids; ECCV/CxC metrics skipped")
            return None
        return metrics

    def run(self, params: Any) -> Iterator[tuple[str, float]]:
        data = self.data()
        i_mu, i_lv, t_mu, t_lv = self.encode(params, data)
        cap_img = np.asarray(data.caption_image, np.int64)
        is_coco = data.name == "coco"
        folds = int(_get(self.config, "num_folds", 5 if is_coco else 0))
        fold_size = int(_get(self.config, "fold_size", 1000))
        eccv = self._eccv_ready(data)
        topk = int(_get(self.config, "eccv_topk", 50)) if eccv is not None else 0
        for kind in self.scores:
            prefix = f"retrieval/{data.name}/{kind}"
            full, (i2t_top, t2i_top) = self._protocol(i_mu, i_lv, t_mu, t_lv, cap_img, kind, topk)
            full_prefix = f"{prefix}/5k" if is_coco else prefix
            yield from ((f"{full_prefix}/{k}", v) for k, v in full.items())
            if folds:   # COCO 1K: folds of `fold_size` consecutive images and their captions
                per_fold = []
                for f in range(folds):
                    lo, hi = f * fold_size, (f + 1) * fold_size
                    caps = np.flatnonzero((cap_img >= lo) & (cap_img < hi))
                    m, _ = self._protocol(i_mu[lo:hi], i_lv[lo:hi], t_mu[caps], t_lv[caps],
                                          cap_img[caps] - lo, kind)
                    per_fold.append(m)
                for k in per_fold[0]:
                    yield f"{prefix}/1k/{k}", float(np.mean([m[k] for m in per_fold]))
            if eccv is not None:
                yield from self._eccv(eccv, data, i2t_top, t2i_top, prefix)

    def _eccv(self, metrics: Any, data: RetrievalData, i2t_top: np.ndarray,
              t2i_top: np.ndarray, prefix: str) -> Iterator[tuple[str, float]]:
        """ECCV Caption and CxC metrics by eccv_caption on the top-k lists (REFERENCE §3.3)."""
        i2t = {int(data.image_ids[q]): data.caption_ids[row].tolist()
               for q, row in enumerate(i2t_top)}
        t2i = {int(data.caption_ids[q]): data.image_ids[row].tolist()
               for q, row in enumerate(t2i_top)}
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
