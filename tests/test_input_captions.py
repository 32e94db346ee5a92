"""Caption training sources (input_pipeline/captions.py): COCO / Flickr30K Karpathy files and
the CUB tree, built tiny in tmp_path. Every caption starts with its global number, so the
tokenizer stand-in's first token tells which caption a row holds."""
import csv
import json

import numpy as np
import pytest
from PIL import Image

from input_pipeline import captions, pipeline
from input_pipeline.config import DataConfig
from input_pipeline.sources import captions as caption_sources


class CaptionTokenizer:
    """row = [caption number, 1, 1, 1]."""
    context_length, vocab_size, pad_id, eos_id = 4, 1 << 30, 1, 1

    def __call__(self, texts):
        out = np.ones((len(texts), 4), np.int32)
        out[:, 0] = [int(t.split()[0]) for t in texts]
        return out


TOK = CaptionTokenizer()


def _image(path, seed):
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (16, 16, 3), np.uint8)).save(path)


def write_coco(root, splits=("train",) * 6 + ("restval",) * 2 + ("val", "test"), extra=True):
    """Karpathy dataset_coco.json; image i has 5 captions (image 0 a 6th, beyond the 5 kept)."""
    images, number = [], 0
    for i, split in enumerate(splits):
        folder = "val2014" if split != "train" else "train2014"
        fn = f"COCO_{folder}_{i:012d}.jpg"
        _image(root / folder / fn, i)
        k = 6 if (i == 0 and extra) else 5
        sents = [{"raw": f"{number + j} a thing number {i}", "tokens": []} for j in range(k)]
        number += k
        images.append({"filepath": folder, "filename": fn, "split": split, "cocoid": 500 + i,
                       "imgid": i, "sentences": sents})
    path = root / "dataset_coco.json"
    path.write_text(json.dumps({"dataset": "coco", "images": images}))
    return path


def write_flickr(root, n=6):
    images = []
    for i in range(n):
        fn = f"{1000 + i}.jpg"
        _image(root / "flickr30k-images" / fn, 100 + i)
        images.append({"filename": fn, "imgid": i, "split": "train" if i < n - 1 else "test",
                       "sentences": [{"raw": f"{5 * i + j} a person {i}"} for j in range(5)]})
    path = root / "dataset_flickr30k.json"
    path.write_text(json.dumps({"dataset": "flickr30k", "images": images}))
    return path


CUB_CLASSES = {"001.Black_footed_Albatross": 3, "002.Laysan_Albatross": 2,
               "004.Groove_billed_Ani": 3, "003.Sooty_Albatross": 2}


def write_cub(root):
    """4 classes (the first 3 trainval, 003 test), 2-3 images each, 10 captions per image."""
    number = 0
    for c, (cls, n) in enumerate(sorted(CUB_CLASSES.items())):
        for i in range(n):
            stem = f"{cls.split('.')[1]}_{i:04d}_{c}"
            _image(root / "images" / cls / f"{stem}.jpg", 10 * c + i)
            (root / "text_c10" / cls).mkdir(parents=True, exist_ok=True)
            lines = [f"{number + j} this bird {cls} {i}" for j in range(10)]
            number += 10
            (root / "text_c10" / cls / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    trainval = [c for c in CUB_CLASSES if not c.startswith("003")]
    (root / "trainvalclasses.txt").write_text("\n".join(trainval) + "\n")
    (root / "testclasses.txt").write_text("003.Sooty_Albatross\n")
    return root


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    root = tmp_path_factory.mktemp("coco")
    return str(write_coco(root)), str(root)


@pytest.fixture(scope="module")
def cub(tmp_path_factory):
    return str(write_cub(tmp_path_factory.mktemp("cub")))


def _cfg(source, **kw):
    cfg = dict(source=source, batch_size=8, image_size=16, seed=0, read_threads=1)
    cfg.update(kw)
    return cfg


def _coco_cfg(coco, **kw):
    return _cfg("coco_karpathy", caption_file=coco[0], image_root=coco[1], **kw)


def _it(cfg):
    return pipeline.build_train_iterator(cfg, TOK, process_index=0, process_count=1)


def _take(it, n):
    return [next(it) for _ in range(n)]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=k)


def _epoch(cfg):
    """All batches of one epoch."""
    return list(_it(dict(cfg, num_epochs=1)))


# ------------------------------------------------------------------------------ counts, ids
def test_coco_counts_and_image_ids(coco):
    index = caption_sources.load_index(DataConfig.from_mapping(_coco_cfg(coco)))
    # train + restval = 8 images; 5 captions each (image 0's 6th is left out by default)
    assert index.num_images == 8 and index.num_pairs == 40
    assert index.image_ids.tolist() == list(range(500, 508))
    assert caption_sources.load_index(DataConfig.from_mapping(
        _coco_cfg(coco, captions_per_image=0))).num_pairs == 41
    assert caption_sources.load_index(DataConfig.from_mapping(
        _coco_cfg(coco, splits=("test",)))).image_ids.tolist() == [509]
    # per_caption: one epoch holds every pair once; image_id = the caption's image's cocoid
    batches = _epoch(_coco_cfg(coco))
    assert len(batches) == 5
    caps = np.concatenate([b["text"][:, 0] for b in batches])
    ids = np.concatenate([b["image_id"] for b in batches])
    assert all(b["image_id"].dtype == np.int32 for b in batches)
    kept = [n for i in range(8) for n in range(i * 5 + (i > 0), i * 5 + (i > 0) + 5)]
    assert sorted(caps.tolist()) == kept
    want = {n: 500 + i for i in range(8) for n in range(i * 5 + (i > 0), i * 5 + (i > 0) + 5)}
    assert [want[c] for c in caps] == ids.tolist()
    # per_image: one record per image per epoch
    batches = _epoch(_coco_cfg(coco, caption_iteration="per_image"))
    ids = np.concatenate([b["image_id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(500, 508))


def test_flickr_counts(tmp_path):
    path = write_flickr(tmp_path)
    cfg = _cfg("flickr30k", caption_file=str(path), image_root=str(tmp_path / "flickr30k-images"),
               batch_size=5)
    batches = _epoch(cfg)
    caps = np.concatenate([b["text"][:, 0] for b in batches]).tolist()
    assert sorted(caps) == list(range(25))   # 5 train images x 5 captions
    ids = np.concatenate([b["image_id"] for b in batches]).tolist()
    assert ids == [c // 5 for c in caps]     # imgid


def test_cub_class_and_image_positives(cub):
    cfg = _cfg("cub", image_root=cub, batch_size=10)
    index = caption_sources.load_index(DataConfig.from_mapping(cfg))
    assert index.num_images == 8 and index.num_pairs == 80   # classes 001, 002, 004
    assert sorted(set(index.class_ids.tolist())) == [0, 1, 3]   # NNN - 1, as PCME
    number_to_class = {n: int(cls[:3]) - 1 for n, cls in _cub_numbers()}
    for level in ("image", "class"):
        batches = _epoch(dict(cfg, positive_level=level))
        caps = np.concatenate([b["text"][:, 0] for b in batches])
        ids = np.concatenate([b["image_id"] for b in batches])
        assert sorted(caps.tolist()) == sorted(n for n, c in _cub_numbers() if c[:3] != "003")
        if level == "class":
            assert ids.tolist() == [number_to_class[c] for c in caps]
        else:   # image ids: equal exactly for the captions of one image (10 per image)
            same = (caps[:, None] // 10) == (caps[None, :] // 10)
            np.testing.assert_array_equal(ids[:, None] == ids[None, :], same)
    test = caption_sources.load_index(DataConfig.from_mapping(dict(cfg, splits=("test",))))
    assert test.num_images == 2 and set(test.class_ids.tolist()) == {2}


def _cub_numbers():
    """(caption number, class) of the CUB tree written by write_cub."""
    out, number = [], 0
    for cls, n in sorted(CUB_CLASSES.items()):
        for _ in range(n):
            out += [(number + j, cls) for j in range(10)]
            number += 10
    return out


def test_positive_matrix_from_a_batch_has_the_block_structure(coco, cub):
    from prolip_jax.core.targets import positive_matrix

    # one batch = the whole epoch of 40 pairs: every image's 5 captions are in it
    (batch,) = _epoch(_coco_cfg(coco, batch_size=40))
    pos = np.asarray(positive_matrix(batch["text"], batch["image_id"], "image_id"))
    caps = batch["text"][:, 0]
    image_of = {n: i for i in range(8) for n in range(i * 5 + (i > 0), i * 5 + (i > 0) + 5)}
    img = np.array([image_of[c] for c in caps])
    np.testing.assert_array_equal(pos, (img[:, None] == img[None, :]).astype(np.float32))
    order = np.argsort(img, kind="stable")   # sorted by image: 8 blocks of 5 x 5 ones
    np.testing.assert_array_equal(pos[np.ix_(order, order)], np.kron(np.eye(8), np.ones((5, 5))))
    # cub, class level: blocks of a class's pairs (30, 20, 30)
    (batch,) = _epoch(_cfg("cub", image_root=cub, batch_size=80, positive_level="class"))
    pos = np.asarray(positive_matrix(batch["text"], batch["image_id"], "image_id"))
    cls = batch["image_id"]
    order = np.argsort(cls, kind="stable")
    blocks = [np.ones((n, n)) for n in (30, 20, 30)]
    want = np.block([[blocks[i] if i == j else np.zeros((len(blocks[i]), len(blocks[j])))
                      for j in range(3)] for i in range(3)])
    np.testing.assert_array_equal(pos[np.ix_(order, order)], want)


# ------------------------------------------------------------------------------ order, resume
@pytest.mark.parametrize("iteration", ["per_caption", "per_image"])
def test_deterministic_and_exact_resume(coco, iteration):
    cfg = _coco_cfg(coco, caption_iteration=iteration, noise_ratio=0.2)
    _same(_take(_it(cfg), 6), _take(_it(cfg), 6))
    for skip in (3, 7):   # per_image: 1 batch per epoch; per_caption: 5
        it = _it(cfg)
        _take(it, skip)
        state = json.loads(json.dumps(it.get_state()))
        expected = _take(it, 4)
        resumed = _it(cfg)
        resumed.set_state(state)
        _same(expected, _take(resumed, 4))
    other = _it(dict(cfg, noise_seed=1))
    with pytest.raises(ValueError, match=r"settings are not those of the run being resumed "
                                         r"\(noise_seed: saved 0, now 1\)"):
        other.set_state(state)


def test_per_image_draws_vary_over_epochs_and_repeat_across_runs(coco):
    cfg = _coco_cfg(coco, caption_iteration="per_image")   # 8 images = 1 batch per epoch

    def draws():
        out = {}
        for b in _take(_it(cfg), 6):
            for i, c in zip(b["image_id"], b["text"][:, 0]):
                out.setdefault(int(i), []).append(int(c))
        return out

    a = draws()
    assert a == draws()
    assert all(len(v) == 6 for v in a.values())
    assert all(len(set(v)) > 1 for v in a.values())   # 5 captions, 6 epochs: not all equal
    for i, v in a.items():   # every draw is one of the image's own captions
        base = (i - 500) * 5 + (i > 500)
        assert all(base <= c < base + 5 for c in v)


# ------------------------------------------------------------------------------ noise
def test_noise_corrupts_exactly_and_is_written(coco, tmp_path):
    cfg = DataConfig.from_mapping(_coco_cfg(coco, noise_ratio=0.5, noise_seed=3))
    index = caption_sources.load_index(cfg)
    assert len(index.noisy) == round(0.5 * 40) == 20
    changed = np.flatnonzero(index.pair_caption != np.arange(40))
    np.testing.assert_array_equal(changed, index.noisy)
    # the captions are shuffled among the chosen pairs: the same multiset
    assert sorted(index.pair_caption[index.noisy].tolist()) == index.noisy.tolist()
    again = caption_sources.load_index(cfg)
    np.testing.assert_array_equal(again.pair_caption, index.pair_caption)
    other = caption_sources.load_index(cfg.replace(noise_seed=4))
    assert other.noisy.tolist() != index.noisy.tolist()
    assert len(caption_sources.load_index(cfg.replace(noise_ratio=0.2)).noisy) == 8

    path = captions.write_noisy_pairs(index, tmp_path / "noisy_pairs.json")
    doc = json.loads(open(path).read())
    assert doc["num_corrupted"] == 20 and doc["num_pairs"] == 40 and doc["noise_ratio"] == 0.5
    assert [p["index"] for p in doc["pairs"]] == index.noisy.tolist()
    for p in doc["pairs"]:
        assert p["original_caption"] == index.captions[p["index"]]
        assert p["new_caption"] == index.captions[p["new_caption_index"]]
        assert p["new_caption"] != p["original_caption"]
        assert p["image_id"] == 500 + index.pair_image[p["index"]]
    assert not list(tmp_path.glob("*.tmp.*"))   # written atomically, nothing left over
    with open(captions.write_noisy_pairs(index, tmp_path / "noisy.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["index"]) for r in rows] == index.noisy.tolist()

    # the batches carry the shuffled captions with the pair's own image id
    batches = _epoch(_coco_cfg(coco, noise_ratio=0.5, noise_seed=3))
    got = {int(c): int(i) for b in batches for c, i in zip(b["text"][:, 0], b["image_id"])}
    noisy = {p["new_caption_index"]: p for p in doc["pairs"]}
    numbers = [int(c.split()[0]) for c in index.captions]
    for q, p in noisy.items():
        assert got[numbers[q]] == p["image_id"]


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("field,value,match", [
    ("splits", ("train", "holdout"), "data.splits: unknown split 'holdout'"),
    ("noise_ratio", 1.0, "data.noise_ratio"),
    ("noise_ratio", -0.1, "data.noise_ratio"),
    ("caption_iteration", "per_word", "data.caption_iteration"),
    ("positive_level", "class", "data.positive_level"),   # coco has no classes
])
def test_config_errors_name_the_field(coco, field, value, match):
    with pytest.raises(ValueError, match=match):
        DataConfig.from_mapping(_coco_cfg(coco, **{field: value})).check_source()


def test_config_needs_the_files():
    with pytest.raises(ValueError, match="data.caption_file"):
        DataConfig.from_mapping(_cfg("flickr30k", image_root="/x")).check_source()
    with pytest.raises(ValueError, match="data.image_root"):
        DataConfig.from_mapping(_cfg("cub")).check_source()
    assert DataConfig.from_mapping(_cfg("cub", image_root="/x", splits="train1,val1")).splits == (
        "train1", "val1")


def test_karpathy_annotation_errors_name_file_and_entry(tmp_path):
    path = write_coco(tmp_path, splits=("train", "train", "test"))
    cfg = _cfg("coco_karpathy", caption_file=str(path), image_root=str(tmp_path))
    with pytest.raises(ValueError, match=r"no images with split 'val' in .*dataset_coco.json"):
        _it(dict(cfg, splits=("val",)))
    doc = json.loads(path.read_text())
    doc["images"][1]["sentences"] = []
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"dataset_coco.json.*COCO_train2014_000000000001.jpg.*no "
                                         r"captions"):
        _it(cfg)
    del doc["images"][1]["sentences"]
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=r"dataset_coco.json entry 1 lacks"):
        _it(cfg)
    with pytest.raises(FileNotFoundError, match="nothere.json"):
        _it(dict(cfg, caption_file=str(tmp_path / "nothere.json")))


def test_missing_images_are_skipped_and_counted_or_an_error_if_all(tmp_path):
    path = write_coco(tmp_path, extra=False)
    (tmp_path / "train2014" / "COCO_train2014_000000000002.jpg").unlink()
    cfg = _cfg("coco_karpathy", caption_file=str(path), image_root=str(tmp_path))
    it = _it(dict(cfg, num_epochs=1))
    batches = list(it)
    assert it.stats["skipped/missing_image"] == 5   # the image's 5 pairs
    assert 502 not in np.concatenate([b["image_id"] for b in batches])
    assert len(batches) == 35 // 8
    # a wrong image_root: nothing sampled exists -> an error naming an entry
    (tmp_path / "elsewhere").mkdir()
    with pytest.raises(FileNotFoundError, match=r"data.image_root .*COCO_train2014_000000000000"):
        _it(dict(cfg, image_root=str(tmp_path / "elsewhere")))
    # images gathered in one folder (image_root/filename) are found too
    assert next(_it(dict(cfg, image_root=str(tmp_path / "train2014"))))["image"].shape[0] == 8


def test_cub_errors_name_file_and_entry(tmp_path):
    root = write_cub(tmp_path)
    cfg = _cfg("cub", image_root=str(root))
    with open(root / "trainvalclasses.txt", "a") as f:
        f.write("005.Crested_Auklet\n")
    with pytest.raises(FileNotFoundError, match=r"trainvalclasses.txt: class '005.Crested_Auklet' "
                                                r"has no image folder"):
        _it(cfg)
    _it(dict(cfg, splits=("test",)))   # the test split is fine
    stray = root / "text_c10" / "003.Sooty_Albatross" / "Sooty_Albatross_0099_2.txt"
    stray.write_text("1 a bird\n")
    with pytest.raises(ValueError, match="Sooty_Albatross_0099_2.txt has no matching image"):
        _it(dict(cfg, splits=("test",)))
    stray.unlink()
    (root / "text_c10" / "003.Sooty_Albatross" / "Sooty_Albatross_0000_2.txt").write_text("\n")
    with pytest.raises(ValueError, match="Sooty_Albatross_0000_2.txt holds no caption"):
        _it(dict(cfg, splits=("test",)))
    with pytest.raises(FileNotFoundError, match="val1classes.txt"):
        _it(dict(cfg, splits=("val1",)))


# ------------------------------------------------------------------------------ the trainer's data
@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A word-level SentencePiece model over the captions' words: <pad> 0, </s> 1, <unk> 2,
    [MASK] 3 (vocabulary <= the micro model's 64)."""
    import sentencepiece as spm

    tmp = tmp_path_factory.mktemp("spm")
    words = ["a", "thing", "number", "this", "bird", "person"] + [str(i) for i in range(40)]
    rng = np.random.default_rng(0)
    (tmp / "corpus.txt").write_text("\n".join(" ".join(rng.choice(words, 5)) for _ in range(300)))
    spm.SentencePieceTrainer.train(
        input=str(tmp / "corpus.txt"), model_prefix=str(tmp / "tok"), model_type="word",
        vocab_size=56, hard_vocab_limit=False, pad_id=0, eos_id=1, unk_id=2, bos_id=-1,
        user_defined_symbols=["[MASK]"], minloglevel=2, num_threads=1)
    return str(tmp / "tok.model")


class _Stop(Exception):
    pass


def test_trainer_feeds_image_id_and_writes_the_noisy_pairs(coco, spm_model, tmp_path, monkeypatch):
    """The trainer's own path (configs/tiny.py + overrides -> build_train_data -> train()):
    image_id reaches the device batch, and <workdir>/noisy_pairs.json is written before the
    checkpoint manager starts (train() is stopped there: no step is compiled)."""
    from prolip_jax.core import sharding
    from prolip_jax import train
    from prolip_jax.trainer import build as trainer_build, checkpoints as trainer_checkpoints, config as trainer_config
    from prolip_jax.trainer.data import build_train_data

    args = ["prolip_jax.train", "--config", "configs/tiny.py:size=micro", "--workdir", str(tmp_path / "w"),
            "--config.data.source=coco_karpathy", f"--config.data.caption_file={coco[0]}",
            f"--config.data.image_root={coco[1]}", "--config.data.noise_ratio=0.25",
            f"--config.data.tokenizer.path={spm_model}",
            "--config.targets.positives=image_id", "--config.masking.mask_token_id=3"]
    config, fv = train.parse_command_line(args)
    tc = trainer_config.parse_config(config)
    data = build_train_data(tc, trainer_build.model_config(tc), trainer_build.step_config(tc))
    batch = next(data.batches)
    assert batch["image_id"].shape == (16,) and set(batch["image_id"].tolist()) <= set(range(500, 508))
    mesh = sharding.make_mesh(config.mesh.shape, config.mesh.axes)
    glob = sharding.global_batch(batch, mesh)
    np.testing.assert_array_equal(np.asarray(glob["image_id"]), batch["image_id"])
    data.batches.close()

    def stop(*a, **k):
        raise _Stop
    monkeypatch.setattr(trainer_checkpoints.ocp, "CheckpointManager", stop)
    with pytest.raises(_Stop):
        train.train(config, fv.workdir)
    doc = json.loads((tmp_path / "w" / "noisy_pairs.json").read_text())
    assert doc["num_corrupted"] == 10 and doc["num_pairs"] == 40
