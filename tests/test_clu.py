"""clu where it serves: windowed training metrics (clu.metrics), the parameter table
(clu.parameter_overview) and a jax.profiler trace of a few trainer steps."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prolip_jax.runtime import overview, profiling
from prolip_jax import train
from prolip_jax.runtime.metrics import read_jsonl
from prolip_jax.core.models import abstract_params, get_config
from prolip_jax.core.models.prolip import count_params
from prolip_jax.runtime.window import Window, reduction
from test_train import tiny_config

KEYS = ("loss", "loss/ppcl", "a", "sigma2_trace/image", "lr", "grad_norm", "nonfinite")


def fake_steps(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """n per-step metric dicts as the train step returns them; one step is non-finite."""
    rng = np.random.default_rng(seed)
    steps = [{k: np.float32(rng.normal() * 3) for k in KEYS} for _ in range(n)]
    for i, s in enumerate(steps):
        s["grad_norm"] = np.float32(abs(s["grad_norm"]))
        s["lr"] = np.float32(1e-3 * (i + 1))
        s["nonfinite"] = np.int32(0)
    bad = steps[n // 2]
    bad["loss"], bad["grad_norm"], bad["nonfinite"] = np.float32(np.nan), np.float32(np.inf), np.int32(1)
    return steps


def expected(steps: list[dict[str, np.ndarray]]) -> dict[str, float]:
    """The window's values computed separately: mean / max over the finite values, sum, last."""
    out = {}
    for k in steps[0]:
        v = np.array([s[k] for s in steps], np.float64)
        finite = v[np.isfinite(v)]
        out[k] = {"mean": np.mean, "max": np.max, "sum": lambda _: np.sum(v), "last": lambda _: v[-1]}[
            reduction(k)](finite)
    return out


def test_window_equals_separately_computed_reductions():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    window = Window(replicated)
    for seed, n in ((0, 7), (1, 3)):  # two windows: result() starts a new one
        steps = fake_steps(n, seed)
        for s in steps:
            window.add({k: jax.device_put(v, replicated) for k, v in s.items()})
        assert window.steps == n
        got = window.result()
        assert window.steps == 0 and sorted(got) == sorted(KEYS)
        want = expected(steps)
        for k in KEYS:
            np.testing.assert_allclose(float(got[k]), want[k], rtol=1e-6, err_msg=k)
        assert got["nonfinite"].dtype == jnp.int32 and got["loss"].sharding.is_fully_replicated
    assert window.result() == {}
    window.add({k: np.float32(np.nan) if k == "loss" else v for k, v in fake_steps(1, 2)[0].items()})
    assert np.isnan(float(window.result()["loss"]))  # no finite value in the window: NaN (logged null)
    with pytest.raises(ValueError, match="metric keys changed"):
        window.add({"loss": np.float32(1.0)})


def test_parameter_table_totals_equal_count_params():
    cfg = get_config("micro")
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract_params(cfg))
    table = overview.parameter_table(params)
    total = count_params(params)
    assert f"Total: {total:,} parameters" in table
    per_tower = {m[1]: int(m[2].replace(",", "")) for m in re.finditer(r"^  (\S+)\s+([\d,]+)\s", table, re.M)}
    assert per_tower == {k: count_params(v) for k, v in params.items()}
    assert sum(per_tower.values()) == total and set(per_tower) == {"visual", "text", "logit_scale", "logit_bias"}
    assert "visual/transformer/resblocks_0/c_fc/kernel" in table

    import prolip_jax

    model = prolip_jax.PretrainedProLIP(cfg, params)
    assert f"{total:,} parameters" in repr(model) and model.summary() == table


def test_profile_settings_are_checked_before_compiling(tmp_path):
    for bad in (dict(num_steps=-1), dict(start_step=-2, num_steps=1), dict(num_steps=1.5)):
        with pytest.raises(ValueError, match="must be a non-negative integer"):
            profiling.ProfileConfig(**bad).check(100)
    profiling.ProfileConfig(start_step=500).check(100)  # off (num_steps=0): any start
    cfg = tiny_config(tmp_path, **{"data.source": "random"})
    cfg.profile = dict(start_step=cfg.total_steps, num_steps=1)
    with pytest.raises(ValueError, match=r"profile.start_step=6 leaves no step to trace"):
        train.train(cfg, str(tmp_path / "w"))
    assert not (tmp_path / "w").exists()


def test_trainer_logs_window_values_writes_parameter_table_and_trace(tmp_path, monkeypatch):
    """Three steps logged every two: the rows at steps 2 and 3 hold the mean (max, sum, last) of
    the per-step metrics of steps 1-2 and of step 3, recorded as the trainer hands them to the
    window. Step 2 is traced; the parameter table is written."""
    per_step = []
    add = Window.add

    def recording_add(self, metrics):
        per_step.append(jax.device_get(dict(metrics)))  # a host sync per step: only in this test
        add(self, metrics)

    monkeypatch.setattr(Window, "add", recording_add)
    cfg = tiny_config(tmp_path, **{"data.source": "random", "total_steps": 3, "log_steps": 2})
    cfg.profile = dict(start_step=1, num_steps=1)
    train.train(cfg, str(tmp_path / "w"))

    rows = {r["step"]: r for r in read_jsonl(str(tmp_path / "w" / "metrics.jsonl"))}
    assert sorted(rows) == [2, 3] and len(per_step) == 3
    assert {"loss", "grad_norm", "nonfinite", "lr", "sigma2_trace/image"} <= set(per_step[0])
    for step, window in ((2, per_step[:2]), (3, per_step[2:])):
        for key, value in expected(window).items():
            assert rows[step][key] == pytest.approx(value, rel=1e-6), (step, key)
    assert rows[2]["loss"] != pytest.approx(per_step[1]["loss"], rel=1e-6)  # not the one step's value

    traces = list((tmp_path / "w" / "profile").glob("plugins/profile/*/*.xplane.pb"))
    assert traces and traces[0].stat().st_size > 0

    table = (tmp_path / "w" / "parameters.txt").read_text()
    total = count_params(abstract_params(get_config("micro")))
    assert f"Total: {total:,} parameters" in table and "Sharding" in table
