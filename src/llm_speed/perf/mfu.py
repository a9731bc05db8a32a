"""Model and hardware FLOP utilisation from a measured time.

MFU = (model FLOPs / measured seconds) / peak FLOP/s, where model FLOPs count only the work the algorithm
needs (e.g. 2mnk for a GEMM, causal attention's visible pairs). HFU uses the FLOPs the hardware actually
executed, including recomputation (activation checkpointing, FlashAttention's backward recomputing QK^T)
and any masked work done anyway. Definitions: Chowdhery et al., "PaLM" (2022), Appendix B; Korthikanti et
al., "Reducing Activation Recomputation in Large Transformer Models" (2022). Worked example: seed 003
(4096^3 GEMM in 0.5 ms on H100 SXM: 274.9 TFLOP/s achieved, MFU 27.8%).
"""

from __future__ import annotations

from typing import Any

from llm_speed.perf.gpus import GPUSpec, get_gpu


def achieved_flops_per_s(flops: float, seconds: float) -> float:
    """``flops / seconds``; raises ValueError for negative FLOPs or a non-positive time."""
    if isinstance(flops, bool) or not isinstance(flops, (int, float)) or not flops >= 0:
        raise ValueError(f"flops must be a number >= 0, got {flops!r}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(f"seconds must be a number > 0, got {seconds!r}")
    return flops / seconds


def mfu(flops: float, seconds: float, gpu: str | GPUSpec, dtype: Any) -> float:
    """Model FLOP utilisation in [0, 1] (can exceed 1 only if the inputs are wrong): achieved / dense peak.

    ``flops`` are the model's useful FLOPs, ``seconds`` the measured wall time, the peak is
    ``get_gpu(gpu).peak_flops(dtype)`` (dense, never sparse).
    """
    return achieved_flops_per_s(flops, seconds) / get_gpu(gpu).peak_flops(dtype)


def hfu(hardware_flops: float, seconds: float, gpu: str | GPUSpec, dtype: Any) -> float:
    """Hardware FLOP utilisation: executed FLOPs (incl. recomputation) / seconds / dense peak; HFU >= MFU."""
    return achieved_flops_per_s(hardware_flops, seconds) / get_gpu(gpu).peak_flops(dtype)
