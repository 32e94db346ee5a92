"""The optimiser: AdamW with the reference's decay mask and warm-up + cosine schedule (REFERENCE §5),
plus the fine-tuning controls of issue 12 (locked parameters, per-group lr / weight decay, layer-wise
lr decay).

Reference (src/prolip_train/main.py, scheduler.py): AdamW(lr 5e-4, betas (0.9, 0.95), eps 1e-6,
wd 0.2) excluding parameters with ndim < 2 or whose name contains "bn", "ln", "bias" or
"logit_scale"; lr = base * (step + 1) / warmup during warm-up, then a cosine to 0; no gradient
clipping by default; `logit_scale` clamped to [0, ln 100] after every step.

Fine-tuning controls (fields of `config.optim`, defaults in FINETUNE_DEFAULTS). Patterns are Python
regular expressions searched (`re.search`) in the '/'-joined parameter path, e.g.
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
Decoupled weight decay follows torch's AdamW per parameter group: p -= lr * lr_mult * wd * p.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

NO_DECAY_SUBSTRINGS = ("bn", "ln", "bias", "logit_scale")
MAX_LOGIT_SCALE = math.log(100.0)



@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """`config.optim`. Defaults: the reference's B/16 DataComp recipe (REFERENCE §5)."""

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

    def validate(self) -> None:
        if self.lr < 0 or self.warmup_steps < 0:
            raise ValueError(f"config.optim.lr and warmup_steps must be >= 0, got {self.lr}, {self.warmup_steps}")
        finetune_config(dataclasses.asdict(self))


# The fine-tuning fields of `config.optim` and their defaults.
FINETUNE_DEFAULTS = {k: getattr(OptimConfig(), k) for k in ("locked", "unlock_step", "groups", "layer_decay")}
GROUP_KEYS = ("pattern", "lr_mult", "weight_decay")

# Parameters before the first transformer block of a tower (layer-wise lr decay's "layer 0").
STEM_NAMES = frozenset({"patch_kernel", "patch_bias", "positional_embedding", "class_embedding",
                        "unc_embedding", "ln_pre", "token_embedding", "cls_emb", "unc_emb"})
_BLOCK = re.compile(r"^transformer/resblocks_(\d+)/")

# Labels of the Adam partition: trained from the start, trained since unlock_step, locked.
ADAM, ADAM_UNLOCKED, LOCKED = "adam", "adam_unlocked", "locked"


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


# ------------------------------------------------------------------------ config parsing
class Finetune(NamedTuple):
    """The validated fine-tuning fields of `config.optim` (see FINETUNE_DEFAULTS)."""
    lock: tuple[str, ...]
    unlock_step: int
    groups: tuple[dict, ...]
    layer_decay: float

    @property
    def active(self) -> bool:
        return bool(self.lock or self.groups or self.layer_decay != 1.0)


def _plain(x):
    return x.to_dict() if hasattr(x, "to_dict") else x  # ml_collections.ConfigDict -> dict


def _compile(pattern: Any, what: str) -> re.Pattern:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"{what}: a pattern must be a non-empty string (a regular expression), got {pattern!r}")
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ValueError(f"{what}: {pattern!r} is not a valid regular expression ({e})") from None


def finetune_config(config: Mapping[str, Any]) -> Finetune:
    """The fine-tuning fields of `config` (missing ones take FINETUNE_DEFAULTS), checked; ValueError if bad."""
    c = {**FINETUNE_DEFAULTS, **{k: _plain(config[k]) for k in FINETUNE_DEFAULTS if k in config}}
    lock = (c["locked"],) if isinstance(c["locked"], str) else tuple(c["locked"] or ())
    for p in lock:
        _compile(p, "optim.locked")
    unlock_step = c["unlock_step"]
    if isinstance(unlock_step, bool) or not isinstance(unlock_step, int) or unlock_step < 0:
        raise ValueError(f"optim.unlock_step must be an integer >= 0 (0: never unlock), got {unlock_step!r}")
    if unlock_step and not lock:
        raise ValueError(f"optim.unlock_step={unlock_step} has no effect without optim.locked patterns")
    groups = []
    for i, g in enumerate(c["groups"] or ()):
        g = _plain(g)
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
        groups.append(dict(g))
    d = c["layer_decay"]
    if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0.0 < d < math.inf:
        raise ValueError(f"optim.layer_decay must be a number > 0 (1: no layer-wise decay), got {d!r}")
    return Finetune(lock, unlock_step, tuple(groups), float(d))


def _check_matches(pattern: str, paths: Sequence[str], what: str) -> None:
    if not any(re.search(pattern, p) for p in paths):
        examples = ", ".join(paths[:: max(len(paths) // 5, 1)][:5])
        raise ValueError(f"{what} pattern {pattern!r} matches no parameter (parameters look like: {examples})")


# --------------------------------------------------------------------- per-leaf settings
def _is_locked_by_pattern(ft: Finetune, path: str) -> bool:
    return any(re.search(p, path) for p in ft.lock)


def _phase_locks(ft: Finetune, step: int) -> bool:
    """Whether the lock patterns are in force at global step `step`."""
    return bool(ft.lock) and (ft.unlock_step == 0 or step < ft.unlock_step)


def rebuild_steps(config: Mapping[str, Any]) -> tuple[int, ...]:
    """Global steps at which the trainer must rebuild the optimiser (make_optimizer(..., step=s)
    and transfer_state): the unlock step, if any."""
    ft = finetune_config(config)
    return (ft.unlock_step,) if ft.lock and ft.unlock_step else ()


def trainable_mask(params: Any, config: Mapping[str, Any], step: int = 0) -> Any:
    """Tree of bool like `params`: False for the parameters locked at global step `step`.

    The train step differentiates only the True leaves (see `partition`); works on abstract params."""
    ft = finetune_config(config)
    paths = param_paths(params)
    for p in ft.lock:
        _check_matches(p, paths, "optim.locked")
    if ft.lock and all(_is_locked_by_pattern(ft, p) for p in paths):
        raise ValueError(f"optim.locked {list(ft.lock)} locks every parameter; nothing would be trained")
    locks = _phase_locks(ft, step)
    return _map_with_path(lambda path, _: not (locks and _is_locked_by_pattern(ft, path)), params)


def locked_paths(params: Any, config: Mapping[str, Any], step: int = 0) -> list[str]:
    """The '/'-paths of the parameters locked at global step `step` (what the checkpoint records)."""
    mask = trainable_mask(params, config, step)
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


def _group_of(ft: Finetune, path: str) -> dict:
    return next((g for g in ft.groups if re.search(g["pattern"], path)), {})


def lr_multipliers(params: Any, config: Mapping[str, Any]) -> Any:
    """Tree of float like `params`: group lr_mult x layer-wise decay multiplier."""
    ft = finetune_config(config)
    layer = jax.tree.leaves(layer_decay_multipliers(params, ft.layer_decay))
    mults = [float(_group_of(ft, p).get("lr_mult", 1.0)) * m for p, m in zip(param_paths(params), layer)]
    return jax.tree.unflatten(jax.tree.structure(params), mults)


def weight_decays(params: Any, config: Mapping[str, Any]) -> Any:
    """Tree of float like `params`: the group's (or base) weight decay where the reference mask allows it, else 0."""
    ft = finetune_config(config)
    base = float(config["weight_decay"])
    return _map_with_path(
        lambda p, x: float(_group_of(ft, p).get("weight_decay", base)) if _decays(p, x) else 0.0, params)


# ---------------------------------------------------------------------------- optimiser
def make_optimizer(config: Mapping[str, Any], total_steps: int, params: Any = None,
                   step: int = 0) -> tuple[optax.GradientTransformation, Callable]:
    """(optax transformation, lr schedule) from `config.optim` (see configs/ and the module docstring).

    Without fine-tuning controls this is today's chain (clip?, adam, masked decay, lr schedule; same
    state layout). With them, `params` (arrays or `jax.eval_shape` shapes) is needed and the chain is
        clip_by_global_norm?                         (over all gradients; locked ones are zero)
        partition {adam, adam_unlocked: scale_by_adam, locked: set_to_zero}   <- the only state
        partition {scale<k>: add_decayed_weights(wd_k) + scale(lr_mult_k), locked: set_to_zero}
        scale_by_learning_rate(schedule)             (one schedule count: the global update count)
    for the phase of global step `step` (locked before optim.unlock_step, all trainable from it)."""
    schedule = warmup_cosine(config["lr"], config["warmup_steps"], total_steps, config.get("end_lr", 0.0))
    ft = finetune_config(config)
    parts = []
    if config.get("clip_norm"):
        parts.append(optax.clip_by_global_norm(config["clip_norm"]))
    adam = lambda: optax.scale_by_adam(b1=config["b1"], b2=config["b2"], eps=config["eps"])  # noqa: E731
    if not ft.active:
        parts += [
            adam(),
            # Decoupled decay as torch.optim.AdamW: p -= lr * wd * p (the mask is static, by name).
            optax.add_decayed_weights(config["weight_decay"], mask=decay_mask),
            optax.scale_by_learning_rate(schedule),
        ]
        return optax.chain(*parts), schedule
    if params is None:
        raise ValueError("optim.locked / optim.groups / optim.layer_decay need the parameter tree: "
                         "make_optimizer(config, total_steps, params)")
    for i, g in enumerate(ft.groups):
        _check_matches(g["pattern"], param_paths(params), f"optim.groups[{i}]")

    trainable = jax.tree.leaves(trainable_mask(params, config, step))
    # Adam state per partition: a parameter unlocked later gets its own Adam count, from 0.
    from_start = jax.tree.leaves(trainable_mask(params, config, 0))
    adam_labels = [LOCKED if not t else ADAM if s else ADAM_UNLOCKED for t, s in zip(trainable, from_start)]
    # Stateless per-leaf settings, one label per distinct (lr_mult, wd) pair; names stay checkpoint-safe.
    settings = list(zip(jax.tree.leaves(lr_multipliers(params, config)),
                        jax.tree.leaves(weight_decays(params, config))))
    distinct = sorted({s for s, t in zip(settings, trainable) if t})
    scale_labels = [f"scale{distinct.index(s)}" if t else LOCKED for s, t in zip(settings, trainable)]

    def scaling(mult: float, wd: float) -> optax.GradientTransformation:
        # Same operations, in the same order, as the plain chain: (adam + wd * p) * lr_mult, then * -lr.
        inner = ([optax.add_decayed_weights(wd)] if wd else []) + ([optax.scale(mult)] if mult != 1.0 else [])
        return optax.chain(*inner) if inner else optax.identity()

    treedef = jax.tree.structure(params)
    adam_tx = {ADAM: adam(), ADAM_UNLOCKED: adam(), LOCKED: optax.set_to_zero()}
    scale_tx = {f"scale{k}": scaling(*s) for k, s in enumerate(distinct)} | {LOCKED: optax.set_to_zero()}
    parts += [
        optax.multi_transform({k: v for k, v in adam_tx.items() if k in adam_labels},
                              jax.tree.unflatten(treedef, adam_labels)),
        optax.multi_transform({k: v for k, v in scale_tx.items() if k in scale_labels},
                              jax.tree.unflatten(treedef, scale_labels)),
        optax.scale_by_learning_rate(schedule),
    ]
    return optax.chain(*parts), schedule


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
    unlocked). The schedule count is carried, so the lr goes on by the global update count.
    Call it under jit (out_shardings from `tree_map_params`) or with concrete params."""
    old_adams = [s for s in jax.tree.leaves(old_state, is_leaf=_is_adam) if _is_adam(s)]
    old_moments = {}  # path -> (index in old_adams, mu, nu)
    for i, s in enumerate(old_adams):
        mu, nu = _present(s.mu), _present(s.nu)
        old_moments.update({p: (i, mu[p], nu[p]) for p in mu})
    old_sched = [s.count for s in jax.tree.leaves(old_state, is_leaf=_is_sched) if _is_sched(s)]

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
        return node

    return jax.tree.map(carry, new_tx.init(params), is_leaf=lambda x: _is_adam(x) or _is_sched(x))


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
    """`logit_scale.clamp_(0, ln 100)` after each optimiser step (REFERENCE §2.1)."""
    return {**params, "logit_scale": jnp.clip(params["logit_scale"], 0.0, MAX_LOGIT_SCALE)}
