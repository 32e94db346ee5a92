"""The optimiser pieces of the COCO recipes of the seed papers: AdamP (PCME++ Table B.1,
DAA §5.2), the step lr schedule (PCME++ App. B.2, Pishdad et al. §4.2), weight
averaging (PCME++ App. B.3) and the lr warm-up after unfreezing (PCME++ §3.1 / App. B.2).

AdamP is checked against a float64 numpy transcription of clovaai/AdamP `adamp.py` (`AdamP.step`,
`_projection`, `_channel_view`, `_layer_view`) run on the tensors in PyTorch's layout, so the
choice of Flax channel axes is checked with it."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from prolip_jax.core import optim

OPTIM = dict(lr=1e-2, warmup_steps=0, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.5, clip_norm=0.0, end_lr=0.0)
ADAMP = dict(name="adamp", schedule="step", step_boundaries=(3,), step_factor=0.1)
STEPS = 5

# Leaves of the test tree, their shapes (Flax layout) and the AdamP branch their gradients make.
LEAVES = {
    "visual/transformer/resblocks_0/attn/query_kernel": ((6, 2, 3), "channel"),  # torch in_proj rows
    "visual/transformer/resblocks_0/mlp/kernel": ((6, 5), "none"),  # gradient along p: no projection
    "visual/transformer/resblocks_0/mlp/bias": ((5,), "none"),  # 1-D: never projected, never decayed
    "visual/transformer/resblocks_1/chan/kernel": ((6, 5), "channel"),  # per output unit scale-invariant
    "visual/transformer/resblocks_1/layer/kernel": ((6, 5), "layer"),  # scale-invariant as a whole
    "visual/token_embedding": ((7, 4), "channel"),  # rows, as torch's nn.Embedding
    "text/token_embedding": ((7, 4), "channel"),
    "logit_scale": ((), "none"),
}


def nest(flat):
    tree = {}
    for path, x in flat.items():
        *parents, name = path.split("/")
        node = tree
        for k in parents:
            node = node.setdefault(k, {})
        node[name] = x
    return tree


def flatten(tree):
    return dict(zip(optim.param_paths(tree), jax.tree.leaves(tree)))


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    flat = {p: rng.normal(size=s) for p, (s, _) in LEAVES.items()}
    flat["logit_scale"] = np.float64(2.0)
    return flat  # float64, '/'-paths


# ------------------------------------------------------- the reference, in PyTorch's layout
def to_torch(path, x):
    name = path.rsplit("/", 1)[-1]
    if name == "query_kernel":  # Flax [in, heads, head_dim] <- torch in_proj rows [heads * head_dim, in]
        return x.reshape(x.shape[0], -1).T
    if name == "kernel":  # Flax Dense [in, out] <- torch nn.Linear [out, in]
        return x.T
    return x  # embeddings, biases, scalars: the same layout


def from_torch(path, x, shape):
    name = path.rsplit("/", 1)[-1]
    if name in ("query_kernel", "kernel"):
        return x.T.reshape(shape)
    return x


def channel_view(x):
    return x.reshape(x.shape[0], -1)  # adamp.py `_channel_view`: x.view(x.size(0), -1)


def layer_view(x):
    return x.reshape(1, -1)  # `_layer_view`: x.view(1, -1)


def cosine_similarity(x, y, eps):
    # torch.nn.functional.cosine_similarity(x, y, dim=1, eps) (x.y / (max(|x|, eps) max(|y|, eps))), abs_()
    nx = np.maximum(np.linalg.norm(x, axis=1), eps)
    ny = np.maximum(np.linalg.norm(y, axis=1), eps)
    return np.abs(np.sum(x * y, axis=1) / (nx * ny))


def projection(p, grad, perturb, delta, wd_ratio, eps):
    """adamp.py `_projection`; also returns which view projected and the margins of the test."""
    wd = 1.0
    expand = [-1] + [1] * (p.ndim - 1)
    ratios = {}
    for name, view in (("channel", channel_view), ("layer", layer_view)):
        cos = cosine_similarity(view(grad), view(p), eps)
        threshold = delta / math.sqrt(view(p).shape[1])
        ratios[name] = cos.max() / threshold
        if cos.max() < threshold:
            p_n = p / (np.linalg.norm(view(p), axis=1).reshape(expand) + eps)
            perturb = perturb - p_n * view(p_n * perturb).sum(axis=1).reshape(expand)
            wd = wd_ratio
            return perturb, wd, name, ratios
    return perturb, wd, "none", ratios


class ReferenceAdamP:
    """adamp.py `AdamP.step` on one parameter group per leaf (lr x lr_mult, the leaf's weight decay)."""

    def __init__(self, b1, b2, eps, delta, wd_ratio, nesterov):
        self.b1, self.b2, self.eps, self.delta, self.wd_ratio, self.nesterov = b1, b2, eps, delta, wd_ratio, nesterov
        self.state = {}

    def step(self, p, grad, key, lr, weight_decay):
        b1, b2 = self.b1, self.b2
        s = self.state.setdefault(key, dict(step=0, exp_avg=np.zeros_like(p), exp_avg_sq=np.zeros_like(p)))
        s["step"] += 1
        bias_correction1 = 1 - b1 ** s["step"]
        bias_correction2 = 1 - b2 ** s["step"]
        s["exp_avg"] = s["exp_avg"] * b1 + (1 - b1) * grad
        s["exp_avg_sq"] = s["exp_avg_sq"] * b2 + (1 - b2) * grad * grad
        denom = np.sqrt(s["exp_avg_sq"]) / math.sqrt(bias_correction2) + self.eps
        step_size = lr / bias_correction1
        if self.nesterov:
            perturb = (b1 * s["exp_avg"] + (1 - b1) * grad) / denom
        else:
            perturb = s["exp_avg"] / denom
        wd_ratio, branch, ratios = 1.0, "none", {}
        if p.ndim > 1:
            perturb, wd_ratio, branch, ratios = projection(p, grad, perturb, self.delta, self.wd_ratio, self.eps)
        if weight_decay > 0:
            p = p * (1 - lr * weight_decay * wd_ratio)
        return p - step_size * perturb, branch, ratios


def make_grad(path, p_torch, rng):
    """A gradient (torch layout) giving the branch of LEAVES: orthogonal to p per channel (row),
    orthogonal to p as a whole, or along p."""
    g = rng.normal(size=p_torch.shape)
    kind = LEAVES[path][1]
    if kind == "channel":
        rows, pv = channel_view(g), channel_view(p_torch)
        rows = rows - pv * (np.sum(rows * pv, axis=1, keepdims=True) / np.sum(pv * pv, axis=1, keepdims=True))
        return rows.reshape(g.shape)
    if kind == "layer":
        return g - p_torch * (np.sum(g * p_torch) / np.sum(p_torch * p_torch))
    if p_torch.ndim > 1:
        return p_torch + 0.3 * g
    return g


def reference_run(flat, *, lr_of, wd_of, locked=(), clip=0.0, nesterov=False, steps=STEPS, delta=0.1, wd_ratio=0.1,
                  seed=1):
    """(params after each step, Flax-layout gradients of each step, branches) of the reference."""
    rng = np.random.default_rng(seed)
    ref = ReferenceAdamP(OPTIM["b1"], OPTIM["b2"], OPTIM["eps"], delta, wd_ratio, nesterov)
    torch_p = {k: to_torch(k, v) for k, v in flat.items()}
    trajectory, grads, branches = [], [], []
    for t in range(steps):
        g = {k: (np.zeros_like(v) if k in locked else make_grad(k, v, rng)) for k, v in torch_p.items()}
        grads.append({k: from_torch(k, v, flat[k].shape) for k, v in g.items()})
        if clip:  # optax.clip_by_global_norm (torch's clip_grad_norm_ divides by norm + 1e-6)
            norm = math.sqrt(sum(np.sum(v * v) for v in g.values()))
            g = {k: v * min(1.0, clip / norm) for k, v in g.items()}
        new, branch = {}, {}
        for k, v in torch_p.items():
            if k in locked:  # no optimiser state, no update (torch: requires_grad False)
                new[k], branch[k] = v, ("locked", {})
                continue
            new[k], *branch[k] = ref.step(v, g[k], k, lr_of(t, k), wd_of[k])
        torch_p = new
        trajectory.append({k: from_torch(k, v, flat[k].shape) for k, v in torch_p.items()})
        branches.append(branch)
    return trajectory, grads, branches


def jax_run(tx, flat, grads):
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), nest(flat))
    state = tx.init(params)
    update = jax.jit(tx.update)
    out = []
    for g in grads:
        u, state = update(jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), nest(g)), state, params)
        params = optax.apply_updates(params, u)
        out.append(flatten(params))
    return out, state


def assert_same_trajectory(ours, reference, flat):
    """float32 against float64, compared on the displacements p_t - p_0 (O(lr) = 1e-2 here): within
    1e-6 absolute (a few float32 ulps of the O(1) parameters; 2e-7 to 5e-7 measured) + 1e-4 relative."""
    for t, (a, b) in enumerate(zip(ours, reference)):
        for path, p0 in flat.items():
            p0 = np.float32(p0)
            np.testing.assert_allclose(np.float64(a[path]) - p0, b[path] - p0, rtol=1e-4, atol=1e-6,
                                       err_msg=f"step {t} {path}")


def step_lr(t, _):
    return OPTIM["lr"] * (0.1 if t >= 3 else 1.0)  # ADAMP's schedule: constant, x0.1 from step 3


def check_branches(branches):
    """Each leaf took the branch its gradients were made for, far from the thresholds."""
    for per_step in branches:
        for path, (branch, ratios) in per_step.items():
            if branch == "locked":
                continue
            assert branch == LEAVES[path][1], path
            if branch == "channel":
                assert ratios["channel"] < 1e-6
            if branch in ("layer", "none") and ratios:
                assert ratios["channel"] > 2, (path, ratios)
            if branch == "layer":
                assert ratios["layer"] < 1e-6
            if branch == "none" and ratios:
                assert ratios["layer"] > 2, (path, ratios)


# ------------------------------------------------------------------------------ AdamP
@pytest.mark.parametrize("nesterov", [False, True])
def test_adamp_matches_the_reference_update_rule(nesterov):
    flat = make_params()
    # The reference decay mask: >= 2-D and no bn / ln / bias / logit_scale in the name.
    wd_of = {k: OPTIM["weight_decay"] if v.ndim >= 2 else 0.0 for k, v in flat.items()}
    trajectory, grads, branches = reference_run(flat, lr_of=step_lr, wd_of=wd_of, nesterov=nesterov)
    check_branches(branches)
    tx, _ = optim.make_optimizer(optim.OptimConfig.of({**OPTIM, **ADAMP, "adamp_nesterov": nesterov}), 10)
    ours, state = jax_run(tx, flat, grads)
    assert_same_trajectory(ours, trajectory, flat)
    adam = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    assert len(adam) == 1 and int(adam[0].count) == STEPS  # Adam's state: transfer_state and sharding apply


def test_adamp_projection_and_wd_ratio_change_the_update():
    # The check above is not vacuous: without the projection (delta -> 0) or with wd_ratio 1 the
    # scale-invariant weights move differently, the others not at all.
    flat = make_params()
    wd_of = {k: OPTIM["weight_decay"] if v.ndim >= 2 else 0.0 for k, v in flat.items()}
    base, grads, _ = reference_run(flat, lr_of=step_lr, wd_of=wd_of)
    for extra in (dict(adamp_delta=1e-12), dict(adamp_wd_ratio=1.0)):
        tx, _ = optim.make_optimizer(optim.OptimConfig.of({**OPTIM, **ADAMP, **extra}), 10)
        ours, _ = jax_run(tx, flat, grads)
        for path, (_, kind) in LEAVES.items():
            differs = not np.allclose(ours[-1][path], base[-1][path], rtol=1e-5, atol=1e-6)
            assert differs == (kind != "none"), (extra, path)


def test_adamp_composes_with_groups_layer_decay_locking_and_clipping():
    flat = make_params()
    cfg = {**OPTIM, **ADAMP, "clip_norm": 1.0, "layer_decay": 0.5, "locked": "^text/",
           "groups": (dict(pattern="/resblocks_1/", lr_mult=0.5, weight_decay=0.3),)}
    # Written out: visual has L = 2 blocks; block i gets 0.5^(2 - i), the stem 0.5^3, the group x0.5.
    mult = {"visual/transformer/resblocks_0/attn/query_kernel": 0.25, "visual/transformer/resblocks_0/mlp/kernel": 0.25,
            "visual/transformer/resblocks_0/mlp/bias": 0.25, "visual/transformer/resblocks_1/chan/kernel": 0.25,
            "visual/transformer/resblocks_1/layer/kernel": 0.25, "visual/token_embedding": 0.125,
            "text/token_embedding": 1.0, "logit_scale": 1.0}
    wd_of = {k: (0.3 if "/resblocks_1/" in k else OPTIM["weight_decay"]) if v.ndim >= 2 else 0.0
             for k, v in flat.items()}
    params32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), nest(flat))
    assert flatten(optim.lr_multipliers(params32, optim.OptimConfig.of(cfg))) == mult
    trajectory, grads, branches = reference_run(flat, lr_of=lambda t, k: step_lr(t, k) * mult[k], wd_of=wd_of,
                                                locked={"text/token_embedding"}, clip=1.0)
    check_branches(branches)
    assert math.sqrt(sum(np.sum(v * v) for v in grads[0].values())) > 5  # clipping is active
    tx, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), 10, params32)
    ours, _ = jax_run(tx, flat, grads)
    assert_same_trajectory(ours, trajectory, flat)
    np.testing.assert_array_equal(ours[-1]["text/token_embedding"], np.float32(flat["text/token_embedding"]))


def test_switching_adamw_to_adamp_carries_the_moments():
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), nest(make_params()))
    adamw, _ = optim.make_optimizer(optim.OptimConfig.of(OPTIM), 10)
    state = adamw.init(params)
    for k in range(2):
        grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.1 * (k + 1), jnp.float32), params)
        _, state = adamw.update(grads, state, params)
    adamp, _ = optim.make_optimizer(optim.OptimConfig.of({**OPTIM, "name": "adamp"}), 10)
    carried = optim.transfer_state(state, adamp, params)
    jax.tree.map(np.testing.assert_array_equal, carried[0], state[0])  # count, mu, nu
    assert int(carried[-1].count) == 2


def test_adamp_channel_axes_are_torch_dim_0():
    ax = optim.adamp_channel_axes
    assert ax("visual/transformer/resblocks_0/c_fc/kernel", 2) == (1,)  # Dense [in, out]
    assert ax("visual/patch_kernel", 4) == (3,)  # Conv [kh, kw, in, out]
    assert ax("text/transformer/resblocks_0/attn/key_kernel", 3) == (1, 2)  # [in, heads, head_dim]
    assert ax("text/transformer/resblocks_0/attn/out_kernel", 3) == (2,)  # [heads, head_dim, out]
    assert ax("text/token_embedding", 2) == ax("visual/positional_embedding", 2) == ax("visual/proj", 2) == (0,)


# --------------------------------------------------------------------------- step schedule
def test_step_schedule_values_at_the_boundaries():
    cfg = {**OPTIM, "lr": 1.0, "warmup_steps": 2, "schedule": "step", "step_boundaries": (5, 8), "step_factor": 0.1}
    tx, schedule = optim.make_optimizer(optim.OptimConfig.of(cfg), 10)
    got = [float(schedule(t)) for t in range(10)]
    want = [0.5, 1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.1, 0.01, 0.01]
    np.testing.assert_allclose(got, want, rtol=1e-6)
    # Fractions of total_steps: PCME++ (x0.1 for the last 10 of 25 epochs), Pishdad et al. (/10 at 15 of 30).
    for fraction, total, boundary in ((0.6, 25 * 40, 15 * 40), (0.5, 30 * 7, 15 * 7)):
        s = optim.make_schedule(optim.OptimConfig.of({**OPTIM, "lr": 5e-4, "schedule": "step", "step_boundaries": (fraction,)}), total)
        assert float(s(boundary - 1)) == pytest.approx(5e-4) and float(s(boundary)) == pytest.approx(5e-5)
        assert float(s(total - 1)) == pytest.approx(5e-5)
    # It drives the updates: with a constant gradient Adam's direction is g / (|g| + eps) ~ 1 every step.
    tx, _ = optim.make_optimizer(optim.OptimConfig.of({**cfg, "weight_decay": 0.0}), 10)
    params = {"w": jnp.ones((2, 2))}
    state, update = tx.init(params), jax.jit(tx.update)
    for t in range(10):
        u, state = update({"w": jnp.full((2, 2), 1e-3)}, state, params)
        np.testing.assert_allclose(u["w"], -want[t], rtol=1e-4, err_msg=f"step {t}")


# ------------------------------------------------------------------- cosine_phases schedule
def test_cosine_phases_schedule_by_hand():
    """lr 1, warm-up 2, period 4, x0.1 from step 6: c(t) = 1 + cos(pi t / 4)."""
    cfg = {**OPTIM, "lr": 1.0, "warmup_steps": 2, "schedule": "cosine_phases", "cosine_steps": 4,
           "step_boundaries": (6,), "step_factor": 0.1}
    _, schedule = optim.make_optimizer(optim.OptimConfig.of(cfg), 12)
    r = math.sqrt(2) / 2
    want = [0.5, 1.0,  # warm-up (step + 1) / 2
            1 / (1 + r), (1 - r) / (1 + r), 0.0,  # c(t) / c(1): it goes on from the warm-up's 1.0
            (1 - r) / 2,  # past the period: c(5) / 2, rising
            0.1, 0.1 * (1 + r) / 2, 0.05, 0.1 * (1 - r) / 2, 0.0, 0.1 * (1 - r) / 2]  # restart x0.1
    np.testing.assert_allclose([float(schedule(t)) for t in range(12)], want, rtol=1e-6, atol=1e-9)
    # Without a warm-up or a boundary: the closed-form cosine, periodic past its period.
    s = optim.make_schedule(optim.OptimConfig.of({**cfg, "warmup_steps": 0, "step_boundaries": ()}), 12)
    np.testing.assert_allclose([float(s(t)) for t in range(9)], [(1 + math.cos(math.pi * t / 4)) / 2 for t in range(9)],
                               atol=1e-7)


def test_cosine_phases_is_the_daa_code_schedule_per_epoch():
    """DAA's code (train_coco.py: pretrain 30 epochs with gradual_warmup over 3, then finetune 40
    epochs at lr x finetune_lr_decay 0.1 with a new optimiser and scheduler; CosineAnnealingLR
    T_max 30 stepped once per epoch), replayed with torch's scheduler: one step per epoch here."""
    torch = pytest.importorskip("torch")
    base, got = 1.5e-4, []
    p = torch.nn.Parameter(torch.zeros(1))
    for lr, epochs, warmup in ((base, 30, 3), (base * 0.1, 40, 0)):
        opt = torch.optim.SGD([p], lr=lr)  # the lr path does not depend on the optimiser (AdamP there)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=30)
        for e in range(epochs):
            if e < warmup:  # engine/trainer.py gradual_warmup
                for group in opt.param_groups:
                    group["lr"] = lr * (e + 1) / warmup
            got.append(opt.param_groups[0]["lr"])
            opt.step()
            scheduler.step()
    ours = optim.make_schedule(optim.OptimConfig.of({**OPTIM, "lr": base, "warmup_steps": 3, "schedule": "cosine_phases",
                                "cosine_steps": 30, "step_boundaries": (30 / 70,)}), 70)
    np.testing.assert_allclose([float(ours(e)) for e in range(70)], got, rtol=2e-6, atol=1e-6 * base)  # float32
    assert got[69] == pytest.approx(0.1 * base * (1 + math.cos(math.pi * 39 / 30)) / 2)  # rising again


# -------------------------------------------------------------------------- weight averaging
SWA = dict(swa_start_step=2, swa_every_steps=2)


def small_params():
    rng = np.random.default_rng(3)
    return {"visual": {"proj": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)},
            "text": {"kernel": jnp.asarray(rng.normal(size=(3, 2)), jnp.float32)},
            "logit_scale": jnp.float32(math.log(100.0) - 1e-3)}


def train(tx, params, steps, state=None, start=0, seed=5):
    """The trainer's loop: params = clamp(apply_updates(params, updates)); returns every params."""
    state = tx.init(params) if state is None else state
    update = jax.jit(tx.update)
    seen = []
    for t in range(start, steps):
        rng = np.random.default_rng(seed + t)
        grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), params)
        grads["logit_scale"] = jnp.float32(-1.0)  # pushes logit_scale up into the clamp
        u, state = update(grads, state, params)
        params = optim.clamp_logit_scale(optax.apply_updates(params, u))
        seen.append(params)
    return seen, state


def numpy_mean(snapshots):
    return jax.tree.map(lambda *xs: np.mean(np.stack([np.float64(x) for x in xs]), axis=0), *snapshots)


def assert_mean(state, snapshots):
    mean, n = optim.swa_params(state)
    assert int(n) == len(snapshots)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), mean, numpy_mean(snapshots))


@pytest.mark.parametrize("name", ["adamw", "adamp"])
def test_swa_is_the_mean_of_the_snapshots(name):
    params = small_params()
    tx, _ = optim.make_optimizer(optim.OptimConfig.of({**OPTIM, **SWA, "name": name}), 10)
    seen, state = train(tx, params, 7)
    # Parameters after n = 2, 4, 6 updates (seen[n - 1]), logit_scale clamped as the trainer does.
    assert_mean(state, [seen[1], seen[3], seen[5]])
    assert float(optim.swa_params(state)[0]["logit_scale"]) == pytest.approx(math.log(100.0))
    _, state0 = train(tx, params, 1)
    assert int(optim.swa_params(state0)[1]) == 0  # nothing averaged before swa_start_step
    with pytest.raises(ValueError, match="no weight average"):
        optim.swa_params(optim.make_optimizer(optim.OptimConfig.of(OPTIM), 10)[0].init(params))


def test_swa_survives_a_save_restore_round_trip():
    params = small_params()
    tx, _ = optim.make_optimizer(optim.OptimConfig.of({**OPTIM, **SWA}), 10)
    _, state = train(tx, params, 7)
    part, mid = train(tx, params, 3)
    # "Checkpoint": the leaves as host arrays, restored into the structure of tx.init's shapes.
    leaves = [np.asarray(x) for x in jax.tree.leaves(mid)]
    restored = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(tx.init, params)), leaves)
    rest, state2 = train(tx, part[-1], 7, state=restored, start=3)
    jax.tree.map(np.testing.assert_array_equal, state2, state)  # exactly the uninterrupted run
    assert_mean(state2, [part[1], rest[0], rest[2]])


def test_swa_round_trips_through_orbax(tmp_path):
    import orbax.checkpoint as ocp

    params = small_params()
    cfg = {**OPTIM, **SWA, "name": "adamp", "locked": "^text/", "layer_decay": 0.5}
    tx, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), 10, params)
    _, state = train(tx, params, 5)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(5, args=ocp.args.Composite(opt_state=ocp.args.StandardSave(state)))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path) as mngr:
        target = jax.eval_shape(tx.init, params)
        restored = mngr.restore(5, args=ocp.args.Composite(opt_state=ocp.args.StandardRestore(target)))["opt_state"]
    is_hole = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    assert jax.tree.structure(restored, is_leaf=is_hole) == jax.tree.structure(state, is_leaf=is_hole)
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    assert int(optim.swa_params(restored)[1]) == 2


def test_swa_is_carried_across_the_unlock_rebuild():
    params = small_params()
    cfg = {**OPTIM, "swa_start_step": 2, "swa_every_steps": 1, "locked": "^text/", "unlock_step": 3,
           "unlock_warmup_steps": 2}
    tx0, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), 10, params, step=0)
    before, s0 = train(tx0, params, 3)
    tx1, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), 10, params, step=3)
    s1 = jax.jit(lambda s, p: optim.transfer_state(s, tx1, p))(s0, before[-1])
    jax.tree.map(np.testing.assert_array_equal, optim.swa_params(s1), optim.swa_params(s0))
    after, s1 = train(tx1, before[-1], 6, state=s1, start=3)
    assert not np.array_equal(after[-1]["text"]["kernel"], params["text"]["kernel"])  # unlocked and trained
    assert_mean(s1, before[1:] + after)  # after 2, 3 (locked text: its constant value), 4, 5, 6 updates
    # Averaging switched on at a resume (a state without it): it counts from the global update count.
    plain, _ = optim.make_optimizer(optim.OptimConfig.of(OPTIM), 10)
    _, sp = train(plain, params, 3)
    with_swa, _ = optim.make_optimizer(optim.OptimConfig.of({**OPTIM, **SWA}), 10)
    carried = optim.transfer_state(sp, with_swa, params)
    swa_state = [s for s in jax.tree.leaves(carried, is_leaf=optim._is_swa) if optim._is_swa(s)][0]
    assert int(swa_state.count) == 3 and int(swa_state.n) == 0


def test_swa_mean_is_sharded_like_the_params():
    params = small_params()
    tx, _ = optim.make_optimizer(optim.OptimConfig.of({**OPTIM, **SWA, "locked": "^text/"}), 10, params)
    abstract = jax.eval_shape(tx.init, params)
    marks = optim.tree_map_params(tx, lambda _, __: "param", abstract, params, transform_non_params=lambda _: "other")
    mean, n = optim.swa_params(marks)
    assert set(jax.tree.leaves(mean)) == {"param"} and n == "other"


# ---------------------------------------------------------------- warm-up after unfreezing
def test_unlocked_parameters_warm_up_after_unlock_step():
    params = small_params()
    base = {**OPTIM, "warmup_steps": 2, "locked": "^visual/", "unlock_step": 3}
    cfg = {**base, "unlock_warmup_steps": 4}
    # Before the unlock the chain is the one without the knob.
    assert (jax.tree.structure(optim.make_optimizer(optim.OptimConfig.of(cfg), 10, params)[0].init(params))
            == jax.tree.structure(optim.make_optimizer(optim.OptimConfig.of(base), 10, params)[0].init(params)))
    tx0, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), 10, params, step=0)
    _, s0 = train(tx0, params, 3)
    ramped, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), 10, params, step=3)
    plain, _ = optim.make_optimizer(optim.OptimConfig.of(base), 10, params, step=3)
    sr, sp = optim.transfer_state(s0, ramped, params), optim.transfer_state(s0, plain, params)
    assert jax.tree.structure(sr) == jax.tree.structure(sp)  # same state layout: checkpoints restore
    up_r, up_p = jax.jit(ramped.update), jax.jit(plain.update)
    for t in range(3, 9):  # updates at global steps 3..8 with the same gradients (params held fixed)
        grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.1 * t, jnp.float32), params)
        ur, sr = up_r(grads, sr, params)
        up, sp = up_p(grads, sp, params)
        np.testing.assert_array_equal(ur["text"]["kernel"], up["text"]["kernel"])  # trained all along
        assert float(ur["logit_scale"]) == float(up["logit_scale"])
        ramp = min((t - 3 + 1) / 4, 1.0)  # 1/4, 2/4, 3/4, then 1
        np.testing.assert_allclose(ur["visual"]["proj"], up["visual"]["proj"] * ramp, rtol=1e-6)


def test_loss_form_scales_every_gradient_after_unlock_step():
    """unlock_warmup_form "loss" (PCME++'s / VSE∞'s code: the loss x ramp in the first epoch after
    the freeze) = the optimiser without the warm-up fed ramp x the gradients, clipping and AdamP
    included, across the unlock rebuild."""
    params = small_params()
    base = {**OPTIM, "name": "adamp", "clip_norm": 2.0, "locked": "^visual/", "unlock_step": 3}
    cfg = {**base, "unlock_warmup_steps": 4, "unlock_warmup_form": "loss"}

    def updates(c, factors):
        txs = [optim.make_optimizer(optim.OptimConfig.of(c), 10, params, step=s)[0] for s in (0, 3)]
        state, out = txs[0].init(params), []
        for t in range(9):
            if t == 3:
                state = optim.transfer_state(state, txs[1], params)
            grads = jax.tree.map(lambda x: jnp.full(x.shape, factors[t] * 0.1 * (t + 1), jnp.float32), params)
            u, state = jax.jit(txs[t >= 3].update)(grads, state, params)
            out.append(u)
        return out

    ramp = [1, 1, 1, 1 / 4, 2 / 4, 3 / 4, 1, 1, 1]  # 1 before the unlock at step 3, then (t - 3 + 1) / 4
    ours, fed, unscaled = updates(cfg, [1] * 9), updates(base, ramp), updates(base, [1] * 9)
    for t in range(9):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9, err_msg=f"step {t}"),
                     ours[t], fed[t])
    assert not np.allclose(ours[3]["text"]["kernel"], unscaled[3]["text"]["kernel"])  # Adam sees the ramp
    assert not np.allclose(ours[3]["visual"]["proj"], 0.0)  # the unlocked parameters move at once


# ------------------------------------------------------------------------------ defaults and validation
def test_defaults_keep_todays_optimizer():
    params = small_params()
    cfg = {**OPTIM, **{k: getattr(optim.OptimConfig(), k) for k in optim.LAYOUT_FIELDS}}
    ref = optax.chain(optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
                      optax.add_decayed_weights(0.5, mask=optim.decay_mask),
                      optax.scale_by_learning_rate(optim.warmup_cosine(1e-2, 0, 10)))
    tx, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), 10)
    assert jax.tree.structure(tx.init(params)) == jax.tree.structure(ref.init(params))
    ours, _ = train(tx, params, 3)
    theirs, _ = train(ref, params, 3)
    jax.tree.map(np.testing.assert_array_equal, ours, theirs)
    assert optim.OptimConfig().name == "adamw" and optim.OptimConfig().schedule == "warmup_cosine"
    assert set(optim.LAYOUT_FIELDS) >= {"name", "swa_every_steps", "locked"}


def test_every_optim_field_is_validated():
    """A field added to OptimConfig must be either one of the base fields or a layout field (one
    that a checkpoint's optimiser is rebuilt from, OptimConfig.with_layout_of)."""
    base = {"lr", "warmup_steps", "b1", "b2", "eps", "weight_decay", "clip_norm", "end_lr"}
    fields = {f.name for f in dataclasses.fields(optim.OptimConfig)}
    assert fields == base | set(optim.LAYOUT_FIELDS)
    assert not base & set(optim.LAYOUT_FIELDS)


@pytest.mark.parametrize("extra, message", [
    (dict(name="sgd"), r"config.optim.name='sgd' is not one of \('adamw', 'adamp'\)"),
    (dict(adamp_delta=0.0), "optim.adamp_delta must be a finite number > 0"),
    (dict(adamp_wd_ratio=-1.0), "optim.adamp_wd_ratio must be a finite number >= 0"),
    (dict(adamp_nesterov=True), "optim.adamp_nesterov=True has no effect with optim.name='adamw'"),
    (dict(schedule="cosine"), r"config.optim.schedule='cosine' is not one of \('warmup_cosine', 'step', 'cosine_phases'\)"),
    (dict(schedule="cosine_phases"), "optim.cosine_steps=0 goes with optim.schedule='cosine_phases'"),
    (dict(cosine_steps=5), "optim.cosine_steps=5 goes with optim.schedule='cosine_phases' .* got optim.schedule='warmup_cosine'"),
    (dict(cosine_steps=-1, schedule="cosine_phases"), "optim.cosine_steps must be an integer >= 0"),
    (dict(schedule="cosine_phases", cosine_steps=4, warmup_steps=5), "needs 0 < optim.cosine_steps and optim.warmup_steps <= cosine_steps"),
    (dict(schedule="cosine_phases", cosine_steps=8, warmup_steps=5, step_boundaries=(3,)),
     r"optim.warmup_steps=5 runs past the first of optim.step_boundaries \(step 3\)"),
    (dict(step_boundaries=(5,)), "optim.step_boundaries=.* has no effect with optim.schedule='warmup_cosine'"),
    (dict(schedule="step", step_boundaries=(1.5,)), "optim.step_boundaries must hold global steps"),
    (dict(schedule="step", step_boundaries=(0,)), "optim.step_boundaries must hold global steps"),
    (dict(schedule="step", step_boundaries=(8, 5)), r"optim.step_boundaries \[8, 5\] are steps"),
    (dict(schedule="step", step_boundaries=(10,)), "must increase and stay below total_steps"),
    (dict(schedule="step", step_factor=0.0), "optim.step_factor must be a finite number > 0"),
    (dict(swa_start_step=5), "optim.swa_start_step=5 has no effect without optim.swa_every_steps"),
    (dict(swa_every_steps=-1), "optim.swa_every_steps must be an integer >= 0"),
    (dict(unlock_warmup_steps=3), "optim.unlock_warmup_steps=3 has no effect without optim.unlock_step"),
    (dict(unlock_warmup_form="grad"), r"config.optim.unlock_warmup_form='grad' is not one of \('lr', 'loss'\)"),
    (dict(unlock_warmup_form="loss"), "optim.unlock_warmup_form='loss' has no effect without optim.unlock_warmup_steps"),
])
def test_bad_recipe_settings_are_refused(extra, message):
    with pytest.raises(ValueError, match=message) as e:
        optim.make_optimizer(optim.OptimConfig.of({**OPTIM, **extra}), 10)
    assert "\n" not in str(e.value)


def test_optim_config_validates_and_parses_the_recipe_fields():
    from prolip_jax.runtime import schema

    with pytest.raises(ValueError, match="optim.swa_start_step=3 has no effect"):
        optim.OptimConfig(swa_start_step=3).validate()
    c = schema.parse(optim.OptimConfig, dict(name="adamp", schedule="step", step_boundaries=[0.6, 20000],
                                             swa_start_step=16, swa_every_steps=1), "optim")
    assert c.step_boundaries == (0.6, 20000) and isinstance(c.step_boundaries[1], int)
    with pytest.raises(ValueError, match="is not one of"):
        schema.parse(optim.OptimConfig, dict(name="sgd"), "optim")
