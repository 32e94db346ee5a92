"""Input pipeline: determinism, exact resume, host sharding, batch format, errors."""
import json
import os
import sys

import numpy as np
import pytest

from input_pipeline import pipeline
from input_pipeline.shards import expand_braces, expand_paths
from prolip_jax.core.normalization import normalize_on_device
from conftest import ALL_KEYS, NUM_SHARDS, PER_SHARD, KeyTokenizer, make_shard_data

N = NUM_SHARDS * PER_SHARD
TOK = KeyTokenizer()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return make_shard_data(tmp_path_factory.mktemp("input_data"), 40, 32)


def _config(data, source, **kw):
    cfg = dict(source=source, path=data[source], batch_size=8, image_size=16, seed=0,
               shuffle_buffer_size=5)
    cfg.update(kw)
    return cfg


def _take(it, n):
    return [next(it) for _ in range(n)]


def _keys(batch):
    keys = batch["text"][:, 0]
    return keys[batch["mask"]] if "mask" in batch else keys


def _assert_same(batches_a, batches_b):
    assert len(batches_a) == len(batches_b)
    for a, b in zip(batches_a, batches_b):
        assert a.keys() == b.keys()
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_batch_format(data):
    it = pipeline.build_train_iterator(_config(data, "array_record"), TOK, process_index=0,
                                       process_count=1)
    batch = next(it)
    assert set(batch) == {"image", "text"}
    assert batch["image"].shape == (8, 16, 16, 3) and batch["image"].dtype == np.float32
    assert batch["text"].shape == (8, 4) and batch["text"].dtype == np.int32
    assert set(_keys(batch)) <= ALL_KEYS
    # OpenAI-normalised pixels lie in [(0 - mean) / std, (1 - mean) / std].
    assert -1.8 < batch["image"].min() < 0 < batch["image"].max() < 2.2
    # uint8 output + on-device normalisation gives the same numbers.
    it8 = pipeline.build_train_iterator(_config(data, "array_record", image_dtype="uint8"),
                                        TOK, process_index=0, process_count=1)
    b8 = next(it8)
    assert b8["image"].dtype == np.uint8
    np.testing.assert_allclose(np.asarray(normalize_on_device(b8["image"])),
                               batch["image"], atol=1e-5)
    np.testing.assert_array_equal(b8["text"], batch["text"])


@pytest.mark.parametrize("source", ["tar", "array_record"])
def test_same_seed_same_batches(data, source):
    def run(seed):
        it = pipeline.build_train_iterator(_config(data, source, seed=seed), TOK,
                                           process_index=0, process_count=1)
        return _take(it, 4)
    a, b, c = run(0), run(0), run(1)
    _assert_same(a, b)
    assert [_keys(x).tolist() for x in a] != [_keys(x).tolist() for x in c]


@pytest.mark.parametrize("source,skip", [("tar", 0), ("tar", 3), ("tar", 11),
                                         ("array_record", 5), ("array_record", 13)])
def test_restore_gives_identical_continuation(data, source, skip):
    # 12 batches of 8 make one epoch, so skip=11 and 13 resume across an epoch boundary.
    cfg = _config(data, source)
    it = pipeline.build_train_iterator(cfg, TOK, process_index=0, process_count=1)
    _take(it, skip)
    state = json.loads(json.dumps(it.get_state()))   # must survive JSON (orbax writes JSON)
    expected = _take(it, 4)
    resumed = pipeline.build_train_iterator(cfg, TOK, process_index=0, process_count=1)
    resumed.set_state(state)
    _assert_same(expected, _take(resumed, 4))   # same records, same augmented pixels
    assert resumed.stats["batches"] == skip + 4


@pytest.mark.parametrize("source", ["tar", "array_record"])
def test_restore_with_worker_processes(data, source):
    cfg = _config(data, source, num_workers=2)
    with pipeline.build_train_iterator(cfg, TOK, process_index=0, process_count=1) as it:
        _take(it, 3)
        state = json.loads(json.dumps(it.get_state()))
        expected = _take(it, 3)
    with pipeline.build_train_iterator(cfg, TOK, process_index=0, process_count=1) as it:
        it.set_state(state)
        got = _take(it, 3)
    _assert_same(expected, got)
    # Two workers read disjoint halves: the first batches cover many shards.
    assert len({k // 10_000 for b in expected for k in _keys(b)}) >= 2


def test_orbax_checkpoint_roundtrip(data, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    import grain
    cfg = _config(data, "array_record")
    it = pipeline.build_train_iterator(cfg, TOK, process_index=0, process_count=1)
    _take(it, 2)
    with ocp.CheckpointManager(str(tmp_path / "ckpt")) as mngr:
        mngr.save(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mngr.wait_until_finished()
        expected = _take(it, 3)
        fresh = pipeline.build_train_iterator(cfg, TOK, process_index=0, process_count=1)
        mngr.restore(2, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(fresh)))
    _assert_same(expected, _take(fresh, 3))


def test_hosts_disjoint_complete_and_reshuffled_per_epoch(data):
    hosts = 4   # 96 records -> 24 per host per epoch -> 6 batches of 16/4 = 4 rows
    epochs = {0: [], 1: []}
    for h in range(hosts):
        it = pipeline.build_train_iterator(_config(data, "array_record", batch_size=16), TOK,
                                           process_index=h, process_count=hosts)
        batches = _take(it, 12)
        assert all(b["text"].shape[0] == 4 for b in batches)
        epochs[0].append([k for b in batches[:6] for k in _keys(b)])
        epochs[1].append([k for b in batches[6:] for k in _keys(b)])
    for e in (0, 1):
        flat = [k for host in epochs[e] for k in host]
        assert len(flat) == len(set(flat)) == N and set(flat) == ALL_KEYS
    assert epochs[0] != epochs[1]   # a fresh permutation each epoch


def test_tar_hosts_disjoint_and_complete(data):
    seen = []
    for h in range(2):   # 8 shards -> 4 per host -> 48 records -> 12 batches of 4 rows
        it = pipeline.build_train_iterator(_config(data, "tar", num_epochs=1), TOK,
                                           process_index=h, process_count=2)
        seen.append([k for b in it for k in _keys(b)])
    assert len(seen[0]) == len(seen[1]) == N // 2
    assert not set(seen[0]) & set(seen[1]) and set(seen[0]) | set(seen[1]) == ALL_KEYS


def test_tar_epochs_complete_and_reshuffled(data):
    it = pipeline.build_train_iterator(_config(data, "tar", num_epochs=2), TOK, process_index=0,
                                       process_count=1)
    keys = [k for b in it for k in _keys(b)]
    assert len(keys) == 2 * N and set(keys[:N]) == set(keys[N:]) == ALL_KEYS
    assert keys[:N] != keys[N:]
    # Shard-level shuffle plus windows of 5: neither shard order nor record order is kept.
    assert [k // 10_000 for k in keys[:N]] != sorted(k // 10_000 for k in keys[:N])


def test_augmentation_independent_of_host_count(data):
    def first_epoch_images(hosts):
        out = {}
        for h in range(hosts):
            it = pipeline.build_train_iterator(_config(data, "array_record", batch_size=8),
                                               TOK, process_index=h, process_count=hosts)
            for b in _take(it, 12):   # one epoch: 96 / 8 rows, or 48 / 4 rows per host
                out.update(zip(_keys(b).tolist(), b["image"]))
        return out
    one, two = first_epoch_images(1), first_epoch_images(2)
    assert one.keys() == two.keys() == ALL_KEYS
    for k in ALL_KEYS:   # randomness is keyed by (seed, epoch, record), not by position
        np.testing.assert_array_equal(one[k], two[k])


@pytest.mark.parametrize("source", ["array_record", "tar"])
def test_eval_iterator_covers_everything_once_with_equal_batch_counts(data, source):
    hosts, counts, keys = 3, [], []
    for h in range(hosts):
        it = pipeline.build_eval_iterator(_config(data, source, batch_size=15), TOK,
                                          process_index=h, process_count=hosts)
        batches = list(it)
        counts.append(len(batches))
        for b in batches:
            assert b["mask"].dtype == bool and b["image"].shape == (5, 16, 16, 3)
            assert (b["text"][~b["mask"]] == TOK.pad_id).all()
            keys += _keys(b).tolist()
    assert sorted(keys) == sorted(ALL_KEYS)
    if source == "array_record":   # padded so that every host runs the same number of steps
        assert counts == [7, 7, 7]


def test_state_from_another_configuration_is_rejected(data):
    it = pipeline.build_train_iterator(_config(data, "array_record"), TOK, process_index=0,
                                       process_count=1)
    next(it)
    other = pipeline.build_train_iterator(_config(data, "array_record", seed=5), TOK,
                                          process_index=0, process_count=1)
    with pytest.raises(ValueError, match="seed: saved 0, now 5"):
        other.set_state(it.get_state())


def test_configuration_errors_are_clear(data, tmp_path):
    with pytest.raises(FileNotFoundError, match="1 of 2 data files do not exist"):
        pipeline.build_train_iterator(_config(
            data, "tar", path=data["tar"].replace("{00000..00007}", "{00007,00009}")),
            TOK, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="never closed"):
        pipeline.build_train_iterator(_config(data, "tar", path="shards/{00000..00009.tar"),
                                      TOK, process_index=0, process_count=1)
    with pytest.raises(ValueError, match="not divisible by the 3 hosts"):
        pipeline.build_train_iterator(_config(data, "array_record"), TOK, process_index=0,
                                      process_count=3)
    with pytest.raises(ValueError, match="cannot feed 2 hosts x 8 worker"):
        pipeline.build_train_iterator(_config(data, "tar", num_workers=8), TOK,
                                      process_index=0, process_count=2)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['shuffle_buffer'\] in data \(did you mean 'shuffle_buffer_size'\?\)"):
        pipeline.build_train_iterator(_config(data, "tar", shuffle_buffer=3), TOK,
                                      process_index=0, process_count=1)
    with pytest.raises(ValueError, match="No tokenizer"):
        pipeline.build_train_iterator(_config(data, "tar"), None, process_index=0,
                                      process_count=1)


def test_brace_and_glob_expansion(tmp_path):
    assert expand_braces("s/{00008..00011}.tar") == [f"s/{i:05d}.tar" for i in range(8, 12)]
    assert expand_braces("{a,b}-{1..2}") == ["a-1", "a-2", "b-1", "b-2"]
    assert expand_braces("x{9..11}") == ["x9", "x10", "x11"]
    for bad, msg in [("a}b{", "has no opening"), ("x{abc}y", "neither a range")]:
        with pytest.raises(ValueError, match=msg):
            expand_braces(bad)
    for name in ("b.tar", "a.tar"):
        (tmp_path / name).write_bytes(b"")
    assert expand_paths(str(tmp_path / "*.tar")) == [str(tmp_path / "a.tar"),
                                                     str(tmp_path / "b.tar")]
    assert expand_paths("gs://bucket/{0..1}.tar") == ["gs://bucket/0.tar", "gs://bucket/1.tar"]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        expand_paths(str(tmp_path / "*.array_record"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")
def test_shared_memory_batch_is_prefaulted():
    """shared_batches.prefault maps a fresh shared-memory batch in at once: writing it afterwards
    takes (almost) no page faults, where the same write into an untouched segment faults every
    page; the contents stay zero and writable."""
    import resource

    from grain._src.python.ipc import shared_memory_array

    from input_pipeline import shared_batches

    def faults_writing(prefault: bool) -> tuple[int, np.ndarray]:
        a = shared_memory_array.SharedMemoryArray((16, 64, 64, 3), np.uint8)
        a.unlink_on_del()
        if prefault:
            shared_batches.prefault(a)
            assert not a.any()   # (reading maps the pages too: only after the prefault)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        a[...] = 7
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, a

    pages = 16 * 64 * 64 * 3 // 4096
    plain, _ = faults_writing(False)
    done, a = faults_writing(True)
    if shared_batches._madvise is False:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (< 5.14)")
    assert plain >= pages // 2, (plain, pages)
    assert done <= pages // 10, (done, pages)
    assert (a == 7).all()


def test_one_worker_builds_batches_in_shared_memory(data):
    """With worker processes the batch is built in shared memory, also with one worker (grain's
    mp_prefetch enables that itself only for two or more, and copies each batch otherwise), in
    a ring of reused segments: 12 batches through 5 slots (2 x per_worker_buffer_size + 3). The
    main process hands out copies it owns, equal to the in-process pipeline's batches, and no
    segment is left behind once the iterator is closed."""
    import grain

    def batch_datasets(ds):   # through grain's wrappers (parents, interleaved worker datasets)
        found, todo = [], [ds]
        while todo:
            d = todo.pop()
            if isinstance(d, pipeline._BatchDataset):
                found.append(d)
                continue
            for v in vars(d).values():
                for item in (v if isinstance(v, (list, tuple)) else [v]):
                    if isinstance(item, (grain.IterDataset, grain.MapDataset)):
                        todo.append(item)
        return found

    ds, _ = pipeline.build_dataset(_config(data, "tar", num_workers=1), TOK, process_index=0, process_count=1)
    assert [d.shared_memory for d in batch_datasets(ds)] == [True]
    ds, _ = pipeline.build_dataset(_config(data, "tar", num_workers=0), TOK, process_index=0, process_count=1)
    assert [d.shared_memory for d in batch_datasets(ds)] == [False]
    from input_pipeline import shared_batches
    sent = []
    with pipeline.build_train_iterator(_config(data, "tar", num_workers=1, per_worker_buffer_size=1),
                                       TOK, process_index=0, process_count=1) as it:
        receive = it._receiver.receive
        it._receiver.receive = lambda value: receive(sent.append(value) or value)
        got = _take(it, 12)
    assert all(isinstance(v, shared_batches.SharedImages) for v in sent) and len(sent) == 12
    assert len({v.data for v in sent}) == 5 and {v.slot for v in sent} == set(range(5))
    assert all(b["image"].flags.owndata and type(b["image"]) is np.ndarray for b in got)
    if os.path.isdir("/dev/shm"):   # the worker unlinked its ring as it stopped
        assert not [v for v in sent if os.path.exists(f"/dev/shm/{v.data}")]
        assert not os.path.exists(f"/dev/shm/{sent[0].flags}")
    with pipeline.build_train_iterator(_config(data, "tar", num_workers=0), TOK, process_index=0,
                                       process_count=1) as it:
        _assert_same(got, _take(it, 12))


def test_image_ring_reuses_free_slots_and_never_overwrites_busy_ones():
    """ImageRing/Receiver in one process: a slot is reused only after the receiver copied it out;
    with every slot busy the batch goes in a one-off segment; received arrays are copies."""
    import gc

    from grain._src.python.ipc import shared_memory_array

    from input_pipeline import shared_batches
    ring, receiver = shared_batches.ImageRing(2), shared_batches.Receiver()
    a, first = ring.take((2, 3), np.uint8)
    a[...] = 1
    b, second = ring.take((2, 3), np.uint8)
    b[...] = 2
    c, third = ring.take((2, 3), np.uint8)   # both slots busy: a one-off grain segment
    assert (first.slot, second.slot) == (0, 1) and c is third
    assert isinstance(third, shared_memory_array.SharedMemoryArray)
    third.unlink_on_del()
    got = receiver.receive(first)
    assert got.tolist() == [[1] * 3] * 2 and receiver.receive("other") == "other"
    d, fourth = ring.take((2, 3), np.uint8)   # slot 0 again, the same segment
    assert (fourth.slot, fourth.data) == (0, first.data)
    d[...] = 4
    assert got.tolist() == [[1] * 3] * 2     # the received copy is not the slot
    assert receiver.receive(second).tolist() == [[2] * 3] * 2
    assert receiver.receive(fourth).tolist() == [[4] * 3] * 2
    e, fifth = ring.take((4, 3), np.float32)   # larger than the slot: a new segment for it
    assert fifth.data not in (first.data, second.data)
    e[...] = 0.5
    assert receiver.receive(fifth).dtype == np.float32 and receiver.receive(fifth).sum() == 6
    g, sixth = ring.take((4, 3), np.float32)   # both slots busy again, never received
    h, seventh = ring.take((4, 3), np.float32)
    assert {sixth.slot, seventh.slot} == {0, 1}
    _, eighth = ring.take((4, 3), np.float32)
    assert isinstance(eighth, shared_memory_array.SharedMemoryArray)
    eighth.unlink_on_del()
    del _
    ring.release_all()   # a worker whose state was set: grain dropped what it had sent
    assert isinstance(ring.take((4, 3), np.float32)[1], shared_batches.SharedImages)
    receiver.close()
    names = [first.flags, second.data, fifth.data]
    del a, b, c, d, e, g, h, ring
    gc.collect()
    if os.path.isdir("/dev/shm"):
        assert not [n for n in names if os.path.exists(f"/dev/shm/{n}")]
    with pytest.raises(ValueError, match="at least one slot"):
        shared_batches.ImageRing(0)


def test_image_ring_says_when_dev_shm_is_too_small(monkeypatch):
    """A full /dev/shm would kill the worker by SIGBUS mid-write; the ring refuses first, naming
    the sizes and what to change (grain re-raises it in the main process)."""
    from input_pipeline import shared_batches
    monkeypatch.setattr(shared_batches, "_free_shm_bytes", lambda: 10 * 2**20)
    ring = shared_batches.ImageRing(1)
    with pytest.raises(OSError, match=r"/dev/shm has 10 MiB free.*needs 36.8 MiB.*--shm-size"):
        ring.take((256, 224, 224, 3), np.uint8)
    array, sent = ring.take((64, 16, 16, 3), np.uint8)   # small enough: fine
    assert isinstance(sent, shared_batches.SharedImages)
    shared_batches.Receiver().receive(sent)
    del array
