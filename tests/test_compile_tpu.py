"""benchmarks/compile_tpu.py: the real train step compiled ahead of time for a TPU topology on CPU.

Needs libtpu (`pip install -e '.[tpu]'`), the TPU compiler; skipped without it (CI has none).
One compile of the tiny config for v4-8 (4 chips): ~25 CPU s, about a minute on a busy 2-core machine.
"""
from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("_compile_tpu", ROOT / "benchmarks" / "compile_tpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


ct = _load_script()
needs_libtpu = pytest.mark.skipif(
    not ct.libtpu_available(),
    reason="libtpu is not installed (the TPU compiler for ahead-of-time compilation on CPU; "
           "pip install -e '.[tpu]')")


def test_topology_names():
    t = ct.parse_topology("v4-256")
    assert (t.chips, t.libtpu_name, t.wrap) == (128, "v4:4x4x8", (True, True, True))
    t = ct.parse_topology("v5e-256")
    assert (t.chips, t.libtpu_name, t.wrap) == (256, "v5e:16x16", (True, True, False))
    assert ct.parse_topology("v5p-128").chips == 64
    with pytest.raises(ValueError, match="unknown TPU topology 'v4-6'.*valid names: .*v4-8.*v5p-128.*v5e-256"):
        ct.parse_topology("v4-6")


def test_depth_extrapolation_is_linear_in_both_towers():
    assert ct.shallow_depths(12, 12) == [(4, 4), (8, 8)]
    assert ct.shallow_depths(32, 24) == [(4, 3), (8, 6)]  # H/14: the towers' proportion kept
    assert ct.shallow_depths(2, 2) is None  # tiny: compiled as it is
    keys = (*ct.MEMORY_KEYS, "compiled_flops_per_chip", "hbm_bytes_per_chip", "dcn_bytes_per_slice")
    shallow = [{k: 10.0 + 4 * i for k in keys} for i in (1, 2)]  # 14 at 4 blocks, 18 at 8
    out = ct.extrapolate(shallow, [(4, 4), (8, 8)], (12, 12), hbm_gib=1.0)
    assert out["total_bytes"] == 22.0 and out["compiled_flops_per_chip"] == 22.0 and out["fits"]


def test_multislice_topologies_and_the_step_estimate():
    t = ct.parse_topology("2xv5p-128")
    assert (t.slices, t.chips, t.total_chips, t.shape) == (2, 64, 128, "4x4x4")
    with pytest.raises(ValueError, match="Nx prefix"):
        ct.parse_topology("0xv5p-128")
    # v5p: 459 TFLOP/s, 2765 GB/s, DCN 50 Gbit/s a chip (6.25 GB/s; 400 GB/s for 64 chips).
    r = {"compiled_flops_per_chip": 459e12 * 0.5, "hbm_bytes_per_chip": 2765e9 * 0.2, "dcn_bytes_per_slice": 400e9 * 0.1,
         "model_flops_per_chip": 459e12 * 0.5}
    e = ct.estimate_step(r, t)
    assert e["compute_s"] == pytest.approx(0.5) and e["memory_s"] == pytest.approx(0.2)
    assert e["dcn_s"] == pytest.approx(0.1) and e["step_s"] == pytest.approx(0.6)
    # Scanned towers: XLA counts the loop body once; the model's FLOPs, bytes scaled alike.
    e = ct.estimate_step({**r, "scan_layers": True, "compiled_flops_per_chip": 459e12 * 0.05}, t)
    assert e["compute_s"] == pytest.approx(0.5) and e["memory_s"] == pytest.approx(2.0)
    # ... plus what the remat policy computes again (flops.recompute_flops), bytes scaled alike.
    e = ct.estimate_step({**r, "scan_layers": True, "compiled_flops_per_chip": 459e12 * 0.05,
                          "recompute_flops_per_chip": 459e12 * 0.1}, t)
    assert e["compute_s"] == pytest.approx(0.6) and e["memory_s"] == pytest.approx(2.4)
    cfg = ct.load_config(str(ROOT / "configs" / "tiny.py"), [])
    assert tuple(ct.for_topology(cfg, t).mesh.dcn_shape) == (2, 1, 1) and not cfg.mesh.get("dcn_shape")


def _error(capsys, *argv: str) -> str:
    """main(argv)'s one-line error (exit status 2)."""
    assert ct.main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_command_line_errors(capsys, monkeypatch):
    """Names, variants and overrides are checked before libtpu is needed (CI has none)."""
    tiny = str(ROOT / "configs" / "tiny.py")
    assert "unknown TPU topology 'v9-8'; valid names: v4-8," in _error(capsys, "--topology", "v9-8", "--config", tiny)
    assert "variant must be one of" in _error(capsys, "--topology", "v4-8", "--config", f"{ct.PAPER_CONFIG}:variant=X/9")
    assert "did you mean config.model.remat?" in _error(capsys, "--topology", "v4-8", "--config", tiny,
                                                        "--config.model.remt=full")
    assert "batch_size" in _error(capsys, "--topology", "v4-8", "--config", tiny, "--config.batch_size=lots")
    assert "--config.model.remat: expected" in _error(capsys, "--topology", "v4-8", "--config", tiny,
                                                      "--config.model.remat")
    assert "unknown argument(s) ['--fast']" in _error(capsys, "--topology", "v4-8", "--config", tiny, "--fast")
    assert "give --config" in _error(capsys, "--topology", "v4-8")
    monkeypatch.setattr(ct, "libtpu_available", lambda: False)
    assert "pip install -e '.[tpu]'" in _error(capsys, "--topology", "v4-8", "--config", tiny)
    with pytest.raises(RuntimeError, match="libtpu is not installed"):
        ct.topology_devices(ct.parse_topology("v4-8"))


@needs_libtpu
def test_config_that_cannot_run_on_the_topology(capsys):
    """The trainer's own checks, on the topology's mesh, before anything compiles: 66 rows do not
    split over v4-8's 4 chips."""
    err = _error(capsys, "--topology", "v4-8", "--config", str(ROOT / "configs" / "tiny.py"), "--config.batch_size=66")
    assert "global batch 66 is not divisible by the 4 data shards" in err


@needs_libtpu
def test_tiny_train_step_compiles_for_v4_8():
    config = ct.load_config(str(ROOT / "configs" / "tiny.py") + ":data=random", [])
    r = ct.compile_report(config, "v4-8")
    assert (r["chips"], r["device_kind"], r["mesh"]["data"], r["per_chip_batch"]) == (4, "TPU v4", 4, 16)
    # Memory per chip from the compiled TPU program: the state (params + 2 Adam moments, f32,
    # replicated) is an argument, donated, so it is aliased by the new state in the output. TPU
    # layouts pad arrays to (8, 128) tiles: the tiny model's 64-wide ones take up to twice their size.
    state_bytes = 3 * 4 * r["params"]
    assert state_bytes <= r["argument_bytes"] < 2 * state_bytes + (1 << 20)
    assert r["alias_bytes"] >= state_bytes and r["output_bytes"] >= state_bytes
    assert r["temp_bytes"] > 0
    assert r["total_bytes"] == (r["argument_bytes"] + r["temp_bytes"] + r["output_bytes"] - r["alias_bytes"]
                                + r["code_bytes"])
    assert r["fits"] and r["hbm_gib"] == 30.75
    # The compiled program's FLOPs count every op; flops.py counts matmuls only: within 1-1.5x.
    assert 1.0 <= r["flops_ratio"] < 1.5, r["flops_ratio"]
    assert "| tiny | v4-8 (4) | 16 | data4, replicated | 30.75 |" in ct.table([r])


@needs_libtpu
@pytest.mark.parametrize("name", ["v4-8", "v5p-8", "v5e-4", "v6e-4"])
def test_hbm_table_is_what_the_compiler_allows(name):
    """A program over the chip's HBM fails to compile; its message states the HBM XLA may use,
    which must be Generation.hbm_gib (one trivial compile per generation, < 1 s each)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    topo = ct.parse_topology(name)
    devices = ct.topology_devices(topo)
    assert devices[0].device_kind == ct.GENERATIONS[topo.generation].device_kind
    mesh = Mesh(devices, ("d",))
    rows = math.ceil(2 * topo.hbm_gib * (1 << 30) / (4 * 1024))  # twice the HBM per chip, float32
    x = jax.ShapeDtypeStruct((topo.chips, rows, 1024), jnp.float32, sharding=NamedSharding(mesh, P("d")))
    with ct.no_persistent_cache_writes(), pytest.raises(Exception, match=r"exceeds available HBM") as e:
        jax.jit(lambda a: a.sum()).lower(x).compile()
    available = ct._OOM.search(str(e.value))
    assert available and float(available.group(3)) * ct._UNITS[available.group(4)] == topo.hbm_gib * (1 << 30)


def test_both_forms_of_the_tpu_out_of_memory_error():
    """XLA:TPU says a program is too large in two ways; both give the bytes it asked for (an
    H/14 step on a v4-256 gave the second, benchmarks/compile_tpu.py then stopped with a traceback)."""
    over = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
            "Used 61.50G of 30.75G hbm. ... (61.50G) exceeds available HBM (30.75G)")
    assert ct.oom_required_bytes(over) == 61.5 * (1 << 30)
    just_over = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: XLA:TPU compile permanent error. Ran out of memory "
                 "in memory space hbm. Used 30.75G of 30.75G hbm. Exceeded hbm capacity by 2.24M.\n\n"
                 "Total hbm usage >= 32.00G:\n    reserved          1.25G \n    program          30.61G \n")
    assert ct.oom_required_bytes(just_over) == 32.0 * (1 << 30)
    assert ct.oom_required_bytes("INTERNAL: something else") is None
