"""Pieces shared by the fused ops: input checks, output allocation, program counts."""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch

from .._block_config import hardware_of

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_NAMES = "float16, bfloat16, float32"


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output (uninitialised). One function so tests can poison every output with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def check_tensor(name: str, t, *, dtypes=FLOAT_DTYPES, dims: int | None = None, what: str = "") -> None:
    """TypeError unless ``t`` is a tensor of one of ``dtypes``; ValueError unless it has ``dims`` dims."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        accepted = _DTYPE_NAMES if dtypes == FLOAT_DTYPES else ", ".join(str(d) for d in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; accepted: {accepted}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims {what}, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    present = {name: t for name, t in tensors.items() if t is not None}
    devices = {t.device for t in present.values()}
    if len(devices) > 1:
        listed = ", ".join(f"{name} {t.device}" for name, t in present.items())
        raise ValueError(f"{', '.join(present)} must be on one device, got {listed}")


def check_real(name: str, value, *, minimum: float | None = None, positive: bool = False) -> float:
    """A finite real number (bools refused), optionally > 0 or >= ``minimum``, else TypeError/ValueError."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the PyTorch references compute: float64 stays float64 (the truth), all else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def reduction_programs(device: torch.device, rows: int) -> int:
    """Programs for a row loop whose per-program partial sums are added up afterwards (weight gradients):
    one per SM on a GPU, so each SM writes one partial row; 4 on CPU (the interpreter runs them in turn)."""
    target = hardware_of(device).sm_count if device.type == "cuda" else 4
    return max(1, min(rows, target))
