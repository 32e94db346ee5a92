"""Pre-norm Transformer encoder shared by both towers.

Matches open_clip 2.24's `ResidualAttentionBlock` as used by ProLIP (REFERENCE §1.1):
`x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))`, no dropout, no LayerScale, MLP
`c_fc -> GELU -> c_proj` of width `int(d * mlp_ratio)`, heads are contiguous
`head_dim`-wide chunks of the model width, q scaled by 1/sqrt(head_dim).

Parameters are stored in float32 and carry logical axis names (`sharding.py` maps them
onto a mesh); activations run in `dtype` (float32 or bfloat16).
"""
from __future__ import annotations

from typing import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

Initializer = Callable[[jax.Array, Sequence[int], jnp.dtype], jax.Array]

# Rematerialisation policies selectable by name (the trainer's config picks one).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


# ----------------------------------------------------------------------------------------
# Initialisers (PyTorch defaults and open_clip's text-tower init, REFERENCE §1.2/§1.3).
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


def gelu(x: jax.Array, quick: bool) -> jax.Array:
    """Exact (erf) GELU as torch's nn.GELU(); QuickGELU for OpenAI-style variants (H/14)."""
    if quick:
        return x * jax.nn.sigmoid(1.702 * x)
    return jax.nn.gelu(x, approximate=False)


def resolve_attention_impl(impl: str, dtype: jnp.dtype) -> str | None:
    """'auto' picks cuDNN flash attention on GPU for 16-bit compute, else XLA."""
    if impl != "auto":
        return impl
    if jax.default_backend() == "gpu" and jnp.dtype(dtype).itemsize == 2:
        return "cudnn"
    return "xla"


class LayerNorm(nn.Module):
    """LayerNorm with float32 statistics and logical axis names ('embed',)."""

    eps: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        scale = self.param("scale", nn.with_logical_partitioning(ones, ("embed",)), (d,))
        bias = self.param("bias", nn.with_logical_partitioning(zeros, ("embed",)), (d,))
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * scale + bias
        return y.astype(self.dtype)


class Linear(nn.Module):
    """y = x @ kernel + bias with kernel stored (in, out) and named logical axes."""

    features: int
    axes: tuple[str | None, str | None]
    kernel_init: Initializer
    bias_init: Initializer | None = zeros
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(self.kernel_init, self.axes),
            (x.shape[-1], self.features))
        y = jnp.dot(x.astype(self.dtype), kernel.astype(self.dtype))
        if self.bias_init is not None:
            bias = self.param("bias", nn.with_logical_partitioning(self.bias_init, self.axes[1:]),
                              (self.features,))
            y = y + bias.astype(self.dtype)
        return y


class Attention(nn.Module):
    """Multi-head self-attention; q, k, v, out kept as separate kernels [D, N, H] / [N, H, D].

    torch's packed `in_proj_weight` (3D, D) rows [q; k; v] map to these by `convert.py`.
    """

    num_heads: int
    init: dict
    dtype: jnp.dtype = jnp.float32
    attention_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        if d % self.num_heads:
            raise ValueError(f"width {d} is not divisible by num_heads {self.num_heads}")
        h = d // self.num_heads
        x = x.astype(self.dtype)

        def proj(name: str, kernel_init: Initializer) -> jax.Array:
            kernel = self.param(f"{name}_kernel", nn.with_logical_partitioning(
                lambda k, s, t=jnp.float32: kernel_init(k, (d, d), t).reshape(s), ("embed", "heads", "kv")),
                (d, self.num_heads, h))
            bias = self.param(f"{name}_bias", nn.with_logical_partitioning(zeros, ("heads", "kv")),
                              (self.num_heads, h))
            return jnp.einsum("btd,dnh->btnh", x, kernel.astype(self.dtype)) + bias.astype(self.dtype)

        q = proj("query", self.init["qkv"])
        k = proj("key", self.init["qkv"])
        v = proj("value", self.init["qkv"])
        impl = resolve_attention_impl(self.attention_impl, self.dtype)
        try:
            o = jax.nn.dot_product_attention(q, k, v, implementation=impl)
        except (ValueError, NotImplementedError):
            if impl != "cudnn" or self.attention_impl != "auto":
                raise
            o = jax.nn.dot_product_attention(q, k, v, implementation="xla")  # shape not cuDNN-able
        out_kernel = self.param("out_kernel", nn.with_logical_partitioning(
            lambda k_, s, t=jnp.float32: self.init["out"](k_, (d, d), t).reshape(s), ("heads", "kv", "embed")),
            (self.num_heads, h, d))
        out_bias = self.param("out_bias", nn.with_logical_partitioning(zeros, ("embed",)), (d,))
        return jnp.einsum("btnh,nhd->btd", o, out_kernel.astype(self.dtype)) + out_bias.astype(self.dtype)


class ResidualBlock(nn.Module):
    """open_clip ResidualAttentionBlock (pre-norm), REFERENCE §1.1."""

    num_heads: int
    mlp_dim: int
    ln_eps: float
    quick_gelu: bool
    init: dict
    dtype: jnp.dtype = jnp.float32
    attention_impl: str = "auto"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d = x.shape[-1]
        y = LayerNorm(self.ln_eps, self.dtype, name="ln_1")(x)
        x = x + Attention(self.num_heads, self.init, self.dtype, self.attention_impl, name="attn")(y)
        y = LayerNorm(self.ln_eps, self.dtype, name="ln_2")(x)
        y = Linear(self.mlp_dim, ("embed", "mlp"), self.init["fc"], self.init["fc_bias"](d),
                   self.dtype, name="c_fc")(y)
        y = gelu(y, self.quick_gelu)
        y = Linear(d, ("mlp", "embed"), self.init["proj"], self.init["proj_bias"](self.mlp_dim),
                   self.dtype, name="c_proj")(y)
        x = x + y
        # Name the residual stream so a remat policy or sharding constraint can refer to it.
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class Encoder(nn.Module):
    """`layers` residual blocks named `resblocks_{i}` (torch: `transformer.resblocks.{i}`)."""

    layers: int
    num_heads: int
    mlp_dim: int
    ln_eps: float
    quick_gelu: bool
    init: dict
    dtype: jnp.dtype = jnp.float32
    attention_impl: str = "auto"
    remat: str = "none"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"unknown remat policy {self.remat!r}; choose from {sorted(REMAT_POLICIES)}")
        block = ResidualBlock
        if self.remat != "none":
            block = nn.remat(ResidualBlock, policy=REMAT_POLICIES[self.remat])
        for i in range(self.layers):
            x = block(self.num_heads, self.mlp_dim, self.ln_eps, self.quick_gelu, self.init,
                      self.dtype, self.attention_impl, name=f"resblocks_{i}")(x)
        return x


def block_init(width: int, layers: int, mlp_dim: int, style: str) -> dict:
    """Initialisers for one tower's blocks.

    'torch' (vision, REFERENCE §1.2: PyTorch defaults): MHA in_proj xavier_uniform over the
    packed (3D, D) matrix, zero attention biases, out_proj and Linear weights and biases
    kaiming_uniform(a=sqrt(5)) = U(+-1/sqrt(fan_in)).
    'open_clip_text' (TextTransformer.init_parameters, REFERENCE §1.3); Linear biases keep
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
