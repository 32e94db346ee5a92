"""Tests for input_pipeline/tokenizers.py: cleaning, golden ids, padding/truncation, offline errors.

Every vocabulary is built here at test time (no downloads):
* a SentencePiece *word* model whose ids follow word frequency, so expected ids are written by hand;
* a SentencePiece unigram model, converted to a T5-style tokenizer.json the way transformers'
  T5Converter does, to check the "sentencepiece" path against the HF fast-tokenizer mechanism;
* a WordLevel tokenizer.json;
* a small merges file in open_clip's bpe_simple_vocab_16e6.txt.gz format.
"""

from __future__ import annotations

import concurrent.futures
import gzip
import importlib.util
import multiprocessing
import pickle
import random
import socket

import numpy as np
import pytest

from input_pipeline import tokenizers as T
from prolip_jax.runtime import paths

# ---------------------------------------------------------------------------------------------
# Cleaning (reference: open_clip 2.24 / prolip tokenizer.py `canonicalize`, `lower`, `whitespace`).
# ---------------------------------------------------------------------------------------------
CANONICALIZE_CASES = [
    # HTML entities: ftfy unescapes once, then html.unescape twice -> "&" -> punctuation removed.
    ("Tom &amp;amp;amp; Jerry", "tom jerry"),
    ("&lt;b&gt;Bold&lt;/b&gt; cat", "bboldb cat"),
    # Underscores become spaces (before punctuation removal, which would delete them).
    ("a_red__circle", "a red circle"),
    # ASCII punctuation removed, lowercased.
    ("Hello, World! It's 5 o'clock: (yes).", "hello world its 5 oclock yes"),
    # Mojibake fixed by ftfy (UTF-8 read as cp1252), curly quote uncurled, then removed.
    ("The Mona Lisa doesn\u00e2\u20ac\u2122t have eyebrows.", "the mona lisa doesnt have eyebrows"),
    ("caf\u00c3\u00a9", "caf\u00e9"),
    # Whitespace (tab, newlines, NBSP, ideographic space) collapsed and stripped.
    ("  a\tphoto\n\nof \u00a0 a\u3000cat  ", "a photo of a cat"),
    # Non-ASCII punctuation is not in string.punctuation: kept, as in the reference.
    ("A cat \u2014 really?", "a cat \u2014 really"),
    ("", ""),
    ("!!! ... ???", ""),
    # ftfy leaves entities alone when the text has a literal "<"; the two html.unescape calls
    # then undo exactly two levels of escaping (a third level survives as "amp").
    ("x < y &amp;amp; z", "x y z"),
    ("1 < 2 &amp;amp;amp; 3", "1 2 amp 3"),
]


@pytest.mark.parametrize("raw,expected", CANONICALIZE_CASES)
def test_canonicalize_cleaning(raw, expected):
    assert T.get_clean_fn("canonicalize")(raw) == expected


def test_basic_clean_ascii_fast_path_matches_ftfy():
    """basic_clean skips ftfy for printable ASCII without '&': the result must be what the full
    path (ftfy.fix_text, html.unescape twice, strip) gives, on captions made of every printable
    ASCII character, and the full path must still run for text just outside the fast path."""
    import html

    import ftfy

    def full(text):
        return html.unescape(html.unescape(ftfy.fix_text(text))).strip()

    rng = random.Random(0)
    printable = [chr(c) for c in range(0x20, 0x7F) if chr(c) != "&"]
    texts = ["".join(rng.choice(printable) for _ in range(rng.randint(0, 40))) for _ in range(3000)]
    texts += ["  A photo of a cat.  ", "it's 5 o'clock", "x < y > z", "a;lt;b", "#38; nbsp; #x26;"]
    for text in texts:
        assert T.basic_clean(text) == full(text), repr(text)
    # Outside the fast path (entity, control character, CR, non-ASCII): ftfy's result.
    for text in ["Tom &amp; Jerry", "a\x07b", "a\r\nb", "doesn\u00e2\u20ac\u2122t", "caf\u00c3\u00a9"]:
        assert T.basic_clean(text) == full(text) != text.strip(), repr(text)


def test_other_clean_modes():
    raw = "  Hello,\t World!  &amp;amp; "
    assert T.get_clean_fn("whitespace")(raw) == "Hello, World! &"
    assert T.get_clean_fn("lower")(raw) == "hello, world! &"
    assert T.get_clean_fn("none")(raw) == raw
    assert T.get_clean_fn(None)(raw) == raw
    with pytest.raises(ValueError, match="Unknown clean mode"):
        T.get_clean_fn("nfkc")


# ---------------------------------------------------------------------------------------------
# SentencePiece, word model: hand-written golden ids.
# ---------------------------------------------------------------------------------------------
# Word i gets id 3 + i: the word trainer orders pieces by frequency and word i occurs 300 - 9 i
# times. Ids 0/1/2 are <pad>, </s>, <unk> as in the T5 c4-en model.
WORDS = ["a", "photo", "of", "cat", "tom", "jerry", "red", "circle", "hello", "world", "its",
         "5", "oclock", "yes", "caf\u00e9", "the", "mona", "lisa", "doesnt", "have", "eyebrows"]
ID = {w: 3 + i for i, w in enumerate(WORDS)}
PAD0, EOS, UNK = 0, 1, 2


def _train_spm(tmp_path, name, lines, **kw):
    import sentencepiece as spm

    corpus = tmp_path / f"{name}.txt"
    corpus.write_text("\n".join(lines), encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / name), pad_id=0, eos_id=1, unk_id=2,
        bos_id=-1, character_coverage=1.0, minloglevel=2, num_threads=1, **kw)
    return tmp_path / f"{name}.model"


@pytest.fixture(scope="module")
def word_model(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spm_word")
    tokens = [w for i, w in enumerate(WORDS) for _ in range(300 - 9 * i)]
    random.Random(0).shuffle(tokens)
    lines = [" ".join(tokens[i:i + 7]) for i in range(0, len(tokens), 7)]
    path = _train_spm(tmp, "word", lines, model_type="word", vocab_size=len(WORDS) + 3)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(path))
    # Guard the premise of the golden ids below.
    assert [sp.id_to_piece(i) for i in range(3)] == ["<pad>", "</s>", "<unk>"]
    assert all(sp.piece_to_id("\u2581" + w) == ID[w] for w in WORDS)
    return path


def test_sentencepiece_attributes(word_model):
    tok = T.build_tokenizer("sentencepiece", word_model, context_length=8)
    assert (tok.context_length, tok.vocab_size, tok.pad_id, tok.eos_id) == (8, len(WORDS) + 3, 1, 1)
    assert tok.clean == "canonicalize"


@pytest.mark.parametrize("raw,cleaned", CANONICALIZE_CASES[:7])
def test_sentencepiece_golden_ids_after_cleaning(word_model, raw, cleaned):
    tok = T.build_tokenizer("sentencepiece", word_model, context_length=12)
    row = [ID.get(w, UNK) for w in cleaned.split()] + [EOS]  # "bboldb" is not a word: <unk>
    expected = row + [EOS] * (12 - len(row))  # pad = EOS = 1
    np.testing.assert_array_equal(tok([raw])[0], expected)


def test_sentencepiece_padding_and_truncation(word_model):
    a, photo, of, cat = ID["a"], ID["photo"], ID["of"], ID["cat"]
    text = "A photo of a cat."  # 5 pieces
    build = lambda L, **kw: T.build_tokenizer("sentencepiece", word_model, context_length=L, **kw)
    np.testing.assert_array_equal(build(8)([text]), [[a, photo, of, a, cat, EOS, EOS, EOS]])
    np.testing.assert_array_equal(build(6)([text]), [[a, photo, of, a, cat, EOS]])  # exact fit
    # Too long: keep L-1 pieces, EOS stays last (HF truncates before the post-processor adds </s>).
    np.testing.assert_array_equal(build(5)([text]), [[a, photo, of, a, EOS]])
    np.testing.assert_array_equal(build(4)([text]), [[a, photo, of, EOS]])
    np.testing.assert_array_equal(build(1)([text]), [[EOS]])
    # Empty caption, unknown word, explicit pad id, and no EOS.
    np.testing.assert_array_equal(build(4)([""]), [[EOS, EOS, EOS, EOS]])
    np.testing.assert_array_equal(build(5)(["a zebra cat"]), [[a, UNK, cat, EOS, EOS]])
    np.testing.assert_array_equal(build(6, pad_id=0)(["a cat"]), [[a, cat, EOS, PAD0, PAD0, PAD0]])
    np.testing.assert_array_equal(build(3, add_eos=False, pad_id=0)(["a cat", text]),
                                  [[a, cat, PAD0], [a, photo, of]])


def test_output_type_and_batch_shapes(word_model):
    tok = T.build_tokenizer("sentencepiece", word_model, context_length=7)
    out = tok(["a cat", "the mona lisa", ""])
    assert out.dtype == np.int32 and out.shape == (3, 7)
    assert tok([]).shape == (0, 7) and tok([]).dtype == np.int32
    np.testing.assert_array_equal(tok("a cat"), tok(["a cat"]))  # bare string = batch of one
    assert tok.decode(out[1]) == "the mona lisa"


# ---------------------------------------------------------------------------------------------
# SentencePiece path == HF fast-tokenizer mechanism (the reference's T5TokenizerFast).
# ---------------------------------------------------------------------------------------------
def _t5_style_tokenizer_json(model_path, out_path):
    """tokenizer.json built as transformers' SpmConverter/T5Converter does (extra_ids=0)."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Regex, Tokenizer, models, normalizers, pre_tokenizers, processors

    proto = pb.ModelProto()
    proto.ParseFromString(model_path.read_bytes())
    tok = Tokenizer(models.Unigram([(p.piece, p.score) for p in proto.pieces],
                                   proto.trainer_spec.unk_id, byte_fallback=False))
    tok.normalizer = normalizers.Sequence([
        normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap),
        normalizers.Replace(Regex(" {2,}"), " ")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    tok.add_special_tokens([AddedToken(p.piece, normalized=False, special=True)
                            for p in proto.pieces if p.type == 3])
    tok.save(str(out_path))
    return out_path


def test_sentencepiece_matches_t5_fast_tokenizer(tmp_path):
    pytest.importorskip("google.protobuf")
    rng = random.Random(1)
    words = ("a photo of the cat dog red blue small large circle square in on at top left corner "
             "background green with and an image two three people street car house tree sky").split()
    endings = ["", ".", " caf\u00e9", " 2024"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + rng.choice(endings)
             for _ in range(2000)]
    model = _train_spm(tmp_path, "uni", lines, model_type="unigram", vocab_size=60,
                       hard_vocab_limit=False)
    spm_tok = T.build_tokenizer("sentencepiece", model, context_length=12)
    hf_tok = T.build_tokenizer("hf", _t5_style_tokenizer_json(model, tmp_path / "t5.json"),
                               context_length=12, clean="canonicalize", pad_id=1)
    assert hf_tok.eos_id == 1
    alphabet = list("abcdefghijklmnopqrstuvwxyz ABXZ0123456789.,!\u00e9\u00ef\u4e2d_-&")
    def random_word():
        if rng.random() < 0.7:
            return rng.choice(words)
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))

    texts = [" ".join(random_word() for _ in range(rng.randint(0, 20))) for _ in range(500)]
    a, b = spm_tok(texts), hf_tok(texts)
    assert (a[:, -1] == 1).all()
    assert (a[:, -2] != 1).any() and (a[:, -2] == 1).any()  # both truncated and padded rows
    np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# HF tokenizer.json.
# ---------------------------------------------------------------------------------------------
HF_VOCAB = {"<pad>": 0, "</s>": 1, "<unk>": 2, "a": 3, "photo": 4, "of": 5, "cat": 6}


def _wordlevel_json(path, eos=True, padding=False):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tok = Tokenizer(models.WordLevel(HF_VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if eos:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>",
                                                           special_tokens=[("</s>", 1)])
    if padding:
        tok.enable_padding(pad_id=0, pad_token="<pad>")
    tok.save(str(path))
    return path


def test_hf_tokenizer_json(tmp_path):
    path = _wordlevel_json(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match="pass pad_id"):
        T.build_tokenizer("hf", path, context_length=4)
    tok = T.build_tokenizer("hf", path, context_length=8, pad_id=1)
    assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.clean) == (7, 1, 1, "whitespace")
    np.testing.assert_array_equal(tok(["a photo of a  cat\n", "A cat", ""]),
                                  [[3, 4, 5, 3, 6, 1, 1, 1],   # pad = eos = 1
                                   [2, 6, 1, 1, 1, 1, 1, 1],   # "A" is unknown: no lowercasing
                                   [1, 1, 1, 1, 1, 1, 1, 1]])
    # Truncation keeps the post-processor's </s> last; exact fit is not truncated.
    short = T.build_tokenizer("hf", tmp_path, context_length=4, pad_id="</s>")  # a directory works
    np.testing.assert_array_equal(short(["a photo of a cat", "a photo of"]),
                                  [[3, 4, 5, 1], [3, 4, 5, 1]])
    lower = T.build_tokenizer("hf", path, context_length=4, pad_id=1, clean="lower")
    np.testing.assert_array_equal(lower(["A Cat!"]), [[3, 2, 1, 1]])  # "cat!" is unknown


def test_hf_pad_from_file_and_no_eos(tmp_path):
    padded_json = _wordlevel_json(tmp_path / "p.json", padding=True)
    padded = T.build_tokenizer("hf", padded_json, context_length=5)
    assert padded.pad_id == 0
    np.testing.assert_array_equal(padded(["a cat"]), [[3, 6, 1, 0, 0]])
    no_eos = T.build_tokenizer("hf", _wordlevel_json(tmp_path / "n.json", eos=False), 4, pad_id=0)
    assert no_eos.eos_id is None
    np.testing.assert_array_equal(no_eos(["a photo of a cat", "cat"]), [[3, 4, 5, 3], [6, 0, 0, 0]])


# ---------------------------------------------------------------------------------------------
# CLIP BPE, open_clip format. Ids follow open_clip SimpleTokenizer's vocab construction:
# byte chars in bytes_to_unicode order (printable ASCII c -> ord(c) - 33), then the same + "</w>"
# (+256), then one id per merge from 512, then <start_of_text>, <end_of_text>.
# ---------------------------------------------------------------------------------------------
CLIP_MERGES = ["c a", "ca t</w>", "d o", "do g</w>", "' s</w>"]
CA, CAT_W, DO, DOG_W, APOS_S_W = 512, 513, 514, 515, 516
SOT, EOT = 517, 518


def _c(ch: str) -> int:  # printable ASCII byte symbol
    return ord(ch) - 33


def _cw(ch: str) -> int:  # the same with the end-of-word suffix
    return 256 + ord(ch) - 33


@pytest.fixture(scope="module", params=["gz", "txt"])
def clip_vocab(request, tmp_path_factory):
    text = "\n".join(['"bpe_simple_vocab_16e6.txt#version: 0.2'] + CLIP_MERGES) + "\n"
    path = tmp_path_factory.mktemp("clip") / f"vocab.{request.param}"
    path.write_bytes(gzip.compress(text.encode()) if request.param == "gz" else text.encode())
    return path


def test_clip_bpe_golden_ids(clip_vocab):
    tok = T.build_tokenizer("clip_bpe", clip_vocab, context_length=8)
    assert (tok.vocab_size, tok.pad_id, tok.eos_id, tok.sot_id) == (519, 0, EOT, SOT)
    assert _cw("a") == 320  # the real CLIP id of "a</w>", same construction
    rows = tok(["A cat", "Dog's", "cats", "2 cats!", "\u00e9", "", "a <end_of_text> cat"])
    np.testing.assert_array_equal(rows, [
        [SOT, _cw("a"), CAT_W, EOT, 0, 0, 0, 0],
        [SOT, DOG_W, APOS_S_W, EOT, 0, 0, 0, 0],               # "'s" is its own regex match
        [SOT, CA, _c("t"), _cw("s"), EOT, 0, 0, 0],            # no ("ca", "t") merge without </w>
        [SOT, _cw("2"), CA, _c("t"), _cw("s"), _cw("!"), EOT, 0],
        [SOT, 127, 256 + 102, EOT, 0, 0, 0, 0],                # UTF-8 c3 a9 -> byte symbols 127, 102
        [SOT, EOT, 0, 0, 0, 0, 0, 0],
        [SOT, _cw("a"), EOT, CAT_W, EOT, 0, 0, 0],             # literal special string, as open_clip
    ])
    assert tok.decode(rows[1]) == "dog 's "


def test_clip_bpe_truncation_and_cleaning(clip_vocab):
    build = lambda L, **kw: T.build_tokenizer("clip_bpe", clip_vocab, context_length=L, **kw)
    np.testing.assert_array_equal(build(5)(["a cat dog"]), [[SOT, _cw("a"), CAT_W, DOG_W, EOT]])  # fits
    np.testing.assert_array_equal(build(4)(["a cat dog"]), [[SOT, _cw("a"), CAT_W, EOT]])  # eot kept
    np.testing.assert_array_equal(build(2)(["a cat dog"]), [[SOT, EOT]])
    # clean="whitespace" keeps case: "CAT" matches no (lowercase) merge.
    np.testing.assert_array_equal(build(6, clean="whitespace")(["CAT"]),
                                  [[SOT, _c("C"), _c("A"), _cw("T"), EOT, 0]])
    # open_clip's split is IGNORECASE: "'S" is one word ("'" gets no </w>), but no merge matches.
    np.testing.assert_array_equal(build(7, clean="whitespace")(["IT'S"]),
                                  [[SOT, _c("I"), _cw("T"), _c("'"), _cw("S"), EOT, 0]])
    # canonicalize: "Dog's_cat" -> "dogs cat"; ("do", "g") is no merge, only ("do", "g</w>").
    dogs_cat = [SOT, DO, _c("g"), _cw("s"), CAT_W, EOT]
    np.testing.assert_array_equal(build(8, clean="canonicalize")(["Dog's_cat"]), [dogs_cat + [0, 0]])
    np.testing.assert_array_equal(build(6, clean="canonicalize")(["Dog's_cat"]), [dogs_cat])
    np.testing.assert_array_equal(build(5, clean="canonicalize")(["Dog's_cat"]), [dogs_cat[:4] + [EOT]])


def test_clip_bpe_bad_merges_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("#version\na b\nc d e\n")
    with pytest.raises(ValueError, match="line 3"):
        T.build_tokenizer("clip_bpe", path, context_length=8)


# ---------------------------------------------------------------------------------------------
# Offline: missing files, URLs, invalid files, no network.
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,hints", [
    ("sentencepiece", ["SentencePiece '.model'", "timm/ViT-B-16-SigLIP", "cc_en.32000"]),
    ("hf", ["tokenizer.json", "timm/ViT-B-16-SigLIP", "pad_id=1"]),
    ("clip_bpe", ["bpe_simple_vocab_16e6.txt.gz", "open_clip"]),
])
def test_missing_file_errors(tmp_path, monkeypatch, kind, hints):
    def no_network(*args, **kwargs):
        raise AssertionError("a tokenizer tried to open a socket")

    monkeypatch.setattr(socket, "socket", no_network)
    missing = tmp_path / "nowhere" / "vocab.bin"
    with pytest.raises(T.TokenizerFileNotFoundError) as err:
        T.build_tokenizer(kind, missing, context_length=8)
    msg = str(err.value)
    assert str(missing) in msg and "never downloads" in msg
    for hint in hints:
        assert hint in msg
    assert isinstance(err.value, FileNotFoundError)
    # A bucket path is read through the path layer (tests/test_bucket_paths.py); without its
    # backend installed the error is one line naming the package.
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(paths.BucketBackendMissing, match="pip install gcsfs"):
            T.build_tokenizer(kind, "gs://bucket/vocab.model", context_length=8)


def test_invalid_files_and_kinds(tmp_path, word_model):
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a valid SentencePiece model"):
        T.build_tokenizer("sentencepiece", junk, context_length=8)
    with pytest.raises(ValueError, match="not a valid tokenizer.json"):
        T.build_tokenizer("hf", junk, context_length=8, pad_id=0)
    with pytest.raises(ValueError, match="Unknown tokenizer kind"):
        T.build_tokenizer("wordpiece", word_model, context_length=8)
    with pytest.raises(ValueError, match="context_length"):
        T.build_tokenizer("sentencepiece", word_model, context_length=0)


# ---------------------------------------------------------------------------------------------
# Pickling for grain worker processes.
# ---------------------------------------------------------------------------------------------
def test_pickle_is_self_contained(tmp_path, word_model, clip_vocab):
    import shutil

    files = {"sp": tmp_path / "sp.model", "hf": tmp_path / "hf.json", "clip": tmp_path / "clip.gz"}
    shutil.copy(word_model, files["sp"])
    _wordlevel_json(files["hf"])
    shutil.copy(clip_vocab, files["clip"])
    toks = [T.build_tokenizer("sentencepiece", files["sp"], 6),
            T.build_tokenizer("hf", files["hf"], 6, pad_id=1),
            T.build_tokenizer("clip_bpe", files["clip"], 6)]
    texts = ["a photo of a cat", "Dog's cat", ""]
    expected = [t(texts) for t in toks]
    blobs = [pickle.dumps(t) for t in toks]
    for f in files.values():
        f.unlink()  # the unpickled copies must not need the files
    for blob, want in zip(blobs, expected):
        copy = pickle.loads(blob)
        assert copy._backend is None  # the library object is rebuilt lazily, not shipped
        np.testing.assert_array_equal(copy(texts), want)
        assert copy._backend is not None


def test_tokenizer_in_spawned_worker(word_model):
    tok = T.build_tokenizer("sentencepiece", word_model, context_length=6)
    texts = ["A photo of a cat.", "hello_world"]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=ctx) as pool:
        out = pool.submit(tok, texts).result(timeout=60)
    np.testing.assert_array_equal(out, [[ID["a"], ID["photo"], ID["of"], ID["a"], ID["cat"], EOS],
                                        [ID["hello"], ID["world"], EOS, EOS, EOS, EOS]])
