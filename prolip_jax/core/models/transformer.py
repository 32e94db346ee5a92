"""Pre-norm Transformer encoder shared by both towers.

Matches open_clip 2.24's `ResidualAttentionBlock` as used by ProLIP (naver-ai/prolip src/prolip/model.py):
`x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`, no dropout, no LayerScale, MLP
`c_fc -> GELU -> c_proj` of width `int(d * mlp_ratio)`, heads are contiguous
`head_dim`-wide chunks of the model width, q scaled by 1/sqrt(head_dim).

Parameters are stored in float32 and carry logical axis names (`sharding.py` maps them
onto a mesh); activations run in `dtype` (float32 or bfloat16).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from prolip_jax.core.models import kernels
from prolip_jax.core.models.activations import gelu

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]

# Rematerialisation policies selectable by name (the trainer's config picks one).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# ----------------------------------------------------------------------------------------
# Initialisers (PyTorch defaults and open_clip's text-tower init, naver-ai/prolip src/prolip/transformer.py VisionTransformer).
# ----------------------------------------------------------------------------------------
def normal(std: float) -> Initializer:
    return jax.nn.initializers.normal(stddev=std)


def uniform(bound: float) -> Initializer:
    """U(-bound, bound): PyTorch's kaiming_uniform(a=sqrt(5)) is U(+-1/sqrt(fan_in))."""

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def constant(value: float) -> Initializer:
    return jax.nn.initializers.constant(value)


zeros = jax.nn.initializers.zeros
ones = jax.nn.initializers.ones


def resolve_attention_impl(impl: str, dtype: jnp.dtype) -> str | None:
    """'auto' picks cuDNN flash attention on GPU for 16-bit compute, else XLA."""
    if impl != "auto":
        return impl
    if jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2:
        return "cudnn"
    return "xla"


class LayerNorm(nn.Module):
    """LayerNorm with float32 statistics and logical axis names ('embed',). Called with a
    `residual`, it returns (x + residual, LayerNorm(x + residual)): a pre-norm block's stream
    after a branch and the next branch's input."""

    eps: float
    dtype: jnp.dtype = jnp.float32
    saved_stats: bool = False  # see layer_norm
    kernel: bool = False  # the Pallas kernels (BlockLevers.pallas_kernels, models/kernels.py)

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        d = x.shape[-1]
        scale = self.param("scale", nn.with_logical_partitioning(ones, ("embed",)), (d,))
        bias = self.param("bias", nn.with_logical_partitioning(zeros, ("embed",)), (d,))
        if self.kernel:
            if residual is None:
                return kernels.layer_norm(x, scale, bias, self.eps, self.dtype)
            return kernels.add_layer_norm(x, residual, scale, bias, self.eps, self.dtype)
        if residual is not None:
            x = x + residual
            return x, layer_norm(x, scale, bias, self.eps, self.saved_stats).astype(self.dtype)
        return layer_norm(x, scale, bias, self.eps, self.saved_stats).astype(self.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float, saved_stats: bool = False) -> jax.Array:
    """float32 (x - mean) / sqrt(var + eps) * scale + bias over the last axis.

    Its backward is the closed form torch's LayerNorm kernel uses (two row means of the scaled
    gradient, the input's row statistics kept from the forward), where autodiff of the forward
    gives XLA a longer chain of broadcasts and reductions, slower on the CPU (docs/performance.md,
    "Levers and defaults").

    `saved_stats` (BlockLevers.ln_saved_stats, a GPU speed lever): the backward reads the row
    statistics the forward saved instead of letting XLA recompute them. On the GPU XLA fused the
    recomputation into a kernel that writes dy * xhat in float32 ([50688, 768] per image block)
    for the next kernel's column sum (the scale's gradient): a row reduction and a column
    reduction cannot share a kernel (the profile's `ln_2/mul`, docs/performance.md). Behind an
    optimization barrier the statistics are plain inputs, and the column sum can read dy and x."""
    return _layer_norm_fwd(x, scale, bias, eps, saved_stats)[0]


def _layer_norm_fwd(x, scale, bias, eps, saved_stats):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    rstd = jax.lax.rsqrt(jnp.square(x32 - mean).mean(-1, keepdims=True) + eps)
    return (x32 - mean) * rstd * scale + bias, (x, mean, rstd, scale)


def _layer_norm_bwd(eps, saved_stats, res, dy):
    x, mean, rstd, scale = res
    if saved_stats:
        mean, rstd = jax.lax.optimization_barrier((mean, rstd))
    xhat = (x.astype(jnp.float32) - mean) * rstd
    g = dy * scale
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    lead = tuple(range(dy.ndim - 1))
    return dx.astype(x.dtype), jnp.sum(dy * xhat, lead), jnp.sum(dy, lead)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


def on_platform(*args: jax.Array, cpu: Callable, default: Callable):
    """`lax.platform_dependent(*args, cpu=cpu, default=default)`, decided while tracing when the
    platform is known: the abstract mesh the step is traced under (`step.make_train_step` with
    sharding rules; a TPU topology's mesh in benchmarks/compile_tpu.py on a CPU host) names its
    devices' platform. platform_dependent traces, and under autodiff differentiates, every
    branch, then keeps one when lowering: deciding here skips the other's tracing
    (docs/performance.md, "Levers and defaults"). Where nothing names the platform (encoders traced
    without a mesh, exports for several platforms) platform_dependent decides, as before."""
    platform = kernels.traced_platform()
    if platform is None:
        return jax.lax.platform_dependent(*args, cpu=cpu, default=default)
    return (cpu if platform == "cpu" else default)(*args)


@jax.custom_vjp
def dense(x: jax.Array, kernel: jax.Array) -> jax.Array:
    """x @ kernel over x's last axis (kernel [in, out]): every projection of the towers.

    The forward and dx are jnp.dot's. On CPU the kernel gradient x^T dy is computed as a plain
    row-major GEMM of an explicit transpose of the narrower of x and dy (the larger [N, in] x
    [N, out] stays as it is): XLA:CPU otherwise hands x^T dy (contraction over the leading,
    major axis of both) to Eigen, ~1.5x slower than YNNPACK's GEMM on these shapes, after
    transposing the *wider* operand (a [4224, 1024] MLP hidden per block of the small model).
    `optimization_barrier` keeps XLA from folding the transposes back into the dot (its gain:
    docs/performance.md, "Levers and defaults"). GPU and TPU get the dot autodiff would emit."""
    return jnp.dot(x, kernel)


def _dense_fwd(x, kernel):
    return jnp.dot(x, kernel), (x, kernel)


def _dense_bwd(res, g):
    x, kernel = res
    dx = jax.lax.dot_general(g, kernel, (((g.ndim - 1,), (1,)), ((), ())))
    lead = tuple(range(x.ndim - 1))

    def autodiff(x, g):
        return jax.lax.dot_general(x, g, ((lead, lead), ((), ())))

    def cpu(x, g):
        barrier = jax.lax.optimization_barrier
        x, g = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        if x.shape[1] <= g.shape[1]:
            return jnp.dot(barrier(x.T), g)  # [in, N] @ [N, out]
        return barrier(jnp.dot(barrier(g.T), x)).T  # ([out, N] @ [N, in])^T: a small transpose

    return dx, on_platform(x, g, cpu=cpu, default=autodiff)


dense.defvjp(_dense_fwd, _dense_bwd)


class Linear(nn.Module):
    """y = x @ kernel + bias with kernel stored (in, out) and named logical axes."""

    features: int
    axes: tuple[str | None, str | None]
    kernel_init: Initializer
    bias_init: Initializer | None = zeros
    dtype: jnp.dtype = jnp.float32
    act: str = ""  # an activation applied with the bias by one Pallas kernel (models/kernels.py)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(self.kernel_init, self.axes),
            (x.shape[-1], self.features))
        y = dense(x.astype(self.dtype), kernel.astype(self.dtype))
        if self.bias_init is not None:
            bias = self.param("bias", nn.with_logical_partitioning(self.bias_init, self.axes[1:]),
                              (self.features,))
            if self.act:
                return kernels.bias_act(y, bias.astype(self.dtype), self.act)
            y = y + bias.astype(self.dtype)
        return gelu(y, self.act) if self.act else y


def attention_xla(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool) -> jax.Array:
    """`jax.nn.dot_product_attention(implementation="xla")` on [B, T, N, H] (its scale after the
    q.k dot, float32 softmax, causal fill), computed on CPU with heads before tokens.

    jax's einsums keep tokens before heads, and XLA:CPU transposes around each of the batched
    dots of the forward and backward pass; moving q, k, v to [B, N, T, H] once (and the output
    back) leaves the dots in the layout YNNPACK takes as it is, close to torch's SDPA on the small
    model's attention (docs/performance.md, "Levers and defaults"). GPU and TPU keep jax's own."""
    def heads_major(q, k, v):
        qt, kt, vt = (jnp.swapaxes(a, 1, 2) for a in (q, k, v))  # [B, N, T, H]
        logits = jnp.einsum("bnth,bnsh->bnts", qt, kt).astype(jnp.float32) * (q.shape[-1] ** -0.5)
        if causal:
            t, s = logits.shape[-2:]
            logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -0.7 * jnp.finfo(jnp.float32).max)
        probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
        return jnp.swapaxes(jnp.einsum("bnts,bnsh->bnth", probs, vt), 1, 2)

    def default(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    return on_platform(q, k, v, cpu=heads_major, default=default)


class Attention(nn.Module):
    """Multi-head attention; q, k, v, out kept as separate kernels [D, N, H] / [N, H, D].

    torch's packed `in_proj_weight` (3D, D) rows [q; k; v] map to these by `convert.py`.
    `causal`: token i attends to tokens <= i (open_clip's text `attn_mask`, OpenAI CLIP).
    `kv`: keys/values from another sequence (cross-attention, the MAP head's probe query).
    """

    num_heads: int
    init: dict
    dtype: jnp.dtype = jnp.float32
    attention_impl: str = "auto"
    causal: bool = False

    @nn.compact
    def __call__(self, x: jax.Array, kv: jax.Array | None = None, tokens: tuple[int, int] | None = None
                 ) -> jax.Array:
        """x [B, T, D] -> [B, T, D]; or x [B*T, D] with `tokens` = (B, T) (the flattened tokens of
        `BlockLevers.flat_tokens`) -> [B*T, D]: the projections then stay 2-D, only q, k, v and the attention
        output take the [B, T, N, H] shape."""
        d = x.shape[-1]
        if d % self.num_heads:
            raise ValueError(f"width {d} is not divisible by num_heads {self.num_heads}")
        h = d // self.num_heads
        x = x.astype(self.dtype)

        def proj(name: str, inp: jax.Array, kernel_init: Initializer) -> jax.Array:
            kernel = self.param(f"{name}_kernel", nn.with_logical_partitioning(
                lambda k, s, t=jnp.float32: kernel_init(k, (d, d), t).reshape(s), ("embed", "heads", "kv")),
                (d, self.num_heads, h))
            bias = self.param(f"{name}_bias", nn.with_logical_partitioning(zeros, ("heads", "kv")),
                              (self.num_heads, h))
            y = dense(inp, kernel.astype(self.dtype).reshape(d, d))  # "btd,dnh->btnh"
            lead = y.shape[:-1] if tokens is None else tokens
            return y.reshape(*lead, self.num_heads, h) + bias.astype(self.dtype)

        kv = x if kv is None else kv.astype(self.dtype)
        q = proj("query", x, self.init["qkv"])
        k = proj("key", kv, self.init["qkv"])
        v = proj("value", kv, self.init["qkv"])
        impl = resolve_attention_impl(self.attention_impl, self.dtype)
        try:
            if impl == "xla":
                o = attention_xla(q, k, v, self.causal)
            else:
                o = jax.nn.dot_product_attention(q, k, v, is_causal=self.causal, implementation=impl)
        except (ValueError, NotImplementedError):
            if impl != "cudnn" or self.attention_impl != "auto":
                raise
            # shape not cuDNN-able
            o = jax.nn.dot_product_attention(q, k, v, is_causal=self.causal, implementation="xla")
        out_kernel = self.param("out_kernel", nn.with_logical_partitioning(
            lambda k_, s, t=jnp.float32: self.init["out"](k_, (d, d), t).reshape(s), ("heads", "kv", "embed")),
            (self.num_heads, h, d))
        out_bias = self.param("out_bias", nn.with_logical_partitioning(zeros, ("embed",)), (d,))
        o = o.reshape(*o.shape[:-2], d) if tokens is None else o.reshape(-1, d)
        o = dense(o, out_kernel.astype(self.dtype).reshape(d, d))  # "btnh,nhd->btd"
        return o + out_bias.astype(self.dtype)


@dataclasses.dataclass(frozen=True)
class BlockLevers:
    """How the blocks compute, each the same arithmetic: GPU speed levers, off by default until
    measured (config.model; tests/test_speed_levers.py; benchmarks/gpu_speed.py LEVERS)."""

    flat_tokens: bool = False  # the blocks on [B*T, D] matrices (residual_block)
    ln_saved_stats: bool = False  # the LayerNorms' backward reads the forward's statistics (layer_norm)
    # LayerNorm (ln_2 with the residual add before it) and the MLP's bias + activation as Pallas
    # kernels, forward and backward (models/kernels.py)
    pallas_kernels: bool = False


class ResidualBlock(nn.Module):
    """open_clip ResidualAttentionBlock (pre-norm), naver-ai/prolip src/prolip/model.py."""

    num_heads: int
    mlp_dim: int
    ln_eps: float
    act: str
    init: dict
    dtype: jnp.dtype = jnp.float32
    attention_impl: str = "auto"
    causal: bool = False
    levers: BlockLevers = BlockLevers()

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return residual_block(self, x)


def residual_block(block: ResidualBlock, x: jax.Array) -> jax.Array:
    """The block's computation, its submodules created inside `block` (a compact parent).

    `levers.flat_tokens`: the block works on the tokens as one [B*T, D] matrix (attention alone sees
    [B, T, N, H]), the same arithmetic. A speed lever for GPUs: with [B, T, D] the weight
    gradients contract over two leading axes and XLA picked batch-minor layouts (bf16[198, 768,
    256]) with transposes around LayerNorm, a visible share of the B/16 step's GPU profile
    (docs/performance.md, "Levers and defaults"); flat, every projection is a plain 2-D GEMM."""
    shape = x.shape
    tokens = None
    if block.levers.flat_tokens:
        tokens, x = shape[:-1], x.reshape(-1, shape[-1])
    levers = block.levers
    y = LayerNorm(block.ln_eps, block.dtype, levers.ln_saved_stats, levers.pallas_kernels, name="ln_1")(x)
    y = Attention(block.num_heads, block.init, block.dtype, block.attention_impl, block.causal,
                  name="attn")(y, tokens=tokens)
    x, y = LayerNorm(block.ln_eps, block.dtype, levers.ln_saved_stats, levers.pallas_kernels, name="ln_2")(x, y)
    x = (x + mlp(block, y, block.mlp_dim, block.act, block.init, levers.pallas_kernels)).reshape(shape)
    # Name the residual stream so a remat policy or sharding constraint can refer to it.
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class ScanStep(ResidualBlock):
    """One step of the scanned blocks (Encoder, scan=True): the unrolled loop's body, the same
    ResidualBlock parameters. carry: the residual stream x, or (x, fork) where fork holds x after
    block `fork_after - 1` (PCME++'s branch point); `index`: this block's number."""

    fork_after: int | None = None

    @nn.compact
    def __call__(self, carry, index: jax.Array):
        x, fork = carry if self.fork_after is not None else (carry, None)
        x = residual_block(self, materialize_cotangent(x))
        if fork is None:
            return x, None
        return (x, jnp.where(index == self.fork_after - 1, x, fork)), None


@jax.custom_vjp
def materialize_cotangent(x: jax.Array) -> jax.Array:
    """Identity; on CPU its backward pass writes the incoming gradient out before using it.

    XLA:CPU otherwise treats the text tower's residual-stream gradient, through all blocks, as
    one elementwise expression of the dots' outputs (every block's LayerNorm backward adds into
    it) and recomputes that whole chain inside each block's weight-gradient transpose: a cost
    quadratic in depth (~9% of the small model's CPU step in a `jax.profiler` trace).
    `lax.optimization_barrier` does not stop it (XLA:CPU drops barriers before fusing); a
    conditional's operand is always a written-out buffer. GPU and TPU fuse sensibly and get
    the plain identity."""
    return x


def _materialize_fwd(x):
    return x, None


def _materialize_bwd(_, g):
    def fence(g):
        # The second branch runs only when g's first element is NaN; the weight gradients then
        # hold a NaN with or without it, and the step's non-finite guard skips the update. Two
        # different branches keep XLA from simplifying the conditional away.
        first = g.reshape(-1)[0]
        return jax.lax.cond(first == first, lambda y: y, lambda y: jnp.full_like(y, jnp.nan), g)

    return (on_platform(g, cpu=fence, default=lambda g: g),)


materialize_cotangent.defvjp(_materialize_fwd, _materialize_bwd)


class Encoder(nn.Module):
    """`layers` residual blocks named `resblocks_{i}` (torch: `transformer.resblocks.{i}`), or with
    `scan` one `nn.scan` over them, `resblocks` holding each parameter stacked along a leading
    `layers` axis (models/layout.py converts between the two): compile time and compile memory
    then stay those of one block whatever the depth (big_vision's and MaxText's scan_layers). The
    same computation either way, remat policy included (applied to each scanned step)."""

    layers: int
    num_heads: int
    mlp_dim: int
    ln_eps: float
    act: str
    init: dict
    dtype: jnp.dtype = jnp.float32
    attention_impl: str = "auto"
    remat: str = "none"
    causal: bool = False
    scan: bool = False
    levers: BlockLevers = BlockLevers()

    @nn.compact
    def __call__(self, x: jax.Array, fork_after: int | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
        """x [B, T, D] -> the stream after every block; with `fork_after` = n also the stream after
        block n - 1, or x itself for n = 0 (a tower whose stream splits there: PCME++'s duplicated
        last blocks, all of them when unc_layers == layers)."""
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat policy {self.remat!r}; choose from {sorted(REMAT_POLICIES)}")
        if fork_after is not None and not 0 <= fork_after <= self.layers:
            raise ValueError(f"fork_after={fork_after} must be in [0, layers={self.layers}]")
        args = (self.num_heads, self.mlp_dim, self.ln_eps, self.act, self.init, self.dtype, self.attention_impl,
                self.causal, self.levers)
        policy = REMAT_POLICIES[self.remat]
        if self.scan:
            # prevent_cse=False: inside a scan the loop already keeps XLA from merging the
            # recomputation with the forward (flax's and jax's advice for remat under scan).
            step = ScanStep if self.remat == "none" else nn.remat(ScanStep, policy=policy, prevent_cse=False)
            blocks = nn.scan(step, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.layers,
                             metadata_params={nn.PARTITION_NAME: "layers"})(*args, fork_after, name="resblocks")
            carry = x if fork_after is None else (x, x)  # fork_after 0: the branch starts from the input
            carry, _ = blocks(carry, jnp.arange(self.layers))
            return carry
        block = ResidualBlock if self.remat == "none" else nn.remat(ResidualBlock, policy=policy)
        fork = x if fork_after == 0 else None
        for i in range(self.layers):
            x = block(*args, name=f"resblocks_{i}")(materialize_cotangent(x))
            if i + 1 == fork_after:
                fork = x
        return x if fork_after is None else (x, fork)


def mlp(module: nn.Module, y: jax.Array, mlp_dim: int, act: str, init: dict, kernel: bool = False) -> jax.Array:
    """`c_fc -> act -> c_proj`, created inside `module` (a compact parent); `kernel`: c_fc's bias
    and the activation as one Pallas kernel."""
    d = y.shape[-1]
    dtype = getattr(module, "dtype", jnp.float32)
    y = Linear(mlp_dim, ("embed", "mlp"), init["fc"], init["fc_bias"](d), dtype, name="c_fc",
               act=act if kernel else "")(y)
    y = y if kernel else gelu(y, act)
    return Linear(d, ("mlp", "embed"), init["proj"], init["proj_bias"](mlp_dim), dtype, name="c_proj")(y)


class MAPHead(nn.Module):
    """Multihead attention pooling (SigLIP): one learned probe attends over all tokens, then
    `x + MLP(LN(x))`. Matches big_vision models/vit.py `MAPHead` and timm
    layers/attention_pool.py `AttentionPoolLatent` (latent_len=1, no q/k norm); the attention
    has no pre-LN and its query comes from the probe."""

    num_heads: int
    mlp_dim: int
    ln_eps: float
    act: str
    init: dict
    dtype: jnp.dtype = jnp.float32
    attention_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, _, d = x.shape
        probe = self.param("probe", nn.with_logical_partitioning(normal(d ** -0.5), ("embed",)), (d,))
        q = jnp.broadcast_to(probe.astype(self.dtype), (b, 1, d))
        y = Attention(self.num_heads, self.init, self.dtype, self.attention_impl, name="attn")(q, kv=x)
        z = LayerNorm(self.ln_eps, self.dtype, name="ln")(y)
        return (y + mlp(self, z, self.mlp_dim, self.act, self.init))[:, 0]


def block_init(width: int, layers: int, mlp_dim: int, style: str) -> dict:
    """Initialisers for one tower's blocks.

    'torch' (vision, naver-ai/prolip src/prolip/transformer.py VisionTransformer: PyTorch defaults): MHA in_proj xavier_uniform over the
    packed (3D, D) matrix, zero attention biases, out_proj and Linear weights and biases
    kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)).
    'open_clip_text' (TextTransformer.init_parameters, naver-ai/prolip src/prolip/transformer.py TextTransformer); Linear biases keep
    PyTorch's default.
    """
    fan_in_uniform = lambda fan_in: uniform(fan_in ** -0.5)  # noqa: E731
    if style == "torch":
        return {
            "qkv": uniform((6.0 / (4 * width)) ** 0.5),
            "out": uniform(width ** -0.5),
            "fc": uniform(width ** -0.5),
            "proj": uniform(mlp_dim ** -0.5),
            "fc_bias": fan_in_uniform,
            "proj_bias": fan_in_uniform,
        }
    if style == "open_clip_text":
        proj_std = width ** -0.5 * (2 * layers) ** -0.5
        return {
            "qkv": normal(width ** -0.5),
            "out": normal(proj_std),
            "fc": normal((2 * width) ** -0.5),
            "proj": normal(proj_std),
            "fc_bias": fan_in_uniform,
            "proj_bias": fan_in_uniform,
        }
    raise ValueError(f"unknown init style {style!r}")
