"""ProLIP objectives as pure functions of arrays (paper §3.2-3.3, REFERENCE §2).

Shapes: mu / logvar are [B, D] float (mu L2-normalised, logvar = log sigma^2). Every
function computes *global-batch* semantics: under `jit` with a sharded batch the compiler
distributes the B x B logits; how the batch is spread over devices never changes the value
(REFERENCE §2.7: the intended loss, not the reference's even-world-size ring bug).

Inclusion numerics (REFERENCE §2.4): the reference evaluates
    inc(1->2) = -2 l1 - l2 - 1/2 log A + B^2 / 4A - C,
    A = e^{eps-l1} + 1/2 e^{eps-l2}, B = 2 mu1 e^{eps-l1} + mu2 e^{eps-l2},
    C = mu1^2 e^{eps-l1} + 1/2 mu2^2 e^{eps-l2}
directly, which at eps = -100 makes A a float32 subnormal: flushed to zero, log A = -inf and
the loss is NaN. We use the same value in closed form:
    log A        = eps + logaddexp(-l1, -l2 - log 2)
    B^2/4A - C   = -(mu1 - mu2)^2 e^{eps} / (sigma1^2 + 2 sigma2^2)
                 = -(mu1 - mu2)^2 exp(eps - logaddexp(l1, l2 + log 2))
(the second by completing the square), which is finite for any eps and needs no subnormals.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Literal

import jax
import jax.numpy as jnp

LOG2 = math.log(2.0)


# --------------------------------------------------------------------------------- CSD / PPCL
def csd(mu1: jax.Array, logvar1: jax.Array | None, mu2: jax.Array, logvar2: jax.Array | None
        ) -> jax.Array:
    """Closed-form sampled distance [N, M] (PCME++ eq. 2): ||mu1 - mu2||^2 + tr(S1 + S2).

    A log sigma^2 of None (a deterministic tower, `embed_unc=False`) has tr(S) = 0: the squared
    distance of the means alone (for unit mu the ranking of the dot product)."""
    sq = (jnp.sum(mu1 ** 2, -1)[:, None] + jnp.sum(mu2 ** 2, -1)[None, :] - 2.0 * mu1 @ mu2.T)
    if logvar1 is not None:
        sq = sq + jnp.sum(jnp.exp(logvar1), -1)[:, None]
    if logvar2 is not None:
        sq = sq + jnp.sum(jnp.exp(logvar2), -1)[None, :]
    return sq


def ppcl_logits(img_mu: jax.Array, img_logvar: jax.Array, txt_mu: jax.Array, txt_logvar: jax.Array,
                scale: jax.Array, bias: jax.Array) -> jax.Array:
    """[B_img, B_txt] logits a * (mu_v . mu_t - tr(S_v + S_t) / 2) + b, as the reference codes it.

    For unit mu this is -(a/2) CSD + (a + b). `scale` is a = exp(logit_scale), `bias` is b.
    """
    trace = jnp.sum(jnp.exp(img_logvar), -1)[:, None] + jnp.sum(jnp.exp(txt_logvar), -1)[None, :]
    return scale * (img_mu @ txt_mu.T - trace / 2.0) + bias


def ppcl_loss(img_mu: jax.Array, img_logvar: jax.Array, txt_mu: jax.Array, txt_logvar: jax.Array,
              scale: jax.Array, bias: jax.Array, targets: jax.Array | None = None) -> jax.Array:
    """-sum log sigmoid(z_ij * logit_ij) / B with z = 2I - 1 (paper eq. 2, REFERENCE §2.2).

    targets: [B_img, B_txt] match targets m in [0, 1] instead of the identity; the loss is then
    the BCE -sum [m log sigmoid(l) + (1 - m) log sigmoid(-l)] / B, which for 0/1 targets is
    the same sum with z = 2m - 1 (several positives per row: identical captions, one image's
    captions) and for fractional m the soft labels of MSDA (PCME++, seed 003 §2.4)."""
    logits = ppcl_logits(img_mu, img_logvar, txt_mu, txt_logvar, scale, bias)
    if targets is None:
        labels = 2.0 * jnp.eye(logits.shape[0], logits.shape[1], dtype=logits.dtype) - 1.0
        return -jnp.sum(jax.nn.log_sigmoid(labels * logits)) / img_mu.shape[0]
    t = targets.astype(logits.dtype)
    return -jnp.sum(t * jax.nn.log_sigmoid(logits) + (1.0 - t) * jax.nn.log_sigmoid(-logits)) / img_mu.shape[0]


# ---------------------------------------------------------------------------------- inclusion
def log_inclusion(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array,
                  eps: float = 0.0) -> jax.Array:
    """Per-dimension log inclusion inc(Z1 -> Z2) (paper eq. 3) with 1/sigma^2 scaled by e^eps.

    Elementwise, same shape as the inputs (the reference does not sum over D).
    """
    log_a = eps + jnp.logaddexp(-logvar1, -logvar2 - LOG2)
    quad = -jnp.square(mu1 - mu2) * jnp.exp(eps - jnp.logaddexp(logvar1, logvar2 + LOG2))
    return -2.0 * logvar1 - logvar2 - 0.5 * log_a + quad


def inclusion_test(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array,
                   eps: float = 0.0) -> jax.Array:
    """H(Z1 in Z2) = inc(Z1->Z2) - inc(Z2->Z1) (paper eq. 4), per dimension: > 0 iff included."""
    return log_inclusion(mu1, logvar1, mu2, logvar2, eps) - log_inclusion(mu2, logvar2, mu1, logvar1, eps)


def inclusion_test_pairwise(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array,
                            eps: float = 0.0) -> jax.Array:
    """[N, M] H summed over D for every pair (the reference's `inclusion_test_batchwise`)."""
    return jnp.sum(inclusion_test(mu1[:, None], logvar1[:, None], mu2[None], logvar2[None], eps), -1)


def _guard(loss: jax.Array, threshold: float) -> jax.Array:
    """The reference drops a term (returns 0) when it explodes past `threshold`."""
    return jnp.where(jnp.abs(loss) > threshold, jnp.zeros_like(loss), loss)


def inclusion_loss(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array,
                   eps: float = -20.0, scale: float = 1000.0, threshold: float = 1e5) -> jax.Array:
    """mean over B x D of -log sigmoid(c * H(Z1 in Z2)) (paper eq. 5), guarded at |L| > 1e5."""
    h = inclusion_test(mu1, logvar1, mu2, logvar2, eps)
    return _guard(jnp.mean(-jax.nn.log_sigmoid(scale * h)), threshold)


# ---------------------------------------------------------------------------------------- VIB
VIB_FORMS = ("reference", "kl")


def vib_loss(mu: jax.Array, logvar: jax.Array, form: str = "reference", threshold: float = 1e4) -> jax.Array:
    """VIB regulariser, mean over B x D, guarded at > 1e4 (REFERENCE §2.5).

    form='reference': what the code computes after its "pcmepp issue #4" fix, with
        log sigma = logvar / 2: -1/2 (1 + log sigma - mu^2 - sigma).
    form='kl': the paper's eq. A.2, KL(N(mu, sigma^2) || N(0, 1)) = -1/2 (1 + log sigma^2 - mu^2 - sigma^2).
    """
    if form == "reference":
        half = logvar / 2.0
        kl = -0.5 * jnp.mean(1.0 + half - mu ** 2 - jnp.exp(half))
    elif form == "kl":
        kl = -0.5 * jnp.mean(1.0 + logvar - mu ** 2 - jnp.exp(logvar))
    else:
        raise ValueError(f"unknown VIB form {form!r}; use one of {VIB_FORMS}")
    return jnp.where(kl > threshold, jnp.zeros_like(kl), kl)


# ---------------------------------------------------------------------------- combined objective
@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Weights of the ProLIP objective (paper eq. 6); defaults are the B/16 DataComp scripts."""

    ppcl_weight: float = 1.0
    vib_beta: float = 1e-4  # beta
    alpha_image_text: float = 1e-7  # alpha_1: image in text
    alpha_masked: float = 1e-3  # alpha_2: original in masked, image and text each
    inclusion_eps: float = -20.0  # log-space epsilon; -100 with c = 10 is the recommended setting
    inclusion_scale: float = 1000.0  # c
    vib_form: Literal["reference", "kl"] = "reference"
    inclusion_threshold: float = 1e5
    vib_threshold: float = 1e4


def num_masked(batch: int, fraction: float) -> int:
    """The reference masks `int(B_local * drop_ratio)` samples (12.5% -> 64 of 512)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"masked fraction must be in [0, 1], got {fraction}")
    return int(batch * fraction)


def prolip_loss(out: dict[str, jax.Array], masked: dict[str, jax.Array] | None = None,
                masked_rows: jax.Array | None = None,
                config: LossConfig = LossConfig(),
                ppcl_fn: Callable | None = None, targets: jax.Array | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The ProLIP objective. Returns (total, terms), each term already weighted.

    out: model outputs for the batch: `image_mean`, `image_logvar`, `text_mean`, `text_logvar`
      [B, D], `logit_scale` (a, already exponentiated) and `logit_bias` (b).
    masked: outputs of the masked forward on M samples (same keys), or None to skip the
      original-in-masked terms.
    masked_rows: int [M], which rows of `out` were masked; the reference masks the first M
      (default). The trainer spreads them over the data shards.
    ppcl_fn: replaces `ppcl_loss` (same signature), e.g. the ring implementation whose memory
      per device is O(b_local^2) (`ring_loss.py`); same value.
    targets: [B, B] match targets for PPCL (`ppcl_loss`); None = the identity.
    """
    c = config
    im, il, tm, tl = out["image_mean"], out["image_logvar"], out["text_mean"], out["text_logvar"]
    ppcl = ppcl_fn or ppcl_loss
    ppcl_args = (im, il, tm, tl, out["logit_scale"], out["logit_bias"])
    ppcl_value = ppcl(*ppcl_args) if targets is None else ppcl(*ppcl_args, targets)
    terms = {"ppcl": c.ppcl_weight * ppcl_value}
    inc = dict(eps=c.inclusion_eps, scale=c.inclusion_scale, threshold=c.inclusion_threshold)
    if masked is not None:
        m = masked["image_mean"].shape[0]
        rows = jnp.arange(m) if masked_rows is None else masked_rows
        terms["img_inclusion"] = c.alpha_masked * inclusion_loss(
            im[rows], il[rows], masked["image_mean"], masked["image_logvar"], **inc)
        terms["txt_inclusion"] = c.alpha_masked * inclusion_loss(
            tm[rows], tl[rows], masked["text_mean"], masked["text_logvar"], **inc)
    if c.alpha_image_text > 0:
        terms["inclusion"] = c.alpha_image_text * inclusion_loss(im, il, tm, tl, **inc)
    if c.vib_beta > 0:
        terms["vib"] = c.vib_beta * (vib_loss(im, il, c.vib_form, c.vib_threshold)
                                     + vib_loss(tm, tl, c.vib_form, c.vib_threshold))
    total = sum(terms.values())
    return total, terms
