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


@pytest.mark.parametrize(("d", "block_n", "split_mask"),
                         [(64, 128, False), (128, 64, True), (256, 64, False)])  # fmt: skip
def test_a_simulated_h100_launch_is_the_plan(d, block_n, split_mask):
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
    assert plan.fixed["SPLIT_MASK"] is split_mask  # causal: split at d = 128 only
    assert per_call["out_ptr"] is out and per_call["lse_ptr"] is lse
    assert per_call["scale2"] == pytest.approx(d**-0.5 * attention_schedule.LOG2E)  # the folded scale
    descriptors = plan.arguments(per_call)
    # 3-D (batch x heads, seq, D): a head's partial last block reads zeros, not the next head's rows
    assert descriptors["q_desc"].block_shape == [1, 64, d]  # one warpgroup's rows
    assert descriptors["k_desc"].block_shape == descriptors["v_desc"].block_shape == [1, block_n, d]
    assert descriptors["q_desc"].shape == [32, 4096, d] and descriptors["v_desc"].shape == [8, 4096, d]
    wanted = attention_schedule.Schedule(128, block_n, 2, 132, 8, split_mask)
    assert attention_schedule.from_plan(plan) == wanted


def test_no_keys_and_no_queries_launch_nothing():
    before = runtime.launch_count("gluon_attention_fwd")
    with simulated_gpu():
        out, lse = attention.forward(*_qkv(seq_kv=0))
        assert not out.any() and torch.isinf(lse).all() and (lse < 0).all()
        out, lse = attention.forward(*_qkv(seq_q=0))
        assert out.shape[2] == 0 and lse.shape[2] == 0
    assert runtime.launch_count("gluon_attention_fwd") == before


# --- fp8 --------------------------------------------------------------------------------------------------

E4M3 = torch.float8_e4m3fn


def _fp8(seq_kv=90, d=64):
    return tuple(x.to(E4M3) for x in _qkv(seq_kv=seq_kv, d=d, dtype=torch.float32))


FP8_BAD = [
    ("descale with bf16", _qkv, {"descale_q": torch.ones(())}, ValueError,
     "descale_q is for fp8 .e4m3. q, k and v only"),
    ("e5m2", lambda: tuple(x.to(torch.float8_e5m2) for x in _fp8()), {}, TypeError, "q has dtype"),
    ("fp8 q, bf16 k", lambda: (_fp8()[0], *_qkv()[1:]), {}, TypeError, "k has dtype torch.bfloat16"),
    ("descale dtype", _fp8, {"descale_k": torch.ones((), dtype=torch.float64)}, TypeError,
     "descale_k must be float32"),
    ("descale shape", _fp8, {"descale_v": torch.ones(3)}, ValueError, r"descale_v must be \[\] or \[1\]"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "make", "options", "error", "message"), FP8_BAD,
                         ids=[c[0] for c in FP8_BAD])  # fmt: skip
def test_bad_fp8_arguments_are_refused_by_name(case, make, options, error, message):
    with simulated_gpu(), pytest.raises(error, match=message):
        attention.forward(*make(), **options)


def test_bad_descale_values_are_refused_where_values_are_checked(monkeypatch):
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)
    with simulated_gpu(), pytest.raises(ValueError, match="descale_k must be finite and > 0"):
        attention.forward(*_fp8(), descale_k=torch.tensor([1.0, -2.0]))


@pytest.mark.parametrize(("d", "block_n"), [(64, 128), (128, 128), (256, 64)])  # (not causal)
def test_a_simulated_fp8_launch_reads_v_transposed(d, block_n):
    seen = []
    remove = gluon_launch.add_observer(lambda plan, per_call: seen.append((plan, per_call)))
    q, k, v = _fp8(seq_kv=90, d=d)
    descale_q, descale_k, descale_v = torch.rand(2, 2) + 0.5, torch.rand(2) + 0.5, torch.rand(()) + 0.5
    try:
        with simulated_gpu():
            out, lse = attention.forward(q, k, v, descale_q=descale_q, descale_k=descale_k,
                                         descale_v=descale_v)  # fmt: skip
    finally:
        remove()
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and out.shape == q.shape
    ((plan, per_call),) = seen
    assert plan.fixed["FP8"] and plan.fixed["BLOCK_N"] == block_n
    v_t = per_call["v_desc"]  # V^T [B H_kv D, Skv], rows 16-byte aligned (96 bytes apart for 90 keys)
    assert v_t.shape == (2 * 2 * d, 90) and v_t.stride() == (96, 1)
    assert torch.equal(v_t.view(torch.uint8).unflatten(0, (2, 2, d)), v.view(torch.uint8).transpose(2, 3))
    assert plan.arguments(per_call)["v_desc"].block_shape == [d, block_n]  # [D, keys]: K-major for fp8
    # descale_q descale_k per K/V head (folded into the scale), descale_v per K/V head
    assert torch.equal(per_call["qk_descale_ptr"], descale_q * descale_k[None])
    assert torch.equal(per_call["v_descale_ptr"], descale_v.expand(2, 2))
    assert per_call["qk_descale_ptr"].is_contiguous() and per_call["v_descale_ptr"].is_contiguous()


def test_a_bad_descale_unchecked_turns_its_heads_outputs_into_nan(monkeypatch):
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)  # as on a GPU: no host read of the values
    seen = []
    remove = gluon_launch.add_observer(lambda plan, per_call: seen.append(per_call))
    try:
        with simulated_gpu():
            bad_v = torch.tensor([[2.0, 1.0], [float("nan"), 1.0]])
            attention.forward(*_fp8(), descale_k=torch.tensor([1.0, -2.0]), descale_v=bad_v)
    finally:
        remove()
    ((per_call,),) = [seen]
    nan = float("nan")
    assert torch.equal(per_call["qk_descale_ptr"].isnan(), torch.tensor([[False, True], [True, True]]))
    assert torch.allclose(per_call["v_descale_ptr"], torch.tensor([[2.0, nan], [nan, nan]]), equal_nan=True)
