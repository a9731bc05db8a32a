"""The KV-cache decode kernels: the append (new tokens written to the cache, rotated and fp8-quantized), the
attention over the cache (split-KV, paged, with the new tokens written in-kernel where the policy says) and
the combine of the splits. Conventions: :mod:`llm_speed.attention.decode`."""

from __future__ import annotations

import triton
import triton.language as tl

from ..core.kernel_math import LN2, LOG2E, cast, dot, tanh
from ..core.launch import Kernel
from ..matmul.fp8 import to_fp8
from .blocks import cache_rows, has_bad_page


@triton.jit
def _rotated(p_x, m_x, o_d, COS, SIN, o_pos, rotary_dim, INTERLEAVED: tl.constexpr):
    """Rows ``p_x + d`` (``p_x`` [M, 1] row pointers, mask ``m_x`` [M, BD]) as float32, dims below
    ``rotary_dim`` rotated by the angles of positions ``o_pos`` [M] (rows of the contiguous ``COS``/``SIN``
    [seqlen_ro, rotary_dim / 2]): pairs (2c, 2c + 1) when INTERLEAVED (GPT-J), else (c, c + rotary_dim / 2)
    (GPT-NeoX), ``(x, y) -> (x cos - y sin, x sin + y cos)`` with the angle of pair c. Other dims pass
    through exactly. The partner of each dim is a second load of the same row (cached lines); masked rows
    read no angle."""
    half = rotary_dim // 2
    if INTERLEAVED:
        first = (o_d % 2) == 0
        o_pair = o_d ^ 1
        o_c = o_d // 2
    else:
        first = o_d < half
        o_pair = tl.where(first, o_d + half, o_d - half)
        o_c = tl.where(first, o_d, o_d - half)
    m_rot = m_x & (o_d < rotary_dim)[None, :]
    b_x = tl.load(p_x + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)
    b_pair = tl.load(p_x + o_pair[None, :], mask=m_rot, other=0.0).to(tl.float32)
    o_angle = o_pos[:, None].to(tl.int64) * half + o_c[None, :]
    b_cos = tl.load(COS + o_angle, mask=m_rot, other=1.0).to(tl.float32)
    b_sin = tl.load(SIN + o_angle, mask=m_rot, other=0.0).to(tl.float32)
    return b_x * b_cos + b_pair * tl.where(first[None, :], -b_sin, b_sin)


@triton.jit
def _to_cache(x, b_descale, dtype: tl.constexpr, FP8_MAX: tl.constexpr, SHIFT: tl.constexpr,
              ROUND_MASK: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr,
              ROUND_BY_HAND: tl.constexpr):  # fmt: skip
    """``x`` [H, D] quantized to fp8 ``dtype`` with the descales ``b_descale`` [H] of its rows:
    ``saturate(x / descale)`` (IEEE division in float32), rounded to nearest even, NaN kept, through the fp8
    GEMM's cast (:func:`llm_speed.matmul.fp8.to_fp8`): the bytes are PyTorch's."""
    y = tl.div_rn(x.to(tl.float32), b_descale[:, None])
    return to_fp8(y, FP8_MAX=FP8_MAX, ROUND_BY_HAND=ROUND_BY_HAND, SHIFT=SHIFT, ROUND_MASK=ROUND_MASK,
                   MIN_NORMAL=MIN_NORMAL, SUBNORMAL_MAGIC=SUBNORMAL_MAGIC, dtype=dtype)  # fmt: skip


@triton.jit
def _append_rows(
    K, V, K_CACHE, V_CACHE, BLOCK_TABLE, COS, SIN, K_DESCALE, V_DESCALE, i_b, i_row, o_j, o_h, o_pos, m_row,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_btb, stride_btp, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    head_dim, page_size, num_blocks, rotary_dim,
    PAGED: tl.constexpr, INTERLEAVED: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_SHIFT: tl.constexpr, FP8_ROUND_MASK: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_MAGIC: tl.constexpr, FP8_ROUND_BY_HAND: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Write rows (new token ``o_j``, KV head ``o_h``) of sequence ``i_b`` at cache positions ``o_pos`` (all
    [R]; rows outside ``m_row`` skipped): slot (``i_row``, pos) when dense, (block_table[i_b, pos //
    page_size], pos % page_size) when paged, a page outside [0, num_blocks) never written; k rotated at its
    position first with COS/SIN; an fp8 cache (K_DESCALE/V_DESCALE given) gets ``saturate(x / descale)``
    rounded to nearest even (:func:`_to_cache`), the descale of (i_b, head) at ``i_b * stride_db +
    head * stride_dh``."""
    if PAGED:
        p_table = BLOCK_TABLE + i_b.to(tl.int64) * stride_btb + (o_pos // page_size) * stride_btp
        b_page = tl.load(p_table, mask=m_row, other=-1)
        m_row = m_row & (b_page >= 0) & (b_page < num_blocks)
        o_row = tl.where(m_row, b_page, 0).to(tl.int64)
        o_slot = (o_pos % page_size).to(tl.int64)
    else:
        o_row = tl.zeros_like(o_pos).to(tl.int64) + i_row
        o_slot = o_pos.to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m = m_row[:, None] & (o_d < head_dim)[None, :]
    # (64-bit rows: a prefill's new keys as a fused QKV view pass 2^31 elements at ~210k tokens)
    p_k = K + i_b.to(tl.int64) * stride_kb + (o_j.to(tl.int64) * stride_ks + o_h * stride_kh)[:, None]
    p_v = V + i_b.to(tl.int64) * stride_vb + (o_j.to(tl.int64) * stride_vs + o_h * stride_vh)[:, None]
    p_v += o_d[None, :]
    p_kc = K_CACHE + (o_row * stride_kcb + o_slot * stride_kcs + o_h * stride_kch)[:, None] + o_d[None, :]
    p_vc = V_CACHE + (o_row * stride_vcb + o_slot * stride_vcs + o_h * stride_vch)[:, None] + o_d[None, :]
    if COS is not None:
        b_k = _rotated(p_k, m, o_d, COS, SIN, o_pos, rotary_dim, INTERLEAVED)  # float32
    else:
        b_k = tl.load(p_k + o_d[None, :], mask=m)
    b_v = tl.load(p_v, mask=m)
    if K_DESCALE is not None:  # an fp8 cache: quantized with the descales of (sequence, head)
        b_kds = tl.load(K_DESCALE + i_b * stride_kdb + o_h * stride_kdh, mask=m_row, other=1.0)
        b_vds = tl.load(V_DESCALE + i_b * stride_vdb + o_h * stride_vdh, mask=m_row, other=1.0)
        b_k = _to_cache(b_k, b_kds, K_CACHE.dtype.element_ty, FP8_MAX, FP8_SHIFT, FP8_ROUND_MASK,
                        FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC, FP8_ROUND_BY_HAND)  # fmt: skip
        b_v = _to_cache(b_v, b_vds, V_CACHE.dtype.element_ty, FP8_MAX, FP8_SHIFT, FP8_ROUND_MASK,
                        FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC, FP8_ROUND_BY_HAND)  # fmt: skip
    elif COS is not None:
        b_k = cast(b_k, K_CACHE.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    tl.store(p_kc, b_k, mask=m)
    tl.store(p_vc, b_v, mask=m)


@triton.jit
def _append_kernel(
    K, V, K_CACHE, V_CACHE, CACHE_SEQLENS, BLOCK_TABLE, CACHE_BATCH_IDX, CACHE_LEFTPAD, COS, SIN,
    K_DESCALE, V_DESCALE,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_cs, stride_btb, stride_btp, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    seq_new, heads_kv, head_dim, page_size, num_blocks, max_cached, cache_batch, rotary_dim,
    PAGED: tl.constexpr, INTERLEAVED: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_SHIFT: tl.constexpr, FP8_ROUND_MASK: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_MAGIC: tl.constexpr, FP8_ROUND_BY_HAND: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Write new token ``j`` of sequence ``b`` (program (b * seq_new + j, head block)) at position
    ``cache_seqlens[b] + j`` (:func:`_append_rows`), in the calls whose attention kernel does not write them
    itself (no query, or several query-row blocks per KV head). Nothing is written for an invalid sequence:
    cache_seqlens outside [0, max_cached] (max_cached = the largest length that leaves room for the new
    tokens and, with rotary, keeps every position inside COS/SIN), a leftpad outside [0, cache_seqlens], a
    cache_batch_idx outside [0, cache_batch); nor to a page outside [0, num_blocks)."""
    pid = tl.program_id(0)
    i_b = pid // seq_new
    i_j = pid % seq_new
    cached = tl.load(CACHE_SEQLENS + i_b * stride_cs)
    ok = (cached >= 0) & (cached <= max_cached)
    if CACHE_LEFTPAD is not None:
        left_pad = tl.load(CACHE_LEFTPAD + i_b)
        ok = ok & (left_pad >= 0) & (left_pad <= cached)
    i_row = i_b.to(tl.int64)  # the dense cache's row (PAGED: never with a batch index)
    if CACHE_BATCH_IDX is not None:
        i_cache = tl.load(CACHE_BATCH_IDX + i_b)
        ok = ok & (i_cache >= 0) & (i_cache < cache_batch)
        i_row = tl.where(ok, i_cache, 0).to(tl.int64)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    # no head to write when the sequence is invalid (a scalar mask broadcast fails under the interpreter)
    m_h = o_h < tl.where(ok, heads_kv, 0)
    o_pos = tl.zeros([BLOCK_H], dtype=tl.int32) + (tl.where(ok, cached, 0) + i_j)  # < capacity when ok
    _append_rows(
        K, V, K_CACHE, V_CACHE, BLOCK_TABLE, COS, SIN, K_DESCALE, V_DESCALE, i_b, i_row,
        tl.zeros([BLOCK_H], dtype=tl.int32) + i_j, o_h, o_pos, m_h,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        stride_btb, stride_btp, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
        head_dim, page_size, num_blocks, rotary_dim, PAGED, INTERLEAVED, RNE_BY_HAND,
        FP8_MAX, FP8_SHIFT, FP8_ROUND_MASK, FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC, FP8_ROUND_BY_HAND, BLOCK_D,
    )  # fmt: skip


@triton.jit
def _float16_rows(b_x):
    """A bfloat16 tile as float16, each row times the power of two that puts its largest magnitude in
    [2**14, 2**15), and the factors back ([rows] float32). Exact for every value down to 2**-32 of its row's
    largest (float16 keeps 11 significant bits against bfloat16's 8; smaller ones round to float16's
    subnormal step, under 2**-38 of it); a row of zeros or subnormals scales by 2**126, one holding inf or
    NaN by 2**-114, so that both factors stay normal float32 numbers."""
    b_amax = tl.max(tl.abs(b_x.to(tl.float32)), 1)
    e = (b_amax.to(tl.int32, bitcast=True) >> 23) & 0xFF  # biased exponent: amax in [2**(e-127), 2**(e-126))
    e = tl.maximum(e, 15)
    b_scale = ((268 - e) << 23).to(tl.float32, bitcast=True)  # 2**(141 - e)
    b_unscale = ((e - 14) << 23).to(tl.float32, bitcast=True)  # 2**(e - 141)
    return (b_x.to(tl.float32) * b_scale[:, None]).to(tl.float16), b_unscale


@triton.jit
def _kvcache_fwd_kernel(
    Q, K_CACHE, V_CACHE, CACHE_SEQLENS, BLOCK_TABLE, CACHE_BATCH_IDX, CACHE_LEFTPAD, COS, SIN, ALIBI,
    K_DESCALE, V_DESCALE, OUT, LSE, K, V,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_nkb, stride_nks, stride_nkh, stride_nvb, stride_nvs, stride_nvh,
    stride_o_split, stride_ob, stride_os, stride_oh,
    stride_l_split, stride_lb, stride_lh, lse_offset,
    stride_cs, stride_btb, stride_btp, stride_ab, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
    seq_q, seq_new, max_cached, heads_kv, group, head_dim, page_size, num_blocks, split_len, num_splits,
    n_row_blocks, cache_batch, rotary_dim,
    qk_scale_log2, softcap, window_left, window_right,
    PAGED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    INTERLEAVED: tl.constexpr, SPLIT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    FP8_MAX: tl.constexpr, FP8_SHIFT: tl.constexpr, FP8_ROUND_MASK: tl.constexpr,
    FP8_MIN_NORMAL: tl.constexpr, FP8_SUBNORMAL_MAGIC: tl.constexpr, FP8_ROUND_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_J: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    i_m = pid % n_row_blocks
    i_split = (pid // n_row_blocks) % num_splits
    i_bh = pid // (n_row_blocks * num_splits)
    i_b = i_bh // heads_kv
    i_hkv = i_bh % heads_kv

    # An invalid sequence reads no key and gets NaN rows: cache_seqlens negative or leaving no room for the
    # new tokens (or, with rotary, putting a position past COS/SIN: max_cached folds both), a leftpad
    # outside [0, cache_seqlens], a cache_batch_idx outside the cache.
    cached = tl.load(CACHE_SEQLENS + i_b * stride_cs)
    bad = (cached < 0) | (cached > max_cached)  # max_cached <= capacity - seq_new: no int32 overflow
    first_key = 0  # keys [first_key, seqlen_k) are the sequence's (absolute cache positions)
    if CACHE_LEFTPAD is not None:
        left_pad = tl.load(CACHE_LEFTPAD + i_b)
        bad = bad | (left_pad < 0) | (left_pad > cached)
        first_key = tl.where(bad, 0, left_pad)
    i_cache = i_b  # the dense cache's row (PAGED: never with a batch index)
    if CACHE_BATCH_IDX is not None:
        i_cache = tl.load(CACHE_BATCH_IDX + i_b)
        bad = bad | (i_cache < 0) | (i_cache >= cache_batch)
        i_cache = tl.where(bad, 0, i_cache)
    seqlen_k = tl.where(bad, 0, cached + seq_new)  # end of the keys visible to this sequence
    lo = i_split * split_len
    if K is not None:
        # The new tokens of this split's key range, written by this program before it reads a key (one
        # query-row block per KV head: no other program reads them), as the append kernel would.
        start = tl.where(bad, 0, cached)
        first_j = tl.maximum(lo - start, 0)
        last_j = tl.where(bad, 0, tl.minimum(lo + split_len - start, seq_new))
        for j in range(first_j, last_j, BLOCK_J):
            o_j = j + tl.arange(0, BLOCK_J)
            _append_rows(
                K, V, K_CACHE, V_CACHE, BLOCK_TABLE, COS, SIN, K_DESCALE, V_DESCALE, i_b,
                i_cache.to(tl.int64), o_j, tl.zeros([BLOCK_J], dtype=tl.int32) + i_hkv, start + o_j,
                o_j < last_j,
                stride_nkb, stride_nks, stride_nkh, stride_nvb, stride_nvs, stride_nvh,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                stride_btb, stride_btp, stride_kdb, stride_kdh, stride_vdb, stride_vdh,
                head_dim, page_size, num_blocks, rotary_dim, PAGED, INTERLEAVED, RNE_BY_HAND,
                FP8_MAX, FP8_SHIFT, FP8_ROUND_MASK, FP8_MIN_NORMAL, FP8_SUBNORMAL_MAGIC, FP8_ROUND_BY_HAND,
                BLOCK_D,
            )  # fmt: skip
        tl.debug_barrier()  # every thread's stores before any thread's loads of the keys
    if PAGED:
        # The pages in use of this split's key range: one outside the pool makes the sequence's rows NaN
        # (every split of the range [0, seqlen_k) checks its own part; the combine kernel spreads the NaN).
        last_page = tl.cdiv(tl.minimum(lo + split_len, seqlen_k), page_size)
        bad = bad | has_bad_page(BLOCK_TABLE, i_b, lo // page_size, last_page, stride_btb, stride_btp,
                                  num_blocks, BLOCK_P)  # fmt: skip
        seqlen_k = tl.where(bad, 0, seqlen_k)
    shift = seqlen_k - seq_q  # query i sits at key position i + shift (bottom-right alignment)
    n_rows = seq_q * group
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    m_r = o_r < n_rows
    o_i = o_r // group  # query position of each row
    o_h = i_hkv * group + o_r % group  # query head of each row
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_dim

    # Keys any row of this block may see, intersected with this program's split (empty when none).
    first_i = (i_m * BLOCK_M) // group
    last_i = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // group, seq_q - 1)
    hi = tl.minimum(lo + split_len, seqlen_k)
    if HAS_RIGHT:
        hi = tl.minimum(hi, last_i + shift + window_right + 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, first_i + shift - window_left)
    if CACHE_LEFTPAD is not None:
        lo = tl.maximum(lo, first_key)
    lo = (lo // BLOCK_N) * BLOCK_N  # split_len is a multiple of BLOCK_N: still inside this split

    p_q = Q + i_b.to(tl.int64) * stride_qb + o_i[:, None].to(tl.int64) * stride_qs + o_h[:, None] * stride_qh
    m_q = m_r[:, None] & m_d[None, :]
    if COS is not None:
        # Query i at position cache_seqlens + i when causal or windowed, else every query at cache_seqlens
        # (flash-attn's rule). An invalid sequence (NaN rows) reads no angle: its positions may be anywhere.
        if HAS_LEFT or HAS_RIGHT:
            o_ro = cached + o_i
        else:
            o_ro = cached + o_i * 0
        m_live = (o_r < tl.where(bad, 0, n_rows))[:, None] & m_d[None, :]
        b_q = _rotated(p_q, m_live, o_d, COS, SIN, o_ro, rotary_dim, INTERLEAVED)
        b_q = cast(b_q, Q.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)  # rounded as flash-attn does
    else:
        b_q = tl.load(p_q + o_d[None, :], mask=m_q, other=0.0)  # [BM, BD]
    if ALIBI is not None:
        # -slope * |query position - key position|, in base 2 like the scores
        b_slope = tl.load(ALIBI + i_b.to(tl.int64) * stride_ab + o_h, mask=m_r, other=0.0) * LOG2E
    qk_scale = qk_scale_log2  # the scores' factor: with an fp8 cache, k's descale folded in (exact algebra)
    if K_DESCALE is not None:
        qk_scale = qk_scale_log2 * tl.load(K_DESCALE + i_b * stride_kdb + i_hkv * stride_kdh)
    # An fp8 cache with a bfloat16 q: QK^T in float16 too, q's rows scaled by powers of two into float16's
    # range (exact: float16 has the longer significand) and the factor back folded into the scores' scale.
    # Each K tile then takes one conversion (e4m3 -> f16) instead of two (e4m3 -> f16 -> bf16).
    QK_F16: tl.constexpr = K_DESCALE is not None and Q.dtype.element_ty == tl.bfloat16
    if QK_F16:
        b_q, b_unscale = _float16_rows(b_q)
        b_qk_scale = qk_scale * b_unscale  # [BM]
    # An fp8 cache with a 16-bit q: P and V in float16 (V exact), v_descale on the float32 sum. In bfloat16
    # each tile took a second cast (e4m3 -> f16 -> bf16: sm_90a d = 128 loop 887 -> 796 SASS instructions)
    # and v * v_descale could round; in float16 it cannot overflow (|v| <= 448 for e4m3, 57344 for e5m2).
    PV_F16: tl.constexpr = V_DESCALE is not None and Q.dtype.element_ty != tl.float32
    if V_DESCALE is not None:
        v_scale = tl.load(V_DESCALE + i_b * stride_vdb + i_hkv * stride_vdh)
        # A 1 the compiler cannot fold (NaN for a descale of 0, inf or NaN): a product between V's load and
        # its dot makes V's shared-memory tile 16-bit, read by ldmatrix.trans; the fp8 tile read as the PV
        # product's transposed operand takes byte-wide gathers (no 8-bit ldmatrix.trans on sm_90): the loop
        # was 1002 SASS instructions (16-bit cache: 724).
        v_one = (v_scale / v_scale).to(tl.float16)

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    o_pos = o_i + shift  # [BM]
    for start_n in range(lo, hi, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)  # [BN]
        m_n = o_n < seqlen_k  # slots past the valid tokens are never read: they may hold anything
        if CACHE_LEFTPAD is not None:
            m_n = m_n & (o_n >= first_key)  # nor the left padding
        b_page, o_slot = cache_rows(BLOCK_TABLE, i_cache, o_n, m_n, stride_btb, stride_btp, page_size, PAGED)
        m_kv = m_n[:, None] & m_d[None, :]
        p_k = K_CACHE + i_hkv * stride_kh + (b_page * stride_kb + o_slot * stride_ks)[:, None] + o_d[None, :]
        b_k = tl.load(p_k, mask=m_kv, other=0.0).to(b_q.dtype)  # [BN, BD] (fp8: exact upcast)
        b_s = dot(b_q, tl.trans(b_k), DOT_IN_FP32, DOT_PRECISION)  # [BM, BN] q.k, unscaled
        if HAS_SOFTCAP:
            if QK_F16:
                b_s = b_s * b_unscale[:, None]
            b_s = softcap * tanh(b_s * (qk_scale / LOG2E / softcap)) * LOG2E
        elif QK_F16:
            b_s = b_s * b_qk_scale[:, None]
        else:
            b_s = b_s * qk_scale
        if ALIBI is not None:  # after the cap, as flash-attn
            b_s = b_s - b_slope[:, None] * tl.abs(o_pos[:, None] - o_n[None, :]).to(tl.float32)
        m_s = m_r[:, None] & m_n[None, :]
        if HAS_RIGHT:
            m_s = m_s & (o_n[None, :] <= o_pos[:, None] + window_right)
        if HAS_LEFT:
            m_s = m_s & (o_n[None, :] >= o_pos[:, None] - window_left)
        b_s = tl.where(m_s, b_s, float("-inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)  # a row with no key yet: exp2(-inf) = 0
        b_alpha = tl.exp2(b_m - b_shift)
        b_p = tl.exp2(b_s - b_shift[:, None])  # [BM, BN]
        b_l = b_l * b_alpha + tl.sum(b_p, 1)
        if PV_F16:  # (RNE_BY_HAND rounds to bfloat16's bits: not for float16, which the interpreter rounds)
            b_p = b_p.to(tl.float16)
        elif Q.dtype.element_ty != tl.float32:
            b_p = cast(b_p, Q.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
        p_v = V_CACHE + i_hkv * stride_vh + (b_page * stride_vb + o_slot * stride_vs)[:, None] + o_d[None, :]
        b_v = tl.load(p_v, mask=m_kv, other=0.0)  # [BN, BD]
        if PV_F16:
            b_v = b_v.to(tl.float16) * v_one
        elif V_DESCALE is None:
            b_v = b_v.to(Q.dtype.element_ty)
        else:  # a float32 q: dequantized exactly in float32
            b_v = b_v.to(tl.float32) * v_scale
        b_acc = b_acc * b_alpha[:, None] + dot(b_p, b_v, DOT_IN_FP32, DOT_PRECISION)
        b_m = b_m_new

    if PV_F16:
        b_acc = b_acc * v_scale
    no_key = b_l == 0.0
    b_out = b_acc / tl.where(no_key, 1.0, b_l)[:, None]
    b_lse = tl.where(no_key, float("-inf"), (b_m + tl.log2(tl.where(no_key, 1.0, b_l))) * LN2)
    b_out = tl.where(bad, float("nan"), b_out)  # an invalid sequence (lengths, page, index): NaN rows
    b_lse = tl.where(bad, float("nan"), b_lse)
    p_out = (
        OUT + i_split.to(tl.int64) * stride_o_split + i_b.to(tl.int64) * stride_ob
        + o_i[:, None].to(tl.int64) * stride_os + o_h[:, None] * stride_oh + o_d[None, :]
    )  # fmt: skip
    if SPLIT:
        tl.store(p_out, b_out, mask=m_q)
    else:
        tl.store(p_out, cast(b_out, OUT.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m_q)
    if LSE is not None:  # (None: not asked for, and no split to merge)
        p_lse = (
            LSE + lse_offset + i_split.to(tl.int64) * stride_l_split + i_b.to(tl.int64) * stride_lb
            + o_h * stride_lh + o_i
        )  # fmt: skip
        tl.store(p_lse, b_lse, mask=m_r)


@triton.jit
def _kvcache_combine_kernel(
    OUT_PART, LSE_PART, OUT, LSE,
    stride_o_split, stride_l_split, lse_offset, seq_q, heads_q, num_splits, head_dim,
    RNE_BY_HAND: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Merge one query row's split results: out = sum_s w_s out_s / sum_s w_s, w_s = exp(lse_s - max_s lse_s).

    The partials share one float32 workspace (one allocation a call): contiguous ``[splits, batch, seq_q,
    heads_q, D]`` outputs from ``OUT_PART``, ``[splits, batch, heads_q, seq_q]`` LSEs from ``LSE_PART +
    lse_offset``; the results ``[batch, seq_q, heads_q, D]`` and ``[batch, heads_q, seq_q]`` (``LSE`` None:
    not asked for); one program per (b, i, h). A NaN partial LSE (a split of an invalid sequence) makes the
    row NaN.
    """
    i_row = tl.program_id(0).to(tl.int64)  # flat (b, i, h) of the output
    i_b = i_row // (seq_q * heads_q)
    i_i = (i_row // heads_q) % seq_q
    i_h = i_row % heads_q
    i_lse = (i_b * heads_q + i_h) * seq_q + i_i
    o_s = tl.arange(0, BLOCK_S)
    o_d = tl.arange(0, BLOCK_D)
    m_s = o_s < num_splits
    m_d = o_d < head_dim
    b_lse = tl.load(LSE_PART + lse_offset + o_s * stride_l_split + i_lse, mask=m_s, other=float("-inf"))
    bad = tl.max(tl.where(b_lse != b_lse, 1, 0), 0) > 0  # explicit: a GPU's max may skip a NaN
    b_lse = tl.where(b_lse != b_lse, float("-inf"), b_lse)
    b_max = tl.max(b_lse, 0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w = tl.exp2((b_lse - b_max) * LOG2E)  # a split that saw no key weighs 0
    b_sum = tl.sum(b_w, 0)
    no_key = b_sum == 0.0
    p_o = OUT_PART + o_s[:, None].to(tl.int64) * stride_o_split + i_row * head_dim + o_d[None, :]
    b_o = tl.load(p_o, mask=m_s[:, None] & m_d[None, :], other=0.0)  # [BS, BD]
    b_out = tl.sum(b_o * b_w[:, None], 0) / tl.where(no_key, 1.0, b_sum)  # [BD]
    b_out = tl.where(bad, float("nan"), b_out)
    b_out = cast(b_out, OUT.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    tl.store(OUT + i_row * head_dim + o_d, b_out, mask=m_d)
    if LSE is not None:  # (None: not asked for)
        b_lse_out = tl.where(no_key, float("-inf"), b_max + tl.log(tl.where(no_key, 1.0, b_sum)))
        tl.store(LSE + i_lse, tl.where(bad, float("nan"), b_lse_out))


APPEND = Kernel(_append_kernel, "kvcache_append")
FORWARD = Kernel(_kvcache_fwd_kernel, "kvcache_attention_fwd")
COMBINE = Kernel(_kvcache_combine_kernel, "kvcache_attention_combine")
KERNEL_APPEND = APPEND.name
KERNEL_DECODE = FORWARD.name
KERNEL_COMBINE = COMBINE.name
