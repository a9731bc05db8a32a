"""int8 GEMM: int32 accumulation, exact for every K (compared for equality with an int64 product)."""

import pytest
import torch
from matmul_helpers import record_gemm_launches

import llm_speed
from llm_speed.matmul import gemm_int8_reference


@pytest.fixture(autouse=True)
def poisoned_outputs():
    """torch.empty fills int32 outputs with their largest value: an unwritten element fails the equality."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(previous)


def int8(*shape, device="cpu"):
    return torch.randint(-128, 128, shape, dtype=torch.int8, device=device)


@pytest.mark.parametrize("m, n, k", [(1, 1, 1), (1, 1, 32), (17, 23, 113), (64, 65, 257), (33, 16, 1000)])
def test_exact_random(device, m, n, k):
    a, b = int8(m, k, device=device), int8(k, n, device=device)
    out = llm_speed.tensor_core_gemm_int8(a, b)
    assert out.dtype == torch.int32 and out.shape == (m, n)
    assert torch.equal(out.cpu(), gemm_int8_reference(a.cpu(), b.cpu()))


@pytest.mark.parametrize("k", [15, 17, 130])
def test_extreme_values_exact(device, k):
    """-128 * -128 summed K times is the largest product; mixed -128/127 rows cover both extremes."""
    a = torch.full((20, k), -128, dtype=torch.int8, device=device)
    b = torch.full((k, 12), -128, dtype=torch.int8, device=device)
    a[1::2] = 127
    b[:, 1::3] = 127
    out = llm_speed.tensor_core_gemm_int8(a, b)
    expected = gemm_int8_reference(a.cpu(), b.cpu())
    assert expected[0, 0] == k * 128 * 128
    assert torch.equal(out.cpu(), expected)


def test_sum_beyond_fp32_exactness(device):
    # K = 1100: sums reach 1100 * 16384 > 2**24, where an fp32 accumulator would start rounding.
    k = 1100
    a = torch.full((16, k), -128, dtype=torch.int8, device=device)
    b = torch.full((k, 16), -128, dtype=torch.int8, device=device)
    a[:, 0] = 127  # 127 * 127 makes the sum odd: not representable in fp32 at this magnitude
    b[0, :] = 127
    out = llm_speed.tensor_core_gemm_int8(a, b)
    expected = (k - 1) * 128 * 128 + 127 * 127
    assert expected > 2**24 and expected % 2 == 1
    assert (out.cpu() == expected).all()


def test_batched_and_strided(device):
    a = int8(3, 40, 21, device=device).mT  # [3, 21, 40], column-major per batch
    b = int8(40, 9, device=device)  # 2-D: broadcast over the batch
    out = llm_speed.tensor_core_gemm_int8(a, b)
    assert out.shape == (3, 21, 9)
    assert torch.equal(out.cpu(), gemm_int8_reference(a.cpu(), b.cpu()))


def test_inputs_not_modified(device):
    a, b = int8(10, 20, device=device), int8(20, 5, device=device)
    a0, b0 = a.clone(), b.clone()
    llm_speed.tensor_core_gemm_int8(a, b)
    assert torch.equal(a, a0) and torch.equal(b, b0)


def test_operands_reach_the_kernel_k_major(device, monkeypatch):
    """wgmma reads 8-bit tiles K-major only (Triton moves any other layout through registers at every K
    step): a [K, N] row-major b, a column-major a and a broadcast batch are copied K-major once before the
    launch, on the first call and on a repeated one; K-major operands go to the kernel as they are. (The
    Triton kernel's launches: under the candidate gluon-gemm-int8 a GPU run would hand 2-D calls to the Gluon
    kernel, so the policy keeps it off here.)"""
    from llm_speed.core import launch
    from llm_speed.core.policy import use_policy

    launches = record_gemm_launches(monkeypatch)
    m, n, k = 24, 20, 48
    cases = [
        (int8(m, k, device=device), int8(k, n, device=device)),  # b N-major: copied
        (int8(k, m, device=device).mT, int8(n, k, device=device).mT),  # a copied, b K-major already
        (int8(2, m, k, device=device), int8(1, k, n, device=device).expand(2, k, n)),  # broadcast b
    ]
    try:
        for a, b in cases:
            for _ in range(2):  # the checked call, then the kept one
                with use_policy(gluon_gemm_int8=False):
                    out = llm_speed.tensor_core_gemm_int8(a, b)
                assert torch.equal(out.cpu(), gemm_int8_reference(a.cpu(), b.cpu()))
                plan, per_call = launches[-1]
                assert plan.fixed["stride_ak"] == 1 and plan.fixed["stride_bk"] == 1
                assert per_call["a_ptr"].stride(-1) == 1 and per_call["b_ptr"].stride(-2) == 1
                assert (per_call["a_ptr"] is a) == (a.stride(-1) == 1)
                assert (per_call["b_ptr"] is b) == (b.stride(-2) == 1)
        assert cases[2][1].stride(0) == 0 and launches[-1][1]["b_ptr"].stride(0) == 0  # still broadcast
    finally:
        launch.clear_plans()  # the plans' launch functions were wrapped
