"""ProLIP (Chun et al., "Probabilistic Language-Image Pre-Training" §3.2-3.3): PPCL + inclusion
losses + VIB, as pure functions of arrays (naver-ai/prolip src/prolip/loss.py).

Shapes: mu / logvar are [B, D] float (mu L2-normalised, logvar = log sigma^2). Every function
computes *global-batch* semantics: under `jit` with a sharded batch the compiler distributes the
B x B logits; how the batch is spread over devices never changes the value (naver-ai/prolip src/prolip/loss.py: the
intended loss, not the reference's even-world-size ring bug).

Where the pieces are: PPCL's formula and its mesh layouts (sharded logits, ppermute ring) in
`ppcl.py`; the inclusion test H (eq. 3-4, a formula on two Gaussians that the evaluators use
too) and CSD in `prolip_jax.core.objectives.distances`; the inclusion loss (eq. 5), VIB and the
weighted sum (eq. 6) here.

Knobs: `Config` (the loss weights of eq. 6, reference defaults) plus how PPCL is laid out over
the devices. Targets other than the identity (several captions of one image, identical
captions, MSDA's soft labels) enter PPCL as BCE targets; for 0/1 targets that is exactly the
paper's -log sigmoid(z_ij logit_ij) with z = 2 m - 1.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Literal

import jax
import jax.numpy as jnp

from prolip_jax.core import sharding
from prolip_jax.core.objectives.distances import inclusion_test
from prolip_jax.core.objectives.prolip.ppcl import ppcl_loss, ppcl_loss_ring

NEEDS_LOGVAR = True
USES_MASKED = True
SOFT_TARGETS = True


# ---------------------------------------------------------------------------------- inclusion
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
    """VIB regulariser, mean over B x D, guarded at > 1e4 (naver-ai/prolip src/prolip/loss.py).

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
class Config:
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
    # "dense": B x B logits sharded by XLA (O(b B) per device); "ring": shard_map + ppermute,
    # O(b^2) per device (ppcl.py). The ring scores the diagonal only: identity targets.
    ppcl_impl: Literal["dense", "ring"] = "dense"

    def validate(self) -> None:
        for name in ("ppcl_weight", "vib_beta", "alpha_image_text", "alpha_masked", "inclusion_scale"):
            if getattr(self, name) < 0:
                raise ValueError(f"config.loss.{name} must be >= 0, got {getattr(self, name)}")


def num_masked(batch: int, fraction: float) -> int:
    """The reference masks `int(B_local * drop_ratio)` samples (12.5% -> 64 of 512)."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"masked fraction must be in [0, 1], got {fraction}")
    return int(batch * fraction)


def prolip_loss(out: dict[str, jax.Array], masked: dict[str, jax.Array] | None = None,
                masked_rows: jax.Array | None = None,
                config: Config = Config(),
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
      per device is O(b_local^2) (`ppcl.py`); same value. `config.ppcl_impl` is not read here:
      `loss` turns it into this argument.
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


def check_targets(cfg: Config, identity: bool) -> None:
    """The ring scores the diagonal only, so it takes identity targets alone (the trainer asks
    before compiling; `loss` asks again for direct callers)."""
    if cfg.ppcl_impl == "ring" and not identity:
        raise ValueError("config.loss.ppcl_impl='ring' scores one positive per row; multi-positive or MSDA "
                         "targets need ppcl_impl='dense'")


def loss(out, cfg: Config, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None):
    """The registry entry point (prolip_jax/core/objectives/__init__.py): `prolip_loss` with PPCL laid
    out by `cfg.ppcl_impl`."""
    ppcl_fn = None
    if cfg.ppcl_impl == "ring":
        check_targets(cfg, identity=targets is None)
        ppcl_fn = lambda *a: ppcl_loss_ring(*a, mesh=mesh, batch_axes=sharding.batch_axes(mesh))  # noqa: E731
    return prolip_loss(out, masked, masked_rows, cfg, ppcl_fn=ppcl_fn, targets=targets)
