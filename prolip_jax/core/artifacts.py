"""Where the user commands find a model (`locate`) and where they may write (`check_out`).

`scripts/evaluate.py`, `scripts/convert_to_pytorch.py`, `scripts/convert_from_pytorch.py` and
`prolip_jax.load` read their model path through `locate`, so each takes the same things:

    WORKDIR              a training workdir: its `checkpoints/` (the trainer's manager root)
    WORKDIR/checkpoints  a checkpoint manager root (CKPT): the latest step, or --step
    CKPT/<step>          one step folder
    HF_DIR               an exported Hugging Face folder (config.json + model.safetensors)
    anything else        a weights file or folder of another family, or a hub repo id, for
                         `prolip_jax.core.pretrained.loader.load_pretrained`

The path rule (prolip_jax/core/pretrained/hub.py): what exists locally is a local path; what looks
like a path (absolute, `./`, `../`, `~`, more than one `/`, a URL, a file name such as
`x/model.npz`) is a path, and a missing one is one line, "no such file or folder: X", with no
network call. A URL (any fsspec protocol) is probed first (`paths.check_reachable`): a missing
backend, no network, refused credentials or nothing there is one line saying which. From a URL
an exported folder loads through the path layer, a checkpoint only from gs:// (orbax reads its
arrays through tensorstore, which knows no other fsspec protocol). Only a missing two-part `org/name` is tried as a Hugging Face repo id; its error
says both that no such local folder exists and what the hub (or its cache) answered.

`check_out(path, overwrite)`: an output folder must be absent or empty unless --overwrite.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Literal

from prolip_jax.core import checkpoint
from prolip_jax.core import convert
from prolip_jax.runtime import paths
from prolip_jax.core.pretrained import hub

Kind = Literal["checkpoint", "hf", "hub", "other"]
# URL protocols orbax restores a checkpoint from (through tensorstore's own drivers).
ORBAX_PROTOCOLS = ("gs", "gcs")


@dataclasses.dataclass(frozen=True)
class Located:
    """kind "checkpoint": `path` is the manager root and `step` the step (resolved);
    "hf": an exported Hugging Face folder; "hub": a repo id (`path` is the str);
    "other": an existing file or folder for load_pretrained."""

    kind: Kind
    path: Path | str  # a URL stays a str (an epath for a bucket checkpoint's root)
    step: int | None = None

    @property
    def step_dir(self) -> Path:
        """CKPT/<step> of a "checkpoint"."""
        return (paths.as_path(self.path) if paths.is_url(self.path) else Path(self.path)) / str(self.step)


def locate(path: str | os.PathLike, step: int | None = None, flag: str = "") -> Located:
    """The one rule above. Raises FileNotFoundError (one line) for a missing local path or a
    workdir / manager root without a complete checkpoint, ValueError for a step that the path
    cannot have (a step folder of another step; a Hugging Face folder has no steps) or a
    checkpoint at a URL orbax cannot read, paths.BucketError for a bucket that cannot be used.
    `flag`: the option the path came from, named in a bucket's error."""
    s = os.fspath(path).removeprefix("file://")
    if hub.is_url(s):
        return _locate_url(s, step, flag)
    local = Path(s).expanduser()
    if not local.exists():
        if hub.is_repo_id(s):
            return Located("hub", s)
        raise FileNotFoundError(f"no such file or folder: {s}")
    if local.is_dir():
        if _has_steps(local):
            return Located("checkpoint", *checkpoint.resolve(local, step))
        if convert.is_hf_dir(local):
            if step is not None:
                raise ValueError(f"{s} is a Hugging Face folder (one model, no steps): drop --step {step}")
            return Located("hf", local)
        ckpts = local / "checkpoints"
        if ckpts.is_dir():  # a training workdir: its error (no complete step yet) names the folder
            return Located("checkpoint", *checkpoint.resolve(ckpts, step))
    return Located("other", local, step)


def _locate_url(url: str, step: int | None, flag: str) -> Located:
    """`locate` of a URL: the same kinds as a local folder, found through the path layer."""
    paths.check_reachable(url, flag, flag, must_exist=True)
    if paths.isdir(url):
        ckpts = paths.join(url, "checkpoints")
        root = url if _has_steps(url) else ckpts if paths.isdir(ckpts) else None
        if root is not None:
            if paths.protocol(url) not in ORBAX_PROTOCOLS:
                raise ValueError(f"{url} is a prolip_jax checkpoint, which loads from gs:// or local disk only "
                                 f"(orbax reads {paths.protocol(url)}:// through no driver): copy it to local disk "
                                 "and pass that folder, or export it (scripts/convert_to_pytorch.py)")
            return Located("checkpoint", *checkpoint.resolve(root, step))
        if convert.is_hf_dir(url):
            if step is not None:
                raise ValueError(f"{url} is a Hugging Face folder (one model, no steps): drop --step {step}")
            return Located("hf", url)
    return Located("other", url, step)


def _has_steps(folder: Path | str) -> bool:
    """A manager root or a step folder: `<step>/params` below it, or `params` in a <step> folder."""
    name = os.fspath(folder).rstrip("/").rsplit("/", 1)[-1]
    if name.isdigit() and paths.isdir(paths.join(folder, checkpoint.PARAMS)):
        return True
    return any(n.isdigit() and paths.isdir(paths.join(folder, n, checkpoint.PARAMS)) for n in paths.listdir(folder))


def check_out(path: str | os.PathLike, overwrite: bool, flag: str = "--out") -> Path:
    """`path` as a Path if it may be written: absent, an empty folder, or (overwrite) a folder
    that will be replaced. Raises FileExistsError, one line naming --overwrite."""
    out = Path(path).expanduser()
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{flag} {out} is a file, not a folder: pass another {flag}")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{flag} {out} exists and is not empty: pass --overwrite to replace it, "
                              f"or another {flag}")
    return out
