"""No MoE op reads device data on the host in its default path (each read would wait for the GPU and break
CUDA-graph capture): forward and backward on CPU tensors taking the CUDA code path, launches stubbed, value
checks off, while every way of reading values on the host raises."""

import pytest
import torch
from moe_testing import host_reads_raise

import llm_speed
from llm_speed.core import launch, runtime


def _grouped_gemm(grad):
    a = torch.randn(24, 16).requires_grad_(grad)
    b = torch.randn(3, 40, 16).requires_grad_(grad)
    offsets = torch.tensor([5, 5, 24], dtype=torch.int32)
    return lambda: llm_speed.grouped_gemm(a, b, offsets, trans_b=True)


def _route(grad):
    logits = torch.randn(10, 16).requires_grad_(grad)
    bias = torch.randn(16)
    return lambda: llm_speed.moe_route(logits, 4, scoring="sigmoid", bias=bias, n_group=4, topk_group=2)[0]


def _sort(grad):
    ids = torch.randint(0, 8, (10, 2), dtype=torch.int32)
    return lambda: llm_speed.moe_sort(ids, 8)[0]


def _fused_moe(grad):
    x = torch.randn(10, 32).requires_grad_(grad)
    w_gate_up = torch.randn(8, 48, 32).requires_grad_(grad)
    w_down = torch.randn(8, 32, 24).requires_grad_(grad)
    weights = torch.rand(10, 2).requires_grad_(grad)
    ids = torch.randint(0, 8, (10, 2))
    return lambda: llm_speed.fused_moe(x, w_gate_up, w_down, weights, ids)


def _module(grad):
    layer = llm_speed.nn.MoE(32, 24, 8, 2)
    layer.requires_grad_(grad)
    x = torch.randn(2, 5, 32).requires_grad_(grad)
    return lambda: layer(x)


CASES = {"grouped_gemm": _grouped_gemm, "moe_route": _route, "moe_sort": _sort, "fused_moe": _fused_moe,
         "nn.MoE": _module}  # fmt: skip


@pytest.mark.parametrize("name", CASES)
def test_default_path_reads_nothing_on_the_host(name, monkeypatch):
    grad = name != "moe_sort"
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    call = CASES[name](grad)
    before = runtime.launch_counts()
    with launch.simulated_gpu():
        for _ in range(2):  # the first call makes the plans, the second takes the direct path
            with host_reads_raise(monkeypatch):
                out = call()
                if grad:
                    out.backward(torch.ones_like(out))
    assert runtime.launch_counts() - before, f"{name}: no Triton kernel launched"
