"""Paths: shard patterns (brace expansion, globs, local or fsspec URLs), and files written
atomically with the permissions of a normal file.

`expand_paths("shards/{00000..01023}.tar")` gives 1024 paths, zero-padded like the pattern
(webdataset / img2dataset naming). Alternatives `{train,val}` and several braces in one pattern
work too. Local paths are checked for existence up front, so a typo or a missing shard fails at
start-up with a message naming the path, not hours later inside a worker process.
"""
from __future__ import annotations

import glob as glob_lib
import os
import re
import tempfile
from pathlib import Path
from typing import IO, Any, Sequence

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


def is_url(path: str) -> bool:
    """True for `scheme://...` paths (gs://, s3://, https://, ...), which go through fsspec."""
    return (re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", path) is not None
            and not path.startswith("file://"))


def _find_closing(pattern: str, start: int) -> int:
    depth = 0
    for i in range(start, len(pattern)):
        if pattern[i] == "{":
            depth += 1
        elif pattern[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"Malformed brace pattern {pattern!r}: the '{{' at position {start} is "
                     "never closed.")


def _split_top_level(body: str) -> list[str]:
    parts, depth, last = [], 0, 0
    for i, ch in enumerate(body):
        depth += (ch == "{") - (ch == "}")
        if ch == "," and depth == 0:
            parts.append(body[last:i])
            last = i + 1
    parts.append(body[last:])
    return parts


def expand_braces(pattern: str) -> list[str]:
    """Expands `{a..b}` numeric ranges and `{x,y}` alternatives, left to right, in order.

    A range keeps the zero padding of its endpoints: `{008..011}` -> 008, 009, 010, 011.
    """
    start, close = pattern.find("{"), pattern.find("}")
    if close >= 0 and (start < 0 or close < start):
        raise ValueError(f"Malformed brace pattern {pattern!r}: the '}}' at position {close} has "
                         "no opening '{'.")
    if start < 0:
        return [pattern]
    end = _find_closing(pattern, start)
    head, body, tail = pattern[:start], pattern[start + 1:end], pattern[end + 1:]
    match = _RANGE.match(body)
    if match:
        a, b = match.group(1), match.group(2)
        lo, hi = int(a), int(b)
        padded = a.lstrip("-").startswith("0") or b.lstrip("-").startswith("0")
        width = max(len(a), len(b)) if padded else 0
        step = 1 if hi >= lo else -1
        options = [str(v).zfill(width) for v in range(lo, hi + step, step)]
    else:
        options = _split_top_level(body)
        if len(options) < 2:
            raise ValueError(f"Malformed brace pattern {pattern!r}: '{{{body}}}' is neither a "
                             "range like {00000..00099} nor a list like {a,b}.")
    return [head + rest for option in options for rest in expand_braces(option + tail)]


def expand_paths(patterns: str | Sequence[str], check_exists: bool = True) -> list[str]:
    """Patterns (braces, then globs) -> ordered list of paths. A string may hold several,
    separated by `::` (the webdataset convention).

    Raises FileNotFoundError naming missing local files. Remote URLs are not stat'ed here (with
    thousands of shards that costs minutes); a missing remote shard fails when it is opened.
    """
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [p for p in os.fspath(patterns).split("::") if p]
    if not patterns:
        raise ValueError("No data path given: set the config's `path` to a file, a glob or a "
                         "brace pattern such as 'shards/{00000..00009}.tar'.")
    paths: list[str] = []
    for pattern in patterns:
        for path in expand_braces(os.fspath(pattern)):
            if not any(ch in path for ch in "*?["):
                paths.append(path if is_url(path)
                             else os.path.expanduser(path.removeprefix("file://")))
                continue
            if is_url(path):
                import fsspec
                fs = fsspec.core.url_to_fs(path)[0]
                protocol = path.split("://", 1)[0]
                matches = sorted(f"{protocol}://{p.split('://', 1)[-1]}" for p in fs.glob(path))
            else:
                matches = sorted(glob_lib.glob(os.path.expanduser(path)))
            if not matches and check_exists:
                raise FileNotFoundError(f"The glob {path!r} (from {pattern!r}) matches no file.")
            paths.extend(matches)
    if check_exists:
        missing = [p for p in paths if not is_url(p) and not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} of {len(paths)} data files do not exist, e.g. {missing[0]!r}"
                + (f" and {missing[-1]!r}" if len(missing) > 1 else "")
                + f" (from {list(patterns)!r}).")
    return paths


def open_binary(path: str) -> IO[bytes]:
    """Opens a local path or an fsspec URL for streaming reads."""
    if is_url(path):
        import fsspec
        return fsspec.open(path, "rb").open()
    return open(path, "rb")


# --------------------------------------------------------------------------- writing files
def umask() -> int:
    """The process umask (read without changing it where /proc allows)."""
    try:
        with open("/proc/self/status") as f:
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


def write_bytes_atomic(path: Any, data: bytes) -> None:
    """Writes `data` to `path` (a local path or an etils epath, e.g. gs://) so that a reader never
    sees a partial file: local files go through a temporary sibling and a rename."""
    s = os.fspath(path) if not hasattr(path, "as_uri") or isinstance(path, Path) else str(path)
    if "://" in s:
        path.write_bytes(data)  # object stores replace an object atomically
        return
    directory = os.path.dirname(s) or "."
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(s)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        chmod_default(tmp)
        os.replace(tmp, s)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
