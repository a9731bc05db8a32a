"""Tensor arguments: the checks every op makes before any work, and the one way kernel outputs are allocated.

Checks read only metadata (type, dtype, rank, device, strides): they cost nothing on any device and never wait
for the GPU. Checks of tensor *values* are the ops' business, behind
:func:`llm_speed.core.runtime.check_values`.
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def dtype_names(dtypes) -> str:
    """``float16, bfloat16, float32`` (for messages listing the accepted dtypes)."""
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t, *, dtypes=FLOAT_DTYPES, dims: int | None = None, what: str = "") -> None:
    """TypeError unless ``t`` is a tensor of one of ``dtypes``; ValueError unless it has ``dims`` dims
    (``what`` names the expected layout, e.g. ``"[N, H]"``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; accepted: {dtype_names(dtypes)}")
    if dims is not None and t.dim() != dims:
        layout = f" {what}" if what else ""
        raise ValueError(f"{name} must have {dims} dims{layout}, got shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor | None) -> None:
    """ValueError unless every given tensor (None skipped) is on one device, listing each one's device."""
    devices = {t.device for t in tensors.values() if t is not None}
    if len(devices) > 1:
        present = {name: t for name, t in tensors.items() if t is not None}
        listed = ", ".join(f"{name} {t.device}" for name, t in present.items())
        raise ValueError(f"{', '.join(present)} must be on one device, got {listed}")


def internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share one memory location for certain: a stride of 0 on a dim of more
    than one element (what ``expand`` makes). PyTorch's in-place ops refuse to write into such a tensor."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True))


def check_written_in_place(**tensors: torch.Tensor) -> None:
    """ValueError unless every tensor an op writes into holds each element once (:func:`internal_overlap`)
    and shares no memory with another of them: the same first element, or contiguous ones whose bytes meet
    (PyTorch's rule for in-place writes; views interleaved in one buffer, e.g. k and v of a packed cache,
    pass)."""
    for name, t in tensors.items():
        if internal_overlap(t):
            raise ValueError(
                f"{name} is written in place but has a stride of 0 (shape {tuple(t.shape)}, strides "
                f"{t.stride()}: an expanded tensor) so several elements share one memory location: pass a "
                f"tensor that holds each element once (e.g. .contiguous())"
            )
    items = list(tensors.items())
    for i, (name, t) in enumerate(items):
        for other, u in items[i + 1:]:
            if t.numel() and u.numel() and _share_memory(t, u):
                raise ValueError(f"{name} and {other} are written in place and share memory: pass separate "
                                 "tensors")  # fmt: skip


def check_not_written(name: str, t: torch.Tensor, **written: torch.Tensor) -> None:
    """ValueError if ``t``, an input the op reads, lives in the memory of a tensor it writes (``written``):
    the op could read what it has just written (a query that is a view of the KV cache it appends to)."""
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return
    for other, u in written.items():
        if t.numel() and u.numel() and t.untyped_storage().data_ptr() == u.untyped_storage().data_ptr():
            raise ValueError(f"{name} shares memory with {other}, which this call writes: pass {name} in "
                             "memory of its own")  # fmt: skip


def _share_memory(t: torch.Tensor, u: torch.Tensor) -> bool:
    if torch.compiler.is_compiling():  # fake tensors have no address; one given twice is seen
        return t is u
    if t.device.type == "meta":
        return False
    if t.untyped_storage().data_ptr() != u.untyped_storage().data_ptr():
        return False
    if t.data_ptr() == u.data_ptr():
        return True
    if not (t.is_contiguous() and u.is_contiguous()):
        return False  # interleaved views of one buffer: as PyTorch, not judged
    t_end = t.data_ptr() + t.numel() * t.element_size()
    u_end = u.data_ptr() + u.numel() * u.element_size()
    return t.data_ptr() < u_end and u.data_ptr() < t_end


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim is contiguous (stride 1, or a single element), else a contiguous copy:
    the kernels take any stride for the other dims but assume unit stride along the last."""
    return t if t.stride(-1) == 1 or t.shape[-1] <= 1 else t.contiguous()


def k_major(t: torch.Tensor, k_dim: int) -> torch.Tensor:
    """Matmul operand ``t`` (2-D, or 3-D batched) with its reduction dim ``k_dim`` (-1 for A [.., M, K], -2
    for B [.., K, N]) contiguous: ``t`` itself when it is (stride 1, or a single element), else a copy of the
    same shape in that layout (a broadcast batch, stride 0, is copied once and broadcast again).

    For 8-bit operands: Hopper's wgmma reads fp8/int8 tiles from shared memory K-major only, and Triton 3.6
    moves any other 8-bit tile through registers, byte by byte, at every K step (fp8 at 4096^3 on an H100
    SXM, 2026-11-25: 107 TFLOP/s with b [K, N] row-major, 1002-1219 with b K-major); one copy up front
    costs a read and a write of the operand."""
    if t.stride(k_dim) == 1 or t.shape[k_dim] <= 1:
        return t
    if t.dim() == 3 and t.stride(0) == 0 and t.shape[0] > 1:
        return k_major(t[:1], k_dim).expand(t.shape)
    return t.contiguous() if k_dim % t.dim() == t.dim() - 1 else t.mT.contiguous().mT


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output (uninitialised). Every op allocates through this one function, so tests can
    poison every output with NaN (``tests/accuracy_rule.py``) and an element a kernel forgets to write
    fails.

    The sizes go to ``torch.empty`` one by one: its argument parser takes a ``torch.Size`` about 1 us slower
    than separate ints on the development CPU (1.3 against 2.3 us an allocation), and ops pass slices of
    their inputs' shapes."""
    if not shape:
        return torch.empty((), dtype=dtype, device=device)
    return torch.empty(*shape, dtype=dtype, device=device)
