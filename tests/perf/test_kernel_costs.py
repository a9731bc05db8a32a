"""Attention and GEMM FLOP/byte counts against brute force and torch's own FLOP counter."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import flop_counter

from llm_speed.attention.configs import tier_dq_kernel, tier_for
from llm_speed.core.gpus import list_gpus
from llm_speed.core.hardware import Hardware
from llm_speed.core.policy import current_policy, use_policy
from llm_speed.perf.kernel_costs import (
    KernelCost,
    attention_cost,
    attention_hardware_flops,
    backward_dq_kernel_by_default,
    gemm_cost,
    visible_pairs,
)


def _mask_pairs(seq_q: int, seq_kv: int) -> int:
    """Brute-force count of the bottom-right causal mask (PyTorch's causal_lower_right convention)."""
    rows = torch.arange(seq_q).unsqueeze(1)
    cols = torch.arange(seq_kv).unsqueeze(0)
    return int((cols <= rows + seq_kv - seq_q).sum())


@pytest.mark.parametrize(
    ("seq_q", "seq_kv"), [(1, 1), (5, 5), (17, 17), (3, 7), (7, 3), (1, 128), (128, 1), (2, 113)]
)
def test_causal_pairs_match_the_mask(seq_q, seq_kv):
    assert visible_pairs(seq_q, seq_kv, causal=True) == _mask_pairs(seq_q, seq_kv)
    assert visible_pairs(seq_q, seq_kv, causal=False) == seq_q * seq_kv


def test_square_causal_is_about_half():
    s = 4096
    assert visible_pairs(s, s, causal=True) == s * (s + 1) // 2
    full = attention_cost(1, 8, s, s, 128).flops
    causal = attention_cost(1, 8, s, s, 128, causal=True).flops
    assert causal / full == pytest.approx((s + 1) / (2 * s))


@pytest.mark.parametrize(("seq_q", "seq_kv", "heads_kv"), [(16, 32, 4), (7, 7, 2), (1, 64, 1)])
def test_flops_match_torch_flop_counter(seq_q, seq_kv, heads_kv):
    batch, heads, dim = 2, 4, 8
    q_shape, kv_shape = (batch, heads, seq_q, dim), (batch, heads, seq_kv, dim)
    # torch counts GQA as if K/V were repeated to all query heads: FLOPs follow the query heads.
    forward = flop_counter.sdpa_flop_count(q_shape, kv_shape, kv_shape)
    backward = flop_counter.sdpa_backward_flop_count(q_shape, q_shape, kv_shape, kv_shape)
    assert attention_cost(batch, heads, seq_q, seq_kv, dim, heads_kv=heads_kv).flops == forward
    assert attention_cost(batch, heads, seq_q, seq_kv, dim, heads_kv=heads_kv, mode="bwd").flops == backward
    both = attention_cost(batch, heads, seq_q, seq_kv, dim, heads_kv=heads_kv, mode="fwd+bwd")
    assert both.flops == forward + backward


def test_naive_matmul_count_against_torch_bmm_flops():
    # torch's own per-op counter (the functions FlopCounterMode uses), applied to eager attention's matmuls.
    b_h, s_q, s_kv, d = 6, 9, 11, 8
    q, k, v, o, s = (b_h, s_q, d), (b_h, d, s_kv), (b_h, s_kv, d), (b_h, s_q, d), (b_h, s_q, s_kv)
    forward = flop_counter.bmm_flop(q, k) + flop_counter.bmm_flop(s, v)  # S = QK^T, O = PV
    assert attention_cost(1, b_h, s_q, s_kv, d, impl="naive").flops == forward
    # An eager backward that kept P runs 4 matmuls (dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q): 2x.
    backward_executed = (
        flop_counter.bmm_flop((b_h, s_kv, s_q), o)
        + flop_counter.bmm_flop(o, (b_h, d, s_kv))
        + flop_counter.bmm_flop(s, v)
        + flop_counter.bmm_flop((b_h, s_kv, s_q), q)
    )
    assert backward_executed == 2 * forward
    # The model-FLOP convention counts FlashAttention's 5 (2.5x) for every implementation.
    assert attention_cost(1, b_h, s_q, s_kv, d, mode="bwd", impl="naive").flops == 2.5 * forward


def test_bytes_by_implementation():
    b, h, hkv, sq, skv, d = 2, 8, 2, 64, 128, 32
    e = 2
    q = b * h * sq * d
    kv = b * hkv * skv * d
    rows = b * h * sq
    scores = b * h * sq * skv
    flash = attention_cost(b, h, sq, skv, d, heads_kv=hkv, dtype="bf16")
    assert flash.bytes_moved == e * (2 * q + 2 * kv) + 4 * rows
    tiled = attention_cost(b, h, sq, skv, d, heads_kv=hkv, dtype="bf16", impl="tiled")
    naive = attention_cost(b, h, sq, skv, d, heads_kv=hkv, dtype="bf16", impl="naive")
    assert tiled.bytes_moved == e * (2 * q + 3 * kv) + 4 * rows  # K read in both passes
    assert naive.bytes_moved == e * (2 * q + 2 * kv) + 4 * e * scores
    naive_fp32_scores = attention_cost(
        b, h, sq, skv, d, heads_kv=hkv, dtype="bf16", impl="naive", score_dtype="fp32"
    )
    assert naive_fp32_scores.bytes_moved == e * (2 * q + 2 * kv) + 4 * 4 * scores
    tiled_bwd = attention_cost(b, h, sq, skv, d, heads_kv=hkv, dtype="bf16", mode="bwd", impl="tiled")
    assert tiled_bwd == attention_cost(b, h, sq, skv, d, heads_kv=hkv, dtype="bf16", mode="bwd")
    flash_bwd = attention_cost(b, h, sq, skv, d, heads_kv=hkv, dtype="bf16", mode="bwd")
    assert flash_bwd.bytes_moved == e * (4 * q + 4 * kv) + 12 * rows
    naive_bwd = attention_cost(b, h, sq, skv, d, heads_kv=hkv, dtype="bf16", mode="bwd", impl="naive")
    assert naive_bwd.bytes_moved == e * (4 * q + 4 * kv) + 7 * e * scores
    # fp32 doubles the tensor traffic but not the fp32 statistics.
    flash32 = attention_cost(b, h, sq, skv, d, heads_kv=hkv, dtype=torch.float32)
    assert flash32.bytes_moved == 4 * (2 * q + 2 * kv) + 4 * rows


def test_flash_is_compute_heavier_per_byte_than_naive():
    flash = attention_cost(1, 16, 2048, 2048, 64)
    naive = attention_cost(1, 16, 2048, 2048, 64, impl="naive")
    assert flash.flops == naive.flops
    assert flash.intensity > 10 * naive.intensity


def test_gemm_cost():
    cost = gemm_cost(128, 256, 64, dtype="bf16")
    assert cost.flops == 2 * 128 * 256 * 64
    assert cost.bytes_moved == (128 * 64 + 64 * 256 + 128 * 256) * 2
    with_everything = gemm_cost(
        128, 256, 64, dtype="fp8", out_dtype="bf16", batch=3, with_c=True, with_bias=True
    )
    assert with_everything.flops == 3 * 2 * 128 * 256 * 64
    assert with_everything.bytes_moved == 3 * (128 * 64 + 64 * 256) + 3 * 128 * 256 * 2 * 2 + 256 * 2
    assert flop_counter.mm_flop((12, 5), (5, 7)) == gemm_cost(12, 7, 5).flops
    assert (KernelCost(1, 2) + KernelCost(3, 4)) == KernelCost(4, 6)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"batch": 0}, ValueError, "batch"),
        ({"seq_q": -1}, ValueError, "seq_q"),
        ({"head_dim": 2.5}, TypeError, "head_dim"),
        ({"heads_kv": 3}, ValueError, r"must divide heads_q \(8\); valid heads_kv: 1, 2, 4, 8"),
        ({"mode": "forward"}, ValueError, "mode"),
        ({"impl": "fast"}, ValueError, "impl"),
        ({"dtype": "fp12"}, ValueError, "dtype"),
        ({"score_dtype": "fp12"}, ValueError, "dtype"),
    ],
)
def test_attention_bad_inputs(kwargs, error, match):
    args = {"batch": 1, "heads_q": 8, "seq_q": 16, "seq_kv": 16, "head_dim": 64, **kwargs}
    with pytest.raises(error, match=match):
        attention_cost(**args)


def test_gemm_bad_inputs():
    with pytest.raises(ValueError, match="k"):
        gemm_cost(4, 4, 0)
    with pytest.raises(ValueError, match="dtype"):
        gemm_cost(4, 4, 4, out_dtype="fp3")


@settings(max_examples=60, deadline=None)
@given(seq_q=st.integers(1, 300), seq_kv=st.integers(1, 300))
def test_causal_pairs_property(seq_q, seq_kv):
    by_row = sum(max(0, min(seq_kv, i + seq_kv - seq_q + 1)) for i in range(seq_q))
    assert visible_pairs(seq_q, seq_kv, causal=True) == by_row <= seq_q * seq_kv


def test_hardware_flops_by_implementation():
    shape = dict(batch=2, heads_q=4, seq_q=64, seq_kv=64, head_dim=32, causal=True)
    model_fwd = attention_cost(**shape).flops
    # Flash's forward executes exactly the model count; tiled recomputes QK^T in its second forward pass
    # (1.5x); the backward with dQ by atomics runs the model's 5 matmuls (2.5x), the one with its own dQ
    # kernel 7 (3.5x forward); naive keeps P, so its backward runs 4 matmuls (2x forward).
    assert attention_hardware_flops(**shape) == model_fwd
    assert attention_hardware_flops(**shape, mode="bwd", deterministic=False) == 2.5 * model_fwd
    assert attention_hardware_flops(**shape, mode="bwd", deterministic=True) == 3.5 * model_fwd
    # By default: what the backward runs on the GPU (an H100 without one): its own dQ kernel on the 227 KB
    # tier (it counted the A100's 5 on an H100 before, HFU 29% low), atomics on an A100.
    assert attention_hardware_flops(**shape, mode="bwd") == 3.5 * model_fwd
    assert attention_hardware_flops(**shape, mode="bwd", gpu="h200") == 3.5 * model_fwd
    assert attention_hardware_flops(**shape, mode="bwd", gpu="a100-sxm-80gb") == 2.5 * model_fwd
    with use_policy(backward_dq_kernel_tiers=()):  # the atomic-dQ candidate
        assert attention_hardware_flops(**shape, mode="bwd", gpu="h100-sxm") == 2.5 * model_fwd
    assert attention_hardware_flops(**shape, impl="tiled") == 1.5 * model_fwd
    assert attention_hardware_flops(**shape, impl="tiled", mode="bwd", gpu="l4") == 2.5 * model_fwd
    assert attention_hardware_flops(**shape, impl="tiled", mode="bwd", deterministic=True) == 3.5 * model_fwd
    assert attention_hardware_flops(**shape, impl="naive", mode="bwd") == 2 * model_fwd
    assert attention_hardware_flops(**shape, impl="naive", mode="fwd+bwd") == 3 * model_fwd
    with pytest.raises(ValueError, match="impl must be one of"):
        attention_hardware_flops(**shape, impl="cudnn")
    with pytest.raises(TypeError, match="seq_q"):
        attention_hardware_flops(1, 1, 2.0, 2, 8)


def test_the_models_dq_path_is_the_launchers():
    # the torch-free model reads the tiers' floors from core; the launcher decides from attention.configs
    for changes in ({}, {"backward_dq_kernel_tiers": ()}, {"backward_tma_dq_add": True}):
        with use_policy(**changes):
            for gpu in list_gpus():
                launcher = tier_dq_kernel(tier_for(Hardware.from_spec(gpu)), current_policy())
                assert backward_dq_kernel_by_default(gpu) is launcher, (gpu.id, changes)


def test_window_pairs_are_counted_not_listed():
    """window_visible_pairs against the row-by-row count of reference.visible's rule (causal, either side
    unbounded, windows wider than the keys, more queries than keys and fewer), and at 10**12 tokens at once
    (it looped over the rows: a long windowed or packed sequence hung the model)."""
    import random
    import time

    from llm_speed.perf.kernel_costs import window_visible_pairs

    def rows(seq_q, seq_kv, causal, window):
        left, right = window if window is not None else (None, None)
        right = 0 if causal else right
        total = 0
        for i in range(seq_q):
            p = i + seq_kv - seq_q
            first = 0 if left is None else max(0, p - left)
            last = seq_kv - 1 if right is None else min(seq_kv - 1, p + right)
            total += max(0, last - first + 1)
        return total

    rng = random.Random(0)
    for _ in range(3000):
        seq_q, seq_kv = rng.randint(0, 40), rng.randint(0, 40)
        sides = [rng.choice([None, rng.randint(0, 50)]) for _ in range(2)]
        window, causal = rng.choice([None, tuple(sides)]), rng.random() < 0.4
        expected = rows(seq_q, seq_kv, causal, window)
        assert window_visible_pairs(seq_q, seq_kv, is_causal=causal, window=window) == expected
    start = time.perf_counter()
    n = 10**12
    assert window_visible_pairs(n, n, is_causal=True) == n * (n + 1) // 2
    assert window_visible_pairs(n, n, window=(128, 128)) == 257 * n - 2 * (128 * 129 // 2)
    assert time.perf_counter() - start < 0.1
