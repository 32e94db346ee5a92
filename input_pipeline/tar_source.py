"""Streaming webdataset tar shards (img2dataset layout) as a resumable grain IterDataset.

A shard holds members `{key}.jpg|jpeg|png|webp` + `{key}.txt` (+ optional `{key}.json`);
consecutive members with the same key form one record (webdataset's rule: the key is the path
up to the first dot of the file name).

Order, per epoch e:
  1. the list of all shards is permuted with (seed, e) (shard-level shuffle);
  2. host h of P takes every P-th shard of that permutation (disjoint, complete);
  3. grain worker w of W (set by `mp_prefetch` through `set_slice`) takes every W-th of those;
  4. each worker reads its shards in sequence and shuffles records in windows of
     `shuffle_buffer_size` (a shuffle buffer that is filled, permuted with a seed derived from
     the window's position, then drained).

Resumption: the state is (epoch, shard, record at which the current window starts, how many of
its records were already produced). Restoring re-opens that shard, streams past the records
before the window, refills the window and drops what was already produced, so the continuation
is exactly what an uninterrupted run would yield. The cost is re-reading up to one window (plus
the start of its shard) per worker. (A classic reservoir shuffle buffer would need its whole
content in the checkpoint; windows need four integers.)
"""
from __future__ import annotations

import logging
import os
import tarfile
from typing import Any, Iterator, Sequence

import numpy as np
import grain

from prolip_jax.runtime import paths as fs
from input_pipeline.records import Skip

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
TEXT_EXT = "txt"
_SHARD_ORDER_TAG = 0x5A4D   # separates the seed streams of shard order and window shuffles
_WINDOW_TAG = 0x57A1
log = logging.getLogger(__name__)
_warned: set[str] = set()   # corrupt shards already reported by this process


class NoRecordsError(ValueError):
    """A whole epoch of a worker's shards gave no usable record: the run could never fill a batch."""


def split_key(name: str) -> tuple[str, str]:
    """'dir/000123.jpg' -> ('dir/000123', 'jpg'); the extension starts at the first dot."""
    if "/" not in name:   # the usual flat shard: no path arithmetic needed
        stem, dot, ext = name.partition(".")
        return (stem, ext.lower()) if dot else (name, "")
    dirname, base = os.path.split(name)
    if "." not in base:
        return name, ""
    stem, ext = base.split(".", 1)
    return os.path.join(dirname, stem), ext.lower()


class _EndCheckingTarInfo(tarfile.TarInfo):
    """Remembers why tarfile stopped reading headers. In stream mode it ends silently at a
    header that is cut short, missing or garbled, exactly as at the end-of-archive zero
    block; only the latter is a complete archive."""

    @classmethod
    def fromtarfile(cls, tar):
        tar.header_error = None
        try:
            return super().fromtarfile(tar)
        except tarfile.HeaderError as e:
            tar.header_error = e
            raise


_SHARD_ERRORS = (tarfile.TarError, EOFError, OSError, ValueError, UnicodeDecodeError)


def iter_tar_groups(fileobj: Any) -> Iterator[tuple[str, dict[str, bytes]]]:
    """Streams (key, {ext: bytes}) groups of consecutive same-key members of a tar stream.

    Where the archive breaks (damaged data or headers, or a cut anywhere before the
    end-of-archive block), the group in progress is yielded with the members read whole
    (the record may still be complete), then the error is raised.
    """
    key, members, error = None, {}, None
    try:
        for name, data in iter_tar_files(fileobj):
            k, ext = split_key(name)
            if k != key and key is not None:
                yield key, members
                members = {}
            key = k
            members.setdefault(ext, data)
    except _SHARD_ERRORS as e:
        error = e
    if key is not None and members:
        yield key, members
    if error is not None:
        raise error


# Header types read without tarfile: regular files, and the types whose size field tarfile
# ignores (no data follows them). Any other type (GNU long names, sparse files, pax headers,
# unknown types) hands the rest of the stream to tarfile.
_REGULAR = (tarfile.REGTYPE, tarfile.AREGTYPE, tarfile.CONTTYPE)
_NO_DATA = (tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE,
            tarfile.DIRTYPE, tarfile.FIFOTYPE)
_BLOCK = tarfile.BLOCKSIZE
_ZERO_BLOCK = bytes(_BLOCK)
# (start, end) of the numeric fields tarfile.TarInfo.frombuf parses: mode, uid, gid, size,
# mtime, devmajor, devminor. A header with garbage in any of them is invalid to tarfile.
_NUMBER_FIELDS = ((100, 108), (108, 116), (116, 124), (124, 136), (136, 148), (329, 337),
                  (337, 345))


def iter_tar_files(fileobj: Any) -> Iterator[tuple[str, bytes]]:
    """(name, data) of the regular files of a tar stream, in order; raises where it breaks.

    The same members and errors as tarfile's stream mode (with a missing end-of-archive
    block an error too), at a fraction of its cost per member: tarfile spends ~25 us parsing
    each header into a TarInfo, ~3x what the rest of reading a record takes. Headers are
    checked as tarfile checks them (checksum, numeric fields); compressed streams, an unreadable
    first header and the rarer header types go through tarfile itself.
    """
    buf = _read_exactly(fileobj, _BLOCK)
    try:
        parsed = _parse_header(buf)
    except tarfile.HeaderError:   # not a plain tar (compressed?), or broken from the start
        yield from _tarfile_files(_Prepended(buf, fileobj))
        return
    while parsed is not None:   # None: the end-of-archive block
        name, size, kind = parsed
        if kind in _REGULAR:
            data = _read_exactly(fileobj, size)
            if len(data) != size:
                raise tarfile.ReadError(f"unexpected end of data in {name!r}")
            yield name, data
            _read_exactly(fileobj, -size % _BLOCK)   # padding; a cut shows at the next header
        elif kind not in _NO_DATA:
            yield from _tarfile_files(_Prepended(buf, fileobj))
            return
        buf = _read_exactly(fileobj, _BLOCK)
        try:
            parsed = _parse_header(buf)
        except tarfile.HeaderError as e:
            raise tarfile.ReadError(f"no end-of-archive block ({e})") from None


def _parse_header(buf: bytes) -> tuple[str, int, bytes] | None:
    """(name, size, type) of a 512-byte header block, None for the end-of-archive (zero)
    block; raises what tarfile.TarInfo.frombuf raises for the same block."""
    if len(buf) == 0:
        raise tarfile.EmptyHeaderError("empty header")
    if len(buf) != _BLOCK:
        raise tarfile.TruncatedHeaderError("truncated header")
    if buf == _ZERO_BLOCK:
        return None
    chksum = _number(buf[148:156])
    # The unsigned sum is the common case; tarfile.calc_chksums also accepts the signed one.
    if chksum != 256 + sum(buf) - sum(buf[148:156]) and chksum not in tarfile.calc_chksums(buf):
        raise tarfile.InvalidHeaderError("bad checksum")
    size = 0
    for start, end in _NUMBER_FIELDS:
        n = _number(buf[start:end])
        if start == 124:
            size = n
    kind = buf[156:157]
    name = _string(buf[0:100])
    if kind == tarfile.AREGTYPE and name.endswith("/"):
        kind = tarfile.DIRTYPE   # old V7 directory
    prefix = _string(buf[345:500])
    if prefix and kind not in tarfile.GNU_TYPES:
        name = prefix + "/" + name   # ustar long name
    return name, size, kind


def _number(field: bytes) -> int:
    """tarfile.nti: octal digits, or base-256 (first byte 0o200/0o377), else a HeaderError."""
    if field[0] in (0o200, 0o377):
        return tarfile.nti(field)
    try:
        return int(field.split(b"\0", 1)[0].decode("ascii").strip() or "0", 8)
    except ValueError:
        raise tarfile.InvalidHeaderError("invalid header") from None


def _string(field: bytes) -> str:
    """tarfile.nts with tarfile's default encoding for names."""
    return field.split(b"\0", 1)[0].decode(tarfile.ENCODING, "surrogateescape")


def _read_exactly(fileobj: Any, size: int) -> bytes:
    """`size` bytes, fewer only at the end of the stream (a short read is not the end)."""
    data = fileobj.read(size)
    if len(data) == size or not data:
        return data
    parts = [data]
    got = len(data)
    while got < size:
        more = fileobj.read(size - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class _Prepended:
    """A read-only stream: `head`, then the rest of `fileobj` (for tarfile to start over)."""

    def __init__(self, head: bytes, fileobj: Any):
        self.head, self.fileobj = head, fileobj

    def read(self, size: int = -1) -> bytes:
        if not self.head:
            return self.fileobj.read(size)
        if size is None or size < 0:
            data, self.head = self.head + self.fileobj.read(), b""
            return data
        data, self.head = self.head[:size], self.head[size:]
        if len(data) < size:
            data += self.fileobj.read(size - len(data))
        return data


def _tarfile_files(fileobj: Any) -> Iterator[tuple[str, bytes]]:
    """iter_tar_files through tarfile's stream mode (any compression, every header type)."""
    with tarfile.open(fileobj=fileobj, mode="r|*", tarinfo=_EndCheckingTarInfo) as tar:
        for info in tar:
            if not info.isfile():
                continue
            f = tar.extractfile(info)
            yield info.name, f.read() if f is not None else b""
        end = getattr(tar, "header_error", None)
        if not isinstance(end, tarfile.EOFHeaderError):
            raise tarfile.ReadError(f"no end-of-archive block at byte {tar.offset} ({end})")


def group_to_raw(key: str, members: dict[str, bytes], rng_key: tuple[int, ...]
                 ) -> dict[str, Any] | Skip:
    """A member group -> raw record (see records.py), or Skip for a member without partner."""
    image = next((members[e] for e in IMAGE_EXTS if e in members), None)
    txt = members.get(TEXT_EXT)
    if image is None and txt is None:
        return Skip("unpaired_member", key)
    if image is None:
        return Skip("missing_image", key)
    if txt is None:
        return Skip("missing_caption", key)
    return {"image": image, "txt": txt, "key": key, "label": None, "rng_key": rng_key,
            "json": members.get("json")}


def iter_shard(path: str, shard_id: int, epoch: int, start: int = 0
               ) -> Iterator[tuple[int, dict[str, Any] | Skip]]:
    """(group index, raw record | Skip) for the groups of one shard from `start` on.

    A shard that stops being readable (damaged data or headers, or cut short anywhere before
    its end-of-archive block) yields one Skip("corrupt_shard"), logs a warning naming it, and
    ends (the records before the damage are kept). A shard that cannot be opened at all raises: that is a wrong
    path or missing permission, which the user must fix, not data to skip.
    """
    try:
        f = fs.open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"Tar shard {path!r} does not exist (it was listed when the "
                                "pipeline was built).") from None
    with f:
        index = -1
        try:
            for index, (key, members) in enumerate(iter_tar_groups(f)):
                if index >= start:
                    yield index, group_to_raw(key, members, (epoch, shard_id, index))
        except _SHARD_ERRORS as e:
            if path not in _warned:  # once per shard and process: later epochs only count it
                _warned.add(path)
                log.warning("Corrupt tar shard %s: unreadable after %d records (%s: %s); the rest "
                            "of it is skipped and counted as skipped/corrupt_shard.", path,
                            index + 1, type(e).__name__, e)
            yield index + 1, Skip("corrupt_shard", f"{path} ({type(e).__name__}: {e})")


def _no_records(num_shards: int, unreadable: list[str], empty: int, skipped: dict[str, int]) -> str:
    what = [f"{len(unreadable)} unreadable as tar, e.g. {unreadable[0]}" if unreadable else "",
            f"{empty} with no records" if empty else "",
            "records skipped: " + ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())) if skipped else ""]
    return (f"none of the {num_shards} tar shards read here yields a usable record "
            f"({'; '.join(w for w in what if w)}); check --config.data.path and --config.data.source")


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    if not shuffle:
        return np.arange(num_shards)
    return np.random.default_rng((seed, _SHARD_ORDER_TAG, epoch)).permutation(num_shards)


class TarStreamDataset(grain.IterDataset):
    """IterDataset of raw records (or Skips) from tar shards; see the module docstring."""

    def __init__(self, shard_paths: Sequence[str], *, seed: int, shuffle: bool,
                 process_index: int, process_count: int, num_epochs: int | None,
                 shuffle_buffer_size: int):
        super().__init__()
        if not shard_paths:
            raise ValueError("TarStreamDataset needs at least one shard.")
        self.shard_paths = list(shard_paths)
        self.seed, self.shuffle = seed, shuffle
        self.process_index, self.process_count = process_index, process_count
        self.num_epochs = num_epochs
        self.window = max(1, shuffle_buffer_size if shuffle else 1)
        self.worker_slice = slice(None)
        self.origin: dict[str, Any] | None = None

    def set_origin(self, origin: dict[str, Any] | None) -> None:
        """After a re-deal (see `resplit_origin`): {"epoch": e, "shards": [[shard, first
        group], ...]}, what is left of epoch e for all hosts; the run starts there."""
        self.origin = origin

    # The resume interface of the pipeline's iterator (as epoch_order.EpochOrderDataset's).
    @staticmethod
    def initial_origin() -> None:
        return None   # the shard order of epoch 0

    def restore_origin(self, origin: dict[str, Any] | None) -> None:
        self.set_origin(origin)

    def resplit(self, process_count: int, num_workers: int,
                worker_states: Sequence[Sequence[dict[str, Any]]]) -> tuple[dict[str, Any], str]:
        return resplit_origin(self, process_count, num_workers, worker_states)

    def set_slice(self, sl: slice, sequential_slice: bool = False) -> None:
        """Called by grain's `mp_prefetch` on each worker's copy of the dataset."""
        del sequential_slice
        self.worker_slice = sl

    def all_tasks(self, epoch: int) -> list[tuple[int, int]]:
        """(shard index, first group) of every host and worker in `epoch`, in dealing order."""
        if self.origin is not None and epoch == self.origin["epoch"]:
            return [(int(s), int(g)) for s, g in self.origin["shards"]]
        order = shard_order(len(self.shard_paths), self.seed, epoch, self.shuffle)
        return [(int(s), 0) for s in order]

    def tasks_for_epoch(self, epoch: int) -> list[tuple[int, int]]:
        """(shard index, first group) this host/worker reads in `epoch`, in reading order."""
        return self.all_tasks(epoch)[self.process_index::self.process_count][self.worker_slice]

    def shards_for_epoch(self, epoch: int) -> np.ndarray:
        """Indices (into shard_paths) this host/worker reads in `epoch`, in reading order."""
        return np.array([s for s, _ in self.tasks_for_epoch(epoch)], np.int64)

    def __iter__(self) -> "_TarStreamIterator":
        return _TarStreamIterator(self)

    def __str__(self) -> str:
        return (f"TarStreamDataset({len(self.shard_paths)} shards, host {self.process_index}/"
                f"{self.process_count}, window={self.window})")


class _TarStreamIterator(grain.DatasetIterator):
    """Window-shuffled stream over this worker's shards, epoch after epoch."""

    def __init__(self, ds: TarStreamDataset):
        super().__init__()
        self._ds = ds
        start = ds.origin["epoch"] if ds.origin is not None else 0
        self._set_position(epoch=start, shard_pos=0, group_pos=0, index=0)

    def _set_position(self, epoch: int, shard_pos: int, group_pos: int, index: int) -> None:
        self._epoch, self._shard_pos, self._group_pos = epoch, shard_pos, group_pos
        self._index = index
        self._window: list[Any] | None = None   # filled lazily at (shard_pos, group_pos)
        self._reader: Iterator[tuple[int, int, Any]] | None = None

    def _read_epoch(self, epoch: int, shard_pos: int, group_pos: int):
        """Yields (shard_pos, group index, record) from a position to the end of the epoch.

        When the epochs repeat forever, an epoch read from its start that gives not one usable
        record raises NoRecordsError: every later one would give none either, and the batches
        would wait forever (a finite run simply ends)."""
        tasks = self._ds.tasks_for_epoch(epoch)
        whole = shard_pos == 0 and group_pos == 0 and self._ds.num_epochs is None
        usable, empty, skipped, unreadable = 0, 0, {}, []
        for pos in range(shard_pos, len(tasks)):
            sid, first = tasks[pos]
            start = max(first, group_pos) if pos == shard_pos else first
            records = 0
            for g, rec in iter_shard(self._ds.shard_paths[sid], sid, epoch, start):
                if isinstance(rec, Skip):
                    if rec.reason == "corrupt_shard":
                        unreadable.append(rec.key)
                    else:
                        skipped[rec.reason] = skipped.get(rec.reason, 0) + 1
                else:
                    usable += 1
                records += 1
                yield pos, g, rec
            empty += records == 0
        if whole and tasks and not usable:
            raise NoRecordsError(_no_records(len(tasks), unreadable, empty, skipped))

    def _fill_window(self) -> bool:
        """Fills the window starting at the current position; False at the end of the data."""
        empty_epochs = 0
        while True:
            if self._ds.num_epochs is not None and self._epoch >= self._ds.num_epochs:
                return False
            if self._reader is None:
                self._reader = self._read_epoch(self._epoch, self._shard_pos, self._group_pos)
            items = []
            for pos, g, rec in self._reader:
                if not items:  # the window starts at its first record
                    self._shard_pos, self._group_pos = pos, g
                items.append(rec)
                if len(items) == self._ds.window:
                    break
            if items:
                if self._ds.shuffle and len(items) > 1:
                    sid = int(self._ds.shards_for_epoch(self._epoch)[self._shard_pos])
                    rng = np.random.default_rng(
                        (self._ds.seed, _WINDOW_TAG, self._epoch, sid, self._group_pos))
                    items = [items[i] for i in rng.permutation(len(items))]
                self._window = items
                return True
            # This epoch is exhausted for this worker: move on to the next one.
            self._epoch, self._shard_pos, self._group_pos, self._reader = (
                self._epoch + 1, 0, 0, None)
            empty_epochs += 1
            if empty_epochs >= 3:
                return False   # this worker has no shards (the builder rejects that up front)

    def __next__(self) -> dict[str, Any] | Skip:
        self._assert_not_closed()
        while self._window is None or self._index >= len(self._window):
            if self._window is not None:   # window drained: the next starts where reading is
                self._window, self._index = None, 0
                self._shard_pos, self._group_pos = -1, -1   # set by _fill_window
            if not self._fill_window():
                raise StopIteration
        item = self._window[self._index]
        self._index += 1
        return item

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "shard_pos": self._shard_pos,
                "group_pos": self._group_pos, "index": self._index}

    def set_state(self, state: dict[str, Any]) -> None:
        # The window is refilled lazily from its start; `index` records already produced
        # are then dropped (a drained window, index == its size, is simply read past).
        self._set_position(int(state["epoch"]), int(state["shard_pos"]),
                           int(state["group_pos"]), int(state["index"]))


def resplit_origin(ds: TarStreamDataset, process_count: int, num_workers: int,
                   states: Sequence[Sequence[dict[str, Any]]]) -> tuple[dict[str, Any], str]:
    """Re-deals the shards left to read to another host/worker layout.

    `ds` is any host's dataset with the old run's origin; states[h][w] is worker w of old
    host h's iterator state. Returns the new origin (for `set_origin`) and what the change
    costs, in words: each old worker's shuffle window is read again from its start (its
    records already produced are seen twice); a worker already in a later epoch than the
    slowest one has its progress there dropped (those records are seen twice too).
    """
    epoch = min(int(st["epoch"]) for per_host in states for st in per_host)
    tasks = ds.all_tasks(epoch)
    w_count = max(1, num_workers)
    left: dict[int, int] = {}
    twice, ahead_shards = 0, 0
    for h, per_host in enumerate(states):
        for w, st in enumerate(per_host):
            mine = tasks[h::process_count][w::w_count]
            if int(st["epoch"]) > epoch:   # done with this epoch: the later one starts over
                twice += int(st["index"])
                ahead_shards += max(0, int(st["shard_pos"])) + 1
                continue
            pos = max(0, int(st["shard_pos"]))
            if pos < len(mine):
                sid, first = mine[pos]
                left[sid] = max(first, int(st["group_pos"]))
                twice += int(st["index"])
            left.update(mine[pos + 1:])
    origin = {"epoch": epoch, "shards": [[s, left[s]] for s, _ in tasks if s in left]}
    cost = f"{twice} records seen twice (the read part of each worker's shuffle window)"
    if ahead_shards:
        cost += (f", plus up to {ahead_shards} shards of epoch {epoch + 1} that workers "
                 "ahead had started, read again")
    return origin, cost
