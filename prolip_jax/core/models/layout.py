"""The two layouts of a tower's blocks in a parameter tree, and the one conversion between them.

    unrolled  `transformer/resblocks_{i}/...`, one subtree per block (config.model.scan_layers
              False; the PyTorch state_dict's `transformer.resblocks.{i}.*`)
    scanned   `transformer/resblocks/...`, every leaf stacked along a new leading [L] axis
              (logical name `layers`, sharding.py maps it to no mesh axis): one `nn.scan` over the
              blocks (transformer.Encoder, scan=True)

`to_layout(tree, scanned)` converts any tree holding parameter-shaped dicts: params, AdamW's
moments (an optax state is tuples of the same dicts), abstract shapes (`jax.ShapeDtypeStruct`,
sharding dropped), host numpy or device arrays. Whatever reads or writes weights (convert.py,
the importers, warm starts, checkpoint restores) calls it once at its boundary, so each takes
and gives either layout.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

UNROLLED_BLOCK = re.compile(r"^resblocks_(\d+)$")
SCANNED_BLOCKS = "resblocks"


def layout_of(tree: Any) -> bool | None:
    """True if `tree` holds scanned blocks, False if unrolled ones, None if it has no blocks."""
    found: list[bool] = []

    def visit(node):
        if isinstance(node, Mapping):
            if SCANNED_BLOCKS in node:
                found.append(True)
            elif any(UNROLLED_BLOCK.match(str(k)) for k in node):
                found.append(False)
            else:
                for v in node.values():
                    visit(v)
        elif isinstance(node, (tuple, list)):
            for v in node:
                visit(v)

    visit(tree)
    return found[0] if found else None


def to_layout(tree: Any, scanned: bool) -> Any:
    """`tree` with every tower's blocks in the scanned (True) or unrolled (False) layout; a tree
    already in that layout (or without blocks) comes back as it is. Give a train state's params
    and optimiser state together, `to_layout((params, opt_state), ...)`: a tower whose moments are
    all masked (locked) takes its number of blocks from the params."""
    depths: dict[tuple, int] = {}
    _collect_depths(tree, (), depths)
    return _convert(tree, scanned, (), depths)


def _collect_depths(node: Any, keys: tuple, depths: dict[tuple, int]) -> None:
    if isinstance(node, Mapping):
        if SCANNED_BLOCKS in node:
            leaves = [x for x in jax.tree.leaves(node[SCANNED_BLOCKS]) if _is_array(x)]
            if leaves:
                depths.setdefault(keys, int(leaves[0].shape[0]))
        for k, v in node.items():
            _collect_depths(v, keys + (k,), depths)
    elif isinstance(node, (tuple, list)):
        for v in node:
            _collect_depths(v, keys, depths)


def _convert(tree: Any, scanned: bool, keys: tuple, depths: dict[tuple, int]) -> Any:
    if isinstance(tree, Mapping):
        out = {k: _convert(v, scanned, keys + (k,), depths) for k, v in tree.items()}
        blocks = sorted((int(m.group(1)), k) for k in out if (m := UNROLLED_BLOCK.match(str(k))))
        if scanned and blocks:
            if [i for i, _ in blocks] != list(range(len(blocks))):
                raise ValueError(f"blocks {[k for _, k in blocks]} are not numbered 0..{len(blocks) - 1}")
            stacked = _map_trees(_stack, [out.pop(k) for _, k in blocks])
            return {**out, SCANNED_BLOCKS: stacked}
        if not scanned and SCANNED_BLOCKS in out:
            stacked = out.pop(SCANNED_BLOCKS)
            # An optimiser state nests the params' dicts under its own keys (multi_transform's
            # partition labels): the depth is the one found at the longest matching path suffix.
            found = [depths[keys[i:]] for i in range(len(keys)) if keys[i:] in depths]
            if not found:
                raise ValueError(f"{'/'.join(map(str, keys))}: scanned blocks without any array, their number "
                                 "is unknown (convert the params with them)")
            n = found[0]
            return {**out, **{f"resblocks_{i}": _map_trees(lambda xs, i=i: _take(xs[0], i), [stacked])
                              for i in range(n)}}
        return out
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # NamedTuple (optax states)
        return type(tree)(*(_convert(v, scanned, keys, depths) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_convert(v, scanned, keys, depths) for v in tree)
    return tree


def _map_trees(fn, trees: list[Any]) -> Any:
    """fn([leaf of each tree]) over trees of the same dict structure (leaves: arrays, shapes,
    None, optax.MaskedNode)."""
    first = trees[0]
    if isinstance(first, Mapping):
        keys = list(first)
        for t in trees[1:]:
            if not isinstance(t, Mapping) or list(t) != keys:
                raise ValueError(f"blocks differ in structure: {keys} vs {list(t) if isinstance(t, Mapping) else t}")
        return {k: _map_trees(fn, [t[k] for t in trees]) for k in keys}
    return fn(trees)


def _is_array(x: Any) -> bool:
    return hasattr(x, "shape") and hasattr(x, "dtype")


def _stack(leaves: list[Any]) -> Any:
    first = leaves[0]
    if not _is_array(first):  # None, optax.MaskedNode: a hole in every block or in none
        if not (first is None or first == ()):
            raise TypeError(f"cannot stack a {type(first).__name__} (boxed params: nn.unbox them first)")
        if any(type(x) is not type(first) for x in leaves):
            raise ValueError("some blocks have state and others not (a lock or group pattern that picks single "
                             "blocks); such a tree has no scanned layout")
        return first
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype)
    if all(isinstance(x, np.ndarray) or np.isscalar(x) for x in leaves):
        return np.stack(leaves)  # host arrays stay on the host (convert.py, warm starts)
    return jnp.stack(leaves)


def _take(x: Any, i: int) -> Any:
    if not _is_array(x):
        return x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return x[i]
