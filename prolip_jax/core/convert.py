"""PyTorch state_dict <-> Flax params, and the Hugging Face folder layout (naver-ai/prolip's ProLIPHF state dict).

The reference checkpoint is a flat dict of float32 tensors keyed as `ProLIP.state_dict()`
(311 tensors for B/16); a Hugging Face folder holds that dict as `model.safetensors` plus the
model kwargs as `config.json`, which `ProLIPHF.from_pretrained(folder)` loads. Every rule
below is a pure layout change (transpose / reshape / split), so conversions are bit-exact.

Safetensors only: pickled `.pt`/`.bin` files are refused (they can execute code).
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Mapping

import numpy as np

from prolip_jax.runtime import paths as fs
from prolip_jax.core.models import layout as block_layout  # `layout` here names a state_dict's key layout
from prolip_jax.core.models.config import ProLIPConfig
from prolip_jax.core.models.prolip import abstract_params

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# Layout kinds: how one source tensor maps to one (or several) Flax leaves.
#   copy   same array                         linear  torch (out, in)  <-> flax (in, out)
#   conv   torch (O, I, kh, kw) <-> flax (kh, kw, I, O)
#   qkv_w  torch (nD, D) rows [q; k; v] (n = number of leaves: 3 packed, 2 for timm's `kv`,
#          1 for a lone `q`) <-> n x flax (D, N, H)  (heads = contiguous H columns)
#   qkv_b  torch (nD,)  <-> n x flax (N, H)     out_w  torch (D, N*H) <-> flax (N, H, D)
#   lead1 / lead2  the source has 1 / 2 extra leading unit axes: timm `pos_embed` (1, N, D),
#          `latent` (1, 1, D), big_vision `t` (1,) <-> flax (N, D), (D,), ()
# Layouts (`conversion_rules(config, layout)`) name the state_dict families:
#   prolip          the reference ProLIP (`visual.*` open_clip ViT + [UNC], `text.*`)
#   open_clip       open_clip's `CLIP` class = OpenAI CLIP (`visual.*`, text at the top level)
#   open_clip_text  open_clip's `CustomTextCLIP` with an open_clip ViT (`visual.*`, `text.*`)
#   timm_siglip     open_clip's `CustomTextCLIP` with a timm ViT (`visual.trunk.*`, `text.*`)
LAYOUTS = ("prolip", "open_clip", "open_clip_text", "timm_siglip")


@dataclasses.dataclass(frozen=True)
class Rule:
    torch_key: str
    flax_paths: tuple[tuple[str, ...], ...]
    kind: str


def _ln(src: str, dst: tuple[str, ...], weight: str = "weight") -> list[Rule]:
    return [Rule(f"{src}.{weight}", (dst + ("scale",),), "copy"), Rule(f"{src}.bias", (dst + ("bias",),), "copy")]


def _dense(src: str, dst: tuple[str, ...]) -> list[Rule]:
    return [Rule(f"{src}.weight", (dst + ("kernel",),), "linear"), Rule(f"{src}.bias", (dst + ("bias",),), "copy")]


def _attn(dst: tuple[str, ...], names: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    return tuple(dst + ("attn", f"{n}_kernel") for n in names), tuple(dst + ("attn", f"{n}_bias") for n in names)


# torch key names of one pre-norm block: open_clip ResidualAttentionBlock and timm's
# VisionTransformer Block (timm/models/vision_transformer.py: qkv packed like torch's in_proj).
OPEN_CLIP_BLOCK = dict(blocks="transformer.resblocks", ln_1="ln_1", ln_2="ln_2", qkv="attn.in_proj_",
                       out="attn.out_proj", fc="mlp.c_fc", proj="mlp.c_proj")
TIMM_BLOCK = dict(blocks="blocks", ln_1="norm1", ln_2="norm2", qkv="attn.qkv.", out="attn.proj",
                  fc="mlp.fc1", proj="mlp.fc2")


def _block_rules(tprefix: str, fprefix: tuple[str, ...], layers: int, names: dict = OPEN_CLIP_BLOCK
                 ) -> Iterator[Rule]:
    """`{tprefix}{names[blocks]}.{i}.*` -> Flax `transformer/resblocks_{i}/*`."""
    n = names
    for i in range(layers):
        t, f = f"{tprefix}{n['blocks']}.{i}", fprefix + ("transformer", f"resblocks_{i}")
        yield from _ln(f"{t}.{n['ln_1']}", f + ("ln_1",))
        yield from _ln(f"{t}.{n['ln_2']}", f + ("ln_2",))
        kernels, biases = _attn(f, ("query", "key", "value"))
        yield Rule(f"{t}.{n['qkv']}weight", kernels, "qkv_w")
        yield Rule(f"{t}.{n['qkv']}bias", biases, "qkv_b")
        yield Rule(f"{t}.{n['out']}.weight", (f + ("attn", "out_kernel"),), "out_w")
        yield Rule(f"{t}.{n['out']}.bias", (f + ("attn", "out_bias"),), "copy")
        yield from _dense(f"{t}.{n['fc']}", f + ("c_fc",))
        yield from _dense(f"{t}.{n['proj']}", f + ("c_proj",))


def _open_clip_vision_rules(config: ProLIPConfig) -> list[Rule]:
    """open_clip VisionTransformer (`visual.*`), plus ProLIP's [UNC] parameters."""
    c, v = config.vision, ("visual",)
    if c.pool != "tok" or c.patch_bias:
        raise ValueError("an open_clip VisionTransformer has a [CLS] pool and no patch bias")
    rules = [Rule("visual.conv1.weight", (v + ("patch_kernel",),), "conv"),
             Rule("visual.positional_embedding", (v + ("positional_embedding",),), "copy"),
             Rule("visual.class_embedding", (v + ("class_embedding",),), "copy")]
    if c.embed_unc:
        rules.append(Rule("visual.unc_embedding", (v + ("unc_embedding",),), "copy"))
    if c.ln_pre:
        rules += _ln("visual.ln_pre", v + ("ln_pre",))
    rules += [*_block_rules("visual.", v, c.layers), *_ln("visual.ln_post", v + ("ln_post",))]
    if c.proj:
        rules.append(Rule("visual.proj", (v + ("proj",),), "copy"))  # already (in, out): x @ proj
    if c.embed_unc:
        rules += _dense("visual.uncertainty_proj", v + ("uncertainty_proj",))
    return rules


def _timm_vision_rules(config: ProLIPConfig) -> list[Rule]:
    """open_clip TimmModel wrapping a timm ViT (`visual.trunk.*`) with the MAP head
    (timm/layers/attention_pool.py AttentionPoolLatent: latent, q, kv, proj, norm, mlp) and no
    extra projection (open_clip SigLIP configs: timm_pool="map", timm_proj="none")."""
    c, v, t = config.vision, ("visual",), "visual.trunk."
    if c.embed_unc or c.ln_pre or c.proj or c.pool != "map" or not c.patch_bias:
        raise ValueError("the timm SigLIP layout needs a VisionConfig with embed_unc=False, ln_pre=False, "
                         "proj=False, pool='map', patch_bias=True")
    m = v + ("map_head",)
    rules = [Rule(f"{t}patch_embed.proj.weight", (v + ("patch_kernel",),), "conv"),
             Rule(f"{t}patch_embed.proj.bias", (v + ("patch_bias",),), "copy"),
             Rule(f"{t}pos_embed", (v + ("positional_embedding",),), "lead1")]
    if c.class_token:
        rules.append(Rule(f"{t}cls_token", (v + ("class_embedding",),), "lead2"))
    rules += [*_block_rules(t, v, c.layers, TIMM_BLOCK), *_ln(f"{t}norm", v + ("ln_post",)),
              Rule(f"{t}attn_pool.latent", (m + ("probe",),), "lead2")]
    q_k, q_b = _attn(m, ("query",))
    kv_k, kv_b = _attn(m, ("key", "value"))
    rules += [Rule(f"{t}attn_pool.q.weight", q_k, "qkv_w"), Rule(f"{t}attn_pool.q.bias", q_b, "qkv_b"),
              Rule(f"{t}attn_pool.kv.weight", kv_k, "qkv_w"), Rule(f"{t}attn_pool.kv.bias", kv_b, "qkv_b"),
              Rule(f"{t}attn_pool.proj.weight", (m + ("attn", "out_kernel"),), "out_w"),
              Rule(f"{t}attn_pool.proj.bias", (m + ("attn", "out_bias"),), "copy"),
              *_ln(f"{t}attn_pool.norm", m + ("ln",)),
              *_dense(f"{t}attn_pool.mlp.fc1", m + ("c_fc",)),
              *_dense(f"{t}attn_pool.mlp.fc2", m + ("c_proj",))]
    return rules


def _text_rules(config: ProLIPConfig, prefix: str) -> list[Rule]:
    """open_clip TextTransformer under `prefix` ('text.', or '' in open_clip's CLIP class)."""
    c, t = config.text, ("text",)
    rules = []
    if c.embed_unc:
        rules += [Rule(f"{prefix}cls_emb", (t + ("cls_emb",),), "copy"),
                  Rule(f"{prefix}unc_emb", (t + ("unc_emb",),), "copy")]
    rules += [Rule(f"{prefix}positional_embedding", (t + ("positional_embedding",),), "copy"),
              Rule(f"{prefix}token_embedding.weight", (t + ("token_embedding",),), "copy"),
              *_block_rules(prefix, t, c.layers), *_ln(f"{prefix}ln_final", t + ("ln_final",))]
    if c.proj_bias:  # open_clip: nn.Linear(width, embed_dim) when proj_bias, else a raw (in, out) Parameter
        rules += _dense(f"{prefix}text_projection", t + ("text_projection",))
    else:
        rules.append(Rule(f"{prefix}text_projection", (t + ("text_projection", "kernel"),), "copy"))
    if c.embed_unc:
        rules += _dense(f"{prefix}text_uncertainty_projection", t + ("text_uncertainty_projection",))
    return rules


def conversion_rules(config: ProLIPConfig, layout: str = "prolip", logit_bias: bool = True) -> list[Rule]:
    """Every torch key of a state_dict of this layout and the Flax leaves it corresponds to.

    `logit_bias=False`: the source has none (OpenAI CLIP); the Flax leaf is then not covered."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown state_dict layout {layout!r}; known: {LAYOUTS}")
    other = config.other_paper_options()
    if other:  # PCME++ / Pishdad heads (models/heads.py): no open_clip or reference module has them
        raise ValueError(f"the PyTorch reference (naver-ai/prolip, open_clip) cannot load this architecture: "
                         f"{', '.join(other)} (port-only options; no {layout} state_dict layout has them)")
    rules = [Rule("logit_scale", (("logit_scale",),), "copy")]
    if logit_bias:
        rules.append(Rule("logit_bias", (("logit_bias",),), "copy"))
    rules += _timm_vision_rules(config) if layout == "timm_siglip" else _open_clip_vision_rules(config)
    rules += _text_rules(config, "" if layout == "open_clip" else "text.")
    return rules


# ------------------------------------------------------------------------ layout changes
def _to_flax(kind: str, w: np.ndarray, flax_shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    if kind == "copy":
        return [w]
    if kind == "linear":
        return [w.T]
    if kind == "conv":
        return [w.transpose(2, 3, 1, 0)]
    if kind == "qkv_w":
        return [part.T.reshape(s) for part, s in zip(np.split(w, len(flax_shapes), axis=0), flax_shapes)]
    if kind == "qkv_b":
        return [part.reshape(s) for part, s in zip(np.split(w, len(flax_shapes)), flax_shapes)]
    if kind == "out_w":
        return [w.T.reshape(flax_shapes[0])]
    if kind in ("lead1", "lead2"):
        return [w.reshape(flax_shapes[0])]
    raise ValueError(kind)


def _to_torch(kind: str, leaves: list[np.ndarray]) -> np.ndarray:
    if kind == "copy":
        return leaves[0]
    if kind == "linear":
        return leaves[0].T
    if kind == "conv":
        return leaves[0].transpose(3, 2, 0, 1)
    if kind == "qkv_w":
        return np.concatenate([x.reshape(x.shape[0], -1).T for x in leaves], axis=0)
    if kind == "qkv_b":
        return np.concatenate([x.reshape(-1) for x in leaves])
    if kind == "out_w":
        n, h, d = leaves[0].shape
        return leaves[0].reshape(n * h, d).T
    if kind in ("lead1", "lead2"):
        return leaves[0].reshape(_torch_shape(kind, [leaves[0].shape]))
    raise ValueError(kind)


def _torch_shape(kind: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    s, n = shapes[0], len(shapes)
    if kind == "copy":
        return tuple(s)
    if kind == "linear":
        return tuple(reversed(s))
    if kind == "conv":
        return (s[3], s[2], s[0], s[1])
    if kind == "qkv_w":
        return (n * s[1] * s[2], s[0])
    if kind == "qkv_b":
        return (n * s[0] * s[1],)
    if kind == "out_w":
        return (s[2], s[0] * s[1])
    if kind == "lead1":
        return (1, *s)
    if kind == "lead2":
        return (1, 1, *s)
    raise ValueError(kind)


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def rule_shapes(rules: list[Rule], abstract: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """source key -> the shape it must have for the model whose parameter shapes are `abstract`."""
    return {r.torch_key: _torch_shape(r.kind, [tuple(_get(abstract, p).shape) for p in r.flax_paths])
            for r in rules}


def expected_torch_shapes(config: ProLIPConfig, layout: str = "prolip") -> dict[str, tuple[int, ...]]:
    """torch key -> shape for a model of this config (no parameters are allocated)."""
    return rule_shapes(conversion_rules(config, layout), abstract_params(config))


def mismatches(state_dict: Mapping[str, Any], expected: Mapping[str, tuple[int, ...]]
               ) -> tuple[list[str], list[str], list[str]]:
    """(missing keys, unexpected keys, 'key: got .., expected ..' for wrong shapes), sorted."""
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = sorted(f"{k}: got {tuple(np.shape(state_dict[k]))}, expected {expected[k]}"
                   for k in set(expected) & set(state_dict) if tuple(np.shape(state_dict[k])) != expected[k])
    return missing, unexpected, wrong


def check_state_dict(state_dict: Mapping[str, Any], config: ProLIPConfig, layout: str = "prolip") -> None:
    """Raises ValueError naming every missing key, unexpected key and wrong shape."""
    missing, unexpected, wrong = mismatches(state_dict, expected_torch_shapes(config, layout))
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s): {missing}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s): {unexpected}")
        if wrong:
            parts.append(f"{len(wrong)} wrong shape(s): {wrong}")
        what = "the ProLIP config" if layout == "prolip" else f"the model config ({layout} layout)"
        raise ValueError(f"state_dict does not match {what}: " + "; ".join(parts))


def apply_rules(state_dict: Mapping[str, Any], rules: list[Rule], abstract: Mapping[str, Any]) -> dict:
    """Source arrays -> nested Flax params (float32 numpy) for the leaves the rules cover.
    Keys and shapes must have been checked (`mismatches`)."""
    params: dict = {}
    for r in rules:
        w = np.asarray(state_dict[r.torch_key], dtype=np.float32)
        shapes = [tuple(_get(abstract, p).shape) for p in r.flax_paths]
        for path, leaf in zip(r.flax_paths, _to_flax(r.kind, w, shapes)):
            _set(params, path, np.array(leaf, dtype=np.float32, order="C"))
    return params


def unapply_rules(params: Mapping[str, Any], rules: list[Rule]) -> dict[str, np.ndarray]:
    """Flax params -> source arrays (float32 numpy, contiguous, source layouts)."""
    out = {}
    for r in rules:
        try:
            leaves = [np.asarray(_get(params, p), dtype=np.float32) for p in r.flax_paths]
        except KeyError as e:
            raise ValueError(f"params lack {'/'.join(r.flax_paths[0])} (needed for {r.torch_key})") from e
        out[r.torch_key] = np.array(_to_torch(r.kind, leaves), dtype=np.float32, order="C")  # keeps 0-d
    return out


def strip_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> dict[str, Any]:
    """DDP checkpoints prefix every key with 'module.' (naver-ai/prolip's ProLIPHF save/load)."""
    if state_dict and all(k.startswith(prefix) for k in state_dict):
        return {k[len(prefix):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def torch_to_flax(state_dict: Mapping[str, Any], config: ProLIPConfig, layout: str = "prolip",
                  scan_layers: bool = False) -> dict:
    """Reference state_dict (numpy arrays, torch layouts) -> Flax params (float32 numpy), the
    blocks unrolled or, with `scan_layers`, stacked (models/layout.py)."""
    state_dict = strip_prefix(state_dict)
    check_state_dict(state_dict, config, layout)
    params = apply_rules(state_dict, conversion_rules(config, layout), abstract_params(config))
    return block_layout.to_layout(params, scan_layers)


def flax_to_torch(params: Mapping[str, Any], config: ProLIPConfig, layout: str = "prolip") -> dict[str, np.ndarray]:
    """Flax params, either block layout -> reference state_dict (float32 numpy arrays, contiguous,
    torch layouts)."""
    params = block_layout.to_layout(params, False)
    out = unapply_rules(params, conversion_rules(config, layout))
    check_state_dict(out, config, layout)  # also catches params of another config (wrong shapes)
    return out


# ---------------------------------------------------------------------- Hugging Face folder
def load_hf(hf_dir: str | os.PathLike) -> tuple[dict, ProLIPConfig]:
    """Reads `config.json` + `model.safetensors` (as `ProLIPHF.save_pretrained` writes), from a
    local folder or any fsspec URL (the path layer)."""
    if not fs.isdir(hf_dir):
        raise FileNotFoundError(f"{hf_dir} is not a directory (expected a Hugging Face folder with "
                                f"{CONFIG_NAME} and {WEIGHTS_NAME})")
    cfg_path, w_path = fs.join(hf_dir, CONFIG_NAME), fs.join(hf_dir, WEIGHTS_NAME)
    if not fs.isfile(cfg_path):
        raise FileNotFoundError(f"{cfg_path} not found: a ProLIP Hugging Face folder needs {CONFIG_NAME}")
    if not fs.isfile(w_path):
        pickled = [n for n in fs.listdir(hf_dir) if n.endswith((".bin", ".pt"))]
        hint = f" ({pickled} are pickle files, which are refused; re-save as safetensors)" if pickled else ""
        raise FileNotFoundError(f"{w_path} not found{hint}")
    config = ProLIPConfig.from_dict(json.loads(fs.read_text(cfg_path)))
    return torch_to_flax(read_safetensors(w_path), config), config


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    try:
        if fs.is_url(path):  # a bucket object: safe_open maps local files only, so read it whole
            from safetensors.flax import load

            for k, v in load(fs.read_bytes(path)).items():
                out[k] = np.array(v, dtype=np.float32)
            return out
        with safe_open(str(path), framework="flax") as f:  # "flax" also reads bfloat16
            for k in f.keys():
                out[k] = np.array(f.get_tensor(k), dtype=np.float32)  # writable host copy
    except (ImportError, OSError):  # a missing package, or the path layer's one-line bucket error
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"could not read {path} as safetensors: {e}") from e
    return out


def is_hf_dir(path: str | os.PathLike) -> bool:
    """A folder (local, or any fsspec URL) holding config.json and model.safetensors."""
    return fs.isfile(fs.join(path, CONFIG_NAME)) and fs.isfile(fs.join(path, WEIGHTS_NAME))
