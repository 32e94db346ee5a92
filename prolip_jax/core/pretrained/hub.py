"""Hugging Face hub names: `org/name` -> a local folder holding the files a format needs.

Paths are paths: a string that exists locally, or looks like a path (absolute, `./`, `../`,
`~`, more than one `/`, a `scheme://` URL, a trailing `/`, or a weights / config file name such
as `x/model.npz`), is never a hub id. Only a missing, two-part `org/name` is tried on the hub
(`is_repo_id`); its error names the local path as well as the hub's answer.

Files come from `huggingface_hub.hf_hub_download`: downloaded when online, read from the hub
cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub) when offline (`HF_HUB_OFFLINE=1`) or
when the hub cannot be reached. One short request (`PROBE_TIMEOUT_S`, no retries) tells
whether it can: huggingface_hub's own fallback retries for about a minute before it reads the
cache. Both variables are read at call time, not at import.
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


# A name ending like a file is a path, not a repo (repo names may hold dots: `org/model.v2`).
_FILE_SUFFIXES = (".safetensors", ".npz", ".json", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".msgpack")
PROBE_TIMEOUT_S = 5.0  # seconds to learn whether the hub answers at all


def is_url(path: str | os.PathLike) -> bool:
    """`scheme://...` (gs://, s3://, file://, ...)."""
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", os.fspath(path)) is not None


def looks_like_path(path: str | os.PathLike) -> bool:
    """True for what can only be a file-system path or URL (whether or not it exists)."""
    s = os.fspath(path)
    return (os.path.isabs(s) or s.startswith(("./", "../", "~", ".\\", "..\\")) or s in (".", "..")
            or s.count("/") > 1 or "\\" in s or s.endswith("/") or is_url(s)
            or s.lower().endswith(_FILE_SUFFIXES))


def is_repo_id(path: str | os.PathLike) -> bool:
    """'org/name' that is neither an existing local path nor path-like (`looks_like_path`)."""
    s = os.fspath(path)
    return bool(_REPO_ID.match(s)) and not looks_like_path(s) and not Path(s).exists()


def offline() -> bool:
    from huggingface_hub import constants

    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE") or constants.HF_HUB_OFFLINE


def cli_download(repo_id: str, files: list[str]) -> str:
    """The download command of the installed huggingface_hub: `hf` from 1.0 on (which dropped
    `huggingface-cli`), `huggingface-cli` before."""
    import huggingface_hub

    major = int(re.match(r"\d+", huggingface_hub.__version__).group())
    return f"{'hf' if major >= 1 else 'huggingface-cli'} download {repo_id} {' '.join(files)}"


def reachable(repo_id: str, filename: str) -> bool:
    """Whether the hub answers one HEAD request for a file of the repo within PROBE_TIMEOUT_S,
    without retries. Any HTTP answer (404, 401 included) counts: the download then says what."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename), timeout=PROBE_TIMEOUT_S)
    except HfHubHTTPError:
        return True
    except Exception:  # no network, DNS, proxy, timeout: the cache is all there is
        return False
    return True


def _fetch(repo_id: str, filename: str, local_only: bool) -> Path | None:
    """The local path of one file, or None when the repo (or the cache, local_only) lacks it."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    try:
        return Path(hf_hub_download(repo_id, filename, cache_dir=os.environ.get("HF_HUB_CACHE") or None,
                                    local_files_only=local_only))
    except EntryNotFoundError:  # not in the repo, or (offline / unreachable hub) not in the cache
        return None
    except HfHubHTTPError as e:  # unknown or gated repo, bad revision
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FileNotFoundError(f"no such local file or folder {repo_id!r}, and as a Hugging Face repo: "
                                f"{first}") from e


def resolve(repo_id: str, prefer: str = "auto") -> Path:
    """Downloads (or finds in the cache) a repo's config + weights; returns their folder.

    prefer: 'prolip' tries the ProLIP files first, anything else the open_clip ones first
    (a repo like apple/DFN5B-CLIP-ViT-H-14 also has a transformers `config.json`)."""
    order = (PROLIP_FILES, OPEN_CLIP_FILES) if prefer == "prolip" else (OPEN_CLIP_FILES, PROLIP_FILES)
    why = "offline" if offline() else None
    if why is None and not reachable(repo_id, order[0][0]):
        why = "unreachable"
    local_only = why is not None
    for config_name, weights_name in order:
        config = _fetch(repo_id, config_name, local_only)
        if config is None:
            continue
        weights = _fetch(repo_id, weights_name, local_only)
        if weights is None:
            pickled = PICKLED_WEIGHTS[weights_name]
            pickled_path = _fetch(repo_id, pickled, local_only)
            if pickled_path is not None:
                raise ValueError(f"Hugging Face repo {repo_id!r} has {pickled} but no {weights_name}. "
                                 + pickle_message(pickled_path))
            raise FileNotFoundError(_missing(repo_id, [weights_name], why))
        if config.parent != weights.parent:  # same snapshot folder unless revisions differ
            raise FileNotFoundError(f"{config} and {weights} of {repo_id!r} are in different snapshots")
        return config.parent
    raise FileNotFoundError(_missing(repo_id, [f for files in order for f in files], why))


def _missing(repo_id: str, files: list[str], why: str | None = None) -> str:
    """One line: the name is no local path, and what the hub (or its cache) said.
    why: "offline" (HF_HUB_OFFLINE), "unreachable" (the probe got no answer) or None."""
    where = os.environ.get("HF_HUB_CACHE") or "the default hub cache (~/.cache/huggingface/hub)"
    if why == "offline" or (why is None and offline()):
        how = f"HF_HUB_OFFLINE is set and they are not in {where}"
    elif why == "unreachable":
        how = f"the hub could not be reached (one try, {PROBE_TIMEOUT_S:g} s timeout) and they are not in {where}"
    else:
        how = f"the repo has none of them (or is private / gated) and they are not in {where}"
    return (f"no such local file or folder {repo_id!r}, and as a Hugging Face repo {repo_id!r}: none of "
            f"{files} is available: {how}. Pass an existing local path, or download them with "
            f"`{cli_download(repo_id, files)}` where the hub is reachable")


def pickle_message(path: str | os.PathLike) -> str:
    out = Path(path).with_suffix(".safetensors").name
    return (f"{Path(path).name} is a pickled PyTorch file, which prolip_jax refuses to load (unpickling can "
            f"run code). Convert it once where PyTorch is installed:\n  python -c \"import torch; "
            f"from safetensors.torch import save_file; sd = torch.load('{path}', map_location='cpu', "
            f"weights_only=True); sd = sd.get('state_dict', sd); "
            f"save_file({{k: v.contiguous() for k, v in sd.items()}}, '{out}')\"\n"
            f"(name it open_clip_model.safetensors for an open_clip model, model.safetensors for a ProLIP "
            f"folder) and pass the .safetensors file or its folder.")
