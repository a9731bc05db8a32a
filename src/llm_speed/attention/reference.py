"""Plain PyTorch attention: the specification every kernel is checked against.

It computes in the dtype of its inputs, so the same function gives the float64 reference (pass float64
tensors) and the "same-precision PyTorch version" whose error sets the tolerance of the kernel tests.
"""

from __future__ import annotations

import functools
import math

import torch

from ..fused.reference import rotate

# fp8 attention's weights reach the PV product as e4m3 scaled by 2**FP8_WEIGHTS_OFFSET (FlashAttention-3's
# Max_offset, arXiv:2407.08608): in (0, 256] they use e4m3's range instead of flushing below 2**-9.
FP8_WEIGHTS_OFFSET = 8


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


# Philox-4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011), as triton.language
# implements it; written in int64 arithmetic so the dropout mask of the kernels can be rebuilt in PyTorch.
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_MASK32 = 0xFFFFFFFF


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of the 64-bit product of the constant ``a`` and uint32 values ``b``
    (int64 tensors), without int64 overflow: b is split into 16-bit halves."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    p_hi, p_lo = a * b_hi, a * b_lo  # each < 2**48
    high = (p_hi + (p_lo >> 16)) >> 16
    low = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return high, low


def philox(seed: int, c0, c1, c2, c3, rounds: int = 10) -> torch.Tensor:
    """The first 32-bit output of Philox-4x32 for counters (c0, c1, c2, c3) (broadcast int64 tensors of
    uint32 values) and the 64-bit ``seed`` as key, as ``tl.philox`` returns it."""
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    c0, c1, c2, c3 = torch.broadcast_tensors(*(torch.as_tensor(c, dtype=torch.int64) & _MASK32
                                               for c in (c0, c1, c2, c3)))  # fmt: skip
    for _ in range(rounds):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32
    return c0


def dropout_keep(
    rng: torch.Tensor, dropout_p: float, bh: torch.Tensor | int, seq_q: int, seq_kv: int, device=None
) -> torch.Tensor:
    """Boolean ``[..., seq_q, seq_kv]``: True where the kernels' attention dropout keeps a weight.

    ``rng``: the call's int64 ``(seed, offset)``; ``bh``: the (sequence * heads_q + head) index of each
    head, an int or an int64 tensor broadcast over the leading dims (``[batch, heads, 1, 1]``). One Philox
    draw per entry with counters (key, query, bh, offset), turned into a float in [0, 1) as
    ``tl.uint_to_uniform_float`` does and kept where it is >= dropout_p (all in float32, as the kernels).
    Computed on the CPU (reads ``rng`` on the host), returned on ``device``: a test and fallback tool."""
    seed, offset = (int(x) for x in rng.tolist())
    rows = torch.arange(seq_q, dtype=torch.int64)[:, None]
    cols = torch.arange(seq_kv, dtype=torch.int64)[None, :]
    bh = torch.as_tensor(bh, dtype=torch.int64)
    draw = philox(seed, cols, rows, bh, torch.tensor(offset, dtype=torch.int64))
    signed = torch.where(draw >= 2**31, draw - 2**32, draw)  # the bits as int32
    signed = torch.where(signed < 0, -signed - 1, signed)
    uniform = signed.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)
    return (uniform >= torch.tensor(dropout_p, dtype=torch.float32)).to(device)


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
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    dropout_mask: torch.Tensor | None = None,
    fp8_weights: bool = False,
):
    """softmax(mask(softcap(q k^T * scale) + alibi)) v in the inputs' own dtype, K/V repeated over each GQA
    group; ``fp8_weights``: the weights rounded to e4m3 before the product with v, as fp8 attention does
    (:func:`softmax_times_values`).

    Same signature and semantics as :func:`llm_speed.flash_attention`: a row that sees no key gives output 0
    and LSE -inf (the LSE is of the capped, scaled, biased scores). Masks as :func:`visible`; ALiBi as
    :func:`dense_alibi_bias`. Dropout: ``dropout_mask`` (bool, broadcast to the weights; True = kept) zeroes
    the dropped weights after the softmax and scales the kept ones by 1 / (1 - dropout_p); the LSE is the one
    before dropout. Differentiable (plain torch ops). Memory O(seq_q * seq_kv) per head: a test tool only.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = apply_softcap((q @ k.transpose(-1, -2)) * scale, softcap)
    if alibi_slopes is not None:
        scores = scores + dense_alibi_bias(alibi_slopes.to(scores.dtype), q.shape[2], k.shape[2])
    if is_causal or window is not None:
        mask = visible(q.shape[2], k.shape[2], is_causal=is_causal, window=window, device=q.device)
        scores = scores.masked_fill(~mask, float("-inf"))
    out, lse = softmax_times_values(scores, v, dropout_mask, dropout_p, fp8_weights)
    return (out, lse) if return_lse else out


def attention_probabilities(
    q, k, lse, *, scale: float, is_causal: bool = False, window=None, softcap=None, alibi_slopes=None
) -> torch.Tensor:
    """The softmax weights ``[batch, heads_q, seq_q, seq_kv]`` float32 of dense ``[B, H, S, D]`` inputs,
    normalised by a forward's saved natural-log ``lse`` (0 where hidden or where a row sees no key). Memory
    O(seq_q * seq_kv) per head: for tests and small problems (flash-attn's ``return_attn_probs``)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    scores = apply_softcap((q.float() @ k.transpose(-1, -2)) * scale, softcap)
    if alibi_slopes is not None:
        scores = scores + dense_alibi_bias(alibi_slopes.float(), q.shape[2], k.shape[2])
    seen = visible(q.shape[2], k.shape[2], is_causal=is_causal, window=window, device=q.device)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    return torch.where(seen & ~torch.isinf(lse)[..., None], probs, torch.zeros_like(probs))


def softmax_times_values(
    scores: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None = None, dropout_p: float = 0.0,
    fp8_weights: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(scores) @ v, logsumexp(scores))``; a row of all -inf gives 0 and -inf, with finite grads.
    ``keep``: the dropout mask applied to the weights (kept ones scaled by 1 / (1 - dropout_p)).
    ``fp8_weights``: fp8 attention's rounding, ``exp(s - max) * 2**FP8_WEIGHTS_OFFSET`` to e4m3 before the
    product with v, divided by the sum of the unrounded weights (FlashAttention-3's).

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
    if fp8_weights:
        scaled = weights * 2.0**FP8_WEIGHTS_OFFSET  # <= 256: no saturation
        weights = scaled.to(torch.float8_e4m3fn).to(scaled.dtype) / (safe_sum * 2.0**FP8_WEIGHTS_OFFSET)
    else:
        weights = weights / safe_sum
    if keep is not None:
        weights = torch.where(keep, weights / (1.0 - dropout_p), torch.zeros_like(weights))
    out = weights @ v
    lse = torch.where(no_key, torch.full_like(row_sum, float("-inf")), row_max + torch.log(safe_sum))
    return out, lse.squeeze(-1)


# --- the float32 paths of the ops where Triton cannot run (CPU tensors without the interpreter) -----------


def kernel_dropout_keep(rng, dropout_p: float, batch: int, heads: int, seq_q: int, seq_kv: int, device,
                        first: int = 0):  # fmt: skip
    """The kernels' dropout mask ``[batch, heads, seq_q, seq_kv]`` of sequences ``first ..`` (None without
    dropout): :func:`dropout_keep` with bh = sequence * heads + head."""
    if not dropout_p:
        return None
    bh = (first + torch.arange(batch))[:, None, None, None] * heads + torch.arange(heads)[None, :, None, None]
    return dropout_keep(rng, dropout_p, bh, seq_q, seq_kv, device)


def dequantize_attention_inputs(q, k, v, descales, dtype=torch.float32):
    """fp8 attention's q ``[B, Hq, S, D]``, k, v ``[B, Hkv, S, D]`` in ``dtype``, each times its descale
    (``descales`` = (descale_q, descale_k, descale_v): float32 ``[]``, ``[1]``, ``[Hkv]``, ``[B, Hkv]`` or
    None for 1; query head h takes descale_q of its KV head h // group, as FlashAttention-3)."""
    batch, heads_kv = q.shape[0], k.shape[1]
    group = q.shape[1] // heads_kv
    out = []
    for x, descale, rep in zip((q, k, v), descales, (group, 1, 1), strict=True):
        x = x.to(dtype)
        if descale is not None:
            rows = descale_rows(descale, batch, heads_kv).to(dtype).repeat_interleave(rep, dim=1)
            x = x * rows[:, :, None, None]
        out.append(x)
    return out


def reference_forward(q, k, v, *, is_causal: bool, window, softcap: float | None, scale: float,
                      alibi_slopes=None, dropout_p: float = 0.0, rng=None, first: int = 0,
                      descales=None):  # fmt: skip
    """(out in q's dtype, lse float32) of :func:`reference_attention` computed in float32, both contiguous;
    dropout with the kernels' mask (``rng``; ``first``: the index of the first sequence, for packed ones).
    fp8 (``descales`` given): the inputs dequantized (:func:`dequantize_attention_inputs`), the weights
    rounded as the kernel rounds them, out bfloat16."""
    keep = kernel_dropout_keep(rng, dropout_p, *q.shape[:3], k.shape[2], q.device, first)
    fp8 = descales is not None
    q32, k32, v32 = dequantize_attention_inputs(q, k, v, descales) if fp8 else (x.float() for x in (q, k, v))
    out, lse = reference_attention(
        q32, k32, v32, is_causal=is_causal, scale=scale, return_lse=True, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_mask=keep, fp8_weights=fp8,
    )  # fmt: skip
    return out.to(torch.bfloat16 if fp8 else q.dtype).contiguous(), lse.contiguous()


def reference_backward(dout, q, k, v, out, lse, dlse, *, is_causal: bool, window, softcap, scale: float,
                       alibi_slopes=None, dropout_p: float = 0.0, rng=None, first: int = 0):  # fmt: skip
    """(dq, dk, dv) of the float32 reference, written out (autograd does not record inside an operator's
    implementation): P from the saved LSE, dV = P^T dO, dS = P (dO V^T - delta) (1 - tanh^2 under a cap),
    dQ = dS K scale, dK = dS^T Q scale, dK and dV summed over each query group. Dropout (mask Z, kept
    weights scaled by r = 1 / (1 - p)): dV = (P Z r)^T dO and dS = P (Z r (dO V^T) - delta)."""
    heads_kv = k.shape[1]
    group = q.shape[1] // heads_kv
    q32, k32, v32 = (t.float() for t in (q, k, v))
    k_rep, v_rep = k32.repeat_interleave(group, dim=1), v32.repeat_interleave(group, dim=1)
    raw = (q32 @ k_rep.transpose(-1, -2)) * scale
    scores = apply_softcap(raw, softcap)
    if alibi_slopes is not None:
        scores = scores + dense_alibi_bias(alibi_slopes.float(), q.shape[-2], k.shape[-2])
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(scores - lse_safe[..., None])
    seen = visible(q.shape[-2], k.shape[-2], is_causal=is_causal, window=window, device=q.device)
    p = p.masked_fill(~seen, 0.0)
    p = torch.where(torch.isinf(lse)[..., None], torch.zeros_like(p), p)
    do32 = dout.float()
    delta = (do32 * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    dp = do32 @ v_rep.transpose(-1, -2)
    keep = kernel_dropout_keep(rng, dropout_p, *q.shape[:3], k.shape[2], q.device, first)
    p_kept = p
    if keep is not None:
        p_kept = torch.where(keep, p / (1.0 - dropout_p), torch.zeros_like(p))
        dp = torch.where(keep, dp / (1.0 - dropout_p), torch.zeros_like(dp))
    ds = p * (dp - delta[..., None])
    if softcap is not None:
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = (ds @ k_rep) * scale
    dk = (ds.transpose(-1, -2) @ q32) * scale
    dv = p_kept.transpose(-1, -2) @ do32

    def per_kv_head(x):
        return x.reshape(x.shape[0], heads_kv, group, *x.shape[2:]).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def _sequences(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _as_batch(t: torch.Tensor) -> torch.Tensor:
    """Rows ``[seq, heads, head_dim]`` of one sequence as a dense batch ``[1, heads, seq, head_dim]``."""
    return t.transpose(0, 1).unsqueeze(0)


def _sequence_options(options: dict, b: int) -> dict:
    """The options of sequence b of a packed batch: its row of ``[batch, heads]`` ALiBi slopes and of fp8
    descales (already ``[batch, heads_kv]``), its index."""
    slopes = options.get("alibi_slopes")
    if slopes is not None and slopes.dim() == 2:
        options = {**options, "alibi_slopes": slopes[b]}
    descales = options.get("descales")
    if descales is not None:
        options = {**options, "descales": tuple(None if t is None else t[b : b + 1] for t in descales)}
    return {**options, "first": b}


def varlen_key_rows(k, cu_k, seqused_k, block_table) -> list:
    """Per sequence, the index of its keys' rows in ``k``: ``cu_k[b] ..`` (the first ``seqused_k[b]`` of
    them when given), or with ``block_table`` (k ``[num_pages, page_size, heads, head_dim]``) the (page,
    slot) of positions ``0 .. n_b - 1``, n_b from ``seqused_k`` or the differences of ``cu_k``."""
    if block_table is None:
        used = None if seqused_k is None else seqused_k.tolist()
        bounds = enumerate(_sequences(cu_k))
        return [slice(k0, k1 if used is None else k0 + used[b]) for b, (k0, k1) in bounds]
    lengths = seqused_k.tolist() if seqused_k is not None else [k1 - k0 for k0, k1 in _sequences(cu_k)]
    page_size = k.shape[1]
    rows = []
    for b, n in enumerate(lengths):
        positions = torch.arange(n, device=k.device)
        rows.append(_cache_slots(block_table, page_size, b, b, positions))
    return rows


def varlen_reference_forward(q, k, v, cu_q, cu_k, *, seqused_k=None, block_table=None, **options):
    """(out, lse ``[heads, total_q]``) of packed sequences, each through :func:`reference_forward` (reads
    ``cu_seqlens`` on the host: CPU tensors only); keys as :func:`varlen_key_rows` says."""
    outs, lses = [], []
    key_rows = varlen_key_rows(k, cu_k, seqused_k, block_table)
    descales = options.get("descales")
    if descales is not None:  # per sequence: [batch, heads_kv]
        batch, heads_kv = cu_q.shape[0] - 1, k.shape[-2]
        options["descales"] = tuple(None if t is None else descale_rows(t, batch, heads_kv) for t in descales)
    for b, ((q0, q1), rows) in enumerate(zip(_sequences(cu_q), key_rows, strict=True)):
        out, lse = reference_forward(*(_as_batch(t) for t in (q[q0:q1], k[rows], v[rows])),
                                     **_sequence_options(options, b))  # fmt: skip
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs, 0) if outs else q.to(torch.bfloat16 if descales is not None else q.dtype)
    lse = torch.cat(lses, 1) if lses else q.new_empty((q.shape[1], 0), dtype=torch.float32)
    return out.contiguous(), lse.contiguous()


def varlen_reference_backward(dout, q, k, v, out, lse, dlse, cu_q, cu_k, *, seqused_k=None, **options):
    """(dq, dk, dv) of packed sequences, each through :func:`reference_backward` (CPU tensors only); key
    rows past ``seqused_k`` get zero gradients."""
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    key_rows = varlen_key_rows(k, cu_k, seqused_k, None)
    for b, ((q0, q1), rows) in enumerate(zip(_sequences(cu_q), key_rows, strict=True)):
        if q1 > q0 and rows.stop > rows.start:
            grads = reference_backward(
                *(_as_batch(t[q0:q1]) for t in (dout, q)), *(_as_batch(t[rows]) for t in (k, v)),
                _as_batch(out[q0:q1]), lse[None, :, q0:q1], None if dlse is None else dlse[None, :, q0:q1],
                **_sequence_options(options, b),
            )  # fmt: skip
            dq[q0:q1], dk[rows], dv[rows] = (g[0].transpose(0, 1) for g in grads)
    return dq, dk, dv


# --- the KV-cache op (flash_attention_with_kvcache) ---------------------------------------------------------


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, *,
                 interleaved: bool) -> torch.Tensor:  # fmt: skip
    """Rotary embedding (RoPE) of ``x`` ``[seq, heads, D]`` at ``positions`` ``[seq]``: rows ``positions``
    of the tables ``cos``/``sin`` ``[seqlen_ro, rotary_dim / 2]``, through the rotary ops' reference
    (:func:`llm_speed.fused.reference.rotate`: GPT-J pairs when ``interleaved``, else GPT-NeoX halves; dims
    past rotary_dim unchanged; computed in float32, float64 for float64 x; x's dtype out)."""
    rotated = rotate(x.transpose(0, 1)[None], cos[positions], sin[positions], interleaved, False)
    return rotated[0].transpose(0, 1)


def alibi_bias(slopes: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
    """ALiBi (Press et al., arXiv:2108.12409) as flash-attn applies it: ``-slope * |p_i - j|`` for query
    positions ``query_pos`` [seq_q] (on the keys' axis: bottom-right aligned, ``i + seq_kv - seq_q`` for a
    dense call) and key positions ``key_pos`` [seq_k]; ``[heads, seq_q, seq_k]`` for ``slopes [heads]``,
    ``[batch, heads, seq_q, seq_k]`` for ``[batch, heads]``, in the slopes' dtype. Added to the scores after
    the cap, before the mask (the non-causal form of flash-attn's ``attn_bias_from_alibi_slopes``)."""
    distance = (query_pos[:, None] - key_pos[None, :]).abs().to(slopes.dtype)
    return -slopes[..., None, None] * distance


def dense_alibi_bias(slopes: torch.Tensor, seq_q: int, seq_kv: int) -> torch.Tensor:
    """:func:`alibi_bias` of a dense call: queries at ``i + seq_kv - seq_q``, keys at ``0 .. seq_kv - 1``."""
    keys = torch.arange(seq_kv, device=slopes.device)
    return alibi_bias(slopes, torch.arange(seq_q, device=slopes.device) + (seq_kv - seq_q), keys)


def _cache_slots(block_table, page_size: int, b: int, row: int, positions: torch.Tensor):
    """Index of sequence b's cache positions: (row, positions) when dense, (page, slot) when paged."""
    if block_table is None:
        return row, positions
    return block_table[b, positions // page_size].long(), positions % page_size


FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def quantize_to_cache(x: torch.Tensor, descale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[seq, heads, D]`` as an fp8 cache of ``dtype`` holds it with ``descale`` ``[heads]``:
    ``(x.float() / descale).clamp(-max, max).to(dtype)`` (float32 division, torch's round-to-nearest-even
    cast of the saturated value; a NaN stays NaN)."""
    limit = FP8_MAX[dtype]
    return (x.float() / descale.float()[:, None]).clamp(-limit, limit).to(dtype)


def descale_rows(descale: torch.Tensor, batch: int, heads_kv: int) -> torch.Tensor:
    """A descale ``[]``, ``[1]``, ``[heads_kv]`` or ``[batch, heads_kv]`` as ``[batch, heads_kv]``."""
    if descale.dim() == 2:
        return descale
    return descale.reshape(-1).expand(heads_kv)[None].expand(batch, heads_kv)


def _kvcache_sequence_valid(cached: int, seq_new: int, capacity: int, start: int, row: int, cache_rows: int,
                            rotary_limit: tuple[int, int] | None) -> bool:  # fmt: skip
    """Whether a sequence's values let the op touch the cache (what ``decode._check_values`` checks where
    values are checked; elsewhere the kernels skip such a sequence and return NaN for it). ``rotary_limit``:
    (rows of the rotary tables, positions past cache_seqlens read from them) or None."""
    inside = 0 <= cached and cached + seq_new <= capacity and 0 <= start <= cached and 0 <= row < cache_rows
    return inside and (rotary_limit is None or cached + rotary_limit[1] <= rotary_limit[0])


def reference_kvcache(
    q, k_cache, v_cache, cache_seqlens, k=None, v=None, *, block_table=None, cache_batch_idx=None,
    cache_leftpad=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True, alibi_slopes=None,
    is_causal=False, scale=None, window=None, softcap=None, k_descale=None, v_descale=None, in_place=False,
    compute_dtype=None,
):  # fmt: skip
    """:func:`llm_speed.attention.decode.flash_attention_with_kvcache` in plain PyTorch, in the dtype of its
    inputs (float64 inputs: the truth; the op's dtype: the same-precision version) or in ``compute_dtype``:
    returns ``(out [batch, seq_q, heads_q, D], lse [batch, heads_q, seq_q], k_cache, v_cache)`` with the new
    tokens written into copies of the caches (k rotated first when rotary), or with ``in_place`` into the
    caches given (then returned). Per sequence b: keys at cache positions ``leftpad .. cache_seqlens + seq_new
    - 1``, query i at ``p_i = cache_seqlens + seq_new - seq_q + i``; scores ``softcap(q.k * scale) - slope *
    |p_i - j|``, masked to ``p_i - left <= j <= p_i + right`` (right = 0 when causal). Rotary positions as
    the op's docstring. Reads the index tensors on the host.

    Values the op's value checks refuse give what its kernels give where those checks are off: a sequence
    with ``cache_seqlens`` outside ``[0, capacity - seq_new]``, a position past the rotary tables, a leftpad
    outside ``[0, cache_seqlens]`` or a ``cache_batch_idx`` outside the cache writes nothing and gets NaN
    output and LSE; a block-table entry outside the pool of a page in use gets no new token (the sequence's
    others are written) and NaN output and LSE.

    An fp8 cache (``k_descale``/``v_descale`` given, ``[batch, heads_kv]`` indexed by sequence): the new
    tokens are written as :func:`quantize_to_cache` of k (rotated in float32 first, whatever q's dtype) and
    v, and attention runs over the keys and values dequantized exactly (``cache * descale`` in float64) then
    rounded to q's dtype (or ``compute_dtype``): with float64 q the truth of the cache the op holds,
    quantization not counted."""
    if not in_place:
        k_cache, v_cache = k_cache.clone(), v_cache.clone()
    batch, seq_q, heads_q, dim = q.shape
    work = q.dtype if compute_dtype is None else compute_dtype
    fp8 = k_descale is not None
    if fp8:
        k_scales = descale_rows(k_descale, batch, k_cache.shape[2])
        v_scales = descale_rows(v_descale, batch, k_cache.shape[2])
    seq_new = 0 if k is None else k.shape[1]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0
    lens = cache_seqlens.tolist() if isinstance(cache_seqlens, torch.Tensor) else [cache_seqlens] * batch
    per_row = left is not None or right is not None
    page_size = k_cache.shape[1]
    capacity = page_size * (1 if block_table is None else block_table.shape[1])
    rotary_limit = None
    if rotary_cos is not None:  # positions cache_seqlens + [0, span) are rotated (decode.rotary_span)
        rotary_limit = (rotary_cos.shape[0], max(seq_new, seq_q if per_row else min(seq_q, 1)))
    lse_dtype = torch.float32 if compute_dtype is not None else q.dtype
    nan_out = q.new_full((seq_q, heads_q, dim), math.nan)  # a sequence whose values the op refuses
    nan_lse = torch.full((heads_q, seq_q), math.nan, dtype=lse_dtype, device=q.device)
    outs, lses = [], []
    for b in range(batch):
        cached = lens[b]
        start = int(cache_leftpad[b]) if cache_leftpad is not None else 0
        row = int(cache_batch_idx[b]) if cache_batch_idx is not None else b
        seqlen_k = cached + seq_new
        if not _kvcache_sequence_valid(cached, seq_new, capacity, start, row, k_cache.shape[0], rotary_limit):
            outs.append(nan_out)
            lses.append(nan_lse)
            continue
        slots = functools.partial(_cache_slots, block_table, page_size, b, row)
        pages_ok = True
        if block_table is not None:  # entries of the pages in use outside the pool are never dereferenced
            pages = block_table[b, : -(-seqlen_k // page_size)].long()
            good = (pages >= 0) & (pages < k_cache.shape[0])
            pages_ok = bool(good.all())
        if seq_new:
            new_pos = torch.arange(cached, seqlen_k)
            k_new, v_new = k[b], v[b]
            if rotary_cos is not None:
                if fp8:  # rotated in float32, then quantized once (as the append kernel)
                    k_new = apply_rotary(k_new.float(), rotary_cos.float(), rotary_sin.float(), new_pos,
                                         interleaved=rotary_interleaved)  # fmt: skip
                else:
                    k_new = apply_rotary(k_new, rotary_cos, rotary_sin, new_pos,
                                         interleaved=rotary_interleaved)  # fmt: skip
            if fp8:
                k_new = quantize_to_cache(k_new, k_scales[b], k_cache.dtype)
                v_new = quantize_to_cache(v_new, v_scales[b], v_cache.dtype)
            if not pages_ok:  # only the tokens whose page is inside the pool
                writable = good[new_pos // page_size]
                new_pos, k_new, v_new = new_pos[writable], k_new[writable], v_new[writable]
            k_cache[slots(new_pos)] = k_new.to(k_cache.dtype)
            v_cache[slots(new_pos)] = v_new.to(v_cache.dtype)
        if not pages_ok:
            outs.append(nan_out)
            lses.append(nan_lse)
            continue
        key_pos = torch.arange(start, seqlen_k)
        keys, values = k_cache[slots(key_pos)], v_cache[slots(key_pos)]  # [seq_k, heads_kv, D]
        if fp8:  # dequantized exactly, rounded to the working dtype
            keys = (keys.double() * k_scales[b].double()[:, None]).to(work)
            values = (values.double() * v_scales[b].double()[:, None]).to(work)
        else:
            keys, values = keys.to(work), values.to(work)
        q_b = q[b]
        if rotary_cos is not None:
            q_pos = cached + (torch.arange(seq_q) if per_row else torch.zeros(seq_q, dtype=torch.long))
            q_b = apply_rotary(q_b, rotary_cos, rotary_sin, q_pos, interleaved=rotary_interleaved)
        q_b = q_b.to(work)
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
        outs.append(out.transpose(0, 1).to(q.dtype))
        lses.append(lse.to(lse_dtype))
    out = torch.stack(outs) if outs else q.new_empty(q.shape)
    lse = torch.stack(lses) if lses else q.new_empty((batch, heads_q, seq_q), dtype=lse_dtype)
    return out, lse, k_cache, v_cache


def kvcache_forward(q, k_cache, v_cache, cache_seqlens, k, v, block_table, scale: float, window_left,
                    window_right, softcap, cache_batch_idx=None, cache_leftpad=None, rotary_cos=None,
                    rotary_sin=None, rotary_interleaved: bool = True, alibi_slopes=None, k_descale=None,
                    v_descale=None):  # fmt: skip
    """(out in q's dtype, lse float32) of the KV-cache op where Triton cannot run: :func:`reference_kvcache`
    in float32, the new k/v appended into ``k_cache``/``v_cache`` in place (arguments as
    ``decode.forward`` takes them, already checked)."""
    window = None if window_left is None and window_right is None else (window_left, window_right)
    out, lse, _, _ = reference_kvcache(
        q, k_cache, v_cache, cache_seqlens, k, v, block_table=block_table, cache_batch_idx=cache_batch_idx,
        cache_leftpad=cache_leftpad, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
        rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes, scale=scale, window=window,
        softcap=softcap, k_descale=k_descale, v_descale=v_descale, in_place=True, compute_dtype=torch.float32,
    )  # fmt: skip
    return out.contiguous(), lse.contiguous()
