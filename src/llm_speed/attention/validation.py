"""Input checks shared by every attention implementation, so all of them accept and reject the same inputs."""

from __future__ import annotations

import math
import numbers

import torch

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_DIM_MULTIPLE = 8
MAX_HEAD_DIM = 256


def validate_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise TypeError/ValueError unless ``q, k, v`` form a valid attention call; return nothing.

    Accepted: q ``[batch, heads_q, seq_q, head_dim]``, k and v ``[batch, heads_kv, seq_kv, head_dim]``;
    heads_q a multiple of heads_kv (heads >= 1); head_dim a multiple of 8 from 8 to 256; one dtype among
    float16, bfloat16, float32 for all three; all three on one device. Batch and sequence lengths may be 0.
    """
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dims [batch, heads, seq, head_dim], got shape {tuple(tensor.shape)}"
            )
    for name, tensor in (("q", q), ("k", k), ("v", v)):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has dtype {tensor.dtype}; accepted: float16, bfloat16, float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q {q.device}, k {k.device}, v {v.device}")

    batch, heads_q, _, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(
            f"k and v must have the same shape [batch, heads_kv, seq_kv, head_dim], "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if k.shape[0] != batch:
        raise ValueError(f"k and v batch ({k.shape[0]}) must equal q batch ({batch})")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v head_dim ({k.shape[3]}) must equal q head_dim ({head_dim})")
    if head_dim % HEAD_DIM_MULTIPLE != 0 or not HEAD_DIM_MULTIPLE <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(
            f"q head_dim is {head_dim}; accepted: a multiple of {HEAD_DIM_MULTIPLE} "
            f"from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}"
        )
    heads_kv = k.shape[1]
    if heads_q < 1 or heads_kv < 1:
        raise ValueError(f"q heads ({heads_q}) and k/v heads ({heads_kv}) must be at least 1")
    if heads_q % heads_kv != 0:
        raise ValueError(
            f"q heads ({heads_q}) must be a multiple of k/v heads ({heads_kv}) (MHA, GQA or MQA)"
        )


def prepare_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """Validate, copy any tensor whose last dim is not contiguous, and resolve the default scale.

    Other strides are kept as they are: the kernels take any stride for batch, heads and sequence.
    """
    validate_attention_inputs(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    q, k, v = (t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous() for t in (q, k, v))
    return q, k, v, float(scale)


def check_window(window) -> tuple[int | None, int | None] | None:
    """``window``: None, or ``(left, right)`` with each an int >= 0 or None (unbounded on that side).

    Returns it as a tuple of plain ints / None (NumPy integers accepted); anything else is a clear error.
    """
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right), got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window, strict=True):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window {name} must be an int >= 0 or None, got {type(side).__name__}")
        if side < 0:
            raise ValueError(f"window {name} must be >= 0 or None, got {side}")
        sides.append(int(side))
    return sides[0], sides[1]


def check_softcap(softcap) -> float | None:
    """``softcap``: None or a finite real number > 0; returned as a float."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a float > 0 or None, got {type(softcap).__name__}")
    if not (math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite number > 0 or None, got {softcap}")
    return float(softcap)
