"""Pishdad et al., probabilistic VSE (Pishdad et al. §3.2, §4.2 and appendix 6.1).

VSE++'s hinge triplet loss with hardest in-batch negatives, unchanged, on a similarity between
the image and caption Gaussians (Pishdad et al. eq. 3):

    L = sum over positive pairs (i, c) of  max_c' [m + s(i, c') - s(i, c)]_+ + max_i' [m + s(i', c) - s(i, c)]_+

`similarity`:
  "kl"           -KL(N_image || N_caption), "w.r.t. the caption distribution" (eq. 4-5)
  "kl_reverse"   -KL(N_caption || N_image) (their Table 6)
  "min_kl"       -min of the two (eq. 6)
  "wasserstein"  -W2, not squared (eq. 7). For diagonal covariances the trace term is
                 ||sigma_i - sigma_c||^2 with standard deviations; the printed eq. 8 has
                 variances, which is not the closed form of eq. 7, so we follow eq. 7.

Variances (§4.2): the network predicts log-variances and every variance is bounded to
[`variance_min`, `variance_max`] = [0.1, 10] "following [Vilnis & McCallum]", who clip; the paper
does not say how. `variance_bound="clip"` clips log sigma^2 to [log 0.1, log 10] (no gradient
outside); "tanh" squashes it smoothly, mid + half tanh((lv - mid) / half) on the log scale
(slope 1 at the centre), for a head that should keep its gradient.

`covariance` (§4.2): "ellipsoidal" (diagonal, D variances); "spherical_avgpool" (the mean of
the D bounded variances, one isotropic variance per instance: "learn an ellipsoidal
distribution and take the average of the variances"); "spherical_one" ("learn a single
constant"): one log-variance per instance, the mean of the head's D log-variances, bounded.
For a linear last layer that mean is itself a 1-output linear head, so this is a learnt single
value without a new head; a [B, 1] logvar gives the same.

Several positives per row (binary targets): every positive pair is a term and the other
positives are excluded from its negatives. Summed, not averaged, as VSE++.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

from prolip_jax.core.objectives import contrastive, distances

NEEDS_LOGVAR = True
USES_MASKED = False
SOFT_TARGETS = False
USES_STEP = True  # sum_warmup_steps

_DIST = {"kl": distances.kl, "kl_reverse": distances.kl_reverse, "min_kl": distances.min_kl}


@dataclasses.dataclass(frozen=True)
class Config:
    """Defaults: the paper's best COCO VSE++ setting (W2, ellipsoidal, margin 0.2; VSRN: 0.1)."""

    similarity: Literal["kl", "kl_reverse", "min_kl", "wasserstein"] = "wasserstein"
    covariance: Literal["ellipsoidal", "spherical_avgpool", "spherical_one"] = "ellipsoidal"
    margin: float = 0.2
    variance_min: float = 0.1
    variance_max: float = 10.0
    variance_bound: Literal["clip", "tanh"] = "clip"
    # True: the hardest negative (Pishdad et al. eq. 3). False: the sum over negatives (VSE0), the
    # warm-up that VSE∞ uses before switching; from random towers the hardest negative alone
    # collapses (benchmarks/methods_synthetic.py).
    max_violation: bool = True
    # VSE∞'s warm-up on the authors' VSE++ / VSRN code bases: the sum over negatives for the
    # first N steps, then max_violation's choice (contrastive.scheduled_triplet). 0: none.
    sum_warmup_steps: int = 0

    def validate(self) -> None:
        if self.margin < 0:
            raise ValueError(f"config.loss.margin must be >= 0, got {self.margin}")
        if self.sum_warmup_steps < 0:
            raise ValueError(f"config.loss.sum_warmup_steps must be >= 0, got {self.sum_warmup_steps}")
        if not 0 < self.variance_min < self.variance_max:
            raise ValueError(f"config.loss.variance_min must be in (0, variance_max={self.variance_max}), "
                             f"got {self.variance_min}")


def shaped_logvar(logvar: jax.Array, cfg: Config) -> jax.Array:
    """The bounded log-variances of `cfg.covariance`, broadcast back to logvar's [B, D]."""
    lo, hi = math.log(cfg.variance_min), math.log(cfg.variance_max)
    lv = jnp.mean(logvar, -1, keepdims=True) if cfg.covariance == "spherical_one" else logvar
    if cfg.variance_bound == "clip":
        lv = jnp.clip(lv, lo, hi)
    else:
        mid, half = (hi + lo) / 2, (hi - lo) / 2
        lv = mid + half * jnp.tanh((lv - mid) / half)
    if cfg.covariance == "spherical_avgpool":
        lv = jax.nn.logsumexp(lv, -1, keepdims=True) - math.log(lv.shape[-1])  # log mean sigma^2
    return jnp.broadcast_to(lv, logvar.shape)


def similarity(im, il, tm, tl, cfg: Config) -> jax.Array:
    """[N_img, M_txt] sim(image i, caption j) after bounding and shaping the covariances."""
    il, tl = shaped_logvar(il, cfg), shaped_logvar(tl, cfg)
    if cfg.similarity == "wasserstein":
        # sqrt'(0) is infinite; 1e-12 only guards rounding below 0, far under float32's resolution of W2^2.
        return -jnp.sqrt(jnp.maximum(distances.wasserstein(im, il, tm, tl), 1e-12))
    return -_DIST[cfg.similarity](im, il, tm, tl)


def loss(out, cfg: Config, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None, step=None):
    im, il, tm, tl = out["image_mean"], out.get("image_logvar"), out["text_mean"], out.get("text_logvar")
    if il is None or tl is None:
        raise ValueError("objective 'pishdad' needs image and text log-variances (a probabilistic head)")
    positive = None if targets is None else jnp.asarray(targets) > 0
    value = contrastive.scheduled_triplet(similarity(im, il, tm, tl, cfg), positive, cfg.margin,
                                          cfg.max_violation, cfg.sum_warmup_steps, step)
    return value, {"triplet": value}
