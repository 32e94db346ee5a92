r"""Every objective of the family trained on a small synthetic set in seconds: does it learn, and
where do its σ² go on inputs built to be ambiguous?

    python benchmarks/methods_synthetic.py                       # every registered objective
    python benchmarks/methods_synthetic.py --objectives prolip pcmepp --steps 600 --seeds 0 1 2
    python benchmarks/methods_synthetic.py --objectives pcme_daa vse_daa smooth_ap --steps 150 --batch 32

The data (`make_batch`): 16 classes, 4 colours x 4 patterns (flat, horizontal stripes, vertical
stripes, checks) filling a 16 px image with pixel noise; the caption is [colour, pattern].
Two kinds of ambiguous inputs are mixed into training, 10% of the batch each:
  * blank images (grey noise, no colour or pattern) paired with a random class's caption: an
    image that cannot say which caption is its own;
  * colour-only captions [colour] paired with an image of that colour: a caption true of four
    classes (the multiplicity of the ProLIP paper §1, PCME++'s ambiguity, §1).
The probabilistic papers expect these to get larger σ² than the clear ones.

Each objective trains the `micro` towers (16 px, patch 8, width 32, one block per tower, ProLIP's
[UNC] head for every objective, deterministic ones ignore it) with the real train step
(prolip_jax/core/step.py), AdamW, batch 64, one CPU device; the knobs and a / b initialisations of
configs/methods.py (the paper's) where it lists the objective; the hardest-negative triplets
(`vse`, `vse_daa`, `pishdad`) with VSE∞'s sum warm-up for the first third. Reported on 256 held-out images:
zero-shot top-1 over the 16 class captions and text->image R@1 (chance 6.25% both), ranked by
the μ dot product so every objective is scored alike; the mean σ² of blank vs clear images and
of colour-only vs full captions, after training and, in brackets, at initialisation (the
untrained head already tells the inputs apart a little: σ² responded to ambiguity where
training moved the ratio above its initial value).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from prolip_jax.core.normalization import normalize_on_device  # noqa: E402
from prolip_jax.core import objectives, optim, sharding  # noqa: E402
from prolip_jax.core import step as step_lib  # noqa: E402
from prolip_jax.core.models import ProLIP, get_config  # noqa: E402

PAD = 1  # = EOS, as in the SigLIP vocabulary
MASK = 63  # the micro vocabulary's last id stands for [MASK]
COLOUR_TOKENS, PATTERN_TOKENS = 10, 20
COLOURS = np.array([[230, 40, 40], [40, 200, 40], [40, 60, 230], [230, 210, 30]], np.float32)
BATCH = 64
OPTIM = dict(lr=3e-3, warmup_steps=20, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.1)


def _patterns() -> np.ndarray:
    yy, xx = np.mgrid[:16, :16]
    stripes = [np.ones((16, 16)), (yy // 2) % 2, (xx // 2) % 2, (yy // 2 + xx // 2) % 2]
    return 0.4 + 0.6 * np.stack(stripes).astype(np.float32)  # [4, 16, 16] brightness


def make_batch(rng: np.random.Generator, n: int, blank_frac: float = 0.0, general_frac: float = 0.0):
    """(uint8 images [n,16,16,3], tokens [n,8], class [n], blank [n], colour-only [n])."""
    cls = rng.integers(0, 16, n)
    colour, pattern = cls // 4, cls % 4
    images = COLOURS[colour][:, None, None, :] * _patterns()[pattern][..., None] + rng.normal(0, 15, (n, 16, 16, 3))
    blank = rng.random(n) < blank_frac
    images[blank] = 128 + rng.normal(0, 15, (int(blank.sum()), 16, 16, 3))
    tokens = np.full((n, 8), PAD, np.int32)
    tokens[:, 0] = COLOUR_TOKENS + colour
    tokens[:, 1] = PATTERN_TOKENS + pattern
    general = (rng.random(n) < general_frac) & ~blank
    tokens[general, 1] = PAD
    return np.clip(images, 0, 255).astype(np.uint8), tokens, cls, blank, general


# Hardest-negative triplets from random towers collapse to one point (every image's hardest
# caption is the same one: 5-7% here without a warm-up); VSE∞ starts with the sum over negatives
# for that reason (loss.sum_warmup_steps). Here a third of the run, as its one warm-up epoch, for
# every objective that has the knob (vse, vse_daa, pishdad).
WARMUP_FRACTION = 1 / 3


def method_settings(objective: str, steps: int) -> tuple[dict, dict]:
    """(loss knobs, model a/b inits) of configs/methods.py for `objective`, if it lists it, and
    the triplet warm-up (WARMUP_FRACTION of `steps`) where the objective has one."""
    fields = {f.name for f in dataclasses.fields(objectives.get(objective).Config)}
    knobs = {"sum_warmup_steps": int(steps * WARMUP_FRACTION)} if "sum_warmup_steps" in fields else {}
    spec = importlib.util.spec_from_file_location("methods_config", ROOT / "configs" / "methods.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name, loss_knobs, model, _ in module.METHODS.values():
        if name == objective:
            inits = {k: v for k, v in model.items() if k in ("init_logit_scale", "init_logit_bias")}
            return {**dict(loss_knobs), **knobs}, inits
    return dict(knobs), {}


def train_and_evaluate(objective: str, steps: int = 300, seed: int = 0, batch: int = BATCH,
                       compiler_options: dict | None = None) -> dict:
    """Trains `objective` on the synthetic set; returns its held-out numbers (module docstring).
    compiler_options: XLA options for the train step's compile (`jax.jit`'s)."""
    knobs, inits = method_settings(objective, steps)
    cfg = dataclasses.replace(get_config("micro"), **inits)
    model = ProLIP(cfg, attention_impl="xla")
    module = objectives.get(objective)
    step_cfg = step_lib.StepConfig(objective=objective, loss=module.Config(**knobs), seed=seed,
                                   masking=step_lib.MaskingConfig(mask_token_id=MASK, protected_ids=(PAD,)))
    tx, schedule = optim.make_optimizer(optim.OptimConfig.of(OPTIM), steps)
    mesh = sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1])
    t0 = time.time()
    train_step = jax.jit(step_lib.make_train_step(model, tx, schedule, step_cfg, mesh, batch), donate_argnums=0,
                         compiler_options=compiler_options)
    state, _ = step_lib.create_train_state(model, tx, mesh, "replicated", seed=seed)
    evaluate = _evaluator(model, seed)
    at_init = evaluate(state.params)
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        images, tokens, *_ = make_batch(rng, batch, blank_frac=0.1, general_frac=0.1)
        state, metrics = train_step(state, sharding.global_batch({"image": images, "text": tokens}, mesh))
    out = {"objective": objective, "steps": steps, "seed": seed, "batch": batch, "loss": float(metrics["loss"]),
           "train_s": time.time() - t0, **evaluate(state.params)}
    out.update({f"{k}_at_init": v for k, v in at_init.items() if k.endswith("sigma2")})
    return out


def _evaluator(model: ProLIP, seed: int):
    """params -> held-out numbers: 256 clear images and the 16 class captions; 64 blank images
    and the 4 colour-only captions."""
    test = np.random.default_rng(10_000 + seed)
    images, _, cls, _, _ = make_batch(test, 256)
    blank_images = make_batch(test, 64, blank_frac=1.0)[0]
    captions = np.full((16, 8), PAD, np.int32)
    captions[:, 0], captions[:, 1] = COLOUR_TOKENS + np.arange(16) // 4, PATTERN_TOKENS + np.arange(16) % 4
    colour_only = np.full((4, 8), PAD, np.int32)
    colour_only[:, 0] = COLOUR_TOKENS + np.arange(4)
    apply = jax.jit(lambda p, i, t: model.apply({"params": p}, normalize_on_device(i, "openai"), t))
    sigma2 = lambda logvar: float(np.mean(np.exp(np.asarray(logvar, np.float64))))  # noqa: E731

    def evaluate(params) -> dict:
        clear = apply(params, images, np.tile(captions, (16, 1)))  # one apply shape for both calls
        ambiguous = apply(params, jnp.concatenate([blank_images] * 4), np.tile(colour_only, (64, 1)))
        mu_img, mu_txt = np.asarray(clear["image_mean"]), np.asarray(clear["text_mean"])[:16]
        out = {"zeroshot_top1": float(np.mean(np.argmax(mu_img @ mu_txt.T, axis=1) == cls)),
               "t2i_R@1": float(np.mean(cls[np.argmax(mu_txt @ mu_img.T, axis=1)] == np.arange(16)))}
        if clear["image_logvar"] is not None:
            out["blank_vs_clear_image_sigma2"] = sigma2(ambiguous["image_logvar"][:64]) / sigma2(clear["image_logvar"])
            out["colour_only_vs_full_caption_sigma2"] = (sigma2(ambiguous["text_logvar"][:4])
                                                         / sigma2(clear["text_logvar"][:16]))
        return out

    return evaluate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--objectives", nargs="+", default=sorted(objectives.REGISTRY))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--batch", type=int, default=BATCH)
    args = p.parse_args(argv)
    unknown = sorted(set(args.objectives) - set(objectives.REGISTRY))
    if unknown:
        p.error(f"unknown objective(s) {unknown}; registered: {sorted(objectives.REGISTRY)}")
    print("| objective | seed | zero-shot top-1 | t->i R@1 | blank / clear image σ² (at init) "
          "| colour-only / full caption σ² (at init) |")
    print("|---|---|---|---|---|---|")
    for name in args.objectives:
        for seed in args.seeds:
            r = train_and_evaluate(name, args.steps, seed, args.batch)
            ratio = lambda key: f"{r[key]:.2f}x ({r[key + '_at_init']:.2f}x)" if key in r else "-"  # noqa: E731
            print(f"| {name} | {seed} | {100 * r['zeroshot_top1']:.1f}% | {100 * r['t2i_R@1']:.1f}% | "
                  f"{ratio('blank_vs_clear_image_sigma2')} | {ratio('colour_only_vs_full_caption_sigma2')} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
