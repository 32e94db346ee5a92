"""The tokenizer a model was trained with travels with it: checkpoints, `load`, exports.

A model's token ids mean nothing without the exact tokenizer file that produced them (a
1,000-row embedding read with a 32k vocabulary runs, and is garbage). So:

* the trainer copies the tokenizer file into the checkpoint directory (the orbax manager root,
  next to the `<step>/` folders), named by its content hash (`tokenizer-<sha256[:12]>.model`),
  and every step's config item records
      "tokenizer": {"kind", "file", "sha256", "kwargs", "mask_token_id", "protected_ids"}
  (`kwargs`: `input_pipeline.tokenizers.build_tokenizer`'s, context_length included), so the
  exact tokenizer of training is rebuilt (`tokenizer_from_record`) and a changed file is an error;
* an exported Hugging Face folder (`prolip_jax.export.save_hf`) gets the file under its usual name, the
  same record as `prolip_tokenizer.json`, and for PyTorch users a `tokenizer.json` +
  `tokenizer_config.json` that `transformers.AutoTokenizer` / open_clip's `HFTokenizer` load.

Files are read and written through the path layer (prolip_jax/runtime/paths.py): local folders or buckets
(gs://), written atomically with the permissions of a normal file.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Mapping

from input_pipeline import tokenizers as T
from prolip_jax.core import checkpoint
from prolip_jax.runtime import paths as fs
from prolip_jax.runtime.paths import write_bytes_atomic

RECORD_NAME = "prolip_tokenizer.json"  # the record inside an exported Hugging Face folder
# The usual file name of each kind inside an export (transformers' names for the first two).
EXPORT_NAMES = {"sentencepiece": "tokenizer.model", "hf": "tokenizer.json", "clip_bpe": "bpe_simple_vocab_16e6.txt"}


# --------------------------------------------------------------------------- the record
@dataclasses.dataclass(frozen=True)
class TokenizerFile:
    """A tokenizer's file content and how to build it, plus the masking ids of the training.

    kind, kwargs: `build_tokenizer(kind, path, **kwargs)` rebuilds it (kwargs hold context_length,
    clean, pad_id, eos_id, ... as resolved when training ran, not as configured)."""

    kind: str
    content: bytes
    kwargs: Mapping[str, Any]
    mask_token_id: int | None = None
    protected_ids: tuple[int, ...] = ()

    @functools.cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def suffix(self) -> str:
        if self.kind == "sentencepiece":
            return ".model"
        if self.kind == "hf":
            return ".json"
        return ".txt.gz" if self.content[:2] == b"\x1f\x8b" else ".txt"

    @property
    def stored_name(self) -> str:
        """The name inside a checkpoint directory: by content, so records of earlier steps (a run
        resumed with another tokenizer) keep pointing at their own file."""
        return f"tokenizer-{self.sha256[:12]}{self.suffix}"

    @property
    def export_name(self) -> str:
        name = EXPORT_NAMES[self.kind]
        return name + ".gz" if self.kind == "clip_bpe" and self.suffix == ".txt.gz" else name

    def record(self, file: str) -> dict[str, Any]:
        return {"kind": self.kind, "file": file, "sha256": self.sha256, "kwargs": dict(self.kwargs),
                "mask_token_id": self.mask_token_id, "protected_ids": list(self.protected_ids)}

    def write_into(self, directory: Any, name: str | None = None) -> dict[str, Any]:
        """Writes the file into `directory` (unless already there with this content) and returns
        its record. `directory`: a local path, a bucket URL or an etils epath."""
        name = name or self.stored_name
        target = fs.join(directory, name)
        if not (fs.exists(target) and _sha256_of(target) == self.sha256):
            write_bytes_atomic(target, self.content)
        return self.record(name)

    @classmethod
    def of(cls, tokenizer: Any, masking: Any = None) -> "TokenizerFile | None":
        """The file behind an `input_pipeline.tokenizers` tokenizer (or the demo's); None for
        anything else (a test's stand-in). `masking`: the trainer's typed config.masking (prolip_jax.core.step.MaskingConfig)."""
        if isinstance(tokenizer, T.SentencePieceTokenizer):
            kind, content = "sentencepiece", tokenizer._model_bytes
            kwargs = dict(clean=tokenizer.clean, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                          add_eos=tokenizer.add_eos)
        elif isinstance(tokenizer, T.HFJsonTokenizer):
            kind, content = "hf", tokenizer._json.encode("utf-8")
            kwargs = dict(clean=tokenizer.clean, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
        elif isinstance(tokenizer, T.ClipBpeTokenizer):
            kind, content = "clip_bpe", fs.read_bytes(tokenizer.path)
            kwargs = dict(clean=tokenizer.clean)
        elif type(tokenizer).__name__ == "DemoTokenizer":
            # The demo's word-level tokenizer.json, read as kind "hf" (same ids: no cleaning,
            # truncation and padding by the library, pad = EOS = 1).
            kind, content = "hf", fs.read_bytes(tokenizer.path)
            kwargs = dict(clean=None, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id)
        else:
            return None
        kwargs["context_length"] = int(tokenizer.context_length)
        mask, protected = None, ()
        if masking is not None:
            mask, protected = int(masking.mask_token_id), tuple(int(i) for i in masking.protected_ids)
        return cls(kind, bytes(content), kwargs, mask, protected)

    @classmethod
    def read(cls, directory: Any, record: Mapping[str, Any]) -> "TokenizerFile":
        """The recorded file from `directory`; an error if it is missing or its content changed."""
        path = fs.join(directory, record["file"])
        if not fs.exists(path):
            raise FileNotFoundError(f"the model's tokenizer {path} is missing (recorded with sha256 "
                                    f"{record['sha256']}); copy it back from the training's checkpoint directory")
        content = fs.read_bytes(path)
        got = hashlib.sha256(content).hexdigest()
        if got != record["sha256"]:
            raise ValueError(f"the tokenizer file {path} has changed since training (sha256 {got}, "
                             f"recorded {record['sha256']}): its ids would not be the ones the model learned")
        return cls(record["kind"], content, dict(record.get("kwargs") or {}), record.get("mask_token_id"),
                   tuple(record.get("protected_ids") or ()))

    def build(self, path: str | os.PathLike, context_length: int | None = None) -> Any:
        """The tokenizer, read from `path` (this file's content); `mask_id` / `protected_ids`
        attributes carry the training's masking ids (evaluators read `mask_id`)."""
        kwargs = dict(self.kwargs)
        if context_length is not None:
            kwargs["context_length"] = int(context_length)
        tok = T.build_tokenizer(self.kind, path, **kwargs)
        if self.mask_token_id is not None:
            tok.mask_id = self.mask_token_id
        tok.protected_ids = tuple(self.protected_ids)
        return tok

    def build_in_memory(self) -> Any:
        """The tokenizer, built from a temporary copy of the content (tokenizers read paths;
        they keep the content, so the copy can go)."""
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / ("tokenizer" + self.suffix)
            path.write_bytes(self.content)
            return self.build(path)


def _sha256_of(path: Any) -> str:
    return hashlib.sha256(fs.read_bytes(path)).hexdigest()


def tokenizer_from_record(directory: Any, record: Mapping[str, Any] | None,
                          context_length: int | None = None) -> Any:
    """The recorded tokenizer of a checkpoint directory / export folder, or None without a record."""
    if not record:
        return None
    tf = TokenizerFile.read(directory, record)
    return tf.build(fs.join(directory, record["file"]), context_length)


# --------------------------------------------------------------------------- Hugging Face export
def write_hf_files(hf_dir: str | os.PathLike, tf: TokenizerFile) -> dict[str, Any]:
    """Writes the tokenizer into an export folder: the file itself (its usual name), the record
    (`prolip_tokenizer.json`), and where possible a `tokenizer.json` + `tokenizer_config.json`
    for `transformers.AutoTokenizer.from_pretrained(hf_dir)` (what the reference's
    `HFTokenizer(name)` calls). Returns the `text_cfg` entries config.json should carry."""
    hf_dir = Path(hf_dir)
    record = tf.write_into(hf_dir, tf.export_name)
    write_bytes_atomic(hf_dir / RECORD_NAME, (json.dumps(record, indent=2) + "\n").encode())
    text_cfg: dict[str, Any] = {}
    clean = tf.kwargs.get("clean")
    if clean in ("canonicalize", "lower", "whitespace"):  # the modes open_clip's HFTokenizer knows
        text_cfg["tokenizer_kwargs"] = {"clean": clean}
    if tf.kind == "clip_bpe":
        return text_cfg  # open_clip's default (OpenAI BPE) tokenizer: no hf_tokenizer_name
    fast = spm_to_hf_json(tf) if tf.kind == "sentencepiece" else tf.content
    if fast is None:
        return text_cfg
    if tf.kind == "sentencepiece":
        write_bytes_atomic(hf_dir / "tokenizer.json", fast)
    write_bytes_atomic(hf_dir / "tokenizer_config.json", (json.dumps(_tokenizer_config(tf), indent=2) + "\n").encode())
    # The folder itself holds the tokenizer: HFTokenizer(<this folder>, ...) / AutoTokenizer.
    text_cfg["hf_tokenizer_name"] = "."
    return text_cfg


def file_from_hf(hf_dir: str | os.PathLike) -> "TokenizerFile | None":
    """The TokenizerFile an exported folder carries (`prolip_tokenizer.json` + its file, as
    `write_hf_files` wrote them; sha256 checked), or None for a folder without that record."""
    record = Path(hf_dir) / RECORD_NAME
    return TokenizerFile.read(hf_dir, json.loads(record.read_text())) if record.is_file() else None


def _tokenizer_config(tf: TokenizerFile) -> dict[str, Any]:
    tok = tf.build_in_memory()
    piece = lambda i: None if i is None else tok.id_to_piece(i)  # noqa: E731
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": int(tf.kwargs["context_length"]),
           "padding_side": "right", "truncation_side": "right", "clean_up_tokenization_spaces": False,
           "eos_token": piece(tok.eos_id), "pad_token": piece(tok.pad_id)}
    unk = [i for i in range(tok.vocab_size) if tok.token_kind(i) == "unknown"]
    if unk:
        cfg["unk_token"] = piece(unk[0])
    if tf.mask_token_id is not None and tok.token_kind(tf.mask_token_id) == "special":
        cfg["mask_token"] = piece(tf.mask_token_id)
    return {k: v for k, v in cfg.items() if v is not None}


def spm_to_hf_json(tf: TokenizerFile) -> bytes | None:
    """A SentencePiece BPE / unigram model as a Hugging Face `tokenizer.json`, built the way
    transformers' SpmConverter builds T5's (merges of a BPE model from its vocabulary, ordered
    by the merged piece's score), with "$A </s>" appended and right padding with the pad id.
    The ids equal `SentencePieceTokenizer`'s on cleaned text (tests/test_tokenizer_travels.py).
    None for another model type (word / char), or without protobuf to read the model."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except ImportError:
        return None
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    proto = pb.ModelProto()
    proto.ParseFromString(tf.content)
    pieces = [(p.piece, p.score, p.type) for p in proto.pieces]
    model_type = proto.trainer_spec.model_type  # 1 unigram, 2 bpe, 3 word, 4 char
    unk_id = proto.trainer_spec.unk_id
    byte_fallback = any(t == 6 for _, _, t in pieces)
    if model_type == 1:
        model = models.Unigram([(p, s) for p, s, _ in pieces], unk_id, byte_fallback=byte_fallback)
    elif model_type == 2:
        vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
        merges = []
        for i, (merged, score, kind) in sorted(enumerate(pieces), key=lambda x: -x[1][1]):
            if kind != 1 or len(merged) < 2:
                continue
            splits = [(merged[:k], merged[k:]) for k in range(1, len(merged))
                      if merged[:k] in vocab and merged[k:] in vocab]
            merges += sorted(splits, key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        model = models.BPE(vocab, merges, unk_token=pieces[unk_id][0], fuse_unk=True, byte_fallback=byte_fallback)
    else:
        return None
    tok = Tokenizer(model)
    steps = []
    if proto.normalizer_spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    if proto.normalizer_spec.remove_extra_whitespaces:
        steps.append(normalizers.Replace(Regex(" {2,}"), " "))
    if steps:
        tok.normalizer = normalizers.Sequence(steps)
    prepend = "always" if proto.normalizer_spec.add_dummy_prefix else "never"
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme=prepend)
    tok.add_special_tokens([AddedToken(p, normalized=False, special=True) for p, _, t in pieces if t in (3, 4)])
    eos, pad = tf.kwargs.get("eos_id"), tf.kwargs.get("pad_id")
    if tf.kwargs.get("add_eos", True) and eos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=["$A", pieces[eos][0]], pair=["$A", pieces[eos][0], "$B", pieces[eos][0]],
            special_tokens=[(pieces[eos][0], eos)])
    if pad is not None:
        tok.enable_padding(direction="right", pad_id=pad, pad_token=pieces[pad][0])
    return tok.to_str(pretty=True).encode("utf-8")


# --------------------------------------------------------------------------- checkpoints
def from_checkpoint(path: str | os.PathLike, step: int | None = None, context_length: int | None = None) -> Any:
    """The tokenizer a checkpoint was trained with (rebuilt from the file recorded beside it,
    its sha256 checked; `mask_id` / `protected_ids` attributes hold the training's masking ids),
    or None for a checkpoint that records none (written before tokenizers were recorded, or
    trained on random tokens). context_length: default the training's."""
    root, step = checkpoint.resolve(path, step)
    meta = checkpoint.load_config(root, step)[1]
    return tokenizer_from_record(root, meta.get("tokenizer"), context_length)


def file_from_checkpoint(path: str | os.PathLike, step: int | None = None) -> "TokenizerFile | None":
    """The recorded TokenizerFile of a checkpoint (None if none is recorded)."""
    root, step = checkpoint.resolve(path, step)
    record = checkpoint.load_config(root, step)[1].get("tokenizer")
    return TokenizerFile.read(root, record) if record else None
