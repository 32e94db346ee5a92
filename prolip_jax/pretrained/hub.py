"""Hugging Face hub names: `org/name` -> a local folder holding the files a format needs.

Files come from `huggingface_hub.hf_hub_download`: downloaded when online, read from the hub
cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub) when offline (`HF_HUB_OFFLINE=1`) or
when the hub cannot be reached. Both variables are read at call time, not at import.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# What each source format needs from a repo, in the order tried: (config file, weights file).
# open_clip's hub uploads are `open_clip_config.json` + `open_clip_model.safetensors`
# (open_clip/constants.py HF_CONFIG_NAME, HF_SAFE_WEIGHTS_NAME); a ProLIP repo is the
# reference's `ProLIPHF.save_pretrained` folder (`config.json` + `model.safetensors`).
OPEN_CLIP_FILES = ("open_clip_config.json", "open_clip_model.safetensors")
PROLIP_FILES = ("config.json", "model.safetensors")
PICKLED_WEIGHTS = {"open_clip_model.safetensors": "open_clip_pytorch_model.bin",
                   "model.safetensors": "pytorch_model.bin"}


def is_repo_id(path: str | os.PathLike) -> bool:
    """'org/name' that is not an existing local path."""
    s = str(path)
    return bool(_REPO_ID.match(s)) and not Path(s).exists()


def offline() -> bool:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE


def _fetch(repo_id: str, filename: str) -> Path | None:
    """The local path of one file, or None when the repo (or the cache, offline) lacks it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    try:
        return Path(hf_hub_download(repo_id, filename, cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                    local_files_only=offline()))
    except EntryNotFoundError:  # not in the repo, or (offline / unreachable hub) not in the cache
        return None
    except HfHubHTTPError as e:  # unknown or gated repo, bad revision
        raise FileNotFoundError(f"Hugging Face repo {repo_id!r}: {e}") from e


def resolve(repo_id: str, prefer: str = "auto") -> Path:
    """Downloads (or finds in the cache) a repo's config + weights; returns their folder.

    prefer: 'prolip' tries the ProLIP files first, anything else the open_clip ones first
    (a repo like apple/DFN5B-CLIP-ViT-H-14 also has a transformers `config.json`)."""
    order = (PROLIP_FILES, OPEN_CLIP_FILES) if prefer == "prolip" else (OPEN_CLIP_FILES, PROLIP_FILES)
    for config_name, weights_name in order:
        config = _fetch(repo_id, config_name)
        if config is None:
            continue
        weights = _fetch(repo_id, weights_name)
        if weights is None:
            pickled = PICKLED_WEIGHTS[weights_name]
            pickled_path = _fetch(repo_id, pickled)
            if pickled_path is not None:
                raise ValueError(f"Hugging Face repo {repo_id!r} has {pickled} but no {weights_name}. "
                                 + pickle_message(pickled_path))
            raise FileNotFoundError(_missing(repo_id, [weights_name]))
        if config.parent != weights.parent:  # same snapshot folder unless revisions differ
            raise FileNotFoundError(f"{config} and {weights} of {repo_id!r} are in different snapshots")
        return config.parent
    raise FileNotFoundError(_missing(repo_id, [f for files in order for f in files]))


def _missing(repo_id: str, files: list[str]) -> str:
    where = os.environ.get("HF_HUB_CACHE") or "the default hub cache (~/.cache/huggingface/hub)"
    if offline():
        how = f"HF_HUB_OFFLINE is set and they are not in {where}"
    else:
        how = f"they could not be downloaded (no such file in the repo, or the hub is unreachable) nor found in {where}"
    return (f"Hugging Face repo {repo_id!r}: none of {files} is available: {how}. Download them with "
            f"`huggingface-cli download {repo_id} {' '.join(files)}` where the hub is reachable, or pass a "
            "local folder")


def pickle_message(path: str | os.PathLike) -> str:
    out = Path(path).with_suffix(".safetensors").name
    return (f"{Path(path).name} is a pickled PyTorch file, which prolip_jax refuses to load (unpickling can "
            f"run code). Convert it once where PyTorch is installed:\n  python -c \"import torch; "
            f"from safetensors.torch import save_file; sd = torch.load('{path}', map_location='cpu', "
            f"weights_only=True); sd = sd.get('state_dict', sd); "
            f"save_file({{k: v.contiguous() for k, v in sd.items()}}, '{out}')\"\n"
            f"(name it open_clip_model.safetensors for an open_clip model, model.safetensors for a ProLIP "
            f"folder) and pass the .safetensors file or its folder.")
