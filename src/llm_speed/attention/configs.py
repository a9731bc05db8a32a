"""Block configurations of the attention kernels, chosen by the device's shared memory per block.

One fixed configuration per (direction, dtype class, padded head_dim): no autotuning (a call's cost must not
depend on a first-call search). ``LARGE`` (227 KB per block: the Hopper-class entries of the GPU table)
carries the 16-bit rows measured on an H100 SXM; its other rows are FULL's.
Forward/dQ: Q [BM, BD] stays on chip while K and V [BN, BD] tiles stream through. dK/dV: K, V and the fp32
dK, dV accumulators [BN, BD] stay on chip while Q and dO [BM, BD] stream. 16-bit tiles use tensor cores;
float32 uses an IEEE product (no TF32), which Triton runs on FMA units with both operands in registers:
smaller tiles and 8 warps. bfloat16 tiles have the sizes of float16 ones.

Tiers by shared memory per block (:class:`llm_speed.core.hardware.Hardware`): ``FULL`` needs at most 98 KiB
(compiled with Triton for sm_80 and sm_90, ``tests/attention/compile_for_gpu.py``), so every GPU of the
table with 99 KB or more per block (A100, H100, H200, B200, Ada) gets it; ``COMPACT`` (one pipeline stage,
half-height key blocks) serves devices with less (V100's 96 KB, T4's 64 KB). Compiled for sm_90 with
Triton 3.6, the FULL 16-bit configurations and float32 at head_dim <= 64 spill at most a few hundred bytes
per thread; earlier float32 head_dim-64 tiles (128 x 64, 4 warps) spilled 11-17 KB per thread.

Under the interpreter (and wherever no CUDA device is involved) the H100 SXM entry of the GPU table stands
in; the interpreter ignores num_warps and num_stages.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from llm_speed.core import runtime
from llm_speed.core.config import KernelConfig
from llm_speed.core.hardware import KIB, Hardware, hardware_of

__all__ = [
    "COMPACT",
    "FULL",
    "LARGE",
    "TIERS",
    "KernelConfig",
    "ShippedConfig",
    "Tier",
    "backward_config",
    "forward_config",
    "shipped_configs",
    "tier_for",
]

DIRECTIONS = ("forward", "backward")
DTYPE_CLASSES = (torch.float16, torch.float32)  # bfloat16 uses float16's row


@dataclasses.dataclass(frozen=True)
class Tier:
    """Configurations for devices with at least ``min_smem_bytes`` of shared memory per block.

    ``table[direction][dtype class][padded head_dim]`` is a :class:`KernelConfig`.
    """

    name: str
    min_smem_bytes: int
    table: dict


def _row(entries: dict) -> dict:
    return {dim: KernelConfig(*entry) for dim, entry in entries.items()}


# Per padded head_dim: (block_m, block_n, num_warps, num_stages).
FULL = Tier(
    "99 KB",
    99 * KIB,
    {
        "forward": {
            torch.float16: _row({64: (128, 64, 4, 3), 128: (128, 32, 8, 2), 256: (64, 32, 8, 1)}),
            torch.float32: _row({64: (64, 32, 8, 2), 128: (64, 32, 8, 1), 256: (32, 32, 8, 1)}),
        },
        "backward": {
            torch.float16: _row({64: (64, 64, 4, 2), 128: (32, 64, 8, 2), 256: (32, 32, 8, 1)}),
            torch.float32: _row({64: (32, 32, 8, 2), 128: (32, 32, 8, 1), 256: (32, 16, 8, 1)}),
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


# Devices with Hopper's 227 KB per block: larger 16-bit tiles, measured on an H100 SXM (torch 2.11,
# Triton 3.6, fp16, 16k tokens, non-causal; docs/notes/attention-tuning.md): forward d=128 128x128 w8 s3
# 481 TFLOP/s against FULL's 128x32 w8 s2 292; d=64 128x64 w8 s3 410 against 392; backward d=128 64x64
# w4 s2 391 against 32x64 w8 s2 150. The other rows are FULL's.
LARGE = Tier(
    "227 KB",
    227 * KIB,
    _with(
        FULL.table,
        {
            "forward": {torch.float16: {64: (128, 64, 8, 3), 128: (128, 128, 8, 3)}},
            "backward": {torch.float16: {128: (64, 64, 4, 2)}},
        },
    ),
)


def _compact(config: KernelConfig) -> KernelConfig:
    """FULL's configuration with one pipeline stage and half the key rows (at least 16, tl.dot's minimum)."""
    return dataclasses.replace(config, block_n=max(16, config.block_n // 2), num_stages=1)


COMPACT = Tier(
    "under 99 KB",
    0,
    {
        direction: {
            dtype: {dim: _compact(cfg) for dim, cfg in row.items()} for dtype, row in by_dtype.items()
        }
        for direction, by_dtype in FULL.table.items()
    },
)

TIERS = (LARGE, FULL, COMPACT)  # largest first


def tier_for(hardware: Hardware) -> Tier:
    """The first tier (largest first) whose shared memory the device has."""
    for tier in TIERS:
        if hardware.smem_per_block_bytes >= tier.min_smem_bytes:
            return tier
    return TIERS[-1]


def _hardware(device) -> Hardware:
    # Launchers run under runtime.on_device_of(q): with no device given, the current CUDA device is q's.
    if device is None and not runtime.INTERPRETED and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return hardware_of(device)


def _lookup(direction: str, block_d: int, dtype: torch.dtype, device) -> KernelConfig:
    by_dtype = tier_for(_hardware(device)).table[direction]
    return by_dtype[torch.float32 if dtype == torch.float32 else torch.float16][max(64, block_d)]


def forward_config(block_d: int, dtype: torch.dtype, device: torch.device | None = None) -> KernelConfig:
    """Forward/dQ blocks for padded head dim ``block_d`` on ``device`` (None: the current CUDA device)."""
    return _lookup("forward", block_d, dtype, device)


def backward_config(block_d: int, dtype: torch.dtype, device: torch.device | None = None) -> KernelConfig:
    """dK/dV blocks for padded head dim ``block_d`` on ``device`` (None: the current CUDA device)."""
    return _lookup("backward", block_d, dtype, device)


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
