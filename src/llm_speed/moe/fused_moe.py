"""The fused mixture-of-experts layer in Triton, forward and backward.

``out[t] = sum_j w[t, j] * W2[e] @ (silu(G[e] @ x[t]) * (U[e] @ x[t]))`` with ``e = topk_ids[t, j]`` and
vLLM's weight layout: ``w_gate_up [E, 2I, H]`` (G[e] its first I rows, U[e] the next I), ``w_down [E, H,
I]`` (the layout of Hugging Face's ``*Experts`` modules too). Forward, five launches, no host read:

1. :func:`llm_speed.moe.routing.sort_copies` (two launches): the ``T * k`` token copies grouped by expert
   (``order``), each expert's cumulative end (``offsets``) and the ``inverse`` permutation;
2. the grouped gate/up GEMM (:mod:`llm_speed.moe.grouped_gemm`'s persistent kernel) reading each copy's
   token row of ``hidden`` in place (no gathered copy) with SwiGLU in its epilogue: ``act [T*k, I]``;
3. the grouped down GEMM: ``y [T*k, H]``;
4. the weighted combine: token t sums ``w[t, j] * y[inverse[t*k + j]]`` over j in float32 (deterministic, no
   atomics).

Backward, five launches: one kernel recomputes each copy's gate and up projections and the down GEMM's
input gradient ``dout[t] @ W2[e]`` together (three accumulators over one pass of H) and applies the SwiGLU
backward in its epilogue, writing ``dh = [dgate, dup]``, the activation (for W2's gradient) and the routing
weight's gradient partials ``<dout[t] @ W2[e], act>``; then ``dh @ W1[e]`` (grouped), the sum of each token's
copies (combine), and the two weight gradients (grouped over the rows of each expert).

Memory: the forward saves only its inputs and the int32 sort (``order``, ``inverse``: T*k each; ``offsets``:
E); nothing of size ``T*k x I`` or ``T*k x 2I`` is kept between forward and backward (the gate/up GEMM is
recomputed, +1 GEMM of the forward's 3 in the backward: 16 T*k*H*I FLOPs against 12). Transient: forward
``act`` and ``y`` (T*k*(I + H) elements); backward ``dh``, ``act``, ``dx`` (T*k*(3I + H)) and fp32 partials
(T*k*ceil(I/BLOCK_N)).

Expert ids out of range with the value checks off: those copies are sorted past the last expert, and their
token's output row (and gradient row) is NaN.

Layout (every op module): kernels, launcher, op registration, autograd, public function. The plain-PyTorch
spec: :func:`llm_speed.moe.reference.fused_moe_reference` (Hugging Face's loop over experts).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..core import autocast, runtime, tensors
from ..core.args import check_choice
from ..core.config import KernelConfig
from ..core.dispatch import Op
from ..core.hardware import Hardware, hardware_of
from ..core.kernel_math import cast, dot, dot_switches, rne_by_hand
from ..core.launch import Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.tensors import check_same_device, check_tensor
from . import reference
from .checks import check_expert_ids, check_topk
from .grouped_gemm import (
    INTERPRETER_PROGRAMS,
    grouped_schedule,
    interpreter_tile,
    pipeline_stages,
    run_grouped,
    run_wgrad,
    uses_tf32,
)
from .routing import sort_copies

ACTIVATIONS = ("silu",)

# --- kernels --------------------------------------------------------------------------------------------


@triton.jit
def _combine_kernel(
    y_ptr, inverse_ptr, weights_ptr, out_ptr, partials_ptr, dw_ptr, tokens, H, stride_y, stride_o, partials,
    TOP_K: tl.constexpr, ROWS: tl.constexpr, WEIGHTED: tl.constexpr, PARTIALS: tl.constexpr,
    RNE_BY_HAND: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):  # fmt: skip
    """Gather each token's copies through ``inverse``, j in order (deterministic, no atomics).

    ROWS: ``out[t] = sum_j (w[t, j] *) y[inverse[t * TOP_K + j]]`` in float32 (WEIGHTED: the forward's
    combine; else the backward's sum of each token's input gradients). PARTIALS (the backward, programs of
    the first column block): ``dw[t, j] = sum_p partials[inverse[t * TOP_K + j], p]``, the routing weight's
    gradient from the backward kernel's per-tile partial sums.

    FLOPs: 2 * tokens * TOP_K * H. Bytes: y read, out written, the indices, weights and partials.
    """
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_t = o_t < tokens
    m = m_t[:, None] & (o_h < H)[None, :]
    m_w = o_t < tl.where(tl.program_id(1) == 0, tokens, 0)  # one program per token block writes dw
    o_p = tl.arange(0, BLOCK_P)
    acc = tl.zeros((BLOCK_T, BLOCK_H), tl.float32)
    copies = o_t.to(tl.int64) * TOP_K
    for j in tl.static_range(TOP_K):
        pos = tl.load(inverse_ptr + copies + j, mask=m_t, other=0).to(tl.int64)
        if ROWS:
            row = tl.load(y_ptr + pos[:, None] * stride_y + o_h[None, :], mask=m, other=0.0).to(tl.float32)
            if WEIGHTED:
                row *= tl.load(weights_ptr + copies + j, mask=m_t, other=0.0).to(tl.float32)[:, None]
            acc += row
        if PARTIALS:
            m_p = m_w[:, None] & (o_p < partials)[None, :]
            part = tl.load(partials_ptr + pos[:, None] * partials + o_p[None, :], mask=m_p, other=0.0)
            dw = tl.sum(part, axis=1)
            tl.store(dw_ptr + copies + j, dw.to(dw_ptr.dtype.element_ty), mask=m_w)
    if ROWS:
        out = out_ptr + o_t.to(tl.int64)[:, None] * stride_o + o_h[None, :]
        tl.store(out, cast(acc, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)


@triton.jit
def _backward_tile(
    x_ptr, dout_ptr, w1_ptr, w2_ptr, topw_ptr, order_ptr, dh_ptr, act_ptr, dwp_ptr,
    e, row0, end, pid_n, H, I, nan_tile,
    stride_x, stride_do, stride_w1e, stride_w1n, stride_w1k, stride_w2e, stride_w2k, stride_w2n,
    stride_dh, stride_act, stride_dwp,
    TOP_K: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_m = row0 + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.where(mask_m, offs_m, row0)
    copy = tl.load(order_ptr + rows)
    token = (copy // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < I
    cols = (offs_n % I).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_k64 = offs_k.to(tl.int64)
    e64 = e.to(tl.int64)
    p_x = x_ptr + token[:, None] * stride_x + offs_k64[None, :]
    p_do = dout_ptr + token[:, None] * stride_do + offs_k64[None, :]
    p_g = w1_ptr + e64 * stride_w1e + offs_k64[:, None] * stride_w1k + cols[None, :] * stride_w1n
    up_shift = tl.full((), I, tl.int64) * stride_w1n
    p_w2 = w2_ptr + e64 * stride_w2e + offs_k64[:, None] * stride_w2k + cols[None, :] * stride_w2n
    step_w1 = tl.full((), BLOCK_K, tl.int64) * stride_w1k
    step_w2 = tl.full((), BLOCK_K, tl.int64) * stride_w2k
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_d = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # dout @ W2[e]: the gradient of act
    k_stop = tl.where(nan_tile, 0, H)
    for k0 in range(0, k_stop, BLOCK_K):
        k_mask = offs_k < H - k0
        b_x = tl.load(p_x, mask=k_mask[None, :], other=0.0)
        b_do = tl.load(p_do, mask=k_mask[None, :], other=0.0)
        b_g = tl.load(p_g, mask=k_mask[:, None], other=0.0)
        b_u = tl.load(p_g + up_shift, mask=k_mask[:, None], other=0.0)
        b_w2 = tl.load(p_w2, mask=k_mask[:, None], other=0.0)
        acc_g += dot(b_x, b_g, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        acc_u += dot(b_x, b_u, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        acc_d += dot(b_do, b_w2, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION)
        p_x += BLOCK_K
        p_do += BLOCK_K
        p_g += step_w1
        p_w2 += step_w2
    w = tl.load(topw_ptr + copy).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-acc_g))
    silu = acc_g * sig
    act = silu * acc_u
    partial = tl.sum(tl.where(mask_n[None, :], acc_d * act, 0.0), axis=1)  # this tile's share of dw
    da = acc_d * w[:, None]
    dg = da * acc_u * sig * (1.0 + acc_g * (1.0 - sig))
    du = da * silu
    nan = float("nan")
    partial = tl.where(nan_tile, nan, partial)
    dg = tl.where(nan_tile, nan, dg)
    du = tl.where(nan_tile, nan, du)
    act = tl.where(nan_tile, nan, act)
    offs_m64 = offs_m.to(tl.int64)
    mask = mask_m[:, None] & mask_n[None, :]
    dtype = dh_ptr.dtype.element_ty
    p_dh = dh_ptr + offs_m64[:, None] * stride_dh + offs_n[None, :]
    tl.store(p_dh, cast(dg, dtype, RNE_BY_HAND=RNE_BY_HAND), mask=mask)
    tl.store(p_dh + I, cast(du, dtype, RNE_BY_HAND=RNE_BY_HAND), mask=mask)
    p_act = act_ptr + offs_m64[:, None] * stride_act + offs_n[None, :]
    tl.store(p_act, cast(act, dtype, RNE_BY_HAND=RNE_BY_HAND), mask=mask)
    tl.store(dwp_ptr + offs_m64 * stride_dwp + pid_n, partial, mask=mask_m)


@triton.jit
def _moe_backward_kernel(
    x_ptr, dout_ptr, w1_ptr, w2_ptr, topw_ptr, order_ptr, offsets_ptr, dh_ptr, act_ptr, dwp_ptr,
    total, H, I, groups, num_programs,
    stride_x, stride_do, stride_w1e, stride_w1n, stride_w1k, stride_w2e, stride_w2k, stride_w2n,
    stride_dh, stride_act, stride_dwp,
    TOP_K: tl.constexpr, DOT_IN_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """The backward's first kernel, persistent over (expert, tile) as the grouped GEMM: for a tile of copies
    r (grouped) and intermediate columns n, with t = order[r] // TOP_K, recompute ``g = x[t] @ G[e]^T``,
    ``u = x[t] @ U[e]^T`` and compute ``d = dout[t] @ W2[e]`` in one pass over H; then ``act = silu(g) * u``,
    the weight gradient partial ``sum_n d * act``, ``da = w * d`` and ``dh = [da * u * silu'(g), da *
    silu(g)]``. Rows past the last offset (copies of an invalid expert id) come out NaN.

    FLOPs: 6 * total * H * I. Bytes: the copies' rows of x and dout, W1 and W2 of the experts hit, dh and act
    written.
    """
    pid = tl.program_id(0)
    num_n = tl.cdiv(I, BLOCK_N)
    starts, ends, tiles, tile_ends, bad = grouped_schedule(
        offsets_ptr, total, groups, num_n, BLOCK_M=BLOCK_M, BLOCK_E=BLOCK_E
    )
    o_g = tl.arange(0, BLOCK_E)
    for t in range(pid, tl.sum(tiles, axis=0), num_programs):
        g = tl.sum((tile_ends <= t).to(tl.int32), axis=0)
        here = o_g == g
        start = tl.sum(tl.where(here, starts, 0), axis=0)
        end = tl.sum(tl.where(here, ends, 0), axis=0)
        local = t - tl.sum(tl.where(here, tile_ends - tiles, 0), axis=0)
        m_tiles = (end - start + BLOCK_M - 1) // BLOCK_M
        _backward_tile(
            x_ptr, dout_ptr, w1_ptr, w2_ptr, topw_ptr, order_ptr, dh_ptr, act_ptr, dwp_ptr,
            tl.minimum(g, groups - 1), start + (local % m_tiles) * BLOCK_M, end, local // m_tiles, H, I,
            bad | (g == groups),
            stride_x, stride_do, stride_w1e, stride_w1n, stride_w1k, stride_w2e, stride_w2k, stride_w2n,
            stride_dh, stride_act, stride_dwp,
            TOP_K=TOP_K, DOT_IN_FP32=DOT_IN_FP32, DOT_PRECISION=DOT_PRECISION, RNE_BY_HAND=RNE_BY_HAND,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        )  # fmt: skip


# --- launcher -------------------------------------------------------------------------------------------

COMBINE = Kernel(_combine_kernel, "moe.combine")
BACKWARD = Kernel(_moe_backward_kernel, "moe.fused_moe_bwd")
COMBINE_BLOCK_ELEMENTS = 4096


@functools.cache
def combine_config(tokens: int, hidden: int) -> KernelConfig:
    """``block_m`` tokens x ``block_n`` columns (at most 1024) per program, about 4096 elements."""
    block_h = min(1024, next_power_of_2(hidden))
    block_t = min(next_power_of_2(tokens), max(1, COMBINE_BLOCK_ELEMENTS // block_h))
    return KernelConfig(block_t, block_h, num_warps=4, num_stages=1)


@functools.cache
def backward_config(rows_per_group: int, element_bytes: int, hardware: Hardware) -> KernelConfig:
    """The backward kernel's tile (three accumulators): BLOCK_M from 16 to 64 by the rows per expert,
    BLOCK_N 64, BLOCK_K 64, stages as deep as shared memory allows (not tuned on a GPU yet)."""
    block_m = min(64, max(16, rows_per_group))
    per_stage = (2 * block_m + 3 * 64) * 64 * element_bytes
    warps = 8 if block_m >= 64 else 4
    return KernelConfig(block_m, 64, warps, pipeline_stages(per_stage, hardware), block_k=64)


@plan_cache
def _combine_plan(
    tokens: int, hidden: int, top_k: int, stride_y: int, rows: bool, weighted: bool, partials: int,
    dtypes: tuple, device: torch.device,
) -> Plan:  # fmt: skip
    cfg = combine_config(tokens, hidden)
    return COMBINE.plan(
        (cdiv(tokens, cfg.block_m), cdiv(hidden, cfg.block_n) if rows else 1), tokens=tokens, H=hidden,
        stride_y=stride_y, stride_o=hidden, partials=partials, TOP_K=top_k, ROWS=rows, WEIGHTED=weighted,
        PARTIALS=partials > 0, RNE_BY_HAND=rne_by_hand(dtypes[2]), BLOCK_T=cfg.block_m, BLOCK_H=cfg.block_n,
        BLOCK_P=next_power_of_2(max(partials, 1)), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


@plan_cache
def _backward_plan(
    total: int, hidden: int, inter: int, groups: int, top_k: int, strides: tuple, dtypes: tuple, tf32: bool,
    device: torch.device,
) -> Plan:  # fmt: skip
    hardware = hardware_of(device)
    interpreted = runtime.INTERPRETED
    bucket = next_power_of_2(max(1, total // groups))
    if interpreted:
        cfg = interpreter_tile(bucket, inter, hidden)
    else:
        cfg = backward_config(bucket, dtypes[0].itemsize, hardware)
    upper = (cdiv(total, cfg.block_m) + groups + 1) * cdiv(inter, cfg.block_n)
    programs = max(1, min(INTERPRETER_PROGRAMS if interpreted else hardware.sm_count, upper))
    switches = dot_switches(dtypes[0], tf32=tf32)
    s_x, s_do, (s_1e, s_1n, s_1k), (s_2e, s_2k, s_2n) = strides
    return BACKWARD.plan(
        (programs,), total=total, H=hidden, I=inter, groups=groups, num_programs=programs,
        stride_x=s_x, stride_do=s_do, stride_w1e=s_1e, stride_w1n=s_1n, stride_w1k=s_1k, stride_w2e=s_2e,
        stride_w2k=s_2k, stride_w2n=s_2n, stride_dh=2 * inter, stride_act=inter,
        stride_dwp=cdiv(inter, cfg.block_n), TOP_K=top_k, DOT_IN_FP32=switches["DOT_IN_FP32"],
        DOT_PRECISION=switches["DOT_PRECISION"], RNE_BY_HAND=rne_by_hand(dtypes[0]),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_E=next_power_of_2(groups + 1),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _combine(inverse, tokens, hidden, *, y=None, weights=None, out=None, partials=None, dw=None) -> None:
    """Launch :func:`_combine_kernel`: ``out`` from the rows ``y`` (``weights`` or not), and/or ``dw`` from
    the backward's ``partials``."""
    if tokens == 0:
        return
    rows = out is not None
    if rows and hidden == 0:
        return
    top_k = inverse.numel() // tokens
    n_partials = 0 if partials is None else partials.shape[1]
    dtypes = tuple(None if t is None else t.dtype for t in (y, weights, out, partials, dw))
    plan = _combine_plan(tokens, hidden, top_k, 0 if y is None else y.stride(0), rows, weights is not None,
                         n_partials, dtypes, inverse.device)  # fmt: skip
    unused = inverse  # stands in for an absent tensor: never read or written
    plan.launch(
        y_ptr=unused if y is None else y, inverse_ptr=inverse,
        weights_ptr=unused if weights is None else weights, out_ptr=unused if out is None else out,
        partials_ptr=unused if partials is None else partials, dw_ptr=unused if dw is None else dw,
    )  # fmt: skip


def _unit_row_strides(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit last stride (the backward kernel steps columns by 1): itself, else a copy."""
    return tensors.last_dim_contiguous(t)


def _forward_torch(hidden, w_gate_up, w_down, topk_weights, topk_ids):
    order, offsets, inverse = reference.moe_sort_reference(topk_ids, w_gate_up.shape[0])
    ct = reference.compute_dtype(hidden.dtype)
    out = reference.fused_moe_reference(
        hidden.to(ct), w_gate_up.to(ct), w_down.to(ct), topk_weights.to(ct), topk_ids
    )
    return out.to(hidden.dtype), order, offsets, inverse


def forward(hidden, w_gate_up, w_down, topk_weights, topk_ids):
    """``(out, order, offsets, inverse)``: the layer's output and the sort the backward reuses; reports
    its work."""
    tokens, hidden_size = hidden.shape
    experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    if tokens:
        runtime.report_work("fused_moe", hidden=hidden, w_gate_up=w_gate_up, w_down=w_down, topk_ids=topk_ids)
    if not runtime.triton_runs_on(hidden.device):
        return _forward_torch(hidden, w_gate_up, w_down, topk_weights, topk_ids)
    device, dtype = hidden.device, hidden.dtype
    order, offsets, inverse = sort_copies(topk_ids, experts)
    copies = order.numel()
    out = tensors.new_output((tokens, hidden_size), dtype, device)
    if copies == 0:
        return out, order, offsets, inverse
    act = tensors.new_output((copies, inter), dtype, device)
    s_e, s_n, s_k = w_gate_up.stride()  # W1[e] [2I, H] read as [K=H, N=2I]
    run_grouped(hidden, w_gate_up, (s_e, s_k, s_n), act, offsets, order, k=hidden_size, gather_div=top_k,
                swiglu=True)  # fmt: skip
    y = tensors.new_output((copies, hidden_size), dtype, device)
    s_e, s_n, s_k = w_down.stride()  # W2[e] [H, I] read as [K=I, N=H]
    run_grouped(act, w_down, (s_e, s_k, s_n), y, offsets, k=inter)
    _combine(inverse, tokens, hidden_size, y=y, weights=topk_weights, out=out)
    return out, order, offsets, inverse


def _backward_torch(dout, hidden, w_gate_up, w_down, topk_weights, topk_ids):
    ct = reference.compute_dtype(hidden.dtype)
    leaves = [t.detach().to(ct).requires_grad_() for t in (hidden, w_gate_up, w_down, topk_weights)]
    with torch.enable_grad():
        out = reference.fused_moe_reference(*leaves, topk_ids)
        grads = torch.autograd.grad(out, leaves, dout.to(ct), allow_unused=True)
    return tuple(
        torch.zeros_like(t) if g is None else g.to(t.dtype)
        for g, t in zip(grads, (hidden, w_gate_up, w_down, topk_weights), strict=False)
    )


def backward(dout, hidden, w_gate_up, w_down, topk_weights, topk_ids, order, offsets, inverse, needs):
    """(dhidden, dw_gate_up, dw_down, dtopk_weights) of :func:`forward` (a 0-element tensor for one not in
    ``needs``); reports its work."""
    tokens, hidden_size = hidden.shape
    experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    device, dtype = hidden.device, hidden.dtype
    need_hidden, need_w1, need_w2, need_topw = needs
    if tokens:
        runtime.report_work("fused_moe_backward", hidden=hidden, w_gate_up=w_gate_up, w_down=w_down,
                            topk_ids=topk_ids)  # fmt: skip
    if not runtime.triton_runs_on(device):
        grads = _backward_torch(dout, hidden, w_gate_up, w_down, topk_weights, topk_ids)
        return tuple(g if need else g.new_empty(0) for g, need in zip(grads, needs, strict=False))
    dout = _unit_row_strides(dout if dout.dtype == dtype else dout.to(dtype))
    hidden = _unit_row_strides(hidden)  # the backward kernel and dW1's product step its columns by 1
    copies = order.numel()
    dhidden = dw1 = dw2 = dtopw = None
    if copies == 0:
        dhidden, dw1, dw2 = torch.zeros_like(hidden), torch.zeros_like(w_gate_up), torch.zeros_like(w_down)
        dtopw = torch.zeros_like(topk_weights)
    else:
        strides = (hidden.stride(0), dout.stride(0), w_gate_up.stride(), w_down.stride())
        dtypes = (dtype, w_gate_up.dtype, w_down.dtype, topk_weights.dtype)
        plan = _backward_plan(
            copies, hidden_size, inter, experts, top_k, strides, dtypes, uses_tf32(dtype), device
        )
        dh = tensors.new_output((copies, 2 * inter), dtype, device)
        act = tensors.new_output((copies, inter), dtype, device)
        partials = tensors.new_output((copies, plan.fixed["stride_dwp"]), torch.float32, device)
        plan.launch(
            x_ptr=hidden, dout_ptr=dout, w1_ptr=w_gate_up, w2_ptr=w_down, topw_ptr=topk_weights,
            order_ptr=order, offsets_ptr=offsets, dh_ptr=dh, act_ptr=act, dwp_ptr=partials,
        )  # fmt: skip
        dx = None
        if need_hidden:
            dx = tensors.new_output((copies, hidden_size), dtype, device)
            s_e, s_n, s_k = w_gate_up.stride()  # W1[e] [2I, H] read as [K=2I, N=H]
            run_grouped(dh, w_gate_up, (s_e, s_n, s_k), dx, offsets, k=2 * inter)
            dhidden = tensors.new_output((tokens, hidden_size), dtype, device)
        if need_topw:
            dtopw = tensors.new_output((tokens, top_k), topk_weights.dtype, device)
        if need_hidden or need_topw:  # dhidden: each token's copies summed; dtopw: the partials summed
            used = partials if need_topw else None
            _combine(inverse, tokens, hidden_size, y=dx, out=dhidden, partials=used, dw=dtopw)
        if need_w1:  # dW1[e] [2I, H] = dh_e^T @ x[tokens of e]
            dw1 = tensors.new_output(w_gate_up.shape, w_gate_up.dtype, device)
            run_wgrad(dh, hidden, dw1, offsets, order, total=copies, gathers=(0, top_k))
        if need_w2:  # dW2[e] [H, I] = (w * dout[tokens of e])^T @ act_e
            dw2 = tensors.new_output(w_down.shape, w_down.dtype, device)
            run_wgrad(dout, act, dw2, offsets, order, topk_weights, total=copies, gathers=(top_k, 0))
    grads = (dhidden, dw1, dw2, dtopw)
    like = (hidden, w_gate_up, w_down, topk_weights)
    return tuple(
        t.new_empty(0) if g is None or not need else g for g, t, need in zip(grads, like, needs, strict=False)
    )


# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::fused_moe", mutates_args=())
def _forward_op(
    hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return forward(hidden, w_gate_up, w_down, topk_weights, topk_ids)


@_forward_op.register_fake
def _forward_fake(hidden, w_gate_up, w_down, topk_weights, topk_ids):
    copies = topk_ids.numel()
    index = functools.partial(hidden.new_empty, dtype=torch.int32)
    return torch.empty_like(hidden), index((copies,)), index((w_gate_up.shape[0],)), index((copies,))


@torch.library.custom_op("llm_speed::fused_moe_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor, hidden: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, order: torch.Tensor, offsets: torch.Tensor,
    inverse: torch.Tensor, needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return backward(dout, hidden, w_gate_up, w_down, topk_weights, topk_ids, order, offsets, inverse, needs)


@_backward_op.register_fake
def _backward_fake(dout, hidden, w_gate_up, w_down, topk_weights, topk_ids, order, offsets, inverse, needs):
    like = (hidden, w_gate_up, w_down, topk_weights)
    return tuple(
        torch.empty_like(t) if need else t.new_empty(0) for t, need in zip(like, needs, strict=False)
    )


_backward_call = autocast.dispatch(Op(_backward_op, backward), autocast.KEEP)  # in the dtypes saved


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output[1:])


def _backward(ctx, dout, *_index_grads):
    hidden, w_gate_up, w_down, topk_weights, topk_ids, order, offsets, inverse = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:4])
    grads = _backward_call(dout, hidden, w_gate_up, w_down, topk_weights, topk_ids, order, offsets, inverse,
                           needs)  # fmt: skip
    return (*(g if need else None for g, need in zip(grads, needs, strict=False)), None)


# Under torch.autocast (core.autocast): hidden and both weights take the autocast dtype, as the linear
# layers of the expert loop it replaces would (the routing weights keep theirs).
_forward_call = autocast.dispatch(Op(_forward_op, forward, setup_context=_setup_context, backward=_backward),
                                  autocast.LOWER, (0, 1, 2))  # fmt: skip


# --- public function ------------------------------------------------------------------------------------


def _validate(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation) -> None:
    check_tensor("hidden", hidden, dims=2, what="[tokens, hidden]")
    check_tensor("w_gate_up", w_gate_up, dims=3, what="[experts, 2 * intermediate, hidden]")
    check_tensor("w_down", w_down, dims=3, what="[experts, hidden, intermediate]")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.dtype != hidden.dtype:
            raise TypeError(f"{name} must have hidden's dtype ({hidden.dtype}), got {w.dtype}")
    experts, two_inter, hidden_size = w_gate_up.shape
    if hidden.shape[1] == 0 or experts == 0 or two_inter == 0 or two_inter % 2:
        raise ValueError(
            f"hidden [tokens, hidden] {tuple(hidden.shape)} and w_gate_up [experts, 2 * intermediate, "
            f"hidden] "
            f"{tuple(w_gate_up.shape)} need hidden >= 1, experts >= 1 and an even 2 * intermediate >= 2"
        )
    if hidden_size != hidden.shape[1]:
        raise ValueError(
            f"w_gate_up {tuple(w_gate_up.shape)} must be [experts, 2 * intermediate, hidden] with hidden's "
            f"last dim ({hidden.shape[1]})"
        )
    expected = (experts, hidden_size, two_inter // 2)
    if tuple(w_down.shape) != expected:
        raise ValueError(
            f"w_down must be [experts, hidden, intermediate] = {expected} to match w_gate_up "
            f"{tuple(w_gate_up.shape)}, got {tuple(w_down.shape)}"
        )
    check_topk(topk_weights, topk_ids, hidden.shape[0])
    check_choice("activation", activation, ACTIVATIONS)
    check_same_device(hidden=hidden, w_gate_up=w_gate_up, w_down=w_down, topk_weights=topk_weights,
                      topk_ids=topk_ids)  # fmt: skip
    check_expert_ids(topk_ids, experts)


def fused_moe(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """A mixture-of-experts layer with SwiGLU experts, fused: gather by expert, grouped gate/up GEMM with the
    activation in its epilogue, grouped down GEMM, weighted combine.

    Args:
        hidden: ``[tokens, hidden]`` (float16, bfloat16, float32; any strides: the backward copies one whose
            last stride is not 1).
        w_gate_up: ``[experts, 2 * intermediate, hidden]``, hidden's dtype: each expert's gate rows then its
            up rows (vLLM's ``w13``, Hugging Face's ``*Experts.gate_up_proj``).
        w_down: ``[experts, hidden, intermediate]`` (vLLM's ``w2``, ``*Experts.down_proj``).
        topk_weights: ``[tokens, top_k]`` routing weights (float16, bfloat16 or float32;
            :func:`llm_speed.moe_route`'s).
        topk_ids: ``[tokens, top_k]`` int32 or int64 experts, in ``[0, experts)``.
        activation: ``"silu"`` (SwiGLU: ``silu(gate) * up``).

    Returns ``[tokens, hidden]`` in hidden's dtype: ``sum_j w[t, j] * down_e(silu(gate_e(x)) * up_e(x))``.
    Products accumulate in float32; the activation and the expert outputs are rounded to hidden's dtype
    once each, and the combine sums in float32. Differentiable in hidden, both weights and topk_weights
    (module docstring: what is saved, what is recomputed). Expert ids are checked where reading them is
    free (CPU tensors, or ``LLM_SPEED_CHECK_INPUTS=1``); unchecked, a token with an id out of range gets a
    NaN row. Reference: :func:`llm_speed.moe.reference.fused_moe_reference`.
    """
    if isinstance(hidden, torch.Tensor):  # float32 weights beside autocast's 16-bit activations meet
        hidden, w_gate_up, w_down = autocast.cast_inputs(autocast.LOWER, hidden, w_gate_up, w_down)
    _validate(hidden, w_gate_up, w_down, topk_weights, topk_ids, activation)
    return _forward_call(hidden, w_gate_up, w_down, topk_weights.contiguous(), topk_ids.contiguous())[0]


__all__ = ["backward_config", "combine_config", "fused_moe"]
