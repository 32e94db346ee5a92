"""HierarCaps image traversal (paper §4.4, Table 2, Fig. 9, B.4; naver-ai/prolip src/analysis/eval_hcaps.py).

For every image (one per row of the HierarCaps test CSV; 4 caption levels each, level 0 the most
general), as the reference's `src/analysis/eval_hcaps.py` does:
  1. start  = the nearest caption of the image among all 4N captions (mu . mu; `score`);
  2. [ROOT] = "null":           the embedding of the empty text "" (Alper & Averbuch-Elor 2024,
                                the deterministic protocol, Table 2 rows without "Prob?");
              "inclusion":      the caption that most includes the image: argmax over the 4N
                                captions of inc(Z_image -> Z_caption) summed over D (eq. 3, eps = 0,
                                the reference's one-sided `inclusion_test_batchwise`; `inclusion=
                                "h"` uses H of eq. 4 instead);
              "inclusion+null": normalise(mu_inclusion + mu_null), the "average of "" and the
                                most inclusive text" of §4.4 (Table 2 "Prob?" rows);
  3. traversal: 50 (`steps`) queries q_i = normalise(start - i (start - root) / steps),
     i = 0 .. steps-1 (from the start towards the root, the root itself excluded, exactly the
     reference's schedule), each retrieving its nearest caption among all 4N;
  4. per image, with P = the set of distinct retrieved caption texts and G = its 4 GT texts:
        precision = |P & G| / |P|                (the reference's tp / max(1, tp + fp))
        recall    = mean over levels l of [G_l in P]          (Alper & Averbuch-Elor's recall)
        R@1       = [P & G non-empty]            (the reference's third number, `any_recalls`)
        R@1_root  = R@1 of the root alone (P = {nearest caption of the root}): Table 2's
                    R@1^[ROOT]; the "null" root retrieves one caption for every image (~0.1).
     All averaged over the images, in %. Texts are compared as strings (identical captions of
     different rows count as the same, as the reference's sets of strings).
Table 2 reports Prec, R@1, R@1^[ROOT]; which of the reference's two recalls its "R@1" column is
cannot be read from the paper, so both are yielded (`R@1` and `recall`).

Config: `Config` (dataset "hierarcaps": csv + image_dir; "demo": the demo's "levels" split;
roots, steps, score, inclusion, encoding knobs).
Metrics: hierarcaps/<name>/<root>/{precision, recall, R@1, R@1_root, level{0..3}_recall,
    num_predictions} (<root>: null, inclusion, inclusion_null), and for a probabilistic model
    hierarcaps/<name>/text_sigma2_trace_level{i}_mean (mean tr(Sigma)) and the ordering rates (%)
    of paper C.6 / Fig. 7 (order_adjacent_rate = eq. C.1, order_level{i}_gt_level{j}_rate), see
    evaluators.uncertainty.ordering_rates. Precision, recall, R@1 and the rates are in %.
`arrays` after a run: start [N] and, per root, root_<root> [N] (caption index, -1 = "")
and traversal_<root> [N, steps] (caption indices; `captions` holds the texts).
"""
from __future__ import annotations

import csv
import dataclasses
import functools
import os
import re
from typing import Any, Callable, Iterator, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from evaluators.common import Encoder, parse_config, tokenizer_from, uncertainty
from evaluators.uncertainty import ordering_rates
from input_pipeline import eval_data
from input_pipeline.eval_data import EvalSet, Files, Records
from prolip_jax.core.objectives.distances import inclusion_test, log_inclusion

ROOTS = ("null", "inclusion", "inclusion+null")
LEVELS = 4   # caption levels per HierarCaps row, general -> specific


@dataclasses.dataclass(frozen=True)
class Config:
    """The HierarCaps evaluator's knobs: config.evals.<name> with type="hierarcaps"."""
    # "hierarcaps": the test CSV + COCO val images; "demo": the demo's "levels" split (4 levels)
    dataset: Literal["hierarcaps", "demo"] = "hierarcaps"
    csv: str = ""                    # hierarcaps: hierarcaps_test.csv (github.com/TAU-VAILab/hierarcaps)
    image_dir: str = ""              # hierarcaps: COCO val2014 (or val2017) images
    demo: dict = dataclasses.field(default_factory=dict)  # demo: kwargs of input_pipeline.demo.get_demo
    name: str | None = None          # in the metric names; None: the data set's ("hierarcaps", "demo")
    # which [ROOT]s; None: ("null", "inclusion+null") for a probabilistic model, ("null",) else
    roots: tuple[Literal["null", "inclusion", "inclusion+null"], ...] | None = None
    steps: int = 50                  # interpolation steps from the start towards the root
    # "csd": rank captions by q . mu_t - tr(Sigma_t) / 2 (the -CSD ranking for a query without
    # variance); the reference uses "dot"
    score: Literal["dot", "csd"] = "dot"
    inclusion: Literal["one_sided", "h"] = "one_sided"   # eq. 3 one-sided inclusion or H of eq. 4
    max_items: int = 0               # the first N rows (0: all)
    batch_size: int = 256            # images per batch, per host
    image_size: int | None = None    # None: the model's vision.image_size
    normalization: str = "openai"    # image normalisation of the encoder
    num_threads: int = 8             # image reading threads per host
    tokenizer: dict = dataclasses.field(default_factory=dict)  # kwargs of build_tokenizer (kind,
    #                                  path, ...), when no tokenizer is passed in (not for demo)

    def validate(self) -> None:
        if self.dataset == "hierarcaps":
            for key in ("csv", "image_dir"):
                if not getattr(self, key):
                    raise ValueError(f"hierarcaps evaluator: dataset='hierarcaps' needs {key!r} "
                                     "(hierarcaps_test.csv and the COCO val image folder)")


# ------------------------------------------------------------------------------ pure functions
def _normalize(x: jax.Array) -> jax.Array:
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def _blocks(n: int, per_row: int, budget: int = 1 << 24) -> int:
    """Rows per device block so that a [rows, per_row] intermediate stays under `budget`."""
    return int(max(1, min(n, budget // max(per_row, 1))))


def _map_blocks(fn: Callable, n: int, block: int, *row_args: np.ndarray) -> np.ndarray:
    """fn over row blocks of the row_args (the last block padded: one compiled shape)."""
    out = []
    for s in range(0, n, block):
        parts = [a[s:s + block] for a in row_args]
        k = len(parts[0])
        parts = [np.concatenate([p, np.repeat(p[-1:], block - k, 0)]) if k < block else p
                 for p in parts]
        out.append(np.asarray(fn(*parts))[:k])
    return np.concatenate(out) if out else np.zeros((0,), np.int64)


def caption_bias(text_logvar: np.ndarray | None, score: str) -> np.ndarray | None:
    """Per-caption score offset: None for "dot", -tr(Sigma_t)/2 for "csd"."""
    if score == "dot" or text_logvar is None:
        if score not in ("dot", "csd"):
            raise ValueError(f"unknown score {score!r}; use 'dot' or 'csd'")
        return None
    if score != "csd":
        raise ValueError(f"unknown score {score!r}; use 'dot' or 'csd'")
    return (-0.5 * uncertainty(text_logvar)).astype(np.float32)


@jax.jit
def _nearest(q: jax.Array, t_mu: jax.Array, bias: jax.Array) -> jax.Array:
    return jnp.argmax(q @ t_mu.T + bias, axis=-1)   # first index among ties


def nearest_caption(query_mu: np.ndarray, text_mu: np.ndarray, bias: np.ndarray | None = None
                    ) -> np.ndarray:
    """int [Q]: the caption with the highest q . mu_t (+ bias) for each query [Q, D]."""
    b = jnp.zeros(len(text_mu), jnp.float32) if bias is None else jnp.asarray(bias)
    t = jnp.asarray(text_mu, jnp.float32)
    return _map_blocks(lambda q: _nearest(q, t, b), len(query_mu),
                       _blocks(len(query_mu), len(text_mu)), np.asarray(query_mu, np.float32))


@functools.partial(jax.jit, static_argnames="kind")
def _most_inclusive(mu: jax.Array, lv: jax.Array, t_mu: jax.Array, t_lv: jax.Array, kind: str
                    ) -> jax.Array:
    f = log_inclusion if kind == "one_sided" else inclusion_test
    h = jnp.sum(f(mu[:, None], lv[:, None], t_mu[None], t_lv[None]), -1)   # [b, M]
    return jnp.argmax(h, axis=-1)


def inclusion_root(image_mu: np.ndarray, image_logvar: np.ndarray, text_mu: np.ndarray,
                   text_logvar: np.ndarray, kind: str = "one_sided") -> np.ndarray:
    """int [N]: for each image the caption that includes it most (paper §4.4).

    kind "one_sided": inc(Z_img -> Z_txt) of eq. 3 summed over D, eps = 0 (the reference's
    `inclusion_test_batchwise` in eval_hcaps.py); "h": H(Z_img in Z_txt) of eq. 4."""
    if kind not in ("one_sided", "h"):
        raise ValueError(f"unknown inclusion {kind!r}; use 'one_sided' or 'h'")
    t_mu, t_lv = jnp.asarray(text_mu, jnp.float32), jnp.asarray(text_logvar, jnp.float32)
    n, (m, d) = len(image_mu), text_mu.shape
    return _map_blocks(lambda mu, lv: _most_inclusive(mu, lv, t_mu, t_lv, kind), n,
                       _blocks(n, m * d), np.asarray(image_mu, np.float32),
                       np.asarray(image_logvar, np.float32))


def make_root(kind: str, null_mu: np.ndarray | None, inclusive_mu: np.ndarray | None, n: int
              ) -> np.ndarray:
    """[N, D] root embeddings: "" (null), the most inclusive caption, or their normalised sum
    (the reference's `root = normalise(sum([t_root, null]))`)."""
    if kind == "null":
        return np.repeat(np.asarray(null_mu, np.float32)[None], n, 0)
    if kind == "inclusion":
        r = np.asarray(inclusive_mu, np.float64)
    elif kind == "inclusion+null":
        r = np.asarray(inclusive_mu, np.float64) + np.asarray(null_mu, np.float64)[None]
    else:
        raise ValueError(f"unknown root {kind!r}; known: {ROOTS}")
    return (r / np.maximum(np.linalg.norm(r, axis=-1, keepdims=True), 1e-12)).astype(np.float32)


@functools.partial(jax.jit, static_argnames="steps")
def _traverse(start: jax.Array, root: jax.Array, t_mu: jax.Array, bias: jax.Array, steps: int
              ) -> jax.Array:
    frac = jnp.arange(steps, dtype=jnp.float32)[None, :, None] / steps        # i / steps
    q = _normalize(start[:, None] - frac * (start - root)[:, None])           # [b, S, D]
    return jnp.argmax(q @ t_mu.T + bias, axis=-1)                              # [b, S]


def traverse(start_mu: np.ndarray, root_mu: np.ndarray, text_mu: np.ndarray, steps: int = 50,
             bias: np.ndarray | None = None) -> np.ndarray:
    """int [N, steps]: the nearest caption of each interpolated query (see module doc, 3)."""
    b = jnp.zeros(len(text_mu), jnp.float32) if bias is None else jnp.asarray(bias)
    t = jnp.asarray(text_mu, jnp.float32)
    n = len(start_mu)
    return _map_blocks(lambda s, r: _traverse(s, r, t, b, steps), n,
                       _blocks(n, steps * len(text_mu)), np.asarray(start_mu, np.float32),
                       np.asarray(root_mu, np.float32))


def traversal_metrics(preds: np.ndarray, text_ids: np.ndarray, gt_ids: np.ndarray
                      ) -> dict[str, np.ndarray]:
    """Per-image scores of retrieved captions (module doc, 4).

    preds int [N, S] caption indices; text_ids int [M]: the text identity of each caption (equal
    strings share an id); gt_ids int [N, L]: the text ids of each image's L levels.
    -> {"precision", "recall", "R@1", "num_predictions"} [N], "level_recall" [N, L] (in [0, 1])."""
    n, levels = gt_ids.shape
    out = {k: np.zeros(n) for k in ("precision", "recall", "R@1", "num_predictions")}
    out["level_recall"] = np.zeros((n, levels))
    for i in range(n):
        p = set(np.asarray(text_ids)[preds[i]].tolist())
        g = gt_ids[i].tolist()
        tp = len(p & set(g))
        out["precision"][i] = tp / max(1, len(p))
        out["level_recall"][i] = [x in p for x in g]
        out["recall"][i] = out["level_recall"][i].mean()
        out["R@1"][i] = float(tp > 0)
        out["num_predictions"][i] = len(p)
    return out


def text_ids(captions: list[str]) -> np.ndarray:
    """int [M]: equal caption strings share an id (the reference compares strings)."""
    return np.unique(np.asarray(captions, dtype=object).astype(str), return_inverse=True)[1].ravel()


# ------------------------------------------------------------------------------ data
def read_hierarcaps(csv_path: str, image_dir: str, limit: int = 0) -> EvalSet:
    """The HierarCaps test set (Alper & Averbuch-Elor 2024; github.com/TAU-VAILab/hierarcaps,
    data/hierarcaps_test.csv): a CSV with header `id,captions,image_url`, `captions` the four
    levels general -> specific joined by "=>" (level 3 is the original COCO caption), and
    `image_url` a COCO val2014 URL (.../COCO_val2014_000000301718.jpg).

    Images are found in `image_dir` by the URL's file name (COCO_val2014_*.jpg, as the ProLIP
    reference), else by the COCO 2017 name <id:012d>.jpg (the same val images). One record per
    CSV row (a COCO image may appear in several rows, as in the reference's evaluation).
    captions: 4 per record, level-major within a record; info: levels=4, ids, image_ids.
    """
    if not os.path.isfile(csv_path):
        raise FileNotFoundError(f"HierarCaps CSV {csv_path!r} does not exist (hierarcaps_test.csv "
                                "from github.com/TAU-VAILab/hierarcaps, data/)")
    if not os.path.isdir(image_dir):
        raise FileNotFoundError(f"HierarCaps image_dir {image_dir!r} does not exist (COCO val2014 "
                                "or val2017 images)")
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"captions", "image_url"} <= set(rows[0]):
        raise ValueError(f"{csv_path}: expected a CSV with columns id,captions,image_url")
    if limit:
        rows = rows[:limit]
    paths, captions, ids, image_ids, missing = [], [], [], [], []
    for n, row in enumerate(rows):
        levels = [c.strip() for c in row["captions"].split("=>")]
        if len(levels) != LEVELS or not all(levels):
            raise ValueError(f"{csv_path} row {n}: {len(levels)} caption levels, expected "
                             f"{LEVELS} non-empty ones joined by '=>'")
        name = row["image_url"].rstrip("/").split("/")[-1]
        match = re.search(r"(\d+)\.\w+$", name)
        image_id = int(match.group(1)) if match else -1
        path = next((p for p in (os.path.join(image_dir, name),
                                 os.path.join(image_dir, f"{image_id:012d}.jpg"))
                     if os.path.isfile(p)), None)
        if path is None:
            missing.append(name)
        paths.append(path)
        captions += levels
        ids.append(row.get("id", str(n)))
        image_ids.append(image_id)
    if missing:
        raise FileNotFoundError(f"HierarCaps: {len(missing)} of {len(rows)} images not in "
                                f"{image_dir!r} (e.g. {missing[0]}; also tried <id:012d>.jpg)")
    info = {"levels": LEVELS, "ids": ids, "image_ids": np.asarray(image_ids, np.int64),
            "captions_per_record": LEVELS}
    return EvalSet("hierarcaps", Records(len(paths), Files(paths)), captions,
                   np.repeat(np.arange(len(paths)), LEVELS), info)


def load_data(cfg: Config) -> EvalSet:
    if cfg.dataset == "hierarcaps":
        return read_hierarcaps(cfg.csv, cfg.image_dir, cfg.max_items)
    data = eval_data.demo("levels", cfg.demo)
    if data.info["captions_per_record"] != LEVELS:
        raise ValueError(f"demo levels split has {data.info['captions_per_record']} captions")
    if cfg.max_items:
        data.records.n = min(cfg.max_items, data.records.n)
        keep = data.caption_record < data.records.n
        data.captions = [c for c, k in zip(data.captions, keep) if k]
        data.caption_record = data.caption_record[keep]
    return data


# ------------------------------------------------------------------------------ evaluator
class Evaluator:
    """HierarCaps traversal; config keys and metrics in the module docstring."""
    HEADLINE = (r"/precision$", r"/R@1$")  # the metrics the trainer's console line shows (regexes)

    def __init__(self, config: Mapping[str, Any], model: Any, tokenizer: Any = None):
        self.config = c = parse_config(Config, config, "hierarcaps")
        self.model = model
        self.image_size = int(c.image_size or model.config.vision.image_size)
        context = model.config.text.context_length
        self.data = load_data(c)
        self.name = c.name or self.data.name
        make = self.data.info.get("tokenizer")
        self.tokenizer = tokenizer or (make(context) if make else
                                       tokenizer_from(c.tokenizer, context, "hierarcaps evaluator"))
        self.encoder = Encoder(model, c.batch_size, c.normalization)
        self.arrays: dict[str, np.ndarray] = {}

    def encode(self, params: Any, progress: Callable[[int], None] | None = None
               ) -> dict[str, np.ndarray | None]:
        batches = self.data.batches(self.encoder.batch_size * jax.process_count(), self.image_size,
                                    self.encoder.normalization, self.config.num_threads)
        img = self.encoder.dataset(params, batches, len(self.data), progress)
        t_mu, t_lv = self.encoder.texts(params, self.tokenizer(self.data.captions), progress)
        null_mu, _ = self.encoder.texts(params, self.tokenizer([""]))
        return {"image_mu": img["mu"], "image_logvar": img.get("logvar"), "text_mu": t_mu,
                "text_logvar": t_lv, "null_mu": null_mu[0]}

    def run(self, params: Any, progress: Callable[[int], None] | None = None
            ) -> Iterator[tuple[str, float]]:
        enc = self.encode(params, progress)
        yield from self.evaluate(enc)

    def evaluate(self, enc: Mapping[str, np.ndarray | None]) -> Iterator[tuple[str, float]]:
        """Metrics from encodings {image_mu [N, D], image_logvar, text_mu [N*4, D] (record-major,
        level 0 first), text_logvar, null_mu [D]} (log sigma^2 None: deterministic)."""
        c = self.config
        probabilistic = enc["image_logvar"] is not None and enc["text_logvar"] is not None
        roots = c.roots or (("null", "inclusion+null") if probabilistic else ("null",))
        if not probabilistic and any(r != "null" for r in roots):
            raise ValueError("hierarcaps evaluator: inclusion roots need a probabilistic model "
                             "(log sigma^2); this one is deterministic: use roots=('null',)")
        n = len(enc["image_mu"])
        t_mu = np.asarray(enc["text_mu"], np.float32)
        ids = text_ids(self.data.captions)
        gts = ids.reshape(n, LEVELS)
        bias = caption_bias(enc["text_logvar"], c.score)
        start = nearest_caption(enc["image_mu"], t_mu, bias)
        self.arrays = {"start": start}
        inclusive = None
        if any(r != "null" for r in roots):
            inclusive = inclusion_root(enc["image_mu"], enc["image_logvar"], t_mu,
                                       enc["text_logvar"], c.inclusion)
        pre = f"hierarcaps/{self.name}"
        for kind in roots:
            root = make_root(kind, enc["null_mu"], None if inclusive is None else t_mu[inclusive], n)
            preds = traverse(t_mu[start], root, t_mu, c.steps, bias)
            m = traversal_metrics(preds, ids, gts)
            root_hit = traversal_metrics(nearest_caption(root, t_mu, bias)[:, None], ids, gts)
            label = kind.replace("+", "_")
            self.arrays[f"traversal_{label}"] = preds
            self.arrays[f"root_{label}"] = (np.full(n, -1) if kind == "null" else inclusive)
            for key in ("precision", "recall", "R@1"):
                yield f"{pre}/{label}/{key}", 100.0 * float(m[key].mean())
            yield f"{pre}/{label}/R@1_root", 100.0 * float(root_hit["R@1"].mean())
            for lvl, v in enumerate(m["level_recall"].mean(0)):
                yield f"{pre}/{label}/level{lvl}_recall", 100.0 * float(v)
            yield f"{pre}/{label}/num_predictions", float(m["num_predictions"].mean())
        if probabilistic:   # Fig. 7 / C.6 on HierarCaps: sigma_t^2 by level and its ordering
            s2 = uncertainty(enc["text_logvar"]).reshape(n, LEVELS)
            for lvl, v in enumerate(s2.mean(0)):
                yield f"{pre}/text_sigma2_trace_level{lvl}_mean", float(v)
            for k, v in ordering_rates(s2).items():
                yield f"{pre}/{k}", v
