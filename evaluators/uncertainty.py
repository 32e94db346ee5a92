"""Uncertainty analyses of a ProLIP model (paper §4.3, C.6; naver-ai/prolip src/analysis/eval_hcaps.py).

    ev = Evaluator(dict(dataset="demo", demo=dict(cache_dir=...)), model)   # model: ProLIP module
    arrays = ev.collect(params)          # per-item numpy arrays (plots)
    metrics = dict(ev.summarize(arrays)) # == dict(ev.run(params))

Per-item uncertainty is tr(Sigma) = sum_d sigma_d^2 = sum_d exp(log sigma_d^2): the paper's
sigma_v^2 / sigma_t^2 (§4.3, "tr(Sigma), namely sum_i sigma_i^2") and `common.uncertainty`,
named `sigma2_trace` in every metric (docs/metrics.md). The statistics (mean, median, std) are
taken over items of that sum. Every "_rate" is a share of items in % (0-100).

Metrics, yielded as "uncertainty/<name>/<metric>" (<name>: config `name`, default "demo"):
    image_sigma2_trace_{mean,median,std}, text_sigma2_trace_{mean,median,std}  (text: every
                                   caption, all levels)
    image_masked_sigma2_trace_mean, text_masked_sigma2_trace_mean
    image_below_text_rate          % with sigma_v^2 < sigma_t^2 of the paired caption (Fig. 5)
    text_sigma2_trace_length_spearman  Spearman(sigma_t^2, caption length in tokens != pad), Fig. 6
    inclusion_image_in_masked_rate, inclusion_text_in_masked_rate, inclusion_image_in_text_rate
                                   % with H(Z1 in Z2) > 0 (eq. 4, summed over D, eps = 0 as the
                                   reference's analysis code), Z1 = original / image
    with levels (caption hierarchies, level 0 most general .. K-1 most specific; Fig. 7, C.6):
    text_sigma2_trace_level{i}_mean
    order_adjacent_rate            eq. C.1: % of adjacent pairs with tr S^i > tr S^{i+1}
    order_monotone_rate            % of hierarchies strictly decreasing over all levels
    order_level{i}_gt_level{j}_rate  for i < j (Fig. C.4); level0_gt_level{K-1} is the headline

Masked inputs follow the training recipe (naver-ai/prolip src/prolip_train/train.py): images keep a random 75% of patches
(`image_keep_ratio` is a KEEP ratio, one subset per image), text tokens other than
`protected_ids` are replaced by `mask_token_id` with probability 0.75. Ties count as "not
ordered" / "not included" (strict inequalities, as eq. C.1).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator, Literal, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from evaluators.common import Encoder, parse_config, percent, uncertainty
from input_pipeline import eval_data
from input_pipeline.eval_data import EvalSet
from prolip_jax.core.objectives.distances import inclusion_test
from prolip_jax.core.models.prolip import ProLIP, mask_text_tokens, random_keep_indices

@dataclasses.dataclass(frozen=True)
class Config:
    """The uncertainty evaluator's knobs: config.evals.<name> with type="uncertainty"."""
    # dataset "demo": input_pipeline.demo, `demo` = kwargs of get_demo (cache_dir, DemoConfig
    # fields, as the zeroshot/retrieval evaluators), `split` ("levels": 4 caption levels);
    # dataset "npz": the file `path` with "image" [N, S, S, 3] (float32 normalised or uint8) and
    # "text" int tokens [N, L] or [N, K, L].
    dataset: Literal["demo", "npz"] = "demo"
    demo: dict = dataclasses.field(default_factory=dict)
    split: str = "levels"
    path: str = ""
    name: str | None = None          # in the metric names; None: "demo" or the npz file's stem
    levels: bool | None = None       # caption axis K is a hierarchy; None: True for the demo "levels" split
    pair_level: int = -1             # which caption an image is paired with for image-in-text (-1: most specific)
    image_size: int | None = None    # None: the model's vision.image_size
    context_length: int | None = None   # None: the model's text.context_length
    batch_size: int = 256            # items per batch, per host
    normalization: str = "openai"    # image normalisation of the encoder
    max_items: int = 0               # the first N items (0: all)
    num_threads: int = 8             # image reading threads per host
    image_keep_ratio: float = 0.75   # masked images keep this fraction of patches
    text_mask_prob: float = 0.75     # masked texts: each maskable token replaced with this probability
    # the [MASK] id of masked texts: the same id as the trainer's `masking.mask_token_id`, which
    # the checkpoint's tokenizer record carries; None: the tokenizer's recorded mask_id (the
    # demo's 2; the reference's 32000)
    mask_token_id: int | None = None
    protected_ids: tuple[int, ...] | None = None   # never masked; None: (pad_id, eos_id) of the
    #                                  tokenizer, else (1,) as the reference
    pad_id: int | None = None        # None: the tokenizer's pad_id, else 1 (SigLIP vocab: pad = eos = 1)
    inclusion_eps: float = 0.0       # eps of H(Z1 in Z2) (eq. 4)
    seed: int = 0                    # seeds the image keep subsets and the text masks

    def validate(self) -> None:
        if self.dataset == "npz" and not self.path:
            raise ValueError("uncertainty evaluator: dataset='npz' needs config.path")
        if not 0.0 < self.image_keep_ratio <= 1.0:
            raise ValueError(f"uncertainty evaluator: image_keep_ratio={self.image_keep_ratio} "
                             "is not in (0, 1]")


# ------------------------------------------------------------------------------ metrics
def rank_average(x: np.ndarray) -> np.ndarray:
    """Ranks 1..N of a 1-D array, ties sharing the average of their ranks (scipy 'average')."""
    x = np.asarray(x)
    order = np.argsort(x, kind="stable")
    sorted_x = x[order]
    # tie groups: [start, end) runs of equal values in sorted order
    starts = np.flatnonzero(np.r_[True, sorted_x[1:] != sorted_x[:-1]])
    ends = np.r_[starts[1:], len(x)]
    ranks = np.empty(len(x), np.float64)
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + 1 + e) / 2.0  # mean of ranks s+1 .. e
    return ranks


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rho = Pearson correlation of average ranks; nan when either side is constant."""
    rx, ry = rank_average(np.ravel(x)), rank_average(np.ravel(y))
    if len(rx) != len(ry):
        raise ValueError(f"spearman: {len(rx)} vs {len(ry)} values")
    if len(rx) < 2 or np.ptp(rx) == 0 or np.ptp(ry) == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def ordering_rates(level_unc: np.ndarray) -> dict[str, float]:
    """Hierarchy ordering of uncertainties [N, K] (level 0 most general; paper C.6), in %.

    order_adjacent_rate: eq. C.1 over every adjacent pair (i, i+1) of every hierarchy;
    order_monotone_rate: hierarchies with all K-1 adjacent pairs decreasing;
    order_level{i}_gt_level{j}_rate: tr S^i > tr S^j for i < j (Fig. C.4). Strict '>'.
    """
    u = np.asarray(level_unc, np.float64)
    if u.ndim != 2 or u.shape[1] < 2:
        raise ValueError(f"need uncertainties [N, K >= 2], got {u.shape}")
    dec = u[:, :-1] > u[:, 1:]
    out = {"order_adjacent_rate": percent(dec.mean()), "order_monotone_rate": percent(dec.all(1).mean())}
    k = u.shape[1]
    for i in range(k):
        for j in range(i + 1, k):
            out[f"order_level{i}_gt_level{j}_rate"] = percent(np.mean(u[:, i] > u[:, j]))
    return out


def inclusion_scores(mu1: np.ndarray, logvar1: np.ndarray, mu2: np.ndarray, logvar2: np.ndarray,
                     eps: float = 0.0) -> np.ndarray:
    """H(Z1 in Z2) summed over D for row-paired Gaussians [N, D] -> [N] (eq. 4; > 0: included)."""
    h = _summed_inclusion(jnp.asarray(mu1), jnp.asarray(logvar1), jnp.asarray(mu2),
                          jnp.asarray(logvar2), jnp.float32(eps))
    return np.asarray(h, np.float64)


@jax.jit
def _summed_inclusion(mu1, lv1, mu2, lv2, eps):
    return jnp.sum(inclusion_test(mu1, lv1, mu2, lv2, eps), -1)


def summarize(arrays: Mapping[str, np.ndarray], levels: bool) -> dict[str, float]:
    """Scalar metrics (see module docstring) from the arrays of `Evaluator.collect`."""
    out: dict[str, float] = {}
    img, txt = arrays["image_sigma2"], arrays["text_sigma2"]  # [N], [N, K]
    for name, v in (("image", img), ("text", txt.ravel())):
        out[f"{name}_sigma2_trace_mean"] = float(np.mean(v))
        out[f"{name}_sigma2_trace_median"] = float(np.median(v))
        out[f"{name}_sigma2_trace_std"] = float(np.std(v))
    out["image_masked_sigma2_trace_mean"] = float(np.mean(arrays["image_masked_sigma2"]))
    out["text_masked_sigma2_trace_mean"] = float(np.mean(arrays["text_masked_sigma2"]))
    out["image_below_text_rate"] = percent(np.mean(img < arrays["paired_text_sigma2"]))
    out["text_sigma2_trace_length_spearman"] = spearman(txt.ravel(), arrays["text_length"].ravel())
    out["inclusion_image_in_masked_rate"] = percent(np.mean(arrays["h_image_in_masked"] > 0))
    out["inclusion_text_in_masked_rate"] = percent(np.mean(arrays["h_text_in_masked"] > 0))
    out["inclusion_image_in_text_rate"] = percent(np.mean(arrays["h_image_in_text"] > 0))
    if levels:
        for i, m in enumerate(txt.mean(0)):
            out[f"text_sigma2_trace_level{i}_mean"] = float(m)
        out.update(ordering_rates(txt))
    return out


# ------------------------------------------------------------------------------ data
def load_data(cfg: Config, context_length: int
              ) -> tuple[EvalSet | np.ndarray, np.ndarray, Any, bool]:
    """-> images (an eval set read through the input pipeline, or an in-memory array [N, S, S, 3]),
    tokens int32 [N, K, L], tokenizer (or None), auto levels flag."""
    tokenizer = None
    if cfg.dataset == "demo":
        images = eval_data.demo(cfg.split, cfg.demo)
        tokenizer = images.info["tokenizer"](context_length)
        k = images.info["captions_per_record"]
        tokens = tokenizer(images.captions).reshape(len(images), k, -1)
        auto_levels = cfg.split == "levels"
    else:
        with np.load(cfg.path) as z:
            images, tokens = z["image"], z["text"]
        auto_levels = False
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim == 2:
        tokens = tokens[:, None]
    if tokens.ndim != 3 or len(tokens) != len(images):
        raise ValueError(f"text must be [N, L] or [N, K, L] with N = {len(images)} images, got {tokens.shape}")
    return images, tokens, tokenizer, auto_levels


# ------------------------------------------------------------------------------ evaluator
class Evaluator:
    """Uncertainty analyses; `config`: `Config` (knobs and defaults), metrics in the module doc.

    model: a `ProLIP` module (`prolip_jax.load(...).module` or the trainer's). tokenizer: only
    read for its `pad_id` / `eos_id` / `mask_id` when the config does not set them (the demo
    brings its own); the data are token ids already.
    """
    HEADLINE = (r"/image_below_text_rate$", r"/inclusion_image_in_masked_rate$", r"/order_adjacent_rate$")

    def __init__(self, config: Mapping[str, Any], model: ProLIP, tokenizer: Any = None):
        self.config = c = parse_config(Config, config, "uncertainty")
        self.model = model
        mc = model.config
        self.image_size = int(c.image_size or mc.vision.image_size)
        self.context_length = int(c.context_length or mc.text.context_length)
        # Captions are tokenised once (an analysis subset is small); images are read per run.
        self.images, self.tokens, data_tokenizer, auto_levels = load_data(c, self.context_length)
        tokenizer = tokenizer or data_tokenizer
        if c.max_items:
            self.tokens = self.tokens[:c.max_items]
            if isinstance(self.images, EvalSet):
                self.images.records.n = min(c.max_items, self.images.records.n)
            else:
                self.images = self.images[:c.max_items]
        self.levels = bool(auto_levels if c.levels is None else c.levels) and self.tokens.shape[1] > 1
        self.pad_id = _first(c.pad_id, getattr(tokenizer, "pad_id", None), 1)
        # None: the mask id the tokenizer records (the trainer's masking.mask_token_id)
        self.mask_id = _first(c.mask_token_id, getattr(tokenizer, "mask_id", None))
        if self.mask_id is None:
            raise ValueError("uncertainty evaluator: set mask_token_id (the tokenizer has no mask_id)")
        default_protected = tuple(sorted({getattr(tokenizer, a) for a in ("pad_id", "eos_id")
                                          if getattr(tokenizer, a, None) is not None})) or (1,)
        self.protected_ids = tuple(c.protected_ids or default_protected)
        self.name = c.name or ("demo" if c.dataset == "demo" else Path(c.path).stem)
        self.encoder = Encoder(model, c.batch_size, c.normalization)
        self.images_per_second = 0.0

    def _encode_images(self, params: Any, progress: Callable[[int], None] | None,
                       keep_idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(self.images, EvalSet):
            mu, lv = self.encoder.images(params, self.images, progress, keep_idx)
        else:
            batches = self.images.batches(self.encoder.batch_size * jax.process_count(),
                                          self.image_size, self.config.normalization,
                                          self.config.num_threads)
            out = self.encoder.dataset(params, batches, len(self.images), progress, keep_idx)
            mu, lv = out["mu"], out.get("logvar")
        if lv is None:
            raise ValueError("the uncertainty evaluator needs a probabilistic model "
                             "(log sigma^2); this one is deterministic (embed_unc=False)")
        return mu, lv

    def collect(self, params: Any, progress: Callable[[int], None] | None = None) -> dict[str, np.ndarray]:
        """Per-item arrays (N images, K captions each, D embedding dims):

        image_sigma2 [N], image_masked_sigma2 [N], text_sigma2 [N, K], text_masked_sigma2 [N, K]:
            tr(Sigma) = sum_d exp(log sigma_d^2);
        paired_text_sigma2 [N]: text_sigma2[:, pair_level];
        text_length [N, K] int: tokens != pad_id (pad = EOS = 1 in the SigLIP/demo vocab, so the
            EOS is not counted either);
        h_image_in_masked [N], h_text_in_masked [N, K], h_image_in_text [N]: H(Z1 in Z2) summed
            over D (eq. 4; > 0 means Z1 is included in Z2).
        `progress(k)` is called with the number of items encoded after each batch.
        """
        c = self.config
        n, k, length = self.tokens.shape
        flat = self.tokens.reshape(n * k, length)
        key_img, key_txt = jax.random.split(jax.random.key(c.seed))

        img_mu, img_lv = self._encode_images(params, progress)
        self.images_per_second = self.encoder.last_throughput
        txt_mu, txt_lv = self.encoder.texts(params, flat, progress)

        # Masked views (naver-ai/prolip src/prolip_train/train.py): a random keep subset per image, tokens replaced at p.
        keep = np.asarray(_keep_indices(key_img, self.model.config.vision.num_patches,
                                        c.image_keep_ratio, n))
        m_img_mu, m_img_lv = self._encode_images(params, progress, keep)
        masked_tokens = np.asarray(_mask_tokens(key_txt, flat, self.mask_id, c.text_mask_prob,
                                                self.protected_ids))
        m_txt_mu, m_txt_lv = self.encoder.texts(params, masked_tokens, progress)

        eps = c.inclusion_eps
        pair = np.arange(n) * k + (c.pair_level % k)  # row of each image's own caption in `flat`
        text_sigma2 = uncertainty(txt_lv).reshape(n, k)
        return {
            "image_sigma2": uncertainty(img_lv),
            "image_masked_sigma2": uncertainty(m_img_lv),
            "text_sigma2": text_sigma2,
            "text_masked_sigma2": uncertainty(m_txt_lv).reshape(n, k),
            "paired_text_sigma2": text_sigma2[:, c.pair_level % k],
            "text_length": (self.tokens != self.pad_id).sum(-1),
            "h_image_in_masked": inclusion_scores(img_mu, img_lv, m_img_mu, m_img_lv, eps),
            "h_text_in_masked": inclusion_scores(txt_mu, txt_lv, m_txt_mu, m_txt_lv, eps).reshape(n, k),
            "h_image_in_text": inclusion_scores(img_mu, img_lv, txt_mu[pair], txt_lv[pair], eps),
        }

    def summarize(self, arrays: Mapping[str, np.ndarray]) -> Iterator[tuple[str, float]]:
        for key, value in summarize(arrays, self.levels).items():
            yield f"uncertainty/{self.name}/{key}", value

    def run(self, params: Any, progress: Callable[[int], None] | None = None
            ) -> Iterator[tuple[str, float]]:
        """The metrics; the per-item arrays stay in `self.arrays` (scripts/evaluate.py plots them)."""
        self.arrays = self.collect(params, progress)
        yield from self.summarize(self.arrays)


# One compiled program each (op-by-op dispatch would compile every primitive separately).
_keep_indices = jax.jit(random_keep_indices, static_argnums=(1, 2, 3))
_mask_tokens = jax.jit(mask_text_tokens, static_argnums=(2, 3, 4))


def _first(*values: Any) -> Any:
    return next((v for v in values if v is not None), None)
