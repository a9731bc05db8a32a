"""Rotary position embedding of q and k in one Triton launch, taking Hugging Face's ``cos``/``sin`` as its
rotary embedding modules return them (Su et al., "RoFormer", 2021, arXiv:2104.09864).

``apply_rotary_qk(q, k, cos, sin)`` computes exactly Hugging Face's ``apply_rotary_pos_emb``: with ``d`` the
width of cos (the rotary dims, ``d <= head_dim``; Phi-3's partial rotary has ``d < head_dim``) and ``h = d /
2``, ``out[:d] = x[:d] * cos + rotate_half(x[:d]) * sin``, i.e. for ``j < h``::

    out[j]     = x[j] * cos[j]         - x[j + h] * sin[j]
    out[j + h] = x[j + h] * cos[j + h] + x[j] * sin[j + h]

(both halves of cos/sin are read, so cos/sin whose halves differ are honoured too) and ``out[d:] = x[d:]``.
``interleaved=True`` is ``apply_rotary_pos_emb_interleave`` (DeepSeek-V2/V3's ``rope_interleave``): pairs
``(x[2j], x[2j + 1])`` rotated by ``cos[j]``, ``sin[j]`` (the first half of cos/sin), written in the halves
layout above. One program handles a block of positions of one head of q or of k: cos and sin are read once per
block, and q and k share the launch. The backward is the transposed map, the same kernel with ``BACKWARD``.

Layout as :mod:`llm_speed.fused.rms_norm`: kernels, launcher, op registration, autograd, public function; the
plain-PyTorch spec is :func:`llm_speed.fused.reference.apply_rotary_qk_reference`.
"""

from __future__ import annotations

import functools
import numbers

import torch
import triton
import triton.language as tl

from ..core import autocast, runtime, tensors
from ..core.args import check_choice, check_flag, type_name
from ..core.config import KernelConfig
from ..core.dispatch import INFERENCE, Op, plain_call
from ..core.kernel_math import cast, rne_by_hand
from ..core.launch import CallCache, Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.tensors import check_same_device, check_tensor
from .reference import apply_rotary_qk_reference, rotary_qk_backward_reference

# --- kernels --------------------------------------------------------------------------------------------


@triton.jit
def _rotary_qk_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, pos_ptr, oq_ptr, ok_ptr,
    stride_qb, stride_qh, stride_qs, stride_kb, stride_kh, stride_ks,
    stride_oqb, stride_oqh, stride_oqs, stride_okb, stride_okh, stride_oks,
    stride_cb, stride_cs, stride_pb, stride_ps,
    batch, seq, heads_q, half, head_dim, table_rows,
    BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr, HAS_PASS: tl.constexpr,
    HAS_POSITIONS: tl.constexpr, INTERLEAVED: tl.constexpr, BACKWARD: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    """Program (r, h): positions ``r * BLOCK_R ...`` (batch and sequence flattened) of head h of q (h <
    heads_q) or of head ``h - heads_q`` of k. A position id outside ``[0, table_rows)`` makes its rows NaN."""
    o_r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    head = tl.program_id(1)
    m_r = o_r < batch * seq
    i_b = o_r // seq
    i_s = o_r % seq
    o_j = tl.arange(0, BLOCK_HALF)
    m = m_r[:, None] & (o_j < half)[None, :]  # [BR, BHALF]
    if HAS_POSITIONS:  # cos/sin a table [positions, d]; the position of (b, s) read from position_ids
        pos = tl.load(pos_ptr + i_b * stride_pb + i_s * stride_ps, mask=m_r, other=0).to(tl.int64)
        ok = (pos >= 0) & (pos < table_rows)
        row_c = tl.where(ok, pos, 0) * stride_cs
    else:
        row_c = i_b * stride_cb + i_s * stride_cs
    p_c = row_c[:, None] + o_j[None, :]
    b_c1 = tl.load(cos_ptr + p_c, mask=m, other=0.0).to(tl.float32)
    b_s1 = tl.load(sin_ptr + p_c, mask=m, other=0.0).to(tl.float32)
    if INTERLEAVED:  # one angle per pair: the first half of cos/sin
        b_c2 = b_c1
        b_s2 = b_s1
    else:
        b_c2 = tl.load(cos_ptr + p_c + half, mask=m, other=0.0).to(tl.float32)
        b_s2 = tl.load(sin_ptr + p_c + half, mask=m, other=0.0).to(tl.float32)
    if HAS_POSITIONS:
        b_c1 = tl.where(ok[:, None], b_c1, float("nan"))
    if head < heads_q:
        p_x = q_ptr + (i_b * stride_qb + head * stride_qh + i_s * stride_qs)[:, None]
        p_o = oq_ptr + (i_b * stride_oqb + head * stride_oqh + i_s * stride_oqs)[:, None]
    else:
        head_k = head - heads_q
        p_x = k_ptr + (i_b * stride_kb + head_k * stride_kh + i_s * stride_ks)[:, None]
        p_o = ok_ptr + (i_b * stride_okb + head_k * stride_okh + i_s * stride_oks)[:, None]
    # where the pairs sit: the halves layout (j, j + half), or (2j, 2j + 1) on the interleaved side
    if INTERLEAVED and not BACKWARD:
        o_in1 = 2 * o_j
        o_in2 = 2 * o_j + 1
    else:
        o_in1 = o_j
        o_in2 = o_j + half
    if INTERLEAVED and BACKWARD:
        o_out1 = 2 * o_j
        o_out2 = 2 * o_j + 1
    else:
        o_out1 = o_j
        o_out2 = o_j + half
    b_x1 = tl.load(p_x + o_in1[None, :], mask=m, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x + o_in2[None, :], mask=m, other=0.0).to(tl.float32)
    if BACKWARD:  # the transpose of the forward map
        b_o1 = b_x1 * b_c1 + b_x2 * b_s2
        b_o2 = b_x2 * b_c2 - b_x1 * b_s1
    else:
        b_o1 = b_x1 * b_c1 - b_x2 * b_s1
        b_o2 = b_x2 * b_c2 + b_x1 * b_s2
    if HAS_POSITIONS:
        b_o2 = tl.where(ok[:, None], b_o2, float("nan"))
    out_ty = oq_ptr.dtype.element_ty
    tl.store(p_o + o_out1[None, :], cast(b_o1, out_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)
    tl.store(p_o + o_out2[None, :], cast(b_o2, out_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)
    if HAS_PASS:  # dims past the rotary ones: copied
        o_p = 2 * half + tl.arange(0, BLOCK_PASS)
        m_p = m_r[:, None] & (o_p < head_dim)[None, :]
        b_pass = tl.load(p_x + o_p[None, :], mask=m_p)
        if HAS_POSITIONS:
            b_pass = tl.where(ok[:, None], b_pass, float("nan"))
        tl.store(p_o + o_p[None, :], b_pass, mask=m_p)


# --- launcher -------------------------------------------------------------------------------------------

KERNEL = Kernel(_rotary_qk_kernel, "rotary_qk")  # forward and backward are the same kernel
ROW_BLOCK_ELEMENTS = 2048  # positions per program so that a program holds about this many pairs
LAYOUTS = (1, 2)  # unsqueeze_dim: q [batch, heads, seq, head_dim] (1) or [batch, seq, heads, head_dim] (2)


@functools.cache
def config(positions: int, half: int) -> KernelConfig:
    """``block_m`` positions of one head, ``block_n`` pairs (half padded to a power of two) per program."""
    block_half = next_power_of_2(half)
    block_r = max(1, min(next_power_of_2(positions), ROW_BLOCK_ELEMENTS // block_half))
    return KernelConfig(block_r, block_half, num_warps=4, num_stages=1)


def _bhs(strides: tuple, unsqueeze_dim: int) -> tuple[int, int, int]:
    """(batch, head, sequence) strides of a q or k tensor in the layout of ``unsqueeze_dim``."""
    if unsqueeze_dim == 1:
        return strides[0], strides[1], strides[2]
    return strides[0], strides[2], strides[1]


def _contiguous_strides(shape: tuple) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


@plan_cache
def _plan(
    q_shape: tuple, k_shape: tuple, unsqueeze_dim: int, half: int, strides: tuple, cos_strides: tuple,
    pos_strides: tuple | None, table_rows: int, interleaved: bool, backward: bool, dtypes: tuple,
    device: torch.device,
) -> Plan:  # fmt: skip
    """strides: q's and k's (of the tensors read). cos_strides: (batch or 0, position). pos_strides: (batch or
    0, sequence) of position_ids, or None. dtypes: q, k, cos, sin, position_ids."""
    batch, seq = q_shape[0], q_shape[2] if unsqueeze_dim == 1 else q_shape[1]
    heads_q = q_shape[1] if unsqueeze_dim == 1 else q_shape[2]
    heads_k = k_shape[1] if unsqueeze_dim == 1 else k_shape[2]
    head_dim = q_shape[3]
    cfg = config(batch * seq, half)
    q_s, k_s = _bhs(strides[0], unsqueeze_dim), _bhs(strides[1], unsqueeze_dim)
    oq_s = _bhs(_contiguous_strides(q_shape), unsqueeze_dim)
    ok_s = _bhs(_contiguous_strides(k_shape), unsqueeze_dim)
    pb, ps = pos_strides if pos_strides is not None else (0, 0)
    return KERNEL.plan(
        (cdiv(batch * seq, cfg.block_m), heads_q + heads_k),
        stride_qb=q_s[0], stride_qh=q_s[1], stride_qs=q_s[2], stride_kb=k_s[0], stride_kh=k_s[1],
        stride_ks=k_s[2], stride_oqb=oq_s[0], stride_oqh=oq_s[1], stride_oqs=oq_s[2], stride_okb=ok_s[0],
        stride_okh=ok_s[1], stride_oks=ok_s[2], stride_cb=cos_strides[0], stride_cs=cos_strides[1],
        stride_pb=pb, stride_ps=ps, batch=batch, seq=seq, heads_q=heads_q, half=half, head_dim=head_dim,
        table_rows=table_rows, BLOCK_R=cfg.block_m, BLOCK_HALF=cfg.block_n,
        BLOCK_PASS=next_power_of_2(max(1, head_dim - 2 * half)), HAS_PASS=head_dim > 2 * half,
        HAS_POSITIONS=pos_strides is not None, INTERLEAVED=interleaved, BACKWARD=backward,
        RNE_BY_HAND=rne_by_hand(dtypes[0]), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _cos_strides(cos: torch.Tensor, batch: int, has_positions: bool) -> tuple[int, int]:
    """(batch stride, position stride) of cos and sin: a [positions, d] table or [seq, d] steps per position
    only; a [batch, seq, d] one per sequence too (a batch of 1 broadcasts)."""
    if has_positions or cos.dim() == 2:
        return 0, cos.stride(-2)
    return (cos.stride(0) if cos.shape[0] == batch and batch > 1 else 0), cos.stride(-2)


def _pos_strides(position_ids: torch.Tensor, batch: int) -> tuple[int, int]:
    if position_ids.dim() == 1:
        return 0, position_ids.stride(0)
    per_batch = position_ids.shape[0] == batch and batch > 1
    return (position_ids.stride(0) if per_batch else 0), position_ids.stride(1)


def _check_positions(position_ids: torch.Tensor, table_rows: int) -> None:
    """ValueError naming the first position id outside the table (reads them on the host: only where
    :func:`llm_speed.core.runtime.check_values` allows it)."""
    bad = (position_ids < 0) | (position_ids >= table_rows)
    if bool(bad.any()):
        first = int(position_ids[bad][0])
        raise ValueError(
            f"position_ids holds {first}; accepted: 0 <= position < {table_rows} (the rows of cos and sin)"
        )


def _launch(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved, backward):
    """(q out, k out) of the kernel, or of the PyTorch spec where Triton cannot run."""
    has_positions = position_ids is not None
    table_rows = cos.shape[-2]
    if has_positions and (not runtime.triton_runs_on(q.device) or runtime.check_values(q.device)):
        _check_positions(position_ids, table_rows)
    if q.numel() + k.numel() == 0 or not runtime.triton_runs_on(q.device):
        if backward:
            return rotary_qk_backward_reference(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved)
        return apply_rotary_qk_reference(
            q, k, cos, sin, position_ids=position_ids, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved
        )
    q, k = tensors.last_dim_contiguous(q), tensors.last_dim_contiguous(k)
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:  # the kernel reads both with cos's strides
        cos, sin = cos.contiguous(), sin.contiguous()
    plan = _plan_of(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved, backward)
    return _launch_plan(plan, q, k, cos, sin, position_ids)


def _plan_of(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved, backward) -> Plan:
    """The plan of a launch on q and k with contiguous last dims and cos/sin of one stride."""
    has_positions = position_ids is not None
    batch = q.shape[0]
    return _plan(
        tuple(q.shape), tuple(k.shape), unsqueeze_dim, cos.shape[-1] // 2, (q.stride(), k.stride()),
        _cos_strides(cos, batch, has_positions),
        _pos_strides(position_ids, batch) if has_positions else None, cos.shape[-2], interleaved, backward,
        (q.dtype, k.dtype, cos.dtype, sin.dtype, position_ids.dtype if has_positions else None), q.device,
    )  # fmt: skip


def _launch_plan(plan: Plan, q, k, cos, sin, position_ids):
    """Allocate (q out, k out) and launch ``plan``."""
    oq = tensors.new_output(q.shape, q.dtype, q.device)
    ok = tensors.new_output(k.shape, k.dtype, k.device)
    positions = cos if position_ids is None else position_ids  # (without positions: never read)
    plan.launch(q_ptr=q, k_ptr=k, cos_ptr=cos, sin_ptr=sin, pos_ptr=positions, oq_ptr=oq, ok_ptr=ok)
    return oq, ok


def _forward_kept(plan: Plan, q, k, cos, sin, position_ids, unsqueeze_dim: int, interleaved: bool):
    """:func:`forward` of a call kept in :data:`_ROTARY_QK_CALLS` (the op's arguments; the plan fixes the
    others)."""
    runtime.report_work("apply_rotary_qk", q=q, k=k, cos=cos)
    return _launch_plan(plan, q, k, cos, sin, position_ids)


def forward(q, k, cos, sin, position_ids, unsqueeze_dim: int, interleaved: bool):
    """(q rotated, k rotated), new contiguous tensors of q's and k's shapes; reports its work."""
    if q.numel():
        runtime.report_work("apply_rotary_qk", q=q, k=k, cos=cos)
    return _launch(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved, False)


def backward(dq_out, dk_out, cos, sin, position_ids, unsqueeze_dim: int, interleaved: bool):
    """(dq, dk) of :func:`forward` for the gradients of its outputs; reports its work."""
    if dq_out.numel():
        runtime.report_work("apply_rotary_qk_backward", q=dq_out, k=dk_out, cos=cos)
    return _launch(dq_out, dk_out, cos, sin, position_ids, unsqueeze_dim, interleaved, True)


# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::rotary_qk_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor | None,
    unsqueeze_dim: int, interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return forward(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved)


@_forward_op.register_fake
def _forward_fake(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("llm_speed::rotary_qk_backward", mutates_args=())
def _backward_op(
    dq_out: torch.Tensor, dk_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    position_ids: torch.Tensor | None, unsqueeze_dim: int, interleaved: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return backward(dq_out, dk_out, cos, sin, position_ids, unsqueeze_dim, interleaved)


@_backward_op.register_fake
def _backward_fake(dq_out, dk_out, cos, sin, position_ids, unsqueeze_dim, interleaved):
    return dq_out.new_empty(dq_out.shape), dk_out.new_empty(dk_out.shape)


# Under torch.autocast (core.autocast): no cast (an elementwise op, on none of autocast's lists).
_backward_call = autocast.dispatch(Op(_backward_op, backward), autocast.KEEP)


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    q, k, cos, sin, position_ids, unsqueeze_dim, interleaved = inputs
    ctx.save_for_backward(cos, sin, position_ids)
    ctx.shapes = (q.shape, k.shape, q.dtype, k.dtype)
    ctx.unsqueeze_dim, ctx.interleaved = unsqueeze_dim, interleaved


def _backward(ctx, dq_out, dk_out):
    cos, sin, position_ids = ctx.saved_tensors
    q_shape, k_shape, q_dtype, k_dtype = ctx.shapes
    if dq_out is None:
        dq_out = torch.zeros(q_shape, dtype=q_dtype, device=cos.device)
    if dk_out is None:
        dk_out = torch.zeros(k_shape, dtype=k_dtype, device=cos.device)
    dq, dk = _backward_call(dq_out, dk_out, cos, sin, position_ids, ctx.unsqueeze_dim, ctx.interleaved)
    return dq, dk, None, None, None, None, None


_forward_plain = Op(_forward_op, forward, setup_context=_setup_context, backward=_backward)
_forward_call = autocast.dispatch(_forward_plain, autocast.KEEP)


# --- public function ------------------------------------------------------------------------------------


def _validate(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved):
    check_tensor("q", q, dims=4, what="[batch, heads, seq, head_dim] (unsqueeze_dim=1)")
    check_tensor("k", k, dims=4, what="[batch, heads_k, seq, head_dim] (unsqueeze_dim=1)")
    check_tensor("cos", cos)
    check_tensor("sin", sin)
    if isinstance(unsqueeze_dim, bool) or not isinstance(unsqueeze_dim, numbers.Integral):  # True == 1
        raise TypeError(f"unsqueeze_dim must be an int (1 or 2), got {type_name(unsqueeze_dim)}")
    check_choice("unsqueeze_dim", unsqueeze_dim, LAYOUTS)
    interleaved = check_flag("interleaved", interleaved)
    if q.dtype != k.dtype:
        raise TypeError(f"q and k must share one dtype, got q {q.dtype}, k {k.dtype}")
    seq_dim = 2 if unsqueeze_dim == 1 else 1
    batch, seq, head_dim = q.shape[0], q.shape[seq_dim], q.shape[3]
    if k.shape[0] != batch or k.shape[seq_dim] != seq or k.shape[3] != head_dim:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in batch, sequence (dim {seq_dim}) and "
            "head_dim; only the heads may differ"
        )
    if cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must have the same shape, got cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    rotary_dim = cos.shape[-1] if cos.dim() else 0
    if rotary_dim % 2 or not 2 <= rotary_dim <= head_dim:
        raise ValueError(
            f"cos and sin have {rotary_dim} rotary dims (their last dim); accepted: an even number from 2 to "
            f"head_dim ({head_dim})"
        )
    if position_ids is not None:
        check_tensor("position_ids", position_ids, dtypes=(torch.int64, torch.int32))
    if position_ids is not None and cos.dim() == 2:  # a table of positions, indexed by position_ids
        shape = tuple(position_ids.shape)
        if shape not in ((seq,), (1, seq), (batch, seq)):
            raise ValueError(f"position_ids has shape {shape}; accepted: [seq], [1, seq] or [batch, seq] "
                             f"with batch {batch} and seq {seq}")  # fmt: skip
    else:
        position_ids = None  # Hugging Face's: per-position cos/sin, position_ids unused
        if cos.dim() == 2:
            if cos.shape[0] != seq:
                raise ValueError(f"cos and sin cover {cos.shape[0]} positions; q has seq {seq}")
        elif cos.dim() == 3:
            if cos.shape[0] not in (1, batch) or cos.shape[1] != seq:
                raise ValueError(
                    f"cos and sin are {tuple(cos.shape)}; accepted: [batch or 1, seq, rotary_dim] with batch "
                    f"{batch} and seq {seq}, [seq, rotary_dim], or a table [positions, rotary_dim] with "
                    "position_ids"
                )
        else:
            raise ValueError(f"cos and sin must have 2 or 3 dims, got {tuple(cos.shape)}")
    check_same_device(q=q, k=k, cos=cos, sin=sin, position_ids=position_ids)
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("cos and sin get no gradient here; pass them detached (q and k are differentiable)")
    return position_ids, interleaved


def apply_rotary_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=...)`` in one launch for q and k.

    Args:
        q: ``[batch, heads, seq, head_dim]`` (``unsqueeze_dim=1``, Hugging Face's attention layout) or
            ``[batch, seq, heads, head_dim]`` (``unsqueeze_dim=2``); float16, bfloat16 or float32; any strides
            with a contiguous last dim (a slice of a fused projection costs no copy).
        k: like q, with its own number of heads (GQA, MQA; DeepSeek's single shared rotary key), q's dtype.
        cos, sin: what a Hugging Face rotary embedding module returns: ``[batch or 1, seq, d]`` (or ``[seq,
            d]``) with ``d`` the rotary dims, even, ``2 <= d <= head_dim``; dims past ``d`` pass through
            unchanged (partial rotary, Phi-3). Any float dtype (read in float32). No gradient: a ValueError if
            they require one while grad mode is on.
        position_ids: Hugging Face's argument, unused with per-position cos/sin as above (as in Hugging Face).
            With a 2-D table ``cos, sin [positions, d]`` (the layout of transformers before 4.38), int32/int64
            ``[seq]``, ``[1, seq]`` or ``[batch, seq]`` picks each token's row in one gather inside the
            kernel; a position outside the table is a ValueError where values are checked
            (:func:`llm_speed.core.runtime.check_values`) and otherwise makes its rows NaN.
        unsqueeze_dim: 1 or 2, as in Hugging Face (the dim cos/sin would be unsqueezed at).
        interleaved: False: ``x * cos + rotate_half(x) * sin`` (Llama, ...). True: Hugging Face's
            ``apply_rotary_pos_emb_interleave`` (DeepSeek-V2/V3 with ``rope_interleave``): pairs ``(2j, 2j +
            1)`` rotated by the first half of cos/sin and written as ``[evens rotated, odds rotated]``.

    Returns ``(q_embed, k_embed)``, new contiguous tensors of q's and k's shapes and dtypes (maths in
    float32); q and k are not modified. Differentiable in q and k (the backward is one launch too). Under
    ``torch.autocast`` nothing is cast (an elementwise op). Devices as :func:`llm_speed.rms_norm`. Reference:
    :func:`llm_speed.fused.reference.apply_rotary_qk_reference`.
    """
    known = None  # the key of a call that _ROTARY_QK_CALLS may serve: per-position cos/sin (Hugging Face's)
    if (
        position_ids is None and type(unsqueeze_dim) is int and (interleaved is True or interleaved is False)
        and (mode := plain_call(q, k, cos, sin)) and not (cos.requires_grad or sin.requires_grad)
    ):  # fmt: skip
        known = (q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(), k.dtype, k.device, cos.shape,
                 cos.stride(), cos.dtype, cos.device, sin.shape, sin.stride(), sin.dtype, sin.device,
                 unsqueeze_dim, interleaved)  # fmt: skip
        run = _ROTARY_QK_CALLS.get(known)
        if run is not None and mode == INFERENCE:
            return run(q, k, cos, sin, None, unsqueeze_dim, interleaved)
        if run is not None:  # with grad: the op's autograd node around the kept launch
            return _forward_plain.checked(run, q, k, cos, sin, None, unsqueeze_dim, interleaved)
    position_ids, interleaved = _validate(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved)
    out = _forward_call(q, k, cos, sin, position_ids, unsqueeze_dim, interleaved)
    if (
        known is not None and q.numel() + k.numel() and runtime.triton_runs_on(q.device)
        and q.stride(-1) == 1 and k.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    ):  # fmt: skip  (what forward() launched, with nothing copied)
        plan = _plan_of(q, k, cos, sin, None, unsqueeze_dim, interleaved, False)
        _ROTARY_QK_CALLS.put(known, functools.partial(_forward_kept, plan))
    return out


# apply_rotary_qk calls already checked (per-position cos/sin), by what the checks and the plan read: a
# repeated call launches the kept plan, with grad inside the op's autograd node (Op.checked).
_ROTARY_QK_CALLS = CallCache()
