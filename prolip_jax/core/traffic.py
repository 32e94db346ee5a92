"""What a compiled program sends between slices (DCN) per call, read from its optimised HLO.

Every collective of the partitioned program names its participants (replica groups, or
source-target pairs for a permute) by logical device id, an index into the program's devices
(the mesh's, flattened). With each device's slice (`sharding.slice_index`), a collective's DCN
bytes are what the least-traffic algorithm over slices must send (the partial results within a
slice are combined over ICI first), for G participants in S slices of m each, per group:
  - all-reduce of B bytes: 2 (S - 1) B (reduce-scatter over the slices, then all-gather);
  - all-gather to B bytes, reduce-scatter from B bytes: (S - 1) B;
  - all-to-all of B bytes: (G - m) B (each participant's blocks for other slices);
  - collective-permute of B bytes: B for each pair whose ends are in different slices.
TPU multislice programs are one slice's program: XLA:TPU turns what crosses slices into `send`s
to its DCN runtime (`_xla_megascale_transfer_type`); each counts its payload once per device of
every slice ("megascale"). A collective in a loop body counts once per iteration (XLA's known trip count); of a
conditional's branches, the one that sends most.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np

from prolip_jax.core import sharding

BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
         "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "megascale")

_SHAPE = re.compile(r"\b(" + "|".join(sorted(BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
# `%name = <result type> op(operands), attributes`: operands are names, so sizes come from the result.
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_CALLED = re.compile(r"\b(?:body|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
# XLA's iota form: [dims]<=[reshape]T(perm): 0..n-1 laid out as `reshape`, transposed, read as `dims`.
_IOTA = r"\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?"
_GROUPS_IOTA = re.compile(r"replica_groups=" + _IOTA)
# XLA's mesh form: mesh['axis_0'=2,'axis_1'=4], device_ids=(<iota>) {'axis_0'}: the devices (in
# the iota's order, else 0..n-1) laid on the named axes; a group varies over the braced axes.
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@dataclasses.dataclass
class Traffic:
    """DCN bytes of one program call, summed over all slices, by collective kind."""

    slices: int
    by_kind: dict[str, float] = dataclasses.field(default_factory=lambda: {k: 0.0 for k in KINDS})

    @property
    def total_bytes(self) -> float:
        return sum(self.by_kind.values())

    @property
    def per_slice_bytes(self) -> float:
        """What each slice sends, on average: the figure to set against one slice's DCN bandwidth."""
        return self.total_bytes / max(self.slices, 1)


def _shape_bytes(text: str) -> list[int]:
    """Bytes of each array shape in a result type, scalars of async bookkeeping (u32[]) left out."""
    return [BYTES[t] * math.prod(int(d) for d in dims.split(",") if d)
            for t, dims in _SHAPE.findall(text) if not (t == "u32" and dims == "")]


def _payload(kind: str, start: bool, result: str) -> int:
    """Per participant: the bytes an all-reduce reduces, an all-gather ends with, a
    reduce-scatter / all-to-all / permute starts from (a reduce-scatter's is its result x G,
    applied by the caller). An async `-start` returns (operands, results): the half that counts."""
    sizes = [b for b in _shape_bytes(result) if b]
    if start and kind != "all-reduce":
        half = len(sizes) // 2
        sizes = sizes[half:] if kind == "all-gather" else sizes[:half]
    return sum(sizes)


def _iota(m: re.Match) -> np.ndarray:
    """The device ids of an iota match (`_IOTA`'s three groups), in the shape of its dims."""
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    dims = ints(m.group(1))
    ids = np.arange(math.prod(dims)).reshape(ints(m.group(2) or m.group(1)))
    if m.group(3):
        ids = ids.transpose(ints(m.group(3)))
    return ids.reshape(dims)


def replica_groups(line: str, num_devices: int) -> list[list[int]]:
    """The participant groups of a collective: explicit lists, the iota form
    `[groups,size]<=[dims]T(perm)`, the mesh form, or (absent) every device in one group."""
    m = _GROUPS_MESH.search(line)
    if m:
        axes = [(name.strip().strip("'"), int(size)) for name, size in
                (a.split("=") for a in m.group(1).split(",") if a.strip())]
        sizes = [size for _, size in axes]
        ids = _iota(re.fullmatch(_IOTA, m.group(2).strip())) if m.group(2) else np.arange(math.prod(sizes))
        grid = ids.reshape(sizes)
        varying = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m.group(3) or name in m.group(3).split(",")]
        fixed = [i for i in range(len(axes)) if i not in varying]
        group = math.prod(sizes[i] for i in varying)
        return grid.transpose(fixed + varying).reshape(-1, group).tolist()
    m = _GROUPS_IOTA.search(line)
    if m:
        ids = _iota(m)
        return ids.reshape(ids.shape[0], -1).tolist()
    m = _GROUPS_LIST.search(line)
    if m and m.group(1):
        return [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return [list(range(num_devices))]


def _collective_bytes(kind: str, line: str, payload: int, slice_of: Sequence[int]) -> float:
    if kind == "collective-permute":
        m = _PAIRS.search(line)
        pairs = re.findall(r"\{(\d+),(\d+)\}", m.group(1)) if m else []
        return float(payload * sum(slice_of[int(a)] != slice_of[int(b)] for a, b in pairs))
    total = 0.0
    for group in replica_groups(line, len(slice_of)):
        counts = np.unique([slice_of[d] for d in group], return_counts=True)[1]
        s, g, m = len(counts), len(group), int(counts.max())
        if s == 1:
            continue
        if kind == "all-reduce":
            total += 2 * (s - 1) * payload
        elif kind == "all-gather":
            total += (s - 1) * payload
        elif kind == "reduce-scatter":
            total += (s - 1) * payload * g  # its input: G results
        else:  # all-to-all
            total += (g - m) * payload
    return total


def _parse(hlo: str) -> tuple[dict[str, list[str]], str]:
    computations: dict[str, list[str]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(1)
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif line.strip() == "}":
            current = None
        elif current is not None:
            computations[current].append(line)
    return computations, entry


def dcn_traffic(hlo: str, slice_of: Sequence[int]) -> Traffic:
    """The DCN bytes of one call of the program `hlo` (optimised HLO text,
    `compiled.as_text()`), whose logical device i is in slice `slice_of[i]`."""
    computations, entry = _parse(hlo)
    memo: dict[str, dict[str, float]] = {}

    def visit(name: str) -> dict[str, float]:
        if name in memo:
            return memo[name]
        memo[name] = {k: 0.0 for k in KINDS}  # a recursive reference counts nothing
        sums = {k: 0.0 for k in KINDS}
        for line in computations.get(name, ()):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            result, op = m.group(1), m.group(2)
            start = op.endswith("-start")
            kind = op[:-len("-start")] if start else op
            if op == "send" and "_xla_megascale_transfer_type" in line:
                sums["megascale"] += float(_shape_bytes(result)[0] * len(slice_of))  # every device of every slice
            elif kind in KINDS:
                sums[kind] += _collective_bytes(kind, line, _payload(kind, start, result), slice_of)
            if op in ("async-done", "async-update"):  # the computation its async-start ran
                continue
            trip = _TRIP.search(line) if op == "while" else None
            trips = int(trip.group(1)) if trip else 1
            called = [(trips, visit(c)) for c in _CALLED.findall(line)]
            branches = _BRANCHES.search(line)
            if branches:  # one branch runs: the one that sends most
                called.append((1, max((visit(c.strip().lstrip("%")) for c in branches.group(1).split(",")),
                                      key=lambda sub: sum(sub.values()))))
            for times, sub in called:
                for k in KINDS:
                    sums[k] += times * sub[k]
        memo[name] = sums
        return sums

    return Traffic(slices=len(set(slice_of)), by_kind=visit(entry))


def program_traffic(compiled, mesh) -> Traffic:
    """`dcn_traffic` of a jitted program compiled over `mesh` (its logical devices are the
    mesh's, flattened)."""
    return dcn_traffic(compiled.as_text(), sharding.device_slices(list(mesh.devices.flat)))
