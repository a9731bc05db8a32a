"""Casting float32 tiles to 16-bit types the same way on a GPU and under Triton's interpreter.

Compiled Triton rounds float32 -> bfloat16 to nearest even; the interpreter truncates, which biases rounded
tiles (softmax probabilities, dS, GEMM outputs) low and makes CPU tests of bfloat16 kernels disagree with the
GPU. Kernels cast through :func:`cast` with ``RNE_BY_HAND=rne_by_hand(dtype)``: under the interpreter, for
bfloat16, the rounding is done on the bits first, so the final (truncating) cast is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _runtime


def rne_by_hand(dtype: torch.dtype) -> bool:
    """The ``RNE_BY_HAND`` switch for casts to ``dtype``: true only for bfloat16 under the interpreter."""
    return _runtime.INTERPRETED and dtype == torch.bfloat16


@triton.jit
def cast(x, dtype: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """``x.to(dtype)``, rounding a float32 ``x`` to nearest even by hand when ``RNE_BY_HAND``."""
    if RNE_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        # Add 0x7FFF plus the lowest kept bit, then drop the 16 low bits: round half to even.
        rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, rounded)  # NaN stays NaN (the addition could carry a NaN's bits to 0)
    return x.to(dtype)
