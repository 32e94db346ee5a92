"""The sharded train step: every mesh and k microbatches give the one-device step (float32).

Tolerance: relative error <= 1e-5 on the loss and on every updated parameter, except the
attention *key* biases: softmax is invariant to them, so their true gradient is exactly zero
and what reaches them is float rounding noise, which Adam's first step scales to +-lr whatever
its size. For those we check that the gradient really is noise-sized.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from prolip_jax.core import optim, sharding
from prolip_jax.core import step as S
from prolip_jax.core.objectives import prolip as prolip_objective
from prolip_jax.core.models import ProLIP, get_config

B = 32
CFG = S.StepConfig(masking=S.MaskingConfig(fraction=0.5, group=4, mask_token_id=63),
                   loss=prolip_objective.Config(alpha_image_text=1e-3))
OPTIM = dict(lr=1e-3, warmup_steps=2, b1=0.9, b2=0.95, eps=1e-6, weight_decay=0.2)


@pytest.fixture(scope="module")
def setup():
    model = ProLIP(get_config("micro"), attention_impl="xla")
    tx, schedule = optim.make_optimizer(optim.OptimConfig.of(OPTIM), 10)
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(B, 16, 16, 3)).astype(np.float32),
             "text": rng.integers(2, 64, size=(B, 8)).astype(np.int32)}
    batch["text"][:, 5:] = 1
    return model, tx, schedule, batch


_COMPILED = {}  # one compiled step per (mesh, rules, microbatches): compiles dominate on CPU


@pytest.fixture(scope="module")
def initial(setup):
    """The initial state on one device, created once: every mesh gets a copy laid out its way
    (the values do not depend on the mesh; a jitted init per mesh only costs its compile)."""
    model, tx, _, _ = setup
    mesh = sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1])
    return jax.device_get(S.create_train_state(model, tx, mesh, "replicated", seed=0)[0])


def run(setup, initial, shape, rules, microbatches=1, batch=None, steps=1, ppcl_impl="dense"):
    model, tx, schedule, default_batch = setup
    n = math.prod(shape)
    mesh = sharding.make_mesh(shape, ("data", "fsdp", "tensor"), jax.devices()[:n])
    state = jax.device_put(initial, S.state_shardings(S.trace_params(model).boxed, tx, mesh, rules))
    key = (shape, rules, microbatches, ppcl_impl)
    if key not in _COMPILED:
        cfg = dataclasses.replace(CFG, microbatches=microbatches,
                                  loss=dataclasses.replace(CFG.loss, ppcl_impl=ppcl_impl))
        # Under the rules, as the trainer runs it: the towers' activation constraints apply.
        _COMPILED[key] = jax.jit(S.make_train_step(model, tx, schedule, cfg, mesh, B, rules=rules))
    step = _COMPILED[key]
    gb = sharding.global_batch(default_batch if batch is None else batch, mesh)
    for _ in range(steps):
        state, metrics = step(state, gb)
    return jax.device_get(state), jax.device_get(metrics)


@pytest.fixture(scope="module")
def single(setup, initial):
    return run(setup, initial, (1, 1, 1), "replicated")


def _compare(state, ref_state, metrics, ref_metrics):
    assert abs(float(metrics["loss"]) - float(ref_metrics["loss"])) <= 1e-5 * abs(float(ref_metrics["loss"]))
    checked = 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state.params), jax.tree.leaves(ref_state.params)):
        if "key_bias" in jax.tree_util.keystr(path):
            continue
        err = float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))
        assert err <= 1e-5, (jax.tree_util.keystr(path), err)
        checked += 1
    assert checked == len(jax.tree.leaves(ref_state.params)) - 2  # one key bias per tower
    assert int(state.step) == 1 and int(state.skipped) == 0


@pytest.mark.parametrize("name,shape,rules,ppcl_impl", [
    ("data", (8, 1, 1), "replicated", "dense"),
    ("fsdp_ring", (2, 4, 1), "fsdp", "ring"),  # the shard_map ring over data x fsdp, in the step
    ("tensor", (4, 1, 2), "tensor", "dense")])
def test_mesh_matches_single_device(setup, initial, single, name, shape, rules, ppcl_impl):
    state, metrics = run(setup, initial, shape, rules, ppcl_impl=ppcl_impl)
    _compare(state, single[0], metrics, single[1])


def test_rules_constrain_the_activations(setup):
    """With rules the lowered step carries the residual stream's sharding constraints
    (batch over data x fsdp); without, none from the towers."""
    model, tx, schedule, batch = setup
    mesh = sharding.make_mesh((2, 4, 1), ("data", "fsdp", "tensor"), jax.devices()[:8])
    state, _ = S.create_train_state(model, tx, mesh, "fsdp", seed=0)
    gb = sharding.global_batch(batch, mesh)
    texts = {}
    for rules in (None, "fsdp"):
        fn = S.make_train_step(model, tx, schedule, CFG, mesh, B, rules=rules)
        texts[rules] = jax.jit(fn).trace(state, gb).lower().as_text()
    constraint = '[{"data", "fsdp"}, {}, {}]> : tensor<32x'
    assert texts["fsdp"].count(constraint) >= 2 * 2  # a block of each tower, full and masked forward
    assert constraint not in texts[None]


def test_microbatches_match_one_batch(setup, initial, single):
    """Gradient caching: k = 2 microbatches (on 8 data shards) == the one-batch step."""
    state, metrics = run(setup, initial, (8, 1, 1), "fsdp", microbatches=2)
    _compare(state, single[0], metrics, single[1])


def test_key_bias_gradient_is_noise(setup):
    model, _, _, batch = setup
    from prolip_jax.core.models import init_params

    params = init_params(model.config, jax.random.key(0))
    grads = jax.jit(jax.grad(
        lambda p: prolip_objective.prolip_loss({**model.apply({"params": p}, batch["image"], batch["text"])})[0]))(params)
    for tower in ("visual", "text"):
        kb = np.abs(grads[tower]["transformer"]["resblocks_0"]["attn"]["key_bias"]).max()
        qb = np.abs(grads[tower]["transformer"]["resblocks_0"]["attn"]["query_bias"]).max()
        assert kb < 1e-6 * qb, (tower, kb, qb)


def test_nonfinite_step_is_skipped(setup, initial, single):
    model, tx, schedule, batch = setup
    bad = {**batch, "image": batch["image"].copy()}
    bad["image"][3] = np.nan
    state, metrics = run(setup, initial, (1, 1, 1), "replicated", batch=bad)
    jax.tree.map(np.testing.assert_array_equal, state.params, initial.params)
    assert int(state.step) == 1 and int(state.skipped) == 1 and int(metrics["nonfinite"]) == 1


def test_nonfinite_update_is_skipped(setup):
    """Finite loss and gradients, non-finite update: Adam with eps = 0 divides 0 by 0 where a
    gradient is exactly 0 (token-embedding rows no caption uses). Nothing of it is kept."""
    model, _, _, batch = setup
    tx, schedule = optim.make_optimizer(optim.OptimConfig.of({**OPTIM, "eps": 0.0}), 10)
    mesh = sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1])
    state, _ = S.create_train_state(model, tx, mesh, "replicated", seed=0)
    fresh = jax.device_get(state)
    new, metrics = jax.jit(S.make_train_step(model, tx, schedule, CFG, mesh, B))(state, sharding.global_batch(batch, mesh))
    new, metrics = jax.device_get((new, metrics))
    assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
    assert int(metrics["nonfinite"]) == 1 and int(new.skipped) == 1 and int(new.step) == 1
    jax.tree.map(np.testing.assert_array_equal, (new.params, new.opt_state), (fresh.params, fresh.opt_state))


def test_locked_tower_gets_no_update_and_the_rest_the_same_one(setup, single):
    """A trainable mask (image tower locked, LiT-style): the step differentiates only the text
    side; the image tower stays bit-identical and the text side gets the update it gets when
    nothing is locked (Adam and decay act per leaf, so locking one tower cannot change the other)."""
    import optax

    model, tx_all, schedule, batch = setup
    mesh = sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1])
    fresh, _ = S.create_train_state(model, tx_all, mesh, "replicated", seed=0)
    trainable = jax.tree_util.tree_map_with_path(lambda path, _: path[0].key != "visual", fresh.params)
    labels = jax.tree.map(lambda t: "train" if t else "locked", trainable)
    tx = optax.multi_transform({"train": tx_all, "locked": optax.set_to_zero()}, labels)
    state = S.TrainState(step=fresh.step, params=fresh.params, opt_state=tx.init(fresh.params), skipped=fresh.skipped)
    step = jax.jit(S.make_train_step(model, tx, schedule, CFG, mesh, B, trainable=trainable))
    new, _ = jax.device_get(step(state, sharding.global_batch(batch, mesh)))
    before = jax.device_get(fresh.params)
    jax.tree.map(np.testing.assert_array_equal, new.params["visual"], before["visual"])
    ref = single[0].params  # one step of the same optimiser with nothing locked
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(new.params["text"]), jax.tree.leaves(ref["text"])):
        if "key_bias" not in jax.tree_util.keystr(path):  # zero true gradient: see the module docstring
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    assert not np.array_equal(new.params["text"]["ln_final"]["scale"], before["text"]["ln_final"]["scale"])


def test_all_finite():
    tree = {"w": jnp.ones((2, 3)), "count": jnp.array(7, jnp.int32), "b": jnp.zeros(2)}
    assert bool(S.all_finite(tree)) and bool(S.all_finite({}))
    assert not bool(S.all_finite({**tree, "b": jnp.array([0.0, jnp.inf])}))
    assert not bool(S.all_finite({**tree, "w": jnp.full((2, 3), jnp.nan)}))


def test_logit_scale_is_clamped():
    params = {"logit_scale": jnp.float32(7.0), "w": jnp.ones(2)}
    assert float(optim.clamp_logit_scale(params)["logit_scale"]) == pytest.approx(math.log(100.0))
    assert float(optim.clamp_logit_scale({**params, "logit_scale": jnp.float32(-1.0)})["logit_scale"]) == 0.0


def test_decay_mask_follows_reference_rule(setup):
    from prolip_jax.core.models import abstract_params

    mask = optim.decay_mask(abstract_params(setup[0].config))
    attn = mask["visual"]["transformer"]["resblocks_0"]["attn"]
    assert attn["query_kernel"] and attn["out_kernel"] and not attn["query_bias"] and not attn["out_bias"]
    assert mask["visual"]["patch_kernel"] and mask["visual"]["positional_embedding"] and mask["visual"]["proj"]
    assert not mask["visual"]["class_embedding"] and not mask["visual"]["ln_pre"]["scale"]
    assert mask["text"]["token_embedding"] and not mask["text"]["text_projection"]["bias"]
    assert not mask["logit_scale"] and not mask["logit_bias"]


def test_schedule_matches_reference():
    lr = optim.warmup_cosine(5e-4, 10, 110)
    assert float(lr(0)) == pytest.approx(5e-5)  # base * (step + 1) / warmup
    assert float(lr(9)) == pytest.approx(5e-4)
    assert float(lr(10)) == pytest.approx(5e-4)
    assert float(lr(60)) == pytest.approx(2.5e-4)  # half-way down the cosine
    assert float(lr(110)) == pytest.approx(0.0, abs=1e-12)


def test_batch_layout_errors():
    with pytest.raises(ValueError, match="not divisible by the 8 data shards"):
        S.check_batch_layout(60, 8, S.StepConfig())
    with pytest.raises(ValueError, match="multiple of masking.group"):
        S.check_batch_layout(8 * 12, 8, S.StepConfig())
    with pytest.raises(ValueError, match="3 microbatches"):
        S.check_batch_layout(8 * 16, 8, S.StepConfig(microbatches=3))
    S.check_batch_layout(16_384, 32, S.StepConfig())  # the paper's 512 per GPU


def test_size_augment_runs_in_the_step_and_cached_gradients_see_the_same_drops():
    """SizeAugment (PCME++'s token dropout, PCME++ §2.4) is on in the step: train=True with its
    own key per step and microbatch. Gradient caching runs each microbatch's forward twice; with
    other drops the second time its gradient would not be the loss's. Reference: the gradient of
    the same loss written directly (features per microbatch with the step's keys, then the loss
    on the whole batch), float32, <= 1e-5 relative. SGD with lr 1 exposes the gradient as the
    update (log a left out: its clamp bends the update)."""
    from prolip_jax.core.objectives import pcmepp

    cfg = get_config("micro", vision={"unc_head": "embedding", "pool": "gpo", "size_augment": 0.25})
    model = ProLIP(cfg, attention_impl="xla")
    mesh = sharding.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), jax.devices()[:1])
    step_cfg = S.StepConfig(objective="pcmepp", loss=pcmepp.Config(), microbatches=2)
    tx = optax.sgd(1.0)
    step = jax.jit(S.make_train_step(model, tx, lambda count: 1.0, step_cfg, mesh, 16))
    rng = np.random.default_rng(0)
    host = {"image": rng.normal(size=(16, 16, 16, 3)).astype(np.float32),
            "text": rng.integers(2, 63, size=(16, 8)).astype(np.int32)}
    state, _ = S.create_train_state(model, tx, mesh, "replicated", seed=0)
    new, metrics = step(state, sharding.global_batch(host, mesh))
    grads = jax.tree.map(lambda a, b: a - b, state.params, new.params)

    def reference_loss(params, step_index):
        rng_aug = jax.random.fold_in(jax.random.fold_in(jax.random.key(step_cfg.seed), step_index), 1)
        keys = jax.random.split(jax.random.split(rng_aug)[0], 2)  # full forward, one per microbatch
        rows = [slice(0, 8), slice(8, 16)]  # one data shard: microbatch i is the i-th half
        feats = [model.apply({"params": params}, host["image"][r], host["text"][r], train=True,
                             rngs={"augment": key}) for r, key in zip(rows, keys)]
        out = {k: jnp.concatenate([f[k] for f in feats]) for k in S.FEATURES}
        out.update(logit_scale=jnp.exp(params["logit_scale"]), logit_bias=params["logit_bias"], text=host["text"])
        return pcmepp.loss(out, step_cfg.loss_config)[0]

    # Jitted: op by op, this model's forward and backward took ~40 s of dispatch on 2 cores.
    reference = jax.jit(jax.value_and_grad(reference_loss))
    ref_loss, ref_grads = reference(state.params, 0)
    assert abs(float(metrics["loss"]) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    leaves = zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads), jax.tree.leaves(state.params))
    for (path, g), r, p in leaves:
        if "logit_scale" in jax.tree_util.keystr(path) or "key_bias" in jax.tree_util.keystr(path):
            continue  # key biases: a zero true gradient, rounding noise (module docstring)
        # The update is read back as old - new params: exact to the params' float32 spacing.
        tol = 1e-5 * float(np.abs(r).max()) + 2 * float(np.spacing(np.abs(p).max()))
        assert float(np.abs(g - r).max()) <= tol, jax.tree_util.keystr(path)
    # The drops are really drawn, anew each step: another step index, another loss.
    assert abs(float(reference(state.params, 1)[0]) - float(ref_loss)) > 1e-4
