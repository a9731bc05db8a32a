"""The kernels of :mod:`llm_speed.fused.cross_entropy`: a row's loss and log-sum-exp by an online softmax over
vocabulary blocks, the reduction, the gradient of the logits, and the scaling of the fused version's
gradients. Launched by :mod:`llm_speed.fused.cross_entropy_launch`."""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.kernel_math import cast, tanh
from ..core.launch import Kernel

# A target outside [0, vocab) that is not ignore_index (possible when the host checks are off, see
# cross_entropy_launch._check_targets) is never used as an address: its row's loss and gradient become NaN.
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
    sum_z = tl.full([], 0.0, tl.float32)  # (with class weights: over the finite logits)
    sum_w = tl.full([], 0.0, tl.float32)  # sum of the class weights
    n_inf = tl.full([], 0.0, tl.float32)  # with class weights: the weights of the -inf logits
    for v0 in range(0, vocab, BLOCK_V):
        o_v = v0 + tl.arange(0, BLOCK_V)
        m_v = o_v < vocab
        b_z = tl.load(p_l + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
        if HAS_SOFTCAP:
            b_z = softcap * tanh(b_z / softcap)
        b_zm = tl.where(m_v, b_z, float("-inf"))
        m_new = tl.maximum(m, tl.max(b_zm, axis=0))
        # -inf logits (masked classes): while every logit so far is -inf the shift is 0, not -inf - -inf
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_shift) + tl.sum(tl.exp(b_zm - m_shift), axis=0)
        m = m_new
        if HAS_WEIGHT:
            finite = m_v & (b_z != float("-inf"))
            b_w = tl.load(weight_ptr + o_v, mask=m_v, other=0.0).to(tl.float32)
            sum_z += tl.sum(b_w * tl.where(finite, b_z - z_t, 0.0), axis=0)
            sum_w += tl.sum(b_w, axis=0)
            n_inf += tl.sum(tl.where(m_v & ~finite, b_w, 0.0), axis=0)
        else:  # a -inf logit makes sum_z -inf (NaN for a -inf target): told apart after the loop, no count
            sum_z += tl.sum(tl.where(m_v, b_z - z_t, 0.0), axis=0)
    log_s = tl.log(s)
    lse = m + log_s
    # F.cross_entropy per row: (1 - eps) * w_t * (lse - z_t) + eps / V * sum_j w_j (lse - z_j), with
    # lse - z_t = (m - z_t) + log_s and sum_j w_j (lse - z_j) = sum_w (lse - z_t) - sum_j w_j (z_j - z_t).
    # A -inf logit z_j makes its term +inf (PyTorch's loss is inf with smoothing), and no term without it.
    d_t = (m - z_t) + log_s
    if HAS_WEIGHT:
        w_t = tl.load(weight_ptr + t_safe).to(tl.float32)
        ce = (1.0 - smoothing) * w_t * d_t + smoothing * ((sum_w * d_t - sum_z) / vocab)
        ce = tl.where(smoothing == 0.0, w_t * d_t, ce)
        masked = n_inf > 0.0
    else:
        ce = tl.where(smoothing == 0.0, d_t, d_t - smoothing * (sum_z / vocab))
        masked = (sum_z == float("-inf")) | (d_t == float("inf"))  # a -inf logit, or a -inf target
    ce = tl.where((smoothing != 0.0) & masked & (m != float("-inf")), float("inf"), ce)
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
        ce_div = tl.where(ce_div == 0.0, float("inf"), ce_div)  # a divisor of 0: loss 0, zero gradients
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


FORWARD = Kernel(_ce_fwd_kernel, "cross_entropy_fwd")
REDUCE = Kernel(_ce_reduce_kernel, "cross_entropy_reduce")
BACKWARD = Kernel(_ce_bwd_kernel, "cross_entropy_bwd")
SCALE = Kernel(_ce_scale_kernel, "cross_entropy_scale")
