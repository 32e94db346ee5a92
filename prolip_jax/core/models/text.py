"""ProLIP text tower: a bidirectional Transformer with [UNC] and [CLS] appended (naver-ai/prolip src/prolip/transformer.py TextTransformer).

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

`cls_emb`, `unc_emb` and `text_uncertainty_projection` exist only for ProLIP (embed_unc with
unc_head "unc_token").

The other papers' options (TextConfig fields; models/heads.py), as in vit.py: unc_head "block"
(PCME++: the last blocks duplicated, fresh init, with the tower's own causal mask; no ln_final
on that branch, pcmepp/modules/clip/model.py ProbTransformer / CLIP.encode_text), "embedding"
(Pishdad et al.: a duplicated projection on the same pooled feature), pool "gpo" (GPO over
the tokens that are not `pad_id`, after ln_final and text_projection per token, as PCME++'s
pcmepp/models/txt_encoder.py EncoderTextClip; its own Linear there, `text_projection` here),
and caption SizeAugment on the input tokens in training.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from prolip_jax.core.models.config import TextConfig
from prolip_jax.core.models.heads import GPO, size_augment_tokens, unc_projection
from prolip_jax.core.models.transformer import (BlockLevers, Encoder, LayerNorm, Linear, block_init, constant, normal,
                                          uniform, zeros)


class TextTower(nn.Module):
    config: TextConfig
    embed_dim: int
    quick_gelu: bool = False
    dtype: jnp.dtype = jnp.float32
    attention_impl: str = "auto"
    remat: str = "none"
    scan_layers: bool = False  # the blocks as one nn.scan (transformer.Encoder, models/layout.py)
    levers: BlockLevers = BlockLevers()  # GPU speed levers of the blocks

    @nn.compact
    def __call__(self, tokens: jax.Array, train: bool = False) -> tuple[jax.Array, jax.Array | None]:
        """tokens int [B, L] with L <= context_length -> (mu [B, E] unnormalised, log sigma^2 [B, E]
        or None for a mu-only tower). train: caption SizeAugment (size_augment > 0) on, drawing
        from the flax rng stream "augment"."""
        c = self.config
        b, length = tokens.shape
        if length > c.context_length:
            raise ValueError(f"token sequence length {length} exceeds context_length {c.context_length}")
        d = c.width
        if train and c.size_augment > 0:
            tokens = size_augment_tokens(
                self.make_rng("augment"), tokens, rate=c.size_augment, vocab_size=c.vocab_size, pad_id=c.pad_id,
                mask_id=c.size_augment_mask_id, masking=c.size_augment_masking, erasing=c.size_augment_erasing,
                protected_ids=c.size_augment_protected_ids)

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
        init = block_init(d, c.layers, c.mlp_dim, "open_clip_text")
        encoder = Encoder(c.layers, c.heads, c.mlp_dim, c.ln_eps, act, init, self.dtype,
                          self.attention_impl, self.remat, causal=c.causal, scan=self.scan_layers,
                          levers=self.levers, name="transformer")
        x_unc = None
        if c.embed_unc and c.unc_head == "block":  # the stream splits after block L - n
            x, x_fork = encoder(x, fork_after=c.layers - c.unc_layers)
            x_unc = Encoder(c.unc_layers, c.heads, c.mlp_dim, c.ln_eps, act, init, self.dtype, self.attention_impl,
                            self.remat, causal=c.causal, scan=self.scan_layers,
                            levers=self.levers, name="unc_transformer")(x_fork)
        else:
            x = encoder(x)
        ln_final = LayerNorm(c.ln_eps, self.dtype, name="ln_final")
        text_projection = Linear(self.embed_dim, ("embed", "proj"), normal(d ** -0.5),
                                 zeros if c.proj_bias else None, self.dtype, name="text_projection")

        if c.pool == "gpo":
            valid = tokens != c.pad_id
            feats = ln_final(x)
            mu = GPO(c.gpo_dim, name="gpo")(text_projection(feats), valid)
            if not c.embed_unc:
                return mu, None
            branch = x_unc if c.unc_head == "block" else feats
            return mu, GPO(c.gpo_dim, name="unc_gpo")(self._unc_projection(branch), valid)

        # ln_final is per token: apply it to the pooled one only (open_clip text_global_pool).
        def pool(seq: jax.Array) -> jax.Array:
            if c.pool == "argmax":  # OpenAI BPE: EOT has the largest id
                return jnp.take_along_axis(seq, jnp.argmax(tokens, axis=-1)[:, None, None], axis=1)[:, 0]
            return seq[:, -1]

        pooled = ln_final(pool(x))
        mu = text_projection(pooled)
        if not c.embed_unc:
            return mu.astype(jnp.float32), None
        if c.unc_head == "unc_token":
            spherical = c.covariance == "spherical"
            logvar = Linear(1 if spherical else self.embed_dim, ("proj_in", "proj"), normal(d ** -0.5),
                            constant(c.init_unc_bias), self.dtype, name="text_uncertainty_projection")(mu)
            logvar = jnp.broadcast_to(logvar, mu.shape) if spherical else logvar
        else:  # "block": the same token of the duplicated branch; "embedding": the same pooled feature
            logvar = self._unc_projection(pool(x_unc) if c.unc_head == "block" else pooled)
        return mu.astype(jnp.float32), logvar.astype(jnp.float32)

    def _unc_projection(self, x: jax.Array) -> jax.Array:
        """torch nn.Linear's default weight init U(+-1/sqrt(fan_in)), as PCME++'s std_linear
        (pcmepp/models/txt_encoder.py); bias init_unc_bias (PCME++: bias_init 0)."""
        c = self.config
        return unc_projection(x, self.embed_dim, c.covariance, lambda fan_in, _: uniform(fan_in ** -0.5),
                              c.init_unc_bias, self.dtype)
