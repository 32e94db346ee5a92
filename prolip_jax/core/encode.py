"""Batched encoding sharded over every host's devices: `Encoder`.

One padded-block loop serves every input: an in-memory array (every host holds all of it and
encodes rows h, h+P, h+2P, ...; the last block padded with copies of its final row) or the
batches of `input_pipeline.build_eval_iterator` (each host reads its own share; padding rows
have mask=False). Each block is split over this host's devices with one compiled shape per
tower, and the rows of all hosts are gathered back into record order, so every host ends with
the same float32 numpy arrays. `prolip_jax.load` and every evaluator encode through it.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prolip_jax.core.models.prolip import ProLIP
from prolip_jax.core.normalization import normalize_on_device

Progress = Callable[[int], None]


@functools.lru_cache(maxsize=8)
def _programs(model: ProLIP, normalization: str, shard: NamedSharding) -> dict[str, Callable]:
    """The jitted towers of `model` on `shard`'s devices, shared by every Encoder of the same
    model, normalisation and devices: a run's evaluators (and `scripts/evaluate.py`'s) each
    hold an Encoder, and each compiled its towers again for the same block shape."""
    def image_fn(params, images, keep_idx=None):
        if images.dtype == jnp.uint8:
            images = normalize_on_device(images, normalization)
        return model.apply({"params": params}, images, keep_idx, method=ProLIP.encode_image)

    def text_fn(params, tokens):
        return model.apply({"params": params}, tokens, method=ProLIP.encode_text)

    # One sharding for every output leaf: log sigma^2 is None for a tower without [UNC].
    return {"image": jax.jit(image_fn, out_shardings=shard), "text": jax.jit(text_fn, out_shardings=shard)}


class Encoder:
    """(mu [N, D] unit-norm, log sigma^2 [N, D]) for images or token ids, in fixed-size blocks
    (log sigma^2 None for a deterministic tower, `embed_unc=False`).

    images: float32 normalised or uint8 (normalised here with `normalization`) [N, S, S, 3].
    tokens: int32 [N, L]. `batch_size` is the block of one host. `last_throughput` holds the
    items/s of the latest call (this host's items).
    """

    def __init__(self, model: ProLIP, batch_size: int = 256, normalization: str = "openai",
                 devices: list[jax.Device] | None = None):
        self.model = model
        devices = devices or jax.local_devices()
        self.mesh = Mesh(np.array(devices), ("batch",))
        n = len(devices)
        self.batch_size = max(n, batch_size // n * n)  # divisible over the devices
        self.normalization = normalization
        self.last_throughput = 0.0
        self._placed = None  # (params given, params placed on this encoder's devices)
        self._shard = NamedSharding(self.mesh, P("batch"))
        self._fns = _programs(model, normalization, self._shard)

    # ---- inputs ------------------------------------------------------------------------
    def images(self, params: Any, images: np.ndarray, progress: Progress | None = None,
               keep_idx: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """An in-memory image array [N, S, S, 3]; keep_idx [N, K]: encode only those patches."""
        out = self.encode(params, "image", self.blocks(images, keep_idx), len(images), progress)
        return out["mu"], out.get("logvar")

    def texts(self, params: Any, tokens: np.ndarray, progress: Progress | None = None
              ) -> tuple[np.ndarray, np.ndarray | None]:
        tokens = np.asarray(tokens, np.int32)
        out = self.encode(params, "text", self.blocks(tokens), len(tokens), progress)
        return out["mu"], out.get("logvar")

    def dataset(self, params: Any, batches: Iterable[dict[str, np.ndarray]], n: int,
                progress: Progress | None = None, keep_idx: np.ndarray | None = None,
                fields: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        """Images of an eval iterator over n records -> {"mu", "logvar", *fields} [n, ...] in
        record order (fields: batch keys to gather too, e.g. "label")."""
        def blocks() -> Iterator[dict[str, np.ndarray]]:
            for b in batches:
                index = np.where(b["mask"], b["index"], -1)
                blk = {"input": b["image"], "index": index, **{f: b[f] for f in fields}}
                if keep_idx is not None:
                    blk["keep"] = keep_idx[np.maximum(index, 0)]
                yield blk
        return self.encode(params, "image", blocks(), n, progress)

    def blocks(self, x: np.ndarray, keep_idx: np.ndarray | None = None
               ) -> Iterator[dict[str, np.ndarray]]:
        """This host's rows h, h+P, ... of an array every host holds, in padded blocks (the
        same number on every host, so no host waits on a collective alone)."""
        h, p, bs = jax.process_index(), jax.process_count(), self.batch_size
        rows = np.arange(h, len(x), p)
        for b in range(-(-(-(-len(x) // p)) // bs)):
            idx = rows[b * bs:(b + 1) * bs]
            k = len(idx)
            take = np.concatenate([idx, np.full(bs - k, idx[-1] if k else 0)])  # copies of the last row
            blk = {"input": x[take], "index": np.where(np.arange(bs) < k, take, -1)}
            if keep_idx is not None:
                blk["keep"] = keep_idx[take]
            yield blk

    # ---- the loop ------------------------------------------------------------------------
    def encode(self, params: Any, tower: str, blocks: Iterable[dict[str, np.ndarray]], n: int,
               progress: Progress | None = None) -> dict[str, np.ndarray]:
        """Blocks {"input" [b, ...], "index" [b] (record, -1 = padding), ["keep"], *fields}
        -> {"mu", "logvar" (absent for a deterministic tower), *fields} [n, ...] in record
        order, the same on every host."""
        params = self.place(params)
        fn, bs = self._fns[tower], self.batch_size
        parts: dict[str, list[np.ndarray]] = {}
        items, start = 0, time.perf_counter()
        for blk in blocks:
            k = len(blk["index"])
            blk = {key: _pad(v, bs) for key, v in blk.items()}
            blk["index"][k:] = -1
            args = [blk["input"]] + ([blk["keep"]] if "keep" in blk else [])
            mu, lv = fn(params, *(jax.device_put(a, self._shard) for a in args))
            out = {"mu": np.asarray(mu), "logvar": None if lv is None else np.asarray(lv)}
            out.update({key: v for key, v in blk.items() if key not in ("input", "keep")})
            for key, v in out.items():
                if v is not None:
                    parts.setdefault(key, []).append(v)
            valid = int((blk["index"] >= 0).sum())
            items += valid
            if progress is not None:
                progress(valid)
        self.last_throughput = items / max(time.perf_counter() - start, 1e-9)
        if not parts:
            d = self.model.config.embed_dim
            return {"mu": np.zeros((0, d), np.float32), "logvar": np.zeros((0, d), np.float32)}
        local = {key: np.concatenate(v) for key, v in parts.items()}
        return _in_record_order(allgather(local), n)

    def place(self, params: Any) -> Any:
        """Parameters on this encoder's devices: replicated, unless already spread over exactly
        them (e.g. the trainer's sharded state on the same host's devices). Parameters spread
        over several hosts (a multi-host trainer's state) are gathered first."""
        if self._placed is not None and self._placed[0] is params:
            return self._placed[1]
        devices = set(self.mesh.devices.flat)
        leaves = jax.tree.leaves(params)
        placed = params
        if not all(isinstance(x, jax.Array) and x.sharding.device_set == devices for x in leaves):
            placed = jax.device_put(_host_local(params), NamedSharding(self.mesh, P()))
        self._placed = (params, placed)
        return placed


def _pad(x: np.ndarray, size: int) -> np.ndarray:
    """Rows padded to `size` with copies of the last one (one compiled shape per tower)."""
    x = np.asarray(x)
    if len(x) >= size:
        return x
    return np.concatenate([x, np.repeat(x[-1:], size - len(x), axis=0)])


def allgather(tree: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every host's rows, concatenated in process order (identity on one host)."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def _in_record_order(rows: dict[str, np.ndarray], n: int) -> dict[str, np.ndarray]:
    index = rows.pop("index")
    valid = index >= 0
    index = index[valid]
    found = np.zeros(n, bool)
    found[index] = True
    if not found.all():
        raise ValueError(f"{n - int(found.sum())} of {n} records could not be read (undecodable "
                         f"or missing; e.g. record {int(np.flatnonzero(~found)[0])})")
    out = {}
    for key, v in rows.items():
        o = np.empty((n, *v.shape[1:]), v.dtype)
        o[index] = v[valid]
        out[key] = o
    return out


def _host_local(params: Any) -> Any:
    """Parameters as arrays this host can read: leaves spread over other hosts' devices are
    replicated by one compiled program and read from a local device."""
    leaves = jax.tree.leaves(params)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return params
    mesh = next(x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding))
    full = jax.jit(lambda t: t, out_shardings=NamedSharding(mesh, P()))(params)
    return jax.tree.map(lambda x: x.addressable_data(0), full)
