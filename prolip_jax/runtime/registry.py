"""The lazy registries (objectives, evaluators, data sources): a name maps to its entry or to a
"module[:attribute]" string imported on first use, so a run loads only what its config names."""
from __future__ import annotations

import importlib
from typing import Any, Mapping


def load(registry: Mapping[str, Any], name: str, unknown: str) -> Any:
    """`registry[name]`, imported when it is a "module[:attribute]" string; for a name not in
    `registry`, ValueError("<unknown>; registered: [...]")."""
    if name not in registry:
        raise ValueError(f"{unknown}; registered: {sorted(registry)}")
    entry = registry[name]
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        entry = importlib.import_module(module)
        entry = getattr(entry, attribute) if attribute else entry
    return entry
