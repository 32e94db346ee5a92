"""XLA flags the project sets for the platform it will run on, before jax's backend starts.

`apply()` runs at the top of the trainer's command line (prolip_jax/train.py) and of the step
benchmark, before anything asks jax for a device: XLA reads XLA_FLAGS once, when its first
client starts. The project's flags come first and the user's XLA_FLAGS after them, so the
user's value wins for a flag both name (XLA keeps the last). This module imports no jax.
"""
from __future__ import annotations

import importlib.util
import os
import shlex
from typing import Mapping, MutableMapping

# Speed levers measured on the GPU, with the config's (docs/performance.md, "Levers and defaults").
GPU_FLAGS = {
    # XLA otherwise merges the full and the masked forward's dots that share a weight by
    # concatenating their activations: a copy of each [B*T, 3072] MLP input per layer.
    "xla_gpu_dot_merger_threshold_mb": "0",
    # Every GEMM to cuBLAS instead of autotuning Triton GEMMs beside it: a shorter compile and
    # fewer, faster GEMMs.
    "xla_gpu_enable_triton_gemm": "false",
}
PLATFORM_FLAGS = {"gpu": GPU_FLAGS}
# Where the project's flags are off for a row of a benchmark (XLA's own defaults then rule).
OFF_ENV = "PROLIP_JAX_NO_XLA_FLAGS"
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin")


def values(flags: str) -> dict[str, str]:
    """Each flag's value in an XLA_FLAGS string, the last one where a flag repeats (as XLA reads
    it): `--a=1 --b --a=2` -> {'a': '2', 'b': 'true'}."""
    out = {}
    for f in shlex.split(flags):
        name, sep, value = f.lstrip("-").partition("=")
        out[name] = value if sep else "true"
    return out


def merged(user: str, project: Mapping[str, str]) -> str:
    """XLA_FLAGS with the project's flags the user did not name, then the user's own string."""
    ours = [f"--{k}={v}" for k, v in project.items() if k not in values(user)]
    return " ".join([*ours, *([user.strip()] if user.strip() else [])])


def expected_platform(environ: Mapping[str, str] = os.environ) -> str:
    """The platform jax will pick, answered without starting it: "gpu" when JAX_PLATFORMS allows
    CUDA (or is unset) and a jax CUDA plugin is installed, else "other"."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
    if platforms and not {"cuda", "gpu"} & set(platforms):
        return "other"
    return "gpu" if any(importlib.util.find_spec(m) for m in CUDA_PLUGINS) else "other"


def apply(environ: MutableMapping[str, str] = os.environ, platform: str | None = None) -> None:
    """Sets XLA_FLAGS in `environ` for `platform` (default: expected_platform()), the user's
    flags after the project's. Nothing when OFF_ENV=1."""
    if environ.get(OFF_ENV) == "1":
        return
    project = PLATFORM_FLAGS.get(platform or expected_platform(environ), {})
    if project:
        environ["XLA_FLAGS"] = merged(environ.get("XLA_FLAGS", ""), project)


def active(platform: str, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The platform's project flags that XLA_FLAGS holds at the project's value: the XLA levers in
    effect (set by `apply` here or in a parent process, or by the user)."""
    now = values(environ.get("XLA_FLAGS", ""))
    return {k: v for k, v in PLATFORM_FLAGS.get(platform, {}).items() if now.get(k) == v}


def describe(flags: Mapping[str, str]) -> str:
    return " ".join(f"--{k}={v}" for k, v in flags.items())
