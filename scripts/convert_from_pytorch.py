"""Import pretrained weights (ProLIP, open_clip / OpenAI CLIP, SigLIP) as a prolip_jax checkpoint.

    python scripts/convert_from_pytorch.py --src SRC --out CKPT [--format auto] [--arch NAME]
    python scripts/convert_from_pytorch.py --hf_dir HF_DIR --out CKPT     # the ProLIP HF folder

SRC: a file or folder (a ProLIP Hugging Face folder with config.json + model.safetensors; an
open_clip hub folder with open_clip_config.json + open_clip_model.safetensors; a big_vision
SigLIP .npz) or a Hugging Face repo id (`timm/ViT-B-16-SigLIP`, `apple/DFN5B-CLIP-ViT-H-14`;
read from the hub cache when HF_HUB_OFFLINE=1). --arch names the architecture when no config
file sits beside the weights (an open_clip name such as ViT-B-32-quickgelu, a ProLIP variant,
or a .json model-config file). Pickled `.bin`/`.pt` files are refused with the one-line
PyTorch command that converts them. The format detected, missing/unplaced keys and wrong
shapes are reported by name, and nothing is written unless everything fits.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--src", help="file, folder or Hugging Face repo id to import")
    src.add_argument("--hf_dir", help="a ProLIP Hugging Face folder (same as --src DIR --format prolip)")
    p.add_argument("--out", required=True, help="output prolip_jax checkpoint directory")
    p.add_argument("--format", default="auto", help="auto | prolip | open_clip | timm_siglip | big_vision")
    p.add_argument("--arch", default=None, help="architecture name or .json config when none is beside the weights")
    p.add_argument("--allow_unplaced", action="store_true", help="drop source keys without a place instead of failing")
    p.add_argument("--step", type=int, default=0, help="step number to record (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = p.parse_args(argv)

    from prolip_jax import checkpoint
    from prolip_jax.pretrained.loader import load_pretrained

    source, fmt = (args.hf_dir, "prolip") if args.hf_dir else (args.src, args.format)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()) and not args.overwrite:
        print(f"error: {out} exists and is not empty (use --overwrite)", file=sys.stderr)
        return 2
    arch = args.arch
    if arch and arch.endswith(".json"):
        arch = json.loads(Path(arch).read_text())
        arch = arch.get("model_cfg", arch)
    try:  # validates every key and shape before anything is written
        config, params, report = load_pretrained(source, format=fmt, arch=arch, allow_unplaced=args.allow_unplaced)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    if out.exists():
        shutil.rmtree(out)
    local = Path(source)
    path = checkpoint.save_params(out, params, config, step=args.step, metadata={
        "source": str(local.absolute()) if local.exists() else source, "source_format": report.format,
        "unplaced": report.unplaced, "filled": report.filled})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
