"""The train state a run starts from, and what the loop and its hooks share.

A run starts fresh (random init), warm (config.init: pretrained weights where they fit) or from
the newest intact checkpoint of its workdir (a damaged one is moved aside), restored on this
run's mesh and optimiser whatever mesh, block layout or fine-tuning controls saved it.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from prolip_jax.core import checkpoint as ckpt_lib
from prolip_jax.core import flops as flops_lib
from prolip_jax.runtime import messages
from prolip_jax.core import optim
from prolip_jax.core import step as step_lib
from prolip_jax.core.models import ProLIP, ProLIPConfig, abstract_params
from prolip_jax.core.models import layout
from prolip_jax.trainer import build
from prolip_jax.trainer.config import ModelOptions, TrainConfig, recorded


def warm_started(state: step_lib.TrainState, apply: Any, shardings: step_lib.TrainState, workdir: Path,
                 is_chief: bool) -> step_lib.TrainState:
    """`state` with the params of `warm_start.prepare(config.init, ...)`: the pretrained ones where
    they fit, the fresh (reference) initialisation for what ProLIP adds (paper B.2, C.8). The
    optimiser state is untouched: AdamW's moments start at zero whatever the params."""
    fresh = multihost_utils.process_allgather(state.params, tiled=True)  # host numpy, every process
    params, report = apply(fresh)
    params = jax.tree.map(lambda x, sh: jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx]),
                          params, shardings.params)
    if is_chief:
        report.write(workdir)
        print(f"{report.summary()}; the table: {workdir / 'warm_start.txt'}", flush=True)
    return state.replace(params=params)


def check_same_model(saved: ProLIPConfig, current: ProLIPConfig, where: Path) -> None:
    """A workdir's checkpoint restores only into a model of its parameter shapes: otherwise one
    line naming the fields that differ, before orbax compares the trees."""
    def shapes(cfg: ProLIPConfig) -> dict[str, tuple[int, ...]]:
        flat = jax.tree_util.tree_flatten_with_path(abstract_params(cfg))[0]
        return {jax.tree_util.keystr(k): tuple(v.shape) for k, v in flat}

    if saved.to_dict() == current.to_dict() or shapes(saved) == shapes(current):  # the first: no trace
        return

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix: d}
        return {k: v for key, value in d.items() for k, v in flat(value, f"{prefix}{key}.").items()}

    old, new = flat(saved.to_dict()), flat(current.to_dict())
    sizes = [k for k in sorted({*old, *new}) if old.get(k) != new.get(k)  # the integer fields set the shapes
             and all(isinstance(v, int) and not isinstance(v, bool) for v in (old.get(k), new.get(k)))]
    fields = [f"{k.rstrip('.')} {old[k]} -> {new[k]}" for k in sizes] or ["other parameter shapes"]
    raise ValueError(f"{where} holds a run of another model ({messages.few(fields)}): pass another --workdir "
                     "for this model, or the config that run was started with")


def restore(mngr: ocp.CheckpointManager, step: int, model: ProLIP, tx: Any, shardings: step_lib.TrainState,
            mesh: Any, tc: TrainConfig, traced: step_lib.ParamTrace, data: Any) -> step_lib.TrainState:
    """The train state saved at `step`, on this run's mesh and optimiser. Fine-tuning controls
    (lock, groups, layer_decay) set the optimiser state's layout: a checkpoint saved under other
    ones is restored in its own layout, then its Adam moments move over by parameter path.
    `traced`: the run's model traced (step.trace_params)."""
    saved_model, meta, _ = ckpt_lib.load_config(mngr.directory, step)
    check_same_model(saved_model, model.config, Path(mngr.directory).parent)
    saved_cfg = meta.get("train_config") or {}
    saved_optim = recorded(optim.OptimConfig, saved_cfg.get("optim"))
    # A checkpoint of the other block layout (model.scan_layers) is restored in its own, then converted.
    scanned = recorded(ModelOptions, saved_cfg.get("model")).scan_layers
    if scanned != model.scan_layers:
        traced = step_lib.trace_params(model.clone(scan_layers=scanned))
    saved_tx, _ = optim.make_optimizer(tc.optim.with_layout_of(saved_optim), tc.run.total_steps, traced.shapes,
                                       step=step)
    saved_sh = step_lib.state_shardings(traced.boxed, saved_tx, mesh, tc.run.sharding_rules)
    state = ckpt_lib.restore_train_state(mngr, step, step_lib.abstract_train_state(traced.boxed, saved_tx, saved_sh),
                                         data)
    if scanned != model.scan_layers:
        params, opt_state = layout.to_layout((state.params, state.opt_state), model.scan_layers)
        params = jax.jit(lambda p: p, out_shardings=shardings.params)(params)
        state = state.replace(params=params, opt_state=opt_state)
        if jax.tree.structure(opt_state) == jax.tree.structure(shardings.opt_state):
            return state.replace(opt_state=jax.jit(lambda o: o, out_shardings=shardings.opt_state)(opt_state))
    if jax.tree.structure(saved_sh.opt_state) == jax.tree.structure(shardings.opt_state):
        return state
    return with_optimizer(state, tx, shardings)


def newest_intact_step(mngr: ocp.CheckpointManager, is_chief: bool) -> int | None:
    """The newest step of `mngr` that reads back as recorded (checkpoint.check_step: arrays
    readable, shapes and dtypes as recorded, values finite), or None when there is no step. A
    damaged step is renamed `<step>.corrupt` (never deleted) with one warning line, and the next
    older one is tried; when every step was damaged, a DamagedCheckpoint names them. Process 0
    checks and moves; the others take its answer."""
    moved: list[int] = []
    found = None
    if is_chief:
        while (step := mngr.latest_step()) is not None:
            problem = ckpt_lib.check_step(mngr.directory, step)
            if problem is None:
                found = step
                break
            name = ckpt_lib.move_aside(mngr.directory, step)
            print(f"warning: checkpoint step {step} is damaged ({problem}); moved it to {mngr.directory / name} "
                  f"and trying the step before", file=sys.stderr, flush=True)
            mngr.reload()
            moved.append(step)
    if jax.process_count() > 1:  # -1: no step at all, -2: every step was damaged
        code = found if found is not None else (-2 if moved else -1)
        code = int(multihost_utils.broadcast_one_to_all(np.int32(code)))
        mngr.reload()
        found, moved = (code, []) if code >= 0 else (None, moved or ([-1] if code == -2 else []))
    if found is None and moved:
        listed = [m for m in moved if m >= 0]
        raise ckpt_lib.DamagedCheckpoint(
            f"no intact checkpoint in {mngr.directory}: "
            + (f"step{'s' if len(listed) > 1 else ''} {', '.join(map(str, listed))} "
               f"{'were' if len(listed) > 1 else 'was'} damaged and moved aside (<step>.corrupt)" if listed else
               "process 0 found every step damaged and moved them aside (<step>.corrupt)")
            + "; put an intact copy back, or rerun to start from step 0")
    return found


def save_swa(directory: Path, state: step_lib.TrainState, step: int, mcfg: ProLIPConfig, tokenizer: Any,
             is_chief: bool) -> None:
    """The weight average of optim.swa_start_step / swa_every_steps (PCME++ App. B.3, its variant
    "PCME++ (SWA)"), written at the end of training as a params checkpoint beside the run's own,
    which scripts/evaluate.py and the converter read like any other. Nothing before the first
    snapshot."""
    swa = optim.swa_params(state.opt_state)
    if int(to_host(swa[1])) == 0:
        return
    ckpt_lib.save_params(directory, swa[0], mcfg, step=step, tokenizer=tokenizer,
                         metadata={"swa": {"snapshots": int(to_host(swa[1])), "step": step}})
    if is_chief:
        print(f"SWA: the average of {int(to_host(swa[1]))} snapshots saved in {directory}", flush=True)


def with_optimizer(state: step_lib.TrainState, tx: Any, shardings: step_lib.TrainState) -> step_lib.TrainState:
    """`state` moved onto optimiser `tx` (another layout of fine-tuning controls): Adam moments
    carried by parameter path, fresh ones for parameters new to the optimiser (optim.transfer_state)."""
    opt_state = jax.jit(lambda o, p: optim.transfer_state(o, tx, p),
                        out_shardings=shardings.opt_state)(state.opt_state, state.params)
    return state.replace(opt_state=opt_state)


def to_host(x: jax.Array) -> np.ndarray:
    """A replicated array's value on this host (multi-host arrays are not fully addressable)."""
    return np.asarray(x.addressable_data(0))


@dataclasses.dataclass
class Run:
    """What the loop and its hooks share while a run trains: the parts it was built from, the
    train state and the compiled step of the current optimiser phase, and where the data is."""

    parts: build.Parts
    workdir: Path
    is_chief: bool
    start: int  # the step this run started from (0, or the restored checkpoint's)
    state: step_lib.TrainState
    shardings: step_lib.TrainState
    tx: Any  # the optimiser of the current phase (optim.unlock_step rebuilds it)
    schedule: Any
    train_step: Any = None  # the jitted step of that phase (`compile_step`)
    step: int = 0
    # The data position after the last batch read (None: the live iterator's): where a resume
    # continues when the next read fails.
    data_state: ckpt_lib.StateSnapshot | None = None
    not_training_s: float = 0.0  # seconds spent in evaluators: not step time
    step_flops: float = 0.0  # model FLOPs of one step of the current phase (`compile_step`)
    last_metrics: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def tc(self) -> TrainConfig:
        return self.parts.tc

    def compile_step(self) -> None:
        """Jits the step of the optimiser phase at `self.step` (only trainable leaves are
        differentiated) and counts its model FLOPs."""
        p, run = self.parts, self.parts.tc.run
        trainable = optim.trainable_mask(p.traced.shapes, p.tc.optim, self.step)
        fn = step_lib.make_train_step(p.model, self.tx, self.schedule, p.step_config, p.mesh, run.batch_size,
                                      trainable=trainable, rules=run.sharding_rules)
        replicated = jax.sharding.NamedSharding(p.mesh, jax.sharding.PartitionSpec())
        self.train_step = jax.jit(fn, in_shardings=(self.shardings, None), out_shardings=(self.shardings, replicated),
                                  donate_argnums=0)
        self.step_flops = self._count_flops()

    def _count_flops(self) -> float:
        """Model FLOPs of one step; a tower locked at this step runs forward only (flops.py)."""
        p, run = self.parts, self.parts.tc.run
        shapes = p.traced.shapes
        locked = set(optim.locked_paths(shapes, p.tc.optim, self.step))
        towers = tuple(t for t in ("visual", "text")
                       if all(q in locked for q in optim.param_paths(shapes) if q.startswith(t + "/")))
        return flops_lib.train_step_flops(p.model_config, run.batch_size,
                                          image_keep_ratio=p.step_config.masking.image_keep_ratio,
                                          num_masked=step_lib.num_masked_rows(run.batch_size, p.step_config),
                                          locked_towers=towers)

    def change_optimizer(self) -> None:
        """The optimiser phase at `self.step` (a locked tower joins at optim.unlock_step): the
        state moved onto it, its Adam moments carried by parameter path, and its step compiled."""
        p = self.parts
        self.tx, self.schedule = build.make_optimizer(p.tc, p.traced.shapes, self.step)
        self.shardings = step_lib.state_shardings(p.traced.boxed, self.tx, p.mesh, p.tc.run.sharding_rules)
        self.state = with_optimizer(self.state, self.tx, self.shardings)
        self.compile_step()


def start_run(parts: build.Parts, workdir: Path, mngr: ocp.CheckpointManager, apply_warm_start: Any,
              stop_at_step: int | None) -> tuple[Run, bool]:
    """(the Run at its first step, whether its state is a random init): restored from the newest
    intact step of `mngr`, else fresh and, with `apply_warm_start` (warm_start.prepare), warm."""
    tc, is_chief = parts.tc, jax.process_index() == 0
    start = newest_intact_step(mngr, is_chief)  # a damaged newest step is moved aside, with a warning
    if stop_at_step is not None and stop_at_step <= (start or 0):
        raise ValueError(f"--stop_at_step={stop_at_step}: the run in {workdir} is already at step {start}")
    tx, schedule = build.make_optimizer(tc, parts.traced.shapes, start or 0)
    random_init = start is None and apply_warm_start is None
    if start is None:
        state, shardings = step_lib.create_train_state(parts.model, tx, parts.mesh, tc.run.sharding_rules,
                                                       tc.run.seed, parts.traced)
        start = 0
        if apply_warm_start is not None:
            state = warm_started(state, apply_warm_start, shardings, workdir, is_chief)
    else:
        shardings = step_lib.state_shardings(parts.traced.boxed, tx, parts.mesh, tc.run.sharding_rules)
        state = restore(mngr, start, parts.model, tx, shardings, parts.mesh, tc, parts.traced, parts.data.batches)
        if is_chief:
            print(f"resumed from {workdir / 'checkpoints' / str(start)} (step {start})", flush=True)
    run = Run(parts, workdir, is_chief, start, state, shardings, tx, schedule, step=start)
    run.compile_step()
    return run, random_init
