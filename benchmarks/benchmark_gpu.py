r"""The GPU benchmark plan (issue 17 §1) in one command: OUT_DIR/results.json and results.md.

    benchmarks/benchmark_gpu.sh OUT_DIR [--parts step,torch] [--deadline 560]   # on the GPU machine
    python benchmarks/benchmark_gpu.py --out OUT_DIR [--parts ...] [--deadline S] [--tiny]
    python benchmarks/benchmark_gpu.py --merge A/results.json B/results.json --out OUT_DIR

Parts (all by default, in this order):
  step       benchmarks/benchmark_step.py on configs/prolip_b16_datacomp.py (bf16 compute, float32
             parameters) at a per-device batch of 256 and a sweep: compile time, step time,
             samples/s, TFLOP/s, MFU (989 TFLOP/s for an H100 SXM, prolip_jax/core/flops.py), peak
             device memory, the step's share of a plain 8192^3 bf16 matmul timed in the same
             process, and a jax.profiler trace of 3 steps (OUT_DIR/profile.tar.gz).
  max_batch  the largest per-device batch that runs, per remat policy (benchmark_step.py --max-batch).
  levers     the step with one lever changed per row: attention xla / cudnn, each remat policy,
             XLA GPU flags (latency-hiding scheduler, command buffers off, Triton GEMM off; each
             in its own process through XLA_FLAGS).
  torch      PyTorch's step of the same model and loss (benchmarks/torch_step.py: bf16 autocast,
             SDPA, torch.compile) at the same batch on the same GPU; the ratio to ours.
  e2e        the trainer (prolip_jax.train) on JPEG tar shards made here at the config's image
             size, for several data.num_workers, against the same trainer on data.source=random
             and against the step alone (part step).
  eval       benchmarks/benchmark_eval.py: encoder images/s and texts/s, blocked CSD ranks of 50k
             queries against a 1M gallery (time, device and host peak memory).

Every measurement is a subprocess with its own time limit; a failure, a timeout or a skip (what
needs CUDA, on another backend) is recorded with its reason, and the other parts go on.
--deadline S stops starting work S seconds after the start (the `run` tool allows 10 minutes a
command: split the plan with --parts over several calls and --merge their results.json here).
--tiny runs the same plan at test size (configs/tiny.py's micro towers, a few steps, a small gallery).

This file is the command line and the order of the parts; beside it: gpu_plan.py (the plan's
sizes and limits, the subprocess runner), gpu_parts.py (one function per part), gpu_report.py
(results.json, results.md, --merge).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its parts beside it, imported from anywhere
from gpu_parts import (levers, part_e2e, part_eval, part_levers, part_max_batch, part_step,  # noqa: E402
                       part_torch, torch_available, torch_step_figures)
from gpu_plan import GPU_PLAN, PARTS, REPO, TINY_PLAN, Plan, Runner  # noqa: E402
from gpu_report import merge, render, save  # noqa: E402

__all__ = ["GPU_PLAN", "PARTS", "TINY_PLAN", "Plan", "Runner", "merge", "render", "save", "torch_available",
           "run_plan", "environment", "main"]


def environment(r: Runner) -> dict:
    """Backend, devices and versions, from a subprocess (this process never touches a device)."""
    code = ("import json, platform, jax\n"
            "d = jax.devices()\n"
            "info = {'backend': jax.default_backend(), 'device_kind': d[0].device_kind, 'n_devices': len(d),\n"
            "        'jax': jax.__version__, 'python': platform.python_version()}\n"
            "try:\n    import torch; info['torch'] = torch.__version__\nexcept ImportError:\n    info['torch'] = None\n"
            "print('ENV' + json.dumps(info))\n")
    try:
        p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=r.env, capture_output=True, text=True,
                           timeout=180)
        line = next(x for x in p.stdout.splitlines() if x.startswith("ENV"))
        info = json.loads(line[3:])
    except (subprocess.TimeoutExpired, StopIteration, json.JSONDecodeError) as e:
        info = {"backend": None, "error": f"{type(e).__name__}: {e}"}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        info["nvidia_smi"] = smi.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    info.update(cpu_count=os.cpu_count(), xla_flags=r.env.get("XLA_FLAGS", ""),
                mem_fraction=r.env.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
                compilation_cache=r.env.get("JAX_COMPILATION_CACHE_DIR"))
    return info


# ------------------------------------------------------------------------------ the whole plan
def run_plan(plan: Plan, out: Path, parts: tuple[str, ...], deadline: float | None, argv: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"command": "python benchmarks/benchmark_gpu.py " + " ".join(map(shlex.quote, argv)),
                               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                               "plan": dataclasses.asdict(plan), "parts": {}}
    with tempfile.TemporaryDirectory(prefix="benchmark_gpu_") as tmp:
        r = Runner(out, Path(tmp), plan.timeout, deadline)
        results["environment"] = env = environment(r)
        save(out, results)
        for part in parts:
            t0 = time.monotonic()
            r.part_end = t0 + dict(plan.part_seconds).get(part, float("inf"))
            try:
                step_part = results["parts"].get("step")
                results["parts"][part] = {
                    "step": lambda: part_step(plan, r, env),
                    "max_batch": lambda: part_max_batch(plan, r, env),
                    "levers": lambda: part_levers(plan, r, env, step_part),
                    "torch": lambda: part_torch(plan, r, env, step_part),
                    "e2e": lambda: part_e2e(plan, r, env, step_part),
                    "eval": lambda: part_eval(plan, r, env),
                }[part]()
            except Exception as e:  # noqa: BLE001 - one part's bug must not lose the others
                results["parts"][part] = {"status": "failed", "error": f"{type(e).__name__}: {e}", "runs": []}
            results["parts"][part]["seconds"] = round(time.monotonic() - t0, 1)
            save(out, results)  # after every part: a run cut short keeps what it measured
        r.log.close()
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for results.json, results.md, log.txt, profile.tar.gz")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--deadline", type=float, default=None, help="seconds after which nothing new starts")
    p.add_argument("--tiny", action="store_true", help="the plan at test size (configs/tiny.py, size=micro)")
    p.add_argument("--timeout", type=int, default=None, help="seconds per subprocess (default: the plan's)")
    p.add_argument("--levers", default=None, help="comma-separated lever names (default: all; see XLA_LEVERS)")
    p.add_argument("--policies", default=None, help="comma-separated remat policies for max_batch (default: all)")
    p.add_argument("--workers", default=None, help="comma-separated data.num_workers for e2e (default: 4,8,16)")
    p.add_argument("--merge", nargs="+", default=None, metavar="RESULTS_JSON")
    # The PyTorch side (part torch) runs in its own process through these:
    p.add_argument("--torch-step-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--per-device-batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--torch-compile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torch_step_worker:
        result = torch_step_figures(args.config, args.per_device_batch, args.steps, args.torch_compile)
        print(json.dumps(result))
        Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    if not args.out:
        p.error("--out is required")
    out = Path(args.out)
    if args.merge:
        out.mkdir(parents=True, exist_ok=True)
        save(out, merge(args.merge))
        print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
        return 0
    parts = tuple(x for x in args.parts.split(",") if x)
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}")
    plan = TINY_PLAN if args.tiny else GPU_PLAN
    if args.timeout:
        plan = dataclasses.replace(plan, timeout=args.timeout)
    if args.levers:
        plan = dataclasses.replace(plan, levers=tuple(args.levers.split(",")))
    if args.policies:
        plan = dataclasses.replace(plan, remat_policies=tuple(args.policies.split(",")))
    if args.workers:
        try:
            workers = tuple(int(w) for w in args.workers.split(","))
        except ValueError:
            workers = ()
        if not workers or min(workers) < 1:
            p.error(f"--workers {args.workers!r}: comma-separated positive integers, e.g. 8,16")
        plan = dataclasses.replace(plan, workers=workers)
    try:
        levers(plan)  # an unknown lever name is an error now, not after an hour of measuring
    except ValueError as e:
        p.error(str(e))
    results = run_plan(plan, out, parts, args.deadline, argv)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}: "
          + ", ".join(f"{k} {v['status']}" for k, v in results["parts"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
