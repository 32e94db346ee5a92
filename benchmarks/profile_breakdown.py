"""Where a profiled step's device time goes, by kernel class and by the model code that made it.

    python benchmarks/profile_breakdown.py PROFILE_DIR [--steps 3] [--top 30] [--json OUT.json]

PROFILE_DIR is a `jax.profiler` trace (`benchmarks/benchmark_step.py --profile DIR`, or the
`profile.tar.gz` of `benchmarks/benchmark_gpu.py`, unpacked). It reads the trace's kernel events
(`*.trace.json.gz`) and the compiled HLO that the trace carries (`*.xplane.pb`, plane
`/host:metadata`) and prints, per step:
  - device time by class: GEMM (cuBLAS / cuBLASLt / nvjet / CUTLASS), attention (cuDNN), XLA
    fusions and other kernels, copies and memsets;
  - the costliest fusion kernels, each with the JAX operation that made it (the HLO
    instruction's `op_name`, layer indices folded: `resblocks_N`), its output shape and the
    fused ops (so "a concatenate of [50688, 3072] and [4768, 3072]" is visible as such);
  - the fusion time summed by JAX op over every kernel ("backward image c_fc/reduce_sum": all
    layers, the full and the masked forward, forward and backward apart).
XLA GPU reuses one compiled kernel for identical fusions, so a kernel's name is that of the first
instruction that uses it; the others are folded into it (their count is the kernel's count).
No xprof or TensorFlow needed: the HLO comes from a minimal protobuf reader below. Kernels inside
command buffers (CUDA graphs) carry no HLO op of their own in the trace, hence the name lookup.
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
from pathlib import Path

# ----------------------------------------------------------------------------- protobuf wire reader
_HLO_TYPES = {1: "pred", 2: "s8", 3: "s16", 4: "s32", 5: "s64", 6: "u8", 7: "u16", 8: "u32", 9: "u64", 10: "f16",
              11: "f32", 12: "f64", 13: "tuple", 16: "bf16"}


def _varint(b: bytes, i: int) -> tuple[int, int]:
    r = s = 0
    while True:
        c = b[i]
        i += 1
        r |= (c & 0x7F) << s
        s += 7
        if c < 0x80:
            return r, i


def _fields(b: bytes):
    """(field number, value) of a serialized message: int for varints, bytes otherwise."""
    i, n = 0, len(b)
    while i < n:
        key, i = _varint(b, i)
        wire = key & 7
        if wire == 0:
            v, i = _varint(b, i)
        elif wire == 1:
            v, i = b[i:i + 8], i + 8
        elif wire == 5:
            v, i = b[i:i + 4], i + 4
        elif wire == 2:
            length, i = _varint(b, i)
            v, i = b[i:i + length], i + length
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield key >> 3, v


def _ints(v: int | bytes) -> list[int]:
    if isinstance(v, int):
        return [v]
    out, i = [], 0
    while i < len(v):
        x, i = _varint(v, i)
        out.append(x)
    return out


def _shape(b: bytes) -> str:
    kind, dims = None, []
    for f, v in _fields(b):
        if f == 2:
            kind = v
        elif f == 3:
            dims += _ints(v)
    return f"{_HLO_TYPES.get(kind, kind)}{dims}"


def hlo_modules(xplane: bytes) -> dict[str, dict[str, dict]]:
    """{module name: {instruction name: {"op", "shape", "op_name", "fused": [(op, shape), ...]}}}
    from the HloProtos an XSpace's `/host:metadata` plane carries (XPlane.event_metadata ->
    XEventMetadata.stats -> XStat.bytes_value)."""
    modules = {}
    for f, plane in _fields(xplane):                      # XSpace.planes
        if f != 1 or dict(_fields(plane)).get(2) != b"/host:metadata":
            continue
        for g, entry in _fields(plane):                   # XPlane.event_metadata (map entries)
            if g != 4:
                continue
            meta = dict(_fields(entry)).get(2)
            if meta is None:
                continue
            name, protos = "", []
            for h, v in _fields(meta):
                if h == 2:
                    name = v.decode(errors="replace")
                elif h == 5:
                    stat = dict(_fields(v))
                    if isinstance(stat.get(6), bytes):
                        protos.append(stat[6])
            for proto in protos:
                module = dict(_fields(proto)).get(1)      # HloProto.hlo_module
                if isinstance(module, bytes):
                    modules[name] = _instructions(module)
    return modules


def _instructions(module: bytes) -> dict[str, dict]:
    computations, by_name = {}, {}
    for f, comp in _fields(module):                       # HloModuleProto.computations
        if f != 3:
            continue
        cid, insts = None, []
        for g, v in _fields(comp):
            if g == 5:
                cid = v
            elif g == 2:                                  # HloInstructionProto
                d = {"called": [], "op_name": ""}
                for h, x in _fields(v):
                    if h == 1:
                        d["name"] = x.decode()
                    elif h == 2:
                        d["op"] = x.decode()
                    elif h == 3:
                        d["shape"] = _shape(x)
                    elif h == 7:
                        d["op_name"] = dict(_fields(x)).get(2, b"").decode(errors="replace")
                    elif h == 38:
                        d["called"] += _ints(x)
                insts.append(d)
        computations[cid] = insts
        by_name.update({d["name"]: d for d in insts})
    for d in by_name.values():
        d["fused"] = [(x.get("op"), x.get("shape")) for c in d.pop("called") for x in computations.get(c, [])
                      if x.get("op") not in ("parameter", "constant", "broadcast", "bitcast", "tuple")]
    return by_name


# ----------------------------------------------------------------------------- the breakdown
def kernel_class(name: str) -> str:
    s = name.lower()
    if "cudnn" in s or "fmha" in s or "flash" in s:
        return "attention (cuDNN)"
    if "gemm" in s or "nvjet" in s or "cutlass" in s or "xmma" in s or "cublas" in s:
        return "GEMM"
    if s.startswith("memcpy") or s.startswith("memset"):
        return "copies and memsets"
    return "XLA fusions and other kernels"


def instruction_of(kernel: str, instructions: dict[str, dict]) -> dict | None:
    """XLA names a kernel after its fusion instruction with '.' -> '_' ("input_add_fusion.6" ->
    "input_add_fusion_6")."""
    if kernel in instructions:
        return instructions[kernel]
    m = re.match(r"(.*)_(\d+)$", kernel)
    return instructions.get(f"{m.group(1)}.{m.group(2)}") if m else None


def fold_layers(op_name: str) -> str:
    return re.sub(r"(resblocks|layers?|blocks?)_\d+", r"\1_N", op_name)


def op_group(op_name: str) -> str:
    """"backward image c_fc/reduce_sum": a folded op name without its jit/jvp wrappers, so that
    the kernels of one model op (every layer, the full and the masked forward) add up."""
    tower = "image" if "encode_image" in op_name else "text" if "encode_text" in op_name else ""
    direction = ("backward" if "transpose(" in op_name else "forward") if tower else "step"  # loss, optimiser, guard
    tail = op_name.split("resblocks_N/", 1)[1] if "resblocks_N/" in op_name else op_name.rsplit("/", 1)[-1]
    return " ".join(x for x in (direction, tower, tail) if x)


def breakdown(profile_dir: Path, steps: int, top: int) -> dict:
    traces = sorted(profile_dir.rglob("*.trace.json.gz"))
    planes = sorted(profile_dir.rglob("*.xplane.pb"))
    if not traces or not planes:
        raise SystemExit(f"{profile_dir}: no *.trace.json.gz and *.xplane.pb (a jax.profiler trace directory)")
    events = json.loads(gzip.decompress(traces[-1].read_bytes()))["traceEvents"]
    modules = hlo_modules(planes[-1].read_bytes())
    # Instruction names repeat across programs ("fusion.3"): look each kernel up in its own
    # program (the event's `hlo_module`, e.g. "jit_train_step" for module "jit_train_step(9309)").
    by_module: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for name, insts in modules.items():
        by_module[re.sub(r"\(\d+\)$", "", name)].update(insts)

    def instruction(e: dict) -> dict | None:
        return instruction_of(e["name"], by_module.get((e.get("args") or {}).get("hlo_module", ""), {}))

    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    on_device = [e for e in events if e.get("ph") == "X" and processes.get(e["pid"], "").startswith("/device:")]
    if not on_device:  # CPU: the thunks run on host threads, named after their HLO instruction
        on_device = [e for e in events if e.get("ph") == "X" and instruction(e)]
    classes, kernels, counts, insts = (collections.Counter(), collections.Counter(), collections.Counter(), {})
    for e in on_device:
        classes[kernel_class(e["name"])] += e.get("dur", 0)
        kernels[e["name"]] += e.get("dur", 0)
        counts[e["name"]] += 1
        insts.setdefault(e["name"], instruction(e))
    total = sum(classes.values())
    rows, by_op, op_kernels = [], collections.Counter(), collections.Counter()
    for name, us in kernels.most_common():
        if kernel_class(name) != "XLA fusions and other kernels":
            continue
        inst = insts[name] or {}
        group = op_group(fold_layers(inst.get("op_name", "")))
        by_op[group] += us
        op_kernels[group] += counts[name]
        if len(rows) == top:
            continue
        rows.append({"kernel": name, "ms_per_step": us / 1e3 / steps, "per_step": counts[name] / steps,
                     "op_name": fold_layers(inst.get("op_name", "")), "shape": inst.get("shape", ""),
                     "fused": sorted({f"{op} {shape}" for op, shape in inst.get("fused", [])
                                      if op not in ("slice", "convert", "multiply", "add")})[:6]})
    return {"profile": str(traces[-1]), "steps": steps, "device_ms_per_step": total / 1e3 / steps,
            "classes_ms_per_step": {k: v / 1e3 / steps for k, v in classes.most_common()},
            "top_fusions": rows,
            "fusions_by_op": [{"op": k, "ms_per_step": us / 1e3 / steps, "per_step": op_kernels[k] / steps}
                              for k, us in by_op.most_common(top)],
            "modules": sorted(modules)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile_dir", type=Path)
    p.add_argument("--steps", type=int, default=3, help="steps in the trace (benchmark_step.py --profile-steps)")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    r = breakdown(args.profile_dir, args.steps, args.top)
    print(f"device time per step: {r['device_ms_per_step']:.1f} ms ({args.steps} steps in {r['profile']})")
    for k, ms in r["classes_ms_per_step"].items():
        print(f"  {ms:8.2f} ms  {100 * ms / r['device_ms_per_step']:5.1f}%  {k}")
    print("costliest fusions (ms per step, kernels per step, kernel, JAX op, output shape):")
    for x in r["top_fusions"]:
        print(f"  {x['ms_per_step']:7.3f} {x['per_step']:4.0f}  {x['kernel'][:34]:34s} {x['op_name'][-90:]}  "
              f"{x['shape']}")
    print("fusion time by JAX op, every kernel of it (ms per step, kernels per step, op):")
    for x in r["fusions_by_op"]:
        print(f"  {x['ms_per_step']:7.3f} {x['per_step']:5.0f}  {x['op'][-100:]}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
