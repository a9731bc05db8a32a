"""Cross-entropy in Triton: on logits (``cross_entropy``) and fused with the LM head
(``fused_linear_cross_entropy``: the loss of ``cross_entropy(hidden @ weight.T + bias, target)`` without the
full ``[N, V]`` logits). Both run the same three kernels.

A row's kernel computes its log-sum-exp with an online softmax over vocabulary blocks (Milakov & Gimelshein,
"Online normalizer calculation for softmax", 2018, arXiv:1805.02867) and its loss: PyTorch's
``cross_entropy`` per row, with class weights and label smoothing as PyTorch defines them, plus the z-loss
``lse_square_scale * lse^2`` (PaLM, Chowdhery et al. 2022, arXiv:2204.02311, section 5; Liger-Kernel's
``lse_square_scale``). A "mean" or "sum" is taken by a second kernel (one launch, where PyTorch's reduction
takes four to six), which keeps its divisors for the backward. The backward kernel writes ``d loss / d
logits`` row by row, recomputing the softmax from the logits and the saved log-sum-exp (kept as the row's
largest logit and the log of its sum of exponentials, so that a logit's difference to the largest is what
rounds, as in PyTorch's ``log_softmax``: see the kernels' section).

The fused linear version processes rows in chunks of ``C``: a chunk's logits ``[C, V]`` come from one GEMM,
the forward kernel turns them into per-row losses and log-sum-exps, and the chunk is dropped. A reduced loss
with grad (every training loss) makes its gradients in the forward while each chunk's logits exist, as
Liger-Kernel does (linkedin/Liger-Kernel ``ops/fused_linear_cross_entropy.py``, Hsu et al. 2024,
arXiv:2410.10989): the backward kernel overwrites the logits in place with their gradient for a loss
gradient of 1 and two GEMMs add the chunk's share to the hidden and weight gradients; the backward scales
them by the loss gradient, read on the device. ``reduction="none"`` (a gradient per row, unknown in the
forward) recomputes each chunk's logits in the backward instead: one more ``N x H x V`` GEMM.

Memory (itemsize ``b``, bias ignored): eager PyTorch holds at least two ``[N, V]`` tensors at once (logits and
log-probabilities in the forward, log-probabilities and their gradient in the backward): ``2 N V b``. Here the
extra memory is one ``[C, V]`` chunk plus ``O(N)`` fp32 statistics: ``C V b + 8 N``. The default ``C`` makes
the chunk as large as ``hidden`` itself, ``C = next_pow2(ceil(N / ceil(V / H)))``, but never below 2^16
logits (a smaller chunk's launches cost more than it saves) nor 1024 rows (each chunk's GEMMs read the whole
weight: fewer rows leave them memory-bound; :func:`default_chunk_rows`). For Llama-3-8B's head (H = 4096,
V = 128256) with N = 8192 tokens in bfloat16: unfused ``2 * 8192 * 128256 * 2 B = 4.20 GB``; fused ``C =
1024``, ``1024 * 128256 * 2 B + 64 KiB = 263 MB``, 16x less (:func:`memory_estimate`; a formula, not a
measurement). Hugging Face's loss also upcasts the logits to float32, which adds ``4 N V`` bytes more.

Layout as :mod:`llm_speed.fused.rms_norm`: kernels, launcher, op registration, autograd, public functions; the
plain-PyTorch specs are :func:`llm_speed.fused.reference.cross_entropy_reference` and
:func:`llm_speed.fused.reference.fused_linear_cross_entropy_reference`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..core import autocast, runtime, tensors
from ..core.args import check_choice, check_flag, check_int, check_real, positive_int
from ..core.chunking import linear_cross_entropy_chunk_rows
from ..core.config import KernelConfig
from ..core.dispatch import INFERENCE, Op, plain_call
from ..core.kernel_math import cast, rne_by_hand, tanh
from ..core.launch import PLAN_CACHE_SIZE, CallCache, Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.tensors import FLOAT_DTYPES, check_same_device, check_tensor, dtype_names
from .reference import softcapped
from .swiglu import config as elementwise_config

REDUCTIONS = ("mean", "sum", "none")

# --- kernels --------------------------------------------------------------------------------------------
# A target outside [0, vocab) that is not ignore_index (possible when the host checks are off, see
# _check_targets) is never used as an address: its row's loss and gradient become NaN.
#
# stats, float32, what the backward reads: each row's log-sum-exp in two parts, its largest logit m [n] and
# log(sum_j exp(z_j - m)) [n]; for "mean" and "sum" followed by each row's cross-entropy [n], each row's
# z-loss [n] (with a z-loss only) and the two divisors of the sums (the cross-entropy's, the z-loss's; 1 for
# "sum"). The loss and the softmax are computed from z - m, as PyTorch's log_softmax does: one float32
# log-sum-exp m + log(s) would carry a rounding of half an ulp of m into both (4.9x PyTorch's loss error
# at logits around 50, 3.1x its gradient's; 1e4x at 1e5).


@triton.jit
def _ce_fwd_kernel(
    logits_ptr, target_ptr, weight_ptr, loss_ptr, z_ptr, stats_ptr, row0, n, stride_l, vocab, ignore_index,
    smoothing, softcap, z_scale,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_Z: tl.constexpr,
    REDUCED: tl.constexpr, STORE_Z: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """Row ``i`` of a chunk's logits is row ``row0 + i`` of the problem: its log-sum-exp goes to stats; its
    cross-entropy and z-loss to stats (REDUCED) or their sum to loss and (STORE_Z) the z-loss to z."""
    i = tl.program_id(0).to(tl.int64)
    row = row0 + i
    p_l = logits_ptr + i * stride_l
    m = tl.full([], float("-inf"), tl.float32)  # running max
    s = tl.full([], 0.0, tl.float32)  # running sum of exp(z - m)
    # The target's logit, and the sum of the logits less it (weighted by the class weights; for smoothing):
    # differences of nearby logits, exact where a sum of the logits themselves would round at their size.
    t = tl.load(target_ptr + row)
    keep = t != ignore_index
    valid = (t >= 0) & (t < vocab)
    t_safe = tl.where(keep & valid, t, 0)
    z_t = tl.load(p_l + t_safe).to(tl.float32)
    if HAS_SOFTCAP:
        z_t = softcap * tanh(z_t / softcap)
    sum_z = tl.full([], 0.0, tl.float32)
    sum_w = tl.full([], 0.0, tl.float32)  # sum of the class weights
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        b_z = tl.load(p_l + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        if HAS_SOFTCAP:
            b_z = softcap * tanh(b_z / softcap)
        b_zm = tl.where(m_v, b_z, float("-inf"))
        m_new = tl.maximum(m, tl.max(b_zm, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(b_zm - m_new), axis=0)
        m = m_new
        if HAS_WEIGHT:
            b_w = tl.load(weight_ptr + o_v, mask=m_v, other=0.0).to(tl.float32)
            sum_z += tl.sum(b_w * tl.where(m_v, b_z - z_t, 0.0), axis=0)
            sum_w += tl.sum(b_w, axis=0)
        else:
            sum_z += tl.sum(tl.where(m_v, b_z - z_t, 0.0), axis=0)
    log_s = tl.log(s)
    lse = m + log_s
    # F.cross_entropy per row: (1 - eps) * w_t * (lse - z_t) + eps / V * sum_j w_j (lse - z_j), with
    # lse - z_t = (m - z_t) + log_s and sum_j w_j (lse - z_j) = sum_w (lse - z_t) - sum_j w_j (z_j - z_t)
    d_t = (m - z_t) + log_s
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t_safe).to(tl.float32)
        ce = (1.0 - smoothing) * w_t * d_t + smoothing * ((sum_w * d_t - sum_z) / vocab)
    else:
        ce = d_t - smoothing * (sum_z / vocab)
    ce = tl.where(keep, tl.where(valid, ce, float("nan")), 0.0)
    z = tl.full([], 0.0, tl.float32)
    if HAS_Z:
        z = tl.where(keep, tl.where(valid, z_scale * lse * lse, float("nan")), 0.0)
    if REDUCED:
        tl.store(stats_ptr + 2 * n + row, ce)
        if HAS_Z:
            tl.store(stats_ptr + 3 * n + row, z)
    else:
        tl.store(loss_ptr + row, cast(ce + z, loss_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND))
        if STORE_Z:
            tl.store(z_ptr + row, cast(z, z_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND))
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + n + row, log_s)


@triton.jit
def _ce_reduce_kernel(
    stats_ptr, target_ptr, weight_ptr, out_ptr, z_ptr, n, vocab, ignore_index,
    MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_Z: tl.constexpr, STORE_Z: tl.constexpr,
    SUMS: tl.constexpr, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """One program: out = the rows' cross-entropy summed and divided (MEAN) by the class weights of the rows
    not ignored (their number without weights), plus the rows' z-loss divided by that number; a divisor of 0
    counts as 1. z (STORE_Z) = the z-loss part. The divisors go to the end of stats for the backward. Without
    SUMS only the divisors (they depend on the targets alone: the forward that computes the gradients needs
    them before any row's loss exists)."""
    b_ce = tl.zeros([BLOCK], dtype=tl.float32)
    b_z = tl.zeros([BLOCK], dtype=tl.float32)
    b_kept = tl.zeros([BLOCK], dtype=tl.float32)
    b_w = tl.zeros([BLOCK], dtype=tl.float32)
    for r0 in range(0, n, BLOCK):
        o = r0 + tl.arange(0, BLOCK)
        m = o < n
        if SUMS:
            b_ce += tl.load(stats_ptr + 2 * n + o, mask=m, other=0.0)
            if HAS_Z:
                b_z += tl.load(stats_ptr + 3 * n + o, mask=m, other=0.0)
        t = tl.load(target_ptr + o, mask=m, other=0)
        kept = m & (t != ignore_index)
        b_kept += kept.to(tl.float32)
        if HAS_WEIGHT:
            ok = kept & (t >= 0) & (t < vocab)
            b_w += tl.load(weight_ptr + tl.where(ok, t, 0), mask=ok, other=0.0).to(tl.float32)
    div_at = 3 * n
    if HAS_Z:
        div_at += n
    if MEAN:
        kept_rows = tl.sum(b_kept, axis=0)
        if HAS_WEIGHT:
            ce_div = tl.sum(b_w, axis=0)
        else:
            ce_div = kept_rows
        ce_div = tl.where(ce_div == 0.0, 1.0, ce_div)
        z_div = tl.maximum(kept_rows, 1.0)
    else:
        ce_div = tl.full([], 1.0, tl.float32)
        z_div = tl.full([], 1.0, tl.float32)
    if SUMS:
        z = tl.sum(b_z, axis=0) / z_div
        loss = tl.sum(b_ce, axis=0) / ce_div + z
        tl.store(out_ptr, cast(loss, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND))
        if STORE_Z:
            tl.store(z_ptr, cast(z, z_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND))
    tl.store(stats_ptr + div_at, ce_div)
    tl.store(stats_ptr + div_at + 1, z_div)


@triton.jit
def _ce_bwd_kernel(
    logits_ptr, dlogits_ptr, target_ptr, weight_ptr, stats_ptr, grad_ptr, row0, n, stride_l, stride_d,
    stride_g, vocab, ignore_index, smoothing, softcap, z_scale,
    BLOCK_V: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_Z: tl.constexpr,
    REDUCED: tl.constexpr, UNIT_GRAD: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """d loss / d logits of the rows of a chunk (row ``i`` is row ``row0 + i`` of the problem), written to
    dlogits (which may be logits itself: each element is read, then written). REDUCED: grad is the gradient
    of the reduced loss (1 with UNIT_GRAD, grad_ptr unread), divided for every row by the divisors in stats;
    else one gradient per row."""
    i = tl.program_id(0).to(tl.int64)
    row = row0 + i
    p_l = logits_ptr + i * stride_l
    p_d = dlogits_ptr + i * stride_d
    t = tl.load(target_ptr + row)
    m = tl.load(stats_ptr + row)
    log_s = tl.load(stats_ptr + n + row)
    if REDUCED:
        if UNIT_GRAD:
            g = tl.full([], 1.0, tl.float32)
        else:
            g = tl.load(grad_ptr).to(tl.float32)
        div_at = 3 * n
        if HAS_Z:
            div_at += n
        g_ce = g / tl.load(stats_ptr + div_at)
        g_z = g / tl.load(stats_ptr + div_at + 1)
    else:
        g = tl.load(grad_ptr + row * stride_g).to(tl.float32)
        g_ce = g
        g_z = g
    keep = t != ignore_index
    valid = (t >= 0) & (t < vocab)
    g_ce = tl.where(keep, tl.where(valid, g_ce, float("nan")), 0.0)  # ignored rows: gradient 0
    g_z = tl.where(keep, tl.where(valid, g_z, float("nan")), 0.0)
    t_safe = tl.where(keep & valid, t, 0)
    # d/dz_j = coef_p * p_j - coef_t * [j == t] - coef_w * w_j   (p = softmax, w_j = 1 without weights)
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t_safe).to(tl.float32)
        sum_w = tl.full([], 0.0, tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            o_v = v0 + tl.arange(0, BLOCK_V)
            sum_w += tl.sum(tl.load(weight_ptr + o_v, mask=o_v < vocab, other=0.0).to(tl.float32), axis=0)
        coef_t = g_ce * (1.0 - smoothing) * w_t
        coef_p = coef_t + g_ce * smoothing * (sum_w / vocab)
    else:
        coef_t = g_ce * (1.0 - smoothing)
        coef_p = g_ce
    coef_w = g_ce * (smoothing / vocab)
    if HAS_Z:
        coef_p += g_z * (2.0 * z_scale) * (m + log_s)
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        b_l = tl.load(p_l + o_v, mask=m_v, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            b_th = tanh(b_l / softcap)
            b_z = softcap * b_th
        else:
            b_z = b_l
        b_dz = coef_p * tl.exp((b_z - m) - log_s) - tl.where(o_v == t, coef_t, 0.0)
        if HAS_WEIGHT:
            b_dz -= coef_w * tl.load(weight_ptr + o_v, mask=m_v, other=0.0).to(tl.float32)
        else:
            b_dz -= coef_w
        if HAS_SOFTCAP:
            b_dz = b_dz * (1.0 - b_th * b_th)
        tl.store(p_d + o_v, cast(b_dz, dlogits_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m_v)


@triton.jit
def _ce_scale_kernel(x_ptr, out_ptr, grad_ptr, numel, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    """out = x * grad (a scalar) in float32, rounded once to out's dtype; out may be x."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < numel
    g = tl.load(grad_ptr).to(tl.float32)
    b_x = tl.load(x_ptr + o, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + o, cast(b_x * g, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)


# --- launcher -------------------------------------------------------------------------------------------

FORWARD = Kernel(_ce_fwd_kernel, "cross_entropy_fwd")
REDUCE = Kernel(_ce_reduce_kernel, "cross_entropy_reduce")
BACKWARD = Kernel(_ce_bwd_kernel, "cross_entropy_bwd")
SCALE = Kernel(_ce_scale_kernel, "cross_entropy_scale")
MAX_BLOCK_V = 4096  # vocabulary entries a program holds at once (the loop walks the rest)
MAX_BLOCK_REDUCE = 1024  # rows the reduction adds per step


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def default_chunk_rows(n: int, hidden: int, vocab: int) -> int:
    """Rows per chunk so that a chunk's logits ``[C, V]`` are about as large as ``hidden [N, H]`` (Liger), but
    at least 2^16 logits and 1024 rows (the GEMMs' intensity): ``C = next_pow2(max(ceil(N / ceil(V / H)),
    ceil(2^16 / V), 1024))``, at most N (:func:`llm_speed.core.chunking.linear_cross_entropy_chunk_rows`,
    which the model prices too)."""
    return linear_cross_entropy_chunk_rows(n, hidden, vocab)


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


def stats_size(n: int, reduced: bool, has_z: bool) -> int:
    """Entries of the float32 statistics the forward keeps for the backward (see the kernels' section)."""
    return (3 * n + (n if has_z else 0) + 2) if reduced else 2 * n


@plan_cache
def _forward_plans(
    n: int, chunk_rows: int, vocab: int, stride_l: int, ignore_index: int, flags: tuple, reduction: str,
    dtypes: tuple, device: torch.device, divisors_first: bool = False,
) -> tuple[tuple[int, ...], tuple[Plan, ...], Plan | None, Plan | None]:  # fmt: skip
    """(chunk sizes, one plan per chunk, the reduction's plan or None, the plan writing the divisors alone
    before the chunks or None): one lookup per call. A chunk's plan fixes the chunk's first row, so a launch
    takes whole target, loss and stats tensors (no per-call views). flags: softcap, class weights, z-loss,
    z-loss returned. dtypes: logits, target, class weights, loss, z. divisors_first: a reduced loss whose
    forward also computes the gradients of more than one chunk (all but the last chunk's read the divisors
    before the reduction runs)."""
    has_softcap, has_weight, has_z, store_z = flags
    reduced = reduction != "none"
    cfg = config(vocab)
    plans = []
    for start, rows in zip(range(0, n, chunk_rows), _chunk_sizes(n, chunk_rows), strict=True):
        plans.append(FORWARD.plan(
            (rows,), row0=start, n=n, stride_l=stride_l, vocab=vocab, ignore_index=ignore_index,
            BLOCK_V=cfg.block_n, HAS_SOFTCAP=has_softcap, HAS_WEIGHT=has_weight, HAS_Z=has_z, REDUCED=reduced,
            STORE_Z=store_z, RNE_BY_HAND=rne_by_hand(dtypes[3]), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        ))  # fmt: skip
    reduce = divisors = None
    if reduced:
        rcfg = reduce_config(n)
        reduce, divisors = (REDUCE.plan(
            (1,), n=n, vocab=vocab, ignore_index=ignore_index, MEAN=reduction == "mean",
            HAS_WEIGHT=has_weight, HAS_Z=has_z, STORE_Z=store_z, SUMS=sums, BLOCK=rcfg.block_n,
            RNE_BY_HAND=rne_by_hand(dtypes[3]), num_warps=rcfg.num_warps, num_stages=rcfg.num_stages,
        ) if sums or divisors_first else None for sums in (True, False))  # fmt: skip
    return _chunk_sizes(n, chunk_rows), tuple(plans), reduce, divisors


@plan_cache
def _backward_plans(
    n: int, chunk_rows: int, vocab: int, strides: tuple, ignore_index: int, flags: tuple, reduced: bool,
    dtypes: tuple, device: torch.device, unit_grad: bool = False,
) -> tuple[Plan, ...]:  # fmt: skip
    """One plan per chunk. strides: logits, dlogits, grad rows. flags: softcap, class weights, z-loss. dtypes:
    logits, dlogits, target, class weights, grad. unit_grad: the gradient of a reduced loss taken as 1 (the
    forward that computes the gradients; the backward scales them)."""
    has_softcap, has_weight, has_z = flags
    stride_l, stride_d, stride_g = strides
    cfg = config(vocab)
    plans = []
    for start, rows in zip(range(0, n, chunk_rows), _chunk_sizes(n, chunk_rows), strict=True):
        plans.append(BACKWARD.plan(
            (rows,), row0=start, n=n, stride_l=stride_l, stride_d=stride_d, stride_g=stride_g, vocab=vocab,
            ignore_index=ignore_index, BLOCK_V=cfg.block_n, HAS_SOFTCAP=has_softcap, HAS_WEIGHT=has_weight,
            HAS_Z=has_z, REDUCED=reduced, UNIT_GRAD=unit_grad, RNE_BY_HAND=rne_by_hand(dtypes[1]),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
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


# PyTorch on the CPU (no interpreter): the kernels' formulas, chunk by chunk, in float32.


def _rows_torch(logits, t, class_weight, ignore_index, smoothing, softcap, z_scale):
    """(cross-entropy rows, z-loss rows, largest logit m, log(sum exp(z - m))) of a chunk, float32."""
    z = softcapped(logits, softcap)
    w = None if class_weight is None else class_weight.to(z.dtype)
    ce = torch.nn.functional.cross_entropy(
        z, t, weight=w, ignore_index=ignore_index, reduction="none", label_smoothing=smoothing
    )
    m = z.amax(-1)
    log_s = torch.logsumexp(z - m[:, None], -1)
    zl = torch.where(t != ignore_index, z_scale * (m + log_s).square(), 0.0)
    return ce.float(), zl.float(), m.float(), log_s.float()


def _forward_torch(chunks, target, class_weight, ignore_index, smoothing, softcap, z_scale, reduction,
                   sizes, loss_dtype, return_z):  # fmt: skip
    n = target.shape[0]
    device = target.device
    ce_rows = torch.empty(n, dtype=torch.float32, device=device)
    z_rows = torch.empty(n, dtype=torch.float32, device=device)
    lse = torch.empty(2, n, dtype=torch.float32, device=device)  # m, then log(s): the kernels' stats
    chunks = iter(chunks)  # one chunk alive at a time (see _forward)
    for t, c, zz, mm, ll in zip(
        _row_chunks(target, sizes), _row_chunks(ce_rows, sizes), _row_chunks(z_rows, sizes),
        _row_chunks(lse[0], sizes), _row_chunks(lse[1], sizes), strict=True,
    ):  # fmt: skip
        logits = next(chunks)
        for out, value in zip((c, zz, mm, ll), _rows_torch(logits, t, class_weight, ignore_index, smoothing,
                                                           softcap, z_scale), strict=True):  # fmt: skip
            out.copy_(value)
        del logits, value
    if reduction == "none":
        z = z_rows.to(loss_dtype) if return_z else z_rows.new_empty(0, dtype=loss_dtype)
        return (ce_rows + z_rows).to(loss_dtype), z, lse.reshape(-1)
    kept = target != ignore_index
    if reduction == "mean":
        ce_div = kept.sum().to(torch.float32)
        if class_weight is not None:
            safe = torch.where(kept, target, 0)
            ce_div = torch.where(kept, class_weight.float()[safe], 0.0).sum()
        ce_div = torch.where(ce_div == 0, 1.0, ce_div)
        z_div = kept.sum().clamp(min=1).to(torch.float32)
    else:
        ce_div = z_div = torch.ones((), dtype=torch.float32, device=device)
    z = z_rows.sum() / z_div
    loss = (ce_rows.sum() / ce_div + z).to(loss_dtype)
    has_z = z_scale > 0
    stats = torch.cat((lse.reshape(-1), ce_rows, *((z_rows,) if has_z else ()), ce_div.reshape(1),
                       z_div.reshape(1)))  # fmt: skip
    return loss, (z.to(loss_dtype) if return_z else z.new_empty(0, dtype=loss_dtype)), stats


def _dlogits_torch(logits, t, class_weight, m, log_s, g_ce, g_z, ignore_index, smoothing, softcap, z_scale):
    vocab = logits.shape[1]
    z = softcapped(logits, softcap)
    p = torch.exp((z - m[:, None].to(z.dtype)) - log_s[:, None].to(z.dtype))
    lse = m + log_s
    keep = t != ignore_index
    g_ce = torch.where(keep, g_ce, 0.0).to(z.dtype)[:, None]
    g_z = torch.where(keep, g_z, 0.0).to(z.dtype)[:, None]
    if class_weight is None:
        w = torch.ones(vocab, dtype=z.dtype, device=z.device)
    else:
        w = class_weight.to(z.dtype)
    w_t = w[torch.where(keep, t, 0)][:, None]
    dz = g_ce * (((1 - smoothing) * w_t + smoothing * w.sum() / vocab) * p - smoothing / vocab * w)
    dz = dz + g_z * 2 * z_scale * lse[:, None].to(z.dtype) * p
    rows = torch.arange(len(t), device=t.device)[keep]
    dz[rows, t[keep]] -= (g_ce * (1 - smoothing) * w_t)[keep, 0]
    if softcap > 0:
        dz = dz * (1 - (z / softcap).square())
    return dz.to(logits.dtype)


def _torch_row_gradients(grad, stats, n, reduced, has_z):
    """(g_ce, g_z) per row, float32, of the loss gradient ``grad`` (PyTorch fallback)."""
    if not reduced:
        g = grad.float()
        return g, g
    div_at = 3 * n + (n if has_z else 0)
    g = grad.float()
    return (g / stats[div_at]).expand(n), (g / stats[div_at + 1]).expand(n)


def _forward(
    chunks, n, vocab, stride_l, logits_dtype, target, class_weight, ignore_index, smoothing, softcap, z_scale,
    chunk_rows, reduction, loss_dtype, return_z, device, after_chunk=None,
):  # fmt: skip
    """The kernels' forward over the logits chunks ``chunks`` (an iterable, each made when asked for):
    (loss, z, stats). Targets are checked on the host only where
    :func:`llm_speed.core.runtime.check_values` allows it (and always by the PyTorch fallback); otherwise an
    invalid one makes its row's loss NaN. ``after_chunk(i, logits, stats)`` (a reduced loss, the kernels
    only) runs after chunk i's row kernel, the reduction's divisors already in stats (the last chunk's: after
    the whole reduction)."""
    triton_runs = runtime.triton_runs_on(device)
    if not triton_runs or runtime.check_values(device):
        _check_targets(target, vocab, ignore_index)
    reduced = reduction != "none"
    has_z = z_scale > 0
    if n == 0 or not triton_runs:
        sizes = _chunk_sizes(n, chunk_rows) if n else ()
        if n == 0:  # nothing to compute: loss 0 (an all-ignored batch's), no statistics to keep but divisors
            empty = torch.zeros(0, dtype=torch.float32, device=device)
            loss = torch.zeros(() if reduced else (0,), dtype=loss_dtype, device=device)
            z = loss.clone() if return_z else loss.new_empty(0)
            stats = torch.ones(stats_size(0, reduced, has_z), dtype=torch.float32, device=device)
            return loss, z, stats if reduced else empty
        return _forward_torch(chunks, target, class_weight, ignore_index, smoothing, softcap, z_scale,
                              reduction, sizes, loss_dtype, return_z)  # fmt: skip
    stats = tensors.new_output((stats_size(n, reduced, has_z),), torch.float32, device)
    loss = tensors.new_output(() if reduced else (n,), loss_dtype, device)
    z = tensors.new_output((() if reduced else (n,)) if return_z else (0,), loss_dtype, device)
    has_weight = class_weight is not None
    weight_arg = class_weight if has_weight else stats  # never read without class weights
    dtypes = (logits_dtype, target.dtype, class_weight.dtype if has_weight else None, loss_dtype)
    flags = (softcap > 0, has_weight, has_z, return_z)
    # A chunk's gradients divide by the reduction's divisors: the reduction writes them after the last
    # chunk's row kernel, before that chunk's gradients; earlier chunks need them first (one launch more).
    sizes, plans, reduce, divisors = _forward_plans(
        n, chunk_rows, vocab, stride_l, ignore_index, flags, reduction, dtypes, device,
        after_chunk is not None and n > chunk_rows,
    )  # fmt: skip
    z_arg = z if return_z else loss
    if divisors is not None:
        divisors.launch(stats_ptr=stats, target_ptr=target, weight_ptr=weight_arg, out_ptr=loss, z_ptr=z_arg)
    # One chunk alive at a time: each is dropped before the next one's GEMM (a zip over the chunks would
    # hold the last one in its reused result tuple while making the next).
    chunks = iter(chunks)
    last = len(plans) - 1
    for i, plan in enumerate(plans):
        logits = next(chunks)
        plan.launch(
            logits_ptr=logits, target_ptr=target, weight_ptr=weight_arg, loss_ptr=loss, z_ptr=z_arg,
            stats_ptr=stats, smoothing=smoothing, softcap=softcap, z_scale=z_scale,
        )  # fmt: skip
        if i == last and reduce is not None:
            reduce.launch(
                stats_ptr=stats, target_ptr=target, weight_ptr=weight_arg, out_ptr=loss, z_ptr=z_arg
            )  # fmt: skip
        if after_chunk is not None:
            after_chunk(i, logits, stats)
        del logits
    return loss, z, stats


def _dlogits(
    plan, logits, dlogits, rows, target, class_weight, stats, grad, g_rows, ignore_index, smoothing, softcap,
    z_scale,
):  # fmt: skip
    """d loss / d logits of one chunk into ``dlogits``: the kernel (``plan``), or PyTorch (``g_rows``: the
    per-row gradients of the fallback); returns the gradient tensor."""
    if plan is not None:
        weight_arg = class_weight if class_weight is not None else stats
        plan.launch(
            logits_ptr=logits, dlogits_ptr=dlogits, target_ptr=target, weight_ptr=weight_arg, stats_ptr=stats,
            grad_ptr=grad, smoothing=smoothing, softcap=softcap, z_scale=z_scale,
        )  # fmt: skip
        return dlogits
    g_ce, g_z = g_rows
    n = target.shape[0]
    return _dlogits_torch(logits, target[rows], class_weight, stats[:n][rows], stats[n : 2 * n][rows],
                          g_ce[rows], g_z[rows], ignore_index, smoothing, softcap, z_scale)  # fmt: skip


def _backward_setup(grad, n, vocab, strides, target, class_weight, stats, ignore_index, softcap, z_scale,
                    chunk_rows, reduction, dtypes, device):  # fmt: skip
    """(plans or None per chunk, the fallback's per-row gradients or None)."""
    reduced = reduction != "none"
    has_z = z_scale > 0
    sizes = _chunk_sizes(n, chunk_rows)
    if runtime.triton_runs_on(device):
        flags = (softcap > 0, class_weight is not None, has_z)
        plans = _backward_plans(n, chunk_rows, vocab, strides, ignore_index, flags, reduced, dtypes, device)
        return plans, None
    return (None,) * len(sizes), _torch_row_gradients(grad, stats, n, reduced, has_z)


def linear_forward(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    class_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float, softcap: float,
    z_scale: float, chunk_rows: int, reduction: str, loss_dtype: torch.dtype, return_z: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(loss, z-loss, stats) of ``cross_entropy(hidden @ weight.T + bias, target)``, chunk by chunk; reports
    its work. loss and z-loss (empty unless ``return_z``) in ``loss_dtype``, ``[N]`` for ``reduction="none"``,
    else scalars; stats as the kernels' section says."""
    n, vocab = hidden.shape[0], weight.shape[0]
    target = target.contiguous()
    if n:
        runtime.report_work("fused_linear_cross_entropy", hidden=hidden, weight=weight)
    sizes = _chunk_sizes(n, chunk_rows) if n else ()
    weight_t = weight.t()
    chunks = (_chunk_logits(h, weight_t, bias) for h in (_row_chunks(hidden, sizes) if n else ()))
    return _forward(
        chunks, n, vocab, vocab, hidden.dtype, target, class_weight, ignore_index, label_smoothing, softcap,
        z_scale, chunk_rows, reduction, loss_dtype, return_z, hidden.device,
    )  # fmt: skip


def _zero_bias_grad(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A dbias no row contributes to: zeros of ``[vocab]``, or without a bias an empty tensor (the autograd
    node returns None for it: no memset of ``[vocab]`` per backward)."""
    return weight.new_empty(0) if bias is None else weight.new_zeros((weight.shape[0],))


def linear_backward(
    grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    bias: torch.Tensor | None, class_weight: torch.Tensor | None, stats: torch.Tensor, ignore_index: int,
    label_smoothing: float, softcap: float, z_scale: float, chunk_rows: int, reduction: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dhidden, dweight, dbias) of :func:`linear_forward` for the gradient ``grad`` of its loss; reports its
    work. Without a bias, dbias is an empty tensor (nobody reads it: no memset of ``[vocab]``)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    target = target.contiguous()
    if n:
        runtime.report_work("fused_linear_cross_entropy_backward", hidden=hidden, weight=weight)
    dhidden = tensors.new_output(hidden.shape, hidden.dtype, device)
    if n == 0:
        return dhidden, torch.zeros_like(weight), _zero_bias_grad(weight, bias)
    sizes = _chunk_sizes(n, chunk_rows)
    stride_g = 0 if reduction != "none" else grad.stride(0)
    dtypes = (hidden.dtype, hidden.dtype, target.dtype, None if class_weight is None else class_weight.dtype,
              grad.dtype)  # fmt: skip
    plans, g_rows = _backward_setup(
        grad, n, vocab, (vocab, vocab, stride_g), target, class_weight, stats, ignore_index, softcap, z_scale,
        chunk_rows, reduction, dtypes, device,
    )  # fmt: skip
    dweight = dbias = None
    weight_t = weight.t()
    for i, (h, dh) in enumerate(zip(_row_chunks(hidden, sizes), _row_chunks(dhidden, sizes), strict=True)):
        logits = _chunk_logits(h, weight_t, bias)
        rows = slice(i * chunk_rows, i * chunk_rows + sizes[i])
        dlogits = _dlogits(plans[i], logits, logits, rows, target, class_weight, stats, grad, g_rows,
                           ignore_index, label_smoothing, softcap, z_scale)  # fmt: skip
        torch.mm(dlogits, weight, out=dh)
        # accumulated in weight's dtype, one GEMM epilogue per chunk (fp32 inside, rounded once), like Liger
        dweight = torch.mm(dlogits.t(), h) if dweight is None else dweight.addmm_(dlogits.t(), h)
        if bias is not None:
            part = dlogits.sum(0, dtype=torch.float32)
            dbias = part if dbias is None else dbias.add_(part)
        del logits, dlogits  # before the next chunk's GEMM (else two chunks are alive at it)
    return dhidden, dweight, _zero_bias_grad(weight, bias) if bias is None else dbias.to(weight.dtype)


def linear_forward_grads(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    class_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float, softcap: float,
    z_scale: float, chunk_rows: int, reduction: str, loss_dtype: torch.dtype, return_z: bool,
    need_dhidden: bool, need_dweight: bool, need_dbias: bool,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(loss, z-loss, stats, dhidden, dweight, dbias): :func:`linear_forward`'s three, and for a reduced loss
    the gradients asked for (``need_*``) of a loss gradient of 1, made chunk by chunk while each chunk's
    logits exist (three GEMMs a chunk, where :func:`linear_forward` then :func:`linear_backward` take four:
    the backward makes the logits again); :func:`scale_grads` turns them into the gradients of the loss
    gradient. A gradient not asked for is an empty tensor and costs no GEMM; dbias is float32. Reports its
    work."""
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    if (need_dhidden or need_dweight or need_dbias) and reduction == "none":
        raise ValueError(
            "need_dhidden, need_dweight, need_dbias: the forward makes the gradients of a reduced loss only "
            "('mean' or 'sum'); reduction='none' takes its per-row gradient in the backward"
        )
    if not (need_dhidden or need_dweight or need_dbias):  # the plain forward (any reduction)
        loss = linear_forward(hidden, weight, target, bias, class_weight, ignore_index, label_smoothing,
                              softcap, z_scale, chunk_rows, reduction, loss_dtype, return_z)  # fmt: skip
        return (*loss, hidden.new_empty(0), weight.new_empty(0), weight.new_empty(0, dtype=torch.float32))
    target = target.contiguous()
    if n == 0 or not runtime.triton_runs_on(device):
        # nothing to chunk, or the PyTorch fallback: the forward, then the backward of a loss gradient of 1
        loss, z, stats = linear_forward(
            hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap, z_scale,
            chunk_rows, reduction, loss_dtype, return_z,
        )  # fmt: skip
        one = torch.ones((), dtype=loss_dtype, device=device)
        dhidden, dweight, dbias = linear_backward(
            one, hidden, weight, target, bias, class_weight, stats, ignore_index, label_smoothing, softcap,
            z_scale, chunk_rows, reduction,
        )  # fmt: skip
        return (loss, z, stats, dhidden if need_dhidden else hidden.new_empty(0),
                dweight if need_dweight else weight.new_empty(0),
                dbias.float() if need_dbias else weight.new_empty(0, dtype=torch.float32))  # fmt: skip
    runtime.report_work(
        "fused_linear_cross_entropy", hidden=hidden, weight=weight, gradients=(need_dhidden, need_dweight)
    )  # fmt: skip
    sizes = _chunk_sizes(n, chunk_rows)
    flags = (softcap > 0, class_weight is not None, z_scale > 0)
    dtypes = (hidden.dtype, hidden.dtype, target.dtype, None if class_weight is None else class_weight.dtype,
              torch.float32)  # fmt: skip
    plans = _backward_plans(
        n, chunk_rows, vocab, (vocab, vocab, 0), ignore_index, flags, True, dtypes, device, unit_grad=True
    )  # fmt: skip
    hidden_rows = _row_chunks(hidden, sizes)
    dhidden = tensors.new_output(hidden.shape, hidden.dtype, device) if need_dhidden else hidden.new_empty(0)
    dhidden_rows = _row_chunks(dhidden, sizes) if need_dhidden else None
    summed = [None, None]  # dweight, dbias: the first chunk's product, then the sum so far

    def gradients(i, logits, stats):
        # d loss / d logits in place of the logits (grad_ptr unread: UNIT_GRAD)
        _dlogits(plans[i], logits, logits, None, target, class_weight, stats, stats, None, ignore_index,
                 label_smoothing, softcap, z_scale)  # fmt: skip
        if need_dhidden:
            torch.mm(logits, weight, out=dhidden_rows[i])
        if need_dweight:  # in weight's dtype, one GEMM epilogue a chunk, as linear_backward
            h = hidden_rows[i]
            summed[0] = torch.mm(logits.t(), h) if summed[0] is None else summed[0].addmm_(logits.t(), h)
        if need_dbias:
            part = logits.sum(0, dtype=torch.float32)
            summed[1] = part if summed[1] is None else summed[1].add_(part)

    weight_t = weight.t()
    chunks = (_chunk_logits(h, weight_t, bias) for h in hidden_rows)
    loss, z, stats = _forward(
        chunks, n, vocab, vocab, hidden.dtype, target, class_weight, ignore_index, label_smoothing, softcap,
        z_scale, chunk_rows, reduction, loss_dtype, return_z, device, after_chunk=gradients,
    )  # fmt: skip
    dweight = summed[0] if need_dweight else weight.new_empty(0)
    dbias = summed[1] if need_dbias else weight.new_empty(0, dtype=torch.float32)
    return loss, z, stats, dhidden, dweight, dbias


@plan_cache
def _scale_plan(numel: int, dtypes: tuple, device: torch.device) -> Plan:
    """The scaling of ``numel`` elements (the elementwise ops' blocks: :func:`llm_speed.fused.swiglu.config`);
    dtypes: in, out."""
    cfg = elementwise_config(numel)
    return SCALE.plan(
        (cdiv(numel, cfg.block_n),), numel=numel, BLOCK=cfg.block_n, RNE_BY_HAND=rne_by_hand(dtypes[1]),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _scaled(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x * grad (float32 maths, one rounding to out's dtype); out may be x."""
    if x.numel() == 0:
        return out
    if runtime.triton_runs_on(x.device):
        _scale_plan(x.numel(), (x.dtype, out.dtype), x.device).launch(x_ptr=x, out_ptr=out, grad_ptr=grad)
    else:
        out.copy_(x.float() * grad.float())
    return out


def scale_grads(
    grad: torch.Tensor, dhidden: torch.Tensor, dweight: torch.Tensor, dbias: torch.Tensor,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dhidden, dweight, dbias) of :func:`linear_forward_grads` times the loss gradient ``grad`` (a scalar),
    in float32 maths rounded once: new tensors, or (``in_place``) dhidden and dweight themselves; dbias (kept
    in float32) in weight's dtype, as :func:`linear_backward` gives it. Empty tensors (gradients not needed)
    stay empty. Reports its work."""
    runtime.report_work("fused_linear_cross_entropy_backward", scaled=(dhidden, dweight, dbias))
    device = dweight.device

    def out(x, dtype):
        return x if in_place and dtype == x.dtype else tensors.new_output(x.shape, dtype, device)

    return (_scaled(grad, dhidden, out(dhidden, dhidden.dtype)),
            _scaled(grad, dweight, out(dweight, dweight.dtype)),
            _scaled(grad, dbias, out(dbias, dweight.dtype)))  # fmt: skip


def forward(
    logits: torch.Tensor, target: torch.Tensor, class_weight: torch.Tensor | None, ignore_index: int,
    label_smoothing: float, softcap: float, z_scale: float, reduction: str, loss_dtype: torch.dtype,
    return_z: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(loss, z-loss, stats) of ``cross_entropy(logits, target)`` (logits ``[N, V]``, last dim contiguous) in
    one launch over the rows (and one for a reduction); reports its work."""
    n, vocab = logits.shape
    target = target.contiguous()
    if n:
        runtime.report_work("cross_entropy", logits=logits)
    return _forward(
        (logits,) if n else (), n, vocab, logits.stride(0), logits.dtype, target, class_weight, ignore_index,
        label_smoothing, softcap, z_scale, max(n, 1), reduction, loss_dtype, return_z, logits.device,
    )  # fmt: skip


def backward(
    grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, class_weight: torch.Tensor | None,
    stats: torch.Tensor, ignore_index: int, label_smoothing: float, softcap: float, z_scale: float,
    reduction: str,
) -> torch.Tensor:  # fmt: skip
    """d loss / d logits of :func:`forward`, a new contiguous tensor in logits' dtype; reports its work."""
    n, vocab = logits.shape
    device = logits.device
    target = target.contiguous()
    if n:
        runtime.report_work("cross_entropy_backward", logits=logits)
    dlogits = tensors.new_output((n, vocab), logits.dtype, device)
    if n == 0:
        return dlogits
    stride_g = 0 if reduction != "none" else grad.stride(0)
    dtypes = (logits.dtype, logits.dtype, target.dtype, None if class_weight is None else class_weight.dtype,
              grad.dtype)  # fmt: skip
    plans, g_rows = _backward_setup(
        grad, n, vocab, (logits.stride(0), vocab, stride_g), target, class_weight, stats, ignore_index,
        softcap, z_scale, n, reduction, dtypes, device,
    )  # fmt: skip
    out = _dlogits(plans[0], logits, dlogits, slice(0, n), target, class_weight, stats, grad, g_rows,
                   ignore_index, label_smoothing, softcap, z_scale)  # fmt: skip
    if out is not dlogits:
        dlogits.copy_(out)
    return dlogits


# --- op registration ------------------------------------------------------------------------------------


def _loss_fake(n, reduced, return_z, loss_dtype, like, z_scale):
    loss = like.new_empty(() if reduced else (n,), dtype=loss_dtype)
    z = like.new_empty((() if reduced else (n,)) if return_z else (0,), dtype=loss_dtype)
    stats = like.new_empty((stats_size(n, reduced, z_scale > 0),), dtype=torch.float32)
    return loss, z, stats


@torch.library.custom_op("llm_speed::fused_linear_cross_entropy_forward", mutates_args=())
def _linear_forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_scale: float,
    chunk_rows: int,
    reduction: str,
    loss_dtype: torch.dtype,
    return_z: bool,
    need_dhidden: bool,
    need_dweight: bool,
    need_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return linear_forward_grads(
        hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap, z_scale,
        chunk_rows, reduction, loss_dtype, return_z, need_dhidden, need_dweight, need_dbias,
    )  # fmt: skip


@_linear_forward_op.register_fake
def _linear_forward_fake(hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap,
                         z_scale, chunk_rows, reduction, loss_dtype, return_z, need_dhidden, need_dweight,
                         need_dbias):  # fmt: skip
    loss = _loss_fake(hidden.shape[0], reduction != "none", return_z, loss_dtype, hidden, z_scale)
    dhidden = torch.empty_like(hidden) if need_dhidden else hidden.new_empty(0)
    dweight = torch.empty_like(weight) if need_dweight else weight.new_empty(0)
    dbias = weight.new_empty((weight.shape[0],) if need_dbias else (0,), dtype=torch.float32)
    return (*loss, dhidden, dweight, dbias)


@torch.library.custom_op("llm_speed::fused_linear_cross_entropy_backward", mutates_args=())
def _linear_backward_op(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    stats: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_scale: float,
    chunk_rows: int,
    reduction: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return linear_backward(
        grad, hidden, weight, target, bias, class_weight, stats, ignore_index, label_smoothing, softcap,
        z_scale, chunk_rows, reduction,
    )  # fmt: skip


@_linear_backward_op.register_fake
def _linear_backward_fake(grad, hidden, weight, target, bias, *_):
    return torch.empty_like(hidden), torch.empty_like(weight), _zero_bias_grad(weight, bias)


@torch.library.custom_op("llm_speed::fused_linear_cross_entropy_scale_grads", mutates_args=())
def _scale_grads_op(
    grad: torch.Tensor, dhidden: torch.Tensor, dweight: torch.Tensor, dbias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return scale_grads(grad, dhidden, dweight, dbias)


@_scale_grads_op.register_fake
def _scale_grads_fake(grad, dhidden, dweight, dbias):
    dbias = dbias.new_empty(dbias.shape, dtype=dweight.dtype)
    return torch.empty_like(dhidden), torch.empty_like(dweight), dbias


@torch.library.custom_op("llm_speed::cross_entropy_forward", mutates_args=())
def _forward_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_scale: float,
    reduction: str,
    loss_dtype: torch.dtype,
    return_z: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return forward(
        logits, target, class_weight, ignore_index, label_smoothing, softcap, z_scale, reduction, loss_dtype,
        return_z,
    )  # fmt: skip


@_forward_op.register_fake
def _forward_fake(logits, target, class_weight, ignore_index, label_smoothing, softcap, z_scale, reduction,
                  loss_dtype, return_z):  # fmt: skip
    return _loss_fake(logits.shape[0], reduction != "none", return_z, loss_dtype, logits, z_scale)


@torch.library.custom_op("llm_speed::cross_entropy_backward", mutates_args=())
def _backward_op(
    grad: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    stats: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_scale: float,
    reduction: str,
) -> torch.Tensor:
    return backward(
        grad, logits, target, class_weight, stats, ignore_index, label_smoothing, softcap, z_scale, reduction
    )


@_backward_op.register_fake
def _backward_fake(grad, logits, *_):
    return logits.new_empty(logits.shape)


# Under torch.autocast (core.autocast): the head's GEMMs take the autocast dtype, as F.linear would; the loss
# reads any dtype and computes in float32; the backward runs in the dtypes the forward saved.
_linear_backward_call = autocast.dispatch(Op(_linear_backward_op, linear_backward), autocast.KEEP)
_scale_grads_call = autocast.dispatch(Op(_scale_grads_op, scale_grads), autocast.KEEP)
_backward_call = autocast.dispatch(Op(_backward_op, backward), autocast.KEEP)


# --- autograd -------------------------------------------------------------------------------------------


def _linear_setup_context(ctx, inputs, output):
    hidden, weight, target, bias, class_weight, ignore_index, smoothing, softcap, z_scale, chunk_rows, \
        reduction, _loss_dtype, _return_z, *needs = inputs  # fmt: skip
    ctx.mark_non_differentiable(*output[1:])
    ctx.args = (ignore_index, smoothing, softcap, z_scale, chunk_rows, reduction)
    grads = output[3:] if any(needs) else None  # the gradients made in the forward (a reduced loss)
    if grads is None or all(type(t) is torch.Tensor for t in grads):
        # Eager: the gradients are kept for one backward, which scales them in place and hands them over (no
        # copy of the head's gradient); a second backward (retain_graph) makes them again from the inputs.
        ctx.save_for_backward(hidden, weight, target, bias, class_weight, output[2])
        ctx.grads = grads
    else:  # traced (torch.compile, opcheck): saved, scaled into new tensors (the tracer's functional rule)
        ctx.save_for_backward(hidden, weight, target, bias, class_weight, output[2], *grads)
        ctx.grads = None


def _linear_backward(ctx, grad, *_):
    saved = ctx.saved_tensors
    grads, ctx.grads = ctx.grads, None
    if grads is not None and plain_call(grad, *grads) == INFERENCE:
        dhidden, dweight, dbias = scale_grads(grad, *grads, in_place=True)
    elif grads is not None or len(saved) > 6:
        dhidden, dweight, dbias = _scale_grads_call(grad, *(grads or saved[6:]))
    else:  # no gradients made in the forward, or already handed over: each chunk's logits made again
        dhidden, dweight, dbias = _linear_backward_call(grad, *saved, *ctx.args)
    need = ctx.needs_input_grad
    return (dhidden if need[0] else None, dweight if need[1] else None, None,
            dbias if need[3] else None, *((None,) * 12))  # fmt: skip


def _setup_context(ctx, inputs, output):
    logits, target, class_weight, ignore_index, smoothing, softcap, z_scale, reduction, _dtype, _z = inputs
    ctx.save_for_backward(logits, target, class_weight, output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.args = (ignore_index, smoothing, softcap, z_scale, reduction)


def _backward(ctx, grad, _dz, _dstats):
    logits, target, class_weight, stats = ctx.saved_tensors
    return _backward_call(grad, logits, target, class_weight, stats, *ctx.args), *((None,) * 9)


# A checked call returns (loss, z) alone: fused_linear_cross_entropy reads nothing else.
_linear_forward_plain = Op(_linear_forward_op, linear_forward_grads, setup_context=_linear_setup_context,
                           backward=_linear_backward, checked_outputs=2)  # fmt: skip
_linear_forward_call = autocast.dispatch(_linear_forward_plain, autocast.LOWER, (0, 1, 3))
_forward_call = autocast.dispatch(
    Op(_forward_op, forward, setup_context=_setup_context, backward=_backward), autocast.KEEP
)


# --- public functions -----------------------------------------------------------------------------------


def _validate_loss(target, n, vocab, class_weight, weight_name, ignore_index, reduction, label_smoothing,
                   softcap, lse_square_scale, return_z_loss, loss_dtype):  # fmt: skip
    """The arguments both losses share, checked; returns the numbers as the ops take them."""
    check_tensor("target", target, dtypes=(torch.int64,), dims=1, what="[N]")
    if target.shape[0] != n:
        raise ValueError(f"target has {target.shape[0]} entries; the loss has {n} rows")
    if class_weight is not None:
        check_tensor(weight_name, class_weight, dims=1, what="[V] (one weight per class)")
        if class_weight.shape[0] != vocab:
            raise ValueError(f"{weight_name} has {class_weight.shape[0]} entries; it must have V = {vocab}")
    ignore_index = check_int("ignore_index", ignore_index)  # any sign: -100 by default
    check_choice("reduction", reduction, REDUCTIONS)
    label_smoothing = check_real("label_smoothing", label_smoothing, minimum=0.0, maximum=1.0)
    softcap = 0.0 if softcap is None else check_real("softcap", softcap, positive=True)
    z_scale = check_real("lse_square_scale", lse_square_scale, minimum=0.0)
    return_z_loss = check_flag("return_z_loss", return_z_loss)
    if loss_dtype not in FLOAT_DTYPES:
        raise TypeError(f"loss_dtype is {loss_dtype!r}; accepted: {dtype_names(FLOAT_DTYPES)}")
    return ignore_index, label_smoothing, softcap, z_scale, return_z_loss


def _validate_linear(hidden, weight, target, bias, ce_weight, chunk_rows, *loss_args):
    check_tensor("hidden", hidden, dims=2, what="[N, H]")
    check_tensor("weight", weight, dims=2, what="[V, H] (the nn.Linear layout)")
    if bias is not None:
        check_tensor("bias", bias, dims=1, what="[V]")
    shared = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(shared) > 1 and not autocast.enabled(hidden.device.type):  # autocast casts them to one dtype
        raise TypeError(f"hidden, weight and bias must share one dtype, got {sorted(map(str, shared))}")
    n, h = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != h:
        raise ValueError(
            f"weight is {tuple(weight.shape)}; it must be [V, H] with H = hidden's last dim ({h})"
        )
    if vocab < 1 or h < 1:
        raise ValueError(f"V ({vocab}) and H ({h}) must be at least 1")
    if bias is not None and bias.shape[0] != vocab:
        raise ValueError(f"bias has {bias.shape[0]} entries; it must have V = {vocab}")
    numbers = _validate_loss(target, n, vocab, ce_weight, "ce_weight", *loss_args)
    check_same_device(hidden=hidden, weight=weight, target=target, bias=bias, ce_weight=ce_weight)
    if chunk_rows is None:
        # Traced by torch.compile, the cached wrapper makes dynamo warn users about lru_cache (it traces the
        # function under it anyway): there the plain rule, the same number.
        rule = linear_cross_entropy_chunk_rows if torch.compiler.is_compiling() else default_chunk_rows
        chunk_rows = rule(n, h, vocab)
    return (*numbers, positive_int("chunk_rows", chunk_rows))


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ce_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
    loss_dtype: torch.dtype = torch.float32,
    chunk_rows: int | None = None,
):
    """``cross_entropy(hidden @ weight.T + bias, target)`` computed in row chunks, never holding ``[N, V]``.

    Args:
        hidden: ``[N, H]`` (flatten batch and sequence first), float16, bfloat16 or float32.
        weight: ``[V, H]``, the ``nn.Linear`` layout (an LM head's ``.weight``), hidden's dtype.
        target: int64 ``[N]``; each entry in ``[0, V)`` or ``ignore_index``. Checked before any work where
            :func:`llm_speed.core.runtime.check_values` allows reading it on the host (CPU tensors, or
            ``LLM_SPEED_CHECK_INPUTS=1``): a ValueError. Unchecked (CUDA by default), an invalid entry makes
            its row's loss NaN (so a reduced loss is NaN) and its row of the hidden gradient NaN.
        bias: optional ``[V]``, hidden's dtype.
        ce_weight: optional class weights ``[V]`` (any float dtype), ``cross_entropy``'s ``weight``
            (Liger's name: ``weight`` here is the LM head).
        ignore_index, reduction, label_smoothing, softcap, lse_square_scale, return_z_loss, loss_dtype: as
            :func:`cross_entropy`.
        chunk_rows: rows per chunk ``C``; default ``next_pow2(ceil(N / ceil(V / H)))``, a chunk of logits as
            large as ``hidden``, at least 2^16 logits and 1024 rows (:func:`default_chunk_rows`).

    Returns the loss in ``loss_dtype`` (float32 by default): a scalar, or ``[N]`` for ``reduction="none"``;
    with ``return_z_loss``, ``(loss, z_loss)``. Logits come from GEMMs in the inputs' dtype (under
    ``torch.autocast``, the autocast dtype, as ``F.linear`` would); log-sum-exp, loss and ``d loss / d
    logits`` in float32. Differentiable in hidden, weight and bias; the weight gradient is accumulated in
    weight's dtype, one GEMM per chunk. A "mean" or "sum" with grad makes the gradients in the forward (three
    GEMMs a chunk, none for a frozen input; the backward multiplies them by the loss gradient, and a second
    backward of the same graph makes them again), so they are held from the forward to the backward;
    ``"none"``'s backward makes each chunk's logits again (four GEMMs a chunk in all).

    Memory: ``O(C x V)`` beyond inputs and gradients, against at least ``2 N V`` elements unfused; for
    Llama-3-8B's head (H = 4096, V = 128256, N = 8192, bfloat16) 263 MB against 4.20 GB by
    :func:`memory_estimate` (a formula, not a measurement). Devices as :func:`llm_speed.rms_norm`.
    Reference: :func:`llm_speed.fused.reference.fused_linear_cross_entropy_reference`.
    """
    known = None  # the key of a call that _LINEAR_CALLS may serve: no bias, class weights or softcap
    if (
        bias is None and ce_weight is None and softcap is None and type(ignore_index) is int
        and type(reduction) is str and type(label_smoothing) is float and 0.0 <= label_smoothing <= 1.0
        and type(lse_square_scale) is float and 0.0 <= lse_square_scale < math.inf
        and (return_z_loss is True or return_z_loss is False) and type(loss_dtype) is torch.dtype
        and (chunk_rows is None or type(chunk_rows) is int) and (mode := plain_call(hidden, weight, target))
    ):  # fmt: skip
        known = (hidden.shape, hidden.stride(), hidden.dtype, hidden.device, weight.shape, weight.stride(),
                 weight.dtype, weight.device, target.shape, target.stride(), target.dtype, target.device,
                 ignore_index, reduction, label_smoothing, lse_square_scale, return_z_loss, loss_dtype,
                 chunk_rows)  # fmt: skip
        call = _LINEAR_CALLS.get(known)
        if call is not None:  # (the implementation checks the targets' values where it may read them)
            if call.forward_plan is not None and mode == INFERENCE:
                return call(hidden, weight, target)
            args = (hidden, weight, target, None, None, *call.numbers, reduction, loss_dtype, return_z_loss)
            if mode == INFERENCE:
                loss, z, _ = linear_forward(*args)
            else:  # with grad: the op's autograd node around its implementation
                needs = _NO_GRADS
                if reduction != "none":
                    needs = (hidden.requires_grad, weight.requires_grad, False)
                lean = call.gradient_plan is not None and (needs[0] or needs[1])  # one chunk, reduced
                run = call.forward if lean else linear_forward_grads
                loss, z = _linear_forward_plain.checked(run, *args, *needs)
            return (loss, z) if return_z_loss else loss
    ignore_index, label_smoothing, softcap, z_scale, return_z_loss, chunk_rows = _validate_linear(
        hidden, weight, target, bias, ce_weight, chunk_rows, ignore_index, reduction, label_smoothing,
        softcap, lse_square_scale, return_z_loss, loss_dtype,
    )  # fmt: skip
    args = (hidden, weight, target, bias, ce_weight, ignore_index, label_smoothing, softcap, z_scale,
            chunk_rows, reduction, loss_dtype, return_z_loss)  # fmt: skip
    needs = _NO_GRADS  # the gradients the forward makes (a reduced loss with grad: see the docstring)
    if reduction != "none" and torch.is_grad_enabled():
        needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    loss, z, *_ = _linear_forward_call(*args, *needs)
    if known is not None:
        numbers = (ignore_index, label_smoothing, softcap, z_scale, chunk_rows)
        call = _LinearCall(hidden, weight, target, numbers, reduction, loss_dtype, return_z_loss)
        _LINEAR_CALLS.put(known, call)
    return (loss, z) if return_z_loss else loss


class _LinearCall:
    """A :func:`fused_linear_cross_entropy` call without bias, class weights or softcap whose metadata passed
    every check before (:data:`_LINEAR_CALLS`): its numbers as the op takes them (ignore_index,
    label_smoothing, softcap, z_scale, chunk_rows) and, where its rows make one chunk (1 <= N <=
    chunk_rows) on a device the kernels run on, the plans of a lean path: one GEMM and the row and
    reduction kernels, and for a reduced loss with grad the gradient kernel and two GEMMs, without the
    chunk loop's machinery or a plan lookup (host time on the development CPU, launch stubbed, 8 x 16 x 64:
    with grad 40-46 -> 28.5-31 us, inference 14.5 -> 12.4 us; docs/guides/host-path.md). The same launches,
    GEMMs and dtypes as the chunk loop: bit for bit its results."""

    __slots__ = ("numbers", "loss_dtype", "return_z", "loss_shape", "device", "forward_plan", "reduce_plan",
                 "gradient_plan", "stats_size")  # fmt: skip

    def __init__(self, hidden, weight, target, numbers, reduction, loss_dtype, return_z):
        ignore_index, _, softcap, z_scale, chunk_rows = numbers
        n, vocab = hidden.shape[0], weight.shape[0]
        reduced = reduction != "none"
        self.numbers, self.loss_dtype, self.return_z = numbers, loss_dtype, return_z
        self.loss_shape = () if reduced else (n,)
        self.device = device = hidden.device
        self.forward_plan = self.reduce_plan = self.gradient_plan = None
        if not (0 < n <= chunk_rows and runtime.triton_runs_on(device)):
            return
        has_z = z_scale > 0
        _, (self.forward_plan,), self.reduce_plan, _ = _forward_plans(
            n, chunk_rows, vocab, vocab, ignore_index, (softcap > 0, False, has_z, return_z), reduction,
            (hidden.dtype, target.dtype, None, loss_dtype), device,
        )  # fmt: skip
        if reduced:  # the gradients read the divisors the reduction leaves in stats
            dtypes = (hidden.dtype, hidden.dtype, target.dtype, None, torch.float32)
            (self.gradient_plan,) = _backward_plans(
                n, chunk_rows, vocab, (vocab, vocab, 0), ignore_index, (softcap > 0, False, has_z), True,
                dtypes, device, unit_grad=True,
            )  # fmt: skip
        self.stats_size = stats_size(n, reduced, has_z)

    def _loss(self, hidden, weight, target, z_alone):
        """(loss, z, stats, logits); z the loss itself unless asked for or ``z_alone``."""
        ignore_index, smoothing, softcap, z_scale, _ = self.numbers
        device = self.device
        if runtime.check_values(device):
            _check_targets(target, weight.shape[0], ignore_index)
        stats = tensors.new_output((self.stats_size,), torch.float32, device)
        loss = tensors.new_output(self.loss_shape, self.loss_dtype, device)
        z = z_arg = loss  # (z_ptr: the loss when unasked, as _forward)
        if self.return_z:
            z = z_arg = tensors.new_output(loss.shape, self.loss_dtype, device)
        elif z_alone:
            z = tensors.new_output((0,), self.loss_dtype, device)
        logits = _chunk_logits(hidden, weight.t(), None)
        self.forward_plan.launch(
            logits_ptr=logits, target_ptr=target, weight_ptr=stats, loss_ptr=loss, z_ptr=z_arg,
            stats_ptr=stats, smoothing=smoothing, softcap=softcap, z_scale=z_scale,
        )  # fmt: skip
        if self.reduce_plan is not None:
            self.reduce_plan.launch(
                stats_ptr=stats, target_ptr=target, weight_ptr=stats, out_ptr=loss, z_ptr=z_arg
            )  # fmt: skip
        return loss, z, stats, logits

    def __call__(self, hidden, weight, target):
        """:func:`linear_forward`'s loss (with ``return_z``, (loss, z-loss)): the inference call."""
        runtime.report_work("fused_linear_cross_entropy", hidden=hidden, weight=weight)
        loss, z, _, _ = self._loss(hidden, weight, target.contiguous(), False)
        return (loss, z) if self.return_z else loss

    def forward(self, hidden, weight, target, bias, class_weight, *args):
        """:func:`linear_forward_grads` of a reduced loss with a gradient asked for (the op's arguments;
        without a bias never ``need_dbias``)."""
        need_dhidden, need_dweight, _ = args[-3:]
        ignore_index, smoothing, softcap, z_scale, _ = self.numbers
        runtime.report_work(
            "fused_linear_cross_entropy", hidden=hidden, weight=weight, gradients=(need_dhidden, need_dweight)
        )  # fmt: skip
        target = target.contiguous()
        loss, z, stats, logits = self._loss(hidden, weight, target, True)
        # d loss / d logits in place of the logits (grad_ptr unread: UNIT_GRAD), then its two GEMMs
        _dlogits(self.gradient_plan, logits, logits, None, target, None, stats, stats, None, ignore_index,
                 smoothing, softcap, z_scale)  # fmt: skip
        dhidden = torch.mm(logits, weight) if need_dhidden else hidden.new_empty(0)
        dweight = torch.mm(logits.t(), hidden) if need_dweight else weight.new_empty(0)
        return loss, z, stats, dhidden, dweight, weight.new_empty(0, dtype=torch.float32)


_NO_GRADS = (False, False, False)
# fused_linear_cross_entropy calls already checked, by what the checks read: a repeated call goes straight to
# the implementation or the lean one-chunk path (with grad inside the op's autograd node).
_LINEAR_CALLS = CallCache()


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
    loss_dtype: torch.dtype = torch.float32,
):
    """``torch.nn.functional.cross_entropy(logits, target)`` in Triton, with a z-loss and a logit softcap.

    Args:
        logits: ``[N, V]``, float16, bfloat16 or float32, any row stride (a non-contiguous last dim is
            copied).
            Read in place, never upcast: the maths is float32 whatever the dtype.
        target: int64 ``[N]``, each entry in ``[0, V)`` or ``ignore_index`` (checked as
            :func:`fused_linear_cross_entropy` says).
        weight: optional class weights ``[V]`` (any float dtype), as PyTorch's: row i counts ``weight[t_i]``
            times, and ``"mean"`` divides by the sum of the weights of the rows not ignored; with label
            smoothing the smoothing term weighs class j by ``weight[j]`` (PyTorch's definition).
        ignore_index: rows with this target add nothing to the loss or the gradients.
        reduction: ``"mean"`` (over the rows not ignored; weighted as above), ``"sum"``, or ``"none"``
            (``[N]``, 0 at ignored rows; differentiable with any output gradient). **A "mean" whose divisor
            is 0 (every row ignored, or N = 0) gives loss 0 and zero gradients**, where PyTorch gives NaN (0 /
            0).
        label_smoothing: in ``[0, 1]``, as ``torch.nn.functional.cross_entropy`` defines it.
        softcap: ``None`` or ``c > 0``: logits become ``c * tanh(logits / c)`` first (Gemma-2's final logit
            softcapping), with the accurate float32 tanh of :mod:`llm_speed.core.kernel_math`.
        lse_square_scale: z-loss weight ``s >= 0``: each row not ignored adds ``s * lse^2`` (``lse`` the
            log-sum-exp of its logits; PaLM's auxiliary loss, Liger's ``lse_square_scale``), unweighted by
            class weights; ``"mean"`` divides the z-loss part by the number of rows not ignored.
        return_z_loss: also return the z-loss part of the loss (reduced the same way), for logging: it is
            included in the loss and carries no gradient of its own.
        loss_dtype: the loss's dtype, float32 by default (as Hugging Face's and Liger's losses; a bfloat16
            loss keeps 3 significant digits); pass the inputs' dtype for the old behaviour.

    Returns the loss (a scalar, or ``[N]`` for ``"none"``), or ``(loss, z_loss)`` with ``return_z_loss``.
    Under ``torch.autocast`` the logits are read as they are (PyTorch's float32 policy for cross_entropy would
    upcast them first: same values, same float32 maths, without the float32 copy). The gradient comes back in
    logits' dtype, computed in float32. Devices as :func:`llm_speed.rms_norm`. One launch over the rows each
    way, plus one for a "mean" or "sum". Reference: :func:`llm_speed.fused.reference.cross_entropy_reference`.
    """
    check_tensor("logits", logits, dims=2, what="[N, V]")
    n, vocab = logits.shape
    if vocab < 1:
        raise ValueError(f"logits must have at least 1 class (V = {vocab})")
    ignore_index, label_smoothing, softcap, z_scale, return_z_loss = _validate_loss(
        target, n, vocab, weight, "weight", ignore_index, reduction, label_smoothing, softcap,
        lse_square_scale, return_z_loss, loss_dtype,
    )  # fmt: skip
    check_same_device(logits=logits, target=target, weight=weight)
    logits = tensors.last_dim_contiguous(logits)
    loss, z, _ = _forward_call(
        logits, target, weight, ignore_index, label_smoothing, softcap, z_scale, reduction, loss_dtype,
        return_z_loss,
    )  # fmt: skip
    return (loss, z) if return_z_loss else loss
