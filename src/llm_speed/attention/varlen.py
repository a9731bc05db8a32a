"""FlashAttention over packed variable-length sequences: flash-attn's ``flash_attn_varlen_func`` layout.

The operators ``llm_speed::flash_attention_varlen_forward`` and ``llm_speed::flash_attention_varlen_backward``
run the same Triton kernels as the dense ones with ``IS_VARLEN`` on (``kernels.py``), registered like them
with ``torch.library.custom_op``, fake implementations and autograd, so ``torch.compile(fullgraph=True)``
captures them.
"""

from __future__ import annotations

import torch

from ..core import runtime
from . import launch
from .flash import _empty_like_shape, check_options, masking, reference_backward
from .reference import reference_attention
from .validation import (
    check_scale,
    check_seqlens_values,
    last_dim_contiguous,
    suggest_keywords,
    validate_varlen_inputs,
)


def _sequences(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    """Rows ``[seq, heads, head_dim]`` of one sequence as a dense batch ``[1, heads, seq, head_dim]``."""
    return t.transpose(0, 1).unsqueeze(0)


def _reference_varlen(q, k, v, cu_q, cu_k, mask: launch.Masking, scale: float):
    """(out, lse) sequence by sequence through the float32 PyTorch reference (CPU without the interpreter)."""
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(_sequences(cu_q), _sequences(cu_k), strict=True):
        out, lse = reference_attention(
            *(_as_batch(t.float()) for t in (q[q0:q1], k[k0:k1], v[k0:k1])),
            is_causal=mask.is_causal, scale=scale, return_lse=True, window=mask.window, softcap=mask.softcap,
        )  # fmt: skip
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs, 0) if outs else q.float()
    lse = torch.cat(lses, 1) if lses else q.new_empty((q.shape[1], 0), dtype=torch.float32)
    return out, lse


def _forward_impl(q, k, v, cu_q, cu_k, mask: launch.Masking, scale: float):
    if q.shape[0] == 0 or k.shape[0] == 0:
        # No query, or no key at all: every row sees nothing (output 0, LSE -inf); nothing to launch.
        out = torch.zeros_like(q)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=torch.float32, device=q.device)
        return out, lse
    # Every path reports its work to the op table (llm_speed.ops), for the profiler.
    runtime.report_work(
        "flash_attention_varlen", q=q, k=k, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, is_causal=mask.is_causal,
        window=mask.window,
    )  # fmt: skip
    if runtime.triton_runs_on(q.device):
        with runtime.on_device_of(q):
            return launch.forward(q, k, v, mask, scale, packed=launch.Packed(cu_q, cu_k))
    out, lse = _reference_varlen(q, k, v, cu_q, cu_k, mask, scale)
    return out.to(q.dtype).contiguous(), lse.contiguous()


@torch.library.custom_op("llm_speed::flash_attention_varlen_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The values of cu_seqlens are checked here, on real tensors (also under torch.compile), before any work.
    check_seqlens_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    mask = masking(is_causal, window_left, window_right, softcap)
    return _forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, mask, scale)


@_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                  window_left=None, window_right=None, softcap=None):  # fmt: skip
    return _empty_like_shape(q, q.shape), _empty_like_shape(q, (q.shape[1], q.shape[0]), torch.float32)


@torch.library.custom_op("llm_speed::flash_attention_varlen_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = masking(is_causal, window_left, window_right, softcap)
    dout = last_dim_contiguous(dout)
    dlse = dlse.contiguous() if dlse is not None else None
    if q.shape[0] == 0 or k.shape[0] == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    runtime.report_work(
        "flash_attention_varlen_backward", q=q, k=k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        is_causal=mask.is_causal, window=mask.window,
    )  # fmt: skip
    if runtime.triton_runs_on(q.device):
        with runtime.on_device_of(q):
            packed = launch.Packed(cu_seqlens_q, cu_seqlens_k)
            return launch.backward(dout, q, k, v, out, lse.contiguous(), dlse, mask, scale, packed=packed)
    # Without the interpreter: the reference's backward sequence by sequence.
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, q1), (k0, k1) in zip(_sequences(cu_seqlens_q), _sequences(cu_seqlens_k), strict=True):
        if q1 > q0 and k1 > k0:
            grads = reference_backward(
                *(_as_batch(t[q0:q1]) for t in (dout, q)), *(_as_batch(t[k0:k1]) for t in (k, v)),
                _as_batch(out[q0:q1]), lse[None, :, q0:q1], None if dlse is None else dlse[None, :, q0:q1],
                mask, scale,
            )  # fmt: skip
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0].transpose(0, 1) for g in grads)
    return dq, dk, dv


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, is_causal, scale,
                   window_left=None, window_right=None, softcap=None):  # fmt: skip
    return (_empty_like_shape(q, q.shape), _empty_like_shape(k, k.shape), _empty_like_shape(v, v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, _max_q, _max_k, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = tuple(args)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.args)
    return (dq, dk, dv) + (None,) * (4 + len(ctx.args))


_forward_op.register_autograd(_backward, setup_context=_setup_context)


@suggest_keywords
def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
):
    """FlashAttention over packed sequences of different lengths (flash-attn's ``flash_attn_varlen_func``).

    Args:
        q: ``[total_q, heads_q, head_dim]``, the queries of every sequence one after another.
        k, v: ``[total_k, heads_kv, head_dim]``; heads_q a multiple of heads_kv (MHA, GQA, MQA).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` on q's device: sequence b is rows
            ``cu_seqlens[b] .. cu_seqlens[b + 1] - 1``; 0 first, non-decreasing, last = total. Empty
            sequences are allowed.
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence (flash-attn's arguments; checked, and
            otherwise unused: the grid is sized from the totals).
        is_causal, scale, window, softcap: as :func:`llm_speed.flash_attention`, each sequence on its own:
            causal masks and windows are aligned bottom-right per sequence (``p = i + seq_k_b - seq_q_b``).
        return_lse: also return the LSE ``[heads_q, total_q]`` fp32 (flash-attn's layout).

    Sequence b attends only to its own keys. A row that sees no key (its sequence has no key, or the mask
    hides them all) outputs 0 with LSE -inf and gets zero gradients. Output ``[total_q, heads_q, head_dim]``
    contiguous, in q's dtype. Forward and backward (autograd, gradients through the LSE too) run the dense
    kernels' bodies with ``IS_VARLEN`` on.

    Grid: ``cdiv(total, block) + batch`` programs per head, an upper bound on the real work that needs no
    read of the lengths on the host; the per-sequence block counts are summed on the device and each program
    finds its sequence there (``kernels._program``), so the grid grows with the tokens, not with
    batch x max_seqlen. The validation reads ``cu_seqlens`` once (one small device-to-host copy) to reject
    bad lengths before any work.

    CPU tensors run the kernels through the interpreter when ``TRITON_INTERPRET=1``, otherwise the PyTorch
    reference per sequence in float32.
    """
    is_causal, return_lse, (left, right), softcap = check_options(is_causal, return_lse, window, softcap)
    validate_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    scale = check_scale(scale, q)
    out, lse = _forward_op(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k), is_causal, scale,
        left, right, softcap,
    )  # fmt: skip
    return (out, lse) if return_lse else out
