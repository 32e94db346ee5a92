"""No function of the library is longer than 80 lines (docs/design.md, house rules): the trainer
is a few modules a reader can hold, not one long function. Scanned with `ast` over prolip_jax/,
input_pipeline/ and evaluators/, nested functions counted in their own right and in their parent."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("prolip_jax", "input_pipeline", "evaluators")
LIMIT = 80


def test_no_function_is_longer_than_80_lines():
    long = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > LIMIT:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, "split these: " + "; ".join(long)
