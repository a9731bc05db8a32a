"""How the fused linear cross-entropy cuts its rows into chunks: one definition, shared by the op
(:mod:`llm_speed.fused.cross_entropy`) and the analytic model that prices it (:mod:`llm_speed.perf.predict`).
Torch-free.

A chunk's logits ``[C, V]`` are made about as large as ``hidden [N, H]`` (Liger-Kernel's rule,
linkedin/Liger-Kernel ``ops/fused_linear_cross_entropy.py``), with two floors: at least
:data:`MIN_CHUNK_LOGITS` logits, and at least :data:`MIN_CHUNK_ROWS` rows when N has them.
"""

from __future__ import annotations

from llm_speed.core.intmath import cdiv, next_power_of_2

# A chunk holds at least this many logits: below it, a chunk's GEMM and kernel launches cost more host time
# than its memory (128 KiB in bfloat16) is worth.
MIN_CHUNK_LOGITS = 1 << 16
# ... and at least this many rows (when N has them): each chunk's three GEMMs read the whole [V, H] weight
# (and the weight gradient's accumulation reads and writes it), so rows per chunk are their FLOPs per weight
# byte; the H100's ridge is 295 FLOP/B. Liger's rule alone gave Llama-3-8B's head 64-row chunks at N = 2048
# (32 weight passes per GEMM): 69 of an 85 ms training step in those GEMMs, against 28.7 ms for the whole
# unfused step (H100, 2026-11-25, benchmarks/train_step_profile.py).
MIN_CHUNK_ROWS = 1024


def linear_cross_entropy_chunk_rows(n: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: ``C = next_pow2(max(ceil(N / ceil(V / H)), ceil(2^16 / V), 1024))``, at most N (and at
    least 1)."""
    liger = next_power_of_2(cdiv(n, cdiv(vocab, hidden)))
    floor = max(MIN_CHUNK_ROWS, next_power_of_2(cdiv(MIN_CHUNK_LOGITS, vocab)))
    return max(1, min(n, max(liger, floor)))
