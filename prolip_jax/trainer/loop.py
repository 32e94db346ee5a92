"""`train(config, workdir)`: a run from its config to its last checkpoint.

The parts are built and checked first (build.py), then the workdir comes into being, the state
starts fresh, warm or from the newest intact checkpoint (state.py), and the loop below runs the
steps; everything else a step does is a hook (hooks.py). Library logging (orbax, grain, absl)
goes to WORKDIR/train.log, not the console (prolip_jax/runtime/library_logs.py).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import jax

from input_pipeline.captions import write_noisy_pairs
from prolip_jax.core import checkpoint as ckpt_lib
from prolip_jax.runtime import library_logs, overview, paths
from prolip_jax.core import sharding
from prolip_jax.trainer.data import BatchFetcher
from prolip_jax.core.pretrained import warm_start
from prolip_jax.trainer import build, checkpoints, hooks
from prolip_jax.trainer import state as state_lib
from prolip_jax.trainer.config import parse_config, with_defaults
from prolip_jax.trainer.console import evaluate_command
from prolip_jax.trainer.workdir import check_workdir, use_compile_cache


def train(config, workdir: str, *, stop_at_step: int | None = None, extra_hooks: Sequence[hooks.Hook] = ()
          ) -> dict[str, Any]:
    """Trains (or resumes) in `workdir`. Returns the last logged metrics.

    stop_at_step (`--stop_at_step`): save and stop when that step is reached, as a preempted
    run does; the same command without it continues to config.total_steps. `extra_hooks`
    (hooks.Hook) act after the built-in ones that log, before the step's checkpoint.
    """
    paths.check_reachable(workdir, "--workdir", "--workdir")  # a bucket: one line on what is wrong with it
    check_workdir(workdir)
    with library_logs.to_file(paths.as_path(workdir) / library_logs.log_name(jax.process_index())):
        return _train(config, workdir, stop_at_step, extra_hooks)


def _train(config, workdir: str, stop_at_step: int | None, extra_hooks: Sequence[hooks.Hook]) -> dict[str, Any]:
    workdir = paths.as_path(workdir)  # local or a bucket (gs://): prolip_jax/runtime/paths.py
    tc = parse_config(with_defaults(config.copy_and_resolve_references()))  # the only parse
    if stop_at_step is not None and not 0 < stop_at_step <= tc.run.total_steps:
        raise ValueError(f"--stop_at_step={stop_at_step} must be in [1, config.total_steps={tc.run.total_steps}]")
    is_chief = jax.process_index() == 0
    cache = use_compile_cache(tc.run.compile_cache_dir)
    if is_chief and cache:
        print(f"compile cache: {cache}", flush=True)
    parts = build.build(tc)
    if is_chief:
        print(tc.levers_line(), flush=True)
    # Pretrained weights (config.init) are imported and checked now, applied after init; a run
    # that resumes never re-imports: its checkpoint already holds the warm-started state.
    resuming = ckpt_lib.is_checkpoint(paths.absolute(workdir / "checkpoints"))
    apply_warm_start = None if resuming else warm_start.prepare(tc.init, parts.model_config, parts.traced.shapes)

    # Only now, with the config and the data checked, does the workdir come into being.
    workdir.mkdir(parents=True, exist_ok=True)
    captions = parts.data.caption_index  # caption sources (input_pipeline/captions.py)
    if is_chief and captions is not None and captions.noise_ratio > 0:
        write_noisy_pairs(captions, workdir / "noisy_pairs.json")  # which pairs data.noise_ratio corrupted
    mngr = checkpoints.manager(workdir, tc.run.keep_checkpoints)
    run, random_init = state_lib.start_run(parts, workdir, mngr, apply_warm_start, stop_at_step)
    if is_chief:  # clu.parameter_overview's table to WORKDIR/parameters.txt, one line here (overview.py)
        print(overview.write_parameter_table(workdir, run.state.params), flush=True)
    return run_loop(run, checkpoints.Checkpoints(run, mngr, known_finite=random_init), stop_at_step, extra_hooks)


def make_hooks(run: state_lib.Run, saves: checkpoints.Checkpoints, stop_at_step: int | None,
               extra_hooks: Sequence[hooks.Hook] = ()) -> list[hooks.Hook]:
    """The hooks of a run, in the order they act after each step; the stop requests last."""
    evaluate = hooks.Evaluate(run.parts.evaluators, saves)
    keep_best = [hooks.KeepBest(run, evaluate)] if run.tc.keep_best.metric else []
    return [hooks.Profile(run), hooks.Unlock(run), hooks.NonFinite(saves), hooks.Throughput(run), evaluate,
            *keep_best, hooks.Write(run, saves), *extra_hooks, hooks.Save(saves), hooks.Stop(saves, stop_at_step)]


def run_loop(run: state_lib.Run, saves: checkpoints.Checkpoints, stop_at_step: int | None = None,
             extra_hooks: Sequence[hooks.Hook] = ()) -> dict[str, Any]:
    """Steps from run.step to config.total_steps; returns the last logged metrics."""
    fetch = BatchFetcher(run.parts.data.batches, run.tc.run.data_timeout_s)  # signals are answered while a read waits
    built: list[hooks.Hook] = []
    try:
        built = make_hooks(run, saves, stop_at_step, extra_hooks)
        stop = built[-1]
        log = hooks.Log()
        for hook in built:
            hook.begin(run, log)
        while run.step < run.tc.run.total_steps:
            with saves.outside_the_model("the data pipeline"):
                batch = fetch.next(stop=stop.requested)
            if batch is None:
                stop.while_waiting(run)
            one_step(run, batch, built)
        for hook in built:
            hook.end(run)
        if run.is_chief:
            print(f"done: the checkpoint of step {run.step} is {saves.directory / str(run.step)}; evaluate it with\n  "
                  + evaluate_command(run.workdir, run.tc.data, run.tc.run.evals), flush=True)
    except hooks.StopRun:  # a stop request: the state reached is kept (the Stop hook has saved it already)
        if run.step > 0:
            saves.save_unless_saved(run.step)
    finally:
        for hook in reversed(built):
            hook.close()
        saves.close()
        fetch.close()
    return run.last_metrics


def one_step(run: state_lib.Run, batch: Any, built: list[hooks.Hook]) -> None:
    """One training step on `batch` (this host's rows), the hooks around it."""
    run.data_state = ckpt_lib.StateSnapshot.of(run.parts.data.batches)  # where a resume continues if the next read fails
    batch = sharding.global_batch(batch, run.parts.mesh)
    for hook in built:
        hook.before_step(run)
    first = run.step == run.start
    if first and run.is_chief:
        print("compiling the train step...", flush=True)
    t_step = time.time()
    run.state, metrics = run.train_step(run.state, batch)
    if first and run.is_chief:  # the call returns once compiled; the step runs on
        print(f"compiled in {time.time() - t_step:.1f} s", flush=True)
    run.step += 1
    log = hooks.Log()
    for hook in built:
        hook.after_step(run, metrics, log)
