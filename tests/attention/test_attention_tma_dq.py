"""The launch policy's ``backward_tma_dq_add`` (measured slower on an H100, off by default): on Hopper the
default backward takes the five-matmul path with each dQ tile added by one TMA bulk reduction. The plumbing on
the CPU (the plan's descriptor, the path, the interpreter's gradients through the same path with element
atomics), the build for sm_90a under the GPU machine's Triton; the values on a GPU in
test_attention_gpu.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from attention_testing import fresh_plans, make_qkv, record_backward_plans

from llm_speed import flash_attention
from llm_speed.attention import flash
from llm_speed.attention.reference import reference_attention
from llm_speed.core import launch, runtime
from llm_speed.core.hardware import hardware_of
from llm_speed.core.policy import SHIPPED, current_policy
from triton_builds import GPU_BUILD_ENV, environment


def test_it_is_off_by_default_and_hopper_keeps_its_dq_kernel():
    assert SHIPPED.backward_tma_dq_add is False
    # the stand-in hardware: an H100
    assert flash.tier_dq_kernel(flash.tier_for(hardware_of(torch.device("cpu"))), current_policy())
    assert flash.deterministic_backward(False, torch.device("cpu"))


def _dkdv(plans):
    (dkdv,) = [p for p in plans if p.kernel is flash.BACKWARD_DKDV]
    return dkdv


def test_the_atomic_path_plan_takes_the_accumulator_through_a_descriptor(monkeypatch, policy):
    """On the CUDA code path (simulated: the H100's hardware, launches stubbed) the dK/dV plan gets a
    descriptor over the fp32 dQ accumulator's [B * H * S, D] rows, in [BLOCK_M, BLOCK_D] tiles, and each
    launch passes the accumulator through it; a ragged query block keeps the element atomics."""
    fresh_plans(monkeypatch)
    policy(backward_tma_dq_add=True)
    assert not flash.deterministic_backward(False, torch.device("cpu"))
    assert flash.deterministic_backward(True, torch.device("cpu"))  # asked for: still the dQ kernel
    made = record_backward_plans(monkeypatch)
    with launch.simulated_gpu():
        for seq in (128, 100):
            q, k, v = (t.requires_grad_() for t in make_qkv(2, 4, 2, seq, seq, 128, torch.float16, "cpu"))
            flash_attention(q, k, v, is_causal=True).sum().backward()
    with_desc, ragged = (_dkdv(plans) for plans in made)
    layout = with_desc.descriptors["DQ_DESC"]
    assert layout.shape == (2 * 4 * 128, 128) and layout.block_shape == (with_desc.fixed["BLOCK_M"], 128)
    assert with_desc.fixed["ATOMIC_DQ"] and not ragged.descriptors and ragged.fixed["DQ_DESC"] is None


def test_the_interpreter_runs_the_same_path_with_element_atomics(monkeypatch, device, policy):
    """Under the interpreter (no descriptor reduction there) the switch still takes the atomic path on the
    H100's tier, with element atomics; compiled on such a GPU, through the descriptor: gradients as float64
    says."""
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    fresh_plans(monkeypatch)
    policy(backward_tma_dq_add=True)
    made = record_backward_plans(monkeypatch)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 32, 32, 32, torch.float32, device))
    dout = torch.randn_like(q)
    flash_attention(q, k, v, is_causal=True).backward(dout)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference_attention(*leaves, is_causal=True).backward(dout.double())
    for got, truth in zip((q.grad, k.grad, v.grad), leaves, strict=True):
        assert (got.double() - truth.grad).abs().max() < 1e-4
    plan = _dkdv(made[0])
    assert plan.fixed["ATOMIC_DQ"]
    # compiled on a GPU with TMA (whole query blocks): the descriptor reduction itself
    whole_blocks = 32 % plan.fixed["BLOCK_M"] == 0
    by_descriptor = not runtime.INTERPRETED and hardware_of(device).has_tma and whole_blocks
    assert ("DQ_DESC" in plan.descriptors) == by_descriptor
    assert by_descriptor or plan.fixed["DQ_DESC"] is None


COMPILE_SCRIPT = r"""
import json, sys
from llm_speed.core.policy import use_policy
from llm_speed.kernel_report import worker
with use_policy(backward_tma_dq_add=True):
    worker.run({"gpu": "h100-sxm", "ops": ["flash_attention_backward"], "shard": 0, "shards": 1,
                "options": {"head_dims": [128], "backward": ["default"], "seq": 4096}}, sys.stdout)
"""


def test_it_builds_for_sm90a_with_one_bulk_reduction_per_tile(tmp_path):
    """Compiled by the GPU machine's Triton as launched: the dK/dV kernels (causal and not) hold a TMA bulk
    reduction (UTMAREDG) and the shared memory fits the H100's per-block limit."""
    env = environment(GPU_BUILD_ENV, TRITON_CACHE_DIR=str(tmp_path), TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env,
                          timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"index"')]
    dkdv = [row for row in rows if row["kernel"] == "flash_attention_bwd_dkdv" and not row["error"]]
    assert len(dkdv) >= 2 and all(row["constexprs"]["ATOMIC_DQ"] for row in dkdv), rows
    assert all(row["tma"] and row["shared_bytes"] <= row["shared_limit"] for row in dkdv), dkdv
