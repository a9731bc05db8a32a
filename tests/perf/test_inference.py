"""Inference analysis: per-op costs, seed 003's prefill/decode intensities, MoE, MLA, decode batch sweep."""

import pytest

from llm_speed.core.gpus import custom_gpu, get_gpu
from llm_speed.perf.inference import (
    analyze_inference,
    decode_batch_sweep,
    expected_experts_hit,
    generalized_attention_cost,
)
from llm_speed.perf.kernel_costs import attention_cost
from llm_speed.perf.kv_cache import kv_cache_size
from llm_speed.perf.models import get_model, param_count


def _op(analysis, phase, name):
    (op,) = [op for op in analysis.ops if op.phase == phase and op.name == name]
    return op


def test_seed_003_prefill_vs_decode_intensity():
    # Seed 003: batch 1, L = 2048, d = 4096. The d x d output projection of llama-2-7b:
    a = analyze_inference("llama-2-7b", "h100-sxm", batch_size=1, seq_len=2048)
    prefill, decode = _op(a, "prefill", "o"), _op(a, "decode", "o")
    d, length = 4096, 2048
    # Exact: 2*L*d*d FLOPs over 2*(L*d + d*d + L*d) bytes = 1024;
    # counting only the weights: L = 2048 (the seed's "AI ~ seq_len").
    assert prefill.intensity == pytest.approx(length * d / (2 * length + d))
    assert prefill.flops / (prefill.count * 2 * d * d) == length
    assert decode.intensity == pytest.approx(1.0, rel=1e-3)  # a GEMV: "AI ~ 1"
    assert prefill.bound == "compute" and decode.bound == "memory"


def test_attention_rows_causal_gqa_and_kv_reads():
    a = analyze_inference("llama-3-8b", "h100-sxm", batch_size=2, seq_len=1024, decode_tokens=64)
    prefill = _op(a, "prefill", "attention")
    assert prefill.flops == 32 * 4 * 2 * 32 * 128 * (1024 * 1025 // 2)  # causal pairs, 32 query heads
    decode = _op(a, "decode", "attention")
    cache = kv_cache_size("llama-3-8b", seq_len=a.decode_context, batch_size=2).total_bytes
    assert a.decode_context == 1024 + 32
    assert cache < decode.bytes_moved < 1.01 * cache  # decode attention is the KV-cache read
    assert decode.bound == "memory"


def test_generalized_attention_matches_kernel_costs():
    for causal in (False, True):
        ours = generalized_attention_cost(2, 8, 64, 64, 128, 128, heads_kv=2, dtype="bf16", causal=causal)
        theirs = attention_cost(2, 8, 64, 64, 128, heads_kv=2, dtype="bf16", causal=causal)
        assert (ours.flops, ours.bytes_moved) == (theirs.flops, theirs.bytes_moved)
    decode = generalized_attention_cost(3, 8, 1, 100, 64, 64, heads_kv=8, dtype="fp16", causal=False)
    assert decode.flops == attention_cost(3, 8, 1, 100, 64, dtype="fp16").flops


def test_mla_decode_reads_the_latent_cache_once():
    a = analyze_inference("deepseek-v3", "h200", batch_size=4, seq_len=4096, decode_tokens=2)
    decode = _op(a, "decode", "attention")
    cache = kv_cache_size("deepseek-v3", seq_len=a.decode_context, batch_size=4).total_bytes
    # plus each head's absorbed query (576 dims) and latent output (512 dims): B*H*1088*2 bytes per layer
    assert decode.bytes_moved == pytest.approx(cache + 61 * (4 * 128 * 1088 * 2 + 4 * 4 * 128))
    # absorbed form: 128 heads score over 576 latent+rope dims and sum 512 latent dims per cached token
    assert decode.flops == 61 * 2 * 4 * 128 * a.decode_context * (576 + 512)
    assert _op(a, "decode", "latent_rmsnorm").flops == 61 * 4 * 4 * (1536 + 512)


def test_sliding_window_limits_attention():
    a = analyze_inference("mistral-7b", "h100-sxm", seq_len=16384, decode_tokens=2)
    decode = _op(a, "decode", "attention")
    assert decode.flops == 32 * 4 * 32 * 128 * 4096  # only the 4096-token window is attended


def test_expected_experts_hit():
    assert expected_experts_hit(8, 2, 1) == pytest.approx(2)
    assert expected_experts_hit(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))
    assert expected_experts_hit(256, 8, 10_000) == pytest.approx(256)


def test_moe_decode_reads_only_the_chosen_experts():
    a = analyze_inference("mixtral-8x7b", "h100-sxm", batch_size=1, seq_len=128, decode_tokens=2)
    up = _op(a, "decode", "expert_gate_up")
    expert_up_weights = 4096 * 2 * 14336 * 2  # bytes of one expert's gate+up, bf16
    assert up.bytes_moved == pytest.approx(32 * (2 * expert_up_weights + 2 * (4096 + 2 * 14336) * 2))
    names = {op.name for op in a.ops if op.phase == "decode"}
    assert {"router", "router_topk", "moe_dispatch", "expert_down", "moe_combine"} <= names


def test_totals_and_speed_bounds():
    a = analyze_inference("llama-3-8b", "h100-sxm", batch_size=4, seq_len=512, decode_tokens=100)
    prefill_ops = [op for op in a.ops if op.phase == "prefill"]
    assert a.ttft_s == pytest.approx(sum(op.time_floor_s for op in prefill_ops))
    assert a.prefill.flops == pytest.approx(sum(op.flops for op in prefill_ops))
    assert a.decode_tokens_per_s == pytest.approx(4 / a.decode_step_s)
    assert a.total_time_s == pytest.approx(a.ttft_s + 100 * a.decode_step_s)
    assert a.weights_bytes == param_count(get_model("llama-3-8b")).total * 2
    # batch-1 decode cannot beat reading the weights once per token
    single = analyze_inference("llama-3-8b", "h100-sxm", batch_size=1)
    non_embedding = (param_count(get_model("llama-3-8b")).total - 128256 * 4096) * 2
    assert single.decode_step_s > non_embedding / get_gpu("h100-sxm").memory_bandwidth
    assert single.fits_in_memory
    assert not single.exceeds_max_position and single.max_position_embeddings == 8192
    for decode_tokens, exceeds in ((96, False), (97, True)):  # llama-2: 4096 positions
        longer = analyze_inference("llama-2-7b", "h100-sxm", seq_len=4000, decode_tokens=decode_tokens)
        assert longer.exceeds_max_position is exceeds
    assert not analyze_inference("llama-3.1-405b", "h100-sxm").fits_in_memory


def test_fits_is_judged_against_the_memory_the_device_reports():
    # Llama-3-8B, 58 x 8k tokens of bf16 KV cache: 80.3e9 bytes, over the H100's datasheet "80 GB" (80e9)
    # but within the 85.02e9 bytes an H100 SXM reports (its 80 GiB of HBM3); it was "fits: no" before.
    h100 = get_gpu("h100-sxm")
    assert h100.usable_memory_bytes == 85_017_493_504 and h100.memory_capacity_bytes == 80e9
    analysis = analyze_inference("llama-3-8b", "h100-sxm", batch_size=58, seq_len=8192)
    assert 80e9 < analysis.memory_per_gpu_bytes < 85e9
    assert analysis.fits_in_memory and analysis.gpu_memory_bytes == h100.usable_memory_bytes
    assert not analyze_inference("llama-3-8b", "h100-sxm", batch_size=64, seq_len=8192).fits_in_memory
    # A user spec that changes the capacity drops the base's measurement; one that does not keeps it.
    capped = custom_gpu({"based_on": "h100-sxm", "hbm_capacity_gb": 80})
    assert capped.device_memory_bytes is None and capped.usable_memory_bytes == 80e9
    assert not analyze_inference("llama-3-8b", capped, batch_size=58, seq_len=8192).fits_in_memory
    assert custom_gpu({"based_on": "h100-sxm", "sm_count": 100}).usable_memory_bytes == 85_017_493_504
    with pytest.raises(ValueError, match="device_memory_bytes must be a number > 0"):
        custom_gpu({"based_on": "h100-sxm", "device_memory_bytes": -1})


def test_fp8_kv_cache_halves_decode_attention_bytes():
    bf16 = _op(analyze_inference("llama-3-8b", "h100-sxm", seq_len=8192), "decode", "attention")
    fp8 = _op(
        analyze_inference("llama-3-8b", "h100-sxm", seq_len=8192, kv_dtype="fp8"), "decode", "attention"
    )
    assert fp8.bytes_moved == pytest.approx(bf16.bytes_moved / 2, rel=0.01)


def test_decode_batch_sweep_moves_gemms_to_compute_bound():
    rows = decode_batch_sweep("llama-3-8b", "h100-sxm", seq_len=1024, batch_sizes=(1, 4, 64, 512))
    assert [row.batch_size for row in rows] == [1, 4, 64, 512]
    assert rows[0].gemm_intensity == pytest.approx(1, rel=0.01)
    assert rows[1].gemm_intensity == pytest.approx(4, rel=0.02)
    ridge = get_gpu("h100-sxm").ridge_point("bf16")
    assert rows[2].gemm_intensity < ridge < rows[3].gemm_intensity
    speeds = [row.tokens_per_s for row in rows]
    assert speeds == sorted(speeds)
    assert rows[0].fits_in_memory


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(model="llama-3-8b", gpu="h100-sxm", batch_size=0), "batch_size"),
        (dict(model="llama-3-8b", gpu="tpu-v5"), "h100"),
        (dict(model="nope", gpu="h100-sxm"), "valid ids"),
        (dict(model="llama-3-8b", gpu="h100-sxm", dtype="int4"), "accepted dtypes"),
        (dict(model="llama-3-8b", gpu="h100-sxm", decode_tokens=0), "decode_tokens"),
    ],
)
def test_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        analyze_inference(kwargs.pop("model"), kwargs.pop("gpu"), **kwargs)
    with pytest.raises(ValueError, match="batch_sizes"):
        decode_batch_sweep("llama-3-8b", "h100-sxm", batch_sizes=())


def test_sliding_window_prefill_reads_every_key_once():
    window = generalized_attention_cost(
        1, 4, 100, 100, 8, 8, heads_kv=4, dtype="bf16", causal=True, sliding_window=10
    )
    full = generalized_attention_cost(1, 4, 100, 100, 8, 8, heads_kv=4, dtype="bf16", causal=True)
    assert window.bytes_moved == full.bytes_moved  # every key is inside some query's window
    assert window.flops == 2 * 4 * (55 + 90 * 10) * 16
    with pytest.raises(ValueError, match="seq_q == seq_kv"):
        generalized_attention_cost(1, 4, 10, 100, 8, 8, heads_kv=4, causal=True, sliding_window=10)
