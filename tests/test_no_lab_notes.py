"""Comments and docstrings carry no lab notes (docs/design.md, house rules).

A comment says why, briefly; a measurement lives in docs/performance.md with its command and
its history in docs/performance_history.md. Scanned here: every comment (`tokenize`) and
docstring (`ast`) of the .py files in prolip_jax/, input_pipeline/, evaluators/ and configs/,
line by line, for dates, work-period names, commit hashes and machine timings (a time with its
unit beside "measured" / "took", a machine, "this CPU", or a before -> after pair). Config
docstrings may still give an expected time ("Expected ...: 15 min on 2 CPU cores").
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("prolip_jax", "input_pipeline", "evaluators", "configs")

_TIME = r"\d[\d,]*(?:\.\d+)?\s?(?:ms|µs|us|s|sec|seconds?|min|minutes?)\b"
_CORES = r"\bon\s+\d+\s+(?:idle|busy|shared)\s+(?:CPU\s+)?cores\b"  # "on 2 cores" alone: an expected time
_MACHINE = r"(?:[HA]100|H200|GH200|TPU v\d|v[4-6][ep]?-\d+)"
PATTERNS = {
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d"),
    "a work-period name": re.compile(
        r"\b(?:this|that|previous|next|last|earlier|later|same|first|second|third|\w+th)\s+(?:work\s+)?session\b"
        r"|\bwork\s+period\b|\bperiod\s+\d+\b|\bsession\s+\d+\b", re.I),
    "a commit hash": re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
    "a timing on a named machine": re.compile(rf"{_MACHINE}.*{_TIME}|{_TIME}.*{_MACHINE}"),
    "a measured timing": re.compile(rf"\b(?:measured|took)\b.*{_TIME}|{_TIME}.*\b(?:measured|took)\b", re.I),
    "a timing on this machine": re.compile(
        rf"{_TIME}.*\bon\s+(?:(?:a|an|the|this)\s+)?(?:idle\s+|busy\s+|shared\s+|lent\s+)?(?:\d+-(?:v?CPU|core)\s+)?"
        rf"(?:CPU|GPU|VM|machine)\b"
        rf"|{_TIME}.*{_CORES}|{_CORES}.*{_TIME}"
        rf"|\bthis\s+(?:\d+-(?:v?CPU|core)\s+)?(?:CPU|VM|machine)\b|\b\d+-(?:core|vCPU)\s+(?:CPU|VM|machine)\b", re.I),
    "a before -> after timing": re.compile(rf"\d[\d,.]*\s?(?:ms|µs|us|s|GiB|MB)?\s?(?:->|→)\s?{_TIME}"),
    "a timing against another": re.compile(rf"{_TIME}\s+(?:instead of|against|vs\.?)\s+{_TIME}"),
    "a relative speed result": re.compile(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?% (?:slower|faster)", re.I),
}
# The one place a time may stand next to a machine: a config's expected run time (house rules).
EXPECTED = re.compile(r"\bexpected\b", re.I)



def prose_lines(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and docstring line of a module."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                out.extend((first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines()))
    return sorted(out)


def lab_notes(path: Path, source: str | None = None) -> list[str]:
    """'file:line: what (the text)' for every lab note in `path`'s comments and docstrings."""
    rel = path.relative_to(ROOT) if path.is_absolute() else path
    found, previous = [], ""
    for lineno, text in prose_lines(source if source is not None else path.read_text()):
        expected = EXPECTED.search(previous + " " + text)  # an expected time may wrap onto the next line
        for what, pattern in PATTERNS.items():
            if pattern.search(text) and not (what.startswith("a timing on") and expected):
                found.append(f"{rel}:{lineno}: {what}: {text.strip()[:100]}")
        previous = text
    return found


FILES = sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py") if ".venv" not in p.parts)


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_comments_and_docstrings_carry_no_lab_notes(path):
    notes = lab_notes(path)
    assert notes == [], "lab notes belong in docs/performance.md (figures) or nowhere:\n" + "\n".join(notes)


@pytest.mark.parametrize("text, what", [
    ("# the small model's step 1897 -> 1792 ms (docs/performance.md)", "a before -> after timing"),
    ("# Measured on this 2-core CPU: faster", "a timing on this machine"),
    ("# ~10 ms of the B/16 step on an H100", "a timing on a named machine"),
    ("# (docs/gpu_results/2026-11-24-h100/breakdown.txt)", "a date"),
    ("# (docs/performance.md, \"The eighth session\")", "a work-period name"),
    ("# the scanned step is 6-17% slower", "a relative speed result"),
    ("# taken with the code before b815d6a", "a commit hash"),
    ("# 12-14 s of compile on a 2-core CPU", "a timing on this machine"),
    ("# the B/16 train state takes 4.7-4.9 s on the CPU", "a timing on this machine"),
    ("# the first save compiles 96 programs, ~4 s on CPU", "a timing on this machine"),
    ("# one direction) on 2 shared cores, XLA:CPU: 78 ms as one slab", "a timing on this machine"),
    ("# the draws compile in 1.5 s instead of 2.9 s for B/16", "a timing against another"),
])
def test_each_kind_of_lab_note_is_caught(text, what):
    found = lab_notes(Path("example.py"), text + "\nx = 1\n")
    assert any(f": {what}: " in line for line in found), found


@pytest.mark.parametrize("text", [
    "# heartbeat_timeout_seconds (100 s by default), timeout_s=600",
    "# aiohttp's unclosed sessions",
    "# its cosine's period T_max in steps",
    "# [B, T, D] -> [B*T, D] token matrices",
    "# Expected run time on 2 CPU cores: about 0.2 s per step after a ~30-60 s compile.",
    "# generates on first use (~30 s on 2 cores), then loads",
    "# Expected time on the CPU: about 0.2 s per step",
    "# ~6 days on 32 H100s (an estimate scaled from the reference)",
    "# why: docs/performance.md, \"Levers and defaults\"",
])
def test_settings_and_reasons_are_not_lab_notes(text):
    assert lab_notes(Path("example.py"), text + "\nx = 1\n") == []
