"""Argument checks shared by every attention entry point (naive, tiled, flash, packed, decode), so all of them
accept and reject the same inputs with the same words: q/k/v rules, window, softcap, scale, flags, the
flash-attn / SDPA argument names, and the values of ``cu_seqlens``.

Checks of metadata (types, dtypes, shapes, devices) cost nothing and always run. The value check of packed
sequences (:func:`check_seqlens_values`) reads two small tensors to the host: the packed op runs it only where
``llm_speed.core.runtime.check_values`` says so (CPU tensors by default), and otherwise its kernels turn the
rows of a sequence with invalid bounds into NaN.
"""

from __future__ import annotations

import inspect
import math
import numbers

import torch

from ..core import runtime
from ..core.args import check_flag, check_real, check_window  # check_window: torch-free, shared
from ..core.tensors import FLOAT_DTYPES, check_tensor, dtype_names, last_dim_contiguous
from ..matmul.fp8 import FP8_DTYPES as ANY_FP8_DTYPES  # routed to fp8 attention (whose checks name its own)

SUPPORTED_DTYPES = FLOAT_DTYPES
FP8_DTYPES = (torch.float8_e4m3fn,)  # fp8 attention's q, k, v: e4m3, as FlashAttention-3
MAX_HEAD_DIM = 256  # any head_dim from 1 to 256, as flash-attn (the kernels mask the padded columns)


_Tensor = torch.Tensor


def _qkv_fine(q, k, v, rank: int, dtypes=SUPPORTED_DTYPES) -> bool:
    """True when :func:`check_qkv` has nothing to say: one expression over the metadata, evaluated once per
    call (the checks that explain what is wrong run only when it is False)."""
    if not (isinstance(q, _Tensor) and isinstance(k, _Tensor) and isinstance(v, _Tensor)):
        return False
    q_shape, k_shape, dtype = q.shape, k.shape, q.dtype
    if len(q_shape) != rank or len(k_shape) != rank or k_shape != v.shape:
        return False
    head_dim, heads_q, heads_kv = q_shape[-1], q_shape[1], k_shape[1]
    return (
        dtype in dtypes
        and dtype == k.dtype
        and dtype == v.dtype
        and q.device == k.device == v.device
        and k_shape[-1] == head_dim
        and 1 <= head_dim <= MAX_HEAD_DIM
        and heads_kv >= 1
        and heads_q % heads_kv == 0
        and heads_q >= 1
    )


def check_qkv(q, k, v, layout: str, dtypes=SUPPORTED_DTYPES) -> None:
    """Checks shared by the dense and packed layouts: tensors of ``len(layout)`` dims, one dtype of
    ``dtypes`` (fp8 attention: :data:`FP8_DTYPES`) and one device, k and v alike, heads (dim 1) grouped,
    head_dim (last) matching and supported."""
    rank = layout.count(",") + 1
    if _qkv_fine(q, k, v, rank, dtypes):
        return
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != rank:
            raise ValueError(f"{name} must have {rank} dims {layout}, got shape {tuple(tensor.shape)}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dtype not in dtypes:
            if tensor.dtype in ANY_FP8_DTYPES and q.dtype not in ANY_FP8_DTYPES:  # fp8 k/v with a 16-bit q
                raise TypeError(f"{name} has dtype {tensor.dtype}, q {q.dtype}: fp8 attention takes q, k and "
                                f"v all {dtype_names(FP8_DTYPES)}")  # fmt: skip
            what = " (fp8 attention, FlashAttention-3's)" if dtypes == FP8_DTYPES else ""
            raise TypeError(f"{name} has dtype {tensor.dtype}; accepted{what}: {dtype_names(dtypes)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape {layout}, got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim:
        raise ValueError(f"k and v head_dim ({k.shape[-1]}) must equal q head_dim ({head_dim})")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q head_dim is {head_dim}; accepted: any head_dim from 1 to {MAX_HEAD_DIM}")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_q < 1 or heads_kv < 1:
        raise ValueError(f"q heads ({heads_q}) and k/v heads ({heads_kv}) must be at least 1")
    if heads_q % heads_kv != 0:
        raise ValueError(
            f"q heads ({heads_q}) must be a multiple of k/v heads ({heads_kv}) (MHA, GQA or MQA)"
        )


def validate_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              dtypes=SUPPORTED_DTYPES) -> None:  # fmt: skip
    """Raise TypeError/ValueError unless ``q, k, v`` form a valid attention call; return nothing.

    Accepted: q ``[batch, heads_q, seq_q, head_dim]``, k and v ``[batch, heads_kv, seq_kv, head_dim]``;
    heads_q a multiple of heads_kv (heads >= 1); head_dim from 1 to 256; one dtype among
    float16, bfloat16, float32 for all three; all three on one device. Batch and sequence lengths may be 0.
    """
    check_qkv(q, k, v, "[batch, heads, seq, head_dim]", dtypes)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k and v batch ({k.shape[0]}) must equal q batch ({q.shape[0]})")


def validate_varlen_inputs(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dtypes=SUPPORTED_DTYPES
) -> tuple[int, int]:
    """Checks of the packed layout that need no read of tensor values (those are in
    :func:`check_seqlens_values`): q ``[total_q, heads_q, head_dim]``, k/v ``[total_k, heads_kv, head_dim]``
    as the dense rules, ``cu_seqlens_*`` 1-D int32 ``[batch + 1]`` on q's device, max_seqlen_* ints >= 0
    (returned as ints)."""
    check_qkv(q, k, v, "[total, heads, head_dim]", dtypes)
    if cu_seqlens_k is None:
        raise TypeError("cu_seqlens_k must be a torch.Tensor (int32 [batch + 1]); it may be None only with a "
                        "block_table and seqused_k (paged keys)")  # fmt: skip
    return _check_seqlens_metadata(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _check_seqlens_metadata(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> tuple[int, int]:
    """``cu_seqlens_*`` 1-D int32 ``[batch + 1]`` on q's device (``cu_seqlens_k`` None: not given),
    max_seqlen_* ints >= 0 (returned as ints)."""
    given = (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k))
    for name, cu in given if cu_seqlens_k is not None else given[:1]:
        if not isinstance(cu, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (int32 [batch + 1]), got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise TypeError(f"{name} must have dtype torch.int32 (flash-attn's layout), got {cu.dtype}")
        if cu.dim() != 1 or cu.shape[0] < 1:
            raise ValueError(f"{name} must be 1-D [batch + 1] with at least one entry, got {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {cu.device}")
    if cu_seqlens_k is not None and cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both be [batch + 1], got {tuple(cu_seqlens_q.shape)} and "
            f"{tuple(cu_seqlens_k.shape)}"
        )
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
            raise TypeError(f"{name} must be an int >= 0, got {value!r}")
    return int(max_seqlen_q), int(max_seqlen_k)


def _pages_fine(q, k, v, page_multiple: int, dtypes=SUPPORTED_DTYPES) -> bool:
    """True when the paged layout checks of :func:`validate_paged_varlen_inputs` have nothing to say: one
    expression over the metadata (the checks that explain what is wrong run only when it is False)."""
    if not (isinstance(q, _Tensor) and isinstance(k, _Tensor) and isinstance(v, _Tensor)):
        return False
    q_shape, k_shape, dtype = q.shape, k.shape, q.dtype
    if len(q_shape) != 3 or len(k_shape) != 4 or k_shape != v.shape:
        return False
    heads_q, head_dim = q_shape[1], q_shape[2]
    return (
        dtype in dtypes
        and dtype == k.dtype
        and dtype == v.dtype
        and q.device == k.device == v.device
        and k_shape[0] >= 1
        and k_shape[1] >= 1
        and k_shape[1] % page_multiple == 0
        and k_shape[2] >= 1
        and heads_q >= 1
        and heads_q % k_shape[2] == 0
        and k_shape[3] == head_dim
        and 1 <= head_dim <= MAX_HEAD_DIM
    )


def _refuse_pages(q, k, v, page_multiple: int, dtypes=SUPPORTED_DTYPES) -> None:
    """The error for paged k/v that failed :func:`_pages_fine`."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4 or t.shape[0] < 1:
            raise ValueError(
                f"with block_table, {name} must be pages [num_pages >= 1, page_size, heads_kv, head_dim], "
                f"got shape {tuple(t.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    page_size = k.shape[1]
    if page_size < 1 or page_size % page_multiple:
        raise ValueError(
            f"page_size (k dim 1) must be a positive multiple of {page_multiple}, got {page_size}"
        )
    check_qkv(q, k[0], v[0], "[total, heads, head_dim]", dtypes)


def validate_paged_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, seqused_k, max_seqlen_q,
                                 max_seqlen_k, page_multiple: int,
                                 dtypes=SUPPORTED_DTYPES) -> tuple[int, int]:  # fmt: skip
    """Checks of packed queries over paged or partly used keys that need no read of tensor values. Paged
    (``block_table`` given): k/v ``[num_pages, page_size, heads_kv, head_dim]`` (page_size a multiple of
    ``page_multiple``), block_table int32 ``[batch, max_pages]``, cu_seqlens_k may be None when seqused_k is
    given. ``seqused_k``: int32 ``[batch]``. All on q's device. Returns the max_seqlen_* as ints."""
    paged = block_table is not None
    if paged:
        if not _pages_fine(q, k, v, page_multiple, dtypes):
            _refuse_pages(q, k, v, page_multiple, dtypes)
    else:
        check_qkv(q, k, v, "[total, heads, head_dim]", dtypes)
    if cu_seqlens_k is None and not (paged and seqused_k is not None):
        raise TypeError("cu_seqlens_k may be None only with a block_table and seqused_k (paged keys)")
    max_q, max_k = _check_seqlens_metadata(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    batch = cu_seqlens_q.shape[0] - 1
    for name, t, shape in (
        ("block_table", block_table, "[batch, max_pages]"),
        ("seqused_k", seqused_k, "[batch]"),
    ):
        if t is None:
            continue
        check_tensor(name, t, dtypes=(torch.int32,), dims=shape.count(",") + 1, what=shape)
        if t.shape[0] != batch:
            raise ValueError(f"{name} must be {shape} with batch = {batch} (len(cu_seqlens_q) - 1), got "
                             f"{tuple(t.shape)}")  # fmt: skip
        if t.device != q.device:
            raise ValueError(f"{name} must be on q's device {q.device}, got {t.device}")
    return max_q, max_k


def check_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_q: int, max_k: int, *,
                         seqused_k=None, block_table=None, num_pages: int = 0):  # fmt: skip
    """Reject cu_seqlens whose values do not describe the packed tensors: 0 first, non-decreasing, last =
    total, no sequence longer than max_seqlen. With ``seqused_k``: each entry in ``[0, keys of its
    sequence]``. With ``block_table`` (paged keys, ``total_k`` the table's capacity): ``cu_seqlens_k`` (if
    given) only needs 0 first and non-decreasing, and every table entry of a page in use is in ``[0,
    num_pages)``. Reads the tensors to the host once: call it only where ``runtime.check_values(device)``
    allows."""
    paged = block_table is not None
    given = [t for t in (cu_seqlens_q, cu_seqlens_k, seqused_k, block_table) if t is not None]
    flat = torch.cat([t.reshape(-1) for t in given]).tolist()  # one copy to the host
    read = {}
    for name, t in (("q", cu_seqlens_q), ("k", cu_seqlens_k), ("used", seqused_k), ("table", block_table)):
        if t is not None:
            read[name], flat = flat[: t.numel()], flat[t.numel() :]
    rows = [("cu_seqlens_q", read["q"], total_q, max_q)]
    if cu_seqlens_k is not None:
        rows.append(("cu_seqlens_k", read["k"], None if paged else total_k, max_k))
    lengths_of = {}
    for name, values, total, longest in rows:
        if values[0] != 0:
            raise ValueError(f"{name} must start at 0, got {values[0]}")
        lengths = [b - a for a, b in zip(values[:-1], values[1:], strict=True)]
        if any(n < 0 for n in lengths):
            raise ValueError(f"{name} must be non-decreasing, got {values}")
        if total is not None and values[-1] != total:
            raise ValueError(f"{name} must end at the packed length {total}, got {values[-1]}")
        if lengths and max(lengths) > longest and not (name == "cu_seqlens_k" and seqused_k is not None):
            raise ValueError(
                f"max_seqlen_{name[-1]} is {longest} but {name} has a sequence of length {max(lengths)}"
            )
        lengths_of[name] = lengths
    keys = lengths_of.get("cu_seqlens_k")
    if seqused_k is not None:
        used = read["used"]
        for b, n in enumerate(used):
            limit = total_k if paged and keys is None else keys[b]
            if not 0 <= n <= limit:
                what = "the block table's capacity" if paged and keys is None else f"sequence {b}'s keys"
                raise ValueError(f"seqused_k[{b}] = {n} must be in [0, {limit}] ({what})")
        if used and max(used) > max_k:
            raise ValueError(f"max_seqlen_k is {max_k} but seqused_k has a sequence of {max(used)} keys")
        keys = used
    if paged:
        page_size = total_k // max(1, block_table.shape[1])
        if any(n > total_k for n in keys):
            b = next(b for b, n in enumerate(keys) if n > total_k)
            raise ValueError(
                f"sequence {b} has {keys[b]} keys, more than the block table holds ({total_k} = "
                f"{block_table.shape[1]} pages x {page_size})"
            )
        table, width = read["table"], block_table.shape[1]
        for b, n in enumerate(keys):
            for col in range(-(-n // page_size)):
                page = table[b * width + col]
                if not 0 <= page < num_pages:
                    raise ValueError(
                        f"block_table[{b}, {col}] = {page} is not a page of k (0 <= page < {num_pages})"
                    )


def descale_fine(t, batch: int, heads_kv: int, device) -> bool:
    """Whether ``t`` is a float32 fp8 descale of an accepted shape (``[]``, ``[1]``, ``[heads_kv]``,
    ``[batch, heads_kv]``) on ``device``: the common case, quickly (:func:`check_descale` explains a miss)."""
    if type(t) is not _Tensor or t.dtype is not torch.float32:
        return False
    shape = t.shape
    n = len(shape)
    return (n == 0 or (n == 1 and (shape[0] == heads_kv or shape[0] == 1))
            or (n == 2 and shape[0] == batch and shape[1] == heads_kv)) and t.device == device  # fmt: skip


def check_descale(name: str, t, batch: int, heads_kv: int, device) -> None:
    """An fp8 descale (FlashAttention-3's, dequantized = fp8 value * descale): float32 ``[]`` or ``[1]``
    (per tensor), ``[heads_kv]`` (per KV head) or ``[batch, heads_kv]`` (per sequence and KV head), on
    ``device``; raises what is wrong."""
    if not isinstance(t, _Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (float32), got {type(t).__name__}")
    if t.dtype is not torch.float32:
        raise TypeError(f"{name} must be float32, got {t.dtype}")
    if t.shape not in ((), (1,), (heads_kv,), (batch, heads_kv)):
        raise ValueError(
            f"{name} must be [] or [1] (per tensor), [heads_kv={heads_kv}] (per KV head) or "
            f"[batch={batch}, heads_kv={heads_kv}] (per sequence and KV head), got shape {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but q is on {device}")


DESCALE_NAMES = ("descale_q", "descale_k", "descale_v")


def is_fp8_call(q, descale_q, descale_k, descale_v) -> bool:
    """Whether an attention call is fp8 attention: a descale given, or q of an fp8 dtype."""
    return (descale_q is not None or descale_k is not None or descale_v is not None
            or getattr(q, "dtype", None) in ANY_FP8_DTYPES)  # fmt: skip


def check_fp8_options(q, k, v, descales, dropout_p, batch: int, heads_kv: int) -> None:
    """fp8 attention's own rules, after q/k/v's (:func:`check_qkv` with :data:`FP8_DTYPES`): each descale
    None (1) or as :func:`check_descale`; forward only (FlashAttention-3 has no fp8 backward): no dropout
    and no input that requires grad while grad mode is on."""
    device = q.device
    for name, t in zip(DESCALE_NAMES, descales, strict=True):
        if t is not None and not descale_fine(t, batch, heads_kv, device):
            check_descale(name, t, batch, heads_kv, device)
    if dropout_p:
        raise ValueError(f"fp8 attention is forward-only (inference): dropout_p must be 0, got {dropout_p!r}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, *descales)):
        raise ValueError(
            "fp8 attention is forward-only (FlashAttention-3 has no fp8 backward either): call it under "
            "torch.no_grad(), or with inputs and descales that do not require grad"
        )


def check_scale(scale, q: torch.Tensor) -> float:
    """``scale``: None (``1 / sqrt(head_dim)``) or a finite real number; returned as a float."""
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1])
    return check_real("scale", scale)


def prepare_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, dtypes=SUPPORTED_DTYPES
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Validate (q, k, v of one of ``dtypes``), copy any tensor whose last dim is not contiguous, and resolve
    the default scale.

    Other strides are kept as they are: the kernels take any stride for batch, heads and sequence.
    """
    validate_attention_inputs(q, k, v, dtypes)
    return last_dim_contiguous(q), last_dim_contiguous(k), last_dim_contiguous(v), check_scale(scale, q)


# Argument names users bring from flash-attn and PyTorch SDPA, and what to say instead of a bare
# "unexpected keyword argument".
_KNOWN_NAMES = {
    "causal": "did you mean is_causal=? (flash-attn's name)",
    "softmax_scale": "did you mean scale=? (flash-attn's name)",
    "window_size": "did you mean window=(left, right)? (flash-attn's window_size, with None for -1)",
    "return_attn_probs": "did you mean return_lse=? (the probabilities are never stored)",
    "return_softmax_lse": "did you mean return_lse=?",
    "attn_mask": "arbitrary masks are not supported; use is_causal= and/or window=(left, right)",
    "dropout_p": "attention dropout is in flash_attention and flash_attention_varlen (dropout_p=)",
    "alibi_slopes": "ALiBi is in flash_attention, flash_attention_varlen and flash_attention_with_kvcache",
    "return_softmax": "did you mean return_lse=?",
    "enable_gqa": "not needed: GQA/MQA is used whenever k/v have fewer heads than q",
    "softcapping": "did you mean softcap=?",
    "sliding_window": "did you mean window=(W - 1, 0) with is_causal=True?",
}


def suggest_keywords(fn):
    """Mark a public attention function whose unknown keywords (flash-attn's or SDPA's names) get ours.

    ``fn`` ends its signature with ``**unknown`` and begins with ``if unknown: unknown_keywords(fn,
    unknown)``: a call with known keywords only pays a test of an empty dict (a wrapper around it cost 0.7 us
    a call on the development CPU). The signature ``inspect`` and ``help`` show leaves ``unknown`` out."""
    signature = inspect.signature(fn)
    parameters = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    if len(parameters) == len(signature.parameters):
        raise TypeError(f"{fn.__name__} must end its signature with **unknown to have its keywords checked")
    fn.__signature__ = signature.replace(parameters=parameters)
    return fn


def unknown_keywords(fn, unknown: dict) -> None:
    """Raise the TypeError of a call of ``fn`` (marked by :func:`suggest_keywords`) with the keywords
    ``unknown``, naming ours for flash-attn's and SDPA's."""
    name = next(iter(unknown))
    accepted = ", ".join(sorted(inspect.signature(fn).parameters))
    hint = _KNOWN_NAMES.get(name, f"accepted keywords: {accepted}")
    raise TypeError(f"{fn.__name__}() got an unexpected keyword argument {name!r}: {hint}")


def check_softcap(softcap) -> float | None:
    """``softcap``: None or a finite real number > 0; returned as a float."""
    if softcap is None:
        return None
    if type(softcap) is float and 0 < softcap < math.inf:
        return softcap
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float > 0 or None, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap}")
    return float(softcap)


def check_alibi_slopes(alibi_slopes, batch: int, heads_q: int, device) -> torch.Tensor | None:
    """``alibi_slopes``: None, or float32 ``[heads_q]`` or ``[batch, heads_q]`` on q's device (flash-attn's
    rule), finite where values are checked (``runtime.check_values``); returned contiguous (every attention
    entry point with ALiBi checks it here)."""
    if alibi_slopes is None:
        return None
    if (type(alibi_slopes) is torch.Tensor and alibi_slopes.dtype is torch.float32
            and (alibi_slopes.shape == (heads_q,) or alibi_slopes.shape == (batch, heads_q))
            and alibi_slopes.device == device and alibi_slopes.is_contiguous()):  # fmt: skip
        _check_slope_values(alibi_slopes)
        return alibi_slopes  # the common case in a few comparisons (the checks below explain the others)
    check_tensor("alibi_slopes", alibi_slopes, dtypes=(torch.float32,))
    if alibi_slopes.shape != (heads_q,) and alibi_slopes.shape != (batch, heads_q):
        raise ValueError(
            f"alibi_slopes must be [heads_q={heads_q}] or [batch={batch}, heads_q={heads_q}], got shape "
            f"{tuple(alibi_slopes.shape)}"
        )
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device} but q is on {device}")
    _check_slope_values(alibi_slopes)
    return alibi_slopes.contiguous()


def _check_slope_values(alibi_slopes: torch.Tensor) -> None:
    # a NaN or infinite slope makes every score of its head NaN: refused where values are read
    if runtime.check_values(alibi_slopes.device):
        runtime.check_finite("alibi_slopes", alibi_slopes)


def check_dropout(dropout_p, device) -> tuple[float, torch.Tensor | None]:
    """``dropout_p``: a real number in [0, 1). Returns it as a float and, when > 0, this call's int64
    ``(seed, offset)`` pair drawn on ``device`` from PyTorch's default generator there (so
    ``torch.manual_seed`` reproduces a call, and a CUDA graph replays fresh draws): the kernels' Philox key
    and counter."""
    if type(dropout_p) is float and dropout_p == 0.0:  # off: nothing to check
        return 0.0, None
    dropout_p = check_real("dropout_p", dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if dropout_p == 0.0:
        return 0.0, None
    return dropout_p, torch.randint(-(2**62), 2**62, (2,), dtype=torch.int64, device=device)


def check_options(is_causal, return_lse, window, softcap):
    """The options every dense and packed entry point shares, checked before any work: (is_causal,
    return_lse, (window_left, window_right), softcap), the window as two Nones when there is none."""
    return (
        check_flag("is_causal", is_causal),
        check_flag("return_lse", return_lse),
        check_window(window) or (None, None),
        check_softcap(softcap),
    )
