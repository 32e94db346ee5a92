"""Data problems end a run in one line, and SIGTERM stops a run at any point of it.

A shard kind that is not data.source's, shards that yield nothing (zero bytes, not tar, empty,
records without captions), data that runs out, a read that hangs: each is one line before or
at the first step, never a loop. `data.source=auto` (configs/own_data.py's default) reads the
kind from the names, so the README's ArrayRecord command runs as written.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from input_pipeline import convert_tar, synthetic, tar_source
from input_pipeline import shards as data_paths
from input_pipeline.config import DataConfig
from prolip_jax.trainer import data as data_lib
from prolip_jax import train


ROOT = Path(__file__).resolve().parents[1]
WORDS = ("a", "photo", "of", "the", "digit", "one", "two", "three")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Good tar shards, the same as ArrayRecord, a SentencePiece model, and bad shards."""
    import sentencepiece as spm

    tmp = tmp_path_factory.mktemp("dead_ends")
    rng = np.random.default_rng(0)
    (tmp / "good").mkdir()
    for s in range(2):
        members = []
        for i in range(24):
            image = synthetic.encode_image(rng.integers(0, 255, (16, 16, 3), np.uint8), "PNG")
            members += synthetic.record_members(f"{s}{i:04d}", {"png": image, "txt": f"a digit {WORDS[5 + i % 3]}".encode()})
        synthetic.write_tar(str(tmp / "good" / f"train-{s:04d}.tar"), members)
    convert_tar.convert(str(tmp / "good" / "*.tar"), str(tmp / "ar"), progress=False)
    (tmp / "corpus.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 5)) for _ in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(tmp / "corpus.txt"), model_prefix=str(tmp / "tok"), model_type="word", vocab_size=16,
        hard_vocab_limit=False, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, user_defined_symbols=["[MASK]"],
        minloglevel=2, num_threads=1)
    bad = tmp / "bad"
    bad.mkdir()
    (bad / "zero-bytes.tar").write_bytes(b"")
    (bad / "not-a-tar.tar").write_bytes((tmp / "ar" / "train-0000.array_record").read_bytes())
    synthetic.write_tar(str(bad / "empty.tar"), [])
    synthetic.write_tar(str(bad / "no-captions.tar"), [(f"{i}.png", synthetic.encode_image(
        np.zeros((16, 16, 3), np.uint8), "PNG")) for i in range(3)])
    return tmp


def cli(files, workdir, *flags):
    return ["train", "--config", str(ROOT / "configs" / "own_data.py") + ":steps=2",
            "--workdir", str(workdir), f"--config.data.tokenizer.path={files / 'tok.model'}",
            "--config.model.variant=micro", "--config.model.attention_impl=xla", "--config.batch_size=16",
            "--config.data.image_size=16", "--config.data.tokenizer.context_length=8",
            "--config.masking.group=2", "--config.masking.fraction=0.5", *flags]


def one_error(capfd, argv) -> str:
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.main(argv)
    assert exit_.value.code == 2
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


@pytest.mark.parametrize("source,kind,other", [("tar", "ar/*.array_record", "array_record"),
                                               ("array_record", "good/*.tar", "tar")])
def test_a_shard_kind_mismatch_is_one_line_before_anything_is_written(files, tmp_path, capfd, source, kind, other):
    line = one_error(capfd, cli(files, tmp_path / "w", f"--config.data.path={files / kind}",
                                f"--config.data.source={source}"))
    assert f"names {other} shards ({files / kind})" in line and f"pass --config.data.source={other}" in line, line
    assert not (tmp_path / "w").exists()


def test_auto_reads_the_kind_from_the_names():
    assert data_paths.source_of_paths("/d/{0000..0009}.tar") == "tar"
    assert data_paths.source_of_paths("/d/a.tar.gz::/e/*.tgz") == "tar"
    assert data_paths.source_of_paths("/d/*.array_record") == "array_record"
    assert data_paths.source_of_paths("/d/coco.array_record-00000-of-00004") == "array_record"
    assert DataConfig(source="auto", path="/d/*.array_record").source == "array_record"
    for mixed in ("/d/*", "/d/a.tar::/d/b.array_record"):
        with pytest.raises(ValueError, match="pass --config.data.source=tar or --config.data.source=array_record"):
            data_paths.source_of_paths(mixed)


@pytest.mark.parametrize("names,expect", [
    (["zero-bytes.tar"], "1 unreadable as tar, e.g. {bad}/zero-bytes.tar (ReadError: empty file)"),
    (["not-a-tar.tar", "zero-bytes.tar"], "2 unreadable as tar, e.g. {bad}/"),
    (["empty.tar", "no-captions.tar"], "1 with no records; records skipped: missing_caption 3"),
])
def test_shards_that_yield_nothing_end_in_one_line(files, tmp_path, capfd, caplog, names, expect):
    bad = files / "bad"
    paths = "::".join(str(bad / n) for n in names)
    caplog.set_level(logging.WARNING, logger="input_pipeline.tar_source")
    start = time.monotonic()
    line = one_error(capfd, cli(files, tmp_path / "w", f"--config.data.path={paths}"))
    assert time.monotonic() - start < 60
    assert f"none of the {len(names)} tar shards read here yields a usable record" in line, line
    assert expect.format(bad=bad) in line, line
    assert "check --config.data.path and --config.data.source" in line and "before the first step" in line
    warned = [r for r in caplog.records if "Corrupt tar shard" in r.getMessage()]
    assert len(warned) <= len(names)  # once per shard, not once per epoch


def test_a_corrupt_shard_is_warned_once_and_counted_every_epoch(files, caplog):
    shards = [str(files / "bad" / "zero-bytes.tar"), str(files / "good" / "train-0000.tar")]
    ds = tar_source.TarStreamDataset(shards, seed=0, shuffle=False, process_index=0, process_count=1,
                                     num_epochs=4, shuffle_buffer_size=8)
    caplog.set_level(logging.WARNING, logger="input_pipeline.tar_source")
    tar_source._warned.discard(shards[0])
    records = list(ds)
    skips = [r for r in records if isinstance(r, tar_source.Skip)]
    assert len(records) - len(skips) == 4 * 24 and len(skips) == 4
    assert sum("Corrupt tar shard" in r.getMessage() for r in caplog.records) == 1


def test_data_that_runs_out_is_one_line(files, tmp_path, capfd):
    line = one_error(capfd, cli(files, tmp_path / "w", f"--config.data.path={files / 'good' / 'train-0000.tar'}",
                                "--config.data.num_epochs=1", "--config.batch_size=32"))
    assert "its data ended (data.num_epochs=1): raise --config.data.num_epochs or lower --config.total_steps" in line


# ------------------------------------------------------------------------------ reads that hang
def test_the_fetcher_hands_over_batches_errors_and_stalls():
    fetch = data_lib.BatchFetcher(iter([1, 2]), timeout_s=5)
    assert [fetch.next(), fetch.next()] == [1, 2]
    with pytest.raises(StopIteration):
        fetch.next()

    release = threading.Event()

    def hangs():
        release.wait()
        yield 3

    fetch = data_lib.BatchFetcher(hangs(), timeout_s=0.5)
    with pytest.raises(data_lib.DataStalled, match="no batch came in 1 s .*--config.data_timeout_s"):
        fetch.next()
    stop = threading.Timer(0.3, lambda: None)
    stop.start()
    assert fetch.next(stop=lambda: not stop.is_alive()) is None and fetch.in_flight  # asked to stop
    release.set()
    assert fetch.next() == 3 and not fetch.in_flight  # the read in flight, not a second one
    fetch.close()
    assert not fetch._thread.is_alive()  # a closed fetcher leaves no thread behind


def test_a_close_that_hangs_is_abandoned_and_one_that_fails_raises(monkeypatch):
    class Closing:
        def __init__(self, close):
            self.close = close

        def __next__(self):
            return 1

    monkeypatch.setattr(data_lib.BatchFetcher, "abandoned", False)
    hang = threading.Event()
    start = time.monotonic()
    data_lib.BatchFetcher(Closing(hang.wait), timeout_s=5).close(timeout_s=0.3)
    assert time.monotonic() - start < 3 and data_lib.BatchFetcher.abandoned  # the command ends without it
    hang.set()

    monkeypatch.setattr(data_lib.BatchFetcher, "abandoned", False)
    def fails():
        raise OSError("a worker is gone")
    with pytest.raises(OSError, match="a worker is gone"):
        data_lib.BatchFetcher(Closing(fails), timeout_s=5).close()
    assert not data_lib.BatchFetcher.abandoned


# A bucket whose reads never answer (a stuck mount), as a filesystem of the path layer.
HANGING_FS = textwrap.dedent("""
    import os, threading, fsspec
    class Hanging(fsspec.AbstractFileSystem):
        protocol = "hang"
        def info(self, path, **kwargs):  # the store answers; its reads do not
            return {"name": path, "size": 1, "type": "file"}
        def _open(self, path, mode="rb", **kwargs):
            if os.environ.get("HANG_MARK"):  # tells the test the read has begun
                open(os.environ["HANG_MARK"], "w").close()
            threading.Event().wait()
    fsspec.register_implementation("hang", Hanging, clobber=True)
""")


def _signal_masks(pid: int) -> str:
    """The blocked / ignored / caught signal masks of `pid`'s threads and of this process."""
    def masks(status: str) -> str:
        return " ".join(line.replace("\t", "") for line in Path(status).read_text().splitlines()
                        if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    try:
        threads = {t: masks(f"/proc/{pid}/task/{t}/status") for t in os.listdir(f"/proc/{pid}/task")}
    except OSError as e:
        return f"no signal masks ({e})"
    return f"child threads {threads}; this process {masks('/proc/self/status')}, SIGINT handler {signal.getsignal(signal.SIGINT)}"


def run_on_a_hanging_bucket(files, tmp_path, *flags, sig=None) -> tuple[int, str, str, float]:
    """(exit code, stdout, stderr, seconds from the signal to the exit) of a run whose first read
    hangs, in its own process (a hung read's threads stay behind in the process that ran it);
    with `sig`, sent once that read has begun."""
    # SIGINT as a terminal's Ctrl-C finds it: a test run started in the background (`make test &`
    # from a script) hands its children SIGINT ignored, and Python then leaves it ignored.
    script = ("import signal, sys\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n" + HANGING_FS
              + "from prolip_jax import train\ntrain.run_command(sys.argv)\n")
    argv = cli(files, tmp_path / "w", "--config.data.path=hang://bucket/x.tar", "--config.data.source=tar", *flags)
    mark = tmp_path / "reading"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
           "HANG_MARK": str(mark), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen([sys.executable, "-c", script, *argv[1:]], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        sent = time.monotonic()
        if sig is not None:
            proc.send_signal(sig)
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # every thread's stack (faulthandler) into the failure
            masks = _signal_masks(proc.pid)
            proc.send_signal(signal.SIGABRT)
            out, err = proc.communicate(timeout=30)
            pytest.fail(f"no exit 60 s after the signal; {masks}; stdout:\n{out}\nstderr:\n{err[-6000:]}")
    finally:
        proc.kill()
    return proc.returncode, out, err, time.monotonic() - sent


def test_a_stalled_pipeline_is_one_line(files, tmp_path):
    code, out, err, _ = run_on_a_hanging_bucket(files, tmp_path, "--config.data_timeout_s=1")
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1, err
    assert lines[0].startswith("error: the data pipeline failed before the first step (no batch came in 1 s"), err
    assert "--config.data_timeout_s" in lines[0]


def test_sigterm_stops_a_run_waiting_for_data(files, tmp_path):
    """A preemption: nothing trained, nothing saved, exit 0 within seconds."""
    code, out, err, seconds = run_on_a_hanging_bucket(files, tmp_path, sig=signal.SIGTERM)
    assert code == 0 and seconds < 15, err
    assert "preempted before the first step: nothing to save; rerun the same command" in out, out + err
    assert not err.strip(), err


def test_ctrl_c_stops_a_run_waiting_for_data_in_one_line(files, tmp_path):
    code, out, err, seconds = run_on_a_hanging_bucket(files, tmp_path, sig=signal.SIGINT)
    assert code == 130 and seconds < 15, err
    assert err.strip() == ("interrupted (Ctrl-C): rerun the same command to resume from the newest checkpoint "
                           f"in {tmp_path / 'w'}")
