"""Triton kernels for attention: FlashAttention forward and backward, and the two-pass tiled forward.

All kernels run on a 1-D grid of (row block, batch * head) programs, row blocks of one head adjacent, and
use 64-bit offsets for everything that multiplies a batch, head or row index by a stride.

Naming follows one convention: ``p_`` pointers, ``b_`` blocks held on chip, ``o_`` offsets, ``m_`` masks;
shape comments use BM (query rows per block), BN (key rows per block) and BD (head_dim padded to a power of
two). Scores are kept in base 2: ``s2 = q.k * scale * log2(e)`` so that ``exp(x * scale) == exp2(s2)``;
``exp2`` is the cheap instruction. The LSE stored in HBM is in natural-log units.

Constexpr switches specialise one body per variant instead of near-copies:
  TWO_PASS       the tiled forward (row max first, then sums without rescaling) instead of flash's online one
  IS_CAUSAL      bottom-right causal mask: query i sees key j <= i + seq_kv - seq_q
  MASKED         this loop over blocks applies the causal and bounds masks to the scores. Each kernel runs
                 its loop twice: unmasked over the interior blocks every row fully sees, masked over the
                 diagonal and ragged blocks only. Blocks no row may see are not visited at all.
  EVEN_M/EVEN_N  seq_q / seq_kv is a multiple of the block: no row/column bounds masks on loads and stores
  EVEN_D         head_dim is already a power of two: no head_dim mask
  DOT_IN_FP32    widen tiles to fp32 before tl.dot; set only under the interpreter for bfloat16, whose tl.dot
                 there multiplies raw bit patterns. The tiles are still rounded to bfloat16 first, so the
                 bfloat16 arithmetic of the kernel is exercised.
  DOT_PRECISION  "ieee" for float32 inputs (no silent TF32 rounding); ignored for 16-bit inputs.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

LN2: tl.constexpr = tl.constexpr(math.log(2.0))  # LSE is stored in natural-log units
LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))  # and read back into base 2


@triton.jit
def _dot(a, b, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """a @ b accumulated in fp32."""
    if DOT_IN_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_rows(
    p_base, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr
):
    """Load a [rows, BD] tile; rows past ``n_rows`` and columns past ``head_dim`` are not read (0)."""
    # 64-bit row offsets: seq * stride can pass 2**31 for long sequences in a [B, S, H, D] layout.
    p = p_base + o_rows[:, None].to(tl.int64) * stride_row + o_d[None, :]
    if EVEN_ROWS and EVEN_D:
        return tl.load(p)
    elif EVEN_ROWS:
        return tl.load(p, mask=o_d[None, :] < head_dim, other=0.0)
    elif EVEN_D:
        return tl.load(p, mask=o_rows[:, None] < n_rows, other=0.0)
    else:
        return tl.load(p, mask=(o_rows[:, None] < n_rows) & (o_d[None, :] < head_dim), other=0.0)


@triton.jit
def _store_rows(
    p_base, value, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr
):
    """Store a [rows, BD] tile, skipping rows past ``n_rows`` and columns past ``head_dim``."""
    # 64-bit row offsets: seq * stride can pass 2**31 for long sequences in a [B, S, H, D] layout.
    p = p_base + o_rows[:, None].to(tl.int64) * stride_row + o_d[None, :]
    if EVEN_ROWS and EVEN_D:
        tl.store(p, value)
    elif EVEN_ROWS:
        tl.store(p, value, mask=o_d[None, :] < head_dim)
    elif EVEN_D:
        tl.store(p, value, mask=o_rows[:, None] < n_rows)
    else:
        tl.store(p, value, mask=(o_rows[:, None] < n_rows) & (o_d[None, :] < head_dim))


@triton.jit
def _visible(o_m, o_n, seq_q, seq_kv, IS_CAUSAL: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """[BM, BN] True where query o_m may see key o_n: inside both sequences and, if causal, not later."""
    if IS_CAUSAL:
        m_visible = o_n[None, :] <= o_m[:, None] + (seq_kv - seq_q)
        if not EVEN_N:
            m_visible = m_visible & (o_n[None, :] < seq_kv)
    else:
        m_visible = o_n[None, :] < seq_kv
    if not EVEN_M:
        m_visible = m_visible & (o_m[:, None] < seq_q)
    return m_visible


@triton.jit
def _block_and_head(n_rows, BLOCK: tl.constexpr):
    """(first row of this program's block, flat batch * head index) from the 1-D launch grid.

    One grid axis, blocks of one head first: CUDA caps the second grid axis at 65535 programs, which
    batch * heads can pass (large-batch decode), while the first axis takes 2**31 - 1.
    """
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_rows, BLOCK)
    return (pid % n_blocks) * BLOCK, pid // n_blocks


@triton.jit
def _causal_key_end(start_m, seq_q, seq_kv, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """One past the last key any row of the query block [start_m, start_m + BLOCK_M) may see."""
    if IS_CAUSAL:
        return tl.maximum(tl.minimum(seq_kv, start_m + BLOCK_M + seq_kv - seq_q), 0)
    else:
        return seq_kv


@triton.jit
def _unmasked_key_end(start_m, seq_q, seq_kv, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """Key blocks before this multiple of BLOCK_N need no mask: every key is inside seq_kv and, if causal,
    already visible to the first (so to every) row of the query block. Only the blocks after it are masked."""
    end = seq_kv
    if IS_CAUSAL:
        end = tl.minimum(end, tl.maximum(start_m + seq_kv - seq_q + 1, 0))
    return (end // BLOCK_N) * BLOCK_N  # end >= 0: floor and truncation agree


@triton.jit
def _scores(
    b_q,
    p_k,
    o_m,
    start_n,
    stride_kn,
    seq_q,
    seq_kv,
    head_dim,
    qk_scale_log2,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Base-2 scores q.k * scale * log2(e) of one [BM, BN] tile, -inf where ``MASKED`` hides a key."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    # Unmasked blocks lie inside seq_kv: their loads need no row bounds either.
    b_k = _load_rows(p_k, o_n, stride_kn, seq_kv, o_d, head_dim, EVEN_N or not MASKED, EVEN_D)  # [BN, BD]
    b_s = _dot(b_q, tl.trans(b_k), DOT_IN_FP32, DOT_PRECISION) * qk_scale_log2  # [BM, BN]
    if MASKED:
        b_s = tl.where(_visible(o_m, o_n, seq_q, seq_kv, IS_CAUSAL, True, EVEN_N), b_s, float("-inf"))
    return b_s


@triton.jit
def _row_max_over_keys(
    b_m,
    b_q,
    p_k,
    o_m,
    key_start,
    key_end,
    stride_kn,
    seq_q,
    seq_kv,
    head_dim,
    qk_scale_log2,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Two-pass forward, pass 1: the running row max of the base-2 scores over keys [key_start, key_end)."""
    for start_n in range(key_start, key_end, BLOCK_N):
        b_s = _scores(
            b_q, p_k, o_m, start_n, stride_kn, seq_q, seq_kv, head_dim, qk_scale_log2,
            MASKED, IS_CAUSAL, EVEN_N, EVEN_D, DOT_IN_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        b_m = tl.maximum(b_m, tl.max(b_s, 1))
    return b_m


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
    qk_scale_log2,
    MASKED: tl.constexpr,
    TWO_PASS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Add keys [key_start, key_end) to the row sums ``b_l`` and the unnormalised output ``b_acc``.

    Online softmax (flash): when a key block raises the running max m, rescale l and acc by
    exp2(m_old - m_new). ``TWO_PASS`` (tiled): m is already the final row max, so nothing is rescaled.
    """
    o_d = tl.arange(0, BLOCK_D)
    for start_n in range(key_start, key_end, BLOCK_N):
        b_s = _scores(
            b_q, p_k, o_m, start_n, stride_kn, seq_q, seq_kv, head_dim, qk_scale_log2,
            MASKED, IS_CAUSAL, EVEN_N, EVEN_D, DOT_IN_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        o_n = start_n + tl.arange(0, BLOCK_N)
        b_v = _load_rows(p_v, o_n, stride_vn, seq_kv, o_d, head_dim, EVEN_N or not MASKED, EVEN_D)  # [BN, BD]
        if TWO_PASS:
            # Rows with no visible key keep max -inf; shift them by 0 so exp2 gives 0, not NaN.
            b_p = tl.exp2(b_s - tl.where(b_m == float("-inf"), 0.0, b_m)[:, None])  # [BM, BN]
            b_l += tl.sum(b_p, 1)
            b_acc += _dot(b_p.to(b_v.dtype), b_v, DOT_IN_FP32, DOT_PRECISION)
        else:
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
            # A row that has seen no key yet has m = -inf; shift by 0 there so exp2 gives 0, not NaN.
            b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = tl.exp2(b_s - b_shift[:, None])  # [BM, BN]
            b_alpha = tl.exp2(b_m - b_shift)
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_acc = b_acc * b_alpha[:, None] + _dot(b_p.to(b_v.dtype), b_v, DOT_IN_FP32, DOT_PRECISION)
            b_m = b_m_new
    return b_m, b_l, b_acc


@triton.jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
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
    heads_q,
    group,
    seq_q,
    seq_kv,
    head_dim,
    qk_scale_log2,
    TWO_PASS: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (batch, query head).

    Flash (``TWO_PASS`` off): one pass over K/V with the online softmax.
    Tiled (``TWO_PASS`` on): pass 1 reads every K tile for each row's max score; pass 2 reads K again, and V,
    summing exp2(s2 - max) and exp2(s2 - max) @ V with no rescaling. Safe softmax, but K is read twice.
    Both output acc / l and the LSE m + log(l).
    """
    start_m, bh = _block_and_head(seq_q, BLOCK_M)
    b = (bh // heads_q).to(tl.int64)
    h = bh % heads_q
    h_kv = (h // group).to(tl.int64)
    h = h.to(tl.int64)

    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    p_q = Q + b * stride_qb + h * stride_qh
    p_k = K + b * stride_kb + h_kv * stride_kh
    p_v = V + b * stride_vb + h_kv * stride_vh
    b_q = _load_rows(p_q, o_m, stride_qm, seq_q, o_d, head_dim, EVEN_M, EVEN_D)  # [BM, BD]
    b_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    b_l = tl.zeros((BLOCK_M,), tl.float32)
    b_acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    # Causal: key blocks entirely in the future of every row of this block are skipped, not masked. Of the
    # rest, only the blocks after unmasked_end (the diagonal and a ragged last block) pay for a mask.
    key_end = _causal_key_end(start_m, seq_q, seq_kv, BLOCK_M, IS_CAUSAL)
    unmasked_end = _unmasked_key_end(start_m, seq_q, seq_kv, BLOCK_N, IS_CAUSAL)
    if TWO_PASS:
        b_m = _row_max_over_keys(
            b_m, b_q, p_k, o_m, 0, unmasked_end, stride_kn, seq_q, seq_kv, head_dim, qk_scale_log2,
            False, IS_CAUSAL, EVEN_N, EVEN_D, DOT_IN_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
        )  # fmt: skip
        b_m = _row_max_over_keys(
            b_m, b_q, p_k, o_m, unmasked_end, key_end, stride_kn, seq_q, seq_kv, head_dim, qk_scale_log2,
            True, IS_CAUSAL, EVEN_N, EVEN_D, DOT_IN_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
        )  # fmt: skip
    b_m, b_l, b_acc = _accumulate_over_keys(
        b_m, b_l, b_acc, b_q, p_k, p_v, o_m, 0, unmasked_end, stride_kn, stride_vn,
        seq_q, seq_kv, head_dim, qk_scale_log2,
        False, TWO_PASS, IS_CAUSAL, EVEN_N, EVEN_D, DOT_IN_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    b_m, b_l, b_acc = _accumulate_over_keys(
        b_m, b_l, b_acc, b_q, p_k, p_v, o_m, unmasked_end, key_end, stride_kn, stride_vn,
        seq_q, seq_kv, head_dim, qk_scale_log2,
        True, TWO_PASS, IS_CAUSAL, EVEN_N, EVEN_D, DOT_IN_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
    )  # fmt: skip

    # Rows that saw no key: l == 0 -> output 0 and LSE -inf.
    no_key = b_l == 0.0
    b_out = b_acc / tl.where(no_key, 1.0, b_l)[:, None]
    b_lse = tl.where(no_key, float("-inf"), (b_m + tl.log2(tl.where(no_key, 1.0, b_l))) * LN2)
    p_o = O + b * stride_ob + h * stride_oh
    _store_rows(p_o, b_out.to(O.dtype.element_ty), o_m, stride_om, seq_q, o_d, head_dim, EVEN_M, EVEN_D)
    p_lse = LSE + bh.to(tl.int64) * seq_q + o_m
    if EVEN_M:
        tl.store(p_lse, b_lse)
    else:
        tl.store(p_lse, b_lse, mask=o_m < seq_q)


@triton.jit
def _flash_bwd_preprocess_kernel(
    O,
    DO,
    DLSE,
    DELTA,
    stride_ob,
    stride_oh,
    stride_om,
    stride_dob,
    stride_doh,
    stride_dom,
    heads_q,
    seq_q,
    head_dim,
    HAS_DLSE: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """delta_i = sum_d dO_id * O_id - dLSE_i, the per-row term of the softmax backward (fp32).

    With an LSE gradient: d lse_i / d s_ij = P_ij, so it folds into delta with a minus sign.
    """
    start_m, bh = _block_and_head(seq_q, BLOCK_M)
    b = (bh // heads_q).to(tl.int64)
    h = (bh % heads_q).to(tl.int64)
    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    b_o = _load_rows(O + b * stride_ob + h * stride_oh, o_m, stride_om, seq_q, o_d, head_dim, EVEN_M, EVEN_D)
    b_do = _load_rows(
        DO + b * stride_dob + h * stride_doh, o_m, stride_dom, seq_q, o_d, head_dim, EVEN_M, EVEN_D
    )
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [BM]
    p_row = bh.to(tl.int64) * seq_q + o_m
    if HAS_DLSE:
        if EVEN_M:
            b_delta -= tl.load(DLSE + p_row)
        else:
            b_delta -= tl.load(DLSE + p_row, mask=o_m < seq_q, other=0.0)
    if EVEN_M:
        tl.store(DELTA + p_row, b_delta)
    else:
        tl.store(DELTA + p_row, b_delta, mask=o_m < seq_q)


@triton.jit
def _probabilities(
    b_q,
    b_k,
    o_m,
    o_n,
    b_lse2,
    seq_q,
    seq_kv,
    qk_scale_log2,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Recompute P = exp2(s2 - lse2) for a [BM, BN] tile from Q, K and the saved LSE.

    ``MASKED``: entries outside the sequences or in a row's future are set to 0. Unmasked tiles hold only
    visible keys; their rows past seq_q (zero Q, dO, LSE and delta) contribute exact zeros.
    """
    b_s = _dot(b_q, tl.trans(b_k), DOT_IN_FP32, DOT_PRECISION) * qk_scale_log2
    b_p = tl.exp2(b_s - b_lse2[:, None])
    if MASKED:
        b_p = tl.where(_visible(o_m, o_n, seq_q, seq_kv, IS_CAUSAL, EVEN_M, EVEN_N), b_p, 0.0)
    return b_p


@triton.jit
def _load_lse2(LSE, p_row, o_m, seq_q, EVEN_M: tl.constexpr):
    """Saved LSE in base 2; rows that saw no key (-inf) become 0 so exp2 never sees -inf - -inf."""
    if EVEN_M:
        b_lse = tl.load(LSE + p_row)
    else:
        b_lse = tl.load(LSE + p_row, mask=o_m < seq_q, other=0.0)
    return tl.where(b_lse == float("-inf"), 0.0, b_lse * LOG2E)


@triton.jit
def _dkdv_over_queries(
    b_dk,
    b_dv,
    b_k,
    b_v,
    p_q,
    p_do,
    LSE,
    DELTA,
    p_rows,
    o_n,
    query_start,
    query_end,
    stride_qm,
    stride_dom,
    seq_q,
    seq_kv,
    head_dim,
    qk_scale_log2,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Add the query blocks [query_start, query_end) of one query head to this key block's dK and dV:
    dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dK += dS^T Q (scaled by the caller)."""
    o_d = tl.arange(0, BLOCK_D)
    for start_m in range(query_start, query_end, BLOCK_M):
        o_m = start_m + tl.arange(0, BLOCK_M)
        b_q = _load_rows(p_q, o_m, stride_qm, seq_q, o_d, head_dim, EVEN_M, EVEN_D)  # [BM, BD]
        b_do = _load_rows(p_do, o_m, stride_dom, seq_q, o_d, head_dim, EVEN_M, EVEN_D)  # [BM, BD]
        b_lse2 = _load_lse2(LSE, p_rows + o_m, o_m, seq_q, EVEN_M)
        if EVEN_M:
            b_delta = tl.load(DELTA + p_rows + o_m)
        else:
            b_delta = tl.load(DELTA + p_rows + o_m, mask=o_m < seq_q, other=0.0)
        b_p = _probabilities(
            b_q, b_k, o_m, o_n, b_lse2, seq_q, seq_kv, qk_scale_log2,
            MASKED, IS_CAUSAL, EVEN_M, EVEN_N, DOT_IN_FP32, DOT_PRECISION,
        )  # fmt: skip
        b_dv += _dot(tl.trans(b_p.to(b_do.dtype)), b_do, DOT_IN_FP32, DOT_PRECISION)
        b_dp = _dot(b_do, tl.trans(b_v), DOT_IN_FP32, DOT_PRECISION)  # [BM, BN]
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dk += _dot(tl.trans(b_ds.to(b_q.dtype)), b_q, DOT_IN_FP32, DOT_PRECISION)
    return b_dk, b_dv


@triton.jit
def _flash_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
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
    stride_dkb,
    stride_dkh,
    stride_dkn,
    stride_dvb,
    stride_dvh,
    stride_dvn,
    heads_q,
    heads_kv,
    group,
    seq_q,
    seq_kv,
    head_dim,
    qk_scale_log2,
    scale,
    IS_CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = one block of BLOCK_N keys of one (batch, kv head); it owns dK and dV for those keys.

    It walks every query head of the GQA group and every query block that can see these keys, recomputing
    P from Q, K and LSE:  dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dK += dS^T Q * scale.
    Each dK/dV element is written once by one program, in a fixed order: deterministic, no atomics.
    """
    start_n, bh = _block_and_head(seq_kv, BLOCK_N)
    b = (bh // heads_kv).to(tl.int64)
    h_kv = (bh % heads_kv).to(tl.int64)

    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    b_k = _load_rows(
        K + b * stride_kb + h_kv * stride_kh, o_n, stride_kn, seq_kv, o_d, head_dim, EVEN_N, EVEN_D
    )  # [BN, BD]
    b_v = _load_rows(
        V + b * stride_vb + h_kv * stride_vh, o_n, stride_vn, seq_kv, o_d, head_dim, EVEN_N, EVEN_D
    )  # [BN, BD]
    b_dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    b_dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)

    # Causal: query blocks before the first row that sees key start_n contribute nothing and are skipped;
    # from the first block whose rows all see every key of this block on, no mask is needed.
    if IS_CAUSAL:
        first_row = tl.maximum(start_n - (seq_kv - seq_q), 0)
        query_start = (first_row // BLOCK_M) * BLOCK_M
        all_see_row = tl.maximum(start_n + BLOCK_N - 1 - (seq_kv - seq_q), 0)
        masked_end = tl.minimum(tl.cdiv(all_see_row, BLOCK_M) * BLOCK_M, seq_q)
    else:
        query_start = 0
        masked_end = 0
    if not EVEN_N:
        # A ragged last key block masks its keys past seq_kv against every query block.
        masked_end = tl.where(start_n + BLOCK_N > seq_kv, seq_q, masked_end)
    for g in range(0, group):
        h = (h_kv * group + g).to(tl.int64)
        p_q = Q + b * stride_qb + h * stride_qh
        p_do = DO + b * stride_dob + h * stride_doh
        p_rows = (b * heads_q + h) * seq_q
        b_dk, b_dv = _dkdv_over_queries(
            b_dk, b_dv, b_k, b_v, p_q, p_do, LSE, DELTA, p_rows, o_n, query_start, masked_end,
            stride_qm, stride_dom, seq_q, seq_kv, head_dim, qk_scale_log2,
            True, IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, DOT_IN_FP32, DOT_PRECISION, BLOCK_M, BLOCK_D,
        )  # fmt: skip
        b_dk, b_dv = _dkdv_over_queries(
            b_dk, b_dv, b_k, b_v, p_q, p_do, LSE, DELTA, p_rows, o_n, masked_end, seq_q,
            stride_qm, stride_dom, seq_q, seq_kv, head_dim, qk_scale_log2,
            False, IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, DOT_IN_FP32, DOT_PRECISION, BLOCK_M, BLOCK_D,
        )  # fmt: skip

    b_dk *= scale
    _store_rows(
        DK + b * stride_dkb + h_kv * stride_dkh,
        b_dk.to(DK.dtype.element_ty),
        o_n,
        stride_dkn,
        seq_kv,
        o_d,
        head_dim,
        EVEN_N,
        EVEN_D,
    )
    _store_rows(
        DV + b * stride_dvb + h_kv * stride_dvh,
        b_dv.to(DV.dtype.element_ty),
        o_n,
        stride_dvn,
        seq_kv,
        o_d,
        head_dim,
        EVEN_N,
        EVEN_D,
    )


@triton.jit
def _dq_over_keys(
    b_dq,
    b_q,
    b_do,
    b_lse2,
    b_delta,
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
    qk_scale_log2,
    MASKED: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Add keys [key_start, key_end) to dQ: dP = dO V^T, dS = P * (dP - delta), dQ += dS K (scaled later)."""
    o_d = tl.arange(0, BLOCK_D)
    for start_n in range(key_start, key_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        # Unmasked blocks lie inside seq_kv: their loads need no row bounds either.
        b_k = _load_rows(p_k, o_n, stride_kn, seq_kv, o_d, head_dim, EVEN_N or not MASKED, EVEN_D)  # [BN, BD]
        b_v = _load_rows(p_v, o_n, stride_vn, seq_kv, o_d, head_dim, EVEN_N or not MASKED, EVEN_D)  # [BN, BD]
        b_p = _probabilities(
            b_q, b_k, o_m, o_n, b_lse2, seq_q, seq_kv, qk_scale_log2,
            MASKED, IS_CAUSAL, EVEN_M, EVEN_N, DOT_IN_FP32, DOT_PRECISION,
        )  # fmt: skip
        b_dp = _dot(b_do, tl.trans(b_v), DOT_IN_FP32, DOT_PRECISION)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq += _dot(b_ds.to(b_k.dtype), b_k, DOT_IN_FP32, DOT_PRECISION)
    return b_dq


@triton.jit
def _flash_bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DQ,
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
    heads_q,
    group,
    seq_q,
    seq_kv,
    head_dim,
    qk_scale_log2,
    scale,
    IS_CAUSAL: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (batch, query head); it owns dQ for those rows.

    Walks the visible key blocks (masking only the diagonal and ragged ones, as the forward does):
    dP = dO V^T, dS = P * (dP - delta), dQ += dS K * scale. Written once.
    """
    start_m, bh = _block_and_head(seq_q, BLOCK_M)
    b = (bh // heads_q).to(tl.int64)
    h = bh % heads_q
    h_kv = (h // group).to(tl.int64)
    h = h.to(tl.int64)

    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    p_k = K + b * stride_kb + h_kv * stride_kh
    p_v = V + b * stride_vb + h_kv * stride_vh
    b_q = _load_rows(Q + b * stride_qb + h * stride_qh, o_m, stride_qm, seq_q, o_d, head_dim, EVEN_M, EVEN_D)
    b_do = _load_rows(
        DO + b * stride_dob + h * stride_doh, o_m, stride_dom, seq_q, o_d, head_dim, EVEN_M, EVEN_D
    )
    p_rows = bh.to(tl.int64) * seq_q + o_m
    b_lse2 = _load_lse2(LSE, p_rows, o_m, seq_q, EVEN_M)
    if EVEN_M:
        b_delta = tl.load(DELTA + p_rows)
    else:
        b_delta = tl.load(DELTA + p_rows, mask=o_m < seq_q, other=0.0)
    b_dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    key_end = _causal_key_end(start_m, seq_q, seq_kv, BLOCK_M, IS_CAUSAL)
    unmasked_end = _unmasked_key_end(start_m, seq_q, seq_kv, BLOCK_N, IS_CAUSAL)
    b_dq = _dq_over_keys(
        b_dq, b_q, b_do, b_lse2, b_delta, p_k, p_v, o_m, 0, unmasked_end, stride_kn, stride_vn,
        seq_q, seq_kv, head_dim, qk_scale_log2,
        False, IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, DOT_IN_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
    )  # fmt: skip
    b_dq = _dq_over_keys(
        b_dq, b_q, b_do, b_lse2, b_delta, p_k, p_v, o_m, unmasked_end, key_end, stride_kn, stride_vn,
        seq_q, seq_kv, head_dim, qk_scale_log2,
        True, IS_CAUSAL, EVEN_M, EVEN_N, EVEN_D, DOT_IN_FP32, DOT_PRECISION, BLOCK_N, BLOCK_D,
    )  # fmt: skip

    b_dq *= scale
    _store_rows(
        DQ + b * stride_dqb + h * stride_dqh,
        b_dq.to(DQ.dtype.element_ty),
        o_m,
        stride_dqm,
        seq_q,
        o_d,
        head_dim,
        EVEN_M,
        EVEN_D,
    )
