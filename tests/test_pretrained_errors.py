"""Importer failures are clear ValueErrors / FileNotFoundErrors and write nothing; Hugging Face
repo ids resolve from a hub cache laid out on disk (nothing is downloaded)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from prolip_jax.core import convert
from prolip_jax.core.pretrained.loader import load_pretrained

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import convert_from_pytorch  # noqa: E402

DATA = Path(__file__).parent / "data" / "pretrained"
CLIP = DATA / "openai_clip_tiny"


def copy_clip(tmp_path: Path, state_dict=None) -> Path:
    d = tmp_path / "clip"
    shutil.copytree(CLIP, d)
    if state_dict is not None:
        save_file(state_dict, str(d / "open_clip_model.safetensors"))
    return d


def test_wrong_family_forced():
    with pytest.raises(ValueError, match="format='big_vision' was requested but .* holds a open_clip checkpoint"):
        load_pretrained(CLIP, format="big_vision")
    with pytest.raises(ValueError, match="format='timm_siglip' was requested .* big_vision"):
        load_pretrained(DATA / "siglip_bigvision_tiny.npz", format="timm_siglip")
    with pytest.raises(ValueError, match="unknown format"):
        load_pretrained(CLIP, format="clip")


def test_truncated_files(tmp_path):
    d = copy_clip(tmp_path)
    w = d / "open_clip_model.safetensors"
    w.write_bytes(w.read_bytes()[:5000])
    with pytest.raises(ValueError, match="could not read .* as safetensors"):
        load_pretrained(d)
    npz = tmp_path / "cut.npz"
    npz.write_bytes((DATA / "siglip_bigvision_tiny.npz").read_bytes()[:50000])
    with pytest.raises(ValueError, match="could not read .* as an .npz archive"):
        load_pretrained(npz)


def test_pickled_files_are_refused_with_the_conversion_command(tmp_path):
    pt = tmp_path / "epoch_32.pt"
    pt.write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(ValueError, match=r"(?s)pickled PyTorch file.*torch.load\(.*save_file\("):
        load_pretrained(pt)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "open_clip_pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(ValueError, match="open_clip_pytorch_model.bin is a pickled"):
        load_pretrained(folder)


def test_shape_mismatch_with_config(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"wrong shape\(s\).*visual.conv1.weight: got \(32, 3, 8, 8\), expected \(768, 3, 32, 32\)"):
        load_pretrained(CLIP, arch="ViT-B-32-quickgelu")
    with pytest.raises(ValueError, match="unknown open_clip architecture"):
        load_pretrained(CLIP, arch="ViT-Z-99")
    out = tmp_path / "ckpt"
    assert convert_from_pytorch.main(["--src", str(CLIP), "--out", str(out), "--arch", "ViT-B-16"]) == 2
    assert "wrong shape" in capsys.readouterr().err and not out.exists()


def test_missing_and_unplaced_keys(tmp_path, capsys):
    sd = convert.read_safetensors(CLIP / "open_clip_model.safetensors")
    extra = copy_clip(tmp_path, {**sd, "visual.extra_head.weight": np.zeros((2, 2), np.float32)})
    with pytest.raises(ValueError, match=r"1 key\(s\) have no place in the model: \['visual.extra_head.weight'\]"):
        load_pretrained(extra)
    out = tmp_path / "ckpt"
    assert convert_from_pytorch.main(["--src", str(extra), "--out", str(out)]) == 2
    assert "no place" in capsys.readouterr().err and not out.exists()
    _, params, report = load_pretrained(extra, allow_unplaced=True)
    assert report.unplaced == ["visual.extra_head.weight"] and "dropped" in report.summary()
    assert convert_from_pytorch.main(["--src", str(extra), "--out", str(out), "--allow_unplaced"]) == 0

    del sd["ln_final.bias"]
    missing = copy_clip(tmp_path / "m", sd)
    with pytest.raises(ValueError, match=r"1 missing key\(s\): \['ln_final.bias'\]"):
        load_pretrained(missing)


def test_no_config_beside_weights(tmp_path):
    w = tmp_path / "open_clip_model.safetensors"
    shutil.copy(CLIP / "open_clip_model.safetensors", w)
    with pytest.raises(FileNotFoundError, match="open_clip_config.json not found: pass arch="):
        load_pretrained(w)
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_pretrained(tmp_path / "nope.safetensors")


# ------------------------------------------------------------------------------ hub names
REV = "0123456789abcdef0123456789abcdef01234567"


def fake_hub(root: Path, repo: str, files: dict[str, Path | bytes]) -> None:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<rev>/<file>}."""
    base = root / f"models--{repo.replace('/', '--')}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(REV)
    snap = base / "snapshots" / REV
    snap.mkdir(parents=True)
    for name, content in files.items():
        (snap / name).write_bytes(content if isinstance(content, bytes) else content.read_bytes())


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    fake_hub(root, "org/tiny-clip", {f: CLIP / f for f in ("open_clip_config.json", "open_clip_model.safetensors")})
    fake_hub(root, "org/pickled-clip", {"open_clip_config.json": CLIP / "open_clip_config.json",
                                        "open_clip_pytorch_model.bin": b"\x80\x04K\x01."})
    return root


def test_hub_repo_id_from_offline_cache(hub_cache, tmp_path):
    import prolip_jax

    config, params, report = load_pretrained("org/tiny-clip")
    assert report.format == "open_clip" and str(hub_cache) in report.source
    _, reference, _ = load_pretrained(CLIP)
    np.testing.assert_array_equal(params["visual"]["proj"], reference["visual"]["proj"])
    model = prolip_jax.load("org/tiny-clip", batch_size=8)
    assert model.report.format == "open_clip" and model.config == config
    assert convert_from_pytorch.main(["--src", "org/tiny-clip", "--out", str(tmp_path / "ckpt")]) == 0


def test_hub_errors_name_repo_and_files(hub_cache):
    with pytest.raises(FileNotFoundError, match=r"'org/absent'.*open_clip_model.safetensors.*HF_HUB_OFFLINE"):
        load_pretrained("org/absent")
    with pytest.raises(ValueError, match="(?s)'org/pickled-clip' has open_clip_pytorch_model.bin but no "
                                         "open_clip_model.safetensors.*save_file"):
        load_pretrained("org/pickled-clip")
    with pytest.raises(ValueError, match="not on the Hugging Face hub"):
        load_pretrained("org/tiny-clip", format="big_vision")
