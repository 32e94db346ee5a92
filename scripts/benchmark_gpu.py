r"""The GPU benchmark plan (issue 17 §1) in one command: OUT_DIR/results.json and results.md.

    scripts/benchmark_gpu.sh OUT_DIR [--parts step,torch] [--deadline 560]   # on the GPU machine
    python scripts/benchmark_gpu.py --out OUT_DIR [--parts ...] [--deadline S] [--tiny]
    python scripts/benchmark_gpu.py --merge A/results.json B/results.json --out OUT_DIR

Parts (all by default, in this order):
  step       scripts/benchmark_step.py on configs/prolip_b16_datacomp.py (bf16 compute, float32
             parameters) at a per-device batch of 256 and a sweep: compile time, step time,
             samples/s, TFLOP/s, MFU (989 TFLOP/s for an H100 SXM, prolip_jax/flops.py), peak
             device memory, the step's share of a plain 8192^3 bf16 matmul timed in the same
             process, and a jax.profiler trace of 3 steps (OUT_DIR/profile.tar.gz).
  max_batch  the largest per-device batch that runs, per remat policy (benchmark_step.py --max-batch).
  levers     the step with one lever changed per row: attention xla / cudnn, each remat policy,
             XLA GPU flags (latency-hiding scheduler, command buffers off, Triton GEMM off; each
             in its own process through XLA_FLAGS).
  torch      PyTorch's step of the same model and loss (scripts/torch_step.py: bf16 autocast,
             SDPA, torch.compile) at the same batch on the same GPU; the ratio to ours.
  e2e        the trainer (prolip_jax.train) on JPEG tar shards made here at the config's image
             size, for several data.num_workers, against the same trainer on data.source=random
             and against the step alone (part step).
  eval       scripts/benchmark_eval.py: encoder images/s and texts/s, blocked CSD ranks of 50k
             queries against a 1M gallery (time, device and host peak memory).

Every measurement is a subprocess with its own time limit; a failure, a timeout or a skip (what
needs CUDA, on another backend) is recorded with its reason, and the other parts go on.
--deadline S stops starting work S seconds after the start (the `run` tool allows 10 minutes a
command: split the plan with --parts over several calls and --merge their results.json here).
--tiny runs the same plan at test size (configs/tiny.py, a few steps, a small gallery).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARTS = ("step", "max_batch", "levers", "torch", "e2e", "eval")
# One lever per row: config overrides (--set) or XLA flags, each against the part-1 baseline.
XLA_LEVERS = {
    "xla:latency_hiding_scheduler": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "xla:no_command_buffers": "--xla_gpu_enable_command_buffer=",
    "xla:no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
    # The 2026-11-24 H100 profile: XLA merges the full and masked image forward's dots that share
    # a weight by concatenating their activations (a [55456, 3072] copy per MLP, ~8 ms a step).
    "xla:no_dot_merger": "--xla_gpu_dot_merger_threshold_mb=0",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    config: str = "configs/prolip_b16_datacomp.py"
    per_device_batch: int = 256
    sweep: tuple[int, ...] = (128, 512)
    steps: int = 20
    matmul_size: int = 8192
    profile_steps: int = 3
    max_batch_step: int = 32
    max_batch_cap: int = 8192
    max_batch_timeout: int = 270  # per policy: two policies fit in one 10-minute call
    remat_policies: tuple[str, ...] = ()  # () = every model.remat choice
    levers: tuple[str, ...] = ()  # () = every lever
    torch_steps: int = 20
    torch_compile: bool = True
    shards: int = 16
    per_shard: int = 256
    jpeg_size: tuple[int, int] = (400, 300)  # web-photo-like, cropped to the config's size
    workers: tuple[int, ...] = (4, 8, 16)
    log_steps: int = 10
    windows: int = 3  # timed log windows after the first one (which holds the compile)
    eval_args: tuple[str, ...] = ("--images", "8192", "--texts", "32768", "--batch", "1024",
                                  "--queries", "50000", "--gallery", "1000000", "--block", "1024")
    timeout: int = 480  # seconds per subprocess
    # Seconds per part (its subprocesses start only while its time lasts), besides --deadline.
    part_seconds: tuple[tuple[str, int], ...] = (("step", 900), ("max_batch", 1200), ("levers", 1200),
                                                 ("torch", 600), ("e2e", 900), ("eval", 600))


GPU_PLAN = Plan()
TINY_PLAN = Plan(config="configs/tiny.py:data=random", per_device_batch=8, sweep=(), steps=1, matmul_size=128,
                 profile_steps=1, levers=("attention=cudnn", "remat=full", "xla:latency_hiding_scheduler"),
                 torch_steps=1, torch_compile=False, shards=2, per_shard=16, jpeg_size=(64, 48), workers=(1,),
                 log_steps=1, windows=2, eval_args=("--images", "16", "--texts", "32", "--batch", "16",
                                                    "--queries", "64", "--gallery", "500", "--block", "32"),
                 timeout=600, max_batch_timeout=600, part_seconds=())  # CPU compiles: the subprocess limit only


# ------------------------------------------------------------------------------ running things
class Runner:
    """Runs subprocesses under the plan's limits and the deadline; appends their output to log.txt."""

    def __init__(self, out: Path, tmp: Path, timeout: int, deadline: float | None):
        self.out, self.tmp, self.timeout = out, tmp, timeout
        self.start, self.deadline = time.monotonic(), deadline
        self.part_end: float | None = None  # monotonic time at which the current part's time is up
        self.log = open(out / "log.txt", "a")
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH")) if p)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        # The largest-batch search and the big gallery want the device's memory, not JAX's
        # default 75% of it; recorded in results.json.
        self.env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

    def left(self) -> float:
        now = time.monotonic()
        plan_left = float("inf") if self.deadline is None else self.deadline - (now - self.start)
        return min(plan_left, float("inf") if self.part_end is None else self.part_end - now)

    def run(self, name: str, argv: list[str], json_out: Path | None = None, xla_flags: str = "",
            timeout: int | None = None) -> dict[str, Any]:
        """{"name", "command", "status": ok | failed | timeout | not run, "seconds", "result"
        (the JSON the command wrote, even a partial one), "error"}."""
        env = dict(self.env)
        if xla_flags:  # added to whatever XLA_FLAGS the caller has (e.g. fake CPU devices)
            env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), xla_flags) if f)
        record: dict[str, Any] = {"name": name, "command": self.display(argv, xla_flags)}
        if self.left() < 15:  # nothing worth starting in the last seconds before the deadline
            return {**record, "status": "not run", "error": "the part's time or the --deadline was used up"}
        limit = min(timeout or self.timeout, self.left() - 5)
        self.log.write(f"\n===== {name}: {record['command']}\n")
        self.log.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: a timeout ends its workers too
        try:
            rc = proc.wait(timeout=limit)
            record["status"] = "ok" if rc == 0 else "failed"
            if rc:
                record["error"] = f"exit status {rc}: {self.tail()}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            record.update(status="timeout", error=f"stopped after {limit:.0f} s")
        record["seconds"] = round(time.monotonic() - t0, 1)
        if json_out is not None and json_out.exists():
            try:
                record["result"] = json.loads(json_out.read_text())
            except json.JSONDecodeError as e:
                record.update(status="failed", error=f"{json_out.name}: {e}")
        elif record["status"] == "ok" and json_out is not None:
            record.update(status="failed", error="the command wrote no results")
        print(f"[{time.monotonic() - self.start:6.0f} s] {name}: {record['status']} ({record['seconds']} s)"
              + (f" - {record['error'][-300:]}" if record.get("error") else ""), flush=True)
        return record

    def tail(self, lines: int = 6) -> str:
        """The last lines of log.txt: the failed command's own last words."""
        self.log.flush()
        text = (self.out / "log.txt").read_text(errors="replace").splitlines()
        return " | ".join(line.strip() for line in text[-lines:] if line.strip())[-1500:]

    def display(self, argv: list[str], xla_flags: str = "") -> str:
        """The command as a reader re-runs it: `python`, paths relative to the repository, no
        temporary output files."""
        words, skip = [], False
        for a in argv:
            if skip:
                skip = False
                continue
            if a == "--json":
                skip = True
                continue
            a = "python" if a == sys.executable else a.replace(str(self.tmp), "$TMP").replace(str(REPO) + "/", "")
            words.append(a)
        prefix = f"XLA_FLAGS={shlex.quote(xla_flags)} " if xla_flags else ""
        # $TMP (this run's temporary folder) stays expandable: double quotes, no globbing.
        return prefix + " ".join(f'"{w}"' if "$TMP" in w else shlex.quote(w) for w in words)


def part_status(runs: list[dict]) -> str:
    done = [r["status"] for r in runs if r["status"] != "skipped"]
    if not done:
        return "skipped"
    if all(s == "ok" for s in done):
        return "ok"
    return "partial" if "ok" in done else "failed"


def skipped(name: str, reason: str, command: str = "") -> dict:
    return {"name": name, "command": command, "status": "skipped", "reason": reason}


# ------------------------------------------------------------------------------------ the parts
def step_args(plan: Plan, per_device_batch: int, *extra: str) -> list[str]:
    return [sys.executable, "scripts/benchmark_step.py", "--config", plan.config,
            "--per-device-batch", str(per_device_batch), "--steps", str(plan.steps), *extra]


def part_step(plan: Plan, r: Runner, env: dict) -> dict:
    profile = r.tmp / "profile"
    j = r.tmp / "step_main.json"
    main = r.run(f"step, per-device batch {plan.per_device_batch}", step_args(
        plan, plan.per_device_batch, "--matmul-reference", "--matmul-size", str(plan.matmul_size),
        "--profile", str(profile), "--profile-steps", str(plan.profile_steps), "--json", str(j)), j)
    runs = [main]
    for b in plan.sweep:
        j = r.tmp / f"step_{b}.json"
        runs.append(r.run(f"step, per-device batch {b}", step_args(plan, b, "--json", str(j)), j))
    out = {"status": part_status(runs), "runs": runs}
    if profile.exists():  # the run tool brings back files at most two folders down: one archive
        with tarfile.open(r.out / "profile.tar.gz", "w:gz") as tar:
            tar.add(profile, arcname="profile")
        out["profile"] = "profile.tar.gz"
        try:  # where the device time goes, by kernel class and JAX op (scripts/profile_breakdown.py)
            sys.path.insert(0, str(REPO / "scripts"))
            from profile_breakdown import breakdown

            out["breakdown"] = breakdown(profile, plan.profile_steps, top=15)
        except Exception as e:  # noqa: BLE001 - a side table; the step's figures stand without it
            out["breakdown_error"] = f"{type(e).__name__}: {e}"
    return out


def remat_policies(plan: Plan) -> tuple[str, ...]:
    if plan.remat_policies:
        return plan.remat_policies
    from prolip_jax.models.transformer import REMAT_POLICIES

    return tuple(REMAT_POLICIES)


def part_max_batch(plan: Plan, r: Runner, env: dict) -> dict:
    if env.get("backend") not in ("gpu", "cuda", "rocm", "tpu"):
        reason = (f"no device memory limit on backend {env.get('backend')!r} (memory_stats() is None); "
                  "`benchmark_step.py --max-batch --memory-limit-bytes N` tests the search there")
        return {"status": "skipped", "reason": reason,
                "runs": [skipped(f"remat={p}", reason) for p in remat_policies(plan)]}
    runs = []
    for policy in remat_policies(plan):
        j = r.tmp / f"max_batch_{policy}.json"
        runs.append(r.run(f"largest batch, remat={policy}", step_args(
            plan, plan.per_device_batch, "--set", f"model.remat={policy}", "--max-batch",
            "--max-batch-step", str(plan.max_batch_step), "--max-batch-cap", str(plan.max_batch_cap),
            "--json", str(j)), j, timeout=plan.max_batch_timeout))
    return {"status": part_status(runs), "runs": runs}


def levers(plan: Plan) -> dict[str, dict[str, str]]:
    """name -> {"set": config override} or {"xla_flags": ...}: the rows of the lever table."""
    table = {f"attention={a}": {"set": f"model.attention_impl={a}"} for a in ("xla", "cudnn")}
    table.update({f"remat={p}": {"set": f"model.remat={p}"} for p in remat_policies(plan) if p != "none"})
    table.update({name: {"xla_flags": flags} for name, flags in XLA_LEVERS.items()})
    if plan.levers:
        unknown = set(plan.levers) - set(table)
        if unknown:
            raise ValueError(f"unknown levers {sorted(unknown)}; known: {sorted(table)}")
        table = {k: table[k] for k in plan.levers}
    return table


def part_levers(plan: Plan, r: Runner, env: dict, step_part: dict | None) -> dict:
    base = next((x for x in (step_part or {}).get("runs", [])[:1] if x["status"] == "ok"), None)
    if base is None:
        j = r.tmp / "lever_baseline.json"
        base = r.run("baseline", step_args(plan, plan.per_device_batch, "--json", str(j)), j)
    else:
        base = {**base, "name": "baseline (part step)"}
    runs = [base]
    for name, lever in levers(plan).items():
        extra = ["--set", lever["set"]] if "set" in lever else []
        argv = step_args(plan, plan.per_device_batch, *extra)
        if lever.get("set") == "model.attention_impl=cudnn" and env.get("backend") != "gpu":
            runs.append(skipped(name, f"cuDNN attention needs a CUDA GPU (backend {env.get('backend')!r})",
                                r.display(argv)))
            continue
        j = r.tmp / f"lever_{len(runs)}.json"
        runs.append(r.run(name, argv + ["--json", str(j)], j, xla_flags=lever.get("xla_flags", "")))
    return {"status": part_status(runs), "runs": runs}


def torch_available() -> str | None:
    """Why the PyTorch side cannot run, or None."""
    if not (REPO / "scripts" / "torch_step.py").exists():
        return "scripts/torch_step.py (the PyTorch step) is not in this tree"
    try:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            return "PyTorch is not installed"
    except ImportError:
        return "PyTorch is not installed"
    return None


def part_torch(plan: Plan, r: Runner, env: dict, step_part: dict | None) -> dict:
    jax_run = next((x for x in (step_part or {}).get("runs", [])[:1] if x["status"] == "ok"), None)
    if jax_run is None:
        j = r.tmp / "torch_jax_side.json"
        jax_run = r.run("prolip_jax step", step_args(plan, plan.per_device_batch, "--json", str(j)), j)
    else:
        jax_run = {**jax_run, "name": "prolip_jax step (part step)"}
    why = torch_available()
    j = r.tmp / "torch_step.json"
    argv = [sys.executable, "scripts/benchmark_gpu.py", "--torch-step-worker", "--config", plan.config,
            "--per-device-batch", str(plan.per_device_batch), "--steps", str(plan.torch_steps),
            *(["--torch-compile"] if plan.torch_compile else []), "--json", str(j)]
    torch_run = skipped("PyTorch step", why, r.display(argv)) if why else r.run("PyTorch step", argv, j)
    out = {"status": part_status([jax_run, torch_run]), "runs": [jax_run, torch_run]}
    if jax_run["status"] == torch_run["status"] == "ok":
        out["ratio"] = (jax_run["result"]["samples_per_s_per_device"]
                        / torch_run["result"]["samples_per_s_per_device"])
    return out


def torch_step_figures(config_spec: str, per_device_batch: int, steps: int, compile_: bool) -> dict:
    """The PyTorch side of part `torch`, in its own process: scripts/torch_step.py's
    `TorchTrainStep` (the same model and loss; bf16 autocast where our step computes in bf16 on
    CUDA) timed over `steps` updates after min(3, steps) warm-up ones (torch.compile happens there)."""
    import torch

    sys.path.insert(0, str(REPO / "scripts"))
    from benchmark_step import load_config
    from torch_step import TorchTrainStep

    from prolip_jax import flops as flops_lib
    from prolip_jax import step as step_lib
    from prolip_jax.train import model_config, step_config

    config = load_config(config_spec)
    mcfg, scfg = model_config(config), step_config(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    autocast = torch.bfloat16 if device == "cuda" and config.model.dtype == "bfloat16" else None
    b, s, length = per_device_batch, mcfg.vision.image_size, mcfg.text.context_length
    step = TorchTrainStep(mcfg, scfg.loss_config, scfg.masking, config.optim.to_dict(), config.total_steps, b,
                          device=device, autocast=autocast, compile=compile_)
    images = torch.randn(b, 3, s, s, device=device)
    tokens = torch.randint(2, mcfg.text.vocab_size, (b, length), device=device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    t0 = time.perf_counter()
    for _ in range(min(3, steps)):
        loss = step(images, tokens)
    sync()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step(images, tokens)
    sync()
    step_s = (time.perf_counter() - t0) / steps
    flops = flops_lib.train_step_flops(mcfg, b, image_keep_ratio=scfg.masking.image_keep_ratio,
                                       num_masked=step_lib.num_masked_rows(b, scfg))
    kind = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    mfu = flops_lib.mfu(flops, step_s, 1, kind, "bfloat16" if autocast is not None else "float32")
    return {"torch": torch.__version__, "device": kind, "autocast": str(autocast), "compile": compile_,
            "batch": b, "steps": steps, "warmup_s": warmup_s, "step_s": step_s, "samples_per_s_per_device": b / step_s,
            "tflops_per_device": flops_lib.tflops_per_device(flops, step_s, 1), "mfu": mfu,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if device == "cuda" else None,
            "loss": float(loss)}


def make_shards(directory: Path, plan: Plan) -> None:
    """plan.shards JPEG tar shards, made in parallel (one process per shard)."""
    from concurrent.futures import ProcessPoolExecutor

    directory.mkdir(parents=True, exist_ok=True)
    with ProcessPoolExecutor(max_workers=min(plan.shards, os.cpu_count() or 1)) as pool:
        list(pool.map(_one_shard, [(directory, s, plan.per_shard, plan.jpeg_size) for s in range(plan.shards)]))


def _one_shard(args: tuple) -> None:
    from input_pipeline import synthetic

    directory, s, per_shard, (w, h) = args
    sub = directory / f"part{s}"
    synthetic.make_jpeg_shards(str(sub), 1, per_shard, w, h, seed=s)
    (sub / "00000.tar").rename(directory / f"{s:05d}.tar")
    sub.rmdir()


def trainer_args(plan: Plan, workdir: Path, global_batch: int, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "prolip_jax.train", "--config", plan.config, "--workdir", str(workdir),
            f"--config.batch_size={global_batch}", f"--config.total_steps={plan.log_steps * (plan.windows + 1)}",
            f"--config.log_steps={plan.log_steps}", "--config.checkpoint_steps=1000000000", *overrides]


def trainer_rate(workdir: Path) -> dict:
    """samples/s over the logged windows after the first (which holds the compile)."""
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [x for x in lines if "samples_per_s" in x][1:]
    if not rows:
        raise ValueError("no timed log window in metrics.jsonl")
    rate = sum(x["samples_per_s"] for x in rows) / len(rows)
    return {"samples_per_s": rate, "windows": len(rows),
            "mfu": rows[-1].get("mfu"), "data": {k: v for k, v in rows[-1].items() if k.startswith("data/")}}


def part_e2e(plan: Plan, r: Runner, env: dict, step_part: dict | None) -> dict:
    sys.path.insert(0, str(REPO / "scripts"))
    from benchmark_step import load_config

    config = load_config(plan.config)
    n = env.get("n_devices") or 1
    global_batch = plan.per_device_batch * n
    shards, tok = r.tmp / "shards", r.tmp / "tokenizer.model"
    t0 = time.monotonic()
    make_shards(shards, plan)
    made = {"name": "JPEG shards", "status": "ok", "seconds": round(time.monotonic() - t0, 1),
            "result": {"shards": plan.shards, "per_shard": plan.per_shard, "jpeg_size": list(plan.jpeg_size),
                       "image_size": config.data.image_size}}
    context = config.data.tokenizer.context_length
    tok_run = r.run("tokenizer", [sys.executable, "scripts/train_tokenizer.py", "--input", str(shards / "*.tar"),
                                  "--output", str(tok), "--context_length", str(context)], timeout=300)
    runs = [made, tok_run]
    base = next((x for x in (step_part or {}).get("runs", [])[:1] if x["status"] == "ok"), None)
    if base is not None:
        runs.append({**base, "name": "step alone (part step: batch on device, no input)"})

    def trainer(name: str, workdir: Path, *overrides: str) -> dict:
        rec = r.run(name, trainer_args(plan, workdir, global_batch, *overrides))
        if rec["status"] == "ok":
            try:
                rec["result"] = trainer_rate(workdir)
            except (OSError, ValueError) as e:
                rec.update(status="failed", error=f"metrics.jsonl: {e}")
        return rec

    runs.append(trainer("trainer, data.source=random", r.tmp / "train_random", "--config.data.source=random"))
    runs[-1]["random_batch_host_s"] = random_batch_seconds(global_batch, config)
    if tok_run["status"] == "ok":
        for w in plan.workers:
            # [MASK] is id 3 in scripts/train_tokenizer.py's layout (pad = EOS = 1 stays protected).
            runs.append(trainer(f"trainer, tar shards, {w} workers", r.tmp / f"train_tar_{w}",
                                "--config.data.source=tar", f"--config.data.path={shards}/*.tar",
                                f"--config.data.tokenizer.path={tok}", "--config.data.tokenizer.kind=sentencepiece",
                                f"--config.data.num_workers={w}", "--config.masking.mask_token_id=3"))
    out = {"status": part_status(runs), "runs": runs, "global_batch": global_batch, "cpu_count": os.cpu_count()}
    synthetic = next((x for x in runs if x["name"] == "trainer, data.source=random" and x["status"] == "ok"), None)
    if synthetic:
        for x in runs:
            if x["name"].startswith("trainer, tar") and x["status"] == "ok":
                x["result"]["vs_random"] = x["result"]["samples_per_s"] / synthetic["result"]["samples_per_s"]
    return out


def random_batch_seconds(global_batch: int, config) -> float | None:
    """Host seconds to make one data.source=random batch (uint8 images drawn each step): the
    synthetic run's own input cost, to read its samples/s against."""
    try:
        from prolip_jax.data import RandomBatches
        from prolip_jax.train import model_config

        mcfg = model_config(config)
        it = RandomBatches(global_batch, mcfg.vision.image_size, mcfg.text.context_length, mcfg.text.vocab_size,
                           process_index=0, process_count=1)
        next(it)
        t0 = time.perf_counter()
        next(it)
        return time.perf_counter() - t0
    except Exception:  # noqa: BLE001 - a side figure; its absence is visible as null
        return None


def part_eval(plan: Plan, r: Runner, env: dict) -> dict:
    """The encoder first (quick), then the CSD ranking, each in its own process: its own time
    limit, and its own device peak memory."""
    runs = []
    for name, only in (("encoder speed", "encoder"), ("blocked CSD ranks", "csd")):
        j = r.tmp / f"eval_{only}.json"
        runs.append(r.run(name, [sys.executable, "scripts/benchmark_eval.py", "--config", plan.config,
                                 *plan.eval_args, "--only", only, "--json", str(j)], j))
    return {"status": part_status(runs), "runs": runs}


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
    results: dict[str, Any] = {"command": "python scripts/benchmark_gpu.py " + " ".join(map(shlex.quote, argv)),
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


def save(out: Path, results: dict) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "results.md").write_text(render(results))


# ---------------------------------------------------------------------------------- markdown
def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 10 ** digits else f"{x:.0f}"
    return str(x)


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f}%"


def _gib(x: int | None) -> str:
    return "—" if x is None else f"{x / 2 ** 30:.3g}"


def _status(run: dict) -> str:
    return f"{run['status']}: {run.get('reason') or run.get('error', '')}".strip().rstrip(":")


def _cmd(run: dict) -> str:
    return f"`{run['command']}`" if run.get("command") else ""


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in row) + " |"
                    for row in rows]


def render(results: dict) -> str:
    env = results.get("environment") or {}
    parts = results.get("parts", {})
    lines = ["# GPU benchmark plan: results", "",
             f"{env.get('n_devices')} x {env.get('device_kind')} ({env.get('backend')}), jax {env.get('jax')}, "
             f"torch {env.get('torch')}, {env.get('cpu_count')} CPU cores; {results.get('date')}; "
             f"`{results.get('command')}`. XLA_PYTHON_CLIENT_MEM_FRACTION={env.get('mem_fraction')}.", ""]
    if "step" in parts:
        p = parts["step"]
        lines += [f"## Train step ({(results.get('plan') or {}).get('config')}) — {p['status']}", ""]
        rows = []
        for run in p["runs"]:
            x = run.get("result") or {}
            if run["status"] != "ok":
                rows.append([run["name"], *["—"] * 8, _status(run), _cmd(run)])
                continue
            mm = x.get("matmul") or {}
            rows.append([x["per_device_batch"], _f(x["compile_s"]), _f(x["step_s"] * 1e3), _f(x["samples_per_s_per_device"]),
                         _f(x["tflops_per_device"]), _pct(x["mfu"]), _pct(mm.get("step_fraction")),
                         _gib((x.get("device_memory") or {}).get("peak_bytes_in_use")),
                         f"{x['dtype']} compute, {'/'.join(x['param_dtypes'])} params, attention "
                         f"{x['attention_impl_resolved']}, remat {x['remat']}"
                         + (f"; {x['device_memory_skipped']}" if x.get("device_memory_skipped") else ""), _cmd(run)])
        lines += _table(["per-device batch", "compile (s)", "step (ms)", "samples/s per device", "TFLOP/s per device",
                         "MFU", "of a bf16 matmul's TFLOP/s", "peak memory (GiB)", "notes", "command"], rows)
        main = (p["runs"][0].get("result") or {}) if p["runs"] else {}
        if main.get("matmul"):
            mm = main["matmul"]
            lines += ["", f"Plain {mm['n']}³ bf16 matmul in the same process: {_f(mm['tflops'])} TFLOP/s; "
                          f"peak used for MFU: {_f(main.get('peak_tflops_per_device'))} TFLOP/s."]
        if p.get("profile"):
            lines += ["", f"Profile of {main.get('profile_steps')} steps: `{p['profile']}` "
                          "(`tar xzf profile.tar.gz; xprof --logdir=profile`; "
                          "`python scripts/profile_breakdown.py profile`)."]
        b = p.get("breakdown")
        if b:
            lines += ["", f"Device time per step: {_f(b['device_ms_per_step'])} ms: " + "; ".join(
                f"{k} {_f(ms)} ms" for k, ms in b["classes_ms_per_step"].items()) + ". Costliest fusions:", ""]
            lines += _table(["ms per step", "kernels per step", "JAX op", "output"],
                            [[_f(x["ms_per_step"]), _f(x["per_step"]), f"`{x['op_name'][-100:]}`", x["shape"]]
                             for x in b["top_fusions"][:10]])
        lines.append("")
    if "max_batch" in parts:
        p = parts["max_batch"]
        lines += [f"## Largest per-device batch per remat policy — {p['status']}", ""]
        rows = []
        for run in p["runs"]:
            mb = (run.get("result") or {}).get("max_batch")
            if mb:
                rows.append([run["name"], mb["max_per_device_batch"],
                             _f(None if mb["first_failing_global_batch"] is None
                                else mb["first_failing_global_batch"] // max(1, run["result"]["n_devices"])),
                             len(mb["probes"]), _status(run) if run["status"] != "ok" else "ok", _cmd(run)])
            else:
                probes = (run.get("result") or {}).get("max_batch_probes") or []
                fit = max((q["batch"] for q in probes if q["fits"]), default=None)
                status = "skipped (below)" if p.get("reason") else _status(run)
                rows.append([run["name"], f"≥ {fit} (global)" if fit else "—", "—", len(probes), status, _cmd(run)])
        lines += _table(["policy", "largest that fits", "first that does not", "probes", "status", "command"], rows)
        if p.get("reason"):
            lines += ["", f"Skipped: {p['reason']}."]
        lines.append("")
    if "levers" in parts:
        p = parts["levers"]
        lines += [f"## Levers (one per row, against the baseline) — {p['status']}", ""]
        base = (p["runs"][0].get("result") or {}) if p["runs"] else {}
        rows = []
        for run in p["runs"]:
            x = run.get("result") or {}
            if run["status"] != "ok":
                rows.append([run["name"], "—", "—", "—", _status(run), _cmd(run)])
                continue
            vs = (x["samples_per_s_per_device"] / base["samples_per_s_per_device"]) if base.get("samples_per_s_per_device") else None
            rows.append([run["name"], _f(x["samples_per_s_per_device"]), _pct(x["mfu"]),
                         "—" if vs is None else f"{vs:.3f}x", "ok", _cmd(run)])
        lines += _table(["lever", "samples/s per device", "MFU", "vs baseline", "status", "command"], rows)
        lines.append("")
    if "torch" in parts:
        p = parts["torch"]
        lines += [f"## Beside PyTorch (same model and loss, same GPU, same batch) — {p['status']}", ""]
        rows = []
        for run in p["runs"]:
            x = run.get("result") or {}
            if run["status"] != "ok":
                rows.append([run["name"], "—", "—", "—", _status(run), _cmd(run)])
                continue
            mem = x.get("peak_memory_bytes", (x.get("device_memory") or {}).get("peak_bytes_in_use"))
            rows.append([run["name"], _f(x["samples_per_s_per_device"]), _f(x["tflops_per_device"]),
                         _gib(mem), "ok", _cmd(run)])
        lines += _table(["step", "samples/s per device", "TFLOP/s", "peak memory (GiB)", "status", "command"], rows)
        if "ratio" in p:
            lines += ["", f"prolip_jax / PyTorch: **{p['ratio']:.2f}x** samples/s."]
        lines.append("")
    if "e2e" in parts:
        p = parts["e2e"]
        lines += [f"## End to end: the trainer with its input pipeline ({p.get('cpu_count')} CPU cores, global batch "
                  f"{p.get('global_batch')}) — {p['status']}", ""]
        rows = []
        for run in p.get("runs", []):
            x = run.get("result") or {}
            if run["name"] in ("JPEG shards", "tokenizer"):
                continue
            if run["status"] != "ok":
                rows.append([run["name"], "—", "—", _status(run), _cmd(run)])
                continue
            rate = x.get("samples_per_s", x.get("samples_per_s_per_device"))
            note = x.get("vs_random")
            extra = ("" if run.get("random_batch_host_s") is None
                     else f"; host makes a random batch in {run['random_batch_host_s'] * 1e3:.0f} ms")
            rows.append([run["name"], _f(rate), "—" if note is None else f"{note:.2f}x", "ok" + extra, _cmd(run)])
        lines += _table(["input", "samples/s", "vs data.source=random", "status", "command"], rows)
        if p.get("error"):
            lines += ["", f"Failed: {p['error']}"]
        lines.append("")
    if "eval" in parts:
        p = parts["eval"]
        lines += [f"## Evaluation speed — {p['status']}", ""]
        rows = []
        for run in p.get("runs") or []:
            x = run.get("result") or {}
            if run["status"] != "ok":
                rows.append([run["name"], "—", _status(run), _cmd(run)])
            elif "encoder" in x:
                e = x["encoder"]
                rows += [["encoder images/s", _f(e["images_per_s"]), f"{e['image_size']} px, block {e['batch']}",
                          _cmd(run)],
                         ["encoder texts/s", _f(e["texts_per_s"]), f"{e['context_length']} tokens, block "
                          f"{e['batch']}", _cmd(run)]]
            elif "csd" in x:
                c = x["csd"]
                peak = (c.get("device_memory") or {}).get("peak_bytes_in_use")
                rows.append([f"blocked CSD ranks, {c['queries']} x {c['gallery']}", f"{_f(c['seconds'])} s",
                             f"dim {c['dim']}, block {c['block']}; device peak {_gib(peak)} GiB, host peak RSS "
                             f"{_gib(c['host_peak_rss_bytes'])} GiB", _cmd(run)])
        if rows:
            lines += _table(["what", "value", "notes", "command"], rows)
        else:
            lines += [p.get("error") or p.get("reason") or p["status"]]
        lines.append("")
    return "\n".join(lines)


def merge(files: list[str]) -> dict:
    """One results dict from several runs of parts of the plan: a part's runs are joined by
    name (a later file's run of the same name wins, unless it was not run)."""
    merged: dict[str, Any] = {"parts": {}, "merged_from": []}
    for f in files:
        r = json.loads(Path(f).read_text())
        merged["merged_from"].append({"file": f, "command": r.get("command"), "date": r.get("date")})
        for key in ("environment", "plan", "date"):
            if r.get(key) is not None:
                merged.setdefault(key, r[key])
        for name, part in r.get("parts", {}).items():
            old = merged["parts"].get(name)
            if old is None:
                merged["parts"][name] = part
                continue
            runs = {x["name"]: x for x in old.get("runs", [])}
            for x in part.get("runs", []):
                if x["status"] != "not run" or x["name"] not in runs:
                    runs[x["name"]] = x
            merged["parts"][name] = {**old, **part, "runs": list(runs.values())}
            if runs:
                merged["parts"][name]["status"] = part_status(list(runs.values()))
    merged["command"] = "; ".join(m["command"] or "" for m in merged["merged_from"])
    merged["parts"] = {k: merged["parts"][k] for k in PARTS if k in merged["parts"]}
    return merged


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="folder for results.json, results.md, log.txt, profile.tar.gz")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--deadline", type=float, default=None, help="seconds after which nothing new starts")
    p.add_argument("--tiny", action="store_true", help="the plan at test size (configs/tiny.py)")
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
