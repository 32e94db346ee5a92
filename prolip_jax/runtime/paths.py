"""The one path layer: local paths and bucket URLs (`gs://`, `s3://`, any fsspec protocol).

Every reader and writer of a user path (data, tokenizer, init weights, the workdir) goes through
these functions, so a `gs://bucket/...` path works wherever a local one does:

    open(path, mode)      exists / isdir / isfile      listdir (names)      glob (full paths)
    makedirs / remove     read_bytes / read_text       write_bytes_atomic / write_text_atomic
    join(base, *names)    as_path / absolute (an etils epath, for code that wants a Path object)
    require_local(path, what, advice): the one-line refusal for readers that need local files
    replacing_folder(out): a local output folder written whole or not at all
    check_reachable(url, what, flag): the start-up check of a bucket path (see below)

Local paths use the os module; URLs use fsspec (gcsfs serves gs://, s3fs s3://). orbax writes
checkpoints through etils.epath, which also resolves gs:// to fsspec's "gcs" filesystem when
TensorFlow is absent (the base install has none), so both reach the same gcsfs backend. Without
the backend installed a URL fails at once with one line naming the package to install.

Bucket errors are one line (`BucketError`, an OSError) saying which of four things is wrong:
the backend is not installed (BucketBackendMissing), the store cannot be reached
(BucketUnreachable, a ConnectionError: no network, or no answer within PROBE_TIMEOUT_S), it
refuses the credentials (BucketAccessDenied, a PermissionError), or the object is not there
(BucketNotFound, a FileNotFoundError). `bucket_error` classifies a backend's exception by its
type's name and module, so gcsfs, aiohttp and google-auth need not be importable here. The first
touch of each bucket runs a probe (`check_reachable`): gcsfs retries a failed connection six
times with exponential backoff (gcsfs/retry.py) and, without credentials, polls the
Compute Engine metadata server five times (google-auth), logging tracebacks throughout; the
probe fails fast instead, with those libraries' loggers kept off the console.
"""
from __future__ import annotations

import builtins
import contextlib
import glob as glob_lib
import logging
import os
import re
import shutil
import socket
import sys
import tempfile
import threading
import urllib.parse
import uuid
from pathlib import Path
from typing import IO, Any, Iterator

from etils import epath
from etils.epath import backend as epath_backend

from prolip_jax.runtime import retries
from prolip_jax.runtime.retries import exception_chain as _chain, http_status as _status

# fsspec protocol -> the package that serves it (for the one-line "install" error).
BACKENDS = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "az": "adlfs", "abfs": "adlfs",
            "hf": "huggingface_hub", "http": "aiohttp", "https": "aiohttp"}
PathLike = Any  # str | os.PathLike | epath.Path


def _str(path: PathLike) -> str:
    return os.fspath(path)


def is_url(path: PathLike) -> bool:
    """True for `scheme://...` paths (gs://, s3://, https://, ...), which go through fsspec."""
    s = _str(path)
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", s) is not None and not s.startswith("file://")


def local(path: PathLike) -> str:
    """A local path string: `~` expanded, a `file://` prefix dropped."""
    return os.path.expanduser(_str(path).removeprefix("file://"))


def protocol(path: PathLike) -> str:
    return _str(path).split("://", 1)[0]


# ---------------------------------------------------------------------------------- bucket errors
class BucketError(OSError):
    """A bucket URL that cannot be used; the message is one line. `kind` says which problem."""

    kind = "bucket"

    def __init__(self, message: str):
        super().__init__(message)

    def __str__(self) -> str:
        return self.args[0]


class BucketBackendMissing(BucketError):
    kind = "backend"


class BucketUnreachable(BucketError, ConnectionError):
    kind = "network"


class BucketAccessDenied(BucketError, PermissionError):
    kind = "credentials"


class BucketNotFound(BucketError, FileNotFoundError):
    kind = "not_found"


# Seconds the probe waits for a first answer from a store (gcsfs retries each call with backoff).
PROBE_TIMEOUT_S = 8.0
# Seconds to open a TCP connection to a store's endpoint before any backend call.
CONNECT_TIMEOUT_S = 3.0
# Loggers that print warnings and tracebacks while a store is unreachable (gcsfs's retries,
# google-auth's metadata-server polling, aiohttp's unclosed sessions).
NOISY_LOGGERS = ("gcsfs", "google", "google.auth", "google.api_core", "urllib3", "aiohttp", "asyncio",
                 "fsspec", "s3fs", "botocore")
# Type names (any module) of exceptions that mean "no connection".
_NETWORK_NAMES = {"ConnectionError", "ConnectionRefusedError", "ConnectionResetError", "ConnectionAbortedError",
                  "TimeoutError", "gaierror", "timeout", "ClientConnectorError", "ClientConnectorDNSError",
                  "ClientConnectorSSLError", "ClientConnectorCertificateError", "ServerDisconnectedError",
                  "ServerTimeoutError", "ClientOSError", "ConnectionTimeoutError", "SocketTimeoutError",
                  "TransportError", "ServiceUnavailable", "DeadlineExceeded", "ReadTimeout", "ConnectTimeout",
                  "EndpointConnectionError", "RetryError"}
_CREDENTIAL_NAMES = {"DefaultCredentialsError", "RefreshError", "UserAccessTokenError", "NoCredentialsError",
                     "Unauthenticated", "Forbidden", "PermissionDenied"}
_probed: set[tuple[str, str]] = set()  # (protocol, bucket) that answered once in this process
_quiet_lock = threading.Lock()
_quiet_depth = 0
_quiet_saved: list[tuple[logging.Logger, list, bool, int]] = []


def _package(scheme: str) -> str:
    return BACKENDS.get(scheme, f"the fsspec backend for {scheme}://")


def _detail(exc: BaseException) -> str:
    """The first line of an exception's message (gcsfs's 403 carries the server's text after it)."""
    try:
        text = str(exc).strip().splitlines()
    except Exception:  # noqa: BLE001 - an exception whose __str__ fails still has a name
        text = []
    return (text[0] if text else type(exc).__name__)[:200]


def _kind_of(exc: BaseException) -> tuple[str, BaseException] | None:
    """(kind, the exception that decided it) for a backend's exception, or None if it is not a
    store problem. The first exception of the chain that says something decides."""
    for e in _chain(exc):
        if isinstance(e, BucketError):
            return e.kind, e
        name, module = type(e).__name__, type(e).__module__ or ""
        status = _status(e)
        if isinstance(e, ImportError):
            return "backend", e
        if status in (401, 403) or name in _CREDENTIAL_NAMES or isinstance(e, PermissionError) or (
                isinstance(e, OSError) and _detail(e).startswith("Forbidden")):  # gcsfs's HTTP 403
            return "credentials", e
        if status == 404 or isinstance(e, FileNotFoundError) or name == "NotFound":
            return "not_found", e
        if name in _NETWORK_NAMES or isinstance(e, (ConnectionError, TimeoutError, socket.gaierror)) or (
                module.startswith("aiohttp") and "Connect" in name) or retries.transient_kind(e):
            return "network", e   # transient errors arrive here once retries.py gave up on them
    return None


def bucket_error(url: PathLike, exc: BaseException, what: str = "", flag: str = "") -> BucketError | None:
    """The one-line BucketError for a backend's exception on `url`, or None when it is not one of
    the four kinds (the caller re-raises the original). `what`/`flag`: how the user gave the path
    ("--workdir", "--checkpoint"); the message names the flag to change."""
    found = _kind_of(exc)
    if found is None:
        return None
    kind, e = found
    if isinstance(e, BucketError):
        return e
    url, scheme = _str(url), protocol(url)
    head = f"{what} {url}" if what else url
    other = f"pass another {flag}" if flag else "check the path"
    if kind == "backend":
        package = _package(scheme)
        return BucketBackendMissing(f"{head}: {scheme}:// paths need {package}, which is not installed: "
                                    f"pip install {package}" + (f", or pass a local {flag}" if flag else ""))
    if kind == "credentials":
        login = ("gcloud auth application-default login, or GOOGLE_APPLICATION_CREDENTIALS naming a key"
                 if scheme in ("gs", "gcs") else f"the credentials {_package(scheme)} reads")
        return BucketAccessDenied(f"{head}: no credentials, or credentials without access ({_detail(e)}): "
                                  f"give ones that can read it ({login}), or {other}")
    if kind == "not_found":
        return BucketNotFound(f"{head}: no such bucket, file or folder: {other}")
    detail = _detail(e) + (f", still after {retries.ATTEMPTS} tries" if retries.transient_kind(e) else "")
    return BucketUnreachable(f"{head}: cannot reach the store ({detail}): check the network"
                             + (f", or pass a local {flag}" if flag else ""))


@contextlib.contextmanager
def _bucket_errors(url: PathLike, what: str = "", flag: str = "") -> Iterator[None]:
    """Re-raises a store's exception inside the block as its one-line BucketError."""
    try:
        yield
    except BucketError:
        raise
    except Exception as e:  # noqa: BLE001 - classified below; anything else goes on unchanged
        err = bucket_error(url, e, what, flag)
        if err is None:
            raise
        raise err from e


def _quiet_enter() -> None:
    """Noisy loggers off the console (nested and across threads: the last to leave restores)."""
    global _quiet_depth
    with _quiet_lock:
        _quiet_depth += 1
        if _quiet_depth > 1:
            return
        for name in NOISY_LOGGERS:
            lg = logging.getLogger(name)
            _quiet_saved.append((lg, lg.handlers[:], lg.propagate, lg.level))
            lg.handlers, lg.propagate = [logging.NullHandler()], False


def _quiet_exit() -> None:
    global _quiet_depth
    with _quiet_lock:
        _quiet_depth -= 1
        if _quiet_depth:
            return
        for lg, handlers, propagate, _level in _quiet_saved:
            lg.handlers, lg.propagate = handlers, propagate
        _quiet_saved.clear()


def _bucket(url: PathLike) -> str:
    return _str(url).split("://", 1)[1].split("/", 1)[0]


def _endpoint(cls: type) -> tuple[str, int] | None:
    """(host, port) a filesystem class talks to, where known without building one (building a
    gcsfs one already polls the metadata server when there are no credentials)."""
    if not (cls.__module__ or "").startswith("gcsfs"):
        return None
    locate = getattr(sys.modules.get("gcsfs.core"), "_location", None)
    try:
        location = locate() if locate else "https://storage.googleapis.com"
    except Exception:  # noqa: BLE001 - a private helper of another version: skip the check
        return None
    parts = urllib.parse.urlsplit(location)
    if not parts.hostname:
        return None
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def _probe_once(url: str, must_exist: bool) -> None:
    """One answer from the store about `url` (its info): raises what the backend raised."""
    import fsspec

    fs, p = fsspec.core.url_to_fs(url)
    try:
        fs.info(p)
    except FileNotFoundError:
        if must_exist:
            raise


def check_reachable(url: PathLike, what: str = "", flag: str = "", must_exist: bool = False) -> None:
    """Raises the one-line BucketError when the store behind `url` is not usable: backend not
    installed, no network (within CONNECT_TIMEOUT_S, or no answer within PROBE_TIMEOUT_S), no or
    refused credentials, or (`must_exist`) nothing at `url`. Local paths and buckets that
    answered before in this process return at once. Nothing is printed: the backends' loggers
    stay off the console until the probe's call returns, even past the deadline."""
    if not is_url(url):
        return
    import fsspec  # a base dependency; imported here so local-only processes never load it

    url, scheme = _str(url), protocol(url)
    if (scheme, _bucket(url)) in _probed and not must_exist:
        return
    with _bucket_errors(url, what, flag):
        cls = fsspec.get_filesystem_class(scheme)  # ImportError: the backend is missing
        endpoint = _endpoint(cls)
        if endpoint is not None:
            try:
                socket.create_connection(endpoint, timeout=CONNECT_TIMEOUT_S).close()
            except OSError as e:
                raise bucket_error(url, ConnectionError(f"{endpoint[0]}: {_detail(e)}"), what, flag) from e
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                _probe_once(url, must_exist)
                outcome.append(None)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                outcome.append(e)
            finally:
                _quiet_exit()

        _quiet_enter()
        thread = threading.Thread(target=run, name="bucket-probe", daemon=True)
        thread.start()
        thread.join(PROBE_TIMEOUT_S)
        if not outcome:
            hint = ("; without credentials off Google Cloud, gcsfs first polls the metadata server: log in, "
                    "or set NO_GCE_CHECK=true" if endpoint is not None else "")
            raise TimeoutError(f"no answer within {PROBE_TIMEOUT_S:g} s{hint}")
        if outcome[0] is not None:
            raise outcome[0]
    _probed.add((scheme, _bucket(url)))


def _fs(path: PathLike) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of a URL, after the bucket's probe; one-line errors."""
    import fsspec

    check_reachable(path)
    with _bucket_errors(path):
        _retry_transient_errors(protocol(path))
        return fsspec.core.url_to_fs(_str(path))


def _retry_transient_errors(scheme: str) -> None:
    """Registers the protocol's filesystem class with transient errors retried (retries.py), for
    this layer and for etils.epath (orbax's checkpoint files), which ask fsspec for the same."""
    import fsspec

    cls = fsspec.get_filesystem_class(scheme)
    wrapped = retries.with_retries(cls)
    if wrapped is cls:
        return
    names = cls.protocol if isinstance(cls.protocol, (tuple, list)) else (cls.protocol,)
    for name in {scheme, *names}:
        fsspec.register_implementation(name, wrapped, clobber=True)
    cached = getattr(getattr(epath_backend, "fsspec_backend", None), "_get_filesystem", None)
    if hasattr(cached, "cache_clear"):   # etils keeps the filesystem it made before
        cached.cache_clear()


def require_local(path: PathLike, what: str, advice: str) -> str:
    """`path` as a local path, or a one-line ValueError for a URL: "<what> must be local (<path>):
    <advice>". For readers that cannot stream from a bucket (array_record, tfds)."""
    if is_url(path):
        raise ValueError(f"{what} must be on local disk, got {_str(path)!r}: {advice}")
    return local(path)


def as_path(path: PathLike) -> epath.Path:
    """An etils epath (gs:// kept intact, unlike pathlib), for code that joins and tests paths."""
    if is_url(path):
        _fs(path)  # the missing-backend error here, in one line, rather than deep inside epath
        return epath.Path(_str(path))
    return epath.Path(local(path))


def absolute(path: PathLike) -> epath.Path:
    """`as_path`, made absolute where local (epath's own `.absolute()` mangles a gs:// path)."""
    return as_path(path) if is_url(path) else epath.Path(os.path.abspath(local(path)))


def join(base: PathLike, *names: str) -> str:
    """`base/names...` as a string; URLs keep their `scheme://`."""
    s = _str(base)
    if is_url(s):
        return "/".join([s.rstrip("/")] + [n.strip("/") for n in names if n])
    return os.path.join(local(s), *names)


# ---------------------------------------------------------------------------------- reading
def open(path: PathLike, mode: str = "rb", **kwargs: Any) -> IO:  # noqa: A001 - the layer's open
    """Opens a local path or a URL (a streaming, seekable file object for reads)."""
    if is_url(path):
        fs, p = _fs(path)
        with _bucket_errors(path):
            return fs.open(p, mode, **kwargs)
    return builtins.open(local(path), mode, **kwargs)


def _info(path: PathLike) -> dict | None:
    """A URL's fsspec info, or None when nothing is there. fsspec's own exists / isdir / isfile
    answer False for any error, which would make an unreachable bucket look empty."""
    fs, p = _fs(path)
    with _bucket_errors(path):
        try:
            return fs.info(p)
        except FileNotFoundError:
            return None


def exists(path: PathLike) -> bool:
    if is_url(path):
        return _info(path) is not None
    return os.path.exists(local(path))


def isdir(path: PathLike) -> bool:
    if is_url(path):
        info = _info(path)
        return info is not None and info.get("type") == "directory"
    return os.path.isdir(local(path))


def isfile(path: PathLike) -> bool:
    if is_url(path):
        info = _info(path)
        return info is not None and info.get("type") == "file"
    return os.path.isfile(local(path))


def listdir(path: PathLike) -> list[str]:
    """Sorted names (not paths) of a folder's entries."""
    if is_url(path):
        fs, p = _fs(path)
        with _bucket_errors(path):
            return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False)
                          if e.rstrip("/") != p.rstrip("/"))
    return sorted(os.listdir(local(path)))


def glob(pattern: PathLike) -> list[str]:
    """Sorted paths matching a glob; URLs come back with their `scheme://`."""
    if is_url(pattern):
        fs, _ = _fs(pattern)
        scheme = protocol(pattern)
        with _bucket_errors(pattern):
            return sorted(f"{scheme}://{p.split('://', 1)[-1]}" for p in fs.glob(_str(pattern)))
    return sorted(glob_lib.glob(local(pattern)))


def read_bytes(path: PathLike) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_text(path: PathLike, encoding: str = "utf-8") -> str:
    return read_bytes(path).decode(encoding)


# ---------------------------------------------------------------------------------- writing
def makedirs(path: PathLike) -> None:
    """Creates a folder and its parents (buckets have no folders: a no-op there in effect)."""
    if is_url(path):
        fs, p = _fs(path)
        with _bucket_errors(path):
            fs.makedirs(p, exist_ok=True)
    else:
        os.makedirs(local(path), exist_ok=True)


def remove(path: PathLike) -> None:
    """Deletes a file (an object in a bucket); nothing when it is not there."""
    if is_url(path):
        fs, p = _fs(path)
        with _bucket_errors(path), contextlib.suppress(FileNotFoundError):
            fs.rm_file(p)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(local(path))


def umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        with builtins.open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (not thread-safe, hence the /proc path)
    os.umask(mask)
    return mask


def chmod_default(path: str | os.PathLike) -> None:
    """Gives `path` the mode a plain `open(..., "w")` / `mkdir` would: 0666 (files) or 0777
    (folders) minus the umask. Temporary files and folders (tempfile.mkstemp / mkdtemp, and
    safetensors' own writer) are created 0600 / 0700, which would lock out everyone else."""
    base = 0o777 if os.path.isdir(path) else 0o666
    os.chmod(path, base & ~umask())


def write_bytes_atomic(path: PathLike, data: bytes) -> None:
    """Writes `data` to `path` so that a reader never sees a partial file: local files go through
    a temporary sibling and a rename; an object store replaces an object whole on upload."""
    if is_url(path):
        fs, p = _fs(path)
        with _bucket_errors(path), fs.open(p, "wb") as f:
            f.write(data)
        return
    s = local(path)
    directory = os.path.dirname(s) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(s)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        chmod_default(tmp)
        os.replace(tmp, s)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: PathLike, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


@contextlib.contextmanager
def replacing_folder(out: str | os.PathLike) -> Iterator[Path]:
    """A local output folder written whole or not at all (an export, a converted checkpoint, an
    evaluation's results): yields a fresh path beside `out`, not yet created (the writer creates
    it: orbax wants to, mkdir gives the usual permissions). When the block ends it replaces `out`;
    on an error it is removed and `out` is left as it was."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

