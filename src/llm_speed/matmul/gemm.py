"""GEMM with a fused epilogue in Triton: ``out = act(alpha * op(a) @ op(b) + beta * c + bias)``.

Two kernels share one epilogue: a tiled kernel (every dtype, layout and batch; int8 accumulates in int32) and
a persistent kernel fed by tensor descriptors (TMA; Hopper and later, 2-D fp16/bf16). Operands are read in
place through their strides: a transposed, column-major or broadcast (stride 0) operand is never copied.

Dispatch: tensors Triton runs on (CUDA; CPU under ``TRITON_INTERPRET=1``) take the Triton kernels. On a GPU
with tensor descriptors whose shared memory holds the large tiles (H100, H200, B200; :func:`tier_for`), 2-D
fp16/bf16 problems whose operands suit tensor descriptors take the persistent TMA kernel, everything else
the tiled kernel; the interpreter runs the tiled kernel (tests force the other). CPU tensors without the
interpreter run :func:`llm_speed.matmul.reference.gemm_reference` in float32, the same function.

fp32 inputs use TF32 tensor cores only when PyTorch allows TF32 for ``torch.matmul``
(``torch.backends.cuda.matmul.fp32_precision = "tf32"``, the legacy ``allow_tf32 = True``, or
``torch.set_float32_matmul_precision("high")``); by default they are computed in full fp32 ("ieee").

Layout (every op module): kernels, launcher (configuration, plans, launch), op registration, autograd, public
functions. Argument checks: :mod:`llm_speed.matmul.checks`; the plain-PyTorch spec:
:mod:`llm_speed.matmul.reference`. Design notes: docs/gemm.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl

from ..core import runtime, tensors
from ..core.config import KernelConfig
from ..core.dispatch import INFERENCE, Op, plain_call, plain_inference
from ..core.hardware import KIB, Hardware, hardware_of
from ..core.kernel_math import cast, dot, dot_switches, rne_by_hand
from ..core.launch import (
    TMA_ALIGN_BYTES,
    CallCache,
    Descriptor,
    Kernel,
    Plan,
    TensorDescriptor,
    cdiv,
    plan_cache,
    tma_aligned,
)  # fmt: skip
from ..core.tiers import Tier, first_fitting
from ..core.tile_choice import choose_tile
from . import reference
from .checks import FLOAT_DTYPES, INT8_DTYPES, TENSOR_CORE_DTYPES, check_epilogue, check_operands

# --- kernels --------------------------------------------------------------------------------------------

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


# --- launcher -------------------------------------------------------------------------------------------

TILED = Kernel(_gemm_tiled_kernel, "matmul.gemm_tiled")
PERSISTENT_TMA = Kernel(_gemm_persistent_tma_kernel, "matmul.gemm_persistent_tma")
TILED_KERNEL = TILED.name  # the launch-count names (runtime.launch_count)
PERSISTENT_TMA_KERNEL = PERSISTENT_TMA.name
PATHS = ("tiled", "persistent_tma")

# CUDA caps the second grid dimension (the batch) at 65535 programs; larger batches launch in chunks.
MAX_GRID_Y = 65535


# Configurations, in tiers by shared memory per block (the resource the pipelined tiles fill). A configuration
# is a tile (BLOCK_M x BLOCK_N, stepping BLOCK_K along the reduction), the width of the grouped launch order
# (GROUP_M) and the launch parameters num_warps and num_stages (the depth of Triton's software pipeline: how
# many K-tiles are loaded ahead of the tensor-core work). A device gets the first tier whose min_smem_bytes it
# has (tier_for); gemm_config chooses one configuration of the tier per problem.


@dataclasses.dataclass(frozen=True)
class GemmTier(Tier):
    """The GEMM's configurations for devices with at least ``min_smem_bytes`` of shared memory per block."""

    tiled: tuple[KernelConfig, ...]
    persistent_tma: tuple[KernelConfig, ...] = ()  # empty: this tier uses the tiled kernel only
    # the persistent kernel's tiles for decode alone (M <= the smallest BLOCK_M; core.tile_choice)
    persistent_tma_decode: tuple[KernelConfig, ...] = ()

    @property
    def persistent_tma_shipped(self) -> tuple[KernelConfig, ...]:
        """Every configuration of the persistent kernel: the general ones, then decode's."""
        return self.persistent_tma + self.persistent_tma_decode


def gemm_tile(m: int, n: int, k: int, warps: int, stages: int) -> KernelConfig:
    return KernelConfig(m, n, warps, stages, block_k=k, group_m=8)


# 227 KB per block (H100, H200, B200): big tiles with 3-4 pipeline stages; the largest needs 144 KB.
LARGE = GemmTier(
    "227 KB",
    227 * KIB,
    tiled=(
        gemm_tile(128, 256, 64, 8, 3),
        gemm_tile(128, 128, 64, 8, 4),
        gemm_tile(128, 128, 32, 4, 4),
        gemm_tile(128, 64, 64, 4, 4),
        gemm_tile(64, 128, 64, 4, 4),
        gemm_tile(64, 64, 64, 4, 4),
        gemm_tile(64, 32, 32, 2, 5),
    ),
    # The persistent kernel fed by tensor descriptors (TMA); fp16/bf16 only.
    persistent_tma=(
        gemm_tile(128, 256, 64, 8, 3),
        gemm_tile(128, 128, 64, 8, 4),
        gemm_tile(128, 128, 64, 4, 3),
        gemm_tile(128, 64, 64, 4, 4),
        gemm_tile(64, 128, 64, 4, 4),
    ),
    # Decode (M <= 64), whose weights only every SM together reads at full bandwidth (4096 x 4096: 128
    # tiles, where 64x128 made 32); eight stages keep 32 KiB of them in flight per SM, about an HBM
    # latency's worth at an SM's share of the bandwidth.
    persistent_tma_decode=(gemm_tile(64, 32, 64, 4, 8),),
)

# 163 KB per block (A100): the tiles of Triton's matmul tutorial
# (https://triton-lang.org/main/getting-started/tutorials/03-matrix-multiplication.html); at most 72 KB.
MEDIUM = GemmTier(
    "163 KB",
    163 * KIB,
    tiled=(
        gemm_tile(128, 256, 32, 8, 3),
        gemm_tile(128, 128, 32, 4, 4),
        gemm_tile(128, 64, 32, 4, 4),
        gemm_tile(64, 128, 32, 4, 4),
        gemm_tile(64, 64, 32, 4, 4),
        gemm_tile(64, 32, 32, 2, 5),
        gemm_tile(32, 64, 32, 2, 5),
    ),
)

# 99 KB per block (Ada, consumer Blackwell) and anything smaller: at most 48 KB.
SMALL = GemmTier(
    "99 KB",
    99 * KIB,
    tiled=(
        gemm_tile(128, 128, 32, 4, 3),
        gemm_tile(128, 64, 32, 4, 3),
        gemm_tile(64, 128, 32, 4, 3),
        gemm_tile(64, 64, 32, 4, 3),
        gemm_tile(32, 64, 32, 2, 3),
    ),
)

TIERS = (LARGE, MEDIUM, SMALL)  # largest first

# The Triton interpreter: one configuration. Big tiles mean few programs, and the interpreter's cost is per
# program and per loop step, not per element.
INTERPRETER = KernelConfig(64, 64, num_warps=4, num_stages=1, block_k=64, group_m=4)

# The number of persistent programs the interpreter launches. Fewer programs than tiles, so each program
# walks several tiles and the persistent loop is really exercised on the CPU.
INTERPRETER_PERSISTENT_PROGRAMS = 3


def shared_bytes(config: KernelConfig, element_bytes: int = 2) -> int:
    """Shared memory the pipelined A and B tiles of ``config`` take: stages x (BM + BN) x BK elements.

    A lower bound of what Triton allocates (the epilogue's layout conversions reuse these buffers);
    ``tests/matmul/test_gemm_compile_sm90.py`` compares it with compiled kernels.
    """
    return config.num_stages * (config.block_m + config.block_n) * config.block_k * element_bytes


def tier_for(hardware: Hardware) -> GemmTier:
    """The GEMM tier of ``hardware`` (:func:`llm_speed.core.tiers.first_fitting`)."""
    return first_fitting(TIERS, hardware)


def tiled_configs(hardware: Hardware) -> tuple[KernelConfig, ...]:
    """The tiled kernel's candidate configurations on ``hardware``."""
    return tier_for(hardware).tiled


def persistent_tma_configs(hardware: Hardware) -> tuple[KernelConfig, ...]:
    """The persistent TMA kernel's candidate configurations on ``hardware`` (empty: the kernel is not
    used)."""
    return tier_for(hardware).persistent_tma_shipped if hardware.has_tma else ()


def has_tma(hardware: Hardware) -> bool:
    """Whether the persistent tensor-descriptor (TMA) kernel is used on ``hardware``."""
    return bool(persistent_tma_configs(hardware))


def shipped_configs() -> tuple[tuple[str, KernelConfig], ...]:
    """Every configuration any device can get, once each, as (path, config) with path "tiled" or
    "persistent_tma" (the tests run each directly, and compile each for sm_90)."""
    seen: dict[tuple[str, KernelConfig], None] = {}
    for tier in TIERS:
        for path, listed in (("tiled", tier.tiled), ("persistent_tma", tier.persistent_tma_shipped)):
            for config in listed:
                seen[(path, config)] = None
    return tuple(seen)


def candidate_configs(path: str, dtype: torch.dtype, hardware: Hardware) -> tuple[KernelConfig, ...]:
    """The configurations :func:`gemm_config` chooses among for ``path`` and operands of ``dtype`` on
    ``hardware``: the tier's list for the path, less those whose pipelined tiles (:func:`shared_bytes` at
    ``dtype``'s element size) exceed the device's shared memory per block (the tiers are sized for 16-bit
    operands; fp32 doubles the bytes); the smallest one if none fits (a device below every tier's minimum)."""
    if path == "persistent_tma":
        listed = persistent_tma_configs(hardware)
        if not listed:
            raise ValueError(f"the persistent TMA kernel is not used on {hardware.name} (no TMA tiles there)")
    elif path == "tiled":
        listed = tiled_configs(hardware)
    else:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    element = dtype.itemsize
    fitting = tuple(c for c in listed if shared_bytes(c, element) <= hardware.smem_per_block_bytes)
    return fitting or (min(listed, key=lambda c: shared_bytes(c, element)),)


@functools.cache
def gemm_config(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype,
    path: str,
    b_k_major: bool,
    hardware: Hardware,
    *,
    batch: int = 1,
) -> KernelConfig:
    """The configuration of a compiled GEMM launch: one of the tier's candidates for ``path`` on
    ``hardware`` (:func:`tiled_configs`, :func:`persistent_tma_configs`), chosen by a cost model, never by
    timing. Pure and cached; the interpreter does not use it (it runs :data:`INTERPRETER`).

    Candidates whose pipelined A and B tiles do not fit the device's shared memory per block are dropped
    first (:func:`candidate_configs`: the tiers are sized for 16-bit operands, and fp32 operands double the
    bytes); then :func:`llm_speed.core.tile_choice.choose_tile`'s rule picks one. What it gives: a large
    problem (tiles >> SMs) takes the largest tile (128x256): the waves are nearly full for every tile, and
    efficiency decides. A problem of a few waves' worth takes the tile that fills the last wave best
    (1024^3 on an H100: 128x64, 128 tiles in one wave of 132 SMs, rather than 32 tiles of 128x256 leaving
    100 SMs idle). Decode (M <= 64 on an H100) is priced by the weights' bytes on the busiest SM, so it
    takes the narrowest tile that spreads them over every SM (4096 x 4096 weights: 64x32, 128 programs,
    where 64x128 gave 32).

    ``b_k_major`` (B read as B^T [N, K] row-major, the ``x @ W^T`` layout) does not change the choice: the
    shared memory and work of a tile are the same in both layouts (it is part of the signature so that a
    layout-specific rule would not change the callers).
    """
    pool = candidate_configs(path, dtype, hardware)
    tiles = [(c.block_m, c.block_n, c.block_k) for c in pool]
    decode = tier_for(hardware).persistent_tma_decode
    index = choose_tile(m, n, k, tiles, hardware.sm_count, batch=batch, element_bytes=dtype.itemsize,
                        decode_only=[i for i, c in enumerate(pool) if c in decode])  # fmt: skip
    return pool[index]


# The fp32 matmul precision setting (torch >= 2.9); torch.backends.cuda.matmul.fp32_precision reads the same.
_fp32_precision_of = getattr(torch._C, "_get_fp32_precision_getter", None)


def fp32_input_precision() -> str:
    """The fp32 dot precision: "tf32" when PyTorch allows TF32 for CUDA matmuls, else "ieee" (the default).

    Reads ``torch.backends.cuda.matmul.fp32_precision`` where it exists (torch >= 2.9; it reflects the legacy
    ``allow_tf32`` and ``torch.set_float32_matmul_precision`` too, whereas reading ``allow_tf32`` raises once
    the new API has set TF32), else ``allow_tf32``.
    """
    if _fp32_precision_of is not None:
        return "tf32" if _fp32_precision_of("cuda", "matmul") == "tf32" else "ieee"
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def _rows_fit(row_stride: int, row_length: int, element: int) -> bool:
    """Rows a tensor descriptor can read: 16-byte aligned and not overlapping."""
    return row_stride >= max(row_length, 1) and (row_stride * element) % TMA_ALIGN_BYTES == 0


def _tma_operands(m, n, k, a_strides, b_strides, dtype: torch.dtype, aligned: bool) -> bool | None:
    """For 2-D op(a) [M, K] and op(b) [K, N] of these strides and dtype: None if the TMA kernel cannot read
    them, else whether B is K-major. ``aligned``: both base addresses are 16-byte aligned.

    fp16/bf16 only, K > 0 (a tensor descriptor needs every dimension positive). A must be row-major; B
    row-major [K, N] or K-major (the ``x @ W^T`` layout). Base addresses and row strides must be 16-byte
    aligned, as tensor descriptors require, and rows must not overlap (kept conservative: anything unusual
    takes the tiled kernel).
    """
    if dtype not in TENSOR_CORE_DTYPES or k == 0 or not aligned or TensorDescriptor is None:
        return None
    element = dtype.itemsize
    stride_am, stride_ak = a_strides
    stride_bk, stride_bn = b_strides
    if stride_ak != 1 or not _rows_fit(stride_am, k, element):
        return None
    if stride_bn == 1 and _rows_fit(stride_bk, n, element):
        return False
    if stride_bk == 1 and _rows_fit(stride_bn, k, element):
        return True
    return None


def _tma_layout(op_a: torch.Tensor, op_b: torch.Tensor) -> bool | None:
    """:func:`_tma_operands` of 2-D tensors op(a), op(b)."""
    m, k = op_a.shape
    n = op_b.shape[1]
    aligned = tma_aligned(op_a, op_b)
    return _tma_operands(m, n, k, op_a.stride(), op_b.stride(), op_a.dtype, aligned)


def _tma_suits(op_a: torch.Tensor, op_b: torch.Tensor, hardware: Hardware) -> bool:
    """Whether the persistent TMA kernel takes this problem on ``hardware`` (no device access): the rule of
    :func:`_recipe` for a compiled launch."""
    if op_a.dim() != 2 or op_b.dim() != 2:
        return False
    return has_tma(hardware) and _tma_layout(op_a, op_b) is not None


class _Empty:
    """An empty output: nothing to launch."""

    __slots__ = ("out_shape",)

    def __init__(self, out_shape):
        self.out_shape = out_shape

    def arguments(self, a, b, c, bias, out, alpha, beta) -> tuple[Plan | None, dict]:
        return None, {}

    def run(self, a, b, c, bias, out, alpha, beta) -> None:
        return None


class _Tiled:
    """The tiled kernel in one launch (a batch of at most MAX_GRID_Y)."""

    __slots__ = ("out_shape", "plan")

    def __init__(self, out_shape, plan: Plan):
        self.out_shape = out_shape
        self.plan = plan

    def arguments(self, a, b, c, bias, out, alpha, beta) -> tuple[Plan, dict]:
        """The plan and its per-call arguments (c and bias absent: ``out`` stands in, never read)."""
        return self.plan, dict(
            a_ptr=a, b_ptr=b, c_ptr=out if c is None else c, bias_ptr=out if bias is None else bias,
            out_ptr=out, alpha=alpha, beta=beta,
        )  # fmt: skip

    def run(self, a, b, c, bias, out, alpha, beta) -> None:
        """Launch: :meth:`arguments`, passed directly (no dict per call)."""
        self.plan.launch(
            a_ptr=a, b_ptr=b, c_ptr=out if c is None else c, bias_ptr=out if bias is None else bias,
            out_ptr=out, alpha=alpha, beta=beta,
        )  # fmt: skip


class _Chunked:
    """The tiled kernel launched once per MAX_GRID_Y batch entries; operands with a batch are sliced."""

    __slots__ = ("out_shape", "chunks", "sliced")

    def __init__(self, out_shape, chunks, sliced):
        self.out_shape = out_shape
        self.chunks = chunks  # (start, stop, plan)
        self.sliced = sliced  # whether a, b, c have a batch dim to slice (out always has)

    def _chunk(self, start, stop, plan, a, b, c, bias, out, alpha, beta) -> tuple[Plan, dict]:
        slice_a, slice_b, slice_c = self.sliced
        part = out[start:stop]
        return plan, dict(
            a_ptr=a[start:stop] if slice_a else a, b_ptr=b[start:stop] if slice_b else b,
            c_ptr=part if c is None else (c[start:stop] if slice_c else c),
            bias_ptr=part if bias is None else bias, out_ptr=part, alpha=alpha, beta=beta,
        )  # fmt: skip

    def arguments(self, a, b, c, bias, out, alpha, beta) -> tuple[Plan, dict]:
        """The first chunk's plan and per-call arguments."""
        return self._chunk(*self.chunks[0], a, b, c, bias, out, alpha, beta)

    def run(self, a, b, c, bias, out, alpha, beta) -> None:
        for chunk in self.chunks:
            plan, arguments = self._chunk(*chunk, a, b, c, bias, out, alpha, beta)
            plan.launch(**arguments)


class _PersistentTma:
    """The persistent kernel; its plan fixes the layouts of a's and b's tensor descriptors, each call passes
    the tensors."""

    __slots__ = ("out_shape", "plan")

    def __init__(self, out_shape, plan: Plan):
        self.out_shape = out_shape
        self.plan = plan

    def arguments(self, a, b, c, bias, out, alpha, beta) -> tuple[Plan, dict]:
        return self.plan, dict(
            a_desc=a, b_desc=b, c_ptr=out if c is None else c, bias_ptr=out if bias is None else bias,
            out_ptr=out, alpha=alpha, beta=beta,
        )  # fmt: skip

    def run(self, a, b, c, bias, out, alpha, beta) -> None:
        """Launch: :meth:`arguments`, passed directly (no dict per call)."""
        self.plan.launch(
            a_desc=a, b_desc=b, c_ptr=out if c is None else c, bias_ptr=out if bias is None else bias,
            out_ptr=out, alpha=alpha, beta=beta,
        )  # fmt: skip


def _broadcast_strides(layout, out_shape) -> tuple[int, ...]:
    """The strides of a tensor of (shape, strides) ``layout`` broadcast to ``out_shape`` (0 where it
    broadcasts), as ``expand`` would give them."""
    shape, strides = layout
    offset = len(out_shape) - len(shape)
    return tuple(
        0 if i < offset or shape[i - offset] == 1 else strides[i - offset] for i in range(len(out_shape))
    )


@plan_cache
def _recipe(
    a_shape, a_strides, b_shape, b_strides, trans_a: bool, trans_b: bool, c_layout, bias_stride,
    dtypes: tuple, activation, tf32: bool, aligned: bool, out_strides, path, config, device: torch.device,
):  # fmt: skip
    """How to launch a problem class: the plan(s) and what each call passes. Keyed on everything that fixes
    the launch: shapes and strides of a and b (and the flags that transpose them), c's shape and strides,
    bias's stride, the dtypes of a, c, bias and out, the activation, TF32, whether a and b are 16-byte
    aligned (tensor descriptors need it), out's strides (None: a fresh contiguous output), a forced path or
    configuration (tests), and the device."""
    a_dtype, c_dtype, bias_dtype, out_dtype = dtypes
    a_rows, a_cols = a_shape[-2:]
    b_rows, b_cols = b_shape[-2:]
    # op(a) [M, K] and op(b) [K, N]: a transpose swaps the sizes and strides of the last two dims
    if trans_a:
        m, k, stride_am, stride_ak = a_cols, a_rows, a_strides[-1], a_strides[-2]
    else:
        m, k, stride_am, stride_ak = a_rows, a_cols, a_strides[-2], a_strides[-1]
    if trans_b:
        n, stride_bk, stride_bn = b_rows, b_strides[-1], b_strides[-2]
    else:
        n, stride_bk, stride_bn = b_cols, b_strides[-2], b_strides[-1]
    batched = len(a_shape) == 3 or len(b_shape) == 3
    batch_a = a_shape[0] if len(a_shape) == 3 else 1
    batch_b = b_shape[0] if len(b_shape) == 3 else 1
    batch = batch_b if batch_a == 1 else batch_a
    out_shape = (batch, m, n) if batched else (m, n)
    if m == 0 or n == 0 or batch == 0:
        return _Empty(out_shape)
    if out_strides is None:
        out_strides = (m * n, n, 1) if batched else (n, 1)
    interpreted = runtime.INTERPRETED
    hardware = hardware_of(device)
    b_k_major = None  # None: the TMA kernel cannot read these operands
    if not batched:
        b_k_major = _tma_operands(m, n, k, (stride_am, stride_ak), (stride_bk, stride_bn), a_dtype, aligned)
    if path is None:
        tma = b_k_major is not None and not interpreted and has_tma(hardware)
        path = "persistent_tma" if tma else "tiled"
    elif path == "persistent_tma":
        if b_k_major is None:
            raise ValueError(
                "the persistent TMA kernel needs 2-D fp16/bf16 operands with K > 0, row-major A and row- or "
                "K-major B, 16-byte aligned"
            )
        if not interpreted and not has_tma(hardware):
            raise ValueError(f"the persistent TMA kernel is not used on {hardware.name} (see gemm.TIERS)")
    elif path != "tiled":
        raise ValueError(f"path must be None or one of {PATHS}, got {path!r}")
    if config is None:
        if interpreted:
            config = INTERPRETER
        else:
            config = gemm_config(m, n, k, a_dtype, path, bool(b_k_major), hardware, batch=batch)
    switches = dot_switches(a_dtype, tf32=tf32)
    c_strides = _broadcast_strides(c_layout, out_shape) if c_layout is not None else (0,) * len(out_shape)
    common = dict(
        M=m, N=n, K=k, stride_bias=bias_stride or 0, stride_cm=c_strides[-2], stride_cn=c_strides[-1],
        stride_om=out_strides[-2], stride_on=out_strides[-1],
        HAS_C=c_layout is not None, HAS_BIAS=bias_stride is not None, ACTIVATION=activation,
        DOT_IN_FP32=switches["DOT_IN_FP32"], DOT_PRECISION=switches["DOT_PRECISION"],
        RNE_BY_HAND=rne_by_hand(out_dtype), **config.meta(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if path == "persistent_tma":
        # NUM_PROGRAMS is one constant per device (a constexpr: one compilation); fewer tiles launch fewer
        # programs, each then walking one tile.
        programs = INTERPRETER_PERSISTENT_PROGRAMS if interpreted else hardware.sm_count
        tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
        grid = (min(programs, tiles),)
        a_desc = Descriptor((m, k), (stride_am, 1), (config.block_m, config.block_k))
        if b_k_major:
            b_desc = Descriptor((n, k), (stride_bn, 1), (config.block_n, config.block_k))
        else:
            b_desc = Descriptor((k, n), (stride_bk, 1), (config.block_k, config.block_n))
        plan = PERSISTENT_TMA.plan(grid, a_desc=a_desc, b_desc=b_desc, B_K_MAJOR=b_k_major,
                                   NUM_PROGRAMS=programs, **common)  # fmt: skip
        return _PersistentTma(out_shape, plan)

    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)

    def batch_stride(shape, strides):  # 0 broadcasts a 2-D operand, or a batch of 1, over the launch's batch
        return strides[0] if len(shape) == 3 and shape[0] != 1 else 0

    fixed = dict(
        common, stride_ab=batch_stride(a_shape, a_strides), stride_am=stride_am, stride_ak=stride_ak,
        stride_bb=batch_stride(b_shape, b_strides), stride_bk=stride_bk, stride_bn=stride_bn,
        stride_cb=c_strides[0] if batched else 0, stride_ob=out_strides[0] if batched else 0,
        ACC_DTYPE=tl.int32 if a_dtype == torch.int8 else tl.float32,
    )  # fmt: skip
    if batch <= MAX_GRID_Y:
        return _Tiled(out_shape, TILED.plan((tiles, batch), **fixed))
    chunk_plans = {}
    chunks = []
    for start in range(0, batch, MAX_GRID_Y):
        count = min(MAX_GRID_Y, batch - start)
        if count not in chunk_plans:
            chunk_plans[count] = TILED.plan((tiles, count), **fixed)
        chunks.append((start, start + count, chunk_plans[count]))
    sliced = (
        len(a_shape) == 3 and a_shape[0] != 1,
        len(b_shape) == 3 and b_shape[0] != 1,
        c_layout is not None and len(c_layout[0]) == 3 and c_layout[0][0] != 1,
    )
    return _Chunked(out_shape, tuple(chunks), sliced)


def _recipe_of(a, b, out_dtype, trans_a, trans_b, c, bias, activation, out, path, config, device):
    """The cached recipe of a problem (see :func:`_recipe` for its key)."""
    a_dtype = a.dtype
    if a_dtype is torch.float32:
        tf32, aligned = fp32_input_precision() == "tf32", True
    else:  # the alignment of a and b decides the TMA path, for 16-bit operands
        tf32, aligned = False, a_dtype is torch.int8 or tma_aligned(a, b)
    return _recipe(
        a.shape, a.stride(), b.shape, b.stride(), trans_a, trans_b,
        None if c is None else (c.shape, c.stride()), None if bias is None else bias.stride(0),
        (a_dtype, None if c is None else c.dtype, None if bias is None else bias.dtype, out_dtype),
        activation, tf32, aligned, None if out is None else out.stride(), path, config, device,
    )  # fmt: skip


def _launch(a, b, out_dtype, trans_a, trans_b, c, bias, alpha, beta, activation, device, out=None,
            path=None, config=None) -> torch.Tensor:  # fmt: skip
    """Allocate ``out`` (unless given) and run the Triton kernel on a problem of checked arguments."""
    if a.dtype is torch.int8:  # (8-bit operands: read K-major, copied if they are not)
        a, b = _k_major_int8(a, b)
    recipe = _recipe_of(a, b, out_dtype, trans_a, trans_b, c, bias, activation, out, path, config, device)
    return _run(recipe, a, b, out_dtype, trans_a, trans_b, c, bias, alpha, beta, device, out)


def _run(recipe, a, b, out_dtype, trans_a, trans_b, c, bias, alpha, beta, device, out=None) -> torch.Tensor:
    """Allocate ``out`` (unless given), report the work, and run ``recipe``."""
    if out is None:
        out = tensors.new_output(recipe.out_shape, out_dtype, device)
    if out.numel() and runtime.observed():
        _report(a, b, trans_a, trans_b, out)
    recipe.run(a, b, c, bias, out, alpha, beta)
    return out


def _report(a, b, trans_a, trans_b, out) -> None:
    """Report one GEMM to the op table (llm_speed.ops) for the profiler, whichever path computes it."""
    row = "tensor_core_gemm_int8" if a.dtype == torch.int8 else "gemm"  # tensor_core_gemm reports as gemm
    runtime.report_work(row, op_a=a.mT if trans_a else a, op_b=b.mT if trans_b else b, out=out)


def launch_gemm(
    op_a: torch.Tensor,
    op_b: torch.Tensor,
    out: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    path: str | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Run a Triton GEMM kernel: ``out = act(alpha * op_a @ op_b + beta * c + bias)``, written in place.

    op_a [.., M, K] and op_b [.., K, N] are already transposed views (any strides, batch 1 broadcasts);
    ``out`` [.., M, N] is allocated by the caller; ``c`` (read only when given) broadcasts to ``out``.
    ``path`` forces "tiled" or "persistent_tma" (tests use it to run the TMA kernel under the interpreter);
    ``config`` forces a configuration (tests run each shipped one); None chooses. Inputs are not validated
    here: the public functions do that.
    """
    return _launch(op_a, op_b, out.dtype, False, False, c, bias, float(alpha), float(beta), activation,
                   out.device, out, path, config)  # fmt: skip


def planned_launch(
    op_a: torch.Tensor,
    op_b: torch.Tensor,
    out: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    path: str | None = None,
    config: KernelConfig | None = None,
) -> tuple[Plan | None, dict]:
    """The plan and per-call arguments of :func:`launch_gemm`'s (first) launch with these arguments, without
    launching (None, {} for an empty output): the tests compile exactly what a launch would run."""
    device = out.device
    if op_a.dtype is torch.int8:  # as _launch
        op_a, op_b = _k_major_int8(op_a, op_b)
    recipe = _recipe_of(op_a, op_b, out.dtype, False, False, c, bias, activation, out, path, config, device)
    return recipe.arguments(op_a, op_b, c, bias, out, float(alpha), float(beta))


def forward(a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype) -> torch.Tensor:
    """The unchecked forward behind the ``llm_speed::gemm`` op (Triton, or the PyTorch fallback); reports
    its work."""
    device = a.device
    if runtime.triton_runs_on(device):
        return _launch(a, b, out_dtype, trans_a, trans_b, c, bias, alpha, beta, activation, device)
    out = reference.gemm_reference(
        a, b, alpha=alpha, beta=beta, c=c, trans_a=trans_a, trans_b=trans_b, bias=bias,
        activation=activation, out_dtype=out_dtype, compute_dtype=torch.float32,
    )  # fmt: skip
    if out.numel() and runtime.observed():
        _report(a, b, trans_a, trans_b, out)
    return out


def _k_major_int8(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """op(a) and op(b) as the int8 kernel reads them: K-major (copies where they are not; wgmma's 8-bit
    layout, :func:`llm_speed.core.tensors.k_major`). int8 launches never transpose through flags."""
    return tensors.k_major(a, -1), tensors.k_major(b, -2)


def forward_int8(a, b) -> torch.Tensor:
    """The unchecked forward behind the ``llm_speed::gemm_int8`` op; reports its work."""
    device = a.device
    if runtime.triton_runs_on(device):
        return _launch(a, b, torch.int32, False, False, None, None, 1.0, 0.0, None, device)
    out = reference.gemm_int8_reference(a, b)
    if out.numel():
        _report(a, b, False, False, out)
    return out


# --- op registration ------------------------------------------------------------------------------------


def _output_shape(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool) -> tuple[int, ...]:
    m = a.shape[-1] if trans_a else a.shape[-2]
    n = b.shape[-2] if trans_b else b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return (m, n)
    batch_a = a.shape[0] if a.dim() == 3 else 1
    batch_b = b.shape[0] if b.dim() == 3 else 1
    return (batch_b if batch_a == 1 else batch_a, m, n)


@torch.library.custom_op("llm_speed::gemm", mutates_args=())
def _gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: float,
    beta: float,
    trans_a: bool,
    trans_b: bool,
    activation: str | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return forward(a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype)


@_gemm_op.register_fake
def _gemm_fake(a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype):
    return a.new_empty(_output_shape(a, b, trans_a, trans_b), dtype=out_dtype)


@torch.library.custom_op("llm_speed::gemm_int8", mutates_args=())
def _gemm_int8_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return forward_int8(a, b)


@_gemm_int8_op.register_fake
def _gemm_int8_fake(a, b):
    return a.new_empty(_output_shape(a, b, False, False), dtype=torch.int32)


_gemm_int8_call = Op(_gemm_int8_op, forward_int8)


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype = inputs
    ctx.save_for_backward(a, b, c, bias)
    ctx.alpha, ctx.beta, ctx.trans_a, ctx.trans_b, ctx.activation = alpha, beta, trans_a, trans_b, activation


def _sum_to_shape(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a gradient over the dims that were broadcast to reach it from ``shape``."""
    extra = grad.dim() - len(shape)
    if extra > 0:
        grad = grad.sum(dim=tuple(range(extra)))
    dims = tuple(i for i, size in enumerate(shape) if size == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def _operand_grad(x, y, trans_x, trans_y, like, alpha):
    """``alpha * op(x) @ op(y)`` in like's dtype and shape. Where like was broadcast over the batch the
    gradient is a sum over it, done on fp32 products, so it is rounded to like's dtype once."""
    if x.dim() == 2 and y.dim() == 2:  # no batch: nothing was broadcast
        return _gemm_call(x, y, None, None, alpha, 0.0, trans_x, trans_y, None, like.dtype)
    summed = _output_shape(x, y, trans_x, trans_y) != tuple(like.shape)
    out_dtype = torch.float32 if summed else like.dtype
    grad = _gemm_call(x, y, None, None, alpha, 0.0, trans_x, trans_y, None, out_dtype)
    return _sum_to_shape(grad, like.shape).to(like.dtype)


# grad * act'(z) in one PyTorch kernel each (the derivative spelled out in tensor ops took about ten passes
# over the fp32 [M, N] gradient for GELU); reference.apply_activation is what they differentiate.
_ACTIVATION_BACKWARD = {
    "relu": lambda grad, z: torch.ops.aten.threshold_backward(grad, z, 0.0),
    "gelu": lambda grad, z: torch.ops.aten.gelu_backward(grad, z),
    "gelu_tanh": lambda grad, z: torch.ops.aten.gelu_backward(grad, z, approximate="tanh"),
    "silu": lambda grad, z: torch.ops.aten.silu_backward(grad, z),
}


def _backward(ctx, grad_out):
    """Gradients with the same GEMM kernel. With an activation, the pre-activation z is recomputed by one
    more forward GEMM (in fp32, no activation) instead of being saved: the forward keeps its single write.
    """
    a, b, c, bias = ctx.saved_tensors
    alpha, beta, trans_a, trans_b, activation = ctx.alpha, ctx.beta, ctx.trans_a, ctx.trans_b, ctx.activation
    grad_z = grad_out  # without an activation, used as is: no copy when it has the operands' dtype
    if activation is not None:
        z = _gemm_call(a, b, c, bias, alpha, beta, trans_a, trans_b, None, torch.float32)
        grad_z = _ACTIVATION_BACKWARD[activation](grad_out.float(), z)
    grad_z_in = grad_z if grad_z.dtype == a.dtype else grad_z.to(a.dtype)  # operands share one dtype

    need_a, need_b, need_c, need_bias = ctx.needs_input_grad[:4]
    grad_a = grad_b = grad_c = grad_bias = None
    if need_a:
        if trans_a:  # a holds op(a)^T: grad = op(b) @ grad_z^T
            grad_a = _operand_grad(b, grad_z_in, trans_b, True, a, alpha)
        else:  # grad = grad_z @ op(b)^T
            grad_a = _operand_grad(grad_z_in, b, False, not trans_b, a, alpha)
    if need_b:
        if trans_b:  # b holds op(b)^T: grad = grad_z^T @ op(a)
            grad_b = _operand_grad(grad_z_in, a, True, trans_a, b, alpha)
        else:  # grad = op(a)^T @ grad_z
            grad_b = _operand_grad(a, grad_z_in, not trans_a, False, b, alpha)
    if need_c and c is not None:
        grad_c = _sum_to_shape(beta * grad_z.float(), c.shape).to(c.dtype)
    if need_bias and bias is not None:
        grad_bias = grad_z.sum(dim=tuple(range(grad_z.dim() - 1)), dtype=torch.float32).to(bias.dtype)
    return grad_a, grad_b, grad_c, grad_bias, None, None, None, None, None, None


_gemm_call = Op(_gemm_op, forward, setup_context=_setup_context, backward=_backward)


# --- public functions -----------------------------------------------------------------------------------


def _checked_gemm(a, b, dtypes, *, alpha, beta, c, trans_a, trans_b, bias, activation, out_dtype):
    """Check the arguments of a float GEMM (operand dtypes in ``dtypes``) and run the op."""
    shape = check_operands(a, b, trans_a, trans_b, dtypes)
    alpha, beta = check_epilogue(
        shape, a, alpha=alpha, beta=beta, c=c, bias=bias, activation=activation, out_dtype=out_dtype
    )
    trans_a, trans_b = bool(trans_a), bool(trans_b)  # numpy bools: the op's schema takes Python bools
    c_used = c if beta != 0 else None  # with beta == 0, c is not an input: never read, no gradient
    return _gemm_call(a, b, c_used, bias, alpha, beta, trans_a, trans_b, activation, out_dtype or a.dtype)


class _GemmCall:
    """A 16-bit :func:`gemm` call without ``c`` (beta 0) or ``out_dtype``, or a
    :func:`tensor_core_gemm_int8` call (``out_dtype`` int32), whose metadata passed every check before: what
    a repeated call with the same metadata does, the output, the report and the launch
    (:data:`_GEMM_CALLS`)."""

    __slots__ = ("recipe", "trans_a", "trans_b", "dtype", "device", "copies")

    def __init__(self, a, b, out_dtype, trans_a=False, trans_b=False, bias=None, activation=None, *,
                 copies=False):  # fmt: skip
        self.trans_a, self.trans_b, self.dtype, self.device = trans_a, trans_b, out_dtype, a.device
        self.copies = copies  # int8 operands of this metadata are copied K-major before the launch
        self.recipe = _recipe_of(a, b, out_dtype, trans_a, trans_b, None, bias, activation, None, None, None,
                                 a.device)  # fmt: skip

    def __call__(self, a, b, bias, alpha: float) -> torch.Tensor:
        return _run(self.recipe, a, b, self.dtype, self.trans_a, self.trans_b, None, bias, alpha, 0.0,
                    self.device)  # fmt: skip

    def forward(self, a, b, c, bias, alpha, *fixed) -> torch.Tensor:
        """:func:`forward` of such a call (the op's arguments; the recipe fixes the others)."""
        return self(a, b, bias, alpha)


# gemm calls already checked, by what the checks and the recipe read (the operands' 16-byte alignment too:
# it picks the TMA kernel): a repeated call skips the checks and the op's layers (with grad, it records the
# op's autograd node around the kept launch: Op.checked).
_GEMM_CALLS = CallCache()


def _gemm_call_key(a, b, trans_a, trans_b, bias, activation) -> tuple:
    return (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, b.device, trans_a, trans_b,
            tma_aligned(a, b), activation,
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device))  # fmt: skip


def gemm(
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
) -> torch.Tensor:
    """``activation(alpha * op(a) @ op(b) + beta * c + bias)`` in one Triton kernel; differentiable.

    a, b: 2-D [M, K] @ [K, N] or 3-D batched (a batch of 1, or a 2-D operand, broadcasts like
    ``torch.matmul``);
    op(x) is x, or its transpose over the last two dims when ``trans_x``. Any strides are read in place.
    dtypes float16, bfloat16, float32 (a and b equal), accumulated in fp32; fp32 uses TF32 only when
    PyTorch allows it for CUDA matmuls (:func:`fp32_input_precision`). ``c`` (broadcastable to the output)
    is required when beta != 0 and never read when beta == 0. ``bias`` has shape [N] (any stride);
    ``activation`` is None, "relu", "gelu", "gelu_tanh" or "silu". The output has ``out_dtype`` (default:
    the dtype of a). M, N or K of 0 is allowed: an empty output, or with K == 0 the epilogue applied to a
    zero product.
    """
    known = None  # the key of a call that _GEMM_CALLS may serve: 16-bit, no c, the default out_dtype
    if (
        c is None and out_dtype is None and (activation is None or type(activation) is str)
        and type(alpha) is float and -math.inf < alpha < math.inf and type(beta) is float and beta == 0.0
        and (trans_a is True or trans_a is False) and (trans_b is True or trans_b is False)
        and (mode := plain_call(a, b, bias)) and a.dtype in TENSOR_CORE_DTYPES
    ):  # fmt: skip
        known = _gemm_call_key(a, b, trans_a, trans_b, bias, activation)
        call = _GEMM_CALLS.get(known)
        if call is not None and mode == INFERENCE:
            return call(a, b, bias, alpha)
        if call is not None:  # with grad: the op's autograd node around the kept launch
            return _gemm_call.checked(call.forward, a, b, None, bias, alpha, 0.0, trans_a, trans_b,
                                      activation, call.dtype)  # fmt: skip
    out = _checked_gemm(
        a, b, FLOAT_DTYPES, alpha=alpha, beta=beta, c=c, trans_a=trans_a, trans_b=trans_b, bias=bias,
        activation=activation, out_dtype=out_dtype,
    )  # fmt: skip
    if known is not None and runtime.triton_runs_on(a.device):
        _GEMM_CALLS.put(known, _GemmCall(a, b, a.dtype, trans_a, trans_b, bias, activation))
    return out


def tensor_core_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
) -> torch.Tensor:
    """``alpha * a @ b + beta * c`` for float16/bfloat16 a and b, returned in float32 (tensor-core GEMM).

    Same shapes, strides, batching and c rules as :func:`gemm`; differentiable.
    """
    return _checked_gemm(
        a, b, TENSOR_CORE_DTYPES, alpha=alpha, beta=beta, c=c, trans_a=False, trans_b=False, bias=None,
        activation=None, out_dtype=torch.float32,
    )  # fmt: skip


def tensor_core_gemm_int8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 a and b (2-D or 3-D batched, any strides), accumulated and returned in int32.

    Exact whenever the true result fits in int32, which is guaranteed for K <= 131071 (|a*b| <= 2**14 per
    product); int32 arithmetic wraps, so overflowing partial sums do not spoil a representable result.
    """
    known = None
    if plain_inference(a, b):  # (int8 tensors never require grad)
        known = _gemm_call_key(a, b, None, None, None, None)  # flags None: never a float call's key
        call = _GEMM_CALLS.get(known)
        if call is not None:
            return call(*_k_major_int8(a, b), None, 1.0) if call.copies else call(a, b, None, 1.0)
    check_operands(a, b, False, False, INT8_DTYPES)
    given = a, b
    if runtime.triton_runs_on(a.device):
        a, b = _k_major_int8(a, b)  # once here: the op's forward and the kept call see them K-major
    out = _gemm_int8_call(a, b)
    if known is not None and runtime.triton_runs_on(a.device):
        copies = a is not given[0] or b is not given[1]
        _GEMM_CALLS.put(known, _GemmCall(a, b, torch.int32, copies=copies))
    return out


__all__ = [
    "fp32_input_precision",
    "gemm",
    "gemm_config",
    "launch_gemm",
    "tensor_core_gemm",
    "tensor_core_gemm_int8",
]
