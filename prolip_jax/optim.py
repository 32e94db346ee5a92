"""The optimiser: AdamW with the reference's decay mask and warm-up + cosine schedule (REFERENCE §5).

Reference (src/prolip_train/main.py, scheduler.py): AdamW(lr 5e-4, betas (0.9, 0.95), eps 1e-6,
wd 0.2) excluding parameters with ndim < 2 or whose name contains "bn", "ln", "bias" or
"logit_scale"; lr = base * (step + 1) / warmup during warm-up, then a cosine to 0; no gradient
clipping by default; `logit_scale` clamped to [0, ln 100] after every step.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax

NO_DECAY_SUBSTRINGS = ("bn", "ln", "bias", "logit_scale")
MAX_LOGIT_SCALE = math.log(100.0)


def warmup_cosine(base_lr: float, warmup_steps: int, total_steps: int, end_lr: float = 0.0) -> Callable:
    """The reference's `cosine_lr`: linear (step + 1) / warmup, then cosine from base_lr to end_lr."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    decay_steps = max(total_steps - warmup_steps, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = base_lr * (step + 1.0) / max(warmup_steps, 1)
        progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
        cos = end_lr + 0.5 * (1.0 + jnp.cos(jnp.pi * progress)) * (base_lr - end_lr)
        return jnp.where(step < warmup_steps, warm, cos)

    return schedule


def decay_mask(params: Any) -> Any:
    """True where weight decay applies (the reference's exclusion rule on the '/'-joined path)."""
    def decays(path, leaf) -> bool:
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return leaf.ndim >= 2 and not any(s in name for s in NO_DECAY_SUBSTRINGS)

    return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(config: Mapping[str, Any], total_steps: int) -> tuple[optax.GradientTransformation, Callable]:
    """(optax transformation, lr schedule) from `config.optim` (see configs/)."""
    schedule = warmup_cosine(config["lr"], config["warmup_steps"], total_steps, config.get("end_lr", 0.0))
    parts = []
    if config.get("clip_norm"):
        parts.append(optax.clip_by_global_norm(config["clip_norm"]))
    parts += [
        optax.scale_by_adam(b1=config["b1"], b2=config["b2"], eps=config["eps"]),
        # Decoupled decay as torch.optim.AdamW: p -= lr * wd * p (the mask is static, by name).
        optax.add_decayed_weights(config["weight_decay"], mask=decay_mask),
        optax.scale_by_learning_rate(schedule),
    ]
    return optax.chain(*parts), schedule


def clamp_logit_scale(params: dict) -> dict:
    """`logit_scale.clamp_(0, ln 100)` after each optimiser step (REFERENCE §2.1)."""
    return {**params, "logit_scale": jnp.clip(params["logit_scale"], 0.0, MAX_LOGIT_SCALE)}
