"""Pooling and augmentation pieces of the other probabilistic VL models' heads.

* `GPO`: VSE∞'s Generalized Pooling Operator (Chen et al. 2021; naver-ai/pcmepp
  pcmepp/modules/aggr/gpo.py, copied from vse_infty lib/modules/aggr/gpo.py), which PCME++ puts
  on both its mu and log sigma^2 branches (PCME++ §2.1, Fig. 2). For a sample with n valid
  tokens: a sinusoidal encoding of the positions 0..n-1 runs through a bidirectional GRU
  (hidden size `dim`, outputs of both directions averaged), a bias-free Linear gives one score
  per position, w = softmax(score / 0.1) over the n positions, and the features, sorted in
  descending order *per dimension* over the n valid tokens, are summed with weights w. The
  weights depend on n only, so which tokens are valid (a pad mask, SizeAugment's dropped
  tokens) matters only through the set of valid features and its size.
* `size_augment_keep`: PCME++'s image SizeAugment (pcmepp/models/img_encoder.py
  `EncoderClipImageFull.forward_base`, after VSE∞): which output tokens GPO pools in training.
* `size_augment_tokens`: PCME++'s caption SizeAugment (pcmepp/datasets.py
  `process_caption_vit`): masking / random replacement / deletion of input tokens.

Parameters are float32 with logical axis names (GRU and score weights are tiny and named
`gpo_*`, which no sharding rule maps, so they are replicated).
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from prolip_jax.core.models.transformer import Linear, constant, uniform

GPO_TEMPERATURE = 0.1  # softmax(scores / 0.1), gpo.py compute_pool_weights
GPO_PAD_SCORE = -10000.0  # scores of padded positions, gpo.py


def positional_encoding_1d(dim: int, length: int) -> np.ndarray:
    """gpo.py `positional_encoding_1d`: pe[:, 0::2] = sin(k * f), pe[:, 1::2] = cos(k * f),
    f = exp(-(2i) log(10000) / dim); float32 [length, dim]."""
    if dim % 2:
        raise ValueError(f"sinusoidal positional encoding needs an even dim, got {dim}")
    pos = np.arange(length, dtype=np.float32)[:, None]
    div = np.exp(np.arange(0, dim, 2, dtype=np.float32) * -(math.log(10000.0) / dim))
    pe = np.zeros((length, dim), np.float32)
    pe[:, 0::2] = np.sin(pos * div)
    pe[:, 1::2] = np.cos(pos * div)
    return pe


class GRUParams(nn.Module):
    """The parameters of one direction of torch.nn.GRU, kernels stored (in, 3H) = torch
    `weight_ih_l0`.T with torch's gate order (r, z, n); init U(+-1/sqrt(H)) as torch."""

    hidden: int

    @nn.compact
    def __call__(self, in_features: int) -> tuple[jax.Array, ...]:
        h, init = self.hidden, uniform(self.hidden ** -0.5)
        return (self.param("w_ih", nn.with_logical_partitioning(init, ("gpo_in", "gpo_gates")), (in_features, 3 * h)),
                self.param("w_hh", nn.with_logical_partitioning(init, ("gpo_hidden", "gpo_gates")), (h, 3 * h)),
                self.param("b_ih", nn.with_logical_partitioning(init, ("gpo_gates",)), (3 * h,)),
                self.param("b_hh", nn.with_logical_partitioning(init, ("gpo_gates",)), (3 * h,)))


def bigru(x: jax.Array, valid: jax.Array, fwd: tuple[jax.Array, ...], bwd: tuple[jax.Array, ...]) -> jax.Array:
    """Bidirectional torch.nn.GRU over a packed batch, outputs of both directions averaged (gpo.py).

    x [B, K, F] float32, valid [B, K] a prefix mask -> [B, K, H] (0 where not valid). Per direction
        r = s(x W_ir + b_ir + h W_hr + b_hr),  z = s(x W_iz + b_iz + h W_hz + b_hz)
        n = tanh(x W_in + b_in + r * (h W_hn + b_hn)),  h' = (1 - z) * n + z * h
    from h = 0; the reverse direction starts at the last *valid* position, as a packed sequence
    (pack_padded_sequence) does. Both directions run in one scan (direction = a leading axis)."""
    w_ih, w_hh, b_ih, b_hh = (jnp.stack(pair) for pair in zip(fwd, bwd))  # [2, ...]
    hd = w_hh.shape[1]
    xs = jnp.stack([x, jnp.flip(x, axis=1)])  # [2, B, K, F]: time reversed for the backward GRU
    vs = jnp.stack([valid, jnp.flip(valid, axis=1)])  # [2, B, K]
    xi = jnp.einsum("dbkf,dfg->kdbg", xs, w_ih) + b_ih[None, :, None]  # [K, 2, B, 3H], time-major

    def step(h, inp):  # h [2, B, H]
        xk, vk = inp
        hh = jnp.einsum("dbh,dhg->dbg", h, w_hh) + b_hh[:, None]
        r = jax.nn.sigmoid(xk[..., :hd] + hh[..., :hd])
        z = jax.nn.sigmoid(xk[..., hd:2 * hd] + hh[..., hd:2 * hd])
        n = jnp.tanh(xk[..., 2 * hd:] + r * hh[..., 2 * hd:])
        h = jnp.where(vk[..., None], (1.0 - z) * n + z * h, 0.0)  # stays 0 before a reversed prefix
        return h, h

    _, out = jax.lax.scan(step, jnp.zeros((2, x.shape[0], hd), jnp.float32), (xi, vs.transpose(2, 0, 1)))
    return (out[:, 0] + jnp.flip(out[:, 1], axis=0)).transpose(1, 0, 2) / 2  # [B, K, H]


class GPO(nn.Module):
    """features [B, K, D], mask [B, K] (True = pooled) -> [B, D] (float32).

    Param names follow gpo.py: `gru_fwd` / `gru_bwd` (torch `gru`, `*_reverse`), `linear`."""

    dim: int = 32  # d_pe = d_hidden (GPO(32, 32) in VSE∞ and PCME++)

    def __call__(self, features: jax.Array, mask: jax.Array) -> jax.Array:
        return self.pool(features, mask)[0]

    @nn.compact
    def pool(self, features: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(pooled [B, D], pool weights [B, K]); gpo.py forward / compute_pool_weights."""
        b, k, _ = features.shape
        mask = jnp.asarray(mask, bool)
        n = mask.sum(axis=1, keepdims=True)  # [B, 1] valid tokens per sample
        valid = jnp.arange(k)[None, :] < n  # [B, K]: the first n sorted positions
        pe = jnp.where(valid[..., None], jnp.asarray(positional_encoding_1d(self.dim, k)), 0.0)
        fwd, bwd = GRUParams(self.dim, name="gru_fwd")(self.dim), GRUParams(self.dim, name="gru_bwd")(self.dim)
        out = bigru(pe, valid, fwd, bwd)
        w = self.param("linear", nn.with_logical_partitioning(uniform(self.dim ** -0.5), ("gpo_hidden", "gpo_score")),
                       (self.dim, 1))
        scores = jnp.where(valid, (out @ w)[..., 0], GPO_PAD_SCORE)
        weights = jax.nn.softmax(scores / GPO_TEMPERATURE, axis=1)  # [B, K]

        x = features.astype(jnp.float32)
        low = jnp.finfo(jnp.float32).min
        x = jnp.flip(jnp.sort(jnp.where(mask[..., None], x, low), axis=1), axis=1)  # descending per dim
        x = jnp.where(valid[..., None], x, 0.0)
        return jnp.einsum("bkd,bk->bd", x, weights), weights


def size_augment_keep(rng: jax.Array, batch: int, tokens: int, rate: float) -> jax.Array:
    """PCME++ / VSE∞ image SizeAugment: bool [B, T], the output tokens kept for pooling.

    Per sample u ~ U(0, 1); if u > rate, each token is kept iff its own v ~ U(0, 1) exceeds
    rate * u, else all are kept (img_encoder.py forward_base: `if prob > self.size_augment:
    selected = tokenwise_prob > self.size_augment * prob`). So a fraction 1 - rate of the
    samples drop each token with probability rate * u < rate, on average rate (1 + rate) / 2 of
    their tokens; overall (1 - rate) rate (1 + rate) / 2 of the tokens (9.6 % for rate 0.2)."""
    k1, k2 = jax.random.split(rng)
    u = jax.random.uniform(k1, (batch, 1))
    v = jax.random.uniform(k2, (batch, tokens))
    return (u <= rate) | (v > rate * u)


def size_augment_tokens(rng: jax.Array, tokens: jax.Array, *, rate: float, vocab_size: int, pad_id: int,
                        mask_id: int, masking: float = 0.5, erasing: float = 0.1,
                        protected_ids: tuple[int, ...] = ()) -> jax.Array:
    """PCME++ caption SizeAugment on int tokens [B, L] (pads at the end).

    Every token that is neither `pad_id` nor protected is picked with probability `rate`; with
    p ~ U(0, 1) and q = p / rate for a picked one, q < masking -> `mask_id`, q < masking + erasing
    -> a uniform id in [0, vocab_size), otherwise the token is deleted: later tokens move left
    and the row is refilled with `pad_id` (datasets.py process_caption_vit, whose SOT / EOT are
    never touched: pass them as `protected_ids`; with SigLIP's vocabulary EOS is the pad)."""
    k1, k2 = jax.random.split(rng)
    p = jax.random.uniform(k1, tokens.shape)
    content = (tokens != pad_id) & ~jnp.isin(tokens, jnp.asarray(protected_ids or (pad_id,), tokens.dtype))
    picked = content & (p < rate)
    q = p / rate
    out = jnp.where(picked & (q < masking), jnp.asarray(mask_id, tokens.dtype), tokens)
    rand = jax.random.randint(k2, tokens.shape, 0, vocab_size, dtype=tokens.dtype)
    out = jnp.where(picked & (q >= masking) & (q < masking + erasing), rand, out)
    deleted = picked & (q >= masking + erasing)
    order = jnp.argsort(deleted, axis=1, stable=True)  # kept tokens first, in order
    out = jnp.take_along_axis(out, order, axis=1)
    n_kept = (~deleted).sum(axis=1, keepdims=True)
    return jnp.where(jnp.arange(tokens.shape[1])[None, :] < n_kept, out, jnp.asarray(pad_id, tokens.dtype))


def xavier_uniform(fan_in: int, fan_out: int):
    """torch `uniform_(-r, r)`, r = sqrt(6 / (fan_in + fan_out)) (pcmepp img_encoder.py init_weights)."""
    return uniform((6.0 / (fan_in + fan_out)) ** 0.5)


def unc_projection(x: jax.Array, embed_dim: int, covariance: str, kernel_init, bias: float,
                   dtype: jnp.dtype) -> jax.Array:
    """The log sigma^2 branch's own Linear(width -> embed_dim), named `unc_projection`, created
    in the calling (compact) module. covariance 'spherical': Linear(width -> 1), broadcast to
    embed_dim (Pishdad et al. §4.2 'spherical-one value': one variance per input)."""
    features = 1 if covariance == "spherical" else embed_dim
    y = Linear(features, ("embed", "proj"), kernel_init(x.shape[-1], features), constant(bias), dtype,
               name="unc_projection")(x)
    return jnp.broadcast_to(y, (*y.shape[:-1], embed_dim)) if features == 1 else y
