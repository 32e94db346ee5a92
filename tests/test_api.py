"""`prolip_jax.load` and the encoders of the public API."""
from __future__ import annotations

import numpy as np
import pytest

import prolip_jax
from conftest import max_rel_err
from prolip_jax import checkpoint
from prolip_jax import export


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, golden_params, golden_config):
    return export.save_hf(tmp_path_factory.mktemp("api") / "hf", golden_params, golden_config)


def test_load_hf_folder_reproduces_reference(hf_dir, golden):
    model = prolip_jax.load(hf_dir, batch_size=4)  # 6 inputs: one full chunk + one padded chunk
    mu, logvar = model.encode_image(golden["images_nchw"].transpose(0, 2, 3, 1))
    assert mu.shape == (6, 64) and mu.dtype == np.float32
    assert max_rel_err(mu, golden["image_mean"]) <= 1e-5 and max_rel_err(logvar, golden["image_logvar"]) <= 1e-5
    np.testing.assert_allclose(np.linalg.norm(mu, axis=-1), 1.0, rtol=1e-6)
    mu, logvar = model.encode_text(golden["texts"])
    assert max_rel_err(mu, golden["text_mean"]) <= 1e-5 and max_rel_err(logvar, golden["text_logvar"]) <= 1e-5
    assert model.logit_scale == pytest.approx(10.0, rel=1e-6) and model.logit_bias == -10.0
    empty_mu, _ = model.encode_text(np.zeros((0, 16), np.int32))
    assert empty_mu.shape == (0, 64)


def test_load_checkpoint_step_dir_and_root(tmp_path, golden_params, golden_config, golden):
    checkpoint.save_params(tmp_path / "ckpt", golden_params, golden_config, step=5)
    for path in (tmp_path / "ckpt", tmp_path / "ckpt" / "5"):
        model = prolip_jax.load(path)
        assert model.config == golden_config
        _, logvar = model.encode_text(golden["texts"][:2])
        assert max_rel_err(logvar, golden["text_logvar"][:2]) <= 1e-5


def test_bad_input_messages(hf_dir, tmp_path):
    model = prolip_jax.load(hf_dir)
    with pytest.raises(ValueError, match=r"images must be \[N, 32, 32, 3\]"):
        model.encode_image(np.zeros((2, 3, 32, 32), np.float32))
    with pytest.raises(ValueError, match="floating point"):
        model.encode_image(np.zeros((2, 32, 32, 3), np.uint8))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 1000\)"):
        model.encode_text(np.full((1, 16), 1000))
    with pytest.raises(ValueError, match="0 < L <= 16"):
        model.encode_text(np.ones((1, 17), np.int32))
    with pytest.raises(ValueError, match="integers"):
        model.encode_text(np.ones((1, 16), np.float32))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="neither a prolip_jax checkpoint"):
        prolip_jax.load(tmp_path / "empty")
