"""evaluators/caption_metrics.py (PMRP, ASP with TF-IDF, class-level positives) and the
uncertainty-bin rho of evaluators/retrieval.py: hand-computed examples, then end to end.

Every expectation below is written out by hand in float64 (ranks 1-based where the metric says
so); tolerance: pytest.approx's default (relative 1e-6) unless stated."""
from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

from evaluators import caption_metrics as CM
from evaluators import ranks as RK
from evaluators import retrieval as R
from evaluators import retrieval_data
from prolip_jax.trainer.build import EVAL_KEYS  # a run's settings of an evaluator, not its config

ROOT = Path(__file__).resolve().parents[1]


# ---- PMRP: 3 images x 2 captions, category vectors over 4 categories -----------------------
CODES = np.array([[1, 1, 0, 0],    # img0
                  [1, 0, 0, 0],    # img1: Hamming 1 from img0
                  [0, 0, 1, 1]],   # img2: Hamming 4 from img0, 3 from img1
                 bool)
CAP_IMG = np.array([0, 0, 1, 1, 2, 2])
I2T = np.array([
    [0.9, 0.1, 0.8, 0.7, 0.6, 0.5],   # order c0 c2 c3 c4 c5 c1
    [0.5, 0.5, 0.2, 0.9, 0.1, 0.0],   # order c3 c0 c1 c2 c4 c5 (tie c0 = c1: c0 first)
    [0.0, 0.0, 0.0, 0.0, 0.3, 0.3],   # order c4 c5 c0 c1 c2 c3
])
T2I = np.array([
    [0.1, 0.9, 0.0],   # c0: img1 img0 img2
    [0.5, 0.5, 0.5],   # c1: all tied -> img0 img1 img2
    [0.3, 0.2, 0.9],   # c2: img2 img0 img1
    [0.0, 1.0, 0.0],   # c3: img1 img0 img2
    [0.2, 0.1, 0.0],   # c4: img0 img1 img2
    [0.0, 0.0, 0.0],   # c5: img0 img1 img2
])


def run_pmrp(acc, scores, split):
    """Feed an accumulator in two blocks (as blocked_ranks does)."""
    acc(scores[:split], 0)
    acc(scores[split:], split)
    return acc


def test_hamming_and_full_ranks():
    np.testing.assert_array_equal(CM.hamming(CODES, CODES), [[0, 1, 4], [1, 0, 3], [4, 3, 0]])
    np.testing.assert_array_equal(RK.full_ranks(I2T[:2]), [[0, 5, 1, 2, 3, 4], [1, 2, 3, 0, 4, 5]])
    # the same tie rule as positive_ranks (stable descending argsort)
    every = np.tile(np.arange(6), (3, 1))
    np.testing.assert_array_equal(RK.full_ranks(I2T), R.positive_ranks(I2T, every))


def test_pmrp_by_hand():
    tc = CODES[CAP_IMG]
    i2t = run_pmrp(CM.PMRP(CODES, tc), I2T, 2).result("i2t")
    # img0: z0 {c0,c1} R=2, top2 {c0,c2} -> 1/2; z1 = z2: {c0..c3} R=4, top4 {c0,c2,c3,c4} -> 3/4
    # img1: z0 {c2,c3}, top2 {c3,c0} -> 1/2; z1 = z2: {c0..c3}, top4 = them -> 1
    # img2: {c4,c5} at every zeta (distances 4, 3) -> 1
    assert i2t["i2t_pmrp_zeta0"] == pytest.approx(100 * (1 / 2 + 1 / 2 + 1) / 3)
    assert i2t["i2t_pmrp_zeta1"] == pytest.approx(100 * (3 / 4 + 1 + 1) / 3)
    assert i2t["i2t_pmrp_zeta2"] == pytest.approx(100 * (3 / 4 + 1 + 1) / 3)
    assert i2t["i2t_pmrp"] == pytest.approx(100 * 5 / 6)
    t2i = run_pmrp(CM.PMRP(tc, CODES), T2I, 3).result("t2i")
    # z0 (own image only): c0 0, c1 1, c2 0, c3 1, c4 0, c5 0
    # z1 = z2 ({img0, img1} for c0..c3, {img2} for c4, c5): 1, 1, 1/2, 1, 0, 0
    assert t2i["t2i_pmrp_zeta0"] == pytest.approx(100 * 2 / 6)
    assert t2i["t2i_pmrp_zeta1"] == pytest.approx(100 * 3.5 / 6)
    assert t2i["t2i_pmrp"] == pytest.approx(100 * (1 / 3 + 7 / 12 + 7 / 12) / 3)


def test_pmrp_unannotated_rules():
    codes = CODES.copy()
    codes[2] = False                      # img2 without any instance annotation
    keep = np.array([True, True, False])
    tc, tk = codes[CAP_IMG], keep[CAP_IMG]
    # "drop" (PCME's script): img2 is no query and c4, c5 leave every gallery
    drop = run_pmrp(CM.PMRP(codes, tc, q_keep=keep, g_keep=tk), I2T, 1).result("i2t")
    # img0 in c0..c3: order c0 c2 c3 c1 -> z0 1/2, z1 = z2 1; img1: order c3 c0 c1 c2 -> 1/2, 1, 1
    assert [drop[f"i2t_pmrp_zeta{z}"] for z in (0, 1, 2)] == pytest.approx([50.0, 100.0, 100.0])
    # "zero": img2 stays with a zero vector (distance 2 from img0, 1 from img1)
    zero = run_pmrp(CM.PMRP(codes, tc), I2T, 1).result("i2t")
    # img0: z0 1/2, z1 {c0..c3} 3/4, z2 all 6 -> 1; img1: 1/2, all -> 1, 1;
    # img2: z0 {c4,c5} 1, z1 {c2..c5}: top4 {c4,c5,c0,c1} -> 1/2, z2 all -> 1
    assert zero["i2t_pmrp_zeta0"] == pytest.approx(100 * 2 / 3)
    assert zero["i2t_pmrp_zeta1"] == pytest.approx(100 * (3 / 4 + 1 + 1 / 2) / 3)
    assert zero["i2t_pmrp_zeta2"] == pytest.approx(100.0)
    with pytest.raises(ValueError, match="no query"):
        CM.PMRP(codes, tc, q_keep=np.zeros(3, bool)).result("i2t")


# ---- ASP ---------------------------------------------------------------------------------
def test_asp_by_hand_with_ties():
    scores = np.array([[0.9, 0.5, 0.5, 0.1],     # tie: item 1 before item 2 -> ranks 1 2 3 4
                       [0.3, 0.3, 0.3, 0.3],     # all tied -> 1 2 3 4
                       [0.1, 0.2, 0.3, 0.4]])    # -> 4 3 2 1
    semantic = np.array([[0.2, 0.8, 0.0, 0.5],   # -> 3 1 4 2
                         [0.0, 0.0, 1.0, 0.0],   # -> 2 3 1 4 (ties in index order)
                         [0.1, 0.2, 0.3, 0.4]])  # -> 4 3 2 1
    want = np.array([(1 / 3 + 1 / 2 + 3 / 4 + 2 / 4) / 4,   # 25/48
                     (1 / 2 + 2 / 3 + 1 / 3 + 1) / 4,        # 5/8
                     1.0])
    np.testing.assert_allclose(CM.asp_per_query(scores, semantic), want, rtol=1e-12)
    # the other tie order (item 2 before item 1) would give 5/12 for the first query
    assert want[0] != pytest.approx((1 / 3 + 1 / 3 + 2 / 4 + 2 / 4) / 4)
    acc = CM.ASP(lambda rows: semantic[rows], 3)
    acc(scores[:1], 0)
    acc(scores[1:], 1)
    assert acc.result("i2t")["i2t_asp_tfidf"] == pytest.approx(100 * 103 / 144)


def test_tfidf_by_hand():
    caps = ["A dog runs", "Dog DOG", "the cat, the dog"]
    # tokens (2+ word characters, lower-cased; "a" dropped): [dog runs] [dog dog] [the cat the dog]
    # n = 3; df: dog 3, runs 1, the 1, cat 1 -> idf dog = ln(4/4) + 1 = 1, the others b = ln 2 + 1
    b = math.log(2) + 1
    v = CM.tfidf_vectors(caps)
    assert v.shape == (3, 4)   # vocabulary: cat dog runs the
    dense = v.toarray()
    np.testing.assert_allclose(dense[0], np.array([0, 1, b, 0]) / math.sqrt(1 + b * b), rtol=1e-12)
    np.testing.assert_allclose(dense[1], [0, 1, 0, 0], rtol=1e-12)   # raw tf 2, normalised
    np.testing.assert_allclose(dense[2], np.array([b, 1, 0, 2 * b]) / math.sqrt(5 * b * b + 1),
                               rtol=1e-12)
    psi = (v @ v.T).toarray()
    assert psi[0, 1] == pytest.approx(1 / math.sqrt(1 + b * b), rel=1e-12)
    assert psi[0, 2] == pytest.approx(1 / (math.sqrt(1 + b * b) * math.sqrt(5 * b * b + 1)), rel=1e-12)
    assert psi[1, 2] == pytest.approx(1 / math.sqrt(5 * b * b + 1), rel=1e-12)
    # SEM: the mean over an image's first P captions, the first repeated when it has fewer
    gt = CM.ground_truth_mean(v, np.array([0, 1, 1]), 2, per_image=2).toarray()
    np.testing.assert_allclose(gt[0], dense[0], rtol=1e-12)                 # (c0 + c0) / 2
    np.testing.assert_allclose(gt[1], (dense[1] + dense[2]) / 2, rtol=1e-12)
    sem = CM.semantic_block(CM.ground_truth_mean(v, np.array([0, 1, 1]), 2, 2), v)
    np.testing.assert_allclose(sem, gt @ dense.T, rtol=1e-12)
    assert CM.tfidf_vectors(["a", "b c"]).nnz == 0   # no token: zero rows, no nan


# ---- CUB: class-level positives ----------------------------------------------------------
def test_cub_class_r_precision_by_hand(monkeypatch):
    image_class = np.array([7, 7, 9])
    cap_img = np.array([0, 0, 1, 2, 2])
    i2t_pos, t2i_pos = CM.class_positives(image_class, cap_img)
    assert [sorted(p[p >= 0].tolist()) for p in i2t_pos] == [[0, 1, 2], [0, 1, 2], [3, 4]]
    assert [sorted(p[p >= 0].tolist()) for p in t2i_pos] == [[0, 1]] * 3 + [[2]] * 2
    scores = np.array([[0.1, 0.9, 0.8, 0.7, 0.0],   # order 1 2 3 0 4: top3 has 1, 2 -> 2/3
                       [0.5] * 5,                   # tied: 0 1 2 -> 3/3
                       [0.9, 0.0, 0.0, 0.1, 0.2]])  # order 0 4 3 ..: top2 has 4 -> 1/2
    ranks = R.positive_ranks(scores, i2t_pos)
    assert R.r_precision(ranks) == pytest.approx(100 * (2 / 3 + 1 + 1 / 2) / 3)
    # the many-positives path (one sort per row) == the per-positive path
    rng = np.random.default_rng(0)
    s = np.round(rng.random((7, 90)), 1)           # many ties
    pos = RK.pad_positives([rng.choice(90, rng.integers(1, 60), replace=False) for _ in range(7)])
    fast = R.positive_ranks(s, pos)
    monkeypatch.setattr(R, "_MANY_POSITIVES", 10 ** 9)
    np.testing.assert_array_equal(fast, R.positive_ranks(s, pos))


# ---- rho: bin-level Pearson of bin mean uncertainty and bin R@1 ----------------------------
def test_binned_rho_by_hand():
    ranks = np.array([[0], [0], [0], [1], [1], [1]])
    unc = np.array([0.1, 0.2, 0.3, 0.4, 1.0, 2.0])
    out = R.binned_ranking(ranks, unc, bins=3)
    # bins {q0,q1} {q2,q3} {q4,q5}: R@1 100, 50, 0; mean sigma^2 0.15, 0.35, 1.5
    x, y = np.array([0.15, 0.35, 1.5]), np.array([100.0, 50.0, 0.0])
    dx, dy = x - x.mean(), y - y.mean()
    rho = (dx * dy).sum() / math.sqrt((dx * dx).sum() * (dy * dy).sum())
    # by hand: sum dx dy = -67.5; sum dx^2 = 2.395 - 3 (2/3)^2; sum dy^2 = 5000
    assert rho == pytest.approx(-67.5 / math.sqrt((2.395 - 4 / 3) * 5000), rel=1e-12)
    assert out["unc_rho_R1"] == pytest.approx(rho, abs=1e-12)
    assert out["unc_corr_R1"] == pytest.approx(-1.0)      # with the bin index: a straight line
    assert R.binned_ranking(np.zeros((4, 1), int), np.arange(4.0), 2)["unc_rho_R1"] == 0.0


# ---- instances file ---------------------------------------------------------------------
def write_instances(path, image_ids, cats_of):
    anns = [{"id": 100 * i + k, "image_id": iid, "category_id": c}
            for i, iid in enumerate(image_ids) for k, c in enumerate(cats_of.get(iid, []))]
    path.write_text(json.dumps({"images": [{"id": i} for i in image_ids], "annotations": anns,
                                "categories": [{"id": c} for c in (1, 2, 3, 90)]}))
    return path


def test_coco_category_codes_and_missing_image(tmp_path):
    f = write_instances(tmp_path / "instances_val2014.json", [5, 6, 7],
                        {5: [1, 1, 3], 6: [90]})
    codes, annotated = retrieval_data.coco_category_codes([str(f)], [6, 5, 7])
    assert codes.shape == (3, 90)
    assert [np.flatnonzero(c).tolist() for c in codes] == [[89], [0, 2], []]
    assert annotated.tolist() == [True, True, False]
    with pytest.raises(ValueError, match=r"instances_val2014\.json.*image id 8"):
        retrieval_data.coco_category_codes(str(f), [5, 8])
    with pytest.raises(FileNotFoundError, match="nothere.json"):
        retrieval_data.coco_category_codes([str(tmp_path / "nothere.json")], [5])


# ---- end to end: a tiny Karpathy-format COCO set through the evaluator (micro model) -------
WORDS = ["dog", "cat", "red", "blue", "runs", "sits", "grass", "table"]


def write_set(root, n=4):
    rng = np.random.default_rng(0)
    (root / "val2014").mkdir(parents=True, exist_ok=True)
    images, cats = [], {}
    for i in range(n):
        fn = f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (20, 24, 3), np.uint8)).save(root / "val2014" / fn)
        sents = [{"raw": " ".join(rng.choice(WORDS, 3)) + f" {j}"} for j in range(5 if i else 4)]
        images.append({"filepath": "val2014", "filename": fn, "cocoid": 1000 + i,
                       "split": "test", "sentences": sents})
        cats[1000 + i] = [] if i == 3 else [int(c) for c in rng.choice([1, 2, 3], rng.integers(1, 3))]
    (root / "dataset_coco.json").write_text(json.dumps({"images": images, "dataset": "coco"}))
    write_instances(root / "instances_val2014.json", [1000 + i for i in range(n)], cats)
    return root / "dataset_coco.json", root / "instances_val2014.json"


def dense_extras(i_mu, i_lv, t_mu, t_lv, cap_img, codes, keep, v):
    """PMRP and ASP from dense -CSD scores (the reference's eval_ret ranking), full argsorts and dense TF-IDF
    rows v of the protocol's captions (fit on the whole split), independently of the blocks."""
    ui, ut = np.exp(i_lv).sum(1), np.exp(t_lv).sum(1)
    scores = {"i2t": i_mu @ t_mu.T - ut[None] / 2, "t2i": t_mu @ i_mu.T - ui[None] / 2}
    gt = []
    for i in range(len(i_mu)):
        caps = list(np.flatnonzero(cap_img == i))
        gt.append(np.mean([v[c] for c in (caps + [caps[0]] * 5)[:5]], 0))   # P = 5
    gt = np.stack(gt)
    sem = {"i2t": gt @ v.T, "t2i": v @ gt.T}
    q_of = {"i2t": np.arange(len(i_mu)), "t2i": cap_img}     # image of each query / item
    g_of = {"i2t": cap_img, "t2i": np.arange(len(i_mu))}
    out = {}
    for d in ("i2t", "t2i"):
        rank = lambda s: np.argsort(np.argsort(-s, kind="stable"), kind="stable")
        asp = [np.mean(np.minimum(rank(s) + 1, rank(c) + 1) / np.maximum(rank(s) + 1, rank(c) + 1))
               for s, c in zip(scores[d], sem[d])]
        out[f"{d}_asp_tfidf"] = 100 * np.mean(asp)
        per_z = []
        for z in (0, 1, 2):
            rps = []
            for q in np.flatnonzero(keep[q_of[d]]):
                cols = np.flatnonzero(keep[g_of[d]])
                order = cols[np.argsort(-scores[d][q, cols], kind="stable")]
                dist = (codes[q_of[d][q]] != codes[g_of[d][order]]).sum(1)
                r = int((dist <= z).sum())
                rps.append((dist[:r] <= z).sum() / r)
            per_z.append(100 * np.mean(rps))
            out[f"{d}_pmrp_zeta{z}"] = per_z[-1]
        out[f"{d}_pmrp"] = np.mean(per_z)
    return out


def test_evaluator_end_to_end_karpathy(tmp_path, caplog):
    from prolip_jax.core.models import ProLIP, abstract_params, get_config
    from prolip_jax.core.normalization import normalize

    cfg = get_config("micro")
    model = ProLIP(cfg, attention_impl="xla")
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(a.dtype),
                          abstract_params(cfg))
    tok = lambda texts: np.stack([np.resize(np.frombuffer(t.encode(), np.uint8).astype(np.int32) % 50 + 1,
                                            cfg.text.context_length) for t in texts])
    karpathy, instances = write_set(tmp_path)
    base = dict(dataset="karpathy", karpathy_json=str(karpathy), image_root=str(tmp_path),
                scores=("csd",), batch_size=8, num_folds=2, fold_size=2, block=3, unc_bins=2,
                same_modality=())
    ev = R.Evaluator(dict(base, instances=str(instances), asp=True), model, tokenizer=tok)
    res = dict(ev.run(params))
    data = ev.data()
    cap_img = data.caption_record
    assert len(data) == 4 and len(data.captions) == 19      # image 0 has 4 captions

    images = np.concatenate([b["image"][b["mask"]] for b in data.batches(4, 16)])
    apply = lambda m, x: jax.jit(lambda p, x: model.apply({"params": p}, x, method=m))(params, x)
    i_mu, i_lv = (np.asarray(a, np.float64) for a in apply(model.encode_image, normalize(images)))
    t_mu, t_lv = (np.asarray(a, np.float64) for a in apply(model.encode_text, tok(data.captions)))
    codes, annotated = retrieval_data.coco_category_codes([str(instances)], data.info["image_ids"])
    assert annotated.tolist() == [True, True, True, False]
    v = CM.tfidf_vectors(data.captions).toarray()
    full = dense_extras(i_mu, i_lv, t_mu, t_lv, cap_img, codes, annotated, v)
    for k, want in full.items():   # float32 scores on device vs float64 here: no near-ties here
        assert res[f"retrieval/coco/csd/5k/{k}"] == pytest.approx(want, abs=1e-6), k
    folds = []
    for f in range(2):
        caps = np.flatnonzero((cap_img >= 2 * f) & (cap_img < 2 * f + 2))
        sl = slice(2 * f, 2 * f + 2)
        # ASP's TF-IDF is fit on the whole split (DAA slices its 5K map per fold)
        folds.append(dense_extras(i_mu[sl], i_lv[sl], t_mu[caps], t_lv[caps],
                                  cap_img[caps] - 2 * f, codes[sl], annotated[sl], v[caps]))
    for k in full:
        assert res[f"retrieval/coco/csd/1k/{k}"] == pytest.approx(np.mean([f[k] for f in folds]), abs=1e-6), k
    for key in ("5k/i2t/unc_rho_R1", "1k/t2i/unc_rho_R1", "1k/i2t/unc_bin1_R1", "5k/rsum"):
        assert f"retrieval/coco/csd/{key}" in res, key
    # "zero": the unannotated image takes part (other values); no instances file: skipped, said once
    zero = dict(R.Evaluator(dict(base, instances=str(instances), pmrp_unannotated="zero"), model,
                            tokenizer=tok).run(params))
    assert "retrieval/coco/csd/5k/t2i_pmrp" in zero and "retrieval/coco/csd/5k/i2t_asp_tfidf" not in zero
    R._WARNED.discard(("coco", "pmrp"))
    with caplog.at_level("WARNING"):
        plain = dict(R.Evaluator(base, model, tokenizer=tok).run(params))
    assert not any("pmrp" in k or "asp" in k for k in plain)
    assert sum("PMRP skipped" in r.message for r in caplog.records) == 1
    bad = write_instances(tmp_path / "instances_train2014.json", [1, 2], {})
    with pytest.raises(ValueError, match="instances_train2014.json.*image id 1000"):
        dict(R.Evaluator(dict(base, instances=str(bad)), model, tokenizer=tok).run(params))


# ---- CUB end to end and the eval configs ------------------------------------------------
def micro():
    from prolip_jax.core.models import ProLIP, abstract_params, get_config

    cfg = get_config("micro")
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: (0.3 * rng.standard_normal(a.shape)).astype(a.dtype),
                          abstract_params(cfg))
    tok = lambda texts: np.stack([np.resize(np.frombuffer(t.encode(), np.uint8).astype(np.int32)
                                            % 50 + 1, cfg.text.context_length) for t in texts])
    return ProLIP(cfg, attention_impl="xla"), params, tok


def write_cub(root):
    rng = np.random.default_rng(1)
    for cls, n in (("001.Black_footed_Albatross", 2), ("017.Cardinal", 3), ("020.Yellow_Warbler", 1)):
        (root / "images" / cls).mkdir(parents=True)
        (root / "text_c10" / cls).mkdir(parents=True)
        for k in range(n):
            Image.fromarray(rng.integers(0, 255, (18, 20, 3), np.uint8)).save(
                root / "images" / cls / f"{cls[4:]}_{k}.jpg")
            (root / "text_c10" / cls / f"{cls[4:]}_{k}.txt").write_text(
                "".join(f"a {cls[4:].lower()} bird {k} {j}\n" for j in range(3)))
    (root / "testclasses.txt").write_text("001.Black_footed_Albatross\n017.Cardinal\n")
    return root


def test_cub_config_end_to_end(tmp_path):
    sys_path_scripts()
    import evaluate

    root = write_cub(tmp_path)
    config = evaluate.load_config(str(ROOT / "configs/eval/cub.py"), [
        f"--config.root={root}", "--config.unc_bins=2"])
    ecfg = {k: v for k, v in config.evals.cub.to_dict().items() if k not in EVAL_KEYS}
    model, params, tok = micro()
    ev = R.Evaluator(ecfg, model, tokenizer=tok)
    res = dict(ev.run(params))
    data = ev.data()
    assert len(data) == 5 and len(data.captions) == 15       # 020 is not a test class
    assert data.info["class_ids"].tolist() == [0, 0, 16, 16, 16]  # NNN - 1, as PCME
    from prolip_jax.core.normalization import normalize
    images = np.concatenate([b["image"][b["mask"]] for b in data.batches(8, 16)])
    apply = lambda m, x: jax.jit(lambda p, x: model.apply({"params": p}, x, method=m))(params, x)
    i_mu, i_lv = (np.asarray(a, np.float64) for a in apply(model.encode_image, normalize(images)))
    t_mu, t_lv = (np.asarray(a, np.float64) for a in apply(model.encode_text, tok(data.captions)))
    cls_i, cls_t = data.info["class_ids"], data.info["class_ids"][data.caption_record]
    for d, s, qc, gc in (("i2t", i_mu @ t_mu.T - np.exp(t_lv).sum(1)[None] / 2, cls_i, cls_t),
                         ("t2i", t_mu @ i_mu.T - np.exp(i_lv).sum(1)[None] / 2, cls_t, cls_i)):
        order = np.argsort(-s, 1, kind="stable")
        hit = gc[order] == qc[:, None]                     # class-level positives
        r = hit.sum(1)
        rp = 100 * np.mean([h[:n].sum() / n for h, n in zip(hit, r)])
        assert res[f"retrieval/cub/csd/{d}_rprecision"] == pytest.approx(rp, abs=1e-6)
        assert res[f"retrieval/cub/csd/{d}_R@1"] == pytest.approx(100 * hit[:, 0].mean(), abs=1e-6)
    assert "retrieval/cub/csd/i2t/unc_rho_R1" in res
    assert not any("pmrp" in k or "asp" in k or "/1k/" in k for k in res)


def sys_path_scripts():
    import sys

    scripts = str(ROOT / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)


def test_coco_config_and_markdown():
    sys_path_scripts()
    import evaluate

    config = evaluate.load_config(str(ROOT / "configs/eval/coco.py"), [
        "--config.karpathy_json=/d/dataset_coco.json", "--config.image_root=/d",
        "--config.instances=/d/instances_val2014.json", "--config.asp=False"])
    ecfg = config.evals.coco
    assert (ecfg.type, ecfg.dataset, ecfg.num_folds, ecfg.fold_size) == ("retrieval", "karpathy", 5, 1000)
    assert ecfg.karpathy_json == "/d/dataset_coco.json" and ecfg.asp is False
    assert R.paths(ecfg.instances) == ("/d/instances_val2014.json",)
    assert R.paths("a.json, b.json") == ("a.json", "b.json") and R.paths("") == ()
    with pytest.raises(ValueError, match="instance"):
        evaluate.load_config(str(ROOT / "configs/eval/coco.py"), ["--config.instance=/x"])
    md = evaluate.markdown_table({"retrieval/coco/csd/5k/i2t_pmrp": 41.234567,
                                  "retrieval/coco/csd/5k/i2t/unc_rho_R1": -0.912345,
                                  "checkpoint/step": 7})
    assert md.splitlines() == ["| metric | value |", "|---|---:|",
                               "| retrieval/coco/csd/5k/i2t_pmrp | 41.23 |",
                               "| retrieval/coco/csd/5k/i2t/unc_rho_R1 | -0.9123 |",
                               "| checkpoint/step | 7 |"]
