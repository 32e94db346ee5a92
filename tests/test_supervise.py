"""prolip_jax/runtime/supervise.py with stand-in trainers (plain Python children, no jax): a C++ abort
becomes one line and a report in the workdir's log, a C++ warning passes through, exit codes and
SIGTERM pass through. The real case, a killed coordinator: tests/test_faults.py."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from prolip_jax.runtime import supervise

WARNING = "W1126 12:00:00.000001   77 preemption_sync_manager.cc:147] Failed to retrieve preemption notice"
FATAL = ("F1126 12:00:00.000002   77 client.h:80] Terminating process because the JAX distributed service "
         "detected fatal errors. This most likely indicates that another task died")


def child(body: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(body)]


def test_an_abort_after_a_fatal_block_is_one_line_and_the_block_goes_to_the_log(tmp_path, capfd):
    code = supervise.run(child(f"""
        import os, sys, time
        print("training", flush=True)
        print("a Python warning", file=sys.stderr, flush=True)
        print({WARNING!r}, file=sys.stderr, flush=True)
        print({FATAL!r}, file=sys.stderr, flush=True)
        print("*** Check failure stack trace: ***", file=sys.stderr, flush=True)
        time.sleep(1.5)   # symbolizing the stack: longer than a quiet second
        print("    @     0x7f22b0f040ee  xla::CoordinationServiceAgent::SetError()", file=sys.stderr, flush=True)
        os.abort()
    """), str(tmp_path), 1, 2)
    out, err = capfd.readouterr()
    assert code == 2 and out == "training\n"
    assert err.splitlines()[0] == "a Python warning" and len(err.splitlines()) == 2, err
    assert err.splitlines()[1] == (
        f"error: process 1 of 2 lost the run's coordinator (process 0: killed, or its machine lost) and jax "
        f"ended it (SIGABRT); its report: {tmp_path / 'train.process_1.log'}. Restart every process with the "
        f"same command: the run resumes from the newest intact checkpoint in {tmp_path}/checkpoints")
    report = (tmp_path / "train.process_1.log").read_text()
    assert report.startswith(WARNING) and FATAL in report and "SetError" in report


def test_a_cpp_warning_and_the_exit_code_pass_through(tmp_path, capfd):
    code = supervise.run(child(f"""
        import sys, time
        print({WARNING!r}, file=sys.stderr, flush=True)
        time.sleep(1.5)   # a quiet second: the block was a warning
        print("error: a user mistake", file=sys.stderr, flush=True)
        sys.exit(3)
    """), str(tmp_path), 0, 2)
    _, err = capfd.readouterr()
    assert code == 3 and err == WARNING + "\nerror: a user mistake\n"
    assert not (tmp_path / "train.log").exists()


def test_a_signal_without_a_cpp_block_is_reported_as_its_exit_status(tmp_path, capfd):
    code = supervise.run(child("import os, signal; os.kill(os.getpid(), signal.SIGKILL)"), str(tmp_path), 0, 2)
    assert code == 128 + signal.SIGKILL and capfd.readouterr().err == ""


def test_sigterm_reaches_the_trainer(tmp_path, capfd):
    started = tmp_path / "started"
    command = child(f"""
        import pathlib, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (print("saved", flush=True), sys.exit(0)))
        pathlib.Path({str(started)!r}).touch()
        time.sleep(60)
    """)

    def terminate_when_started():
        while not started.exists():
            time.sleep(0.05)
        signal.raise_signal(signal.SIGTERM)   # as a preemption notice reaches the parent

    before = signal.getsignal(signal.SIGTERM)
    threading.Thread(target=terminate_when_started, daemon=True).start()
    assert supervise.run(command, str(tmp_path), 0, 2) == 0
    assert capfd.readouterr().out == "saved\n"
    assert signal.getsignal(signal.SIGTERM) is before   # the caller's handler is back


def test_ctrl_c_is_left_to_the_trainer(tmp_path, capfd):
    """The terminal sends SIGINT to the whole process group: the supervisor waits for its trainer
    (no KeyboardInterrupt of its own) and exits with the trainer's code."""
    started = tmp_path / "started"
    command = child(f"""
        import pathlib, time
        pathlib.Path({str(started)!r}).touch()
        time.sleep(1.5)
        print("finished", flush=True)
    """)

    def interrupt_when_started():
        while not started.exists():
            time.sleep(0.05)
        signal.raise_signal(signal.SIGINT)   # the parent's share of a Ctrl-C

    before = signal.getsignal(signal.SIGINT)
    threading.Thread(target=interrupt_when_started, daemon=True).start()
    assert supervise.run(command, str(tmp_path), 0, 2) == 0
    assert capfd.readouterr().out == "finished\n"
    assert signal.getsignal(signal.SIGINT) is before


def test_the_child_dies_with_its_supervisor(tmp_path):
    """kill -9 of the supervising parent takes the trainer with it (Linux PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("PR_SET_PDEATHSIG is Linux's")
    pid_file, trainer = tmp_path / "child.pid", tmp_path / "trainer.py"
    trainer.write_text(textwrap.dedent(f"""
        import os, pathlib, time
        from prolip_jax.runtime import supervise
        supervise.die_with_parent()
        pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()))
        time.sleep(60)
    """))
    parent = subprocess.Popen(child(f"""
        import sys
        from prolip_jax.runtime import supervise
        sys.exit(supervise.run([sys.executable, {str(trainer)!r}], {str(tmp_path)!r}, 0, 2))
    """))
    deadline = time.time() + 60
    while not (pid_file.exists() and pid_file.read_text()) and parent.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and _alive(child_pid):
        time.sleep(0.05)
    assert not _alive(child_pid)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"   # a zombie has died
    except FileNotFoundError:
        return False


def test_the_supervisor_of_a_real_launch_loads_no_jax(tmp_path):
    """`python -m prolip_jax.train --coordinator_address ...` becomes the supervisor before the
    trainer's imports: its own imports (`-X importtime`, which the child does not inherit) hold
    no jax. The child here stops at a bad --config: one line, exit 2, passed through."""
    import os
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != supervise.CHILD_ENV}
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "prolip_jax.train", "--config", "configs/missing.py",
                        "--workdir", str(tmp_path / "w"), "--coordinator_address=127.0.0.1:1", "--num_processes", "2",
                        "--process_id=0"], cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True,
                       text=True, timeout=120)
    lines = p.stderr.splitlines()
    imported = {line.split("|")[-1].strip() for line in lines if line.startswith("import time:")}
    assert "prolip_jax.runtime.supervise" in imported and "jax" not in imported and "prolip_jax.core.step" not in imported
    errors = [line for line in lines if not line.startswith("import time:")]
    assert p.returncode == 2 and len(errors) == 1 and "configs/missing.py" in errors[0], p.stderr[-2000:]


@pytest.mark.parametrize("argv,expected", [
    (["--workdir=W", "--config", "c.py"], {"workdir": "W", "config": "c.py", "process_id": None}),
    (["-workdir", "W", "--process_id", "1", "--process_id=2"], {"workdir": "W", "process_id": "2"}),
    (["--workdirs=X", "--config"], {"workdir": None, "config": None}),
])
def test_flags_are_read_before_absl(argv, expected):
    from prolip_jax.runtime import train_flags

    for name, value in expected.items():
        assert train_flags.flag_value(["train.py", *argv], name) == value
