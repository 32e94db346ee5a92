"""Resuming the data on another host or worker count (a resized slice, another node count):
exact sources continue the global record sequence with nothing lost or repeated; tar shards
are re-dealt and the cost is counted; the trainer does it from its checkpoints."""
import json
import logging
import re

import pytest

from input_pipeline import pipeline
from conftest import ALL_KEYS, NUM_SHARDS, PER_SHARD, KeyTokenizer, make_shard_data

N = NUM_SHARDS * PER_SHARD
TOK = KeyTokenizer()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shard_data(tmp_path_factory.mktemp("elastic_data"), 24, 20)


def _cfg(data, source, **kw):
    return {**dict(source=source, path=data[source], batch_size=8, image_size=16, seed=0,
                   shuffle_buffer_size=5, augment=False), **kw}


def _hosts(cfg, count):
    return [pipeline.build_train_iterator(cfg, TOK, process_index=h, process_count=count)
            for h in range(count)]


def _global_batches(iterators, n):
    """n global batches (the record keys of all hosts' rows, as sets) and every host's state."""
    batches = [set() for _ in range(n)]
    for it in iterators:
        for i in range(n):
            batches[i] |= set(next(it)["text"][:, 0].tolist())
    return batches, [json.loads(json.dumps(it.get_state())) for it in iterators]


def test_exact_source_resumes_on_2_then_1_then_2_hosts(data, caplog):
    cfg = _cfg(data, "array_record")
    expected, _ = _global_batches(_hosts(cfg, 1), 15)   # an uninterrupted run, 1.25 epochs

    first, states = _global_batches(_hosts(cfg, 2), 5)
    one = _hosts(cfg, 1)[0]
    with caplog.at_level(logging.WARNING):
        one.set_states(states)
    assert "2 hosts x 0 workers -> 1 hosts x 0 workers (after 5 batches)" in caplog.text
    assert "no record lost or repeated" in caplog.text
    second, states = _global_batches([one], 5)
    two = _hosts(cfg, 2)
    for it in two:
        it.set_state(states[0])   # a one-process state suffices for any layout
    third, states = _global_batches(two, 5)
    assert first + second + third == expected   # the same records in the same global batches
    flat = [k for b in expected[:12] for k in b]
    assert len(flat) == len(set(flat)) == N and set(flat) == ALL_KEYS
    assert sum(s["batches"] for s in states) == 2 * 15


def test_exact_source_resumes_on_another_worker_count(data):
    cfg = _cfg(data, "array_record")
    expected, _ = _global_batches(_hosts(cfg, 1), 12)   # one epoch
    first, states = _global_batches(_hosts(cfg, 2), 4)
    with pipeline.build_train_iterator(dict(cfg, num_workers=2), TOK, process_index=0,
                                       process_count=1) as it:
        it.set_states(states)
        second, states = _global_batches([it], 4)
    with pipeline.build_train_iterator(dict(cfg, num_workers=1), TOK, process_index=0,
                                       process_count=1) as it:
        it.set_state(states[0])
        third, _ = _global_batches([it], 4)
    assert first == expected[:4] and third == expected[8:]
    # Two workers group the records of batches 4..7 differently, but read exactly them.
    assert set().union(*second) == set().union(*expected[4:8])
    assert sum(len(b) for b in second) == 32


def test_tar_shards_are_re_dealt_and_the_cost_counted(data, caplog):
    cfg = _cfg(data, "tar", num_epochs=1)
    seen = []
    hosts = _hosts(cfg, 2)
    for it in hosts:
        seen += [k for _ in range(3) for k in next(it)["text"][:, 0].tolist()]
    states = [json.loads(json.dumps(it.get_state())) for it in hosts]
    one = _hosts(cfg, 1)[0]
    with caplog.at_level(logging.WARNING):
        one.set_states(states)
    [line] = [r.getMessage() for r in caplog.records if "new layout" in r.getMessage()]
    assert "2 hosts x 0 workers -> 1 hosts x 0 workers" in line
    twice = int(line.split("; ")[1].split(" records seen twice")[0])
    assert 0 < twice <= 2 * 5   # at most one shuffle window per old worker
    rest = [k for b in one for k in b["text"][:, 0].tolist()]   # to the end of the epoch
    keys = seen + rest
    assert len(keys) - len(set(keys)) == twice   # exactly the counted records come twice
    assert len(ALL_KEYS - set(keys)) < 8 and set(keys) <= ALL_KEYS   # only the last partial
    assert len(keys) + len(ALL_KEYS - set(keys)) == N + twice        # batch is dropped


def test_other_differences_are_still_refused(data):
    it = _hosts(_cfg(data, "array_record"), 2)
    next(it[0]), next(it[1])
    states = [it[0].get_state(), it[1].get_state()]
    other = pipeline.build_train_iterator(_cfg(data, "array_record", seed=3), TOK,
                                          process_index=0, process_count=1)
    with pytest.raises(ValueError, match=r"^the data pipeline's settings are not those of the run being resumed "
                                         r"\(seed: saved 0, now 3\): resume with the same settings, or start a "
                                         r"new --workdir$"):
        other.set_states(states)
    fewer = pipeline.build_train_iterator(_cfg(data, "array_record", seed=3, path=data["array_record"].replace(
        "*.array_record", "0000[0-6]*.array_record")), TOK, process_index=0, process_count=1)
    with pytest.raises(ValueError, match=rf"\(files: saved {NUM_SHARDS} files from '\S+' on, now "
                                         rf"{NUM_SHARDS - 1} files from '\S+' on, num_records: saved {N}, now {N - PER_SHARD}, "
                                         r"seed: saved 0, now 3\)"):
        fewer.set_states(states)
    one = _hosts(_cfg(data, "array_record"), 1)[0]
    with pytest.raises(ValueError, match="each of the 2 saved hosts exactly once"):
        one.set_states(states[:1])
    with pytest.raises(ValueError, match="Pass the states of all saved hosts"):
        one.set_state(states[1])


@pytest.mark.parametrize("source", ["tar", "array_record"])
def test_moved_files_resume_and_other_files_are_named(data, source, tmp_path, caplog):
    """The same files under another directory (a copy to local disk, a new mount, a bucket) are
    the same records: the run resumes at its position, with one warning. Other files are refused
    in one line that says which (a rename, one shard fewer, or a state that predates the names)."""
    import shutil
    from pathlib import Path

    first = Path(data["array_record"]).parent if source == "array_record" else Path(data["tar"]).parent
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    path = data[source].replace(str(first), str(moved))
    it = _hosts(_cfg(data, source), 1)[0]
    _, (state,) = _global_batches([it], 3)
    expected, _ = _global_batches([it], 2)
    again = _hosts(_cfg(data, source, path=path), 1)[0]
    with caplog.at_level(logging.WARNING):
        again.set_state(state)
        again.set_state(state)
    assert caplog.text.count("The data files moved") == 1 and str(moved) in caplog.text
    assert _global_batches([again], 2)[0] == expected

    other = sorted(moved.iterdir())
    other[0].rename(other[0].with_name("renamed" + other[0].suffix))
    renamed = _hosts(_cfg(data, source, path=str(moved / f"*{other[0].suffix}")), 1)[0]
    with pytest.raises(ValueError, match=rf"^the data files are not those of the run being resumed \(it read "
                                         rf"{NUM_SHARDS} files from '{re.escape(str(first))}/\S+' on; this run reads "
                                         rf"{NUM_SHARDS} files from '{re.escape(str(moved))}/\S+' on\): resume "
                                         r"with the same files, or start a new --workdir$"):
        renamed.set_state(state)
    older = dict(state, data_files=None)   # written before states named their files
    with pytest.raises(ValueError, match=r"^the data \(its files or the source's settings\) is not that of "
                                         rf"the run being resumed \(this run reads {NUM_SHARDS} files from"):
        again.set_state(older)


def test_a_dataset_name_is_not_matched_by_its_last_part():
    """tfds names are not paths: 'tfds:a/train' and 'tfds:b/train' are other data."""
    import grain
    from input_pipeline.sources.base import Records

    def iterator(name):
        records = Records(files=[f"tfds:{name}/train"], relocatable=False)
        fingerprint = {"source": "tfds", "files": pipeline._digest(records.files)}
        return pipeline.InputIterator(grain.MapDataset.range(1).to_iter_dataset().__iter__(), fingerprint,
                                      data_files=pipeline._files_summary(records))

    state = iterator("a").get_state()
    with pytest.raises(ValueError, match=r"^the data files are not those of the run being resumed \(it read "
                                         r"'tfds:a/train'; this run reads 'tfds:b/train'\)"):
        iterator("b").set_state(state)


def test_signed_urls_are_recorded_without_their_secrets():
    """A state names its first file; a signed URL's user, password and signature stay out of the
    checkpoint, and a re-signed URL is the same file."""
    from input_pipeline.sources.base import Records

    def summary(signature):
        files = [f"https://me:hunter2@host/d/{i}.tar?sig={signature}" for i in range(3)]
        return pipeline._files_summary(Records(files=files))

    a, b = summary("SIGNED_ONE"), summary("SIGNED_TWO")
    assert a["first"] == "https://host/d/0.tar" and a["names"] == b["names"]
    assert "hunter2" not in json.dumps(a) and "SIGNED" not in json.dumps(a)


def test_trainer_resumes_its_data_on_2_then_1_then_2_processes(tmp_path):
    """The trainer's own checkpoints: 2 processes (2 steps) -> 1 process (to step 4) -> 2
    processes (to step 6) on the demo data; the data position ends at 6 global batches."""
    import subprocess
    import sys

    from input_pipeline import demo
    from test_train_processes import ARGS, ROOT, _env, _free_port

    cache = tmp_path / "cache"
    demo.get_demo(cache_dir=str(cache), image_size=32, num_train=64, context_length=8)  # micro
    args = [*ARGS, "--config.data.demo.num_train=64", "--config.checkpoint_steps=100",
            "--workdir", str(tmp_path / "w")]

    train = [sys.executable, "-m", "prolip_jax.train", "--config", "configs/tiny.py:steps=6,data=demo,size=micro", *args]

    def run(steps, processes):
        # One program for every run (total_steps 6, --stop_at_step before it), so the last run
        # reads both processes' compiles of the first from a cache of its own.
        cmd = train + ([f"--stop_at_step={steps}"] if steps < 6 else [])
        env = dict(_env(1), PROLIP_JAX_CACHE=str(cache),   # one device each: compiles fast
                   JAX_ENABLE_COMPILATION_CACHE="true", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))
        if processes == 1:
            procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True)]
        else:
            port = _free_port()
            procs = [subprocess.Popen(
                cmd + ["--coordinator_address", f"127.0.0.1:{port}", "--num_processes",
                       str(processes), "--process_id", str(i)], cwd=ROOT, env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for i in range(processes)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        for p, out in zip(procs, outs):
            assert p.returncode == 0, out[-3000:]
        return outs[0]

    run(2, 2)
    out = run(4, 1)
    assert "2 hosts x 0 workers -> 1 hosts x 0 workers (after 2 batches)" in out, out[-2000:]
    out = run(6, 2)
    assert "1 hosts x 0 workers -> 2 hosts x 0 workers (after 4 batches)" in out, out[-2000:]
    data = tmp_path / "w" / "checkpoints" / "6" / "data"
    states = [json.loads((data / f"process_{i}-of-2.json").read_text()) for i in range(2)]
    for s in states:   # no skipped records: the stream is read up to 6 batches of 16, no gap
        assert s["origin"] == {"base": 4 * 16, "done": []} and s["batches"] == 6
        assert s["origin"]["base"] + 2 * s["source"]["next_index"] == 6 * 16

    # A stop the run is already past: one line, exit 2, before anything is compiled or written.
    saved = sorted((tmp_path / "w" / "checkpoints").iterdir())
    late = subprocess.run(train + ["--stop_at_step=4"], cwd=ROOT, env=dict(_env(1), PROLIP_JAX_CACHE=str(cache)),
                          capture_output=True, text=True, timeout=300)
    assert late.returncode == 2 and late.stderr.count("\n") == 1, late.stderr[-2000:]
    assert re.fullmatch(r"error: --stop_at_step=4: the run in \S+ is already at step 6\n", late.stderr), late.stderr
    assert sorted((tmp_path / "w" / "checkpoints").iterdir()) == saved
