"""The modality-gap evaluator: the metrics of hand-made embeddings, then end to end on the demo set
against an independent float64 computation from one jitted encoding of the whole set."""
from __future__ import annotations

import jax
import numpy as np
import pytest

import evaluators
from evaluators import modality_gap as MG


def test_gap_of_two_cones():
    """Images all along e1 and captions all along e2: the centroids are e1 and e2 (gap sqrt 2),
    matched pairs are orthogonal; sigma^2 is tr(Sigma) = 3 x 0.5 per item, averaged over items."""
    v = np.tile([1.0, 0.0, 0.0], (4, 1))
    t = np.tile([0.0, 1.0, 0.0], (8, 1))
    lv = np.log(np.full((4, 3), 0.5))
    got = MG.gap_metrics(v, lv, t, None, np.repeat(np.arange(4), 2))
    assert got["gap"] == pytest.approx(np.sqrt(2.0))
    assert got["matched_cosine"] == pytest.approx(0.0) and got["mismatched_cosine"] == pytest.approx(0.0)
    assert got["image_sigma2_trace_mean"] == pytest.approx(1.5) and "text_sigma2_trace_mean" not in got
    same = MG.gap_metrics(v, None, v[np.repeat(np.arange(4), 2)], None, np.repeat(np.arange(4), 2))
    assert same["gap"] == pytest.approx(0.0) and same["matched_cosine"] == pytest.approx(1.0)


def test_mismatched_pairs_are_other_images():
    v = np.eye(5)
    caps = np.arange(5)
    got = MG.gap_metrics(v, None, v, None, caps, seed=3)
    assert got["matched_cosine"] == pytest.approx(1.0) and got["mismatched_cosine"] == pytest.approx(0.0)


def test_end_to_end_on_the_demo_set(tmp_path):
    from prolip_jax.core.models import ProLIP, abstract_params, get_config

    cfg = get_config("micro")
    model = ProLIP(cfg, attention_impl="xla")
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(a.dtype), abstract_params(cfg))
    demo = dict(cache_dir=str(tmp_path / "demo"), image_size=16, num_train=200, num_zeroshot=36,
                num_retrieval=20, num_levels=10)
    ev = evaluators.build("modality_gap", dict(dataset="demo", demo=demo, batch_size=16), model)
    got = dict(ev.run(params))

    # Independent: the demo's arrays, one jitted call per tower, the formulas in float64 here.
    from input_pipeline.demo import get_demo

    ref = get_demo(**demo).load_split("retrieval", image_size=16, context_length=cfg.text.context_length)
    v, v_lv = (np.asarray(x, np.float64) for x in jax.jit(
        lambda p, x: model.apply({"params": p}, x, method=model.encode_image))(params, ref["image"]))
    t, t_lv = (np.asarray(x, np.float64) for x in jax.jit(
        lambda p, x: model.apply({"params": p}, x, method=model.encode_text))(params, ref["text"]))
    cap_img = ev.retrieval.data().caption_record   # one caption per image in the demo split
    assert len(v) == 20 and list(cap_img) == list(range(20))
    want = {"gap": np.linalg.norm(v.mean(0) - t.mean(0)),
            "matched_cosine": np.mean(np.sum(v * t, axis=1)),
            "image_sigma2_trace_mean": np.exp(v_lv).sum(1).mean(),
            "text_sigma2_trace_mean": np.exp(t_lv).sum(1).mean()}
    assert set(got) == {f"modality_gap/demo/{k}" for k in [*want, "mismatched_cosine"]}
    for key, value in want.items():
        assert got[f"modality_gap/demo/{key}"] == pytest.approx(value, rel=1e-4), key
    assert 0.0 < got["modality_gap/demo/gap"] < 2.0
    assert -1.0 <= got["modality_gap/demo/mismatched_cosine"] <= 1.0


def test_misspelled_field_names_the_nearest():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['sed'\].*did you mean 'seed'"):
        evaluators.build("modality_gap", dict(sed=1), None)
