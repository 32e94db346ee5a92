"""PCME + Smooth-AP: DAA's Smooth-AP baseline (DAA §5.4, Table 4 "B + Smooth-AP" with B =
PCME-bert; DAA's criterions/DAA.py `Smooth_AP`, added to PCME by probemb.py with weight ap_beta).

Smooth-AP (Brown et al. 2020) relaxes average precision with the same clamped sigmoid as DAA
(tau = 0.01): for a query q with positives P_q,
    AP~_q = 1/|P_q| sum_{c in P_q} (1 + sum_{a in P_q, a != c} phi(s_qa - s_qc))
                                   / (1 + sum_{a != c} phi(s_qa - s_qc)),
and the loss is 1 - mean_q AP~_q, once image-to-text and once text-to-image. As in the code, the
queries are the B_img * J image samples (caption samples for t2i), the items every sample of the
other modality, s the raw cross-modal dot product of samples (DAA.py does not overwrite input2
here), and the positives of a query are the J samples of its matching caption(s) (the code's
J x J same-pair blocks; with several captions per image, every positive target's samples).

`ap_rank_index`: "query" ranks each query's own row (Brown et al.); "code" reproduces DAA.py's
broadcast, which reads s[a, q] - s[q, c] (the transposed similarity of a cross-modal score
matrix) for the other items a. SGRAF-DAA's model.py `SmoothAP` transposes first, i.e. "query".

The weight: the released config sets ap_beta = 0 and the paper does not give the weight behind
Table 4; the default here takes daa_beta's 1000 so that the two regularisers are compared at
the same strength on the same PCME base. The PCME knobs and defaults are pcme.Config's.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from prolip_jax.core.objectives import pcme
from prolip_jax.core.objectives.daa import masked_rank_sum

NEEDS_LOGVAR = True
USES_MASKED = False
SOFT_TARGETS = False  # positives are a set: 0/1 targets only


@dataclasses.dataclass(frozen=True)
class Knobs:
    ap_beta: float = 1000.0  # not published (see the module docstring)
    ap_tau: float = 0.01  # DAA.py Smooth_AP
    ap_rank_index: Literal["query", "code"] = "query"

    def validate_ap(self) -> None:
        if self.ap_beta < 0:
            raise ValueError(f"config.loss.ap_beta must be >= 0, got {self.ap_beta}")
        if not self.ap_tau > 0:
            raise ValueError(f"config.loss.ap_tau must be > 0, got {self.ap_tau}")


@dataclasses.dataclass(frozen=True)
class Config(pcme.Config, Knobs):
    def validate(self) -> None:
        pcme.Config.validate(self)
        self.validate_ap()


def smooth_ap_loss(zq: jax.Array, zi: jax.Array, positives: jax.Array, tau: float,
                   index: str = "query") -> jax.Array:
    """1 - mean_q AP~_q for queries zq [Bq, J, D], items zi [Bi, J, D], positives [Bq, Bi] bool.

    Queries without a positive (none in a well-formed batch) are left out of the mean."""
    bq, j, d = zq.shape
    s = zq.reshape(bq * j, d) @ zi.reshape(-1, d).T
    pos = jnp.repeat(jnp.repeat(positives, j, 0), j, 1).astype(s.dtype)  # [Bq J, Bi J]
    v = s if index == "query" else s.T
    if v.shape != s.shape:
        raise ValueError(f"ap_rank_index='code' needs as many images as captions, got {s.shape}")
    rank_all = 1.0 + masked_rank_sum(s, v, tau)
    rank_pos = 1.0 + masked_rank_sum(s, v, tau, weights=pos)
    n_pos = jnp.sum(pos, -1)
    ap = jnp.sum(pos * rank_pos / rank_all, -1) / jnp.maximum(n_pos, 1.0)
    has = (n_pos > 0).astype(s.dtype)
    return 1.0 - jnp.sum(ap * has) / jnp.maximum(jnp.sum(has), 1.0)


def loss(out, cfg: Config, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None):
    zv, zt = pcme.sample_outputs(out, cfg, rng)
    terms = pcme.terms_from_samples(out, cfg, zv, zt, targets)
    if cfg.ap_beta > 0:
        b_img, b_txt = zv.shape[0], zt.shape[0]
        pos = jnp.eye(b_img, b_txt, dtype=bool) if targets is None else targets > 0.5
        terms["ap_i2t"] = cfg.ap_beta * smooth_ap_loss(zv, zt, pos, cfg.ap_tau, cfg.ap_rank_index)
        terms["ap_t2i"] = cfg.ap_beta * smooth_ap_loss(zt, zv, pos.T, cfg.ap_tau, cfg.ap_rank_index)
    return sum(terms.values()), terms
