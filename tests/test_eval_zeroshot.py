"""Zero-shot evaluator and BPRW: hand-computed metrics, the EM against a direct transcription of
the reference loop, and both evaluators end to end on the demo data with the micro model."""
import json
import os

import jax
import numpy as np
import pytest
from PIL import Image

from evaluators import common, prompt_reweighting as pr, zeroshot as zs
from input_pipeline import eval_data

DEMO = dict(image_size=16, num_train=200, num_zeroshot=72, num_retrieval=20, num_levels=10)


# ----------------------------------------------------------------------------- shipped data
def test_shipped_imagenet_data():
    names, templates = zs.imagenet_classnames(), zs.openai_imagenet_templates()
    assert len(names) == 1000 and len(templates) == 80
    assert names[:3] == ["tench", "goldfish", "great white shark"] and names[-1] == "toilet paper"
    assert templates[0] == "a bad photo of a {}." and templates[-1] == "a tattoo of the {}."
    assert all(t.count("{}") == 1 for t in templates)
    p = zs.prompts(names[:2], templates[:2])
    assert p == ["a bad photo of a tench.", "a photo of many tench.",
                 "a bad photo of a goldfish.", "a photo of many goldfish."]


def test_resolve_list_paths_and_missing(tmp_path):
    (tmp_path / "n.txt").write_text("cat\ndog\n")
    (tmp_path / "t.json").write_text(json.dumps(["a {}"]))
    assert zs.resolve_list(str(tmp_path / "n.txt"), list, "x") == ["cat", "dog"]
    assert zs.resolve_list(str(tmp_path / "t.json"), list, "x") == ["a {}"]
    assert zs.resolve_list(None, lambda: ["d"], "x") == ["d"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        zs.resolve_list(str(tmp_path / "missing.json"), list, "class names")


# ----------------------------------------------------------------------------- pure metrics
def test_prompt_ensemble_by_hand():
    # 2 classes x 2 templates, D = 2: class 0 prompts (1,0), (0,1) -> mean (.5,.5) -> (1,1)/sqrt2
    mu = np.array([[1, 0], [0, 1], [0.6, 0.8], [0.6, 0.8]], np.float32)
    logvar = np.log(np.array([[1, 2], [3, 4], [0.5, 0.5], [1.5, 0.5]], np.float32))
    cmu, cs2 = zs.class_embeddings(mu, logvar, 2, 2)
    np.testing.assert_allclose(cmu, [[2 ** -0.5, 2 ** -0.5], [0.6, 0.8]], atol=1e-7)
    np.testing.assert_allclose(cs2, [[2, 3], [1, 0.5]], rtol=1e-6)   # mean sigma^2, not normalised


def test_topk_by_hand():
    logits = np.array([[3., 1, 2, 0], [0, 1, 2, 3], [1, 1, 1, 1]])
    labels = np.array([2, 0, 3])
    assert zs.topk_accuracy(logits, labels, 1) == 0
    assert zs.topk_accuracy(logits, labels, 2) == pytest.approx(100 / 3)   # row 0 (rank 1), in %
    # row 1 has rank 3; the tied row 2 ranks label 3 last (stable order), so it is not rewarded
    np.testing.assert_array_equal(zs.label_rank(logits, labels), [1, 3, 3])
    assert zs.topk_accuracy(logits, labels, 4) == 100.0
    assert zs.topk_accuracy(logits, np.array([0, 3, 0]), 1) == 100.0


def test_csd_and_dot_disagree():
    img = np.array([[1.0, 0.0]])
    cmu = np.array([[0.8, 0.6], [0.6, 0.8]])
    cs2 = np.array([[0.3, 0.3], [0.05, 0.05]])   # class 0 is closer but much more uncertain
    dot = zs.zeroshot_logits(img, cmu, cs2, "dot")
    csd = zs.zeroshot_logits(img, cmu, cs2, "csd")
    np.testing.assert_allclose(dot, [[80, 60]])
    np.testing.assert_allclose(csd, [[80 - 50 * 0.6, 60 - 50 * 0.1]])   # 50 vs 55
    assert zs.topk_accuracy(dot, np.array([0]), 1) == 100 and zs.topk_accuracy(csd, np.array([1]), 1) == 100
    # for unit mu the csd rule ranks exactly like -CSD = -(|mu_i - mu_c|^2 + tr S_i + tr S_c)
    full = -np.stack([((img[0] - c) ** 2).sum() + 0.7 + s.sum() for c, s in zip(cmu, cs2)])
    assert np.argmax(full) == np.argmax(csd[0]) == 1


def test_binned_accuracy_by_hand():
    unc = np.arange(20.0)[::-1]                   # item 19 is the least uncertain
    correct = (np.arange(20) >= 10).astype(float)  # the 10 least uncertain are right
    accs, corr = common.binned_accuracy(correct, unc, bins=10)
    np.testing.assert_allclose(accs, [100] * 5 + [0] * 5)   # in %
    # Pearson r of bin index 0..9 against the step 1,1,1,1,1,0,0,0,0,0:
    # S_xy = 0.5 * (-12.5) - 0.5 * 12.5 = -12.5, S_xx = 82.5, S_yy = 2.5
    assert corr == pytest.approx(-12.5 / np.sqrt(82.5 * 2.5))


# ----------------------------------------------------------------------------- EM / BPRW
def _reference_em(obs, means, variances, alpha, var_multi, stable_eps, prior, tol=1e-12, max_iter=1000):
    """A direct numpy transcription of the reference `estimate_mixing_proportions` loop."""
    K = len(means)
    N, D = obs.shape
    pi = np.ones(K) / K if prior == "uniform" else (1 / variances.mean(1)) / (1 / variances.mean(1)).sum()
    variances = variances * var_multi
    if stable_eps:
        variances = variances + stable_eps
    obs, means, variances = obs[:, None], means[None], variances[None] * var_multi
    for _ in range(max_iter):
        exponent = -0.5 * ((obs - means) ** 2 / variances).sum(2)
        log_det = -0.5 * np.log(variances).sum(2) - 0.5 * D * np.log(2 * np.pi)
        with np.errstate(divide="ignore"):
            lr = log_det + exponent + np.log(pi)
        r = np.exp(lr - lr.max(1, keepdims=True))
        r /= r.sum(1, keepdims=True)
        new = (r.sum(0) + alpha - 1) / (N + K * (alpha - 1))
        new = np.clip(new, 0, None)
        new /= new.sum()
        if np.linalg.norm(new - pi) < tol:
            break
        pi = new
    return pi


def test_em_map_weights_by_hand():
    # 1-D, two far-apart components; 3 observations at component 0, 1 at component 1: the
    # responsibilities are 0/1, so pi = (N_k + alpha - 1) / (N + K (alpha - 1)) = (4/6, 2/6).
    obs = np.array([[0.0], [0.0], [0.0], [10.0]])
    means, var = np.array([[0.0], [10.0]]), np.array([[0.1], [0.1]])
    pi, iters = pr.estimate_mixing_proportions(obs, means, var, alpha=2.0, prior="uniform")
    np.testing.assert_allclose(pi, [4 / 6, 2 / 6], atol=1e-12)
    assert 1 <= iters <= 3
    # alpha < 1 pushes the rare component to 0 (clamped): (3 - .75, 1 - .75)/(4 - 1.5) clamp ok
    pi, _ = pr.estimate_mixing_proportions(obs, means, var, alpha=0.25, prior="uniform")
    np.testing.assert_allclose(pi, [2.25 / 2.5, 0.25 / 2.5], atol=1e-12)
    pi, _ = pr.estimate_mixing_proportions(np.zeros((4, 1)), means, var, alpha=0.25, prior="uniform")
    np.testing.assert_allclose(pi, [1.0, 0.0], atol=1e-12)


@pytest.mark.parametrize("alpha,mult,eps,prior", [(5, 1, 0.02, "inverse"), (2, 1.5, 0.01, "inverse"),
                                                   (0.8, 1, 0.0, "uniform")])
def test_em_matches_reference_loop(alpha, mult, eps, prior):
    rng = np.random.default_rng(1)
    C, T, D, M = 3, 5, 4, 30
    means = rng.normal(size=(C, T, D)) * 0.5
    var = rng.uniform(0.05, 0.5, size=(C, T, D))
    obs = means[:, :1] + rng.normal(size=(C, M, D)) * 0.4     # mostly near prompt 0
    pi, iters = pr.estimate_mixing_proportions(obs, means, var, alpha=alpha, multiplier=mult,
                                               stable_eps=eps, prior=prior)
    for c in range(C):
        np.testing.assert_allclose(pi[c], _reference_em(obs[c], means[c], var[c], alpha, mult, eps, prior),
                                   atol=1e-9)
    np.testing.assert_allclose(pi.sum(1), 1.0)
    assert (iters >= 1).all() and (iters <= 1000).all()


def test_initial_weights_inverse():
    var = np.array([[[1.0, 1.0], [3.0, 3.0]]])   # mean sigma^2 1 and 3 -> pi ~ (1, 1/3)
    np.testing.assert_allclose(pr.initial_weights(var, "inverse"), [[0.75, 0.25]])


def test_bprw_end_to_end_finds_the_matching_prompt(tmp_path):
    rng = np.random.default_rng(0)
    C, T, D, per = 3, 4, 16, 8
    text_mu = rng.normal(size=(C, T, D))
    text_mu /= np.linalg.norm(text_mu, axis=-1, keepdims=True)
    text_s2 = np.full((C, T, D), 0.01)
    best = np.array([2, 0, 3])   # the images of class c look like prompt best[c]
    labels = np.repeat(np.arange(C), per)
    img = text_mu[labels, best[labels]] + rng.normal(size=(C * per, D)) * 0.02
    img_lv = np.full_like(img, np.log(1e-4))
    for cfg in (pr.BPRWConfig.from_spec("2-1-5-20-0.02-inverse", use_gt=True),
                pr.parse_config("nn")):
        w, info = pr.bprw_weights(text_mu, text_s2, img, img_lv, cfg, labels=labels, seed=3)
        assert w.shape == (C, T) and (w >= 0).all()
        np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-12)
        np.testing.assert_array_equal(w.argmax(1), best)
        assert (w[np.arange(C), best] > 0.5).all()
        w2, _ = pr.bprw_weights(text_mu, text_s2, img, img_lv, cfg, labels=labels, seed=3)
        np.testing.assert_array_equal(w, w2)   # seeded
        if cfg.use_gt:   # few-shot picks only labelled images of the class
            assert (labels[info["images"]] == np.arange(C)[:, None]).all()
    cmu, cs2 = pr.reweighted_classifier(w, text_mu, text_s2)
    np.testing.assert_allclose(cmu[1], w[1] @ text_mu[1])
    np.testing.assert_allclose(cs2[1], (w[1] ** 2) @ text_s2[1])
    npy, js = pr.save_weights(str(tmp_path), "w", w, ["a", "b", "c"], ["t{}"] * T, cfg)
    np.testing.assert_allclose(np.load(npy), w, rtol=1e-6)
    assert json.load(open(js))["spec"] == "5-1-10-10-0.02-inverse"


def test_bprw_spec_parsing():
    cfg = pr.BPRWConfig.from_spec("2-1-5-20-0.02-inverse", use_gt=True)
    assert (cfg.alpha, cfg.multiplier, cfg.num_images, cfg.num_samples, cfg.stable_eps, cfg.prior) == \
        (2.0, 1.0, 5, 20, 0.02, "inverse")
    assert cfg.spec == "2-1-5-20-0.02-inverse" and pr.parse_config("fewshot").use_gt
    with pytest.raises(ValueError):
        pr.BPRWConfig.from_spec("2-1-5")


# ----------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def micro():
    """The micro model with random numpy parameters of the right shapes (eager Flax init of
    even this model takes >10 s on 2 cores; only finite, input-dependent outputs matter here)."""
    from prolip_jax.core.models import ProLIP, abstract_params, get_config
    cfg = get_config("micro")
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "scale" in name and "logit" not in name:   # LayerNorm scales
            return np.ones(leaf.shape, leaf.dtype)
        return (rng.normal(size=leaf.shape) * 0.2).astype(leaf.dtype)

    return ProLIP(cfg), jax.tree_util.tree_map_with_path(draw, abstract_params(cfg))


def test_evaluator_on_demo(micro, tmp_path_factory):
    model, params = micro
    out = tmp_path_factory.mktemp("out")
    config = dict(dataset="demo", demo=dict(cache_dir=str(tmp_path_factory.mktemp("demo")), **DEMO),
                  task="object", batch_size=16, bprw=("nn", "fewshot"), out_dir=str(out))
    ev = zs.Evaluator(config, model)
    results = dict(ev.run(params))
    for kind in ("dot", "csd"):
        for k in ("top1", "top5"):
            assert 0 <= results[f"zeroshot/object/{k}_{kind}"] <= 100
        assert results[f"zeroshot/object/top1_{kind}"] <= results[f"zeroshot/object/top5_{kind}"]
        bins = [results[f"zeroshot/object/unc_bin{i}_top1_{kind}"] for i in range(10)]
        assert all(0 <= b <= 100 for b in bins)
        sizes = [8] * 2 + [7] * 8   # 72 images in 10 equal-count bins
        assert np.dot(bins, sizes) / 72 == pytest.approx(results[f"zeroshot/object/top1_{kind}"])
        assert -1 <= results[f"zeroshot/object/unc_corr_{kind}"] <= 1
        for mode in ("nn", "fewshot"):
            assert 0 <= results[f"bprw/object/{mode}/top1_{kind}"] <= 100
            # the base is the plain ensemble: the same number as the zero-shot metric
            assert results[f"bprw/object/{mode}/top1_{kind}_base"] == results[f"zeroshot/object/top1_{kind}"]
    assert results["zeroshot/object/image_sigma2_trace_mean"] > 0
    # recompute top-1 from the raw encodings by hand
    enc = ev.encode(params)
    assert enc["text_mu"].shape == (36 * 4, 32) and enc["image_mu"].shape == (72, 32)
    cmu, cs2 = zs.class_embeddings(enc["text_mu"], enc["text_logvar"], 36, 4)
    logits = 100 * enc["image_mu"] @ cmu.T - 50 * cs2.sum(-1)
    assert results["zeroshot/object/top1_csd"] == pytest.approx(100 * np.mean(logits.argmax(1) == enc["label"]))
    w = np.load(out / "bprw_object_fewshot.npy")
    assert w.shape == (36, 4)
    np.testing.assert_allclose(w.sum(1), 1.0, atol=1e-5)
    # the BPRW-only evaluator yields only bprw metrics
    only = dict(zs.BPRWEvaluator(dict(config, bprw="nn", out_dir=""), model).run(params))
    assert set(only) == {f"bprw/object/nn/{k}" for k in (
        "top1_dot_base", "top1_dot", "top1_csd_base", "top1_csd", "weight_max", "weight_entropy",
        "uniform_entropy", "em_iterations")}
    assert only["bprw/object/nn/top1_csd"] == results["bprw/object/nn/top1_csd"]   # seeded
    # few-shot with one support image per class, scored without the support images: the
    # base accuracy is the plain ensemble's on the 36 images that are left
    one_shot = dict(spec="2-1-1-5-0.02-inverse", use_gt=True)
    ex = dict(zs.BPRWEvaluator(dict(config, bprw=[one_shot], out_dir="", bprw_exclude_support=True),
                           model).run(params))
    support = pr.select_images(enc["text_mu"].reshape(36, 4, -1), enc["image_mu"], 1,
                               enc["label"], np.random.default_rng(0))
    keep = np.setdiff1d(np.arange(72), support.ravel())
    assert len(keep) == 36
    base = 100 * np.mean(logits[keep].argmax(1) == enc["label"][keep])
    assert ex["bprw/object/2-1-1-5-0.02-inverse-gt/top1_csd_base"] == pytest.approx(base)


def test_imagefolder(micro, tmp_path):
    model, params = micro
    rng = np.random.default_rng(0)
    classes = ["n002", "n001"]   # index file order differs from the sorted order
    for d in classes:
        os.makedirs(tmp_path / "val" / d)
        for i in range(3):
            Image.fromarray(rng.integers(0, 255, (20 + i, 24, 3), np.uint8)).save(
                tmp_path / "val" / d / f"img{i}.JPEG")
    (tmp_path / "val" / "n001" / "notes.txt").write_text("not an image")
    (tmp_path / "index.json").write_text(json.dumps({"n002": 0, "n001": 1}))
    files, labels = eval_data.imagefolder_files(str(tmp_path), "val", str(tmp_path / "index.json"))
    assert len(files) == 6 and labels.tolist() == [1, 1, 1, 0, 0, 0]   # dirs listed sorted
    assert eval_data.read_class_index(str(tmp_path / "index.json")) == {"n002": 0, "n001": 1}
    keras = tmp_path / "keras.json"
    keras.write_text(json.dumps({"0": ["n002", "two"], "1": ["n001", "one"]}))
    assert eval_data.read_class_index(str(keras)) == {"n002": 0, "n001": 1}
    tok = lambda texts: np.asarray([[3 + len(t) % 50] + [1] * 7 for t in texts], np.int32)
    config = dict(dataset="imagefolder", root=str(tmp_path), split="val",
                  class_index=str(tmp_path / "index.json"), classnames=["two", "one"],
                  templates=["a {}", "the {}"], batch_size=8, name="folder")
    ev = zs.Evaluator(config, model, tokenizer=tok)
    src = list(ev.data.batches(4, 16))   # the input pipeline's eval batches: padded, masked
    assert [b["image"].shape for b in src] == [(4, 16, 16, 3)] * 2 and src[0]["image"].dtype == np.uint8
    assert [b["mask"].sum() for b in src] == [4, 2] and src[1]["index"].tolist() == [4, 5, -1, -1]
    results = dict(ev.run(params))
    assert 0 <= results["zeroshot/folder/top1_dot"] <= 100 and results["zeroshot/folder/top5_csd"] == 100.0
    # 6 images: 6 bins of one image each, so every bin accuracy is 0 or 100 (no empty bins)
    bins = [results[f"zeroshot/folder/unc_bin{i}_top1_dot"] for i in range(6)]
    assert set(bins) <= {0.0, 100.0} and "zeroshot/folder/unc_bin6_top1_dot" not in results
    assert np.mean(bins) == pytest.approx(results["zeroshot/folder/top1_dot"])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        zs.Evaluator(dict(config, root=str(tmp_path / "nope")), model, tokenizer=tok)
    with pytest.raises(ValueError, match="not in the class index"):
        eval_data.imagefolder_files(str(tmp_path), "val", _write(tmp_path / "one.json", {"n002": 0}))


def _write(path, obj):
    path.write_text(json.dumps(obj))
    return str(path)
