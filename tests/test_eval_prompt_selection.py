"""evaluators/prompt_selection.py and the zero-shot evaluator's `prompt_select` (paper Table 3
"filtering by sigma stats" / "top-K prompts"): rules and accuracies by hand."""
from __future__ import annotations

import numpy as np
import pytest

from evaluators import prompt_selection as PS
from evaluators import zeroshot as zs

U = np.array([[1.0, 2.0, 3.0, 10.0], [5.0, 5.0, 5.0, 5.0]])   # prompt sigma^2 sums [C, T]


def test_rules_by_hand():
    T, F = True, False
    np.testing.assert_array_equal(PS.select(U, dict(kind="topk", k=2)), [[T, T, F, F], [T] * 4])
    # class 0: mean 4, ties kept in class 1 (all equal to its threshold)
    np.testing.assert_array_equal(PS.select(U, "sigma_filter:0"), [[T, T, T, F], [T] * 4])
    # std (ddof 1) of class 0 = sqrt(50 / 3) = 4.08 -> threshold < 1: the least uncertain is kept
    np.testing.assert_array_equal(PS.select(U, dict(kind="sigma_filter", coeff=-1)),
                                  [[T, F, F, F], [T] * 4])
    np.testing.assert_array_equal(PS.select(U, dict(kind="sigma_filter", coeff=1.5)),
                                  [[T] * 4, [T] * 4])       # 4 + 1.5 * 4.08 = 10.1 >= 10
    # the 3rd smallest overall is 3: class 1 keeps nothing below it, so its minimum (all ties)
    np.testing.assert_array_equal(PS.select(U, "global_topn:3"), [[T, T, T, F], [T] * 4])
    np.testing.assert_array_equal(PS.select(U, "threshold:2.5"), [[T, T, F, F], [T] * 4])
    assert PS.label("topk:10") == "topk_10" and PS.label(dict(kind="sigma_filter", coeff=-0.5)) == "sigma_filter_m0.5"
    for bad in ("median:1", dict(kind="topk"), dict(kind="topk", k=0), dict(kind="topk", k=1, n=2)):
        with pytest.raises(ValueError):
            PS.parse(bad)


def test_selected_classifier_by_hand():
    mu = np.array([[[1, 0], [0, 1], [0, -1]]], np.float64)
    s2 = np.array([[[1, 1], [3, 3], [5, 7]]], np.float64)
    cmu, cs2 = PS.selected_classifier(mu, s2, np.array([[True, True, False]]))
    np.testing.assert_allclose(cmu, [[2 ** -0.5, 2 ** -0.5]])
    np.testing.assert_allclose(cs2, [[2, 2]])
    # everything kept == the plain ensemble
    cmu, cs2 = PS.selected_classifier(mu, s2, np.ones((1, 3), bool))
    emu, es2 = zs.class_embeddings(mu.reshape(3, 2), np.log(s2.reshape(3, 2)), 1, 3)
    np.testing.assert_allclose(cmu, emu)
    np.testing.assert_allclose(cs2, es2)


def unit(deg):
    a = np.deg2rad(np.asarray(deg, np.float64))
    return np.stack([np.cos(a), np.sin(a)], -1)


def test_zeroshot_prompt_select_fixes_a_hand_made_case(monkeypatch):
    """Class 0: a certain template at 90 deg and an uncertain one at 0 deg (ensemble at 45 deg);
    class 1: two equally certain templates at 53.13 deg. Images at 80 deg (class 0) and 10 deg
    (class 1) are both wrong with the ensemble (cos 35 < cos 26.9; cos 35 > cos 43.1) and both
    right with the least uncertain template of each class (top-1)."""
    text_mu = np.concatenate([unit([90, 0]), unit([53.13, 53.13])])      # class-major [C*T, D]
    text_lv = np.log(np.array([[1e-4] * 2, [1e-2] * 2, [1e-4] * 2, [1e-4] * 2]))
    enc = {"text_mu": text_mu, "text_logvar": text_lv, "image_mu": unit([80, 10]),
           "image_logvar": np.full((2, 2), -9.0), "label": np.array([0, 1])}
    ev = object.__new__(zs.Evaluator)   # no data to read: the encodings are given
    ev.config, ev.name, ev.classnames, ev.templates = {}, "toy", ["a", "b"], ["{}", "x {}"]
    ev.bprw, ev.bprw_only = [], True
    ev.prompt_select = [dict(kind="topk", k=1), "sigma_filter:0"]
    monkeypatch.setattr(ev, "encode", lambda params, progress=None: enc)
    res = dict(ev.run(None))
    for label in ("topk_1", "sigma_filter_0"):   # sigma_filter: class 0 mean -> keeps 90 deg only
        p = f"promptsel/toy/{label}"
        for kind in ("dot", "csd"):
            assert res[f"{p}/top1_{kind}_base"] == 0.0 and res[f"{p}/top1_{kind}"] == 100.0, (p, kind)
        assert res[f"{p}/kept_mean"] == 1.5 and res[f"{p}/kept_min"] == 1.0   # class 1: ties kept
    assert len(res) == 12
