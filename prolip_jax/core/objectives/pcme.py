"""PCME (Chun et al. 2021) as DAA uses it (DAA §3 "Preliminaries"; DAA's criterions/probemb.py).

Each input is a Gaussian N(mu, sigma^2); J reparameterised samples z = mu + eps * sigma are drawn
per input (eps ~ N(0, I) from the `rng` argument, fresh every step). The match probability of an
image-caption pair is the Monte-Carlo mean over the J x J sample pairs (DAA eq. 3)

    p(m | v, t) = 1/J^2 sum_{j,j'} sig(s_jj'),   s = -a ||z_v^j - z_t^j'|| + b,

with the code's sigmoid sig(x) = e^x / (e^x + e^-x) = sigmoid(2x) and the code's distance
sqrt(sum (z_v - z_t)^2 + 1e-6). The loss is the soft-contrastive NLL (DAA eq. 2),
-log p for a matching pair and -log(1 - p) otherwise, computed as the code does in log space,
    -log p = log J^2 - logsumexp_k log sigmoid(2 s_k)   (= soft_contrastive_nll with m = +1),
and SUMMED over all B x B pairs (the code's reduction='sum'), once image-to-text and once
text-to-image. The two directions score the same B^2 pairs with the same distances, so they are
equal (in the code too); both are reported because the code adds both.

Targets: 0/1 targets (several captions of one image) are the code's m = +-1. A fractional target
t enters as the binary cross-entropy -(t log p + (1 - t) log(1 - p)) against the MC match
probability, which is the code's NLL at t in {0, 1}; so PCME accepts MSDA's soft labels
(SOFT_TARGETS), an extension the DAA code never exercises.

VIB (`vib_form`): "code" is probemb.py's `kl_divergence(samples.mean(1), logsigma)` summed over
B x D, where the network's `logsigma` is log sigma (the samples are mu + eps * exp(logsigma)) but
is plugged into the KL formula as if it were log sigma^2: with our log sigma^2 = `logvar` that is
-1/2 sum(1 + logvar/2 - mean_j(z_j)^2 - exp(logvar/2)) (the form PCME++ later fixed, see
prolip.vib_loss "reference"). "kl" is the exact KL(N(mu, sigma^2) || N(0, I)) summed over B x D.
Either is summed over the two modalities and weighted by `vib_beta`.

Uniformity (`uniform_lambda` > 0, probemb.py `uniform_loss`, Wang & Isola): log of the mean over
all pairs of the 2 B J image and caption samples of exp(-2 ||x - y||^2). The code subsamples 128
rows (with replacement) once (2BJ)^2 > 16384 to dodge a CUDA error; we use every pair.

Defaults are DAA's COCO config (config/coco/pcme_coco.yaml): J = 5 (PCME's own COCO config uses 7,
PCME++'s PCME baseline 8), vib_beta = 1e-5, no uniformity (its CUB config uses 10). The scale a and
shift b are the model's `logit_scale` / `logit_bias` (DAA and PCME initialise both to 15: set the
model's init_logit_scale = log 15, init_logit_bias = 15 to match).

Memory: the B x B x J x J sampled distances; one [B, J, D] sample tensor per modality.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp

NEEDS_LOGVAR = True
USES_MASKED = False
SOFT_TARGETS = True

DIST_EPS = 1e-6  # probemb.py batchwise_cdist: sqrt(sum(.)^2 + eps)
UNIFORM_T = 2.0  # probemb.py uniform_loss(t=2)


@dataclasses.dataclass(frozen=True)
class Config:
    num_samples: int = 5  # J, DAA's COCO config (DAA §5.2 "5 probabilistic samples")
    vib_beta: float = 1e-5  # DAA's COCO config
    vib_form: Literal["code", "kl"] = "code"
    uniform_lambda: float = 0.0  # DAA's COCO config (CUB: 10)

    def validate(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"config.loss.num_samples must be >= 1, got {self.num_samples}")
        for name in ("vib_beta", "uniform_lambda"):
            if getattr(self, name) < 0:
                raise ValueError(f"config.loss.{name} must be >= 0, got {getattr(self, name)}")


# ------------------------------------------------------------------------------------ sampling
def draw_eps(rng: jax.Array, batch_img: int, batch_txt: int, num_samples: int, dim: int,
             dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """eps ~ N(0, I) of shape [B, J, D] for images and captions (rng split in two, in that order).

    jax.random values do not depend on how the result is sharded, so neither does the loss."""
    k_img, k_txt = jax.random.split(rng)
    return (jax.random.normal(k_img, (batch_img, num_samples, dim), dtype),
            jax.random.normal(k_txt, (batch_txt, num_samples, dim), dtype))


def samples(mu: jax.Array, logvar: jax.Array, eps: jax.Array) -> jax.Array:
    """[B, J, D] reparameterised samples mu + eps * sigma, sigma = exp(logvar / 2)."""
    return mu[:, None, :] + eps * jnp.exp(0.5 * logvar)[:, None, :]


# ------------------------------------------------------------------------------ pair log-lik
def sampled_distance(zv: jax.Array, zt: jax.Array) -> jax.Array:
    """[B_img, B_txt, J, J] distances sqrt(||z_v - z_t||^2 + 1e-6) over all sample pairs.

    Expanded as |z_v|^2 + |z_t|^2 - 2 z_v.z_t (clamped at 0) instead of the code's explicit
    difference, which would need [B, B, J, J, D]."""
    dot = jnp.einsum("ajd,bkd->abjk", zv, zt)
    sq = jnp.sum(zv ** 2, -1)[:, None, :, None] + jnp.sum(zt ** 2, -1)[None, :, None, :] - 2.0 * dot
    return jnp.sqrt(jnp.maximum(sq, 0.0) + DIST_EPS)


def log_match_prob(dist: jax.Array, scale: jax.Array, shift: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(log p, log(1 - p)) [B_img, B_txt] of the MC match probability from [.., J, J] distances."""
    s = (-scale * dist + shift).reshape(dist.shape[:2] + (-1,))
    log_j2 = math.log(s.shape[-1])
    # sig(s) = e^s / (e^s + e^-s) = sigmoid(2s): the code's s*m - logsumexp(s, -s), m = +-1.
    log_p = jax.nn.logsumexp(jax.nn.log_sigmoid(2.0 * s), -1) - log_j2
    log_q = jax.nn.logsumexp(jax.nn.log_sigmoid(-2.0 * s), -1) - log_j2
    return log_p, log_q


def pair_nll(dist: jax.Array, scale: jax.Array, shift: jax.Array, targets: jax.Array | None = None
             ) -> jax.Array:
    """[B_img, B_txt] -(t log p + (1 - t) log(1 - p)); t = identity when targets is None."""
    log_p, log_q = log_match_prob(dist, scale, shift)
    if targets is None:
        targets = jnp.eye(log_p.shape[0], log_p.shape[1], dtype=log_p.dtype)
    targets = targets.astype(log_p.dtype)
    return -(targets * log_p + (1.0 - targets) * log_q)


def pcme_from_samples(zv: jax.Array, zt: jax.Array, scale: jax.Array, shift: jax.Array,
                      targets: jax.Array | None = None) -> dict[str, jax.Array]:
    """The code's i2t and t2i NLL, each summed over the B x B pairs (equal: same pairs)."""
    nll = jnp.sum(pair_nll(sampled_distance(zv, zt), scale, shift, targets))
    return {"i2t": nll, "t2i": nll}


# ------------------------------------------------------------------------------- regularisers
def vib(mu: jax.Array, logvar: jax.Array, z: jax.Array, form: str = "code") -> jax.Array:
    """VIB of one modality, summed over B x D (see the module docstring for the two forms)."""
    if form == "code":
        half = 0.5 * logvar
        return -0.5 * jnp.sum(1.0 + half - jnp.mean(z, 1) ** 2 - jnp.exp(half))
    if form == "kl":
        return -0.5 * jnp.sum(1.0 + logvar - mu ** 2 - jnp.exp(logvar))
    raise ValueError(f"unknown vib_form {form!r}; use 'code' or 'kl'")


def uniformity(x: jax.Array, t: float = UNIFORM_T) -> jax.Array:
    """log mean_{i<j} exp(-t ||x_i - x_j||^2) over the rows of x [N, D] (torch.pdist pairs)."""
    n = x.shape[0]
    sq = jnp.sum(x ** 2, -1)
    d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2.0 * x @ x.T, 0.0)
    upper = jnp.arange(n)[:, None] < jnp.arange(n)[None, :]
    total = jnp.sum(jnp.where(upper, jnp.exp(-t * d2), 0.0))
    return jnp.log(total / (n * (n - 1) / 2))


# ------------------------------------------------------------------------------------ objective
def sample_outputs(out, cfg: Config, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Image and caption samples [B, J, D] for this step."""
    if rng is None:
        raise ValueError("PCME samples its embeddings: pass a fresh `rng` every step")
    im, il, tm, tl = out["image_mean"], out["image_logvar"], out["text_mean"], out["text_logvar"]
    if il is None or tl is None:
        raise ValueError("PCME needs image_logvar and text_logvar (a probabilistic head on both towers)")
    eps_v, eps_t = draw_eps(rng, im.shape[0], tm.shape[0], cfg.num_samples, im.shape[-1], im.dtype)
    return samples(im, il, eps_v), samples(tm, tl, eps_t)


def terms_from_samples(out, cfg: Config, zv: jax.Array, zt: jax.Array, targets=None
                       ) -> dict[str, jax.Array]:
    """PCME's weighted terms given this step's samples (shared with pcme_daa / smooth_ap)."""
    terms = pcme_from_samples(zv, zt, out["logit_scale"], out["logit_bias"], targets)
    if cfg.vib_beta > 0:
        terms["vib"] = cfg.vib_beta * (vib(out["image_mean"], out["image_logvar"], zv, cfg.vib_form)
                                       + vib(out["text_mean"], out["text_logvar"], zt, cfg.vib_form))
    if cfg.uniform_lambda > 0:
        dim = zv.shape[-1]
        terms["uniform"] = cfg.uniform_lambda * uniformity(
            jnp.concatenate([zv.reshape(-1, dim), zt.reshape(-1, dim)]))
    return terms


def loss(out, cfg: Config, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None):
    zv, zt = sample_outputs(out, cfg, rng)
    terms = terms_from_samples(out, cfg, zv, zt, targets)
    return sum(terms.values()), terms
