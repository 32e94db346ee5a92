"""Bring your own data: configs/own_data.py, configs/eval/imagefolder.py, `--config.x=y` on
scripts/evaluate.py, and the ImageFolder class-name traps (issue 15): class names in another
order than the folders, or naming other classes, are errors; no class names means the folder
names, never ImageNet's. Data (PNG + caption tar shards, an ImageFolder split, a SentencePiece
model) is generated here."""
from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from evaluators import retrieval_data
from evaluators import zeroshot as zs
from input_pipeline import eval_data, synthetic
from prolip_jax import train
from prolip_jax.trainer import build as trainer_build, config as trainer_config

ROOT = Path(__file__).resolve().parents[1]
OWN = str(ROOT / "configs" / "own_data.py")
EVAL = str(ROOT / "configs" / "eval" / "imagefolder.py")
sys.path.insert(0, str(ROOT / "scripts"))
import evaluate  # noqa: E402  (scripts/evaluate.py)

CLASSES = ("eight", "five", "seven_up")   # sorted folder names; "seven_up" -> "seven up"
WORDS = ("a", "photo", "of", "the", "digit", "eight", "five", "seven", "up", "picture", "handwritten")


def _png(rng, size=20):
    return synthetic.encode_image(rng.integers(0, 255, (size, size, 3), np.uint8), "PNG")


def _imagefolder(root, classes=CLASSES, per_class=2, split="val"):
    rng = np.random.default_rng(0)
    for c in classes:
        os.makedirs(root / split / c, exist_ok=True)
        for i in range(per_class):
            (root / split / c / f"{i}.png").write_bytes(_png(rng))
    return root


def _tar_shards(directory, num_shards=2, per_shard=16):
    """The training layout: <key>.png + <key>.txt."""
    rng = np.random.default_rng(1)
    os.makedirs(directory, exist_ok=True)
    paths = []
    for s in range(num_shards):
        members = []
        for i in range(per_shard):
            caption = f"a photo of the digit {CLASSES[(s + i) % 3].replace('_', ' ')}"
            members += synthetic.record_members(f"{s:04d}{i:04d}", {"png": _png(rng), "txt": caption.encode()})
        paths.append(synthetic.write_tar(str(directory / f"train-{s:04d}.tar"), members))
    return paths


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    """A word-level SentencePiece model in the layout own_data.py expects: <pad> 0, </s> 1,
    <unk> 2, [MASK] 3 (vocab 15 <= the micro model's 64)."""
    import sentencepiece as spm

    tmp = tmp_path_factory.mktemp("spm")
    rng = np.random.default_rng(0)
    (tmp / "corpus.txt").write_text("\n".join(" ".join(rng.choice(WORDS, 6)) for _ in range(300)))
    spm.SentencePieceTrainer.train(
        input=str(tmp / "corpus.txt"), model_prefix=str(tmp / "tok"), model_type="word", vocab_size=64,
        hard_vocab_limit=False, pad_id=0, eos_id=1, unk_id=2, bos_id=-1, user_defined_symbols=["[MASK]"],
        minloglevel=2, num_threads=1)
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "tok.model"))
    assert [sp.id_to_piece(i) for i in range(4)] == ["<pad>", "</s>", "<unk>", "[MASK]"]
    return str(tmp / "tok.model")


def _names(root, classnames="", class_index=""):
    return zs.imagefolder_classnames(eval_data.imagefolder(str(root), "val", class_index).info, classnames)


# ----------------------------------------------------------------------------- configs/own_data.py
def test_own_data_config_parses_with_overrides():
    config, fv = train.parse_command_line([
        "prolip_jax.train", "--config", OWN, "--workdir", "/unused",
        "--config.data.path=/data/mine/train-{0000..0009}.tar", "--config.data.tokenizer.path=/data/tok.model",
        "--config.data.source=array_record", "--config.masking.mask_token_id=5",
        "--config.masking.protected_ids=(0, 1)", "--config.data.num_workers=4"])
    assert config.data.path == "/data/mine/train-{0000..0009}.tar" and config.data.source == "array_record"
    assert config.data.tokenizer.path == "/data/tok.model" and config.data.tokenizer.context_length == 16
    assert config.masking.mask_token_id == 5 and tuple(config.masking.protected_ids) == (0, 1)
    # the small-scale loss weights, not the paper's (which leave sigma^2 at init in a short run)
    assert (config.loss.vib_beta, config.loss.alpha_image_text) == (1e-3, 1e-3)
    mcfg = trainer_build.model_config(trainer_config.parse_config(config))
    assert (mcfg.vision.image_size, mcfg.text.context_length) == (config.data.image_size, 16)
    # size=small: a model file of its own, image size and context to match
    config, _ = train.parse_command_line([
        "prolip_jax.train", "--config", OWN + ":size=small,steps=7", "--workdir", "/unused"])
    mcfg = trainer_build.model_config(trainer_config.parse_config(config))
    assert config.total_steps == 7 and mcfg.vision.image_size == config.data.image_size == 64
    assert mcfg.text.context_length == config.data.tokenizer.context_length == 32
    with pytest.raises(ValueError, match="unknown size 'huge'"):
        train.parse_command_line(["prolip_jax.train", "--config", OWN + ":size=huge", "--workdir", "/u"])


# ----------------------------------------------------------------------------- evaluate.py --config.x=y
def test_evaluate_accepts_overrides(tmp_path):
    c = evaluate.load_config(EVAL + ":evals=zeroshot+retrieval")
    c = evaluate.apply_overrides(c, [
        f"--config.root={tmp_path}", "--config.tokenizer.path=/tok.model", "--config.num_images=5",
        "--config.templates=('a photo of the number {}.', '{}')", "--config.shards=/val/{0..1}.tar"])
    zero, ret = c.evals.zeroshot.to_dict(), c.evals.retrieval.to_dict()
    # one override reaches every evaluator that reads the field
    assert zero["root"] == str(tmp_path) and zero["num_images"] == ret["num_images"] == 5
    assert zero["tokenizer"]["path"] == ret["tokenizer"]["path"] == "/tok.model"
    assert zero["templates"] == ("a photo of the number {}.", "{}") and ret["path"] == "/val/{0..1}.tar"
    c = evaluate.apply_overrides(evaluate.load_config(EVAL), ["--config.evals.zeroshot.split=test"])
    assert c.evals.zeroshot.split == "test"


@pytest.mark.parametrize("override, expected", [
    ("--config.rot=/data", r"--config\.rot: config has no field 'rot'; did you mean config\.root\?"),
    ("--config.evals.zeroshot.splt=val", r"config\.evals\.zeroshot has no field 'splt'; did you mean "
                                         r"config\.evals\.zeroshot\.split\?"),
    ("--config.num_images=many", r"--config\.num_images=many"),
])
def test_evaluate_refuses_a_bad_override_in_one_line(tmp_path, capsys, override, expected):
    import re

    code = evaluate.main(["--checkpoint", str(tmp_path / "none"), "--config", EVAL, "--out",
                          str(tmp_path / "out"), override])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert re.search(expected, err), err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- class names
def test_imagefolder_without_classnames_uses_the_folder_names(tmp_path, micro):
    """Before: the 1,000 ImageNet names, so zero-shot on any other folder scored ~0%."""
    model, _ = micro
    _imagefolder(tmp_path / "digits")
    c = evaluate.apply_overrides(evaluate.load_config(EVAL), [f"--config.root={tmp_path / 'digits'}"])
    tok = lambda texts: np.ones((len(texts), 8), np.int32)
    ev = zs.Evaluator(c.evals.zeroshot.to_dict(), model, tokenizer=tok)
    assert ev.classnames == ["eight", "five", "seven up"] and ev.name == "digits"
    assert ev.data.info["labels"].tolist() == [0, 0, 1, 1, 2, 2]
    assert ev.templates == list(evaluate.load_config(EVAL).templates)


def test_imagenet_names_only_for_the_imagenet_folders(tmp_path):
    wnids = zs.imagenet_wnids()
    for w in wnids:
        os.makedirs(tmp_path / "val" / w)
    (tmp_path / "val" / wnids[1] / "x.png").write_bytes(_png(np.random.default_rng(0)))
    names = _names(tmp_path)
    assert names == zs.imagenet_classnames() and names[1] == "goldfish"
    assert _names(tmp_path, zs.imagenet_classnames()) == zs.imagenet_classnames()


def test_classnames_that_do_not_match_the_folders_name_the_difference(tmp_path):
    _imagefolder(tmp_path)
    (tmp_path / "names.txt").write_text("eight\nfive\nsix\n")
    with pytest.raises(ValueError, match=r"folders without a class name \['seven_up'\], class names "
                                         r"without a folder \['six'\]"):
        _names(tmp_path, str(tmp_path / "names.txt"))
    with pytest.raises(ValueError, match=r"\['seven_up'\].*\['four', 'six'\] \(3 folders, 4 names\)"):
        _names(tmp_path, ["Eight", "five", "four", "six"])
    # "_" and case do not count as a difference
    assert _names(tmp_path, ["Eight", "five", "seven up"]) == ["Eight", "five", "seven up"]


def test_permuted_classnames_without_class_index_is_an_error(tmp_path):
    """Before: accepted silently; zero-shot scored below chance (8.6% on 10 digits)."""
    _imagefolder(tmp_path)
    order = ["seven_up", "eight", "five"]
    (tmp_path / "names.txt").write_text("\n".join(order) + "\n")
    with pytest.raises(ValueError, match=r"another order \(3 of 3 out of place\).*sorted folder name "
                                         r"\['eight', 'five', 'seven_up'\].*set class_index"):
        _names(tmp_path, str(tmp_path / "names.txt"))
    # the fix the message names: class_index = the folders in the order of the names
    es = eval_data.imagefolder(str(tmp_path), "val", str(tmp_path / "names.txt"))
    assert zs.imagefolder_classnames(es.info, str(tmp_path / "names.txt")) == order
    assert es.info["labels"].tolist() == [1, 1, 2, 2, 0, 0]   # eight -> 1, five -> 2, seven_up -> 0
    assert _names(tmp_path, order, class_index=order) == order   # a list works as class_index too


def test_names_for_opaque_folders_need_a_mapping(tmp_path):
    _imagefolder(tmp_path, classes=("0", "1", "2"))
    with pytest.raises(ValueError, match=r"match none of the class folders \['0', '1', '2'\].*"
                                         r"\{folder: name\}"):
        _names(tmp_path, ["zero", "one", "two"])
    (tmp_path / "names.json").write_text(json.dumps({"2": "two", "0": "zero", "1": "one"}))
    assert _names(tmp_path, str(tmp_path / "names.json")) == ["zero", "one", "two"]
    with pytest.raises(ValueError, match=r"names no class for the folders \['2'\]"):
        _names(tmp_path, {"0": "zero", "1": "one"})


# ----------------------------------------------------------------------------- retrieval on tar shards
def test_retrieval_set_from_training_tar_shards(tmp_path):
    paths = _tar_shards(tmp_path, num_shards=2, per_shard=3)
    members = synthetic.record_members("orphan", {"txt": b"no image"})   # skipped, as in training
    synthetic.write_tar(str(tmp_path / "train-0002.tar"), members)
    es = retrieval_data.image_text_tars(str(tmp_path / "train-{0000..0002}.tar"))
    assert len(es) == 6 and es.captions[0] == "a photo of the digit eight"
    assert es.caption_record.tolist() == list(range(6))
    img = Image.open(io.BytesIO(es.records[5]["image"]))
    assert img.size == (20, 20) and paths


# ----------------------------------------------------------------------------- the recipe, end to end
# (Training steps are not run here: compiling even the micro train step costs ~1 min of CPU on
# 2 cores; tests/test_train.py runs the trainer. These check what the recipe adds around it.)
def _micro_args(tmp_path, spm_model):
    return [f"--config.data.path={tmp_path}/shards/train-{{0000..0001}}.tar",
            f"--config.data.tokenizer.path={spm_model}", "--config.model.variant=micro",
            "--config.data.image_size=16", "--config.data.tokenizer.context_length=8",
            "--config.batch_size=16", "--config.data.shuffle_buffer_size=8"]


def test_recipe_training_batches_from_png_tar_shards(tmp_path, spm_model):
    """configs/own_data.py + overrides -> the trainer's data: PNG + caption shards, the
    SentencePiece model, pad = EOS = 1, and the [MASK] id (3) never emitted by the tokenizer."""
    from prolip_jax.trainer.data import build_train_data

    _tar_shards(tmp_path / "shards")
    config, _ = train.parse_command_line(["prolip_jax.train", "--config", OWN, "--workdir", "/unused",
                                          *_micro_args(tmp_path, spm_model)])
    tc = trainer_config.parse_config(config)
    data = build_train_data(tc, trainer_build.model_config(tc), trainer_build.step_config(tc))
    try:
        batch = next(data.batches)
    finally:
        data.batches.close()
    assert batch["image"].shape == (16, 16, 16, 3) and batch["image"].dtype == np.uint8
    text = np.asarray(batch["text"])
    assert text.shape == (16, 8) and text.max() < 64
    assert config.masking.mask_token_id not in text and (text == 1).any(axis=1).all()


def test_recipe_evaluate_a_checkpoint_with_overrides(tmp_path, spm_model, micro, capsys):
    """scripts/evaluate.py --config configs/eval/imagefolder.py:evals=zeroshot+retrieval with
    `--config.*` overrides on a checkpoint: zero-shot named after the folder, retrieval on tars."""
    from prolip_jax.core import checkpoint
    from prolip_jax.core.models import get_config

    model, params = micro
    checkpoint.save_params(tmp_path / "ckpt", params, get_config("micro"), step=3)
    _tar_shards(tmp_path / "shards", num_shards=1, per_shard=6)
    _imagefolder(tmp_path / "digits")
    out = tmp_path / "eval"
    code = evaluate.main(["--checkpoint", str(tmp_path / "ckpt"), "--config", EVAL + ":evals=zeroshot+retrieval",
                          "--out", str(out), "--no_plots", f"--config.root={tmp_path / 'digits'}",
                          f"--config.shards={tmp_path}/shards/train-0000.tar",
                          f"--config.tokenizer.path={spm_model}", "--config.batch_size=8"])
    results = json.loads((out / "results.json").read_text())
    assert code == 0 and results["checkpoint/step"] == 3
    assert 0 <= results["zeroshot/digits/top1_csd"] <= 100 and 0 <= results["retrieval/tar/csd/i2t_R@1"] <= 100
    # a class-name trap on the command line: exit 2 and one line saying what is wrong
    (tmp_path / "names.txt").write_text("five\neight\nseven up\n")
    capsys.readouterr()
    code = evaluate.main(["--checkpoint", str(tmp_path / "ckpt"), "--config", EVAL, "--out", str(out), "--overwrite",
                          f"--config.root={tmp_path / 'digits'}", f"--config.tokenizer.path={spm_model}",
                          f"--config.classnames={tmp_path / 'names.txt'}"])
    last = capsys.readouterr().err.strip().splitlines()[-1]   # (above it: progress bars)
    assert code == 2 and last.startswith("error: zero-shot on ") and "in another order" in last
