"""Benchmark the ProLIP train step: compile time, step time, samples/s, TFLOP/s, MFU, memory.

    python benchmarks/benchmark_step.py --config configs/prolip_b16_datacomp.py [--per-device-batch 256] \
        [--steps 10] [--set model.dtype=bfloat16 --set loss.ppcl_impl=dense ...] \
        [--matmul-reference] [--profile DIR] [--json OUT.json]
    python benchmarks/benchmark_step.py --config ... --max-batch [--max-batch-step 32]
    python benchmarks/benchmark_step.py --config ... --state-only    # the train state's creation time

Runs the real jitted step (full + masked forward, ProLIP loss, AdamW update, donated state) on
random device-resident data, on every local device (the config's mesh). FLOPs are counted
analytically (prolip_jax/core/flops.py); MFU uses the peak table there for the device kind.

--matmul-reference times a plain N x N x N bf16 matmul in the same process (N = --matmul-size,
8192 by default) and reports the step's TFLOP/s as a fraction of it: what this machine's
matmuls actually reach, beside the datasheet peak. --profile writes a jax.profiler trace of
--profile-steps steps after the timed ones. Peak device memory is `memory_stats()` (None on CPU).

--max-batch finds the largest batch whose step compiles and runs (no RESOURCE_EXHAUSTED): a
probe at the given batch and its double, a jump to where the compiled memory (arguments +
outputs + temporaries - donated) extrapolates linearly to the device's limit, then bisection
down to --max-batch-step. --memory-limit-bytes imposes a limit on the compiled memory (a test
of the search where the device reports none, e.g. CPU).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

_START = time.perf_counter()  # before jax's import: the process's own start-up is part of a run's cost

from prolip_jax.runtime import xla_flags  # noqa: E402

xla_flags.apply()  # as the trainer does: the platform's XLA flags before jax's backend starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402


def load_config(spec: str):
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    from prolip_jax.trainer.config import with_defaults  # the sections a config may leave out, as the trainer fills them

    return with_defaults(module.get_config(arg or None))


def set_field(config, assignment: str) -> None:
    """`a.b=value` on the config; a field the config lacks (e.g. a section such as `step` that
    keeps its defaults) is created, its value read as JSON where it parses (true, 3, [1, 2])."""
    key, eq, value = assignment.partition("=")
    if not eq or not key:
        raise ValueError(f"--set {assignment!r}: expected field=value, e.g. model.remat=full")
    *parents, leaf = key.split(".")
    target = config
    with config.unlocked():
        for p in parents:
            if p not in target:
                target[p] = ml_collections.ConfigDict()
            target = target[p]
        if leaf not in target:
            target[leaf] = _json_or_text(value)
            return
    old = target[leaf]
    if old is None:  # a None default (e.g. a speed lever left to the platform): typed by its value
        target[leaf] = _json_or_text(value)
    elif isinstance(old, (tuple, list)):  # e.g. mesh.shape=[1,-1,1]
        target[leaf] = tuple(json.loads(value))
    elif isinstance(old, bool):
        target[leaf] = value.lower() in ("1", "true", "yes")
    else:
        target[leaf] = type(old)(value)


def _json_or_text(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def is_out_of_memory(error: BaseException) -> bool:
    """An XLA allocation failure (GPU/TPU: RESOURCE_EXHAUSTED), as opposed to any other error."""
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def device_memory() -> dict[str, int] | None:
    """Device 0's allocator statistics (peak_bytes_in_use, bytes_limit), None where the backend
    keeps none (CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    if not stats:
        return None
    return {k: int(stats[k]) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit") if k in stats}


def compiled_memory(compiled) -> dict[str, int] | None:
    """Per-device bytes of a compiled step from XLA's memory analysis; `total` is what must fit:
    arguments + outputs + temporaries - the donated (aliased) arguments."""
    m = compiled.memory_analysis()
    if m is None:
        return None
    out = {"argument": m.argument_size_in_bytes, "output": m.output_size_in_bytes,
           "temp": m.temp_size_in_bytes, "alias": m.alias_size_in_bytes}
    out["total"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    return {k: int(v) for k, v in out.items()}


def matmul_tflops(n: int, dtype: Any = jnp.bfloat16, reps: int = 10) -> float:
    """TFLOP/s of a plain [n, n] @ [n, n] matmul on device 0 (random data, after a warm-up)."""
    ka, kb = jax.random.split(jax.random.key(0))
    a = jax.random.normal(ka, (n, n), dtype)
    b = jax.random.normal(kb, (n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    for _ in range(3):
        f(a, b).block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(a, b)
    out.block_until_ready()
    return 2.0 * n ** 3 * reps / (time.perf_counter() - t0) / 1e12


def largest_fitting(fits: Callable[[int], tuple[bool, int | None]], start: int, step: int,
                    cap: int, limit: int | None) -> tuple[int, int | None]:
    """(largest batch found to fit, smallest found not to; None if none failed up to `cap`).

    fits(b) -> (fits, compiled bytes or None); batches are multiples of `step`, fitting assumed
    monotone. With a memory `limit`, two probes give bytes per sample and the search jumps to
    the extrapolated limit; then the bracket is widened if needed and bisected to `step`.
    """
    def snap(b: float) -> int:
        return int(min(cap, max(step, b // step * step)))

    lo, hi, seen = 0, None, {}

    def probe(b: int) -> bool:
        nonlocal lo, hi
        ok, need = fits(b)
        seen[b] = need
        if ok:
            lo = max(lo, b)
        else:
            hi = b if hi is None else min(hi, b)
        return ok

    b = snap(start)
    if probe(b) and b < cap and probe(snap(2 * b)) and snap(2 * b) < cap:
        b1, b2 = b, snap(2 * b)
        delta = b2  # no limit known: keep doubling
        if limit and seen[b1] and seen[b2] and seen[b2] > seen[b1]:
            per_sample = (seen[b2] - seen[b1]) / (b2 - b1)
            guess = snap(b2 + (limit - seen[b2]) / per_sample)
            delta = max(step, guess // 16)  # the extrapolation is close: search near it
            if guess > b2 and not probe(guess) and snap(guess - delta) > b2:
                probe(snap(guess - delta))
        while hi is None and lo < cap and snap(lo + delta) not in seen:
            probe(snap(lo + delta))
            delta *= 2
    while hi is not None and hi - lo > step:
        mid = snap((lo + hi) / 2)
        if mid <= lo or mid >= hi:
            break
        probe(mid)
    return lo, hi


class Bench:
    """The model, optimiser, mesh and step of `config`, compiled per global batch size."""

    def __init__(self, config):
        from prolip_jax.core import optim, sharding
        from prolip_jax.core import step as step_lib
        from prolip_jax.trainer.build import build_model, model_config, step_config
        from prolip_jax.trainer.config import parse_config

        self.config, self.sharding, self.step_lib = config, sharding, step_lib
        self.tc = tc = parse_config(config)
        self.mcfg = model_config(tc)
        self.mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
        self.scfg = step_config(tc)
        self.model = build_model(tc, self.mcfg)
        self.tx, self.schedule = optim.make_optimizer(tc.optim, config.total_steps)
        self.state, self.state_sh = None, None

    def fresh_state(self):
        """The train state, created once and again only if a failed (donating) call deleted it."""
        if self.state is None or any(x.is_deleted() for x in jax.tree.leaves(self.state)):
            self.state = None  # free the old buffers before allocating new ones
            self.state, self.state_sh = self.step_lib.create_train_state(
                self.model, self.tx, self.mesh, self.config.sharding_rules, 0)
        return self.state

    def batch(self, b: int) -> dict[str, jax.Array]:
        s, length = self.mcfg.vision.image_size, self.mcfg.text.context_length
        rng = np.random.default_rng(0)
        batch = {"image": rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8),
                 "text": rng.integers(2, self.mcfg.text.vocab_size, (b, length), dtype=np.int32)}
        if self.scfg.targets.needs_image_id:
            batch["image_id"] = np.arange(b, dtype=np.int32) // 2  # two captions per image
        return self.sharding.global_batch(batch, self.mesh)

    def compile(self, b: int, batch: dict) -> tuple[Any, float, float]:
        """(compiled step, lower seconds, compile seconds) for global batch b."""
        state = self.fresh_state()
        fn = jax.jit(self.step_lib.make_train_step(self.model, self.tx, self.schedule, self.scfg, self.mesh, b,
                                                   rules=self.config.sharding_rules),
                     in_shardings=(self.state_sh, None), out_shardings=(self.state_sh, None), donate_argnums=0)
        t0 = time.perf_counter()
        lowered = fn.lower(state, batch)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        return compiled, t1 - t0, time.perf_counter() - t1

    def run(self, compiled, batch: dict, steps: int):
        """Runs `steps` steps from the current state; returns the last metrics (waited for)."""
        metrics = None
        for _ in range(steps):
            self.state, metrics = compiled(self.state, batch)
        jax.block_until_ready(metrics)
        return metrics


def max_batch(bench: Bench, start: int, step: int, cap: int, memory_limit: int | None,
              on_probe: Callable[[list], None] = lambda probes: None) -> dict[str, Any]:
    """largest_fitting over real compiles and one real step per probe (global batch sizes).
    on_probe(probes so far) after each probe: a search cut short still leaves its bounds."""
    mem = device_memory()
    limit = memory_limit or (mem or {}).get("bytes_limit")
    probes = []

    def fits(b: int) -> tuple[bool, int | None]:
        t0 = time.perf_counter()
        need, ok, why = None, False, ""
        try:
            batch = bench.batch(b)
            compiled, _, _ = bench.compile(b, batch)
            need = (compiled_memory(compiled) or {}).get("total")
            if memory_limit and need is not None and need > memory_limit:
                why = "compiled memory over --memory-limit-bytes"
            else:
                bench.run(compiled, batch, 1)
                ok = True
        except Exception as e:  # noqa: BLE001 - only an allocation failure means "does not fit"
            if not is_out_of_memory(e):
                raise
            why = str(e).splitlines()[0][:200]
        finally:
            batch = compiled = None
        probes.append({"batch": b, "fits": ok, "compiled_bytes": need, "seconds": round(time.perf_counter() - t0, 2),
                       **({"why": why} if why else {})})
        print(f"batch {b}: {'fits' if ok else 'does not fit'}"
              f"{'' if need is None else f' ({need / 2 ** 30:.3g} GiB compiled)'}{f' - {why}' if why else ''}",
              flush=True)
        on_probe(probes)
        return ok, need

    lo, hi = largest_fitting(fits, start, step, cap, limit)
    n = jax.device_count()
    return {"max_global_batch": lo, "max_per_device_batch": lo // n, "first_failing_global_batch": hi,
            "step": step, "cap": cap, "memory_limit_bytes": limit,
            "limit_source": "--memory-limit-bytes" if memory_limit else ("memory_stats" if limit else None),
            "probes": probes}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the config's)")
    p.add_argument("--per-device-batch", type=int, default=None, help="global batch = this x device count")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--set", action="append", default=[], help="field=value override, repeatable")
    p.add_argument("--matmul-reference", action="store_true", help="also time a plain bf16 N^3 matmul")
    p.add_argument("--matmul-size", type=int, default=8192)
    p.add_argument("--profile", default=None, metavar="DIR", help="jax.profiler trace of a few steps here")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--json", default=None, metavar="OUT", help="write the figures to this JSON file")
    p.add_argument("--max-batch", action="store_true", help="find the largest batch that fits (see above)")
    p.add_argument("--max-batch-step", type=int, default=32, help="resolution, per device")
    p.add_argument("--max-batch-cap", type=int, default=16384, help="largest batch tried, per device")
    p.add_argument("--memory-limit-bytes", type=int, default=None)
    p.add_argument("--state-only", action="store_true",
                   help="stop after creating the train state (its time: `train state X s`)")
    p.add_argument("--compile-only", action="store_true",
                   help="stop after the train state and the compile (fills a compile cache for a later timed run)")
    args = p.parse_args(argv)

    from prolip_jax.core import flops as flops_lib
    from prolip_jax.core.models.transformer import resolve_attention_impl

    config = load_config(args.config)
    for assignment in args.set:
        try:
            set_field(config, assignment)
        except (ValueError, TypeError) as e:
            p.error(str(e))
    n = jax.device_count()
    if args.per_device_batch:
        config.batch_size = args.per_device_batch * n
    elif args.batch:
        config.batch_size = args.batch
    bench = Bench(config)
    b = config.batch_size
    kind = jax.devices()[0].device_kind
    dtype = bench.model.dtype
    result: dict[str, Any] = {
        "backend": jax.default_backend(), "device_kind": kind, "n_devices": n, "jax": jax.__version__,
        "variant": config.model.variant, "dtype": jnp.dtype(dtype).name,
        "remat": config.model.remat, "attention_impl": config.model.attention_impl,
        "attention_impl_resolved": resolve_attention_impl(config.model.attention_impl, dtype),
        "ppcl_impl": config.loss.get("ppcl_impl"), "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "overrides": args.set, "levers": bench.tc.levers_line()}
    print(result["levers"], flush=True)
    print(f"device: {n} x {kind}; model {config.model.variant} ({result['dtype']}); ppcl {result['ppcl_impl']}; "
          f"remat {config.model.remat}; attention {result['attention_impl_resolved']}", flush=True)

    if args.max_batch:
        result["max_batch"] = max_batch(bench, b, args.max_batch_step * n, args.max_batch_cap * n,
                                        args.memory_limit_bytes,
                                        lambda probes: _write(args.json, {**result, "max_batch_probes": probes}))
        mb = result["max_batch"]
        print(f"largest batch that fits: {mb['max_global_batch']} ({mb['max_per_device_batch']} per device); "
              f"first failing: {mb['first_failing_global_batch']}")
        _write(args.json, result)
        return

    # Where a run's wall time goes besides the compile (each lever is a process of its own, so
    # start-up and initialisation bound how many fit in a lent machine's 10-minute call).
    t_init = time.perf_counter()
    jax.block_until_ready(bench.fresh_state())
    init_s = time.perf_counter() - t_init
    if args.state_only:
        result.update(init_s=init_s, startup_s=t_init - _START)
        print(f"train state {init_s:.1f} s (start-up {t_init - _START:.1f} s)")
        _write(args.json, result)
        return
    batch = bench.batch(b)
    compiled, lower_s, compile_s = bench.compile(b, batch)
    if args.compile_only:
        result.update(global_batch=b, init_s=init_s, lower_s=lower_s, compile_s=compile_s,
                      startup_s=t_init - _START)
        print(f"train state {init_s:.1f} s, compile {compile_s:.1f} s (+ {lower_s:.1f} s tracing)")
        _write(args.json, result)
        return
    t_warm = time.perf_counter()
    bench.run(compiled, batch, 1)  # warm-up
    warmup_s = time.perf_counter() - t_warm
    first_step_s = time.perf_counter() - _START  # launch to the first step done: the start-up figure
    t0 = time.perf_counter()
    metrics = bench.run(compiled, batch, args.steps)
    step_s = (time.perf_counter() - t0) / args.steps
    mem = device_memory()  # before the matmul reference, which allocates its own buffers

    m_count = bench.step_lib.num_masked_rows(b, bench.scfg)
    step_flops = flops_lib.train_step_flops(bench.mcfg, b, image_keep_ratio=bench.scfg.masking.image_keep_ratio,
                                            num_masked=m_count)
    mfu = flops_lib.mfu(step_flops, step_s, n, kind, dtype)
    tflops = flops_lib.tflops_per_device(step_flops, step_s, n)
    param_dtypes = sorted({x.dtype.name for x in jax.tree.leaves(bench.state.params)})
    result.update({
        "global_batch": b, "per_device_batch": b // n, "steps": args.steps, "param_dtypes": param_dtypes,
        "lower_s": lower_s, "compile_s": compile_s, "step_s": step_s, "samples_per_s": b / step_s,
        "samples_per_s_per_device": b / step_s / n, "tflop_per_step": step_flops / 1e12,
        "tflops_per_device": tflops, "peak_tflops_per_device": _tera(flops_lib.peak_flops_per_device(kind, dtype)),
        "mfu": mfu, "compiled_memory": compiled_memory(compiled), "device_memory": mem,
        "loss": float(metrics["loss"]), "startup_s": t_init - _START, "init_s": init_s, "warmup_s": warmup_s,
        "first_step_s": first_step_s})
    if mem is None:
        result["device_memory_skipped"] = f"memory_stats() reports nothing on {jax.default_backend()}"
    print(f"compile: {compile_s:.1f} s (+ {lower_s:.1f} s tracing)")
    print(f"step: {step_s * 1e3:.1f} ms; {b / step_s:.1f} samples/s ({b / step_s / n:.1f} per device)")
    print(f"TFLOP/s per device: {tflops:.3g} ({step_flops / 1e12:.3g} TFLOP per step); MFU: "
          f"{'n/a (no peak known for this device)' if mfu is None else f'{100 * mfu:.1f}%'}")
    if result["compiled_memory"] is not None:
        cm, gib = result["compiled_memory"], 1 << 30
        print(f"compiled memory per device: arguments {cm['argument'] / gib:.3g} GiB, "
              f"outputs {cm['output'] / gib:.3g} GiB, temporaries {cm['temp'] / gib:.3g} GiB")
    if mem is not None:
        print(f"peak device memory: {mem.get('peak_bytes_in_use', 0) / 2 ** 30:.3g} GiB of "
              f"{mem.get('bytes_limit', 0) / 2 ** 30:.3g} GiB")
    print(f"loss after {args.steps + 1} steps: {result['loss']:.4f}")
    print(f"wall time: start-up (imports, config, model) {result['startup_s']:.1f} s, train state "
          f"{init_s:.1f} s, tracing + compile {lower_s + compile_s:.1f} s, warm-up step {warmup_s:.1f} s, "
          f"{args.steps} timed steps {step_s * args.steps:.1f} s; first step done {first_step_s:.1f} s after launch")

    _write(args.json, result)  # the figures so far, whatever the extras below do
    if args.profile:
        try:
            jax.profiler.start_trace(args.profile)
            try:
                bench.run(compiled, batch, args.profile_steps)
            finally:
                jax.profiler.stop_trace()
            result["profile_dir"], result["profile_steps"] = args.profile, args.profile_steps
            print(f"profile of {args.profile_steps} steps written to {args.profile} (xprof --logdir={args.profile})")
        except Exception as e:  # noqa: BLE001 - e.g. no CUPTI: the step's figures stand without it
            result["profile_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"profile failed: {result['profile_error']}")
    if args.matmul_reference:
        compiled = batch = bench.state = None  # room for the matmul's buffers
        try:
            mm = matmul_tflops(args.matmul_size)
            result["matmul"] = {"n": args.matmul_size, "dtype": "bfloat16", "tflops": mm,
                                "step_fraction": tflops / mm}
            print(f"{args.matmul_size}^3 bf16 matmul: {mm:.4g} TFLOP/s; the step reaches {100 * tflops / mm:.1f}% of it")
        except Exception as e:  # noqa: BLE001
            result["matmul_error"] = f"{type(e).__name__}: {e}"[:500]
            print(f"matmul reference failed: {result['matmul_error']}")
    _write(args.json, result)


def _tera(x: float | None) -> float | None:
    return None if x is None else x / 1e12


def _write(path: str | None, result: dict) -> None:
    if path:  # atomically: a process stopped mid-write leaves the previous figures
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(f"{path}.tmp").write_text(json.dumps(result, indent=1))
        os.replace(f"{path}.tmp", path)


if __name__ == "__main__":
    main()
