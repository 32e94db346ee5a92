"""MetricWriter: metrics.jsonl, TensorBoard event files read back, resume, stdout progress/ETA."""
from __future__ import annotations

import io
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

from prolip_jax.runtime.metrics import MetricWriter, format_duration, format_value, read_jsonl, read_tensorboard_scalars


def _strict_json(line: str) -> dict:
    """json.loads that rejects NaN/Infinity (Python's default parser accepts them)."""
    def reject(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(line, parse_constant=reject)


class FakeClock:
    def __init__(self, times):
        self._times = iter(times)

    def __call__(self) -> float:
        return next(self._times)


def test_jsonl_lines_are_valid_json_with_keys_and_steps(tmp_path):
    out = io.StringIO()
    with MetricWriter(str(tmp_path), total_steps=100, stream=out) as w:
        w.write(10, {"loss": jnp.float32(1.5), "lr": np.float64(5e-4), "skipped": 3})
        w.write(20, {"loss": jnp.array(float("nan")), "lr": 4e-4, "skipped": np.int64(0)})
        w.write(30, {"loss": float("inf"), "lr": jnp.array([2e-4]), "skipped": True})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    records = [_strict_json(line) for line in lines]
    assert [r["step"] for r in records] == [10, 20, 30]
    assert all(list(r) == ["step", "loss", "lr", "skipped"] for r in records)
    assert records[0]["loss"] == 1.5 and records[0]["lr"] == pytest.approx(5e-4)
    # Non-finite values: null with the key kept; integers stay integers.
    assert records[1]["loss"] is None and records[2]["loss"] is None
    assert records[0]["skipped"] == 3 and isinstance(records[1]["skipped"], int)
    assert records[2]["skipped"] == 1
    assert records[2]["lr"] == pytest.approx(2e-4)


def test_tensorboard_scalars_read_back(tmp_path):
    with MetricWriter(str(tmp_path), total_steps=100, stream=io.StringIO()) as w:
        w.write(1, {"loss": 2.25, "mfu": 0.5})
        w.write(2, {"loss": 1.75, "mfu": float("nan")})
    tb = tmp_path / "tb"
    assert any("tfevents" in name for name in os.listdir(tb))
    scalars = read_tensorboard_scalars(str(tb))
    assert scalars["loss"] == [(1, 2.25), (2, 1.75)]
    assert scalars["mfu"][0] == (1, 0.5)
    assert scalars["mfu"][1][0] == 2 and math.isnan(scalars["mfu"][1][1])


def test_nonfinite_values_log_no_warnings(tmp_path, caplog):
    """tensorboardX warns once per non-finite scalar (a dozen lines per skipped step); silenced."""
    import logging

    with caplog.at_level(logging.WARNING), MetricWriter(str(tmp_path), 10, stream=io.StringIO()) as w:
        w.write(1, {f"loss/{i}": float("nan") for i in range(12)})
    assert not caplog.records, [r.getMessage() for r in caplog.records]


def test_resume_drops_later_steps_and_appends(tmp_path):
    with MetricWriter(str(tmp_path), total_steps=50, stream=io.StringIO()) as w:
        for step in (10, 20, 30, 40):
            w.write(step, {"loss": float(step)})
    # A crash mid-write leaves a torn last line; it must not survive the resume.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 50, "lo')

    with MetricWriter(str(tmp_path), total_steps=50, resume_step=30, stream=io.StringIO()) as w:
        w.write(30, {"loss": -30.0})
        w.write(40, {"loss": -40.0})
    records = read_jsonl(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in records] == [(10, 10.0), (20, 20.0), (30, -30.0), (40, -40.0)]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()
    # TensorBoard: two event files; the purge marker hides the first run's steps >= 30.
    assert len([n for n in os.listdir(tmp_path / "tb") if "tfevents" in n]) == 2
    scalars = read_tensorboard_scalars(str(tmp_path / "tb"))
    assert scalars["loss"] == [(10, 10.0), (20, 20.0), (30, -30.0), (40, -40.0)]


def test_fresh_start_replaces_stale_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 5, "loss": 9.0}\n')
    with MetricWriter(str(tmp_path), total_steps=10, stream=io.StringIO()) as w:
        w.write(1, {"loss": 1.0})
    assert read_jsonl(str(tmp_path / "metrics.jsonl")) == [{"step": 1, "loss": 1.0}]


def test_non_chief_writes_nothing(tmp_path, capsys):
    workdir = tmp_path / "run"
    out = io.StringIO()
    w = MetricWriter(str(workdir), total_steps=10, is_chief=False, stream=out)
    w.write(1, {"loss": 1.0})
    w.close()
    assert not workdir.exists()
    assert out.getvalue() == "" and capsys.readouterr().out == ""


def test_stdout_progress_and_eta(tmp_path):
    out = io.StringIO()
    # Writes at steps 100, 200, 300 at t = 5, 15, 25 s: 0.1 s/step, 700 steps left -> 70 s.
    with MetricWriter(str(tmp_path), total_steps=1000, stream=out, clock=FakeClock([5.0, 15.0, 25.0])) as w:
        w.write(100, {"loss": 1.23456})
        w.write(200, {"loss": 1.0})
        w.write(300, {"loss": 0.5, "skipped": 2, "data/skipped/corrupt_image": 0,
                      "data/skipped/empty_caption": 3})
    lines = out.getvalue().splitlines()
    assert lines[0] == "[ 100/1000  10.0%] ETA ? | loss 1.235"
    assert "ETA 1m20s" in lines[1]  # 800 steps left at 0.1 s/step
    # Zero per-reason skip counters are left off the line (not out of the files).
    assert lines[2] == ("[ 300/1000  30.0%] ETA 1m10s | loss 0.5 | skipped 2 | data/skipped/empty_caption 3 | "
                        "+1 more in metrics.jsonl")
    assert "corrupt_image" in (tmp_path / "metrics.jsonl").read_text().splitlines()[-1]


def test_console_lines_are_compact_and_fit_the_width(tmp_path):
    """A line per list of names in `console`: names under one parent written once, values in a
    few characters, each line cut to line_width, and '+N more' only where it fits."""
    values = {"loss": 5.8534, "loss/ppcl": 5.84, "loss/vib": 4.1e-4, "samples_per_s": 2392.6, "lr": 5e-4,
              "grad_norm": 1.0, "zeroshot/digits/top1_csd": 12.5, "zeroshot/digits/top1_dot": 11.0,
              "retrieval/tar/csd/i2t_R@1": 20.0}
    evals = ["zeroshot/digits/top1_csd", "zeroshot/digits/top1_dot", "retrieval/tar/csd/i2t_R@1"]
    out = io.StringIO()
    with MetricWriter(str(tmp_path), total_steps=5000, stream=out, clock=FakeClock([0.0])) as w:
        w.write(1200, values, console=[["loss", "loss/ppcl", "loss/vib", "samples_per_s", "lr"], evals])
    assert out.getvalue().splitlines() == [
        "[1200/5000  24.0%] ETA ? | loss 5.853 (ppcl 5.84, vib 4.1e-4) | samples_per_s 2393 | lr 5e-4",
        "[1200/5000  24.0%] | zeroshot/digits top1_csd 12.5, top1_dot 11 | retrieval/tar/csd/i2t_R@1 20 | "
        "+1 more in metrics.jsonl"]
    out = io.StringIO()
    with MetricWriter(str(tmp_path), total_steps=5000, stream=out, line_width=60, clock=FakeClock([0.0])) as w:
        w.write(1200, values, console=[["loss", "loss/ppcl", "loss/vib", "samples_per_s", "lr"], evals])
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 60 and lines[0].startswith("[1200/5000  24.0%] ETA ? | loss 5.853 (ppcl"), lines
    assert lines[1] == "[1200/5000  24.0%] | zeroshot/digits/top1_csd 12.5", lines


@pytest.mark.parametrize("value,text", [(1, "1"), (0, "0"), (0.0, "0"), (5.8534, "5.853"), (0.02235, "0.02235"),
                                        (1e-4, "1e-4"), (0.00010000000474974513, "1e-4"), (2.2345e-5, "2.23e-5"),
                                        (0.00099996, "1e-3"), (2392.6, "2393"), (1.5e7, "1.5e7"), (-0.5, "-0.5"),
                                        (float("nan"), "nan")])
def test_format_value(value, text):
    assert format_value(value) == text


def test_eta_uses_moving_window(tmp_path):
    out = io.StringIO()
    # A slow start (1 s/step) followed by fast steps (0.1 s/step); window of 3 writes
    # forgets the slow interval.
    clock = FakeClock([0.0, 100.0, 110.0, 120.0])
    with MetricWriter(str(tmp_path), total_steps=1000, eta_window=3, stream=out, clock=clock) as w:
        for step in (100, 200, 300, 400):
            w.write(step, {"loss": 1.0})
        assert w.seconds_per_step() == pytest.approx(0.1)
    assert "ETA 1m00s" in out.getvalue().splitlines()[-1]


def test_rejects_bad_metrics(tmp_path):
    with MetricWriter(str(tmp_path), total_steps=10, stream=io.StringIO()) as w:
        with pytest.raises(ValueError, match="scalars"):
            w.write(1, {"loss": np.zeros(3)})
        with pytest.raises(ValueError, match="reserved"):
            w.write(1, {"step": 1})
    with pytest.raises(RuntimeError, match="close"):
        w.write(2, {"loss": 1.0})


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (59.4, "59s"), (65, "1m05s"),
                                          (3 * 3600 + 12 * 60, "3h12m"), (2 * 86400 + 3 * 3600, "2d03h")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
