"""llm-speed: fast LLM kernels in Triton, a performance model that explains them, and benchmarks.

Importing the package never touches a GPU.
"""

__version__ = "0.1.0"

from llm_speed import profiler
from llm_speed.attention import flash_attention, naive_attention, tiled_attention, validate_attention_inputs
from llm_speed.fused.cross_entropy import fused_linear_cross_entropy
from llm_speed.fused.rms_norm import rms_norm
from llm_speed.fused.rotary import apply_rotary
from llm_speed.fused.swiglu import swiglu
from llm_speed.helpers import AttentionMemoryPool, optimal_attention, pad_to_alignment, safe_flash_attention
from llm_speed.matmul import gemm, tensor_core_gemm, tensor_core_gemm_int8, validate_gemm_inputs
from llm_speed.perf.memory import (
    analyze_memory_hierarchy,
    calculate_attention_vram,
    calculate_flash_attention_vram,
    estimate_attention_memory,
    find_optimal_batch_size,
)

__all__ = [
    "__version__",
    # attention kernels (llm_speed.attention)
    "flash_attention",
    "naive_attention",
    "tiled_attention",
    "validate_attention_inputs",
    # GEMM kernels (llm_speed.matmul)
    "gemm",
    "tensor_core_gemm",
    "tensor_core_gemm_int8",
    "validate_gemm_inputs",
    # fused LLM ops (llm_speed.fused)
    "rms_norm",
    "apply_rotary",
    "swiglu",
    "fused_linear_cross_entropy",
    # memory helpers (llm_speed.perf.memory)
    "analyze_memory_hierarchy",
    "calculate_attention_vram",
    "calculate_flash_attention_vram",
    "estimate_attention_memory",
    "find_optimal_batch_size",
    # attention helpers (llm_speed.helpers) and the profiler
    "AttentionMemoryPool",
    "optimal_attention",
    "pad_to_alignment",
    "safe_flash_attention",
    "profiler",
]
