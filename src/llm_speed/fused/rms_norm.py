"""RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019, arXiv:1910.07467) in Triton.

``y = x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)``; ``offset=1.0`` is Gemma's convention (its
weights are stored as a difference from 1, google-deepmind/gemma ``layers.py`` ``RMSNorm``). Statistics in
float32, one read of x and one write of y per row (the unfused PyTorch expression reads and writes the row
about five times). The backward kernel recomputes ``x * rstd`` from x and the saved per-row rstd and, like
Liger-Kernel's ``ops/rms_norm.py``, sums the weight gradient in float32 partial rows, one per program; a
second kernel sums their columns and rounds once to the weight's dtype.

Layout (every op module): kernels, launcher (configuration, plans, launch), op registration, autograd, public
function; the plain-PyTorch spec is :func:`llm_speed.fused.reference.rms_norm_reference`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..core import autocast, runtime, tensors
from ..core.args import check_choice, check_flag, check_real
from ..core.config import KernelConfig
from ..core.dispatch import INFERENCE, Op, plain_call
from ..core.hardware import Hardware, hardware_of
from ..core.kernel_math import cast, rne_by_hand
from ..core.launch import CallCache, Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.tensors import check_same_device, check_tensor, internal_overlap
from .reference import compute_dtype

# --- kernels --------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, stride_x, stride_y, rows, hidden, eps, offset,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, HAS_WEIGHT: tl.constexpr, LLAMA: tl.constexpr,
    RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    # BLOCK_R rows per program: narrow rows (small hidden) would leave most of a program idle
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_h = tl.arange(0, BLOCK_H)
    m_r = o_r < rows
    m = m_r[:, None] & (o_h < hidden)[None, :]
    p_x = x_ptr + o_r[:, None] * stride_x + o_h[None, :]
    b_x = tl.load(p_x, mask=m, other=0.0)
    b_xf = b_x.to(tl.float32)  # [BR, BH]
    b_rstd = 1.0 / tl.sqrt(tl.sum(b_xf * b_xf, axis=1) / hidden + eps)  # [BR]
    b_y = b_xf * b_rstd[:, None]
    if LLAMA:  # Llama's casting: the normalised x rounded to x's dtype before the weight multiplies it
        b_y = cast(b_y, x_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND).to(tl.float32)
    if HAS_WEIGHT:
        b_w = tl.load(w_ptr + o_h, mask=o_h < hidden, other=0.0).to(tl.float32)
        b_y = b_y * (offset + b_w)[None, :]
    b_y = cast(b_y, y_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND)
    tl.store(y_ptr + o_r[:, None] * stride_y + o_h[None, :], b_y, mask=m)
    if rstd_ptr is not None:  # (None: an inference call, no backward to read it)
        tl.store(rstd_ptr + o_r, b_rstd, mask=m_r)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, stride_dy, stride_x, stride_dx,
    rows, rows_per_program, hidden, offset,
    BLOCK_H: tl.constexpr, HAS_WEIGHT: tl.constexpr, LLAMA: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """dx (which may be dy itself: each row is read, then written) and, with a weight, the float32 partial
    sums of dweight of this program's rows."""
    pid = tl.program_id(0)
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h < hidden
    if HAS_WEIGHT:
        b_w = tl.load(w_ptr + o_h, mask=m_h, other=0.0).to(tl.float32) + offset
    b_dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, rows)  # every program has a row (the launcher's grid)
    # 64-bit row offsets (row * stride can pass 2**31 elements)
    p_dx = dx_ptr + row_start.to(tl.int64) * stride_dx
    x_ty = x_ptr.dtype.element_ty
    # Each step loads the next row before this row's reduction, so those loads are in flight while its
    # barriers run (the last step reloads its own row: nothing past the program's rows is read). A row read
    # is never one dx has been written over (in place, dx is dy): rows only move forward.
    b_x_next = tl.load(x_ptr + row_start.to(tl.int64) * stride_x + o_h, mask=m_h, other=0.0)
    b_dy_next = tl.load(dy_ptr + row_start.to(tl.int64) * stride_dy + o_h, mask=m_h, other=0.0)
    rstd_next = tl.load(rstd_ptr + row_start)
    for row in range(row_start, row_end):
        b_x = b_x_next.to(tl.float32)  # [BH]
        b_dy = b_dy_next.to(tl.float32)
        rstd = rstd_next
        following = tl.minimum(row + 1, row_end - 1).to(tl.int64)
        b_x_next = tl.load(x_ptr + following * stride_x + o_h, mask=m_h, other=0.0)
        b_dy_next = tl.load(dy_ptr + following * stride_dy + o_h, mask=m_h, other=0.0)
        rstd_next = tl.load(rstd_ptr + following)
        b_xhat = b_x * rstd
        if HAS_WEIGHT:
            b_g = b_dy * b_w  # gradient with respect to xhat
            if LLAMA:  # as autograd through Llama's module: the gradient of the rounded xhat, in x's dtype
                b_g = cast(b_g, x_ty, RNE_BY_HAND=RNE_BY_HAND).to(tl.float32)
                b_dw += b_dy * cast(b_xhat, x_ty, RNE_BY_HAND=RNE_BY_HAND).to(tl.float32)
            else:
                b_dw += b_dy * b_xhat
        else:
            b_g = b_dy
        # d/dx of x * rstd(x): rstd * (g - xhat * mean(g * xhat))
        b_dx = rstd * (b_g - b_xhat * (tl.sum(b_g * b_xhat, axis=0) / hidden))
        tl.store(p_dx + o_h, cast(b_dx, dx_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m_h)
        p_dx += stride_dx
    if HAS_WEIGHT:
        tl.store(dw_partial_ptr + pid * BLOCK_H + o_h, b_dw, mask=m_h)


@triton.jit
def _rms_norm_dw_kernel(
    partial_ptr, dw_ptr, programs, hidden, stride_p,
    BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """dweight: the column sums of the backward's float32 partial rows, rounded once to the weight's dtype
    (one launch where ``partial.sum(0).to(dtype)`` took two)."""
    o_h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < hidden
    b_dw = tl.zeros([BLOCK_H], dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        o_p = start + tl.arange(0, BLOCK_P)
        m = (o_p < programs)[:, None] & m_h[None, :]
        b_part = tl.load(partial_ptr + o_p[:, None] * stride_p + o_h[None, :], mask=m, other=0.0)
        b_dw += tl.sum(b_part, axis=0)
    tl.store(dw_ptr + o_h, cast(b_dw, dw_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m_h)


# --- launcher -------------------------------------------------------------------------------------------

FORWARD = Kernel(_rms_norm_fwd_kernel, "rms_norm_fwd")
BACKWARD = Kernel(_rms_norm_bwd_kernel, "rms_norm_bwd")
WEIGHT_GRAD = Kernel(_rms_norm_dw_kernel, "rms_norm_dw")
ROW_BLOCK_ELEMENTS = 4096  # forward: rows per program so that a program holds about this many elements
INTERPRETER_PROGRAMS = 4  # backward under the interpreter, which runs programs one after another
WEIGHT_GRAD_COLUMNS = 64  # the weight gradient's reduction: columns (and partial rows) per program's tile
CASTINGS = ("float32", "llama")


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
def _forward_plan(
    rows: int, hidden: int, stride_x: int, dtypes: tuple, llama: bool, device: torch.device, rstd: bool = True
) -> Plan:  # fmt: skip
    """dtypes: x, weight (None without one). ``rstd`` False: rstd is not stored (its pointer compiled out;
    no ``rstd_ptr`` per call)."""
    cfg = forward_config(rows, hidden)
    return FORWARD.plan(
        (cdiv(rows, cfg.block_m),), stride_x=stride_x, stride_y=hidden, rows=rows, hidden=hidden,
        BLOCK_R=cfg.block_m, BLOCK_H=cfg.block_n, HAS_WEIGHT=dtypes[1] is not None, LLAMA=llama,
        RNE_BY_HAND=rne_by_hand(dtypes[0]), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if rstd else {"rstd_ptr": None}),
    )  # fmt: skip


@plan_cache
def _backward_plan(
    rows: int, hidden: int, strides: tuple, dtypes: tuple, llama: bool, device: torch.device
) -> tuple[Plan, Plan | None]:  # fmt: skip
    """The backward's plan and, with a weight, its weight gradient's (the partial rows' column sums).
    strides: dy, x, dx rows. dtypes: dy, x, weight (None without one), rstd."""
    cfg = backward_config(rows, hidden, hardware_of(device), runtime.INTERPRETED)
    stride_dy, stride_x, stride_dx = strides
    backward = BACKWARD.plan(
        (cfg.splits,), stride_dy=stride_dy, stride_x=stride_x, stride_dx=stride_dx, rows=rows,
        rows_per_program=cdiv(rows, cfg.splits), hidden=hidden, BLOCK_H=cfg.block_n,
        HAS_WEIGHT=dtypes[2] is not None, LLAMA=llama, RNE_BY_HAND=rne_by_hand(dtypes[1]),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if dtypes[2] is None:
        return backward, None
    # Columns per program: 64 gives 64 programs at hidden 4096, each summing the partial rows in tiles of
    # up to 64 x 64 floats (16 KB in flight per program).
    block_h = min(WEIGHT_GRAD_COLUMNS, cfg.block_n)
    weight_grad = WEIGHT_GRAD.plan(
        (cdiv(hidden, block_h),), programs=cfg.splits, hidden=hidden, stride_p=cfg.block_n,
        BLOCK_P=min(WEIGHT_GRAD_COLUMNS, next_power_of_2(cfg.splits)), BLOCK_H=block_h,
        RNE_BY_HAND=rne_by_hand(dtypes[2]), num_warps=4, num_stages=1,
    )  # fmt: skip
    return backward, weight_grad


def _forward_torch(x2d, weight, eps, offset, llama):
    ct = compute_dtype(x2d.dtype)
    xf = x2d.to(ct)
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)
    y = xf * rstd[:, None]
    if llama:
        y = y.to(x2d.dtype).to(ct)
    if weight is not None:
        y = y * (offset + weight.to(ct))
    return y.to(x2d.dtype), rstd.float()


def _backward_torch(dy, x2d, weight, rstd, offset, llama):
    ct = compute_dtype(x2d.dtype)
    xhat = x2d.to(ct) * rstd.to(ct)[:, None]
    g = dy.to(ct)
    dw = None
    if weight is not None:
        g = g * (offset + weight.to(ct))
        if llama:
            g = g.to(x2d.dtype).to(ct)
        dw = (dy.to(ct) * (xhat.to(x2d.dtype).to(ct) if llama else xhat)).sum(0)
    dx = rstd.to(ct)[:, None] * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    return dx.to(x2d.dtype), (x2d.new_empty(0) if dw is None else dw.to(weight.dtype))


def forward(
    x2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, llama: bool, in_place: bool
):  # fmt: skip
    """(y, rstd float32 [rows]) of rows ``x2d`` [rows, hidden] (last dim contiguous); reports its work.
    ``in_place`` is the backward's (see :func:`rms_norm`)."""
    rows = x2d.shape[0]
    if rows == 0 or not runtime.triton_runs_on(x2d.device):
        if rows:
            runtime.report_work("rms_norm", x=x2d, weight=weight)
        return _forward_torch(x2d, weight, eps, offset, llama)
    return _launch_forward(_plan_of(x2d, weight, llama), x2d, weight, eps, offset)


def _plan_of(x2d, weight, llama: bool, rstd: bool = True) -> Plan:
    """The forward plan of rows ``x2d`` (and ``weight``); ``rstd`` False: one that stores no rstd."""
    dtypes = (x2d.dtype, None if weight is None else weight.dtype)
    return _forward_plan(*x2d.shape, x2d.stride(0), dtypes, llama, x2d.device, rstd)


def _launch_forward(plan: Plan, x2d, weight, eps: float, offset: float):
    """Report the work, allocate (y, rstd) and launch ``plan`` (:func:`forward`'s Triton path); rstd None
    when the plan stores none."""
    rows, hidden = x2d.shape
    runtime.report_work("rms_norm", x=x2d, weight=weight)
    y = tensors.new_output((rows, hidden), x2d.dtype, x2d.device)
    w = x2d if weight is None else weight  # (without a weight: never read)
    if "rstd_ptr" in plan.fixed:  # an inference plan
        plan.launch(x_ptr=x2d, w_ptr=w, y_ptr=y, eps=eps, offset=offset)
        return y, None
    rstd = tensors.new_output((rows,), torch.float32, x2d.device)
    plan.launch(x_ptr=x2d, w_ptr=w, y_ptr=y, rstd_ptr=rstd, eps=eps, offset=offset)
    return y, rstd


def _backward_into(dx, dy, x2d, weight, rstd, offset, llama):
    """dx (a new tensor, or dy itself) and dweight (empty without a weight) of :func:`forward`."""
    rows, hidden = x2d.shape
    if rows == 0 or not runtime.triton_runs_on(x2d.device):
        dx_torch, dw = _backward_torch(dy, x2d, weight, rstd, offset, llama)
        dx.copy_(dx_torch)
        return dx, dw
    dtypes = (dy.dtype, x2d.dtype, None if weight is None else weight.dtype, rstd.dtype)
    strides = (dy.stride(0), x2d.stride(0), dx.stride(0))
    plan, weight_grad = _backward_plan(rows, hidden, strides, dtypes, llama, x2d.device)
    if weight is None:
        plan.launch(dy_ptr=dy, x_ptr=x2d, w_ptr=rstd, rstd_ptr=rstd, dx_ptr=dx, dw_partial_ptr=rstd,
                    offset=offset)  # fmt: skip
        return dx, x2d.new_empty(0)
    # every program writes its whole partial row; the columns past hidden are never read
    dw_partial = tensors.new_output((plan.grid[0], plan.fixed["BLOCK_H"]), torch.float32, x2d.device)
    plan.launch(dy_ptr=dy, x_ptr=x2d, w_ptr=weight, rstd_ptr=rstd, dx_ptr=dx, dw_partial_ptr=dw_partial,
                offset=offset)  # fmt: skip
    dw = tensors.new_output((hidden,), weight.dtype, x2d.device)
    weight_grad.launch(partial_ptr=dw_partial, dw_ptr=dw)
    return dx, dw


def backward(
    dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, offset: float,
    llama: bool,
):  # fmt: skip
    """(dx, dweight) of :func:`forward` (dweight empty without a weight); reports its work."""
    rows, hidden = x2d.shape
    dy = tensors.last_dim_contiguous(dy)
    if rows:
        runtime.report_work("rms_norm_backward", x=x2d, weight=weight)
    dx = tensors.new_output((rows, hidden), x2d.dtype, x2d.device)
    return _backward_into(dx, dy, x2d, weight, rstd, offset, llama)


def backward_in_place(
    dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, offset: float,
    llama: bool,
) -> torch.Tensor:  # fmt: skip
    """dweight of :func:`forward` (empty without a weight), dx written over ``dy`` (which must have x's
    dtype, rows of ``hidden`` and a contiguous last dim); reports its work."""
    rows, _ = x2d.shape
    if rows:
        runtime.report_work("rms_norm_backward", x=x2d, weight=weight)
    return _backward_into(dy, dy, x2d, weight, rstd, offset, llama)[1]


def can_write_into(dy: torch.Tensor, x2d: torch.Tensor) -> bool:
    """Whether dx can be written over dy: same dtype and shape, a contiguous last dim, and each element held
    once (a reduction's backward hands an expanded dy, rows sharing memory)."""
    return (dy.dtype == x2d.dtype and dy.shape == x2d.shape and (dy.stride(-1) == 1 or dy.shape[-1] <= 1)
            and not internal_overlap(dy))  # fmt: skip


# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::rms_norm_forward", mutates_args=())
def _forward_op(
    x2d: torch.Tensor, weight: torch.Tensor | None, eps: float, offset: float, llama: bool, in_place: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(x2d, weight, eps, offset, llama, in_place)


@_forward_op.register_fake
def _forward_fake(x2d, weight, eps, offset, llama, in_place):
    return torch.empty_like(x2d), x2d.new_empty((x2d.shape[0],), dtype=torch.float32)


@torch.library.custom_op("llm_speed::rms_norm_backward", mutates_args=())
def _backward_op(
    dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, offset: float,
    llama: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    return backward(dy, x2d, weight, rstd, offset, llama)


@_backward_op.register_fake
def _backward_fake(dy, x2d, weight, rstd, offset, llama):
    return torch.empty_like(x2d), (x2d.new_empty(0) if weight is None else torch.empty_like(weight))


@torch.library.custom_op("llm_speed::rms_norm_backward_in_place", mutates_args=("dy",))
def _backward_in_place_op(
    dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor | None, rstd: torch.Tensor, offset: float,
    llama: bool,
) -> torch.Tensor:
    return backward_in_place(dy, x2d, weight, rstd, offset, llama)


@_backward_in_place_op.register_fake
def _backward_in_place_fake(dy, x2d, weight, rstd, offset, llama):
    return x2d.new_empty(0) if weight is None else torch.empty_like(weight)


# Under torch.autocast (core.autocast): float32, as F.rms_norm on autocast's float32 list; the backward runs
# in the dtypes its forward saved.
_backward_call = autocast.dispatch(Op(_backward_op, backward), autocast.KEEP)
_backward_in_place_call = autocast.dispatch(Op(_backward_in_place_op, backward_in_place), autocast.KEEP)


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    x2d, weight, _, offset, llama, in_place = inputs
    ctx.save_for_backward(x2d, weight, output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.offset, ctx.llama, ctx.in_place = offset, llama, in_place


def _backward(ctx, dy, _drstd):
    x2d, weight, rstd = ctx.saved_tensors
    if ctx.in_place and can_write_into(dy, x2d):
        dw = _backward_in_place_call(dy, x2d, weight, rstd, ctx.offset, ctx.llama)
        dx = dy
    else:
        dx, dw = _backward_call(dy, x2d, weight, rstd, ctx.offset, ctx.llama)
    return dx, (dw if weight is not None else None), None, None, None, None


_forward_plain = Op(_forward_op, forward, setup_context=_setup_context, backward=_backward)
_forward_call = autocast.dispatch(_forward_plain, autocast.FLOAT32, (0, 1))


# --- public function ------------------------------------------------------------------------------------


def _validate(x, weight, eps, offset, casting, in_place):
    check_tensor("x", x)
    if x.dim() < 1:
        raise ValueError("x must have at least 1 dim [..., hidden], got a 0-dim tensor")
    if x.shape[-1] == 0:
        raise ValueError("x's last dim (hidden) must be at least 1")
    offset = check_real("offset", offset)
    if weight is None:
        if offset != 0.0:
            raise ValueError(f"offset ({offset}) scales a weight; without a weight it must be 0.0")
    else:
        check_tensor("weight", weight, dims=1, what="[hidden]")
        if weight.shape[0] != x.shape[-1]:
            raise ValueError(
                f"weight has {weight.shape[0]} elements; it must match x's last dim ({x.shape[-1]})"
            )
        check_same_device(x=x, weight=weight)
    check_choice("casting", casting, CASTINGS)
    return check_real("eps", eps, minimum=0.0), offset, casting == "llama", check_flag("in_place", in_place)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "float32",
    in_place: bool = False,
) -> torch.Tensor:
    """RMSNorm over the last dim: ``x * rsqrt(mean(x^2, -1) + eps) * (offset + weight)``.

    Args:
        x: ``[..., hidden]``, any leading shape, float16, bfloat16 or float32. A non-contiguous last dim (or
            leading dims that cannot be flattened without a copy) is copied first.
        weight: ``[hidden]``, float16, bfloat16 or float32 (need not match x: float32 weights with bfloat16
            activations are fine), or None: no scale (``x * rsqrt(mean(x^2) + eps)``, OLMo's and T5's
            weightless norms).
        eps: added to the mean square, finite and >= 0.
        offset: added to the weight; 0 for Llama/Mistral/Qwen, 1.0 for Gemma (weights stored minus 1). 0.0
            without a weight.
        casting: ``"float32"`` (default; Gemma's, Liger's ``casting_mode="gemma"``): everything in
            float32, one rounding at the end. ``"llama"`` (Llama's module, Liger's
            ``casting_mode="llama"``): the normalised x is rounded to x's dtype before the weight multiplies
            it, and the backward differentiates that expression as autograd would. The two differ only for
            16-bit x.
        in_place: the backward writes dx over the output gradient instead of a new tensor (saves one
            ``[rows, hidden]`` buffer; Liger's ``in_place``). Only safe when nothing else reads that gradient:
            the gradient of a norm whose output feeds linear layers is (pre-norm blocks, the final norm); the
            gradient reaching a post-norm through a residual sum is shared with the residual branch, and would
            be overwritten (Gemma-2/3's and OLMo-2's post-norms: leave it False there), and so is a gradient
            the caller holds: ``y.backward(g)`` or ``torch.autograd.grad(y, x, g)`` overwrite ``g`` (a second
            backward with it then differs). Ignored where dy's dtype or layout does not fit or it holds an
            element twice (an expanded gradient: a new tensor is written then), and under ``torch.compile``.

    Returns ``[..., hidden]`` in x's dtype. Mean square, rstd and products in float32. Differentiable in x and
    weight: the weight gradient is summed over rows in float32 and returned in weight's dtype.

    Under ``torch.autocast`` x and weight are computed in float32 and the output is float32, as
    ``torch.nn.functional.rms_norm`` (on CUDA autocast's float32 list) does on CUDA; under CPU autocast too,
    where PyTorch's ``rms_norm`` keeps 16-bit inputs in their dtype.

    Devices: CUDA tensors run the Triton kernels; CPU tensors run them through the interpreter under
    ``TRITON_INTERPRET=1``, else the same formulas in PyTorch. Reference:
    :func:`llm_speed.fused.reference.rms_norm_reference`.
    """
    known = None  # the key of a call that _RMS_NORM_CALLS may serve
    if (
        type(eps) is float and 0.0 <= eps < math.inf
        and type(offset) is float and -math.inf < offset < math.inf
        and type(casting) is str and (in_place is True or in_place is False)
        and (mode := plain_call(x, optional=(weight,)))
    ):  # fmt: skip
        known = _rms_norm_call_key(x, weight, casting, offset, mode)
        kept = _RMS_NORM_CALLS.get(known)
        if kept is not None:
            x2d, weight = _rows_of(x, weight)
            if mode == INFERENCE:
                y, _ = _launch_forward(kept, x2d, weight, eps, offset)
            else:  # with grad: the op's autograd node around the kept launch
                y, _ = _forward_plain.checked(kept, x2d, weight, eps, offset, casting == "llama", in_place)
            return y if x.dim() == 2 else y.reshape(x.shape)
    eps, offset, llama, in_place = _validate(x, weight, eps, offset, casting, in_place)
    x2d, weight = _rows_of(x, weight)
    keep = known is not None and x2d.shape[0] and runtime.triton_runs_on(x.device)
    if keep and mode == INFERENCE:
        # what the op would launch, but with no rstd stored (no backward reads it), kept for the next call
        plan = _plan_of(x2d, weight, llama, rstd=False)
        _RMS_NORM_CALLS.put(known, plan)
        y, _ = _launch_forward(plan, x2d, weight, eps, offset)
    else:
        y, _ = _forward_call(x2d, weight, eps, offset, llama, in_place)
        if keep:  # with grad: the launch of forward(), for Op.checked
            _RMS_NORM_CALLS.put(known, functools.partial(_launch_kept, _plan_of(x2d, weight, llama)))
    return y if x.dim() == 2 else y.reshape(x.shape)


def _launch_kept(plan: Plan, x2d, weight, eps: float, offset: float, llama: bool, in_place: bool):
    """:func:`forward` of a call kept in :data:`_RMS_NORM_CALLS` with grad (the op's arguments)."""
    return _launch_forward(plan, x2d, weight, eps, offset)


def _rows_of(x: torch.Tensor, weight):
    """(x as [rows, hidden] with a contiguous last dim, weight with a contiguous last dim)."""
    x2d = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    return tensors.last_dim_contiguous(x2d), weight if weight is None else tensors.last_dim_contiguous(weight)


# Calls whose metadata passed every check before: a repeated call with the same metadata skips the checks and
# the op's layers (rows, report, outputs and launch remain). Inference calls keep their plan, calls with grad
# the launch Op.checked runs inside the op's autograd node.
_RMS_NORM_CALLS = CallCache()


def _rms_norm_call_key(x, weight, casting: str, offset: float, mode: int) -> tuple:
    """The key of :data:`_RMS_NORM_CALLS`: everything the checks and the plan read (the offset only as
    given or not: without a weight it must be 0), and the :func:`plain_call` mode (an inference plan stores
    no rstd)."""
    weight_key = None if weight is None else (weight.shape, weight.stride(), weight.dtype, weight.device)
    return x.shape, x.stride(), x.dtype, x.device, casting, offset != 0.0, weight_key, mode
