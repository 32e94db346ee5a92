"""A `jax.profiler` trace of a few training steps, for TensorBoard's profile plugin or XProf.

    --config.profile.start_step=10 --config.profile.num_steps=5

traces steps 11..15 (the five steps after step 10; step numbers as in metrics.jsonl) on the
first host into `<workdir>/profile/plugins/profile/<run>/<host>.xplane.pb`; view it with

    tensorboard --logdir <workdir>/profile     # with tensorboard-plugin-profile installed
    xprof --logdir=<workdir>/profile --port=8791

The default start (after step 10) keeps compilation and the first steps out of the trace.
clu.profiler is a thin wrapper of the same two jax calls (start_trace / stop_trace), so they
are called directly. The trace is stopped however training ends (`stop()` in a finally).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax

from prolip_jax.runtime import paths

PROFILE_DIR = "profile"


@dataclasses.dataclass(frozen=True)
class ProfileConfig:
    """config.profile: trace `num_steps` steps after step `start_step` (0 steps: no trace)."""
    start_step: int = 10
    num_steps: int = 0

    def validate(self) -> None:
        """ValueError for a negative or non-integer setting."""
        for name in ("start_step", "num_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"config.profile.{name} must be a non-negative integer, got {value!r}")

    def check(self, total_steps: int) -> None:
        """validate(), and a trace that starts within the run (checked before anything compiles)."""
        self.validate()
        if self.num_steps and self.start_step >= total_steps:
            raise ValueError(f"config.profile.start_step={self.start_step} leaves no step to trace: the run "
                             f"has total_steps={total_steps} (steps after start_step are traced)")

    @property
    def enabled(self) -> bool:
        return self.num_steps > 0


class Profiler:
    """Starts the trace before step `start_step + 1` and stops it after `start_step + num_steps`
    (or the last step) has finished on device. Only process 0 traces."""

    def __init__(self, config: ProfileConfig, workdir: str | Path, total_steps: int, is_chief: bool):
        self.config = config
        self.logdir = paths.join(workdir, PROFILE_DIR)  # a bucket URL stays one (prolip_jax/runtime/paths.py)
        self.stop_after = min(config.start_step + config.num_steps, total_steps)
        self.active = False
        self._on = is_chief and config.enabled

    def before_step(self, step: int) -> None:
        """`step`: the steps done so far (the next one is step + 1)."""
        if self._on and step == self.config.start_step:
            paths.makedirs(self.logdir)
            jax.profiler.start_trace(self.logdir)
            self.active = True

    def after_step(self, step: int, outputs: Any) -> None:
        """`step`: the step just dispatched; `outputs` its results, waited for before the trace
        stops so that the device work of the last traced step is in it."""
        if self.active and step >= self.stop_after:
            jax.block_until_ready(outputs)
            self.stop()
            print(f"profile of steps {self.config.start_step + 1}-{step} written to {self.logdir}; view it with "
                  f"`tensorboard --logdir {self.logdir}` (tensorboard-plugin-profile) or "
                  f"`xprof --logdir={self.logdir}`", flush=True)

    def stop(self) -> None:
        """Stops a running trace (idempotent; training may end early)."""
        if self.active:
            self.active = False
            jax.profiler.stop_trace()

    def skipped_note(self, start: int) -> str | None:
        """The reason a resumed run (at step `start`) takes no trace, or None."""
        if self._on and start > self.config.start_step:
            return (f"config.profile: the run resumes at step {start}, after profile.start_step="
                    f"{self.config.start_step}; no trace is taken")
        return None
