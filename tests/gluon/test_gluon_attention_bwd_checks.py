"""The Gluon attention backward and its autograd pairing off a GPU: bad arguments refused by name before any
work, any device but a compute capability 9.0 GPU refused, under a simulated H100 the launch it makes (what
the kernel report compiles, whose tile and ring the schedule model reads); and the choice of the Gluon
kernels (``llm_speed.gluon.select``) refusing each call it does not take, for its reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from llm_speed.core import runtime
from llm_speed.core.hardware import Hardware
from llm_speed.core.launch import simulated_gpu
from llm_speed.core.policy import CANDIDATES, SHIPPED
from llm_speed.gluon import attention_bwd, attention_bwd_schedule, flash, select
from llm_speed.gluon import launch as gluon_launch
from llm_speed.kernel_report.capture import stand_in

BF16 = torch.bfloat16


def _tensors(heads=4, heads_kv=2, seq_q=100, seq_kv=90, d=64, dtype=BF16):
    q = torch.randn(2, heads, seq_q, d).to(dtype)
    k, v = (torch.randn(2, heads_kv, seq_kv, d).to(dtype) for _ in range(2))
    out, dout = torch.randn_like(q), torch.randn_like(q)
    return q, k, v, out, torch.randn(2, heads, seq_q), dout


def _swap(index, value):
    def make():
        return tuple(value(x) if i == index else x for i, x in enumerate(_tensors()))

    return make


BAD = [
    ("float32 q", _swap(0, lambda x: x.float()), {}, TypeError, "q has dtype torch.float32"),
    ("strided k", _swap(1, lambda x: x.transpose(1, 2)), {}, ValueError, "k must be contiguous"),
    ("heads", lambda: _tensors(heads=3, heads_kv=2), {}, ValueError, "q's 3 heads must be a multiple"),
    ("head dim", lambda: _tensors(d=96), {}, ValueError, "head dim 96 is not supported; accepted: 64, 128"),
    ("out shape", _swap(3, lambda x: x[:, :2]), {}, ValueError, r"out must be \(2, 4, 100, 64\)"),
    ("dout dtype", _swap(5, lambda x: x.half()), {}, ValueError, "dout must be .* like q"),
    ("out strided", _swap(3, lambda x: x.transpose(2, 3).contiguous().transpose(2, 3)), {}, ValueError,
     "out must be contiguous"),
    ("lse dtype", _swap(4, lambda x: x.double()), {}, TypeError, "lse has dtype torch.float64"),
    ("lse shape", _swap(4, lambda x: x[:, :, :7]), {}, ValueError, r"lse must be \(2, 4, 100\)"),
    ("dlse shape", _tensors, {"dlse": torch.zeros(2, 4, 99)}, ValueError, "dlse must be"),
    ("causal flag", _tensors, {"is_causal": 1}, TypeError, "is_causal must be a bool"),
    ("scale", _tensors, {"scale": float("inf")}, ValueError, "scale must be a finite number"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "make", "options", "error", "message"), BAD, ids=[c[0] for c in BAD])
def test_bad_arguments_are_refused_by_name(case, make, options, error, message):
    before = runtime.launch_count("gluon_attention_bwd")
    with simulated_gpu(), pytest.raises(error, match=message):
        attention_bwd.backward(*make(), **options)
    assert runtime.launch_count("gluon_attention_bwd") == before


def test_only_a_compute_capability_9_gpu_runs_it():
    with pytest.raises(ValueError, match="q is on cpu: llm_speed.gluon.attention_bwd runs on CUDA devices"):
        attention_bwd.backward(*_tensors())
    with simulated_gpu(), stand_in(Hardware.from_spec("b200")):
        with pytest.raises(ValueError, match="compute capability 10.0"):
            attention_bwd.backward(*_tensors())
    q, k, v = _tensors()[:3]
    with pytest.raises(ValueError, match="llm_speed.gluon.flash.flash_attention runs on CUDA devices"):
        flash.flash_attention(q, k, v)
    with pytest.raises(ValueError, match="head dim 96"):  # the arguments first, then the device
        flash.flash_attention(*_tensors(d=96)[:3])


@pytest.mark.parametrize("d", [64, 128])
def test_a_simulated_h100_launch_is_the_plan(d):
    seen = []
    remove = gluon_launch.add_observer(lambda plan, per_call: seen.append((plan, per_call)))
    q, k, v, out, lse, dout = _tensors(heads=16, heads_kv=4, seq_q=1024, seq_kv=1000, d=d)
    dlse = torch.randn_like(lse)
    before = runtime.launch_count("gluon_attention_bwd")
    try:
        with simulated_gpu():
            dq, dk, dv = attention_bwd.backward(q, k, v, out, lse, dout, is_causal=True, dlse=dlse)
    finally:
        remove()
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape) and dq.dtype == q.dtype
    assert runtime.launch_count("gluon_attention_bwd") == before + 1
    ((plan, per_call),) = seen
    assert plan.grid == (-(-1000 // 128) * 2 * 4, 1, 1) and plan.num_warps == 4  # key blocks x K/V heads
    names = ("BLOCK_M", "BLOCK_N", "HEAD_DIM", "STAGES", "IS_CAUSAL", "kv_pairs")
    wanted = dict(BLOCK_M=64, BLOCK_N=128, HEAD_DIM=d, STAGES=2, IS_CAUSAL=True, kv_pairs=8)
    assert {name: plan.fixed[name] for name in names} == wanted
    assert per_call["dk_ptr"] is dk and per_call["dv_ptr"] is dv and per_call["lse_ptr"] is lse
    assert per_call["dq_ptr"].dtype == torch.float32  # the atomics' buffer
    delta = (dout.float() * out.float()).sum(-1) - dlse
    assert torch.allclose(per_call["delta_ptr"], delta)
    assert per_call["scale2"] == pytest.approx(d**-0.5 * attention_bwd_schedule.LOG2E)
    descriptors = plan.arguments(per_call)
    # 3-D (batch x heads, seq, D): a partial block reads zeros, not the next head's rows
    assert descriptors["q_desc"].block_shape == descriptors["do_desc"].block_shape == [1, 64, d]
    assert descriptors["k_desc"].block_shape == [1, 64, d]  # one warpgroup's keys
    assert descriptors["q_desc"].shape == [32, 1024, d] and descriptors["k_desc"].shape == [8, 1000, d]
    assert attention_bwd_schedule.from_plan(plan) == attention_bwd_schedule.Schedule(64, 128, 2)


def test_no_keys_and_no_queries_launch_nothing():
    before = runtime.launch_count("gluon_attention_bwd")
    with simulated_gpu():
        dq, dk, dv = attention_bwd.backward(*_tensors(seq_kv=0))
        assert not dq.any() and dk.shape[2] == 0
        dq, dk, dv = attention_bwd.backward(*_tensors(seq_q=0))
        assert not dk.any() and not dv.any() and dq.shape[2] == 0
    assert runtime.launch_count("gluon_attention_bwd") == before


def test_flash_attention_pairs_the_forward_and_the_backward():
    q, k, v = (x.requires_grad_() for x in _tensors(heads=4, heads_kv=2, seq_q=256, seq_kv=256)[:3])
    before = [runtime.launch_count(name) for name in ("gluon_attention_fwd", "gluon_attention_bwd")]
    with simulated_gpu():  # nothing runs: the launches are counted, the outputs stay as allocated
        out = flash.flash_attention(q, k, v, is_causal=True)
        assert out.requires_grad and out.shape == q.shape
        out.backward(torch.ones_like(out))
    after = [runtime.launch_count(name) for name in ("gluon_attention_fwd", "gluon_attention_bwd")]
    assert after == [before[0] + 1, before[1] + 1]
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


# --- the choice (stage 3) -------------------------------------------------------------------------------

ON = dataclasses.replace(SHIPPED, gluon_forward_head_dims=(64, 128), gluon_backward_head_dims=(64, 128),
                        gluon_fp8_forward_head_dims=(64, 128))  # fmt: skip


def _call(**changes):
    q, k, v, out, _, dout = _tensors(**changes)
    return q, k, v, out, dout


REFUSED = [
    ("not named by the policy", {}, {"policy": SHIPPED}, "not in the policy's gluon_"),
    ("head dim", {"d": 96}, {"policy": dataclasses.replace(ON, gluon_forward_head_dims=(96,),
                                                           gluon_backward_head_dims=(96,))},
     "the Gluon kernel takes"),
    ("float32", {"dtype": torch.float32}, {}, "fp16 or bf16"),
    ("fp8 descales, bf16 q", {}, {"descales": (None, None, None)}, "fp8 takes e4m3 alike"),
    ("window", {}, {"window": (100, 0)}, "sliding window"),
    ("softcap", {}, {"softcap": 30.0}, "softcap"),
    ("alibi", {}, {"alibi_slopes": torch.ones(4)}, "ALiBi"),
    ("dropout", {}, {"dropout_p": 0.1}, "dropout"),
    ("two-pass", {}, {"two_pass": True}, "two-pass"),
    ("heads", {"heads": 3, "heads_kv": 2}, {}, "not a multiple"),
    ("empty", {"seq_kv": 0}, {}, "empty"),
    ("cpu", {}, {}, "tensors on cpu, not CUDA"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "shape", "options", "reason"), REFUSED, ids=[c[0] for c in REFUSED])
def test_each_call_the_gluon_kernels_do_not_take_is_refused_for_its_reason(case, shape, options, reason):
    q, k, v, out, dout = _call(**shape)
    options = {"policy": ON, **options}
    backward_options = {n: x for n, x in options.items() if n not in ("descales", "two_pass")}
    assert reason in select.gluon_forward_refusal(q, k, v, **options)
    assert not select.gluon_forward_applies(q, k, v, **options)
    if case not in ("fp8 descales, bf16 q", "two-pass"):  # forward-only options
        assert reason in select.gluon_backward_refusal(q, k, v, out, dout, **backward_options)
        assert not select.gluon_backward_applies(q, k, v, out, dout, **backward_options)


def test_layouts_and_devices_the_kernels_do_not_take(monkeypatch):
    monkeypatch.setattr(select, "device_refusal", lambda device: None)  # as on an H100
    q, k, v, out, dout = _call()
    assert select.gluon_forward_applies(q, k, v, policy=ON)  # the boundary: everything taken
    assert select.gluon_backward_applies(q, k, v, out, dout, policy=ON)
    seq_major = torch.randn(2, 100, 4, 64).to(BF16).transpose(1, 2)  # [B, S, H, D] viewed as [B, H, S, D]
    assert "not contiguous" in select.gluon_forward_refusal(seq_major, k, v, policy=ON)
    shifted = torch.empty(q.numel() + 1, dtype=BF16)[1:].view(q.shape)
    assert "16-byte" in select.gluon_forward_refusal(shifted, k, v, policy=ON)
    assert "dense [B, H, S, D]" in select.gluon_forward_refusal(q[0], k[0], v[0], policy=ON)  # packed
    assert "several devices" in select.gluon_forward_refusal(q, k.to("meta"), v, policy=ON)
    assert "deterministic" in select.gluon_backward_refusal(q, k, v, out, dout, deterministic=True, policy=ON)
    with torch_deterministic():
        assert not select.gluon_backward_applies(q, k, v, out, dout, policy=ON)
    assert "out is not" in select.gluon_backward_refusal(q, k, v, out[:, :2], dout, policy=ON)
    # a misaligned dout that is contiguous: the backward's dout.contiguous() keeps it, and its TMA
    # descriptor asserted inside autograd's backward instead of the Triton kernels taking the call
    shifted_dout = torch.empty(dout.numel() + 1, dtype=BF16)[1:].view(dout.shape)
    assert "dout is contiguous but not 16-byte" in select.gluon_backward_refusal(q, k, v, out, shifted_dout,
                                                                                 policy=ON)  # fmt: skip
    assert select.gluon_backward_applies(q, k, v, out, dout.transpose(1, 2).contiguous().transpose(1, 2),
                                         policy=ON)  # (not contiguous: copied, aligned)  # fmt: skip
    # the current policy when none is given: the candidates turn on d = 128 only
    from llm_speed.core.policy import use_policy

    q, k, v, out, dout = _call(d=128)
    assert not select.gluon_forward_applies(q, k, v)
    with use_policy("gluon-forward"):
        assert select.gluon_forward_applies(q, k, v)
        assert not select.gluon_backward_applies(q, k, v, out, dout)
    with use_policy("gluon-backward"):
        assert select.gluon_backward_applies(q, k, v, out, dout)
        assert not select.gluon_forward_applies(q, k, v)
    assert CANDIDATES["gluon-forward"].target["head_dim"] == 128


def test_only_compute_capability_9_devices(monkeypatch):
    assert "not CUDA" in select.device_refusal(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability (8, 0)" in select.device_refusal(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert select.device_refusal(torch.device("cuda", 0)) is None
    with simulated_gpu():  # CPU tensors stand for the stand-in GPU's (an H100), as the launches take them
        assert select.device_refusal(torch.device("cpu")) is None
        with stand_in(Hardware.from_spec("b200")):
            assert "compute capability (10, 0)" in select.device_refusal(torch.device("cpu"))


class torch_deterministic:
    def __enter__(self):
        self.was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc):
        torch.use_deterministic_algorithms(self.was)


def test_d256_is_the_forwards_alone(monkeypatch):
    # the forward takes d = 256; the backward (dK and dV of 64 keys x 256 would need 256 fp32 registers a
    # lane) and the pair refuse it by name, and the selection keeps it to the forward under a policy naming it
    q, k, v, out, lse, dout = _tensors(d=256)
    with simulated_gpu(), pytest.raises(ValueError, match="head dim 256 is not supported; accepted: 64, 128"):
        attention_bwd.backward(q, k, v, out, lse, dout)
    with simulated_gpu(), pytest.raises(ValueError, match="head dim 256 is not supported"):
        flash.flash_attention(q, k, v)
    monkeypatch.setattr(select, "device_refusal", lambda device: None)  # as on an H100
    both = dataclasses.replace(SHIPPED, gluon_forward_head_dims=(256,), gluon_backward_head_dims=(256,))
    assert select.gluon_forward_applies(q, k, v, policy=both)
    why = select.gluon_backward_refusal(q, k, v, out, dout, policy=both)
    assert "the Gluon kernel takes (64, 128)" in why
    assert "not in the policy's" in select.gluon_forward_refusal(q, k, v, policy=ON)  # off unless named


def test_fp8_only_under_its_own_field(monkeypatch):
    monkeypatch.setattr(select, "device_refusal", lambda device: None)  # as on an H100
    q, k, v = (x.float().to(torch.float8_e4m3fn) for x in _tensors()[:3])
    descales = (torch.ones(()), None, torch.ones(2))
    assert select.gluon_forward_applies(q, k, v, descales=descales, policy=ON)
    assert select.gluon_forward_applies(q, k, v, policy=ON)  # e4m3 without descales: descales of 1
    sixteen = dataclasses.replace(ON, gluon_fp8_forward_head_dims=())
    why = select.gluon_forward_refusal(q, k, v, descales=descales, policy=sixteen)
    assert "not in the policy's gluon_fp8_forward_head_dims" in why
    fp8_alone = dataclasses.replace(SHIPPED, gluon_fp8_forward_head_dims=(64,))
    assert "gluon_forward_head_dims" in select.gluon_forward_refusal(*_tensors()[:3], policy=fp8_alone)
    assert "e4m3 alike" in select.gluon_forward_refusal(q, k.to(torch.float8_e5m2), v, policy=ON)
    assert "softcap" in select.gluon_forward_refusal(q, k, v, descales=descales, softcap=5.0, policy=ON)
    assert CANDIDATES["gluon-forward-fp8"].policy.gluon_fp8_forward_head_dims == (128,)
    assert SHIPPED.gluon_fp8_forward_head_dims == ()
