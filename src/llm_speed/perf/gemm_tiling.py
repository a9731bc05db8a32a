"""How a GEMM's shape changes its speed: tile counts, wave quantization, HBM traffic, Tensor Core alignment.

Sources: Stanford CS336 (2025), lecture 5 (tiling cuts HBM reads by the tile size; wave quantization on a
108-SM A100: 108 tiles take one wave, 109 take two); NVIDIA "Matrix Multiplication Background User's Guide"
(Deep Learning Performance docs: tile and wave quantization, Tensor Core alignment of 16 bytes: dimensions a
multiple of 8 for FP16, 16 for INT8); ``pad_to_alignment`` keeps the old cuda_llm_ops helper's signature.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llm_speed.core.args import positive_int, type_name
from llm_speed.core.gpus import GPUSpec, dtype_bytes, get_gpu

# Tensor Core kernels (cuBLAS, CUTLASS) need every leading dimension to span a multiple of 16 bytes
# (NVIDIA Matrix Multiplication Background User's Guide, "Tensor Core Requirements").
TENSOR_CORE_ALIGNMENT_BYTES = 16


def tile_count(m: int, n: int, tile_m: int, tile_n: int) -> int:
    """Output tiles (thread blocks) a GEMM launches: ``ceil(m / tile_m) * ceil(n / tile_n)``."""
    m, n = positive_int("m", m), positive_int("n", n)
    tile_m, tile_n = positive_int("tile_m", tile_m), positive_int("tile_n", tile_n)
    return math.ceil(m / tile_m) * math.ceil(n / tile_n)


@dataclass(frozen=True)
class WaveQuantization:
    """How evenly a GEMM's tiles fill the GPU's SMs."""

    tiles: int
    sm_count: int
    tiles_per_sm: int  # concurrent tiles one SM runs (occupancy in CTAs)
    waves: int  # ceil(tiles / (sm_count * tiles_per_sm))
    tail_tiles: int  # tiles in the last, partial wave (0 when the last wave is full)
    efficiency: float  # tiles / (waves * sm_count * tiles_per_sm): busy fraction of the SM slots
    padding_efficiency: float  # m*n / (tiles * tile_m * tile_n): useful fraction of the computed tile area


def wave_quantization(
    m: int, n: int, tile_m: int, tile_n: int, sm_count: int | GPUSpec | str, *, tiles_per_sm: int = 1
) -> WaveQuantization:
    """Waves and SM utilisation of an ``m x n`` output split into ``tile_m x tile_n`` tiles.

    tiles = ceil(m/tile_m) * ceil(n/tile_n); slots = sm_count * tiles_per_sm; waves = ceil(tiles / slots);
    efficiency = tiles / (waves * slots). CS336 lecture 5: on 108 SMs, 108 tiles run in 1 wave (100%), 109
    tiles need 2 waves (109/216 = 50.5%). ``sm_count`` may also be a GPU id or :class:`GPUSpec`.
    """
    if isinstance(sm_count, (str, GPUSpec)):
        sm_count = get_gpu(sm_count).sm_count
    sm_count = positive_int("sm_count", sm_count)
    tiles_per_sm = positive_int("tiles_per_sm", tiles_per_sm)
    tiles = tile_count(m, n, tile_m, tile_n)
    slots = sm_count * tiles_per_sm
    waves = math.ceil(tiles / slots)
    return WaveQuantization(
        tiles=tiles,
        sm_count=sm_count,
        tiles_per_sm=tiles_per_sm,
        waves=waves,
        tail_tiles=tiles % slots,
        efficiency=tiles / (waves * slots),
        padding_efficiency=(m * n) / (tiles * tile_m * tile_n),
    )


@dataclass(frozen=True)
class GemmTraffic:
    """DRAM bytes of ``C[m, n] = A[m, k] @ B[k, n]`` under three data-reuse assumptions."""

    untiled_bytes: float  # every multiply-add reads its A and B element from DRAM
    tiled_bytes: float  # each tile_m x tile_n block streams its A rows and B columns once
    minimum_bytes: float  # each operand read once, C written once (perfect reuse)
    reduction: float  # untiled_bytes / tiled_bytes


def gemm_hbm_traffic(
    m: int,
    n: int,
    k: int,
    *,
    dtype: Any = "fp16",
    out_dtype: Any = None,
    tile_m: int = 128,
    tile_n: int = 128,
) -> GemmTraffic:
    """DRAM traffic with and without tiling (caches ignored), e = input element size, e_o = output's.

    untiled = ``2*m*n*k*e + m*n*e_o`` (CS336 lecture 5: each element of A and B re-read for every output it
    feeds);
    tiled = ``(m*k*ceil(n/tile_n) + k*n*ceil(m/tile_m))*e + m*n*e_o`` (A re-read once per column of tiles, B
    once per row of tiles: a ~tile-size reduction); minimum = ``(m*k + k*n)*e + m*n*e_o``.
    """
    m, n, k = positive_int("m", m), positive_int("n", n), positive_int("k", k)
    tile_m, tile_n = positive_int("tile_m", tile_m), positive_int("tile_n", tile_n)
    e_in = dtype_bytes(dtype)
    e_out = e_in if out_dtype is None else dtype_bytes(out_dtype)
    output = m * n * e_out
    untiled = 2 * m * n * k * e_in + output
    tiled = (m * k * math.ceil(n / tile_n) + k * n * math.ceil(m / tile_m)) * e_in + output
    minimum = (m * k + k * n) * e_in + output
    return GemmTraffic(float(untiled), float(tiled), float(minimum), untiled / tiled)


def tensor_core_alignment(dtype: Any) -> int:
    """Element multiple every GEMM dimension needs for Tensor Core kernels: 16 bytes / element size.

    fp16/bf16: 8, fp8/int8: 16, tf32/fp32: 4 (NVIDIA's GEMM guide: "8 for FP16, 16 for INT8").
    """
    return int(TENSOR_CORE_ALIGNMENT_BYTES // dtype_bytes(dtype))


@dataclass(frozen=True)
class AlignmentAdvice:
    """Which GEMM dims break Tensor Core alignment, the padded shape, and the extra work padding costs."""

    dtype: str
    alignment: int
    shape: tuple[int, int, int]
    padded_shape: tuple[int, int, int]
    misaligned: tuple[str, ...]  # names of the misaligned dims among "m", "n", "k"
    extra_flops_fraction: float  # padded 2mnk / original 2mnk - 1


def check_alignment(
    m: int, n: int, k: int, dtype: Any = "fp16", alignment: int | None = None
) -> AlignmentAdvice:
    """Alignment advice for a GEMM (Tensor Core kernels want every dimension a multiple of 16 bytes).

    ``alignment`` defaults to :func:`tensor_core_alignment` of ``dtype``; pass 16 for "multiples of 16"
    elements whatever the dtype (the old cuda_llm_ops advice).
    """
    dims = {"m": positive_int("m", m), "n": positive_int("n", n), "k": positive_int("k", k)}
    step = tensor_core_alignment(dtype) if alignment is None else positive_int("alignment", alignment)
    padded = {name: pad_to_alignment(size, step) for name, size in dims.items()}
    return AlignmentAdvice(
        dtype=str(dtype),
        alignment=step,
        shape=(m, n, k),
        padded_shape=(padded["m"], padded["n"], padded["k"]),
        misaligned=tuple(name for name, size in dims.items() if size % step),
        extra_flops_fraction=(padded["m"] * padded["n"] * padded["k"]) / (m * n * k) - 1,
    )


def pad_to_alignment(tensor_or_size: Any, alignment: int = 16) -> Any:
    """Round sizes up to a multiple of ``alignment`` (Tensor Core alignment).

    * an int: the smallest multiple of ``alignment`` >= it (0 stays 0);
    * a shape (tuple/list of ints): the last two dims rounded up (the only dim for a 1-D shape);
    * a tensor: as the old cuda_llm_ops helper, a new zero-filled tensor with its last two dims rounded up
      and the original values in the leading corner; the input itself is returned when nothing needs
      padding. A 1-D tensor has its only dim padded (the old helper left 1-D tensors alone; padding them is
      the useful reading).
    """
    alignment = positive_int("alignment", alignment)
    accepted = "an int, a shape (a tuple or list of ints) or a torch.Tensor"
    if isinstance(tensor_or_size, bool):
        raise TypeError(f"tensor_or_size must be {accepted}, got bool")
    if isinstance(tensor_or_size, numbers.Integral):
        if tensor_or_size < 0:
            raise ValueError(f"size must be >= 0, got {tensor_or_size}")
        return -(-int(tensor_or_size) // alignment) * alignment
    if isinstance(tensor_or_size, Sequence) and not isinstance(tensor_or_size, str):
        for s in tensor_or_size:  # int(s) would truncate 16.5 and read True or "16" as sizes
            if isinstance(s, bool) or not isinstance(s, numbers.Integral):
                raise TypeError(
                    f"tensor_or_size must be {accepted}, got {type_name(s)} {s!r} in {tensor_or_size!r}"
                )
        shape = [int(s) for s in tensor_or_size]
        if any(s < 0 for s in shape):
            raise ValueError(f"shape sizes must be >= 0, got {tuple(shape)}")
        for i in range(max(0, len(shape) - 2), len(shape)):
            shape[i] = pad_to_alignment(shape[i], alignment)
        return type(tensor_or_size)(shape) if isinstance(tensor_or_size, (tuple, list)) else tuple(shape)

    import torch

    if not isinstance(tensor_or_size, torch.Tensor):
        raise TypeError(f"tensor_or_size must be {accepted}, got {type_name(tensor_or_size)}")
    tensor = tensor_or_size
    if tensor.dim() == 0:
        raise ValueError("pad_to_alignment needs a tensor with at least one dimension")
    padded_shape = pad_to_alignment(tuple(tensor.shape), alignment)
    if padded_shape == tuple(tensor.shape):
        return tensor
    padded = torch.zeros(padded_shape, dtype=tensor.dtype, device=tensor.device)
    padded[tuple(slice(0, s) for s in tensor.shape)] = tensor
    return padded
