"""Model configuration: dataclasses, the reference `config.json` schema, named variants.

The reference (naver-ai/prolip, open_clip 2.24) describes a model by a kwargs dict
`{"embed_dim", "init_logit_bias", "vision_cfg": {...}, "text_cfg": {...}}` (naver-ai/prolip src/prolip/model_configs);
the released Hugging Face `config.json` is that same dict. `ProLIPConfig.from_dict` reads it
(any size), `to_dict` writes it back so `ProLIPHF.from_pretrained` can rebuild the model.

The same towers, configured by the fields after `init_unc_bias`, are the deterministic
CLIP / SigLIP models the importers in `prolip_jax.core.pretrained` load (`embed_unc=False`: no
[UNC] token, mu only). The defaults are ProLIP's. In the dict schema a deterministic tower
says `"embed_unc": false` explicitly and lists its options with open_clip's key names where
open_clip has one (`pool_type`, `no_ln_pre`, `no_causal_mask`, `proj_bias`, `act_kwargs`) and
`class_token`, `patch_bias`, `proj_type` otherwise.

Uncertainty-head and pooling options from the other probabilistic VL papers, on the same
towers (fields `unc_head`, `unc_layers`, `covariance`, `pool="gpo"`, `gpo_dim`, `size_augment`;
models/heads.py): PCME++'s duplicated last block with GPO pooling and SizeAugment (PCME++
§2.1 / naver-ai/pcmepp pcmepp/models/{img,txt}_encoder.py) and Pishdad et al.'s duplicated
embedding layer (Pishdad et al. §3.1, §4.2). They have no open_clip equivalent: in the dict schema
they are written under their field names, and only when they differ from the default, so a
ProLIP `config.json` stays the reference's; `prolip_jax.core.convert` refuses to export them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

# Choices of the option fields (validated in VisionConfig / TextConfig.__post_init__).
UNC_HEADS = ("unc_token", "block", "embedding")
COVARIANCES = ("diagonal", "spherical")

# The paper's initial a = 10 (§4.1, "following SigLIP"); the reference code uses
# log(1/0.07) when the config does not say (naver-ai/prolip src/prolip/loss.py). We default to the paper.
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
    # pool "gpo": VSE∞'s Generalized Pooling Operator (Chen et al. 2021, models/heads.py GPO) over
    # every output token, after ln_post and proj per token.
    # Uncertainty head when embed_unc (the other papers' heads; no [UNC] token for them):
    #   "unc_token"  ProLIP: [UNC] token -> uncertainty_proj (pool "tok" or "map")
    #   "block"      PCME++: the last `unc_layers` blocks duplicated (fresh init, `unc_transformer`)
    #                on the shared trunk -> unc_projection (-> unc_gpo with pool "gpo")
    #   "embedding"  Pishdad et al.: a duplicated final embedding layer on the same pooled feature
    #                (unc_projection; with pool "gpo" also a duplicated GPO, unc_gpo)
    unc_head: str = "unc_token"
    unc_layers: int = 1  # blocks duplicated by unc_head "block" (PCME++ n_unc_layers = 1)
    covariance: str = "diagonal"  # "spherical": a 1-dim log sigma^2 head broadcast to embed_dim
    gpo_dim: int = 32  # GPO positional-encoding size and BiGRU hidden size (VSE∞: GPO(32, 32))
    size_augment: float = 0.0  # PCME++ image SizeAugment (training only, pool "gpo"); 0.2 there

    def __post_init__(self):
        _check_tower_options("vision", self)

    @property
    def heads(self) -> int:
        return self.width // self.head_width

    @property
    def mlp_dim(self) -> int:
        return int(self.width * self.mlp_ratio)  # open_clip: int(d_model * mlp_ratio)

    @property
    def unc_token(self) -> bool:
        """ProLIP's [UNC] token (a position row after [CLS]); the other papers' heads have none."""
        return self.embed_unc and self.unc_head == "unc_token"

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
    # Options of the other papers' heads, as VisionConfig (pool "gpo" pools the non-pad tokens).
    unc_head: str = "unc_token"  # "unc_token" is ProLIP's (pool "prolip"); "block" | "embedding"
    unc_layers: int = 1
    covariance: str = "diagonal"
    gpo_dim: int = 32
    # The tokenizer's pad id (1: SigLIP's T5 vocabulary, where EOS == pad; 0: OpenAI BPE):
    # needed by pool "gpo" (pads are not pooled) and by SizeAugment (pads are never touched).
    pad_id: int | None = None
    # PCME++ caption SizeAugment (pcmepp/datasets.py process_caption_vit; training only): each
    # token that is neither pad nor in `size_augment_protected_ids` is picked with probability
    # `size_augment` (PCME++ 0.2); a picked token becomes `size_augment_mask_id` with probability
    # `size_augment_masking`, a uniformly random id with `size_augment_erasing`, else is deleted.
    size_augment: float = 0.0
    size_augment_mask_id: int | None = None
    size_augment_masking: float = 0.5
    size_augment_erasing: float = 0.1
    size_augment_protected_ids: tuple[int, ...] = ()  # e.g. OpenAI BPE's SOT/EOT (49406, 49407)

    def __post_init__(self):
        # lists from a trainer config (ml_collections) -> a hashable tuple
        object.__setattr__(self, "size_augment_protected_ids",
                           tuple(int(i) for i in self.size_augment_protected_ids))
        _check_tower_options("text", self)

    @property
    def mlp_dim(self) -> int:
        return int(self.width * self.mlp_ratio)


def _check_tower_options(where: str, c: "VisionConfig | TextConfig") -> None:
    """The choice fields of one tower (cross-field rules: ProLIPConfig.__post_init__)."""
    problems = []
    if c.unc_head not in UNC_HEADS:
        problems.append(f"{where} unc_head {c.unc_head!r} is not one of {UNC_HEADS}")
    if c.covariance not in COVARIANCES:
        problems.append(f"{where} covariance {c.covariance!r} is not one of {COVARIANCES}")
    if not (isinstance(c.unc_layers, int) and 1 <= c.unc_layers <= c.layers):
        problems.append(f"{where} unc_layers {c.unc_layers!r} must be an int in [1, layers={c.layers}]")
    if not (isinstance(c.gpo_dim, int) and c.gpo_dim > 0 and c.gpo_dim % 2 == 0):
        problems.append(f"{where} gpo_dim {c.gpo_dim!r} must be a positive even int (sinusoidal encoding)")
    if not 0.0 <= c.size_augment < 1.0:
        problems.append(f"{where} size_augment {c.size_augment!r} must be in [0, 1)")
    if where == "text":
        m, e = c.size_augment_masking, c.size_augment_erasing
        if not (0.0 <= m <= 1.0 and 0.0 <= e <= 1.0 and m + e <= 1.0):
            problems.append(f"text size_augment_masking {m!r} and size_augment_erasing {e!r} must be "
                            "probabilities with a sum <= 1 (the rest is deletion)")
    if problems:
        raise ValueError("invalid ProLIP config: " + "; ".join(problems))


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
        for where, tower, pools in (("vision", v, ("tok", "map", "gpo")),
                                    ("text", t, ("prolip", "last", "argmax", "gpo"))):
            if tower.pool not in pools:
                problems.append(f"{where} pool {tower.pool!r} is not one of {pools}")
            if tower.act not in ("gelu", "gelu_tanh"):
                problems.append(f"{where} act {tower.act!r} is not 'gelu' or 'gelu_tanh' (QuickGELU: quick_gelu=True)")
        if v.pool == "tok" and not v.class_token:
            problems.append("vision pool 'tok' needs class_token=True")
        for where, tower, plain in (("vision", v, ("tok", "gpo")), ("text", t, ("last", "argmax", "gpo"))):
            if not tower.embed_unc:
                for field, default in (("unc_head", "unc_token"), ("covariance", "diagonal"), ("unc_layers", 1)):
                    if getattr(tower, field) != default:
                        problems.append(f"{where} {field}={getattr(tower, field)!r} needs embed_unc=True "
                                        "(embed_unc=False is a mu-only tower)")
            elif tower.unc_head != "unc_token" and tower.pool not in plain:
                problems.append(f"{where} unc_head {tower.unc_head!r} pools with one of {plain}, not {tower.pool!r}")
            if tower.unc_layers != 1 and tower.unc_head != "block":
                problems.append(f"{where} unc_layers={tower.unc_layers} is an option of unc_head 'block' only")
        if v.embed_unc and v.unc_head == "unc_token" and v.pool == "gpo":
            problems.append("vision unc_head 'unc_token' (ProLIP's [UNC]) pools with 'tok' or 'map', not 'gpo'")
        if v.size_augment and v.pool != "gpo":
            problems.append("vision size_augment drops output tokens before pooling: it needs pool 'gpo'")
        if t.pool == "gpo" and t.pad_id is None:
            problems.append("text pool 'gpo' needs pad_id (pads are not pooled): 1 for SigLIP's T5 "
                            "vocabulary, 0 for OpenAI's BPE")
        if t.size_augment and (t.pad_id is None or t.size_augment_mask_id is None):
            problems.append("text size_augment needs pad_id and size_augment_mask_id (the [MASK] token)")
        if not v.proj and v.width != self.embed_dim:
            problems.append(f"vision proj=False needs width {v.width} == embed_dim {self.embed_dim}")
        prolip_text = t.embed_unc and t.unc_head == "unc_token"
        if (t.pool == "prolip") != prolip_text:
            problems.append("text pool 'prolip' ([UNC],[CLS] appended) goes with embed_unc=True and "
                            "unc_head 'unc_token', and only with them")
        if prolip_text and (t.causal or not t.proj_bias):
            problems.append("the ProLIP text tower (embed_unc=True) has no causal mask and a text_projection bias")
        if v.image_size % v.patch_size:
            problems.append(f"vision image_size {v.image_size} is not a multiple of patch_size {v.patch_size}")
        if v.width % v.head_width:
            problems.append(f"vision width {v.width} is not a multiple of head_width {v.head_width}")
        if t.width % t.heads:
            problems.append(f"text width {t.width} is not divisible by heads {t.heads}")
        # The reference applies text_uncertainty_projection, a Linear(width, embed_dim), to the
        # *projected* CLS embedding (naver-ai/prolip src/prolip/transformer.py TextTransformer), which only type-checks when they agree.
        if prolip_text and t.width != self.embed_dim:
            problems.append(f"text width {t.width} must equal embed_dim {self.embed_dim}: the reference "
                            "computes text log sigma^2 from the projected [CLS] embedding")
        if problems:
            raise ValueError("invalid ProLIP config: " + "; ".join(problems))

    # ------------------------------------------------------------------ reference schema
    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ProLIPConfig":
        """Builds a config from a reference `config.json` dict (naver-ai/prolip src/prolip/model_configs)."""
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
        # Another paper's uncertainty head (`unc_head`): no [UNC] token, the tower options apply.
        vis_other = not vis_det and vis.get("unc_head", "unc_token") != "unc_token"
        txt_other = not txt_det and txt.get("unc_head", "unc_token") != "unc_token"
        _check_supported("vision_cfg", vis, _VISION_FIXED, skip=(
            _VISION_OPTIONS if vis_det else {**_VISION_OPTIONS, "embed_unc": (True,)} if vis_other else ()))
        _check_supported("text_cfg", txt, _TEXT_FIXED, skip=(
            _TEXT_OPTIONS if txt_det else {**_TEXT_OPTIONS, "embed_unc": (True,)} if txt_other else ()))
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
            **{k: vis[k] for k in _OPTION_KEYS if k in vis},
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
            pool="prolip" if not (txt_det or txt_other) else txt.get("pool_type", "argmax"),
            causal=not txt.get("no_causal_mask", True),
            proj_bias=bool(txt.get("proj_bias", True)),
            act=_act(txt.get("act_kwargs"), "text_cfg"),
            pad_id=txt.get("pad_id"),
            **{k: txt[k] for k in _OPTION_KEYS + _TEXT_OPTION_KEYS if k in txt},
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
        if t.pool != "prolip":  # no [UNC],[CLS]: a mu-only tower or another paper's head
            text_cfg.update(embed_cls=False, embed_unc=t.embed_unc, pool_type=t.pool,
                            no_causal_mask=not t.causal, proj_bias=t.proj_bias)
        if t.pad_id is not None:
            text_cfg["pad_id"] = t.pad_id
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
        # The other papers' options (port only), likewise only when set.
        for cfg, tower, keys in ((vision_cfg, v, _OPTION_KEYS), (text_cfg, t, _OPTION_KEYS + _TEXT_OPTION_KEYS)):
            for key in keys:
                value, default = getattr(tower, key), _TOWER_DEFAULTS[key]
                if value != default:
                    cfg[key] = list(value) if isinstance(value, tuple) else value
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

    def other_paper_options(self) -> list[str]:
        """The options set here that change the architecture away from what the reference
        (naver-ai/prolip, open_clip) can build: 'vision.pool='gpo'', ... Empty for ProLIP, CLIP
        and SigLIP configs. Training-only options (SizeAugment) are not listed."""
        out = []
        for where, tower in (("vision", self.vision), ("text", self.text)):
            if tower.pool == "gpo":
                out.append(f"{where}.pool='gpo'")
            for key in ("unc_head", "unc_layers", "covariance"):
                if getattr(tower, key) != _TOWER_DEFAULTS[key]:
                    out.append(f"{where}.{key}={getattr(tower, key)!r}")
        return out

    def without_training_options(self) -> "ProLIPConfig":
        """The same model with SizeAugment off (training-only: it has no parameters and changes
        nothing at evaluation), e.g. for a `config.json` the reference must load."""
        keys = ("size_augment", *_TEXT_OPTION_KEYS)
        return self.replace(vision=dataclasses.replace(self.vision, size_augment=0.0),
                            text=dataclasses.replace(self.text, **{k: _TOWER_DEFAULTS[k] for k in keys}))


# The option fields (other papers' heads) written under their own names in the dict schema.
_OPTION_KEYS = ("unc_head", "unc_layers", "covariance", "gpo_dim", "size_augment")
_TEXT_OPTION_KEYS = ("size_augment_mask_id", "size_augment_masking", "size_augment_erasing",
                     "size_augment_protected_ids")  # text only (SizeAugment of captions)
_TOWER_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TextConfig)}


# Reference kwargs the port reads, and those it accepts only at their supported value.
_TOP_KEYS = {"embed_dim", "vision_cfg", "text_cfg", "quick_gelu", "init_logit_scale",
             "init_logit_bias", "cast_dtype", "output_dict"}
_VISION_KEYS = {"image_size", "layers", "width", "head_width", "mlp_ratio", "patch_size",
                "norm_kwargs", "embed_unc", "init_unc_bias", "ls_init_value", "attentional_pool",
                "attn_pooler_queries", "attn_pooler_heads", "no_ln_pre", "pos_embed_type",
                "pool_type", "output_tokens", "act_kwargs", "timm_model_name", "class_token",
                "patch_bias", "proj_type", *_OPTION_KEYS,
                "timm_model_pretrained", "timm_pool", "timm_proj", "timm_proj_bias", "timm_drop",
                "timm_drop_path"}
_TEXT_KEYS = {"context_length", "vocab_size", "hf_tokenizer_name", "tokenizer_kwargs", "width",
              "heads", "layers", "mlp_ratio", "ls_init_value", "embed_cls", "embed_unc", "pad_id",
              "no_causal_mask", "final_ln_after_pool", "pool_type", "proj_bias", "output_tokens",
              "act_kwargs", "norm_kwargs", "init_unc_bias", "hf_model_name",
              "hf_model_pretrained", "hf_proj_type", "hf_pooler_type", *_OPTION_KEYS, *_TEXT_OPTION_KEYS}
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
_VISION_OPTIONS = {"embed_unc": (False,), "class_token": (True, False), "pool_type": ("tok", "map", "gpo"),
                   "no_ln_pre": (False, True), "proj_type": ("linear", "none")}
_TEXT_OPTIONS = {"embed_unc": (False,), "embed_cls": (False,), "no_causal_mask": (True, False),
                 "proj_bias": (True, False), "pool_type": ("last", "argmax", "gpo")}


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
    # The other papers' heads on the "tiny" towers (tests). PCME++ (naver-ai/pcmepp
    # configs/pcmepp.yaml): duplicated last block, GPO, SizeAugment 0.2, log sigma^2 bias 0
    # (its bias_init), a causal text tower as its CLIP one, GPO over the non-pad tokens (pad 1 in
    # this SigLIP vocabulary; 999 stands in for a [MASK] token).
    "tiny_pcmepp": {
        "embed_dim": 64, "init_logit_bias": -10,
        "vision_cfg": {"embed_unc": True, "image_size": 32, "layers": 2, "width": 64, "patch_size": 8,
                       "head_width": 32, "init_unc_bias": 0.0, "unc_head": "block", "pool_type": "gpo",
                       "size_augment": 0.2},
        "text_cfg": {**_SIGLIP_TEXT, "context_length": 16, "vocab_size": 1000, "width": 64, "heads": 2,
                     "layers": 2, "init_unc_bias": 0.0, "embed_unc": True, "embed_cls": False,
                     "unc_head": "block", "pool_type": "gpo", "pad_id": 1, "no_causal_mask": False,
                     "size_augment": 0.2, "size_augment_mask_id": 999},
    },
    # Pishdad et al.: a duplicated embedding layer for log sigma^2 on the tiny towers' own pooling.
    "tiny_pishdad": {
        "embed_dim": 64, "init_logit_bias": -10,
        "vision_cfg": {"embed_unc": True, "image_size": 32, "layers": 2, "width": 64, "patch_size": 8,
                       "head_width": 32, "unc_head": "embedding"},
        "text_cfg": {**_SIGLIP_TEXT, "context_length": 16, "vocab_size": 1000, "width": 64, "heads": 2,
                     "layers": 2, "embed_unc": True, "embed_cls": False, "unc_head": "embedding",
                     "pool_type": "last"},
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

    `overrides` replace top-level fields, e.g. `get_config('B/16', init_logit_scale=0.0)`;
    `vision` / `text` may be a mapping of VisionConfig / TextConfig field overrides, e.g.
    `get_config('B/16', vision={'unc_head': 'block', 'pool': 'gpo'})` (see `with_overrides`).
    """
    if isinstance(name_or_dict, str):
        if name_or_dict not in VARIANTS:
            raise ValueError(f"unknown model variant {name_or_dict!r}; known: {sorted(VARIANTS)}")
        name_or_dict = VARIANTS[name_or_dict]
    cfg = ProLIPConfig.from_dict(name_or_dict)
    return with_overrides(cfg, **overrides) if overrides else cfg


def with_overrides(cfg: ProLIPConfig, vision: Mapping[str, Any] | VisionConfig | None = None,
                   text: Mapping[str, Any] | TextConfig | None = None, **top: Any) -> ProLIPConfig:
    """`cfg` with top-level fields and per-tower field overrides (a trainer config's
    `model.vision` / `model.text` dicts) replaced; the result is validated as a whole."""
    towers = {}
    for where, value, cls in (("vision", vision, VisionConfig), ("text", text, TextConfig)):
        if value is None or isinstance(value, cls):
            if value is not None:
                towers[where] = value
            continue
        value = value.to_dict() if hasattr(value, "to_dict") else dict(value)  # ml_collections too
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown {where} field(s) {unknown}; known: "
                             f"{sorted(f.name for f in dataclasses.fields(cls))}")
        towers[where] = dataclasses.replace(getattr(cfg, where), **value)
    return cfg.replace(**towers, **top)
