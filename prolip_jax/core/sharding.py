"""Device mesh from config and logical-axis rules -> parameter and batch shardings.

Parameters carry logical axis names (models/); `config.sharding_rules` maps each name to mesh
axes, e.g. replicated (every name -> None), FSDP ('embed' -> 'fsdp') or tensor-parallel
('mlp'/'heads'/'vocab' -> 'tensor'). The batch is split over `BATCH_AXES` ('data', 'fsdp').
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

BATCH_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """`config.mesh`: one entry of `shape` may be -1 (all remaining devices)."""

    shape: tuple[int, ...] = (-1, 1, 1)
    axes: tuple[str, ...] = ("data", "fsdp", "tensor")

    def validate(self) -> None:
        if len(self.shape) != len(self.axes):
            raise ValueError(f"config.mesh.shape {self.shape} and axes {self.axes} differ in length")

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


def make_mesh(shape: Sequence[int], axes: Sequence[str], devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh of `shape` over `axes`; one entry may be -1 (all remaining devices)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != len(axes):
        raise ValueError(f"mesh shape {shape} and axes {list(axes)} differ in length")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one -1")
    known = math.prod(s for s in shape if s != -1)
    if -1 in shape:
        if len(devices) % known:
            raise ValueError(f"mesh shape {shape} does not divide {len(devices)} devices")
        shape[shape.index(-1)] = len(devices) // known
    if math.prod(shape) != len(devices):
        raise ValueError(f"mesh shape {shape} needs {math.prod(shape)} devices, {len(devices)} available")
    # Auto axes: classic GSPMD propagation (jax.make_mesh defaults to Explicit in jax >= 0.10).
    return jax.make_mesh(tuple(shape), tuple(axes), axis_types=(AxisType.Auto,) * len(axes), devices=devices)


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


def global_batch(local: dict[str, np.ndarray], mesh: Mesh) -> dict[str, jax.Array]:
    """This host's rows -> global arrays sharded over the batch axes (multi-host safe)."""
    return {k: jax.make_array_from_process_local_data(batch_sharding(mesh, np.ndim(v)), np.asarray(v))
            for k, v in local.items()}
