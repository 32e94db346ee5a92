"""The shipped GPU step, each speed lever alone and PyTorch, one process a row, on one GPU.

    python benchmarks/gpu_speed.py --out OUT [--deadline 520] [--only NAME ...] [--sizes 256 512] [--tiny]

Rows, most wanted first, at 256 samples per device: the step as shipped (`shipped`: the GPU's
platform defaults, no flags) from an empty compile cache and again with the cache present (the
cold and the warm first step after launch), the PyTorch step of the same model and loss
(`benchmarks/torch_step.py`, torch.compile), the shipped step plus each lever not yet on by
default, then every lever off (`no levers`) and each lever alone on top of that, and the levers
that helped alone together (`best levers`, when that is not the shipped set); the fastest JAX
row is profiled from the run's compile cache (`profile_breakdown.py` -> breakdown.txt); then the
shipped step and PyTorch at 512. Each JAX row is `benchmarks/benchmark_step.py` (train state,
compile, a warm-up step, `--steps` timed steps). Every process ends by `--deadline` (one that
would start in its last 15 s is recorded as not run) and `--only` picks rows by name for a
second call (`--only "no levers" flat_tokens fused_guard`). A JAX row is mostly its compile and
the PyTorch row mostly its torch.compile warm-up, so a 9-minute call holds about eight rows.

The rows run one after another because compiling every row at once first, side by side on the
host's cores, was far slower than the compiles one at a time and left the PyTorch warm-ups short
of GPU memory (docs/performance_history.md, "GPU (H100): the speed levers beside PyTorch").
Writes OUT/speed.json, OUT/speed.md, OUT/log.txt, OUT/breakdown.txt and OUT/profile.tar.gz.
`--tiny`: the same plan at test size on CPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from gpu_plan import REPO, Runner

from prolip_jax.runtime import xla_flags

# Each lever computes the same step (tests/test_speed_levers.py); what each removes:
# docs/performance.md, "Levers and defaults". Config levers: name -> (--set on, --set off).
CONFIG_LEVERS = {
    "flat_tokens": ("model.flat_tokens=true", "model.flat_tokens=false"),
    "fused_guard": ("step.finite_guard=fused", "step.finite_guard=per_leaf"),
    "cast_once": ("step.cast_params_once=true", "step.cast_params_once=false"),
    "ln_saved_stats": ("model.ln_saved_stats=true", "model.ln_saved_stats=false"),
    "pallas_kernels": ("model.pallas_kernels=true", "model.pallas_kernels=false"),
    # Not a GPU default: the same numbers, a 4x faster compile on the CPU (the cold first step's
    # target), a slower CPU step (docs/performance.md, "Scanned blocks").
    "scan_layers": ("model.scan_layers=true", "model.scan_layers=false"),
}
# XLA levers: name -> the flag of xla_flags.GPU_FLAGS (set alone with the project's flags off).
XLA_LEVERS = {"no_dot_merger": "xla_gpu_dot_merger_threshold_mb", "no_triton_gemm": "xla_gpu_enable_triton_gemm"}
LEVERS = (*CONFIG_LEVERS, *XLA_LEVERS)
# What a GPU run gets with no flags: the PLATFORM_DEFAULTS "gpu" entries of trainer.config.ModelOptions
# and core.step.StepOptions, and xla_flags.GPU_FLAGS (tests/test_gpu_speed.py checks they agree).
SHIPPED = ("flat_tokens", "fused_guard", "cast_once", "no_dot_merger", "no_triton_gemm")
PYTORCH = "PyTorch (torch.compile)"


def lever_row(name: str, batch: int, on: tuple[str, ...]) -> dict:
    """A row with exactly the levers `on`: every other config lever set off, the project's XLA
    flags off (xla_flags.OFF_ENV) but those of `on`."""
    sets = tuple(CONFIG_LEVERS[n][0 if n in on else 1] for n in CONFIG_LEVERS)
    xla = " ".join(f"--{XLA_LEVERS[n]}={xla_flags.GPU_FLAGS[XLA_LEVERS[n]]}" for n in XLA_LEVERS if n in on)
    return dict(name=name, batch=batch, sets=sets, xla=xla, env={xla_flags.OFF_ENV: "1"}, levers=on)


def shipped_row(batch: int, name: str = "shipped", plus: tuple[str, ...] = ()) -> dict:
    """The step as a GPU run gets it with no flags, plus config levers `plus`."""
    return dict(name=name, batch=batch, sets=tuple(CONFIG_LEVERS[n][0] for n in plus), xla="", env={},
                levers=SHIPPED + plus)


def variants(sizes: tuple[int, ...]) -> list[dict]:
    """The JAX rows in the order they are timed (most wanted first, in case time runs out)."""
    first, *others = sizes
    rows = [shipped_row(first), shipped_row(first, "shipped, warm cache")]
    rows += [shipped_row(first, f"shipped + {n}", (n,)) for n in CONFIG_LEVERS if n not in SHIPPED]
    rows += [lever_row("no levers", first, ())] + [lever_row(n, first, (n,)) for n in LEVERS]
    rows += [shipped_row(b) for b in others]
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


def best_row(timed: list[dict], batch: int, margin: float = 0.01) -> dict | None:
    """The levers that were more than `margin` faster alone than `no levers` at `batch`, as one
    row ("best levers"); None when none was, no `no levers` row ran, or they are the shipped set."""
    sps = {t["variant"]: t["result"]["samples_per_s_per_device"] for t in timed
           if t["status"] == "ok" and t["per_device_batch"] == batch and t.get("result")}
    if "no levers" not in sps:
        return None
    helped = tuple(name for name in LEVERS if sps.get(name, 0) > (1 + margin) * sps["no levers"])
    if not helped or set(helped) == set(SHIPPED):
        return None
    return lever_row("best levers", batch, helped)


def label(row: dict) -> str:
    return f"{row['name']} @{row['batch']}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--deadline", type=float, default=520, help="seconds after which nothing new starts")
    p.add_argument("--tiny", action="store_true", help="the plan at test size on CPU")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sizes", type=int, nargs="+", default=[256, 512], metavar="PER_DEVICE_BATCH",
                   help="per-device batches, the first one's rows (and profile) first")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME",
                   help="rows to run by name: shipped, \"no levers\", PyTorch, a lever's name, ... (every size)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    config = "configs/tiny.py:data=random" if args.tiny else "configs/prolip_b16_datacomp.py"
    sizes = (8,) if args.tiny else tuple(args.sizes)
    steps = 1 if args.tiny else args.steps
    tmp = Path(tempfile.mkdtemp(prefix="gpu_speed_"))
    r = Runner(out, tmp, timeout=600 if args.tiny else 300, deadline=args.deadline)
    # The profile's process loads the fastest row's compiled step instead of compiling it again.
    r.env.update(JAX_COMPILATION_CACHE_DIR=str(tmp / "jax_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
                 TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"))
    rows = variants(sizes)
    results: dict = {"config": config, "steps": steps, "shipped": list(SHIPPED),
                     "levers": {**{k: {"set": v[0]} for k, v in CONFIG_LEVERS.items()},
                                **{k: {"xla_flags": f"--{v}={xla_flags.GPU_FLAGS[v]}"} for k, v in XLA_LEVERS.items()}}}

    # ---- every row, one at a time -------------------------------------------------------------
    timed = []
    order = [("jax", row) for row in rows[:2]] + [("torch", sizes[0])] + [("jax", row) for row in rows[2:]]
    order += [("torch", b) for b in sizes[1:]]
    if args.only:
        names = {n.lower() for n in args.only}
        known = {row["name"].lower() for row in rows} | {"pytorch"}
        if names - known:
            p.error(f"--only: unknown row(s) {sorted(names - known)}; choose from {sorted(known)}")
        order = [(k, w) for k, w in order if (w["name"].lower() if k == "jax" else "pytorch") in names]
    last_lever = max((k for k, (kind, w) in enumerate(order) if kind == "jax" and w["name"] in LEVERS), default=None)
    first_size_done = max((k for k, (kind, w) in enumerate(order)
                           if (w["batch"] if kind == "jax" else w) == sizes[0]), default=-1)
    i = 0
    while i < len(order):
        kind, what = order[i]
        j = tmp / f"t{i}.json"
        if kind == "jax":
            rec = r.run(label(what), step_argv(config, what, steps, j), j, xla_flags=what["xla"], env=what["env"])
            rec.update(variant=what["name"], per_device_batch=what["batch"], levers=list(what["levers"]))
        else:
            rec = r.run(f"PyTorch @{what}", torch_argv(config, what, steps, not args.tiny, j), j)
            rec.update(variant=PYTORCH, per_device_batch=what)
        timed.append(rec)
        results["timed"] = timed
        write(out, results)
        if i == last_lever:  # every lever measured alone: the ones that helped, together
            best = best_row(timed, sizes[0])
            if best is not None:
                order.insert(i + 1, ("jax", best))
                rows.append(best)
                first_size_done += 1
        if i == first_size_done:  # the first size's rows done: its fastest profiled before the next size
            profile(r, config, rows, timed, sizes[0], out, results)
        i += 1
    write(out, results)
    print(f"results: {out / 'speed.md'}")


def profile(r: Runner, config: str, rows: list[dict], timed: list[dict], size: int, out: Path,
            results: dict) -> None:
    """The fastest JAX row at `size`, profiled: its compiled step comes from the run's compile cache."""
    ok = [t for t in timed if t["status"] == "ok" and t["variant"] != PYTORCH
          and t["per_device_batch"] == size]
    if not ok:
        return
    best = max(ok, key=lambda t: t["result"]["samples_per_s_per_device"])
    row = next(x for x in rows if label(x) == best["name"])
    prof, j = r.tmp / "profile", r.tmp / "profile.json"
    rec = r.run(f"profile: {best['name']}", step_argv(config, row, 2, j, "--profile", str(prof),
                                                      "--profile-steps", "3"), j, xla_flags=row["xla"], env=row["env"])
    results["profile"] = {"variant": best["name"], **rec}
    if rec["status"] == "ok" and prof.exists():
        with tarfile.open(out / "profile.tar.gz", "w:gz") as tar:
            tar.add(prof, arcname="profile")
        done = subprocess.run([sys.executable, "benchmarks/profile_breakdown.py", str(prof), "--steps", "3"],
                              cwd=REPO, env=r.env, capture_output=True, text=True, timeout=max(10, r.left()))
        (out / "breakdown.txt").write_text(done.stdout + done.stderr[-3000:])
    write(out, results)


def write(out: Path, results: dict) -> None:
    (out / "speed.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "speed.md").write_text(report(results))


def report(results: dict) -> str:
    """The table of docs/performance.md: one row per timed process, ratios to the shipped step
    and to PyTorch at the same per-device batch."""
    timed = results.get("timed", [])
    ref = {}
    for t in timed:
        if t["status"] == "ok" and t["variant"] in ("shipped", PYTORCH):
            ref[(t["variant"], t["per_device_batch"])] = t["result"]["samples_per_s_per_device"]
    lines = [f"config `{results['config']}`, {results['steps']} timed steps, every row a process of its own, "
             "one after another on the same GPU", "",
             "| step | per-device batch | samples/s per device | MFU | vs shipped | vs PyTorch | step (ms) | "
             "compile (s) | train state (s) | first step after launch (s) | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in timed:
        res, b = t.get("result") or {}, t["per_device_batch"]
        sps = res.get("samples_per_s_per_device")
        fmt = lambda x, f: "—" if x is None else f.format(x)  # noqa: E731
        base, torch_ = ref.get(("shipped", b)), ref.get((PYTORCH, b))
        lines.append(" | ".join([
            f"| {t['variant']}", str(b), fmt(sps, "{:.0f}"), fmt(res.get("mfu") and 100 * res["mfu"], "{:.1f}%"),
            fmt(sps and base and sps / base, "{:.3f}x"), fmt(sps and torch_ and sps / torch_, "{:.3f}x"),
            fmt(res.get("step_s") and 1e3 * res["step_s"], "{:.1f}"), fmt(res.get("compile_s", res.get("warmup_s")), "{:.0f}"),
            fmt(res.get("init_s"), "{:.1f}"), fmt(res.get("first_step_s"), "{:.0f}"), t["status"] + " |"]))
    lines += ["", "Commands (PyTorch's compile column: its warm-up steps, torch.compile included):", ""]
    lines += [f"- {t['name']}: `{t['command']}`" for t in timed]
    if "profile" in results:
        lines += ["", f"Profile: {results['profile']['variant']} (`profile.tar.gz`, `breakdown.txt`)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
