r"""Compile the real ProLIP train step for a TPU pod on a CPU machine (no TPU needed).

    pip install -e '.[tpu]'     # libtpu, the TPU compiler (never part of the base install)
    python benchmarks/compile_tpu.py --topology v5p-128 --config configs/prolip_b16_datacomp.py \
        [--config.batch_size=32768 --config.model.remat=full ...]
    python benchmarks/compile_tpu.py --all --topology v4-256,v5p-128 [--out table.md]

libtpu describes a TPU slice it is not running on (`jax.experimental.topologies`, the approach
of MaxText's train_compile.py): its devices are compile-only, enough to build the config's mesh,
lower the jitted train step (the trainer's: full + masked forward, ProLIP loss, AdamW update,
donated state) on abstract arguments (the sharded train state, a global batch of uint8 images
and int32 tokens as the trainer sends) and compile it with the TPU compiler. Reported per chip:
  - memory from the compiled program: arguments, temporaries, outputs; total = arguments +
    temporaries + outputs - aliased (the donated state's buffers reused for the new state) +
    generated code, against the HBM XLA may use on that chip (`Generation.hbm_gib`). A program that does
    not fit fails to compile with RESOURCE_EXHAUSTED: reported as "no" with the bytes it asked for;
  - FLOPs of the compiled program (`compiled.cost_analysis()`: every op, per chip) against
    prolip_jax/core/flops.py's matmul-only model count (`train_step_flops` / chips), and their ratio;
  - compile time (lowering + compilation, on this machine).

Topology names are Cloud TPU accelerator types: v4-N and v5p-N count TensorCores (2 per chip:
v4-256 = 128 chips), v5e-N and v6e-N count chips. `--all` compiles the paper's configurations
(configs/prolip_b16_datacomp.py, global batch 16,384): B/16 data-parallel, L/16, So400m/14 and
H/14 with FSDP, each as its config says (bfloat16 compute, no remat, ring PPCL); any
`--config.*=...` override applies to every one of them.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PAPER_CONFIG = "configs/prolip_b16_datacomp.py"
PAPER_VARIANTS = ("B/16", "L/16", "So400m/14", "H/14")  # the config's mesh: B/16 DP, the rest FSDP
DEFAULT_ALL_TOPOLOGIES = ("v4-256",)  # the pod configs/prolip_b16_datacomp.py's docstring names
LIBTPU_MISSING = ("libtpu is not installed: it is the TPU compiler this script needs (no TPU needed). "
                  "Install it with `pip install -e '.[tpu]'` (or `pip install 'jax[tpu]'`, which pins "
                  "the libtpu matching the installed jax)")


# ============================================================================ topologies
@dataclasses.dataclass(frozen=True)
class Generation:
    libtpu_name: str  # the generation's prefix in libtpu topology names ("v5" is v5p)
    device_kind: str  # what jax reports for its devices (its bf16 peak: flops.peak_flops_per_device)
    cores_per_chip: int  # TensorCores per chip (the N of "v4-N" counts cores)
    chip_config: str  # "megacore": one device per chip of 2 cores
    datasheet_hbm: str
    shapes: dict[int, str]  # chips -> slice shape of the standard slices
    # HBM per chip that XLA may allocate (GiB): the "available HBM" libtpu 0.0.42 states when a
    # program does not fit (tests/test_compile_tpu.py checks it). The runtime keeps the rest of
    # the datasheet capacity.
    hbm_gib: float
    # Rates for the step-time estimate (Cloud TPU documentation, cloud.google.com/tpu/docs/<generation>:
    # "HBM bandwidth", and the data-center network: v5p "DCN bandwidth per chip 50 Gbps"; v5e
    # "2 x 100 Gbps NIC" per host of 8 chips, 25 Gbps a chip). None: not stated there.
    hbm_gb_s: float
    dcn_gbit_s: float | None


_CUBES = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
          512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}
_PLANES = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
GENERATIONS = {
    "v4": Generation("v4", "TPU v4", 2, "megacore", "32 GiB HBM2", _CUBES, 30.75, 1200, None),
    "v5p": Generation("v5", "TPU v5", 2, "megacore", "95 GB HBM2e", _CUBES, 95.74, 2765, 50),
    "v5e": Generation("v5e", "TPU v5 lite", 1, "default", "16 GB HBM2", _PLANES, 15.75, 819, 25),
    "v6e": Generation("v6e", "TPU v6 lite", 1, "default", "32 GB HBM", _PLANES, 31.25, 1640, None),
}


@dataclasses.dataclass(frozen=True)
class Topology:
    name: str  # "v4-256", or "2xv5p-128": two slices joined over DCN (multislice)
    generation: str  # "v4"
    chips: int  # per slice
    shape: str  # "4x4x8"
    slices: int = 1

    @property
    def total_chips(self) -> int:
        return self.chips * self.slices

    @property
    def libtpu_name(self) -> str:
        return f"{GENERATIONS[self.generation].libtpu_name}:{self.shape}"

    @property
    def wrap(self) -> tuple[bool, bool, bool]:
        """Torus wrap-around links per dimension: the full-size dimensions of the slice."""
        dims = [int(d) for d in self.shape.split("x")]
        if len(dims) == 3:  # v4 / v5p: a cube of 4x4x4 chips or more is a torus
            return (min(dims) >= 4,) * 3
        return (dims[0] == 16, dims[1] == 16, False)  # v5e / v6e: 16 chips wide wraps

    @property
    def hbm_gib(self) -> float:
        return GENERATIONS[self.generation].hbm_gib


def topology_names() -> list[str]:
    return [f"{g}-{chips * gen.cores_per_chip}" for g, gen in GENERATIONS.items() for chips in gen.shapes]


def parse_topology(name: str) -> Topology:
    """'v5p-128' (an accelerator type), or 'Nxv5p-128' (N such slices over DCN) -> Topology;
    ValueError listing the valid names."""
    m = re.fullmatch(r"(?:(\d+)x)?(v4|v5p|v5e|v6e)-(\d+)", name.strip().lower())
    gen = GENERATIONS.get(m.group(2)) if m else None
    chips = int(m.group(3)) // gen.cores_per_chip if gen else None
    if gen is None or chips not in gen.shapes or (m.group(1) is not None and int(m.group(1)) < 1):
        raise ValueError(f"unknown TPU topology {name!r}; valid names: {', '.join(topology_names())}, "
                         "each as N slices with an Nx prefix (2xv5p-128)")
    return Topology(name.strip().lower(), m.group(2), chips, gen.shapes[chips], int(m.group(1) or 1))


def libtpu_available() -> bool:
    env = os.environ.get("TPU_LIBRARY_PATH")
    return bool(env and os.path.isfile(env)) or importlib.util.find_spec("libtpu") is not None


def topology_devices(topo: Topology) -> list[Any]:
    """The compile-only devices of `topo` (libtpu; no TPU needed). RuntimeError if libtpu is missing."""
    if not libtpu_available():
        raise RuntimeError(LIBTPU_MISSING)
    from jax.experimental import topologies

    # libtpu reads these once, when it loads: without them it queries the GCE metadata server
    # and warns that it cannot find the TPU VM's workers, and a second process using libtpu at
    # the same time fails on /tmp/libtpu_lockfile (which guards real TPU chips). Nothing here
    # runs on a TPU.
    accelerator = topo.name.split("x", 1)[1] if topo.slices > 1 else topo.name
    for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", accelerator),
                       ("TPU_WORKER_HOSTNAMES", "localhost"), ("TPU_WORKER_ID", "0"),
                       ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")):
        os.environ.setdefault(key, value)
    gen = GENERATIONS[topo.generation]
    desc = topologies.get_topology_desc(
        topology_name=topo.libtpu_name, platform="tpu", chip_config_name=gen.chip_config,
        chips_per_host_bounds=(2, 2, 1) if topo.chips >= 4 else (1, 1, 1), num_slices=topo.slices,
        wrap=topo.wrap)
    devices = list(desc.devices)
    if len(devices) != topo.total_chips:
        raise RuntimeError(f"libtpu gave {len(devices)} devices for {topo.name} ({topo.libtpu_name}), "
                           f"expected {topo.total_chips}")
    return devices


# ================================================================================ config
def load_config(spec: str, overrides: list[str]) -> Any:
    """The trainer's config of `spec` ('path.py[:args]') with `--config.<field>=value` overrides,
    read as `python -m prolip_jax.train` reads them."""
    from absl import flags
    from ml_collections import config_flags

    from prolip_jax.runtime import config_args
    from prolip_jax.trainer.config import with_defaults

    config = with_defaults(config_args.load_config_file(spec))
    config_args.check_overrides(config, overrides)
    bad = [a for a in overrides if "=" not in a]
    if bad:
        raise ValueError(f"{bad[0]}: expected --config.<field>=<value>")
    fv = flags.FlagValues()  # not absl's global FLAGS: main() may run more than once in a process
    argv = ["compile_tpu", *overrides]
    holder = config_flags.DEFINE_config_dict("config", config, lock_config=True, flag_values=fv, sys_argv=argv)
    fv(argv)
    return holder.value


# =============================================================================== compile
def build_step(config: Any, devices: list[Any], mcfg: Any = None, constraints: bool = True
               ) -> tuple[Any, tuple[Any, Any], dict[str, Any]]:
    """(jitted train step, (abstract state, abstract global batch), facts) on `devices`'s mesh,
    built as prolip_jax/trainer/build.py builds them; `mcfg` replaces the config's model (a shallower one);
    `constraints`: see compile_report."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from prolip_jax.core import flops as flops_lib
    from prolip_jax.core import optim, sharding
    from prolip_jax.core import step as step_lib
    from prolip_jax.trainer.build import build_model, model_config, step_config, validate
    from prolip_jax.trainer.config import parse_config

    tc = parse_config(config, platform="tpu")
    mcfg = model_config(tc) if mcfg is None else mcfg
    mesh = sharding.make_mesh(tc.mesh.shape, tc.mesh.axes, devices=devices, dcn_shape=tc.mesh.dcn_shape)
    validate(tc, mesh, mcfg)  # the trainer's checks: batch layout over the mesh, sizes, combinations
    scfg = step_config(tc)
    model = build_model(tc, mcfg)
    traced = step_lib.trace_params(model)  # model.init traced once: shapes, logical axes
    sharding.check_divisible(traced.boxed, mesh, config.sharding_rules)
    param_shapes = traced.shapes
    optim_cfg = tc.optim
    tx, schedule = optim.make_optimizer(optim_cfg, config.total_steps, param_shapes, step=0)
    state_sh = step_lib.state_shardings(traced.boxed, tx, mesh, config.sharding_rules)
    state = step_lib.abstract_train_state(traced.boxed, tx, state_sh)
    trainable = optim.trainable_mask(param_shapes, optim_cfg, 0)
    b = config.batch_size
    # The trainer's step: the activation constraints under config.sharding_rules (step.make_train_step).
    fn = step_lib.make_train_step(model, tx, schedule, scfg, mesh, b, trainable=trainable,
                                  rules=config.sharding_rules if constraints else None)
    replicated = NamedSharding(mesh, P())
    jitted = jax.jit(fn, in_shardings=(state_sh, None), out_shardings=(state_sh, replicated), donate_argnums=0)
    s, length = mcfg.vision.image_size, mcfg.text.context_length
    image_dtype = jnp.uint8 if config.data.get("image_dtype", "uint8") == "uint8" else jnp.float32
    batch = {"image": jax.ShapeDtypeStruct((b, s, s, 3), image_dtype, sharding=sharding.batch_sharding(mesh, 4)),
             "text": jax.ShapeDtypeStruct((b, length), jnp.int32, sharding=sharding.batch_sharding(mesh, 2))}
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(param_shapes))
    counted = dict(image_keep_ratio=config.masking.image_keep_ratio, num_masked=step_lib.num_masked_rows(b, scfg))
    model_flops = flops_lib.train_step_flops(mcfg, b, **counted)
    facts = {"mesh": dict(mesh.shape), "rules": config.sharding_rules, "params": n_params,
             "model_flops": model_flops, "dtype": config.model.dtype,
             "recompute_flops": flops_lib.recompute_flops(mcfg, b, config.model.remat, **counted)}
    return jitted, (state, batch), facts


@contextlib.contextmanager
def no_persistent_cache_writes():
    """JAX's persistent compilation cache cannot load an executable compiled for compile-only
    devices (it warns on every later read): keep these out of it."""
    import jax

    key = "jax_persistent_cache_min_compile_time_secs"
    old = getattr(jax.config, key)
    jax.config.update(key, 1e12)
    try:
        yield
    finally:
        jax.config.update(key, old)


_OOM = re.compile(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)", re.S)
# The other form of XLA:TPU's out-of-memory error (E1000 CompileTimeHbmOom), a program just over.
_OOM_USAGE = re.compile(r"RESOURCE_EXHAUSTED.*?Total hbm usage >= ([\d.]+)([KMGT]?)", re.S)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def oom_required_bytes(message: str) -> float | None:
    """The HBM a program asked for, from XLA:TPU's out-of-memory compile error; None if the
    message is not one."""
    m = _OOM.search(message) or _OOM_USAGE.search(message)
    return float(m.group(1)) * _UNITS[m.group(2)] if m else None


MEMORY_KEYS = ("argument_bytes", "temp_bytes", "output_bytes", "alias_bytes", "code_bytes", "total_bytes")


def _compile(config: Any, devices: list[Any], hbm_gib: float, mcfg: Any = None,
             constraints: bool = True) -> dict[str, Any]:
    """Per-chip measurements of one compile: memory, FLOPs and compile time (or the OOM)."""
    from prolip_jax.core import traffic

    t0, c0 = time.perf_counter(), time.process_time()  # wall and CPU (all threads): a shared machine's wall time drifts
    jitted, args, facts = build_step(config, devices, mcfg, constraints)
    mesh = args[1]["image"].sharding.mesh  # the batch is laid out on the step's mesh
    lowered = jitted.lower(*args)
    out = {"facts": facts}
    try:
        with no_persistent_cache_writes():
            compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001  (jax raises JaxRuntimeError; its type is private)
        required = oom_required_bytes(str(e))
        if required is None:
            raise
        return {**out, "compile_s": time.perf_counter() - t0, "compile_cpu_s": time.process_time() - c0, "fits": False,
                "error": " ".join(str(e).split())[:300], "required_bytes": required}
    out["compile_s"], out["compile_cpu_s"] = time.perf_counter() - t0, time.process_time() - c0
    mem = compiled.memory_analysis()
    out.update(argument_bytes=mem.argument_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
               output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
               code_bytes=mem.generated_code_size_in_bytes)
    out["total_bytes"] = (out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"] - out["alias_bytes"]
                          + out["code_bytes"])
    out["fits"] = out["total_bytes"] <= hbm_gib * (1 << 30)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost  # older jax: one dict per program
    out["compiled_flops_per_chip"] = float(cost.get("flops", float("nan")))
    out["hbm_bytes_per_chip"] = float(cost.get("bytes accessed", float("nan")))
    out["dcn_bytes_per_slice"] = traffic.program_traffic(compiled, mesh).per_slice_bytes
    return out


def shallow_depths(vision_layers: int, text_layers: int, target: int = 4) -> list[tuple[int, int]] | None:
    """Two shallower (vision, text) depths in the model's own proportion, the first with about
    `target` vision blocks and the second twice as deep; None if the model is not deeper than that."""
    g = math.gcd(vision_layers, text_layers)
    unit = (vision_layers // g, text_layers // g)
    k = max(1, round(target / unit[0]))
    if 2 * k >= g:
        return None
    return [(k * unit[0], k * unit[1]), (2 * k * unit[0], 2 * k * unit[1])]


def extrapolate(shallow: list[dict[str, Any]], depths: list[tuple[int, int]], full: tuple[int, int],
                hbm_gib: float) -> dict[str, Any]:
    """The full-depth measurements, linear in depth through two shallower compiles (both towers
    scaled together: every block adds the same parameters, optimiser state, saved activations,
    FLOPs and code)."""
    (a, _), (b, _) = depths
    t = (full[0] - a) / (b - a)
    out = {key: shallow[0][key] + t * (shallow[1][key] - shallow[0][key])
           for key in (*MEMORY_KEYS, "compiled_flops_per_chip", "hbm_bytes_per_chip", "dcn_bytes_per_slice")}
    out["fits"] = out["total_bytes"] <= hbm_gib * (1 << 30)
    return out


def compile_report(config: Any, topology: str | Topology, label: str = "", extrapolate_depth: bool = False,
                   constraints: bool = True) -> dict[str, Any]:
    """Compiles the train step of `config` for `topology`; a dict of per-chip memory and FLOPs.

    extrapolate_depth: compile the model at two shallower depths (`shallow_depths`) and extrapolate
    linearly to its depth (`extrapolate`), for machines without the memory the full compile needs
    (libtpu takes ~18 GB of host memory for B/16 whatever the batch; the towers are unrolled).
    constraints: the step as the trainer builds it, whose towers' activation constraints
    (`nn.with_logical_constraint(x, ("batch", "length", "embed"))`) apply under the config's
    sharding rules (step.make_train_step `rules`); False: the step as the trainer once lowered it,
    where they were no-ops and sharding propagation alone decided the activations' layout."""
    from prolip_jax.trainer.build import model_config
    from prolip_jax.trainer.config import parse_config

    topo = parse_topology(topology) if isinstance(topology, str) else topology
    devices = topology_devices(topo)
    mcfg = model_config(parse_config(config, platform="tpu"))
    full = (mcfg.vision.layers, mcfg.text.layers)
    depths = shallow_depths(*full) if extrapolate_depth else None
    if depths is None:
        measured = _compile(config, devices, topo.hbm_gib, constraints=constraints)
        how = "compiled"
    else:
        shallow = [_compile(config, devices, topo.hbm_gib, mcfg.replace(
            vision=dataclasses.replace(mcfg.vision, layers=v), text=dataclasses.replace(mcfg.text, layers=t)),
            constraints) for v, t in depths]
        oom = [r for r in shallow if "total_bytes" not in r]  # the full depth needs more than these
        measured = dict(oom[0]) if oom else extrapolate(shallow, depths, full, topo.hbm_gib)
        for key in ("compile_s", "compile_cpu_s"):
            measured[key] = sum(r[key] for r in shallow)
        measured["facts"] = build_step(config, devices, mcfg)[2]  # the full model's (traced, not compiled)
        how = "extrapolated from " + " and ".join(f"{v}+{t}" for v, t in depths) + " blocks"
    if not constraints:
        how += ", activation constraints off"
    facts = measured.pop("facts")
    report = {"label": label or config.model.variant, "topology": topo.name, "chips": topo.total_chips,
              "slices": topo.slices, "generation": topo.generation,
              "device_kind": devices[0].device_kind, "hbm_gib": topo.hbm_gib, "batch": config.batch_size,
              "per_chip_batch": config.batch_size / topo.total_chips, "remat": config.model.remat,
              "scan_layers": bool(config.model.get("scan_layers", False)),
              "ppcl_impl": config.loss.get("ppcl_impl", ""), "how": how, "depth": full, **facts,
              "model_flops_per_chip": facts["model_flops"] / topo.total_chips,
              "recompute_flops_per_chip": facts["recompute_flops"] / topo.total_chips, **measured}
    if "compiled_flops_per_chip" in report:
        report["flops_ratio"] = report["compiled_flops_per_chip"] / report["model_flops_per_chip"]
        report.update(estimate_step(report, topo))
    return report


def estimate_step(r: dict[str, Any], topo: Topology) -> dict[str, Any]:
    """An estimated step time from the compiled program, not a measurement: the larger of its
    FLOPs at the chip's bf16 peak and its HBM bytes at the chip's bandwidth (a roofline, as if
    compute and memory traffic overlapped perfectly), plus what each slice sends over DCN at the
    slice's DCN bandwidth (chips x the per-chip rate, not overlapped: an upper side). Rates:
    `flops.peak_flops_per_device` and `GENERATIONS`. XLA's cost analysis counts a loop's body once, so for scanned towers the FLOPs are
    flops.py's model count plus what the remat policy computes again (`flops.recompute_flops`),
    and the HBM bytes are scaled by the same factor (the blocks' bytes taken to grow as their
    FLOPs do)."""
    from prolip_jax.core import flops as flops_lib

    gen = GENERATIONS[topo.generation]
    flops, hbm = r["compiled_flops_per_chip"], r["hbm_bytes_per_chip"]
    counted = r["model_flops_per_chip"] + r.get("recompute_flops_per_chip", 0.0)
    if r.get("scan_layers") and flops < counted:
        hbm *= counted / flops
        flops = counted
    peak = flops_lib.peak_flops_per_device(gen.device_kind, "bfloat16")
    compute_s = flops / peak
    memory_s = hbm / (gen.hbm_gb_s * 1e9)
    out = {"compute_s": compute_s, "memory_s": memory_s, "dcn_s": 0.0, "est_hbm_bytes_per_chip": hbm,
           "peak_flops_per_chip": peak}
    if r["dcn_bytes_per_slice"] > 0:
        if gen.dcn_gbit_s is None:
            out["dcn_s"] = float("nan")  # no published per-chip DCN rate for this generation
        else:
            out["dcn_s"] = r["dcn_bytes_per_slice"] / (topo.chips * gen.dcn_gbit_s * 1e9 / 8)
    out["step_s"] = max(compute_s, memory_s) + out["dcn_s"]
    return out


# ================================================================================ output
def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / (1 << 30):.2f}"


def table(reports: list[dict[str, Any]]) -> str:
    """Markdown table of compile_report results (~: extrapolated in depth, see compile_report)."""
    head = ("| config | topology (chips) | batch/chip | mesh, rules | HBM/chip GiB | arguments | temporaries "
            "| output | total GiB | fits | compiled TFLOP/chip | flops.py TFLOP/chip | ratio | HBM GB/chip "
            "| DCN MB/slice | est. step s (compute, HBM, DCN) | compile s (CPU s) | how |")
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in reports:
        mesh = "x".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1) or "1"
        est = "" if r["how"] == "compiled" else "~"
        if "total_bytes" in r:
            mem = [est + _gib(r[k]) for k in ("argument_bytes", "temp_bytes", "output_bytes", "total_bytes")]
            flops = [f"{est}{r['compiled_flops_per_chip'] / 1e12:.1f}", f"{r['model_flops_per_chip'] / 1e12:.1f}",
                     f"{r['flops_ratio']:.2f}", f"{est}{r['est_hbm_bytes_per_chip'] / 1e9:.0f}",
                     f"{est}{r['dcn_bytes_per_slice'] / 1e6:.0f}" if r["slices"] > 1 else "-",
                     f"~{r['step_s']:.2f} ({r['compute_s']:.2f}, {r['memory_s']:.2f}, {r['dcn_s']:.2f})"]
        else:
            mem = ["-", "-", "-", f"{'>' if est else ''}{_gib(r['required_bytes'])} needed"]
            flops = ["-", f"{r['model_flops_per_chip'] / 1e12:.1f}", "-", "-", "-", "-"]
        rows.append(f"| {r['label']} | {r['topology']} ({r['chips']}) | {r['per_chip_batch']:g} | {mesh}, "
                    f"{r['rules']} | {r['hbm_gib']:g} | " + " | ".join(mem) + f" | {'yes' if r['fits'] else '**no**'} | "
                    + " | ".join(flops) + f" | {r['compile_s']:.0f} ({r['compile_cpu_s']:.0f}) | {r['how']} |")
    return "\n".join(rows)


def describe(r: dict[str, Any]) -> str:
    lines = [f"{r['label']} on {r['topology']}: {r['chips']} x {r['device_kind']}, mesh {r['mesh']}, rules "
             f"{r['rules']}, global batch {r['batch']} ({r['per_chip_batch']:g}/chip), {r['params'] / 1e6:.0f}M "
             f"params, {r['dtype']} compute, remat {r['remat']}, ppcl {r['ppcl_impl']}",
             f"compile: {r['compile_s']:.1f} s, {r['compile_cpu_s']:.1f} CPU s ({r['how']}; depth {r['depth'][0]}+{r['depth'][1]} blocks)"]
    if "total_bytes" in r:
        lines.append(f"memory per chip: arguments {_gib(r['argument_bytes'])} GiB, temporaries {_gib(r['temp_bytes'])} "
                     f"GiB, output {_gib(r['output_bytes'])} GiB, aliased (donated) {_gib(r['alias_bytes'])} GiB, "
                     f"code {_gib(r['code_bytes'])} GiB -> total {_gib(r['total_bytes'])} of {r['hbm_gib']:g} GiB HBM: "
                     f"{'fits' if r['fits'] else 'DOES NOT FIT'}")
        lines.append(f"FLOPs per chip: compiled {r['compiled_flops_per_chip'] / 1e12:.2f} TFLOP, flops.py "
                     f"{r['model_flops_per_chip'] / 1e12:.2f} TFLOP (ratio {r['flops_ratio']:.3f}), remat "
                     f"{r['remat']} computes {r['recompute_flops_per_chip'] / 1e12:.2f} TFLOP again")
        gen = GENERATIONS[r["generation"]]
        lines.append(f"estimated step (not measured): {r['step_s']:.3f} s = max(compute {r['compute_s']:.3f} s at "
                     f"{r['peak_flops_per_chip'] / 1e12:g} TFLOP/s, HBM {r['est_hbm_bytes_per_chip'] / 1e9:.1f} GB in "
                     f"{r['memory_s']:.3f} s at {gen.hbm_gb_s:g} GB/s) + DCN "
                     f"{r['dcn_bytes_per_slice'] / 1e6:.1f} MB per slice in {r['dcn_s']:.3f} s at "
                     f"{gen.dcn_gbit_s or '?'} Gbit/s per chip")
    else:
        lines.append(f"DOES NOT FIT: {r['error']}")
    return "\n".join(lines)


def for_topology(config: Any, topo: Topology) -> Any:
    """`config` on `topo`: over several slices the data axis spans them (config.mesh.dcn_shape),
    unless the config says how."""
    if topo.slices == 1 or config.mesh.get("dcn_shape"):
        return config
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.mesh.dcn_shape = tuple(topo.slices if a == "data" else 1 for a in config.mesh.axes)
    return config


def check(config: Any, topo: Topology) -> None:
    """The trainer's checks of `config` on `topo`'s mesh (prolip_jax/trainer/build.py validate): ValueError."""
    from prolip_jax.core import sharding
    from prolip_jax.core import step as step_lib
    from prolip_jax.trainer.build import build_model, model_config, validate
    from prolip_jax.trainer.config import parse_config

    tc = parse_config(config, platform="tpu")
    mesh = sharding.make_mesh(tc.mesh.shape, tc.mesh.axes, devices=topology_devices(topo), dcn_shape=tc.mesh.dcn_shape)
    mcfg = model_config(tc)
    validate(tc, mesh, mcfg)
    sharding.check_divisible(step_lib.trace_params(build_model(tc, mcfg)).boxed, mesh, config.sharding_rules)


def main(argv: list[str] | None = None) -> int:
    from absl import flags

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topology", default=None,
                   help="accelerator type(s), comma-separated, e.g. v5p-128,v4-256,v5e-256 "
                        f"(default with --all: {','.join(DEFAULT_ALL_TOPOLOGIES)})")
    p.add_argument("--config", default=None, help="config file[:args], as for prolip_jax.train")
    p.add_argument("--all", action="store_true",
                   help=f"the paper's configurations: {PAPER_CONFIG} with variant={', '.join(PAPER_VARIANTS)}")
    p.add_argument("--out", default=None, help="also write the markdown table here")
    p.add_argument("--no_constraints", action="store_true",
                   help="without the towers' activation sharding constraints, as the trainer lowered its "
                        "step before it passed the sharding rules (see compile_report)")
    p.add_argument("--extrapolate_depth", action="store_true",
                   help="compile two shallower copies of the model and extrapolate to its depth (for "
                        "machines without the ~18 GB (B/16) to ~40 GB of host memory a full compile takes)")
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    overrides = [a for a in rest if a.startswith("--config.")]
    unknown = [a for a in rest if not a.startswith("--config.")]
    try:
        if unknown:
            raise ValueError(f"unknown argument(s) {unknown}")
        if args.all == bool(args.config):
            raise ValueError("give --config FILE[:args] or --all (one of them)")
        if not args.all and not args.topology:
            raise ValueError("--topology is required, e.g. --topology v5p-128")
        topologies = [parse_topology(t) for t in (args.topology.split(",") if args.topology else DEFAULT_ALL_TOPOLOGIES)]
        specs = [(f"{PAPER_CONFIG}:variant={v}", v) for v in PAPER_VARIANTS] if args.all else [(args.config, "")]
        if args.all:  # pods run the towers' blocks scanned: one compiled block, whatever the depth
            overrides = ["--config.model.scan_layers=True", *overrides]
        configs = [(load_config(spec, overrides), label) for spec, label in specs]
        if not libtpu_available():
            raise RuntimeError(LIBTPU_MISSING)
        for topo in topologies:  # a config that cannot run on a topology fails now, before any compile
            for config, _ in configs:
                check(for_topology(config, topo), topo)
    except (flags.Error, ValueError, TypeError, KeyError, AttributeError, RuntimeError, FileNotFoundError) as e:
        msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
        print("error: " + " ".join(msg.split()), file=sys.stderr)  # one line
        return 2
    reports = []
    for topo in topologies:
        for config, label in configs:
            r = compile_report(for_topology(config, topo), topo, label, extrapolate_depth=args.extrapolate_depth,
                               constraints=not args.no_constraints)
            print(describe(r), flush=True)
            reports.append(r)
    md = table(reports)
    print("\n" + md)
    if args.out:
        cmd = "python benchmarks/compile_tpu.py " + " ".join(sys.argv[1:] if argv is None else argv)
        Path(args.out).write_text(f"<!-- {cmd} -->\n{md}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
