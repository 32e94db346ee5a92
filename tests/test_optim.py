"""The optimiser's fine-tuning controls (issue 12 §3): locked parameters, unlocking, per-group lr and
weight decay, layer-wise lr decay, state transfer and sharding of the state.

Expectations are built from plain optax AdamW chains run on the same leaves; learning-rate
multipliers are powers of two so that "multiplied by m" is exact in float32 and the comparisons
are bit-for-bit."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from prolip_jax.core import optim

OPTIM = dict(lr=1e-3, warmup_steps=2, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.2, clip_norm=0.0, end_lr=0.0)
TOTAL = 10


def _block(rng):
    return {"attn": {"query_kernel": rng.normal(size=(4, 4)), "query_bias": rng.normal(size=(4,))},
            "ln_1": {"scale": rng.normal(size=(4,))}}


def make_tree(seed=0):
    """A small stand-in of the ProLIP parameter tree: 3 image blocks, 2 text blocks."""
    rng = np.random.default_rng(seed)
    tree = {
        "visual": {"patch_kernel": rng.normal(size=(2, 2, 3, 4)), "positional_embedding": rng.normal(size=(5, 4)),
                   "class_embedding": rng.normal(size=(4,)), "ln_pre": {"scale": rng.normal(size=(4,))},
                   "transformer": {f"resblocks_{i}": _block(rng) for i in range(3)},
                   "ln_post": {"scale": rng.normal(size=(4,))}, "proj": rng.normal(size=(4, 3))},
        "text": {"token_embedding": rng.normal(size=(10, 4)), "positional_embedding": rng.normal(size=(6, 4)),
                 "transformer": {f"resblocks_{i}": _block(rng) for i in range(2)},
                 "ln_final": {"bias": rng.normal(size=(4,))}, "text_projection": {"kernel": rng.normal(size=(4, 3))}},
        "logit_scale": np.float64(2.3), "logit_bias": np.float64(-10.0),
    }
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


def todays_chain(cfg):
    """make_optimizer as it was before the fine-tuning controls (the reference AdamW)."""
    schedule = optim.warmup_cosine(cfg["lr"], cfg["warmup_steps"], TOTAL)
    parts = [optax.clip_by_global_norm(cfg["clip_norm"])] if cfg.get("clip_norm") else []
    return optax.chain(*parts, optax.scale_by_adam(b1=cfg["b1"], b2=cfg["b2"], eps=cfg["eps"]),
                       optax.add_decayed_weights(cfg["weight_decay"], mask=optim.decay_mask),
                       optax.scale_by_learning_rate(schedule))


def grads_of(k, params):
    """The k-th gradient of run_updates, restricted to the keys of `params`."""
    return {key: v for key, v in make_tree(100 + k).items() if key in params}


def run_updates(tx, params, steps=3, state=None):
    """Updates of `steps` consecutive steps (params held fixed, gradients from a fixed seed sequence)."""
    state = tx.init(params) if state is None else state
    out = []
    update = jax.jit(tx.update)  # jitted on both sides of a comparison: eager and XLA differ in the last bit
    for k in range(steps):
        u, state = update(grads_of(k, params), state, params)
        out.append(u)
    return out, state


def assert_trees_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def leaf(tree, path):
    for k in path.split("/"):
        tree = tree[k]
    return tree


def state_bytes(state):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))


# ------------------------------------------------------------------------------ defaults
@pytest.mark.parametrize("clip", [0.0, 1.0])
def test_default_config_is_todays_optimizer(clip):
    cfg = {**OPTIM, "clip_norm": clip}
    params = make_tree()
    tx, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), TOTAL, params)
    ref = todays_chain(cfg)
    # Same state layout (existing checkpoints restore) and bit-identical updates.
    assert jax.tree.structure(tx.init(params)) == jax.tree.structure(ref.init(params))
    ours, _ = run_updates(tx, params)
    theirs, _ = run_updates(ref, params)
    assert_trees_equal(ours, theirs)
    # Configs from before issue 12 (no fine-tuning fields) build the same optimiser, params or not.
    tx_old_cfg, _ = optim.make_optimizer(optim.OptimConfig.of({**OPTIM, "clip_norm": clip}), TOTAL)
    assert_trees_equal(run_updates(tx_old_cfg, params)[0], theirs)


def test_neutral_group_gives_todays_updates_through_the_partitioned_chain():
    # A group with lr_mult 1 and the base weight decay switches on the partitioned chain; the
    # per-leaf operations are the same, so the updates are bit-identical.
    cfg = {**OPTIM, "clip_norm": 1.0, "groups": (dict(pattern="."),)}
    params = make_tree()
    tx, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), TOTAL, params)
    assert isinstance(tx.init(params)[1], optax.MultiTransformState)
    assert_trees_equal(run_updates(tx, params)[0], run_updates(todays_chain(cfg), params)[0])


# ------------------------------------------------------------------------------- locking
def test_locked_params_get_no_state_and_zero_updates():
    cfg = {**OPTIM, "locked": ("^visual/",)}
    params = make_tree()
    tx, schedule = optim.make_optimizer(optim.OptimConfig.of(cfg), TOTAL, params)
    mask = optim.trainable_mask(params, optim.OptimConfig.of(cfg))
    assert not any(jax.tree.leaves(mask["visual"])) and all(jax.tree.leaves(mask["text"])) and mask["logit_scale"]
    trainable, _ = optim.partition(params, mask)

    state = tx.init(params)
    # Adam moments (mu, nu) exist only for the trainable leaves: 2 x their bytes + the counts.
    counts = 4 + 4  # the Adam count and the schedule count (int32)
    assert state_bytes(state) == 2 * state_bytes(trainable) + counts
    assert all(isinstance(x, optax.MaskedNode) for x in jax.tree.leaves(
        state[0].inner_states["adam"].inner_state.mu["visual"], is_leaf=lambda x: isinstance(x, optax.MaskedNode)))

    ours, _ = run_updates(tx, params)
    ref, _ = run_updates(todays_chain(OPTIM), {k: v for k, v in params.items() if k != "visual"})
    for u, r in zip(ours, ref):
        assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u["visual"]))
        assert_trees_equal({k: v for k, v in u.items() if k != "visual"}, r)  # the rest is plain AdamW
    assert optim.locked_paths(params, optim.OptimConfig.of(cfg)) == [p for p in optim.param_paths(params) if p.startswith("visual/")]


def test_partition_differentiates_only_trainable_leaves():
    cfg = {**OPTIM, "locked": "^text/|logit_"}  # a single string is one pattern
    params = make_tree()
    mask = optim.trainable_mask(params, optim.OptimConfig.of(cfg))
    trainable, locked = optim.partition(params, mask)
    assert optim.combine(trainable, locked) == params
    loss = lambda t: sum(jnp.sum(x ** 2) for x in jax.tree.leaves(optim.combine(t, locked)))  # noqa: E731
    grads = jax.grad(loss)(trainable)
    assert jax.tree.structure(grads) == jax.tree.structure(trainable)
    assert len(jax.tree.leaves(grads)) == sum(jax.tree.leaves(mask)) < len(jax.tree.leaves(params))


# ------------------------------------------------------------------- groups and layer decay
def test_group_lr_mult_and_weight_decay_scale_updates_exactly():
    groups = (dict(pattern=r"^visual/transformer/", lr_mult=0.25),  # first match wins ...
              dict(pattern=r"^visual/", lr_mult=0.5, weight_decay=0.0),  # ... over this one
              dict(pattern=r"^text/", weight_decay=0.05))
    cfg = {**OPTIM, "groups": groups}
    params = make_tree()
    tx, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), TOTAL, params)
    mults, wds = optim.lr_multipliers(params, optim.OptimConfig.of(cfg)), optim.weight_decays(params, optim.OptimConfig.of(cfg))
    assert leaf(mults, "visual/transformer/resblocks_1/attn/query_kernel") == 0.25
    assert leaf(mults, "visual/proj") == 0.5 and leaf(wds, "visual/proj") == 0.0
    assert leaf(mults, "text/token_embedding") == 1.0 and leaf(wds, "text/token_embedding") == 0.05
    assert leaf(wds, "visual/transformer/resblocks_1/attn/query_kernel") == 0.2  # inherits the base
    # The reference mask still applies inside a group: biases, norms, 1-D never decay.
    assert leaf(wds, "text/ln_final/bias") == 0.0 and leaf(wds, "text/transformer/resblocks_0/attn/query_bias") == 0.0

    ours, _ = run_updates(tx, params)

    @jax.jit
    def expected(params, grads):
        # Each leaf as under a torch param group: AdamW with lr * lr_mult and the group's decay.
        out = {}
        for path in optim.param_paths(params):
            m, wd = leaf(mults, path), leaf(wds, path)
            ref_tx = optax.chain(optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-6), optax.add_decayed_weights(wd),
                                 optax.scale_by_learning_rate(optim.warmup_cosine(1e-3 * m, 2, TOTAL)))
            p, st = leaf(params, path), ref_tx.init(leaf(params, path))
            out[path] = []
            for g in grads:
                r, st = ref_tx.update(leaf(g, path), st, p)
                out[path].append(r)
        return out

    for path, refs in expected(params, [grads_of(k, params) for k in range(3)]).items():
        for u, r in zip(ours, refs):  # another XLA program: float32 rounding (x lr)
            np.testing.assert_allclose(leaf(u, path), r, rtol=1e-6, atol=1e-10, err_msg=path)


def test_layer_decay_multipliers_follow_beit_convention():
    params = make_tree()
    d = 0.5
    m = optim.layer_decay_multipliers(params, d)
    # image tower, L = 3 blocks: stem d^4, block i d^(3 - i), after the blocks 1
    for p in ("visual/patch_kernel", "visual/positional_embedding", "visual/class_embedding", "visual/ln_pre/scale"):
        assert leaf(m, p) == d ** 4, p
    for i in range(3):
        assert leaf(m, f"visual/transformer/resblocks_{i}/attn/query_kernel") == d ** (3 - i)
        assert leaf(m, f"visual/transformer/resblocks_{i}/ln_1/scale") == d ** (3 - i)
    assert leaf(m, "visual/ln_post/scale") == leaf(m, "visual/proj") == 1.0
    # text tower, L = 2: its own depth
    assert leaf(m, "text/token_embedding") == leaf(m, "text/positional_embedding") == d ** 3
    assert leaf(m, "text/transformer/resblocks_0/attn/query_bias") == d ** 2
    assert leaf(m, "text/transformer/resblocks_1/attn/query_bias") == d
    assert leaf(m, "text/ln_final/bias") == leaf(m, "text/text_projection/kernel") == 1.0
    assert m["logit_scale"] == m["logit_bias"] == 1.0
    # Block indices are numbers, not strings (resblocks_10 is the last of 11).
    deep = {"visual": {"transformer": {f"resblocks_{i}": {"w": jnp.ones((2, 2))} for i in range(11)}}}
    md = optim.layer_decay_multipliers(deep, d)["visual"]["transformer"]
    assert md["resblocks_10"]["w"] == d and md["resblocks_2"]["w"] == d ** 9
    # Combined multiplicatively with the group multiplier, and it reaches the updates.
    cfg = {**OPTIM, "layer_decay": d, "groups": (dict(pattern="^visual/", lr_mult=0.5),), "weight_decay": 0.0}
    assert leaf(optim.lr_multipliers(params, optim.OptimConfig.of(cfg)), "visual/transformer/resblocks_0/attn/query_kernel") == 0.5 * d ** 3
    tx, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), TOTAL, params)
    (ours,), _ = run_updates(tx, params, steps=1)
    (plain,), _ = run_updates(todays_chain(cfg), params, steps=1)
    for path, mult in zip(optim.param_paths(params), jax.tree.leaves(optim.lr_multipliers(params, optim.OptimConfig.of(cfg)))):
        np.testing.assert_array_equal(leaf(ours, path), leaf(plain, path) * mult, err_msg=path)


# ------------------------------------------------------------------------------- unlocking
def test_unlock_rebuilds_optimizer_and_keeps_moments():
    cfg = {**OPTIM, "locked": ("^visual/",), "unlock_step": 3}
    params = make_tree()
    tx0, schedule = optim.make_optimizer(optim.OptimConfig.of(cfg), TOTAL, params, step=0)
    assert optim.rebuild_steps(optim.OptimConfig.of(cfg)) == (3,) and optim.rebuild_steps(optim.OptimConfig.of(OPTIM)) == ()
    assert optim.locked_paths(params, optim.OptimConfig.of(cfg), step=2) and not optim.locked_paths(params, optim.OptimConfig.of(cfg), step=3)
    _, state0 = run_updates(tx0, params, steps=3)

    tx1, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), TOTAL, params, step=3)
    state1 = jax.jit(lambda s, p: optim.transfer_state(s, tx1, p))(state0, params)
    adam0 = state0[0].inner_states["adam"].inner_state
    adam1 = state1[0].inner_states["adam"].inner_state
    assert_trees_equal(adam1, adam0)  # the text tower and logit_* keep moments and count (3)
    unlocked = state1[0].inner_states["adam_unlocked"].inner_state
    assert int(unlocked.count) == 0 and all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(unlocked.mu))
    assert int(state1[-1].count) == 3  # the schedule goes on by the global update count

    # Step 4: the text tower updates exactly as if nothing had changed; the image tower takes
    # Adam's first step at the lr of global step 3.
    (u1,), _ = run_updates(tx1, params, steps=1, state=state1)
    grads = grads_of(0, params)  # run_updates's first gradient
    (u0,), _ = run_updates(tx0, params, steps=1, state=state0)
    assert_trees_equal(u1["text"], u0["text"])
    first = optax.chain(optax.scale_by_adam(b1=0.9, b2=0.95, eps=1e-6),
                        optax.add_decayed_weights(0.2, optim.decay_mask),
                        optax.scale_by_learning_rate(lambda _: schedule(3)))
    ref, _ = jax.jit(first.update)(grads["visual"], first.init(params["visual"]), params["visual"])
    assert_trees_equal(u1["visual"], ref)


def test_transfer_state_across_layouts_by_path():
    params = make_tree()
    plain, _ = optim.make_optimizer(optim.OptimConfig.of(OPTIM), TOTAL, params)
    _, s_plain = run_updates(plain, params, steps=2)
    locked_cfg = {**OPTIM, "locked": "^text/", "layer_decay": 0.7}
    tx, _ = optim.make_optimizer(optim.OptimConfig.of(locked_cfg), TOTAL, params)
    s = optim.transfer_state(s_plain, tx, params)
    adam = s[0].inner_states["adam"].inner_state
    assert int(adam.count) == 2 and int(s[-1].count) == 2
    np.testing.assert_array_equal(adam.mu["visual"]["proj"], s_plain[0].mu["visual"]["proj"])
    # ... and back: the text moments were not kept while locked, so they restart from zero.
    back = optim.transfer_state(s, plain, params)
    np.testing.assert_array_equal(back[0].nu["visual"]["proj"], s_plain[0].nu["visual"]["proj"])
    assert not np.any(np.asarray(back[0].mu["text"]["token_embedding"]))
    assert int(back[0].count) == 2


# ------------------------------------------------------------------------------- sharding
def test_tree_map_params_shards_partitioned_state():
    from jax.sharding import NamedSharding, PartitionSpec as P

    from prolip_jax.core import sharding

    mesh = sharding.make_mesh((-1,), ("data",), jax.devices()[:2])
    params = make_tree()
    abstract = jax.eval_shape(lambda: params)
    # Shard the first axis of every >= 2-D leaf of even size, as a stand-in for the logical rules.
    param_sh = jax.tree.map(lambda x: NamedSharding(mesh, P("data") if x.ndim >= 2 and x.shape[0] % 2 == 0 else P()),
                            abstract)
    replicated = NamedSharding(mesh, P())
    cfg = {**OPTIM, "locked": "^visual/transformer/", "groups": (dict(pattern="^text/", lr_mult=0.5),)}
    for tx in (optim.make_optimizer(optim.OptimConfig.of(OPTIM), TOTAL)[0], optim.make_optimizer(optim.OptimConfig.of(cfg), TOTAL, abstract)[0]):
        abstract_opt = jax.eval_shape(tx.init, abstract)
        opt_sh = optim.tree_map_params(tx, lambda _, s: s, abstract_opt, param_sh,
                                       transform_non_params=lambda _: replicated)
        state = jax.jit(tx.init, out_shardings=opt_sh)(params)
        adam = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
                if isinstance(s, optax.ScaleByAdamState)][0]
        assert adam.mu["visual"]["proj"].sharding == param_sh["visual"]["proj"]
        assert adam.count.sharding == replicated
    # On a plain chain it agrees with optax's own.
    tx = optim.make_optimizer(optim.OptimConfig.of(OPTIM), TOTAL)[0]
    abstract_opt = jax.eval_shape(tx.init, abstract)
    ours = optim.tree_map_params(tx, lambda _, s: s, abstract_opt, param_sh, transform_non_params=lambda _: replicated)
    assert ours == optax.tree_map_params(tx, lambda _, s: s, abstract_opt, param_sh,
                                         transform_non_params=lambda _: replicated)


def test_works_on_the_model_parameter_tree():
    from prolip_jax.core.models import abstract_params, get_config

    params = abstract_params(get_config("micro"))
    cfg = {**OPTIM, "locked": ("^visual/",), "unlock_step": 5, "layer_decay": 0.7,
           "groups": (dict(pattern="^text/transformer/", lr_mult=0.1),)}
    tx, _ = optim.make_optimizer(optim.OptimConfig.of(cfg), TOTAL, params)
    state = jax.eval_shape(tx.init, params)
    assert jax.tree.leaves(state)  # builds from abstract shapes
    locked = optim.locked_paths(params, optim.OptimConfig.of(cfg))
    assert "visual/patch_kernel" in locked and "text/token_embedding" not in locked
    m = optim.lr_multipliers(params, optim.OptimConfig.of(cfg))
    assert leaf(m, "text/transformer/resblocks_0/c_fc/kernel") == pytest.approx(0.1 * 0.7)
    assert leaf(m, "text/cls_emb") == pytest.approx(0.7 ** 2)  # text L = 1: stem d^2
    assert leaf(m, "visual/unc_embedding") == pytest.approx(0.7 ** 2)
    assert leaf(m, "visual/uncertainty_proj/kernel") == 1.0


# ------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("extra, message", [
    (dict(locked=("^vision/",)), r"optim.locked pattern '\^vision/' matches no parameter \(parameters look like: "),
    (dict(locked=("visual/(",)), r"optim.locked: 'visual/\(' is not a valid regular expression"),
    (dict(locked=(".",)), "locks every parameter"),
    (dict(locked=("",)), "non-empty string"),
    (dict(groups=(dict(pattern="^txt/", lr_mult=0.1),)), r"optim.groups\[0\] pattern '\^txt/' matches no parameter"),
    (dict(groups=(dict(pattern="[", lr_mult=0.1),)), r"optim.groups\[0\].pattern: '\[' is not a valid regular"),
    (dict(groups=(dict(pattern="^text/", lr_mult=-0.1),)), r"optim.groups\[0\].lr_mult must be a finite number >= 0"),
    (dict(groups=(dict(pattern="^text/", weight_decay=float("nan")),)), r"weight_decay must be a finite number"),
    (dict(groups=(dict(pattern="^text/", lr=0.1),)), r"optim.groups\[0\] has keys \['lr', 'pattern'\]"),
    (dict(groups=("^text/",)), r"optim.groups\[0\] must be a dict"),
    (dict(layer_decay=0.0), "optim.layer_decay must be a number > 0"),
    (dict(unlock_step=5), "optim.unlock_step=5 has no effect without optim.locked"),
    (dict(locked="^text/", unlock_step=-1), "optim.unlock_step must be an integer >= 0"),
])
def test_bad_settings_are_refused_with_one_line(extra, message):
    params = make_tree()
    with pytest.raises(ValueError, match=message) as e:
        optim.make_optimizer(optim.OptimConfig.of({**OPTIM, **extra}), TOTAL, params)
    assert "\n" not in str(e.value)
    if "matches no parameter" in message:
        assert "visual/" in str(e.value)  # example paths


def test_fine_tuning_needs_the_parameter_tree():
    with pytest.raises(ValueError, match="need the parameter tree"):
        optim.make_optimizer(optim.OptimConfig.of({**OPTIM, "layer_decay": 0.7}), TOTAL)


def test_partitioned_state_round_trips_through_orbax(tmp_path):
    import orbax.checkpoint as ocp

    params = make_tree()
    tx, _ = optim.make_optimizer(optim.OptimConfig.of({**OPTIM, "locked": "^visual/", "layer_decay": 0.5}), TOTAL, params)
    _, state = run_updates(tx, params, steps=2)
    with ocp.CheckpointManager(tmp_path) as mngr:
        mngr.save(2, args=ocp.args.Composite(opt_state=ocp.args.StandardSave(state)))
        mngr.wait_until_finished()
    with ocp.CheckpointManager(tmp_path) as mngr:
        target = jax.eval_shape(tx.init, params)
        restored = mngr.restore(2, args=ocp.args.Composite(opt_state=ocp.args.StandardRestore(target)))["opt_state"]
    is_hole = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    assert jax.tree.structure(restored, is_leaf=is_hole) == jax.tree.structure(state, is_leaf=is_hole)
    assert_trees_equal(restored, state)


def test_config_dict_fields():
    import ml_collections as mlc

    c = mlc.ConfigDict({**OPTIM, "locked": (), "unlock_step": 0, "groups": (), "layer_decay": 1.0})
    c.locked = ("^visual/",)  # not `lock`: that is a ConfigDict method
    c.groups = (dict(pattern="^text/", lr_mult=0.1),)
    parsed = optim.OptimConfig.of(c)
    assert parsed == optim.OptimConfig.of(c.to_dict())
    assert (parsed.lock, parsed.unlock_step, parsed.groups, parsed.layer_decay) == (
        ("^visual/",), 0, (dict(pattern="^text/", lr_mult=0.1),), 1.0)
    assert parsed.finetuning and not optim.OptimConfig.of(OPTIM).finetuning
