"""Uncertainty-based prompt selection for zero-shot classification (paper §3.4 and Table 3 rows
"Filtering by sigma stats" and "Top-K prompts"; PCME++ C.6; the reference's
src/analysis/unc_zeroshot_prompts.py, naver-ai/prolip src/prolip/zero_shot_classifier.py "other filters").

Per class c and template t the prompt uncertainty is u_{c,t} = sum_d sigma^2_{c,t,d}. A
selection keeps a subset S_c of templates per class; the class embedding is then the usual
ensemble over S_c only: mu_c = normalise(mean_{t in S_c} mu_{c,t}), sigma^2_c = mean_{t in S_c}
sigma^2_{c,t} (evaluators.zeroshot.class_embeddings restricted to S_c). Kinds (keep u <= tau):

  sigma_filter  tau_c = mean_t u_{c,t} + coeff * std_t u_{c,t}   (`by_std_values_per_class`;
                std with Bessel's correction, torch.std's default)
  topk          tau_c = the k-th smallest u_{c,t}: the k least uncertain templates of the class
                (`by_ranking`; ties at tau_c are kept, so a class may keep more than k)
  global_topn   tau = the n-th smallest u over all classes' prompts  (`by_std_values_all`)
  threshold     tau = value                                            (`by_abs_value`)

A class whose S_c would be empty keeps its least uncertain template(s) (as the reference).
Settings are dicts, e.g. dict(kind="sigma_filter", coeff=0.0) or dict(kind="topk", k=10), or
strings "sigma_filter:0", "topk:10", "global_topn:5000", "threshold:0.05".
"""
from __future__ import annotations

from typing import Any

import numpy as np

KINDS = {"sigma_filter": "coeff", "topk": "k", "global_topn": "n", "threshold": "value"}


def parse(setting: Any) -> tuple[str, float]:
    """A setting -> (kind, parameter); a ValueError naming the kinds otherwise."""
    if isinstance(setting, str):
        kind, _, value = setting.partition(":")
        params = {KINDS.get(kind, "_"): value} if value else {}
    else:
        setting = dict(setting)
        kind = setting.pop("kind", None)
        params = setting
    if kind not in KINDS:
        raise ValueError(f"unknown prompt selection {setting!r}; kinds: {sorted(KINDS)} "
                         "(e.g. dict(kind='topk', k=10) or 'sigma_filter:0')")
    key = KINDS[kind]
    if set(params) != {key}:
        raise ValueError(f"prompt selection {kind!r} takes exactly one parameter {key!r}, got "
                         f"{sorted(params)}")
    value = float(params[key])
    if kind in ("topk", "global_topn"):
        if value < 1 or value != int(value):
            raise ValueError(f"prompt selection {kind}: {key} must be an integer >= 1")
    return kind, value


def label(setting: Any) -> str:
    """Metric-name label: "sigma_filter_0", "topk_10", ..."""
    kind, value = parse(setting)
    return f"{kind}_{value:g}".replace("-", "m")


def select(prompt_unc: np.ndarray, setting: Any) -> np.ndarray:
    """bool [C, T] mask of kept templates from the prompt uncertainties u [C, T]."""
    u = np.asarray(prompt_unc, np.float64)
    kind, value = parse(setting)
    if kind == "sigma_filter":
        std = u.std(1, ddof=1, keepdims=True) if u.shape[1] > 1 else np.zeros((len(u), 1))
        tau = u.mean(1, keepdims=True) + value * std
    elif kind == "topk":
        tau = np.sort(u, 1)[:, min(int(value), u.shape[1]) - 1][:, None]
    elif kind == "global_topn":
        tau = np.sort(u.ravel())[min(int(value), u.size) - 1]
    else:
        tau = value
    keep = u <= tau
    empty = ~keep.any(1)
    keep[empty] = u[empty] == u[empty].min(1, keepdims=True)   # the least uncertain template(s)
    return keep


def selected_classifier(text_mu: np.ndarray, text_sigma2: np.ndarray, keep: np.ndarray
                        ) -> tuple[np.ndarray, np.ndarray]:
    """text_mu, text_sigma2 [C, T, D], keep bool [C, T] -> (class mu [C, D] = normalise(mean of
    the kept mu), class sigma^2 [C, D] = mean of the kept sigma^2)."""
    w = keep.astype(np.float64)[..., None]
    mu = (np.asarray(text_mu, np.float64) * w).sum(1) / w.sum(1)
    mu /= np.maximum(np.linalg.norm(mu, axis=-1, keepdims=True), 1e-12)
    s2 = (np.asarray(text_sigma2, np.float64) * w).sum(1) / w.sum(1)
    return mu, s2
