"""Config to parts: the model config, the module, the step's settings, the optimiser, the data
and the in-training evaluators of a typed `TrainConfig`, each checked before anything compiles.
Benchmarks, scripts and tests build what they need from here (`build` for all of it).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import evaluators
from prolip_jax.core import objectives, optim, sharding
from prolip_jax.runtime import schema
from prolip_jax.core import step as step_lib
from prolip_jax.trainer.data import TrainData, build_train_data
from prolip_jax.core.models import ProLIP, ProLIPConfig, get_config
from prolip_jax.core.models.transformer import BlockLevers
from prolip_jax.core.pretrained import openclip
from prolip_jax.trainer.config import RunConfig, TrainConfig


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
    if tc.data.image_size != mcfg.vision.image_size:
        raise ValueError(f"data.image_size={tc.data.image_size} but the model expects "
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


def make_optimizer(tc: TrainConfig, param_shapes: Any, step: int) -> tuple[Any, Any]:
    """(optax transformation, learning-rate schedule) of the optimiser phase at `step`: a locked
    tower joins at optim.unlock_step, so the optimiser depends on the step a run starts from."""
    return optim.make_optimizer(tc.optim, tc.run.total_steps, param_shapes, step=step)


@dataclasses.dataclass
class Parts:
    """What a run is built from: the typed config and everything it names, checked."""

    tc: TrainConfig
    mesh: Any
    model_config: ProLIPConfig
    model: ProLIP
    step_config: step_lib.StepConfig
    traced: step_lib.ParamTrace  # model.init traced once: shapes, logical axes, draws
    data: TrainData  # this host's batches, the tokenizer file and a caption index (trainer/data.py)
    evaluators: list[tuple[dict, Any]]


def build(tc: TrainConfig) -> Parts:
    """Every part of a run of `tc`, each checked before anything compiles: the mesh, the model,
    the step's settings, the optimiser's patterns against the parameters, the data (its files,
    tokenizer and masking ids) and the evaluators."""
    mesh = sharding.make_mesh(tc.mesh.shape, tc.mesh.axes, dcn_shape=tc.mesh.dcn_shape)
    mcfg = model_config(tc)
    validate(tc, mesh, mcfg)
    tc.profile.check(tc.run.total_steps)
    scfg = step_config(tc)
    model = build_model(tc, mcfg)
    traced = step_lib.trace_params(model)
    sharding.check_divisible(traced.boxed, mesh, tc.run.sharding_rules)
    make_optimizer(tc, traced.shapes, 0)  # lock/group patterns against the parameters
    data = build_train_data(tc, mcfg, scfg)
    return Parts(tc, mesh, mcfg, model, scfg, traced, data, build_evaluators(tc.run, model))
