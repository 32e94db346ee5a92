"""Shared fixtures: the golden reference fixture (tests/data/prolip_reference_tiny.npz)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

# XLA:CPU compiles the suite's programs at LLVM -O0 with its older fusion emitters: most tests
# run a program a few times, so its compile is their cost, and both compile faster
# (docs/performance_history.md, "Test suite time"). A test that runs a program for hundreds of
# steps asks for XLA's defaults back with `jax.jit(..., compiler_options=OPTIMIZED)`; a
# subprocess gets `xla_flags(devices)`.
OPT_LEVEL_FLAG = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
OPTIMIZED = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}  # XLA's defaults
# XLA:CPU ends the process (SIGABRT) when a collective's local participants have not all arrived
# 40 s after the first (its default). The fake devices of one process take turns on 2 cores beside
# the other pytest worker and the trainer subprocesses; on a loaded 2-core CI machine a pytest
# worker died that way in an 8-device MSDA step (tests/test_methods.py), which is slowness, not a
# lost peer: warn after 60 s (the warning names the collective), end the process after 10 minutes.
COLLECTIVE_TIMEOUT_FLAGS = ("--xla_cpu_collective_call_warn_stuck_timeout_seconds=60 "
                            "--xla_cpu_collective_call_terminate_timeout_seconds=600")


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test's subprocess: `devices` fake CPU devices, compiled as the suite is."""
    return f"--xla_force_host_platform_device_count={devices} {OPT_LEVEL_FLAG} {COLLECTIVE_TIMEOUT_FLAGS}"


# Eight fake CPU devices for sharding tests, whoever runs pytest (`make test` drops a caller's own
# XLA_FLAGS first, so these always apply there).
os.environ.setdefault("XLA_FLAGS", xla_flags(8))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Identical programs (a resumed run, a re-created train step) are compiled once per session:
# compilation dominates the run time of these tiny models on CPU.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"prolip_jax_test_cache_{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# `make test` runs two pytest-xdist workers, one test file each at a time (--dist loadfile), in
# collection order: the longest files go first (their order below), so that none of them starts
# last while the other worker has nothing left. A file not named keeps its place after them.
LONGEST_FIRST = ("test_caption_recipes.py", "test_objectives_learn.py", "test_demo.py", "test_faults.py",
                 "test_train_processes.py", "test_step.py", "test_benchmark_gpu.py", "test_train.py",
                 "test_resume_elastic.py", "test_train_finetune.py", "test_scan_layers.py",
                 "test_speed_levers.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


DATA = Path(__file__).parent / "data"
FIXTURE = DATA / "prolip_reference_tiny.npz"


@pytest.fixture(scope="session")
def golden():
    """The reference fixture as a dict of numpy arrays (see data/prolip_reference_tiny.README.md)."""
    with np.load(FIXTURE) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="session")
def golden_config(golden):
    from prolip_jax.core.models import ProLIPConfig

    return ProLIPConfig.from_dict(json.loads(str(golden["config_json"])))


@pytest.fixture(scope="session")
def golden_state_dict(golden):
    return {k[len("sd/"):]: v for k, v in golden.items() if k.startswith("sd/")}


@pytest.fixture(scope="session")
def golden_params(golden_state_dict, golden_config):
    from prolip_jax.core import convert

    return convert.torch_to_flax(golden_state_dict, golden_config)


def max_rel_err(actual, expected) -> float:
    """max |a - e| / max |e|: the tolerance measure used throughout the parity tests."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


class KeyTokenizer:
    """Stand-in tokenizer for pipeline tests: row = [key, 1, 1, 1]; captions start with their
    integer key, so a batch's text tells which records it holds."""
    context_length, vocab_size, pad_id, eos_id = 4, 1 << 30, 1, 1

    def __call__(self, texts):
        out = np.ones((len(texts), 4), np.int32)
        out[:, 0] = [int(t.split()[0]) for t in texts]
        return out


# Tar shards of keyed JPEG records and the same records as ArrayRecord (pipeline and resume tests).
NUM_SHARDS, PER_SHARD = 8, 12
ALL_KEYS = {s * 10_000 + i for s in range(NUM_SHARDS) for i in range(PER_SHARD)}


def make_shard_data(root: Path, width: int, height: int) -> dict[str, str]:
    """{"tar": brace pattern, "array_record": glob} of NUM_SHARDS x PER_SHARD records under root."""
    from input_pipeline import convert_tar, synthetic

    synthetic.make_jpeg_shards(str(root / "tar"), NUM_SHARDS, PER_SHARD, width, height, seed=1)
    convert_tar.convert(str(root / "tar" / "*.tar"), str(root / "ar"), progress=False)
    return {"tar": str(root / "tar" / f"{{00000..{NUM_SHARDS - 1:05d}}}.tar"),
            "array_record": str(root / "ar" / "*.array_record")}


@pytest.fixture(scope="module")
def micro():
    """(the `micro` ProLIP module, random params): unit LayerNorm scales, N(0, 0.2) elsewhere."""
    import jax

    from prolip_jax.core.models import ProLIP, abstract_params, get_config
    cfg = get_config("micro")
    rng = np.random.default_rng(0)

    def draw(path, leaf):
        name = jax.tree_util.keystr(path)
        if "scale" in name and "logit" not in name:
            return np.ones(leaf.shape, leaf.dtype)
        return (rng.normal(size=leaf.shape) * 0.2).astype(leaf.dtype)

    return ProLIP(cfg), jax.tree_util.tree_map_with_path(draw, abstract_params(cfg))
