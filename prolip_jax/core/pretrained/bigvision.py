"""big_vision SigLIP two-tower `.npz` checkpoints (e.g. `webli_en_b16_224_63724782.npz`).

The file holds flattened parameter paths (`params/img/...`, `params/txt/...`, `params/t`,
`params/b`; the `params/` prefix is optional, as big_vision utils.load_params accepts both).
Layouts matched (google-research/big_vision):
  models/vit.py `_Model` (name "img", pool_type="map", no head: SigLIP's out_dim=(None, E)):
    embedding/{kernel (p,p,3,D), bias}, pos_embedding (1, grid^2, D) added before any token,
    Transformer/encoderblock_{i}/{LayerNorm_0, MultiHeadDotProductAttention_0/{query,key,value,out},
    LayerNorm_1, MlpBlock_0/Dense_{0,1}}, Transformer/encoder_norm,
    MAPHead_0/{probe (1,1,D), MultiHeadDotProductAttention_0, LayerNorm_0, MlpBlock_0}
  models/proj/image_text/text_transformer.py `_Model` (name "txt", pool_type="last"):
    Embed_0/embedding (V, D), pos_embedding (1, L, D), Encoder_0/(same blocks, encoder_norm),
    head/{kernel, bias}
  models/proj/image_text/two_towers.py: t (1,) = log temperature, b (1,) = bias.
Flax kernels are already (D, heads, head_dim) etc., so every rule is a copy or drops unit axes.
Activations are flax `nn.gelu` (tanh approximation), LayerNorm eps 1e-6 (flax default).
The architecture is read off the shapes (heads from the attention kernels).
"""
from __future__ import annotations

import math
import re
from typing import Any, Mapping

import numpy as np

from prolip_jax.runtime import paths as fs
from prolip_jax.core.convert import Rule
from prolip_jax.core.models.config import ProLIPConfig, TextConfig, VisionConfig


def read_npz(path) -> dict[str, np.ndarray]:
    """Flat {path: float32 array} without the optional `params/` prefix; big_vision stores
    bfloat16 as raw 2-byte void (utils.recover_dtype), converted here."""
    try:
        with fs.open(path, "rb") as f, np.load(f, allow_pickle=False) as z:  # local or a bucket
            flat = {k: z[k] for k in z.files}
    except Exception as e:  # BadZipFile, truncated members, pickled object arrays
        raise ValueError(f"could not read {path} as an .npz archive: {e}") from e
    out = {}
    for k, v in flat.items():
        if v.dtype.kind == "V" and v.dtype.itemsize == 2:  # bfloat16 bits -> float32
            v = (v.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        out[k[len("params/"):] if k.startswith("params/") else k] = np.asarray(v, np.float32)
    return out


def normalise(flat: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Undo big_vision's storage variants: scanned blocks (`encoderblock/...` stacked over depth,
    vit.py scan_to_pyloop) and old text checkpoints' second posemb (text_transformer.py load)."""
    out = dict(flat)
    for k in [k for k in out if "/encoderblock/" in k]:
        stacked = out.pop(k)
        for i in range(stacked.shape[0]):
            out[k.replace("/encoderblock/", f"/encoderblock_{i}/")] = stacked[i]
    extra = out.pop("txt/Encoder_0/pos_embedding", None)
    if extra is not None and "txt/pos_embedding" in out:
        out["txt/pos_embedding"] = out["txt/pos_embedding"] + extra
    return out


def _blocks(src: str, dst: tuple[str, ...], layers: int) -> list[Rule]:
    rules = []
    for i in range(layers):
        s, f = f"{src}/encoderblock_{i}", dst + ("transformer", f"resblocks_{i}")
        rules += [Rule(f"{s}/LayerNorm_0/{p}", (f + ("ln_1", p),), "copy") for p in ("scale", "bias")]
        rules += [Rule(f"{s}/LayerNorm_1/{p}", (f + ("ln_2", p),), "copy") for p in ("scale", "bias")]
        rules += _mhdpa(f"{s}/MultiHeadDotProductAttention_0", f + ("attn",))
        rules += _mlp(f"{s}/MlpBlock_0", f)
    return rules


def _mhdpa(src: str, dst: tuple[str, ...]) -> list[Rule]:
    rules = [Rule(f"{src}/{n}/{p}", (dst + (f"{n}_{p}",),), "copy")
             for n in ("query", "key", "value") for p in ("kernel", "bias")]
    return rules + [Rule(f"{src}/out/{p}", (dst + (f"out_{p}",),), "copy") for p in ("kernel", "bias")]


def _mlp(src: str, dst: tuple[str, ...]) -> list[Rule]:
    return [Rule(f"{src}/Dense_{i}/{p}", (dst + (name, p),), "copy")
            for i, name in ((0, "c_fc"), (1, "c_proj")) for p in ("kernel", "bias")]


def rules(config: ProLIPConfig) -> list[Rule]:
    v, t, m = ("visual",), ("text",), ("visual", "map_head")
    return [
        Rule("t", (("logit_scale",),), "lead1"), Rule("b", (("logit_bias",),), "lead1"),
        Rule("img/embedding/kernel", (v + ("patch_kernel",),), "copy"),
        Rule("img/embedding/bias", (v + ("patch_bias",),), "copy"),
        Rule("img/pos_embedding", (v + ("positional_embedding",),), "lead1"),
        *_blocks("img/Transformer", v, config.vision.layers),
        *[Rule(f"img/Transformer/encoder_norm/{p}", (v + ("ln_post", p),), "copy") for p in ("scale", "bias")],
        Rule("img/MAPHead_0/probe", (m + ("probe",),), "lead2"),
        *_mhdpa("img/MAPHead_0/MultiHeadDotProductAttention_0", m + ("attn",)),
        *[Rule(f"img/MAPHead_0/LayerNorm_0/{p}", (m + ("ln", p),), "copy") for p in ("scale", "bias")],
        *_mlp("img/MAPHead_0/MlpBlock_0", m),
        Rule("txt/Embed_0/embedding", (t + ("token_embedding",),), "copy"),
        Rule("txt/pos_embedding", (t + ("positional_embedding",),), "lead1"),
        *_blocks("txt/Encoder_0", t, config.text.layers),
        *[Rule(f"txt/Encoder_0/encoder_norm/{p}", (t + ("ln_final", p),), "copy") for p in ("scale", "bias")],
        *[Rule(f"txt/head/{p}", (t + ("text_projection", p),), "copy") for p in ("kernel", "bias")],
    ]


def is_big_vision(keys) -> bool:
    return any(k.startswith(("img/", "txt/")) for k in keys) and any("encoderblock" in k for k in keys)


def _depth(flat: Mapping[str, Any], prefix: str) -> int:
    idx = {int(m.group(1)) for k in flat if (m := re.match(re.escape(prefix) + r"/encoderblock_(\d+)/", k))}
    return max(idx) + 1 if idx else 0


def infer_config(flat: Mapping[str, np.ndarray]) -> ProLIPConfig:
    """The SigLIP two-tower architecture, from the parameter shapes."""
    need = ["img/embedding/kernel", "img/pos_embedding", "img/MAPHead_0/probe", "txt/Embed_0/embedding",
            "txt/pos_embedding", "txt/head/kernel",
            "img/Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel",
            "img/Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel",
            "txt/Encoder_0/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel",
            "txt/Encoder_0/encoderblock_0/MlpBlock_0/Dense_0/kernel"]
    missing = [k for k in need if k not in flat]
    if missing:
        hint = ""
        if "img/cls" in flat or "img/head/kernel" in flat:
            hint = " (a [CLS]-pooled or image-head big_vision ViT is not a SigLIP two-tower; not supported)"
        raise ValueError(f"not a big_vision SigLIP two-tower checkpoint: missing {missing}{hint}")
    p, _, _, width = flat["img/embedding/kernel"].shape
    n = flat["img/pos_embedding"].shape[1]
    grid = math.isqrt(n)
    if grid * grid != n:
        raise ValueError(f"img/pos_embedding has {n} rows, not a square patch grid")
    vq = flat["img/Transformer/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel"]
    tq = flat["txt/Encoder_0/encoderblock_0/MultiHeadDotProductAttention_0/query/kernel"]
    vocab, twidth = flat["txt/Embed_0/embedding"].shape
    embed_dim = flat["txt/head/kernel"].shape[1]
    vmlp = flat["img/Transformer/encoderblock_0/MlpBlock_0/Dense_0/kernel"].shape[1]
    tmlp = flat["txt/Encoder_0/encoderblock_0/MlpBlock_0/Dense_0/kernel"].shape[1]
    # int(width * mlp_ratio) is the MLP width (open_clip); +0.5 keeps float rounding off it.
    vision = VisionConfig(image_size=grid * p, patch_size=p, width=width, layers=_depth(flat, "img/Transformer"),
                          head_width=vq.shape[2], mlp_ratio=(vmlp + 0.5) / width, ln_eps=1e-6, embed_unc=False,
                          class_token=False, pool="map", ln_pre=False, patch_bias=True, proj=False,
                          act="gelu_tanh")
    text = TextConfig(context_length=flat["txt/pos_embedding"].shape[1], vocab_size=vocab, width=twidth,
                      heads=tq.shape[1], layers=_depth(flat, "txt/Encoder_0"), mlp_ratio=(tmlp + 0.5) / twidth,
                      ln_eps=1e-6, embed_unc=False, pool="last", causal=False, proj_bias=True, act="gelu_tanh")
    return ProLIPConfig(embed_dim=embed_dim, vision=vision, text=text,
                        init_logit_scale=float(np.ravel(flat.get("t", [math.log(10.0)]))[0]),
                        init_logit_bias=float(np.ravel(flat.get("b", [-10.0]))[0]) or -10.0)
