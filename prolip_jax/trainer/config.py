"""The trainer's config, typed: `parse_config` checks every field of a configs/*.py ConfigDict
against its declaration (the dataclass beside the code that uses it) once, at the top of a run,
and every part of the trainer receives the section it needs. `with_defaults` fills what a config
leaves out, so `--config.<section>.<any field>=...` works on the command line; `record` is what a
checkpoint keeps of it.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, ClassVar, Literal

import jax

from input_pipeline.config import DataConfig
from prolip_jax.core import checkpoint as ckpt_lib
from prolip_jax.core import objectives, optim, sharding
from prolip_jax.runtime import profiling, schema, xla_flags
from prolip_jax.core import step as step_lib
from prolip_jax.core.models.config import PAPER_INIT_LOGIT_SCALE
from prolip_jax.core.models.transformer import REMAT_POLICIES
from prolip_jax.core.pretrained import warm_start
from prolip_jax.core.targets import TargetsConfig


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
    the variant's VisionConfig / TextConfig (prolip_jax/core/models/config.py), e.g. the heads and
    pooling of the other methods: `model.text = dict(pool="gpo")`."""

    # A name in prolip_jax.core.models.VARIANTS, or "open_clip:NAME" for the towers of an open_clip
    # architecture ('open_clip:ViT-B-32-quickgelu', prolip_jax/core/pretrained/openclip.py ARCHS): the
    # shape a CLIP warm start needs, with `vision` / `text` adding the method's heads.
    variant: str = "tiny"
    config_json: str = ""  # or a reference config.json (any size), used instead of `variant`
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # compute; params stay float32
    remat: str = dataclasses.field(default="none", metadata={"choices": tuple(REMAT_POLICIES)})
    attention_impl: Literal["auto", "xla", "cudnn"] = "auto"
    # False: the unrolled step runs faster on CPU with fewer temporaries (docs/performance.md, "Scanned blocks")
    scan_layers: bool = False  # each tower's blocks as one nn.scan (models/layout.py): 4x faster B/16 compile
    # GPU speed levers of the blocks, the same arithmetic, one line per field of
    # models/transformer.py BlockLevers (build_model passes them by name; tests/test_speed_levers.py;
    # docs/performance.md): the blocks on [B*T, D] token matrices, and the LayerNorms' backward
    # reading the forward's row statistics, LayerNorm and the MLP's bias + activation as Pallas
    # kernels (models/kernels.py). None: the platform's (PLATFORM_DEFAULTS).
    flat_tokens: bool | None = None
    ln_saved_stats: bool | None = None
    pallas_kernels: bool | None = None
    init_logit_scale: float = PAPER_INIT_LOGIT_SCALE  # log a
    init_logit_bias: float | None = None  # b; None: the variant's (ProLIP: -10)
    # The joint embedding's size (mu, sigma^2); 0: the variant's. PCME++ on COCO: 1024 on CLIP's
    # 512-d trunks (seed 003 App. B.2), with config.init.fresh for the new projections.
    embed_dim: int = 0
    vision: Any = dataclasses.field(default_factory=dict)
    text: Any = dataclasses.field(default_factory=dict)

    # The levers that won on the GPU (docs/performance.md, "Levers and defaults"); CPU and TPU
    # keep the programs the golden tests pin.
    PLATFORM_DEFAULTS: ClassVar[dict] = {"default": dict(flat_tokens=False, ln_saved_stats=False, pallas_kernels=False),
                                         "gpu": dict(flat_tokens=True)}


# The config's sections and the dataclass declaring each one's fields, beside the code that uses
# them. `loss` is the selected objective's Config (prolip_jax/core/objectives/); `data` is
# input_pipeline.DataConfig (its source's needs, such as data.path, are checked when it is built).
SECTIONS: dict[str, type] = {
    "model": ModelOptions,
    "masking": step_lib.MaskingConfig,  # ProLIP's masked forward
    "step": step_lib.StepOptions,  # how the step computes: speed levers, same result (prolip_jax/core/step.py)
    "targets": TargetsConfig,  # positives and MSDA (prolip_jax/core/targets.py)
    "optim": optim.OptimConfig,
    "mesh": sharding.MeshConfig,
    "init": warm_start.InitConfig,  # a pretrained model to start from (prolip_jax/core/pretrained/warm_start.py)
    "keep_best": ckpt_lib.KeepBestConfig,  # the best checkpoint by a metric (prolip_jax/core/checkpoint.py)
    "profile": profiling.ProfileConfig,  # a jax.profiler trace of a few steps (prolip_jax/runtime/profiling.py)
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
    objective: str  # a name in prolip_jax.core.objectives.REGISTRY
    loss: Any  # that objective's Config
    # The batch is the run's (config.batch_size) and the seed, unless data.seed sets it, too.
    data: DataConfig
    platform: str = "cpu"  # what the levers left None were resolved for (parse_config)

    @property
    def normalization(self) -> str:
        return self.data.normalization

    def for_platform(self, platform: str) -> "TrainConfig":
        """The config with every lever left None at `platform`'s default (schema.for_platform)."""
        return dataclasses.replace(self, platform=platform, **{
            name: schema.for_platform(getattr(self, name), platform) for name in SECTIONS})

    def levers(self) -> list[str]:
        """The config's speed levers that are on, as overrides name them (`model.flat_tokens`)."""
        return [lever for name in SECTIONS for lever in schema.levers_on(getattr(self, name), name)]

    def levers_line(self) -> str:
        """One line naming the levers in effect: the config's and the project's XLA flags."""
        flags = xla_flags.active(self.platform)
        named = self.levers() + ([f"XLA_FLAGS {xla_flags.describe(flags)}"] if flags else [])
        return f"speed levers ({self.platform}): {', '.join(named) or 'none'}"


def objective_name(config) -> str:
    return config.loss.get("objective", "prolip") if "loss" in config else "prolip"


def parse_config(config, platform: str | None = None) -> TrainConfig:
    """Every field of `config` checked against its declaration: unknown fields, wrong types and
    values outside a field's choices are one-line ValueErrors / TypeErrors. The speed levers the
    config leaves None take `platform`'s defaults (default: jax's backend, "cpu", "gpu", "tpu")."""
    schema.check_keys(config.keys(), {*schema.fields(RunConfig), *SECTIONS, "loss", "data"}, "config")
    run = schema.parse(RunConfig, {k: config[k] for k in schema.fields(RunConfig) if k in config}, "config")
    sections = {name: schema.parse(cls, config.get(name), f"config.{name}") for name, cls in SECTIONS.items()}
    name = objective_name(config)
    module = objectives.get(name)
    loss = schema.parse(module.Config, {k: v for k, v in (config.get("loss") or {}).items() if k != "objective"},
                        f"config.loss (objective {name!r})")
    tc = TrainConfig(run=run, **sections, objective=name, loss=loss, data=parse_data(config.get("data"), run))
    return tc.for_platform(platform or jax.default_backend())


def parse_data(section, run: RunConfig) -> DataConfig:
    """`config.data` typed: the run's batch and (unless the section sets one) seed; "auto"
    resolved to the source data.path's names say."""
    values = schema.plain(section) if section is not None else {}
    if values.get("batch_size", run.batch_size) != run.batch_size:
        raise ValueError(f"config.data.batch_size={values['batch_size']} differs from config.batch_size="
                         f"{run.batch_size}, the run's global batch: remove data.batch_size")
    return DataConfig.from_mapping({"seed": run.seed, **values, "batch_size": run.batch_size}, "config.data")


def record(tc: TrainConfig) -> dict[str, Any]:
    """What a checkpoint keeps of the config (its `train_config`): the typed sections in the
    layout of a config file (the run's fields at the top, `loss` with its `objective`), as JSON
    values. Checkpoints written from the raw ConfigDict have the same layout."""
    sections = {name: dataclasses.asdict(getattr(tc, name)) for name in SECTIONS}
    run = dataclasses.asdict(tc.run)
    run["evals"] = {k: schema.plain(v) for k, v in tc.run.evals.items()}
    loss = {"objective": tc.objective, **dataclasses.asdict(tc.loss)}
    data = {k: v for k, v in dataclasses.asdict(tc.data).items() if k != "batch_size"}  # the run's
    # The speed levers as resolved for this run's platform, and the XLA flags it ran with.
    levers = {"platform": tc.platform, "on": tc.levers(), "xla_flags": os.environ.get("XLA_FLAGS", "")}
    return json.loads(json.dumps({**run, **sections, "loss": loss, "data": data, "levers": levers}, default=str))


def recorded(cls: type, saved: Any) -> Any:
    """Section `cls` as a checkpoint recorded it (`record`'s dict for that section): the fields
    this code still declares; the others, and any the checkpoint lacks, take today's defaults."""
    known = {k: v for k, v in (saved or {}).items() if k in schema.fields(cls)}
    return schema.parse(cls, known, "the checkpoint's recorded config")


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
