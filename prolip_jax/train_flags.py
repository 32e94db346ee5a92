"""The trainer's flags, declared once; its `--help`, and a multi-process launch's supervisor,
both started without importing jax.

`python -m prolip_jax.train --help` runs `exit_if_help` before the trainer imports jax and the
project (seconds), so help is instant. With `--config FILE[:ARGS]` it also prints that config
file's docstring and its args, read with `ast` (the file is not run). `exit_if_supervisor` turns
the process of a multi-process launch into its trainer's supervisor (prolip_jax/supervise.py)
from the same point. The standard library and prolip_jax.supervise only.
"""
from __future__ import annotations

import ast
import sys
import textwrap
from pathlib import Path

from prolip_jax import supervise

ROOT = Path(__file__).resolve().parents[1]

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
# The config's sections (prolip_jax.train.SECTIONS plus loss, data and evals; a test keeps them
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
    """A config file's docstring and its args, read without running the file."""
    path = Path(spec.partition(":")[0])
    if not path.is_file():
        return f"config file {path} does not exist"
    tree = ast.parse(path.read_text(), filename=str(path))
    doc = ast.get_docstring(tree) or "(no docstring)"
    args = _config_args(tree)
    head = f"--config {path}" + (f"[:ARGS]; ARGS (key=value,...) and their defaults: {args}" if args
                                 else " (takes no args)")
    return f"{head}\n\n{doc}"


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
                                      f"sections: {', '.join(SECTIONS)}")),
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
    that the supervisor never imports jax and the project (~2-3 s and a few hundred MB per
    process); a command this misses (a flag file) is supervised by train.main after parsing."""
    if supervise.is_child() or not (flag_value(argv, "coordinator_address") or supervise.auto_distributed()):
        return

    def integer(name: str) -> int | None:  # a malformed one is the child's parser's to report
        value = flag_value(argv, name)
        return int(value) if value is not None and value.strip().lstrip("-").isdigit() else None

    sys.exit(supervise.run_trainer(argv, flag_value(argv, "workdir") or ".", integer("process_id"),
                                   integer("num_processes")))
