"""RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019, arXiv:1910.07467) in Triton.

``y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)``; ``offset=1.0`` is Gemma's convention (its
weights are stored as a difference from 1, google-deepmind/gemma ``layers.py`` ``RMSNorm``). Statistics in
float32, one read of x and one write of y per row (the unfused PyTorch expression reads and writes the row
about five times). The backward kernel recomputes ``x * rstd`` from x and the saved per-row rstd and, like
Liger-Kernel's ``ops/rms_norm.py``, sums the weight gradient in float32 partial rows, one per program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _runtime
from .._triton_cast import cast, rne_by_hand
from . import _common
from ._common import check_real, check_same_device, check_tensor, compute_dtype, reduction_programs

KERNEL_FORWARD = "rms_norm_fwd"
KERNEL_BACKWARD = "rms_norm_bwd"
ROW_BLOCK_ELEMENTS = 4096  # forward: rows per program so that a program holds about this many elements


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, rows, hidden, eps, offset,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    # BLOCK_R rows per program: narrow rows (small hidden) would leave most of a program idle
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_h = tl.arange(0, BLOCK_H)
    m_r = o_r < rows
    m = m_r[:, None] & (o_h < hidden)[None, :]
    b_x = tl.load(x_ptr + o_r[:, None] * stride_x + o_h[None, :], mask=m, other=0.0).to(
        tl.float32
    )  # [BR, BH]
    b_w = tl.load(w_ptr + o_h, mask=o_h < hidden, other=0.0).to(tl.float32)
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_x * b_x, axis=1) / hidden + eps)  # [BR]
    b_y = b_x * b_rstd[:, None] * (offset + b_w)[None, :]
    b_y = cast(b_y, y_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    tl.store(y_ptr + o_r[:, None] * stride_y + o_h[None, :], b_y, mask=m)
    tl.store(rstd_ptr + o_r, b_rstd, mask=m_r)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, stride_dy, stride_x, stride_dx,
    rows, rows_per_program, hidden, offset,
    BLOCK_H: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < hidden
    b_w = tl.load(w_ptr + o_h, mask=m_h, other=0.0).to(tl.float32) + offset
    b_dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, rows)
    # 64-bit row pointers, moved one row per step (row * stride can pass 2**31 elements)
    p_x = x_ptr + row_start.to(tl.int64) * stride_x
    p_dy = dy_ptr + row_start.to(tl.int64) * stride_dy
    p_dx = dx_ptr + row_start.to(tl.int64) * stride_dx
    p_rstd = rstd_ptr + row_start
    for _ in range(row_start, row_end):
        b_x = tl.load(p_x + o_h, mask=m_h, other=0.0).to(tl.float32)  # [BH]
        b_dy = tl.load(p_dy + o_h, mask=m_h, other=0.0).to(tl.float32)
        rstd = tl.load(p_rstd)
        b_xhat = b_x * rstd
        b_g = b_dy * b_w  # gradient with respect to xhat
        # d/dx of x * rstd(x): rstd * (g - xhat * mean(g * xhat))
        b_dx = rstd * (b_g - b_xhat * (tl.sum(b_g * b_xhat, axis=0) / hidden))
        tl.store(p_dx + o_h, cast(b_dx, dx_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m_h)
        b_dw += b_dy * b_xhat
        p_x += stride_x
        p_dy += stride_dy
        p_dx += stride_dx
        p_rstd += 1
    tl.store(dw_partial_ptr + pid * BLOCK_H + o_h, b_dw, mask=m_h)


def _num_warps(block: int) -> int:
    return min(16, max(1, block // 256))


def _forward_torch(x2d, weight, eps, offset):
    xf = x2d.to(compute_dtype(x2d.dtype))
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = xf * rstd[:, None] * (offset + weight.to(xf.dtype))
    return y.to(x2d.dtype), rstd.float()


def _backward_torch(dy, x2d, weight, rstd, offset):
    ct = compute_dtype(x2d.dtype)
    xhat = x2d.to(ct) * rstd.to(ct)[:, None]
    g = dy.to(ct) * (offset + weight.to(ct))
    dx = rstd.to(ct)[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dw = (dy.to(ct) * xhat).sum(0)
    return dx.to(x2d.dtype), dw.to(weight.dtype)


@torch.library.custom_op("llm_speed::rms_norm_forward", mutates_args=())
def _forward_op(
    x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, hidden = x2d.shape
    if rows:
        _runtime.report_work("rms_norm", x=x2d, weight=weight)
    if rows == 0 or not _runtime.triton_runs_on(x2d.device):
        return _forward_torch(x2d, weight, eps, offset)
    y = _common.new_output((rows, hidden), x2d.dtype, x2d.device)
    rstd = _common.new_output((rows,), torch.float32, x2d.device)
    block = triton.next_power_of_2(hidden)
    block_r = min(triton.next_power_of_2(rows), max(1, ROW_BLOCK_ELEMENTS // block))
    with _runtime.on_device_of(x2d):
        _rms_norm_fwd_kernel[(triton.cdiv(rows, block_r),)](
            x_ptr=x2d, w_ptr=weight, y_ptr=y, rstd_ptr=rstd, stride_x=x2d.stride(0), stride_y=y.stride(0),
            rows=rows, hidden=hidden, eps=eps, offset=offset,
            BLOCK_R=block_r, BLOCK_H=block, RNE_BY_HAND=rne_by_hand(x2d.dtype),
            num_warps=_num_warps(block_r * block),
        )  # fmt: skip
    _runtime.record_launch(KERNEL_FORWARD)
    return y, rstd


@_forward_op.register_fake
def _forward_fake(x2d, weight, eps, offset):
    return torch.empty_like(x2d), x2d.new_empty((x2d.shape[0],), dtype=torch.float32)


@torch.library.custom_op("llm_speed::rms_norm_backward", mutates_args=())
def _backward_op(
    dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, hidden = x2d.shape
    dy = dy.contiguous()
    if rows:
        _runtime.report_work("rms_norm_backward", x=x2d, weight=weight)
    if rows == 0 or not _runtime.triton_runs_on(x2d.device):
        return _backward_torch(dy, x2d, weight, rstd, offset)
    block = triton.next_power_of_2(hidden)
    programs = reduction_programs(x2d.device, rows)
    rows_per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, rows_per_program)
    dx = _common.new_output((rows, hidden), x2d.dtype, x2d.device)
    dw_partial = torch.zeros((programs, block), dtype=torch.float32, device=x2d.device)
    with _runtime.on_device_of(x2d):
        _rms_norm_bwd_kernel[(programs,)](
            dy_ptr=dy, x_ptr=x2d, w_ptr=weight, rstd_ptr=rstd, dx_ptr=dx, dw_partial_ptr=dw_partial,
            stride_dy=dy.stride(0), stride_x=x2d.stride(0), stride_dx=dx.stride(0),
            rows=rows, rows_per_program=rows_per_program, hidden=hidden, offset=offset,
            BLOCK_H=block, RNE_BY_HAND=rne_by_hand(x2d.dtype), num_warps=_num_warps(block),
        )  # fmt: skip
    _runtime.record_launch(KERNEL_BACKWARD)
    return dx, dw_partial[:, :hidden].sum(0).to(weight.dtype)


@_backward_op.register_fake
def _backward_fake(dy, x2d, weight, rstd, offset):
    return torch.empty_like(x2d), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x2d, weight, _, offset = inputs
    ctx.save_for_backward(x2d, weight, output[1])
    ctx.offset = offset


def _backward(ctx, dy, _drstd):
    x2d, weight, rstd = ctx.saved_tensors
    dx, dw = _backward_op(dy, x2d, weight, rstd, ctx.offset)
    return dx, dw, None, None


_forward_op.register_autograd(_backward, setup_context=_setup_context)


def _validate(x, weight, eps, offset):
    check_tensor("x", x)
    check_tensor("weight", weight, dims=1, what="[hidden]")
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dim [..., hidden], got a 0-dim tensor")
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} elements; it must match x's last dim ({x.shape[-1]})")
    if x.shape[-1] == 0:
        raise ValueError("x's last dim (hidden) must be at least 1")
    check_same_device(x=x, weight=weight)
    return check_real("eps", eps, minimum=0.0), check_real("offset", offset)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)``.

    Args:
        x: ``[..., hidden]``, any leading shape, float16, bfloat16 or float32. A non-contiguous last dim (or
            leading dims that cannot be flattened without a copy) is copied first.
        weight: ``[hidden]``, float16, bfloat16 or float32 (need not match x: float32 weights with bfloat16
            activations are fine).
        eps: added to the mean square, finite and >= 0.
        offset: added to the weight; 0 for Llama/Mistral/Qwen2, 1.0 for Gemma (weights stored minus 1).

    Returns ``[..., hidden]`` in x's dtype. Mean square, rstd and products in float32. Differentiable in x and
    weight: the weight gradient is summed over rows in float32 and returned in weight's dtype.

    Devices: CUDA tensors run the Triton kernels; CPU tensors run them through the interpreter under
    ``TRITON_INTERPRET=1``, else the same formulas in PyTorch. Reference: :func:`rms_norm_reference`.
    """
    eps, offset = _validate(x, weight, eps, offset)
    hidden = x.shape[-1]
    x2d = x.reshape(-1, hidden)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    y, _ = _forward_op(x2d, weight if weight.stride(0) == 1 else weight.contiguous(), eps, offset)
    return y.reshape(x.shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, offset: float = 0.0):
    """Plain PyTorch RMSNorm, same signature and semantics as :func:`rms_norm`; float64 stays float64."""
    xf = x.to(compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * (offset + weight.to(xf.dtype))
    return y.to(x.dtype)


# --- op table (llm_speed.ops rows "rms_norm", "rms_norm_backward") --------------------------------------


def rms_norm_work(backward: bool = False):
    """Cost of one reported call ``(x=[rows, hidden], weight=[hidden])``: the minimum DRAM traffic (forward:
    x, weight in; y, fp32 rstd out. backward: dy, x, weight, rstd in; dx, dweight out) and FLOPs counted per
    element (forward: square, sum, two products = 4; backward: about 9 for dx and dweight together)."""

    def cost(*, x, weight, **_):
        from llm_speed.ops import Work

        rows, hidden = x.shape
        act, w = x.element_size() * rows * hidden, weight.element_size() * hidden
        if backward:
            return Work(9.0 * rows * hidden, 3 * act + 2 * w + 4 * rows, x.dtype, x.device)
        return Work(4.0 * rows * hidden, 2 * act + w + 4 * rows, x.dtype, x.device)

    return cost


def rms_norm_example(device, dtype, size: int):
    """x ``[size, size]`` (rows x hidden) and a weight."""
    return (
        torch.randn(size, size, device=device, dtype=dtype),
        torch.randn(size, device=device, dtype=dtype),
    ), {}
