"""What the user sees of a run: the console line's metrics (every metric still goes to
metrics.jsonl and TensorBoard) and the command that evaluates the finished run.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from input_pipeline.config import DataConfig


def headline(evaluator: Any, values: dict[str, Any]) -> list[str]:
    """The names of `values` (one evaluator's metrics) that the console line shows: those matching
    a regex of the evaluator's `HEADLINE` (declared in its module). Every metric still goes to
    metrics.jsonl and TensorBoard."""
    patterns = getattr(evaluator, "HEADLINE", ())
    return [k for k in values if any(re.search(p, k) for p in patterns)]


# The console line's training metrics (all of them go to metrics.jsonl and TensorBoard): the loss
# and its largest terms, throughput and learning rate, and the problem counters once nonzero.
CONSOLE_LOSS_TERMS = 3
CONSOLE_TRAINING = ("loss", "samples_per_s", "lr")
CONSOLE_IF_NONZERO = ("nonfinite", "skipped_updates", "data/skipped")


def console_lines(values: dict[str, Any], evaluator_headlines: list[str]) -> list[list[str]]:
    """The names of `values` the console shows: a line of training metrics, then one of the
    evaluators' headlines (see `headline`); MetricWriter cuts each line to the terminal's width."""
    if "loss" not in values:
        return [evaluator_headlines]
    def size(k: str) -> float:  # the largest first, a non-finite one before them
        return -abs(values[k]) if np.isfinite(values[k]) else -np.inf

    terms = sorted((k for k in values if k.startswith("loss/")), key=size)[:CONSOLE_LOSS_TERMS]
    training = ["loss", *terms, *(k for k in CONSOLE_TRAINING[1:] if k in values),
                *(k for k in CONSOLE_IF_NONZERO if values.get(k))]
    return [training, evaluator_headlines]


def evaluate_command(workdir: Path, data: DataConfig, evals: dict[str, Any] | None = None) -> str:
    """The command that evaluates the checkpoint of `workdir` (scripts/evaluate.py) with the eval
    config that fits the run's data (configs/eval/): the demo's, the caption benchmark's with the
    run's own paths, or zero-shot on an ImageFolder: the run's own zero-shot folder when `evals`
    (config.evals) has one, else one the user names."""
    def here(path: Path) -> str:  # relative to the working directory when inside it
        return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)

    config, flags = data.data_source().evaluate_with(data)
    folders = [e for e in (evals or {}).values() if e.get("type") == "zeroshot" and e.get("root")]
    if config == "imagefolder.py" and folders:
        split = folders[0].get("split", "val")
        flags = f" --config.root={folders[0]['root']}" + (f" --config.split={split}" if split != "val" else "")
    root = Path(__file__).resolve().parents[2]
    return (f"python {here(root / 'scripts' / 'evaluate.py')} --checkpoint {workdir} "
            f"--config {here(root / 'configs' / 'eval' / config)} --out {workdir / 'eval'}{flags}")
