"""Demo dataset: deterministic, the right splits and captions, atomic cache, real pipeline."""
import colorsys
import os

import grain
import numpy as np
import pytest

from input_pipeline import demo, pipeline
from input_pipeline.demo import render
from input_pipeline.records import decode_record

TINY = dict(image_size=32, num_train=64, num_zeroshot=72, num_retrieval=40, num_levels=12,
            seed=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return demo.get_demo(cache_dir=str(tmp_path_factory.mktemp("demo")), **TINY)


def _records(ds, split):
    src = grain.sources.ArrayRecordDataSource([ds.split_path(split)])
    return [src[i] for i in range(len(src))]


def test_deterministic_from_seed(tiny, tmp_path):
    again = demo.get_demo(cache_dir=str(tmp_path), **TINY)
    other = demo.get_demo(cache_dir=str(tmp_path), **{**TINY, "seed": 4})
    for split in demo.SPLITS:
        assert _records(tiny, split) == _records(again, split)   # byte-identical
    assert _records(tiny, "train") != _records(other, "train")
    assert again.root != other.root   # one cache folder per configuration


def test_splits_sizes_and_captions(tiny):
    for split in demo.SPLITS:
        assert len(_records(tiny, split)) == TINY[f"num_{split}"]
        assert tiny.meta["splits"][split]["num_records"] == TINY[f"num_{split}"]
    train = [decode_record(r) for r in _records(tiny, "train")]
    for rec in train:   # four levels, general -> specific, each containing the previous words
        levels = rec["txt"]
        assert len(levels) == 4 and levels[0] == "a shape"
        f = rec["meta"]
        assert levels[1] == f"a {render.SHAPES[f['shape']]}"
        assert levels[2] == f"a {render.COLOUR_NAMES[f['colour']]} {render.SHAPES[f['shape']]}"
        assert levels[3] == (f"a {render.SIZE_NAMES[f['size']]} {levels[2][2:]} "
                             f"{render.POSITION_NAMES[f['position']]}")
    retrieval = [decode_record(r)["txt"] for r in _records(tiny, "retrieval")]
    assert len(set(retrieval)) == len(retrieval)   # exactly one image per caption
    zs = [decode_record(r) for r in _records(tiny, "zeroshot")]
    names = tiny.zeroshot_tasks["object"]["classnames"]
    assert len(names) == 36 and np.bincount([r["meta"]["label"] for r in zs]).tolist() == [2] * 36
    for r in zs:
        assert r["txt"] == f"a {names[r['meta']['label']]}"
    assert all(len(decode_record(r)["txt"]) == 4 for r in _records(tiny, "levels"))


def test_images_show_the_captioned_colour_and_position(tiny):
    for rec in map(decode_record, _records(tiny, "train")[:40]):
        image = np.asarray(demo.dataset.load_rgb(rec["image"], 1 << 30, 1), np.float32) / 255
        sat = image.max(-1) - image.min(-1)           # the background is grey: sat = 0
        ys, xs = np.nonzero(sat > 0.5)
        assert len(ys) > 10
        hue = colorsys.rgb_to_hsv(*image[ys, xs].mean(0))[0] * 360
        target = render.COLOURS[render.COLOUR_NAMES[rec["meta"]["colour"]]]
        assert min(abs(hue - target), 360 - abs(hue - target)) < 20
        row, col = divmod(rec["meta"]["position"], 3)
        cy, cx = ys.mean() / image.shape[0], xs.mean() / image.shape[1]
        assert abs(cy - (0.28, 0.5, 0.72)[row]) < 0.12 and abs(cx - (0.28, 0.5, 0.72)[col]) < 0.12


def test_tokenizer(tiny):
    tok = tiny.tokenizer()
    ids = tok(["a small red circle in the top left", "A RED, circle!", "a purple blob"])
    assert ids.shape == (3, 16) and ids.dtype == np.int32
    assert (tok.pad_id, tok.eos_id, tok.mask_id) == (1, 1, 2)
    assert ids[0, 8] == tok.eos_id and ids[0, :8].min() > 2 and (ids[0, 9:] == 1).all()
    np.testing.assert_array_equal(ids[1, :4], tok(["a red circle"])[0, :4])   # normalised
    assert ids[2, 1] == 0 and ids[2, 2] == 0                                   # <unk>
    assert tok.decode(ids[0]) == "a small red circle in the top left"
    assert (tok(["a " * 40])[0, -1]) == tok.eos_id   # truncation keeps the EOS
    vocab = tiny.meta["tokenizer"]["vocab"]
    assert tok.vocab_size == len(vocab) and vocab[2] == "[MASK]"
    for split in ("zeroshot", "levels"):   # every caption is in-vocabulary
        ev = tiny.load_split(split)
        assert (ev["text"] > 2).sum() == sum(len(c.split()) for c in ev["captions"].ravel())


def test_load_split_arrays(tiny):
    ev = tiny.load_split("levels", image_size=24, normalization="0.5")
    n = TINY["num_levels"]
    assert ev["image"].shape == (n, 24, 24, 3) and ev["image"].dtype == np.float32
    assert -1 <= ev["image"].min() and ev["image"].max() <= 1
    assert ev["captions"].shape == (n, 4) and ev["text"].shape == (n, 4, 16)
    zs = tiny.load_split("zeroshot", image_dtype="uint8")
    assert zs["image"].dtype == np.uint8 and zs["label"].shape == (TINY["num_zeroshot"],)
    np.testing.assert_array_equal(zs["label"], zs["colour"] * 6 + zs["shape"])


def test_demo_through_the_real_pipeline(tiny):
    cfg = dict(source="demo", demo=dict(cache_dir=str(tiny.root.parent), **TINY),
               batch_size=16, image_size=32, seed=1)
    it = pipeline.build_train_iterator(cfg, process_index=0, process_count=1)
    batches = [next(it) for _ in range(8)]   # two epochs of 64
    assert batches[0]["image"].shape == (16, 32, 32, 3) and batches[0]["text"].shape == (16, 16)
    tok = tiny.tokenizer()
    captions = {tok.decode(row) for b in batches for row in b["text"]}
    assert "a shape" in captions and any(len(c.split()) >= 7 for c in captions)
    ev = pipeline.build_eval_iterator({**cfg, "demo": {**cfg["demo"], "split": "zeroshot"}},
                                      process_index=0, process_count=1)
    labels = np.concatenate([b["label"][b["mask"]] for b in ev])
    assert sorted(labels.tolist()) == sorted(list(range(36)) * 2)


def test_cache_is_atomic_and_reused(tiny, tmp_path, monkeypatch):
    meta = tiny.root / "meta.json"
    mtime = os.path.getmtime(meta)
    assert demo.get_demo(cache_dir=str(tiny.root.parent), **TINY).root == tiny.root
    assert os.path.getmtime(meta) == mtime   # loaded, not regenerated
    # A generation that dies half-way leaves no folder that looks complete.
    calls = {"n": 0}
    real = demo.dataset._make_records

    def dying(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("killed")
        return real(*args)
    monkeypatch.setattr(demo.dataset, "_make_records", dying)
    with pytest.raises(RuntimeError, match="killed"):
        demo.get_demo(cache_dir=str(tmp_path), num_workers=0, **{**TINY, "num_train": 2500})
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(demo.dataset, "_make_records", real)
    ds = demo.get_demo(cache_dir=str(tmp_path), **TINY)
    assert sorted(os.listdir(tmp_path)) == [ds.root.name]


def test_config_validation():
    with pytest.raises(ValueError, match="num_retrieval"):
        demo.DemoConfig(num_retrieval=1000)
    with pytest.raises(ValueError, match="level_weights"):
        demo.DemoConfig(level_weights=(0, 0, 0, 0))
