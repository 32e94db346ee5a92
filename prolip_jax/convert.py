"""PyTorch state_dict <-> Flax params, and the Hugging Face folder layout (REFERENCE §4).

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
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

from prolip_jax.models.config import ProLIPConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# Layout kinds: how one torch tensor maps to one (or three) Flax leaves.
#   copy   same array                         linear  torch (out, in)  <-> flax (in, out)
#   conv   torch (O, I, kh, kw) <-> flax (kh, kw, I, O)
#   qkv_w  torch (3D, D) rows [q; k; v] <-> 3 x flax (D, N, H)  (heads = contiguous H columns)
#   qkv_b  torch (3D,)  <-> 3 x flax (N, H)     out_w  torch (D, N*H) <-> flax (N, H, D)


@dataclasses.dataclass(frozen=True)
class Rule:
    torch_key: str
    flax_paths: tuple[tuple[str, ...], ...]
    kind: str


def _block_rules(tprefix: str, fprefix: tuple[str, ...], layers: int) -> Iterator[Rule]:
    for i in range(layers):
        t, f = f"{tprefix}.transformer.resblocks.{i}", fprefix + ("transformer", f"resblocks_{i}")
        for ln in ("ln_1", "ln_2"):
            yield Rule(f"{t}.{ln}.weight", (f + (ln, "scale"),), "copy")
            yield Rule(f"{t}.{ln}.bias", (f + (ln, "bias"),), "copy")
        qkv = ("query", "key", "value")
        yield Rule(f"{t}.attn.in_proj_weight", tuple(f + ("attn", f"{n}_kernel") for n in qkv), "qkv_w")
        yield Rule(f"{t}.attn.in_proj_bias", tuple(f + ("attn", f"{n}_bias") for n in qkv), "qkv_b")
        yield Rule(f"{t}.attn.out_proj.weight", (f + ("attn", "out_kernel"),), "out_w")
        yield Rule(f"{t}.attn.out_proj.bias", (f + ("attn", "out_bias"),), "copy")
        for fc in ("c_fc", "c_proj"):
            yield Rule(f"{t}.mlp.{fc}.weight", (f + (fc, "kernel"),), "linear")
            yield Rule(f"{t}.mlp.{fc}.bias", (f + (fc, "bias"),), "copy")


def conversion_rules(config: ProLIPConfig) -> list[Rule]:
    """Every torch key of a ProLIP state_dict and the Flax leaves it corresponds to."""
    v = ("visual",)
    rules = [
        Rule("logit_scale", (("logit_scale",),), "copy"),
        Rule("logit_bias", (("logit_bias",),), "copy"),
        Rule("visual.class_embedding", (v + ("class_embedding",),), "copy"),
        Rule("visual.unc_embedding", (v + ("unc_embedding",),), "copy"),
        Rule("visual.positional_embedding", (v + ("positional_embedding",),), "copy"),
        Rule("visual.proj", (v + ("proj",),), "copy"),  # already (in, out): used as x @ proj
        Rule("visual.conv1.weight", (v + ("patch_kernel",),), "conv"),
        Rule("visual.ln_pre.weight", (v + ("ln_pre", "scale"),), "copy"),
        Rule("visual.ln_pre.bias", (v + ("ln_pre", "bias"),), "copy"),
        *_block_rules("visual", v, config.vision.layers),
        Rule("visual.ln_post.weight", (v + ("ln_post", "scale"),), "copy"),
        Rule("visual.ln_post.bias", (v + ("ln_post", "bias"),), "copy"),
        Rule("visual.uncertainty_proj.weight", (v + ("uncertainty_proj", "kernel"),), "linear"),
        Rule("visual.uncertainty_proj.bias", (v + ("uncertainty_proj", "bias"),), "copy"),
    ]
    t = ("text",)
    rules += [
        Rule("text.cls_emb", (t + ("cls_emb",),), "copy"),
        Rule("text.unc_emb", (t + ("unc_emb",),), "copy"),
        Rule("text.positional_embedding", (t + ("positional_embedding",),), "copy"),
        Rule("text.token_embedding.weight", (t + ("token_embedding",),), "copy"),
        *_block_rules("text", t, config.text.layers),
        Rule("text.ln_final.weight", (t + ("ln_final", "scale"),), "copy"),
        Rule("text.ln_final.bias", (t + ("ln_final", "bias"),), "copy"),
    ]
    for name in ("text_projection", "text_uncertainty_projection"):
        rules.append(Rule(f"text.{name}.weight", (t + (name, "kernel"),), "linear"))
        rules.append(Rule(f"text.{name}.bias", (t + (name, "bias"),), "copy"))
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
        return [part.T.reshape(s) for part, s in zip(np.split(w, 3, axis=0), flax_shapes)]
    if kind == "qkv_b":
        return [part.reshape(s) for part, s in zip(np.split(w, 3), flax_shapes)]
    if kind == "out_w":
        return [w.T.reshape(flax_shapes[0])]
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
    raise ValueError(kind)


def _torch_shape(kind: str, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    s = shapes[0]
    if kind == "copy":
        return tuple(s)
    if kind == "linear":
        return tuple(reversed(s))
    if kind == "conv":
        return (s[3], s[2], s[0], s[1])
    if kind == "qkv_w":
        return (3 * s[1] * s[2], s[0])
    if kind == "qkv_b":
        return (3 * s[0] * s[1],)
    if kind == "out_w":
        return (s[2], s[0] * s[1])
    raise ValueError(kind)


def _get(tree: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


def _set(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for p in path[:-1]:
        tree = tree.setdefault(p, {})
    tree[path[-1]] = value


def expected_torch_shapes(config: ProLIPConfig) -> dict[str, tuple[int, ...]]:
    """torch key -> shape for a model of this config (no parameters are allocated)."""
    from prolip_jax.models.prolip import abstract_params  # local: keeps this module light

    abstract = abstract_params(config)
    return {r.torch_key: _torch_shape(r.kind, [tuple(_get(abstract, p).shape) for p in r.flax_paths])
            for r in conversion_rules(config)}


def check_state_dict(state_dict: Mapping[str, Any], config: ProLIPConfig) -> None:
    """Raises ValueError naming every missing key, unexpected key and wrong shape."""
    expected = expected_torch_shapes(config)
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    wrong = sorted(f"{k}: got {tuple(np.shape(state_dict[k]))}, expected {expected[k]}"
                   for k in set(expected) & set(state_dict) if tuple(np.shape(state_dict[k])) != expected[k])
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s): {missing}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s): {unexpected}")
        if wrong:
            parts.append(f"{len(wrong)} wrong shape(s): {wrong}")
        raise ValueError("state_dict does not match the ProLIP config: " + "; ".join(parts))


def strip_prefix(state_dict: Mapping[str, Any], prefix: str = "module.") -> dict[str, Any]:
    """DDP checkpoints prefix every key with 'module.' (REFERENCE §4.2)."""
    if state_dict and all(k.startswith(prefix) for k in state_dict):
        return {k[len(prefix):]: v for k, v in state_dict.items()}
    return dict(state_dict)


def torch_to_flax(state_dict: Mapping[str, Any], config: ProLIPConfig) -> dict:
    """Reference state_dict (numpy arrays, torch layouts) -> Flax params (float32 numpy)."""
    state_dict = strip_prefix(state_dict)
    check_state_dict(state_dict, config)
    from prolip_jax.models.prolip import abstract_params

    abstract = abstract_params(config)
    params: dict = {}
    for r in conversion_rules(config):
        w = np.asarray(state_dict[r.torch_key], dtype=np.float32)
        shapes = [tuple(_get(abstract, p).shape) for p in r.flax_paths]
        for path, leaf in zip(r.flax_paths, _to_flax(r.kind, w, shapes)):
            _set(params, path, np.array(leaf, dtype=np.float32, order="C"))
    return params


def flax_to_torch(params: Mapping[str, Any], config: ProLIPConfig) -> dict[str, np.ndarray]:
    """Flax params -> reference state_dict (float32 numpy arrays, contiguous, torch layouts)."""
    out = {}
    for r in conversion_rules(config):
        try:
            leaves = [np.asarray(_get(params, p), dtype=np.float32) for p in r.flax_paths]
        except KeyError as e:
            raise ValueError(f"params lack {'/'.join(r.flax_paths[0])} (needed for {r.torch_key})") from e
        out[r.torch_key] = np.array(_to_torch(r.kind, leaves), dtype=np.float32, order="C")  # keeps 0-d
    check_state_dict(out, config)  # also catches params of another config (wrong shapes)
    return out


# ---------------------------------------------------------------------- Hugging Face folder
def load_hf(hf_dir: str | os.PathLike) -> tuple[dict, ProLIPConfig]:
    """Reads `config.json` + `model.safetensors` (as `ProLIPHF.save_pretrained` writes)."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"{hf_dir} is not a directory (expected a Hugging Face folder with "
                                f"{CONFIG_NAME} and {WEIGHTS_NAME})")
    cfg_path, w_path = hf_dir / CONFIG_NAME, hf_dir / WEIGHTS_NAME
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: a ProLIP Hugging Face folder needs {CONFIG_NAME}")
    if not w_path.is_file():
        pickled = [p.name for p in hf_dir.glob("*.bin")] + [p.name for p in hf_dir.glob("*.pt")]
        hint = f" ({pickled} are pickle files, which are refused; re-save as safetensors)" if pickled else ""
        raise FileNotFoundError(f"{w_path} not found{hint}")
    config = ProLIPConfig.from_dict(json.loads(cfg_path.read_text()))
    return torch_to_flax(read_safetensors(w_path), config), config


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    from safetensors import safe_open

    out = {}
    try:
        with safe_open(str(path), framework="flax") as f:  # "flax" also reads bfloat16
            for k in f.keys():
                out[k] = np.array(f.get_tensor(k), dtype=np.float32)  # writable host copy
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"could not read {path} as safetensors: {e}") from e
    return out


def save_hf(hf_dir: str | os.PathLike, params: Mapping[str, Any], config: ProLIPConfig,
            overwrite: bool = False) -> Path:
    """Writes `config.json` + `model.safetensors` loadable by `ProLIPHF.from_pretrained(hf_dir)`.

    Everything is converted and checked first, then written into a temporary folder that is
    renamed into place, so a failure never leaves a half-written folder.
    """
    from safetensors.numpy import save_file

    hf_dir = Path(hf_dir)
    if hf_dir.exists() and any(hf_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"{hf_dir} exists and is not empty (pass overwrite=True / --overwrite)")
    state_dict = flax_to_torch(params, config)
    hf_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{hf_dir.name}.tmp-", dir=hf_dir.parent))
    try:
        save_file(state_dict, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        (tmp / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2) + "\n")
        if hf_dir.exists():
            shutil.rmtree(hf_dir)
        os.replace(tmp, hf_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return hf_dir


def is_hf_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / CONFIG_NAME).is_file() and (p / WEIGHTS_NAME).is_file()
