"""evaluators/hierarcaps.py and its reader read_hierarcaps: traversal metrics on hand-built 2-D
embeddings, [ROOT] by inclusion against the paper's closed form, the CSV loader, end to end."""
from __future__ import annotations

import csv

import numpy as np
import pytest
from PIL import Image

from evaluators import hierarcaps as H


def unit(deg):
    a = np.deg2rad(np.atleast_1d(np.asarray(deg, np.float64)))
    return np.stack([np.cos(a), np.sin(a)], -1).astype(np.float32)


# Two images on the unit circle: img0 at 0 deg with captions (level 0..3) at 90, 60, 30, 5 deg;
# img1 at 180 deg with captions at 260, 240, 210, 185 deg; "" at 100 deg.
CAPTION_DEG = [90, 60, 30, 5, 260, 240, 210, 185]
CAPTIONS = ["object", "bird", "blue bird", "a blue bird on a branch",
            "sports", "kite surfing", "kite surfer on a board", "a kite surfer in the air"]


def hand_encodings():
    # Level-0 captions get log sigma^2 = -5, the rest 0; images 0. One-sided inclusion of an
    # image (sigma^2 = 1) in a caption, summed over 2 dims: 2 (-L - log(1 + e^-L / 2) / 2) -
    # |dmu|^2 / (1 + 2 e^L): L = -5: 5.68 - 0.987 |dmu|^2, L = 0: -0.41 - |dmu|^2 / 3.
    # img0: cap0 (90 deg, |dmu|^2 = 2) 3.71 beats cap4 (3.36) and its near captions (< 0);
    # img1: cap4 (260 deg, |dmu|^2 = 1.65) 4.05 beats cap0 (3.71).
    t_lv = np.zeros((8, 2), np.float32)
    t_lv[[0, 4]] = -5.0
    return {"image_mu": unit([0, 180]), "image_logvar": np.zeros((2, 2), np.float32),
            "text_mu": unit(CAPTION_DEG), "text_logvar": t_lv, "null_mu": unit(100)[0]}


def test_traversal_on_the_circle_by_hand():
    enc = hand_encodings()
    t = enc["text_mu"]
    start = H.nearest_caption(enc["image_mu"], t)
    np.testing.assert_array_equal(start, [3, 7])              # 5 deg and 185 deg
    np.testing.assert_array_equal(
        H.inclusion_root(enc["image_mu"], enc["image_logvar"], t, enc["text_logvar"]), [0, 4])
    # "" root at 100 deg: img0 sweeps 5 -> ~98 deg and meets 5, 30, 60, 90 (mid-points 17.5,
    # 45, 75); img1 sweeps 185 -> ~102 deg: 185 until 137.5 deg, then 90 (img0's level 0).
    root = H.make_root("null", enc["null_mu"], None, 2)
    preds = H.traverse(t[start], root, t, 50)
    assert preds.shape == (2, 50)
    assert set(preds[0]) == {0, 1, 2, 3} and set(preds[1]) == {7, 0}
    assert preds[0, 0] == 3 and preds[1, 0] == 7 and preds[0, -1] == 0   # start first, root-most last
    m = H.traversal_metrics(preds, np.arange(8), np.arange(8).reshape(2, 4))
    np.testing.assert_allclose(m["precision"], [1.0, 0.5])
    np.testing.assert_allclose(m["recall"], [1.0, 0.25])
    np.testing.assert_allclose(m["R@1"], [1.0, 1.0])
    np.testing.assert_allclose(m["level_recall"][1], [0, 0, 0, 1])
    # inclusion + "": normalise(u(90) + u(100)) = u(95); normalise(u(260) + u(100)) = u(180)
    r = H.make_root("inclusion+null", enc["null_mu"], t[[0, 4]], 2)
    np.testing.assert_allclose(r, unit([95, 180]), atol=1e-6)
    np.testing.assert_array_equal(H.nearest_caption(r, t), [0, 7])


def test_traversal_metrics_compare_strings():
    # captions 1 and 5 are the same text: retrieving 5 counts as retrieving 1
    ids = H.text_ids(["a", "b", "c", "d", "e", "b", "f", "g"])
    gts = ids.reshape(2, 4)
    m = H.traversal_metrics(np.array([[5, 5, 6], [4, 4, 4]]), ids, gts)
    np.testing.assert_allclose(m["precision"], [0.5, 1.0])   # {b, f}: b is GT; {e}
    np.testing.assert_allclose(m["recall"], [0.25, 0.25])
    np.testing.assert_allclose(m["num_predictions"], [2, 1])


def test_inclusion_root_matches_the_closed_form():
    """argmax_j sum_d inc(Z_i -> Z_j) with the paper's A, B, C form of eq. 3."""
    rng = np.random.default_rng(0)
    mu1, lv1 = rng.normal(size=(5, 6)), rng.normal(size=(5, 6)) - 2
    mu2, lv2 = rng.normal(size=(9, 6)), rng.normal(size=(9, 6)) - 1

    def inc(m1, l1, m2, l2):   # [N, M] sum over D of inc(Z1 -> Z2)
        s1, s2, m1, m2 = np.exp(l1)[:, None], np.exp(l2)[None], m1[:, None], m2[None]
        a = 1 / s1 + 1 / (2 * s2)
        b = 2 * m1 / s1 + m2 / s2
        c = m1 ** 2 / s1 + m2 ** 2 / (2 * s2)
        return (-2 * np.log(s1) - np.log(s2) - 0.5 * np.log(a) + b ** 2 / (4 * a) - c).sum(-1)

    f32 = [x.astype(np.float32) for x in (mu1, lv1, mu2, lv2)]
    np.testing.assert_array_equal(H.inclusion_root(*f32), inc(mu1, lv1, mu2, lv2).argmax(1))
    h = inc(mu1, lv1, mu2, lv2) - inc(mu2, lv2, mu1, lv1).T      # eq. 4
    np.testing.assert_array_equal(H.inclusion_root(*f32, kind="h"), h.argmax(1))
    with pytest.raises(ValueError, match="unknown inclusion"):
        H.inclusion_root(mu1, lv1, mu2, lv2, "kl")


# ------------------------------------------------------------------------------ loader
def write_hierarcaps(root, rows, image_names):
    root.mkdir(parents=True, exist_ok=True)
    (root / "images").mkdir(exist_ok=True)
    with open(root / "hierarcaps_test.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "captions", "image_url"])
        for i, (caps, url) in enumerate(rows):
            w.writerow([i, " => ".join(caps), url])
    rng = np.random.default_rng(0)
    for name in image_names:
        Image.fromarray(rng.integers(0, 255, (20, 24, 3), np.uint8)).save(root / "images" / name)
    return str(root / "hierarcaps_test.csv"), str(root / "images")


URL = "http://images.cocodataset.org/val2014/COCO_val2014_{:012d}.jpg"


def test_loader_format_and_errors(tmp_path):
    rows = [(CAPTIONS[:4], URL.format(301718)), (CAPTIONS[4:], URL.format(100489))]
    path, images = write_hierarcaps(tmp_path / "a", rows, ["COCO_val2014_000000301718.jpg",
                                                           "000000100489.jpg"])   # 2017 naming
    es = H.read_hierarcaps(path, images)
    assert len(es) == 2 and es.captions == CAPTIONS
    np.testing.assert_array_equal(es.caption_record, [0, 0, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(es.info["image_ids"], [301718, 100489])
    assert es.records[1]["key"].endswith("000000100489.jpg")
    assert len(H.read_hierarcaps(path, images, limit=1)) == 1
    # a caption with a comma survives the CSV quoting; three levels are refused
    bad, imgs = write_hierarcaps(tmp_path / "b", [(["a", "b, c", "d"], URL.format(1))],
                                 ["COCO_val2014_000000000001.jpg"])
    with pytest.raises(ValueError, match="3 caption levels"):
        H.read_hierarcaps(bad, imgs)
    miss, imgs = write_hierarcaps(tmp_path / "c", rows, ["COCO_val2014_000000301718.jpg"])
    with pytest.raises(FileNotFoundError, match="1 of 2 images"):
        H.read_hierarcaps(miss, imgs)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        H.read_hierarcaps(str(tmp_path / "nope.csv"), imgs)


# ------------------------------------------------------------------------------ evaluator
class WordTokenizer:
    """Word ids (3 + hash % 40) then pad 1, context 8: enough for a micro model."""

    def __call__(self, texts):
        out = np.ones((len(texts), 8), np.int32)
        for i, t in enumerate(texts):
            ids = [3 + sum(map(ord, w)) % 40 for w in t.split()][:7]
            out[i, :len(ids)] = ids
        return out


def test_evaluator_by_hand_and_end_to_end(micro, tmp_path):
    model, params = micro
    rows = [(CAPTIONS[:4], URL.format(1)), (CAPTIONS[4:], URL.format(2))]
    path, images = write_hierarcaps(tmp_path, rows, ["COCO_val2014_000000000001.jpg",
                                                     "COCO_val2014_000000000002.jpg"])
    cfg = dict(dataset="hierarcaps", csv=path, image_dir=images, batch_size=8,
               roots=("null", "inclusion", "inclusion+null"))
    ev = H.Evaluator(cfg, model, WordTokenizer())
    m = dict(ev.evaluate(hand_encodings()))
    p = "hierarcaps/hierarcaps"
    expected = {   # (precision, recall, R@1, R@1_root) in %, from the circle geometry above
        "null": (75.0, 62.5, 100.0, 50.0),               # "" -> img0's level 0 for both images
        "inclusion": (100.0, 100.0, 100.0, 100.0),        # img1 sweeps 185 -> ~258: 210, 240, 260
        "inclusion_null": (100.0, 62.5, 100.0, 100.0),    # img1's root u(180): stays at 185
    }
    for root, values in expected.items():
        got = tuple(m[f"{p}/{root}/{k}"] for k in ("precision", "recall", "R@1", "R@1_root"))
        assert got == pytest.approx(values), root
    assert [m[f"{p}/null/level{i}_recall"] for i in range(4)] == pytest.approx([50, 50, 50, 100])
    assert m[f"{p}/null/num_predictions"] == 3.0
    assert m[f"{p}/text_sigma2_trace_level0_mean"] == pytest.approx(2 * np.exp(-5.0), rel=1e-5)
    assert m[f"{p}/order_level1_gt_level2_rate"] == 0.0    # equal sigma^2: not ordered
    np.testing.assert_array_equal(ev.arrays["root_inclusion"], [0, 4])
    # end to end with a micro model: every number in range, defaults pick the two roots
    ev = H.Evaluator(dict(cfg, roots=None), model, WordTokenizer())
    res = dict(ev.run(params))
    assert {k.split("/")[2] for k in res if k.count("/") == 3} == {"null", "inclusion_null"}
    for k, v in res.items():
        if k.endswith(("precision", "recall", "R@1", "R@1_root")):
            assert 0.0 <= v <= 100.0, k
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bogus'\]"):
        H.Evaluator(dict(cfg, bogus=1), model, WordTokenizer())
    with pytest.raises(ValueError, match="needs 'csv'"):
        H.Evaluator(dict(dataset="hierarcaps"), model, WordTokenizer())
