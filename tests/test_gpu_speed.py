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
from benchmark_step import set_field  # noqa: E402


def test_rows_most_wanted_first():
    rows = gpu_speed.variants((256, 512))
    assert [(r["name"], r["batch"]) for r in rows[:2]] == [("baseline", 256), ("all levers", 256)]
    assert {r["name"] for r in rows if r["batch"] == 256} == {"baseline", "all levers", *gpu_speed.LEVERS}
    every = rows[1]
    assert set(every["sets"]) == {s for sets, _ in gpu_speed.LEVERS.values() for s in sets}
    assert every["xla"] == "--xla_gpu_dot_merger_threshold_mb=0 --xla_gpu_enable_triton_gemm=false"
    argv = gpu_speed.step_argv("configs/x.py", every, 20, Path("/tmp/j.json"))
    assert argv.count("--set") == len(every["sets"]) and "--per-device-batch" in argv


def test_report_ratios_against_baseline_and_pytorch():
    def row(variant, sps, b=256):
        return {"name": f"{variant} @{b}", "variant": variant, "per_device_batch": b, "status": "ok",
                "command": "cmd", "result": {"samples_per_s_per_device": sps, "mfu": 0.3, "step_s": b / sps}}
    md = gpu_speed.report({"config": "c", "steps": 20, "timed": [
        row("baseline", 1000.0), row("all levers", 1200.0), row("PyTorch (torch.compile)", 1100.0),
        {"name": "cast_once @256", "variant": "cast_once", "per_device_batch": 256, "status": "not run",
         "command": "cmd"}]})
    line = next(x for x in md.splitlines() if x.startswith("| all levers"))
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
    assert config.step.finite_guard == "fused" and config.model.flat_tokens is True and config.model.scan_layers
    with pytest.raises(ValueError):
        set_field(config, "model.remat")  # no '=': nothing to set


def test_best_row_takes_the_levers_that_helped():
    def row(variant, sps, status="ok"):
        return {"variant": variant, "per_device_batch": 256, "status": status,
                "result": {"samples_per_s_per_device": sps}}
    timed = [row("baseline", 1000.0), row("no_dot_merger", 1100.0), row("flat_tokens", 1005.0),
             row("fused_guard", 1050.0), row("cast_once", 0.0, status="failed")]
    best = gpu_speed.best_row(timed, 256)
    assert best["levers"] == ["no_dot_merger", "fused_guard"]
    assert best["xla"] == "--xla_gpu_dot_merger_threshold_mb=0" and best["sets"] == ("step.finite_guard=fused",)
    assert gpu_speed.best_row(timed[:1] + [row("flat_tokens", 1005.0)], 256) is None  # within the 1% margin
    assert gpu_speed.best_row(timed[1:], 256) is None  # no baseline to compare with


def test_state_only_times_the_train_state_alone(tmp_path, capsys):
    import json

    import benchmark_step

    benchmark_step.main(["--config", "configs/tiny.py:data=random", "--state-only", "--json", str(tmp_path / "r.json")])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["init_s"] > 0 and "compile_s" not in result
    assert "train state" in capsys.readouterr().out
