"""Compiled memory and step time of the global-batch PPCL loss: dense sharded logits vs ring.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
        python benchmarks/benchmark_loss_memory.py                       # B = 256 .. 16384, D = 768
    python benchmarks/benchmark_loss_memory.py --batches 1024 4096 --dim 1152 --time-max 0

For each global batch B (sharded over all devices on one "data" axis) it compiles loss +
gradients w.r.t. all six inputs (`jax.value_and_grad` of `ppcl.make_ppcl_loss(impl, mesh)`)
and prints the per-device temp memory XLA reports (`compiled.memory_analysis()`: buffers
beyond the inputs and outputs) and, for B <= --time-max, the median wall time of a step.
Memory needs no execution, so it is reported for every B; fake CPU devices share the host's
cores, so CPU step times say little about an accelerator.
"""
from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prolip_jax.core.objectives.prolip import ppcl


def _inputs(batch: int, dim: int, rows: NamedSharding, rep: NamedSharding):
    k = jax.random.split(jax.random.key(0), 4)
    mu = lambda key: jax.device_put(jax.random.normal(key, (batch, dim)) / dim ** 0.5, rows)  # noqa: E731
    logvar = lambda key: jax.device_put(-5.0 + jax.random.normal(key, (batch, dim)), rows)  # noqa: E731
    return (mu(k[0]), logvar(k[1]), mu(k[2]), logvar(k[3]),
            jax.device_put(jnp.float32(10.0), rep), jax.device_put(jnp.float32(-10.0), rep))


def measure(impl: str, mesh: Mesh, batch: int, dim: int, repeats: int, time_it: bool):
    """(temp MiB per device, median step seconds or None) for loss + gradients."""
    rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    specs = [jax.ShapeDtypeStruct((batch, dim), jnp.float32, sharding=rows)] * 4
    specs += [jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)] * 2
    step = jax.jit(jax.value_and_grad(ppcl.make_ppcl_loss(impl, mesh), argnums=range(6)))
    compiled = step.lower(*specs).compile()
    stats = compiled.memory_analysis()
    temp = stats.temp_size_in_bytes / 2 ** 20 if stats is not None else float("nan")
    if not time_it:
        return temp, None
    args = _inputs(batch, dim, rows, rep)
    jax.block_until_ready(compiled(*args))  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return temp, statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--time-max", type=int, default=4096, help="time steps only for B <= this")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("data",))
    n = len(devices)
    print(f"jax {jax.__version__}, {n} x {devices[0].device_kind} ({devices[0].platform}), D = {args.dim}, "
          f"float32, loss + grad w.r.t. all inputs; temp = compiled per-device temp memory")
    print("| B | b_local | b_local*B*4 (MiB) | dense temp (MiB) | ring temp (MiB) | dense/ring "
          "| dense step (ms) | ring step (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batches:
        if batch % n:
            print(f"| {batch} | skipped: not divisible by {n} devices |")
            continue
        time_it = batch <= args.time_max
        (dense_mem, dense_t), (ring_mem, ring_t) = (
            measure(impl, mesh, batch, args.dim, args.repeats, time_it) for impl in ("dense", "ring"))
        ms = lambda t: "-" if t is None else f"{1e3 * t:.1f}"  # noqa: E731
        print(f"| {batch} | {batch // n} | {batch // n * batch * 4 / 2 ** 20:.2f} | {dense_mem:.2f} | "
              f"{ring_mem:.2f} | {dense_mem / ring_mem:.1f}x | {ms(dense_t)} | {ms(ring_t)} |", flush=True)


if __name__ == "__main__":
    main()
