"""prolip_jax/core/artifacts.py: one path rule for `prolip_jax.load`, scripts/evaluate.py and both
converters (workdir, checkpoints folder, step folder, exported folder; paths are never hub ids;
--out refuses a non-empty folder unless --overwrite; nothing half-written), and export -> import
keeping the tokenizer. Each test below failed on the code before these rules."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import prolip_jax
from prolip_jax.core import checkpoint
from prolip_jax.core import artifacts
from prolip_jax.core.pretrained import hub

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_from_pytorch  # noqa: E402
import convert_to_pytorch  # noqa: E402
import evaluate  # noqa: E402

STEP = 3
TEXTS = ["a photo", "a photo of a red dog", "zebra"]  # "zebra": not in the vocabulary (unk)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    """A word-level tokenizer.json (kind "hf") small enough for the micro model (64 rows)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    from input_pipeline.tokenizer_files import TokenizerFile
    from input_pipeline.tokenizers import build_tokenizer

    words = ["<pad>", "</s>", "<unk>", "a", "photo", "of", "red", "dog", "cat"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return TokenizerFile.of(build_tokenizer("hf", path, context_length=8, pad_id=0, clean=None))


@pytest.fixture(scope="module")
def workdir(micro, tokenizer_file, tmp_path_factory):
    """A training workdir's layout (WORKDIR/checkpoints/<step>/...) with a recorded tokenizer
    and the training's normalisation, as the trainer writes them."""
    from prolip_jax.core.models import get_config

    _, params = micro
    w = tmp_path_factory.mktemp("runs") / "w"
    checkpoint.save_params(w / "checkpoints", params, get_config("micro"), step=STEP, tokenizer=tokenizer_file,
                           metadata={"train_config": {"data": {"normalization": "0.5"}}})
    return w


@pytest.fixture
def no_hub(monkeypatch):
    """Any hub call fails the test; HF_HUB_OFFLINE is unset (a user without the variable)."""
    import huggingface_hub
    from huggingface_hub import constants

    def boom(*args, **kwargs):
        raise AssertionError(f"the hub was called for {args}")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", boom)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", boom)


# ------------------------------------------------------------------------------ the path rule
@pytest.mark.parametrize("name, repo", [
    ("org/name", True), ("timm/ViT-B-16-SigLIP", True), ("org/model.v2", True),
    ("workdirs/demo", True),  # two parts, missing locally: tried on the hub too (see the test below)
    ("./org/name", False), ("../org/name", False), ("~/org", False), ("/org/name", False),
    ("a/b/c", False), ("org/name/", False), ("gs://bucket/run", False), ("file:///x/y", False),
    ("org/model.npz", False), ("ckpt/open_clip_model.safetensors", False), ("name", False),
])
def test_is_repo_id(name, repo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert hub.is_repo_id(name) is repo
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    assert not hub.is_repo_id("org/name")  # an existing local path is a path


@pytest.mark.parametrize("name", ["nope", "./nope", "../nope-prolip-x", "~/nope-prolip-x", "ckpt/a/b",
                                  "ckpt/model.npz", "ckpt/prolip_b16/"])
def test_a_missing_path_is_one_line_within_a_second_and_never_the_hub(name, no_hub, tmp_path, monkeypatch, capsys):
    import prolip_jax.api  # noqa: F401  (imports happen before the clock starts)
    import prolip_jax.export  # noqa: F401

    monkeypatch.chdir(tmp_path)
    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as e:
        prolip_jax.load(name)
    assert str(e.value) == f"no such file or folder: {name}"
    assert time.perf_counter() - start < 1.0
    for tool, argv in ((convert_to_pytorch, ["--checkpoint", name, "--out", "hf"]),
                       (convert_from_pytorch, ["--src", name, "--out", "ckpt"])):
        start = time.perf_counter()
        assert tool.main(argv) == 2
        assert capsys.readouterr().err == f"error: no such file or folder: {name}\n"
        assert time.perf_counter() - start < 1.0
    assert not (tmp_path / "hf").exists() and not (tmp_path / "ckpt").exists()


def test_a_missing_org_name_tries_the_cache_fast_and_names_both(monkeypatch, tmp_path):
    """`workdirs/demo` before `make demo`: no network, HF_HUB_OFFLINE unset. Before: ~50 s of
    huggingface_hub retries and advice to run `huggingface-cli`, which 2.x no longer ships."""
    import huggingface_hub
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    probes, downloads = [], []

    def no_network(url, **kw):
        probes.append((url, kw.get("timeout")))
        raise OSError("[Errno -2] Name or service not known")

    real = huggingface_hub.hf_hub_download

    def cache_only(repo_id, filename, **kw):
        downloads.append(filename)
        assert kw.get("local_files_only") is True, "an unreachable hub must not be retried"
        return real(repo_id, filename, **kw)

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", no_network)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cache_only)
    import prolip_jax.api  # noqa: F401  (imports happen before the clock starts)

    start = time.perf_counter()
    with pytest.raises(FileNotFoundError) as e:
        prolip_jax.load("workdirs/demo")
    assert time.perf_counter() - start < 2.0
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("no such local file or folder 'workdirs/demo', and as a Hugging Face repo")
    assert "could not be reached" in msg and str(tmp_path / "hub") in msg
    assert "`hf download workdirs/demo open_clip_config.json" in msg and "huggingface-cli" not in msg
    assert len(probes) == 1 and probes[0][1] <= 5 and downloads  # one probe, then the cache
    # HF_HUB_OFFLINE: no probe at all, and the message says why.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError,
                       match=r"^no such local file or folder 'ckpt/prolip_b16'.*HF_HUB_OFFLINE is set"):
        prolip_jax.load("ckpt/prolip_b16")
    assert len(probes) == 1


@pytest.mark.parametrize("version, cli", [("2.4.0", "hf"), ("1.0.0", "hf"), ("0.30.2", "huggingface-cli")])
def test_the_advice_names_the_installed_cli(version, cli, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "__version__", version)
    assert hub.cli_download("org/name", ["config.json"]) == f"{cli} download org/name config.json"


# ------------------------------------------------------------------------------ one rule, every tool
def test_every_layout_is_accepted_by_load_and_the_converters(workdir, tmp_path, capsys):
    """Before: convert_to_pytorch refused a workdir ("holds no complete checkpoint")."""
    ckpts = workdir / "checkpoints"
    reference = prolip_jax.load(ckpts)
    for i, path in enumerate((workdir, ckpts, ckpts / str(STEP))):
        where = artifacts.locate(path)
        assert (where.kind, where.path, where.step) == ("checkpoint", ckpts.absolute(), STEP)
        model = prolip_jax.load(path)
        assert model.step == STEP and model.normalization == "0.5" and model.tokenizer is not None
        assert convert_to_pytorch.main(["--checkpoint", str(path), "--out", str(tmp_path / f"hf{i}")]) == 0
        assert convert_from_pytorch.main(["--src", str(path), "--out", str(tmp_path / f"ckpt{i}")]) == 0
        np.testing.assert_array_equal(prolip_jax.load(tmp_path / f"ckpt{i}").params["visual"]["proj"],
                                      reference.params["visual"]["proj"])
    # An exported folder is accepted by every tool too (convert_to_pytorch: an export again).
    assert artifacts.locate(tmp_path / "hf0").kind == "hf"
    assert convert_to_pytorch.main(["--checkpoint", str(tmp_path / "hf0"), "--out", str(tmp_path / "hf_again")]) == 0
    weights = [(tmp_path / d / "model.safetensors").read_bytes() for d in ("hf0", "hf_again")]
    assert weights[0] == weights[1]
    assert (tmp_path / "hf_again" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert convert_to_pytorch.main(["--checkpoint", str(workdir), "--out", str(tmp_path / "hf9"), "--step", "4"]) == 2
    assert "step 4 not in" in capsys.readouterr().err
    with pytest.raises(ValueError, match="Hugging Face folder .* drop --step 2"):
        prolip_jax.load(tmp_path / "hf0", step=2)


def test_export_then_import_keeps_the_tokenizer(workdir, tmp_path):
    """Before: prolip_jax.load(<imported>).tokenize raised "this model carries no tokenizer"."""
    original = prolip_jax.load(workdir)
    ids = original.tokenize(TEXTS)
    assert ids[0].tolist() == [3, 4, 1, 0, 0, 0, 0, 0] and ids[2, 0] == 2  # a photo </s> <pad>...; zebra = <unk>
    assert convert_to_pytorch.main(["--checkpoint", str(workdir), "--out", str(tmp_path / "hf")]) == 0
    assert convert_from_pytorch.main(["--hf_dir", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    back = prolip_jax.load(tmp_path / "back")
    np.testing.assert_array_equal(back.tokenize(TEXTS), ids)
    assert back.normalization == "0.5"  # the export's preprocessor_config.json, recorded too
    # (config.json's text_cfg names the export folder itself, ".", as its tokenizer)
    assert back.config.text.hf_tokenizer_name == "."
    assert back.config.vision == original.config.vision and back.config.embed_dim == original.config.embed_dim
    mu, logvar = back.encode_text(ids)
    mu0, logvar0 = original.encode_text(ids)
    np.testing.assert_array_equal(mu, mu0)
    np.testing.assert_array_equal(logvar, logvar0)
    # The recorded tokenizer file sits in the checkpoint with its sha256, as the trainer's does.
    meta = checkpoint.load_config(tmp_path / "back")[1]
    assert (tmp_path / "back" / meta["tokenizer"]["file"]).is_file()


# ------------------------------------------------------------------------------ --out
def test_convert_from_pytorch_out_needs_overwrite_and_is_never_half_written(workdir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert_from_pytorch.main(["--src", str(workdir), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--overwrite" in err and (out / "keep.txt").read_text() == "mine"
    # An error while writing: the earlier folder is untouched and no temporary is left.
    real = checkpoint.save_params

    def fails_late(directory, *args, **kwargs):
        real(directory, *args, **kwargs)
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_params", fails_late)
    with pytest.raises(OSError, match="disk full"):
        convert_from_pytorch.main(["--src", str(workdir), "--out", str(out), "--overwrite"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"] and (out / "keep.txt").read_text() == "mine"
    monkeypatch.setattr(checkpoint, "save_params", real)
    assert convert_from_pytorch.main(["--src", str(workdir), "--out", str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and prolip_jax.load(out).step == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


class _Probe:
    """An evaluator that reports an id of the tokenizer it was handed (the recorded one)."""

    def __init__(self, config, model, tokenizer=None):
        from prolip_jax.core.encode import Encoder

        self.tokenizer = tokenizer
        self.encoder = Encoder(model, batch_size=8)  # keeps the throughput measurement small

    def run(self, params, progress=None):
        yield "probe/ids", int(self.tokenizer(["a photo"])[0, 1])


def test_evaluate_takes_every_layout_and_out_needs_overwrite(workdir, tmp_path, capsys, monkeypatch):
    """Before: evaluate.py overwrote a non-empty --out silently (and had no --overwrite)."""
    import evaluators

    monkeypatch.setitem(evaluators.REGISTRY, "probe", _Probe)
    cfg = tmp_path / "probe.py"
    cfg.write_text("import ml_collections as m\ndef get_config(arg=None):\n    c = m.ConfigDict()\n"
                   "    c.evals = m.ConfigDict(dict(p=dict(type='probe')))\n    return c\n")
    convert_to_pytorch.main(["--checkpoint", str(workdir), "--out", str(tmp_path / "hf")])
    out = tmp_path / "eval"
    for checkpoint_path in (workdir, tmp_path / "hf"):
        argv = ["--checkpoint", str(checkpoint_path), "--config", str(cfg), "--out", str(out), "--no_plots"]
        code = evaluate.main(argv + (["--overwrite"] if out.exists() else []))
        assert code == 0 and json.loads((out / "results.json").read_text())["probe/ids"] == 4
    assert json.loads((out / "results.json").read_text()).get("checkpoint/step") is None  # the export's
    capsys.readouterr()
    before = (out / "results.json").read_text()
    start = time.perf_counter()
    assert evaluate.main(["--checkpoint", str(workdir), "--config", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --out ") and "--overwrite" in err
    assert time.perf_counter() - start < 1.0  # refused before the model is loaded
    # An error while writing the results leaves the earlier ones and no temporary folder.
    monkeypatch.setattr(evaluate, "markdown_table", lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        evaluate.main(["--checkpoint", str(workdir), "--config", str(cfg), "--out", str(out), "--overwrite"])
    assert (out / "results.json").read_text() == before
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".eval")]
