"""evaluators/retrieval.py: metrics by hand, against eccv_caption, blocked == dense, end to end."""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from PIL import Image

from evaluators import ranks as RK
from evaluators import retrieval as R
from evaluators import retrieval_data
from input_pipeline import eval_data

# ---- a hand-computed case: 3 images, 7 captions; img0 {0,1}, img1 {2,3}, img2 {4,5,6} -----
CAP_IMG = np.array([0, 0, 1, 1, 2, 2, 2])
I2T_SCORES = np.array([
    [0.9, 0.1, 0.5, 0.3, 0.2, 0.2, 0.2],   # order 0,2,3,4,5,6,1 -> positives at ranks 0, 6
    [0.5] * 7,                               # all tied: stable order 0..6 -> ranks 2, 3
    [0.8, 0.0, 0.0, 0.0, 0.7, 0.9, 0.1],   # order 5,0,4,6,1,2,3 -> positives 4,5,6 at 2, 0, 3
])
T2I_SCORES = np.array([
    [1.0, 0.0, 0.0],   # c0 -> img0 rank 0
    [0.5, 0.5, 0.0],   # c1 -> img0 rank 0 (tie, lower index first)
    [0.5, 0.5, 0.0],   # c2 -> img1 rank 1 (tie, img0 first)
    [0.0, 0.0, 1.0],   # c3 -> img1 rank 2
    [0.0, 0.0, 1.0],   # c4 -> img2 rank 0
    [0.3, 0.2, 0.1],   # c5 -> img2 rank 2
    [0.1, 0.3, 0.2],   # c6 -> img2 rank 1
])


def i2t_positives(cap_img, n):
    return RK.pad_positives([np.flatnonzero(cap_img == i) for i in range(n)])


def test_positive_ranks_and_ties_by_hand():
    ranks = R.positive_ranks(I2T_SCORES, i2t_positives(CAP_IMG, 3))
    pad = RK.PAD
    np.testing.assert_array_equal(ranks, [[0, 6, pad], [2, 3, pad], [2, 0, 3]])
    np.testing.assert_array_equal(R.positive_ranks(T2I_SCORES, CAP_IMG[:, None])[:, 0],
                                  [0, 0, 1, 2, 0, 2, 1])
    # ... which is exactly where a stable descending argsort puts them (naver-ai/prolip src/prolip_train/zero_shot_unc.py)
    order = np.argsort(-I2T_SCORES, axis=1, kind="stable")
    for q, row in enumerate(ranks):
        for p, r in zip(np.flatnonzero(CAP_IMG == q), row):
            assert order[q, r] == p
    np.testing.assert_array_equal(R.top_indices(I2T_SCORES, 4), order[:, :4])
    np.testing.assert_array_equal(R.top_indices(T2I_SCORES, 2),
                                  np.argsort(-T2I_SCORES, axis=1, kind="stable")[:, :2])


def test_metrics_by_hand():
    i2t = R.positive_ranks(I2T_SCORES, i2t_positives(CAP_IMG, 3))
    t2i = R.positive_ranks(T2I_SCORES, CAP_IMG[:, None])
    assert R.recall_at_k(i2t, 1) == pytest.approx(200 / 3)
    assert R.recall_at_k(i2t, 3) == pytest.approx(100.0)   # img1's first positive at rank 2
    assert R.recall_at_k(i2t, 2) == pytest.approx(200 / 3)
    # R-P: img0 1/2, img1 0/2, img2 2/3
    assert R.r_precision(i2t) == pytest.approx(100 * (1 / 2 + 0 + 2 / 3) / 3)
    # mAP@R: img0 (1/1)/2; img1 0; img2 (1/1 + 2/3)/3
    assert R.map_at_r(i2t) == pytest.approx(100 * (1 / 2 + 0 + 5 / 9) / 3)
    assert R.recall_at_k(t2i, 1) == pytest.approx(300 / 7)
    assert R.recall_at_k(t2i, 2) == pytest.approx(500 / 7)
    # one positive per query: R-P = mAP@R = R@1
    assert R.r_precision(t2i) == pytest.approx(300 / 7)
    assert R.map_at_r(t2i) == pytest.approx(300 / 7)
    m = R.ranking_metrics(i2t, t2i, ks=(1, 5, 10))
    assert m["rsum"] == pytest.approx(200 / 3 + 100 + 100 + 300 / 7 + 100 + 100)
    assert m["i2t_map_at_r"] == pytest.approx(100 * 19 / 54)


def test_against_eccv_caption_on_real_coco_ids():
    pytest.importorskip("eccv_caption")
    from eccv_caption import _metrics as E
    from eccv_caption import Metrics

    gts = Metrics()
    rng = np.random.default_rng(0)
    for direction in ("i2t", "t2i"):
        for gt in (gts.eccv_gts[direction], gts.coco_gts[direction], gts.cxc_gts[direction]):
            queries = rng.choice(sorted(gt), 150, replace=False)
            pos_ids = sorted({int(x) for q in queries for x in gt[int(q)]})
            pool = sorted(gts.coco_gts["t2i" if direction == "i2t" else "i2t"])
            others = rng.choice(pool, 1500, replace=False)
            gallery = np.array(sorted(set(pos_ids) | set(int(x) for x in others)))
            where = {int(g): i for i, g in enumerate(gallery)}
            # coarse scores: many ties, broken by the gallery order as the reference does
            pos = RK.pad_positives([[where[int(x)] for x in set(gt[int(q)])] for q in queries])
            scores = rng.random((len(queries), len(gallery)))
            for j in range(pos.shape[1]):   # lift the positives so that the metrics are not ~0
                ok = pos[:, j] >= 0
                scores[np.flatnonzero(ok), pos[ok, j]] += rng.uniform(0, 1.2, ok.sum())
            scores = np.round(scores, 2)
            order = np.argsort(-scores, axis=1, kind="stable")
            target = {int(q): gallery[order[i]].tolist() for i, q in enumerate(queries)}
            sub_gt = {int(q): gt[int(q)] for q in queries}
            ranks = R.positive_ranks(scores, pos)
            ref = E.compute_eccv_metrics(target, sub_gt)
            assert R.map_at_r(ranks) == pytest.approx(100 * ref["eccv_map_at_r"], abs=1e-9)
            assert R.r_precision(ranks) == pytest.approx(100 * ref["eccv_rprecision"], abs=1e-9)
            assert R.r_precision(ranks) == pytest.approx(
                100 * E.compute_rprecision(target, sub_gt), abs=1e-9)
            for k in (1, 5, 10, 50):
                assert R.recall_at_k(ranks, k) == pytest.approx(
                    100 * E.compute_r_at_k(target, sub_gt, K=k), abs=1e-9)
            assert 10 < R.map_at_r(ranks) < 90   # a real, non-degenerate comparison


def test_blocked_equals_dense_and_reference_ranking():
    rng = np.random.default_rng(1)
    nq, ng, d = 13, 29, 8
    q_mu = rng.normal(size=(nq, d)).astype(np.float32)
    q_mu /= np.linalg.norm(q_mu, axis=1, keepdims=True)
    g_mu = rng.normal(size=(ng, d)).astype(np.float32)
    g_mu /= np.linalg.norm(g_mu, axis=1, keepdims=True)
    q_lv = rng.normal(-2, 1, size=(nq, d)).astype(np.float32)
    g_lv = rng.normal(-2, 1, size=(ng, d)).astype(np.float32)
    pos = RK.pad_positives([rng.choice(ng, rng.integers(1, 5), replace=False) for _ in range(nq)])
    # the reference's CSD-equivalent scores: mu_q @ mu_g.T - u_g / 2 (naver-ai/prolip src/prolip_train/zero_shot_unc.py)
    u_g = np.exp(g_lv.astype(np.float64)).sum(1)
    ref = {"csd": q_mu.astype(np.float64) @ g_mu.T - u_g[None] / 2, "dot": q_mu @ g_mu.T}
    for kind in ("csd", "dot"):
        ranks, top = R.blocked_ranks(q_mu, q_lv, g_mu, g_lv, pos, kind=kind, block=4, topk=6)
        np.testing.assert_array_equal(ranks, R.positive_ranks(ref[kind], pos))
        np.testing.assert_array_equal(top, np.argsort(-ref[kind], 1, kind="stable")[:, :6])
    # CSD and dot rank differently here (the uncertainties matter)
    assert not np.array_equal(R.blocked_ranks(q_mu, q_lv, g_mu, g_lv, pos, "csd", 4)[0],
                              R.blocked_ranks(q_mu, q_lv, g_mu, g_lv, pos, "dot", 4)[0])


def test_device_ranks_equal_host_ranks_with_ties_padding_and_exclusion():
    """blocked_ranks counts ranks on the device when it only needs ranks: the same values as
    positive_ranks on the host scores, ties broken by gallery index, -1 padding, an excluded
    item never ranked, blocks that do not divide the queries."""
    rng = np.random.default_rng(7)
    nq, ng, d = 11, 23, 4
    # coarse integer means: many exactly equal dot scores, so the tie rule is exercised
    q_mu = rng.integers(-1, 2, size=(nq, d)).astype(np.float32)
    g_mu = rng.integers(-1, 2, size=(ng, d)).astype(np.float32)
    pos = RK.pad_positives([rng.choice(ng, rng.integers(1, 6), replace=False) for _ in range(nq)])
    scores = q_mu @ g_mu.T
    assert (np.diff(np.sort(scores, 1), axis=1) == 0).sum() > nq * 5   # ties present
    for exclude in (None, rng.integers(0, ng, nq)):
        host = scores.copy()
        if exclude is not None:
            host[np.arange(nq), exclude] = -np.inf
        want = R.positive_ranks(host, pos)
        got, top = R.blocked_ranks(q_mu, None, g_mu, None, pos, "dot", block=4, exclude=exclude)
        assert top is None
        np.testing.assert_array_equal(got, want)
        assert (got[pos < 0] == want[pos < 0]).all() and (pos < 0).any()   # padding -> _PAD
    # the CSD kind with uncertainties takes the same path
    q_lv = rng.normal(-2, 1, size=(nq, d)).astype(np.float32)
    g_lv = rng.normal(-2, 1, size=(ng, d)).astype(np.float32)
    from evaluators.common import blocked_scores
    dense = np.concatenate([s for _, s in blocked_scores(q_mu, q_lv, g_mu, g_lv, "csd", block=5)])
    np.testing.assert_array_equal(R.blocked_ranks(q_mu, q_lv, g_mu, g_lv, pos, "csd", block=5)[0],
                                  R.positive_ranks(dense, pos))


# ---- end to end ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from prolip_jax.core.models import ProLIP, abstract_params, get_config

    cfg = get_config("micro")
    model = ProLIP(cfg, attention_impl="xla")
    # random weights of the right shapes (an eager `init_params` costs ~15 s of op compiles)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(a.dtype),
                          abstract_params(cfg))
    demo = dict(cache_dir=str(tmp_path_factory.mktemp("demo")), image_size=16, num_train=200,
                num_zeroshot=36, num_retrieval=20, num_levels=10)
    return model, params, demo


def embed(model, params, images, tokens):
    """Independent encoding: the whole set in one jitted call per tower, float64 numpy."""
    i_mu, i_lv = jax.jit(lambda p, x: model.apply({"params": p}, x, method=model.encode_image))(
        params, images)
    t_mu, t_lv = jax.jit(lambda p, x: model.apply({"params": p}, x, method=model.encode_text))(
        params, tokens)
    return tuple(np.asarray(x, np.float64) for x in (i_mu, i_lv, t_mu, t_lv))


def dense_metrics(emb, cap_img, kind):
    """Independent dense computation: full score matrices (naver-ai/prolip src/prolip_train/zero_shot_unc.py), stable argsort."""
    i_mu, i_lv, t_mu, t_lv = emb
    ui, ut = np.exp(i_lv).sum(1), np.exp(t_lv).sum(1)
    i2t = i_mu @ t_mu.T - (ut[None] / 2 if kind == "csd" else 0)
    t2i = t_mu @ i_mu.T - (ui[None] / 2 if kind == "csd" else 0)
    out = {}
    for d, s, pos_of in (("i2t", i2t, lambda q: set(np.flatnonzero(cap_img == q))),
                         ("t2i", t2i, lambda q: {cap_img[q]})):
        order = np.argsort(-s, axis=1, kind="stable")
        hits = np.array([[o in pos_of(q) for o in order[q]] for q in range(len(s))])
        for k in (1, 5, 10):
            out[f"{d}_R@{k}"] = 100 * hits[:, :k].any(1).mean()
        nr = hits.sum(1)
        out[f"{d}_rprecision"] = 100 * np.mean([h[:r].sum() / r for h, r in zip(hits, nr)])
        out[f"{d}_map_at_r"] = 100 * np.mean([sum(h[:i + 1].sum() / (i + 1)
                                                  for i in range(r) if h[i]) / r
                                              for h, r in zip(hits, nr)])
    out["rsum"] = sum(out[f"{d}_R@{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10))
    return out


def test_evaluator_end_to_end_demo(setup):
    model, params, demo = setup
    ev = R.Evaluator(dict(dataset="demo", demo=demo, batch_size=16, block=7), model)
    res = dict(ev.run(params))
    data = ev.data()
    assert len(data) == 20 and len(data.captions) == 20
    from input_pipeline.demo import get_demo
    ref = get_demo(**demo).load_split("retrieval", image_size=16,
                                      context_length=model.config.text.context_length)
    assert data.captions == list(ref["captions"])
    names = {f"retrieval/demo/{s}/{d}_{m}" for s in ("csd", "dot") for d in ("i2t", "t2i")
             for m in ("R@1", "R@5", "R@10", "rprecision", "map_at_r")}
    names |= {"retrieval/demo/csd/rsum", "retrieval/demo/dot/rsum"}
    # plus recall per query-uncertainty bin (tests/test_eval_retrieval_unc.py); no i2i / t2t
    # metrics: one caption per image and no caption shared
    assert {k for k in res if "/unc_" not in k} == names
    assert "retrieval/demo/csd/i2t/unc_corr_R1" in res
    for kind in ("csd", "dot"):
        want = dense_metrics(embed(model, params, ref["image"], ref["text"]), data.caption_record,
                             kind)
        for k, v in want.items():
            assert res[f"retrieval/demo/{kind}/{k}"] == pytest.approx(v, abs=1e-6), (kind, k)


def write_karpathy(root, n_test=4, name="coco"):
    rng = np.random.default_rng(0)
    images, sentid = [], 0
    (root / "val2014").mkdir(parents=True, exist_ok=True)
    for i in range(n_test + 1):
        fn = f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (20 + i, 24, 3), np.uint8)).save(root / "val2014" / fn)
        nsent = 6 if i == 0 else 5
        sents = [{"raw": f"a red square number {i} {j}", "tokens": [], "imgid": i,
                  "sentid": sentid + j} for j in range(nsent)]
        sentid += nsent
        images.append({"filepath": "val2014", "filename": fn, "imgid": i, "cocoid": 1000 + i,
                       "split": "train" if i == n_test else "test", "sentences": sents,
                       "sentids": [s["sentid"] for s in sents]})
    path = root / f"dataset_{name}.json"
    path.write_text(json.dumps({"images": images, "dataset": name}))
    return path


def test_karpathy_loading(tmp_path):
    from input_pipeline.transforms import eval_transform

    path = write_karpathy(tmp_path)
    data = retrieval_data.karpathy(str(path), str(tmp_path))
    assert data.name == "coco" and len(data) == 4
    assert len(data.captions) == 20   # image 0 has 6 sentences: the first 5 are kept
    assert data.captions[:2] == ["a red square number 0 0", "a red square number 0 1"]
    np.testing.assert_array_equal(data.caption_record, np.repeat(np.arange(4), 5))
    np.testing.assert_array_equal(data.info["image_ids"], [1000, 1001, 1002, 1003])
    assert data.info["caption_ids"] is None   # no annotation ids given
    (batch,) = list(data.batches(4, 16))      # through the input pipeline's eval iterator
    assert batch["image"].shape == (4, 16, 16, 3) and batch["image"].dtype == np.uint8
    assert batch["mask"].all() and batch["index"].tolist() == [0, 1, 2, 3]
    want = eval_transform(Image.open(tmp_path / "val2014" / "img2.png").convert("RGB"), 16)
    np.testing.assert_array_equal(batch["image"][2], want)
    # real COCO caption ids from an annotation file, matched on (image id, text)
    anns = [{"image_id": 1000 + i, "id": 7000 + 10 * i + j,
             "caption": f"A red square number {i} {j} "} for i in range(4) for j in range(6)]
    (tmp_path / "captions_val2014.json").write_text(json.dumps({"annotations": anns}))
    data = retrieval_data.karpathy(str(path), str(tmp_path),
                              coco_annotations=[str(tmp_path / "captions_val2014.json")])
    assert data.info["caption_ids"][:6].tolist() == [7000, 7001, 7002, 7003, 7004, 7010]
    # missing files are named
    with pytest.raises(FileNotFoundError, match="nothere.json"):
        retrieval_data.karpathy(str(tmp_path / "nothere.json"), str(tmp_path))
    (tmp_path / "val2014" / "img3.png").unlink()
    with pytest.raises(FileNotFoundError, match="img3.png"):
        retrieval_data.karpathy(str(path), str(tmp_path))


def test_evaluator_karpathy_coco_folds(setup, tmp_path):
    from input_pipeline.demo import get_demo

    model, params, demo = setup
    tok = get_demo(**demo).tokenizer(model.config.text.context_length)
    path = write_karpathy(tmp_path, n_test=4)
    ev = R.Evaluator(dict(dataset="karpathy", karpathy_json=str(path), image_root=str(tmp_path),
                          num_folds=2, fold_size=2, scores=("csd",), batch_size=8), model,
                     tokenizer=tok)
    res = dict(ev.run(params))
    data = ev.data()
    images = np.concatenate([b["image"][b["mask"]] for b in data.batches(4, 16)])
    from prolip_jax.core.normalization import normalize
    tokens = tok(data.captions)
    emb = embed(model, params, normalize(images), tokens)
    full = dense_metrics(emb, data.caption_record, "csd")
    for k, v in full.items():
        assert res[f"retrieval/coco/csd/5k/{k}"] == pytest.approx(v, abs=1e-6), k
    # fold f: images 2f, 2f+1 and their captions 10f..10f+9
    folds = [dense_metrics((emb[0][2 * f:2 * f + 2], emb[1][2 * f:2 * f + 2],
                            emb[2][10 * f:10 * f + 10], emb[3][10 * f:10 * f + 10]),
                           data.caption_record[:10], "csd") for f in range(2)]
    for k in full:
        assert res[f"retrieval/coco/csd/1k/{k}"] == pytest.approx(
            np.mean([f[k] for f in folds]), abs=1e-6), k
    assert not any("eccv" in k or "cxc" in k for k in res)   # not the COCO 5K ids


def test_evaluator_eccv_and_cxc_on_real_ids(setup, monkeypatch):
    """The ECCV / CxC path on a 150-image slice of the real COCO 5K ids (eccv_caption's ground
    truths restricted to it), checked against our own metrics on the dense ranking."""
    eccv_caption = pytest.importorskip("eccv_caption")
    full = eccv_caption.Metrics()
    imgs = sorted(full.eccv_gts["i2t"])[:150]
    caps = [c for i in imgs for c in full.coco_gts["i2t"][i]]
    keep_i, keep_c = set(imgs), set(caps)

    def restrict(g):
        i2t = {i: [c for c in v if c in keep_c] for i, v in g["i2t"].items() if i in keep_i}
        t2i = {c: [i for i in v if i in keep_i] for c, v in g["t2i"].items() if c in keep_c}
        return {"i2t": {k: v for k, v in i2t.items() if v}, "t2i": {k: v for k, v in t2i.items() if v}}

    class Slice(eccv_caption.Metrics):
        def __init__(self):
            self.__dict__.update(full.__dict__)
            self.coco_ids = np.array(caps)
            self.coco_gts, self.cxc_gts, self.eccv_gts = (
                restrict(g) for g in (full.coco_gts, full.cxc_gts, full.eccv_gts))

    monkeypatch.setattr(eccv_caption, "Metrics", Slice)
    model, _, _ = setup
    rng = np.random.default_rng(2)
    cap_img = np.repeat(np.arange(len(imgs)), 5)
    i_mu = rng.normal(size=(len(imgs), 6))
    t_mu = i_mu[cap_img] + rng.normal(size=(len(caps), 6))   # correlated: metrics well above 0
    i_mu /= np.linalg.norm(i_mu, axis=1, keepdims=True)
    t_mu /= np.linalg.norm(t_mu, axis=1, keepdims=True)
    i_lv, t_lv = rng.normal(-3, 1, i_mu.shape), rng.normal(-3, 1, t_mu.shape)
    emb = tuple(x.astype(np.float32) for x in (i_mu, i_lv, t_mu, t_lv))
    ev = R.Evaluator(dict(dataset="karpathy", scores=("csd",), num_folds=0), model)
    ev._data = eval_data.EvalSet("coco", [None] * len(imgs), [""] * len(caps), cap_img,
                                 {"image_ids": np.array(imgs), "caption_ids": np.array(caps)})
    monkeypatch.setattr(ev, "encode", lambda params, data, progress=None: emb)
    res = dict(ev.run(None))

    i_mu, i_lv, t_mu, t_lv = (x.astype(np.float64) for x in emb)
    scores = {"i2t": i_mu @ t_mu.T - np.exp(t_lv).sum(1)[None] / 2,   # naver-ai/prolip src/prolip_train/zero_shot_unc.py
              "t2i": t_mu @ i_mu.T - np.exp(i_lv).sum(1)[None] / 2}
    ids = {"i2t": (imgs, caps), "t2i": (caps, imgs)}
    sl = Slice()
    for d in ("i2t", "t2i"):
        q_ids, g_ids = ids[d]
        where = {g: j for j, g in enumerate(g_ids)}
        for gt, name in ((sl.eccv_gts[d], "eccv"), (sl.cxc_gts[d], "cxc")):
            rows = [q_ids.index(q) for q in gt]
            ranks = R.positive_ranks(scores[d][rows],
                                     RK.pad_positives([[where[g] for g in gt[q]] for q in gt]))
            if name == "eccv":
                assert res[f"retrieval/coco/csd/eccv/{d}_r1"] == pytest.approx(R.recall_at_k(ranks, 1))
                assert res[f"retrieval/coco/csd/eccv/{d}_map_at_r"] == pytest.approx(R.map_at_r(ranks))
                assert res[f"retrieval/coco/csd/eccv/{d}_rprecision"] == pytest.approx(R.r_precision(ranks))
            else:
                for k in (1, 5, 10):
                    assert res[f"retrieval/coco/csd/cxc/{d}_R@{k}"] == pytest.approx(
                        R.recall_at_k(ranks, k))
    assert 5 < res["retrieval/coco/csd/eccv/i2t_map_at_r"] < 95
    assert res["retrieval/coco/csd/eccv/mean_r1"] == pytest.approx(
        (res["retrieval/coco/csd/eccv/i2t_r1"] + res["retrieval/coco/csd/eccv/t2i_r1"]) / 2)
    assert "retrieval/coco/csd/5k/rsum" in res and not any("/1k/" in k for k in res)
