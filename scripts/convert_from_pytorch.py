"""Import reference PyTorch ProLIP weights (a Hugging Face folder) as a prolip_jax checkpoint.

    python scripts/convert_from_pytorch.py --hf_dir HF_DIR --out CKPT [--overwrite]

HF_DIR holds `config.json` + `model.safetensors`, e.g. a downloaded
`SanghyukChun/ProLIP-ViT-B-16-DC-1B-12_8B`. Pickled `.bin`/`.pt` files are refused.
Missing/unexpected keys or wrong shapes are reported by name and nothing is written.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf_dir", required=True, help="folder with config.json and model.safetensors")
    p.add_argument("--out", required=True, help="output prolip_jax checkpoint directory")
    p.add_argument("--step", type=int, default=0, help="step number to record (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = p.parse_args(argv)

    from prolip_jax import checkpoint, convert

    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        print(f"error: {out} exists and is not empty (use --overwrite)", file=sys.stderr)
        return 2
    try:
        params, config = convert.load_hf(args.hf_dir)  # validates every key and shape first
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if out.exists():
        shutil.rmtree(out)
    path = checkpoint.save_params(out, params, config, step=args.step,
                                  metadata={"source": str(Path(args.hf_dir).absolute())})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
