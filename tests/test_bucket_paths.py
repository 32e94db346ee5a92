"""Bucket paths (gs://) for every path kind: tokenizer, init weights, data, workdir.

The stand-in: a fake `gs`/`gcs` fsspec filesystem over a local folder (`FakeGCS`), registered
for the test's duration. gs:// paths then take exactly the code path they take on a pod: the
path layer (prolip_jax/runtime/paths.py) asks fsspec for the "gs" filesystem and etils.epath for "gcs"
(TensorFlow absent), and both get this class where gcsfs would serve them. Like GCS, it needs
no folders before a write. orbax's array data goes through tensorstore's own GCS driver, not
fsspec, so the training test points orbax's manager at the same folder by its local name;
every other workdir file goes through the stand-in.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from etils.epath import backend as epath_backend
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem

from prolip_jax.runtime import paths

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


@pytest.fixture(autouse=True)
def fresh_probes(monkeypatch):
    """Each test probes its buckets anew (the path layer remembers buckets that answered)."""
    monkeypatch.setattr(paths, "_probed", set(), raising=False)  # raising=False: the suite also runs on older code


def _no_backend(monkeypatch):
    """fsspec as it is without gcsfs: gs:// names a package that is not installed."""
    registry = importlib.import_module("fsspec.registry")
    for name in FakeGCS.protocol:
        monkeypatch.delitem(registry._registry, name, raising=False)
        monkeypatch.setitem(registry.known_implementations, name,
                            {"class": "gcsfs_not_installed_x.GCSFileSystem", "err": "Please install gcsfs"})


def test_a_bucket_without_its_backend_is_one_line_naming_the_package(monkeypatch):
    _no_backend(monkeypatch)
    for call in (lambda: paths.read_bytes("gs://b/x"), lambda: paths.as_path("gs://b/x"),
                 lambda: paths.isfile("gs://b/x"), lambda: paths.check_reachable("gs://b/x", "--workdir", "--workdir")):
        with pytest.raises(paths.BucketBackendMissing) as err:
            call()
        assert "\n" not in str(err.value) and "pip install gcsfs" in str(err.value)
        assert "gs://b/x" in str(err.value) and err.value.kind == "backend"


# ------------------------------------------------------------------ the kinds of bucket error
def _named(name: str, module: str, base: type = Exception, real: bool = True) -> type:
    """The real exception class where its package is installed (and `real`), else a look-alike of
    the same name and module (the path layer classifies by name and module, never by importing them)."""
    try:
        if not real:
            raise ImportError(module)
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return type(name, (base,), {"__module__": module, "lookalike": True})


def _dns_error(real: bool) -> BaseException:
    """What gcsfs raises, out of retries, with no network: aiohttp's ClientConnectorDNSError."""
    import types

    cls = _named("ClientConnectorDNSError", "aiohttp.client_exceptions", OSError, real)
    cause = OSError(-2, "Name or service not known")
    if getattr(cls, "lookalike", False):
        e = cls(-2, "Cannot connect to host storage.googleapis.com:443 ssl:default [Name or service not known]")
    else:
        e = cls(types.SimpleNamespace(host="storage.googleapis.com", port=443, ssl=True), cause)
    e.__cause__ = cause
    return e


def _http_401(real: bool) -> BaseException:
    """gcsfs's HttpError for a 401 (an anonymous caller on a private bucket)."""
    cls = _named("HttpError", "gcsfs.retry", Exception, real)
    e = cls.__new__(cls)
    Exception.__init__(e, "Anonymous caller does not have storage.objects.get access, 401")
    e.code, e.message = 401, "Anonymous caller does not have storage.objects.get access, 401"
    return e


def _no_credentials(real: bool) -> BaseException:
    cls = _named("DefaultCredentialsError", "google.auth.exceptions", Exception, real)
    return cls("Your default credentials were not found.")


FAULTS = {  # kind -> (the exception the store raises, the paths class of the one-line error, words of it)
    "network": (_dns_error, "BucketUnreachable", "cannot reach the store"),
    "credentials-401": (_http_401, "BucketAccessDenied", "credentials"),
    "credentials-403": (lambda real: OSError("Forbidden: b/run\nno storage.objects.get access"), "BucketAccessDenied",
                        "credentials"),
    "credentials-none": (_no_credentials, "BucketAccessDenied", "gcloud auth application-default login"),
}


class FaultyGCS(FakeGCS):
    """The stand-in whose every call raises `fault` (and logs as gcsfs does while retrying)."""

    fault = None

    def _raise(self, *args, **kwargs):
        import logging

        logging.getLogger("gcsfs").warning("Could not determine bucket type for bucket name b")
        try:
            raise type(self).fault()
        except Exception:
            logging.getLogger("gcsfs").exception("_request out of retries on exception")
            raise

    info = ls = _open = makedirs = find = _raise


@pytest.fixture
def faulty(bucket, monkeypatch):
    """gs:// served by FaultyGCS; returns a setter of its fault."""
    for name in FakeGCS.protocol:
        monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, name, FaultyGCS)
    return lambda fault: monkeypatch.setattr(FaultyGCS, "fault", staticmethod(fault))


@pytest.mark.parametrize("real", [True, False], ids=["installed", "lookalike"])
@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_each_kind_of_bucket_fault_is_one_line_naming_it(kind, real, faulty, capfd):
    """What check_workdir, locate and every reader call: one line of the right kind, not a False
    (fsspec's isfile / isdir / exists swallow any error) nor the backend's traceback."""
    make, name, words = FAULTS[kind]
    cls = getattr(paths, name)
    faulty(lambda: make(real))
    from prolip_jax.core import artifacts

    calls = {"check_reachable": lambda: paths.check_reachable("gs://b/run", "--workdir", "--workdir"),
             "isfile": lambda: paths.isfile("gs://b/run"), "isdir": lambda: paths.isdir("gs://b/run"),
             "listdir": lambda: paths.listdir("gs://b/run"), "read": lambda: paths.read_bytes("gs://b/run/x"),
             "locate": lambda: artifacts.locate("gs://b/run", flag="--checkpoint")}
    for name, call in calls.items():
        paths._probed.clear()
        with pytest.raises(cls) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and "gs://b/run" in msg and words in msg, (name, msg)
    assert "--workdir gs://b/run" in str(pytest.raises(cls, paths.check_reachable, "gs://b/run", "--workdir",
                                                          "--workdir").value)
    out, errs = capfd.readouterr()
    assert out == "" and errs == ""  # gcsfs's warnings and tracebacks stay off the console


def test_a_missing_bucket_object_is_not_found_and_a_new_workdir_is_fine(bucket):
    from prolip_jax.core import artifacts

    paths.check_reachable("gs://b/new-run", "--workdir", "--workdir")  # a new workdir: nothing there yet
    assert not paths.isfile("gs://b/new-run") and not paths.isdir("gs://b/new-run")
    with pytest.raises(paths.BucketNotFound) as err:
        paths.check_reachable("gs://b/none", "--checkpoint", "--checkpoint", must_exist=True)
    assert isinstance(err.value, FileNotFoundError) and "\n" not in str(err.value)
    with pytest.raises(FileNotFoundError, match="gs://b/none: no such bucket, file or folder"):
        artifacts.locate("gs://b/none")


def test_a_store_that_does_not_answer_is_unreachable_within_the_probe_deadline(faulty, monkeypatch):
    import threading
    import time

    release = threading.Event()
    faulty(lambda: release.wait(60) and FileNotFoundError())  # hangs as gcsfs's retries do
    monkeypatch.setattr(paths, "PROBE_TIMEOUT_S", 0.5)
    start = time.perf_counter()
    try:
        with pytest.raises(paths.BucketUnreachable, match=r"no answer within 0.5 s"):
            paths.isdir("gs://b/run")
        assert time.perf_counter() - start < 5
    finally:
        release.set()


def test_the_real_gcsfs_answers_in_one_line_within_15_s(capfd):
    """With gcsfs installed and whatever network there is: one line of one of the four kinds."""
    pytest.importorskip("gcsfs")
    import time

    start = time.perf_counter()
    with pytest.raises(paths.BucketError) as err:
        paths.check_reachable("gs://prolip-jax-test-no-such-bucket-3f9c2/run", "--checkpoint", "--checkpoint",
                              must_exist=True)
    assert time.perf_counter() - start < 15
    assert "\n" not in str(err.value) and err.value.kind in ("network", "credentials", "not_found")
    assert capfd.readouterr() == ("", "")


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
    from prolip_jax.core.pretrained.loader import load_pretrained

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
    from input_pipeline import captions, caption_files, tar_source
    from input_pipeline.sources import array_record, tfds
    from input_pipeline.shards import expand_paths
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
        array_record.array_record_source(["gs://b/ar/00000.array_record"])
    msg = str(err.value)
    assert "\n" not in msg and "gs://b/ar/00000.array_record" in msg
    assert "gcloud storage cp" in msg and "tar" in msg
    with pytest.raises(ValueError, match="data.tfds_data_dir must be on local disk"):
        tfds.tfds_source("coco", "train", "gs://b/tfds")


def test_a_training_workdir_in_a_bucket(flaky, monkeypatch, tmp_path):
    """A workdir in a bucket whose every 10th call fails once (FlakyGCS): the run finishes
    bit-identical to one in a local folder and counts the retries in its metrics."""
    import jax

    from prolip_jax import train
    from prolip_jax.core import checkpoint
    from prolip_jax.trainer import checkpoints as trainer_checkpoints
    from prolip_jax.runtime.metrics import read_jsonl, read_tensorboard_scalars

    spec = importlib.util.spec_from_file_location("tiny", Path(__file__).parents[1] / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config("steps=2,data=random,size=micro")
    c.log_steps = 1

    # orbax's arrays go through tensorstore's own GCS driver: hand the manager the local name of
    # the same folder (on a pod, orbax writes gs:// itself).
    real_manager = trainer_checkpoints.ocp.CheckpointManager
    to_local = lambda d: str(d).replace("gs://", str(bucket) + "/")  # noqa: E731
    monkeypatch.setattr(trainer_checkpoints.ocp, "CheckpointManager",
                        lambda directory, *a, **k: real_manager(to_local(directory), *a, **k))
    bucket = flaky
    train.train(c, "gs://b/run")
    run = bucket / "b" / "run"
    train.train(c, str(tmp_path / "local"))
    jax.tree.map(np.testing.assert_array_equal, *(checkpoint.load_params(w)[0] for w in (
        run / "checkpoints", tmp_path / "local" / "checkpoints")))
    assert (run / "parameters.txt").read_text().strip()
    records = read_jsonl("gs://b/run/metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2] and all(np.isfinite(r["loss"]) for r in records)
    assert records[-1]["io/retries/http_503"] > 0
    events = paths.glob("gs://b/run/tb/*tfevents*")
    assert events and all(Path(to_local(e)).stat().st_size > 0 for e in events)
    scalars = read_tensorboard_scalars("gs://b/run/tb")
    assert [s for s, _ in scalars["loss"]] == [1, 2]
    assert (run / "checkpoints" / "2").is_dir()
    assert not Path("gs:").exists()  # nothing landed in a local folder named after the URL


def test_metrics_in_a_bucket_roll_to_new_objects(bucket, monkeypatch):
    """Object stores cannot append: metrics.jsonl is a set of objects, only the newest rewritten
    at each write, a new one past ROLL_RECORDS lines or ROLL_SECONDS; read_jsonl reads the set;
    a resume cuts it at its step. TensorBoard's event files roll past ROLL_EVENT_BYTES."""
    import io

    from prolip_jax.runtime import metrics

    monkeypatch.setattr(metrics, "ROLL_RECORDS", 3)
    monkeypatch.setattr(metrics, "ROLL_EVENT_BYTES", 120)
    uploads = []
    write = paths.write_bytes_atomic
    monkeypatch.setattr(paths, "write_bytes_atomic", lambda p, d: uploads.append((str(p), len(d))) or write(p, d))
    now = [0.0]

    def run(steps, resume_step=0):
        with metrics.MetricWriter("gs://b/run", 20, resume_step=resume_step, stream=io.StringIO(),
                                  clock=lambda: now[0]) as w:
            for step in steps:
                w.write(step, {"loss": float(step)})

    run(range(1, 9))
    names = sorted(p.name for p in (bucket / "b" / "run").iterdir() if p.suffix == ".jsonl")
    assert names == ["metrics-00001.jsonl", "metrics-00002.jsonl", "metrics.jsonl"]
    assert [r["step"] for r in metrics.read_jsonl("gs://b/run/metrics.jsonl")] == list(range(1, 9))
    jsonl = [n for p, n in uploads if p.endswith(".jsonl")]
    assert max(jsonl) < 3 * 40   # never more than one object's three lines at a time
    assert len([p for p in paths.glob("gs://b/run/tb/*tfevents*")]) >= 3
    assert [s for s, _ in metrics.read_tensorboard_scalars("gs://b/run/tb")["loss"]] == list(range(1, 9))

    run([5, 6], resume_step=5)   # steps 5-8 of the first run dropped, 5 and 6 logged again
    assert [r["step"] for r in metrics.read_jsonl("gs://b/run/metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert not (bucket / "b" / "run" / "metrics-00002.jsonl").exists()
    with metrics.MetricWriter("gs://b/run", 20, resume_step=7, stream=io.StringIO(), clock=lambda: now[0]) as w:
        w.write(7, {"loss": 7.0})   # into metrics-00002.jsonl (metrics-00001.jsonl is full)
        now[0] = metrics.ROLL_SECONDS   # an old object rolls too, however few lines it holds
        w.write(8, {"loss": 8.0})
        w.write(9, {"loss": 9.0})
    assert [r["step"] for r in metrics.read_jsonl("gs://b/run/metrics.jsonl")] == list(range(1, 10))
    assert [(bucket / "b" / "run" / f"metrics-0000{i}.jsonl").read_text().count("\n") for i in (2, 3)] == [2, 1]


# ----------------------------------------------------------- transient errors (runtime/retries.py)
class HttpError(OSError):
    """What gcsfs raises for an HTTP error status (gcsfs.retry.HttpError carries `.code`)."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


class _FlakyFile:
    def __init__(self, f, flake):
        self._f, self._flake = f, flake

    def read(self, *args):
        self._flake("read")
        return self._f.read(*args)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


class FlakyGCS(FakeGCS):
    """FakeGCS whose every `every`-th call (listings, info, opening, reads, writes) fails once
    with `status` (503: the store is briefly unavailable)."""

    every, status, calls = 0, 503, [0]
    deny = None   # (what, path) -> True: that call gets HTTP 403 (access withdrawn)

    def _flake(self, what, path=""):
        type(self).calls[0] += 1
        if self.deny and self.deny(what, str(path)):
            raise HttpError(403, f"Forbidden: 403 on {what} {path} (injected)")
        if self.every and self.calls[0] % self.every == 0:
            raise HttpError(self.status, f"{self.status} on {what} (injected)")


for _name in ("info", "ls", "cat_file", "pipe_file", "rm", "mkdir", "makedirs", "mv"):
    def _method(self, *args, _name=_name, **kwargs):
        self._flake(_name)
        return getattr(FakeGCS, _name)(self, *args, **kwargs)
    setattr(FlakyGCS, _name, _method)


def _flaky_open(self, path, mode="rb", **kwargs):
    self._flake("open " + mode, path)
    f = FakeGCS.open(self, path, mode, **kwargs)
    return _FlakyFile(f, self._flake) if "r" in mode else f


FlakyGCS.open = _flaky_open


@pytest.fixture
def flaky(bucket, monkeypatch):
    """gs:// served by FlakyGCS (every 10th call failing once), retries without waiting."""
    from prolip_jax.runtime import retries

    for name in FakeGCS.protocol:
        monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, name, FlakyGCS)
    epath_backend.fsspec_backend._get_filesystem.cache_clear()
    monkeypatch.setattr(FlakyGCS, "every", 10)
    monkeypatch.setattr(FlakyGCS, "calls", [0])
    monkeypatch.setattr(retries, "INITIAL_S", 0.001)
    monkeypatch.setattr(retries, "_counts", __import__("collections").Counter())
    return bucket


def test_transient_errors_are_retried_and_counted(flaky, caplog):
    from input_pipeline import tar_source
    from input_pipeline.shards import expand_paths
    from input_pipeline.synthetic import make_jpeg_shards
    from prolip_jax.runtime import retries

    make_jpeg_shards(str(flaky / "b" / "shards"), num_shards=2, per_shard=5, width=24, height=24)
    local = expand_paths(str(flaky / "b" / "shards" / "*.tar"))
    want = [list(tar_source.iter_shard(p, i, 0)) for i, p in enumerate(local)]
    for _ in range(3):   # every call path at several phases of the failing calls
        urls = expand_paths("gs://b/shards/*.tar")
        assert [list(tar_source.iter_shard(u, i, 0)) for i, u in enumerate(urls)] == want
        paths.write_text_atomic("gs://b/a/x.txt", "hello")
        assert paths.read_text("gs://b/a/x.txt") == "hello" and paths.exists("gs://b/a/x.txt")
        assert paths.listdir("gs://b/a") == ["x.txt"]
        meta = paths.as_path("gs://b/ckpt") / "1" / "_CHECKPOINT_METADATA"   # orbax's files go through epath
        meta.write_text('{"step": 1}')
        assert meta.exists() and meta.read_text() == '{"step": 1}' and [p.name for p in meta.parent.iterdir()] == [meta.name]
    assert FlakyGCS.calls[0] >= 30 and retries.counts() == {"http_503": FlakyGCS.calls[0] // 10}
    warned = [r.getMessage() for r in caplog.records if "transient store error" in r.getMessage()]
    assert len(warned) == 1 and "(http_503)" in warned[0] and "io/retries/http_503" in warned[0]


def test_access_withdrawn_mid_run_saves_and_stops_in_one_line(flaky, monkeypatch, capfd):
    """A permanent error (HTTP 403 on the workdir's metrics.jsonl from its third write on) is not
    retried: the state reached is saved, one line names the bucket error, exit 2; the rerun with
    access back resumes from that checkpoint and finishes."""
    from prolip_jax import train
    from prolip_jax.trainer import checkpoints as trainer_checkpoints

    real_manager = trainer_checkpoints.ocp.CheckpointManager
    monkeypatch.setattr(trainer_checkpoints.ocp, "CheckpointManager", lambda directory, *a, **k: real_manager(
        str(directory).replace("gs://", str(flaky) + "/"), *a, **k))
    writes = []

    def deny(what, path):
        writes.append(1) if what == "open wb" and path.endswith("metrics.jsonl") else None
        return len(writes) > 2 and what == "open wb" and path.endswith("metrics.jsonl")

    monkeypatch.setattr(FlakyGCS, "deny", staticmethod(deny))
    monkeypatch.setattr(FlakyGCS, "every", 0)   # only the 403s: the writes are counted exactly
    cli = ["train", "--config", str(Path(__file__).parents[1] / "configs" / "tiny.py") + ":data=random,steps=3,size=micro",
           "--config.log_steps=1", "--config.checkpoint_steps=100", "--workdir", "gs://b/run"]
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.main(cli)
    assert exit_.value.code == 2
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("error: the metrics writer failed after step 2 (gs://b/run/metrics.jsonl: "
                                               "no credentials, or credentials without access (Forbidden: 403"), err
    assert err[0].endswith(f"saved checkpoint step 2 ({flaky / 'b' / 'run' / 'checkpoints' / '2'}): rerun the same "
                           "command to resume from it"), err[0]
    assert len(writes) == 3   # the 403 was not retried
    monkeypatch.setattr(FlakyGCS, "deny", None)
    train.main(cli)   # access back: resumes from step 2
    from prolip_jax.runtime.metrics import read_jsonl

    assert [r["step"] for r in read_jsonl("gs://b/run/metrics.jsonl")] == [1, 3]   # step 2's was the write refused
    assert (flaky / "b" / "run" / "checkpoints" / "3").is_dir()


def test_an_async_backend_like_gcsfs_retries_too(tmp_path, monkeypatch):
    """gcsfs and s3fs are async filesystems whose sync methods fsspec makes from their
    coroutines: the coroutines are wrapped (a sync override would bypass them), and the sync
    calls, the backend's own calls between coroutines and the open files' reads all retry."""
    import asyncio

    from fsspec.asyn import AsyncFileSystem

    from prolip_jax.runtime import retries

    calls = [0]

    async def flake(what):
        calls[0] += 1
        await asyncio.sleep(0)
        if calls[0] % 3 == 0:
            raise HttpError(429, f"429 on {what} (injected)")

    class AsyncStore(AsyncFileSystem):   # a local folder behind coroutines, as gcsfs is a bucket
        cachable = False

        async def _info(self, path, **kwargs):
            await flake("info")
            p = tmp_path / path
            if not p.exists():
                raise FileNotFoundError(path)
            return {"name": path, "size": p.stat().st_size, "type": "directory" if p.is_dir() else "file"}

        async def _ls(self, path, detail=True, **kwargs):
            await flake("ls")
            return [f"{path}/{n.name}" for n in sorted((tmp_path / path).iterdir())]

        async def _cat_file(self, path, start=None, end=None, **kwargs):
            await flake("cat_file")
            return (tmp_path / path).read_bytes()[start:end]

        async def _pipe_file(self, path, data, **kwargs):
            await flake("pipe_file")
            (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / path).write_bytes(data)

        def _open(self, path, mode="rb", **kwargs):
            return _FlakyFile(open(tmp_path / path, mode), lambda what: asyncio.run(flake(what)))

    monkeypatch.setattr(retries, "INITIAL_S", 0.001)
    monkeypatch.setattr(retries, "_counts", __import__("collections").Counter())
    fs = retries.with_retries(AsyncStore)()
    for i in range(4):
        fs.pipe_file(f"b/x{i}.txt", b"hello %d" % i)
        assert fs.cat_file(f"b/x{i}.txt") == b"hello %d" % i and fs.exists(f"b/x{i}.txt")
        assert fs.info(f"b/x{i}.txt")["size"] == 7 and len(fs.ls("b")) == i + 1
        with fs.open(f"b/x{i}.txt") as f:
            assert f.read() == b"hello %d" % i
    assert calls[0] >= 30 and retries.counts()["http_429"] >= 10


@pytest.mark.parametrize("status, kind", [(503, "BucketUnreachable"), (403, "BucketAccessDenied")])
def test_an_error_that_stays_is_one_line(flaky, monkeypatch, status, kind):
    """A transient status that does not pass gives up after retries.ATTEMPTS tries; a permanent one
    (403) is not retried at all. Either is the path layer's one line."""
    from prolip_jax.runtime import retries

    paths.write_text_atomic("gs://b/a/x.txt", "hello")
    monkeypatch.setattr(FlakyGCS, "every", 1)
    monkeypatch.setattr(FlakyGCS, "status", status)
    monkeypatch.setattr(FlakyGCS, "calls", [0])
    with pytest.raises(paths.BucketError) as e:
        paths.read_text("gs://b/a/x.txt")
    assert type(e.value).__name__ == kind and "\n" not in str(e.value) and "gs://b/a/x.txt" in str(e.value)
    assert FlakyGCS.calls[0] == (retries.ATTEMPTS if status == 503 else 1)
    if status == 503:
        assert str(e.value) == ("gs://b/a/x.txt: cannot reach the store (503 on open rb (injected), still after "
                                f"{retries.ATTEMPTS} tries): check the network")


# ------------------------------------------------------------- models from a URL (prolip_jax.load)
@pytest.fixture
def exported(micro, tmp_path):
    """A local exported folder (config.json + model.safetensors + preprocessor_config.json)."""
    from prolip_jax import export
    from prolip_jax.core.models import get_config

    return export.save_hf(tmp_path / "hf", micro[1], get_config("micro"), normalization="0.5")


@pytest.fixture
def memory_root():
    """A fresh folder in fsspec's in-memory filesystem, removed afterwards."""
    import uuid

    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/prolip-test-{uuid.uuid4().hex[:8]}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_an_exported_folder_loads_from_any_fsspec_url(exported, bucket, memory_root):
    import jax

    import prolip_jax

    fs, root = memory_root
    fs.put(str(exported), root + "/hf", recursive=True)
    shutil.copytree(exported, bucket / "b" / "hf")
    want = prolip_jax.load(exported)
    for url in (f"memory://{root}/hf", "gs://b/hf"):
        got = prolip_jax.load(url)
        assert got.step is None and got.normalization == want.normalization == "0.5", url
        for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="Hugging Face folder .* drop --step 3"):
        prolip_jax.load("gs://b/hf", step=3)


def test_a_checkpoint_at_a_url_orbax_cannot_read_is_one_line(micro, tmp_path, memory_root):
    from prolip_jax.core import checkpoint
    from prolip_jax.core import artifacts
    from prolip_jax.core.models import get_config

    fs, root = memory_root
    checkpoint.save_params(tmp_path / "run" / "checkpoints", micro[1], get_config("micro"), step=2)
    fs.put(str(tmp_path / "run"), root + "/run", recursive=True)
    for url in (f"memory://{root}/run", f"memory://{root}/run/checkpoints", f"memory://{root}/run/checkpoints/2"):
        with pytest.raises(ValueError) as err:
            artifacts.locate(url)
        msg = str(err.value)
        assert "\n" not in msg and "loads from gs:// or local disk only" in msg and url in msg


def test_a_bucket_checkpoint_is_located_through_the_path_layer(micro, bucket):
    from prolip_jax.core import checkpoint
    from prolip_jax.core import artifacts
    from prolip_jax.core.models import get_config

    checkpoint.save_params(bucket / "b" / "run" / "checkpoints", micro[1], get_config("micro"), step=2)
    for url in ("gs://b/run", "gs://b/run/checkpoints", "gs://b/run/checkpoints/2"):
        where = artifacts.locate(url)  # on main: "no prolip_jax checkpoint found" (pathlib folded gs://)
        assert (where.kind, str(where.path), where.step) == ("checkpoint", "gs://b/run/checkpoints", 2)
        assert str(where.step_dir) == "gs://b/run/checkpoints/2"


WRAPPER = """
import importlib, importlib.util, sys
sys.path[:0] = [{tests!r}, {scripts!r}]
import test_bucket_paths as t
registry = importlib.import_module("fsspec.registry")._registry
t.FaultyGCS.root = {root!r}
t.FaultyGCS.fault = staticmethod(lambda: t._dns_error(importlib.util.find_spec("aiohttp") is not None))
for name in t.FakeGCS.protocol:
    registry[name] = t.FaultyGCS
import evaluate
sys.exit(evaluate.main(sys.argv[1:]))
"""


def test_evaluate_on_an_unreachable_bucket_prints_one_line_within_15_s(tmp_path):
    """The console of `scripts/evaluate.py --checkpoint gs://...` with no network: one line, exit 2."""
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "gcs").mkdir()
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER.format(tests=str(root / "tests"), scripts=str(root / "scripts"),
                                      root=str(tmp_path / "gcs")))
    start = time.perf_counter()
    run = subprocess.run([sys.executable, str(wrapper), "--checkpoint", "gs://b/run", "--config",
                          str(root / "configs" / "eval" / "demo.py"), "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=60, cwd=tmp_path,
                         env={**os.environ, "JAX_PLATFORMS": "cpu"})
    elapsed = time.perf_counter() - start
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: gs://b/run: cannot reach the store (") and "check the network" in run.stderr
    assert elapsed < 15


@pytest.mark.parametrize("kind", sorted(FAULTS))
def test_training_on_a_faulty_bucket_is_one_line_before_anything_else(kind, faulty, capfd, tmp_path):
    """The trainer's --workdir (or a data path) in a bucket that cannot be used: one line naming
    the kind and the flag, exit 2, and nothing else on the console."""
    from prolip_jax import train

    make, _, words = FAULTS[kind]
    faulty(lambda: make(True))
    cli = ["train", "--config", str(Path(__file__).parents[1] / "configs" / "tiny.py") + ":data=random,steps=2,size=micro"]
    for extra, flag in ((["--workdir", "gs://b/run"], "--workdir gs://b/run"),
                        (["--workdir", str(tmp_path / "w"), "--config.data.source=tar",
                          "--config.data.path=gs://b/shards/{0..1}.tar"], "data.path gs://b/shards")):
        paths._probed.clear()
        capfd.readouterr()
        with pytest.raises(SystemExit) as exit_:
            train.main(cli + extra)
        out, err = capfd.readouterr()
        assert exit_.value.code == 2
        lines = [line for line in (out + err).splitlines() if line.strip() and not line.startswith("compile cache")]
        assert len(lines) == 1 and lines[0].startswith("error: ") and flag in lines[0] and words in lines[0], lines
