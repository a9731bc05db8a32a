"""Attention over a KV cache, dense or paged, with split-KV ("flash-decoding") and an in-place append.

The public function follows flash-attn's ``flash_attn_with_kvcache`` (Dao-AILab/flash-attention,
``flash_attn/flash_attn_interface.py``): q ``[batch, seq_q, heads_q, D]``; a dense cache
``[batch, seq_cache, heads_kv, D]`` or a paged one ``[num_blocks, page_size, heads_kv, D]`` addressed through
``block_table [batch, max_pages]`` (vLLM's PagedAttention layout, Kwon et al., SOSP 2023, arXiv:2309.06180);
new keys/values appended in place at ``cache_seqlens``. Split-KV follows Flash-Decoding (Dao, Haziza, Massa,
Sizov, 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html): when batch x heads_kv programs cannot
fill the GPU, each sequence's keys are cut into ``splits`` ranges whose partial results are merged by their
log-sum-exp.

Nothing on the host reads ``cache_seqlens`` or the block table (unless the value checks are on,
:func:`llm_speed.core.runtime.check_values`): grids, split counts and buffers are sized from shapes alone,
the cache *capacity* per sequence (``seq_cache``, or ``max_pages * page_size``) standing in for the longest
sequence, as flash-attn sizes its split count (``flash_api.cpp``, ``mha_fwd_kvcache``: ``seqlen_k`` is the
cache's size, not the lengths). A program whose split holds no visible key writes an empty partial (0, LSE
-inf) that the combine kernel weighs 0. Invalid entries are caught in the kernels: a sequence whose
``cache_seqlens`` is negative or leaves no room for the new tokens (or puts a rotary position past the
tables), whose ``cache_leftpad`` is outside ``[0, cache_seqlens]`` or whose ``cache_batch_idx`` names no cache
row touches no cache slot, and one whose block table names a page outside the pool (among the pages in use)
reads no such page; all get NaN rows.

The flash-attn 2.x options are done in the kernels, with no extra pass over q or the cache:
``cache_batch_idx`` picks the dense cache row of each sequence; ``cache_leftpad`` moves the first key of a
sequence (its masks and ALiBi distances are in cache positions, unchanged); rotary embedding is applied to k
in the append kernel as it is written and to q in the attention kernel as it is loaded (float32, rounded to
q's dtype, as flash-attn's ``rotary.h``); ALiBi's ``-slope * |p_i - j|`` is added to the scores after the
softcap.
An fp8 cache (``float8_e4m3fn``/``float8_e5m2`` with ``k_descale``/``v_descale``, FlashAttention-3's
names) halves the bytes decode streams: the attention kernel reads fp8 tiles and widens them exactly before
``tl.dot``, the keys to q's dtype (to float16 for a bfloat16 q, whose rows it scales by powers of two into
float16's range, the factors folded into the scores), ``k_descale`` folded into the score scale; with a
16-bit q the values' product runs in float16 (every e4m3 and e5m2 value is one exactly, and P in [0, 1] is
rounded once, as in q's dtype) and ``v_descale`` scales its float32 sum (a float32 q: values dequantized in
float32); new k/v are quantized with the same descales as they are written (by the append kernel or the
attention kernel).
An option left out is a None pointer, a constexpr: its code is compiled out.

Kernels. In a decode step (the query rows of a KV head fit one tile, :func:`appends_in_attention`) the
attention kernel writes the new k/v rows itself: each (sequence, KV head, split) program writes those of its
split's key range, then a block barrier, then reads its keys (flash-attn 2's ``Append_KV``); otherwise the
append kernel (one program per new token and block of KV heads) writes them before. The attention kernel has
one program per (query-row block, split, batch * kv head), on a 1-D grid. The rows of a program are the
``group = heads_q / heads_kv`` query heads that share its KV head times the ``seq_q`` query positions, row
``r`` being position ``r // group`` of head ``r % group``: with GQA a decode step reads each K/V tile once for
the whole group, and the rows fill the M dimension of ``tl.dot`` (>= 16). Key rows are gathered one by one
through the block table when paged, so any ``page_size`` works with any key block.
Naming: ``p_`` pointers, ``b_`` blocks, ``o_`` offsets, ``m_`` masks;
BM rows, BN keys, BD padded head_dim. Scores are in base 2 (``exp2``); the LSE in HBM is in natural-log units.

Constexpr switches:
  PAGED                    keys are gathered through BLOCK_TABLE; else the cache is [batch, seq_cache, ...]
  HAS_LEFT / HAS_RIGHT     window bounds (causal is HAS_RIGHT with right = 0)
  HAS_SOFTCAP              scores become softcap * tanh(scores / softcap)
  INTERLEAVED              rotary pairs (2c, 2c + 1) (GPT-J); else (c, c + rotary_dim / 2) (GPT-NeoX)
  SPLIT                    write fp32 partial (out, lse) per split for the combine kernel; else the result
  DOT_IN_FP32, DOT_PRECISION, RNE_BY_HAND   as in core/kernel_math.py (append: RNE_BY_HAND for rotated k)
The optional inputs are pointers fixed to None (constexprs: their code is compiled out) when not given:
  CACHE_BATCH_IDX          the dense cache row of sequence b is CACHE_BATCH_IDX[b] (never with PAGED)
  CACHE_LEFTPAD            sequence b's keys start at position CACHE_LEFTPAD[b] (never with PAGED)
  COS, SIN                 rotate k (append) and q (attention): [seqlen_ro, rotary_dim / 2]; q per row when
                           HAS_LEFT or HAS_RIGHT, else every query at cache_seqlens
  ALIBI                    add -ALIBI[b, h] * |p_i - j| to the scores (after the softcap)
  K, V                     (attention kernel) the new tokens it writes, BLOCK_J rows at a time (None: no new
                           token, or the append kernel writes them)
  K_DESCALE, V_DESCALE     an fp8 cache: the descale of (sequence b, KV head h) is at b * stride_db +
                           h * stride_dh (strides 0 for a per-tensor or per-head descale); the append
                           kernel quantizes k/v with them (FP8_* constexprs: the fp8 GEMM's cast), the
                           attention kernel widens the fp8 tiles exactly (keys to q's dtype, float16 for a
                           bfloat16 q; values to float16 with a 16-bit q) and folds them into the score
                           scale and the output
All contiguous (a [heads_q] ALIBI has batch stride 0) but the descales (read through their strides).

Layout (every op module): kernels, launcher (configuration, plans, launch), op registration, public function
(forward only: no autograd). The plain-PyTorch spec is :func:`llm_speed.attention.reference.reference_kvcache`
(:func:`~llm_speed.attention.reference.reference_attention` over each sequence's gathered keys when no option
is given).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..core import runtime, tensors
from ..core.args import check_flag, check_real, positive_int
from ..core.config import KernelConfig
from ..core.dispatch import Op, plain_inference
from ..core.hardware import Hardware, hardware_of
from ..core.kernel_math import LN2, LOG2E, cast, dot, dot_switches, rne_by_hand, tanh
from ..core.launch import CallCache, Kernel, cdiv, next_power_of_2, plan_cache
from ..core.policy import LaunchPolicy, current_policy
from ..core.tensors import FLOAT_DTYPES, check_same_device, check_tensor, dtype_names
from ..core.tile_choice import SMALLEST_TILE_SIDE as MIN_DOT_DIM
from ..matmul.fp8 import FP8_DTYPES, fp8_constants, to_fp8
from .checks import (
    MAX_HEAD_DIM,
    check_alibi_slopes,
    check_descale,
    check_descale_values,
    check_scale,
    check_softcap,
    check_window,
    descale_fine,
    suggest_keywords,
    unknown_keywords,
)

PAGE_MULTIPLE = 16  # page_size must be a multiple of this (flash-attn asks 256, vLLM 16)
MAX_SPLITS = 128  # as flash-attn's split heuristic
# Programs of 4 warps per SM that the split count fills: flash-attn counts two per SM for its 128-thread
# kernel. Ours holds 2-3 per SM on sm_90a at head_dim 128 (156-179 registers); on 2026-11-25 (H100) the
# step at batch 8 x 16k with one program per SM read 2.27 TB/s, at batch 32 x 16k with two 3.06 TB/s.
PROGRAMS_PER_SM = 2
MAX_TABLE_BLOCK = 64  # block-table entries checked per step by an attention program

# --- kernels --------------------------------------------------------------------------------------------


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
    p_k = K + i_b.to(tl.int64) * stride_kb + (o_j * stride_ks + o_h * stride_kh)[:, None]
    p_v = V + i_b.to(tl.int64) * stride_vb + (o_j * stride_vs + o_h * stride_vh)[:, None] + o_d[None, :]
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


# --- launcher -------------------------------------------------------------------------------------------

APPEND = Kernel(_append_kernel, "kvcache_append")
FORWARD = Kernel(_kvcache_fwd_kernel, "kvcache_attention_fwd")
COMBINE = Kernel(_kvcache_combine_kernel, "kvcache_attention_combine")
KERNEL_APPEND = APPEND.name
KERNEL_DECODE = FORWARD.name
KERNEL_COMBINE = COMBINE.name
APPEND_BLOCK_ELEMENTS = 4096  # append: KV heads x head_dim elements per program at most
FUSED_APPEND_ELEMENTS = 512  # new tokens x head_dim per step of the attention kernel's append
# The append kernel's fp8 constexprs for a 16-bit cache (unused: its quantization is compiled out).
_NO_FP8 = dict(FP8_MAX=0.0, FP8_SHIFT=0, FP8_ROUND_MASK=0, FP8_MIN_NORMAL=0.0, FP8_SUBNORMAL_MAGIC=0.0,
               FP8_ROUND_BY_HAND=False)  # fmt: skip


def _fp8_switches(cache_dtype: torch.dtype | None) -> dict:
    """The append kernel's FP8_* constexprs for a cache of ``cache_dtype`` (None: a 16-bit cache): those of
    the fp8 GEMM's cast (:func:`llm_speed.matmul.fp8.fp8_constants`), rounding by hand under the
    interpreter."""
    if cache_dtype is None:
        return _NO_FP8
    return {"FP8_" + name.removeprefix("FP8_"): value for name, value in fp8_constants(cache_dtype).items()}


def choose_num_splits(programs: int, key_blocks: int, slots: int, max_splits: int = MAX_SPLITS) -> int:
    """Split count for ``programs`` (batch x heads_kv x row blocks) over ``key_blocks`` key blocks, on a GPU
    with ``slots`` program slots (SMs x :data:`PROGRAMS_PER_SM` for a kernel of 4 warps).

    flash-attn's ``num_splits_heuristic`` (Dao-AILab/flash-attention, ``csrc/flash_attn/flash_api.cpp``),
    which ``set_params_splitkv`` calls with twice the SM count for its 128-thread kernel: no split when the
    programs nearly fill the slots (>= 80%); otherwise the smallest split count whose wave efficiency
    (programs x splits / slots over its ceiling) is within 85% of the best, skipping counts that give the same
    blocks per split as the one below.
    """
    if programs >= 0.8 * slots or key_blocks <= 1:
        return 1
    limit = min(max_splits, slots, key_blocks)
    candidates = [s for s in range(1, limit + 1) if s == 1 or cdiv(key_blocks, s) != cdiv(key_blocks, s - 1)]
    efficiency = {s: programs * s / slots / cdiv(programs * s, slots) for s in candidates}
    best = max(efficiency.values())
    return next(s for s in candidates if efficiency[s] >= 0.85 * best)


def max_block_m(head_dim: int, dtype: torch.dtype) -> int:
    """The attention kernel's largest query tile: 32 rows, 16 at head_dim > 128 or in float32 (the fp32
    accumulator and both tiles stay in registers)."""
    return 16 if head_dim > 128 or dtype == torch.float32 else 32


def appends_in_attention(
    rows: int, head_dim: int, dtype: torch.dtype, policy: LaunchPolicy | None = None
) -> bool:
    """Whether a call with new tokens and ``rows`` = group * seq_q query rows per KV head has the attention
    kernel write them (one launch), under ``policy`` (None: the current one) with its
    ``decode_append_in_attention``: its rows fit one query tile, so one program per (sequence, KV head,
    split) reads each new key and can write it first; else (several tiles would race on them, or the
    policy says no) the append kernel runs before."""
    policy = current_policy() if policy is None else policy
    return policy.decode_append_in_attention and 0 < rows <= max_block_m(head_dim, dtype)


@functools.cache
def kernel_config(
    head_dim: int, dtype: torch.dtype, rows: int, capacity: int, programs_kv: int, hardware: Hardware,
    num_splits: int = 0,
) -> KernelConfig:
    """The attention kernel's tiles and split count for ``rows`` = group * seq_q query rows per KV head,
    ``capacity`` cache tokens per sequence and ``programs_kv`` = batch * heads_kv; ``num_splits`` as asked
    (0: :func:`choose_num_splits` on ``hardware``'s SMs, :data:`PROGRAMS_PER_SM` each).

    Decode reads each K/V tile once per program and is bound by memory: key blocks (``block_n``) of 64 rows
    (32 at head_dim 256) keep the loads wide; query tiles (``block_m``) of at most 32 rows (16 at head_dim 256
    or in float32) keep the fp32 accumulator and both tiles in registers; ``block_m`` is at least 16, the
    smallest ``tl.dot`` tile. ``splits``: at most MAX_SPLITS (the combine kernel holds every split of a row
    at once) and one key block of the capacity per split; the key range of split s is
    ``[s * L, (s + 1) * L)`` with ``L = cdiv(key_blocks, splits) * block_n`` (:func:`split_len`).
    Compiled for sm_90 (Triton 3.9) they need at most 84 KB of shared memory and spill at most about 1 KB
    per thread (16-bit, head_dim 128, paged and split); most variants spill nothing.
    """
    block_d = max(MIN_DOT_DIM, next_power_of_2(head_dim))
    block_n = 32 if block_d > 128 else 64
    block_m = min(max_block_m(head_dim, dtype), max(MIN_DOT_DIM, next_power_of_2(rows)))
    key_blocks = cdiv(capacity, block_n)
    num_warps = 4 if block_d <= 128 else 8
    if num_splits == 0:
        slots = hardware.sm_count * PROGRAMS_PER_SM * 4 // num_warps  # 8 warps (head_dim 256): half as many
        num_splits = choose_num_splits(programs_kv * cdiv(rows, block_m), key_blocks, slots)
    blocks_per_split = cdiv(max(key_blocks, 1), max(1, min(num_splits, MAX_SPLITS, key_blocks)))
    splits = max(1, cdiv(key_blocks, blocks_per_split))  # no split past the capacity
    return KernelConfig(block_m, block_n, num_warps, 2, block_d=block_d, splits=splits)


def split_len(cfg: KernelConfig, capacity: int) -> int:
    """Keys per split of ``cfg`` over a cache of ``capacity`` tokens: whole key blocks."""
    return cdiv(cdiv(capacity, cfg.block_n), cfg.splits) * cfg.block_n


def rotary_span(seq_new: int, seq_q: int, per_row: bool) -> int:
    """Positions ``cache_seqlens + [0, span)`` a call with rotary reads angles for: the new keys', and the
    queries' (``seq_q`` of them when ``per_row``, causal or windowed; else all at ``cache_seqlens``)."""
    return max(seq_new, seq_q if per_row else min(seq_q, 1))


@plan_cache
def _plans(
    q_shape: tuple, q_strides: tuple, cache_shape: tuple, k_strides: tuple, v_strides: tuple,
    table_shape: tuple | None, table_strides: tuple | None, seqlens_stride: int, seq_new: int,
    new_strides: tuple | None, dtype: torch.dtype, window_left: int | None, window_right: int | None,
    has_softcap: bool, num_splits: int, device: torch.device, batch_idx: bool = False, leftpad: bool = False,
    rotary: tuple | None = None, alibi_batch_stride: int | None = None, fp8: tuple | None = None, *,
    lse: bool, policy: LaunchPolicy,
) -> tuple:
    """(append plan or None, attention plan or None, combine plan or None, shape of out, shape of the LSE or
    None when ``lse`` is False (not asked for: its stores are compiled out), elements of the float32
    workspace of the split partials or 0 (no split)) of one problem class; shapes are plain tuples (cheaper
    to allocate from than a torch.Size); every caller spells ``lse``, so that a class's plans have one key
    however they are asked for. ``new_strides`` = (k's strides, v's strides) when there are new tokens. The
    optional inputs (contiguous):
    ``batch_idx`` and ``leftpad`` whether ``cache_batch_idx``/``cache_leftpad`` are given, ``rotary`` =
    (seqlen_ro, rotary_dim, the tables' dtype, interleaved) or None, ``alibi_batch_stride`` (0 for [heads_q]
    slopes, heads_q for [batch, heads_q]) or None, ``fp8`` = (the caches' fp8 dtype, (batch stride, head
    stride) of k_descale, the same of v_descale) or None (a 16-bit cache). An absent input's pointer is fixed
    to None (a constexpr: its code is compiled out). ``policy``: the launch choices
    (:func:`appends_in_attention`)."""
    batch, seq_q, heads_q, head_dim = q_shape
    heads_kv = cache_shape[2]
    paged = table_shape is not None
    page_size = cache_shape[1]
    capacity = table_shape[1] * page_size if paged else cache_shape[1]
    num_blocks = cache_shape[0] if paged else 0
    stride_btb, stride_btp = table_strides if paged else (0, 0)
    seqlen_ro, rotary_dim, _, interleaved = rotary or (1, 0, None, False)
    per_row = window_left is not None or window_right is not None
    max_cached = capacity - seq_new  # the largest valid cache_seqlens
    if rotary is not None:
        max_cached = min(max_cached, seqlen_ro - rotary_span(seq_new, seq_q, per_row))
    given = (("CACHE_BATCH_IDX", batch_idx), ("CACHE_LEFTPAD", leftpad), ("COS", rotary), ("SIN", rotary))
    given += (("K_DESCALE", fp8), ("V_DESCALE", fp8))
    absent = {name: None for name, present in given if not present}
    (s_kdb, s_kdh), (s_vdb, s_vdh) = fp8[1:] if fp8 is not None else ((0, 0), (0, 0))
    optional = dict(cache_batch=cache_shape[0], rotary_dim=rotary_dim, INTERLEAVED=interleaved,
                    stride_kdb=s_kdb, stride_kdh=s_kdh, stride_vdb=s_vdb, stride_vdh=s_vdh, **absent)
    fp8_switches = _fp8_switches(fp8[0] if fp8 else None)
    lse_shape = (batch, heads_q, seq_q) if lse else None
    group = heads_q // heads_kv
    attending = batch and seq_q
    fused = bool(batch and seq_new) and appends_in_attention(group * seq_q, head_dim, dtype, policy)
    (s_kb, s_ks, s_kh, _), (s_vb, s_vs, s_vh, _) = new_strides if seq_new else ((0,) * 4, (0,) * 4)
    append = None
    if batch and seq_new and not fused:
        block_d = next_power_of_2(head_dim)
        block_h = min(next_power_of_2(heads_kv), max(1, APPEND_BLOCK_ELEMENTS // block_d))
        append = APPEND.plan(
            (batch * seq_new, cdiv(heads_kv, block_h)),
            stride_kb=s_kb, stride_ks=s_ks, stride_kh=s_kh, stride_vb=s_vb, stride_vs=s_vs, stride_vh=s_vh,
            stride_kcb=k_strides[0], stride_kcs=k_strides[1], stride_kch=k_strides[2],
            stride_vcb=v_strides[0], stride_vcs=v_strides[1], stride_vch=v_strides[2],
            stride_cs=seqlens_stride, stride_btb=stride_btb, stride_btp=stride_btp,
            seq_new=seq_new, heads_kv=heads_kv, head_dim=head_dim, page_size=page_size, num_blocks=num_blocks,
            max_cached=max_cached, PAGED=paged, RNE_BY_HAND=rotary is not None and rne_by_hand(dtype),
            BLOCK_H=block_h, BLOCK_D=block_d, **optional, **fp8_switches,
            num_warps=min(8, max(1, block_h * block_d // 512)), num_stages=1,
        )  # fmt: skip
    if not attending:
        return append, None, None, (batch, seq_q, heads_q, head_dim), lse_shape, 0
    cfg = kernel_config(head_dim, dtype, group * seq_q, capacity, batch * heads_kv, hardware_of(device),
                        num_splits)  # fmt: skip
    split = cfg.splits > 1
    n_row_blocks = cdiv(group * seq_q, cfg.block_m)
    # The outputs the kernel writes: the result [B, Sq, Hq, D] / LSE [B, Hq, Sq], or float32 partials with a
    # leading split dim, the LSEs after the outputs in one workspace (all contiguous, allocated per call).
    out_strides = (seq_q * heads_q * head_dim, heads_q * head_dim, head_dim)
    lse_strides = (heads_q * seq_q, seq_q)
    split_o = batch * seq_q * heads_q * head_dim if split else 0
    split_l = batch * heads_q * seq_q if split else 0
    lse_offset = cfg.splits * split_o  # (0 without a split)
    switches = dot_switches(dtype)
    attend = FORWARD.plan(
        (n_row_blocks * cfg.splits * batch * heads_kv,),
        stride_qb=q_strides[0], stride_qs=q_strides[1], stride_qh=q_strides[2],
        stride_kb=k_strides[0], stride_ks=k_strides[1], stride_kh=k_strides[2],
        stride_vb=v_strides[0], stride_vs=v_strides[1], stride_vh=v_strides[2],
        stride_nkb=s_kb, stride_nks=s_ks, stride_nkh=s_kh, stride_nvb=s_vb, stride_nvs=s_vs, stride_nvh=s_vh,
        stride_o_split=split_o, stride_ob=out_strides[0], stride_os=out_strides[1], stride_oh=out_strides[2],
        stride_l_split=split_l, stride_lb=lse_strides[0], stride_lh=lse_strides[1], lse_offset=lse_offset,
        stride_cs=seqlens_stride, stride_btb=stride_btb, stride_btp=stride_btp,
        stride_ab=alibi_batch_stride or 0,
        seq_q=seq_q, seq_new=seq_new, max_cached=max_cached, heads_kv=heads_kv, group=group,
        head_dim=head_dim, page_size=page_size, num_blocks=num_blocks, split_len=split_len(cfg, capacity),
        num_splits=cfg.splits, n_row_blocks=n_row_blocks,
        window_left=window_left if window_left is not None else 0,
        window_right=window_right if window_right is not None else 0,
        PAGED=paged, HAS_LEFT=window_left is not None, HAS_RIGHT=window_right is not None,
        HAS_SOFTCAP=has_softcap, SPLIT=split, **switches, **optional, **fp8_switches,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
        BLOCK_J=max(1, min(cfg.block_n, FUSED_APPEND_ELEMENTS // cfg.block_d)),
        BLOCK_P=next_power_of_2(min(max(1, table_shape[1] if paged else 1), MAX_TABLE_BLOCK)),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if alibi_batch_stride is not None else {"ALIBI": None}),
        **({} if lse or split else {"LSE": None}),
        **({} if fused else {"K": None, "V": None}),
    )  # fmt: skip
    combine = None
    if split:
        combine = COMBINE.plan(
            (batch * seq_q * heads_q,), stride_o_split=split_o, stride_l_split=split_l, lse_offset=lse_offset,
            seq_q=seq_q, heads_q=heads_q, num_splits=cfg.splits, head_dim=head_dim,
            RNE_BY_HAND=rne_by_hand(dtype), BLOCK_S=next_power_of_2(cfg.splits), BLOCK_D=cfg.block_d,
            num_warps=4, num_stages=1, **({} if lse else {"LSE": None}),
        )  # fmt: skip
    out_shape = (batch, seq_q, heads_q, head_dim)
    return append, attend, combine, out_shape, lse_shape, cfg.splits * (split_o + split_l)


_LOG2E = math.log2(math.e)
_Tensor = torch.Tensor
_F32 = torch.float32
_I32 = torch.int32
_MINUS_INF = float("-inf")
_E4M3, _E5M2 = FP8_DTYPES


_NOTHING: dict = {}  # no optional input (never written)


def descale_strides(t: torch.Tensor) -> tuple[int, int]:
    """(batch stride, head stride) the kernels read a descale with: 0 along a dim it lacks or of size 1
    (``[]``/``[1]``: one value; ``[heads_kv]``; ``[batch, heads_kv]``)."""
    shape = t.shape
    if not shape:
        return (0, 0)
    if len(shape) == 2:
        stride_b, stride_h = t.stride()
        return (stride_b if shape[0] > 1 else 0, stride_h if shape[1] > 1 else 0)
    return (0, t.stride()[0]) if shape[0] > 1 else (0, 0)


def _optional_inputs(cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved,
                     alibi_slopes, k_cache=None, k_descale=None, v_descale=None):  # fmt: skip
    """({kernel parameter: tensor} of the optional inputs given to both kernels (the slopes go to the
    attention kernel alone), their part of the plan key: (batch index given, leftpad given, rotary key or
    None, ALiBi batch stride or None, fp8 key or None))."""
    extra = {}
    rotary = alibi_batch_stride = fp8 = None
    if cache_batch_idx is not None:
        extra["CACHE_BATCH_IDX"] = cache_batch_idx
    if cache_leftpad is not None:
        extra["CACHE_LEFTPAD"] = cache_leftpad
    if rotary_cos is not None:
        rotary = (rotary_cos.shape[0], 2 * rotary_cos.shape[1], rotary_cos.dtype, rotary_interleaved)
        extra["COS"], extra["SIN"] = rotary_cos, rotary_sin
    if alibi_slopes is not None:
        alibi_batch_stride = alibi_slopes.shape[1] if alibi_slopes.dim() == 2 else 0
    if k_descale is not None:
        fp8 = (k_cache.dtype, descale_strides(k_descale), descale_strides(v_descale))
        extra["K_DESCALE"], extra["V_DESCALE"] = k_descale, v_descale
    keys = (cache_batch_idx is not None, cache_leftpad is not None, rotary, alibi_batch_stride, fp8)
    return extra, keys


def _cache_inputs(k_cache, k_descale, v_descale) -> tuple[dict, tuple]:
    """:func:`_optional_inputs` of a call with no optional input but an fp8 cache's descales (or none: a
    16-bit cache), without its work."""
    if k_descale is None:
        return _NOTHING, ()
    fp8 = (k_cache.dtype, descale_strides(k_descale), descale_strides(v_descale))
    return {"K_DESCALE": k_descale, "V_DESCALE": v_descale}, (False, False, None, None, fp8)


def _plan_args(q, k_cache, v_cache, cache_seqlens, k, v, block_table, window_left, window_right, capped: bool,
               num_splits: int) -> tuple:  # fmt: skip
    """:func:`_plans`'s arguments but the optional inputs'."""
    seq_new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    return (
        q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
        block_table.shape if paged else None, block_table.stride() if paged else None,
        cache_seqlens.stride(0), seq_new, (k.stride(), v.stride()) if seq_new else None, q.dtype,
        window_left, window_right, capped, num_splits, q.device,
    )  # fmt: skip


def forward(q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale: float, window_left, window_right,
            softcap, num_splits: int, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
            rotary_sin=None, rotary_interleaved: bool = True, alibi_slopes=None, k_descale=None,
            v_descale=None):  # fmt: skip
    """Append k/v (if given; k rotated when rotary_cos/sin are; quantized with the descales into an fp8
    cache) into the caches, then attend; returns (out, lse). Arguments as checked by
    :func:`flash_attention_with_kvcache` (q, k, v with a contiguous last dim; cache_batch_idx,
    cache_leftpad, the rotary tables and the slopes contiguous; ``cache_seqlens`` an int32 tensor; the
    descales given exactly when the caches are fp8). Reads no tensor value on the host; reports its work
    once per call."""
    q_shape = q.shape
    device = q.device
    seq_new = 0 if k is None else k.shape[1]
    if not runtime.triton_runs_on(device) and q_shape[0] and (q_shape[1] or seq_new):
        raise runtime.TritonUnavailable(
            "flash_attention_with_kvcache runs Triton kernels only: use CUDA tensors, or CPU tensors with "
            "TRITON_INTERPRET=1 set before importing llm_speed"
        )
    plan_args = _plan_args(q, k_cache, v_cache, cache_seqlens, k, v, block_table, window_left, window_right,
                           softcap is not None, num_splits)  # fmt: skip
    plain = cache_batch_idx is None and cache_leftpad is None and rotary_cos is None and alibi_slopes is None
    if plain:  # a 16-bit cache, or an fp8 cache alone (the serving case): no other option's work
        extra, optional_keys = _cache_inputs(k_cache, k_descale, v_descale)
    else:
        extra, optional_keys = _optional_inputs(cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
                                                rotary_interleaved, alibi_slopes, k_cache, k_descale,
                                                v_descale)  # fmt: skip
    plans = _plans(*plan_args, *optional_keys, lse=True, policy=current_policy())
    return _run(plans, q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, window_left,
                window_right, softcap, extra, cache_leftpad, alibi_slopes)  # fmt: skip


def _run(plans: tuple, q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale: float, window_left,
         window_right, softcap, extra: dict, cache_leftpad=None, alibi_slopes=None):  # fmt: skip
    """Append, report, allocate and attend with ``plans`` (:func:`_plans`'s tuple): :func:`forward` after
    its plans; ``extra`` the optional inputs' per-call tensors. Returns (out, lse); lse None when the plans
    store none."""
    append, attend, combine, out_shape, lse_shape, workspace = plans
    device = q.device
    seq_new = 0 if k is None else k.shape[1]
    table = cache_seqlens if block_table is None else block_table  # a placeholder when dense (never read)
    # (a call spelled with **extra costs the plain call about 0.3 us: it has its own line)
    if append is not None and extra:
        append.launch(K=k, V=v, K_CACHE=k_cache, V_CACHE=v_cache, CACHE_SEQLENS=cache_seqlens,
                      BLOCK_TABLE=table, **extra)  # fmt: skip
    elif append is not None:
        append.launch(K=k, V=v, K_CACHE=k_cache, V_CACHE=v_cache, CACHE_SEQLENS=cache_seqlens,
                      BLOCK_TABLE=table)  # fmt: skip
    if attend is None:  # no query (batch or seq_q 0): empty results
        out = torch.empty(out_shape, dtype=q.dtype, device=device)
        return out, None if lse_shape is None else torch.empty(lse_shape, dtype=_F32, device=device)
    runtime.report_work(
        "attention_kvcache_fwd", q=q, k_cache=k_cache, cache_seqlens=cache_seqlens, seq_new=seq_new,
        block_table=block_table, window=(window_left, window_right), cache_leftpad=cache_leftpad,
    )  # fmt: skip
    out = tensors.new_output(out_shape, q.dtype, device)
    lse = None if lse_shape is None else tensors.new_output(lse_shape, _F32, device)
    # What the attention kernel writes: the results, or the split partials (outputs and LSEs in one buffer)
    part = out if combine is None else tensors.new_output((workspace,), _F32, device)
    part_lse = lse if combine is None else part
    qk_scale_log2 = scale * _LOG2E
    cap = softcap if softcap is not None else 0.0
    if alibi_slopes is not None:
        extra = {**extra, "ALIBI": alibi_slopes}
    if append is None and seq_new:  # the attention kernel appends them (see _plans)
        extra = {**extra, "K": k, "V": v}
    if extra:
        extra = extra if part_lse is None else {**extra, "LSE": part_lse}
        attend.launch(Q=q, K_CACHE=k_cache, V_CACHE=v_cache, CACHE_SEQLENS=cache_seqlens, BLOCK_TABLE=table,
                      OUT=part, qk_scale_log2=qk_scale_log2, softcap=cap, **extra)  # fmt: skip
    elif part_lse is not None:
        attend.launch(Q=q, K_CACHE=k_cache, V_CACHE=v_cache, CACHE_SEQLENS=cache_seqlens, BLOCK_TABLE=table,
                      OUT=part, LSE=part_lse, qk_scale_log2=qk_scale_log2, softcap=cap)  # fmt: skip
    else:  # the LSE's stores compiled out
        attend.launch(Q=q, K_CACHE=k_cache, V_CACHE=v_cache, CACHE_SEQLENS=cache_seqlens, BLOCK_TABLE=table,
                      OUT=part, qk_scale_log2=qk_scale_log2, softcap=cap)  # fmt: skip
    if combine is not None and lse is not None:
        combine.launch(OUT_PART=part, LSE_PART=part, OUT=out, LSE=lse)
    elif combine is not None:
        combine.launch(OUT_PART=part, LSE_PART=part, OUT=out)
    return out, lse


# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::flash_attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    block_table: torch.Tensor | None,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float | None,
    num_splits: int,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(
        q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, window_left, window_right, softcap,
        num_splits, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes,
        k_descale, v_descale,
    )  # fmt: skip


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, window_left, window_right,
                  softcap, num_splits, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
                  rotary_sin=None, rotary_interleaved=True, alibi_slopes=None, k_descale=None,
                  v_descale=None):  # fmt: skip
    batch, seq_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seq_q), dtype=torch.float32)


_kvcache_call = Op(_kvcache_op, forward)  # forward only: no gradient formula


# --- public function ------------------------------------------------------------------------------------


def _check_tensors(q, k_cache, v_cache, k, v, block_table) -> bool:
    """Types, ranks, dtypes (one float dtype for all, or fp8 caches of one dtype) and devices; the common
    case in a few comparisons. Returns whether the caches are fp8."""
    check_tensor("q", q, dims=4, what="[batch, seq_q, heads_q, head_dim]")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens to append) or both be None")
    dtype, device = q.dtype, q.device
    fp8 = False
    for name, t, cache in (("k_cache", k_cache, True), ("v_cache", v_cache, True), ("k", k, False),
                           ("v", v, False)):  # fmt: skip
        if t is not None and (not isinstance(t, _Tensor) or t.dtype is not dtype or t.dim() != 4
                              or t.device != device):  # fmt: skip
            if cache and (t.dtype is _E4M3 or t.dtype is _E5M2) and t.dim() == 4 and t.device == device:
                fp8 = True
            else:
                _refuse_tensor(name, t, dtype, device)
    if fp8 and k_cache.dtype is not v_cache.dtype:
        raise TypeError(
            f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must share one dtype: q's, or one fp8 "
            f"dtype ({dtype_names(FP8_DTYPES)})"
        )
    if block_table is not None:
        if not isinstance(block_table, _Tensor):
            raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
        if block_table.dtype is not torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.device != device:
            check_same_device(q=q, block_table=block_table)
    return fp8


def _refuse_tensor(name: str, t, dtype: torch.dtype, device: torch.device) -> None:
    """The error for ``t``, which failed the quick tests of :func:`_check_tensors`."""
    cache = name.endswith("_cache")
    check_tensor(name, t, dtypes=FLOAT_DTYPES + FP8_DTYPES if cache else FLOAT_DTYPES)
    if t.dtype != dtype and not (cache and t.dtype in FP8_DTYPES):
        other = f" (or an fp8 dtype, {dtype_names(FP8_DTYPES)}, with k_descale/v_descale)" if cache else ""
        raise TypeError(f"{name} dtype {t.dtype} differs from q's {dtype}: it must be q's dtype{other}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dims, got shape {tuple(t.shape)}")
    raise ValueError(f"{name} is on {t.device}, q on another device: all tensors must be on one device")


def _check_descales(q, k_cache, k_descale, v_descale, fp8: bool) -> None:
    """The descales of an fp8 cache (both required; float32 ``[]``, ``[1]``, ``[heads_kv]`` or ``[batch,
    heads_kv]`` on q's device), and none with a 16-bit cache."""
    if fp8:
        batch, heads_kv, device = q.shape[0], k_cache.shape[2], q.device
        if descale_fine(k_descale, batch, heads_kv, device) and descale_fine(v_descale, batch, heads_kv,
                                                                               device):  # fmt: skip
            return
    else:
        name = "k_descale" if k_descale is not None else "v_descale"
        raise ValueError(
            f"{name} is for an fp8 cache ({dtype_names(FP8_DTYPES)}); k_cache has dtype {k_cache.dtype}: "
            f"leave {name} None"
        )
    for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
        if t is None:
            raise ValueError(
                f"{name} is required with an fp8 cache (k_cache {k_cache.dtype}): float32 [], [heads_kv="
                f"{heads_kv}] or [batch={batch}, heads_kv={heads_kv}]; the cache holds x / {name}"
            )
        check_descale(name, t, batch, heads_kv, device)


def _check_shapes(q, k_cache, v_cache, k, v, block_table, indexed: bool) -> int:
    """Shape rules (``indexed``: a ``cache_batch_idx`` picks the dense cache rows); returns the cache capacity
    per sequence (tokens)."""
    batch, _, heads_q, head_dim = q.shape
    cache_shape = k_cache.shape
    if cache_shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(cache_shape)} and {tuple(v_cache.shape)}"
        )
    heads_kv = cache_shape[2]
    if cache_shape[3] != head_dim:
        raise ValueError(f"k_cache/v_cache head_dim ({cache_shape[3]}) must equal q head_dim ({head_dim})")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q head_dim is {head_dim}; accepted: any head_dim from 1 to {MAX_HEAD_DIM}")
    if heads_q < 1 or heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"q heads ({heads_q}) must be a positive multiple of k_cache heads ({heads_kv})")
    if (k_cache.stride()[3] != 1 or v_cache.stride()[3] != 1) and head_dim > 1:
        name = "k_cache" if k_cache.stride()[3] != 1 else "v_cache"
        raise ValueError(f"{name} must have a contiguous last dim (it is written in place, not copied)")
    if k is not None:
        k_shape, v_shape = k.shape, v.shape
        if k_shape != v_shape or k_shape[0] != batch or k_shape[2] != heads_kv or k_shape[3] != head_dim:
            expected = (batch, k_shape[1], heads_kv, head_dim)
            name, shape = ("k", k_shape) if tuple(k_shape) != expected else ("v", v_shape)
            raise ValueError(
                f"{name} must be [batch, seq_new, heads_kv, head_dim] = {expected}, got {tuple(shape)}"
            )
    if block_table is None:
        if cache_shape[0] != batch and not indexed:
            raise ValueError(
                f"k_cache batch ({cache_shape[0]}) must equal q batch ({batch}) without a block_table or a "
                "cache_batch_idx"
            )
        return cache_shape[1]
    table_shape = block_table.shape
    if len(table_shape) != 2 or table_shape[0] != batch:
        raise ValueError(f"block_table must be [batch={batch}, max_pages], got shape {tuple(table_shape)}")
    page_size = cache_shape[1]
    if page_size < 1 or page_size % PAGE_MULTIPLE:
        raise ValueError(
            f"page_size (k_cache dim 1) must be a positive multiple of {PAGE_MULTIPLE}, got {page_size}"
        )
    return table_shape[1] * page_size


def _check_index(name: str, t, batch: int, device: torch.device) -> None:
    """``t``: an int32 ``[batch]`` tensor on ``device``."""
    if not isinstance(t, _Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 [batch]) or None, got {type(t).__name__}")
    if t.dtype is not torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype}")
    if t.shape != (batch,):
        raise ValueError(f"{name} must be [batch={batch}], got shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


def _options_fine(q, k, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, alibi_slopes):
    """True when :func:`_check_options` has nothing to say: the common case in a few comparisons (the
    checks that explain what is wrong run only when it is False)."""
    batch, _, heads_q, head_dim = q.shape
    device = q.device
    for t in (cache_batch_idx, cache_leftpad):
        if t is not None and not (type(t) is _Tensor and t.dtype is _I32 and t.shape == (batch,)
                                  and block_table is None and t.device == device):  # fmt: skip
            return False
    if rotary_cos is not None:
        if type(rotary_cos) is not _Tensor or type(rotary_sin) is not _Tensor or k is None:
            return False
        shape, dtype = rotary_cos.shape, rotary_cos.dtype
        if not (len(shape) == 2 and rotary_sin.shape == shape and 1 <= shape[1] <= head_dim // 2
                and shape[0] >= 1 and (dtype is q.dtype or dtype is _F32) and rotary_sin.dtype is dtype
                and rotary_cos.device == device and rotary_sin.device == device):  # fmt: skip
            return False
    elif rotary_sin is not None:
        return False
    return alibi_slopes is None or (
        type(alibi_slopes) is _Tensor and alibi_slopes.dtype is _F32 and alibi_slopes.device == device
        and (alibi_slopes.shape == (heads_q,) or alibi_slopes.shape == (batch, heads_q))
    )  # fmt: skip


def _check_options(q, k, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, alibi_slopes):
    """The optional inputs (at least one given): types, dtypes, shapes, devices, and the combinations
    flash-attn refuses (an index or a leftpad with a block table; rotary without new keys)."""
    if _options_fine(q, k, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, alibi_slopes):
        return
    batch, _, heads_q, head_dim = q.shape
    device = q.device
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None:
            _check_index(name, t, batch, device)
            if block_table is not None:
                raise ValueError(f"{name} cannot be used with block_table (as in flash-attn)")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin must be given together")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            check_tensor(name, t, dims=2, what="[seqlen_ro, rotary_dim / 2]")
            if t.dtype is not q.dtype and t.dtype is not torch.float32:
                raise TypeError(f"{name} has dtype {t.dtype}; accepted: q's dtype ({q.dtype}) or float32")
            if t.device != device:
                raise ValueError(f"{name} is on {t.device} but q is on {device}")
        if rotary_sin.dtype is not rotary_cos.dtype or rotary_sin.shape != rotary_cos.shape:
            raise ValueError(
                f"rotary_sin ({tuple(rotary_sin.shape)}, {rotary_sin.dtype}) must have rotary_cos's shape "
                f"and dtype ({tuple(rotary_cos.shape)}, {rotary_cos.dtype})"
            )
        seqlen_ro, half = rotary_cos.shape
        if not 1 <= half <= head_dim // 2:
            raise ValueError(
                f"rotary_cos is [seqlen_ro, rotary_dim / 2] with rotary_dim = {2 * half}; accepted: "
                f"rotary_dim from 2 to head_dim ({head_dim})"
            )
        if seqlen_ro < 1:
            raise ValueError("rotary_cos/rotary_sin must have at least one row (position)")
        if k is None:
            raise ValueError(
                "rotary_cos/rotary_sin need new keys k and v to append (as in flash-attn: the cache holds "
                "keys already rotated, and the new ones are rotated as they are written)"
            )
    check_alibi_slopes(alibi_slopes, batch, heads_q, device)


def _cache_seqlens(cache_seqlens, batch: int, seq_new: int, capacity: int, device, rotary_limit):
    """``cache_seqlens`` as an int32 [batch] tensor on ``device`` (an int: filled, checked against the
    capacity and the rotary tables (``rotary_limit`` = (seqlen_ro, span) or None) on the host, where it
    already is)."""
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype is not torch.int32:
            raise TypeError(f"cache_seqlens must be int32 (or an int), got {cache_seqlens.dtype}")
        if cache_seqlens.shape != (batch,):
            raise ValueError(f"cache_seqlens must be [batch={batch}], got shape {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {device}")
        return cache_seqlens
    value = positive_int("cache_seqlens", cache_seqlens, allow_zero=True)
    if batch and value + seq_new > capacity:
        _too_small(value + seq_new, capacity)
    if batch and rotary_limit is not None and value + rotary_limit[1] > rotary_limit[0]:
        _rotary_too_short(value + rotary_limit[1], rotary_limit[0])
    return torch.full((batch,), value, dtype=torch.int32, device=device)


def _too_small(longest: int, capacity: int):
    raise ValueError(
        f"cache too small: cache_seqlens + seq_new reaches {longest} tokens, the cache holds {capacity} per "
        "sequence"
    )


def _rotary_too_short(end: int, seqlen_ro: int):
    raise ValueError(
        f"rotary_cos/rotary_sin have {seqlen_ro} rows (positions) but the call rotates positions up to "
        f"{end - 1} (cache_seqlens + seq_new - 1, or cache_seqlens + seq_q - 1 for causal/windowed queries)"
    )


def _first_true(mask: torch.Tensor) -> int:
    return int(mask.nonzero()[0, 0])


def _check_values(cache_seqlens, seq_new: int, capacity: int, k_cache, block_table, cache_batch_idx=None,
                  cache_leftpad=None, rotary_limit=None) -> None:  # fmt: skip
    """The checks that read ``cache_seqlens``, the block table and the optional index tensors (only under
    ``runtime.check_values``): lengths >= 0 and within the capacity (and the rotary tables), block-table
    entries of the pages in use inside the pool, distinct slots for the appended tokens, cache_batch_idx
    entries inside the cache (distinct when appending), leftpads in [0, cache_seqlens]."""
    if cache_seqlens.numel() == 0:
        return
    smallest, largest = torch.stack([cache_seqlens.min(), cache_seqlens.max()]).tolist()
    if smallest < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {smallest}")
    if largest + seq_new > capacity:
        _too_small(largest + seq_new, capacity)
    if rotary_limit is not None and largest + rotary_limit[1] > rotary_limit[0]:
        _rotary_too_short(largest + rotary_limit[1], rotary_limit[0])
    if cache_batch_idx is not None:
        cache_batch = k_cache.shape[0]
        outside = (cache_batch_idx < 0) | (cache_batch_idx >= cache_batch)
        if bool(outside.any()):
            b = _first_true(outside)
            raise ValueError(
                f"cache_batch_idx[{b}] = {int(cache_batch_idx[b])} is not a row of k_cache (0 <= row < "
                f"{cache_batch})"
            )
        if seq_new and cache_batch_idx.unique().numel() != cache_batch_idx.numel():
            raise ValueError("cache_batch_idx names one cache row twice: the new tokens of two sequences "
                             "would go to the same slots")  # fmt: skip
    if cache_leftpad is not None:
        outside = (cache_leftpad < 0) | (cache_leftpad > cache_seqlens)
        if bool(outside.any()):
            b = _first_true(outside)
            raise ValueError(
                f"cache_leftpad[{b}] = {int(cache_leftpad[b])} must be in [0, cache_seqlens[{b}] = "
                f"{int(cache_seqlens[b])}]"
            )
    if block_table is None:
        return
    page_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
    pages_used = (cache_seqlens.long() + seq_new + page_size - 1) // page_size  # [B]
    in_use = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used[:, None]
    bad = in_use & ((block_table < 0) | (block_table >= num_blocks))
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"block_table[{row}, {col}] = {int(block_table[row, col])} is not a page of k_cache "
            f"(0 <= page < {num_blocks})"
        )
    if seq_new:
        pos = cache_seqlens.long()[:, None] + torch.arange(seq_new, device=block_table.device)[None, :]
        slots = block_table.long().gather(1, pos // page_size) * page_size + pos % page_size
        if slots.unique().numel() != slots.numel():
            raise ValueError("block_table maps the new tokens of two sequences to the same cache slot")


# Plain decode calls already checked (no optional input but an fp8 cache's descales, cache_seqlens a tensor,
# the values of index tensors not read: CUDA tensors by default), by what the checks and the plans read: a
# repeated step with the same metadata skips the checks and the op's layers (append, report, outputs and
# attention remain).
_DECODE_CALLS = CallCache()


def _decode_call_key(q, k_cache, v_cache, cache_seqlens, k, v, block_table, is_causal, num_splits,
                     return_lse, k_descale, v_descale) -> tuple:  # fmt: skip
    """The key of :data:`_DECODE_CALLS`: every tensor's metadata, the flags (spelled out: a loop over
    the tensors costs 0.6 us more a call) and the launch policy."""
    key = (
        q.shape, q.stride(), q.dtype, q.device, k_cache.shape, k_cache.stride(), k_cache.dtype,
        k_cache.device, v_cache.shape, v_cache.stride(), v_cache.dtype, v_cache.device, cache_seqlens.shape,
        cache_seqlens.stride(), cache_seqlens.dtype, cache_seqlens.device, is_causal, num_splits, return_lse,
        k is None, block_table is None, current_policy(),
    )  # fmt: skip
    if k is not None:
        key += (k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device)
    if block_table is not None:
        key += (block_table.shape, block_table.stride(), block_table.dtype, block_table.device)
    if k_descale is not None:
        key += (k_descale.shape, k_descale.stride(), k_descale.dtype, k_descale.device, v_descale.shape,
                v_descale.stride(), v_descale.dtype, v_descale.device)  # fmt: skip
    return key


@suggest_keywords
def flash_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = True,
    alibi_slopes: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    **unknown,
):
    """Attention of new queries over a KV cache, dense or paged, appending new keys/values in place.

    Layout and semantics of flash-attn's ``flash_attn_with_kvcache`` (Dao-AILab/flash-attention, 2.x). Key
    positions below are cache positions (0 = the cache's first slot); query i sits at position
    ``p_i = cache_seqlens + seq_new - seq_q + i`` (bottom-right alignment).

    Args:
        q: ``[batch, seq_q, heads_q, head_dim]``; seq_q = 1 for decode, more for chunked prefill or
            speculative decoding. head_dim from 1 to 256.
        k_cache, v_cache: dense ``[cache_batch, seq_cache, heads_kv, head_dim]`` (cache_batch = batch unless
            ``cache_batch_idx`` is given), or with ``block_table`` pages ``[num_blocks, page_size, heads_kv,
            head_dim]`` (page_size a multiple of 16). heads_q a multiple of heads_kv (MHA, GQA, MQA). Last
            dim contiguous; other strides are read as they are.
        cache_seqlens: int32 ``[batch]`` or an int: tokens already in each sequence's cache (left padding
            included).
        k, v: optional ``[batch, seq_new, heads_kv, head_dim]``, written into the caches in place at
            positions ``cache_seqlens .. cache_seqlens + seq_new - 1`` (through the block table if paged). No
            other slot is written. Attention then runs over the keys up to ``cache_seqlens + seq_new``.
            ``cache_seqlens`` itself is not advanced (the caller owns it, as in flash-attn).
        block_table: int32 ``[batch, max_pages]``: physical page of each logical page of each sequence (vLLM's
            and flash-attn's paged layout). Only the entries of pages in use (the first
            ``cdiv(cache_seqlens + seq_new, page_size)``) are read.
        is_causal: query i sees keys up to ``p_i``. Same as ``window=(left, 0)``.
        scale: score scale, default ``1 / sqrt(head_dim)``.
        window: ``(left, right)``: query i sees keys ``p_i - left .. p_i + right``; None on a side leaves
            it unbounded (:func:`llm_speed.attention.reference.visible`).
        softcap: scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma 2, Grok-1).
        num_splits: key-range splits merged by log-sum-exp (Flash-Decoding); 0 chooses from batch x heads_kv,
            the cache capacity (``seq_cache``, or ``max_pages * page_size``) and the SM count; 1 disables
            splitting. At most 128 splits, and one key block of the capacity per split, are used whatever is
            asked. The count depends on shapes only, never on the values of ``cache_seqlens``.
        return_lse: also return the natural-log LSE ``[batch, heads_q, seq_q]`` float32 (of the scaled,
            capped scores with the ALiBi bias).
        cache_batch_idx: int32 ``[batch]``: sequence b reads and appends to dense cache row
            ``cache_batch_idx[b]`` (not with ``block_table``). Rows must be distinct when appending.
        cache_leftpad: int32 ``[batch]``: sequence b's keys start at position ``cache_leftpad[b]`` (keys
            ``cache_leftpad .. cache_seqlens + seq_new - 1``), in ``[0, cache_seqlens]``; positions, masks
            and ALiBi distances are unchanged by it (not with ``block_table``).
        rotary_cos, rotary_sin: ``[seqlen_ro, rotary_dim / 2]`` in q's dtype or float32 (rotary_dim even,
            at most head_dim; needs ``k``/``v``): rotary embedding (RoPE, Su et al., arXiv:2104.09864) of the
            first rotary_dim dims, computed in float32 and rounded to q's dtype. The new keys are rotated as
            they are written, key j at position ``cache_seqlens + j``; the queries as they are loaded, query
            i at ``cache_seqlens + i`` when causal or windowed, else every query at ``cache_seqlens`` (both as
            flash-attn; the cache already holds rotated keys, and ``cache_leftpad`` does not shift these
            positions). Rows up to the largest position used must exist.
        rotary_interleaved: True (flash-attn's default): pairs (0, 1), (2, 3), ... (GPT-J); False: pairs
            (c, c + rotary_dim / 2) (GPT-NeoX, Llama).
        alibi_slopes: float32 ``[heads_q]`` or ``[batch, heads_q]``: ``-slope * |p_i - j|`` is added to the
            score of query i and key j, after the softcap (ALiBi, Press et al., arXiv:2108.12409; flash-attn's
            non-causal form, also used when causal: its causal kernel adds ``slope * j`` instead, which gives
            the same output and an LSE larger by ``slope * p_i``).
        k_descale, v_descale: float32 ``[]`` or ``[1]`` (per tensor), ``[heads_kv]`` (per KV head) or
            ``[batch, heads_kv]`` (per sequence and KV head, FlashAttention-3's layout): required exactly when
            the caches are fp8 (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``, both caches one dtype; q
            and k/v stay float16, bfloat16 or float32). The cache holds ``x / descale``: a key is
            ``k_cache.float() * k_descale``, a value ``v_cache.float() * v_descale``. The attention kernel
            reads the fp8 tiles, widens the keys exactly to q's dtype (to float16 for a bfloat16 q, whose
            rows are scaled by powers of two into float16's range, exactly, the factors folded into the
            scores), folds ``k_descale`` into the score scale (exact algebra), and with a 16-bit q takes the
            values' product in float16 (the values exact, the weights rounded once) and scales its float32
            sum by ``v_descale`` (a float32 q: the values dequantized in float32); no dequantized copy in
            memory. Appended k/v (after rotary, computed in float32) are quantized as they are written:
            ``saturate(x / descale)`` in float32 (IEEE division), rounded to nearest even, saturated to the
            format's largest finite value (448 for e4m3, 57344 for e5m2; infinities too); a NaN stays NaN.
            That is ``(x.float() / descale).clamp(-max, max).to(fp8)`` in PyTorch, bit for bit. The descales
            are read on the device (no host read): with the value checks on they must be finite and > 0.

    Returns ``out`` ``[batch, seq_q, heads_q, head_dim]`` contiguous in q's dtype (and the LSE). A query that
    sees no key (an empty cache, or a causal row before the first key) outputs 0 with LSE -inf.

    Checks. Everything that needs no tensor value is checked before any work, so a refused call leaves the
    caches as they were: shapes, dtypes, devices, flags, ``num_splits``, ``window``, ``softcap``, ``scale``,
    the optional inputs, the descales' presence, dtype, shape and device, and an int ``cache_seqlens`` against
    the capacity and the rotary tables. The checks
    of tensor values (``cache_seqlens`` >= 0, ``cache_seqlens + seq_new`` <= capacity, positions inside the
    rotary tables; block-table entries of pages in use inside ``[0, num_blocks)``; no two appended tokens
    sharing a slot; ``cache_batch_idx`` entries in ``[0, cache_batch)``, distinct when appending;
    ``cache_leftpad`` in ``[0, cache_seqlens]``; descales finite and > 0) read those tensors on the host, so
    they run only where
    :func:`llm_speed.core.runtime.check_values` says (CPU tensors by default; ``LLM_SPEED_CHECK_INPUTS=1``/
    ``0`` forces them on/off). Without them (CUDA by default: no host synchronisation, CUDA-graph
    capturable) the kernels never read or write outside a tensor, and:

    - a sequence with ``cache_seqlens < 0`` or ``cache_seqlens + seq_new > capacity``, a position past the
      rotary tables, a ``cache_leftpad`` outside ``[0, cache_seqlens]`` or a ``cache_batch_idx`` outside
      ``[0, cache_batch)`` reads and writes no cache slot (its new tokens are not appended), and its output
      rows and LSE are NaN;
    - a block-table entry outside ``[0, num_blocks)`` of a page in use is never dereferenced: no new token is
      written to it, the sequence's other appended tokens are, and its output rows and LSE are NaN (also when
      a window keeps every query away from that page);
    - two sequences appending to one slot (the block table or ``cache_batch_idx``) are not detected: the slot
      ends up holding one of the two tokens.

    Forward only (no autograd). Runs the Triton kernels on CUDA tensors, and on CPU tensors under
    ``TRITON_INTERPRET=1``. The kernels read ``cache_batch_idx``, ``cache_leftpad``, the rotary tables and
    the slopes contiguous: one that is not is copied (flash-attn refuses it). Unknown keywords from flash-attn
    (``causal``, ``softmax_scale``, ``window_size``, ``return_softmax_lse``) get a hint naming this
    function's argument; flash-attn's ``softcap=0.0`` and ``window_size=(-1, -1)`` are spelled
    ``softcap=None`` and ``window=None`` here.
    """
    if unknown:
        unknown_keywords(flash_attention_with_kvcache, unknown)
    known = None  # the key of a call that _DECODE_CALLS may serve: a plain decode step (an fp8 cache too)
    if (
        window is None and softcap is None and cache_batch_idx is None and cache_leftpad is None
        and rotary_cos is None and rotary_sin is None and alibi_slopes is None
        and (k_descale is None) == (v_descale is None) and rotary_interleaved is True
        and type(num_splits) is int and num_splits >= 0
        and (is_causal is True or is_causal is False) and (return_lse is True or return_lse is False)
        and (scale is None or type(scale) is float and -math.inf < scale < math.inf)
        and type(cache_seqlens) is torch.Tensor and (k is None) == (v is None)
        and plain_inference(q, k_cache, v_cache, cache_seqlens, k, v, block_table, k_descale, v_descale)
        and not runtime.check_values(q.device)
    ):  # fmt: skip
        known = _decode_call_key(q, k_cache, v_cache, cache_seqlens, k, v, block_table, is_causal, num_splits,
                                 return_lse, k_descale, v_descale)  # fmt: skip
        plans = _DECODE_CALLS.get(known)
        if plans is not None:
            scale = check_scale(None, q) if scale is None else scale
            extra = _NOTHING if k_descale is None else {"K_DESCALE": k_descale, "V_DESCALE": v_descale}
            out, lse = _run(plans, q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, None,
                            0 if is_causal else None, None, extra)  # fmt: skip
            return (out, lse) if return_lse else out
    fp8 = _check_tensors(q, k_cache, v_cache, k, v, block_table)
    is_causal = check_flag("is_causal", is_causal)
    return_lse = check_flag("return_lse", return_lse)
    if rotary_interleaved is not True:
        rotary_interleaved = check_flag("rotary_interleaved", rotary_interleaved)
    num_splits = positive_int("num_splits", num_splits, allow_zero=True)
    left, right = check_window(window) if window is not None else (None, None)
    if softcap is not None:
        softcap = check_softcap(softcap)
    if scale is not None:
        scale = check_real("scale", scale)
    optional = not (cache_batch_idx is None and cache_leftpad is None and rotary_cos is None
                    and rotary_sin is None and alibi_slopes is None)  # fmt: skip
    if optional:
        _check_options(q, k, block_table, cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
                       alibi_slopes)  # fmt: skip
    capacity = _check_shapes(q, k_cache, v_cache, k, v, block_table, cache_batch_idx is not None)
    if fp8 or k_descale is not None or v_descale is not None:
        _check_descales(q, k_cache, k_descale, v_descale, fp8)
    seq_new = 0 if k is None else k.shape[1]
    if scale is None:
        scale = check_scale(None, q)
    if is_causal:
        right = 0
    rotary_limit = None
    if rotary_cos is not None:
        span = rotary_span(seq_new, q.shape[1], left is not None or right is not None)
        rotary_limit = (rotary_cos.shape[0], span)
    cache_seqlens = _cache_seqlens(cache_seqlens, q.shape[0], seq_new, capacity, q.device, rotary_limit)
    if runtime.check_values(q.device):
        _check_values(cache_seqlens, seq_new, capacity, k_cache, block_table, cache_batch_idx, cache_leftpad,
                      rotary_limit)  # fmt: skip
        if fp8:
            check_descale_values(("k_descale", k_descale), ("v_descale", v_descale))
    given = q, k, v  # (the calls already checked keep only steps that copy none of them)
    if q.stride()[3] != 1:  # the kernels read the last dim with unit stride
        q = tensors.last_dim_contiguous(q)
    if k is not None and (k.stride()[3] != 1 or v.stride()[3] != 1):
        k, v = tensors.last_dim_contiguous(k), tensors.last_dim_contiguous(v)
    if optional:  # the kernels read these contiguous (flash-attn requires it): a small copy if not
        if cache_batch_idx is not None and not cache_batch_idx.is_contiguous():
            cache_batch_idx = cache_batch_idx.contiguous()
        if cache_leftpad is not None and not cache_leftpad.is_contiguous():
            cache_leftpad = cache_leftpad.contiguous()
        if rotary_cos is not None and not (rotary_cos.is_contiguous() and rotary_sin.is_contiguous()):
            rotary_cos, rotary_sin = rotary_cos.contiguous(), rotary_sin.contiguous()
        if alibi_slopes is not None and not alibi_slopes.is_contiguous():
            alibi_slopes = alibi_slopes.contiguous()
    if known is not None and given[0] is q and given[1] is k and given[2] is v and runtime.triton_runs_on(
        q.device
    ):  # a plain inference step, nothing copied: what the op would run, kept for the next such call (with
        # the LSE's stores compiled out unless it is asked for)
        plan_args = _plan_args(q, k_cache, v_cache, cache_seqlens, k, v, block_table, left, right, False,
                               num_splits)  # fmt: skip
        extra, optional_keys = _cache_inputs(k_cache, k_descale, v_descale)
        plans = _plans(*plan_args, *optional_keys, lse=return_lse, policy=current_policy())
        _DECODE_CALLS.put(known, plans)
        out, lse = _run(plans, q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, left, right,
                        None, extra)  # fmt: skip
    elif optional or fp8:
        out, lse = _kvcache_call(
            q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, left, right, softcap, num_splits,
            cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes,
            k_descale, v_descale,
        )  # fmt: skip
    else:
        out, lse = _kvcache_call(
            q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, left, right, softcap, num_splits
        )
    return (out, lse) if return_lse else out
