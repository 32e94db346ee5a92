"""scripts/tar_to_array_record.py: round trip, skip counts, atomic and resumable output."""
import json
import os
import subprocess
import sys

import grain
import numpy as np
import pytest

from input_pipeline import convert_tar, pipeline, synthetic
from input_pipeline.records import decode_record
from input_pipeline.tar_source import iter_shard
from conftest import KeyTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture()
def shards(tmp_path):
    paths = synthetic.make_jpeg_shards(str(tmp_path / "tar"), 3, 6, 40, 30, seed=3)
    # Shard 1 gets bad records: a corrupt image, a non-UTF-8 caption, an orphan caption.
    members = synthetic.record_members("0000100", {
        "jpg": synthetic.image_variant("garbage", (1, 2, 3)), "txt": b"100 x"})
    members += synthetic.record_members("0000101", {
        "jpg": synthetic.image_variant("jpeg", (1, 2, 3)), "txt": b"\xff\xfe"})
    members += synthetic.record_members("0000102", {"txt": b"102 orphan"})
    import tarfile
    with tarfile.open(paths[1]) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar] + members
    synthetic.write_tar(paths[1], members)
    return str(tmp_path / "tar" / "{00000..00002}.tar"), paths


def test_round_trip_is_lossless_and_counts_skips(shards, tmp_path):
    pattern, paths = shards
    out = str(tmp_path / "ar")
    summary = convert_tar.convert(pattern, out, progress=False)
    assert summary["written"] == 18 and summary["skipped_total"] == 3
    assert {k: v for k, v in summary["skipped"].items() if v} == {
        "corrupt_image": 1, "bad_text_encoding": 1, "missing_image": 1}
    assert sorted(os.listdir(out)) == sorted(
        [f"0000{i}.array_record" for i in range(3)] + [f"0000{i}.stats.json" for i in range(3)]
        + [convert_tar.SUMMARY_FILE])
    # Every good tar record is in the ArrayRecord files with identical bytes and caption.
    src = grain.sources.ArrayRecordDataSource(
        [os.path.join(out, f"0000{i}.array_record") for i in range(3)])
    converted = {r["key"]: r for r in (decode_record(src[i]) for i in range(len(src)))}
    originals = {}
    for path in paths:
        for _, raw in iter_shard(path, 0, 0):
            if not isinstance(raw, tuple) and raw["key"] not in ("0000100", "0000101"):
                originals[raw["key"]] = raw
    assert converted.keys() == originals.keys()
    for key, raw in originals.items():
        assert converted[key]["image"] == raw["image"]
        assert converted[key]["txt"] == raw["txt"].decode()
        assert converted[key]["meta"]["json"] == {"key": key}
    # The pipeline reads both sources to the same eval images.
    tok = KeyTokenizer()

    def eval_images(source, path):
        cfg = dict(source=source, path=path, batch_size=6, image_size=16)
        it = pipeline.build_eval_iterator(cfg, tok, process_index=0, process_count=1)
        return {int(k): im for b in it for k, im in zip(b["text"][b["mask"], 0],
                                                         b["image"][b["mask"]])}
    from_tar = eval_images("tar", pattern)
    from_ar = eval_images("array_record", os.path.join(out, "*.array_record"))
    assert from_tar.keys() == from_ar.keys() and len(from_tar) == 18
    for k in from_tar:
        np.testing.assert_array_equal(from_tar[k], from_ar[k])


def test_killed_run_leaves_nothing_that_looks_complete_and_rerun_resumes(shards, tmp_path,
                                                                         monkeypatch):
    pattern, _ = shards
    out = str(tmp_path / "ar")
    real = convert_tar.encode_record
    calls = {"n": 0}

    def dying_encode(*args, **kwargs):   # the "kill" happens in the middle of shard 1
        calls["n"] += 1
        if calls["n"] == 9:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    monkeypatch.setattr(convert_tar, "encode_record", dying_encode)
    with pytest.raises(KeyboardInterrupt):
        convert_tar.convert(pattern, out, progress=False)
    assert sorted(os.listdir(out)) == ["00000.array_record", "00000.stats.json"]
    # A temporary file of a run that was SIGKILLed (no cleanup) must not be mistaken either.
    open(os.path.join(out, ".00001.array_record.tmp-1-dead"), "wb").close()
    monkeypatch.setattr(convert_tar, "encode_record", real)
    summary = convert_tar.convert(pattern, out, progress=False)
    assert summary["resumed_shards"] == 1 and summary["written"] == 18
    with open(os.path.join(out, "00001.stats.json")) as f:
        assert json.load(f)["written"] == 6


def test_cli(shards, tmp_path):
    pattern, _ = shards
    script = os.path.join(REPO, "scripts", "tar_to_array_record.py")
    env = dict(os.environ, PYTHONPATH=REPO)
    ok = subprocess.run([sys.executable, script, "--input", pattern, "--output",
                         str(tmp_path / "out"), "--no-progress"], capture_output=True,
                        text=True, env=env, check=False)
    assert ok.returncode == 0, ok.stderr
    assert "18 records written, 3 skipped" in ok.stdout
    bad = subprocess.run([sys.executable, script, "--input", pattern.replace("00002", "00003"),
                          "--output", str(tmp_path / "out2")], capture_output=True, text=True,
                         env=env, check=False)
    assert bad.returncode == 2 and "00003.tar" in bad.stderr and "do not exist" in bad.stderr
