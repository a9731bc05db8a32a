"""kvcache_decode_cost: the bytes of a decode step are the visible cache, Q/O/LSE and the append."""

import pytest

from llm_speed.perf.kernel_costs import attention_cost, kvcache_decode_cost


def test_decode_bytes_and_flops_by_hand():
    # Llama-3-8B-like decode: 32 query heads, 8 KV heads, head_dim 128, fp16, 4 sequences of 4096 tokens.
    cost = kvcache_decode_cost(4, 32, 1, 4096, 128, heads_kv=8, dtype="fp16", seq_new=1)
    cache = 2 * 2 * 4 * 8 * 4096 * 128
    q_out_lse = 2 * 2 * 4 * 32 * 128 + 4 * 4 * 32
    append = 4 * 2 * 4 * 8 * 128
    assert cost.bytes_moved == cache + q_out_lse + append
    assert cost.flops == 4 * 4 * 32 * 128 * 4096
    assert cost.intensity == pytest.approx(32 / 8, rel=0.01)  # heads_q / heads_kv FLOP per byte


def test_decode_flops_match_attention_cost_and_causal_counts_visible_pairs():
    for causal in (False, True):
        decode = kvcache_decode_cost(2, 8, 5, 300, 64, heads_kv=2, causal=causal)
        dense = attention_cost(2, 8, 5, 300, 64, heads_kv=2, causal=causal)
        assert decode.flops == dense.flops


@pytest.mark.parametrize(
    "kwargs, error",
    [({"seq_new": 301}, ValueError), ({"seq_new": -1}, ValueError), ({"heads_kv": 3}, ValueError),
     ({"seq_new": 1.0}, TypeError)],
)  # fmt: skip
def test_decode_cost_refuses_bad_arguments(kwargs, error):
    with pytest.raises(error):
        kvcache_decode_cost(2, 8, 1, 300, 64, **kwargs)


def test_fp8_cache_bytes_by_hand_and_prediction():
    """An fp8 cache is read at 1 byte per element and written at 1 by the append (the new K/V read at q's
    2); the model's decode prediction counts the same bytes, labelled uncalibrated."""
    from llm_speed.perf.predict import predict

    cost = kvcache_decode_cost(4, 32, 1, 4096, 128, heads_kv=8, dtype="bf16", seq_new=1, kv_dtype="fp8")
    cache = 2 * 1 * 4 * 8 * 4096 * 128
    q_out_lse = 2 * 2 * 4 * 32 * 128 + 4 * 4 * 32
    append = 2 * (2 + 1) * 4 * 8 * 128
    assert cost.bytes_moved == cache + q_out_lse + append
    assert cost.flops == kvcache_decode_cost(4, 32, 1, 4096, 128, heads_kv=8, dtype="bf16").flops
    same = kvcache_decode_cost(4, 32, 1, 4096, 128, heads_kv=8, dtype="bf16", seq_new=1, kv_dtype="bf16")
    assert same == kvcache_decode_cost(4, 32, 1, 4096, 128, heads_kv=8, dtype="bf16", seq_new=1)
    problem = dict(batch=64, heads_q=32, heads_kv=8, seq_q=1, seq_kv=4096, head_dim=128, dtype="bf16")
    bf16 = predict("attention_kvcache_fwd", "h100-sxm", **problem)
    fp8 = predict("attention_kvcache_fwd", "h100-sxm", **problem, kv_dtype="float8_e4m3fn")
    expected = kvcache_decode_cost(64, 32, 1, 4096, 128, heads_kv=8, dtype="bf16", kv_dtype="fp8")
    assert fp8.breakdown.bytes_moved == expected.bytes_moved
    assert bf16.seconds / fp8.seconds > 1.7  # about half the bytes of a memory-bound step
    assert not fp8.calibrated and "UNCALIBRATED" in fp8.source
