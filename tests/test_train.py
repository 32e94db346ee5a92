"""The trainer end to end on CPU: resume, restore onto another mesh, metrics, bad configs.

One real run of `configs/tiny.py` with the micro model on a small generated demo dataset
(the real grain ArrayRecord pipeline, so the data position is checkpointed too).
"""
from __future__ import annotations

import json
from unittest import mock

import flax.linen as nn
import jax
import numpy as np
import pytest

from prolip_jax.core import checkpoint
from prolip_jax import train
from prolip_jax.trainer import build as trainer_build, config as trainer_config
from prolip_jax.runtime.metrics import read_jsonl
from prolip_jax.core.models import ProLIP
from input_pipeline import tokenizer_files

N = 3  # steps before the interruption


def tiny_config(tmp_path, **overrides):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("tiny", Path(__file__).parents[1] / "configs" / "tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # The micro towers (16 px, patch 8, context 8, vocab 64: the demo vocab fits), batch 16: 2
    # rows per data shard on 8 devices, one of them masked.
    c = module.get_config(f"steps={2 * N},size=micro")
    c.data.demo = dict(image_size=16, num_train=200, num_zeroshot=36, num_retrieval=20, num_levels=10,
                       cache_dir=str(tmp_path / "demo_cache"))
    c.log_steps = 1
    c.checkpoint_steps = 100
    for key, value in overrides.items():
        target = c
        *parents, leaf = key.split(".")
        for p in parents:
            target = target[p]
        target[leaf] = value
    return c


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Straight 2N steps, and N steps interrupted then resumed for N (same mesh)."""
    tmp = tmp_path_factory.mktemp("train")
    cfg = tiny_config(tmp)
    # In-training evaluation (big_vision style), every 3 steps.
    cfg.evals.zs = dict(type="zeroshot", log_steps=3, prefix="eval/", dataset="demo", task="object",
                        demo=dict(cfg.data.demo), name="object")
    # The best step by top-1 (any metric works; the reference's --save-best-unc is unc_corr_csd, "min").
    cfg.keep_best = dict(metric="eval/zeroshot/object/top1_csd", mode="max", baseline=-1.0)
    straight = train.train(cfg, str(tmp / "straight"))
    inits = []  # how often each run traces model.init (the shapes, shardings and draws share one trace)
    with mock.patch.object(ProLIP, "init", autospec=True, side_effect=lambda *a, **k: inits.append(1) or
                           nn.Module.init(*a, **k)):
        interrupted = train.train(tiny_config(tmp), str(tmp / "resumed"), stop_at_step=N)
        interrupted["model.init traces"], inits[:] = len(inits), []
        resumed = train.train(tiny_config(tmp), str(tmp / "resumed"))
        resumed["model.init traces"] = len(inits)
    return tmp, straight, interrupted, resumed


def _params(workdir):
    params, _, step = checkpoint.load_params(workdir / "checkpoints")
    return jax.device_get(params), step


def test_resume_gives_identical_parameters_and_batches(runs):
    tmp, straight, interrupted, resumed = runs
    assert interrupted["data/batches"] == N
    a, step_a = _params(tmp / "straight")
    b, step_b = _params(tmp / "resumed")
    assert step_a == step_b == 2 * N
    jax.tree.map(np.testing.assert_array_equal, a, b)  # bit-identical
    # The same batches were seen: same data position, and the loss of every step matches.
    assert resumed["data/batches"] == straight["data/batches"] == 2 * N
    la = {r["step"]: r["loss"] for r in read_jsonl(str(tmp / "straight" / "metrics.jsonl"))}
    lb = {r["step"]: r["loss"] for r in read_jsonl(str(tmp / "resumed" / "metrics.jsonl"))}
    assert sorted(lb) == list(range(1, 2 * N + 1))  # each step logged once across the restart
    assert la == lb
    # A fresh start and a restore each trace model.init once (step.trace_params).
    assert interrupted["model.init traces"] == resumed["model.init traces"] == 1


def test_metrics_contents(runs):
    tmp, straight, *_ = runs
    rows = read_jsonl(str(tmp / "straight" / "metrics.jsonl"))
    for key in ("loss", "loss/ppcl", "loss/img_inclusion", "loss/txt_inclusion", "loss/inclusion", "loss/vib",
                "a", "b", "sigma2_trace/image", "sigma2_trace/text", "lr", "grad_norm", "step_time_s", "samples_per_s",
                "samples_per_s_per_device", "tflops_per_device", "skipped_updates", "data/skipped"):
        assert key in rows[-1], key
    assert rows[0]["lr"] == pytest.approx(1e-3 / 20)  # warm-up: lr * (0 + 1) / 20
    evals = {r["step"]: v for r in rows for k, v in r.items() if k.startswith("eval/zeroshot/") and k.endswith("/top1_csd")}
    assert sorted(evals) == [3, 6] and all(0.0 <= v <= 100.0 for v in evals.values())  # percent (docs/metrics.md)
    assert any((tmp / "straight" / "tb").iterdir())
    assert all(np.isfinite(r["loss"]) for r in rows)


def test_best_checkpoint_by_a_metric(runs):
    tmp, *_ = runs
    top1 = {r["step"]: r["eval/zeroshot/object/top1_csd"] for r in read_jsonl(str(tmp / "straight" / "metrics.jsonl"))
            if "eval/zeroshot/object/top1_csd" in r}
    best_step = 3 if top1[3] >= top1[6] else 6  # the first of equal values is kept (strictly better only)
    params, meta, step = checkpoint.load_params(tmp / "straight" / "best")
    # One step kept (max_to_keep=1), beside the tokenizer file its config records.
    assert step == best_step and sorted(p.name for p in (tmp / "straight" / "best").iterdir()
                                        if not p.name.startswith("tokenizer-")) == [str(best_step)]
    assert tokenizer_files.from_checkpoint(tmp / "straight" / "best").mask_id == 2  # the demo's, recorded
    _, meta, _ = checkpoint.load_config(tmp / "straight" / "best")
    assert meta["best"] == {"metric": "eval/zeroshot/object/top1_csd", "value": pytest.approx(top1[best_step]),
                            "step": best_step}
    if best_step == 6:  # the last step's params are the final checkpoint's
        jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), _params(tmp / "straight")[0])


def test_keep_best_of_a_metric_nobody_logs_is_an_error(tmp_path):
    cfg = tiny_config(tmp_path, **{"data.source": "random", "total_steps": 2})
    cfg.keep_best = dict(metric="eval/zeroshot/imagenet/unc_corr_csd", mode="min", baseline=0.0)
    with pytest.raises(ValueError, match=r"keep_best.metric='eval/zeroshot/imagenet/unc_corr_csd' is not a "
                                         r"logged metric \(set --config\.keep_best\.metric\); the \d+ logged: a, b, "
                                         r".*, and \d+ more$"):
        train.train(cfg, str(tmp_path / "w"))


def test_checkpoint_loads_as_a_model(runs):
    import prolip_jax

    tmp, *_ = runs
    model = prolip_jax.load(tmp / "straight" / "checkpoints")
    mu, logvar = model.encode_text(np.ones((2, 8), np.int32))
    assert mu.shape == (2, 32) and np.all(np.isfinite(logvar))


def test_a_checkpoint_of_the_trainer_before_it_became_a_package_resumes(runs, tmp_path, monkeypatch):
    """A step-3 checkpoint of the same run written by the trainer before prolip_jax/trainer/
    (tests/data/checkpoint_step3_trainer_before_parts.README.md) resumes to the step today's
    uninterrupted run reaches: the same parameters (bit-identical when the fixture was written;
    the tolerance leaves room for a later change of rounding in the fixture's three steps) and
    the same data position."""
    import tarfile
    from pathlib import Path

    tmp, straight, *_ = runs
    with tarfile.open(Path(__file__).parent / "data" / "checkpoint_step3_trainer_before_parts.tar.gz") as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}   # Python >= 3.11.4
        tar.extractall(tmp_path / "w" / "checkpoints", **safe)
    monkeypatch.chdir(tmp_path)   # the fixture's run read its demo data from ./demo_cache
    cfg = tiny_config(tmp)
    cfg.data.demo.cache_dir = "demo_cache"
    resumed = train.train(cfg, str(tmp_path / "w"))
    assert resumed["data/batches"] == straight["data/batches"] == 2 * N
    a, step_a = _params(tmp_path / "w")
    b, _ = _params(tmp / "straight")
    assert step_a == 2 * N
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert np.abs(x - y).max() <= 1e-5 * max(np.abs(y).max(), 1e-12), jax.tree_util.keystr(path)
    assert resumed["loss"] == pytest.approx(straight["loss"], rel=1e-5)


def test_restore_onto_another_mesh(runs, tmp_path):
    """The 8-way data-parallel checkpoint resumes on an FSDP x data mesh and keeps training;
    a half-written later save (as a killed process leaves it) does not hide it."""
    tmp, *_ = runs
    import shutil

    shutil.copytree(tmp / "straight", tmp_path / "w")
    killed = tmp_path / "w" / "checkpoints" / f"{2 * N + 5}.orbax-checkpoint-tmp-1234567"
    (killed / "params").mkdir(parents=True)
    (killed / "params" / "partial").write_bytes(b"\0" * 100)
    assert checkpoint.resolve(tmp_path / "w" / "checkpoints")[1] == 2 * N
    cfg = tiny_config(tmp, **{"total_steps": 2 * N + 1, "sharding_rules": "fsdp"})
    cfg.mesh.shape = (2, 4, 1)
    out = train.train(cfg, str(tmp_path / "w"))
    assert np.isfinite(out["loss"])
    _, step = _params(tmp_path / "w")
    assert step == 2 * N + 1


def test_bad_configs_fail_before_compiling(tmp_path):
    with pytest.raises(ValueError, match="not divisible by the 8 data shards"):
        train.train(tiny_config(tmp_path, batch_size=12), str(tmp_path / "a"))
    with pytest.raises(ValueError, match="multiple of masking.group"):
        train.train(tiny_config(tmp_path, **{"masking.group": 8}), str(tmp_path / "a"))
    with pytest.raises(ValueError, match="needs data.path"):
        train.train(tiny_config(tmp_path, **{"data.source": "array_record"}), str(tmp_path / "b"))
    with pytest.raises(ValueError, match="data.image_size=32 but the model expects 16"):
        train.train(tiny_config(tmp_path, **{"data.image_size": 32}), str(tmp_path / "c"))
    with pytest.raises(FileNotFoundError):
        train.train(tiny_config(tmp_path, **{"model.config_json": str(tmp_path / "none.json")}), str(tmp_path / "d"))
    cfg = tiny_config(tmp_path)
    cfg.optim.bogus = 1
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bogus'\] in config.optim"):
        train.train(cfg, str(tmp_path / "e"))
    cfg = tiny_config(tmp_path, **{"data.bogus": 1})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \[.bogus.\] in config.data"):
        train.train(cfg, str(tmp_path / "f"))


def test_model_embed_dim_override(tmp_path):
    """config.model.embed_dim replaces the variant's joint embedding size (PCME++'s 1024-d on
    CLIP's trunks); 0 keeps it; a negative size or one the towers cannot take is an error."""
    base = trainer_build.model_config(trainer_config.parse_config(tiny_config(tmp_path)))
    assert trainer_build.model_config(trainer_config.parse_config(tiny_config(tmp_path, **{"model.embed_dim": 0}))) == base
    heads = {"model.vision": {"unc_head": "block", "pool": "gpo"},
             "model.text": {"unc_head": "block", "pool": "gpo", "pad_id": 0}}
    wide = trainer_build.model_config(trainer_config.parse_config(tiny_config(tmp_path, **heads, **{"model.embed_dim": 2 * base.embed_dim})))
    assert wide.embed_dim == 2 * base.embed_dim and wide.vision.width == base.vision.width
    with pytest.raises(ValueError, match="config.model.embed_dim=-1 must be > 0"):
        trainer_build.model_config(trainer_config.parse_config(tiny_config(tmp_path, **{"model.embed_dim": -1})))
    with pytest.raises(ValueError, match="text width .* must equal embed_dim"):   # ProLIP's text head
        trainer_build.model_config(trainer_config.parse_config(tiny_config(tmp_path, **{"model.embed_dim": 2 * base.embed_dim})))


def test_nonfinite_run_stops_with_last_good_checkpoint(tmp_path):
    """Adam's eps = 0 makes every update non-finite from finite gradients (0/0 on the token rows
    no caption uses): each step is skipped, K in a row stop the run, the message names the
    flagged steps and a checkpoint that is good, and no checkpoint holds a non-finite value.
    (The next test's program: the stopping rule and the checkpoint interval are not compiled in.)"""
    cfg = tiny_config(tmp_path, **{"data.source": "random", "max_nonfinite_in_a_row": 2, "total_steps": 10,
                                   "checkpoint_steps": 1})
    cfg.optim.eps = 0.0
    with pytest.raises(FloatingPointError, match=r"steps 1-2 \(2 in a row\) had a non-finite loss, gradient "
                       r"or update.* The last good checkpoint is step 2 in"):
        train.train(cfg, str(tmp_path / "nan"))
    saved = sorted(int(p.name) for p in (tmp_path / "nan" / "checkpoints").glob("[0-9]*"))
    assert saved == [1, 2]
    for step in saved:
        params, _, _ = checkpoint.load_params(tmp_path / "nan" / "checkpoints", step)
        assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(jax.device_get(params)))
    rows = [json.loads(line) for line in (tmp_path / "nan" / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite"] for r in rows] == [1, 1] and rows[-1]["skipped_updates"] == 2


def test_nonfinite_from_the_first_step_says_no_checkpoint(tmp_path):
    cfg = tiny_config(tmp_path, **{"data.source": "random", "max_nonfinite_in_a_row": 1, "total_steps": 10})
    cfg.optim.eps = 0.0  # Adam's 0/0 on the token rows no caption uses
    with pytest.raises(FloatingPointError, match=r"steps 1-1 .* No checkpoint was written"):
        train.train(cfg, str(tmp_path / "eps0"))


def test_tokenizer_larger_than_the_model_is_refused_before_compiling(tmp_path):
    """Token ids past the embedding table NaN every step; refused up front, naming both sizes."""
    from prolip_jax.core.models import get_config

    small = get_config("micro").to_dict()
    small["text_cfg"]["vocab_size"] = 16
    (tmp_path / "model.json").write_text(json.dumps(small))
    cfg = tiny_config(tmp_path, **{"model.config_json": str(tmp_path / "model.json")})
    with pytest.raises(ValueError, match=r"the tokenizer has \d+ tokens but the model's text embedding has 16 rows"):
        train.train(cfg, str(tmp_path / "vocab"))
    assert not (tmp_path / "vocab").exists()


def test_eval_at_start_logs_the_starting_parameters_once(tmp_path):
    """config.eval_at_start: a fresh run evaluates before its first update and logs step 0; the
    run resumed later does not evaluate its starting point again."""
    def config():
        cfg = tiny_config(tmp_path, total_steps=2, eval_at_start=True)
        cfg.evals.zs = dict(type="zeroshot", log_steps=100, prefix="eval/", dataset="demo", task="object",
                            demo=dict(cfg.data.demo), name="object")
        return cfg

    train.train(config(), str(tmp_path / "run"), stop_at_step=1)
    train.train(config(), str(tmp_path / "run"))
    rows = read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
    evaluated = [r["step"] for r in rows if "eval/zeroshot/object/top1_csd" in r]
    assert evaluated == [0, 2]  # the starting parameters, then the end of the run (total_steps)
    assert "loss" not in rows[0] and rows[1]["step"] == 1 and "loss" in rows[1]
