"""Naive attention: the full score matrix in memory, as a textbook writes it. The first step of the lesson."""

from __future__ import annotations

import torch

from ..core import runtime
from ..core.args import check_flag
from .checks import check_softcap, check_window, prepare_attention_inputs, suggest_keywords, unknown_keywords
from .reference import apply_softcap, softmax_times_values, visible


@suggest_keywords
def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    **unknown,
):
    """Attention with the ``[batch, heads_q, seq_q, seq_kv]`` score matrix materialised, in plain PyTorch ops.

    Same signature and semantics as :func:`llm_speed.flash_attention` (bottom-right causal mask, ``window``
    and ``softcap``, rows that see no key give 0 and LSE -inf, GQA/MQA by folding each query group into the
    rows, so K/V are not repeated).
    Scores, softmax and accumulation are float32; the output has q's dtype; the LSE is float32.
    Differentiable through autograd (plain torch ops).

    Cost per (batch, head): memory O(seq_q * seq_kv) for the scores and again for the probabilities;
    HBM traffic O(seq * head_dim) for Q, K, V, O plus O(seq_q * seq_kv) for writing and re-reading the score
    and probability matrices several times (matmul, max, exp, sum,
    matmul). That quadratic traffic is what tiling removes.
    Runs on any device; on CPU it is ordinary PyTorch.
    """
    if unknown:
        unknown_keywords(naive_attention, unknown)
    is_causal, return_lse = check_flag("is_causal", is_causal), check_flag("return_lse", return_lse)
    window, softcap = check_window(window), check_softcap(softcap)
    q, k, v, scale = prepare_attention_inputs(q, k, v, scale)
    # for the profiler (llm_speed.ops)
    runtime.report_work("naive_attention", q=q, k=k, is_causal=is_causal, window=window)
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    # Fold each group's query heads into the rows: [B, Hkv, G * Sq, D] against [B, Hkv, Skv, D], so K and V
    # are used as they are (a broadcast batch dim would make matmul copy them G times).
    q32 = q.float().reshape(batch, heads_kv, group * seq_q, head_dim)
    k32, v32 = k.float(), v.float()
    scores = apply_softcap((q32 @ k32.transpose(-1, -2)) * scale, softcap)
    if is_causal or window is not None:
        mask = visible(seq_q, seq_kv, is_causal=is_causal, window=window, device=q.device).repeat(group, 1)
        scores = scores.masked_fill(~mask, float("-inf"))
    out, lse = softmax_times_values(scores, v32)
    out = out.reshape(batch, heads_q, seq_q, head_dim).to(q.dtype)
    lse = lse.reshape(batch, heads_q, seq_q)
    return (out, lse) if return_lse else out
