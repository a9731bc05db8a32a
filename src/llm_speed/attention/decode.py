"""Attention over a KV cache, dense or paged, with split-KV ("flash-decoding"): kernels, launcher and op.

The public function follows flash-attn's ``flash_attn_with_kvcache`` (Dao-AILab/flash-attention,
``flash_attn/flash_attn_interface.py``): q ``[batch, seq_q, heads_q, D]``; a dense cache
``[batch, seq_cache, heads_kv, D]`` or a paged one ``[num_blocks, page_size, heads_kv, D]`` addressed through
``block_table [batch, max_pages]`` (vLLM's PagedAttention layout, Kwon et al., SOSP 2023, arXiv:2309.06180);
new keys/values appended in place at ``cache_seqlens``. Split-KV follows Flash-Decoding (Dao, Haziza, Massa,
Sizov, 2023, https://crfm.stanford.edu/2023/10/12/flashdecoding.html): when batch x heads_kv programs cannot
fill the GPU, each sequence's keys are cut into ``num_splits`` ranges whose partial results are merged by
their log-sum-exp.

Kernel layout. One program per (query-row block, split, batch * kv head), on a 1-D grid. The rows of a
program are the ``group = heads_q / heads_kv`` query heads that share its KV head times the ``seq_q`` query
positions, row ``r`` being position ``r // group`` of head ``r % group``: with GQA a decode step reads each
K/V tile once for the whole group, and the rows fill the M dimension of ``tl.dot`` (>= 16). Key rows are
gathered one by one through the block table when paged, so any ``page_size`` works with any key block.
Naming as in ``kernels.py``: ``p_`` pointers, ``b_`` blocks, ``o_`` offsets, ``m_`` masks; BM rows, BN keys,
BD padded head_dim. Scores are in base 2 (``exp2``); the LSE in HBM is in natural-log units.

Constexpr switches:
  PAGED                    keys are gathered through BLOCK_TABLE; else the cache is [batch, seq_cache, ...]
  HAS_LEFT / HAS_RIGHT     window bounds (causal is HAS_RIGHT with right = 0)
  HAS_SOFTCAP              scores become softcap * tanh(scores / softcap)
  SPLIT                    write fp32 partial (out, lse) per split for the combine kernel; else the result
  DOT_IN_FP32, DOT_PRECISION, RNE_BY_HAND   as in kernels.py / core/kernel_math.py
"""

from __future__ import annotations

import math
import numbers

import torch
import triton
import triton.language as tl

from ..core import runtime, tensors
from ..core.args import check_flag
from ..core.hardware import hardware_of
from ..core.kernel_math import cast, rne_by_hand
from .kernels import _dot
from .validation import HEAD_DIM_MULTIPLE, MAX_HEAD_DIM, SUPPORTED_DTYPES, check_softcap, check_window

KERNEL_DECODE = "kvcache_attention_fwd"
KERNEL_COMBINE = "kvcache_attention_combine"

LN2: tl.constexpr = tl.constexpr(math.log(2.0))
LOG2E: tl.constexpr = tl.constexpr(math.log2(math.e))
PAGE_MULTIPLE = 16  # page_size must be a multiple of this (flash-attn asks 256, vLLM 16)
MAX_SPLITS = 128  # as flash-attn's split heuristic
MIN_DOT_DIM = 16


@triton.jit
def _tanh(x):
    """tanh in float32 without libdevice (the interpreter has none): Lambert's continued fraction
    x / (1 + x^2 / (3 + x^2 / (5 + ...))) where |x| < 1 (no cancellation near 0), else 1 - 2 / (e^2x + 1)."""
    x_small = tl.minimum(tl.maximum(x, -1.0), 1.0)
    x2 = x_small * x_small
    b_d = x2 * 0.0 + 19.0
    for i in tl.static_range(9):
        b_d = (17.0 - 2.0 * i) + x2 / b_d
    small = x_small / b_d
    large = 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)
    return tl.where(tl.abs(x) < 1.0, small, large)


@triton.jit
def _cache_rows(BLOCK_TABLE, stride_bt, i_b, o_n, m_n, page_size, PAGED: tl.constexpr):
    """(page, slot) of key positions ``o_n`` of sequence ``i_b``, as int64 [BN]: through the block table
    when paged, else (i_b, o_n). Positions outside ``m_n`` do not read the table."""
    if PAGED:
        b_page = tl.load(BLOCK_TABLE + i_b * stride_bt + o_n // page_size, mask=m_n, other=0).to(tl.int64)
        return b_page, (o_n % page_size).to(tl.int64)
    else:
        return tl.zeros_like(o_n).to(tl.int64) + i_b, o_n.to(tl.int64)


@triton.jit
def _kvcache_fwd_kernel(
    Q, K_CACHE, V_CACHE, CACHE_SEQLENS, BLOCK_TABLE, OUT, LSE,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_o_split, stride_ob, stride_os, stride_oh,
    stride_l_split, stride_lb, stride_lh,
    stride_bt,
    seq_q, seq_new, heads_kv, group, head_dim, page_size, split_len, num_splits, n_row_blocks,
    qk_scale_log2, softcap, window_left, window_right,
    PAGED: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    i_m = pid % n_row_blocks
    i_split = (pid // n_row_blocks) % num_splits
    i_bh = pid // (n_row_blocks * num_splits)
    i_b = i_bh // heads_kv
    i_hkv = i_bh % heads_kv

    seqlen_k = tl.load(CACHE_SEQLENS + i_b) + seq_new  # keys visible to this sequence
    shift = seqlen_k - seq_q  # query i sits at key position i + shift (bottom-right alignment)
    n_rows = seq_q * group
    o_r = i_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    m_r = o_r < n_rows
    o_i = o_r // group  # query position of each row
    o_h = i_hkv * group + o_r % group  # query head of each row
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < head_dim

    # Keys any row of this block may see, intersected with this program's split.
    first_i = (i_m * BLOCK_M) // group
    last_i = tl.minimum((i_m * BLOCK_M + BLOCK_M - 1) // group, seq_q - 1)
    lo = i_split * split_len
    hi = tl.minimum(lo + split_len, seqlen_k)
    if HAS_RIGHT:
        hi = tl.minimum(hi, last_i + shift + window_right + 1)
    if HAS_LEFT:
        lo = tl.maximum(lo, first_i + shift - window_left)
    lo = (lo // BLOCK_N) * BLOCK_N  # split_len is a multiple of BLOCK_N: still inside this split

    p_q = Q + i_b.to(tl.int64) * stride_qb + o_i[:, None].to(tl.int64) * stride_qs + o_h[:, None] * stride_qh
    m_q = m_r[:, None] & m_d[None, :]
    b_q = tl.load(p_q + o_d[None, :], mask=m_q, other=0.0)  # [BM, BD]

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    o_pos = o_i + shift  # [BM]
    for start_n in range(lo, hi, BLOCK_N):
        o_n = start_n + tl.arange(0, BLOCK_N)  # [BN]
        m_n = o_n < seqlen_k  # slots past the valid tokens are never read: they may hold anything
        b_page, o_slot = _cache_rows(BLOCK_TABLE, stride_bt, i_b, o_n, m_n, page_size, PAGED)
        m_kv = m_n[:, None] & m_d[None, :]
        p_k = K_CACHE + i_hkv * stride_kh + (b_page * stride_kb + o_slot * stride_ks)[:, None] + o_d[None, :]
        b_k = tl.load(p_k, mask=m_kv, other=0.0)  # [BN, BD]
        b_s = _dot(b_q, tl.trans(b_k), DOT_IN_FP32, DOT_PRECISION)  # [BM, BN] q.k, unscaled
        if HAS_SOFTCAP:
            b_s = softcap * _tanh(b_s * (qk_scale_log2 / LOG2E / softcap)) * LOG2E
        else:
            b_s = b_s * qk_scale_log2
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
        if V_CACHE.dtype.element_ty != tl.float32:
            b_p = cast(b_p, V_CACHE.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
        p_v = V_CACHE + i_hkv * stride_vh + (b_page * stride_vb + o_slot * stride_vs)[:, None] + o_d[None, :]
        b_v = tl.load(p_v, mask=m_kv, other=0.0)  # [BN, BD]
        b_acc = b_acc * b_alpha[:, None] + _dot(b_p, b_v, DOT_IN_FP32, DOT_PRECISION)
        b_m = b_m_new

    no_key = b_l == 0.0
    b_out = b_acc / tl.where(no_key, 1.0, b_l)[:, None]
    b_lse = tl.where(no_key, float("-inf"), (b_m + tl.log2(tl.where(no_key, 1.0, b_l))) * LN2)
    p_out = (
        OUT + i_split.to(tl.int64) * stride_o_split + i_b.to(tl.int64) * stride_ob
        + o_i[:, None].to(tl.int64) * stride_os + o_h[:, None] * stride_oh + o_d[None, :]
    )  # fmt: skip
    if SPLIT:
        tl.store(p_out, b_out, mask=m_q)
    else:
        tl.store(p_out, cast(b_out, OUT.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m_q)
    p_lse = LSE + i_split.to(tl.int64) * stride_l_split + i_b.to(tl.int64) * stride_lb + o_h * stride_lh + o_i
    tl.store(p_lse, b_lse, mask=m_r)


@triton.jit
def _kvcache_combine_kernel(
    OUT_PART, LSE_PART, OUT, LSE,
    stride_o_split, stride_l_split, seq_q, heads_q, num_splits, head_dim,
    RNE_BY_HAND: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """Merge one query row's split results: out = sum_s w_s out_s / sum_s w_s, w_s = exp(lse_s - max_s lse_s).

    Partials are contiguous ``[splits, batch, seq_q, heads_q, D]`` and ``[splits, batch, heads_q, seq_q]``,
    the results ``[batch, seq_q, heads_q, D]`` and ``[batch, heads_q, seq_q]``; one program per (b, i, h).
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
    b_lse = tl.load(LSE_PART + o_s * stride_l_split + i_lse, mask=m_s, other=float("-inf"))  # [BS]
    b_max = tl.max(b_lse, 0)
    b_max = tl.where(b_max == float("-inf"), 0.0, b_max)
    b_w = tl.exp2((b_lse - b_max) * LOG2E)  # a split that saw no key weighs 0
    b_sum = tl.sum(b_w, 0)
    no_key = b_sum == 0.0
    p_o = OUT_PART + o_s[:, None].to(tl.int64) * stride_o_split + i_row * head_dim + o_d[None, :]
    b_o = tl.load(p_o, mask=m_s[:, None] & m_d[None, :], other=0.0)  # [BS, BD]
    b_out = tl.sum(b_o * b_w[:, None], 0) / tl.where(no_key, 1.0, b_sum)  # [BD]
    b_out = cast(b_out, OUT.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    tl.store(OUT + i_row * head_dim + o_d, b_out, mask=m_d)
    tl.store(LSE + i_lse, tl.where(no_key, float("-inf"), b_max + tl.log(tl.where(no_key, 1.0, b_sum))))


# ---------------------------------------------------------------------------------------------------------
# Launcher


def block_config(head_dim: int, dtype: torch.dtype, rows: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps) for ``rows`` = group * seq_q query rows per KV head.

    Decode reads each K/V tile once per program and is bound by memory: key blocks of 64 rows (32 at
    head_dim 256) keep the loads wide; query tiles of at most 32 rows (16 at head_dim 256 or in float32)
    keep the fp32 accumulator and both tiles in registers. BM is at least 16, the smallest ``tl.dot`` tile.
    Compiled for sm_90 (Triton 3.9, every switch on) they need at most 84 KB of shared memory and spill at
    most about 1 KB per thread (16-bit, head_dim 128, paged and split); most variants spill nothing.
    """
    block_d = max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    block_n = 32 if block_d > 128 else 64
    cap_m = 16 if block_d > 128 or dtype == torch.float32 else 32
    block_m = min(cap_m, max(MIN_DOT_DIM, triton.next_power_of_2(max(rows, 1))))
    return block_m, block_n, block_d, 4 if block_d <= 128 else 8


def choose_num_splits(programs: int, key_blocks: int, sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Split count for ``programs`` (batch x heads_kv x row blocks) over ``key_blocks`` key blocks.

    flash-attn's ``num_splits_heuristic`` (Dao-AILab/flash-attention, ``csrc/flash_attn/flash_api.cpp``): no
    split when the programs nearly fill the SMs (>= 80%); otherwise the smallest split count whose wave
    efficiency (programs x splits / SMs over its ceiling) is within 85% of the best, skipping counts that
    give the same blocks per split as the one below.
    """
    if programs >= 0.8 * sms or key_blocks <= 1:
        return 1
    limit = min(max_splits, sms, key_blocks)

    def eligible(s: int) -> bool:
        return s == 1 or triton.cdiv(key_blocks, s) != triton.cdiv(key_blocks, s - 1)

    def efficiency(s: int) -> float:
        waves = programs * s / sms
        return waves / math.ceil(waves)

    candidates = [s for s in range(1, limit + 1) if eligible(s)]
    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.85 * best)


def append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table) -> None:
    """Write k, v ``[batch, seq_new, heads_kv, D]`` at positions cache_seqlens.. of each sequence, through the
    block table when paged. Only those slots are written."""
    batch, seq_new = k.shape[:2]
    pos = cache_seqlens.long()[:, None] + torch.arange(seq_new, device=k.device)[None, :]  # [B, S_new]
    if block_table is None:
        rows, slots = torch.arange(batch, device=k.device)[:, None].expand_as(pos), pos
    else:
        page_size = k_cache.shape[1]
        rows, slots = block_table.long().gather(1, pos // page_size), pos % page_size
    k_cache[rows, slots] = k
    v_cache[rows, slots] = v


def forward(q, k_cache, v_cache, cache_seqlens, block_table, seq_new: int, max_seqlen_k: int, scale: float,
            window_left, window_right, softcap, num_splits: int):  # fmt: skip
    """Launch the attention kernel (and the combine kernel when split). Returns (out, lse)."""
    batch, seq_q, heads_q, head_dim = q.shape
    heads_kv = k_cache.shape[2]
    group = heads_q // heads_kv
    block_m, block_n, block_d, num_warps = block_config(head_dim, q.dtype, group * seq_q)
    n_row_blocks = triton.cdiv(group * seq_q, block_m)
    key_blocks = triton.cdiv(max_seqlen_k, block_n)
    if num_splits == 0:
        programs = batch * heads_kv * n_row_blocks
        num_splits = choose_num_splits(programs, key_blocks, hardware_of(q.device).sm_count)
    # At most MAX_SPLITS (the combine kernel holds every split of a row at once) and one key block per split.
    blocks_per_split = triton.cdiv(max(key_blocks, 1), max(1, min(num_splits, MAX_SPLITS, key_blocks)))
    num_splits = max(1, triton.cdiv(key_blocks, blocks_per_split))  # no split left without keys
    split = num_splits > 1
    out = tensors.new_output((batch, seq_q, heads_q, head_dim), q.dtype, q.device)
    lse = tensors.new_output((batch, heads_q, seq_q), torch.float32, q.device)
    if split:
        out_k = tensors.new_output((num_splits, batch, seq_q, heads_q, head_dim), torch.float32, q.device)
        lse_k = tensors.new_output((num_splits, batch, heads_q, seq_q), torch.float32, q.device)
        o_split, l_split = out_k.stride(0), lse_k.stride(0)
    else:
        out_k, lse_k, o_split, l_split = out, lse, 0, 0
    paged = block_table is not None
    runtime.report_work(
        "attention_kvcache_fwd", q=q, k_cache=k_cache, cache_seqlens=cache_seqlens, seq_new=seq_new,
        block_table=block_table, window=(window_left, window_right),
    )  # fmt: skip
    _kvcache_fwd_kernel[(n_row_blocks * num_splits * batch * heads_kv,)](
        Q=q, K_CACHE=k_cache, V_CACHE=v_cache, CACHE_SEQLENS=cache_seqlens,
        BLOCK_TABLE=block_table if paged else cache_seqlens, OUT=out_k, LSE=lse_k,
        stride_qb=q.stride(0), stride_qs=q.stride(1), stride_qh=q.stride(2),
        stride_kb=k_cache.stride(0), stride_ks=k_cache.stride(1), stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0), stride_vs=v_cache.stride(1), stride_vh=v_cache.stride(2),
        stride_o_split=o_split,
        stride_ob=out_k.stride(-4), stride_os=out_k.stride(-3), stride_oh=out_k.stride(-2),
        stride_l_split=l_split, stride_lb=lse_k.stride(-3), stride_lh=lse_k.stride(-2),
        stride_bt=block_table.stride(0) if paged else 0,
        seq_q=seq_q, seq_new=seq_new, heads_kv=heads_kv, group=group, head_dim=head_dim,
        page_size=k_cache.shape[1], split_len=blocks_per_split * block_n, num_splits=num_splits,
        n_row_blocks=n_row_blocks, qk_scale_log2=scale * math.log2(math.e),
        softcap=softcap if softcap is not None else 0.0,
        window_left=window_left if window_left is not None else 0,
        window_right=window_right if window_right is not None else 0,
        PAGED=paged, HAS_LEFT=window_left is not None, HAS_RIGHT=window_right is not None,
        HAS_SOFTCAP=softcap is not None, SPLIT=split,
        # The interpreter's tl.dot is wrong on bfloat16: widen the (bf16-rounded) tiles there only.
        DOT_IN_FP32=runtime.INTERPRETED and q.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        RNE_BY_HAND=rne_by_hand(q.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    runtime.record_launch(KERNEL_DECODE)
    if split:
        _kvcache_combine_kernel[(batch * seq_q * heads_q,)](
            OUT_PART=out_k, LSE_PART=lse_k, OUT=out, LSE=lse,
            stride_o_split=o_split, stride_l_split=l_split, seq_q=seq_q, heads_q=heads_q,
            num_splits=num_splits, head_dim=head_dim,
            RNE_BY_HAND=rne_by_hand(q.dtype), BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        )  # fmt: skip
        runtime.record_launch(KERNEL_COMBINE)
    return out, lse


# ---------------------------------------------------------------------------------------------------------
# Operator


def forward_impl(q, k_cache, v_cache, cache_seqlens, max_cache_seqlen, k, v, block_table, scale, window_left,
                 window_right, softcap, num_splits):  # fmt: skip
    """Append k/v (if given), then attend; on whatever runs on q's device. Returns (out, lse)."""
    seq_new = 0
    if k is not None:
        seq_new = k.shape[1]
        if k.numel():
            append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table)
    batch, seq_q, heads_q, head_dim = q.shape
    if batch == 0 or seq_q == 0:
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return out, torch.full((batch, heads_q, seq_q), float("-inf"), dtype=torch.float32, device=q.device)
    if not runtime.triton_runs_on(q.device):
        raise runtime.TritonUnavailable(
            "flash_attention_with_kvcache runs Triton kernels only: use CUDA tensors, or CPU tensors with "
            "TRITON_INTERPRET=1 set before importing llm_speed"
        )
    max_seqlen_k = max_cache_seqlen + seq_new
    with runtime.on_device_of(q):
        return forward(
            q, k_cache, v_cache, cache_seqlens, block_table, seq_new, max_seqlen_k, scale,
            window_left, window_right, softcap, num_splits,
        )  # fmt: skip


@torch.library.custom_op("llm_speed::flash_attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def _kvcache_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    max_cache_seqlen: int,
    k: torch.Tensor | None,
    v: torch.Tensor | None,
    block_table: torch.Tensor | None,
    scale: float,
    window_left: int | None,
    window_right: int | None,
    softcap: float | None,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_impl(
        q, k_cache, v_cache, cache_seqlens, max_cache_seqlen, k, v, block_table, scale, window_left,
        window_right, softcap, num_splits,
    )  # fmt: skip


@_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, max_cache_seqlen, k, v, block_table, scale, window_left,
                  window_right, softcap, num_splits):  # fmt: skip
    batch, seq_q, heads_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, heads_q, seq_q), dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------
# Input checks (all before any write: a refused call leaves the cache as it was)


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def _check_tensors(q, k_cache, v_cache, k, v, block_table) -> None:
    named = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "k": k, "v": v, "block_table": block_table}
    for name, t in named.items():
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if (k is None) != (v is None):
        raise ValueError("k and v must be given together (new tokens to append) or both be None")
    for name in ("q", "k_cache", "v_cache", "k", "v"):
        t = named[name]
        if t is not None and t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims, got shape {tuple(t.shape)}")
        if t is not None and t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; accepted: float16, bfloat16, float32")
        if t is not None and t.dtype != q.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from q's {q.dtype}: all must share one dtype")
    for name, t in named.items():
        if t is not None and t.device != q.device:
            raise ValueError(
                f"{name} is on {t.device} but q is on {q.device}: all tensors must share a device"
            )


def _check_shapes(q, k_cache, v_cache, k, v, block_table) -> int:
    """Shape rules; returns the cache capacity per sequence (tokens)."""
    batch, _, heads_q, head_dim = q.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must have one shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    heads_kv = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache/v_cache head_dim ({k_cache.shape[3]}) must equal q head_dim ({head_dim})")
    if head_dim % HEAD_DIM_MULTIPLE or not HEAD_DIM_MULTIPLE <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"q head_dim is {head_dim}; accepted: a multiple of {HEAD_DIM_MULTIPLE} from {HEAD_DIM_MULTIPLE} "
            f"to {MAX_HEAD_DIM}"
        )
    if heads_q < 1 or heads_kv < 1 or heads_q % heads_kv:
        raise ValueError(f"q heads ({heads_q}) must be a positive multiple of k_cache heads ({heads_kv})")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must have a contiguous last dim (it is written in place, not copied)")
    if k is not None:
        seq_new = k.shape[1]
        expected = (batch, seq_new, heads_kv, head_dim)
        for name, t in (("k", k), ("v", v)):
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"{name} must be [batch, seq_new, heads_kv, head_dim] = {expected}, got {tuple(t.shape)}"
                )
    if block_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(
                f"k_cache batch ({k_cache.shape[0]}) must equal q batch ({batch}) without a block_table"
            )
        return k_cache.shape[1]
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be int32, got {block_table.dtype}")
    if block_table.dim() != 2 or block_table.shape[0] != batch:
        raise ValueError(
            f"block_table must be [batch={batch}, max_pages], got shape {tuple(block_table.shape)}"
        )
    page_size = k_cache.shape[1]
    if page_size < 1 or page_size % PAGE_MULTIPLE:
        raise ValueError(
            f"page_size (k_cache dim 1) must be a positive multiple of {PAGE_MULTIPLE}, got {page_size}"
        )
    return block_table.shape[1] * page_size


def _check_cache_seqlens(cache_seqlens, batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(cache_seqlens as a contiguous int32 [batch] tensor, its maximum); one host read of its extremes."""
    if isinstance(cache_seqlens, torch.Tensor):
        if cache_seqlens.dtype != torch.int32:
            raise TypeError(f"cache_seqlens must be int32 (or an int), got {cache_seqlens.dtype}")
        if tuple(cache_seqlens.shape) != (batch,):
            raise ValueError(f"cache_seqlens must be [batch={batch}], got shape {tuple(cache_seqlens.shape)}")
        if cache_seqlens.device != device:
            raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {device}")
        if batch == 0:
            return cache_seqlens.contiguous(), 0
        smallest, largest = torch.stack([cache_seqlens.min(), cache_seqlens.max()]).tolist()
        if smallest < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {smallest}")
        return cache_seqlens.contiguous(), largest
    value = _check_int("cache_seqlens", cache_seqlens, 0)
    return torch.full((batch,), value, dtype=torch.int32, device=device), value


def _check_cache_ranges(
    cache_seqlens, longest: int, seq_new: int, capacity: int, k_cache, block_table
) -> None:
    """Capacity (``longest`` = max cache_seqlens + seq_new), the block table entries in use, and distinct
    slots for the appended tokens."""
    if cache_seqlens.numel() == 0:
        return
    if longest > capacity:
        raise ValueError(
            f"cache too small: cache_seqlens + seq_new reaches {longest} tokens, the cache holds {capacity} "
            "per sequence"
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


# ---------------------------------------------------------------------------------------------------------
# Public function


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
):
    """Attention of new queries over a KV cache, dense or paged, appending new keys/values in place.

    Layout and semantics of flash-attn's ``flash_attn_with_kvcache`` (Dao-AILab/flash-attention):

    Args:
        q: ``[batch, seq_q, heads_q, head_dim]``; seq_q = 1 for decode, more for chunked prefill or
            speculative decoding.
        k_cache, v_cache: dense ``[batch, seq_cache, heads_kv, head_dim]``, or with ``block_table`` pages
            ``[num_blocks, page_size, heads_kv, head_dim]`` (page_size a multiple of 16). heads_q a multiple
            of heads_kv (MHA, GQA, MQA). Last dim contiguous; other strides are read as they are.
        cache_seqlens: int32 ``[batch]`` or an int: tokens already valid in each sequence's cache.
        k, v: optional ``[batch, seq_new, heads_kv, head_dim]``, written into the caches in place at
            positions ``cache_seqlens .. cache_seqlens + seq_new - 1`` (through the block table if paged). No
            other slot is written. Attention then runs over ``cache_seqlens + seq_new`` keys.
            ``cache_seqlens`` itself is not advanced (the caller owns it, as in flash-attn).
        block_table: int32 ``[batch, max_pages]``: physical page of each logical page of each sequence (vLLM's
            and flash-attn's paged layout). Only the entries of pages in use are read and checked.
        is_causal: bottom-right aligned per sequence: query i (at key position i + seqlen_k - seq_q) sees keys
            up to its own position. Same as ``window=(left, 0)``.
        scale: score scale, default ``1 / sqrt(head_dim)``.
        window: ``(left, right)`` local attention as in :func:`llm_speed.attention.reference.visible`.
        softcap: scores become ``softcap * tanh(scores / softcap)`` before masking (Gemma 2, Grok-1).
        num_splits: key-range splits merged by log-sum-exp (Flash-Decoding); 0 chooses from batch x heads_kv,
            the context length and the SM count; 1 disables splitting. At most 128 splits, and one key
            block per split, are used whatever is asked.
        return_lse: also return the natural-log LSE ``[batch, heads_q, seq_q]`` float32.

    Returns ``out`` ``[batch, seq_q, heads_q, head_dim]`` contiguous in q's dtype (and the LSE). A query that
    sees no key (an empty cache, or a causal row before the first key) outputs 0 with LSE -inf.

    Every argument is checked before the cache is touched, so a refused call changes nothing; the checks read
    ``cache_seqlens`` on the host (one synchronisation; up to two more when paged, for the block table).
    Forward only (no autograd). Runs the Triton kernels on CUDA tensors, and on CPU tensors under
    ``TRITON_INTERPRET=1``.
    """
    _check_tensors(q, k_cache, v_cache, k, v, block_table)
    is_causal = check_flag("is_causal", is_causal)
    return_lse = check_flag("return_lse", return_lse)
    num_splits = _check_int("num_splits", num_splits, 0)
    window = check_window(window)
    softcap = check_softcap(softcap)
    scale = _check_scale(scale, q.shape[-1])
    capacity = _check_shapes(q, k_cache, v_cache, k, v, block_table)
    cache_seqlens, max_cache_seqlen = _check_cache_seqlens(cache_seqlens, q.shape[0], q.device)
    seq_new = k.shape[1] if k is not None else 0
    _check_cache_ranges(cache_seqlens, max_cache_seqlen + seq_new, seq_new, capacity, k_cache, block_table)

    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0
    if q.stride(-1) != 1 and q.shape[-1] > 1:
        q = q.contiguous()
    if block_table is not None:
        block_table = block_table.contiguous()
    out, lse = _kvcache_op(
        q,
        k_cache,
        v_cache,
        cache_seqlens,
        max_cache_seqlen,
        k,
        v,
        block_table,
        scale,
        left,
        right,
        softcap,
        num_splits,
    )
    return (out, lse) if return_lse else out
