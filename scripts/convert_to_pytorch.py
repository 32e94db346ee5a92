"""Export a prolip_jax checkpoint to a Hugging Face folder that the reference PyTorch code loads.

    python scripts/convert_to_pytorch.py --checkpoint CKPT --out HF_DIR [--step N] [--overwrite]

HF_DIR receives `config.json` + `model.safetensors` (keys and shapes of REFERENCE §4), which
`prolip.model.ProLIPHF.from_pretrained(HF_DIR)` loads with no missing or unexpected key.
Everything is checked before anything is written; the folder appears only when complete.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="prolip_jax checkpoint directory (CKPT or CKPT/<step>)")
    p.add_argument("--out", required=True, help="output Hugging Face folder")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    args = p.parse_args(argv)

    import jax

    from prolip_jax import checkpoint, convert

    try:
        params, config, step = checkpoint.load_params(args.checkpoint, step=args.step)
        params = jax.tree.map(np.asarray, params)
        out = convert.save_hf(args.out, params, config, overwrite=args.overwrite)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"wrote {out} (step {step}, {n:,} parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
