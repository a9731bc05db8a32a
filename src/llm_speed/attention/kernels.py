"""Triton kernels for attention: FlashAttention forward and backward, and the two-pass tiled forward, for
dense ``[batch, heads, seq, head_dim]`` tensors and for packed variable-length sequences.

All kernels run on a 1-D grid of (row block, head) programs (see :func:`_program`) and use 64-bit offsets for
everything that multiplies a batch, head or row index by a stride.

Naming follows one convention: ``p_`` pointers, ``b_`` blocks held on chip, ``o_`` offsets, ``m_`` masks;
shape comments use BM (query rows per block), BN (key rows per block) and BD (head_dim padded to a power of
two). Scores are kept in base 2: ``s2 = s * log2(e)`` with ``s = q.k * scale`` (or ``softcap * tanh(s /
softcap)``), so that ``exp(s) == exp2(s2)``; ``exp2`` is the cheap instruction. The LSE stored in HBM is in
natural-log units.

Visibility (``reference.visible`` is the spec): with ``p = i + seq_kv - seq_q`` per sequence, query i sees
key j when ``p - left <= j <= p + right``; a causal mask is ``right = 0``. Each kernel splits its loop over
blocks into three: masked blocks on the left edge of the window, unmasked interior blocks every row of the
program's block fully sees, masked blocks on the right edge (the diagonal and a ragged last block). Blocks
no row may see are not visited at all, so the work grows with the window, not with the sequence.

Constexpr switches specialise one body per variant instead of near-copies:
  TWO_PASS       the tiled forward (row max first, then sums without rescaling) instead of flash's online one
  HAS_LEFT       the window has a left bound ``window_left`` (else keys reach back to the sequence start)
  HAS_RIGHT      the window has a right bound ``window_right`` (causal: 0; else keys reach the sequence end)
  SOFTCAP        scores are capped: ``softcap * tanh(s / softcap)`` (Gemma 2, arXiv:2408.00118)
  IS_VARLEN      packed sequences: rows of sequence b are ``cu_seqlens[b] .. cu_seqlens[b + 1] - 1`` of one
                 ``[total, heads, head_dim]`` tensor (flash-attn's varlen layout), lengths read on device
  MASKED         this loop over blocks applies the visibility and bounds masks to the scores
  EVEN_M/EVEN_N  seq_q / seq_kv is a multiple of the block: no row/column bounds masks on loads and stores
  EVEN_D         head_dim is already a power of two: no head_dim mask
  DOT_IN_FP32    widen tiles to fp32 before tl.dot; set only under the interpreter for bfloat16, whose tl.dot
                 there multiplies raw bit patterns. The tiles are still rounded to bfloat16 first, so the
                 bfloat16 arithmetic of the kernel is exercised.
  DOT_PRECISION  "ieee" for float32 inputs (no silent TF32 rounding); ignored for 16-bit inputs.
  RNE_BY_HAND    float32 -> bfloat16 casts round to nearest even by hand (the interpreter truncates); see
                 ``llm_speed.core.kernel_math``.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from ..core.kernel_math import cast

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
def _tanh(x):
    """tanh in fp32 from exp2 (libdevice is not available under the interpreter).

    ``(1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` never overflows; below |x| = 0.25, where ``1 - e`` would
    cancel, the Taylor series to x^9 is used (truncation error < 1e-8 relative).
    """
    a = tl.abs(x)
    e = tl.exp2(a * (-2.0 * LOG2E))
    big = (1.0 - e) / (1.0 + e)
    x2 = x * x
    small = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0)))))
    return tl.where(a < 0.25, small, tl.where(x < 0, -big, big))


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
def _load_vector(p, o_rows, n_rows, EVEN_ROWS: tl.constexpr):
    """Load one fp32 value per row (LSE, delta); rows past ``n_rows`` read 0."""
    if EVEN_ROWS:
        return tl.load(p + o_rows)
    else:
        return tl.load(p + o_rows, mask=o_rows < n_rows, other=0.0)


@triton.jit
def _store_vector(p, value, o_rows, n_rows, EVEN_ROWS: tl.constexpr):
    if EVEN_ROWS:
        tl.store(p + o_rows, value)
    else:
        tl.store(p + o_rows, value, mask=o_rows < n_rows)


@triton.jit
def _program(
    CU_Q,
    CU_K,
    BLOCK_STARTS,
    seq_q,
    seq_kv,
    heads,
    batch,
    grid_blocks,
    BLOCK: tl.constexpr,
    OVER_KEYS: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """Which rows this program owns: (first row of its block within its sequence, batch b, head h, first
    packed row of the sequence's queries and keys, the sequence's seq_q and seq_kv).

    One grid axis, the blocks of one head adjacent: CUDA caps the second grid axis at 65535 programs, which
    batch * heads can pass, while the first takes 2**31 - 1. Blocks are of queries, or with ``OVER_KEYS`` of
    keys (the dK/dV kernel).

    Dense: ``cdiv(seq, BLOCK)`` blocks per (batch, head). Varlen: ``grid_blocks`` programs per head, an upper
    bound known on the host without reading the lengths (``cdiv(total, BLOCK) + batch``: each sequence
    wastes at most one partial block); ``BLOCK_STARTS[b]`` (a device-side cumulative sum of per-sequence
    block counts, ``batch + 1`` entries) maps the program's block to its sequence by counting the sequences
    that end at or before it. Programs past the last block get empty sequences and write nothing.
    """
    pid = tl.program_id(0)
    if IS_VARLEN:
        blk = pid % grid_blocks
        h = pid // grid_blocks
        o_b = tl.arange(0, BLOCK_B)
        b_ends = tl.load(BLOCK_STARTS + 1 + o_b, mask=o_b < batch, other=blk + 1)
        b_count = tl.sum((b_ends <= blk).to(tl.int32), 0)
        spare = b_count >= batch
        b = tl.minimum(b_count, batch - 1)
        start = (blk - tl.load(BLOCK_STARTS + b)) * BLOCK
        bos_q = tl.load(CU_Q + b)
        bos_k = tl.load(CU_K + b)
        len_q = tl.where(spare, 0, tl.load(CU_Q + b + 1) - bos_q)
        len_k = tl.where(spare, 0, tl.load(CU_K + b + 1) - bos_k)
        return start, b.to(tl.int64), h.to(tl.int64), bos_q.to(tl.int64), len_q, bos_k.to(tl.int64), len_k
    else:
        if OVER_KEYS:
            n_blocks = tl.cdiv(seq_kv, BLOCK)
        else:
            n_blocks = tl.cdiv(seq_q, BLOCK)
        bh = pid // n_blocks
        zero = (pid * 0).to(tl.int64)
        return (
            (pid % n_blocks) * BLOCK,
            (bh // heads).to(tl.int64),
            (bh % heads).to(tl.int64),
            zero,
            seq_q,
            zero,
            seq_kv,
        )


@triton.jit
def _ranges(
    start,
    n_rows,
    lo_offset,
    hi_offset,
    full_lo_offset,
    full_hi_offset,
    n_cols,
    HAS_LO: tl.constexpr,
    HAS_HI: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Split the columns a block of rows may see into masked left edge, unmasked interior, masked right edge.

    Row r of the block ``[start, start + n_rows)`` sees columns ``r + lo_offset <= c <= r + hi_offset``
    (each side only when ``HAS_LO`` / ``HAS_HI``) inside ``[0, n_cols)``. Returns ``(lo, left_end, mid_lo,
    mid_hi, hi)``: loop masked over ``[lo, left_end)``, unmasked over ``[mid_lo, mid_hi)`` (whole blocks every
    row fully sees; ``full_*_offset`` give the row whose bound is the tightest) and masked over ``[mid_hi,
    hi)``. ``lo`` and ``mid_*`` are multiples of BLOCK; columns outside ``[lo, hi)`` are seen by no row.
    """
    lo = 0
    full_lo = 0
    if HAS_LO:
        lo = (tl.maximum(start + lo_offset, 0) // BLOCK) * BLOCK
        full_lo = tl.cdiv(tl.maximum(start + full_lo_offset, 0), BLOCK) * BLOCK
    hi = n_cols
    full_hi = n_cols
    if HAS_HI:
        hi = tl.maximum(tl.minimum(n_cols, start + n_rows + hi_offset), 0)
        full_hi = tl.maximum(tl.minimum(n_cols, start + full_hi_offset + 1), 0)
    mid_lo = tl.maximum(full_lo, lo)
    mid_hi = tl.maximum((full_hi // BLOCK) * BLOCK, mid_lo)
    return lo, tl.minimum(mid_lo, hi), mid_lo, mid_hi, hi


@triton.jit
def _key_ranges(
    start_m,
    seq_q,
    seq_kv,
    window_left,
    window_right,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Key ranges of a query block (forward, dQ): query i sees keys i + d - left .. i + d + right."""
    d = seq_kv - seq_q
    return _ranges(
        start_m, BLOCK_M, d - window_left, d + window_right, BLOCK_M - 1 + d - window_left, d + window_right,
        seq_kv, HAS_LO=HAS_LEFT, HAS_HI=HAS_RIGHT, BLOCK=BLOCK_N,
    )  # fmt: skip


@triton.jit
def _query_ranges(
    start_n,
    seq_q,
    seq_kv,
    window_left,
    window_right,
    EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Query ranges of a key block (dK/dV): key j is seen by queries j - d - right .. j - d + left."""
    d = seq_kv - seq_q
    lo, left_end, mid_lo, mid_hi, hi = _ranges(
        start_n, BLOCK_N, -d - window_right, window_left - d, BLOCK_N - 1 - d - window_right, window_left - d,
        seq_q, HAS_LO=HAS_RIGHT, HAS_HI=HAS_LEFT, BLOCK=BLOCK_M,
    )  # fmt: skip
    # Rows past seq_q in an unmasked query block contribute exact zeros (zero Q and dO, LSE and delta 0), so
    # without a left bound the interior reaches seq_q itself, not its last whole block.
    if not HAS_LEFT:
        mid_hi = tl.maximum(hi, mid_lo)
    if not EVEN_N:
        # A ragged last key block masks its keys past seq_kv against every query block.
        ragged = start_n + BLOCK_N > seq_kv
        left_end = tl.where(ragged, hi, left_end)
        mid_lo = tl.where(ragged, hi, mid_lo)
        mid_hi = tl.where(ragged, hi, mid_hi)
    return lo, left_end, mid_lo, mid_hi, hi


@triton.jit
def _visible(
    o_m,
    o_n,
    seq_q,
    seq_kv,
    window_left,
    window_right,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """[BM, BN] True where query o_m may see key o_n: inside both sequences and inside the window."""
    p = o_m[:, None] + (seq_kv - seq_q)
    if EVEN_N:
        m_visible = o_n[None, :] >= 0
    else:
        m_visible = o_n[None, :] < seq_kv
    if HAS_LEFT:
        m_visible = m_visible & (o_n[None, :] >= p - window_left)
    if HAS_RIGHT:
        m_visible = m_visible & (o_n[None, :] <= p + window_right)
    if not EVEN_M:
        m_visible = m_visible & (o_m[:, None] < seq_q)
    return m_visible


@triton.jit
def _capped_scores(b_qk, scale, softcap, SOFTCAP: tl.constexpr):
    """(base-2 scores s2, tanh of the cap or None) from raw q.k products ``b_qk`` [BM, BN]."""
    if SOFTCAP:
        b_t = _tanh(b_qk * (scale / softcap))
        return b_t * (softcap * LOG2E), b_t
    else:
        return b_qk * (scale * LOG2E), b_qk


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
    scale,
    softcap,
    window_left,
    window_right,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Base-2 scores of one [BM, BN] tile, -inf where ``MASKED`` hides a key."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    # Unmasked blocks lie inside seq_kv: their loads need no row bounds either.
    b_k = _load_rows(
        p_k, o_n, stride_kn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N or not MASKED, EVEN_D=EVEN_D
    )  # [BN, BD]
    b_qk = _dot(b_q, tl.trans(b_k), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)  # [BM, BN]
    b_s, _ = _capped_scores(b_qk, scale, softcap, SOFTCAP=SOFTCAP)
    if MASKED:
        m_visible = _visible(
            o_m, o_n, seq_q, seq_kv, window_left, window_right,
            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, EVEN_M=True, EVEN_N=EVEN_N,
        )  # fmt: skip
        b_s = tl.where(m_visible, b_s, float("-inf"))
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
    scale,
    softcap,
    window_left,
    window_right,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
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
            b_q, p_k, o_m, start_n, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, MASKED=MASKED, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
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
    scale,
    softcap,
    window_left,
    window_right,
    MASKED: tl.constexpr,
    TWO_PASS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
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
            b_q, p_k, o_m, start_n, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, MASKED=MASKED, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        )  # fmt: skip
        o_n = start_n + tl.arange(0, BLOCK_N)
        b_v = _load_rows(
            p_v, o_n, stride_vn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N or not MASKED, EVEN_D=EVEN_D
        )  # [BN, BD]
        if TWO_PASS:
            # Rows with no visible key keep max -inf; shift them by 0 so exp2 gives 0, not NaN.
            b_p = tl.exp2(b_s - tl.where(b_m == float("-inf"), 0.0, b_m)[:, None])  # [BM, BN]
            b_l += tl.sum(b_p, 1)
            b_p16 = cast(b_p, b_v.dtype, RNE_BY_HAND=RNE_BY_HAND)
            b_acc += _dot(b_p16, b_v, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        else:
            b_m_new = tl.maximum(b_m, tl.max(b_s, 1))
            # A row that has seen no key yet has m = -inf; shift by 0 there so exp2 gives 0, not NaN.
            b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
            b_p = tl.exp2(b_s - b_shift[:, None])  # [BM, BN]
            b_alpha = tl.exp2(b_m - b_shift)
            b_l = b_l * b_alpha + tl.sum(b_p, 1)
            b_p16 = cast(b_p, b_v.dtype, RNE_BY_HAND=RNE_BY_HAND)
            b_acc = b_acc * b_alpha[:, None] + _dot(
                b_p16, b_v, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION
            )
            b_m = b_m_new
    return b_m, b_l, b_acc


@triton.jit
def _attention_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
    CU_Q,
    CU_K,
    BLOCK_STARTS,
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
    heads_q,
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
    TWO_PASS: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (sequence, query head).

    Flash (``TWO_PASS`` off): one pass over K/V with the online softmax.
    Tiled (``TWO_PASS`` on): pass 1 reads every K tile for each row's max score; pass 2 reads K again, and V,
    summing exp2(s2 - max) and exp2(s2 - max) @ V with no rescaling. Safe softmax, but K is read twice.
    Both output acc / l and the LSE m + log(l).
    """
    start_m, b, h, bos_q, seq_q, bos_k, seq_kv = _program(
        CU_Q, CU_K, BLOCK_STARTS, seq_q, seq_kv, heads_q, batch, grid_blocks,
        BLOCK=BLOCK_M, OVER_KEYS=False, IS_VARLEN=IS_VARLEN, BLOCK_B=BLOCK_B,
    )  # fmt: skip
    h_kv = h // group

    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    p_q = Q + b * stride_qb + h * stride_qh + bos_q * stride_qm
    p_k = K + b * stride_kb + h_kv * stride_kh + bos_k * stride_kn
    p_v = V + b * stride_vb + h_kv * stride_vh + bos_k * stride_vn
    b_q = _load_rows(p_q, o_m, stride_qm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D)  # [BM, BD]
    b_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    b_l = tl.zeros((BLOCK_M,), tl.float32)
    b_acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    lo, left_end, mid_lo, mid_hi, hi = _key_ranges(
        start_m, seq_q, seq_kv, window_left, window_right,
        HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    if TWO_PASS:
        b_m = _row_max_over_keys(
            b_m, b_q, p_k, o_m, lo, left_end, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        )  # fmt: skip
        b_m = _row_max_over_keys(
            b_m, b_q, p_k, o_m, mid_lo, mid_hi, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, MASKED=False, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        )  # fmt: skip
        b_m = _row_max_over_keys(
            b_m, b_q, p_k, o_m, mid_hi, hi, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        )  # fmt: skip
    b_m, b_l, b_acc = _accumulate_over_keys(
        b_m, b_l, b_acc, b_q, p_k, p_v, o_m, lo, left_end, stride_kn, stride_vn, seq_q, seq_kv, head_dim,
        scale, softcap, window_left, window_right, MASKED=True, TWO_PASS=TWO_PASS, HAS_LEFT=HAS_LEFT,
        HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
        DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    b_m, b_l, b_acc = _accumulate_over_keys(
        b_m, b_l, b_acc, b_q, p_k, p_v, o_m, mid_lo, mid_hi, stride_kn, stride_vn, seq_q, seq_kv, head_dim,
        scale, softcap, window_left, window_right, MASKED=False, TWO_PASS=TWO_PASS, HAS_LEFT=HAS_LEFT,
        HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
        DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    b_m, b_l, b_acc = _accumulate_over_keys(
        b_m, b_l, b_acc, b_q, p_k, p_v, o_m, mid_hi, hi, stride_kn, stride_vn, seq_q, seq_kv, head_dim,
        scale, softcap, window_left, window_right, MASKED=True, TWO_PASS=TWO_PASS, HAS_LEFT=HAS_LEFT,
        HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
        DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )  # fmt: skip

    # Rows that saw no key: l == 0 -> output 0 and LSE -inf.
    no_key = b_l == 0.0
    b_out = b_acc / tl.where(no_key, 1.0, b_l)[:, None]
    b_lse = tl.where(no_key, float("-inf"), (b_m + tl.log2(tl.where(no_key, 1.0, b_l))) * LN2)
    p_o = O + b * stride_ob + h * stride_oh + bos_q * stride_om
    b_out = cast(b_out, O.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    _store_rows(p_o, b_out, o_m, stride_om, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D)
    _store_vector(LSE + b * stride_lb + h * stride_lh + bos_q, b_lse, o_m, seq_q, EVEN_ROWS=EVEN_M)


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
    stride_lb,
    stride_lh,
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
    b_o = _load_rows(p_o, o_m, stride_om, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D)
    b_do = _load_rows(p_do, o_m, stride_dom, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D)
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [BM]
    o_row = b * stride_lb + h * stride_lh
    if HAS_DLSE:
        b_delta -= _load_vector(DLSE + o_row, o_m, seq_q, EVEN_ROWS=EVEN_M)
    _store_vector(DELTA + o_row, b_delta, o_m, seq_q, EVEN_ROWS=EVEN_M)


@triton.jit
def _probabilities(
    b_q,
    b_k,
    o_m,
    o_n,
    b_lse2,
    seq_q,
    seq_kv,
    scale,
    softcap,
    window_left,
    window_right,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Recompute P = exp2(s2 - lse2) for a [BM, BN] tile from Q, K and the saved LSE, and the factor that
    takes dS back through the cap (1 - tanh^2, or 1 without a cap).

    ``MASKED``: entries outside the sequences or the window are set to 0. Unmasked tiles hold only visible
    keys; their rows past seq_q (zero Q, dO, LSE and delta) contribute exact zeros.
    """
    b_qk = _dot(b_q, tl.trans(b_k), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
    b_s, b_t = _capped_scores(b_qk, scale, softcap, SOFTCAP=SOFTCAP)
    b_p = tl.exp2(b_s - b_lse2[:, None])
    if MASKED:
        m_visible = _visible(
            o_m, o_n, seq_q, seq_kv, window_left, window_right,
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
    b_lse = _load_vector(p_lse, o_m, seq_q, EVEN_ROWS=EVEN_M)
    return tl.where(b_lse == float("-inf"), 0.0, b_lse * LOG2E)


@triton.jit
def _dkdv_over_queries(
    b_dk,
    b_dv,
    b_k,
    b_v,
    p_q,
    p_do,
    p_lse,
    p_delta,
    o_n,
    query_start,
    query_end,
    stride_qm,
    stride_dom,
    seq_q,
    seq_kv,
    head_dim,
    scale,
    softcap,
    window_left,
    window_right,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Add the query blocks [query_start, query_end) of one query head to this key block's dK and dV:
    dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta) * cap',  dK += dS^T Q (scaled by the caller)."""
    o_d = tl.arange(0, BLOCK_D)
    for start_m in range(query_start, query_end, BLOCK_M):
        o_m = start_m + tl.arange(0, BLOCK_M)
        # [BM, BD] tiles of Q and dO
        b_q = _load_rows(p_q, o_m, stride_qm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D)
        b_do = _load_rows(p_do, o_m, stride_dom, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D)
        b_lse2 = _load_lse2(p_lse, o_m, seq_q, EVEN_M=EVEN_M)
        b_delta = _load_vector(p_delta, o_m, seq_q, EVEN_ROWS=EVEN_M)
        b_p, b_dcap = _probabilities(
            b_q, b_k, o_m, o_n, b_lse2, seq_q, seq_kv, scale, softcap, window_left, window_right,
            MASKED=MASKED, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_M=EVEN_M,
            EVEN_N=EVEN_N, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        b_p16 = cast(b_p, b_do.dtype, RNE_BY_HAND=RNE_BY_HAND)
        b_dv += _dot(tl.trans(b_p16), b_do, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        b_dp = _dot(b_do, tl.trans(b_v), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)  # [BM, BN]
        b_ds = cast(b_p * (b_dp - b_delta[:, None]) * b_dcap, b_q.dtype, RNE_BY_HAND=RNE_BY_HAND)
        b_dk += _dot(tl.trans(b_ds), b_q, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
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
    CU_Q,
    CU_K,
    BLOCK_STARTS,
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
    stride_lb,
    stride_lh,
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
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program = one block of BLOCK_N keys of one (sequence, kv head); it owns dK and dV for those keys.

    It walks every query head of the GQA group and every query block that can see these keys, recomputing
    P from Q, K and LSE:  dV += P^T dO,  dP = dO V^T,  dS = P * (dP - delta) * cap',  dK += dS^T Q * scale.
    Each dK/dV element is written once by one program, in a fixed order: deterministic, no atomics.
    """
    start_n, b, h_kv, bos_q, seq_q, bos_k, seq_kv = _program(
        CU_Q, CU_K, BLOCK_STARTS, seq_q, seq_kv, heads_kv, batch, grid_blocks,
        BLOCK=BLOCK_N, OVER_KEYS=True, IS_VARLEN=IS_VARLEN, BLOCK_B=BLOCK_B,
    )  # fmt: skip

    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    p_k = K + b * stride_kb + h_kv * stride_kh + bos_k * stride_kn
    p_v = V + b * stride_vb + h_kv * stride_vh + bos_k * stride_vn
    b_k = _load_rows(p_k, o_n, stride_kn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D)  # [BN, BD]
    b_v = _load_rows(p_v, o_n, stride_vn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D)  # [BN, BD]
    b_dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    b_dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)

    lo, left_end, mid_lo, mid_hi, hi = _query_ranges(
        start_n, seq_q, seq_kv, window_left, window_right,
        EVEN_N=EVEN_N, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    for g in range(0, group):
        h = h_kv * group + g
        p_q = Q + b * stride_qb + h * stride_qh + bos_q * stride_qm
        p_do = DO + b * stride_dob + h * stride_doh + bos_q * stride_dom
        p_lse = LSE + b * stride_lb + h * stride_lh + bos_q
        p_delta = DELTA + b * stride_lb + h * stride_lh + bos_q
        b_dk, b_dv = _dkdv_over_queries(
            b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, o_n, lo, left_end, stride_qm, stride_dom,
            seq_q, seq_kv, head_dim, scale, softcap, window_left, window_right,
            MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_M=EVEN_M,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            RNE_BY_HAND=RNE_BY_HAND, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
        )  # fmt: skip
        b_dk, b_dv = _dkdv_over_queries(
            b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, o_n, mid_lo, mid_hi, stride_qm, stride_dom,
            seq_q, seq_kv, head_dim, scale, softcap, window_left, window_right,
            MASKED=False, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_M=EVEN_M,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            RNE_BY_HAND=RNE_BY_HAND, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
        )  # fmt: skip
        b_dk, b_dv = _dkdv_over_queries(
            b_dk, b_dv, b_k, b_v, p_q, p_do, p_lse, p_delta, o_n, mid_hi, hi, stride_qm, stride_dom,
            seq_q, seq_kv, head_dim, scale, softcap, window_left, window_right,
            MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_M=EVEN_M,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            RNE_BY_HAND=RNE_BY_HAND, BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D,
        )  # fmt: skip

    b_dk *= scale
    b_dk = cast(b_dk, DK.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    b_dv = cast(b_dv, DV.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    p_dk = DK + b * stride_dkb + h_kv * stride_dkh + bos_k * stride_dkn
    p_dv = DV + b * stride_dvb + h_kv * stride_dvh + bos_k * stride_dvn
    _store_rows(p_dk, b_dk, o_n, stride_dkn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D)
    _store_rows(p_dv, b_dv, o_n, stride_dvn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D)


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
    scale,
    softcap,
    window_left,
    window_right,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Add keys [key_start, key_end) to dQ: dP = dO V^T, dS = P * (dP - delta) * cap', dQ += dS K."""
    o_d = tl.arange(0, BLOCK_D)
    for start_n in range(key_start, key_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        # Unmasked blocks lie inside seq_kv: their loads need no row bounds either. The constexpr is spelled
        # inline: a name assigned in the loop body becomes a loop value for Triton 3.6 (compile error).
        b_k = _load_rows(
            p_k, o_n, stride_kn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N or not MASKED, EVEN_D=EVEN_D
        )
        b_v = _load_rows(
            p_v, o_n, stride_vn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N or not MASKED, EVEN_D=EVEN_D
        )
        b_p, b_dcap = _probabilities(
            b_q, b_k, o_m, o_n, b_lse2, seq_q, seq_kv, scale, softcap, window_left, window_right,
            MASKED=MASKED, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_M=EVEN_M,
            EVEN_N=EVEN_N, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
        b_dp = _dot(b_do, tl.trans(b_v), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        b_ds = cast(b_p * (b_dp - b_delta[:, None]) * b_dcap, b_k.dtype, RNE_BY_HAND=RNE_BY_HAND)
        b_dq += _dot(b_ds, b_k, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
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
    CU_Q,
    CU_K,
    BLOCK_STARTS,
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
    heads_q,
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
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    """One program = one block of BLOCK_M query rows of one (sequence, query head); it owns dQ for those rows.

    Walks the visible key blocks (masking only the edge and ragged ones, as the forward does):
    dP = dO V^T, dS = P * (dP - delta) * cap', dQ += dS K * scale. Written once.
    """
    start_m, b, h, bos_q, seq_q, bos_k, seq_kv = _program(
        CU_Q, CU_K, BLOCK_STARTS, seq_q, seq_kv, heads_q, batch, grid_blocks,
        BLOCK=BLOCK_M, OVER_KEYS=False, IS_VARLEN=IS_VARLEN, BLOCK_B=BLOCK_B,
    )  # fmt: skip
    h_kv = h // group

    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    p_k = K + b * stride_kb + h_kv * stride_kh + bos_k * stride_kn
    p_v = V + b * stride_vb + h_kv * stride_vh + bos_k * stride_vn
    p_q = Q + b * stride_qb + h * stride_qh + bos_q * stride_qm
    p_do = DO + b * stride_dob + h * stride_doh + bos_q * stride_dom
    b_q = _load_rows(p_q, o_m, stride_qm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D)
    b_do = _load_rows(p_do, o_m, stride_dom, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D)
    b_lse2 = _load_lse2(LSE + b * stride_lb + h * stride_lh + bos_q, o_m, seq_q, EVEN_M=EVEN_M)
    b_delta = _load_vector(DELTA + b * stride_lb + h * stride_lh + bos_q, o_m, seq_q, EVEN_ROWS=EVEN_M)
    b_dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    lo, left_end, mid_lo, mid_hi, hi = _key_ranges(
        start_m, seq_q, seq_kv, window_left, window_right,
        HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    b_dq = _dq_over_keys(
        b_dq, b_q, b_do, b_lse2, b_delta, p_k, p_v, o_m, lo, left_end, stride_kn, stride_vn,
        seq_q, seq_kv, head_dim, scale, softcap, window_left, window_right,
        MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_M=EVEN_M, EVEN_N=EVEN_N,
        EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND,
        BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    b_dq = _dq_over_keys(
        b_dq, b_q, b_do, b_lse2, b_delta, p_k, p_v, o_m, mid_lo, mid_hi, stride_kn, stride_vn,
        seq_q, seq_kv, head_dim, scale, softcap, window_left, window_right,
        MASKED=False, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_M=EVEN_M, EVEN_N=EVEN_N,
        EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND,
        BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )  # fmt: skip
    b_dq = _dq_over_keys(
        b_dq, b_q, b_do, b_lse2, b_delta, p_k, p_v, o_m, mid_hi, hi, stride_kn, stride_vn,
        seq_q, seq_kv, head_dim, scale, softcap, window_left, window_right,
        MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, EVEN_M=EVEN_M, EVEN_N=EVEN_N,
        EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND,
        BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
    )  # fmt: skip

    b_dq *= scale
    b_dq = cast(b_dq, DQ.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    p_dq = DQ + b * stride_dqb + h * stride_dqh + bos_q * stride_dqm
    _store_rows(p_dq, b_dq, o_m, stride_dqm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D)
