"""The attention backward kernels: the preprocess (delta = rowsum(dO * O)), dK/dV (dQ by atomics or
not), dQ, and the dQ conversion. Conventions: :mod:`llm_speed.attention.flash`."""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.kernel_math import LOG2E, cast, dot
from ..core.launch import (
    Kernel,
)
from .blocks import (
    add_rows,
    alibi_bias,
    capped_scores,
    desc_origin,
    dropout_keep,
    key_ranges,
    load_parts,
    load_rng,
    load_rows,
    load_slope2,
    load_vector,
    program_block,
    query_ranges,
    store_rows,
    store_vector,
    visible_mask,
)


@triton.jit
def _flash_bwd_preprocess_kernel(
    O,
    DO,
    LSE,
    DLSE,
    DELTA,
    LSE2,
    DQ_ACC,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_lb,
    stride_lh,
    heads_q,
    seq_q,
    head_dim,
    HAS_DLSE: tl.constexpr,
    ZERO_DQ: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_D: tl.constexpr,
    ROWS32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """delta_i = sum_d dO_id * O_id - dLSE_i, the per-row term of the softmax backward (fp32), and the saved
    LSE in base 2 (:func:`_load_lse2`) into ``LSE2``, which the dK/dV and dQ kernels read as it is: the dK/dV
    kernel reloads it per query block, where the conversion cost 43-68 SASS instructions a block on sm_90a
    (FlashAttention-3's preprocess makes the same copy, hopper/flash_bwd_preprocess_kernel.h). With
    ``ZERO_DQ`` it also zeroes the same rows of the fp32 dQ accumulator the dK/dV kernel adds to (one launch
    fewer than a separate fill).

    Packed sequences run it as one batch of ``total_q`` rows: the rows are independent. With an LSE
    gradient: d lse_i / d s_ij = P_ij, so it folds into delta with a minus sign.
    """
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(seq_q, BLOCK_M)
    bh = pid // n_blocks
    b = (bh // heads_q).to(tl.int64)
    h = (bh % heads_q).to(tl.int64)
    o_m = (pid % n_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    p_o = O + b * stride_ob + h * stride_oh
    p_do = DO + b * stride_dob + h * stride_doh
    b_o = load_rows(p_o, o_m, stride_om, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                     ROWS32=ROWS32)  # fmt: skip
    b_do = load_rows(p_do, o_m, stride_dom, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                      ROWS32=ROWS32)  # fmt: skip
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [BM]
    o_row = b * stride_lb + h * stride_lh
    if HAS_DLSE:
        b_delta -= load_vector(DLSE + o_row, o_m, seq_q, EVEN_ROWS=EVEN_M)
    store_vector(DELTA + o_row, b_delta, o_m, seq_q, EVEN_ROWS=EVEN_M)
    b_lse2 = _load_lse2(LSE + o_row, o_m, seq_q, EVEN_M=EVEN_M)
    store_vector(LSE2 + o_row, b_lse2, o_m, seq_q, EVEN_ROWS=EVEN_M)
    if ZERO_DQ:
        p_dq = DQ_ACC + b * stride_dqb + h * stride_dqh
        b_zero = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        store_rows(p_dq, b_zero, o_m, stride_dqm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                    ROWS32=ROWS32)  # fmt: skip


@triton.jit
def _probabilities(
    b_qk,
    r_m,
    c_n,
    b_lse2,
    seq_q,
    seq_kv,
    scale,
    softcap,
    window_left,
    window_right,
    slope2,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """Recompute P = exp2(s2 - lse2) of a tile of raw products ``b_qk`` and the saved base-2 LSE, and the
    factor that takes dS back through the cap (1 - tanh^2, or 1 without a cap). Either orientation: [BM, BN]
    (the dQ kernel: ``r_m = o_m[:, None]``, ``c_n = o_n[None, :]``, ``b_lse2 = lse2[:, None]``) or its
    transpose [BN, BM] (the dK/dV kernel: the same indices and LSE the other way round).

    ``MASKED``: entries outside the sequences or the window are set to 0. Unmasked tiles hold only visible
    keys; their rows past seq_q (zero Q, dO, LSE and delta) contribute exact zeros.
    """
    b_s, b_t = capped_scores(b_qk, scale, softcap, SOFTCAP=SOFTCAP)
    if HAS_ALIBI:
        b_s += alibi_bias(r_m, c_n, seq_q, seq_kv, slope2)
    # P <= 1, as a probability is: at huge scaled scores (|s| ~ 1e8 and up) this recomputed s and the saved
    # LSE round apart by more than 1, and exp2 of the difference was inf (dV inf, dQ/dK NaN). The min before
    # the exp2 (one FMNMX per element) kept the Gluon backward free of spills, the min after it did not.
    b_p = tl.exp2(tl.minimum(b_s - b_lse2, 0.0))
    if MASKED:
        m_visible = visible_mask(
            r_m, c_n, seq_q, seq_kv, window_left, window_right,
            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, EVEN_M=EVEN_M, EVEN_N=EVEN_N,
        )  # fmt: skip
        b_p = tl.where(m_visible, b_p, 0.0)
    if SOFTCAP:
        return b_p, 1.0 - b_t * b_t
    else:
        return b_p, 1.0


@triton.jit
def _load_lse2(p_lse, o_m, seq_q, EVEN_M: tl.constexpr):
    """Saved LSE in base 2; rows that saw no key (-inf) become 0 so exp2 never sees -inf - -inf."""
    b_lse = load_vector(p_lse, o_m, seq_q, EVEN_ROWS=EVEN_M)
    return tl.where(b_lse == float("-inf"), 0.0, b_lse * LOG2E)


@triton.jit
def _dkdv_over_queries(
    b_dk,
    b_dv,
    b_k,
    b_v,
    p_q,
    p_do,
    p_lse2,
    p_delta,
    p_dq,
    dq_desc,
    q_desc,
    do_desc,
    desc_at,
    o_n,
    query_start,
    query_end,
    stride_qm,
    stride_dom,
    stride_dqm,
    seq_q,
    seq_kv,
    head_dim,
    scale,
    softcap,
    window_left,
    window_right,
    slope2,
    seed,
    bh,
    rng_offset,
    dropout_p,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    ROWS32: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    DELTA_IN_ACC: tl.constexpr,
    D_HALVES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """Add the query blocks [query_start, query_end) of one query head to this key block's dK and dV, in the
    transposed orientation (FlashAttention-2's): S^T = K Q^T [BN, BM], P^T, dV += P^T dO, dP^T = V dO^T,
    dS^T = P^T * (dP^T - delta) * cap', dK += dS^T Q (scaled by the caller). ``DELTA_IN_ACC`` (not with
    ``DROPOUT``): dP^T's product starts from -delta (no pass over the tile after it, and delta's per-query
    column vector is not held across the block; see the kernel for where). Every product but dQ's then has
    the key block as its M side and reads Q and dO as they were loaded (no transpose of a register tile).
    With ``ATOMIC_DQ`` also dQ += dS K into the fp32 accumulator at ``p_dq`` (unscaled), by atomics: the
    fifth matmul, where the deterministic path recomputes S and dP in a dQ kernel of its own; with a
    descriptor ``dq_desc`` over the accumulator's rows (``desc_at``: this head's first, row and column) by one
    TMA bulk reduction per tile instead of an atomic per element. ``TMA`` (whole query blocks of a 16-bit
    problem; not with ``D_HALVES``): Q and dO come through the tensor descriptors ``q_desc`` /
    ``do_desc`` over their rows, this head's starting at ``desc_at`` (:func:`desc_origin`).

    K, Q and dK are tuples (:func:`load_parts`): the whole tile, or with ``D_HALVES`` (atomic dQ by
    element) its two halves along the head dim, as dQ's product then comes, so that dQ's product and its
    atomics take a [BM, BD / 2] tile at a time: the accumulator's registers and the shared memory its layout
    conversion passes through (to the atomics' vector layout) are halved. S^T is then two products into one
    accumulator."""
    o_dv = tl.arange(0, BLOCK_D)  # V and dO: always whole
    # With the halves, Q and dO keep 64-bit offsets (sm_90a, d = 128: 32-bit ones there too left the loop
    # at 591 SASS instructions with a spill instruction, against 635 and none; the atomics' 32-bit).
    LOADS32: tl.constexpr = ROWS32 and not D_HALVES
    for start_m in range(query_start, query_end, BLOCK_M):
        o_m = start_m + tl.arange(0, BLOCK_M)
        # [BM, BD] tiles of Q (or its halves) and dO
        if TMA:
            b_q = (q_desc.load([(desc_at[0] + start_m).to(tl.int32), desc_at[1]]),)
            b_do = do_desc.load([(desc_at[0] + start_m).to(tl.int32), desc_at[1]])
        else:
            b_q = load_parts(p_q, o_m, stride_qm, seq_q, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                              HALVES=D_HALVES, BLOCK_D=BLOCK_D, ROWS32=LOADS32)  # fmt: skip
            b_do = load_rows(p_do, o_m, stride_dom, seq_q, o_dv, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                              ROWS32=LOADS32)  # fmt: skip
        b_lse2 = load_vector(p_lse2, o_m, seq_q, EVEN_ROWS=EVEN_M)
        b_st = dot(b_k[0], tl.trans(b_q[0]), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)  # [BN, BM]
        for part in tl.static_range(1, len(b_k)):
            b_st = dot(b_k[part], tl.trans(b_q[part]), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
                       acc=b_st)  # fmt: skip
        b_pt, b_dcap = _probabilities(
            b_st, o_m[None, :], o_n[:, None], b_lse2[None, :], seq_q, seq_kv, scale, softcap, window_left,
            window_right, slope2, MASKED=MASKED, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP,
            HAS_ALIBI=HAS_ALIBI, EVEN_M=EVEN_M, EVEN_N=EVEN_N,
        )  # fmt: skip
        if DROPOUT:
            # dV takes the kept weights, dP the kept gradients, both times 1 / (1 - p); dS = P * (dP - delta)
            m_keep = dropout_keep(seed, o_m[None, :], o_n[:, None], bh, rng_offset, dropout_p)
            keep_scale = 1.0 / (1.0 - dropout_p)
            b_pt16 = cast(tl.where(m_keep, b_pt * keep_scale, 0.0), b_do.dtype, RNE_BY_HAND=RNE_BY_HAND)
        else:
            b_pt16 = cast(b_pt, b_do.dtype, RNE_BY_HAND=RNE_BY_HAND)
        if SOFTCAP:  # P * cap' now: one [BN, BM] tile held until dS instead of two
            b_pt = b_pt * b_dcap
        # dV before dP: P^T is dead before dP^T is live (fewer registers than the other order)
        b_dv += dot(b_pt16, b_do, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)  # [BN, BD]
        b_delta = load_vector(p_delta, o_m, seq_q, EVEN_ROWS=EVEN_M)
        if DELTA_IN_ACC:
            # dP^T - delta straight from the tensor cores: the accumulator starts at -delta
            b_dpt = dot(b_v, tl.trans(b_do), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
                        acc=tl.zeros_like(b_st) - b_delta[None, :])  # fmt: skip
        else:
            b_dpt = dot(b_v, tl.trans(b_do), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)  # [BN, BM]
            if DROPOUT:
                b_dpt = tl.where(m_keep, b_dpt * keep_scale, 0.0)
            b_dpt -= b_delta[None, :]
        b_dst = cast(b_pt * b_dpt, b_q[0].dtype, RNE_BY_HAND=RNE_BY_HAND)
        if D_HALVES:
            b_dk = (dot(b_dst, b_q[0], DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, acc=b_dk[0]),
                    dot(b_dst, b_q[1], DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, acc=b_dk[1]))
        else:
            b_dk = (dot(b_dst, b_q[0], DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, acc=b_dk[0]),)
        if ATOMIC_DQ:
            # [BM, BD] or, D_HALVES, each half after the other's atomics (one half's tile live at once)
            for part in tl.static_range(len(b_k)):
                b_dq = dot(tl.trans(b_dst), b_k[part], DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
                if dq_desc is not None:  # one TMA bulk reduction (backward_tma_dq_add; never in halves)
                    dq_desc.atomic_add([(desc_at[0] + start_m).to(tl.int32), desc_at[1]], b_dq)
                else:
                    o_d = part * (BLOCK_D // 2) + tl.arange(0, b_dq.shape[1])
                    add_rows(p_dq, b_dq, o_m, stride_dqm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M,
                              EVEN_D=EVEN_D, ROWS32=ROWS32)  # fmt: skip
    return b_dk, b_dv


@triton.jit
def _flash_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DK,
    DV,
    DQ,
    DQ_DESC,
    Q_DESC,
    DO_DESC,
    CU_Q,
    CU_K,
    SEQUSED_K,
    ALIBI,
    RNG,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    stride_lb,
    stride_lh,
    stride_ab,
    heads_kv,
    group,
    seq_q,
    seq_kv,
    head_dim,
    batch,
    grid_blocks,
    scale,
    softcap,
    window_left,
    window_right,
    dropout_p,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    UNIFORM: tl.constexpr,
    SEQUSED: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    ROWS32: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    D_HALVES: tl.constexpr,
    DESC_SEQ_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program = one block of BLOCK_N keys of one (sequence, kv head); it owns dK and dV for those keys.

    It walks every query head of the GQA group and every query block that can see these keys, recomputing
    P from Q, K and LSE:  dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta) * cap',  dK += dS^T Q * scale.
    Each dK/dV element is written once by one program, in a fixed order. With ``ATOMIC_DQ`` (the default
    path, FlashAttention-2's) it also adds dS K to the fp32 dQ accumulator ``DQ`` with atomics: five
    matmuls per tile in all, dQ's summation order left to the hardware; without it, ``DQ`` is not touched
    and the dQ kernel computes dQ on its own (the deterministic path). ``Q_DESC`` / ``DO_DESC`` (16-bit,
    or None): tensor descriptors over the rows of Q and dO (``DESC_SEQ_MAJOR``: of sequence-major ones;
    ``IS_VARLEN``: of packed ones), through which the query blocks' tiles are loaded
    (:func:`_dkdv_over_queries`).
    """
    start_n, b, h_kv, bos_q, seq_q, bos_k, seq_kv, valid = program_block(
        CU_Q, CU_K, SEQUSED_K, seq_q, seq_kv, heads_kv, batch, grid_blocks, 1,
        BLOCK=BLOCK_N, OVER_KEYS=True, IS_VARLEN=IS_VARLEN, SEQUSED=SEQUSED, PAGED=False, BLOCK_B=BLOCK_B,
        LPT=False, UNIFORM=UNIFORM,
    )  # fmt: skip

    o_n = start_n + tl.arange(0, BLOCK_N)
    o_dv = tl.arange(0, BLOCK_D)
    p_k = K + b * stride_kb + h_kv * stride_kh + bos_k * stride_kn
    p_v = V + b * stride_vb + h_kv * stride_vh + bos_k * stride_vn
    # K and dK: (the whole tile,) or with D_HALVES its two halves along the head dim (_dkdv_over_queries)
    b_k = load_parts(p_k, o_n, stride_kn, seq_kv, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D, HALVES=D_HALVES,
                      BLOCK_D=BLOCK_D, ROWS32=ROWS32)  # fmt: skip
    if D_HALVES:
        b_dk = (tl.zeros((BLOCK_N, BLOCK_D // 2), tl.float32), tl.zeros((BLOCK_N, BLOCK_D // 2), tl.float32))
    else:
        b_dk = (tl.zeros((BLOCK_N, BLOCK_D), tl.float32),)
    b_v = load_rows(p_v, o_n, stride_vn, seq_kv, o_dv, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D,
                     ROWS32=ROWS32)  # [BN, BD]  # fmt: skip
    b_dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)

    # A ragged last query block (packed sequences) leaves the interior for the masked edge, so that the
    # interior runs without row bounds (984 -> 865 SASS instructions at d = 128); not for float32, whose
    # FMA products spill in the loop with it (sm_89, Triton 3.6).
    WHOLE_INTERIOR: tl.constexpr = not EVEN_M and DOT_PRECISION != "ieee"
    lo, left_end, mid_lo, mid_hi, hi = query_ranges(
        start_n, seq_q, seq_kv, window_left, window_right,
        WHOLE_INTERIOR=WHOLE_INTERIOR, EVEN_N=EVEN_N, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    # dP^T starts from -delta in its accumulator where that compiles leaner (sm_90a, Triton 3.6, d = 128:
    # causal 25 -> 0 spill instructions in the loops, a window with softcap 231 -> 91 in the per-block loops,
    # the non-causal interior loop 532 -> 494 instructions); not with packed sequences (d = 128: their
    # interior loop's spill instructions 1 -> 57; float32 at d = 64: 128 -> 248 registers), nor with dropout
    # (its mask applies to dP before delta is subtracted).
    DELTA_IN_ACC: tl.constexpr = not IS_VARLEN and not DROPOUT
    seed, rng_offset = load_rng(RNG, DROPOUT=DROPOUT)
    for g in range(0, group):
        h = h_kv * group + g
        slope2 = load_slope2(ALIBI, b, h, stride_ab, HAS_ALIBI=HAS_ALIBI)
        bh = b * heads_kv * group + h
        p_q = Q + b * stride_qb + h * stride_qh + bos_q * stride_qm
        p_do = DO + b * stride_dob + h * stride_doh + bos_q * stride_dom
        p_lse2 = LSE2 + b * stride_lb + h * stride_lh + bos_q
        p_delta = DELTA + b * stride_lb + h * stride_lh + bos_q
        p_dq = DQ + b * stride_dqb + h * stride_dqh + bos_q * stride_dqm
        # this head's first row and column in Q's and dO's descriptors, or the (head-major) accumulator's
        desc_at = desc_origin(b, h, heads_kv * group, seq_q, head_dim, bos_q, SEQ_MAJOR=DESC_SEQ_MAJOR,
                               IS_VARLEN=IS_VARLEN)  # fmt: skip
        # The left edge (masked), the interior, the right edge (masked), in this order. Q_DESC / DO_DESC: the
        # interior's blocks are whole; the edges' only with EVEN_M (a ragged last block would read the next
        # head's rows). Pointer loads left in the causal diagonal loop beside the interior's TMA held 3 spill
        # instructions in it (sm_90a, d = 128); none with TMA in both.
        for segment in tl.static_range(3):
            b_dk, b_dv = _dkdv_over_queries(
                b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse2, p_delta, p_dq, DQ_DESC, Q_DESC, DO_DESC, desc_at,
                o_n, (lo, mid_lo, mid_hi)[segment], (left_end, mid_hi, hi)[segment], stride_qm, stride_dom,
                stride_dqm, seq_q, seq_kv, head_dim, scale, softcap, window_left, window_right, slope2, seed,
                bh, rng_offset, dropout_p, MASKED=segment != 1, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT,
                SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, DROPOUT=DROPOUT,
                EVEN_M=EVEN_M or (segment == 1 and WHOLE_INTERIOR), EVEN_N=EVEN_N, EVEN_D=EVEN_D,
                ROWS32=ROWS32, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND,
                ATOMIC_DQ=ATOMIC_DQ, DELTA_IN_ACC=DELTA_IN_ACC, D_HALVES=D_HALVES, BLOCK_M=BLOCK_M,
                BLOCK_D=BLOCK_D, TMA=Q_DESC is not None and (EVEN_M or segment == 1),
            )  # fmt: skip

    p_dk = DK + b * stride_dkb + h_kv * stride_dkh + bos_k * stride_dkn
    p_dv = DV + b * stride_dvb + h_kv * stride_dvh + bos_k * stride_dvn
    for part in tl.static_range(len(b_dk)):
        b_dk_part = b_dk[part] * scale
        if IS_VARLEN:  # a sequence with invalid bounds saw no query: NaN over its keys' gradients
            b_dk_part = tl.where(valid, b_dk_part, float("nan"))
        b_dk_part = cast(b_dk_part, DK.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
        o_d = part * (BLOCK_D // 2) + tl.arange(0, b_dk_part.shape[1])
        store_rows(p_dk, b_dk_part, o_n, stride_dkn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D,
                    ROWS32=ROWS32)  # fmt: skip
    if IS_VARLEN:
        b_dv = tl.where(valid, b_dv, float("nan"))
    b_dv = cast(b_dv, DV.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    store_rows(p_dv, b_dv, o_n, stride_dvn, seq_kv, o_dv, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D,
                ROWS32=ROWS32)  # fmt: skip


@triton.jit
def _dq_over_keys(
    b_dq,
    b_q,
    b_do,
    b_lse2,
    b_delta,
    p_k,
    p_v,
    k_desc,
    v_desc,
    desc_at,
    o_m,
    key_start,
    key_end,
    stride_kn,
    stride_vn,
    seq_q,
    seq_kv,
    head_dim,
    scale,
    softcap,
    window_left,
    window_right,
    slope2,
    seed,
    bh,
    rng_offset,
    dropout_p,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    ROWS32: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """Add keys [key_start, key_end) to dQ: dP = dO V^T, dS = P * (dP - delta) * cap', dQ += dS K. ``TMA``
    (whole key blocks of a 16-bit problem): K and V come through the tensor descriptors ``k_desc`` /
    ``v_desc`` over their rows, this (sequence, head)'s starting at ``desc_at`` (:func:`desc_origin`)."""
    o_d = tl.arange(0, BLOCK_D)
    for start_n in range(key_start, key_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        if TMA:
            b_k = k_desc.load([(desc_at[0] + start_n).to(tl.int32), desc_at[1]])
            b_v = v_desc.load([(desc_at[0] + start_n).to(tl.int32), desc_at[1]])
        else:
            # Unmasked blocks lie inside seq_kv: their loads need no row bounds either. The constexpr is
            # spelled inline: a name assigned in the loop body becomes a loop value for Triton 3.6 (compile
            # error).
            b_k = load_rows(
                p_k, o_n, stride_kn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N or not MASKED, EVEN_D=EVEN_D,
                ROWS32=ROWS32,
            )
            b_v = load_rows(
                p_v, o_n, stride_vn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N or not MASKED, EVEN_D=EVEN_D,
                ROWS32=ROWS32,
            )
        b_qk = dot(b_q, tl.trans(b_k), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        b_p, b_dcap = _probabilities(
            b_qk, o_m[:, None], o_n[None, :], b_lse2[:, None], seq_q, seq_kv, scale, softcap, window_left,
            window_right, slope2, MASKED=MASKED, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP,
            HAS_ALIBI=HAS_ALIBI, EVEN_M=EVEN_M, EVEN_N=EVEN_N,
        )  # fmt: skip
        b_dp = dot(b_do, tl.trans(b_v), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        if DROPOUT:
            m_keep = dropout_keep(seed, o_m[:, None], o_n[None, :], bh, rng_offset, dropout_p)
            b_dp = tl.where(m_keep, b_dp * (1.0 / (1.0 - dropout_p)), 0.0)
        b_ds = cast(b_p * (b_dp - b_delta[:, None]) * b_dcap, b_k.dtype, RNE_BY_HAND=RNE_BY_HAND)
        b_dq += dot(b_ds, b_k, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
    return b_dq


@triton.jit
def _flash_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE2,
    DELTA,
    DQ,
    K_DESC,
    V_DESC,
    CU_Q,
    CU_K,
    SEQUSED_K,
    ALIBI,
    RNG,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_dob,
    stride_doh,
    stride_dom,
    stride_dqb,
    stride_dqh,
    stride_dqm,
    stride_lb,
    stride_lh,
    stride_ab,
    heads_q,
    group,
    seq_q,
    seq_kv,
    head_dim,
    batch,
    grid_blocks,
    section,
    scale,
    softcap,
    window_left,
    window_right,
    dropout_p,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    UNIFORM: tl.constexpr,
    SEQUSED: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    ROWS32: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    DESC_SEQ_MAJOR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    LPT: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (sequence, query head); it owns dQ for those rows.

    Walks the visible key blocks (masking only the edge and ragged ones, as the forward does):
    dP = dO V^T, dS = P * (dP - delta) * cap', dQ += dS K * scale. Written once. ``K_DESC`` / ``V_DESC``
    (16-bit, or None): tensor descriptors over the rows of K and V (``DESC_SEQ_MAJOR``: of sequence-major
    ones; ``IS_VARLEN``: of packed ones), through which the interior loop (and with ``EVEN_N`` the edge
    loops) loads its tiles (:func:`_dq_over_keys`).
    """
    start_m, b, h, bos_q, seq_q, bos_k, seq_kv, valid = program_block(
        CU_Q, CU_K, SEQUSED_K, seq_q, seq_kv, heads_q, batch, grid_blocks, section,
        BLOCK=BLOCK_M, OVER_KEYS=False, IS_VARLEN=IS_VARLEN, SEQUSED=SEQUSED, PAGED=False, BLOCK_B=BLOCK_B,
        LPT=LPT, UNIFORM=UNIFORM,
    )  # fmt: skip
    h_kv = h // group
    slope2 = load_slope2(ALIBI, b, h, stride_ab, HAS_ALIBI=HAS_ALIBI)
    seed, rng_offset = load_rng(RNG, DROPOUT=DROPOUT)
    bh = b * heads_q + h
    kv_at = desc_origin(b, h_kv, heads_q // group, seq_kv, head_dim, bos_k, SEQ_MAJOR=DESC_SEQ_MAJOR,
                         IS_VARLEN=IS_VARLEN)  # K_DESC, V_DESC  # fmt: skip

    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    p_k = K + b * stride_kb + h_kv * stride_kh + bos_k * stride_kn
    p_v = V + b * stride_vb + h_kv * stride_vh + bos_k * stride_vn
    p_q = Q + b * stride_qb + h * stride_qh + bos_q * stride_qm
    p_do = DO + b * stride_dob + h * stride_doh + bos_q * stride_dom
    b_q = load_rows(p_q, o_m, stride_qm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                     ROWS32=ROWS32)  # fmt: skip
    b_do = load_rows(p_do, o_m, stride_dom, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                      ROWS32=ROWS32)  # fmt: skip
    b_lse2 = load_vector(LSE2 + b * stride_lb + h * stride_lh + bos_q, o_m, seq_q, EVEN_ROWS=EVEN_M)
    b_delta = load_vector(DELTA + b * stride_lb + h * stride_lh + bos_q, o_m, seq_q, EVEN_ROWS=EVEN_M)
    b_dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    lo, left_end, mid_lo, mid_hi, hi = key_ranges(
        start_m, seq_q, seq_kv, window_left, window_right,
        HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    # The left edge (masked), the interior, the right edge (masked), in this order; K_DESC / V_DESC as the
    # dK/dV kernel's Q_DESC / DO_DESC: the interior's blocks are whole, the edges' only with EVEN_N.
    for segment in tl.static_range(3):
        b_dq = _dq_over_keys(
            b_dq, b_q, b_do, b_lse2, b_delta, p_k, p_v, K_DESC, V_DESC, kv_at, o_m,
            (lo, mid_lo, mid_hi)[segment], (left_end, mid_hi, hi)[segment], stride_kn, stride_vn, seq_q,
            seq_kv, head_dim, scale, softcap, window_left, window_right, slope2, seed, bh, rng_offset,
            dropout_p, MASKED=segment != 1, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP,
            HAS_ALIBI=HAS_ALIBI, DROPOUT=DROPOUT, EVEN_M=EVEN_M, EVEN_N=EVEN_N, EVEN_D=EVEN_D, ROWS32=ROWS32,
            DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND, BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D, TMA=K_DESC is not None and (EVEN_N or segment == 1),
        )  # fmt: skip

    b_dq *= scale
    if IS_VARLEN:  # a sequence with invalid bounds saw no key: NaN over its rows' gradients
        b_dq = tl.where(valid, b_dq, float("nan"))
    b_dq = cast(b_dq, DQ.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    p_dq = DQ + b * stride_dqb + h * stride_dqh + bos_q * stride_dqm
    store_rows(p_dq, b_dq, o_m, stride_dqm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                ROWS32=ROWS32)  # fmt: skip


@triton.jit
def _flash_bwd_dq_convert_kernel(
    DQ_ACC,
    DQ,
    n,
    scale,
    EVEN: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """dQ = scale * the fp32 accumulator, in dQ's dtype: the last step of the default (atomic) backward.
    Both are contiguous and of one shape, so the kernel walks them flat."""
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        b_dq = tl.load(DQ_ACC + o) * scale
        tl.store(DQ + o, cast(b_dq, DQ.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND))
    else:
        b_dq = tl.load(DQ_ACC + o, mask=o < n, other=0.0) * scale
        tl.store(DQ + o, cast(b_dq, DQ.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=o < n)


BACKWARD_PREPROCESS = Kernel(_flash_bwd_preprocess_kernel, "flash_attention_bwd_preprocess")
BACKWARD_DKDV = Kernel(_flash_bwd_dkdv_kernel, "flash_attention_bwd_dkdv")
BACKWARD_DQ = Kernel(_flash_bwd_dq_kernel, "flash_attention_bwd_dq")
BACKWARD_DQ_CONVERT = Kernel(_flash_bwd_dq_convert_kernel, "flash_attention_bwd_dq_convert")
# The backward's two paths (``tier_dq_kernel`` chooses the default): the atomic one adds dQ from the dK/dV
# kernel (five matmuls per tile, FlashAttention-2's), then converts the fp32 accumulator; the deterministic
# one has a dQ kernel of its own (every element one writer; seven matmuls per tile: S and dP recomputed).
ATOMIC_BACKWARD_KERNELS = (BACKWARD_PREPROCESS, BACKWARD_DKDV, BACKWARD_DQ_CONVERT)
DETERMINISTIC_BACKWARD_KERNELS = (BACKWARD_PREPROCESS, BACKWARD_DKDV, BACKWARD_DQ)
