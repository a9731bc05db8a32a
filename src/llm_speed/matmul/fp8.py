"""FP8 in Triton: quantization (amax and cast fused), the scaled GEMM, and the float8 training linear.

- :func:`quantize_fp8` turns a float tensor into fp8 (e4m3 or e5m2) and float32 scales with
  ``x ~= x_fp8.float() * scale``: one scale per tensor, per row, per 1x128 group or per 128x128 block
  (DeepSeek-V3's activation and weight blocks, arXiv:2412.19437 section 3.3). ``scale = amax / fp8_max``
  (amax floored at 1e-12, torchao's EPS, so an all-zero group gets a tiny scale and exact zeros), and the
  cast saturates at +-fp8_max.
- :func:`gemm_fp8` computes ``(a * scale_a) @ (b * scale_b) + bias`` with the granularity read from the
  scale shapes (tensor x tensor, row x row, 1x128 x 128x128), as ``torch._scaled_mm`` does where the two
  overlap; fp32 accumulation; output bfloat16, float16 or float32.
- :func:`float8_linear` is ``x @ weight.T + bias`` with both operands quantized dynamically to e4m3 (per
  tensor or per row), the output gradient to e5m2, and both gradients computed by the same kernels (torchao's
  float8 training recipe, ``torchao/float8``: forward e4m3, gradients e5m2; the weight gradient in fp8 too).
  :class:`llm_speed.nn.Float8Linear` wraps it.

How "tensor" scaling needs no host read: the amax of a whole tensor is found in two launches. The first
(``_amax_partial_kernel``) runs at most :data:`AMAX_PROGRAMS` programs (a constant per device), each writing
the amax of its share of the rows to a float32 buffer of partials (every element written, no atomics: the
result is the same on every run). The second (the quantize kernel) has every program reduce those few
partials itself (at most a few KB, read from L2), compute the scale, and cast its tile; program (0, 0)
writes the scale. Nothing is read on the host and nothing is sized from tensor values, so the call can be
captured in a CUDA graph.

Under Triton's interpreter the float32 -> fp8 cast is done on the bits by hand (:func:`to_fp8`),
because the interpreter's own cast rounds wrongly where the rounding carries into the next power of two and
does not saturate (docs/fp8.md, "Interpreter rounding"); compiled Triton uses the hardware's
``cvt.rn.satfinite``.

Layout (every op module): kernels, launcher (configuration, plans, launch), op registration, autograd, public
functions. The plain-PyTorch spec: :mod:`llm_speed.matmul.reference` (``quantize_fp8_reference``,
``gemm_fp8_reference``). Design notes: docs/gemm.md ("FP8").
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..core import autocast, runtime, tensors
from ..core.args import check_choice, check_flag
from ..core.config import KernelConfig
from ..core.dispatch import Op
from ..core.hardware import Hardware, hardware_of
from ..core.kernel_math import cast, rne_by_hand
from ..core.launch import Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.policy import current_policy
from ..core.tensors import FLOAT_DTYPES, check_same_device, check_tensor, dtype_names
from ..core.tile_choice import choose_tile, fits_block_scaling
from . import reference
from .gemm_configs import gemm_tile, shared_bytes
from .gemm_kernels import grouped_tile

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The largest finite value of each fp8 format (OCP FP8 spec; torch.finfo agrees).
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# amax is floored here before the scale is taken (torchao's float8 EPS): an all-zero group gets a finite
# scale and exact zeros.
AMAX_FLOOR = 1e-12
# The side of a scaling block along K (1x128 and 128x128 granularities).
BLOCK = reference.FP8_BLOCK
GRANULARITIES = ("tensor", "row", (1, BLOCK), (BLOCK, BLOCK))
# The granularity as the op schema's string, and the kernels' MODE constexpr.
_NAMES = {"tensor": "tensor", "row": "row", (1, BLOCK): "1x128", (BLOCK, BLOCK): "128x128"}
_MODES = {"tensor": 0, "row": 1, "1x128": 2, "128x128": 3}
# The scaled GEMM's SCALING constexpr, read from the scale shapes as the spec reads them.
TENSOR, ROW, BLOCKWISE = reference.TENSOR, reference.ROW, reference.BLOCKWISE
scaling_of = reference.scaling_of
SCALINGS = ("tensor", "row", "block")

# --- kernels --------------------------------------------------------------------------------------------


@triton.jit
def to_fp8(y, FP8_MAX: tl.constexpr, ROUND_BY_HAND: tl.constexpr, SHIFT: tl.constexpr,
            ROUND_MASK: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr,
            dtype: tl.constexpr):  # fmt: skip
    """Saturate float32 ``y`` to +-FP8_MAX and cast it to fp8 ``dtype``, rounding to nearest even.

    With ROUND_BY_HAND (the interpreter, whose own cast is wrong, see the module docstring) ``y`` is first
    rounded onto the fp8 grid in float32, so the cast is exact. Normal range: drop the low SHIFT = 23 -
    mantissa bits of the float32 bits with round-half-even (a carry into the exponent gives the correct next
    power of two). Subnormals (|y| < MIN_NORMAL) have a fixed spacing: adding then subtracting
    SUBNORMAL_MAGIC (a power of two whose float32 ulp is that spacing) rounds to it in float32's own RNE.
    Under the interpreter its casts of NaN (0x7C) and of a -0 the rounding made +0 are corrected on the bits.

    A NaN stays NaN, with its sign, as PyTorch's cast keeps it (a GPU's min/max would saturate it).
    """
    s = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if ROUND_BY_HAND:
        bits = s.to(tl.uint32, bitcast=True)
        half = (1 << (SHIFT - 1)) - 1
        normal = ((bits + (half + ((bits >> SHIFT) & 1))) & ROUND_MASK).to(tl.float32, bitcast=True)
        a = tl.abs(s)
        small = (a + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC
        small = tl.where(s < 0, -small, small)
        s = tl.where(a < MIN_NORMAL, small, normal)
        q = s.to(dtype).to(tl.uint8, bitcast=True)
        negative = (y.to(tl.uint32, bitcast=True) >> 31) == 1
        nan = tl.where(negative, 0xFF, 0x7F).to(tl.uint8)
        q = tl.where(y != y, nan, tl.where(negative & (q == 0), 0x80, q))
        return q.to(dtype, bitcast=True)
    return tl.where(y == y, s.to(dtype), y.to(dtype))


@triton.jit
def _amax_partial_kernel(
    x_ptr, partial_ptr, rows, cols, stride_xr, stride_xc, row_blocks,
    NUM_PROGRAMS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Pass 1 of per-tensor scaling: program p writes the amax of row blocks p, p + NUM_PROGRAMS, ... to
    ``partial_ptr[p]`` (float32). Reads x once; writes NUM_PROGRAMS floats."""
    pid = tl.program_id(0)
    o_c = tl.arange(0, BLOCK_C)
    b_amax = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for rb in range(pid, row_blocks, NUM_PROGRAMS):
        o_r = (rb * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        m_r = o_r < rows
        for c in range(0, cols, BLOCK_C):
            o = c + o_c
            m = m_r[:, None] & (o < cols)[None, :]
            p_x = x_ptr + o_r[:, None] * stride_xr + o.to(tl.int64)[None, :] * stride_xc
            b_x = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
            b_amax = tl.maximum(b_amax, tl.abs(b_x))
    tl.store(partial_ptr + pid, tl.max(tl.max(b_amax, axis=1), axis=0))


@triton.jit
def _quantize_fp8_kernel(
    x_ptr, q_ptr, scale_ptr, partial_ptr,
    rows, cols, cols_per_program, n_partials, stride_xr, stride_xc, stride_qr, stride_sr, stride_sc,
    MODE: tl.constexpr, NUM_PARTIALS: tl.constexpr, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr,
    ROUND_BY_HAND: tl.constexpr, SHIFT: tl.constexpr, ROUND_MASK: tl.constexpr, MIN_NORMAL: tl.constexpr,
    SUBNORMAL_MAGIC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Quantize rows [pid0 * BLOCK_R, +BLOCK_R) x columns [pid1 * cols_per_program, +cols_per_program).

    MODE 0 (tensor): the amax is the max of the pass-1 partials (``n_partials`` of them); one column tile.
    MODE 1 (row): the program's columns are the whole row, read twice (amax, then cast; the second read
    mostly hits L2). MODE 2 (1x128): one 128-column group, a scale per row. MODE 3 (128x128): BLOCK_R = 128
    rows of one 128-column group, one scale. ``scale = max(amax, AMAX_FLOOR) / FP8_MAX``; ``q = x / scale``
    saturated to +-FP8_MAX. Bytes: x read once (twice for long rows), q written once, the scales.
    """
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    o_r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    m_r = o_r < rows
    o_c = tl.arange(0, BLOCK_C)
    c_start = pid_c * cols_per_program
    c_end = tl.minimum(c_start + cols_per_program, cols)
    if MODE == 0:
        o_p = tl.arange(0, NUM_PARTIALS)
        b_p = tl.load(partial_ptr + o_p, mask=o_p < n_partials, other=0.0)
        amax = tl.max(b_p, axis=0)
        b_amax = tl.zeros((BLOCK_R,), dtype=tl.float32) + amax
    else:
        b_amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for c in range(c_start, c_end, BLOCK_C):
            o = c + o_c
            m = m_r[:, None] & (o < c_end)[None, :]
            p_x = x_ptr + o_r[:, None] * stride_xr + o.to(tl.int64)[None, :] * stride_xc
            b_x = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
            b_amax = tl.maximum(b_amax, tl.max(tl.abs(b_x), axis=1))
        if MODE == 3:
            b_amax = tl.zeros((BLOCK_R,), dtype=tl.float32) + tl.max(b_amax, axis=0)
    # div_rn, not `/`: compiled Triton divides float32 approximately (div.full.f32, up to 2 ulp), and the
    # scale and the bytes are to be PyTorch's (torch divides rounded to nearest)
    b_scale = tl.div_rn(tl.maximum(b_amax, AMAX_FLOOR), FP8_MAX)  # [BR]
    if MODE == 0:
        # program (0, 0) writes the one scale
        tl.store(scale_ptr + tl.arange(0, BLOCK_R), b_scale, mask=(tl.arange(0, BLOCK_R) + pid_r + pid_c) < 1)
    elif MODE == 3:
        p_s = scale_ptr + pid_r * stride_sr + pid_c * stride_sc + tl.arange(0, BLOCK_R)
        tl.store(p_s, b_scale, mask=tl.arange(0, BLOCK_R) < 1)
    else:  # one scale per row (MODE 1: column 0; MODE 2: this program's 128-column group)
        tl.store(scale_ptr + o_r * stride_sr + pid_c * stride_sc, b_scale, mask=m_r)
    for c in range(c_start, c_end, BLOCK_C):
        o = c + o_c
        m = m_r[:, None] & (o < c_end)[None, :]
        p_x = x_ptr + o_r[:, None] * stride_xr + o.to(tl.int64)[None, :] * stride_xc
        b_x = tl.load(p_x, mask=m, other=0.0).to(tl.float32)
        b_q = to_fp8(tl.div_rn(b_x, b_scale[:, None]), FP8_MAX=FP8_MAX, ROUND_BY_HAND=ROUND_BY_HAND,
                     SHIFT=SHIFT, ROUND_MASK=ROUND_MASK, MIN_NORMAL=MIN_NORMAL,
                     SUBNORMAL_MAGIC=SUBNORMAL_MAGIC, dtype=q_ptr.dtype.element_ty)  # fmt: skip
        tl.store(q_ptr + o_r[:, None] * stride_qr + o.to(tl.int64)[None, :], b_q, mask=m)


@triton.jit
def _block_scales(sa_ptr, sb_ptr, offs_am, n_block, k_tile, stride_sam, stride_sak, stride_sbk, stride_sbn,
                  SCALE_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """The scale of each row's product at K step ``k_tile``: A's scale of the row times B's of the tile's
    128 x 128 block (one value: the tile's columns lie in one 128-wide block, ``n_block``) [BM]."""
    group = (k_tile * BLOCK_K) // SCALE_BLOCK
    b_sa = tl.load(sa_ptr + offs_am * stride_sam + group * stride_sak)
    return b_sa * tl.load(sb_ptr + group * stride_sbk + n_block * stride_sbn)


@triton.jit
def _block_scaled_product(
    a_ptr, b_ptr, sa_ptr, sb_ptr, offs_am, offs_bl, offs_br, n_block, K, stride_am, stride_ak, stride_bk,
    stride_bn, stride_sam, stride_sak, stride_sbk, stride_sbn, SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The block-scaled product's left and right column halves ``(acc_l, acc_r)`` [BM, BN/2], each K step's
    product scaled by its rows' scales before it joins its accumulator.

    A K step's product must be finished before it is scaled, and Triton 3.6 waits for a wgmma whose result
    the loop uses at once. So the two halves alternate: step k's left product is waited for; step k-1's
    right product (carried from the last iteration, finished by that wait) is scaled into ``acc_r``; step k's
    right product is issued and left in flight (its result only goes to the next iteration, whose uses follow
    the first wait: Triton's pipeliner makes it asynchronous); the left product is scaled into ``acc_l``
    beside it, on the CUDA cores. The carried product's registers are dead before the next one is issued,
    so no copy reads a product in flight (ptxas would serialize every wgmma). The first step is peeled off;
    the loop sits in an ``if`` so that the wait after it does not keep the first step's tiles allocated."""
    HALF: tl.constexpr = BLOCK_N // 2
    offs_k = tl.arange(0, BLOCK_K)
    offs_k64 = offs_k.to(tl.int64)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k64[None, :] * stride_ak
    bl_ptrs = b_ptr + offs_k64[:, None] * stride_bk + offs_bl[None, :] * stride_bn
    br_ptrs = b_ptr + offs_k64[:, None] * stride_bk + offs_br[None, :] * stride_bn
    a_step = tl.full((), BLOCK_K, tl.int64) * stride_ak
    b_step = tl.full((), BLOCK_K, tl.int64) * stride_bk
    kept = K > 0  # always true (K = 0 launches nothing); the compiler cannot tell
    b_a = tl.load(a_ptrs, mask=offs_k[None, :] < K, other=0.0)
    b_bl = tl.load(bl_ptrs, mask=offs_k[:, None] < K, other=0.0)
    b_br = tl.load(br_ptrs, mask=offs_k[:, None] < K, other=0.0)
    b_s = _block_scales(sa_ptr, sb_ptr, offs_am, n_block, 0, stride_sam, stride_sak, stride_sbk, stride_sbn,
                        SCALE_BLOCK=SCALE_BLOCK, BLOCK_K=BLOCK_K)  # fmt: skip
    acc_l = tl.dot(b_a, b_bl) * b_s[:, None]
    # "kept *": the wait after the loop looks through its operands for the products it waits on, and would
    # keep this step's tiles allocated through the loop
    p_r = kept.to(tl.float32) * tl.dot(b_a, b_br)
    acc_r = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
    if K > BLOCK_K:
        for k_tile in range(1, tl.cdiv(K, BLOCK_K)):
            k_left = K - k_tile * BLOCK_K
            b_a = tl.load(a_ptrs + k_tile * a_step, mask=offs_k[None, :] < k_left, other=0.0)
            b_bl = tl.load(bl_ptrs + k_tile * b_step, mask=offs_k[:, None] < k_left, other=0.0)
            b_br = tl.load(br_ptrs + k_tile * b_step, mask=offs_k[:, None] < k_left, other=0.0)
            p_l = tl.dot(b_a, b_bl)
            acc_r += p_r * b_s[:, None]  # step k-1's right product, at step k-1's scales
            p_r = tl.dot(b_a, b_br)
            b_s = _block_scales(
                sa_ptr, sb_ptr, offs_am, n_block, k_tile, stride_sam, stride_sak, stride_sbk, stride_sbn,
                SCALE_BLOCK=SCALE_BLOCK, BLOCK_K=BLOCK_K,
            )  # fmt: skip
            acc_l += p_l * b_s[:, None]
    acc_r += p_r * b_s[:, None]
    return acc_l, acc_r


@triton.jit
def _gemm_fp8_epilogue(acc, offs_m, offs_n, M, N, bias_ptr, out_ptr, stride_om, stride_on, stride_bias,
                       HAS_BIAS: tl.constexpr, RNE_BY_HAND: tl.constexpr):  # fmt: skip
    """``out[offs_m, offs_n] = acc (+ bias)`` in out's dtype, masked to [M, N]."""
    mask_n = offs_n < N
    if HAS_BIAS:
        b_bias = tl.load(bias_ptr + offs_n.to(tl.int64) * stride_bias, mask=mask_n, other=0.0)
        acc += b_bias.to(tl.float32)[None, :]
    mask = (offs_m < M)[:, None] & mask_n[None, :]
    p_out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    tl.store(p_out, cast(acc, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=mask)


@triton.jit
def _gemm_fp8_kernel(
    a_ptr, b_ptr, sa_ptr, sb_ptr, bias_ptr, out_ptr,
    M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_sam, stride_sak, stride_sbk, stride_sbn,
    stride_om, stride_on, stride_bias,
    SCALING: tl.constexpr, HAS_BIAS: tl.constexpr, RNE_BY_HAND: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """``out = (A * sa) @ (B * sb) + bias`` for fp8 A [M, K] and B [K, N] (any strides), fp32 accumulation.

    SCALING 0 (tensor): one scale each, applied once in the epilogue. SCALING 1 (row): sa per row of A
    (``sa_ptr + m * stride_sam``), sb per column of B (``sb_ptr + n * stride_sbn``), in the epilogue. SCALING
    2 (block): sa per (row, 128-wide K group) and sb per (128 K x 128 N block); each K step's product is
    scaled before it joins the accumulator (:func:`_block_scaled_product`: the tile's two column halves
    alternate so that one half's scaling runs beside the other's product), so BLOCK_K must divide
    SCALE_BLOCK (a step never straddles two groups); a partial last group is masked to zeros like any K tail.
    Edge rows/columns re-read a valid row/column (modulo), so only K is masked in the loop; the store is
    masked.

    FLOPs: 2 * M * N * K. Minimum bytes: M*K + K*N (one byte each) + M*N*out_bytes, plus the scales
    (block: 4 * (M * K/128 + K/128 * N/128)) and N*bias_bytes.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M=GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am = (offs_m % M).to(tl.int64)
    if SCALING == 2:
        tl.static_assert(SCALE_BLOCK % BLOCK_N == 0, "a tile's columns must lie in one scaling block")
        offs_l = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        offs_r = offs_l + BLOCK_N // 2
        acc_l, acc_r = _block_scaled_product(
            a_ptr, b_ptr, sa_ptr, sb_ptr, offs_am, (offs_l % N).to(tl.int64), (offs_r % N).to(tl.int64),
            (pid_n * BLOCK_N) // SCALE_BLOCK, K, stride_am, stride_ak, stride_bk, stride_bn, stride_sam,
            stride_sak, stride_sbk, stride_sbn, SCALE_BLOCK=SCALE_BLOCK, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
        )  # fmt: skip
        _gemm_fp8_epilogue(acc_l, offs_m, offs_l, M, N, bias_ptr, out_ptr, stride_om, stride_on, stride_bias,
                           HAS_BIAS=HAS_BIAS, RNE_BY_HAND=RNE_BY_HAND)  # fmt: skip
        _gemm_fp8_epilogue(acc_r, offs_m, offs_r, M, N, bias_ptr, out_ptr, stride_om, stride_on, stride_bias,
                           HAS_BIAS=HAS_BIAS, RNE_BY_HAND=RNE_BY_HAND)  # fmt: skip
    else:
        offs_k = tl.arange(0, BLOCK_K)
        offs_bn = (offs_n % N).to(tl.int64)
        offs_k64 = offs_k.to(tl.int64)
        a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k64[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k64[:, None] * stride_bk + offs_bn[None, :] * stride_bn
        a_step = tl.full((), BLOCK_K, tl.int64) * stride_ak
        b_step = tl.full((), BLOCK_K, tl.int64) * stride_bk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
            k_left = K - k_tile * BLOCK_K
            b_a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)  # [BM, BK]
            b_b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)  # [BK, BN]
            acc = tl.dot(b_a, b_b, acc)
            a_ptrs += a_step
            b_ptrs += b_step
        # (tensor: the plan's strides are 0, every lane reads the one scale)
        b_sa = tl.load(sa_ptr + offs_am * stride_sam)
        b_sb = tl.load(sb_ptr + offs_bn * stride_sbn)
        # the scales' product first, as torch._scaled_mm: acc * scale_a alone can overflow (a ~ 1e37)
        acc = acc * (b_sa[:, None] * b_sb[None, :])
        _gemm_fp8_epilogue(acc, offs_m, offs_n, M, N, bias_ptr, out_ptr, stride_om, stride_on, stride_bias,
                           HAS_BIAS=HAS_BIAS, RNE_BY_HAND=RNE_BY_HAND)  # fmt: skip


# --- launcher -------------------------------------------------------------------------------------------

AMAX = Kernel(_amax_partial_kernel, "matmul.fp8_amax")
QUANTIZE = Kernel(_quantize_fp8_kernel, "matmul.fp8_quantize")
GEMM = Kernel(_gemm_fp8_kernel, "matmul.gemm_fp8")
AMAX_KERNEL, QUANTIZE_KERNEL, GEMM_KERNEL = AMAX.name, QUANTIZE.name, GEMM.name

# Pass 1 of per-tensor scaling runs at most this many programs per SM (fewer when there are fewer row
# blocks); the interpreter runs INTERPRETER_AMAX_PROGRAMS, so its programs still each walk several blocks.
AMAX_PROGRAMS_PER_SM = 2
INTERPRETER_AMAX_PROGRAMS = 3
# Elements a quantize program holds per step (rows x columns of its tile).
QUANTIZE_TILE_ELEMENTS = 4096


def fp8_constants(dtype: torch.dtype) -> dict:
    """The rounding constexprs of :func:`to_fp8` for ``dtype`` (mantissa bits, smallest normal)."""
    mantissa, min_exp = (3, -6) if dtype == torch.float8_e4m3fn else (2, -14)
    shift = 23 - mantissa
    return dict(
        FP8_MAX=FP8_MAX[dtype], SHIFT=shift, ROUND_MASK=(0xFFFFFFFF << shift) & 0xFFFFFFFF,
        MIN_NORMAL=2.0**min_exp, SUBNORMAL_MAGIC=2.0 ** (min_exp - mantissa + 23),
        ROUND_BY_HAND=runtime.INTERPRETED,
    )  # fmt: skip


@functools.cache
def quantize_config(rows: int, cols: int, granularity: str, hardware: Hardware, interpreted: bool):
    """The quantize kernel's tile (block_m rows x block_n columns), warps, and, for "tensor", the number of
    pass-1 programs (``splits``). Pure and cached.

    1x128 and 128x128 take one 128-column group per program (128x128: all 128 rows of the block). "row" and
    "tensor" take up to 1024 columns per step and as many rows as make :data:`QUANTIZE_TILE_ELEMENTS`.
    """
    if granularity == "128x128":
        return KernelConfig(BLOCK, BLOCK, num_warps=8, num_stages=1)
    if granularity == "1x128":
        block_c = BLOCK
    else:
        block_c = min(next_power_of_2(max(cols, 16)), 1024)
    block_r = max(1, min(next_power_of_2(rows), QUANTIZE_TILE_ELEMENTS // block_c))
    warps = min(8, max(1, block_r * block_c // 512))
    splits = 1
    if granularity == "tensor":
        cap = INTERPRETER_AMAX_PROGRAMS if interpreted else AMAX_PROGRAMS_PER_SM * hardware.sm_count
        splits = max(1, min(cap, cdiv(rows, block_r)))
    return KernelConfig(block_r, block_c, num_warps=warps, num_stages=1, splits=splits)


def scale_shape(rows: int, cols: int, granularity: str) -> tuple[int, ...]:
    """The shape of ``quantize_fp8``'s scale: [], [rows, 1], [rows, cdiv(cols, 128)], or
    [cdiv(rows, 128), cdiv(cols, 128)]."""
    if granularity == "tensor":
        return ()
    if granularity == "row":
        return (rows, 1)
    if granularity == "1x128":
        return (rows, cdiv(cols, BLOCK))
    return (cdiv(rows, BLOCK), cdiv(cols, BLOCK))


class _QuantizePlans:
    __slots__ = ("amax", "quantize", "scale_shape", "partials")

    def __init__(self, amax, quantize, scale_shape, partials):
        self.amax, self.quantize, self.scale_shape, self.partials = amax, quantize, scale_shape, partials


@plan_cache
def _quantize_plans(rows, cols, strides, x_dtype, dtype, granularity, device) -> _QuantizePlans:
    """The launches of one quantization class, keyed on shape, strides, both dtypes, granularity, device."""
    interpreted = runtime.INTERPRETED
    config = quantize_config(rows, cols, granularity, hardware_of(device), interpreted)
    block_r, block_c = config.block_m, config.block_n
    stride_xr, stride_xc = strides
    shape = scale_shape(rows, cols, granularity)
    if granularity == "row":
        grid, cols_per_program = (cdiv(rows, block_r), 1), cols
    else:
        grid, cols_per_program = (cdiv(rows, block_r), cdiv(cols, block_c)), block_c
    partials = config.splits if granularity == "tensor" else 1
    amax = None
    if granularity == "tensor":
        amax = AMAX.plan(
            (partials,), rows=rows, cols=cols, stride_xr=stride_xr, stride_xc=stride_xc,
            row_blocks=cdiv(rows, block_r), NUM_PROGRAMS=partials, BLOCK_R=block_r, BLOCK_C=block_c,
            num_warps=config.num_warps, num_stages=1,
        )  # fmt: skip
    quantize = QUANTIZE.plan(
        grid, rows=rows, cols=cols, cols_per_program=cols_per_program, n_partials=partials,
        stride_xr=stride_xr, stride_xc=stride_xc, stride_qr=cols,
        stride_sr=shape[1] if len(shape) == 2 else 0, stride_sc=1 if len(shape) == 2 else 0,
        MODE=_MODES[granularity], NUM_PARTIALS=next_power_of_2(partials), AMAX_FLOOR=AMAX_FLOOR,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=config.num_warps, num_stages=1, **fp8_constants(dtype),
    )  # fmt: skip
    return _QuantizePlans(amax, quantize, shape, partials)


def quantize_forward(x: torch.Tensor, dtype: torch.dtype, granularity: str):
    """(x_fp8 [rows, cols] contiguous, scale float32) of 2-D ``x`` (any strides): the unchecked forward
    behind ``llm_speed::quantize_fp8``; reports its work."""
    rows, cols = x.shape
    device = x.device
    if rows and cols and runtime.observed():
        runtime.report_work("quantize_fp8", x=x, dtype=dtype, granularity=granularity)
    if not runtime.triton_runs_on(device):
        return reference.quantize_fp8_reference(x, dtype, _granularity_value(granularity))
    plans = _quantize_plans(rows, cols, x.stride(), x.dtype, dtype, granularity, device)
    q = tensors.new_output((rows, cols), dtype, device)
    scale = tensors.new_output(plans.scale_shape, torch.float32, device)
    if rows == 0 or cols == 0:
        if scale.numel():  # an empty tensor's amax is 0: the floored scale (nothing reads the values)
            scale.fill_(AMAX_FLOOR / FP8_MAX[dtype])
        return q, scale
    partials = scale
    if plans.amax is not None:
        partials = tensors.new_output((plans.partials,), torch.float32, device)
        plans.amax.launch(x_ptr=x, partial_ptr=partials)
    plans.quantize.launch(x_ptr=x, q_ptr=q, scale_ptr=scale, partial_ptr=partials)
    return q, scale


def _granularity_value(name: str):
    return {"1x128": (1, BLOCK), "128x128": (BLOCK, BLOCK)}.get(name, name)


# The fp8 GEMM's tiles on devices with 227 KB of shared memory per block (H100, H200, B200): BLOCK_K 128
# (one scaling block, the K a 64-row fp8 wgmma consumes in 4 steps of 32), 3-4 stages.
GEMM_CONFIGS = (
    gemm_tile(128, 256, 128, 8, 3),
    gemm_tile(128, 128, 128, 8, 4),
    gemm_tile(128, 128, 128, 4, 4),
    gemm_tile(128, 64, 128, 4, 4),
    gemm_tile(64, 128, 128, 4, 4),
    gemm_tile(64, 64, 128, 4, 4),
)
# The interpreter: 64x64 tiles (its cost is per program, not per element); BLOCK_K 64 divides 128, so
# a block-scaled K step stays inside one scaling group.
INTERPRETER_GEMM = KernelConfig(64, 64, num_warps=4, num_stages=1, block_k=64, group_m=4)


def candidate_gemm_configs(scaling: int, hardware: Hardware) -> tuple[KernelConfig, ...]:
    """The configurations :func:`gemm_fp8_config` chooses among: :data:`GEMM_CONFIGS` whose pipelined operands
    fit the shared memory per block (one byte per element), and for block scaling whose accumulator fits
    :func:`llm_speed.core.tile_choice.fits_block_scaling`; the smallest one if none is left."""
    pool = [c for c in GEMM_CONFIGS if shared_bytes(c, 1) <= hardware.smem_per_block_bytes]
    if scaling == BLOCKWISE:
        pool = [c for c in pool if fits_block_scaling(c.block_m, c.block_n, c.num_warps)]
    return tuple(pool) or (min(GEMM_CONFIGS, key=lambda c: shared_bytes(c, 1)),)


@functools.cache
def gemm_fp8_config(m: int, n: int, k: int, scaling: int, hardware: Hardware) -> KernelConfig:
    """The fp8 GEMM's configuration: :func:`llm_speed.core.tile_choice.choose_tile`'s rule (the 16-bit
    GEMM's) over :func:`candidate_gemm_configs`, one byte per operand element. Pure and cached; the
    interpreter runs :data:`INTERPRETER_GEMM`."""
    pool = candidate_gemm_configs(scaling, hardware)
    tiles = [(c.block_m, c.block_n, c.block_k) for c in pool]
    return pool[choose_tile(m, n, k, tiles, hardware.sm_count, element_bytes=1)]


@plan_cache
def _gemm_plan(a_shape, a_strides, b_shape, b_strides, trans_b, sa_layout, sb_layout, bias_stride, dtypes,
               device, config=None) -> Plan | None:  # fmt: skip
    """The plan of one fp8 GEMM class; keyed on shapes and strides of a, b and both scales, trans_b, bias's
    stride, the dtypes (a, b, bias, out), the device and a forced configuration (tests; None chooses).
    None for an empty output or K = 0 (nothing to launch)."""
    m, k = a_shape
    n = b_shape[0] if trans_b else b_shape[1]
    if m == 0 or n == 0 or k == 0:  # (K = 0: no product; gemm_forward writes the bias or zeros)
        return None
    scaling = scaling_of(m, n, k, sa_layout[0], sb_layout[0], trans_b)
    stride_bk, stride_bn = (b_strides[1], b_strides[0]) if trans_b else b_strides
    if scaling == TENSOR:  # one value each, whatever its shape ([], [1], [1, 1]): every lane reads it
        sa_strides = sb_strides = (0, 0)
    else:
        sa_strides, sb_strides = tuple(sa_layout[1]), tuple(sb_layout[1])
    stride_sbk, stride_sbn = (sb_strides[1], sb_strides[0]) if trans_b else sb_strides
    if config is not None:
        pass
    elif runtime.INTERPRETED:
        config = INTERPRETER_GEMM
    else:
        config = gemm_fp8_config(m, n, k, scaling, hardware_of(device))
    out_dtype = dtypes[3]
    return GEMM.plan(
        (cdiv(m, config.block_m) * cdiv(n, config.block_n),), M=m, N=n, K=k,
        stride_am=a_strides[0], stride_ak=a_strides[1], stride_bk=stride_bk, stride_bn=stride_bn,
        stride_sam=sa_strides[0], stride_sak=sa_strides[1], stride_sbk=stride_sbk, stride_sbn=stride_sbn,
        stride_om=n, stride_on=1, stride_bias=bias_stride or 0, SCALING=scaling,
        HAS_BIAS=bias_stride is not None, RNE_BY_HAND=rne_by_hand(out_dtype), SCALE_BLOCK=BLOCK,
        **config.meta(), num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def planned_gemm(a, b, scale_a, scale_b, bias, out_dtype, trans_b, config=None) -> Plan | None:
    """The plan :func:`gemm_forward` launches for these arguments, or with ``config`` forced (tests compile
    exactly it)."""
    return _gemm_plan(
        a.shape, a.stride(), b.shape, b.stride(), trans_b, (scale_a.shape, scale_a.stride()),
        (scale_b.shape, scale_b.stride()), None if bias is None else bias.stride(0),
        (a.dtype, b.dtype, None if bias is None else bias.dtype, out_dtype), a.device, config,
    )  # fmt: skip


def _gluon_takes(a, b, scale_a, scale_b, out_dtype, trans_b) -> bool:
    """Whether the warp-specialized Gluon kernel runs this call: only under a policy that turns it on (off as
    shipped: one attribute read, the Gluon package not imported), and only for the calls
    :func:`llm_speed.gluon.gemm_fp8_select.gluon_gemm_fp8_applies` takes (block scaling, b [N, K], sm_90)."""
    if not current_policy().gluon_gemm_fp8:
        return False
    from ..gluon.gemm_fp8_select import gluon_gemm_fp8_applies

    return gluon_gemm_fp8_applies(a, b, scale_a, scale_b, out_dtype, trans_b)


def gemm_forward(a, b, scale_a, scale_b, bias, out_dtype, trans_b) -> torch.Tensor:
    """The unchecked forward behind ``llm_speed::gemm_fp8``; reports its work."""
    device = a.device
    m = a.shape[0]
    n = b.shape[0] if trans_b else b.shape[1]
    if not runtime.triton_runs_on(device):
        out = reference.gemm_fp8_reference(a, b, scale_a, scale_b, bias=bias, out_dtype=out_dtype,
                                           trans_b=trans_b, compute_dtype=torch.float32)  # fmt: skip
    elif _gluon_takes(a, b, scale_a, scale_b, out_dtype, trans_b):
        from ..gluon.gemm_fp8 import gemm_fp8 as gluon_gemm_fp8

        out = gluon_gemm_fp8(a, b, scale_a, scale_b, out_dtype=out_dtype, bias=bias)
    else:
        if a.stride(1) != 1 or b.stride(1 if trans_b else 0) != 1:  # wgmma's 8-bit layout: K-major
            a, b = tensors.k_major(a, -1), tensors.k_major(b, -1 if trans_b else -2)
        plan = planned_gemm(a, b, scale_a, scale_b, bias, out_dtype, trans_b)
        out = tensors.new_output((m, n), out_dtype, device)
        if plan is not None:
            plan.launch(a_ptr=a, b_ptr=b, sa_ptr=scale_a, sb_ptr=scale_b,
                        bias_ptr=out if bias is None else bias, out_ptr=out)  # fmt: skip
        elif out.numel() and bias is not None:  # K = 0: the empty sum (block scales have no K group to read)
            out.copy_(bias.expand(m, n))
        elif out.numel():
            out.zero_()
    if m and n and runtime.observed():
        runtime.report_work("gemm_fp8", op_a=a, op_b=b.mT if trans_b else b, out=out)
    return out


# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::quantize_fp8", mutates_args=())
def _quantize_op(x: torch.Tensor, dtype: torch.dtype, granularity: str) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_forward(x, dtype, granularity)


@_quantize_op.register_fake
def _quantize_fake(x, dtype, granularity):
    rows, cols = x.shape
    return x.new_empty((rows, cols), dtype=dtype), x.new_empty(
        scale_shape(rows, cols, granularity), dtype=torch.float32
    )


_quantize_call = Op(_quantize_op, quantize_forward)


@torch.library.custom_op("llm_speed::gemm_fp8", mutates_args=())
def _gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
    trans_b: bool,
) -> torch.Tensor:
    return gemm_forward(a, b, scale_a, scale_b, bias, out_dtype, trans_b)


@_gemm_op.register_fake
def _gemm_fake(a, b, scale_a, scale_b, bias, out_dtype, trans_b):
    return a.new_empty((a.shape[0], b.shape[0] if trans_b else b.shape[1]), dtype=out_dtype)


_gemm_call = Op(_gemm_op, gemm_forward)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
LINEAR_GRANULARITIES = ("tensor", "row")


def linear_forward(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, granularity: str):
    """``x2d @ weight.T + bias`` with x2d and weight quantized to e4m3 at ``granularity`` ("tensor" or
    "row"), in x2d's dtype: the forward of ``llm_speed::float8_linear``."""
    x_q, x_s = quantize_forward(x2d, E4M3, granularity)
    w_q, w_s = quantize_forward(weight, E4M3, granularity)
    return gemm_forward(x_q, w_q, x_s, w_s, bias, x2d.dtype, True)


@torch.library.custom_op("llm_speed::float8_linear", mutates_args=())
def _linear_op(
    x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, granularity: str
) -> torch.Tensor:
    return linear_forward(x2d, weight, bias, granularity)


@_linear_op.register_fake
def _linear_fake(x2d, weight, bias, granularity):
    return x2d.new_empty((x2d.shape[0], weight.shape[0]))


@torch.library.custom_op("llm_speed::float8_linear_backward", mutates_args=())
def _linear_backward_op(
    grad: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, granularity: str, need_x: bool, need_w: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return linear_backward(grad, x2d, weight, granularity, need_x, need_w)


@_linear_backward_op.register_fake
def _linear_backward_fake(grad, x2d, weight, granularity, need_x, need_w):
    return torch.empty_like(x2d), torch.empty_like(weight)


# --- autograd -------------------------------------------------------------------------------------------


def linear_backward(grad, x2d, weight, granularity, need_x=True, need_w=True):
    """(grad_x, grad_weight) of :func:`linear_forward`, both through the fp8 kernels: the output gradient
    quantized to e5m2, the saved input and weight requantized to e4m3 along the dim each product reduces
    over (per tensor: the same scales; per row: ``x.T`` and ``weight.T`` per row, i.e. per column of x and
    weight, and the gradient per row for grad_x and per column for grad_weight, as torchao's rowwise
    recipe). An unneeded gradient is returned empty-shaped (zeros are not computed)."""
    grad = tensors.last_dim_contiguous(grad)
    grad_x = grad_w = None
    if granularity == "tensor":
        g_q, g_s = quantize_forward(grad, E5M2, "tensor")
        if need_x:  # [M, N] @ [N, K]: the weight as stored is B
            w_q, w_s = quantize_forward(weight, E4M3, "tensor")
            grad_x = gemm_forward(g_q, w_q, g_s, w_s, None, x2d.dtype, False)
        if need_w:  # [N, M] @ [M, K]: the gradient's transposed view is A
            x_q, x_s = quantize_forward(x2d, E4M3, "tensor")
            grad_w = gemm_forward(g_q.mT, x_q, g_s, x_s, None, weight.dtype, False)
    else:
        if need_x:  # grad rows x weight columns (weight.T rows), both reducing over N
            g_q, g_s = quantize_forward(grad, E5M2, "row")
            wt_q, wt_s = quantize_forward(weight.mT, E4M3, "row")
            grad_x = gemm_forward(g_q, wt_q, g_s, wt_s, None, x2d.dtype, True)
        if need_w:  # grad columns x input columns, both reducing over M
            gt_q, gt_s = quantize_forward(grad.mT, E5M2, "row")
            xt_q, xt_s = quantize_forward(x2d.mT, E4M3, "row")
            grad_w = gemm_forward(gt_q, xt_q, gt_s, xt_s, None, weight.dtype, True)
    if grad_x is None:
        grad_x = x2d.new_empty(x2d.shape)
    if grad_w is None:
        grad_w = weight.new_empty(weight.shape)
    return grad_x, grad_w


_linear_backward_call = Op(_linear_backward_op, linear_backward)


def _setup_context(ctx, inputs, output) -> None:
    x2d, weight, bias, granularity = inputs
    ctx.save_for_backward(x2d, weight)
    ctx.granularity = granularity
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ctx, grad):
    x2d, weight = ctx.saved_tensors
    need_x, need_w, need_bias = ctx.needs_input_grad[:3]
    grad_x = grad_w = grad_bias = None
    if need_x or need_w:
        grad_x, grad_w = _linear_backward_call(grad, x2d, weight, ctx.granularity, bool(need_x), bool(need_w))
    if need_bias and ctx.has_bias:
        grad_bias = grad.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
    return grad_x if need_x else None, grad_w if need_w else None, grad_bias, None


_linear_call = Op(_linear_op, linear_forward, setup_context=_setup_context, backward=_backward)
# Under torch.autocast x takes the autocast dtype (so the output does, as nn.Linear's); the weight keeps its
# own, quantized from it as torchao's Float8Linear does (its "autocast logic for F.linear").
_linear_autocast = autocast.dispatch(_linear_call, autocast.LOWER, (0,))


# --- public functions -----------------------------------------------------------------------------------


def check_granularity(granularity) -> str:
    """The schema name of a granularity ("tensor", "row", (1, 128), (128, 128)); ValueError otherwise."""
    key = tuple(granularity) if isinstance(granularity, (list, tuple)) else granularity
    try:
        return _NAMES[key]
    except (KeyError, TypeError):
        raise ValueError(
            f"granularity must be one of 'tensor', 'row', (1, 128), (128, 128), got {granularity!r}"
        ) from None


def quantize_fp8(
    x: torch.Tensor, *, dtype: torch.dtype = torch.float8_e4m3fn, granularity="tensor"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize 2-D ``x`` [rows, cols] to fp8: ``(x_fp8, scale)`` with ``x ~= x_fp8.float() * scale``.

    Args:
        x: float16, bfloat16 or float32, any strides (a transposed view is read in place).
        dtype: ``torch.float8_e4m3fn`` (forward operands, max 448) or ``torch.float8_e5m2`` (gradients, max
            57344).
        granularity: "tensor" (scale ``[]``), "row" (``[rows, 1]``), ``(1, 128)`` (``[rows, cdiv(cols,
            128)]``: per row and 128-column group) or ``(128, 128)`` (``[cdiv(rows, 128), cdiv(cols,
            128)]``). A last group narrower than 128 is scaled on its own elements.

    ``scale = max(amax, 1e-12) / fp8_max`` in float32 over each group; ``x_fp8 = saturate(x / scale)``,
    rounded to nearest even. ``x`` must be finite: an inf or NaN makes its group's scale non-finite (every
    element of the group 0 or NaN), so where values are checked (``runtime.check_values``: CPU tensors) it is
    refused. One fused kernel (amax and cast) per call; "tensor" adds a first pass that
    writes per-program partial amaxes (no host read, see the module docstring). Not differentiable. Returns
    ``x_fp8`` contiguous.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, dims=2, what="[rows, cols]")
    if dtype not in FP8_DTYPES:
        raise TypeError(f"dtype must be one of {dtype_names(FP8_DTYPES)}, got {dtype}")
    name = check_granularity(granularity)
    if runtime.check_values(x.device):
        runtime.check_finite("x", x, " (its amax sets the scale)")
    return _quantize_call(x, dtype, name)


def check_scale_values(*named) -> None:
    """Scales or descales ``(name, tensor or None)`` finite and > 0 (a host read: only where
    ``runtime.check_values``)."""
    for name, t in named:
        if t is None:
            continue
        bad = ~(torch.isfinite(t) & (t > 0))
        if bool(bad.any()):
            raise ValueError(f"{name} must be finite and > 0, got {t.reshape(-1)[bad.reshape(-1)][0].item()}")


def _check_scale(name: str, scale) -> None:
    check_tensor(name, scale, dtypes=(torch.float32,))
    if scale.dim() > 2:
        raise ValueError(f"{name} must have at most 2 dims, got shape {tuple(scale.shape)}")


def gemm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    trans_b: bool = False,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) + bias`` for fp8 ``a`` [M, K] and ``b`` [K, N] (``trans_b``: b is
    [N, K], an ``nn.Linear`` weight), accumulated in float32, returned in ``out_dtype``.

    dtypes: a and b each ``float8_e4m3fn`` or ``float8_e5m2`` (mixed is fine: e5m2 gradients times e4m3
    weights); scales float32; any strides. The granularity comes from the scale shapes (b's read against
    b as stored):

    - tensor x tensor: both scales ``[]``, ``[1]`` or ``[1, 1]``;
    - row x row: scale_a ``[M, 1]``, scale_b ``[1, N]`` (``[N, 1]`` when trans_b), as ``torch._scaled_mm``;
    - 1x128 x 128x128 (DeepSeek-V3): scale_a ``[M, cdiv(K, 128)]``, scale_b ``[cdiv(K, 128), cdiv(N,
      128)]`` (``[cdiv(N, 128), cdiv(K, 128)]`` when trans_b); K need not be a multiple of 128.

    bias: ``[N]``, float16, bfloat16 or float32, added in float32. out_dtype: bfloat16, float16 or
    float32. Same result as ``torch._scaled_mm(a, b, scale_a, scale_b, bias, out_dtype=...)`` where both
    accept the arguments (with b given there as the [K, N] view). Not differentiable (see
    :func:`float8_linear` for training). M, N or K of 0 is allowed.
    """
    fp8 = FP8_DTYPES
    check_tensor("a", a, dtypes=fp8, dims=2, what="[M, K]")
    check_tensor("b", b, dtypes=fp8, dims=2, what="[N, K]" if trans_b else "[K, N]")
    trans_b = check_flag("trans_b", trans_b)
    _check_scale("scale_a", scale_a)
    _check_scale("scale_b", scale_b)
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {dtype_names(OUT_DTYPES)}, got {out_dtype}")
    m, k = a.shape
    k_b, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != k_b:
        raise ValueError(
            f"a [{m}, {k}] and b {list(b.shape)} (trans_b={trans_b}) do not share K: {k} != {k_b}"
        )
    if bias is not None:
        check_tensor("bias", bias, dims=1, what="[N]")
        if bias.shape[0] != n:
            raise ValueError(f"bias has {bias.shape[0]} elements; it must have N = {n}")
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    scaling_of(m, n, k, tuple(scale_a.shape), tuple(scale_b.shape), trans_b)  # ValueError before any work
    if runtime.check_values(a.device):
        check_scale_values(("scale_a", scale_a), ("scale_b", scale_b))
    return _gemm_call(a, b, scale_a, scale_b, bias, out_dtype, trans_b)


def float8_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, granularity: str = "tensor"
) -> torch.Tensor:
    """``x @ weight.T + bias`` in fp8, differentiable: x and weight quantized dynamically to e4m3 ("tensor" or
    "row" scaling), the output gradient to e5m2, grad_x and grad_weight through :func:`gemm_fp8`'s kernel
    (torchao float8 training semantics). x ``[..., K]`` float16/bfloat16/float32 (the output has its dtype;
    under ``torch.autocast`` x is cast to the autocast dtype first, as torchao does); weight ``[N, K]`` any
    float dtype (the weight gradient has its dtype); bias ``[N]``. K of 0 gives the bias rows (zeros without
    one)."""
    check_tensor("x", x)
    x = autocast.cast_inputs(autocast.LOWER, x)[0]
    check_tensor("weight", weight, dims=2, what="[out_features, in_features]")
    if x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x's last dim ({x.shape[-1] if x.dim() else None}) must be weight's in_features "
                         f"({weight.shape[1]})")  # fmt: skip
    if bias is not None:
        check_tensor("bias", bias, dims=1, what="[out_features]")
        if bias.shape[0] != weight.shape[0]:
            raise ValueError(
                f"bias has {bias.shape[0]} elements; it must have out_features = {weight.shape[0]}"
            )
    check_same_device(x=x, weight=weight, bias=bias)
    granularity = check_choice("granularity", granularity, LINEAR_GRANULARITIES)
    # (rows named, not -1: with K = 0 a reshape cannot infer them)
    x2d = tensors.last_dim_contiguous(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]))
    out = _linear_autocast(x2d, weight, bias, granularity)
    return out.reshape(*x.shape[:-1], weight.shape[0])


__all__ = ["float8_linear", "gemm_fp8", "gemm_fp8_config", "quantize_config", "quantize_fp8", "scaling_of"]
