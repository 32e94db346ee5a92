"""DataComp 38-task suite (evaluators/suite.py): the shipped task table, the metrics against
hand-computed examples, and the suite end to end on generated data laid out like each source
kind (ImageFolder, clip_benchmark webdataset, Karpathy retrieval; tfds when installed) with the
micro model and a stand-in tokenizer: skip reasons, label mismatches, tables, averages."""
import configparser
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from evaluators import suite, zeroshot as zs

ROOT = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------- the table
def test_task_table_matches_datacomp():
    tasks = suite.load_tasks()
    assert len(tasks) == 38 and len({t["id"] for t in tasks}) == 38
    groups = {g: sum(t["group"] == g for t in tasks) for g in suite.GROUPS}
    assert groups == {"imagenet": 1, "dist_shift": 6, "vtab": 13, "retrieval": 3, "other": 15}
    metric = {t["datacomp_key"]: t["metric"] for t in tasks}
    recall = {k for k, m in metric.items() if m == "mean_per_class_recall"}
    assert recall == {"vtab/caltech101", "fgvc_aircraft", "vtab/flowers", "vtab/pets"}
    assert metric["retrieval/mscoco_2014_5k_test_image_text_retrieval"] == "mean_recall@1"
    assert metric["wilds/iwildcam"] == "f1_macro" and metric["fairness/dollar_street"] == "worst_group_top5"
    sizes = {"imagenet1k": 1000, "imagenet-a": 200, "imagenet-r": 200, "imagenet-o": 200,
             "caltech101": 102, "cifar100": 100, "sun397": 397, "cars": 196, "country211": 211,
             "fgvc_aircraft": 100, "flowers": 102, "pets": 37, "clevr_count_all": 8, "gtsrb": 43}
    by_id = {t["id"]: t for t in tasks}
    for tid, n in sizes.items():
        assert len(suite.shipped_classnames(by_id[tid]["classnames"])) == n, tid
    # ImageNet-A's names are ImageNet's, masked in ImageNet (= sorted wnid) order
    a = suite.shipped_classnames("imagenet-a")
    first = suite.imagenet_wnids().index(suite.imagenet_wnids("imagenet-a")[0])
    assert a[0] == zs.imagenet_classnames()[first] and len(set(a)) == 200
    for t in tasks:
        if t["kind"] == "classification":
            tpl = suite.shipped_templates(t.get("templates"))
            assert tpl and all(x.count("{}") == 1 and "{c}" not in x for x in tpl), t["id"]
    assert suite.wds_folder(by_id["pets"]) == "wds_vtab-pets_test"
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "data/*.json" in cfg["options.package_data"]["evaluators"]


# ----------------------------------------------------------------------------- metrics by hand
def test_metrics_by_hand():
    labels = np.array([0, 0, 0, 0, 1, 1, 2])
    pred = np.array([0, 0, 0, 1, 1, 0, 1])
    # recall: class 0 3/4, class 1 1/2, class 2 0/1 -> (0.75 + 0.5 + 0) / 3, in %
    assert zs.mean_per_class_recall(pred, labels) == pytest.approx(100 * 1.25 / 3)
    # F1: class 0 p=3/4 r=3/4 -> .75; class 1 p=1/3 r=1/2 -> 0.4; class 2 p=0 r=0 -> 0
    assert zs.macro_f1(pred, labels) == pytest.approx(100 * (0.75 + 0.4 + 0) / 3)
    correct = pred == labels
    groups = np.array([0, 0, 1, 1, 1, 2, 2])   # group accs 1, 2/3, 0
    assert zs.worst_group_accuracy(correct, groups) == 0.0
    assert zs.worst_group_accuracy(correct, groups, exclude=[2]) == pytest.approx(100 * 2 / 3)
    m = {"retrieval/x/csd/i2t_R@1": 50.0, "retrieval/x/csd/t2i_R@1": 30.0, "retrieval/x/csd/i2t_R@5": 99.0}
    assert suite.retrieval_metric(m, "csd") == pytest.approx(40.0)
    assert suite.retrieval_metric({"retrieval/c/csd/5k/i2t_R@1": 10.0, "retrieval/c/csd/5k/t2i_R@1": 20.0,
                                   "retrieval/c/csd/1k/i2t_R@1": 90.0}, "csd") == pytest.approx(15.0)
    rows = [dict(group="vtab", value=0.5), dict(group="vtab", value=0.25),
            dict(group="imagenet", value=0.9), dict(group="other", value=None, skipped="no data")]
    avg = suite.averages(rows)
    assert avg["average"] == pytest.approx(1.65 / 3) and avg["num_tasks"] == 3 and avg["num_skipped"] == 1
    assert avg["vtab/average"] == pytest.approx(0.375) and avg["retrieval/average"] is None


# ----------------------------------------------------------------------------- generated data
def _png(rng, size=12) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _folder(root: Path, classes, per=2, rng=None):
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(per):
            (root / c / f"{i}.png").write_bytes(_png(rng))


def _wds(folder: Path, samples, classnames=None, templates=None, kind=None):
    """samples: dicts of extension -> bytes; written as test/0.tar + nshards.txt."""
    (folder / "test").mkdir(parents=True)
    (folder / "test" / "nshards.txt").write_text("1")
    with tarfile.open(folder / "test" / "0.tar", "w") as tf:
        for i, s in enumerate(samples):
            for ext, data in s.items():
                info = tarfile.TarInfo(f"s{i:04d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    if classnames:
        (folder / "classnames.txt").write_text("\n".join(classnames) + "\n")
    if templates:
        (folder / "zeroshot_classification_templates.txt").write_text("\n".join(templates) + "\n")
    if kind:
        (folder / "dataset_type.txt").write_text(kind)


def _npy(row) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(row, np.int64))
    return buf.getvalue()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    d = tmp_path_factory.mktemp("suite")
    _folder(d / "cifar10" / "test", ["airplane", "cat"], rng=rng)        # named like the classes
    _folder(d / "imagenet-a" / "test", ["n01498041", "n12267677"], rng=rng)   # wnids of A
    _folder(d / "mnist" / "test", ["a", "b", "c"], rng=rng)              # 3 folders, 10 names
    _folder(d / "objectnet" / "test", ["chair"], rng=rng)                # no names shipped
    _wds(d / "wds_vtab-pets_test", [{"png": _png(rng), "cls": str(i % 3).encode()} for i in range(5)],
         ["cat", "dog", "hamster"], ["a photo of a {c}.", "a {c}."])
    _wds(d / "wds_gtsrb_test", [{"png": _png(rng), "cls": b"5"}], ["stop", "go"])   # label 5 of 2
    _wds(d / "wds_wilds-fmow_test", [{"jpg": _png(rng), "cls": str(i % 2).encode(), "npy": _npy([i % 3, 0, i % 2])}
                                     for i in range(6)], ["airport", "farm"])
    meta = {"dataset": "flickr30k", "images": [
        {"filename": f"{i}.png", "split": "test", "sentences": [{"raw": f"picture {i} {j}"} for j in range(2)]}
        for i in range(3)]}
    (d / "flickr30k" / "images").mkdir(parents=True)
    for i in range(3):
        (d / "flickr30k" / "images" / f"{i}.png").write_bytes(_png(rng))
    (d / "flickr30k" / "dataset_flickr30k.json").write_text(json.dumps(meta))
    return d


def test_webdataset_loader(data_dir):
    es = suite.webdataset(str(data_dir / "wds_wilds-fmow_test"))
    assert len(es) == 6 and es.info["classnames"] == ["airport", "farm"]
    assert es.info["labels"].tolist() == [0, 1, 0, 1, 0, 1]
    assert es.info["metadata"][:, 0].tolist() == [0, 1, 2, 0, 1, 2]
    rec = es.records[1]
    assert rec["label"] == 1 and Image.open(io.BytesIO(rec["image"])).size == (12, 12)
    pets = suite.webdataset(str(data_dir / "wds_vtab-pets_test"))
    assert pets.info["templates"] == ["a photo of a {}.", "a {}."]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        suite.webdataset(str(data_dir / "nope"))


def _tok(texts):   # stand-in tokenizer: distinct texts give distinct rows
    return np.asarray([[3 + sum(map(ord, t)) % 200, 3 + len(t) % 50] + [1] * 6 for t in texts], np.int32)


def test_suite_end_to_end(micro, data_dir, tmp_path, capsys):
    model, params = micro
    ev = suite.Evaluator(dict(data_dir=str(data_dir), batch_size=8, num_threads=2), model, _tok)
    metrics = dict(ev.run(params))
    rows = {r["id"]: r for r in ev.rows}
    assert len(rows) == 38
    ran = {k for k, r in rows.items() if r["value"] is not None}
    assert ran == {"cifar10", "imagenet-a", "pets", "fmow", "flickr30k"}
    assert rows["cifar10"]["source"] == "imagefolder" and rows["cifar10"]["n"] == 4
    assert rows["cifar10"]["num_classes"] == 10 and rows["imagenet-a"]["num_classes"] == 200
    assert rows["pets"]["source"] == "wds" and rows["pets"]["num_classes"] == 3   # the data's names
    assert rows["pets"]["num_templates"] == 2 and rows["pets"]["metric"] == "mean_per_class_recall"
    assert rows["fmow"]["metric"] == "worst_group_acc" and rows["flickr30k"]["source"] == "karpathy"
    for k in ran:
        assert 0 <= rows[k]["value"] <= 100 and metrics[f"suite/{k}/{rows[k]['metric']}"] == rows[k]["value"]
    assert "label set mismatch: 3 class folders" in rows["mnist"]["skipped"]
    assert "label set mismatch: labels span 5..5" in rows["gtsrb"]["skipped"]
    assert rows["objectnet"]["skipped"].startswith("missing class-name file")
    assert rows["sun397"]["skipped"].startswith("no data: looked for")
    assert rows["winogavil"]["skipped"].startswith("not supported")
    assert metrics["suite/num_tasks"] == 5
    assert metrics["suite/average"] == pytest.approx(np.mean([rows[k]["value"] for k in ran]))
    assert metrics["suite/dist_shift/average"] == rows["imagenet-a"]["value"]
    err = capsys.readouterr().err
    assert "suite: gtsrb: skipped: label set mismatch" in err
    # the tables
    suite.write_tables(ev.rows, tmp_path)
    table = json.loads((tmp_path / "suite.json").read_text())
    assert table["summary"]["num_tasks"] == 5 and len(table["tasks"]) == 38
    md = (tmp_path / "suite.md").read_text()
    assert "| SUN397 | vtab | acc1 | skipped: no data" in md
    assert "Average over 5 of 38 tasks:" in md and f"| {rows['pets']['n']} |" in md
    # fmow by hand: worst group over regions 0..2 of top-1 correctness
    assert rows["fmow"]["metrics"]["acc1"] >= rows["fmow"]["value"]


def test_suite_selected_tasks_and_errors(micro, data_dir):
    model, _ = micro
    ev = suite.Evaluator(dict(data_dir=str(data_dir), tasks=["mnist", "cifar10"]), model, _tok)
    assert [t["id"] for t in ev.tasks] == ["cifar10", "mnist"]
    with pytest.raises(ValueError, match="unknown suite tasks"):
        suite.Evaluator(dict(data_dir=str(data_dir), tasks=["nope"]), model, _tok)
    with pytest.raises(ValueError, match="tokenizer"):
        suite.Evaluator(dict(data_dir=str(data_dir)), model)


def test_evaluate_cli_suite_config():
    import importlib.util
    spec = importlib.util.spec_from_file_location("_evaluate", ROOT / "scripts" / "evaluate.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class A:
        suite, data_dir, tfds_data_dir, tasks, batch_size = "datacomp38", "/d", "", "pets,cars", 32
        tokenizer = "sentencepiece:/v/c4.model"
    c = mod.suite_config(A)
    e = c.evals.suite
    assert e.type == "datacomp38" and list(e.tasks) == ["pets", "cars"]
    assert dict(e.tokenizer) == {"kind": "sentencepiece", "path": "/v/c4.model"}
    with pytest.raises(SystemExit, match="--data_dir"):
        A.data_dir = ""
        mod.suite_config(A)


def test_tfds_source_when_installed(tmp_path):
    pytest.importorskip("tensorflow_datasets")
    task = {t["id"]: t for t in suite.load_tasks()}["cifar10"]
    with pytest.raises(suite.Skip, match="missing tfds data"):
        suite.open_classification(task, str(tmp_path), tfds_data_dir=str(tmp_path))
