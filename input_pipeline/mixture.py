"""Weighted mixtures of data sources, with exact per-source resume.

    c.data.mixture = (dict(name="datacomp", source="tar", path="gs://b/datacomp/{00000..09999}.tar", weight=0.8),
                      dict(name="cc12m", source="array_record", path="/data/cc12m/*.array_record", weight=0.2))
    c.data.mixture_stages = ((20_000, (0.5, 0.5)),)   # from step 20,000 on: half and half

Each entry is a source of its own (any registered one), configured by the `data` fields it sets
over the section's (`source`, `path`, `caption_file`, ...), plus its `weight` and an optional
`name` (its metrics: data/<name>/examples, data/<name>/skipped).

How a batch is drawn: every source runs its own pipeline (pipeline.build_train_iterator) that
yields chunks of batch_size / mixture_chunks records; a batch is `mixture_chunks` chunks, each
from the source whose drawn share lags its weight the most (smooth weighted round-robin, the
rule of nginx's weighted upstream balancer): every source's chunk count stays within one chunk
of its weight's share at any point, and each batch holds close to the weights' proportions. The
choice depends only on the weights and the counts, so it is the same on every host, and a
source's records are its own pipeline's global order: the global batch is the same with any
number of hosts.

Resume: the state holds each source's own iterator state (its exact position; tar shards
re-dealt on a new layout, as for one source) beside the scheduler's credits, so a resumed run
draws the same batches as an uninterrupted one, also on another host count.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from input_pipeline import pipeline
from input_pipeline.config import DataConfig

_STATE_VERSION = "mixture-1"
# What a mixed batch holds: the keys every source gives. Image ids are per dataset (equal ids
# of two datasets are not the same image) and labels per label set, so neither is mixed.
KEYS = ("image", "text")


@dataclasses.dataclass(frozen=True)
class Part:
    name: str
    config: DataConfig   # this source's data section (batch_size: the whole batch, as data's)
    where: str           # "data.mixture[i]", for messages


def parts(cfg: DataConfig) -> list[Part]:
    """The mixture's sources, each parsed as a data section of its own (DataConfig.check_mixture
    has checked the weights and the stages)."""
    base = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(DataConfig)
            if f.name not in ("mixture", "mixture_stages", "mixture_chunks")}
    out = []
    for i, entry in enumerate(cfg.mixture):
        where = f"data.mixture[{i}]"
        fields = {k: v for k, v in dict(entry).items() if k not in ("name", "weight")}
        part = DataConfig.from_mapping({**base, **fields}, where)
        out.append(Part(str(entry.get("name") or f"{part.source}{i}"), part, where))
    return out


def weights_at(cfg: DataConfig, batch: int) -> tuple[float, ...]:
    """The weights of the batch with 0-based index `batch` (the batch step `batch + 1` trains
    on): the last stage whose step is <= batch, else the entries' own."""
    weights = tuple(float(e["weight"]) for e in cfg.mixture)
    for step, stage in cfg.mixture_stages:
        if batch >= step:
            weights = tuple(float(w) for w in stage)
    return weights


def _stage(cfg: DataConfig, batch: int) -> int:
    return sum(batch >= step for step, _ in cfg.mixture_stages)


def check_layout(cfg: DataConfig, process_count: int) -> int:
    """The global chunk size; ValueError naming the flag when the hosts cannot share it."""
    chunk = cfg.batch_size // cfg.mixture_chunks
    if chunk % process_count:
        raise ValueError(f"a data.mixture batch is data.mixture_chunks={cfg.mixture_chunks} chunks of "
                         f"{chunk} records, which {process_count} hosts cannot share evenly: set "
                         f"--config.data.mixture_chunks to a divisor of {cfg.batch_size // process_count}")
    return chunk


class MixtureIterator:
    """This host's mixed batches, with the input pipeline iterator's interface (next,
    get_state / set_state / set_states, stats, layout, close)."""

    caption_index = None   # no caption source's noisy pairs: image ids are not mixed

    def __init__(self, cfg: DataConfig, parts_: Sequence[Part], iterators: Sequence[Any]):
        self._cfg, self._parts, self._its = cfg, list(parts_), list(iterators)
        self._batches = 0
        self._credits = [0.0] * len(self._parts)
        self._drawn = [0] * len(self._parts)   # chunks taken from each source

    # -- drawing ------------------------------------------------------------------------
    def _pick(self, weights: Sequence[float]) -> int:
        total = sum(weights)
        for i, w in enumerate(weights):
            self._credits[i] += w / total
        i = max((i for i, w in enumerate(weights) if w > 0), key=lambda i: (self._credits[i], -i))
        self._credits[i] -= 1.0
        return i

    def __next__(self) -> dict[str, np.ndarray]:
        if self._batches and _stage(self._cfg, self._batches) != _stage(self._cfg, self._batches - 1):
            self._credits = [0.0] * len(self._parts)   # a new stage: its shares from here on
        weights = weights_at(self._cfg, self._batches)
        chunks = []
        for _ in range(self._cfg.mixture_chunks):
            i = self._pick(weights)
            chunks.append(next(self._its[i]))
            self._drawn[i] += 1
        self._batches += 1
        return {k: np.concatenate([c[k] for c in chunks]) for k in KEYS}

    def __iter__(self) -> "MixtureIterator":
        return self

    # -- what the trainer reads ---------------------------------------------------------
    @property
    def layout(self) -> dict[str, int]:
        return self._its[0].layout

    @property
    def stats(self) -> dict[str, Any]:
        """The sources' counters summed (as one source's), and each source's examples, skipped
        records and share of the chunks drawn, as `<name>/<counter>`."""
        per = [it.stats for it in self._its]
        out: dict[str, Any] = {"batches": self._batches}
        for key in ("examples", "skipped", "truncated"):
            if any(key in s for s in per):
                out[key] = sum(int(s.get(key, 0)) for s in per)
        for reason in sorted({k for s in per for k in s if k.startswith("skipped/")}):
            out[reason] = sum(int(s.get(reason, 0)) for s in per)
        total = max(sum(self._drawn), 1)
        for part, s, drawn in zip(self._parts, per, self._drawn):
            out[f"{part.name}/examples"] = int(s["examples"])
            out[f"{part.name}/skipped"] = int(s["skipped"])
            out[f"{part.name}/share"] = drawn / total
        return out

    @property
    def skip_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for it in self._its:
            for reason, n in it.skip_counts.items():
                out[reason] = out.get(reason, 0) + n
        return out

    # -- resume ---------------------------------------------------------------------------
    def get_state(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "names": [p.name for p in self._parts],
                "batches": self._batches, "credits": list(self._credits), "drawn": list(self._drawn),
                "layout": self.layout, "sources": [it.get_state() for it in self._its]}

    def _checked(self, state: dict[str, Any]) -> dict[str, Any]:
        names = [p.name for p in self._parts]
        if state.get("version") != _STATE_VERSION:
            raise ValueError("the checkpoint's data state is not a mixture's (the run was started with one "
                             "data.source): resume it with that config, or start the mixture in a new workdir")
        if state["names"] != names:
            raise ValueError(f"the checkpoint's data mixture has the sources {state['names']}, the config "
                             f"{names}: resume with the same data.mixture (names and order), or start a new "
                             "workdir")
        return state

    def _restore_counters(self, state: dict[str, Any]) -> None:
        self._batches = int(state["batches"])
        self._credits = [float(c) for c in state["credits"]]
        self._drawn = [int(d) for d in state["drawn"]]

    def set_state(self, state: dict[str, Any]) -> None:
        state = self._checked(state)
        for it, s in zip(self._its, state["sources"]):
            it.set_state(s)
        self._restore_counters(state)

    def set_states(self, states: Sequence[dict[str, Any]]) -> None:
        """Resumes from every saved host's state, with any host or worker count: each source
        from its own states (pipeline.InputIterator.set_states), the scheduler from host 0's
        (every host's is the same)."""
        states = [self._checked(s) for s in states]
        for i, it in enumerate(self._its):
            it.set_states([s["sources"][i] for s in states])
        self._restore_counters(states[0])

    def close(self) -> None:
        failed = None
        for it in self._its:
            try:
                it.close()
            except Exception as e:  # noqa: BLE001 - close the others, then raise the first
                failed = failed or e
        if failed is not None:
            raise failed

    def __enter__(self) -> "MixtureIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def build_mixture_iterator(cfg: DataConfig, tokenizer: Any, *, process_index: int | None = None,
                           process_count: int | None = None) -> MixtureIterator:
    """This host's iterator over `cfg.mixture` (see the module docstring); `tokenizer` reads
    every source's captions."""
    h, p = pipeline.process_index_count(process_index, process_count)
    chunk = check_layout(cfg, p)
    its: list[Any] = []
    parts_ = parts(cfg)
    try:
        for part in parts_:
            try:
                its.append(pipeline.build_train_iterator(part.config.replace(batch_size=chunk), tokenizer,
                                                         process_index=h, process_count=p))
            except (ValueError, FileNotFoundError) as e:   # which source, then what is wrong with it
                raise type(e)(f"{part.where} ({part.name}): {e}") from None
    except BaseException:
        for it in its:
            it.close()
        raise
    return MixtureIterator(cfg, parts_, its)
