"""A mixture of K tar sources (data.mixture, input_pipeline/mixture.py) against one tar source of
the same shards, at the same worker count: images/s and images per CPU-second.

    python benchmarks/benchmark_mixture.py --sources 3 --workers 2 --rounds 5

Writes img2dataset-style shards of ~400x300 JPEGs (as benchmarks/benchmark_input.py) into a
temporary folder; the mixture reads them as K sources of equal weight (shard k, k+K, ... in
source k), each with `--workers` grain worker processes, the one source with `--workers`. Each
measurement is a process of its own (no other pipeline's workers beside it), the two taking
turns for `--rounds` rounds; each times `--batches` batches after `--warmup` untimed ones. The
figures are the medians over the rounds and the ratio of the medians.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _measure(args: argparse.Namespace) -> None:
    """One measurement (in its own process): prints a JSON line."""
    import numpy as np
    import psutil

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from benchmark_input import _tokenizer
    from input_pipeline import mixture, pipeline, synthetic
    from input_pipeline.config import DataConfig

    files = sorted(glob.glob(os.path.join(args.data, "*.tar")))
    rng = np.random.default_rng(0)
    tokenizer = _tokenizer(args.data, [synthetic.random_caption(rng) for _ in range(2000)])
    base = dict(source="tar", batch_size=args.batch_size, image_size=args.image_size, num_workers=args.workers,
                per_worker_buffer_size=2, shuffle_buffer_size=256, seed=0, image_dtype="uint8")
    if args.measure == "mixture":
        cfg = DataConfig.from_mapping(dict(base, mixture=tuple(
            dict(source="tar", path=files[k::args.sources], weight=1.0) for k in range(args.sources))))
        it = mixture.build_mixture_iterator(cfg, tokenizer, process_index=0, process_count=1)
    else:
        it = pipeline.build_train_iterator(dict(base, path=files), tokenizer, process_index=0, process_count=1)
    with it:
        for _ in range(args.warmup):
            next(it)
        me = psutil.Process()
        family = [me] + me.children(recursive=True)
        cpu0 = sum(sum(p.cpu_times()[:2]) for p in family)
        start = time.perf_counter()
        for _ in range(args.batches):
            next(it)
        wall = time.perf_counter() - start
        cpu = sum(sum(p.cpu_times()[:2]) for p in family) - cpu0
    n = args.batches * args.batch_size
    print(json.dumps({"images_per_s": n / wall, "images_per_cpu_s": n / cpu}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sources", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=24)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=100)
    parser.add_argument("--measure", choices=("one", "mixture"), help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        _measure(args)
        return 0

    from input_pipeline import synthetic
    runs: dict[str, list[dict]] = {"one": [], "mixture": []}
    with tempfile.TemporaryDirectory() as tmp:
        synthetic.make_jpeg_shards(tmp, args.shards, args.per_shard, 400, 300)
        common = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("measure", "data")]
        for r in range(args.rounds):
            for kind in (("one", "mixture") if r % 2 == 0 else ("mixture", "one")):
                out = subprocess.run([sys.executable, __file__, *common, f"--measure={kind}", f"--data={tmp}"],
                                     capture_output=True, text=True, check=True).stdout
                runs[kind].append(json.loads(out.strip().splitlines()[-1]))
                print(f"round {r + 1} {kind:<8} {runs[kind][-1]['images_per_s']:6.0f} images/s "
                      f"{runs[kind][-1]['images_per_cpu_s']:6.0f} per CPU-s", flush=True)
    med = {k: {m: statistics.median(x[m] for x in v) for m in ("images_per_s", "images_per_cpu_s")}
           for k, v in runs.items()}
    print(f"machine: {os.cpu_count()} cores; {args.sources} tar sources x {args.workers} workers against one source x "
          f"{args.workers} workers, batch {args.batch_size}, {args.image_size} px, median of {args.rounds} rounds")
    for k in ("one", "mixture"):
        print(f"{k:<8} {med[k]['images_per_s']:6.0f} images/s {med[k]['images_per_cpu_s']:6.0f} per CPU-s")
    print(f"mixture / one: {med['mixture']['images_per_s'] / med['one']['images_per_s']:.0%} images/s, "
          f"{med['mixture']['images_per_cpu_s'] / med['one']['images_per_cpu_s']:.0%} per CPU-s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
