"""Benchmark the ProLIP train step: compile time, step time, samples/s, TFLOP/s, MFU, memory.

    python scripts/benchmark_step.py --config configs/prolip_b16_datacomp.py [--batch 256] \
        [--steps 10] [--set model.dtype=bfloat16 --set loss.ppcl_impl=dense ...]

Runs the real jitted step (full + masked forward, ProLIP loss, AdamW update, donated state) on
random device-resident data, on every local device (the config's mesh). FLOPs are counted
analytically (prolip_jax/flops.py); MFU uses the peak table there for the device kind.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import time

import jax
import jax.numpy as jnp
import numpy as np


def load_config(spec: str):
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("config", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg or None)


def set_field(config, assignment: str) -> None:
    key, _, value = assignment.partition("=")
    *parents, leaf = key.split(".")
    target = config
    for p in parents:
        target = target[p]
    old = target[leaf]
    if isinstance(old, (tuple, list)):  # e.g. mesh.shape=[1,-1,1]
        target[leaf] = tuple(json.loads(value))
    elif isinstance(old, bool):
        target[leaf] = value.lower() in ("1", "true", "yes")
    else:
        target[leaf] = type(old)(value)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, default=None, help="global batch (default: the config's)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--set", action="append", default=[], help="field=value override, repeatable")
    args = p.parse_args()

    from prolip_jax import flops as flops_lib
    from prolip_jax import optim, sharding
    from prolip_jax import step as step_lib
    from prolip_jax.models import ProLIP
    from prolip_jax.train import model_config, step_config

    config = load_config(args.config)
    for assignment in args.set:
        set_field(config, assignment)
    if args.batch:
        config.batch_size = args.batch
    mcfg = model_config(config)
    mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
    scfg = step_config(config)
    model = ProLIP(mcfg, dtype=jnp.dtype(config.model.dtype), attention_impl=config.model.attention_impl,
                   remat=config.model.remat)
    tx, schedule = optim.make_optimizer(config.optim.to_dict(), config.total_steps)
    state, state_sh = step_lib.create_train_state(model, tx, mesh, config.sharding_rules, 0)
    b, s, length = config.batch_size, mcfg.vision.image_size, mcfg.text.context_length
    rng = np.random.default_rng(0)
    batch = sharding.global_batch({
        "image": rng.integers(0, 256, (b, s, s, 3), dtype=np.uint8),
        "text": rng.integers(2, mcfg.text.vocab_size, (b, length), dtype=np.int32)}, mesh)
    step_fn = jax.jit(step_lib.make_train_step(model, tx, schedule, scfg, mesh, b),
                      in_shardings=(state_sh, None), out_shardings=(state_sh, None), donate_argnums=0)

    t0 = time.perf_counter()
    compiled = step_fn.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    state, metrics = compiled(state, batch)  # warm-up
    jax.block_until_ready(metrics)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - t0) / args.steps

    n = jax.device_count()
    m_count = step_lib.num_masked_rows(b, scfg)
    step_flops = flops_lib.train_step_flops(mcfg, b, image_keep_ratio=scfg.masking.image_keep_ratio, num_masked=m_count)
    kind = jax.devices()[0].device_kind
    mfu = flops_lib.mfu(step_flops, step_s, n, kind, model.dtype)
    print(f"device: {n} x {kind}; model {config.model.variant} ({config.model.dtype}); global batch {b}; "
          f"ppcl {config.loss.ppcl_impl}; remat {config.model.remat}")
    print(f"compile: {compile_s:.1f} s")
    print(f"step: {step_s * 1e3:.1f} ms; {b / step_s:.1f} samples/s ({b / step_s / n:.1f} per device)")
    print(f"TFLOP/s per device: {flops_lib.tflops_per_device(step_flops, step_s, n):.3g} "
          f"({step_flops / 1e12:.3g} TFLOP per step); MFU: {'n/a (no peak known for this device)' if mfu is None else f'{100 * mfu:.1f}%'}")
    if mem is not None:
        gib = 1 << 30
        print(f"compiled memory per device: arguments {mem.argument_size_in_bytes / gib:.3g} GiB, "
              f"outputs {mem.output_size_in_bytes / gib:.3g} GiB, temporaries {mem.temp_size_in_bytes / gib:.3g} GiB")
    print(f"loss after {args.steps + 1} steps: {float(metrics['loss']):.4f}")


if __name__ == "__main__":
    main()
