"""Transient store errors retried, for everyone who reads or writes a bucket through fsspec.

A week on a pod meets a bucket's passing failures: HTTP 429 (rate limits) and 5xx, connections
reset mid-transfer, reads that time out. `with_retries(cls)` is an fsspec filesystem class whose
calls (info, listings, opening, whole-file reads and writes, removals, renames) and whose open
files' reads are retried on those, with jittered exponential backoff (tenacity's
`wait_random_exponential`: a uniform wait below min(MAX_WAIT_S, INITIAL_S * 2^attempt), the
"full jitter" of AWS's backoff note), ATTEMPTS tries in all. The path layer registers it for a
protocol on its first use (prolip_jax/runtime/paths.py), so the data, tokenizer and init-weight
reads, the workdir's files and orbax's checkpoint files (etils.epath asks fsspec for the same
class) all get it. gcsfs retries each HTTP request itself; this is the layer above it, for what
gcsfs gives up on and for the other backends. orbax's array data goes through tensorstore's own
GCS driver, which retries by itself.

Permanent errors (401/403, 404, any other status, a missing backend) are never retried: they
reach the caller at once and become the path layer's one-line BucketError. Every retry is
counted by kind (`counts()`: "http_503", "connection", ...), which the trainer logs as
io/retries/<kind>, and the first of each kind is logged as a warning.
"""
from __future__ import annotations

import collections
import inspect
import io
import logging
import threading
from typing import Any, Callable, TypeVar

import tenacity

ATTEMPTS = 6
INITIAL_S = 1.0
MAX_WAIT_S = 30.0
TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)
# Type names (any module) of failures in flight: a connection that broke or stalled after it was
# made. Not the "no network" ones (DNS, refused): the path layer's probe reports those at once.
_IN_FLIGHT_NAMES = {"ConnectionResetError", "ConnectionAbortedError", "BrokenPipeError", "TimeoutError",
                    "timeout", "ServerDisconnectedError", "ServerTimeoutError", "ClientPayloadError",
                    "ClientOSError", "SocketTimeoutError", "ReadTimeout", "IncompleteRead",
                    "ChunkedEncodingError", "ProtocolError", "RemoteDisconnected"}

log = logging.getLogger(__name__)
_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()
T = TypeVar("T")


def exception_chain(exc: BaseException):
    """`exc`, then its causes and contexts (each once)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def http_status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries (gcsfs HttpError.code, aiohttp .status), if any."""
    for attr in ("code", "status", "status_code"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    return None


def transient_kind(exc: BaseException) -> str | None:
    """"http_<status>" or "connection" for an error worth retrying, None for any other (the
    first exception of the chain that carries a status or a known name decides)."""
    for e in exception_chain(exc):
        status = http_status(e)
        if status is not None:
            return f"http_{status}" if status in TRANSIENT_STATUS else None
        if isinstance(e, (FileNotFoundError, PermissionError, ImportError)):
            return None
        if type(e).__name__ in _IN_FLIGHT_NAMES:
            return "connection"
    return None


def counts() -> dict[str, int]:
    """Retries so far in this process, by kind."""
    with _lock:
        return dict(_counts)


def _before_sleep(what: str) -> Callable[[tenacity.RetryCallState], None]:
    def note(state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception()
        kind = transient_kind(exc) or "other"
        with _lock:
            _counts[kind] += 1
            first = _counts[kind] == 1
        if first:   # once per kind: the metrics count the rest
            log.warning("transient store error (%s) on %s: %s; retrying with backoff, at most %d tries "
                        "(counted as io/retries/%s)", kind, what, f"{type(exc).__name__}: {exc}"[:300],
                        ATTEMPTS, kind)
    return note


def _policy(what: str) -> dict[str, Any]:
    """tenacity's arguments, for the sync and the async retries alike (the module docstring)."""
    return dict(stop=tenacity.stop_after_attempt(ATTEMPTS),
                wait=tenacity.wait_random_exponential(multiplier=INITIAL_S, max=MAX_WAIT_S),
                retry=tenacity.retry_if_exception(lambda e: transient_kind(e) is not None),
                before_sleep=_before_sleep(what), reraise=True)


def call(fn: Callable[[], T], what: str) -> T:
    """`fn()`, retried on transient errors (the module docstring); `what` names the object."""
    return tenacity.Retrying(**_policy(what))(fn)


class _ReadFile(io.RawIOBase):
    """A file open for reading whose reads are retried: a failed read reopens the object and
    continues at the same offset."""

    def __init__(self, path: str, mode: str, kwargs: dict, raw_open: Callable[..., Any]):
        super().__init__()
        self._path, self._mode, self._kwargs, self._raw_open = path, mode, kwargs, raw_open
        self._pos = 0
        self._f = call(self._open, path)

    def _open(self) -> Any:
        f = self._raw_open(self._path, self._mode, **self._kwargs)
        if self._pos:
            f.seek(self._pos)
        return f

    def _again(self, op: Callable[[Any], T]) -> T:
        def attempt() -> T:
            try:
                return op(self._f)
            except Exception as e:
                if transient_kind(e) is not None:   # the object's stream is in an unknown state
                    try:
                        self._f.close()
                    except Exception:  # noqa: BLE001 - closing a broken stream may fail too
                        pass
                    self._f = self._open()
                raise
        return call(attempt, self._path)

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._again(lambda f: f.read(size))
        self._pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def readall(self) -> bytes:
        return self.read(-1)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._pos = self._again(lambda f: f.seek(offset, whence))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __getattr__(self, name: str) -> Any:   # the backend file's own attributes (size, path, ...)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._f, name)

    def close(self) -> None:
        if not self.closed:
            try:
                self._f.close()
            finally:
                super().close()


class _WriteFile(io.RawIOBase):
    """A file open for writing, kept in memory and written whole on close with retries (an object
    store replaces an object whole anyway; a failed upload is simply made again)."""

    def __init__(self, path: str, mode: str, kwargs: dict, raw_open: Callable[..., Any]):
        super().__init__()
        self._path, self._mode, self._kwargs, self._raw_open = path, mode, kwargs, raw_open
        self._buffer = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self._buffer += data
        return len(data)

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is not None:   # a writer that failed: nothing is uploaded
            self._buffer = None
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        if self._buffer is None:
            return super().close()
        try:
            def upload() -> None:
                with self._raw_open(self._path, self._mode, **self._kwargs) as f:
                    f.write(bytes(self._buffer))
            call(upload, self._path)
        finally:
            super().close()


def _open(owner: type) -> Callable[..., Any]:
    def open(self: Any, path: str, mode: str = "rb", **kwargs: Any) -> Any:  # noqa: A001 - fsspec's name
        if "b" not in mode:   # text: over the binary file, as fsspec's own open does
            text = {k: kwargs.pop(k) for k in ("encoding", "errors", "newline") if k in kwargs}
            return io.TextIOWrapper(self.open(path, mode + "b", **kwargs), **text)
        raw = super(owner, self).open   # the class's own open (DirFileSystem's, fsspec's, ...)
        if mode == "rb" and not kwargs.get("compression"):
            return _ReadFile(path, mode, kwargs, raw)
        if mode in ("wb", "xb") and not kwargs.get("compression"):
            return _WriteFile(path, mode, kwargs, raw)
        return call(lambda: raw(path, mode, **kwargs), path)   # appends, compressed: the opening
    return open


def _retried(owner: type, name: str) -> Callable[..., Any]:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        original = getattr(super(owner, self), name)
        return call(lambda: original(*args, **kwargs), str(args[0]) if args else name)
    method.__name__ = name
    return method


def _retried_async(owner: type, name: str) -> Callable[..., Any]:
    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        original = getattr(super(owner, self), name)

        async def attempt() -> Any:   # a coroutine function: tenacity runs a plain callable unawaited
            return await original(*args, **kwargs)
        return await tenacity.AsyncRetrying(**_policy(str(args[0]) if args else name))(attempt)
    method.__name__ = name
    return method


# The primitive calls (the composite ones, glob, find, walk, exists, are built on them).
PRIMITIVES = ("info", "ls", "cat_file", "pipe_file", "rm_file", "rm", "mkdir", "makedirs", "mv", "copy",
              "put_file", "get_file", "modified", "created")
_classes: dict[type, type] = {}


def with_retries(cls: type) -> type:
    """`cls` (an fsspec filesystem class) with transient errors retried; the same class for the
    same `cls`, and `cls` itself when it already retries.

    An async filesystem (gcsfs, s3fs) gets its coroutines wrapped (`_info`, `_ls`, ...) where its
    sync methods are fsspec's defaults: fsspec then makes the sync ones from the wrapped
    coroutines (asyn.mirror_sync_methods), and the backend's own calls between coroutines are
    retried too. A sync method the class defines itself is wrapped as it is."""
    from fsspec import AbstractFileSystem

    if getattr(cls, "retries_transient_errors", False):
        return cls
    if cls not in _classes:
        wrapped = type(f"Retrying{cls.__name__}", (cls,), {"__module__": __name__,
                                                           "retries_transient_errors": True})
        wrapped.open = _open(wrapped)
        for name in PRIMITIVES:
            coroutine = inspect.iscoroutinefunction(getattr(cls, "_" + name, None))
            if coroutine:
                setattr(wrapped, "_" + name, _retried_async(wrapped, "_" + name))
            own_sync = getattr(cls, name, None) is not getattr(AbstractFileSystem, name, None)
            if hasattr(cls, name) and (own_sync or not coroutine):
                setattr(wrapped, name, _retried(wrapped, name))
        _classes[cls] = wrapped
    return _classes[cls]
