"""What the user sees during training: `metrics.jsonl`, TensorBoard scalars and a stdout line.

`MetricWriter.write(step, {"loss": ..., ...})` (called every `log_steps` by the trainer):

* appends `{"step": N, "loss": ..., ...}` as one line to `WORKDIR/metrics.jsonl`, flushed at
  once. Non-finite values are written as JSON `null` (NaN/inf are not valid JSON) and the key
  is kept, so a NaN loss is visible and every line has the same keys.
* writes each value as a TensorBoard scalar into `WORKDIR/tb/` through tensorboardX (no
  TensorFlow needed); non-finite values go to TensorBoard unchanged (it plots them as gaps).
* prints `[  1200/78800   1.5%] ETA 3h12m | loss 5.853 (ppcl 5.84, ...) | lr 5e-4` to stdout:
  the names in `console` (a line each: the trainer's headline training metrics, then each
  evaluator's headline), or every value when it is None. Names that share a parent are written
  once (`loss 5.853 (ppcl 5.84, vib 4e-4)`, `zeroshot/object top1_csd 12.5, top1_dot 11`), a
  line is cut to `line_width` columns, and it says how many values only the files hold when
  that fits. The ETA comes from the wall time per step over the last `eta_window` writes (the
  interval before the first write, which holds compilation, is never part of it). Per-reason
  skip counters ("data/skipped/<reason>") are left off while they are 0: they stay in the files.

Resume: `resume_step=N` drops the lines of an earlier run with step >= N (the file is
rewritten atomically, so a crash cannot lose the good lines) and asks TensorBoard to purge
its events with step >= N, so steps logged again after a restart appear once.

Only the chief (process 0) writes; other processes get a writer whose methods do nothing.
Bucket workdirs ("gs://..."): every file goes through the path layer (prolip_jax/runtime/paths.py,
gcsfs for gs://). Object stores cannot append, so there metrics.jsonl is a set of objects:
`metrics.jsonl`, then `metrics-00001.jsonl`, ... (`jsonl_parts`; `read_jsonl` reads the set).
Only the newest is rewritten at each write, and a new one starts once it holds ROLL_RECORDS
lines or is ROLL_SECONDS old, so a week-long run never re-uploads its history. TensorBoard event
files roll the same way at ROLL_EVENT_BYTES (`_BucketEventFile`, in place of tensorboardX's own
gs:// writer, which needs google-cloud-storage): `<name>`, `<name>.00001`, ..., which TensorBoard
reads in that order like any event files of one folder.
"""
from __future__ import annotations

import collections
import json
import logging
import math
import os
import re
import struct
import sys
import time
from typing import Any, Callable, Mapping, Sequence, TextIO

import numpy as np

from prolip_jax.runtime import paths

JSONL_NAME = "metrics.jsonl"
TB_DIR = "tb"
ROLL_RECORDS = 500
ROLL_SECONDS = 600.0
ROLL_EVENT_BYTES = 1 << 20


def _part_name(path: str, i: int) -> str:
    """The i-th object of a metrics.jsonl set: the file itself, then <stem>-NNNNN.jsonl beside it."""
    if i == 0:
        return path
    stem = path[:-len(".jsonl")] if path.endswith(".jsonl") else path
    return f"{stem}-{i:05d}.jsonl"


def jsonl_parts(path: str | os.PathLike) -> list[str]:
    """The objects of the metrics.jsonl at `path` in order (one for a local file)."""
    path = os.fspath(path)
    directory, name = path.rstrip("/").rsplit("/", 1) if "/" in path else (".", path)
    stem = name[:-len(".jsonl")] if name.endswith(".jsonl") else name
    pattern = re.compile(re.escape(stem) + r"-(\d{5,})\.jsonl$")
    names = paths.listdir(directory) if paths.isdir(directory) else []
    numbered = sorted((int(m.group(1)), n) for n in names if (m := pattern.match(n)))
    return [path] + [paths.join(directory, n) for _, n in numbered]


def _to_number(value: Any) -> int | float:
    """Python int/float from a Python, numpy or jax scalar (a 0-d or size-1 array)."""
    arr = np.asarray(value)
    if arr.size != 1:
        raise ValueError(f"metric values must be scalars, got shape {arr.shape}")
    item = arr.reshape(()).item()
    if isinstance(item, bool):
        return int(item)
    if isinstance(item, int):
        return item
    return float(item)


def _json_value(x: int | float) -> int | float | None:
    return x if isinstance(x, int) or math.isfinite(x) else None


def format_duration(seconds: float) -> str:
    """'3h12m', '4m05s', '12s'; days as '2d03h'."""
    s = int(round(max(seconds, 0.0)))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d{h:02d}h"
    if h:
        return f"{h}h{m:02d}m"
    if m:
        return f"{m}m{s:02d}s"
    return f"{s}s"


def format_value(v: int | float) -> str:
    """A console value in a few characters: integers as they are, 4 significant digits, no
    fraction from 1,000 on, short exponents ('5e-4')."""
    if isinstance(v, int) or not math.isfinite(v):
        return str(v)
    if v != 0 and (abs(v) < 1e-3 or abs(v) >= 1e6):
        mantissa, _, exponent = f"{v:.2e}".partition("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.4g}"


def _fields(names: Sequence[str], values: Mapping[str, int | float]) -> list[str]:
    """`name value` per name; a run of names under one parent is written once: a parent shown
    just before its children gives `loss 5.853 (ppcl 5.84, vib 4e-4)`, children alone
    `zeroshot/object top1_csd 12.5, top1_dot 11`."""
    groups: list[tuple[str, str | None, list[str]]] = []  # (parent, its value or None, children)
    for name in names:
        parent, _, leaf = name.rpartition("/")
        if groups and parent and groups[-1][0] == parent:
            groups[-1][2].append(f"{leaf} {format_value(values[name])}")
        elif any(n.startswith(name + "/") for n in names):
            groups.append((name, format_value(values[name]), []))
        elif parent:
            groups.append((parent, None, [f"{leaf} {format_value(values[name])}"]))
        else:
            groups.append((name, format_value(values[name]), []))
    out = []
    for parent, value, children in groups:
        if value is not None:
            out.append(f"{parent} {value}" + (f" ({', '.join(children)})" if children else ""))
        elif len(children) == 1:
            out.append(f"{parent}/{children[0]}")
        else:
            out.append(f"{parent} {', '.join(children)}")
    return out


def _is_remote(path: str) -> bool:
    return paths.is_url(path)


class _BucketEventFile:
    """A TensorBoard event file in a bucket: buffered, uploaded whole through the path layer on
    each flush (object stores cannot append), rolled to `<path>.NNNNN` past ROLL_EVENT_BYTES or
    ROLL_SECONDS (tensorboardX writes each event with one `write`, so every object holds whole
    records). Stands in for tensorboardX's file handle."""

    def __init__(self, path: str):
        self.base, self.part, self.buffer, self.started = path, 0, bytearray(), time.monotonic()

    @property
    def path(self) -> str:
        return self.base if self.part == 0 else f"{self.base}.{self.part:05d}"

    def write(self, data: bytes) -> None:
        self.buffer += data

    def flush(self) -> None:
        if not self.buffer and self.part:
            return
        paths.write_bytes_atomic(self.path, bytes(self.buffer))
        if len(self.buffer) >= ROLL_EVENT_BYTES or time.monotonic() - self.started >= ROLL_SECONDS:
            self.part, self.buffer, self.started = self.part + 1, bytearray(), time.monotonic()

    def close(self) -> None:
        self.flush()


class _BucketEventFiles:
    """tensorboardX's writer factory interface (record_writer.register_writer_factory)."""

    def open(self, path: str) -> _BucketEventFile:
        return _BucketEventFile(path)

    def directory_check(self, path: str) -> None:
        paths.makedirs(path)


class MetricWriter:
    """Metric sink for the trainer; see the module docstring. Use as a context manager or close()."""

    def __init__(self, workdir: str, total_steps: int, is_chief: bool = True, resume_step: int = 0,
                 eta_window: int = 20, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, line_width: int = 160):
        """workdir: local path or fsspec URL; total_steps: for progress and ETA; resume_step: the
        first step this run logs (earlier lines with step >= resume_step are dropped); stream:
        where the progress line goes (default sys.stdout); clock: seconds, injectable for tests;
        line_width: the longest console line (a terminal's width, so that lines never wrap)."""
        self.total_steps = int(total_steps)
        self.line_width = line_width
        self.is_chief = is_chief
        self._stream = stream
        self._clock = clock
        self._times: collections.deque[tuple[int, float]] = collections.deque(maxlen=max(eta_window, 2))
        self._tb = None
        self._file = None
        self._remote_lines: list[str] | None = None
        if not is_chief:
            return
        self.path = workdir.rstrip("/") + "/" + JSONL_NAME
        if _is_remote(workdir):
            from tensorboardX import record_writer  # deferred like SummaryWriter below

            # Event files in a bucket go through the path layer too (set before the writer opens).
            record_writer.register_writer_factory(paths.protocol(workdir), _BucketEventFiles())
            self._resume_remote(resume_step)
        else:
            kept, _ = self._load_lines_before(resume_step)
            os.makedirs(workdir, exist_ok=True)
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, self.path)  # atomic: either the old or the filtered file exists
            self._file = open(self.path, "a")
        from tensorboardX import SummaryWriter  # deferred: non-chief processes never need it

        # tensorboardX logs a warning for every non-finite scalar (a dozen per skipped step);
        # non-finite values are expected here and reported once, in the line and the skip count.
        logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)

        # purge_step makes TensorBoard drop the earlier run's events with step >= resume_step.
        # The suffix keeps a restart within the same second (tensorboardX names files by whole
        # seconds and opens them with "wb") from overwriting the earlier file, and sorts after it.
        self._tb = SummaryWriter(workdir.rstrip("/") + "/" + TB_DIR,
                                 purge_step=resume_step if resume_step > 0 else None,
                                 filename_suffix=f".{time.time_ns()}")

    # ------------------------------------------------------------------------------ jsonl files
    def _load_lines_before(self, resume_step: int, path: str | None = None) -> tuple[list[str], int]:
        """(the lines of an existing metrics.jsonl, or of one object of its set, with step <
        resume_step, how many lines it holds); torn lines are dropped."""
        path = path or self.path
        lines = [line for line in (paths.read_text(path) if paths.exists(path) else "").splitlines() if line.strip()]
        kept = []
        for line in lines:
            try:
                keep = int(json.loads(line)["step"]) < resume_step
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a crash mid-write
            if keep:
                kept.append(line + "\n")
        return kept, len(lines)

    def _resume_remote(self, resume_step: int) -> None:
        """Continues the bucket's set of objects: the first one holding a line with step >=
        resume_step (or a torn one) is cut there and the later ones deleted, so an earlier run's
        steps logged again appear once; writing goes on in the last one kept."""
        parts = jsonl_parts(self.path) if paths.exists(self.path) else [self.path]
        for i, part in enumerate(parts):
            self._remote_lines, written = self._load_lines_before(resume_step, part)
            self._part = i
            if len(self._remote_lines) < written:
                for later in parts[i + 1:]:
                    paths.remove(later)
                break
        self._part_started = self._clock()
        self._rewrite_remote()

    def _rewrite_remote(self) -> None:
        """Uploads the newest object whole; rolls to the next one once it is full or old."""
        paths.write_text_atomic(_part_name(self.path, self._part), "".join(self._remote_lines))
        if len(self._remote_lines) >= ROLL_RECORDS or self._clock() - self._part_started >= ROLL_SECONDS:
            self._part, self._remote_lines, self._part_started = self._part + 1, [], self._clock()

    # ---------------------------------------------------------------------------------- writing
    def write(self, step: int, metrics: Mapping[str, Any], console: Sequence[Sequence[str]] | None = None) -> None:
        """Log `metrics` (name -> scalar) for `step` to the files; stdout gets a line per list of
        names in `console` (default: one line of all of them) and how many more the files hold."""
        if not self.is_chief:
            return
        if self._tb is None:
            raise RuntimeError("MetricWriter.write() after close()")
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number; rename the metric")
        step = int(step)
        values = {name: _to_number(v) for name, v in metrics.items()}

        line = json.dumps({"step": step, **{k: _json_value(v) for k, v in values.items()}},
                          allow_nan=False) + "\n"
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
        else:
            self._remote_lines.append(line)
            self._rewrite_remote()

        for name, v in values.items():
            self._tb.add_scalar(name, v, global_step=step)
        self._tb.flush()

        self._times.append((step, self._clock()))
        groups = [list(values)] if console is None else [[k for k in line if k in values] for line in console]
        groups = [[k for k in line if not ("/skipped/" in k and values[k] == 0)] for line in groups]
        lines = self.progress_lines(step, [line for line in groups if line] or [[]], values)
        print("\n".join(lines), file=self._stream or sys.stdout, flush=True)

    def seconds_per_step(self) -> float | None:
        """Wall seconds per step over the last `eta_window` writes; None before two writes."""
        if len(self._times) < 2:
            return None
        (s0, t0), (s1, t1) = self._times[0], self._times[-1]
        return (t1 - t0) / (s1 - s0) if s1 > s0 else None

    def progress_lines(self, step: int, lines: Sequence[Sequence[str]],
                       values: Mapping[str, int | float]) -> list[str]:
        """One text line per list of names in `lines`, each at most `line_width` characters
        (names that do not fit are left off), the last saying how many values are not shown."""
        total = max(self.total_steps, 1)
        width = len(str(self.total_steps))
        sps = self.seconds_per_step()
        eta = "?" if sps is None else format_duration(sps * max(self.total_steps - step, 0))
        tag = f"[{step:>{width}d}/{self.total_steps} {100.0 * step / total:5.1f}%]"
        out, shown = [], 0
        for i, names in enumerate(lines):
            head, names = f"{tag} ETA {eta}" if i == 0 else tag, list(names)
            while names and len(" | ".join([head, *_fields(names, values)])) > self.line_width:
                names.pop()
            out.append(" | ".join([head, *_fields(names, values)]))
            shown += len(names)
        more = f" | +{len(values) - shown} more in {JSONL_NAME}"
        if shown < len(values) and len(out[-1]) + len(more) <= self.line_width:
            out[-1] += more
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------ reading back
def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl, in a bucket its whole set of objects (`jsonl_parts`); null
    stays None. A last line cut short (a run killed
    while writing it) is skipped with a warning; a bad line before the last is a ValueError
    naming it."""
    lines = [line for part in jsonl_parts(path) for line in paths.read_text(part).splitlines()]
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if any(rest.strip() for rest in lines[i + 1:]):
                raise ValueError(f"{path}: line {i + 1} is not valid JSON") from None
            logging.getLogger(__name__).warning("%s: its last line is cut short (the run was stopped while "
                                                "writing it); read the %d lines before it", path, len(records))
    return records


def read_tensorboard_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """Scalars of every event file in `logdir`: tag -> [(step, value), ...] in file order.

    A TF-free reader of the TFRecord framing (u64 length, u32 masked crc, data, u32 masked
    crc), with both checksums verified, decoding tensorboardX's Event protos. Applies
    TensorBoard's purge rule: a SessionLog START at step T (written for `resume_step`) drops
    the events read so far with step >= T.
    """
    from tensorboardX.record_writer import masked_crc32c
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    for name in paths.listdir(logdir):
        if "tfevents" not in name:
            continue
        data = paths.read_bytes(paths.join(logdir, name))
        pos = 0
        while pos + 12 <= len(data):
            header = data[pos:pos + 8]
            (length,) = struct.unpack("<Q", header)
            (crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
            if crc != masked_crc32c(header):
                raise ValueError(f"{name}: corrupt record header at byte {pos}")
            body = data[pos + 12:pos + 12 + length]
            (body_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
            if body_crc != masked_crc32c(body):
                raise ValueError(f"{name}: corrupt record at byte {pos}")
            pos += 16 + length
            event = event_pb2.Event.FromString(body)
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                for tag in scalars:
                    scalars[tag] = [(s, v) for s, v in scalars[tag] if s < event.step]
            for value in event.summary.value:
                scalars[value.tag].append((event.step, value.simple_value))
    return dict(scalars)
