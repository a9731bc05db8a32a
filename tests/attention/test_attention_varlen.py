"""Packed variable-length attention (flash-attn's varlen layout): accuracy against each sequence's dense
float64 computation, empty sequences, GQA, causal alignment per sequence, windows and softcap, the grid, bad
cu_seqlens, torch.library registration."""

import pytest
import torch
from attention_testing import (
    BACKWARD_KERNELS,
    FORWARD_KERNELS,
    assert_error_rule,
    expect_launches,
    fresh_plans,
)

from llm_speed.attention import flash_attention_varlen, plans
from llm_speed.attention.reference import reference_attention
from llm_speed.core import runtime

LENGTHS_Q = [0, 17, 1, 129, 128]
LENGTHS_K = [17, 0, 128, 1, 129]


def cu_seqlens(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def packed_inputs(lengths_q, lengths_k, heads_q, heads_kv, head_dim, dtype, device):
    q = torch.randn(sum(lengths_q), heads_q, head_dim).to(dtype).to(device)
    k = torch.randn(sum(lengths_k), heads_kv, head_dim).to(dtype).to(device)
    v = torch.randn(sum(lengths_k), heads_kv, head_dim).to(dtype).to(device)
    return q, k, v, cu_seqlens(lengths_q, device), cu_seqlens(lengths_k, device)


def dense_per_sequence(q, k, v, cu_q, cu_k, dout, dlse, dtype, **options):
    """(out, lse, dq, dk, dv) of the reference in ``dtype`` on the CPU, each sequence as its own dense batch
    of one: the padded dense computation, without the padding. ALiBi slopes ``[batch, heads]``: row b for
    sequence b."""
    leaves = [t.detach().cpu().to(dtype).requires_grad_() for t in (q, k, v)]
    options = {n: t.cpu() if isinstance(t, torch.Tensor) else t for n, t in options.items()}
    slopes = options.pop("alibi_slopes", None)
    outs, lses = [], []
    bounds_q, bounds_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(bounds_q) - 1):
        rows, keys = slice(bounds_q[b], bounds_q[b + 1]), slice(bounds_k[b], bounds_k[b + 1])
        dense = [t[s].transpose(0, 1).unsqueeze(0) for t, s in zip(leaves, (rows, keys, keys), strict=True)]
        alibi = slopes[b] if slopes is not None and slopes.dim() == 2 else slopes
        out, lse = reference_attention(*dense, return_lse=True, alibi_slopes=alibi, **options)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out, lse = torch.cat(outs), torch.cat(lses, 1)
    finite = torch.isfinite(lse)
    loss = (out * dout.cpu().to(dtype)).sum() + torch.where(finite, lse * dlse.cpu().to(dtype), 0).sum()
    loss.backward()
    return out.detach(), lse.detach(), *(t.grad for t in leaves)


def check_varlen(q, k, v, cu_q, cu_k, **options):
    dout = torch.randn(q.shape, dtype=q.dtype).to(q.device)
    dlse = torch.randn(q.shape[1], q.shape[0]).to(q.device)
    truth = dense_per_sequence(q, k, v, cu_q, cu_k, dout, dlse, torch.float64, **options)
    same = dense_per_sequence(q, k, v, cu_q, cu_k, dout, dlse, q.dtype, **options)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    lengths_q, lengths_k = (cu[1:] - cu[:-1] for cu in (cu_q, cu_k))
    with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=q.device):
        out, lse = flash_attention_varlen(
            *leaves, cu_q, cu_k, int(lengths_q.max()), int(lengths_k.max()), return_lse=True, **options
        )
        finite = torch.isfinite(lse)
        ((out * dout).sum() + torch.where(finite, lse * dlse, 0).sum()).backward()
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    got = (out.detach(), lse.detach(), *(t.grad for t in leaves))
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_error_rule(name, got[i], same[i], truth[i], 2.0 if i < 2 else 3.0, q.dtype)
    return got


@pytest.mark.parametrize("is_causal", [False, True])
def test_mixed_lengths_gqa_against_dense(is_causal, device):
    # Lengths {0, 1, 17, 128, 129} for queries and keys in different orders: empty query sequences, query
    # sequences with no key (output 0, LSE -inf), causal alignment bottom-right per sequence both ways.
    q, k, v, cu_q, cu_k = packed_inputs(LENGTHS_Q, LENGTHS_K, 4, 2, 16, torch.float16, device)
    out, lse, dq, *_ = check_varlen(q, k, v, cu_q, cu_k, is_causal=is_causal)
    no_key = slice(LENGTHS_Q[0], LENGTHS_Q[0] + LENGTHS_Q[1])  # the second sequence: 17 queries, no key
    assert (out[no_key] == 0).all() and (lse[:, no_key] == float("-inf")).all() and (dq[no_key] == 0).all()


def test_window_softcap_and_mqa(device):
    q, k, v, cu_q, cu_k = packed_inputs([40, 0, 23, 5], [33, 9, 23, 70], 2, 1, 32, torch.float32, device)
    check_varlen(q, k, v, cu_q, cu_k, is_causal=True, window=(7, None), softcap=4.0)
    check_varlen(q, k, v, cu_q, cu_k, window=(None, 3))


def test_strided_packed_qkv(device):
    # q, k, v sliced out of one packed [total, 3, heads, head_dim] buffer are read in place.
    lengths = [3, 20, 0, 9]
    qkv = torch.randn(sum(lengths), 3, 2, 16, device=device)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    assert not q.is_contiguous() and q.stride(-1) == 1
    cu = cu_seqlens(lengths, device)
    check_varlen(q, k, v, cu, cu, is_causal=True)


def test_strided_cu_seqlens_and_seqused_k(device):
    # Columns of [batch, 2] int32 tables: the same values with stride 2 give the same outputs and gradients
    # as contiguous ones (the kernels read them with unit stride: they are copied), the repeated call too.
    def column(t):
        return torch.stack([t, torch.full_like(t, 99)], 1)[:, 0]

    q, k, v, cu_q, cu_k = packed_inputs([5, 0, 9], [7, 4, 11], 2, 1, 16, torch.float32, device)
    for _ in range(2):  # the second call with the same metadata may be served as a kept call
        check_varlen(q, k, v, column(cu_q), column(cu_k), is_causal=True)
    used = torch.tensor([7, 2, 6], dtype=torch.int32, device=device)
    with torch.no_grad():
        expected = flash_attention_varlen(q, k, v, cu_q, cu_k, 9, 11, seqused_k=used, is_causal=True)
        out = flash_attention_varlen(q, k, v, cu_q, cu_k, 9, 11, seqused_k=column(used), is_causal=True)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_grid_grows_with_tokens_not_batch_times_longest(device, monkeypatch):
    # One long sequence and many short ones: the grid is bounded by cdiv(total, block) + batch per head,
    # far below batch x cdiv(max_seqlen, block); each program finds its sequence's block on the device.
    grids = []
    real_grid = plans._grid
    fresh_plans(monkeypatch)
    monkeypatch.setattr(plans, "_grid", lambda *args: grids.append((args, real_grid(*args))) or grids[-1][1])
    lengths = [200] + [1] * 15
    q, k, v, cu_q, cu_k = packed_inputs(lengths, lengths, 2, 2, 16, torch.float32, device)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 200, 200)
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    (n_rows, block, batch, heads, varlen), (grid, args) = grids[0]
    assert grid == ((-(-215 // block) + 16) * 2,) and grid[0] < 16 * -(-200 // block) * 2
    # each program finds its sequence on the device, over BLOCK_B >= batch lanes of cu_seqlens
    assert varlen and args == {"batch": 16, "grid_blocks": -(-215 // block) + 16, "BLOCK_B": 16}
    assert torch.isfinite(out).all()
    zeros = torch.zeros(q.shape, dtype=q.dtype), torch.zeros(q.shape[1], q.shape[0])
    truth = dense_per_sequence(q, k, v, cu_q, cu_k, *zeros, torch.float64)[0]
    assert (out.cpu().double() - truth).abs().max() < 1e-5  # every block found its sequence


def test_empty_totals(device):
    for lengths_q, lengths_k in (([0, 0], [3, 4]), ([2, 5], [0, 0]), ([], [])):
        q, k, v, cu_q, cu_k = packed_inputs(lengths_q, lengths_k, 2, 1, 16, torch.float16, device)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, 5, 5, is_causal=True, return_lse=True)
        assert out.shape == q.shape and lse.shape == (2, q.shape[0])
        assert (out == 0).all() and (lse == float("-inf")).all()
        out.float().sum().backward()
        assert all(t.grad is not None and (t.grad == 0).all() for t in leaves)


def _good(device):
    q, k, v, cu_q, cu_k = packed_inputs([3, 5], [4, 4], 2, 1, 16, torch.float32, device)
    return [q, k, v, cu_q, cu_k, 5, 4]


@pytest.mark.parametrize(
    "position, bad, error, message",
    [
        (3, lambda cu: cu.long(), TypeError, "cu_seqlens_q must have dtype torch.int32"),
        (4, lambda cu: cu.float(), TypeError, "cu_seqlens_k must have dtype torch.int32"),
        (3, lambda cu: cu.to("meta"), ValueError, "cu_seqlens_q must be on q's device"),
        (3, lambda cu: cu[None], ValueError, r"cu_seqlens_q must be 1-D \[batch \+ 1\]"),
        (4, lambda cu: cu[:2], ValueError, "cu_seqlens_q and cu_seqlens_k must both be"),
        (3, lambda cu: cu + 1, ValueError, "cu_seqlens_q must start at 0"),
        (
            3,
            lambda cu: torch.tensor([0, 6, 5], dtype=cu.dtype, device=cu.device),
            ValueError,
            "must be non-decreasing",
        ),
        (
            4,
            lambda cu: torch.tensor([0, 4, 7], dtype=cu.dtype, device=cu.device),
            ValueError,
            "must end at the packed length 8",
        ),
        (5, lambda n: 4, ValueError, "max_seqlen_q is 4 but cu_seqlens_q has a sequence of length 5"),
        (6, lambda n: -1, TypeError, "max_seqlen_k must be an int >= 0"),
        (0, lambda q: q[None], ValueError, r"q must have 3 dims \[total, heads, head_dim\]"),
    ],
)
def test_bad_inputs_fail_before_any_work(position, bad, error, message, device, monkeypatch):
    # The value checks of cu_seqlens and max_seqlen read the tensors on the host: on for every device here
    # (CUDA's default is off, the kernels then write NaN rows: test_attention_varlen_unchecked.py).
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)
    args = _good(device)
    args[position] = bad(args[position])
    before = {name: runtime.launch_count(name) for name in FORWARD_KERNELS}
    with pytest.raises(error, match=message):
        flash_attention_varlen(*args)
    assert all(runtime.launch_count(name) == count for name, count in before.items())


def test_opcheck_and_compile_fullgraph(device):
    q, k, v, cu_q, cu_k = packed_inputs([5, 0, 9], [7, 3, 9], 2, 1, 16, torch.float32, device)
    for t in (q, k, v):
        t.requires_grad_()
    args = (q, k, v, cu_q, cu_k, 9, 9, True, 0.3, 2, None, 3.0)
    torch.library.opcheck(torch.ops.llm_speed.flash_attention_varlen_forward.default, args)
    out, lse = torch.ops.llm_speed.flash_attention_varlen_forward(*(t.detach() for t in (q, k, v)), *args[3:])
    bwd_args = (torch.randn_like(out), *(t.detach() for t in (q, k, v)), out, lse, torch.randn_like(lse))
    bwd_args = (*bwd_args, cu_q, cu_k, True, 0.3, 2, None, 3.0)
    torch.library.opcheck(torch.ops.llm_speed.flash_attention_varlen_backward.default, bwd_args)

    torch._dynamo.reset()

    def loss(q, k, v):
        out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 9, 9, is_causal=True, return_lse=True)
        return out.square().sum() + lse[torch.isfinite(lse)].sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    traced = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    loss(*eager).backward()
    with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=device):
        compiled(*traced).backward()
    for a, b in zip(eager, traced, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_cpu_without_interpreter_runs_the_reference_per_sequence(monkeypatch):
    monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    q, k, v, cu_q, cu_k = packed_inputs([0, 9, 1, 20], [4, 0, 7, 20], 4, 2, 16, torch.float16, "cpu")
    before = {name: runtime.launch_count(name) for name in (*FORWARD_KERNELS, *BACKWARD_KERNELS)}
    dout = torch.randn(q.shape, dtype=q.dtype)
    dlse = torch.randn(q.shape[1], q.shape[0])
    truth = dense_per_sequence(q, k, v, cu_q, cu_k, dout, dlse, torch.float64, is_causal=True, softcap=2.0)
    same = dense_per_sequence(q, k, v, cu_q, cu_k, dout, dlse, q.dtype, is_causal=True, softcap=2.0)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = flash_attention_varlen(
        *leaves, cu_q, cu_k, 20, 20, is_causal=True, softcap=2.0, return_lse=True
    )
    ((out * dout).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0).sum()).backward()
    got = (out.detach(), lse.detach(), *(t.grad for t in leaves))
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_error_rule(name, got[i], same[i], truth[i], 2.0 if i < 2 else 3.0, q.dtype)
    assert all(runtime.launch_count(name) == count for name, count in before.items())
