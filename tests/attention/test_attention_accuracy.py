"""Accuracy against a float64 reference: kernel error <= 2x (outputs) / 3x (gradients) the error of the same
computation done by PyTorch in the kernel's own precision, plus a small fixed cap (see attention_testing).

The shapes form a covering set rather than a full product: every ragged length (1, 2, 17, 113, 129), seq_q
both below and above seq_kv, head dims 8..256 including non-powers of two, MHA/GQA/MQA, causal and not, each
dtype several times.
"""

import pytest
import torch
from attention_testing import (
    BACKWARD_KERNELS,
    FORWARD_KERNELS,
    check_against_reference,
    expect_launches,
    make_qkv,
    pin_configs,
)

from llm_speed import flash_attention, naive_attention, tiled_attention
from llm_speed.attention import flash
from llm_speed.core.config import KernelConfig

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, is_causal, dtype)
FLASH_CASES = [
    (1, 2, 2, 1, 1, 64, False, F32),  # single query, single key
    (2, 2, 1, 2, 17, 40, True, F16),  # MQA, seq_q < seq_kv, causal bottom-right
    (1, 4, 2, 17, 2, 96, True, BF16),  # GQA, seq_q > seq_kv: 15 rows see no key
    (2, 4, 2, 113, 113, 64, True, F16),
    (1, 2, 2, 129, 113, 128, False, BF16),
    (1, 2, 1, 113, 129, 128, True, F32),
    (1, 3, 1, 129, 17, 40, True, F32),  # most rows and whole query blocks see no key
    (1, 2, 2, 128, 128, 64, True, F16),  # every EVEN_* switch on
    (2, 2, 2, 64, 64, 8, False, F32),  # smallest head_dim
    (1, 2, 2, 33, 47, 72, False, F16),  # head_dim 72 padded to 128
    (1, 2, 1, 100, 37, 112, False, BF16),
    (1, 1, 1, 17, 33, 192, True, F16),
    (1, 1, 1, 129, 129, 256, True, BF16),  # largest head_dim
    (1, 2, 2, 17, 129, 256, False, F32),
]


def _case_id(case):
    b, hq, hkv, sq, skv, d, causal, dtype = case
    return f"b{b}-h{hq}:{hkv}-s{sq}x{skv}-d{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", FLASH_CASES, ids=_case_id)
def test_flash_forward_backward_matches_float64(case, device):
    b, hq, hkv, sq, skv, d, causal, dtype = case
    q, k, v = make_qkv(b, hq, hkv, sq, skv, d, dtype, device)
    with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=device):
        check_against_reference(flash_attention, q, k, v, is_causal=causal)


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
def test_flash_lse_gradient_and_custom_scale(dtype, device):
    # Gradients through the returned LSE fold into the backward's delta term; a non-default scale too.
    q, k, v = make_qkv(1, 4, 2, 37, 53, 32, dtype, device)
    check_against_reference(flash_attention, q, k, v, is_causal=True, scale=0.37, dlse=True)


def test_backward_stays_finite_at_huge_scaled_scores(device):
    # |scaled scores| ~ 1e10-1e30: the recomputed score and the saved LSE round apart by far more than 1, and
    # exp2 of the difference was inf (dV inf, dQ/dK NaN) where PyTorch's float32 SDPA is finite. P is now
    # held <= 1; the gradients match float64 as closely as PyTorch's own float32 (a near-one-hot softmax).
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 2, 8, 16, device=device)
    for scale in (1e10, 1e30):
        with expect_launches(*BACKWARD_KERNELS, device=device):
            ours = torch.autograd.grad(flash_attention(q, k, v, scale=scale), (q, k, v), grad)
        exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
        truth = torch.autograd.grad(
            torch.nn.functional.scaled_dot_product_attention(*exact, scale=scale), exact, grad.double()
        )
        single = [t.detach().requires_grad_() for t in (q, k, v)]
        torch_fp32 = torch.autograd.grad(
            torch.nn.functional.scaled_dot_product_attention(*single, scale=scale), single, grad
        )
        for name, mine, want, theirs in zip("qkv", ours, truth, torch_fp32, strict=True):
            assert torch.isfinite(mine).all(), (scale, name)
            bound = 3 * (theirs.double() - want).abs().max() + 1e-6 * want.abs().max()
            assert (mine.double() - want).abs().max() <= bound, (scale, name)


# Forward-only cases for the tiled kernel (its backward is flash's, checked once below) and for naive.
FORWARD_CASES = [
    (1, 2, 1, 1, 17, 64, True, F32),
    (2, 4, 2, 113, 129, 40, False, F16),
    (1, 2, 2, 129, 2, 128, True, BF16),  # rows with no key
    (1, 3, 3, 17, 113, 96, True, F32),
    (1, 1, 1, 33, 65, 256, False, F16),
]


@pytest.mark.parametrize("case", FORWARD_CASES, ids=_case_id)
def test_tiled_forward_matches_float64(case, device):
    b, hq, hkv, sq, skv, d, causal, dtype = case
    q, k, v = make_qkv(b, hq, hkv, sq, skv, d, dtype, device)
    with expect_launches(flash.TILED.name, device=device):
        check_against_reference(tiled_attention, q, k, v, is_causal=causal, grads=False)


def test_tiled_backward_matches_float64(device):
    q, k, v = make_qkv(2, 4, 1, 65, 47, 48, torch.bfloat16, device)
    with expect_launches(flash.TILED.name, *BACKWARD_KERNELS, device=device):
        check_against_reference(tiled_attention, q, k, v, is_causal=True, dlse=True)


@pytest.mark.parametrize("case", FORWARD_CASES, ids=_case_id)
def test_naive_forward_backward_matches_float64(case, device):
    b, hq, hkv, sq, skv, d, causal, dtype = case
    q, k, v = make_qkv(b, hq, hkv, sq, skv, d, dtype, device)
    check_against_reference(naive_attention, q, k, v, is_causal=causal, dlse=True)


# Small pinned blocks: many key and query blocks per head, so every split the kernels make is exercised —
# skipped causal blocks, unmasked interior blocks, masked diagonal blocks, ragged last blocks — in the
# forward, the dQ kernel (key blocks) and the dK/dV kernel (query blocks), with GQA.
SMALL_BLOCK_CASES = [
    (113, 129, True, F32),  # seq_q < seq_kv: the diagonal starts 16 keys in
    (129, 47, True, F16),  # seq_q > seq_kv: 82 rows see no key
    (80, 80, True, BF16),  # every block even, causal
    (50, 77, False, F16),  # ragged both ways, not causal: only the last key block is masked
]


@pytest.mark.parametrize("seq_q, seq_kv, causal, dtype", SMALL_BLOCK_CASES)
def test_masked_and_unmasked_blocks_with_small_blocks(seq_q, seq_kv, causal, dtype, device, monkeypatch):
    small = KernelConfig(16, 16, 4, 1)
    pin_configs(monkeypatch, forward=small, backward=small)
    q, k, v = make_qkv(1, 4, 2, seq_q, seq_kv, 40, dtype, device)
    with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=device):
        check_against_reference(flash_attention, q, k, v, is_causal=causal, dlse=True)
    with expect_launches(flash.TILED.name, device=device):
        check_against_reference(tiled_attention, q, k, v, is_causal=causal, grads=False)
