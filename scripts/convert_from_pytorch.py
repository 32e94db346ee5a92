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
shapes are reported by name, and nothing is written unless everything fits: CKPT is written
beside itself and renamed into place when complete. A non-empty CKPT is refused unless
--overwrite. SRC may also be a prolip_jax training workdir, checkpoints folder or step folder
(the rule of every tool, prolip_jax/core/artifacts.py). The tokenizer and image normalisation an
exported folder (or a prolip_jax checkpoint) carries are recorded in CKPT, so
`prolip_jax.load(CKPT).tokenize(...)` gives the ids of the original.
"""
from __future__ import annotations

import argparse
import json
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

    from prolip_jax.core import checkpoint
    from prolip_jax.runtime import paths
    from prolip_jax.core import artifacts
    from prolip_jax.core.pretrained.loader import load_pretrained

    source, fmt = (args.hf_dir, "prolip") if args.hf_dir else (args.src, args.format)
    arch = args.arch
    try:  # validates every key and shape before anything is written
        out = artifacts.check_out(args.out, args.overwrite)
        if arch and arch.endswith(".json"):
            arch = json.loads(Path(arch).read_text())
            arch = arch.get("model_cfg", arch)
        where = artifacts.locate(source)
        config, params, report = load_pretrained(where.step_dir if where.kind == "checkpoint" else where.path,
                                                 format=fmt, arch=arch, allow_unplaced=args.allow_unplaced)
        tokenizer, normalization = recorded_preprocessing(where)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.summary())
    local = Path(source)
    metadata = {"source": str(local.absolute()) if local.exists() else source, "source_format": report.format,
                "unplaced": report.unplaced, "filled": report.filled}
    if normalization is not None:
        metadata["normalization"] = normalization
    # Written beside --out, renamed into place when complete: an error leaves nothing half-written.
    with paths.replacing_folder(out) as tmp:
        checkpoint.save_params(tmp, params, config, step=args.step, metadata=metadata, tokenizer=tokenizer)
    path = out / str(args.step)
    if tokenizer is not None:
        print(f"tokenizer: {tokenizer.kind} (sha256 {tokenizer.sha256[:12]}) recorded with the checkpoint")
    print(f"wrote {path}")
    return 0


def recorded_preprocessing(where) -> tuple:
    """(TokenizerFile or None, normalisation or None) that the source carries: an exported
    folder's prolip_tokenizer.json + preprocessor_config.json, or a prolip_jax checkpoint's record.
    `where`: a prolip_jax.core.artifacts.Located."""
    from input_pipeline import tokenizer_files
    from prolip_jax.core import checkpoint
    from prolip_jax import export

    if where.kind == "hf":
        return tokenizer_files.file_from_hf(where.path), export.load_hf_preprocessing(where.path)[1]
    if where.kind == "checkpoint":
        meta = checkpoint.load_config(where.path, where.step)[1]
        return (tokenizer_files.file_from_checkpoint(where.path, where.step),
                checkpoint.training_normalization(meta))
    return None, None


if __name__ == "__main__":
    sys.exit(main())
