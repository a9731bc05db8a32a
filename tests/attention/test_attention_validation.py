"""Bad input: each case raises ValueError/TypeError naming the argument; each boundary just inside passes."""

import pytest
import torch
from attention_testing import assert_error_rule, make_qkv

from llm_speed import flash_attention, naive_attention, tiled_attention, validate_attention_inputs
from llm_speed.attention.reference import reference_attention

ALL_FUNCTIONS = [flash_attention, tiled_attention, naive_attention]


def _qkv(batch=1, heads_q=2, heads_kv=2, seq_q=3, seq_kv=4, dim=16, dtype=torch.float32):
    return list(make_qkv(batch, heads_q, heads_kv, seq_q, seq_kv, dim, dtype, "cpu"))


def _with(index, tensor):
    qkv = _qkv()
    qkv[index] = tensor
    return qkv


BAD_INPUTS = [
    # (id, (q, k, v), exception, words the message must contain)
    ("q-rank3", _with(0, torch.randn(2, 3, 16)), ValueError, ["q", "4 dims"]),
    ("k-rank5", _with(1, torch.randn(1, 2, 4, 16, 1)), ValueError, ["k", "4 dims"]),
    ("v-not-tensor", _with(2, [[1.0]]), TypeError, ["v", "torch.Tensor"]),
    ("q-float64", _with(0, torch.randn(1, 2, 3, 16, dtype=torch.float64)), TypeError, ["q", "float16"]),
    ("k-int32", _with(1, torch.ones(1, 2, 4, 16, dtype=torch.int32)), TypeError, ["k", "bfloat16"]),
    (
        "dtype-mismatch",
        _with(1, torch.randn(1, 2, 4, 16, dtype=torch.float16)),
        TypeError,
        ["share one dtype"],
    ),
    ("batch-mismatch", _qkv()[:1] + _qkv(batch=2)[1:], ValueError, ["batch"]),
    ("head-dim-mismatch", _qkv()[:1] + _qkv(dim=24)[1:], ValueError, ["head_dim"]),
    ("k-v-shape-mismatch", _with(2, torch.randn(1, 2, 5, 16)), ValueError, ["k and v", "same shape"]),
    ("head-dim-264", _qkv(dim=264), ValueError, ["head_dim", "256"]),
    ("head-dim-0", _qkv(dim=0), ValueError, ["head_dim"]),
    ("heads-not-divisible", _qkv(heads_q=3, heads_kv=2), ValueError, ["multiple", "heads"]),
    ("heads-kv-0", _qkv(heads_q=2, heads_kv=0), ValueError, ["heads", "at least 1"]),
    ("mixed-devices", _with(1, torch.randn(1, 2, 4, 16, device="meta")), ValueError, ["device"]),
]


@pytest.mark.parametrize("fn", [*ALL_FUNCTIONS, validate_attention_inputs], ids=lambda f: f.__name__)
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_rejected_with_a_clear_message(fn, case):
    _, (q, k, v), error, words = case
    with pytest.raises(error) as info:
        fn(q, k, v)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


@pytest.mark.parametrize("fn", ALL_FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("scale, error", [("0.5", TypeError), (True, TypeError), (float("inf"), ValueError)])
def test_bad_scale_is_rejected(fn, scale, error):
    with pytest.raises(error, match="scale"):
        fn(*_qkv(), scale=scale)


BOUNDARIES = [
    ("head-dim-8", dict(dim=8)),
    ("head-dim-256", dict(dim=256)),
    ("head-dim-40-not-power-of-two", dict(dim=40)),
    ("mqa-one-kv-head", dict(heads_q=4, heads_kv=1)),
    ("mha-equal-heads", dict(heads_q=3, heads_kv=3)),
    ("seq-1", dict(seq_q=1, seq_kv=1)),
    ("bfloat16", dict(dtype=torch.bfloat16)),
]


@pytest.mark.parametrize("case", BOUNDARIES, ids=[c[0] for c in BOUNDARIES])
def test_boundary_inputs_are_accepted(case):
    q, k, v = _qkv(**case[1])
    assert validate_attention_inputs(q, k, v) is None
    for fn in ALL_FUNCTIONS:
        out = fn(q, k, v, is_causal=True, scale=0.0 if case[0] == "seq-1" else None)
        assert out.shape == q.shape and out.dtype == q.dtype and torch.isfinite(out).all()


@pytest.mark.parametrize("scale", [0.5, 2, -1.0, 0.0], ids=["float", "int", "negative", "zero"])
def test_any_finite_real_scale_is_accepted(scale):
    q, k, v = _qkv()
    truth = reference_attention(q.double(), k.double(), v.double(), scale=float(scale))
    same = reference_attention(q, k, v, scale=float(scale))
    for fn in ALL_FUNCTIONS:
        assert_error_rule(fn.__name__, fn(q, k, v, scale=scale), same, truth, 2.0, torch.float32)
