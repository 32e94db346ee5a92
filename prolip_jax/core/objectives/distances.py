"""Pairwise [N, M] distances between diagonal Gaussians N(mu, diag(exp(logvar))), and the
inclusion test of two Gaussians.

Row i is the first argument's i-th Gaussian, column j the second's j-th. They are the training
distances of PCME++'s Table 4 ablation (Chun, "Improved Probabilistic Image-Text
Representations" §3.3 / Table 4: CSD, KL, 2-Wasserstein, Expected Likelihood Kernel,
Bhattacharyya; the paper gives no formulas for the alternatives, these are the textbook diagonal
closed forms) and the similarities of Pishdad et al. ("Uncertainty-based Cross-Modal Retrieval
with Probabilistic Representations" §3.2 and its appendix 6.1: -KL, -min KL, -W2). CSD is also
ProLIP's distance (Chun et al., "Probabilistic Language-Image Pre-Training" §3.2) and the
evaluators' score.

Memory. `csd`, `kl`, `kl_reverse`, `min_kl` and `wasserstein` are sums of matmuls of
per-dimension terms (||a - b||^2 = |a|^2 + |b|^2 - 2 a.b, sum_d x_d / y_d = x @ (1/y)^T, ...):
O(N M + (N + M) D) memory, never [N, M, D]. `elk` and `bhattacharyya` put sigma_1^2 + sigma_2^2
inside a quotient and a log per dimension, which does not factor into per-side terms: they
materialise [N, M, D] (fine at a COCO batch of 128 x 128 x 1024; chunk them before using them
at CLIP batch sizes). The expanded forms (CSD's included) cancel in float32: their absolute
error is ~1e-7 of the size of the summed terms, not of the difference.

A logvar of None is a point mass (a mu-only tower): allowed where the distance stays finite
(`csd`, `wasserstein`); the others divide by or take the log of sigma^2 and raise ValueError.

Inclusion (ProLIP §3.3 eq. 3-4; asymmetric, so not in DISTANCES; used by ProLIP's inclusion
loss and the HierarCaps / uncertainty evaluators). The reference code (naver-ai/prolip src/prolip/loss.py) evaluates
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

import math

import jax
import jax.numpy as jnp

LOG2 = math.log(2.0)
LOG_2PI = math.log(2.0 * math.pi)


def _need(name: str, *logvars) -> None:
    if any(lv is None for lv in logvars):
        raise ValueError(f"distance {name!r} needs both log-variances (it is undefined for a point mass); "
                         "a mu-only tower can use 'csd' or 'wasserstein'")


def _sq_mean_dist(mu1: jax.Array, mu2: jax.Array) -> jax.Array:
    return jnp.sum(mu1 ** 2, -1)[:, None] + jnp.sum(mu2 ** 2, -1)[None, :] - 2.0 * mu1 @ mu2.T


def csd(mu1: jax.Array, logvar1: jax.Array | None, mu2: jax.Array, logvar2: jax.Array | None
        ) -> jax.Array:
    """Closed-form sampled distance [N, M] (PCME++ eq. 1): ||mu1 - mu2||^2 + tr(S1 + S2).

    A log sigma^2 of None (a deterministic tower, `embed_unc=False`) has tr(S) = 0: the squared
    distance of the means alone (for unit mu the ranking of the dot product)."""
    sq = _sq_mean_dist(mu1, mu2)
    if logvar1 is not None:
        sq = sq + jnp.sum(jnp.exp(logvar1), -1)[:, None]
    if logvar2 is not None:
        sq = sq + jnp.sum(jnp.exp(logvar2), -1)[None, :]
    return sq


def kl(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array) -> jax.Array:
    """KL(N1_i || N2_j) = 1/2 sum_d [s1/s2 + (m1 - m2)^2 / s2 - 1 + log s2 - log s1], s = sigma^2.

    As matmuls: (s1 + m1^2) @ (1/s2)^T - 2 m1 @ (m2/s2)^T + sum m2^2/s2 + sum log s2 - sum log s1 - D.
    Pishdad et al. eq. 5 is its negative with 1 = image, 2 = caption.
    """
    _need("kl", logvar1, logvar2)
    inv2 = jnp.exp(-logvar2)
    cross = (jnp.exp(logvar1) + mu1 ** 2) @ inv2.T - 2.0 * mu1 @ (mu2 * inv2).T
    col = jnp.sum(mu2 ** 2 * inv2 + logvar2, -1)
    row = jnp.sum(logvar1, -1)
    return 0.5 * (cross + col[None, :] - row[:, None] - mu1.shape[-1])


def kl_reverse(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array) -> jax.Array:
    """KL(N2_j || N1_i), laid out [N, M] like `kl` (the other direction of the same pairs)."""
    return kl(mu2, logvar2, mu1, logvar1).T


def min_kl(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array) -> jax.Array:
    """min(KL(N1 || N2), KL(N2 || N1)): symmetric (Pishdad et al. eq. 6, negated)."""
    return jnp.minimum(kl(mu1, logvar1, mu2, logvar2), kl_reverse(mu1, logvar1, mu2, logvar2))


def wasserstein(mu1: jax.Array, logvar1: jax.Array | None, mu2: jax.Array, logvar2: jax.Array | None
                ) -> jax.Array:
    """Squared 2-Wasserstein distance ||mu1 - mu2||^2 + ||sigma1 - sigma2||^2 (standard deviations).

    The diagonal closed form of tr(S1 + S2 - 2 (S1^1/2 S2 S1^1/2)^1/2); PCME++'s ablation codes
    exactly this (pcmepp/criterions/pcmepp.py `_compute_wd_loss`, sigma = exp(logvar / 2)). Not
    clamped at 0: float32 cancellation can leave it ~-1e-7 for identical Gaussians.
    """
    sq = _sq_mean_dist(mu1, mu2)
    sd1 = None if logvar1 is None else jnp.exp(0.5 * logvar1)
    sd2 = None if logvar2 is None else jnp.exp(0.5 * logvar2)
    if sd1 is not None:
        sq = sq + jnp.sum(sd1 ** 2, -1)[:, None]
    if sd2 is not None:
        sq = sq + jnp.sum(sd2 ** 2, -1)[None, :]
    if sd1 is not None and sd2 is not None:
        sq = sq - 2.0 * sd1 @ sd2.T
    return sq


def elk(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array) -> jax.Array:
    """-log of the Expected Likelihood Kernel, -log int N1(x) N2(x) dx (materialises [N, M, D]):

        1/2 sum_d [(m1 - m2)^2 / (s1 + s2) + log(2 pi (s1 + s2))].

    The ELK is a similarity; its negative log is the distance that enters -a d + b.
    """
    _need("elk", logvar1, logvar2)
    log_s = jnp.logaddexp(logvar1[:, None, :], logvar2[None, :, :])  # log(s1 + s2)
    diff2 = jnp.square(mu1[:, None, :] - mu2[None, :, :])
    return 0.5 * jnp.sum(diff2 * jnp.exp(-log_s) + log_s + LOG_2PI, -1)


def bhattacharyya(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array) -> jax.Array:
    """Bhattacharyya distance (materialises [N, M, D]), s = (s1 + s2) / 2:

        1/8 sum_d (m1 - m2)^2 / s + 1/2 sum_d log(s / sqrt(s1 s2)).
    """
    _need("bhattacharyya", logvar1, logvar2)
    log_s = jnp.logaddexp(logvar1[:, None, :], logvar2[None, :, :]) - LOG2
    diff2 = jnp.square(mu1[:, None, :] - mu2[None, :, :])
    quad = 0.125 * jnp.sum(diff2 * jnp.exp(-log_s), -1)
    logs = 0.5 * jnp.sum(log_s, -1) - 0.25 * (jnp.sum(logvar1, -1)[:, None] + jnp.sum(logvar2, -1)[None, :])
    return quad + logs


DISTANCES = {
    "csd": csd,
    "kl": kl,
    "kl_reverse": kl_reverse,
    "min_kl": min_kl,
    "wasserstein": wasserstein,
    "elk": elk,
    "bhattacharyya": bhattacharyya,
}


def pairwise(name: str, mu1: jax.Array, logvar1: jax.Array | None, mu2: jax.Array,
             logvar2: jax.Array | None) -> jax.Array:
    """The [N, M] distance `name` (a key of DISTANCES)."""
    if name not in DISTANCES:
        raise ValueError(f"unknown distance {name!r}; use one of {sorted(DISTANCES)}")
    return DISTANCES[name](mu1, logvar1, mu2, logvar2)


# ---------------------------------------------------------------------------------- inclusion
def log_inclusion(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array,
                  eps: float = 0.0) -> jax.Array:
    """Per-dimension log inclusion inc(Z1 -> Z2) (ProLIP eq. 3) with 1/sigma^2 scaled by e^eps.

    Elementwise, same shape as the inputs (the reference does not sum over D). Closed form: see
    the module docstring.
    """
    log_a = eps + jnp.logaddexp(-logvar1, -logvar2 - LOG2)
    quad = -jnp.square(mu1 - mu2) * jnp.exp(eps - jnp.logaddexp(logvar1, logvar2 + LOG2))
    return -2.0 * logvar1 - logvar2 - 0.5 * log_a + quad


def inclusion_test(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array,
                   eps: float = 0.0) -> jax.Array:
    """H(Z1 in Z2) = inc(Z1->Z2) - inc(Z2->Z1) (ProLIP eq. 4), per dimension: > 0 iff included."""
    return log_inclusion(mu1, logvar1, mu2, logvar2, eps) - log_inclusion(mu2, logvar2, mu1, logvar1, eps)


def inclusion_test_pairwise(mu1: jax.Array, logvar1: jax.Array, mu2: jax.Array, logvar2: jax.Array,
                            eps: float = 0.0) -> jax.Array:
    """[N, M] H summed over D for every pair (the reference's `inclusion_test_batchwise`)."""
    return jnp.sum(inclusion_test(mu1[:, None], logvar1[:, None], mu2[None], logvar2[None], eps), -1)
