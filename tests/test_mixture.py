"""Mixtures of data sources (input_pipeline/mixture.py): drawn proportions, staged weights,
exact per-source resume (also on another host count), per-source counts, one-line errors."""
import collections

import numpy as np
import pytest

from input_pipeline import convert_tar, mixture, synthetic
from input_pipeline.config import DataConfig
from conftest import KeyTokenizer

TOK = KeyTokenizer()
PER_SHARD = 12


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Nine tar shards: source k reads shards 3k..3k+2 (record key // 10_000 // 3 = k); the third
    source as ArrayRecord, to mix kinds."""
    root = tmp_path_factory.mktemp("mixture_data")
    synthetic.make_jpeg_shards(str(root / "tar"), 9, PER_SHARD, 24, 20, seed=3)
    convert_tar.convert(str(root / "tar" / "0000[678].tar"), str(root / "ar"), progress=False)
    return [dict(source="tar", path=str(root / "tar" / "{00000..00002}.tar")),
            dict(source="tar", path=str(root / "tar" / "{00003..00005}.tar")),
            dict(source="array_record", path=str(root / "ar" / "*.array_record"))]


def _config(shards, weights, **kw):
    entries = tuple(dict(s, weight=w, name=n) for s, w, n in zip(shards, weights, ("a", "b", "c")))
    return DataConfig.from_mapping(dict(dict(batch_size=16, image_size=8, seed=0, shuffle_buffer_size=4,
                                             mixture_chunks=8, mixture=entries), **kw))


def _source_of(batch):
    return batch["text"][:, 0] // 10_000 // 3


def _iterator(cfg, h=0, p=1):
    return mixture.build_mixture_iterator(cfg, TOK, process_index=h, process_count=p)


class _Counting:
    """A source's iterator stand-in: chunks of `rows` rows of its index k."""

    def __init__(self, k, rows):
        self.k, self.rows, self.n = k, rows, 0

    def __next__(self):
        self.n += self.rows
        return {"image": np.zeros((self.rows, 1, 1, 3), np.uint8), "text": np.full((self.rows, 1), self.k)}

    @property
    def stats(self):
        return {"examples": self.n, "skipped": 0}


def test_drawn_proportions_follow_the_weights_and_the_stages(shards):
    """10,000 samples within 2% of the weights (within one chunk at any point, by construction);
    from the stage's step on, its weights, a zero weight drawing nothing; per-source counts."""
    weights = (0.5, 0.3, 0.2)
    cfg = _config(shards, weights, mixture_stages=((625, (0.0, 0.25, 0.75)),))
    it = mixture.MixtureIterator(cfg, mixture.parts(cfg), [_Counting(k, 2) for k in range(3)])
    drawn = np.zeros(3)
    for b in range(625):   # 10,000 samples
        drawn += np.bincount(next(it)["text"][:, 0], minlength=3)
        assert np.abs(drawn - np.multiply(weights, 16 * (b + 1))).max() <= 2   # one chunk of 2
    assert np.abs(drawn / 10_000 - weights).max() < 0.02
    per_batch = [np.bincount(next(it)["text"][:, 0], minlength=3) for _ in range(50)]
    assert all(b[0] == 0 for b in per_batch)   # weight 0 from step 625 on
    later = np.sum(per_batch, axis=0)
    assert np.abs(later - np.multiply((0.0, 0.25, 0.75), 800)).max() <= 2, later
    stats = it.stats
    assert [stats[f"{n}/examples"] for n in "abc"] == list(drawn + later)
    assert stats["examples"] == 675 * 16 and stats["batches"] == 675


def test_the_real_pipelines_mix_in_proportion(shards):
    """The three real pipelines (two tar, one ArrayRecord) behind the mixture: each batch's
    records come from the sources in the weights' proportions, none skipped."""
    with _iterator(_config(shards, (0.5, 0.25, 0.25))) as it:
        for _ in range(20):
            assert list(np.bincount(_source_of(next(it)), minlength=3)) == [8, 4, 4]
        stats = it.stats
    assert [stats[f"{n}/examples"] for n in "abc"] == [160, 80, 80] and stats["skipped"] == 0
    assert all(stats[f"{n}/skipped"] == 0 for n in "abc") and stats["a/share"] == 0.5


def test_a_resumed_mixture_draws_the_same_batches(shards):
    """State after 7 batches, restored into a fresh iterator: the next batches are the
    uninterrupted run's (each source at its own position, the scheduler's credits with it)."""
    cfg = _config(shards, (0.45, 0.35, 0.2))
    with _iterator(cfg) as it:
        for _ in range(7):
            next(it)
        state = it.get_state()
        want = [next(it) for _ in range(9)]
    with _iterator(cfg) as it:
        it.set_state(state)
        got = [next(it) for _ in range(9)]
        assert it.stats["batches"] == 16
    for a, b in zip(want, got):
        assert a.keys() == b.keys() == {"image", "text"}
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])


def test_a_mixture_resumes_on_another_host_count(shards):
    """One host's state after 5 batches resumed on two hosts: each global batch after it holds
    the records the one-host run draws (the sources are random-access and tar; tar's shards are
    re-dealt on a new layout, so for it the check is what was left: nothing read twice)."""
    cfg = _config(shards, (0.0, 0.5, 0.5))   # b (tar) and c (ArrayRecord)
    with _iterator(cfg) as it:
        for _ in range(5):
            next(it)
        state = it.get_state()
        one = [next(it) for _ in range(6)]
    two = [_iterator(cfg, h, 2) for h in range(2)]
    try:
        for it in two:
            it.set_states([state])
        for step, batch in enumerate(one):
            parts = [next(it) for it in two]
            keys = np.concatenate([p["text"][:, 0] for p in parts])
            assert len(keys) == 16
            from_c = lambda k: k[k // 10_000 // 3 == 2]  # noqa: E731
            assert sorted(from_c(keys)) == sorted(from_c(batch["text"][:, 0])), step   # exact
            assert collections.Counter(_source_of({"text": keys[:, None]})) == \
                collections.Counter(_source_of(batch))   # the same composition
    finally:
        for it in two:
            it.close()


def test_a_mixture_state_and_a_one_source_state_are_not_confused(shards):
    from input_pipeline import pipeline

    cfg = _config(shards, (1, 1, 1))
    with _iterator(cfg) as it:
        mixed = it.get_state()
    one = pipeline.build_train_iterator(DataConfig.from_mapping(dict(shards[2], batch_size=16, image_size=8)), TOK,
                                        process_index=0, process_count=1)
    with one:
        with pytest.raises(ValueError, match="the checkpoint's data state is a data.mixture's"):
            one.set_state(mixed)
        single = one.get_state()
    with _iterator(cfg) as it, pytest.raises(ValueError, match="the checkpoint's data state is not a mixture's"):
        it.set_state(single)


@pytest.mark.parametrize("change, message", [
    (dict(weights=(0.5, -0.1, 0.6)), "has a negative or non-numeric weight; weights are >= 0"),
    (dict(weights=(0, 0, 0)), "data.mixture weights are all zero: give at least one source a positive weight"),
    (dict(mixture_stages=((10, (0.5, 0.5)),)), "is not one weight per source (3 sources in data.mixture)"),
    (dict(mixture_stages=((10, (1, 1, 1)), (5, (1, 0, 0)))), "steps [10, 5] are out of order"),
    (dict(mixture_chunks=5), "data.mixture_chunks=5 must divide data.batch_size=16"),
])
def test_bad_mixtures_are_one_line(shards, change, message):
    weights = change.pop("weights", (1, 1, 1))
    with pytest.raises(ValueError) as e:
        _config(shards, weights, **change)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_source_with_no_records_and_a_chunk_hosts_cannot_share(shards, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_tar.convert(str(_empty_tar(tmp_path)), str(empty), progress=False)
    cfg = _config([shards[0], shards[1], dict(source="array_record", path=str(empty / "*.array_record"))],
                  (1, 1, 1))
    with pytest.raises(ValueError, match=r"^data\.mixture\[2\] \(c\): The source has 0 records"):
        _iterator(cfg)
    with pytest.raises(ValueError, match=r"data.mixture_chunks=16 chunks of 1 records, which 2 hosts cannot "
                                         r"share evenly: set --config.data.mixture_chunks to a divisor of 8"):
        _iterator(_config(shards, (1, 1, 1), mixture_chunks=16), 0, 2)


def _empty_tar(tmp_path):
    return synthetic.write_tar(str(tmp_path / "00000.tar"), [])


def test_the_trainer_resumes_a_mixture_exactly(shards, tmp_path):
    """configs/own_data.py with a mixture: a run stopped at step 2 and resumed ends bit-identical
    to the straight run, and metrics.jsonl counts every source's examples."""
    import json
    from pathlib import Path

    import jax
    import sentencepiece as spm

    from prolip_jax import train
    from prolip_jax.core import checkpoint

    (tmp_path / "corpus.txt").write_text("\n".join(synthetic.random_caption(np.random.default_rng(i))
                                                   for i in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "tok"), model_type="word", vocab_size=16,
        hard_vocab_limit=False, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, user_defined_symbols=["[MASK]"],
        minloglevel=2, num_threads=1)

    def run(workdir, **kw):
        config, _ = train.parse_command_line([
            "prolip_jax.train", "--config", str(Path(__file__).parents[1] / "configs" / "own_data.py") + ":steps=4",
            "--workdir", str(workdir), f"--config.data.tokenizer.path={tmp_path / 'tok.model'}",
            "--config.data.tokenizer.context_length=8", "--config.model.variant=micro",
            "--config.model.attention_impl=xla", "--config.batch_size=16", "--config.data.image_size=16",
            "--config.masking.group=2", "--config.masking.fraction=0.5", "--config.log_steps=1",
            "--config.data.mixture_chunks=4", "--config.data.shuffle_buffer_size=4"])
        config.data.mixture = tuple(dict(s, weight=w, name=n) for s, w, n in zip(shards, (2, 1, 1), "abc"))
        return train.train(config, str(workdir), **kw)

    run(tmp_path / "straight")
    run(tmp_path / "resumed", stop_at_step=2)
    run(tmp_path / "resumed")
    a, _, _ = checkpoint.load_params(tmp_path / "straight" / "checkpoints")
    b, _, step = checkpoint.load_params(tmp_path / "resumed" / "checkpoints")
    assert step == 4
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))
    rows = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "data/a/examples" in r][-1]
    assert last["step"] == 4 and last["data/examples"] == 4 * 16
    assert (last["data/a/examples"], last["data/b/examples"], last["data/c/examples"]) == (32, 16, 16)
    assert last["data/a/share"] == 0.5
