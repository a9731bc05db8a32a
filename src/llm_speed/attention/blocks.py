"""The building blocks of the attention kernels, shared by the flash forward and backward and the
KV-cache decode: program mapping (which rows a program owns, longest first), tiles (loads and stores, row
offsets, paged rows), and scores (visibility, softcap, ALiBi, dropout, the online softmax and fp8 weights).
Conventions: :mod:`llm_speed.attention.flash`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.kernel_math import LOG2E, cast, dot, tanh, warp_uniform
from ..matmul.fp8 import fp8_constants, to_fp8
from .reference import FP8_WEIGHTS_OFFSET

MAX_TABLE_BLOCK = 64  # block-table entries checked per step by a paged attention program (forward, decode)
PAGE_SCAN: tl.constexpr = tl.constexpr(MAX_TABLE_BLOCK)
# fp8 attention: the weights P go to the PV product as e4m3 (FlashAttention-3, arXiv:2407.08608), computed as
# exp2(s2 - max + P8_OFFSET), i.e. scaled by 2**8 (FA3's Max_offset) so that they use e4m3's range up to 256
# (max 448) instead of [0, 1], where values below 2**-9 would flush to 0; the row sums carry the same factor.
P8_OFFSET: tl.constexpr = tl.constexpr(float(FP8_WEIGHTS_OFFSET))
_P8 = fp8_constants(torch.float8_e4m3fn)  # the cast's rounding constants (:func:`weights_as`)
P8_MAX: tl.constexpr = tl.constexpr(_P8["FP8_MAX"])
P8_SHIFT: tl.constexpr = tl.constexpr(_P8["SHIFT"])
P8_ROUND_MASK: tl.constexpr = tl.constexpr(_P8["ROUND_MASK"])
P8_MIN_NORMAL: tl.constexpr = tl.constexpr(_P8["MIN_NORMAL"])
P8_SUBNORMAL_MAGIC: tl.constexpr = tl.constexpr(_P8["SUBNORMAL_MAGIC"])


@triton.jit
def _row_offsets(o_rows, stride_row, ROWS32: tl.constexpr):
    """``o_rows * stride_row`` as a column: 64-bit, as seq * stride can pass 2**31 for long sequences in a
    [B, S, H, D] layout, or 32-bit where the launcher found that every row of the tensors fits
    (:func:`rows_fit_32`): a 64-bit product per address cost the backward's dK/dV loop 47 of its 451 SASS
    instructions at d = 128 (sm_90a, Triton 3.6)."""
    if ROWS32:
        return o_rows[:, None] * stride_row
    else:
        return o_rows[:, None].to(tl.int64) * stride_row


@triton.jit
def load_rows(
    p_base, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
    ROWS32: tl.constexpr = False,
):  # fmt: skip
    """Load a [rows, BD] tile; rows past ``n_rows`` and columns past ``head_dim`` are not read (0)."""
    p = p_base + _row_offsets(o_rows, stride_row, ROWS32=ROWS32) + o_d[None, :]
    return _load_tile(p, o_rows, n_rows, o_d, head_dim, EVEN_ROWS=EVEN_ROWS, EVEN_D=EVEN_D)


@triton.jit
def load_parts(p_base, o_rows, stride_row, n_rows, head_dim, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
                HALVES: tl.constexpr, BLOCK_D: tl.constexpr, ROWS32: tl.constexpr = False):  # fmt: skip
    """:func:`load_rows` of a [rows, BD] tile as a tuple: (the tile,), or with ``HALVES`` its two
    [rows, BD / 2] halves along the head dim (each its own operand, in shared memory of its own)."""
    if HALVES:
        o_d = tl.arange(0, BLOCK_D // 2)
        return (
            load_rows(p_base, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS=EVEN_ROWS, EVEN_D=EVEN_D,
                       ROWS32=ROWS32),
            load_rows(p_base, o_rows, stride_row, n_rows, o_d + BLOCK_D // 2, head_dim, EVEN_ROWS=EVEN_ROWS,
                       EVEN_D=EVEN_D, ROWS32=ROWS32),
        )  # fmt: skip
    else:
        o_d = tl.arange(0, BLOCK_D)
        return (
            load_rows(p_base, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS=EVEN_ROWS, EVEN_D=EVEN_D,
                       ROWS32=ROWS32),
        )  # fmt: skip


@triton.jit
def load_kv(p_base, o_n, stride_row, n_rows, o_d, head_dim, b_page, b_slot, stride_page,
             EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr, PAGED: tl.constexpr,
             ROWS32: tl.constexpr = False):  # fmt: skip
    """Load a [BN, BD] tile of keys or values at positions ``o_n``: rows of ``p_base``, or with ``PAGED``
    slot ``b_slot`` of page ``b_page`` (:func:`cache_rows`; ``stride_page`` apart)."""
    if PAGED:
        p = p_base + (b_page * stride_page + b_slot * stride_row)[:, None] + o_d[None, :]
        return _load_tile(p, o_n, n_rows, o_d, head_dim, EVEN_ROWS=EVEN_ROWS, EVEN_D=EVEN_D)
    else:
        return load_rows(p_base, o_n, stride_row, n_rows, o_d, head_dim, EVEN_ROWS=EVEN_ROWS, EVEN_D=EVEN_D,
                          ROWS32=ROWS32)


@triton.jit
def load_columns(p_base, o_cols, stride_d, n_cols, o_d, head_dim, EVEN_COLS: tl.constexpr,
                  EVEN_D: tl.constexpr):  # fmt: skip
    """Load the [BD, cols] tile of a transposed ``[head_dim, seq]`` operand (positions ``o_cols`` contiguous,
    rows ``stride_d`` apart: V with ``V_TRANSPOSED``); columns past ``n_cols`` and rows past ``head_dim`` are
    not read (0)."""
    p = p_base + o_d[:, None].to(tl.int64) * stride_d + o_cols[None, :]
    if EVEN_COLS and EVEN_D:
        return tl.load(p)
    elif EVEN_COLS:
        return tl.load(p, mask=o_d[:, None] < head_dim, other=0.0)
    elif EVEN_D:
        return tl.load(p, mask=o_cols[None, :] < n_cols, other=0.0)
    else:
        return tl.load(p, mask=(o_d[:, None] < head_dim) & (o_cols[None, :] < n_cols), other=0.0)


@triton.jit
def _load_tile(p, o_rows, n_rows, o_d, head_dim, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load the [rows, BD] tile at pointers ``p``, masked as :func:`load_rows` says."""
    if EVEN_ROWS and EVEN_D:
        return tl.load(p)
    elif EVEN_ROWS:
        return tl.load(p, mask=o_d[None, :] < head_dim, other=0.0)
    elif EVEN_D:
        return tl.load(p, mask=o_rows[:, None] < n_rows, other=0.0)
    else:
        return tl.load(p, mask=(o_rows[:, None] < n_rows) & (o_d[None, :] < head_dim), other=0.0)


@triton.jit
def store_rows(
    p_base, value, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
    ROWS32: tl.constexpr = False,
):  # fmt: skip
    """Store a [rows, BD] tile, skipping rows past ``n_rows`` and columns past ``head_dim``."""
    p = p_base + _row_offsets(o_rows, stride_row, ROWS32=ROWS32) + o_d[None, :]
    if EVEN_ROWS and EVEN_D:
        tl.store(p, value)
    elif EVEN_ROWS:
        tl.store(p, value, mask=o_d[None, :] < head_dim)
    elif EVEN_D:
        tl.store(p, value, mask=o_rows[:, None] < n_rows)
    else:
        tl.store(p, value, mask=(o_rows[:, None] < n_rows) & (o_d[None, :] < head_dim))


@triton.jit
def add_rows(p_base, value, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS: tl.constexpr,
              EVEN_D: tl.constexpr, ROWS32: tl.constexpr = False):  # fmt: skip
    """Add a [rows, BD] fp32 tile to memory with atomics (other programs add to the same rows), skipping rows
    past ``n_rows`` and columns past ``head_dim``. Relaxed order: only the sum matters."""
    p = p_base + _row_offsets(o_rows, stride_row, ROWS32=ROWS32) + o_d[None, :]
    if EVEN_ROWS and EVEN_D:
        tl.atomic_add(p, value, sem="relaxed")
    elif EVEN_ROWS:
        tl.atomic_add(p, value, mask=o_d[None, :] < head_dim, sem="relaxed")
    elif EVEN_D:
        tl.atomic_add(p, value, mask=o_rows[:, None] < n_rows, sem="relaxed")
    else:
        tl.atomic_add(p, value, mask=(o_rows[:, None] < n_rows) & (o_d[None, :] < head_dim), sem="relaxed")


@triton.jit
def load_vector(p, o_rows, n_rows, EVEN_ROWS: tl.constexpr):
    """Load one fp32 value per row (LSE, delta); rows past ``n_rows`` read 0."""
    if EVEN_ROWS:
        return tl.load(p + o_rows)
    else:
        return tl.load(p + o_rows, mask=o_rows < n_rows, other=0.0)


@triton.jit
def store_vector(p, value, o_rows, n_rows, EVEN_ROWS: tl.constexpr):
    if EVEN_ROWS:
        tl.store(p + o_rows, value)
    else:
        tl.store(p + o_rows, value, mask=o_rows < n_rows)


@triton.jit
def weights_as(b_p, dtype: tl.constexpr, RNE_BY_HAND: tl.constexpr, GPU_CAST: tl.constexpr = True):
    """Softmax weights ``b_p`` (float32, >= 0) as the PV product's operand dtype: fp8 e4m3, else
    :func:`cast`.

    fp8: the weights are at most ``2**P8_OFFSET`` (256, inside e4m3's 448), so compiled they may take the
    GPU's cast alone (``GPU_CAST``: ``cvt.rn.satfinite``, round to nearest even, NaN kept) instead of the fp8
    GEMM's general cast (:func:`llm_speed.matmul.fp8.to_fp8`), which clamps and selects NaN first: 64
    FMNMX, 32 more conversions and the byte selects of a 32-weight thread's block (sm_90a). Under the
    interpreter, whose own cast is wrong, the general cast rounds by hand."""
    if dtype.is_fp8():
        if RNE_BY_HAND or not GPU_CAST:
            # (.value: the interpreter passes a global constexpr on as the wrapper, which int arithmetic
            # rejects)
            return to_fp8(b_p, FP8_MAX=P8_MAX.value, ROUND_BY_HAND=RNE_BY_HAND, SHIFT=P8_SHIFT.value,
                           ROUND_MASK=P8_ROUND_MASK.value, MIN_NORMAL=P8_MIN_NORMAL.value,
                           SUBNORMAL_MAGIC=P8_SUBNORMAL_MAGIC.value, dtype=dtype)  # fmt: skip
        return b_p.to(dtype)
    else:
        return cast(b_p, dtype, RNE_BY_HAND=RNE_BY_HAND)


@triton.jit
def descale_in_range(d):
    """Whether an fp8 descale is finite and > 0 (NaN fails both comparisons)."""
    return (d > 0.0) & (d < float("inf"))


@triton.jit
def negated_tile(b_x):
    """``-b_x``; an fp8 or bfloat16 tile by flipping its sign bits (exact; fp8 has no arithmetic of its own,
    and Triton's interpreter negates a bfloat16 tile's raw bits as an integer: 0.31 became -14.1)."""
    if b_x.dtype.is_fp8():
        return (b_x.to(tl.uint8, bitcast=True) ^ 0x80).to(b_x.dtype, bitcast=True)
    elif b_x.dtype.is_bf16():
        return (b_x.to(tl.uint16, bitcast=True) ^ 0x8000).to(b_x.dtype, bitcast=True)
    else:
        return -b_x


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _owned_rows(CU, o_b, batch, total):
    """Per sequence i (lanes ``o_b`` < batch): (first row, end row, valid) of the rows it owns in a packed
    tensor of ``total`` rows, read from ``CU`` (``cu_seqlens``, ``batch + 1`` entries) and always in bounds.

    The rows owned split ``[0, total)`` whatever CU holds: sequence 0 starts at 0, the last one ends at
    ``total``, and boundary i is the running maximum of ``CU[0..i]`` clamped to ``[0, total]``. For valid
    ``cu_seqlens`` (0 first, non-decreasing, last = total) that is CU itself. A sequence whose own entries
    differ from its owned bounds is invalid (a negative or decreasing entry, one past the total, a first
    entry other than 0, a last one other than total): its programs write NaN over the rows it owns and read
    nothing else, so no program reads or writes outside the tensors and the other sequences stay exact.
    """
    m_b = o_b < batch
    b_cu = tl.load(CU + o_b, mask=m_b, other=0)  # entry i: the first row of sequence i
    b_cu_next = tl.load(CU + 1 + o_b, mask=m_b, other=0)  # entry i + 1: its end
    b_max = tl.associative_scan(b_cu, 0, _max_combine)  # max of entries 0..i
    b_start = tl.where(o_b == 0, 0, tl.minimum(tl.maximum(b_max, 0), total))
    b_end = tl.minimum(tl.maximum(tl.maximum(b_max, b_cu_next), 0), total)
    b_end = tl.where(o_b == batch - 1, total, b_end)
    return b_start, b_end, (b_cu == b_start) & (b_cu_next == b_end)


@triton.jit
def _lane(values, this):
    """The entry of ``values`` at the one lane where ``this`` is true (0 where none is)."""
    return tl.sum(tl.where(this, values, 0), 0)


@triton.jit
def _longest_first(pid, n_blocks, pairs, section):
    """(query block, pair) of program ``pid`` in longest-first order (see :func:`program_block`): ``pairs``
    (batch, head) pairs of ``n_blocks`` blocks each, in sections of ``section`` pairs; within a section
    block-major, from the last block (under a causal mask the one that sees the most keys)."""
    per_section = section * n_blocks
    first = (pid // per_section) * section
    width = tl.minimum(section, pairs - first)
    rest = pid % per_section
    return n_blocks - 1 - rest // width, first + rest % width


@triton.jit
def program_block(
    CU_Q,
    CU_K,
    SEQUSED_K,
    seq_q,
    seq_kv,
    heads,
    batch,
    grid_blocks,
    section,
    BLOCK: tl.constexpr,
    OVER_KEYS: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    SEQUSED: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_B: tl.constexpr,
    LPT: tl.constexpr,
    UNIFORM: tl.constexpr = False,
):
    """Which rows this program owns: (first row of its block within its sequence, batch b, head h, first
    packed row of the sequence's queries and keys, the sequence's seq_q and seq_kv, whether its bounds are
    valid).

    One grid axis, the blocks of one head adjacent: CUDA caps the second grid axis at 65535 programs, which
    batch * heads can pass, while the first takes 2**31 - 1. Blocks are of queries, or with ``OVER_KEYS`` of
    keys (the dK/dV kernel).

    Dense: ``cdiv(seq, BLOCK)`` blocks per (batch, head), always valid. Varlen (``seq_q``, ``seq_kv`` are
    the packed totals): ``grid_blocks`` programs per head, an upper bound known on the host without reading
    the lengths (``cdiv(total, BLOCK) + batch``: each sequence wastes at most one partial block). Each
    program reads both ``cu_seqlens`` (``BLOCK_B`` >= batch lanes), sums the per-sequence block counts of
    the rows each sequence owns (:func:`_owned_rows`) and counts the sequences that end at or before its
    block. Programs past the last block get empty sequences and write nothing. An invalid sequence gets no
    rows on the other side (no key for a query block, no query for a key block): its programs read none
    and write NaN over their own rows.

    ``SEQUSED``: sequence b uses only its first ``SEQUSED_K[b]`` keys (flash-attn's ``seqused_k``); an entry
    below 0 or past the sequence's keys makes it invalid. ``PAGED`` (forward only): the keys live in pages
    (:func:`kv_pages`), sequence b has ``SEQUSED_K[b]`` keys (without ``SEQUSED``: ``CU_K[b + 1] - CU_K[b]``)
    from position 0, and ``seq_kv`` is the block table's capacity (pages per row x page size).

    Launch order. By default the blocks of one (batch, head) are adjacent, in row order. ``LPT`` (query
    blocks under causal-like masks, where a block's work grows with its index): longest first, as
    FlashAttention-3's LPT tile scheduler (Dao-AILab/flash-attention, ``SingleTileLPTScheduler``): the
    (batch, head) pairs go in sections of ``section`` (as many as keep their K and V in L2), and within a
    section the block index is the major axis, heaviest block first (:func:`_longest_first`), so the last
    programs to start are the shortest and the SMs finish together instead of waiting on the last head's
    diagonal blocks.

    ``UNIFORM`` (packed; :func:`~llm_speed.core.kernel_math.warp_uniform`): what a program reads of its
    sequence comes out of reductions across lanes, which ptxas cannot see the threads agree on; passed
    through ``redux.sync`` it sits in uniform registers, as a dense program's sizes do (sm_90a, d = 128,
    4 x 1024 tokens, the main loops in SASS instructions: forward 464 -> 431, dQ 370 -> 288, dK/dV 520 ->
    422).
    """
    pid = tl.program_id(0)
    if IS_VARLEN:
        if LPT:
            blk, h = _longest_first(pid, grid_blocks, heads, section)
        else:
            blk = pid % grid_blocks
            h = pid // grid_blocks
        o_b = tl.arange(0, BLOCK_B)
        b_start_q, b_end_q, b_valid_q = _owned_rows(CU_Q, o_b, batch, seq_q)
        if PAGED:
            b_start_k = tl.zeros_like(o_b)
            b_end_k = tl.zeros_like(o_b)
            b_valid_k = o_b >= 0
        else:
            b_start_k, b_end_k, b_valid_k = _owned_rows(CU_K, o_b, batch, seq_kv)
        if OVER_KEYS:
            b_blocks = tl.where(o_b < batch, tl.cdiv(b_end_k - b_start_k, BLOCK), 0)
        else:
            b_blocks = tl.where(o_b < batch, tl.cdiv(b_end_q - b_start_q, BLOCK), 0)
        b_block_end = tl.cumsum(b_blocks, 0)
        b_count = tl.sum(((o_b < batch) & (b_block_end <= blk)).to(tl.int32), 0)
        spare = b_count >= batch
        this = o_b == tl.minimum(b_count, batch - 1)
        start = (blk - _lane(b_block_end - b_blocks, this)) * BLOCK
        bos_q = _lane(b_start_q, this)
        bos_k = _lane(b_start_k, this)
        valid = _lane((b_valid_q & b_valid_k).to(tl.int32), this) != 0
        len_q = tl.where(spare, 0, _lane(b_end_q, this) - bos_q)
        len_k = tl.where(spare, 0, _lane(b_end_k, this) - bos_k)
        b = tl.minimum(b_count, batch - 1)
        if SEQUSED or PAGED:
            if SEQUSED:
                used = tl.load(SEQUSED_K + b)
            else:  # paged keys without seqused_k: the lengths cu_seqlens_k gives
                used = tl.load(CU_K + b + 1) - tl.load(CU_K + b)
            limit = seq_kv if PAGED else len_k
            valid = valid & (used >= 0) & (used <= limit)
            len_k = tl.where(spare, 0, tl.minimum(tl.maximum(used, 0), limit))
        if OVER_KEYS:
            len_q = tl.where(valid, len_q, 0)
        else:
            len_k = tl.where(valid, len_k, 0)
        start, b = warp_uniform(start, REDUX=UNIFORM), warp_uniform(b, REDUX=UNIFORM)
        bos_q, bos_k = warp_uniform(bos_q, REDUX=UNIFORM), warp_uniform(bos_k, REDUX=UNIFORM)
        len_q, len_k = warp_uniform(len_q, REDUX=UNIFORM), warp_uniform(len_k, REDUX=UNIFORM)
        valid = warp_uniform(valid, REDUX=UNIFORM) != 0
        b, h, bos_q, bos_k = b.to(tl.int64), h.to(tl.int64), bos_q.to(tl.int64), bos_k.to(tl.int64)
        return start, b, h, bos_q, len_q, bos_k, len_k, valid
    else:
        if OVER_KEYS:
            n_blocks = tl.cdiv(seq_kv, BLOCK)
        else:
            n_blocks = tl.cdiv(seq_q, BLOCK)
        if LPT:
            blk, bh = _longest_first(pid, n_blocks, batch * heads, section)
        else:
            blk = pid % n_blocks
            bh = pid // n_blocks
        zero = (pid * 0).to(tl.int64)
        return (
            blk * BLOCK,
            (bh // heads).to(tl.int64),
            (bh % heads).to(tl.int64),
            zero,
            seq_q,
            zero,
            seq_kv,
            pid >= 0,
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
def key_ranges(
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
def query_ranges(
    start_n,
    seq_q,
    seq_kv,
    window_left,
    window_right,
    WHOLE_INTERIOR: tl.constexpr,
    EVEN_N: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Query ranges of a key block (dK/dV): key j is seen by queries j - d - right .. j - d + left.
    ``WHOLE_INTERIOR``: the interior holds whole query blocks only, so that it loads and adds without row
    bounds; a ragged last block goes to the masked right edge."""
    d = seq_kv - seq_q
    lo, left_end, mid_lo, mid_hi, hi = _ranges(
        start_n, BLOCK_N, -d - window_right, window_left - d, BLOCK_N - 1 - d - window_right, window_left - d,
        seq_q, HAS_LO=HAS_RIGHT, HAS_HI=HAS_LEFT, BLOCK=BLOCK_M,
    )  # fmt: skip
    # Without a left bound every query from the diagonal on sees the keys: the interior reaches seq_q (rows
    # past it in a bounded load contribute exact zeros), or with ``WHOLE_INTERIOR`` its last whole block.
    if not HAS_LEFT:
        if WHOLE_INTERIOR:
            mid_hi = tl.maximum((hi // BLOCK_M) * BLOCK_M, mid_lo)
        else:
            mid_hi = tl.maximum(hi, mid_lo)
    if not EVEN_N:
        # A ragged last key block masks its keys past seq_kv against every query block.
        ragged = start_n + BLOCK_N > seq_kv
        left_end = tl.where(ragged, hi, left_end)
        mid_lo = tl.where(ragged, hi, mid_lo)
        mid_hi = tl.where(ragged, hi, mid_hi)
    return lo, left_end, mid_lo, mid_hi, hi


@triton.jit
def visible_mask(
    r_m,
    c_n,
    seq_q,
    seq_kv,
    window_left,
    window_right,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    EVEN_M: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """True where query ``r_m`` may see key ``c_n``: inside both sequences and inside the window. The indices
    come broadcastable to the tile's orientation: ``o_m[:, None]``, ``o_n[None, :]`` for a [BM, BN] tile of
    scores, ``o_m[None, :]``, ``o_n[:, None]`` for its transpose [BN, BM] (the dK/dV kernel's)."""
    p = r_m + (seq_kv - seq_q)
    if EVEN_N:
        m_visible = c_n >= 0
    else:
        m_visible = c_n < seq_kv
    if HAS_LEFT:
        m_visible = m_visible & (c_n >= p - window_left)
    if HAS_RIGHT:
        m_visible = m_visible & (c_n <= p + window_right)
    if not EVEN_M:
        m_visible = m_visible & (r_m < seq_q)
    return m_visible


@triton.jit
def alibi_bias(r_m, c_n, seq_q, seq_kv, slope2):
    """ALiBi's bias in base 2 (Press et al., arXiv:2108.12409): ``-slope * |p - j| * log2(e)`` with
    ``p = i + seq_kv - seq_q`` the query's key position, bottom-right aligned as the masks (flash-attn's
    convention). ``slope2`` is the head's slope times log2(e); either tile orientation."""
    return -slope2 * tl.abs(r_m + (seq_kv - seq_q) - c_n).to(tl.float32)


@triton.jit
def dropout_keep(seed, r_m, c_n, bh, rng_offset, dropout_p):
    """True where attention dropout keeps the (query ``r_m``, key ``c_n``) weight of (sequence, head) ``bh``.

    One Philox-4x32 draw (Salmon et al., SC 2011) per entry, counters (key, query, sequence * heads + head,
    the call's offset) and the call's seed as key: the mask is a function of the entry alone, so the forward,
    the backward (either orientation, any blocks) and :func:`llm_speed.attention.reference.dropout_keep`
    all see the same one."""
    c0 = c_n.to(tl.int32).to(tl.uint32, bitcast=True)  # counters broadcast to the tile inside Philox
    c1 = r_m.to(tl.int32).to(tl.uint32, bitcast=True)
    c2 = bh.to(tl.int32).to(tl.uint32, bitcast=True)
    c3 = rng_offset.to(tl.uint32, bitcast=True)
    draw, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    return tl.uint_to_uniform_float(draw) >= dropout_p


@triton.jit
def load_rng(RNG, DROPOUT: tl.constexpr):
    """(seed, counter offset) of this call's dropout, from the int64 pair ``RNG`` ((0, 0) without)."""
    if DROPOUT:
        return tl.load(RNG), tl.load(RNG + 1).to(tl.int32)
    else:
        return 0, 0


@triton.jit
def load_slope2(ALIBI, b, h, stride_ab, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of (sequence b, query head h) times log2(e) (0 without ALiBi)."""
    if HAS_ALIBI:
        return tl.load(ALIBI + b * stride_ab + h) * LOG2E
    else:
        return 0.0


@triton.jit
def capped_scores(b_qk, scale, softcap, SOFTCAP: tl.constexpr):
    """(base-2 scores s2, tanh of the cap or None) from raw q.k products ``b_qk`` [BM, BN]."""
    if SOFTCAP:
        b_t = tanh(b_qk * (scale / softcap))
        return b_t * (softcap * LOG2E), b_t
    else:
        return b_qk * (scale * LOG2E), b_qk


@triton.jit
def desc_origin(b, h, heads, seq, head_dim, bos, SEQ_MAJOR: tl.constexpr, IS_VARLEN: tl.constexpr):
    """(row, column) of sequence b, head h's first position in a tensor descriptor over the rows of a tensor
    (:func:`_tma_rows`): head-major, the ``[B * H * S, D]`` rows, ((b * H + h) * S, 0); with ``SEQ_MAJOR``,
    the ``[B * S, H * D]`` rows of a ``[B, S, H, D]`` one, (b * S, h * D), or with ``IS_VARLEN`` the ``[T,
    H * D]`` rows of packed sequences, (bos, h * D) (``bos``: the sequence's first row)."""
    if IS_VARLEN:
        return bos, (h * head_dim).to(tl.int32)  # (a descriptor takes 32-bit coordinates)
    elif SEQ_MAJOR:
        return b * seq, (h * head_dim).to(tl.int32)
    else:
        return (b * heads + h) * seq, 0


@triton.jit
def qk(
    b_q, p_k, start_n, stride_kn, seq_kv, head_dim, b_page, b_slot, stride_kpage, k_desc, desc_at,
    MASKED: tl.constexpr, PAGED: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TMA: tl.constexpr, ROWS32: tl.constexpr = False,
):  # fmt: skip
    """The raw q.k products [BM, BN] of the key block at ``start_n`` (K loaded as :func:`block_scores`
    says)."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    if TMA:
        b_k = k_desc.load([(desc_at[0] + start_n).to(tl.int32), desc_at[1]])  # [BN, BD]
    else:
        # Unmasked blocks lie inside seq_kv: their loads need no row bounds either.
        b_k = load_kv(
            p_k, o_n, stride_kn, seq_kv, o_d, head_dim, b_page, b_slot, stride_kpage,
            EVEN_ROWS=EVEN_N or not MASKED, EVEN_D=EVEN_D, PAGED=PAGED, ROWS32=ROWS32,
        )  # [BN, BD]  # fmt: skip
    return dot(b_q, tl.trans(b_k), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)  # [BM, BN]


@triton.jit
def scores_of(
    b_qk, o_m, start_n, seq_q, seq_kv, scale, softcap, window_left, window_right, slope2,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """(raw scores, factor) of the q.k products ``b_qk`` of the key block at ``start_n``
    (:func:`block_scores`)."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    if SOFTCAP:
        b_raw = tanh(b_qk * (scale / softcap))
        factor = softcap * LOG2E
    else:
        b_raw = b_qk
        factor = scale * LOG2E
    if HAS_ALIBI:
        b_raw = b_raw * factor + alibi_bias(o_m[:, None], o_n[None, :], seq_q, seq_kv, slope2)
        factor = 1.0
    if MASKED:
        m_visible = visible_mask(
            o_m[:, None], o_n[None, :], seq_q, seq_kv, window_left, window_right,
            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, EVEN_M=True, EVEN_N=EVEN_N,
        )  # fmt: skip
        b_raw = tl.where(m_visible, b_raw, float("-inf"))
    return b_raw, factor


@triton.jit
def block_scores(
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
    slope2,
    b_page,
    b_slot,
    stride_kpage,
    k_desc,
    desc_at,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    PAGED: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TMA: tl.constexpr = False,
    ROWS32: tl.constexpr = False,
):
    """(raw scores, factor) of one [BM, BN] tile: the base-2 scores are ``raw * factor`` (raw: q.k, or the
    cap's tanh; factor: scale * log2(e), or softcap * log2(e)), raw is -inf where ``MASKED`` hides a key.
    The forward folds the factor into its exp2 (one FFMA per score, ``exp2(raw * factor - m)``) and scales
    only the row maxima (max(raw) * factor == max(raw * factor): the factor is positive), instead of
    multiplying every score first. ALiBi's bias breaks that identity: with ``HAS_ALIBI`` raw is the base-2
    score itself (after the cap, as flash-attn) and the factor 1. ``TMA`` (unmasked blocks only): K comes
    through the tensor descriptor ``k_desc`` over the rows of K, this (sequence, head)'s starting at
    ``desc_at``."""
    b_qk = qk(
        b_q, p_k, start_n, stride_kn, seq_kv, head_dim, b_page, b_slot, stride_kpage, k_desc, desc_at,
        MASKED=MASKED, PAGED=PAGED, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
        DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
    )  # fmt: skip
    return scores_of(
        b_qk, o_m, start_n, seq_q, seq_kv, scale, softcap, window_left, window_right, slope2, MASKED=MASKED,
        HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, EVEN_N=EVEN_N,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip


@triton.jit
def kv_pages(p_table, b, o_n, seq_kv, stride_tb, stride_tp, page_size, PAGED: tl.constexpr):
    """(page, slot) of key positions ``o_n`` through sequence b's row of the block table (``PAGED``; else
    unused zeros): one small gather per key block, shared by the K and V loads."""
    if PAGED:
        return cache_rows(p_table, b, o_n, o_n < seq_kv, stride_tb, stride_tp, page_size, PAGED=True)
    else:
        return 0, 0


@triton.jit
def row_max_over_keys(
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
    slope2,
    p_table,
    b,
    stride_tb,
    stride_tp,
    page_size,
    stride_kpage,
    MASKED: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    PAGED: tl.constexpr,
    EVEN_N: tl.constexpr,
    EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROWS32: tl.constexpr,
):
    """Two-pass forward, pass 1: the running row max of the base-2 scores over keys [key_start, key_end)."""
    for start_n in range(key_start, key_end, BLOCK_N):
        b_page, b_slot = kv_pages(p_table, b, start_n + tl.arange(0, BLOCK_N), seq_kv, stride_tb, stride_tp,
                                page_size, PAGED=PAGED)  # fmt: skip
        b_raw, factor = block_scores(
            b_q, p_k, o_m, start_n, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, slope2, b_page, b_slot, stride_kpage, None, 0, MASKED=MASKED,
            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, PAGED=PAGED,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ROWS32=ROWS32,
        )  # fmt: skip
        b_m = tl.maximum(b_m, tl.max(b_raw, 1) * factor)
    return b_m


@triton.jit
def online_softmax(b_raw, factor, b_m, b_l, FP8: tl.constexpr):
    """One key block of the online softmax over base-2 scores ``raw * factor`` [BM, BN]: (float32 weights,
    the rescale factor of the rows so far, new row max, new row sums). ``FP8``: the weights scaled by
    ``2**P8_OFFSET`` for e4m3's range (one op per row; the sums carry the scale too)."""
    b_m_new = tl.maximum(b_m, tl.max(b_raw, 1) * factor)
    # A row that has seen no key yet has m = -inf; shift by 0 there so exp2 gives 0, not NaN.
    b_shift = tl.where(b_m_new == float("-inf"), 0.0, b_m_new)
    if FP8:
        b_p = tl.exp2(b_raw * factor - (b_shift - P8_OFFSET)[:, None])
    else:
        b_p = tl.exp2(b_raw * factor - b_shift[:, None])  # [BM, BN]: one FFMA, then exp2
    b_alpha = tl.exp2(b_m - b_shift)
    return b_p, b_alpha, b_m_new, b_l * b_alpha + tl.sum(b_p, 1)


# --- paged rows (the KV-cache decode and the paged forward) ---


@triton.jit
def cache_rows(BLOCK_TABLE, i_b, o_n, m_n, stride_btb, stride_btp, page_size, PAGED: tl.constexpr):
    """(page, slot) of key positions ``o_n`` of sequence ``i_b``, as int64 [BN]: through the block table
    when paged, else (i_b, o_n). Positions outside ``m_n`` do not read the table."""
    if PAGED:
        p_table = BLOCK_TABLE + i_b.to(tl.int64) * stride_btb + (o_n // page_size) * stride_btp
        b_page = tl.load(p_table, mask=m_n, other=0).to(tl.int64)
        return b_page, (o_n % page_size).to(tl.int64)
    else:
        return tl.zeros_like(o_n).to(tl.int64) + i_b, o_n.to(tl.int64)


@triton.jit
def has_bad_page(BLOCK_TABLE, i_b, first, last, stride_btb, stride_btp, num_blocks, BLOCK_P: tl.constexpr):
    """Whether a block-table entry of sequence ``i_b`` among logical pages [first, last) is outside
    [0, num_blocks)."""
    b_bad = tl.zeros([BLOCK_P], dtype=tl.int32)
    p_row = BLOCK_TABLE + i_b.to(tl.int64) * stride_btb
    for start in range(first, last, BLOCK_P):
        o_p = start + tl.arange(0, BLOCK_P)
        m_p = o_p < last
        b_page = tl.load(p_row + o_p * stride_btp, mask=m_p, other=0)
        b_bad += tl.where(m_p & ((b_page < 0) | (b_page >= num_blocks)), 1, 0)
    return tl.max(b_bad, 0) > 0
