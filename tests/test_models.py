"""Towers against the golden reference fixture (float32), variants, masking, axis names."""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import max_rel_err
from prolip_jax.core.models import (VARIANTS, ProLIP, ProLIPConfig, abstract_params, count_params, get_config,
                               init_params, mask_text_tokens, num_kept_patches, random_keep_indices)

TOL = 1e-5  # max |a - e| / max |e| over each output array, float32


def _nhwc(images_nchw):
    return jnp.asarray(images_nchw.transpose(0, 2, 3, 1))


@pytest.fixture(scope="module")
def model(golden_config):
    return ProLIP(golden_config, attention_impl="xla")


def test_full_forward_matches_reference(model, golden, golden_params):
    out = jax.jit(model.apply)({"params": golden_params}, _nhwc(golden["images_nchw"]), jnp.asarray(golden["texts"]))
    for key in ("image_mean", "image_logvar", "text_mean", "text_logvar"):
        assert max_rel_err(out[key], golden[key]) <= TOL, key
    np.testing.assert_allclose(np.linalg.norm(out["image_mean"], axis=-1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(out["logit_scale"], golden["logit_scale_exp"], rtol=1e-6)
    np.testing.assert_allclose(out["logit_bias"], golden["logit_bias"])


def test_masked_forward_matches_reference(model, golden, golden_params):
    out = model.apply({"params": golden_params}, _nhwc(golden["images_nchw"][:2]),
                      jnp.asarray(golden["masked_texts"]), image_keep_idx=jnp.asarray(golden["image_keep_idx"]))
    assert max_rel_err(out["image_mean"], golden["masked_image_mean"]) <= TOL
    assert max_rel_err(out["image_logvar"], golden["masked_image_logvar"]) <= TOL
    assert max_rel_err(out["text_mean"], golden["masked_text_mean"]) <= TOL
    assert max_rel_err(out["text_logvar"], golden["masked_text_logvar"]) <= TOL


def test_per_sample_keep_indices_equal_shared_ones(model, golden, golden_params):
    """A [B, K] keep index with identical rows gives the shared-[K] result."""
    images = _nhwc(golden["images_nchw"][:2])
    keep = jnp.asarray(golden["image_keep_idx"])
    shared = model.apply({"params": golden_params}, images, None, image_keep_idx=keep)
    per_sample = model.apply({"params": golden_params}, images, None, image_keep_idx=jnp.stack([keep, keep]))
    np.testing.assert_allclose(per_sample["image_mean"], shared["image_mean"], atol=1e-6)
    # ... and different subsets give different outputs for the same image.
    other = model.apply({"params": golden_params}, images, None,
                        image_keep_idx=jnp.stack([keep, jnp.arange(4, 16)]))
    np.testing.assert_allclose(other["image_mean"][0], shared["image_mean"][0], atol=1e-6)
    assert np.abs(other["image_mean"][1] - shared["image_mean"][1]).max() > 1e-3


def test_text_uncertainty_is_wired_from_projected_cls(model, golden, golden_params):
    """naver-ai/prolip src/prolip/transformer.py TextTransformer: with W_u = 0 the text log sigma^2 equals b_u exactly; the image one does not."""
    params = jax.tree.map(lambda x: x, golden_params)
    params["text"]["text_uncertainty_projection"]["kernel"] = np.zeros_like(
        params["text"]["text_uncertainty_projection"]["kernel"])
    out = model.apply({"params": params}, None, jnp.asarray(golden["texts"]))
    bias = params["text"]["text_uncertainty_projection"]["bias"]
    np.testing.assert_array_equal(np.asarray(out["text_logvar"]), np.broadcast_to(bias, out["text_logvar"].shape))


def test_no_attention_mask_pad_tokens_matter(model, golden, golden_params):
    """Pad tokens take part in attention (no key-padding mask): changing a pad id changes the output."""
    tokens = np.array(golden["texts"][:1])
    pad_pos = int(np.where(tokens[0] == 1)[0][-1])
    changed = tokens.copy()
    changed[0, pad_pos] = 5
    a = model.apply({"params": golden_params}, None, jnp.asarray(tokens))["text_mean"]
    b = model.apply({"params": golden_params}, None, jnp.asarray(changed))["text_mean"]
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-4


def test_b16_parameter_count():
    params = abstract_params(get_config("B/16"))
    assert count_params(params) == 197_923_586


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_dicts_round_trip(name):
    cfg = get_config(name)
    assert ProLIPConfig.from_dict(cfg.to_dict()) == cfg


def test_variant_sizes_match_reference():
    so = get_config("So400m/14")
    assert (so.vision.heads, so.vision.mlp_dim, so.vision.num_patches) == (16, 4304, 256)
    h = get_config("H/14")
    assert h.quick_gelu and h.text.ln_eps == 1e-5 and h.vision.heads == 16 and h.text.context_length == 77
    assert get_config("B/16").text.ln_eps == 1e-6 and get_config("B/16").vision.ln_eps == 1e-5
    assert get_config("L/16").vision.num_patches == 256


def test_init_values(golden_config):
    params = init_params(golden_config, jax.random.key(0))
    assert math.isclose(float(params["logit_scale"]), math.log(10.0), rel_tol=1e-6)  # the paper's a = 10
    assert float(params["logit_bias"]) == -10.0
    np.testing.assert_array_equal(params["visual"]["uncertainty_proj"]["bias"], -10.0)
    np.testing.assert_array_equal(params["text"]["text_uncertainty_projection"]["bias"], -10.0)
    # Fresh model: log sigma^2 starts near the -10 bias.
    cfg = golden_config.replace(init_logit_scale=math.log(1 / 0.07))
    params = init_params(cfg, jax.random.key(0))
    assert math.isclose(float(params["logit_scale"]), math.log(1 / 0.07), rel_tol=1e-6)


def test_every_parameter_has_logical_axis_names(golden_config):
    model = ProLIP(golden_config)
    boxed = jax.eval_shape(lambda r: model.init(r, jnp.zeros((1, 32, 32, 3)), jnp.ones((1, 16), jnp.int32)),
                           jax.random.key(0))["params"]
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))
    assert leaves and all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
    for leaf in leaves:
        assert len(leaf.names) == len(leaf.value.shape)
        named = [n for n in leaf.names if n is not None]
        assert len(named) == len(set(named)), leaf.names  # one mesh axis per name at most


def test_bfloat16_compute_keeps_float32_params_and_outputs(golden_config, golden, golden_params):
    model = ProLIP(golden_config, dtype=jnp.bfloat16, attention_impl="xla")
    out = model.apply({"params": golden_params}, _nhwc(golden["images_nchw"]), jnp.asarray(golden["texts"]))
    assert out["image_mean"].dtype == jnp.float32 and out["text_logvar"].dtype == jnp.float32
    # bf16 has an 8-bit mantissa: loose agreement only.
    assert max_rel_err(out["image_mean"], golden["image_mean"]) < 0.05
    assert max_rel_err(out["text_logvar"], golden["text_logvar"]) < 0.05


def test_remat_gives_same_gradients(golden_config, golden, golden_params):
    images, tokens = _nhwc(golden["images_nchw"][:2]), jnp.asarray(golden["texts"][:2])

    def grads(remat):
        m = ProLIP(golden_config, remat=remat, attention_impl="xla")
        return jax.jit(jax.grad(lambda p: m.apply({"params": p}, images, tokens)["image_logvar"].sum()))(
            golden_params)

    # Recomputation compiles the blocks differently, so float32 rounding may differ: gradients
    # here are O(1) (largest 2.0), and the key biases' are 0 in exact arithmetic (softmax ignores
    # a shift of every logit), pure rounding noise of ~1e-7; hence atol 1e-6.
    a, b = grads("none"), grads("full")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_bad_inputs_raise(model, golden_params):
    with pytest.raises(ValueError, match=r"expected images \[B, 32, 32, 3\]"):
        model.apply({"params": golden_params}, jnp.zeros((1, 3, 32, 32)), None)
    with pytest.raises(ValueError, match="exceeds context_length 16"):
        model.apply({"params": golden_params}, None, jnp.ones((1, 17), jnp.int32))


def test_config_errors_are_clear():
    with pytest.raises(ValueError, match="unknown key"):
        ProLIPConfig.from_dict({"embed_dim": 8, "vision_cfg": {"embed_unc": True, "bogus": 1}})
    with pytest.raises(ValueError, match="vision_cfg.embed_unc=False"):
        ProLIPConfig.from_dict({"embed_dim": 768, "vision_cfg": {}, "text_cfg": {}})
    with pytest.raises(ValueError, match="no_causal_mask"):
        ProLIPConfig.from_dict({"vision_cfg": {"embed_unc": True}, "text_cfg": {"no_causal_mask": False}})
    with pytest.raises(ValueError, match="must equal embed_dim"):
        get_config("B/16", embed_dim=512)
    with pytest.raises(ValueError, match="unknown model variant"):
        get_config("B/17")


def test_keep_indices():
    idx = random_keep_indices(jax.random.key(0), 196, 0.75)
    assert idx.shape == (147,) and idx.dtype == jnp.int32  # int(196 * 0.75), naver-ai/prolip src/prolip_train/train.py
    assert np.all(np.diff(np.asarray(idx)) > 0) and idx.max() < 196
    per = random_keep_indices(jax.random.key(0), 16, 0.75, batch=4)
    assert per.shape == (4, 12) and np.all(np.diff(np.asarray(per), axis=-1) > 0)
    assert len({tuple(r) for r in np.asarray(per)}) > 1
    assert num_kept_patches(16, 1.0) == 16
    with pytest.raises(ValueError):
        num_kept_patches(16, 0.01)


def test_mask_text_tokens_never_touches_protected_ids():
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, 900, size=(64, 32)), jnp.int32)
    tokens = tokens.at[:, 20:].set(1)  # pad == EOS == 1 tail
    masked = np.asarray(mask_text_tokens(jax.random.key(1), tokens, mask_id=999, prob=0.75))
    tokens = np.asarray(tokens)
    np.testing.assert_array_equal(masked[:, 20:], 1)
    changed = masked[:, :20] != tokens[:, :20]
    assert np.all(masked[:, :20][changed] == 999)
    assert 0.70 < changed.mean() < 0.80  # 1280 Bernoulli(0.75) draws
    none = np.asarray(mask_text_tokens(jax.random.key(1), jnp.asarray(tokens), 999, prob=0.0))
    np.testing.assert_array_equal(none, tokens)
    clip = np.asarray(mask_text_tokens(jax.random.key(2), jnp.asarray(tokens), 999, 1.0, protected_ids=(1, 5)))
    assert np.all((clip == 999) | (tokens == 1) | (tokens == 5))


def test_deterministic_tower_layouts():
    """The CLIP / SigLIP options of the same towers: which parameters exist, the position rows,
    and names shared with ProLIP (so a partial load into a ProLIP matches by name)."""
    import dataclasses

    from prolip_jax.core.models.config import TextConfig, VisionConfig

    prolip = get_config("tiny")
    v, t = prolip.vision, prolip.text
    clip = prolip.replace(vision=dataclasses.replace(v, embed_unc=False),
                          text=dataclasses.replace(t, embed_unc=False, pool="argmax", causal=True, proj_bias=False))
    siglip = prolip.replace(
        vision=dataclasses.replace(v, embed_unc=False, class_token=False, pool="map", ln_pre=False, patch_bias=True,
                                   proj=False, act="gelu_tanh"),
        text=dataclasses.replace(t, embed_unc=False, pool="last"))
    p, c, s = (abstract_params(cfg) for cfg in (prolip, clip, siglip))
    grid = v.num_patches
    assert [x["visual"]["positional_embedding"].shape[0] for x in (p, c, s)] == [grid + 2, grid + 1, grid]
    assert [x["text"]["positional_embedding"].shape[0] for x in (p, c, s)] == [18, 16, 16]
    assert set(c["visual"]) == set(p["visual"]) - {"unc_embedding", "uncertainty_proj"}
    assert set(s["visual"]) == set(p["visual"]) - {"unc_embedding", "uncertainty_proj", "class_embedding", "ln_pre",
                                                   "proj"} | {"patch_bias", "map_head"}
    assert set(c["text"]) == set(p["text"]) - {"cls_emb", "unc_emb", "text_uncertainty_projection"}
    assert "bias" not in c["text"]["text_projection"] and "bias" in s["text"]["text_projection"]
    assert set(s["visual"]["map_head"]) == {"probe", "attn", "ln", "c_fc", "c_proj"}
    for cfg in (clip, siglip):
        assert ProLIPConfig.from_dict(cfg.to_dict()) == cfg
    assert isinstance(clip.vision, VisionConfig) and isinstance(clip.text, TextConfig)
    with pytest.raises(ValueError, match="pool 'tok' needs class_token"):
        prolip.replace(vision=dataclasses.replace(v, class_token=False))
    with pytest.raises(ValueError, match="text pool 'prolip'"):
        prolip.replace(text=dataclasses.replace(t, embed_unc=False))
    with pytest.raises(ValueError, match="no causal mask"):
        prolip.replace(text=dataclasses.replace(t, causal=True))


def test_materialize_cotangent_is_the_identity_and_fences_only_on_cpu():
    from prolip_jax.core.models.transformer import materialize_cotangent

    x = jnp.linspace(-2.0, 3.0, 12).reshape(3, 4)
    f = lambda x: jnp.sum(jnp.sin(materialize_cotangent(x)) * x)  # noqa: E731
    want = jnp.sin(x) + x * jnp.cos(x)
    np.testing.assert_array_equal(jax.jit(jax.grad(f))(x), want)
    # A NaN gradient stays non-finite (the fence's other branch): the step's guard still sees it.
    g = jax.jit(jax.grad(lambda x: jnp.sum(materialize_cotangent(x) * jnp.where(x < -1.9, jnp.nan, 1.0))))(x)
    assert not np.isfinite(np.asarray(g)).any()
    # The fence (a conditional on `g[0] == g[0]`) is in the CPU program only.
    traced = jax.jit(jax.grad(f)).trace(x)
    assert "stablehlo.compare" in traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "stablehlo.compare" not in traced.lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("d_in,d_out", [(4, 6), (6, 4)])  # x narrower than dy, and dy narrower
def test_dense_gradients_and_their_cpu_form(d_in, d_out):
    """dense's value and both gradients against float64 numpy (float32, rel 1e-6); on CPU the
    kernel gradient goes through barriers (explicit transposes), elsewhere it is autodiff's dot."""
    from prolip_jax.core.models.transformer import dense

    rng = np.random.default_rng(0)
    x, k, w = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, d_in), (d_in, d_out), (2, 3, d_out)))
    loss = lambda x, k: jnp.sum(dense(x, k) * w)  # noqa: E731  (so dy = w)
    dx, dk = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, k)
    x64, k64, w64 = (a.astype(np.float64) for a in (x, k, w))
    np.testing.assert_allclose(dense(x, k), x64 @ k64, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dx, w64 @ k64.T, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dk, x64.reshape(-1, d_in).T @ w64.reshape(-1, d_out), rtol=1e-6, atol=1e-6)
    traced = jax.jit(jax.grad(loss, argnums=(0, 1))).trace(x, k)
    assert "optimization_barrier" in traced.lower(lowering_platforms=("cpu",)).as_text()
    for platform in ("cuda", "tpu"):
        text = traced.lower(lowering_platforms=(platform,)).as_text()
        assert "optimization_barrier" not in text and text.count("stablehlo.dot_general") == 2, platform
        assert "contracting_dims = [0, 1] x [0, 1]" in text, platform  # x^T dy over (batch, length)


def test_layer_norm_gradients_against_float64_finite_differences():
    """layer_norm's closed-form backward against central differences of its forward in float64
    numpy (h = 1e-6); the float32 gradients within 2e-5 of the largest entry."""
    from prolip_jax.core.models.transformer import layer_norm

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 3, 5)) * 3 + 1, rng.standard_normal((2, 3, 5))  # w = dL/dy
    scale, bias, eps = rng.standard_normal(5), rng.standard_normal(5), 1e-5

    def loss64(x, scale, bias):
        mean = x.mean(-1, keepdims=True)
        y = (x - mean) / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps) * scale + bias
        return np.sum(y * w)

    def numeric(i):
        args, out = [x, scale, bias], np.zeros_like([x, scale, bias][i])
        for idx in np.ndindex(out.shape):
            up, down = [a.copy() for a in args], [a.copy() for a in args]
            up[i][idx] += 1e-6
            down[i][idx] -= 1e-6
            out[idx] = (loss64(*up) - loss64(*down)) / 2e-6
        return out

    f32 = [jnp.asarray(a, jnp.float32) for a in (x, scale, bias)]
    loss = lambda *a: jnp.sum(layer_norm(*a, eps) * jnp.asarray(w, jnp.float32))  # noqa: E731
    np.testing.assert_allclose(loss(*f32), loss64(x, scale, bias), rtol=1e-5)
    for i, got in enumerate(jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*f32)):
        want = numeric(i)
        assert np.abs(np.asarray(got, np.float64) - want).max() <= 2e-5 * np.abs(want).max(), i


@pytest.mark.parametrize("causal,s", [(False, 7), (True, 5)])  # cross-attention (s != t) and causal self-attention
def test_attention_xla_equals_jax_and_is_cpu_only(causal, s):
    """attention_xla (on CPU: heads-major einsums) against jax.nn.dot_product_attention: values
    and the three gradients within float32 rounding (rel 1e-5); other platforms get jax's own."""
    from prolip_jax.core.models.transformer import attention_xla

    rng = np.random.default_rng(0)
    t = s if causal else 5
    q, (k, v), w = (jnp.asarray(rng.standard_normal((2, t, 3, 8)), jnp.float32),
                    (jnp.asarray(rng.standard_normal((2, s, 3, 8)), jnp.float32) for _ in range(2)),
                    jnp.asarray(rng.standard_normal((2, t, 3, 8)), jnp.float32))
    ours = lambda q, k, v: jnp.sum(attention_xla(q, k, v, causal) * w)  # noqa: E731
    theirs = lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(q, k, v, is_causal=causal) * w)  # noqa: E731
    for a, b in zip(jax.jit(jax.value_and_grad(ours, (0, 1, 2)))(q, k, v),
                    jax.jit(jax.value_and_grad(theirs, (0, 1, 2)))(q, k, v)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert max_rel_err(x, y) <= 1e-5
    if causal:  # the first token sees only itself: its output is v's first token
        np.testing.assert_allclose(attention_xla(q, k, v, True)[:, 0], v[:, 0], rtol=1e-6)
    traced = jax.jit(ours).trace(q, k, v)
    cpu, tpu = (traced.lower(lowering_platforms=(p,)).as_text() for p in ("cpu", "tpu"))
    assert "0, 2, 1, 3" in cpu and "0, 2, 1, 3" not in tpu  # the heads-major transposes, CPU only


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_the_mesh_platform_picks_the_branch_while_tracing(platform):
    """Under an abstract mesh that names its devices' platform (the train step's, or a TPU
    topology's in benchmarks/compile_tpu.py) dense, attention_xla and materialize_cotangent trace
    only that platform's branch (no platform_index left to decide at lowering); on CPU the
    gradients are bitwise those of the undecided program."""
    from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

    from prolip_jax.core.models.transformer import attention_xla, dense, materialize_cotangent

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 5, 3, 8)), jnp.float32) for _ in range(3))
    kernel = jnp.asarray(rng.standard_normal((24, 24)), jnp.float32)

    def loss(q, kernel):
        x = materialize_cotangent(dense(q.reshape(2, 5, 24), kernel)).reshape(2, 5, 3, 8)
        return jnp.sum(attention_xla(x, k, v, True) ** 2)

    grad = jax.jit(jax.grad(loss, (0, 1)))
    mesh = AbstractMesh((1,), ("data",), abstract_device=AbstractDevice(
        device_kind="any", num_cores=None, platform=platform))
    with use_abstract_mesh(mesh):
        decided = grad.trace(q, kernel)
    assert "platform_index" in str(grad.trace(q, kernel).jaxpr)
    assert "platform_index" not in str(decided.jaxpr)
    text = decided.lower(lowering_platforms=(platform,)).as_text()
    assert ("optimization_barrier" in text) == (platform == "cpu")   # dense's CPU-only kernel gradient
    if platform == "cpu":
        with use_abstract_mesh(mesh):
            got = grad(q, kernel)
        for a, b in zip(got, grad(q, kernel)):
            np.testing.assert_array_equal(a, b)
