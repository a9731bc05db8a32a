"""Plain PyTorch attention: the specification every kernel is checked against.

It computes in the dtype of its inputs, so the same function gives the float64 reference (pass float64
tensors) and the "same-precision PyTorch version" whose error sets the tolerance of the kernel tests.
"""

from __future__ import annotations

import math

import torch


def causal_visible(seq_q: int, seq_kv: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``[seq_q, seq_kv]``: True where query i may see key j, i.e. ``j <= i + seq_kv - seq_q``.

    The mask is aligned bottom-right (the last query sees every key), as FlashAttention >= 2.1 and KV-cache
    prefill need. PyTorch SDPA's ``is_causal`` is aligned top-left (``j <= i``); the two agree only when
    seq_q == seq_kv.
    """
    rows = torch.arange(seq_q, device=device)[:, None]
    cols = torch.arange(seq_kv, device=device)[None, :]
    return cols <= rows + (seq_kv - seq_q)


def visible(
    seq_q: int,
    seq_kv: int,
    *,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean ``[seq_q, seq_kv]``: True where query i may see key j under a causal mask and/or a window.

    With ``p = i + seq_kv - seq_q`` (query i's bottom-right aligned position), ``window=(left, right)`` keeps
    keys ``p - left <= j <= p + right``; None on a side leaves it unbounded. ``is_causal`` forces right = 0.
    This is flash-attn's ``window_size`` convention (Dao-AILab/flash-attention, ``flash_attn_func``): a
    Mistral / Gemma-2 sliding window of W tokens is ``window=(W - 1, 0)`` with ``is_causal=True``.
    """
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0
    rows = torch.arange(seq_q, device=device)[:, None] + (seq_kv - seq_q)
    cols = torch.arange(seq_kv, device=device)[None, :]
    mask = torch.ones((seq_q, seq_kv), dtype=torch.bool, device=device)
    if left is not None:
        mask &= cols >= rows - left
    if right is not None:
        mask &= cols <= rows + right
    return mask


def apply_softcap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma 2, arXiv:2408.00118; Grok-1), or ``scores`` when None."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
):
    """softmax(mask(softcap(q k^T * scale))) v in the inputs' own dtype, K/V repeated over each GQA group.

    Same signature and semantics as :func:`llm_speed.flash_attention`: a row that sees no key gives output 0
    and LSE -inf (the LSE is of the capped, scaled scores). Masks as :func:`visible`. Differentiable (plain
    torch ops). Memory O(seq_q * seq_kv) per head: a test tool only.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = apply_softcap((q @ k.transpose(-1, -2)) * scale, softcap)
    if is_causal or window is not None:
        mask = visible(q.shape[2], k.shape[2], is_causal=is_causal, window=window, device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    out, lse = softmax_times_values(scores, v)
    return (out, lse) if return_lse else out


def softmax_times_values(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(scores) @ v, logsumexp(scores))``; a row of all -inf gives 0 and -inf, with finite grads.

    The row max is detached: softmax does not depend on it, and differentiating through it would turn the
    -inf rows into NaN gradients.
    """
    if scores.shape[-1] == 0:  # no key at all: amax would raise; every row sees nothing
        row_max = scores.new_zeros((*scores.shape[:-1], 1))
    else:
        row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    no_key = row_sum == 0
    safe_sum = torch.where(no_key, torch.ones_like(row_sum), row_sum)
    out = (weights / safe_sum) @ v
    lse = torch.where(no_key, torch.full_like(row_sum, float("-inf")), row_max + torch.log(safe_sum))
    return out, lse.squeeze(-1)
