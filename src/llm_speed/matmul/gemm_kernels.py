"""The kernels of :mod:`llm_speed.matmul.gemm`: the tiled kernel (every dtype, layout and batch) and the
persistent TMA kernel (Hopper and later), their shared epilogue and grouped tile order."""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.kernel_math import cast, dot
from ..core.launch import (
    Kernel,
)  # fmt: skip

# Constants of the activation formulas (not tuning knobs).
_SQRT_HALF = tl.constexpr(0.7071067811865476)  # 1 / sqrt(2), for the erf form of GELU
_SQRT_TWO_OVER_PI = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi), for the tanh form of GELU
_GELU_CUBIC = tl.constexpr(0.044715)  # the cubic coefficient of the tanh form of GELU


@triton.jit
def grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Map a linear tile index to (pid_m, pid_n) so GROUP_M consecutive programs share B columns in L2.

    Tiles are visited column by column inside bands of GROUP_M tile rows: programs running at the same time
    read the same few B tiles and the same GROUP_M A tiles, instead of sweeping all of B per tile row.
    """
    tiles_per_group = GROUP_M * num_pid_n
    group_id = tile_id // tiles_per_group
    first_pid_m = group_id * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (tile_id % tiles_per_group) % group_rows
    pid_n = (tile_id % tiles_per_group) // group_rows
    return pid_m, pid_n


@triton.jit
def _activation(x, ACTIVATION: tl.constexpr):
    """Apply the named activation to an fp32 block (None leaves it as is)."""
    if ACTIVATION == "relu":
        x = tl.maximum(x, 0.0)
    elif ACTIVATION == "gelu":
        x = 0.5 * x * (1.0 + tl.math.erf(x * _SQRT_HALF))
    elif ACTIVATION == "gelu_tanh":
        # 0.5 * x * (1 + tanh(u)) == x * sigmoid(2u): no tanh needed.
        inner = _SQRT_TWO_OVER_PI * (x + _GELU_CUBIC * x * x * x)
        x = x * tl.sigmoid(2.0 * inner)
    elif ACTIVATION == "silu":
        x = x * tl.sigmoid(x)
    return x


@triton.jit
def _epilogue(
    acc, offs_m, offs_n, M, N,
    c_ptr, stride_cm, stride_cn, bias_ptr, stride_bias, out_ptr, stride_om, stride_on,
    alpha, beta,
    HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, INTEGER: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """Scale, add beta*C and bias, activate, and store the [BLOCK_M, BLOCK_N] tile: the one write of ``out``.

    ``c_ptr`` and ``out_ptr`` already point at this batch entry. C is loaded only when HAS_C: with beta == 0
    it is never read, so NaN there cannot leak. The fp32 -> ``out`` cast rounds to nearest even (RNE_BY_HAND:
    by hand under the interpreter, which truncates to bfloat16).
    """
    mask_m = offs_m < M
    mask_n = offs_n < N
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if INTEGER:
        result = acc
    else:
        result = acc * alpha
        if HAS_C:
            c_ptrs = (
                c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn
            )
            b_c = tl.load(c_ptrs, mask=mask_mn, other=0.0).to(tl.float32)
            result += beta * b_c
        if HAS_BIAS:
            bias_ptrs = bias_ptr + offs_n.to(tl.int64) * stride_bias
            b_bias = tl.load(bias_ptrs, mask=mask_n, other=0.0).to(tl.float32)
            result += b_bias[None, :]
        result = _activation(result, ACTIVATION=ACTIVATION)
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :].to(tl.int64) * stride_on
    out = cast(result, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    tl.store(out_ptrs, out, mask=mask_mn)


@triton.jit
def _gemm_tiled_kernel(
    a_ptr, b_ptr, c_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    stride_cb, stride_cm, stride_cn,
    stride_ob, stride_om, stride_on,
    stride_bias, alpha, beta,
    HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    ACC_DTYPE: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Batched tiled GEMM with fused epilogue; grid = (tiles of one [M, N] output, batch).

    Each program computes one [BLOCK_M, BLOCK_N] tile of one batch entry, stepping through K in BLOCK_K
    slices (pipelined num_stages deep on a GPU). Any strides: a batch stride of 0 broadcasts an operand.
    Loads of rows/columns past the edge are redirected (modulo) to valid ones, so only K is masked in the
    loop; the store is masked.

    ACC_DTYPE is fp32 for float inputs and int32 for int8 (exact: every product and partial sum is an
    integer; int32 arithmetic wraps, so the result is exact whenever it fits in int32). DOT_IN_FP32 and
    DOT_PRECISION are :func:`llm_speed.core.kernel_math.dot`'s switches (bf16 widened under the interpreter,
    whose bf16 dot is wrong; "ieee" or "tf32" for fp32 inputs).

    FLOPs: 2 * batch * M * N * K (plus O(M * N) in the epilogue).
    Minimum bytes: each operand read once and ``out`` written once:
    ``size(A) + size(B) + batch*M*N*out_bytes`` (+ ``batch*M*N*c_bytes`` when HAS_C, + ``N*bias_bytes``),
    where size counts distinct elements (a broadcast operand is read once).
    """
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_pid_m, num_pid_n, GROUP_M=GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_k64 = offs_k.to(tl.int64)
    # Edge rows/columns re-read a valid row/column; their results are never stored.
    offs_am = (offs_m % M).to(tl.int64)
    offs_bn = (offs_n % N).to(tl.int64)
    a_ptrs = a_ptr + batch * stride_ab + offs_am[:, None] * stride_am + offs_k64[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k64[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    # The K step in int64: BLOCK_K * a column stride above 2**31 / BLOCK_K would overflow int32.
    a_step = tl.full((), BLOCK_K, tl.int64) * stride_ak
    b_step = tl.full((), BLOCK_K, tl.int64) * stride_bk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
    for k_tile in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k_tile * BLOCK_K
        b_a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0)  # [BLOCK_M, BLOCK_K]
        b_b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0)  # [BLOCK_K, BLOCK_N]
        acc += dot(b_a, b_b, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        a_ptrs += a_step
        b_ptrs += b_step

    _epilogue(
        acc, offs_m, offs_n, M, N,
        c_ptr + batch * stride_cb, stride_cm, stride_cn,
        bias_ptr, stride_bias, out_ptr + batch * stride_ob, stride_om, stride_on,
        alpha, beta,
        HAS_C=HAS_C, HAS_BIAS=HAS_BIAS, ACTIVATION=ACTIVATION, INTEGER=ACC_DTYPE == tl.int32,
        RNE_BY_HAND=RNE_BY_HAND,
    )  # fmt: skip


@triton.jit
def _gemm_persistent_tma_kernel(
    a_desc, b_desc, c_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_cm, stride_cn, stride_om, stride_on,
    stride_bias, alpha, beta,
    HAS_C: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
    B_K_MAJOR: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """Persistent 2-D GEMM fed by tensor descriptors (TMA on Hopper); fp16/bf16 in, fp32 accumulation.

    NUM_PROGRAMS programs (one per SM on a GPU) each walk the tiles ``pid, pid + NUM_PROGRAMS, ...`` in
    grouped order, so the launch cost is paid once and the next tile's loads start while the SM is still busy.
    ``a_desc`` describes A [M, K] (row-major); ``b_desc`` describes B [K, N] row-major, or, when B_K_MAJOR,
    B^T [N, K] row-major (the ``x @ W^T`` layout); their block shapes are the launch's tiles. Descriptor loads
    past the edges return zeros, so no masks are needed in the K loop; the epilogue is the tiled kernel's.

    FLOPs: 2 * M * N * K. Minimum bytes: (M*K + K*N) * in_bytes + M*N*out_bytes (+ M*N*c_bytes when HAS_C,
    + N*bias_bytes).
    """
    start_pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = grouped_tile(tile_id, num_pid_m, num_pid_n, GROUP_M=GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_tile in range(0, k_tiles):
            off_k = k_tile * BLOCK_K
            b_a = a_desc.load([off_m, off_k])  # [BLOCK_M, BLOCK_K]
            if B_K_MAJOR:
                b_b = b_desc.load([off_n, off_k]).T  # [BLOCK_N, BLOCK_K] -> [BLOCK_K, BLOCK_N]
            else:
                b_b = b_desc.load([off_k, off_n])  # [BLOCK_K, BLOCK_N]
            acc += dot(b_a, b_b, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        offs_m = off_m + tl.arange(0, BLOCK_M)
        offs_n = off_n + tl.arange(0, BLOCK_N)
        _epilogue(
            acc, offs_m, offs_n, M, N,
            c_ptr, stride_cm, stride_cn, bias_ptr, stride_bias, out_ptr, stride_om, stride_on,
            alpha, beta,
            HAS_C=HAS_C, HAS_BIAS=HAS_BIAS, ACTIVATION=ACTIVATION, INTEGER=False, RNE_BY_HAND=RNE_BY_HAND,
        )  # fmt: skip


TILED = Kernel(_gemm_tiled_kernel, "matmul.gemm_tiled")
PERSISTENT_TMA = Kernel(_gemm_persistent_tma_kernel, "matmul.gemm_persistent_tma")
TILED_KERNEL = TILED.name  # the launch-count names (runtime.launch_count)
PERSISTENT_TMA_KERNEL = PERSISTENT_TMA.name
