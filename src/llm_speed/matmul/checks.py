"""Argument checks of the GEMM family (``gemm``, ``tensor_core_gemm``, ``tensor_core_gemm_int8``): every error
names the argument and what is accepted, in the wording of :mod:`llm_speed.core.args` and
:mod:`llm_speed.core.tensors` where a shared check fits.

They read only metadata (types, dtypes, shapes, devices), never tensor values, and build no transposed views:
the sizes after ``trans_a`` / ``trans_b`` are read from the shapes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..core.args import check_choice, check_flag, check_real
from ..core.tensors import FLOAT_DTYPES, check_same_device, check_tensor, dtype_names
from .reference import ACTIVATIONS

TENSOR_CORE_DTYPES = (torch.float16, torch.bfloat16)
INT8_DTYPES = (torch.int8,)
_ACTIVATION_CHOICES = (None, *ACTIVATIONS)


class GemmShape(NamedTuple):
    """The problem size after transposes and batch broadcasting: ``out`` is [batch, m, n] (or [m, n])."""

    batch: int | None  # None when both operands are 2-D
    m: int
    n: int
    k: int

    @property
    def out_shape(self) -> tuple[int, ...]:
        return (self.m, self.n) if self.batch is None else (self.batch, self.m, self.n)


def _check_operand(name: str, x, dtypes) -> None:
    check_tensor(name, x, dtypes=dtypes)
    if x.dim() not in (2, 3):
        raise ValueError(
            f"{name} must be 2-D [rows, cols] or 3-D [batch, rows, cols], got shape {tuple(x.shape)}"
        )


_Tensor = torch.Tensor


def _operands_fine(a, b, trans_a, trans_b, dtypes) -> bool:
    """True when the type, dtype, rank, flag and device checks of :func:`check_operands` have nothing to say:
    one expression over the metadata per call (the checks that explain what is wrong run when it is
    False)."""
    return (
        isinstance(a, _Tensor)
        and isinstance(b, _Tensor)
        and (trans_a is True or trans_a is False)
        and (trans_b is True or trans_b is False)
        and a.dtype in dtypes
        and a.dtype == b.dtype
        and 2 <= a.dim() <= 3
        and 2 <= b.dim() <= 3
        and a.device == b.device
    )


def check_operands(a, b, trans_a, trans_b, dtypes: tuple[torch.dtype, ...]) -> GemmShape:
    """Check a, b (type, dtype, rank, flags, device, inner and batch dims) and return the problem size."""
    if not _operands_fine(a, b, trans_a, trans_b, dtypes):
        _check_operand("a", a, dtypes)
        _check_operand("b", b, dtypes)
        trans_a = check_flag("trans_a", trans_a)
        trans_b = check_flag("trans_b", trans_b)
        if a.dtype != b.dtype:
            raise TypeError(f"a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
        if a.device != b.device:
            check_same_device(a=a, b=b)
    a_shape, b_shape = a.shape, b.shape
    m, k = (a_shape[-1], a_shape[-2]) if trans_a else (a_shape[-2], a_shape[-1])
    k_b, n = (b_shape[-1], b_shape[-2]) if trans_b else (b_shape[-2], b_shape[-1])
    if k != k_b:
        op_a = (*a_shape[:-2], m, k)
        op_b = (*b_shape[:-2], k_b, n)
        raise ValueError(
            f"inner dimensions of a and b do not match: op(a) has shape {op_a} and op(b) has shape {op_b} "
            f"(after trans_a={trans_a}, trans_b={trans_b}); op(a)[-1] must equal op(b)[-2]"
        )
    batch = None
    if len(a_shape) == 3 or len(b_shape) == 3:
        batch_a = a_shape[0] if len(a_shape) == 3 else 1
        batch_b = b_shape[0] if len(b_shape) == 3 else 1
        if batch_a != batch_b and batch_a != 1 and batch_b != 1:
            raise ValueError(
                "batch dimensions of a and b must match or be 1, "
                f"got a {tuple(a_shape)} and b {tuple(b_shape)}"
            )
        batch = batch_b if batch_a == 1 else batch_a
    return GemmShape(batch, m, n, k)


def validate_gemm_inputs(a, b, trans_a: bool = False, trans_b: bool = False) -> GemmShape:
    """Check the operands of ``llm_speed.gemm`` and return the problem size (batch, m, n, k).

    Raises TypeError (not tensors, unsupported or mismatched dtypes, non-bool flags) or ValueError (rank not 2
    or 3, inner dims that differ after the transposes, batch dims that neither match nor are 1, different
    devices). Accepted dtypes: float16, bfloat16, float32.
    """
    return check_operands(a, b, trans_a, trans_b, FLOAT_DTYPES)


def check_scalar(name: str, value) -> float:
    """alpha/beta: a finite real number, as a float (a bool is refused: it is almost always a misplaced
    flag)."""
    return check_real(name, value)


def _check_epilogue_tensor(name: str, x, a) -> None:
    """c or bias: a float tensor on the device of a."""
    check_tensor(name, x, dtypes=FLOAT_DTYPES)
    if x.device != a.device:
        check_same_device(a=a, **{name: x})


def check_epilogue(
    shape: GemmShape, a, *, alpha, beta, c, bias, activation, out_dtype
) -> tuple[float, float]:
    """Check the epilogue arguments of ``llm_speed.gemm`` against the problem size; (alpha, beta) as
    floats."""
    alpha = check_real("alpha", alpha)
    beta = check_real("beta", beta)
    if c is not None:
        _check_epilogue_tensor("c", c, a)
        try:
            broadcasts = torch.broadcast_shapes(tuple(c.shape), shape.out_shape) == shape.out_shape
        except RuntimeError:
            broadcasts = False
        if not broadcasts:
            raise ValueError(
                f"c must have the output shape {shape.out_shape} or broadcast to it, got {tuple(c.shape)}"
            )
    elif beta != 0:
        raise ValueError(f"c is required when beta != 0 (got beta={beta} and c=None)")
    if bias is not None:
        _check_epilogue_tensor("bias", bias, a)
        if tuple(bias.shape) != (shape.n,):
            raise ValueError(f"bias must have shape (N,) = ({shape.n},), got {tuple(bias.shape)}")
    if activation is not None:
        check_choice("activation", activation, _ACTIVATION_CHOICES)
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be None or one of ({dtype_names(FLOAT_DTYPES)}), got {out_dtype}")
    return alpha, beta
