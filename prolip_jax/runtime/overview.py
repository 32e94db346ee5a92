"""The parameter table big_vision prints at the start of a run, from `clu.parameter_overview`.

    print(parameter_table(params))
    print(write_parameter_table(workdir, params))   # the table to a file, one summary line back

clu's table (name, shape, dtype, size, and the PartitionSpec of each sharded jax.Array) and its
total, then one line per top-level entry (the towers `visual` and `text`, `logit_scale`,
`logit_bias`). Only shapes, dtypes and shardings are read: no value leaves the devices, so every
host of a multi-host run can build it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
from clu import parameter_overview

from prolip_jax.runtime import paths

PARAMETERS_NAME = "parameters.txt"


def _size(tree: Any) -> tuple[int, int]:
    """(parameter count, bytes) of a pytree of arrays (or one array)."""
    leaves = jax.tree.leaves(tree)
    return (int(sum(np.prod(x.shape, dtype=np.int64) for x in leaves)),
            int(sum(np.prod(x.shape, dtype=np.int64) * np.dtype(x.dtype).itemsize for x in leaves)))


def tower_totals(params: Mapping[str, Any]) -> dict[str, int]:
    """Parameter count of each top-level entry, in the params' order."""
    return {key: _size(value)[0] for key, value in params.items()}


def parameter_table(params: Mapping[str, Any]) -> str:
    """clu.parameter_overview's table of `params` (with a sharding column when they are sharded
    jax.Arrays), its total, and the total of each top-level entry."""
    sharded = any(hasattr(getattr(x, "sharding", None), "spec") for x in jax.tree.leaves(params))
    # "sharding" reads x.sharding.spec; no mean/std columns (they would pull every value to host).
    table = parameter_overview.get_parameter_overview(dict(params), include_stats="sharding" if sharded else False)
    # clu's own total line prints floats for 0-d parameters (np.prod(()) == 1.0): ours instead.
    table = table.rsplit("\nTotal:", 1)[0]
    total, total_bytes = _size(params)
    width = max(len(k) for k in params) if params else 0
    lines = [table, f"Total: {total:,} parameters, {total_bytes:,} bytes; per top-level entry:"]
    for key, value in params.items():
        count, size = _size(value)
        lines.append(f"  {key:<{width}}  {count:>15,}  {100.0 * count / max(total, 1):5.1f}%  {size:,} bytes")
    return "\n".join(lines)


def summary(params: Mapping[str, Any]) -> str:
    """One line: the total and each top-level entry's count, largest first."""
    totals = sorted(tower_totals(params).items(), key=lambda kv: -kv[1])
    return (f"{_size(params)[0]:,} parameters (" + ", ".join(f"{k} {n:,}" for k, n in totals) + ")")


def write_parameter_table(workdir: str | Path, params: Mapping[str, Any]) -> str:
    """Writes the table to `<workdir>/parameters.txt`; returns the one line the trainer prints."""
    path = paths.join(workdir, PARAMETERS_NAME)  # local or a bucket (prolip_jax/runtime/paths.py)
    paths.write_text_atomic(path, parameter_table(params) + "\n")
    return f"{summary(params)}; the table: {path}"
