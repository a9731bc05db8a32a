"""llm-speed: fast LLM kernels in Triton, a performance model that explains them, and benchmarks.

Importing the package never touches a GPU.
"""

__version__ = "0.1.0"

# --- attention kernels (llm_speed.attention) ---
from llm_speed.attention import (  # noqa: E402, I001  (sections are ordered by area, not sorted)
    flash_attention,  # noqa: F401
    naive_attention,  # noqa: F401
    tiled_attention,  # noqa: F401
    validate_attention_inputs,  # noqa: F401
)

# --- GEMM kernels (llm_speed.matmul) ---
from llm_speed.matmul import (  # noqa: E402
    gemm,  # noqa: F401
    tensor_core_gemm,  # noqa: F401
    tensor_core_gemm_int8,  # noqa: F401
    validate_gemm_inputs,  # noqa: F401
)

# --- performance model (llm_speed.perf) ---
from llm_speed.perf.memory import (  # noqa: E402
    analyze_memory_hierarchy,  # noqa: F401
    calculate_attention_vram,  # noqa: F401
    calculate_flash_attention_vram,  # noqa: F401
    estimate_attention_memory,  # noqa: F401
    find_optimal_batch_size,  # noqa: F401
)

# --- seed-002 helpers (llm_speed.helpers) ---
from llm_speed import profiler  # noqa: E402, F401  (CUDAProfiler, KernelMetrics, Bottleneck)
from llm_speed.helpers import (  # noqa: E402
    AttentionMemoryPool,  # noqa: F401
    optimal_attention,  # noqa: F401
    pad_to_alignment,  # noqa: F401
    safe_flash_attention,  # noqa: F401
)
