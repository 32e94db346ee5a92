"""Bayesian Prompt Re-Weighting (BPRW; paper §3.4, A.8, C.7; naver-ai/prolip src/prolip/zero_shot_classifier.py).

Per class c the T prompt embeddings N(mu_{c,t}, diag sigma2_{c,t}) are treated as the known
components of a Gaussian mixture. Observations are K samples drawn from each of M image
Gaussians; EM with a Dirichlet(alpha) MAP M-step estimates the mixing weights pi_c [T]. The
re-weighted class embedding is `pi_c @ mu_{c,:}` (NOT re-normalised) with variance
`pi_c**2 @ sigma2_{c,:}`, scored by the reference's `100 dot - 50 sum(sigma2)` rule.

Two ways to pick the M images (naver-ai/prolip src/prolip/zero_shot_classifier.py step 1):
    "nn"       zero-shot: the M images nearest to mean_t(mu_{c,t})       (Table 3, K = 0)
    "fewshot"  M labelled images of class c, drawn with a seeded Generator (`--use_gt`)

Hyper-parameters use the reference's spec string `alpha-multiplier-NN-K-stable_eps-prior`:
    NN_SPEC = "5-1-10-10-0.02-inverse"       FEWSHOT_SPEC = "2-1-5-20-0.02-inverse"

Deliberate differences from the reference code: EM runs in float64 (tol = 1e-12 is below
float32 resolution, so the float32 reference effectively always runs 1000 iterations), all
classes at once, and the few-shot images are drawn at random per class (the reference indexes
`50 * c ... 50 * c + NN` into a list that only holds the first image of every batch of ten).

The evaluator is `evaluators.zeroshot.BPRWEvaluator` (registered as "prompt_reweighting"): the
zero-shot evaluator with BPRW switched on; this module is the algorithm alone.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Sequence

import numpy as np

from prolip_jax.runtime import schema

NN_SPEC = "5-1-10-10-0.02-inverse"
FEWSHOT_SPEC = "2-1-5-20-0.02-inverse"
PRIORS = ("uniform", "inverse", "inverse_sq", "inverse_5")


@dataclasses.dataclass(frozen=True)
class BPRWConfig:
    """alpha: Dirichlet concentration (> 1 smooths, < 1 sparsifies); multiplier: variance scale;
    num_images: M images per class ("NN"); num_samples: K samples per image; stable_eps: added
    to the text variances; prior: initial pi; use_gt: few-shot (labelled) instead of nearest."""
    alpha: float = 5.0
    multiplier: float = 1.0
    num_images: int = 10
    num_samples: int = 10
    stable_eps: float = 0.02
    prior: str = "inverse"
    use_gt: bool = False
    max_iter: int = 1000
    tol: float = 1e-12

    def __post_init__(self):
        if self.prior not in PRIORS:
            raise ValueError(f"unknown BPRW prior {self.prior!r}; known: {PRIORS}")
        if self.num_images < 1 or self.num_samples < 1:
            raise ValueError("BPRW needs num_images >= 1 and num_samples >= 1")

    @classmethod
    def from_spec(cls, spec: str, use_gt: bool = False, **kw: Any) -> "BPRWConfig":
        """'alpha-multiplier-NN-K-stable_eps-prior', e.g. '5-1-10-10-0.02-inverse'."""
        parts = spec.split("-")
        if len(parts) != 6:
            raise ValueError(f"BPRW spec {spec!r} is not 'alpha-multiplier-NN-K-stable_eps-prior'")
        return cls(alpha=float(parts[0]), multiplier=float(parts[1]), num_images=int(parts[2]),
                   num_samples=int(parts[3]), stable_eps=float(parts[4]), prior=parts[5],
                   use_gt=use_gt, **kw)

    @property
    def spec(self) -> str:
        return (f"{self.alpha:g}-{self.multiplier:g}-{self.num_images}-{self.num_samples}-"
                f"{self.stable_eps:g}-{self.prior}")


def initial_weights(variances: np.ndarray, prior: str) -> np.ndarray:
    """Initial pi [..., T] from the raw text variances [..., T, D] (paper Alg. 1 line 5)."""
    power = {"uniform": 0, "inverse": 1, "inverse_sq": 2, "inverse_5": 5}[prior]
    if power == 0:
        pi = np.ones(variances.shape[:-1])
    else:
        pi = 1.0 / np.mean(np.asarray(variances, np.float64) ** power, axis=-1)
    return pi / pi.sum(-1, keepdims=True)


def component_log_density(obs: np.ndarray, means: np.ndarray, variances: np.ndarray) -> np.ndarray:
    """log N(x_j; mu_t, diag var_t) for obs [C, M, D], means / variances [C, T, D] -> [C, M, T].

    Expanded as sum x^2/v - 2 x.(mu/v) + sum mu^2/v so that it is two batched matmuls.
    """
    obs, means, variances = (np.asarray(a, np.float64) for a in (obs, means, variances))
    inv = 1.0 / variances
    quad = (np.einsum("cmd,ctd->cmt", obs ** 2, inv) - 2.0 * np.einsum("cmd,ctd->cmt", obs, means * inv)
            + np.sum(means ** 2 * inv, -1)[:, None, :])
    log_det = -0.5 * np.sum(np.log(variances), -1) - 0.5 * obs.shape[-1] * np.log(2 * np.pi)
    return log_det[:, None, :] - 0.5 * quad


def estimate_mixing_proportions(obs: np.ndarray, means: np.ndarray, variances: np.ndarray,
                                alpha: float = 100.0, multiplier: float = 1.0,
                                stable_eps: float = 0.0, prior: str = "uniform",
                                tol: float = 1e-12, max_iter: int = 1000
                                ) -> tuple[np.ndarray, np.ndarray]:
    """EM for the weights of a mixture with known diagonal Gaussian components (paper A.8).

    obs [C, M, D] (or [M, D]), means / variances (sigma^2) [C, T, D] (or [T, D]).
    Returns (pi [C, T], iterations run [C]) (or [T], scalar). Semantics of the reference's
    `estimate_mixing_proportions` (naver-ai/prolip src/prolip/zero_shot_classifier.py step 3): pi starts from `prior` on the raw
    variances; the variances used are (var * multiplier + stable_eps) * multiplier (the
    reference multiplies twice); the M-step is the Dirichlet MAP
    pi = (N_t + alpha - 1) / (M + T (alpha - 1)), clamped at 0 and renormalised; a class stops
    when ||pi_new - pi|| < tol and then keeps the previous pi, as the reference returns it.
    """
    single = np.ndim(obs) == 2
    if single:
        obs, means, variances = obs[None], means[None], variances[None]
    variances = np.asarray(variances, np.float64)
    pi = initial_weights(variances, prior)                                   # [C, T]
    var = (variances * multiplier + stable_eps) * multiplier
    log_prob = component_log_density(obs, means, var)                        # [C, M, T]
    n_obs, n_comp = log_prob.shape[1], log_prob.shape[2]
    active = np.ones(len(pi), bool)
    iters = np.zeros(len(pi), np.int64)
    for _ in range(max_iter):
        idx = np.flatnonzero(active)
        if idx.size == 0:
            break
        with np.errstate(divide="ignore"):   # a weight clamped to 0 stays 0 (log 0 = -inf)
            lp = log_prob[idx] + np.log(pi[idx])[:, None, :]                 # E-step [c, M, T]
        lp -= lp.max(-1, keepdims=True)
        resp = np.exp(lp)
        resp /= resp.sum(-1, keepdims=True)
        nk = resp.sum(1)                                                     # M-step [c, T]
        new = np.clip((nk + alpha - 1.0) / (n_obs + n_comp * (alpha - 1.0)), 0.0, None)
        new /= new.sum(-1, keepdims=True)
        iters[idx] += 1
        done = np.linalg.norm(new - pi[idx], axis=-1) < tol
        pi[idx[~done]] = new[~done]
        active[idx[done]] = False
    return (pi[0], iters[0]) if single else (pi, iters)


def select_images(text_mu: np.ndarray, image_mu: np.ndarray, num_images: int,
                  labels: np.ndarray | None = None, rng: np.random.Generator | None = None
                  ) -> np.ndarray:
    """Image indices [C, M] per class (naver-ai/prolip src/prolip/zero_shot_classifier.py step 1).

    text_mu [C, T, D]; image_mu [N, D]. Without labels: the top-M images by
    mean_t(mu_{c,t}) . mu_img. With labels [N]: M labelled images of class c drawn without
    replacement by `rng` (all of them, repeated cyclically, when a class has fewer than M).
    """
    n_classes = text_mu.shape[0]
    if labels is None:
        sims = text_mu.mean(1) @ np.asarray(image_mu).T                      # [C, N]
        m = min(num_images, sims.shape[1])
        top = np.argpartition(-sims, m - 1, axis=1)[:, :m]
        order = np.argsort(-np.take_along_axis(sims, top, 1), axis=1, kind="stable")
        return np.take_along_axis(top, order, 1)
    rng = rng if rng is not None else np.random.default_rng(0)
    out = np.zeros((n_classes, num_images), np.int64)
    for c in range(n_classes):
        pool = np.flatnonzero(labels == c)
        if pool.size == 0:
            raise ValueError(f"few-shot BPRW: no labelled image of class {c}")
        pick = rng.permutation(pool)
        out[c] = np.resize(pick, num_images)
    return out


def sample_observations(image_mu: np.ndarray, image_logvar: np.ndarray, indices: np.ndarray,
                        num_samples: int, rng: np.random.Generator) -> np.ndarray:
    """K samples mu + eps * exp(logvar / 2) from each selected image: indices [C, M] ->
    observations [C, M * K, D] (naver-ai/prolip src/prolip/zero_shot_classifier.py step 2)."""
    mu = np.asarray(image_mu, np.float64)[indices]                          # [C, M, D]
    std = np.exp(np.asarray(image_logvar, np.float64)[indices] / 2.0)
    eps = rng.standard_normal((*indices.shape, num_samples, mu.shape[-1]))
    samples = mu[:, :, None, :] + eps * std[:, :, None, :]
    return samples.reshape(indices.shape[0], -1, mu.shape[-1])


def reweighted_classifier(weights: np.ndarray, text_mu: np.ndarray, text_sigma2: np.ndarray
                          ) -> tuple[np.ndarray, np.ndarray]:
    """weights [C, T], text mu / sigma^2 [C, T, D] -> (w @ mu [C, D] NOT re-normalised,
    w**2 @ sigma^2 [C, D]) (naver-ai/prolip src/prolip/zero_shot_classifier.py step 4)."""
    return (np.einsum("ct,ctd->cd", weights, text_mu),
            np.einsum("ct,ctd->cd", weights ** 2, text_sigma2))


def bprw_weights(text_mu: np.ndarray, text_sigma2: np.ndarray, image_mu: np.ndarray,
                 image_logvar: np.ndarray, config: BPRWConfig, labels: np.ndarray | None = None,
                 seed: int = 0, class_chunk: int = 64) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Learned prompt weights [C, T] (rows sum to 1) and {"iterations" [C], "images" [C, M]}.

    text_mu / text_sigma2 [C, T, D] (normalised mu, sigma^2 = exp(logvar)); image_mu /
    image_logvar [N, D]; labels [N] are required (and only used) when config.use_gt.
    Seeded: one numpy Generator draws the few-shot picks, then the samples class chunk by chunk.
    """
    if config.use_gt and labels is None:
        raise ValueError("few-shot BPRW (use_gt) needs image labels")
    rng = np.random.default_rng(seed)
    indices = select_images(text_mu, image_mu, config.num_images,
                            labels if config.use_gt else None, rng)
    weights = np.zeros(text_mu.shape[:2])
    iters = np.zeros(text_mu.shape[0], np.int64)
    for s in range(0, text_mu.shape[0], class_chunk):   # bounds the [c, M*K, D] samples
        sl = slice(s, s + class_chunk)
        obs = sample_observations(image_mu, image_logvar, indices[sl], config.num_samples, rng)
        weights[sl], iters[sl] = estimate_mixing_proportions(
            obs, text_mu[sl], text_sigma2[sl], alpha=config.alpha, multiplier=config.multiplier,
            stable_eps=config.stable_eps, prior=config.prior, tol=config.tol,
            max_iter=config.max_iter)
    return weights, {"iterations": iters, "images": indices}


def weight_stats(weights: np.ndarray) -> dict[str, float]:
    """Paper Fig. C.6 statistics: mean max_t pi_c, mean entropy of pi_c, and the uniform's."""
    p = np.clip(weights, 1e-300, None)
    ent = -np.sum(np.where(weights > 0, weights * np.log(p), 0.0), -1)
    return {"weight_max": float(weights.max(-1).mean()), "weight_entropy": float(ent.mean()),
            "uniform_entropy": float(np.log(weights.shape[-1]))}


def save_weights(out_dir: str, stem: str, weights: np.ndarray, classnames: Sequence[str],
                 templates: Sequence[str], config: BPRWConfig) -> tuple[str, str]:
    """Writes `<stem>.npy` (float32 [C, T]) and `<stem>.json` ({spec, config, classnames,
    templates, weights}); returns both paths."""
    os.makedirs(out_dir, exist_ok=True)
    npy, js = os.path.join(out_dir, stem + ".npy"), os.path.join(out_dir, stem + ".json")
    np.save(npy, weights.astype(np.float32))
    with open(js, "w") as f:
        json.dump({"spec": config.spec, "config": dataclasses.asdict(config),
                   "classnames": list(classnames), "templates": list(templates),
                   "weights": np.round(weights, 8).tolist()}, f)
    return npy, js


def parse_config(value: Any) -> BPRWConfig:
    """A BPRWConfig from a spec string, 'nn' / 'fewshot' presets, or a dict of its fields
    (a dict may also hold `spec`; an unknown field is an error naming the nearest one)."""
    if isinstance(value, BPRWConfig):
        return value
    if isinstance(value, str):
        presets = {"nn": (NN_SPEC, False), "fewshot": (FEWSHOT_SPEC, True)}
        spec, gt = presets.get(value, (value, False))
        return BPRWConfig.from_spec(spec, use_gt=gt)
    d = dict(value)
    where = "a BPRW setting (config.evals.<name>.bprw)"
    if "spec" in d:
        spec = d.pop("spec")
        schema.check_keys(d, schema.fields(BPRWConfig), where)
        return BPRWConfig.from_spec(spec, **d)
    return schema.parse(BPRWConfig, d, where)
