"""Creating a model's parameters without compiling one program per parameter.

`jax.jit(model.init)` compiles every parameter's random draw into one program: B/16's ~400
draws are ~400 kernels, whose compile was most of the train state's start-up time on the CPU and
on the GPU (docs/performance.md, "Start-up: train state and first step"). The draws repeat a
handful of computations (every block's kernels share a shape and an initialiser), so here each
parameter is drawn by a small jitted program shared by every parameter that computes the same
thing (23 programs for B/16), compiled in parallel, then called once per parameter: the same
values bit for bit (tests/test_param_init.py), in a fraction of the time.

The key of each parameter is Flax's own: `Scope.make_rng('params')` folds the SHA-1 of the
scope path and a counter into the root key (flax/core/scope.py `LazyRng`, `_fold_in_static`).
`record` watches `Scope.param` while `model.init` is traced abstractly (no forward pass runs)
and keeps each parameter's path, that static suffix and its initialiser. A model whose
parameters are not all drawn that way is reported as not recordable (no draws), and the
caller compiles the plain `model.init`: under a lifted transform (`nn.scan`,
`nn.remat`) the rng a parameter sees is a new traced value, whose relation to the root key
cannot be read here, and an initialiser may read an input array.
"""
from __future__ import annotations

import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import flax.core.scope as flax_scope
import flax.linen as nn
from flax import traverse_util
import jax
import numpy as np


# On XLA:CPU the draws compile about twice as fast at LLVM -O1 with the older fusion emitters
# (docs/performance.md, "Levers and defaults"), and give the same bits as at XLA's defaults
# (tests/test_param_init.py). -O0 would not: without FMA contraction the truncated normal's last
# bit differs. Where XLA_FLAGS sets either
# option (the test suite compiles at -O0), the draws keep the process's setting, so that they give
# what `jax.jit(model.init)` gives in that process.
CPU_COMPILE_OPTIONS = {"xla_backend_optimization_level": 1, "xla_cpu_use_fusion_emitters": False}


# Compiled draws by (jaxpr, constants, layout, options), kept for the process: a second train
# state of the same model (a benchmark's retry, the test suite's many small models) compiles
# nothing new. Bounded: cleared when it grows past _MAX_PROGRAMS.
_PROGRAMS: dict[Any, Any] = {}
_MAX_PROGRAMS = 2048


def cpu_compile_options() -> dict | None:
    flags = os.environ.get("XLA_FLAGS", "")
    return None if any(name in flags for name in CPU_COMPILE_OPTIONS) else CPU_COMPILE_OPTIONS


@dataclasses.dataclass(frozen=True)
class Draw:
    path: tuple[str, ...]           # the parameter's path in the params tree
    suffix: tuple[str | int, ...]   # what Flax folds into the root key for it
    init: Callable[[jax.Array], Any]  # key -> the (boxed) value, as the module asked for it


def record(model: nn.Module, *inputs: Any) -> list[Draw] | None:
    """Every parameter `model.init(rng, *inputs)` creates, in creation order; None when some
    parameter's key is not Flax's fold-in of the root key or its initialiser reads an array."""
    return trace(model, *inputs)[0]


def trace(model: nn.Module, *inputs: Any) -> tuple[list[Draw] | None, Any]:
    """(`record`'s draws, the abstract variables `model.init(rng, *inputs)` returns, boxed): one
    abstract trace gives both, so the caller need not trace `model.init` again for the shapes
    and logical axes (step.state_shardings)."""
    draws: list[Draw] = []
    recordable = True
    root: list[jax.Array] = []
    original = flax_scope.Scope.param

    def param(self, name, init_fn, *init_args, unbox=True, **init_kwargs):
        nonlocal recordable
        if self.is_mutable_collection("params") and not self.has_variable("params", name):
            lazy = self.rngs.get("params")
            arrays = any(isinstance(x, jax.Array) for x in jax.tree.leaves((init_args, init_kwargs)))
            if not isinstance(lazy, flax_scope.LazyRng) or lazy.rng is not root[0] or arrays:
                recordable = False
            else:  # the suffix make_rng('params') is about to fold in (its counter, incremented)
                draws.append(Draw(self.path + (name,), lazy.suffix + (self.rng_counters["params"] + 1,),
                                  lambda key: init_fn(key, *init_args, **init_kwargs)))
        return original(self, name, init_fn, *init_args, unbox=unbox, **init_kwargs)

    def init(rng):
        root.append(rng)
        return model.init(rng, *inputs)

    flax_scope.Scope.param = param
    try:
        variables = jax.eval_shape(init, jax.random.key(0))
    finally:
        flax_scope.Scope.param = original
    return (draws if recordable else None), variables


def draw_params(draws: list[Draw], rng: jax.Array, shardings: Any) -> Any | None:
    """`nn.unbox(model.init(rng, *inputs)["params"])` laid out as `shardings` (a tree of the
    params' shardings), drawn parameter by parameter from `record`'s draws of that model; None
    when the draws do not cover exactly the parameters of `shardings`."""
    by_path = traverse_util.flatten_dict(shardings)  # path tuple -> sharding
    if set(by_path) != {d.path for d in draws}:
        return None
    # The keys: Flax's own fold-in, computed once per parameter (one small cached program).
    key_data = [np.asarray(jax.random.key_data(flax_scope._fold_in_static(rng, d.suffix))) for d in draws]
    impl = jax.random.key_impl(rng)

    # One program per distinct computation: a draw's jaxpr (its constants included), its layout
    # and the compile options.
    cpu = all(d.platform == "cpu" for s in by_path.values() for d in s.device_set)
    options = cpu_compile_options() if cpu else None
    if len(_PROGRAMS) > _MAX_PROGRAMS:
        _PROGRAMS.clear()
    lowered: dict[Any, Any] = {}
    program_of = []
    for d, kd in zip(draws, key_data):
        def draw(kd, d=d):
            return nn.unbox(d.init(jax.random.wrap_key_data(kd, impl=impl)))
        closed = jax.make_jaxpr(draw)(kd)
        sig = (str(closed), tuple(np.asarray(c).tobytes() for c in closed.consts), by_path[d.path],
               tuple(sorted((options or {}).items())))
        if sig not in _PROGRAMS and sig not in lowered:
            lowered[sig] = jax.jit(draw, out_shardings=by_path[d.path]).lower(kd)
        program_of.append(sig)
    # XLA compiles outside the GIL: the programs compile side by side.
    with ThreadPoolExecutor(max(1, min(len(lowered), os.cpu_count() or 1))) as pool:
        _PROGRAMS.update(zip(lowered, pool.map(lambda low: low.compile(options), lowered.values())))

    return traverse_util.unflatten_dict({d.path: _PROGRAMS[sig](kd) for d, sig, kd in zip(draws, program_of, key_data)})
