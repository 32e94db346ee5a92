"""The other papers' heads on the ProLIP towers: GPO, PCME++'s duplicated block, Pishdad et
al.'s duplicated embedding layer, SizeAugment, axis names, sharding, export refusal."""
from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prolip_jax.core import convert
from prolip_jax.core import sharding
from prolip_jax.core.models import ProLIP, ProLIPConfig, abstract_params, dummy_inputs, get_config
from prolip_jax.core.models.config import with_overrides
from prolip_jax.core.models.heads import GPO, size_augment_keep, size_augment_tokens
from prolip_jax.core.models.text import TextTower
from prolip_jax import export


# ------------------------------------------------------------------------------ numpy GPO
def _np_gru(x, p, reverse):
    """torch.nn.GRU, one direction, float64; x [n, F] -> [n, H]."""
    w_ih, w_hh, b_ih, b_hh = (np.asarray(p[k], np.float64) for k in ("w_ih", "w_hh", "b_ih", "b_hh"))
    hd = w_hh.shape[0]
    sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    h, out = np.zeros(hd), np.zeros((len(x), hd))
    for k in (range(len(x) - 1, -1, -1) if reverse else range(len(x))):
        gi, gh = x[k] @ w_ih + b_ih, h @ w_hh + b_hh
        r, z = sig(gi[:hd] + gh[:hd]), sig(gi[hd:2 * hd] + gh[hd:2 * hd])
        n = np.tanh(gi[2 * hd:] + r * gh[2 * hd:])
        h = (1 - z) * n + z * h
        out[k] = h
    return out


def _np_gpo(feats, mask, p, dim):
    """vse_infty lib/modules/aggr/gpo.py GPO.forward for one sample (its n valid tokens)."""
    x = np.asarray(feats, np.float64)[np.asarray(mask)]
    n = len(x)
    pos = np.arange(n)[:, None]
    div = np.exp(np.arange(0, dim, 2) * -(math.log(10000.0) / dim))
    pe = np.zeros((n, dim))
    pe[:, 0::2], pe[:, 1::2] = np.sin(pos * div), np.cos(pos * div)
    out = (_np_gru(pe, p["gru_fwd"], False) + _np_gru(pe, p["gru_bwd"], True)) / 2
    s = (out @ np.asarray(p["linear"], np.float64))[:, 0] / 0.1
    w = np.exp(s - s.max())
    w /= w.sum()
    return (-np.sort(-x, axis=0) * w[:, None]).sum(0)


@pytest.fixture(scope="module")
def gpo_setup():
    dim, b, k, d = 8, 4, 9, 5
    rng = np.random.default_rng(0)
    feats = rng.normal(size=(b, k, d)).astype(np.float32) * 3
    mask = np.ones((b, k), bool)
    mask[1, 6:] = False  # text-style padding
    mask[2, [0, 3, 4]] = False  # dropped tokens anywhere (SizeAugment)
    mask[3, 1:] = False  # a single valid token
    gpo = GPO(dim)
    params = nn.unbox(jax.jit(gpo.init)(jax.random.key(1), feats, mask))
    apply = jax.jit(lambda f, m: gpo.apply(params, f, m, method=GPO.pool))
    return apply, params, feats, mask, dim


def test_gpo_equals_float64_numpy_reference(gpo_setup):
    apply, params, feats, mask, dim = gpo_setup
    got = np.asarray(apply(feats, mask)[0])
    ref = np.stack([_np_gpo(feats[i], mask[i], params["params"], dim) for i in range(len(feats))])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    # no valid token at all: 0, not NaN
    empty = np.asarray(apply(feats, mask & False)[0])
    np.testing.assert_array_equal(empty, 0.0)


def test_gpo_masks_padding_and_sorts_per_dimension(gpo_setup):
    apply, params, feats, mask, _ = gpo_setup
    pooled, weights = apply(feats, mask)
    noisy = np.where(mask[..., None], feats, 1e3 * np.random.default_rng(1).normal(size=feats.shape))
    np.testing.assert_allclose(apply(noisy.astype(np.float32), mask)[0], pooled, rtol=1e-6, atol=1e-6)
    perm = np.random.default_rng(2).permutation(feats.shape[1])  # token order does not matter
    np.testing.assert_allclose(apply(feats[:, perm], mask[:, perm])[0], pooled, rtol=1e-5, atol=1e-6)
    # pooled = sum_k w_k * (k-th largest value of each dimension), weights only on the n valid slots
    i = 0
    w = np.asarray(weights[i])
    np.testing.assert_allclose(w.sum(), 1.0, rtol=1e-6)
    np.testing.assert_allclose(pooled[i], (-np.sort(-feats[i], axis=0) * w[:, None]).sum(0), rtol=1e-5, atol=1e-6)
    assert not np.allclose(pooled[i], (feats[i] * w[:, None]).sum(0), atol=1e-3)  # not a per-token sort
    assert np.all(np.asarray(weights[1])[6:] == 0) and np.all(np.asarray(weights[2])[6:] == 0)


# ------------------------------------------------------------------------ PCME++ block head
# Compilation dominates on CPU: parameters are random arrays of the abstract shapes (no init
# compile) and each forward is compiled once, then fed other parameters / keys.
def _random_params(cfg, seed=0):
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        v = rng.normal(size=x.shape).astype(np.float32) * 0.1
        return v + 1 if jax.tree_util.keystr(path).endswith("['scale']") else v

    return jax.tree_util.tree_map_with_path(leaf, abstract_params(cfg))


def _inputs(cfg, b=8, seed=0):
    rng = np.random.default_rng(seed)
    s = cfg.vision.image_size
    images = rng.normal(size=(b, s, s, 3)).astype(np.float32)
    tokens = rng.integers(2, cfg.text.vocab_size - 1, size=(b, cfg.text.context_length)).astype(np.int32)
    for i in range(b):
        tokens[i, 4 + i:] = 1  # EOS == pad == 1 (SigLIP vocabulary), then padding
    return images, tokens


@pytest.fixture(scope="module")
def pcmepp():
    """tiny_pcmepp, random parameters, inputs, and its forward (eval: an unused "augment" key)."""
    cfg = get_config("tiny_pcmepp")
    model = ProLIP(cfg, attention_impl="xla")
    images, tokens = _inputs(cfg)
    jitted = jax.jit(lambda p, key, im, tok: model.apply({"params": p}, im, tok, rngs={"augment": key}))

    def fwd(p, key, tok=tokens):
        return jitted(p, key, images, tok)

    train = jax.jit(lambda p, key: model.apply({"params": p}, images, tokens, train=True, rngs={"augment": key}))
    return cfg, _random_params(cfg), images, tokens, fwd, train


def test_block_head_is_a_fresh_block_on_the_shared_trunk(pcmepp):
    cfg, params, images, tokens, fwd, _ = pcmepp
    # a real init (the text tower alone: compilation time): the duplicate is not a copy of the
    # last block, but comes from the same initialiser
    text_cfg = dataclasses.replace(cfg.text, pool="last", size_augment=0.0)
    key = jax.random.key(0, impl="unsafe_rbg")  # compiles faster than threefry
    init = jax.jit(lambda r: nn.unbox(TextTower(text_cfg, cfg.embed_dim).init(r, tokens[:1])))(key)
    last, dup = init["params"]["transformer"]["resblocks_1"], init["params"]["unc_transformer"]["resblocks_0"]
    assert jax.tree.structure(last) == jax.tree.structure(dup)
    for name in ("query_kernel", "out_kernel"):
        a, b = np.asarray(last["attn"][name]), np.asarray(dup["attn"][name])
        assert not np.allclose(a, b) and 0.7 < b.std() / a.std() < 1.4
    base = fwd(params, jax.random.key(0))
    assert base["image_logvar"].shape == base["image_mean"].shape == (8, cfg.embed_dim)

    def bump(*path):
        tree = jax.tree.map(np.array, params)
        node = tree
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = node[path[-1]] + 0.5
        return fwd(tree, jax.random.key(0))

    for tower, key in (("visual", "image"), ("text", "text")):
        # the duplicated block feeds log sigma^2 only; the original last block mu only; the trunk both
        dup = bump(tower, "unc_transformer", "resblocks_0", "c_fc", "bias")
        last = bump(tower, "transformer", "resblocks_1", "c_fc", "bias")
        trunk = bump(tower, "transformer", "resblocks_0", "c_fc", "bias")
        np.testing.assert_array_equal(dup[f"{key}_mean"], base[f"{key}_mean"])
        assert not np.allclose(dup[f"{key}_logvar"], base[f"{key}_logvar"])
        np.testing.assert_array_equal(last[f"{key}_logvar"], base[f"{key}_logvar"])
        assert not np.allclose(last[f"{key}_mean"], base[f"{key}_mean"])
        assert not np.allclose(trunk[f"{key}_mean"], base[f"{key}_mean"])
        assert not np.allclose(trunk[f"{key}_logvar"], base[f"{key}_logvar"])


def test_mu_only_towers_with_gpo_and_text_pads(pcmepp):
    """mu-only towers (embed_unc=False) with GPO are the full model's mu path; text GPO does not
    pool pads: with another pad id and the pads replaced by it, nothing changes (the tower is
    causal, as PCME++'s CLIP text, so pads reach no other token through attention either)."""
    cfg, params, images, tokens, fwd, _ = pcmepp
    mu_only = with_overrides(cfg, vision={"embed_unc": False, "unc_head": "unc_token"},
                             text={"embed_unc": False, "unc_head": "unc_token", "pad_id": 999})
    assert ProLIPConfig.from_dict(mu_only.to_dict()) == mu_only
    assert {"unc_transformer", "unc_gpo", "unc_projection"}.isdisjoint(abstract_params(mu_only)["visual"])
    other = np.where(tokens == 1, 999, tokens)  # the pad positions' features change
    out = jax.jit(lambda p: ProLIP(mu_only, attention_impl="xla").apply({"params": p}, images, other))(params)
    base = fwd(params, jax.random.key(0))
    assert out["image_logvar"] is None and out["text_logvar"] is None
    np.testing.assert_allclose(out["image_mean"], base["image_mean"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["text_mean"], base["text_mean"], rtol=1e-5, atol=1e-6)
    as_content = fwd(params, jax.random.key(0), tok=other)  # pad_id 1: the 999s are pooled
    assert not np.allclose(as_content["text_mean"], base["text_mean"], atol=1e-4)


# ---------------------------------------------------------------------- Pishdad et al. head
def test_embedding_head_projects_the_same_pooled_feature():
    # vision diagonal, text spherical-one-value (a 1-dim head broadcast to embed_dim)
    cfg = with_overrides(get_config("tiny_pishdad"), text={"covariance": "spherical"})
    p = _random_params(cfg, 3)
    assert "unc_embedding" not in p["visual"] and "unc_transformer" not in p["visual"] and "cls_emb" not in p["text"]
    assert p["text"]["unc_projection"]["kernel"].shape == (64, 1)
    # log sigma^2 layer := a copy of the mu projection -> log sigma^2 == the unnormalised mu
    p["visual"]["unc_projection"] = {"kernel": p["visual"]["proj"], "bias": np.zeros(cfg.embed_dim, np.float32)}
    images, tokens = _inputs(cfg, b=4)
    out = jax.jit(lambda p: ProLIP(cfg, attention_impl="xla").apply({"params": p}, images, tokens))(p)
    lv = np.asarray(out["image_logvar"])
    np.testing.assert_allclose(lv / np.linalg.norm(lv, axis=-1, keepdims=True), out["image_mean"],
                               rtol=1e-5, atol=1e-6)
    lv = np.asarray(out["text_logvar"])
    assert lv.shape == (4, cfg.embed_dim) and np.all(lv == lv[:, :1]) and not np.all(lv == lv[0, 0])


# ----------------------------------------------------------------------------- SizeAugment
def test_size_augment_is_identity_at_eval_and_random_in_training(pcmepp):
    cfg, params, _, _, fwd, train = pcmepp
    ev = fwd(params, jax.random.key(0))
    for k, v in fwd(params, jax.random.key(1)).items():
        np.testing.assert_array_equal(v, ev[k])  # eval: no augmentation, whatever the key
    t1, t1b, t2 = (train(params, jax.random.key(s)) for s in (1, 1, 2))
    for k in ("image_mean", "image_logvar", "text_mean", "text_logvar"):
        np.testing.assert_array_equal(t1[k], t1b[k])  # deterministic given the key
        assert not np.allclose(t1[k], ev[k]) and not np.allclose(t1[k], t2[k])
    off = cfg.without_training_options()
    assert (off.vision.size_augment, off.text.size_augment, off.text.size_augment_mask_id) == (0, 0, None)


def test_image_size_augment_drops_the_pcmepp_fraction():
    rate, b, t = 0.2, 4000, 50
    keep = np.asarray(jax.jit(size_augment_keep, static_argnums=(1, 2, 3))(jax.random.key(0), b, t, rate))
    dropped = 1 - keep.mean()
    assert abs(dropped - (1 - rate) * rate * (1 + rate) / 2) < 0.004  # 9.6 % of the tokens
    untouched = keep.all(axis=1).mean()  # u <= 0.2, plus a few lucky draws
    assert 0.19 < untouched < 0.26


def test_caption_size_augment_masks_replaces_and_deletes():
    b, n, length = 2000, 20, 32
    tokens = np.ones((b, length), np.int32)  # pad 1
    tokens[:, :n] = np.arange(100, 100 + n)
    tokens[:, 0] = 5  # a protected SOT-like id
    augment = jax.jit(functools.partial(size_augment_tokens, rate=0.2, vocab_size=10 ** 6, pad_id=1, mask_id=7,
                                        protected_ids=(5,)))
    out = np.asarray(augment(jax.random.key(0), jnp.asarray(tokens)))
    assert np.all(out[:, 0] == 5)
    lengths = (out != 1).sum(1)
    deleted = (n - lengths).sum() / (b * (n - 1))
    masked = (out == 7).sum() / (b * (n - 1))
    original = (out >= 100) & (out < 100 + n)
    replaced = ((out != 1) & (out != 5) & (out != 7) & ~original).sum() / (b * (n - 1))
    assert abs(deleted - 0.2 * 0.4) < 0.006 and abs(masked - 0.2 * 0.5) < 0.006 and abs(replaced - 0.02) < 0.003
    for row, ok, ln in zip(out[:50], original[:50], lengths[:50]):
        assert np.all(np.diff(row[ok]) > 0)  # kept tokens keep their order
        assert np.all(row[ln:] == 1) and np.all(row[:ln] != 1)  # deletion refills with pads at the end


# ------------------------------------------------------------------------ config / sharding
def _boxed(cfg):
    images, tokens = dummy_inputs(cfg)
    return jax.eval_shape(lambda r: ProLIP(cfg).init(r, images, tokens), jax.random.key(0))["params"]


@pytest.mark.parametrize("name", ["tiny_pcmepp", "tiny_pishdad"])
def test_new_parameters_have_logical_axis_names(name):
    cfg = get_config(name)
    if name == "tiny_pishdad":
        cfg = with_overrides(cfg, vision={"pool": "gpo"}, text={"covariance": "spherical"})
    boxed = _boxed(cfg)
    flat = jax.tree_util.tree_flatten_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
    new = [(jax.tree_util.keystr(p), x) for p, x in flat if any(s in jax.tree_util.keystr(p) for s in ("gpo", "unc_"))]
    assert new and all(isinstance(x, nn.LogicallyPartitioned) for _, x in flat)
    for path, leaf in new:
        assert len(leaf.names) == leaf.value.ndim and all(isinstance(n, str) for n in leaf.names), path
        assert len(set(leaf.names)) == len(leaf.names), path


def test_sharded_forward_equals_unsharded(pcmepp):
    """FSDP over 8 fake devices ('embed' -> 'fsdp', batch over data x fsdp), SizeAugment on."""
    cfg, params, images, tokens, _, train = pcmepp
    mesh = sharding.make_mesh((2, 4), ("data", "fsdp"))
    shardings = sharding.logical_shardings(_boxed(cfg), mesh, "fsdp")
    assert shardings["visual"]["unc_projection"]["kernel"].spec[0] == "fsdp"
    assert shardings["text"]["unc_transformer"]["resblocks_0"]["c_fc"]["kernel"].spec[0] == "fsdp"
    model = ProLIP(cfg, attention_impl="xla")
    sharded = jax.jit(
        lambda p, im, tok, key: model.apply({"params": p}, im, tok, train=True, rngs={"augment": key}),
        in_shardings=(shardings, sharding.batch_sharding(mesh, 4), sharding.batch_sharding(mesh, 2), None))
    got = sharded(jax.device_put(params, shardings), images, tokens, jax.random.key(1))
    ref = train(params, jax.random.key(1))
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=2e-6)


def test_config_fields_round_trip_and_are_validated():
    base = get_config("tiny")
    for name in ("tiny_pcmepp", "tiny_pishdad"):
        cfg = get_config(name)
        d = cfg.to_dict()
        assert ProLIPConfig.from_dict(d) == cfg
        assert d["vision_cfg"]["unc_head"] in ("block", "embedding") and "unc_head" in d["text_cfg"]
    assert get_config("tiny_pcmepp").text.size_augment_mask_id == 999
    d = base.to_dict()
    written = set(d["vision_cfg"]) | set(d["text_cfg"])
    assert not {"unc_head", "size_augment", "gpo_dim", "covariance", "pad_id"} & written
    cfg = get_config("tiny", vision={"unc_head": "block", "unc_layers": 2, "pool": "gpo", "size_augment": 0.1},
                     text={"unc_head": "embedding", "pool": "gpo", "pad_id": 0, "size_augment": 0.2,
                           "size_augment_mask_id": 3, "size_augment_protected_ids": [49406, 49407]})
    assert cfg.text.size_augment_protected_ids == (49406, 49407)
    assert ProLIPConfig.from_dict(cfg.to_dict()) == cfg
    errors = [
        (dict(vision={"unc_head": "blocks"}), "vision unc_head 'blocks' is not one of"),
        (dict(text={"covariance": "full"}), "text covariance 'full' is not one of"),
        (dict(vision={"pool": "gpoo"}), "vision pool 'gpoo' is not one of"),
        (dict(vision={"size_augment": 0.2}), "vision size_augment drops output tokens"),
        (dict(vision={"size_augment": 1.0, "pool": "gpo", "unc_head": "block"}), r"1.0 must be in \[0, 1\)"),
        (dict(text={"unc_head": "block", "pool": "gpo"}), "text pool 'gpo' needs pad_id"),
        (dict(text={"size_augment": 0.2, "pad_id": 1}), "size_augment_mask_id"),
        (dict(vision={"pool": "gpo"}), "vision unc_head 'unc_token'.*not 'gpo'"),
        (dict(vision={"unc_head": "block", "pool": "map"}), "vision unc_head 'block' pools with one of"),
        (dict(text={"unc_head": "block"}), "text pool 'prolip'"),
        (dict(vision={"unc_layers": 3, "unc_head": "block"}), r"unc_layers 3 must be an int in \[1, layers=2\]"),
        (dict(vision={"embed_unc": False, "unc_head": "block"}), "unc_head='block' needs embed_unc=True"),
        (dict(vision={"gpo_dim": 7}), "gpo_dim 7 must be a positive even int"),
        (dict(vision={"bogus": 1}), r"unknown vision field\(s\) \['bogus'\]"),
        (dict(text={"size_augment_masking": 0.7, "size_augment_erasing": 0.4}), "sum <= 1"),
    ]
    for kw, msg in errors:
        with pytest.raises(ValueError, match=msg):
            get_config("tiny", **kw)


def test_export_refuses_other_papers_architectures(tmp_path, pcmepp):
    cfg, params = pcmepp[:2]
    with pytest.raises(ValueError, match=r"cannot load this architecture: vision.pool='gpo', "
                                         r"vision.unc_head='block', text.pool='gpo', text.unc_head='block'"):
        convert.flax_to_torch(params, cfg)
    pishdad = get_config("tiny_pishdad")
    with pytest.raises(ValueError, match=r"vision.unc_head='embedding'"):
        export.save_hf(tmp_path / "out", _random_params(pishdad), pishdad)
    assert not (tmp_path / "out").exists()
    sph = get_config("tiny", vision={"covariance": "spherical"})
    with pytest.raises(ValueError, match="vision.covariance='spherical'"):
        convert.expected_torch_shapes(sph)
    # SizeAugment is training-only: a ProLIP trained with it exports, without the option
    aug = get_config("tiny", text={"pad_id": 1, "size_augment": 0.2, "size_augment_mask_id": 999})
    out = export.save_hf(tmp_path / "aug", _random_params(aug), aug)
    import json
    text_cfg = json.loads((out / convert.CONFIG_NAME).read_text())["text_cfg"]
    assert "size_augment" not in text_cfg and "size_augment_mask_id" not in text_cfg and text_cfg["pad_id"] == 1
