"""FlashAttention (Dao et al., arXiv:2205.14135 and arXiv:2307.08691) in Triton: the kernels of the whole
family (flash forward and backward, the two-pass tiled forward, packed variable-length sequences), their
launcher, and the ``flash_attention`` op.

Layout (every op module): kernels, launcher (configuration, plans, ``forward``/``backward`` implementations),
op registration, autograd, public function. ``tiled.py`` and ``varlen.py`` register their ops on the kernels
and launchers here; ``naive.py`` is plain PyTorch; the plain-PyTorch spec is
:func:`llm_speed.attention.reference.reference_attention`; the argument checks are ``checks.py``.

Kernels. All run on a 1-D grid of (row block, head) programs (see :func:`_program`) and use 64-bit offsets
for everything that multiplies a batch, head or row index by a stride.

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
                 ``[total, heads, head_dim]`` tensor (flash-attn's varlen layout), bounds read on device
  MASKED         this loop over blocks applies the visibility and bounds masks to the scores
  EVEN_M/EVEN_N  seq_q / seq_kv is a multiple of the block: no row/column bounds masks on loads and stores
  EVEN_D         head_dim is already a power of two: no head_dim mask
  TMA_KV         (16-bit forward, not paged) the unmasked interior loop loads K and V through tensor
                 descriptors; the backward's kernels take descriptors of their streamed tiles (Q_DESC, ...)
  DESC_SEQ_MAJOR the descriptors are over the rows of sequence-major ``[B, S, H, D]`` tensors
  ROWS32         row offsets in 32 bits: every row of every tensor fits (``rows_fit_32``)
  FP8_GPU_CAST   (fp8) the softmax weights take the GPU's own e4m3 cast (``_weights_as``)
  OVERLAP        (16-bit forward, Hopper) the unmasked interior loop issues the next block's QK^T before this
                 block's softmax, so that the two overlap (FlashAttention-3's intra-warpgroup pipelining,
                 arXiv:2407.08608 section 3.2; ``_accumulate_overlapped``)
  DOT_IN_FP32, DOT_PRECISION, RNE_BY_HAND
                 the switches of :mod:`llm_speed.core.kernel_math` (``dot_switches``): bfloat16 dots widened
                 and float32 -> bfloat16 casts rounded by hand under the interpreter only; "ieee" float32
                 products (no silent TF32).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..core import (
    autocast,  # torch.autocast rules
    runtime,
    tensors,
)
from ..core.args import check_flag
from ..core.config import KernelConfig
from ..core.dispatch import INFERENCE, Op, plain_call
from ..core.hardware import KIB, Hardware, hardware_of
from ..core.kernel_math import LN2, LOG2E, cast, dot, dot_switches, tanh, uniform_switch, warp_uniform
from ..core.launch import (
    TMA_ALIGN_BYTES,
    CallCache,
    Descriptor,
    Kernel,
    Plan,
    cdiv,
    next_power_of_2,
    plan_cache,
    tma_aligned,
)
from ..core.policy import LaunchPolicy, current_policy
from ..core.tiers import Tier, first_fitting
from ..core.tile_choice import SMALLEST_TILE_SIDE as MIN_DOT_DIM  # tl.dot needs every tile dim >= 16
from ..matmul.fp8 import fp8_constants, to_fp8
from .checks import (
    DESCALE_NAMES,
    FP8_DTYPES,
    check_alibi_slopes,
    check_descale_values,
    check_dropout,
    check_fp8_options,
    check_options,
    check_scale,
    check_seqlens_values,
    is_fp8_call,
    prepare_attention_inputs,
    suggest_keywords,
    unknown_keywords,
)
from .decode import MAX_TABLE_BLOCK, cache_rows, descale_strides, has_bad_page
from .reference import (
    FP8_WEIGHTS_OFFSET,
    reference_backward,
    reference_forward,
    varlen_reference_backward,
    varlen_reference_forward,
)

# --- kernels --------------------------------------------------------------------------------------------

PAGE_SCAN: tl.constexpr = tl.constexpr(MAX_TABLE_BLOCK)  # table entries a paged forward checks per step
# fp8 attention: the weights P go to the PV product as e4m3 (FlashAttention-3, arXiv:2407.08608), computed as
# exp2(s2 - max + P8_OFFSET), i.e. scaled by 2**8 (FA3's Max_offset) so that they use e4m3's range up to 256
# (max 448) instead of [0, 1], where values below 2**-9 would flush to 0; the row sums carry the same factor.
P8_OFFSET: tl.constexpr = tl.constexpr(float(FP8_WEIGHTS_OFFSET))
_P8 = fp8_constants(torch.float8_e4m3fn)  # the cast's rounding constants (:func:`_weights_as`)
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
def _load_rows(
    p_base, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
    ROWS32: tl.constexpr = False,
):  # fmt: skip
    """Load a [rows, BD] tile; rows past ``n_rows`` and columns past ``head_dim`` are not read (0)."""
    p = p_base + _row_offsets(o_rows, stride_row, ROWS32=ROWS32) + o_d[None, :]
    return _load_tile(p, o_rows, n_rows, o_d, head_dim, EVEN_ROWS=EVEN_ROWS, EVEN_D=EVEN_D)


@triton.jit
def _load_parts(p_base, o_rows, stride_row, n_rows, head_dim, EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr,
                HALVES: tl.constexpr, BLOCK_D: tl.constexpr, ROWS32: tl.constexpr = False):  # fmt: skip
    """:func:`_load_rows` of a [rows, BD] tile as a tuple: (the tile,), or with ``HALVES`` its two
    [rows, BD / 2] halves along the head dim (each its own operand, in shared memory of its own)."""
    if HALVES:
        o_d = tl.arange(0, BLOCK_D // 2)
        return (
            _load_rows(p_base, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS=EVEN_ROWS, EVEN_D=EVEN_D,
                       ROWS32=ROWS32),
            _load_rows(p_base, o_rows, stride_row, n_rows, o_d + BLOCK_D // 2, head_dim, EVEN_ROWS=EVEN_ROWS,
                       EVEN_D=EVEN_D, ROWS32=ROWS32),
        )  # fmt: skip
    else:
        o_d = tl.arange(0, BLOCK_D)
        return (
            _load_rows(p_base, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS=EVEN_ROWS, EVEN_D=EVEN_D,
                       ROWS32=ROWS32),
        )  # fmt: skip


@triton.jit
def _load_kv(p_base, o_n, stride_row, n_rows, o_d, head_dim, b_page, b_slot, stride_page,
             EVEN_ROWS: tl.constexpr, EVEN_D: tl.constexpr, PAGED: tl.constexpr,
             ROWS32: tl.constexpr = False):  # fmt: skip
    """Load a [BN, BD] tile of keys or values at positions ``o_n``: rows of ``p_base``, or with ``PAGED``
    slot ``b_slot`` of page ``b_page`` (``decode.cache_rows``; ``stride_page`` apart)."""
    if PAGED:
        p = p_base + (b_page * stride_page + b_slot * stride_row)[:, None] + o_d[None, :]
        return _load_tile(p, o_n, n_rows, o_d, head_dim, EVEN_ROWS=EVEN_ROWS, EVEN_D=EVEN_D)
    else:
        return _load_rows(p_base, o_n, stride_row, n_rows, o_d, head_dim, EVEN_ROWS=EVEN_ROWS, EVEN_D=EVEN_D,
                          ROWS32=ROWS32)


@triton.jit
def _load_columns(p_base, o_cols, stride_d, n_cols, o_d, head_dim, EVEN_COLS: tl.constexpr,
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
    """Load the [rows, BD] tile at pointers ``p``, masked as :func:`_load_rows` says."""
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
def _add_rows(p_base, value, o_rows, stride_row, n_rows, o_d, head_dim, EVEN_ROWS: tl.constexpr,
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
def _weights_as(b_p, dtype: tl.constexpr, RNE_BY_HAND: tl.constexpr, GPU_CAST: tl.constexpr = True):
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
def _descale_fine(d):
    """Whether an fp8 descale is finite and > 0 (NaN fails both comparisons)."""
    return (d > 0.0) & (d < float("inf"))


@triton.jit
def _negated(b_x):
    """``-b_x``; an fp8 tile by flipping its sign bits (exact; fp8 has no arithmetic of its own)."""
    if b_x.dtype.is_fp8():
        return (b_x.to(tl.uint8, bitcast=True) ^ 0x80).to(b_x.dtype, bitcast=True)
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
    """(query block, pair) of program ``pid`` in longest-first order (see :func:`_program`): ``pairs``
    (batch, head) pairs of ``n_blocks`` blocks each, in sections of ``section`` pairs; within a section
    block-major, from the last block (under a causal mask the one that sees the most keys)."""
    per_section = section * n_blocks
    first = (pid // per_section) * section
    width = tl.minimum(section, pairs - first)
    rest = pid % per_section
    return n_blocks - 1 - rest // width, first + rest % width


@triton.jit
def _program(
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
    (:func:`_pages`), sequence b has ``SEQUSED_K[b]`` keys (without ``SEQUSED``: ``CU_K[b + 1] - CU_K[b]``)
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
def _visible(
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
def _alibi(r_m, c_n, seq_q, seq_kv, slope2):
    """ALiBi's bias in base 2 (Press et al., arXiv:2108.12409): ``-slope * |p - j| * log2(e)`` with
    ``p = i + seq_kv - seq_q`` the query's key position, bottom-right aligned as the masks (flash-attn's
    convention). ``slope2`` is the head's slope times log2(e); either tile orientation."""
    return -slope2 * tl.abs(r_m + (seq_kv - seq_q) - c_n).to(tl.float32)


@triton.jit
def _dropout_keep(seed, r_m, c_n, bh, rng_offset, dropout_p):
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
def _load_rng(RNG, DROPOUT: tl.constexpr):
    """(seed, counter offset) of this call's dropout, from the int64 pair ``RNG`` ((0, 0) without)."""
    if DROPOUT:
        return tl.load(RNG), tl.load(RNG + 1).to(tl.int32)
    else:
        return 0, 0


@triton.jit
def _load_slope2(ALIBI, b, h, stride_ab, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of (sequence b, query head h) times log2(e) (0 without ALiBi)."""
    if HAS_ALIBI:
        return tl.load(ALIBI + b * stride_ab + h) * LOG2E
    else:
        return 0.0


@triton.jit
def _capped_scores(b_qk, scale, softcap, SOFTCAP: tl.constexpr):
    """(base-2 scores s2, tanh of the cap or None) from raw q.k products ``b_qk`` [BM, BN]."""
    if SOFTCAP:
        b_t = tanh(b_qk * (scale / softcap))
        return b_t * (softcap * LOG2E), b_t
    else:
        return b_qk * (scale * LOG2E), b_qk


@triton.jit
def _desc_origin(b, h, heads, seq, head_dim, bos, SEQ_MAJOR: tl.constexpr, IS_VARLEN: tl.constexpr):
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
def _qk(
    b_q, p_k, start_n, stride_kn, seq_kv, head_dim, b_page, b_slot, stride_kpage, k_desc, desc_at,
    MASKED: tl.constexpr, PAGED: tl.constexpr, EVEN_N: tl.constexpr, EVEN_D: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TMA: tl.constexpr, ROWS32: tl.constexpr = False,
):  # fmt: skip
    """The raw q.k products [BM, BN] of the key block at ``start_n`` (K loaded as :func:`_scores` says)."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    o_d = tl.arange(0, BLOCK_D)
    if TMA:
        b_k = k_desc.load([(desc_at[0] + start_n).to(tl.int32), desc_at[1]])  # [BN, BD]
    else:
        # Unmasked blocks lie inside seq_kv: their loads need no row bounds either.
        b_k = _load_kv(
            p_k, o_n, stride_kn, seq_kv, o_d, head_dim, b_page, b_slot, stride_kpage,
            EVEN_ROWS=EVEN_N or not MASKED, EVEN_D=EVEN_D, PAGED=PAGED, ROWS32=ROWS32,
        )  # [BN, BD]  # fmt: skip
    return dot(b_q, tl.trans(b_k), DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)  # [BM, BN]


@triton.jit
def _scores_of(
    b_qk, o_m, start_n, seq_q, seq_kv, scale, softcap, window_left, window_right, slope2,
    MASKED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, EVEN_N: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """(raw scores, factor) of the q.k products ``b_qk`` of the key block at ``start_n``
    (:func:`_scores`)."""
    o_n = start_n + tl.arange(0, BLOCK_N)
    if SOFTCAP:
        b_raw = tanh(b_qk * (scale / softcap))
        factor = softcap * LOG2E
    else:
        b_raw = b_qk
        factor = scale * LOG2E
    if HAS_ALIBI:
        b_raw = b_raw * factor + _alibi(o_m[:, None], o_n[None, :], seq_q, seq_kv, slope2)
        factor = 1.0
    if MASKED:
        m_visible = _visible(
            o_m[:, None], o_n[None, :], seq_q, seq_kv, window_left, window_right,
            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, EVEN_M=True, EVEN_N=EVEN_N,
        )  # fmt: skip
        b_raw = tl.where(m_visible, b_raw, float("-inf"))
    return b_raw, factor


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
    b_qk = _qk(
        b_q, p_k, start_n, stride_kn, seq_kv, head_dim, b_page, b_slot, stride_kpage, k_desc, desc_at,
        MASKED=MASKED, PAGED=PAGED, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
        DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
    )  # fmt: skip
    return _scores_of(
        b_qk, o_m, start_n, seq_q, seq_kv, scale, softcap, window_left, window_right, slope2, MASKED=MASKED,
        HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, EVEN_N=EVEN_N,
        BLOCK_N=BLOCK_N,
    )  # fmt: skip


@triton.jit
def _pages(p_table, b, o_n, seq_kv, stride_tb, stride_tp, page_size, PAGED: tl.constexpr):
    """(page, slot) of key positions ``o_n`` through sequence b's row of the block table (``PAGED``; else
    unused zeros): one small gather per key block, shared by the K and V loads."""
    if PAGED:
        return cache_rows(p_table, b, o_n, o_n < seq_kv, stride_tb, stride_tp, page_size, PAGED=True)
    else:
        return 0, 0


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
        b_page, b_slot = _pages(p_table, b, start_n + tl.arange(0, BLOCK_N), seq_kv, stride_tb, stride_tp,
                                page_size, PAGED=PAGED)  # fmt: skip
        b_raw, factor = _scores(
            b_q, p_k, o_m, start_n, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, slope2, b_page, b_slot, stride_kpage, None, 0, MASKED=MASKED,
            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, PAGED=PAGED,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ROWS32=ROWS32,
        )  # fmt: skip
        b_m = tl.maximum(b_m, tl.max(b_raw, 1) * factor)
    return b_m


@triton.jit
def _online_softmax(b_raw, factor, b_m, b_l, FP8: tl.constexpr):
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
    column: :func:`_desc_origin`).
    """
    o_d = tl.arange(0, BLOCK_D)
    for start_n in range(key_start, key_end, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)
        b_page, b_slot = _pages(p_table, b, o_n, seq_kv, stride_tb, stride_tp, page_size, PAGED=PAGED)
        b_raw, factor = _scores(
            b_q, p_k, o_m, start_n, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, slope2, b_page, b_slot, stride_kpage, k_desc, desc_at, MASKED=MASKED,
            HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, PAGED=PAGED,
            EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION,
            BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, TMA=TMA, ROWS32=ROWS32,
        )  # fmt: skip
        if TMA:
            b_v = v_desc.load([(desc_at[0] + start_n).to(tl.int32), desc_at[1]])  # [BN, BD]
        elif V_TRANSPOSED:  # a K-major B operand in shared memory, loaded by pipelined copies along the keys
            b_vt = _load_columns(p_v, o_n, stride_vn, seq_kv, o_d, head_dim, EVEN_COLS=EVEN_N or not MASKED,
                                 EVEN_D=EVEN_D)  # [BD, BN]  # fmt: skip
            b_v = tl.trans(b_vt)  # [BN, BD]
        else:
            b_v = _load_kv(
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
            b_p, b_alpha, b_m_new, b_l = _online_softmax(b_raw, factor, b_m, b_l, FP8=b_v.dtype.is_fp8())
            if DROPOUT:
                m_keep = _dropout_keep(seed, o_m[:, None], o_n[None, :], bh, rng_offset, dropout_p)
                b_p = tl.where(m_keep, b_p, 0.0)
            b_pv = _weights_as(b_p, b_v.dtype, RNE_BY_HAND=RNE_BY_HAND, GPU_CAST=FP8_GPU_CAST)
            b_acc = b_acc * b_alpha[:, None] + dot(b_pv, b_v, DOT_IN_FP32=DOT_IN_FP32,
                                                   DOT_PRECISION=DOT_PRECISION)  # fmt: skip
            b_m = b_m_new
    return b_m, b_l, b_acc


@triton.jit
def _online_step(
    b_qk, b_m, b_l, o_m, start_n, seq_q, seq_kv, scale, softcap, slope2, dtype: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, RNE_BY_HAND: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """:func:`_online_softmax` of one unmasked 16-bit key block's products ``b_qk``, the weights in ``dtype``
    for the PV product (no dropout)."""
    b_raw, factor = _scores_of(
        b_qk, o_m, start_n, seq_q, seq_kv, scale, softcap, 0, 0, slope2, MASKED=False, HAS_LEFT=False,
        HAS_RIGHT=False, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI, EVEN_N=True, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    b_p, b_alpha, b_m, b_l = _online_softmax(b_raw, factor, b_m, b_l, FP8=False)
    return _weights_as(b_p, dtype, RNE_BY_HAND=RNE_BY_HAND), b_alpha, b_m, b_l


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
        b_v = _load_kv(
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
    """:func:`_qk` of an unmasked, unpaged key block."""
    return _qk(
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
    probability ``dropout_p`` by :func:`_dropout_keep` from the seed and offset in ``RNG``, the kept ones
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
    K and V, with ``IS_VARLEN`` the ``[T, Hkv * D]`` rows of packed ones (:func:`_desc_origin`). ``ROWS32``:
    the row offsets of Q, K, V and O fit in 32 bits (:func:`_row_offsets`).
    """
    start_m, b, h, bos_q, seq_q, bos_k, seq_kv, valid = _program(
        CU_Q, CU_K, SEQUSED_K, seq_q, seq_kv, heads_q, batch, grid_blocks, section,
        BLOCK=BLOCK_M, OVER_KEYS=False, IS_VARLEN=IS_VARLEN, SEQUSED=SEQUSED, PAGED=PAGED, BLOCK_B=BLOCK_B,
        LPT=LPT, UNIFORM=UNIFORM,
    )  # fmt: skip
    h_kv = h // group
    slope2 = _load_slope2(ALIBI, b, h, stride_ab, HAS_ALIBI=HAS_ALIBI)
    seed, rng_offset = _load_rng(RNG, DROPOUT=DROPOUT)
    bh = b * heads_q + h
    desc_at = _desc_origin(b, h_kv, heads_q // group, seq_kv, head_dim, bos_k, SEQ_MAJOR=DESC_SEQ_MAJOR,
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
    b_q = _load_rows(p_q, o_m, stride_qm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                     ROWS32=ROWS32)  # [BM, BD]  # fmt: skip
    # fp8: q's and k's descales are factors of the scores (> 0: the sign stays), folded into the scale. One
    # that is not finite and > 0 (only with the host's value checks off) turns the rows it scales into NaN.
    if DESCALE_Q is not None:
        d_q = tl.load(DESCALE_Q + b * stride_dqb + h_kv * stride_dqh)
        valid = valid & _descale_fine(d_q)
        scale = scale * d_q
    if DESCALE_K is not None:
        d_k = tl.load(DESCALE_K + b * stride_dkb + h_kv * stride_dkh)
        valid = valid & _descale_fine(d_k)
        scale = scale * d_k
    if not SOFTCAP:
        # The exp2 fold (:func:`_scores`) needs a positive factor: a negative scale's sign moves into q
        # (``NEG_SCALE``, exact), and a zero scale becomes 1e-30 (every finite score * 1e-30 rounds to the
        # same weight, as with 0, while a hidden key's -inf stays -inf instead of becoming -inf * 0 = NaN).
        if NEG_SCALE:
            b_q = _negated(b_q)
        scale = tl.maximum(tl.abs(scale), 1e-30)
    b_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    b_l = tl.zeros((BLOCK_M,), tl.float32)
    b_acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    lo, left_end, mid_lo, mid_hi, hi = _key_ranges(
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
        b_m = _row_max_over_keys(
            b_m, b_q, p_k, o_m, lo, left_end, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, slope2, KV_TABLE, b, stride_tb, stride_tp, page_size, stride_kb,
            MASKED=True, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI,
            PAGED=PAGED, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
            DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ROWS32=ROWS32,
        )  # fmt: skip
        b_m = _row_max_over_keys(
            b_m, b_q, p_k, o_m, mid_lo, mid_hi, stride_kn, seq_q, seq_kv, head_dim, scale, softcap,
            window_left, window_right, slope2, KV_TABLE, b, stride_tb, stride_tp, page_size, stride_kb,
            MASKED=False, HAS_LEFT=HAS_LEFT, HAS_RIGHT=HAS_RIGHT, SOFTCAP=SOFTCAP, HAS_ALIBI=HAS_ALIBI,
            PAGED=PAGED, EVEN_N=EVEN_N, EVEN_D=EVEN_D, DOT_IN_FP32=DOT_IN_FP32,
            DOT_PRECISION=DOT_PRECISION, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D, ROWS32=ROWS32,
        )  # fmt: skip
        b_m = _row_max_over_keys(
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
        valid = valid & _descale_fine(d_v)
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
    _store_rows(p_o, b_out, o_m, stride_om, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                ROWS32=ROWS32)  # fmt: skip
    if LSE is not None:  # (None: an inference call that does not ask for it)
        _store_vector(LSE + b * stride_lb + h * stride_lh + bos_q, b_lse, o_m, seq_q, EVEN_ROWS=EVEN_M)


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
    b_o = _load_rows(p_o, o_m, stride_om, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                     ROWS32=ROWS32)  # fmt: skip
    b_do = _load_rows(p_do, o_m, stride_dom, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                      ROWS32=ROWS32)  # fmt: skip
    b_delta = tl.sum(b_o.to(tl.float32) * b_do.to(tl.float32), 1)  # [BM]
    o_row = b * stride_lb + h * stride_lh
    if HAS_DLSE:
        b_delta -= _load_vector(DLSE + o_row, o_m, seq_q, EVEN_ROWS=EVEN_M)
    _store_vector(DELTA + o_row, b_delta, o_m, seq_q, EVEN_ROWS=EVEN_M)
    b_lse2 = _load_lse2(LSE + o_row, o_m, seq_q, EVEN_M=EVEN_M)
    _store_vector(LSE2 + o_row, b_lse2, o_m, seq_q, EVEN_ROWS=EVEN_M)
    if ZERO_DQ:
        p_dq = DQ_ACC + b * stride_dqb + h * stride_dqh
        b_zero = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        _store_rows(p_dq, b_zero, o_m, stride_dqm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
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
    b_s, b_t = _capped_scores(b_qk, scale, softcap, SOFTCAP=SOFTCAP)
    if HAS_ALIBI:
        b_s += _alibi(r_m, c_n, seq_q, seq_kv, slope2)
    b_p = tl.exp2(b_s - b_lse2)
    if MASKED:
        m_visible = _visible(
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
    ``do_desc`` over their rows, this head's starting at ``desc_at`` (:func:`_desc_origin`).

    K, Q and dK are tuples (:func:`_load_parts`): the whole tile, or with ``D_HALVES`` (atomic dQ by
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
            b_q = _load_parts(p_q, o_m, stride_qm, seq_q, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                              HALVES=D_HALVES, BLOCK_D=BLOCK_D, ROWS32=LOADS32)  # fmt: skip
            b_do = _load_rows(p_do, o_m, stride_dom, seq_q, o_dv, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                              ROWS32=LOADS32)  # fmt: skip
        b_lse2 = _load_vector(p_lse2, o_m, seq_q, EVEN_ROWS=EVEN_M)
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
            m_keep = _dropout_keep(seed, o_m[None, :], o_n[:, None], bh, rng_offset, dropout_p)
            keep_scale = 1.0 / (1.0 - dropout_p)
            b_pt16 = cast(tl.where(m_keep, b_pt * keep_scale, 0.0), b_do.dtype, RNE_BY_HAND=RNE_BY_HAND)
        else:
            b_pt16 = cast(b_pt, b_do.dtype, RNE_BY_HAND=RNE_BY_HAND)
        if SOFTCAP:  # P * cap' now: one [BN, BM] tile held until dS instead of two
            b_pt = b_pt * b_dcap
        # dV before dP: P^T is dead before dP^T is live (fewer registers than the other order)
        b_dv += dot(b_pt16, b_do, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)  # [BN, BD]
        b_delta = _load_vector(p_delta, o_m, seq_q, EVEN_ROWS=EVEN_M)
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
                    _add_rows(p_dq, b_dq, o_m, stride_dqm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M,
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
    start_n, b, h_kv, bos_q, seq_q, bos_k, seq_kv, valid = _program(
        CU_Q, CU_K, SEQUSED_K, seq_q, seq_kv, heads_kv, batch, grid_blocks, 1,
        BLOCK=BLOCK_N, OVER_KEYS=True, IS_VARLEN=IS_VARLEN, SEQUSED=SEQUSED, PAGED=False, BLOCK_B=BLOCK_B,
        LPT=False, UNIFORM=UNIFORM,
    )  # fmt: skip

    o_n = start_n + tl.arange(0, BLOCK_N)
    o_dv = tl.arange(0, BLOCK_D)
    p_k = K + b * stride_kb + h_kv * stride_kh + bos_k * stride_kn
    p_v = V + b * stride_vb + h_kv * stride_vh + bos_k * stride_vn
    # K and dK: (the whole tile,) or with D_HALVES its two halves along the head dim (_dkdv_over_queries)
    b_k = _load_parts(p_k, o_n, stride_kn, seq_kv, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D, HALVES=D_HALVES,
                      BLOCK_D=BLOCK_D, ROWS32=ROWS32)  # fmt: skip
    if D_HALVES:
        b_dk = (tl.zeros((BLOCK_N, BLOCK_D // 2), tl.float32), tl.zeros((BLOCK_N, BLOCK_D // 2), tl.float32))
    else:
        b_dk = (tl.zeros((BLOCK_N, BLOCK_D), tl.float32),)
    b_v = _load_rows(p_v, o_n, stride_vn, seq_kv, o_dv, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D,
                     ROWS32=ROWS32)  # [BN, BD]  # fmt: skip
    b_dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)

    # A ragged last query block (packed sequences) leaves the interior for the masked edge, so that the
    # interior runs without row bounds (984 -> 865 SASS instructions at d = 128); not for float32, whose
    # FMA products spill in the loop with it (sm_89, Triton 3.6).
    WHOLE_INTERIOR: tl.constexpr = not EVEN_M and DOT_PRECISION != "ieee"
    lo, left_end, mid_lo, mid_hi, hi = _query_ranges(
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
    seed, rng_offset = _load_rng(RNG, DROPOUT=DROPOUT)
    for g in range(0, group):
        h = h_kv * group + g
        slope2 = _load_slope2(ALIBI, b, h, stride_ab, HAS_ALIBI=HAS_ALIBI)
        bh = b * heads_kv * group + h
        p_q = Q + b * stride_qb + h * stride_qh + bos_q * stride_qm
        p_do = DO + b * stride_dob + h * stride_doh + bos_q * stride_dom
        p_lse2 = LSE2 + b * stride_lb + h * stride_lh + bos_q
        p_delta = DELTA + b * stride_lb + h * stride_lh + bos_q
        p_dq = DQ + b * stride_dqb + h * stride_dqh + bos_q * stride_dqm
        # this head's first row and column in Q's and dO's descriptors, or the (head-major) accumulator's
        desc_at = _desc_origin(b, h, heads_kv * group, seq_q, head_dim, bos_q, SEQ_MAJOR=DESC_SEQ_MAJOR,
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
        _store_rows(p_dk, b_dk_part, o_n, stride_dkn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D,
                    ROWS32=ROWS32)  # fmt: skip
    if IS_VARLEN:
        b_dv = tl.where(valid, b_dv, float("nan"))
    b_dv = cast(b_dv, DV.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    _store_rows(p_dv, b_dv, o_n, stride_dvn, seq_kv, o_dv, head_dim, EVEN_ROWS=EVEN_N, EVEN_D=EVEN_D,
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
    ``v_desc`` over their rows, this (sequence, head)'s starting at ``desc_at`` (:func:`_desc_origin`)."""
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
            b_k = _load_rows(
                p_k, o_n, stride_kn, seq_kv, o_d, head_dim, EVEN_ROWS=EVEN_N or not MASKED, EVEN_D=EVEN_D,
                ROWS32=ROWS32,
            )
            b_v = _load_rows(
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
            m_keep = _dropout_keep(seed, o_m[:, None], o_n[None, :], bh, rng_offset, dropout_p)
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
    start_m, b, h, bos_q, seq_q, bos_k, seq_kv, valid = _program(
        CU_Q, CU_K, SEQUSED_K, seq_q, seq_kv, heads_q, batch, grid_blocks, section,
        BLOCK=BLOCK_M, OVER_KEYS=False, IS_VARLEN=IS_VARLEN, SEQUSED=SEQUSED, PAGED=False, BLOCK_B=BLOCK_B,
        LPT=LPT, UNIFORM=UNIFORM,
    )  # fmt: skip
    h_kv = h // group
    slope2 = _load_slope2(ALIBI, b, h, stride_ab, HAS_ALIBI=HAS_ALIBI)
    seed, rng_offset = _load_rng(RNG, DROPOUT=DROPOUT)
    bh = b * heads_q + h
    kv_at = _desc_origin(b, h_kv, heads_q // group, seq_kv, head_dim, bos_k, SEQ_MAJOR=DESC_SEQ_MAJOR,
                         IS_VARLEN=IS_VARLEN)  # K_DESC, V_DESC  # fmt: skip

    o_m = start_m + tl.arange(0, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    p_k = K + b * stride_kb + h_kv * stride_kh + bos_k * stride_kn
    p_v = V + b * stride_vb + h_kv * stride_vh + bos_k * stride_vn
    p_q = Q + b * stride_qb + h * stride_qh + bos_q * stride_qm
    p_do = DO + b * stride_dob + h * stride_doh + bos_q * stride_dom
    b_q = _load_rows(p_q, o_m, stride_qm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                     ROWS32=ROWS32)  # fmt: skip
    b_do = _load_rows(p_do, o_m, stride_dom, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
                      ROWS32=ROWS32)  # fmt: skip
    b_lse2 = _load_vector(LSE2 + b * stride_lb + h * stride_lh + bos_q, o_m, seq_q, EVEN_ROWS=EVEN_M)
    b_delta = _load_vector(DELTA + b * stride_lb + h * stride_lh + bos_q, o_m, seq_q, EVEN_ROWS=EVEN_M)
    b_dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)

    lo, left_end, mid_lo, mid_hi, hi = _key_ranges(
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
    _store_rows(p_dq, b_dq, o_m, stride_dqm, seq_q, o_d, head_dim, EVEN_ROWS=EVEN_M, EVEN_D=EVEN_D,
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


# --- launcher -------------------------------------------------------------------------------------------

FORWARD = Kernel(_attention_fwd_kernel, "flash_attention_fwd")
TILED = Kernel(_attention_fwd_kernel, "tiled_attention_fwd")  # the same body with TWO_PASS on
BACKWARD_PREPROCESS = Kernel(_flash_bwd_preprocess_kernel, "flash_attention_bwd_preprocess")
BACKWARD_DKDV = Kernel(_flash_bwd_dkdv_kernel, "flash_attention_bwd_dkdv")
BACKWARD_DQ = Kernel(_flash_bwd_dq_kernel, "flash_attention_bwd_dq")
BACKWARD_DQ_CONVERT = Kernel(_flash_bwd_dq_convert_kernel, "flash_attention_bwd_dq_convert")
# The backward's two paths (``tier_dq_kernel`` chooses the default): the atomic one adds dQ from the dK/dV
# kernel (five matmuls per tile, FlashAttention-2's), then converts the fp32 accumulator; the deterministic
# one has a dQ kernel of its own (every element one writer; seven matmuls per tile: S and dP recomputed).
ATOMIC_BACKWARD_KERNELS = (BACKWARD_PREPROCESS, BACKWARD_DKDV, BACKWARD_DQ_CONVERT)
DETERMINISTIC_BACKWARD_KERNELS = (BACKWARD_PREPROCESS, BACKWARD_DKDV, BACKWARD_DQ)

FP8_DTYPE = FP8_DTYPES[0]  # fp8 attention's q, k, v (FlashAttention-3's): e4m3 only
# The preprocess kernel (delta = rowsum(dO * O)) streams rows: Triton's default launch options.
PREPROCESS_WARPS, PREPROCESS_STAGES = 4, 3
# The dQ conversion (fp32 accumulator -> dQ) streams elements: 1024 per program, 4 warps.
CONVERT_BLOCK, CONVERT_WARPS = 1024, 4

# Block configurations, chosen by the device's shared memory per block.
#
# One fixed configuration per (direction, dtype class, padded head_dim): no autotuning (a call's cost must not
# depend on a first-call search). ``LARGE`` (227 KB per block: the Hopper-class entries of the GPU table)
# carries the 16-bit rows measured on an H100 SXM; its other rows are FULL's. Forward/dQ: Q [BM, BD] stays
# on chip while K and V [BN, BD] tiles stream through. dK/dV: K, V and the fp32 dK, dV accumulators [BN, BD]
# stay on chip while Q and dO [BM, BD] stream. 16-bit tiles use tensor cores; float32 uses an IEEE product
# (no TF32), which Triton runs on FMA units with both operands in registers: smaller tiles and 8 warps.
# bfloat16 tiles have the sizes of float16 ones.
#
# Tiers by shared memory per block (:class:`llm_speed.core.hardware.Hardware`): ``FULL`` needs at most 98 KiB
# (compiled as launched for the L4, ``tests/kernel_report/test_budgets.py``), so every GPU of the
# table with 99 KB or more per block (A100, H100, H200, B200, Ada) gets it; ``COMPACT`` (one pipeline stage,
# half-height key blocks) serves devices with less (V100's 96 KB, T4's 64 KB). Compiled for sm_90 with
# Triton 3.6, the FULL 16-bit configurations and float32 at head_dim <= 64 spill at most a few hundred bytes
# per thread; earlier float32 head_dim-64 tiles (128 x 64, 4 warps) spilled 11-17 KB per thread. The
# float32 rows at head_dim 128 and 256 are as small as they are because larger ones (forward 64x32, dK/dV
# 32x32 and 32x16) spilled inside their loops on packed sequences (``tests/kernel_report`` checks it).
#
# Under the interpreter (and wherever no CUDA device is involved) the H100 SXM entry of the GPU table stands
# in; the interpreter ignores num_warps and num_stages.

DIRECTIONS = ("forward", "backward")
DTYPE_CLASSES = (torch.float16, torch.float32)  # bfloat16 uses float16's row


@dataclasses.dataclass(frozen=True)
class AttentionTier(Tier):
    """Attention's configurations for devices with at least ``min_smem_bytes`` of shared memory per block.

    ``table[direction][dtype class][padded head_dim]`` is a :class:`KernelConfig` (``block_d`` unset: the
    row serves every head dim padded up to its key; :func:`attention_config` sets it).
    """

    table: dict


def _row(entries: dict) -> dict:
    return {dim: KernelConfig(*entry) for dim, entry in entries.items()}


# Per padded head_dim: (block_m, block_n, num_warps, num_stages).
FULL = AttentionTier(
    "99 KB",
    99 * KIB,
    {
        "forward": {
            torch.float16: _row({64: (128, 64, 4, 3), 128: (128, 32, 8, 2), 256: (64, 32, 8, 1)}),
            torch.float32: _row({64: (64, 32, 8, 2), 128: (32, 32, 8, 1), 256: (32, 32, 8, 1)}),
        },
        "backward": {
            torch.float16: _row({64: (64, 64, 4, 2), 128: (32, 64, 8, 2), 256: (32, 32, 8, 1)}),
            torch.float32: _row({64: (32, 32, 8, 2), 128: (16, 32, 8, 1), 256: (16, 16, 8, 1)}),
        },
    },
)


def _with(tier_table: dict, changes: dict) -> dict:
    """``tier_table`` with ``changes[direction][dtype][block_d]`` = (block_m, block_n, warps, stages)."""
    table = {
        direction: {dtype: dict(row) for dtype, row in by_dtype.items()}
        for direction, by_dtype in tier_table.items()
    }
    for direction, by_dtype in changes.items():
        for dtype, row in by_dtype.items():
            table[direction][dtype].update(_row(row))
    return table


# Devices with Hopper's 227 KB per block: larger 16-bit tiles, chosen by measurements on an H100 SXM
# (docs/guides/attention-hopper.md): forward 128x64 w8 s3 at d=64 and 128 (128x128 was no faster, and the
# overlapped loop's two score tiles spill there), backward d=128 64x64 w4 s2. Whether the tier's backward
# computes dQ in its own kernel is a launch choice (core.policy: ``backward_dq_kernel_tiers``).
LARGE = AttentionTier(
    "227 KB",
    227 * KIB,
    _with(
        FULL.table,
        {
            "forward": {torch.float16: {64: (128, 64, 8, 3), 128: (128, 64, 8, 3)}},
            "backward": {torch.float16: {128: (64, 64, 4, 2)}},
        },
    ),
)


def _compact(config: KernelConfig) -> KernelConfig:
    """FULL's configuration with one pipeline stage and half the key rows (at least 16, tl.dot's minimum)."""
    return dataclasses.replace(config, block_n=max(16, config.block_n // 2), num_stages=1)


COMPACT = AttentionTier(
    "under 99 KB",
    0,
    {
        direction: {
            dtype: {dim: _compact(cfg) for dim, cfg in row.items()} for dtype, row in by_dtype.items()
        }
        for direction, by_dtype in FULL.table.items()
    },
)

TIERS = (LARGE, FULL, COMPACT)  # largest first


def tier_for(hardware: Hardware) -> AttentionTier:
    """The attention tier of ``hardware`` (:func:`llm_speed.core.tiers.first_fitting`)."""
    return first_fitting(TIERS, hardware)


@functools.cache
def attention_config(direction: str, block_d: int, dtype: torch.dtype, hardware: Hardware) -> KernelConfig:
    """The blocks of the ``direction`` ("forward": the forward and dQ kernels; "backward": dK/dV) kernels for
    head_dim padded to ``block_d`` in ``dtype`` on ``hardware``: its tier's row, with ``block_d`` set."""
    by_dtype = tier_for(hardware).table[direction]
    row = by_dtype[torch.float32 if dtype == torch.float32 else torch.float16]
    return dataclasses.replace(row[max(64, block_d)], block_d=block_d)


class ShippedConfig(NamedTuple):
    """One entry of a tier's table."""

    tier: str
    direction: str
    dtype: torch.dtype  # float16 stands for bfloat16 too
    block_d: int
    config: KernelConfig


def shipped_configs() -> tuple[ShippedConfig, ...]:
    """Every configuration of every tier (tests run each directly and compile each for a GPU)."""
    return tuple(
        ShippedConfig(tier.name, direction, dtype, block_d, config)
        for tier in TIERS
        for direction in DIRECTIONS
        for dtype in DTYPE_CLASSES
        for block_d, config in tier.table[direction][dtype].items()
    )


def padded_head_dim(head_dim: int, dtype: torch.dtype | None = None) -> int:
    """head_dim padded to a power of two, at least :data:`MIN_DOT_DIM` (``BLOCK_D``); for fp8 at least 32,
    the K of an fp8 wgmma (a 16-wide fp8 q.k^T does not compile for sm_90a)."""
    return max(2 * MIN_DOT_DIM if dtype == FP8_DTYPE else MIN_DOT_DIM, next_power_of_2(head_dim))


# Plans. A plan's key holds everything that fixes its arguments: shapes, strides, dtypes, the mask (causal
# flag, window sizes, whether scores are capped), the layout and the device. Per call: the tensors, the
# scale and the cap (floats). Outputs are allocated contiguous, so their strides follow from the shapes.

_ROW_LETTER = {"q": "m", "o": "m", "do": "m", "dq": "m", "k": "n", "v": "n", "dk": "n", "dv": "n"}


def _contiguous_strides(shape: tuple) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(1, size)
    return tuple(reversed(strides))


def seq_major(shape: tuple, stride: tuple) -> bool:
    """Whether a dense ``[B, H, S, D]`` tensor steps over heads faster than over positions: a
    ``[B, S, H, D]`` one (flash-attn's and Hugging Face's layout, or a slice of a packed QKV) viewed with
    ``.transpose(1, 2)``. With one head both layouts are the same."""
    return shape[1] > 1 and stride[2] > stride[1]


def new_dense_output(shape: tuple, like_seq_major: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """The ``[B, H, S, D]`` output of a dense forward in q's order of dims: sequence-major when q is (then
    ``out.transpose(1, 2)`` is a contiguous ``[B, S, H, D]`` tensor, no copy), else contiguous."""
    if like_seq_major:
        batch, heads, seq, head_dim = shape
        return tensors.new_output((batch, seq, heads, head_dim), dtype, device).transpose(1, 2)
    return tensors.new_output(shape, dtype, device)


def _output_strides(q_shape: tuple, q_stride: tuple, varlen: bool) -> tuple:
    if not varlen and seq_major(q_shape, q_stride):
        batch, heads, seq, head_dim = q_shape
        return (seq * heads * head_dim, head_dim, heads * head_dim, 1)
    return _contiguous_strides(q_shape)


def rows_fit_32(varlen: bool, tensors, block_rows: int, block_d: int) -> bool:
    """Whether every in-tile offset ``row * stride_row + column`` of ``tensors``, each ``(rows, strides)`` of
    a dense ``[B, H, S, D]`` or packed ``[T, H, D]`` tensor, fits in 32 bits, for tiles of up to
    ``block_rows`` rows (a ragged last one reaches past the last row) and ``block_d`` columns: the kernels
    then compute them without a 64-bit multiply (``ROWS32``; batch, head and a packed sequence's start stay
    64-bit in the base pointer). Packed rows count from the sequence's start, bounded here by the total."""
    for rows, stride in tensors:
        stride_row = stride[0] if varlen else stride[2]
        if (rows + block_rows) * stride_row + block_d > 2**31 - 1:
            return False
    return True


def _stride_args(varlen: bool, **strides: tuple) -> dict:
    """Keyword arguments ``stride_<name>b/h/<row>`` of each named tensor's strides: (batch, head, row) of a
    dense ``[B, H, S, D]`` tensor, or of a packed ``[T, H, D]`` one as a single batch."""
    args = {}
    for name, stride in strides.items():
        stride_b, stride_h, stride_row = (0, stride[1], stride[0]) if varlen else stride[:3]
        args.update({f"stride_{name}b": stride_b, f"stride_{name}h": stride_h})
        args[f"stride_{name}{_ROW_LETTER[name]}"] = stride_row
    return args


def _lse_stride_args(lse_shape: tuple, varlen: bool) -> dict:
    """(batch, head) strides of a contiguous row statistic: dense ``[B, H, S]``, packed ``[H, T]``."""
    strides = _contiguous_strides(lse_shape)
    if varlen:
        return {"stride_lb": 0, "stride_lh": strides[0]}
    return {"stride_lb": strides[0], "stride_lh": strides[1]}


def _alibi_dims(alibi_slopes) -> int:
    """0 without ALiBi, else the dims of the slopes (1: ``[heads_q]``, 2: ``[batch, heads_q]``)."""
    return 0 if alibi_slopes is None else alibi_slopes.dim()


def _mask_args(is_causal: bool, left: int | None, right: int | None, capped: bool, alibi: int, heads_q: int,
               dropout: bool) -> dict:  # fmt: skip
    """The fixed arguments of the scores: the causal flag folded into the window's right side; ``alibi`` the
    dims of the slopes (0 without; 1: one per head; 2: ``[batch, heads_q]``); ``dropout`` on or off."""
    if is_causal:
        right = 0
    return {
        "stride_ab": heads_q if alibi == 2 else 0,
        "HAS_ALIBI": alibi > 0,
        "DROPOUT": dropout,
        "window_left": left if left is not None else 0,
        "window_right": right if right is not None else 0,
        "HAS_LEFT": left is not None,
        "HAS_RIGHT": right is not None,
        "SOFTCAP": capped,
    }


def _sizes(q_shape, k_shape, varlen: bool):
    """(heads_q, heads_kv, seq_q, seq_kv, head_dim); packed: seq_* are the totals."""
    if varlen:
        return q_shape[1], k_shape[1], q_shape[0], k_shape[0], q_shape[2]
    return q_shape[1], k_shape[1], q_shape[2], k_shape[2], q_shape[3]


def _grid(n_rows: int, block: int, batch: int, heads: int, varlen: bool) -> tuple[tuple[int], dict]:
    """1-D grid and the arguments that let each program find its rows (:func:`_program`).

    Dense: ``cdiv(seq, block)`` programs per (batch, head). Packed: ``cdiv(total, block) + batch`` per head,
    an upper bound on the real block count (each sequence wastes at most one partial block) known without
    reading the lengths back to the host; each program finds its sequence from ``cu_seqlens`` on the device.
    Spare programs exit having written nothing. A second grid axis would cap batch * heads at 65535 on CUDA.
    """
    if not varlen:
        return (cdiv(n_rows, block) * batch * heads,), {"batch": batch, "grid_blocks": 0, "BLOCK_B": 1}
    blocks = cdiv(n_rows, block) + batch
    return (blocks * heads,), {"batch": batch, "grid_blocks": blocks, "BLOCK_B": next_power_of_2(batch)}


def _launch_order(
    is_causal: bool, left, right, hardware: Hardware, pairs: int, kv_bytes: int, group: int, rows: int,
    policy: LaunchPolicy,
) -> dict:
    """The launch-order arguments of a query-block kernel (forward, dQ; :func:`_program`): longest first
    (``LPT``) in sections of ``section`` of its ``pairs`` (batch, head) pairs, or row order.

    Longest first only pays where a query block's work grows with its index: a causal mask, or a window
    bounded on the right only (a left bound makes the blocks alike), and only on long sequences (``rows``
    queries per sequence, packed: in all; at least ``policy.lpt_min_rows``). A section holds as many pairs as
    keep the K and V they stream (``kv_bytes`` per KV head, shared by ``group`` query heads) in the L2 at
    once, so that the programs running together still share their loads there; at least one. The dK/dV
    kernel keeps row order: its key blocks already start with the heaviest (the first keys see the most
    queries)."""
    min_rows = policy.lpt_min_rows
    if not (is_causal or right is not None) or left is not None or min_rows is None or rows < min_rows:
        return {"section": 1, "LPT": False}
    section = hardware.l2_bytes * group // max(1, kv_bytes)
    return {"section": min(max(1, section), pairs), "LPT": True}


def _paged_args(k_stride, v_stride, table_shape, table_stride) -> dict:
    """The fixed arguments of paged K/V ``[num_pages, page_size, heads_kv, head_dim]`` read through a block
    table ``[batch, max_pages]``: strides (page, head, slot) and the table's."""
    return {
        "stride_kb": k_stride[0], "stride_kh": k_stride[2], "stride_kn": k_stride[1],
        "stride_vb": v_stride[0], "stride_vh": v_stride[2], "stride_vn": v_stride[1],
        "stride_tb": table_stride[0], "stride_tp": table_stride[1],
    }  # fmt: skip


def _tma_rows(shape, strides, block_rows, block_d: int, dtype, hardware: Hardware, aligned: bool,
              varlen: bool = False):  # fmt: skip
    """(tensor descriptors, sequence-major) over the rows of tensors of ``shape`` ``[B, H, S, D]`` with
    ``strides`` (one each; blocks ``[block_rows[i], block_d]``), for loops over whole blocks inside one
    (sequence, head), which then never reach the next one's rows; or None where they keep their pointer
    loads. Head-major tensors (each the ``[B * H * S, D]`` rows of one allocation), or sequence-major ones
    (each the ``[B * S, H * D]`` rows of a ``[B, S, H, D]`` layout, rows possibly longer: a slice of a
    packed QKV; head dim unpadded, as a block's columns are the head's own), all of one kind: the kernels
    find a head's first row and column by :func:`_desc_origin`. ``varlen``: packed ``[T, H, D]`` tensors
    (``shape`` and ``strides`` those of :func:`_sizes`' order), sequence-major only. Hopper or later,
    fp16/bf16, ``aligned`` (the base addresses 16-byte aligned), rows 16-byte aligned, fewer than 2**31."""
    if not (aligned and hardware.has_tma) or dtype not in (torch.float16, torch.bfloat16):
        return None
    if varlen:  # as one sequence-major sequence of T rows
        shape = (1, shape[1], shape[0], shape[2])
        strides = [(0, stride[1], stride[0], stride[2]) for stride in strides]
    batch, heads, seq, head_dim = shape
    if seq < max(block_rows):
        return None
    kinds, layouts = set(), []
    for (stride_b, stride_h, stride_n, stride_d), rows_per_block in zip(strides, block_rows, strict=True):
        if stride_d != 1 or stride_n * dtype.itemsize % TMA_ALIGN_BYTES:
            return None
        if not varlen and stride_n >= head_dim and (heads == 1 or stride_h == seq * stride_n) and (
            batch == 1 or stride_b == heads * seq * stride_n
        ):  # head-major (with one head, either kind: taken as this one)
            kinds.add(False)
            rows, width = batch * heads * seq, head_dim
        elif (
            (heads == 1 or stride_h == head_dim) and head_dim == block_d and stride_n >= heads * head_dim
            and (batch == 1 or stride_b == seq * stride_n)
        ):  # sequence-major (packed sequences: always)
            kinds.add(True)
            rows, width = batch * seq, heads * head_dim
        else:
            return None
        if rows >= 2**31:
            return None
        layouts.append(Descriptor((rows, width), (stride_n, 1), (rows_per_block, block_d)))
    if len(kinds) != 1:
        return None
    return tuple(layouts), kinds.pop()


def _tma_kv(k_shape, k_stride, v_stride, dtype, block_n: int, block_d: int, hardware: Hardware,
            aligned: bool, v_block_n: int | None = None, varlen: bool = False):  # fmt: skip
    """((K's, V's) tensor descriptors, sequence-major) of a forward's interior loop (``TMA_KV``;
    :func:`_tma_rows`), or None where it keeps its pointer loads. V's blocks are ``[v_block_n, BLOCK_D]``
    when given (the overlapped loop loads V in half blocks)."""
    return _tma_rows(k_shape, (k_stride, v_stride), (block_n, v_block_n or block_n), block_d, dtype, hardware,
                     aligned, varlen)  # fmt: skip


@plan_cache
def _forward_plan(
    q_shape, k_shape, q_stride, k_stride, v_stride, batch, dtype, is_causal, left, right, capped, two_pass,
    varlen, negative_scale, alibi, dropout, device, sequsage=False, table_shape=None, table_stride=None,
    descales=None, v_transposed=False, aligned=False, *, lse: bool, policy: LaunchPolicy,
) -> Plan:  # fmt: skip
    """The forward (flash, or with ``two_pass`` tiled) plan of one problem class; ``batch``: the number of
    sequences (packed: ``len(cu_seqlens) - 1``); ``negative_scale``: the scale is below 0 (q is negated in
    the kernel, so that the base-2 factor of the scores is positive). Packed only: ``sequsage``, keys per
    sequence from ``seqused_k``; ``table_shape``/``table_stride``, the block table's of paged K/V (k's shape
    then ``[num_pages, page_size, heads_kv, head_dim]``). fp8 (e4m3 q, k, v): ``descales``, the (batch
    stride, head stride) of descale_q, descale_k and descale_v, None for one not given; ``v_transposed``, V
    comes as :func:`transposed_values` makes it (``v_stride`` then V^T's: batch, head, head-dim stride).
    ``aligned`` (16-bit, not paged): K's and V's base addresses are 16-byte aligned, so that the interior loop
    may load through tensor descriptors (:func:`_tma_kv`; the plan then takes ``K_DESC=k, V_DESC=v`` per
    call).
    ``lse`` False (flash only): the LSE is not stored (its pointer compiled out; no ``LSE`` per call); every
    caller spells it, so that a class's plan has one key however it is asked for. ``policy``: the launch
    choices (:mod:`llm_speed.core.policy`; every caller passes the current one)."""
    paged = table_shape is not None
    if paged:
        num_pages, page_size, heads_kv, head_dim = k_shape
        heads_q, seq_q, seq_kv = q_shape[1], q_shape[0], table_shape[1] * page_size  # seq_kv: the capacity
    else:
        heads_q, heads_kv, seq_q, seq_kv, head_dim = _sizes(q_shape, k_shape, varlen)
        num_pages, page_size = 0, 1
    block_d = padded_head_dim(head_dim, dtype)
    hardware = hardware_of(device)
    cfg = attention_config("forward", block_d, dtype, hardware)
    grid, grid_args = _grid(seq_q, cfg.block_m, batch, heads_q, varlen)
    order = _launch_order(is_causal, left, right, hardware, heads_q if varlen else batch * heads_q,
                          2 * seq_kv * head_dim * dtype.itemsize, heads_q // heads_kv, seq_q,
                          policy)  # fmt: skip
    lse_shape = (heads_q, seq_q) if varlen else (batch, heads_q, seq_q)
    o_stride = _output_strides(q_shape, q_stride, varlen)
    strides = _stride_args(varlen, q=q_stride, k=k_stride, v=v_stride, o=o_stride)
    strides.update(_paged_args(k_stride, v_stride, table_shape, table_stride) if paged else
                   {"stride_tb": 0, "stride_tp": 0})  # fmt: skip
    switches = dot_switches(dtype)
    descales = descales or (None, None, None)
    for name, given in zip(("DESCALE_Q", "DESCALE_K", "DESCALE_V"), descales, strict=True):
        letter = name[-1].lower()
        strides[f"stride_d{letter}b"], strides[f"stride_d{letter}h"] = given or (0, 0)
        if given is None:
            strides[name] = None  # compiled out
    if dtype == FP8_DTYPE:  # bfloat16 output and e4m3 weights: both casts rounded by hand when interpreted
        switches["RNE_BY_HAND"] = runtime.INTERPRETED
    # The overlapped interior loop (``OVERLAP``: :func:`_accumulate_overlapped`) needs Hopper's wgmma and
    # 128-row query blocks (a 64-row wgmma per warpgroup).
    overlap = (
        block_d in policy.forward_overlap_head_dims and hardware.has_tma and cfg.block_m >= 128
        and dtype in (torch.float16, torch.bfloat16) and not (two_pass or dropout or paged or v_transposed)
    )  # fmt: skip
    tma = None
    tma_kv_dims = policy.forward_tma_kv_head_dims
    if not (paged or two_pass or alibi or dropout or v_transposed) and block_d in tma_kv_dims:
        tma = _tma_kv(k_shape, k_stride, v_stride, dtype, cfg.block_n, block_d, hardware, aligned,
                      cfg.block_n // 2 if overlap else None, varlen)  # fmt: skip
    descs, desc_seq_major = tma or ((None, None), False)
    strides.update(K_DESC=descs[0], V_DESC=descs[1], DESC_SEQ_MAJOR=desc_seq_major)
    # 32-bit row offsets for the row-loaded tensors (paged K/V and V^T address their own way, 64-bit); not
    # for float32, whose packed kernels spilled with them (sm_90a: d = 128 78 loop spill instructions, d = 256
    # 1682), as the backward's took more registers
    rows = [(seq_q, q_stride), (seq_q, o_stride)]
    if not paged:
        rows += [(seq_kv, k_stride)] + ([] if v_transposed else [(seq_kv, v_stride)])
    rows32 = policy.rows32 and dtype != torch.float32 and rows_fit_32(
        varlen, rows, max(cfg.block_m, cfg.block_n), block_d
    )
    if not varlen:  # pointers a dense class never reads are compiled out: a call passes only its tensors
        strides.update(CU_Q=None, CU_K=None, SEQUSED_K=None, KV_TABLE=None)
        strides.update({} if alibi else {"ALIBI": None}, **({} if dropout else {"RNG": None}))
    if not lse:
        strides["LSE"] = None
    return (TILED if two_pass else FORWARD).plan(
        grid, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **strides,
        **_lse_stride_args(lse_shape, varlen), **grid_args, **order,
        heads_q=heads_q, group=heads_q // heads_kv, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
        page_size=page_size, num_pages=num_pages,
        **_mask_args(is_causal, left, right, capped, alibi, heads_q, dropout), TWO_PASS=two_pass,
        IS_VARLEN=varlen, UNIFORM=varlen and policy.uniform_bounds and uniform_switch(hardware),
        SEQUSED=sequsage, PAGED=paged,
        NEG_SCALE=negative_scale and not capped,
        EVEN_M=not varlen and seq_q % cfg.block_m == 0, EVEN_N=not varlen and seq_kv % cfg.block_n == 0,
        EVEN_D=head_dim == block_d, **switches, V_TRANSPOSED=v_transposed,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, TMA_KV=tma is not None,
        OVERLAP=overlap, ROWS32=rows32, FP8_GPU_CAST=dtype == FP8_DTYPE and policy.fp8_weights_gpu_cast,
    )  # fmt: skip


def _dq_in_halves(block_d: int, block_m: int, dtype: torch.dtype) -> bool:
    """Whether the dK/dV kernel with atomic dQ takes the head dim in halves (``D_HALVES``): 16-bit tiles of
    64+ query rows at head dim 128 (the H100's 64 x 64). Whole, dQ's [64, 128] float32 tile passed through
    32 KiB of shared memory on its way to the atomics' vector layout (129 KiB a block: one block of 4 warps
    per SM) and held 64 registers a thread beside dK and dV (255 registers, 28 spill instructions in the
    loops); in halves 16 KiB (113 KiB: two blocks per SM, as the dQ-kernel path's dK/dV kernel) and 32
    registers (sm_90a, Triton 3.6; docs/notes/attention-overlap.md)."""
    return block_d == 128 and block_m >= 64 and dtype != torch.float32


@plan_cache
def _backward_plans(
    q_shape, k_shape, q_stride, k_stride, v_stride, out_stride, dout_stride, batch, dtypes, has_dlse,
    is_causal, left, right, capped, varlen, deterministic, alibi, dropout, device, sequsage=False,
    aligned=False, *, policy: LaunchPolicy,
) -> tuple[Plan, Plan, Plan]:  # fmt: skip
    """(preprocess, dK/dV, dQ) plans of one backward problem class; ``dtypes``: those of q, out, dout, lse
    and dlse (None without). The default path's third plan is the dQ conversion (dQ added by atomics in the
    dK/dV kernel); ``deterministic``: the dQ kernel. ``aligned`` (16-bit): q's, dout's, k's and v's
    base addresses are 16-byte aligned, so that the dK/dV kernel may load Q and dO and the dQ kernel K and V
    through tensor descriptors (:func:`_tma_rows`; the plans then take ``Q_DESC=q, DO_DESC=dout`` and
    ``K_DESC=k, V_DESC=v`` per call). ``policy``: the launch choices."""
    heads_q, heads_kv, seq_q, seq_kv, head_dim = _sizes(q_shape, k_shape, varlen)
    dtype = dtypes[0]
    block_d = padded_head_dim(head_dim)
    even_d = head_dim == block_d
    hardware = hardware_of(device)
    lse_shape = (heads_q, seq_q) if varlen else (batch, heads_q, seq_q)
    lse_strides = _lse_stride_args(lse_shape, varlen)
    atomic = not deterministic
    # the fp32 dQ accumulator (default path): contiguous, q's shape
    dq_strides = _stride_args(varlen, dq=_contiguous_strides(q_shape) if atomic else (0, 0, 0, 0))
    fwd = attention_config("forward", block_d, dtype, hardware)  # the preprocess takes the forward's rows
    cfg = attention_config("backward", block_d, dtype, hardware)
    # 32-bit row offsets (dQ, dK, dV and the accumulator are contiguous); not for float32, whose packed dK/dV
    # kernel took 48 more registers with them (sm_90a: two blocks per SM to one)
    rows32 = policy.rows32 and dtype != torch.float32 and rows_fit_32(
        varlen,
        [*[(seq_q, st) for st in (q_stride, out_stride, dout_stride, _contiguous_strides(q_shape))],
         *[(seq_kv, st) for st in (k_stride, v_stride, _contiguous_strides(k_shape))]],
        max(fwd.block_m, cfg.block_m, cfg.block_n), block_d,
    )  # fmt: skip

    # delta: packed rows run as one batch of total_q rows (rows are independent here).
    preprocess = BACKWARD_PREPROCESS.plan(
        (cdiv(seq_q, fwd.block_m) * (1 if varlen else batch) * heads_q,),
        num_warps=PREPROCESS_WARPS, num_stages=PREPROCESS_STAGES,
        **_stride_args(varlen, o=out_stride, do=dout_stride), **dq_strides, **lse_strides,
        heads_q=heads_q, seq_q=seq_q, head_dim=head_dim, HAS_DLSE=has_dlse, ZERO_DQ=atomic,
        EVEN_M=seq_q % fwd.block_m == 0, EVEN_D=even_d, ROWS32=rows32, BLOCK_M=fwd.block_m, BLOCK_D=block_d,
    )  # fmt: skip

    # What the dK/dV and dQ kernels share: strides, sizes, masking and dtype switches.
    common = dict(
        **_stride_args(varlen, q=q_stride, k=k_stride, v=v_stride, do=dout_stride), **lse_strides,
        group=heads_q // heads_kv, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
        **_mask_args(is_causal, left, right, capped, alibi, heads_q, dropout), IS_VARLEN=varlen,
        UNIFORM=varlen and policy.uniform_bounds and uniform_switch(hardware), SEQUSED=sequsage,
        EVEN_D=even_d, ROWS32=rows32,
        **dot_switches(dtype),
        BLOCK_D=block_d, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    grid, grid_args = _grid(seq_kv, cfg.block_n, batch, heads_kv, varlen)
    dk_strides = _contiguous_strides(k_shape)
    tma_dq = None  # dQ tiles added by TMA bulk reductions (whole query blocks, dense)
    if (atomic and policy.backward_tma_dq_add and hardware.has_tma and not runtime.INTERPRETED and not varlen
            and even_d):  # fmt: skip
        rows = q_shape[0] * q_shape[1] * seq_q
        if seq_q % cfg.block_m == 0 and rows < 2**31:
            tma_dq = Descriptor((rows, head_dim), (head_dim, 1), (cfg.block_m, block_d))
    d_halves = atomic and tma_dq is None and _dq_in_halves(block_d, cfg.block_m, dtype)
    tma_qdo = None  # Q and dO tiles by TMA
    if block_d in policy.backward_tma_head_dims and not (d_halves or tma_dq):
        tma_qdo = _tma_rows(q_shape, (q_stride, dout_stride), (cfg.block_m, cfg.block_m), block_d, dtype,
                            hardware, aligned, varlen)  # fmt: skip
    (q_desc, do_desc), qdo_seq_major = tma_qdo or ((None, None), False)
    dkdv = BACKWARD_DKDV.plan(
        grid, **common, **grid_args, **_stride_args(varlen, dk=dk_strides, dv=dk_strides), **dq_strides,
        DQ_DESC=tma_dq, Q_DESC=q_desc, DO_DESC=do_desc, DESC_SEQ_MAJOR=qdo_seq_major,
        heads_kv=heads_kv, EVEN_M=not varlen and seq_q % cfg.block_m == 0,
        EVEN_N=not varlen and seq_kv % cfg.block_n == 0, ATOMIC_DQ=atomic, D_HALVES=d_halves,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
    )  # fmt: skip
    if atomic:
        n = 1
        for size in q_shape:
            n *= size
        dq = BACKWARD_DQ_CONVERT.plan(
            (cdiv(n, CONVERT_BLOCK),), num_warps=CONVERT_WARPS, num_stages=1, n=n,
            EVEN=n % CONVERT_BLOCK == 0, RNE_BY_HAND=dot_switches(dtype)["RNE_BY_HAND"], BLOCK=CONVERT_BLOCK,
        )  # fmt: skip
        return preprocess, dkdv, dq
    # dQ holds Q, dO and the fp32 dQ accumulator [BM, BD]; K and V stream, like the forward.
    grid, grid_args = _grid(seq_q, cfg.block_n, batch, heads_q, varlen)
    order = _launch_order(is_causal, left, right, hardware, heads_q if varlen else batch * heads_q,
                          2 * seq_kv * head_dim * dtype.itemsize, heads_q // heads_kv, seq_q,
                          policy)  # fmt: skip
    # K and V tiles by TMA, as the dK/dV kernel's Q and dO; not with ALiBi or dropout (as the forward: sm_90a,
    # the causal ALiBi+dropout dQ kernel, at 255 registers, spilled 9 instructions in its loops with it)
    tma_kv = None
    if block_d in policy.backward_tma_head_dims and not (alibi or dropout):
        tma_kv = _tma_rows(k_shape, (k_stride, v_stride), (cfg.block_m, cfg.block_m), block_d, dtype,
                           hardware, aligned, varlen)  # fmt: skip
    (k_desc, v_desc), kv_seq_major = tma_kv or ((None, None), False)
    dq = BACKWARD_DQ.plan(
        grid, **common, **grid_args, **order, **_stride_args(varlen, dq=_contiguous_strides(q_shape)),
        K_DESC=k_desc, V_DESC=v_desc, DESC_SEQ_MAJOR=kv_seq_major, heads_q=heads_q,
        EVEN_M=not varlen and seq_q % cfg.block_n == 0, EVEN_N=not varlen and seq_kv % cfg.block_m == 0,
        BLOCK_M=cfg.block_n, BLOCK_N=cfg.block_m,
    )  # fmt: skip
    return preprocess, dkdv, dq


def _launch_backward(plans, dout, q, k, v, out, lse, dlse, cu_q, cu_k, scale: float, softcap, deterministic,
                     alibi_slopes, dropout_p: float, rng, seqused_k=None):  # fmt: skip
    """Launch the three backward kernels: delta = rowsum(dO * O) - dLSE and the LSE in base 2, then dK/dV
    over key blocks, then dQ.

    Default path: the preprocess also zeroes an fp32 dQ accumulator, the dK/dV kernel adds dS K to it with
    atomics (FlashAttention-2's five matmuls per tile), and a conversion writes dQ = scale * accumulator in
    q's dtype. dQ's additions come in whatever order the GPU runs the programs: run to run, its last bits can
    differ. ``deterministic``: a dQ kernel of its own recomputes S and dP (seven matmuls per tile) and every
    output element has exactly one writer: no atomics, bitwise repeatable. ``seqused_k`` (packed): key rows
    past a sequence's used ones have no writer, so dK and dV start at zero."""
    preprocess, dkdv, dq_plan = plans
    device = q.device
    delta = tensors.new_output(lse.shape, torch.float32, device)
    lse2 = tensors.new_output(lse.shape, torch.float32, device)  # the preprocess's base-2 LSE
    # deterministic: the accumulator is not used; any float32 tensor stands in
    dq_acc = delta if deterministic else tensors.new_output(q.shape, torch.float32, device)
    preprocess.launch(O=out, DO=dout, LSE=lse, DLSE=delta if dlse is None else dlse, DELTA=delta, LSE2=lse2,
                      DQ_ACC=dq_acc)  # fmt: skip
    if seqused_k is None:
        dk = tensors.new_output(k.shape, k.dtype, device)
        dv = tensors.new_output(v.shape, v.dtype, device)
    else:
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq = tensors.new_output(q.shape, q.dtype, device)
    if cu_q is None:  # dense programs never read the sequence pointers: any tensor of the plan's dtype
        cu_q = cu_k = delta
    softcap = 1.0 if softcap is None else softcap
    # without ALiBi or dropout their pointers are never read: any tensor of the plan's dtype stands in
    alibi = delta if alibi_slopes is None else alibi_slopes
    rng = delta if rng is None else rng
    used = delta if seqused_k is None else seqused_k
    if "Q_DESC" in dkdv.descriptors:  # backward_tma_head_dims: Q and dO through their descriptors too
        dkdv.launch(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, DK=dk, DV=dv, DQ=dq_acc, Q_DESC=q,
                    DO_DESC=dout, CU_Q=cu_q, CU_K=cu_k, SEQUSED_K=used, ALIBI=alibi, RNG=rng, scale=scale,
                    softcap=softcap, dropout_p=dropout_p)  # fmt: skip
    elif dkdv.descriptors:  # backward_tma_dq_add: the accumulator through its descriptor too
        dkdv.launch(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, DK=dk, DV=dv, DQ=dq_acc, DQ_DESC=dq_acc,
                    CU_Q=cu_q, CU_K=cu_k, SEQUSED_K=used, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    else:
        dkdv.launch(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, DK=dk, DV=dv, DQ=dq_acc, CU_Q=cu_q,
                    CU_K=cu_k, SEQUSED_K=used, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    if deterministic and dq_plan.descriptors:  # K and V through their descriptors too
        dq_plan.launch(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, DQ=dq, K_DESC=k, V_DESC=v, CU_Q=cu_q,
                       CU_K=cu_k, SEQUSED_K=used, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                       dropout_p=dropout_p)  # fmt: skip
    elif deterministic:
        dq_plan.launch(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, DQ=dq, CU_Q=cu_q, CU_K=cu_k,
                       SEQUSED_K=used, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                       dropout_p=dropout_p)  # fmt: skip
    else:
        dq_plan.launch(DQ_ACC=dq_acc, DQ=dq, scale=scale)
    return dq, dk, dv


def _descale_key(descales) -> tuple | None:
    """The plan key of fp8 attention's (descale_q, descale_k, descale_v) (each a tensor or None): the
    (batch stride, head stride) each is read with, None for one not given; None for 16-bit attention."""
    if descales is None:
        return None
    return tuple(None if t is None else descale_strides(t) for t in descales)


def _descale_inputs(descales) -> dict:
    """The forward kernel's per-call descale pointers (those given; the others are fixed None)."""
    if descales is None:
        return {}
    return {name: t for name, t in zip(("DESCALE_Q", "DESCALE_K", "DESCALE_V"), descales, strict=True)
            if t is not None}  # fmt: skip


# V^T's rows (one per head dim) start this many elements apart at least: 16 bytes of fp8, so that the pointer
# of every row is 16-byte aligned and Triton specialises its stride as such (vector copies along the keys).
V_T_ALIGN = 16


def transposed_values(v: torch.Tensor) -> torch.Tensor:
    """V ``[B, Hkv, S, D]`` as fp8 attention's forward reads it (``V_TRANSPOSED``): V^T ``[B, Hkv, D, S]``
    with the keys contiguous, each head-dim row ``cdiv(S, V_T_ALIGN) * V_T_ALIGN`` elements apart (the
    padding never read). One copy per call, 1 byte per element each way for e4m3."""
    batch, heads_kv, seq_kv, head_dim = v.shape
    if seq_kv % V_T_ALIGN == 0:  # no padding: the plain copy (3 us on the CPU against 6)
        return v.transpose(2, 3).contiguous()
    row = cdiv(seq_kv, V_T_ALIGN) * V_T_ALIGN
    v_t = torch.empty((batch, heads_kv, head_dim, row), dtype=v.dtype, device=v.device)[..., :seq_kv]
    return v_t.copy_(v.transpose(2, 3))


def attention_forward(
    q, k, v, is_causal: bool, scale: float, window_left=None, window_right=None, softcap=None, two_pass=False,
    alibi_slopes=None, dropout_p: float = 0.0, rng=None, descales=None,
):  # fmt: skip
    """(out, lse) of the flash forward, or with ``two_pass`` the tiled one, of dense ``[B, H, S, D]``
    tensors (last dim contiguous): out contiguous in q's dtype (bfloat16 for fp8), lse float32 ``[B, Hq,
    Sq]``. Reports its work; runs the Triton kernel wherever it can run, else the float32 PyTorch reference.
    ``alibi_slopes``: float32 ``[Hq]`` or ``[B, Hq]`` contiguous; ``dropout_p`` > 0 with ``rng`` the int64
    (seed, offset); fp8 (e4m3 q, k, v, flash only): ``descales`` = (descale_q, descale_k, descale_v), each
    float32 ``[]``, ``[1]``, ``[Hkv]``, ``[B, Hkv]`` or None."""
    shape, device = q.shape, q.device
    batch, heads_q, seq_q, head_dim = shape
    out_dtype = q.dtype if descales is None else torch.bfloat16  # fp8: bfloat16 out (FlashAttention-3's)
    if batch == 0 or seq_q == 0 or k.shape[2] == 0:
        # Nothing to launch. With no key at all every row sees nothing: output 0, LSE -inf.
        out = torch.zeros(shape, dtype=out_dtype, device=device)
        return out, torch.full(shape[:3], float("-inf"), dtype=torch.float32, device=device)
    window = None if window_left is None and window_right is None else (window_left, window_right)
    name = "tiled_attention" if two_pass else "flash_attention" if descales is None else "flash_attention_fp8"
    runtime.report_work(name, q=q, k=k, is_causal=is_causal, window=window)
    if not runtime.triton_runs_on(device):
        out, lse = reference_forward(q, k, v, is_causal=is_causal, window=window, softcap=softcap,
                                     scale=scale, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                     rng=rng, descales=descales)  # fmt: skip
        if seq_major(shape, q.stride()):  # the layout the kernel writes
            out = new_dense_output(shape, True, out_dtype, device).copy_(out)
        return out, lse
    if descales is not None:  # fp8: V transposed once per call, so that the PV product is pipelined
        v = transposed_values(v)
    key = _dense_plan_key(q, k, v, is_causal, scale < 0.0, window_left, window_right, softcap is not None,
                          two_pass, _alibi_dims(alibi_slopes), dropout_p > 0.0)  # fmt: skip
    # (the descales' and V's layout part of the key for fp8 only: a 16-bit call's key is as before)
    if descales is None:
        plan = _forward_plan(*key, aligned=tma_aligned(k, v), lse=True, policy=current_policy())
    else:
        plan = _forward_plan(*key, descales=_descale_key(descales), v_transposed=True, lse=True,
                             policy=current_policy())
    out, lse = _dense_outputs(shape, seq_major(shape, q.stride()), out_dtype, device)
    softcap = 1.0 if softcap is None else softcap
    if descales is None and alibi_slopes is None and rng is None:  # the common call: five tensors
        _launch_dense(plan, q, k, v, out, lse, scale, softcap, dropout_p)
    else:  # the slopes, seeds and descales a class has (the plan compiled out those it has not)
        extras = _descale_inputs(descales)
        if plan.descriptors:  # TMA_KV: K and V through the interior loop's descriptors too
            extras.update(K_DESC=k, V_DESC=v)
        if alibi_slopes is not None:
            extras["ALIBI"] = alibi_slopes
        if rng is not None:
            extras["RNG"] = rng
        plan.launch(Q=q, K=k, V=v, O=out, LSE=lse, scale=scale, softcap=softcap, dropout_p=dropout_p,
                    **extras)  # fmt: skip
    return out, lse


def _launch_dense(plan: Plan, q, k, v, out, lse, scale: float, softcap: float, dropout_p: float) -> None:
    """Launch a dense forward plan on its five tensors (a ``TMA_KV`` plan takes K and V twice: as pointers
    and through its descriptors; lse None: a plan that stores none)."""
    if lse is None and plan.descriptors:
        plan.launch(Q=q, K=k, V=v, K_DESC=k, V_DESC=v, O=out, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    elif lse is None:
        plan.launch(Q=q, K=k, V=v, O=out, scale=scale, softcap=softcap, dropout_p=dropout_p)
    elif plan.descriptors:
        plan.launch(Q=q, K=k, V=v, K_DESC=k, V_DESC=v, O=out, LSE=lse, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    else:
        plan.launch(Q=q, K=k, V=v, O=out, LSE=lse, scale=scale, softcap=softcap, dropout_p=dropout_p)


def _dense_plan_key(q, k, v, is_causal, negative, left, right, capped, two_pass, alibi, dropout) -> tuple:
    """The :func:`_forward_plan` arguments of a dense forward."""
    return (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.shape[0], q.dtype, is_causal, left, right,
            capped, two_pass, False, negative, alibi, dropout, q.device)  # fmt: skip


def _dense_outputs(shape, like_seq_major: bool, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a dense forward: out as :func:`new_dense_output`, lse float32 ``[B, Hq, Sq]``."""
    return new_dense_output(shape, like_seq_major, dtype, device), tensors.new_output(
        shape[:3], torch.float32, device
    )


class _DenseCall:
    """A dense inference forward call (no window, softcap, ALiBi, dropout or fp8; no copy of q, k, v) whose
    metadata passed every check: what a call with the same metadata does, the report, the outputs and the
    launch (:data:`_DENSE_CALLS`). ``lse`` False: the call does not return the LSE, so the plan stores none
    (one allocation less a call)."""

    __slots__ = ("plan", "shape", "lse_shape", "seq_major", "dtype", "device", "default_scale")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, negative: bool,
                 lse: bool):  # fmt: skip
        self.shape, self.dtype, self.device = q.shape, q.dtype, q.device
        self.lse_shape = tuple(q.shape[:3]) if lse else None
        self.seq_major = seq_major(q.shape, q.stride())
        self.default_scale = check_scale(None, q)
        key = _dense_plan_key(q, k, v, is_causal, negative, None, None, False, False, 0, False)
        # (with LSE: the op's own plan)
        self.plan = _forward_plan(*key, aligned=tma_aligned(k, v), lse=lse, policy=current_policy())

    def __call__(self, q, k, v, is_causal: bool, scale: float | None) -> tuple:
        runtime.report_work("flash_attention", q=q, k=k, is_causal=is_causal, window=None)
        out = new_dense_output(self.shape, self.seq_major, self.dtype, self.device)
        lse = self.lse_shape and tensors.new_output(self.lse_shape, torch.float32, self.device)
        _launch_dense(self.plan, q, k, v, out, lse, self.default_scale if scale is None else scale, 1.0, 0.0)
        return out, lse

    def forward(self, q, k, v, is_causal: bool, scale: float, *fixed) -> tuple:
        """:func:`forward` of such a call (the op's arguments; the plan fixes the others)."""
        return self(q, k, v, is_causal, scale)


# Dense calls already checked, by what the checks read: a repeated call (the same shapes, strides, dtypes,
# devices and flags) skips the checks and the op's layers, as PyTorch's C++ dispatch costs nothing there:
# 15 -> 7 us a call on the development CPU (launch stubbed), where SDPA takes 7. With grad it records the op's
# autograd node around the kept launch (Op.checked).
_DENSE_CALLS = CallCache()


def _dense_call_key(q, k, v, is_causal, scale, lse) -> tuple:
    """The key of :data:`_DENSE_CALLS`: everything the checks and the plan of such a call read (``lse``:
    the LSE is stored: returned, or saved for the backward; the launch policy)."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, is_causal, lse, scale is not None and scale < 0.0,
            tma_aligned(k, v), current_policy())  # fmt: skip


# The same calls made through flash-attn's interface (llm_speed.flash_attn_interface): q, k, v in its
# [batch, seq, heads, dim] layout, keyed (by _dense_call_key) on those tensors as given, so a repeated call
# makes none of the four transposed views (q, k, v in, out back) that cost ~3 us of the development CPU; the
# entry is the _DENSE_CALLS entry its first call left (a sequence-major output, no LSE; a TMA plan's
# descriptors are made over the tensors as given, the same memory as the views its plan was made for).
_SEQ_MAJOR_CALLS = CallCache()


def seq_major_inference(q, k, v, is_causal: bool, scale: float | None) -> torch.Tensor | None:
    """For flash-attn's interface: the ``[batch, seq_q, heads_q, dim]`` output of a plain inference call on
    ``[batch, seq, heads, dim]`` tensors that an earlier call of the same metadata made through
    :func:`flash_attention` (and :func:`keep_seq_major`); None when there is none (the caller takes the
    full path). ``is_causal`` a bool, ``scale`` None or a finite float, no grad to record: the caller's
    conditions."""
    call = _SEQ_MAJOR_CALLS.get(_dense_call_key(q, k, v, is_causal, scale, False))
    if call is None:
        return None
    if runtime.observed():  # a profiler listens: the report names [B, H, S, D] shapes
        runtime.report_work("flash_attention", q=q.transpose(1, 2), k=k.transpose(1, 2), is_causal=is_causal,
                            window=None)  # fmt: skip
    out = tensors.new_output(q.shape, q.dtype, q.device)  # the plan writes q's [B, S, H, D] order
    _launch_dense(call.plan, q, k, v, out, None, call.default_scale if scale is None else scale, 1.0, 0.0)
    return out


def keep_seq_major(given: tuple, views: tuple, is_causal: bool, scale: float | None) -> None:
    """After :func:`flash_attention` ran on ``views``, the ``transpose(1, 2)`` of flash-attn's ``[batch, seq,
    heads, dim]`` tensors ``given`` (q, k, v; no grad, no option): keep what it kept for the next such
    call."""
    call = _DENSE_CALLS.get(_dense_call_key(*views, is_causal, scale, False))
    if call is not None and call.seq_major:
        _SEQ_MAJOR_CALLS.put(_dense_call_key(*given, is_causal, scale, False), call)


def forward(
    q, k, v, is_causal: bool, scale: float, window_left=None, window_right=None, softcap=None,
    deterministic=False, alibi_slopes=None, dropout_p: float = 0.0, rng=None,
):  # fmt: skip
    """(out, lse) of the flash forward (:func:`attention_forward`); the op's implementation
    (``deterministic`` is the backward's, kept for it by the autograd context)."""
    return attention_forward(q, k, v, is_causal, scale, window_left, window_right, softcap, False,
                             alibi_slopes, dropout_p, rng)  # fmt: skip


def tier_dq_kernel(tier: AttentionTier, policy: LaunchPolicy) -> bool:
    """Whether ``tier``'s default backward computes dQ in a kernel of its own (seven matmuls per tile,
    bitwise repeatable, as ``deterministic=True``) instead of adding it by atomics from the dK/dV kernel
    (five): the policy's ``backward_dq_kernel_tiers``, not with its ``backward_tma_dq_add``."""
    return tier.name in policy.backward_dq_kernel_tiers and not policy.backward_tma_dq_add


def deterministic_backward(deterministic: bool, device: torch.device) -> bool:
    """Whether a backward on ``device`` computes dQ in a kernel of its own (the deterministic path): asked
    for, PyTorch's deterministic mode is on (``torch.use_deterministic_algorithms(True)``, read when the
    backward runs: PyTorch's convention), or the device's tier does by default (:func:`tier_dq_kernel`
    under the current policy)."""
    return (
        deterministic
        or torch.are_deterministic_algorithms_enabled()
        or tier_dq_kernel(tier_for(hardware_of(device)), current_policy())
    )


def default_backward_kernels(device) -> tuple[Kernel, ...]:
    """The kernels a backward on ``device`` launches unless asked for the deterministic path."""
    dq_kernel = deterministic_backward(False, torch.device(device))
    return DETERMINISTIC_BACKWARD_KERNELS if dq_kernel else ATOMIC_BACKWARD_KERNELS


def backward(
    dout, q, k, v, out, lse, dlse, is_causal: bool, scale: float, window_left=None, window_right=None,
    softcap=None, deterministic=False, alibi_slopes=None, dropout_p: float = 0.0, rng=None,
):  # fmt: skip
    """(dq, dk, dv) of the dense forward (flash or tiled: both save Q, K, V, O and the LSE); reports its
    work. GQA gradients are summed over each query group. dQ by atomics (five matmuls per tile), or a dQ
    kernel of its own, bitwise repeatable, when :func:`deterministic_backward` says so."""
    dout = tensors.last_dim_contiguous(dout)
    if dlse is not None:
        dlse = dlse.contiguous()
    if q.numel() == 0 or k.numel() == 0:
        # Empty batch or sequence: no score exists, so every gradient is 0.
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    window = None if window_left is None and window_right is None else (window_left, window_right)
    deterministic = deterministic_backward(deterministic, q.device)
    runtime.report_work("flash_attention_backward", q=q, k=k, is_causal=is_causal, window=window,
                        deterministic=deterministic)  # fmt: skip
    if not runtime.triton_runs_on(q.device):
        return reference_backward(dout, q, k, v, out, lse, dlse, is_causal=is_causal, window=window,
                                  softcap=softcap, scale=scale, alibi_slopes=alibi_slopes,
                                  dropout_p=dropout_p, rng=rng)  # fmt: skip
    lse = lse.contiguous()
    dtypes = (q.dtype, out.dtype, dout.dtype, lse.dtype, None if dlse is None else dlse.dtype)
    plans = _backward_plans(
        q.shape, k.shape, q.stride(), k.stride(), v.stride(), out.stride(), dout.stride(), q.shape[0], dtypes,
        dlse is not None, is_causal, window_left, window_right, softcap is not None, False, deterministic,
        _alibi_dims(alibi_slopes), dropout_p > 0.0, q.device,
        aligned=tma_aligned(q, dout) and tma_aligned(k, v), policy=current_policy(),
    )  # fmt: skip
    return _launch_backward(plans, dout, q, k, v, out, lse, dlse, None, None, scale, softcap, deterministic,
                            alibi_slopes, dropout_p, rng)  # fmt: skip


def varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float,
    window_left=None, window_right=None, softcap=None, deterministic=False, alibi_slopes=None,
    dropout_p: float = 0.0, rng=None, seqused_k=None, block_table=None, descales=None,
):  # fmt: skip
    """(out ``[Tq, Hq, D]``, lse float32 ``[Hq, Tq]``) of packed sequences; the packed op's implementation
    (fp8: ``descales`` as :func:`attention_forward`'s, indexed by sequence; out bfloat16).

    The values of ``cu_seqlens`` (and ``seqused_k``, ``block_table``) are checked on the host first where
    ``runtime.check_values`` allows (CPU tensors by default); elsewhere nothing reads them on the host: the
    kernel finds each sequence's rows on the device and writes NaN over the rows of a sequence whose bounds
    (or pages) are invalid. Paged (``block_table``): k and v are ``[num_pages, page_size, heads_kv,
    head_dim]``, sequence b's keys the first ``seqused_k[b]`` positions of its pages (without ``seqused_k``
    the differences of ``cu_seqlens_k``, taken in the kernel)."""
    shape, device = q.shape, q.device
    total_q, heads_q, _ = shape
    paged = block_table is not None
    total_k = block_table.shape[1] * k.shape[1] if paged else k.shape[0]  # paged: the capacity
    if runtime.check_values(device):
        check_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k,
                             seqused_k=seqused_k, block_table=block_table, num_pages=k.shape[0])  # fmt: skip
    batch = cu_seqlens_q.shape[0] - 1
    out_dtype = q.dtype if descales is None else torch.bfloat16  # fp8: bfloat16 out (FlashAttention-3's)
    if total_q == 0:  # no query: nothing to launch
        lse = torch.empty((heads_q, 0), dtype=torch.float32, device=device)
        return torch.zeros_like(q, dtype=out_dtype), lse
    if batch == 0:  # rows but no sequence: cu_seqlens (one entry, both 0 and the total) is invalid
        lse = torch.full((heads_q, total_q), float("nan"), dtype=torch.float32, device=device)
        return torch.full_like(q, float("nan"), dtype=out_dtype), lse
    triton_runs = runtime.triton_runs_on(device)
    if total_k == 0 and not triton_runs:  # no key at all: every row sees nothing (output 0, LSE -inf)
        lse = torch.full((heads_q, total_q), float("-inf"), dtype=torch.float32, device=device)
        return torch.zeros_like(q, dtype=out_dtype), lse
    window = None if window_left is None and window_right is None else (window_left, window_right)
    if total_k:
        runtime.report_work(
            "flash_attention_varlen", q=q, k=k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            is_causal=is_causal, window=window, seqused_k=seqused_k, block_table=block_table,
        )  # fmt: skip
    if not triton_runs:
        return varlen_reference_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=is_causal,
                                        window=window, softcap=softcap, scale=scale,
                                        alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng=rng,
                                        seqused_k=seqused_k, block_table=block_table,
                                        descales=descales)  # fmt: skip
    plan = _varlen_plan(q, k, v, batch, is_causal, scale < 0.0, window_left, window_right,
                        softcap is not None, alibi_slopes, dropout_p > 0.0, seqused_k is not None,
                        block_table, descales)  # fmt: skip
    out = tensors.new_output(shape, out_dtype, device)
    lse = tensors.new_output((heads_q, total_q), torch.float32, device)
    if total_k == 0:
        # No key: the kernel still runs, to write 0 and -inf (NaN where cu_seqlens_q is invalid); it reads no
        # key row, so any tensor of k's dtype stands in for the empty K and V.
        k = v = q
    _launch_varlen(plan, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale,
                   1.0 if softcap is None else softcap, dropout_p, seqused_k, block_table, alibi_slopes, rng,
                   descales)  # fmt: skip
    return out, lse


def _varlen_plan(q, k, v, batch: int, is_causal: bool, negative: bool, window_left=None, window_right=None,
                 capped: bool = False, alibi_slopes=None, dropout: bool = False, seqused: bool = False,
                 block_table=None, descales=None) -> Plan:  # fmt: skip
    """The forward plan of a packed call of ``batch`` sequences (with the LSE, which the op returns)."""
    paged = block_table is not None
    return _forward_plan(q.shape, k.shape, q.stride(), k.stride(), v.stride(), batch, q.dtype, is_causal,
                         window_left, window_right, capped, False, True, negative, _alibi_dims(alibi_slopes),
                         dropout, q.device, seqused, block_table.shape if paged else None,
                         block_table.stride() if paged else None, _descale_key(descales),
                         aligned=tma_aligned(k, v), lse=True, policy=current_policy())  # fmt: skip


def _launch_varlen(plan: Plan, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale: float,
                   softcap: float = 1.0, dropout_p: float = 0.0, seqused_k=None, block_table=None,
                   alibi_slopes=None, rng=None, descales=None) -> None:  # fmt: skip
    """Launch a packed forward plan (a ``TMA_KV`` plan takes K and V through its descriptors too); an input
    not given stands in as ``lse`` (the plan compiles its reads out)."""
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    used = lse if seqused_k is None else seqused_k
    table = lse if block_table is None else block_table
    alibi = lse if alibi_slopes is None else alibi_slopes
    rng = lse if rng is None else rng
    if plan.descriptors:  # TMA_KV: K and V through the interior loop's descriptors too
        plan.launch(Q=q, K=k, V=v, K_DESC=k, V_DESC=v, O=out, LSE=lse, CU_Q=cu_seqlens_q, CU_K=cu_k,
                    SEQUSED_K=used, KV_TABLE=table, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    elif descales is None:
        plan.launch(Q=q, K=k, V=v, O=out, LSE=lse, CU_Q=cu_seqlens_q, CU_K=cu_k, SEQUSED_K=used,
                    KV_TABLE=table, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    else:  # fp8 (forward only: no dropout)
        plan.launch(Q=q, K=k, V=v, O=out, LSE=lse, CU_Q=cu_seqlens_q, CU_K=cu_k, SEQUSED_K=used,
                    KV_TABLE=table, ALIBI=alibi, RNG=lse, scale=scale, softcap=softcap, dropout_p=0.0,
                    **_descale_inputs(descales))  # fmt: skip


class VarlenCall:
    """A packed call (no window, softcap, ALiBi, dropout, ``seqused_k``, block table or fp8; no copy of q, k,
    v) whose metadata passed every check: what :func:`varlen_forward` does for a call with the same metadata
    (``flash_attention_varlen``'s calls already checked), without looking its plan up again: the value checks
    where ``runtime.check_values`` says, the report, the outputs and the launch. A call with no query row, no
    sequence or no key, or whose kernels cannot run on its device, keeps ``plan`` None and takes
    :func:`varlen_forward` whole."""

    __slots__ = ("plan", "shape", "lse_shape", "dtype", "device", "default_scale", "total_k")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 is_causal: bool, negative: bool):  # fmt: skip
        self.shape, self.dtype, self.device = q.shape, q.dtype, q.device
        self.lse_shape = (q.shape[1], q.shape[0])
        self.default_scale = check_scale(None, q)
        self.total_k = k.shape[0]
        batch = cu_seqlens_q.shape[0] - 1
        self.plan = None
        if q.shape[0] and batch and self.total_k and runtime.triton_runs_on(q.device):
            self.plan = _varlen_plan(q, k, v, batch, is_causal, negative)

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                is_causal: bool, scale: float, *fixed) -> tuple:  # fmt: skip
        """:func:`varlen_forward` of such a call (the op's arguments; the plan fixes the others)."""
        plan = self.plan
        if plan is None:
            return varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                  scale)  # fmt: skip
        device = self.device
        if runtime.check_values(device):
            check_seqlens_values(cu_seqlens_q, cu_seqlens_k, self.shape[0], self.total_k, max_seqlen_q,
                                 max_seqlen_k)  # fmt: skip
        runtime.report_work(
            "flash_attention_varlen", q=q, k=k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            is_causal=is_causal, window=None, seqused_k=None, block_table=None,
        )  # fmt: skip
        out = tensors.new_output(self.shape, self.dtype, device)
        lse = tensors.new_output(self.lse_shape, torch.float32, device)
        _launch_varlen(plan, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale)
        return out, lse


def varlen_backward(
    dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, is_causal: bool, scale: float,
    window_left=None, window_right=None, softcap=None, deterministic=False, alibi_slopes=None,
    dropout_p: float = 0.0, rng=None, seqused_k=None, block_table=None,
):  # fmt: skip
    """(dq, dk, dv) of :func:`varlen_forward`; reports its work. Never reads ``cu_seqlens`` on the host
    where Triton runs; invalid bounds give NaN (or zero) gradients on the rows of their sequence, and nothing
    outside the tensors is read or written. Paths as :func:`backward`'s. Key rows past ``seqused_k`` get
    zero gradients; paged K/V (``block_table``) has no backward (as in flash-attn)."""
    if block_table is not None:
        raise ValueError("block_table (paged K/V) is forward-only: no gradient flows into the pages")
    dout = tensors.last_dim_contiguous(dout)
    if dlse is not None:
        dlse = dlse.contiguous()
    batch = cu_seqlens_q.shape[0] - 1
    if q.shape[0] == 0 or k.shape[0] == 0 or batch == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    window = None if window_left is None and window_right is None else (window_left, window_right)
    deterministic = deterministic_backward(deterministic, q.device)
    runtime.report_work(
        "flash_attention_varlen_backward", q=q, k=k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        is_causal=is_causal, window=window, deterministic=deterministic, seqused_k=seqused_k,
    )  # fmt: skip
    if not runtime.triton_runs_on(q.device):
        return varlen_reference_backward(
            dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, is_causal=is_causal, window=window,
            softcap=softcap, scale=scale, alibi_slopes=alibi_slopes, dropout_p=dropout_p, rng=rng,
            seqused_k=seqused_k,
        )  # fmt: skip
    lse = lse.contiguous()
    dtypes = (q.dtype, out.dtype, dout.dtype, lse.dtype, None if dlse is None else dlse.dtype)
    plans = _backward_plans(
        q.shape, k.shape, q.stride(), k.stride(), v.stride(), out.stride(), dout.stride(), batch, dtypes,
        dlse is not None, is_causal, window_left, window_right, softcap is not None, True, deterministic,
        _alibi_dims(alibi_slopes), dropout_p > 0.0, q.device, seqused_k is not None,
        aligned=tma_aligned(q, dout) and tma_aligned(k, v), policy=current_policy(),
    )  # fmt: skip
    cu_q, cu_k = cu_seqlens_q, cu_seqlens_k
    return _launch_backward(plans, dout, q, k, v, out, lse, dlse, cu_q, cu_k, scale, softcap, deterministic,
                            alibi_slopes, dropout_p, rng, seqused_k)  # fmt: skip


# --- op registration ------------------------------------------------------------------------------------


def _empty(x: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype or x.dtype, device=x.device)


@torch.library.custom_op("llm_speed::flash_attention_forward", mutates_args=())
def forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, is_causal, scale, window_left, window_right, softcap, deterministic, alibi_slopes,
                   dropout_p, rng)  # fmt: skip


@forward_op.register_fake
def forward_fake(q, k, v, is_causal, scale, window_left=None, window_right=None, softcap=None,
                 deterministic=False, alibi_slopes=None, dropout_p=0.0, rng=None):  # fmt: skip
    """Shapes and dtypes of (out, lse) for fake tensors; shared with the tiled forward operator."""
    batch, heads_q, seq_q, _ = q.shape
    out = new_dense_output(q.shape, seq_major(q.shape, q.stride()), q.dtype, q.device)
    return out, _empty(q, (batch, heads_q, seq_q), torch.float32)


@torch.library.custom_op("llm_speed::flash_attention_backward", mutates_args=())
def backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(dout, q, k, v, out, lse, dlse, is_causal, scale, window_left, window_right, softcap,
                    deterministic, alibi_slopes, dropout_p, rng)  # fmt: skip


@backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, dlse, is_causal, scale, window_left=None, window_right=None,
                   softcap=None, deterministic=False, alibi_slopes=None, dropout_p=0.0,
                   rng=None):  # fmt: skip
    return _empty(q, q.shape), _empty(k, k.shape), _empty(v, v.shape)


_backward_call = Op(backward_op, backward)
_backward_call = autocast.dispatch(_backward_call, autocast.KEEP)  # torch.autocast: as saved (issue 34)


# --- autograd -------------------------------------------------------------------------------------------


def setup_context(ctx, inputs, output):
    """Save what the backward recomputes from; shared with the tiled forward operator."""
    q, k, v, is_causal, scale, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (is_causal, scale, *rest)


def autograd_backward(ctx, dout, dlse):
    """Gradients for (q, k, v) through the flash backward; shared with the tiled forward operator."""
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _backward_call(dout, q, k, v, out, lse, dlse, *ctx.args)
    return (dq, dk, dv) + (None,) * len(ctx.args)


_forward_plain = Op(forward_op, forward, setup_context=setup_context, backward=autograd_backward)
_forward_call = autocast.dispatch(_forward_plain, autocast.LOWER, (0, 1, 2))  # torch.autocast: as SDPA


def fp8_forward(q, k, v, descale_q, descale_k, descale_v, is_causal: bool, scale: float, window_left=None,
                window_right=None, softcap=None, alibi_slopes=None):  # fmt: skip
    """(out bfloat16, lse) of fp8 attention (e4m3 q, k, v); the fp8 op's implementation. The descales'
    values (finite, > 0) are checked on the host where ``runtime.check_values`` allows; elsewhere the kernel
    writes NaN over the rows a bad one scales."""
    if runtime.check_values(q.device):
        check_descale_values(*zip(DESCALE_NAMES, (descale_q, descale_k, descale_v), strict=True))
    return attention_forward(q, k, v, is_causal, scale, window_left, window_right, softcap, False,
                             alibi_slopes, descales=(descale_q, descale_k, descale_v))  # fmt: skip


@torch.library.custom_op("llm_speed::flash_attention_fp8_forward", mutates_args=())
def _fp8_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descale_q: torch.Tensor | None,
    descale_k: torch.Tensor | None,
    descale_v: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_forward(q, k, v, descale_q, descale_k, descale_v, is_causal, scale, window_left, window_right,
                       softcap, alibi_slopes)  # fmt: skip


@_fp8_forward_op.register_fake
def _fp8_forward_fake(q, k, v, descale_q, descale_k, descale_v, is_causal, scale, window_left=None,
                      window_right=None, softcap=None, alibi_slopes=None):  # fmt: skip
    batch, heads_q, seq_q, _ = q.shape
    out = new_dense_output(q.shape, seq_major(q.shape, q.stride()), torch.bfloat16, q.device)
    return out, _empty(q, (batch, heads_q, seq_q), torch.float32)


_fp8_forward_call = Op(_fp8_forward_op, fp8_forward)  # forward only: no gradient formula


def _fp8_attention(q, k, v, descales, is_causal, scale, left, right, softcap, alibi_slopes, dropout_p):
    """:func:`flash_attention` with e4m3 q, k, v: (out, lse)."""
    q, k, v, scale = prepare_attention_inputs(q, k, v, scale, FP8_DTYPES)
    batch, heads_kv = q.shape[0], k.shape[1]
    check_fp8_options(q, k, v, descales, dropout_p, batch, heads_kv)
    alibi_slopes = check_alibi_slopes(alibi_slopes, batch, q.shape[1], q.device)
    return _fp8_forward_call(q, k, v, *descales, is_causal, scale, left, right, softcap, alibi_slopes)


# --- public function ------------------------------------------------------------------------------------


@suggest_keywords
def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    **unknown,
):
    """FlashAttention: ``softmax(q k^T * scale) v`` without ever storing the seq_q x seq_kv matrix.

    Args:
        q: ``[batch, heads_q, seq_q, head_dim]``.
        k, v: ``[batch, heads_kv, seq_kv, head_dim]``; heads_q a multiple of heads_kv (MHA, GQA, MQA). K/V are
            shared by each group of heads_q / heads_kv query heads without being repeated in memory.
        is_causal: mask aligned bottom-right: query i sees keys j <= i + seq_kv - seq_q (as FlashAttention
            >= 2.1 and KV-cache prefill do). PyTorch SDPA aligns top-left (j <= i); they differ when
            seq_q != seq_kv. A row that sees no key outputs 0 with LSE -inf and gets zero gradients.
            Fully masked key blocks are skipped, not computed.
        scale: score scale, default ``1 / sqrt(head_dim)``; any finite real number.
        return_lse: also return the log-sum-exp of each row's scaled scores, ``[batch, heads_q, seq_q]`` fp32.
        window: ``(left, right)`` local attention, flash-attn's ``window_size`` convention but with None
            (not -1) for an unbounded side: with ``p = i + seq_kv - seq_q``, query i sees keys
            ``p - left <= j <= p + right``; ``is_causal=True`` makes right 0. A Mistral / Gemma-2 sliding
            window of W tokens is ``window=(W - 1, 0), is_causal=True``. Key blocks outside every row's
            window are skipped: the work grows with the window, not with seq_kv.
        softcap: ``c > 0``: scores ``s`` become ``c * tanh(s / c)`` before masking and softmax (Gemma 2,
            arXiv:2408.00118; Grok-1); the backward includes the derivative ``1 - tanh^2``.
        deterministic: the backward's path (see below).
        alibi_slopes: float32 ``[heads_q]`` or ``[batch, heads_q]``: ALiBi (Press et al., arXiv:2108.12409),
            ``-slope * |i + seq_kv - seq_q - j|`` added to the scores after the cap (flash-attn's rule),
            forward and backward (the slopes get no gradient).
        dropout_p: attention dropout in [0, 1): each weight is dropped with this probability and the kept
            ones scaled by ``1 / (1 - dropout_p)``, forward and backward, the mask drawn in the kernels by
            Philox from a seed and offset taken from PyTorch's generator of q's device (``torch.manual_seed``
            reproduces a call; :func:`llm_speed.attention.reference.dropout_keep` rebuilds the mask). The LSE
            is the one before dropout. Applied whenever > 0 (pass 0 in evaluation, as with flash-attn).
        descale_q, descale_k, descale_v: fp8 attention (FlashAttention-3's, arXiv:2407.08608): q, k and v
            ``torch.float8_e4m3fn`` (as :func:`llm_speed.quantize_fp8` makes them), each descale None (1) or
            float32 ``[]``/``[1]`` (per tensor), ``[heads_kv]`` or ``[batch, heads_kv]`` (query head h takes
            its KV head's, h // group, as FlashAttention-3); the dequantized inputs are ``x.float() *
            descale``. The products run on fp8 tensor cores: q.k^T with the two descales folded into the
            score scale, then the weights rounded to e4m3 (scaled by 2**8, FlashAttention-3's Max_offset, so
            that they use e4m3's range) times v, v's descale applied once to the output. Output bfloat16;
            the LSE sees only the q.k^T product, not the rounded weights (on Hopper's fp8 tensor cores that
            product is accumulated at their precision, as ``torch._scaled_mm(..., use_fast_accum=True)``
            and FlashAttention-3: about 1e-4 relative). Descales must be finite and > 0: checked on the host
            where ``runtime.check_values`` says, otherwise a bad one makes the rows it scales NaN. Forward
            only: a ValueError when grad mode is on and an input requires grad, or with ``dropout_p``.
            Causal, windows, softcap, GQA and ALiBi as for 16-bit inputs.

    dtypes float16, bfloat16, float32 (all three alike; fp8 e4m3 with the descales above); statistics and
    accumulation in float32; the output has q's dtype (bfloat16 for fp8), shape ``[batch, heads_q, seq_q,
    head_dim]`` and q's order of dims: where q is a ``[batch, seq_q, heads_q, head_dim]`` tensor viewed with
    ``.transpose(1, 2)`` (flash-attn's and Hugging Face's layout, or a slice of a packed QKV) the output is
    written so that ``out.transpose(1, 2)`` is contiguous (no copy made); otherwise the output is contiguous.
    head_dim: any from 1 to 256 (padded to a power of two >= 16 on chip by masked loads, never copied). Any
    strides with a contiguous last dim are read in place (a ``[B, S, H, D]`` tensor viewed with
    ``.transpose(1, 2)`` costs no copy); a non-contiguous last dim is copied first. Inputs are not modified.

    Zero sizes: batch 0 or seq_q 0 give empty results; seq_kv 0 gives output 0 and LSE -inf (no key is
    visible); gradients are zeros.

    Backward (autograd): recomputes the probabilities block by block from Q, K, V, O and the LSE; GQA
    gradients are summed over each query group; gradients through the returned LSE are supported. Two paths
    (PyTorch's convention, flash-attn's ``deterministic``):

    - atomic: one kernel over key blocks computes dK, dV and dQ (five matmuls per tile, FlashAttention-2's
      backward), adding each block's dQ share to an fp32 accumulator with atomics. The order of those
      additions is the GPU's, so dQ's last bits can differ from run to run (dK and dV cannot);
    - dQ kernel: dQ comes from a kernel of its own that recomputes the scores (seven matmuls per tile),
      every gradient element has one writer, and gradients are bitwise repeatable. Taken with
      ``deterministic=True``, whenever ``torch.are_deterministic_algorithms_enabled()`` when the backward
      runs, and by default on devices with Hopper's shared memory (227 KB per block: H100, H200), where it
      measured 1.7-1.9x faster than the atomic path (H100 SXM, d=128, 16k tokens). Other devices default
      to the atomic path.

    ``deterministic`` only chooses the backward's path; the forward is always bitwise repeatable.

    Devices: CUDA tensors run the Triton kernels. CPU tensors run the same Triton kernels through the
    interpreter when ``TRITON_INTERPRET=1`` was set before import (``llm_speed.core.runtime.INTERPRETED``);
    otherwise they run the PyTorch reference (``reference.py``) in float32, which stores the scores.

    Memory on the Triton path: O(batch * heads * seq * head_dim) in forward and backward, never
    O(seq_q * seq_kv).

    Flags must be real bools (NumPy bools accepted); flash-attn's and SDPA's argument names (``causal=``,
    ``softmax_scale=``, ``attn_mask=``, ...) get a TypeError naming ours.
    """
    if unknown:
        unknown_keywords(flash_attention, unknown)
    known = None  # the key of a call that _DENSE_CALLS may serve: the common inference call
    if (
        window is None and softcap is None and alibi_slopes is None and type(dropout_p) is float
        and not dropout_p and descale_q is None and descale_k is None and descale_v is None
        and (is_causal is True or is_causal is False) and (return_lse is True or return_lse is False)
        and (deterministic is True or deterministic is False)
        and (scale is None or type(scale) is float and -math.inf < scale < math.inf)
        and (mode := plain_call(q, k, v))
    ):  # fmt: skip
        known = _dense_call_key(q, k, v, is_causal, scale, return_lse or mode != INFERENCE)
        call = _DENSE_CALLS.get(known)
        if call is not None and mode == INFERENCE:
            out, lse = call(q, k, v, is_causal, scale)
            return (out, lse) if return_lse else out
        if call is not None:  # with grad: the op's autograd node around the kept launch
            scale = call.default_scale if scale is None else scale
            out, lse = _forward_plain.checked(call.forward, q, k, v, is_causal, scale, None, None, None,
                                              deterministic)  # fmt: skip
            return (out, lse) if return_lse else out
    is_causal, return_lse, (left, right), softcap = check_options(is_causal, return_lse, window, softcap)
    deterministic = check_flag("deterministic", deterministic)
    if is_fp8_call(q, descale_q, descale_k, descale_v):
        out, lse = _fp8_attention(q, k, v, (descale_q, descale_k, descale_v), is_causal, scale, left, right,
                                  softcap, alibi_slopes, dropout_p)  # fmt: skip
        return (out, lse) if return_lse else out
    q, k, v = autocast.cast_inputs(autocast.LOWER, q, k, v)  # as SDPA: mixed dtypes meet under autocast
    given = q, k, v
    q, k, v, scale = prepare_attention_inputs(q, k, v, scale)
    keep = (
        known is not None and given[0] is q and given[1] is k and given[2] is v  # nothing copied
        and runtime.triton_runs_on(q.device) and q.shape[0] and q.shape[2] and k.shape[2]
    )  # fmt: skip
    if keep and mode == INFERENCE:
        # what the op would launch, kept for the next such call (the LSE's stores compiled out unless it is
        # asked for)
        call = _DenseCall(q, k, v, is_causal, scale < 0.0, return_lse)
        _DENSE_CALLS.put(known, call)
        out, lse = call(q, k, v, is_causal, scale)
    elif alibi_slopes is None and not dropout_p:  # the common call: nothing more to check
        out, lse = _forward_call(q, k, v, is_causal, scale, left, right, softcap, deterministic)
        if keep:  # with grad: the launch of forward() with its LSE, for Op.checked
            _DENSE_CALLS.put(known, _DenseCall(q, k, v, is_causal, scale < 0.0, True))
    else:
        alibi_slopes = check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[1], q.device)
        dropout_p, rng = check_dropout(dropout_p, q.device)
        out, lse = _forward_call(
            q, k, v, is_causal, scale, left, right, softcap, deterministic, alibi_slopes, dropout_p, rng
        )
    return (out, lse) if return_lse else out
