"""One process of a multi-process run trains in a child process, so that losing the run's
coordinator still ends it with one line.

When process 0 (the coordinator, which hosts jax's coordination service) dies, jax's client in
every other process polls an error and aborts the process from a C++ thread at once (SIGABRT,
a `Check failure stack trace`), before Python can say anything: jaxlib's callback for it cannot
take a Python function (prolip_jax/runtime/peers.py). So `python -m prolip_jax.train` of a multi-process
run is a small parent that starts the real trainer as its child with the same arguments and:

  * passes the child's stdout through untouched and its stderr line by line, holding back a
    block of C++ log lines (`W1126 12:00:00.000000  1234 file.cc:12] ...`) and what follows them
    until a second passes without output (unless the block holds a fatal `F` line: the abort
    and its stack trace follow) or the child ends;
  * when the child dies of a signal after such a block, appends the block to the process's log
    in the workdir (train.log or train.process_<i>.log, beside the libraries' logs:
    prolip_jax/runtime/library_logs.py) and prints one line naming the lost coordinator, or the signal,
    and the checkpoint to resume from; exit 2;
  * forwards SIGTERM (preemption: the child saves and exits 0), leaves Ctrl-C to the child (the
    terminal sends it to both) and exits with the child's code.

The child dies with the parent (Linux `PR_SET_PDEATHSIG`, set by the child at start-up), so a
kill -9 of this process still takes its trainer with it (tests/test_faults.py).
"""
from __future__ import annotations

import ctypes
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from prolip_jax.runtime import library_logs, messages, paths

CHILD_ENV = "PROLIP_JAX_SUPERVISOR_PID"  # set in the child: the parent's pid
# absl's C++ log line: severity, MMDD, time, thread, file:line]
CPP_LOG = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] ")
COORDINATOR_LOST = "JAX distributed service detected fatal errors"
QUIET_S = 1.0


def is_child() -> bool:
    return CHILD_ENV in os.environ


def auto_distributed() -> bool:
    """A multi-process launch that jax.distributed.initialize() detects by itself: SLURM jobs of
    more than one task, TPU pod slices, or PROLIP_DISTRIBUTED=1 (scripts/launch_tpu_pod.sh)."""
    return (os.environ.get("PROLIP_DISTRIBUTED") == "1" or int(os.environ.get("SLURM_NTASKS", "1")) > 1
            or "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""))


def die_with_parent() -> None:
    """In the child: be killed when the supervising parent dies (Linux; elsewhere a no-op)."""
    parent = int(os.environ[CHILD_ENV])
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent was gone before prctl: nobody is left to wait for us
        os._exit(2)


def run(command: list[str], workdir: str, process_id: int | None, num_processes: int | None) -> int:
    """Runs the trainer's `command` as a child; returns the exit code to use. process_id,
    num_processes: the command line's (None where jax detects them: SLURM's then)."""
    child = subprocess.Popen(command, env={**os.environ, CHILD_ENV: str(os.getpid())},
                             stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1)
    # SIGTERM (a preemption notice, `kill`) goes on to the trainer, which saves and exits. Ctrl-C
    # reaches the trainer from the terminal by itself (one process group): ignored here.
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda sig, _: child.send_signal(sig)),
                signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN)}
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in child.stderr:
            lines.put(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    held: list[str] = []

    def flush() -> None:
        sys.stderr.write("".join(held))
        sys.stderr.flush()
        held.clear()

    try:
        while reader.is_alive() or not lines.empty():
            try:
                line = lines.get(timeout=QUIET_S)
            except queue.Empty:
                if not any(CPP_LOG.match(h) and h[0] == "F" for h in held):  # a fatal line: the abort follows
                    flush()  # a quiet second after a C++ block: it was only a warning
                continue
            if held or CPP_LOG.match(line):
                held.append(line)
            else:
                sys.stderr.write(line)
                sys.stderr.flush()
        code = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if code >= 0 or not held:
        flush()
        return code if code >= 0 else 128 - code
    if process_id is None and "SLURM_PROCID" in os.environ:
        process_id, num_processes = int(os.environ["SLURM_PROCID"]), os.environ.get("SLURM_NTASKS")
    process = "this process" if process_id is None else f"process {process_id} of {num_processes}"
    report = _keep(held, workdir, process_id or 0)
    name = signal.Signals(-code).name
    if any(COORDINATOR_LOST in line for line in held):
        what = (f"{process} lost the run's coordinator (process 0: killed, or its machine lost) and jax "
                f"ended it ({name})")
    else:
        what = f"{process} was ended by {name} from inside jax or XLA"
    print(f"error: {what}; its report: {report}. {messages.restart_every_process(workdir)}", file=sys.stderr,
          flush=True)
    return 2


def run_trainer(argv: list[str], workdir: str, process_id: int | None, num_processes: int | None) -> int:
    """`run` of this process's own command as the trainer: `python -m prolip_jax.train argv[1:]`."""
    return run([sys.executable, "-m", "prolip_jax.train", *argv[1:]], workdir, process_id, num_processes)


def _keep(held: list[str], workdir: str, process_id: int) -> str:
    """Appends the held C++ block to the process's log in a local workdir (train.log,
    train.process_<i>.log), or to a temporary file."""
    if paths.is_url(workdir):
        fd, name = tempfile.mkstemp(prefix="prolip_jax-crash-", suffix=".log")
        os.close(fd)
        path = Path(name)
    else:
        path = Path(workdir) / library_logs.log_name(process_id)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(held))
    except OSError as e:
        return f"not kept ({e.strerror})"
    return str(path)
