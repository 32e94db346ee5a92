r"""The ProLIP trainer: one file, read top to bottom.

    python -m prolip_jax.train --config configs/tiny.py --workdir /tmp/prolip_tiny [--config.x=y ...]

Runs on CPU (1..N devices), GPU and TPU. Multi-host: `jax.distributed.initialize()` is called
on TPU pods and under SLURM (auto-detected), or with explicit `--coordinator_address`,
`--num_processes`, `--process_id`. A workdir holding a checkpoint resumes by itself (params,
optimiser, step and the data iterator's position); SIGTERM saves a checkpoint and exits cleanly.
"""
from __future__ import annotations

# The imports below wait until `--help` is answered and, in a multi-process launch, until this
# process has become the supervisor of the one that trains: jax and the project take seconds to load.
import sys

from prolip_jax import supervise, train_flags

if __name__ == "__main__":
    train_flags.exit_if_help(sys.argv, __doc__)
    train_flags.exit_if_supervisor(sys.argv)

import contextlib
import dataclasses
import difflib
import json
import logging
import os
import re
import signal
import time
from pathlib import Path
from typing import Any, Iterator, Literal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import evaluators
from input_pipeline.captions import write_noisy_pairs
from input_pipeline import paths as data_paths
from input_pipeline import sources as data_sources
from input_pipeline.config import AUTO as DATA_AUTO
from input_pipeline.config import SOURCES as DATA_SOURCES
from input_pipeline.config import DataConfig
from input_pipeline.tar_source import NoRecordsError
from prolip_jax import checkpoint as ckpt_lib
from prolip_jax import flops as flops_lib
from prolip_jax import config_args, library_logs, messages, objectives, optim, overview, profiling, schema, sharding
from prolip_jax import paths, peers
from prolip_jax import step as step_lib
from prolip_jax.data import BatchFetcher, DataStalled, build_train_data
from prolip_jax.metrics import JSONL_NAME, TB_DIR, MetricWriter
from prolip_jax.models import ProLIP, ProLIPConfig, abstract_params, get_config
from prolip_jax.models import layout
from prolip_jax.models.config import PAPER_INIT_LOGIT_SCALE
from prolip_jax.models.transformer import REMAT_POLICIES, BlockLevers
from prolip_jax.pretrained import openclip, warm_start
from prolip_jax.targets import TargetsConfig
from prolip_jax.window import Window


# =====================================================================================
# Configuration: everything is checked before anything compiles.
# =====================================================================================
@dataclasses.dataclass(frozen=True)
class RunConfig:
    """The top-level fields of a trainer config (configs/*.py); the sections are in SECTIONS."""

    total_steps: int
    batch_size: int  # global
    seed: int = 0
    microbatches: int = 1  # gradient caching over k microbatches (step.py)
    sharding_rules: Any = "replicated"  # a name in sharding.RULES or ((logical, mesh axis), ...)
    log_steps: int = 50
    checkpoint_steps: int = 1000
    keep_checkpoints: int = 3
    max_nonfinite_in_a_row: int = 10  # skipped updates in a row before the run stops
    # Seconds the loop waits for one batch before it saves and stops in one line. The first
    # batch fills every data worker's shuffle window: raise this for large windows in a bucket.
    data_timeout_s: float = 600.0
    evals: Any = dataclasses.field(default_factory=dict)  # name -> evaluator config (build_evaluators)
    # A fresh run (not a resume) first runs every evaluator on its starting parameters and logs
    # them at step 0: what a warm start scores before any update (the baseline of a fine-tune).
    eval_at_start: bool = False
    # JAX's persistent compilation cache: a relaunch (a resume, a requeued job, the next run of the
    # same config) loads its compiled programs instead of compiling them again. "" turns it off;
    # JAX_COMPILATION_CACHE_DIR, when set, wins. A bucket path (gs://...) serves a whole pod.
    compile_cache_dir: str = "~/.cache/prolip_jax/jax_compile_cache"

    def validate(self) -> None:
        for name in ("total_steps", "batch_size", "microbatches", "log_steps", "checkpoint_steps",
                     "keep_checkpoints", "max_nonfinite_in_a_row", "data_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"config.{name} must be positive, got {getattr(self, name)}")


@dataclasses.dataclass(frozen=True)
class ModelOptions:
    """`config.model`: which towers, at which precision. `vision` / `text` override fields of
    the variant's VisionConfig / TextConfig (prolip_jax/models/config.py), e.g. the heads and
    pooling of the other methods: `model.text = dict(pool="gpo")`."""

    # A name in prolip_jax.models.VARIANTS, or "open_clip:NAME" for the towers of an open_clip
    # architecture ('open_clip:ViT-B-32-quickgelu', prolip_jax/pretrained/openclip.py ARCHS): the
    # shape a CLIP warm start needs, with `vision` / `text` adding the method's heads.
    variant: str = "tiny"
    config_json: str = ""  # or a reference config.json (any size), used instead of `variant`
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # compute; params stay float32
    remat: str = dataclasses.field(default="none", metadata={"choices": tuple(REMAT_POLICIES)})
    attention_impl: Literal["auto", "xla", "cudnn"] = "auto"
    # False: on CPU the scanned step is 6-17% slower and B/16's compiled temporaries 1.7x (docs/performance.md)
    scan_layers: bool = False  # each tower's blocks as one nn.scan (models/layout.py): 4x faster B/16 compile
    # GPU speed levers of the blocks, the same arithmetic, one line per field of
    # models/transformer.py BlockLevers (build_model passes them by name; tests/test_speed_levers.py;
    # docs/performance.md): the blocks on [B*T, D] token matrices, and the LayerNorms' backward
    # reading the forward's row statistics.
    flat_tokens: bool = False
    ln_saved_stats: bool = False
    init_logit_scale: float = PAPER_INIT_LOGIT_SCALE  # log a
    init_logit_bias: float | None = None  # b; None: the variant's (ProLIP: -10)
    # The joint embedding's size (mu, sigma^2); 0: the variant's. PCME++ on COCO: 1024 on CLIP's
    # 512-d trunks (seed 003 App. B.2), with config.init.fresh for the new projections.
    embed_dim: int = 0
    vision: Any = dataclasses.field(default_factory=dict)
    text: Any = dataclasses.field(default_factory=dict)


# The config's sections and the dataclass declaring each one's fields, beside the code that uses
# them. `loss` is the selected objective's Config (prolip_jax/objectives/); `data` is
# input_pipeline.DataConfig (validated by the pipeline when it is built, before compiling).
SECTIONS: dict[str, type] = {
    "model": ModelOptions,
    "masking": step_lib.MaskingConfig,  # ProLIP's masked forward
    "step": step_lib.StepOptions,  # how the step computes: speed levers, same result (prolip_jax/step.py)
    "targets": TargetsConfig,  # positives and MSDA (prolip_jax/targets.py)
    "optim": optim.OptimConfig,
    "mesh": sharding.MeshConfig,
    "init": warm_start.InitConfig,  # a pretrained model to start from (prolip_jax/pretrained/warm_start.py)
    "keep_best": ckpt_lib.KeepBestConfig,  # the best checkpoint by a metric (prolip_jax/checkpoint.py)
    "profile": profiling.ProfileConfig,  # a jax.profiler trace of a few steps (prolip_jax/profiling.py)
}


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A trainer config, typed: `parse_config` builds it once at the top of a run and each part
    of the code receives the section it needs (nothing downstream re-parses the ConfigDict)."""

    run: RunConfig
    model: ModelOptions
    masking: step_lib.MaskingConfig
    step: step_lib.StepOptions
    targets: TargetsConfig
    optim: optim.OptimConfig
    mesh: sharding.MeshConfig
    init: warm_start.InitConfig
    keep_best: ckpt_lib.KeepBestConfig
    profile: profiling.ProfileConfig
    objective: str  # a name in prolip_jax.objectives.REGISTRY
    loss: Any  # that objective's Config
    # `config.data` as a dict, its keys and source checked: the pipeline builds its DataConfig from
    # it with what only the model knows (prolip_jax/data.py), and "random" needs no pipeline.
    data: dict[str, Any]

    @property
    def normalization(self) -> str:
        return self.data.get("normalization", "openai")


def objective_name(config) -> str:
    return config.loss.get("objective", "prolip") if "loss" in config else "prolip"


def parse_config(config) -> TrainConfig:
    """Every field of `config` checked against its declaration: unknown fields, wrong types and
    values outside a field's choices are one-line ValueErrors / TypeErrors."""
    schema.check_keys(config.keys(), {*schema.fields(RunConfig), *SECTIONS, "loss", "data"}, "config")
    run = schema.parse(RunConfig, {k: config[k] for k in schema.fields(RunConfig) if k in config}, "config")
    sections = {name: schema.parse(cls, config.get(name), f"config.{name}") for name, cls in SECTIONS.items()}
    name = objective_name(config)
    module = objectives.get(name)
    loss = schema.parse(module.Config, {k: v for k, v in (config.get("loss") or {}).items() if k != "objective"},
                        f"config.loss (objective {name!r})")
    data = config.data.to_dict() if "data" in config else {}
    if data:
        schema.check_keys(data.keys(), schema.fields(DataConfig), "config.data")
        if data.get("source") == DATA_AUTO and data.get("path"):  # every part below sees the kind named
            data["source"] = data_paths.source_of_paths(data["path"])
        if data.get("source") not in ("random", DATA_AUTO, *DATA_SOURCES):
            raise ValueError(f"config.data.source={data.get('source')!r} is not one of "
                             f"{('random', DATA_AUTO, *DATA_SOURCES)}")
    return TrainConfig(run=run, **sections, objective=name, loss=loss, data=data)


def model_config(tc: TrainConfig) -> ProLIPConfig:
    m = tc.model
    if m.config_json:
        path = Path(m.config_json)
        if not path.is_file():
            raise FileNotFoundError(f"model.config_json={path} does not exist")
        cfg = ProLIPConfig.from_dict(json.loads(path.read_text()))
    elif m.variant.startswith("open_clip:"):
        cfg = openclip.config_from_open_clip(openclip.arch_config(m.variant[len("open_clip:"):]))
    else:
        cfg = get_config(m.variant)
    towers = {}
    for side, overrides in (("vision", m.vision), ("text", m.text)):
        if overrides:
            base = getattr(cfg, side)
            towers[side] = schema.parse(type(base), {**dataclasses.asdict(base), **overrides}, f"config.model.{side}")
    extra = {} if m.init_logit_bias is None else {"init_logit_bias": m.init_logit_bias}
    if m.embed_dim < 0:
        raise ValueError(f"config.model.embed_dim={m.embed_dim} must be > 0 (or 0: the variant's)")
    if m.embed_dim:
        extra["embed_dim"] = m.embed_dim
    return cfg.replace(init_logit_scale=m.init_logit_scale, **extra, **towers)


def step_config(tc: TrainConfig) -> step_lib.StepConfig:
    return step_lib.StepConfig(
        objective=tc.objective, loss=tc.loss, masking=tc.masking, targets=tc.targets,
        microbatches=tc.run.microbatches, seed=tc.run.seed, normalization=tc.normalization, options=tc.step)


def build_model(tc: TrainConfig, mcfg: ProLIPConfig) -> ProLIP:
    """The module the step runs: the towers of `mcfg` with config.model's compute options."""
    m = tc.model
    levers = BlockLevers(**{f.name: getattr(m, f.name) for f in dataclasses.fields(BlockLevers)})
    return ProLIP(mcfg, dtype=jnp.dtype(m.dtype), attention_impl=m.attention_impl, remat=m.remat,
                  scan_layers=m.scan_layers, levers=levers)


def validate(tc: TrainConfig, mesh, mcfg: ProLIPConfig) -> None:
    """Clear errors for a config that cannot run (batch layout, sizes, combinations of sections)."""
    module = objectives.get(tc.objective)
    scfg = step_config(tc)
    step_lib.check_batch_layout(tc.run.batch_size, sharding.num_batch_shards(mesh), scfg)
    if tc.run.batch_size % jax.process_count():
        raise ValueError(f"batch_size {tc.run.batch_size} is not divisible by {jax.process_count()} hosts")
    if tc.data.get("image_size") != mcfg.vision.image_size:
        raise ValueError(f"data.image_size={tc.data.get('image_size')} but the model expects "
                         f"{mcfg.vision.image_size} px images")
    if module.NEEDS_LOGVAR and not (mcfg.vision.embed_unc and mcfg.text.embed_unc):
        raise ValueError(f"config.loss.objective={tc.objective!r} needs log sigma^2 from both towers, but the "
                         f"model has no uncertainty head (embed_unc=False); use a probabilistic model or a "
                         f"deterministic objective (clip, siglip, vse)")
    if tc.targets.soft and not module.SOFT_TARGETS:
        raise ValueError(f"config.targets.mix_fraction={tc.targets.mix_fraction} (MSDA) gives soft match targets, "
                         f"which objective {tc.objective!r} cannot take; set it to 0 or use an objective with "
                         f"soft targets (prolip, pcmepp, siglip)")
    if hasattr(module, "check_targets"):
        module.check_targets(tc.loss, tc.targets.identity)
    if tc.model.scan_layers and (tc.optim.layer_decay != 1.0 or tc.optim.name == "adamp"):
        raise ValueError("optim.layer_decay and optim.name='adamp' treat each block's parameters apart; "
                         "set model.scan_layers=False with them")
    if scfg.masked_group_rows and not 0 <= tc.masking.mask_token_id < mcfg.text.vocab_size:
        raise ValueError(f"masking.mask_token_id={tc.masking.mask_token_id} is outside the model's "
                         f"vocabulary of {mcfg.text.vocab_size}")


def maybe_initialize_distributed(coordinator_address: str | None, num_processes: int | None,
                                 process_id: int | None) -> None:
    """Explicit flags win; otherwise SLURM jobs of more than one task, TPU pod slices, or
    PROLIP_DISTRIBUTED=1 (what scripts/launch_tpu_pod.sh sets) call the auto-detecting
    `jax.distributed.initialize()`."""
    if coordinator_address:
        # CPU processes need gloo for cross-process collectives (no effect on GPU/TPU clients).
        # Nothing may touch the backend before initialize(), so do not ask which one it is.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    elif supervise.auto_distributed():
        jax.distributed.initialize()


EVAL_KEYS = ("type", "log_steps", "prefix")


def build_evaluators(run: RunConfig, model: ProLIP) -> list[tuple[dict, Any]]:
    """`config.evals.<name> = dict(type=..., log_steps=..., prefix=..., **evaluator_config)`
    (big_vision style) -> [(settings, evaluators.REGISTRY[type](evaluator_config, model))].
    Every host runs every evaluator (sharded over all hosts; identical metrics)."""
    built = []
    for name, ecfg in run.evals.items():
        ecfg = ecfg.to_dict() if hasattr(ecfg, "to_dict") else dict(ecfg)
        try:
            cls = evaluators.get(ecfg.get("type"))
        except ValueError as e:
            raise ValueError(f"config.evals.{name}: {e}") from None
        settings = {"name": name, "log_steps": int(ecfg.get("log_steps", run.log_steps)),
                    "prefix": ecfg.get("prefix", "")}
        built.append((settings, cls({k: v for k, v in ecfg.items() if k not in EVAL_KEYS}, model)))
    return built


def headline(evaluator: Any, values: dict[str, Any]) -> list[str]:
    """The names of `values` (one evaluator's metrics) that the console line shows: those matching
    a regex of the evaluator's `HEADLINE` (declared in its module). Every metric still goes to
    metrics.jsonl and TensorBoard."""
    patterns = getattr(evaluator, "HEADLINE", ())
    return [k for k in values if any(re.search(p, k) for p in patterns)]


# The console line's training metrics (all of them go to metrics.jsonl and TensorBoard): the loss
# and its largest terms, throughput and learning rate, and the problem counters once nonzero.
CONSOLE_LOSS_TERMS = 3
CONSOLE_TRAINING = ("loss", "samples_per_s", "lr")
CONSOLE_IF_NONZERO = ("nonfinite", "skipped_updates", "data/skipped")


def console_lines(values: dict[str, Any], evaluator_headlines: list[str]) -> list[list[str]]:
    """The names of `values` the console shows: a line of training metrics, then one of the
    evaluators' headlines (see `headline`); MetricWriter cuts each line to the terminal's width."""
    if "loss" not in values:
        return [evaluator_headlines]
    def size(k: str) -> float:  # the largest first, a non-finite one before them
        return -abs(values[k]) if np.isfinite(values[k]) else -np.inf

    terms = sorted((k for k in values if k.startswith("loss/")), key=size)[:CONSOLE_LOSS_TERMS]
    training = ["loss", *terms, *(k for k in CONSOLE_TRAINING[1:] if k in values),
                *(k for k in CONSOLE_IF_NONZERO if values.get(k))]
    return [training, evaluator_headlines]


def evaluate_command(workdir: Path, data: dict[str, Any], evals: dict[str, Any] | None = None) -> str:
    """The command that evaluates the checkpoint of `workdir` (scripts/evaluate.py) with the eval
    config that fits the run's data (configs/eval/): the demo's, the caption benchmark's with the
    run's own paths, or zero-shot on an ImageFolder: the run's own zero-shot folder when `evals`
    (config.evals) has one, else one the user names."""
    def here(path: Path) -> str:  # relative to the working directory when inside it
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)

    config, flags = data_sources.get(data.get("source", "random")).evaluate_with(data)
    folders = [e for e in (evals or {}).values() if e.get("type") == "zeroshot" and e.get("root")]
    if config == "imagefolder.py" and folders:
        split = folders[0].get("split", "val")
        flags = f" --config.root={folders[0]['root']}" + (f" --config.split={split}" if split != "val" else "")
    root = Path(__file__).resolve().parents[1]
    return (f"python {here(root / 'scripts' / 'evaluate.py')} --checkpoint {workdir} "
            f"--config {here(root / 'configs' / 'eval' / config)} --out {workdir / 'eval'}{flags}")


def warm_started(state: step_lib.TrainState, apply: Any, shardings: step_lib.TrainState, workdir: Path,
                 is_chief: bool) -> step_lib.TrainState:
    """`state` with the params of `warm_start.prepare(config.init, ...)`: the pretrained ones where
    they fit, the fresh (reference) initialisation for what ProLIP adds (paper B.2, C.8). The
    optimiser state is untouched: AdamW's moments start at zero whatever the params."""
    from jax.experimental import multihost_utils

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


def restore(mngr: ocp.CheckpointManager, step: int, model: ProLIP, tx: Any, shardings: step_lib.TrainState,
            mesh: Any, tc: TrainConfig, traced: step_lib.ParamTrace, data: Any) -> step_lib.TrainState:
    """The train state saved at `step`, on this run's mesh and optimiser. Fine-tuning controls
    (lock, groups, layer_decay) set the optimiser state's layout: a checkpoint saved under other
    ones is restored in its own layout, then its Adam moments move over by parameter path.
    `traced`: the run's model traced (step.trace_params)."""
    saved_model, meta, _ = ckpt_lib.load_config(mngr.directory, step)
    check_same_model(saved_model, model.config, Path(mngr.directory).parent)
    saved_cfg = meta.get("train_config", {})
    saved = saved_cfg.get("optim", {})
    # A checkpoint of the other block layout (model.scan_layers) is restored in its own, then converted.
    scanned = bool(saved_cfg.get("model", {}).get("scan_layers", False))
    if scanned != model.scan_layers:
        traced = step_lib.trace_params(model.clone(scan_layers=scanned))
    saved_tx, _ = optim.make_optimizer(tc.optim.with_layout_of(saved), tc.run.total_steps, traced.shapes, step=step)
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
    from jax.experimental import multihost_utils

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


# =====================================================================================
# Training.
# =====================================================================================
class RunFault(RuntimeError):
    """A fault the run stopped for after keeping what it could (a failed save, a failure outside
    the model); its message is the one line the user sees."""


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


def train(config, workdir: str, *, stop_at_step: int | None = None) -> dict[str, Any]:
    """Trains (or resumes) in `workdir`. Returns the last logged metrics.

    stop_at_step (`--stop_at_step`): save and stop when that step is reached, as a preempted
    run does; the same command without it continues to config.total_steps.
    Library logging (orbax, grain, absl) goes to WORKDIR/train.log, not the console
    (prolip_jax/library_logs.py; process i > 0: train.process_<i>.log).
    """
    paths.check_reachable(workdir, "--workdir", "--workdir")  # a bucket: one line on what is wrong with it
    check_workdir(workdir)
    with library_logs.to_file(paths.as_path(workdir) / library_logs.log_name(jax.process_index())):
        return _train(config, workdir, stop_at_step=stop_at_step)


def _train(config, workdir: str, *, stop_at_step: int | None = None) -> dict[str, Any]:
    """The run of `train`."""
    workdir = paths.as_path(workdir)  # local or a bucket (gs://): prolip_jax/paths.py
    config = with_defaults(config.copy_and_resolve_references())
    tc = parse_config(config)  # the only parse: every part below gets its typed section
    run = tc.run
    if stop_at_step is not None and not 0 < stop_at_step <= run.total_steps:
        raise ValueError(f"--stop_at_step={stop_at_step} must be in [1, config.total_steps={run.total_steps}]")
    is_chief = jax.process_index() == 0
    cache = use_compile_cache(run.compile_cache_dir)
    if is_chief and cache:
        print(f"compile cache: {cache}", flush=True)

    # ---- Mesh, model, optimiser -------------------------------------------------------
    mesh = sharding.make_mesh(tc.mesh.shape, tc.mesh.axes)
    mcfg = model_config(tc)
    validate(tc, mesh, mcfg)
    tc.profile.check(run.total_steps)
    scfg = step_config(tc)
    model = build_model(tc, mcfg)
    traced = step_lib.trace_params(model)  # model.init traced once: shapes, logical axes, draws
    param_shapes = traced.shapes
    # The optimiser depends on the step (a locked tower unlocks at optim.unlock_step), so it is
    # built once the step to start from is known.
    make_optimizer = lambda step: optim.make_optimizer(  # noqa: E731
        tc.optim, run.total_steps, param_shapes, step=step)
    make_optimizer(0)  # checks lock/group patterns against the parameters before anything compiles

    # ---- Data (training batches and the in-training evaluators) ---------------------------
    data = build_train_data(tc, mcfg, scfg)
    evaluators = build_evaluators(run, model)

    # ---- Pretrained weights (config.init): imported and checked now, applied after init. ---
    # A run that resumes never re-imports: its checkpoint already holds the warm-started state.
    ckpt_dir = paths.absolute(workdir / "checkpoints")
    resuming = ckpt_lib.is_checkpoint(ckpt_dir)
    apply_warm_start = None if resuming else warm_start.prepare(tc.init, mcfg, param_shapes)

    # ---- Checkpoints: resume if the workdir has one -------------------------------------
    # Only now, with the config and the data checked, does the workdir come into being.
    workdir.mkdir(parents=True, exist_ok=True)
    caption_index = getattr(data, "caption_index", None)  # caption sources (input_pipeline/captions.py)
    if is_chief and caption_index is not None and caption_index.noise_ratio > 0:
        write_noisy_pairs(caption_index, workdir / "noisy_pairs.json")  # which pairs data.noise_ratio corrupted
    mngr = ocp.CheckpointManager(
        ckpt_dir,
        options=ocp.CheckpointManagerOptions(max_to_keep=run.keep_checkpoints, create=True,
                                             enable_async_checkpointing=True),
        item_names=ckpt_lib.TRAIN_ITEMS)
    start = newest_intact_step(mngr, is_chief)  # a damaged newest step is moved aside, with a warning
    if stop_at_step is not None and stop_at_step <= (start or 0):
        raise ValueError(f"--stop_at_step={stop_at_step}: the run in {workdir} is already at step {start}")
    tx, schedule = make_optimizer(start or 0)
    random_init = start is None and apply_warm_start is None
    if start is None:
        state, state_sh = step_lib.create_train_state(model, tx, mesh, run.sharding_rules, run.seed, traced)
        start = 0
        if apply_warm_start is not None:
            state = warm_started(state, apply_warm_start, state_sh, workdir, is_chief)
    else:
        state_sh = step_lib.state_shardings(traced.boxed, tx, mesh, run.sharding_rules)
        state = restore(mngr, start, model, tx, state_sh, mesh, tc, traced, data)
        if is_chief:
            print(f"resumed from {workdir / 'checkpoints' / str(start)} (step {start})", flush=True)
    if is_chief:  # clu.parameter_overview's table to WORKDIR/parameters.txt, one line here (overview.py)
        print(overview.write_parameter_table(workdir, state.params), flush=True)

    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def compile_step(step: int):
        """The jitted step of the optimiser phase at `step`: only trainable leaves are differentiated."""
        trainable = optim.trainable_mask(param_shapes, tc.optim, step)
        fn = step_lib.make_train_step(model, tx, schedule, scfg, mesh, run.batch_size, trainable=trainable,
                                      rules=run.sharding_rules)
        return jax.jit(fn, in_shardings=(state_sh, None), out_shardings=(state_sh, replicated), donate_argnums=0)

    train_step = compile_step(start)
    rebuild_at = optim.rebuild_steps(tc.optim)

    best = (ckpt_lib.BestKeeper(workdir / "best", tc.keep_best, mcfg, tokenizer=getattr(data, "tokenizer_file", None))
            if tc.keep_best.metric else None)
    evaluated: set[str] = set()  # evaluators that have run at least once, and every metric logged:
    logged: set[str] = set()  # keep_best's metric must be among them

    # ---- What the user sees ----------------------------------------------------------------
    writer = MetricWriter(str(workdir), run.total_steps, is_chief=is_chief, resume_step=start + 1)
    m_count = step_lib.num_masked_rows(run.batch_size, scfg)

    def count_step_flops(step: int) -> float:
        """Model FLOPs of one step; a tower locked at `step` runs forward only (flops.py)."""
        locked = set(optim.locked_paths(param_shapes, tc.optim, step))
        towers = tuple(t for t in ("visual", "text")
                       if all(p in locked for p in optim.param_paths(param_shapes) if p.startswith(t + "/")))
        return flops_lib.train_step_flops(mcfg, run.batch_size, image_keep_ratio=scfg.masking.image_keep_ratio,
                                          num_masked=m_count, locked_towers=towers)

    step_flops = count_step_flops(start)
    device_kind = jax.devices()[0].device_kind
    preempted = {"flag": False}
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: preempted.update(flag=True))

    state_is_finite = jax.jit(lambda s: step_lib.all_finite((s.params, s.opt_state)), out_shardings=replicated)
    # The step keeps an update only when the new parameters and optimiser state are finite, and
    # the state it had otherwise (step.py), so a state that starts finite stays finite. A random
    # init is; a warm-started or restored state (an imported NaN, a checkpoint from other code)
    # is checked once, at its first save. The check is a reduction per leaf: compiling it costs
    # ~1.6 s on a CPU for the PCME++ recipe's ~600 leaves, for a run that needs no check.
    finite = {"known": random_init}

    def save(step: int, force: bool = False, data_state: ckpt_lib.StateSnapshot | None = None) -> None:
        if not finite["known"]:
            if not bool(to_host(state_is_finite(state))):
                raise FloatingPointError(f"the train state at step {step} is not finite; not saving it. "
                                         f"{last_good_checkpoint()}")
            finite["known"] = True
        try:
            ckpt_lib.save_train_state(mngr, step, state, mcfg, config, data, force=force,
                                      locked=optim.locked_paths(param_shapes, tc.optim, step), data_state=data_state)
        except Exception as e:  # noqa: BLE001 - a failed save (orbax re-raises the previous one's here)
            raise save_failed(e, step) from None
        saving["step"] = step

    saving: dict[str, int | None] = {"step": None}  # the last save started

    def finish_saves() -> None:
        """Waits for the asynchronous saves; one that failed stops the run in one line."""
        try:
            mngr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise save_failed(e, step) from None

    def save_failed(e: BaseException, at: int) -> RunFault:
        """A failed save (a full disk, a lost mount): the partial folder removed, one line naming
        the folder, the bytes needed and free, and the newest intact checkpoint."""
        # Orbax reports a background save's failure at the next save: the one still unfinished failed.
        unfinished = saving["step"] is not None and not (ckpt_dir / str(saving["step"])).exists()
        failed = ckpt_lib.failed_step(e, saving["step"] if unfinished else at)
        logging.getLogger("absl").error("saving checkpoint step %d failed", failed, exc_info=e)  # train.log
        ckpt_lib.wait_for_failed_save(mngr)  # nothing may still write into the folders removed below
        if is_chief:
            ckpt_lib.remove_partial_saves(ckpt_dir)
        state_bytes = sum(x.nbytes for x in jax.tree.leaves((state.params, state.opt_state)))
        return RunFault(ckpt_lib.save_failure(ckpt_dir, failed, e, state_bytes))

    @contextlib.contextmanager
    def outside_the_model(what: str) -> Iterator[None]:
        """A failure of `what` (the data pipeline, an evaluator, the metrics writer) leaves the
        model state sound: it is saved first, then the run stops in one line naming both."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every failure of these parts ends the same way
            raise stopped_by(what, e) from None

    def stopped_by(what: str, e: BaseException) -> BaseException:
        if isinstance(e, (RunFault, FloatingPointError)):
            return e
        logging.getLogger("absl").error("%s failed after step %d", what, step, exc_info=e)  # train.log
        if isinstance(e, StopIteration):
            gist = (f"its data ended (data.num_epochs={tc.data.get('num_epochs')}): raise "
                    "--config.data.num_epochs or lower --config.total_steps")
        elif isinstance(e, (NoRecordsError, DataStalled, paths.BucketError)):  # written for the user: shown whole
            gist = " ".join(str(e).split())
        else:
            gist = f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]
        if step == 0:
            return RunFault(f"{what} failed before the first step ({gist}); no checkpoint was written")
        if mngr.latest_step() != step:
            save(step, force=True, data_state=data_state)  # the data position before the failed read
        finish_saves()
        return RunFault(f"{what} failed after step {step} ({gist}); saved checkpoint step {step} "
                        f"({ckpt_dir / str(step)}): rerun the same command to resume from it")

    def last_good_checkpoint() -> str:
        good = mngr.latest_step()
        if good is None:
            return "No checkpoint was written."
        return f"The last good checkpoint is step {good} in {workdir / 'checkpoints'}."

    # ---- The loop --------------------------------------------------------------------------
    window = Window(replicated)  # every step's metrics, reduced over the log window on device (window.py)
    profiler = profiling.Profiler(tc.profile, workdir, run.total_steps, is_chief)
    if is_chief and profiler.skipped_note(start):
        print(profiler.skipped_note(start), flush=True)
    last_metrics: dict[str, Any] = {}
    prev_metrics = None
    in_a_row = 0
    t_log, step_log = time.time(), start
    step = start
    data_state = None  # the data position after the last batch read (None: the live iterator's)
    fetch = BatchFetcher(data, run.data_timeout_s)  # signals are answered while a read waits
    try:
        if run.eval_at_start and start == 0 and evaluators:
            values, shown = {}, []
            for settings, evaluator in evaluators:
                with outside_the_model(f"evaluator {settings['name']!r}"):
                    evaluated_values = {settings["prefix"] + k: v for k, v in evaluator.run(state.params)}
                values.update(evaluated_values)
                shown += headline(evaluator, evaluated_values)
            logged.update(values)
            with outside_the_model("the metrics writer"):
                writer.write(0, values, console=console_lines(values, shown))
            t_log = time.time()  # the evaluation is not training step time
        while step < run.total_steps:
            with outside_the_model("the data pipeline"):
                batch = fetch.next(stop=lambda: preempted["flag"])
            if batch is None:  # SIGTERM while waiting for data: saved at the position before the read
                if step > 0 and mngr.latest_step() != step:
                    save(step, force=True, data_state=data_state)
                finish_saves()
                if is_chief:
                    print(f"preempted: saved step {step}; rerun the same command to resume" if step else
                          "preempted before the first step: nothing to save; rerun the same command", flush=True)
                return last_metrics
            data_state = ckpt_lib.StateSnapshot.of(data)  # where a resume continues if the next read fails
            batch = sharding.global_batch(batch, mesh)
            profiler.before_step(step)
            if step == start and is_chief:
                print("compiling the train step...", flush=True)
            t_step = time.time()
            state, metrics = train_step(state, batch)
            if step == start and is_chief:  # the call returns once compiled; the step runs on
                print(f"compiled in {time.time() - t_step:.1f} s", flush=True)
            window.add(metrics)
            step += 1
            profiler.after_step(step, (state, metrics))
            if step in rebuild_at:  # optim.unlock_step: the locked parameters join the optimiser
                tx, schedule = make_optimizer(step)
                state_sh = step_lib.state_shardings(traced.boxed, tx, mesh, run.sharding_rules)
                state = with_optimizer(state, tx, state_sh)
                train_step = compile_step(step)
                step_flops = count_step_flops(step)
                if is_chief:
                    print(f"step {step}: unlocked {list(tc.optim.lock)} (fresh Adam moments for them)", flush=True)
            # Read the previous step's flag (step - 1): the device keeps working on this one meanwhile.
            if prev_metrics is not None:
                in_a_row = in_a_row + 1 if int(to_host(prev_metrics["nonfinite"])) else 0
            prev_metrics = metrics
            if in_a_row >= run.max_nonfinite_in_a_row:
                finish_saves()
                raise FloatingPointError(
                    f"steps {step - in_a_row}-{step - 1} ({in_a_row} in a row) had a non-finite loss, gradient "
                    f"or update and were skipped; stopping (check optim.lr, optim.eps and the data). "
                    f"{last_good_checkpoint()}")
            if step % run.log_steps == 0 or step == run.total_steps:
                values: dict[str, Any] = {k: float(to_host(v)) for k, v in window.result().items()}
                dt = (time.time() - t_log) / max(step - step_log, 1)
                t_log, step_log = time.time(), step
                values.update({
                    "step_time_s": dt, "samples_per_s": run.batch_size / dt,
                    "samples_per_s_per_device": run.batch_size / dt / jax.device_count(),
                    "tflops_per_device": flops_lib.tflops_per_device(step_flops, dt, jax.device_count()),
                    "skipped_updates": int(to_host(state.skipped)),
                    **{f"data/{k}": v for k, v in data.stats.items()},
                })
                mfu = flops_lib.mfu(step_flops, dt, jax.device_count(), device_kind, model.dtype)
                if mfu is not None:
                    values["mfu"] = mfu
            else:
                values = {}
            shown: list[str] = []  # the evaluators' headline metrics
            for settings, evaluator in evaluators:
                if step % settings["log_steps"] == 0 or step == run.total_steps:
                    t_eval = time.time()
                    with outside_the_model(f"evaluator {settings['name']!r}"):
                        evaluated_values = {settings["prefix"] + k: v for k, v in evaluator.run(state.params)}
                    values.update(evaluated_values)
                    shown += headline(evaluator, evaluated_values)
                    t_log += time.time() - t_eval  # evaluation time is not training step time
                    evaluated.add(settings["name"])
            logged.update(values)
            if best is not None and best.metric in values:
                if best.offer(step, float(values[best.metric]), state.params) and is_chief:
                    print(f"step {step}: best {best.metric} so far ({values[best.metric]:.4g}), kept in "
                          f"{workdir / 'best'}", flush=True)
            elif best is not None and len(evaluated) == len(evaluators) and values and best.metric not in logged:
                near = difflib.get_close_matches(best.metric, logged, n=3, cutoff=0.6)
                hint = (f"did you mean {messages.few(near)}?" if near else
                        f"the {len(logged)} logged: {messages.few(sorted(logged), 5)}")
                raise ValueError(f"config.keep_best.metric={best.metric!r} is not a logged metric (set "
                                 f"--config.keep_best.metric); {hint}")
            if values:
                with outside_the_model("the metrics writer"):
                    writer.write(step, values, console=console_lines(values, shown))
                last_metrics = values
            if step % run.checkpoint_steps == 0 and step < run.total_steps:
                save(step)
            asked_to_stop = step == stop_at_step
            if asked_to_stop or preempted["flag"] or mngr.reached_preemption(step):
                if mngr.latest_step() != step:  # not saved just above (a checkpoint step)
                    save(step, force=True)
                finish_saves()
                if is_chief and asked_to_stop:
                    print(f"stopped at step {step} (--stop_at_step): saved; the same command without it "
                          f"continues to step {run.total_steps}", flush=True)
                elif is_chief:
                    print(f"preempted: saved step {step}; rerun the same command to resume", flush=True)
                return last_metrics
        if mngr.latest_step() != step:
            save(step, force=True)
        finish_saves()
        if tc.optim.swa_every_steps:
            save_swa(workdir / "swa", state, step, mcfg, getattr(data, "tokenizer_file", None), is_chief)
        if is_chief:
            print(f"done: the checkpoint of step {step} is {ckpt_dir / str(step)}; evaluate it with\n  "
                  + evaluate_command(workdir, tc.data, run.evals), flush=True)
        return last_metrics
    finally:
        profiler.stop()
        signal.signal(signal.SIGTERM, previous_handler)
        for close in (mngr.wait_until_finished, mngr.close):  # after a failed save: its error again
            try:
                close()
            except Exception:  # noqa: BLE001 - already reported in one line; the details in train.log
                logging.getLogger("absl").exception("closing the checkpoint manager")
        writer.close()
        fetch.close()
        if best is not None:
            best.close()


# =====================================================================================
# Command line.
# =====================================================================================
def with_defaults(config):
    """`config` with every field it leaves out set to the default declared beside the code that
    uses it (RunConfig, SECTIONS, the objective's Config, input_pipeline.DataConfig), so
    `--config.<section>.<any field>=...` works (None defaults become typed placeholders:
    ml_collections cannot override a plain None)."""
    def fill(section, defaults):
        for key, value in defaults.items():
            if key not in section:
                section[key] = value

    with config.unlocked():
        fill(config, schema.defaults(RunConfig))
        for name, cls in SECTIONS.items():
            if name not in config:
                config[name] = {}
            fill(config[name], schema.defaults(cls))
        if "loss" not in config:
            config.loss = {}
        fill(config.loss, {"objective": objective_name(config), **schema.defaults(objectives.get(
            objective_name(config)).Config)})
        if "data" in config:
            data_defaults = schema.defaults(DataConfig)
            data_defaults.pop("batch_size")  # the trainer's batch_size rules
            data_defaults["tokenizer"] = {"kind": "sentencepiece", "path": ""}  # build_tokenizer kwargs
            fill(config.data, data_defaults)
    return config


def _split_config_arg(argv: list[str]) -> tuple[str, list[str]]:
    """(the value of --config, the other arguments)."""
    rest, spec = [argv[0]], None
    args = iter(argv[1:])
    for a in args:
        if a == "--config":
            spec = next(args, None)
        elif a.startswith("--config="):
            spec = a.split("=", 1)[1]
        else:
            rest.append(a)
    if not spec:
        raise ValueError("--config is required: --config configs/<name>.py[:args]")
    return spec, rest


def parse_command_line(argv: list[str]) -> tuple[Any, Any]:
    """(config, flag values) of `argv` = [program, --config FILE[:args], --workdir DIR,
    --config.<field>=value ...]. Raises ValueError, FileNotFoundError or absl's flags.Error
    whose first line names the problem."""
    from absl import flags
    from ml_collections import config_flags

    spec, argv = _split_config_arg(argv)
    config = with_defaults(config_args.load_config_file(spec))
    config_args.check_overrides(config, argv)
    fv = flags.FlagValues()  # not absl's global FLAGS: parsing twice in one process is fine
    holder = config_flags.DEFINE_config_dict("config", config, lock_config=True, flag_values=fv, sys_argv=argv)
    define = {"string": flags.DEFINE_string, "integer": flags.DEFINE_integer}
    for name, kind, _, text in train_flags.FLAGS:  # declared once, beside the help (train_flags.py)
        define[kind](name, None, text, flag_values=fv, required=name == "workdir")
    fv(argv)
    return holder.value, fv


def main(argv: list[str] | None = None) -> None:
    """The command line. A bad command prints one line naming the problem and exits 2, before
    anything is created; `--config.<field>=value` overrides any field of the config."""
    from absl import flags, logging

    argv = list(sys.argv if argv is None else argv)
    if any(a in train_flags.HELP_ARGS for a in argv[1:]):
        print(train_flags.help_text(argv, __doc__))
        return

    def fail(e: BaseException) -> None:
        msg = e.args[0] if e.args and isinstance(e.args[0], str) else str(e)
        print("error: " + " ".join(msg.split()), file=sys.stderr)  # one line
        sys.exit(2)

    try:
        config, fv = parse_command_line(argv)
    except (flags.Error, ValueError, TypeError, FileNotFoundError, AttributeError, KeyError) as e:
        fail(e)

    if supervise.is_child():
        supervise.die_with_parent()
    elif fv.coordinator_address or supervise.auto_distributed():  # several processes: prolip_jax/supervise.py
        sys.exit(supervise.run_trainer(argv, fv.workdir, fv.process_id, fv.num_processes))
    logging.set_verbosity(logging.WARNING)  # orbax logs every save step at INFO
    maybe_initialize_distributed(fv.coordinator_address, fv.num_processes, fv.process_id)
    watch = peers.watch(fv.workdir)  # several processes: a lost one ends the others in one line
    code = 2
    try:
        train(config, fv.workdir, stop_at_step=fv.stop_at_step)
        code = 0
    except (ValueError, FileNotFoundError, FloatingPointError, RunFault, paths.BucketError) as e:
        fail(e)
    except KeyboardInterrupt:  # Ctrl-C: stop now; the checkpoints written so far stay
        print(f"interrupted (Ctrl-C): rerun the same command to resume from the newest checkpoint in "
              f"{fv.workdir}", file=sys.stderr)
        code = 130
        sys.exit(code)
    finally:
        if watch is not None:
            watch.stop(code)


if __name__ == "__main__":
    code = 1
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    finally:
        if BatchFetcher.abandoned:  # a hung read's library threads and worker processes cannot end cleanly
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    sys.exit(code)
