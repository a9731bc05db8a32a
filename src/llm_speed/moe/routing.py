"""Mixture-of-experts routing in Triton: top-k expert choice per token, and the sort that groups the token
copies by expert.

:func:`moe_route` covers the routers of the open MoE models: softmax scores, top-k, renormalised or not
(Mixtral; Qwen2/Qwen3-MoE's ``norm_topk_prob``), and DeepSeek-V3's sigmoid scores with a correction bias
that steers the choice but not the weights, grouped top-k (only the experts of the ``topk_group`` best of
``n_group`` groups compete) and a routed scaling factor. One program routes a block of tokens, the whole
expert row in registers; the backward (gradient for the router logits through the weights) recomputes the
scores from the logits.

:func:`moe_sort` groups the ``tokens * top_k`` token copies by expert, each expert's copies in token order
(deterministic): the ``order`` of the copies, each expert's cumulative end (``offsets``, as
:func:`llm_speed.grouped_gemm` takes them) and the ``inverse`` permutation (where each copy went), found on
the device in two launches (counts per chunk of copies, then each chunk places its copies after those of
the chunks before it), with no host read. Copies with an id outside ``[0, num_experts)`` are placed last,
past ``offsets[-1]``: the fused layer turns their rows into NaN.

Layout (every op module): kernels, launcher, op registration, autograd, public functions. Plain-PyTorch
specs: :func:`llm_speed.moe.reference.moe_route_reference` and
:func:`~llm_speed.moe.reference.moe_sort_reference`.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from ..core import runtime, tensors
from ..core.args import check_choice, check_flag, check_real, positive_int
from ..core.config import KernelConfig
from ..core.dispatch import Op
from ..core.hardware import hardware_of
from ..core.kernel_math import cast, rne_by_hand
from ..core.launch import Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.tensors import check_same_device, check_tensor
from . import reference
from .checks import INDEX_DTYPES, check_expert_ids

SCORINGS = ("softmax", "sigmoid")
# Added to the chosen scores' sum before renormalizing, as DeepSeek-V3 does (modeling_deepseek.py's
# ``topk_weight.sum(dim=-1, keepdim=True) + 1e-20``): nothing at a softmax's sum (>= 1/experts), and weights 0
# instead of 0/0 where every chosen sigmoid score is 0 (logits below about -104 in float32).
RENORMALIZE_EPS: tl.constexpr = tl.constexpr(1e-20)

# --- kernels --------------------------------------------------------------------------------------------


@triton.jit
def _scores(logits_ptr, o_t, o_e, tokens, experts, stride_l, SOFTMAX: tl.constexpr):
    """fp32 scores [BLOCK_T, BLOCK_E] of a block of tokens (0 in padded columns)."""
    m_e = o_e < experts
    m = (o_t < tokens)[:, None] & m_e[None, :]
    x = tl.load(logits_ptr + o_t.to(tl.int64)[:, None] * stride_l + o_e[None, :], mask=m, other=0.0)
    x = tl.where(m_e[None, :], x.to(tl.float32), float("-inf"))
    if SOFTMAX:
        p = tl.exp(x - tl.max(x, axis=1)[:, None])
        p = tl.where(m_e[None, :], p, 0.0)
        return p / tl.sum(p, axis=1)[:, None]
    return tl.where(m_e[None, :], tl.sigmoid(x), 0.0)


@triton.jit
def _route_fwd_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr,
    tokens, experts, group_size, stride_l, scale,
    TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """Top-k routing of BLOCK_T tokens: scores, choice (scores + bias, grouped), k rounds of argmax.

    Ties go to the lowest expert id. Weights are the chosen scores (without the bias), divided by their sum
    when RENORMALIZE, times ``scale``; written in float32 with the ids (int32), both ``[tokens, TOP_K]``.
    FLOPs: O(tokens * experts * (TOP_K + N_GROUP)) comparisons. Bytes: the logits read, 8 per choice written.
    """
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < experts
    scores = _scores(logits_ptr, o_t, o_e, tokens, experts, stride_l, SOFTMAX=SOFTMAX)
    choice = scores
    if HAS_BIAS:
        choice += tl.load(bias_ptr + o_e, mask=m_e, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(m_e[None, :], choice, float("-inf"))
    if N_GROUP > 1:
        group = o_e // group_size
        o_g = tl.arange(0, BLOCK_G)
        group_scores = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
        for gi in tl.static_range(N_GROUP):
            v = tl.where((group == gi)[None, :], choice, float("-inf"))
            best = tl.max(v, axis=1)
            if GROUP_TOP2:  # the group's two best choices, summed (DeepSeek-V3)
                first = tl.argmax(v, axis=1)
                v = tl.where(o_e[None, :] == first[:, None], float("-inf"), v)
                best += tl.max(v, axis=1)
            group_scores = tl.where(o_g[None, :] == gi, best[:, None], group_scores)
        kept = tl.zeros((BLOCK_T, BLOCK_G), tl.int32)
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.argmax(group_scores, axis=1)
            hit = o_g[None, :] == top[:, None]
            kept = tl.where(hit, 1, kept)
            group_scores = tl.where(hit, float("-inf"), group_scores)
        allowed = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)
        for gi in tl.static_range(N_GROUP):
            kept_gi = tl.max(tl.where(o_g[None, :] == gi, kept, 0), axis=1)
            allowed = tl.where((group == gi)[None, :], kept_gi[:, None], allowed)
        choice = tl.where(allowed > 0, choice, float("-inf"))
    o_k = tl.arange(0, BLOCK_K)
    w = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    for j in tl.static_range(TOP_K):
        top = tl.argmax(choice, axis=1)
        hit = o_e[None, :] == top[:, None]
        w = tl.where(o_k[None, :] == j, tl.sum(tl.where(hit, scores, 0.0), axis=1)[:, None], w)
        ids = tl.where(o_k[None, :] == j, top[:, None].to(tl.int32), ids)
        choice = tl.where(hit, float("-inf"), choice)
    if RENORMALIZE:  # + EPS as DeepSeek-V3: chosen sigmoid scores that are all 0 give weights 0, not 0/0
        w = w / (tl.sum(w, axis=1) + RENORMALIZE_EPS)[:, None]
    m = (o_t < tokens)[:, None] & (o_k < TOP_K)[None, :]
    out = o_t.to(tl.int64)[:, None] * TOP_K + o_k[None, :]
    tl.store(weights_ptr + out, w * scale, mask=m)
    tl.store(ids_ptr + out, ids, mask=m)


@triton.jit
def _route_bwd_kernel(
    logits_ptr, dweights_ptr, ids_ptr, dlogits_ptr,
    tokens, experts, stride_l, stride_dw, stride_dl, scale,
    TOP_K: tl.constexpr, SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr, RNE_BY_HAND: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """d(logits) of the weights of :func:`_route_fwd_kernel` (the choice itself has no gradient).

    With v_j the chosen scores and S their sum: dv_j = scale * dw_j, or with RENORMALIZE
    ``scale * (dw_j - sum_i dw_i v_i / S) / S`` (S + RENORMALIZE_EPS, as the forward divides by) for every
    chosen j, a chosen dw_j of 0 included; scattered to the experts as G, then through the scores:
    softmax ``p * (G - sum(G * p))``, sigmoid ``G * s * (1 - s)``.
    """
    o_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    o_e = tl.arange(0, BLOCK_E)
    m_t = o_t < tokens
    scores = _scores(logits_ptr, o_t, o_e, tokens, experts, stride_l, SOFTMAX=SOFTMAX)
    row_dw = dweights_ptr + o_t.to(tl.int64) * stride_dw
    row_ids = ids_ptr + o_t.to(tl.int64) * TOP_K
    g = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    picked = tl.zeros((BLOCK_T, BLOCK_E), tl.int32)  # the chosen columns (a chosen dw may be 0)
    chosen = tl.zeros((BLOCK_T,), tl.float32)
    dot_wv = tl.zeros((BLOCK_T,), tl.float32)
    for j in tl.static_range(TOP_K):
        idx = tl.load(row_ids + j, mask=m_t, other=-1)
        dw = tl.load(row_dw + j, mask=m_t, other=0.0).to(tl.float32)
        hit = o_e[None, :] == idx[:, None]
        v = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        chosen += v
        dot_wv += dw * v
        g = tl.where(hit, g + dw[:, None], g)
        picked = tl.where(hit, 1, picked)
    if RENORMALIZE:
        s = chosen + RENORMALIZE_EPS
        g = tl.where(picked > 0, (g - (dot_wv / s)[:, None]) / s[:, None], 0.0)
        # columns chosen twice cannot happen (top-k picks distinct experts); unchosen columns stay 0
    g = g * scale
    if SOFTMAX:
        dl = scores * (g - tl.sum(g * scores, axis=1)[:, None])
    else:
        dl = g * scores * (1.0 - scores)
    m = m_t[:, None] & (o_e < experts)[None, :]
    p = dlogits_ptr + o_t.to(tl.int64)[:, None] * stride_dl + o_e[None, :]
    tl.store(p, cast(dl, dlogits_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)


@triton.jit
def _expert_key(ids_ptr, o, m, experts):
    """Each copy's bucket: its expert id, or ``experts`` (after every expert) for an id out of range."""
    ids = tl.load(ids_ptr + o, mask=m, other=0)
    return tl.where((ids >= 0) & (ids < experts), ids, experts).to(tl.int32)


@triton.jit
def _sort_count_kernel(
    ids_ptr, counts_ptr, copies, experts, chunk, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr
):
    """Copies per bucket in chunk ``pid`` (``[pid * chunk, (pid + 1) * chunk)``): one row of ``counts``."""
    pid = tl.program_id(0)
    o_e = tl.arange(0, BLOCK_E)
    count = tl.zeros((BLOCK_E,), tl.int32)
    lo = pid * chunk
    hi = tl.minimum(lo + chunk, copies)
    for i0 in range(lo, hi, BLOCK):
        o = i0 + tl.arange(0, BLOCK)
        m = o < hi
        key = _expert_key(ids_ptr, o, m, experts)
        count += tl.sum(((key[:, None] == o_e[None, :]) & m[:, None]).to(tl.int32), axis=0)
    tl.store(counts_ptr + pid * BLOCK_E + o_e, count)


@triton.jit
def _sort_place_kernel(
    ids_ptr, counts_ptr, order_ptr, inverse_ptr, offsets_ptr,
    copies, experts, chunk, chunks,
    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Place chunk ``pid``'s copies: a bucket's copies go after those of the buckets before it and of the
    earlier chunks, in copy order (a cumulative sum of the one-hot rows); program 0 writes ``offsets``."""
    pid = tl.program_id(0)
    o_e = tl.arange(0, BLOCK_E)
    totals = tl.zeros((BLOCK_E,), tl.int32)
    before = tl.zeros((BLOCK_E,), tl.int32)
    for p in range(0, chunks):
        row = tl.load(counts_ptr + p * BLOCK_E + o_e)
        totals += row
        before += tl.where(p < pid, row, 0)
    ends = tl.cumsum(totals, axis=0)
    tl.store(offsets_ptr + o_e, ends, mask=o_e < tl.where(pid == 0, experts, 0))
    base = ends - totals + before
    lo = pid * chunk
    hi = tl.minimum(lo + chunk, copies)
    for i0 in range(lo, hi, BLOCK):
        o = i0 + tl.arange(0, BLOCK)
        m = o < hi
        key = _expert_key(ids_ptr, o, m, experts)
        hit = ((key[:, None] == o_e[None, :]) & m[:, None]).to(tl.int32)
        rank = tl.cumsum(hit, axis=0)
        pos = tl.sum(tl.where(hit > 0, base[None, :] + rank - 1, 0), axis=1)
        tl.store(order_ptr + pos, o, mask=m)
        tl.store(inverse_ptr + o, pos, mask=m)
        base += tl.sum(hit, axis=0)


# --- launcher -------------------------------------------------------------------------------------------

ROUTE_FORWARD = Kernel(_route_fwd_kernel, "moe.route_fwd")
ROUTE_BACKWARD = Kernel(_route_bwd_kernel, "moe.route_bwd")
SORT_COUNT = Kernel(_sort_count_kernel, "moe.sort_count")
SORT_PLACE = Kernel(_sort_place_kernel, "moe.sort_place")
ROUTE_BLOCK_ELEMENTS = 4096  # routing: tokens per program so that a program holds about this many scores
SORT_BLOCK = 64  # copies per step of the sort (a [SORT_BLOCK, experts + 1] one-hot tile)
INTERPRETER_CHUNKS = 3  # the sort's programs under the interpreter (more than one: the prefix is exercised)


@functools.cache
def route_config(tokens: int, experts: int) -> KernelConfig:
    """``block_m`` tokens of ``block_n`` (experts padded to a power of two) per program."""
    block_e = next_power_of_2(experts)
    block_t = min(next_power_of_2(tokens), max(1, ROUTE_BLOCK_ELEMENTS // block_e))
    return KernelConfig(block_t, block_e, num_warps=4 if block_t * block_e <= 4096 else 8, num_stages=1)


@functools.cache
def sort_config(copies: int, experts: int, programs: int) -> KernelConfig:
    """``splits`` chunks of copies (at most ``programs``: the SMs), each a multiple of SORT_BLOCK copies."""
    chunks = max(1, min(cdiv(copies, SORT_BLOCK), programs))
    chunk = cdiv(cdiv(copies, chunks), SORT_BLOCK) * SORT_BLOCK
    block_e = next_power_of_2(experts + 1)
    warps = 4 if SORT_BLOCK * block_e <= 8192 else 8
    return KernelConfig(
        SORT_BLOCK, chunk, num_warps=warps, num_stages=1, block_d=block_e, splits=cdiv(copies, chunk)
    )


@plan_cache
def _route_plan(
    tokens: int, experts: int, stride: int, top_k: int, softmax: bool, renormalize: bool, bias: bool,
    n_group: int, topk_group: int, dtypes: tuple, device: torch.device,
) -> Plan:  # fmt: skip
    cfg = route_config(tokens, experts)
    group_size = experts // n_group
    return ROUTE_FORWARD.plan(
        (cdiv(tokens, cfg.block_m),), tokens=tokens, experts=experts, group_size=group_size, stride_l=stride,
        TOP_K=top_k, SOFTMAX=softmax, RENORMALIZE=renormalize, HAS_BIAS=bias, N_GROUP=n_group,
        TOPK_GROUP=topk_group, GROUP_TOP2=bias and group_size >= 2, BLOCK_T=cfg.block_m, BLOCK_E=cfg.block_n,
        BLOCK_K=next_power_of_2(top_k), BLOCK_G=next_power_of_2(n_group),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


@plan_cache
def _route_backward_plan(
    tokens: int, experts: int, strides: tuple, top_k: int, softmax: bool, renormalize: bool, dtypes: tuple,
    device: torch.device,
) -> Plan:  # fmt: skip
    cfg = route_config(tokens, experts)
    return ROUTE_BACKWARD.plan(
        (cdiv(tokens, cfg.block_m),), tokens=tokens, experts=experts, stride_l=strides[0],
        stride_dw=strides[1], stride_dl=experts, TOP_K=top_k, SOFTMAX=softmax, RENORMALIZE=renormalize,
        RNE_BY_HAND=rne_by_hand(dtypes[0]), BLOCK_T=cfg.block_m, BLOCK_E=cfg.block_n,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


@plan_cache
def _sort_plans(copies: int, experts: int, ids_dtype: torch.dtype, device: torch.device) -> tuple[Plan, Plan]:
    programs = INTERPRETER_CHUNKS if runtime.INTERPRETED else hardware_of(device).sm_count
    cfg = sort_config(copies, experts, programs)
    common = dict(copies=copies, experts=experts, chunk=cfg.block_n, BLOCK=cfg.block_m, BLOCK_E=cfg.block_d,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    return SORT_COUNT.plan((cfg.splits,), **common), SORT_PLACE.plan(
        (cfg.splits,), chunks=cfg.splits, **common
    )


def sort_copies(topk_ids: torch.Tensor, num_experts: int):
    """``(order, offsets, inverse)`` of ``topk_ids`` [tokens, top_k] (contiguous) on the device: the
    Triton launches, or the reference where Triton does not run. No report, no checks."""
    copies = topk_ids.numel()
    device = topk_ids.device
    if not runtime.triton_runs_on(device):
        return reference.moe_sort_reference(topk_ids, num_experts)
    order = tensors.new_output((copies,), torch.int32, device)
    inverse = tensors.new_output((copies,), torch.int32, device)
    if copies == 0:
        return order, torch.zeros(num_experts, dtype=torch.int32, device=device), inverse
    offsets = tensors.new_output((num_experts,), torch.int32, device)
    count, place = _sort_plans(copies, num_experts, topk_ids.dtype, device)
    counts = tensors.new_output((count.grid[0], place.fixed["BLOCK_E"]), torch.int32, device)
    count.launch(ids_ptr=topk_ids, counts_ptr=counts)
    place.launch(
        ids_ptr=topk_ids, counts_ptr=counts, order_ptr=order, inverse_ptr=inverse, offsets_ptr=offsets
    )
    return order, offsets, inverse


def sort_forward(topk_ids: torch.Tensor, num_experts: int):
    """:func:`sort_copies`, reporting its work."""
    if topk_ids.numel():
        runtime.report_work("moe_sort", topk_ids=topk_ids, num_experts=num_experts)
    return sort_copies(topk_ids, num_experts)


def route_forward(logits, bias, top_k, scoring, renormalize, n_group, topk_group, scale):
    """(weights float32, ids int32) ``[tokens, top_k]``; reports its work."""
    tokens, experts = logits.shape
    if tokens:
        runtime.report_work("moe_route", router_logits=logits, top_k=top_k)
    if tokens == 0 or not runtime.triton_runs_on(logits.device):
        return reference.moe_route_reference(
            logits, top_k, scoring=scoring, renormalize=renormalize, bias=bias,
            n_group=n_group if n_group > 1 else None, topk_group=topk_group, routed_scaling_factor=scale,
        )  # fmt: skip
    weights = tensors.new_output((tokens, top_k), torch.float32, logits.device)
    ids = tensors.new_output((tokens, top_k), torch.int32, logits.device)
    plan = _route_plan(
        tokens, experts, logits.stride(0), top_k, scoring == "softmax", renormalize, bias is not None,
        n_group, topk_group, (logits.dtype, None if bias is None else bias.dtype), logits.device,
    )  # fmt: skip
    plan.launch(logits_ptr=logits, bias_ptr=logits if bias is None else bias, weights_ptr=weights,
                ids_ptr=ids, scale=scale)  # fmt: skip
    return weights, ids


def _route_backward_torch(dweights, logits, ids, scoring, renormalize, scale):
    ct = reference.compute_dtype(logits.dtype)
    with torch.enable_grad():
        x = logits.detach().to(ct).requires_grad_()
        scores = x.softmax(-1) if scoring == "softmax" else x.sigmoid()
        w = scores.gather(1, ids.long())
        if renormalize:
            w = w / w.sum(-1, keepdim=True)
        (grad,) = torch.autograd.grad(w * scale, x, dweights.to(ct))
    return grad.to(logits.dtype)


def route_backward(dweights, logits, ids, scoring, renormalize, scale):
    """d(router_logits) from d(weights); reports its work."""
    tokens, experts = logits.shape
    dweights = tensors.last_dim_contiguous(dweights)
    if tokens:
        runtime.report_work("moe_route_backward", router_logits=logits, top_k=ids.shape[1])
    if tokens == 0 or not runtime.triton_runs_on(logits.device):
        return _route_backward_torch(dweights, logits, ids, scoring, renormalize, scale)
    dlogits = tensors.new_output((tokens, experts), logits.dtype, logits.device)
    plan = _route_backward_plan(
        tokens, experts, (logits.stride(0), dweights.stride(0)), ids.shape[1], scoring == "softmax",
        renormalize, (logits.dtype, dweights.dtype, ids.dtype), logits.device,
    )  # fmt: skip
    plan.launch(logits_ptr=logits, dweights_ptr=dweights, ids_ptr=ids, dlogits_ptr=dlogits, scale=scale)
    return dlogits


# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::moe_route", mutates_args=())
def _route_op(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str, renormalize: bool,
    n_group: int, topk_group: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return route_forward(logits, bias, top_k, scoring, renormalize, n_group, topk_group, scale)


@_route_op.register_fake
def _route_fake(logits, bias, top_k, scoring, renormalize, n_group, topk_group, scale):
    shape = (logits.shape[0], top_k)
    return logits.new_empty(shape, dtype=torch.float32), logits.new_empty(shape, dtype=torch.int32)


@torch.library.custom_op("llm_speed::moe_route_backward", mutates_args=())
def _route_backward_op(
    dweights: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, scoring: str, renormalize: bool,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    return route_backward(dweights, logits, ids, scoring, renormalize, scale)


@_route_backward_op.register_fake
def _route_backward_fake(dweights, logits, ids, scoring, renormalize, scale):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


_route_backward_call = Op(_route_backward_op, route_backward)


@torch.library.custom_op("llm_speed::moe_sort", mutates_args=())
def _sort_op(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return sort_forward(topk_ids, num_experts)


@_sort_op.register_fake
def _sort_fake(topk_ids, num_experts):
    copies = topk_ids.numel()
    new = topk_ids.new_empty
    return (
        new((copies,), dtype=torch.int32),
        new((num_experts,), dtype=torch.int32),
        new((copies,), dtype=torch.int32),
    )


_sort_call = Op(_sort_op, sort_forward)


# --- autograd -------------------------------------------------------------------------------------------


def _route_setup_context(ctx, inputs, output):
    logits, _, _, scoring, renormalize, _, _, scale = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.scoring, ctx.renormalize, ctx.scale = scoring, renormalize, scale


def _route_backward(ctx, dweights, _dids):
    logits, ids = ctx.saved_tensors
    if dweights is None:
        return (None,) * 8
    dlogits = _route_backward_call(dweights, logits, ids, ctx.scoring, ctx.renormalize, ctx.scale)
    return dlogits, None, None, None, None, None, None, None


_route_call = Op(_route_op, route_forward, setup_context=_route_setup_context, backward=_route_backward)


# --- public functions -----------------------------------------------------------------------------------


def check_groups(experts: int, top_k: int, n_group, topk_group) -> tuple[int, int]:
    if n_group is None and topk_group is None:
        return 1, 1
    if n_group is None or topk_group is None:
        raise ValueError("n_group and topk_group go together: give both (grouped top-k) or neither")
    n_group = positive_int("n_group", n_group)
    topk_group = positive_int("topk_group", topk_group)
    if experts % n_group:
        raise ValueError(f"n_group ({n_group}) must divide the number of experts ({experts})")
    if topk_group > n_group:
        raise ValueError(f"topk_group ({topk_group}) must be at most n_group ({n_group})")
    if top_k > topk_group * (experts // n_group):
        raise ValueError(
            f"top_k ({top_k}) must be at most the experts of topk_group groups "
            f"({topk_group} x {experts // n_group})"
        )
    return n_group, topk_group


def _check_logit_values(router_logits: torch.Tensor, bias: torch.Tensor | None) -> None:
    """A NaN or +inf logit has no rank; -inf is a score of 0 (softmax without a bias: masked), but a row of
    them leaves none to choose (a host read: only where values are checked)."""
    if bias is not None:
        runtime.check_finite("bias", bias)
    bad = torch.isnan(router_logits) | (router_logits == math.inf)
    if bool(bad.any()):
        raise ValueError(f"router_logits must not hold NaN or +inf (-inf is a score of 0), got "
                         f"{router_logits[bad][0].item()}")  # fmt: skip
    if router_logits.shape[0] and bool((router_logits == -math.inf).all(1).any()):
        row = int((router_logits == -math.inf).all(1).nonzero()[0, 0])
        raise ValueError(f"router_logits row {row} is -inf for every expert: no expert can be chosen")


def moe_route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's top-k experts and their weights, in one Triton kernel: ``(topk_weights, topk_ids)``.

    Args:
        router_logits: ``[tokens, experts]`` (float16, bfloat16, float32; the last dim contiguous or copied).
            ``-inf`` gives an expert the score 0: with softmax scoring and no ``bias`` that masks it out
            (it is chosen only once every finite expert is); under sigmoid scoring, or with a ``bias``, 0 is
            a score like any other. NaN, ``+inf`` or a row of ``-inf`` only is refused where values are
            checked (CPU tensors), and unchecked gives that row no meaningful choice.
        top_k: experts per token, 1 to experts.
        scoring: ``"softmax"`` (Mixtral, Qwen2/Qwen3-MoE) or ``"sigmoid"`` (DeepSeek-V3), in float32.
        renormalize: divide the k chosen scores by their sum (Mixtral; Qwen's ``norm_topk_prob``).
        bias: ``[experts]`` correction bias added to the scores for the choice only (DeepSeek-V3's
            ``e_score_correction_bias``); not differentiated.
        n_group, topk_group: grouped top-k (DeepSeek-V3: 8 and 4): the experts form ``n_group`` equal
            groups, a group scores the sum of its two best ``score + bias`` (its best without a bias), and
            only the experts of the ``topk_group`` best groups are chosen from. Both or neither.
        routed_scaling_factor: multiplies the weights (DeepSeek-V3: 2.5).

    Returns ``topk_weights`` float32 and ``topk_ids`` int32, both ``[tokens, top_k]``, best first (ties: the
    lower id). Differentiable in ``router_logits`` through the weights (the choice itself is not).
    Reference: :func:`llm_speed.moe.reference.moe_route_reference`.
    """
    check_tensor("router_logits", router_logits, dims=2, what="[tokens, experts]")
    experts = router_logits.shape[1]
    if experts == 0:
        raise ValueError("router_logits must have at least one expert (shape[1] >= 1)")
    top_k = positive_int("top_k", top_k)
    if top_k > experts:
        raise ValueError(f"top_k ({top_k}) must be at most the number of experts ({experts})")
    check_choice("scoring", scoring, SCORINGS)
    renormalize = check_flag("renormalize", renormalize)
    scale = check_real("routed_scaling_factor", routed_scaling_factor, positive=True)
    if bias is not None:
        check_tensor("bias", bias, dims=1, what="[experts]")
        if bias.shape[0] != experts:
            raise ValueError(f"bias has {bias.shape[0]} entries; it must have one per expert ({experts})")
        check_same_device(router_logits=router_logits, bias=bias)
        bias = bias.contiguous()
    n_group, topk_group = check_groups(experts, top_k, n_group, topk_group)
    if runtime.check_values(router_logits.device):
        _check_logit_values(router_logits, bias)
    logits = tensors.last_dim_contiguous(router_logits)
    return _route_call(logits, bias, top_k, scoring, renormalize, n_group, topk_group, scale)


def moe_sort(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the token copies of a routing by expert, on the device: ``(order, offsets, inverse)``.

    ``topk_ids`` ``[tokens, top_k]`` (int32 or int64) holds each token's experts; copy ``c = t * top_k + j``
    is token t's j-th choice. ``order`` (int32 ``[tokens * top_k]``) lists the copies grouped by expert, each
    expert's in copy order; ``offsets`` (int32 ``[num_experts]``) is each expert's cumulative end in
    ``order`` (what :func:`llm_speed.grouped_gemm` takes); ``inverse`` (int32) is where each copy went:
    ``order[inverse[c]] == c``. Ids outside ``[0, num_experts)``: ValueError where the values are checked
    (CPU tensors, or ``LLM_SPEED_CHECK_INPUTS=1``); unchecked, those copies are placed last, past
    ``offsets[-1]``. Reference: :func:`llm_speed.moe.reference.moe_sort_reference`.
    """
    check_tensor("topk_ids", topk_ids, dtypes=INDEX_DTYPES, dims=2, what="[tokens, top_k]")
    num_experts = positive_int("num_experts", num_experts)
    check_expert_ids(topk_ids, num_experts)
    return _sort_call(topk_ids.contiguous(), num_experts)


__all__ = ["check_groups", "moe_route", "moe_sort", "route_config", "sort_config", "sort_copies"]
