"""PPCL, ProLIP's probabilistic pairwise contrastive loss (Chun et al., "Probabilistic
Language-Image Pre-Training" §3.2 eq. 2), on one device and over a device mesh.

`ppcl_loss` is the formula. Over a mesh, `global_ppcl_loss` / `make_ppcl_loss` give exactly
`ppcl_loss` of the gathered batch: -sum log sigmoid(z_ij l_ij) over all B x B pairs /
B_global, z = +1 on the global diagonal and -1 elsewhere. This is the intended loss of
naver-ai/prolip src/prolip/loss.py, not the reference ring, which for even world sizes skips the opposite rank's
texts and counts another block twice.

- "dense" (`ppcl_loss_sharded`): `ppcl_loss` under jit with the batch sharded; the
  compiler gathers the texts and row-shards the [B, B] logits: O(b * B) memory per device.
- "ring" (`ppcl_loss_ring`): `shard_map`; each device keeps its b = B / n images and texts,
  scores its own [b, b] block (the positives), then passes the text block around the ring
  n - 1 times with `ppermute`, adding negative-only [b, b] blocks: O(b^2 + b D) per device.
  Across slices (a hybrid mesh, prolip_jax/core/sharding.py) the texts cross DCN once and the
  ring stays within each slice.
  Plain autodiff of the loop would stack all n blocks' residuals (O(b * B) again), so the
  backward pass is a second ring (custom_vjp) that recomputes each block and carries the text
  gradients along with the text block back to their owner.

Usage (see `make_ppcl_loss`): `fn = make_ppcl_loss("ring", mesh)` has the signature of
`ppcl_loss` and can be used inside the jitted train step.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prolip_jax.core import sharding


# ------------------------------------------------------------------------------ the formula
def ppcl_logits(img_mu: jax.Array, img_logvar: jax.Array, txt_mu: jax.Array, txt_logvar: jax.Array,
                scale: jax.Array, bias: jax.Array) -> jax.Array:
    """[B_img, B_txt] logits a * (mu_v . mu_t - tr(S_v + S_t) / 2) + b, as the reference codes it.

    For unit mu this is -(a/2) CSD + (a + b). `scale` is a = exp(logit_scale), `bias` is b.
    """
    trace = jnp.sum(jnp.exp(img_logvar), -1)[:, None] + jnp.sum(jnp.exp(txt_logvar), -1)[None, :]
    return scale * (img_mu @ txt_mu.T - trace / 2.0) + bias


def ppcl_loss(img_mu: jax.Array, img_logvar: jax.Array, txt_mu: jax.Array, txt_logvar: jax.Array,
              scale: jax.Array, bias: jax.Array, targets: jax.Array | None = None) -> jax.Array:
    """-sum log sigmoid(z_ij * logit_ij) / B with z = 2I - 1 (ProLIP eq. 2, naver-ai/prolip src/prolip/loss.py).

    targets: [B_img, B_txt] match targets m in [0, 1] instead of the identity; the loss is then
    the BCE -sum [m log sigmoid(l) + (1 - m) log sigmoid(-l)] / B, which for 0/1 targets is
    the same sum with z = 2m - 1 (several positives per row: identical captions, one image's
    captions) and for fractional m the soft labels of MSDA (PCME++, "Improved Probabilistic
    Image-Text Representations" §2.4)."""
    logits = ppcl_logits(img_mu, img_logvar, txt_mu, txt_logvar, scale, bias)
    if targets is None:
        labels = 2.0 * jnp.eye(logits.shape[0], logits.shape[1], dtype=logits.dtype) - 1.0
        return -jnp.sum(jax.nn.log_sigmoid(labels * logits)) / img_mu.shape[0]
    t = targets.astype(logits.dtype)
    return -jnp.sum(t * jax.nn.log_sigmoid(logits) + (1.0 - t) * jax.nn.log_sigmoid(-logits)) / img_mu.shape[0]


# ------------------------------------------------------------------------------ over a mesh
IMPLS = ("dense", "ring")
DEFAULT_BATCH_AXES = ("data", "fsdp")
PPCLFn = Callable[..., jax.Array]  # (img_mu, img_logvar, txt_mu, txt_logvar, scale, bias) -> []


def mesh_batch_axes(mesh: Mesh, batch_axes: str | Sequence[str] = DEFAULT_BATCH_AXES) -> tuple[str, ...]:
    """The axes of `batch_axes` present in `mesh`, in order; the others replicate the loss."""
    names = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes)
    return tuple(a for a in names if a in mesh.axis_names)


def _check_batch(img_mu: jax.Array, txt_mu: jax.Array, n: int) -> None:
    if img_mu.shape[0] != txt_mu.shape[0]:
        raise ValueError(f"PPCL needs paired batches, got {img_mu.shape[0]} images, {txt_mu.shape[0]} texts")
    if img_mu.shape[0] % n:
        raise ValueError(f"global batch {img_mu.shape[0]} does not divide over {n} batch shards")


# ------------------------------------------------------------------------------------ dense
def ppcl_loss_sharded(img_mu: jax.Array, img_logvar: jax.Array, txt_mu: jax.Array, txt_logvar: jax.Array,
                      scale: jax.Array, bias: jax.Array, mesh: Mesh,
                      batch_axes: str | Sequence[str] = DEFAULT_BATCH_AXES) -> jax.Array:
    """Option (a): `ppcl_loss` on [B, D] inputs constrained to rows over `batch_axes`."""
    axes = mesh_batch_axes(mesh, batch_axes)
    _check_batch(img_mu, txt_mu, math.prod(mesh.shape[a] for a in axes))
    rows = NamedSharding(mesh, P(axes or None))
    im, il, tm, tl = (jax.lax.with_sharding_constraint(x, rows) for x in (img_mu, img_logvar, txt_mu, txt_logvar))
    return ppcl_loss(im, il, tm, tl, scale, bias)


# ------------------------------------------------------------------------------------- ring
def _block_loss(img_mu: jax.Array, img_tr: jax.Array, txt_mu: jax.Array, txt_tr: jax.Array,
                scale: jax.Array, bias: jax.Array, diagonal: bool) -> jax.Array:
    """-sum log sigmoid(z * logits) of one block: images [b, D], texts [c, D] (c = b, or the
    b rows of every slice), tr = sum exp(logvar).

    Same arithmetic as `ppcl_logits`; z = +1 on the own block's diagonal (the first b columns),
    else -1.
    """
    logits = scale * (img_mu @ txt_mu.T - (img_tr[:, None] + txt_tr[None, :]) / 2.0) + bias
    if diagonal:
        labels = 2.0 * jnp.eye(logits.shape[0], logits.shape[1], dtype=logits.dtype) - 1.0
        return -jnp.sum(jax.nn.log_sigmoid(labels * logits))
    return -jnp.sum(jax.nn.log_sigmoid(-logits))


# A ring layout (n, slices): n positions (the batch axes flattened, row-major) in `slices`
# contiguous runs of k = n / slices, one per slice (the hybrid mesh's slice-major data axis).
Layout = tuple[int, int]


def _shift(x, axes: tuple[str, ...], layout: Layout):
    """Send a pytree from ring position i to i + 1 within its slice."""
    n, slices = layout
    k = n // slices
    return jax.lax.ppermute(x, axes, perm=[(p, p - p % k + (p % k + 1) % k) for p in range(n)])


def _across(x, axes: tuple[str, ...], layout: Layout, hop: int):
    """Send a pytree from each position to the same position `hop` slices on (over DCN)."""
    n, slices = layout
    k = n // slices
    return jax.lax.ppermute(x, axes, perm=[(p, (p + hop * k) % n) for p in range(n)])


def _gather_slices(x, axes: tuple[str, ...], layout: Layout):
    """Rows [b] -> [slices * b]: block j holds the same position's rows in slice s - j. Each
    row crosses DCN once per other slice, all positions at once."""
    slices = layout[1]
    if slices == 1:
        return x
    parts = [x] + [_across(x, axes, layout, j) for j in range(1, slices)]
    return jax.tree.map(lambda *blocks: jnp.concatenate(blocks), *parts)


def _return_slices(dx, axes: tuple[str, ...], layout: Layout):
    """The transpose of `_gather_slices`: block j's gradient goes back to slice s - j and is added."""
    slices = layout[1]
    if slices == 1:
        return dx
    b = jax.tree.leaves(dx)[0].shape[0] // slices
    block = lambda j: jax.tree.map(lambda g: g[j * b:(j + 1) * b], dx)  # noqa: E731
    total = block(0)
    for j in range(1, slices):
        total = jax.tree.map(jnp.add, total, _across(block(j), axes, layout, -j))
    return total


def _ring_loop(axes: tuple[str, ...], layout: Layout, img_mu, img_tr, txt_mu, txt_tr, scale, bias) -> jax.Array:
    """The own block, then the ring within the slice over the (gathered) text blocks."""
    def body(_, carry):
        t_mu, t_tr, total = carry
        t_mu, t_tr = _shift((t_mu, t_tr), axes, layout)  # after m hops: the block of position i - m
        return t_mu, t_tr, total + _block_loss(img_mu, img_tr, t_mu, t_tr, scale, bias, False)

    own = _block_loss(img_mu, img_tr, txt_mu, txt_tr, scale, bias, True)
    return jax.lax.fori_loop(1, layout[0] // layout[1], body, (txt_mu, txt_tr, own))[2]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring_sum(axes: tuple[str, ...], layout: Layout, img_mu, img_tr, txt_mu, txt_tr, scale, bias) -> jax.Array:
    """This device's share of the pair sum: its b images x all B texts. Runs inside shard_map.
    Over slices, each position first gathers its counterparts' texts from the other slices;
    the ring then runs within the slice on those blocks."""
    txt_mu, txt_tr = _gather_slices((txt_mu, txt_tr), axes, layout)
    return _ring_loop(axes, layout, img_mu, img_tr, txt_mu, txt_tr, scale, bias)


def _ring_sum_fwd(axes, layout, img_mu, img_tr, txt_mu, txt_tr, scale, bias):
    # Residuals: the local [b, D] inputs, the texts as gathered from the other slices (kept, so
    # that the backward pass does not send them over DCN again).
    txt_mu, txt_tr = _gather_slices((txt_mu, txt_tr), axes, layout)
    res = (img_mu, img_tr, txt_mu, txt_tr, scale, bias)
    return _ring_loop(axes, layout, *res), res


def _ring_sum_bwd(axes, layout, res, g):
    img_mu, img_tr, txt_mu, txt_tr, scale, bias = res

    def block_grads(t_mu, t_tr, diagonal):
        # Recompute one block and pull back g: 6 cotangents (img_mu, img_tr, t_mu, t_tr, scale, bias).
        f = functools.partial(_block_loss, diagonal=diagonal)
        return jax.vjp(f, img_mu, img_tr, t_mu, t_tr, scale, bias)[1](g)

    def body(_, carry):
        t_mu, t_tr, dt, acc = carry
        # The text gradients travel with their block, so each device adds its image rows' share.
        t_mu, t_tr, dt = _shift((t_mu, t_tr, dt), axes, layout)
        gi_mu, gi_tr, gt_mu, gt_tr, gs, gb = block_grads(t_mu, t_tr, False)
        dt = (dt[0] + gt_mu, dt[1] + gt_tr)
        acc = jax.tree.map(jnp.add, acc, (gi_mu, gi_tr, gs, gb))
        return t_mu, t_tr, dt, acc

    gi_mu, gi_tr, gt_mu, gt_tr, gs, gb = block_grads(txt_mu, txt_tr, True)
    _, _, dt, (di_mu, di_tr, ds, db) = jax.lax.fori_loop(
        1, layout[0] // layout[1], body, (txt_mu, txt_tr, (gt_mu, gt_tr), (gi_mu, gi_tr, gs, gb)))
    # Position i now holds the gradient of block i + 1 (k - 1 hops back): one more hop home, then
    # each slice's rows back to their slice.
    dt_mu, dt_tr = _return_slices(_shift(dt, axes, layout), axes, layout)
    return di_mu, di_tr, dt_mu, dt_tr, ds, db


_ring_sum.defvjp(_ring_sum_fwd, _ring_sum_bwd)


def ring_slices(mesh: Mesh, axes: tuple[str, ...]) -> int:
    """How many slices the ring's positions span (`sharding.mesh_slices`), when they fall into
    them in contiguous equal runs (the hybrid mesh's slice-major data axis); else 1: the plain
    ring, exact on any layout."""
    slices = sharding.mesh_slices(mesh)
    n = math.prod(mesh.shape[a] for a in axes)
    if slices == 1 or n % slices:
        return 1
    grid = np.moveaxis(mesh.devices, [mesh.axis_names.index(a) for a in axes], list(range(len(axes))))
    runs = [{sharding.slice_index(d) for d in run.flat} for run in grid.reshape(slices, n // slices, -1)]
    if any(len(ids) != 1 for ids in runs) or len(set.union(*runs)) != slices:
        return 1
    return slices


def ppcl_loss_ring(img_mu: jax.Array, img_logvar: jax.Array, txt_mu: jax.Array, txt_logvar: jax.Array,
                   scale: jax.Array, bias: jax.Array, mesh: Mesh,
                   batch_axes: str | Sequence[str] = DEFAULT_BATCH_AXES) -> jax.Array:
    """Option (b): `ppcl_loss` of the global batch, computed on a ring over `batch_axes`.

    img_mu, img_logvar, txt_mu, txt_logvar: [B, D], rows sharded (or resharded here) over the
    batch axes of `mesh` present in `batch_axes`; several axes form one ring over their
    flattened product, other mesh axes (e.g. "tensor") compute the same value redundantly.
    Over S slices (`ring_slices`) the texts cross DCN in one exchange (S - 1 blocks to every
    position at once) and the ring runs within each slice on blocks S times larger: a plain
    ring's n - 1 hops would each wait on DCN, and send S (n - 1) blocks over it, not n (S - 1).
    scale (a = exp(logit_scale)), bias (b): scalars, replicated. Returns the scalar loss.
    """
    axes = mesh_batch_axes(mesh, batch_axes)
    n = math.prod(mesh.shape[a] for a in axes)
    _check_batch(img_mu, txt_mu, n)
    if n == 1:
        return ppcl_loss(img_mu, img_logvar, txt_mu, txt_logvar, scale, bias)
    layout = (n, ring_slices(mesh, axes))

    def local(im, il, tm, tl, s, c):
        # Traces before the ring: a [b] vector travels instead of the [b, D] logvar block.
        it, tt = jnp.sum(jnp.exp(il), -1), jnp.sum(jnp.exp(tl), -1)
        # Make a, b device-varying so their pullback is psum'd once, outside the ring.
        s, c = jax.lax.pcast((s, c), axes, to="varying")
        return jax.lax.psum(_ring_sum(axes, layout, im, it, tm, tt, s, c), axes)

    rows = P(axes)
    total = jax.shard_map(local, mesh=mesh, in_specs=(rows,) * 4 + (P(), P()), out_specs=P())(
        img_mu, img_logvar, txt_mu, txt_logvar, jnp.asarray(scale), jnp.asarray(bias))
    return total / img_mu.shape[0]  # naver-ai/prolip src/prolip/loss.py: all pairs / B_global


# ------------------------------------------------------------------------------- dispatch
def global_ppcl_loss(impl: str, img_mu: jax.Array, img_logvar: jax.Array, txt_mu: jax.Array,
                     txt_logvar: jax.Array, scale: jax.Array, bias: jax.Array, mesh: Mesh | None = None,
                     batch_axes: str | Sequence[str] = DEFAULT_BATCH_AXES) -> jax.Array:
    """PPCL by `impl` in IMPLS; with no mesh, "dense" is plain `ppcl_loss` (single device)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown PPCL implementation {impl!r}; use one of {IMPLS}")
    args = (img_mu, img_logvar, txt_mu, txt_logvar, scale, bias)
    if mesh is None:
        if impl == "ring":
            raise ValueError("impl='ring' needs the mesh")
        return ppcl_loss(*args)
    fn = ppcl_loss_ring if impl == "ring" else ppcl_loss_sharded
    return fn(*args, mesh=mesh, batch_axes=batch_axes)


def make_ppcl_loss(impl: str = "dense", mesh: Mesh | None = None,
                   batch_axes: str | Sequence[str] = DEFAULT_BATCH_AXES) -> PPCLFn:
    """A function with `ppcl_loss`'s signature, for `prolip_loss(..., ppcl_fn=...)`."""
    if impl not in IMPLS:
        raise ValueError(f"unknown PPCL implementation {impl!r}; use one of {IMPLS}")
    if impl == "ring" and mesh is None:
        raise ValueError("impl='ring' needs the mesh")
    return functools.partial(global_ppcl_loss, impl, mesh=mesh, batch_axes=batch_axes)
