"""Rotary position embedding (Su et al., "RoFormer", 2021, arXiv:2104.09864) applied in one Triton pass.

Each pair ``(x1, x2)`` of the first ``rotary_dim`` dims of a head is rotated by its angle:
``(x1 cos - x2 sin, x2 cos + x1 sin)``. Pairs are ``(i, i + rotary_dim/2)`` by default (GPT-NeoX / Llama
"rotate half", huggingface/transformers ``rotate_half``) or ``(2i, 2i+1)`` with ``interleaved=True`` (GPT-J,
the paper's layout). Dims past ``rotary_dim`` are copied. The backward is the rotation by the opposite angle,
the same kernel with ``sin`` negated (``CONJUGATE``).

Layout as :mod:`llm_speed.fused.rms_norm`: kernels, launcher, op registration, autograd, public function; the
plain-PyTorch spec is :func:`llm_speed.fused.reference.apply_rotary_reference`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..core import autocast, runtime, tensors
from ..core.args import check_flag
from ..core.config import KernelConfig
from ..core.dispatch import Op
from ..core.kernel_math import cast, rne_by_hand
from ..core.launch import Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.tensors import check_same_device, check_tensor
from .reference import rotate

# --- kernels --------------------------------------------------------------------------------------------


@triton.jit
def _rotary_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr,
    stride_xb, stride_xh, stride_xs, stride_cb, stride_cs, stride_ob, stride_oh, stride_os,
    batch, heads, seq, half, head_dim,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
    INTERLEAVED: tl.constexpr, CONJUGATE: tl.constexpr, HAS_PASS: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    # BLOCK_R rows of (batch, head, position) per program, flattened in that order
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    i_b = o_r // (heads * seq)
    i_h = (o_r // seq) % heads
    i_s = o_r % seq
    o_j = tl.arange(0, BLOCK_HALF)
    m_s = o_r < batch * heads * seq
    m = m_s[:, None] & (o_j < half)[None, :]  # [BR, BHALF]
    p_x = x_ptr + (i_b * stride_xb + i_h * stride_xh + i_s * stride_xs)[:, None]
    p_o = out_ptr + (i_b * stride_ob + i_h * stride_oh + i_s * stride_os)[:, None]
    p_c = (i_b * stride_cb + i_s * stride_cs)[:, None] + o_j[None, :]
    b_cos = tl.load(cos_ptr + p_c, mask=m, other=0.0).to(tl.float32)
    b_sin = tl.load(sin_ptr + p_c, mask=m, other=0.0).to(tl.float32)
    if CONJUGATE:
        b_sin = -b_sin
    if INTERLEAVED:
        o_1 = 2 * o_j
        o_2 = 2 * o_j + 1
    else:
        o_1 = o_j
        o_2 = o_j + half
    b_x1 = tl.load(p_x + o_1[None, :], mask=m, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x + o_2[None, :], mask=m, other=0.0).to(tl.float32)
    b_o1 = b_x1 * b_cos - b_x2 * b_sin
    b_o2 = b_x2 * b_cos + b_x1 * b_sin
    out_ty = out_ptr.dtype.element_ty
    tl.store(p_o + o_1[None, :], cast(b_o1, out_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)
    tl.store(p_o + o_2[None, :], cast(b_o2, out_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)
    if HAS_PASS:
        o_p = 2 * half + tl.arange(0, BLOCK_PASS)
        m_p = m_s[:, None] & (o_p < head_dim)[None, :]
        tl.store(p_o + o_p[None, :], tl.load(p_x + o_p[None, :], mask=m_p), mask=m_p)


# --- launcher -------------------------------------------------------------------------------------------

KERNEL = Kernel(_rotary_kernel, "rotary")  # forward and backward are the same kernel
ROW_BLOCK_ELEMENTS = 4096  # rows per program so that a program holds about this many pairs


@functools.cache
def config(rows: int, half: int) -> KernelConfig:
    """``block_m`` rows (one head at one position each) of ``block_n`` pairs (half padded to a power of two)
    per program."""
    block_half = next_power_of_2(half)
    block_r = max(1, min(next_power_of_2(rows), ROW_BLOCK_ELEMENTS // block_half))
    return KernelConfig(block_r, block_half, num_warps=4, num_stages=1)


@plan_cache
def _plan(
    shape: tuple, half: int, x_strides: tuple, cos_strides: tuple, interleaved: bool, conjugate: bool,
    dtypes: tuple, device: torch.device,
) -> Plan:  # fmt: skip
    batch, heads, seq, head_dim = shape
    rows = batch * heads * seq
    cfg = config(rows, half)
    stride_cb, stride_cs = cos_strides
    return KERNEL.plan(
        (cdiv(rows, cfg.block_m),),
        stride_xb=x_strides[0], stride_xh=x_strides[1], stride_xs=x_strides[2],
        stride_cb=stride_cb, stride_cs=stride_cs,
        stride_ob=heads * seq * head_dim, stride_oh=seq * head_dim, stride_os=head_dim,
        batch=batch, heads=heads, seq=seq, half=half, head_dim=head_dim,
        BLOCK_R=cfg.block_m, BLOCK_HALF=cfg.block_n, BLOCK_PASS=next_power_of_2(max(1, head_dim - 2 * half)),
        INTERLEAVED=interleaved, CONJUGATE=conjugate, HAS_PASS=head_dim > 2 * half,
        RNE_BY_HAND=rne_by_hand(dtypes[0]), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def forward(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, conjugate: bool
) -> torch.Tensor:
    """x ``[batch, heads, seq, head_dim]`` rotated by cos/sin ``[(batch,) seq, half]`` (by the opposite angle
    when ``conjugate``: the backward), a new contiguous tensor; reports its work."""
    if x.numel():  # the backward is this op with the opposite angle: reported under the same row
        runtime.report_work("apply_rotary", x=x, cos=cos)
    if x.numel() == 0 or not runtime.triton_runs_on(x.device):
        return rotate(x, cos, sin, interleaved, conjugate)
    x = tensors.last_dim_contiguous(x)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:  # the kernel reads both with cos's strides
        cos, sin = cos.contiguous(), sin.contiguous()
    shape = x.shape
    # cos [batch, seq, half] steps per sequence; [seq, half] and a batch of 1 broadcast
    cos_strides = (cos.stride(0) if cos.dim() == 3 and cos.shape[0] == shape[0] else 0, cos.stride(-2))
    plan = _plan(
        shape, cos.shape[-1], x.stride()[:3], cos_strides, interleaved, conjugate,
        (x.dtype, cos.dtype, sin.dtype), x.device,
    )  # fmt: skip
    out = tensors.new_output(shape, x.dtype, x.device)
    plan.launch(x_ptr=x, cos_ptr=cos, sin_ptr=sin, out_ptr=out)
    return out


# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::rotary", mutates_args=())
def _rotary_op(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, conjugate: bool
) -> torch.Tensor:
    return forward(x, cos, sin, interleaved, conjugate)


@_rotary_op.register_fake
def _rotary_fake(x, cos, sin, interleaved, conjugate):
    return x.new_empty(x.shape)


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    _, cos, sin, interleaved, conjugate = inputs
    ctx.save_for_backward(cos, sin)
    ctx.interleaved, ctx.conjugate = interleaved, conjugate


def _backward(ctx, dout):
    cos, sin = ctx.saved_tensors
    # The rotation is orthogonal: its gradient is the rotation by the opposite angle (differentiable again).
    return _rotary_call(dout, cos, sin, ctx.interleaved, not ctx.conjugate), None, None, None, None


# Under torch.autocast (core.autocast): no cast (an elementwise op, on none of autocast's lists).
_rotary_call = autocast.dispatch(
    Op(_rotary_op, forward, setup_context=_setup_context, backward=_backward), autocast.KEEP
)


# --- public function ------------------------------------------------------------------------------------


def _validate(x, cos, sin, interleaved):
    check_tensor("x", x, dims=4, what="[batch, heads, seq, head_dim]")
    check_tensor("cos", cos)
    check_tensor("sin", sin)
    interleaved = check_flag("interleaved", interleaved)
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must have the same shape, got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    batch, _, seq, head_dim = x.shape
    if cos.dim() not in (2, 3):
        raise ValueError(
            "cos and sin must be [seq, rotary_dim // 2] or [batch, seq, rotary_dim // 2], "
            f"got {tuple(cos.shape)}"
        )
    if cos.shape[-2] != seq:
        raise ValueError(f"cos and sin cover {cos.shape[-2]} positions; x has seq {seq}")
    if cos.dim() == 3 and cos.shape[0] not in (1, batch):
        raise ValueError(f"cos and sin batch ({cos.shape[0]}) must be 1 or x's batch ({batch})")
    rotary_dim = 2 * cos.shape[-1]
    if not 2 <= rotary_dim <= head_dim:
        raise ValueError(
            f"rotary_dim = 2 * cos.shape[-1] = {rotary_dim}; accepted: from 2 to x's head_dim ({head_dim})"
        )
    check_same_device(x=x, cos=cos, sin=sin)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("cos and sin get no gradient here; pass them detached (x is differentiable)")
    return interleaved


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` dims of every head of ``x`` by the angles whose cos/sin are given.

    Args:
        x: ``[batch, heads, seq, head_dim]``, float16, bfloat16 or float32, any strides (a ``[B, S, H, D]``
            tensor viewed with ``.transpose(1, 2)`` costs no copy; one whose last dim is not contiguous is
            copied first).
        cos, sin: ``[seq, rotary_dim // 2]`` or ``[batch, seq, rotary_dim // 2]`` (batch 1 broadcasts), one
            value per pair and position, float16/bfloat16/float32; ``2 <= rotary_dim <= head_dim``. Hugging
            Face models carry cos/sin of width head_dim with both halves equal: pass ``cos[..., :half]``.
            They get no gradient (a ValueError if they require one while grad mode is on).
        interleaved: False pairs dims ``(i, i + rotary_dim/2)`` (GPT-NeoX / Llama "rotate half"); True pairs
            ``(2i, 2i+1)`` (GPT-J). Dims from ``rotary_dim`` to ``head_dim`` pass through unchanged.

    Returns a new contiguous ``[batch, heads, seq, head_dim]`` tensor in x's dtype (maths in float32); x is
    not modified. Differentiable in x. Devices as :func:`llm_speed.rms_norm`. Reference:
    :func:`llm_speed.fused.reference.apply_rotary_reference`.
    """
    interleaved = _validate(x, cos, sin, interleaved)
    return _rotary_call(x, cos, sin, interleaved, False)
