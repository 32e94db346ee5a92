"""The tokenizer part of "bring your own data" (issue 15): a tokenizer recipe that keeps words
whole and reserves [MASK]; masking ids checked against the tokenizer before compiling; truncated
captions and prompts counted / warned about; the trained tokenizer (and normalisation) recorded
in the checkpoint and used by `prolip_jax.load`, scripts/evaluate.py and the PyTorch export;
exported files readable by others. Data (PNG + caption tar shards) is generated here.
"""
from __future__ import annotations

import io
import json
import logging
import os
import random
import stat
import sys
import types
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from input_pipeline import synthetic
from input_pipeline.tokenizers import build_tokenizer
from prolip_jax import export
from input_pipeline import tokenizer_files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import train_tokenizer  # noqa: E402  (scripts/train_tokenizer.py)

DIGITS = "zero one two three four five six seven eight nine".split()
SEVEN = "a scan of a handwritten number seven"


def digit_captions(n=300, seed=0):
    rng = random.Random(seed)
    return [f"a {rng.choice(['scan', 'photo', 'picture'])} of a {rng.choice(['handwritten', 'printed', 'faded'])} "
            f"{rng.choice(['number', 'digit'])} {rng.choice(DIGITS)}" for _ in range(n)]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Two webdataset shards of <key>.png + <key>.txt (the layout of the user story)."""
    tmp = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    captions = digit_captions(64)
    for s in range(2):
        members = []
        for i in range(32):
            png = synthetic.encode_image(rng.integers(0, 255, (20, 20, 3), np.uint8), "PNG")
            members += synthetic.record_members(f"{s:04d}{i:04d}", {"png": png, "txt": captions[s * 32 + i].encode()})
        synthetic.write_tar(str(tmp / f"train-{s:04d}.tar"), members)
    return str(tmp / "train-{0000..0001}.tar"), captions


@pytest.fixture(scope="module")
def tok_path(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer.model"
    train_tokenizer.train_tokenizer([shards[0]], out, context_length=8)
    return out


# ------------------------------------------------------------------------ the recipe
def test_train_tokenizer_keeps_words_whole_and_reserves_mask(shards, tmp_path):
    path, captions = shards
    (tmp_path / "caps.txt").write_text("\n".join(digit_captions()))
    out = io.StringIO()
    with redirect_stdout(out):
        assert train_tokenizer.main(["--input", path, str(tmp_path / "caps.txt"), "--output",
                                     str(tmp_path / "tok" / "tokenizer.model"), "--context_length", "6"]) == 0
    tok = build_tokenizer("sentencepiece", tmp_path / "tok" / "tokenizer.model", context_length=16)
    sp = tok.backend
    assert sp.encode(SEVEN, out_type=str) == ["\u2581" + w for w in SEVEN.split()]  # 7 pieces, words whole
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "</s>", "<unk>", "[MASK]"]
    assert tok.token_kind(3) == "special" and tok.special_ids() == {0: "<pad>", 3: "[MASK]"}
    assert (tok.pad_id, tok.eos_id) == (1, 1)
    text = out.getvalue()
    assert "--config.masking.mask_token_id=3 --config.masking.protected_ids='(1,)'" in text
    assert f"--config.data.tokenizer.path={tmp_path / 'tok' / 'tokenizer.model'}" in text
    assert "100.0% of them" in text and "unk 2, [MASK] 3" in text
    # context 6 < the 8 tokens of "a ... number seven" + EOS: every caption is cut, and it says so.
    assert "longest caption: 8 tokens" in text and "(100.0%) would be cut" in text and "warning: raise" in text
    # The old recipe (benchmarks/benchmark_input.py: unigram) on the same corpus: near character level.
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(digit_captions()), model_writer=model, vocab_size=64,
                                   hard_vocab_limit=False, model_type="unigram", pad_id=-1, eos_id=1, unk_id=2,
                                   bos_id=-1, minloglevel=2)
    assert len(spm.SentencePieceProcessor(model_proto=model.getvalue()).encode(SEVEN)) > 15


# ------------------------------------------------------------------------ masking ids
def test_masking_ids_must_be_reserved_tokens(tok_path, caplog):
    from prolip_jax.trainer.data import check_masking
    from prolip_jax.core.step import MaskingConfig

    tok = build_tokenizer("sentencepiece", tok_path, context_length=8)
    check_masking(tok, MaskingConfig(mask_token_id=3, protected_ids=(1,)), 512)
    check_masking(tok, MaskingConfig(mask_token_id=400, protected_ids=(1,)), 512)  # past the vocab: never produced
    with pytest.raises(ValueError, match=r"mask_token_id=2 is '<unk>' \(the unknown-word id\).*"
                                         r"--config.masking.mask_token_id=3 \('\[MASK\]'\)"):
        check_masking(tok, MaskingConfig(mask_token_id=2, protected_ids=(1,)), 512)
    seven = tok.backend.piece_to_id("\u2581seven")
    with pytest.raises(ValueError, match=rf"mask_token_id={seven} is '\u2581seven' \(an ordinary piece"):
        check_masking(tok, MaskingConfig(mask_token_id=seven, protected_ids=(1,)), 512)
    with pytest.raises(ValueError, match="pad/EOS id"):
        check_masking(tok, MaskingConfig(mask_token_id=1, protected_ids=(1,)), 512)
    with pytest.raises(ValueError, match=r"lacks the pad id 1 .*protected_ids='\(0, 1\)'"):
        check_masking(tok, MaskingConfig(mask_token_id=3, protected_ids=(0,)), 512)
    with pytest.raises(ValueError, match="a word there would never be masked"):
        check_masking(tok, MaskingConfig(mask_token_id=3, protected_ids=(1, seven)), 512)


def test_unk_mask_id_is_refused_before_compiling(shards, tok_path, tmp_path):
    """The trap: configs/tiny.py's mask id 2 is <unk> in a user's tokenizer; it used to train."""
    from prolip_jax import train

    cfg = _config(tmp_path, shards[0], tok_path)
    cfg.masking.mask_token_id = 2
    with pytest.raises(ValueError, match=r"mask_token_id=2 is '<unk>'.*Use --config.masking.mask_token_id=3"):
        train.train(cfg, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------ truncation
def test_truncated_captions_are_counted_and_warned(shards, tok_path, caplog):
    from input_pipeline.pipeline import build_train_iterator

    data = dict(source="tar", path=shards[0], image_size=16, batch_size=16, num_workers=0, shuffle_buffer_size=8)
    for context, expect_cut in ((4, True), (8, False)):
        tok = build_tokenizer("sentencepiece", tok_path, context_length=context)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="input_pipeline.pipeline"):
            it = build_train_iterator(data, tok, process_index=0, process_count=1)
            next(it), next(it)
        stats = it.stats
        assert stats["examples"] == 32
        if expect_cut:  # every caption has >= 7 pieces + EOS
            assert stats["truncated"] == 32 and stats["truncated_share"] == 1.0
            warnings = [r.message for r in caplog.records if "max_truncated_share" in r.message]
            assert len(warnings) == 1 and "of 4 tokens" in warnings[0]  # once, not per batch
            assert it.get_state()["truncated"] == 32
        else:
            assert stats["truncated"] == 0 and not caplog.records
        it.close()


def test_truncated_prompts_are_warned(tok_path, caplog):
    from evaluators import common

    tok = build_tokenizer("sentencepiece", tok_path, context_length=4)
    with caplog.at_level(logging.WARNING):
        ids = common.tokenize_checked(tok, ["a seven", "a scan of a handwritten number seven"], "zero-shot digits prompts")
    assert ids.shape == (2, 4)
    assert "zero-shot digits prompts: 1 of 2 texts are longer than the tokenizer's context length (4" in caplog.text


# ------------------------------------------------------------------------ a trained checkpoint
def _config(tmp_path, path, tok_path):
    """configs/tiny.py with the micro model (its vocabulary raised to fit the tokenizer) on the shards."""
    from prolip_jax.core.models import get_config
    from test_train import tiny_config

    model = get_config("micro").to_dict()
    model["text_cfg"]["vocab_size"] = 512
    (tmp_path / "model.json").write_text(json.dumps(model))
    cfg = tiny_config(tmp_path, **{"model.config_json": str(tmp_path / "model.json"), "total_steps": 2})
    cfg.data.source, cfg.data.path = "tar", path
    cfg.data.tokenizer = dict(kind="sentencepiece", path=str(tok_path), context_length=8)
    cfg.data.shuffle_buffer_size = 8
    cfg.data.normalization = "0.5"  # not the default: load() must use the recorded one
    cfg.masking.mask_token_id, cfg.masking.protected_ids = 3, (1,)
    return cfg


@pytest.fixture(scope="module")
def trained(shards, tok_path, tmp_path_factory):
    """A trainer checkpoint of the run `_config` describes: the trainer's data object
    (prolip_jax.trainer.data.build_train_data) and its save (checkpoint.save_train_state), with random
    parameters in place of trained ones. A real run compiles the train step (~60 s of CPU cold);
    what this tests happens outside the step."""
    import jax
    import orbax.checkpoint as ocp

    from prolip_jax.core import checkpoint
    from prolip_jax.trainer import build as trainer_build, config as trainer_config
    from prolip_jax.trainer.data import build_train_data
    from prolip_jax.core.models import abstract_params

    tmp = tmp_path_factory.mktemp("run")
    cfg = trainer_config.with_defaults(_config(tmp, shards[0], tok_path))
    tc = trainer_config.parse_config(cfg)
    mcfg = trainer_build.model_config(tc)
    data = build_train_data(tc, mcfg, trainer_build.step_config(tc))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda a: (0.1 * rng.standard_normal(a.shape)).astype(a.dtype), abstract_params(mcfg))
    state = types.SimpleNamespace(params=params, opt_state={"count": np.zeros((), np.int32)},
                                  step=np.asarray(2, np.int32), skipped=np.asarray(0, np.int32))
    with ocp.CheckpointManager((tmp / "workdir" / "checkpoints").absolute(), item_names=checkpoint.TRAIN_ITEMS,
                               options=ocp.CheckpointManagerOptions(create=True)) as mngr:
        checkpoint.save_train_state(mngr, 2, state, mcfg, trainer_config.record(tc), data.batches,
                                    tokenizer=data.tokenizer_file)
        mngr.wait_until_finished()
    data.batches.close()
    return tmp / "workdir", shards[1]


def test_checkpoint_records_the_tokenizer_and_load_uses_it(trained, tok_path):
    import hashlib

    import prolip_jax
    from prolip_jax.core import checkpoint

    workdir, captions = trained
    sha = hashlib.sha256(tok_path.read_bytes()).hexdigest()
    meta = checkpoint.load_config(workdir / "checkpoints")[1]
    assert meta["tokenizer"]["sha256"] == sha and meta["tokenizer"]["mask_token_id"] == 3
    assert (workdir / "checkpoints" / meta["tokenizer"]["file"]).read_bytes() == tok_path.read_bytes()
    tok_path_copy = Path(str(tok_path) + ".orig")
    tok_path.rename(tok_path_copy)  # the original may move away: the checkpoint has its copy
    try:
        model = prolip_jax.load(workdir)
        expected = build_tokenizer("sentencepiece", tok_path_copy, context_length=8)(captions)
        np.testing.assert_array_equal(model.tokenize(captions), expected)
        assert model.tokenizer.mask_id == 3 and model.normalization == "0.5"
    finally:
        tok_path_copy.rename(tok_path)
    images = [Image.new("RGB", (40, 20), (255, 0, 0)), Image.new("L", (20, 30), 0)]
    x = model.preprocess(images)
    assert x.shape == (2, 16, 16, 3) and x.dtype == np.float32
    np.testing.assert_allclose(x[0, 0, 0], [1.0, -1.0, -1.0], atol=1e-6)  # (1 - 0.5) / 0.5, (0 - 0.5) / 0.5
    np.testing.assert_allclose(x[1], -1.0, atol=1e-6)
    mu, logvar = model.encode_image(x)
    assert mu.shape == (2, 32) and np.isfinite(logvar).all()
    # A changed file is refused: its ids would not be the ones the model learned.
    stored = workdir / "checkpoints" / meta["tokenizer"]["file"]
    original = stored.read_bytes()
    try:
        stored.write_bytes(original + b"x")
        with pytest.raises(ValueError, match="has changed since training"):
            tokenizer_files.from_checkpoint(workdir / "checkpoints")
    finally:
        stored.write_bytes(original)


def test_best_checkpoint_records_the_tokenizer(trained, tmp_path):
    from prolip_jax.core import checkpoint

    params, config, _ = checkpoint.load_params(trained[0] / "checkpoints")
    tf = tokenizer_files.file_from_checkpoint(trained[0] / "checkpoints")
    best = checkpoint.BestKeeper(tmp_path / "best", checkpoint.KeepBestConfig(metric="m", mode="max", baseline=0.0), config,
                                  tokenizer=tf)
    assert best.offer(3, 0.5, params)
    best.close()
    tok = tokenizer_files.from_checkpoint(tmp_path / "best")
    assert tok.vocab_size == tf.build_in_memory().vocab_size and tok.mask_id == 3


class _Probe:
    """An evaluator that reports the tokenizer scripts/evaluate.py hands it."""

    def __init__(self, config, model, tokenizer=None):
        self.tokenizer = tokenizer

    def run(self, params, progress=None):
        yield "probe/vocab_size", self.tokenizer.vocab_size
        yield "probe/mask_id", self.tokenizer.mask_id


def test_evaluate_uses_the_recorded_tokenizer(trained, tok_path, tmp_path, monkeypatch):
    import ml_collections as mlc

    import evaluate  # scripts/evaluate.py
    import evaluators

    monkeypatch.setitem(evaluators.REGISTRY, "probe", _Probe)
    config = mlc.ConfigDict({"evals": {"p": {"type": "probe"}}})
    results = evaluate.evaluate(str(trained[0]), config, tmp_path / "eval", plots=False)
    vocab = build_tokenizer("sentencepiece", tok_path, context_length=8).vocab_size
    assert results["probe/vocab_size"] == vocab and results["probe/mask_id"] == 3


def test_export_carries_the_tokenizer_and_normalisation(trained, tok_path, tmp_path):
    import convert_to_pytorch  # scripts/convert_to_pytorch.py

    import prolip_jax

    workdir, captions = trained
    old = os.umask(0o022)
    try:
        out = io.StringIO()
        with redirect_stdout(out):
            assert convert_to_pytorch.main(["--checkpoint", str(workdir / "checkpoints"), "--out", str(tmp_path / "hf")]) == 0
    finally:
        os.umask(old)
    hf = tmp_path / "hf"
    assert f"HFTokenizer({str(hf)!r}, context_length=8, clean='canonicalize')" in out.getvalue()
    assert (hf / "tokenizer.model").read_bytes() == tok_path.read_bytes()
    text_cfg = json.loads((hf / "config.json").read_text())["text_cfg"]
    assert text_cfg["hf_tokenizer_name"] == "." and text_cfg["tokenizer_kwargs"] == {"clean": "canonicalize"}
    # Everything readable by group and others (safetensors and mkdtemp made 0600 / 0700).
    for f in [hf, *hf.iterdir()]:
        assert stat.S_IMODE(f.stat().st_mode) == (0o755 if f.is_dir() else 0o644), f.name
    # The fast tokenizer.json (what AutoTokenizer / HFTokenizer load) gives the training's ids.
    expected = build_tokenizer("sentencepiece", tok_path, context_length=8)(captions + ["a xylophone of 7s"])
    fast = build_tokenizer("hf", hf / "tokenizer.json", context_length=8, clean="canonicalize")
    np.testing.assert_array_equal(fast(captions + ["a xylophone of 7s"]), expected)
    config = json.loads((hf / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["pad_token"], config["mask_token"], config["model_max_length"]) == (
        "</s>", "</s>", "[MASK]", 8)
    assert json.loads((hf / "preprocessor_config.json").read_text())["image_mean"] == [0.5, 0.5, 0.5]
    model = prolip_jax.load(hf)
    np.testing.assert_array_equal(model.tokenize(captions), expected[:-1])
    assert model.normalization == "0.5"


def test_export_without_tokenizer_has_normal_permissions(tmp_path, golden_params, golden_config):

    old = os.umask(0o022)
    try:
        hf = export.save_hf(tmp_path / "hf", golden_params, golden_config)
    finally:
        os.umask(old)
    assert stat.S_IMODE((hf / "model.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE(hf.stat().st_mode) == 0o755
