"""Global-batch PPCL on 8 fake CPU devices: dense sharded logits and the ppermute ring both
equal the single-device `ppcl.ppcl_loss` (loss and gradients of all six inputs, relative
error <= 1e-5), and the compiled ring never holds a b_local x B array.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from prolip_jax.core.objectives.prolip import ppcl
from conftest import max_rel_err

TOL = 1e-5
# (mesh shape, mesh axis names): the batch shards over the present ones of ("data", "fsdp").
MESHES = {"data8": ((8,), ("data",)), "data4_fsdp2": ((4, 2), ("data", "fsdp")),
          "data4_tensor2": ((4, 2), ("data", "tensor")), "fsdp2_data4": ((2, 4), ("fsdp", "data"))}


def _mesh(name: str) -> Mesh:
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
    shape, names = MESHES[name]
    return Mesh(np.array(jax.devices()[:8]).reshape(shape), names)


def _inputs(batch: int = 64, dim: int = 16, seed: int = 0):
    """Unit mu, spread logvar; a = 4, b = 0.5 so negatives weigh as much as positives (with the
    trained b = -10 a skipped or doubled ring block would hide below the tolerance)."""
    k = jax.random.split(jax.random.key(seed), 4)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    im, tm = unit(jax.random.normal(k[0], (batch, dim))), unit(jax.random.normal(k[1], (batch, dim)))
    il = -4.0 + jax.random.normal(k[2], (batch, dim))
    tl = -4.0 + jax.random.normal(k[3], (batch, dim))
    return im, il, tm, tl, jnp.float32(4.0), jnp.float32(0.5)


@pytest.fixture(scope="module")
def reference():
    args = _inputs()
    return args, jax.jit(jax.value_and_grad(ppcl.ppcl_loss, argnums=range(6)))(*args)


@pytest.mark.parametrize("impl", ppcl.IMPLS)
@pytest.mark.parametrize("mesh_name", MESHES)
def test_matches_single_device(reference, impl, mesh_name):
    mesh = _mesh(mesh_name)
    args, (ref_loss, ref_grads) = reference
    rows = NamedSharding(mesh, P(ppcl.mesh_batch_axes(mesh)))
    sharded = [jax.device_put(x, rows) for x in args[:4]] + list(args[4:])
    fn = ppcl.make_ppcl_loss(impl, mesh)
    loss, grads = jax.jit(jax.value_and_grad(fn, argnums=range(6)))(*sharded)
    assert max_rel_err(loss, ref_loss) <= TOL, (float(loss), float(ref_loss))
    for name, g, r in zip(("img_mu", "img_logvar", "txt_mu", "txt_logvar", "scale", "bias"), grads, ref_grads):
        assert g.shape == r.shape, name
        assert max_rel_err(g, r) <= TOL, (name, max_rel_err(g, r))
        assert float(jnp.max(jnp.abs(r))) > 1e-4, name  # the gradient is not trivially ~0


def test_every_pair_counted_once():
    """Independent check of the pair sum: float64 numpy, each (i, j) written out."""
    mesh = _mesh("data4_fsdp2")
    im, il, tm, tl, a, b = (np.asarray(x, np.float64) for x in _inputs(batch=16, dim=4, seed=1))
    total = 0.0
    for i in range(16):
        for j in range(16):
            logit = a * (im[i] @ tm[j] - (np.exp(il[i]).sum() + np.exp(tl[j]).sum()) / 2) + b
            total += np.logaddexp(0.0, -logit if i == j else logit)  # -log sigmoid(z * logit)
    ring = jax.jit(ppcl.make_ppcl_loss("ring", mesh))(*_inputs(batch=16, dim=4, seed=1))
    assert abs(float(ring) - total / 16) <= TOL * total / 16


def test_dispatch_errors():
    mesh = _mesh("data8")
    with pytest.raises(ValueError, match="unknown PPCL"):
        ppcl.make_ppcl_loss("gather", mesh)
    with pytest.raises(ValueError, match="needs the mesh"):
        ppcl.make_ppcl_loss("ring")
    with pytest.raises(ValueError, match="does not divide"):
        ppcl.ppcl_loss_ring(*_inputs(batch=12), mesh=mesh)
    single = ppcl.global_ppcl_loss("dense", *_inputs())  # no mesh: the plain formula
    assert float(single) == float(ppcl.ppcl_loss(*_inputs()))


def _temp_bytes(impl: str, mesh: Mesh, batch: int, dim: int) -> int:
    """Compiled per-device temp memory of loss + gradients (nothing is executed)."""
    rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    specs = [jax.ShapeDtypeStruct((batch, dim), jnp.float32, sharding=rows)] * 4
    specs += [jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)] * 2
    fn = jax.value_and_grad(ppcl.make_ppcl_loss(impl, mesh), argnums=range(6))
    stats = jax.jit(fn).lower(*specs).compile().memory_analysis()
    if stats is None or stats.temp_size_in_bytes <= 0:
        pytest.skip("this backend reports no compiled temp memory")
    return stats.temp_size_in_bytes


def test_ring_memory_is_not_b_local_times_b():
    # D = 16, so the b x B logits dominate dense; b_local = 64 on 4 and on 8 devices.
    mesh4, mesh8 = (Mesh(np.array(_mesh("data8").devices[:n]), ("data",)) for n in (4, 8))
    ring4, ring8 = _temp_bytes("ring", mesh4, 256, 16), _temp_bytes("ring", mesh8, 512, 16)
    dense4, dense8 = _temp_bytes("dense", mesh4, 256, 16), _temp_bytes("dense", mesh8, 512, 16)
    b_by_batch = 64 * 512 * 4  # bytes of one [b_local, B] float32 array at B = 512
    assert ring8 < b_by_batch <= dense8, (ring8, b_by_batch, dense8)
    # Same b_local, twice the global batch: the ring's memory stays, dense's doubles.
    assert ring8 <= 1.1 * ring4 and dense8 >= 1.8 * dense4, (ring4, ring8, dense4, dense8)
    # D = 768 (B/16 width): dense also gathers the [B, D] texts; the ring is several times smaller.
    ring, dense = _temp_bytes("ring", mesh8, 512, 768), _temp_bytes("dense", mesh8, 512, 768)
    assert 3 * ring < dense, (ring, dense)
