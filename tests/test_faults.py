"""The faults of a long run, each met with one line and the newest intact state (docs/training.md,
"When a long run meets a fault"): a damaged checkpoint, a full disk during a save, a failure
outside the model, a torn metrics line.

One tiny run (random batches, a checkpoint every step) is shared; each test damages its own copy.
Every run here has the same config, so the persistent compilation cache compiles its step once.
"""
from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from prolip_jax.core import checkpoint
from prolip_jax import train
from prolip_jax.trainer import build as trainer_build, workdir as trainer_workdir

from test_train import tiny_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import convert_to_pytorch  # noqa: E402
import evaluate  # noqa: E402

STEPS = 3
# The same run as `config()` through the command line (tests of main(): the one-line errors).
CLI = ["--config", str(ROOT / "configs" / "tiny.py") + f":data=random,steps={STEPS},size=micro",
       "--config.log_steps=1", "--config.checkpoint_steps=1"]


def config(tmp_path, **overrides):
    return tiny_config(tmp_path, **{"data.source": "random", "total_steps": STEPS, "checkpoint_steps": 1,
                                    "keep_checkpoints": 5, **overrides})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run of STEPS steps with a checkpoint at every step."""
    tmp = tmp_path_factory.mktemp("faults")
    train.train(config(tmp), str(tmp / "run"))
    return tmp / "run"


def copy_of(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "w")
    return tmp_path / "w"


def array_files(step_dir: Path, item: str) -> list[Path]:
    """The data files of an orbax item (OCDBT: `<item>/d/*` and `<item>/ocdbt.process_*/d/*`)."""
    return sorted(p for p in (step_dir / item).rglob("*") if p.is_file() and p.parent.name == "d")


def truncate_half(files: list[Path]) -> None:
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size // 2)


def damage(step_dir: Path) -> None:
    """What a disk that filled during a copy leaves: the params' array files cut to half their
    size, the optimiser state's array files gone."""
    truncate_half(array_files(step_dir, "params"))
    for f in array_files(step_dir, "opt_state"):
        f.unlink()


def one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]


def params_of(ckpt: Path, step: int):
    return jax.device_get(checkpoint.load_params(ckpt, step)[0])


# ------------------------------------------------------------------------- a damaged checkpoint
def test_check_step_names_what_is_wrong(run, tmp_path):
    w = copy_of(run, tmp_path) / "checkpoints"
    assert checkpoint.check_step(w, STEPS) is None
    truncate_half(array_files(w / "3", "params"))
    assert checkpoint.check_step(w, 3).startswith("params")
    for f in array_files(w / "2", "opt_state"):
        f.unlink()
    problem = checkpoint.check_step(w, 2)
    assert problem.startswith("opt_state") and "missing" in problem, problem
    (w / "1" / "config" / "metadata").write_text('{"model": ')  # a torn JSON item
    assert checkpoint.check_step(w, 1) == "config/metadata is not valid JSON"
    # Values: a readable, well-shaped array holding NaN is damage too.
    from prolip_jax.core.models import get_config

    checkpoint.save_params(tmp_path / "nan", {"w": np.array([1.0, np.nan], np.float32)}, get_config("micro"), step=7)
    assert checkpoint.check_step(tmp_path / "nan", 7) == "params/w holds non-finite values"


def test_resume_falls_back_to_the_newest_intact_step(run, tmp_path, capfd):
    """The newest step damaged: one warning line, the step moved aside (kept), the run resumes
    from the step before and ends where an uninterrupted run ends."""
    w = copy_of(run, tmp_path)
    damage(w / "checkpoints" / str(STEPS))
    sizes = {p.relative_to(w / "checkpoints" / str(STEPS)): p.stat().st_size
             for p in (w / "checkpoints" / str(STEPS)).rglob("*") if p.is_file()}
    capfd.readouterr()
    train.train(config(tmp_path), str(w))
    out, err = capfd.readouterr()
    warning = one_line(err)
    assert warning.startswith(f"warning: checkpoint step {STEPS} is damaged (params") and \
        f"moved it to {w / 'checkpoints' / f'{STEPS}.corrupt'}" in warning, warning
    assert f"resumed from {w / 'checkpoints' / str(STEPS - 1)} (step {STEPS - 1})" in out
    moved = w / "checkpoints" / f"{STEPS}.corrupt"
    assert {p.relative_to(moved): p.stat().st_size for p in moved.rglob("*") if p.is_file()} == sizes  # never deleted
    # The step was redone from the intact one: bit-identical to the uninterrupted run's.
    jax.tree.map(np.testing.assert_array_equal, params_of(w / "checkpoints", STEPS), params_of(run / "checkpoints", STEPS))


def test_no_intact_checkpoint_is_one_line_exit_2(run, tmp_path, capfd):
    w = copy_of(run, tmp_path)
    for step in range(1, STEPS + 1):
        damage(w / "checkpoints" / str(step))
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.main(["train"] + CLI + ["--workdir", str(w)])
    assert exit_.value.code == 2
    out, err = capfd.readouterr()
    lines = err.splitlines()
    assert len(lines) == STEPS + 1 and all(line.startswith("warning: checkpoint step") for line in lines[:-1]), err
    assert lines[-1] == (f"error: no intact checkpoint in {w / 'checkpoints'}: steps 3, 2, 1 were damaged and moved "
                         "aside (<step>.corrupt); put an intact copy back, or rerun to start from step 0")
    assert sorted(p.name for p in (w / "checkpoints").iterdir()) == ["1.corrupt", "2.corrupt", "3.corrupt"]


def test_tools_name_a_damaged_checkpoint_in_one_line(run, tmp_path, capfd):
    """prolip_jax.load, scripts/evaluate.py and the converter to PyTorch: one line naming the
    step, what is wrong and the intact steps to pass instead."""
    import prolip_jax

    w = copy_of(run, tmp_path)
    truncate_half(array_files(w / "checkpoints" / str(STEPS), "params"))
    expected = (f"checkpoint {w / 'checkpoints' / str(STEPS)} is damaged (params")
    with pytest.raises(checkpoint.DamagedCheckpoint) as e:
        prolip_jax.load(w)
    assert str(e.value).startswith(expected) and "\n" not in str(e.value)
    assert str(e.value).endswith("pass an earlier step (--step; available: 2, 1); resuming the training run "
                                 "moves a damaged step aside by itself")
    capfd.readouterr()
    assert evaluate.main(["--checkpoint", str(w), "--config", str(ROOT / "configs" / "eval" / "demo.py"),
                          "--out", str(tmp_path / "eval")]) == 2
    assert one_line(capfd.readouterr().err).startswith("error: " + expected)
    assert convert_to_pytorch.main(["--checkpoint", str(w), "--out", str(tmp_path / "hf")]) == 2
    assert one_line(capfd.readouterr().err).startswith("error: " + expected)
    assert prolip_jax.load(w, step=STEPS - 1) is not None  # the step before is intact


# ------------------------------------------------------------------------- a full disk during a save
def test_full_disk_during_a_save_is_one_line(run, tmp_path, capfd, monkeypatch):
    """The array writes of step 2's save fail with ENOSPC (as tensorstore's do on a full disk; orbax
    runs them in its background threads): one line naming the folder, the bytes needed and free
    and the checkpoint to resume from, exit 2; no partial folder; step 1 intact; the rerun resumes
    from it and ends bit-identical to the uninterrupted run."""
    import asyncio
    import errno

    from orbax.checkpoint._src.serialization import jax_array_handlers, serialization

    write = serialization.async_serialize_from_host

    async def full_disk(rslices, tensorstore_spec, **kwargs):
        if "/2.orbax-checkpoint-tmp" in str(tensorstore_spec):
            raise OSError(errno.ENOSPC, "No space left on device")
        return await write(rslices, tensorstore_spec, **kwargs)

    # Orbax reports the first failed write while its other writes (each item's `_sharding` file,
    # in their own threads) still run: slowed here, they write after the failure is reported, as
    # they did once on CI (the cleanup then met a vanishing `_sharding.__lock`).
    write_shardings = jax_array_handlers._async_serialize_shardings

    calls = []

    async def slow_shardings(*args, **kwargs):
        calls.append(1)
        await asyncio.sleep(0.5 * (len(calls) > 1))  # the first item's, awaited before its arrays, in time
        return await write_shardings(*args, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", full_disk)
    monkeypatch.setattr(jax_array_handlers, "_async_serialize_shardings", slow_shardings)
    w = tmp_path / "w"
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.main(["train"] + CLI + ["--workdir", str(w)])
    assert exit_.value.code == 2
    import gc

    gc.collect()  # the failed save's write tasks, collected now, report to train.log (never the console)
    line = one_line(capfd.readouterr().err)
    ckpt = w / "checkpoints"
    assert line.startswith(f"error: could not write checkpoint step 2 to {ckpt}: the disk is full; a step needs ~")
    assert " free; the partial folder was removed. Free space (or lower --config.keep_checkpoints), then rerun " \
           f"the same command to resume from step 1 ({ckpt / '1'})" in line, line
    time.sleep(1)  # longer than the slowed writes: none of them may come after the cleanup
    assert sorted(p.name for p in ckpt.iterdir()) == ["1"]  # no <step>.orbax-checkpoint-tmp* left
    assert checkpoint.check_step(ckpt, 1) is None
    assert "No space left on device" in (w / "train.log").read_text()  # orbax's own report, off the console

    monkeypatch.setattr(serialization, "async_serialize_from_host", write)  # space freed
    train.train(config(tmp_path), str(w))
    jax.tree.map(np.testing.assert_array_equal, params_of(ckpt, STEPS), params_of(run / "checkpoints", STEPS))


# ------------------------------------------------------------------------- a failure outside the model
class _FailingData:
    """The run's data, whose read of batch `at` raises what grain raises when a worker dies."""

    def __init__(self, data, at: int):
        self._data, self._at, self._reads = data, at, 0

    def __getattr__(self, name):
        return getattr(self._data, name)

    def __iter__(self):
        return self

    def __next__(self):
        self._reads += 1
        if self._reads == self._at:
            raise RuntimeError("Worker process was terminated unexpectedly with exit code -9")
        return next(self._data)


class _FailingEvaluator:
    HEADLINE = ()

    def __init__(self, at: int):
        self.calls, self.at = 0, at

    def run(self, params):
        self.calls += 1
        if self.calls == self.at:
            raise OSError("the evaluation data's mount is gone")
        yield "eval/ok", 1.0


@pytest.mark.parametrize("part", ["data", "evaluator"])
def test_a_failure_outside_the_model_saves_first(run, tmp_path, capfd, monkeypatch, part):
    """The data pipeline fails reading batch 3 / an evaluator fails at step 2: the state reached
    is saved first, one line names what failed and the checkpoint, exit 2; the rerun continues
    exactly (same batches: bit-identical to the uninterrupted run)."""
    if part == "data":
        build = trainer_build.build_train_data
        monkeypatch.setattr(trainer_build, "build_train_data",
                            lambda *a: dataclasses.replace(built := build(*a), batches=_FailingData(built.batches, at=3)))
        saved, what = 2, "the data pipeline"
        gist = "RuntimeError: Worker process was terminated unexpectedly with exit code -9"
    else:
        monkeypatch.setattr(trainer_build, "build_evaluators", lambda run_config, model: [
            ({"name": "zs", "log_steps": 1, "prefix": ""}, _FailingEvaluator(at=2))])
        saved, what = 2, "evaluator 'zs'"
        gist = "OSError: the evaluation data's mount is gone"
    w = tmp_path / "w"
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        # Checkpoints every 100 steps: the one at step 2 is the failure's.
        train.main(["train"] + CLI + ["--workdir", str(w), "--config.checkpoint_steps=100"])
    assert exit_.value.code == 2
    ckpt = w / "checkpoints"
    assert one_line(capfd.readouterr().err) == (
        f"error: {what} failed after step {saved} ({gist}); saved checkpoint step {saved} ({ckpt / str(saved)}): "
        "rerun the same command to resume from it")
    assert sorted(p.name for p in ckpt.iterdir()) == [str(saved)] and checkpoint.check_step(ckpt, saved) is None
    assert gist.split(": ", 1)[1] in (w / "train.log").read_text()  # the traceback, off the console

    monkeypatch.undo()
    out = train.train(config(tmp_path), str(w))
    assert out["data/batches"] == STEPS  # none read twice, none skipped
    jax.tree.map(np.testing.assert_array_equal, params_of(ckpt, STEPS), params_of(run / "checkpoints", STEPS))


def test_a_killed_workers_image_ring_is_released_on_close():
    """A worker killed with its ring in use cannot unlink it; the main process's Receiver does
    when the pipeline closes (once the workers have stopped), the slots it never received
    included, and takes them off the resource tracker's list."""
    from input_pipeline import shared_batches

    ring = shared_batches.ImageRing(2)
    images, sent = ring.take((2, 4, 4, 3), np.uint8)
    images[:] = 7
    _, unseen = ring.take((2, 4, 4, 3), np.uint8)  # a batch still in grain's queue when the worker died
    receiver = shared_batches.Receiver()
    assert (receiver.receive(sent) == 7).all()
    names = [sent.flags, sent.data, unseen.data]
    assert all(Path("/dev/shm", n).exists() for n in names)
    # The worker dies here (its exit hooks never run); the pipeline closes.
    receiver.close()
    assert not any(Path("/dev/shm", n).exists() for n in names)
    for segment in (ring._flags, *ring._data):  # the dead worker's mappings; its exit hook finds the names gone
        segment.close()


# ------------------------------------------------------------------------- beside the arrays
def test_a_torn_last_metrics_line_is_skipped_with_a_warning(tmp_path, caplog):
    from prolip_jax.runtime.metrics import read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": null}\n{"step": 3, "lo')
    with caplog.at_level("WARNING"):
        assert read_jsonl(str(path)) == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": None}]
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: its last line is cut short (the run was stopped while writing it); read the 2 lines before it"]
    path.write_text('{"step": 1}\n{"step": 2\n{"step": 3}\n')  # damage before the end is not a torn write
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not valid JSON$"):
        read_jsonl(str(path))


# ------------------------------------------------------------------------- a lost host
class _KeyValues:
    """The coordination service's key-value store, as PeerWatch uses it."""

    def __init__(self):
        self.values, self.down = {}, False

    def key_value_set(self, key, value, allow_overwrite=False):
        if self.down:
            raise RuntimeError("UNAVAILABLE: Failed to send RPC to coordination service")
        self.values[key] = value

    def key_value_try_get(self, key):
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: {key}")
        return self.values[key]


def test_peer_watch_names_a_silent_failed_or_unreachable_process():
    from prolip_jax.runtime.peers import PeerWatch

    now = [0.0]
    kv = _KeyValues()
    me, other = (PeerWatch(kv, p, 2, on_lost=print, timeout_s=30, clock=lambda: now[0]) for p in (0, 1))
    for t in (0, 10, 20, 30):  # both beat
        now[0] = t
        assert other.check_once() is None and me.check_once() is None
    now[0] = 55  # process 1 is killed after its beat at 30 s
    assert me.check_once() is None
    now[0] = 61
    assert me.check_once() == "process 1 of 2 has sent no heartbeat for 31 s (killed, or its machine lost)"
    other.stop(0)  # ... unless it ended cleanly (the run finished, or was preempted and saved)
    assert me.check_once() is None and 1 not in me.seen
    kv.values["prolip_jax/exit/0"] = "2"
    assert PeerWatch(kv, 1, 2, print).check_once() == "process 0 of 2 stopped with an error (see its output)"
    kv.down = True
    assert PeerWatch(kv, 1, 2, print).check_once().startswith("the run's coordinator (process 0) does not answer")


def test_a_lost_process_ends_the_other_in_one_line(tmp_path):
    """Two processes x 4 CPU devices: process 1 is killed with SIGKILL after step 3; process 0
    stops within PROLIP_PEER_TIMEOUT_S (+ one beat) with one line, exit 2, never hanging. Both
    restarted, the coordinator (process 0) is killed after step 3: process 1 stops at once with
    one line (prolip_jax/runtime/supervise.py), exit 2. (A run restarted after a kill resumes from
    the newest intact checkpoint: test_resume_falls_back_to_the_newest_intact_step.)"""
    import os
    import re
    import signal
    import subprocess
    import time

    from conftest import xla_flags
    from test_train_processes import ARGS, _free_port

    # The peer timeout (60 s by default): short, as its wait is idle time of the suite; the
    # beat thread of a live process still beats every second on a loaded 2-core machine.
    TIMEOUT_S = 4
    env = dict(os.environ, XLA_FLAGS=xla_flags(4), JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1", PROLIP_PEER_TIMEOUT_S=str(TIMEOUT_S), PYTHONPATH=str(ROOT),
               # A fresh cache: both processes compile on the first start, both read it on the restart.
               JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"))

    def start():
        port = _free_port()
        return [subprocess.Popen(
            [sys.executable, "-m", "prolip_jax.train", "--config", "configs/tiny.py:data=random,steps=1000,size=micro",
             "--workdir", str(tmp_path / "w"), *ARGS, "--config.checkpoint_steps=2",
             "--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", str(i)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]

    def kill_after_step_3(victim):
        """Starts both, kills process `victim` once the chief logs step 3: (the other's exit code,
        its stderr, the seconds it took to stop)."""
        procs = start()
        for line in procs[0].stdout:  # the chief's progress lines
            if line.startswith("[   3/"):
                break
        procs[victim].send_signal(signal.SIGKILL)
        other = procs[1 - victim]
        t0 = time.monotonic()
        _, err = other.communicate(timeout=120)
        waited = time.monotonic() - t0
        procs[victim].communicate()
        return other.returncode, err, waited

    code, err, waited = kill_after_step_3(1)
    assert code == 2 and TIMEOUT_S - 1 <= waited < TIMEOUT_S + 5 + 10, waited  # - 1: the last beat
    found = re.fullmatch(
        r"error: process 1 of 2 has sent no heartbeat for (\d+) s \(killed, or its machine lost\); stopping process 0 "
        r"too\. Restart every process with the same command: the run resumes from the newest intact checkpoint in "
        + re.escape(str(tmp_path / "w" / "checkpoints")), one_line(err))
    assert found and TIMEOUT_S <= int(found.group(1)) < TIMEOUT_S + 10, err
    assert checkpoint.resolve(tmp_path / "w" / "checkpoints")[1] >= 2

    code, err, waited = kill_after_step_3(0)  # the same program as before: read from the cache
    assert code == 2 and waited < 30, waited
    log = tmp_path / "w" / "train.process_1.log"
    assert re.fullmatch(
        r"error: process 1 of 2 lost the run's coordinator \(process 0: killed, or its machine lost\) and jax "
        r"ended it \(SIGABRT\); its report: " + re.escape(str(log)) + r"\. Restart every process with the same "
        r"command: the run resumes from the newest intact checkpoint in " + re.escape(str(tmp_path / "w" / "checkpoints")),
        one_line(err)), err
    assert "Terminating process because the JAX distributed service detected fatal errors" in log.read_text()


def test_resuming_with_another_model_is_one_line(run, tmp_path, capfd):
    """Another model size in a workdir of a run: one line naming what differs, nothing written."""
    w = copy_of(run, tmp_path)
    before = sorted(p.relative_to(w) for p in w.rglob("*"))
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.main(["train"] + CLI + ["--workdir", str(w), "--config.model.variant=tiny", "--config.data.image_size=32"])
    assert exit_.value.code == 2
    line = one_line(capfd.readouterr().err)
    assert line.startswith(f"error: {w} holds a run of another model (") and len(line) < 400, line
    assert "(embed_dim 32 -> 64, text_cfg.context_length 8 -> 16, text_cfg.layers 1 -> 2, and 6 more)" in line and line.endswith(
        "pass another --workdir for this model, or the config that run was started with")
    assert sorted(p.relative_to(w) for p in w.rglob("*") if not p.name.startswith("train")) == \
        [p for p in before if not p.name.startswith("train")]


@pytest.mark.parametrize("kind", ["file", "other files"])
def test_a_workdir_that_is_not_a_runs_is_one_line_before_anything_is_written(tmp_path, capfd, kind):
    w = tmp_path / "w"
    if kind == "file":
        w.write_text("notes")
    else:
        (w / "photos").mkdir(parents=True)
        (w / "notes.txt").write_text("mine")
    capfd.readouterr()
    with pytest.raises(SystemExit) as exit_:
        train.main(["train"] + CLI + ["--workdir", str(w)])
    assert exit_.value.code == 2
    line = one_line(capfd.readouterr().err)
    expect = (f"error: --workdir {w} is a file, not a folder" if kind == "file" else
              f"error: --workdir {w} holds other files (notes.txt, photos) and no run: pass a new or empty folder")
    assert line.startswith(expect), line
    assert (w.read_text() == "notes" if kind == "file" else sorted(p.name for p in w.iterdir()) == ["notes.txt", "photos"])


def test_a_workdir_of_a_run_or_of_the_launch_scripts_is_accepted(tmp_path):
    for names in ([], ["slurm"], ["train.log", "my_notes.txt"], ["checkpoints"]):
        w = tmp_path / "-".join(names or ["empty"])
        w.mkdir()
        for n in names:
            (w / n).mkdir()
        trainer_workdir.check_workdir(str(w))
    trainer_workdir.check_workdir(str(tmp_path / "new"))
