"""Seed 002's helpers: optimal_attention's dispatch, safe_flash_attention's fallback, the memory pool."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import cuda_llm_ops
import llm_speed
from llm_speed import helpers
from llm_speed.attention.reference import reference_attention
from llm_speed.perf import gemm_tiling, memory


def qkv(device, seq_q=16, seq_kv=None, heads_q=2, heads_kv=None, dtype=torch.float32):
    seq_kv = seq_q if seq_kv is None else seq_kv
    heads_kv = heads_q if heads_kv is None else heads_kv
    q = torch.randn(1, heads_q, seq_q, 16, device=device, dtype=dtype)
    k = torch.randn(1, heads_kv, seq_kv, 16, device=device, dtype=dtype)
    return q, k, torch.randn_like(k)


def test_reexports_are_the_perf_functions():
    for module in (llm_speed, helpers):
        assert module.estimate_attention_memory is memory.estimate_attention_memory
        assert module.find_optimal_batch_size is memory.find_optimal_batch_size
        assert module.pad_to_alignment is gemm_tiling.pad_to_alignment
    for name in ("AttentionMemoryPool", "optimal_attention", "safe_flash_attention"):
        assert getattr(llm_speed, name) is getattr(helpers, name)
        assert hasattr(cuda_llm_ops, name)


@pytest.fixture
def spies(monkeypatch):
    """Replace the three kernels seen by optimal_attention with recorders that compute nothing."""
    calls = []
    for name in ("flash_attention", "tiled_attention", "naive_attention"):

        def spy(q, k, v, *, is_causal, scale, _name=name):
            calls.append((_name, is_causal, scale))
            return torch.zeros_like(q)

        monkeypatch.setattr(helpers, name, spy)
    return calls


@pytest.mark.parametrize(
    "seq_q, seq_kv, chosen",
    [
        (8, 8, "naive_attention"),
        (127, 127, "naive_attention"),
        (128, 128, "tiled_attention"),
        (511, 511, "tiled_attention"),
        (512, 512, "flash_attention"),
        (2048, 2048, "flash_attention"),
        (1, 600, "flash_attention"),
        (200, 64, "tiled_attention"),
    ],
)
def test_optimal_attention_dispatch_by_longer_sequence(spies, seq_q, seq_kv, chosen):
    q = torch.empty(1, 1, seq_q, 8)
    k = torch.empty(1, 1, seq_kv, 8)
    helpers.optimal_attention(q, k, k, is_causal=True, scale=0.5)
    assert spies == [(chosen, True, 0.5)]


def test_optimal_attention_results_match_reference_for_each_branch(device):
    # Real kernels for the naive and tiled branches (flash needs >= 512 tokens: too slow interpreted; the
    # dispatch test above proves it is chosen, and flash_attention has its own accuracy tests).
    for seq in (16, 130):
        q, k, v = qkv(device, seq_q=seq, heads_q=1)
        expected = reference_attention(q.double(), k.double(), v.double(), is_causal=True)
        out = llm_speed.optimal_attention(q, k, v, is_causal=True)
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)


def test_optimal_attention_takes_numpy_bools(spies):
    # (NumPy 2 names numpy.bool_ "numpy.bool": a check by the old name refused it)
    helpers.optimal_attention(*qkv("cpu"), is_causal=np.True_)
    assert spies[0][1] is True


def test_optimal_attention_rejects_bad_input_before_dispatch(spies):
    with pytest.raises(ValueError, match="q must have 4 dims"):
        helpers.optimal_attention(torch.empty(2, 3), torch.empty(2, 3), torch.empty(2, 3))
    with pytest.raises(TypeError, match="is_causal"):
        helpers.optimal_attention(*qkv("cpu"), is_causal="yes")
    with pytest.raises(RuntimeError, match="q must have 4 dims") as info:
        cuda_llm_ops.optimal_attention(torch.empty(2, 3), torch.empty(2, 3), torch.empty(2, 3))
    assert isinstance(info.value, ValueError)
    assert spies == []


def _raise_out_of_memory(*args, **kwargs):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")


@pytest.mark.parametrize(
    "seq_q, seq_kv, heads_kv, is_causal",
    [
        (16, 16, 2, False),
        (16, 16, 2, True),
        (8, 24, 1, True),
        (24, 8, 2, True),
    ],
)
def test_safe_flash_attention_falls_back_on_out_of_memory(
    device, monkeypatch, seq_q, seq_kv, heads_kv, is_causal
):
    q, k, v = qkv(device, seq_q=seq_q, seq_kv=seq_kv, heads_kv=heads_kv)
    expected = llm_speed.flash_attention(q, k, v, is_causal=is_causal, scale=0.2)
    monkeypatch.setattr(helpers, "flash_attention", _raise_out_of_memory)
    with pytest.warns(RuntimeWarning, match="ran out of memory.*scaled_dot_product_attention"):
        out = helpers.safe_flash_attention(q, k, v, is_causal=is_causal, scale=0.2)
    # Same semantics as flash (bottom-right causal mask, rows seeing no key are 0, GQA).
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-6)
    if seq_q > seq_kv:
        assert torch.count_nonzero(out[:, :, : seq_q - seq_kv]) == 0


def test_safe_flash_attention_other_errors_and_disabled_fallback_propagate(device, monkeypatch):
    q, k, v = qkv(device)
    monkeypatch.setattr(helpers, "flash_attention", _raise_out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        helpers.safe_flash_attention(q, k, v, fallback_to_torch=False)

    def other_error(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(helpers, "flash_attention", other_error)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning either
        with pytest.raises(RuntimeError, match="illegal memory access"):
            helpers.safe_flash_attention(q, k, v)
    with pytest.raises(TypeError, match="fallback_to_torch"):
        helpers.safe_flash_attention(q, k, v, fallback_to_torch="no")


def test_safe_flash_attention_without_error_is_flash(device):
    q, k, v = qkv(device)
    assert torch.equal(helpers.safe_flash_attention(q, k, v), llm_speed.flash_attention(q, k, v))
    assert torch.equal(
        cuda_llm_ops.safe_flash_attention(q, k, v, True, is_causal=True, scale=0.0),
        llm_speed.flash_attention(q, k, v, is_causal=True),
    )


def test_memory_pool_hands_out_views_of_one_allocation(device):
    pool = llm_speed.AttentionMemoryPool(4, 2, 64, 16, device=device, dtype=torch.float32)
    assert pool.nbytes == 4 * 4 * 2 * 64 * 16 * 4
    q, k, v, out = pool.get_tensors(3, 40)
    assert q.shape == k.shape == v.shape == out.shape == (3, 2, 40, 16)
    assert q.data_ptr() == pool.q.data_ptr() and out.data_ptr() == pool.output.data_ptr()
    assert not q.is_contiguous()  # strided over max_seq_len: the kernels read it in place
    # Writing through a view lands in the pool, and the next request returns the same memory.
    q.copy_(torch.randn_like(q))
    k.copy_(torch.randn_like(k))
    v.copy_(torch.randn_like(v))
    again = pool.get_tensors(3, 40)
    assert torch.equal(again[0], q)
    expected = reference_attention(q.double(), k.double(), v.double())
    torch.testing.assert_close(llm_speed.flash_attention(q, k, v).double(), expected, rtol=0, atol=1e-5)
    assert pool.get_tensors(4, 64)[0].is_contiguous()


def test_memory_pool_bad_sizes():
    pool = helpers.AttentionMemoryPool(2, 1, 8, 8, device="cpu")
    assert pool.q.dtype == torch.float16  # the seed's dtype
    for args, message in (
        ((3, 4), "batch_size must be 1 to 2"),
        ((1, 9), "seq_len must be 1 to 8"),
        ((0, 4), "batch_size"),
        ((1.0, 4), "batch_size must be an int"),
    ):
        with pytest.raises((ValueError, TypeError), match=message):
            pool.get_tensors(*args)
    with pytest.raises(ValueError, match="max_seq_len must be >= 1"):
        helpers.AttentionMemoryPool(1, 1, 0, 8)
    with pytest.raises(RuntimeError, match="seq_len must be 1 to 8") as info:
        cuda_llm_ops.AttentionMemoryPool(2, 1, 8, 8, device="cpu").get_tensors(1, 9)
    assert isinstance(info.value, ValueError)
