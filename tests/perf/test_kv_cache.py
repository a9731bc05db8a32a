"""KV-cache sizes against independently computed numbers (MHA, GQA, MQA, MLA, sliding window, dtypes)."""

import dataclasses

import pytest

from llm_speed.perf.kv_cache import kv_cache_size, max_batch_for_memory
from llm_speed.perf.models import get_model


def test_llama2_7b_mha():
    # 2 (K and V) * 32 heads * 128 dims * 2 bytes = 16 KiB per layer; 32 layers: 512 KiB per token.
    size = kv_cache_size("llama-2-7b", seq_len=4096, batch_size=1)
    assert size.bytes_per_token_per_layer == 16384
    assert size.bytes_per_token == 524_288
    assert size.total_bytes == 2 * 1024**3  # 4096 tokens: exactly 2 GiB


def test_llama3_8b_gqa_is_a_quarter():
    size = kv_cache_size("llama-3-8b", seq_len=8192, batch_size=4)
    assert size.bytes_per_token == 2 * 8 * 128 * 2 * 32 == 131_072
    assert size.total_bytes == 131_072 * 8192 * 4


def test_deepseek_v3_mla():
    # DeepSeek-V2 paper, Table 1: (d_c + d_h^R) * l elements per token = (512 + 64) * 61.
    size = kv_cache_size("deepseek-v3", seq_len=1, dtype="bf16")
    assert size.elements_per_token_per_layer == 576
    assert size.bytes_per_token == 576 * 61 * 2 == 70_272
    mha_equivalent = 2 * 128 * 128 * 61 * 2  # the same model caching full 128-dim K and V per head
    assert mha_equivalent / size.bytes_per_token == pytest.approx(56.9, abs=0.1)


def test_seed_003_mha_mqa_gqa_savings():
    # Seed 003: MQA shrinks the cache to 1/n_heads, GQA to g/n_heads; LLaMA-2 70B: 64 heads, g = 8.
    gqa = get_model("llama-2-70b")
    mha = dataclasses.replace(gqa, num_kv_heads=64)
    mqa = dataclasses.replace(gqa, num_kv_heads=1)
    sizes = {
        c.attention_type: kv_cache_size(c, seq_len=4096, batch_size=2).total_bytes for c in (gqa, mha, mqa)
    }
    assert sizes["MHA"] / sizes["GQA"] == 8
    assert sizes["MHA"] / sizes["MQA"] == 64
    # The seed's formula per layer: 2 * n_heads * d_k * seq_len * batch_size elements.
    assert sizes["MHA"] == 2 * 64 * 128 * 4096 * 2 * 80 * 2


@pytest.mark.parametrize(
    "dtype,factor", [("fp32", 2.0), ("fp16", 1.0), ("fp8", 0.5), ("int8", 0.5), ("int4", 0.25)]
)
def test_dtypes(dtype, factor):
    bf16 = kv_cache_size("llama-3-8b", seq_len=1000, dtype="bf16").total_bytes
    assert kv_cache_size("llama-3-8b", seq_len=1000, dtype=dtype).total_bytes == bf16 * factor


def test_sliding_window_caps_the_cache():
    short = kv_cache_size("mistral-7b", seq_len=1000)
    long = kv_cache_size("mistral-7b", seq_len=32768)
    assert short.cached_tokens == 1000
    assert long.cached_tokens == 4096
    assert long.total_bytes == 4096 * 131_072


def test_max_batch_for_memory():
    per_sequence = kv_cache_size("llama-2-7b", seq_len=4096).bytes_per_sequence
    assert max_batch_for_memory("llama-2-7b", seq_len=4096, free_bytes=10 * per_sequence + 1) == 10
    assert max_batch_for_memory("llama-2-7b", seq_len=4096, free_bytes=per_sequence - 1) == 0
    with pytest.raises(ValueError, match="free_bytes"):
        max_batch_for_memory("llama-2-7b", seq_len=4096, free_bytes=-1)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(seq_len=0), ValueError, "seq_len must be a positive int"),
        (dict(seq_len=10, batch_size=0), ValueError, "batch_size"),
        (dict(seq_len=10, dtype="fp7"), ValueError, "accepted"),
        (dict(seq_len=1.5), TypeError, "seq_len must be an int"),
        (dict(seq_len=True), TypeError, "seq_len must be an int"),
    ],
)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        kv_cache_size("llama-3-8b", **kwargs)


def test_unknown_model():
    with pytest.raises(ValueError, match="valid ids"):
        kv_cache_size("nope", seq_len=10)


def test_quantization_scales():
    # llama-3-8b: 2 * 8 * 128 = 2048 elements per token and layer. int4 with one fp16 scale per 32 elements:
    # 1024 bytes of values + 64 scales * 2 bytes = 1152 bytes (12.5% over the bare int4 figure).
    bare = kv_cache_size("llama-3-8b", seq_len=1024, dtype="int4")
    grouped = kv_cache_size("llama-3-8b", seq_len=1024, dtype="int4", quant_group_size=32)
    assert bare.scale_bytes_per_token_per_layer == 0 and bare.bytes_per_token_per_layer == 1024
    assert grouped.scale_bytes_per_token_per_layer == 128
    assert grouped.bytes_per_token_per_layer == 1152
    assert grouped.total_bytes == 1152 * 32 * 1024
    # Asymmetric int8 with a scale and a zero point per token and head (group = head_dim = 128).
    int8 = kv_cache_size("llama-3-8b", seq_len=8, dtype="int8", quant_group_size=128, scale_bytes=4)
    assert int8.bytes_per_token_per_layer == 2048 + 16 * 4
    # MLA: 576 latent elements do not divide into groups of 128; the last partial group has its own scale.
    mla = kv_cache_size("deepseek-v3", seq_len=8, dtype="fp8", quant_group_size=128)
    assert mla.scale_bytes_per_token_per_layer == 5 * 2
    with pytest.raises(ValueError, match="quant_group_size"):
        kv_cache_size("llama-3-8b", seq_len=8, dtype="int4", quant_group_size=0)
    with pytest.raises(ValueError, match="scale_bytes"):
        kv_cache_size("llama-3-8b", seq_len=8, dtype="int4", quant_group_size=32, scale_bytes=-1)
