"""Fine-tuning end to end: the `tiny` ProLIP warm-started from an imported tiny OpenAI-style
CLIP (open_clip's file layout) with the image tower locked, then resumed with nothing locked."""
from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from prolip_jax.core import checkpoint
from prolip_jax.core import convert
from prolip_jax import train
from prolip_jax.trainer import build as trainer_build, config as trainer_config
from prolip_jax.runtime.metrics import read_jsonl
from prolip_jax.core.models import init_params
from prolip_jax.core.pretrained import warm_start
from prolip_jax.core.pretrained.openclip import config_from_open_clip
from test_train import tiny_config

ROOT = Path(__file__).resolve().parents[1]

# open_clip's model_cfg of a CLIP with the `tiny` ProLIP's sizes (open_clip_config.json).
CLIP_CFG = {"embed_dim": 64, "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "patch_size": 8,
                                            "head_width": 32},
            "text_cfg": {"context_length": 16, "vocab_size": 1000, "width": 64, "heads": 2, "layers": 2}}


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        out.update(_flat(v, f"{prefix}{k}/") if isinstance(v, dict) else {f"{prefix}{k}": np.asarray(v)})
    return out


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    """A random tiny CLIP written as open_clip writes it: open_clip_model.safetensors + config."""
    d = tmp_path_factory.mktemp("clip")
    cfg = config_from_open_clip(CLIP_CFG)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), init_params(cfg, jax.random.key(7)))
    # OpenAI CLIP has no logit_bias: the warm start must restart a and b (the reference's rule).
    state_dict = convert.unapply_rules(params, convert.conversion_rules(cfg, "open_clip", logit_bias=False))
    save_file({k: np.array(v, order="C") for k, v in state_dict.items()}, str(d / "open_clip_model.safetensors"))
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": CLIP_CFG}))
    return d, _flat(params)


def _finetune_config(tmp_path, source_dir, **overrides):
    """The `tiny` ProLIP warm-started from `source_dir`, its image tower locked, 16 steps."""
    cfg = trainer_config.with_defaults(tiny_config(tmp_path, **{
        "model.variant": "tiny", "data.image_size": 32, "total_steps": 16, "optim.warmup_steps": 2, **overrides}))
    cfg.init.path, cfg.optim.locked = str(source_dir), ("^visual/",)
    cfg.data.demo = dict(cfg.data.demo, image_size=32, num_train=400)
    return cfg


def test_finetune_from_clip_with_the_image_tower_locked(tmp_path, clip_dir):
    source_dir, source = clip_dir
    cfg = _finetune_config(tmp_path, source_dir)
    train.train(cfg, str(tmp_path / "ft"))
    ckpts = tmp_path / "ft" / "checkpoints"

    table = (tmp_path / "ft" / "warm_start.txt").read_text()
    kinds = {r["name"]: r["kind"] for r in json.loads((tmp_path / "ft" / "warm_start.json").read_text())["params"]}
    assert kinds["visual/transformer/resblocks_0/attn/query_kernel"] == "loaded" and "loaded" in table
    assert kinds["visual/unc_embedding"] == "new" and kinds["text/positional_embedding"] == "resized"

    # What the trainer started from: the warm start of its fresh init (same seed, same values).
    mcfg = trainer_build.model_config(trainer_config.parse_config(cfg))
    start, _ = warm_start.init_from_config(cfg.init, mcfg, jax.device_get(init_params(mcfg, jax.random.key(cfg.seed))))
    start = _flat(start)
    last, _, step = checkpoint.load_params(ckpts)
    last = _flat(jax.device_get(last))
    assert step == 16
    np.testing.assert_array_equal(start["visual/transformer/resblocks_1/c_fc/kernel"],
                                  source["visual/transformer/resblocks_1/c_fc/kernel"])
    for name in start:  # the locked image tower is bit-identical to the warm start
        if name.startswith("visual/"):
            np.testing.assert_array_equal(last[name], start[name], err_msg=name)
    moved = [n for n in start if n.startswith("text/") and not np.array_equal(last[n], start[n])]
    assert "text/text_uncertainty_projection/kernel" in moved and "text/transformer/resblocks_0/c_fc/kernel" in moved
    _, meta, _ = checkpoint.load_config(ckpts, 16)
    assert "visual/patch_kernel" in meta["locked"] and not any(p.startswith("text/") for p in meta["locked"])

    losses = [r["loss"] for r in read_jsonl(tmp_path / "ft" / "metrics.jsonl")]
    assert np.mean(losses[-4:]) < np.mean(losses[:4]) - 0.1, losses

    # Resume under other controls (nothing locked): restored through the saved optimiser layout,
    # the image tower now trains, and the import is not repeated.
    (tmp_path / "ft" / "warm_start.txt").unlink()
    cfg.total_steps, cfg.optim.locked = 18, ()
    train.train(cfg, str(tmp_path / "ft"))
    resumed, _, _ = checkpoint.load_params(ckpts)
    resumed = _flat(jax.device_get(resumed))
    assert not np.array_equal(resumed["visual/transformer/resblocks_1/c_fc/kernel"],
                              last["visual/transformer/resblocks_1/c_fc/kernel"])
    assert not (tmp_path / "ft" / "warm_start.txt").exists()


def test_a_warm_start_that_imports_a_nan_is_never_saved(tmp_path, clip_dir):
    """The state's finiteness is checked once when it did not come from a random init (train.py
    `save`): a NaN in the imported weights stops the run at its first save, with nothing saved."""
    source_dir, _ = clip_dir
    bad = tmp_path / "bad_clip"
    bad.mkdir()
    weights = load_file(str(source_dir / "open_clip_model.safetensors"))
    name = next(k for k in sorted(weights) if k.startswith("transformer.") and k.endswith("mlp.c_fc.weight"))
    weights[name][0, 0] = np.nan  # a text-tower weight, so the image tower locked below stays clean
    save_file(weights, str(bad / "open_clip_model.safetensors"))
    (bad / "open_clip_config.json").write_text((source_dir / "open_clip_config.json").read_text())
    cfg = _finetune_config(tmp_path, bad, checkpoint_steps=1)
    with pytest.raises(FloatingPointError, match="the train state at step 1 is not finite; not saving it"):
        train.train(cfg, str(tmp_path / "ft"))
    assert not list((tmp_path / "ft" / "checkpoints").glob("[0-9]*"))


@pytest.mark.parametrize("recipe, source_arch", [
    ("siglip_l16", "ViT-L-16-SigLIP-256"), ("siglip_so400m", "ViT-SO400M-14-SigLIP"),
    ("dfn_h14", "ViT-H-14-quickgelu"), ("long", "B/16"), ("own_data", "B/16")])
def test_recipes_fit_their_sources(recipe, source_arch):
    """Each recipe of configs/finetune.py is a valid trainer config whose model can be warm-started
    from its source's architecture (shapes only: nothing is downloaded)."""
    from prolip_jax.runtime import config_args
    from prolip_jax.core.models import abstract_params, get_config
    from prolip_jax.core.pretrained import warm_start
    from prolip_jax.core.pretrained.openclip import arch_config

    cfg = trainer_config.with_defaults(config_args.load_config_file(f"{ROOT}/configs/finetune.py:recipe={recipe}"))
    target = trainer_build.model_config(trainer_config.parse_config(cfg))
    assert cfg.data.tokenizer.context_length == target.text.context_length
    assert cfg.data.image_size == target.vision.image_size
    source = get_config(source_arch) if "/" in source_arch else config_from_open_clip(arch_config(source_arch))
    warm_start.check_fit(target, abstract_params(target), source, abstract_params(source), cfg.init.text_pos_keep)
