"""Maths every kernel shares, written once: rounding casts, an accurate tanh, the tile product, and the host
helper that sets their switches.

- :func:`cast` rounds float32 to 16-bit types the same way on a GPU and under Triton's interpreter. Compiled
  Triton rounds float32 -> bfloat16 to nearest even; the interpreter truncates, which biases rounded tiles
  (softmax probabilities, dS, GEMM outputs) low and makes CPU tests of bfloat16 kernels disagree with the GPU.
  With ``RNE_BY_HAND`` (:func:`rne_by_hand`) the rounding is done on the bits first, so the final cast is
  exact.
- :func:`tanh` in float32 from ``exp2`` (libdevice does not run under the interpreter), accurate near 0, where
  ``1 - 2 / (e^2x + 1)`` cancels.
- :func:`dot` is ``tl.dot`` accumulating in float32, with the interpreter's bfloat16 fault worked around.
- :func:`dot_switches` gives the three constexprs these take, from the operands' dtype.
- :func:`warp_uniform` tells ptxas that a value every thread holds is one value (``redux.sync``), where a
  kernel computes its work from data it reads (packed sequences' bounds); :func:`uniform_switch` says where
  that compiles.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import runtime

LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))
# base-2 to natural log: an LSE kept in base 2 in a kernel is stored in natural-log units
LN2: tl.constexpr = tl.constexpr(math.log(2.0))


def rne_by_hand(dtype: torch.dtype) -> bool:
    """The ``RNE_BY_HAND`` switch for casts to ``dtype``: true only for bfloat16 under the interpreter."""
    return runtime.INTERPRETED and dtype == torch.bfloat16


def dot_switches(dtype: torch.dtype, *, tf32: bool = False) -> dict:
    """``DOT_IN_FP32``, ``DOT_PRECISION`` and ``RNE_BY_HAND`` for tiles of ``dtype``.

    DOT_IN_FP32: widen tiles to float32 before ``tl.dot``; only for bfloat16 under the interpreter, whose
    ``tl.dot`` multiplies raw bit patterns there (the tiles are still rounded to bfloat16 first, and a
    bfloat16 product is exact in float32). DOT_PRECISION: float32 operands get a true float32 product
    ("ieee") unless ``tf32`` (PyTorch allows TF32 for matmuls); 16-bit operands ignore it.
    """
    widen = runtime.INTERPRETED and dtype == torch.bfloat16
    return {
        "DOT_IN_FP32": widen,
        "DOT_PRECISION": "ieee" if dtype == torch.float32 and not tf32 else "tf32",
        "RNE_BY_HAND": widen,
    }


def uniform_switch(hardware) -> bool:
    """The ``REDUX`` switch of :func:`warp_uniform`: compiled for an NVIDIA GPU of compute capability 8.0
    or later (``redux.sync``'s minimum, PTX ISA 7.0), not under the interpreter (no inline PTX there)."""
    capability = tuple(hardware.compute_capability)
    return not runtime.INTERPRETED and torch.version.hip is None and capability >= (8, 0)


@triton.jit
def warp_uniform(x, REDUX: tl.constexpr):
    """``x``, a 32-bit integer every thread of the warp holds the same value of, as a value ptxas knows to be
    warp-uniform. Triton gives a reduction across lanes (``tl.sum``, ``tl.cumsum``) to every thread, but
    ptxas cannot tell that the threads agree: the result, and everything computed from it (loop bounds,
    addresses, TMA coordinates), stays in per-thread registers, and each wgmma or TMA instruction in a loop
    that needs it in a uniform register converts it again (``R2UR``). ``redux.sync`` of a value the lanes
    agree on returns it, in a uniform register (sm_90a, a packed sequence's dQ kernel at d = 128: 255 -> 221
    registers, 370 -> 288 SASS instructions in its main loop). Without ``REDUX``: ``x`` as it is. Call it
    where every thread of the warp is active (all 32 lanes take part)."""
    if REDUX:
        return tl.inline_asm_elementwise("redux.sync.max.s32 $0, $1, 0xffffffff;", "=r,r", [x.to(tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)  # fmt: skip
    return x.to(tl.int32)


@triton.jit
def cast(x, dtype: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """``x.to(dtype)``, rounding a float32 ``x`` to nearest even by hand when ``RNE_BY_HAND``."""
    if RNE_BY_HAND:
        bits = x.to(tl.uint32, bitcast=True)
        # Add 0x7FFF plus the lowest kept bit, then drop the 16 low bits: round half to even.
        rounded = ((bits + (((bits >> 16) & 1) + 0x7FFF)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        x = tl.where(x != x, x, rounded)  # NaN stays NaN (the addition could carry a NaN's bits to 0)
    return x.to(dtype)


@triton.jit
def tanh(x):
    """tanh of a float32 block from exp2.

    ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` never overflows; below |x| = 0.25, where ``1 - e`` would
    lose digits, the Taylor series to x^9 (truncation below 1e-8 relative) is used instead.
    """
    a = tl.abs(x)
    e = tl.exp2(a * (-2.0 * LOG2E))
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(a < 0.25, small, tl.where(x < 0, -big, big))


@triton.jit
def dot(a, b, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, acc=None):
    """``a @ b`` accumulated in float32 (see :func:`dot_switches`), onto ``acc`` when given (a float32
    tile the products are added to in the tensor cores' accumulator: no separate pass over the result)."""
    if DOT_IN_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc=acc, input_precision=DOT_PRECISION)
