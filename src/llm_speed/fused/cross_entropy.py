"""Fused linear + cross-entropy: the loss of ``cross_entropy(hidden @ weight.T + bias, target)`` without the
full ``[N, V]`` logits.

Rows are processed in chunks of ``C``: a chunk's logits ``[C, V]`` come from one GEMM, a Triton kernel turns
them into per-row losses and log-sum-exps (an online softmax over vocabulary blocks, Milakov & Gimelshein,
"Online normalizer calculation for softmax", 2018, arXiv:1805.02867), and the chunk is dropped. The backward
recomputes each chunk's logits, a second kernel overwrites them in place with ``d loss / d logits``, and two
GEMMs add the chunk's share to the hidden and weight gradients. A "mean" or "sum" is taken by a third kernel
(one launch, where PyTorch's reduction takes four to six), which keeps the divisor for the backward. The
chunking follows Liger-Kernel (linkedin/Liger-Kernel ``ops/fused_linear_cross_entropy.py``, Hsu et al. 2024,
arXiv:2410.10989), which computes the gradients during the forward instead; recomputing costs one more
``N x H x V`` GEMM but supports any output gradient (``reduction="none"``) and keeps the forward free of
gradient buffers.

Memory (itemsize ``b``, bias ignored): eager PyTorch holds at least two ``[N, V]`` tensors at once (logits and
log-probabilities in the forward, log-probabilities and their gradient in the backward): ``2 N V b``. Here the
extra memory is one ``[C, V]`` chunk plus ``O(N)`` fp32 statistics: ``C V b + 8 N``. The default ``C`` makes
the chunk as large as ``hidden`` itself, ``C = next_pow2(ceil(N / ceil(V / H)))``, but never below 2^16
logits (:func:`default_chunk_rows`; a smaller chunk's launches cost more than it saves). For Llama-3-8B's head
(H = 4096, V = 128256) with N = 8192 tokens in bfloat16: unfused ``2 * 8192 * 128256 * 2 B = 4.20 GB``; fused
``C = 256``, ``256 * 128256 * 2 B + 64 KiB = 65.7 MB``, 64x less (:func:`memory_estimate`; a formula, not a
measurement). Hugging Face's loss also upcasts the logits to float32, which adds ``4 N V`` bytes more.

Layout as :mod:`llm_speed.fused.rms_norm`: kernels, launcher, op registration, autograd, public function; the
plain-PyTorch spec is :func:`llm_speed.fused.reference.fused_linear_cross_entropy_reference`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..core import runtime, tensors
from ..core.args import check_choice, check_int, check_real, positive_int
from ..core.config import KernelConfig
from ..core.dispatch import Op
from ..core.kernel_math import cast, rne_by_hand, tanh
from ..core.launch import PLAN_CACHE_SIZE, Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.tensors import check_same_device, check_tensor
from .reference import softcapped

REDUCTIONS = ("mean", "sum", "none")

# --- kernels --------------------------------------------------------------------------------------------
# A target outside [0, vocab) that is not ignore_index (possible when the host checks are off, see
# _check_targets) is never used as an address: its row's loss and gradient become NaN.


@triton.jit
def _ce_fwd_kernel(
    logits_ptr, target_ptr, loss_ptr, stats_ptr, row0, loss_start, stride_l, vocab, ignore_index, smoothing,
    softcap,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """Loss (in loss's dtype, from element ``loss_start`` on) and log-sum-exp (float32, the first elements of
    stats) of the rows of a chunk's logits; row ``i`` of the chunk is row ``row0 + i`` of the problem."""
    i = tl.program_id(0).to(tl.int64)
    row = row0 + i
    p_l = logits_ptr + i * stride_l
    m = tl.full([], float("-inf"), tl.float32)  # running max
    s = tl.full([], 0.0, tl.float32)  # running sum of exp(z - m)
    sum_z = tl.full([], 0.0, tl.float32)  # sum of all logits (label smoothing)
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        b_z = tl.load(p_l + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        if HAS_SOFTCAP:
            b_z = softcap * tanh(b_z / softcap)
        b_zm = tl.where(m_v, b_z, float("-inf"))
        m_new = tl.maximum(m, tl.max(b_zm, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(b_zm - m_new), axis=0)
        sum_z += tl.sum(tl.where(m_v, b_z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    t = tl.load(target_ptr + row)
    keep = t != ignore_index
    valid = (t >= 0) & (t < vocab)
    z_t = tl.load(p_l + tl.where(keep & valid, t, 0)).to(tl.float32)
    if HAS_SOFTCAP:
        z_t = softcap * tanh(z_t / softcap)
    # (1 - eps) * (lse - z_t) + eps * (lse - mean(z)): torch.nn.functional.cross_entropy's label smoothing
    loss = lse - (1.0 - smoothing) * z_t - smoothing * (sum_z / vocab)
    loss = tl.where(keep, tl.where(valid, loss, float("nan")), 0.0)
    tl.store(loss_ptr + loss_start + row, cast(loss, loss_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND))
    tl.store(stats_ptr + row, lse)


@triton.jit
def _ce_reduce_kernel(
    stats_ptr, target_ptr, out_ptr, n, ignore_index,
    MEAN: tl.constexpr, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """One program: out = the sum of the rows' float32 losses (stats[n:2n]), divided (MEAN) by the number of
    rows not ignored (at least 1); the divisor (1 for a sum) goes to stats[2n] for the backward."""
    b_total = tl.zeros([BLOCK], dtype=tl.float32)
    b_kept = tl.zeros([BLOCK], dtype=tl.int32)
    for r0 in range(0, n, BLOCK):
        o = r0 + tl.arange(0, BLOCK)
        m = o < n
        b_total += tl.load(stats_ptr + n + o, mask=m, other=0.0)
        b_kept += (m & (tl.load(target_ptr + o, mask=m, other=0) != ignore_index)).to(tl.int32)
    total = tl.sum(b_total, axis=0)
    if MEAN:
        divisor = tl.maximum(tl.sum(b_kept, axis=0), 1).to(tl.float32)
    else:
        divisor = tl.full([], 1.0, tl.float32)
    tl.store(out_ptr, cast(total / divisor, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND))
    tl.store(stats_ptr + 2 * n, divisor)


@triton.jit
def _ce_bwd_kernel(
    logits_ptr, target_ptr, stats_ptr, grad_ptr, row0, divisor_at, stride_l, stride_g, vocab, ignore_index,
    smoothing, softcap,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, REDUCED: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """Overwrite a chunk's logits with d loss / d logits, row by row (each element read, then written); row
    ``i`` of the chunk is row ``row0 + i`` of the problem. REDUCED: grad is the gradient of the reduced loss,
    divided for every row by the divisor (stats[divisor_at]); else one gradient per row."""
    i = tl.program_id(0).to(tl.int64)
    row = row0 + i
    p_l = logits_ptr + i * stride_l
    t = tl.load(target_ptr + row)
    lse = tl.load(stats_ptr + row)
    if REDUCED:
        g = tl.load(grad_ptr).to(tl.float32) / tl.load(stats_ptr + divisor_at)
    else:
        g = tl.load(grad_ptr + row * stride_g).to(tl.float32)
    g = tl.where((t >= 0) & (t < vocab), g, float("nan"))
    g = tl.where(t != ignore_index, g, 0.0)  # ignored rows: gradient 0
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        b_l = tl.load(p_l + o_v, mask=m_v, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            b_th = tanh(b_l / softcap)
            b_z = softcap * b_th
        else:
            b_z = b_l
        b_dz = tl.exp(b_z - lse) - smoothing / vocab - tl.where(o_v == t, 1.0 - smoothing, 0.0)
        if HAS_SOFTCAP:
            b_dz = b_dz * (1.0 - b_th * b_th)
        b_dl = cast(b_dz * g, logits_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
        tl.store(p_l + o_v, b_dl, mask=m_v)


# --- launcher -------------------------------------------------------------------------------------------

FORWARD = Kernel(_ce_fwd_kernel, "cross_entropy_fwd")
REDUCE = Kernel(_ce_reduce_kernel, "cross_entropy_reduce")
BACKWARD = Kernel(_ce_bwd_kernel, "cross_entropy_bwd")
MAX_BLOCK_V = 4096  # vocabulary entries a program holds at once (the loop walks the rest)
MAX_BLOCK_REDUCE = 1024  # rows the reduction adds per step


# A chunk holds at least this many logits: below it, a chunk's GEMM and kernel launches cost more host time
# than its memory (128 KiB in bfloat16) is worth.
MIN_CHUNK_LOGITS = 1 << 16


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def default_chunk_rows(n: int, hidden: int, vocab: int) -> int:
    """Rows per chunk so that a chunk's logits ``[C, V]`` are about as large as ``hidden [N, H]`` (Liger), but
    at least :data:`MIN_CHUNK_LOGITS` logits: ``C = next_pow2(max(ceil(N / ceil(V / H)), ceil(2^16 / V)))``,
    at most N."""
    liger = next_power_of_2(cdiv(n, cdiv(vocab, hidden)))
    return max(1, min(n, max(liger, next_power_of_2(cdiv(MIN_CHUNK_LOGITS, vocab)))))


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


@functools.cache
def config(vocab: int) -> KernelConfig:
    """Forward and backward: one row per program (``block_m`` 1), ``block_n`` vocabulary entries per step
    (vocab padded to a power of two, at most :data:`MAX_BLOCK_V`)."""
    return KernelConfig(1, min(MAX_BLOCK_V, next_power_of_2(vocab)), num_warps=8, num_stages=1)


@functools.cache
def reduce_config(n: int) -> KernelConfig:
    """The reduction: one program adding ``block_n`` rows per step (``n`` padded to a power of two, at most
    :data:`MAX_BLOCK_REDUCE`)."""
    block = min(MAX_BLOCK_REDUCE, next_power_of_2(n))
    return KernelConfig(1, block, num_warps=max(1, min(4, block // 256)), num_stages=1)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _chunk_sizes(n: int, chunk_rows: int) -> tuple[int, ...]:
    """Rows of each chunk: ``chunk_rows``, the last one what is left."""
    return (chunk_rows,) * (n // chunk_rows) + ((n % chunk_rows,) if n % chunk_rows else ())


def _row_chunks(t: torch.Tensor, sizes: tuple[int, ...]):
    """Views of ``t``'s rows, one per chunk (``t`` itself for a single chunk)."""
    return (t,) if len(sizes) == 1 else t.split_with_sizes(sizes)


@plan_cache
def _forward_plans(
    n: int, chunk_rows: int, vocab: int, ignore_index: int, has_softcap: bool, reduction: str, dtypes: tuple,
    device: torch.device,
) -> tuple[tuple[int, ...], tuple[Plan, ...], Plan | None]:  # fmt: skip
    """(chunk sizes, one plan per chunk, the reduction's plan or None): one lookup per call. A chunk's plan
    fixes the chunk's first row, so a launch takes whole target, loss and stats tensors (no per-call views).
    Reduced: the rows' losses go to the stats (float32), else to loss. dtypes: hidden, target, rows, loss."""
    reduced = reduction != "none"
    cfg = config(vocab)
    plans = []
    for start, rows in zip(range(0, n, chunk_rows), _chunk_sizes(n, chunk_rows), strict=True):
        plans.append(FORWARD.plan(
            (rows,), row0=start, loss_start=n if reduced else 0, stride_l=vocab, vocab=vocab,
            ignore_index=ignore_index, BLOCK_V=cfg.block_n, HAS_SOFTCAP=has_softcap,
            RNE_BY_HAND=rne_by_hand(dtypes[2]), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ))  # fmt: skip
    reduce = None
    if reduced:
        rcfg = reduce_config(n)
        reduce = REDUCE.plan(
            (1,), n=n, ignore_index=ignore_index, MEAN=reduction == "mean", BLOCK=rcfg.block_n,
            RNE_BY_HAND=rne_by_hand(dtypes[3]), num_warps=rcfg.num_warps, num_stages=rcfg.num_stages,
        )  # fmt: skip
    return _chunk_sizes(n, chunk_rows), tuple(plans), reduce


@plan_cache
def _backward_plans(
    n: int, chunk_rows: int, vocab: int, ignore_index: int, has_softcap: bool, reduced: bool, stride_g: int,
    dtypes: tuple, device: torch.device,
) -> tuple[Plan, ...]:  # fmt: skip
    cfg = config(vocab)
    plans = []
    for start, rows in zip(range(0, n, chunk_rows), _chunk_sizes(n, chunk_rows), strict=True):
        plans.append(BACKWARD.plan(
            (rows,), row0=start, divisor_at=2 * n, stride_l=vocab, stride_g=stride_g, vocab=vocab,
            ignore_index=ignore_index, BLOCK_V=cfg.block_n, HAS_SOFTCAP=has_softcap, REDUCED=reduced,
            RNE_BY_HAND=rne_by_hand(dtypes[0]), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ))  # fmt: skip
    return tuple(plans)


def _chunk_logits(hidden_rows, weight_t, bias):
    """The logits ``[C, V]`` of a chunk of rows of hidden (contiguous, in the inputs' dtype); ``weight_t`` is
    the head transposed, ``[H, V]``."""
    return torch.mm(hidden_rows, weight_t) if bias is None else torch.addmm(bias, hidden_rows, weight_t)


def _check_targets(target, vocab, ignore_index):
    """ValueError naming the first target outside ``[0, vocab)`` that is not ``ignore_index`` (reads the
    targets on the host: only where :func:`llm_speed.core.runtime.check_values` allows it)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        first = int(target[bad][0])
        raise ValueError(
            f"target holds {first}; accepted: 0 <= target < {vocab} (vocab) or ignore_index {ignore_index}"
        )


def _forward_torch(
    hidden, weight, target, bias, ignore_index, label_smoothing, softcap, chunk_rows, reduction
):  # fmt: skip
    n = hidden.shape[0]
    rows = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = tensors.new_output((n,), torch.float32, hidden.device)
    sizes = _chunk_sizes(n, chunk_rows)
    for h, t, loss_rows, lse_rows in zip(
        _row_chunks(hidden, sizes), _row_chunks(target, sizes), _row_chunks(rows, sizes),
        _row_chunks(lse, sizes), strict=True,
    ):  # fmt: skip
        z = softcapped(_chunk_logits(h, weight.t(), bias), softcap)
        loss_rows.copy_(torch.nn.functional.cross_entropy(
            z, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
        ))  # fmt: skip
        lse_rows.copy_(torch.logsumexp(z, -1))
    if reduction == "none":
        return rows.to(hidden.dtype), lse
    if reduction == "mean":  # over the rows not ignored; 0 / 1 when every row is (PyTorch: 0 / 0)
        divisor = (target != ignore_index).sum().clamp(min=1).to(torch.float32)
    else:
        divisor = torch.ones((), dtype=torch.float32, device=hidden.device)
    return (rows.sum() / divisor).to(hidden.dtype), torch.cat((lse, rows, divisor.reshape(1)))


def _dlogits_torch(logits, t, lse, g, ignore_index, label_smoothing, softcap):
    vocab = logits.shape[1]
    z = softcapped(logits, softcap)
    dz = torch.exp(z - lse[:, None].to(z.dtype)) - label_smoothing / vocab
    keep = t != ignore_index
    dz[keep, t[keep]] -= 1.0 - label_smoothing
    if softcap > 0:
        dz = dz * (1 - (z / softcap).square())
    return (dz * torch.where(keep, g, 0.0)[:, None].to(dz.dtype)).to(logits.dtype)


def forward(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    ignore_index: int, label_smoothing: float, softcap: float, chunk_rows: int, reduction: str,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(loss, stats), chunk by chunk; reports its work. loss: in hidden's dtype, ``[N]`` for
    ``reduction="none"``, else a scalar. stats, float32, what the backward reads: each row's log-sum-exp
    (``[N]``); for "mean" and "sum" followed by each row's loss and the divisor of the sum (1 for "sum"):
    ``[2N + 1]``.

    Targets are checked on the host only where :func:`llm_speed.core.runtime.check_values` allows it (and
    always by the PyTorch fallback, on the CPU); otherwise an invalid one makes its row's loss NaN."""
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    target = target.contiguous()
    triton_runs = runtime.triton_runs_on(device)
    if not triton_runs or runtime.check_values(device):
        _check_targets(target, vocab, ignore_index)
    if n:
        runtime.report_work("fused_linear_cross_entropy", hidden=hidden, weight=weight)
    if n == 0 or not triton_runs:
        return _forward_torch(
            hidden, weight, target, bias, ignore_index, label_smoothing, softcap, chunk_rows, reduction
        )
    reduced = reduction != "none"
    stats = tensors.new_output((2 * n + 1 if reduced else n,), torch.float32, device)
    loss = tensors.new_output(() if reduced else (n,), hidden.dtype, device)
    rows = stats if reduced else loss  # where the rows' losses go
    # a chunk's logits have hidden's dtype (matmul and addmm require weight and bias to share it)
    dtypes = (hidden.dtype, target.dtype, rows.dtype, loss.dtype)
    sizes, plans, reduce = _forward_plans(
        n, chunk_rows, vocab, ignore_index, softcap > 0, reduction, dtypes, device
    )  # fmt: skip
    weight_t = weight.t()
    for h, plan in zip(_row_chunks(hidden, sizes), plans, strict=True):
        plan.launch(
            logits_ptr=_chunk_logits(h, weight_t, bias), target_ptr=target, loss_ptr=rows, stats_ptr=stats,
            smoothing=label_smoothing, softcap=softcap,
        )  # fmt: skip
    if reduce is not None:
        reduce.launch(stats_ptr=stats, target_ptr=target, out_ptr=loss)
    return loss, stats


def backward(
    grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    bias: torch.Tensor | None, stats: torch.Tensor, ignore_index: int, label_smoothing: float, softcap: float,
    chunk_rows: int, reduction: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dhidden, dweight, dbias) of :func:`forward` for the gradient ``grad`` of its loss; reports its work.
    dbias is returned (zeros) even without a bias."""
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    reduced = reduction != "none"
    target = target.contiguous()
    triton_runs = runtime.triton_runs_on(device)
    if n:
        runtime.report_work("fused_linear_cross_entropy_backward", hidden=hidden, weight=weight)
    dhidden = tensors.new_output(hidden.shape, hidden.dtype, device)
    if n == 0:
        return dhidden, torch.zeros_like(weight), weight.new_zeros((vocab,))
    sizes = _chunk_sizes(n, chunk_rows)
    if triton_runs:
        dtypes = (hidden.dtype, target.dtype, stats.dtype, grad.dtype)
        stride_g = 0 if reduced else grad.stride(0)
        plans = _backward_plans(
            n, chunk_rows, vocab, ignore_index, softcap > 0, reduced, stride_g, dtypes, device
        )  # fmt: skip
    else:  # PyTorch on the CPU: one float32 gradient per row
        grad = (grad.float() / stats[2 * n]).expand(n) if reduced else grad.float()
    dweight = dbias = None
    for i, (h, dh) in enumerate(zip(_row_chunks(hidden, sizes), _row_chunks(dhidden, sizes), strict=True)):
        logits = _chunk_logits(h, weight.t(), bias)
        if triton_runs:
            plans[i].launch(
                logits_ptr=logits, target_ptr=target, stats_ptr=stats, grad_ptr=grad,
                smoothing=label_smoothing, softcap=softcap,
            )  # fmt: skip
            dlogits = logits
        else:
            rows = slice(i * chunk_rows, i * chunk_rows + sizes[i])
            dlogits = _dlogits_torch(
                logits, target[rows], stats[rows], grad[rows], ignore_index, label_smoothing, softcap
            )
        torch.mm(dlogits, weight, out=dh)
        # accumulated in weight's dtype, one GEMM epilogue per chunk (fp32 inside, rounded once), like Liger
        dweight = torch.mm(dlogits.t(), h) if dweight is None else dweight.addmm_(dlogits.t(), h)
        if bias is not None:
            part = dlogits.sum(0, dtype=torch.float32)
            dbias = part if dbias is None else dbias.add_(part)
    dbias = weight.new_zeros((vocab,)) if bias is None else dbias.to(weight.dtype)
    return dhidden, dweight, dbias


# --- op registration ------------------------------------------------------------------------------------


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
    reduction: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(
        hidden, weight, target, bias, ignore_index, label_smoothing, softcap, chunk_rows, reduction
    )


@_forward_op.register_fake
def _forward_fake(
    hidden, weight, target, bias, ignore_index, label_smoothing, softcap, chunk_rows, reduction
):
    n = hidden.shape[0]
    reduced = reduction != "none"
    loss = hidden.new_empty(() if reduced else (n,))
    return loss, hidden.new_empty((2 * n + 1 if reduced else n,), dtype=torch.float32)


@torch.library.custom_op("llm_speed::fused_linear_cross_entropy_backward", mutates_args=())
def _backward_op(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    stats: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    chunk_rows: int,
    reduction: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(
        grad,
        hidden,
        weight,
        target,
        bias,
        stats,
        ignore_index,
        label_smoothing,
        softcap,
        chunk_rows,
        reduction,
    )


@_backward_op.register_fake
def _backward_fake(grad, hidden, weight, target, *_):
    return torch.empty_like(hidden), torch.empty_like(weight), weight.new_empty((weight.shape[0],))


_backward_call = Op(_backward_op, backward)


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    hidden, weight, target, bias, ignore_index, label_smoothing, softcap, chunk_rows, reduction = inputs
    ctx.save_for_backward(hidden, weight, target, bias, output[1])
    ctx.args = (ignore_index, label_smoothing, softcap, chunk_rows, reduction)


def _backward(ctx, grad, _dstats):
    hidden, weight, target, bias, stats = ctx.saved_tensors
    dhidden, dweight, dbias = _backward_call(grad, hidden, weight, target, bias, stats, *ctx.args)
    return dhidden, dweight, None, (dbias if bias is not None else None), None, None, None, None, None


_forward_call = Op(_forward_op, forward, setup_context=_setup_context, backward=_backward)


# --- public function ------------------------------------------------------------------------------------


def _validate(hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, chunk_rows):
    check_tensor("hidden", hidden, dims=2, what="[N, H]")
    check_tensor("weight", weight, dims=2, what="[V, H] (the nn.Linear layout)")
    check_tensor("target", target, dtypes=(torch.int64,), dims=1, what="[N]")
    if bias is not None:
        check_tensor("bias", bias, dims=1, what="[V]")
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != hidden.dtype):
        dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
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
    ignore_index = check_int("ignore_index", ignore_index)  # any sign: -100 by default
    check_choice("reduction", reduction, REDUCTIONS)
    label_smoothing = check_real("label_smoothing", label_smoothing, minimum=0.0, maximum=1.0)
    softcap = 0.0 if softcap is None else check_real("softcap", softcap, positive=True)
    if chunk_rows is None:
        chunk_rows = default_chunk_rows(n, h, vocab)
    chunk_rows = positive_int("chunk_rows", chunk_rows)
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
        target: int64 ``[N]``; each entry in ``[0, V)`` or ``ignore_index``. Checked before any work where
            :func:`llm_speed.core.runtime.check_values` allows reading it on the host (CPU tensors, or
            ``LLM_SPEED_CHECK_INPUTS=1``): a ValueError. Unchecked (CUDA by default), an invalid entry makes
            its row's loss NaN (so a reduced loss is NaN) and its row of the hidden gradient NaN.
        bias: optional ``[V]``, hidden's dtype.
        ignore_index: rows with this target add nothing to the loss or the gradients.
        reduction: ``"mean"`` over the non-ignored rows (a batch with every row ignored gives loss 0 and zero
            gradients, where PyTorch gives NaN), ``"sum"``, or ``"none"`` (``[N]``, 0 at ignored rows).
        label_smoothing: in ``[0, 1]``, as ``torch.nn.functional.cross_entropy`` defines it.
        softcap: ``None`` or ``c > 0``: logits become ``c * tanh(logits / c)`` first (Gemma-2's final logit
            softcapping, google-deepmind/gemma ``final_logit_softcap``).
        chunk_rows: rows per chunk ``C``; default ``next_pow2(ceil(N / ceil(V / H)))``, a chunk of logits as
            large as ``hidden``, and at least 2^16 logits (:func:`default_chunk_rows`).

    Returns the loss in hidden's dtype: a scalar, or ``[N]`` for ``reduction="none"``. Logits come from
    GEMMs in the inputs' dtype; log-sum-exp, loss and ``d loss / d logits`` in float32. Differentiable in
    hidden, weight and bias: the backward recomputes each chunk's logits; the weight gradient is accumulated
    in weight's dtype, one GEMM per chunk.

    Memory: ``O(C x V)`` beyond inputs and gradients, against at least ``2 N V`` elements unfused; for
    Llama-3-8B's head (H = 4096, V = 128256, N = 8192, bfloat16) 65.7 MB against 4.20 GB by
    :func:`memory_estimate` (a formula, not a measurement). Devices as :func:`llm_speed.rms_norm`.
    Reference: :func:`llm_speed.fused.reference.fused_linear_cross_entropy_reference`.
    """
    ignore_index, label_smoothing, softcap, chunk_rows = _validate(
        hidden, weight, target, bias, ignore_index, reduction, label_smoothing, softcap, chunk_rows
    )
    loss, _ = _forward_call(
        hidden, weight, target, bias, ignore_index, label_smoothing, softcap, chunk_rows, reduction
    )
    return loss
