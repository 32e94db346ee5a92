"""A compact PyTorch re-statement of the reference ProLIP forward (naver-ai/prolip, naver-ai/prolip src/prolip/model.py).

Used only by the optional torch tests: module and parameter names reproduce the reference's
state_dict keys (so `load_state_dict(strict=True)` checks our exported keys and shapes), and
`test_torch_parity.py` first proves this module reproduces the golden fixture (made by the
real reference) before using it at other model sizes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class QuickGELU(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d, heads, mlp_ratio, eps, quick_gelu):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d, eps=eps)
        self.attn = nn.MultiheadAttention(d, heads)
        self.ln_2 = nn.LayerNorm(d, eps=eps)
        hidden = int(d * mlp_ratio)
        self.mlp = nn.Sequential()
        self.mlp.add_module("c_fc", nn.Linear(d, hidden))
        self.mlp.add_module("gelu", QuickGELU() if quick_gelu else nn.GELU())
        self.mlp.add_module("c_proj", nn.Linear(hidden, d))

    def forward(self, x):  # x: [L, N, D] (not batch-first, as open_clip)
        y = self.ln_1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self, d, layers, heads, mlp_ratio, eps, quick_gelu):
        super().__init__()
        self.resblocks = nn.ModuleList(
            [ResidualAttentionBlock(d, heads, mlp_ratio, eps, quick_gelu) for _ in range(layers)])

    def forward(self, x):
        for block in self.resblocks:
            x = block(x)
        return x


class Visual(nn.Module):
    def __init__(self, embed_dim, c, quick_gelu):
        super().__init__()
        d, p = c["width"], c["patch_size"]
        eps = (c.get("norm_kwargs") or {}).get("eps", 1e-5)
        n = (c["image_size"] // p) ** 2
        self.conv1 = nn.Conv2d(3, d, kernel_size=p, stride=p, bias=False)
        self.class_embedding = nn.Parameter(torch.randn(d))
        self.unc_embedding = nn.Parameter(torch.randn(d))
        self.positional_embedding = nn.Parameter(torch.randn(n + 2, d))
        self.ln_pre = nn.LayerNorm(d, eps=eps)
        self.transformer = Transformer(d, c["layers"], d // c.get("head_width", 64), c.get("mlp_ratio", 4.0), eps,
                                       quick_gelu)
        self.ln_post = nn.LayerNorm(d, eps=eps)
        self.proj = nn.Parameter(torch.randn(d, embed_dim))
        self.uncertainty_proj = nn.Linear(d, embed_dim)

    def forward(self, x, keep_idx=None):
        x = self.conv1(x).flatten(2).permute(0, 2, 1)
        pos = self.positional_embedding
        if keep_idx is not None:
            x = x.index_select(1, keep_idx)
            pos = pos.index_select(0, torch.cat([keep_idx.new_tensor([0, 1]), keep_idx + 2]))
        b = x.shape[0]
        x = torch.cat([self.class_embedding.expand(b, 1, -1), self.unc_embedding.expand(b, 1, -1), x], 1) + pos
        x = self.transformer(self.ln_pre(x).permute(1, 0, 2)).permute(1, 0, 2)
        x = self.ln_post(x)
        mean = self.ln_post(x[:, 0]) @ self.proj  # CLS gets ln_post twice
        return mean, self.uncertainty_proj(x[:, 1])


class Text(nn.Module):
    def __init__(self, embed_dim, c, quick_gelu):
        super().__init__()
        d = c["width"]
        eps = (c.get("norm_kwargs") or {}).get("eps", 1e-5)
        self.token_embedding = nn.Embedding(c["vocab_size"], d)
        self.cls_emb = nn.Parameter(torch.randn(d))
        self.unc_emb = nn.Parameter(torch.randn(d))
        self.positional_embedding = nn.Parameter(torch.randn(c["context_length"] + 2, d))
        self.transformer = Transformer(d, c["layers"], c["heads"], c.get("mlp_ratio", 4.0), eps, quick_gelu)
        self.ln_final = nn.LayerNorm(d, eps=eps)
        self.text_projection = nn.Linear(d, embed_dim)
        self.text_uncertainty_projection = nn.Linear(d, embed_dim)

    def forward(self, tokens):
        x = self.token_embedding(tokens)
        b, length = tokens.shape
        x = torch.cat([x, self.unc_emb.expand(b, 1, -1), self.cls_emb.expand(b, 1, -1)], 1)
        x = x + self.positional_embedding[: length + 2]
        x = self.transformer(x.permute(1, 0, 2)).permute(1, 0, 2)  # no attention mask at all
        mean = self.text_projection(self.ln_final(x[:, -1]))
        return mean, self.text_uncertainty_projection(mean)  # log sigma^2 from the projected CLS


class TorchProLIP(nn.Module):
    """Built from a reference config.json dict."""

    def __init__(self, config: dict):
        super().__init__()
        q = bool(config.get("quick_gelu", False))
        self.visual = Visual(config["embed_dim"], config["vision_cfg"], q)
        self.text = Text(config["embed_dim"], config["text_cfg"], q)
        self.logit_scale = nn.Parameter(torch.tensor(float(config.get("init_logit_scale", 2.302585))))
        self.logit_bias = nn.Parameter(torch.tensor(float(config.get("init_logit_bias", -10.0))))

    def encode_image(self, images, keep_idx=None):
        mean, logvar = self.visual(images, keep_idx)
        return F.normalize(mean, dim=-1), logvar

    def encode_text(self, tokens):
        mean, logvar = self.text(tokens)
        return F.normalize(mean, dim=-1), logvar
