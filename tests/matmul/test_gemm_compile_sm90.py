"""Ahead-of-time compilation of the GEMM kernels for Hopper (sm90), no GPU needed.

The interpreter never compiles; this checks that the GPU machine's Triton (3.6) turns every configuration an
H100 gets (``tiled_configs`` / ``persistent_tma_configs`` of its table entry) into real Hopper code: wgmma
tensor-core instructions (fp16, bf16, int8 with int32 accumulation, fp32 with TF32; mma.sync for two-warp
tiles, under a warpgroup), a cp.async software pipeline (tiled kernel), TMA bulk-tensor loads (persistent
kernel), and shared memory at least the pipelined tiles' estimate and within the chip's 227 KB per block. The
operand dtypes rotate over the configurations; every configuration ``gemm_config`` can choose for fp32
operands (full-precision "ieee" dots, PyTorch's default) is compiled too, since fp32 doubles the tiles'
bytes. What is compiled is what a launch runs: the plan ``planned_launch`` makes for the configuration
(its constexprs, fixed integers and launch options), with Triton's argument specialisation (integers equal
to 1 become constants, integers and pointers divisible by 16 are marked so). Runs in a subprocess because
the test session's kernels are interpreted.
"""

import json
import subprocess
import sys

import pytest
import torch

from llm_speed.core.hardware import Hardware
from llm_speed.matmul.gemm_configs import (
    candidate_configs,
    persistent_tma_configs,
    shared_bytes,
    tiled_configs,
)
from triton_builds import BUILDS, environment

pytest.importorskip(
    "triton.backends.nvidia", reason="compiles for sm_90: this Triton build has no NVIDIA backend"
)

H100 = Hardware.from_spec("h100-sxm")

SCRIPT = r"""
import importlib, json
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

gemm_configs = importlib.import_module("llm_speed.matmul.gemm_configs")
gemm_kernels = importlib.import_module("llm_speed.matmul.gemm_kernels")
gemm_launch = importlib.import_module("llm_speed.matmul.gemm_launch")
from llm_speed.core.hardware import Hardware

POINTEE = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.int8: "i8",
           torch.int32: "i32"}


def compile_sm90(plan, per_call):
    fn = plan.kernel.fn
    names = fn.arg_names
    constexpr_params = {names[i] for i in fn.constexprs}
    signature, constexprs, divisible = {}, {}, []
    arguments = plan.arguments(per_call)
    for name in names:
        value = arguments[name]
        if name in constexpr_params:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + POINTEE[value.dtype]
            if value.data_ptr() % 16 == 0:
                divisible.append(name)
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif isinstance(value, int):
            if value == 1:  # Triton specialises an integer argument equal to 1 as a constant
                signature[name], constexprs[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0:
                    divisible.append(name)
        else:  # a host-side tensor descriptor
            block = ", ".join(map(str, value.block_shape))
            signature[name] = f"tensordesc<{POINTEE[value.base.dtype]}[{block}]>"
    index = {name: i for i, name in enumerate(names)}
    source = ASTSource(fn=fn, signature=signature, constexprs={(index[k],): v for k, v in constexprs.items()},
                       attrs={(index[n],): [["tt.divisibility", 16]] for n in divisible})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": plan.num_warps, "num_stages": plan.num_stages})
    ptx = compiled.asm["ptx"]
    return {"wgmma": ptx.count("wgmma.mma_async"), "mma": ptx.count("mma.sync"),
            "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
            "tma": ptx.count("cp.async.bulk.tensor"), "shared": compiled.metadata.shared,
            "scratch": [compiled.metadata.global_scratch_size, compiled.metadata.profile_scratch_size]}


def problem(config, dtype, out_dtype, b_k_major, epilogue):
    # Two tiles each way, four K steps: sizes and row strides divisible by 16, as a model's usually are.
    m, n, k = 2 * config.block_m, 2 * config.block_n, 4 * config.block_k
    a = torch.zeros(m, k, dtype=dtype)
    b = torch.zeros(n, k, dtype=dtype).mT if b_k_major else torch.zeros(k, n, dtype=dtype)
    out = torch.zeros(m, n, dtype=out_dtype)
    kwargs = {}
    if epilogue:
        kwargs = dict(alpha=1.5, beta=0.5, c=torch.zeros(m, n), bias=torch.zeros(n), activation="gelu")
    return a, b, out, kwargs


matmul = torch.backends.cuda.matmul
h100 = Hardware.from_spec("h100-sxm")
# (name, operand, output, TF32, epilogue): the tiled kernel's variants, in rotation.
variants = [("fp16", torch.float16, torch.float16, False, True),
            ("bf16", torch.bfloat16, torch.bfloat16, False, False),
            ("int8", torch.int8, torch.int32, False, False),
            ("tf32", torch.float32, torch.float32, True, True)]
jobs = [("tiled", config, *variants[i % len(variants)], False)
        for i, config in enumerate(gemm_configs.tiled_configs(h100))]
jobs += [("tiled", config, "fp32", torch.float32, torch.float32, False, False, True)
         for config in gemm_configs.candidate_configs("tiled", torch.float32, h100)]
jobs += [("persistent_tma", config, ("fp16", "bf16")[i % 2], (torch.float16, torch.bfloat16)[i % 2],
          (torch.float16, torch.bfloat16)[i % 2], False, True, i % 3 != 1)
         for i, config in enumerate(gemm_configs.persistent_tma_configs(h100))]
rows = []
for path, config, name, dtype, out_dtype, tf32, epilogue, b_k_major in jobs:
    matmul.fp32_precision = "tf32" if tf32 else "ieee"
    a, b, out, kwargs = problem(config, dtype, out_dtype, b_k_major and path == "persistent_tma", epilogue)
    plan, per_call = gemm_launch.planned_launch(a, b, out, path=path, config=config, **kwargs)
    assert plan.kernel is (gemm_kernels.PERSISTENT_TMA if path == "persistent_tma" else gemm_kernels.TILED)
    rows.append(dict(compile_sm90(plan, per_call), kernel=path, dtype=name, config=config.name()))
print(json.dumps(rows))
"""
ELEMENT_BYTES = {"fp16": 2, "bf16": 2, "int8": 1, "tf32": 4, "fp32": 4}


# The GPU machine's build only, as the fp8 and decode compile checks: compiling every configuration with the
# dev pin too (which no GPU of ours runs) cost `make test` ~25 s on a cold Triton cache, as CI's is.
@pytest.mark.parametrize("build", BUILDS[1:])
def test_every_h100_config_compiles_to_hopper_code(build):
    env = environment(build, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    fp32 = candidate_configs("tiled", torch.float32, H100)
    shipped = tiled_configs(H100) + fp32 + persistent_tma_configs(H100)
    assert [row["config"] for row in rows] == [config.name() for config in shipped]
    assert {row["dtype"] for row in rows} == {"fp16", "bf16", "int8", "tf32", "fp32"}
    assert 0 < len(fp32) < len(tiled_configs(H100))  # fp32 drops the tiles too big for it, keeps the rest
    for row, config in zip(rows, shipped, strict=True):
        if row["dtype"] == "fp32":  # full-precision fp32 dots run on the FMA units, not the tensor cores
            assert row["wgmma"] == 0 and row["cp_async"] > 0, row
        # a warpgroup (4 warps) issues wgmma; two-warp tiles fall back to mma.sync
        elif config.num_warps >= 4:
            assert row["wgmma"] > 0, row
        else:
            assert row["mma"] > 0, row
        if row["kernel"] == "tiled":
            assert row["cp_async"] > 0, row
        else:
            assert row["tma"] > 0, row
        # wgmma pipelines keep num_stages A/B tile pairs in shared memory (the estimate, exactly: 144 KB for
        # 128x256x64 fp16 at 3 stages); the mma.sync and FMA pipelines one fewer.
        estimate = shared_bytes(config, ELEMENT_BYTES[row["dtype"]])
        if config.num_warps < 4 or row["dtype"] == "fp32":
            estimate = estimate * (config.num_stages - 1) // config.num_stages
        assert estimate <= row["shared"], row
        assert row["shared"] <= H100.smem_per_block_bytes, row
    # Host-side descriptors: the kernels need no global scratch memory, so no triton.set_allocator is needed
    # (device-side tl.make_tensor_descriptor would need one).
    assert all(row["scratch"] == [0, 0] for row in rows), rows
