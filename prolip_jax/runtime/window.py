"""Training metrics over the window between two logs, accumulated on device with `clu.metrics`.

The train step returns one scalar per metric; logging only the step that falls on `log_steps`
shows a noisy sample and hides a spike between logs. `Window.add(metrics)` merges every step's
values into a small `clu.metrics.Collection` on device (a jitted call with the accumulator
donated: no host sync), and `Window.result()` at a log step computes the window's values and
starts a new window. Each key is reduced by `reduction(key)`:

    "grad_norm"   max over the window's steps       (a spike between logs stays visible)
    "nonfinite"   sum: the window's count of skipped (non-finite) steps
    "lr"          the last step's value
    anything else the mean over the window's steps  (losses, a, b, sigma^2, ...)

A skipped step's non-finite values are left out of the mean and the max (its update was not
applied; `nonfinite` counts it); a key with no finite value in the window comes out NaN.
The keys are whatever the train step returns, read from its first call.
"""
import functools
from typing import Any, Callable, Mapping

import flax
import jax
import jax.numpy as jnp
from clu import metrics as clu_metrics

REDUCTIONS = {"grad_norm": "max", "nonfinite": "sum", "lr": "last"}  # others: "mean"


def reduction(key: str) -> str:
    return REDUCTIONS.get(key, "mean")


def _finite(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(values as float32 [n], their finite mask) of a scalar or array."""
    values = jnp.asarray(values, jnp.float32).reshape(-1)
    return values, jnp.isfinite(values)


@flax.struct.dataclass
class FiniteAverage(clu_metrics.Average):
    """clu's Average of the finite values only."""

    @classmethod
    def from_model_output(cls, values: jax.Array, **_) -> "FiniteAverage":
        values, finite = _finite(values)
        return super().from_model_output(jnp.where(finite, values, 0.0), mask=finite)


@flax.struct.dataclass
class Max(clu_metrics.Metric):
    """Maximum of the finite values (clu has no Max); NaN when there is none."""
    value: jax.Array
    count: jax.Array

    @classmethod
    def empty(cls) -> "Max":
        return cls(value=jnp.array(-jnp.inf, jnp.float32), count=jnp.array(0, jnp.int32))

    @classmethod
    def from_model_output(cls, values: jax.Array, **_) -> "Max":
        values, finite = _finite(values)
        return cls(value=jnp.max(jnp.where(finite, values, -jnp.inf), initial=-jnp.inf),
                   count=finite.sum(dtype=jnp.int32))

    def merge(self, other: "Max") -> "Max":
        return type(self)(value=jnp.maximum(self.value, other.value), count=self.count + other.count)

    def compute(self) -> jax.Array:
        return jnp.where(self.count > 0, self.value, jnp.nan)


@flax.struct.dataclass
class Sum(clu_metrics.Metric):
    """Sum of the values (clu has no Sum); integer values stay integers."""
    total: jax.Array

    @classmethod
    def empty(cls) -> "Sum":
        return cls(total=jnp.array(0, jnp.int32))

    @classmethod
    def from_model_output(cls, values: jax.Array, **_) -> "Sum":
        return cls(total=jnp.sum(values))

    def merge(self, other: "Sum") -> "Sum":
        return type(self)(total=self.total + other.total)

    def compute(self) -> jax.Array:
        return self.total


METRIC_TYPES = {"mean": FiniteAverage, "max": Max, "sum": Sum, "last": clu_metrics.LastValue}


def collection_type(keys: Any) -> tuple[type, dict[str, str]]:
    """(a clu Collection type over `keys`, field name -> key). Keys such as "loss/ppcl" are no
    Python identifiers, so the fields are named m0, m1, ... and read their key by name."""
    fields = {f"m{i}": key for i, key in enumerate(sorted(keys))}
    return clu_metrics.Collection.create(**{
        field: METRIC_TYPES[reduction(key)].from_output(key) for field, key in fields.items()}), fields


@functools.lru_cache(maxsize=16)
def _programs(keys: tuple[str, ...], out_sharding: Any) -> tuple[dict[str, str], Callable, Callable, Callable]:
    """(field -> key, start, add, compute): a window's jitted programs, shared by every Window of
    these keys in the process (a second run of the same trainer compiles none of them again)."""
    cls, fields = collection_type(keys)
    start = jax.jit(lambda m: cls.single_from_model_output(**m), out_shardings=out_sharding)
    add = jax.jit(lambda acc, m: acc.merge(cls.single_from_model_output(**m)),
                  donate_argnums=0, out_shardings=out_sharding)
    compute = jax.jit(lambda acc: acc.compute(), out_shardings=out_sharding)
    return fields, start, add, compute


class Window:
    """Accumulates the train step's metric dicts on device; see the module docstring.

        window = Window()
        state, metrics = train_step(state, batch); window.add(metrics)   # every step, async
        values = window.result()     # at a log step: {key: device scalar}, and a new window
    """

    def __init__(self, out_sharding: Any = None):
        """out_sharding: where the accumulator lives (the trainer's replicated NamedSharding, so
        every host reads it locally); None lets jit choose."""
        self._out_sharding = out_sharding
        self._fields: dict[str, str] | None = None
        self._acc = None
        self.steps = 0  # steps added since the last result()

    def _build(self, keys: Any) -> None:
        self._fields, self._start, self._add, self._compute = _programs(tuple(sorted(keys)), self._out_sharding)

    def add(self, metrics: Mapping[str, jax.Array]) -> None:
        """Merges one step's metrics (scalars) into the window: dispatched, not waited for."""
        if self._fields is None:
            self._build(metrics.keys())
        if set(metrics) != set(self._fields.values()):
            raise ValueError(f"the metric keys changed from {sorted(self._fields.values())} to {sorted(metrics)}")
        metrics = dict(metrics)
        self._acc = self._start(metrics) if self._acc is None else self._add(self._acc, metrics)
        self.steps += 1

    def result(self) -> dict[str, jax.Array]:
        """The window's value of every key (device scalars), then an empty window; {} if no step
        was added since the last call."""
        if self._acc is None:
            return {}
        out = self._compute(self._acc)
        self._acc, self.steps = None, 0
        return {self._fields[field]: value for field, value in out.items()}
