"""The KV-cache decode's configuration (tiles, split counts, where the new tokens are written) and launch
(the plans of a step and the step itself: append, attend, combine)."""

from __future__ import annotations

import functools
import math

import torch

from ..core import runtime, tensors
from ..core.config import KernelConfig
from ..core.hardware import Hardware, hardware_of
from ..core.kernel_math import dot_switches, rne_by_hand
from ..core.launch import cdiv, next_power_of_2, plan_cache
from ..core.policy import LaunchPolicy, current_policy
from ..core.tile_choice import SMALLEST_TILE_SIDE as MIN_DOT_DIM
from ..matmul.fp8 import fp8_constants
from . import reference
from .blocks import MAX_TABLE_BLOCK
from .decode_kernels import APPEND, COMBINE, FORWARD
from .options import MaskKey, ScoreMods, from_op

MAX_SPLITS = 128  # as flash-attn's split heuristic
# Programs of 4 warps per SM that the split count fills: flash-attn counts two per SM for its 128-thread
# kernel. Ours holds 2-3 per SM on sm_90a at head_dim 128 (156-179 registers); on 2026-11-25 (H100) the
# step at batch 8 x 16k with one program per SM read 2.27 TB/s, at batch 32 x 16k with two 3.06 TB/s.
PROGRAMS_PER_SM = 2


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
def step_plans(
    q_shape: tuple, q_strides: tuple, cache_shape: tuple, k_strides: tuple, v_strides: tuple,
    table_shape: tuple | None, table_strides: tuple | None, seqlens_stride: int, seq_new: int,
    new_strides: tuple | None, dtype: torch.dtype, mask: MaskKey, num_splits: int, device: torch.device,
    batch_idx: bool = False, leftpad: bool = False,
    rotary: tuple | None = None, alibi_batch_stride: int | None = None, fp8: tuple | None = None, *,
    lse: bool, policy: LaunchPolicy,
) -> tuple:
    """(append plan or None, attention plan or None, combine plan or None, shape of out, shape of the LSE or
    None when ``lse`` is False (not asked for: its stores are compiled out), elements of the float32
    workspace of the split partials or 0 (no split)) of one problem class; shapes are plain tuples (cheaper
    to allocate from than a torch.Size); every caller spells ``lse``, so that a class's plans have one key
    however they are asked for. ``new_strides`` = (k's strides, v's strides) when there are new tokens;
    ``mask``: the call's :attr:`ScoreMods.key` (the window and the cap; causal already a right bound of 0).
    The optional inputs (contiguous):
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
    per_row = mask.has_left or mask.has_right
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
        window_left=mask.left if mask.left is not None else 0, window_right=mask.right_bound,
        PAGED=paged, HAS_LEFT=mask.has_left, HAS_RIGHT=mask.has_right, HAS_SOFTCAP=mask.capped, SPLIT=split,
        **switches, **optional, **fp8_switches,
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
_F32 = torch.float32
_MINUS_INF = float("-inf")


NO_INPUTS: dict = {}  # no optional input (never written)


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


def cache_inputs(k_cache, k_descale, v_descale) -> tuple[dict, tuple]:
    """:func:`_optional_inputs` of a call with no optional input but an fp8 cache's descales (or none: a
    16-bit cache), without its work."""
    if k_descale is None:
        return NO_INPUTS, ()
    fp8 = (k_cache.dtype, descale_strides(k_descale), descale_strides(v_descale))
    return {"K_DESCALE": k_descale, "V_DESCALE": v_descale}, (False, False, None, None, fp8)


def step_plan_args(q, k_cache, v_cache, cache_seqlens, k, v, block_table, mods: ScoreMods,
                   num_splits: int) -> tuple:  # fmt: skip
    """:func:`step_plans`'s arguments but the optional inputs'."""
    seq_new = 0 if k is None else k.shape[1]
    paged = block_table is not None
    return (
        q.shape, q.stride(), k_cache.shape, k_cache.stride(), v_cache.stride(),
        block_table.shape if paged else None, block_table.stride() if paged else None,
        cache_seqlens.stride(0), seq_new, (k.stride(), v.stride()) if seq_new else None, q.dtype,
        mods.key, num_splits, q.device,
    )  # fmt: skip


def forward(q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale: float, window_left, window_right,
            softcap, num_splits: int, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
            rotary_sin=None, rotary_interleaved: bool = True, alibi_slopes=None, k_descale=None,
            v_descale=None):  # fmt: skip
    """Append k/v (if given; k rotated when rotary_cos/sin are; quantized with the descales into an fp8
    cache) into the caches, then attend; returns (out, lse). Arguments as checked by
    :func:`flash_attention_with_kvcache` (q, k, v with a contiguous last dim; cache_batch_idx,
    cache_leftpad, the rotary tables and the slopes contiguous; ``cache_seqlens`` an int32 tensor; the
    descales given exactly when the caches are fp8; a causal mask as ``window_right`` 0). The Triton path
    reads no tensor value on the host (where Triton cannot run, the float32 reference reads the CPU index
    tensors); reports its work once per call. The op's implementation: its window, cap and slopes made one
    :class:`ScoreMods`."""
    q_shape = q.shape
    device = q.device
    seq_new = 0 if k is None else k.shape[1]
    if not runtime.triton_runs_on(device):  # the float32 PyTorch reference, appending in place
        if q_shape[0] and q_shape[1]:
            runtime.report_work("attention_kvcache_fwd", q=q, k_cache=k_cache, cache_seqlens=cache_seqlens,
                                seq_new=seq_new, block_table=block_table, window=(window_left, window_right),
                                cache_leftpad=cache_leftpad)  # fmt: skip
        return reference.kvcache_forward(
            q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, window_left, window_right, softcap,
            cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin, rotary_interleaved, alibi_slopes,
            k_descale, v_descale,
        )  # fmt: skip
    mods = from_op(False, window_left, window_right, softcap, alibi_slopes)
    plan_args = step_plan_args(q, k_cache, v_cache, cache_seqlens, k, v, block_table, mods, num_splits)
    plain = cache_batch_idx is None and cache_leftpad is None and rotary_cos is None and alibi_slopes is None
    if plain:  # a 16-bit cache, or an fp8 cache alone (the serving case): no other option's work
        extra, optional_keys = cache_inputs(k_cache, k_descale, v_descale)
    else:
        extra, optional_keys = _optional_inputs(cache_batch_idx, cache_leftpad, rotary_cos, rotary_sin,
                                                rotary_interleaved, alibi_slopes, k_cache, k_descale,
                                                v_descale)  # fmt: skip
    plans = step_plans(*plan_args, *optional_keys, lse=True, policy=current_policy())
    return run_step(plans, q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, mods, extra,
                    cache_leftpad)  # fmt: skip


# A causal decode step's options as the kernels take them: a right bound of 0
DECODE_CAUSAL = from_op(False, None, 0)


def run_step(plans: tuple, q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale: float,
             mods: ScoreMods, extra: dict, cache_leftpad=None):  # fmt: skip
    """Append, report, allocate and attend with ``plans`` (:func:`step_plans`'s tuple) under ``mods``:
    :func:`forward` after its plans; ``extra`` the optional inputs' per-call tensors but the slopes (in
    ``mods``). Returns (out, lse); lse None when the plans store none."""
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
        block_table=block_table, window=mods.window, cache_leftpad=cache_leftpad,
    )  # fmt: skip
    out = tensors.new_output(out_shape, q.dtype, device)
    lse = None if lse_shape is None else tensors.new_output(lse_shape, _F32, device)
    # What the attention kernel writes: the results, or the split partials (outputs and LSEs in one buffer)
    part = out if combine is None else tensors.new_output((workspace,), _F32, device)
    part_lse = lse if combine is None else part
    qk_scale_log2 = scale * _LOG2E
    cap = mods.softcap
    if cap is None:  # (not read: HAS_SOFTCAP off)
        cap = 0.0
    if mods.alibi_slopes is not None:
        extra = {**extra, "ALIBI": mods.alibi_slopes}
    if append is None and seq_new:  # the attention kernel appends them (see step_plans)
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
