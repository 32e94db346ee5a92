"""The house rules of the import graph, checked from the source (an AST scan, nothing imported).

Layers, bottom to top (docs/design.md), each a folder: the runtime plumbing (prolip_jax/runtime/:
paths, config typing, messages, metrics, processes), the core (prolip_jax/core/: models,
objectives, step, optim, sharding, checkpoint, ...), `input_pipeline`, `evaluators`, and the top
that wires them together (the rest of prolip_jax/: the trainer, the Python API, the export and
conversion; `scripts/`, `benchmarks/`). A module imports only from its own layer or below; there
is no cycle, function-level imports counted; and the libraries import the project's own modules
at the top of a file, never inside a function (which is how cycles hide). Commands (`scripts/`,
`benchmarks/`) may import late: nothing imports them, and they set XLA_FLAGS or answer --help
before jax loads.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("prolip_jax", "input_pipeline", "evaluators", "scripts", "benchmarks")
LAYER = {"runtime": 0, "core": 1, "input_pipeline": 2, "evaluators": 3, "top": 4}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str:
    """The layer of a module: its folder in prolip_jax/ (runtime/, core/; anything else there is
    the top), its package otherwise. The bare `prolip_jax` package (its __init__ loads the API
    lazily) sits with the runtime: every import of a core module passes through it."""
    parts = module.split(".")
    if parts[0] == "prolip_jax":
        if len(parts) == 1:
            return "runtime"
        return parts[1] if parts[1] in ("runtime", "core") else "top"
    if parts[0] in ("scripts", "benchmarks"):
        return "top"
    return parts[0]


def project_modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            out[module_name(path)] = path
    return out


def imports(path: Path, tree: ast.AST, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported project module, line, inside a function) for every import in `path` (parsed:
    `tree`). `from a import b` counts a.b when that is a module, else a; importing a.b also
    imports package a."""
    own = module_name(path)
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = own.split(".") if is_package else own.split(".")[:-1]
                    anchor = anchor[:len(anchor) - child.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in child.names]
            for name in names:
                parts = name.split(".")
                for i in range(1, len(parts) + 1):  # the packages on the way are imported too
                    prefix = ".".join(parts[:i])
                    if prefix in modules and prefix != own and not own.startswith(prefix + "."):
                        found.append((prefix, child.lineno, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def registry_imports(tree: ast.AST, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """The modules a registry names as "module:class" strings (evaluators.REGISTRY, imported when
    a config names them): edges of the graph like any import, so a cycle through them is found."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
            module = node.value.split(":")[0]
            if module in modules:
                found.append((module, node.lineno, False))
    return found


def graph() -> tuple[dict[str, Path], dict[str, list[tuple[str, int, bool]]]]:
    modules = project_modules()
    found = {}
    for m, p in modules.items():
        tree = ast.parse(p.read_text(), filename=str(p))
        found[m] = imports(p, tree, modules) + registry_imports(tree, modules)
    return modules, found


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def test_no_import_cycles():
    _, found = graph()
    edges = {m: {target for target, _, _ in imps} for m, imps in found.items()}
    assert cycles(edges) == []


def test_imports_only_go_down():
    modules, found = graph()
    upward = [f"{module_name(modules[m])}:{line} imports {target} ({layer_of(m)} -> {layer_of(target)})"
              for m, imps in found.items() for target, line, _ in imps
              if LAYER[layer_of(target)] > LAYER[layer_of(m)]]
    assert upward == []


def test_libraries_import_own_modules_at_the_top_of_the_file():
    modules, found = graph()
    inside = sorted({f"{modules[m].relative_to(ROOT)}:{line} imports {target}"
                     for m, imps in found.items() for target, line, in_function in imps
                     if in_function and not m.startswith(("scripts", "benchmarks"))})
    assert inside == []


def test_the_registry_is_part_of_the_graph():
    """evaluators.REGISTRY's "module:class" strings are edges: the scan still sees every evaluator."""
    _, found = graph()
    assert {"evaluators.zeroshot", "evaluators.retrieval", "evaluators.hierarcaps"} <= {
        target for target, _, _ in found["evaluators"]}


def test_the_scan_sees_cycles_and_layers():
    """The checks above can fail: a made-up cycle and an upward import are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("prolip_jax.core.step") == "core" and layer_of("prolip_jax.train") == "top"
    assert LAYER[layer_of("input_pipeline.pipeline")] > LAYER[layer_of("prolip_jax.core.models.vit")]


def test_no_function_is_longer_than_80_lines():
    """The library reads as parts a reader can hold (prolip_jax/, input_pipeline/, evaluators/)."""
    import ast

    long = []
    for folder in ("prolip_jax", "input_pipeline", "evaluators"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
