"""Device mesh from config and logical-axis rules -> parameter and batch shardings.

Parameters carry logical axis names (models/); `config.sharding_rules` maps each name to mesh
axes, e.g. replicated (every name -> None), FSDP ('embed' -> 'fsdp') or tensor-parallel
('mlp'/'heads'/'vocab' -> 'tensor'). The batch is split over `BATCH_AXES` ('data', 'fsdp').

Beyond one slice (TPU multislice; GPU nodes): `config.mesh.dcn_shape` lays the `data` axis over
the slices, joined by the data-center network (DCN), and every other axis inside a slice (ICI),
as MaxText's `dcn_data_parallelism` does: the mesh is jax's hybrid mesh, slice-major along
`data`, so FSDP gathers and tensor-parallel traffic never leave a slice.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

BATCH_AXES = ("data", "fsdp")
DCN_AXIS = "data"  # the one axis that may cross slices


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """`config.mesh`: `shape` is the mesh within one slice (one entry may be -1: all of the
    slice's remaining devices); `dcn_shape`, the same length, how many slices each axis spans
    (only `data` may span more than one; () is one slice, as (1, 1, 1))."""

    shape: tuple[int, ...] = (-1, 1, 1)
    axes: tuple[str, ...] = ("data", "fsdp", "tensor")
    dcn_shape: tuple[int, ...] = ()

    def validate(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ValueError(f"config.mesh.shape {self.shape} and axes {self.axes} differ in length")
        check_dcn_shape(self.dcn_shape, self.axes)


def check_dcn_shape(dcn_shape: Sequence[int], axes: Sequence[str]) -> None:
    """Only the data axis may cross slices: FSDP's per-layer gathers and tensor parallelism's
    per-layer reductions over DCN would crawl."""
    if not dcn_shape:
        return
    if len(dcn_shape) != len(axes):
        raise ValueError(f"config.mesh.dcn_shape {tuple(dcn_shape)} and axes {tuple(axes)} differ in length")
    for size, axis in zip(dcn_shape, axes):
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"config.mesh.dcn_shape {tuple(dcn_shape)}: every entry is a slice count >= 1")
        if size > 1 and axis != DCN_AXIS:
            raise ValueError(f"config.mesh.dcn_shape {tuple(dcn_shape)} puts the {axis!r} axis across slices; "
                             f"only {DCN_AXIS!r} may cross them (set its entry to 1)")


def slice_index(device: Any) -> int:
    """The slice (DCN granule) a device is in: TPU devices carry it; elsewhere a process's
    devices are one granule (a GPU node), jax's `process_is_granule`."""
    if device.platform == "tpu":
        return getattr(device, "slice_index", 0)  # a single slice's devices may lack it
    return device.process_index


def device_slices(devices: Sequence[Any]) -> list[int]:
    return [slice_index(d) for d in devices]

# Ready-made rule sets, selectable by name in a config (`sharding_rules = "fsdp"`). `layers`,
# the leading axis of scanned blocks' stacked parameters (model.scan_layers), is never split:
# every device runs every block (as MaxText's rules).
RULES: dict[str, tuple[tuple[str, Any], ...]] = {
    "replicated": (("batch", BATCH_AXES), ("layers", None)),
    "fsdp": (("batch", BATCH_AXES), ("embed", "fsdp"), ("vocab", "fsdp"), ("layers", None)),
    "tensor": (("batch", BATCH_AXES), ("mlp", "tensor"), ("heads", "tensor"), ("vocab", "tensor"), ("layers", None)),
    "fsdp_tensor": (("batch", BATCH_AXES), ("embed", "fsdp"), ("mlp", "tensor"), ("heads", "tensor"),
                    ("vocab", "tensor"), ("layers", None)),
}


def _resolve_shape(shape: Sequence[int], axes: Sequence[str], count: int, where: str) -> tuple[int, ...]:
    shape = list(shape)
    if len(shape) != len(axes):
        raise ValueError(f"mesh shape {shape} and axes {list(axes)} differ in length")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if count % known:
            raise ValueError(f"mesh shape {shape} does not divide {count} devices{where}")
        shape[shape.index(-1)] = count // known
    if math.prod(shape) != count:
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices{where}, {count} available")
    return tuple(shape)


class _Granule:
    """A device seen through `slice_index`, for jax's hybrid-mesh helper (which reads the
    attribute): the same device wherever slices come from the process or a test's stand-in."""

    def __init__(self, device: Any):
        self.device, self.slice_index = device, slice_index(device)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.device, name)


def make_mesh(shape: Sequence[int], axes: Sequence[str], devices: Sequence[jax.Device] | None = None,
              dcn_shape: Sequence[int] = ()) -> Mesh:
    """A mesh of `shape` over `axes` (one entry may be -1: all remaining devices). With a
    `dcn_shape` of more than one slice, `shape` is each slice's mesh and the result jax's hybrid
    mesh (`mesh_utils.create_hybrid_device_mesh`): axis sizes shape x dcn_shape, slice-major."""
    devices = list(jax.devices() if devices is None else devices)
    slices = math.prod(dcn_shape) if dcn_shape else 1
    per_slice = collections.Counter(device_slices(devices))  # slice -> its device count
    found = sorted(per_slice)
    if slices == 1:
        if len(found) > 1 and devices[0].platform == "tpu":  # elsewhere a flat mesh over hosts is fine
            raise ValueError(f"the devices are in {len(found)} slices: set config.mesh.dcn_shape, e.g. "
                             f"{tuple(len(found) if a == DCN_AXIS else 1 for a in axes)}, to lay the data axis "
                             "over them")
        shape = _resolve_shape(shape, axes, len(devices), "")
        # Auto axes: classic GSPMD propagation (jax.make_mesh defaults to Explicit in jax >= 0.10).
        return jax.make_mesh(shape, tuple(axes), axis_types=(AxisType.Auto,) * len(axes), devices=devices)
    check_dcn_shape(dcn_shape, axes)
    if len(found) != slices:
        raise ValueError(f"config.mesh.dcn_shape {tuple(dcn_shape)} spans {slices} slices; the devices are in "
                         f"{len(found)}")
    counts = [per_slice[s] for s in found]
    if len(set(counts)) > 1:
        raise ValueError(f"the slices hold different device counts {counts}: a hybrid mesh needs equal slices")
    ici = _resolve_shape(shape, axes, counts[0], " per slice")
    granules = mesh_utils.create_hybrid_device_mesh(ici, tuple(dcn_shape), [_Granule(d) for d in devices])
    grid = np.vectorize(lambda g: g.device, otypes=[object])(granules)
    mesh = Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))
    _SLICES[mesh] = slices
    return mesh


# The meshes make_mesh laid over several slices, and how many: what the loss lays its traffic by.
_SLICES: dict[Mesh, int] = {}


def mesh_slices(mesh: Mesh) -> int:
    """How many slices `make_mesh` laid the mesh's data axis over (1: one slice, as without
    config.mesh.dcn_shape, whatever the hosts)."""
    return _SLICES.get(mesh, 1)


def resolve_rules(rules: str | Sequence[Sequence[Any]]) -> tuple[tuple[str, Any], ...]:
    if isinstance(rules, str):
        if rules not in RULES:
            raise ValueError(f"unknown sharding rules {rules!r}; choose from {sorted(RULES)} or give pairs")
        return RULES[rules]
    return tuple((str(name), tuple(ax) if isinstance(ax, list) else ax) for name, ax in rules)


def batch_axes(mesh: Mesh) -> tuple[str, ...]:
    return tuple(a for a in BATCH_AXES if a in mesh.axis_names)


def num_batch_shards(mesh: Mesh) -> int:
    return math.prod(mesh.shape[a] for a in batch_axes(mesh))


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
    """Leading (batch) dimension split over the data-parallel axes, the rest replicated."""
    return NamedSharding(mesh, P(batch_axes(mesh), *([None] * (ndim - 1))))


def logical_shardings(boxed_tree: Any, mesh: Mesh, rules) -> Any:
    """NamedShardings for a tree of `nn.LogicallyPartitioned` boxes (or abstract boxes)."""
    specs = nn.get_partition_spec(boxed_tree)
    return nn.logical_to_mesh_sharding(specs, mesh, resolve_rules(rules))


def check_divisible(boxed_tree: Any, mesh: Mesh, rules) -> None:
    """Every parameter dimension divides over the mesh axes its logical axis maps to: else one
    line naming the parameter (jax would raise an IndivisibleError from deep inside the init)."""
    shardings = logical_shardings(boxed_tree, mesh, rules)
    shapes = nn.unbox(boxed_tree)
    for (path, shape), named in zip(jax.tree_util.tree_leaves_with_path(shapes), jax.tree.leaves(shardings)):
        for size, axes in zip(shape.shape, named.spec):
            parts = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
            if size % parts:
                name = "/".join(str(getattr(k, "key", k)) for k in path)
                raise ValueError(f"parameter {name} {tuple(shape.shape)}: its dimension {size} does not divide over "
                                 f"mesh axes {axes} ({parts} devices); change config.mesh.shape (e.g. fewer fsdp "
                                 "devices per slice) or config.sharding_rules")


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This host's rows -> global arrays sharded over the batch axes (multi-host safe)."""
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(v)), np.asarray(v))
            for k, v in local.items()}
