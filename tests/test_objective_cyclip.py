"""CyCLIP: the loss against a float64 reference written with per-pair loops (the authors' code,
goel-shashank/CyCLIP src/train.py `get_loss`, read term by term), to 1e-5 relative; the batch
sharded over 8 devices gives the same value; the registry contract and the knobs' checks."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from prolip_jax.core import objectives, sharding
from prolip_jax.core.objectives import cyclip

RTOL = 1e-5


def _out(b=6, d=4, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    v, t = rng.normal(size=(b, d)), rng.normal(size=(b, d))
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    t /= np.linalg.norm(t, axis=1, keepdims=True)
    return {"image_mean": v.astype(np.float32), "text_mean": t.astype(np.float32),
            "image_logvar": None, "text_logvar": None, "logit_scale": np.float32(scale),
            "logit_bias": np.float32(0.0)}


def _reference(out, lam_in, lam_cross):
    """float64, loops: CE over rows and columns of a v.t, then the code's cyclic terms with the
    logit scale multiplied in and divided out again, as `get_loss` writes them."""
    v, t = np.asarray(out["image_mean"], np.float64), np.asarray(out["text_mean"], np.float64)
    a, n = float(out["logit_scale"]), len(v)
    logits = a * v @ t.T

    def ce(rows):
        return np.mean([np.log(np.sum(np.exp(r))) - r[i] for i, r in enumerate(rows)])

    clip = (ce(logits) + ce(logits.T)) / 2
    inmodal = sum(((a * v[j] @ v[k]) - (a * t[j] @ t[k])) ** 2 for j in range(n) for k in range(n)) / n ** 2
    cross = sum(((a * v[j] @ t[k]) - (a * v[k] @ t[j])) ** 2 for j in range(n) for k in range(n)) / n ** 2
    return clip + lam_in * inmodal / a ** 2 * n + lam_cross * cross / a ** 2 * n


def _rel(actual, expected) -> float:
    return abs(float(actual) - expected) / abs(expected)


@pytest.mark.parametrize("lam_in,lam_cross", [(0.25, 0.25), (1.0, 0.0), (0.0, 0.5)])
def test_matches_reference(lam_in, lam_cross):
    out = _out()
    total, terms = cyclip.loss(jax.tree.map(jnp.asarray, out), cyclip.Config(lam_in, lam_cross))
    assert _rel(total, _reference(out, lam_in, lam_cross)) < RTOL
    assert set(terms) == {"clip"} | ({"inmodal_cyclic"} if lam_in else set()) | (
        {"crossmodal_cyclic"} if lam_cross else set())
    assert float(terms.get("crossmodal_cyclic", 1.0)) > 0  # random pairs are not symmetric


def test_cyclic_terms_vanish_for_identical_towers():
    """v = t: image-image equals text-text and v_j.t_k = v_k.t_j, so only InfoNCE is left."""
    out = _out()
    out["text_mean"] = out["image_mean"]
    _, terms = cyclip.loss(jax.tree.map(jnp.asarray, out), cyclip.Config())
    assert float(terms["inmodal_cyclic"]) == pytest.approx(0.0, abs=1e-6)
    assert float(terms["crossmodal_cyclic"]) == pytest.approx(0.0, abs=1e-6)


def test_sharded_equals_unsharded():
    obj, cfg = objectives.get("cyclip"), cyclip.Config()
    out = jax.tree.map(jnp.asarray, _out(b=16, d=8, seed=3))
    mesh = sharding.make_mesh((8,), ("data",))
    rows = NamedSharding(mesh, P("data"))
    placed = jax.tree.map(lambda x: jax.device_put(x, rows if x.ndim else NamedSharding(mesh, P())), out)
    sharded = jax.jit(lambda o: obj.loss(o, cfg, mesh=mesh))(placed)
    assert _rel(sharded[0], float(obj.loss(out, cfg)[0])) < RTOL


def test_registered_with_the_contract_and_checks_its_knobs():
    obj = objectives.get("cyclip")
    assert dataclasses.is_dataclass(obj.Config) and obj.Config.__dataclass_params__.frozen
    assert (obj.NEEDS_LOGVAR, obj.USES_MASKED, obj.SOFT_TARGETS) == (False, False, False)
    with pytest.raises(ValueError, match="inmodal_weight"):
        obj.Config(inmodal_weight=-1.0).validate()
