"""Unrolled vs scanned blocks (config.model.scan_layers): compile time, compile memory, step time.

    python benchmarks/compile_scan.py                     # B/16 compile both ways, small-model steps
    python benchmarks/compile_scan.py --compile-config configs/prolip_b16_datacomp.py:variant=L/16

Compile: the real train step (prolip_jax/core/step.py make_train_step: full + masked forward, the
config's loss, AdamW) of `--compile-config` lowered and compiled for one CPU device at a
per-device batch of `--compile-batch`, from abstract shapes (no parameters allocated), each
layout in its own process: lower and compile seconds and the process's peak RSS (the host
memory a compile needs). Step: the `--step-config` model's step both ways in one process, the
layouts alternating one step each per repeat (a load spike hits both), medians reported.
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # one CPU device, before jax is imported

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402


def build(config_arg: str, batch: int, scan: bool, overrides: list[str]):
    """(jitted step, model, tx, mesh, state shardings, batch shapes, typed config, the model traced:
    step.ParamTrace) of a config with scan_layers."""
    import jax
    import numpy as np

    from benchmark_step import load_config, set_field  # benchmarks/benchmark_step.py
    from prolip_jax.core import optim, sharding
    from prolip_jax.core import step as step_lib
    from prolip_jax.trainer.build import build_model, model_config, step_config
    from prolip_jax.trainer.config import parse_config

    config = load_config(config_arg)
    for assignment in overrides:
        set_field(config, assignment)
    config.batch_size = batch
    config.mesh.shape = (1, 1, 1)
    tc = parse_config(config)
    mcfg, scfg = model_config(tc), step_config(tc)
    mesh = sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1])
    model = build_model(tc, mcfg).clone(scan_layers=scan)
    tx, schedule = optim.make_optimizer(tc.optim, tc.run.total_steps)
    traced = step_lib.trace_params(model)
    state_sh = step_lib.state_shardings(traced.boxed, tx, mesh, tc.run.sharding_rules)
    s, length = mcfg.vision.image_size, mcfg.text.context_length
    batch_sh = {"image": jax.ShapeDtypeStruct((batch, s, s, 3), np.uint8, sharding=sharding.batch_sharding(mesh, 4)),
                "text": jax.ShapeDtypeStruct((batch, length), np.int32, sharding=sharding.batch_sharding(mesh, 2))}
    step = jax.jit(step_lib.make_train_step(model, tx, schedule, scfg, mesh, batch, rules=tc.run.sharding_rules),
                   in_shardings=(state_sh, None), out_shardings=(state_sh, None), donate_argnums=0)
    return step, model, tx, mesh, state_sh, batch_sh, tc, traced


def compile_one(config_arg: str, batch: int, scan: bool, overrides: list[str]) -> dict:
    import jax

    from prolip_jax.core import step as step_lib

    step, _, tx, _, state_sh, batch_sh, _, traced = build(config_arg, batch, scan, overrides)
    abstract = step_lib.abstract_train_state(traced.boxed, tx, state_sh)
    t0 = time.perf_counter()
    lowered = step.lower(abstract, batch_sh)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    return {"scan_layers": scan, "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
            "peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
            "temp_gib": round(getattr(mem, "temp_size_in_bytes", 0) / 2**30, 3) if mem else None,
            "jax": jax.__version__}


def step_times(config_arg: str, batch: int, repeats: int, overrides: list[str]) -> dict:
    import jax
    import numpy as np

    from prolip_jax.core import step as step_lib
    from prolip_jax.core import sharding
    from prolip_jax.core.models.layout import to_layout

    runs, state = {}, None
    for scan in (False, True):
        step, model, tx, mesh, state_sh, batch_sh, tc, traced = build(config_arg, batch, scan, overrides)
        if state is None:  # one initial state (on the host), converted: both layouts train the same numbers
            state = jax.device_get(step_lib.create_train_state(model, tx, mesh, tc.run.sharding_rules, tc.run.seed,
                                                                  traced)[0])
        s = jax.device_put(state.replace(params=to_layout(state.params, scan),
                                         opt_state=to_layout((state.params, state.opt_state), scan)[1]), state_sh)
        rng = np.random.default_rng(0)
        data = {k: rng.integers(0, 255 if k == "image" else 60, v.shape).astype(v.dtype) for k, v in batch_sh.items()}
        t0 = time.perf_counter()
        compiled = step.lower(s, batch_sh).compile()
        runs[scan] = {"compiled": compiled, "state": s, "batch": sharding.global_batch(data, mesh),
                      "compile_s": time.perf_counter() - t0, "times": [], "loss": None}
    for i in range(repeats + 2):
        for scan, r in runs.items():
            t0 = time.perf_counter()
            r["state"], metrics = r["compiled"](r["state"], r["batch"])
            r["loss"] = float(jax.block_until_ready(metrics)["loss"])
            if i >= 2:  # two untimed warm-up steps
                r["times"].append(time.perf_counter() - t0)
    return {str(scan): {"compile_s": round(r["compile_s"], 2), "step_ms_median": round(1e3 * statistics.median(r["times"]), 1),
                        "step_ms_min": round(1e3 * min(r["times"]), 1), "loss_after": r["loss"]}
            for scan, r in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile-config", default="configs/prolip_b16_datacomp.py")
    p.add_argument("--compile-batch", type=int, default=8)
    p.add_argument("--step-config", default="configs/own_data.py:size=small")
    p.add_argument("--step-batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--set", action="append", default=[], help="field=value config override, repeatable")
    p.add_argument("--one", choices=("0", "1"), help=argparse.SUPPRESS)  # child: compile one layout
    p.add_argument("--skip-steps", action="store_true")
    args = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if args.one is not None:
        print(json.dumps(compile_one(args.compile_config, args.compile_batch, args.one == "1", args.set)))
        return
    print(f"load average {os.getloadavg()}", flush=True)
    for scan in ("0", "1"):  # a process each: peak RSS is the compile's alone
        cmd = [sys.executable, __file__, "--one", scan, "--compile-config", args.compile_config,
               "--compile-batch", str(args.compile_batch)] + [f"--set={s}" for s in args.set]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        print(f"compile {args.compile_config} batch {args.compile_batch}: {out.strip().splitlines()[-1]}", flush=True)
    if not args.skip_steps:
        print(f"steps {args.step_config} batch {args.step_batch}: "
              f"{json.dumps(step_times(args.step_config, args.step_batch, args.repeats, args.set))}", flush=True)
    print(f"load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
