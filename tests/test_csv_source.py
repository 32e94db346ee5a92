"""data.source="csv": image-text pairs listed in a CSV/TSV or Parquet file (open_clip's
--csv-img-key / --csv-caption-key / --csv-separator), read through the public pipeline entry
points and the trainer."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from input_pipeline import build_train_iterator, sources
from input_pipeline import shards as data_paths
from input_pipeline.config import DataConfig
from prolip_jax import train

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("a", "photo", "of", "the", "red", "green", "blue", "square")
N = 12


class CharTokenizer:
    """The caption's bytes as ids (decodable back to the text), padded with 0."""
    pad_id, context_length = 0, 24

    def __call__(self, texts):
        out = np.zeros((len(texts), self.context_length), np.int32)
        for i, t in enumerate(texts):
            b = t.encode()[:self.context_length]
            out[i, :len(b)] = list(b)
        return out


def decode(tokens) -> str:
    return bytes(int(t) for t in tokens if t).decode()


@pytest.fixture(scope="module")
def listing(tmp_path_factory):
    """N PNGs of one flat colour each (row i: value 10 * i), half under images/ with relative
    paths, half absolute; a tab-separated listing in open_clip's default columns."""
    tmp = tmp_path_factory.mktemp("csv")
    (tmp / "images").mkdir()
    rows = []
    for i in range(N):
        path = tmp / "images" / f"{i:02d}.png"
        Image.fromarray(np.full((16, 16, 3), 10 * i, np.uint8)).save(path)
        rows.append((f"images/{i:02d}.png" if i % 2 else str(path),
                     f"a photo of {WORDS[4 + i % 4]} {i}"))
    with open(tmp / "train.csv", "w", newline="") as f:
        w = csv.writer(f, delimiter="\t")
        w.writerow(["filepath", "title"])
        w.writerows(rows)
    return tmp, rows


def _cfg(path, **kw):
    return {**dict(source="csv", path=str(path), batch_size=4, image_size=16, seed=0, augment=False,
                   image_dtype="uint8", read_threads=1), **kw}


def _row(batch, k) -> int:
    """The listing row of batch row k, from its caption's trailing number."""
    return int(decode(batch["text"][k]).rsplit(" ", 1)[1])


def test_batches_hold_the_listed_images_and_captions(listing):
    tmp, rows = listing
    it = build_train_iterator(_cfg(tmp / "train.csv", num_epochs=1), CharTokenizer(),
                              process_index=0, process_count=1)
    seen = []
    for batch in it:
        assert batch["image"].shape == (4, 16, 16, 3) and batch["image"].dtype == np.uint8
        for k in range(4):
            i = _row(batch, k)
            assert decode(batch["text"][k]) == rows[i][1]
            np.testing.assert_array_equal(batch["image"][k], np.full((16, 16, 3), 10 * i, np.uint8))
            seen.append(i)
    assert sorted(seen) == list(range(N)) and seen != list(range(N))   # one epoch, shuffled
    assert it.stats["skipped"] == 0
    it.close()


def test_resume_gives_the_same_next_batch(listing):
    tmp, _ = listing
    cfg = _cfg(tmp / "train.csv")
    it = build_train_iterator(cfg, CharTokenizer(), process_index=0, process_count=1)
    for _ in range(4):   # into the second epoch
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    want = [next(it) for _ in range(2)]
    again = build_train_iterator(cfg, CharTokenizer(), process_index=0, process_count=1)
    again.set_state(state)
    for a, b in zip(want, [next(again) for _ in range(2)]):
        np.testing.assert_array_equal(a["image"], b["image"])
        np.testing.assert_array_equal(a["text"], b["text"])
    # The state pins the listing and its columns.
    other = build_train_iterator(_cfg(tmp / "train.csv", csv_caption_key="filepath"), CharTokenizer(),
                                 process_index=0, process_count=1)
    with pytest.raises(ValueError, match=r"^the data source's settings are not those of the run being "
                                         r"resumed \(caption_key: saved 'title', now 'filepath'\): resume "
                                         r"with the same settings, or start a new --workdir$"):
        other.set_state(state)
    for i in (it, again, other):
        i.close()


def test_a_script_that_closes_its_iterator_exits_quietly(listing):
    """The public iterator in a user's script, without and with worker processes: closed by the
    script and again by grain at the interpreter's exit (DatasetIterator.__del__, while modules
    are torn down: these iterators are the script's globals), nothing on stderr."""
    import os
    import subprocess

    tmp, _ = listing
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              f"from test_csv_source import CharTokenizer, _cfg\nfrom input_pipeline import build_train_iterator\n"
              f"its = [build_train_iterator(_cfg({str(tmp / 'train.csv')!r}, num_workers=w), CharTokenizer(), "
              f"process_index=0, process_count=1) for w in (0, 1)]\n"
              f"for it in its:\n    next(it); it.close()\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert run.returncode == 0 and run.stderr == "", run.stderr[-3000:]


def _error(cfg) -> str:
    with pytest.raises((ValueError, FileNotFoundError, ImportError)) as e:
        build_train_iterator(cfg, CharTokenizer(), process_index=0, process_count=1)
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_bad_listings_are_one_line(listing, tmp_path):
    tmp, rows = listing
    comma = tmp_path / "comma.csv"
    comma.write_text("path,caption\nimages/01.png,x\n")
    msg = _error(_cfg(comma))
    assert "has no column 'filepath' (its columns: 'path,caption'; split at '\\t'" in msg, msg
    assert "--config.data.csv_img_key" in msg and "--config.data.csv_separator" in msg
    msg = _error(_cfg(comma, csv_separator=",", csv_img_key="path"))
    assert "has no column 'title' (its columns: 'path', 'caption'" in msg
    assert msg.endswith("set --config.data.csv_caption_key"), msg
    missing = tmp_path / "missing.csv"
    missing.write_text(f"filepath\ttitle\n{rows[0][0]}\tok\nimages/none.png\tgone\n")
    msg = _error(_cfg(missing))
    assert f"the image of row 1, {tmp_path / 'images' / 'none.png'}, does not exist" in msg, msg
    empty = tmp_path / "empty.csv"
    empty.write_text("filepath\ttitle\n")
    assert "lists no image-text pairs" in _error(_cfg(empty))
    assert "does not exist" in _error(_cfg(tmp_path / "nowhere.csv"))
    with pytest.raises(ValueError, match=r"data.source='csv' needs data.path \(a .csv, .tsv or .parquet"):
        DataConfig(source="csv").check_source()
    with pytest.raises(ValueError, match="data.csv_separator must be one character"):
        DataConfig(source="csv", path="x.csv", csv_separator="::").check_source()


def test_auto_and_the_registry_know_listings():
    assert data_paths.source_of_paths("/d/train.csv") == "csv"
    assert data_paths.source_of_paths("/d/train.TSV") == "csv"
    assert data_paths.source_of_paths("gs://b/train.parquet") == "csv"
    assert DataConfig(source="auto", path="/d/train.tsv").source == "csv"
    assert sources.get("csv").name == "csv" and "csv" in sources.READ_BY_THE_PIPELINE


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)   # import pyarrow.parquet fails
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "train.parquet").write_bytes(b"PAR1")
    assert _error(_cfg(tmp_path / "train.parquet")).endswith("needs pyarrow: pip install pyarrow")


def test_parquet_listing(listing, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    tmp, rows = listing
    table = pa.table({"url": [str(tmp / p) if not Path(p).is_absolute() else p for p, _ in rows],
                      "caption": [c for _, c in rows], "other": list(range(N))})
    pq.write_table(table, tmp_path / "train.parquet")
    it = build_train_iterator(_cfg(tmp_path / "train.parquet", csv_img_key="url", csv_caption_key="caption",
                                   num_epochs=1, shuffle=False), CharTokenizer(), process_index=0, process_count=1)
    batch = next(it)
    assert [decode(t) for t in batch["text"]] == [c for _, c in rows[:4]]
    np.testing.assert_array_equal(batch["image"][3], np.full((16, 16, 3), 30, np.uint8))
    it.close()
    msg = _error(_cfg(tmp_path / "train.parquet"))
    assert "has no column 'filepath' (its columns: 'url', 'caption', 'other')" in msg, msg
    assert "csv_separator" not in msg


def test_a_trainer_step_on_a_listing(listing, tmp_path):
    """The trainer's command line, data.source=csv: one step, and the data state in the checkpoint."""
    import sentencepiece as spm

    tmp, _ = listing
    rng = np.random.default_rng(0)
    (tmp_path / "corpus.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 5)) for _ in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(tmp_path / "corpus.txt"), model_prefix=str(tmp_path / "tok"), model_type="word", vocab_size=16,
        hard_vocab_limit=False, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, user_defined_symbols=["[MASK]"],
        minloglevel=2, num_threads=1)
    workdir = tmp_path / "w"
    config, _ = train.parse_command_line([
        "prolip_jax.train", "--config", str(ROOT / "configs" / "own_data.py") + ":steps=1",
        "--workdir", str(workdir), f"--config.data.path={tmp / 'train.csv'}",
        f"--config.data.tokenizer.path={tmp_path / 'tok.model'}", "--config.data.tokenizer.context_length=8",
        "--config.model.variant=micro", "--config.model.attention_impl=xla", "--config.batch_size=16",
        "--config.data.image_size=16", "--config.masking.group=2", "--config.masking.fraction=0.5"])
    assert config.data.source == "auto"   # own_data.py's default: the .csv ending picks the source
    metrics = train.train(config, str(workdir))
    assert np.isfinite(metrics["loss"]), metrics
    (state,) = (workdir / "checkpoints").glob("*/*/process_0-of-1.json")
    assert json.loads(state.read_text())["fingerprint"]["source"] == "csv"
