"""Ahead-of-time compilation of the fp8 kernels for Hopper (sm_90a), no GPU needed.

Every configuration :func:`llm_speed.matmul.fp8.gemm_fp8_config` can choose on an H100 is compiled as a launch
makes it (the plan ``planned_gemm`` builds, replayed through Triton's launch path by the kernel report's
:mod:`llm_speed.kernel_report.build`): block scaling on each
configuration it may take, tensor and row scaling rotating over all of them (e5m2 and bf16 bias in turn).
Checked: fp8 wgmma in the PTX and QGMMA (Hopper's fp8 warpgroup MMA) in the SASS, no local memory (a zero
stack: nothing spilled), registers within 255, shared memory within the 227 KB per block; the quantize and
amax kernels too (no MMA there). Runs in a subprocess because the test session's kernels are interpreted.
"""

import json
import subprocess
import sys

import pytest

from llm_speed.core.hardware import Hardware
from llm_speed.matmul.fp8 import BLOCKWISE, GEMM_CONFIGS, candidate_gemm_configs
from triton_builds import BUILDS, environment

pytest.importorskip(
    "triton.backends.nvidia", reason="compiles for sm_90: this Triton build has no NVIDIA backend"
)

H100 = Hardware.from_spec("h100-sxm")

SCRIPT = r"""
import importlib, json, re
import torch

fp8 = importlib.import_module("llm_speed.matmul.fp8")
from llm_speed.core.hardware import Hardware
from llm_speed.kernel_report import build
from llm_speed.kernel_report.capture import Launch

TARGET = build.target_of("h100-sxm")


compiled = []  # (compiled kernel, ptxas log, plan, row fields); their SASS read in one run at the end


def compile_sm90(plan, per_call, **fields):
    # The kernel report's path: the launch replayed through Triton up to its compile, then read.
    with build.stand_in_driver(TARGET):
        made = build.specialise(Launch("fp8", "", plan, per_call))
    kernel, log, _ = build.compile_build(made)
    compiled.append((kernel, log, plan, fields))


E4, E5 = torch.float8_e4m3fn, torch.float8_e5m2
h100 = Hardware.from_spec("h100-sxm")
jobs = [(config, ("tensor", "row")[i % 2], i) for i, config in enumerate(fp8.GEMM_CONFIGS)]
jobs += [(config, "block", i) for i, config in enumerate(fp8.candidate_gemm_configs(fp8.BLOCKWISE, h100))]
for config, scaling, i in jobs:
    m, n, k = 2 * config.block_m, 2 * config.block_n, 4 * config.block_k
    a = torch.zeros(m, k, dtype=E4)
    w = torch.zeros(n, k, dtype=E5 if i % 3 == 1 else E4)
    if scaling == "tensor":
        sa, sb = torch.ones(()), torch.ones(())
    elif scaling == "row":
        sa, sb = torch.ones(m, 1), torch.ones(n, 1)
    else:
        sa, sb = torch.ones(m, k // 128), torch.ones(n // 128, k // 128)
    bias = torch.zeros(n, dtype=torch.bfloat16) if i % 2 else None
    out = torch.zeros(m, n, dtype=torch.bfloat16)
    plan = fp8.planned_gemm(a, w, sa, sb, bias, torch.bfloat16, True, config=config)
    assert plan.fixed["SCALING"] == ("tensor", "row", "block").index(scaling)
    per_call = dict(a_ptr=a, b_ptr=w, sa_ptr=sa, sb_ptr=sb, bias_ptr=out if bias is None else bias,
                    out_ptr=out)
    compile_sm90(plan, per_call, kernel="gemm", scaling=scaling, config=config.name())
size = 4096
x = torch.zeros(size, size, dtype=torch.bfloat16)
for name in ("tensor", "row", "1x128", "128x128"):
    plans = fp8._quantize_plans(size, size, x.stride(), x.dtype, E4, name, torch.device("cpu"))
    q = torch.zeros(size, size, dtype=E4)
    scale, partials = torch.zeros(fp8.scale_shape(size, size, name)), torch.zeros(plans.partials)
    per_call = dict(x_ptr=x, q_ptr=q, scale_ptr=scale, partial_ptr=partials)
    compile_sm90(plans.quantize, per_call, kernel="quantize", scaling=name, config="")
    if plans.amax is not None:
        compile_sm90(plans.amax, dict(x_ptr=x, partial_ptr=partials), kernel="amax", scaling=name, config="")
disassembled = build.disassemble_all([kernel.asm["cubin"] for kernel, *_ in compiled], TARGET.arch)
rows = []
for (kernel, log, plan, fields), (sass, usage) in zip(compiled, disassembled, strict=True):
    row = build.analyse(kernel, log, sass, usage, TARGET, plan)
    wgmma_fp8 = len(re.findall(r"wgmma\.mma_async\S*\.(e4m3|e5m2)", kernel.asm["ptx"]))
    rows.append(dict(fields, wgmma_fp8=wgmma_fp8, tensor_cores=row["tensor_cores"], regs=row["registers"],
                     local=row["spill_instructions"], stack=row["stack_bytes"], shared=row["shared_bytes"]))
print(json.dumps(rows))
"""


@pytest.mark.parametrize("build", BUILDS[1:])  # the GPU machine's Triton 3.6 (the installed one compiles too)
def test_fp8_kernels_compile_to_qgmma_without_spills(build):
    env = environment(build, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    block = candidate_gemm_configs(BLOCKWISE, H100)
    gemms = [row for row in rows if row["kernel"] == "gemm"]
    assert len(gemms) == len(GEMM_CONFIGS) + len(block)
    assert 0 < len(block) < len(GEMM_CONFIGS)  # block scaling drops the tiles that would spill
    for row in gemms:
        assert row["wgmma_fp8"] > 0 and row["tensor_cores"] == "QGMMA", row  # fp8 warpgroup MMA only
    for row in rows:
        assert row["stack"] == 0 and row["local"] == 0, row  # nothing spilled to local memory
        assert row["regs"] <= 255 and row["shared"] <= H100.smem_per_block_bytes, row
