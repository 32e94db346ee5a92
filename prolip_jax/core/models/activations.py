"""The towers' MLP activations, shared by the XLA path (transformer.py) and the Pallas kernels
(kernels.py, which bring their own erf: Triton has none)."""
from __future__ import annotations

from typing import Callable

import jax

ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")
SQRT_HALF = 0.5 ** 0.5


def gelu(x: jax.Array, act: str, erf: Callable[[jax.Array], jax.Array] = jax.lax.erf) -> jax.Array:
    """'gelu': exact (erf) GELU as torch's nn.GELU(); 'quick_gelu': OpenAI CLIP's x*sigmoid(1.702x)
    (H/14, open_clip *-quickgelu); 'gelu_tanh': the tanh approximation used by SigLIP (timm
    act_layer='gelu_tanh', flax `nn.gelu` default in big_vision's MlpBlock)."""
    if act == "quick_gelu":
        return x * jax.nn.sigmoid(1.702 * x)
    if act == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    if act == "gelu":
        # torch's nn.GELU() formula, x/2 (1 + erf(x/sqrt 2)): jax.nn.gelu(approximate=False) goes
        # through erfc, whose XLA:CPU expansion (exp + piecewise selects) makes the step slower
        # (docs/performance.md, "Levers and defaults"); the two agree to float32 rounding.
        return x * 0.5 * (1.0 + erf(x * SQRT_HALF))
    raise ValueError(f"unknown activation {act!r}; choose from {ACTIVATIONS}")
