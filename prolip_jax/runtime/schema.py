"""Typed config sections: a frozen dataclass per section, declared beside the code that uses it.

A trainer config (configs/*.py) is an ml_collections ConfigDict: that is what the command line
overrides and what a checkpoint records. Each of its sections is described by a dataclass whose
fields are the section's knobs with their defaults (e.g. `optim.OptimConfig`, the objective's
`Config` in prolip_jax/core/objectives/). This module turns the two into each other:

    defaults(cls)                 -> {field: default} to fill a ConfigDict section (typed
                                     placeholders for None, which ml_collections cannot override)
    parse(cls, section, where)    -> cls(**section), with unknown fields ("did you mean ..."),
                                     ill-typed values and choice fields (typing.Literal, or
                                     `field(metadata={"choices": ...})`) refused in one line, then
                                     the dataclass's own `validate()`
    for_platform(section, name)   -> the section with each field left None set to the
                                     platform's default (the class's PLATFORM_DEFAULTS)

so a knob is declared once and a bad one fails before anything compiles.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import types
import typing
from typing import Any, Literal, Mapping

from prolip_jax.runtime import messages

_SCALARS = (bool, int, float, str)


class FieldTypeError(TypeError, ValueError):
    """A config value of the wrong type: a user's mistake, reported in one line like a bad value
    (a ValueError too, so whoever reports those reports it)."""


def fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"{f.name} has no default")


def required(cls: type) -> tuple[str, ...]:
    """Fields without a default: a config must set them."""
    return tuple(f.name for f in dataclasses.fields(cls)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def defaults(cls: type) -> dict[str, Any]:
    """The section's fields and defaults as a ConfigDict can hold them: tuples stay tuples,
    None becomes a typed placeholder so `--config.<section>.<field>=...` can set it."""
    from ml_collections import config_dict

    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in required(cls):
            continue
        value = default_of(f)
        if value is None:
            scalar = [t for t in _flatten(hints[f.name]) if t in _SCALARS]
            value = config_dict.placeholder(scalar[0]) if scalar else None
        out[f.name] = value
    return out


# Names of one knob as other trainers spell it, tried before spelling closeness (difflib), so
# that `learning_rate` finds `lr`, which it does not resemble.
SYNONYMS = (("lr", "learning_rate", "base_lr"), ("weight_decay", "wd"),
            ("warmup_steps", "warmup", "num_warmup_steps"),
            ("total_steps", "steps", "num_steps", "max_steps", "train_steps"),
            ("batch_size", "batch", "bs", "global_batch_size"), ("num_epochs", "epochs"),
            ("num_workers", "workers"))


def synonyms(name: str) -> tuple[str, ...]:
    """`name` and the names of the same knob in SYNONYMS."""
    return next((g for g in SYNONYMS if name.lower() in g), (name,))


def nearest_field(name: str, known: Any, spelling: bool = True) -> str | None:
    """The known field that `name` most likely means: a synonym, else (with `spelling`) the
    closest spelling."""
    known = list(known)
    same = [k for k in synonyms(name) if k in known and k != name]
    if same or not spelling:
        return same[0] if same else None
    close = difflib.get_close_matches(name, known, n=1) or difflib.get_close_matches(name.lower(), known, n=1)
    return close[0] if close else None


def check_keys(given: Any, known: Any, where: str) -> None:
    """ValueError naming an unknown key (with the closest known one) in `where`."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        close = nearest_field(unknown[0], known)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ValueError(f"unknown field(s) {unknown} in {where}{hint}; the fields of {where} are: "
                         f"{messages.few(sorted(known), 8)}")


def parse(cls: type, section: Mapping[str, Any] | None, where: str) -> Any:
    """`cls` built from `section` (a ConfigDict or mapping; missing fields take their defaults)."""
    values = plain(section) if section is not None else {}
    check_keys(values, fields(cls), where)
    missing = [name for name in required(cls) if name not in values]
    if missing:
        raise ValueError(f"{where} lacks field(s) {missing}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in values:
            continue
        kwargs[f.name] = coerce(values[f.name], hints[f.name], f"{where}.{f.name}",
                                f.metadata.get("choices"))
    obj = cls(**kwargs)
    if hasattr(obj, "validate"):
        obj.validate()
    return obj


def coerce(value: Any, hint: Any, name: str, choices: tuple | None = None) -> Any:
    """`value` checked against the type `hint` (lists become tuples, ints pass as floats)."""
    value = _check_type(value, hint, name)
    if choices is not None and value not in choices:
        raise ValueError(f"{name}={value!r} is not one of {tuple(choices)}")
    return value


def _check_type(value: Any, hint: Any, name: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{name}={value!r} is not one of {args}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _check_type(value, option, name)
            except (TypeError, ValueError) as e:
                errors.append(e)
        raise errors[-1] if len(errors) == 1 else FieldTypeError(
            f"{name}={value!r} is not a {_name(hint)}")
    if origin in (tuple, list, collections.abc.Sequence) or hint in (tuple, list):
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
            raise FieldTypeError(f"{name}={value!r} is not a {_name(hint)}")
        if args and (args[-1] is Ellipsis or origin is not tuple):  # tuple[T, ...], list[T], Sequence[T]
            return tuple(_check_type(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
        if args:
            if len(args) != len(value):
                raise FieldTypeError(f"{name}={value!r} needs {len(args)} values")
            return tuple(_check_type(v, a, f"{name}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        return tuple(value)
    if origin in (dict, collections.abc.Mapping) or hint in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise FieldTypeError(f"{name}={value!r} is not a dict")
        return dict(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise FieldTypeError(f"{name}={value!r} is not a number")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise FieldTypeError(f"{name}={value!r} is not an integer")
        return value
    if hint is bool:
        if not isinstance(value, bool):
            raise FieldTypeError(f"{name}={value!r} is not True/False")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise FieldTypeError(f"{name}={value!r} is not a string")
        return value
    return value


def _flatten(hint: Any) -> tuple:
    """The scalar types a hint allows: a Union's members, a Literal's values' types."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return tuple(a for arg in typing.get_args(hint) for a in _flatten(arg))
    if typing.get_origin(hint) is Literal:
        return tuple(dict.fromkeys(type(a) for a in typing.get_args(hint)))
    return (hint,)


def for_platform(section: Any, platform: str) -> Any:
    """`section` with each field left None given its default on `platform`: a class declares
    `PLATFORM_DEFAULTS = {"default": {field: value}, "gpu": {field: value}, ...}` (a ClassVar)
    for the fields whose best value depends on where the program runs (the speed levers)."""
    table = getattr(type(section), "PLATFORM_DEFAULTS", None)
    if not table:
        return section
    chosen = {**table["default"], **table.get(platform, {})}
    return dataclasses.replace(section, **{k: v for k, v in chosen.items() if getattr(section, k) is None})


def levers_on(section: Any, where: str) -> list[str]:
    """The PLATFORM_DEFAULTS fields of `section` set away from their "default" entry, named as a
    config override would name them: `model.flat_tokens`, `step.finite_guard=fused`."""
    table = getattr(type(section), "PLATFORM_DEFAULTS", None) or {"default": {}}
    on = []
    for k, off in table["default"].items():
        value = getattr(section, k)
        if value is not None and value != off:
            on.append(f"{where}.{k}" if value is True else f"{where}.{k}={value}")
    return on


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def plain(section: Any) -> dict[str, Any]:
    """A ConfigDict / mapping as plain Python (nested ConfigDicts become dicts)."""
    if hasattr(section, "to_dict"):
        return section.to_dict()
    return dict(section)
