r"""Train a SentencePiece tokenizer on your captions, and print the flags that go with it.

    python scripts/train_tokenizer.py --input '/data/mine/train-{00000..00009}.tar' \
        --output /data/mine/tokenizer.model --context_length 16

--input: webdataset tar shards (the `.txt` member of each record is its caption) and/or text
files with one caption per line (anything not ending in .tar / .tar.gz / .tgz); several paths,
globs and brace patterns. The output is a `.model` file for `data.tokenizer.kind=sentencepiece`.

The vocabulary, in the layout the trainer's defaults (configs/own_data.py) and the reference
expect:
    0 <pad>   reserved (never produced: the pipeline pads with EOS, as SigLIP/ProLIP do)
    1 </s>    EOS, appended to every caption, and the pad id the pipeline uses (pad = EOS = 1)
    2 <unk>   characters never seen in the captions
    3 [MASK]  the token ProLIP's masked forward writes over text (`masking.mask_token_id`)
    4...      BPE pieces
It prints the vocabulary size (the model's text embedding must have at least that many rows),
these ids, the exact `--config.data.tokenizer.*` / `--config.masking.*` flags, how many pieces
are whole words, and the longest tokenized caption and the share of captions cut at
`--context_length` (truncation is silent in training: a cut class word is simply gone).

Why BPE with an automatic vocabulary size: on a small caption corpus (hundreds to thousands of
captions) SentencePiece's default unigram model stays almost character-level whatever
vocab_size is asked for (with hard_vocab_limit=False, 400 digit captions gave 46 pieces and
"a scan of a handwritten number seven" 25 of them, so a context of 16 cut off the class word).
BPE merges the most frequent pairs first and, asked for more pieces than the corpus can form,
stops once every word is a single piece, so on such a corpus each word stays whole (7 pieces
for that caption) and the vocabulary is as small as that allows. Words it never saw (e.g. a
zero-shot class name absent from the captions) are still spelled with sub-word pieces, not
mapped to <unk> as a word-level model would. On a large corpus the vocabulary stops at
--max_vocab_size and rare words split into frequent sub-words, as usual.
"""
from __future__ import annotations

import argparse
import io
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/train_tokenizer.py` from anywhere
    sys.path.insert(0, str(ROOT))

PAD_ID, EOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3
MASK_PIECE = "[MASK]"
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def read_captions(inputs: Sequence[str]) -> Iterator[str]:
    """Captions of tar shards (the `.txt` member of each record) and text files (one per line)."""
    from input_pipeline import shards as paths_lib
    from prolip_jax.runtime import paths as fs
    from input_pipeline import tar_source
    from input_pipeline.decode import pick_caption
    from input_pipeline.records import Skip

    for path in paths_lib.expand_paths(list(inputs)):
        if path.endswith(TAR_SUFFIXES):
            with fs.open(path, "rb") as f:
                try:
                    for _, members in tar_source.iter_tar_groups(f):
                        caption = pick_caption(members.get(tar_source.TEXT_EXT), None)
                        if not isinstance(caption, Skip):
                            yield caption
                except tar_source._SHARD_ERRORS as e:  # the records before the damage are kept
                    print(f"warning: {path} is unreadable past some point ({type(e).__name__}: {e}); "
                          "its captions before that are used", file=sys.stderr)
        else:
            with fs.open(path, "rb") as f:
                for line in io.TextIOWrapper(f, encoding="utf-8", errors="replace"):
                    if line.strip():
                        yield line.strip()


def train_tokenizer(inputs: Sequence[str], output: str | os.PathLike, context_length: int,
                    vocab_size: int = 0, max_vocab_size: int = 1000, model_type: str = "bpe",
                    clean: str = "canonicalize", max_sentences: int = 2_000_000,
                    num_threads: int = 0) -> dict:
    """Trains and writes the model; returns the report (see `report_lines`).

    vocab_size: 0 = automatic (BPE: every word of the corpus whole, at most max_vocab_size)."""
    import sentencepiece as spm

    from input_pipeline.tokenizers import build_tokenizer, get_clean_fn
    from prolip_jax.runtime.paths import write_bytes_atomic

    clean_fn = get_clean_fn(clean)
    # The tokenizer sees captions cleaned as the pipeline cleans them, so train on those.
    captions = [c for c in (clean_fn(t) for t in read_captions(inputs)) if c]
    if not captions:
        raise ValueError(f"no captions found in {list(inputs)} (tar shards need <key>.txt members; "
                         "text files one caption per line)")
    target = vocab_size or max_vocab_size
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(captions), model_writer=model, model_type=model_type,
        vocab_size=target, hard_vocab_limit=not (vocab_size == 0 or model_type == "word"),
        pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1, user_defined_symbols=[MASK_PIECE],
        character_coverage=1.0,  # small corpora: keep every character seen (else <unk>)
        input_sentence_size=max_sentences, shuffle_input_sentence=True,
        num_threads=num_threads or min(os.cpu_count() or 1, 8), minloglevel=2)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(output, model.getvalue())

    tok = build_tokenizer("sentencepiece", output, context_length=context_length, clean=clean)
    assert (tok.pad_id, tok.eos_id, tok.id_to_piece(MASK_ID)) == (EOS_ID, EOS_ID, MASK_PIECE)
    sp = tok.backend
    lengths = [len(ids) + 1 for ids in sp.encode(captions, out_type=int)]  # + EOS
    truncated = sum(n > context_length for n in lengths)
    longest = max(range(len(captions)), key=lengths.__getitem__)
    words = Counter(w for c in captions for w in c.split())
    whole = {w for w in words if len(sp.encode(w, out_type=int)) == 1}
    ordered = sorted(lengths)
    return {
        "output": str(output.absolute()), "vocab_size": tok.vocab_size, "model_type": model_type,
        "clean": clean, "context_length": context_length, "pad_id": tok.pad_id, "eos_id": tok.eos_id,
        "unk_id": UNK_ID, "mask_id": MASK_ID, "protected_ids": (tok.eos_id,),
        "num_captions": len(captions), "distinct_words": len(words),
        "whole_words": len(whole) / len(words),
        "whole_word_occurrences": sum(words[w] for w in whole) / sum(words.values()),
        "longest_tokens": lengths[longest], "longest_caption": captions[longest],
        "longest_pieces": sp.encode(captions[longest], out_type=str),
        "truncated": truncated, "truncated_share": truncated / len(captions),
        "p99_tokens": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def flags(report: dict) -> str:
    """The trainer flags for this tokenizer (also the eval config's, e.g. configs/eval/imagefolder.py)."""
    parts = ["--config.data.tokenizer.kind=sentencepiece",
             f"--config.data.tokenizer.path={report['output']}",
             f"--config.data.tokenizer.context_length={report['context_length']}"]
    if report["clean"] != "canonicalize":  # build_tokenizer's default for sentencepiece
        parts.append(f"--config.data.tokenizer.clean={report['clean']}")
    parts += [f"--config.masking.mask_token_id={report['mask_id']}",
              f"--config.masking.protected_ids='{tuple(report['protected_ids'])}'"]
    return " ".join(parts)


def report_lines(r: dict) -> list[str]:
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    lines = [
        f"wrote {r['output']}: {r['model_type']} SentencePiece model, vocabulary {r['vocab_size']} "
        f"(the model's text embedding needs >= {r['vocab_size']} rows: model.text vocab_size)",
        f"ids: pad {r['pad_id']} (= EOS; piece 0 <pad> is reserved, never produced), eos {r['eos_id']}, "
        f"unk {r['unk_id']}, [MASK] {r['mask_id']}",
        f"{r['num_captions']} captions, {r['distinct_words']} distinct words: {pct(r['whole_words'])} of them "
        f"({pct(r['whole_word_occurrences'])} of word occurrences) are one piece",
        f"longest caption: {r['longest_tokens']} tokens with EOS ({r['longest_caption']!r} -> "
        f"{' '.join(r['longest_pieces'])}); 99% of captions fit in {r['p99_tokens']}",
        f"context_length {r['context_length']}: {r['truncated']} of {r['num_captions']} captions "
        f"({pct(r['truncated_share'])}) would be cut",
    ]
    if r["truncated"]:
        lines.append(f"warning: raise --context_length (and the model's text context_length) to "
                     f"{r['longest_tokens']} to keep every caption whole")
    if r["whole_words"] < 0.99:
        lines.append("note: some words are split into pieces (the vocabulary is capped at --max_vocab_size); "
                     "fine for a large corpus, or raise --max_vocab_size if the model's embedding allows")
    lines += ["flags for prolip_jax.train (and the eval config's tokenizer):", "  " + flags(r)]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help="tar shards and/or caption text files (paths, globs, brace patterns)")
    p.add_argument("--output", required=True, help="the .model file to write")
    p.add_argument("--context_length", type=int, required=True,
                   help="the text context length to check captions against (data.tokenizer.context_length)")
    p.add_argument("--vocab_size", type=int, default=0,
                   help="exact vocabulary size; 0 (default): automatic, every word whole up to --max_vocab_size")
    p.add_argument("--max_vocab_size", type=int, default=1000,
                   help="cap of the automatic size (default 1000: the `tiny` variant's text embedding)")
    p.add_argument("--model_type", default="bpe", choices=("bpe", "unigram", "word"),
                   help="SentencePiece model type (default bpe; see the module docstring)")
    p.add_argument("--clean", default="canonicalize", choices=("canonicalize", "lower", "whitespace", "none"),
                   help="the text cleaning the tokenizer applies (build_tokenizer's clean; default canonicalize)")
    p.add_argument("--max_sentences", type=int, default=2_000_000,
                   help="captions sampled for training from a larger corpus")
    args = p.parse_args(argv)
    if args.context_length < 2:
        p.error("--context_length must be >= 2 (one piece and EOS)")
    try:
        report = train_tokenizer(args.input, args.output, args.context_length, vocab_size=args.vocab_size,
                                 max_vocab_size=args.max_vocab_size, model_type=args.model_type,
                                 clean=args.clean, max_sentences=args.max_sentences)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    print("\n".join(report_lines(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
