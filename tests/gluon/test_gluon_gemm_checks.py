"""``llm_speed.gluon.gemm.gemm`` off a GPU: each bad argument refused before any work with a ValueError or
TypeError naming it, the device refused anywhere but a compute capability 9.0 GPU, and under a simulated
H100 the launch it makes (what the kernel report compiles)."""

from __future__ import annotations

import pytest
import torch

from llm_speed.core import runtime
from llm_speed.core.hardware import Hardware
from llm_speed.core.launch import simulated_gpu
from llm_speed.gluon import gemm as gluon_gemm
from llm_speed.gluon import launch as gluon_launch
from llm_speed.kernel_report.capture import stand_in

F16, BF16 = torch.float16, torch.bfloat16


def _t(*shape, dtype=F16):
    return torch.randn(*shape).to(dtype)


BAD = [
    ("not a tensor", lambda: ([[1.0]], _t(8, 8)), {}, TypeError, "a must be a torch.Tensor"),
    ("float32", lambda: (_t(8, 8, dtype=torch.float32), _t(8, 8)), {}, TypeError, "a has dtype torch.float"),
    ("dtypes differ", lambda: (_t(8, 8), _t(8, 8, dtype=BF16)), {}, TypeError, "b has dtype torch.bfloat16"),
    ("3-D", lambda: (_t(2, 8, 8), _t(8, 8)), {}, ValueError, r"a must have 2 dims \[M, K\]"),
    ("K differs", lambda: (_t(8, 16), _t(8, 8)), {}, ValueError, "b must have K = 16"),
    ("K differs, b^T", lambda: (_t(8, 16), _t(8, 8)), {"trans_b": True}, ValueError, "b must have K = 16"),
    ("strided", lambda: (_t(8, 16)[:, ::2], _t(8, 8)), {}, ValueError, "a must suit a TMA descriptor"),
    ("rows unaligned", lambda: (_t(8, 12), _t(12, 8)), {}, ValueError, "a must suit a TMA descriptor"),
    ("N unaligned", lambda: (_t(8, 8), _t(12, 8)), {"trans_b": True}, ValueError, "N = 12 output columns"),
    ("trans_b not bool", lambda: (_t(8, 8), _t(8, 8)), {"trans_b": 1}, TypeError, "trans_b must be a bool"),
]


@pytest.mark.parametrize(("case", "make", "options", "error", "message"), BAD, ids=[c[0] for c in BAD])
def test_bad_arguments_are_refused_by_name(case, make, options, error, message):
    a, b = make()
    with simulated_gpu(), pytest.raises(error, match=message):
        gluon_gemm.gemm(a, b, **options)


def test_only_a_compute_capability_9_gpu_runs_it():
    a, b = _t(16, 8), _t(8, 16)
    with pytest.raises(ValueError, match=r"a is on cpu: llm_speed.gluon.gemm runs on CUDA devices of "):
        gluon_gemm.gemm(a, b)
    for gpu, capability in (("b200", "10.0"), ("a100-sxm-80gb", "8.0")):
        with simulated_gpu(), stand_in(Hardware.from_spec(gpu)):
            with pytest.raises(ValueError, match=f"compute capability {capability}: .* 9.0 only"):
                gluon_gemm.gemm(a, b)


@pytest.mark.parametrize("trans_b", [False, True])
def test_a_simulated_h100_launch_is_the_plan(trans_b):
    seen = []
    remove = gluon_launch.add_observer(lambda plan, per_call: seen.append((plan, per_call)))
    a = _t(1000, 512, dtype=BF16)
    b = _t(4096, 512, dtype=BF16) if trans_b else _t(512, 4096, dtype=BF16)
    before = runtime.launch_count("gluon_gemm")
    try:
        with simulated_gpu():
            out = gluon_gemm.gemm(a, b, trans_b=trans_b)
    finally:
        remove()
    assert out.shape == (1000, 4096) and out.dtype == BF16
    assert runtime.launch_count("gluon_gemm") == before + 1
    ((plan, per_call),) = seen
    assert plan.grid == (128, 1, 1)  # 8 x 16 tiles over the H100's 132 SMs: one program per tile
    assert {k: plan.fixed[k] for k in ("M", "N", "K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "TRANS_B")} == dict(
        M=1000, N=4096, K=512, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, TRANS_B=trans_b
    )
    assert per_call["a_desc"] is a and per_call["b_desc"] is b and per_call["c_desc"] is out
    descriptors = plan.arguments(per_call)
    assert descriptors["b_desc"].block_shape == ([256, 64] if trans_b else [64, 256])
    assert descriptors["c_desc"].block_shape == [128, 256]


def test_empty_problems_launch_nothing():
    before = runtime.launch_count("gluon_gemm")
    with simulated_gpu():
        assert gluon_gemm.gemm(_t(0, 8), _t(8, 16)).shape == (0, 16)
        zero = gluon_gemm.gemm(_t(4, 0), _t(0, 16))
    assert zero.shape == (4, 16) and not zero.any()
    assert runtime.launch_count("gluon_gemm") == before


def test_shared_memory_picks_the_ring_depth():
    h100 = Hardware.from_spec("h100-sxm")
    assert gluon_gemm.gemm_config(4096, h100).num_stages == 3  # 3 x 48 KiB + 64 KiB of output tile
    assert gluon_gemm.gemm_config(128, h100).num_stages == 4
    small = Hardware("small", (9, 0), 100 * 1024, 1)
    with pytest.raises(ValueError, match="do not hold two 128x256x64 ring slots"):
        gluon_gemm.gemm_config(4096, small)
    assert [gluon_gemm.instruction_n(n) for n in (256, 128, 192, 8)] == [256, 128, 192, 8]


def test_the_output_comes_from_new_output(nan_poisoned):
    # the GPU test's NaN poisoning reaches this op's output (an element the kernel does not write fails there)
    with simulated_gpu():
        out = gluon_gemm.gemm(_t(16, 8), _t(8, 16))
    assert out.isnan().all()
