"""The attention forward kernel (flash and two-pass tiled, dense, packed, paged, fp8) and its loops over
key blocks: the one-product loop and the overlapped one. Conventions: :mod:`llm_speed.attention.flash`."""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.kernel_math import LN2, cast, dot
from ..core.launch import (
    Kernel,
)
from .blocks import (
    P8_OFFSET,
    PAGE_SCAN,
    block_scores,
    desc_origin,
    descale_in_range,
    dropout_keep,
    has_bad_page,
    key_ranges,
    kv_pages,
    load_columns,
    load_kv,
    load_rng,
    load_rows,
    load_slope2,
    negated_tile,
    online_softmax,
    program_block,
    qk,
    row_max_over_keys,
    scores_of,
    store_rows,
    store_vector,
    weights_as,
)


@triton.jit
def _accumulate_over_keys(
    b_m,
    b_l,
    b_acc,
    b_q,
    p_k,
    p_v,
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
    p_table,
    b,
    stride_tb,
    stride_tp,
    page_size,
    stride_kpage,
    stride_vpage,
    k_desc,
    v_desc,
    desc_at,
    MASKED: tl.constexpr,
    TWO_PASS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    PAGED: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    V_TRANSPOSED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS32: tl.constexpr,
    FP8_GPU_CAST: tl.constexpr,
    TMA: tl.constexpr = False,
):
    """Add keys [key_start, key_end) to the row sums ``b_l`` and the unnormalised output ``b_acc``.

    Online softmax (flash): when a key block raises the running max m, rescale l and acc by
    exp2(m_old - m_new). ``TWO_PASS`` (tiled): m is already the final row max, so nothing is rescaled.
    ``DROPOUT``: the row sums take every weight, the output only the kept ones (the caller divides by
    1 - dropout_p once at the end), as FlashAttention does. ``V_TRANSPOSED``: ``p_v`` points at V^T (keys
    contiguous, head dims ``stride_vn`` apart), loaded as [BD, BN] tiles and fed transposed to the PV product.
    ``TMA`` (the unmasked interior of a 16-bit forward, not paged): K and V come through the tensor
    descriptors ``k_desc`` / ``v_desc`` over their rows, this (sequence, head)'s starting at ``desc_at`` (row,
    column: :func:`desc_origin`).
    """
    o_d = tl.arange(0, BLOCK_D)
    for start_n in range(key_start, key_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        b_page, b_slot = kv_pages(p_table, b, o_n, seq_kv, stride_tb, stride_tp, page_size, PAGED=PAGED)
        b_raw, factor = block_scores(
            b_q, p_k, o_m, start_n, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, slope2, b_page, b_slot, stride_kpage, k_desc, desc_at, MASKED=MASKED,
            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, PAGED=PAGED,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
        )  # fmt: skip
        if TMA:
            b_v = v_desc.load([(desc_at[0] + start_n).to(tl.int32), desc_at[1]])  # [BN, BD]
        elif V_TRANSPOSED:  # a K-major B operand in shared memory, loaded by pipelined copies along the keys
            b_vt = load_columns(p_v, o_n, stride_vn, seq_kv, o_d, head_dim, EVEN_COLS=EVEN_N or not MASKED,
                                 EVEN_D=EVEN_D)  # [BD, BN]  # fmt: skip
            b_v = tl.trans(b_vt)  # [BN, BD]
        else:
            b_v = load_kv(
                p_v, o_n, stride_vn, seq_kv, o_d, head_dim, b_page, b_slot, stride_vpage,
                EVEN_ROWS=EVEN_N or not MASKED, EVEN_D=EVEN_D, PAGED=PAGED, ROWS32=ROWS32,
            )  # [BN, BD]  # fmt: skip
        if TWO_PASS:
            # Rows with no visible key keep max -inf; shift them by 0 so exp2 gives 0, not NaN.
            b_p = tl.exp2(b_raw * factor - tl.where(b_m == float("-inf"), 0.0, b_m)[:, None])  # [BM, BN]
            b_l += tl.sum(b_p, 1)
            b_p16 = cast(b_p, b_v.dtype, RNE_BY_HAND=RNE_BY_HAND)
            b_acc += dot(b_p16, b_v, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        else:
            b_p, b_alpha, b_m_new, b_l = online_softmax(b_raw, factor, b_m, b_l, FP8=b_v.dtype.is_fp8())
            if DROPOUT:
                m_keep = dropout_keep(seed, o_m[:, None], o_n[None, :], bh, rng_offset, dropout_p)
                b_p = tl.where(m_keep, b_p, 0.0)
            b_pv = weights_as(b_p, b_v.dtype, RNE_BY_HAND=RNE_BY_HAND, GPU_CAST=FP8_GPU_CAST)
            b_acc = b_acc * b_alpha[:, None] + dot(b_pv, b_v, DOT_IN_FP32=DOT_IN_FP32,
                                                   DOT_PRECISION=DOT_PRECISION)  # fmt: skip
            b_m = b_m_new
    return b_m, b_l, b_acc


@triton.jit
def _online_step(
    b_qk, b_m, b_l, o_m, start_n, seq_q, seq_kv, scale, softcap, slope2, dtype: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, RNE_BY_HAND: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """:func:`online_softmax` of one unmasked 16-bit key block's products ``b_qk``, the weights in ``dtype``
    for the PV product (no dropout)."""
    b_raw, factor = scores_of(
        b_qk, o_m, start_n, seq_q, seq_kv, scale, softcap, 0, 0, slope2, MASKED=False, HAS_LEFT=False,
        HAS_RIGHT=False, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, EVEN_N=True, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    b_p, b_alpha, b_m, b_l = online_softmax(b_raw, factor, b_m, b_l, FP8=False)
    return weights_as(b_p, dtype, RNE_BY_HAND=RNE_BY_HAND), b_alpha, b_m, b_l


@triton.jit
def _pv_half(
    b_acc, b_p, p_v, start_n, stride_vn, seq_kv, head_dim, v_desc, desc_at, EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
    TMA: tl.constexpr, ROWS32: tl.constexpr,
):  # fmt: skip
    """``acc + p @ V[start_n : start_n + HALF]`` (p: [BM, HALF] weights; the rows lie inside seq_kv)."""
    if TMA:
        b_v = v_desc.load([(desc_at[0] + start_n).to(tl.int32), desc_at[1]])  # [HALF, BD]
    else:
        b_v = load_kv(
            p_v, start_n + tl.arange(0, HALF), stride_vn, seq_kv, tl.arange(0, BLOCK_D), head_dim, 0, 0, 0,
            EVEN_ROWS=True, EVEN_D=EVEN_D, PAGED=False, ROWS32=ROWS32,
        )  # fmt: skip
    return dot(b_p, b_v, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, acc=b_acc)


@triton.jit
def _key_halves(b_p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weights of a block's first and second BLOCK_N / 2 keys: register views (no data moves)."""
    return tl.split(tl.permute(tl.reshape(b_p, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _interior_qk(b_q, p_k, start_n, stride_kn, seq_kv, head_dim, k_desc, desc_at, EVEN_D: tl.constexpr,
                 DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, TMA: tl.constexpr, ROWS32: tl.constexpr):  # fmt: skip
    """:func:`qk` of an unmasked, unpaged key block."""
    return qk(
        b_q, p_k, start_n, stride_kn, seq_kv, head_dim, 0, 0, 0, k_desc, desc_at, MASKED=False, PAGED=False,
        EVEN_N=True, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
    )  # fmt: skip


@triton.jit
def _accumulate_overlapped(
    b_m, b_l, b_acc, b_q, p_k, p_v, o_m, key_start, key_end, stride_kn, stride_vn, seq_q, seq_kv, head_dim,
    scale, softcap, slope2, k_desc, v_desc, desc_at, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    EVEN_D: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TMA: tl.constexpr,
    ROWS32: tl.constexpr,
):  # fmt: skip
    """:func:`_accumulate_over_keys` over the unmasked interior ``[key_start, key_end)`` (whole blocks; no
    dropout, paging or fp8), software-pipelined so that the next block's QK^T runs on the tensor cores while
    this block's softmax runs (FlashAttention-3's intra-warpgroup overlap).

    Iteration j: (1) ``acc * alpha + P_{j-1}[:, :BN/2] V_{j-1}[:BN/2]``, waited for; (2) ``S_{j+1} = q
    K_{j+1}^T``, not waited for: Triton's pipeliner makes it asynchronous because its result is only carried
    to the next iteration, whose uses follow the wait of (1); (3) the softmax of ``S_j``, overlapping (2);
    (4) ``+ P_{j-1}[:, BN/2:] V_{j-1}[BN/2:]``, waited for, which also retires (2) before ``S_{j+1}`` is
    copied into the loop-carried registers (ptxas serialises every wgmma if any instruction reads the
    accumulator of one in flight). ``P_{j-1}`` comes through the loop in registers and through a select on
    ``kept`` (true, which the compiler cannot tell), so that Triton keeps it a register operand of the
    wgmma (a loop-carried operand as it is would go through shared memory). The first block, the first
    ``S_1`` and the last two blocks are peeled off the loop."""
    HALF: tl.constexpr = BLOCK_N // 2
    dtype: tl.constexpr = p_v.dtype.element_ty
    kept = key_end >= key_start  # always true; the compiler cannot tell (see above)
    if key_end > key_start:
        n_last = key_end - BLOCK_N
        b_qk = _interior_qk(b_q, p_k, key_start, stride_kn, seq_kv, head_dim, k_desc, desc_at, EVEN_D=EVEN_D,
                            DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
                            BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32)  # fmt: skip
        b_p, b_alpha, b_m, b_l = _online_step(
            b_qk, b_m, b_l, o_m, key_start, seq_q, seq_kv, scale, softcap, slope2, dtype, SOFTCAP=SOFTCAP,
            HAS_ALIBI=HAS_ALIBI, RNE_BY_HAND=RNE_BY_HAND, BLOCK_N=BLOCK_N,
        )  # fmt: skip
        # S_1 (one interior block only: S_0 again, unused); "kept *" ends the wait after the loop's search for
        # the dots it waits on here, which would keep this K tile's shared memory for the whole loop
        b_qk = kept.to(tl.float32) * _interior_qk(
            b_q, p_k, tl.minimum(key_start + BLOCK_N, n_last), stride_kn, seq_kv, head_dim, k_desc, desc_at,
            EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
        )  # fmt: skip
        if key_end - key_start > 2 * BLOCK_N:
            for start_n in range(key_start + BLOCK_N, n_last, BLOCK_N):
                b_p_lo, b_p_hi = _key_halves(tl.where(kept, b_p, 0.0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
                b_acc = _pv_half(
                    b_acc * b_alpha[:, None], b_p_lo, p_v, start_n - BLOCK_N, stride_vn, seq_kv, head_dim,
                    v_desc, desc_at, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
                    HALF=HALF, BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
                )  # fmt: skip
                b_qk_next = _interior_qk(
                    b_q, p_k, start_n + BLOCK_N, stride_kn, seq_kv, head_dim, k_desc, desc_at, EVEN_D=EVEN_D,
                    DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
                    TMA=TMA, ROWS32=ROWS32,
                )  # fmt: skip
                b_p, b_alpha, b_m, b_l = _online_step(
                    b_qk, b_m, b_l, o_m, start_n, seq_q, seq_kv, scale, softcap, slope2, dtype,
                    SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, RNE_BY_HAND=RNE_BY_HAND, BLOCK_N=BLOCK_N,
                )  # fmt: skip
                b_acc = _pv_half(
                    b_acc, b_p_hi, p_v, start_n - HALF, stride_vn, seq_kv, head_dim, v_desc, desc_at,
                    EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, HALF=HALF,
                    BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
                )  # fmt: skip
                b_qk = b_qk_next
        if key_end - key_start > BLOCK_N:  # S_{n-1} is in b_qk, P_{n-2} in b_p
            b_acc = _pv_block(
                b_acc, b_alpha, b_p, p_v, n_last - BLOCK_N, stride_vn, seq_kv, head_dim, v_desc, desc_at,
                EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, BLOCK_M=BLOCK_M,
                BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
            )  # fmt: skip
            b_p, b_alpha, b_m, b_l = _online_step(
                b_qk, b_m, b_l, o_m, n_last, seq_q, seq_kv, scale, softcap, slope2, dtype, SOFTCAP=SOFTCAP,
                HAS_ALIBI=HAS_ALIBI, RNE_BY_HAND=RNE_BY_HAND, BLOCK_N=BLOCK_N,
            )  # fmt: skip
        b_acc = _pv_block(
            b_acc, b_alpha, b_p, p_v, n_last, stride_vn, seq_kv, head_dim, v_desc, desc_at, EVEN_D=EVEN_D,
            DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
        )  # fmt: skip
    return b_m, b_l, b_acc


@triton.jit
def _pv_block(
    b_acc, b_alpha, b_p, p_v, start_n, stride_vn, seq_kv, head_dim, v_desc, desc_at, EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, TMA: tl.constexpr, ROWS32: tl.constexpr,
):  # fmt: skip
    """``acc * alpha + p @ V`` of the key block at ``start_n``, in the two halves :func:`_pv_half` loads."""
    b_p_lo, b_p_hi = _key_halves(b_p, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    b_acc = _pv_half(
        b_acc * b_alpha[:, None], b_p_lo, p_v, start_n, stride_vn, seq_kv, head_dim, v_desc, desc_at,
        EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, HALF=BLOCK_N // 2,
        BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
    )  # fmt: skip
    return _pv_half(
        b_acc, b_p_hi, p_v, start_n + BLOCK_N // 2, stride_vn, seq_kv, head_dim, v_desc, desc_at,
        EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, HALF=BLOCK_N // 2,
        BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
    )  # fmt: skip


@triton.jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    CU_Q,
    CU_K,
    SEQUSED_K,
    KV_TABLE,
    ALIBI,
    RNG,
    DESCALE_Q,
    DESCALE_K,
    DESCALE_V,
    K_DESC,
    V_DESC,
    stride_qb,
    stride_qh,
    stride_qm,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ob,
    stride_oh,
    stride_om,
    stride_lb,
    stride_lh,
    stride_ab,
    stride_tb,
    stride_tp,
    stride_dqb,
    stride_dqh,
    stride_dkb,
    stride_dkh,
    stride_dvb,
    stride_dvh,
    heads_q,
    group,
    seq_q,
    seq_kv,
    head_dim,
    batch,
    grid_blocks,
    section,
    page_size,
    num_pages,
    scale,
    softcap,
    window_left,
    window_right,
    dropout_p,
    TWO_PASS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr,
    NEG_SCALE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    UNIFORM: tl.constexpr,
    SEQUSED: tl.constexpr,
    PAGED: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    FP8_GPU_CAST: tl.constexpr,
    V_TRANSPOSED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
    LPT: tl.constexpr,
    TMA_KV: tl.constexpr,
    DESC_SEQ_MAJOR: tl.constexpr,
    OVERLAP: tl.constexpr,
    ROWS32: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (sequence, query head).

    Flash (``TWO_PASS`` off): one pass over K/V with the online softmax.
    Tiled (``TWO_PASS`` on): pass 1 reads every K tile for each row's max score; pass 2 reads K again, and V,
    summing exp2(s2 - max) and exp2(s2 - max) @ V with no rescaling. Safe softmax, but K is read twice.
    Both output acc / l and the LSE m + log(l). ``HAS_ALIBI``: per-(sequence, head) slopes ``ALIBI`` (row
    stride ``stride_ab``, 0 for one slope per head). ``DROPOUT`` (flash only): weights dropped with
    probability ``dropout_p`` by :func:`dropout_keep` from the seed and offset in ``RNG``, the kept ones
    scaled by 1 / (1 - dropout_p); the LSE is that of the weights before dropout. ``PAGED`` (packed
    queries only): K and V are ``[num_pages, page_size, heads_kv, head_dim]`` pages (``stride_kb`` /
    ``stride_vb`` apart), key position n of sequence b at slot ``n % page_size`` of page
    ``KV_TABLE[b, n // page_size]``; a sequence whose pages in reach name one outside ``[0, num_pages)``
    reads none and gets NaN rows. fp8 (q, k, v e4m3): the weights go to the PV product as e4m3, scaled by
    ``2**P8_OFFSET`` (:func:`_accumulate_over_keys`); each of ``DESCALE_Q/K/V`` is a pointer to float32
    descales (at ``b * stride_d?b + h_kv * stride_d?h``) or None (1; its code compiled out); q's and k's
    fold into the score scale, v's into the output (exact algebra). ``V_TRANSPOSED`` (fp8, not paged): V is
    V^T ``[B, Hkv, D, S]`` with the keys contiguous (``stride_vn``: the head-dim stride), so that the PV
    product's B operand is K-major in shared memory, as an fp8 wgmma needs (the transpose bit of wgmma is
    for 16-bit types only), and its tiles stream through the software pipeline like K's. ``TMA_KV`` (16-bit,
    not paged): ``K_DESC`` / ``V_DESC`` are tensor descriptors over the ``[B * Hkv * S, D]`` rows of K and V
    (:func:`_tma_kv`), through which the unmasked interior loop loads its tiles (TMA); the masked edge loops
    keep their pointer loads; with ``DESC_SEQ_MAJOR`` over the ``[B * S, Hkv * D]`` rows of sequence-major
    K and V, with ``IS_VARLEN`` the ``[T, Hkv * D]`` rows of packed ones (:func:`desc_origin`). ``ROWS32``:
    the row offsets of Q, K, V and O fit in 32 bits (:func:`_row_offsets`).
    """
    start_m, b, h, bos_q, seq_q, bos_k, seq_kv, valid = program_block(
        CU_Q, CU_K, SEQUSED_K, seq_q, seq_kv, heads_q, batch, grid_blocks, section,
        BLOCK=BLOCK_M, OVER_KEYS=False, IS_VARLEN=IS_VARLEN, SEQUSED=SEQUSED, PAGED=PAGED, BLOCK_B=BLOCK_B,
        LPT=LPT, UNIFORM=UNIFORM,
    )  # fmt: skip
    h_kv = h // group
    slope2 = load_slope2(ALIBI, b, h, stride_ab, HAS_ALIBI=HAS_ALIBI)
    seed, rng_offset = load_rng(RNG, DROPOUT=DROPOUT)
    bh = b * heads_q + h
    desc_at = desc_origin(b, h_kv, heads_q // group, seq_kv, head_dim, bos_k, SEQ_MAJOR=DESC_SEQ_MAJOR,
                           IS_VARLEN=IS_VARLEN)  # TMA_KV  # fmt: skip

    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    p_q = Q + b * stride_qb + h * stride_qh + bos_q * stride_qm
    if PAGED:  # the page is found per key block; stride_kb / stride_vb step over pages
        p_k = K + h_kv * stride_kh
        p_v = V + h_kv * stride_vh
    else:
        p_k = K + b * stride_kb + h_kv * stride_kh + bos_k * stride_kn
        if V_TRANSPOSED:  # keys contiguous
            p_v = V + b * stride_vb + h_kv * stride_vh + bos_k
        else:
            p_v = V + b * stride_vb + h_kv * stride_vh + bos_k * stride_vn
    b_q = load_rows(p_q, o_m, stride_qm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                     ROWS32=ROWS32)  # [BM, BD]  # fmt: skip
    # fp8: q's and k's descales are factors of the scores (> 0: the sign stays), folded into the scale. One
    # that is not finite and > 0 (only with the host's value checks off) turns the rows it scales into NaN.
    if DESCALE_Q is not None:
        d_q = tl.load(DESCALE_Q + b * stride_dqb + h_kv * stride_dqh)
        valid = valid & descale_in_range(d_q)
        scale = scale * d_q
    if DESCALE_K is not None:
        d_k = tl.load(DESCALE_K + b * stride_dkb + h_kv * stride_dkh)
        valid = valid & descale_in_range(d_k)
        scale = scale * d_k
    if not SOFTCAP:
        # The exp2 fold (:func:`block_scores`) needs a positive factor: a negative scale's sign moves into q
        # (``NEG_SCALE``, exact), and a zero scale becomes 1e-30 (every finite score * 1e-30 rounds to the
        # same weight, as with 0, while a hidden key's -inf stays -inf instead of becoming -inf * 0 = NaN).
        if NEG_SCALE:
            b_q = negated_tile(b_q)
        scale = tl.maximum(tl.abs(scale), 1e-30)
    b_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    b_l = tl.zeros((BLOCK_M,), tl.float32)
    b_acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    lo, left_end, mid_lo, mid_hi, hi = key_ranges(
        start_m, seq_q, seq_kv, window_left, window_right,
        HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    if PAGED:
        # Every page this block reaches must be in the pool: else read none of them, NaN rows.
        bad = has_bad_page(KV_TABLE, b, lo // page_size, tl.cdiv(hi, page_size), stride_tb, stride_tp,
                            num_pages, BLOCK_P=PAGE_SCAN)  # fmt: skip
        valid = valid & ~bad
        left_end = tl.where(bad, lo, left_end)
        mid_lo = tl.where(bad, lo, mid_lo)
        mid_hi = tl.where(bad, lo, mid_hi)
        hi = tl.where(bad, lo, hi)
    if TWO_PASS:
        b_m = row_max_over_keys(
            b_m, b_q, p_k, o_m, lo, left_end, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, slope2, KV_TABLE, b, stride_tb, stride_tp, page_size, stride_kb,
            MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI,
            PAGED=PAGED, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
            DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ROWS32=ROWS32,
        )  # fmt: skip
        b_m = row_max_over_keys(
            b_m, b_q, p_k, o_m, mid_lo, mid_hi, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, slope2, KV_TABLE, b, stride_tb, stride_tp, page_size, stride_kb,
            MASKED=False, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI,
            PAGED=PAGED, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
            DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ROWS32=ROWS32,
        )  # fmt: skip
        b_m = row_max_over_keys(
            b_m, b_q, p_k, o_m, mid_hi, hi, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, slope2, KV_TABLE, b, stride_tb, stride_tp, page_size, stride_kb,
            MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI,
            PAGED=PAGED, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
            DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ROWS32=ROWS32,
        )  # fmt: skip
    b_m, b_l, b_acc = _accumulate_over_keys(
        b_m, b_l, b_acc, b_q, p_k, p_v, o_m, lo, left_end, stride_kn, stride_vn, seq_q, seq_kv, head_dim,
        scale, softcap, window_left, window_right, slope2, seed, bh, rng_offset, dropout_p, KV_TABLE, b,
        stride_tb, stride_tp, page_size, stride_kb, stride_vb, None, None, 0, MASKED=True, TWO_PASS=TWO_PASS,
        HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, DROPOUT=DROPOUT,
        PAGED=PAGED, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
        DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND, V_TRANSPOSED=V_TRANSPOSED, BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D, ROWS32=ROWS32, FP8_GPU_CAST=FP8_GPU_CAST,
    )  # fmt: skip
    if OVERLAP:
        b_m, b_l, b_acc = _accumulate_overlapped(
            b_m, b_l, b_acc, b_q, p_k, p_v, o_m, mid_lo, mid_hi, stride_kn, stride_vn, seq_q, seq_kv,
            head_dim, scale, softcap, slope2, K_DESC, V_DESC, desc_at, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI,
            EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, TMA=TMA_KV, ROWS32=ROWS32,
        )  # fmt: skip
    else:
        b_m, b_l, b_acc = _accumulate_over_keys(
            b_m, b_l, b_acc, b_q, p_k, p_v, o_m, mid_lo, mid_hi, stride_kn, stride_vn, seq_q, seq_kv,
            head_dim, scale, softcap, window_left, window_right, slope2, seed, bh, rng_offset, dropout_p,
            KV_TABLE, b, stride_tb, stride_tp, page_size, stride_kb, stride_vb, K_DESC, V_DESC, desc_at,
            MASKED=False, TWO_PASS=TWO_PASS, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP,
            HAS_ALIBI=HAS_ALIBI, DROPOUT=DROPOUT, PAGED=PAGED, EVEN_N=EVEN_N, EVEN_D=EVEN_D,
            DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND,
            V_TRANSPOSED=V_TRANSPOSED, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ROWS32=ROWS32, TMA=TMA_KV,
            FP8_GPU_CAST=FP8_GPU_CAST,
        )  # fmt: skip
    b_m, b_l, b_acc = _accumulate_over_keys(
        b_m, b_l, b_acc, b_q, p_k, p_v, o_m, mid_hi, hi, stride_kn, stride_vn, seq_q, seq_kv, head_dim,
        scale, softcap, window_left, window_right, slope2, seed, bh, rng_offset, dropout_p, KV_TABLE, b,
        stride_tb, stride_tp, page_size, stride_kb, stride_vb, None, None, 0, MASKED=True, TWO_PASS=TWO_PASS,
        HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, DROPOUT=DROPOUT,
        PAGED=PAGED, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
        DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND, V_TRANSPOSED=V_TRANSPOSED, BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D, ROWS32=ROWS32, FP8_GPU_CAST=FP8_GPU_CAST,
    )  # fmt: skip

    # Rows that saw no key: l == 0 -> output 0 and LSE -inf.
    no_key = b_l == 0.0
    b_out = b_acc / tl.where(no_key, 1.0, b_l)[:, None]
    if DROPOUT:
        b_out = b_out * (1.0 / (1.0 - dropout_p))
    b_lse2 = b_m + tl.log2(tl.where(no_key, 1.0, b_l))
    if DESCALE_V is not None:  # fp8: v's descale, once on the output
        d_v = tl.load(DESCALE_V + b * stride_dvb + h_kv * stride_dvh)
        valid = valid & descale_in_range(d_v)
        b_out = b_out * d_v
    if V.dtype.element_ty.is_fp8():  # the weights' 2**P8_OFFSET leaves the row sums
        b_lse2 = b_lse2 - P8_OFFSET
    b_lse = tl.where(no_key, float("-inf"), b_lse2 * LN2)
    # a packed sequence with invalid bounds saw no key, an fp8 descale was bad: NaN over the rows shows it
    if IS_VARLEN or V.dtype.element_ty.is_fp8():
        b_out = tl.where(valid, b_out, float("nan"))
        b_lse = tl.where(valid, b_lse, float("nan"))
    p_o = O + b * stride_ob + h * stride_oh + bos_q * stride_om
    b_out = cast(b_out, O.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    store_rows(p_o, b_out, o_m, stride_om, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                ROWS32=ROWS32)  # fmt: skip
    if LSE is not None:  # (None: an inference call that does not ask for it)
        store_vector(LSE + b * stride_lb + h * stride_lh + bos_q, b_lse, o_m, seq_q, EVEN_ROWS=EVEN_M)


FORWARD = Kernel(_attention_fwd_kernel, "flash_attention_fwd")
TILED = Kernel(_attention_fwd_kernel, "tiled_attention_fwd")  # the same body with TWO_PASS on
