"""Inspect a data set by a ProLIP model's uncertainty (paper Fig. 4 / C.1 and Fig. 1 / A.2).

    python scripts/inspect_uncertainty.py --checkpoint CKPT --dataset demo --out DIR
    python scripts/inspect_uncertainty.py --checkpoint CKPT --dataset karpathy \
        --karpathy_json dataset_coco.json --image_root COCO_DIR --tokenizer_path TOK --out DIR
    python scripts/inspect_uncertainty.py --checkpoint CKPT --dataset hierarcaps \
        --csv hierarcaps_test.csv --image_dir val2014 --tokenizer_path TOK --out DIR

Writes DIR/index.html (the --top most and least uncertain images and captions, thumbnails in
DIR/images/), DIR/ranking.json (the rankings and every item's tr(Sigma), "image_sigma2_trace" /
"text_sigma2_trace") and DIR/ellipses.png (PCA of --samples draws of the first --ellipses
images and their captions, with 2-sigma ellipses).
CKPT: a prolip_jax checkpoint directory or a Hugging Face folder (prolip_jax.load).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def load_set(args: argparse.Namespace) -> Any:
    from evaluators import hierarcaps, retrieval_data
    from input_pipeline import eval_data

    if args.dataset == "demo":
        demo = {"cache_dir": args.demo_cache_dir} if args.demo_cache_dir else {}
        data = eval_data.demo(args.demo_split, demo)
    elif args.dataset == "karpathy":
        data = retrieval_data.karpathy(args.karpathy_json, args.image_root, args.split)
    elif args.dataset == "hierarcaps":
        data = hierarcaps.read_hierarcaps(args.csv, args.image_dir)
    else:
        raise SystemExit(f"error: unknown dataset {args.dataset!r} (demo | karpathy | hierarcaps)")
    if args.max_items and args.max_items < len(data):
        import numpy as np

        data.records.n = args.max_items
        keep = np.asarray(data.caption_record) < args.max_items
        data.captions = [c for c, k in zip(data.captions, keep) if k]
        data.caption_record = np.asarray(data.caption_record)[keep]
    return data


def tokenizer_for(data: Any, args: argparse.Namespace, context_length: int) -> Any:
    if "tokenizer" in data.info:   # the demo's own
        return data.info["tokenizer"](context_length)
    if not args.tokenizer_path:
        raise SystemExit("error: --tokenizer_path (and --tokenizer_kind) are needed for this dataset")
    from input_pipeline.tokenizers import build_tokenizer

    return build_tokenizer(kind=args.tokenizer_kind, path=args.tokenizer_path,
                           context_length=context_length)


def inspect(model: Any, params: Any, data: Any, tokenizer: Any, out: Path, top: int = 16,
            ellipses: int = 5, samples: int = 10, batch_size: int = 64) -> dict[str, Any]:
    """Encodes `data`, writes index.html / ranking.json / ellipses.png under `out`."""
    import numpy as np

    from evaluators import inspect_data

    out.mkdir(parents=True, exist_ok=True)
    enc = inspect_data.encode_set(model, params, data, tokenizer, batch_size)
    ranking = inspect_data.write_html(out, data, enc, top)
    n = min(ellipses, len(data))
    caps = np.flatnonzero(np.asarray(data.caption_record) < n)
    mu = np.concatenate([enc["image_mu"][:n], enc["text_mu"][caps]])
    lv = np.concatenate([enc["image_logvar"][:n], enc["text_logvar"][caps]])
    labels = [f"image {i}" for i in range(n)] + [data.captions[c] for c in caps]
    kinds = ["image"] * n + ["text"] * len(caps)
    inspect_data.pca_ellipses(mu, lv, labels, out / "ellipses.png", kinds, samples)
    return {"ranking": ranking, "encodings": enc}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--dataset", default="demo", help="demo | karpathy | hierarcaps")
    p.add_argument("--out", required=True)
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--top", type=int, default=16, help="items per most / least uncertain section")
    p.add_argument("--ellipses", type=int, default=5, help="images (with their captions) in ellipses.png")
    p.add_argument("--samples", type=int, default=10, help="draws per embedding for the PCA (paper A.2)")
    p.add_argument("--max_items", type=int, default=0, help="only the first N images (0: all)")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--demo_cache_dir", default="")
    p.add_argument("--demo_split", default="levels", help="demo: levels (4 captions) | retrieval")
    p.add_argument("--karpathy_json", default="")
    p.add_argument("--image_root", default="")
    p.add_argument("--split", default="test")
    p.add_argument("--csv", default="", help="hierarcaps_test.csv")
    p.add_argument("--image_dir", default="", help="HierarCaps: COCO val images")
    p.add_argument("--tokenizer_kind", default="sentencepiece")
    p.add_argument("--tokenizer_path", default="")
    args = p.parse_args(argv)

    import prolip_jax

    data = load_set(args)
    model = prolip_jax.load(args.checkpoint, step=args.step)
    tokenizer = tokenizer_for(data, args, model.config.text.context_length)
    out = Path(args.out)
    res = inspect(model.module, model.params, data, tokenizer, out, args.top, args.ellipses,
                  args.samples, args.batch_size)
    r = res["ranking"]
    print(f"wrote {out / 'index.html'} ({len(r['images_most'])} + {len(r['images_least'])} images, "
          f"{len(r['captions_most'])} + {len(r['captions_least'])} captions), "
          f"{out / 'ranking.json'} and {out / 'ellipses.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
