"""Builds per-host train/eval iterators: source -> decode/augment -> tokenize/batch -> workers.

    it = build_train_iterator(config.data, tokenizer)   # process index/count from jax
    batch = next(it)     # {"image": float32 [b, S, S, 3], "text": int32 [b, L]}, b = batch/P
    it.stats             # {"examples": ..., "skipped": ..., "skipped/corrupt_image": ...,
                         #  "truncated": captions cut at the context length, "truncated_share"}
    state = it.get_state(); ...; it.set_state(state)     # JSON-able dict; exact resume
    it.set_states([state of every host])   # resume on another host or worker count
    # or inside an orbax checkpoint: grain.checkpoint.CheckpointSave(it) / CheckpointRestore(it)
    it.close()

Records that must be dropped (records.SKIP_REASONS) are counted inside the worker that met
them; the counts ride along in each batch (key "_skipped") and the iterator sums them, so the
numbers are exact with any number of worker processes and survive a restore. Captions the
tokenizer cuts at its context length (tokenizers.Tokenizer.encode_with_truncation) are counted
the same way ("_truncated"), and a warning is logged once their share passes
data.max_truncated_share (truncation is silent otherwise: a cut class word is just gone).
"""
from __future__ import annotations

import hashlib
import json
import logging
import urllib.parse
from typing import Any, Callable, Mapping, Sequence

import grain
import numpy as np

from input_pipeline import shared_batches, tokenizers
from input_pipeline.config import DataConfig
from input_pipeline.epoch_order import EpochOrderDataset
from input_pipeline.decode import DecodeConfig, ExampleDecoder
from input_pipeline.records import REASON_INDEX, SKIP_REASONS, Skip
from prolip_jax.core.normalization import normalize

Tokenizer = Callable[[Sequence[str]], np.ndarray]
_PAD = Skip("padding")   # eval: a position past the end of this host's share of the data
_STATE_VERSION = 2   # 2: layout and origin (resume on another host/worker count)
log = logging.getLogger(__name__)


class _BatchDataset(grain.IterDataset):
    """Examples (or Skips) -> batches of `batch_size`; tokenizes the captions per batch.

    Train: Skips are dropped (and counted); every batch is full.
    Eval: every position keeps its row, so all hosts yield the same number of batches (a
    multi-host eval must not hang on a collective); dropped records and the padding at the
    end become rows with mask=False.
    """

    def __init__(self, parent: grain.IterDataset, batch_size: int, tokenizer: Tokenizer,
                 normalization: str, image_dtype: str, train: bool, image_size: int):
        super().__init__(parent)
        self.batch_size, self.tokenizer, self.train = batch_size, tokenizer, train
        self.normalization, self.image_dtype = normalization, image_dtype
        self.image_size = image_size
        self.shared_memory = False
        self.per_worker_buffer_size = 1   # grain's default; sizes the workers' rings

    def enable_shared_memory_output(self, per_worker_buffer_size: int | None = None) -> None:
        """Set before the dataset goes to grain's worker processes (by _build, and again by
        grain's mp_prefetch itself, without an argument, with two or more workers): the workers
        build the images straight into a ring of reused shared-memory buffers (shared_batches.py),
        which saves the copy grain would make to send them and the fresh pages of a new segment
        per batch. The ring is sized for `per_worker_buffer_size` (None: as set before)."""
        self.shared_memory = True
        if per_worker_buffer_size is not None:
            self.per_worker_buffer_size = per_worker_buffer_size

    def __iter__(self) -> "_BatchIterator":
        return _BatchIterator(self._parent.__iter__(), self)

    def __str__(self) -> str:
        return f"_BatchDataset(batch_size={self.batch_size}, train={self.train})"


class _BatchIterator(grain.DatasetIterator):

    def __init__(self, parent: grain.DatasetIterator, ds: _BatchDataset):
        super().__init__(parent)
        self._ds = ds
        self._ring: shared_batches.ImageRing | None = None
        self._outgoing: Any = None   # what is sent instead of the images built in the ring

    def __next__(self) -> dict[str, np.ndarray]:
        ds = self._ds
        rows: list[dict[str, Any] | None] = []
        counts = np.zeros(len(SKIP_REASONS), np.int64)
        while len(rows) < ds.batch_size:
            try:
                ex = next(self._parent)
            except StopIteration:
                if rows and not ds.train:
                    break
                raise
            if isinstance(ex, Skip):
                if ex.reason != _PAD.reason:
                    counts[REASON_INDEX[ex.reason]] += 1
                if not ds.train:
                    rows.append(None)
                continue
            rows.append(ex)
        return self._collate(rows, counts)

    def _collate(self, rows: list[dict[str, Any] | None], counts: np.ndarray
                 ) -> dict[str, np.ndarray]:
        ds = self._ds
        b, s = ds.batch_size, ds.image_size
        valid = [r for r in rows if r is not None]
        mask = np.array([r is not None for r in rows] + [False] * (b - len(rows)))
        images = self._array((b, s, s, 3), np.uint8, ds.image_dtype == "uint8")
        images[len(rows):] = 0
        captions = [""] * b
        for i, r in enumerate(rows):
            if r is not None:
                images[i] = r["image"]
                captions[i] = r["caption"]
            else:
                images[i] = 0
        truncated = None
        if valid:
            texts = [captions[i] for i in np.flatnonzero(mask)]
            if hasattr(ds.tokenizer, "encode_with_truncation"):
                tokens, cut = ds.tokenizer.encode_with_truncation(texts)
                truncated = np.int64(np.count_nonzero(cut))
            else:  # a tokenizer that cannot tell (tests' stand-ins, the demo's): not counted
                tokens = ds.tokenizer(texts)
            tokens = np.asarray(tokens)
            if tokens.ndim != 2 or tokens.shape[0] != len(valid):
                raise ValueError(f"The tokenizer returned shape {tokens.shape} for "
                                 f"{len(valid)} texts; expected [N, context_length].")
            text = np.zeros((b, tokens.shape[1]), np.int32)
            pad_id = getattr(ds.tokenizer, "pad_id", 0)
            text[~mask] = pad_id
            text[mask] = tokens
        else:  # an eval batch of nothing but dropped records
            length = int(getattr(ds.tokenizer, "context_length"))
            text = np.full((b, length), getattr(ds.tokenizer, "pad_id", 0), np.int32)
        if ds.image_dtype == "float32":
            images = normalize(
                images, ds.normalization, out=self._array(images.shape, np.float32, True))
        out = {"image": images if self._outgoing is None else self._outgoing, "text": text,
               "_skipped": counts}
        self._outgoing = None
        if truncated is not None:
            out["_truncated"] = truncated
        if not ds.train:
            out["mask"] = mask
        for key in ("label", "image_id"):   # image_id: caption sources (captions.py)
            if valid and all(key in r for r in valid):
                ids = np.full((b,), -1, np.int32)   # -1: rows without a record
                ids[mask] = [r[key] for r in valid]
                out[key] = ids
        return out

    def _array(self, shape: tuple[int, ...], dtype: Any, final: bool) -> np.ndarray:
        """An uninitialised array; in the worker's ring if it is what leaves the worker (then
        self._outgoing is what to send in its place)."""
        if final and self._ds.shared_memory:
            if self._ring is None:
                self._ring = shared_batches.ImageRing(
                    shared_batches.ring_slots(self._ds.per_worker_buffer_size))
            array, self._outgoing = self._ring.take(shape, dtype)
            return array
        return np.empty(shape, dtype)

    def get_state(self) -> dict[str, Any]:
        # Batches are only handed out whole, so the parent's position is the exact state.
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state)
        if self._ring is not None:   # in a worker: what it sent before is discarded unread
            self._ring.release_all()


class InputIterator(grain.DatasetIterator):
    """Per-host batch iterator with skip statistics and a JSON-able, checked state.

    Works with orbax through `grain.checkpoint.CheckpointSave(it)` / `CheckpointRestore(it)`
    (one JSON file per process) or with `get_state()` / `set_state()` directly. A state saved
    with another process or worker count is resumed with `set_states(every host's state)`.
    """

    def __init__(self, parent: grain.DatasetIterator, fingerprint: Mapping[str, Any],
                 layout: Mapping[str, int] | None = None, dataset: Any = None,
                 order: Any = None, max_truncated_share: float | None = None,
                 context_length: int | None = None, data_files: Mapping[str, Any] | None = None):
        super().__init__(parent)
        self._fingerprint = dict(fingerprint)
        self._data_files = data_files   # `_files_summary`: how a state names its files
        self._told_moved = False
        self._layout = dict(layout or {"process_index": 0, "process_count": 1,
                                       "num_workers": 0})
        self._dataset, self._order = dataset, order   # to rebuild at a new origin
        self._counts = np.zeros(len(SKIP_REASONS), np.int64)
        self._examples = 0
        self._batches = 0
        self._truncated: int | None = None   # None: the tokenizer does not report truncation
        self._max_truncated_share = max_truncated_share
        self._context_length = context_length
        self._warned_truncation = False
        # A caption source's CaptionIndex (which pairs data.noise_ratio corrupted), else None.
        self.caption_index: Any = None
        self._started = False
        self._receiver = shared_batches.Receiver()   # images from worker processes' rings

    def __next__(self) -> dict[str, np.ndarray]:
        self._assert_not_closed()
        self._started = True
        batch = dict(next(self._parent))
        batch["image"] = self._receiver.receive(batch["image"])
        self._counts += np.asarray(batch.pop("_skipped"))
        self._examples += int(batch["mask"].sum()) if "mask" in batch else len(batch["text"])
        self._batches += 1
        if "_truncated" in batch:
            self._truncated = (self._truncated or 0) + int(batch.pop("_truncated"))
            self._check_truncation()
        return batch

    def close(self) -> None:
        try:
            super().close()   # stops the workers
        finally:   # also when a dead worker makes stopping them fail
            self._receiver.close()
            # grain's iterators go now, not at the interpreter's exit: there grain's __del__
            # closes them again, and its thread-prefetch close fails on torn-down modules.
            self._parents = ()

    def _check_truncation(self) -> None:
        """Warns once when the share of truncated captions passes the configured limit."""
        limit = self._max_truncated_share
        if self._warned_truncation or limit is None or not self._examples:
            return
        share = self._truncated / self._examples
        if share > limit:
            self._warned_truncation = True
            at = f" of {self._context_length} tokens" if self._context_length else ""
            log.warning(
                "%d of %d captions so far (%.1f%%) were longer than the context length%s and were "
                "cut (more than data.max_truncated_share=%g; counted as data/truncated): the words "
                "past the cut are lost. Use a longer context (data.tokenizer.context_length and "
                "the model's text context_length) or a tokenizer that keeps words whole "
                "(scripts/train_tokenizer.py reports the longest caption).", self._truncated,
                self._examples, 100 * share, at, limit)

    @property
    def layout(self) -> dict[str, int]:
        """{"process_index", "process_count", "num_workers"} of this pipeline."""
        return dict(self._layout)

    @property
    def skip_counts(self) -> dict[str, int]:
        """Records dropped so far on this host, per reason (records.SKIP_REASONS)."""
        return {r: int(n) for r, n in zip(SKIP_REASONS, self._counts)}

    @property
    def stats(self) -> dict[str, int]:
        """Flat, log-ready counters for this host: examples, batches, skipped (total and
        per reason as `skipped/<reason>`). Cumulative over the run, restores included."""
        out = {"examples": self._examples, "batches": self._batches,
               "skipped": int(self._counts.sum())}
        out.update({f"skipped/{r}": n for r, n in self.skip_counts.items()})
        if self._truncated is not None:
            out["truncated"] = self._truncated
            out["truncated_share"] = self._truncated / max(self._examples, 1)
        return out

    def get_state(self) -> dict[str, Any]:
        return {"version": _STATE_VERSION, "source": self._parent.get_state(),
                "skipped": self.skip_counts, "examples": self._examples,
                "batches": self._batches, "truncated": self._truncated,
                "fingerprint": self._fingerprint, "data_files": self._data_files,
                "layout": self._layout,
                "origin": self._order.origin if self._order is not None else None}

    def set_state(self, state: dict[str, Any]) -> None:
        """Resumes from this host's saved state (same process and worker count), or from the
        single state of a one-process run on any layout."""
        state = self._checked(state)
        if _layout_key(state["layout"]) != _layout_key(self._layout):
            if state["layout"]["process_count"] == 1:
                return self.set_states([state])
            raise ValueError(
                "The iterator state was saved by host {process_index} of {process_count} with "
                "{num_workers} worker processes; this pipeline is host {now[process_index]} of "
                "{now[process_count]} with {now[num_workers]}. Pass the states of all saved "
                "hosts to set_states().".format(now=self._layout, **state["layout"]))
        self._set_origin(state["origin"])
        self._parent.set_state(state["source"])
        self._counts = np.array([state["skipped"].get(r, 0) for r in SKIP_REASONS], np.int64)
        self._examples, self._batches = int(state["examples"]), int(state["batches"])
        self._truncated = state.get("truncated")   # absent in states saved before it was counted

    def set_states(self, states: Sequence[dict[str, Any]]) -> None:
        """Resumes from the states of every host of a saved run, with any process and worker
        count. Exact sources (array_record, tfds, demo) continue the global record sequence
        with nothing lost or repeated; tar shards are re-dealt (the cost is logged)."""
        states = [self._checked(s) for s in states]
        old = states[0]["layout"]
        if sorted(s["layout"]["process_index"] for s in states) != list(
                range(old["process_count"])) or any(
                s["layout"]["process_count"] != old["process_count"] or
                s["layout"]["num_workers"] != old["num_workers"] for s in states):
            raise ValueError(f"set_states needs the state of each of the {old['process_count']} "
                             f"saved hosts exactly once; got those of hosts "
                             f"{sorted(s['layout']['process_index'] for s in states)}.")
        states = sorted(states, key=lambda s: s["layout"]["process_index"])
        if _layout_key(old) == _layout_key(self._layout):
            return self.set_state(states[self._layout["process_index"]])
        if self._started or self._order is None:
            raise ValueError("A state from another host/worker layout can only be restored into "
                             "a freshly built train iterator.")
        if any(s["origin"] != states[0]["origin"] for s in states):
            raise ValueError("The saved hosts' states disagree on their origin (not one run?).")
        self._set_origin(states[0]["origin"])   # the old run's, to map its positions
        workers = [_worker_states(s["source"], old["num_workers"]) for s in states]
        # Random-access order: exact; tar's stream: its shards re-dealt (input_pipeline/sources/).
        origin, cost = self._order.resplit(old["process_count"], old["num_workers"], workers)
        self._set_origin(origin, force=True)
        # Counters: every host has consumed the same batches; the sums go to host 0.
        counts = sum(np.array([s["skipped"].get(r, 0) for r in SKIP_REASONS], np.int64)
                     for s in states)
        first = self._layout["process_index"] == 0
        self._counts = counts if first else np.zeros_like(counts)
        self._examples = sum(int(s["examples"]) for s in states) if first else 0
        if any(s.get("truncated") is not None for s in states):
            self._truncated = sum(int(s.get("truncated") or 0) for s in states) if first else 0
        self._batches = int(states[0]["batches"])
        if first:
            log.warning("Data resumed on a new layout: %d hosts x %d workers -> %d hosts x %d "
                        "workers (after %d batches); %s.", old["process_count"],
                        old["num_workers"], self._layout["process_count"],
                        self._layout["num_workers"], self._batches, cost)

    def _checked(self, state: dict[str, Any]) -> dict[str, Any]:
        """The state in the current format, or a clear error if it cannot be resumed here."""
        version = state.get("version")
        if version == "mixture-1":   # input_pipeline/mixture.py's
            raise ValueError("the checkpoint's data state is a data.mixture's: resume with the config's "
                             "data.mixture, or start one data.source in a new workdir")
        if version not in (1, _STATE_VERSION):
            raise ValueError(f"Iterator state version {version!r} is not {_STATE_VERSION}; it "
                             "was written by another code version.")
        saved = state["fingerprint"]
        diff = {k: (saved.get(k), v) for k, v in self._fingerprint.items() if saved.get(k) != v}
        moved = "files" in diff and self._moved_files(state.get("data_files"))
        if moved:
            del diff["files"]
        if set(diff) == {"files"}:
            raise ValueError(self._other_files(state.get("data_files")))
        if diff:
            detail = ", ".join(f"{k}: saved {a!r}, now {b!r}" if k != "files" else
                               self._files_detail(state.get("data_files")) for k, (a, b) in diff.items())
            raise ValueError(f"the data pipeline's settings are not those of the run being resumed "
                             f"({detail}): resume with the same settings, or start a new --workdir")
        if moved and not self._told_moved:   # once, also for every saved host's state
            self._told_moved = True
            log.warning("The data files moved: the run being resumed read %s, this run reads %s (the "
                        "same names): resuming at the saved position.", _files_read(state["data_files"]),
                        _files_read(self._data_files))
        if version == 1:   # layout in the fingerprint; origin (0, []) or a fresh tar start
            layout = {k: saved[k] for k in ("process_index", "process_count", "num_workers")}
            if saved["num_records"] and saved["num_records"] % layout["process_count"]:
                raise ValueError("This version-1 iterator state (whose epochs dropped "
                                 "num_records % process_count records) cannot be resumed "
                                 "exactly by this version.")
            origin = self._order.initial_origin() if self._order is not None else None
            state = dict(state, layout=layout, origin=origin, version=_STATE_VERSION)
        return state

    def _moved_files(self, saved: Mapping[str, Any] | None) -> bool:
        """Whether the saved run's files are this run's read from another directory or bucket:
        the same names in the same order and the same settings (with the rest of the
        fingerprint, the same records)."""
        ours = self._data_files
        return bool(saved and ours and saved.get("names") and saved["names"] == ours["names"]
                    and saved.get("settings") == ours["settings"])

    def _other_files(self, saved: Mapping[str, Any] | None) -> str:
        now = self._data_files or {"count": 0, "first": "", "names": None, "settings": []}
        if not saved:   # a state written before states named their files
            return (f"the data (its files or the source's settings) is not that of the run being "
                    f"resumed (this run reads {_files_read(now)}): resume with the same data, or "
                    "start a new --workdir")
        if now["names"] is not None and saved.get("names") == now["names"]:   # other settings
            a, b = ({k: v for d in x for k, v in d.items()} for x in (saved["settings"], now["settings"]))
            diff = ", ".join(f"{k}: saved {a.get(k)!r}, now {b.get(k)!r}" for k in sorted({*a, *b})
                             if a.get(k) != b.get(k))
            return (f"the data source's settings are not those of the run being resumed ({diff}): "
                    "resume with the same settings, or start a new --workdir")
        return (f"the data files are not those of the run being resumed (it read {_files_read(saved)}; "
                f"this run reads {_files_read(now)}): resume with the same files, or start a new --workdir")

    def _files_detail(self, saved: Mapping[str, Any] | None) -> str:
        if not (saved and self._data_files):
            return "files: other files"
        return f"files: saved {_files_read(saved)}, now {_files_read(self._data_files)}"

    def _set_origin(self, origin: Any, force: bool = False) -> None:
        """Moves the source to `origin`; a new origin needs a fresh parent iterator."""
        if self._order is None or (origin == self._order.origin and not force):
            return
        self._order.restore_origin(origin)
        parent = self._dataset.__iter__()
        self._parent.close()
        self._parents = (parent,)

    def __enter__(self) -> "InputIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _layout_key(layout: Mapping[str, int]) -> tuple[int, int, int]:
    return layout["process_index"], layout["process_count"], layout["num_workers"]


def _worker_states(state: dict[str, Any], num_workers: int) -> list[dict[str, Any]]:
    """Per-worker source states out of a host's state (grain's mp_prefetch interleaves one
    iterator per worker; without workers the host's state is its single worker's)."""
    if num_workers == 0:
        return [state]
    out: list[Any] = [None] * num_workers
    for i, st in zip(state["iterators_in_use_indices"], state["iterators_in_use_states"]):
        out[i] = st
    if any(st is None for st in out):
        raise ValueError("The saved state lacks some worker's position (a finished epoch?).")
    return out


def process_index_count(process_index: int | None, process_count: int | None
                         ) -> tuple[int, int]:
    if process_index is None or process_count is None:
        import jax
        process_index = jax.process_index() if process_index is None else process_index
        process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is not in [0, {process_count}).")
    return process_index, process_count


def resolve_tokenizer(cfg: DataConfig, tokenizer: Tokenizer | None) -> Tokenizer:
    if tokenizer is not None:
        return tokenizer
    source = cfg.data_source()
    if source.own_tokenizer:
        return source.tokenizer(cfg)
    if cfg.tokenizer:
        return tokenizers.build_tokenizer(**cfg.tokenizer)
    raise ValueError("No tokenizer: pass one to the builder or set data.tokenizer to the "
                     "kwargs of input_pipeline.tokenizers.build_tokenizer.")


class _KeepImageId:
    """The decoder, with the raw record's "image_id" (caption sources) carried past it."""

    def __init__(self, decoder: Callable[[Any], Any]):
        self.decoder = decoder

    def __call__(self, raw: Any) -> Any:
        ex = self.decoder(raw)
        if isinstance(ex, Skip) or raw.get("image_id") is None:
            return ex
        return dict(ex, image_id=int(raw["image_id"]))


class _Compose:
    """Picklable f(g(x)) for grain worker processes."""

    def __init__(self, *fns: Callable[[Any], Any]):
        self.fns = fns

    def __call__(self, x: Any) -> Any:
        for fn in self.fns:
            x = fn(x)
        return x


def build_dataset(config: Mapping[str, Any] | DataConfig, tokenizer: Tokenizer | None = None,
                  *, train: bool = True, process_index: int | None = None,
                  process_count: int | None = None) -> tuple[grain.IterDataset, dict[str, Any]]:
    """The grain IterDataset of per-host batches, and the fingerprint of its data order.

    Lower level than the iterators: batches still carry the workers' "_skipped" counts, and with
    worker processes each "image" is a shared_batches.SharedImages to be turned into an array by
    a shared_batches.Receiver (as InputIterator does), which also frees the slot for reuse."""
    return _build(config, tokenizer, train, process_index, process_count)[:2]


def _build(config: Mapping[str, Any] | DataConfig, tokenizer: Tokenizer | None, train: bool,
           process_index: int | None, process_count: int | None
           ) -> tuple[grain.IterDataset, dict[str, Any], dict[str, int], Any, Any, dict[str, Any]]:
    """(dataset, fingerprint, host/worker layout, the order dataset that holds the origin,
    the random-access source or None, `_files_summary` of its files)."""
    cfg = DataConfig.from_mapping(config)
    cfg.check_source()
    h, p = process_index_count(process_index, process_count)
    if cfg.batch_size % p:
        raise ValueError(f"data.batch_size={cfg.batch_size} is not divisible by the "
                         f"{p} hosts.")
    tokenizer = resolve_tokenizer(cfg, tokenizer)
    decoder = ExampleDecoder(DecodeConfig(
        image_size=cfg.image_size, train=train, augment=cfg.augment_config() if train else None,
        max_image_pixels=cfg.max_image_pixels, min_image_side=cfg.min_image_side,
        seed=cfg.seed))
    shuffle = train and cfg.shuffle
    num_epochs = cfg.num_epochs if train else 1
    source = cfg.data_source()
    records = source.read(cfg, shuffle=shuffle, num_epochs=num_epochs, process_index=h,
                          process_count=p)
    if records.stream is not None:   # a stream in the source's own order (tar)
        order = records.stream
        ds = order.map(decoder)
        size = src = None
    else:
        src, to_raw = records.items, records.to_raw
        decoder = _KeepImageId(decoder)
        size = len(src)
        if train:
            ds = order = EpochOrderDataset(
                grain.MapDataset.source(src), seed=cfg.seed, shuffle=shuffle, process_index=h,
                process_count=p, num_epochs=num_epochs)
            ds = ds.map(_Compose(to_raw, decoder))
        else:
            order = None
            ds = grain.MapDataset.range(-(-size // p)).map(
                _Compose(_EvalPosition(src, h, p), to_raw, decoder))
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.read_threads,
                                                  prefetch_buffer_size=cfg.read_buffer_size))
    ds = _BatchDataset(ds, cfg.batch_size // p, tokenizer, cfg.normalization, cfg.image_dtype,
                       train=train, image_size=cfg.image_size)
    if cfg.num_workers > 0:
        _ensure_absl_flags_parsed()
        # Images straight into reused shared memory. grain's mp_prefetch asks for shared memory
        # itself only with two or more workers (one worker's dataset is wrapped before its
        # check), and otherwise copies every batch into a fresh segment: 9.6 MB per 64 images
        # at 224 px.
        ds.enable_shared_memory_output(cfg.per_worker_buffer_size)
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(
            num_workers=cfg.num_workers, per_worker_buffer_size=cfg.per_worker_buffer_size))
    fingerprint = {   # the keys and values of states saved before: they must still restore
        "source": cfg.source, "files": _digest([*records.files, *records.settings]), "num_records": size,
        "train": train, "seed": cfg.seed, "shuffle": shuffle, "batch_size": cfg.batch_size,
        **source.spec(cfg)}
    layout = {"process_index": h, "process_count": p, "num_workers": cfg.num_workers}
    return ds, fingerprint, layout, order, src, _files_summary(records)


def _digest(files: Sequence[str]) -> str:
    return hashlib.sha1(json.dumps(list(files)).encode()).hexdigest()[:16]


def _files_summary(records: Any) -> dict[str, Any]:
    """How many files, the first, the digest of their names without directories (relocatable
    paths) and the source's settings: what a resume compares when the fingerprint's digest of
    the files and settings differs."""
    files = [_without_secrets(str(f)) for f in records.files]
    names = [f.rstrip("/").rsplit("/", 1)[-1] for f in files] if records.relocatable else None
    return {"count": len(files), "first": files[0] if files else "",
            "names": _digest(names) if names is not None else None,
            "settings": [json.loads(x) for x in records.settings]}


def _without_secrets(path: str) -> str:
    """A URL without its user, password, query and fragment (a signed URL's signature is not
    written into checkpoints or logs, and a re-signed URL keeps its name)."""
    if "://" not in path:
        return path
    parts = urllib.parse.urlsplit(path)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def _files_read(summary: Mapping[str, Any]) -> str:
    first = repr(summary["first"])
    return first if summary["count"] == 1 else f"{summary['count']} files from {first} on"


def _ensure_absl_flags_parsed() -> None:
    # grain's worker processes read absl flags; outside absl.app.run (pytest, notebooks,
    # plain scripts) they are unparsed and the workers would fail (JAX_STACK_NOTES §2c).
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def build_train_iterator(config: Mapping[str, Any] | DataConfig,
                         tokenizer: Tokenizer | None = None, *,
                         process_index: int | None = None,
                         process_count: int | None = None) -> InputIterator:
    """Infinite (or `num_epochs`) shuffled, augmented per-host batches:
    {"image": float32|uint8 [B/P, S, S, 3], "text": int32 [B/P, L]} (+ "label" int32 [B/P]
    when every record has one). process_index/count default to jax's.

    Batches are always full: dropped records are replaced by the next ones. With a finite
    `num_epochs` the last partial batch of each worker is dropped.

    Caption sources (coco_karpathy, flickr30k, cub) add "image_id" int32 [B/P] (equal ids:
    positives) and the iterator's `caption_index` (captions.CaptionIndex; None otherwise),
    whose noisy pairs captions.write_noisy_pairs records."""
    cfg = DataConfig.from_mapping(config)
    cfg.check_source()   # before the tokenizer is opened: the source may bring its own
    tokenizer = resolve_tokenizer(cfg, tokenizer)
    ds, fingerprint, layout, order, src, files = _build(cfg, tokenizer, True, process_index,
                                                        process_count)
    it = InputIterator(ds.__iter__(), fingerprint, layout, ds, order,
                       max_truncated_share=cfg.max_truncated_share,
                       context_length=getattr(tokenizer, "context_length", None), data_files=files)
    it.caption_index = getattr(src, "index", None)
    return it


def build_eval_iterator(config: Mapping[str, Any] | DataConfig,
                        tokenizer: Tokenizer | None = None, *, source: Any = None,
                        process_index: int | None = None,
                        process_count: int | None = None) -> InputIterator:
    """One pass, in order, eval transform: {"image", "text", "mask": bool [B/P]} (+ "label").

    Rows of dropped records and of the padding at the end have mask=False. For random-access
    sources (array_record, tfds, demo) every host yields exactly ceil(ceil(N/P) / (B/P))
    batches, so a multi-host eval never waits on a host that ran out. Tar shards hold unknown
    numbers of records, so hosts may yield different numbers of batches: for multi-host eval
    convert them to ArrayRecord first (scripts/tar_to_array_record.py).

    `source`: any random-access sequence of raw records (records.py; e.g. the evaluation sets of
    input_pipeline.eval_data) read instead of `config.source`/`path`; its batches also carry
    "index" int32 [B/P], the record of each row (-1 where mask=False)."""
    if source is not None:
        return _eval_iterator_from(source, DataConfig.from_mapping(config), tokenizer,
                                   *process_index_count(process_index, process_count))
    ds, fingerprint, layout, *_ = _build(config, tokenizer, False, process_index, process_count)
    return InputIterator(ds.__iter__(), fingerprint, layout)


def _eval_iterator_from(source: Any, cfg: DataConfig, tokenizer: Tokenizer | None, h: int,
                        p: int) -> InputIterator:
    if cfg.batch_size % p:
        raise ValueError(f"eval batch_size={cfg.batch_size} is not divisible by the {p} hosts.")
    decoder = ExampleDecoder(DecodeConfig(
        image_size=cfg.image_size, train=False, augment=None,
        max_image_pixels=cfg.max_image_pixels, min_image_side=cfg.min_image_side))
    ds = grain.MapDataset.range(-(-len(source) // p)).map(
        _Indexed(_EvalPosition(source, h, p, raw=True), decoder))
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=cfg.read_threads,
                                              prefetch_buffer_size=cfg.read_buffer_size))
    ds = _IndexedBatchDataset(ds, cfg.batch_size // p, tokenizer or _NoText(),
                              cfg.normalization, cfg.image_dtype, train=False,
                              image_size=cfg.image_size)
    fingerprint = {"source": f"records:{type(source).__name__}", "num_records": len(source),
                   "train": False, "batch_size": cfg.batch_size}
    layout = {"process_index": h, "process_count": p, "num_workers": 0}
    return InputIterator(ds.__iter__(), fingerprint, layout)


class _EvalPosition:
    """Eval order: host h reads records h, h+P, h+2P, ...; past the end -> padding.
    raw=True: the source holds raw records already (-> (position, record))."""

    def __init__(self, src: Any, process_index: int, process_count: int, raw: bool = False):
        self.src, self.h, self.p, self.raw = src, process_index, process_count, raw

    def __call__(self, j: int) -> Any:
        position = j * self.p + self.h
        if position >= len(self.src):
            return _PAD
        if self.raw:
            return position, self.src[position]
        return 0, position, self.src[position]


class _Indexed:
    """(position, raw record) -> decoded example with "index" = position (or the Skip)."""

    def __init__(self, position: _EvalPosition, decoder: Callable[[Any], Any]):
        self.position, self.decoder = position, decoder

    def __call__(self, j: int) -> Any:
        item = self.position(j)
        if isinstance(item, Skip):
            return item
        ex = self.decoder(item[1])
        return ex if isinstance(ex, Skip) else dict(ex, index=item[0])


class _NoText:
    """Tokenizer for image-only eval batches (their texts are encoded apart)."""
    pad_id, context_length = 0, 1

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return np.zeros((len(texts), 1), np.int32)


class _IndexedBatchDataset(_BatchDataset):
    def __iter__(self) -> "_IndexedBatchIterator":
        return _IndexedBatchIterator(self._parent.__iter__(), self)


class _IndexedBatchIterator(_BatchIterator):
    def _collate(self, rows: list[dict[str, Any] | None], counts: np.ndarray
                 ) -> dict[str, np.ndarray]:
        out = super()._collate(rows, counts)
        index = np.full(self._ds.batch_size, -1, np.int32)
        index[:len(rows)] = [-1 if r is None else r["index"] for r in rows]
        out["index"] = index
        return out
