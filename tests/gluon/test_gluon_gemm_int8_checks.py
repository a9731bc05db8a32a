"""``llm_speed.gluon.gemm.gemm_int8`` off a GPU: each bad argument refused before any work with a ValueError
or TypeError naming it, the device refused anywhere but a compute capability 9.0 GPU, under a simulated H100
the launch it makes (what the kernel report compiles); and ``tensor_core_gemm_int8``'s choice of it: only
under the candidate ``gluon-gemm-int8``, only for the calls it takes, never through a kept Triton call."""

from __future__ import annotations

import pytest
import torch

from llm_speed.core import runtime
from llm_speed.core.hardware import Hardware
from llm_speed.core.launch import simulated_gpu
from llm_speed.core.policy import CANDIDATES, SHIPPED, use_policy
from llm_speed.gluon import gemm as gluon_gemm
from llm_speed.gluon import launch as gluon_launch
from llm_speed.gluon.gemm_int8_select import gluon_gemm_int8_applies, gluon_gemm_int8_refusal
from llm_speed.kernel_report.capture import stand_in
from llm_speed.matmul import gemm_kernels
from llm_speed.matmul.gemm import tensor_core_gemm_int8

pytest.importorskip("triton.experimental.gluon", reason="this Triton has no Gluon")

I8 = torch.int8
GLUON = gluon_gemm.GEMM.name
TRITON = gemm_kernels.TILED.name


def _i(*shape, dtype=I8):
    return torch.randint(-128, 128, shape).to(dtype)


BAD = [
    ("not a tensor", lambda: ([[1]], _i(16, 16)), TypeError, "a must be a torch.Tensor"),
    ("fp16", lambda: (_i(16, 16, dtype=torch.float16), _i(16, 16)), TypeError, "a has dtype torch.float16"),
    ("uint8", lambda: (_i(16, 16), _i(16, 16, dtype=torch.uint8)), TypeError, "b has dtype torch.uint8"),
    ("3-D", lambda: (_i(2, 16, 16), _i(16, 16)), ValueError, r"a must have 2 dims \[M, K\]"),
    ("K differs", lambda: (_i(8, 32), _i(8, 16)), ValueError, "b must have K = 32"),
    ("rows unaligned", lambda: (_i(8, 24), _i(8, 24)), ValueError,
     r"a must suit a TMA descriptor: .*rows a multiple of 16 elements apart"),
    ("b transposed", lambda: (_i(8, 16), _i(16, 8).T), ValueError, "b must suit a TMA descriptor"),
    ("N unaligned", lambda: (_i(8, 16), _i(6, 16)), ValueError,
     "N = 6 output columns must be a multiple of 4"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "make", "error", "message"), BAD, ids=[c[0] for c in BAD])
def test_bad_arguments_are_refused_by_name(case, make, error, message):
    a, b = make()
    before = runtime.launch_count(GLUON)
    with simulated_gpu(), pytest.raises(error, match=message):
        gluon_gemm.gemm_int8(a, b)
    assert runtime.launch_count(GLUON) == before


def test_only_a_compute_capability_9_gpu_runs_it():
    a, b = _i(16, 16), _i(16, 16)
    with pytest.raises(ValueError, match=r"a is on cpu: llm_speed.gluon.gemm.gemm_int8 runs on CUDA devices"):
        gluon_gemm.gemm_int8(a, b)
    with simulated_gpu(), stand_in(Hardware.from_spec("a100-sxm-80gb")):
        with pytest.raises(ValueError, match="compute capability 8.0: .* 9.0 only"):
            gluon_gemm.gemm_int8(a, b)


def test_a_simulated_h100_launch_is_the_plan():
    seen = []
    remove = gluon_launch.add_observer(lambda plan, per_call: seen.append((plan, per_call)))
    a, b = _i(1000, 512), _i(4096, 512)
    try:
        with simulated_gpu():
            out = gluon_gemm.gemm_int8(a, b)
            assert gluon_gemm.gemm_int8(_i(0, 16), _i(8, 16)).shape == (0, 8)  # empty: no launch
            zero = gluon_gemm.gemm_int8(_i(4, 0), _i(8, 0))
    finally:
        remove()
    assert out.shape == (1000, 4096) and out.dtype == torch.int32
    assert zero.dtype == torch.int32 and not zero.any()
    ((plan, per_call),) = seen
    assert plan.grid == (132, 1, 1)  # 8 x 32 tiles of 128 x 128 over the H100's 132 SMs
    fixed = {k: plan.fixed[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "STAGES", "TRANS_B", "ACC_INT32")}
    assert fixed == dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, STAGES=4, TRANS_B=True, ACC_INT32=True)
    descriptors = plan.arguments(per_call)
    assert descriptors["b_desc"].block_shape == [128, 128] and descriptors["c_desc"].base is out
    # the 16-bit plan is unchanged: 128 x 256 x 64 over three slots, fp32 accumulation
    half = gluon_gemm._plan(1000, 4096, 512, torch.bfloat16, True, Hardware.from_spec("h100-sxm"))
    assert (half.fixed["BLOCK_N"], half.fixed["BLOCK_K"], half.fixed["STAGES"], half.fixed["ACC_INT32"]) == (
        256, 64, 3, False)


def test_shared_memory_picks_the_int8_tile():
    h100 = Hardware.from_spec("h100-sxm")
    config = gluon_gemm.gemm_config(4096, h100, torch.int8)  # 128 x 256 of int32 would leave two slots
    assert (config.block_n, config.block_k, config.num_stages) == (128, 128, 4)
    assert gluon_gemm.gemm_config(4096, h100).num_stages == 3  # fp16: as before


REFUSED = [
    ("batched", lambda: (_i(2, 64, 32), _i(2, 32, 48)), "batched operands"),
    ("empty", lambda: (_i(0, 32), _i(32, 16).T.contiguous().T), "an empty problem"),
    ("K unaligned", lambda: (_i(64, 24), _i(48, 24).T), "a is not K-contiguous with 16-byte aligned rows"),
    ("N ragged", lambda: (_i(64, 32), _i(6, 32).T), "N = 6"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "make", "reason"), REFUSED, ids=[c[0] for c in REFUSED])
def test_the_choice_refuses_what_the_kernel_does_not_take(case, make, reason):
    a, b = make()
    with simulated_gpu(), use_policy("gluon-gemm-int8"):
        assert reason in (gluon_gemm_int8_refusal(a, b) or "")
        assert not gluon_gemm_int8_applies(a, b)


def test_the_choice_under_the_candidate_only():
    a, w = _i(64, 32), _i(48, 32)
    candidate = CANDIDATES["gluon-gemm-int8"]
    assert candidate.target["op"] == "tensor_core_gemm_int8" and candidate.target["family"] == "gemm"
    with simulated_gpu():
        assert gluon_gemm_int8_refusal(a, w.T, policy=SHIPPED) == "the policy's gluon_gemm_int8 is off"
        with use_policy("gluon-gemm-int8"):
            assert gluon_gemm_int8_applies(a, w.T)
        with use_policy("gluon-gemm-int8"), stand_in(Hardware.from_spec("b200")):
            assert "compute capability" in gluon_gemm_int8_refusal(a, w.T)
    with use_policy("gluon-gemm-int8"):  # a CPU tensor with no simulated GPU
        assert "not CUDA" in gluon_gemm_int8_refusal(a, w.T)


def _ran(call) -> set[str]:
    before = runtime.launch_counts()
    call()
    return set(runtime.launch_counts() - before)


def test_tensor_core_gemm_int8_launches_it_under_the_candidate_every_call():
    a, w = _i(64, 32), _i(48, 32)
    with simulated_gpu():
        assert _ran(lambda: tensor_core_gemm_int8(a, w.T)) == {TRITON}  # as shipped
        with use_policy("gluon-gemm-int8"):
            for _ in range(2):  # the second call is not served by a kept Triton launch
                assert _ran(lambda: tensor_core_gemm_int8(a, w.T)) == {GLUON}
            # b [K, N] row-major: copied K-major first (one copy), then the Gluon kernel
            assert GLUON in _ran(lambda: tensor_core_gemm_int8(a, w.T.contiguous()))
            assert _ran(lambda: tensor_core_gemm_int8(_i(2, 64, 32), _i(2, 32, 48))) == {TRITON}  # batched
        assert _ran(lambda: tensor_core_gemm_int8(a, w.T)) == {TRITON}  # back to the shipped policy
