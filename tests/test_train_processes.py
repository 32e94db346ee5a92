"""The trainer as users run it: two processes x 1 CPU device through jax.distributed on
localhost == one process x 2 devices (training and in-training evaluation); SIGTERM
(preemption) saves and exits cleanly."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import time
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from conftest import xla_flags
from prolip_jax.core import checkpoint

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--config.log_steps=1"]  # with configs/tiny.py:size=micro (the micro towers, batch 16)


def _env(devices: int) -> dict:
    # No persistent compilation cache: a hit in one process and not the other would leave them
    # far apart at the first collective (gloo gives up after 30 s).
    env = dict(os.environ, XLA_FLAGS=xla_flags(devices), JAX_PLATFORMS="cpu",
               JAX_ENABLE_COMPILATION_CACHE="false", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# In-training evaluation on tiny demo splits: every evaluator, each host reading its share.
EVAL_CONFIG = """
from prolip_jax.runtime import config_args

def get_config(arg=None):
    c = config_args.load_config_file("{root}/configs/tiny.py:" + (arg or ""))
    demo = dict(cache_dir="{cache}", image_size=16, num_train=200, num_zeroshot=36,
                num_retrieval=20, num_levels=10)
    for name, kw in (("zs", dict(type="zeroshot", task="object", bprw=("nn",))),
                     ("ret", dict(type="retrieval")), ("unc", dict(type="uncertainty"))):
        c.evals[name] = dict(kw, dataset="demo", demo=demo, log_steps=3, prefix="eval/",
                             batch_size=8)
    return c
"""


def _eval_config(tmp_path) -> str:
    from input_pipeline.demo import get_demo

    cache = tmp_path / "demo"
    get_demo(cache_dir=str(cache), image_size=16, num_train=200, num_zeroshot=36,   # once, here
             num_retrieval=20, num_levels=10)
    path = tmp_path / "eval_config.py"
    path.write_text(EVAL_CONFIG.format(root=ROOT, cache=cache))
    return str(path)


def test_two_processes_equal_one(tmp_path):
    train = [sys.executable, "-m", "prolip_jax.train", "--config", _eval_config(tmp_path) + ":steps=3,data=random,size=micro"]
    port = _free_port()
    # Two devices in all: the same batch shards (and so the same masked rows) in both runs.
    single = subprocess.run(train + ARGS + ["--workdir", str(tmp_path / "single")], cwd=ROOT, env=_env(2),
                            capture_output=True, text=True, timeout=600)
    procs = [subprocess.Popen(
        train + ARGS + ["--workdir", str(tmp_path / "multi"), "--coordinator_address", f"127.0.0.1:{port}",
                        "--num_processes", "2", "--process_id", str(i)],
        cwd=ROOT, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert single.returncode == 0, single.stderr[-3000:]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    assert "[3/3" in outs[0] and "[3/3" not in outs[1]  # only process 0 reports

    a, _, step_a = checkpoint.load_params(tmp_path / "multi" / "checkpoints")
    b, _, step_b = checkpoint.load_params(tmp_path / "single" / "checkpoints")
    assert step_a == step_b == 3
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))):
        if "key_bias" in jax.tree_util.keystr(path):  # zero true gradient: see test_step.py
            continue
        assert np.abs(x - y).max() <= 1e-5 * max(np.abs(y).max(), 1e-12), jax.tree_util.keystr(path)
    la = (tmp_path / "multi" / "metrics.jsonl").read_text().splitlines()
    lb = (tmp_path / "single" / "metrics.jsonl").read_text().splitlines()
    assert len(la) == len(lb) == 3
    # In-training evaluation at step 3 on 2 hosts == on 1 host: the same metrics (from params
    # equal to ~1e-5, see above; every host reads its share and gathers the encodings).
    ea, eb = ({k: v for k, v in json.loads(lines[2]).items() if k.startswith("eval/")} for lines in (la, lb))
    assert set(ea) == set(eb) and len(ea) > 80
    assert {k.split("/")[1] for k in ea} == {"zeroshot", "bprw", "retrieval", "uncertainty"}
    for k, v in eb.items():
        assert ea[k] == pytest.approx(v, rel=1e-3, abs=1e-6), k

    # (Restoring onto another mesh: tests/test_train.py::test_restore_onto_another_mesh; onto another
    # device and process count: tests/test_resume_elastic.py, 2 -> 1 -> 2 processes.)


def test_sigterm_saves_and_exits_cleanly(tmp_path):
    args = [sys.executable, "-m", "prolip_jax.train", "--config", "configs/tiny.py:steps=100000,data=random,size=micro", *ARGS,
            "--workdir", str(tmp_path / "w")]
    proc = subprocess.Popen(args, cwd=ROOT, env=_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.time() + 600
    for line in proc.stdout:  # wait until training is under way
        lines.append(line)
        if re.match(r"\[\s*2/", line) or time.time() > deadline:  # the progress line of step 2
            break
    proc.send_signal(signal.SIGTERM)
    out = "".join(lines) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "preempted: saved step" in out
    root, step = checkpoint.resolve(tmp_path / "w" / "checkpoints")
    assert step >= 2
    assert checkpoint.load_config(root)[1]["train_config"]["total_steps"] == 100000
