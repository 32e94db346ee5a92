"""Shard patterns: brace expansion and globs over local paths or bucket URLs (gs://, ...).

Opening, listing and writing files is the core's path layer (prolip_jax/runtime/paths.py); this module
only turns a pattern into the ordered list of shard paths.

`expand_paths("shards/{00000..01023}.tar")` gives 1024 paths, zero-padded like the pattern
(webdataset / img2dataset naming). Alternatives `{train,val}` and several braces in one pattern
work too. Local paths are checked for existence up front, so a typo or a missing shard fails at
start-up with a message naming the path, not hours later inside a worker process.
"""
from __future__ import annotations

import os
import re
from typing import Sequence

from prolip_jax.runtime import paths as fs

_RANGE = re.compile(r"^(-?\d+)\.\.(-?\d+)$")


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


def split_patterns(patterns: str | Sequence[str]) -> list[str]:
    """data.path as a list of patterns: a string may hold several, separated by `::`."""
    if isinstance(patterns, (str, os.PathLike)):
        return [p for p in os.fspath(patterns).split("::") if p]
    return list(patterns)


def expand_paths(patterns: str | Sequence[str], check_exists: bool = True) -> list[str]:
    """Patterns (braces, then globs) -> ordered list of paths. A string may hold several,
    separated by `::` (the webdataset convention).

    Raises FileNotFoundError naming missing local files. Remote URLs are not stat'ed here (with
    thousands of shards that costs minutes); a missing remote shard fails when it is opened.
    """
    patterns = split_patterns(patterns)
    if not patterns:
        raise ValueError("No data path given: set the config's `path` to a file, a glob or a "
                         "brace pattern such as 'shards/{00000..00009}.tar'.")
    paths: list[str] = []
    for pattern in patterns:
        for path in expand_braces(os.fspath(pattern)):
            if not any(ch in path for ch in "*?["):
                paths.append(path if fs.is_url(path) else fs.local(path))
                continue
            matches = fs.glob(path)
            if not matches and check_exists:
                raise FileNotFoundError(f"The glob {path!r} (from {pattern!r}) matches no file.")
            paths.extend(matches)
    if check_exists:
        missing = [p for p in paths if not fs.is_url(p) and not os.path.isfile(p)]
        if missing:
            raise FileNotFoundError(
                f"{len(missing)} of {len(paths)} data files do not exist, e.g. {missing[0]!r}"
                + (f" and {missing[-1]!r}" if len(missing) > 1 else "")
                + f" (from {list(patterns)!r}).")
    return paths


# File name endings of the two shard kinds data.path can name (tfds-style array_record shards
# carry a suffix such as `.array_record-00000-of-00064`).
_SHARD_KINDS = (("tar", re.compile(r"\.(tar|tar\.gz|tgz)$")),
                ("array_record", re.compile(r"\.array_record(-\d+-of-\d+)?$")))


def shard_kind(path: str) -> str | None:
    """"tar" or "array_record" from a file name or pattern's ending; None when it says neither."""
    name = os.fspath(path).rstrip("/")
    return next((kind for kind, ending in _SHARD_KINDS if ending.search(name)), None)


# One file listing image paths and captions (data.source="csv").
_LISTING = re.compile(r"\.(csv|tsv|parquet)$", re.IGNORECASE)


def source_of_paths(patterns: str | Sequence[str]) -> str:
    """The shard kind that every pattern of data.path names, or "csv" for one listing file
    (for `data.source="auto"`)."""
    patterns = split_patterns(patterns)
    if len(patterns) == 1 and _LISTING.search(os.fspath(patterns[0])):
        return "csv"
    kinds = {shard_kind(p) for p in patterns}
    if len(kinds) != 1 or None in kinds:
        raise ValueError(f"data.source='auto' cannot tell the shard kind of data.path={'::'.join(patterns)!r} "
                         "(names ending in .tar or .array_record): pass --config.data.source=tar or "
                         "--config.data.source=array_record")
    return kinds.pop()


def check_shard_kind(files: Sequence[str], source: str) -> None:
    """One line when data.path names shards of the other kind than data.source reads: a tar
    reader would skip every ArrayRecord file as a corrupt tar, and the reverse fails deep in riegeli."""
    for f in files:
        kind = shard_kind(f)
        if kind is not None and kind != source:
            more = sum(shard_kind(g) == kind for g in files) - 1
            raise ValueError(f"data.path names {kind} shards ({f}{f' and {more} more' if more else ''}) but "
                             f"data.source={source!r}: pass --config.data.source={kind} "
                             "(or --config.data.source=auto)")
