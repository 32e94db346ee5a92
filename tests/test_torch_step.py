"""benchmarks/torch_step.py, the PyTorch step that benchmarks/benchmark_cpu_step.py times beside ours:
from the same weights, batch, masked tokens and kept patches it gives our step's loss, gradient
norm and updated parameters (float32). Skipped when torch is absent (`pip install torch==2.13.0`).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import jax  # noqa: E402

from prolip_jax.core import convert  # noqa: E402
from prolip_jax.core import optim, sharding
from prolip_jax.core import step as S  # noqa: E402
from prolip_jax.core.models import ProLIP, get_config  # noqa: E402
from prolip_jax.core.models.prolip import mask_text_tokens, random_keep_indices  # noqa: E402
from prolip_jax.core.objectives import prolip as prolip_objective  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from torch_step import TorchTrainStep  # noqa: E402  (benchmarks/torch_step.py)

B = 32
CFG = S.StepConfig(masking=S.MaskingConfig(fraction=0.5, group=4, mask_token_id=63),
                   loss=prolip_objective.Config(alpha_image_text=1e-3))
OPTIM = dict(lr=1e-3, warmup_steps=2, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.2, end_lr=0.0)


def test_torch_step_matches_ours():
    cfg = get_config("micro")
    model = ProLIP(cfg, attention_impl="xla")
    tx, schedule = optim.make_optimizer(optim.OptimConfig.of(OPTIM), 10)
    mesh = sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1])
    state, _ = S.create_train_state(model, tx, mesh, "replicated", seed=0)
    params0 = jax.device_get(state.params)
    rng = np.random.default_rng(0)
    images = rng.normal(size=(B, 16, 16, 3)).astype(np.float32)
    tokens = rng.integers(2, 64, size=(B, 8)).astype(np.int32)
    tokens[:, 5:] = 1
    new_state, metrics = jax.jit(S.make_train_step(model, tx, schedule, CFG, mesh, B))(
        state, sharding.global_batch({"image": images, "text": tokens}, mesh))

    # The masked inputs our step draws at step 0 (prolip_jax/core/step.py train_step).
    mk = CFG.masking
    rng_img, rng_txt, _, _ = jax.random.split(jax.random.fold_in(jax.random.key(CFG.seed), 0), 4)
    m_tokens = mask_text_tokens(rng_txt, S.group_rows(tokens, mk.group, CFG.masked_group_rows), mk.mask_token_id,
                                mk.text_mask_prob, mk.protected_ids)
    keep_idx = random_keep_indices(rng_img, cfg.vision.num_patches, mk.image_keep_ratio)

    theirs = TorchTrainStep(cfg, CFG.loss_config, mk, OPTIM, 10, B, params=params0)
    loss = theirs(torch.from_numpy(images.transpose(0, 3, 1, 2).copy()), torch.from_numpy(tokens).long(),
                  torch.from_numpy(np.array(m_tokens)).long(), torch.from_numpy(np.array(keep_idx)).long())
    assert abs(float(loss) - float(metrics["loss"])) <= 1e-5 * abs(float(metrics["loss"]))
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in theirs.model.parameters()))
    assert abs(float(grad_norm) - float(metrics["grad_norm"])) <= 1e-4 * float(metrics["grad_norm"])

    ours = convert.flax_to_torch(jax.device_get(new_state.params), cfg)
    d = cfg.vision.width
    for name, t in theirs.model.state_dict().items():
        got, want = t.numpy(), ours[name]
        if name.endswith("in_proj_bias"):
            # Softmax ignores the key bias: its gradient is rounding noise that Adam's first step
            # scales to +-lr (tests/test_step.py), so only the query and value biases are compared.
            got, want = np.delete(got, np.s_[d:2 * d]), np.delete(want, np.s_[d:2 * d])
        err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-12))
        assert err <= 1e-5, (name, err)
