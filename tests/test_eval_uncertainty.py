"""evaluators/uncertainty.py (metrics by hand, the evaluator on demo data) and scripts/evaluate.py
on a checkpoint written by the converter."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from evaluators import uncertainty as unc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_from_pytorch  # noqa: E402
import evaluate  # noqa: E402
from prolip_jax import export

DEMO = dict(image_size=16, num_train=200, num_zeroshot=36, num_retrieval=20, num_levels=10)


# ------------------------------------------------------------------------------ metrics
def test_rank_average_and_spearman_by_hand():
    np.testing.assert_array_equal(unc.rank_average(np.array([10.0, 30.0, 20.0, 20.0])),
                                  [1.0, 4.0, 2.5, 2.5])
    # x = [1, 2, 3, 4, 5], y = [2, 1, 4, 3, 5]: d = [1, 1, 1, 1, 0], rho = 1 - 6*4/(5*24) = 0.8
    assert unc.spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    assert unc.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # ties: x ranks [1.5, 1.5, 3, 4], y ranks [1, 2, 3, 4]; Pearson of those = 0.9486833 (= 3/sqrt(10))
    assert unc.spearman([5, 5, 7, 9], [1, 2, 3, 4]) == pytest.approx(3 / np.sqrt(10))
    assert np.isnan(unc.spearman([1, 1, 1], [1, 2, 3]))
    from scipy.stats import spearmanr
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 5, 50), rng.normal(size=50)
    assert unc.spearman(x, y) == pytest.approx(spearmanr(x, y).statistic, abs=1e-12)


def test_ordering_rates_by_hand_with_ties():
    u = np.array([[4.0, 3.0, 2.0, 1.0],    # fully decreasing: 3/3 adjacent, monotone
                  [4.0, 4.0, 2.0, 1.0],    # a tie between levels 0 and 1 is not "decreasing"
                  [1.0, 2.0, 3.0, 0.5]])   # increasing, then decreasing at the end
    r = unc.ordering_rates(u)   # in %
    assert r["order_adjacent_rate"] == pytest.approx(100 * (3 + 2 + 1) / 9)
    assert r["order_monotone_rate"] == pytest.approx(100 * 1 / 3)
    assert r["order_level0_gt_level3_rate"] == pytest.approx(100 * 1.0)
    assert r["order_level0_gt_level1_rate"] == pytest.approx(100 * 1 / 3)
    assert r["order_level1_gt_level2_rate"] == pytest.approx(100 * 2 / 3)
    assert len([k for k in r if k.startswith("order_level")]) == 6
    with pytest.raises(ValueError):
        unc.ordering_rates(np.ones((3, 1)))


def test_inclusion_scores_on_known_gaussians():
    rng = np.random.default_rng(0)
    mu = rng.normal(size=(6, 8)).astype(np.float32)
    mu /= np.linalg.norm(mu, axis=-1, keepdims=True)
    small, big = np.full((6, 8), -6.0, np.float32), np.full((6, 8), -2.0, np.float32)
    # Same mean, smaller variance: Z1 is included in Z2 (and not the other way round).
    h = unc.inclusion_scores(mu, small, mu, big)
    assert np.all(h > 0)
    assert np.all(unc.inclusion_scores(mu, big, mu, small) < 0)
    # Golden check of the per-item sum against naver-ai/prolip src/prolip/loss.py's formula in float64 numpy
    # (eps = 0; for equal means only the variance terms remain).
    def inc(m1, l1, m2, l2):
        i1, i2 = np.exp(-l1), np.exp(-l2)
        a, b, c = i1 + 0.5 * i2, 2 * m1 * i1 + m2 * i2, m1 ** 2 * i1 + 0.5 * m2 ** 2 * i2
        return -2 * l1 - l2 - 0.5 * np.log(a) + b ** 2 / 4 / a - c

    m64 = mu.astype(np.float64)
    np.testing.assert_allclose(h, (inc(m64, -6.0, m64, -2.0) - inc(m64, -2.0, m64, -6.0)).sum(-1), rtol=1e-5)
    # per dim: (l2 - l1) - 0.5 log((e^6 + e^2 / 2) / (e^2 + e^6 / 2)) = 3.6666
    assert h[0] == pytest.approx(8 * (4.0 - 0.5 * np.log((np.exp(6) + np.exp(2) / 2) / (np.exp(2) + np.exp(6) / 2))), rel=1e-5)
    # Different means, larger variances of Z2: still included in this regime; mixed rows too.
    lv1, lv2 = rng.uniform(-8, -4, (6, 8)), rng.uniform(-8, -4, (6, 8))
    mu2 = mu + 0.01 * rng.normal(size=mu.shape)
    np.testing.assert_allclose(unc.inclusion_scores(mu, lv1, mu2, lv2),
                               (inc(m64, lv1, mu2, lv2) - inc(mu2, lv2, m64, lv1)).sum(-1), rtol=2e-3, atol=1e-2)
    # Identical Gaussians: H = 0 exactly, counted as not included (strict > 0).
    assert np.all(unc.inclusion_scores(mu, small, mu, small) == 0)


def test_summarize_rates_from_arrays():
    arrays = {
        "image_sigma2": np.array([1.0, 2.0, 3.0, 4.0]),
        "image_masked_sigma2": np.array([2.0, 2.0, 2.0, 2.0]),
        "text_sigma2": np.array([[4.0, 1.0], [5.0, 2.0], [6.0, 7.0], [8.0, 3.0]]),
        "text_masked_sigma2": np.ones((4, 2)),
        "paired_text_sigma2": np.array([1.0, 2.0, 7.0, 3.0]),
        "text_length": np.array([[1, 3], [1, 3], [1, 3], [1, 3]]),
        "h_image_in_masked": np.array([1.0, -1.0, 0.0, 2.0]),
        "h_text_in_masked": np.array([[1.0, 1.0], [1.0, 1.0], [-1.0, -1.0], [0.0, 5.0]]),
        "h_image_in_text": np.array([-1.0, -1.0, -1.0, 3.0]),
    }
    m = unc.summarize(arrays, levels=True)
    assert m["image_sigma2_trace_mean"] == pytest.approx(2.5)
    assert m["image_sigma2_trace_median"] == pytest.approx(2.5)
    assert m["image_sigma2_trace_std"] == pytest.approx(np.sqrt(1.25))
    assert m["text_sigma2_trace_mean"] == pytest.approx(4.5)
    assert m["image_below_text_rate"] == pytest.approx(25.0)     # only 3 < 7 (ties are not "below")
    assert m["inclusion_image_in_masked_rate"] == pytest.approx(50.0)   # 0 is not > 0
    assert m["inclusion_text_in_masked_rate"] == pytest.approx(100 * 5 / 8)
    assert m["inclusion_image_in_text_rate"] == pytest.approx(25.0)
    assert m["order_adjacent_rate"] == pytest.approx(75.0)
    assert m["text_sigma2_trace_level0_mean"] == pytest.approx(5.75)
    # sigma^2 ranks [4,1,5,2,6,7,8,3] vs length ranks 2.5 / 6.5: cov -20, var 42 and 32
    assert m["text_sigma2_trace_length_spearman"] == pytest.approx(-20 / np.sqrt(42 * 32))
    assert "order_adjacent_rate" not in unc.summarize(arrays, levels=False)


# ------------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def micro():
    from prolip_jax.core.models import ProLIP, get_config, init_params

    config = get_config("micro")
    # jit: one compiled init instead of op-by-op dispatch (seconds on 2 CPU cores)
    return config, ProLIP(config), init_params(config, jax.random.key(0))


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    from input_pipeline.demo import get_demo

    cache = tmp_path_factory.mktemp("demo")
    get_demo(cache_dir=str(cache), **DEMO)
    return str(cache)


@pytest.fixture(scope="module")
def demo_eval(micro, demo_dir):
    """The evaluator on the demo levels split and its collected arrays (default batch size, as
    the script uses)."""
    _, model, params = micro
    ev = unc.Evaluator(dict(dataset="demo", demo=dict(cache_dir=demo_dir, **DEMO)), model)
    return ev, ev.collect(params)


def test_evaluator_on_demo_levels(micro, demo_eval):
    config, model, params = micro
    ev, arrays = demo_eval
    assert ev.levels and ev.mask_id == 2 and ev.protected_ids == (1,)
    assert ev.tokens.shape == (10, 4, config.text.context_length)
    assert arrays["image_sigma2"].shape == (10,)
    assert arrays["text_sigma2"].shape == arrays["h_text_in_masked"].shape == (10, 4)
    # Caption lengths grow with the level (level 0 "a shape" .. level 3 the full description).
    lengths = arrays["text_length"]
    assert np.all(lengths[:, 0] == 2) and np.all(lengths[:, 3] > lengths[:, 0])
    # At init log sigma^2 is about the -10 bias: tr(Sigma) ~ 32 * e^-10 = 1.45e-3.
    assert 3e-4 < np.median(arrays["image_sigma2"]) < 1e-2
    # Masking really changes the inputs: masked embeddings differ from the originals.
    assert not np.allclose(arrays["image_masked_sigma2"], arrays["image_sigma2"])
    metrics = dict(ev.summarize(arrays))
    assert metrics == {f"uncertainty/demo/{k}": v for k, v in unc.summarize(arrays, True).items()}
    assert len(metrics) == 6 + 2 + 1 + 1 + 3 + 4 + 2 + 6  # stats, masked, below, rho, rates, levels, order
    for key in ("inclusion_image_in_masked_rate", "inclusion_text_in_masked_rate",
                "inclusion_image_in_text_rate", "order_adjacent_rate", "order_level0_gt_level3_rate"):
        assert 0.0 <= metrics[f"uncertainty/demo/{key}"] <= 100.0
    rate = metrics["uncertainty/demo/inclusion_image_in_text_rate"]
    assert rate == 100 * np.mean(arrays["h_image_in_text"] > 0)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bogus'\]"):
        unc.Evaluator(dict(dataset="demo", bogus=1), model)


def test_evaluate_script_on_converted_checkpoint(micro, demo_dir, demo_eval, tmp_path):

    config, _, params = micro
    hf, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "eval"
    export.save_hf(hf, params, config)
    assert convert_from_pytorch.main(["--hf_dir", str(hf), "--out", str(ckpt)]) == 0
    cfg = ROOT / "configs" / "eval" / "demo.py"
    assert evaluate.main(["--checkpoint", str(ckpt), "--config",
                          f"{cfg}:small=1,cache_dir={demo_dir}",
                          "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["throughput/images_per_second"] > 0
    assert results["uncertainty/seconds"] > 0
    assert 3e-4 < results["uncertainty/demo/image_sigma2_trace_mean"] < 1e-2
    assert set(results) >= {f"uncertainty/demo/{k}" for k in (
        "text_sigma2_trace_mean", "text_sigma2_trace_length_spearman", "inclusion_image_in_masked_rate",
        "inclusion_text_in_masked_rate", "inclusion_image_in_text_rate", "order_adjacent_rate",
        "order_monotone_rate", "order_level0_gt_level3_rate")}
    # Same weights, same data, same seed as the in-process evaluator: identical numbers.
    direct = dict(demo_eval[0].summarize(demo_eval[1]))
    assert results["uncertainty/demo/order_adjacent_rate"] == direct["uncertainty/demo/order_adjacent_rate"]
    assert results["uncertainty/demo/text_sigma2_trace_mean"] == pytest.approx(
        direct["uncertainty/demo/text_sigma2_trace_mean"], rel=1e-5)
    # The other evaluators of the demo config ran too (their own tests check their values).
    assert 0 <= results["zeroshot/object/top1_csd"] <= 100
    assert 0 <= results["retrieval/demo/csd/rsum"] <= 600
    for png in ("uncertainty_sigma2_hist", "uncertainty_sigma2_vs_length",
                "uncertainty_sigma2_by_level", "zeroshot_accuracy_by_uncertainty"):
        path = out / f"{png}.png"
        assert path.stat().st_size > 1000 and path.read_bytes()[:4] == b"\x89PNG"
    # An unregistered evaluator type is a clear error naming it and the registered ones.
    bad = tmp_path / "bad.py"
    bad.write_text("import ml_collections as m\ndef get_config(arg=None):\n    c = m.ConfigDict()\n"
                   "    c.evals = m.ConfigDict(dict(x=dict(type='no_such_eval')))\n    return c\n")
    with pytest.raises(SystemExit, match=r"x: unknown evaluator type 'no_such_eval'; registered: \[.*'zeroshot'"):
        evaluate.main(["--checkpoint", str(ckpt), "--config", str(bad), "--out", str(tmp_path / "eval_bad")])
