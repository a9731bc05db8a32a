"""The fused ops' rows of llm_speed.ops: each call reports its work (Triton and the PyTorch fallback alike),
the cost counts what the docstrings say, the example matches the baseline, and backward rows have probes."""

import pytest
import torch

from llm_speed import ops
from llm_speed.core import runtime
from llm_speed.profiler import CUDAProfiler

FORWARD = ("rms_norm", "swiglu", "geglu", "apply_rotary", "apply_rotary_qk", "cross_entropy",
           "fused_linear_cross_entropy")  # fmt: skip


@pytest.mark.parametrize("interpreted", [True, False], ids=["triton", "fallback"])
@pytest.mark.parametrize("name", FORWARD)
def test_forward_row_reports_its_cost_and_matches_the_baseline(name, interpreted, monkeypatch):
    if not interpreted:  # the CPU path without the interpreter: the same formulas in PyTorch
        monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    row = ops.get(name)
    args, kwargs = row.example_problem(torch.device("cpu"), torch.float32, 24)
    profiler = CUDAProfiler(torch.device("cpu"))
    with profiler.profile(name):
        out = row.load()(*args, **kwargs)
    metrics = profiler.get_metrics(name)
    expected = row.work(**_problem(name, args))
    assert metrics.flops == expected.flops > 0 and metrics.bytes_moved == expected.bytes_moved > 0
    torch.testing.assert_close(out, row.load_baseline()(*args, **kwargs), rtol=1e-4, atol=1e-4)


def _problem(name, args):
    if name == "rms_norm":
        return {"x": args[0], "weight": args[1]}
    if name in ("swiglu", "geglu"):
        return {"gate": args[0]}
    if name == "apply_rotary":
        return {"x": args[0], "cos": args[1]}
    if name == "apply_rotary_qk":
        return {"q": args[0], "k": args[1], "cos": args[2]}
    if name == "cross_entropy":
        return {"logits": args[0]}
    return {"hidden": args[0], "weight": args[1]}


def test_costs_by_hand():
    x = torch.empty(8, 16, dtype=torch.bfloat16)
    w = torch.empty(16, dtype=torch.float32)
    work = ops.get("rms_norm").work(x=x, weight=w)
    assert (work.flops, work.bytes_moved) == (4 * 8 * 16, 2 * 2 * 8 * 16 + 4 * 16 + 4 * 8)
    back = ops.get("rms_norm_backward").work(x=x, weight=w)
    assert (back.flops, back.bytes_moved) == (9 * 8 * 16, 3 * 2 * 8 * 16 + 2 * 4 * 16 + 4 * 8)
    hidden, weight = torch.empty(4, 8, dtype=torch.float16), torch.empty(32, 8, dtype=torch.float16)
    ce = ops.get("fused_linear_cross_entropy").work(hidden=hidden, weight=weight)
    # no [N, V] logits traffic: hidden and weight read once
    assert (ce.flops, ce.bytes_moved) == (2 * 4 * 32 * 8 + 4 * 4 * 32, 2 * (4 + 32) * 8)
    ce_back = ops.get("fused_linear_cross_entropy_backward").work(hidden=hidden, weight=weight)
    assert (ce_back.flops, ce_back.bytes_moved) == (6 * 4 * 32 * 8 + 4 * 4 * 32, 4 * (4 + 32) * 8)
    gate = torch.empty(10, 3)
    assert ops.get("swiglu_backward").work(gate=gate).bytes_moved == 5 * 30 * 4
    assert ops.get("rms_norm").work(x=x, weight=None).bytes_moved == 2 * 2 * 8 * 16 + 4 * 8
    logits = torch.empty(4, 32, dtype=torch.bfloat16)
    back = ops.get("cross_entropy_backward").work(logits=logits)
    assert (back.flops, back.bytes_moved) == (6 * 4 * 32, 2 * 2 * 4 * 32 + 4 * 4)
    q, k, cos = torch.empty(2, 8, 5, 64), torch.empty(2, 2, 5, 64), torch.empty(2, 5, 32)
    rot = ops.get("apply_rotary_qk").work(q=q, k=k, cos=cos)
    moved = 2 * 4 * (q.numel() + k.numel()) + 2 * 4 * 320
    assert (rot.flops, rot.bytes_moved) == (6 * 2 * 10 * 5 * 16, moved)


BACKWARD = ("rms_norm_backward", "swiglu_backward", "geglu_backward", "apply_rotary_qk_backward",
            "cross_entropy_backward", "fused_linear_cross_entropy_backward")  # fmt: skip


@pytest.mark.parametrize("name", BACKWARD)
def test_backward_probe_reports_forward_and_backward(name):
    cpu = torch.device("cpu")
    profiler = CUDAProfiler(cpu)
    with profiler.profile("both"):
        grads = ops.get(name).run_probe(cpu)
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    with profiler.profile("forward"):
        ops.get(name.removesuffix("_backward")).run_probe(cpu)
    forward = profiler.get_metrics("forward").flops
    both = profiler.get_metrics("both").flops
    if name == "apply_rotary_qk_backward":  # the same kernel both ways: the same cost
        assert both == 2 * forward > 0
    else:
        assert both > 2 * forward > 0  # every other backward costs more than its forward
