"""Cost functions of windowed and packed attention: pair counts equal the reference mask's, and the totals
agree with the dense model where they overlap."""

import pytest

from llm_speed.attention.reference import visible
from llm_speed.perf.kernel_costs import (
    attention_cost,
    varlen_attention_cost,
    window_attention_cost,
    window_visible_pairs,
)


@pytest.mark.parametrize("seq_q, seq_kv", [(7, 7), (5, 11), (11, 5), (0, 4), (4, 0)])
@pytest.mark.parametrize("window", [None, (0, 0), (1, None), (None, 2), (3, 1), (100, 100)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_pairs_equal_the_reference_mask(seq_q, seq_kv, window, is_causal):
    mask = visible(seq_q, seq_kv, is_causal=is_causal, window=window)
    assert window_visible_pairs(seq_q, seq_kv, is_causal=is_causal, window=window) == int(mask.sum())


@pytest.mark.parametrize("mode", ["fwd", "bwd", "fwd+bwd"])
def test_no_window_matches_the_dense_model(mode):
    for causal in (False, True):
        dense = attention_cost(2, 8, 300, 500, 64, heads_kv=2, dtype="bf16", causal=causal, mode=mode)
        ours = window_attention_cost(
            2, 8, 300, 500, 64, heads_kv=2, dtype="bf16", is_causal=causal, mode=mode
        )
        assert ours == dense


def test_sliding_window_flops_grow_with_the_window_not_the_sequence():
    def flops(seq):
        return window_attention_cost(1, 1, seq, seq, 64, is_causal=True, window=(127, 0)).flops

    assert flops(4096) / flops(2048) == pytest.approx(2.0, rel=0.05)  # linear, not quadratic


def test_varlen_is_the_sum_of_its_sequences():
    lengths = [0, 1, 17, 128, 129]
    packed = varlen_attention_cost(lengths, lengths[::-1], 4, 64, heads_kv=2, is_causal=True, mode="fwd+bwd")
    flops = sum(
        window_attention_cost(1, 4, sq, sk, 64, heads_kv=2, is_causal=True, mode="fwd+bwd").flops
        for sq, sk in zip(lengths, lengths[::-1], strict=True)
        if sq and sk
    )
    assert packed.flops == flops
    with pytest.raises(ValueError, match="one entry per sequence"):
        varlen_attention_cost([1, 2], [1], 4, 64)


def test_profiler_counts_windowed_and_packed_work_through_the_op_table():
    """A profile block around a windowed call counts only the visible pairs; a packed call sums its
    sequences (the op table's rows for flash_attention and flash_attention_varlen)."""
    import torch

    from llm_speed import flash_attention, flash_attention_varlen
    from llm_speed.perf.kernel_costs import varlen_attention_cost, window_attention_cost
    from llm_speed.profiler import CUDAProfiler

    profiler = CUDAProfiler("cpu")
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    with profiler.profile("window"):
        flash_attention(q, k, v, is_causal=True, window=(7, None))
    expected = window_attention_cost(1, 2, 40, 40, 16, dtype="fp32", is_causal=True, window=(7, 0))
    assert profiler.get_metrics().flops == pytest.approx(expected.flops)

    cu = torch.tensor([0, 9, 9, 30], dtype=torch.int32)
    q, k, v = (torch.randn(30, 2, 16) for _ in range(3))
    with profiler.profile("packed"):
        flash_attention_varlen(q, k, v, cu, cu, 21, 21, is_causal=True)
    expected = varlen_attention_cost([9, 0, 21], [9, 0, 21], 2, 16, dtype="fp32", is_causal=True)
    assert profiler.get_metrics().flops == pytest.approx(expected.flops)
    assert profiler.get_metrics().bytes_moved == pytest.approx(expected.bytes_moved)
