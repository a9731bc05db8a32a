"""Grouped GEMM in Triton: rows of ``a`` grouped by ``offsets``, group g multiplied by ``b[g]``, one launch.

``out[s_g:e_g] = a[s_g:e_g] @ op(b[g])`` for the groups ``[s_g, e_g)`` that ``offsets`` (cumulative ends, as
``torch._grouped_mm``'s ``offs``) cut the rows into: the expert GEMMs of a mixture-of-experts layer, every
expert at once. The launch is persistent: a fixed number of programs (one per SM on a GPU) walks every
(group, tile) pair of the problem, tile ``t`` to program ``t mod programs``. The tiles are found on the
device from ``offsets`` (each program reads the group ends as it goes), so neither the grid nor any buffer
depends on their values: no host read, nothing to synchronise, and the call can be captured in a CUDA graph.
Empty groups have no tiles.

Two kernels:

- :func:`_grouped_gemm_kernel`, the forward shape ``[rows, K] x [K, N] per group``. Switches the MoE layer
  uses (:mod:`llm_speed.moe.fused_moe`): rows gathered through an index (the token copies grouped by expert
  read their token's row of the hidden states, no gathered copy of them is made), and the SwiGLU epilogue (a
  tile holds the gate and the up columns of its outputs, two accumulators, and writes ``silu(gate) * up``
  once: the ``[rows, 2I]`` projection is never stored).
- :func:`_grouped_wgrad_kernel`, the weight-gradient shape ``out[g] = A_g^T @ B_g``, the reduction running
  over the rows of group g (grid: output tiles x groups; an empty group writes zeros).

Invalid ``offsets`` (decreasing, negative, past ``total``) with the value checks off make every output
element NaN; rows past the last offset (it should be ``total``) come out NaN. Nothing is read or written
outside a tensor either way.

Layout (every op module): kernels, launcher (configuration, plans, launch), op registration, autograd, public
function. The plain-PyTorch spec: :func:`llm_speed.moe.reference.grouped_gemm_reference`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..core import autocast, runtime, tensors
from ..core.args import check_flag
from ..core.config import KernelConfig
from ..core.dispatch import Op
from ..core.hardware import KIB, Hardware, hardware_of
from ..core.kernel_math import cast, dot, dot_switches, rne_by_hand
from ..core.launch import Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.tensors import FLOAT_DTYPES, check_same_device, check_tensor, dtype_names
from ..core.tile_choice import SMALLEST_TILE_SIDE
from ..matmul.gemm_configs import fp32_input_precision
from . import reference
from .checks import check_offsets

# --- kernels --------------------------------------------------------------------------------------------


@triton.jit
def _offsets_bad(offsets_ptr, total, groups, BLOCK_E: tl.constexpr):
    """Whether the cumulative ends decrease somewhere, start below 0 or pass ``total`` (one vector load)."""
    o = tl.arange(0, BLOCK_E)
    inside = o < groups
    ends = tl.load(offsets_ptr + o, mask=inside, other=0)
    prev = tl.load(offsets_ptr + o - 1, mask=inside & (o > 0), other=0)
    wrong = inside & ((ends < prev) | (ends > total))
    return tl.max(wrong.to(tl.int32), axis=0) > 0


@triton.jit
def grouped_schedule(offsets_ptr, total, groups, num_n, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """The persistent order of a grouped launch, for every group at once (vectors over BLOCK_E >= groups + 1
    entries; entry ``groups`` is the rows past the last offset, empty unless the offsets end early).

    Returns each group's first row and end (the offsets clamped into ``[0, total]``), its number of tiles
    (row tiles x ``num_n``), the running sum of the tiles (group g's end in the order), and whether the
    offsets are invalid (decreasing, negative, or past ``total``). Every row of ``[0, total)`` falls in some
    group's range whatever the offsets hold (the ranges chain from 0 to ``total``); valid offsets make the
    ranges disjoint, invalid ones only NaN tiles, so an overlap writes the same NaN twice.
    """
    o = tl.arange(0, BLOCK_E)
    inside = o < groups
    raw = tl.load(offsets_ptr + o, mask=inside, other=0)
    raw = tl.where(inside, raw, total)
    prev = tl.load(offsets_ptr + o - 1, mask=(o > 0) & (o <= groups), other=0)
    prev = tl.where(o > groups, total, prev)
    bad = tl.max((inside & ((raw < prev) | (raw > total))).to(tl.int32), axis=0) > 0
    ends = tl.minimum(tl.maximum(raw, 0), total)
    starts = tl.minimum(tl.maximum(prev, 0), total)
    tiles = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M * num_n
    return starts, ends, tiles, tl.cumsum(tiles, axis=0), bad


@triton.jit
def _grouped_tile(
    a_ptr, b_ptr, out_ptr, order_ptr, e, row0, end, pid_n, N, K, nan_tile,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_om, stride_on,
    GATHER_DIV: tl.constexpr, SWIGLU: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] output tile: rows ``row0 ...`` (below ``end``) of group ``e``."""
    offs_m = row0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.where(mask_m, offs_m, row0)  # rows past the group re-read its first row; never stored
    if GATHER_DIV > 0:  # grouped row r reads row order[r] // GATHER_DIV of a (a token copy's token)
        src = tl.load(order_ptr + rows) // GATHER_DIV
    else:
        src = rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    cols = (offs_n % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_k64 = offs_k.to(tl.int64)
    a_ptrs = a_ptr + src.to(tl.int64)[:, None] * stride_am + offs_k64[None, :] * stride_ak
    b_ptrs = b_ptr + e.to(tl.int64) * stride_be + offs_k64[:, None] * stride_bk + cols[None, :] * stride_bn
    a_step = tl.full((), BLOCK_K, tl.int64) * stride_ak
    b_step = tl.full((), BLOCK_K, tl.int64) * stride_bk
    up_shift = tl.full((), N, tl.int64) * stride_bn  # SWIGLU: the up columns follow the N gate columns
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_stop = tl.where(nan_tile, 0, K)
    for k0 in range(0, k_stop, BLOCK_K):
        k_mask = offs_k < K - k0
        b_a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        b_b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        acc += dot(b_a, b_b, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        if SWIGLU:
            b_u = tl.load(b_ptrs + up_shift, mask=k_mask[:, None], other=0.0)
            acc_up += dot(b_a, b_u, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        a_ptrs += a_step
        b_ptrs += b_step
    if SWIGLU:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # silu(gate) * up
    acc = tl.where(nan_tile, float("nan"), acc)
    out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n.to(tl.int64)[None, :] * stride_on
    tl.store(out_ptrs, cast(acc, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND),
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr, order_ptr,
    total, N, K, groups, num_programs,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_om, stride_on,
    GATHER_DIV: tl.constexpr, SWIGLU: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Persistent grouped GEMM: ``out[r] = a[src(r)] @ B_g`` for the rows r of each group g.

    B_g is the [K, N] matrix at ``b_ptr + g * stride_be`` with strides (stride_bk, stride_bn): ``b[g]`` or
    its transpose. With SWIGLU, B_g has 2N columns ([gate; up]) and ``out`` N columns, ``silu(gate) * up``.
    ``src(r)`` is r, or ``order[r] // GATHER_DIV`` when GATHER_DIV > 0.

    ``num_programs`` programs each walk the tiles ``t = pid, pid + num_programs, ...`` of the sequence
    (group 0's tiles, group 1's, ..., then a last group of the rows past the final offset, which is empty
    unless the offsets end early: :func:`grouped_schedule`); a tile finds its group among the running tile
    counts with one vector comparison. Within a group, tile t covers rows ``pid_m`` and columns ``pid_n`` with
    ``pid_m`` varying fastest, so programs running together share B_g's column panel. The group bounds are
    clamped into ``[0, total]`` and every row belongs to a tile: invalid offsets change what is computed
    (NaN), never which memory is touched.

    FLOPs: 2 * total * N * K (x2 with SWIGLU). Minimum bytes: a (or its gathered rows) + the B_g of groups
    with rows + out.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    starts, ends, tiles, tile_ends, bad = grouped_schedule(
        offsets_ptr, total, groups, num_n, BLOCK_M=BLOCK_M, BLOCK_E=BLOCK_E
    )
    o_g = tl.arange(0, BLOCK_E)
    for t in range(pid, tl.sum(tiles, axis=0), num_programs):
        g = tl.sum((tile_ends <= t).to(tl.int32), axis=0)  # the group whose tiles hold t
        here = o_g == g
        start = tl.sum(tl.where(here, starts, 0), axis=0)
        end = tl.sum(tl.where(here, ends, 0), axis=0)
        local = t - tl.sum(tl.where(here, tile_ends - tiles, 0), axis=0)
        m_tiles = (end - start + BLOCK_M - 1) // BLOCK_M
        _grouped_tile(
            a_ptr, b_ptr, out_ptr, order_ptr, tl.minimum(g, groups - 1), start + (local % m_tiles) * BLOCK_M,
            end, local // m_tiles, N, K, bad | (g == groups),
            stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_om, stride_on,
            GATHER_DIV=GATHER_DIV, SWIGLU=SWIGLU, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            RNE_BY_HAND=RNE_BY_HAND, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )  # fmt: skip


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr, b_ptr, out_ptr, offsets_ptr, order_ptr, scale_ptr,
    total, M, N, groups,
    stride_ar, stride_am, stride_br, stride_bn, stride_oe, stride_om, stride_on,
    GATHER_A_DIV: tl.constexpr, GATHER_B_DIV: tl.constexpr, SCALE_A: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr,
    RNE_IN: tl.constexpr, RNE_OUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """``out[g] = A_g^T @ B_g`` over the rows r of group g; grid = (tiles of [M, N], groups).

    Row r of A_g is ``a[src_a(r)]`` (M wide), of B_g ``b[src_b(r)]`` (N wide); ``src_x(r)`` is r, or
    ``order[r] // GATHER_X_DIV`` when that is > 0. SCALE_A multiplies row r of A by ``scale[order[r]]``
    (rounded back to a's dtype before the product). An empty group writes zeros; invalid offsets, NaN.

    FLOPs: 2 * total * M * N. Minimum bytes: the rows of a and b read once, out written once.
    """
    pid = tl.program_id(0)
    g = tl.program_id(1)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    bad = _offsets_bad(offsets_ptr, total, groups, BLOCK_E=BLOCK_E)
    start = tl.load(offsets_ptr + tl.maximum(g - 1, 0))
    start = tl.minimum(tl.maximum(tl.where(g > 0, start, 0), 0), total)
    end = tl.minimum(tl.maximum(tl.load(offsets_ptr + g), start), total)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_m = (offs_m % M).to(tl.int64)
    cols_n = (offs_n % N).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    r_stop = tl.where(bad, start, end)
    for r0 in range(start, r_stop, BLOCK_K):
        rows = r0 + offs_r
        mask_r = rows < end
        rows = tl.where(mask_r, rows, start)
        if GATHER_A_DIV > 0 or GATHER_B_DIV > 0 or SCALE_A:
            copy = tl.load(order_ptr + rows)
        if GATHER_A_DIV > 0:
            src_a = copy // GATHER_A_DIV
        else:
            src_a = rows
        if GATHER_B_DIV > 0:
            src_b = copy // GATHER_B_DIV
        else:
            src_b = rows
        p_a = a_ptr + src_a.to(tl.int64)[None, :] * stride_ar + cols_m[:, None] * stride_am
        b_a = tl.load(p_a, mask=mask_r[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if SCALE_A:
            s = tl.load(scale_ptr + copy, mask=mask_r, other=0.0).to(tl.float32)
            b_a = cast(b_a.to(tl.float32) * s[None, :], a_ptr.dtype.element_ty, RNE_BY_HAND=RNE_IN)
        p_b = b_ptr + src_b.to(tl.int64)[:, None] * stride_br + cols_n[None, :] * stride_bn
        b_b = tl.load(p_b, mask=mask_r[:, None], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc += dot(b_a, b_b, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
    acc = tl.where(bad, float("nan"), acc)
    out_ptrs = (out_ptr + g.to(tl.int64) * stride_oe + offs_m.to(tl.int64)[:, None] * stride_om
                + offs_n.to(tl.int64)[None, :] * stride_on)  # fmt: skip
    tl.store(out_ptrs, cast(acc, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_OUT),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])  # fmt: skip


# --- launcher -------------------------------------------------------------------------------------------

GROUPED = Kernel(_grouped_gemm_kernel, "moe.grouped_gemm")
WGRAD = Kernel(_grouped_wgrad_kernel, "moe.grouped_wgrad")

# The interpreter runs programs one after another at a cost per program, per loop step and per call of a
# @triton.jit helper (about 1 ms each: Triton 3.9 patches the language module on every device-function call),
# and its tl.dot is a NumPy product of the whole tile: tiles just as large as the problem needs
# (interpreter_tile), and a few persistent programs (fewer than tiles, so each walks several groups' tiles).
INTERPRETER_PROGRAMS = 2
EPILOGUE_SMEM_BYTES = 16 * KIB  # room kept beside the pipelined tiles for the epilogue's layout changes


def pipeline_stages(config_bytes_per_stage: int, hardware: Hardware) -> int:
    """The deepest pipeline (4, 3 or 2 stages) whose tiles fit the device's shared memory per block."""
    room = hardware.smem_per_block_bytes - EPILOGUE_SMEM_BYTES
    for stages in (4, 3, 2):
        if stages * config_bytes_per_stage <= room:
            return stages
    return 1


def _side(n: int, largest: int) -> int:
    return min(largest, max(SMALLEST_TILE_SIDE, next_power_of_2(n)))


@functools.cache
def interpreter_tile(rows_per_group: int, n: int, k: int) -> KernelConfig:
    """The interpreter's tile: BLOCK_M the rows per group (16 to 64), BLOCK_N the columns (up to 64), BLOCK_K
    the reduction (up to 128), each a power of two at least 16."""
    return KernelConfig(_side(rows_per_group, 64), _side(n, 64), 4, 1, block_k=_side(k, 128))


@functools.cache
def grouped_config(
    rows_per_group: int, n: int, element_bytes: int, swiglu: bool, hardware: Hardware
) -> KernelConfig:
    """The compiled forward-shape kernel's tile, a pure function of the problem and the hardware (not tuned
    on a GPU yet: the rule below is the first guess, stated so it can be measured).

    ``rows_per_group`` (total rows / groups, a power of two): BLOCK_M is it, from 16 (tl.dot's smallest
    side: decode's few tokens per expert) to 128; BLOCK_N 128, or 64 with the SwiGLU epilogue (two
    accumulators) or small row tiles; BLOCK_K 64; 8 warps from 128x128 accumulator elements on; pipeline
    stages as deep as shared memory allows.
    """
    block_m = min(128, max(SMALLEST_TILE_SIDE, rows_per_group))
    block_n = 64 if swiglu or block_m <= 32 else 128
    block_n = min(block_n, max(SMALLEST_TILE_SIDE, next_power_of_2(n)))
    block_k = 64
    accumulators = block_m * block_n * (2 if swiglu else 1)
    warps = 8 if accumulators >= 128 * 128 else 4
    per_stage = (block_m + block_n * (2 if swiglu else 1)) * block_k * element_bytes
    return KernelConfig(block_m, block_n, warps, pipeline_stages(per_stage, hardware), block_k=block_k)


@functools.cache
def wgrad_config(m: int, n: int, element_bytes: int, hardware: Hardware) -> KernelConfig:
    """The weight-gradient kernel's output tile: 128x128 (64 on a side under 128 wide), 64 rows per step."""
    block_m = 128 if m >= 128 else max(SMALLEST_TILE_SIDE, min(64, next_power_of_2(m)))
    block_n = 128 if n >= 128 else max(SMALLEST_TILE_SIDE, min(64, next_power_of_2(n)))
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    per_stage = (block_m + block_n) * 64 * element_bytes
    return KernelConfig(block_m, block_n, warps, pipeline_stages(per_stage, hardware), block_k=64)


def uses_tf32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 and fp32_input_precision() == "tf32"


@plan_cache
def _grouped_plan(
    total: int, n: int, k: int, groups: int, a_strides: tuple, b_strides: tuple, out_strides: tuple,
    dtypes: tuple, gather_div: int, swiglu: bool, tf32: bool, device: torch.device,
) -> Plan:  # fmt: skip
    """The forward-shape launch of a problem class: keyed on every size, stride, dtype and switch it fixes."""
    a_dtype, _, out_dtype = dtypes
    hardware = hardware_of(device)
    interpreted = runtime.INTERPRETED
    bucket = next_power_of_2(max(1, total // groups))
    if interpreted:
        cfg = interpreter_tile(bucket, n, k)
    else:
        cfg = grouped_config(bucket, n, a_dtype.itemsize, swiglu, hardware)
    # Tiles there can be at most: each group (and the tail past the last offset) adds one partial row tile.
    upper = (cdiv(total, cfg.block_m) + groups + 1) * cdiv(n, cfg.block_n)
    programs = max(1, min(INTERPRETER_PROGRAMS if interpreted else hardware.sm_count, upper))
    switches = dot_switches(a_dtype, tf32=tf32)
    return GROUPED.plan(
        (programs,), total=total, N=n, K=k, groups=groups, num_programs=programs,
        stride_am=a_strides[0], stride_ak=a_strides[1], stride_be=b_strides[0], stride_bk=b_strides[1],
        stride_bn=b_strides[2], stride_om=out_strides[0], stride_on=out_strides[1],
        GATHER_DIV=gather_div, SWIGLU=swiglu, DOT_IN_FP32=switches["DOT_IN_FP32"],
        DOT_PRECISION=switches["DOT_PRECISION"], RNE_BY_HAND=rne_by_hand(out_dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=next_power_of_2(groups + 1),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


@plan_cache
def _wgrad_plan(
    total: int, m: int, n: int, groups: int, a_strides: tuple, b_strides: tuple, out_strides: tuple,
    dtypes: tuple, gathers: tuple, scale: bool, tf32: bool, device: torch.device,
) -> Plan:  # fmt: skip
    a_dtype, _, out_dtype = dtypes[:3]
    if runtime.INTERPRETED:  # a [M, N] output tile, BLOCK_K rows of a group per step
        bucket = next_power_of_2(max(1, total // groups))
        cfg = KernelConfig(_side(m, 128), _side(n, 128), 4, 1, block_k=_side(bucket, 64))
    else:
        cfg = wgrad_config(m, n, a_dtype.itemsize, hardware_of(device))
    switches = dot_switches(a_dtype, tf32=tf32)
    return WGRAD.plan(
        (cdiv(m, cfg.block_m) * cdiv(n, cfg.block_n), groups), total=total, M=m, N=n, groups=groups,
        stride_ar=a_strides[0], stride_am=a_strides[1], stride_br=b_strides[0], stride_bn=b_strides[1],
        stride_oe=out_strides[0], stride_om=out_strides[1], stride_on=out_strides[2],
        GATHER_A_DIV=gathers[0], GATHER_B_DIV=gathers[1], SCALE_A=scale,
        DOT_IN_FP32=switches["DOT_IN_FP32"], DOT_PRECISION=switches["DOT_PRECISION"],
        RNE_IN=rne_by_hand(a_dtype), RNE_OUT=rne_by_hand(out_dtype),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=next_power_of_2(groups),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def run_grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    b_strides: tuple[int, int, int],
    out: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor | None = None,
    *,
    k: int,
    gather_div: int = 0,
    swiglu: bool = False,
) -> None:
    """Launch :func:`_grouped_gemm_kernel` into ``out`` [total, N] (no report, no checks: the ops' building
    block). ``b_strides`` = (group, k, n) strides of B_g as a [k, N] matrix; ``order`` is read when
    ``gather_div`` > 0."""
    total, n = out.shape
    if total == 0 or n == 0:
        return
    plan = _grouped_plan(
        total, n, k, b.shape[0], a.stride(), b_strides, out.stride(), (a.dtype, b.dtype, out.dtype),
        gather_div, swiglu, uses_tf32(a.dtype), a.device,
    )  # fmt: skip
    plan.launch(a_ptr=a, b_ptr=b, out_ptr=out, offsets_ptr=offsets,
                order_ptr=offsets if order is None else order)  # fmt: skip


def run_wgrad(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    offsets: torch.Tensor,
    order: torch.Tensor | None = None,
    scale: torch.Tensor | None = None,
    *,
    total: int,
    gathers: tuple[int, int] = (0, 0),
) -> None:
    """Launch :func:`_grouped_wgrad_kernel` into ``out`` [groups, M, N] (no report, no checks). a's rows
    are M wide, b's N wide; ``total`` grouped rows (``order``'s length when gathering)."""
    groups, m, n = out.shape
    if m == 0 or n == 0 or groups == 0:
        return
    plan = _wgrad_plan(
        total, m, n, groups, a.stride(), b.stride(), out.stride(),
        (a.dtype, b.dtype, out.dtype, None if scale is None else scale.dtype), gathers, scale is not None,
        uses_tf32(a.dtype), a.device,
    )  # fmt: skip
    plan.launch(a_ptr=a, b_ptr=b, out_ptr=out, offsets_ptr=offsets,
                order_ptr=offsets if order is None else order,
                scale_ptr=offsets if scale is None else scale)  # fmt: skip


def _b_strides(b: torch.Tensor, trans_b: bool) -> tuple[int, int, int]:
    """(group, k, n) strides of op(b[g]) as a [K, N] matrix."""
    s_e, s_1, s_2 = b.stride()
    return (s_e, s_2, s_1) if trans_b else (s_e, s_1, s_2)


def _n_of(b: torch.Tensor, trans_b: bool) -> int:
    return b.shape[1] if trans_b else b.shape[2]


def forward(a, b, offsets, trans_b: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """``out[rows of g] = a[rows of g] @ op(b[g])``; reports its work."""
    total, k = a.shape
    n = _n_of(b, trans_b)
    if not runtime.triton_runs_on(a.device):
        out = reference.grouped_gemm_reference(
            a, b, offsets, trans_b=trans_b, out_dtype=out_dtype, compute_dtype=torch.float32
        )
    else:
        out = tensors.new_output((total, n), out_dtype, a.device)
        run_grouped(a, b, _b_strides(b, trans_b), out, offsets, k=k)
    if out.numel():
        runtime.report_work("grouped_gemm", a=a, b=b, out=out)
    return out


def _backward_torch(dout, a, b, offsets, trans_b, need_a, need_b):
    da = db = None
    if need_a:
        da = reference.grouped_gemm_reference(
            dout, b, offsets, trans_b=not trans_b, out_dtype=a.dtype, compute_dtype=torch.float32
        )
    if need_b:
        db = torch.zeros(b.shape, dtype=torch.float32, device=b.device)
        for g, (s, e) in enumerate(reference.group_bounds(offsets)):
            x, y = a[s:e].float(), dout[s:e].float()
            db[g] = y.mT @ x if trans_b else x.mT @ y
        db = db.to(b.dtype)
    return da, db


def backward(dout, a, b, offsets, trans_b: bool, need_a: bool, need_b: bool):
    """(da, db) of :func:`forward` (a 0-element tensor for one not needed); reports its work."""
    total, k = a.shape
    dout = dout if dout.dtype == a.dtype else dout.to(a.dtype)  # the operands share one dtype
    if runtime.triton_runs_on(a.device):
        da = db = None
        if need_a:
            da = tensors.new_output((total, k), a.dtype, a.device)
            # da[rows of g] = dout[rows of g] @ op(b[g])^T: op(b[g])^T as a [N, K] matrix
            s_e, s_k, s_n = _b_strides(b, trans_b)
            run_grouped(dout, b, (s_e, s_n, s_k), da, offsets, k=_n_of(b, trans_b))
        if need_b:
            db = tensors.new_output(b.shape, b.dtype, b.device)
            if trans_b:  # db[g] [N, K] = dout_g^T @ a_g
                run_wgrad(dout, a, db, offsets, total=total)
            else:  # db[g] [K, N] = a_g^T @ dout_g
                run_wgrad(a, dout, db, offsets, total=total)
    else:
        da, db = _backward_torch(dout, a, b, offsets, trans_b, need_a, need_b)
    if total:
        runtime.report_work("grouped_gemm_backward", a=a, b=b, out=dout)
    return (a.new_empty(0) if da is None else da), (b.new_empty(0) if db is None else db)


# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::grouped_gemm", mutates_args=())
def _forward_op(
    a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, trans_b: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    return forward(a, b, offsets, trans_b, out_dtype)


@_forward_op.register_fake
def _forward_fake(a, b, offsets, trans_b, out_dtype):
    return a.new_empty((a.shape[0], _n_of(b, trans_b)), dtype=out_dtype)


@torch.library.custom_op("llm_speed::grouped_gemm_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, trans_b: bool,
    need_a: bool, need_b: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return backward(dout, a, b, offsets, trans_b, need_a, need_b)


@_backward_op.register_fake
def _backward_fake(dout, a, b, offsets, trans_b, need_a, need_b):
    return (torch.empty_like(a) if need_a else a.new_empty(0)), (
        torch.empty_like(b) if need_b else b.new_empty(0)
    )


_backward_call = autocast.dispatch(Op(_backward_op, backward), autocast.KEEP)  # in the dtypes saved


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    a, b, offsets, trans_b, _ = inputs
    ctx.save_for_backward(a, b, offsets)
    ctx.trans_b = trans_b


def _backward(ctx, dout):
    a, b, offsets = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[:2]
    da, db = _backward_call(dout, a, b, offsets, ctx.trans_b, need_a, need_b)
    return (da if need_a else None), (db if need_b else None), None, None, None


# Under torch.autocast (core.autocast): a and b take the autocast dtype, as torch._grouped_mm and mm do.
_forward_call = autocast.dispatch(Op(_forward_op, forward, setup_context=_setup_context, backward=_backward),
                                  autocast.LOWER, (0, 1))  # fmt: skip


# --- public function ------------------------------------------------------------------------------------


def _validate(a, b, offsets, trans_b, out_dtype) -> tuple[bool, torch.dtype]:
    check_tensor("a", a, dims=2, what="[total, K]")
    trans_b = check_flag("trans_b", trans_b)
    check_tensor("b", b, dims=3, what="[groups, N, K] (trans_b)" if trans_b else "[groups, K, N]")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype, got a {a.dtype} and b {b.dtype}")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype must be None or one of ({dtype_names(FLOAT_DTYPES)}), got {out_dtype}")
    k_b = b.shape[2] if trans_b else b.shape[1]
    if a.shape[1] != k_b:
        layout = "[groups, N, K]" if trans_b else "[groups, K, N]"
        raise ValueError(
            f"a [total, K] has K = {a.shape[1]} but b {tuple(b.shape)} (read as {layout}) has K = {k_b}"
        )
    if b.shape[0] == 0:
        raise ValueError("b must have at least one group (b.shape[0] >= 1)")
    check_tensor("offsets", offsets, dtypes=(torch.int32,), dims=1, what="[groups] (cumulative ends)")
    check_same_device(a=a, b=b, offsets=offsets)
    check_offsets(offsets, a.shape[0], b.shape[0])
    return trans_b, out_dtype or a.dtype


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    *,
    trans_b: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Grouped GEMM: ``out[s_g:e_g] = a[s_g:e_g] @ op(b[g])`` for every group g, in one Triton launch.

    Args:
        a: ``[total, K]`` rows, grouped (float16, bfloat16, float32; any strides).
        b: ``[groups, K, N]``, or ``[groups, N, K]`` with ``trans_b`` (the ``nn.Linear`` / expert-weight
            layout), a's dtype, any strides.
        offsets: int32 ``[groups]``, the cumulative end of each group's rows (``torch._grouped_mm``'s
            ``offs``): group g is rows ``[offsets[g-1], offsets[g])`` (``offsets[-1]`` before the first is 0).
            Non-decreasing and ending at ``total``; empty groups allowed.
        trans_b: read ``b[g]`` transposed.
        out_dtype: the output's dtype (default a's); products accumulate in float32 (fp32 operands use TF32
            only when PyTorch allows it for matmuls, as :func:`llm_speed.gemm`).

    Returns ``[total, N]``. Differentiable in a and b (offsets is an index). ``offsets``' values are never
    read on the host (a persistent launch finds the tiles on the device); they are checked before any work
    where reading is free (CPU tensors, or ``LLM_SPEED_CHECK_INPUTS=1``): ValueError for decreasing or
    negative entries or an end other than ``total``. Unchecked, invalid offsets give NaN (every element when
    they decrease or pass ``total``, the rows past an early end otherwise).

    Devices: CUDA tensors run the Triton kernels; CPU tensors run them through the interpreter under
    ``TRITON_INTERPRET=1``, else :func:`llm_speed.moe.reference.grouped_gemm_reference` in float32.
    """
    if isinstance(a, torch.Tensor):  # mixed float dtypes meet under autocast, as for torch.mm
        a, b = autocast.cast_inputs(autocast.LOWER, a, b)
    trans_b, out_dtype = _validate(a, b, offsets, trans_b, out_dtype)
    return _forward_call(a, b, offsets, trans_b, out_dtype)


__all__ = ["grouped_config", "grouped_gemm", "run_grouped", "run_wgrad", "wgrad_config"]
