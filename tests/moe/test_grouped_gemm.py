"""grouped_gemm: float64 truth with the 2x/3x rule against torch._grouped_mm in the same precision, group
sizes 0/1/17/129, one group holding every row, 1/8/64 groups, both layouts of b, strides, bad input."""

import importlib

import pytest
import torch
from moe_testing import DTYPES, GRAD_FACTOR, OUTPUT_FACTOR, expect_launches, leaves, rule

from llm_speed import grouped_gemm
from llm_speed.core import runtime
from llm_speed.moe.reference import grouped_gemm_reference

module = importlib.import_module("llm_speed.moe.grouped_gemm")  # the package's attribute is the function
KERNELS = (module.GROUPED.name,)
BACKWARD_KERNELS = (module.GROUPED.name, module.WGRAD.name)


def _offsets(counts, device):
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def _same_precision(a, b, offsets, *, trans_b):
    """torch._grouped_mm in the inputs' dtype (CUTLASS on a GPU, also on the CPU), or the loop in that dtype
    where it refuses the problem."""
    try:
        return torch._grouped_mm(a, b.transpose(1, 2) if trans_b else b, offs=offsets)
    except RuntimeError:
        return grouped_gemm_reference(a, b, offsets, trans_b=trans_b)


def _run(fn, a, b, offsets, trans_b, dout):
    out = fn(a, b, offsets, trans_b=trans_b)
    out.backward(dout.to(out.dtype))
    return out.detach(), a.grad, b.grad


CASES = {
    "0-1-17-129": [0, 1, 17, 129],
    "one-group-takes-all": [0, 0, 150, 0],
    "single-group": [77],
    "64-groups": [0, 3, 1, 0, 2] * 12 + [5, 0, 1, 4],
}


F32, BF16, F16 = DTYPES
RUNS = [
    *((case, trans_b, dtype) for case in ("0-1-17-129",) for trans_b in (False, True) for dtype in DTYPES),
    ("one-group-takes-all", False, F32), ("one-group-takes-all", True, BF16),
    ("single-group", False, F16), ("single-group", True, F32),
    ("64-groups", True, F32), ("64-groups", False, BF16),
]  # fmt: skip


@pytest.mark.parametrize(("case", "trans_b", "dtype"), RUNS)
def test_accuracy_forward_and_backward(case, trans_b, dtype, device):
    counts = CASES[case]
    # ragged K and N: K past one interpreter K step (128) for the 0/1/17/129 case, N past one tile (64)
    k, n = (200, 72) if case == "0-1-17-129" else (40, 24)
    groups, total = len(counts), sum(counts)
    offsets = _offsets(counts, device)
    a = torch.randn(total, k)
    b = torch.randn(groups, n, k) if trans_b else torch.randn(groups, k, n)
    dout = torch.randn(total, n)
    truth = _run(grouped_gemm_reference, *leaves(a, b, dtype=torch.float64), offsets.cpu(), trans_b, dout)
    same = _run(_same_precision, *leaves(a, b, dtype=dtype), offsets.cpu(), trans_b, dout)
    with expect_launches(*BACKWARD_KERNELS, device=device):
        got = _run(grouped_gemm, *leaves(a, b, dtype=dtype, device=device), offsets, trans_b, dout.to(device))
    assert got[0].dtype == dtype and got[0].shape == (total, n)
    rule("out", got[0], same[0], truth[0], OUTPUT_FACTOR, dtype, k)
    rule("da", got[1], same[1], truth[1], GRAD_FACTOR, dtype, n)
    rule("db", got[2], same[2], truth[2], GRAD_FACTOR, dtype, max(counts))


def test_out_dtype_strides_and_empty_rows(device):
    counts = [5, 0, 9]
    offsets = _offsets(counts, device)
    storage = torch.randn(14, 80, device=device, dtype=torch.bfloat16)
    a = storage[:, 3:51]  # a row stride of 80, columns offset: read in place
    b = torch.randn(3, 33, 48, device=device, dtype=torch.bfloat16).transpose(1, 2)  # [3, 48, 33], K-major
    out = grouped_gemm(a, b, offsets, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert out.device == a.device
    truth = grouped_gemm_reference(a.double().cpu(), b.double().cpu(), offsets.cpu())
    torch.testing.assert_close(out.double().cpu(), truth, rtol=0, atol=48 * 2 * 2**-8)
    # no rows at all: an empty output, and zero gradients for b
    a0 = torch.randn(0, 48, device=device, requires_grad=True)
    b0 = torch.randn(3, 48, 8, device=device, requires_grad=True)
    empty = grouped_gemm(a0, b0, torch.zeros(3, dtype=torch.int32, device=device))
    assert empty.shape == (0, 8)
    empty.sum().backward()
    assert b0.grad.abs().sum() == 0 and a0.grad.shape == (0, 48)


def test_only_b_requires_grad(device):
    a = torch.randn(20, 16, device=device)
    b = torch.randn(2, 16, 8, device=device, requires_grad=True)
    offsets = _offsets([12, 8], device)
    grouped_gemm(a, b, offsets).square().sum().backward()
    expected = torch.stack([2 * a[:12].T @ (a[:12] @ b[0]), 2 * a[12:].T @ (a[12:] @ b[1])]).detach()
    torch.testing.assert_close(b.grad, expected, rtol=1e-5, atol=1e-4)


def test_opcheck(device):
    a = torch.randn(5, 16, device=device, requires_grad=True)
    b = torch.randn(2, 16, 16, device=device, requires_grad=True)
    offsets = _offsets([5, 0], device)
    torch.library.opcheck(torch.ops.llm_speed.grouped_gemm.default, (a, b, offsets, False, torch.float32))


BAD = [
    (lambda a, b, o: (a.double(), b, o), {}, TypeError, "a has dtype"),
    (lambda a, b, o: (a, b.half(), o), {}, TypeError, "a and b must have the same dtype"),
    (lambda a, b, o: (a, b[0], o), {}, ValueError, "b must have 3 dims"),
    (lambda a, b, o: (a[:, :7], b, o), {}, ValueError, "has K = 7"),
    (lambda a, b, o: (a, b, o), {"trans_b": True}, ValueError, "read as \\[groups, N, K\\]"),
    (lambda a, b, o: (a, b, o.long()), {}, TypeError, "offsets has dtype"),
    (lambda a, b, o: (a, b, o[:2]), {}, ValueError, "one per group"),
    (lambda a, b, o: (a, b, o.flip(0)), {}, ValueError, "non-decreasing"),
    (lambda a, b, o: (a, b, o - 10), {}, ValueError, ">= 0"),
    (lambda a, b, o: (a, b, o - o[-1] + 11), {}, ValueError, "must end at the number of rows \\(12\\)"),
    (lambda a, b, o: (a, b[:0], o[:0]), {}, ValueError, "at least one group"),
    (lambda a, b, o: (a, b, o), {"trans_b": 1}, TypeError, "trans_b must be a bool"),
    (lambda a, b, o: (a, b, o), {"out_dtype": torch.int32}, TypeError, "out_dtype"),
]


@pytest.mark.parametrize(("make", "kwargs", "error", "message"), BAD)
def test_bad_input_is_a_clear_error_before_any_work(make, kwargs, error, message, device, monkeypatch):
    # the values of offsets are checked where runtime.check_values allows a host read (CPU tensors by
    # default, CUDA ones under LLM_SPEED_CHECK_INPUTS=1): on, so every device tests the check; off, the
    # kernel makes the rows NaN (test_unchecked_invalid_offsets_give_nan_never_out_of_bounds)
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)
    a, b = torch.randn(12, 16, device=device), torch.randn(3, 16, 8, device=device)
    offsets = _offsets([4, 0, 8], device)
    before = runtime.launch_counts()
    with pytest.raises(error, match=message):
        grouped_gemm(*make(a, b, offsets), **kwargs)
    assert runtime.launch_counts() == before


def test_unchecked_invalid_offsets_give_nan_never_out_of_bounds(monkeypatch, device):
    """With the value checks off the kernel still touches only its tensors: decreasing offsets or an end past
    the rows make every element NaN; an early end makes the rows past it NaN and leaves the others right."""
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    a, b = torch.randn(12, 16, device=device), torch.randn(3, 16, 8, device=device)
    for bad in ([8, 4, 12], [4, 8, 30], [-3, 4, 12]):
        assert grouped_gemm(a, b, torch.tensor(bad, dtype=torch.int32, device=device)).isnan().all(), bad
    short = torch.tensor([4, 4, 9], dtype=torch.int32, device=device)
    out = grouped_gemm(a, b, short)
    assert out[9:].isnan().all() and not out[:9].isnan().any()
    torch.testing.assert_close(out[:9], grouped_gemm_reference(a[:9], b, short.cpu()), rtol=1e-5, atol=1e-5)
