"""Library logging off the console: orbax's, grain's, absl's and asyncio's lines go to a file.

orbax and grain log through absl's logger ("absl"), and a failed asynchronous save or a damaged
checkpoint makes them log the same traceback from several background threads (hundreds of lines
for one full disk). The user needs one line naming the fault (the trainer and the tools print
it); the details belong in a file: `WORKDIR/train.log` for the trainer (`to_file`), nowhere for a
tool that only reads (`to_file(None)`).

Inside `to_file`, for its duration:
  * the "absl" and "asyncio" loggers (LOGGERS) write to the file only (not propagated to the
    console's handlers);
  * an exception that ends a background thread (orbax's save threads re-raise the write error)
    is written to the file instead of stderr;
  * tensorstore's late callbacks into an asyncio loop that orbax has closed after a failed read
    or write ("RuntimeError: Event loop is closed", reported through sys.unraisablehook from a
    C++ thread, once per array still in flight) go to the file too, also after the block. Every
    other unraisable exception is reported as before;
  * so do the write tasks of a failed save that are collected after the block (asyncio reports
    "Task exception was never retrieved" when a task is garbage-collected, as late as the
    interpreter's exit); asyncio's other lines reach the console again.
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import traceback
from typing import Any, Iterator

from prolip_jax.runtime import paths

LOG_NAME = "train.log"
# absl's logger carries orbax's, grain's and absl's own lines; asyncio's reports the write tasks of
# a failed orbax save ("Task exception was never retrieved").
LOGGERS = ("absl", "asyncio")


def log_name(process_index: int) -> str:
    """The trainer's log file in the workdir: train.log (process 0), train.process_<i>.log."""
    return LOG_NAME if process_index == 0 else f"train.process_{process_index}.log"


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
    loggers = [logging.getLogger(name) for name in LOGGERS]
    if any(isinstance(h, _PathHandler) for h in loggers[0].handlers):  # inside another: that one rules
        yield
        return
    handler = _PathHandler(path)
    saved = ([(lg.handlers[:], lg.propagate, lg.level) for lg in loggers], threading.excepthook,
             sys.unraisablehook)

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        handler.write_exception(f"exception in thread {name}", args.exc_value)

    for lg in loggers:
        lg.handlers[:], lg.propagate = [handler], False
        lg.setLevel(logging.INFO)
    threading.excepthook, sys.unraisablehook = thread_hook, _late_filter(saved[2], handler)
    try:
        yield
    finally:
        for lg, (handlers, propagate, level) in zip(loggers, saved[0]):
            lg.handlers[:], lg.propagate = handlers, propagate
            lg.setLevel(level)
        threading.excepthook = saved[1]
        # The closed-loop callbacks and the failed save's tasks can come after the block: keep
        # sending those to the file, nothing else.
        sys.unraisablehook = _late_filter(saved[2], handler)
        asyncio_logger = logging.getLogger("asyncio")
        for old in [f for f in asyncio_logger.filters if isinstance(f, _LateTasks)]:
            asyncio_logger.removeFilter(old)
        asyncio_logger.addFilter(_LateTasks(handler))


def _late_filter(previous: Any, handler: _PathHandler) -> Any:
    """sys.unraisablehook that sends closed-loop errors to `handler`, the rest to `previous`."""
    previous = getattr(previous, "_prolip_previous", previous)

    def hook(unraisable: Any) -> None:
        if _closed_loop_error(unraisable.exc_value):
            handler.write_exception("late callback into a closed event loop", unraisable.exc_value)
        else:
            previous(unraisable)

    hook._prolip_previous = previous
    return hook


class _LateTasks(logging.Filter):
    """On asyncio's logger after a `to_file` block: its reports of tasks and futures whose
    exception nobody retrieved (a failed save's writes, collected late) go to the file only."""

    UNRETRIEVED = ("Task exception was never retrieved", "Future exception was never retrieved")

    def __init__(self, handler: _PathHandler):
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(self.UNRETRIEVED):
            self.handler.handle(record)
            return False
        return True
