"""Pallas kernels for the blocks' row-wise work on the GPU (`BlockLevers.pallas_kernels`).

    layer_norm(x, scale, bias, eps, dtype)             -> LayerNorm(x) in `dtype`
    add_layer_norm(x, delta, scale, bias, eps, dtype)  -> (x + delta, LayerNorm(x + delta))
    bias_act(x, bias, act)                             -> act(x + bias)

Each computes what the XLA path computes (transformer.layer_norm, `x + attn` then ln_2, the MLP's
`c_fc` bias and GELU), forward and backward, to float32 rounding (tests/test_kernels.py). Why:
in the GPU profile of the B/16 step XLA runs the LayerNorm backward in three passes, one writing
dy * xhat as a float32 [B*T, D] array for the scale's column sum, and the GELU backward with the
bias gradient as a kernel of its own (docs/performance.md, "GPU train step"). Here each is one
pass over its rows: a program holds a block of whole rows (the width padded to a power of two,
as Triton requires, and masked), so the row statistics, the normalised rows and each block's
column sums of the parameter gradients come out of one read; the blocks' column sums add up in
XLA. On a GPU they compile with Triton; elsewhere (the CPU tests) Pallas interprets them.

Under a mesh that splits the batch the kernels run per shard (`jax.shard_map`): XLA cannot
partition a Triton call and would gather its operands onto every device.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.sharding import PartitionSpec as P

from prolip_jax.core.models.activations import gelu
from prolip_jax.core.sharding import BATCH_AXES

# Elements in one program's tile of rows: rows = this / the padded width (8 rows of 768 -> 1024).
TILE_ELEMENTS = 8192
COLUMNS = 1024  # bias_act's programs also split the width (an MLP's 3072 or 4096)
NUM_WARPS = 4


def traced_platform() -> str | None:
    """The platform of the mesh being traced under (the step's, or a TPU topology's on a CPU
    host), None where nothing names one (then lax.platform_dependent decides when lowering)."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None)


# ------------------------------------------------------------------------------ the arithmetic
@jax.custom_jvp
def erf(x: jax.Array) -> jax.Array:
    """float32 erf as a rational function on [-4, 4] (Eigen's and XLA's own float32 erf; beyond
    4 it is +-1 in float32): Pallas's Triton lowering has no erf."""
    x = jnp.clip(x, -4.0, 4.0)
    x2 = x * x
    p = functools.reduce(lambda acc, c: acc * x2 + c, (
        2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05, -7.34990630326855e-04,
        -2.95459980854025e-03, -1.60960333262415e-02), jnp.full_like(x, -2.72614225801306e-10))
    q = functools.reduce(lambda acc, c: acc * x2 + c, (
        -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03, -1.42647390514189e-02),
        jnp.full_like(x, -1.45660718464996e-05))
    return x * p / q


# Its derivative is erf's own, 2 / sqrt(pi) exp(-x^2), not the rational function's.
erf.defjvp(lambda primals, tangents: (erf(primals[0]), 2.0 / math.sqrt(math.pi) * jnp.exp(-primals[0] ** 2) * tangents[0]))


def activation(z: jax.Array, act: str) -> jax.Array:
    """activations.gelu in float32, with the erf above."""
    return gelu(z, act, erf=erf)


def activation_grad(z: jax.Array, act: str) -> jax.Array:
    """d activation / dz, elementwise (forward-mode autodiff of `activation`)."""
    return jax.jvp(functools.partial(activation, act=act), (z,), (jnp.ones_like(z),))[1]


# ------------------------------------------------------------------------------ kernels
# A program's refs are blocks of a power-of-two shape over arrays that they may overhang (the last
# block of rows, the padded width). Every access is masked: Triton computes the overhang's
# addresses from the array's strides (a padded row's tail is the next row's head), and Pallas's
# interpreter fills it with NaN.
def _masks(shape: tuple[int, int], n: int, d: int, col_block=0):
    """(tile, rows, cols) masks of a (rows, width) block: inside the [n, d] array."""
    rows = pl.program_id(0) * shape[0] + jax.lax.broadcasted_iota(jnp.int32, (shape[0],), 0) < n
    cols = col_block * shape[1] + jax.lax.broadcasted_iota(jnp.int32, (shape[1],), 0) < d
    return rows[:, None] & cols[None, :], rows, cols


def _load(ref, mask) -> jax.Array:
    """The block as float32, 0 where `mask` is False."""
    return plt.load(ref, mask=mask, other=0).astype(jnp.float32)


def _store(ref, value: jax.Array, mask) -> None:
    plt.store(ref, value.astype(ref.dtype), mask=mask)


def _ln_fwd_kernel(*refs, n, d, eps, residual):
    if residual:
        x_ref, delta_ref, scale_ref, bias_ref, y_ref, h_ref, mean_ref, rstd_ref = refs
    else:
        x_ref, scale_ref, bias_ref, y_ref, mean_ref, rstd_ref = refs
    inside, rows, cols = _masks(x_ref.shape, n, d)
    h = _load(x_ref, inside)
    if residual:  # the residual stream, rounded to its dtype as `x + delta` is, then normalised
        h = (h + _load(delta_ref, inside)).astype(h_ref.dtype)
        _store(h_ref, h, inside)
        h = h.astype(jnp.float32)
    mean = jnp.sum(h, axis=1) / d
    centred = jnp.where(inside, h - mean[:, None], 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(centred * centred, axis=1) / d + eps)
    y = centred * rstd[:, None] * _load(scale_ref, cols)[None, :] + _load(bias_ref, cols)[None, :]
    _store(y_ref, y, inside)
    _store(mean_ref, mean, rows)
    _store(rstd_ref, rstd, rows)


def _ln_bwd_kernel(*refs, n, d, residual):
    if residual:
        h_ref, dy_ref, dh_ref, scale_ref, mean_ref, rstd_ref, dx_ref, dscale_ref, dbias_ref = refs
    else:
        h_ref, dy_ref, scale_ref, mean_ref, rstd_ref, dx_ref, dscale_ref, dbias_ref = refs
    inside, rows, cols = _masks(h_ref.shape, n, d)
    mean, rstd = _load(mean_ref, rows), _load(rstd_ref, rows)
    xhat = jnp.where(inside, (_load(h_ref, inside) - mean[:, None]) * rstd[:, None], 0.0)
    dy = _load(dy_ref, inside)
    g = dy * _load(scale_ref, cols)[None, :]
    # The closed form of transformer._layer_norm_bwd: two row means of the scaled gradient.
    mean_g = jnp.sum(g, axis=1) / d
    mean_gx = jnp.sum(g * xhat, axis=1) / d
    dx = rstd[:, None] * (g - mean_g[:, None] - xhat * mean_gx[:, None])
    if residual:  # the stream's own gradient passes through the add
        dx = dx + _load(dh_ref, inside)
    _store(dx_ref, dx, inside)
    _store(dscale_ref, jnp.sum(dy * xhat, axis=0)[None, :], cols[None, :])
    _store(dbias_ref, jnp.sum(dy, axis=0)[None, :], cols[None, :])


def _bias_act_fwd_kernel(x_ref, b_ref, y_ref, *, n, d, act):
    inside, _, cols = _masks(x_ref.shape, n, d, pl.program_id(1))
    z = _load(x_ref, inside) + _load(b_ref, cols)[None, :]
    _store(y_ref, activation(z, act), inside)


def _bias_act_bwd_kernel(x_ref, b_ref, dy_ref, dx_ref, db_ref, *, n, d, act):
    inside, _, cols = _masks(x_ref.shape, n, d, pl.program_id(1))
    z = _load(x_ref, inside) + _load(b_ref, cols)[None, :]
    dz = _load(dy_ref, inside) * activation_grad(z, act)  # 0 outside: dy is
    _store(dx_ref, dz, inside)
    _store(db_ref, jnp.sum(dz, axis=0)[None, :], cols[None, :])


# ------------------------------------------------------------------------------ calls
def _call(kernel, out_shape, grid, in_specs, out_specs, **static):
    """The kernel compiled by Triton on a GPU, interpreted by Pallas elsewhere."""
    def call(interpret: bool):
        return pl.pallas_call(
            functools.partial(kernel, **static), out_shape=out_shape, grid=grid, in_specs=in_specs,
            out_specs=out_specs, interpret=interpret,
            compiler_params=plt.CompilerParams(num_warps=NUM_WARPS, num_stages=1))

    platform = traced_platform()
    if platform is not None:
        return call(platform != "gpu")
    return lambda *args: jax.lax.platform_dependent(*args, cuda=call(False), default=call(True))


def _row_tiles(n: int, d: int):
    """(programs, padded width, block specs) for whole rows of width d: a tile of rows, a
    parameter vector, a per-row vector (the statistics), a row of column sums per program."""
    width = pl.next_power_of_2(d)
    rows = max(1, TILE_ELEMENTS // width)
    specs = (pl.BlockSpec((rows, width), lambda i: (i, 0)), pl.BlockSpec((width,), lambda i: (0,)),
             pl.BlockSpec((rows,), lambda i: (i,)), pl.BlockSpec((1, width), lambda i: (i, 0)))
    return pl.cdiv(n, rows), specs


def _per_shard(fn, n_in: int, n_whole: int, n_out: int):
    """fn on each batch shard where the traced mesh splits the batch: its first n_in arguments and
    every output split along their leading axis, the next n_whole (parameters) whole."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = tuple(a for a in BATCH_AXES if a in getattr(mesh, "axis_names", ()) and mesh.shape[a] > 1)
    if not axes:
        return fn
    rows, whole = P(axes), P()
    return jax.shard_map(fn, mesh=mesh, in_specs=(rows,) * n_in + (whole,) * n_whole,
                         out_specs=(rows,) * n_out if n_out > 1 else rows, check_vma=False)


def _ln_forward(x, delta, scale, bias, eps, dtype):
    """(y, h, mean, rstd) of h = x ([N, D]) or x + delta."""
    n, d = x.shape
    programs, (tile, vec, row, _) = _row_tiles(n, d)
    residual = delta is not None
    out_shape = [jax.ShapeDtypeStruct((n, d), dtype)] + [jax.ShapeDtypeStruct((n, d), x.dtype)] * residual \
        + [jax.ShapeDtypeStruct((n,), jnp.float32)] * 2
    ins = [x, delta] if residual else [x]
    outs = _call(_ln_fwd_kernel, out_shape, (programs,), [tile] * len(ins) + [vec, vec],
                 [tile] * (1 + residual) + [row, row], n=n, d=d, eps=eps, residual=residual)(*ins, scale, bias)
    y, h = outs[0], outs[1] if residual else x
    return y, h, outs[-2], outs[-1]


def _ln_backward(h, dy, dh, scale, mean, rstd):
    """(dx, dscale, dbias): dx includes dh (the stream's gradient) when given."""
    n, d = h.shape
    programs, (tile, vec, row, part) = _row_tiles(n, d)
    residual = dh is not None
    ins = [h, dy, dh] if residual else [h, dy]
    out_shape = [jax.ShapeDtypeStruct((n, d), h.dtype)] + [jax.ShapeDtypeStruct((programs, d), jnp.float32)] * 2
    return _call(_ln_bwd_kernel, out_shape, (programs,), [tile] * len(ins) + [vec, row, row],
                 [tile, part, part], n=n, d=d, residual=residual)(*ins, scale, mean, rstd)


def _rows(x):
    return x.reshape(-1, x.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float, dtype) -> jax.Array:
    """transformer.layer_norm(x, scale, bias, eps).astype(dtype), one kernel each way."""
    return _layer_norm_fwd(x, scale, bias, eps, dtype)[0]


def _layer_norm_fwd(x, scale, bias, eps, dtype):
    def fwd(x, scale, bias):
        y, _, mean, rstd = _ln_forward(_rows(x), None, scale, bias, eps, dtype)
        return y.reshape(x.shape), mean, rstd

    y, mean, rstd = _per_shard(fwd, 1, 2, 3)(x, scale, bias)
    return y, (x, mean, rstd, scale)


def _layer_norm_bwd(eps, dtype, res, dy):
    def bwd(x, dy, mean, rstd, scale):
        dx, dscale, dbias = _ln_backward(_rows(x), _rows(dy), None, scale, mean, rstd)
        return dx.reshape(x.shape), dscale, dbias

    scale = res[-1]
    dx, dscale, dbias = _per_shard(bwd, 4, 1, 3)(res[0], dy, *res[1:])
    return dx, dscale.sum(0).astype(scale.dtype), dbias.sum(0).astype(scale.dtype)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def add_layer_norm(x: jax.Array, delta: jax.Array, scale: jax.Array, bias: jax.Array, eps: float, dtype
                   ) -> tuple[jax.Array, jax.Array]:
    """(h, LayerNorm(h)) for h = x + delta (the residual stream after a branch, and the next
    branch's normalised input), one kernel each way."""
    return _add_layer_norm_fwd(x, delta, scale, bias, eps, dtype)[0]


def _add_layer_norm_fwd(x, delta, scale, bias, eps, dtype):
    def fwd(x, delta, scale, bias):
        y, h, mean, rstd = _ln_forward(_rows(x), _rows(delta), scale, bias, eps, dtype)
        return h.reshape(x.shape), y.reshape(x.shape), mean, rstd

    h, y, mean, rstd = _per_shard(fwd, 2, 2, 4)(x, delta, scale, bias)
    return (h, y), (h, mean, rstd, scale)


def _add_layer_norm_bwd(eps, dtype, res, cotangents):
    dh, dy = cotangents

    def bwd(h, dy, dh, mean, rstd, scale):
        dx, dscale, dbias = _ln_backward(_rows(h), _rows(dy), _rows(dh), scale, mean, rstd)
        return dx.reshape(h.shape), dscale, dbias

    h, mean, rstd, scale = res
    dx, dscale, dbias = _per_shard(bwd, 5, 1, 3)(h, dy, dh, mean, rstd, scale)
    return dx, dx, dscale.sum(0).astype(scale.dtype), dbias.sum(0).astype(scale.dtype)


add_layer_norm.defvjp(_add_layer_norm_fwd, _add_layer_norm_bwd)


def _act_tiles(n: int, d: int):
    """(grid, block specs) for tiles of rows x columns: a tile, the bias's columns, a row of
    column sums per row of programs."""
    cols = min(COLUMNS, pl.next_power_of_2(d))
    rows = max(1, TILE_ELEMENTS // cols)
    specs = (pl.BlockSpec((rows, cols), lambda i, j: (i, j)), pl.BlockSpec((cols,), lambda i, j: (j,)),
             pl.BlockSpec((1, cols), lambda i, j: (i, j)))
    return (pl.cdiv(n, rows), pl.cdiv(d, cols)), specs


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def bias_act(x: jax.Array, bias: jax.Array, act: str) -> jax.Array:
    """activations.gelu(x + bias, act) in x's dtype, one kernel each way (the backward also
    gives the bias gradient's column sums)."""
    return _bias_act_fwd(x, bias, act)[0]


def _bias_act_fwd(x, bias, act):
    def fwd(x, bias):
        n, d = _rows(x).shape
        grid, (tile, vec, _) = _act_tiles(n, d)
        y = _call(_bias_act_fwd_kernel, jax.ShapeDtypeStruct((n, d), x.dtype), grid, [tile, vec], tile,
                  n=n, d=d, act=act)(_rows(x), bias)
        return y.reshape(x.shape)

    return _per_shard(fwd, 1, 1, 1)(x, bias), (x, bias)


def _bias_act_bwd(act, res, dy):
    def bwd(x, dy, bias):
        n, d = _rows(x).shape
        grid, (tile, vec, part) = _act_tiles(n, d)
        out_shape = (jax.ShapeDtypeStruct((n, d), x.dtype), jax.ShapeDtypeStruct((grid[0], d), jnp.float32))
        dx, db = _call(_bias_act_bwd_kernel, out_shape, grid, [tile, vec, tile], (tile, part), n=n, d=d,
                       act=act)(_rows(x), bias, _rows(dy))
        return dx.reshape(x.shape), db

    x, bias = res
    dx, db = _per_shard(bwd, 2, 1, 2)(x, dy, bias)
    return dx, db.sum(0).astype(bias.dtype)


bias_act.defvjp(_bias_act_fwd, _bias_act_bwd)
