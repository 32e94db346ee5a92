"""Evaluators: zero-shot classification, retrieval, uncertainty analyses, prompt re-weighting.

    from evaluators import build
    ev = build("zeroshot", dict(dataset="demo"), model)     # model: a ProLIP module
    metrics = dict(ev.run(params))                          # or run(params, progress=bar.update)

The trainer (`prolip_jax.trainer.build.build_evaluators`, `config.evals`) and `scripts/evaluate.py`
both build evaluators here. A new evaluator is one module with a class following `Evaluator`,
a frozen `Config` dataclass of its knobs (parsed by `common.parse_config`: a misspelled key is
an error naming the nearest field) and its data reader beside it, and one line in `REGISTRY`.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Protocol

from prolip_jax.runtime import registry


class Evaluator(Protocol):
    """`Cls(config, model, tokenizer=None)`, config a dict / ConfigDict parsed into the module's
    `Config`; `run` reads its data (its own reader, on input_pipeline.eval_data),
    encodes sharded over all hosts' devices and yields the same (name, value) pairs on every
    host. `progress(k)` is called with the number of items this host encoded. Optional
    attributes: `arrays` (per-item numpy arrays of the last run, for plots), `encoder`, and
    `HEADLINE`: regexes of the few metrics the trainer's console line shows (all go to the files)."""

    def run(self, params: Any, progress: Callable[[int], None] | None = None
            ) -> Iterator[tuple[str, float]]: ...


# "module:class", imported by `get` when a config names it (big_vision's evaluators are loaded
# the same way): a training run loads only the evaluators it uses, not all of them and their
# dependencies (scipy, the caption metrics), which cost every trainer process start-up time
# (docs/performance.md, "Levers and defaults").
# A class may stand in for a string (tests register stand-ins).
REGISTRY: dict[str, str | type] = {
    "zeroshot": "evaluators.zeroshot:Evaluator",
    "prompt_reweighting": "evaluators.zeroshot:BPRWEvaluator",
    "retrieval": "evaluators.retrieval:Evaluator",
    "uncertainty": "evaluators.uncertainty:Evaluator",
    "datacomp38": "evaluators.suite:Evaluator",
    "hierarcaps": "evaluators.hierarcaps:Evaluator",
    "modality_gap": "evaluators.modality_gap:Evaluator",
}


def get(kind: str) -> type:
    """The evaluator class registered as `kind`; ValueError listing the known names."""
    return registry.load(REGISTRY, kind, f"unknown evaluator type {kind!r}")


def build(kind: str, config: Any, model: Any, tokenizer: Any = None) -> Evaluator:
    return get(kind)(config, model, tokenizer)
