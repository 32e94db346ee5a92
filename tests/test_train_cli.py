"""The trainer's command line: every bad command is one line naming the problem, exit 2, and
nothing created; every field of the typed config can be overridden."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prolip_jax import train

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.py") + ":data=random"
# A config file with a mistyped evaluator type (written once, beside the tests' tmp files).
EVAL_TYPO = str(Path(__file__).resolve().parent / "data" / "config_eval_typo.py")


def _run_main(args, workdir):
    with pytest.raises(SystemExit) as e:
        train.main(["prolip_jax.train", *args, "--workdir", str(workdir)])
    return e.value.code


@pytest.mark.parametrize("args, expected", [
    ([f"--config={ROOT}/configs/tinyy.py"], r"config file .*tinyy\.py does not exist \(.*configs/ has: .*tiny\.py"),
    (["--config", TINY + ",stepz=3"], r"unknown config arg 'stepz'; known: \['data', 'size', 'steps'\]"),
    (["--config", TINY + ",size=huge"], r"size='huge' is not 'tiny' or 'micro'"),
    (["--config", TINY, "--config.model.dtype=bfloat61"],
     r"config\.model\.dtype='bfloat61' is not one of \('float32', 'bfloat16', 'float16'\)"),
    (["--config", TINY, "--config.data.source=tarr"], r"config\.data\.source='tarr' is not one of \(.*'tar'.*\)"),
    (["--config", TINY, "--config.optim.lrr=1"], r"config\.optim has no field 'lrr'; did you mean config\.optim\.lr\?$"),
    # another trainer's name for a field: a synonym, or the field of that name in another section
    (["--config", TINY, "--config.optim.learning_rate=1e-3"],
     r"^error: --config\.optim\.learning_rate: config\.optim has no field 'learning_rate'; did you mean config\.optim\.lr\?$"),
    (["--config", TINY, "--config.optim.wd=0.1"], r"did you mean config\.optim\.weight_decay\?$"),
    (["--config", TINY, "--config.optim.warmup=5"], r"did you mean config\.optim\.warmup_steps\?$"),
    (["--config", TINY, "--config.num_steps=5"], r"config has no field 'num_steps'; did you mean config\.total_steps"),
    (["--config", TINY, "--config.batch=8"], r"did you mean config\.batch_size\?$"),
    (["--config", TINY, "--config.data.batch_size=8"], r"config\.data has no field 'batch_size'; did you mean config\.batch_size\?$"),
    (["--config", TINY, "--config.optim.qqq=1"], r"config\.optim has no field 'qqq'; the fields of config\.optim: adamp_delta, .*b1, b2, .*and \d+ more$"),
    (["--config", TINY, "--config.batch_size=abc"], r"--config\.batch_size=abc: invalid literal"),
    (["--config", TINY, "--config.model.remat=sometimes"], r"config\.model\.remat='sometimes' is not one of"),
    (["--config", TINY, "--config.model.variant=B/17"], r"unknown model variant 'B/17'"),
    (["--config", TINY, "--config.data.source=tar", "--config.data.path=/nowhere/{0..1}.tar"],
     r"needs data\.tokenizer\.path"),
    (["--config", TINY, "--config.data.source=tar"], r"data\.source='tar' needs data\.path \(files, globs"),
    (["--config", TINY, "--config.data.source=auto"], r"data\.source='auto' needs data\.path"),
    (["--config", TINY, "--config.data.crop_scale=(0.8,)"], r"config\.data\.crop_scale=\(0\.8,\) needs 2 values"),
    (["--config", TINY, "--config.optim.locked=('^vision/',)"],
     r"optim\.locked pattern '\^vision/' matches no parameter \(parameters look like: "),
    (["--config", TINY, "--config.init.path=/nowhere/model.safetensors"], r"/nowhere/model\.safetensors"),
    (["--config", TINY, f"--config.init.path={ROOT}/tests/data/pretrained/openai_clip_tiny"],
     r"warm start: \d+ parameter\(s\) of the source do not fit the target model.*text/ln_final/bias: target \(64,\), "
     r"source \(40,\).*; and \d+ more\. Point --config\.init\.path at"),
    (["--config", TINY, "--config.keep_best.mode=best"], r"config\.keep_best\.mode='best' is not one of"),
    ([f"--config={EVAL_TYPO}"], r"config\.evals\.zs: unknown evaluator type 'zeroshoot'; registered: \[.*'zeroshot'"),
    (["--config", TINY + ",steps=5", "--stop_at_step=6"], r"--stop_at_step=6 must be in \[1, config\.total_steps=5\]"),
    (["--config", TINY, "--stop_at_step=0"], r"--stop_at_step=0 must be in \[1, config\.total_steps=200\]"),
])
def test_bad_command_is_one_line_exit_2_nothing_created(tmp_path, capsys, args, expected):
    import re

    workdir = tmp_path / "run"
    assert _run_main(args, workdir) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert "\\n" not in err and re.search(expected, err), err
    assert len(err) < 700, len(err)  # long lists are cut to a few items and a count
    assert not workdir.exists()


def test_every_data_field_can_be_overridden():
    """Fields the config file leaves out (DataConfig's defaults), None-valued ones included."""
    config, fv = train.parse_command_line([
        "prolip_jax.train", "--config", TINY, "--workdir", "/unused",
        "--config.data.shuffle_buffer_size=100", "--config.data.num_epochs=3",
        "--config.data.tfds_data_dir=/data/tfds", "--config.data.tokenizer.path=/vocab.model",
        "--config.optim.lr=0.5"])
    assert config.data.shuffle_buffer_size == 100 and config.data.num_epochs == 3
    assert config.data.tfds_data_dir == "/data/tfds" and config.data.tokenizer.path == "/vocab.model"
    assert config.optim.lr == 0.5 and fv.workdir == "/unused"
    # Left alone, they keep DataConfig's defaults (None included) and the pipeline accepts them.
    from input_pipeline.config import DataConfig

    config, _ = train.parse_command_line(["prolip_jax.train", "--config", TINY, "--workdir", "/unused"])
    data = config.data.to_dict()
    assert data["num_epochs"] is None and data["label_key"] is None
    DataConfig.from_mapping({**data, "source": "demo"})


def test_the_data_section_is_parsed_once_and_its_source_checked_when_built():
    """`config.data` is typed at the top like every section; what its source needs (data.path)
    is asked when the data is built, so a config may leave its paths to the command line."""
    from prolip_jax.trainer import config as trainer_config

    config, _ = train.parse_command_line(["prolip_jax.train", "--config", f"{ROOT}/configs/prolip_b16_datacomp.py",
                                          "--workdir", "/unused"])
    tc = trainer_config.parse_config(config)
    assert (tc.data.source, tc.data.path, tc.data.batch_size) == ("tar", "", config.batch_size)
    with pytest.raises(ValueError, match=r"data\.source='tar' needs data\.path"):
        tc.data.check_source()
    recorded = trainer_config.record(tc)["data"]
    assert "batch_size" not in recorded and recorded["tokenizer"]["kind"] == config.data.tokenizer.kind
    # "auto" is resolved once, from the names: every part and the checkpoint see the source named.
    config, _ = train.parse_command_line(["prolip_jax.train", "--config", TINY, "--workdir", "/unused",
                                          "--config.data.source=auto", "--config.data.path=/d/{0..3}.array_record"])
    assert trainer_config.record(trainer_config.parse_config(config))["data"]["source"] == "array_record"
    # A config file that sets data.batch_size must agree with the run's batch.
    with config.unlocked():
        config.data.batch_size = config.batch_size + 1
    with pytest.raises(ValueError, match=r"config\.data\.batch_size=\d+ differs from config\.batch_size=\d+"):
        trainer_config.parse_config(config)


def test_entry_point_bad_config_path(tmp_path):
    """`python -m prolip_jax.train` itself: one line on stderr, exit 2, no workdir."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-m", "prolip_jax.train", "--config", "configs/tinyy.py",
                          "--workdir", str(tmp_path / "w")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "configs/tinyy.py does not exist" in out.stderr and not (tmp_path / "w").exists()


_CACHE_PROBE = """
import sys, jax, jax.numpy as jnp
from prolip_jax.trainer.workdir import use_compile_cache
print(use_compile_cache(sys.argv[1]))
jax.jit(lambda x: jnp.sin(x) * 2)(jnp.ones(3)).block_until_ready()
"""


@pytest.mark.parametrize("env_dir", [False, True])
def test_compile_cache_dir(tmp_path, env_dir):
    """config.compile_cache_dir turns JAX's persistent cache on (programs land there); "" turns
    it off; JAX_COMPILATION_CACHE_DIR, when set, wins."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env.update(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    if env_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "from_env")
    for arg, expected in ((str(tmp_path / "cache"), tmp_path / ("from_env" if env_dir else "cache")),
                          ("", tmp_path / "from_env" if env_dir else None)):
        p = subprocess.run([sys.executable, "-c", _CACHE_PROBE, arg], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        assert p.stdout.strip() == str(expected)
    assert any((tmp_path / ("from_env" if env_dir else "cache")).iterdir())
    if env_dir:
        assert not (tmp_path / "cache").exists()
