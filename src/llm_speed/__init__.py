"""llm-speed: fast LLM kernels in Triton, a performance model that explains them, and benchmarks.

Importing the package never touches a GPU, and imports nothing heavy: each public name is loaded from its
module on first use (PEP 562 ``__getattr__``), so ``llm-speed gpus`` and the other model commands start
without importing torch. ``from llm_speed import flash_attention`` works as usual.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    # attention kernels
    "flash_attention": "llm_speed.attention",
    "naive_attention": "llm_speed.attention",
    "tiled_attention": "llm_speed.attention",
    "validate_attention_inputs": "llm_speed.attention",
    "flash_attention_with_kvcache": "llm_speed.attention",
    "flash_attention_varlen": "llm_speed.attention",
    # GEMM kernels
    "gemm": "llm_speed.matmul",
    "tensor_core_gemm": "llm_speed.matmul",
    "tensor_core_gemm_int8": "llm_speed.matmul",
    "validate_gemm_inputs": "llm_speed.matmul",
    "quantize_fp8": "llm_speed.matmul.fp8",
    "gemm_fp8": "llm_speed.matmul.fp8",
    # fused LLM ops
    "rms_norm": "llm_speed.fused.rms_norm",
    "apply_rotary": "llm_speed.fused.rotary",
    "apply_rotary_qk": "llm_speed.fused.rotary_qk",
    "swiglu": "llm_speed.fused.swiglu",
    "geglu": "llm_speed.fused.geglu",
    "fused_linear_cross_entropy": "llm_speed.fused.cross_entropy",
    "cross_entropy": "llm_speed.fused.cross_entropy",
    # mixture of experts
    "grouped_gemm": "llm_speed.moe.grouped_gemm",
    "moe_route": "llm_speed.moe.routing",
    "moe_sort": "llm_speed.moe.routing",
    "fused_moe": "llm_speed.moe.fused_moe",
    # memory helpers of the analytic model
    "analyze_memory_hierarchy": "llm_speed.perf.memory",
    "calculate_attention_vram": "llm_speed.perf.memory",
    "calculate_flash_attention_vram": "llm_speed.perf.memory",
    "estimate_attention_memory": "llm_speed.perf.memory",
    "find_optimal_batch_size": "llm_speed.perf.memory",
    # kernel choice, out-of-memory fallback, buffer pool
    "AttentionMemoryPool": "llm_speed.helpers",
    "optimal_attention": "llm_speed.helpers",
    "pad_to_alignment": "llm_speed.helpers",
    "safe_flash_attention": "llm_speed.helpers",
}
# Sub-modules reachable as attributes without an explicit import (``llm_speed.profiler.CUDAProfiler``).
_SUBMODULES = ("profiler", "ops", "distributed", "fused", "nn", "integrations")

__all__ = ["__version__", *_EXPORTS, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"llm_speed.{name}")
    else:
        raise AttributeError(f"module 'llm_speed' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    # the public names and the module's own dunders, not its imports (importlib, Any, annotations)
    return sorted({name for name in globals() if name.startswith("__")} | set(__all__))
