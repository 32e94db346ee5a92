"""User-facing messages stay short: a long list is cut to its first few items and a count.

    raise ValueError(f"{len(bad)} parameters do not fit: {messages.few(bad)}")
    # -> "3 parameters do not fit: a, b, c" or "... a, b, c and 402 more"

Standard library only: every layer (core, input_pipeline, evaluators, commands) may use it.
"""
from __future__ import annotations

from typing import Any, Iterable


def few(items: Iterable[Any], n: int = 3, sep: str = ", ") -> str:
    """The first `n` items joined by `sep`, then "and K more" when `items` holds K more."""
    items = [str(x) for x in items]
    shown = sep.join(items[:n])
    if len(items) > n:
        return f"{shown}{sep.rstrip() + ' ' if shown else ''}and {len(items) - n:,} more"
    return shown


def restart_every_process(workdir: Any) -> str:
    """The end of a multi-process run's one-line error for a lost process (prolip_jax/runtime/peers.py,
    prolip_jax/runtime/supervise.py): what to do next."""
    return ("Restart every process with the same command: the run resumes from the newest intact "
            f"checkpoint in {str(workdir).rstrip('/')}/checkpoints")
