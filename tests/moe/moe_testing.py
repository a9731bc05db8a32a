"""Shared tools of the MoE tests: the float64 2x/3x rule for matrix products and leaves (the MoE ops'
host-read cases are in tests/core/test_no_host_reads.py with every other op's)."""

from __future__ import annotations

import torch

import accuracy_rule
from accuracy_rule import GRAD_FACTOR, OUTPUT_FACTOR, expect_launches, matmul_cap  # noqa: F401

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rule(name: str, got, same, truth, factor: float, dtype: torch.dtype, k: int) -> None:
    """The suite's rule with the matrix-product cap: one ``dtype`` ulp at the truth's magnitude plus K fp32
    ulps (``accuracy_rule.matmul_cap``)."""
    accuracy_rule.assert_error_rule(name, got, same, truth, factor, cap=matmul_cap(dtype, truth.double(), k))


def leaves(*tensors, dtype=None, device=None):
    """Detached copies that require grad (floating ones), optionally cast / moved."""
    out = []
    for t in tensors:
        t = t.detach().clone()
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        if device is not None:
            t = t.to(device)
        out.append(t.requires_grad_() if t.is_floating_point() else t)
    return out


def grads(tensors):
    return [t.grad for t in tensors if t.is_floating_point()]
