"""Packed attention over paged keys (``block_table``) and partly used keys (``seqused_k``): flash-attn's
varlen options for vLLM-style prefill over a paged KV cache. Float64 truth per sequence, the 2x/3x rule,
the paged kernel bitwise equal to the packed one on the same keys, bad tables and lengths (checked and
unchecked)."""

import pytest
import torch
from attention_testing import BACKWARD_KERNELS, FORWARD_KERNELS, assert_error_rule, expect_launches
from test_attention_varlen import check_varlen, cu_seqlens, dense_per_sequence, packed_inputs

from llm_speed.attention import flash, flash_attention_varlen
from llm_speed.core import runtime
from llm_speed.flash_attn_interface import flash_attn_varlen_func

LENGTHS_Q = [5, 0, 40, 1]
LENGTHS_K = [37, 16, 40, 0]
UNUSED = -7  # table entries past a sequence's pages: never read


def paged_copy(k, v, cu_k, page_size, spare_pages=3, seed=0):
    """(k_pages, v_pages, block_table): each sequence's keys copied, in order, into pages of one pool
    ``[num_pages, page_size, heads, dim]`` drawn in random order; table entries past its pages are UNUSED."""
    lengths = (cu_k[1:] - cu_k[:-1]).tolist()
    pages_of = [-(-n // page_size) for n in lengths]
    max_pages = max(pages_of) + 1
    num_pages = sum(pages_of) + spare_pages
    order = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed)).tolist()
    k_pages = torch.randn(num_pages, page_size, *k.shape[1:]).to(k.dtype)
    v_pages = torch.randn(num_pages, page_size, *v.shape[1:]).to(v.dtype)
    table = torch.full((len(lengths), max_pages), UNUSED, dtype=torch.int32)
    start = cu_k[:-1].tolist()
    for b, n in enumerate(lengths):
        for col in range(pages_of[b]):
            page = order.pop()
            table[b, col] = page
            rows = slice(start[b] + col * page_size, start[b] + min(n, (col + 1) * page_size))
            count = rows.stop - rows.start
            k_pages[page, :count] = k[rows].cpu()
            v_pages[page, :count] = v[rows].cpu()
    device = k.device
    return k_pages.to(device), v_pages.to(device), table.to(device)


def repacked(k, v, cu_k, used):
    """k, v and cu_seqlens_k of the first ``used[b]`` keys of each sequence only."""
    starts = cu_k[:-1].tolist()
    rows = [torch.arange(s, s + n) for s, n in zip(starts, used, strict=True)]
    index = torch.cat(rows).to(k.device)
    return k[index], v[index], cu_seqlens(used, k.device)


@pytest.mark.parametrize(
    ("page_size", "options"),
    [
        (16, {"is_causal": True}),
        (48, {}),
        (16, {"is_causal": True, "window": (9, None), "softcap": 5.0}),
    ],
)
def test_paged_forward_is_the_packed_forward(page_size, options, device):
    # The same keys, paged in random order: the same blocks in the same order, so the same bits as the
    # packed call; both within the float64 rule.
    q, k, v, cu_q, cu_k = packed_inputs(LENGTHS_Q, LENGTHS_K, 4, 2, 24, torch.float16, device)
    k_pages, v_pages, table = paged_copy(k, v, cu_k, page_size)
    packed = flash_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, return_lse=True, **options)
    with expect_launches(*FORWARD_KERNELS, device=device):
        out, lse = flash_attention_varlen(q, k_pages, v_pages, cu_q, cu_k, 40, 40, return_lse=True,
                                          block_table=table, **options)  # fmt: skip
    assert torch.equal(out, packed[0]) and torch.equal(lse, packed[1])
    zeros = torch.zeros(q.shape, dtype=q.dtype), torch.zeros(q.shape[1], q.shape[0])
    truth = dense_per_sequence(q, k, v, cu_q, cu_k, *zeros, torch.float64, **options)
    same = dense_per_sequence(q, k, v, cu_q, cu_k, *zeros, q.dtype, **options)
    assert_error_rule("out", out.cpu(), same[0], truth[0], 2.0, q.dtype)
    assert_error_rule("lse", lse.cpu(), same[1], truth[1], 2.0, q.dtype)


def test_paged_alibi_gqa_and_seqused_without_cu_seqlens_k(device):
    # vLLM's call: seqused_k gives the keys, cu_seqlens_k is None; ALiBi per (sequence, head), GQA 4:1.
    # Sequences 0 and 2 see keys (each with its own row of slopes: the reference takes row b for sequence b).
    q, k, v, cu_q, cu_k = packed_inputs(LENGTHS_Q, LENGTHS_K, 4, 1, 32, torch.bfloat16, device)
    k_pages, v_pages, table = paged_copy(k, v, cu_k, 32)
    used = [30, 16, 33, 0]
    slopes = torch.rand(4, 4, device=device)
    options = {"is_causal": True, "alibi_slopes": slopes}
    with expect_launches(*FORWARD_KERNELS, device=device):
        out, lse = flash_attention_varlen(q, k_pages, v_pages, cu_q, None, 40, 33, block_table=table,
                                          seqused_k=torch.tensor(used, dtype=torch.int32, device=device),
                                          return_lse=True, **options)  # fmt: skip
    k_used, v_used, cu_used = repacked(k, v, cu_k, used)
    zeros = torch.zeros(q.shape, dtype=q.dtype), torch.zeros(q.shape[1], q.shape[0])
    truth = dense_per_sequence(q, k_used, v_used, cu_q, cu_used, *zeros, torch.float64, **options)
    same = dense_per_sequence(q, k_used, v_used, cu_q, cu_used, *zeros, q.dtype, **options)
    assert_error_rule("out", out.cpu(), same[0], truth[0], 2.0, q.dtype)
    assert_error_rule("lse", lse.cpu(), same[1], truth[1], 2.0, q.dtype)


@pytest.mark.parametrize("deterministic", [False, True])
def test_seqused_k_forward_and_backward(deterministic, device):
    # Each sequence attends to the first seqused_k[b] of its keys (masks aligned on that length); the rows
    # past it get zero gradients, the rest the dense gradients of the shortened sequences.
    q, k, v, cu_q, cu_k = packed_inputs(LENGTHS_Q, LENGTHS_K, 2, 2, 16, torch.float32, device)
    used = [20, 16, 0, 0]
    seqused = torch.tensor(used, dtype=torch.int32, device=device)
    k_used, v_used, cu_used = repacked(k, v, cu_k, used)
    dout = torch.randn(q.shape).to(device)
    dlse = torch.randn(q.shape[1], q.shape[0]).to(device)
    truth = dense_per_sequence(q, k_used, v_used, cu_q, cu_used, dout, dlse, torch.float64, is_causal=True)
    same = dense_per_sequence(q, k_used, v_used, cu_q, cu_used, dout, dlse, q.dtype, is_causal=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    kernels = (
        (flash.BACKWARD_PREPROCESS.name, flash.BACKWARD_DKDV.name, flash.BACKWARD_DQ.name)
        if deterministic
        else BACKWARD_KERNELS
    )
    with expect_launches(*FORWARD_KERNELS, *kernels, device=device):
        out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, 40, 40, is_causal=True, return_lse=True,
                                          seqused_k=seqused, deterministic=deterministic)  # fmt: skip
        finite = torch.isfinite(lse)
        ((out * dout).sum() + torch.where(finite, lse * dlse, 0).sum()).backward()
    index = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_k[:-1].tolist(), used, strict=True)])
    unused = torch.ones(k.shape[0], dtype=torch.bool)
    unused[index] = False
    dq, dk, dv = (t.grad.cpu() for t in leaves)
    assert (dk[unused] == 0).all() and (dv[unused] == 0).all()
    got = (out.detach().cpu(), lse.detach().cpu(), dq, dk[index], dv[index])
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_error_rule(name, got[i], same[i], truth[i], 2.0 if i < 2 else 3.0, q.dtype)


def test_full_seqused_k_changes_nothing(device):
    q, k, v, cu_q, cu_k = packed_inputs([9, 30], [30, 9], 2, 2, 16, torch.float16, device)
    full = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    got = check_varlen(q, k, v, cu_q, cu_k, is_causal=True)
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 30, 30, is_causal=True, seqused_k=full)
    assert torch.equal(out.cpu(), got[0].cpu())


def test_paged_is_forward_only(device):
    q, k, v, cu_q, cu_k = packed_inputs([4, 4], [16, 20], 2, 2, 16, torch.float32, device)
    k_pages, v_pages, table = paged_copy(k, v, cu_k, 16)
    with pytest.raises(ValueError, match="forward-only"):
        flash_attention_varlen(q.requires_grad_(), k_pages, v_pages, cu_q, cu_k, 4, 20, block_table=table)
    with torch.no_grad():
        assert (
            flash_attention_varlen(q, k_pages, v_pages, cu_q, cu_k, 4, 20, block_table=table).shape == q.shape
        )


def test_bad_paged_arguments_name_the_argument(device, monkeypatch):
    # The checks of the table's and the lengths' values (the last four) read them on the host: on for every
    # device here (CUDA's default is off: test_unchecked_bad_page_and_length_give_nan_rows_only_there).
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)
    q, k, v, cu_q, cu_k = packed_inputs([4, 4], [16, 20], 2, 2, 16, torch.float32, device)
    k_pages, v_pages, table = paged_copy(k, v, cu_k, 16)

    def call(max_k=20, **changes):
        args = {"k": k_pages, "v": v_pages, "cu_seqlens_k": cu_k, "block_table": table, "seqused_k": None}
        args.update(changes)
        return flash_attention_varlen(q, args.pop("k"), args.pop("v"), cu_q, args.pop("cu_seqlens_k"), 4,
                                      max_k, **args)  # fmt: skip

    with pytest.raises(TypeError, match="block_table has dtype torch.int64"):
        call(block_table=table.long())
    with pytest.raises(ValueError, match=r"block_table must be \[batch, max_pages\] with batch = 2"):
        call(block_table=table[:1])
    with pytest.raises(ValueError, match="page_size .* multiple of 16"):
        call(k=k_pages[:, :8], v=v_pages[:, :8])
    with pytest.raises(ValueError, match="with block_table, k must be pages"):
        call(k=k, v=v)
    with pytest.raises(TypeError, match="cu_seqlens_k may be None only"):
        call(cu_seqlens_k=None)
    with pytest.raises(ValueError, match=r"seqused_k must be \[batch\]"):
        call(seqused_k=torch.zeros(3, dtype=torch.int32, device=device))
    bad = table.clone()
    bad[1, 1] = k_pages.shape[0]  # the second page of sequence 1 (20 keys) is in use
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = \d+ is not a page of k"):
        call(block_table=bad)
    with pytest.raises(ValueError, match=r"seqused_k\[0\] = 17 must be in \[0, 16\]"):
        call(seqused_k=torch.tensor([17, 3], dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="more than the block table holds"):
        call(cu_seqlens_k=cu_seqlens([16, 49], device), max_k=49)  # 3 pages of 16 per row


def test_unchecked_bad_page_and_length_give_nan_rows_only_there(device, monkeypatch):
    # Values unchecked (the CUDA default): a table entry outside the pool, or a seqused_k past a sequence's
    # keys, turns that sequence's rows into NaN and reads no page outside the pool; the others stay exact.
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    q, k, v, cu_q, cu_k = packed_inputs([4, 6, 3], [16, 20, 5], 2, 2, 16, torch.float32, device)
    k_pages, v_pages, table = paged_copy(k, v, cu_k, 16)
    good = flash_attention_varlen(q, k_pages, v_pages, cu_q, cu_k, 6, 20, block_table=table)
    bad = table.clone()
    bad[1, 1] = 10**6
    out = flash_attention_varlen(q, k_pages, v_pages, cu_q, cu_k, 6, 20, block_table=bad)
    assert out[4:10].isnan().all()
    assert torch.equal(out[:4], good[:4]) and torch.equal(out[10:], good[10:])
    longer = cu_seqlens([16, 49, 5], device)  # sequence 1 claims more keys than its row's 3 pages hold
    out = flash_attention_varlen(q, k_pages, v_pages, cu_q, longer, 6, 49, block_table=table)
    assert out[4:10].isnan().all()
    assert torch.equal(out[:4], good[:4]) and torch.equal(out[10:], good[10:])
    seqused = torch.tensor([16, 21, 5], dtype=torch.int32, device=device)  # sequence 1 has 20 keys
    out = flash_attention_varlen(q, k, v, cu_q, cu_k, 6, 21, seqused_k=seqused)
    assert out[4:10].isnan().all() and not out[:4].isnan().any() and not out[10:].isnan().any()


def test_flash_attn_varlen_func_block_table(device):
    # flash-attn's call: k/v as [num_blocks, page_block_size, heads_k, dim], cu_seqlens_k the key lengths;
    # with dropout the returned S_dmask (over the paged keys) matches the packed call's.
    q, k, v, cu_q, cu_k = packed_inputs(LENGTHS_Q, LENGTHS_K, 2, 2, 16, torch.float32, device)
    k_pages, v_pages, table = paged_copy(k, v, cu_k, 16)
    packed = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, 0.0, None, True)
    with torch.no_grad():
        out = flash_attn_varlen_func(
            q, k_pages, v_pages, cu_q, cu_k, 40, 40, 0.0, None, True, block_table=table
        )
    assert torch.equal(out, packed)
    torch.manual_seed(3)
    ref = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 40, 40, 0.25, return_attn_probs=True)
    torch.manual_seed(3)
    with torch.no_grad():
        got = flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, 40, 40, 0.25, return_attn_probs=True,
                                     block_table=table)  # fmt: skip
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_paged_op_registration(device):
    # The packed forward op with a block table passes torch.library's checks (schema, fake, dispatch).
    q, k, v, cu_q, cu_k = packed_inputs([3, 5], [16, 7], 2, 1, 16, torch.float32, device)
    k_pages, v_pages, table = paged_copy(k, v, cu_k, 16)
    used = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
    args = (q, k_pages, v_pages, cu_q, None, 5, 16, True, 0.25)
    kwargs = {"seqused_k": used, "block_table": table}
    torch.library.opcheck(torch.ops.llm_speed.flash_attention_varlen_forward.default, args, kwargs,
                          test_utils=("test_schema", "test_faketensor"))  # fmt: skip
