r"""`make demo`: pretrain a small ProLIP on the demo dataset on CPU, evaluate it, print a summary.

    python scripts/demo.py --workdir workdirs/demo                 # what `make demo` runs
    python scripts/demo.py --workdir /tmp/demo_smoke --config configs/demo.py:smoke=1 --check

Three stages, each reused when a rerun finds it done:
  1. the demo dataset (input_pipeline/demo), generated into the cache if absent;
  2. training with the real trainer (prolip_jax.trainer.loop.train): grain pipeline, orbax checkpoints
     in WORKDIR/checkpoints, WORKDIR/metrics.jsonl and TensorBoard events in WORKDIR/tb. An
     interrupted run resumes from its last checkpoint; a finished one is not trained again;
  3. offline evaluation of the final checkpoint on the held-out demo splits with
     scripts/evaluate.py and configs/eval/demo.py: WORKDIR/eval/results.json and the plots. It
     is skipped when results.json already holds the final checkpoint's step.

Then a table of the headline numbers against the targets (TARGETS below; `smoke=1` configs
use the looser SMOKE_TARGETS) goes to stdout and to WORKDIR/summary.md. Missed targets are
reported, not hidden; with --check they also make the exit status 1 (the CI smoke test).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python scripts/demo.py` from anywhere: find evaluators/
    sys.path.insert(0, str(ROOT))

N_CLASSES = 36  # zero-shot "object" task: 6 colours x 6 shapes
N_RETRIEVAL = 500  # retrieval split: one image per distinct level-3 caption

# (label, results.json key, target, chance/meaning): every value is an accuracy, recall or rate
# in % (the evaluators' unit, docs/metrics.md), so every headline's spread over seeds is in points.
Z = "zeroshot/object/top1_csd"
R = "retrieval/demo/csd/{}_R@{}"
U = "uncertainty/demo/{}"


def _targets(zs: float, r_at: int, r_min: float, below: float, order: float, inclusion: float) -> list[tuple]:
    return [
        ("zero-shot top-1 (36 classes, CSD)", Z, zs, f"chance {100 / N_CLASSES:.1f}%"),
        (f"image->text R@{r_at} (500 pairs, CSD)", R.format("i2t", r_at), r_min,
         f"chance {100 * r_at / N_RETRIEVAL:.1f}%"),
        (f"text->image R@{r_at} (500 pairs, CSD)", R.format("t2i", r_at), r_min,
         f"chance {100 * r_at / N_RETRIEVAL:.1f}%"),
        # The ProLIP paper's Fig. 5 (image vs text uncertainty): per pair, not a ratio of means,
        # whose size moves with the seed (1.53-1.75x over seeds 0-2, docs/demo.md).
        ("image less uncertain than its caption", U.format("image_below_text_rate"), below,
         "of 500 pairs (0% untrained)"),
        ("level 0 more uncertain than level 3", U.format("order_level0_gt_level3_rate"), order,
         "of 500 hierarchies"),
        ("masked image includes image (H > 0)", U.format("inclusion_image_in_masked_rate"),
         inclusion, "of 500 images"),
        ("masked caption includes caption (H > 0)", U.format("inclusion_text_in_masked_rate"),
         inclusion, "of 500 captions"),
    ]


# The targets for `make demo` (held-out splits). The model after one step (docs/demo.md,
# "Untrained"): image below its caption 0%, inclusion 43.6% (images) / 77.0% (captions): the
# inclusion targets are above both, the trained runs' 96.8-100%.
TARGETS = _targets(zs=80.0, r_at=1, r_min=50.0, below=90.0, order=90.0, inclusion=90.0)
# Targets the current recipe is known to miss, with why, printed on the target's own line when
# it is missed (docs/demo.md has the measurements).
KNOWN_MISSES = {
    "level 0 more uncertain than level 3": "known: one caption true of every image is calibrated "
    "by its mean, not sigma^2 (docs/demo.md)",
}
# The CI smoke run (a few hundred steps): loose, but an untrained model fails every checked
# line (chance: 2.8% zero-shot, 2% R@10; the one-step model's rates above).
SMOKE_TARGETS = _targets(zs=12.0, r_at=10, r_min=12.0, below=60.0, order=0.0, inclusion=85.0)


def _load_module(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def latest_step(workdir: Path) -> int | None:
    from prolip_jax.core import checkpoint

    try:
        return checkpoint.resolve(workdir / "checkpoints")[1]
    except (FileNotFoundError, ValueError):  # no checkpoint yet
        return None


def summarize(results: dict, targets: list[tuple], known: dict[str, str] | None = None) -> tuple[list[str], bool]:
    """Markdown table lines and whether every target was met; a missed target in `known` says
    so, with the reason, in its own line."""
    known = KNOWN_MISSES if known is None else known
    lines = ["| metric | value | target | note |", "|---|---|---|---|"]
    ok_all = True
    for label, key, target, note in targets:
        value = results.get(key)
        ok = value is not None and (target <= 0 or value >= target)  # target 0: reported only
        ok_all &= ok
        shown = "missing" if value is None else f"{value:.1f}%"
        want = "reported" if target <= 0 else f">= {target:.0f}%"
        verdict = "ok" if ok else f"MISSED ({known[label]})" if label in known else "MISSED"
        lines.append(f"| {label} | {shown} | {want} {verdict} | {note} |")
    return lines, ok_all


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="workdirs/demo", help="checkpoints, metrics, eval results")
    p.add_argument("--config", default=str(ROOT / "configs" / "demo.py"), help="train config[:args]")
    p.add_argument("--check", action="store_true", help="exit with status 1 if a target is missed")
    args = p.parse_args(argv)
    workdir = Path(args.workdir)
    t0 = time.time()

    from absl import logging

    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    evaluate = _load_module(ROOT / "scripts" / "evaluate.py", "_prolip_evaluate")
    config = evaluate.load_config(args.config)
    from prolip_jax.trainer.data import demo_kwargs as run_demo_kwargs
    from prolip_jax.trainer.build import model_config
    from prolip_jax.trainer.config import parse_config

    tc = parse_config(config)
    demo_kwargs = run_demo_kwargs(tc.data, model_config(tc))  # the trainer's dataset, exactly
    smoke = "smoke=1" in args.config.partition(":")[2].split(",")

    # ---- 1. Data ---------------------------------------------------------------------------
    from input_pipeline.demo import get_demo

    print(f"[1/3] demo dataset ({demo_kwargs})", flush=True)
    t = time.time()
    ds = get_demo(**demo_kwargs)
    print(f"      {ds.root} ({time.time() - t:.0f}s)", flush=True)

    # ---- 2. Training -------------------------------------------------------------------------
    step = latest_step(workdir)
    if step is not None and step >= config.total_steps:
        print(f"[2/3] training: already done ({workdir / 'checkpoints'} is at step {step})", flush=True)
    else:
        from prolip_jax.trainer.loop import train

        resume = f", resuming from step {step}" if step else ""
        print(f"[2/3] training {config.total_steps} steps of batch {config.batch_size} on "
              f"{_devices()}{resume}; logs in {workdir}", flush=True)
        t = time.time()
        train(config, str(workdir))
        print(f"      trained in {time.time() - t:.0f}s", flush=True)
        step = latest_step(workdir)
        if step is None or step < config.total_steps:  # SIGTERM: the trainer saved and returned
            print(f"training stopped at step {step}; rerun the same command to resume")
            return 1

    # ---- 3. Evaluation -------------------------------------------------------------------------
    out = workdir / "eval"
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    # Results written before the metrics took one unit (docs/metrics.md) lack the sigma2_trace
    # names: evaluate again rather than read their fractions as %.
    if results.get("checkpoint/step") == step and U.format("text_sigma2_trace_mean") in results:
        print(f"[3/3] evaluation: reusing {results_path} (step {step})", flush=True)
    else:
        # The held-out splits of the very dataset trained on: the eval config's evaluators with
        # the training run's DemoConfig fields (one cache folder, one generation).
        eval_config = evaluate.load_config(str(ROOT / "configs" / "eval" / "demo.py"))
        for name in eval_config.evals:
            eval_config.evals[name]["demo"] = dict(demo_kwargs)
        print(f"[3/3] evaluating step {step} on the held-out splits -> {out}", flush=True)
        evaluate.evaluate(str(workdir), eval_config, out)
        results = json.loads(results_path.read_text())

    # ---- Summary ---------------------------------------------------------------------------------
    lines, ok = summarize(results, SMOKE_TARGETS if smoke else TARGETS)
    header = (f"ProLIP demo{' (smoke)' if smoke else ''}: model {config.model.variant}, "
              f"{config.total_steps} steps x batch {config.batch_size}, step {step}; "
              f"held-out demo splits ({results_path})")
    plots = sorted(x.name for x in out.glob("*.png"))
    missed = [line.split(" | ")[0][2:] for line in lines[2:] if "MISSED" in line]
    unknown = [label for label in missed if label not in KNOWN_MISSES]
    verdict = "yes" if ok else (f"NO: {len(missed)} missed, {len(missed) - len(unknown)} of them known "
                                f"(see their lines){'; not known: ' + ', '.join(unknown) if unknown else ''}")
    text = "\n".join([header, "", *lines, "", f"plots: {', '.join(plots)}", f"all targets met: {verdict}", ""])
    (workdir / "summary.md").write_text(text)
    print("\n" + text + f"(total {time.time() - t0:.0f}s; this table is also in {workdir / 'summary.md'})")
    return 0 if ok or not args.check else 1


def _devices() -> str:
    import jax

    devices = jax.devices()
    return f"{len(devices)} {devices[0].platform.upper()} device{'s' if len(devices) > 1 else ''}"


if __name__ == "__main__":
    sys.exit(main())
