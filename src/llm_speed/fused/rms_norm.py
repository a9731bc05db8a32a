"""RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019, arXiv:1910.07467) in Triton.

``y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)``; ``offset=1.0`` is Gemma's convention (its
weights are stored as a difference from 1, google-deepmind/gemma ``layers.py`` ``RMSNorm``). Statistics in
float32, one read of x and one write of y per row (the unfused PyTorch expression reads and writes the row
about five times). The backward kernel recomputes ``x * rstd`` from x and the saved per-row rstd and, like
Liger-Kernel's ``ops/rms_norm.py``, sums the weight gradient in float32 partial rows, one per program.

Layout (every op module): kernels, launcher (configuration, plans, launch), op registration, autograd, public
function; the plain-PyTorch spec is :func:`llm_speed.fused.reference.rms_norm_reference`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..core import runtime, tensors
from ..core.args import check_real
from ..core.config import KernelConfig
from ..core.dispatch import Op
from ..core.hardware import Hardware, hardware_of
from ..core.kernel_math import cast, rne_by_hand
from ..core.launch import Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.tensors import check_same_device, check_tensor
from .reference import compute_dtype

# --- kernels --------------------------------------------------------------------------------------------


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
    p_x = x_ptr + o_r[:, None] * stride_x + o_h[None, :]
    b_x = tl.load(p_x, mask=m, other=0.0).to(tl.float32)  # [BR, BH]
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


# --- launcher -------------------------------------------------------------------------------------------

FORWARD = Kernel(_rms_norm_fwd_kernel, "rms_norm_fwd")
BACKWARD = Kernel(_rms_norm_bwd_kernel, "rms_norm_bwd")
ROW_BLOCK_ELEMENTS = 4096  # forward: rows per program so that a program holds about this many elements
INTERPRETER_PROGRAMS = 4  # backward under the interpreter, which runs programs one after another


def _num_warps(elements: int) -> int:
    return min(16, max(1, elements // 256))


@functools.cache
def forward_config(rows: int, hidden: int) -> KernelConfig:
    """``block_m`` rows of ``block_n`` (hidden padded to a power of two) elements per program."""
    block_h = next_power_of_2(hidden)
    block_r = min(next_power_of_2(rows), max(1, ROW_BLOCK_ELEMENTS // block_h))
    return KernelConfig(block_r, block_h, num_warps=_num_warps(block_r * block_h), num_stages=1)


@functools.cache
def backward_config(rows: int, hidden: int, hardware: Hardware, interpreted: bool) -> KernelConfig:
    """One row at a time; ``splits`` programs, one per SM (each writes one float32 weight-gradient
    partial)."""
    block_h = next_power_of_2(hidden)
    programs = max(1, min(rows, INTERPRETER_PROGRAMS if interpreted else hardware.sm_count))
    programs = cdiv(rows, cdiv(rows, programs))  # no program without rows
    return KernelConfig(1, block_h, num_warps=_num_warps(block_h), num_stages=1, splits=programs)


@plan_cache
def _forward_plan(rows: int, hidden: int, stride_x: int, dtypes: tuple, device: torch.device) -> Plan:
    cfg = forward_config(rows, hidden)
    dtype = dtypes[0]
    return FORWARD.plan(
        (cdiv(rows, cfg.block_m),), stride_x=stride_x, stride_y=hidden, rows=rows, hidden=hidden,
        BLOCK_R=cfg.block_m, BLOCK_H=cfg.block_n, RNE_BY_HAND=rne_by_hand(dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


@plan_cache
def _backward_plan(rows: int, hidden: int, strides: tuple, dtypes: tuple, device: torch.device) -> Plan:
    cfg = backward_config(rows, hidden, hardware_of(device), runtime.INTERPRETED)
    dtype = dtypes[1]
    stride_dy, stride_x = strides
    return BACKWARD.plan(
        (cfg.splits,), stride_dy=stride_dy, stride_x=stride_x, stride_dx=hidden, rows=rows,
        rows_per_program=cdiv(rows, cfg.splits), hidden=hidden, BLOCK_H=cfg.block_n,
        RNE_BY_HAND=rne_by_hand(dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


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


def forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float):
    """(y, rstd float32 [rows]) of rows ``x2d`` [rows, hidden] (last dim contiguous); reports its work."""
    rows, hidden = x2d.shape
    if rows:
        runtime.report_work("rms_norm", x=x2d, weight=weight)
    if rows == 0 or not runtime.triton_runs_on(x2d.device):
        return _forward_torch(x2d, weight, eps, offset)
    y = tensors.new_output((rows, hidden), x2d.dtype, x2d.device)
    rstd = tensors.new_output((rows,), torch.float32, x2d.device)
    _forward_plan(rows, hidden, x2d.stride(0), (x2d.dtype, weight.dtype), x2d.device).launch(
        x_ptr=x2d, w_ptr=weight, y_ptr=y, rstd_ptr=rstd, eps=eps, offset=offset
    )
    return y, rstd


def backward(dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float):
    """(dx, dweight) of :func:`forward`; reports its work."""
    rows, hidden = x2d.shape
    dy = tensors.last_dim_contiguous(dy)
    if rows:
        runtime.report_work("rms_norm_backward", x=x2d, weight=weight)
    if rows == 0 or not runtime.triton_runs_on(x2d.device):
        return _backward_torch(dy, x2d, weight, rstd, offset)
    dtypes = (dy.dtype, x2d.dtype, weight.dtype, rstd.dtype)
    plan = _backward_plan(rows, hidden, (dy.stride(0), x2d.stride(0)), dtypes, x2d.device)
    dx = tensors.new_output((rows, hidden), x2d.dtype, x2d.device)
    # every program writes its whole partial row; the columns past hidden are never read
    dw_partial = tensors.new_output((plan.grid[0], plan.fixed["BLOCK_H"]), torch.float32, x2d.device)
    plan.launch(dy_ptr=dy, x_ptr=x2d, w_ptr=weight, rstd_ptr=rstd, dx_ptr=dx, dw_partial_ptr=dw_partial,
                offset=offset)  # fmt: skip
    return dx, dw_partial[:, :hidden].sum(0).to(weight.dtype)


# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::rms_norm_forward", mutates_args=())
def _forward_op(
    x2d: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(x2d, weight, eps, offset)


@_forward_op.register_fake
def _forward_fake(x2d, weight, eps, offset):
    return torch.empty_like(x2d), x2d.new_empty((x2d.shape[0],), dtype=torch.float32)


@torch.library.custom_op("llm_speed::rms_norm_backward", mutates_args=())
def _backward_op(
    dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, offset: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return backward(dy, x2d, weight, rstd, offset)


@_backward_op.register_fake
def _backward_fake(dy, x2d, weight, rstd, offset):
    return torch.empty_like(x2d), torch.empty_like(weight)


_backward_call = Op(_backward_op, backward)


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x2d, weight, _, offset = inputs
    ctx.save_for_backward(x2d, weight, output[1])
    ctx.offset = offset


def _backward(ctx, dy, _drstd):
    x2d, weight, rstd = ctx.saved_tensors
    dx, dw = _backward_call(dy, x2d, weight, rstd, ctx.offset)
    return dx, dw, None, None


_forward_call = Op(_forward_op, forward, setup_context=_setup_context, backward=_backward)


# --- public function ------------------------------------------------------------------------------------


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
    ``TRITON_INTERPRET=1``, else the same formulas in PyTorch. Reference:
    :func:`llm_speed.fused.reference.rms_norm_reference`.
    """
    eps, offset = _validate(x, weight, eps, offset)
    hidden = x.shape[-1]
    x2d = tensors.last_dim_contiguous(x.reshape(-1, hidden))
    weight = tensors.last_dim_contiguous(weight)
    y, _ = _forward_call(x2d, weight, eps, offset)
    return y.reshape(x.shape)
