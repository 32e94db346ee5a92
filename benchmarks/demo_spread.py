r"""The demo's headline figures over several seeds: each value with its spread.

    python benchmarks/demo_spread.py --out /tmp/demo_spread                 # seeds 0,1,2 (~30 min on 2 cores)
    python benchmarks/demo_spread.py --out /tmp/s --seeds 0,1 --config configs/demo.py:smoke=1

Runs `scripts/demo.py` once per seed in its own process and workdir (OUT/seed<N>; a rerun
reuses finished seeds, as `make demo` does), reads each run's summary table (OUT/seed<N>/
summary.md) and writes OUT/spread.md and OUT/spread.json: per headline, the mean, the half
range (max - min) / 2 printed as "±", and every seed's value. A headline whose half range is
above --max-spread points (default 2) is flagged, and with --check makes the exit status 1.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_VALUE = re.compile(r"^(-?[0-9.]+)%$")


def read_summary(path: Path) -> dict[str, float]:
    """summary.md's table -> {label: value in %} for every row with a number ('98.3%')."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2:
            continue
        m = _VALUE.match(cells[1])
        if m:
            rows[cells[0]] = float(m.group(1))
    return rows


def spread(per_seed: dict[int, dict[str, float]], max_spread: float) -> list[dict]:
    """One row per label present in every seed: mean, half range, values, within max_spread points."""
    labels = [k for k in next(iter(per_seed.values())) if all(k in r for r in per_seed.values())]
    out = []
    for label in labels:
        values = [per_seed[s][label] for s in sorted(per_seed)]
        half = (max(values) - min(values)) / 2
        out.append(dict(label=label, mean=sum(values) / len(values), half_range=half,
                        values=values, within=half <= max_spread))
    return out


def markdown(rows: list[dict], seeds: list[int], config: str) -> str:
    lines = [f"Demo headlines over seeds {', '.join(map(str, seeds))} ({config}); "
             "value = mean ± half range", "",
             "| metric | value | " + " | ".join(f"seed {s}" for s in seeds) + " | spread ok |",
             "|---|---|" + "---|" * len(seeds) + "---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['mean']:.1f}% ± {r['half_range']:.1f} | "
                     + " | ".join(f"{v:.1f}%" for v in r["values"])
                     + f" | {'yes' if r['within'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="one workdir per seed (OUT/seed<N>), spread.md, spread.json")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--config", default="configs/demo.py", help="demo config[:args]; seed=N is appended")
    p.add_argument("--max-spread", type=float, default=2.0, help="allowed half range, in points")
    p.add_argument("--check", action="store_true", help="exit 1 when a headline spreads more")
    args = p.parse_args(argv)
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        print(f"error: --seeds must be comma-separated integers, got {args.seeds!r}", file=sys.stderr)
        return 2
    if not seeds:
        print("error: --seeds names no seed", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sep = "," if ":" in args.config else ":"
    per_seed = {}
    for seed in seeds:
        workdir = out / f"seed{seed}"
        t = time.time()
        cmd = [sys.executable, str(ROOT / "scripts" / "demo.py"), "--workdir", str(workdir),
               "--config", f"{args.config}{sep}seed={seed}"]
        print(f"seed {seed}: {' '.join(cmd)}", flush=True)
        with open(out / f"seed{seed}.log", "w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        summary = workdir / "summary.md"
        if rc not in (0, 1) or not summary.exists():  # 1: a target missed (with --check only)
            print(f"error: the demo for seed {seed} failed (exit {rc}); its log: {out / f'seed{seed}.log'}",
                  file=sys.stderr)
            return 1
        per_seed[seed] = read_summary(summary)
        print(f"seed {seed}: done in {time.time() - t:.0f}s", flush=True)
    rows = spread(per_seed, args.max_spread)
    text = markdown(rows, seeds, args.config)
    (out / "spread.md").write_text(text)
    (out / "spread.json").write_text(json.dumps(dict(config=args.config, seeds=seeds, rows=rows), indent=1))
    print("\n" + text)
    bad = [r["label"] for r in rows if not r["within"]]
    if bad:
        print(f"spread above ±{args.max_spread:g} points: {', '.join(bad)}")
    return 1 if bad and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
