"""The project's checkpoint format: an orbax `CheckpointManager` directory.

    CKPT/                       a manager root: one sub-directory per step
      <step>/params/            float32 model parameters (orbax StandardSave, any sharding)
      <step>/config/            JSON: {"model": <reference config.json dict>, ...metadata}
      <step>/...                the trainer adds its own items (optimizer state, data iterator)
      tokenizer-<sha>.<ext>     the tokenizer file of training (its record, with sha256, is the
                                config's "tokenizer" entry; input_pipeline/tokenizer_files.py)

Everything needed to rebuild the model is inside (`params` + `config`), so `prolip_jax.load`,
`scripts/convert_to_pytorch.py` and the evaluators take a CKPT path alone. A path to one
step directory (`CKPT/<step>`) is accepted too. Orbax writes each step into a temporary
directory and renames it when complete, so an interrupted save never looks like a checkpoint.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

import jax
import orbax.checkpoint as ocp
from etils import epath

from prolip_jax.runtime import library_logs, paths
from prolip_jax.core.models import layout
from prolip_jax.core.models.config import ProLIPConfig
from prolip_jax.core.models.prolip import abstract_params

# The thread class orbax runs each write of a save in (orbax 0.12 futures/future.py); private,
# hence looked up softly: without it a failed save's cleanup does not wait for them.
try:
    from orbax.checkpoint._src.futures.future import _SignalingThread as _OrbaxWriteThread
except ImportError:  # pragma: no cover - another orbax layout
    _OrbaxWriteThread = None

PARAMS = "params"
CONFIG = "config"

# Orbax splits the save of a replicated array across its replicas, each writing a slice it cuts
# with an eager `lax.slice`: one small XLA compile per array shape and device at the first save
# (96 for the micro model's parameters on 8 devices, seconds of a first save on the CPU;
# docs/performance.md, "Levers and defaults"). Below 1 MiB a slice saves
# nothing worth that: one replica writes the array whole, as orbax does on GPU anyway
# (orbax/checkpoint/_src/serialization/jax_array_handlers.py). The arrays are the same, only
# their files' chunks differ; either reads back. orbax 0.12 has no public setter for the knob.
REPLICA_PARALLEL_MIN_BYTES = 1 << 20
_ARRAY_HANDLER = ocp.type_handlers.get_type_handler(jax.Array)
if hasattr(_ARRAY_HANDLER, "_min_slice_bytes_for_replica_parallel"):
    _ARRAY_HANDLER._min_slice_bytes_for_replica_parallel = REPLICA_PARALLEL_MIN_BYTES


def save_params(directory: str | os.PathLike, params: Mapping[str, Any], config: ProLIPConfig,
                step: int = 0, metadata: Mapping[str, Any] | None = None, tokenizer: Any = None) -> Path:
    """Writes a params-only checkpoint (what the converter produces) and waits for it.
    `tokenizer`: a tokenizer_files.TokenizerFile to record with it."""
    directory = Path(directory).absolute()
    meta = {"model": config.to_dict(), **(metadata or {})}
    if tokenizer is not None:
        directory.mkdir(parents=True, exist_ok=True)
        meta["tokenizer"] = tokenizer.write_into(directory)
    with ocp.CheckpointManager(directory) as mngr:
        mngr.save(step, args=ocp.args.Composite(**{
            PARAMS: ocp.args.StandardSave(params), CONFIG: ocp.args.JsonSave(meta)}))
        mngr.wait_until_finished()
    return directory / str(step)


def resolve(path: str | os.PathLike, step: int | None = None) -> tuple[Path, int]:
    """(manager root, step) for a CKPT root (latest or given step) or a CKPT/<step> path; a
    bucket URL's root comes back as an etils epath (pathlib would fold `gs://` into `gs:/`)."""
    path = paths.as_path(path) if paths.is_url(path) else Path(path).absolute()
    if not paths.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.name.isdigit() and paths.isdir(path / PARAMS):  # a single step directory
        if step is not None and step != int(path.name):
            raise ValueError(f"{path} is step {path.name}, but step={step} was asked for")
        return path.parent, int(path.name)
    steps = sorted(int(n) for n in paths.listdir(path) if n.isdigit() and paths.isdir(path / n / PARAMS))
    if not steps:
        raise FileNotFoundError(f"{path} holds no complete checkpoint (expected <step>/{PARAMS}/ "
                                "sub-directories as written by prolip_jax)")
    if step is None:
        return path, steps[-1]
    if step not in steps:
        raise FileNotFoundError(f"step {step} not in {path}; available: {steps}")
    return path, step


def _intact_first(*items: str) -> Callable:
    """`read(path, step, ...)` that first checks the step (`check_step` of `items`): a damaged one
    is one DamagedCheckpoint line instead of orbax's and tensorstore's tracebacks. Library
    logging stays off the console meanwhile."""
    def decorate(read: Callable) -> Callable:
        @functools.wraps(read)
        def wrapper(path: str | os.PathLike, step: int | None = None, *args: Any, **kwargs: Any) -> Any:
            root, step = resolve(path, step)  # a missing path: its own one-line error
            with library_logs.to_file(None):
                problem = check_step(root, step, items)
                if problem:
                    raise damaged_error(root, step, problem)
                return read(path, step, *args, **kwargs)
        return wrapper
    return decorate


@_intact_first()
def load_config(path: str | os.PathLike, step: int | None = None) -> tuple[ProLIPConfig, dict, int]:
    """(model config, the whole metadata dict, step) of a checkpoint, without reading params."""
    root, step = resolve(path, step)
    with ocp.CheckpointManager(root, item_names=(PARAMS, CONFIG)) as mngr:
        meta = mngr.restore(step, args=ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))[CONFIG]
    if "model" not in meta:
        raise ValueError(f"{root / str(step) / CONFIG} has no 'model' entry (not a prolip_jax checkpoint?)")
    return ProLIPConfig.from_dict(meta["model"]), dict(meta), step


def training_normalization(meta: Mapping[str, Any]) -> Any:
    """The image normalisation the model was trained with (`data.normalization` of the recorded
    training config, or the "normalization" an import recorded from an exported folder), or
    None when the checkpoint does not say (other params-only checkpoints)."""
    data = (meta.get("train_config") or {}).get("data") or {}
    found = data.get("normalization") or meta.get("normalization")
    return tuple(tuple(x) for x in found) if isinstance(found, list) else found  # JSON: a (mean, std) pair


def saved_layout(root: str | os.PathLike, step: int) -> bool:
    """Whether the params saved at `root/<step>` hold scanned blocks (model.scan_layers, models/layout.py),
    read from the saved tree's metadata."""
    tree = ocp.StandardCheckpointHandler().metadata(epath.Path(root) / str(step) / PARAMS).tree
    return bool(layout.layout_of(tree))


@_intact_first(PARAMS)
def load_params(path: str | os.PathLike, step: int | None = None,
                sharding: jax.sharding.Sharding | Any | None = None,
                scan_layers: bool = False) -> tuple[dict, ProLIPConfig, int]:
    """(params, config, step). `sharding`: one Sharding for every leaf or a matching pytree of
    them (restore onto any mesh); default: the first local device. The params come in the
    unrolled layout, or the scanned one with `scan_layers`, whichever was saved."""

    config, _, step = load_config(path, step)
    root, _ = resolve(path, step)
    saved_scan = saved_layout(root, step)
    abstract = abstract_params(config, scan_layers=saved_scan)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    tree_sharding = None if isinstance(sharding, jax.sharding.Sharding) or saved_scan == scan_layers else sharding
    if tree_sharding is not None:  # given in the other layout: restore, convert, then place
        sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    if isinstance(sharding, jax.sharding.Sharding):
        sharding = jax.tree.map(lambda _: sharding, abstract)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sharding)
    with ocp.CheckpointManager(root, item_names=(PARAMS, CONFIG)) as mngr:
        restored = mngr.restore(step, args=ocp.args.Composite(**{PARAMS: ocp.args.StandardRestore(target)}))
    params = layout.to_layout(restored[PARAMS], scan_layers)
    if tree_sharding is not None:
        params = jax.device_put(params, tree_sharding)
    return params, config, step


def is_checkpoint(path: str | os.PathLike) -> bool:
    try:
        resolve(path)
        return True
    except (FileNotFoundError, ValueError):
        return False


# ----------------------------------------------------------------------------------------
# Damaged steps: files cut short or missing (a disk that filled during a copy, a bucket sync
# cut off), arrays that do not match their recorded shape or dtype, non-finite values.
# ----------------------------------------------------------------------------------------
class DamagedCheckpoint(ValueError):
    """A step folder whose files do not read back as recorded (`check_step` says what)."""


def _check_arrays(item: epath.Path) -> str | None:
    """What is wrong with the arrays of one orbax item folder, or None. Each array is opened and
    read alone, synchronously, through tensorstore (what orbax writes with): an unreadable one
    ends the check at once, with no reads left running (orbax's own restore leaves them to call
    into its closed event loop, a traceback each on stderr)."""
    import numpy as np
    import tensorstore as ts

    try:
        tree = ocp.PyTreeCheckpointer().metadata(item).item_metadata
    except Exception as e:  # noqa: BLE001 - any failure to read is the answer
        return f"metadata unreadable, {_short(e)}"
    if tree is None or getattr(tree, "tree", None) is None:
        return "metadata unreadable, files missing or cut short"
    uri = str(item) if "://" in str(item) else "file://" + os.path.abspath(str(item))
    kvstore = ({"driver": "ocdbt", "base": uri.rstrip("/") + "/"} if (item / "manifest.ocdbt").exists()
               else {"driver": "file", "path": uri.removeprefix("file://").rstrip("/") + "/"})
    for recorded in jax.tree.leaves(tree.tree):
        name = getattr(recorded, "name", None)
        if name is None or not hasattr(recorded, "shape"):  # scalars kept in the metadata itself
            continue
        try:
            array = ts.open({"driver": "zarr", "kvstore": kvstore, "path": name}, open=True).result()
            value = array.read().result()
        except Exception as e:  # noqa: BLE001
            return _short(e) if str(name) in str(e) else f"{name}: {_short(e)}"
        shape, dtype = tuple(recorded.shape), np.dtype(recorded.dtype)
        if value.shape != shape or value.dtype != dtype:
            return f"{name} is {value.dtype}{list(value.shape)}, recorded as {dtype}{list(shape)}"
        if np.issubdtype(value.dtype, np.inexact) and not np.all(np.isfinite(value)):
            return f"{name} holds non-finite values"
    return None


def check_step(root: str | os.PathLike, step: int, items: tuple[str, ...] | None = None) -> str | None:
    """What is wrong with `root/<step>`, in a few words, or None when it is intact: the config
    and data items parse, and every array of each array item (`items`; None: all)
    reads back at the shape and dtype its metadata records, with finite values. One array at a
    time in host memory."""
    step_dir = epath.Path(root) / str(step)
    meta = step_dir / CONFIG / "metadata"
    try:
        json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        return f"{CONFIG}/metadata {'is missing' if isinstance(e, FileNotFoundError) else 'is not valid JSON'}"
    for f in sorted((step_dir / DATA).glob("*.json")) if (step_dir / DATA).is_dir() else ():
        try:
            json.loads(f.read_text())
        except ValueError:
            return f"{DATA}/{f.name} is not valid JSON"
    for name in (PARAMS, OPT_STATE, COUNTERS) if items is None else items:
        item = step_dir / name
        if not item.is_dir():
            if name == PARAMS:
                return f"{PARAMS}/ is missing"
            continue
        problem = _check_arrays(item)
        if problem:
            return f"{name} {problem}" if problem.startswith("metadata") else f"{name}/{problem}"
    return None


_READ_ERRORS = {"OUT_OF_RANGE": "a file is shorter than recorded", "NOT_FOUND": "a file is missing",
                "FAILED_PRECONDITION": "a file is missing or cut short", "DATA_LOSS": "a file is corrupt"}


def _short(e: BaseException) -> str:
    """The gist of an orbax/tensorstore read error: the array it was reading and what went wrong."""
    text = str(e)
    code = re.match(r"([A-Z_]{4,}):", text)
    array = re.search(r'Error reading "([^"/]+)', text)
    what = _READ_ERRORS.get(code.group(1)) if code else None
    if what is None:
        what = (text.splitlines() or [type(e).__name__])[0][:120]
    return f"{array.group(1)}: {what}" if array else what


def move_aside(root: str | os.PathLike, step: int) -> str:
    """Renames `root/<step>` to `<step>.corrupt` (or `.corrupt-2`, ...), never deleting it;
    returns the new name. Checkpoint readers and orbax see only integer-named steps."""
    root = epath.Path(root)
    name, n = f"{step}.corrupt", 1
    while (root / name).exists():
        n += 1
        name = f"{step}.corrupt-{n}"
    (root / str(step)).rename(root / name)
    return name


def damaged_error(root: str | os.PathLike, step: int, problem: str) -> DamagedCheckpoint:
    """The one-line error of the tools for a damaged step, naming the intact steps to pass instead."""
    root = Path(root)
    others = sorted((int(p.name) for p in root.iterdir() if p.name.isdigit() and int(p.name) != step), reverse=True)
    hint = (f"pass an earlier step (--step; available: {', '.join(map(str, others[:5]))})" if others else
            "no other step is saved here")
    return DamagedCheckpoint(f"checkpoint {root / str(step)} is damaged ({problem}): {hint}; resuming the "
                             "training run moves a damaged step aside by itself")


# ----------------------------------------------------------------------------------------
# A save that fails (a full disk, a lost mount): one line, no partial folder left behind.
# ----------------------------------------------------------------------------------------
_TMP = ".orbax-checkpoint-tmp"


def failed_step(error: BaseException, default: int) -> int:
    """The step whose save raised `error` (orbax names its temporary folder), else `default`."""
    found = re.findall(r"(\d+)" + re.escape(_TMP), str(error))
    return int(found[0]) if found else default


def _is_orbax_write(thread: threading.Thread) -> bool:
    return _OrbaxWriteThread is not None and isinstance(thread, _OrbaxWriteThread)


def wait_for_failed_save(mngr: ocp.CheckpointManager, timeout_s: float = 60.0) -> None:
    """Waits until no write of a failed save goes on. Orbax raises at the first failed write
    while the save's other writes (each item's `_sharding` file, its metadata) run on in their
    own threads, and tensorstore creates the folders it writes into: a partial folder removed
    before they end comes back (orbax `future.ChainedFuture` stops at the first error; met on
    CI as a vanishing `_sharding.__lock` under the cleanup)."""
    try:
        mngr.wait_until_finished()
    except Exception:  # noqa: BLE001 - the failure being handled, raised again
        pass
    deadline = time.monotonic() + timeout_s
    for t in threading.enumerate():
        if _is_orbax_write(t) and t is not threading.current_thread():
            try:
                t.join(max(0.0, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - its join re-raises the write's failure, reported already
                pass
    left = [t.name for t in threading.enumerate() if _is_orbax_write(t) and t.is_alive()]
    if left:  # a write that hangs: the cleanup goes ahead (a temporary folder is never read as a step)
        logging.getLogger("absl").warning("after a failed save, orbax writes still running after %.0f s: %s",
                                          timeout_s, left)


def remove_partial_saves(root: str | os.PathLike) -> list[str]:
    """Deletes the temporary folders of unfinished saves under `root` (never a finished step);
    returns their names."""
    root = epath.Path(root)
    removed = []
    for p in root.iterdir() if root.is_dir() else ():
        if _TMP in p.name:
            for _ in range(3):  # a file that vanishes under rmtree (a write still finishing): again
                try:
                    p.rmtree() if p.is_dir() else p.unlink()
                    break
                except FileNotFoundError:
                    pass
            if not p.exists():
                removed.append(p.name)
    return removed


def _size(path: epath.Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def save_failure(root: str | os.PathLike, step: int, error: BaseException, state_bytes: int) -> str:
    """One line for a save of `step` into `root` that raised `error`: why (the disk is full, ...),
    the bytes a step needs (the newest finished step's size, else the state's) and those free,
    and the newest intact checkpoint the run resumes from."""
    import errno
    import shutil

    text = str(error)
    code = re.search(r"os_error_code='(\d+)'", text)
    number = getattr(error, "errno", None) or (int(code.group(1)) if code else None)
    why = ("the disk is full" if number == errno.ENOSPC else os.strerror(number) if number else
           (text.splitlines() or [type(error).__name__])[0][:160])
    local = not paths.is_url(root)
    steps = sorted(int(p.name) for p in epath.Path(root).iterdir() if p.name.isdigit()) if epath.Path(root).is_dir() else []
    needed = _size(epath.Path(root) / str(steps[-1])) if steps and local else state_bytes
    room = f"; a step needs ~{_bytes(needed)}" + (f", {_bytes(shutil.disk_usage(root).free)} free" if local else "")
    resume = (f"rerun the same command to resume from step {steps[-1]} ({epath.Path(root) / str(steps[-1])})"
              if steps else "no checkpoint was written: a rerun starts from step 0")
    return (f"could not write checkpoint step {step} to {root}: {why}{room}; the partial folder was removed. "
            f"Free space (or lower --config.keep_checkpoints), then {resume}")


def _bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


# ----------------------------------------------------------------------------------------
class StateSnapshot:
    """The iterator position frozen at save time, for grain's orbax checkpoint handler.

    Orbax saves asynchronously; handing it the live iterator would record wherever the
    iterator has moved on to by then. The handler calls `get_state()` (bytes) on save and
    `set_state(bytes)` + `start_prefetch()` on restore.
    """

    def __init__(self, state: bytes | None = None):
        self.state = state

    @classmethod
    def of(cls, iterator: Any) -> "StateSnapshot":
        return cls(json.dumps(iterator.get_state()).encode())

    def get_state(self) -> bytes:
        return self.state

    def set_state(self, state: bytes) -> None:
        self.state = state

    def start_prefetch(self) -> None:
        pass

    def restore_into(self, iterator: Any) -> None:
        iterator.set_state(json.loads(self.state.decode()))


# The trainer's checkpoints: the same directory layout plus optimiser, counters and data.
# ----------------------------------------------------------------------------------------
OPT_STATE = "opt_state"
COUNTERS = "counters"
DATA = "data"
TRAIN_ITEMS = (PARAMS, OPT_STATE, COUNTERS, CONFIG, DATA)


def save_train_state(mngr: ocp.CheckpointManager, step: int, state: Any, model_config: ProLIPConfig,
                     train_config: Mapping[str, Any], data: Any, force: bool = False, locked: list[str] = (),
                     data_state: StateSnapshot | None = None, tokenizer: Any = None) -> None:
    """Asynchronous save of params, optimiser state, counters, config and the data position.
    `train_config`: the run's config as JSON values (prolip_jax.trainer.config.record); `locked`:
    the parameter paths locked at `step` (recorded in the config item); `data_state`: the data
    position to record instead of `data`'s own (the one before a failed read); `tokenizer`: the
    tokenizer_files.TokenizerFile the run reads its captions with (the model travels with it)."""
    import grain  # here, not at the top: loading a model for inference needs no grain

    meta = {"model": model_config.to_dict(), "train_config": dict(train_config),
            "locked": list(locked)}
    if tokenizer is not None:
        meta["tokenizer"] = tokenizer.record(tokenizer.stored_name)
        if jax.process_index() == 0:  # one writer for the shared directory
            tokenizer.write_into(mngr.directory)
    mngr.save(step, force=force, args=ocp.args.Composite(**{
        PARAMS: ocp.args.StandardSave(state.params),
        OPT_STATE: ocp.args.StandardSave(state.opt_state),
        COUNTERS: ocp.args.StandardSave({"step": state.step, "skipped": state.skipped}),
        CONFIG: ocp.args.JsonSave(meta),
        DATA: grain.checkpoint.CheckpointSave(data_state or StateSnapshot.of(data)),
    }))


def restore_train_state(mngr: ocp.CheckpointManager, step: int, abstract: Any, data: Any) -> Any:
    """The train state at `step`, placed as `abstract` (a TrainState of ShapeDtypeStructs with
    shardings: any mesh); `data` is moved to the position it had when that step was saved,
    also when the run now has another process or worker count (see `restore_data_state`)."""
    restored = mngr.restore(step, args=ocp.args.Composite(**{
        PARAMS: ocp.args.StandardRestore(abstract.params),
        OPT_STATE: ocp.args.StandardRestore(abstract.opt_state),
        COUNTERS: ocp.args.StandardRestore({"step": abstract.step, "skipped": abstract.skipped}),
    }))
    restore_data_state(epath.Path(mngr.directory) / str(step) / DATA, data)
    counters = restored[COUNTERS]
    if int(counters["step"]) != step:
        raise ValueError(f"checkpoint {step} holds step counter {int(counters['step'])}")
    return type(abstract)(step=counters["step"], params=restored[PARAMS], opt_state=restored[OPT_STATE],
                           skipped=counters["skipped"])


_DATA_FILE = re.compile(r"^process_(\d+)-of-(\d+)\.json$")


def restore_data_state(directory: str | os.PathLike, data: Any) -> None:
    """Moves `data` to the position saved in `directory` (grain's CheckpointSave writes one
    `process_<i>-of-<n>.json` per process). With the saved process count, each process reads
    its own file; with another one (or another worker count), the states of all n saved
    processes are read (the checkpoint directory is shared) and the data re-split."""
    directory = epath.Path(directory)   # also gs:// and other remote checkpoint roots
    files: dict[tuple[int, int], Any] = {}
    for f in directory.glob("process_*-of-*.json") if directory.is_dir() else ():
        m = _DATA_FILE.match(f.name)
        if m:
            files[int(m.group(1)), int(m.group(2))] = f
    counts = sorted({n for _, n in files})
    if len(counts) != 1:
        raise FileNotFoundError(f"{directory} holds no data iterator state (process_<i>-of-<n>.json)"
                                if not counts else
                                f"{directory} mixes the data states of runs with {counts} processes")
    saved = counts[0]
    me, now = jax.process_index(), jax.process_count()
    missing = sorted(set(range(saved)) - {i for i, _ in files})
    if saved == now and (me, saved) in files:
        state = json.loads(files[me, saved].read_text())
        if getattr(data, "layout", None) in (None, state.get("layout")):
            data.set_state(state)   # the common case: same layout, this process's own file
            return
    if not hasattr(data, "set_states"):   # RandomBatches: its position is global already
        if (0, saved) not in files:
            raise FileNotFoundError(f"{directory / f'process_0-of-{saved}.json'} is missing")
        data.set_state(json.loads(files[0, saved].read_text()))
        if me == 0 and saved != now:
            logging.warning("Data resumed on a new layout: %d -> %d processes (random batches: exact).",
                            saved, now)
        return
    if missing:
        raise FileNotFoundError(
            f"Resuming the data of a {saved}-process run on {now} processes needs the state of every "
            f"saved process, but {', '.join(f'process_{i}-of-{saved}.json' for i in missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing from {directory}.")
    data.set_states([json.loads(files[i, saved].read_text()) for i in range(saved)])


# ----------------------------------------------------------------------------------------
# The best checkpoint by an evaluation metric (the reference's `--save-best-unc`).
# ----------------------------------------------------------------------------------------
# `config.keep_best` knobs. The reference (naver-ai/prolip src/prolip_train/main.py,
# `--save-best-unc`) keeps the checkpoint whose uncertainty-vs-accuracy bin correlation is the
# most negative, starting from 0 (`prev_best_unc > unc`): metric = a zeroshot evaluator's
# "unc_corr_csd", mode "min", baseline 0.
@dataclasses.dataclass(frozen=True)
class KeepBestConfig:
    """`config.keep_best`: keep the checkpoint whose logged `metric` was best so far."""

    metric: str = ""  # a logged metric name, e.g. "eval/zeroshot/imagenet/unc_corr_csd"; "" = off
    mode: Literal["min", "max"] = "min"  # which direction is better
    baseline: float = 0.0  # a value must beat this (and every earlier one) to be kept


class BestKeeper:
    """Keeps `WORKDIR/best/<step>` (params + config, as `save_params` writes), the step whose
    `metric` was best so far; the value survives restarts (it is read back from the config item)."""

    def __init__(self, directory: str | os.PathLike, settings: KeepBestConfig, model_config: ProLIPConfig,
                 tokenizer: Any = None):
        self.tokenizer = tokenizer  # a tokenizer_files.TokenizerFile recorded with each kept step
        self.metric, self.mode = settings.metric, settings.mode
        self.model_config = model_config
        self.mngr = ocp.CheckpointManager(Path(directory).absolute(), item_names=(PARAMS, CONFIG),
                                          options=ocp.CheckpointManagerOptions(max_to_keep=1, create=True))
        self.best = float(settings.baseline)
        step = self.mngr.latest_step()
        if step is not None:
            meta = self.mngr.restore(step, args=ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))[CONFIG]
            self.best = float(meta["best"]["value"])

    def offer(self, step: int, value: float, params: Any) -> bool:
        """Saves `params` if `value` beats the best so far; True if it did."""
        better = value < self.best if self.mode == "min" else value > self.best
        if not better:  # NaN is never better
            return False
        self.best = float(value)
        meta = {"model": self.model_config.to_dict(), "best": {"metric": self.metric, "value": self.best, "step": step}}
        if self.tokenizer is not None:
            meta["tokenizer"] = self.tokenizer.record(self.tokenizer.stored_name)
            if jax.process_index() == 0:
                self.tokenizer.write_into(self.mngr.directory)
        self.mngr.save(step, args=ocp.args.Composite(**{PARAMS: ocp.args.StandardSave(params),
                                                        CONFIG: ocp.args.JsonSave(meta)}), force=True)
        self.mngr.wait_until_finished()
        return True

    def close(self) -> None:
        self.mngr.close()
