"""CyCLIP (Goel et al., "CyCLIP: Cyclic Contrastive Language-Image Pretraining", NeurIPS 2022):
CLIP's InfoNCE plus two consistency terms on the means (logvar ignored).

    total = InfoNCE(a mu_v mu_t^T)                                      "clip"
          + lambda_in    * sum_jk (<v_j, v_k> - <t_j, t_k>)^2 / N       "inmodal_cyclic"    (in-modal consistency)
          + lambda_cross * sum_jk (<v_j, t_k> - <v_k, t_j>)^2 / N       "crossmodal_cyclic" (cross-modal consistency)

As the authors' code (goel-shashank/CyCLIP src/train.py `get_loss`): each cyclic term is the mean
of the squared differences over the N x N pairs times the batch size N, on the cosine
similarities (the code multiplies the logits by a and divides the mean by a^2), and both lambdas
default to 0.25 (its `--cylambda1` / `--cylambda2`). Several positives per row enter InfoNCE as
in the `clip` objective; the cyclic terms do not use targets. The global batch is one matrix, so
the value does not depend on how the batch is spread over devices.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from prolip_jax.core.objectives.contrastive import info_nce

NEEDS_LOGVAR = False
USES_MASKED = False
SOFT_TARGETS = False  # InfoNCE's softmax rows (as `clip`)


@dataclasses.dataclass(frozen=True)
class Config:
    """Defaults: the authors' code (`--cylambda1 0.25 --cylambda2 0.25`)."""

    inmodal_weight: float = 0.25  # lambda_in: image-image vs text-text similarities
    crossmodal_weight: float = 0.25  # lambda_cross: <v_j, t_k> vs <v_k, t_j>

    def validate(self) -> None:
        for name in ("inmodal_weight", "crossmodal_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"config.loss.{name} must be >= 0, got {getattr(self, name)}")


def _sum_sq_over_n(x: jax.Array) -> jax.Array:
    return jnp.sum(jnp.square(x)) / x.shape[0]


def loss(out, cfg: Config, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None):
    v, t = out["image_mean"], out["text_mean"]
    terms = {"clip": info_nce(v, t, out["logit_scale"], targets)}
    if cfg.inmodal_weight > 0:
        terms["inmodal_cyclic"] = cfg.inmodal_weight * _sum_sq_over_n(v @ v.T - t @ t.T)
    if cfg.crossmodal_weight > 0:
        cross = v @ t.T
        terms["crossmodal_cyclic"] = cfg.crossmodal_weight * _sum_sq_over_n(cross - cross.T)
    return sum(terms.values()), terms
