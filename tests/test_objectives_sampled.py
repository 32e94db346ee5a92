"""PCME, PCME + DAA, VSE + DAA and PCME + Smooth-AP (the sampled / rank-based objectives).

Values are checked against float64 references written out below with loops and plain numpy
(per-pair loops for PCME, per-query loops for the soft ranks, and line-by-line numpy
transliterations of DAA's criterions/DAA.py `coco_DAA` and `Smooth_AP` for the code variants),
from float32 inputs, to 1e-5 relative. PCME's samples are reproduced from the same key; the
sampling itself is checked statistically. Gradients by finite differences in float64
(jax.test_util.check_grads). Each whole objective is compiled once, with the batch sharded over
8 devices, and checked against the same references as its unsharded parts (compilations are
what cost time here: a handful keeps the file at ~20 s of CPU).
"""
from __future__ import annotations

import functools
import math
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from prolip_jax.core import objectives, sharding
from prolip_jax.runtime import schema
from prolip_jax.core.objectives import daa, pcme, smooth_ap

RTOL = 1e-5
NAMES = ("pcme", "pcme_daa", "vse_daa", "smooth_ap")
IGNORE = (0, 1)


def _rel(actual, expected) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


def _out(b=6, d=4, length=7, seed=0, scale=3.0, bias=2.0, vocab=9):
    rng = np.random.default_rng(seed)

    def gauss():
        mu = rng.normal(size=(b, d))
        mu /= np.linalg.norm(mu, axis=1, keepdims=True)
        return mu.astype(np.float32), rng.uniform(-3.0, -0.5, size=(b, d)).astype(np.float32)

    (im, il), (tm, tl) = gauss(), gauss()
    text = rng.integers(2, vocab, size=(b, length)).astype(np.int32)
    text[:, -2:] = 1  # pad = EOS = 1 tail, as the SigLIP tokenizer
    return {"image_mean": im, "image_logvar": il, "text_mean": tm, "text_logvar": tl,
            "logit_scale": np.float32(scale), "logit_bias": np.float32(bias), "text": text}


@functools.cache
def _jitted(obj, cfg):
    return jax.jit(lambda out, t, key: obj.loss(out, cfg, targets=t, rng=key))


def _run(obj, out, cfg, targets=None, rng=None):
    """obj.loss under jit, compiled once per (objective, config) (not once per eager op)."""
    return _jitted(obj, cfg)({k: jnp.asarray(v) for k, v in out.items()},
                             None if targets is None else jnp.asarray(targets), rng)


def _multi_positive(b):
    t = np.eye(b, dtype=np.float32)
    t[0, 1] = t[1, 0] = 1.0
    return t


def _phi(x, tau):
    return 1.0 / (1.0 + np.exp(np.clip(-x / tau, -50.0, 50.0)))


def _samples_np(out, key, j):
    """The eps draws PCME documents (key split in two: images, captions), in float64."""
    k_img, k_txt = jax.random.split(key)
    b, d = out["image_mean"].shape
    eps_v = np.asarray(jax.random.normal(k_img, (b, j, d), jnp.float32), np.float64)
    eps_t = np.asarray(jax.random.normal(k_txt, (b, j, d), jnp.float32), np.float64)
    f = lambda k: np.asarray(out[k], np.float64)
    zv = f("image_mean")[:, None] + eps_v * np.exp(f("image_logvar") / 2)[:, None]
    zt = f("text_mean")[:, None] + eps_t * np.exp(f("text_logvar") / 2)[:, None]
    return zv, zt


# ------------------------------------------------------------------------------ references
def ref_pcme_nll(zv, zt, a, b, t):
    """(i2t, t2i): per-pair loops over the J x J samples, sigma(x) = e^x / (e^x + e^-x)."""
    def direction(z1, z2, tt):
        total = 0.0
        for i in range(len(z1)):
            for j in range(len(z2)):
                probs = []
                for k in range(z1.shape[1]):
                    for m in range(z2.shape[1]):
                        s = -a * math.sqrt(np.sum((z1[i, k] - z2[j, m]) ** 2) + 1e-6) + b
                        probs.append(math.exp(s) / (math.exp(s) + math.exp(-s)))
                p = np.mean(probs)
                total += -(tt[i, j] * math.log(p) + (1 - tt[i, j]) * math.log(1 - p))
        return total
    return direction(zv, zt, t), direction(zt, zv, t.T)


def ref_vib_code(z, logvar):
    """probemb.py kl_divergence(samples.mean(1), logsigma), logsigma = log sigma = logvar / 2."""
    ls = logvar / 2
    return -0.5 * np.sum(1 + ls - z.mean(1) ** 2 - np.exp(ls))


def ref_uniformity(x):
    vals = [math.exp(-2 * np.sum((x[i] - x[j]) ** 2)) for i in range(len(x)) for j in range(i + 1, len(x))]
    return math.log(np.mean(vals))


def ref_tfidf(text, ignore=IGNORE):
    """sklearn's CountVectorizer + TfidfTransformer(smooth_idf=True, norm='l2') on id bags."""
    bags = [Counter(int(t) for t in row if int(t) not in ignore) for row in text]
    n = len(bags)
    vocab = sorted(set().union(*bags))
    idf = {t: math.log((1 + n) / (1 + sum(t in bag for bag in bags))) + 1 for t in vocab}
    x = np.array([[bag[t] * idf[t] for t in vocab] for bag in bags], np.float64).reshape(n, len(vocab))
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    x = x / np.where(norm > 0, norm, 1)
    return x @ x.T


def ref_soft_rank_loss(s, c, tau):
    """1 - mean_q ASP~_q with each query's own ranking, per-query loops (s, c [Q, N])."""
    total = 0.0
    for q in range(s.shape[0]):
        for i in range(s.shape[1]):
            others = np.arange(s.shape[1]) != i
            rs = 1 + np.sum(_phi(s[q, others] - s[q, i], tau))
            rc = 1 + np.sum(_phi(c[q, others] - c[q, i], tau))
            total += min(rs, rc) / max(rs, rc)
    return 1 - total / s.size


def ref_coco_daa(input1, cider_map, tau=0.01):
    """DAA.py coco_DAA, line by line (input2 is overwritten by input1 there)."""
    k = input1.shape[1]
    x = input1.reshape(-1, input1.shape[-1])
    n = len(x)
    cm = np.tile(cider_map[:, :, None], (1, 1, k)).reshape(-1, n)
    cm = np.tile(cm[:, None, :], (1, k, 1)).reshape(n, -1)
    score = x @ x.T
    score_diff = score[:, :, None] - score[None, :, :]
    cider_diff = cm[:, :, None] - cm[None, :, :]
    diag_mask = (1 - np.eye(n))[:, None, :]
    cider_rank_all = (diag_mask * _phi(cider_diff, tau)).sum(0) + 1
    score_rank_all = (diag_mask * _phi(score_diff, tau)).sum(0) + 1
    asp = (np.minimum(cider_rank_all, score_rank_all) / np.maximum(cider_rank_all, score_rank_all)).sum() / n ** 2
    return 1 - asp


def ref_smooth_ap_query(s, pos, tau):
    """Brown et al.'s Smooth-AP per query (s [Q, N], pos bool [Q, N]), loops."""
    aps = []
    for q in range(s.shape[0]):
        ratios = []
        for c in np.flatnonzero(pos[q]):
            others = np.arange(s.shape[1]) != c
            r_all = 1 + np.sum(_phi(s[q, others] - s[q, c], tau))
            r_pos = 1 + np.sum(_phi(s[q, others & pos[q]] - s[q, c], tau))
            ratios.append(r_pos / r_all)
        aps.append(np.mean(ratios))
    return 1 - np.mean(aps)


def ref_code_smooth_ap(input1, input2, tau=0.01):
    """DAA.py Smooth_AP, line by line."""
    k = input1.shape[1]
    x1, x2 = input1.reshape(-1, input1.shape[-1]), input2.reshape(-1, input2.shape[-1]).T
    n = len(x1)
    matched = np.eye(n)
    for i in range(0, n, k):
        matched[i:i + k, i:i + k] = 1
    score = x1 @ x2
    score_diff = score[:, :, None] - score[None, :, :]
    diag_mask = (1 - np.eye(n))[:, None, :]
    pos_mask_label = np.broadcast_to(matched, (n, n, n))
    pos_mask_loc = matched[:, :, None]
    score_rank = diag_mask * _phi(score_diff, tau)
    score_rank_all = score_rank.sum(0) + 1
    score_rank_pos = ((score_rank * pos_mask_label * pos_mask_loc).sum(0) + 1) * matched
    return 1 - (score_rank_pos / score_rank_all).sum() / (k * n)

def ref_vse(s, pos, margin=0.2):
    """VSE++ hardest-negative triplet summed over the positive pairs, loops."""
    total = 0.0
    for i, j in zip(*np.nonzero(pos)):
        hard_txt = max(s[i, k] for k in range(s.shape[1]) if not pos[i, k])
        hard_img = max(s[k, j] for k in range(s.shape[0]) if not pos[k, j])
        total += max(0.0, margin + hard_txt - s[i, j]) + max(0.0, margin + hard_img - s[i, j])
    return total


# The full objectives are checked once each, on the configuration below, against these terms.
CFG = {"pcme": {"num_samples": 2, "vib_beta": 0.1, "uniform_lambda": 0.5},
       "pcme_daa": {"num_samples": 2, "vib_beta": 0.1, "uniform_lambda": 0.5},
       "smooth_ap": {"num_samples": 2, "vib_beta": 0.1},
       "vse_daa": {}}


def ref_terms(name, out, t, key, cfg):
    """Expected weighted terms of objective `name` (float64) on the samples drawn from `key`."""
    f = lambda k: np.asarray(out[k], np.float64)
    t = t.astype(np.float64)
    rep = lambda m, j: np.repeat(np.repeat(m, j, 0), j, 1)
    if name == "vse_daa":
        s = f("image_mean") @ f("text_mean").T
        c = (t @ ref_tfidf(out["text"])) / t.sum(1, keepdims=True)
        return {"vse": ref_vse(s, t > 0), "daa_i2t": 50 * ref_soft_rank_loss(s, c, 0.001),
                "daa_t2i": 50 * ref_soft_rank_loss(s.T, c.T, 0.001)}
    j = cfg.num_samples
    zv, zt = _samples_np(out, key, j)
    i2t, t2i = ref_pcme_nll(zv, zt, float(out["logit_scale"]), float(out["logit_bias"]), t)
    terms = {"i2t": i2t, "t2i": t2i,
             "vib": cfg.vib_beta * (ref_vib_code(zv, f("image_logvar")) + ref_vib_code(zt, f("text_logvar")))}
    if cfg.uniform_lambda:
        d = zv.shape[-1]
        terms["uniform"] = cfg.uniform_lambda * ref_uniformity(np.concatenate([zv.reshape(-1, d), zt.reshape(-1, d)]))
    s = zv.reshape(len(zv) * j, -1) @ zt.reshape(len(zt) * j, -1).T
    if name == "pcme_daa":
        c = (t @ ref_tfidf(out["text"])) / t.sum(1, keepdims=True)
        terms["daa_i2t"] = 1000 * ref_soft_rank_loss(s, rep(c, j), 0.01)
        terms["daa_t2i"] = 1000 * ref_soft_rank_loss(s.T, rep(c.T, j), 0.01)
    if name == "smooth_ap":
        pos = rep(t, j) > 0.5
        terms["ap_i2t"] = 1000 * ref_smooth_ap_query(s, pos, 0.01)
        terms["ap_t2i"] = 1000 * ref_smooth_ap_query(s.T, pos.T, 0.01)
    return terms


# ----------------------------------------------------------------------------- full objectives
@pytest.mark.parametrize("name", NAMES)
def test_objective_matches_reference_sharded_and_not(name, monkeypatch):
    """Each objective once under jit with the batch sharded over 8 devices (the DAA / AP rank
    sums forced through their chunked scan) against the float64 reference on the same samples;
    PCME also unsharded. Every unsharded term is checked against the same references below."""
    monkeypatch.setattr(daa, "CHUNK_ELEMENTS", 16 * 16 * 4)  # 4 chunks of 4 items
    obj = objectives.get(name)
    cfg = schema.parse(obj.Config, CFG[name], "config.loss")
    out, t, key = _out(b=8, d=4, seed=19), _multi_positive(8), jax.random.key(20)
    mesh = sharding.make_mesh((8,), ("data",))
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data") if x.ndim else P()))
    f = jax.jit(lambda out, t, key: obj.loss(out, cfg, targets=t, rng=key, mesh=mesh))
    total, terms = f(jax.tree.map(put, {k: jnp.asarray(v) for k, v in out.items()}), put(jnp.asarray(t)), key)
    expected = ref_terms(name, out, t, key, cfg)
    assert set(terms) == set(expected)
    for term, value in expected.items():
        assert _rel(terms[term], value) < RTOL, term
    assert _rel(total, sum(expected.values())) < RTOL
    if name == "pcme":
        single_total, _ = _run(pcme, out, cfg, t, key)
        assert _rel(single_total, total) < RTOL


# ------------------------------------------------------------------------------------- PCME
def test_pcme_from_samples_matches_loops():
    rng = np.random.default_rng(1)
    zv, zt = (rng.normal(size=(5, 3, 4)).astype(np.float32) * 0.5 for _ in range(2))
    f = jax.jit(pcme.pcme_from_samples)
    for t in (np.eye(5, dtype=np.float32), _multi_positive(5), np.diag(np.float32([0.7, 1, 1, 0.4, 1]))):
        got = f(jnp.asarray(zv), jnp.asarray(zt), jnp.float32(3.0), jnp.float32(2.0), jnp.asarray(t))
        i2t, t2i = ref_pcme_nll(zv.astype(np.float64), zt.astype(np.float64), 3.0, 2.0, t.astype(np.float64))
        assert _rel(got["i2t"], i2t) < RTOL and _rel(got["t2i"], t2i) < RTOL
        assert abs(i2t - t2i) < 1e-9 * abs(i2t)  # the code's two directions score the same pairs


def test_pcme_vib_forms():
    out = _out(b=3, d=4)
    z = np.random.default_rng(2).normal(size=(3, 2, 4)).astype(np.float32)
    mu, lv = (np.asarray(out[k], np.float64) for k in ("image_mean", "image_logvar"))
    code, kl = (pcme.vib(jnp.asarray(out["image_mean"]), jnp.asarray(out["image_logvar"]), jnp.asarray(z), form)
                for form in ("code", "kl"))
    assert _rel(code, ref_vib_code(z.astype(np.float64), lv)) < RTOL
    assert _rel(kl, -0.5 * np.sum(1 + lv - mu ** 2 - np.exp(lv))) < RTOL  # KL(N(mu, sigma^2) || N(0, I))


def test_pcme_sampling_statistics_and_rng():
    mu = jnp.asarray([[0.5, -1.0, 2.0]])
    logvar = jnp.asarray([[-2.0, 0.0, 1.0]])
    eps, _ = pcme.draw_eps(jax.random.key(0), 1, 1, 20000, 3)
    z = np.asarray(pcme.samples(mu, logvar, eps))[0]
    np.testing.assert_allclose(z.mean(0), np.asarray(mu)[0], atol=0.05)
    np.testing.assert_allclose(z.std(0), np.exp(np.asarray(logvar)[0] / 2), rtol=0.03)
    other, _ = pcme.draw_eps(jax.random.key(1), 1, 1, 20000, 3)
    assert not np.allclose(eps, other)  # a fresh rng every step: fresh samples
    with pytest.raises(ValueError, match="rng"):
        pcme.loss({k: jnp.asarray(v) for k, v in _out().items()}, pcme.Config())


# ---------------------------------------------------------------------------------- TF-IDF
def test_tfidf_hand_example():
    # The fourth caption is pad/EOS only: no TF-IDF vector, similarity 0, no NaN. n = 4 documents.
    text = np.array([[5, 6, 6, 1, 1], [5, 7, 1, 1, 1], [8, 6, 7, 9, 0], [1, 1, 1, 1, 1]], np.int32)
    k = np.asarray(jax.jit(daa.tfidf_cosine, static_argnums=1)(jnp.asarray(text), IGNORE))
    idf2, idf1 = math.log(5 / 3) + 1, math.log(5 / 2) + 1  # df = 2 (ids 5, 6, 7), df = 1 (8, 9)
    norm2 = math.sqrt(2 * idf2 ** 2 + 2 * idf1 ** 2)
    # doc 0 = idf2 (1, 2) on ids (5, 6); doc 1 = idf2 (1, 1) on (5, 7); doc 2 = (idf2, idf2, idf1, idf1)
    expected = np.array([[1, 1 / math.sqrt(10), 2 * idf2 / (math.sqrt(5) * norm2), 0],
                         [0, 1, idf2 / (math.sqrt(2) * norm2), 0],
                         [0, 0, 1, 0],
                         [0, 0, 0, 0]])
    expected = expected + np.triu(expected, 1).T
    np.testing.assert_allclose(k, expected, rtol=1e-6, atol=1e-7)


def test_tfidf_random_and_semantic_map_with_targets():
    text = _out(b=7, length=9, vocab=12, seed=4)["text"]
    k = ref_tfidf(text)
    t = np.eye(7, dtype=np.float32)
    t[0, 1] = t[1, 0] = 1.0
    f = jax.jit(daa.semantic_map, static_argnums=2)
    assert _rel(f(jnp.asarray(text), jnp.asarray(np.eye(7, dtype=np.float32)), IGNORE), k) < RTOL
    expected = k.copy()
    expected[0] = expected[1] = (k[0] + k[1]) / 2  # images 0, 1: mean over their GT captions 0, 1
    np.testing.assert_allclose(f(jnp.asarray(text), jnp.asarray(t), IGNORE), expected, rtol=1e-5, atol=1e-7)


def test_tfidf_equals_sklearn():
    sk = pytest.importorskip("sklearn.feature_extraction.text")
    text = _out(b=7, length=9, vocab=12, seed=5)["text"]
    docs = [" ".join(f"t{int(t)}" for t in row if int(t) not in IGNORE) for row in text]
    x = sk.TfidfVectorizer(token_pattern=r"\S+", lowercase=False).fit_transform(docs).toarray()
    np.testing.assert_allclose(daa.tfidf_cosine(jnp.asarray(text), IGNORE), x @ x.T, rtol=1e-5, atol=1e-7)


# -------------------------------------------------------------------------------------- DAA
def test_soft_asp_tends_to_exact_asp():
    # One query, four items. S ranks (0.9, 0.5, 0.7, 0.1) -> 1, 3, 2, 4; C (0.2, 0.8, 0.6, 0.1)
    # -> 3, 1, 2, 4; ASP = (1/3 + 1/3 + 1 + 1) / 4 = 2/3 (DAA eq. 4).
    s = jnp.asarray([[0.9, 0.5, 0.7, 0.1]])
    c = jnp.asarray([[0.2, 0.8, 0.6, 0.1]])
    asp = jax.jit(lambda tau: daa.soft_asp(s, daa.semantic_ranks(c, 1, tau), tau)[0])
    errors = [abs(float(asp(tau)) - 2 / 3) for tau in (0.3, 0.1, 0.03, 1e-3)]
    assert errors == sorted(errors, reverse=True) and errors[0] > 0.01
    assert errors[-1] < 1e-6


@pytest.mark.parametrize("similarity,index", [("cross", "query"), ("same_modality", "query"),
                                              ("cross", "code")])
def test_asp_loss_matches_loops(similarity, index):
    rng = np.random.default_rng(6)
    zq, zi = (rng.normal(size=(4, 3, 5)).astype(np.float32) * 0.3 for _ in range(2))
    c = rng.uniform(size=(4, 4)).astype(np.float32)
    got = jax.jit(lambda *a: daa.asp_loss(*a, 0.05, similarity, index))(
        jnp.asarray(zq), jnp.asarray(zi), jnp.asarray(c))
    xq, xi = zq.reshape(12, 5).astype(np.float64), zi.reshape(12, 5).astype(np.float64)
    s = xq @ (xq if similarity == "same_modality" else xi).T
    cexp = np.repeat(np.repeat(c.astype(np.float64), 3, 0), 3, 1)
    if index == "code":  # rank[q, c] = 1 + sum_{a != c} phi(U[a, q] - U[q, c]) (DAA.py's broadcast)
        total = 0.0
        for q in range(12):
            for i in range(12):
                o = np.arange(12) != i
                rs = 1 + np.sum(_phi(s[o, q] - s[q, i], 0.05))
                rc = 1 + np.sum(_phi(cexp[o, q] - cexp[q, i], 0.05))
                total += min(rs, rc) / max(rs, rc)
        expected = 1 - total / 144
    else:
        expected = ref_soft_rank_loss(s, cexp, 0.05)
    assert _rel(got, expected) < RTOL


def test_daa_code_variant_is_coco_daa():
    """daa_similarity='same_modality', daa_rank_index='code' is DAA.py's coco_DAA."""
    out = _out(b=6, d=4, seed=7)
    zv, zt = (np.random.default_rng(s).normal(size=(6, 2, 4)).astype(np.float32) * 0.5 for s in (7, 8))
    cfg = daa.PcmeDaaConfig(daa_similarity="same_modality", daa_rank_index="code")
    terms = jax.jit(lambda zv, zt, text: daa.daa_terms(zv, zt, daa.semantic_map(text, None, IGNORE), cfg))(
        jnp.asarray(zv), jnp.asarray(zt), jnp.asarray(out["text"]))
    c = ref_tfidf(out["text"])
    assert _rel(terms["daa_i2t"], 1000 * ref_coco_daa(zv.astype(np.float64), c)) < RTOL
    assert _rel(terms["daa_t2i"], 1000 * ref_coco_daa(zt.astype(np.float64), c.T)) < RTOL


def test_daa_gradient_flows_only_through_similarity():
    rng = np.random.default_rng(12)
    zq, zi = (jnp.asarray(rng.normal(size=(4, 2, 3)) * 0.5, jnp.float32) for _ in range(2))
    c = jnp.asarray(rng.uniform(size=(4, 4)), jnp.float32)
    g_z, g_c = jax.jit(jax.grad(lambda z, c: daa.asp_loss(z, zi, c, 0.3), (0, 1)))(zq, c)
    assert np.all(np.asarray(g_c) == 0)
    assert np.any(np.asarray(g_z) != 0)


def test_chunked_rank_sum_equals_one_shot():
    rng = np.random.default_rng(13)
    u, v, w = (jnp.asarray(rng.normal(size=(6, 11)), jnp.float32) for _ in range(3))

    @jax.jit
    def both(u, v, w):
        def value_and_grad(chunk, weights):  # chunk = 6 * 11 * 3: 4 chunks of 3 items, the last padded
            f = lambda u, v: jnp.sum(jnp.sin(daa.masked_rank_sum(u, v, 0.2, weights, chunk)))
            return daa.masked_rank_sum(u, v, 0.2, weights, chunk), jax.grad(f, (0, 1))(u, v)
        return [(value_and_grad(None, weights), value_and_grad(6 * 11 * 3, weights)) for weights in (None, w)]

    for (full, g_full), (chunked, g_chunk) in both(u, v, w):
        assert _rel(chunked, full) < 1e-6
        for a, b in zip(g_chunk, g_full):
            assert _rel(a, b) < 1e-5


def test_rank_sum_slab_size_follows_the_compiled_platform():
    """The default slab size is the platform's the program is lowered for, not the host's: at
    Q = N = 160 the CPU program scans 4 slabs of 2^20 elements, the TPU program (compiled ahead of
    time on this CPU host by benchmarks/compile_tpu.py) takes all 160 items in one."""
    u = jnp.zeros((160, 160), jnp.float32)
    traced = jax.jit(lambda u: daa.masked_rank_sum(u, u, 0.2)).trace(u)
    assert "stablehlo.while" in traced.lower(lowering_platforms=("cpu",)).as_text()
    assert "stablehlo.while" not in traced.lower(lowering_platforms=("tpu",)).as_text()


# ------------------------------------------------------------------------------- Smooth-AP
def test_smooth_ap_code_variant_is_daa_smooth_ap():
    zv, zt = (np.random.default_rng(s).normal(size=(5, 2, 4)).astype(np.float32) * 0.5 for s in (14, 15))
    f = jax.jit(lambda a, b: smooth_ap.smooth_ap_loss(a, b, jnp.eye(5, dtype=bool), 0.01, "code"))
    for a, b in ((zv, zt), (zt, zv)):
        expected = ref_code_smooth_ap(a.astype(np.float64), b.astype(np.float64))
        assert _rel(f(jnp.asarray(a), jnp.asarray(b)), expected) < RTOL


# -------------------------------------------------------------------------------- gradients
def test_gradients_float64():
    rng = np.random.default_rng(16)
    with jax.enable_x64(True):
        zv, zt = (jnp.asarray(rng.normal(size=(4, 2, 3)) * 0.5) for _ in range(2))
        c = jnp.asarray(rng.uniform(size=(4, 4)))
        pos = jnp.asarray(_multi_positive(4) > 0)
        check_grads(jax.jit(lambda zq, zi: daa.asp_loss(zq, zi, c, 0.3, "same_modality", "code")), (zv, zt), 1,
                    modes=("rev",))
        check_grads(jax.jit(lambda zq, zi: smooth_ap.smooth_ap_loss(zq, zi, pos, 0.3)), (zv, zt), 1,
                    modes=("rev",))
        # PCME from (mu, log sigma^2, a, b) through its reparameterised samples (NLL, VIB,
        # uniformity), eps fixed; pcme_daa and smooth_ap add the rank terms checked above.
        out = {k: jnp.asarray(v, jnp.float64) for k, v in _out(b=4, d=3, seed=17).items() if k != "text"}
        cfg = pcme.Config(num_samples=2, vib_beta=0.1, uniform_lambda=0.5)
        t = jnp.asarray(_multi_positive(4), jnp.float64)
        eps_v, eps_t = (jnp.asarray(rng.normal(size=(4, 2, 3))) for _ in range(2))
        names = ("image_mean", "image_logvar", "text_mean", "text_logvar", "logit_scale", "logit_bias")

        def full(im, il, tm, tl, a, b):
            o = dict(zip(names, (im, il, tm, tl, a, b)))
            terms = pcme.terms_from_samples(o, cfg, pcme.samples(im, il, eps_v), pcme.samples(tm, tl, eps_t), t)
            return sum(terms.values())

        check_grads(jax.jit(full), tuple(out[k] for k in names), 1, modes=("rev",))


# ---------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("name", NAMES)
def test_registered_with_the_contract(name):
    obj = objectives.get(name)
    for flag in ("NEEDS_LOGVAR", "USES_MASKED", "SOFT_TARGETS"):
        assert isinstance(getattr(obj, flag), bool)
    cfg = schema.parse(obj.Config, {}, "config.loss")
    assert callable(obj.loss) and cfg == obj.Config()
    assert obj.SOFT_TARGETS == (name == "pcme") and obj.USES_MASKED is False


@pytest.mark.parametrize("name,knobs,field", [
    ("pcme", {"num_samples": 0}, "num_samples"), ("pcme", {"vib_form": "exact"}, "vib_form"),
    ("pcme_daa", {"daa_tau": 0.0}, "daa_tau"), ("pcme_daa", {"daa_similarity": "both"}, "daa_similarity"),
    ("pcme_daa", {"vib_beta": -1.0}, "vib_beta"), ("vse_daa", {"daa_beta": -1.0}, "daa_beta"),
    ("vse_daa", {"margin": -0.1}, "margin"), ("smooth_ap", {"ap_tau": 0.0}, "ap_tau"),
    ("smooth_ap", {"ap_rank_index": "row"}, "ap_rank_index")])
def test_validate_rejects_bad_knobs(name, knobs, field):
    with pytest.raises(ValueError, match=field):
        schema.parse(objectives.get(name).Config, knobs, "config.loss")
