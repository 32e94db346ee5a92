"""Deterministic baselines on the means alone (logvar ignored): CLIP InfoNCE, SigLIP, VSE∞.

Three objectives in one module, registered as "module:attribute" (`clip`, `siglip`, `vse` are
namespaces holding Config, loss and the three flags). All have global-batch semantics: plain
jnp on the gathered [N, M] similarity matrix, which XLA shards under jit.

- clip: CLIP's symmetric InfoNCE, logits = a * mu_i . mu_t with a = out["logit_scale"] (the
  learnable inverse temperature, already exponentiated); (CE over rows + CE over columns) / 2,
  each a mean over its rows, as open_clip's ClipLoss and pcmepp/criterions/infonce.py. With
  several positives per row the row's target is uniform over its positives (the mean over
  positives of -log softmax); for identity targets that is exactly CLIP's loss.
- siglip: SigLIP's pairwise sigmoid loss, logits = a * mu_i . mu_t + b, -sum log sigmoid(z l) / N
  with z = 2 m - 1, normalised by the (image) batch size as big_vision's siglip trainer. Written
  as BCE with target m, which equals that for 0/1 targets and also takes soft targets (the
  pairwise argument of PCME++, PCME++ App. A.5).
- vse: VSE∞'s triplet loss with hardest in-batch negatives (VSE++ max violation), margin 0.2,
  summed over the batch as VSE∞'s ContrastiveLoss (pcmepp/criterions/triplet.py):
  sum_i [m + max_j' s(i, j') - s(i, i)]_+ + sum_j [m + max_i' s(i', j) - s(j, j)]_+ on s = mu_i . mu_t.
"""
from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp


def _targets(targets, n: int, m: int, dtype) -> jax.Array:
    return jnp.eye(n, m, dtype=dtype) if targets is None else jnp.asarray(targets, dtype)


# ------------------------------------------------------------------------------ shared formulas
def info_nce(img_mu: jax.Array, txt_mu: jax.Array, scale: jax.Array, targets: jax.Array | None = None
             ) -> jax.Array:
    """Symmetric InfoNCE on logits scale * img_mu @ txt_mu^T; targets None = the identity.

    A row (column) with no positive contributes 0 but still counts in its mean."""
    logits = scale * img_mu @ txt_mu.T
    t = _targets(targets, *logits.shape, logits.dtype)
    rows = t / jnp.maximum(jnp.sum(t, 1, keepdims=True), jnp.finfo(t.dtype).tiny)
    cols = t / jnp.maximum(jnp.sum(t, 0, keepdims=True), jnp.finfo(t.dtype).tiny)
    ce_img = -jnp.sum(rows * jax.nn.log_softmax(logits, axis=1)) / logits.shape[0]
    ce_txt = -jnp.sum(cols * jax.nn.log_softmax(logits, axis=0)) / logits.shape[1]
    return 0.5 * (ce_img + ce_txt)


def hardest_negative_triplet(sim: jax.Array, positive: jax.Array | None, margin: float,
                             max_violation: bool = True) -> jax.Array:
    """Hinge triplet loss summed over the positive pairs (i, j) of the [N, M] similarity `sim`.

    positive: bool [N, M], None = the identity. Negatives of (i, j) are the non-positives of row i
    (captions for image i) and of column j (images for caption j), so other positives of a
    multi-positive row are never negatives. max_violation=True: the hardest negative only
    (VSE++ / VSE∞; Pishdad et al., Pishdad et al. eq. 3); a row without negatives adds 0.
    max_violation=False: VSE0, the sum over all negatives; [N, M] for the identity (`positive`
    None, N = M), with `positive` given it materialises [N, M, M] and [N, N, M] (VSE∞ uses it
    only for its first warm-up epochs).
    """
    n, m = sim.shape
    if positive is None and not max_violation:  # identity: [N, M] costs against the diagonal
        diag = jnp.diagonal(sim)
        off = ~jnp.eye(n, m, dtype=bool)
        c_txt = jax.nn.relu(margin + sim - diag[:, None])
        c_img = jax.nn.relu(margin + sim - diag[None, :])
        return jnp.sum(jnp.where(off, c_txt + c_img, jnp.zeros_like(sim)))
    if positive is None:
        positive = jnp.eye(n, m, dtype=bool)
    if max_violation:
        low = jnp.finfo(sim.dtype).min  # not -inf: margin + (-inf) - s stays finite, no NaN grads
        s_neg = jnp.where(positive, low, sim)
        hard_txt = jnp.max(s_neg, axis=1, keepdims=True)  # hardest caption of each image
        hard_img = jnp.max(s_neg, axis=0, keepdims=True)  # hardest image of each caption
        cost = jax.nn.relu(margin + hard_txt - sim) + jax.nn.relu(margin + hard_img - sim)
        return jnp.sum(jnp.where(positive, cost, jnp.zeros_like(cost)))
    pos, neg = positive.astype(sim.dtype), (~positive).astype(sim.dtype)
    # [i, j, k]: positive (i, j) against negative caption k of image i.
    c_txt = pos[:, :, None] * neg[:, None, :] * jax.nn.relu(margin + sim[:, None, :] - sim[:, :, None])
    # [i, k, j]: positive (i, j) against negative image k of caption j.
    c_img = pos[:, None, :] * neg[None, :, :] * jax.nn.relu(margin + sim[None, :, :] - sim[:, None, :])
    return jnp.sum(c_txt) + jnp.sum(c_img)


# ------------------------------------------------------------------------------------- clip
@dataclasses.dataclass(frozen=True)
class ClipConfig:
    """No knobs: the temperature is the model's learnable `logit_scale` (PCME++ initialises
    it at 1.0 for its InfoNCE baseline, PCME++ App. B.2; CLIP at 1/0.07)."""


def clip_loss(out, cfg: ClipConfig, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None):
    value = info_nce(out["image_mean"], out["text_mean"], out["logit_scale"], targets)
    return value, {"clip": value}


clip = types.SimpleNamespace(Config=ClipConfig, loss=clip_loss, NEEDS_LOGVAR=False, USES_MASKED=False,
                             SOFT_TARGETS=False)


# ----------------------------------------------------------------------------------- siglip
@dataclasses.dataclass(frozen=True)
class SiglipConfig:
    """No knobs: a = `logit_scale`, b = `logit_bias` are the model's learnable scalars."""


def siglip_loss(out, cfg: SiglipConfig, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None):
    logits = out["logit_scale"] * out["image_mean"] @ out["text_mean"].T + out["logit_bias"]
    t = _targets(targets, *logits.shape, logits.dtype)
    # softplus(l) - t l = -t log sigmoid(l) - (1 - t) log sigmoid(-l) = -log sigmoid((2t - 1) l) for 0/1 t.
    value = jnp.sum(jax.nn.softplus(logits) - t * logits) / logits.shape[0]
    return value, {"siglip": value}


siglip = types.SimpleNamespace(Config=SiglipConfig, loss=siglip_loss, NEEDS_LOGVAR=False, USES_MASKED=False,
                               SOFT_TARGETS=True)


# -------------------------------------------------------------------------------------- vse
@dataclasses.dataclass(frozen=True)
class VseConfig:
    margin: float = 0.2  # VSE∞'s margin, as configured by PCME++ (App. B.2)
    # True: hardest negative (VSE++). False: VSE0's sum over negatives throughout.
    max_violation: bool = True
    # VSE∞'s warm-up (vse_mean_warmup_epochs in its train.py): the sum over negatives for the
    # first N training steps, then max_violation's choice. 0: no warm-up.
    sum_warmup_steps: int = 0

    def validate(self) -> None:
        if self.margin < 0:
            raise ValueError(f"config.loss.margin must be >= 0, got {self.margin}")
        if self.sum_warmup_steps < 0:
            raise ValueError(f"config.loss.sum_warmup_steps must be >= 0, got {self.sum_warmup_steps}")


def scheduled_triplet(sim: jax.Array, positive: jax.Array | None, margin: float, max_violation: bool,
                      sum_warmup_steps: int = 0, step: jax.Array | None = None) -> jax.Array:
    """`hardest_negative_triplet`, with the sum over negatives while step < sum_warmup_steps.

    VSE∞ (its train.py) trains the first epochs with VSE0's sum and then switches to the hardest
    negative: from random towers every image's hardest caption is the same one and the hardest-
    negative loss alone stays at chance (benchmarks/methods_synthetic.py). Both branches are compiled
    once; lax.cond runs one of them per step."""
    if not (max_violation and sum_warmup_steps and step is not None):
        return hardest_negative_triplet(sim, positive, margin, max_violation)
    return jax.lax.cond(step < sum_warmup_steps,
                        lambda: hardest_negative_triplet(sim, positive, margin, False),
                        lambda: hardest_negative_triplet(sim, positive, margin, True))


def vse_loss(out, cfg: VseConfig, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None,
             step=None):
    sim = out["image_mean"] @ out["text_mean"].T
    positive = None if targets is None else jnp.asarray(targets) > 0
    value = scheduled_triplet(sim, positive, cfg.margin, cfg.max_violation, cfg.sum_warmup_steps, step)
    return value, {"vse": value}


vse = types.SimpleNamespace(Config=VseConfig, loss=vse_loss, NEEDS_LOGVAR=False, USES_MASKED=False,
                            SOFT_TARGETS=False, USES_STEP=True)
