"""Export a prolip_jax checkpoint to a Hugging Face folder that the reference PyTorch code loads.

    python scripts/convert_to_pytorch.py --checkpoint CKPT --out HF_DIR [--step N] [--overwrite]
        [--tokenizer KIND:PATH]

CKPT: a training workdir, its checkpoints/ folder, one step folder or an exported folder (the
rule of every tool, prolip_jax/core/artifacts.py). A non-empty HF_DIR is refused unless --overwrite.

HF_DIR receives `config.json` + `model.safetensors` (keys and shapes of naver-ai/prolip's ProLIPHF state dict), which
`prolip.model.ProLIPHF.from_pretrained(HF_DIR)` loads with no missing or unexpected key, plus
the tokenizer recorded with the checkpoint (its file, `tokenizer.json` + `tokenizer_config.json`
for `AutoTokenizer` / the reference's `HFTokenizer(HF_DIR, ...)`; config.json's
`hf_tokenizer_name` is then "." = this folder) and `preprocessor_config.json` with the
training's normalisation. A checkpoint that records no tokenizer keeps the variant's default
tokenizer name (a warning says so); `--tokenizer` gives one explicitly.
Everything is checked before anything is written; the folder appears only when complete.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="training workdir, checkpoints folder (CKPT), step folder (CKPT/<step>) or exported folder")
    p.add_argument("--out", required=True, help="output Hugging Face folder")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--tokenizer", default="",
                   help="KIND:PATH (sentencepiece | hf | clip_bpe) to export instead of the recorded tokenizer")
    args = p.parse_args(argv)

    import jax

    from input_pipeline import tokenizer_files
    from prolip_jax.core import checkpoint
    from prolip_jax.core import convert, artifacts
    from prolip_jax import export

    try:
        artifacts.check_out(args.out, args.overwrite)  # before the (slow) load
        where = artifacts.locate(args.checkpoint, args.step)
        if where.kind == "checkpoint":
            params, config, step = checkpoint.load_params(where.path, step=where.step)
            normalization = checkpoint.training_normalization(checkpoint.load_config(where.path, step)[1])
            recorded = tokenizer_files.file_from_checkpoint(where.path, step)
        elif where.kind == "hf":  # an export again (another --tokenizer, or a copy)
            params, config = convert.load_hf(where.path)
            step, normalization = None, export.load_hf_preprocessing(where.path)[1]
            recorded = tokenizer_files.file_from_hf(where.path)
        else:
            raise ValueError(f"{args.checkpoint} is not a prolip_jax checkpoint, training workdir or exported "
                             "folder: import other weights with scripts/convert_from_pytorch.py first")
        tokenizer = explicit_tokenizer(args.tokenizer, config) or recorded
        params = jax.tree.map(np.asarray, params)
        out = export.save_hf(args.out, params, config, overwrite=args.overwrite, tokenizer=tokenizer,
                              normalization=normalization)
    except (FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"wrote {out} ({'step ' + str(step) if step is not None else 'from ' + str(args.checkpoint)}, "
          f"{n:,} parameters)")
    if tokenizer is None:
        print(f"warning: {args.checkpoint} records no tokenizer; config.json names "
              f"{config.text.hf_tokenizer_name!r} (the model variant's default). Check that it is the one the "
              f"model was trained with (vocabulary <= {config.text.vocab_size}), or pass --tokenizer KIND:PATH.",
              file=sys.stderr)
    else:
        clean = tokenizer.kwargs.get("clean")
        print(f"tokenizer: {tokenizer.kind} ({tokenizer.export_name}, sha256 {tokenizer.sha256[:12]}); in PyTorch: "
              f"HFTokenizer({str(out)!r}, context_length={tokenizer.kwargs['context_length']}"
              + (f", clean={clean!r})" if clean else ")"))
    return 0


def explicit_tokenizer(spec: str, config) -> object:
    """--tokenizer KIND:PATH -> a tokenizer_files.TokenizerFile (None without the flag)."""
    if not spec:
        return None
    from input_pipeline.tokenizers import build_tokenizer
    from input_pipeline.tokenizer_files import TokenizerFile

    kind, _, path = spec.partition(":")
    if not path:
        raise ValueError("--tokenizer is KIND:PATH, e.g. sentencepiece:/data/tokenizer.model")
    tokenizer = build_tokenizer(kind, path, context_length=config.text.context_length)
    if tokenizer.vocab_size > config.text.vocab_size:
        raise ValueError(f"--tokenizer {path} has {tokenizer.vocab_size} tokens but the model's text embedding "
                         f"has {config.text.vocab_size} rows: not this model's tokenizer")
    return TokenizerFile.of(tokenizer)


if __name__ == "__main__":
    sys.exit(main())
