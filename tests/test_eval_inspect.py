"""evaluators/inspect_data.py and scripts/inspect_uncertainty.py: rankings by sigma^2, the HTML
page and the PCA ellipse picture (hand-made arrays), and the script's `inspect` on demo data."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from evaluators import inspect_data as I
from input_pipeline import eval_data

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import inspect_uncertainty  # noqa: E402


def test_rank_by_sigma2_by_hand():
    most, least = I.rank_by_sigma2(np.array([3.0, 1.0, 2.0, 3.0]), 2)
    assert most.tolist() == [0, 3] and least.tolist() == [1, 2]   # ties: lower index first
    most, least = I.rank_by_sigma2(np.array([5.0]), 3)
    assert most.tolist() == least.tolist() == [0]


def test_write_html_order_and_files(tmp_path):
    rng = np.random.default_rng(0)
    data = eval_data.arrays(rng.integers(0, 255, (3, 8, 8, 3), np.uint8), "toy")
    data.captions = ["dog", "a red car parked", "thing", "a cat"]
    data.caption_record = np.array([0, 1, 2, 2])
    d = 4
    # sigma^2 = d * exp(lv): images 1 > 0 > 2; captions 2 > 0 > 3 > 1
    enc = {"image_mu": np.eye(3, d), "image_logvar": np.array([[-3.0] * d, [-1.0] * d, [-5.0] * d]),
           "text_mu": np.eye(4, d), "text_logvar": np.array([[-2.0] * d, [-6.0] * d, [0.0] * d, [-4.0] * d])}
    ranking = I.write_html(tmp_path, data, enc, top=2)
    assert ranking == {"images_most": [1, 0], "images_least": [2, 0],
                       "captions_most": [2, 0], "captions_least": [1, 3]}
    page = (tmp_path / "index.html").read_text()
    most_caps = page[page.index("Most uncertain captions"):page.index("Least uncertain captions")]
    assert most_caps.index("thing") < most_caps.index("dog") and "a cat" not in most_caps
    for i in (0, 1, 2):
        assert (tmp_path / "images" / f"img_{i:06d}.png").is_file()
    saved = json.loads((tmp_path / "ranking.json").read_text())
    assert saved["text_sigma2_trace"][2] == pytest.approx(4.0)
    # CSD of caption 1 with image 1: ||e1 - e1||^2 + 4 e^-1 + 4 e^-6
    assert I.pair_csd(enc, data.caption_record)[1] == pytest.approx(4 * np.exp(-1) + 4 * np.exp(-6))


def test_pca_ellipses_axis_aligned(tmp_path):
    # means spread along x (and a little along y): PC1 = x, PC2 = y, so the projected
    # covariance of each item is diag(sigma_x^2, sigma_y^2)
    mu = np.array([[-10.0, 0, 0], [10.0, 0, 0], [0, 2.0, 0], [0, -2.0, 0]])
    lv = np.log(np.array([[0.01, 0.04, 0.02]] * 4))
    out = I.pca_ellipses(mu, lv, ["a", "b", "c", "d"], tmp_path / "ellipses.png",
                         ["image", "image", "text", "text"], samples=50)
    assert (tmp_path / "ellipses.png").stat().st_size > 1000
    np.testing.assert_allclose(np.abs(out["components"]), [[1, 0, 0], [0, 1, 0]], atol=0.02)
    np.testing.assert_allclose(out["cov2d"], [np.diag([0.01, 0.04])] * 4, atol=1e-3)
    np.testing.assert_allclose(np.abs(out["mean2d"][:, 0]), [10, 10, 0, 0], atol=0.2)


def test_script_inspect_on_demo(micro, tmp_path):
    model, params = micro
    demo = dict(cache_dir=str(tmp_path / "demo"), image_size=16, num_train=200, num_zeroshot=36,
                num_retrieval=20, num_levels=10)
    args = argparse.Namespace(dataset="demo", demo_cache_dir="", demo_split="levels", max_items=6)
    data = eval_data.demo("levels", demo)
    tok = inspect_uncertainty.tokenizer_for(data, args, model.config.text.context_length)
    res = inspect_uncertainty.inspect(model, params, data, tok, tmp_path / "out", top=3,
                                      ellipses=2, batch_size=16)
    out = tmp_path / "out"
    assert (out / "index.html").is_file() and (out / "ellipses.png").is_file()
    s2 = I.uncertainty(res["encodings"]["text_logvar"])
    assert res["ranking"]["captions_most"] == np.argsort(-s2, kind="stable")[:3].tolist()
    assert len(list((out / "images").glob("*.png"))) >= 3
