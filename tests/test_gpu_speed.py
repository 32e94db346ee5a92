"""benchmarks/gpu_speed.py, the GPU speed plan: its rows, `--only`, and the table it writes
(the plan run whole takes minutes at test size; its parts are checked here without a GPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import ml_collections
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import gpu_speed  # noqa: E402
from prolip_jax.runtime import xla_flags  # noqa: E402
from benchmark_step import set_field  # noqa: E402


def test_rows_most_wanted_first():
    rows = gpu_speed.variants((256, 512))
    assert [(r["name"], r["batch"]) for r in rows[:2]] == [("shipped", 256), ("shipped, warm cache", 256)]
    assert [r["name"] for r in rows[2:6]] == ["shipped + ln_saved_stats", "shipped + pallas_kernels",
                                              "shipped + scan_layers", "no levers"]
    assert {r["name"] for r in rows if r["batch"] == 256} >= {"no levers", *gpu_speed.LEVERS}
    assert [(r["name"], r["batch"]) for r in rows if r["batch"] == 512] == [("shipped", 512)]
    shipped, none = rows[0], rows[5]
    assert shipped["sets"] == () and shipped["xla"] == "" and shipped["env"] == {}  # no flags: what a user gets
    assert none["env"] == {xla_flags.OFF_ENV: "1"} and none["xla"] == ""
    assert set(none["sets"]) == {off for _, off in gpu_speed.CONFIG_LEVERS.values()}
    alone = next(r for r in rows if r["name"] == "no_dot_merger")
    assert alone["xla"] == "--xla_gpu_dot_merger_threshold_mb=0" and alone["env"] == none["env"]
    flat = next(r for r in rows if r["name"] == "flat_tokens")
    assert "model.flat_tokens=true" in flat["sets"] and "step.finite_guard=per_leaf" in flat["sets"]
    argv = gpu_speed.step_argv("configs/x.py", flat, 20, Path("/tmp/j.json"))
    assert argv.count("--set") == len(gpu_speed.CONFIG_LEVERS) and "--per-device-batch" in argv


def test_shipped_is_what_a_gpu_run_gets():
    """The plan's SHIPPED names the levers a GPU run turns on with no flags."""
    from prolip_jax.trainer.config import parse_config

    on = parse_config(ml_collections.ConfigDict({"total_steps": 1, "batch_size": 8}), platform="gpu").levers()
    config_levers = {n for n, (on_set, _) in gpu_speed.CONFIG_LEVERS.items() if on_set.removesuffix("=true") in on}
    assert len(config_levers) == len(on)
    flags = {n for n, flag in gpu_speed.XLA_LEVERS.items() if flag in xla_flags.GPU_FLAGS}
    assert config_levers | flags == set(gpu_speed.SHIPPED)


def test_report_ratios_against_shipped_and_pytorch():
    def row(variant, sps, b=256):
        return {"name": f"{variant} @{b}", "variant": variant, "per_device_batch": b, "status": "ok",
                "command": "cmd", "result": {"samples_per_s_per_device": sps, "mfu": 0.3, "step_s": b / sps}}
    md = gpu_speed.report({"config": "c", "steps": 20, "timed": [
        row("shipped", 1000.0), row("shipped + pallas_kernels", 1200.0), row(gpu_speed.PYTORCH, 1100.0),
        {"name": "cast_once @256", "variant": "cast_once", "per_device_batch": 256, "status": "not run",
         "command": "cmd"}]})
    line = next(x for x in md.splitlines() if x.startswith("| shipped + pallas_kernels"))
    assert "1.200x" in line and "1.091x" in line and "30.0%" in line
    assert "| cast_once | 256 | — |" in md


def test_only_rejects_an_unknown_row(tmp_path):
    p = subprocess.run([sys.executable, "benchmarks/gpu_speed.py", "--out", str(tmp_path), "--tiny",
                        "--only", "flat_tokenz"], cwd=REPO, capture_output=True, text=True)
    assert p.returncode == 2 and "unknown row(s) ['flat_tokenz']" in p.stderr


def test_set_field_creates_a_missing_section():
    config = ml_collections.ConfigDict({"model": {"remat": "none", "scan_layers": False}})
    set_field(config, "step.finite_guard=fused")
    set_field(config, "model.flat_tokens=true")
    set_field(config, "model.scan_layers=true")
    from prolip_jax.trainer.config import with_defaults  # levers left to the platform: None placeholders
    filled = with_defaults(ml_collections.ConfigDict({"total_steps": 1, "batch_size": 8}))
    set_field(filled, "model.pallas_kernels=true")
    set_field(filled, "step.finite_guard=per_leaf")
    assert filled.model.pallas_kernels is True and filled.step.finite_guard == "per_leaf"
    assert config.step.finite_guard == "fused" and config.model.flat_tokens is True and config.model.scan_layers
    with pytest.raises(ValueError):
        set_field(config, "model.remat")  # no '=': nothing to set


def test_best_row_takes_the_levers_that_helped():
    def row(variant, sps, status="ok"):
        return {"variant": variant, "per_device_batch": 256, "status": status,
                "result": {"samples_per_s_per_device": sps}}
    timed = [row("no levers", 1000.0), row("no_dot_merger", 1100.0), row("flat_tokens", 1005.0),
             row("fused_guard", 1050.0), row("cast_once", 0.0, status="failed")]
    best = gpu_speed.best_row(timed, 256)
    assert best["levers"] == ("fused_guard", "no_dot_merger")
    assert best["xla"] == "--xla_gpu_dot_merger_threshold_mb=0" and "step.finite_guard=fused" in best["sets"]
    assert "model.flat_tokens=false" in best["sets"]
    assert gpu_speed.best_row(timed[:1] + [row("flat_tokens", 1005.0)], 256) is None  # within the 1% margin
    assert gpu_speed.best_row(timed[1:], 256) is None  # no `no levers` row to compare with
    shipped = [row("no levers", 1000.0)] + [row(n, 1100.0) for n in gpu_speed.SHIPPED]
    assert gpu_speed.best_row(shipped, 256) is None  # the shipped set: its row exists already


def test_state_only_times_the_train_state_alone(tmp_path, capsys):
    import json

    import benchmark_step

    benchmark_step.main(["--config", "configs/tiny.py:data=random", "--state-only", "--json", str(tmp_path / "r.json")])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["init_s"] > 0 and "compile_s" not in result
    assert "train state" in capsys.readouterr().out
