"""Library logging off the console: orbax's, grain's and absl's own lines go to a file.

orbax and grain log through absl's logger ("absl"), and a failed asynchronous save or a damaged
checkpoint makes them log the same traceback from several background threads (hundreds of lines
for one full disk). The user needs one line naming the fault (the trainer and the tools print
it); the details belong in a file: `WORKDIR/train.log` for the trainer (`to_file`), nowhere for a
tool that only reads (`to_file(None)`).

Inside `to_file`, for its duration:
  * the "absl" logger writes to the file only (not propagated to the console's handlers);
  * an exception that ends a background thread (orbax's save threads re-raise the write error)
    is written to the file instead of stderr;
  * tensorstore's late callbacks into an asyncio loop that orbax has closed after a failed read
    ("RuntimeError: Event loop is closed", printed through sys.excepthook from a C++ thread) go
    to the file too. Every other uncaught exception is printed as before.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import traceback
from typing import Any, Iterator

from prolip_jax import paths

LOG_NAME = "train.log"


class _PathHandler(logging.Handler):
    """Appends records to a local file, opened per record (a bucket workdir: not written)."""

    def __init__(self, path: Any):
        super().__init__(logging.DEBUG)
        self.path = None if path is None or paths.is_url(path) else str(path)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if self.path is None:
            return
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(self.format(record) + "\n")
        except OSError:  # a full disk must not turn one line into a logging traceback
            pass

    def write_exception(self, what: str, exc: BaseException) -> None:
        self.emit(logging.LogRecord("prolip_jax", logging.ERROR, __file__, 0,
                                    what + "\n" + "".join(traceback.format_exception(exc)).rstrip(), None, None))


def _closed_loop_error(exc: BaseException | None) -> bool:
    return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


@contextlib.contextmanager
def to_file(path: Any) -> Iterator[None]:
    """absl's logger, background-thread exceptions and late closed-loop errors into `path`
    (None: dropped) while the block runs; the previous settings come back afterwards. Inside
    another `to_file` block, the outer one's file keeps them."""
    absl_logger = logging.getLogger("absl")
    if any(isinstance(h, _PathHandler) for h in absl_logger.handlers):  # inside another: that one rules
        yield
        return
    handler = _PathHandler(path)
    saved = (absl_logger.handlers[:], absl_logger.propagate, absl_logger.level, threading.excepthook,
             sys.excepthook)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        handler.write_exception(f"exception in thread {name}", args.exc_value)

    def except_hook(kind: type, exc: BaseException, tb: Any) -> None:
        if _closed_loop_error(exc):
            handler.write_exception("late callback into a closed event loop", exc)
        else:
            saved[4](kind, exc, tb)

    absl_logger.handlers[:] = [handler]
    absl_logger.propagate = False
    absl_logger.setLevel(logging.INFO)
    threading.excepthook, sys.excepthook = thread_hook, except_hook
    try:
        yield
    finally:
        absl_logger.handlers[:], absl_logger.propagate = saved[0], saved[1]
        absl_logger.setLevel(saved[2])
        threading.excepthook = saved[3]
        # The closed-loop callbacks can come after the block: keep filtering those, nothing else.
        sys.excepthook = _late_filter(saved[4], handler)


def _late_filter(previous: Any, handler: _PathHandler) -> Any:
    if getattr(previous, "_prolip_late_filter", False):
        return previous

    def hook(kind: type, exc: BaseException, tb: Any) -> None:
        if _closed_loop_error(exc):
            handler.write_exception("late callback into a closed event loop", exc)
        else:
            previous(kind, exc, tb)

    hook._prolip_late_filter = True
    return hook
