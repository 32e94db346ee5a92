"""Training objectives: one module per method, one `REGISTRY` line each.

    config.loss.objective = "pcmepp"        # selects the module below
    config.loss.<knob> = ...                # that module's `Config` fields, declared only there

An objective module defines

  Config        a frozen dataclass of its `config.loss.*` knobs with their defaults (the only
                place they are declared); an optional `validate(self)` raises ValueError naming
                the bad field. `prolip_jax.runtime.schema` builds it from the ml_collections config, so
                unknown or ill-typed fields fail before anything compiles.
  NEEDS_LOGVAR  bool: needs a probabilistic head (`image_logvar` / `text_logvar` not None).
  USES_MASKED   bool: the step runs ProLIP's masked forward and passes its outputs (`masked`).
  SOFT_TARGETS  bool: accepts a match-target matrix other than the identity (several positives
                per row, MSDA's soft labels). Objectives that cannot (triplet, InfoNCE) say False
                and the config check refuses MSDA / multi-positive targets with them.
  check_targets optional (cfg, identity: bool) -> None: raises a one-line ValueError before
                compiling when this configuration cannot take targets other than the identity
                (ProLIP's ring PPCL).
  USES_STEP     optional bool (default False): `loss` also takes `step`, the global step as a
                traced int scalar (schedules inside the objective, e.g. VSE∞'s warm-up).
  loss(out, cfg, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None[, step])
                -> (total [], terms {name: weighted term []})   with total == sum(terms)

    out      model outputs on the global batch: `image_mean`, `image_logvar`, `text_mean`,
             `text_logvar` [B, D] float32 (mu unit-norm; logvar = log sigma^2, None for a
             mu-only tower), `logit_scale` (a, already exponentiated), `logit_bias` (b), and
             `text` int [B, L] (the tokens, for objectives that score captions against each
             other, e.g. DAA).
    targets  float [B_img, B_txt] in [0, 1], row i = image i; None means the identity. Every
             objective accepts binary targets (several captions of one image, identical
             captions: all positives); only SOFT_TARGETS ones accept fractional values (MSDA).
    rng      a PRNG key for objectives that sample (PCME); fresh every step.
    mesh     the device mesh, for implementations that need it (the PPCL ring).

Every objective has global-batch semantics: under `jit` with the batch sharded over the mesh
its value does not depend on how the batch is spread over devices.
"""
from __future__ import annotations

from typing import Any

from prolip_jax.runtime import registry

# name -> "module" or "module:attribute" (an object with Config, loss and the three flags),
# imported lazily so that one objective's import never slows or breaks the others.
REGISTRY: dict[str, str] = {
    "prolip": "prolip_jax.core.objectives.prolip",
    "pcmepp": "prolip_jax.core.objectives.pcmepp",
    "pishdad": "prolip_jax.core.objectives.pishdad",
    "clip": "prolip_jax.core.objectives.contrastive:clip",
    "siglip": "prolip_jax.core.objectives.contrastive:siglip",
    "vse": "prolip_jax.core.objectives.contrastive:vse",
    "pcme": "prolip_jax.core.objectives.pcme",
    "pcme_daa": "prolip_jax.core.objectives.daa:pcme_daa",
    "vse_daa": "prolip_jax.core.objectives.daa:vse_daa",
    "smooth_ap": "prolip_jax.core.objectives.smooth_ap",
    "cyclip": "prolip_jax.core.objectives.cyclip",
}


def get(name: str) -> Any:
    """The objective module registered as `name`; ValueError listing the known names."""
    return registry.load(REGISTRY, name, f"config.loss.objective={name!r} is not a registered objective")
