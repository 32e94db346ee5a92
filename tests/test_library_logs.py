"""Library logging off the console (prolip_jax/runtime/library_logs.py)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_failed_saves_tasks_collected_after_the_block_go_to_the_file(tmp_path):
    """asyncio reports a task whose exception nobody retrieved when the task is collected, which
    for a failed orbax save can be after the trainer's `to_file` block, even at exit: the report
    goes to train.log, never to the console; asyncio's other lines still reach the console."""
    log = tmp_path / "train.log"
    script = textwrap.dedent(f"""
        import asyncio, gc, logging
        from absl import logging as absl_logging
        from prolip_jax.runtime import library_logs
        absl_logging.set_verbosity(absl_logging.WARNING)   # as the trainer: absl's handler on the console
        tasks = []

        async def write():
            raise OSError(28, "No space left on device")

        for _ in range(2):   # a second run in the same process: one report each, no stacked filters
            with library_logs.to_file({str(log)!r}):
                loop = asyncio.new_event_loop()
                tasks.append(loop.create_task(write()))
                loop.run_until_complete(asyncio.sleep(0.01))
            loop.close()
            tasks.clear()
            gc.collect()
        logging.getLogger("asyncio").error("another asyncio line")
        loop = asyncio.new_event_loop()
        task = loop.create_task(write())   # left for the interpreter's exit to collect
        loop.run_until_complete(asyncio.sleep(0.01))
    """)
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert "never retrieved" not in run.stderr and "No space left" not in run.stderr, run.stderr
    assert "another asyncio line" in run.stderr
    assert log.read_text().count("Task exception was never retrieved") >= 2  # the exit's may go unreported
