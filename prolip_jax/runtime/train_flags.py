"""The trainer's flags, declared once; its `--help`, and a multi-process launch's supervisor,
both started without importing jax.

`python -m prolip_jax.train --help` runs `exit_if_help` before the trainer imports jax and the
project (seconds), so help is instant. With `--config FILE[:ARGS]` it also prints that config
file's docstring and its args, read with `ast`, and every field `--config.FIELD=VALUE` can set:
those the file sets (its get_config run, which needs ml_collections only) and those declared
beside the code that uses them, read with `ast` from the declaring dataclasses. `exit_if_supervisor`
turns the process of a multi-process launch into its trainer's supervisor (prolip_jax/runtime/supervise.py)
from the same point. The standard library and prolip_jax.runtime.supervise only; a config's fields add
prolip_jax.runtime.config_args and what the config file imports (ml_collections), never jax.
"""
from __future__ import annotations

import ast
import functools
import sys
import textwrap
from pathlib import Path
from typing import Any

from prolip_jax.runtime import config_args, supervise

ROOT = Path(__file__).resolve().parents[2]

# (name, kind, placeholder, help): prolip_jax.train.parse_command_line defines the absl flags
# from these; --config is ml_collections' config flag (a file, then --config.<field>=value).
FLAGS: tuple[tuple[str, str, str, str], ...] = (
    ("workdir", "string", "DIR", ("checkpoints, metrics.jsonl, TensorBoard events and the parameter "
                                  "table go here; a workdir holding a checkpoint resumes (required)")),
    ("coordinator_address", "string", "HOST:PORT", ("process 0's address, for multi-host runs "
                                                    "without auto-detection (TPU pods and SLURM are detected)")),
    ("num_processes", "integer", "N", "number of processes (with --coordinator_address)"),
    ("process_id", "integer", "I", "this process's index (with --coordinator_address)"),
    ("stop_at_step", "integer", "N", ("save and stop at step N, as a preempted run does; the same "
                                      "command without it continues to config.total_steps")),
)
# The config's sections (prolip_jax.trainer.config.SECTIONS plus loss, data and evals; a test keeps them
# equal), named here so that help needs no import of the sections' modules.
SECTIONS = ("model", "loss", "optim", "data", "masking", "step", "targets", "mesh", "init", "keep_best",
            "profile", "evals")
HELP_ARGS = ("-h", "--help", "--helpshort", "--helpfull")


def flag_value(argv: list[str], name: str) -> str | None:
    """The value of flag `name` in `argv` as absl reads it (`--name=V`, `--name V`, one dash
    too; the last one wins), or None: for what must be known before absl and jax are loaded."""
    value = None
    for i, a in enumerate(argv):
        for dash in ("--", "-"):
            if a == dash + name and i + 1 < len(argv):
                value = argv[i + 1]
            elif a.startswith(dash + name + "="):
                value = a.split("=", 1)[1]
    return value


def config_spec(argv: list[str]) -> str | None:
    """The value of --config in `argv` (`FILE[:ARGS]`), or None."""
    return flag_value(argv, "config")


def _config_args(tree: ast.Module) -> str:
    """`key=default, ...` of the `config_args.parse(arg, key="default", ...)` call in the file."""
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "parse"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "config_args"):
            return ", ".join(f"{k.arg}={ast.literal_eval(k.value)!s}" if isinstance(k.value, ast.Constant)
                             else f"{k.arg}=..." for k in node.keywords if k.arg)
    return ""


def config_help(spec: str) -> str:
    """A config file's docstring, its args (read without running the file) and its fields."""
    path = Path(spec.partition(":")[0])
    if not path.is_file():
        return f"config file {path} does not exist"
    tree = ast.parse(path.read_text(), filename=str(path))
    doc = ast.get_docstring(tree) or "(no docstring)"
    args = _config_args(tree)
    head = f"--config {path}" + (f"[:ARGS]; ARGS (key=value,...) and their defaults: {args}" if args
                                 else " (takes no args)")
    return f"{head}\n\n{doc}\n\n{_fields_help(spec)}"


# ------------------------------------------------------------------------- the config's fields
# The declared ones are read from the dataclasses that declare them (prolip_jax/trainer/config.py RunConfig
# and SECTIONS, input_pipeline DataConfig, the objective's Config) with `ast`: their modules import jax.
_TRAINER = ROOT / "prolip_jax" / "trainer" / "config.py"
_BUILD = ROOT / "prolip_jax" / "trainer" / "build.py"  # EVAL_KEYS
_NOT_IN_DATA = ("batch_size",)  # the top-level batch_size rules (trainer.config.with_defaults drops data's)


def _module_file(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


@functools.lru_cache(maxsize=None)
def _parsed(file: Path) -> ast.Module:
    return ast.parse(file.read_text(), filename=str(file))


def _imports(file: Path) -> dict[str, tuple[str, str | None]]:
    """The file's imported names: alias -> (module, None) for a module, (module, name) for a name."""
    out: dict[str, tuple[str, str | None]] = {}
    for node in _parsed(file).body:
        if isinstance(node, ast.Import):
            out.update({a.asname or a.name: (a.name, None) for a in node.names if a.asname})
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out[a.asname or a.name] = (sub, None) if _module_file(sub) else (node.module, a.name)
    return out


def _class(file: Path, expr: ast.expr) -> tuple[Path, ast.ClassDef] | None:
    """The class that `expr` (a name or module.name in `file`) denotes, or None."""
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name):  # module.Class
        module, name = _imports(file).get(expr.value.id, ("", ""))
        target = _module_file(module) if module and name is None else None
        return _class(target, ast.Name(expr.attr)) if target else None
    if not isinstance(expr, ast.Name):
        return None
    for node in _parsed(file).body:
        if isinstance(node, ast.ClassDef) and node.name == expr.id:
            return file, node
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)  # X = SimpleNamespace(Config=C)
                and any(isinstance(t, ast.Name) and t.id == expr.id for t in node.targets)):
            config = next((k.value for k in node.value.keywords if k.arg == "Config"), None)
            return _class(file, config) if config is not None else None
    module, name = _imports(file).get(expr.id, ("", None))
    target = _module_file(module) if name else None
    return _class(target, ast.Name(name)) if target else None


def _fields(file: Path, expr: ast.expr) -> list[str] | None:
    """The dataclass fields of the class `expr` in `file`, its bases' first; None if unresolved."""
    found = _class(file, expr)
    if found is None:
        return None
    where, node = found
    out = [f for base in node.bases for f in (_fields(where, base) or [])]
    for item in node.body:
        if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                and "ClassVar" not in ast.unparse(item.annotation) and item.target.id not in out):
            out.append(item.target.id)
    return out


def _assigned(file: Path, name: str) -> ast.expr | None:
    for node in _parsed(file).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node.value
    return None


def config_fields(spec: str) -> list[tuple[str, list[str]]]:
    """(section, its fields) of the trainer config `spec` (FILE[:ARGS]): the top level first, then
    each section and evaluator. The fields the file sets (its get_config is run: configs import
    ml_collections, not jax) and the declared ones it leaves at their defaults."""
    def union(declared: list[str] | None, given: Any) -> list[str]:
        declared = declared or []
        return [*declared, *(k for k in (given.keys() if hasattr(given, "keys") else given or ()) if k not in declared)]

    config = config_args.load_config_file(spec)
    top = [k for k in config if not hasattr(config[k], "keys")]
    out = [("top level", [k for k in union(_fields(_TRAINER, ast.Name("RunConfig")), top) if k != "evals"])]
    sections = _assigned(_TRAINER, "SECTIONS")
    for key, value in zip(sections.keys, sections.values):
        out.append((f"{key.value}.", union(_fields(_TRAINER, value), config.get(key.value))))
    objective = config.loss.get("objective", "prolip") if "loss" in config else "prolip"
    registry = ast.literal_eval(_assigned(_module_file("prolip_jax.core.objectives"), "REGISTRY"))
    module, _, attr = registry.get(objective, "").partition(":")
    declared = _fields(_module_file(module), ast.Name(attr or "Config")) if _module_file(module) else None
    out.append((f"loss. ({objective})", union(["objective", *(declared or [])], config.get("loss"))))
    declared = [f for f in _fields(_TRAINER, ast.Name("DataConfig")) or [] if f not in _NOT_IN_DATA]
    out.append(("data.", union(declared, config.get("data"))))
    eval_keys = ast.literal_eval(_assigned(_BUILD, "EVAL_KEYS"))
    out += [(f"evals.{name}.", union(list(eval_keys), section)) for name, section in config.get("evals", {}).items()]
    out.append(("evals.NAME.", [f"{', '.join(eval_keys)} and the fields of that evaluator type's Config (evaluators/)"]))
    return out


def _fields_help(spec: str) -> str:
    try:
        rows = config_fields(spec)
    except Exception as e:  # noqa: BLE001 - help still prints; the run would report the same error
        return f"fields: not listed, the config file failed: {' '.join(str(e).split())}"
    width = max(len(name) for name, _ in rows)
    return "\n".join(["fields (--config.FIELD=VALUE):", *(
        textwrap.fill(", ".join(fields), 100, initial_indent=f"  {name:<{width}}  ",
                      subsequent_indent=" " * (width + 4)) for name, fields in rows)])


def _configs_list() -> str:
    """One line per trainer config in configs/: its name and its docstring's first line."""
    lines = []
    folder = Path("configs") if Path("configs").is_dir() else ROOT / "configs"
    for path in sorted(folder.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        lines.append(f"  {str(path):<32} {doc.strip().splitlines()[0] if doc.strip() else ''}")
    return "\n".join(lines)


def help_text(argv: list[str], doc: str) -> str:
    """The trainer's help: `doc`, the flags, and the config's docstring (or the list of configs)."""
    rows = [("--config FILE[:ARGS]", "the experiment: a configs/*.py file, ARGS its args (key=value,...)"),
            ("--config.FIELD=VALUE", ("overrides any field of the config, e.g. --config.optim.lr=1e-4; "
                                      f"sections: {', '.join(SECTIONS)} (--config FILE --help lists "
                                      "every field)")),
            *((f"--{name} {ph}", text) for name, _, ph, text in FLAGS)]
    width = max(len(r[0]) for r in rows)
    flags = [textwrap.fill(text, 100, initial_indent=f"  {flag:<{width}}  ", subsequent_indent=" " * (width + 4))
             for flag, text in rows]
    spec = config_spec(argv)
    config = (config_help(spec) if spec else
              "configs (--config FILE --help prints one's docstring and args):\n" + _configs_list())
    return "\n".join([doc.strip(), "", "flags:", *flags, "", config])


def exit_if_help(argv: list[str], doc: str) -> None:
    """Prints the help and exits 0 when `argv` asks for it; else returns."""
    if any(a in HELP_ARGS for a in argv[1:]):
        print(help_text(argv, doc))
        sys.exit(0)


def exit_if_supervisor(argv: list[str]) -> None:
    """`python -m prolip_jax.train` before it loads jax: in a multi-process launch (a
    --coordinator_address, or supervise.auto_distributed) this process becomes the supervisor of the
    trainer, run as its child with the same command, and exits with its code; a single process,
    or the child itself, returns and trains. Read from the raw argv (flag_value), so
    that the supervisor never imports jax and the project (seconds of start-up and a few hundred
    MB per process); a command this misses (a flag file) is supervised by train.main after parsing."""
    if supervise.is_child() or not (flag_value(argv, "coordinator_address") or supervise.auto_distributed()):
        return

    def integer(name: str) -> int | None:  # a malformed one is the child's parser's to report
        value = flag_value(argv, name)
        return int(value) if value is not None and value.strip().lstrip("-").isdigit() else None

    sys.exit(supervise.run_trainer(argv, flag_value(argv, "workdir") or ".", integer("process_id"),
                                   integer("num_processes")))
