"""The optimiser: AdamW with the reference's decay mask and warm-up + cosine schedule (naver-ai/prolip scripts/*.sh and src/prolip_train/params.py),
plus the fine-tuning controls of issue 12 (locked parameters, per-group lr / weight decay, layer-wise
lr decay) and the pieces of the seed papers' COCO recipes (AdamP, a step schedule, weight averaging).

Reference (src/prolip_train/main.py, scheduler.py): AdamW(lr 5e-4, betas (0.9, 0.95), eps 1e-6,
wd 0.2) excluding parameters with ndim < 2 or whose name contains "bn", "ln", "bias" or
"logit_scale"; lr = base * (step + 1) / warmup during warm-up, then a cosine to 0; no gradient
clipping by default; `logit_scale` clamped to [0, ln 100] after every step.

Fine-tuning controls (fields of `OptimConfig`, `config.optim`, checked by its `validate`).
Patterns are Python regular expressions searched (`re.search`) in the '/'-joined parameter path, e.g.
`visual/transformer/resblocks_3/attn/query_kernel`, `text/token_embedding`, `logit_scale`.
- locked: patterns of parameters that are not trained: they get no optimiser state (no Adam moments)
  and their update is exactly zero. `^visual/` locks the image tower (LiT).
- unlock_step: with `locked`, the locked parameters become trainable at this global step (0: never).
  The trainer rebuilds the optimiser at that step (make_optimizer(..., step=unlock_step)) and moves
  the state over with `transfer_state`: the parameters trained so far keep their Adam moments and
  count, the unlocked ones start from zero moments with their own Adam count (as a PyTorch
  parameter whose optimiser state is created on its first gradient), and the lr schedule goes on
  by the global update count.
- groups: dicts `dict(pattern=..., lr_mult=..., weight_decay=...)`; the first group whose pattern
  matches a parameter sets its lr multiplier and weight decay (missing keys: lr_mult 1, the base
  weight_decay). The reference decay mask still applies inside a group: biases, norms, 1-D
  parameters and logit_scale never decay, whatever the group's weight_decay.
- layer_decay: layer-wise lr decay d per tower (BEiT / timm `param_groups_layer_decay`, EVA-CLIP's
  CLIP variant): in a tower with L blocks, block i gets d^(L - i), the stem (patch / token /
  positional embeddings, [CLS] / [UNC] tokens, ln_pre) d^(L + 1), everything after the blocks
  (final norms, projections, heads) and parameters outside the towers (logit_scale, logit_bias) 1.
  It multiplies the group multiplier.
- unlock_warmup_steps: with unlock_step, the lr of the parameters that unlock ramps linearly from 0
  over this many steps from unlock_step: x (step - unlock_step + 1) / unlock_warmup_steps, like the
  reference's warm-up (PCME++ §3.1 / App. B.2: the visual backbone frozen for 2 epochs, then "a linear LR
  warmup during the first epoch after unfreezing"). 0: none.
- unlock_warmup_form: what that warm-up ramps. "lr" (above, the paper's words) or "loss": the whole
  loss, hence every parameter's gradient before clipping and the optimiser, is multiplied by
  (step - unlock_step + 1) / unlock_warmup_steps over those steps, as the code of PCME++
  (naver-ai/pcmepp pcmepp/engine.py: `embedding_warmup_after_freeze`, loss x (batch_idx + 1) /
  num_training_batches in epoch `embedding_warmup_epochs` 2, the first after the 2-epoch freeze)
  and of VSE∞ (woodfrog/vse_infty train.py: loss x i / num_loader_iter, i from 0, in epoch
  `embedding_warmup_epochs`) do. Under Adam(P) that is not an lr warm-up: a fresh parameter's
  first steps are full-size (m and sqrt(v) scale alike); parameters with older, larger second
  moments get smaller steps until v adapts. See `scale_by_loss_ramp`.
Decoupled weight decay follows torch's AdamW per parameter group: p -= lr * lr_mult * wd * p.

Recipes of the COCO seed papers (PCME++ App. B.2 / Table B.1, Pishdad et al. §4.2,
DAA §5.2); fields of `config.optim`, defaults in OptimConfig:
- name: "adamw" (the default, above) or "adamp": AdamP (Heo et al., ICLR 2021; clovaai/AdamP
  `adamp.py`), the optimiser of PCME++ and DAA; see `scale_by_adamp`. adamp_delta (0.1),
  adamp_wd_ratio (0.1) and adamp_nesterov (False) are its delta, wd_ratio and nesterov. It composes
  with everything above: the decay mask and group weight decays (scaled by wd_ratio where the
  projection applies), lr multipliers, locking, clipping (before it, as torch's clip_grad_norm_).
- schedule: "warmup_cosine" (the reference's) or "step": after the same linear warm-up, the base lr
  multiplied by step_factor (0.1) at each of step_boundaries: global steps (ints) or fractions of
  total_steps (floats in (0, 1)). PCME++: constant, x0.1 for the last 10 of 25 epochs (0.6);
  Pishdad et al.: /10 at epoch 15 of 30 (0.5).
  "cosine_phases": DAA's two phases (DAA §5.2; its code's train_coco.py, engine/trainer.py,
  optimizers/__init__.py, config/coco/pcme_coco.yaml): see `warmup_cosine_phases`. A cosine of
  period cosine_steps (torch's CosineAnnealingLR T_max, going on past it), restarted from its top
  at each of step_boundaries with the base lr x step_factor^k, the linear warm-up in front.
- swa_start_step, swa_every_steps: stochastic weight averaging (PCME++ App. B.3; its code:
  swa_start_epoch 16, swa_per_epochs 1). The parameters after n updates, for n = swa_start_step,
  swa_start_step + swa_every_steps, ..., are averaged with equal weights (torch.optim.swa_utils'
  running mean) in the optimiser state, so a checkpoint holds the average and a resume goes on with
  it; `swa_params(opt_state)` returns it and the number of snapshots. swa_every_steps 0: off.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Literal, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax
import optax.tree_utils as otu

from prolip_jax.runtime import schema

NO_DECAY_SUBSTRINGS = ("bn", "ln", "bias", "logit_scale")
MAX_LOGIT_SCALE = math.log(100.0)



@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """`config.optim`. Defaults: the reference's B/16 DataComp recipe (naver-ai/prolip scripts/*.sh and src/prolip_train/params.py)."""

    lr: float = 5e-4
    warmup_steps: int = 10_000
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-6
    weight_decay: float = 0.2
    clip_norm: float = 0.0  # global-norm clipping; 0 = none (the reference clips nothing)
    end_lr: float = 0.0  # where the cosine ends
    # Fine-tuning controls (module docstring); the defaults train everything with one AdamW.
    locked: Any = ()  # a pattern or a tuple of patterns
    unlock_step: int = 0
    groups: Any = ()  # dicts of GROUP_KEYS
    layer_decay: float = 1.0
    unlock_warmup_steps: int = 0  # linear lr warm-up of the parameters that unlock at unlock_step
    unlock_warmup_form: Literal["lr", "loss"] = "lr"  # what unlock_warmup_steps ramps (module docstring)
    # The COCO recipes of the seed papers (module docstring); the defaults are the reference's.
    name: Literal["adamw", "adamp"] = "adamw"
    adamp_delta: float = 0.1  # AdamP's delta (clovaai/AdamP adamp.py default)
    adamp_wd_ratio: float = 0.1  # AdamP's wd_ratio: weight decay x this where the projection applies
    adamp_nesterov: bool = False
    schedule: Literal["warmup_cosine", "step", "cosine_phases"] = "warmup_cosine"
    step_boundaries: tuple[int | float, ...] = ()  # "step" / "cosine_phases": global steps, or fractions of total_steps
    step_factor: float = 0.1  # "step" / "cosine_phases": the lr multiplier at each boundary
    cosine_steps: int = 0  # "cosine_phases": the cosine's period T_max in steps (warmup_cosine_phases)
    swa_start_step: int = 0  # the first averaged parameters: those after this many updates
    swa_every_steps: int = 0  # then every this many updates; 0: no weight averaging

    @classmethod
    def of(cls, section: Mapping[str, Any] | None) -> "OptimConfig":
        """`config.optim` (a ConfigDict or a dict; missing fields take their defaults), typed and
        checked: what the trainer does once at start-up, for callers that hold a dict."""
        return schema.parse(cls, section, "config.optim")

    @property
    def lock(self) -> tuple[str, ...]:
        """`locked` as a tuple of patterns."""
        return (self.locked,) if isinstance(self.locked, str) else tuple(self.locked or ())

    @property
    def finetuning(self) -> bool:
        """Whether any fine-tuning control is set (they need the parameter tree)."""
        return bool(self.lock or self.groups or self.layer_decay != 1.0)

    def with_layout_of(self, saved: "OptimConfig") -> "OptimConfig":
        """This config with the LAYOUT_FIELDS of `saved` (a checkpoint's recorded `optim`): the
        optimiser whose state layout that checkpoint has."""
        return OptimConfig.of({**dataclasses.asdict(self), **{k: getattr(saved, k) for k in LAYOUT_FIELDS}})

    def validate(self) -> None:
        """One-line ValueErrors naming the field (schema.parse has checked types and choices)."""
        if self.lr < 0 or self.warmup_steps < 0:
            raise ValueError(f"config.optim.lr and warmup_steps must be >= 0, got {self.lr}, {self.warmup_steps}")
        self._validate_finetuning()
        self._validate_recipe()

    def _validate_finetuning(self) -> None:
        for p in self.lock:
            _compile(p, "optim.locked")
        unlock_step = self.unlock_step
        if isinstance(unlock_step, bool) or not isinstance(unlock_step, int) or unlock_step < 0:
            raise ValueError(f"optim.unlock_step must be an integer >= 0 (0: never unlock), got {unlock_step!r}")
        if unlock_step and not self.lock:
            raise ValueError(f"optim.unlock_step={unlock_step} has no effect without optim.locked patterns")
        for i, g in enumerate(self.groups or ()):
            if not isinstance(g, Mapping):
                raise ValueError(f"optim.groups[{i}] must be a dict(pattern=..., lr_mult=..., weight_decay=...), got {g!r}")
            unknown = sorted(set(g) - set(GROUP_KEYS))
            if unknown or "pattern" not in g:
                raise ValueError(f"optim.groups[{i}] has keys {sorted(g)}; expected 'pattern' and optionally "
                                 f"'lr_mult', 'weight_decay'")
            _compile(g["pattern"], f"optim.groups[{i}].pattern")
            for key in ("lr_mult", "weight_decay"):
                v = g.get(key)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0
                                      or math.isinf(v)):
                    raise ValueError(f"optim.groups[{i}].{key} must be a finite number >= 0, got {v!r}")
        d = self.layer_decay
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < d < math.inf:
            raise ValueError(f"optim.layer_decay must be a number > 0 (1: no layer-wise decay), got {d!r}")

    def _validate_recipe(self) -> None:
        for key in ("unlock_warmup_steps", "swa_start_step", "swa_every_steps", "cosine_steps"):
            if not _is_int(getattr(self, key)) or getattr(self, key) < 0:
                raise ValueError(f"optim.{key} must be an integer >= 0, got {getattr(self, key)!r}")
        if self.unlock_warmup_steps and not self.unlock_step:
            raise ValueError(f"optim.unlock_warmup_steps={self.unlock_warmup_steps} has no effect without "
                             f"optim.unlock_step (and optim.locked)")
        if self.unlock_warmup_form != "lr" and not self.unlock_warmup_steps:
            raise ValueError(f"optim.unlock_warmup_form={self.unlock_warmup_form!r} has no effect without "
                             f"optim.unlock_warmup_steps")
        if not _is_number(self.adamp_delta) or self.adamp_delta <= 0:
            raise ValueError(f"optim.adamp_delta must be a finite number > 0, got {self.adamp_delta!r}")
        if not _is_number(self.adamp_wd_ratio) or self.adamp_wd_ratio < 0:
            raise ValueError(f"optim.adamp_wd_ratio must be a finite number >= 0, got {self.adamp_wd_ratio!r}")
        if self.adamp_nesterov and self.name != "adamp":
            raise ValueError(f"optim.adamp_nesterov=True has no effect with optim.name={self.name!r}")
        if (self.schedule == "cosine_phases") != (self.cosine_steps > 0):
            raise ValueError(f"optim.cosine_steps={self.cosine_steps} goes with optim.schedule='cosine_phases' "
                             f"(its cosine's period, > 0) and only with it; got optim.schedule={self.schedule!r}")
        bounds = self.step_boundaries
        for b in bounds:
            if not ((_is_int(b) and b > 0) or (isinstance(b, float) and 0.0 < b < 1.0)):
                raise ValueError(f"optim.step_boundaries must hold global steps (integers > 0) or fractions of "
                                 f"total_steps (floats in (0, 1)), got {list(bounds)!r}")
        if bounds and self.schedule not in ("step", "cosine_phases"):
            raise ValueError(f"optim.step_boundaries={list(bounds)} has no effect with optim.schedule={self.schedule!r}")
        if not _is_number(self.step_factor) or self.step_factor <= 0:
            raise ValueError(f"optim.step_factor must be a finite number > 0, got {self.step_factor!r}")
        if self.swa_start_step and not self.swa_every_steps:
            raise ValueError(f"optim.swa_start_step={self.swa_start_step} has no effect without optim.swa_every_steps")


GROUP_KEYS = ("pattern", "lr_mult", "weight_decay")
# The fields a checkpoint's optimiser state layout depends on (locked, unlock_step, groups,
# layer_decay, name, swa_every_steps), and the ones that must come with them for the merged
# config to validate: a checkpoint saved under other fine-tuning controls is restored in its own
# layout (OptimConfig.with_layout_of), then its Adam moments move over (transfer_state).
LAYOUT_FIELDS = ("locked", "unlock_step", "groups", "layer_decay", "unlock_warmup_steps", "unlock_warmup_form",
                 "name", "adamp_delta", "adamp_wd_ratio", "adamp_nesterov", "schedule", "step_boundaries",
                 "step_factor", "cosine_steps", "swa_start_step", "swa_every_steps")

# Parameters before the first transformer block of a tower (layer-wise lr decay's "layer 0").
STEM_NAMES = frozenset({"patch_kernel", "patch_bias", "positional_embedding", "class_embedding",
                        "unc_embedding", "ln_pre", "token_embedding", "cls_emb", "unc_emb"})
_BLOCK = re.compile(r"^transformer/resblocks_(\d+)/")

# Labels of the Adam partition: trained from the start, trained since unlock_step, locked.
ADAM, ADAM_UNLOCKED, LOCKED = "adam", "adam_unlocked", "locked"


def _linear_warmup(base_lr: float, step: jax.Array, warmup_steps: int) -> jax.Array:
    """The reference's warm-up lr at `step` (below warmup_steps): base_lr (step + 1) / warmup_steps."""
    return base_lr * (jnp.asarray(step).astype(jnp.float32) + 1.0) / max(warmup_steps, 1)


def warmup_cosine(base_lr: float, warmup_steps: int, total_steps: int, end_lr: float = 0.0) -> Callable:
    """The reference's `cosine_lr`: linear (step + 1) / warmup, then cosine from base_lr to end_lr."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    decay_steps = max(total_steps - warmup_steps, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warm = _linear_warmup(base_lr, step, warmup_steps)
        progress = jnp.clip((step - warmup_steps) / decay_steps, 0.0, 1.0)
        cos = end_lr + 0.5 * (1.0 + jnp.cos(jnp.pi * progress)) * (base_lr - end_lr)
        return jnp.where(step < warmup_steps, warm, cos)

    return schedule


def warmup_step(base_lr: float, warmup_steps: int, boundaries: Sequence[int], factor: float) -> Callable:
    """The same linear warm-up, then base_lr x factor^(number of boundaries <= step): a step decay
    (torch MultiStepLR by update count; PCME++ and Pishdad et al. decay x0.1 at one boundary)."""
    bounds = jnp.asarray(sorted(boundaries), jnp.int32).reshape(-1)

    def schedule(step):
        step = jnp.asarray(step)
        warm = _linear_warmup(base_lr, step, warmup_steps)
        passed = jnp.sum(step >= bounds) if len(boundaries) else 0
        decayed = base_lr * jnp.power(jnp.float32(factor), passed)
        return jnp.where(step < warmup_steps, warm, decayed).astype(jnp.float32)

    return schedule


def warmup_cosine_phases(base_lr: float, warmup_steps: int, cosine_steps: int, boundaries: Sequence[int],
                         factor: float) -> Callable:
    """DAA's lr (its code: train_coco.py pretrain() then finetune(), engine/trainer.py
    gradual_warmup, torch CosineAnnealingLR stepped once per epoch), by update count.

    Phase k runs from boundary k (phase 0 from step 0) with t = step - its start and
    c(t) = 1 + cos(pi t / cosine_steps):
        lr = base_lr * factor^k * c(t) / n,
    n = 2, except on phase 0's first descent (t <= cosine_steps) after a warm-up, where
    n = c(warmup_steps - 1). Steps below warmup_steps: base_lr * (step + 1) / warmup_steps.
    Why: the code's finetune() multiplies the lr by finetune_lr_decay (0.1) and builds a new
    optimiser and a new CosineAnnealingLR(T_max 30 epochs) for its 40 epochs, so the cosine
    restarts from its top and, past T_max, rises again (torch's cosine is periodic: at epoch 39 of
    the phase the lr is back at 0.21 x its start). In pre-training gradual_warmup overwrites the
    lr of the first pretrain_warmup_epochs (3) epochs with base x (e + 1) / 3 while the
    scheduler's clock runs from 0; torch 1.9's CosineAnnealingLR is chainable (lr_t = lr_{t-1}
    c(t) / c(t - 1)), so from the last warm-up value, base, it goes on as base c(t) / c(W - 1)
    (until its reset branch at T_max + 1, after which it is base c(t) / 2 again). With one step
    per epoch this is the code's lr exactly; with many, the same curve without the code's
    per-epoch staircase."""
    if not 0 < cosine_steps or warmup_steps > cosine_steps:
        raise ValueError(f"optim.schedule='cosine_phases' needs 0 < optim.cosine_steps and optim.warmup_steps <= "
                         f"cosine_steps, got cosine_steps={cosine_steps}, warmup_steps={warmup_steps}")
    if boundaries and warmup_steps > min(boundaries):
        raise ValueError(f"optim.warmup_steps={warmup_steps} runs past the first of optim.step_boundaries "
                         f"(step {min(boundaries)}): the warm-up belongs to the first phase")
    bounds = jnp.asarray(sorted(boundaries), jnp.int32).reshape(-1)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), bounds])
    first_norm = 1.0 + math.cos(math.pi * max(warmup_steps - 1, 0) / cosine_steps)

    def schedule(step):
        step = jnp.asarray(step)
        phase = jnp.sum(step >= bounds) if len(boundaries) else jnp.int32(0)
        t = (step - starts[phase]).astype(jnp.float32)
        c = 1.0 + jnp.cos(jnp.pi * t / cosine_steps)
        norm = jnp.where((phase == 0) & (t <= cosine_steps), first_norm, 2.0)
        cos = base_lr * jnp.power(jnp.float32(factor), phase) * c / norm
        warm = _linear_warmup(base_lr, step, warmup_steps)
        return jnp.where(step < warmup_steps, warm, cos).astype(jnp.float32)

    return schedule


def boundary_steps(boundaries: Sequence[int | float], total_steps: int) -> tuple[int, ...]:
    """optim.step_boundaries as global steps: ints are steps, floats in (0, 1) fractions of total_steps."""
    steps = tuple(b if isinstance(b, int) else int(round(b * total_steps)) for b in boundaries)
    if any(s >= total_steps for s in steps) or any(b >= a for a, b in zip(steps[1:], steps)):
        raise ValueError(f"optim.step_boundaries {list(boundaries)} are steps {list(steps)} of total_steps="
                         f"{total_steps}; they must increase and stay below total_steps")
    return steps


def make_schedule(cfg: OptimConfig, total_steps: int) -> Callable:
    """The lr schedule of `config.optim` (optim.schedule)."""
    if total_steps <= 0:
        raise ValueError(f"total_steps must be positive, got {total_steps}")
    if cfg.schedule == "step":
        return warmup_step(cfg.lr, cfg.warmup_steps, boundary_steps(cfg.step_boundaries, total_steps), cfg.step_factor)
    if cfg.schedule == "cosine_phases":
        return warmup_cosine_phases(cfg.lr, cfg.warmup_steps, cfg.cosine_steps,
                                    boundary_steps(cfg.step_boundaries, total_steps), cfg.step_factor)
    return warmup_cosine(cfg.lr, cfg.warmup_steps, total_steps, cfg.end_lr)


# ------------------------------------------------------------------------------- paths
def _path_str(path) -> str:
    def key(k):
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    return "/".join(key(k) for k in path)


def _map_with_path(fn: Callable[[str, Any], Any], tree: Any) -> Any:
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(_path_str(p), x), tree)


def param_paths(params: Any) -> list[str]:
    """The '/'-joined paths of the leaves of `params` (arrays or ShapeDtypeStructs), in tree order."""
    return [_path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]


def _decays(path: str, leaf) -> bool:
    return len(leaf.shape) >= 2 and not any(s in path for s in NO_DECAY_SUBSTRINGS)


def decay_mask(params: Any) -> Any:
    """True where weight decay applies (the reference's exclusion rule on the '/'-joined path)."""
    return _map_with_path(_decays, params)


# ------------------------------------------------------------------------ config helpers
def _compile(pattern: Any, what: str) -> re.Pattern:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{what}: a pattern must be a non-empty string (a regular expression), got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{what}: {pattern!r} is not a valid regular expression ({e})") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_matches(pattern: str, paths: Sequence[str], what: str) -> None:
    if not any(re.search(pattern, p) for p in paths):
        examples = ", ".join(paths[:: max(len(paths) // 5, 1)][:5])
        raise ValueError(f"{what} pattern {pattern!r} matches no parameter (parameters look like: {examples})")


# --------------------------------------------------------------------- per-leaf settings
def _is_locked_by_pattern(cfg: OptimConfig, path: str) -> bool:
    return any(re.search(p, path) for p in cfg.lock)


def _phase_locks(cfg: OptimConfig, step: int) -> bool:
    """Whether the lock patterns are in force at global step `step`."""
    return bool(cfg.lock) and (cfg.unlock_step == 0 or step < cfg.unlock_step)


def rebuild_steps(cfg: OptimConfig) -> tuple[int, ...]:
    """Global steps at which the trainer must rebuild the optimiser (make_optimizer(..., step=s)
    and transfer_state): the unlock step, if any."""
    return (cfg.unlock_step,) if cfg.lock and cfg.unlock_step else ()


def trainable_mask(params: Any, cfg: OptimConfig, step: int = 0) -> Any:
    """Tree of bool like `params`: False for the parameters locked at global step `step`.

    The train step differentiates only the True leaves (see `partition`); works on abstract params."""
    paths = param_paths(params)
    for p in cfg.lock:
        _check_matches(p, paths, "optim.locked")
    if cfg.lock and all(_is_locked_by_pattern(cfg, p) for p in paths):
        raise ValueError(f"optim.locked {list(cfg.lock)} locks every parameter; nothing would be trained")
    locks = _phase_locks(cfg, step)
    return _map_with_path(lambda path, _: not (locks and _is_locked_by_pattern(cfg, path)), params)


def locked_paths(params: Any, cfg: OptimConfig, step: int = 0) -> list[str]:
    """The '/'-paths of the parameters locked at global step `step` (what the checkpoint records)."""
    mask = trainable_mask(params, cfg, step)
    return [p for p, trainable in zip(param_paths(params), jax.tree.leaves(mask)) if not trainable]


def layer_decay_multipliers(params: Any, layer_decay: float) -> Any:
    """Tree of float like `params`: the layer-wise lr multiplier of each leaf (1.0 everywhere if d = 1).

    A tower is a top-level entry with `transformer/resblocks_{i}` blocks; see the module docstring."""
    depth: dict[str, int] = {}  # tower -> number of blocks L
    for path in param_paths(params):
        tower, _, rest = path.partition("/")
        m = _BLOCK.match(rest + "/")
        if m:
            depth[tower] = max(depth.get(tower, 0), int(m.group(1)) + 1)

    def mult(path: str, _) -> float:
        tower, _, rest = path.partition("/")
        if tower not in depth or layer_decay == 1.0:
            return 1.0
        n = depth[tower]
        m = _BLOCK.match(rest + "/")
        if m:
            return layer_decay ** (n - int(m.group(1)))
        if rest.split("/")[0] in STEM_NAMES:
            return layer_decay ** (n + 1)
        return 1.0

    return _map_with_path(mult, params)


def _group_of(cfg: OptimConfig, path: str) -> Mapping[str, Any]:
    return next((g for g in cfg.groups if re.search(g["pattern"], path)), {})


def lr_multipliers(params: Any, cfg: OptimConfig) -> Any:
    """Tree of float like `params`: group lr_mult x layer-wise decay multiplier."""
    layer = jax.tree.leaves(layer_decay_multipliers(params, float(cfg.layer_decay)))
    mults = [float(_group_of(cfg, p).get("lr_mult", 1.0)) * m for p, m in zip(param_paths(params), layer)]
    return jax.tree.unflatten(jax.tree.structure(params), mults)


def weight_decays(params: Any, cfg: OptimConfig) -> Any:
    """Tree of float like `params`: the group's (or base) weight decay where the reference mask allows it, else 0."""
    base = float(cfg.weight_decay)
    return _map_with_path(
        lambda p, x: float(_group_of(cfg, p).get("weight_decay", base)) if _decays(p, x) else 0.0, params)


# -------------------------------------------------------------------------------- AdamP
def adamp_channel_axes(path: str, ndim: int) -> tuple[int, ...]:
    """The axes of a >= 2-D parameter that index AdamP's channels: the axes of torch's dim 0.

    clovaai/AdamP `_channel_view` is `x.view(x.size(0), -1)`: one channel per index of torch's first
    axis, the output unit of nn.Linear [out, in] and nn.Conv2d [out, in, kh, kw] weights (what a
    following BatchNorm normalises, the scale invariance AdamP detects, paper §3). Flax kernels keep
    the output axes last: Dense [in, out], Conv [kh, kw, in, out], the attention output
    [heads, head_dim, out] -> the last axis; the attention query/key/value kernels [in, heads,
    head_dim] -> (heads, head_dim), the rows of torch's in_proj_weight. Other tensors (embedding
    tables, positional embeddings, open_clip's raw x @ proj matrices) are stored as in torch
    (prolip_jax/core/convert.py copies them) -> axis 0. One deviation from the torch model: torch's packed
    in_proj_weight is one tensor, here three, so its layer-wise test runs per query/key/value."""
    name = path.rsplit("/", 1)[-1]
    if name.endswith("kernel"):
        if name in ("query_kernel", "key_kernel", "value_kernel"):
            return tuple(range(1, ndim))
        return (ndim - 1,)
    return (0,)


def _adamp_projection(p, grad, perturb, axes, delta: float, eps: float):
    """(perturb, projected?) of clovaai/AdamP `_projection`: the channel view first, then the layer
    view; the first whose largest |cos(grad, p)| is below delta / sqrt(view size) removes the radial
    component p_n (p_n . perturb) of the update in that view, p_n = p / (|p| + eps).

    Written as per-channel sums over the other axes (the layer's sums are the channels' summed)
    and one update, perturb - p (p . perturb) / (|p| + eps)^2 with the chosen view's |p|: the
    reference's maths without a transposed copy of each tensor per view, a smaller program (the
    PCME++ recipes' step is mostly optimiser)."""
    other = tuple(a for a in range(p.ndim) if a not in axes)  # summed in the channel view
    channel = {name: jnp.sum(x * y, axis=other, keepdims=True)
               for name, (x, y) in dict(pp=(p, p), gg=(grad, grad), pg=(p, grad), pu=(p, perturb)).items()}
    layer = {name: jnp.sum(v) for name, v in channel.items()}

    def test(s, size):
        # torch.nn.functional.cosine_similarity(x, y, dim=1, eps): x.y / (max(|x|, eps) max(|y|, eps))
        pn = jnp.sqrt(s["pp"])
        cos = jnp.abs(s["pg"]) / (jnp.maximum(pn, eps) * jnp.maximum(jnp.sqrt(s["gg"]), eps))
        return jnp.max(cos) < delta / math.sqrt(size), s["pu"] / jnp.square(pn + eps)

    hit_channel, coef_channel = test(channel, math.prod(p.shape[a] for a in other))
    hit_layer, coef_layer = test(layer, p.size)
    coef = jnp.where(hit_channel, coef_channel, coef_layer)
    done = hit_channel | hit_layer
    return jnp.where(done, perturb - p * coef, perturb), done


def scale_by_adamp(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, delta: float = 0.1,
                   wd_ratio: float = 0.1, nesterov: bool = False,
                   weight_decay: float | Callable[[str, Any], float] = 0.0) -> optax.GradientTransformation:
    """AdamP (Heo et al., ICLR 2021, Algorithm 2; clovaai/AdamP adamp.py `AdamP.step`) up to the
    learning rate: chain it with scale_by_learning_rate. Per parameter, with t the update count:
        m = b1 m + (1 - b1) g,  v = b2 v + (1 - b2) g^2
        perturb = m / (sqrt(v) / sqrt(1 - b2^t) + eps)      (nesterov: (b1 m + (1 - b1) g) instead of m)
        ndim > 1: perturb, projected = projection (see _adamp_projection);  r = wd_ratio if projected else 1
        update = perturb / (1 - b1^t) + wd * r * p
    so that x -lr it is the reference's `p *= 1 - lr wd r; p -= lr / (1 - b1^t) perturb`.
    weight_decay: a number, or a function (path, leaf) -> number per parameter ('/'-joined path).
    The state is optax's ScaleByAdamState, so state utilities (transfer_state, sharding) treat it as Adam's."""
    decay = weight_decay if callable(weight_decay) else (lambda path, x: weight_decay)

    def init(params):
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=otu.tree_zeros_like(params),
                                      nu=otu.tree_zeros_like(params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("AdamP needs the parameters: tx.update(grads, state, params)")
        count = optax.safe_increment(state.count)
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
        t = count.astype(jnp.float32)
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t

        def one(path, g, m, v, p):
            path = _path_str(path)
            denom = jnp.sqrt(v) / jnp.sqrt(bc2).astype(v.dtype) + eps
            perturb = ((b1 * m + (1 - b1) * g) if nesterov else m) / denom
            ratio = 1.0
            if p.ndim > 1:
                perturb, projected = _adamp_projection(p, g, perturb, adamp_channel_axes(path, p.ndim), delta, eps)
                ratio = jnp.where(projected, wd_ratio, 1.0)
            out = perturb / bc1.astype(perturb.dtype)
            wd = decay(path, p)
            return out + (wd * ratio) * p if wd else out

        new = jax.tree_util.tree_map_with_path(one, updates, mu, nu, params)
        return new, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


# ------------------------------------------------------------------------ weight averaging
class SWAState(NamedTuple):
    """Stochastic weight averaging: `mean` of the `n` snapshots taken so far; `count` updates seen."""
    count: jax.Array
    n: jax.Array
    mean: Any


def swa(start_step: int, every_steps: int) -> optax.GradientTransformation:
    """Averages the parameters after n updates for n = start_step, start_step + every_steps, ... (n >= 1).

    Last in the chain: it passes the updates through and takes the new parameters as the trainer
    makes them (apply_updates, then clamp_logit_scale). The mean is torch.optim.swa_utils'
    AveragedModel default: mean += (p - mean) / (n + 1), so snapshot k has weight 1 / n."""
    first = max(start_step, 1)

    def init(params):
        return SWAState(count=jnp.zeros([], jnp.int32), n=jnp.zeros([], jnp.int32), mean=otu.tree_zeros_like(params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("weight averaging needs the parameters: tx.update(grads, state, params)")
        count = optax.safe_increment(state.count)
        due = (count >= first) & ((count - start_step) % every_steps == 0)

        def snapshot():
            new = optax.apply_updates(params, updates)
            if isinstance(new, Mapping) and "logit_scale" in new:
                new = clamp_logit_scale(new)
            n = state.n + 1
            return jax.tree.map(lambda m, x: m + (x.astype(m.dtype) - m) / n.astype(m.dtype), state.mean, new), n

        mean, n = jax.lax.cond(due, snapshot, lambda: (state.mean, state.n))
        return updates, SWAState(count=count, n=n, mean=mean)

    return optax.GradientTransformation(init, update)


def _is_swa(x) -> bool:
    return isinstance(x, SWAState)


def swa_params(opt_state: Any) -> tuple[Any, jax.Array]:
    """(averaged parameters, number of snapshots averaged) held in a make_optimizer state (or a train
    state's opt_state) with optim.swa_every_steps > 0. While the number is 0 the average is zeros:
    use the parameters themselves then. Works under jit (the number is an array)."""
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=_is_swa) if _is_swa(s)]
    if not found:
        raise ValueError("this optimiser state keeps no weight average (optim.swa_every_steps is 0)")
    return found[0].mean, found[0].n


def _unlock_ramp(count: jax.Array, start: int, steps: int) -> jax.Array:
    """clip((count - start + 1) / steps, 0, 1): optim.unlock_warmup_steps' linear ramp at update `count`."""
    return jnp.clip((count - start + 1).astype(jnp.float32) / steps, 0.0, 1.0)


def _scale_by_lr_with_ramp(schedule: Callable, ramped: frozenset[str], start: int,
                           steps: int) -> optax.GradientTransformation:
    """scale_by_learning_rate(schedule) (the same state) with the leaves at `ramped` paths scaled
    further by clip((count - start + 1) / steps, 0, 1): optim.unlock_warmup_steps."""

    def update(updates, state, params=None):
        del params
        lr = schedule(state.count)
        ramp = _unlock_ramp(state.count, start, steps)

        def one(path, u):
            step_size = -lr * ramp if _path_str(path) in ramped else -lr
            return jnp.array(step_size, dtype=u.dtype) * u

        return (jax.tree_util.tree_map_with_path(one, updates),
                optax.ScaleByScheduleState(count=optax.safe_increment(state.count)))

    return optax.GradientTransformation(optax.scale_by_learning_rate(schedule).init, update)


def scale_by_loss_ramp(start: int, steps: int) -> optax.GradientTransformation:
    """Multiplies the gradients by clip((count - start + 1) / steps, 0, 1) from update `start`
    on (1 before it): a loss multiplied by that factor (optim.unlock_warmup_form "loss"). First in
    the chain, so clipping and Adam see the scaled gradients, as after torch's loss.backward().
    Its state is a schedule count (the global update count, carried by transfer_state)."""

    def update(updates, state, params=None):
        del params
        factor = jnp.where(state.count >= start, _unlock_ramp(state.count, start, steps), 1.0)
        return (jax.tree.map(lambda u: (factor * u).astype(u.dtype), updates),
                optax.ScaleByScheduleState(count=optax.safe_increment(state.count)))

    return optax.GradientTransformation(optax.scale_by_learning_rate(lambda _: 1.0).init, update)


# ---------------------------------------------------------------------------- optimiser
def make_optimizer(cfg: OptimConfig, total_steps: int, params: Any = None,
                   step: int = 0) -> tuple[optax.GradientTransformation, Callable]:
    """(optax transformation, lr schedule) from `config.optim` (see configs/ and the module docstring).

    Without fine-tuning controls this is the plain chain (clip?, adam, masked decay, lr schedule; same
    state layout). With them, `params` (arrays or `jax.eval_shape` shapes) is needed and the chain is
        clip_by_global_norm?                         (over all gradients; locked ones are zero)
        partition {adam, adam_unlocked: scale_by_adam, locked: set_to_zero}   <- the only state
        partition {scale<k>: add_decayed_weights(wd_k) + scale(lr_mult_k), locked: set_to_zero}
        scale_by_learning_rate(schedule)             (one schedule count: the global update count)
    for the phase of global step `step` (locked before optim.unlock_step, all trainable from it).
    optim.name "adamp": scale_by_adamp in place of scale_by_adam, with the (group) weight decay inside
    it (AdamP scales it by wd_ratio where it projects); the scale partitions only multiply by lr_mult.
    optim.unlock_warmup_steps: from unlock_step the lr stage ramps the unlocked parameters' lr, or
    (unlock_warmup_form "loss") scale_by_loss_ramp, first, scales every gradient.
    optim.swa_every_steps: swa(...) last (its state: the running average of the parameters)."""
    schedule = make_schedule(cfg, total_steps)
    parts = []
    if cfg.clip_norm:
        parts.append(optax.clip_by_global_norm(cfg.clip_norm))
    averaging = [swa(cfg.swa_start_step, cfg.swa_every_steps)] if cfg.swa_every_steps else []
    if not cfg.finetuning:
        wd = cfg.weight_decay
        if cfg.name == "adamp":
            parts += [_adam(cfg, lambda path, x: wd if _decays(path, x) else 0.0)]
        else:
            # Decoupled decay as torch.optim.AdamW: p -= lr * wd * p (the mask is static, by name).
            parts += [_adam(cfg), optax.add_decayed_weights(wd, mask=decay_mask)]
        parts += [optax.scale_by_learning_rate(schedule), *averaging]
        return optax.chain(*parts), schedule
    if params is None:
        raise ValueError("optim.locked / optim.groups / optim.layer_decay need the parameter tree: "
                         "make_optimizer(config, total_steps, params)")
    for i, g in enumerate(cfg.groups):
        _check_matches(g["pattern"], param_paths(params), f"optim.groups[{i}]")
    if cfg.unlock_warmup_steps and cfg.unlock_warmup_form == "loss":  # the code of PCME++ / VSE∞
        parts.insert(0, scale_by_loss_ramp(cfg.unlock_step, cfg.unlock_warmup_steps))  # in every phase: same layout
    return optax.chain(*parts, *_finetuning_stages(cfg, schedule, params, step), *averaging), schedule


def _adam(cfg: OptimConfig, weight_decay: float | Callable = 0.0) -> optax.GradientTransformation:
    """The Adam stage: optax's scale_by_adam, or scale_by_adamp (optim.name "adamp") with the
    weight decay inside it (AdamP scales it by wd_ratio where it projects)."""
    if cfg.name == "adamp":  # torch's AdamP defaults are (0.9, 0.999), 1e-8; the config's values are used
        return scale_by_adamp(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, delta=cfg.adamp_delta,
                              wd_ratio=cfg.adamp_wd_ratio, nesterov=cfg.adamp_nesterov, weight_decay=weight_decay)
    return optax.scale_by_adam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)


def _finetuning_stages(cfg: OptimConfig, schedule: Callable, params: Any,
                       step: int) -> list[optax.GradientTransformation]:
    """make_optimizer's chain after clipping when fine-tuning controls are set: the Adam partition,
    the per-group scale partition and the lr stage, for the phase of global step `step`."""
    adamp = cfg.name == "adamp"
    paths = param_paths(params)
    trainable = jax.tree.leaves(trainable_mask(params, cfg, step))
    # Adam state per partition: a parameter unlocked later gets its own Adam count, from 0.
    from_start = jax.tree.leaves(trainable_mask(params, cfg, 0))
    adam_labels = [LOCKED if not t else ADAM if s else ADAM_UNLOCKED for t, s in zip(trainable, from_start)]
    # Stateless per-leaf settings, one label per distinct (lr_mult, wd) pair; names stay checkpoint-safe.
    decays = jax.tree.leaves(weight_decays(params, cfg))
    settings = list(zip(jax.tree.leaves(lr_multipliers(params, cfg)), [0.0] * len(decays) if adamp else decays))
    distinct = sorted({s for s, t in zip(settings, trainable) if t})
    scale_labels = [f"scale{distinct.index(s)}" if t else LOCKED for s, t in zip(settings, trainable)]

    def scaling(mult: float, wd: float) -> optax.GradientTransformation:
        # Same operations, in the same order, as the plain chain: (adam + wd * p) * lr_mult, then * -lr.
        inner = ([optax.add_decayed_weights(wd)] if wd else []) + ([optax.scale(mult)] if mult != 1.0 else [])
        return optax.chain(*inner) if inner else optax.identity()

    treedef = jax.tree.structure(params)
    wd_of = dict(zip(paths, decays))
    adam_tx = {ADAM: _adam(cfg, lambda path, _: wd_of[path]), ADAM_UNLOCKED: _adam(cfg, lambda path, _: wd_of[path]),
               LOCKED: optax.set_to_zero()}
    scale_tx = {f"scale{k}": scaling(*s) for k, s in enumerate(distinct)} | {LOCKED: optax.set_to_zero()}
    unlocked = frozenset(p for p, label in zip(paths, adam_labels) if label == ADAM_UNLOCKED)
    if cfg.unlock_warmup_steps and unlocked and cfg.unlock_warmup_form == "lr":  # PCME++ App. B.2's words
        lr_stage = _scale_by_lr_with_ramp(schedule, unlocked, cfg.unlock_step, cfg.unlock_warmup_steps)
    else:
        lr_stage = optax.scale_by_learning_rate(schedule)
    return [
        optax.multi_transform({k: v for k, v in adam_tx.items() if k in adam_labels},
                              jax.tree.unflatten(treedef, adam_labels)),
        optax.multi_transform({k: v for k, v in scale_tx.items() if k in scale_labels},
                              jax.tree.unflatten(treedef, scale_labels)),
        lr_stage,
    ]


# ------------------------------------------------------------------ state utilities
def _is_masked(x) -> bool:
    return isinstance(x, optax.MaskedNode)


def _is_adam(x) -> bool:
    return isinstance(x, optax.ScaleByAdamState)


def _is_sched(x) -> bool:
    return isinstance(x, optax.ScaleByScheduleState)


def _present(tree: Any) -> dict[str, Any]:
    """path -> leaf of a params-like tree, skipping MaskedNode holes (parameters outside a partition)."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_masked)
    return {_path_str(p): x for p, x in flat if not _is_masked(x)}


def transfer_state(old_state: Any, new_tx: optax.GradientTransformation, params: Any) -> Any:
    """`new_tx.init(params)` carrying over what `old_state` (any make_optimizer state) knows.

    Adam moments move per parameter path (same shape only); a new Adam partition takes the largest
    count of the old partitions it draws from, or starts at 0 if it draws from none (parameters just
    unlocked). The schedule count is carried, so the lr goes on by the global update count. A weight
    average (optim.swa_every_steps) is carried whole: its count, number of snapshots and mean.
    Call it under jit (out_shardings from `tree_map_params`) or with concrete params."""
    old_adams = [s for s in jax.tree.leaves(old_state, is_leaf=_is_adam) if _is_adam(s)]
    old_moments = {}  # path -> (index in old_adams, mu, nu)
    for i, s in enumerate(old_adams):
        mu, nu = _present(s.mu), _present(s.nu)
        old_moments.update({p: (i, mu[p], nu[p]) for p in mu})
    old_sched = [s.count for s in jax.tree.leaves(old_state, is_leaf=_is_sched) if _is_sched(s)]
    old_swa = [s for s in jax.tree.leaves(old_state, is_leaf=_is_swa) if _is_swa(s)]

    def carry(node):
        if _is_adam(node):
            fresh = _present(node.mu)
            found = {p: old_moments[p] for p, x in fresh.items()
                     if p in old_moments and old_moments[p][1].shape == x.shape}
            if not found:
                return node

            def pick(i):
                return lambda path, x: x if _is_masked(x) or path not in found else found[path][i].astype(x.dtype)

            mu = jax.tree_util.tree_map_with_path(lambda p, x: pick(1)(_path_str(p), x), node.mu, is_leaf=_is_masked)
            nu = jax.tree_util.tree_map_with_path(lambda p, x: pick(2)(_path_str(p), x), node.nu, is_leaf=_is_masked)
            counts = [jnp.asarray(old_adams[i].count) for i in sorted({i for i, _, _ in found.values()})]
            count = functools.reduce(jnp.maximum, counts).astype(node.count.dtype)
            return node._replace(count=count, mu=mu, nu=nu)
        if _is_sched(node) and old_sched:
            return node._replace(count=jnp.asarray(old_sched[0]).astype(node.count.dtype))
        if _is_swa(node):
            if old_swa:  # the average so far, by parameter path (same shape only)
                old_mean = _present(old_swa[0].mean)
                mean = jax.tree_util.tree_map_with_path(
                    lambda p, x: old_mean[_path_str(p)].astype(x.dtype)
                    if _path_str(p) in old_mean and old_mean[_path_str(p)].shape == x.shape else x, node.mean)
                return node._replace(count=jnp.asarray(old_swa[0].count).astype(node.count.dtype),
                                     n=jnp.asarray(old_swa[0].n).astype(node.n.dtype), mean=mean)
            if old_sched:  # averaging switched on now: it counts global updates from here
                return node._replace(count=jnp.asarray(old_sched[0]).astype(node.count.dtype))
        return node

    return jax.tree.map(carry, new_tx.init(params), is_leaf=lambda x: _is_adam(x) or _is_sched(x) or _is_swa(x))


def tree_map_params(tx: optax.GradientTransformation, f: Callable, state: Any, *rest: Any,
                    transform_non_params: Callable | None = None) -> Any:
    """`optax.tree_map_params` for make_optimizer's states, partitioned ones included.

    In a multi_transform state each partition holds a copy of the parameter tree with MaskedNode
    holes where it does not own the parameter; optax's version then fails on the structure
    mismatch unless the holes are leaves that f passes through, which is what this does."""
    return optax.tree_map_params(tx, lambda v, *r: v if _is_masked(v) else f(v, *r), state, *rest,
                                 transform_non_params=transform_non_params, is_leaf=_is_masked)


def partition(tree: Any, mask: Any) -> tuple[Any, Any]:
    """(trainable, locked): two trees like `tree` with None where the other one holds the leaf."""
    trainable = jax.tree.map(lambda m, x: x if m else None, mask, tree)
    locked = jax.tree.map(lambda m, x: None if m else x, mask, tree)
    return trainable, locked


def combine(trainable: Any, locked: Any) -> Any:
    """Inverse of `partition`."""
    return jax.tree.map(lambda a, b: b if a is None else a, trainable, locked, is_leaf=lambda x: x is None)


def clamp_logit_scale(params: dict) -> dict:
    """`logit_scale.clamp_(0, ln 100)` after each optimiser step (naver-ai/prolip src/prolip/loss.py)."""
    return {**params, "logit_scale": jnp.clip(params["logit_scale"], 0.0, MAX_LOGIT_SCALE)}
