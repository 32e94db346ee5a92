"""The run's folder: checked before anything is written (a file, or a folder of other files, is
one line), and the compile cache a relaunch loads its compiled programs from.
"""
from __future__ import annotations

import os

import jax

from prolip_jax.runtime import messages, paths
from prolip_jax.runtime.metrics import JSONL_NAME, TB_DIR


def check_workdir(workdir: str) -> None:
    """Before anything is written: --workdir must be a folder that is new, empty, or holds a run
    (names the trainer or the launch scripts write), never a file or a folder of other files."""
    if paths.isfile(workdir):
        raise ValueError(f"--workdir {workdir} is a file, not a folder: pass a new folder, or the workdir of "
                         "the run to resume")
    names = paths.listdir(workdir) if paths.isdir(workdir) else []
    if names and not any(n in RUN_NAMES or n.startswith(RUN_PREFIXES) for n in names):
        raise ValueError(f"--workdir {workdir} holds other files ({messages.few(sorted(names))}) and no run: "
                         "pass a new or empty folder (checkpoints, logs and tb/ go there)")


# What a run leaves in its workdir (and the SLURM script's logs): a folder with any of them is a run's.
RUN_NAMES = ("checkpoints", JSONL_NAME, TB_DIR, "parameters.txt", "best", "swa",
             "eval", "slurm", "profile", "noisy_pairs.json")
RUN_PREFIXES = ("train.", "warm_start.")


def use_compile_cache(path: str) -> str | None:
    """Turns on JAX's persistent compilation cache at `path` (config.compile_cache_dir) unless
    one is already set (JAX_COMPILATION_CACHE_DIR, or jax.config by the caller); returns the
    directory in use, None if off. Programs that compile in under a second are not stored."""
    current = jax.config.jax_compilation_cache_dir
    if current or not path:
        return current or None
    path = path if "://" in path else os.path.expanduser(path)
    jax.config.update("jax_compilation_cache_dir", path)
    return path
