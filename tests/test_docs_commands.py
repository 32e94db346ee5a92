"""docs/data.md's own-data recipe, run as written: its commands are extracted from the page (as
tests/test_readme.py extracts the README's) and run in order (tar shards, tokenizer, train,
the ArrayRecord conversion, both evaluations, export), with small stand-ins: /data/... and workdirs/... in a temporary folder,
generated PNG + caption files, and flags appended for a micro model and a 2-step run. One tiny
workdir serves every check; the scripts run in this process (no interpreter or jax start-up each).
"""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from input_pipeline import synthetic
from test_readme import ROOT, commands

DATA_MD = ROOT / "docs" / "data.md"
OWN_DATA = DATA_MD.read_text().split("\n# Input pipeline", 1)[0]   # the "Your own data" half
CLASSES = ("eight", "five", "seven")
SHARDS = 6   # the page's train-{0000..0005}

# What each command gets appended: the micro model (vocabulary 64, context 8, 16 px) at batch 16
# (and 2 steps: `steps=2`), no plots. A flag given twice takes the last value (argparse and absl).
TINY = {
    "train_tokenizer.py": ["--context_length", "8", "--max_vocab_size", "64"],
    "prolip_jax.train": ["--config.model.variant=micro", "--config.data.image_size=16",
                         "--config.data.tokenizer.context_length=8", "--config.batch_size=16", "--config.masking.group=2",
                         "--config.data.shuffle_buffer_size=8", "--config.log_steps=1"],
    "tar_to_array_record.py": ["--no-progress"],   # its tqdm bar would write escape codes to the captured stderr
    "evaluate.py": ["--no_plots", "--config.batch_size=8"],
    "convert_to_pytorch.py": [],
}


def _raw_shard_folder(folder: Path, shard: int, per_shard: int = 8) -> None:
    """`000000.png` + `000000.txt` ... : what the page's tar command packs."""
    rng = np.random.default_rng(shard)
    folder.mkdir(parents=True)
    for i in range(per_shard):
        (folder / f"{i:06d}.png").write_bytes(synthetic.encode_image(rng.integers(0, 255, (20, 20, 3), np.uint8), "PNG"))
        (folder / f"{i:06d}.txt").write_text(f"a photo of the digit {CLASSES[(shard + i) % 3]}")


def _imagefolder(root: Path) -> None:
    rng = np.random.default_rng(9)
    for c in CLASSES:
        (root / "val" / c).mkdir(parents=True)
        for i in range(2):
            (root / "val" / c / f"{i}.png").write_bytes(synthetic.encode_image(rng.integers(0, 255, (20, 20, 3), np.uint8), "PNG"))


def _run(argv: list[str]) -> None:
    """`python scripts/X.py ...` or `python -m prolip_jax.train ...`, in this process."""
    if argv[1] == "-m":
        from prolip_jax import train

        spec = argv.index("--config") + 1
        argv[spec] += ",steps=2" if ":" in argv[spec] else ":steps=2"   # the page's "Run length" arg
        train.main([argv[2], *argv[3:], *TINY[argv[2]]])
        return
    script = Path(argv[1])
    sys.path.insert(0, str(ROOT / script.parent))
    try:
        module = __import__(script.stem)
    finally:
        sys.path.remove(str(ROOT / script.parent))
    code = module.main([*argv[2:], *TINY[script.name]])
    assert code in (0, None), f"{' '.join(argv)} exited {code}"


@pytest.mark.skipif(shutil.which("tar") is None, reason="the page's shard command needs GNU tar")
def test_the_own_data_recipe_runs_as_written(tmp_path, monkeypatch, capsys):
    # A benchmark's command reproduces a measurement (minutes to hours): benchmarks/ has its own tests.
    steps = [c for c in commands(OWN_DATA) if not c.startswith("python benchmarks/")]
    kinds = [shlex.split(c)[0] if c.startswith("tar ") else shlex.split(c)[1:3] for c in steps
             if not c.startswith("--")]   # a `--config.templates=...` line shows one flag, not a command
    assert kinds == ["tar", ["scripts/train_tokenizer.py", "--input"], ["-m", "prolip_jax.train"],
                     ["scripts/tar_to_array_record.py", "--input"], ["scripts/evaluate.py", "--checkpoint"], ["scripts/evaluate.py", "--checkpoint"],
                     ["scripts/convert_to_pytorch.py", "--checkpoint"]], kinds
    for raw in ("/data/mine/raw/0000", "/data/digits", "workdirs/mine"):
        assert raw in OWN_DATA, f"docs/data.md no longer names {raw}: update this test's stand-ins"

    monkeypatch.chdir(ROOT)   # the page's relative paths: configs/..., scripts/...
    here = lambda cmd: (cmd.replace("/data/", f"{tmp_path}/data/")
                        .replace("workdirs/mine", f"{tmp_path}/workdirs/mine"))
    _imagefolder(tmp_path / "data" / "digits")
    tar = here(next(c for c in steps if c.startswith("tar ")).split("   #")[0])
    for shard, name in [*((s, f"train-{s:04d}") for s in range(SHARDS)), (SHARDS, "val-0000")]:
        _raw_shard_folder(tmp_path / "data" / "mine" / "raw" / f"{shard:04d}", shard)
        cmd = tar.replace("raw/0000", f"raw/{shard:04d}").replace("train-0000", name)
        subprocess.run(shlex.split(cmd), check=True)

    capsys.readouterr()
    for cmd in steps:
        if cmd.startswith("python"):
            _run(shlex.split(here(cmd)))
    out, err = capsys.readouterr()

    # Train: every progress line fits a terminal; the closing line evaluates on the run's own folder.
    progress = [line for line in out.splitlines() if line.startswith("[")]
    assert progress and max(map(len, progress)) <= 160, max(progress, key=len)
    assert any(re.search(r"\| zeroshot/digits .*top1_csd \d", line) for line in progress), progress
    workdir = tmp_path / "workdirs" / "mine"
    closing = out.splitlines()[out.splitlines().index(next(l for l in out.splitlines() if l.startswith("done: "))) + 1]
    assert f"--config.root={tmp_path}/data/digits" in closing and "YOUR_IMAGEFOLDER" not in closing, closing
    # The ArrayRecord conversion wrote every shard's records where the page's train flag reads them,
    # and the page does not ask for data.source (auto reads the kind from the names).
    assert re.search(rf"^{SHARDS} shards \(0 already done\), {SHARDS * 8} records written, 0 skipped$", out, re.M), out
    ar_glob = re.search(r"--config\.data\.path='(/data/mine/ar/\*\.array_record)'", OWN_DATA)
    assert ar_glob and len(list(Path(here(ar_glob.group(1))).parent.glob("*.array_record"))) == SHARDS
    assert "data.source=array_record" not in OWN_DATA
    # Both evaluations wrote their results (each to its own --out), and the export its folder.
    outs = sorted(workdir.glob("*/results.json"))
    assert len(outs) == 2, outs
    results = [json.loads(p.read_text()) for p in outs]
    assert all(r["checkpoint/step"] == 2 and "zeroshot/digits/top1_csd" in r for r in results)
    assert any("retrieval/tar/csd/i2t_R@1" in r for r in results)
    assert (workdir / "hf" / "config.json").is_file() and list((workdir / "hf").glob("*.safetensors"))
    # Piped (not a terminal), scripts/evaluate.py shows plain lines, no progress bars' escape codes.
    assert "\x1b[" not in err and "\r" not in err, repr(err[-300:])
    assert re.search(r"^evaluating zeroshot \(1/\d\)$", err, re.M), err[-500:]
