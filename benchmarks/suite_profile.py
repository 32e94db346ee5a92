"""Where the test suite's CPU time goes: `make test`'s pytest run, measured per test file.

    python benchmarks/suite_profile.py --out /tmp/suite_profile            # the whole suite
    python benchmarks/suite_profile.py --out DIR -- tests/test_step.py     # some tests only

Runs pytest as `make test` does (its arguments, read with `make -n test`: two xdist workers,
one file each at a time; the suite's compile cache in a fresh temporary folder) and records, for
every test, the CPU seconds of the pytest worker and of the subprocesses it waited for (trainer
runs, scripts), and in every Python process that imports jax, the XLA compile seconds of each
program (`jax.monitoring`'s backend-compile event, by the jitted function's name) with the test
that was running. Prints and writes
DIR/profile.md: CPU per file, the slowest tests, compile seconds per program and per file.

The suite's budget is CPU: `make test` keeps both cores busy, so its wall time is about its CPU
time over two. Subprocesses started in the background (tests/test_caption_recipes.py trains
two recipes at a time) are counted in the test that waits for them. Compile seconds are wall
seconds of each compile, so they run high where several processes share the cores. A process
that imports jax gets a small import hook (a sitecustomize on PYTHONPATH) that only adds the
listener; nothing else changes.
"""
from __future__ import annotations

import argparse
import collections
import csv
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Installed in every Python process of the run: once `jax.monitoring` is imported, a listener
# appends (test, event, seconds, program) rows to $SUITE_PROFILE_OUT/compile.<pid>.tsv.
SITECUSTOMIZE = '''
import importlib.abc, os, sys

class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "jax.monitoring":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            out = open(os.path.join(os.environ["SUITE_PROFILE_OUT"], f"compile.{os.getpid()}.tsv"), "a",
                       buffering=1)

            def listen(event, seconds, **kw):
                if event.startswith("/jax/core/compile/"):
                    test = os.environ.get("PYTEST_CURRENT_TEST", "-").split(" ")[0]
                    out.write(f"{test}\\t{event.rsplit('/', 1)[-1]}\\t{seconds:.4f}\\t{kw.get('fun_name', '')}\\n")
            module.register_event_duration_secs_listener(listen)
        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("SUITE_PROFILE_OUT"):
    sys.meta_path.insert(0, _Hook())
'''

# A pytest plugin: each test's CPU seconds, the worker's own and its waited-for children's.
PLUGIN = '''
import os, resource, time
import pytest

def _cpu():
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (own, kids), t0 = _cpu(), time.time()
    yield
    own2, kids2 = _cpu()
    with open(os.path.join(os.environ["SUITE_PROFILE_OUT"], f"cpu.{os.getpid()}.tsv"), "a") as f:
        f.write(f"{item.nodeid}\\t{own2 - own:.2f}\\t{kids2 - kids:.2f}\\t{time.time() - t0:.2f}\\n")
'''


def write_hooks(out: Path) -> Path:
    """out/hooks: the sitecustomize and the pytest plugin, for PYTHONPATH."""
    hooks = out / "hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (hooks / "suite_profile_plugin.py").write_text(PLUGIN)
    return hooks


def run_pytest(out: Path, pytest_args: list[str]) -> int:
    hooks = write_hooks(out)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # as `make test`
    env.update(JAX_PLATFORMS="cpu", SUITE_PROFILE_OUT=str(out), TMPDIR=tempfile.mkdtemp(prefix="suite_tmp_"),
               PYTHONPATH=os.pathsep.join(p for p in (str(hooks), env.get("PYTHONPATH")) if p))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "suite_profile_plugin", *pytest_args]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=REPO, env=env).returncode


def _rows(out: Path, prefix: str) -> list[list[str]]:
    rows = []
    for path in sorted(out.glob(f"{prefix}.*.tsv")):
        with open(path) as f:
            rows += [r for r in csv.reader(f, delimiter="\t") if len(r) == 4]
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # parametrized test ids may hold a table's separator


def report(out: Path, top: int = 25) -> str:
    cpu = [(_cell(test), float(own), float(kids), float(wall)) for test, own, kids, wall in _rows(out, "cpu")]
    compiles = [(_cell(test), event, float(s), _cell(name)) for test, event, s, name in _rows(out, "compile")]
    if not cpu:
        raise SystemExit(f"no per-test rows under {out}: did pytest run any test?")
    per_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0])
    for test, own, kids, wall in cpu:
        acc = per_file[test.split("::")[0]]
        acc[0] += own
        acc[1] += kids
        acc[2] += wall
    total_cpu = sum(own + kids for _, own, kids, _ in cpu)
    backend = [c for c in compiles if c[1] == "backend_compile_duration"]
    lines = ["# Test suite CPU profile\n",
             f"{len(cpu)} tests, {total_cpu:,.0f} CPU seconds (pytest workers and their subprocesses); "
             f"XLA compiles {sum(c[2] for c in backend):,.0f} s over {len(backend)} programs, tracing "
             f"{sum(c[2] for c in compiles if c[1] == 'jaxpr_trace_duration'):,.0f} s, lowering "
             f"{sum(c[2] for c in compiles if c[1] == 'jaxpr_to_mlir_module_duration'):,.0f} s (wall seconds of each).\n",
             "## CPU per test file\n", "| file | CPU s | of it subprocesses | wall s |", "|---|---|---|---|"]
    for name, (own, kids, wall) in sorted(per_file.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:top]:
        lines.append(f"| {name} | {own + kids:.0f} | {kids:.0f} | {wall:.0f} |")
    lines += ["", "## Slowest tests (CPU)\n", "| test | CPU s | wall s |", "|---|---|---|"]
    for test, own, kids, wall in sorted(cpu, key=lambda r: -(r[1] + r[2]))[:top]:
        lines.append(f"| {test} | {own + kids:.0f} | {wall:.0f} |")
    by_program: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for test, _, seconds, name in backend:
        for key, table in ((name.split(".")[0] or "?", by_program), (test.split("::")[0], by_file)):
            table[key][0] += seconds
            table[key][1] += 1
    for title, table in (("XLA compile seconds per program", by_program), ("XLA compile seconds per file", by_file)):
        lines += ["", f"## {title}\n", "| | seconds | compiles |", "|---|---|---|"]
        for key, (seconds, count) in sorted(table.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"| {key} | {seconds:.0f} | {count} |")
    return "\n".join(lines) + "\n"


def make_test_args() -> list[str]:
    """The pytest arguments of `make test`, read from the Makefile (`make -n`: printed, not run),
    less `-q` (run_pytest adds it) and `--durations` (the profile has its own)."""
    try:
        dry = subprocess.run(["make", "-n", "-s", "test"], cwd=REPO, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"could not read make test's command ({e}); pass pytest arguments after --")
    line = next((x for x in dry.stdout.splitlines() if " -m pytest " in x), None)
    if line is None:
        raise SystemExit("`make -n test` printed no pytest command; pass pytest arguments after --")
    argv = shlex.split(line.split(" -m pytest ", 1)[1])
    return [a for a in argv if a != "-q" and not a.startswith("--durations")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="a new or empty folder for the raw rows and profile.md")
    p.add_argument("--report-only", action="store_true", help="summarise the rows already in --out")
    p.add_argument("pytest_args", nargs="*", help="after --: pytest arguments (default: make test's)")
    args = p.parse_args(argv)
    out = Path(args.out)
    if not args.report_only:
        if out.exists() and any(out.iterdir()):
            p.error(f"--out {out} is not empty: pass a new folder (or --report-only to summarise it)")
        out.mkdir(parents=True, exist_ok=True)
        rc = run_pytest(out, args.pytest_args or make_test_args())
        if rc:
            print(f"(pytest exited with status {rc}; the profile covers the tests that ran)", file=sys.stderr)
    md = report(out)
    (out / "profile.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
