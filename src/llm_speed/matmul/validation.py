"""Argument checks for the GEMM family: every error names the argument and what is accepted."""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch

from llm_speed.core.args import check_flag
from llm_speed.matmul.reference import ACTIVATIONS

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)
INT8_DTYPES = (torch.int8,)


class GemmShape(NamedTuple):
    """The problem size after transposes and batch broadcasting: ``out`` is [batch, m, n] (or [m, n])."""

    batch: int | None  # None when both operands are 2-D
    m: int
    n: int
    k: int

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.m, self.n) if self.batch is None else (self.batch, self.m, self.n)


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_operands(
    a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool, dtypes: tuple[torch.dtype, ...]
) -> GemmShape:
    """Check a, b (type, rank, dtype, device, inner and batch dims) and return the problem size."""
    for name, x in (("a", a), ("b", b)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (2, 3):
            raise ValueError(
                f"{name} must be 2-D [rows, cols] or 3-D [batch, rows, cols], got shape {tuple(x.shape)}"
            )
        if x.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in ({_names(dtypes)}), got {x.dtype}")
    trans_a = check_flag("trans_a", trans_a)
    trans_b = check_flag("trans_b", trans_b)
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on the same device, got a on {a.device} and b on {b.device}")
    op_a_shape = tuple(a.mT.shape if trans_a else a.shape)
    op_b_shape = tuple(b.mT.shape if trans_b else b.shape)
    if op_a_shape[-1] != op_b_shape[-2]:
        raise ValueError(
            f"inner dimensions of a and b do not match: op(a) has shape {op_a_shape} and op(b) has shape "
            f"{op_b_shape} (after trans_a={trans_a}, trans_b={trans_b}); op(a)[-1] must equal op(b)[-2]"
        )
    batch = None
    if a.dim() == 3 or b.dim() == 3:
        batch_a = a.shape[0] if a.dim() == 3 else 1
        batch_b = b.shape[0] if b.dim() == 3 else 1
        if batch_a != batch_b and 1 not in (batch_a, batch_b):
            raise ValueError(
                "batch dimensions of a and b must match or be 1, "
                f"got a {tuple(a.shape)} and b {tuple(b.shape)}"
            )
        batch = batch_b if batch_a == 1 else batch_a
    return GemmShape(batch, op_a_shape[-2], op_b_shape[-1], op_a_shape[-1])


def validate_gemm_inputs(a, b, trans_a: bool = False, trans_b: bool = False) -> GemmShape:
    """Check the operands of ``llm_speed.gemm`` and return the problem size (batch, m, n, k).

    Raises TypeError (not tensors, unsupported or mismatched dtypes, non-bool flags) or ValueError (rank not 2
    or 3, inner dims that differ after the transposes, batch dims that neither match nor are 1, different
    devices). Accepted dtypes: float16, bfloat16, float32.
    """
    return check_operands(a, b, trans_a, trans_b, FLOAT_DTYPES)


def check_scalar(name: str, value) -> float:
    """alpha/beta: a real number (bool is refused: it is almost always a misplaced flag)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    return float(value)


def _check_float_tensor(name: str, x, device: torch.device) -> None:
    """c or bias: a float tensor on the device of a."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have dtype in ({_names(FLOAT_DTYPES)}), got {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} must be on the device of a ({device}), got {x.device}")


def check_epilogue(
    shape: GemmShape,
    a: torch.Tensor,
    *,
    alpha,
    beta,
    c,
    bias,
    activation,
    out_dtype,
) -> None:
    """Check the epilogue arguments of ``llm_speed.gemm`` against the problem size."""
    check_scalar("alpha", alpha)
    check_scalar("beta", beta)
    if beta != 0 and c is None:
        raise ValueError(f"c is required when beta != 0 (got beta={beta} and c=None)")
    if c is not None:
        _check_float_tensor("c", c, a.device)
        try:
            broadcasts = torch.broadcast_shapes(tuple(c.shape), shape.out_shape) == torch.Size(
                shape.out_shape
            )
        except RuntimeError:
            broadcasts = False
        if not broadcasts:
            raise ValueError(
                f"c must have the output shape {shape.out_shape} or broadcast to it, got {tuple(c.shape)}"
            )
    if bias is not None:
        _check_float_tensor("bias", bias, a.device)
        if tuple(bias.shape) != (shape.n,):
            raise ValueError(f"bias must have shape (N,) = ({shape.n},), got {tuple(bias.shape)}")
    if activation is not None and activation not in ACTIVATIONS:
        raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be None or one of ({_names(FLOAT_DTYPES)}), got {out_dtype}")
