"""Block configurations for the GEMM kernels, all in one place, chosen by what the device has.

A configuration (:class:`llm_speed.core.hardware.KernelConfig`, shared with attention) is a tile shape
(BLOCK_M x BLOCK_N, stepping BLOCK_K along the reduction), the width of the grouped launch order (GROUP_M),
and the launch parameters num_warps and num_stages (the depth of Triton's software pipeline: how many
K-tiles are loaded ahead of the tensor-core work).

The lists come in tiers by shared memory per block, the resource the pipelined tiles fill: a device gets
the first tier whose ``min_smem_bytes`` it has (:func:`tier_for`), so an H100, H200 or B200 (227 KB per
block) get the large tiles and the persistent tensor-descriptor (TMA) kernel, an A100 (163 KB) the tiles of
Triton's matmul tutorial, and 99-KB parts (Ada, consumer Blackwell) small tiles. The TMA kernel runs where
the device has tensor descriptors (compute capability >= 9.0) and its tier ships TMA configurations. The
number of SMs sets the persistent kernel's program count.

On a GPU the launcher autotunes over the tier's list, keyed on the problem (size buckets, the strides that
decide the layout, the dtypes). Under the Triton interpreter one pinned configuration runs: the
interpreter ignores num_warps/num_stages and autotuning there would only cost time.

Nothing here touches the GPU; the launcher passes the device's :class:`Hardware` in.
"""

from __future__ import annotations

import dataclasses

from llm_speed.core.config import KernelConfig
from llm_speed.core.hardware import KIB, Hardware

__all__ = [
    "INTERPRETER",
    "INTERPRETER_PERSISTENT_PROGRAMS",
    "TIERS",
    "KernelConfig",
    "Hardware",
    "Tier",
    "has_tma",
    "persistent_tma_configs",
    "shared_bytes",
    "shipped_configs",
    "tier_for",
    "tiled_configs",
]


@dataclasses.dataclass(frozen=True)
class Tier:
    """The configurations for devices with at least ``min_smem_bytes`` of shared memory per block."""

    name: str
    min_smem_bytes: int
    tiled: tuple[KernelConfig, ...]
    persistent_tma: tuple[KernelConfig, ...] = ()  # empty: this tier uses the tiled kernel only


def _cfg(m: int, n: int, k: int, warps: int, stages: int) -> KernelConfig:
    return KernelConfig(m, n, warps, stages, block_k=k, group_m=8)


# 227 KB per block (H100, H200, B200): big tiles with 3-4 pipeline stages; the largest needs 144 KB.
LARGE = Tier(
    "227 KB",
    227 * KIB,
    tiled=(
        _cfg(128, 256, 64, 8, 3),
        _cfg(128, 128, 64, 8, 4),
        _cfg(128, 128, 32, 4, 4),
        _cfg(128, 64, 64, 4, 4),
        _cfg(64, 128, 64, 4, 4),
        _cfg(64, 64, 64, 4, 4),
        _cfg(64, 32, 32, 2, 5),
    ),
    # The persistent kernel fed by tensor descriptors (TMA); fp16/bf16 only.
    persistent_tma=(
        _cfg(128, 256, 64, 8, 3),
        _cfg(128, 128, 64, 8, 4),
        _cfg(128, 128, 64, 4, 3),
        _cfg(128, 64, 64, 4, 4),
        _cfg(64, 128, 64, 4, 4),
    ),
)

# 163 KB per block (A100): the tiles of Triton's matmul tutorial
# (https://triton-lang.org/main/getting-started/tutorials/03-matrix-multiplication.html); at most 72 KB.
MEDIUM = Tier(
    "163 KB",
    163 * KIB,
    tiled=(
        _cfg(128, 256, 32, 8, 3),
        _cfg(128, 128, 32, 4, 4),
        _cfg(128, 64, 32, 4, 4),
        _cfg(64, 128, 32, 4, 4),
        _cfg(64, 64, 32, 4, 4),
        _cfg(64, 32, 32, 2, 5),
        _cfg(32, 64, 32, 2, 5),
    ),
)

# 99 KB per block (Ada, consumer Blackwell) and anything smaller: at most 48 KB. On a device with less than
# a configuration needs, the autotuner skips it (out of resources).
SMALL = Tier(
    "99 KB",
    99 * KIB,
    tiled=(
        _cfg(128, 128, 32, 4, 3),
        _cfg(128, 64, 32, 4, 3),
        _cfg(64, 128, 32, 4, 3),
        _cfg(64, 64, 32, 4, 3),
        _cfg(32, 64, 32, 2, 3),
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


def tier_for(hardware: Hardware) -> Tier:
    """The first tier (largest first) whose shared memory the device has; the smallest tier otherwise."""
    for tier in TIERS:
        if hardware.smem_per_block_bytes >= tier.min_smem_bytes:
            return tier
    return TIERS[-1]


def tiled_configs(hardware: Hardware) -> tuple[KernelConfig, ...]:
    """The autotuning list of the tiled kernel on ``hardware``."""
    return tier_for(hardware).tiled


def persistent_tma_configs(hardware: Hardware) -> tuple[KernelConfig, ...]:
    """The autotuning list of the persistent TMA kernel on ``hardware`` (empty: the kernel is not used)."""
    return tier_for(hardware).persistent_tma if hardware.has_tma else ()


def has_tma(hardware: Hardware) -> bool:
    """Whether the persistent tensor-descriptor (TMA) kernel is used on ``hardware``."""
    return bool(persistent_tma_configs(hardware))


def shipped_configs() -> tuple[tuple[str, KernelConfig], ...]:
    """Every configuration any device can get, once each, as (path, config) with path "tiled" or
    "persistent_tma" (the tests run each directly, and compile each for sm_90)."""
    seen: dict[tuple[str, KernelConfig], None] = {}
    for tier in TIERS:
        for path, listed in (("tiled", tier.tiled), ("persistent_tma", tier.persistent_tma)):
            for config in listed:
                seen[(path, config)] = None
    return tuple(seen)
