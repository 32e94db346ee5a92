"""ProLIP image tower: a ViT with an extra [UNC] token (naver-ai/prolip src/prolip/transformer.py VisionTransformer).

Token layout `[CLS, UNC, patch_0 .. patch_{N-1}]` with position rows 0, 1, 2.. ; `ln_pre`,
the blocks, `ln_post` on the tokens, then a *second* `ln_post` on CLS only (a quirk of the
reference that parity needs); mu = CLS @ proj (no bias), log sigma^2 = Linear(UNC) with the
bias initialised to -10. The patch embedding is a stride-p convolution without bias.

The same module is the deterministic CLIP / SigLIP image tower (`VisionConfig` options):

    family          tokens (= positional_embedding rows)   pool        params only there
    ProLIP          CLS, UNC, patches   (grid^2 + 2)        tok (CLS)   unc_embedding, uncertainty_proj
    open_clip CLIP  CLS, patches        (grid^2 + 1)        tok (CLS)   -
    SigLIP          patches             (grid^2)            map         patch_bias, map_head

`ln_pre` and `proj` are absent for SigLIP (no pre-LN; the MAP output is the embedding), and
`class_embedding` without a class token. Only ProLIP (embed_unc) applies ln_post twice to CLS.

The other papers' options (VisionConfig.unc_head / pool "gpo"; models/heads.py), on the same
trunk and with the same parameter names where they share a part:

    unc_head    log sigma^2 from                                            params only there
    block       PCME++ (§2.1): blocks L-n..L-1 duplicated, fresh    unc_transformer,
                init, on the trunk's first L-n blocks; no LayerNorm on that  unc_projection
                branch (pcmepp/modules/clip/model.py ProbVisionTransformer)
    embedding   Pishdad et al. (§3.1): a duplicated projection on  unc_projection
                the same pooled feature as mu
    pool "gpo"  mu = GPO(proj(ln_post(every token))) (`gpo`); log sigma^2 = GPO of its own branch's
                projected tokens (`unc_gpo`); SizeAugment drops tokens from both in training.

PCME++ itself has no ln_post (the CLIP ViT's ln_post / proj are dropped) and projects with a
fresh Linear with bias (pcmepp/models/img_encoder.py EncoderImageAggr.fc); here mu keeps the
tower's ln_post and `proj`, so a CLIP / ProLIP warm start carries them over.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from prolip_jax.core.models.config import VisionConfig
from prolip_jax.core.models.heads import GPO, size_augment_keep, unc_projection, xavier_uniform
from prolip_jax.core.models.transformer import (BlockLevers, Encoder, LayerNorm, Linear, MAPHead, block_init, constant,
                                          normal, uniform)


class VisionTower(nn.Module):
    config: VisionConfig
    embed_dim: int
    quick_gelu: bool = False
    dtype: jnp.dtype = jnp.float32
    attention_impl: str = "auto"
    remat: str = "none"
    scan_layers: bool = False  # the blocks as one nn.scan (transformer.Encoder, models/layout.py)
    levers: BlockLevers = BlockLevers()  # GPU speed levers of the blocks

    @nn.compact
    def __call__(self, images: jax.Array, keep_idx: jax.Array | None = None, train: bool = False
                 ) -> tuple[jax.Array, jax.Array | None]:
        """images [B, H, W, 3] (normalised) -> (mu [B, E] unnormalised, log sigma^2 [B, E] or
        None without [UNC]).

        keep_idx: optional int [K] (shared by the batch, as the reference) or [B, K] patch
        indices in raster order to keep for the masked forward; the others are dropped before
        [CLS]/[UNC] are prepended and the position embeddings are gathered to match.
        train: SizeAugment (size_augment > 0) on, drawing from the flax rng stream "augment".
        """
        c = self.config
        b, h, w, ch = images.shape
        if (h, w, ch) != (c.image_size, c.image_size, 3):
            raise ValueError(f"expected images [B, {c.image_size}, {c.image_size}, 3], got {images.shape}")
        # The helpers run in this order because flax draws each parameter's init key from a
        # per-module counter: the order they create parameters in is the order of the values.
        x = self._tokens(self._embed_patches(images), keep_idx)
        if c.ln_pre:
            x = LayerNorm(c.ln_eps, self.dtype, name="ln_pre")(x)
        x, x_unc = self._encode(x)
        proj = None
        if c.proj:
            proj = self.param("proj", nn.with_logical_partitioning(normal(c.width ** -0.5), ("embed", "proj")),
                              (c.width, self.embed_dim)).astype(self.dtype)
        ln_post = LayerNorm(c.ln_eps, self.dtype, name="ln_post")
        if c.pool == "gpo":
            return self._gpo(ln_post(x), x_unc, proj, train)
        return self._pool_heads(x, x_unc, proj, ln_post)

    def _block_args(self) -> tuple[str, dict]:
        """(activation, initialisers) shared by the trunk, the uncertainty branch and the MAP head."""
        c = self.config
        return "quick_gelu" if self.quick_gelu else c.act, block_init(c.width, c.layers, c.mlp_dim, "torch")

    def _embed_patches(self, images: jax.Array) -> jax.Array:
        """images [B, H, W, 3] -> patch tokens [B, N, d]: Conv2d(3, d, k=p, s=p, bias=False), patches
        in raster (h, w) order (SigLIP's patch_bias added)."""
        c = self.config
        b, d, p, g = images.shape[0], c.width, c.patch_size, c.grid
        kernel = self.param("patch_kernel", nn.with_logical_partitioning(
            uniform((3 * p * p) ** -0.5), (None, None, None, "embed")), (p, p, 3, d))
        x = images.astype(self.dtype).reshape(b, g, p, g, p, 3)
        x = jnp.einsum("bgphqc,pqcd->bghd", x, kernel.astype(self.dtype)).reshape(b, g * g, d)
        if c.patch_bias:
            x = x + self.param("patch_bias", nn.with_logical_partitioning(
                uniform((3 * p * p) ** -0.5), ("embed",)), (d,)).astype(self.dtype)
        return x

    def _tokens(self, x: jax.Array, keep_idx: jax.Array | None) -> jax.Array:
        """Patch tokens [B, N, d] -> the encoder's input [B, prefix + K, d]: the kept patches
        (keep_idx, or all), [CLS]? [UNC]? prepended, position embeddings added to match."""
        c = self.config
        b, d = x.shape[0], c.width
        scale = d ** -0.5
        n_prefix = int(c.class_token) + int(c.unc_token)  # [CLS]? [UNC]? (ProLIP's) before the patches
        pos = self.param("positional_embedding", nn.with_logical_partitioning(
            normal(scale), ("pos", "embed")), (c.num_patches + n_prefix, d)).astype(self.dtype)
        pos_special, pos_patches = pos[:n_prefix], pos[n_prefix:]
        if keep_idx is not None:
            keep_idx = jnp.asarray(keep_idx, jnp.int32)
            if keep_idx.ndim == 1:
                x = jnp.take(x, keep_idx, axis=1)
                pos_patches = jnp.take(pos_patches, keep_idx, axis=0)
            else:
                x = jnp.take_along_axis(x, keep_idx[:, :, None], axis=1)
                pos_patches = jnp.take(pos_patches, keep_idx, axis=0)  # [B, K, d]
        special = []
        if c.class_token:
            special.append(self.param("class_embedding", nn.with_logical_partitioning(normal(scale), ("embed",)), (d,)))
        if c.unc_token:
            special.append(self.param("unc_embedding", nn.with_logical_partitioning(normal(scale), ("embed",)), (d,)))
        x = x + pos_patches
        if special:
            special = jnp.broadcast_to(jnp.stack(special).astype(self.dtype), (b, n_prefix, d))
            x = jnp.concatenate([special + pos_special, x], axis=1)
        return nn.with_logical_constraint(x, ("batch", "length", "embed"))

    def _encode(self, x: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(the trunk's output tokens, the uncertainty branch's tokens or None): unc_head "block"
        forks the stream after block L - n into its own copy of the last n blocks."""
        c = self.config
        act, init = self._block_args()
        encoder = Encoder(c.layers, c.heads, c.mlp_dim, c.ln_eps, act, init, self.dtype,
                          self.attention_impl, self.remat, scan=self.scan_layers, levers=self.levers,
                          name="transformer")
        if not (c.embed_unc and c.unc_head == "block"):
            return encoder(x), None
        x, x_fork = encoder(x, fork_after=c.layers - c.unc_layers)
        x_unc = Encoder(c.unc_layers, c.heads, c.mlp_dim, c.ln_eps, act, init, self.dtype,
                        self.attention_impl, self.remat, scan=self.scan_layers, levers=self.levers,
                        name="unc_transformer")(x_fork)
        return x, x_unc

    def _pool_heads(self, x: jax.Array, x_unc: jax.Array | None, proj: jax.Array | None, ln_post: nn.Module
                    ) -> tuple[jax.Array, jax.Array | None]:
        """pool "tok" or "map": (mu [B, E], log sigma^2 [B, E] or None) from the encoder's tokens."""
        c = self.config
        n_prefix = int(c.class_token) + int(c.unc_token)
        if c.pool == "tok":
            # ln_post is per token and only the prefix tokens are read, so apply it there only.
            pooled = ln_post(x[:, :n_prefix])
            mu_token = pooled[:, 0]
            if c.unc_token:
                mu_token = ln_post(mu_token)  # ProLIP's CLS gets ln_post twice (naver-ai/prolip src/prolip/transformer.py VisionTransformer step 6)
        else:  # "map": final norm on every token, then attention pooling (big_vision/timm SigLIP)
            pooled = ln_post(x)
            act, init = self._block_args()
            mu_token = MAPHead(c.heads, c.mlp_dim, c.ln_eps, act, init, self.dtype, self.attention_impl,
                               name="map_head")(pooled)

        mu = mu_token if proj is None else jnp.dot(mu_token, proj)
        if not c.embed_unc:
            return mu.astype(jnp.float32), None
        if c.unc_head == "unc_token":
            spherical = c.covariance == "spherical"
            unc_index = int(c.class_token)  # [UNC] follows [CLS] where there is one
            logvar = Linear(1 if spherical else self.embed_dim, ("embed", "proj"), normal(c.width ** -0.5),
                            constant(c.init_unc_bias), self.dtype, name="uncertainty_proj")(pooled[:, unc_index])
            logvar = jnp.broadcast_to(logvar, mu.shape) if spherical else logvar
        else:  # "block": the [CLS] of the duplicated branch; "embedding": the same pooled feature
            logvar = self._unc_projection(x_unc[:, 0] if c.unc_head == "block" else mu_token)
        return mu.astype(jnp.float32), logvar.astype(jnp.float32)

    def _unc_projection(self, x: jax.Array) -> jax.Array:
        c = self.config
        return unc_projection(x, self.embed_dim, c.covariance, xavier_uniform, c.init_unc_bias, self.dtype)

    def _gpo(self, tokens: jax.Array, x_unc: jax.Array | None, proj: jax.Array | None, train: bool
             ) -> tuple[jax.Array, jax.Array | None]:
        """pool 'gpo': every output token (ln_post'ed, projected) pooled by GPO; SizeAugment in
        training drops the same tokens from both branches (img_encoder.py forward_base)."""
        c = self.config
        b, t, _ = tokens.shape
        keep = jnp.ones((b, t), bool)
        if train and c.size_augment > 0:
            keep = size_augment_keep(self.make_rng("augment"), b, t, c.size_augment)
        mu = GPO(c.gpo_dim, name="gpo")(tokens if proj is None else jnp.einsum("btd,de->bte", tokens, proj), keep)
        if not c.embed_unc:
            return mu, None
        logvar = GPO(c.gpo_dim, name="unc_gpo")(self._unc_projection(x_unc if c.unc_head == "block" else tokens),
                                                keep)
        return mu, logvar
