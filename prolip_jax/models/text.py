"""ProLIP text tower: a bidirectional Transformer with [UNC] and [CLS] appended (REFERENCE §1.3).

Token layout `[t_0 .. t_{L-1}, UNC, CLS]` + position rows 0..L+1 (the reference slices
`positional_embedding[:L + 2]`, so a shorter input moves UNC/CLS to rows L, L+1); **no
attention mask at all** (no causal mask, pad tokens attend and are attended to); `ln_final`
on CLS only; mu = Linear(CLS) with bias. As coded in the reference, text log sigma^2 is
`text_uncertainty_projection(mu_unnormalised)`: the [UNC] output is computed but unused, and
[UNC] affects log sigma^2 only through attention (the paper's §3.1 holds for images only).

The same module is the deterministic CLIP / SigLIP text tower (`TextConfig` options):

    family                 positional_embedding rows   mask     pooled token        text_projection
    ProLIP                 context_length + 2          none     appended [CLS]      kernel + bias
    OpenAI / open_clip     context_length              causal   argmax(token id)    kernel only
    SigLIP (open_clip,     context_length              none     last                kernel + bias
      big_vision)

`cls_emb`, `unc_emb` and `text_uncertainty_projection` exist only for ProLIP (embed_unc).
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from prolip_jax.models.config import TextConfig
from prolip_jax.models.transformer import Encoder, LayerNorm, Linear, block_init, constant, normal, zeros


class TextTower(nn.Module):
    config: TextConfig
    embed_dim: int
    quick_gelu: bool = False
    dtype: jnp.dtype = jnp.float32
    attention_impl: str = "auto"
    remat: str = "none"

    @nn.compact
    def __call__(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """tokens int [B, L] with L <= context_length -> (mu [B, E] unnormalised, log sigma^2 [B, E]
        or None without [UNC])."""
        c = self.config
        b, length = tokens.shape
        if length > c.context_length:
            raise ValueError(f"token sequence length {length} exceeds context_length {c.context_length}")
        d = c.width

        table = self.param("token_embedding", nn.with_logical_partitioning(normal(0.02), ("vocab", "embed")),
                           (c.vocab_size, d))
        x = jnp.take(table, tokens, axis=0).astype(self.dtype)
        prolip = c.pool == "prolip"
        if prolip:
            cls = self.param("cls_emb", nn.with_logical_partitioning(normal(0.01), ("embed",)), (d,))
            unc = self.param("unc_emb", nn.with_logical_partitioning(normal(0.01), ("embed",)), (d,))
        pos = self.param("positional_embedding", nn.with_logical_partitioning(normal(0.01), ("pos", "embed")),
                         (c.context_length + 2 * prolip, d))
        if prolip:
            special = jnp.broadcast_to(jnp.stack([unc, cls]).astype(self.dtype), (b, 2, d))
            x = jnp.concatenate([x, special], axis=1)
        # open_clip slices positional_embedding[:seq_len] (transformer.py TextTransformer._embeds)
        x = x + pos[: x.shape[1]].astype(self.dtype)
        x = nn.with_logical_constraint(x, ("batch", "length", "embed"))

        act = "quick_gelu" if self.quick_gelu else c.act
        x = Encoder(c.layers, c.heads, c.mlp_dim, c.ln_eps, act,
                    block_init(d, c.layers, c.mlp_dim, "open_clip_text"), self.dtype,
                    self.attention_impl, self.remat, causal=c.causal, name="transformer")(x)

        # ln_final is per token: apply it to the pooled one only (open_clip text_global_pool).
        if c.pool == "argmax":  # OpenAI BPE: EOT has the largest id
            x = jnp.take_along_axis(x, jnp.argmax(tokens, axis=-1)[:, None, None], axis=1)
        pooled = LayerNorm(c.ln_eps, self.dtype, name="ln_final")(x[:, -1])
        mu = Linear(self.embed_dim, ("embed", "proj"), normal(d ** -0.5), zeros if c.proj_bias else None,
                    self.dtype, name="text_projection")(pooled)
        if not c.embed_unc:
            return mu.astype(jnp.float32), None
        logvar = Linear(self.embed_dim, ("proj_in", "proj"), normal(d ** -0.5), constant(c.init_unc_bias),
                        self.dtype, name="text_uncertainty_projection")(mu)
        return mu.astype(jnp.float32), logvar.astype(jnp.float32)
