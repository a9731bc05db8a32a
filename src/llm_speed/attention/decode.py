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

Kernels. New k/v rows are written by the append kernel (one program per new token and block of KV heads)
before the attention kernel runs. Under the launch policy's ``decode_append_in_attention`` (the
``decode-append`` candidate: unproven on a GPU, off as shipped), a decode step whose query rows of a KV head
fit one tile (:func:`appends_in_attention`) has the attention kernel write them itself instead: each
(sequence, KV head, split) program writes those of its split's key range, then a block barrier, then reads
its keys (flash-attn 2's ``Append_KV``). The attention kernel has
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

import math

import torch

from ..core import runtime, tensors
from ..core.args import check_flag, check_real, positive_int
from ..core.dispatch import Op, plain_inference
from ..core.launch import CallCache
from ..core.policy import current_number, current_policy
from ..core.tensors import (
    FLOAT_DTYPES,
    check_not_written,
    check_same_device,
    check_tensor,
    check_written_in_place,
    dtype_names,
)
from ..matmul.fp8 import FP8_DTYPES, check_scale_values
from .checks import (
    MAX_HEAD_DIM,
    check_alibi_slopes,
    check_descale,
    check_scale,
    check_softcap,
    check_window,
    descale_fine,
    suggest_keywords,
    unknown_keywords,
)
from .decode_kernels import KERNEL_APPEND, KERNEL_COMBINE, KERNEL_DECODE
from .decode_launch import (
    DECODE_CAUSAL,
    NO_INPUTS,
    appends_in_attention,
    cache_inputs,
    choose_num_splits,
    forward,
    kernel_config,
    rotary_span,
    run_step,
    step_plan_args,
    step_plans,
)
from .options import NO_MODS

# The op's public function, and the names other modules read from the op module (kernels and launch live in
# decode_kernels.py and decode_launch.py).
__all__ = [
    "flash_attention_with_kvcache",
    "KERNEL_APPEND",
    "KERNEL_COMBINE",
    "KERNEL_DECODE",
    "appends_in_attention",
    "choose_num_splits",
    "kernel_config",
    "rotary_span",
]

_Tensor = torch.Tensor
_F32 = torch.float32
_I32 = torch.int32
_E4M3, _E5M2 = FP8_DTYPES
PAGE_MULTIPLE = 16  # page_size must be a multiple of this (flash-attn asks 256, vLLM 16)


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
        if (cache or t is not None) and (not isinstance(t, _Tensor) or t.dtype is not dtype or t.dim() != 4
                              or t.device != device):  # fmt: skip
            if cache and isinstance(t, _Tensor) and (t.dtype is _E4M3 or t.dtype is _E5M2) and t.dim() == 4 \
                    and t.device == device:  # fmt: skip
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
        check_written_in_place(k_cache=k_cache, v_cache=v_cache)  # the new tokens go into the caches
        check_not_written("q", q, k_cache=k_cache, v_cache=v_cache)  # q is read after the append
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
        k is None, block_table is None, current_number(),
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
            ``cache_seqlens`` itself is not advanced (the caller owns it, as in flash-attn). Caches written
            this way must hold each element once and not share memory (an expanded cache, or one tensor
            for both, is refused: the appends would overwrite each other).
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
    ``TRITON_INTERPRET=1``; other CPU tensors run the PyTorch reference in float32
    (:func:`llm_speed.attention.reference.kvcache_forward`: every option, the append in place, NaN rows for
    invalid entries as above). The kernels read ``cache_batch_idx``, ``cache_leftpad``, the rotary tables and
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
        and plain_inference(q, k_cache, v_cache, cache_seqlens,
                            optional=(k, v, block_table, k_descale, v_descale))
        and not runtime.check_values(q.device)
    ):  # fmt: skip
        known = _decode_call_key(q, k_cache, v_cache, cache_seqlens, k, v, block_table, is_causal, num_splits,
                                 return_lse, k_descale, v_descale)  # fmt: skip
        plans = _DECODE_CALLS.get(known)
        if plans is not None:
            scale = check_scale(None, q) if scale is None else scale
            extra = NO_INPUTS if k_descale is None else {"K_DESCALE": k_descale, "V_DESCALE": v_descale}
            out, lse = run_step(plans, q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale,
                                DECODE_CAUSAL if is_causal else NO_MODS, extra)  # fmt: skip
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
            check_scale_values(("k_descale", k_descale), ("v_descale", v_descale))
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
        mods = DECODE_CAUSAL if is_causal else NO_MODS  # (no window: known)
        plan_args = step_plan_args(q, k_cache, v_cache, cache_seqlens, k, v, block_table, mods, num_splits)
        extra, optional_keys = cache_inputs(k_cache, k_descale, v_descale)
        plans = step_plans(*plan_args, *optional_keys, lse=return_lse, policy=current_policy())
        _DECODE_CALLS.put(known, plans)
        out, lse = run_step(plans, q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale, mods, extra)
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
