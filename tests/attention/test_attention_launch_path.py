"""The per-call path of the dense and packed attention ops: every launch goes through a cached plan (one
lookup after the first call of a problem class, scale and softcap passed per call), and nothing reads tensor
values on the host (``core.launch.simulated_gpu``: CPU tensors take the CUDA path, launches are no-ops)."""

import pytest
import torch
from attention_testing import BACKWARD_KERNELS, FORWARD_KERNELS, fresh_plans, make_qkv

from call_records import record_calls
from host_reads import host_reads_raise
from llm_speed import flash_attention, tiled_attention
from llm_speed.attention import flash, flash_attention_varlen, launcher
from llm_speed.attention.reference import reference_attention
from llm_speed.core import launch, runtime


def _calls():
    q, k, v = make_qkv(2, 4, 2, 19, 23, 32, torch.float16, "cpu")
    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    cu_q = torch.tensor([0, 5, 12, 19], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 9, 23], dtype=torch.int32)

    def dense(fn, **options):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse = fn(*leaves, return_lse=True, **options)
        torch.autograd.grad((out.float().sum(), lse.sum()), leaves)
        with torch.no_grad():
            fn(q, k, v, **options)

    def varlen(**options):
        leaves = [t.clone().requires_grad_() for t in packed]
        out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, 7, 14, return_lse=True, **options)
        torch.autograd.grad((out.float().sum(), lse.sum()), leaves)

    return [
        lambda: dense(flash_attention, is_causal=True),
        lambda: dense(flash_attention, window=(3, None), softcap=20.0, scale=0.5),
        lambda: dense(tiled_attention, is_causal=False),
        lambda: varlen(is_causal=True, window=(2, 0), softcap=5.0),
    ]


def test_no_host_reads_and_one_plan_lookup_per_launch(monkeypatch):
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)  # as on a GPU: cu_seqlens values are not checked
    with launch.simulated_gpu():
        calls = _calls()
        for call in calls:  # first calls make the plans (host reads allowed: nothing may need them anyway)
            call()
        made = launcher.forward_plan.cache_info().misses, launcher.backward_plans.cache_info().misses
        before = runtime.launch_counts()
        with host_reads_raise(monkeypatch):
            for call in calls:
                call()
        ran = runtime.launch_counts() - before
        misses = (launcher.forward_plan.cache_info().misses, launcher.backward_plans.cache_info().misses)
        assert misses == made
    # forward: flash 2 calls x (grad + no-grad) + varlen 1, tiled 1 x 2; backward: 4 calls x 3 kernels
    assert ran[FORWARD_KERNELS[0]] == 5 and ran[flash.TILED.name] == 2
    assert all(ran[name] == 4 for name in BACKWARD_KERNELS)


def test_scale_and_softcap_are_per_call(device, monkeypatch):
    fresh_plans(monkeypatch)
    q, k, v = make_qkv(1, 2, 1, 17, 21, 16, torch.float32, device)
    results = []
    for scale, softcap in ((0.3, 2.0), (0.9, 7.0)):
        out = flash_attention(q, k, v, is_causal=True, scale=scale, softcap=softcap)
        q64, k64, v64 = (t.double() for t in (q, k, v))
        ref = reference_attention(q64, k64, v64, is_causal=True, scale=scale, softcap=softcap)
        assert (out.double() - ref).abs().max() < 1e-5
        results.append(out)
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    assert launcher.forward_plan.cache_info().misses == 1  # one plan served both calls
    assert not torch.equal(results[0], results[1])


def test_a_plan_per_problem_class(device, monkeypatch):
    # Shapes, strides, dtypes and mask parameters each make their own plan; the same class reuses one.
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    fresh_plans(monkeypatch)
    q, k, v = make_qkv(1, 2, 2, 9, 9, 16, torch.float32, device)
    flash_attention(q, k, v)
    flash_attention(q.clone(), k.clone(), v.clone())
    assert launcher.forward_plan.cache_info().misses == 1
    for variant in (
        lambda: flash_attention(q, k, v, is_causal=True),
        lambda: flash_attention(q, k, v, window=(2, 3)),
        lambda: flash_attention(q, k, v, window=(2, 4)),
        lambda: flash_attention(q, k, v, softcap=3.0),
        lambda: flash_attention(q.transpose(1, 2).contiguous().transpose(1, 2), k, v),
        lambda: flash_attention(q.half(), k.half(), v.half()),
        lambda: flash_attention(q[:, :, :5], k, v),
    ):
        misses = launcher.forward_plan.cache_info().misses
        variant()
        assert launcher.forward_plan.cache_info().misses == misses + 1


def test_a_repeated_inference_call_skips_the_checks(device, monkeypatch):
    """The second dense inference call with the same metadata is served from the calls already checked: no
    check, one launch, the same result as the first call and as float64."""
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    fresh_plans(monkeypatch)
    checked = record_calls(monkeypatch, flash, "prepare_attention_inputs")
    q, k, v = make_qkv(2, 4, 2, 19, 23, 32, torch.float32, device)
    with torch.no_grad():
        first = flash_attention(q, k, v, is_causal=True)
        before = runtime.launch_count(FORWARD_KERNELS[0])
        again = flash_attention(q.clone(), k.clone(), v.clone(), is_causal=True)
        assert runtime.launch_count(FORWARD_KERNELS[0]) == before + 1
        # the LSE asked for: another class (the calls above store none), checked once
        out, lse = flash_attention(q, k, v, is_causal=True, return_lse=True)
        flash_attention(q.clone(), k.clone(), v.clone(), is_causal=True, return_lse=True)
        flash_attention(q, k, v, is_causal=True, scale=-0.2)  # a negative scale: another plan, checked
        negative = flash_attention(q, k, v, is_causal=True, scale=-0.3)
    assert len(checked) == 3 and len(launcher.DENSE_CALLS) == 3
    assert torch.equal(again, first) and torch.equal(out, first)
    assert sorted(call.plan.fixed.get("LSE", "given") is None for call in launcher.DENSE_CALLS.values()) == [
        False, True, True
    ]  # the LSE's pointer compiled out where it is not returned
    q64, k64, v64 = (t.double() for t in (q, k, v))
    ref, ref_lse = reference_attention(q64, k64, v64, is_causal=True, return_lse=True)
    assert (out.double() - ref).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5
    ref = reference_attention(q64, k64, v64, is_causal=True, scale=-0.3)
    assert (negative.double() - ref).abs().max() < 1e-5


def test_the_checked_calls_never_skip_a_check(device, monkeypatch):
    """A call with the metadata of one checked before still gets every error its arguments deserve, and a
    call that needs autograd, autocast or another option goes through the op."""
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    fresh_plans(monkeypatch)
    q, k, v = make_qkv(1, 2, 2, 9, 9, 16, torch.float32, device)
    with torch.no_grad():
        flash_attention(q, k, v, is_causal=True)
        assert len(launcher.DENSE_CALLS) == 1
        with pytest.raises(TypeError, match="is_causal"):
            flash_attention(q, k, v, is_causal=1)  # equal to True as a key, not a bool
        with pytest.raises(ValueError, match="scale"):
            flash_attention(q, k, v, is_causal=True, scale=float("nan"))
        with pytest.raises(TypeError, match="return_lse"):
            flash_attention(q, k, v, is_causal=True, return_lse="yes")
        with pytest.raises(ValueError, match="head_dim"):
            flash_attention(q, k[..., :8], v[..., :8], is_causal=True)
    checked = record_calls(monkeypatch, flash, "prepare_attention_inputs")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attention(*leaves, is_causal=True).sum().backward()  # autograd: through the op
    with torch.no_grad():
        flash_attention(q, k, v, is_causal=True, window=(2, 0))
        flash_attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, is_causal=True)  # copied
        flash_attention(q, k, v, is_causal=True)
    # the call with grad is kept too (with its LSE)
    assert len(checked) == 3 and len(launcher.DENSE_CALLS) == 2
    assert all(leaf.grad is not None for leaf in leaves)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_a_repeated_call_with_grad_records_the_node_around_the_kept_one(deterministic, device, monkeypatch):
    """With grad, the second dense call with the same metadata skips the checks and the op's layers and
    records the op's autograd node around the kept launch (a plan that stores the LSE): the same output and
    gradients as the checked call, as float64 says, only for the inputs that require grad."""
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    fresh_plans(monkeypatch)
    checked = record_calls(monkeypatch, flash, "prepare_attention_inputs")
    q, k, v = make_qkv(1, 4, 2, 13, 21, 32, torch.float32, device)
    dout = torch.randn_like(q)
    results = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = flash_attention(*leaves, is_causal=True, deterministic=deterministic)
        out.backward(dout)
        results.append((out.detach(), *(leaf.grad for leaf in leaves)))
    assert len(checked) == 1 and len(launcher.DENSE_CALLS) == 1
    for first, second in zip(*results, strict=True):
        assert torch.equal(first, second)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    reference_attention(q64, k64, v64, is_causal=True).backward(dout.double())
    for got, truth in zip(results[1][1:], (q64.grad, k64.grad, v64.grad), strict=True):
        assert (got.double() - truth).abs().max() < 1e-4
    k_only = k.clone().requires_grad_()
    flash_attention(q, k_only, v, is_causal=True, deterministic=deterministic).backward(dout)
    assert len(checked) == 1 and torch.equal(k_only.grad, results[1][2])


def test_checked_calls_are_bounded_and_cleared():
    cache = launch.CallCache(maxsize=2)
    cache.put(1, "a")
    cache.put(2, "b")
    cache.put(3, "c")  # full: it starts again
    assert dict(cache) == {3: "c"}
    launch.clear_plans()
    assert not cache


def test_a_repeated_varlen_call_skips_the_metadata_checks_not_the_values(device, monkeypatch):
    """A repeated packed inference call goes straight to its kept launch (no check of the metadata, no plan
    lookup), which still checks the values of cu_seqlens where they may be read (CPU tensors); causal or not
    are two classes."""
    from llm_speed.attention import varlen

    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    launch.clear_plans()
    checked = record_calls(monkeypatch, varlen, "validate_varlen_inputs")
    q, k, v = (torch.randn(19, 4, 32, device=device) for _ in range(3))
    cu = torch.tensor([0, 5, 12, 19], dtype=torch.int32, device=device)
    with torch.no_grad():
        first = flash_attention_varlen(q, k, v, cu, cu, 7, 7, is_causal=True)
        again = flash_attention_varlen(q.clone(), k, v, cu, cu, 7, 7, is_causal=True)
        assert len(checked) == 1 and torch.equal(again, first)
        lookups = launcher.forward_plan.cache_info()
        flash_attention_varlen(q, k, v, cu, cu, 7, 7, is_causal=True)
        assert launcher.forward_plan.cache_info() == lookups  # the kept launch: no plan looked up
        full = flash_attention_varlen(q, k, v, cu, cu, 7, 7)  # not causal: a class of its own
        assert torch.equal(flash_attention_varlen(q, k, v, cu, cu, 7, 7), full)
        assert len(checked) == 2 and len(varlen._VARLEN_CALLS) == 2
        for b, (lo, hi) in enumerate(((0, 5), (5, 12), (12, 19))):
            for causal, got in ((True, first), (False, full)):
                one = [t[lo:hi].transpose(0, 1)[None].double() for t in (q, got)]
                ref = reference_attention(one[0], *(t[lo:hi].transpose(0, 1)[None].double() for t in (k, v)),
                                          is_causal=causal)  # fmt: skip
                assert (one[1] - ref).abs().max() < 1e-5, (b, causal)
        if runtime.check_values(q.device):
            bad = torch.tensor([0, 12, 5, 19], dtype=torch.int32, device=device)  # same metadata, decreasing
            with pytest.raises(ValueError, match="cu_seqlens"):
                flash_attention_varlen(q, k, v, bad, cu, 7, 7, is_causal=True)
        with pytest.raises(TypeError, match="is_causal"):
            flash_attention_varlen(q, k, v, cu, cu, 7, 7, is_causal=1)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = flash_attention_varlen(*leaves, cu, cu, 7, 7, is_causal=True)  # with grad: kept too
    dout = torch.randn_like(out)
    out.backward(dout)
    assert len(checked) == 2 and torch.equal(out.detach(), first)
    for b, (lo, hi) in enumerate(((0, 5), (5, 12), (12, 19))):
        one = [t[lo:hi].transpose(0, 1)[None].double().requires_grad_() for t in (q, k, v)]
        reference_attention(*one, is_causal=True).backward(dout[lo:hi].transpose(0, 1)[None].double())
        for leaf, truth in zip(leaves, one, strict=True):
            assert (leaf.grad[lo:hi].transpose(0, 1)[None].double() - truth.grad).abs().max() < 1e-4, b
