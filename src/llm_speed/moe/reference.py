"""Plain-PyTorch specs of the mixture-of-experts ops: the same signatures and semantics as the kernels.

Loops over experts, as Hugging Face's ``*Experts.forward`` runs them: what the tests compare with (float64
inputs give the float64 truth; inputs in a kernel's dtype give the same-precision baseline), ``bench moe``'s
Hugging Face baseline, and the ops' CPU fallbacks (no Triton interpreter). They read ``offsets`` and the
expert ids on the host: references only, never an op's default path on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the references accumulate: float64 stays float64 (the truth), all else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def group_bounds(offsets: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, end)]`` of each group from cumulative ends (read on the host)."""
    ends = offsets.tolist()
    return list(zip([0, *ends[:-1]], ends, strict=False))


def grouped_gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    offsets: torch.Tensor,
    *,
    trans_b: bool = False,
    out_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``out[s:e] = a[s:e] @ op(b[g])`` for each group g of rows ``[s, e)`` (:func:`llm_speed.grouped_gemm`).

    Products in ``compute_dtype`` (default: a's dtype, as ``torch._grouped_mm`` in the same precision), the
    result in ``out_dtype`` (default: a's dtype).
    """
    out_dtype = out_dtype or a.dtype
    ct = compute_dtype or a.dtype
    n = b.shape[1] if trans_b else b.shape[2]
    out = torch.zeros(a.shape[0], n, dtype=ct, device=a.device)
    for g, (s, e) in enumerate(group_bounds(offsets)):
        if e > s:
            w = b[g].mT if trans_b else b[g]
            out[s:e] = a[s:e].to(ct) @ w.to(ct)
    return out.to(out_dtype)


def moe_route_reference(
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
    """Top-k routing as Mixtral/Qwen (softmax) and DeepSeek-V3 (sigmoid, correction bias, grouped top-k)
    write it in transformers and vLLM (``grouped_topk``); weights in float32 (float64 stays), ids int32.

    Experts are chosen on ``score + bias``; the weights are the scores without the bias. Grouped top-k:
    a group's score is the sum of its two best ``score + bias`` (its best one without a bias, or with groups
    of one expert), the ``topk_group`` best groups are kept, and top-k runs over their experts only.
    """
    ct = compute_dtype(router_logits.dtype)
    logits = router_logits.to(ct)
    scores = logits.softmax(-1) if scoring == "softmax" else logits.sigmoid()
    choice = scores if bias is None else scores + bias.to(ct)
    if n_group is not None and n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, n_group, experts // n_group)
        if bias is not None and experts // n_group >= 2:
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.max(-1).values
        keep = group_scores.topk(topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        mask = mask[:, :, None].expand_as(grouped).reshape(tokens, experts)
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:  # + 1e-20 as DeepSeek-V3: chosen sigmoid scores that are all 0 give 0, not 0/0
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids.to(torch.int32)


def moe_sort_reference(topk_ids: torch.Tensor, num_experts: int):
    """``(order, offsets, inverse)`` of :func:`llm_speed.moe_sort`: token copies (flat index ``t * top_k +
    j``) grouped by expert, each expert's copies in token order; ids outside ``[0, num_experts)`` last."""
    flat = topk_ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return order.to(torch.int32), counts.cumsum(0).to(torch.int32), inverse.to(torch.int32)


def fused_moe_reference(
    hidden: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: str = "silu",
) -> torch.Tensor:
    """Hugging Face's expert loop (``MixtralExperts.forward``): for each expert hit, its tokens' gate/up
    projection, ``silu(gate) * up``, the down projection, times the routing weight, summed into the output in
    hidden's dtype. Differentiable in every float input (plain autograd)."""
    out = torch.zeros_like(hidden)
    num_experts = w_gate_up.shape[0]
    ids = topk_ids.long()
    for e in range(num_experts):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        gate, up = F.linear(hidden[token], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e])
        y = y * topk_weights[token, slot, None]
        out = out.index_add(0, token, y.to(out.dtype))
    return out
