"""Text tokenizers: SigLIP/ProLIP SentencePiece, HF ``tokenizer.json``, CLIP BPE.

Every tokenizer here follows one contract, the one the ProLIP reference relies on:

    tok = build_tokenizer("sentencepiece", "/data/vocab/c4_en.model", context_length=64)
    ids = tok(["A photo of a cat.", ...])     # np.ndarray int32 [N, context_length]
    tok.context_length, tok.vocab_size, tok.pad_id, tok.eos_id

* ``"sentencepiece"`` follows naver-ai/prolip ``src/prolip/tokenizer.py`` ``HFTokenizer`` built as
  ``HFTokenizer("timm/ViT-B-16-SigLIP", context_length=64, clean="canonicalize")``: the text is
  cleaned with ``canonicalize``, encoded with the T5-style SentencePiece model (no BOS, ``</s>``
  appended), truncated so that EOS stays the last token, and right-padded with pad id = EOS id = 1
  (ProLIP's training code takes ``texts != 1`` as the padding mask). See
  :class:`SentencePieceTokenizer` for when its ids equal the hub tokenizer.json's.
* ``"hf"`` loads a Hugging Face ``tokenizer.json`` with the ``tokenizers`` library; padding and
  truncation are done by the library exactly as ``transformers``' fast tokenizers do for
  ``batch_encode_plus(..., max_length=L, padding="max_length", truncation=True)``.
* ``"clip_bpe"`` matches open_clip 2.24 ``SimpleTokenizer.__call__`` (the OpenAI CLIP BPE, vocab
  49408, used by ViT-H-14-ProLIP): ``<start_of_text> ... <end_of_text>`` then zeros.

Nothing here touches the network: every tokenizer reads one local file, and a missing file raises
:class:`TokenizerFileNotFoundError` naming the file and where it is usually published. The file's
contents are kept in the object and the library object that encodes is built lazily, so a
tokenizer pickles (without that object, and without needing the file again) into grain worker
processes and loads its model once per process.
"""

from __future__ import annotations

import abc
import functools
import gzip
import html
import os
import string
from typing import Any, Callable, Optional, Sequence, Union

import ftfy
import numpy as np
import regex

from prolip_jax.runtime import paths as fs

# Rust-side thread pools and forked grain workers do not mix (open_clip sets the same at import);
# setdefault keeps an explicit user choice.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__all__ = [
    "CLEAN_MODES", "TOKENIZER_KINDS", "TokenizerFileNotFoundError", "Tokenizer",
    "SentencePieceTokenizer", "HFJsonTokenizer", "ClipBpeTokenizer", "build_tokenizer",
    "basic_clean", "whitespace_clean", "canonicalize_text", "get_clean_fn",
]

# --------------------------------------------------------------------------------------------
# Text cleaning (open_clip 2.24 tokenizer.py, copied unchanged into prolip/tokenizer.py).
# The `regex` module is used on purpose: open_clip does `import regex as re`, and its `\s`
# (Unicode White_Space) differs from the stdlib's (str.isspace, which also takes \x1c-\x1f).
# --------------------------------------------------------------------------------------------
_WHITESPACE = regex.compile(r"\s+")
_DROP_PUNCTUATION = str.maketrans("", "", string.punctuation)


def basic_clean(text: str) -> str:
    """ftfy.fix_text, then html.unescape twice, then strip (open_clip ``basic_clean``)."""
    if text.isascii() and text.isprintable() and "&" not in text:
        # Printable ASCII without '&' is a fixed point of all three: ftfy's fixes act on
        # non-ASCII text, control characters, \r line breaks, terminal escapes and HTML
        # entities. Skipping ftfy saves ~15 us per caption (tests/test_tokenizers.py checks
        # the identity against ftfy).
        return text.strip()
    text = ftfy.fix_text(text)
    text = html.unescape(html.unescape(text))
    return text.strip()


def whitespace_clean(text: str) -> str:
    """Collapse every whitespace run to one space, then strip (open_clip ``whitespace_clean``)."""
    return _WHITESPACE.sub(" ", text).strip()


def canonicalize_text(text: str) -> str:
    """big_vision's canonicalisation as in open_clip ``canonicalize_text``: ``_`` -> space, drop
    ASCII ``string.punctuation``, lowercase, collapse whitespace, strip."""
    text = text.replace("_", " ")
    text = text.translate(_DROP_PUNCTUATION)
    text = text.lower()
    return whitespace_clean(text)


def _clean_canonicalize(text: str) -> str:
    return canonicalize_text(basic_clean(text))


def _clean_lower(text: str) -> str:
    return whitespace_clean(basic_clean(text)).lower()


def _clean_whitespace(text: str) -> str:
    return whitespace_clean(basic_clean(text))


def _clean_none(text: str) -> str:
    return text


# Module-level functions (not lambdas) so that tokenizers holding them stay picklable.
_CLEAN_FNS: dict[str, Callable[[str], str]] = {
    "canonicalize": _clean_canonicalize,
    "lower": _clean_lower,
    "whitespace": _clean_whitespace,
    "none": _clean_none,
}
CLEAN_MODES = tuple(_CLEAN_FNS)


def get_clean_fn(mode: Optional[str]) -> Callable[[str], str]:
    """Cleaning function for ``mode`` in :data:`CLEAN_MODES` (``None`` means ``"none"``)."""
    key = "none" if mode is None else str(mode).lower()
    if key not in _CLEAN_FNS:
        raise ValueError(f"Unknown clean mode {mode!r}; expected one of {CLEAN_MODES} or None.")
    return _CLEAN_FNS[key]


# --------------------------------------------------------------------------------------------
# Offline file access.
# --------------------------------------------------------------------------------------------
class TokenizerFileNotFoundError(FileNotFoundError):
    """A tokenizer's vocabulary/model file is not on local disk (nothing is ever downloaded)."""


_SPM_HINT = (
    "The SigLIP/ProLIP English vocabulary is the T5 c4-en SentencePiece model (32,000 pieces): "
    "'spiece.model' in the Hugging Face repo timm/ViT-B-16-SigLIP, or "
    "gs://t5-data/vocabs/cc_en.32000/sentencepiece.model (big_vision's 'c4_en' tokenizer, the "
    "file open_clip's SigLipTokenizer fetches)."
)
_HF_HINT = (
    "A 'tokenizer.json' sits at the top of Hugging Face model repos, e.g. timm/ViT-B-16-SigLIP "
    "(for that T5 vocabulary pass pad_id=1, as SigLIP/ProLIP do); it is written by "
    "tokenizers.Tokenizer.save() or transformers' save_pretrained()."
)
_CLIP_HINT = (
    "The OpenAI CLIP BPE vocabulary is 'bpe_simple_vocab_16e6.txt.gz' from open_clip's source "
    "tree (src/open_clip/bpe_simple_vocab_16e6.txt.gz, also inside the open_clip_torch wheel) or "
    "openai/CLIP (clip/bpe_simple_vocab_16e6.txt.gz)."
)


def _read_file(path: Union[str, os.PathLike], kind: str, what: str, hint: str) -> bytes:
    """Bytes of a local file or a bucket object (gs://..., through the path layer), or a
    :class:`TokenizerFileNotFoundError` that says what to fetch."""
    tail = ("This code never downloads files from the internet at run time: put the file on local "
            "disk or in your bucket once and point the config at it. " + hint)
    name = os.fspath(path) if fs.is_url(path) else fs.local(path)
    if not fs.isfile(name):
        raise TokenizerFileNotFoundError(
            f"The {kind!r} tokenizer needs {what}, but {name!r} does not exist "
            f"or is not a file. {tail}")
    return fs.read_bytes(name)


# --------------------------------------------------------------------------------------------
# Common interface.
# --------------------------------------------------------------------------------------------
class Tokenizer(abc.ABC):
    """Callable ``tok(texts) -> int32 [N, context_length]``; cleans, encodes, pads, truncates.

    Subclasses keep only plain data (file bytes, settings) in their state; the library object that
    does the encoding (``self._backend``) is rebuilt lazily on first use in each process.
    """

    kind: str = ""
    context_length: int
    vocab_size: int
    pad_id: int
    eos_id: Optional[int]

    def __init__(self, context_length: int, clean: Optional[str]):
        if int(context_length) < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}.")
        self.context_length = int(context_length)
        self.clean = clean
        self._clean_fn = get_clean_fn(clean)
        self._backend: Any = None

    @abc.abstractmethod
    def _load_backend(self) -> Any:
        """Builds the encoding object from the stored file bytes (called once per process)."""

    @abc.abstractmethod
    def _encode_counting(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Cleaned texts -> (int32 [N, context_length] with the kind's specials/padding,
        bool [N]: the text did not fit and was cut)."""

    def _encode_cleaned(self, texts: list[str]) -> np.ndarray:
        return self._encode_counting(texts)[0]

    @property
    def backend(self) -> Any:
        if self._backend is None:
            self._backend = self._load_backend()
        return self._backend

    def clean_text(self, text: str) -> str:
        """The cleaning this tokenizer applies before encoding."""
        return self._clean_fn(text)

    def __call__(self, texts: Union[str, Sequence[str]]) -> np.ndarray:
        """Tokenizes a batch. texts: N strings (a bare string counts as N=1).

        Returns: np.ndarray int32 [N, context_length].
        """
        if isinstance(texts, str):
            texts = [texts]
        cleaned = [self._clean_fn(t) for t in texts]
        if not cleaned:
            return np.zeros((0, self.context_length), np.int32)
        return self._encode_cleaned(cleaned)

    def encode_with_truncation(self, texts: Union[str, Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
        """``(self(texts), truncated)``: truncated bool [N] marks the texts whose pieces (with the
        kind's specials) did not fit in ``context_length`` and were cut. Truncation is otherwise
        silent, so the input pipeline counts it (``data/truncated``) and zero-shot warns with it."""
        if isinstance(texts, str):
            texts = [texts]
        cleaned = [self._clean_fn(t) for t in texts]
        if not cleaned:
            return np.zeros((0, self.context_length), np.int32), np.zeros((0,), bool)
        return self._encode_counting(cleaned)

    # Token kinds of `token_kind`: what an id is in this tokenizer's vocabulary.
    TOKEN_KINDS = ("special", "unknown", "normal", "byte", "unused", "outside")

    def token_kind(self, token_id: int) -> str:
        """What ``token_id`` is here: "special" (control / user-defined / added special token,
        pad and EOS included: never produced from text), "unknown" (the ``<unk>`` id),
        "normal" (an ordinary piece text is encoded into), "byte" / "unused" (SentencePiece
        byte-fallback / unused pieces) or "outside" (>= vocab_size: never produced)."""
        i = int(token_id)
        if i < 0 or i >= self.vocab_size:
            return "outside"
        if i in (self.pad_id, self.eos_id):
            return "special"
        return self._token_kind(i)

    def _token_kind(self, token_id: int) -> str:
        return "normal"

    def id_to_piece(self, token_id: int) -> Optional[str]:
        """The vocabulary string of ``token_id`` (None outside the vocabulary)."""
        return None

    def special_ids(self) -> dict[int, str]:
        """{id: piece} of the special ids that encoding text never produces (not pad/EOS/BOS;
        e.g. a ``[MASK]`` piece): free for the trainer's masking."""
        return {}

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_backend"] = None  # never ship the library object; rebuilt lazily after unpickling
        return state

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(context_length={self.context_length}, vocab_size="
                f"{self.vocab_size}, pad_id={self.pad_id}, eos_id={self.eos_id}, clean={self.clean!r})")


def _pack_rows(rows: Sequence[Sequence[int]], context_length: int, pad_id: int) -> np.ndarray:
    """Right-pads rows (each already <= context_length long) into int32 [N, context_length]."""
    out = np.full((len(rows), context_length), pad_id, dtype=np.int32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return out


# --------------------------------------------------------------------------------------------
# SigLIP-style SentencePiece.
# --------------------------------------------------------------------------------------------
class SentencePieceTokenizer(Tokenizer):
    """T5/SigLIP SentencePiece model read directly with ``sentencepiece``.

    Row layout for a text of n pieces p_1..p_n and context length L (no BOS):
        n <= L - 1:  [p_1 .. p_n, eos, pad, ..., pad]
        n >= L:      [p_1 .. p_{L-1}, eos]
    which is what ``T5TokenizerFast.batch_encode_plus(max_length=L, padding="max_length",
    truncation=True)`` returns: the tokenizers library truncates the encoding to
    ``L - post_processor.added_tokens()`` (= L - 1 for T5's ``$A </s>`` template) *before*
    appending ``</s>``, then pads (tokenizers/src/tokenizer/mod.rs ``post_process``).

    Pieces come from ``sentencepiece`` itself rather than from HF's Unigram port of the same model.
    The two agree (tests compare against a tokenizer.json built as transformers' ``T5Converter``
    builds it) as long as no piece has an inner ``▁`` (sentencepiece's default
    ``split_by_whitespace``) and the text holds no control-symbol string such as ``</s>``, which
    HF would map to its id (``canonicalize`` removes ``<``/``/``/``>``). To run the hub's own file
    instead, use kind ``"hf"`` with timm/ViT-B-16-SigLIP's tokenizer.json and ``pad_id=1``.

    Args:
      path: the ``.model`` file.
      context_length: L.
      clean: cleaning mode, default ``"canonicalize"`` (ProLIP's ``tokenizer_kwargs``).
      eos_id: EOS id; default the model's own EOS piece (``</s>`` = 1 in the c4-en model).
      pad_id: pad id; default = ``eos_id`` (SigLIP/ProLIP pad with 1, not T5's ``<pad>`` = 0).
      add_eos: append EOS (True for the reference).
      num_threads: sentencepiece batch-encode threads; 1 suits one-process-per-core workers.
    """

    kind = "sentencepiece"

    def __init__(self, path: Union[str, os.PathLike], context_length: int = 64,
                 clean: Optional[str] = "canonicalize", eos_id: Optional[int] = None,
                 pad_id: Optional[int] = None, add_eos: bool = True, num_threads: int = 1):
        super().__init__(context_length, clean)
        self.path = os.fspath(path)
        self._model_bytes = _read_file(path, self.kind, "a SentencePiece '.model' file", _SPM_HINT)
        self.add_eos = bool(add_eos)
        self.num_threads = int(num_threads)
        sp = self.backend  # load once here: fail early on a bad file, read the vocab facts
        self.vocab_size = int(sp.get_piece_size())
        if eos_id is None and sp.eos_id() >= 0:
            eos_id = sp.eos_id()
        if eos_id is None and self.add_eos:
            raise ValueError(f"SentencePiece model {self.path!r} defines no EOS piece; pass eos_id.")
        self.eos_id = None if eos_id is None else int(eos_id)
        if pad_id is None:
            if self.eos_id is None:
                raise ValueError(f"SentencePiece model {self.path!r} has no EOS to pad with; "
                                 "pass pad_id.")
            pad_id = self.eos_id  # SigLIP/ProLIP: pad = EOS
        self.pad_id = int(pad_id)
        if self.pad_id < 0 or (self.eos_id is not None and self.eos_id < 0):
            raise ValueError(f"Ids must be >= 0, got eos_id={self.eos_id}, pad_id={self.pad_id}.")

    def _load_backend(self) -> Any:
        import sentencepiece as spm

        try:
            return spm.SentencePieceProcessor(model_proto=self._model_bytes)
        except Exception as e:  # sentencepiece raises a bare RuntimeError on a bad proto
            raise ValueError(f"{self.path!r} is not a valid SentencePiece model: {e}") from e

    def _encode_counting(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        sp = self.backend
        if len(texts) < 32:  # the batch API starts a thread pool per call: ~40 us of overhead
            pieces = [sp.encode(t, out_type=int, add_bos=False, add_eos=False) for t in texts]
        else:
            pieces = sp.encode(texts, out_type=int, add_bos=False, add_eos=False,
                               num_threads=self.num_threads)
        L = self.context_length
        if self.add_eos:
            rows = [ids[: L - 1] + [self.eos_id] for ids in pieces]
        else:
            rows = [ids[:L] for ids in pieces]
        room = L - 1 if self.add_eos else L
        truncated = np.fromiter((len(ids) > room for ids in pieces), bool, len(pieces))
        return _pack_rows(rows, L, self.pad_id), truncated

    def _piece_types(self) -> list[int]:
        """The ModelProto piece type of every id (1 normal, 2 unknown, 3 control, 4 user-defined,
        5 unused, 6 byte). sentencepiece's Python API has no is_user_defined, so the proto is read
        (protobuf); without protobuf, user-defined pieces count as normal."""
        types = self.__dict__.get("_types")
        if types is None:
            try:
                from sentencepiece import sentencepiece_model_pb2 as pb

                proto = pb.ModelProto()
                proto.ParseFromString(self._model_bytes)
                types = [int(p.type) for p in proto.pieces]
            except Exception:  # pylint: disable=broad-except  (no protobuf, or a proto it cannot read)
                sp = self.backend
                types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                         else 6 if sp.is_byte(i) else 1 for i in range(self.vocab_size)]
            self._types = types
        return types

    def _token_kind(self, token_id: int) -> str:
        t = self._piece_types()[token_id]
        return {2: "unknown", 3: "special", 4: "special", 5: "unused", 6: "byte"}.get(t, "normal")

    def id_to_piece(self, token_id: int) -> Optional[str]:
        i = int(token_id)
        return self.backend.id_to_piece(i) if 0 <= i < self.vocab_size else None

    def special_ids(self) -> dict[int, str]:
        types = self._piece_types()
        return {i: self.id_to_piece(i) for i, t in enumerate(types)
                if t in (3, 4) and i not in (self.pad_id, self.eos_id)}

    def decode(self, ids: Sequence[int]) -> str:
        """Pieces -> text, dropping pad/EOS ids."""
        drop = {self.pad_id, self.eos_id}
        return self.backend.decode([int(i) for i in ids if int(i) not in drop])


# --------------------------------------------------------------------------------------------
# Hugging Face tokenizer.json.
# --------------------------------------------------------------------------------------------
class HFJsonTokenizer(Tokenizer):
    """A ``tokenizer.json`` run by the ``tokenizers`` library, as transformers' fast tokenizers do.

    ``transformers`` ``PreTrainedTokenizerFast.set_truncation_and_padding`` calls
    ``enable_truncation(max_length=L, stride=0, strategy="longest_first", direction="right")`` and
    ``enable_padding(length=L, direction="right", pad_id=pad_token_id, ...)`` and then
    ``encode_batch``; we make the same calls, so specials added by the file's post-processor
    survive truncation (e.g. T5's ``</s>`` stays last) exactly as in the reference.

    Args:
      path: the ``tokenizer.json`` file, or a directory holding one.
      context_length: L.
      clean: cleaning mode, default ``"whitespace"`` (open_clip/ProLIP ``HFTokenizer`` default).
      pad_id: int id or token string; default the file's ``padding.pad_id`` (an error if none).
      eos_id: int id or token string; default the special token the post-processor appends
        (None when it appends none).
    """

    kind = "hf"

    def __init__(self, path: Union[str, os.PathLike], context_length: int = 64,
                 clean: Optional[str] = "whitespace", pad_id: Union[int, str, None] = None,
                 eos_id: Union[int, str, None] = None):
        super().__init__(context_length, clean)
        path = os.fspath(path)
        if fs.isdir(path):
            path = fs.join(path, "tokenizer.json")
        self.path = path
        what = "a Hugging Face 'tokenizer.json'"
        self._json = _read_file(path, self.kind, what, _HF_HINT).decode("utf-8")
        from tokenizers import Tokenizer as _HFTok

        try:
            raw = _HFTok.from_str(self._json)
        except Exception as e:
            raise ValueError(f"{self.path!r} is not a valid tokenizer.json: {e}") from e
        self.vocab_size = int(raw.get_vocab_size(with_added_tokens=True))
        file_padding = raw.padding
        raw.no_truncation()  # settings saved in the file must not affect the EOS probe below
        raw.no_padding()
        if pad_id is None:
            if file_padding is None:
                raise ValueError(
                    f"{self.path!r} has no padding settings, so the pad id is unknown: pass pad_id "
                    "(for the SigLIP/ProLIP T5 vocabulary, pad_id=1 as in open_clip's SigLipTokenizer).")
            pad_id = file_padding["pad_id"]
        self.pad_id = self._resolve_id(raw, pad_id, "pad_id")
        if eos_id is None:
            probe = raw.encode("a", add_special_tokens=True)
            ends_special = bool(probe.ids) and probe.special_tokens_mask[-1] == 1
            self.eos_id = int(probe.ids[-1]) if ends_special else None
        else:
            self.eos_id = self._resolve_id(raw, eos_id, "eos_id")
        self._backend = self._configure(raw)

    def _resolve_id(self, raw: Any, value: Union[int, str], name: str) -> int:
        if isinstance(value, str):
            tid = raw.token_to_id(value)
            if tid is None:
                raise ValueError(f"{name}: token {value!r} is not in {self.path!r}.")
            return int(tid)
        return int(value)

    def _configure(self, raw: Any) -> Any:
        raw.enable_truncation(max_length=self.context_length, stride=0,
                              strategy="longest_first", direction="right")
        pad_token = raw.id_to_token(self.pad_id) or "[PAD]"
        raw.enable_padding(direction="right", pad_id=self.pad_id, pad_type_id=0,
                           pad_token=pad_token, length=self.context_length)
        return raw

    def _load_backend(self) -> Any:
        from tokenizers import Tokenizer as _HFTok

        return self._configure(_HFTok.from_str(self._json))

    def _encode_counting(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self.backend.encode_batch(texts, add_special_tokens=True)
        ids = np.asarray([e.ids for e in encodings], dtype=np.int32)
        # With truncation on, the library keeps what was cut off in `overflowing`.
        truncated = np.fromiter((len(e.overflowing) > 0 for e in encodings), bool, len(encodings))
        return ids.reshape(len(texts), self.context_length), truncated

    def _unk_id(self) -> Optional[int]:
        import json as _json

        model = _json.loads(self._json).get("model") or {}
        if isinstance(model.get("unk_id"), int):  # Unigram
            return model["unk_id"]
        unk = model.get("unk_token")
        return None if unk is None else self.backend.token_to_id(unk)

    def _token_kind(self, token_id: int) -> str:
        if self._is_added_special(token_id):
            return "special"
        if token_id == self._unk_id():
            return "unknown"
        return "normal"

    def id_to_piece(self, token_id: int) -> Optional[str]:
        return self.backend.id_to_token(int(token_id))

    def special_ids(self) -> dict[int, str]:
        emitted = set(self.backend.encode("a", add_special_tokens=True).ids)  # BOS/CLS/SEP, pad
        return {int(i): t.content for i, t in self.backend.get_added_tokens_decoder().items()
                if t.special and int(i) not in emitted | {self.pad_id, self.eos_id}}

    def _is_added_special(self, token_id: int) -> bool:
        t = self.backend.get_added_tokens_decoder().get(int(token_id))
        return t is not None and t.special

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=True)


# --------------------------------------------------------------------------------------------
# OpenAI CLIP BPE (open_clip SimpleTokenizer).
# --------------------------------------------------------------------------------------------
_CLIP_SPECIALS = ("<start_of_text>", "<end_of_text>")
# open_clip keeps lines [1, 49152-256-2] of the file: line 0 is a version header, and
# 48894 merges + 512 byte symbols + 2 specials = 49408 ids.
_CLIP_MAX_MERGES = 49152 - 256 - 2
# open_clip's split pattern, specials first (so a literal "<start_of_text>" in the text maps to
# the special id, as in open_clip), compiled IGNORECASE like the original.
_CLIP_PATTERN = regex.compile(
    "|".join(_CLIP_SPECIALS) + r"""|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+""",
    regex.IGNORECASE,
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP reversible byte -> printable-character table (open_clip ``bytes_to_unicode``)."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class ClipBpeTokenizer(Tokenizer):
    """OpenAI CLIP BPE as open_clip 2.24 ``SimpleTokenizer`` (no torch).

    Row layout: ``[sot, p_1 .. p_n, eot, 0, ..., 0]``; if ``n + 2 > L`` the row is cut to L and its
    last entry set to ``eot`` (so L - 2 pieces are kept). ``pad_id`` = 0, ``eos_id`` = eot.

    Cleaning and the regex word split run in Python exactly as in open_clip. Each word's byte-level
    BPE comes from the ``tokenizers`` library's ``models.BPE`` (``end_of_word_suffix="</w>"``; it
    applies the merges lowest rank first, like open_clip's ``bpe``) behind an LRU cache of word ->
    ids, the counterpart of open_clip's (unbounded) ``self.cache``: captions reuse few words, so a
    cached caption costs a few microseconds beyond cleaning.

    Args:
      path: ``bpe_simple_vocab_16e6.txt.gz`` (gzip or plain text, open_clip's format: a header
        line, then one ``"a b"`` merge per line).
      context_length: L (77 for CLIP/ViT-H-14).
      clean: cleaning mode, default ``"lower"`` (open_clip ``SimpleTokenizer`` default).
      cache_size: words kept in the per-process LRU cache.
    """

    kind = "clip_bpe"

    def __init__(self, path: Union[str, os.PathLike], context_length: int = 77,
                 clean: Optional[str] = "lower", cache_size: int = 1 << 16):
        super().__init__(context_length, clean)
        self.path = os.fspath(path)
        self.cache_size = int(cache_size)
        raw = _read_file(path, self.kind, "a CLIP BPE merges file", _CLIP_HINT)
        self._merges = self._parse_merges(raw)
        vocab = list(_bytes_to_unicode().values())
        vocab = vocab + [v + "</w>" for v in vocab]
        vocab += ["".join(m) for m in self._merges]
        vocab += list(_CLIP_SPECIALS)
        # dict(zip(...)) like open_clip: a repeated string keeps its last id.
        self._encoder = dict(zip(vocab, range(len(vocab))))
        self.vocab_size = len(self._encoder)
        self.sot_id = self._encoder[_CLIP_SPECIALS[0]]
        self.eos_id = self._encoder[_CLIP_SPECIALS[1]]
        self.pad_id = 0

    def _parse_merges(self, raw: bytes) -> list[tuple[str, str]]:
        text = (gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw).decode("utf-8")
        lines = text.split("\n")[1 : _CLIP_MAX_MERGES + 1]
        merges = []
        for lineno, line in enumerate(lines, start=2):
            parts = tuple(line.split())
            if not parts:
                # Only a trailing newline of a short file gets here (the real file is cut well
                # before its end); open_clip would add an empty "" token for it, we skip it.
                continue
            if len(parts) != 2:
                raise ValueError(f"{self.path!r} line {lineno}: expected a merge 'a b', got {line!r}.")
            merges.append(parts)
        return merges

    def _load_backend(self) -> Callable[[str], tuple[int, ...]]:
        """Returns the cached word -> ids function (one regex match in, BPE ids out)."""
        from tokenizers import models

        bpe = models.BPE(vocab=self._encoder, merges=self._merges, end_of_word_suffix="</w>")
        byte_chars = _bytes_to_unicode()
        # open_clip seeds its bpe cache with the specials, so a word equal to one maps to its id.
        specials = {s: (self._encoder[s],) for s in _CLIP_SPECIALS}

        def word_ids(word: str) -> tuple[int, ...]:
            if word in specials:
                return specials[word]
            symbols = "".join(byte_chars[b] for b in word.encode("utf-8"))
            return tuple(t.id for t in bpe.tokenize(symbols))

        return functools.lru_cache(maxsize=self.cache_size)(word_ids)

    def encode_words(self, text: str) -> list[int]:
        """BPE ids of an already-cleaned text, without specials (open_clip ``encode`` after cleaning)."""
        word_ids = self.backend
        return [i for word in _CLIP_PATTERN.findall(text) for i in word_ids(word)]

    def _encode_counting(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        L = self.context_length
        rows, truncated = [], np.zeros(len(texts), bool)
        for i, text in enumerate(texts):
            row = [self.sot_id] + self.encode_words(text) + [self.eos_id]
            if len(row) > L:  # open_clip: tokens = tokens[:L]; tokens[-1] = eot
                row = row[:L]
                row[-1] = self.eos_id
                truncated[i] = True
            rows.append(row)
        return _pack_rows(rows, L, self.pad_id), truncated

    def _token_kind(self, token_id: int) -> str:
        # pad id 0 is also the piece "!" (open_clip pads with 0); only SOT/EOT are special.
        return "special" if token_id == self.sot_id else "normal"

    def id_to_piece(self, token_id: int) -> Optional[str]:
        i = int(token_id)
        if not 0 <= i < self.vocab_size:
            return None
        decoder = self.__dict__.get("_decoder")
        if decoder is None:
            decoder = self._decoder = {v: k for k, v in self._encoder.items()}
        return decoder.get(i)

    def special_ids(self) -> dict[int, str]:
        return {}  # SOT starts every row: no special id is free

    def decode(self, ids: Sequence[int]) -> str:
        """open_clip ``decode`` of one row, skipping ``<start_of_text>`` and stopping at
        ``<end_of_text>`` (pad id 0 is also the real token "!", so padding is cut, not filtered)."""
        decoder = {v: k for k, v in self._encoder.items()}
        byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        pieces = []
        for i in map(int, ids):
            if i == self.eos_id:
                break
            if i != self.sot_id:
                pieces.append(decoder[i])
        text = bytearray(byte_decoder[c] for c in "".join(pieces)).decode("utf-8", errors="replace")
        return text.replace("</w>", " ")


# --------------------------------------------------------------------------------------------
# Factory.
# --------------------------------------------------------------------------------------------
TOKENIZER_KINDS: dict[str, type] = {
    "sentencepiece": SentencePieceTokenizer,
    "hf": HFJsonTokenizer,
    "clip_bpe": ClipBpeTokenizer,
}


def build_tokenizer(kind: str, path: Union[str, os.PathLike], context_length: int,
                    **kw: Any) -> Tokenizer:
    """Builds a tokenizer from config.

    Args:
      kind: ``"sentencepiece"`` | ``"hf"`` | ``"clip_bpe"``.
      path: the local vocabulary/model file (see each class).
      context_length: output width L.
      **kw: per-kind options (``clean``, ``pad_id``, ``eos_id``, ...; see each class).

    Returns: a :class:`Tokenizer`; ``tok(texts)`` gives int32 [N, context_length].
    """
    try:
        cls = TOKENIZER_KINDS[kind]
    except KeyError:
        raise ValueError(f"Unknown tokenizer kind {kind!r}; "
                         f"expected one of {sorted(TOKENIZER_KINDS)}.") from None
    return cls(path, context_length=context_length, **kw)
