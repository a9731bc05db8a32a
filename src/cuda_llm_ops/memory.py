"""The old projects' memory formulas, literally, for code that depends on their numbers.

``llm_speed`` exports corrected functions of the same names (:mod:`llm_speed.perf.memory`); these keep the
old results, known errors included (docs/compat.md lists them):

* :func:`estimate_attention_memory` counts every dtype but float16 as 4 bytes (bfloat16 too);
* :func:`calculate_attention_vram` counts one s x s score matrix for all heads (``num_heads`` times too low);
* :func:`analyze_memory_hierarchy` calls the time to stream 1 KB at full bandwidth a "latency" (0.05 ns for
  shared memory), and gives L2 the HBM bandwidth.
"""

from __future__ import annotations

from typing import Any

from llm_speed.core.args import positive_int
from llm_speed.core.gpus import normalize_dtype
from llm_speed.perf.memory import checked_qkv_and_output, gb_breakdown, positive_number

# The old bandwidth table (bytes/s): an A100's shared memory and HBM, and the HBM figure again for L2.
OLD_MEMORY_BANDWIDTH: dict[str, float] = {"shared_memory": 19e12, "l2_cache": 1.5e12, "hbm": 1.5e12}


def analyze_memory_hierarchy() -> dict[str, dict[str, float]]:
    """Per level: ``bandwidth_tb_s`` and ``latency_ns = 1024 / bandwidth * 1e9`` (really a streaming time)."""
    return {
        level: {"bandwidth_tb_s": bandwidth / 1e12, "latency_ns": 1024 / bandwidth * 1e9}
        for level, bandwidth in OLD_MEMORY_BANDWIDTH.items()
    }


def calculate_attention_vram(
    seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int = 2
) -> dict[str, float]:
    """Standard attention in decimal GB: qkv 3*s*h*d*e, attention_matrix s*s*e (one head), output s*h*d*e."""
    qkv, output = checked_qkv_and_output(seq_len, num_heads, head_dim, dtype_bytes)
    attention_matrix = int(seq_len) * int(seq_len) * positive_number("dtype_bytes", dtype_bytes)
    return gb_breakdown(qkv=qkv, attention_matrix=attention_matrix, output=output)


def estimate_attention_memory(
    batch: int, heads: int, seq_len: int, head_dim: int, dtype: Any = "fp16"
) -> float:
    """MiB of Q, K, V, O and a 10% allowance, with e = 2 bytes for float16 and 4 for any other dtype."""
    batch = positive_int("batch", batch)
    heads = positive_int("heads", heads)
    seq_len = positive_int("seq_len", seq_len)
    head_dim = positive_int("head_dim", head_dim)
    element = 2 if normalize_dtype(dtype) == "fp16" else 4
    tensor = batch * heads * seq_len * head_dim * element
    return (3 * tensor + tensor + 0.1 * tensor) / (1024 * 1024)
