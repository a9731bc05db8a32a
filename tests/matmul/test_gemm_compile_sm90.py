"""Ahead-of-time compilation of the GEMM kernels for Hopper (sm90), no GPU needed.

The interpreter never compiles; this checks that the installed Triton turns every configuration an H100
gets (``configs.tiled_configs`` / ``persistent_tma_configs`` of its table entry) into real Hopper code:
wgmma tensor-core instructions (fp16, bf16, int8 with int32 accumulation, fp32 with TF32; mma.sync for
two-warp tiles, under a warpgroup), a cp.async software pipeline (tiled kernel), TMA bulk-tensor loads
(persistent kernel), and shared memory at least the pipelined tiles' estimate and within the chip's
227 KB per block. The operand dtypes rotate over the configurations. Runs in a subprocess because the
test session's kernels are interpreted.
"""

import json
import subprocess
import sys

import pytest

from llm_speed.core.hardware import Hardware
from llm_speed.matmul import configs
from triton_builds import BUILDS, environment

pytest.importorskip("triton.backends.nvidia")

H100 = Hardware.from_spec("h100-sxm")

SCRIPT = r"""
import json, sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llm_speed.core.hardware import Hardware
from llm_speed.matmul import configs, kernels

def compile_sm90(fn, types, consts, divisible_by_16, config):
    index = {name: i for i, name in enumerate(fn.arg_names)}
    consts = dict(consts, **config.meta())
    signature = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(index[n],): [["tt.divisibility", 16]] for n in divisible_by_16}
    source = ASTSource(fn=fn, signature=signature, constexprs={(index[k],): v for k, v in consts.items()},
                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps, "num_stages": config.num_stages})
    ptx = compiled.asm["ptx"]
    return {"config": config.name(), "wgmma": ptx.count("wgmma.mma_async"), "mma": ptx.count("mma.sync"),
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "tma": ptx.count("cp.async.bulk.tensor"), "shared": compiled.metadata.shared,
            "scratch": [compiled.metadata.global_scratch_size, compiled.metadata.profile_scratch_size]}

h100 = Hardware.from_spec("h100-sxm")
# Row-major operands: the unit strides are specialised to 1, the others known divisible by 16, as Triton's
# launcher does for real tensors.
aligned = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "out_ptr", "M", "N", "K", "stride_ab", "stride_am",
           "stride_bb", "stride_bk", "stride_cb", "stride_cm", "stride_ob", "stride_om"]
units = dict(stride_ak=1, stride_bn=1, stride_cn=1, stride_on=1, DOT_IN_FP32=False, RNE_BY_HAND=False)
# (name, operand, output, accumulator, precision, epilogue): the tiled kernel's variants, in rotation.
variants = [("fp16", "*fp16", "*fp16", tl.float32, "ieee", True),
            ("bf16", "*bf16", "*bf16", tl.float32, "ieee", False),
            ("int8", "*i8", "*i32", tl.int32, "ieee", False),
            ("tf32", "*fp32", "*fp32", tl.float32, "tf32", True)]
rows = []
for i, config in enumerate(configs.tiled_configs(h100)):
    name, operand, output, acc, precision, epilogue = variants[i % len(variants)]
    types = dict(a_ptr=operand, b_ptr=operand, c_ptr="*fp32", bias_ptr="*fp32", out_ptr=output,
                 alpha="fp32", beta="fp32")
    consts = dict(units, HAS_C=epilogue, HAS_BIAS=epilogue, ACTIVATION="gelu" if epilogue else None,
                  ACC_DTYPE=acc, INPUT_PRECISION=precision)
    rows.append(dict(compile_sm90(kernels.gemm_tiled_kernel, types, consts, aligned, config),
                     kernel="tiled", dtype=name))
for i, config in enumerate(configs.persistent_tma_configs(h100)):
    element, b_k_major = ("fp16", "bf16")[i % 2], i % 3 != 1
    b_block = [config.block_n, config.block_k] if b_k_major else [config.block_k, config.block_n]
    types = dict(a_desc=f"tensordesc<{element}[{config.block_m}, {config.block_k}]>",
                 b_desc=f"tensordesc<{element}[{b_block[0]}, {b_block[1]}]>", c_ptr="*fp32",
                 bias_ptr="*fp32", out_ptr=f"*{element}", alpha="fp32", beta="fp32")
    consts = dict(HAS_C=True, HAS_BIAS=True, ACTIVATION="gelu_tanh", DOT_IN_FP32=False, RNE_BY_HAND=False,
                  B_K_MAJOR=b_k_major,
                  NUM_PROGRAMS=h100.sm_count)
    rows.append(dict(compile_sm90(kernels.gemm_persistent_tma_kernel, types, consts,
                                  ["c_ptr", "bias_ptr", "out_ptr", "stride_cm", "stride_om"], config),
                     kernel="persistent_tma", dtype=element))
print(json.dumps(rows))
"""
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "int8": 1, "tf32": 4}


@pytest.mark.parametrize("build", BUILDS)
def test_every_h100_config_compiles_to_hopper_code(build):
    env = environment(build, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    shipped = configs.tiled_configs(H100) + configs.persistent_tma_configs(H100)
    assert [row["config"] for row in rows] == [config.name() for config in shipped]
    assert {row["dtype"] for row in rows} == {"fp16", "bf16", "int8", "tf32"}
    for row, config in zip(rows, shipped, strict=True):
        # a warpgroup (4 warps) issues wgmma; two-warp tiles fall back to mma.sync
        assert (row["wgmma"] > 0) if config.num_warps >= 4 else (row["mma"] > 0), row
        if row["kernel"] == "tiled":
            assert row["cp_async"] > 0, row
        else:
            assert row["tma"] > 0, row
        # wgmma pipelines keep num_stages A/B tile pairs in shared memory (the estimate, exactly: 144 KB for
        # 128x256x64 fp16 at 3 stages); the mma.sync pipeline one fewer.
        estimate = configs.shared_bytes(config, ELEMENT_BYTES[row["dtype"]])
        if config.num_warps < 4:
            estimate = estimate * (config.num_stages - 1) // config.num_stages
        assert estimate <= row["shared"], row
        assert row["shared"] <= H100.smem_per_block_bytes, row
    # Host-side descriptors: the kernels need no global scratch memory, so no triton.set_allocator is needed
    # (device-side tl.make_tensor_descriptor would need one).
    assert all(row["scratch"] == [0, 0] for row in rows), rows
