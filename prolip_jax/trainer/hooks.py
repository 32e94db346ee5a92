"""What happens around each step, one hook each: the profiler, the unlock of a locked tower,
the non-finite guard, the metrics window, the evaluators, keep-best, the metrics writer, the
periodic checkpoints and the stop requests (--stop_at_step, SIGTERM, orbax's preemption notice).

The loop (loop.py) calls every hook in order: `begin` before the first step, `before_step` /
`after_step` around each step (`log` collects the values the step logs), `end` after the last
step, and `close` always. A hook that ends the run early raises `StopRun` once it has saved.
"""
from __future__ import annotations

import dataclasses
import difflib
import signal
import time
from typing import Any

import jax

from prolip_jax.core import checkpoint as ckpt_lib
from prolip_jax.core import flops as flops_lib
from prolip_jax.runtime import messages, profiling, retries
from prolip_jax.core import optim
from prolip_jax.runtime.metrics import MetricWriter
from prolip_jax.trainer.checkpoints import Checkpoints
from prolip_jax.trainer.console import console_lines, headline
from prolip_jax.trainer.state import Run, save_swa, to_host
from prolip_jax.runtime.window import Window


class StopRun(Exception):
    """Raised by a hook: the run stops before config.total_steps; the loop saves the state
    reached (unless saved already) and returns, and the same command continues the run."""


@dataclasses.dataclass
class Log:
    """What one step logs: every value (metrics.jsonl, TensorBoard) and the evaluators' headlines."""

    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    shown: list[str] = dataclasses.field(default_factory=list)


class Hook:
    """Does nothing at every point of the loop; a hook overrides the points it acts at."""

    def begin(self, run: Run, log: Log) -> None: ...
    def before_step(self, run: Run) -> None: ...
    def after_step(self, run: Run, metrics: dict[str, Any], log: Log) -> None: ...
    def end(self, run: Run) -> None: ...
    def close(self) -> None: ...


def is_log_step(run: Run, every: int) -> bool:
    return run.step % every == 0 or run.step == run.tc.run.total_steps


class Profile(Hook):
    """A jax.profiler trace of config.profile's steps (prolip_jax/runtime/profiling.py)."""

    def __init__(self, run: Run):
        self.profiler = profiling.Profiler(run.tc.profile, run.workdir, run.tc.run.total_steps, run.is_chief)
        if run.is_chief and self.profiler.skipped_note(run.start):
            print(self.profiler.skipped_note(run.start), flush=True)

    def before_step(self, run: Run) -> None:
        self.profiler.before_step(run.step)

    def after_step(self, run: Run, metrics: dict[str, Any], log: Log) -> None:
        self.profiler.after_step(run.step, (run.state, metrics))

    def close(self) -> None:
        self.profiler.stop()


class Unlock(Hook):
    """At optim.unlock_step the locked parameters join the optimiser (fresh Adam moments for them)."""

    def __init__(self, run: Run):
        self.at = optim.rebuild_steps(run.tc.optim)

    def after_step(self, run: Run, metrics: dict[str, Any], log: Log) -> None:
        if run.step in self.at:
            run.change_optimizer()
            if run.is_chief:
                print(f"step {run.step}: unlocked {list(run.tc.optim.lock)} (fresh Adam moments for them)", flush=True)


class NonFinite(Hook):
    """Stops after config.max_nonfinite_in_a_row skipped updates in a row (the step skips an
    update whose loss, gradient or result is not finite). Each step reads the flag of the step
    before, so the device keeps working on this one meanwhile."""

    def __init__(self, checkpoints: Checkpoints):
        self.checkpoints, self.previous, self.in_a_row = checkpoints, None, 0

    def after_step(self, run: Run, metrics: dict[str, Any], log: Log) -> None:
        if self.previous is not None:
            self.in_a_row = self.in_a_row + 1 if int(to_host(self.previous["nonfinite"])) else 0
        self.previous = metrics
        if self.in_a_row >= run.tc.run.max_nonfinite_in_a_row:
            self.checkpoints.finish()
            raise FloatingPointError(
                f"steps {run.step - self.in_a_row}-{run.step - 1} ({self.in_a_row} in a row) had a non-finite loss, "
                f"gradient or update and were skipped; stopping (check optim.lr, optim.eps and the data). "
                f"{self.checkpoints.last_good()}")


class Throughput(Hook):
    """Every step's metrics reduced over the log window on device (window.py); at each log
    step their means, the step time and throughput, TFLOP/s and MFU, and the data counters."""

    def __init__(self, run: Run):
        replicated = jax.sharding.NamedSharding(run.parts.mesh, jax.sharding.PartitionSpec())
        self.window = Window(replicated)
        self.device_kind = jax.devices()[0].device_kind

    def begin(self, run: Run, log: Log) -> None:
        self.t_log, self.step_log, self.excluded = time.time(), run.step, run.not_training_s

    def after_step(self, run: Run, metrics: dict[str, Any], log: Log) -> None:
        self.window.add(metrics)
        if not is_log_step(run, run.tc.run.log_steps):
            return
        now, batch = time.time(), run.tc.run.batch_size
        dt = (now - self.t_log - (run.not_training_s - self.excluded)) / max(run.step - self.step_log, 1)
        self.t_log, self.step_log, self.excluded = now, run.step, run.not_training_s
        log.values.update({k: float(to_host(v)) for k, v in self.window.result().items()})
        log.values.update({
            "step_time_s": dt, "samples_per_s": batch / dt,
            "samples_per_s_per_device": batch / dt / jax.device_count(),
            "tflops_per_device": flops_lib.tflops_per_device(run.step_flops, dt, jax.device_count()),
            "skipped_updates": int(to_host(run.state.skipped)),
            **{f"data/{k}": v for k, v in run.parts.data.batches.stats.items()},
            **{f"io/retries/{k}": v for k, v in retries.counts().items()},   # bucket calls retried
        })
        mfu = flops_lib.mfu(run.step_flops, dt, jax.device_count(), self.device_kind, run.parts.model.dtype)
        if mfu is not None:
            log.values["mfu"] = mfu


class Evaluate(Hook):
    """The in-training evaluators (config.evals), each every its log_steps and at the last step;
    with config.eval_at_start, all of them on the starting parameters of a fresh run, at step 0.
    Their time is not step time."""

    def __init__(self, evaluators: list[tuple[dict, Any]], checkpoints: Checkpoints):
        self.evaluators, self.checkpoints = evaluators, checkpoints
        self.evaluated: set[str] = set()  # the evaluators that have run at least once

    def _run(self, run: Run, settings: dict, evaluator: Any, log: Log) -> None:
        t = time.time()
        with self.checkpoints.outside_the_model(f"evaluator {settings['name']!r}"):
            values = {settings["prefix"] + k: v for k, v in evaluator.run(run.state.params)}
        log.values.update(values)
        log.shown += headline(evaluator, values)
        self.evaluated.add(settings["name"])
        run.not_training_s += time.time() - t

    def begin(self, run: Run, log: Log) -> None:
        if run.tc.run.eval_at_start and run.start == 0:
            for settings, evaluator in self.evaluators:
                self._run(run, settings, evaluator, log)
            self.evaluated.clear()  # keep-best waits for the evaluators of the training steps

    def after_step(self, run: Run, metrics: dict[str, Any], log: Log) -> None:
        for settings, evaluator in self.evaluators:
            if is_log_step(run, settings["log_steps"]):
                self._run(run, settings, evaluator, log)


class KeepBest(Hook):
    """The best checkpoint by config.keep_best.metric (checkpoint.BestKeeper); a metric that is
    none of those logged once every evaluator has run is one line with the nearest names."""

    def __init__(self, run: Run, evaluate: Evaluate):
        tc = run.tc
        self.best = ckpt_lib.BestKeeper(run.workdir / "best", tc.keep_best, run.parts.model_config,
                                        tokenizer=run.parts.data.tokenizer_file)
        self.evaluate = evaluate
        self.logged: set[str] = set()  # every metric logged so far

    def begin(self, run: Run, log: Log) -> None:
        self.logged.update(log.values)

    def after_step(self, run: Run, metrics: dict[str, Any], log: Log) -> None:
        self.logged.update(log.values)
        metric, values = self.best.metric, log.values
        if metric in values:
            if self.best.offer(run.step, float(values[metric]), run.state.params) and run.is_chief:
                print(f"step {run.step}: best {metric} so far ({values[metric]:.4g}), kept in "
                      f"{run.workdir / 'best'}", flush=True)
        elif len(self.evaluate.evaluated) == len(self.evaluate.evaluators) and values and metric not in self.logged:
            near = difflib.get_close_matches(metric, self.logged, n=3, cutoff=0.6)
            hint = (f"did you mean {messages.few(near)}?" if near else
                    f"the {len(self.logged)} logged: {messages.few(sorted(self.logged), 5)}")
            raise ValueError(f"config.keep_best.metric={metric!r} is not a logged metric (set "
                             f"--config.keep_best.metric); {hint}")

    def close(self) -> None:
        self.best.close()


class Write(Hook):
    """metrics.jsonl, TensorBoard and the console line (metrics.py) of each step that logs."""

    def __init__(self, run: Run, checkpoints: Checkpoints):
        self.writer = MetricWriter(str(run.workdir), run.tc.run.total_steps, is_chief=run.is_chief,
                                   resume_step=run.start + 1)
        self.checkpoints = checkpoints

    def _write(self, step: int, log: Log) -> None:
        with self.checkpoints.outside_the_model("the metrics writer"):
            self.writer.write(step, log.values, console=console_lines(log.values, log.shown))

    def begin(self, run: Run, log: Log) -> None:
        if log.values:
            self._write(0, log)

    def after_step(self, run: Run, metrics: dict[str, Any], log: Log) -> None:
        if log.values:
            self._write(run.step, log)
            run.last_metrics = log.values

    def close(self) -> None:
        self.writer.close()


class Save(Hook):
    """A checkpoint every config.checkpoint_steps, and of the last step; then the weight average
    of optim.swa_every_steps (PCME++ App. B.3) beside them."""

    def __init__(self, checkpoints: Checkpoints):
        self.checkpoints = checkpoints

    def after_step(self, run: Run, metrics: dict[str, Any], log: Log) -> None:
        if run.step % run.tc.run.checkpoint_steps == 0 and run.step < run.tc.run.total_steps:
            self.checkpoints.save(run.step)

    def end(self, run: Run) -> None:
        self.checkpoints.save_unless_saved(run.step)
        if run.tc.optim.swa_every_steps:
            save_swa(run.workdir / "swa", run.state, run.step, run.parts.model_config,
                     run.parts.data.tokenizer_file, run.is_chief)


def preempted_line(step: int) -> str:
    if not step:
        return "preempted before the first step: nothing to save; rerun the same command"
    return f"preempted: saved step {step}; rerun the same command to resume"


class Stop(Hook):
    """Stops at --stop_at_step, on SIGTERM (a preemption; also while waiting for data) and on
    orbax's preemption notice: saved, one line, the same command resumes."""

    def __init__(self, checkpoints: Checkpoints, stop_at_step: int | None):
        self.checkpoints, self.stop_at_step = checkpoints, stop_at_step
        self.preempted = False
        self.previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, *_: Any) -> None:
        self.preempted = True

    def requested(self) -> bool:
        return self.preempted

    def after_step(self, run: Run, metrics: dict[str, Any], log: Log) -> None:
        asked = run.step == self.stop_at_step
        if not (asked or self.preempted or self.checkpoints.mngr.reached_preemption(run.step)):
            return
        self.checkpoints.save_unless_saved(run.step)
        if run.is_chief and asked:
            print(f"stopped at step {run.step} (--stop_at_step): saved; the same command without it "
                  f"continues to step {run.tc.run.total_steps}", flush=True)
        elif run.is_chief:
            print(preempted_line(run.step), flush=True)
        raise StopRun

    def while_waiting(self, run: Run) -> None:
        """SIGTERM while waiting for data: saved at the data position before that read."""
        if run.step > 0:
            self.checkpoints.save_unless_saved(run.step, data_state=run.data_state)
        else:
            self.checkpoints.finish()
        if run.is_chief:
            print(preempted_line(run.step), flush=True)
        raise StopRun

    def close(self) -> None:
        signal.signal(signal.SIGTERM, self.previous_handler)
