"""The modality gap of a paired image-caption set, and how spread each modality's Gaussians are.

Liang et al., "Mind the Gap: Understanding the Modality Gap in Multi-modal Contrastive
Representation Learning" (NeurIPS 2022, §4.1): image and text embeddings of a contrastive model
sit in two separate cones, and the gap is the distance between the two centroids of the
L2-normalised embeddings, ||mean_i v_i - mean_j t_j||. Beside it: the mean cosine of the
matched pairs and of random (mismatched) pairs, and for a probabilistic model the average sigma^2
of each modality: tr(Sigma) = sum_d sigma_d^2 per item, averaged over the items (the "avg
sigma_v^2 / sigma_t^2" columns of ProLIP's ablation, Chun et al., "Probabilistic Language-Image
Pre-Training", Table C.3: its untrained row, 0.035, is about 768 e^-10 = 0.0349, a trace).

The set and its encoding are declared once, for every evaluator of paired data:
`evaluators.retrieval.PairedSet` (demo, Karpathy COCO / Flickr30K, CUB, tfds, tar shards).

Metrics (plain numbers, not %): modality_gap/<name>/{gap, matched_cosine, mismatched_cosine},
and with log sigma^2 modality_gap/<name>/{image,text}_sigma2_trace_mean.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import numpy as np

from evaluators import retrieval
from evaluators.common import parse_config, uncertainty


@dataclasses.dataclass(frozen=True)
class Config(retrieval.PairedSet):
    """The modality-gap evaluator's knobs: config.evals.<name> with type="modality_gap" (the
    set and its encoding: PairedSet's fields)."""

    seed: int = 0  # which other image each caption is compared with for the mismatched cosine


class Evaluator:
    """`run(params)` yields ("modality_gap/<name>/<metric>", value); see the module docstring."""
    HEADLINE = (r"/gap$",)  # the metric the trainer's console line shows (a regex)

    def __init__(self, config: Any, model: Any, tokenizer: Any = None):
        self.config = c = parse_config(Config, config, "modality_gap")
        # The retrieval evaluator reads and encodes the set (the PairedSet fields are its own).
        paired = {f.name: getattr(c, f.name) for f in dataclasses.fields(retrieval.PairedSet)}
        self.retrieval = retrieval.Evaluator(paired, model, tokenizer)

    def run(self, params: Any, progress: Callable[[int], None] | None = None) -> Iterator[tuple[str, float]]:
        data = self.retrieval.data()
        i_mu, i_lv, t_mu, t_lv = self.retrieval.encode(params, data, progress)
        values = gap_metrics(i_mu, i_lv, t_mu, t_lv, np.asarray(data.caption_record), self.config.seed)
        for key, value in values.items():
            yield f"modality_gap/{data.name}/{key}", value


def gap_metrics(i_mu: np.ndarray, i_lv: np.ndarray | None, t_mu: np.ndarray, t_lv: np.ndarray | None,
                caption_image: np.ndarray, seed: int = 0) -> dict[str, float]:
    """The metrics of images [N, D] and captions [M, D] (caption_image int [M]: each caption's
    image), in float64. mu is L2-normalised by the model; normalised again so that the gap is
    that of unit vectors whatever the caller passes."""
    v = _unit(np.asarray(i_mu, np.float64))
    t = _unit(np.asarray(t_mu, np.float64))
    matched = np.sum(v[caption_image] * t, axis=1)
    # A random other image for every caption (a derangement where one exists).
    rng = np.random.default_rng(seed)
    other = (caption_image + rng.integers(1, max(len(v), 2), size=len(t))) % len(v)
    out = {"gap": float(np.linalg.norm(v.mean(0) - t.mean(0))),
           "matched_cosine": float(matched.mean()),
           "mismatched_cosine": float(np.sum(v[other] * t, axis=1).mean())}
    for side, lv in (("image", i_lv), ("text", t_lv)):
        if lv is not None:
            out[f"{side}_sigma2_trace_mean"] = float(uncertainty(lv).mean())
    return out


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
