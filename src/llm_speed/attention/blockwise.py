"""The algorithms of kernels.py written blockwise in PyTorch, for CPU tensors without the interpreter.

Blocks of BLOCK rows (the kernels' sizes vary with head_dim; the results agree to rounding), the same
skipping of fully masked causal blocks, float32 statistics and the same rule for rows that see no key;
vectorised over batch and heads, looping over query and key blocks. Memory, causal masks included, stays
O(block * block) per head, never O(seq_q * seq_kv).
"""

from __future__ import annotations

import torch

BLOCK = 64  # rows per query or key block


def _grouped(x: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """[B, Hq, S, D] -> [B, Hkv, G, S, D] float32: each K/V head faces its G query heads by broadcasting."""
    batch, heads, seq, dim = x.shape
    return x.float().reshape(batch, heads_kv, heads // heads_kv, seq, dim)


def tile_visible(rows: slice, cols: slice, seq_q: int, seq_kv: int, device=None) -> torch.Tensor:
    """``causal_visible(seq_q, seq_kv)[rows, cols]`` built for the tile alone, never the whole matrix."""
    row_ids = torch.arange(rows.start, rows.stop, device=device)[:, None]
    col_ids = torch.arange(cols.start, cols.stop, device=device)[None, :]
    return col_ids <= row_ids + (seq_kv - seq_q)


def _scores(q_blk, k_blk, rows: slice, cols: slice, seq_q, seq_kv, is_causal, scale):
    """Scaled scores of one [rows, cols] tile, -inf where causally masked."""
    s = (q_blk @ k_blk.transpose(-1, -2)) * scale
    if is_causal:
        s = s.masked_fill(~tile_visible(rows, cols, seq_q, seq_kv, q_blk.device), float("-inf"))
    return s


def _key_end(m0: int, m1: int, seq_q: int, seq_kv: int, is_causal: bool) -> int:
    """One past the last key that rows [m0, m1) may see: later key blocks are skipped."""
    return max(0, min(seq_kv, m1 + seq_kv - seq_q)) if is_causal else seq_kv


def _finish(acc, row_sum, row_max):
    """Divide by the row sums; rows that saw no key give 0 and LSE -inf."""
    no_key = row_sum == 0
    safe_sum = torch.where(no_key, torch.ones_like(row_sum), row_sum)
    lse = torch.where(no_key, torch.full_like(row_sum, float("-inf")), row_max + torch.log(safe_sum))
    return acc / safe_sum[..., None], lse


def flash_forward_blockwise(q, k, v, is_causal: bool, scale: float, two_pass: bool = False):
    """(out in q's dtype, lse fp32) by online softmax over key blocks; ``two_pass``: the tiled algorithm."""
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    qg, kg, vg = _grouped(q, heads_kv), k.float().unsqueeze(2), v.float().unsqueeze(2)
    out = qg.new_empty(qg.shape)
    lse = qg.new_empty(qg.shape[:-1])
    for m0 in range(0, seq_q, BLOCK):
        m1 = min(m0 + BLOCK, seq_q)
        q_blk = qg[..., m0:m1, :]
        key_blocks = [
            (n0, min(n0 + BLOCK, seq_kv))
            for n0 in range(0, _key_end(m0, m1, seq_q, seq_kv, is_causal), BLOCK)
        ]
        row_max = q_blk.new_full(q_blk.shape[:-1], float("-inf"))
        if two_pass:
            for n0, n1 in key_blocks:
                s = _scores(
                    q_blk, kg[..., n0:n1, :], slice(m0, m1), slice(n0, n1), seq_q, seq_kv, is_causal, scale
                )
                row_max = torch.maximum(row_max, s.amax(-1))
        row_sum = torch.zeros_like(row_max)
        acc = torch.zeros_like(q_blk)
        for n0, n1 in key_blocks:
            s = _scores(
                q_blk, kg[..., n0:n1, :], slice(m0, m1), slice(n0, n1), seq_q, seq_kv, is_causal, scale
            )
            new_max = row_max if two_pass else torch.maximum(row_max, s.amax(-1))
            # Rows with no visible key so far keep max -inf; shift them by 0 so exp gives 0, not NaN.
            shift = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            p = torch.exp(s - shift[..., None])
            rescale = torch.exp(row_max - shift)
            row_sum = row_sum * rescale + p.sum(-1)
            acc = acc * rescale[..., None] + p @ vg[..., n0:n1, :]
            row_max = new_max
        out[..., m0:m1, :], lse[..., m0:m1] = _finish(acc, row_sum, row_max)
    return (out.reshape(batch, heads_q, seq_q, head_dim).to(q.dtype), lse.reshape(batch, heads_q, seq_q))


def flash_backward_blockwise(dout, q, k, v, out, lse, dlse, is_causal: bool, scale: float):
    """(dq, dk, dv), recomputing P block by block from Q, K and the saved LSE; dK/dV summed over groups."""
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    qg, dog = _grouped(q, heads_kv), _grouped(dout, heads_kv)
    kg, vg = k.float().unsqueeze(2), v.float().unsqueeze(2)
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse.float()
    delta = delta.reshape(qg.shape[:-1])
    lse = lse.reshape(qg.shape[:-1])
    lse = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    dq = torch.zeros_like(qg)
    dk = torch.zeros_like(kg.squeeze(2))
    dv = torch.zeros_like(dk)
    for m0 in range(0, seq_q, BLOCK):
        m1 = min(m0 + BLOCK, seq_q)
        for n0 in range(0, _key_end(m0, m1, seq_q, seq_kv, is_causal), BLOCK):
            n1 = min(n0 + BLOCK, seq_kv)
            rows, cols = slice(m0, m1), slice(n0, n1)
            s = _scores(qg[..., rows, :], kg[..., cols, :], rows, cols, seq_q, seq_kv, is_causal, scale)
            p = torch.exp(s - lse[..., rows, None])  # masked entries: exp(-inf) = 0
            dv[..., cols, :] += (p.transpose(-1, -2) @ dog[..., rows, :]).sum(2)
            dp = dog[..., rows, :] @ vg[..., cols, :].transpose(-1, -2)
            ds = p * (dp - delta[..., rows, None])
            dk[..., cols, :] += (ds.transpose(-1, -2) @ qg[..., rows, :]).sum(2) * scale
            dq[..., rows, :] += (ds @ kg[..., cols, :]) * scale
    return (dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))
