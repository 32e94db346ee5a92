"""The speed levers beside PyTorch on one GPU, in one command that fits a lent machine's call.

    python benchmarks/gpu_speed.py --out OUT [--deadline 520] [--tiny]

Every JAX variant is `benchmarks/benchmark_step.py` in a process of its own: the baseline (the
config as shipped), each lever of LEVERS alone, and all of them together, at 256 samples per
device; the baseline and all levers at 512 as well; the PyTorch step of the same model and loss
(`benchmarks/torch_step.py`, torch.compile) at both sizes. A B/16 compile takes about a minute on
the GPU, too long to run a dozen one after another in ten minutes, so the command works in two
phases sharing one persistent compile cache (and XLA's per-fusion GEMM autotuning cache in it):

1. compile: every variant at once with `--compile-only` (and the PyTorch step warmed for one
   step, filling torch's own compile cache), each process on its share of the 16 CPU cores;
2. time: each variant again, one after another alone on the GPU, loading its compiled step from
   the cache: `--steps` timed steps after a warm-up one. Then a profile of the fastest variant
   at 256 (`profile_breakdown.py` -> breakdown.txt).

Caveat, recorded in the results: in phase 1 the variants autotune their GEMMs while sharing the
GPU, so a kernel choice can be a little worse than one tuned alone; every variant, the baseline
included, is built that way. Writes OUT/speed.json, OUT/speed.md, OUT/log.txt, OUT/breakdown.txt
and OUT/profile.tar.gz. `--tiny`: the same plan at test size on CPU (tests/test_gpu_speed.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from gpu_plan import REPO, Runner

# name -> (benchmark_step --set overrides, extra XLA_FLAGS). Each lever computes the same step
# (tests/test_speed_levers.py); the XLA flag stops XLA merging the full and the masked forward's
# dots that share a weight by concatenating their activations (docs/gpu_results/2026-11-24-h100).
LEVERS = {
    "no_dot_merger": ((), "--xla_gpu_dot_merger_threshold_mb=0"),
    "flat_tokens": (("model.flat_tokens=true",), ""),
    "fused_guard": (("step.finite_guard=fused",), ""),
    "cast_once": (("step.cast_params_once=true",), ""),
}


def variants(sizes: tuple[int, ...]) -> list[dict]:
    """The JAX rows in the order phase 2 times them (most wanted first, in case time runs out)."""
    all_sets = tuple(s for sets, _ in LEVERS.values() for s in sets)
    all_flags = " ".join(f for _, f in LEVERS.values() if f)
    first, *others = sizes
    rows = [dict(name="baseline", batch=first, sets=(), xla=""),
            dict(name="all levers", batch=first, sets=all_sets, xla=all_flags)]
    rows += [dict(name=name, batch=first, sets=sets, xla=xla) for name, (sets, xla) in LEVERS.items()]
    for b in others:
        rows += [dict(name="baseline", batch=b, sets=(), xla=""),
                 dict(name="all levers", batch=b, sets=all_sets, xla=all_flags)]
    return rows


def step_argv(config: str, row: dict, steps: int, json_path: Path, *extra: str) -> list[str]:
    argv = [sys.executable, "benchmarks/benchmark_step.py", "--config", config,
            "--per-device-batch", str(row["batch"]), "--steps", str(steps), "--json", str(json_path)]
    for s in row["sets"]:
        argv += ["--set", s]
    return argv + list(extra)


def torch_argv(config: str, batch: int, steps: int, compile_: bool, json_path: Path) -> list[str]:
    return [sys.executable, "benchmarks/benchmark_gpu.py", "--torch-step-worker", "--config", config,
            "--per-device-batch", str(batch), "--steps", str(steps), *(["--torch-compile"] if compile_ else []),
            "--json", str(json_path)]


def run_parallel(jobs: list[tuple[str, list[str], str, Path]], env: dict, out: Path, limit: float) -> list[dict]:
    """Starts every (name, argv, xla_flags, json) at once; waits at most `limit` seconds in all."""
    procs, t0 = [], time.monotonic()
    for name, argv, xla, json_path in jobs:
        e = dict(env)
        if xla:
            e["XLA_FLAGS"] = " ".join(f for f in (e.get("XLA_FLAGS", ""), xla) if f)
        log = open(out / f"compile_{len(procs)}.log", "w")
        procs.append((name, subprocess.Popen(argv, cwd=REPO, env=e, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True), log, json_path))
    records = []
    for name, proc, log, json_path in procs:
        try:
            rc = proc.wait(timeout=max(1.0, limit - (time.monotonic() - t0)))
            status = "ok" if rc == 0 else f"failed (exit status {rc})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            status = "timeout"
        log.close()
        result = json.loads(json_path.read_text()) if json_path.exists() else {}
        records.append({"name": name, "status": status, "seconds": round(time.monotonic() - t0, 1),
                        "result": result})
        print(f"[compile] {name}: {status} ({records[-1]['seconds']} s)", flush=True)
    with open(out / "log.txt", "a") as all_log:  # the phase's logs, one after another
        for i, (name, *_rest) in enumerate(procs):
            all_log.write(f"\n===== compile phase: {name}\n{(out / f'compile_{i}.log').read_text(errors='replace')}")
            (out / f"compile_{i}.log").unlink()
    return records


def label(row: dict) -> str:
    return f"{row['name']} @{row['batch']}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--deadline", type=float, default=520, help="seconds after which nothing new starts")
    p.add_argument("--tiny", action="store_true", help="the plan at test size on CPU")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = "configs/tiny.py:data=random" if args.tiny else "configs/prolip_b16_datacomp.py"
    sizes = (8,) if args.tiny else (256, 512)
    steps = 1 if args.tiny else args.steps
    tmp = Path(tempfile.mkdtemp(prefix="gpu_speed_"))
    r = Runner(out, tmp, timeout=600 if args.tiny else 300, deadline=args.deadline)
    cache = tmp / "jax_cache"
    r.env.update(JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                 TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"))
    rows = variants(sizes)
    results: dict = {"config": config, "steps": steps, "levers": {k: {"set": list(v[0]), "xla_flags": v[1]}
                                                                  for k, v in LEVERS.items()},
                     "caveat": "phase 1 compiles (and autotunes) every variant at once on the shared GPU"}

    # ---- phase 1: every compile at once --------------------------------------------------
    env1 = dict(r.env, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # many processes share the GPU's memory
    env1.pop("XLA_PYTHON_CLIENT_MEM_FRACTION", None)
    jobs = [(label(row), step_argv(config, row, 1, tmp / f"c{i}.json", "--compile-only"), row["xla"],
             tmp / f"c{i}.json") for i, row in enumerate(rows)]
    jobs += [(f"PyTorch @{b}", torch_argv(config, b, 1, not args.tiny, tmp / f"tc{b}.json"), "",
              tmp / f"tc{b}.json") for b in sizes]
    t0 = time.monotonic()
    results["compile"] = run_parallel(jobs, env1, out, limit=min(r.left() - 60, 600 if args.tiny else 270))
    results["compile_phase_s"] = round(time.monotonic() - t0, 1)

    # ---- phase 2: timed, one at a time ------------------------------------------------------
    timed = []
    order = [("jax", row) for row in rows[:2]] + [("torch", sizes[0])] + [("jax", row) for row in rows[2:]]
    order += [("torch", b) for b in sizes[1:]]
    for i, (kind, what) in enumerate(order):
        j = tmp / f"t{i}.json"
        if kind == "jax":
            rec = r.run(label(what), step_argv(config, what, steps, j), j, xla_flags=what["xla"])
            rec.update(variant=what["name"], per_device_batch=what["batch"])
        else:
            rec = r.run(f"PyTorch @{what}", torch_argv(config, what, steps, not args.tiny, j), j)
            rec.update(variant="PyTorch (torch.compile)", per_device_batch=what)
        timed.append(rec)
        results["timed"] = timed
        write(out, results)

    # ---- the fastest JAX variant at the first size, profiled -----------------------------------
    ok = [t for t in timed if t["status"] == "ok" and t["variant"] != "PyTorch (torch.compile)"
          and t["per_device_batch"] == sizes[0]]
    if ok:
        best = max(ok, key=lambda t: t["result"]["samples_per_s_per_device"])
        row = next(x for x in rows if label(x) == best["name"])
        prof, j = tmp / "profile", tmp / "profile.json"
        rec = r.run(f"profile: {best['name']}", step_argv(config, row, 2, j, "--profile", str(prof),
                                                          "--profile-steps", "3"), j, xla_flags=row["xla"])
        results["profile"] = {"variant": best["name"], **rec}
        if rec["status"] == "ok" and prof.exists():
            with tarfile.open(out / "profile.tar.gz", "w:gz") as tar:
                tar.add(prof, arcname="profile")
            done = subprocess.run([sys.executable, "benchmarks/profile_breakdown.py", str(prof), "--steps", "3"],
                                  cwd=REPO, env=r.env, capture_output=True, text=True, timeout=max(10, r.left()))
            (out / "breakdown.txt").write_text(done.stdout + done.stderr[-3000:])
    write(out, results)
    print(f"results: {out / 'speed.md'}")


def write(out: Path, results: dict) -> None:
    (out / "speed.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "speed.md").write_text(report(results))


def report(results: dict) -> str:
    """The table of docs/performance.md: one row per timed process, ratios to the baseline and to
    PyTorch at the same per-device batch."""
    timed = results.get("timed", [])
    ref = {}
    for t in timed:
        if t["status"] == "ok" and t["variant"] in ("baseline", "PyTorch (torch.compile)"):
            ref[(t["variant"], t["per_device_batch"])] = t["result"]["samples_per_s_per_device"]
    compile_s = {c["name"]: c["result"].get("compile_s") for c in results.get("compile", []) if c["result"]}
    lines = [f"config `{results['config']}`, {results['steps']} timed steps; compile phase "
             f"{results.get('compile_phase_s')} s ({results['caveat']})", "",
             "| step | per-device batch | samples/s per device | MFU | vs baseline | vs PyTorch | step (ms) | "
             "compile (s) | train state (s) | status |", "|---|---|---|---|---|---|---|---|---|---|"]
    for t in timed:
        res, b = t.get("result") or {}, t["per_device_batch"]
        sps = res.get("samples_per_s_per_device")
        fmt = lambda x, f: "—" if x is None else f.format(x)  # noqa: E731
        base, torch_ = ref.get(("baseline", b)), ref.get(("PyTorch (torch.compile)", b))
        lines.append(" | ".join([
            f"| {t['variant']}", str(b), fmt(sps, "{:.0f}"), fmt(res.get("mfu") and 100 * res["mfu"], "{:.1f}%"),
            fmt(sps and base and sps / base, "{:.3f}x"), fmt(sps and torch_ and sps / torch_, "{:.3f}x"),
            fmt(res.get("step_s") and 1e3 * res["step_s"], "{:.1f}"), fmt(compile_s.get(t["name"]), "{:.0f}"),
            fmt(res.get("init_s"), "{:.1f}"), t["status"] + " |"]))
    lines += ["", "Commands (phase 2; phase 1 ran each with `--compile-only`, all at once):", ""]
    lines += [f"- {t['name']}: `{t['command']}`" for t in timed]
    if "profile" in results:
        lines += ["", f"Profile: {results['profile']['variant']} (`profile.tar.gz`, `breakdown.txt`)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
