"""open_clip state dicts: OpenAI-style CLIP (open_clip `CLIP`) and SigLIP (`CustomTextCLIP`
with a timm ViT), as open_clip writes them (`open_clip_model.safetensors`).

The model config is open_clip's model-config dict (`embed_dim`, `vision_cfg`, `text_cfg`, ...):
the `model_cfg` of an `open_clip_config.json` beside the weights, or a named architecture
(`ARCHS`). `config_from_open_clip` maps it onto the deterministic towers with open_clip's
defaults (open_clip/model.py CLIPVisionCfg, CLIPTextCfg): causal text mask, EOT-argmax
pooling, text_projection without bias, LayerNorm eps 1e-5. The key-to-parameter rules are
`prolip_jax.core.convert.conversion_rules` (layouts open_clip / open_clip_text / timm_siglip).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

from prolip_jax.core.models.config import ProLIPConfig, TextConfig, VisionConfig

# timm SigLIP trunks (timm/models/vision_transformer.py vit_*_siglip_*): patch, width, depth,
# heads, mlp_ratio. All: class_token=False, global_pool='map', nn.GELU, LayerNorm eps 1e-6.
TIMM_SIGLIP = {
    **{f"vit_base_patch16_siglip_{s}": (16, 768, 12, 12, 4.0) for s in (224, 256, 384, 512)},
    **{f"vit_large_patch16_siglip_{s}": (16, 1024, 24, 16, 4.0) for s in (256, 384)},
    **{f"vit_so400m_patch14_siglip_{s}": (14, 1152, 27, 16, 3.7362) for s in (224, 378, 384)},
}

_CLIP_TEXT = {"context_length": 77, "vocab_size": 49408}
_SIGLIP_TEXT = {"vocab_size": 32000, "hf_tokenizer_name": "timm/ViT-B-16-SigLIP",
                "tokenizer_kwargs": {"clean": "canonicalize"}, "no_causal_mask": True, "proj_bias": True,
                "pool_type": "last", "norm_kwargs": {"eps": 1e-6}}


def _siglip(embed_dim: int, timm_name: str, image_size: int, context: int, width: int, heads: int,
            layers: int, **text: Any) -> dict:
    return {"embed_dim": embed_dim, "init_logit_bias": -10, "custom_text": True,
            "vision_cfg": {"image_size": image_size, "timm_model_name": timm_name, "timm_model_pretrained": False,
                           "timm_pool": "map", "timm_proj": "none"},
            "text_cfg": {**_SIGLIP_TEXT, "context_length": context, "width": width, "heads": heads,
                         "layers": layers, **text}}


# open_clip/model_configs/*.json (open_clip 3.3.0) of the architectures the paper starts from.
# A "-quickgelu" suffix on a CLIP name sets quick_gelu (the OpenAI weights need it).
ARCHS: dict[str, dict[str, Any]] = {
    "ViT-B-32": {"embed_dim": 512, "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 32},
                 "text_cfg": {**_CLIP_TEXT, "width": 512, "heads": 8, "layers": 12}},
    "ViT-B-16": {"embed_dim": 512, "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 16},
                 "text_cfg": {**_CLIP_TEXT, "width": 512, "heads": 8, "layers": 12}},
    "ViT-L-14": {"embed_dim": 768, "vision_cfg": {"image_size": 224, "layers": 24, "width": 1024, "patch_size": 14},
                 "text_cfg": {**_CLIP_TEXT, "width": 768, "heads": 12, "layers": 12}},
    "ViT-H-14": {"embed_dim": 1024, "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80,
                                                   "patch_size": 14},
                 "text_cfg": {**_CLIP_TEXT, "width": 1024, "heads": 16, "layers": 24}},
    "ViT-B-16-SigLIP": _siglip(768, "vit_base_patch16_siglip_224", 224, 64, 768, 12, 12),
    "ViT-B-16-SigLIP-256": _siglip(768, "vit_base_patch16_siglip_256", 256, 64, 768, 12, 12),
    "ViT-B-16-SigLIP-384": _siglip(768, "vit_base_patch16_siglip_384", 384, 64, 768, 12, 12),
    "ViT-L-16-SigLIP-256": _siglip(1024, "vit_large_patch16_siglip_256", 256, 64, 1024, 16, 24),
    "ViT-L-16-SigLIP-384": _siglip(1024, "vit_large_patch16_siglip_384", 384, 64, 1024, 16, 24),
    "ViT-SO400M-14-SigLIP": _siglip(1152, "vit_so400m_patch14_siglip_224", 224, 16, 1152, 16, 27, mlp_ratio=3.7362),
    "ViT-SO400M-14-SigLIP-384": _siglip(1152, "vit_so400m_patch14_siglip_384", 384, 64, 1152, 16, 27,
                                        mlp_ratio=3.7362),
}


def arch_config(name: str) -> dict[str, Any]:
    """open_clip model-config dict of a named architecture ('ViT-B-32-quickgelu', ...)."""
    base, quick = (name[: -len("-quickgelu")], True) if name.endswith("-quickgelu") else (name, False)
    if base not in ARCHS:
        raise ValueError(f"unknown open_clip architecture {name!r}; known: {sorted(ARCHS)} "
                         "(add '-quickgelu' to a CLIP name for QuickGELU)")
    cfg = dict(ARCHS[base])
    if quick:
        cfg["quick_gelu"] = True
    return cfg


# open_clip config keys this port reads, and the ones it accepts only at open_clip's default.
_VISION_READ = {"image_size", "layers", "width", "head_width", "mlp_ratio", "patch_size", "no_ln_pre",
                "norm_kwargs", "act_kwargs", "timm_model_name", "timm_model_pretrained", "timm_pool",
                "timm_proj", "timm_proj_bias", "timm_drop", "timm_drop_path", "patch_dropout",
                "output_tokens", "final_ln_after_pool"}
_VISION_DEFAULTS = {"ls_init_value": None, "attentional_pool": False, "pos_embed_type": "learnable",
                    "pool_type": "tok", "block_type": None, "qk_norm": False, "scaled_cosine_attn": False,
                    "scale_heads": False, "scale_attn_inner": False, "scale_attn": False, "scale_fc": False}
_TEXT_READ = {"context_length", "vocab_size", "hf_tokenizer_name", "tokenizer_kwargs", "tokenizer_mode",
              "width", "heads", "layers", "mlp_ratio", "no_causal_mask", "proj_bias", "pool_type",
              "norm_kwargs", "act_kwargs", "output_tokens", "final_ln_after_pool", "pad_id", "eos_id"}
_TEXT_DEFAULTS = {"ls_init_value": None, "embed_cls": False, "hf_model_name": None, "proj_type": "linear",
                  "use_pad_mask": False, "block_type": None, "qk_norm": False, "scaled_cosine_attn": False,
                  "scale_heads": False, "scale_attn_inner": False, "scale_attn": False, "scale_fc": False}


def _check(where: str, d: Mapping[str, Any], read: set[str], defaults: Mapping[str, Any]) -> None:
    problems = [f"{k}={d[k]!r} (only {defaults[k]!r} is supported)" for k in d
                if k in defaults and d[k] != defaults[k]]
    problems += [f"unknown key {k!r}" for k in d if k not in read and k not in defaults]
    if problems:
        raise ValueError(f"open_clip {where} is not supported: " + "; ".join(problems))


def _act(cfg: Mapping[str, Any], where: str) -> str:
    kw = cfg.get("act_kwargs") or {}
    if set(kw) - {"approximate"} or kw.get("approximate", "none") not in ("none", "tanh"):
        raise ValueError(f"open_clip {where}.act_kwargs={kw!r} is not supported")
    return "gelu_tanh" if kw.get("approximate") == "tanh" else "gelu"


def config_from_open_clip(model_cfg: Mapping[str, Any]) -> ProLIPConfig:
    """ProLIPConfig of the deterministic model an open_clip model-config dict describes."""
    cfg = dict(model_cfg)
    unknown = set(cfg) - {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "init_logit_scale",
                          "init_logit_bias", "custom_text", "cast_dtype", "output_dict", "nonscalar_logit_scale"}
    if unknown:
        raise ValueError(f"open_clip model config has unsupported key(s) {sorted(unknown)}")
    vis, txt = dict(cfg.get("vision_cfg") or {}), dict(cfg.get("text_cfg") or {})
    _check("vision_cfg", vis, _VISION_READ, _VISION_DEFAULTS)
    _check("text_cfg", txt, _TEXT_READ, _TEXT_DEFAULTS)
    embed_dim = int(cfg.get("embed_dim", 512))
    image_size = vis.get("image_size", 224)
    image_size = image_size[0] if isinstance(image_size, (list, tuple)) else int(image_size)

    if vis.get("timm_model_name"):
        name = vis["timm_model_name"]
        if name not in TIMM_SIGLIP:
            raise ValueError(f"timm model {name!r} is not a known SigLIP trunk ({sorted(TIMM_SIGLIP)}); "
                             "pass the architecture explicitly (arch=ProLIPConfig(...))")
        if vis.get("timm_pool") != "map" or vis.get("timm_proj", "linear") != "none":
            raise ValueError("only timm SigLIP trunks with timm_pool='map' and timm_proj='none' are supported "
                             f"(got {vis.get('timm_pool')!r}, {vis.get('timm_proj')!r})")
        patch, width, layers, heads, mlp_ratio = TIMM_SIGLIP[name]
        vision = VisionConfig(image_size=image_size, patch_size=patch, width=width, layers=layers,
                              head_width=width // heads, mlp_ratio=mlp_ratio, ln_eps=1e-6, embed_unc=False,
                              class_token=False, pool="map", ln_pre=False, patch_bias=True, proj=False)
    else:
        patch = vis.get("patch_size", 16)
        vision = VisionConfig(
            image_size=image_size, patch_size=patch[0] if isinstance(patch, (list, tuple)) else int(patch),
            width=vis.get("width", 768), layers=vis.get("layers", 12), head_width=vis.get("head_width", 64),
            mlp_ratio=vis.get("mlp_ratio", 4.0), ln_eps=(vis.get("norm_kwargs") or {}).get("eps", 1e-5),
            embed_unc=False, ln_pre=not vis.get("no_ln_pre", False), act=_act(vis, "vision_cfg"))

    pool = txt.get("pool_type", "argmax")
    if pool not in ("argmax", "last"):
        raise ValueError(f"open_clip text pool_type={pool!r} is not supported (argmax, last)")
    text = TextConfig(
        context_length=txt.get("context_length", 77), vocab_size=txt.get("vocab_size", 49408),
        width=txt.get("width", 512), heads=txt.get("heads", 8), layers=txt.get("layers", 12),
        mlp_ratio=txt.get("mlp_ratio", 4.0), ln_eps=(txt.get("norm_kwargs") or {}).get("eps", 1e-5),
        hf_tokenizer_name=txt.get("hf_tokenizer_name"),
        tokenizer_kwargs=tuple(sorted((txt.get("tokenizer_kwargs") or {}).items())),
        embed_unc=False, pool=pool, causal=not txt.get("no_causal_mask", False),
        proj_bias=bool(txt.get("proj_bias", False)), act=_act(txt, "text_cfg"))
    return ProLIPConfig(
        embed_dim=embed_dim, vision=vision, text=text, quick_gelu=bool(cfg.get("quick_gelu", False)),
        # open_clip's default logit scale init is log(1/0.07); the weights overwrite it anyway.
        init_logit_scale=float(cfg.get("init_logit_scale", math.log(1 / 0.07))),
        # No bias in CLIP: the importer sets the parameter to 0; the init value only matters for
        # config round trips (ProLIPConfig writes -10 for a falsy bias, as the reference).
        init_logit_bias=float(cfg.get("init_logit_bias") or -10.0))


def detect_layout(keys: set[str]) -> str | None:
    """Which state_dict family the keys are (convert.LAYOUTS), or None."""
    if any(k.startswith("visual.trunk.") for k in keys):
        return "timm_siglip"
    if "visual.conv1.weight" not in keys:
        return None
    if "text.unc_emb" in keys or "visual.unc_embedding" in keys:
        return "prolip"
    if "token_embedding.weight" in keys:
        return "open_clip"
    if "text.token_embedding.weight" in keys:
        return "open_clip_text"
    return None
