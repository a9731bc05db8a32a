"""Shared helpers of the GEMM tests: the accuracy rule of TESTING.md for matrix products."""

from __future__ import annotations

import torch

from llm_speed.matmul.reference import apply_activation, gemm_reference

FLOAT32_EPS = torch.finfo(torch.float32).eps


def torch_same_precision(a, b, *, alpha=1.0, beta=0.0, c=None, trans_a=False, trans_b=False, bias=None,
                         activation=None, out_dtype=None):  # fmt: skip
    """Plain PyTorch at the kernel's own precision: matmul in the input dtype, epilogue in fp32."""
    op_a = a.mT if trans_a else a
    op_b = b.mT if trans_b else b
    z = alpha * torch.matmul(op_a, op_b).float()
    if beta != 0:
        z = z + beta * c.float()
    if bias is not None:
        z = z + bias.float()
    return apply_activation(z, activation).to(out_dtype or a.dtype)


def assert_gemm_accurate(out: torch.Tensor, a, b, *, factor: float = 2.0, **kwargs) -> None:
    """The kernel's error vs float64 is at most ``factor`` x PyTorch's same-precision error plus a cap.

    The cap is one output ulp at the result's magnitude plus K fp32 ulps (the accumulation over K).
    """
    assert not out.isnan().any(), "output has NaN (an element was not written, or NaN leaked in)"
    cpu_args = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
    a, b = a.cpu(), b.cpu()
    expected_args = {key: v for key, v in cpu_args.items() if key != "out_dtype"}
    expected = gemm_reference(a, b, out_dtype=torch.float64, **expected_args)
    same_precision = torch_same_precision(a, b, **cpu_args)
    k = a.shape[-2] if kwargs.get("trans_a") else a.shape[-1]
    kernel_error = (out.cpu().double() - expected).abs().max().item() if out.numel() else 0.0
    torch_error = (same_precision.double() - expected).abs().max().item() if out.numel() else 0.0
    magnitude = expected.abs().max().item() if out.numel() else 0.0
    cap = torch.finfo(out.dtype).eps * magnitude + k * FLOAT32_EPS
    assert kernel_error <= factor * torch_error + cap, (
        f"kernel error {kernel_error:.3e} > {factor} x torch error {torch_error:.3e} + cap {cap:.3e}"
    )
