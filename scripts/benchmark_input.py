"""Input pipeline throughput: decode + augment + tokenize at 224 px from JPEG tar shards.

    python scripts/benchmark_input.py                    # worker counts 1..#cores
    python scripts/benchmark_input.py --workers 0 1 2 4 --images 4000

Writes its own img2dataset-style shards of ~400x300 JPEGs (quality 90, ~40-60 KB, like web
photos) into a temporary folder, then times the real training pipeline (tar source, window
shuffle, RandomResizedCrop + ColorJitter + grayscale, tokenization, batching) for each worker
count. `--workers 0` runs everything in this process. Tokenizer: a SentencePiece model trained
on the fly on the captions and used through input_pipeline.tokenizers (canonicalize cleaning,
context 64), as for SigLIP-style ProLIP training.

Columns: images/s (wall clock, all workers together); per core = images/s / workers (meaningful
while workers <= cores); per CPU-s = images per CPU-second used by this process and its workers
(psutil), the per-core cost that other load on a shared machine does not distort.
"""
from __future__ import annotations

import argparse
import os
import platform
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


def _cpu_seconds() -> float:
    """CPU time (user + system) of this process and its worker processes so far."""
    import psutil
    me = psutil.Process()
    total = 0.0
    for proc in [me] + me.children(recursive=True):
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _measure(config: dict, tokenizer, warmup: int, images: int, repeats: int
             ) -> list[tuple[float, float]]:
    """(images/s, images per CPU-second) over `repeats` windows of `images`, after a warm-up."""
    from input_pipeline import pipeline
    it = pipeline.build_train_iterator(config, tokenizer, process_index=0, process_count=1)
    out = []
    try:
        for _ in range(warmup):   # includes starting the worker processes
            next(it)
        batches = max(1, images // config["batch_size"])
        for _ in range(repeats):
            cpu, start = _cpu_seconds(), time.perf_counter()
            for _ in range(batches):
                batch = next(it)
            n = batches * config["batch_size"]
            out.append((n / (time.perf_counter() - start), n / (_cpu_seconds() - cpu)))
        assert batch["image"].shape[1:] == (config["image_size"],) * 2 + (3,)
        del batch
        return out
    finally:
        it.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = os.cpu_count() or 1
    parser.add_argument("--workers", type=int, nargs="+", default=list(range(1, cores + 1)))
    parser.add_argument("--images", type=int, default=1500, help="images per timed window")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows per setting")
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
        print(f"machine: {platform.processor() or platform.machine()}, {cores} cores; "
              f"image_size={args.image_size} batch={args.batch_size} "
              f"image_dtype={args.image_dtype} color_jitter_impl={args.color_jitter_impl}")
        print(f"{'workers':>8} {'images/s':>9} {'per core':>9} {'per CPU-s':>10}   (median of "
              f"{args.repeats} windows of {args.images} images; min-max of images/s)")
        for workers in args.workers:
            config = dict(source="tar", path=os.path.join(tmp, "*.tar"),
                          batch_size=args.batch_size, image_size=args.image_size,
                          num_workers=workers, shuffle_buffer_size=256, seed=0,
                          image_dtype=args.image_dtype,
                          color_jitter_impl=args.color_jitter_impl)
            rates = _measure(config, tokenizer, warmup=2 * max(1, workers),
                             images=args.images, repeats=args.repeats)
            wall = sorted(r[0] for r in rates)
            cpu = sorted(r[1] for r in rates)[len(rates) // 2]
            rate = wall[len(wall) // 2]
            print(f"{workers:>8} {rate:>9.0f} {rate / max(1, workers):>9.0f} {cpu:>10.0f}   "
                  f"[{wall[0]:.0f}-{wall[-1]:.0f}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
