"""benchmarks/suite_profile.py: the hook records a process's XLA compiles by test and program;
the report sums CPU per file and compile seconds per program."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import suite_profile  # noqa: E402


def test_the_hook_records_compiles_of_a_process_that_imports_jax(tmp_path):
    hooks = suite_profile.write_hooks(tmp_path)
    env = dict(os.environ, SUITE_PROFILE_OUT=str(tmp_path), PYTEST_CURRENT_TEST="tests/test_x.py::test_y (call)",
               PYTHONPATH=str(hooks), JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    code = "import jax; jax.jit(lambda x: x * 3 + 1).lower(1.0).compile()"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    rows = suite_profile._rows(tmp_path, "compile")
    backend = [r for r in rows if r[1] == "backend_compile_duration"]
    assert backend and all(r[0] == "tests/test_x.py::test_y" for r in backend)
    assert any(r[3] == "jit(<lambda>)" for r in backend)
    # A process that never imports jax is left alone (the trainer's --help must stay jax-free).
    subprocess.run([sys.executable, "-c", "import sys; assert 'jax' not in sys.modules"], env=env, check=True)


def test_report_sums_per_file_and_per_program(tmp_path):
    (tmp_path / "cpu.1.tsv").write_text("tests/a.py::t1\t10.0\t5.0\t8.0\ntests/a.py::t2[x|y]\t1.0\t0.0\t1.0\n"
                                        "tests/b.py::t\t2.0\t30.0\t20.0\n")
    (tmp_path / "compile.2.tsv").write_text("tests/b.py::t\tbackend_compile_duration\t12.5\tjit(train_step)\n"
                                            "tests/a.py::t1\tbackend_compile_duration\t2.5\tjit(train_step)\n"
                                            "tests/a.py::t1\tjaxpr_trace_duration\t1.0\tjit(init)\n")
    md = suite_profile.report(tmp_path)
    assert "3 tests, 48 CPU seconds" in md and "XLA compiles 15 s over 2 programs, tracing 1 s" in md
    files = md.split("## CPU per test file")[1].split("##")[0]
    assert files.index("| tests/b.py | 32 | 30 | 20 |") < files.index("| tests/a.py | 16 | 5 | 9 |")
    assert "| jit(train_step) | 15 | 2 |" in md and "t2[x\\|y]" in md


def test_default_arguments_are_make_tests():
    """Read from the Makefile, not repeated: its workers and file-wise distribution and test path."""
    import re

    args = suite_profile.make_test_args()
    line = re.search(r"-m pytest (.*)", (REPO / "Makefile").read_text()).group(1)
    assert "--dist" in args and "loadfile" in args and args[-1] == "tests"
    assert "-q" not in args and not any(a.startswith("--durations") for a in args)
    assert args[args.index("-n") + 1].isdigit() and "$(TEST_WORKERS)" in line  # the variable, expanded
