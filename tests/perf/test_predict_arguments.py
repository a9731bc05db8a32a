"""llm_speed.perf.predict's problem arguments: a malformed override (tile, config, window, launch_order, a
size or a dtype) is refused before any work with a TypeError or ValueError naming its key and what is
accepted; the accepted spellings (one int for one packed sequence, NumPy numbers) give plain values back."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from llm_speed.perf.predict import predict

GPU = "h100-sxm"
GEMM = dict(m=64, n=64, k=64)
ATTENTION = dict(batch=1, heads_q=8, seq_q=1024, head_dim=64)
DECODE = dict(batch=1, heads_q=8, seq_kv=16, head_dim=64)


@pytest.mark.parametrize(
    "op, key, value, error",
    [
        ("gemm", "tile", (128, 128), ValueError),
        ("gemm", "tile", (0, 0, 0, 0), ValueError),
        ("gemm", "tile", (-128, 128, 64, 4), ValueError),
        ("gemm", "tile", (128.9, 128, 64, 8), TypeError),  # never truncated
        ("gemm", "tile", "abc", TypeError),
        ("gemm", "tile", 128, TypeError),
        ("gemm_fp8", "tile", (128,), ValueError),
        ("flash_attention", "config", (64, 64), ValueError),
        ("flash_attention", "config", (0, 0, 0, 0), ValueError),
        ("flash_attention", "config", (-64, 64, 4, 2), ValueError),
        ("flash_attention", "config", "abc", TypeError),
        ("flash_attention_backward", "backward_config", (64, 64), ValueError),
        ("flash_attention_backward", "backward_config", (0, 0, 0, 0), ValueError),
    ],
)
def test_a_malformed_tile_or_config_names_itself(op, key, value, error):
    problem = GEMM if op.startswith("gemm") else ATTENTION
    what = "BM, BN, BK[, warps]" if key == "tile" else "BM, BN, warps[, stages]"
    with pytest.raises(error, match=re.escape(f"{key} must be 3 or 4 positive ints ({what}), got")):
        predict(op, GPU, context="graph", **problem, **{key: value})


def test_a_well_formed_tile_is_used_as_given():
    p = predict("gemm", GPU, m=4096, n=4096, k=4096, tile=[np.int64(128), 256, 64, 8])
    assert p.breakdown.tile == (128, 256, 64, 8) and p.problem["tile"] == [128, 256, 64, 8]


@pytest.mark.parametrize(
    "value, error",
    [(float("nan"), ValueError), (float("inf"), ValueError), (-1.0, ValueError), (True, TypeError),
     ("abc", TypeError)],
)  # fmt: skip
def test_all_reduce_size_bytes_is_a_finite_number(value, error):
    with pytest.raises(error, match="size_bytes must be a"):
        predict("all_reduce", GPU, implementation="ring", size_bytes=value, num_gpus=8)


def test_numpy_sizes_give_plain_json():
    p = predict("gemm", GPU, m=np.int64(4096), n=np.int32(4096), k=4096, scale_bytes=np.float32(2.0),
                weight_dtype="int4", group_size=np.int64(128), with_bias=np.bool_(True))  # fmt: skip
    assert type(p.problem["m"]) is int and type(p.problem["scale_bytes"]) is float
    assert p.problem["with_bias"] is True
    json.dumps(p.to_dict(), allow_nan=False)
    varlen = predict("flash_attention_varlen", GPU, lengths_q=np.array([100, 200]), heads_q=8, head_dim=64)
    assert varlen.problem["lengths_q"] == [100, 200] and type(varlen.problem["lengths_q"][0]) is int
    json.dumps(varlen.to_dict(), allow_nan=False)


@pytest.mark.parametrize(
    "window, error, message",
    [
        ((-5, -5), ValueError, "window left must be >= 0 or None"),
        ((1.5, 0), TypeError, "window left must be an int >= 0 or None"),
        ((0, "a"), TypeError, "window right must be an int >= 0 or None"),
        (5, TypeError, r"window must be None or a pair \(left, right\)"),
        ((), TypeError, "window must be None or a pair"),
        ((1, 2, 3), TypeError, "window must be None or a pair"),
    ],
)
def test_window_is_checked_as_the_kernels_check_it(window, error, message):
    with pytest.raises(error, match=message):
        predict("flash_attention", GPU, window=window, **ATTENTION)


def test_a_window_open_on_one_side():
    left = predict("flash_attention", GPU, window=(128, None), causal=True, **ATTENTION)
    listed = predict("flash_attention", GPU, window=[128, None], causal=True, **ATTENTION)
    assert left.seconds == listed.seconds
    full = predict("flash_attention", GPU, causal=True, **ATTENTION)
    assert left.breakdown.flops < full.breakdown.flops


@pytest.mark.parametrize("order", ["fifo", "LPT", 3])
def test_launch_order_is_lpt_or_row(order):
    with pytest.raises(ValueError, match=f"launch_order is {order!r}; accepted: 'lpt', 'row'"):
        predict("flash_attention", GPU, launch_order=order, causal=True, **ATTENTION)


@pytest.mark.parametrize("op", ["apply_rotary", "apply_rotary_qk", "apply_rotary_qk_backward"])
@pytest.mark.parametrize("rotary_dim", [256, 10**12, 33])
def test_rotary_dim_is_an_even_number_up_to_head_dim(op, rotary_dim):
    heads = dict(heads=32) if op == "apply_rotary" else dict(heads_q=32, heads_kv=8)
    with pytest.raises(ValueError, match=r"rotary_dim must be an even number from 2 to head_dim \(64\)"):
        predict(op, GPU, batch=1, seq=4096, head_dim=64, rotary_dim=rotary_dim, **heads)
    assert predict(op, GPU, batch=1, seq=4096, head_dim=64, rotary_dim=32, **heads).seconds > 0


def test_rotary_qk_heads_kv_divides_heads_q():
    with pytest.raises(ValueError, match=r"heads_kv \(32\) must divide heads_q \(8\)"):
        predict("apply_rotary_qk", GPU, batch=1, heads_q=8, heads_kv=32, seq=4096, head_dim=64)


@pytest.mark.parametrize(
    "op, problem, error, message",
    [
        ("gemm", dict(GEMM, build=5), TypeError, "build must be a string"),
        ("gemm", dict(GEMM, out_dtype="fp7"), ValueError, "out_dtype: dtype 'fp7' is not understood"),
        ("gemm", dict(GEMM, weight_dtype="int3"), ValueError, "weight_dtype: dtype 'int3' is not understood"),
        ("gemm", dict(GEMM, weight_dtype="int4", scale_bytes="x"), TypeError, "scale_bytes must be a number"),
        ("gemm", dict(GEMM, weight_dtype="int4", group_size=32, scale_bytes=-2.0), ValueError,
         "scale_bytes must be a finite number >= 0"),
        ("attention_kvcache_fwd", dict(DECODE, kv_dtype="fp7"), ValueError,
         "kv_dtype: dtype 'fp7' is not understood"),
        ("attention_kvcache_fwd", dict(DECODE, seq_new=17), ValueError,
         r"seq_new \(17\) cannot exceed seq_kv \(16\)"),
        ("flash_attention_varlen", dict(lengths_q="4096", heads_q=8, head_dim=64), TypeError,
         "lengths_q must be a list of sequence lengths"),
        ("flash_attention_varlen", dict(lengths_q=[], heads_q=8, head_dim=64), ValueError,
         "lengths_q must hold at least one"),
    ],
)  # fmt: skip
def test_refusals_name_the_argument(op, problem, error, message):
    with pytest.raises(error, match=message):
        predict(op, GPU, **problem)


def test_one_int_is_one_packed_sequence():
    one = predict("flash_attention_varlen", GPU, lengths_q=4096, heads_q=8, head_dim=64)
    listed = predict("flash_attention_varlen", GPU, lengths_q=[4096], heads_q=8, head_dim=64)
    assert one.seconds == listed.seconds
    keys = predict("flash_attention_varlen", GPU, lengths_q=[512], lengths_k=4096, heads_q=8, head_dim=64)
    assert keys.breakdown.flops == pytest.approx(one.breakdown.flops / 8)
