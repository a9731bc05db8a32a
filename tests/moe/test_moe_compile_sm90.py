"""Ahead-of-time compilation of every MoE kernel for Hopper (sm_90) with the GPU machine's Triton (3.6), no
GPU needed: what the plans of a Qwen3-30B-A3B layer launch on an H100 (their constexprs, fixed integers,
warps and stages) compiles, the 16-bit grouped GEMMs and the backward kernel use wgmma tensor-core
instructions, and every kernel's shared memory fits the H100's 227 KB per block. Runs in a subprocess
(``compile_moe_sm90.py``) because the test session's kernels are interpreted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from triton_builds import BUILDS, environment

pytest.importorskip("triton.backends.nvidia")

SCRIPT = Path(__file__).with_name("compile_moe_sm90.py")
H100_SHARED_PER_BLOCK = 227 * 1024
TENSOR_CORE_KERNELS = ("SwiGLU bf16", "down bf16", "wgrad", "fused_moe backward")


@pytest.mark.parametrize("build", BUILDS[1:])  # the GPU machine's build; compiling with 3.9 adds no signal
def test_every_moe_kernel_compiles_for_sm90(build):
    env = environment(build)
    env.pop("TRITON_INTERPRET", None)
    src = str(Path(__file__).resolve().parents[2] / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), src) if p)
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = {r["name"]: r for r in map(json.loads, done.stdout.splitlines())}
    assert len(results) == 10, sorted(results)
    for name, result in results.items():
        assert result["shared"] <= H100_SHARED_PER_BLOCK, (name, result)
        if any(word in name for word in TENSOR_CORE_KERNELS):
            assert result["wgmma"] > 0, (name, result)
