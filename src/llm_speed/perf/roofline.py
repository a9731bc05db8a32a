"""The roofline model: attainable FLOP/s = min(peak, bandwidth x arithmetic intensity).

Source: S. Williams, A. Waterman, D. Patterson, "Roofline: An Insightful Visual Performance Model for
Multicore Architectures", CACM 52(4), 2009 (Performance = min(Peak Compute, Bandwidth * AI); memory- and
compute-bound regions either side of the ridge point).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llm_speed.core.args import non_negative_number
from llm_speed.core.gpus import GPUSpec, get_gpu, normalize_dtype


@dataclass(frozen=True)
class RooflinePoint:
    """Where one kernel (``flops`` work, ``bytes_moved`` DRAM traffic) sits on one GPU's roofline."""

    flops: float
    bytes_moved: float
    intensity: float  # FLOP per byte of DRAM traffic
    ridge_point: float  # FLOP/byte where the roof turns flat
    peak_flops: float  # FLOP/s
    memory_bandwidth: float  # bytes/s
    attainable_flops: float  # FLOP/s
    bound: str  # "memory" or "compute"
    time_floor_s: float  # the shortest possible run time
    gpu_id: str
    dtype: str

    @property
    def compute_time_s(self) -> float:
        """``flops / peak_flops``: the time if only arithmetic counted."""
        return self.flops / self.peak_flops

    @property
    def memory_time_s(self) -> float:
        """``bytes_moved / memory_bandwidth``: the time if only DRAM traffic counted."""
        return self.bytes_moved / self.memory_bandwidth


def arithmetic_intensity(flops: float, bytes_moved: float) -> float:
    """``flops / bytes_moved`` in FLOP/byte (infinite when no bytes move and work is done, 0 for no work)."""
    flops = non_negative_number("flops", flops)
    bytes_moved = non_negative_number("bytes_moved", bytes_moved)
    if bytes_moved == 0:
        return float("inf") if flops > 0 else 0.0
    return flops / bytes_moved


def roofline(flops: float, bytes_moved: float, dtype: Any, gpu: str | GPUSpec) -> RooflinePoint:
    """Place a kernel on ``gpu``'s roofline for ``dtype`` (both required: there is no default GPU).

    intensity I = flops / bytes_moved; ridge R = peak / bandwidth; attainable = min(peak, bandwidth * I);
    bound = "memory" if I < R else "compute"; time floor = max(flops / peak, bytes_moved / bandwidth)
    (the two resources work in parallel, so the slower one sets the floor).
    """
    spec = get_gpu(gpu)
    dtype_name = normalize_dtype(dtype)
    peak = spec.peak_flops(dtype_name)
    bandwidth = spec.memory_bandwidth
    intensity = arithmetic_intensity(flops, bytes_moved)
    ridge = peak / bandwidth
    attainable = min(peak, bandwidth * intensity)
    time_floor = max(flops / peak, bytes_moved / bandwidth)
    return RooflinePoint(
        flops=float(flops),
        bytes_moved=float(bytes_moved),
        intensity=intensity,
        ridge_point=ridge,
        peak_flops=peak,
        memory_bandwidth=bandwidth,
        attainable_flops=attainable,
        bound="memory" if intensity < ridge else "compute",
        time_floor_s=time_floor,
        gpu_id=spec.id,
        dtype=dtype_name,
    )
