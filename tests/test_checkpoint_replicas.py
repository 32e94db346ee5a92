"""Saving replicated parameters compiles nothing: orbax's replica-parallel save cuts each
replica's slice with an eager `lax.slice` (one XLA compile per array shape and device);
prolip_jax.core.checkpoint has one replica write every array whose slices would be under
REPLICA_PARALLEL_MIN_BYTES, and the arrays read back exactly."""
from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from prolip_jax.core import checkpoint


def test_saving_replicated_params_on_8_devices_compiles_no_slices(micro, tmp_path, caplog):
    model, params = micro
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    replicated = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        checkpoint.save_params(tmp_path / "ckpt", replicated, model.config)
    slices = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling jit(slice)")]
    assert not slices, f"{len(slices)} slice compiles, e.g. {slices[0][:200]}"
    back, _, _ = checkpoint.load_params(tmp_path / "ckpt")
    jax.tree.map(np.testing.assert_array_equal, back, params)
