"""Weight conversion: bit-exact round trips, the HF folder layout, scripts, and bad input."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import prolip_jax
from conftest import max_rel_err
from prolip_jax.core import checkpoint
from prolip_jax.core import convert
from prolip_jax.core.models import ProLIPConfig, get_config, init_params
from prolip_jax import export

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_from_pytorch  # noqa: E402
import convert_to_pytorch  # noqa: E402

# The released SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B config.json (naver-ai/prolip src/prolip/model_configs).
RELEASED_B16 = {
    "embed_dim": 768, "init_logit_bias": -10,
    "vision_cfg": {"image_size": 224, "layers": 12, "width": 768, "patch_size": 16, "embed_unc": True,
                   "init_unc_bias": -10},
    "text_cfg": {"context_length": 64, "vocab_size": 32100, "hf_tokenizer_name": "timm/ViT-B-16-SigLIP",
                 "tokenizer_kwargs": {"clean": "canonicalize"}, "width": 768, "heads": 12, "layers": 12,
                 "no_causal_mask": True, "proj_bias": True, "pool_type": "last", "embed_cls": True,
                 "embed_unc": True, "norm_kwargs": {"eps": 1e-6}, "init_unc_bias": -10},
}


def _write_hf(folder: Path, state_dict: dict, config: dict) -> Path:
    folder.mkdir(parents=True)
    save_file({k: np.array(v, order="C") for k, v in state_dict.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_torch_jax_torch_round_trip_is_bit_exact(golden_state_dict, golden_config):
    back = convert.flax_to_torch(convert.torch_to_flax(golden_state_dict, golden_config), golden_config)
    assert set(back) == set(golden_state_dict) and len(back) == 71
    for k, v in golden_state_dict.items():
        assert back[k].shape == v.shape and back[k].dtype == np.float32
        np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_jax_torch_jax_round_trip_is_bit_exact():
    cfg = get_config("micro")
    params = jax.tree.map(np.asarray, init_params(cfg, jax.random.key(3)))
    back = convert.torch_to_flax(convert.flax_to_torch(params, cfg), cfg)
    jax.tree.map(np.testing.assert_array_equal, back, params)


def test_b16_key_layout_matches_reference():
    shapes = convert.expected_torch_shapes(get_config("B/16"))
    assert len(shapes) == 311
    b = "visual.transformer.resblocks.11."
    assert shapes["logit_scale"] == () and shapes["logit_bias"] == ()
    assert shapes["visual.conv1.weight"] == (768, 3, 16, 16)
    assert shapes["visual.positional_embedding"] == (198, 768)
    assert shapes["visual.proj"] == (768, 768)
    assert shapes[b + "attn.in_proj_weight"] == (2304, 768) and shapes[b + "attn.in_proj_bias"] == (2304,)
    assert shapes[b + "mlp.c_fc.weight"] == (3072, 768) and shapes[b + "mlp.c_proj.weight"] == (768, 3072)
    assert shapes["text.positional_embedding"] == (66, 768)
    assert shapes["text.token_embedding.weight"] == (32100, 768)
    assert shapes["text.text_uncertainty_projection.weight"] == (768, 768)
    assert sum(int(np.prod(s)) for s in shapes.values()) == 197_923_586


def test_released_config_json_builds_b16():
    cfg = ProLIPConfig.from_dict(RELEASED_B16)
    assert cfg == get_config("B/16")
    assert cfg.text.hf_tokenizer_name == "timm/ViT-B-16-SigLIP"
    assert ProLIPConfig.from_dict(cfg.to_dict()) == cfg


def test_hf_folder_layout(tmp_path, golden_params, golden_config, golden_state_dict):
    out = export.save_hf(tmp_path / "hf", golden_params, golden_config)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    written = json.loads((out / "config.json").read_text())
    assert set(written) >= {"embed_dim", "vision_cfg", "text_cfg", "init_logit_bias"}
    assert written["vision_cfg"]["embed_unc"] is True and written["text_cfg"]["no_causal_mask"] is True
    sd = convert.read_safetensors(out / "model.safetensors")
    assert set(sd) == set(golden_state_dict)
    for k in sd:
        np.testing.assert_array_equal(sd[k], golden_state_dict[k])
    with pytest.raises(FileExistsError, match="not empty"):
        export.save_hf(tmp_path / "hf", golden_params, golden_config)
    export.save_hf(tmp_path / "hf", golden_params, golden_config, overwrite=True)


def test_ddp_prefix_is_stripped(golden_state_dict, golden_config):
    prefixed = {f"module.{k}": v for k, v in golden_state_dict.items()}
    params = convert.torch_to_flax(prefixed, golden_config)
    np.testing.assert_array_equal(params["logit_bias"], golden_state_dict["logit_bias"])


def test_mismatches_are_named(golden_state_dict, golden_config):
    bad = dict(golden_state_dict)
    del bad["visual.unc_embedding"]
    bad["text.extra.weight"] = np.zeros(3, np.float32)
    bad["visual.proj"] = np.zeros((64, 32), np.float32)
    with pytest.raises(ValueError) as e:
        convert.torch_to_flax(bad, golden_config)
    msg = str(e.value)
    assert "1 missing key(s): ['visual.unc_embedding']" in msg
    assert "1 unexpected key(s): ['text.extra.weight']" in msg
    assert "visual.proj: got (64, 32), expected (64, 64)" in msg


def test_convert_from_pytorch_writes_nothing_on_bad_input(tmp_path, golden_state_dict, golden, capsys):
    bad = dict(golden_state_dict)
    del bad["text.cls_emb"]
    hf = _write_hf(tmp_path / "hf", bad, json.loads(str(golden["config_json"])))
    assert convert_from_pytorch.main(["--hf_dir", str(hf), "--out", str(tmp_path / "ckpt")]) == 2
    assert "missing key(s): ['text.cls_emb']" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()
    # A folder with only a pickled checkpoint is refused with a pointer to safetensors.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text(str(golden["config_json"]))
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert convert_from_pytorch.main(["--hf_dir", str(pickled), "--out", str(tmp_path / "ckpt")]) == 2
    assert "pickle" in capsys.readouterr().err and not (tmp_path / "ckpt").exists()


def test_convert_to_pytorch_errors(tmp_path, capsys, golden_params, golden_config):
    assert convert_to_pytorch.main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    ckpt = tmp_path / "ckpt"
    checkpoint.save_params(ckpt, golden_params, golden_config, step=7)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("keep me")
    assert convert_to_pytorch.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "taken")]) == 2
    assert (tmp_path / "taken" / "x").read_text() == "keep me"
    assert convert_to_pytorch.main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "hf"), "--step", "3"]) == 2
    assert "step 3 not in" in capsys.readouterr().err


def test_scripts_end_to_end(tmp_path, golden, golden_state_dict):
    """HF -> convert_from_pytorch (CLI) -> CKPT -> prolip_jax.load; CKPT -> convert_to_pytorch -> HF."""
    hf = _write_hf(tmp_path / "hf", golden_state_dict, json.loads(str(golden["config_json"])))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "convert_from_pytorch.py"),
                          "--hf_dir", str(hf), "--out", str(tmp_path / "ckpt")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    model = prolip_jax.load(tmp_path / "ckpt")
    mu, logvar = model.encode_image(golden["images_nchw"].transpose(0, 2, 3, 1))
    assert max_rel_err(mu, golden["image_mean"]) <= 1e-5 and max_rel_err(logvar, golden["image_logvar"]) <= 1e-5
    mu, logvar = model.encode_text(golden["texts"])
    assert max_rel_err(mu, golden["text_mean"]) <= 1e-5 and max_rel_err(logvar, golden["text_logvar"]) <= 1e-5

    assert convert_to_pytorch.main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf2")]) == 0
    sd = convert.read_safetensors(tmp_path / "hf2" / "model.safetensors")
    assert set(sd) == set(golden_state_dict)
    for k in sd:
        np.testing.assert_array_equal(sd[k], golden_state_dict[k], err_msg=k)
