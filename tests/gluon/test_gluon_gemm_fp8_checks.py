"""``llm_speed.gluon.gemm_fp8.gemm_fp8`` off a GPU: each bad argument refused before any work with a
ValueError or TypeError naming it (and a passing case at each boundary), the device refused anywhere but a
compute capability 9.0 GPU, and under a simulated H100 the launch it makes (what the kernel report
compiles)."""

from __future__ import annotations

import pytest
import torch

from llm_speed.core import runtime
from llm_speed.core.hardware import Hardware
from llm_speed.core.launch import simulated_gpu
from llm_speed.gluon import gemm_fp8 as gluon_fp8
from llm_speed.gluon import launch as gluon_launch
from llm_speed.kernel_report.capture import stand_in

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _args(m=8, n=16, k=32, *, dtype_a=E4M3, dtype_b=E4M3):
    a = torch.randn(m, k).to(dtype_a)
    b = torch.randn(n, k).to(dtype_b)
    groups = -(-k // 128)
    return a, b, torch.rand(m, groups), torch.rand(-(-n // 128), groups)


def _replace(index, value):
    def make():
        args = list(_args())
        args[index] = value(args[index]) if callable(value) else value
        return args

    return make


BAD = [
    ("a not a tensor", _replace(0, [[1.0]]), {}, TypeError, "a must be a torch.Tensor"),
    ("a e5m2", lambda: _args(dtype_a=E5M2), {}, TypeError, "a has dtype torch.float8_e5m2"),
    ("b bf16", _replace(1, lambda b: b.to(torch.bfloat16)), {}, TypeError, "b has dtype torch.bfloat16"),
    ("a 3-D", _replace(0, lambda a: a.reshape(2, 4, 32)), {}, ValueError, r"a must have 2 dims \[M, K\]"),
    ("K differs", _replace(1, torch.zeros(16, 48).to(E4M3)), {}, ValueError,
     r"b must be \[N, K\] with K = 32"),
    ("scale_a shape", _replace(2, torch.rand(8, 2)), {}, ValueError,
     r"scale_a must be \[M, cdiv\(K, 128\)\]"),
    ("scale_a bf16", _replace(2, lambda s: s.bfloat16()), {}, TypeError, "scale_a has dtype torch.bfloat16"),
    ("scale_b transposed", lambda: _args(n=256, k=384)[:3] + (torch.rand(3, 2),), {}, ValueError,
     r"scale_b must be \[cdiv\(N, 128\), cdiv\(K, 128\)\].*\[2, 3\]"),
    ("out fp32", _args, {"out_dtype": torch.float32}, TypeError, "out_dtype must be one of"),
    ("bias length", _args, {"bias": torch.zeros(15)}, ValueError,
     "bias has 15 elements; it must have N = 16"),
    ("bias int", _args, {"bias": torch.zeros(16, dtype=torch.int32)}, TypeError,
     "bias has dtype torch.int32"),
    ("a strided", _replace(0, lambda a: torch.zeros(8, 64).to(E4M3)[:, ::2]), {}, ValueError,
     "a must suit a TMA descriptor"),
    ("K unaligned", lambda: _args(k=24), {}, ValueError, "a must suit a TMA descriptor"),
    ("N unaligned", lambda: _args(n=12), {}, ValueError, "N = 12 output columns must be a multiple of 8"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "make", "options", "error", "message"), BAD, ids=[c[0] for c in BAD])
def test_bad_arguments_are_refused_by_name(case, make, options, error, message):
    args = make()
    seen = []
    remove = gluon_launch.add_observer(lambda plan, per_call: seen.append(plan))
    try:
        with simulated_gpu(), pytest.raises(error, match=message):
            gluon_fp8.gemm_fp8(*args, **options)
    finally:
        remove()
    assert not seen  # refused before any work


def test_the_boundaries_pass():
    # K = 16 (one TMA row of 16 bytes), N = 8, a strided scale_a, a strided fp32 bias
    a, b, s_a, s_b = _args(m=3, n=8, k=16)
    s_a = torch.rand(1, 3).T
    with simulated_gpu():
        out = gluon_fp8.gemm_fp8(a, b, s_a, s_b, out_dtype=torch.float16, bias=torch.zeros(8, 2)[:, 0])
    assert out.shape == (3, 8) and out.dtype == torch.float16


def test_only_a_compute_capability_9_gpu_runs_it():
    with pytest.raises(ValueError, match=r"a is on cpu: llm_speed.gluon.gemm_fp8 runs on CUDA devices of "):
        gluon_fp8.gemm_fp8(*_args())
    for gpu, capability in (("b200", "10.0"), ("a100-sxm-80gb", "8.0")):
        with simulated_gpu(), stand_in(Hardware.from_spec(gpu)):
            with pytest.raises(ValueError, match=f"compute capability {capability}: .* 9.0 only"):
                gluon_fp8.gemm_fp8(*_args())


@pytest.mark.parametrize("bias", [False, True])
def test_a_simulated_h100_launch_is_the_plan(bias):
    seen = []
    remove = gluon_launch.add_observer(lambda plan, per_call: seen.append((plan, per_call)))
    a, b, s_a, s_b = _args(1000, 4096, 512)
    bias_t = torch.zeros(4096, dtype=torch.bfloat16) if bias else None
    before = runtime.launch_count("gluon_gemm_fp8")
    try:
        with simulated_gpu():
            out = gluon_fp8.gemm_fp8(a, b, s_a, s_b, bias=bias_t)
    finally:
        remove()
    assert out.shape == (1000, 4096) and out.dtype == torch.bfloat16
    assert runtime.launch_count("gluon_gemm_fp8") == before + 1
    ((plan, per_call),) = seen
    assert plan.grid == (132, 1, 1)  # 8 x 32 tiles: one program per SM, persistent
    names = ("M", "N", "K", "BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "HAS_BIAS")
    assert [plan.fixed[k] for k in names] == [1000, 4096, 512, 128, 128, 128, 6, bias]
    assert (plan.fixed["stride_sam"], plan.fixed["stride_sak"]) == (4, 1)
    assert (plan.fixed["stride_sbn"], plan.fixed["stride_sbk"]) == (4, 1)
    assert per_call["a_desc"] is a and per_call["b_desc"] is b and per_call["c_desc"] is out
    assert per_call["sa_ptr"] is s_a and per_call["sb_ptr"] is s_b
    assert per_call["bias_ptr"] is (bias_t if bias else out)
    descriptors = plan.arguments(per_call)
    assert descriptors["a_desc"].block_shape == descriptors["b_desc"].block_shape == [128, 128]
    assert descriptors["c_desc"].block_shape == [64, 128]  # each consumer warpgroup stores its rows
    assert plan.num_warps == 4  # the default partition: one consumer warpgroup


def test_empty_problems_launch_nothing():
    before = runtime.launch_count("gluon_gemm_fp8")
    with simulated_gpu():
        assert gluon_fp8.gemm_fp8(*_args(m=0)).shape == (0, 16)
        zero = gluon_fp8.gemm_fp8(*_args(k=0))
        biased = gluon_fp8.gemm_fp8(*_args(k=0), bias=torch.arange(16.0))
    assert zero.shape == (8, 16) and not zero.any()
    assert torch.equal(biased.float(), torch.arange(16.0).expand(8, 16))
    assert runtime.launch_count("gluon_gemm_fp8") == before


def test_shared_memory_picks_the_ring_depth():
    assert gluon_fp8.gemm_fp8_config(Hardware.from_spec("h100-sxm")).num_stages == 6  # 6 x 32 KiB + 32 KiB
    small = Hardware("small", (9, 0), 100 * 1024, 1)
    assert gluon_fp8.gemm_fp8_config(small).num_stages == 2
    with pytest.raises(ValueError, match="do not hold two 128x128x128 fp8 ring slots"):
        gluon_fp8.gemm_fp8_config(Hardware("tiny", (9, 0), 90 * 1024, 1))


def test_the_output_comes_from_new_output(nan_poisoned):
    # the GPU test's NaN poisoning reaches this op's output (an element the kernel does not write fails there)
    with simulated_gpu():
        out = gluon_fp8.gemm_fp8(*_args())
    assert out.isnan().all()


def _block_call(m=256, n=384, k=512, **changes):
    """gemm_fp8's arguments at 1x128 x 128x128 scaling, b [N, K]: the call the candidate policy gives the
    Gluon kernel; ``changes`` replaces some."""
    a, b, s_a, s_b = _args(m, n, k)
    call = dict(a=a, b=b, scale_a=s_a, scale_b=s_b, out_dtype=torch.bfloat16, trans_b=True)
    call.update(changes)
    return call


REFUSED = [
    ("b [K, N]", lambda: _block_call(trans_b=False), "b is [K, N]"),
    ("e5m2", lambda: _block_call(a=torch.zeros(256, 512).to(E5M2)), "e4m3 operands only"),
    ("fp32 out", lambda: _block_call(out_dtype=torch.float32), "bfloat16 or float16 only"),
    ("row scales", lambda: _block_call(scale_a=torch.ones(256, 1), scale_b=torch.ones(384, 1)),
     "not 1x128 x 128x128"),
    ("tensor scales", lambda: _block_call(scale_a=torch.ones(()), scale_b=torch.ones(())),
     "not 1x128 x 128x128"),
    ("a transposed", lambda: _block_call(a=torch.zeros(512, 256).to(E4M3).T), "a is not K-contiguous"),
    ("N ragged", lambda: _block_call(n=380), "N = 380"),
    ("empty", lambda: _block_call(m=0), "an empty problem"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "make", "reason"), REFUSED, ids=[c[0] for c in REFUSED])
def test_the_choice_refuses_what_the_kernel_does_not_take(case, make, reason):
    from llm_speed.core.policy import use_policy
    from llm_speed.gluon.gemm_fp8_select import gluon_gemm_fp8_applies, gluon_gemm_fp8_refusal

    call = make()
    with simulated_gpu(), use_policy("gluon-gemm-fp8"):
        assert reason in (gluon_gemm_fp8_refusal(**call) or "")
        assert not gluon_gemm_fp8_applies(**call)


def test_the_choice_takes_block_scaling_under_the_candidate_only():
    from llm_speed.core.policy import CANDIDATES, SHIPPED, use_policy
    from llm_speed.gluon.gemm_fp8_select import gluon_gemm_fp8_applies, gluon_gemm_fp8_refusal

    call = _block_call(m=1, n=8, k=16)  # one row, one partial group: [1, 1] scales, block or per tensor alike
    candidate = CANDIDATES["gluon-gemm-fp8"]
    assert candidate.target["op"] == "gemm_fp8" and candidate.target["scaling"] == "block"
    with simulated_gpu():
        assert gluon_gemm_fp8_refusal(**call, policy=SHIPPED) == "the policy's gluon_gemm_fp8 is off"
        with use_policy("gluon-gemm-fp8"):
            assert gluon_gemm_fp8_applies(**_block_call()) and gluon_gemm_fp8_applies(**call)
        with use_policy("gluon-gemm-fp8"), stand_in(Hardware.from_spec("b200")):
            assert "compute capability" in gluon_gemm_fp8_refusal(**_block_call())
    with use_policy("gluon-gemm-fp8"):  # a CPU tensor with no simulated GPU
        assert "not CUDA" in gluon_gemm_fp8_refusal(**_block_call())
