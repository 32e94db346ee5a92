"""Config files: load `path/to/config.py[:key=value,...]` (big_vision style), parse its args, check `--config.*` overrides."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from prolip_jax.runtime import messages, schema


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


def load_config_file(spec: str) -> Any:
    """`path/to/config.py[:arg]` -> the module's `get_config(arg)`, or a ValueError /
    FileNotFoundError whose one line names the problem (a mistyped path lists its folder)."""
    import importlib.util

    path, _, arg = spec.partition(":")
    file = Path(path)
    if not file.is_file():
        folder = file.parent if file.parent.is_dir() else Path(".")
        near = sorted(p.name for p in folder.glob("*.py"))
        raise FileNotFoundError(f"config file {path} does not exist ({folder}/ has: {', '.join(near) or 'no .py files'})")
    module_spec = importlib.util.spec_from_file_location(f"config_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ValueError(f"config file {path} has no get_config(arg=None) function")
    return module.get_config(arg or None)


def check_overrides(config: Any, argv: list[str], prefix: str = "--config.") -> None:
    """Every `--config.a.b=v` names a field of `config`, else a one-line ValueError naming the
    field it most likely means: a synonym in the same section (`optim.learning_rate` ->
    `optim.lr`), a field of that name in another section (`optim.total_steps` -> `total_steps`),
    or the closest spelling in the same section (schema.nearest_field)."""
    for item in argv:
        if not item.startswith(prefix):
            continue
        dotted = item[len(prefix):].partition("=")[0]
        node, where = config, "config"
        for key in dotted.split("."):
            fields = list(node.keys()) if hasattr(node, "keys") else []
            if key not in fields:
                near = schema.nearest_field(key, fields, spelling=False)
                near = ([f"{where}.{near}"] if near else _fields_named(config, key)
                        or [f"{where}.{n}" for n in filter(None, [schema.nearest_field(key, fields)])])
                what = f"{where} has no field {key!r}" if fields else f"{where} is not a section"
                if near:
                    raise ValueError(f"{item.partition('=')[0]}: {what}; did you mean {' or '.join(near[:2])}?")
                raise ValueError(f"{item.partition('=')[0]}: {what}; "
                                 f"the fields of {where}: {messages.few(sorted(fields), 8) or 'none'}")
            node, where = node[key], f"{where}.{key}"


def _fields_named(config: Any, key: str) -> list[str]:
    """Dotted paths of the fields of `config` called `key` or a synonym of it, at any depth:
    the shallowest first, then those called `key`."""
    names = schema.synonyms(key)

    def walk(node: Any, where: str) -> list[str]:
        if not hasattr(node, "keys"):
            return []
        return [p for k in node.keys() for p in ([f"{where}.{k}"] if k in names else []) + walk(node[k], f"{where}.{k}")]
    return sorted(walk(config, "config"), key=lambda path: (path.count("."), not path.endswith("." + key)))
