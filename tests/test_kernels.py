"""The Pallas kernels of `model.pallas_kernels` (prolip_jax/core/models/kernels.py) against the
XLA path they replace, forward and backward, in Pallas's interpreter on the CPU: LayerNorm
(transformer.layer_norm), the residual add + LayerNorm of a block's ln_2, and the MLP's bias +
activation (activations.gelu), for every activation. Float32, to float32 rounding (relative
2e-6 of the largest value: sums over a row in another order). Shapes whose rows and width do not
fill the last tile, and tiles made small so that several programs (and column blocks) share the
rows and the columns. The kernels lower to Triton for CUDA (an export, no GPU needed) and run per shard
under a batch-splitting mesh."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from prolip_jax.core import sharding
from prolip_jax.core.models import ProLIP, activations, get_config, kernels
from prolip_jax.core.models import transformer as T
from prolip_jax.core.models.transformer import BlockLevers

EPS = 1e-5


def close(got, want, rel=2e-6):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
    assert err <= rel, err


def arrays(shape, d, seed=0):
    rng = np.random.default_rng(seed)
    x, delta, ct, ct2 = (jnp.asarray(rng.normal(size=(*shape, d)) * 2 + 0.5, jnp.float32) for _ in range(4))
    scale, bias = (jnp.asarray(rng.normal(size=(d,)), jnp.float32) for _ in range(2))
    return x, delta, scale, bias, ct, ct2


def reference_ln(x, scale, bias):
    return T.layer_norm(x, scale, bias, EPS)


def kernel_ln(x, scale, bias):
    return kernels.layer_norm(x, scale, bias, EPS, jnp.float32)


# (TILE_ELEMENTS, COLUMNS, rows' leading shape, width): one program with a padded width; tiles of
# 4 rows of 256 (18 programs, the last one overhanging) and bias_act's 64-column blocks.
SIZES = [(8192, 1024, (3, 7), 40), (1024, 64, (70,), 200)]


@pytest.fixture(params=SIZES, ids=["one tile", "many tiles"])
def size(request, monkeypatch):
    tile, columns, shape, d = request.param
    monkeypatch.setattr(kernels, "TILE_ELEMENTS", tile)
    monkeypatch.setattr(kernels, "COLUMNS", columns)
    return shape, d


def test_layer_norm(size):
    shape, d = size
    x, _, scale, bias, ct, _ = arrays(shape, d)
    close(kernel_ln(x, scale, bias), reference_ln(x, scale, bias))
    want = jax.grad(lambda *a: jnp.sum(reference_ln(*a) * ct), argnums=(0, 1, 2))(x, scale, bias)
    got = jax.grad(lambda *a: jnp.sum(kernel_ln(*a) * ct), argnums=(0, 1, 2))(x, scale, bias)
    for g, w in zip(got, want):
        close(g, w)


def test_residual_add_and_layer_norm(size):
    shape, d = size
    x, delta, scale, bias, ct, ct2 = arrays(shape, d, seed=1)

    def reference(x, delta, scale, bias):
        h = x + delta
        return h, reference_ln(h, scale, bias)

    def kernel(x, delta, scale, bias):
        return kernels.add_layer_norm(x, delta, scale, bias, EPS, jnp.float32)

    for g, w in zip(kernel(x, delta, scale, bias), reference(x, delta, scale, bias)):
        close(g, w)

    def loss(fn):  # both outputs carry a gradient: the stream's and the normalised input's
        return lambda *a: jnp.sum(fn(*a)[0] * ct2) + jnp.sum(fn(*a)[1] * ct)

    want = jax.grad(loss(reference), argnums=(0, 1, 2, 3))(x, delta, scale, bias)
    got = jax.grad(loss(kernel), argnums=(0, 1, 2, 3))(x, delta, scale, bias)
    for g, w in zip(got, want):
        close(g, w)


@pytest.mark.parametrize("act", activations.ACTIVATIONS)
def test_bias_and_activation(monkeypatch, act):
    monkeypatch.setattr(kernels, "TILE_ELEMENTS", 1024)
    monkeypatch.setattr(kernels, "COLUMNS", 64)  # 16 rows x 64 columns: 3 x 4 programs, both overhanging
    x, _, _, bias, ct, _ = arrays((5, 9), 200, seed=2)

    def reference(x, bias):
        return T.gelu(x + bias, act)

    def kernel(x, bias):
        return kernels.bias_act(x, bias, act)

    close(kernel(x, bias), reference(x, bias))
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * ct), argnums=(0, 1))(x, bias)
    got = jax.grad(lambda *a: jnp.sum(kernel(*a) * ct), argnums=(0, 1))(x, bias)
    for g, w in zip(got, want):
        close(g, w)


def test_erf_is_float32_erf():
    x = jnp.linspace(-6.0, 6.0, 100_001, dtype=jnp.float32)
    assert float(jnp.abs(kernels.erf(x) - jax.lax.erf(x)).max()) <= 1e-6


def test_the_kernels_lower_to_triton_for_cuda():
    """What a GPU compiles: each kernel, forward and backward, as a Triton call in bfloat16 at the
    B/16 image tower's shapes (lowered for CUDA on this CPU host: the program, not its speed)."""
    s = jax.ShapeDtypeStruct
    x, p = s((256, 197, 768), jnp.bfloat16), s((768,), jnp.float32)
    hidden, hidden_bias = s((256 * 197, 3072), jnp.bfloat16), s((3072,), jnp.bfloat16)

    def round_trip(fn):
        def both(*args):
            out, vjp = jax.vjp(fn, *args)
            return vjp(out)
        return both

    cases = [(lambda x, s_, b: kernels.layer_norm(x, s_, b, EPS, jnp.bfloat16), (x, p, p)),
             (lambda x, d, s_, b: kernels.add_layer_norm(x, d, s_, b, EPS, jnp.bfloat16), (x, x, p, p)),
             (lambda x, b: kernels.bias_act(x, b, "gelu"), (hidden, hidden_bias))]
    for fn, args in cases:
        exported = jax.export.export(jax.jit(round_trip(fn)), platforms=["cuda"], disabled_checks=[
            jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
        assert exported.mlir_module().count("__gpu$xla.gpu.triton") == 2  # forward and backward


def test_per_shard_under_a_batch_mesh():
    """On a mesh that splits the batch each device runs the kernels on its rows (shard_map): the
    same values and gradients as one device, the parameter gradients summed over shards."""
    mesh = sharding.make_mesh((4, 2, 1), ("data", "fsdp", "tensor"), jax.devices()[:8])
    x, delta, scale, bias, ct, ct2 = arrays((16, 5), 24, seed=3)

    def loss(x, delta, scale, bias):
        h, y = kernels.add_layer_norm(x, delta, scale, bias, EPS, jnp.float32)
        z = kernels.bias_act(kernels.layer_norm(h, scale, bias, EPS, jnp.float32), bias, "gelu")
        return jnp.sum(y * ct) + jnp.sum(z * ct2)

    want = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(x, delta, scale, bias)
    rows = NamedSharding(mesh, P(("data", "fsdp")))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # as the step traces (step.py)
        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
        lowered = fn.lower(jax.device_put(x, rows), jax.device_put(delta, rows), scale, bias)
        got = lowered.compile()(jax.device_put(x, rows), jax.device_put(delta, rows), scale, bias)
    assert "shard_map" in str(lowered.as_text()) or "sdy.manual_computation" in lowered.as_text()
    close(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        close(g, w)


def test_the_lever_puts_the_kernels_in_the_blocks():
    model = ProLIP(get_config("micro"), attention_impl="xla", levers=BlockLevers(pallas_kernels=True))
    image, text = jnp.zeros((2, 16, 16, 3)), jnp.ones((2, 8), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), image, text)
    jaxpr = str(jax.make_jaxpr(lambda p: model.apply(p, image, text))(params))
    layers = get_config("micro").vision.layers + get_config("micro").text.layers
    assert jaxpr.count("pallas_call") >= 3 * layers  # ln_1, ln_2 with the residual, bias + GELU


def test_bfloat16_as_the_gpu_runs_them():
    """bfloat16 activations (the B/16 recipe's compute dtype), float32 parameters: the residual
    stream rounded to bfloat16 as `x + delta` is, the outputs in bfloat16; against the XLA path
    to bfloat16 rounding (relative 1e-2 of the largest value, values and gradients)."""
    x, delta, scale, bias, ct, ct2 = arrays((6,), 200, seed=4)
    x, delta, ct, ct2 = (a.astype(jnp.bfloat16) for a in (x, delta, ct, ct2))

    def reference(x, delta, scale, bias):
        h = x + delta
        return h, T.gelu(reference_ln(h, scale, bias).astype(jnp.bfloat16) + bias.astype(jnp.bfloat16), "gelu")

    def kernel(x, delta, scale, bias):
        h, y = kernels.add_layer_norm(x, delta, scale, bias, EPS, jnp.bfloat16)
        return h, kernels.bias_act(y, bias.astype(jnp.bfloat16), "gelu")

    for g, w in zip(kernel(x, delta, scale, bias), reference(x, delta, scale, bias)):
        assert g.dtype == w.dtype == jnp.bfloat16
        close(g, w, rel=1e-2)

    def loss(fn):
        return lambda *a: jnp.sum((fn(*a)[0] * ct2).astype(jnp.float32)) + jnp.sum((fn(*a)[1] * ct).astype(jnp.float32))

    want = jax.grad(loss(reference), argnums=(0, 1, 2, 3))(x, delta, scale, bias)
    got = jax.grad(loss(kernel), argnums=(0, 1, 2, 3))(x, delta, scale, bias)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        close(g, w, rel=1e-2)
