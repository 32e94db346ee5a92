"""Input pipeline throughput against a bare PIL loop, both timed in the same run.

    python benchmarks/benchmark_input.py --workers 0 1 2          # default: 0..#cores
    python benchmarks/benchmark_input.py --workers 0 1 2 4 --images 4000

Writes its own img2dataset-style shards of ~400x300 JPEGs (quality 90, ~40 KB, like web photos)
into a temporary folder, then for each worker count times, alternately, in windows of
`--images` images:
  pipeline: the real training pipeline (tar source, window shuffle, per-record seeded
      RandomResizedCrop + ColorJitter + grayscale, caption, tokenization, batching, grain
      worker processes); `--workers 0` runs it in this process.
  bare: the same JPEGs (already in memory) through a loop of nothing but the same decode and
      the training transform (crop + bicubic resize, colour jitter / grayscale, uint8 array),
      one RNG for the whole loop; in `workers` spawned processes (in this process for 0).
Tokenizer: a SentencePiece model trained on the fly on the captions and used through
input_pipeline.tokenizers (canonicalize cleaning, context 64), as for SigLIP-style training.

Columns: images/s (wall clock, all processes together); per core = images/s / workers
(meaningful while workers <= cores); per CPU-s = images per CPU-second the timed processes
used (psutil), which other load on a shared machine distorts much less. pipeline/bare = the
ratio of the two in adjacent windows (median over repeats), by wall clock and by CPU-seconds.
Each figure is the median over `--repeats` windows; [min-max] of the pipeline's images/s.
"""
from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time


def _tokenizer(directory: str, captions: list[str]):
    import sentencepiece as spm
    corpus = os.path.join(directory, "corpus.txt")
    with open(corpus, "w") as f:
        f.write("\n".join(captions))
    prefix = os.path.join(directory, "spm")
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=64,
                                   hard_vocab_limit=False, model_type="unigram", pad_id=-1,
                                   eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    from input_pipeline.tokenizers import build_tokenizer
    return build_tokenizer("sentencepiece", prefix + ".model", context_length=64)


def _cpu_seconds(procs) -> float:
    """CPU time (user + system) so far of psutil processes `procs`."""
    import psutil
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _family():
    """This process and all its descendants (grain workers, bare-loop processes)."""
    import psutil
    me = psutil.Process()
    return [me] + me.children(recursive=True)


def _wait_quiet(timeout: float = 10.0) -> None:
    """Waits until this process family stops using CPU (grain workers fill their prefetch
    buffers after a pipeline window), so that the next window runs alone."""
    deadline = time.monotonic() + timeout
    last = _cpu_seconds(_family())
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _cpu_seconds(_family())
        if now - last < 0.02:   # < 10% of one core over the interval
            return
        last = now


# --- the bare loop ---------------------------------------------------------------------------

_JPEGS: list[bytes] = []


def _load_jpegs(pattern: str) -> list[bytes]:
    import glob
    from input_pipeline import tar_source
    out = []
    for path in sorted(glob.glob(pattern)):
        with open(path, "rb") as f:
            out += [m["jpg"] for _, m in tar_source.iter_tar_groups(f)]
    return out


def _bare_init(pattern: str) -> None:
    global _JPEGS
    _JPEGS = _load_jpegs(pattern)


def _bare_loop(args: tuple[int, int, int, str, bool]) -> int:
    """Decodes and transforms `count` of the JPEGs from `offset` on, like the pipeline's
    decoder does for one record, minus everything around it (tar, per-record seeding,
    captions, tokenization, batching, worker processes). pil_defaults: with PIL's default
    memory settings rather than the pipeline's (decode.keep_pil_blocks)."""
    count, offset, size, jitter_impl, pil_defaults = args
    import numpy as np
    from PIL import Image
    from input_pipeline import decode, transforms
    aug = transforms.AugmentConfig(color_jitter_impl=jitter_impl)
    rng = np.random.default_rng(offset)
    blocks_max = Image.core.get_blocks_max()
    if pil_defaults:
        Image.core.set_blocks_max(0)
    else:
        decode.keep_pil_blocks()
    for i in range(offset, offset + count):
        img = Image.open(io.BytesIO(_JPEGS[i % len(_JPEGS)]))
        img.load()
        if img.mode != "RGB":
            img = img.convert("RGB")
        image = transforms.train_transform(img, size, rng, aug)
    if pil_defaults:   # for the pipeline, when it runs in this process (--workers 0)
        Image.core.set_blocks_max(blocks_max)
    assert image.shape == (size, size, 3) and image.dtype == np.uint8
    return count


class _Bare:
    """The bare loop in `workers` processes (this process for 0), timed like the pipeline."""

    def __init__(self, workers: int, pattern: str, size: int, jitter_impl: str,
                 pil_defaults: bool):
        self.workers, self.size, self.jitter_impl = workers, size, jitter_impl
        self.pil_defaults = pil_defaults
        self.pool = None
        if workers:
            self.pool = multiprocessing.get_context("spawn").Pool(
                workers, initializer=_bare_init, initargs=(pattern,))
            self.pool.map(_bare_loop, self._chunks(8), chunksize=1)   # start + warm up
        else:
            _bare_init(pattern)
            _bare_loop(self._chunks(8)[0])

    def _chunks(self, images: int) -> list[tuple[int, int, int, str, bool]]:
        n = max(1, self.workers)
        return [(images // n, w * 997, self.size, self.jitter_impl, self.pil_defaults)
                for w in range(n)]

    def measure(self, images: int) -> tuple[float, float]:
        """(images/s, images per CPU-second) of one window of `images`."""
        import psutil
        procs = ([psutil.Process(p.pid) for p in self.pool._pool] if self.pool
                 else [psutil.Process()])
        cpu, start = _cpu_seconds(procs), time.perf_counter()
        if self.pool:
            n = sum(self.pool.map(_bare_loop, self._chunks(images), chunksize=1))
        else:
            n = _bare_loop(self._chunks(images)[0])
        return n / (time.perf_counter() - start), n / max(_cpu_seconds(procs) - cpu, 1e-6)

    def close(self) -> None:
        if self.pool:
            self.pool.terminate()
            self.pool.join()


# --- the pipeline ----------------------------------------------------------------------------

class _Pipeline:
    def __init__(self, config: dict, tokenizer):
        from input_pipeline import pipeline
        self.config = config
        self.it = pipeline.build_train_iterator(config, tokenizer, process_index=0,
                                                process_count=1)
        for _ in range(2 * max(1, config["num_workers"])):   # starts the worker processes
            next(self.it)

    def measure(self, images: int) -> tuple[float, float]:
        """(images/s, images per CPU-second) of one window of `images`, in steady state: the
        batches the workers prefetched while the other loops ran are taken first, untimed,
        until `workers` batches in a row had to be waited for (a batch takes >> 5 ms)."""
        waited = 0
        while waited < max(1, self.config["num_workers"]):
            start = time.perf_counter()
            next(self.it)
            waited = waited + 1 if time.perf_counter() - start > 0.005 else 0
        batches = max(1, images // self.config["batch_size"])
        procs = _family()
        cpu, start = _cpu_seconds(procs), time.perf_counter()
        for _ in range(batches):
            batch = next(self.it)
        n = batches * self.config["batch_size"]
        rates = n / (time.perf_counter() - start), n / max(_cpu_seconds(procs) - cpu, 1e-6)
        assert batch["image"].shape[1:] == (self.config["image_size"],) * 2 + (3,)
        return rates

    def close(self) -> None:
        self.it.close()


_LOOPS = ("pipeline", "bare", "bare, PIL defaults")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = os.cpu_count() or 1
    parser.add_argument("--workers", type=int, nargs="+", default=list(range(0, cores + 1)))
    parser.add_argument("--images", type=int, default=1000, help="images per timed window")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed windows per worker count, for each loop")
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--per-shard", type=int, default=100)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-dtype", default="uint8", choices=("uint8", "float32"))
    parser.add_argument("--color-jitter-impl", default="fast", choices=("fast", "torchvision"))
    args = parser.parse_args(argv)

    from input_pipeline import synthetic
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        synthetic.make_jpeg_shards(tmp, args.shards, args.per_shard, 400, 300)
        sizes = [os.path.getsize(os.path.join(tmp, f)) for f in os.listdir(tmp)]
        print(f"made {args.shards} shards x {args.per_shard} JPEGs 400x300 "
              f"({sum(sizes) / (args.shards * args.per_shard) / 1e3:.0f} KB/image incl. tar) "
              f"in {time.perf_counter() - t0:.1f} s")
        rng = __import__("numpy").random.default_rng(0)
        tokenizer = _tokenizer(tmp, [synthetic.random_caption(rng) for _ in range(2000)])
        pattern = os.path.join(tmp, "*.tar")
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"machine: {platform.processor() or platform.machine()}, {cores} cores, load "
              f"average {load} at the start; image_size={args.image_size} "
              f"batch={args.batch_size} image_dtype={args.image_dtype} "
              f"color_jitter_impl={args.color_jitter_impl}")
        print(f"median of {args.repeats} windows of {args.images} images per loop, the loops "
              "taking turns; pipeline/loop: the pipeline's rate over the loop's, window by window")
        print(f"{'workers':>7}  {'loop':<20} {'images/s':>8} {'[min-max]':>11} {'per core':>8} "
              f"{'per CPU-s':>9}   {'pipeline/loop: wall, CPU-s':>26}")
        results = {}
        for workers in args.workers:
            config = dict(source="tar", path=pattern, batch_size=args.batch_size,
                          image_size=args.image_size, num_workers=workers,
                          per_worker_buffer_size=2, shuffle_buffer_size=256, seed=0,
                          image_dtype=args.image_dtype,
                          color_jitter_impl=args.color_jitter_impl)
            loops = {"pipeline": _Pipeline(config, tokenizer)}
            try:
                for name, defaults in (("bare", False), ("bare, PIL defaults", True)):
                    loops[name] = _Bare(workers, pattern, args.image_size,
                                        args.color_jitter_impl, defaults)
                runs = {name: [] for name in loops}
                for r in range(args.repeats):   # each loop goes first in turn
                    for name in _LOOPS[r % 3:] + _LOOPS[:r % 3]:
                        _wait_quiet()
                        runs[name].append(loops[name].measure(args.images))
            finally:
                for loop in loops.values():
                    loop.close()
            n = max(1, workers)
            for name in _LOOPS:
                wall = [x[0] for x in runs[name]]
                rate, cpu = statistics.median(wall), statistics.median(x[1] for x in runs[name])
                results[workers, name] = rate
                line = (f"{workers:>7}  {name:<20} {rate:>8.0f} "
                        f"{f'[{min(wall):.0f}-{max(wall):.0f}]':>11} {rate / n:>8.0f} {cpu:>9.0f}")
                if name != "pipeline":
                    pairs = list(zip(runs["pipeline"], runs[name]))
                    ratio_wall = statistics.median(p[0] / b[0] for p, b in pairs)
                    ratio_cpu = statistics.median(p[1] / b[1] for p, b in pairs)
                    line += f"   {ratio_wall:>18.0%} {ratio_cpu:>7.0%}"
                print(line, flush=True)
        if 1 in args.workers:
            for w in args.workers:
                if w > 1:
                    print(f"scaling, {w} workers against 1: " + ", ".join(
                        f"{name} {results[w, name] / results[1, name]:.2f}x" for name in _LOOPS))
        print(f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
