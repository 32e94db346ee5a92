"""A lost process in a multi-process run ends the others in one line, within a bounded time.

When one process of a run dies (kill -9, the OOM killer, a lost machine), the others wait in
their next collective. jax's coordination service notices the missing heartbeats after
`heartbeat_timeout_seconds` (100 s by default) and aborts every process with a C++ stack trace.
`PeerWatch` gets there first and says it in one line: each process beats in the coordination
service's key-value store every few seconds (a background thread: it beats while the main
thread computes, compiles or waits), and reads the others' beats. A process whose beat has not
changed for `timeout_s` (PROLIP_PEER_TIMEOUT_S, default 60 s), one that ended with an error, or
a coordinator that no longer answers, ends this process with one line and exit code 2. A process
that ended cleanly (the run finished, or preempted and saved) says so first, and is not missed.

Not here: when the coordinator (process 0) dies, jax's client in every other process sees its
error-polling call fail and aborts at once with a C++ stack trace (jaxlib's callback for that,
`missed_heartbeat_callback`, cannot be given a Python function: its status argument has no
Python conversion). prolip_jax/runtime/supervise.py turns that abort into the one line.

Restarting every process with the same command resumes from the newest intact checkpoint.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Callable

import jax
from jax._src import distributed  # the client jax.distributed.initialize made (no public handle)

from prolip_jax.runtime import messages

TIMEOUT_S = float(os.environ.get("PROLIP_PEER_TIMEOUT_S", "60"))
_BEAT, _EXIT = "prolip_jax/beat/{}", "prolip_jax/exit/{}"


class PeerWatch:
    """Beats for process `me` of `n` and watches the others (see the module docstring)."""

    def __init__(self, client: Any, me: int, n: int, on_lost: Callable[[str], None], timeout_s: float = TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic):
        self.client, self.me, self.n, self.on_lost = client, me, n, on_lost
        self.timeout_s, self.clock = timeout_s, clock
        self.every_s = max(min(5.0, timeout_s / 4), 0.5)
        self.beats = 0
        self.seen = {p: (None, clock()) for p in range(n) if p != me}  # last beat and when it changed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prolip-peer-watch", daemon=True)

    def start(self) -> "PeerWatch":
        self.check_once()  # the first beat before the run starts
        self._thread.start()
        return self

    def stop(self, code: int) -> None:
        """This process ends with `code` (0: cleanly): the others take note, the watch stops."""
        self._stop.set()
        try:
            self.client.key_value_set(_EXIT.format(self.me), str(code), allow_overwrite=True)
        except Exception:  # noqa: BLE001 - the coordinator is gone already: nothing to tell
            pass

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            problem = self.check_once()
            if problem and not self._stop.is_set():
                self.on_lost(problem)
                return

    def check_once(self) -> str | None:
        """One beat and one look at the others: what is wrong, or None."""
        self.beats += 1
        try:
            self.client.key_value_set(_BEAT.format(self.me), str(self.beats), allow_overwrite=True)
        except Exception:  # noqa: BLE001 - any failure to reach the coordination service
            return "the run's coordinator (process 0) does not answer (killed, or its machine lost)"
        now = self.clock()
        for p in list(self.seen):
            ended = _get(self.client, _EXIT.format(p))
            if ended is not None:
                if ended != "0":
                    return f"process {p} of {self.n} stopped with an error (see its output)"
                del self.seen[p]  # ended cleanly: not missed
                continue
            beat = _get(self.client, _BEAT.format(p))
            last, since = self.seen[p]
            if beat != last:
                self.seen[p] = (beat, now)
            elif now - since > self.timeout_s:
                return (f"process {p} of {self.n} has sent no heartbeat for {now - since:.0f} s "
                        "(killed, or its machine lost)")
        return None


def _get(client: Any, key: str) -> str | None:
    try:
        return client.key_value_try_get(key)
    except Exception:  # noqa: BLE001 - NOT_FOUND: not written yet
        return None


def watch(workdir: str) -> PeerWatch | None:
    """The watch of this process of a multi-process run (None with one process), started; on a
    lost peer it prints one line and exits 2."""
    client = distributed.global_state.client
    if client is None or jax.process_count() < 2:
        return None
    return PeerWatch(client, jax.process_index(), jax.process_count(), lambda problem: _end(problem, workdir)).start()


def _end(problem: str, workdir: str) -> None:
    """One line on stderr, exit 2 (the main thread may be blocked in a collective with the lost
    process, so no cleanup runs)."""
    print(f"error: {problem}; stopping process {jax.process_index()} too. {messages.restart_every_process(workdir)}",
          file=sys.stderr, flush=True)
    os._exit(2)

