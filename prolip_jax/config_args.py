"""Config-file arguments: `--config configs/<name>.py:key=value,key2=value2` (big_vision style)."""
from __future__ import annotations


def parse(arg: str | None, **defaults: str) -> dict[str, str]:
    """`defaults` updated from the comma-separated `key=value` pairs of `arg`; unknown keys are
    an error naming the known ones (values stay strings: the config converts them)."""
    out = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, _, value = item.partition("=")
        if key not in out:
            raise ValueError(f"unknown config arg {key!r}; known: {sorted(out)}")
        out[key] = value
    return out
