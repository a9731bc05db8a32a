"""Argument checks shared by the mixture-of-experts ops: metadata always, values of the index tensors
(``offsets``, expert ids) only where :func:`llm_speed.core.runtime.check_values` allows a host read.

Every error names the argument. With value checks off (CUDA tensors by default) the kernels never read or
write outside a tensor, and what an invalid entry touches comes out NaN (see each op's docstring).
"""

from __future__ import annotations

import torch

from ..core import runtime
from ..core.tensors import check_tensor

INDEX_DTYPES = (torch.int32, torch.int64)
OFFSETS_DTYPES = (torch.int32,)


def check_offsets(offsets, total: int, groups: int) -> None:
    """``offsets``: int32 ``[groups]``, cumulative group ends (as ``torch._grouped_mm``'s ``offs``); with
    value checks on, non-decreasing from >= 0 and ending at ``total`` (ValueError naming the first bad
    entry)."""
    check_tensor("offsets", offsets, dtypes=OFFSETS_DTYPES, dims=1, what="[groups] (cumulative ends)")
    if offsets.shape[0] != groups:
        raise ValueError(f"offsets has {offsets.shape[0]} entries; it must have one per group ({groups})")
    if not runtime.check_values(offsets.device):
        return
    ends = offsets.tolist()
    previous = 0
    for g, end in enumerate(ends):
        if end < previous:
            what = "offsets must be >= 0" if g == 0 else "offsets must be non-decreasing"
            raise ValueError(f"{what}: offsets[{g}] = {end} < {previous}")
        previous = end
    if ends and ends[-1] != total:
        raise ValueError(f"offsets must end at the number of rows ({total}), got offsets[-1] = {ends[-1]}")


def check_expert_ids(topk_ids, num_experts: int) -> None:
    """With value checks on, every id in ``[0, num_experts)`` (ValueError with the first bad one)."""
    if topk_ids.numel() == 0 or not runtime.check_values(topk_ids.device):
        return
    low, high = int(topk_ids.min()), int(topk_ids.max())
    if low < 0 or high >= num_experts:
        bad = low if low < 0 else high
        raise ValueError(f"topk_ids must be in [0, {num_experts}) (the number of experts), found {bad}")


def check_topk(topk_weights, topk_ids, tokens: int | None) -> int:
    """``topk_weights`` float ``[tokens, top_k]`` and ``topk_ids`` int32/int64 of the same shape; returns
    top_k."""
    check_tensor("topk_weights", topk_weights, dims=2, what="[tokens, top_k]")
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, dims=2, what="[tokens, top_k]")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must have one "
            "shape"
        )
    if tokens is not None and topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids has {topk_ids.shape[0]} rows; it must have one per token ({tokens})")
    if topk_ids.shape[1] == 0:
        raise ValueError("top_k (topk_ids.shape[1]) must be at least 1")
    return topk_ids.shape[1]
