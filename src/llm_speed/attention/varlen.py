"""FlashAttention over packed variable-length sequences: flash-attn's ``flash_attn_varlen_func`` layout.

The operators ``llm_speed::flash_attention_varlen_forward`` and ``llm_speed::flash_attention_varlen_backward``
run FlashAttention's kernels with ``IS_VARLEN`` on, through the launchers of ``flash.py``
(``flash.varlen_forward`` / ``flash.varlen_backward``); registered like the dense ones with
``torch.library.custom_op``, fake implementations and autograd, so ``torch.compile(fullgraph=True)`` captures
them.
"""

from __future__ import annotations

import math

import torch

from ..core import (
    autocast,  # torch.autocast rules
    runtime,
)
from ..core.args import check_flag
from ..core.dispatch import INFERENCE, Op, plain_call
from ..core.launch import CallCache, tma_aligned
from ..core.policy import current_number
from ..core.tensors import last_dim_contiguous
from ..matmul.fp8 import check_scale_values
from . import flash
from .checks import (
    DESCALE_NAMES,
    FP8_DTYPES,
    SUPPORTED_DTYPES,
    check_alibi_slopes,
    check_dropout,
    check_fp8_options,
    check_options,
    check_scale,
    is_fp8_call,
    suggest_keywords,
    unknown_keywords,
    validate_paged_varlen_inputs,
    validate_varlen_inputs,
)
from .decode import PAGE_MULTIPLE
from .options import from_op

# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::flash_attention_varlen_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The values of cu_seqlens are checked in the implementation, on real tensors (also under torch.compile).
    return flash.varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, window_left,
        window_right, softcap, deterministic, alibi_slopes, dropout_p, rng, seqused_k, block_table,
    )  # fmt: skip


@_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
                  window_left=None, window_right=None, softcap=None, deterministic=False, alibi_slopes=None,
                  dropout_p=0.0, rng=None, seqused_k=None, block_table=None):  # fmt: skip
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("llm_speed::flash_attention_varlen_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash.varlen_backward(
        dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, is_causal, scale, window_left,
        window_right, softcap, deterministic, alibi_slopes, dropout_p, rng, seqused_k, block_table,
    )  # fmt: skip


@_backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, is_causal, scale,
                   window_left=None, window_right=None, softcap=None, deterministic=False, alibi_slopes=None,
                   dropout_p=0.0, rng=None, seqused_k=None, block_table=None):  # fmt: skip
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_backward_call = Op(_backward_op, flash.varlen_backward)
_backward_call = autocast.dispatch(_backward_call, autocast.KEEP)  # torch.autocast: as saved (issue 34)


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, _max_q, _max_k, *args = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = tuple(args)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _backward_call(dout, q, k, v, out, lse, dlse, cu_q, cu_k, *ctx.args)
    return (dq, dk, dv) + (None,) * (4 + len(ctx.args))


_forward_plain = Op(_forward_op, flash.varlen_forward, setup_context=_setup_context, backward=_backward)
_forward_call = autocast.dispatch(_forward_plain, autocast.LOWER, (0, 1, 2))  # torch.autocast: as SDPA


def _fp8_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, descale_q, descale_k,
                 descale_v, is_causal, scale, window_left=None, window_right=None, softcap=None,
                 alibi_slopes=None, seqused_k=None, block_table=None):  # fmt: skip
    """(out bfloat16, lse) of fp8 attention over packed sequences; the fp8 op's implementation (the
    descales' values checked on the host where ``runtime.check_values`` allows, like cu_seqlens')."""
    if runtime.check_values(q.device):
        check_scale_values(*zip(DESCALE_NAMES, (descale_q, descale_k, descale_v), strict=True))
    mods = from_op(is_causal, window_left, window_right, softcap, alibi_slopes)
    return flash.packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mods,
                                seqused_k, block_table, (descale_q, descale_k, descale_v))  # fmt: skip


@torch.library.custom_op("llm_speed::flash_attention_varlen_fp8_forward", mutates_args=())
def _fp8_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    descale_q: torch.Tensor | None,
    descale_k: torch.Tensor | None,
    descale_v: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _fp8_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, descale_q, descale_k, descale_v,
        is_causal, scale, window_left, window_right, softcap, alibi_slopes, seqused_k, block_table,
    )  # fmt: skip


@_fp8_forward_op.register_fake
def _fp8_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, descale_q, descale_k,
                      descale_v, is_causal, scale, window_left=None, window_right=None, softcap=None,
                      alibi_slopes=None, seqused_k=None, block_table=None):  # fmt: skip
    out = torch.empty_like(q, dtype=torch.bfloat16)
    return out, q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


_fp8_forward_call = Op(_fp8_forward_op, _fp8_forward)  # forward only: no gradient formula


# --- public function ------------------------------------------------------------------------------------


@suggest_keywords
def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    seqused_k: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    **unknown,
):
    """FlashAttention over packed sequences of different lengths (flash-attn's ``flash_attn_varlen_func``).

    Args:
        q: ``[total_q, heads_q, head_dim]``, the queries of every sequence one after another.
        k, v: ``[total_k, heads_kv, head_dim]``; heads_q a multiple of heads_kv (MHA, GQA, MQA).
        cu_seqlens_q, cu_seqlens_k: int32 ``[batch + 1]`` on q's device: sequence b is rows
            ``cu_seqlens[b] .. cu_seqlens[b + 1] - 1``; 0 first, non-decreasing, last = total. Empty
            sequences are allowed. Any stride (a strided one, seqused_k too, is copied: the kernels read
            them with unit stride).
        max_seqlen_q, max_seqlen_k: ints >= the longest sequence, the caller's (flash-attn's arguments,
            never computed from ``cu_seqlens``): checked where the values are, otherwise unused (the grid is
            sized from the totals).
        is_causal, scale, window, softcap: as :func:`llm_speed.flash_attention`, each sequence on its own:
            causal masks and windows are aligned bottom-right per sequence (``p = i + seq_k_b - seq_q_b``).
        return_lse: also return the LSE ``[heads_q, total_q]`` fp32 (flash-attn's layout).
        deterministic: the backward's path, as :func:`llm_speed.flash_attention`'s: by default dQ is added
            up with atomics (five matmuls per tile; its last bits may differ run to run); ``True`` (or
            ``torch.are_deterministic_algorithms_enabled()`` when the backward runs) gives bitwise
            repeatable gradients from a dQ kernel of its own.
        alibi_slopes, dropout_p: as :func:`llm_speed.flash_attention`.
        seqused_k: int32 ``[batch]``: sequence b attends only to the first ``seqused_k[b]`` of its keys
            (0 to all of them; flash-attn's ``seqused_k``); the masks align on that length. Key rows past it
            get zero gradients.
        block_table: int32 ``[batch, max_pages]``: paged keys and values (vLLM's PagedAttention layout, as
            :func:`llm_speed.flash_attention_with_kvcache`): k and v are pages ``[num_pages, page_size,
            heads_kv, head_dim]`` (page_size a multiple of 16) and key position n of sequence b sits at slot
            ``n % page_size`` of page ``block_table[b, n // page_size]``. Sequence b has ``seqused_k[b]``
            keys, or without seqused_k ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` (cu_seqlens_k may then be
            None). Forward only (flash-attn's varlen backward has no block table either): a ValueError when a
            gradient is needed. Only the entries of pages in use are read; one outside ``[0, num_pages)``
            is rejected where values are checked, else its sequence's rows are NaN and no page outside the
            pool is read.
        descale_q, descale_k, descale_v: fp8 attention, as :func:`llm_speed.flash_attention`'s (e4m3 q, k,
            v, paged or not; output bfloat16; forward only), a ``[batch, heads_kv]`` descale indexed by
            sequence.

    Sequence b attends only to its own keys. A row that sees no key (its sequence has no key, or the mask
    hides them all) outputs 0 with LSE -inf and gets zero gradients. Output ``[total_q, heads_q, head_dim]``
    contiguous, in q's dtype. Forward and backward (autograd, gradients through the LSE too) run the dense
    kernels' bodies with ``IS_VARLEN`` on.

    Grid: ``cdiv(total, block) + batch`` programs per head, an upper bound on the real work that needs no
    read of the lengths on the host; the per-sequence block counts are summed on the device and each program
    finds its sequence from ``cu_seqlens`` on the device (``program_block``), so the grid grows with the
    tokens, not with batch x max_seqlen.

    Values of ``cu_seqlens``: where ``llm_speed.core.runtime.check_values`` says so (CPU tensors by default,
    any device with ``LLM_SPEED_CHECK_INPUTS=1``) they are read once (one small device-to-host copy) and bad
    ones rejected with a ValueError before any work. Elsewhere (CUDA tensors by default) nothing is read on
    the host, so a call can be captured in a CUDA graph: a sequence whose bounds are invalid (a negative or
    decreasing entry, one past the total, a first entry other than 0 or a last one other than the total)
    gets NaN over its rows of the output and LSE (NaN or zero gradients in the backward), the other sequences
    are computed exactly, and nothing outside the tensors is read or written.

    CPU tensors run the kernels through the interpreter when ``TRITON_INTERPRET=1``, otherwise the PyTorch
    reference per sequence in float32.
    """
    if unknown:
        unknown_keywords(flash_attention_varlen, unknown)
    known = None  # the key of a call that _VARLEN_CALLS may serve: the common call
    if (
        window is None and softcap is None and alibi_slopes is None and type(dropout_p) is float
        and not dropout_p and seqused_k is None and block_table is None and descale_q is None
        and descale_k is None and descale_v is None and (is_causal is True or is_causal is False)
        and (return_lse is True or return_lse is False) and (deterministic is True or deterministic is False)
        and (scale is None or type(scale) is float and -math.inf < scale < math.inf)
        and type(max_seqlen_q) is int and type(max_seqlen_k) is int
        and (mode := plain_call(q, k, v, cu_seqlens_q, optional=(cu_seqlens_k,)))
    ):  # fmt: skip
        known = _varlen_call_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                 scale)  # fmt: skip
        call = _VARLEN_CALLS.get(known)
        if call is not None:  # the kept launch checks the values of cu_seqlens where it may
            scale = call.default_scale if scale is None else scale
            if mode == INFERENCE:
                out, lse = call.forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        is_causal, scale)  # fmt: skip
            else:  # with grad: the op's autograd node around the kept launch
                out, lse = _forward_plain.checked(call.forward, q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, is_causal, scale, None, None,
                                                  None, deterministic)  # fmt: skip
            return (out, lse) if return_lse else out
    is_causal, return_lse, (left, right), softcap = check_options(is_causal, return_lse, window, softcap)
    deterministic = check_flag("deterministic", deterministic)
    fp8 = is_fp8_call(q, descale_q, descale_k, descale_v)
    if fp8:
        dtypes = FP8_DTYPES
    else:
        dtypes = SUPPORTED_DTYPES
        q, k, v = autocast.cast_inputs(autocast.LOWER, q, k, v)  # as SDPA: mixed dtypes meet under autocast
    if seqused_k is None and block_table is None:
        max_seqlen_q, max_seqlen_k = validate_varlen_inputs(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtypes
        )
        kv_extra = ()
    else:
        max_seqlen_q, max_seqlen_k = validate_paged_varlen_inputs(
            q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, max_seqlen_q, max_seqlen_k,
            PAGE_MULTIPLE, dtypes,
        )  # fmt: skip
        if not fp8 and block_table is not None and torch.is_grad_enabled() and (
            q.requires_grad or k.requires_grad or v.requires_grad
        ):  # (fp8: check_fp8_options says it is forward-only)
            raise ValueError(
                "block_table (paged K/V) is forward-only (as in flash-attn): call under torch.no_grad() or "
                "with q, k, v that do not require grad"
            )
        if seqused_k is not None:  # read with unit stride, as cu_seqlens below
            seqused_k = last_dim_contiguous(seqused_k)
        kv_extra = (seqused_k, block_table)
    # the kernels read the index vectors with unit stride: a strided one (a column of a table) is copied
    given_cu = cu_seqlens_q, cu_seqlens_k
    cu_seqlens_q = last_dim_contiguous(cu_seqlens_q)
    if cu_seqlens_k is not None:
        cu_seqlens_k = last_dim_contiguous(cu_seqlens_k)
    given = q, k, v
    q, k, v = last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v)
    scale = check_scale(scale, q)
    if fp8:
        batch, descales = cu_seqlens_q.shape[0] - 1, (descale_q, descale_k, descale_v)
        check_fp8_options(q, k, v, descales, dropout_p, batch, k.shape[-2])  # heads_kv, packed or paged
        alibi_slopes = check_alibi_slopes(alibi_slopes, batch, q.shape[1], q.device)
        out, lse = _fp8_forward_call(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *descales, is_causal, scale,
            left, right, softcap, alibi_slopes, seqused_k, block_table,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    if alibi_slopes is None and not dropout_p and not kv_extra:  # the common call: nothing more to check
        extra = ()
    else:
        batch = cu_seqlens_q.shape[0] - 1
        alibi_slopes = check_alibi_slopes(alibi_slopes, batch, q.shape[1], q.device)
        extra = (alibi_slopes, *check_dropout(dropout_p, q.device), *kv_extra)
    out, lse = _forward_call(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, left, right,
        softcap, deterministic, *extra,
    )  # fmt: skip
    if (known is not None and given[0] is q and given[1] is k and given[2] is v
            and given_cu[0] is cu_seqlens_q and given_cu[1] is cu_seqlens_k):  # nothing copied
        _VARLEN_CALLS.put(known, flash.VarlenCall(q, k, v, cu_seqlens_q, is_causal, scale < 0.0))
    return (out, lse) if return_lse else out


# Packed calls already checked, by every tensor's metadata, the two maximum lengths (what the checks read) and
# what the plan reads besides (causal, a negative scale, K's and V's 16-byte alignment), each with its launch
# (flash.VarlenCall): a repeated call skips the checks and the plan lookup (the kept launch still checks the
# values of cu_seqlens where runtime.check_values says), with grad inside the op's autograd node (Op.checked).
_VARLEN_CALLS = CallCache()


def _varlen_call_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                     scale) -> tuple:  # fmt: skip
    """The key of :data:`_VARLEN_CALLS`: every tensor's metadata, the two lengths and what the plan reads
    (the launch policy too)."""
    key = (
        q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(),
        v.dtype, v.device, cu_seqlens_q.shape, cu_seqlens_q.stride(), cu_seqlens_q.dtype, cu_seqlens_q.device,
        max_seqlen_q, max_seqlen_k, is_causal, scale is not None and scale < 0.0, tma_aligned(k, v),
        current_number(),
    )  # fmt: skip
    if cu_seqlens_k is None:
        return key
    return (*key, cu_seqlens_k.shape, cu_seqlens_k.stride(), cu_seqlens_k.dtype, cu_seqlens_k.device)

