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
