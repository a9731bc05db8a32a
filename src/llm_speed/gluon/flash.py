"""Attention with autograd through the Gluon kernels (issue 73): the warp-specialized forward
(:func:`llm_speed.gluon.attention.forward`) paired with the warp-specialized backward
(:func:`llm_speed.gluon.attention_bwd.backward`), which reads the forward's output and natural-log LSE.
Reached explicitly; no other llm-speed function selects it until a GPU proves it (docs/gluon.md)."""

from __future__ import annotations

import torch

from .attention import BACKWARD_HEAD_DIMS, check_arguments, forward
from .attention_bwd import backward
from .launch import check_device


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal: bool, scale: float):
        out, lse = forward(q, k, v, is_causal=is_causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(q, k, v, out, lse, dout, is_causal=ctx.is_causal, scale=ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:  # fmt: skip
    """softmax(q k^T * scale) v with autograd, forward and backward by the Gluon kernels: q [B, H, Sq, D], k
    and v [B, H_kv, Skv, D] contiguous, H a multiple of H_kv, fp16 or bf16, D 64 or 128, causal masks
    aligned bottom-right; dK and dV summed over each query group; dQ added by atomics (not bitwise
    repeatable). CUDA tensors on a compute capability 9.0 GPU only. Bad arguments raise a TypeError or
    ValueError naming the argument before any work. Unproven on a GPU."""
    scale = check_arguments(q, k, v, is_causal, scale, BACKWARD_HEAD_DIMS)  # the pair's: the backward's
    check_device("q", q, "llm_speed.gluon.flash.flash_attention")
    return _FlashAttention.apply(q, k, v, is_causal, scale)
