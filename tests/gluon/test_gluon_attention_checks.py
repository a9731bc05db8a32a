"""``llm_speed.gluon.attention.forward`` off a GPU: bad arguments refused by name before any work, any
device but a compute capability 9.0 GPU refused, and under a simulated H100 the launch it makes (what the
kernel report compiles), whose tile, ring and grid the schedule model reads."""

from __future__ import annotations

import pytest
import torch

from llm_speed.core import runtime
from llm_speed.core.hardware import Hardware
from llm_speed.core.launch import simulated_gpu
from llm_speed.gluon import attention, attention_schedule
from llm_speed.gluon import launch as gluon_launch
from llm_speed.kernel_report.capture import stand_in

BF16 = torch.bfloat16


def _qkv(heads=4, heads_kv=2, seq_q=100, seq_kv=90, d=64, dtype=BF16):
    return (torch.randn(2, heads, seq_q, d).to(dtype), torch.randn(2, heads_kv, seq_kv, d).to(dtype),
            torch.randn(2, heads_kv, seq_kv, d).to(dtype))  # fmt: skip


def _swap(index, value):
    def make():
        q, k, v = _qkv()
        return tuple(value(x) if i == index else x for i, x in enumerate((q, k, v)))

    return make


BAD = [
    ("float32 q", _swap(0, lambda x: x.float()), {}, TypeError, "q has dtype torch.float32"),
    ("dtypes differ", _swap(1, lambda x: x.half()), {}, TypeError, "k has dtype torch.float16"),
    ("3-D v", _swap(2, lambda x: x[0]), {}, ValueError, r"v must have 4 dims \[B, H, S, D\]"),
    ("strided k", _swap(1, lambda x: x.transpose(1, 2)), {}, ValueError, "k must be contiguous"),
    ("heads", lambda: _qkv(heads=3, heads_kv=2), {}, ValueError, "q's 3 heads must be a multiple of k's 2"),
    ("head dim", lambda: _qkv(d=96), {}, ValueError, "head dim 96 is not supported; accepted: 64, 128, 256"),
    ("k/v differ", _swap(2, lambda x: x[:, :, :10].contiguous()), {}, ValueError, "k and v must both be"),
    ("causal flag", _qkv, {"is_causal": 1}, TypeError, "is_causal must be a bool"),
    ("scale", _qkv, {"scale": float("nan")}, ValueError, "scale must be a finite number"),
]


@pytest.mark.parametrize(("case", "make", "options", "error", "message"), BAD, ids=[c[0] for c in BAD])
def test_bad_arguments_are_refused_by_name(case, make, options, error, message):
    with simulated_gpu(), pytest.raises(error, match=message):
        attention.forward(*make(), **options)


def test_only_a_compute_capability_9_gpu_runs_it():
    with pytest.raises(ValueError, match="q is on cpu: llm_speed.gluon.attention runs on CUDA devices"):
        attention.forward(*_qkv())
    with simulated_gpu(), stand_in(Hardware.from_spec("b200")):
        with pytest.raises(ValueError, match="compute capability 10.0"):
            attention.forward(*_qkv())


@pytest.mark.parametrize(("d", "block_n"), [(64, 128), (128, 64), (256, 64)])
def test_a_simulated_h100_launch_is_the_plan(d, block_n):
    seen = []
    remove = gluon_launch.add_observer(lambda plan, per_call: seen.append((plan, per_call)))
    q, k, v = _qkv(heads=16, heads_kv=4, seq_q=4096, seq_kv=4096, d=d)
    before = runtime.launch_count("gluon_attention_fwd")
    try:
        with simulated_gpu():
            out, lse = attention.forward(q, k, v, is_causal=True)
    finally:
        remove()
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert runtime.launch_count("gluon_attention_fwd") == before + 1
    ((plan, per_call),) = seen
    items = 2 * 16 * (4096 // 128)
    assert plan.grid == (min(items, 132), 1, 1) and plan.num_warps == 4
    assert {
        k: plan.fixed[k] for k in ("BLOCK_M", "BLOCK_N", "HEAD_DIM", "STAGES", "IS_CAUSAL", "heads_kv")
    } == (dict(BLOCK_M=128, BLOCK_N=block_n, HEAD_DIM=d, STAGES=2, IS_CAUSAL=True, heads_kv=4))
    assert per_call["out_ptr"] is out and per_call["lse_ptr"] is lse
    assert per_call["scale2"] == pytest.approx(d**-0.5 * attention_schedule.LOG2E)  # the folded scale
    descriptors = plan.arguments(per_call)
    assert descriptors["q_desc"].block_shape == [64, d]  # one warpgroup's rows
    assert descriptors["k_desc"].block_shape == [block_n, d]
    assert attention_schedule.from_plan(plan) == attention_schedule.Schedule(128, block_n, 2, 132, 8)


def test_no_keys_and_no_queries_launch_nothing():
    before = runtime.launch_count("gluon_attention_fwd")
    with simulated_gpu():
        out, lse = attention.forward(*_qkv(seq_kv=0))
        assert not out.any() and torch.isinf(lse).all() and (lse < 0).all()
        out, lse = attention.forward(*_qkv(seq_q=0))
        assert out.shape[2] == 0 and lse.shape[2] == 0
    assert runtime.launch_count("gluon_attention_fwd") == before
