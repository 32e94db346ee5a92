"""Warm starts (`prolip_jax.core.pretrained.warm_start`): CLIP / SigLIP / ProLIP sources into a ProLIP,
with the reference's resizes checked against hand-computed float64 values."""
from __future__ import annotations

import dataclasses
import functools
import json
from fractions import Fraction as F
from pathlib import Path

import jax
import numpy as np
import pytest

from prolip_jax.core.models.config import get_config
from prolip_jax.core.models.prolip import ProLIP, abstract_params, init_params
from prolip_jax.core.pretrained.warm_start import (DEFAULTS, bicubic_aa_matrix, init_from_config, linear_matrix,
                                              warm_start)

DATA = Path(__file__).parent / "data" / "pretrained"
MICRO = get_config("micro")  # image 16 / patch 8 (grid 2), width 32, 1 layer; text context 8, vocab 64


def with_(cfg, vision=None, text=None, **top):
    return cfg.replace(vision=dataclasses.replace(cfg.vision, **(vision or {})),
                       text=dataclasses.replace(cfg.text, **(text or {})), **top)


def clip_like(cfg, **text):
    """open_clip / OpenAI CLIP towers: CLS (no UNC), causal argmax text, no projection bias."""
    return with_(cfg, dict(embed_unc=False), dict(embed_unc=False, pool="argmax", causal=True, proj_bias=False, **text))


@functools.lru_cache(maxsize=None)
def _init(cfg, seed):
    return init_params(cfg, jax.random.key(seed))


def init(cfg, seed):
    """Fresh host copies of cached parameters (one compile per config)."""
    return jax.tree.map(np.array, _init(cfg, seed))


def zeros(cfg):
    """Parameters of the right shapes where values do not matter (no compile)."""
    return jax.tree.map(lambda x: np.zeros(x.shape, np.float32), abstract_params(cfg))


def rows(report, kind):
    return {r.name for r in report.rows if r.kind == kind}


def forward(cfg, params):
    s, n = cfg.vision.image_size, cfg.text.context_length
    images = np.random.default_rng(0).normal(size=(2, s, s, 3)).astype(np.float32)
    tokens = np.arange(2 * n).reshape(2, n) % cfg.text.vocab_size
    return jax.jit(ProLIP(cfg).apply)({"params": params}, images, tokens)


def test_same_prolip_is_the_source_exactly():
    source = init(MICRO, 1)
    params, report = warm_start(MICRO, init(MICRO, 0), MICRO, source)
    assert jax.tree.structure(params) == jax.tree.structure(source)
    assert all(np.array_equal(a, b) and a.dtype == np.float32 for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(source)))
    assert report.counts() == {"loaded": len(jax.tree.leaves(source)), "resized": 0, "new": 0, "fresh": 0,
                               "dropped": 0}
    out, ref = forward(MICRO, params), forward(MICRO, source)
    assert all(np.array_equal(out[k], ref[k]) for k in ref)


def test_clip_to_prolip_same_size():
    src_cfg = clip_like(MICRO)
    source, fresh = init(src_cfg, 1), init(MICRO, 0)
    params, report = warm_start(MICRO, fresh, src_cfg, source, source_absent=("logit_bias",))
    v, t, sv, st = params["visual"], params["text"], source["visual"], source["text"]
    # Image rows: CLS copied, UNC new, patches copied (grid unchanged).
    np.testing.assert_array_equal(v["positional_embedding"][0], sv["positional_embedding"][0])
    np.testing.assert_array_equal(v["positional_embedding"][1], fresh["visual"]["positional_embedding"][1])
    np.testing.assert_array_equal(v["positional_embedding"][2:], sv["positional_embedding"][1:])
    # Text rows: 8 tokens copied, UNC/CLS rows the target's init.
    np.testing.assert_array_equal(t["positional_embedding"][:8], st["positional_embedding"])
    np.testing.assert_array_equal(t["positional_embedding"][8:], fresh["text"]["positional_embedding"][8:])
    assert rows(report, "new") == {
        "visual/unc_embedding", "visual/uncertainty_proj/kernel", "visual/uncertainty_proj/bias", "text/cls_emb",
        "text/unc_emb", "text/text_uncertainty_projection/kernel", "text/text_uncertainty_projection/bias",
        "text/text_projection/bias", "logit_bias", "logit_scale"}
    assert rows(report, "resized") == {"visual/positional_embedding", "text/positional_embedding"}
    assert rows(report, "dropped") == set()
    # New parameters keep the reference's init: uncertainty bias -10, text_projection bias 0, a = 10, b = -10.
    assert np.all(v["uncertainty_proj"]["bias"] == -10) and np.all(t["text_uncertainty_projection"]["bias"] == -10)
    assert np.all(t["text_projection"]["bias"] == 0)
    assert np.isclose(params["logit_scale"], np.log(10)) and params["logit_bias"] == -10
    np.testing.assert_array_equal(v["transformer"]["resblocks_0"]["c_fc"]["kernel"],
                                  sv["transformer"]["resblocks_0"]["c_fc"]["kernel"])
    out = forward(MICRO, params)
    assert all(np.all(np.isfinite(out[k])) for k in out)


# PyTorch F.interpolate(mode='bicubic', antialias=True, align_corners=False) weights, by hand
# from Keys' kernel with a = -0.5 (support 2*max(scale,1), cut at the border, renormalised):
# 2 -> 4: centres 0.25, 0.75, .. taps at distance 0.25 / 1.25 -> k = 111/128, -9/128 (sum 102/128),
#         0.25 / 0.75 -> 111/128, 29/128 (sum 140/128).
# 4 -> 2: scale 2, distances/2 = 0.25, 0.25, 0.75, 1.25 -> (111, 111, 29, -9) / 242.
UP_2_4 = [[F(37, 34), F(-3, 34)], [F(111, 140), F(29, 140)], [F(29, 140), F(111, 140)], [F(-3, 34), F(37, 34)]]
DOWN_4_2 = [[F(111, 242), F(111, 242), F(29, 242), F(-9, 242)], [F(-9, 242), F(29, 242), F(111, 242), F(111, 242)]]


def test_resize_weights_match_pytorch_by_hand():
    np.testing.assert_allclose(bicubic_aa_matrix(2, 4), np.array(UP_2_4, float), rtol=0, atol=1e-15)
    np.testing.assert_allclose(bicubic_aa_matrix(4, 2), np.array(DOWN_4_2, float), rtol=0, atol=1e-15)
    # linear, align_corners=False: src = max(scale*(i+0.5) - 0.5, 0); 4 -> 20 (scale 0.2), 8 -> 4 (scale 2).
    up = linear_matrix(4, 20)
    np.testing.assert_allclose(up[[0, 2, 3, 10, 19]], [[1, 0, 0, 0], [1, 0, 0, 0], [0.8, 0.2, 0, 0],
                                                       [0, 0.4, 0.6, 0], [0, 0, 0, 1]], atol=1e-12)
    np.testing.assert_allclose(linear_matrix(8, 4), np.kron(np.eye(4), [0.5, 0.5]), atol=1e-12)


def test_clip_to_prolip_other_resolution_and_context():
    """grid 2 -> 4 (bicubic), CLIP context 12 -> ProLIP 8 + [UNC], [CLS] (first 4 kept, rest linear)."""
    src_cfg = clip_like(MICRO, context_length=12)
    tgt = with_(MICRO, dict(image_size=32))
    source, fresh = init(src_cfg, 1), init(tgt, 0)
    params, report = warm_start(tgt, fresh, src_cfg, source, source_absent=("logit_bias",), text_pos_keep=4)
    old = source["visual"]["positional_embedding"].astype(np.float64)
    grid = old[1:].reshape(2, 2, -1)
    m = np.array(UP_2_4, float)
    expected = np.einsum("ij,kl,jld->ikd", m, m, grid).reshape(16, -1)
    pos = params["visual"]["positional_embedding"]
    assert pos.shape == (18, 32)
    np.testing.assert_allclose(pos[2:], expected, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(pos[0], source["visual"]["positional_embedding"][0])
    np.testing.assert_array_equal(pos[1], fresh["visual"]["positional_embedding"][1])
    told = source["text"]["positional_embedding"].astype(np.float64)
    tpos = params["text"]["positional_embedding"]
    np.testing.assert_array_equal(tpos[:4], told[:4])
    np.testing.assert_allclose(tpos[4:8], (told[4:12:2] + told[5:12:2]) / 2, rtol=0, atol=1e-7)
    np.testing.assert_array_equal(tpos[8:], fresh["text"]["positional_embedding"][8:])
    note = {r.name: r.note for r in report.rows}
    assert "patch grid 2x2 -> 4x4" in note["visual/positional_embedding"]
    assert "context 12 -> 8 (first 4 kept" in note["text/positional_embedding"]


def test_prolip_to_long_context_the_longprolip_way():
    """context 8 -> 24 (as B/16 64 -> B/16-long 256): first 4 rows kept, 4 rows -> 20 linearly, UNC/CLS copied."""
    tgt = with_(MICRO, text=dict(context_length=24))
    source = init(MICRO, 1)
    params, report = warm_start(tgt, init(tgt, 0), MICRO, source, text_pos_keep=4)
    old = source["text"]["positional_embedding"].astype(np.float64)  # rows t0..t7, UNC, CLS
    new = params["text"]["positional_embedding"]
    assert new.shape == (26, 32)
    np.testing.assert_array_equal(new[:4], old[:4])
    expected = []
    for i in range(20):  # F.interpolate(size=20, mode='linear', align_corners=False) of rows 4..7
        s = max((i + 0.5) * 4 / 20 - 0.5, 0.0)
        i0 = int(np.floor(s))
        i1, lam = min(i0 + 1, 3), s - i0
        expected.append((1 - lam) * old[4 + i0] + lam * old[4 + i1])
    np.testing.assert_allclose(new[4:24], np.array(expected), rtol=0, atol=1e-7)
    np.testing.assert_allclose(new[7], 0.8 * old[4] + 0.2 * old[5], atol=1e-7)  # by hand: s = 0.2
    np.testing.assert_array_equal(new[23], old[7])
    np.testing.assert_array_equal(new[24:], old[8:])  # UNC, CLS
    assert rows(report, "resized") == {"text/positional_embedding"}
    assert report.counts()["new"] == report.counts()["dropped"] == 0
    # The reference's 20 kept rows do not fit a context of 8: a clear error, not a silent copy.
    with pytest.raises(ValueError, match="text_pos_keep=20 keeps every source row"):
        warm_start(tgt, zeros(tgt), MICRO, source)


def siglip_target(vocab_size=128):
    """A ProLIP the size of the big_vision fixture (mu/8 towers, 2 layers, context 8), vocab 128."""
    return with_(MICRO, dict(image_size=32, layers=2), dict(layers=2, vocab_size=vocab_size))


def test_siglip_from_config_init(tmp_path):
    tgt = siglip_target()
    fresh = init(tgt, 0)
    params, report = init_from_config({"path": str(DATA / "siglip_bigvision_tiny.npz")}, tgt, fresh)
    from prolip_jax.core.pretrained.loader import load_pretrained

    _, source, _ = load_pretrained(DATA / "siglip_bigvision_tiny.npz")
    assert report.format == "big_vision"
    assert rows(report, "dropped") == {"visual/patch_bias"} | {
        f"visual/map_head/{k}" for k in ("probe", "ln/scale", "ln/bias", "c_fc/kernel", "c_fc/bias", "c_proj/kernel",
                                          "c_proj/bias") + tuple(f"attn/{q}_{w}" for q in ("query", "key", "value", "out")
                                                                 for w in ("kernel", "bias"))}
    assert {"visual/class_embedding", "visual/ln_pre/scale", "visual/proj", "visual/unc_embedding",
            "text/cls_emb", "text/unc_emb"} <= rows(report, "new")
    assert "logit_scale" in rows(report, "loaded") and "logit_bias" in rows(report, "loaded")
    assert params["logit_bias"] == source["logit_bias"]
    # No [CLS] in SigLIP: both extra image rows are new, the 16 patch rows copied.
    pos = params["visual"]["positional_embedding"]
    np.testing.assert_array_equal(pos[:2], fresh["visual"]["positional_embedding"][:2])
    np.testing.assert_array_equal(pos[2:], source["visual"]["positional_embedding"])
    # Vocabulary 100 -> 128, zero-padded.
    tok = params["text"]["token_embedding"]
    np.testing.assert_array_equal(tok[:100], source["text"]["token_embedding"])
    assert np.all(tok[100:] == 0)
    np.testing.assert_array_equal(params["text"]["text_projection"]["bias"], source["text"]["text_projection"]["bias"])
    out = forward(tgt, params)
    assert all(np.all(np.isfinite(out[k])) for k in out)

    table = report.table()
    assert table.splitlines()[0].endswith(f"{len(rows(report, 'loaded'))} loaded, 3 resized, 11 new, 16 dropped")
    assert "visual/transformer/resblocks_{0..1}/ln_1/scale" in table and "resblocks_0/" not in table
    assert "vocabulary 100 -> 128 (zero-padded)" in table
    report.write(tmp_path)
    saved = json.loads((tmp_path / "warm_start.json").read_text())
    assert saved["counts"] == report.counts() and len(saved["params"]) == len(report.rows)
    assert (tmp_path / "warm_start.txt").read_text() == table + "\n"


def test_vocab_padding_modes_and_smaller_vocab():
    small, big = with_(MICRO, text=dict(vocab_size=48)), MICRO
    source, fresh = init(small, 1), init(big, 0)
    params, _ = warm_start(big, fresh, small, source, vocab_pad="fresh")  # naver-ai/prolip's behaviour
    np.testing.assert_array_equal(params["text"]["token_embedding"][:48], source["text"]["token_embedding"])
    np.testing.assert_array_equal(params["text"]["token_embedding"][48:], fresh["text"]["token_embedding"][48:])
    with pytest.raises(ValueError, match=r"text/token_embedding: target \(48, 32\), source \(64, 32\) \(a smaller vocab"):
        warm_start(small, zeros(small), big, zeros(big))


def test_unexpected_mismatches_are_listed():
    other = with_(MICRO, dict(width=48), dict(layers=2))
    with pytest.raises(ValueError) as err:
        warm_start(MICRO, zeros(MICRO), other, zeros(other))
    msg = str(err.value)
    # The count, an example of each kind of misfit (not all 42: a user error stays a few lines).
    assert msg.startswith("warm start: 42 parameter(s) of the source do not fit") and "; and 39 more." in msg
    assert "text/transformer/resblocks_1/attn/key_bias: only in the source (2, 16)" in msg
    assert "visual/class_embedding: target (32,), source (48,)" in msg
    assert "visual/positional_embedding: target (6, 32), source (6, 48) (the width differs)" in msg
    # An unknown family: parameters no ProLIP / CLIP / SigLIP has.
    source = zeros(MICRO)
    source["visual"]["adapter"] = {"kernel": np.zeros((32, 32), np.float32)}
    with pytest.raises(ValueError, match=r"visual/adapter/kernel: only in the source \(32, 32\)"):
        warm_start(MICRO, zeros(MICRO), MICRO, source)


def test_config_init_knobs():
    fresh = {"logit_scale": np.zeros(())}
    assert init_from_config(None, MICRO, fresh) == (fresh, None)
    assert init_from_config(dict(DEFAULTS), MICRO, fresh) == (fresh, None)  # empty path: no warm start
    with pytest.raises(ValueError, match=r"unknown config.init key\(s\) \['paht'\]"):
        init_from_config({"paht": "x"}, MICRO, fresh)
    with pytest.raises(ValueError, match="vocab_pad"):
        init_from_config({"path": "x", "vocab_pad": "random"}, MICRO, fresh)
    with pytest.raises(FileNotFoundError):
        init_from_config({"path": "/nonexistent/model.safetensors"}, MICRO, fresh)


def test_config_init_from_an_open_clip_file(tmp_path):
    """Through the importer: an OpenAI-style CLIP state dict (no logit_bias) written as open_clip
    saves it; the importer's filled-in logit_bias counts as absent, so a and b restart at 10, -10."""
    from safetensors.numpy import save_file

    from prolip_jax.core import convert

    src_cfg = clip_like(MICRO)
    source = init(src_cfg, 1)
    source["logit_scale"] = np.float32(np.log(100.0))
    state = convert.unapply_rules(source, convert.conversion_rules(src_cfg, "open_clip", logit_bias=False))
    assert "logit_bias" not in state
    save_file(state, str(tmp_path / "open_clip_model.safetensors"))
    params, report = init_from_config({"path": str(tmp_path), "arch": src_cfg}, MICRO, init(MICRO, 0))
    assert report.format == "open_clip" and {"logit_scale", "logit_bias"} <= rows(report, "new")
    assert np.isclose(params["logit_scale"], np.log(10)) and params["logit_bias"] == -10
    np.testing.assert_array_equal(params["visual"]["proj"], source["visual"]["proj"])
    assert not (tmp_path / "warm_start.txt").exists()  # only the caller writes the report


def test_clip_into_pcmepp_and_pishdad_heads():
    """CLIP weights into PCME++'s towers (duplicated last block, GPO, per-branch projections) and
    Pishdad et al.'s (duplicated embedding layer): the shared trunk is loaded, the heads are new
    at the target's initialisation (PCME++ starts its uncertainty block at random, PCME++ §2.4)."""
    src_cfg = clip_like(MICRO)
    source = zeros(src_cfg)
    pcmepp = with_(MICRO, dict(unc_head="block", pool="gpo"), dict(unc_head="block", pool="gpo", pad_id=1))
    pishdad = with_(MICRO, dict(unc_head="embedding"), dict(unc_head="embedding", pool="last"))
    for target, heads in ((pcmepp, ("unc_transformer", "unc_projection", "gpo", "unc_gpo")),
                          (pishdad, ("unc_projection",))):
        _, report = warm_start(target, zeros(target), src_cfg, source, source_absent=("logit_bias",))
        new = rows(report, "new")
        for tower in ("visual", "text"):
            assert any(n.startswith(f"{tower}/{heads[0]}/") for n in new), (tower, heads)
            assert f"{tower}/transformer/resblocks_0/c_fc/kernel" in rows(report, "loaded")
        outside_heads = {n for n in new if "/" in n and not n.split("/")[1].startswith(heads)}
        assert outside_heads <= {"visual/positional_embedding", "text/text_projection/bias"}, outside_heads


def test_fresh_projections_at_another_embed_dim():
    """PCME++'s recipe: CLIP's trunks with a new, wider joint embedding. Without config.init.fresh
    the projections' shapes are a mismatch (an error naming them); with it they keep the target's
    fresh initialisation at the new width and everything else of the trunk is loaded."""
    src_cfg = clip_like(MICRO)
    heads = dict(unc_head="block", pool="gpo")
    target = with_(MICRO, heads, dict(heads, pad_id=1), embed_dim=2 * MICRO.embed_dim)
    source, fresh = init(src_cfg, 1), init(target, 0)
    with pytest.raises(ValueError, match=r"visual/proj: target \(32, 64\), source \(32, 32\)"):
        warm_start(target, fresh, src_cfg, source, source_absent=("logit_bias",))
    patterns = ("^visual/proj$", "^text/text_projection/")
    params, report = warm_start(target, fresh, src_cfg, source, source_absent=("logit_bias",), fresh=patterns)
    assert rows(report, "fresh") == {"visual/proj", "text/text_projection/kernel"}
    np.testing.assert_array_equal(params["visual"]["proj"], fresh["visual"]["proj"])
    np.testing.assert_array_equal(params["text"]["text_projection"]["kernel"], fresh["text"]["text_projection"]["kernel"])
    assert params["visual"]["proj"].shape == (32, 64)
    np.testing.assert_array_equal(params["visual"]["transformer"]["resblocks_0"]["c_fc"]["kernel"],
                                  source["visual"]["transformer"]["resblocks_0"]["c_fc"]["kernel"])
    assert "visual/transformer/resblocks_0/c_fc/kernel" in rows(report, "loaded")
    assert report.counts()["fresh"] == 2 and "fresh" in report.table()
    # Same shapes: fresh still wins over the source.
    _, same = warm_start(MICRO, init(MICRO, 0), MICRO, init(MICRO, 1), fresh=("^visual/proj$",))
    assert rows(same, "fresh") == {"visual/proj"}


def test_fresh_knob_errors():
    base = {"path": "/nonexistent/model.safetensors"}
    for bad, message in (("visual/proj", "must be a tuple of regexes"), (("visual/(proj",), "not a regular expression")):
        with pytest.raises(ValueError, match=message):
            init_from_config({**base, "fresh": bad}, MICRO, {"logit_scale": np.zeros(())})
    with pytest.raises(ValueError, match=r"fresh=\('\^visual/projection\$',\) matches no parameter"):
        warm_start(MICRO, init(MICRO, 0), MICRO, init(MICRO, 1), fresh=("^visual/projection$",))
