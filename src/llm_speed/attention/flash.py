"""FlashAttention: the public function, its torch.library registration and its autograd.

The operators ``llm_speed::flash_attention_forward`` and ``llm_speed::flash_attention_backward`` are
registered with ``torch.library.custom_op``, each with a fake (meta) implementation, and the forward with
``register_autograd``: ``torch.compile(fullgraph=True)`` captures them and ``torch.library.opcheck`` passes.
``tiled.py`` registers its forward the same way, reusing the fake, the autograd and the backward here.
"""

from __future__ import annotations

import torch

from .. import _runtime
from . import blockwise, launch
from .validation import prepare_attention_inputs


def _empty_like_shape(x: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype or x.dtype, device=x.device)


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def forward_impl(q, k, v, is_causal: bool, scale: float, two_pass: bool = False):
    """(out, lse) of the flash forward, or with ``two_pass`` the tiled one, on whatever runs on q's device."""
    batch, heads_q, seq_q, head_dim = q.shape
    seq_kv = k.shape[2]
    if batch == 0 or seq_q == 0 or seq_kv == 0:
        # Nothing to launch. With no key at all every row sees nothing: output 0, LSE -inf.
        out = torch.zeros((batch, heads_q, seq_q, head_dim), dtype=q.dtype, device=q.device)
        lse = torch.full((batch, heads_q, seq_q), float("-inf"), dtype=torch.float32, device=q.device)
        return out, lse
    # Every path reports its work to the op table (llm_speed.ops), for the profiler.
    _runtime.report_work("tiled_attention" if two_pass else "flash_attention", q=q, k=k, is_causal=is_causal)
    if _runtime.triton_runs_on(q.device):
        with _runtime.on_device_of(q):
            return launch.forward(q, k, v, is_causal, scale, two_pass=two_pass)
    out, lse = blockwise.flash_forward_blockwise(q, k, v, is_causal, scale, two_pass=two_pass)
    return out.contiguous(), lse.contiguous()


@torch.library.custom_op("llm_speed::flash_attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_impl(q, k, v, is_causal, scale)


@_forward_op.register_fake
def forward_fake(q, k, v, is_causal, scale):
    """Shapes and dtypes of (out, lse) for fake tensors; shared with the tiled forward operator."""
    batch, heads_q, seq_q, _ = q.shape
    return _empty_like_shape(q, q.shape), _empty_like_shape(q, (batch, heads_q, seq_q), torch.float32)


@torch.library.custom_op("llm_speed::flash_attention_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dout = _last_dim_contiguous(dout)
    dlse = dlse.contiguous() if dlse is not None else None
    if q.numel() == 0 or k.numel() == 0:
        # Empty batch or sequence: no score exists, so every gradient is 0.
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    _runtime.report_work("flash_attention_backward", q=q, k=k, is_causal=is_causal)
    if _runtime.triton_runs_on(q.device):
        with _runtime.on_device_of(q):
            return launch.backward(dout, q, k, v, out, lse.contiguous(), dlse, is_causal, scale)
    dq, dk, dv = blockwise.flash_backward_blockwise(dout, q, k, v, out, lse, dlse, is_causal, scale)
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, dlse, is_causal, scale):
    return (_empty_like_shape(q, q.shape), _empty_like_shape(k, k.shape), _empty_like_shape(v, v.shape))


def setup_context(ctx, inputs, output):
    """Save what the backward recomputes from; shared with the tiled forward operator."""
    q, k, v, is_causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.is_causal = is_causal
    ctx.scale = scale


def backward(ctx, dout, dlse):
    """Gradients for (q, k, v) through the flash backward operator; shared with the tiled forward operator."""
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, dlse, ctx.is_causal, ctx.scale)
    return dq, dk, dv, None, None


_forward_op.register_autograd(backward, setup_context=setup_context)


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
):
    """FlashAttention: ``softmax(q k^T * scale) v`` without ever storing the seq_q x seq_kv matrix.

    Args:
        q: ``[batch, heads_q, seq_q, head_dim]``.
        k, v: ``[batch, heads_kv, seq_kv, head_dim]``; heads_q a multiple of heads_kv (MHA, GQA, MQA). K/V are
            shared by each group of heads_q / heads_kv query heads without being repeated in memory.
        is_causal: mask aligned bottom-right: query i sees keys j <= i + seq_kv - seq_q (as FlashAttention
            >= 2.1 and KV-cache prefill do). PyTorch SDPA aligns top-left (j <= i); they differ when
            seq_q != seq_kv. A row that sees no key outputs 0 with LSE -inf and gets zero gradients.
            Fully masked key blocks are skipped, not computed.
        scale: score scale, default ``1 / sqrt(head_dim)``; any finite real number.
        return_lse: also return the log-sum-exp of each row's scaled scores, ``[batch, heads_q, seq_q]`` fp32.

    dtypes float16, bfloat16, float32 (all three alike); statistics and accumulation in float32; the output
    has q's dtype and is contiguous ``[batch, heads_q, seq_q, head_dim]``. head_dim: a multiple of 8 from 8
    to 256. Any strides with a contiguous last dim are read in place (a ``[B, S, H, D]`` tensor viewed with
    ``.transpose(1, 2)`` costs no copy); a non-contiguous last dim is copied first. Inputs are not modified.

    Zero sizes: batch 0 or seq_q 0 give empty results; seq_kv 0 gives output 0 and LSE -inf (no key is
    visible); gradients are zeros.

    Backward (autograd): recomputes the probabilities block by block from Q, K, V, O and the LSE; dK/dV and dQ
    come from separate kernels with one writer per element, so gradients are bitwise repeatable; GQA
    gradients are summed over each query group. Gradients through the returned LSE are supported.

    Devices: CUDA tensors run the Triton kernels. CPU tensors run the same Triton kernels through the
    interpreter when ``TRITON_INTERPRET=1`` was set before import (``llm_speed._runtime.INTERPRETED``);
    otherwise they run the same blockwise algorithm written in PyTorch (``blockwise.py``).

    Memory: O(batch * heads * seq * head_dim) in forward and backward, never O(seq_q * seq_kv).
    """
    q, k, v, scale = prepare_attention_inputs(q, k, v, scale)
    out, lse = _forward_op(q, k, v, bool(is_causal), scale)
    return (out, lse) if return_lse else out
