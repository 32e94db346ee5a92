"""Importers vs the original implementations: tiny random models whose golden embeddings were
made by open_clip 3.3.0 + timm 1.0.31 (torch) and by big_vision's own Flax code (see
tests/data/pretrained/README.md). Each family exercises its pooling mode: [CLS] (OpenAI CLIP
image), MAP head (SigLIP image), EOT argmax with a causal mask (OpenAI CLIP text), last token
(SigLIP text)."""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from prolip_jax.core import convert
from prolip_jax.core.models.config import ProLIPConfig
from prolip_jax.core.models.prolip import ProLIP
from prolip_jax.core.pretrained import bigvision
from prolip_jax.core.pretrained.loader import load_pretrained
from prolip_jax.core.pretrained.openclip import config_from_open_clip
from prolip_jax import export

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import convert_from_pytorch  # noqa: E402

DATA = Path(__file__).parent / "data" / "pretrained"
TOL = 1e-5


def rel_err(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a) - b)) / np.max(np.abs(b)))


def golden(name: str) -> dict[str, np.ndarray]:
    with np.load(DATA / f"{name}_golden.npz") as z:
        return {k: z[k] for k in z.files}


def embed(config: ProLIPConfig, params, g) -> tuple[np.ndarray, np.ndarray]:
    """Unnormalised (image, text) embeddings; asserts the towers have no log sigma^2."""
    model = ProLIP(config)
    mu_i, lv_i = model.apply({"params": params}, g["images"], method=lambda m, x: m.visual(x))
    mu_t, lv_t = model.apply({"params": params}, g["tokens"], method=lambda m, x: m.text(x))
    assert lv_i is None and lv_t is None
    return np.asarray(mu_i), np.asarray(mu_t)


def timm_tiny_arch() -> ProLIPConfig:
    """The fixture's tiny timm trunk is not a named timm model: spell it out."""
    cfg = json.loads((DATA / "siglip_openclip_tiny" / "open_clip_config.json").read_text())["model_cfg"]
    cfg = {**cfg, "embed_dim": 768, "vision_cfg": {**cfg["vision_cfg"], "timm_model_name": "vit_base_patch16_siglip_224"}}
    base = config_from_open_clip(cfg)
    return base.replace(embed_dim=32, vision=dataclasses.replace(base.vision, patch_size=8, width=32, layers=2,
                                                                 head_width=16))


def test_openai_clip_matches_open_clip():
    g = golden("openai_clip_tiny")
    config, params, report = load_pretrained(DATA / "openai_clip_tiny")
    assert (report.format, report.layout, report.unplaced) == ("open_clip", "open_clip", [])
    assert report.filled == {"logit_bias": "0.0 (the source has no logit bias)"}
    v, t = config.vision, config.text
    assert config.quick_gelu and not v.embed_unc and v.class_token and v.pool == "tok" and v.ln_pre and v.proj
    assert t.causal and t.pool == "argmax" and not t.proj_bias and not t.embed_unc
    assert params["visual"]["positional_embedding"].shape == (v.num_patches + 1, 32)  # CLS + patches
    assert params["text"]["positional_embedding"].shape == (12, 40)
    assert "bias" not in params["text"]["text_projection"]
    img, txt = embed(config, params, g)
    assert rel_err(img, g["image_embed"]) <= TOL and rel_err(txt, g["text_embed"]) <= TOL
    assert params["logit_scale"] == g["logit_scale"] and params["logit_bias"] == 0.0


def test_siglip_timm_matches_open_clip():
    g = golden("siglip_openclip_tiny")
    with pytest.raises(ValueError, match="not a known SigLIP trunk.*arch="):
        load_pretrained(DATA / "siglip_openclip_tiny")
    config, params, report = load_pretrained(DATA / "siglip_openclip_tiny", format="timm_siglip", arch=timm_tiny_arch())
    assert (report.format, report.layout, report.unplaced, report.filled) == ("timm_siglip", "timm_siglip", [], {})
    v = params["visual"]
    assert v["positional_embedding"].shape == (16, 32)  # patches only
    assert {"map_head", "patch_bias"} <= set(v) and not {"class_embedding", "ln_pre", "proj"} & set(v)
    img, txt = embed(config, params, g)
    assert rel_err(img, g["image_embed"]) <= TOL and rel_err(txt, g["text_embed"]) <= TOL
    assert params["logit_bias"] == g["logit_bias"]


def test_siglip_big_vision_matches_big_vision(tmp_path):
    g = golden("siglip_bigvision_tiny")
    config, params, report = load_pretrained(DATA / "siglip_bigvision_tiny.npz")
    assert (report.format, report.unplaced) == ("big_vision", [])
    v, t = config.vision, config.text
    assert (v.image_size, v.patch_size, v.width, v.layers, v.heads, v.mlp_dim) == (32, 8, 32, 2, 2, 128)
    assert (t.context_length, t.vocab_size, t.heads, t.layers, t.pool, t.causal) == (8, 100, 2, 2, "last", False)
    assert v.act == t.act == "gelu_tanh" and v.pool == "map" and config.embed_dim == 32
    img, txt = embed(config, params, g)
    assert rel_err(img, g["image_embed"]) <= TOL and rel_err(txt, g["text_embed"]) <= TOL
    np.testing.assert_allclose(np.exp(params["logit_scale"]), g["t"][0], rtol=1e-6)
    assert params["logit_bias"] == g["b"][0]
    # The same weights saved with scanned blocks (big_vision scan=True) and without the
    # `params/` prefix import to the same parameters.
    flat = bigvision.read_npz(DATA / "siglip_bigvision_tiny.npz")
    scanned = {}
    for k, x in flat.items():
        if "/encoderblock_" in k:
            head, rest = k.split("/encoderblock_", 1)
            i, rest = rest.split("/", 1)
            scanned.setdefault(f"{head}/encoderblock/{rest}", {})[int(i)] = x
        else:
            scanned[k] = x
    scanned = {k: np.stack([v[i] for i in sorted(v)]) if isinstance(v, dict) else v for k, v in scanned.items()}
    np.savez(tmp_path / "scanned.npz", **scanned)
    _, params2, _ = load_pretrained(tmp_path / "scanned.npz")
    for a, b in zip(*(map(np.asarray, jax_leaves(p)) for p in (params, params2))):
        np.testing.assert_array_equal(a, b)


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def test_open_clip_export_round_trip_is_bit_exact():
    """import -> export (convert.unapply_rules, the open_clip layout) gives back the file."""
    config, params, _ = load_pretrained(DATA / "openai_clip_tiny")
    source = convert.read_safetensors(DATA / "openai_clip_tiny" / "open_clip_model.safetensors")
    back = convert.unapply_rules(params, convert.conversion_rules(config, "open_clip", logit_bias=False))
    assert set(back) == set(source)
    for k in source:
        np.testing.assert_array_equal(back[k], source[k], err_msg=k)


def test_prolip_sources_and_export_round_trip(tmp_path, golden_params, golden_config, golden_state_dict):
    hf = export.save_hf(tmp_path / "hf", golden_params, golden_config)
    config, params, report = load_pretrained(hf)
    assert (report.format, report.layout, config) == ("prolip", "prolip", golden_config)
    back = convert.flax_to_torch(params, config)
    for k, x in golden_state_dict.items():
        np.testing.assert_array_equal(back[k], x, err_msg=k)
    with pytest.raises(ValueError, match="format='open_clip' was requested.*prolip"):
        load_pretrained(hf, format="open_clip")


@pytest.mark.parametrize("name", ["openai_clip_tiny", "siglip_bigvision_tiny.npz"])
def test_deterministic_config_round_trips(name):
    config, _, _ = load_pretrained(DATA / name)
    assert ProLIPConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert ProLIPConfig.from_dict(timm_tiny_arch().to_dict()) == timm_tiny_arch()


def test_convert_script_and_load_clip(tmp_path, capsys):
    """open_clip folder -> convert_from_pytorch -> prolip_jax checkpoint -> prolip_jax.load:
    mu only (log sigma^2 None), equal to open_clip's normalised embeddings."""
    import prolip_jax

    g = golden("openai_clip_tiny")
    src = tmp_path / "src"
    shutil.copytree(DATA / "openai_clip_tiny", src)
    assert convert_from_pytorch.main(["--src", str(src), "--out", str(tmp_path / "ckpt")]) == 0
    assert "as open_clip" in capsys.readouterr().out
    model = prolip_jax.load(tmp_path / "ckpt", batch_size=8)
    mu, logvar = model.encode_image(g["images"])
    assert logvar is None
    expected = g["image_embed"] / np.linalg.norm(g["image_embed"], axis=-1, keepdims=True)
    assert rel_err(mu, expected) <= TOL
    mu, logvar = prolip_jax.load(src, batch_size=8).encode_text(g["tokens"])
    expected = g["text_embed"] / np.linalg.norm(g["text_embed"], axis=-1, keepdims=True)
    assert logvar is None and rel_err(mu, expected) <= TOL
