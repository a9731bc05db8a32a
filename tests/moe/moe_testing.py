"""Shared tools of the MoE tests: the float64 2x/3x rule for matrix products, leaves, a host-read guard."""

from __future__ import annotations

import contextlib

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


READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
         "unique")  # fmt: skip


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def host_reads_raise(monkeypatch):
    """Every way of reading a tensor's values on the host raises inside the block (as
    tests/core/test_no_host_reads.py does for the other ops)."""

    def refuse(name):
        def method(*args, **kwargs):
            raise HostRead(f"{name} read device data on the host")

        return method

    with monkeypatch.context() as patch:
        for name in READS:
            patch.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        for name in ("nonzero", "unique", "equal"):
            patch.setattr(torch, name, refuse(f"torch.{name}"))
        yield
