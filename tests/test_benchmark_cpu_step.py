"""benchmarks/benchmark_cpu_step.py's `--profile` summary: thunk time per kind from a perfetto trace."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from benchmark_cpu_step import thunk_times  # noqa: E402


def test_thunk_times_sums_kinds_per_step(tmp_path):
    events = [
        {"ph": "X", "name": "ynn_fusion.1", "dur": 3000}, {"ph": "X", "name": "ynn_fusion.22", "dur": 1000},
        {"ph": "X", "name": "ynn_fusion.1", "dur": 2000}, {"ph": "X", "name": "ynn_fusion.22", "dur": 2000},
        {"ph": "X", "name": "copy_bitcast_fusion.7", "dur": 500}, {"ph": "X", "name": "copy_bitcast_fusion.7", "dur": 700},
        {"ph": "X", "name": "ThunkExecutor::Execute", "dur": 9000},  # bookkeeping, left out
        {"ph": "X", "name": "$api.py:2479 block_until_ready", "dur": 9000},
        {"ph": "X", "name": "CommonPjRtBuffer::Await", "dur": 9000}, {"ph": "X", "name": "end: ynn_fusion", "dur": 9},
        {"ph": "i", "name": "ynn_fusion.1"},  # not a complete event
    ]
    (tmp_path / "plugins").mkdir()
    with gzip.open(tmp_path / "plugins" / "host.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert thunk_times(str(tmp_path), steps=2) == [("ynn_fusion", 4.0, 2), ("copy_bitcast_fusion", 0.6, 1)]


def test_thunk_times_reads_a_real_cpu_trace(tmp_path):
    f = jax.jit(lambda a, b: jnp.tanh(a @ b) * 2.0)
    a = jnp.ones((256, 256))
    f(a, a).block_until_ready()
    with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
        for _ in range(2):
            f(a, a).block_until_ready()
    rows = thunk_times(str(tmp_path), steps=2)
    kinds = [kind for kind, _, _ in rows]
    assert any("fusion" in k or k.startswith("dot") for k in kinds), kinds  # the matmul's thunk
    assert all(ms >= 0 and n >= 1 and k.islower() and " " not in k for k, ms, n in rows), rows


def test_thunk_times_without_a_trace_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no perfetto trace"):
        thunk_times(str(tmp_path), steps=1)
