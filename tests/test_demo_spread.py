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
| mean text sigma^2 / mean image sigma^2 | {ratio} | > 1x ok | texts more uncertain: > 1 |
| masked image includes image (H > 0) | missing | >= 70% MISSED | of 500 images |
"""


def test_spread_flags_a_headline_that_moves_more_than_the_limit(tmp_path):
    per_seed = {}
    for seed, (zs, ratio) in enumerate([("96.0%", "1.80x"), ("99.0%", "1.81x"), ("97.0%", "1.79x")]):
        path = tmp_path / f"{seed}.md"
        path.write_text(TABLE.format(zs=zs, ratio=ratio))
        per_seed[seed] = demo_spread.read_summary(path)
    assert per_seed[0] == {"zero-shot top-1 (36 classes, CSD)": (96.0, "%"),
                           "mean text sigma^2 / mean image sigma^2": (1.80, "x")}
    rows = {r["label"]: r for r in demo_spread.spread(per_seed, max_spread=1.0)}
    zs = rows["zero-shot top-1 (36 classes, CSD)"]
    assert zs["half_range"] == 1.5 and not zs["within"] and abs(zs["mean"] - 97.333) < 1e-3
    assert rows["mean text sigma^2 / mean image sigma^2"]["within"]   # 0.01x <= 1% of 1.80x
    text = demo_spread.markdown(list(rows.values()), [0, 1, 2], "configs/demo.py")
    assert "| zero-shot top-1 (36 classes, CSD) | 97.3% ± 1.5 | 96.0% | 99.0% | 97.0% | NO |" in text


def test_bad_seeds_are_one_line(capsys):
    assert demo_spread.main(["--out", "/tmp/unused_spread", "--seeds", "a,b"]) == 2
    assert capsys.readouterr().err.strip() == "error: --seeds must be comma-separated integers, got 'a,b'"
