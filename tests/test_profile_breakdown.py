"""benchmarks/profile_breakdown.py on a real jax.profiler trace (CPU): the HLO it reads from the
xplane names the JAX operation behind each kernel, with layer indices folded."""
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import profile_breakdown  # noqa: E402


def test_breakdown_names_the_jax_op_of_each_kernel(tmp_path):
    @jax.jit
    def profiled_block(x, w):   # a name no other test's program has: the trace lists them all
        with jax.named_scope("resblocks_3"):
            return jnp.tanh(x @ w).sum()

    f = profiled_block
    x, w = jnp.ones((64, 128)), jnp.ones((128, 128))
    f(x, w).block_until_ready()          # compile outside the trace
    jax.profiler.start_trace(str(tmp_path))
    for _ in range(2):
        f(x, w).block_until_ready()
    jax.profiler.stop_trace()

    r = profile_breakdown.breakdown(tmp_path, steps=2, top=5)
    assert any(m.startswith("jit_profiled_block") for m in r["modules"])
    assert r["device_ms_per_step"] > 0
    assert abs(sum(r["classes_ms_per_step"].values()) - r["device_ms_per_step"]) < 1e-9
    ops = [x["op_name"] for x in r["top_fusions"]]
    assert any("resblocks_N" in op and "jit(profiled_block)" in op for op in ops), ops
    assert all("resblocks_3" not in op for op in ops)
    by_op = r["fusions_by_op"]  # every fusion kernel, summed per op: the total is the class's
    assert abs(sum(x["ms_per_step"] for x in by_op) - r["classes_ms_per_step"]["XLA fusions and other kernels"]) < 1e-6


def test_kernel_names_and_classes():
    insts = {"input_add_fusion.6": {"op_name": "a"}, "wrapped_concatenate": {"op_name": "b"}}
    assert profile_breakdown.instruction_of("input_add_fusion_6", insts)["op_name"] == "a"
    assert profile_breakdown.instruction_of("wrapped_concatenate", insts)["op_name"] == "b"
    assert profile_breakdown.instruction_of("input_add_fusion_7", insts) is None
    assert profile_breakdown.kernel_class("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_TNT") == "GEMM"
    assert profile_breakdown.kernel_class("cudnn_generated_fort_native_sdpa_sm90") == "attention (cuDNN)"
    assert profile_breakdown.kernel_class("memcpy128") == "copies and memsets"
    assert profile_breakdown.fold_layers("visual/resblocks_11/ln_1") == "visual/resblocks_N/ln_1"
    op = "jit(train_step)/transpose(jvp(ProLIP))/ProLIP.encode_image/visual/transformer/resblocks_N/c_fc/reduce_sum"
    assert profile_breakdown.op_group(op) == "backward image c_fc/reduce_sum"
    assert profile_breakdown.op_group("jit(train_step)/reduce_sum") == "step reduce_sum"
