"""FLOPs and minimum DRAM bytes of windowed and packed (varlen) FlashAttention, for the analytic model.

Same conventions as ``llm_speed.perf.kernel_costs.attention_cost`` (stated there): FLOPs count the matrix
products only (4 FLOPs per visible (query, key) pair and head_dim element forward, 2.5x that backward,
FlashAttention-2 paper, Sec. 4); softcapping is elementwise work and adds none. Bytes are the minimum DRAM
traffic of the flash algorithm: Q, K, V read once, O and the fp32 LSE written once forward; Q, K, V, O, dO,
LSE read, delta written and read, dQ, dK, dV written backward. A window shrinks the FLOPs, not the minimum
bytes (every key is still read by some query block unless no query sees it, which these counts ignore).
Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..perf._checks import attention_shape, positive_int
from ..perf.gpus import dtype_bytes
from ..perf.kernel_costs import KernelCost, attention_cost_for_mode, flash_attention_bytes


def window_visible_pairs(
    seq_q: int, seq_kv: int, *, is_causal: bool = False, window: tuple[int | None, int | None] | None = None
) -> int:
    """(query, key) pairs a head computes under ``is_causal`` and ``window`` (``reference.visible``'s rule:
    query i sees keys ``p - left <= j <= p + right`` with ``p = i + seq_kv - seq_q``). Closed form per row,
    summed over the rows: O(seq_q) integer work."""
    seq_q = positive_int("seq_q", seq_q, allow_zero=True)
    seq_kv = positive_int("seq_kv", seq_kv, allow_zero=True)
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0
    pairs = 0
    for i in range(seq_q):
        p = i + seq_kv - seq_q
        first = 0 if left is None else max(0, p - left)
        last = seq_kv - 1 if right is None else min(seq_kv - 1, p + right)
        pairs += max(0, last - first + 1)
    return pairs


def _cost(forward_flops, q_elems, kv_elems, rows, element, mode) -> KernelCost:
    return attention_cost_for_mode(
        forward_flops, *flash_attention_bytes(q_elems, kv_elems, rows, element), mode
    )


def window_attention_cost(
    batch: int,
    heads_q: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    *,
    heads_kv: int | None = None,
    dtype: Any = "fp16",
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    mode: str = "fwd",
) -> KernelCost:
    """Cost of ``flash_attention(..., is_causal=, window=)``: FLOPs over the visible pairs only."""
    batch, heads_q, seq_q, seq_kv, head_dim, heads_kv = attention_shape(
        batch, heads_q, seq_q, seq_kv, head_dim, heads_kv
    )
    pairs = window_visible_pairs(seq_q, seq_kv, is_causal=is_causal, window=window)
    return _cost(
        4 * batch * heads_q * head_dim * pairs,
        batch * heads_q * seq_q * head_dim,
        batch * heads_kv * seq_kv * head_dim,
        batch * heads_q * seq_q,
        dtype_bytes(dtype),
        mode,
    )


def varlen_attention_cost(
    lengths_q: Sequence[int],
    lengths_k: Sequence[int],
    heads_q: int,
    head_dim: int,
    *,
    heads_kv: int | None = None,
    dtype: Any = "fp16",
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    mode: str = "fwd",
) -> KernelCost:
    """Cost of ``flash_attention_varlen`` for sequences of these lengths: each sequence attends within itself,
    so FLOPs are the sum over sequences (not batch x max_seqlen); bytes are of the packed totals."""
    if len(lengths_q) != len(lengths_k):
        raise ValueError(f"lengths_q and lengths_k must have one entry per sequence, got {len(lengths_q)} "
                         f"and {len(lengths_k)}")  # fmt: skip
    _, heads_q, _, _, head_dim, heads_kv = attention_shape(1, heads_q, 1, 1, head_dim, heads_kv)
    pairs = sum(
        window_visible_pairs(sq, sk, is_causal=is_causal, window=window)
        for sq, sk in zip(lengths_q, lengths_k, strict=True)
    )
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    return _cost(
        4 * heads_q * head_dim * pairs,
        heads_q * total_q * head_dim,
        heads_kv * total_k * head_dim,
        heads_q * total_q,
        dtype_bytes(dtype),
        mode,
    )
