"""The parts of the GPU benchmark plan (benchmarks/benchmark_gpu.py): step, max_batch, levers,
torch, e2e and eval, each a function of the plan, the runner and the environment that returns
{"status", "runs", ...} for results.json.
"""
from __future__ import annotations

import json
import os
import sys
import tarfile
import time
from pathlib import Path

from gpu_plan import REPO, Plan, Runner, XLA_LEVERS, part_status, skipped


# ------------------------------------------------------------------------------------ the parts
def step_args(plan: Plan, per_device_batch: int, *extra: str) -> list[str]:
    return [sys.executable, "benchmarks/benchmark_step.py", "--config", plan.config,
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
        try:  # where the device time goes, by kernel class and JAX op (benchmarks/profile_breakdown.py)
            from profile_breakdown import breakdown

            out["breakdown"] = breakdown(profile, plan.profile_steps, top=15)
        except Exception as e:  # noqa: BLE001 - a side table; the step's figures stand without it
            out["breakdown_error"] = f"{type(e).__name__}: {e}"
    return out


def remat_policies(plan: Plan) -> tuple[str, ...]:
    if plan.remat_policies:
        return plan.remat_policies
    from prolip_jax.core.models.transformer import REMAT_POLICIES

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
    if not (REPO / "benchmarks" / "torch_step.py").exists():
        return "benchmarks/torch_step.py (the PyTorch step) is not in this tree"
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
    argv = [sys.executable, "benchmarks/benchmark_gpu.py", "--torch-step-worker", "--config", plan.config,
            "--per-device-batch", str(plan.per_device_batch), "--steps", str(plan.torch_steps),
            *(["--torch-compile"] if plan.torch_compile else []), "--json", str(j)]
    torch_run = skipped("PyTorch step", why, r.display(argv)) if why else r.run("PyTorch step", argv, j)
    out = {"status": part_status([jax_run, torch_run]), "runs": [jax_run, torch_run]}
    if jax_run["status"] == torch_run["status"] == "ok":
        out["ratio"] = (jax_run["result"]["samples_per_s_per_device"]
                        / torch_run["result"]["samples_per_s_per_device"])
    return out


def torch_step_figures(config_spec: str, per_device_batch: int, steps: int, compile_: bool) -> dict:
    """The PyTorch side of part `torch`, in its own process: benchmarks/torch_step.py's
    `TorchTrainStep` (the same model and loss; bf16 autocast where our step computes in bf16 on
    CUDA) timed over `steps` updates after min(3, steps) warm-up ones (torch.compile happens there)."""
    import torch

    from benchmark_step import load_config
    from torch_step import TorchTrainStep

    from prolip_jax.core import flops as flops_lib
    from prolip_jax.core import step as step_lib
    from prolip_jax.trainer.build import model_config, step_config
    from prolip_jax.trainer.config import parse_config

    config = load_config(config_spec)
    tc = parse_config(config)
    mcfg, scfg = model_config(tc), step_config(tc)
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
    from benchmark_step import load_config

    from prolip_jax.trainer.build import model_config
    from prolip_jax.trainer.config import parse_config

    config = load_config(plan.config)
    mcfg = model_config(parse_config(config))
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
                                  "--output", str(tok), "--context_length", str(context),
                                  "--max_vocab_size", str(mcfg.text.vocab_size)],  # a tokenizer may not exceed it
                  timeout=300)
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

    # [MASK] is id 3 in scripts/train_tokenizer.py's layout (pad = EOS = 1 stays protected). The
    # random run takes it too: both runs compile the same step (the second one from the compile
    # cache, where one is set), so what differs between them is the input alone.
    mask = "--config.masking.mask_token_id=3"
    runs.append(trainer("trainer, data.source=random", r.tmp / "train_random", "--config.data.source=random", mask))
    runs[-1]["random_batch_host_s"] = random_batch_seconds(global_batch, mcfg)
    if tok_run["status"] == "ok":
        for w in plan.workers:
            runs.append(trainer(f"trainer, tar shards, {w} workers", r.tmp / f"train_tar_{w}",
                                "--config.data.source=tar", f"--config.data.path={shards}/*.tar",
                                f"--config.data.tokenizer.path={tok}", "--config.data.tokenizer.kind=sentencepiece",
                                f"--config.data.num_workers={w}", mask))
    out = {"status": part_status(runs), "runs": runs, "global_batch": global_batch, "cpu_count": os.cpu_count()}
    synthetic = next((x for x in runs if x["name"] == "trainer, data.source=random" and x["status"] == "ok"), None)
    if synthetic:
        for x in runs:
            if x["name"].startswith("trainer, tar") and x["status"] == "ok":
                x["result"]["vs_random"] = x["result"]["samples_per_s"] / synthetic["result"]["samples_per_s"]
    return out


def random_batch_seconds(global_batch: int, mcfg) -> float | None:
    """Host seconds to make one data.source=random batch (uint8 images drawn each step) of the
    model config `mcfg`: the synthetic run's own input cost, to read its samples/s against."""
    try:
        from input_pipeline.sources.random_batches import RandomBatches

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
        runs.append(r.run(name, [sys.executable, "benchmarks/benchmark_eval.py", "--config", plan.config,
                                 *plan.eval_args, "--only", only, "--json", str(j)], j))
    return {"status": part_status(runs), "runs": runs}
