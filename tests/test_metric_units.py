"""One unit per metric kind (docs/metrics.md): every evaluator's metrics through one check, known
perfect encodings scoring exactly 100%, and the trainer's sigma^2 equal to the evaluators' under
the same name rule (`sigma2_trace`) on the same model and batch."""
from __future__ import annotations

import json
import math
import re

import jax
import numpy as np
import pytest
from PIL import Image

import evaluators
from evaluators import retrieval, suite, uncertainty, zeroshot
from prolip_jax.core import step

DEMO = dict(image_size=16, num_train=200, num_zeroshot=36, num_retrieval=20, num_levels=10)

PERCENT = re.compile(  # accuracy / recall / precision / mAP / F1 / rate names (the last path part)
    r"top\d+_\w+|\w*R@\d+(_root)?|unc_bin\d+_\w+|(\w+_)?(r1|rprecision|map_at_r|asp_tfidf)"
    r"|\w*pmrp(_zeta\d+)?|precision|recall|level\d+_recall|\w+_rate|acc\d+|mean_per_class_recall"
    r"|f1_macro|worst_group_\w+|mean_recall@1|average")


def unit(key: str) -> str:
    """The unit docs/metrics.md gives the metric `key`."""
    last = key.rsplit("/", 1)[-1]
    if re.search(r"unc_corr|unc_rho|spearman", last):
        return "correlation"
    if "sigma2" in last:
        return "sigma2"
    if last == "rsum":
        return "rsum"
    return "%" if PERCENT.fullmatch(last) else "other"


def check_units(metrics: dict[str, float]) -> dict[str, list[str]]:
    """Asserts every metric's range for its unit; returns the keys by unit."""
    by_unit: dict[str, list[str]] = {}
    for key, value in metrics.items():
        u = unit(key)
        by_unit.setdefault(u, []).append(key)
        if u == "%":
            assert 0.0 <= value <= 100.0, (key, value)
        elif u == "rsum":
            assert 0.0 <= value <= 600.0, (key, value)
        elif u == "correlation":
            assert math.isnan(value) or -1.0 <= value <= 1.0, (key, value)
        elif u == "sigma2":   # one name rule: the trace, and the name says so
            assert "sigma2_trace" in key and value >= 0, (key, value)
        assert "unc_mean" not in key, key
    return by_unit


@pytest.fixture(scope="module")
def micro():
    from prolip_jax.core.models import ProLIP, get_config, init_params

    config = get_config("micro")
    return config, ProLIP(config), init_params(config, jax.random.key(0))


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from input_pipeline.demo import get_demo

    cache = str(tmp_path_factory.mktemp("demo"))
    get_demo(cache_dir=cache, **DEMO)
    return dict(cache_dir=cache, **DEMO)


def _tok(texts):   # stand-in tokenizer for the suite: distinct texts give distinct rows
    return np.asarray([[3 + sum(map(ord, t)) % 200, 3 + len(t) % 50] + [1] * 6 for t in texts], np.int32)


def _suite_dir(root):
    """cifar10 as an ImageFolder (2 classes x 2 images) and a 3-image Flickr30K (Karpathy)."""
    rng = np.random.default_rng(0)
    for c in ("airplane", "cat"):
        (root / "cifar10" / "test" / c).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (12, 12, 3), np.uint8)).save(root / "cifar10" / "test" / c / f"{i}.png")
    (root / "flickr30k" / "images").mkdir(parents=True)
    for i in range(3):
        Image.fromarray(rng.integers(0, 255, (12, 12, 3), np.uint8)).save(root / "flickr30k" / "images" / f"{i}.png")
    meta = {"dataset": "flickr30k", "images": [
        {"filename": f"{i}.png", "split": "test", "sentences": [{"raw": f"picture {i} {j}"} for j in range(2)]}
        for i in range(3)]}
    (root / "flickr30k" / "dataset_flickr30k.json").write_text(json.dumps(meta))
    return root


def test_every_evaluator_reports_one_unit_per_kind(micro, demo, tmp_path):
    """Each registered evaluator on a random micro model: every accuracy-like name in [0, 100],
    correlations in [-1, 1], sigma^2 named `sigma2_trace`."""
    _, model, params = micro
    configs = {
        "zeroshot": dict(dataset="demo", demo=demo, task="object", batch_size=16, bprw=("nn",),
                         prompt_select=("topk:2",)),
        "prompt_reweighting": dict(dataset="demo", demo=demo, task="object", batch_size=16, bprw=("nn",)),
        "retrieval": dict(dataset="demo", demo=demo, scores=("csd", "dot"), batch_size=16, unc_bins=2),
        "uncertainty": dict(dataset="demo", demo=demo, batch_size=16),
        "hierarcaps": dict(dataset="demo", demo=demo, batch_size=16),
        "modality_gap": dict(dataset="demo", demo=demo, batch_size=16),
        "datacomp38": dict(data_dir=str(_suite_dir(tmp_path)), tasks=("cifar10", "flickr30k"),
                           batch_size=8, num_threads=2),
    }
    assert set(configs) == set(evaluators.REGISTRY)   # a new evaluator joins this check
    for kind, cfg in configs.items():
        ev = evaluators.build(kind, cfg, model, _tok if kind == "datacomp38" else None)
        by_unit = check_units(dict(ev.run(params)))
        if kind != "modality_gap":   # the gap and cosines are plain numbers
            assert by_unit.get("%"), (kind, by_unit)
        if kind in ("zeroshot", "uncertainty", "modality_gap", "hierarcaps"):
            assert by_unit.get("sigma2"), (kind, by_unit)


def test_perfect_cases_score_100(micro, demo, monkeypatch):
    """Known perfect encodings through the evaluators' own metric code: 100, not 1."""
    _, model, params = micro
    # Zero-shot: every prompt of class c is e_c and every image of class c is e_c.
    ev = zeroshot.Evaluator(dict(dataset="demo", demo=demo, task="object", batch_size=16,
                                 bprw=("nn",), prompt_select=("topk:2",)), model)
    n_cls, n_tpl = len(ev.classnames), len(ev.templates)
    labels = np.arange(72) % n_cls
    eye = np.eye(n_cls, 40, dtype=np.float32)
    enc = {"text_mu": np.repeat(eye, n_tpl, 0), "text_logvar": np.full((n_cls * n_tpl, 40), -10, np.float32),
           "image_mu": eye[labels], "image_logvar": np.full((72, 40), -10, np.float32), "label": labels}
    monkeypatch.setattr(ev, "encode", lambda params, progress=None: enc)
    m = dict(ev.run(params))
    pct = check_units(m)["%"]
    assert len(pct) >= 4 + 20 + 4 + 4 and all(m[k] == 100.0 for k in pct), {k: m[k] for k in pct}

    # Retrieval: image i is e_i and its caption e_i (the demo split: one caption per image).
    ev = retrieval.Evaluator(dict(dataset="demo", demo=demo, scores=("csd",), unc_bins=2), model)
    cap_img = np.asarray(ev.data().caption_record)
    eye = np.eye(len(cap_img), 32, dtype=np.float32)
    lv = np.full((len(cap_img), 32), -10, np.float32)
    monkeypatch.setattr(ev, "encode", lambda params, data, progress=None: (eye, lv, eye[cap_img], lv))
    m = dict(ev.run(params))
    pct = check_units(m)["%"]
    assert len(pct) >= 10 and all(m[k] == 100.0 for k in pct), {k: m[k] for k in pct}
    assert m["retrieval/demo/csd/rsum"] == 600.0

    # Uncertainty: images below their captions, every inclusion holds, levels strictly ordered.
    ev = uncertainty.Evaluator(dict(dataset="demo", demo=demo, batch_size=16), model)
    text = np.tile([4.0, 3.0, 2.0, 1.0], (10, 1))
    arrays = {"image_sigma2": np.full(10, 0.5), "image_masked_sigma2": np.ones(10), "text_sigma2": text,
              "text_masked_sigma2": text + 1, "paired_text_sigma2": text[:, -1],
              "text_length": np.tile([2, 4, 6, 8], (10, 1)), "h_image_in_masked": np.ones(10),
              "h_text_in_masked": np.ones((10, 4)), "h_image_in_text": np.ones(10)}
    monkeypatch.setattr(ev, "collect", lambda params, progress=None: arrays)
    m = dict(ev.run(params))
    pct = check_units(m)["%"]
    assert len(pct) == 4 + 2 + 6 and all(m[k] == 100.0 for k in pct), {k: m[k] for k in pct}

    # The suite's metrics of a perfect classifier and a perfect retrieval.
    labels = np.array([0, 0, 1, 1, 2])
    for metric in ("acc1", "mean_per_class_recall", "f1_macro", "worst_group_acc", "worst_group_top5"):
        got = suite.classification_metrics(dict(metric=metric, group_column=0), labels, np.zeros(5, int),
                                           labels, np.arange(5)[:, None] % 2)
        assert got["main"] == 100.0 and got["acc1"] == got["acc5"] == 100.0, metric
    assert suite.retrieval_metric({"retrieval/f/csd/i2t_R@1": 100.0, "retrieval/f/csd/t2i_R@1": 100.0},
                                  "csd") == 100.0


def test_trainer_and_evaluator_sigma2_agree(micro, tmp_path):
    """The trainer's `sigma2_trace/<side>` (prolip_jax.core.step) and the uncertainty evaluator's
    `<side>_sigma2_trace_mean` are the same number on the same model and inputs."""
    config, model, params = micro
    rng = np.random.default_rng(0)
    n, size, length = 6, config.vision.image_size, config.text.context_length
    images = rng.normal(size=(n, size, size, 3)).astype(np.float32)   # already normalised
    tokens = rng.integers(4, 60, (n, length)).astype(np.int32)
    tokens[:, -2:] = 1   # EOS / pad
    np.savez(tmp_path / "batch.npz", image=images, text=tokens)
    ev = uncertainty.Evaluator(dict(dataset="npz", path=str(tmp_path / "batch.npz"), name="b",
                                    mask_token_id=2, batch_size=4), model)
    evaluated = dict(ev.run(params))
    features = jax.jit(lambda p, x, t: model.apply({"params": p}, x, t))(params, images, tokens)
    trained = {k: float(v) for k, v in step.sigma2_metrics(features).items()}
    assert set(trained) == {"sigma2_trace/image", "sigma2_trace/text"}
    for side in ("image", "text"):
        assert trained[f"sigma2_trace/{side}"] == pytest.approx(
            evaluated[f"uncertainty/b/{side}_sigma2_trace_mean"], rel=1e-5), side
    # the trace, not the per-dimension mean: D = 32 times the mean over dimensions
    per_dim = float(np.exp(np.asarray(features["image_logvar"], np.float64)).mean())
    assert trained["sigma2_trace/image"] == pytest.approx(32 * per_dim, rel=1e-5)
