"""A PyTorch train step of the same ProLIP model and loss as `prolip_jax/core/step.py`, for benchmarks.

The model is tests/torch_reference.py's `TorchProLIP` (the reference forward, module names =
the reference's state_dict keys, so `convert.flax_to_torch` weights load with strict keys); its
`nn.MultiheadAttention(need_weights=False)` runs `F.scaled_dot_product_attention`, as open_clip
calls it. One step is naver-ai/prolip's (src/prolip_train/train.py, src/prolip/loss.py
`ProLIPLoss`, naver-ai/prolip src/prolip/loss.py): the full forward, the masked forward on the masked rows (text tokens
other than the protected ids -> [MASK] with prob p, one sorted random subset of patches shared
by the sub-batch), PPCL + original-in-masked and image-in-text inclusion + VIB, backward,
`torch.optim.AdamW` (no decay for ndim < 2 or names with bn/ln/bias/logit_scale, as main.py),
then `logit_scale.clamp_(0, ln 100)`.

Same sizes and the same rows as ours: the masked rows are the first `int(G * fraction)` of every
group of G rows (prolip_jax/core/step.py; the reference takes the first n rows of the local batch,
the same cost). Two deliberate differences that only make this step cheaper, never different in
value: tr(S_v + S_t) is a broadcast sum of per-row traces (the reference materialises a
B x B x D tensor), and the |loss| > 1e5 guards are `torch.where` (the reference's Python `if`
syncs with the device).

On CUDA: bf16 autocast as the reference's `--precision amp_bf16` (`autocast=torch.bfloat16`)
and optional `torch.compile` of the forward + loss (`compile=True`).

    from torch_step import TorchTrainStep   # benchmarks/ on sys.path
    step = TorchTrainStep(model_cfg, loss_cfg, masking_cfg, optim_cfg, total_steps, device="cuda",
                          autocast=torch.bfloat16, compile=True)
    loss = step(images_nchw_float, tokens)   # one update; returns the loss tensor
"""
from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any, Mapping

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # the benchmark prints the one-line hint
    torch = None

if torch is not None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from torch_reference import TorchProLIP  # noqa: E402

TORCH_MISSING = "PyTorch is not installed: `.venv/bin/pip install torch==2.13.0` (the project's `torch` extra)"
NO_DECAY_SUBSTRINGS = ("bn", "ln", "bias", "logit_scale")  # open_clip main.py's exclusion rule


def require_torch() -> None:
    if torch is None:
        raise SystemExit(TORCH_MISSING)


def build_model(model_cfg: Any, params: Any = None) -> "TorchProLIP":
    """TorchProLIP for a prolip_jax `ProLIPConfig`; with `params` (flax tree) their weights."""
    require_torch()
    model = TorchProLIP(model_cfg.without_training_options().to_dict())
    if params is not None:
        from prolip_jax.core import convert

        sd = convert.flax_to_torch(params, model_cfg)
        model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sd.items()}, strict=True)
    return model


# ------------------------------------------------------------------------------- the loss
def ppcl_loss(im, il, tm, tl, scale, bias):
    """-sum log sigmoid(z * logits) / B, z = 2I - 1 (naver-ai/prolip src/prolip/loss.py)."""
    trace = il.exp().sum(-1)[:, None] + tl.exp().sum(-1)[None, :]
    logits = scale * (im @ tm.T - trace / 2) + bias
    labels = 2 * torch.eye(im.shape[0], tm.shape[0], device=im.device, dtype=logits.dtype) - 1
    return -F.logsigmoid(labels * logits).sum() / im.shape[0]


def _inc(mu1, l1, mu2, l2, eps):
    inv1, inv2 = torch.exp(-l1 + eps), torch.exp(-l2 + eps)
    a = inv1 + 0.5 * inv2
    b = 2 * mu1 * inv1 + mu2 * inv2
    c = mu1 ** 2 * inv1 + 0.5 * mu2 ** 2 * inv2
    return -2 * l1 - l2 - 0.5 * torch.log(a) + b ** 2 / 4 / a - c


def inclusion_loss(mu1, l1, mu2, l2, eps, scale, threshold):
    """The reference's elementwise inclusion loss as coded (naver-ai/prolip src/prolip/loss.py), mean over B x D."""
    h = _inc(mu1, l1, mu2, l2, eps) - _inc(mu2, l2, mu1, l1, eps)
    loss = -F.logsigmoid(scale * h).mean()
    return torch.where(loss.abs() > threshold, torch.zeros_like(loss), loss)


def vib_loss(mu, logvar, form, threshold):
    """naver-ai/prolip src/prolip/loss.py: 'reference' uses log sigma = logvar / 2 (the code's form), 'kl' eq. A.2."""
    x = logvar / 2 if form == "reference" else logvar
    kl = -0.5 * (1 + x - mu ** 2 - x.exp()).mean()
    return torch.where(kl > threshold, torch.zeros_like(kl), kl)


def prolip_loss(out: Mapping[str, Any], masked: Mapping[str, Any], masked_rows, cfg: Any):
    """(total, terms) with prolip_jax's `objectives.prolip.Config` weights; inputs float32."""
    im, il, tm, tl = out["image_mean"], out["image_logvar"], out["text_mean"], out["text_logvar"]
    inc = dict(eps=cfg.inclusion_eps, scale=cfg.inclusion_scale, threshold=cfg.inclusion_threshold)
    terms = {"ppcl": cfg.ppcl_weight * ppcl_loss(im, il, tm, tl, out["logit_scale"], out["logit_bias"])}
    if masked is not None:
        r = masked_rows
        terms["img_inclusion"] = cfg.alpha_masked * inclusion_loss(
            im[r], il[r], masked["image_mean"], masked["image_logvar"], **inc)
        terms["txt_inclusion"] = cfg.alpha_masked * inclusion_loss(
            tm[r], tl[r], masked["text_mean"], masked["text_logvar"], **inc)
    if cfg.alpha_image_text > 0:
        terms["inclusion"] = cfg.alpha_image_text * inclusion_loss(im, il, tm, tl, **inc)
    if cfg.vib_beta > 0:
        terms["vib"] = cfg.vib_beta * (vib_loss(im, il, cfg.vib_form, cfg.vib_threshold)
                                       + vib_loss(tm, tl, cfg.vib_form, cfg.vib_threshold))
    return sum(terms.values()), terms


def forward_and_loss(model, images, tokens, m_tokens, keep_idx, masked_rows, loss_cfg):
    """Full forward, masked forward (images of the masked rows with `keep_idx` patches,
    `m_tokens`), loss; the features are cast to float32 before the loss (under autocast the
    matmuls of the loss still run in bf16, as the reference's loss inside autocast)."""
    f32 = lambda t: t.float()  # noqa: E731

    def feats(imgs, toks, keep=None):
        im, il = model.encode_image(imgs, keep)
        tm, tl = model.encode_text(toks)
        return {"image_mean": f32(im), "image_logvar": f32(il), "text_mean": f32(tm), "text_logvar": f32(tl)}

    out = feats(images, tokens)
    masked = feats(images[masked_rows], m_tokens, keep_idx) if masked_rows is not None else None
    out.update(logit_scale=model.logit_scale.exp(), logit_bias=model.logit_bias)
    return prolip_loss(out, masked, masked_rows, loss_cfg)


# ------------------------------------------------------------------------------- the step
def warmup_cosine(base_lr: float, warmup: int, total: int, end_lr: float = 0.0):
    """The reference's `cosine_lr` (prolip_jax/core/optim.py warmup_cosine)."""
    decay = max(total - warmup, 1)

    def lr(step: int) -> float:
        if step < warmup:
            return base_lr * (step + 1) / max(warmup, 1)
        progress = min(max((step - warmup) / decay, 0.0), 1.0)
        return end_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (base_lr - end_lr)

    return lr


class TorchTrainStep:
    """One ProLIP training update per call, on `device`, float32 weights.

    model_cfg: prolip_jax ProLIPConfig; loss_cfg: objectives.prolip.Config; masking: step.MaskingConfig;
    optim: the trainer's `config.optim` mapping (lr, warmup_steps, b1, b2, eps, weight_decay, end_lr);
    autocast: None (float32) or a dtype (torch.bfloat16 on CUDA); compile: torch.compile the
    forward + loss. params: optional flax parameters to start from (else the torch init).
    """

    def __init__(self, model_cfg: Any, loss_cfg: Any, masking: Any, optim: Mapping[str, Any], total_steps: int,
                 batch: int, device: str = "cpu", autocast: Any = None, compile: bool = False, params: Any = None,
                 seed: int = 0):
        require_torch()
        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.model = build_model(model_cfg, params).to(self.device).train()
        self.loss_cfg, self.masking, self.autocast = loss_cfg, masking, autocast
        self.num_patches = model_cfg.vision.num_patches
        self.keep = int(self.num_patches * masking.image_keep_ratio)
        g = masking.group
        m = int(g * masking.fraction)
        self.masked_rows = (torch.arange(batch // g)[:, None] * g + torch.arange(m)[None]).reshape(-1).to(self.device)
        self.protected = torch.tensor(masking.protected_ids, device=self.device)
        decay, no_decay = [], []
        for name, p in self.model.named_parameters():
            (no_decay if p.ndim < 2 or any(s in name for s in NO_DECAY_SUBSTRINGS) else decay).append(p)
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": optim["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
            lr=optim["lr"], betas=(optim["b1"], optim["b2"]), eps=optim["eps"])
        self.schedule = warmup_cosine(optim["lr"], optim["warmup_steps"], total_steps, optim.get("end_lr", 0.0))
        self.step_count = 0
        self._loss = forward_and_loss
        if compile:
            self._loss = torch.compile(forward_and_loss)

    def masked_inputs(self, tokens):
        """(masked tokens [M, L], sorted kept patch indices [K]) drawn as the reference does."""
        t = tokens[self.masked_rows]
        replace = (torch.rand(t.shape, device=t.device) < self.masking.text_mask_prob) & ~torch.isin(t, self.protected)
        m_tokens = torch.where(replace, torch.full_like(t, self.masking.mask_token_id), t)
        keep_idx = torch.randperm(self.num_patches, device=t.device)[: self.keep].sort().values
        return m_tokens, keep_idx

    def __call__(self, images, tokens, m_tokens=None, keep_idx=None):
        """images float [B, 3, H, W] normalised, tokens int64 [B, L] -> loss (detached)."""
        if m_tokens is None:
            m_tokens, keep_idx = self.masked_inputs(tokens)
        for group in self.opt.param_groups:
            group["lr"] = self.schedule(self.step_count)
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None):
            loss, _ = self._loss(self.model, images, tokens, m_tokens, keep_idx, self.masked_rows, self.loss_cfg)
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(100))
        self.step_count += 1
        return loss.detach()
