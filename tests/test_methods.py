"""Methods as configs of one trainer: the typed config, match targets / MSDA, bad combinations."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prolip_jax.runtime import config_args
from prolip_jax.core import objectives, targets
from prolip_jax import train
from prolip_jax.trainer import build as trainer_build, config as trainer_config

from conftest import xla_flags

ROOT = Path(__file__).resolve().parents[1]


def methods_config(arg: str):
    spec = importlib.util.spec_from_file_location("methods", ROOT / "configs" / "methods.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, trainer_config.with_defaults(module.get_config(arg))


@pytest.mark.parametrize("method", ["prolip", "pcmepp", "pcme", "pishdad", "pcme_daa", "smooth_ap", "clip",
                                    "siglip", "vse"])
def test_every_method_config_parses_and_selects_its_objective(method):
    module, config = methods_config(f"method={method},smoke=1")
    tc = trainer_config.parse_config(config)
    scfg = trainer_build.step_config(tc)
    assert scfg.objective == module.METHODS[method][0]
    assert type(scfg.loss) is objectives.get(scfg.objective).Config
    # ProLIP's masked forward runs only for the objective that uses it.
    assert bool(scfg.masked_group_rows) == (scfg.objective == "prolip")
    mcfg = trainer_build.model_config(tc)
    overrides = module.METHODS[method][2]
    for key in ("init_logit_scale", "init_logit_bias"):
        if key in overrides:
            assert getattr(mcfg, key) == pytest.approx(overrides[key])
    # PCME++ and Pishdad et al. train their own uncertainty heads, the rest ProLIP's [UNC].
    head = {"pcmepp": "block", "pishdad": "embedding"}.get(method, "unc_token")
    assert (mcfg.vision.unc_head, mcfg.text.unc_head) == (head, head)
    if method == "pcmepp":
        assert mcfg.text.size_augment_mask_id == config.masking.mask_token_id


def test_unknown_objective_and_knob_are_one_line_errors():
    _, config = methods_config("method=pcmepp")
    with config.unlocked():
        config.loss.pp_alhpa = 0.2
    with pytest.raises(ValueError, match=r"pp_alhpa.*did you mean 'pp_alpha'"):
        trainer_config.parse_config(config)
    _, config = methods_config("method=pcmepp")
    config.loss.objective = "pcmepp2"
    with pytest.raises(ValueError, match="not a registered objective"):
        trainer_config.parse_config(config)
    _, config = methods_config("method=pcmepp")
    config.loss.distance = "cosine"
    with pytest.raises(ValueError, match=r"config.loss.*distance='cosine' is not one of"):
        trainer_config.parse_config(config)


def validate(config, mesh):
    tc = trainer_config.parse_config(config)
    trainer_build.validate(tc, mesh, trainer_build.model_config(tc))


def test_bad_combinations_stop_before_compiling():
    from prolip_jax.core import sharding

    mesh = sharding.make_mesh((-1, 1, 1), ("data", "fsdp", "tensor"))
    _, config = methods_config("method=vse")
    config.targets.mix_fraction = 0.25  # MSDA's soft labels cannot enter a triplet loss
    with pytest.raises(ValueError, match="MSDA.*'vse' cannot take"):
        validate(config, mesh)
    _, config = methods_config("method=pcme")
    config.model.vision = {"embed_unc": False}  # a mu-only image tower: no sigma^2 to sample
    config.model.text = {"embed_unc": False, "pool": "last"}
    with pytest.raises(ValueError, match="needs log sigma"):
        validate(config, mesh)
    _, config = methods_config("method=prolip,positives=same_caption")
    config.loss.ppcl_impl = "ring"
    with pytest.raises(ValueError, match="ring"):
        validate(config, mesh)


def test_positive_matrix_marks_identical_captions_and_image_ids():
    tokens = jnp.array([[5, 6, 1], [7, 1, 1], [5, 6, 1], [8, 9, 1]])
    ids = jnp.array([0, 1, 2, 1])
    same = np.asarray(targets.positive_matrix(tokens, ids, "same_caption"))
    expected = np.eye(4)
    expected[0, 2] = expected[2, 0] = 1  # rows 0 and 2 carry the same caption
    np.testing.assert_array_equal(same, expected)
    by_id = np.asarray(targets.positive_matrix(tokens, ids, "image_id"))
    expected = np.eye(4)
    expected[1, 3] = expected[3, 1] = 1
    np.testing.assert_array_equal(by_id, expected)
    with pytest.raises(ValueError, match="image_id"):
        targets.positive_matrix(tokens, None, "image_id")


def test_cutmix_box_and_lambda_as_timm_rand_bbox():
    # lam 0.75 on 8 x 8: sides int(8 * 0.5) = 4, centre (2, 7): rows 0..3, cols 5..7 (clipped at 8).
    box, lam = targets.cutmix_box(jnp.array([0.75]), jnp.array([2]), jnp.array([7]), 8, 8)
    expected = np.zeros((8, 8), bool)
    expected[0:4, 5:8] = True
    np.testing.assert_array_equal(np.asarray(box[0]), expected)
    assert float(lam[0]) == pytest.approx(1 - 12 / 64)


def test_mix_gives_soft_targets_from_the_reversed_partner():
    cfg = targets.TargetsConfig(mix_fraction=1.0, cutmix_prob=0.0)  # every image: Mixup
    images = jnp.arange(4, dtype=jnp.float32)[:, None, None, None] * jnp.ones((4, 2, 2, 1))
    mixed, soft, lam = targets.mix(jax.random.key(0), images, jnp.eye(4), cfg)
    lam = np.asarray(lam, np.float64)
    for i in range(4):
        np.testing.assert_allclose(np.asarray(mixed[i]), lam[i] * i + (1 - lam[i]) * (3 - i), rtol=1e-6)
        row = np.zeros(4)
        row[i] += lam[i]
        row[3 - i] += 1 - lam[i]
        np.testing.assert_allclose(np.asarray(soft[i]), row, rtol=1e-6, atol=1e-7)
    unmixed = targets.mix(jax.random.key(0), images, jnp.eye(4), targets.TargetsConfig(mix_fraction=0.0))
    np.testing.assert_array_equal(np.asarray(unmixed[0]), np.asarray(images))
    np.testing.assert_array_equal(np.asarray(unmixed[1]), np.eye(4))


def test_pcmepp_with_msda_and_shared_captions_trains_in_the_trainer(tmp_path):
    """One real run of the trainer with another objective: PCME++ with MSDA and same-caption
    positives on random data: finite, its terms logged, no masked forward. In its own process on
    one CPU device: with the suite's 8 fake devices, XLA:CPU can run this step's independent
    collectives (MSDA's reversed batch, a collective-permute, and an all-reduce) in different
    orders on different devices, and they wait on each other forever (docs/performance.md,
    "The test suite")."""
    argv = ["--config", f"{ROOT / 'configs' / 'methods.py'}:method=pcmepp,steps=3,positives=same_caption",
            "--workdir", str(tmp_path / "w"), "--config.model.variant=micro", "--config.data.source=random",
            "--config.data.image_size=16", "--config.batch_size=16", "--config.log_steps=1", "--config.evals={}",
            "--config.optim.warmup_steps=1", "--config.compile_cache_dir="]
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(1)}
    proc = subprocess.run([sys.executable, "-m", "prolip_jax.train", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    metrics = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()][-1]
    assert np.isfinite(metrics["loss"]) and metrics["skipped_updates"] == 0
    assert {"loss/match", "loss/pseudo_match", "loss/vib"} <= set(metrics)
    assert not any(k.endswith("inclusion") for k in metrics)


def test_tower_overrides_keep_fixed_length_tuples():
    """A `config.model.text` override re-parses the variant's TextConfig: its tokenizer_kwargs
    (tuple[tuple[str, Any], ...]) must come back as values, not as their types (the checkpoint's
    config.json is written from them)."""
    import json

    c = trainer_config.with_defaults(config_args.load_config_file("configs/methods.py:method=pcmepp"))
    mcfg = trainer_build.model_config(trainer_config.parse_config(c))
    assert mcfg.text.tokenizer_kwargs == (("clean", "canonicalize"),)
    json.dumps(mcfg.to_dict())
