"""benchmarks/demo_spread.py: reading the demo's summary table and the spread over seeds."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("demo_spread", ROOT / "benchmarks" / "demo_spread.py")
demo_spread = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo_spread)

TABLE = """header

| metric | value | target | note |
|---|---|---|---|
| zero-shot top-1 (36 classes, CSD) | {zs} | >= 80% ok | chance 2.8% |
| image less uncertain than its caption | {below} | >= 90% ok | of 500 pairs (0% untrained) |
| masked image includes image (H > 0) | missing | >= 70% MISSED | of 500 images |
"""


def test_spread_flags_a_headline_that_moves_more_than_the_limit(tmp_path):
    per_seed = {}
    for seed, (zs, below) in enumerate([("96.0%", "100.0%"), ("99.0%", "99.0%"), ("97.0%", "98.4%")]):
        path = tmp_path / f"{seed}.md"
        path.write_text(TABLE.format(zs=zs, below=below))
        per_seed[seed] = demo_spread.read_summary(path)
    assert per_seed[0] == {"zero-shot top-1 (36 classes, CSD)": 96.0, "image less uncertain than its caption": 100.0}
    rows = {r["label"]: r for r in demo_spread.spread(per_seed, max_spread=1.0)}
    zs = rows["zero-shot top-1 (36 classes, CSD)"]
    assert zs["half_range"] == 1.5 and not zs["within"] and abs(zs["mean"] - 97.333) < 1e-3
    assert rows["image less uncertain than its caption"]["within"]   # 0.8 <= 1 point
    text = demo_spread.markdown(list(rows.values()), [0, 1, 2], "configs/demo.py")
    assert "| zero-shot top-1 (36 classes, CSD) | 97.3% ± 1.5 | 96.0% | 99.0% | 97.0% | NO |" in text


def test_bad_seeds_are_one_line(capsys):
    assert demo_spread.main(["--out", "/tmp/unused_spread", "--seeds", "a,b"]) == 2
    assert capsys.readouterr().err.strip() == "error: --seeds must be comma-separated integers, got 'a,b'"
