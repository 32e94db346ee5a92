"""Optional PyTorch checks (`pip install torch==2.13.0`; skipped when torch is absent).

1. `torch_reference.TorchProLIP` loaded with the fixture's state_dict reproduces the golden
   outputs (which the real reference produced), so it is a faithful stand-in.
2. At other sizes, a JAX model exported by `save_hf` loads into it with strict keys and gives
   the JAX outputs; its own safetensors export loads through `prolip_jax.load`.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402

import prolip_jax  # noqa: E402
from conftest import max_rel_err  # noqa: E402
from prolip_jax.core import convert  # noqa: E402
from prolip_jax.core.models import get_config, init_params  # noqa: E402
from prolip_jax import export
from torch_reference import TorchProLIP  # noqa: E402

OTHER_SIZES = {
    "micro": "micro",
    "quick_gelu_odd_widths": {
        "embed_dim": 48, "quick_gelu": True, "init_logit_bias": -7,
        "vision_cfg": {"embed_unc": True, "image_size": 36, "patch_size": 12, "width": 40, "head_width": 20,
                       "layers": 3, "mlp_ratio": 3.7362},
        "text_cfg": {"context_length": 11, "vocab_size": 300, "width": 48, "heads": 4, "layers": 2,
                     "mlp_ratio": 2.5}},
}


def _torch_outputs(model, images, tokens):
    with torch.no_grad():
        img = model.encode_image(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()))
        txt = model.encode_text(torch.from_numpy(tokens).long())
    return [t.numpy() for t in (*img, *txt)]


def test_torch_stand_in_reproduces_fixture(golden, golden_state_dict):
    model = TorchProLIP(json.loads(str(golden["config_json"]))).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in golden_state_dict.items()}, strict=True)
    outs = _torch_outputs(model, golden["images_nchw"].transpose(0, 2, 3, 1), golden["texts"])
    for got, key in zip(outs, ("image_mean", "image_logvar", "text_mean", "text_logvar")):
        assert max_rel_err(got, golden[key]) <= 1e-5, key


def _perturbed_params(cfg):
    params = init_params(cfg, jax.random.key(1))
    leaves, tdef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    return tdef.unflatten([np.asarray(x + 0.05 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)])


@pytest.mark.parametrize("name", sorted(OTHER_SIZES))
def test_export_loads_into_torch_and_matches(tmp_path, name):
    cfg = get_config(OTHER_SIZES[name])
    params = _perturbed_params(cfg)
    export.save_hf(tmp_path / "hf", params, cfg)
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    model = TorchProLIP(hf_config).eval()
    sd = convert.read_safetensors(tmp_path / "hf" / "model.safetensors")
    model.load_state_dict({k: torch.from_numpy(v) for k, v in sd.items()}, strict=True)

    rng = np.random.default_rng(0)
    s, length = cfg.vision.image_size, cfg.text.context_length
    images = rng.normal(size=(3, s, s, 3)).astype(np.float32)
    tokens = rng.integers(2, cfg.text.vocab_size, size=(3, length)).astype(np.int32)
    tokens[0, 4:] = 1
    jm = prolip_jax.load(tmp_path / "hf")
    ours = [*jm.encode_image(images), *jm.encode_text(tokens)]
    for got, ref in zip(ours, _torch_outputs(model, images, tokens)):
        assert max_rel_err(got, ref) <= 1e-5

    # ... and the other direction: torch weights -> safetensors -> prolip_jax.load.
    from safetensors.torch import save_file

    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    (tmp_path / "hf2").mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(tmp_path / "hf2" / "model.safetensors"))
    (tmp_path / "hf2" / "config.json").write_text(json.dumps(hf_config))
    jm2 = prolip_jax.load(tmp_path / "hf2")
    ours = [*jm2.encode_image(images), *jm2.encode_text(tokens[:, : length - 2])]  # shorter text too
    refs = _torch_outputs(model, images, tokens[:, : length - 2])
    for got, ref in zip(ours, refs):
        assert max_rel_err(got, ref) <= 1e-5
