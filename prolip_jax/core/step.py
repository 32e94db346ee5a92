"""The train state, its sharded initialisation and the jitted ProLIP train step.

One step (paper §3.3, naver-ai/prolip src/prolip/loss.py and §2.6): the full forward on the global batch, the masked
forward on the masked sub-batch (the first `int(G * fraction)` rows of every group of G = 8
consecutive rows: 64 of each 512-row shard as the reference masks 12.5% of each GPU's batch, but
a set that does not depend on the mesh; images keep one shared random subset of patches, text
tokens other than pad/EOS become [MASK] with prob p), the ProLIP loss with
global-batch semantics, the AdamW update, then `logit_scale` clamped to [0, ln 100]. A step whose
loss, gradients, new parameters or new optimiser state are not finite leaves params and optimiser
state unchanged: finite gradients can still give a non-finite update (Adam's 0/0 with eps = 0 on
a zero gradient, a NaN learning rate), so the guard looks at what would be kept.

Gradient accumulation over k microbatches uses gradient caching (Gao et al. 2021): PPCL couples
every pair of the global batch, so summing per-microbatch losses would change the objective.
Instead the features of all microbatches are computed first (no activations kept), the loss and
its gradient w.r.t. the features are taken on the whole batch, and each microbatch's forward is
re-run to pull that feature gradient back to the parameters. The result equals the one-batch
gradient exactly (no dropout, no batch statistics) for one microbatch's activation memory.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, ClassVar, Literal

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prolip_jax.core.normalization import normalize_on_device
from prolip_jax.core import objectives, param_init, sharding
from prolip_jax.core.objectives import prolip as prolip_objective
from prolip_jax.core.models.prolip import ProLIP, dummy_inputs, mask_text_tokens, num_kept_patches
from prolip_jax.core import optim
from prolip_jax.core.optim import clamp_logit_scale
from prolip_jax.core.targets import TargetsConfig, batch_targets

FEATURES = ("image_mean", "image_logvar", "text_mean", "text_logvar")


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 []: batches consumed (a skipped non-finite step counts too)
    params: Any
    opt_state: Any
    skipped: jax.Array  # int32 []: total updates skipped for a non-finite loss, gradient or update


def all_finite(tree: Any, fused: bool = False) -> jax.Array:
    """bool []: every floating-point leaf of `tree` is finite (integer leaves always are).

    fused (StepOptions.finite_guard): one float sum of `x * 0` over every leaf instead of a
    boolean reduction per leaf; x * 0 is 0 for finite x and NaN for an inf or NaN, so the sum is
    finite exactly when every leaf is, and cannot overflow. A float sum is what XLA can fold into
    the kernel that writes the leaf (the optimiser update), where ~400 boolean reductions were
    400 kernels of their own in the GPU profile (docs/performance.md, "Levers and defaults")."""
    floats = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not floats:
        return jnp.array(True)
    if fused:
        return jnp.isfinite(sum(jnp.sum(x * 0, dtype=jnp.float32) for x in floats))
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in floats]))


def compute_copy(params: Any, dtype: jnp.dtype) -> Any:
    """The params with every kernel (a leaf named `*kernel`: all the towers' matmul weights) cast
    to the compute dtype once, for StepOptions.cast_params_once. The layers cast their kernel at
    each use (`kernel.astype(dtype)`), which is then a no-op; norms, embeddings, heads and the
    loss's scalars keep float32. Gradients come back float32 through the cast."""
    def cast(path, x):
        name = getattr(path[-1], "key", "")
        return x.astype(dtype) if str(name).endswith("kernel") and x.dtype != dtype else x
    return jax.tree_util.tree_map_with_path(cast, params)


def sigma2_metrics(features: dict) -> dict[str, jax.Array]:
    """{"sigma2_trace/image", "sigma2_trace/text"}: the batch mean of tr(Sigma) = sum_d sigma_d^2
    (log sigma^2 [B, D] -> []); the evaluators' `..._sigma2_trace_mean` (docs/metrics.md).
    A deterministic tower (log sigma^2 None) has no entry."""
    # The trace, not the per-dimension mean: the paper's sigma_v^2 / sigma_t^2 are tr(Sigma) (§4.3).
    return {f"sigma2_trace/{side}": jnp.mean(jnp.sum(jnp.exp(features[f"{side}_logvar"]), -1))
            for side in ("image", "text") if features[f"{side}_logvar"] is not None}


@dataclasses.dataclass(frozen=True)
class MaskingConfig:
    """ProLIP's masked forward (`config.masking`; naver-ai/prolip src/prolip_train/train.py). Only objectives with
    USES_MASKED run it. The ids must be special tokens of the tokenizer: [MASK] replaces text
    tokens, protected ids (pad, EOS) are never masked."""

    fraction: float = 0.125  # of every group of `group` consecutive rows
    group: int = 8  # must divide the rows per data shard
    image_keep_ratio: float = 0.75  # the reference's `drop_prob` is a *keep* ratio for images
    text_mask_prob: float = 0.75
    mask_token_id: int = 32000  # `<extra_id_99>` in the SigLIP vocab
    protected_ids: tuple[int, ...] = (1,)  # pad == EOS

    def validate(self) -> None:
        for name in ("fraction", "image_keep_ratio", "text_mask_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"config.masking.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.group < 1:
            raise ValueError(f"config.masking.group must be >= 1, got {self.group}")


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """`config.step`: how the step computes, not what. Each option is a speed lever measured in
    docs/performance.md and tested against the default step (tests/test_speed_levers.py)."""

    # None: the platform's default (PLATFORM_DEFAULTS, resolved by the trainer's parse_config).
    # A bfloat16/float16 copy of the kernels made once per step, used by the full and the masked
    # forward, instead of a cast at every use. Not bit-identical in 16-bit compute: the two
    # forwards' weight gradients then add in the compute dtype before the cast back to float32.
    cast_params_once: bool | None = None
    # "per_leaf": a boolean reduction per leaf of grads, params and optimiser state; "fused": one
    # float sum (all_finite). The same decision either way.
    finite_guard: Literal["per_leaf", "fused"] | None = None

    # The levers that won on the GPU (docs/performance.md, "Levers and defaults"); CPU and TPU
    # keep the programs the golden tests pin.
    PLATFORM_DEFAULTS: ClassVar[dict] = {"default": dict(cast_params_once=False, finite_guard="per_leaf"),
                                         "gpu": dict(cast_params_once=True, finite_guard="fused")}


@dataclasses.dataclass(frozen=True)
class StepConfig:
    objective: str = "prolip"  # a name in prolip_jax.core.objectives.REGISTRY
    loss: Any = None  # that objective's Config; None = its defaults
    masking: MaskingConfig = MaskingConfig()
    targets: TargetsConfig = TargetsConfig()
    microbatches: int = 1
    seed: int = 0
    normalization: str = "openai"  # for uint8 batches, normalised on device (cheaper on the host)
    options: StepOptions = StepOptions()

    @property
    def module(self) -> Any:
        return objectives.get(self.objective)

    @property
    def loss_config(self) -> Any:
        return self.module.Config() if self.loss is None else self.loss

    @property
    def masked_group_rows(self) -> int:
        """Masked rows per group of `masking.group` rows (0: no masked forward)."""
        if not self.module.USES_MASKED:
            return 0
        return prolip_objective.num_masked(self.masking.group, self.masking.fraction)

    @property
    def masks_text(self) -> bool:
        """Whether the run writes masking.mask_token_id over text tokens (the masked forward runs
        and masks text): the id must then be one no text encodes to (prolip_jax.trainer.data.check_masking)."""
        return bool(self.masked_group_rows and self.masking.text_mask_prob)


# --------------------------------------------------------------------------------- state
@dataclasses.dataclass(frozen=True)
class ParamTrace:
    """One abstract trace of `model.init` (no forward pass runs): what a train state, its
    shardings and a restore target need, so that none of them traces the model again."""
    draws: list[param_init.Draw] | None  # param_init.record's draws; None: it cannot follow the model
    boxed: Any  # the abstract params with their logical axes (nn.Partitioned boxes)

    @property
    def shapes(self) -> Any:
        """The params' ShapeDtypeStructs, unboxed."""
        return nn.unbox(self.boxed)


def trace_params(model: ProLIP) -> ParamTrace:
    draws, variables = param_init.trace(model, *dummy_inputs(model.config))
    return ParamTrace(draws, variables["params"])


def create_train_state(model: ProLIP, tx: optax.GradientTransformation, mesh: Mesh, rules: Any,
                       seed: int, traced: ParamTrace | None = None) -> tuple[TrainState, TrainState]:
    """(state, state shardings): parameters are created already sharded (jit with out_shardings).
    `traced`: the model's `trace_params`, traced here when not given."""
    traced = traced or trace_params(model)
    shardings = state_shardings(traced.boxed, tx, mesh, rules)
    params = None if traced.draws is None else param_init.draw_params(traced.draws, jax.random.key(seed),
                                                                      shardings.params)
    if params is None:  # a model param_init cannot follow (e.g. scanned layers): one program
        return jax.jit(_init_fn(model, tx), out_shardings=shardings)(jax.random.key(seed)), shardings
    state = jax.jit(_state_from_params(tx), out_shardings=shardings, donate_argnums=0)(params)
    return state, shardings


def _init_fn(model: ProLIP, tx: optax.GradientTransformation) -> Callable[[jax.Array], TrainState]:
    images, tokens = dummy_inputs(model.config)

    def init(rng):
        return _state_from_params(tx)(nn.unbox(model.init(rng, images, tokens)["params"]))

    return init


def _state_from_params(tx: optax.GradientTransformation) -> Callable[[Any], TrainState]:
    def state(params):
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
                          skipped=jnp.zeros((), jnp.int32))

    return state


def abstract_train_state(boxed: Any, tx: optax.GradientTransformation, shardings: TrainState) -> TrainState:
    """ShapeDtypeStructs of the train state carrying `shardings` (the target of a restore);
    `boxed`: the model's abstract params (`ParamTrace.boxed`)."""
    shapes = jax.eval_shape(_state_from_params(tx), nn.unbox(boxed))
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


def state_shardings(boxed: Any, tx: optax.GradientTransformation, mesh: Mesh, rules: Any) -> TrainState:
    """The train state's shardings; `boxed`: the model's abstract params with their logical axes
    (`ParamTrace.boxed`)."""
    param_sh = sharding.logical_shardings(boxed, mesh, rules)
    replicated = NamedSharding(mesh, P())
    abstract_opt = jax.eval_shape(tx.init, nn.unbox(boxed))
    opt_sh = optim.tree_map_params(tx, lambda _, s: s, abstract_opt, param_sh,
                                   transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=param_sh, opt_state=opt_sh, skipped=replicated)


# ------------------------------------------------------------------------- batch layout
def group_rows(x: jax.Array, group: int, rows: int) -> jax.Array:
    """The first `rows` rows of every group of `group` consecutive rows of x [B, ...].

    Groups never straddle data shards (group divides the rows per shard), so this is local."""
    b = x.shape[0]
    return x.reshape(b // group, group, *x.shape[1:])[:, :rows].reshape(b // group * rows, *x.shape[1:])


def split_microbatches(x: jax.Array, n_shards: int, k: int) -> jax.Array:
    """[B, ...] -> [k, B/k, ...], microbatch i holding rows of every shard (keeps all devices busy)."""
    b = x.shape[0]
    x = x.reshape(n_shards, k, b // (n_shards * k), *x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape(k, b // k, *x.shape[3:])


def merge_microbatches(x: jax.Array, n_shards: int) -> jax.Array:
    """Inverse of `split_microbatches`: [k, B/k, ...] -> [B, ...]."""
    k, bk = x.shape[:2]
    x = x.reshape(k, n_shards, bk // n_shards, *x.shape[2:])
    return jnp.swapaxes(x, 0, 1).reshape(k * bk, *x.shape[3:])


def num_masked_rows(global_batch: int, cfg: StepConfig) -> int:
    """Rows of the global batch that get a masked forward (`group_rows` of every mask group)."""
    return global_batch // cfg.masking.group * cfg.masked_group_rows


def check_batch_layout(global_batch: int, n_shards: int, cfg: StepConfig) -> None:
    """Raises ValueError (before anything compiles) if the batch cannot be laid out as asked."""
    problems = []
    if global_batch % n_shards:
        problems.append(f"global batch {global_batch} is not divisible by the {n_shards} data shards")
    else:
        b_shard = global_batch // n_shards
        if cfg.masked_group_rows and b_shard % cfg.masking.group:
            problems.append(f"rows per data shard ({b_shard}) must be a multiple of masking.group "
                            f"({cfg.masking.group})")
        elif b_shard % cfg.microbatches or num_masked_rows(b_shard, cfg) % cfg.microbatches:
            problems.append(f"rows per data shard ({b_shard}) and its masked rows "
                            f"({num_masked_rows(b_shard, cfg)}) must divide into {cfg.microbatches} microbatches")
    if problems:
        raise ValueError("; ".join(problems))


# ---------------------------------------------------------------------------- the step
@dataclasses.dataclass(frozen=True)
class _Forward:
    """What the step differentiates: the towers' features and the objective's loss on them.

    The gradient functions below take it rather than closing over `make_train_step`'s locals, so
    each reads on its own; it holds only static settings (and the masked rows' indices)."""
    model: ProLIP
    cfg: StepConfig
    mesh: Mesh
    masked_rows: jax.Array  # int [global_batch / group * masked_group_rows]: the masked sub-batch's rows

    @property
    def m_group(self) -> int:
        return self.cfg.masked_group_rows  # 0 unless the objective uses ProLIP's masked forward

    def compute(self, params: Any) -> Any:
        """The params the forwards read: the kernels cast once (StepOptions.cast_params_once) or as is."""
        return compute_copy(params, self.model.dtype) if self.cfg.options.cast_params_once else params

    def features(self, params, images, tokens, keep_idx=None, rng=None):
        # SizeAugment (PCME++ §2.4, PCME++) is the only training-time randomness in the towers: its
        # key is per step and per microbatch, so gradient caching's re-run sees the same dropped tokens.
        vision, text = self.model.config.vision, self.model.config.text
        train = {"train": True, "rngs": {"augment": rng}} if (vision.size_augment or text.size_augment) else {}
        out = self.model.apply({"params": params}, images, tokens, image_keep_idx=keep_idx, **train)
        return {key: out[key] for key in FEATURES}

    def loss(self, feats, mfeats, logit_scale, logit_bias, ctx):
        """ctx: what the objective reads besides features: tokens, targets, rng (no gradient)."""
        objective = self.cfg.module
        out = {**feats, "logit_scale": jnp.exp(logit_scale), "logit_bias": logit_bias, "text": ctx["text"]}
        extra = {"step": ctx["step"]} if getattr(objective, "USES_STEP", False) else {}
        return objective.loss(out, self.cfg.loss_config, targets=ctx["targets"], masked=mfeats,
                              masked_rows=self.masked_rows if self.m_group else None, rng=ctx["rng"],
                              mesh=self.mesh, **extra)


# Differentiating only w.r.t. the trainable leaves (optim.partition: None where the other part
# holds the leaf) is what keeps a locked tower from costing its weight-gradient matmuls; both
# gradient functions take (train, frozen) and join them inside the differentiated function.
def _grads_one_batch(fw: _Forward, train, frozen, images, tokens, m_images, m_tokens, keep_idx, ctx):
    """(loss, terms, features, grads of `train`) of the whole batch in one forward and backward."""
    rng_full, rng_masked = jax.random.split(ctx["rng_augment"])

    def total(t):
        p = fw.compute(optim.combine(t, frozen))
        f = fw.features(p, images, tokens, rng=rng_full)
        mf = fw.features(p, m_images, m_tokens, keep_idx, rng_masked) if fw.m_group else None
        loss, terms = fw.loss(f, mf, p["logit_scale"], p["logit_bias"], ctx)
        return loss, (terms, f)
    (loss, (terms, f)), grads = jax.value_and_grad(total, has_aux=True)(train)
    return loss, terms, f, grads


def _grads_cached(fw: _Forward, n_shards: int, k: int, train, frozen, images, tokens, m_images, m_tokens,
                  keep_idx, ctx):
    """_grads_one_batch's result by gradient caching over k microbatches (the module docstring):
    features first, the loss's gradient w.r.t. them, then each microbatch's forward re-run and
    pulled back to the parameters."""
    params = fw.compute(optim.combine(train, frozen))
    split_mb = lambda x: split_microbatches(x, n_shards, k)  # noqa: E731
    merge_mb = lambda x: merge_microbatches(x, n_shards)  # noqa: E731
    rng_full, rng_masked = (jax.random.split(r, k) for r in jax.random.split(ctx["rng_augment"]))
    chunks = (split_mb(images), split_mb(tokens), rng_full)
    f = jax.tree.map(merge_mb, jax.lax.map(lambda xs: fw.features(params, *xs[:2], rng=xs[2]), chunks))
    if fw.m_group:
        m_chunks = (split_mb(m_images), split_mb(m_tokens), rng_masked)
        mf = jax.tree.map(merge_mb, jax.lax.map(lambda xs: fw.features(params, *xs[:2], keep_idx, xs[2]), m_chunks))
    else:
        mf = None
    (loss, terms), (g_f, g_mf, g_scale, g_bias) = jax.value_and_grad(
        fw.loss, argnums=(0, 1, 2, 3), has_aux=True)(f, mf, params["logit_scale"], params["logit_bias"], ctx)

    def pull_back(acc, xs, keep=None):
        imgs, toks, rng, g = xs
        _, vjp = jax.vjp(lambda t: fw.features(fw.compute(optim.combine(t, frozen)), imgs, toks, keep, rng), train)
        return jax.tree.map(jnp.add, acc, vjp(g)[0]), None

    grads = jax.tree.map(jnp.zeros_like, train)
    grads, _ = jax.lax.scan(pull_back, grads, (*chunks, jax.tree.map(split_mb, g_f)))
    if fw.m_group:
        grads, _ = jax.lax.scan(lambda a, xs: pull_back(a, xs, keep_idx), grads,
                                (*m_chunks, jax.tree.map(split_mb, g_mf)))
    for name, g_direct in (("logit_scale", g_scale), ("logit_bias", g_bias)):
        if grads[name] is not None:  # None: locked
            grads = {**grads, name: grads[name] + g_direct}
    return loss, terms, f, grads


def _step_inputs(cfg: StepConfig, num_patches: int, state: TrainState, batch: dict):
    """(images, tokens, masked images, masked tokens, kept patch indices, ctx) of one step: the
    batch normalised and mixed (targets), the masked sub-batch and the step's random keys."""
    images, tokens = batch["image"], batch["text"]
    if images.dtype == jnp.uint8:
        images = normalize_on_device(images, cfg.normalization)
    rng_step = jax.random.fold_in(jax.random.key(cfg.seed), state.step)
    rng_img, rng_txt, rng_mix, rng_loss = jax.random.split(rng_step, 4)
    rng_aug = jax.random.fold_in(rng_step, 1)  # apart from the split: earlier draws unchanged
    images, targets = batch_targets(rng_mix, images, tokens, batch.get("image_id"), cfg.targets)
    ctx = {"text": tokens, "targets": targets, "rng": rng_loss, "rng_augment": rng_aug, "step": state.step}
    mk, g, m_group = cfg.masking, cfg.masking.group, cfg.masked_group_rows
    m_images = group_rows(images, g, m_group)
    m_tokens = mask_text_tokens(rng_txt, group_rows(tokens, g, m_group), mk.mask_token_id,
                                mk.text_mask_prob, mk.protected_ids)
    # One subset of patches shared by the masked sub-batch, as the reference draws it.
    keep_idx = jnp.sort(jax.random.permutation(rng_img, num_patches)[
        :num_kept_patches(num_patches, mk.image_keep_ratio)])
    return images, tokens, m_images, m_tokens, keep_idx, ctx


def _update_if_finite(state: TrainState, grads: Any, loss: jax.Array, tx: optax.GradientTransformation,
                      fused: bool) -> tuple[TrainState, jax.Array]:
    """(the next state, finite): the update applied and logit_scale clamped, or, where the loss,
    gradients, new params or new optimiser state are not finite, the old params and state kept."""
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = clamp_logit_scale(optax.apply_updates(state.params, updates))
    finite = (jnp.isfinite(loss) & all_finite(grads, fused) & all_finite(params, fused)
              & all_finite(opt_state, fused))
    # One conditional, not a `jnp.where(finite, ...)` per leaf: XLA:CPU fuses the whole
    # `finite` reduction (an `and` per leaf) into every leaf's select, a program quadratic in
    # the number of leaves (the small model's step: 143 MB of HLO, minutes to compile).
    params, opt_state = jax.lax.cond(finite, lambda: (params, opt_state),
                                     lambda: (state.params, state.opt_state))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                      skipped=state.skipped + (~finite).astype(jnp.int32)), finite


def make_train_step(model: ProLIP, tx: optax.GradientTransformation, schedule: Callable, cfg: StepConfig,
                    mesh: Mesh, global_batch: int, trainable: Any = None, rules: Any = None
                    ) -> Callable[[TrainState, dict], tuple[TrainState, dict]]:
    """Returns `train_step(state, batch) -> (state, metrics)` (not yet jitted).

    batch: {"image": float [B, H, W, 3] normalised, or uint8 (normalised here), "text": int [B, L]},
    B = global_batch sharded over the mesh's batch axes.
    trainable: a tree of bools like the params (`optim.trainable_mask`); gradients are computed
    only for the True leaves (locked ones get zeros, which `tx` must ignore), None = all.
    rules: the logical-axis rules of the parameters (`config.sharding_rules`), under which the
    towers' activation constraints (`nn.with_logical_constraint` on the residual stream) lay the
    activations out on `mesh` too; None leaves them no-ops and XLA to choose. With FSDP, the
    scanned large towers fit only with them: without, sharding propagation replicates the scanned
    residual stream and L/16 at the paper's batch asks ~27x the HBM per chip (docs/performance.md,
    "TPU pods, compiled ahead of time").
    """
    n_shards = sharding.num_batch_shards(mesh)
    check_batch_layout(global_batch, n_shards, cfg)
    g, m_group = cfg.masking.group, cfg.masked_group_rows
    masked_rows = (jnp.arange(global_batch // g)[:, None] * g + jnp.arange(m_group)[None]).reshape(-1)
    fw = _Forward(model, cfg, mesh, masked_rows)
    k = cfg.microbatches
    grad_fn = functools.partial(_grads_one_batch, fw) if k == 1 else functools.partial(_grads_cached, fw, n_shards, k)

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        images, tokens, m_images, m_tokens, keep_idx, ctx = _step_inputs(
            cfg, model.config.vision.num_patches, state, batch)
        mask = jax.tree.map(lambda _: True, state.params) if trainable is None else trainable
        train, frozen = optim.partition(state.params, mask)
        loss, terms, f, grads = grad_fn(train, frozen, images, tokens, m_images, m_tokens, keep_idx, ctx)
        grads = optim.combine(grads, jax.tree.map(jnp.zeros_like, frozen))
        new_state, finite = _update_if_finite(state, grads, loss, tx, cfg.options.finite_guard == "fused")
        metrics = {
            "loss": loss, **{f"loss/{name}": v for name, v in terms.items()},
            "a": jnp.exp(state.params["logit_scale"]), "b": state.params["logit_bias"],
            **sigma2_metrics(f),
            "lr": schedule(_opt_count(state.opt_state)), "grad_norm": optax.tree.norm(grads),
            "nonfinite": (~finite).astype(jnp.int32),
        }
        return new_state, metrics

    return train_step if rules is None else _under_rules(train_step, mesh, rules)


def _under_rules(train_step: Callable, mesh: Mesh, rules: Any) -> Callable:
    """train_step traced under the mesh (abstract: this runs inside jit) and the logical-axis
    rules, so flax's logical constraints resolve to sharding constraints."""
    axis_rules = sharding.resolve_rules(rules)

    @functools.wraps(train_step)  # the compiled program keeps the name jit_train_step (profiles)
    def constrained_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), nn.logical_axis_rules(axis_rules):
            return train_step(state, batch)

    return constrained_step


def _opt_count(opt_state: Any) -> jax.Array:
    """The schedule's update count (it does not advance on skipped steps)."""
    is_sched = lambda x: isinstance(x, optax.ScaleByScheduleState)  # noqa: E731
    states = [s for s in jax.tree.leaves(opt_state, is_leaf=is_sched) if is_sched(s)]
    return states[0].count if states else jnp.zeros((), jnp.int32)
