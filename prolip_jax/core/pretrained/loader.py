"""`load_pretrained`: one entry for every source family.

    config, params, report = load_pretrained("timm/ViT-B-16-SigLIP")          # hub name
    config, params, report = load_pretrained("webli_en_b16_224_63724782.npz")  # big_vision
    config, params, report = load_pretrained("dir/with/open_clip_model.safetensors", arch="ViT-B-32-quickgelu")

Formats: 'prolip' (the reference's Hugging Face folder, or a prolip_jax checkpoint),
'open_clip' (open_clip `CLIP` = OpenAI-style, or `CustomTextCLIP` with an open_clip ViT),
'timm_siglip' (open_clip `CustomTextCLIP` with a timm SigLIP trunk), 'big_vision' (SigLIP
two-tower .npz). Local safetensors / npz only: pickled files are refused (unpickling runs code).
Nothing is written; the returned `ImportReport` names the format detected, what was loaded and
every source key that had no place in the model.
"""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np

from etils import epath

from prolip_jax.core import checkpoint
from prolip_jax.core import convert, artifacts
from prolip_jax.runtime import paths as fs
from prolip_jax.core.models import layout as block_layout  # `layout` here names a file's key layout
from prolip_jax.core.models.config import VARIANTS, ProLIPConfig, get_config
from prolip_jax.core.models.prolip import abstract_params
from prolip_jax.core.pretrained import bigvision, hub, openclip
from prolip_jax.core.pretrained.hub import pickle_message

FORMATS = ("auto", "prolip", "open_clip", "timm_siglip", "big_vision")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_LAYOUT_FORMAT = {"prolip": "prolip", "open_clip": "open_clip", "open_clip_text": "open_clip",
                  "timm_siglip": "timm_siglip"}


@dataclasses.dataclass
class ImportReport:
    source: str  # the file or folder read
    format: str  # one of FORMATS[1:]
    layout: str  # the key layout: convert.LAYOUTS, 'big_vision' or 'prolip_jax' (own checkpoint)
    loaded: list[str]  # Flax parameter paths ('visual/proj') filled from the source
    filled: dict[str, str] = dataclasses.field(default_factory=dict)  # paths not in the source -> value
    unplaced: list[str] = dataclasses.field(default_factory=list)  # source keys with no place (dropped)

    def summary(self) -> str:
        lines = [f"imported {self.source} as {self.format} ({self.layout} layout): "
                 f"{len(self.loaded)} parameters loaded"]
        lines += [f"  set (not in the source): {k} = {v}" for k, v in sorted(self.filled.items())]
        if self.unplaced:
            lines.append(f"  {len(self.unplaced)} source key(s) without a place, dropped: {self.unplaced}")
        return "\n".join(lines)


def load_pretrained(path_or_repo: str | os.PathLike, format: str = "auto",
                    arch: str | Mapping[str, Any] | ProLIPConfig | None = None,
                    allow_unplaced: bool = False, scan_layers: bool = False) -> tuple[ProLIPConfig, dict, ImportReport]:
    """(config, float32 params, report) of a pretrained model of any supported family.

    path_or_repo: a file (.safetensors, .npz), a folder (Hugging Face layout, open_clip hub
      layout, a prolip_jax checkpoint, its step folder or training workdir) or a Hugging Face
      repo id ('timm/ViT-B-16-SigLIP'): prolip_jax.core.artifacts.locate's rule.
    format: 'auto' detects the family from the keys; any other value must match it.
    arch: the architecture when the source does not carry it: an open_clip model name
      ('ViT-B-32-quickgelu', openclip.ARCHS) or model-config dict for open_clip/timm weights, a
      ProLIP variant name for ProLIP weights, or a ProLIPConfig for any family. Overrides a
      config file beside the weights; big_vision's is read off the shapes.
    allow_unplaced: return (and report) source keys that have no place instead of raising.
    scan_layers: the params with each tower's blocks stacked (models/layout.py); default unrolled.
    Raises ValueError for a wrong family, unreadable/truncated or pickled file, keys missing
    from the source or shapes that differ from the config; FileNotFoundError for missing files.
    """
    if format not in FORMATS:
        raise ValueError(f"unknown format {format!r}; choose from {FORMATS}")
    if _bucket_weights(path_or_repo):  # gs://.../model.safetensors or a folder of them: the path layer
        where = artifacts.Located("other", fs.as_path(path_or_repo))
    else:
        where = artifacts.locate(path_or_repo)  # paths are paths; only a missing org/name is a repo id
    if where.kind == "checkpoint":  # a prolip_jax checkpoint, its step folder or training workdir
        return _own_checkpoint(where.step_dir, format, scan_layers)
    if where.kind == "hub":
        if format == "big_vision":
            raise ValueError("big_vision .npz checkpoints are not on the Hugging Face hub; pass the local file")
        path = hub.resolve(str(path_or_repo), prefer=format)
    else:
        path = where.path if isinstance(where.path, epath.Path) else Path(where.path)

    if path.is_dir():
        path = _weights_in(path)
    if path.suffix in PICKLE_SUFFIXES:
        raise ValueError(pickle_message(path))

    if path.suffix == ".npz":
        flat = bigvision.normalise(bigvision.read_npz(path))
        detected, layout = ("big_vision", "big_vision") if bigvision.is_big_vision(flat) else (None, None)
    elif path.suffix == ".safetensors":
        flat = convert.strip_prefix(convert.read_safetensors(path))
        layout = openclip.detect_layout(set(flat))
        detected = _LAYOUT_FORMAT.get(layout)
    else:
        raise ValueError(f"{path}: unsupported file type (expected .safetensors or .npz)")
    if detected is None:
        raise ValueError(f"{path}: the keys match no supported family (ProLIP, open_clip, timm SigLIP, "
                         f"big_vision SigLIP); first keys: {sorted(flat)[:8]}")
    if format not in ("auto", detected):
        raise ValueError(f"format={format!r} was requested but {path} holds a {detected} checkpoint "
                         f"({layout} key layout); pass format={detected!r} or 'auto'")

    config = _config(detected, path, arch, flat)
    if layout == "big_vision":
        rules = bigvision.rules(config)
    else:
        rules = convert.conversion_rules(config, layout, logit_bias="logit_bias" in flat)
    config, params, report = _place(flat, config, rules, ImportReport(str(path), detected, layout, []), allow_unplaced)
    return config, block_layout.to_layout(params, scan_layers), report


def _bucket_weights(path: Any) -> bool:
    """A bucket URL naming a weights file, or a folder holding one (not an orbax checkpoint,
    which orbax reads itself)."""
    if not fs.is_url(path):
        return False
    if os.fspath(path).endswith((".safetensors", ".npz") + PICKLE_SUFFIXES):
        return True
    return bool(fs.glob(fs.join(path, "*.safetensors")) or fs.glob(fs.join(path, "*.npz")))


def _weights_in(folder: Path) -> Path:
    for name in ("open_clip_model.safetensors", "model.safetensors"):
        if (folder / name).is_file():
            return folder / name
    found = sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.npz"))
    if len(found) == 1:
        return found[0]
    pickled = sorted(p for s in PICKLE_SUFFIXES for p in folder.glob(f"*{s}"))
    if not found and pickled:
        raise ValueError(pickle_message(pickled[0]))
    what = f"several candidates {[p.name for p in found]}: pass one file" if found else "no .safetensors or .npz"
    raise FileNotFoundError(f"{folder}: {what} (expected open_clip_model.safetensors, model.safetensors, "
                            "a big_vision .npz or a prolip_jax checkpoint)")


def _config(fmt: str, path: Path, arch: Any, flat: Mapping[str, np.ndarray]) -> ProLIPConfig:
    if isinstance(arch, ProLIPConfig):
        return arch
    if fmt == "big_vision":
        if arch is not None:
            raise ValueError("big_vision: the architecture is read from the shapes; arch must be None or a ProLIPConfig")
        return bigvision.infer_config(flat)
    if fmt == "prolip":
        if arch is not None:
            return get_config(arch)  # a ProLIP variant name or reference config dict
        cfg_path = path.parent / convert.CONFIG_NAME
        if not cfg_path.is_file():
            raise FileNotFoundError(f"{cfg_path} not found: a ProLIP state_dict needs its config.json beside it "
                                    f"or arch= (a variant: {sorted(VARIANTS)})")
        return ProLIPConfig.from_dict(json.loads(cfg_path.read_text()))
    if arch is not None:
        return openclip.config_from_open_clip(openclip.arch_config(arch) if isinstance(arch, str) else arch)
    cfg_path = path.parent / "open_clip_config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: pass arch= (an open_clip name such as "
                                f"'ViT-B-32-quickgelu'; known: {sorted(openclip.ARCHS)}) or put the model's "
                                "open_clip_config.json beside the weights")
    cfg = json.loads(cfg_path.read_text())
    return openclip.config_from_open_clip(cfg.get("model_cfg", cfg))


def _place(flat: Mapping[str, np.ndarray], config: ProLIPConfig, rules: list[convert.Rule],
           report: ImportReport, allow_unplaced: bool) -> tuple[ProLIPConfig, dict, ImportReport]:
    abstract = abstract_params(config)
    missing, unexpected, wrong = convert.mismatches(flat, convert.rule_shapes(rules, abstract))
    if missing or wrong:
        parts = [f"{len(missing)} missing key(s): {missing}"] if missing else []
        parts += [f"{len(wrong)} wrong shape(s): {wrong}"] if wrong else []
        raise ValueError(f"{report.source} ({report.format}) does not match the model config "
                         f"(check arch / the config file): " + "; ".join(parts))
    report.unplaced = unexpected
    if unexpected and not allow_unplaced:
        raise ValueError(f"{report.source} ({report.format}): {len(unexpected)} key(s) have no place in the model: "
                         f"{unexpected} (allow_unplaced=True drops them)")
    params = convert.apply_rules(flat, rules, abstract)
    covered = {p for r in rules for p in r.flax_paths}
    report.loaded = sorted("/".join(p) for p in covered)
    for keypath, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        p = tuple(k.key for k in keypath)
        if p in covered:
            continue
        if p == ("logit_bias",):  # OpenAI CLIP has no logit bias: the neutral value
            convert._set(params, p, np.zeros((), np.float32))
            report.filled["logit_bias"] = "0.0 (the source has no logit bias)"
        else:
            raise ValueError(f"internal: no rule fills {'/'.join(p)}")
    return config, params, report


def _own_checkpoint(path: Path, fmt: str, scan_layers: bool) -> tuple[ProLIPConfig, dict, ImportReport]:
    if fmt not in ("auto", "prolip"):
        raise ValueError(f"format={fmt!r} was requested but {path} is a prolip_jax checkpoint (format 'prolip')")
    params, config, step = checkpoint.load_params(path)
    params = block_layout.to_layout(jax_to_numpy(params), scan_layers)
    loaded = sorted("/".join(k.key for k in kp) for kp, _ in _leaves_with_path(params))
    return config, params, ImportReport(f"{path} (step {step})", "prolip", "prolip_jax", loaded)


def jax_to_numpy(tree: Any) -> Any:
    import jax

    return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


def _leaves_with_path(tree: Any):
    import jax

    return jax.tree_util.tree_leaves_with_path(tree)
