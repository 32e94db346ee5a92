"""benchmarks/own_data_digits.py, the own-data recipe's figure over seeds: its data (the split,
the shards, the ImageFolder) and its table, on a small stand-in for the digits file (the real one
comes from scikit-learn, not installed here). The training runs themselves are the benchmark's."""
from __future__ import annotations

import gzip
import sys
import tarfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import own_data_digits as digits  # noqa: E402


def fake_csv(path: Path, per_class: int = 60) -> Path:
    rng = np.random.default_rng(0)
    rows = [np.append(rng.integers(0, 17, 64), c) for c in range(10) for _ in range(per_class)]
    with gzip.open(path, "wt") as f:
        f.write("\n".join(",".join(map(str, r)) for r in rows) + "\n")
    return path


def test_the_data_is_a_stratified_split_into_shards_and_an_imagefolder(tmp_path):
    images, labels = digits.load_digits(fake_csv(tmp_path / "digits.csv.gz"))
    assert images.shape == (600, 8, 8) and images.dtype == np.uint8 and images.max() <= 255
    train, val = digits.split(labels)
    assert len(val) == digits.NUM_VAL and not set(train) & set(val) and len(train) + len(val) == 600
    assert np.bincount(labels[val]).tolist() == [digits.NUM_VAL // 10] * 10
    data = digits.write_data(tmp_path / "out", images, labels)
    shards = sorted((data / "shards").glob("*.tar"))
    assert len(shards) == digits.NUM_SHARDS
    members = [m for s in shards for m in tarfile.open(s).getnames()]
    assert len(members) == 2 * len(train)
    captions = [tarfile.open(shards[0]).extractfile(m).read().decode() for m in tarfile.open(shards[0]).getnames()
                if m.endswith(".txt")]
    assert all(any(name in c.split() for name in digits.NAMES) for c in captions)
    folders = sorted(p.name for p in (data / "digits" / "val").iterdir())
    assert folders == sorted(digits.NAMES) and len(list((data / "digits" / "val").rglob("*.png"))) == len(val)


def test_the_table_gives_the_mean_and_half_range():
    results = [dict(seed=s, top1=t, first_above_50=300, ppcl_at_300=4.5, train_seconds=600.0)
               for s, t in ((0, 94.0), (1, 96.0), (2, 95.0))]
    table = digits.markdown(results, 97.0, 5000)
    assert "zero-shot top-1 95.0% ± 1.0 (mean ± half range)" in table
    assert "| 1 | 96.0% | 300 | 4.5 |" in table and "(supervised): 97.0%" in table
