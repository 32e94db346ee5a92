"""Model configuration: dataclasses, the reference `config.json` schema, named variants.

The reference (naver-ai/prolip, open_clip 2.24) describes a model by a kwargs dict
`{"embed_dim", "init_logit_bias", "vision_cfg": {...}, "text_cfg": {...}}` (REFERENCE §1.4);
the released Hugging Face `config.json` is that same dict. `ProLIPConfig.from_dict` reads it
(any size), `to_dict` writes it back so `ProLIPHF.from_pretrained` can rebuild the model.

The same towers, configured by the fields after `init_unc_bias`, are the deterministic
CLIP / SigLIP models the importers in `prolip_jax.pretrained` load (`embed_unc=False`: no
[UNC] token, mu only). The defaults are ProLIP's. In the dict schema a deterministic tower
says `"embed_unc": false` explicitly and lists its options with open_clip's key names where
open_clip has one (`pool_type`, `no_ln_pre`, `no_causal_mask`, `proj_bias`, `act_kwargs`) and
`class_token`, `patch_bias`, `proj_type` otherwise.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

# The paper's initial a = 10 (§4.1, "following SigLIP"); the reference code uses
# log(1/0.07) when the config does not say (REFERENCE §2.3). We default to the paper.
PAPER_INIT_LOGIT_SCALE = math.log(10.0)


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    layers: int = 12
    head_width: int = 64
    mlp_ratio: float = 4.0
    ln_eps: float = 1e-5  # torch default; the reference sets no norm_kwargs for vision
    init_unc_bias: float = -10.0
    # Architecture options (defaults = ProLIP). Token layout = [CLS]? [UNC]? patches, with one
    # positional-embedding row per token: ProLIP grid+2 rows (CLS, UNC, patches), OpenAI /
    # open_clip CLIP grid+1 (CLS, patches), SigLIP grid (patches only).
    embed_unc: bool = True  # [UNC] token -> log sigma^2 (uncertainty_proj); False: mu only
    class_token: bool = True  # a [CLS] token (`class_embedding`); SigLIP has none
    pool: str = "tok"  # "tok": the [CLS] output; "map": SigLIP attention-pool head (`map_head`)
    ln_pre: bool = True  # LayerNorm before the blocks (CLIP, ProLIP); SigLIP has none
    patch_bias: bool = False  # bias of the patch-embedding conv (SigLIP: timm / big_vision)
    proj: bool = True  # mu = pooled @ proj (no bias); False: mu = pooled (SigLIP, width == embed_dim)
    act: str = "gelu"  # "gelu" (erf) | "gelu_tanh" (SigLIP); ProLIPConfig.quick_gelu overrides

    @property
    def heads(self) -> int:
        return self.width // self.head_width

    @property
    def mlp_dim(self) -> int:
        return int(self.width * self.mlp_ratio)  # open_clip: int(d_model * mlp_ratio)

    @property
    def grid(self) -> int:
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid * self.grid


@dataclasses.dataclass(frozen=True)
class TextConfig:
    context_length: int = 64
    vocab_size: int = 32100
    width: int = 768
    heads: int = 12
    layers: int = 12
    mlp_ratio: float = 4.0
    ln_eps: float = 1e-5  # B/16, L/16, So400m set 1e-6 through norm_kwargs; H/14 keeps 1e-5
    init_unc_bias: float = -10.0
    # Architecture options (defaults = ProLIP). Positional-embedding rows: context_length + 2
    # for "prolip" (tokens, UNC, CLS), context_length otherwise.
    embed_unc: bool = True  # ProLIP: [UNC],[CLS] appended, log sigma^2 head; False: mu only
    pool: str = "prolip"  # "prolip": appended [CLS]; "last": last token (SigLIP); "argmax": the
    #                       token at argmax(token id), the EOT of OpenAI's BPE (open_clip CLIP)
    causal: bool = False  # causal attention mask (OpenAI CLIP text)
    proj_bias: bool = True  # text_projection bias (ProLIP, SigLIP); OpenAI CLIP has none
    act: str = "gelu"  # "gelu" | "gelu_tanh" (big_vision SigLIP); ProLIPConfig.quick_gelu overrides
    # Carried for config.json round trips only (the model does not use them).
    hf_tokenizer_name: str | None = None
    tokenizer_kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def mlp_dim(self) -> int:
        return int(self.width * self.mlp_ratio)


@dataclasses.dataclass(frozen=True)
class ProLIPConfig:
    embed_dim: int = 768
    vision: VisionConfig = VisionConfig()
    text: TextConfig = TextConfig()
    quick_gelu: bool = False
    init_logit_scale: float = PAPER_INIT_LOGIT_SCALE  # log a
    init_logit_bias: float = -10.0  # b

    def __post_init__(self):
        v, t = self.vision, self.text
        problems = []
        for where, tower, pools in (("vision", v, ("tok", "map")), ("text", t, ("prolip", "last", "argmax"))):
            if tower.pool not in pools:
                problems.append(f"{where} pool {tower.pool!r} is not one of {pools}")
            if tower.act not in ("gelu", "gelu_tanh"):
                problems.append(f"{where} act {tower.act!r} is not 'gelu' or 'gelu_tanh' (QuickGELU: quick_gelu=True)")
        if v.pool == "tok" and not v.class_token:
            problems.append("vision pool 'tok' needs class_token=True")
        if not v.proj and v.width != self.embed_dim:
            problems.append(f"vision proj=False needs width {v.width} == embed_dim {self.embed_dim}")
        if (t.pool == "prolip") != t.embed_unc:
            problems.append("text pool 'prolip' ([UNC],[CLS] appended) goes with embed_unc=True and only with it")
        if t.embed_unc and (t.causal or not t.proj_bias):
            problems.append("the ProLIP text tower (embed_unc=True) has no causal mask and a text_projection bias")
        if v.image_size % v.patch_size:
            problems.append(f"vision image_size {v.image_size} is not a multiple of patch_size {v.patch_size}")
        if v.width % v.head_width:
            problems.append(f"vision width {v.width} is not a multiple of head_width {v.head_width}")
        if t.width % t.heads:
            problems.append(f"text width {t.width} is not divisible by heads {t.heads}")
        # The reference applies text_uncertainty_projection, a Linear(width, embed_dim), to the
        # *projected* CLS embedding (REFERENCE §1.3), which only type-checks when they agree.
        if t.embed_unc and t.width != self.embed_dim:
            problems.append(f"text width {t.width} must equal embed_dim {self.embed_dim}: the reference "
                            "computes text log sigma^2 from the projected [CLS] embedding")
        if problems:
            raise ValueError("invalid ProLIP config: " + "; ".join(problems))

    # ------------------------------------------------------------------ reference schema
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ProLIPConfig":
        """Builds a config from a reference `config.json` dict (REFERENCE §1.4)."""
        d = dict(d)
        _check_keys("config", d, _TOP_KEYS)
        vis = dict(d.get("vision_cfg") or {})
        txt = dict(d.get("text_cfg") or {})
        _check_keys("vision_cfg", vis, _VISION_KEYS)
        _check_keys("text_cfg", txt, _TEXT_KEYS)
        # A deterministic tower must say `"embed_unc": false`; absent means the reference default
        # (vision False, rejected below as before; text True).
        vis_det = vis.get("embed_unc", True) is False
        txt_det = txt.get("embed_unc", True) is False
        _check_supported("vision_cfg", vis, _VISION_FIXED, skip=_VISION_OPTIONS if vis_det else ())
        _check_supported("text_cfg", txt, _TEXT_FIXED, skip=_TEXT_OPTIONS if txt_det else ())
        vision = VisionConfig(
            image_size=_single(vis.get("image_size", 224), "vision_cfg.image_size"),
            patch_size=_single(vis.get("patch_size", 16), "vision_cfg.patch_size"),
            width=vis.get("width", 768),
            layers=vis.get("layers", 12),
            head_width=vis.get("head_width", 64),
            mlp_ratio=vis.get("mlp_ratio", 4.0),
            ln_eps=(vis.get("norm_kwargs") or {}).get("eps", 1e-5),
            init_unc_bias=float(vis.get("init_unc_bias", -10)),
            embed_unc=not vis_det,
            class_token=bool(vis.get("class_token", True)),
            pool=vis.get("pool_type", "tok"),
            ln_pre=not vis.get("no_ln_pre", False),
            patch_bias=bool(vis.get("patch_bias", False)),
            proj=vis.get("proj_type", "linear") != "none",
            act=_act(vis.get("act_kwargs"), "vision_cfg"),
        )
        text = TextConfig(
            context_length=txt.get("context_length", 64),
            vocab_size=txt.get("vocab_size", 32100),
            width=txt.get("width", 768),
            heads=txt.get("heads", 12),
            layers=txt.get("layers", 12),
            mlp_ratio=txt.get("mlp_ratio", 4.0),
            ln_eps=(txt.get("norm_kwargs") or {}).get("eps", 1e-5),
            init_unc_bias=float(txt.get("init_unc_bias", -10)),
            hf_tokenizer_name=txt.get("hf_tokenizer_name"),
            tokenizer_kwargs=tuple(sorted((txt.get("tokenizer_kwargs") or {}).items())),
            embed_unc=not txt_det,
            pool="prolip" if not txt_det else txt.get("pool_type", "argmax"),
            causal=not txt.get("no_causal_mask", True),
            proj_bias=bool(txt.get("proj_bias", True)),
            act=_act(txt.get("act_kwargs"), "text_cfg"),
        )
        return cls(
            embed_dim=d.get("embed_dim", 768),
            vision=vision,
            text=text,
            quick_gelu=bool(d.get("quick_gelu", False)),
            init_logit_scale=float(d.get("init_logit_scale", PAPER_INIT_LOGIT_SCALE)),
            init_logit_bias=float(d.get("init_logit_bias") or -10.0),
        )

    def to_dict(self) -> dict[str, Any]:
        """The reference `config.json` dict; `ProLIPHF(**to_dict())` builds the same model."""
        v, t = self.vision, self.text
        text_cfg: dict[str, Any] = {
            "context_length": t.context_length, "vocab_size": t.vocab_size, "width": t.width,
            "heads": t.heads, "layers": t.layers, "mlp_ratio": t.mlp_ratio,
            "no_causal_mask": True, "proj_bias": True, "pool_type": "last",
            "embed_cls": True, "embed_unc": True, "norm_kwargs": {"eps": t.ln_eps},
            "init_unc_bias": t.init_unc_bias,
        }
        if not t.embed_unc:
            text_cfg.update(embed_cls=False, embed_unc=False, pool_type=t.pool,
                            no_causal_mask=not t.causal, proj_bias=t.proj_bias)
        if t.act != "gelu":
            text_cfg["act_kwargs"] = {"approximate": "tanh"}
        vision_cfg: dict[str, Any] = {
            "image_size": v.image_size, "patch_size": v.patch_size, "width": v.width,
            "layers": v.layers, "head_width": v.head_width, "mlp_ratio": v.mlp_ratio,
            "norm_kwargs": {"eps": v.ln_eps},
            "embed_unc": v.embed_unc, "init_unc_bias": v.init_unc_bias,
        }
        # Non-ProLIP options only when set, so a ProLIP config.json stays the reference's.
        for key, value, default in (("class_token", v.class_token, True), ("pool_type", v.pool, "tok"),
                                    ("no_ln_pre", not v.ln_pre, False), ("patch_bias", v.patch_bias, False),
                                    ("proj_type", "linear" if v.proj else "none", "linear")):
            if value != default:
                vision_cfg[key] = value
        if v.act != "gelu":
            vision_cfg["act_kwargs"] = {"approximate": "tanh"}
        if t.hf_tokenizer_name is not None:
            text_cfg["hf_tokenizer_name"] = t.hf_tokenizer_name
        if t.tokenizer_kwargs:
            text_cfg["tokenizer_kwargs"] = dict(t.tokenizer_kwargs)
        return {
            "embed_dim": self.embed_dim,
            "quick_gelu": self.quick_gelu,
            "init_logit_scale": self.init_logit_scale,
            # The reference creates `logit_bias` only `if init_logit_bias:` (truthy), so never 0.
            "init_logit_bias": self.init_logit_bias or -10.0,
            "vision_cfg": vision_cfg,
            "text_cfg": text_cfg,
        }

    def replace(self, **kw) -> "ProLIPConfig":
        return dataclasses.replace(self, **kw)


# Reference kwargs the port reads, and those it accepts only at their supported value.
_TOP_KEYS = {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "init_logit_scale",
             "init_logit_bias", "cast_dtype", "output_dict"}
_VISION_KEYS = {"image_size", "layers", "width", "head_width", "mlp_ratio", "patch_size",
                "norm_kwargs", "embed_unc", "init_unc_bias", "ls_init_value", "attentional_pool",
                "attn_pooler_queries", "attn_pooler_heads", "no_ln_pre", "pos_embed_type",
                "pool_type", "output_tokens", "act_kwargs", "timm_model_name", "class_token",
                "patch_bias", "proj_type",
                "timm_model_pretrained", "timm_pool", "timm_proj", "timm_proj_bias", "timm_drop",
                "timm_drop_path"}
_TEXT_KEYS = {"context_length", "vocab_size", "hf_tokenizer_name", "tokenizer_kwargs", "width",
              "heads", "layers", "mlp_ratio", "ls_init_value", "embed_cls", "embed_unc", "pad_id",
              "no_causal_mask", "final_ln_after_pool", "pool_type", "proj_bias", "output_tokens",
              "act_kwargs", "norm_kwargs", "init_unc_bias", "hf_model_name",
              "hf_model_pretrained", "hf_proj_type", "hf_pooler_type"}
# key -> (the reference's default, values the port supports). Anything else changes the
# architecture in a way the ProLIP towers (here and in the reference's ProLIP class) do not
# implement. Note that the reference's *vision* default is embed_unc=False: a config.json
# must say `"embed_unc": true` for the image tower to have an [UNC] token.
_VISION_FIXED = {"embed_unc": (False, (True,)), "ls_init_value": (None, (None,)),
                 "attentional_pool": (False, (False,)), "no_ln_pre": (False, (False,)),
                 "pos_embed_type": ("learnable", ("learnable",)), "pool_type": ("tok", ("tok",)),
                 "output_tokens": (False, (False,)), "act_kwargs": (None, (None, {"approximate": "tanh"})),
                 "timm_model_name": (None, (None,)), "class_token": (True, (True,)),
                 "patch_bias": (False, (False, True)), "proj_type": ("linear", ("linear",))}
_TEXT_FIXED = {"embed_cls": (True, (True,)), "embed_unc": (True, (True,)),
               "no_causal_mask": (True, (True,)), "proj_bias": (True, (True,)),
               "ls_init_value": (None, (None,)), "output_tokens": (False, (False,)),
               "act_kwargs": (None, (None, {"approximate": "tanh"})), "hf_model_name": (None, (None,))}
# Keys a deterministic tower (explicit `"embed_unc": false`) may set to other values.
_VISION_OPTIONS = {"embed_unc": (False,), "class_token": (True, False), "pool_type": ("tok", "map"),
                   "no_ln_pre": (False, True), "proj_type": ("linear", "none")}
_TEXT_OPTIONS = {"embed_unc": (False,), "embed_cls": (False,), "no_causal_mask": (True, False),
                 "proj_bias": (True, False), "pool_type": ("last", "argmax")}


def _check_keys(where: str, d: Mapping[str, Any], known: set[str]) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {unknown}")


def _check_supported(where: str, d: Mapping[str, Any], fixed: Mapping[str, tuple],
                     skip: Mapping[str, tuple] = ()) -> None:
    """Rejects unsupported values; `skip` replaces the allowed values of some keys."""
    for key, (default, allowed) in fixed.items():
        value = d.get(key, default)
        if key in skip:
            if key in d and value not in skip[key]:
                raise ValueError(f"{where}.{key}={value!r} is not supported: it must be one of {skip[key]}")
            continue
        if value not in allowed:
            given = f"{value!r}" if key in d else f"{value!r} (the reference default when absent)"
            raise ValueError(f"{where}.{key}={given} is not supported by ProLIP: it must be {allowed[0]!r}")


def _act(act_kwargs: Mapping[str, Any] | None, where: str) -> str:
    """open_clip's `act_kwargs` for nn.GELU: {"approximate": "tanh"} -> 'gelu_tanh'."""
    approx = (act_kwargs or {}).get("approximate", "none")
    if approx not in ("none", "tanh") or set(act_kwargs or {}) - {"approximate"}:
        raise ValueError(f"{where}.act_kwargs={act_kwargs!r} is not supported (only approximate='tanh')")
    return "gelu_tanh" if approx == "tanh" else "gelu"


def _single(value: Any, where: str) -> int:
    """The reference accepts (h, w) tuples; the port supports square images/patches."""
    if isinstance(value, (list, tuple)):
        if len(value) != 2 or value[0] != value[1]:
            raise ValueError(f"{where}={value!r}: only square sizes are supported")
        value = value[0]
    return int(value)


# ----------------------------------------------------------------------------------------
# Named variants: reference config.json dicts (src/prolip/model_configs/*.json).
# ----------------------------------------------------------------------------------------
_SIGLIP_TEXT = {"vocab_size": 32100, "hf_tokenizer_name": "timm/ViT-B-16-SigLIP",
                "tokenizer_kwargs": {"clean": "canonicalize"}, "norm_kwargs": {"eps": 1e-6}}

VARIANTS: dict[str, dict[str, Any]] = {
    "B/16": {
        "embed_dim": 768, "init_logit_bias": -10,
        "vision_cfg": {"embed_unc": True, "image_size": 224, "layers": 12, "width": 768, "patch_size": 16},
        "text_cfg": {**_SIGLIP_TEXT, "context_length": 64, "width": 768, "heads": 12, "layers": 12},
    },
    "B/16-long": {
        "embed_dim": 768, "init_logit_bias": -10,
        "vision_cfg": {"embed_unc": True, "image_size": 224, "layers": 12, "width": 768, "patch_size": 16},
        "text_cfg": {**_SIGLIP_TEXT, "context_length": 256, "width": 768, "heads": 12, "layers": 12},
    },
    "L/16": {
        "embed_dim": 1024, "init_logit_bias": -10,
        "vision_cfg": {"embed_unc": True, "image_size": 256, "layers": 24, "width": 1024, "patch_size": 16},
        "text_cfg": {**_SIGLIP_TEXT, "context_length": 64, "width": 1024, "heads": 16, "layers": 24},
    },
    "So400m/14": {
        "embed_dim": 1152, "init_logit_bias": -10,
        "vision_cfg": {"embed_unc": True, "image_size": 224, "layers": 27, "width": 1152, "head_width": 72,
                       "patch_size": 14, "mlp_ratio": 3.7362},
        "text_cfg": {**_SIGLIP_TEXT, "hf_tokenizer_name": "timm/ViT-SO400M-14-SigLIP",
                     "context_length": 64, "width": 1152, "heads": 16, "layers": 27,
                     "mlp_ratio": 3.7362},
    },
    "H/14": {
        "embed_dim": 1024, "quick_gelu": True, "init_logit_bias": -10,
        "vision_cfg": {"embed_unc": True, "image_size": 224, "layers": 32, "width": 1280, "head_width": 80,
                       "patch_size": 14},
        # OpenAI BPE vocab, no hf_tokenizer_name, LayerNorm eps left at 1e-5.
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16,
                     "layers": 24},
    },
    # Tiny sizes for tests and the CPU demo. "tiny" is the golden fixture's configuration.
    "tiny": {
        "embed_dim": 64, "init_logit_bias": -10,
        "vision_cfg": {"embed_unc": True, "image_size": 32, "layers": 2, "width": 64, "patch_size": 8, "head_width": 32},
        "text_cfg": {**_SIGLIP_TEXT, "context_length": 16, "vocab_size": 1000, "width": 64,
                     "heads": 2, "layers": 2},
    },
    "micro": {
        "embed_dim": 32, "init_logit_bias": -10,
        "vision_cfg": {"embed_unc": True, "image_size": 16, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 32, "heads": 2, "layers": 1,
                     "norm_kwargs": {"eps": 1e-6}},
    },
}


def get_config(name_or_dict: str | Mapping[str, Any], **overrides: Any) -> ProLIPConfig:
    """A named variant ('B/16', 'L/16', 'So400m/14', 'H/14', 'tiny', ...) or a reference dict.

    `overrides` replace top-level fields, e.g. `get_config('B/16', init_logit_scale=0.0)`.
    """
    if isinstance(name_or_dict, str):
        if name_or_dict not in VARIANTS:
            raise ValueError(f"unknown model variant {name_or_dict!r}; known: {sorted(VARIANTS)}")
        name_or_dict = VARIANTS[name_or_dict]
    cfg = ProLIPConfig.from_dict(name_or_dict)
    return cfg.replace(**overrides) if overrides else cfg
