"""Tensors an op writes into hold each element once and share no memory with each other
(``core.tensors.check_written_in_place``), as PyTorch's in-place ops require: a KV cache that new tokens are
appended to, and the output gradient rms_norm(in_place=True) writes dx over. Before (audit of 2026-12-07),
an expanded cache took each sequence's new token in one shared row, ``k_cache is v_cache`` had the key
overwritten by the value, and a reduction's expanded output gradient gave every row of dx the same values."""

from __future__ import annotations

import pytest
import torch

import llm_speed
from llm_speed.core.tensors import check_written_in_place, internal_overlap


def test_internal_overlap_is_a_zero_stride_over_several_elements():
    base = torch.zeros(1, 8, 2, 4)
    assert internal_overlap(base.expand(3, 8, 2, 4))
    assert not internal_overlap(base)
    assert not internal_overlap(torch.zeros(1, 8).expand(1, 8))  # a size-1 dim's stride is irrelevant
    assert not internal_overlap(torch.zeros(4, 6)[:, ::2])


def test_views_of_one_buffer_are_judged_as_pytorch_judges_them():
    packed = torch.zeros(2, 3, 2, 4, 8)  # [batch, seq, k/v, heads, dim]: interleaved, never overlapping
    check_written_in_place(k_cache=packed[:, :, 0], v_cache=packed[:, :, 1])
    stacked = torch.zeros(2, 2, 3, 4, 8)  # [k/v, batch, ...]: two contiguous halves
    check_written_in_place(k_cache=stacked[0], v_cache=stacked[1])
    with pytest.raises(ValueError, match="k_cache and v_cache are written in place and share memory"):
        check_written_in_place(k_cache=stacked[0], v_cache=stacked[0])
    flat = torch.zeros(100)
    with pytest.raises(ValueError, match="share memory"):  # contiguous, overlapping bytes
        check_written_in_place(k_cache=flat[:60], v_cache=flat[40:])


def _decode_inputs(batch=2, heads=4, heads_kv=2, dim=16, slots=32):
    torch.manual_seed(0)
    q = torch.randn(batch, 1, heads, dim)
    k_new, v_new = torch.randn(batch, 1, heads_kv, dim), torch.randn(batch, 1, heads_kv, dim)
    lengths = torch.tensor([5, 9], dtype=torch.int32)
    k_base, v_base = torch.randn(1, slots, heads_kv, dim), torch.randn(1, slots, heads_kv, dim)
    return q, k_new, v_new, lengths, k_base, v_base


def test_an_expanded_cache_is_refused_before_anything_is_written():
    q, k_new, v_new, lengths, k_base, v_base = _decode_inputs()
    before = k_base.clone()
    with pytest.raises(ValueError, match="k_cache is written in place but has a stride of 0"):
        llm_speed.flash_attention_with_kvcache(q, k_base.expand(2, -1, -1, -1), v_base.expand(2, -1, -1, -1),
                                               cache_seqlens=lengths, k=k_new, v=v_new)  # fmt: skip
    assert torch.equal(k_base, before)
    # reading one shared prompt's cache without appending is fine
    shared = k_base.expand(2, -1, -1, -1), v_base.expand(2, -1, -1, -1)
    out = llm_speed.flash_attention_with_kvcache(q, *shared, cache_seqlens=lengths)
    assert out.shape == q.shape


def test_one_tensor_for_both_caches_is_refused_when_appending():
    q, k_new, v_new, lengths, cache, _ = _decode_inputs()
    cache = cache.repeat(2, 1, 1, 1)
    before = cache.clone()
    with pytest.raises(ValueError, match="k_cache and v_cache are written in place and share memory"):
        llm_speed.flash_attention_with_kvcache(q, cache, cache, cache_seqlens=lengths, k=k_new, v=v_new)
    assert torch.equal(cache, before)


def test_rms_norm_in_place_backward_does_not_write_into_an_expanded_gradient():
    torch.manual_seed(0)
    x = torch.randn(4, 16, requires_grad=True)
    weight = torch.randn(16, requires_grad=True)
    column = torch.arange(16.0)
    # sum(0)'s backward hands rms_norm an output gradient expanded over the rows (strides (0, 1))
    (llm_speed.rms_norm(x, weight, in_place=True).sum(0) * column).sum().backward()
    x64 = x.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.detach().double()
    (y64.sum(0) * column.double()).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-5)


def test_one_tensor_for_both_caches_is_refused_under_torch_compile():
    """Traced, the tensors have no addresses, but one tensor given twice is still the same object."""
    q, k_new, v_new, lengths, cache, _ = _decode_inputs()
    cache = cache.repeat(2, 1, 1, 1)

    def step(q, k_cache, v_cache, lengths, k, v):
        return llm_speed.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v)

    torch._dynamo.reset()
    with pytest.raises(ValueError, match="k_cache and v_cache are written in place and share memory"):
        torch.compile(step, backend="eager")(q, cache, cache, lengths, k_new, v_new)


def test_a_query_in_the_memory_of_the_cache_it_appends_to_is_refused():
    """The kernel reads q after writing the new tokens: a q viewed from the slot it appends into would be
    the new key."""
    _, k_new, v_new, lengths, k_base, v_base = _decode_inputs(heads=2)
    k_cache, v_cache = k_base.repeat(2, 1, 1, 1), v_base.repeat(2, 1, 1, 1)
    with pytest.raises(ValueError, match="q shares memory with k_cache, which this call writes"):
        llm_speed.flash_attention_with_kvcache(k_cache[:, 5:6], k_cache, v_cache, cache_seqlens=lengths,
                                               k=k_new, v=v_new)  # fmt: skip
