"""flash-attn's interface on llm-speed's kernels: ``from llm_speed.flash_attn_interface import ...`` replaces
``from flash_attn import ...`` (or ``flash_attn.flash_attn_interface``) unchanged.

The functions have flash-attn 2.x's names, signatures, defaults, layouts (``[batch, seq, heads, head_dim]``;
packed ``[total, heads, head_dim]``) and return values (Dao-AILab/flash-attention,
``flash_attn/flash_attn_interface.py``): ``window_size=(-1, -1)`` and ``softcap=0.0`` mean "off", dropout is
the second positional argument, ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``. Each is a
thin wrapper over llm-speed's own entry points (:func:`llm_speed.flash_attention`,
:func:`llm_speed.flash_attention_varlen`, :func:`llm_speed.flash_attention_with_kvcache`): the same kernels,
autograd, ``torch.compile`` and CUDA-graph behaviour, no copies (a ``[batch, seq, heads, dim]`` tensor is read
through its strides and the output written in that layout).

What differs from flash-attn (docs/attention.md, "Migrating from flash-attn", has the list):

- ``S_dmask`` (``return_attn_probs=True`` with ``dropout_p > 0``, else None as in flash-attn) holds the
  normalised probabilities, negative where dropout dropped them, shaped ``[batch, heads, seq_q, seq_k]``
  without flash-attn's rounding of the lengths to multiples of 128; it is recomputed in PyTorch (memory
  O(seq_q * seq_k) per head): a tool for tests on small problems, as flash-attn says of its own.
- The dropout mask is llm-speed's own Philox stream (seeded from PyTorch's generator of q's device, so
  ``torch.manual_seed`` reproduces a call), not bit-identical to flash-attn's.
- float32 inputs are accepted (flash-attn takes float16 and bfloat16 only), and CPU tensors (the kernels
  under ``TRITON_INTERPRET=1``, else the PyTorch reference, ``flash_attn_with_kvcache`` included).
- ``softmax_lse`` of a row that sees no key (causal with ``seq_q > seq_k``, a window, an empty cache) is
  ``-inf``; flash-attn writes ``+inf``. The output row is 0 in both.
- With ``alibi_slopes`` under flash-attn's causal kernel (``causal=True``, no left window), in every function,
  the output is the same and ``softmax_lse`` differs by a per-row constant: flash-attn adds ``slope * j``,
  llm-speed ``-slope * |i + seq_k - seq_q - j|``.

Arguments take flash-attn's forms: ``window_size`` any indexable pair of integers (a tuple, a list, a
two-element integer tensor as flash-attn's tests draw it); a paged ``flash_attn_varlen_func`` whose inputs
require grad runs its forward and raises only if a gradient is asked of it (flash-attn has no backward there).
"""

from __future__ import annotations

import functools
import math
import numbers
import operator
import reprlib
from collections.abc import Mapping

import torch

from .attention import flash, reference
from .attention.checks import check_dropout, check_scale
from .attention.decode import flash_attention_with_kvcache
from .attention.flash import flash_attention
from .attention.varlen import flash_attention_varlen
from .core.args import check_flag, check_real, type_name
from .core.dispatch import INFERENCE, plain_call

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]


def _window(window_size) -> tuple[int | None, int | None] | None:
    """flash-attn's ``window_size=(left, right)``, -1 (any negative) for an unbounded side: any pair it
    indexes (a tuple, a list, a two-element integer tensor or array: its tests pass ``torch.randint(0,
    seqlen_k, (2,))``), each side an integer (Python, NumPy or a one-element integer tensor)."""
    if type(window_size) is tuple and window_size == (-1, -1):  # the default: one comparison
        return None
    try:
        pair = not isinstance(window_size, str | bytes | Mapping) and len(window_size) == 2
        window_size[1]
    except (TypeError, KeyError, IndexError):  # no len() (a 0-d tensor, an int) or not indexable
        pair = False
    if not pair:
        raise TypeError(
            "window_size must be a pair (left, right) of ints, -1 for unbounded (a tuple, list or "
            f"two-element tensor), got {reprlib.repr(window_size)}"
        )
    sides = []
    for name, side in zip(("left", "right"), (window_size[0], window_size[1]), strict=True):
        if isinstance(side, bool) or getattr(side, "dtype", None) == torch.bool:
            raise TypeError(f"window_size {name} must be an int (-1 for unbounded), got {side!r}")
        try:
            value = operator.index(side)
        except TypeError:
            raise TypeError(
                f"window_size {name} must be an int (-1 for unbounded), got {type(side).__name__} "
                f"{reprlib.repr(side)}"
            ) from None
        sides.append(None if value < 0 else value)
    return None if sides == [None, None] else (sides[0], sides[1])


def _no_window_or_softcap(window_size, softcap) -> bool:
    """Whether ``window_size`` and ``softcap`` are flash-attn's defaults as it spells them ((-1, -1), 0.0):
    the common call, which the functions below pass on with its few arguments only."""
    return type(window_size) is tuple and window_size == (-1, -1) and type(softcap) is float and not softcap


def _softcap(softcap) -> float | None:
    """flash-attn's ``softcap``: 0.0 (the default), or any value <= 0, is off (its kernels cap only when
    ``softcap > 0``, csrc/flash_attn/flash_api.cpp); anything else goes to the checks of ``softcap``."""
    real = isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
    return None if softcap is None or (real and softcap <= 0) else softcap


def _options(causal, softmax_scale, flag_name: str, flag) -> tuple:
    """``causal``, ``softmax_scale`` and the return flag (``flag_name``) checked under flash-attn's names
    (llm-speed's entry points would name is_causal, scale, return_lse)."""
    scale = None if softmax_scale is None else check_real("softmax_scale", softmax_scale)
    return check_flag("causal", causal), scale, check_flag(flag_name, flag)


def _options_fine(causal, softmax_scale, flag) -> bool:
    """Whether :func:`_options` has nothing to say: bools, and None or a finite float (the common call)."""
    return (
        (causal is True or causal is False) and (flag is True or flag is False)
        and (softmax_scale is None or type(softmax_scale) is float and -math.inf < softmax_scale < math.inf)
    )  # fmt: skip


def _check_seq_major(q, k, v) -> None:
    """q, k, v in flash-attn's layout as the caller gave them, checked before they are transposed."""
    for name, t, layout in (("q", q, _Q_LAYOUT), ("k", k, _KV_LAYOUT), ("v", v, _KV_LAYOUT)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type_name(t)}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {layout}, got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape {_KV_LAYOUT}, got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


_Q_LAYOUT = "[batch, seq_q, heads_q, head_dim] (flash-attn's layout)"
_KV_LAYOUT = "[batch, seq_k, heads_k, head_dim] (flash-attn's layout)"


def _generator_state(device: torch.device):
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_generator_state(device: torch.device, state) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _drawn_rng(state, dropout_p: float, device: torch.device) -> torch.Tensor:
    """The ``(seed, offset)`` pair a forward drew first (:func:`check_dropout`) from the generator that was
    at ``state`` before it: replayed, the generator left where the forward left it."""
    after = _generator_state(device)
    _set_generator_state(device, state)
    _, rng = check_dropout(dropout_p, device)
    _set_generator_state(device, after)
    return rng


def _dense_probs(q, k, lse, rng, *, dropout_p, scale, causal, window, softcap, alibi_slopes, first=0):
    """flash-attn's ``S_dmask`` of dense ``[B, H, S, D]`` inputs: probabilities, negative where dropped."""
    scale = check_scale(scale, q)
    probs = reference.attention_probabilities(
        q, k, lse, scale=scale, is_causal=causal, window=window, softcap=softcap, alibi_slopes=alibi_slopes
    )
    keep = reference.kernel_dropout_keep(rng, dropout_p, *q.shape[:3], k.shape[2], q.device, first)
    return torch.where(keep, probs, -probs).to(q.dtype)


def _descales(q_descale, k_descale, v_descale) -> dict:
    """FlashAttention-3's fp8 descales as llm-speed's keywords (none when none is given)."""
    if q_descale is None and k_descale is None and v_descale is None:
        return {}
    return {"descale_q": q_descale, "descale_k": k_descale, "descale_v": v_descale}


def _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
           return_attn_probs, descales=None):  # fmt: skip
    """The dense functions on ``[batch, seq, heads, dim]`` views (read through their strides)."""
    plain = (
        return_attn_probs is False and not descales and alibi_slopes is None and type(dropout_p) is float
        and not dropout_p and (causal is True or causal is False)
        and (deterministic is True or deterministic is False)
        and _no_window_or_softcap(window_size, softcap)
        and (softmax_scale is None or type(softmax_scale) is float and -math.inf < softmax_scale < math.inf)
        and plain_call(q, k, v)
    )  # fmt: skip
    if plain:  # a repeated plain call: no view made (flash.seq_major_inference, flash.seq_major_autograd)
        if plain == INFERENCE:
            out = flash.seq_major_inference(q, k, v, causal, softmax_scale)
        else:
            out = flash.seq_major_autograd(q, k, v, causal, softmax_scale, deterministic)
        if out is not None:
            return out
    if not plain:  # the plain call's options are already bools and a finite scale
        causal, softmax_scale, return_attn_probs = _options(causal, softmax_scale, "return_attn_probs",
                                                            return_attn_probs)  # fmt: skip
    _check_seq_major(q, k, v)
    window, cap = _window(window_size), _softcap(softcap)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    state = _generator_state(q.device) if return_attn_probs and dropout_p else None
    if descales:  # fp8 (FlashAttention-3's keywords)
        result = flash_attention(qt, kt, vt, is_causal=causal, scale=softmax_scale, window=window,
                                 softcap=cap, return_lse=return_attn_probs, alibi_slopes=alibi_slopes,
                                 dropout_p=dropout_p, **descales)  # fmt: skip
    else:
        result = flash_attention(
            qt, kt, vt, is_causal=causal, scale=softmax_scale, window=window, softcap=cap,
            return_lse=return_attn_probs, deterministic=deterministic, alibi_slopes=alibi_slopes,
            dropout_p=dropout_p,
        )  # fmt: skip
    if not return_attn_probs:
        if plain:
            flash.keep_seq_major((q, k, v), (qt, kt, vt), causal, softmax_scale, lse=plain != INFERENCE)
        return result.transpose(1, 2)  # contiguous: the kernel writes q's [batch, seq, heads, dim] order
    out, lse = result
    probs = None
    if state is not None:
        with torch.no_grad():
            rng = _drawn_rng(state, dropout_p, q.device)
            probs = _dense_probs(qt.detach(), kt.detach(), lse.detach(), rng, dropout_p=dropout_p,
                                 scale=softmax_scale, causal=causal, window=window, softcap=cap,
                                 alibi_slopes=alibi_slopes)  # fmt: skip
    return out.transpose(1, 2), lse, probs


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """flash-attn's ``flash_attn_func``: q ``[batch, seq_q, heads_q, dim]``, k/v ``[batch, seq_k,
    heads_k, dim]`` (heads_q a multiple of heads_k), any head dim from 1 to 256. Returns out ``[batch,
    seq_q, heads_q, dim]``; with ``return_attn_probs`` ``(out, softmax_lse [batch, heads_q, seq_q],
    S_dmask or None)``. fp8 (FlashAttention-3's): e4m3 q, k, v with the keywords ``q_descale``,
    ``k_descale``, ``v_descale`` (float32 ``[batch, heads_k]``, or ``[]``/``[1]``/``[heads_k]``), bfloat16
    out, forward only: see :func:`llm_speed.flash_attention`."""
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs, _descales(q_descale, k_descale, v_descale))  # fmt: skip


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_qkvpacked_func``: ``qkv [batch, seq, 3, heads, dim]``, read in place."""
    _check_packed("qkv", qkv, 5, 2, 3)
    q, k, v = qkv.unbind(2)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs)  # fmt: skip


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_kvpacked_func``: q ``[batch, seq_q, heads_q, dim]``, ``kv [batch, seq_k, 2,
    heads_k, dim]``, read in place."""
    _check_packed("kv", kv, 5, 2, 2)
    k, v = kv.unbind(2)
    return _dense(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs)  # fmt: skip


def _check_packed(name: str, t, dims: int, axis: int, count: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims or t.shape[axis] != count:
        raise ValueError(f"{name} must have {dims} dims, {count} at dim {axis}, got shape {tuple(t.shape)}")


def _varlen_probs(q, k, lse, cu_q, cu_k, max_q, max_k, rng, *, dropout_p, scale, causal, window, softcap,
                  alibi_slopes, seqused_k=None, block_table=None):  # fmt: skip
    """``S_dmask [batch, heads_q, max_seqlen_q, max_seqlen_k]`` of packed sequences, zero past each one's
    lengths (reads ``cu_seqlens`` on the host); keys as ``reference.varlen_key_rows`` finds them."""
    bounds_q = cu_q.tolist()
    key_rows = reference.varlen_key_rows(k, cu_k, seqused_k, block_table)
    batch = len(bounds_q) - 1
    probs = q.new_zeros((batch, q.shape[1], max_q, max_k))
    for b in range(batch):
        q0, q1 = bounds_q[b], bounds_q[b + 1]
        keys = k[key_rows[b]]
        slopes = alibi_slopes[b] if alibi_slopes is not None and alibi_slopes.dim() == 2 else alibi_slopes
        probs[b, :, : q1 - q0, : keys.shape[0]] = _dense_probs(
            q[q0:q1].transpose(0, 1)[None], keys.transpose(0, 1)[None], lse[None, :, q0:q1], rng,
            dropout_p=dropout_p, scale=scale, causal=causal, window=window, softcap=softcap,
            alibi_slopes=slopes, first=b,
        )[0]  # fmt: skip
    return probs


class _PagedForward(torch.autograd.Function):
    """A paged forward (``block_table=``) of inputs that require grad: run (grad off inside, as in any
    autograd function), its outputs in the graph, and an error only if a gradient is asked for."""

    @staticmethod
    def forward(ctx, run, q, k, v):
        return run(q, k, v)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "flash_attn_varlen_func with block_table (paged K/V) has no backward, as in flash-attn: call it "
            "under torch.no_grad() or with packed k/v (no block_table) to train"
        )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
    seqused_k=None,
    *,
    q_descale=None,
    k_descale=None,
    v_descale=None,
):
    """flash-attn's ``flash_attn_varlen_func``: q ``[total_q, heads_q, dim]``, k/v ``[total_k, heads_k,
    dim]``, int32 ``cu_seqlens_*`` ``[batch + 1]``. Returns out ``[total_q, heads_q, dim]``; with
    ``return_attn_probs`` ``(out, softmax_lse [heads_q, total_q], S_dmask or None)``.

    ``block_table`` int32 ``[batch, max_pages]``: paged K/V, k/v ``[num_blocks, page_block_size, heads_k,
    dim]``, sequence b's keys the first ``cu_seqlens_k[b + 1] - cu_seqlens_k[b]`` positions of its pages
    (forward only, as flash-attn). ``seqused_k`` int32 ``[batch]`` (a keyword beyond flash-attn 2's, as in
    FlashAttention-3 and vLLM's build): sequence b uses only its first ``seqused_k[b]`` keys; with it and a
    block_table, ``cu_seqlens_k`` may be None. fp8: ``q_descale``, ``k_descale``, ``v_descale`` as
    :func:`flash_attn_func`'s. See :func:`llm_speed.flash_attention_varlen`."""
    if not _options_fine(causal, softmax_scale, return_attn_probs):
        causal, softmax_scale, return_attn_probs = _options(causal, softmax_scale, "return_attn_probs",
                                                            return_attn_probs)  # fmt: skip
    if (
        not return_attn_probs and alibi_slopes is None and seqused_k is None and block_table is None
        and q_descale is None and k_descale is None and v_descale is None
        and _no_window_or_softcap(window_size, softcap)
    ):  # fmt: skip
        # the common call: its few arguments only (each keyword passed costs the call its binding)
        return flash_attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal=causal,
            scale=softmax_scale, deterministic=deterministic, dropout_p=dropout_p,
        )  # fmt: skip
    window, cap = _window(window_size), _softcap(softcap)
    state = _generator_state(q.device) if return_attn_probs and dropout_p else None
    run = functools.partial(
        flash_attention_varlen, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, is_causal=causal, scale=softmax_scale,
        window=window, softcap=cap, return_lse=return_attn_probs, deterministic=deterministic,
        alibi_slopes=alibi_slopes, dropout_p=dropout_p, seqused_k=seqused_k, block_table=block_table,
        **_descales(q_descale, k_descale, v_descale),
    )  # fmt: skip
    if block_table is not None and torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v)
    ):  # flash-attn runs a paged forward whatever its inputs; only its backward is missing
        result = _PagedForward.apply(run, q, k, v)
    else:
        result = run(q, k, v)
    if not return_attn_probs:
        return result
    out, lse = result
    probs = None
    if state is not None:
        with torch.no_grad():
            probs = _varlen_probs(
                q.detach(), k.detach(), lse.detach(), cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                _drawn_rng(state, dropout_p, q.device), dropout_p=dropout_p, scale=softmax_scale,
                causal=causal, window=window, softcap=cap, alibi_slopes=alibi_slopes, seqused_k=seqused_k,
                block_table=block_table,
            )  # fmt: skip
    return out, lse, probs


def flash_attn_varlen_qkvpacked_func(
    qkv,
    cu_seqlens,
    max_seqlen,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_varlen_qkvpacked_func``: ``qkv [total, 3, heads, dim]``, read in place."""
    _check_packed("qkv", qkv, 4, 1, 3)
    q, k, v = qkv.unbind(1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q,
    kv,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash-attn's ``flash_attn_varlen_kvpacked_func``: q ``[total_q, heads_q, dim]``,
    ``kv [total_k, 2, heads_k, dim]``, read in place."""
    _check_packed("kv", kv, 4, 1, 2)
    k, v = kv.unbind(1)
    return flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
        window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
    *,
    k_descale=None,
    v_descale=None,
):
    """flash-attn's ``flash_attn_with_kvcache`` (decode and chunked prefill over a dense or paged KV cache,
    appending ``k``/``v`` in place): see :func:`llm_speed.flash_attention_with_kvcache` for the semantics.
    ``cache_seqlens=None`` means every cache slot is in use (the cache's capacity), as in flash-attn.
    Returns out ``[batch, seq_q, heads_q, dim]``, with ``return_softmax_lse`` ``(out, lse [batch, heads_q,
    seq_q])``. An fp8 cache (e4m3 or e5m2) takes FlashAttention-3's ``k_descale``/``v_descale`` (keywords;
    float32 ``[batch, heads_kv]`` as FA3, or ``[]``/``[1]``/``[heads_kv]``); q stays 16-bit (no
    ``q_descale``)."""
    if not _options_fine(causal, softmax_scale, return_softmax_lse):
        causal, softmax_scale, return_softmax_lse = _options(causal, softmax_scale, "return_softmax_lse",
                                                             return_softmax_lse)  # fmt: skip
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("cache_seqlens is required when k/v are appended (where would they go?)")
        if block_table is not None and not isinstance(block_table, torch.Tensor):
            raise TypeError(f"block_table must be a torch.Tensor, got {type(block_table).__name__}")
        if block_table is not None and block_table.dim() != 2:
            raise ValueError(f"block_table must be [batch, max_pages], got shape {tuple(block_table.shape)}")
        if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 4:
            pages = 1 if block_table is None else block_table.shape[1]
            cache_seqlens = pages * k_cache.shape[1]
    if (
        rotary_cos is None and cache_batch_idx is None and cache_leftpad is None and alibi_slopes is None
        and k_descale is None and v_descale is None and rotary_interleaved is True
        and _no_window_or_softcap(window_size, softcap)
    ):  # fmt: skip
        # the serving step: its few arguments only (each keyword passed costs the call its binding)
        return flash_attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, k=k, v=v, block_table=block_table,
            is_causal=causal, scale=softmax_scale, num_splits=num_splits, return_lse=return_softmax_lse,
            rotary_sin=rotary_sin,
        )  # fmt: skip
    return flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, k=k, v=v, block_table=block_table,
        is_causal=causal, scale=softmax_scale, window=_window(window_size), softcap=_softcap(softcap),
        num_splits=num_splits, return_lse=return_softmax_lse, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, k_descale=k_descale,
        v_descale=v_descale,
    )  # fmt: skip

