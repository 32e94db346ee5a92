"""The GPU benchmark plan's settings and its subprocess runner (benchmarks/benchmark_gpu.py).

`Plan` holds every size and limit of the plan (`GPU_PLAN` for the GPU, `TINY_PLAN` for the test
on CPU); `Runner` runs one measurement as a subprocess under the plan's time limits and the
--deadline and records how it ended (ok, failed, timeout, not run) with the command a reader
re-runs.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PARTS = ("step", "max_batch", "levers", "torch", "e2e", "eval")
# One lever per row: config overrides (--set) or XLA flags, each against the part-1 baseline.
XLA_LEVERS = {
    "xla:latency_hiding_scheduler": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "xla:no_command_buffers": "--xla_gpu_enable_command_buffer=",
    "xla:no_triton_gemm": "--xla_gpu_enable_triton_gemm=false",
    # In the GPU profile XLA merges the full and masked image forward's dots that share a weight
    # by concatenating their activations (a [55456, 3072] copy per MLP; docs/performance.md).
    "xla:no_dot_merger": "--xla_gpu_dot_merger_threshold_mb=0",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    config: str = "configs/prolip_b16_datacomp.py"
    per_device_batch: int = 256
    sweep: tuple[int, ...] = (128, 512)
    steps: int = 20
    matmul_size: int = 8192
    profile_steps: int = 3
    max_batch_step: int = 32
    max_batch_cap: int = 8192
    max_batch_timeout: int = 270  # per policy: two policies fit in one 10-minute call
    remat_policies: tuple[str, ...] = ()  # () = every model.remat choice
    levers: tuple[str, ...] = ()  # () = every lever
    torch_steps: int = 20
    torch_compile: bool = True
    shards: int = 16
    per_shard: int = 256
    jpeg_size: tuple[int, int] = (400, 300)  # web-photo-like, cropped to the config's size
    workers: tuple[int, ...] = (4, 8, 16)
    log_steps: int = 10
    windows: int = 3  # timed log windows after the first one (which holds the compile)
    eval_args: tuple[str, ...] = ("--images", "8192", "--texts", "32768", "--batch", "1024",
                                  "--queries", "50000", "--gallery", "1000000", "--block", "1024")
    timeout: int = 480  # seconds per subprocess
    # Seconds per part (its subprocesses start only while its time lasts), besides --deadline.
    part_seconds: tuple[tuple[str, int], ...] = (("step", 900), ("max_batch", 1200), ("levers", 1200),
                                                 ("torch", 600), ("e2e", 900), ("eval", 600))


GPU_PLAN = Plan()
# The micro towers: every run of the plan is a compile and a step or two on CPU (tests/test_benchmark_gpu.py).
TINY_PLAN = Plan(config="configs/tiny.py:data=random,size=micro", per_device_batch=8, sweep=(), steps=1,
                 matmul_size=128, profile_steps=1,
                 levers=("attention=cudnn", "remat=full", "xla:latency_hiding_scheduler"), torch_steps=1,
                 torch_compile=False, shards=2, per_shard=16, jpeg_size=(64, 48), workers=(1,),
                 log_steps=1, windows=2, eval_args=("--images", "16", "--texts", "32", "--batch", "16",
                                                    "--queries", "64", "--gallery", "500", "--block", "32"),
                 timeout=600, max_batch_timeout=600, part_seconds=())  # CPU compiles: the subprocess limit only


# ------------------------------------------------------------------------------ running things
class Runner:
    """Runs subprocesses under the plan's limits and the deadline; appends their output to log.txt."""

    def __init__(self, out: Path, tmp: Path, timeout: int, deadline: float | None):
        self.out, self.tmp, self.timeout = out, tmp, timeout
        self.start, self.deadline = time.monotonic(), deadline
        self.part_end: float | None = None  # monotonic time at which the current part's time is up
        self.log = open(out / "log.txt", "a")
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), self.env.get("PYTHONPATH")) if p)
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        # The largest-batch search and the big gallery want the device's memory, not JAX's
        # default 75% of it; recorded in results.json.
        self.env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")

    def left(self) -> float:
        now = time.monotonic()
        plan_left = float("inf") if self.deadline is None else self.deadline - (now - self.start)
        return min(plan_left, float("inf") if self.part_end is None else self.part_end - now)

    def run(self, name: str, argv: list[str], json_out: Path | None = None, xla_flags: str = "",
            timeout: int | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
        """{"name", "command", "status": ok | failed | timeout | not run, "seconds", "result"
        (the JSON the command wrote, even a partial one), "error"}. `env`: variables set for
        this command (shown in its command)."""
        extra = dict(env or {})
        env = {**self.env, **extra}
        if xla_flags:  # added to whatever XLA_FLAGS the caller has (e.g. fake CPU devices)
            env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), xla_flags) if f)
        record: dict[str, Any] = {"name": name, "command": "".join(
            f"{k}={shlex.quote(v)} " for k, v in extra.items()) + self.display(argv, xla_flags)}
        if self.left() < 15:  # nothing worth starting in the last seconds before the deadline
            return {**record, "status": "not run", "error": "the part's time or the --deadline was used up"}
        limit = min(timeout or self.timeout, self.left() - 5)
        self.log.write(f"\n===== {name}: {record['command']}\n")
        self.log.flush()
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: a timeout ends its workers too
        try:
            rc = proc.wait(timeout=limit)
            record["status"] = "ok" if rc == 0 else "failed"
            if rc:
                record["error"] = f"exit status {rc}: {self.tail()}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            record.update(status="timeout", error=f"stopped after {limit:.0f} s")
        record["seconds"] = round(time.monotonic() - t0, 1)
        if json_out is not None and json_out.exists():
            try:
                record["result"] = json.loads(json_out.read_text())
            except json.JSONDecodeError as e:
                record.update(status="failed", error=f"{json_out.name}: {e}")
        elif record["status"] == "ok" and json_out is not None:
            record.update(status="failed", error="the command wrote no results")
        print(f"[{time.monotonic() - self.start:6.0f} s] {name}: {record['status']} ({record['seconds']} s)"
              + (f" - {record['error'][-300:]}" if record.get("error") else ""), flush=True)
        return record

    def tail(self, lines: int = 6) -> str:
        """The last lines of log.txt: the failed command's own last words."""
        self.log.flush()
        text = (self.out / "log.txt").read_text(errors="replace").splitlines()
        return " | ".join(line.strip() for line in text[-lines:] if line.strip())[-1500:]

    def display(self, argv: list[str], xla_flags: str = "") -> str:
        """The command as a reader re-runs it: `python`, paths relative to the repository, no
        temporary output files."""
        words, skip = [], False
        for a in argv:
            if skip:
                skip = False
                continue
            if a == "--json":
                skip = True
                continue
            a = "python" if a == sys.executable else a.replace(str(self.tmp), "$TMP").replace(str(REPO) + "/", "")
            words.append(a)
        prefix = f"XLA_FLAGS={shlex.quote(xla_flags)} " if xla_flags else ""
        # $TMP (this run's temporary folder) stays expandable: double quotes, no globbing.
        return prefix + " ".join(f'"{w}"' if "$TMP" in w else shlex.quote(w) for w in words)


def part_status(runs: list[dict]) -> str:
    done = [r["status"] for r in runs if r["status"] != "skipped"]
    if not done:
        return "skipped"
    if all(s == "ok" for s in done):
        return "ok"
    return "partial" if "ok" in done else "failed"


def skipped(name: str, reason: str, command: str = "") -> dict:
    return {"name": name, "command": command, "status": "skipped", "reason": reason}
