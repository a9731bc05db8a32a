"""FlashAttention: the public function, its torch.library registration and its autograd.

The operators ``llm_speed::flash_attention_forward`` and ``llm_speed::flash_attention_backward`` are
registered with ``torch.library.custom_op``, each with a fake (meta) implementation, and the forward with
``register_autograd``: ``torch.compile(fullgraph=True)`` captures them and ``torch.library.opcheck`` passes.
``tiled.py`` registers its forward the same way, reusing the fake, the autograd and the backward here.
"""

from __future__ import annotations

import torch

from ..core import runtime
from ..core.args import check_flag
from . import launch
from .reference import apply_softcap, reference_attention, visible
from .validation import (
    check_softcap,
    check_window,
    last_dim_contiguous,
    prepare_attention_inputs,
    suggest_keywords,
)


def _empty_like_shape(x: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype or x.dtype, device=x.device)


def masking(is_causal: bool, window_left, window_right, softcap) -> launch.Masking:
    """The operators' flat (causal, left, right, softcap) arguments as one value; no window when both sides
    are None."""
    window = None if window_left is None and window_right is None else (window_left, window_right)
    return launch.Masking(is_causal=is_causal, window=window, softcap=softcap)


def reference_forward(q, k, v, mask: launch.Masking, scale: float):
    """(out, lse) from the PyTorch reference in float32: the path for CPU tensors without the interpreter."""
    out, lse = reference_attention(
        q.float(), k.float(), v.float(), is_causal=mask.is_causal, scale=scale, return_lse=True,
        window=mask.window, softcap=mask.softcap,
    )  # fmt: skip
    return out.to(q.dtype).contiguous(), lse.contiguous()


def reference_backward(dout, q, k, v, out, lse, dlse, mask: launch.Masking, scale: float):
    """(dq, dk, dv) of the float32 reference, written out (CPU tensors without the interpreter; autograd
    does not record inside an operator's implementation): P from the saved LSE, dV = P^T dO,
    dS = P (dO V^T - delta) (1 - tanh^2 under a cap), dQ = dS K scale, dK = dS^T Q scale, dK and dV
    summed over each query group."""
    heads_kv = k.shape[1]
    group = q.shape[1] // heads_kv
    q32, k32, v32 = (t.float() for t in (q, k, v))
    k_rep, v_rep = k32.repeat_interleave(group, dim=1), v32.repeat_interleave(group, dim=1)
    raw = (q32 @ k_rep.transpose(-1, -2)) * scale
    scores = apply_softcap(raw, mask.softcap)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - lse_safe[..., None])
    p = p.masked_fill(~visible(q.shape[-2], k.shape[-2], is_causal=mask.is_causal, window=mask.window,
                                device=q.device), 0.0)  # fmt: skip
    p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(p), p)
    do32 = dout.float()
    delta = (do32 * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    ds = p * (do32 @ v_rep.transpose(-1, -2) - delta[..., None])
    if mask.softcap is not None:
        ds = ds * (1 - torch.tanh(raw / mask.softcap) ** 2)
    dq = (ds @ k_rep) * scale
    dk = (ds.transpose(-1, -2) @ q32) * scale
    dv = p.transpose(-1, -2) @ do32

    def per_kv_head(x):
        return x.reshape(x.shape[0], heads_kv, group, *x.shape[2:]).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def forward_impl(q, k, v, mask: launch.Masking, scale: float, two_pass: bool = False):
    """(out, lse) of the flash forward, or with ``two_pass`` the tiled one, on whatever runs on q's device."""
    batch, heads_q, seq_q, head_dim = q.shape
    seq_kv = k.shape[2]
    if batch == 0 or seq_q == 0 or seq_kv == 0:
        # Nothing to launch. With no key at all every row sees nothing: output 0, LSE -inf.
        out = torch.zeros((batch, heads_q, seq_q, head_dim), dtype=q.dtype, device=q.device)
        lse = torch.full((batch, heads_q, seq_q), float("-inf"), dtype=torch.float32, device=q.device)
        return out, lse
    # Every path reports its work to the op table (llm_speed.ops), for the profiler.
    runtime.report_work(
        "tiled_attention" if two_pass else "flash_attention",
        q=q,
        k=k,
        is_causal=mask.is_causal,
        window=mask.window,
    )
    if runtime.triton_runs_on(q.device):
        with runtime.on_device_of(q):
            return launch.forward(q, k, v, mask, scale, two_pass=two_pass)
    return reference_forward(q, k, v, mask, scale)


@torch.library.custom_op("llm_speed::flash_attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_impl(q, k, v, masking(is_causal, window_left, window_right, softcap), scale)


@_forward_op.register_fake
def forward_fake(q, k, v, is_causal, scale, window_left=None, window_right=None, softcap=None):
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
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mask = masking(is_causal, window_left, window_right, softcap)
    dout = last_dim_contiguous(dout)
    dlse = dlse.contiguous() if dlse is not None else None
    if q.numel() == 0 or k.numel() == 0:
        # Empty batch or sequence: no score exists, so every gradient is 0.
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    runtime.report_work("flash_attention_backward", q=q, k=k, is_causal=mask.is_causal, window=mask.window)
    if runtime.triton_runs_on(q.device):
        with runtime.on_device_of(q):
            return launch.backward(dout, q, k, v, out, lse.contiguous(), dlse, mask, scale)
    return reference_backward(dout, q, k, v, out, lse, dlse, mask, scale)


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, dlse, is_causal, scale, window_left=None, window_right=None,
                   softcap=None):  # fmt: skip
    return (_empty_like_shape(q, q.shape), _empty_like_shape(k, k.shape), _empty_like_shape(v, v.shape))


def setup_context(ctx, inputs, output):
    """Save what the backward recomputes from; shared with the tiled forward operator."""
    q, k, v, is_causal, scale, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (is_causal, scale, *rest)


def backward(ctx, dout, dlse):
    """Gradients for (q, k, v) through the flash backward operator; shared with the tiled forward operator."""
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _backward_op(dout, q, k, v, out, lse, dlse, *ctx.args)
    return (dq, dk, dv) + (None,) * len(ctx.args)


_forward_op.register_autograd(backward, setup_context=setup_context)


def check_options(is_causal, return_lse, window, softcap):
    """The options every dense and packed entry point shares, checked before any work."""
    return (
        check_flag("is_causal", is_causal),
        check_flag("return_lse", return_lse),
        check_window(window) or (None, None),
        check_softcap(softcap),
    )


@suggest_keywords
def flash_attention(
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
        window: ``(left, right)`` local attention, flash-attn's ``window_size`` convention but with None
            (not -1) for an unbounded side: with ``p = i + seq_kv - seq_q``, query i sees keys
            ``p - left <= j <= p + right``; ``is_causal=True`` makes right 0. A Mistral / Gemma-2 sliding
            window of W tokens is ``window=(W - 1, 0), is_causal=True``. Key blocks outside every row's
            window are skipped: the work grows with the window, not with seq_kv.
        softcap: ``c > 0``: scores ``s`` become ``c * tanh(s / c)`` before masking and softmax (Gemma 2,
            arXiv:2408.00118; Grok-1); the backward includes the derivative ``1 - tanh^2``.

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
    interpreter when ``TRITON_INTERPRET=1`` was set before import (``llm_speed.core.runtime.INTERPRETED``);
    otherwise they run the PyTorch reference (``reference.py``) in float32, which stores the scores.

    Memory on the Triton path: O(batch * heads * seq * head_dim) in forward and backward, never
    O(seq_q * seq_kv).

    Flags must be real bools (NumPy bools accepted); flash-attn's and SDPA's argument names (``causal=``,
    ``softmax_scale=``, ``attn_mask=``, ...) get a TypeError naming ours.
    """
    is_causal, return_lse, (left, right), softcap = check_options(is_causal, return_lse, window, softcap)
    q, k, v, scale = prepare_attention_inputs(q, k, v, scale)
    out, lse = _forward_op(q, k, v, is_causal, scale, left, right, softcap)
    return (out, lse) if return_lse else out
