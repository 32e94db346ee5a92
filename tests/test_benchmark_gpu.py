"""benchmarks/benchmark_gpu.py: the GPU benchmark plan, run whole at test size on CPU.

On CPU the parts that need CUDA must come back skipped with their reason (cuDNN attention, the
largest batch: no device memory limit), device memory as absent, MFU as unknown — never faked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import benchmark_gpu  # noqa: E402
from conftest import xla_flags  # noqa: E402
from benchmark_step import largest_fitting  # noqa: E402


@pytest.mark.parametrize("true_max,limit", [(700, 1000), (700, None), (100, 1000), (3000, 1000), (10 ** 6, 1000)])
def test_largest_fitting_brackets_the_true_maximum(true_max, limit):
    calls = []

    def fits(b):
        calls.append(b)
        # Bytes grow a little faster than linearly, so the extrapolated guess is off.
        return b <= true_max, 100 + b * 900 / true_max * (1 + b / 1e5)

    lo, hi = largest_fitting(fits, 256, 32, 16384, limit)
    assert len(calls) == len(set(calls)) <= 12
    if true_max >= 16384:
        assert (lo, hi) == (16384, None)
    else:
        assert lo == true_max // 32 * 32 and hi == lo + 32


def test_runner_records_failures_and_timeouts(tmp_path):
    r = benchmark_gpu.Runner(tmp_path, tmp_path / "tmp", timeout=60, deadline=None)
    ok = r.run("ok", [sys.executable, "-c", "print('hello')"])
    bad = r.run("bad", [sys.executable, "-c", "raise SystemExit('boom 42')"])
    slow = r.run("slow", [sys.executable, "-c", "import time; time.sleep(60)"], timeout=2)
    assert ok["status"] == "ok" and ok["command"] == "python -c 'print('\"'\"'hello'\"'\"')'"
    assert bad["status"] == "failed" and "boom 42" in bad["error"]
    assert slow["status"] == "timeout" and 1.5 < slow["seconds"] < 20
    late = benchmark_gpu.Runner(tmp_path, tmp_path, timeout=60, deadline=0).run("late", [sys.executable, "-V"])
    assert late["status"] == "not run" and "deadline" in late["error"]
    assert "hello" in (tmp_path / "log.txt").read_text()


def test_merge_joins_the_runs_of_a_part_measured_in_several_calls(tmp_path):
    def run(name, status="ok"):
        return {"name": name, "status": status, "command": f"cmd {name}",
                **({"result": {"samples_per_s_per_device": 2.0, "mfu": 0.5}} if status == "ok" else {})}

    a = {"command": "a", "parts": {"eval": {"status": "skipped", "runs": []},
                                   "levers": {"status": "ok", "runs": [run("baseline"), run("remat=full")]}}}
    b = {"command": "b", "parts": {"levers": {"status": "failed", "runs": [
        run("baseline", "failed"), run("remat=full", "not run"), run("xla:no_triton_gemm")]}}}
    for name, r in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(r))
    merged = benchmark_gpu.merge([str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert list(merged["parts"]) == ["levers", "eval"]   # plan order
    levers = {r["name"]: r["status"] for r in merged["parts"]["levers"]["runs"]}
    assert levers == {"baseline": "failed", "remat=full": "ok", "xla:no_triton_gemm": "ok"}
    assert merged["parts"]["levers"]["status"] == "partial"
    benchmark_gpu.save(tmp_path, merged)   # renders without the parts it lacks
    md = (tmp_path / "results.md").read_text()
    assert "| remat=full | 2 | 50.0% | — | ok | `cmd remat=full` |" in md and "## Evaluation speed" in md


def _runs(part: dict) -> dict:
    return {r["name"]: r for r in part["runs"]}


@pytest.mark.skipif(os.environ.get("PROLIP_TEST_GPU_PLAN") != "1",
                    reason="the GPU plan's rehearsal (a dozen processes): PROLIP_TEST_GPU_PLAN=1, before a GPU run")
def test_the_whole_plan_at_tiny_size_on_cpu(tmp_path):
    """Run before a GPU session (docs/performance.md, "Measuring on a GPU"): the plan's every part
    on CPU at test size, so that the device's minutes are not spent on a broken script."""
    out = tmp_path / "out"
    # Every run here is 1-3 steps, its time the compile's: the plan's subprocesses inherit these
    # XLA_FLAGS, LLVM -O0 (conftest.py; the plan's figures are not what is tested) on one CPU
    # device, as the plan runs on one GPU (the suite's 8 fake devices: 132 s here, one: 104 s).
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=xla_flags(1))
    p = subprocess.run([sys.executable, "benchmarks/benchmark_gpu.py", "--out", str(out), "--tiny"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads((out / "results.json").read_text())
    assert res["environment"]["backend"] == "cpu"
    assert list(res["parts"]) == list(benchmark_gpu.PARTS)
    parts = res["parts"]

    # 1. The step, with the matmul reference and a profile; no MFU and no device memory on CPU.
    assert parts["step"]["status"] == "ok", parts["step"]
    main = parts["step"]["runs"][0]["result"]
    assert main["compile_s"] > 0 and main["step_s"] > 0 and main["samples_per_s"] > 0
    assert main["startup_s"] > 0 and main["init_s"] > 0 and main["warmup_s"] > 0   # the run's other costs
    assert main["tflops_per_device"] > 0 and main["mfu"] is None and main["peak_tflops_per_device"] is None
    assert main["matmul"]["tflops"] > 0 and main["matmul"]["step_fraction"] > 0
    assert main["device_memory"] is None and "memory_stats" in main["device_memory_skipped"]
    assert main["param_dtypes"] == ["float32"] and main["per_device_batch"] == 8
    with tarfile.open(out / "profile.tar.gz") as tar:
        assert any(n.endswith(".xplane.pb") for n in tar.getnames())
    b = parts["step"].get("breakdown")   # benchmarks/profile_breakdown.py on that profile
    assert b and b["device_ms_per_step"] > 0 and b["top_fusions"], parts["step"].get("breakdown_error")
    assert any(m.startswith("jit_train_step") for m in b["modules"])

    # 2. Largest batch: needs a device memory limit.
    assert parts["max_batch"]["status"] == "skipped" and "memory_stats" in parts["max_batch"]["reason"]

    # 3. Levers: each its own process; cuDNN skipped on CPU; XLA flags reach the subprocess.
    lv = _runs(parts["levers"])
    assert lv["attention=cudnn"]["status"] == "skipped" and "CUDA" in lv["attention=cudnn"]["reason"]
    assert lv["remat=full"]["result"]["remat"] == "full" and lv["remat=full"]["result"]["step_s"] > 0
    flag_run = lv["xla:latency_hiding_scheduler"]
    assert flag_run["status"] == "ok", flag_run
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flag_run["result"]["xla_flags"]
    assert flag_run["command"].startswith("XLA_FLAGS=")

    # 4. Beside PyTorch (CPU, float32 here), when torch is installed.
    torch_run = parts["torch"]["runs"][1]
    if benchmark_gpu.torch_available() is None:
        assert torch_run["status"] == "ok", torch_run
        assert torch_run["result"]["samples_per_s_per_device"] > 0 and parts["torch"]["ratio"] > 0
    else:
        assert torch_run["status"] == "skipped"

    # 5. The trainer on real tar shards against data.source=random.
    e2e = _runs(parts["e2e"])
    assert e2e["tokenizer"]["status"] == "ok"
    assert e2e["trainer, data.source=random"]["result"]["samples_per_s"] > 0
    tar_run = e2e["trainer, tar shards, 1 workers"]
    assert tar_run["status"] == "ok", tar_run
    assert tar_run["result"]["samples_per_s"] > 0 and tar_run["result"]["vs_random"] > 0
    assert tar_run["result"]["data"]["data/skipped"] == 0

    # 6. Evaluation speed.
    enc, ranks = (x["result"] for x in parts["eval"]["runs"])   # each in its own process
    assert enc["encoder"]["images_per_s"] > 0 and enc["encoder"]["texts_per_s"] > 0 and "csd" not in enc
    assert ranks["csd"]["seconds"] > 0 and ranks["csd"]["device_memory"] is None and ranks["csd"]["gallery"] == 500
    assert "encoder" not in ranks

    md = (out / "results.md").read_text()
    for heading in ("## Train step", "## Largest per-device batch", "## Levers", "## Beside PyTorch",
                    "## End to end", "## Evaluation speed"):
        assert heading in md
    assert f"`python benchmarks/benchmark_step.py --config {benchmark_gpu.TINY_PLAN.config} --per-device-batch 8" in md


@pytest.mark.parametrize("bad", ["a", "0", "8,-1"])
def test_bad_worker_counts_are_refused_before_anything_runs(tmp_path, bad, capsys):
    with pytest.raises(SystemExit) as e:
        benchmark_gpu.main(["--out", str(tmp_path / "out"), "--parts", "e2e", "--workers", bad])
    assert e.value.code == 2 and "--workers" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
