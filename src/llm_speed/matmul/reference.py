"""Plain PyTorch GEMM: the specification the Triton kernels are tested against, and the CPU fallback.

Same arguments as ``llm_speed.gemm``; ``compute_dtype`` chooses the precision of the arithmetic (tests use
float64, the fallback float32, like the kernels' fp32 accumulator).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")


def apply_activation(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The activation the kernels fuse into their epilogue, in PyTorch (None: identity)."""
    if activation is None:
        return x
    if activation == "relu":
        return torch.relu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "silu":
        return F.silu(x)
    raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")


def activation_derivative(z: torch.Tensor, activation: str | None) -> torch.Tensor:
    """d act(z) / dz, elementwise, for the backward pass (z is the pre-activation)."""
    if activation is None:
        return torch.ones_like(z)
    if activation == "relu":
        return (z > 0).to(z.dtype)
    if activation == "gelu":
        cdf = 0.5 * (1.0 + torch.erf(z * 0.5**0.5))
        pdf = torch.exp(-0.5 * z * z) * (2.0 * torch.pi) ** -0.5
        return cdf + z * pdf
    if activation == "gelu_tanh":
        # gelu_tanh(z) = z * sigmoid(2u), u = sqrt(2/pi) * (z + 0.044715 z^3)
        scale = (2.0 / torch.pi) ** 0.5
        u = scale * (z + 0.044715 * z**3)
        s = torch.sigmoid(2.0 * u)
        du_dz = scale * (1.0 + 3.0 * 0.044715 * z * z)
        return s + z * s * (1.0 - s) * 2.0 * du_dz
    if activation == "silu":
        s = torch.sigmoid(z)
        return s * (1.0 + z * (1.0 - s))
    raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")


def gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    trans_a: bool = False,
    trans_b: bool = False,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``act(alpha * op(a) @ op(b) + beta * c + bias)`` in ``compute_dtype``, returned in ``out_dtype``.

    op(x) is x or its transpose over the last two dims. Batch dims broadcast like ``torch.matmul``. With
    beta == 0, c is not read. Differentiable (tests use it for float64 reference gradients).
    """
    op_a = a.mT if trans_a else a
    op_b = b.mT if trans_b else b
    result = alpha * torch.matmul(op_a.to(compute_dtype), op_b.to(compute_dtype))
    if beta != 0:
        result = result + beta * c.to(compute_dtype)
    if bias is not None:
        result = result + bias.to(compute_dtype)
    result = apply_activation(result, activation)
    return result.to(out_dtype or a.dtype)


def gemm_int8_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of int8 tensors computed exactly in int64, returned as int32."""
    return torch.matmul(a.to(torch.int64), b.to(torch.int64)).to(torch.int32)
