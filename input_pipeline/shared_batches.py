"""Batch images sent from grain worker processes in reused shared memory.

grain's mp_prefetch sends each batch's arrays in a new shared-memory segment that the main
process unlinks when it lets go of the array. A new segment is fresh memory: every 4 KB page of
it is faulted in and zeroed by the kernel (and, in a VM that hands freed memory back, by the
host), a few percent of a worker's time per image where a reused buffer's pages cost next to
nothing (`benchmarks/benchmark_input.py`; the figures: docs/performance.md, "Input pipeline
against a bare PIL loop").

So each worker keeps a ring of segments and writes every batch's images into a free slot
(`ImageRing.take`); what crosses grain's queue is a small `SharedImages` descriptor. The main
process (`Receiver`) copies the images out (a small cost, into memory malloc reuses) and marks
the slot free in the ring's flag segment. The copy is what makes reuse safe: the trainer may keep
a batch alive for as long as it likes (and jax on CPU may alias a numpy array rather than copy it),
so the main process never hands out a view of a slot. A worker that finds no free slot (the main
process is behind by more than the ring) sends that batch in a one-off segment, as grain would:
no waiting, so no worker can block on a main process that has stopped reading.

Names: the worker creates and unlinks every segment (at its normal exit, via multiprocessing's
exit hooks). The main process maps them by name without registering them with the resource
tracker, so it never unlinks what a running worker owns; when it closes, after the workers have
stopped, it unlinks the ring segments a killed worker left (`Receiver.close`).
"""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
from dataclasses import dataclass
from multiprocessing import shared_memory, util
from typing import Any

import numpy as np

_MADV_POPULATE_WRITE = 23   # Linux >= 5.14 (uapi/asm-generic/mman-common.h)
_madvise = None
_FREE, _BUSY = 0, 1


def prefault(array: np.ndarray) -> np.ndarray:
    """Maps in all pages of a fresh shared-memory array in one madvise call rather than one fault
    per 4 KB page on first write (less system time per image; docs/performance.md). Without the
    call (not Linux, an older kernel) the pages fault in on first write; the contents are the
    same."""
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                _madvise = libc.madvise
            except (OSError, AttributeError):
                pass
    if _madvise and array.nbytes and _madvise(array.ctypes.data, array.nbytes, _MADV_POPULATE_WRITE):
        _madvise = False   # EINVAL: a kernel without it; stop asking
    return array


def _free_shm_bytes() -> int | None:
    """Bytes free in /dev/shm (None where there is none: not Linux)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def ring_slots(per_worker_buffer_size: int) -> int:
    """Slots a worker's ring needs so that it never falls back in steady state: the batches it
    has in flight are its queue and the main process's interleave buffer (grain's
    mp_prefetch: per_worker_buffer_size each), the one in each of their hands, and one spare."""
    return 2 * per_worker_buffer_size + 3


def _check_room(nbytes: int, slots: int) -> None:
    """A full /dev/shm would kill the worker with SIGBUS on the first write into the new segment
    (tmpfs allocates pages as they are touched); say what to change instead."""
    free = _free_shm_bytes()
    if free is not None and free < nbytes:
        raise OSError(
            f"/dev/shm has {free / 2**20:.0f} MiB free, and an input worker needs "
            f"{nbytes / 2**20:.1f} MiB more for a batch of images (each worker keeps up to "
            f"{slots} batches there, more with a larger data.per_worker_buffer_size). Enlarge "
            "/dev/shm (in a container: docker run --shm-size=...) or lower data.num_workers, "
            "data.per_worker_buffer_size or the per-host batch size.")


@dataclass(frozen=True)
class SharedImages:
    """What crosses grain's queue instead of the images: slot `slot` of the ring whose flags
    live in segment `flags`, holding an array of `shape` and `dtype` in segment `data`."""
    flags: str
    slot: int
    data: str
    shape: tuple[int, ...]
    dtype: str


class ImageRing:
    """Worker side: `slots` reusable shared-memory buffers and one flag byte per slot (busy
    while the main process has not copied the slot out)."""

    def __init__(self, slots: int):
        if slots < 1:
            raise ValueError(f"An image ring needs at least one slot; got {slots}.")
        self._flags = shared_memory.SharedMemory(create=True, size=slots)
        self._flags.buf[:slots] = bytes(slots)
        self._data: list[shared_memory.SharedMemory | None] = [None] * slots
        self._next = 0
        self._made = 0   # data segments are named <flags>-<slot>-<n>: a main process can find them all
        # Unlinks the names when the worker process ends normally (grain stops its workers by
        # an event, and multiprocessing runs these hooks as the process exits).
        util.Finalize(self, ImageRing._unlink, args=([self._flags], self._data), exitpriority=10)

    @property
    def slots(self) -> int:
        return len(self._data)

    def take(self, shape: tuple[int, ...], dtype: Any) -> tuple[np.ndarray, Any]:
        """(array to write the batch's images into, what to send in its place): a free slot of
        the ring and its SharedImages, or, with every slot still busy, a one-off grain segment
        (grain's SharedMemoryArray, sent and unlinked by grain as usual) for both."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        for i in range(self.slots):
            k = (self._next + i) % self.slots
            if self._flags.buf[k] == _FREE:
                break
        else:
            from grain._src.python.ipc import shared_memory_array
            _check_room(nbytes, self.slots)
            array = prefault(shared_memory_array.SharedMemoryArray(shape, dtype))
            return array, array
        self._next = (k + 1) % self.slots
        segment = self._data[k]
        if segment is None or segment.size < nbytes:
            if segment is not None:   # a larger batch than before: this slot's segment grows
                ImageRing._unlink([segment])
                self._data[k] = None
            _check_room(nbytes, self.slots)
            segment = self._data[k] = shared_memory.SharedMemory(
                create=True, size=max(nbytes, 1), name=f"{self._flags.name}-{k}-{self._made}")
            self._made += 1
            fresh = True
        else:
            fresh = False
        array = np.ndarray(shape, dtype, buffer=segment.buf)
        if fresh:
            prefault(array)
        self._flags.buf[k] = _BUSY
        return array, SharedImages(self._flags.name, k, segment.name, tuple(shape), dtype.str)

    def release_all(self) -> None:
        """Marks every slot free. Only for a worker told to set its state: grain's main process
        discards, unread, every element the worker sent before that (grain's
        process_prefetch.py, _SetStateIsDone), so no slot is still being read."""
        self._flags.buf[:self.slots] = bytes(self.slots)

    @staticmethod
    def _unlink(*groups: list[shared_memory.SharedMemory | None]) -> None:
        for group in groups:
            for segment in group:
                if segment is None:
                    continue
                try:
                    segment.close()
                except BufferError:   # an array still views it; the name goes all the same
                    pass
                try:
                    segment.unlink()
                except FileNotFoundError:
                    pass


def _map(name: str) -> mmap.mmap:
    """Maps an existing POSIX shared-memory segment by name. Not through SharedMemory: in Python
    3.11 attaching registers the name with the resource tracker, which would then unlink a
    segment the worker still uses (or warn about it) when this process exits."""
    import _posixshmem
    fd = _posixshmem.shm_open("/" + name.lstrip("/"), os.O_RDWR, mode=0o600)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def _release(name: str) -> None:
    """Unlinks segment `name` if it still exists, and unregisters it from the resource tracker
    (where the worker that created it registered it)."""
    import _posixshmem
    from multiprocessing import resource_tracker

    name = "/" + name.lstrip("/")
    try:
        _posixshmem.shm_unlink(name)
    except FileNotFoundError:   # its worker unlinked (and unregistered) it
        return
    resource_tracker.unregister(name, "shared_memory")


class Receiver:
    """Main-process side: turns SharedImages back into arrays this process owns."""

    def __init__(self):
        self._flags: dict[str, mmap.mmap] = {}
        self._data: dict[tuple[str, int], tuple[str, mmap.mmap]] = {}

    def receive(self, value: Any) -> Any:
        """`value` itself unless it is a SharedImages: then a copy of its images, after which the
        worker may reuse the slot."""
        if not isinstance(value, SharedImages):
            return value
        flags = self._flags.get(value.flags)
        if flags is None:
            flags = self._flags[value.flags] = _map(value.flags)
        name, data = self._data.get((value.flags, value.slot), (None, None))
        if name != value.data:   # first use of the slot, or the worker replaced its segment
            if data is not None:
                data.close()
            data = _map(value.data)
            self._data[value.flags, value.slot] = (value.data, data)
        count = int(np.prod(value.shape))
        images = np.frombuffer(data, value.dtype, count).reshape(value.shape).copy()
        flags[value.slot] = _FREE
        return images

    def close(self) -> None:
        """Unmaps every segment, then releases the names a worker left behind. Called once the
        workers have stopped: one that ended normally has unlinked its ring already; one that was
        killed (kill -9, the OOM killer) has not, and its ring is unlinked here and taken off the
        resource tracker's list (no "leaked shared_memory objects" warning at exit)."""
        if not self._flags and not self._data:   # nothing mapped (no workers, or closed before)
            return
        names = [*self._flags, *(name for name, _ in self._data.values())]
        if os.path.isdir("/dev/shm"):   # also the slots of a ring not yet seen here (Linux)
            names += [n for flags in self._flags for n in os.listdir("/dev/shm") if n.startswith(flags + "-")]
        for _, data in self._data.values():
            data.close()
        for flags in self._flags.values():
            flags.close()
        self._data.clear()
        self._flags.clear()
        for name in dict.fromkeys(names):
            _release(name)
