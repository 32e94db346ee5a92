"""What the trainer tells its user: a fast `--help` with the flags and the config's args, a quiet
console (the parameter table in a file, compile time, headline metrics, the evaluate command at
the end) and short errors that name the flag to change."""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import evaluators
from input_pipeline.config import DataConfig
from prolip_jax.runtime import messages, train_flags
from prolip_jax import train
from prolip_jax.trainer import config as trainer_config, console as trainer_console
from prolip_jax.runtime.metrics import read_jsonl
from prolip_jax.core.models import abstract_params, get_config
from prolip_jax.core.pretrained.warm_start import warm_start
from test_train import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def test_help_is_fast_imports_no_jax_and_shows_the_config_args():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "prolip_jax.train", "--help",
                          "--config", "configs/tiny.py:steps=3"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    seconds = time.perf_counter() - t0
    assert out.returncode == 0, out.stderr[-2000:]
    assert seconds < 5, seconds  # a loose bound (a loaded CI machine); the imports below are the exact check
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
    assert "prolip_jax.runtime.train_flags" in imported and not {m for m in imported if m.split(".")[0] == "jax"}
    for flag in ("--config FILE[:ARGS]", "--config.FIELD=VALUE", "--workdir DIR", "--coordinator_address",
                 "--num_processes", "--process_id"):
        assert flag in out.stdout, flag
    # The config file's args with their defaults (from its source) and its docstring.
    assert "--config configs/tiny.py[:ARGS]; ARGS (key=value,...) and their defaults: steps=200, data=demo" \
        in out.stdout
    assert "data=random    random images/tokens" in out.stdout
    # Every field --config.FIELD=VALUE can set, the top-level ones first.
    top = re.search(r"^  top level +(.*?)\n  model\.", out.stdout, re.S | re.M)
    assert top and {"total_steps", "batch_size", "log_steps", "seed"} <= set(re.split(r",\s+", top.group(1))), out.stdout
    assert re.search(r"^  optim\. +lr, warmup_steps, ", out.stdout, re.M)


@pytest.mark.parametrize("spec", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.py")))
def test_help_lists_every_field_of_the_config(spec):
    """The fields help lists (read without jax) are those `--config.FIELD=VALUE` accepts: the
    config file's and the declared defaults, each section's and the objective's."""
    config, _ = train.parse_command_line(["prolip_jax.train", "--config", f"{ROOT}/{spec}", "--workdir", "/u"])
    listed = {name.split(" ")[0]: fields for name, fields in train_flags.config_fields(f"{ROOT}/{spec}")}
    assert set(listed.pop("top")) == {k for k in config if not hasattr(config[k], "keys")}
    for name, section in config.items():
        if name == "evals":
            assert {f"evals.{e}." for e in section} | {"evals.NAME."} == {k for k in listed if k.startswith("evals.")}
            assert all(set(listed[f"evals.{e}."]) == set(section[e]) | {"type", "log_steps", "prefix"} for e in section)
        elif hasattr(section, "keys"):
            assert listed[name + "."] == list(section) or set(listed[name + "."]) == set(section), name


def test_help_without_config_lists_the_configs(capsys):
    train.main(["prolip_jax.train", "-h"])
    out = capsys.readouterr().out
    assert "--workdir DIR" in out and re.search(r"configs/tiny\.py +A tiny ProLIP on the demo dataset", out)


def test_help_names_every_flag_and_section_the_trainer_defines():
    _, fv = train.parse_command_line(["prolip_jax.train", "--config", f"{ROOT}/configs/tiny.py:data=random",
                                      "--workdir", "/unused"])
    defined = {name for name in fv if name != "config" and not name.startswith("config.")}
    assert {name for name, *_ in train_flags.FLAGS} == defined
    assert set(train_flags.SECTIONS) == {*trainer_config.SECTIONS, "loss", "data", "evals"}


def test_console_of_a_tiny_run(tmp_path, capsys):
    """Two steps of the micro model with two in-training evaluators: the table goes to a file,
    compilation is announced and timed, evaluation lines carry the headline metrics only (the
    files get all of them), and the last lines name the checkpoint and the command evaluating it."""
    cfg = tiny_config(tmp_path, **{"data.source": "random", "total_steps": 2, "log_steps": 1})
    demo = dict(cfg.data.demo)
    cfg.evals.zs = dict(type="zeroshot", log_steps=2, dataset="demo", task="object", demo=demo, name="object")
    cfg.evals.ret = dict(type="retrieval", log_steps=2, dataset="demo", demo=demo, scores=("csd",))
    workdir = tmp_path / "w"
    train.train(cfg, str(workdir))
    lines = capsys.readouterr().out.splitlines()

    table = (workdir / "parameters.txt").read_text()
    assert "Total:" in table and table.count("\n") > 20
    summary = [line for line in lines if "parameters (" in line]
    assert len(summary) == 1 and re.match(r"[\d,]+ parameters \((text|visual) [\d,]+, (text|visual) [\d,]+, ",
                                          summary[0]), summary
    assert str(workdir / "parameters.txt") in summary[0]
    assert not any(line.startswith(("|", "+-")) for line in lines)  # no row of the table
    assert lines.count("speed levers (cpu): none") == 1  # the platform's defaults: none on the CPU
    compiling, compiled = lines.index("compiling the train step..."), lines.index(
        next(line for line in lines if line.startswith("compiled in ")))
    first_step = lines.index(next(line for line in lines if line.startswith("[1/2")))
    assert compiling < compiled < first_step and re.fullmatch(r"compiled in \d+\.\d s", lines[compiled])

    # Progress: a line of headline training metrics fitting a terminal, and one of each
    # evaluator's headline on the steps that evaluated; everything else only in the files.
    progress = [line for line in lines if line.startswith("[")]
    assert max(map(len, progress)) <= 160, max(progress, key=len)
    assert re.fullmatch(r"\[1/2  50\.0%\] ETA \? \| loss [\d.]+ \((ppcl|img_inclusion|txt_inclusion|inclusion|vib) [\d.e-]+"
                        r"(, \w+ [\d.e-]+){2}\) \| samples_per_s [\d.]+ \| lr [\de.-]+ \| \+\d+ more in metrics\.jsonl",
                        progress[0]), progress[0]
    train_line, eval_line = (line for line in progress if line.startswith("[2/2"))
    assert " | loss " in train_line and "zeroshot" not in train_line
    evaluated = {k for k in read_jsonl(str(workdir / "metrics.jsonl"))[-1] if k.startswith(("zeroshot/", "retrieval/"))}
    # written once per parent: "zeroshot/object top1_dot 2.8, top1_csd 2.8"
    shown = {k for k in evaluated if re.search(rf"{re.escape(k.rsplit('/', 1)[0])}( \S+ [\d.]+,)* "
                                               rf"{re.escape(k.rsplit('/', 1)[1])} [\d.]+", eval_line)}
    assert {"zeroshot/object/top1_csd", "retrieval/demo/csd/i2t_R@1", "retrieval/demo/csd/t2i_R@1"} <= shown
    assert len(shown) <= 4 and len(evaluated) > 40  # a few on the console, all in the file
    assert re.search(r" \| \+\d+ more in metrics\.jsonl$", eval_line) and "unc_bin" not in eval_line
    for dropped in ("nonfinite", "skipped_updates", "data/skipped", "samples_per_s_per_device", "step_time_s"):
        assert f"{dropped} " not in "".join(progress), dropped  # zero counters, per-device rate: files only

    assert lines[-2] == f"done: the checkpoint of step 2 is {(workdir / 'checkpoints' / '2').absolute()}; evaluate it with"
    assert (workdir / "checkpoints" / "2").is_dir()
    assert re.fullmatch(rf"  python \S*scripts/evaluate\.py --checkpoint {re.escape(str(workdir))} --config "
                        rf"\S*configs/eval/demo\.py --out {re.escape(str(workdir / 'eval'))}", lines[-1]), lines[-1]
    assert len(lines) <= 10, lines


def test_the_evaluate_command_fits_the_run_data():
    w = Path("/runs/x")
    for data, tail in (({"source": "cub", "image_root": "/d/cub"}, r"cub\.py --out /runs/x/eval --config\.root=/d/cub"),
                       ({"source": "coco_karpathy", "caption_file": "/c/k.json", "image_root": "/c"},
                        r"coco\.py --out /runs/x/eval --config\.karpathy_json=/c/k\.json --config\.image_root=/c"),
                       ({"source": "tar"}, r"imagefolder\.py --out /runs/x/eval --config\.root=YOUR_IMAGEFOLDER")):
        assert re.fullmatch(r"python \S*scripts/evaluate\.py --checkpoint /runs/x --config \S*configs/eval/" + tail,
                            trainer_console.evaluate_command(w, DataConfig.from_mapping(data))), data
    # A run with its own zero-shot folder (configs/own_data.py:zeroshot=DIR) is evaluated on it.
    config, _ = train.parse_command_line(["prolip_jax.train", "--config", f"{ROOT}/configs/own_data.py:zeroshot=/d/digits",
                                          "--workdir", "/u", "--config.evals.zeroshot.split=test"])
    assert trainer_console.evaluate_command(w, DataConfig(source="tar"), config.evals).endswith(
        "imagefolder.py --out /runs/x/eval --config.root=/d/digits --config.split=test")


def test_every_evaluator_declares_its_headline():
    for kind in evaluators.REGISTRY:
        assert getattr(evaluators.get(kind), "HEADLINE", ()), kind
    values = {"zeroshot/object/top1_csd": 1, "zeroshot/object/unc_bin3_top1_csd": 1, "x/i2t_R@1": 1}
    assert trainer_console.headline(evaluators.get("zeroshot"), values) == ["zeroshot/object/top1_csd"]


def test_few_cuts_long_lists():
    assert messages.few(range(405)) == "0, 1, 2, and 402 more"
    assert messages.few(["a", "b"]) == "a, b" and messages.few([]) == ""


def test_wrong_size_warm_start_error_is_short_and_names_the_flags():
    """Another width and layer count: every tower parameter misfits; the error stays a few lines."""
    micro = get_config("micro")
    other = micro.replace(vision=dataclasses.replace(micro.vision, width=48, layers=3),
                          text=dataclasses.replace(micro.text, width=48, layers=3), embed_dim=48)

    def zeros(cfg):
        return jax.tree.map(lambda s: np.zeros(s.shape, np.float32), abstract_params(cfg))

    with pytest.raises(ValueError) as err:
        warm_start(micro, zeros(micro), other, zeros(other))
    msg = str(err.value)
    count = int(re.match(r"warm start: (\d+) parameter\(s\)", msg).group(1))
    assert count > 30 and len(msg) < 700 and "\n" not in msg, msg
    assert re.search(rf"; and {count - 3} more\. ", msg)
    # An example of each kind of misfit leads: another shape, another width, a block only in the source.
    assert ": target (" in msg and "(the width differs)" in msg and ": only in the source" in msg
    assert "--config.init.path" in msg and "--config.model.variant" in msg


def test_too_few_shards_for_the_workers_names_the_flag(tmp_path):
    from conftest import KeyTokenizer
    from input_pipeline import pipeline

    for i in range(3):
        (tmp_path / f"part-{i}.tar").write_bytes(b"")
    config = dict(source="tar", path=str(tmp_path / "part-{0..2}.tar"), batch_size=8, image_size=16,
                  num_workers=4)
    with pytest.raises(ValueError, match=r"3 tar shards cannot feed 1 hosts x 4 worker processes .*: set "
                                         r"--config\.data\.num_workers=3 or fewer, or split the data into 4\+ shards"):
        pipeline.build_train_iterator(config, KeyTokenizer(), process_index=0, process_count=1)
