"""Bucket paths (gs://) for every path kind: tokenizer, init weights, data, workdir.

The stand-in: a fake `gs`/`gcs` fsspec filesystem over a local folder (`FakeGCS`), registered
for the test's duration. gs:// paths then take exactly the code path they take on a pod: the
path layer (prolip_jax/paths.py) asks fsspec for the "gs" filesystem and etils.epath for "gcs"
(TensorFlow absent), and both get this class where gcsfs would serve them. Like GCS, it needs
no folders before a write. orbax's array data goes through tensorstore's own GCS driver, not
fsspec, so the training test points orbax's manager at the same folder by its local name;
every other workdir file goes through the stand-in.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from prolip_jax import paths

DATA = Path(__file__).parent / "data"


class FakeGCS(DirFileSystem):
    """gs://bucket/key -> <root>/bucket/key; listings come back as 'bucket/key' like gcsfs."""

    protocol = ("gs", "gcs")
    cachable = False
    root = ""

    def __init__(self, *args, **kwargs):  # gcsfs options (finalize_on_close, ...) are ignored
        super().__init__(path=type(self).root, fs=LocalFileSystem(auto_mkdir=True))


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """The local folder behind gs://; `gs://b/x` is `bucket / "b" / "x"`."""
    root = tmp_path / "gcs"
    root.mkdir()
    monkeypatch.setattr(FakeGCS, "root", str(root))
    for name in FakeGCS.protocol:
        monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, name, FakeGCS)
    epath_backend.fsspec_backend._get_filesystem.cache_clear()  # etils caches the gcs filesystem
    yield root
    epath_backend.fsspec_backend._get_filesystem.cache_clear()


def test_the_layer_reads_lists_and_writes_a_bucket(bucket):
    paths.write_text_atomic("gs://b/a/x.txt", "hello")  # no folder needed first, as on GCS
    assert (bucket / "b" / "a" / "x.txt").read_text() == "hello"
    assert paths.read_text("gs://b/a/x.txt") == "hello"
    assert paths.exists("gs://b/a/x.txt") and paths.isfile("gs://b/a/x.txt") and paths.isdir("gs://b/a")
    assert not paths.exists("gs://b/a/y.txt")
    paths.write_bytes_atomic("gs://b/a/y.bin", b"\x00\x01")
    assert paths.listdir("gs://b/a") == ["x.txt", "y.bin"]
    assert paths.glob("gs://b/a/*.txt") == ["gs://b/a/x.txt"]
    assert paths.join("gs://b/a/", "", "z") == "gs://b/a/z"
    with paths.open("gs://b/a/y.bin") as f:
        assert f.read() == b"\x00\x01"
    assert str(paths.as_path("gs://b/a") / "x.txt") == "gs://b/a/x.txt"
    assert (paths.as_path("gs://b/a") / "x.txt").read_text() == "hello"  # epath reaches it too


def test_a_bucket_without_its_backend_is_one_line_naming_the_package():
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    for call in (lambda: paths.read_bytes("gs://b/x"), lambda: paths.as_path("gs://b/x")):
        with pytest.raises(ImportError) as err:
            call()
        assert "\n" not in str(err.value) and "pip install gcsfs" in str(err.value)
        assert "gs://b/x" in str(err.value)


def _wordlevel_json(path):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3, "photo": 4,
                                      "of": 5, "cat": 6}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    tok.save(str(path))
    return path


def test_tokenizer_from_a_bucket_and_its_record_into_one(bucket, tmp_path):
    from input_pipeline import tokenizer_files
    from input_pipeline import tokenizers as T

    local = _wordlevel_json(tmp_path / "tokenizer.json")
    (bucket / "b" / "tok").mkdir(parents=True)
    shutil.copy(local, bucket / "b" / "tok" / "tokenizer.json")
    texts = ["a photo of a cat", "cat"]
    want = T.build_tokenizer("hf", local, context_length=8, pad_id=0)(texts)
    for where in ("gs://b/tok/tokenizer.json", "gs://b/tok"):  # the file, or its folder
        tok = T.build_tokenizer("hf", where, context_length=8, pad_id=0)
        np.testing.assert_array_equal(tok(texts), want)
    with pytest.raises(T.TokenizerFileNotFoundError, match="gs://b/tok/none.json"):
        T.build_tokenizer("hf", "gs://b/tok/none.json", context_length=8, pad_id=0)
    # The record a checkpoint keeps, written into and read back from a bucket folder.
    tf = tokenizer_files.TokenizerFile.of(tok)
    record = tf.write_into("gs://b/run/checkpoints/5")
    assert (bucket / "b" / "run" / "checkpoints" / "5" / record["file"]).read_bytes() == local.read_bytes()
    again = tokenizer_files.tokenizer_from_record("gs://b/run/checkpoints/5", record)
    np.testing.assert_array_equal(again(texts), want)


def test_init_weights_from_a_bucket(bucket):
    from prolip_jax.pretrained.loader import load_pretrained

    shutil.copytree(DATA / "pretrained" / "openai_clip_tiny", bucket / "b" / "init" / "openai_clip_tiny")
    shutil.copy(DATA / "pretrained" / "siglip_bigvision_tiny.npz", bucket / "b" / "init")
    for name, url in (("openai_clip_tiny", "gs://b/init/openai_clip_tiny"),
                      ("openai_clip_tiny/open_clip_model.safetensors",
                       "gs://b/init/openai_clip_tiny/open_clip_model.safetensors"),
                      ("siglip_bigvision_tiny.npz", "gs://b/init/siglip_bigvision_tiny.npz")):
        config, params, report = load_pretrained(url)
        config0, params0, report0 = load_pretrained(DATA / "pretrained" / name)
        assert config == config0 and report.source.startswith("gs://b/init/")
        assert (report.format, report.loaded) == (report0.format, report0.loaded)
        import jax

        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params0)):
            np.testing.assert_array_equal(a, b)


def test_tar_shards_and_caption_files_from_a_bucket(bucket):
    from input_pipeline import captions, caption_files, sources, tar_source
    from input_pipeline.paths import expand_paths
    from input_pipeline.synthetic import make_jpeg_shards

    make_jpeg_shards(str(bucket / "b" / "shards"), num_shards=2, per_shard=3, width=24, height=24)
    urls = expand_paths("gs://b/shards/*.tar")
    assert urls == ["gs://b/shards/00000.tar", "gs://b/shards/00001.tar"]
    assert expand_paths("gs://b/shards/{00000..00001}.tar") == urls
    local = expand_paths(str(bucket / "b" / "shards" / "*.tar"))
    got = [list(tar_source.iter_shard(u, i, 0)) for i, u in enumerate(urls)]
    want = [list(tar_source.iter_shard(p, i, 0)) for i, p in enumerate(local)]
    assert len(got[0]) == 3 and got == want

    # A Karpathy split file and its images, both in the bucket; the reader's ToRaw gets the bytes.
    images = bucket / "b" / "coco" / "val2014"
    images.mkdir(parents=True)
    (images / "1.jpg").write_bytes(b"jpeg-1")
    (images / "2.jpg").write_bytes(b"jpeg-2")
    split = {"dataset": "coco", "images": [
        {"filepath": "val2014", "filename": f"{i}.jpg", "split": "train", "cocoid": i,
         "sentences": [{"raw": f"caption {i}"}]} for i in (1, 2)]}
    (bucket / "b" / "coco" / "dataset_coco.json").write_text(json.dumps(split))
    index = captions.read_karpathy("gs://b/coco/dataset_coco.json", "gs://b/coco", ("train",),
                                   "coco_karpathy", None)
    assert index.image_paths == ["gs://b/coco/val2014/1.jpg", "gs://b/coco/val2014/2.jpg"]
    src = captions.CaptionSource(index, "per_caption", "image")
    raw = captions.ToRaw()((0, 1, src[1]))
    assert (raw["image"], raw["txt"]) == (b"jpeg-2", "caption 2")
    (bucket / "b" / "list.txt").write_text("x\ny\n")
    assert caption_files.read_list("gs://b/list.txt", "class") == ["x", "y"]

    # array_record cannot stream from a bucket: one line saying what to do instead.
    with pytest.raises(ValueError) as err:
        sources.array_record_source(["gs://b/ar/00000.array_record"])
    msg = str(err.value)
    assert "\n" not in msg and "gs://b/ar/00000.array_record" in msg
    assert "gcloud storage cp" in msg and "tar" in msg
    with pytest.raises(ValueError, match="data.tfds_data_dir must be on local disk"):
        sources.tfds_source("coco", "train", "gs://b/tfds")


def test_a_training_workdir_in_a_bucket(bucket, monkeypatch):
    from prolip_jax import train
    from prolip_jax.metrics import read_jsonl, read_tensorboard_scalars

    spec = importlib.util.spec_from_file_location("tiny", Path(__file__).parents[1] / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("steps=2,data=random,size=micro")
    c.log_steps = 1

    # orbax's arrays go through tensorstore's own GCS driver: hand the manager the local name of
    # the same folder (on a pod, orbax writes gs:// itself).
    real_manager = train.ocp.CheckpointManager
    to_local = lambda d: str(d).replace("gs://", str(bucket) + "/")  # noqa: E731
    monkeypatch.setattr(train.ocp, "CheckpointManager",
                        lambda directory, *a, **k: real_manager(to_local(directory), *a, **k))
    train.train(c, "gs://b/run")
    run = bucket / "b" / "run"
    assert (run / "parameters.txt").read_text().strip()
    records = read_jsonl("gs://b/run/metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["loss"]) for r in records)
    events = paths.glob("gs://b/run/tb/*tfevents*")
    assert events and all(Path(to_local(e)).stat().st_size > 0 for e in events)
    scalars = read_tensorboard_scalars("gs://b/run/tb")
    assert [s for s, _ in scalars["loss"]] == [1, 2]
    assert (run / "checkpoints" / "2").is_dir()
    assert not Path("gs:").exists()  # nothing landed in a local folder named after the URL
