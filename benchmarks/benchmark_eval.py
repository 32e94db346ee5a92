"""Evaluation speed: the encoder's images/s and texts/s, and blocked CSD retrieval over a big gallery.

    python benchmarks/benchmark_eval.py --config configs/prolip_b16_datacomp.py \
        [--images 8192 --texts 32768 --batch 1024] [--queries 50000 --gallery 1000000 --block 1024] \
        [--only encoder|csd] [--json OUT.json]

Encoder: `prolip_jax.core.encode.Encoder` (what `prolip_jax.load` and every evaluator use) on randomly
initialised parameters of the config's model and random uint8 images / token ids, on all local
devices; each tower is timed on its second pass (the first one compiles), host transfers
included. Retrieval: `evaluators.retrieval.blocked_ranks` ("csd", the paper's protocol: query
blocks scored against the whole gallery on device and each query's positive ranked there too),
random unit-norm means and log sigma^2 of the model's embedding width. It runs first, so the
device's peak memory (`memory_stats()`, None on CPU) is its own; the host's peak RSS is reported
beside it. `--only` runs one of the two (the GPU plan runs each in its own process, so that each
has its own time limit and its own peak memory).
"""
from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_step import device_memory, load_config, set_field  # noqa: E402


def gaussian_embeddings(rng: np.random.Generator, n: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(unit-norm mu, log sigma^2 around the trained models' -7) float32 [n, dim]."""
    mu = rng.standard_normal((n, dim), dtype=np.float32)
    mu /= np.linalg.norm(mu, axis=1, keepdims=True)
    logvar = rng.standard_normal((n, dim), dtype=np.float32)
    logvar *= 0.5
    logvar -= 7.0
    return mu, logvar


def csd_retrieval(queries: int, gallery: int, dim: int, block: int) -> dict:
    from evaluators.retrieval import blocked_ranks

    rng = np.random.default_rng(0)
    q_mu, q_lv = gaussian_embeddings(rng, queries, dim)
    g_mu, g_lv = gaussian_embeddings(rng, gallery, dim)
    positives = rng.integers(0, gallery, (queries, 1))
    t0 = time.perf_counter()
    ranks, _ = blocked_ranks(q_mu, q_lv, g_mu, g_lv, positives, kind="csd", block=block)
    seconds = time.perf_counter() - t0
    assert ranks.shape == (queries, 1) and (ranks >= 0).all()
    return {"queries": queries, "gallery": gallery, "dim": dim, "block": block, "seconds": seconds,
            "pairs_per_s": queries * gallery / seconds, "device_memory": device_memory(),
            "host_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def encoder_speed(config, images: int, texts: int, batch: int) -> dict:
    from prolip_jax.core.encode import Encoder
    from prolip_jax.core.models import ProLIP
    from prolip_jax.trainer.build import model_config
    from prolip_jax.trainer.config import parse_config

    mcfg = model_config(parse_config(config))
    model = ProLIP(mcfg, dtype=jnp.dtype(config.model.dtype), attention_impl=config.model.attention_impl)
    s, length = mcfg.vision.image_size, mcfg.text.context_length
    params = jax.jit(lambda r: model.init(r, jnp.zeros((1, s, s, 3)), jnp.ones((1, length), jnp.int32)))(
        jax.random.key(0))["params"]
    encoder = Encoder(model, batch_size=batch, normalization=config.data.get("normalization", "openai"))
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (images, s, s, 3), dtype=np.uint8)
    tokens = rng.integers(2, mcfg.text.vocab_size, (texts, length), dtype=np.int32)
    out = {"batch": encoder.batch_size, "images": images, "texts": texts, "image_size": s, "context_length": length}
    for tower, data, call in (("images", pixels, encoder.images), ("texts", tokens, encoder.texts)):
        t0 = time.perf_counter()
        call(params, data)  # compiles
        out[f"{tower}_first_pass_s"] = time.perf_counter() - t0
        call(params, data)
        out[f"{tower}_per_s"] = encoder.last_throughput
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], help="field=value override, repeatable")
    p.add_argument("--images", type=int, default=8192)
    p.add_argument("--texts", type=int, default=32768)
    p.add_argument("--batch", type=int, default=1024, help="encoder block (all local devices together)")
    p.add_argument("--queries", type=int, default=50_000)
    p.add_argument("--gallery", type=int, default=1_000_000)
    p.add_argument("--block", type=int, default=1024, help="query rows scored at once")
    p.add_argument("--only", choices=("encoder", "csd"), default=None, help="run one of the two measurements")
    p.add_argument("--json", default=None, metavar="OUT")
    args = p.parse_args(argv)

    config = load_config(args.config)
    for assignment in args.set:
        set_field(config, assignment)
    from prolip_jax.trainer.build import model_config
    from prolip_jax.trainer.config import parse_config

    result = {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
              "n_devices": jax.device_count(), "variant": config.model.variant, "dtype": config.model.dtype}
    if args.only in (None, "csd"):
        embed_dim = model_config(parse_config(config)).embed_dim
        result["csd"] = c = csd_retrieval(args.queries, args.gallery, embed_dim, args.block)
        peak = ("n/a" if c["device_memory"] is None
                else f"{c['device_memory']['peak_bytes_in_use'] / 2 ** 30:.3g} GiB")
        print(f"blocked CSD ranks, {args.queries} x {args.gallery} (dim {c['dim']}, block {args.block}): "
              f"{c['seconds']:.1f} s ({c['pairs_per_s'] / 1e9:.3g} G pairs/s); host peak RSS "
              f"{c['host_peak_rss_bytes'] / 2 ** 30:.3g} GiB; device peak {peak}", flush=True)
    if args.only in (None, "encoder"):
        result["encoder"] = e = encoder_speed(config, args.images, args.texts, args.batch)
        print(f"encoder ({config.model.variant}, {config.model.dtype}, block {e['batch']}): "
              f"{e['images_per_s']:.1f} images/s, {e['texts_per_s']:.1f} texts/s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
