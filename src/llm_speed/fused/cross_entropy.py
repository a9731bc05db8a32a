"""Fused linear + cross-entropy: the loss of ``cross_entropy(hidden @ weight.T + bias, target)`` without the
full ``[N, V]`` logits.

Rows are processed in chunks of ``C``: a chunk's logits ``[C, V]`` come from one GEMM, a Triton kernel turns
them into per-row losses and log-sum-exps (an online softmax over vocabulary blocks, Milakov & Gimelshein,
"Online normalizer calculation for softmax", 2018, arXiv:1805.02867), and the chunk is dropped. The backward
recomputes each chunk's logits, a second kernel overwrites them in place with ``d loss / d logits``, and two
GEMMs add the chunk's share to the hidden and weight gradients. The chunking follows Liger-Kernel
(linkedin/Liger-Kernel ``ops/fused_linear_cross_entropy.py``, Hsu et al. 2024, arXiv:2410.10989), which
computes the gradients during the forward instead; recomputing costs one more ``N x H x V`` GEMM but supports
any output gradient (``reduction="none"``) and keeps the forward free of gradient buffers.

Memory (itemsize ``b``, bias ignored): eager PyTorch holds at least two ``[N, V]`` tensors at once (logits and
log-probabilities in the forward, log-probabilities and their gradient in the backward): ``2 N V b``. Here the
extra memory is one ``[C, V]`` chunk plus ``O(N)`` fp32 statistics: ``C V b + 8 N``. The default ``C`` makes
the chunk as large as ``hidden`` itself: ``C = next_pow2(ceil(N / ceil(V / H)))``. For Llama-3-8B's head
(H = 4096, V = 128256) with N = 8192 tokens in bfloat16: unfused ``2 * 8192 * 128256 * 2 B = 4.20 GB``; fused
``C = 256``, ``256 * 128256 * 2 B + 64 KiB = 65.7 MB``, 64x less (:func:`memory_estimate`; a formula, not a
measurement). Hugging Face's loss also upcasts the logits to float32, which adds ``4 N V`` bytes more.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch
import triton
import triton.language as tl

from ..core import runtime
from ..core.args import check_real
from ..core.kernel_math import cast, rne_by_hand
from ..core.tensors import check_same_device, check_tensor
from .reference import reduce_loss, softcapped

KERNEL_FORWARD = "cross_entropy_fwd"
KERNEL_BACKWARD = "cross_entropy_bwd"
REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1) saturates to +-1 without inf / inf; libdevice tanh does not run interpreted
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _ce_fwd_kernel(
    logits_ptr, target_ptr, loss_ptr, lse_ptr, stride_l, vocab, ignore_index, smoothing, softcap,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    p_l = logits_ptr + row * stride_l
    m = tl.full([], float("-inf"), tl.float32)  # running max
    s = tl.full([], 0.0, tl.float32)  # running sum of exp(z - m)
    sum_z = tl.full([], 0.0, tl.float32)  # sum of all logits (label smoothing)
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        b_z = tl.load(p_l + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        if HAS_SOFTCAP:
            b_z = softcap * _tanh(b_z / softcap)
        b_zm = tl.where(m_v, b_z, float("-inf"))
        m_new = tl.maximum(m, tl.max(b_zm, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(b_zm - m_new), axis=0)
        sum_z += tl.sum(tl.where(m_v, b_z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(target_ptr + row)
    keep = t != ignore_index
    z_t = tl.load(p_l + tl.where(keep, t, 0)).to(tl.float32)
    if HAS_SOFTCAP:
        z_t = softcap * _tanh(z_t / softcap)
    # (1 - eps) * (lse - z_t) + eps * (lse - mean(z)): torch.nn.functional.cross_entropy's label smoothing
    loss = lse - (1.0 - smoothing) * z_t - smoothing * (sum_z / vocab)
    tl.store(loss_ptr + row, tl.where(keep, loss, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_bwd_kernel(
    logits_ptr, target_ptr, lse_ptr, grad_ptr, stride_l, vocab, ignore_index, smoothing, softcap,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """Overwrite a chunk's logits with d loss / d logits, row by row (each element read, then written)."""
    row = tl.program_id(0).to(tl.int64)
    p_l = logits_ptr + row * stride_l
    t = tl.load(target_ptr + row)
    lse = tl.load(lse_ptr + row)
    g = tl.where(t != ignore_index, tl.load(grad_ptr + row), 0.0)  # ignored rows: gradient 0
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        b_l = tl.load(p_l + o_v, mask=m_v, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            b_th = _tanh(b_l / softcap)
            b_z = softcap * b_th
        else:
            b_z = b_l
        b_dz = tl.exp(b_z - lse) - smoothing / vocab - tl.where(o_v == t, 1.0 - smoothing, 0.0)
        if HAS_SOFTCAP:
            b_dz = b_dz * (1.0 - b_th * b_th)
        b_dl = cast(b_dz * g, logits_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
        tl.store(p_l + o_v, b_dl, mask=m_v)


def default_chunk_rows(n: int, hidden: int, vocab: int) -> int:
    """Rows per chunk so that a chunk's logits ``[C, V]`` are about as large as ``hidden [N, H]`` (Liger)."""
    return max(1, min(n, triton.next_power_of_2(triton.cdiv(n, triton.cdiv(vocab, hidden)))))


def memory_estimate(
    n: int, hidden: int, vocab: int, itemsize: int = 2, chunk_rows: int | None = None
) -> dict:
    """Bytes the loss needs beyond its inputs and gradients: eager ``2 N V b`` against fused ``C V b + 8 N``.

    Returns ``{"unfused_bytes", "fused_bytes", "chunk_rows", "saving"}`` (``saving`` = unfused / fused). A
    formula (see the module docstring), not a measurement.
    """
    chunk = chunk_rows or default_chunk_rows(n, hidden, vocab)
    unfused = 2 * n * vocab * itemsize
    fused = chunk * vocab * itemsize + 8 * n
    return {"unfused_bytes": unfused, "fused_bytes": fused, "chunk_rows": chunk, "saving": unfused / fused}


def _chunk_logits(hidden, weight, bias, start, end):
    h = hidden[start:end]
    out = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    return out.contiguous()


def _check_targets(target, vocab, ignore_index):
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        first = int(target[bad][0])
        raise ValueError(
            f"target holds {first}; accepted: 0 <= target < {vocab} (vocab) or ignore_index {ignore_index}"
        )


def _block_v(vocab: int) -> int:
    return min(4096, triton.next_power_of_2(vocab))


@torch.library.custom_op("llm_speed::fused_linear_cross_entropy_forward", mutates_args=())
def _forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    n, vocab = hidden.shape[0], weight.shape[0]
    _check_targets(target, vocab, ignore_index)
    loss = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    lse = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    use_triton = runtime.triton_runs_on(hidden.device)
    if n:
        runtime.report_work("fused_linear_cross_entropy", hidden=hidden, weight=weight)
    for start in range(0, n, chunk_rows):
        end = min(n, start + chunk_rows)
        logits = _chunk_logits(hidden, weight, bias, start, end)
        if not use_triton:
            z = softcapped(logits, softcap)
            t = target[start:end]
            rows = torch.nn.functional.cross_entropy(
                z, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
            )
            loss[start:end], lse[start:end] = rows, torch.logsumexp(z, -1)
            continue
        with runtime.on_device_of(hidden):
            _ce_fwd_kernel[(end - start,)](
                logits_ptr=logits, target_ptr=target[start:end],
                loss_ptr=loss[start:end], lse_ptr=lse[start:end],
                stride_l=logits.stride(0), vocab=vocab, ignore_index=ignore_index, smoothing=label_smoothing,
                softcap=softcap, BLOCK_V=_block_v(vocab), HAS_SOFTCAP=softcap > 0, num_warps=8,
            )  # fmt: skip
        runtime.record_launch(KERNEL_FORWARD)
    return loss, lse


@_forward_op.register_fake
def _forward_fake(hidden, weight, target, bias, ignore_index, label_smoothing, softcap, chunk_rows):
    n = hidden.shape[0]
    return hidden.new_empty((n,), dtype=torch.float32), hidden.new_empty((n,), dtype=torch.float32)


def _dlogits_torch(logits, t, lse, g, ignore_index, label_smoothing, softcap):
    vocab = logits.shape[1]
    z = softcapped(logits, softcap)
    dz = torch.exp(z - lse[:, None].to(z.dtype)) - label_smoothing / vocab
    keep = t != ignore_index
    dz[keep, t[keep]] -= 1.0 - label_smoothing
    if softcap > 0:
        dz = dz * (1 - (z / softcap).square())
    return (dz * torch.where(keep, g, 0.0)[:, None].to(dz.dtype)).to(logits.dtype)


@torch.library.custom_op("llm_speed::fused_linear_cross_entropy_backward", mutates_args=())
def _backward_op(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    lse: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    chunk_rows: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, vocab = hidden.shape[0], weight.shape[0]
    grad = grad.to(torch.float32).contiguous()
    dhidden = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    # Accumulated in weight's dtype, one GEMM epilogue per chunk (fp32 inside, rounded once), like Liger.
    dweight = torch.zeros_like(weight, memory_format=torch.contiguous_format)
    dbias = torch.zeros(vocab, dtype=torch.float32, device=hidden.device)
    use_triton = runtime.triton_runs_on(hidden.device)
    if n:
        runtime.report_work("fused_linear_cross_entropy_backward", hidden=hidden, weight=weight)
    for start in range(0, n, chunk_rows):
        end = min(n, start + chunk_rows)
        logits = _chunk_logits(hidden, weight, bias, start, end)
        if use_triton:
            with runtime.on_device_of(hidden):
                _ce_bwd_kernel[(end - start,)](
                    logits_ptr=logits, target_ptr=target[start:end], lse_ptr=lse[start:end],
                    grad_ptr=grad[start:end], stride_l=logits.stride(0), vocab=vocab,
                    ignore_index=ignore_index, smoothing=label_smoothing, softcap=softcap,
                    BLOCK_V=_block_v(vocab), HAS_SOFTCAP=softcap > 0,
                    RNE_BY_HAND=rne_by_hand(logits.dtype), num_warps=8,
                )  # fmt: skip
            runtime.record_launch(KERNEL_BACKWARD)
            dlogits = logits
        else:
            t = target[start:end]
            dlogits = _dlogits_torch(
                logits, t, lse[start:end], grad[start:end], ignore_index, label_smoothing, softcap
            )
        torch.mm(dlogits, weight, out=dhidden[start:end])
        dweight.addmm_(dlogits.t(), hidden[start:end])
        if bias is not None:
            dbias += dlogits.sum(0, dtype=torch.float32)
    return dhidden, dweight, dbias.to(weight.dtype)


@_backward_op.register_fake
def _backward_fake(
    grad, hidden, weight, target, bias, lse, ignore_index, label_smoothing, softcap, chunk_rows
):
    return torch.empty_like(hidden), torch.empty_like(weight), weight.new_empty((weight.shape[0],))


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, ignore_index, label_smoothing, softcap, chunk_rows = inputs
    ctx.save_for_backward(hidden, weight, target, bias, output[1])
    ctx.args = (ignore_index, label_smoothing, softcap, chunk_rows)


def _backward(ctx, grad, _dlse):
    hidden, weight, target, bias, lse = ctx.saved_tensors
    dhidden, dweight, dbias = _backward_op(grad, hidden, weight, target, bias, lse, *ctx.args)
    return dhidden, dweight, None, (dbias if bias is not None else None), None, None, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _check_int(name, value, *, positive=False):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if positive and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return int(value)


def _validate(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, chunk_rows):
    check_tensor("hidden", hidden, dims=2, what="[N, H]")
    check_tensor("weight", weight, dims=2, what="[V, H] (the nn.Linear layout)")
    check_tensor("target", target, dtypes=(torch.int64,), dims=1, what="[N]")
    if bias is not None:
        check_tensor("bias", bias, dims=1, what="[V]")
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) > 1:
        raise TypeError(f"hidden, weight and bias must share one dtype, got {sorted(map(str, dtypes))}")
    n, h = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != h:
        raise ValueError(
            f"weight is {tuple(weight.shape)}; it must be [V, H] with H = hidden's last dim ({h})"
        )
    if vocab < 1 or h < 1:
        raise ValueError(f"V ({vocab}) and H ({h}) must be at least 1")
    if target.shape[0] != n:
        raise ValueError(f"target has {target.shape[0]} entries; hidden has {n} rows")
    if bias is not None and bias.shape[0] != vocab:
        raise ValueError(f"bias has {bias.shape[0]} entries; it must have V = {vocab}")
    check_same_device(hidden=hidden, weight=weight, target=target, bias=bias)
    ignore_index = _check_int("ignore_index", ignore_index)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction is {reduction!r}; accepted: 'mean', 'sum', 'none'")
    label_smoothing = check_real("label_smoothing", label_smoothing, minimum=0.0)
    if label_smoothing > 1.0:
        raise ValueError(f"label_smoothing must be <= 1, got {label_smoothing}")
    softcap = 0.0 if softcap is None else check_real("softcap", softcap, positive=True)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(n, h, vocab)
    chunk_rows = _check_int("chunk_rows", chunk_rows, positive=True)
    return ignore_index, label_smoothing, softcap, chunk_rows


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target)`` computed in row chunks, never holding ``[N, V]``.

    Args:
        hidden: ``[N, H]`` (flatten batch and sequence first), float16, bfloat16 or float32.
        weight: ``[V, H]``, the ``nn.Linear`` layout (an LM head's ``.weight``), hidden's dtype.
        target: int64 ``[N]``; each entry in ``[0, V)`` or ``ignore_index`` (else ValueError, checked before
            any loss is computed; the check reads the targets on the host).
        bias: optional ``[V]``, hidden's dtype.
        ignore_index: rows with this target add nothing to the loss or the gradients.
        reduction: ``"mean"`` over the non-ignored rows (a batch with every row ignored gives loss 0 and zero
            gradients, where PyTorch gives NaN), ``"sum"``, or ``"none"`` (``[N]``, 0 at ignored rows).
        label_smoothing: in ``[0, 1]``, as ``torch.nn.functional.cross_entropy`` defines it.
        softcap: ``None`` or ``c > 0``: logits become ``c * tanh(logits / c)`` first (Gemma-2's final logit
            softcapping, google-deepmind/gemma ``final_logit_softcap``).
        chunk_rows: rows per chunk ``C``; default ``next_pow2(ceil(N / ceil(V / H)))``, a chunk of logits as
            large as ``hidden``.

    Returns the loss in hidden's dtype: a scalar, or ``[N]`` for ``reduction="none"``. Logits come from
    GEMMs in the inputs' dtype; log-sum-exp, loss and ``d loss / d logits`` in float32. Differentiable in
    hidden, weight and bias: the backward recomputes each chunk's logits; the weight gradient is accumulated
    in weight's dtype, one GEMM per chunk.

    Memory: ``O(C x V)`` beyond inputs and gradients, against at least ``2 N V`` elements unfused; for
    Llama-3-8B's head (H = 4096, V = 128256, N = 8192, bfloat16) 65.7 MB against 4.20 GB by
    :func:`memory_estimate` (a formula, not a measurement). Devices as :func:`llm_speed.rms_norm`.
    Reference: :func:`fused_linear_cross_entropy_reference`.
    """
    ignore_index, label_smoothing, softcap, chunk_rows = _validate(
        hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, chunk_rows
    )
    rows, _ = _forward_op(hidden, weight, target, bias, ignore_index, label_smoothing, softcap, chunk_rows)
    return reduce_loss(rows, target, ignore_index, reduction, hidden.dtype)
