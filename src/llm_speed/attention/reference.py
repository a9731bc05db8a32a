"""Plain PyTorch attention: the specification every kernel is checked against.

It computes in the dtype of its inputs, so the same function gives the float64 reference (pass float64
tensors) and the "same-precision PyTorch version" whose error sets the tolerance of the kernel tests.
"""

from __future__ import annotations

import functools
import math

import torch


def causal_visible(seq_q: int, seq_kv: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Boolean ``[seq_q, seq_kv]``: True where query i may see key j, i.e. ``j <= i + seq_kv - seq_q``.

    The mask is aligned bottom-right (the last query sees every key), as FlashAttention >= 2.1 and KV-cache
    prefill need. PyTorch SDPA's ``is_causal`` is aligned top-left (``j <= i``); the two agree only when
    seq_q == seq_kv.
    """
    rows = torch.arange(seq_q, device=device)[:, None]
    cols = torch.arange(seq_kv, device=device)[None, :]
    return cols <= rows + (seq_kv - seq_q)


def visible(
    seq_q: int,
    seq_kv: int,
    *,
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean ``[seq_q, seq_kv]``: True where query i may see key j under a causal mask and/or a window.

    With ``p = i + seq_kv - seq_q`` (query i's bottom-right aligned position), ``window=(left, right)`` keeps
    keys ``p - left <= j <= p + right``; None on a side leaves it unbounded. ``is_causal`` forces right = 0.
    This is flash-attn's ``window_size`` convention (Dao-AILab/flash-attention, ``flash_attn_func``): a
    Mistral / Gemma-2 sliding window of W tokens is ``window=(W - 1, 0)`` with ``is_causal=True``.
    """
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0
    rows = torch.arange(seq_q, device=device)[:, None] + (seq_kv - seq_q)
    cols = torch.arange(seq_kv, device=device)[None, :]
    mask = torch.ones((seq_q, seq_kv), dtype=torch.bool, device=device)
    if left is not None:
        mask &= cols >= rows - left
    if right is not None:
        mask &= cols <= rows + right
    return mask


def apply_softcap(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma 2, arXiv:2408.00118; Grok-1), or ``scores`` when None."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
):
    """softmax(mask(softcap(q k^T * scale))) v in the inputs' own dtype, K/V repeated over each GQA group.

    Same signature and semantics as :func:`llm_speed.flash_attention`: a row that sees no key gives output 0
    and LSE -inf (the LSE is of the capped, scaled scores). Masks as :func:`visible`. Differentiable (plain
    torch ops). Memory O(seq_q * seq_kv) per head: a test tool only.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = apply_softcap((q @ k.transpose(-1, -2)) * scale, softcap)
    if is_causal or window is not None:
        mask = visible(q.shape[2], k.shape[2], is_causal=is_causal, window=window, device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    out, lse = softmax_times_values(scores, v)
    return (out, lse) if return_lse else out


def softmax_times_values(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(scores) @ v, logsumexp(scores))``; a row of all -inf gives 0 and -inf, with finite grads.

    The row max is detached: softmax does not depend on it, and differentiating through it would turn the
    -inf rows into NaN gradients.
    """
    if scores.shape[-1] == 0:  # no key at all: amax would raise; every row sees nothing
        row_max = scores.new_zeros((*scores.shape[:-1], 1))
    else:
        row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    weights = torch.exp(scores - row_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    no_key = row_sum == 0
    safe_sum = torch.where(no_key, torch.ones_like(row_sum), row_sum)
    out = (weights / safe_sum) @ v
    lse = torch.where(no_key, torch.full_like(row_sum, float("-inf")), row_max + torch.log(safe_sum))
    return out, lse.squeeze(-1)


# --- the float32 paths of the ops where Triton cannot run (CPU tensors without the interpreter) -----------


def reference_forward(q, k, v, *, is_causal: bool, window, softcap: float | None, scale: float):
    """(out in q's dtype, lse float32) of :func:`reference_attention` computed in float32, both contiguous."""
    out, lse = reference_attention(
        q.float(), k.float(), v.float(), is_causal=is_causal, scale=scale, return_lse=True, window=window,
        softcap=softcap,
    )  # fmt: skip
    return out.to(q.dtype).contiguous(), lse.contiguous()


def reference_backward(dout, q, k, v, out, lse, dlse, *, is_causal: bool, window, softcap, scale: float):
    """(dq, dk, dv) of the float32 reference, written out (autograd does not record inside an operator's
    implementation): P from the saved LSE, dV = P^T dO, dS = P (dO V^T - delta) (1 - tanh^2 under a cap),
    dQ = dS K scale, dK = dS^T Q scale, dK and dV summed over each query group."""
    heads_kv = k.shape[1]
    group = q.shape[1] // heads_kv
    q32, k32, v32 = (t.float() for t in (q, k, v))
    k_rep, v_rep = k32.repeat_interleave(group, dim=1), v32.repeat_interleave(group, dim=1)
    raw = (q32 @ k_rep.transpose(-1, -2)) * scale
    scores = apply_softcap(raw, softcap)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - lse_safe[..., None])
    seen = visible(q.shape[-2], k.shape[-2], is_causal=is_causal, window=window, device=q.device)
    p = p.masked_fill(~seen, 0.0)
    p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(p), p)
    do32 = dout.float()
    delta = (do32 * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    ds = p * (do32 @ v_rep.transpose(-1, -2) - delta[..., None])
    if softcap is not None:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = (ds @ k_rep) * scale
    dk = (ds.transpose(-1, -2) @ q32) * scale
    dv = p.transpose(-1, -2) @ do32

    def per_kv_head(x):
        return x.reshape(x.shape[0], heads_kv, group, *x.shape[2:]).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def _sequences(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    """Rows ``[seq, heads, head_dim]`` of one sequence as a dense batch ``[1, heads, seq, head_dim]``."""
    return t.transpose(0, 1).unsqueeze(0)


def varlen_reference_forward(q, k, v, cu_q, cu_k, **options):
    """(out, lse ``[heads, total_q]``) of packed sequences, each through :func:`reference_forward` (reads
    ``cu_seqlens`` on the host: CPU tensors only)."""
    outs, lses = [], []
    for (q0, q1), (k0, k1) in zip(_sequences(cu_q), _sequences(cu_k), strict=True):
        out, lse = reference_forward(*(_as_batch(t) for t in (q[q0:q1], k[k0:k1], v[k0:k1])), **options)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs, 0) if outs else q.clone()
    lse = torch.cat(lses, 1) if lses else q.new_empty((q.shape[1], 0), dtype=torch.float32)
    return out.contiguous(), lse.contiguous()


def varlen_reference_backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, **options):
    """(dq, dk, dv) of packed sequences, each through :func:`reference_backward` (CPU tensors only)."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, q1), (k0, k1) in zip(_sequences(cu_q), _sequences(cu_k), strict=True):
        if q1 > q0 and k1 > k0:
            grads = reference_backward(
                *(_as_batch(t[q0:q1]) for t in (dout, q)), *(_as_batch(t[k0:k1]) for t in (k, v)),
                _as_batch(out[q0:q1]), lse[None, :, q0:q1], None if dlse is None else dlse[None, :, q0:q1],
                **options,
            )  # fmt: skip
            dq[q0:q1], dk[k0:k1], dv[k0:k1] = (g[0].transpose(0, 1) for g in grads)
    return dq, dk, dv


# --- the KV-cache op (flash_attention_with_kvcache) ---------------------------------------------------------


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, *,
                 interleaved: bool) -> torch.Tensor:  # fmt: skip
    """Rotary embedding (RoPE) of ``x`` ``[..., seq, heads, D]`` at ``positions`` (int, broadcastable to
    ``[..., seq]``): dims below ``rotary_dim = 2 * cos.shape[1]`` rotated pairwise by the angles of row
    ``positions`` of ``cos``/``sin`` ``[seqlen_ro, rotary_dim / 2]``, the others unchanged. Pairs (2c, 2c + 1)
    when ``interleaved`` (GPT-J), else (c, c + rotary_dim / 2) (GPT-NeoX): ``(x, y) -> (x cos - y sin,
    x sin + y cos)``. Computed in float32 (float64 for float64 ``x``) and returned in x's dtype, as
    flash-attn rotates before its matmuls."""
    work = torch.promote_types(x.dtype, torch.float32)
    half = cos.shape[1]
    c = cos.to(work)[positions][..., None, :]  # [..., seq, 1, half]
    s = sin.to(work)[positions][..., None, :]
    rot = x[..., : 2 * half].to(work)
    if interleaved:
        a, b = rot[..., 0::2], rot[..., 1::2]
        turned = torch.stack([a * c - b * s, a * s + b * c], dim=-1).flatten(-2)
    else:
        a, b = rot[..., :half], rot[..., half:]
        turned = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([turned.to(x.dtype), x[..., 2 * half :]], dim=-1)


def alibi_bias(slopes: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """ALiBi's ``-slope * |p_i - j|`` ``[heads, seq_q, seq_k]`` for ``slopes`` [heads], query positions
    ``query_pos`` [seq_q] and key positions ``key_pos`` [seq_k] (Press et al., arXiv:2108.12409; the
    non-causal form of flash-attn's ``attn_bias_from_alibi_slopes``), in the slopes' dtype."""
    distance = (query_pos[:, None] - key_pos[None, :]).abs().to(slopes.dtype)
    return -slopes[:, None, None] * distance


def _cache_slots(block_table, page_size: int, b: int, row: int, positions: torch.Tensor):
    """Index of sequence b's cache positions: (row, positions) when dense, (page, slot) when paged."""
    if block_table is None:
        return row, positions
    return block_table[b, positions // page_size].long(), positions % page_size


def reference_kvcache(
    q, k_cache, v_cache, cache_seqlens, k=None, v=None, *, block_table=None, cache_batch_idx=None,
    cache_leftpad=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True, alibi_slopes=None,
    is_causal=False, scale=None, window=None, softcap=None,
):  # fmt: skip
    """:func:`llm_speed.attention.decode.flash_attention_with_kvcache` in plain PyTorch, in the dtype of its
    inputs (float64 inputs: the truth; the op's dtype: the same-precision version): returns ``(out
    [batch, seq_q, heads_q, D], lse [batch, heads_q, seq_q], k_cache, v_cache)`` with the new tokens
    written into copies of the caches (k rotated first when rotary). Per sequence b: keys at cache positions
    ``leftpad .. cache_seqlens + seq_new - 1``, query i at ``p_i = cache_seqlens + seq_new - seq_q + i``;
    scores ``softcap(q.k * scale) - slope * |p_i - j|``, masked to ``p_i - left <= j <= p_i + right``
    (right = 0 when causal). Rotary positions as the op's docstring. Reads the index tensors on the host (a
    test tool)."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    batch, seq_q, heads_q, dim = q.shape
    seq_new = 0 if k is None else k.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0
    lens = cache_seqlens.tolist() if isinstance(cache_seqlens, torch.Tensor) else [cache_seqlens] * batch
    per_row = left is not None or right is not None
    outs, lses = [], []
    for b in range(batch):
        cached = lens[b]
        start = int(cache_leftpad[b]) if cache_leftpad is not None else 0
        row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
        slots = functools.partial(_cache_slots, block_table, k_cache.shape[1], b, row)
        if seq_new:
            new_pos = torch.arange(cached, cached + seq_new)
            k_new = k[b]
            if rotary_cos is not None:
                k_new = apply_rotary(k_new, rotary_cos, rotary_sin, new_pos, interleaved=rotary_interleaved)
            k_cache[slots(new_pos)] = k_new
            v_cache[slots(new_pos)] = v[b]
        seqlen_k = cached + seq_new
        key_pos = torch.arange(start, seqlen_k)
        keys, values = k_cache[slots(key_pos)], v_cache[slots(key_pos)]  # [seq_k, heads_kv, D]
        q_b = q[b]
        if rotary_cos is not None:
            q_pos = cached + (torch.arange(seq_q) if per_row else torch.zeros(seq_q, dtype=torch.long))
            q_b = apply_rotary(q_b, rotary_cos, rotary_sin, q_pos, interleaved=rotary_interleaved)
        group = heads_q // keys.shape[1]
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads_q, seq_k, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        scores = apply_softcap((q_b.transpose(0, 1) @ keys.transpose(-1, -2)) * scale, softcap)
        query_pos = torch.arange(seq_q) + seqlen_k - seq_q
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
            scores = scores + alibi_bias(slopes.to(scores.dtype), query_pos, key_pos)
        mask = torch.ones(seq_q, len(key_pos), dtype=torch.bool)
        if left is not None:
            mask &= key_pos[None, :] >= query_pos[:, None] - left
        if right is not None:
            mask &= key_pos[None, :] <= query_pos[:, None] + right
        out, lse = softmax_times_values(scores.masked_fill(~mask, float("-inf")), values)
        outs.append(out.transpose(0, 1))
        lses.append(lse)
    out = torch.stack(outs) if outs else q.new_empty(q.shape)
    lse = torch.stack(lses) if lses else q.new_empty((batch, heads_q, seq_q))
    return out, lse, k_cache, v_cache
