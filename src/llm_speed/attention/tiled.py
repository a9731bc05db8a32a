"""Tiled attention: K/V tiles stream through on-chip memory in two passes. The middle step of the lesson."""

from __future__ import annotations

import torch

from .. import _runtime
from . import blockwise, launch
from .validation import prepare_attention_inputs


def _tiled_forward(q, k, v, is_causal: bool, scale: float):
    batch, heads_q, seq_q, head_dim = q.shape
    if batch == 0 or seq_q == 0 or k.shape[2] == 0:
        out = torch.zeros((batch, heads_q, seq_q, head_dim), dtype=q.dtype, device=q.device)
        return out, torch.full((batch, heads_q, seq_q), float("-inf"), dtype=torch.float32, device=q.device)
    if _runtime.triton_runs_on(q.device):
        return launch.forward(q, k, v, is_causal, scale, two_pass=True)
    return blockwise.flash_forward_blockwise(q, k, v, is_causal, scale, two_pass=True)


class _TiledAttention(torch.autograd.Function):
    """Tiled forward; the backward is FlashAttention's (it needs only Q, K, V, O and the LSE)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale):
        out, lse = _tiled_forward(q, k, v, is_causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.llm_speed.flash_attention_backward(
            dout, q, k, v, out, lse, dlse, ctx.is_causal, ctx.scale
        )
        return dq, dk, dv, None, None


def tiled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Attention that tiles K/V through on-chip memory in two passes, without online softmax.

    Same signature and semantics as :func:`llm_speed.flash_attention` (shapes, GQA, bottom-right causal mask,
    rows with no visible key -> 0 and LSE -inf, dtypes, strides, zero sizes, validation).

    Each Triton program holds one block of query rows. Pass 1 streams every K tile to find the row max of the
    scores; pass 2 streams K again together with V, summing exp(s - max) and exp(s - max) @ V; the output is
    the ratio. Nothing of size seq_q x seq_kv is written: memory O(batch * heads * seq * head_dim).
    HBM traffic per (batch, head): Q and O once, V once and K twice per query block, i.e.
    O(seq_q * head_dim + (seq_q / BLOCK_M) * seq_kv * head_dim * 3) elements, against O(seq_q * seq_kv) for
    naive attention; FlashAttention's online softmax removes the second read of K.

    Autograd: the backward is FlashAttention's backward kernels (they recompute from Q, K, V, O, LSE).
    CPU tensors run the Triton kernel under the interpreter, otherwise the same two-pass algorithm blockwise
    in PyTorch. Not registered as a torch.library op: torch.compile treats it as an autograd.Function.
    """
    q, k, v, scale = prepare_attention_inputs(q, k, v, scale)
    out, lse = _TiledAttention.apply(q, k, v, bool(is_causal), scale)
    return (out, lse) if return_lse else out
