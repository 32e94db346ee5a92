"""The ProLIP train step on CPU beside a PyTorch train step of the same model and loss, one run.

    python benchmarks/benchmark_cpu_step.py                     # own_data small model, batch 64, 2 threads
    python benchmarks/benchmark_cpu_step.py --config configs/tiny.py --batch 128 --repeats 30

Ours: the real jitted step (prolip_jax/core/step.py make_train_step: full + masked forward, the
config's ProLIP loss, AdamW, donated state) on one CPU device. Theirs: benchmarks/torch_step.py
(the reference step in PyTorch: same sizes, masked forward, loss terms and AdamW, float32,
`torch.set_num_threads(threads)`). Both get the same batch; the two steps alternate, one
each per repeat, so a load spike from other processes hits both, and the medians are compared.

`--profile DIR` also traces 3 of our steps with `jax.profiler` into DIR and prints where they
spend their time: XLA:CPU thunk time per kind of thunk (`ynn_fusion` = YNNPACK matmuls,
`copy_bitcast_fusion` = transposes, ...), summed over threads, per step. This is how the levers in
docs/performance.md were found.

Threads: torch uses `--threads`; XLA's CPU thread pool takes the cores this process may run on
(on a larger machine pin both with `taskset -c 0,1`). Needs torch (`pip install torch==2.13.0`).
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # one CPU device, before jax is imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

DEFAULT_CONFIG = "configs/own_data.py:size=small"  # 64 px, patch 8, width 256, 6 + 6 layers


def thunk_times(trace_dir: str, steps: int) -> list[tuple[str, float, int]]:
    """[(thunk kind, ms per step, count per step)], largest first, from the perfetto trace that
    `jax.profiler.trace(trace_dir, create_perfetto_trace=True)` wrote over `steps` steps. A kind is
    a thunk's (HLO instruction's) name without its `.N` suffix; runtime events are left out."""
    import collections
    import glob
    import gzip
    import json
    import re

    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise SystemExit(f"no perfetto trace (*.trace.json.gz) under {trace_dir}")
    with gzip.open(max(files, key=os.path.getmtime)) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    hlo_name = re.compile(r"([a-z][a-z0-9_-]*)(\.\d+)?")  # thunks carry their HLO instruction's name
    total, count = collections.Counter(), collections.Counter()
    for e in events:
        m = hlo_name.fullmatch(e.get("name", ""))
        if e.get("ph") != "X" or "dur" not in e or m is None:
            continue  # runtime bookkeeping ("ThunkExecutor::Execute", "$api.py:...", ...)
        kind = m.group(1)
        total[kind] += e["dur"]  # microseconds
        count[kind] += 1
    return [(k, us / 1e3 / steps, count[k] // steps) for k, us in total.most_common()]


def build_ours(config, batch: int, images, tokens):
    """(compiled step, state, device batch): as benchmarks/benchmark_step.py builds it."""
    import jax

    from prolip_jax.core import optim, sharding
    from prolip_jax.core import step as step_lib
    from prolip_jax.trainer.build import build_model, model_config, step_config
    from prolip_jax.trainer.config import parse_config

    tc = parse_config(config)
    mcfg, scfg = model_config(tc), step_config(tc)
    mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
    model = build_model(tc, mcfg)
    tx, schedule = optim.make_optimizer(tc.optim, config.total_steps)
    state, state_sh = step_lib.create_train_state(model, tx, mesh, config.sharding_rules, config.seed)
    dev_batch = sharding.global_batch({"image": images, "text": tokens}, mesh)
    step_fn = jax.jit(step_lib.make_train_step(model, tx, schedule, scfg, mesh, batch, rules=config.sharding_rules),
                      in_shardings=(state_sh, None), out_shardings=(state_sh, None), donate_argnums=0)
    return step_fn.lower(state, dev_batch).compile(), state, dev_batch, mcfg, scfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=DEFAULT_CONFIG)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10, help="timed steps of each (medians reported)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each first")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    p.add_argument("--set", action="append", default=[], help="field=value config override, repeatable")
    p.add_argument("--profile", metavar="DIR", help="trace 3 of our steps into DIR, print thunk time per kind")
    args = p.parse_args()

    from torch_step import TORCH_MISSING, TorchTrainStep  # benchmarks/torch_step.py

    try:
        import torch
    except ImportError:
        raise SystemExit(TORCH_MISSING)
    import jax
    import numpy as np

    from benchmark_step import load_config, set_field  # benchmarks/benchmark_step.py
    from prolip_jax.core.normalization import normalize

    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    for assignment in args.set:
        set_field(config, assignment)
    config.batch_size = b = args.batch

    t0 = time.perf_counter()
    from prolip_jax.trainer.build import model_config
    from prolip_jax.trainer.config import parse_config

    mcfg = model_config(parse_config(config))
    s, length = mcfg.vision.image_size, mcfg.text.context_length
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8)
    tokens = rng.integers(2, mcfg.text.vocab_size, (b, length), dtype=np.int32)
    compiled, state, dev_batch, mcfg, scfg = build_ours(config, b, images, tokens)
    compile_s = time.perf_counter() - t0

    # The reference's loader hands the step normalised float NCHW images (ours normalises uint8
    # inside the jitted step).
    t_images = torch.from_numpy(normalize(images, scfg.normalization).transpose(0, 3, 1, 2).copy())
    t_tokens = torch.from_numpy(tokens.astype(np.int64))
    # Both start from our initial weights (converted to the reference's state_dict).
    theirs = TorchTrainStep(mcfg, scfg.loss_config, scfg.masking, config.optim.to_dict(), config.total_steps, b,
                            params=jax.device_get(state.params), seed=config.seed)

    def run_ours():
        nonlocal state
        state, metrics = compiled(state, dev_batch)
        jax.block_until_ready(metrics)
        return float(metrics["loss"])

    def run_theirs():
        return float(theirs(t_images, t_tokens))

    for _ in range(args.warmup):
        run_ours(), run_theirs()
    load0 = os.getloadavg()[0]
    times = {"ours": [], "torch": []}
    cpu = {"ours": [], "torch": []}
    for _ in range(args.repeats):
        for name, fn in (("ours", run_ours), ("torch", run_theirs)):
            t, c = time.perf_counter(), time.process_time()
            loss = fn()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
            if not np.isfinite(loss):
                raise SystemExit(f"{name}: non-finite loss {loss}")
    load1 = os.getloadavg()[0]

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    name = config.model.config_json or config.model.variant
    print(f"model {name} ({mcfg.vision.image_size} px / patch {mcfg.vision.patch_size}, width "
          f"{mcfg.vision.width}/{mcfg.text.width}, {mcfg.vision.layers}+{mcfg.text.layers} layers, context "
          f"{length}); batch {b}; 1 CPU device; torch {torch.__version__} with {args.threads} threads, "
          f"jax {jax.__version__} on {os.cpu_count()} cores")
    print(f"our compile: {compile_s:.1f} s; load average {load0:.1f} -> {load1:.1f} during the timed steps")
    for k in ("ours", "torch"):
        v = times[k]
        print(f"{k:>5}: median {med[k]:.0f} ms/step (min {min(v) * 1e3:.0f}, max {max(v) * 1e3:.0f}; "
              f"{args.repeats} steps, alternating); CPU time {statistics.median(cpu[k]) * 1e3:.0f} ms/step")
    print(f"ratio (torch ms / ours ms): {med['torch'] / med['ours']:.2f}x "
          f"({'ours faster' if med['ours'] < med['torch'] else 'torch faster'})")
    if load1 > os.cpu_count():
        # OpenMP's spinning barriers (torch) lose far more than XLA's pool to other processes.
        print(f"warning: load average {load1:.1f} on {os.cpu_count()} cores: other processes share them; "
              "the ratio is only meaningful on an idle machine")
    if args.profile:
        with jax.profiler.trace(args.profile, create_perfetto_trace=True):
            for _ in range(3):
                run_ours()
        rows = thunk_times(args.profile, 3)
        print(f"our step's thunk time, summed over threads ({sum(r[1] for r in rows):.0f} ms per step; trace in "
              f"{args.profile}):")
        for kind, ms, n in rows[:15]:
            print(f"  {ms:8.1f} ms  {n:5d} per step  {kind}")


if __name__ == "__main__":
    main()
