"""Speed levers chosen by platform: a config that leaves a lever unset gets the platform's
default (the GPU's measured winners; CPU and TPU keep today's programs), the user's setting
wins, the project's XLA flags go in before jax's backend starts and under the user's own, and
the run names and records what is on."""
from __future__ import annotations

from pathlib import Path

from prolip_jax.core import step as step_lib
from prolip_jax.runtime import xla_flags
from prolip_jax.trainer import config as trainer_config
from prolip_jax.trainer.build import build_model, model_config, step_config
from prolip_jax.trainer.config import parse_config, with_defaults
from test_train import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def test_flags_merge_with_the_users_whose_value_wins():
    project = xla_flags.GPU_FLAGS
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true --xla_force_host_platform_device_count=8"}
    xla_flags.apply(env, platform="gpu")
    got = xla_flags.values(env["XLA_FLAGS"])
    assert got["xla_gpu_enable_triton_gemm"] == "true"  # the user's
    assert got["xla_gpu_dot_merger_threshold_mb"] == project["xla_gpu_dot_merger_threshold_mb"]
    assert got["xla_force_host_platform_device_count"] == "8"
    assert xla_flags.active("gpu", env) == {"xla_gpu_dot_merger_threshold_mb": "0"}
    xla_flags.apply(env, platform="gpu")  # a supervised child applies again: nothing repeats
    assert env["XLA_FLAGS"].count("dot_merger") == 1 and env["XLA_FLAGS"].count("triton_gemm") == 1
    empty: dict = {}
    xla_flags.apply(empty, platform="gpu")
    assert xla_flags.values(empty["XLA_FLAGS"]) == project
    for env in ({}, {xla_flags.OFF_ENV: "1"}):
        xla_flags.apply(env, platform="other" if not env else "gpu")
        assert "XLA_FLAGS" not in env
    assert xla_flags.expected_platform({"JAX_PLATFORMS": "cpu"}) == "other"
    assert xla_flags.values("--a=1 --b --a=2") == {"a": "2", "b": "true"}


def test_a_gpu_run_gets_the_gpu_levers_unless_the_config_sets_them(tmp_path):
    cfg = with_defaults(tiny_config(tmp_path, **{"data.source": "random"}))
    cpu, gpu = parse_config(cfg, platform="cpu"), parse_config(cfg, platform="gpu")
    assert (cpu.model.flat_tokens, cpu.step.cast_params_once, cpu.step.finite_guard) == (False, False, "per_leaf")
    assert (gpu.model.flat_tokens, gpu.step.cast_params_once, gpu.step.finite_guard) == (True, True, "fused")
    assert gpu.model.ln_saved_stats is False  # not measured alone: off everywhere
    assert parse_config(cfg, platform="tpu") == parse_config(cfg, platform="cpu").for_platform("tpu")
    assert parse_config(cfg, platform="tpu").levers() == []
    # What the step and the model are built with.
    assert step_config(gpu).options == step_lib.StepOptions(cast_params_once=True, finite_guard="fused")
    assert build_model(gpu, model_config(gpu)).levers.flat_tokens is True
    assert build_model(cpu, model_config(cpu)).levers.flat_tokens is False

    with cfg.unlocked():
        cfg.model.flat_tokens = False
        cfg.step.finite_guard = "per_leaf"
    mine = parse_config(cfg, platform="gpu")
    assert (mine.model.flat_tokens, mine.step.finite_guard, mine.step.cast_params_once) == (False, "per_leaf", True)
    assert mine.levers() == ["step.cast_params_once"]
    line = mine.levers_line()
    assert line.startswith("speed levers (gpu): step.cast_params_once")

    record = trainer_config.record(gpu)
    assert record["model"]["flat_tokens"] is True and record["levers"]["platform"] == "gpu"
    assert record["levers"]["on"] == ["model.flat_tokens", "step.cast_params_once", "step.finite_guard=fused"]
    assert trainer_config.recorded(trainer_config.ModelOptions, record["model"]).flat_tokens is True


def test_levers_line_names_the_xla_flags_in_effect(monkeypatch, tmp_path):
    gpu = parse_config(with_defaults(tiny_config(tmp_path, **{"data.source": "random"})), platform="gpu")
    monkeypatch.setenv("XLA_FLAGS", xla_flags.merged("", xla_flags.GPU_FLAGS))
    assert gpu.levers_line() == ("speed levers (gpu): model.flat_tokens, step.cast_params_once, step.finite_guard=fused, "
                                 "XLA_FLAGS --xla_gpu_dot_merger_threshold_mb=0 --xla_gpu_enable_triton_gemm=false")


def test_an_override_on_the_command_line_reaches_a_lever_left_to_the_platform():
    from prolip_jax import train
    config, _ = train.parse_command_line(["prolip_jax.train", "--config", f"{ROOT}/configs/tiny.py:data=random",
                                          "--workdir", "/unused", "--config.model.flat_tokens=false",
                                          "--config.step.finite_guard=fused"])
    tc = parse_config(config, platform="gpu")
    assert (tc.model.flat_tokens, tc.step.finite_guard, tc.step.cast_params_once) == (False, "fused", True)
