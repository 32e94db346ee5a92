"""The one path layer: local paths and bucket URLs (`gs://`, `s3://`, any fsspec protocol).

Every reader and writer of a user path (data, tokenizer, init weights, the workdir) goes through
these functions, so a `gs://bucket/...` path works wherever a local one does:

    open(path, mode)      exists / isdir / isfile      listdir (names)      glob (full paths)
    makedirs              read_bytes / read_text       write_bytes_atomic / write_text_atomic
    join(base, *names)    as_path / absolute (an etils epath, for code that wants a Path object)
    require_local(path, what, advice): the one-line refusal for readers that need local files
    replacing_folder(out): a local output folder written whole or not at all

Local paths use the os module; URLs use fsspec (gcsfs serves gs://, s3fs s3://). orbax writes
checkpoints through etils.epath, which also resolves gs:// to fsspec's "gcs" filesystem when
TensorFlow is absent (the base install has none), so both reach the same gcsfs backend. Without
the backend installed a URL fails at once with one line naming the package to install.
"""
from __future__ import annotations

import builtins
import contextlib
import glob as glob_lib
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import IO, Any, Iterator

from etils import epath

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


def _fs(path: PathLike) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of a URL; one line naming the package if it is absent."""
    import fsspec  # a base dependency; imported here so local-only processes never load it

    try:
        return fsspec.core.url_to_fs(_str(path))
    except ImportError as e:
        scheme = protocol(path)
        package = BACKENDS.get(scheme, f"the fsspec backend for {scheme}://")
        raise ImportError(f"{_str(path)}: {scheme}:// paths need {package}: pip install {package}") from e


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
        return fs.open(p, mode, **kwargs)
    return builtins.open(local(path), mode, **kwargs)


def exists(path: PathLike) -> bool:
    if is_url(path):
        fs, p = _fs(path)
        return fs.exists(p)
    return os.path.exists(local(path))


def isdir(path: PathLike) -> bool:
    if is_url(path):
        fs, p = _fs(path)
        return fs.isdir(p)
    return os.path.isdir(local(path))


def isfile(path: PathLike) -> bool:
    if is_url(path):
        fs, p = _fs(path)
        return fs.isfile(p)
    return os.path.isfile(local(path))


def listdir(path: PathLike) -> list[str]:
    """Sorted names (not paths) of a folder's entries."""
    if is_url(path):
        fs, p = _fs(path)
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False)
                      if e.rstrip("/") != p.rstrip("/"))
    return sorted(os.listdir(local(path)))


def glob(pattern: PathLike) -> list[str]:
    """Sorted paths matching a glob; URLs come back with their `scheme://`."""
    if is_url(pattern):
        fs, _ = _fs(pattern)
        scheme = protocol(pattern)
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
        fs.makedirs(p, exist_ok=True)
    else:
        os.makedirs(local(path), exist_ok=True)


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
        with fs.open(p, "wb") as f:
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

