"""The attention kernels' configuration: tiers of tiles by shared memory per block, and the pure choice
functions a plan reads (head dim padding, 32-bit rows, launch order, dQ path)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from ..core.config import KernelConfig
from ..core.hardware import Hardware
from ..core.launch import (
    next_power_of_2,
)
from ..core.policy import LaunchPolicy
from ..core.tiers import ATTENTION_TIER_FLOORS, Tier, first_fitting
from ..core.tile_choice import SMALLEST_TILE_SIDE as MIN_DOT_DIM  # tl.dot needs every tile dim >= 16
from .checks import (
    FP8_DTYPES,
)

FP8_DTYPE = FP8_DTYPES[0]  # fp8 attention's q, k, v (FlashAttention-3's): e4m3 only
# The preprocess kernel (delta = rowsum(dO * O)) streams rows: Triton's default launch options.
PREPROCESS_WARPS, PREPROCESS_STAGES = 4, 3
# The dQ conversion (fp32 accumulator -> dQ) streams elements: 1024 per program, 4 warps.
CONVERT_BLOCK, CONVERT_WARPS = 1024, 4

# Block configurations, chosen by the device's shared memory per block.
#
# One fixed configuration per (direction, dtype class, padded head_dim): no autotuning (a call's cost must not
# depend on a first-call search). ``LARGE`` (227 KB per block: the Hopper-class entries of the GPU table)
# carries the 16-bit rows measured on an H100 SXM; its other rows are FULL's. Forward/dQ: Q [BM, BD] stays
# on chip while K and V [BN, BD] tiles stream through. dK/dV: K, V and the fp32 dK, dV accumulators [BN, BD]
# stay on chip while Q and dO [BM, BD] stream. 16-bit tiles use tensor cores; float32 uses an IEEE product
# (no TF32), which Triton runs on FMA units with both operands in registers: smaller tiles and 8 warps.
# bfloat16 tiles have the sizes of float16 ones.
#
# Tiers by shared memory per block (:class:`llm_speed.core.hardware.Hardware`): ``FULL`` needs at most 98 KiB
# (compiled as launched for the L4, ``tests/kernel_report/test_budgets.py``), so every GPU of the
# table with 99 KB or more per block (A100, H100, H200, B200, Ada) gets it; ``COMPACT`` (one pipeline stage,
# half-height key blocks) serves devices with less (V100's 96 KB, T4's 64 KB). Compiled for sm_90 with
# Triton 3.6, the FULL 16-bit configurations and float32 at head_dim <= 64 spill at most a few hundred bytes
# per thread; earlier float32 head_dim-64 tiles (128 x 64, 4 warps) spilled 11-17 KB per thread. The
# float32 rows at head_dim 128 and 256 are as small as they are because larger ones (forward 64x32, dK/dV
# 32x32 and 32x16) spilled inside their loops on packed sequences (``tests/kernel_report`` checks it).
#
# Under the interpreter (and wherever no CUDA device is involved) the H100 SXM entry of the GPU table stands
# in; the interpreter ignores num_warps and num_stages.

DIRECTIONS = ("forward", "backward")
DTYPE_CLASSES = (torch.float16, torch.float32)  # bfloat16 uses float16's row


@dataclasses.dataclass(frozen=True)
class AttentionTier(Tier):
    """Attention's configurations for devices with at least ``min_smem_bytes`` of shared memory per block.

    ``table[direction][dtype class][padded head_dim]`` is a :class:`KernelConfig` (``block_d`` unset: the
    row serves every head dim padded up to its key; :func:`attention_config` sets it).
    """

    table: dict


def _row(entries: dict) -> dict:
    return {dim: KernelConfig(*entry) for dim, entry in entries.items()}


# Per padded head_dim: (block_m, block_n, num_warps, num_stages).
FULL = AttentionTier(
    *dataclasses.astuple(ATTENTION_TIER_FLOORS[1]),
    {
        "forward": {
            torch.float16: _row({64: (128, 64, 4, 3), 128: (128, 32, 8, 2), 256: (64, 32, 8, 1)}),
            torch.float32: _row({64: (64, 32, 8, 2), 128: (32, 32, 8, 1), 256: (32, 32, 8, 1)}),
        },
        "backward": {
            torch.float16: _row({64: (64, 64, 4, 2), 128: (32, 64, 8, 2), 256: (32, 32, 8, 1)}),
            torch.float32: _row({64: (32, 32, 8, 2), 128: (16, 32, 8, 1), 256: (16, 16, 8, 1)}),
        },
    },
)


def _with(tier_table: dict, changes: dict) -> dict:
    """``tier_table`` with ``changes[direction][dtype][block_d]`` = (block_m, block_n, warps, stages)."""
    table = {
        direction: {dtype: dict(row) for dtype, row in by_dtype.items()}
        for direction, by_dtype in tier_table.items()
    }
    for direction, by_dtype in changes.items():
        for dtype, row in by_dtype.items():
            table[direction][dtype].update(_row(row))
    return table


# Devices with Hopper's 227 KB per block: larger 16-bit tiles, chosen by measurements on an H100 SXM
# (docs/guides/attention-hopper.md): forward 128x64 w8 s3 at d=64 and 128 (128x128 was no faster, and the
# overlapped loop's two score tiles spill there), backward d=128 64x64 w4 s2. Whether the tier's backward
# computes dQ in its own kernel is a launch choice (core.policy: ``backward_dq_kernel_tiers``).
LARGE = AttentionTier(
    *dataclasses.astuple(ATTENTION_TIER_FLOORS[0]),
    _with(
        FULL.table,
        {
            "forward": {torch.float16: {64: (128, 64, 8, 3), 128: (128, 64, 8, 3)}},
            "backward": {torch.float16: {128: (64, 64, 4, 2)}},
        },
    ),
)


def _compact(config: KernelConfig) -> KernelConfig:
    """FULL's configuration with one pipeline stage and half the key rows (at least 16, tl.dot's minimum)."""
    return dataclasses.replace(config, block_n=max(16, config.block_n // 2), num_stages=1)


COMPACT = AttentionTier(
    *dataclasses.astuple(ATTENTION_TIER_FLOORS[2]),
    {
        direction: {
            dtype: {dim: _compact(cfg) for dim, cfg in row.items()} for dtype, row in by_dtype.items()
        }
        for direction, by_dtype in FULL.table.items()
    },
)

TIERS = (LARGE, FULL, COMPACT)  # largest first


def tier_for(hardware: Hardware) -> AttentionTier:
    """The attention tier of ``hardware`` (:func:`llm_speed.core.tiers.first_fitting`)."""
    return first_fitting(TIERS, hardware)


@functools.cache
def attention_config(direction: str, block_d: int, dtype: torch.dtype, hardware: Hardware) -> KernelConfig:
    """The blocks of the ``direction`` ("forward": the forward kernels and the backward's preprocess;
    "backward": the dK/dV kernel, whose row the dQ kernel takes with M and N swapped) kernels for head_dim
    padded to ``block_d`` in ``dtype`` on ``hardware``: its tier's row, with ``block_d`` set."""
    by_dtype = tier_for(hardware).table[direction]
    row = by_dtype[torch.float32 if dtype == torch.float32 else torch.float16]
    return dataclasses.replace(row[max(64, block_d)], block_d=block_d)


class ShippedConfig(NamedTuple):
    """One entry of a tier's table."""

    tier: str
    direction: str
    dtype: torch.dtype  # float16 stands for bfloat16 too
    block_d: int
    config: KernelConfig


def shipped_configs() -> tuple[ShippedConfig, ...]:
    """Every configuration of every tier (tests run each directly and compile each for a GPU)."""
    return tuple(
        ShippedConfig(tier.name, direction, dtype, block_d, config)
        for tier in TIERS
        for direction in DIRECTIONS
        for dtype in DTYPE_CLASSES
        for block_d, config in tier.table[direction][dtype].items()
    )


def padded_head_dim(head_dim: int, dtype: torch.dtype | None = None) -> int:
    """head_dim padded to a power of two, at least :data:`MIN_DOT_DIM` (``BLOCK_D``); for fp8 at least 32,
    the K of an fp8 wgmma (a 16-wide fp8 q.k^T does not compile for sm_90a)."""
    return max(2 * MIN_DOT_DIM if dtype == FP8_DTYPE else MIN_DOT_DIM, next_power_of_2(head_dim))


def rows_fit_32(varlen: bool, tensors, block_rows: int, block_d: int) -> bool:
    """Whether every in-tile offset ``row * stride_row + column`` of ``tensors``, each ``(rows, strides)`` of
    a dense ``[B, H, S, D]`` or packed ``[T, H, D]`` tensor, fits in 32 bits, for tiles of up to
    ``block_rows`` rows (a ragged last one reaches past the last row) and ``block_d`` columns: the kernels
    then compute them without a 64-bit multiply (``ROWS32``; batch, head and a packed sequence's start stay
    64-bit in the base pointer). Packed rows count from the sequence's start, bounded here by the total."""
    for rows, stride in tensors:
        stride_row = stride[0] if varlen else stride[2]
        if (rows + block_rows) * stride_row + block_d > 2**31 - 1:
            return False
    return True


def launch_order(
    is_causal: bool, left, right, hardware: Hardware, pairs: int, kv_bytes: int, group: int, rows: int,
    policy: LaunchPolicy,
) -> dict:
    """The launch-order arguments of a query-block kernel (forward, dQ; :func:`program_block`): longest first
    (``LPT``) in sections of ``section`` of its ``pairs`` (batch, head) pairs, or row order.

    Longest first only pays where a query block's work grows with its index: a causal mask, or a window
    bounded on the right only (a left bound makes the blocks alike), and only on long sequences (``rows``
    queries per sequence, packed: in all; at least ``policy.lpt_min_rows``). A section holds as many pairs as
    keep the K and V they stream (``kv_bytes`` per KV head, shared by ``group`` query heads) in the L2 at
    once, so that the programs running together still share their loads there; at least one. The dK/dV
    kernel keeps row order: its key blocks already start with the heaviest (the first keys see the most
    queries)."""
    min_rows = policy.lpt_min_rows
    if not (is_causal or right is not None) or left is not None or min_rows is None or rows < min_rows:
        return {"section": 1, "LPT": False}
    section = hardware.l2_bytes * group // max(1, kv_bytes)
    return {"section": min(max(1, section), pairs), "LPT": True}


def dq_in_halves(block_d: int, block_m: int, dtype: torch.dtype) -> bool:
    """Whether the dK/dV kernel with atomic dQ takes the head dim in halves (``D_HALVES``): 16-bit tiles of
    64+ query rows at head dim 128 (the H100's 64 x 64). Whole, dQ's [64, 128] float32 tile passed through
    32 KiB of shared memory on its way to the atomics' vector layout (129 KiB a block: one block of 4 warps
    per SM) and held 64 registers a thread beside dK and dV (255 registers, 28 spill instructions in the
    loops); in halves 16 KiB (113 KiB: two blocks per SM, as the dQ-kernel path's dK/dV kernel) and 32
    registers (sm_90a, Triton 3.6; docs/guides/attention-hopper.md)."""
    return block_d == 128 and block_m >= 64 and dtype != torch.float32


def tier_dq_kernel(tier: AttentionTier, policy: LaunchPolicy) -> bool:
    """Whether ``tier``'s default backward computes dQ in a kernel of its own (seven matmuls per tile,
    bitwise repeatable, as ``deterministic=True``) instead of adding it by atomics from the dK/dV kernel
    (five): :meth:`LaunchPolicy.dq_kernel_on` of the tier."""
    return policy.dq_kernel_on(tier.name)
