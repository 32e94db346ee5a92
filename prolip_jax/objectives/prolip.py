"""ProLIP (seed 002 §3.2-3.3): PPCL + inclusion losses + VIB; the formulas are in losses.py.

Knobs: `losses.LossConfig` (the loss weights of the paper's eq. 6, reference defaults) plus
how PPCL is laid out over the devices. Targets other than the identity (several captions of
one image, identical captions, MSDA's soft labels) enter PPCL as BCE targets; for 0/1 targets
that is exactly the paper's -log sigmoid(z_ij logit_ij) with z = 2 m - 1.
"""
from __future__ import annotations

import dataclasses
from typing import Literal

from prolip_jax import losses, sharding

NEEDS_LOGVAR = True
USES_MASKED = True
SOFT_TARGETS = True


@dataclasses.dataclass(frozen=True)
class Config(losses.LossConfig):
    # "dense": B x B logits sharded by XLA (O(b B) per device); "ring": shard_map + ppermute,
    # O(b^2) per device (ring_loss.py). The ring scores the diagonal only: identity targets.
    ppcl_impl: Literal["dense", "ring"] = "dense"

    def validate(self) -> None:
        for name in ("ppcl_weight", "vib_beta", "alpha_image_text", "alpha_masked", "inclusion_scale"):
            if getattr(self, name) < 0:
                raise ValueError(f"config.loss.{name} must be >= 0, got {getattr(self, name)}")


def loss(out, cfg: Config, *, targets=None, masked=None, masked_rows=None, rng=None, mesh=None):
    ppcl_fn = None
    if cfg.ppcl_impl == "ring":
        if targets is not None:
            raise ValueError("config.loss.ppcl_impl='ring' scores one positive per row; use 'dense' with "
                             "multi-positive or soft targets")
        from prolip_jax.ring_loss import ppcl_loss_ring

        ppcl_fn = lambda *a: ppcl_loss_ring(*a, mesh=mesh, batch_axes=sharding.batch_axes(mesh))  # noqa: E731
    return losses.prolip_loss(out, masked, masked_rows, cfg, ppcl_fn=ppcl_fn, targets=targets)
