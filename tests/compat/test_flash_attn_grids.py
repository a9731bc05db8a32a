"""llm_speed.flash_attn_interface called as flash-attn's own tests call flash-attn (Dao-AILab/flash-attention,
tests/test_flash_attn.py, 2.x): the same test functions, a few points of each parameter grid at CPU sizes,
and the argument forms those tests use: ``window_size`` as ``torch.randint(0, seqlen_k, (2,))`` (a tensor),
positional ``dropout_p``, ``return_attn_probs=True`` with the dropout mask read back from ``S_dmask``,
``requires_grad`` inputs to a paged forward (``block_table=``), whose backward does not exist there either.

The reference is written here from flash-attn's test semantics (``attention_ref``, ``construct_local_mask``,
``attn_bias_from_alibi_slopes``, ``apply_rotary_emb``): queries and keys aligned bottom-right per sequence,
padded positions masked, rows that see no key give 0. It runs in float64 (the truth) and in the inputs'
dtype (the same-precision PyTorch version), and the accuracy rule is ``tests/accuracy_rule.py``'s (outputs
within 2x, gradients within 3x the same-precision error plus a fixed cap; flash-attn's is 2x against a
float32 reference). Differences from flash-attn that remain are listed in docs/attention.md ("What still
differs").
"""

from __future__ import annotations

import math

import pytest
import torch

from accuracy_rule import GRAD_FACTOR, OUTPUT_FACTOR, assert_error_rule
from llm_speed import flash_attn_interface as fa

F16, BF16 = torch.float16, torch.bfloat16


@pytest.fixture(autouse=True)
def _poison_outputs(nan_poisoned):
    """Kernel outputs start as NaN (tests/conftest.py): an element a kernel forgets to write fails."""


# --- the reference (flash-attn's test semantics, written out) ---------------------------------------------


def local_window(causal: bool, window_size) -> tuple[int | None, int | None]:
    """flash-attn's window as (left, right), None for an unbounded (negative) side; causal sets right to 0."""
    left, right = (int(window_size[0]), int(window_size[1]))
    left, right = (None if left < 0 else left), (None if right < 0 else right)
    return left, 0 if causal else right


def attention_ref(q, k, v, *, key_mask=None, query_mask=None, causal=False, window_size=(-1, -1), softcap=0.0,
                  alibi=None, keep=None, dropout_p=0.0):  # fmt: skip
    """softmax(mask(softcap(q k^T / sqrt(d)) + alibi)) v of q ``[b, sq, h, d]``, k, v ``[b, sk, hk, d]`` in
    their dtype. Sequence b has the queries ``query_mask[b]`` and the keys ``key_mask[b]`` (default: all);
    query i of a sequence with n_q queries sits at key position ``end - n_q + i``, end = 1 + its last key
    (left padding, flash-attn's ``key_leftpad``, moves no position). ALiBi adds ``-slope * |p_i - j|``;
    dropout keeps the weights where ``keep`` and scales them by 1 / (1 - p). Padded queries give 0."""
    batch, seq_q, heads, dim = q.shape
    seq_k = k.shape[1]
    k = k.repeat_interleave(heads // k.shape[2], dim=2)
    v = v.repeat_interleave(heads // v.shape[2], dim=2)
    key_mask = torch.ones(batch, seq_k, dtype=torch.bool) if key_mask is None else key_mask
    query_mask = torch.ones(batch, seq_q, dtype=torch.bool) if query_mask is None else query_mask
    cols = torch.arange(seq_k)
    ends = torch.where(key_mask, cols + 1, 0).amax(dim=1)  # [b]
    rows = torch.arange(seq_q)[None, :] + (ends - query_mask.sum(dim=1))[:, None]  # p_i: [b, sq]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dim)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi is not None:
        slopes = alibi if alibi.dim() == 2 else alibi[None].expand(batch, -1)
        distance = (rows[:, None, :, None] - cols[None, None, None, :]).abs()
        scores = scores - slopes.to(scores.dtype)[:, :, None, None] * distance.to(scores.dtype)
    visible = key_mask[:, None, None, :].expand(batch, 1, seq_q, seq_k)
    left, right = local_window(causal, window_size)
    if left is not None:
        visible = visible & (cols[None, None, None, :] >= rows[:, None, :, None] - left)
    if right is not None:
        visible = visible & (cols[None, None, None, :] <= rows[:, None, :, None] + right)
    scores = scores.masked_fill(~visible, -math.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows that see no key: 0
    if keep is not None:
        weights = weights.masked_fill(~keep, 0.0) / (1 - dropout_p)
    out = torch.einsum("bhqk,bkhd->bqhd", weights, v)
    return out.masked_fill(~query_mask[:, :, None, None], 0.0)


def rotary_ref(x, cos, sin, offsets, interleaved: bool):
    """flash-attn's ``apply_rotary_emb`` of x ``[b, s, h, d]`` at positions ``offsets[b] + i``, in float32
    (float64 for float64 x), rounded to x's dtype."""
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = cos.shape[1]
    positions = offsets[:, None].long() + torch.arange(x.shape[1])[None, :]
    c, s = cos.to(work)[positions][:, :, None, :], sin.to(work)[positions][:, :, None, :]
    rot, rest = x[..., : 2 * half].to(work), x[..., 2 * half :]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    else:
        x1, x2 = rot[..., :half], rot[..., half:]
        rot = torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)
    return torch.cat([rot.to(x.dtype), rest], dim=-1)


def check_against_reference(out, grads, leaves, assemble, dout=None, **options):
    """The accuracy rule on ``out`` (and ``grads`` of ``leaves``): ``assemble(*leaf copies)`` gives the
    reference's (q, k, v) for :func:`attention_ref`; truth in float64, same precision in the leaves' dtype."""
    dtype = out.dtype
    results = []
    for work in (torch.float64, dtype):
        copies = [t.detach().cpu().to(work).requires_grad_(grads is not None) for t in leaves]
        ref = attention_ref(*assemble(*copies), **options)
        ref_grads = None
        if grads is not None:
            ref_grads = torch.autograd.grad(ref, copies, dout.cpu().to(work))
        results.append((ref.detach(), ref_grads))
    (truth, truth_grads), (same, same_grads) = results
    assert_error_rule("out", out, same, truth, OUTPUT_FACTOR, dtype)
    for i, grad in enumerate(grads or ()):
        assert_error_rule(f"grad {i}", grad, same_grads[i], truth_grads[i], GRAD_FACTOR, dtype)


def window_of(local: bool, seqlen_k: int):
    """flash-attn's tests: ``(-1, -1)``, or a window drawn as a tensor."""
    return torch.randint(0, seqlen_k, (2,)) if local else (-1, -1)


def alibi_of(alibi: bool, batch: int, heads: int, device):
    return torch.rand(batch, heads, device=device, dtype=torch.float32) * 0.3 if alibi else None


def kept(s_dmask, dropout_p):
    """The dropout mask flash-attn's tests read from ``S_dmask``: non-negative entries were kept."""
    return (s_dmask >= 0).cpu() if dropout_p else None


# --- test_flash_attn_qkvpacked ---------------------------------------------------------------------------

# (seqlen, d, dropout_p, causal, local, alibi, deterministic, dtype), a sample of its grid
QKVPACKED = [
    (33, 59, 0.0, True, True, True, False, F16),
    (40, 40, 0.17, False, True, False, True, BF16),
    (17, 32, 0.17, True, False, True, False, F16),
]


@pytest.mark.parametrize("case", QKVPACKED, ids=lambda c: f"s{c[0]}-d{c[1]}-p{c[2]}-c{c[3]}-l{c[4]}-a{c[5]}")
def test_flash_attn_qkvpacked(case, device):
    seqlen, d, dropout_p, causal, local, alibi, deterministic, dtype = case
    torch.manual_seed(0)
    batch, heads = 2, 3
    window_size = window_of(local, seqlen)
    qkv = torch.randn(batch, seqlen, 3, heads, d, device=device, dtype=dtype, requires_grad=True)
    slopes = alibi_of(alibi, batch, heads, device)
    out, lse, s_dmask = fa.flash_attn_qkvpacked_func(
        qkv, dropout_p, causal=causal, window_size=window_size, alibi_slopes=slopes,
        deterministic=deterministic, return_attn_probs=True,
    )  # fmt: skip
    assert lse.shape == (batch, heads, seqlen) and (s_dmask is None) == (dropout_p == 0)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    check_against_reference(
        out, (dqkv,), (qkv,), lambda t: t.unbind(2), dout, causal=causal, window_size=window_size,
        alibi=None if slopes is None else slopes.cpu(), keep=kept(s_dmask, dropout_p), dropout_p=dropout_p,
    )  # fmt: skip


# --- test_flash_attn_output (flash_attn_func, flash_attn_kvpacked_func) -----------------------------------

# (seqlen_q, seqlen_k, d, dropout_p, causal, local, alibi, deterministic, mha_type, dtype, kvpacked, softcap)
OUTPUT = [
    (21, 37, 64, 0.0, True, True, False, False, "gqa", F16, False, 0.0),
    (29, 21, 96, 0.17, True, False, True, True, "mqa", BF16, True, 0.0),
    (1, 30, 80, 0.0, False, True, True, False, "mha", F16, False, 50.0),
]


@pytest.mark.parametrize("case", OUTPUT, ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-{c[8]}-kv{c[10]}")
def test_flash_attn_output(case, device):
    seqlen_q, seqlen_k, d, dropout_p, causal, local, alibi, deterministic, mha_type, dtype, kvpacked, cap = (
        case
    )
    torch.manual_seed(1)
    batch, heads = 2, 4
    heads_k = {"mha": heads, "mqa": 1, "gqa": 2}[mha_type]
    window_size = window_of(local, seqlen_k)
    q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=dtype, requires_grad=True)
    slopes = alibi_of(alibi, batch, heads, device)
    if kvpacked:
        kv = torch.randn(batch, seqlen_k, 2, heads_k, d, device=device, dtype=dtype, requires_grad=True)
        leaves = (q, kv)
        out, lse, s_dmask = fa.flash_attn_kvpacked_func(
            q, kv, dropout_p, causal=causal, window_size=window_size, softcap=cap, alibi_slopes=slopes,
            deterministic=deterministic, return_attn_probs=True,
        )  # fmt: skip
    else:
        k, v = (torch.randn(batch, seqlen_k, heads_k, d, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))  # fmt: skip
        leaves = (q, k, v)
        out, lse, s_dmask = fa.flash_attn_func(
            q, k, v, dropout_p, causal=causal, window_size=window_size, softcap=cap, alibi_slopes=slopes,
            deterministic=deterministic, return_attn_probs=True,
        )  # fmt: skip
    assert out.shape == q.shape and lse.shape == (batch, heads, seqlen_q)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)

    def assemble(*t):
        return (t[0], *t[1].unbind(2)) if kvpacked else t

    check_against_reference(
        out, grads, leaves, assemble, dout, causal=causal, window_size=window_size, softcap=cap,
        alibi=None if slopes is None else slopes.cpu(), keep=kept(s_dmask, dropout_p), dropout_p=dropout_p,
    )  # fmt: skip


# --- test_flash_attn_varlen_output (unpadded sequences from padding masks) ---------------------------------


def padding_mask(max_seqlen: int, batch: int, lengths=None):
    """flash-attn's ``generate_random_padding_mask(mode="random")``: lengths in [max - 20, max]."""
    if lengths is None:
        lengths = torch.randint(max(1, max_seqlen - 20), max_seqlen + 1, (batch,))
    return torch.arange(max_seqlen)[None, :] < torch.as_tensor(lengths)[:, None]


def unpad(x, mask):
    """(x's valid rows packed, int32 cu_seqlens, max length) as flash-attn's ``unpad_input``."""
    lengths = mask.sum(dim=1)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return x[mask.to(x.device)], cu.to(x.device), int(lengths.max())


# (seqlen_q, seqlen_k, d, dropout_p, causal, local, alibi, mha_type, dtype, kvpacked)
VARLEN = [
    (25, 31, 59, 0.0, True, True, True, "gqa", F16, False),
    (23, 9, 64, 0.17, False, False, False, "mha", BF16, True),
    (8, 40, 40, 0.0, True, False, True, "mqa", F16, False),
]


@pytest.mark.parametrize("case", VARLEN, ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-{c[7]}-kv{c[9]}")
def test_flash_attn_varlen_output(case, device):
    seqlen_q, seqlen_k, d, dropout_p, causal, local, alibi, mha_type, dtype, kvpacked = case
    torch.manual_seed(2)
    batch, heads = 2, 4
    heads_k = {"mha": heads, "mqa": 1, "gqa": 2}[mha_type]
    window_size = window_of(local, seqlen_k)
    q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=dtype)
    k, v = (torch.randn(batch, seqlen_k, heads_k, d, device=device, dtype=dtype) for _ in range(2))
    query_mask, key_mask = padding_mask(seqlen_q, batch), padding_mask(seqlen_k, batch)
    q_unpad, cu_q, max_q = unpad(q, query_mask)
    k_unpad, cu_k, max_k = unpad(k, key_mask)
    v_unpad, _, _ = unpad(v, key_mask)
    slopes = alibi_of(alibi, batch, heads, device)
    q_unpad.requires_grad_()
    if kvpacked:
        kv_unpad = torch.stack([k_unpad, v_unpad], dim=1).requires_grad_()
        leaves = (q_unpad, kv_unpad)
        out_unpad, lse, s_dmask = fa.flash_attn_varlen_kvpacked_func(
            q_unpad, kv_unpad, cu_q, cu_k, max_q, max_k, dropout_p, causal=causal, window_size=window_size,
            alibi_slopes=slopes, return_attn_probs=True,
        )  # fmt: skip
    else:
        k_unpad.requires_grad_()
        v_unpad.requires_grad_()
        leaves = (q_unpad, k_unpad, v_unpad)
        out_unpad, lse, s_dmask = fa.flash_attn_varlen_func(
            q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, dropout_p, causal=causal,
            window_size=window_size, alibi_slopes=slopes, return_attn_probs=True,
        )  # fmt: skip
    assert out_unpad.shape == q_unpad.shape and lse.shape == (heads, q_unpad.shape[0])
    dout = torch.randn_like(out_unpad)
    grads = torch.autograd.grad(out_unpad, leaves, dout)

    def padded(rows, mask):  # the unpadded rows back in a zero-padded [b, s, ...] tensor
        full = torch.zeros(*mask.shape, *rows.shape[1:], dtype=rows.dtype)
        full[mask] = rows
        return full

    def assemble(q_rows, *kv_rows):
        k_rows, v_rows = kv_rows[0].unbind(1) if kvpacked else kv_rows
        return padded(q_rows, query_mask), padded(k_rows, key_mask), padded(v_rows, key_mask)

    keep = None
    if dropout_p:  # S_dmask [b, h, max_q, max_k] of each sequence's own rows and keys
        keep = torch.zeros(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool)
        keep[:, :, :max_q, :max_k] = kept(s_dmask, dropout_p)
    dout_padded = padded(dout.cpu(), query_mask)

    # the rule on the padded layout: unpadded results scattered back (padded rows 0 on both sides)
    results = []
    for work in (torch.float64, dtype):
        copies = [t.detach().cpu().to(work).requires_grad_() for t in leaves]
        ref = attention_ref(*assemble(*copies), key_mask=key_mask, query_mask=query_mask, causal=causal,
                            window_size=window_size, alibi=None if slopes is None else slopes.cpu(),
                            keep=keep, dropout_p=dropout_p)  # fmt: skip
        results.append((ref.detach(), torch.autograd.grad(ref, copies, dout_padded.to(work))))
    (truth, truth_grads), (same, same_grads) = results
    assert_error_rule("out", padded(out_unpad.detach().cpu(), query_mask), same, truth, OUTPUT_FACTOR, dtype)
    for i, grad in enumerate(grads):
        assert_error_rule(f"grad {i}", grad, same_grads[i], truth_grads[i], GRAD_FACTOR, dtype)


# --- test_flash_attn_causal / test_flash_attn_varlen_causal (paged) -----------------------------------------

# (seqlen_q, seqlen_k, swap_sq_sk, d, local, dtype)
CAUSAL = [(1, 47, True, 59, True, F16), (13, 40, False, 64, False, BF16), (33, 19, False, 80, True, F16)]


@pytest.mark.parametrize("case", CAUSAL, ids=lambda c: f"{c[0]}x{c[1]}-swap{c[2]}-d{c[3]}-l{c[4]}")
def test_flash_attn_causal(case, device):
    seqlen_q, seqlen_k, swap, d, local, dtype = case
    if swap:
        seqlen_q, seqlen_k = seqlen_k, seqlen_q
    torch.manual_seed(3)
    batch, heads = 2, 3
    window_size = window_of(local, seqlen_k)
    q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(batch, seqlen_k, heads, d, device=device, dtype=dtype, requires_grad=True)
            for _ in range(2))  # fmt: skip
    out = fa.flash_attn_func(q, k, v, 0.0, causal=True, window_size=window_size)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out, grads, (q, k, v), lambda *t: t, dout, causal=True, window_size=window_size)


def block_kvcache(seqlen_k: int, page_size: int, batch: int, heads_k: int, d: int, device, dtype):
    """flash-attn's ``_generate_block_kvcache``: pages in a shuffled pool three times the need, a block
    table, and the logical [b, seqlen_k, hk, d] caches the table describes."""
    pages = math.ceil(seqlen_k / page_size)
    num_blocks = pages * batch * 3
    k_paged, v_paged = (torch.randn(num_blocks, page_size, heads_k, d, device=device, dtype=dtype)
                        for _ in range(2))  # fmt: skip
    table = torch.randperm(num_blocks, dtype=torch.int32, device=device)[: batch * pages].view(batch, pages)
    logical = [p[table.long().flatten()].view(batch, pages * page_size, heads_k, d)[:, :seqlen_k]
               for p in (k_paged, v_paged)]  # fmt: skip
    return (*logical, table, k_paged, v_paged)


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_flash_attn_varlen_causal(paged, device):
    """Inputs that require grad as flash-attn's test makes them; with a block table the forward runs and only
    the backward is missing (as in flash-attn, whose test skips it there)."""
    torch.manual_seed(4)
    batch, heads, d, seqlen_q, seqlen_k, dtype = 3, 3, 64, 20, 45, F16
    window_size = window_of(True, seqlen_k)
    q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=dtype, requires_grad=True)
    if paged:
        k, v, table, k_paged, v_paged = block_kvcache(seqlen_k, 16, batch, heads, d, device, dtype)
        k_paged.requires_grad_()
        v_paged.requires_grad_()
    else:
        k, v = (torch.randn(batch, seqlen_k, heads, d, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))  # fmt: skip
        table = None
    query_mask, key_mask = padding_mask(seqlen_q, batch), padding_mask(seqlen_k, batch)
    q_unpad, cu_q, max_q = unpad(q, query_mask)
    k_unpad, cu_k, max_k = unpad(k, key_mask)
    v_unpad, _, _ = unpad(v, key_mask)
    out_unpad = fa.flash_attn_varlen_func(
        q_unpad, k_paged if paged else k_unpad, v_paged if paged else v_unpad, cu_q, cu_k, max_q, max_k, 0.0,
        causal=True, window_size=window_size, block_table=table,
    )  # fmt: skip
    assert out_unpad.requires_grad
    out = torch.zeros(batch, seqlen_q, heads, d, dtype=dtype)
    out[query_mask] = out_unpad.detach().cpu()
    results = [
        attention_ref(*(t.detach().cpu().to(work) for t in (q, k, v)), key_mask=key_mask,
                      query_mask=query_mask, causal=True, window_size=window_size)
        for work in (torch.float64, dtype)
    ]  # fmt: skip
    assert_error_rule("out", out, results[1], results[0], OUTPUT_FACTOR, dtype)
    dout = torch.randn_like(out_unpad)
    if paged:
        with pytest.raises(RuntimeError, match="block_table .* has no backward"):
            torch.autograd.grad(out_unpad, (q, k_paged, v_paged), dout)
    else:
        dq, dk, dv = torch.autograd.grad(out_unpad, (q, k, v), dout)
        assert dq.shape == q.shape and torch.isfinite(dk).all() and torch.isfinite(dv).all()


# --- test_flash_attn_kvcache -----------------------------------------------------------------------------

# (seqlen_q, seqlen_k, d, has_batch_idx, has_leftpad, paged_kv_block_size, rotary_fraction,
#  rotary_interleaved, seqlen_new_eq_seqlen_q, causal, local, alibi, new_kv, mha_type, num_splits, dtype)
KVCACHE = [
    (1, 48, 64, False, True, None, 0.5, False, True, True, False, False, True, "gqa", 0, F16),
    (3, 64, 59, True, False, None, 0.0, True, False, False, True, True, True, "mha", 1, BF16),
    (4, 80, 32, False, False, 16, 1.0, True, True, False, True, False, True, "mqa", 0, F16),
    (1, 40, 80, False, True, None, 0.0, False, True, True, True, True, False, "gqa", 0, F16),
    (6, 32, 64, False, False, 32, 0.5, False, False, True, False, True, True, "mha", 1, BF16),
]


@pytest.mark.parametrize("case", KVCACHE, ids=lambda c: f"{c[0]}x{c[1]}-d{c[2]}-page{c[5]}-rot{c[6]}-{c[13]}")
def test_flash_attn_kvcache(case, device):
    (seqlen_q, seqlen_k, d, has_batch_idx, has_leftpad, page_size, rotary_fraction, rotary_interleaved,
     seqlen_new_eq_seqlen_q, causal, local, alibi, new_kv, mha_type, num_splits, dtype) = case  # fmt: skip
    torch.manual_seed(5)
    batch, heads = 2, 6
    batch_cache = batch * 2 if has_batch_idx else batch
    heads_k = {"mha": heads, "mqa": 1, "gqa": 3}[mha_type]
    rotary_dim = math.floor(int(rotary_fraction * d) / 16) * 16  # flash-attn: a multiple of 16
    window_size = window_of(local, seqlen_k)
    q = torch.randn(batch, seqlen_q, heads, d, device=device, dtype=dtype)
    seqlen_new = seqlen_q if seqlen_new_eq_seqlen_q else int(torch.randint(1, seqlen_q + 1, (1,)))
    k = v = None
    if new_kv:
        k, v = (torch.randn(batch, seqlen_new, heads_k, d, device=device, dtype=dtype) for _ in range(2))
    if page_size is None:
        k_cache, v_cache = (torch.randn(batch_cache, seqlen_k, heads_k, d, device=device, dtype=dtype)
                            for _ in range(2))  # fmt: skip
        table = None
    else:
        k_cache, v_cache, table, k_paged, v_paged = block_kvcache(
            seqlen_k, page_size, batch, heads_k, d, device, dtype
        )
    rotated_span = seqlen_q if (causal or local) and rotary_dim > 1 else seqlen_new
    high = (seqlen_k - rotated_span + 1) if new_kv else seqlen_k + 1
    cache_seqlens = torch.randint(0 if new_kv else 1, high, (batch,), dtype=torch.int32, device=device)
    leftpad = None
    if has_leftpad:
        leftpad = torch.stack([torch.randint(0, int(n), ()) if n > 0 else torch.zeros((), dtype=torch.int64)
                               for n in cache_seqlens.cpu()]).to(torch.int32).to(device)  # fmt: skip
    batch_idx = None
    if has_batch_idx:
        batch_idx = torch.randperm(batch_cache, dtype=torch.int32, device=device)[:batch]
    slopes = alibi_of(alibi, batch, heads, device)
    cos = sin = None
    if rotary_dim:
        rows = seqlen_k if page_size is None else k_paged.shape[0] * page_size
        angle = torch.rand(rows, rotary_dim // 2, device=device) * 2 * math.pi
        cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    # the caches the call should leave, and the keys it attends to (before the call writes anything)
    lens = cache_seqlens.cpu().long()
    rows_of = batch_idx.cpu().long() if has_batch_idx else torch.arange(batch)
    k_ref, v_ref = k_cache.cpu()[rows_of].clone(), v_cache.cpu()[rows_of].clone()
    if new_kv:
        k_ro = rotary_ref(k.cpu(), cos.cpu(), sin.cpu(), lens, rotary_interleaved) if rotary_dim else k.cpu()
        slots = torch.arange(seqlen_k)[None, :]
        update = (slots >= lens[:, None]) & (slots < lens[:, None] + seqlen_new)
        k_ref[update], v_ref[update] = k_ro.flatten(0, 1), v.cpu().flatten(0, 1)
    out = fa.flash_attn_with_kvcache(
        q, k_cache if page_size is None else k_paged, v_cache if page_size is None else v_paged, k, v,
        rotary_cos=cos, rotary_sin=sin, cache_seqlens=cache_seqlens, cache_batch_idx=batch_idx,
        cache_leftpad=leftpad, block_table=table, causal=causal, window_size=window_size,
        rotary_interleaved=rotary_interleaved, alibi_slopes=slopes, num_splits=num_splits,
    )  # fmt: skip
    if new_kv:  # flash-attn's test: k within 1e-3 (rotated), v exactly
        if page_size is None:
            k_now, v_now = k_cache.cpu()[rows_of], v_cache.cpu()[rows_of]
        else:
            k_now, v_now = (p.cpu()[table.cpu().long().flatten()].view(batch, -1, heads_k, d)[:, :seqlen_k]
                            for p in (k_paged, v_paged))  # fmt: skip
        torch.testing.assert_close(k_now, k_ref, rtol=1e-3, atol=1e-3)
        assert torch.equal(v_now, v_ref)
    key_mask = torch.arange(seqlen_k)[None, :] < (lens + (seqlen_new if new_kv else 0))[:, None]
    if has_leftpad:
        key_mask &= torch.arange(seqlen_k)[None, :] >= leftpad.cpu()[:, None]
    results = []
    for work in (torch.float64, dtype):
        q_ro = q.cpu()
        if rotary_dim:  # causal or local: query i at cache_seqlens + i; else every query at cache_seqlens
            if causal or local:
                q_ro = rotary_ref(q_ro, cos.cpu(), sin.cpu(), lens, rotary_interleaved)
            else:
                flat = q_ro.reshape(batch, 1, seqlen_q * heads, d)
                q_ro = rotary_ref(flat, cos.cpu(), sin.cpu(), lens, rotary_interleaved).view_as(q_ro)
        results.append(attention_ref(
            q_ro.to(work), k_ref.to(work), v_ref.to(work), key_mask=key_mask, causal=causal,
            window_size=window_size, alibi=None if slopes is None else slopes.cpu(),
        ))  # fmt: skip
    assert_error_rule("out", out, results[1], results[0], OUTPUT_FACTOR, dtype)


# --- test_flash_attn_bwd_overflow / _bwd_transpose / _bwd_varlen_overflow / _deterministic ----------------


def test_flash_attn_bwd_overflow(device):
    """Inputs scaled by 5 and 3, a length no block divides; gradients by ``.backward()`` into ``.grad``."""
    causal = True
    torch.manual_seed(7)
    q = (torch.randn(2, 17, 5, 32, dtype=F16, device=device) * 5).requires_grad_()
    k, v = ((torch.randn(2, 17, 5, 32, dtype=F16, device=device) * 3).requires_grad_() for _ in range(2))
    out = fa.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    check_against_reference(out, (q.grad, k.grad, v.grad), (q, k, v), lambda *t: t, dout, causal=causal)


def test_flash_attn_bwd_transpose(device):
    """The output rearranged ``b s ... -> s b ...`` before the loss: a non-contiguous output gradient."""
    torch.manual_seed(8)
    q, k, v = (torch.randn(3, 25, 2, 64, dtype=BF16, device=device, requires_grad=True) for _ in range(3))
    out = fa.flash_attn_func(q, k, v, causal=True).transpose(0, 1)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    check_against_reference(out.transpose(0, 1), grads, (q, k, v), lambda *t: t, dout.transpose(0, 1),
                            causal=True)  # fmt: skip


def test_flash_attn_bwd_varlen_overflow(device):
    """Long query sequences over one key each, ``max_seqlen_q`` the total: no NaN in any gradient."""
    torch.manual_seed(9)
    cu_q = torch.tensor([0, 15, 22, 40], device=device, dtype=torch.int32)
    cu_k = torch.tensor([0, 1, 2, 3], device=device, dtype=torch.int32)
    q = (torch.randn(40, 5, 16, dtype=F16, device=device) * 3).requires_grad_()
    k, v = ((torch.randn(3, 5, 16, dtype=F16, device=device) * 3).requires_grad_() for _ in range(2))
    out = fa.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 3, causal=True)
    out.backward(torch.randn_like(out))
    assert not (q.grad.isnan().any() or k.grad.isnan().any() or v.grad.isnan().any())


def test_flash_attn_deterministic(device):
    """``deterministic=True`` with flash-attn's window forms: the gradients of repeated calls bit for bit."""
    torch.manual_seed(10)
    window_size = window_of(True, 31)
    q = torch.randn(2, 19, 4, 64, dtype=F16, device=device, requires_grad=True)
    k, v = (torch.randn(2, 31, 2, 64, dtype=F16, device=device, requires_grad=True) for _ in range(2))
    out = fa.flash_attn_func(q, k, v, 0.0, causal=True, window_size=window_size, deterministic=True)
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))


# --- argument forms --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window_size",
    [(3, 5), [3, 5], torch.tensor([3, 5]), torch.tensor([3, 5], dtype=torch.int32), (torch.tensor(3), 5),
     range(3, 6, 2)],
    ids=["tuple", "list", "tensor", "int32-tensor", "0d-tensor-side", "range"],
)  # fmt: skip
def test_every_indexable_window_pair_is_the_same_call(window_size, device):
    torch.manual_seed(6)
    q, k, v = (torch.randn(1, 12, 2, 16, device=device) for _ in range(3))
    expected = fa.flash_attn_func(q, k, v, window_size=(3, 5))
    torch.testing.assert_close(fa.flash_attn_func(q, k, v, window_size=window_size), expected, rtol=0, atol=0)
    cache = torch.randn(1, 16, 2, 16, device=device)
    lens = torch.tensor([12], dtype=torch.int32, device=device)
    expected = fa.flash_attn_with_kvcache(q[:, :2], cache, cache, cache_seqlens=lens, window_size=(3, 5))
    got = fa.flash_attn_with_kvcache(q[:, :2], cache, cache, cache_seqlens=lens, window_size=window_size)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    "window_size, match",
    [((1, 2, 3), "pair"), (4, "pair"), (torch.tensor(4), "pair"), ((1.5, 2), "left must be an int"),
     ((True, 2), "left must be an int"), (torch.tensor([1.0, 2.0]), "left must be an int"),
     ({0: 1, 1: 2}, "pair")],
    ids=["triple", "int", "0d-tensor", "float", "bool", "float-tensor", "dict"],
)  # fmt: skip
def test_a_window_that_is_no_pair_of_ints_is_refused(window_size, match):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(TypeError, match=f"window_size {match}|window_size must be a {match}"):
        fa.flash_attn_func(q, q, q, window_size=window_size)


@pytest.mark.parametrize("softcap", [0.0, 0, -1.0, -30], ids=["0.0", "int-0", "negative", "int-negative"])
def test_softcap_at_or_below_zero_is_off(softcap, device):
    """flash-attn caps only when ``softcap > 0`` (csrc/flash_attn/flash_api.cpp): anything else is off."""
    q = torch.randn(1, 6, 2, 16, device=device)
    expected = fa.flash_attn_func(q, q, q, causal=True)
    torch.testing.assert_close(fa.flash_attn_func(q, q, q, causal=True, softcap=softcap), expected, rtol=0,
                               atol=0)  # fmt: skip
    cache, lens = torch.randn(1, 8, 2, 16, device=device), 6
    expected = fa.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=lens)
    got = fa.flash_attn_with_kvcache(q[:, :1], cache, cache, cache_seqlens=lens, softcap=softcap)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
