"""PCME++ ("Improved Probabilistic Image-Text Representations", Chun, §2; the authors' pcmepp/criterions/pcmepp.py and pcmepp/engine.py).

    logits  l_ij = -a d(Z_v_i, Z_t_j) + b            d = CSD (eq. 1) or a Table 4 ablation distance
    total   = 2 * mean_ij BCE(l, m~)                                           "match"    (eq. 2)
            + alpha * (mean BCE(l, m~_pp i2t) + mean BCE(l^T, m~^T_pp t2i))    "pseudo_match" (§2.3)
            + beta * (KL_v + KL_t)                                             "vib"
            + infonce_weight * CLIP InfoNCE                                    "infonce" (App. C.6)

This is the code's reduction, not the paper's notation: the match BCE is a mean over all N x M
pairs multiplied by 2 (the i2t and t2i losses of one symmetric matrix are equal, the code's
"pcme issue #3" shortcut), each PP BCE is a plain mean over N x M, and the two directions are
added, not averaged.

- Targets m (None = identity; binary multi-positive; MSDA soft labels) are label-smoothed as
  engine.py does, m~ = (1 - s) m + s (1 - m), s = `label_smoothing` (code default 1e-4; for
  MSDA targets the code smooths the one-hots before mixing, which gives the same m~).
- Pseudo-positives, row-wise as the code (`logits >= gt_vals.unsqueeze(1)`, not the paper's
  Fig. A.2 which omits the unsqueeze): in row i, the GT column is argmax_j m~_ij (the first on
  ties) and every j with l_ij >= l_i,GT (d <= d_GT for a > 0, the GT itself included) gets the
  row's GT label max_j m~_ij. t2i repeats this on the transposed matrices (the code calls its
  loss with the towers swapped; for the symmetric CSD / W2 that is the transposed logits, for
  the other distances we keep d(v, t) so that each pair has one match logit).
- VIB: KL(N(mu, sigma^2) || N(0, I)) = -1/2 mean(1 + log sigma^2 - mu^2 - sigma^2) over B x D per
  tower, a tower's term dropped (0) when it exceeds `vib_threshold` (code: 10000) — the
  `prolip.vib_loss(form="kl")` of ProLIP's objective. Only towers with a logvar contribute.
- a, b: a = out["logit_scale"], b = out["logit_bias"]. PCME++'s a (`negative_scale`) is an
  unconstrained parameter initialised at 5 (COCO) or 1 (large scale); ours is stored as log a
  and exponentiated, so a > 0 always and PCME++'s init a = 5 is log a = log 5 (b = 5 as is).
- mu-only (logvar None): CSD is ||mu_v - mu_t||^2 and VIB is skipped: the "PCME++ (mu only)"
  baseline of Table 1 with `pp_alpha=0, vib_beta=0, label_smoothing=0` (the released
  configs/others/pcmepp_mu_only.yaml has no PP or smoothing; it names the PCME criterion with
  `prob_distance: energy_distance_closed_form`, which that criterion's code rejects, so the
  intended mu-only loss is this one). 'wasserstein' also works mu-only; the other distances
  need both log-variances.
- Large-scale mode (App. C.6, alpha = 0, beta = 1e-6 there): `infonce_weight` adds CLIP's
  symmetric InfoNCE on the means with the raw targets. Its inverse temperature is
  out["infonce_scale"] when the model has a separate learnable one (openclip's logit_scale
  beside PCME++'s a, as the authors' openclip-based run); otherwise out["logit_scale"], i.e.
  shared with a.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from prolip_jax.core.objectives import contrastive, distances, prolip

NEEDS_LOGVAR = False
USES_MASKED = False
SOFT_TARGETS = True

MU_ONLY_DISTANCES = ("csd", "wasserstein")


@dataclasses.dataclass(frozen=True)
class Config:
    """Defaults: the paper's COCO setting (PCME++ §3.1, App. B.2) and the code's smoothing."""

    # Table 4: "kl" is KL(image || text); the closed forms are in distances.py.
    distance: Literal["csd", "kl", "wasserstein", "elk", "bhattacharyya"] = "csd"
    pp_alpha: float = 0.1  # alpha, pseudo-positive weight (0.01 / 0 under 20 / 50 % noise)
    vib_beta: float = 1e-4  # beta (1e-6 for the large-scale run)
    label_smoothing: float = 1e-4  # engine.py / configs/pcmepp.yaml `label_smoothing`
    vib_threshold: float = 1e4  # a tower's KL above this is dropped for the step (code's guard)
    infonce_weight: float = 0.0  # App. C.6: CLIP InfoNCE added to PCME++ for large-scale training

    def validate(self) -> None:
        for name in ("pp_alpha", "vib_beta", "infonce_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"config.loss.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"config.loss.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.vib_threshold <= 0:
            raise ValueError(f"config.loss.vib_threshold must be > 0, got {self.vib_threshold}")


def bce_mean(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """torch BCEWithLogitsLoss (mean): mean of softplus(l) - m l = -m log s(l) - (1 - m) log s(-l)."""
    return jnp.mean(jax.nn.softplus(logits) - targets * logits)


def smooth_targets(targets: jax.Array, smoothing: float) -> jax.Array:
    """(1 - s) m + s (1 - m): 1 -> 1 - s, 0 -> s (pcmepp/engine.py)."""
    return (1.0 - smoothing) * targets + smoothing * (1.0 - targets)


def pseudo_positive_targets(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Row-wise PP relabelling of `_recompute_matched` (PCME++ §2.3): every entry of row i whose
    logit is >= the logit of row i's GT column gets row i's GT label."""
    gt_idx = jnp.argmax(targets, axis=1)
    gt_label = jnp.max(targets, axis=1, keepdims=True)
    gt_logit = jnp.take_along_axis(logits, gt_idx[:, None], axis=1)
    return jnp.where(logits >= gt_logit, gt_label, targets)


def loss(out, cfg: Config, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None):
    im, il, tm, tl = out["image_mean"], out.get("image_logvar"), out["text_mean"], out.get("text_logvar")
    if (il is None or tl is None) and cfg.distance not in MU_ONLY_DISTANCES:
        raise ValueError(f"config.loss.distance={cfg.distance!r} needs image and text log-variances; "
                         f"a mu-only model can use {MU_ONLY_DISTANCES}")
    d = distances.pairwise(cfg.distance, im, il, tm, tl)
    logits = -out["logit_scale"] * d + out["logit_bias"]
    raw = jnp.eye(*logits.shape, dtype=logits.dtype) if targets is None else jnp.asarray(targets, logits.dtype)
    m = smooth_targets(raw, cfg.label_smoothing)

    terms = {"match": 2.0 * bce_mean(logits, m)}
    if cfg.pp_alpha > 0:
        i2t = bce_mean(logits, pseudo_positive_targets(logits, m))
        t2i = bce_mean(logits.T, pseudo_positive_targets(logits.T, m.T))
        terms["pseudo_match"] = cfg.pp_alpha * (i2t + t2i)
    if cfg.vib_beta > 0 and (il is not None or tl is not None):
        vib = sum(prolip.vib_loss(mu, lv, "kl", cfg.vib_threshold) for mu, lv in ((im, il), (tm, tl))
                  if lv is not None)
        terms["vib"] = cfg.vib_beta * vib
    if cfg.infonce_weight > 0:
        scale = out.get("infonce_scale", out["logit_scale"])
        terms["infonce"] = cfg.infonce_weight * contrastive.info_nce(im, tm, scale, targets)
    return sum(terms.values()), terms
