"""`prolip_jax.load` and the encoders of the public API."""
from __future__ import annotations

import numpy as np
import pytest

import prolip_jax
from conftest import max_rel_err
from prolip_jax.core import checkpoint
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
    # logit_scale is the log, as open_clip's; scale is a = exp(logit_scale).
    assert model.logit_scale == pytest.approx(np.log(10.0), rel=1e-6) and model.logit_bias == -10.0
    assert model.scale == pytest.approx(10.0, rel=1e-6)
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


def _words(texts):
    """A stand-in tokenizer: one id per word (its length + 3), EOS 1, padded to 16."""
    texts = [texts] if isinstance(texts, str) else texts
    out = np.ones((len(texts), 16), np.int32)
    for i, t in enumerate(texts):
        ids = [len(w) + 3 for w in t.split()][:15]
        out[i, :len(ids)] = ids
    return out


def test_similarity_and_zero_shot_against_float64(hf_dir, golden):
    """similarity = a (mu_v . mu_t - tr(S_v + S_t) / 2) + b and zero_shot = softmax over classes of
    100 mu_v . mu_c - 50 tr(S_c) with prompt-averaged classes, recomputed in float64 (<= 1e-5)."""
    model = prolip_jax.load(hf_dir, tokenizer=_words)
    image = model.encode_image(golden["images_nchw"].transpose(0, 2, 3, 1))
    text = model.encode_text(golden["texts"])
    (vm, vl), (tm, tl) = [(np.float64(m), np.float64(lv)) for m, lv in (image, text)]
    want = 10.0 * (vm @ tm.T - (np.exp(vl).sum(1)[:, None] + np.exp(tl).sum(1)[None, :]) / 2) - 10.0
    got = model.similarity(image, text)
    assert got.shape == (6, len(golden["texts"])) and max_rel_err(got, want) <= 1e-5

    classes, templates = ["cat", "small dog", "red bird"], ["a {}", "a photo of the {} here"]
    probs = model.zero_shot(image, classes, templates)
    pm, pl = [np.float64(x) for x in model.encode_text(_words([t.format(c) for c in classes for t in templates]))]
    cm = pm.reshape(3, 2, -1).mean(1)
    cm /= np.linalg.norm(cm, axis=-1, keepdims=True)
    logits = 100 * vm @ cm.T - 50 * np.exp(pl).reshape(3, 2, -1).mean(1).sum(-1)[None]
    want = np.exp(logits - logits.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    assert probs.shape == (6, 3) and np.abs(probs - want).max() <= 1e-5
    np.testing.assert_allclose(model.uncertainty(image), np.exp(vl).sum(1), rtol=1e-6)
    assert model.uncertainty((vm, None)) is None
    with pytest.raises(ValueError, match="classnames must be a non-empty list"):
        model.zero_shot(image, "cat")
    with pytest.raises(ValueError, match="pairs of one width"):
        model.similarity(image, (text[0][:, :8], None))
