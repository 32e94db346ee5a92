"""PCME++, Pishdad et al., CLIP, SigLIP, VSE∞ objectives and the Gaussian distances.

Every value is checked against a float64 reference written out below with loops and plain
numpy (full-covariance textbook formulas for the distances, per-pair loops for the losses),
from float32 inputs, to 1e-5 relative; gradients by finite differences in float64
(jax.test_util.check_grads); and each objective once with the batch sharded over 8 devices.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P
from jax.test_util import check_grads

from prolip_jax.core import objectives, sharding
from prolip_jax.core.objectives import contrastive, distances, pcmepp, pishdad

RTOL = 1e-5
NAMES = ("pcmepp", "pishdad", "clip", "siglip", "vse")


def _rel(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


def _gauss(rng, n, d, lv=(-2.0, 1.0)):
    mu = rng.normal(size=(n, d))
    mu /= np.linalg.norm(mu, axis=1, keepdims=True)
    return mu.astype(np.float32), rng.uniform(*lv, size=(n, d)).astype(np.float32)


def _out(b=6, d=4, seed=0, lv=(-2.0, 1.0), scale=2.0, bias=1.0):
    rng = np.random.default_rng(seed)
    (im, il), (tm, tl) = _gauss(rng, b, d, lv), _gauss(rng, b, d, lv)
    return {"image_mean": im, "image_logvar": il, "text_mean": tm, "text_logvar": tl,
            "logit_scale": np.float32(scale), "logit_bias": np.float32(bias)}


def _j(out):
    return {k: (None if v is None else jnp.asarray(v)) for k, v in out.items()}


def _f64(out):
    return {k: (None if v is None else np.asarray(v, np.float64)) for k, v in out.items()}


def _multi_positive(b):
    """Binary targets: captions 0 and 1 both describe image 0 and image 1 (identical captions)."""
    t = np.eye(b, dtype=np.float32)
    t[0, 1] = t[1, 0] = 1.0
    return t


def _msda(b):
    """MSDA soft targets (PCME++ §2.4): image i mixed with image b-1-i with weight lam_i."""
    t = np.eye(b, dtype=np.float32)
    for i, lam in ((0, 0.7), (2, 0.4)):
        t[i, i], t[i, b - 1 - i] = lam, 1.0 - lam
    return t


# ------------------------------------------------------------------- float64 references
def _diag(v):
    return np.diag(np.exp(v))


def _sqrtm_psd(a):
    w, v = np.linalg.eigh(a)
    return (v * np.sqrt(np.maximum(w, 0))) @ v.T


def _ref_pair(name, m1, l1, m2, l2):
    """One pair's distance from the full-covariance formulas (Sigma = diag(exp(logvar)))."""
    d = len(m1)
    if name == "kl_reverse":
        return _ref_pair("kl", m2, l2, m1, l1)
    if name == "min_kl":
        return min(_ref_pair("kl", m1, l1, m2, l2), _ref_pair("kl", m2, l2, m1, l1))
    s1 = np.zeros((d, d)) if l1 is None else _diag(l1)
    s2 = np.zeros((d, d)) if l2 is None else _diag(l2)
    dm = m1 - m2
    if name == "csd":  # E ||Z1 - Z2||^2 = ||dm||^2 + tr(S1 + S2)
        return dm @ dm + np.trace(s1 + s2)
    if name == "wasserstein":  # ||dm||^2 + tr(S1 + S2 - 2 (S1^1/2 S2 S1^1/2)^1/2)
        r1 = _sqrtm_psd(s1)
        return dm @ dm + np.trace(s1 + s2 - 2 * _sqrtm_psd(r1 @ s2 @ r1))
    if name == "kl":  # KL(N1 || N2), Pishdad et al. eq. 4
        inv2 = np.linalg.inv(s2)
        return 0.5 * (np.trace(inv2 @ s1) + dm @ inv2 @ dm - d
                      + np.linalg.slogdet(s2)[1] - np.linalg.slogdet(s1)[1])
    if name == "elk":  # -log int N(x; m1, S1) N(x; m2, S2) dx = -log N(m1; m2, S1 + S2)
        s = s1 + s2
        return 0.5 * (dm @ np.linalg.solve(s, dm) + np.linalg.slogdet(2 * np.pi * s)[1])
    if name == "bhattacharyya":
        s = (s1 + s2) / 2
        return dm @ np.linalg.solve(s, dm) / 8 + 0.5 * (
            np.linalg.slogdet(s)[1] - 0.5 * (np.linalg.slogdet(s1)[1] + np.linalg.slogdet(s2)[1]))
    raise KeyError(name)


def _ref_dist(name, m1, l1, m2, l2):
    return np.array([[_ref_pair(name, m1[i], None if l1 is None else l1[i], m2[j], None if l2 is None else l2[j])
                      for j in range(len(m2))] for i in range(len(m1))])


def _nls(x):
    """-log sigmoid(x)."""
    return np.logaddexp(0.0, -x)


def _ref_bce_mean(logits, m):
    n, k = logits.shape
    return sum(m[i, j] * _nls(logits[i, j]) + (1 - m[i, j]) * _nls(-logits[i, j])
               for i in range(n) for j in range(k)) / (n * k)


def _ref_pp(logits, m):
    new = m.copy()
    for i in range(len(m)):
        g = int(np.argmax(m[i]))
        for j in range(m.shape[1]):
            if logits[i, j] >= logits[i, g]:
                new[i, j] = m[i].max()
    return new


def _ref_kl_prior(mu, lv):
    return -0.5 * np.mean(1 + lv - mu ** 2 - np.exp(lv))


def _ref_info_nce(im, tm, scale, t):
    logits = scale * im @ tm.T
    total = 0.0
    for lg, tt in ((logits, t), (logits.T, t.T)):
        rows = 0.0
        for i in range(len(lg)):
            logp = lg[i] - np.log(np.sum(np.exp(lg[i])))
            pos = np.flatnonzero(tt[i])
            rows += -np.sum(tt[i, pos] * logp[pos]) / np.sum(tt[i, pos])
        total += rows / len(lg)
    return total / 2


def _ref_pcmepp(o, cfg, targets=None):
    im, il, tm, tl = o["image_mean"], o["image_logvar"], o["text_mean"], o["text_logvar"]
    logits = -o["logit_scale"] * _ref_dist(cfg.distance, im, il, tm, tl) + o["logit_bias"]
    t = np.eye(len(im)) if targets is None else np.asarray(targets, np.float64)
    s = cfg.label_smoothing
    m = t * (1 - s) + (1 - t) * s  # 1 -> 1 - s, 0 -> s
    total = 2 * _ref_bce_mean(logits, m)
    if cfg.pp_alpha:
        total += cfg.pp_alpha * (_ref_bce_mean(logits, _ref_pp(logits, m))
                                 + _ref_bce_mean(logits.T, _ref_pp(logits.T, m.T)))
    if cfg.vib_beta:
        for mu, lv in ((im, il), (tm, tl)):
            if lv is not None:
                kl = _ref_kl_prior(mu, lv)
                total += cfg.vib_beta * (0.0 if kl > cfg.vib_threshold else kl)
    if cfg.infonce_weight:
        total += cfg.infonce_weight * _ref_info_nce(im, tm, o.get("infonce_scale", o["logit_scale"]), t)
    return total


def _ref_hinge(sim, pos, margin, hardest=True):
    total = 0.0
    for i, j in zip(*np.nonzero(pos)):
        c_txt = [margin + sim[i, k] - sim[i, j] for k in range(sim.shape[1]) if not pos[i, k]]
        c_img = [margin + sim[k, j] - sim[i, j] for k in range(sim.shape[0]) if not pos[k, j]]
        for c in (c_txt, c_img):
            c = [max(x, 0.0) for x in c]
            total += (max(c) if c else 0.0) if hardest else sum(c)
    return total


def _ref_shape(lv, cfg):
    lo, hi = math.log(cfg.variance_min), math.log(cfg.variance_max)
    if cfg.covariance == "spherical_one":
        lv = np.repeat(lv.mean(1, keepdims=True), lv.shape[1], 1)
    if cfg.variance_bound == "clip":
        var = np.clip(np.exp(lv), cfg.variance_min, cfg.variance_max)
    else:
        mid, half = (hi + lo) / 2, (hi - lo) / 2
        var = np.exp(mid + half * np.tanh((lv - mid) / half))
    if cfg.covariance == "spherical_avgpool":
        var = np.repeat(var.mean(1, keepdims=True), var.shape[1], 1)
    return np.log(var)


def _ref_pishdad(o, cfg, targets=None):
    im, tm = o["image_mean"], o["text_mean"]
    il, tl = _ref_shape(o["image_logvar"], cfg), _ref_shape(o["text_logvar"], cfg)
    if cfg.similarity == "wasserstein":
        sim = -np.sqrt(_ref_dist("wasserstein", im, il, tm, tl))
    else:
        sim = -_ref_dist(cfg.similarity, im, il, tm, tl)
    pos = np.eye(len(im), dtype=bool) if targets is None else np.asarray(targets) > 0
    return _ref_hinge(sim, pos, cfg.margin)


def _ref_siglip(o, targets=None):
    logits = o["logit_scale"] * o["image_mean"] @ o["text_mean"].T + o["logit_bias"]
    t = np.eye(len(logits)) if targets is None else np.asarray(targets, np.float64)
    return sum(t[i, j] * _nls(logits[i, j]) + (1 - t[i, j]) * _nls(-logits[i, j])
               for i in range(len(t)) for j in range(len(t))) / len(t)


# ------------------------------------------------------------------------------ distances
@pytest.mark.parametrize("name", sorted(distances.DISTANCES))
def test_distance_matches_full_covariance_formula(name):
    rng = np.random.default_rng(1)
    (m1, l1), (m2, l2) = _gauss(rng, 5, 4, (-3.0, 2.0)), _gauss(rng, 6, 4, (-3.0, 2.0))
    got = distances.pairwise(name, *map(jnp.asarray, (m1, l1, m2, l2)))
    assert got.shape == (5, 6)
    assert _rel(got, _ref_dist(name, *(x.astype(np.float64) for x in (m1, l1, m2, l2)))) < RTOL


@pytest.mark.parametrize("name", ["csd", "kl", "kl_reverse", "min_kl", "wasserstein"])
def test_matmul_distances_never_materialise_pairs_by_dims(name):
    n, m, d = 3, 5, 7
    args = (jnp.ones((n, d)), jnp.ones((n, d)), jnp.ones((m, d)), jnp.ones((m, d)))
    jaxpr = jax.make_jaxpr(distances.DISTANCES[name])(*args).jaxpr
    shapes = {getattr(v.aval, "shape", ()) for eqn in jaxpr.eqns for v in eqn.outvars}
    assert (n, m, d) not in shapes and (m, n, d) not in shapes


def test_distance_point_masses():
    rng = np.random.default_rng(2)
    (m1, _), (m2, _) = _gauss(rng, 3, 4), _gauss(rng, 4, 4)
    sq = ((m1[:, None] - m2[None]) ** 2).sum(-1)
    for name in ("csd", "wasserstein"):
        assert _rel(distances.pairwise(name, jnp.asarray(m1), None, jnp.asarray(m2), None), sq) < RTOL
    with pytest.raises(ValueError, match="kl"):
        distances.pairwise("kl", jnp.asarray(m1), None, jnp.asarray(m2), None)


# -------------------------------------------------------------------------------- PCME++
PCMEPP_CASES = {
    "default": ({}, None),
    "kl": ({"distance": "kl"}, None),
    "wasserstein": ({"distance": "wasserstein"}, None),
    "elk": ({"distance": "elk"}, None),
    "bhattacharyya": ({"distance": "bhattacharyya"}, None),
    "msda_soft": ({}, "msda"),
    "multi_positive": ({"distance": "kl"}, "multi"),
    "no_pp_no_smoothing": ({"pp_alpha": 0.0, "label_smoothing": 0.0}, "msda"),
    "strong_pp": ({"pp_alpha": 2.0, "label_smoothing": 0.05, "vib_beta": 0.1}, "multi"),
    "infonce": ({"infonce_weight": 0.5, "pp_alpha": 0.0, "vib_beta": 1e-6}, None),
}


@pytest.mark.parametrize("case", sorted(PCMEPP_CASES))
def test_pcmepp_matches_reference(case):
    knobs, kind = PCMEPP_CASES[case]
    cfg = pcmepp.Config(**knobs)
    cfg.validate()
    o = _out(bias=4.0, scale=1.5)
    targets = {"msda": _msda(6), "multi": _multi_positive(6), None: None}[kind]
    total, terms = pcmepp.loss(_j(o), cfg, targets=None if targets is None else jnp.asarray(targets))
    assert abs(float(total) - float(sum(terms.values()))) <= 1e-6 * abs(float(total))
    assert _rel(total, _ref_pcmepp(_f64(o), cfg, targets)) < RTOL


def test_pcmepp_pseudo_positives_are_row_wise_and_take_the_gt_label():
    logits = jnp.array([[0.0, 1.0, -1.0], [3.0, 2.0, 2.5], [0.0, 0.0, 0.0]])
    m = jnp.array([[0.7, 0.0, 0.3], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    # row 0: GT col 0 (label 0.7), col 1 is closer; row 1: GT col 1, cols 0, 2 closer; row 2: ties count.
    want = [[0.7, 0.7, 0.3], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    np.testing.assert_array_equal(pcmepp.pseudo_positive_targets(logits, m), np.float32(want))


def test_pcmepp_mu_only_and_separate_infonce_temperature():
    o = _out()
    o["image_logvar"] = o["text_logvar"] = None
    cfg = pcmepp.Config(pp_alpha=0.0, vib_beta=0.0, label_smoothing=0.0)
    total, terms = pcmepp.loss(_j(o), cfg)
    assert set(terms) == {"match"} and _rel(total, _ref_pcmepp(_f64(o), cfg)) < RTOL
    with pytest.raises(ValueError, match="distance"):
        pcmepp.loss(_j(o), pcmepp.Config(distance="elk"))
    o = _out()
    o["infonce_scale"] = np.float32(7.0)
    cfg = pcmepp.Config(infonce_weight=1.0)
    assert _rel(pcmepp.loss(_j(o), cfg)[0], _ref_pcmepp(_f64(o), cfg)) < RTOL


def test_pcmepp_vib_explosion_guard():
    o = _out()
    o["text_logvar"] = np.full_like(o["text_logvar"], 11.0)  # KL ~ e^11 / 2 > 1e4: dropped
    cfg = pcmepp.Config()
    terms = pcmepp.loss(_j(o), cfg)[1]
    assert float(terms["vib"]) == pytest.approx(1e-4 * _ref_kl_prior(_f64(o)["image_mean"], _f64(o)["image_logvar"]),
                                                rel=RTOL)
    assert _rel(pcmepp.loss(_j(o), cfg)[0], _ref_pcmepp(_f64(o), cfg)) < RTOL


# ------------------------------------------------------------------------------ Pishdad
PISHDAD_CASES = [(s, c, "clip") for s in ("kl", "kl_reverse", "min_kl", "wasserstein")
                 for c in ("ellipsoidal", "spherical_avgpool", "spherical_one")]
PISHDAD_CASES += [("wasserstein", "ellipsoidal", "tanh"), ("min_kl", "spherical_avgpool", "tanh")]


@pytest.mark.parametrize("sim,cov,bound", PISHDAD_CASES)
def test_pishdad_matches_reference(sim, cov, bound):
    cfg = pishdad.Config(similarity=sim, covariance=cov, variance_bound=bound, margin=0.3)
    o = _out(lv=(-4.0, 4.0), d=5)  # beyond [log 0.1, log 10]: the bound acts
    for targets in (None, _multi_positive(6)):
        got = pishdad.loss(_j(o), cfg, targets=None if targets is None else jnp.asarray(targets))[0]
        assert _rel(got, _ref_pishdad(_f64(o), cfg, targets)) < RTOL


# ----------------------------------------------------------------- CLIP / SigLIP / VSE∞
@pytest.mark.parametrize("kind", [None, "multi"])
def test_clip_and_vse_match_reference(kind):
    o, targets = _out(), (_multi_positive(6) if kind else None)
    t = None if targets is None else jnp.asarray(targets)
    f = _f64(o)
    assert _rel(contrastive.clip.loss(_j(o), contrastive.clip.Config(), targets=t)[0],
                _ref_info_nce(f["image_mean"], f["text_mean"], f["logit_scale"],
                              np.eye(6) if targets is None else targets)) < RTOL
    pos = np.eye(6, dtype=bool) if targets is None else targets > 0
    for hardest in (True, False):
        cfg = contrastive.vse.Config(margin=0.5, max_violation=hardest)
        assert _rel(contrastive.vse.loss(_j(o), cfg, targets=t)[0],
                    _ref_hinge(f["image_mean"] @ f["text_mean"].T, pos, 0.5, hardest)) < RTOL


@pytest.mark.parametrize("name", ["vse", "pishdad"])
def test_triplet_sum_warmup_then_hardest(name):
    """VSE∞'s warm-up: sum over negatives while step < sum_warmup_steps, the hardest after (jitted,
    the step traced as the train step passes it)."""
    o, obj = _out(), objectives.get(name)
    cfg = obj.Config(sum_warmup_steps=5)
    loss = jax.jit(lambda step: obj.loss(_j(o), cfg, step=step)[0])
    for step, hardest in ((0, False), (4, False), (5, True), (100, True)):
        want = obj.loss(_j(o), obj.Config(max_violation=hardest))[0]
        assert _rel(loss(jnp.int32(step)), want) < RTOL, (step, hardest)
    assert _rel(loss(jnp.int32(0)), obj.loss(_j(o), cfg)[0]) > 1e-3  # no step given: the hardest


@pytest.mark.parametrize("kind", [None, "multi", "msda"])
def test_siglip_matches_reference(kind):
    o = _out()
    targets = {"msda": _msda(6), "multi": _multi_positive(6), None: None}[kind]
    got = contrastive.siglip.loss(_j(o), contrastive.siglip.Config(),
                                  targets=None if targets is None else jnp.asarray(targets))[0]
    assert _rel(got, _ref_siglip(_f64(o), targets)) < RTOL


# ---------------------------------------------------------------------------- gradients
# Through the objectives, every distance's gradient is checked too (min_kl / kl_reverse via Pishdad).
GRAD_CASES = {
    "pcmepp_csd": ("pcmepp", {"vib_beta": 0.1, "pp_alpha": 0.5}, "msda"),
    "pcmepp_kl": ("pcmepp", {"distance": "kl", "infonce_weight": 0.3}, "multi"),
    "pcmepp_wasserstein": ("pcmepp", {"distance": "wasserstein"}, None),
    "pcmepp_elk": ("pcmepp", {"distance": "elk"}, None),
    "pcmepp_bhattacharyya": ("pcmepp", {"distance": "bhattacharyya"}, None),
    "pishdad_w2": ("pishdad", {}, "multi"),
    "pishdad_kl_avgpool": ("pishdad", {"similarity": "kl", "covariance": "spherical_avgpool"}, None),
    "pishdad_minkl_one_tanh": ("pishdad", {"similarity": "min_kl", "covariance": "spherical_one",
                                           "variance_bound": "tanh"}, None),
    "pishdad_kl_reverse": ("pishdad", {"similarity": "kl_reverse"}, None),
    "clip": ("clip", {}, "multi"),
    "siglip": ("siglip", {}, "msda"),
    "vse": ("vse", {}, "multi"),
    "vse0": ("vse", {"max_violation": False}, "multi"),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_gradients_float64(case):
    name, knobs, kind = GRAD_CASES[case]
    obj = objectives.get(name)
    cfg = obj.Config(**knobs)
    o = _out(b=5, d=3, seed=4, lv=(-1.5, 1.5), bias=2.0)  # logvar inside Pishdad's bounds: no clip kink
    targets = {"msda": _msda(5), "multi": _multi_positive(5), None: None}[kind]
    with jax.enable_x64(True):
        t = None if targets is None else jnp.asarray(targets, jnp.float64)

        def f(im, il, tm, tl, a, b):
            out = {"image_mean": im, "image_logvar": il, "text_mean": tm, "text_logvar": tl,
                   "logit_scale": a, "logit_bias": b}
            return obj.loss(out, cfg, targets=t)[0]

        args = tuple(jnp.asarray(o[k], jnp.float64) for k in
                     ("image_mean", "image_logvar", "text_mean", "text_logvar", "logit_scale", "logit_bias"))
        check_grads(f, args, 1, modes=("rev",))


# ----------------------------------------------------------------------------- sharding
SHARDED_KNOBS = {"pcmepp": {"distance": "kl", "infonce_weight": 0.2}, "pishdad": {"covariance": "spherical_avgpool"},
                 "clip": {}, "siglip": {}, "vse": {}}


@pytest.mark.parametrize("name", NAMES)
def test_sharded_equals_unsharded(name):
    assert len(jax.devices()) >= 8
    obj = objectives.get(name)
    cfg = obj.Config(**SHARDED_KNOBS[name])
    o = _j(_out(b=16, d=8, seed=5, bias=4.0))
    targets = np.eye(16, dtype=np.float32)
    targets[3, 12] = targets[12, 3] = 1.0
    mesh = sharding.make_mesh((8,), ("data",))
    rows = NamedSharding(mesh, P("data"))
    put = lambda x: jax.device_put(x, rows if x.ndim else NamedSharding(mesh, P()))  # noqa: E731
    o_sh, t_sh = jax.tree.map(put, o), put(jnp.asarray(targets))
    assert len(o_sh["image_mean"].sharding.device_set) == 8
    sharded = jax.jit(lambda out, t: obj.loss(out, cfg, targets=t, mesh=mesh))(o_sh, t_sh)
    single = obj.loss(o, cfg, targets=jnp.asarray(targets))
    assert _rel(sharded[0], single[0]) < RTOL
    assert set(sharded[1]) == set(single[1])


# ------------------------------------------------------------------- contract and knobs
@pytest.mark.parametrize("name", NAMES)
def test_registered_with_the_contract(name):
    obj = objectives.get(name)
    assert dataclasses.is_dataclass(obj.Config) and obj.Config.__dataclass_params__.frozen
    for flag in ("NEEDS_LOGVAR", "USES_MASKED", "SOFT_TARGETS"):
        assert isinstance(getattr(obj, flag), bool)
    assert obj.USES_MASKED is False
    total, terms = obj.loss(_j(_out()), obj.Config())
    assert total.shape == () and abs(float(total) - float(sum(terms.values()))) <= 1e-6 * abs(float(total))


@pytest.mark.parametrize("name,knobs,field", [
    ("pcmepp", {"label_smoothing": 0.5}, "label_smoothing"),
    ("pcmepp", {"pp_alpha": -0.1}, "pp_alpha"),
    ("pishdad", {"variance_min": 20.0}, "variance_min"),
    ("vse", {"margin": -0.2}, "margin"),
    ("vse", {"sum_warmup_steps": -1}, "sum_warmup_steps"),
])
def test_validate_rejects_bad_knobs(name, knobs, field):
    with pytest.raises(ValueError, match=field):
        objectives.get(name).Config(**knobs).validate()
