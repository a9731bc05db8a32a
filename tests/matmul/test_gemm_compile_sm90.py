"""Ahead-of-time compilation of the GEMM kernels for Hopper (sm90), no GPU needed.

The interpreter never compiles; this checks that the installed Triton turns both kernels into real Hopper
code: wgmma tensor-core instructions (fp16, int8 with int32 accumulation, fp32 with TF32), a cp.async
software pipeline sized by num_stages (tiled kernel), and TMA bulk-tensor loads (persistent kernel). Runs
in a subprocess because the test session's kernels are interpreted.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.backends.nvidia")

SCRIPT = r"""
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llm_speed.matmul import kernels

def compile_sm90(fn, types, consts, divisible_by_16, num_warps, num_stages):
    index = {name: i for i, name in enumerate(fn.arg_names)}
    signature = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(index[n],): [["tt.divisibility", 16]] for n in divisible_by_16}
    source = ASTSource(fn=fn, signature=signature, constexprs={(index[k],): v for k, v in consts.items()},
                       attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    ptx = compiled.asm["ptx"]
    return {"wgmma": ptx.count("wgmma.mma_async"),
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "tma": ptx.count("cp.async.bulk.tensor"), "shared": compiled.metadata.shared,
            "scratch": [compiled.metadata.global_scratch_size, compiled.metadata.profile_scratch_size]}

tiled_types = dict(a_ptr="*fp16", b_ptr="*fp16", c_ptr="*fp32", bias_ptr="*fp32", out_ptr="*fp16",
                   alpha="fp32", beta="fp32")
epilogue = dict(HAS_C=True, HAS_BIAS=True, ACTIVATION="gelu", DOT_IN_FP32=False, RNE_BY_HAND=False,
                BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8)
# Row-major operands: the unit strides are specialised to 1, the others known divisible by 16, as Triton's
# launcher does for real tensors.
tiled = dict(epilogue, ACC_DTYPE=tl.float32, INPUT_PRECISION="ieee", stride_ak=1, stride_bn=1, stride_cn=1,
             stride_on=1)
aligned = ["a_ptr", "b_ptr", "c_ptr", "bias_ptr", "out_ptr", "M", "N", "K", "stride_ab", "stride_am",
           "stride_bb", "stride_bk", "stride_cb", "stride_cm", "stride_ob", "stride_om"]
result = {"tiled": compile_sm90(kernels.gemm_tiled_kernel, tiled_types, tiled, aligned, 8, 3)}
# int8 with int32 accumulation, and fp32 with TF32 allowed: both must reach the tensor cores too.
plain = dict(tiled, HAS_C=False, HAS_BIAS=False, ACTIVATION=None)
for name, operand, output, acc, precision in (("int8", "*i8", "*i32", tl.int32, "ieee"),
                                              ("tf32", "*fp32", "*fp32", tl.float32, "tf32")):
    types = dict(tiled_types, a_ptr=operand, b_ptr=operand, out_ptr=output)
    consts = dict(plain, ACC_DTYPE=acc, INPUT_PRECISION=precision)
    result[name] = compile_sm90(kernels.gemm_tiled_kernel, types, consts, aligned, 8, 3)
tma_types = dict(a_desc="tensordesc<fp16[128, 64]>", b_desc="tensordesc<fp16[128, 64]>", c_ptr="*fp32",
                 bias_ptr="*fp32", out_ptr="*fp16", alpha="fp32", beta="fp32")
tma = dict(epilogue, B_K_MAJOR=True, NUM_PROGRAMS=132)
result["tma"] = compile_sm90(kernels.gemm_persistent_tma_kernel, tma_types, tma,
                             ["c_ptr", "bias_ptr", "out_ptr", "stride_cm", "stride_om"], 8, 3)
print(json.dumps(result))
"""


def test_kernels_compile_to_hopper_code():
    env = dict(os.environ, TRITON_INTERPRET="0")
    command = [sys.executable, "-c", SCRIPT]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    tiled, tma = result["tiled"], result["tma"]
    assert tiled["wgmma"] > 0 and tiled["cp_async"] > 0, tiled
    # 3 pipeline stages of a 128x64 A tile and a 64x128 B tile in fp16
    assert tiled["shared"] >= 3 * (128 * 64 + 64 * 128) * 2, tiled
    assert tma["wgmma"] > 0 and tma["tma"] > 0, tma
    assert result["int8"]["wgmma"] > 0 and result["tf32"]["wgmma"] > 0, result
    # Host-side descriptors: the kernels need no global scratch memory, so no triton.set_allocator is needed
    # (device-side tl.make_tensor_descriptor would need one).
    assert all(compiled["scratch"] == [0, 0] for compiled in result.values()), result
