"""llm_speed.flash_attn_interface against flash-attn's own test grids (Dao-AILab/flash-attention,
tests/test_flash_attn.py: test_flash_attn_output, test_flash_attn_varlen_output, the qkv/kv-packed variants,
dropout, ALiBi, deterministic), sampled so the interpreter runs them in seconds.

Two accuracy rules on every case: flash-attn's (kernel error against a float32 reference at most twice the
same-dtype PyTorch error, plus a small floor) and llm-speed's (against float64, ``tests/accuracy_rule.py``).
Dropout cases build their reference from the mask that ``return_attn_probs`` gives back, which also proves the
mask reproduces the output and the gradients. Launch counts prove the Triton kernels ran.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_testing import (
    BACKWARD_KERNELS,
    FORWARD_KERNELS,
    GRAD_FACTOR,
    OUTPUT_FACTOR,
    assert_error_rule,
    expect_launches,
    max_error,
)

import llm_speed
from llm_speed import flash_attn_interface as fa
from llm_speed.attention import reference


def _reference(q, k, v, *, causal, window, softcap, alibi, keep, dropout_p, scale=None):
    """flash-attn layout [b, s, h, d] through llm-speed's reference, in the inputs' dtype."""
    out = reference.reference_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, window=window,
        softcap=softcap, scale=scale, alibi_slopes=None if alibi is None else alibi.to(q.dtype),
        dropout_p=dropout_p, dropout_mask=keep,
    )  # fmt: skip
    return out.transpose(1, 2)


def _flash_attn_rule(name, out, out_pt, out_ref32):
    """flash-attn's own rule: error against the float32 reference at most 2x PyTorch's in the same dtype
    (plus a floor of one unit of rounding, for PyTorch results that happen to be almost exact)."""
    floor = 1e-3 if out.dtype == torch.float16 else 8e-3
    assert max_error(out, out_ref32) <= 2 * max_error(out_pt, out_ref32) + floor, name


def _alibi_slopes(batch, heads, per_batch):
    slopes = torch.rand(batch, heads) * 0.3 if per_batch else torch.rand(heads) * 0.3
    return slopes.float()


# (head_dim, seq_q, seq_k, causal, local, softcap, alibi, heads_k (of 4 query heads), dropout_p, dtype,
#  packing): a sample of flash-attn's grid, every option at least twice, head dims that are not multiples of
# 8 (59, 111: in its grid; 1 and 3: the ends).
CASES = [
    (59, 33, 45, True, False, 0.0, None, 4, 0.0, torch.float16, "none"),
    (111, 17, 17, False, False, 0.0, "head", 2, 0.0, torch.bfloat16, "qkv"),
    (80, 1, 23, True, True, 0.0, None, 1, 0.17, torch.float16, "none"),
    (40, 23, 9, False, True, 30.0, "batch", 2, 0.0, torch.float16, "kv"),
    (3, 19, 31, True, False, 0.0, "batch", 4, 0.17, torch.bfloat16, "none"),
    (1, 8, 8, False, False, 0.0, None, 4, 0.0, torch.float16, "qkv"),
    (96, 21, 21, True, False, 50.0, "head", 2, 0.17, torch.float16, "kv"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"d{c[0]}-{c[1]}x{c[2]}-{c[10]}")
def test_output_and_gradients_match_flash_attn_rules(case, device):
    d, seq_q, seq_k, causal, local, softcap, alibi, heads_k, dropout_p, dtype, packing = case
    torch.manual_seed(d + seq_q)
    batch, heads = 2, 4
    window_size = (5, 3) if local else (-1, -1)
    window = (5, 3) if local else None
    if packing == "qkv":
        seq_k, heads_k = seq_q, heads
    q = torch.randn(batch, seq_q, heads, d, dtype=dtype, device=device)
    k = torch.randn(batch, seq_k, heads_k, d, dtype=dtype, device=device)
    v = torch.randn(batch, seq_k, heads_k, d, dtype=dtype, device=device)
    slopes = None if alibi is None else _alibi_slopes(batch, heads, alibi == "batch").to(device)
    options = dict(causal=causal, window_size=window_size, softcap=softcap, alibi_slopes=slopes,
                   return_attn_probs=True)  # fmt: skip
    if packing == "qkv":
        qkv = torch.stack([q, k, v], 2).requires_grad_()
        run = lambda: fa.flash_attn_qkvpacked_func(qkv, dropout_p, **options)  # noqa: E731
        leaves = (qkv,)
    elif packing == "kv":
        q.requires_grad_()
        kv = torch.stack([k, v], 2).requires_grad_()
        run = lambda: fa.flash_attn_kvpacked_func(q, kv, dropout_p, **options)  # noqa: E731
        leaves = (q, kv)
    else:
        q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
        run = lambda: fa.flash_attn_func(q, k, v, dropout_p, **options)  # noqa: E731
        leaves = (q, k, v)
    with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=device):
        out, lse, s_dmask = run()
        assert out.shape == (batch, seq_q, heads, d) and out.is_contiguous()
        assert lse.shape == (batch, heads, seq_q) and lse.dtype == torch.float32
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, dout)

    keep = None
    if dropout_p:
        assert s_dmask.shape == (batch, heads, seq_q, seq_k)
        keep = (s_dmask >= 0).cpu()
    else:
        assert s_dmask is None  # flash-attn returns S_dmask only with dropout
    capped = softcap or None

    def leaves_as(dtype_):
        return tuple(t.detach().cpu().to(dtype_).requires_grad_() for t in leaves)

    results = {}
    for label, dtype_ in (("truth", torch.float64), ("ref32", torch.float32), ("pt", dtype)):
        copies = leaves_as(dtype_)
        if packing == "qkv":
            q_, k_, v_ = copies[0].unbind(2)
        elif packing == "kv":
            q_, (k_, v_) = copies[0], copies[1].unbind(2)
        else:
            q_, k_, v_ = copies
        ref = _reference(
            q_, k_, v_, causal=causal, window=window, softcap=capped,
            alibi=None if slopes is None else slopes.cpu(), keep=keep, dropout_p=dropout_p,
        )  # fmt: skip
        results[label] = (ref, torch.autograd.grad(ref, copies, dout.cpu().to(dtype_)))
    truth, pt, ref32 = results["truth"], results["pt"], results["ref32"]
    _flash_attn_rule("out", out, pt[0], ref32[0])
    assert_error_rule("out", out, pt[0], truth[0], OUTPUT_FACTOR, dtype)
    for i, grad in enumerate(grads):
        assert_error_rule(f"grad {i}", grad, pt[1][i], truth[1][i], GRAD_FACTOR, dtype)
    if dropout_p and packing == "none":  # |S_dmask| holds the probabilities themselves
        probs = reference.attention_probabilities(
            q.detach().transpose(1, 2).float().cpu(), k.detach().transpose(1, 2).float().cpu(), lse.cpu(),
            scale=1 / math.sqrt(d), is_causal=causal, window=window, softcap=capped,
            alibi_slopes=None if slopes is None else slopes.cpu(),
        )  # fmt: skip
        torch.testing.assert_close(s_dmask.abs().float().cpu(), probs, atol=2e-3, rtol=1e-2)


def test_varlen_output_grid_and_packed_variants(device):
    """flash-attn's test_flash_attn_varlen_output, sampled: ragged lengths (one empty query sequence), GQA,
    causal, ALiBi per (sequence, head), dropout reproduced from S_dmask; and the qkv/kv-packed variants
    equal the unpacked call bit for bit."""
    torch.manual_seed(3)
    lens_q, lens_k, heads, heads_k, d, dtype = [5, 0, 19], [7, 4, 23], 4, 2, 59, torch.float16
    cu_q = torch.tensor([0, 5, 5, 24], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 7, 11, 34], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), heads, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(sum(lens_k), heads_k, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(sum(lens_k), heads_k, d, dtype=dtype, device=device, requires_grad=True)
    slopes = _alibi_slopes(3, heads, True).to(device)
    with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=device):
        out, lse, s_dmask = fa.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), 0.2, None, True, alibi_slopes=slopes,
            return_attn_probs=True,
        )  # fmt: skip
        dout = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    assert out.shape == q.shape and lse.shape == (heads, sum(lens_q))
    assert s_dmask.shape == (3, heads, max(lens_q), max(lens_k))
    for b in (0, 2):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        keep = (s_dmask[b : b + 1, :, : q1 - q0, : k1 - k0] >= 0).cpu()
        copies = [t.detach().cpu()[a:z].double().unsqueeze(0).requires_grad_()
                  for t, (a, z) in ((q, (q0, q1)), (k, (k0, k1)), (v, (k0, k1)))]  # fmt: skip
        pt = [t.detach().to(dtype).requires_grad_() for t in copies]
        refs = []
        for qs, ks, vs in (copies, pt):
            ref = _reference(qs, ks, vs, causal=True, window=None, softcap=None, alibi=slopes[b].cpu(),
                             keep=keep, dropout_p=0.2)  # fmt: skip
            grad_out = dout.cpu()[q0:q1].unsqueeze(0).to(ref.dtype)
            refs.append((ref, torch.autograd.grad(ref, (qs, ks, vs), grad_out)))
        (truth, truth_grads), (same, same_grads) = refs
        assert_error_rule(f"out {b}", out[q0:q1].unsqueeze(0), same, truth, OUTPUT_FACTOR, dtype)
        for i, (grad, (a, z)) in enumerate(zip(grads, ((q0, q1), (k0, k1), (k0, k1)), strict=True)):
            assert_error_rule(f"grad {i} seq {b}", grad[a:z].unsqueeze(0), same_grads[i], truth_grads[i],
                              GRAD_FACTOR, dtype)  # fmt: skip

    # the packed variants are views of the same call
    qkv = torch.stack([q.detach(), q.detach(), q.detach()], 1)
    cu = torch.tensor([0, 5, 5, 24], dtype=torch.int32, device=device)
    packed = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 19, causal=True)
    plain = fa.flash_attn_varlen_func(q.detach(), q.detach(), q.detach(), cu, cu, 19, 19, causal=True)
    torch.testing.assert_close(packed, plain, rtol=0, atol=0)
    kv = torch.stack([k.detach(), v.detach()], 1)
    packed = fa.flash_attn_varlen_kvpacked_func(q.detach(), kv, cu_q, cu_k, 19, 23, window_size=(3, -1))
    plain = fa.flash_attn_varlen_func(
        q.detach(), k.detach(), v.detach(), cu_q, cu_k, 19, 23, window_size=(3, -1)
    )
    torch.testing.assert_close(packed, plain, rtol=0, atol=0)


def test_dropout_same_seed_same_result_and_keep_rate(device):
    """Same torch seed, same output and gradients (bitwise); another seed, another mask; the kept fraction
    of visible weights is within 4 standard deviations of 1 - p."""
    q, k, v = (torch.randn(2, 64, 2, 16, device=device, requires_grad=True) for _ in range(3))
    results = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        out, _, s_dmask = fa.flash_attn_func(q, k, v, 0.3, return_attn_probs=True)
        results.append((out, torch.autograd.grad(out.sum(), q)[0], s_dmask))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][2] >= 0, results[2][2] >= 0)
    kept = (results[0][2] > 0).double().mean().item()
    n = results[0][2].numel()
    assert abs(kept - 0.7) <= 4 * math.sqrt(0.7 * 0.3 / n), kept


def test_mask_rebuilt_in_pytorch_equals_the_kernels():
    """reference.dropout_keep (Philox in int64 PyTorch) reproduces the kernels' mask: the output of a
    dropout call equals the float64 reference run with that mask, rebuilt from the replayed seed alone."""
    torch.manual_seed(11)
    q, k, v = (torch.randn(1, 2, 16, 24, dtype=torch.float64).float() for _ in range(3))
    torch.manual_seed(5)
    out = llm_speed.flash_attention(q, k, v, dropout_p=0.4)
    torch.manual_seed(5)
    rng = torch.randint(-(2**62), 2**62, (2,), dtype=torch.int64)
    keep = reference.kernel_dropout_keep(rng, 0.4, 1, 2, 16, 16, "cpu")
    ref = reference.reference_attention(q.double(), k.double(), v.double(), dropout_p=0.4, dropout_mask=keep)
    assert max_error(out, ref) < 1e-5


def test_deterministic_backward_is_bitwise_repeatable(device):
    """flash-attn's test_flash_attn_deterministic: deterministic=True gives identical gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 40, 4, 24, dtype=torch.float16, device=device, requires_grad=True)
               for _ in range(3))  # fmt: skip
    grads = []
    for _ in range(2):
        out = fa.flash_attn_func(q, k, v, causal=True, deterministic=True)
        grads.append(torch.autograd.grad(out.sum(), (q, k, v)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_flash_attn_arguments_and_their_errors():
    q = torch.randn(1, 4, 2, 16)
    # window_size=(-1, x) and softcap=0.0 are flash-attn's "off", positional dropout_p is accepted
    torch.testing.assert_close(fa.flash_attn_func(q, q, q, 0.0, None, False, (-1, 2), 0.0),
                               fa.flash_attn_func(q, q, q, window_size=(-1, 2)), rtol=0, atol=0)  # fmt: skip
    with pytest.raises(ValueError, match="dropout_p must be in"):
        fa.flash_attn_func(q, q, q, 1.0)
    with pytest.raises(ValueError, match="alibi_slopes must be"):
        fa.flash_attn_func(q, q, q, alibi_slopes=torch.ones(3))
    with pytest.raises(TypeError, match="alibi_slopes has dtype torch.float16; accepted: float32"):
        fa.flash_attn_func(q, q, q, alibi_slopes=torch.ones(2, dtype=torch.float16))
    with pytest.raises(ValueError, match="qkv must have 5 dims"):
        fa.flash_attn_qkvpacked_func(q)
    with pytest.raises(ValueError, match=r"with block_table, k must be pages \[num_pages >= 1, page_size"):
        cu = torch.tensor([0, 4], dtype=torch.int32)
        table = torch.zeros(1, 1, dtype=torch.int32)
        fa.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, block_table=table)


def test_kvcache_wrapper_takes_flash_attn_positional_layout(device):
    """flash_attn_with_kvcache(q, k_cache, v_cache, k, v, ...) with k/v positional, flash-attn's order."""
    torch.manual_seed(1)
    q = torch.randn(2, 1, 4, 32, device=device)
    k_cache, v_cache = (torch.zeros(2, 16, 2, 32, device=device) for _ in range(2))
    k_cache[:, :5], v_cache[:, :5] = torch.randn(2, 5, 2, 32), torch.randn(2, 5, 2, 32)
    k_new, v_new = (torch.randn(2, 1, 2, 32, device=device) for _ in range(2))
    seqlens = torch.tensor([5, 5], dtype=torch.int32, device=device)
    out, lse = fa.flash_attn_with_kvcache(
        q, k_cache, v_cache, k_new, v_new, cache_seqlens=seqlens, causal=True, return_softmax_lse=True
    )
    keys, values = k_cache[:, :6].transpose(1, 2), v_cache[:, :6].transpose(1, 2)
    ref = reference.reference_attention(q.transpose(1, 2).double(), keys.double(), values.double(),
                                        is_causal=True).transpose(1, 2)  # fmt: skip
    assert max_error(out, ref) < 1e-5 and lse.shape == (2, 4, 1)
    torch.testing.assert_close(k_cache[:, 5:6], k_new, rtol=0, atol=0)


@pytest.mark.parametrize("causal, scale", [(False, None), (True, -0.3)], ids=["plain", "causal-neg-scale"])
def test_repeated_plain_call_is_served_in_flash_attn_layout(causal, scale, device, monkeypatch):
    """A repeated plain inference call of flash_attn_func launches the plan its first call kept, on the
    [batch, seq, heads, dim] tensors as given: no call of flash_attention, the same output bit for bit, in
    that layout and contiguous; a call with grad (its first: the entry kept with grad stores the LSE),
    dropout, probabilities or other metadata takes the full path."""
    from llm_speed.core import launch

    launch.clear_plans()
    calls, original = [], fa.flash_attention
    monkeypatch.setattr(fa, "flash_attention", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    q, k, v = (torch.randn(2, 37, h, 32, device=device, dtype=torch.float16) for h in (4, 2, 2))
    with torch.no_grad(), expect_launches(*FORWARD_KERNELS, device=device):
        first = fa.flash_attn_func(q, k, v, causal=causal, softmax_scale=scale)
        again = fa.flash_attn_func(q, k, v, causal=causal, softmax_scale=scale)
    assert len(calls) == 1  # the second call was served without it
    assert again.shape == q.shape and again.is_contiguous() and torch.equal(again, first)
    expected = _reference(q.float(), k.float(), v.float(), causal=causal, window=None, softcap=None,
                          alibi=None, keep=None, dropout_p=0.0, scale=scale)  # fmt: skip
    torch.testing.assert_close(again.float(), expected, rtol=2e-3, atol=2e-3)
    with torch.no_grad():
        fa.flash_attn_func(q, k, v, causal=not causal, softmax_scale=scale)  # other metadata
        fa.flash_attn_func(q, k, v, causal=causal, softmax_scale=scale, return_attn_probs=True)
        fa.flash_attn_func(q[:, :20], k, v, causal=causal, softmax_scale=scale)
    fa.flash_attn_func(q.requires_grad_(), k, v, causal=causal, softmax_scale=scale)  # grad to record
    assert len(calls) == 5
    # with a profiler listening the served call reports the problem as flash_attention would
    from llm_speed.core import runtime

    reports = []
    monkeypatch.setattr(runtime, "_work_observers", [lambda op, problem: reports.append((op, problem))])
    with torch.no_grad():
        fa.flash_attn_func(q.detach(), k, v, causal=causal, softmax_scale=scale)
    assert len(calls) == 5 and [op for op, _ in reports] == ["flash_attention"]
    assert reports[0][1]["q"].shape == (2, 4, 37, 32) and reports[0][1]["k"].shape == (2, 2, 37, 32)


@pytest.mark.parametrize("causal, scale, deterministic", [(False, None, False), (True, -0.3, True)],
                         ids=["plain", "causal-neg-scale-deterministic"])  # fmt: skip
def test_repeated_call_with_grad_is_served_in_flash_attn_layout(causal, scale, deterministic, device,
                                                                 monkeypatch):  # fmt: skip
    """A repeated plain call of flash_attn_func whose inputs require grad launches the plan its first call
    kept on the [batch, seq, heads, dim] tensors as given and records one autograd node (no transposed view,
    each of which records one: 28 -> 18 us a call on the development CPU, launch stubbed): the same output
    and gradients bit for bit as the full path, within the 2x / 3x rule of float64; other metadata takes
    the full path."""
    from llm_speed.core import launch

    launch.clear_plans()
    calls, original = [], fa.flash_attention
    monkeypatch.setattr(fa, "flash_attention", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 37, h, 32, device=device, dtype=torch.float16) for h in (4, 2, 2))
    dout = torch.randn(2, 37, 4, 32, device=device, dtype=torch.float16).transpose(0, 1).contiguous()
    dout = dout.transpose(0, 1)  # a gradient in another layout than the output's
    results, nodes = [], []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=device):
            out = fa.flash_attn_func(*leaves, causal=causal, softmax_scale=scale, deterministic=deterministic)
            out.backward(dout)
        assert out.shape == q.shape and out.is_contiguous()
        results.append((out.detach(), *(t.grad for t in leaves)))
        nodes.append(type(out.grad_fn).__name__)
    assert len(calls) == 1  # the second call was served without flash_attention
    assert nodes[0] == "TransposeBackward0" and nodes[1] == "_SeqMajorForwardBackward", nodes
    for first, again in zip(*results, strict=True):
        assert torch.equal(first, again)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    same = [t.clone().requires_grad_() for t in (q, k, v)]
    truth = _reference(*leaves, causal=causal, window=None, softcap=None, alibi=None, keep=None,
                       dropout_p=0.0, scale=scale)  # fmt: skip
    truth.backward(dout.double())
    plain = _reference(*same, causal=causal, window=None, softcap=None, alibi=None, keep=None, dropout_p=0.0,
                       scale=scale)  # fmt: skip
    plain.backward(dout)
    expected = [(truth.detach(), plain.detach(), OUTPUT_FACTOR)]
    expected += [(a.grad, b.grad, GRAD_FACTOR) for a, b in zip(leaves, same, strict=True)]
    for name, got, (exact, rounded, factor) in zip(("out", "dq", "dk", "dv"), results[1], expected,
                                                   strict=True):  # fmt: skip
        assert_error_rule(name, got, rounded, exact, factor, q.dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    fa.flash_attn_func(*leaves, causal=not causal, softmax_scale=scale)  # other metadata: the full path
    assert len(calls) == 2
