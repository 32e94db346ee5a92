"""evaluators/retrieval.py, uncertainty-aware parts: recall per query-uncertainty bin
(the reference's eval_ret_unc), image->image and text->text retrieval."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from evaluators import ranks as RK
from evaluators import retrieval as R
from input_pipeline.eval_data import EvalSet


def test_binned_ranking_by_hand():
    # one positive per query at ranks 0, 3, 0, 1; sigma^2 order q0 < q2 < q3 < q1
    ranks = np.array([[0], [3], [0], [1]])
    two = R.binned_ranking(np.array([[0, 1], [2, RK.PAD], [0, 3], [1, RK.PAD]]),
                           np.array([0.1, 0.4, 0.2, 0.3]), bins=2)
    # mAP@R: q0 (1 + 1) / 2, q2 1/2 | q3 0, q1 0 (R = 1, positive at rank 1 / 2)
    assert two["unc_bin0_map_at_r"] == pytest.approx(100 * (1 + 0.5) / 2)
    assert two["unc_bin1_map_at_r"] == 0.0 and two["unc_bin1_R1"] == 0.0
    out = R.binned_ranking(ranks, np.array([0.1, 0.4, 0.2, 0.3]), bins=2)
    assert out["unc_bin0_R1"] == 100.0 and out["unc_bin1_R1"] == 0.0          # {q0, q2} | {q3, q1}
    assert out["unc_bin0_map_at_r"] == 100.0
    assert out["unc_bin1_map_at_r"] == 0.0     # R = 1: a positive below rank 0 scores nothing
    assert out["unc_corr_R1"] == pytest.approx(-1.0)
    assert out["unc_corr_map_at_r"] == pytest.approx(-1.0)
    # three bins over 4 queries: sizes 2, 1, 1; constant values -> correlation 0, not nan
    flat = R.binned_ranking(np.zeros((4, 1), int), np.arange(4.0), bins=3)
    assert [flat[f"unc_bin{i}_R1"] for i in range(3)] == [100.0] * 3 and flat["unc_corr_R1"] == 0.0
    with pytest.raises(ValueError):
        R.binned_ranking(np.zeros((0, 1), int), np.zeros(0))


def test_same_modality_positives_by_hand():
    cap_img = np.array([0, 0, 1, 2, 2, 2])
    pos = R.same_modality_positives(cap_img, ["a dog", "A  dog", "cat", "x", "y", "a dog "])
    assert [p.tolist() for p in pos["t2t"]] == [[1], [0], [], [4, 5], [3, 5], [3, 4]]
    # "a dog" is a caption of images 0 and 2 (after normalisation): they are each other's positive
    assert [p.tolist() for p in pos["i2i"]] == [[2], [], [0]]
    assert [p.tolist() for p in R.same_modality_positives(cap_img)["i2i"]] == [[], [], []]


def test_blocked_ranks_excludes_the_query():
    mu = np.array([[1, 0], [0.8, 0.6], [0, 1]], np.float32)
    # dot scores of q0: [1, .8, 0] -> without itself its positive 2 is at rank 1 (after item 1)
    ranks, _ = R.blocked_ranks(mu[[0]], None, mu, None, np.array([[2]]), "dot", exclude=np.array([0]))
    assert ranks[0, 0] == 1
    ranks, _ = R.blocked_ranks(mu[[0]], None, mu, None, np.array([[2]]), "dot")
    assert ranks[0, 0] == 2


def dense_ranks(q_mu, q_lv, g_mu, g_lv, positives, exclude=None):
    """-CSD ranks computed densely in numpy (stable descending order)."""
    d = ((q_mu[:, None] - g_mu[None]) ** 2).sum(-1) + np.exp(q_lv).sum(-1)[:, None] \
        + np.exp(g_lv).sum(-1)[None]
    s = -d
    if exclude is not None:
        s[np.arange(len(s)), exclude] = -np.inf
    order = np.argsort(-s, 1, kind="stable")
    return np.array([[np.flatnonzero(order[q] == p)[0] if p >= 0 else RK.PAD for p in row]
                     for q, row in enumerate(positives)])


def test_evaluator_uncertainty_outputs_equal_dense(monkeypatch):
    from prolip_jax.core.models import ProLIP, get_config

    rng = np.random.default_rng(0)
    cap_img = np.repeat(np.arange(6), 2)                          # 6 images x 2 captions
    captions = [f"c{i}" for i in range(12)]
    captions[11] = captions[0]                                    # images 0 and 5 share a caption

    def unit(x):
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    i_mu, t_mu = unit(rng.normal(size=(6, 4))), unit(rng.normal(size=(12, 4)))
    i_lv, t_lv = (rng.normal(size=(6, 4)) - 2).astype(np.float32), (rng.normal(size=(12, 4)) - 2).astype(np.float32)
    ev = R.Evaluator(dict(dataset="demo", scores=("csd",), unc_bins=3, block=5), ProLIP(get_config("micro")))
    ev._data = EvalSet("toy", records=None, captions=captions, caption_record=cap_img)
    monkeypatch.setattr(ev, "encode", lambda params, data, progress=None: (i_mu, i_lv, t_mu, t_lv))
    res = dict(ev.run(None))
    p = "retrieval/toy/csd"
    i2t = dense_ranks(i_mu, i_lv, t_mu, t_lv, RK.pad_positives([np.flatnonzero(cap_img == i) for i in range(6)]))
    for k, v in R.binned_ranking(i2t, np.exp(i_lv).sum(-1), 3).items():
        assert res[f"{p}/i2t/{k}"] == pytest.approx(v), k
    t2t = dense_ranks(t_mu, t_lv, t_mu, t_lv, (cap_img * 2 + 1 - np.arange(12) % 2)[:, None],
                      exclude=np.arange(12))
    assert res[f"{p}/t2t_R@1"] == pytest.approx(R.recall_at_k(t2t, 1))
    assert res[f"{p}/t2t_map_at_r"] == pytest.approx(R.map_at_r(t2t))
    assert res[f"{p}/t2t_num_queries"] == 12
    i2i = dense_ranks(i_mu[[0, 5]], i_lv[[0, 5]], i_mu, i_lv, np.array([[5], [0]]), exclude=np.array([0, 5]))
    assert res[f"{p}/i2i_num_queries"] == 2
    assert res[f"{p}/i2i_R@5"] == pytest.approx(R.recall_at_k(i2i, 5))
    # off switches; an unknown direction is an error
    monkeypatch.setattr(ev, "config", dataclasses.replace(ev.config, unc_bins=0, same_modality=()))
    plain = dict(ev.run(None))
    assert not any("unc_" in k or "i2i" in k or "t2t" in k for k in plain)
    with pytest.raises(ValueError, match="same_modality"):
        R.Evaluator(dict(dataset="demo", same_modality=("x2y",)), ProLIP(get_config("micro")))
