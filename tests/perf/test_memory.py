"""Seed 000's and seed 002's memory numbers under their own assumptions, and the precise attention model."""

from fractions import Fraction

import numpy as np
import pytest
import torch

import llm_speed
from llm_speed.perf.memory import (
    MEMORY_BANDWIDTH,
    analyze_memory_hierarchy,
    attention_memory,
    calculate_attention_vram,
    calculate_flash_attention_vram,
    estimate_attention_memory,
    find_optimal_batch_size,
)


def test_exported_from_the_package():
    for name in (
        "analyze_memory_hierarchy",
        "calculate_attention_vram",
        "calculate_flash_attention_vram",
        "estimate_attention_memory",
        "find_optimal_batch_size",
    ):
        assert callable(getattr(llm_speed, name))


def test_memory_hierarchy_reports_a_streaming_time_not_a_latency():
    mem = analyze_memory_hierarchy()
    assert set(mem) == set(MEMORY_BANDWIDTH) == {"shared_memory", "l2_cache", "hbm"}
    assert mem["shared_memory"]["bandwidth_tb_s"] == pytest.approx(19.0)
    assert mem["hbm"]["bandwidth_tb_s"] == pytest.approx(1.555)
    # L2 sits between shared memory and HBM (the old table gave it the HBM figure).
    assert (
        mem["hbm"]["bandwidth_tb_s"]
        < mem["l2_cache"]["bandwidth_tb_s"]
        < mem["shared_memory"]["bandwidth_tb_s"]
    )
    assert all("latency_ns" not in level for level in mem.values())
    assert mem["shared_memory"]["stream_1kb_ns"] == pytest.approx(1024 / 19e12 * 1e9)


def test_attention_vram_counts_a_score_matrix_per_head():
    # 128K tokens, 32 heads, head_dim 128, fp16: 32 matrices of 131072^2 elements.
    std = calculate_attention_vram(128 * 1024, 32, 128)
    assert std["attention_matrix"] == pytest.approx(32 * 131072**2 * 2 / 1e9)
    assert std["qkv"] == pytest.approx(3 * 131072 * 32 * 128 * 2 / 1e9)
    assert std["total"] == pytest.approx(std["qkv"] + std["attention_matrix"] + std["output"])
    flash = calculate_flash_attention_vram(128 * 1024, 32, 128)
    assert flash["online_softmax"] == pytest.approx(131072 * 32 * 8 / 1e9)
    assert f"{flash['total']:10.2f}" == "      4.33"
    assert (
        calculate_attention_vram(512, 32, 128)["total"]
        > calculate_flash_attention_vram(512, 32, 128)["total"]
    )


def test_estimate_attention_memory_counts_each_dtype_s_size():
    # (2, 16, 8192, 64) fp16: tensor = 33,554,432 B; (3 + 1 + 0.1) * tensor / 2^20 = 131.2 MiB.
    assert estimate_attention_memory(2, 16, 8192, 64) == pytest.approx(131.2)
    assert estimate_attention_memory(2, 16, 8192, 64, dtype=torch.float16) == pytest.approx(131.2)
    assert estimate_attention_memory(2, 16, 8192, 64, dtype=torch.float32) == pytest.approx(262.4)
    assert estimate_attention_memory(2, 16, 8192, 64, dtype="bf16") == pytest.approx(131.2)
    assert estimate_attention_memory(2, 16, 8192, 64, dtype=torch.bfloat16) == pytest.approx(131.2)


def test_seed_002_find_optimal_batch_size_follows_its_formula():
    # per sample 4*16*2048*64*2 = 16 MiB; 24 GiB / 16 MiB / 1.2 = 1280 -> 1024 (the guide says "e.g. 8").
    assert find_optimal_batch_size(16, 2048, 64, max_memory_gb=24) == 1024
    assert find_optimal_batch_size(16, 2048, 64) == 512  # 16 GiB: 853 -> 512
    assert find_optimal_batch_size(64, 131072, 128, max_memory_gb=1) == 1  # nothing fits: at least 1


def test_precise_model_matches_the_quick_formulas_where_assumptions_agree():
    # One sequence: the quick formula's score matrices are exact; it has no P/S split though.
    s, d = 1024, 64
    seed = calculate_attention_vram(s, 4, d)
    precise = attention_memory(1, 4, s, s, d, dtype="fp16", impl="standard")
    assert precise.scores_bytes == pytest.approx(seed["attention_matrix"] * 1e9)
    assert precise.q_bytes + precise.k_bytes + precise.v_bytes == pytest.approx(seed["qkv"] * 1e9)
    # Peak: S and P alive together while softmax runs.
    assert precise.peak_bytes == pytest.approx((seed["qkv"] + 2 * seed["attention_matrix"]) * 1e9)
    flash_seed = calculate_flash_attention_vram(s, 8, d)
    flash = attention_memory(1, 8, s, s, d, dtype="fp16")
    # One fp32 LSE per row instead of the seed's running max and sum: half the seed's softmax figure.
    assert flash.softmax_stats_bytes == pytest.approx(flash_seed["online_softmax"] * 1e9 / 2)
    assert flash.peak_bytes == pytest.approx((flash_seed["total"] - flash_seed["online_softmax"] / 2) * 1e9)


def test_precise_model_heads_batch_and_gqa():
    b, h, hkv, s, d = 2, 32, 8, 4096, 128
    mem = attention_memory(b, h, s, s, d, heads_kv=hkv, dtype="bf16", impl="standard")
    assert mem.scores_bytes == b * h * s * s * 2  # one matrix per head and sequence, unlike the seed
    assert mem.k_bytes == b * hkv * s * d * 2
    assert mem.peak_bytes == sum(mem.items.values())
    # Eager GQA repeats K and V to all 32 query heads before the matmuls.
    assert set(mem.items) == {"q", "k", "v", "k_repeated", "v_repeated", "scores", "probs"}
    assert mem.items["k_repeated"] == b * h * s * d * 2
    assert mem.kv_repeated_bytes == 2 * b * h * s * d * 2
    flash = attention_memory(b, h, s, s, d, heads_kv=hkv, dtype="bf16")
    assert "k_repeated" not in flash.items and flash.k_bytes == mem.k_bytes
    assert mem.saved_for_backward_bytes is None and mem.backward_peak_bytes is None


def test_standard_peak_switches_to_output_when_scores_are_small():
    # seq_kv = 1 and head_dim = 256: P is smaller than O, so P + O beats S + P.
    mem = attention_memory(1, 4, 64, 1, 256, impl="standard", dtype="fp16")
    assert set(mem.items) == {"q", "k", "v", "probs", "output"}


def test_training_adds_saved_tensors_and_backward_peak():
    b, h, s, d = 1, 16, 2048, 64
    e = 2
    qkv = b * h * s * d * e
    score = b * h * s * s * e
    std = attention_memory(b, h, s, s, d, dtype="fp16", impl="standard", training=True)
    assert std.saved_for_backward_bytes == 3 * qkv + score
    # Q, K, V, O, dO, dV alive throughout; P, dP and dS together while softmax's backward runs.
    assert std.backward_peak_bytes == 6 * qkv + 3 * score
    assert set(std.items) == {
        "q",
        "k",
        "v",
        "output",
        "grad_output",
        "grad_v",
        "probs",
        "grad_probs",
        "grad_scores",
    }
    assert std.peak_bytes == std.backward_peak_bytes > std.forward_peak_bytes
    flash = attention_memory(b, h, s, s, d, dtype="fp16", training=True)
    stats = b * h * s * 4
    assert flash.saved_for_backward_bytes == 4 * qkv + stats
    # dO, the fp32 dQ accumulator, delta and the base-2 LSE, dQ, dK, dV
    assert flash.backward_peak_bytes == 4 * qkv + stats + qkv + b * h * s * d * 4 + 2 * stats + 3 * qkv
    assert flash.peak_bytes < std.peak_bytes / 10


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: calculate_attention_vram(-1, 32, 128), ValueError, "seq_len"),
        (lambda: calculate_flash_attention_vram(512, 0, 128), ValueError, "num_heads"),
        (lambda: calculate_attention_vram(512, 32, 128, dtype_bytes=0), ValueError, "dtype_bytes"),
        (lambda: estimate_attention_memory(2, 16, 8192, 64, dtype="fp5"), ValueError, "dtype"),
        (lambda: find_optimal_batch_size(16, 2048, 64, max_memory_gb=-1), ValueError, "max_memory_gb"),
        # inf: inf GB returned (vram), OverflowError (batch size); NaN was refused, inf was not
        (lambda: calculate_attention_vram(1024, 8, 64, dtype_bytes=float("inf")), ValueError,
         "dtype_bytes must be finite, got inf"),
        (lambda: calculate_flash_attention_vram(1024, 8, 64, dtype_bytes=float("inf")), ValueError,
         "dtype_bytes must be finite"),
        (lambda: calculate_attention_vram(1024, 8, 64, dtype_bytes=float("nan")), ValueError,
         "dtype_bytes must be finite"),
        (lambda: calculate_attention_vram(1024, 8, 64, dtype_bytes="2"), TypeError,
         "dtype_bytes must be a real number, got str"),
        (lambda: find_optimal_batch_size(16, 2048, 64, max_memory_gb=float("inf")), ValueError,
         "max_memory_gb must be finite, got inf"),
        (lambda: find_optimal_batch_size(16, 2048, 64, max_memory_gb=0), ValueError,
         "max_memory_gb must be > 0"),
        (lambda: find_optimal_batch_size(16, 2048, 64, max_memory_gb=True), TypeError,
         "max_memory_gb must be a real number, got bool"),
        (lambda: attention_memory(1, 8, 16, 16, 64, heads_kv=3), ValueError, "heads_kv"),
        (lambda: attention_memory(1, 8, 16, 16, 64, impl="naive"), ValueError, "impl"),
        (lambda: attention_memory(1, 8, 16, 16.0, 64), TypeError, "seq_kv"),
    ],
)
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_numpy_scalars_and_huge_finite_sizes():
    # np.float32(24) was refused as "must be a number > 0"; 1e300 GiB raised OverflowError
    assert find_optimal_batch_size(16, 2048, 64, max_memory_gb=np.float32(24)) == 1024
    assert find_optimal_batch_size(16, 2048, 64, max_memory_gb=np.int64(24)) == 1024
    huge = find_optimal_batch_size(16, 2048, 64, max_memory_gb=1e300)
    fits = Fraction(1e300) * 1024**3 / (4 * 16 * 2048 * 64 * 2) / Fraction(1.2)  # samples that fit
    assert huge.bit_count() == 1 and huge <= fits < 2 * huge
    assert calculate_attention_vram(1024, 8, 64, dtype_bytes=np.float32(2)) == calculate_attention_vram(
        1024, 8, 64, dtype_bytes=2
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("impl", ["standard", "flash"])
def test_forward_peak_matches_the_cuda_allocator(impl):
    """What the caching allocator holds above Q, K, V at the forward's peak, against the model's items."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, s, d = 1, 8, 2048, 64
    q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.float16) for _ in range(3))

    def run():
        if impl == "standard":  # scale folded into q beforehand, as the model assumes
            return torch.softmax(q @ k.transpose(-1, -2), dim=-1) @ v
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    run()  # warm-up: cuBLAS workspaces and other one-time buffers are allocated outside the measurement
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - before
    model = attention_memory(b, h, s, s, d, dtype="fp16", impl=impl)
    predicted = model.peak_bytes - model.q_bytes - model.k_bytes - model.v_bytes
    assert out.shape == (b, h, s, d)
    assert measured == pytest.approx(predicted, rel=0.02, abs=256 * 1024)
