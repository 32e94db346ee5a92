"""The trainer as parts: a hook is the one place a run's extra behaviour goes, and the parts a
benchmark builds are the trainer's own (prolip_jax/trainer/)."""
from __future__ import annotations

import numpy as np

from prolip_jax import train
from prolip_jax.trainer import build, hooks
from prolip_jax.trainer.config import parse_config, record, with_defaults

from test_train import tiny_config


class Recorder(hooks.Hook):
    """Every point of the loop it is called at, and the loss of each step that logs."""

    def __init__(self):
        self.calls: list[str] = []
        self.losses: dict[int, float] = {}

    def begin(self, run, log):
        self.calls.append(f"begin@{run.step}")

    def after_step(self, run, metrics, log):
        self.calls.append(f"after@{run.step}")
        if "loss" in log.values:
            self.losses[run.step] = log.values["loss"]

    def end(self, run):
        self.calls.append(f"end@{run.step}")

    def close(self):
        self.calls.append("close")


class StopAfter(hooks.Hook):
    def __init__(self, step: int):
        self.step = step

    def after_step(self, run, metrics, log):
        if run.step == self.step:
            raise hooks.StopRun


def config(tmp_path):
    c = tiny_config(tmp_path)
    c.data.source = "random"
    c.data.image_size = 16
    c.evals = {}
    c.total_steps = 3
    return c


def test_a_hook_sees_every_step_and_the_logged_values(tmp_path):
    recorder = Recorder()
    metrics = train.train(config(tmp_path), str(tmp_path / "w"), extra_hooks=[recorder])
    assert recorder.calls == ["begin@0", "after@1", "after@2", "after@3", "end@3", "close"]
    assert sorted(recorder.losses) == [1, 2, 3] and recorder.losses[3] == metrics["loss"]
    assert np.all(np.isfinite(list(recorder.losses.values())))


def test_a_hook_that_stops_the_run_leaves_it_resumable(tmp_path):
    """StopRun from a user's hook: the state reached is saved, no error; the same command
    continues from it."""
    recorder = Recorder()
    train.train(config(tmp_path), str(tmp_path / "w"), extra_hooks=[recorder, StopAfter(2)])
    assert recorder.calls == ["begin@0", "after@1", "after@2", "close"]
    assert sorted(p.name for p in (tmp_path / "w" / "checkpoints").iterdir()) == ["2"]
    again = Recorder()
    train.train(config(tmp_path), str(tmp_path / "w"), extra_hooks=[again])
    assert again.calls == ["begin@2", "after@3", "end@3", "close"]


def test_benchmarks_build_the_trainers_parts(tmp_path):
    """`build.build` gives what the trainer runs: the same model config and step settings."""
    tc = parse_config(with_defaults(config(tmp_path)))
    parts = build.build(tc)
    try:
        assert parts.model_config == build.model_config(tc)
        assert parts.step_config == build.step_config(tc)
        assert parts.traced.shapes and parts.evaluators == []
        assert record(tc)["total_steps"] == 3 and record(tc)["loss"]["objective"] == "prolip"
    finally:
        parts.data.batches.close()
