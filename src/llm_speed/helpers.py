"""Helpers of the old CUDA project's API (``cuda_llm_ops``, see docs/compat.md), working: kernel choice by
sequence length, an out-of-memory fallback, a buffer pool.

The memory and alignment helpers of the same API live in :mod:`llm_speed.perf` and are re-exported here:
:func:`estimate_attention_memory`, :func:`find_optimal_batch_size`, :func:`pad_to_alignment`.
"""

from __future__ import annotations

import warnings

import torch

from llm_speed.attention.checks import validate_attention_inputs
from llm_speed.attention.flash import flash_attention
from llm_speed.attention.naive import naive_attention
from llm_speed.attention.reference import causal_visible
from llm_speed.attention.tiled import tiled_attention
from llm_speed.core import runtime
from llm_speed.core.args import check_flag
from llm_speed.perf.gemm_tiling import pad_to_alignment
from llm_speed.perf.memory import estimate_attention_memory, find_optimal_batch_size

__all__ = [
    "AttentionMemoryPool",
    "estimate_attention_memory",
    "find_optimal_batch_size",
    "optimal_attention",
    "pad_to_alignment",
    "safe_flash_attention",
]

# The old project's kernel-choice thresholds: FlashAttention from 512 tokens on, tiled attention from 128, and
# the naive kernel, cheapest to launch, below that.
FLASH_MIN_SEQ_LEN = 512
TILED_MIN_SEQ_LEN = 128


def optimal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *, scale: float | None = None
) -> torch.Tensor:
    """Attention through the implementation the old project recommended for the sequence length.

    The longer of seq_q and seq_kv decides (equal lengths: q's, as before): >= 512 flash, >= 128 tiled,
    else naive. Unlike the old code, ``is_causal`` and ``scale`` reach every implementation (it
    dropped ``is_causal`` for tiled and naive). All three give the same result within rounding, with
    llm_speed's semantics (bottom-right causal mask, GQA/MQA).
    """
    validate_attention_inputs(q, k, v)
    is_causal = check_flag("is_causal", is_causal)
    seq_len = max(q.shape[2], k.shape[2])
    if seq_len >= FLASH_MIN_SEQ_LEN:
        attention = flash_attention
    elif seq_len >= TILED_MIN_SEQ_LEN:
        attention = tiled_attention
    else:
        attention = naive_attention
    return attention(q, k, v, is_causal=is_causal, scale=scale)


def _is_out_of_memory(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False, scale: float | None = None
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with llm_speed's semantics.

    SDPA aligns its causal mask top-left; this passes a bottom-right mask when seq_q != seq_kv and sets the
    rows that see no key to 0, as :func:`llm_speed.flash_attention` does. GQA uses SDPA's ``enable_gqa``.
    """
    validate_attention_inputs(q, k, v)
    runtime.report_work("sdpa_attention", q=q, k=k, is_causal=is_causal)  # for the profiler (llm_speed.ops)
    seq_q, seq_kv = q.shape[2], k.shape[2]
    extra = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if not is_causal or seq_q == seq_kv:
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=is_causal, scale=scale, **extra
        )
    visible = causal_visible(seq_q, seq_kv, q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, **extra)
    blind_rows = ~visible.any(dim=-1)  # queries before the first key when seq_q > seq_kv
    return out.masked_fill(blind_rows[:, None], 0.0)


def safe_flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    fallback_to_torch: bool = True,
    *,
    is_causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """:func:`llm_speed.flash_attention`, falling back to PyTorch SDPA when it runs out of memory.

    The old project's production pattern. Only out-of-memory errors (``torch.cuda.OutOfMemoryError`` or a
    RuntimeError saying "out of memory") fall back, and a RuntimeWarning says so; every other error, and
    out-of-memory with ``fallback_to_torch=False``, propagates. The fallback keeps llm_speed's semantics
    (see :func:`sdpa_attention`).
    """
    fallback_to_torch = check_flag("fallback_to_torch", fallback_to_torch)
    is_causal = check_flag("is_causal", is_causal)
    try:
        return flash_attention(q, k, v, is_causal=is_causal, scale=scale)
    except RuntimeError as error:
        if not fallback_to_torch or not _is_out_of_memory(error):
            raise
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        warnings.warn(
            f"safe_flash_attention: flash_attention ran out of memory ({first_line}); "
            "falling back to torch scaled_dot_product_attention",
            RuntimeWarning,
            stacklevel=2,
        )
        return sdpa_attention(q, k, v, is_causal=is_causal, scale=scale)


def _pool_size(name: str, value: object, limit: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1 or (limit is not None and value > limit):
        accepted = f"1 to {limit}" if limit is not None else ">= 1"
        raise ValueError(f"{name} must be {accepted}, got {value}")
    return value


class AttentionMemoryPool:
    """Buffers for Q, K, V and the output, allocated once and handed out as views (the old project's pattern).

    The four ``[max_batch, heads, max_seq_len, head_dim]`` buffers are made at construction (uninitialised,
    like ``torch.empty``); :meth:`get_tensors` returns ``[batch_size, heads, seq_len, head_dim]`` views of
    them, so repeated calls allocate nothing. The views share the pool's memory: writing into them changes
    the pool, and the next ``get_tensors`` call returns the same memory again. For ``seq_len <
    max_seq_len`` the views are strided (not contiguous); llm_speed's kernels read them in place.

    ``device`` defaults to the current CUDA device when there is one (the old code hard-coded 'cuda'), else
    the CPU; ``dtype`` defaults to float16, as before.
    """

    def __init__(
        self,
        max_batch: int,
        heads: int,
        max_seq_len: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float16,
        device: torch.device | str | None = None,
    ) -> None:
        self.max_batch = _pool_size("max_batch", max_batch)
        self.heads = _pool_size("heads", heads)
        self.max_seq_len = _pool_size("max_seq_len", max_seq_len)
        self.head_dim = _pool_size("head_dim", head_dim)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        shape = (self.max_batch, self.heads, self.max_seq_len, self.head_dim)
        self.q = torch.empty(shape, device=device, dtype=dtype)
        self.k = torch.empty_like(self.q)
        self.v = torch.empty_like(self.q)
        self.output = torch.empty_like(self.q)

    @property
    def nbytes(self) -> int:
        """Bytes held by the four buffers."""
        return 4 * self.q.numel() * self.q.element_size()

    def get_tensors(
        self, batch_size: int, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views ``(q, k, v, output)`` of shape ``[batch_size, heads, seq_len, head_dim]`` into the pool.

        Raises ValueError when ``batch_size`` exceeds ``max_batch`` or ``seq_len`` exceeds ``max_seq_len``
        (the old slicing silently returned smaller tensors then).
        """
        batch_size = _pool_size("batch_size", batch_size, self.max_batch)
        seq_len = _pool_size("seq_len", seq_len, self.max_seq_len)
        return (
            self.q[:batch_size, :, :seq_len, :],
            self.k[:batch_size, :, :seq_len, :],
            self.v[:batch_size, :, :seq_len, :],
            self.output[:batch_size, :, :seq_len, :],
        )
