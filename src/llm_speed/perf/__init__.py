"""The performance model: GPU specs, roofline, memory, GEMM shape effects, kernel costs, MFU.

Pure Python; nothing here touches a GPU unless a function that reads the live device is called.
"""

from llm_speed.perf.gemm_shapes import (
    check_alignment,
    gemm_hbm_traffic,
    pad_to_alignment,
    tensor_core_alignment,
    tile_count,
    wave_quantization,
)
from llm_speed.perf.gpus import (
    GPUSpec,
    detect_gpu,
    dtype_bytes,
    get_gpu,
    list_gpus,
    live_device_properties,
    normalize_dtype,
)
from llm_speed.perf.kernel_costs import KernelCost, attention_cost, gemm_cost, visible_pairs
from llm_speed.perf.memory import (
    AttentionMemory,
    analyze_memory_hierarchy,
    attention_memory,
    calculate_attention_vram,
    calculate_flash_attention_vram,
    estimate_attention_memory,
    find_optimal_batch_size,
)
from llm_speed.perf.mfu import achieved_flops_per_s, hfu, mfu
from llm_speed.perf.roofline import RooflinePoint, arithmetic_intensity, roofline

__all__ = [
    "AttentionMemory",
    "GPUSpec",
    "KernelCost",
    "RooflinePoint",
    "achieved_flops_per_s",
    "analyze_memory_hierarchy",
    "arithmetic_intensity",
    "attention_cost",
    "attention_memory",
    "calculate_attention_vram",
    "calculate_flash_attention_vram",
    "check_alignment",
    "detect_gpu",
    "dtype_bytes",
    "estimate_attention_memory",
    "find_optimal_batch_size",
    "gemm_cost",
    "gemm_hbm_traffic",
    "get_gpu",
    "hfu",
    "list_gpus",
    "live_device_properties",
    "mfu",
    "normalize_dtype",
    "pad_to_alignment",
    "roofline",
    "tensor_core_alignment",
    "tile_count",
    "visible_pairs",
    "wave_quantization",
]
