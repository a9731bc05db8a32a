"""The configuration of :mod:`llm_speed.matmul.gemm`: the tiers of tiles by shared memory per block, the
interpreter's tile, and :func:`gemm_config`, the pure choice of a problem's tile."""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..core.config import KernelConfig
from ..core.hardware import KIB, Hardware
from ..core.tiers import Tier, first_fitting
from ..core.tile_choice import choose_tile

PATHS = ("tiled", "persistent_tma")



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
