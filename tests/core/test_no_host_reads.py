"""No op reads device data on the host in its default path: each would be a GPU synchronisation, and makes
the call impossible to capture in a CUDA graph.

Every public op runs, forward and (where differentiable) backward, on CPU tensors taking the CUDA code path
with the launches stubbed (``core.launch.simulated_gpu``) and the value checks off (as for CUDA tensors by
default), while every way of reading a tensor's values on the host raises. A read shows as the raise, with its
line.
"""

from __future__ import annotations

import pytest
import torch

import llm_speed
from host_reads import HostRead, host_reads_raise
from llm_speed.core import launch, runtime


def _randn(*shape, grad=False):
    return torch.randn(*shape).requires_grad_(grad)


def _attention(name, grad):
    q, k, v = (_randn(2, 4, 24, 16, grad=grad) for _ in range(3))
    return lambda: getattr(llm_speed, name)(q, k, v, is_causal=True)


def _varlen(grad):
    cu = torch.tensor([0, 5, 5, 16], dtype=torch.int32)
    q, k, v = (_randn(16, 2, 16, grad=grad) for _ in range(3))
    return lambda: llm_speed.flash_attention_varlen(q, k, v, cu, cu, 11, 11, is_causal=True)


def _kvcache(paged: bool, append: bool):
    def make(grad):
        batch, heads_kv, dim = 2, 2, 32
        seqlens = torch.tensor([40, 25], dtype=torch.int32)
        if paged:
            k_cache, v_cache = (torch.randn(8, 16, heads_kv, dim) for _ in range(2))
            table = torch.arange(8, dtype=torch.int32).reshape(batch, 4)
        else:
            k_cache, v_cache = (torch.randn(batch, 64, heads_kv, dim) for _ in range(2))
            table = None
        q = torch.randn(batch, 1, 4, dim)
        new = [torch.randn(batch, 1, heads_kv, dim) for _ in range(2)] if append else [None, None]
        return lambda: llm_speed.flash_attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, k=new[0], v=new[1], block_table=table, is_causal=True
        )

    return make


def _gemm(grad):
    a, b = _randn(24, 16, grad=grad), _randn(16, 40, grad=grad)
    bias = _randn(40, grad=grad)
    return lambda: llm_speed.gemm(a, b, bias=bias, activation="gelu")


def _int8(grad):
    a, b = (torch.randint(-128, 128, (32, 32), dtype=torch.int8) for _ in range(2))
    return lambda: llm_speed.tensor_core_gemm_int8(a, b)


def _rms_norm(grad):
    x, w = _randn(6, 64, grad=grad), _randn(64, grad=grad)
    return lambda: llm_speed.rms_norm(x, w)


def _swiglu(grad):
    g, u = _randn(6, 64, grad=grad), _randn(6, 64, grad=grad)
    return lambda: llm_speed.swiglu(g, u)


def _rotary(grad):
    x = _randn(1, 2, 16, 16, grad=grad)
    cos, sin = torch.randn(16, 8), torch.randn(16, 8)
    return lambda: llm_speed.apply_rotary(x, cos, sin)


def _cross_entropy(reduction):
    def make(grad):
        h, w = _randn(8, 16, grad=grad), _randn(64, 16, grad=grad)
        target = torch.randint(0, 64, (8,))
        target[3] = -100
        return lambda: llm_speed.fused_linear_cross_entropy(h, w, target, reduction=reduction, chunk_rows=3)

    return make


def _geglu(grad):
    g, u = _randn(6, 64, grad=grad), _randn(6, 64, grad=grad)
    return lambda: llm_speed.geglu(g, u)


def _rotary_qk(grad):
    q, k = _randn(1, 4, 16, 16, grad=grad), _randn(1, 2, 16, 16, grad=grad)
    cos, sin = torch.randn(1, 16, 16), torch.randn(1, 16, 16)
    return lambda: torch.cat([t.flatten() for t in llm_speed.apply_rotary_qk(q, k, cos, sin)])


def _logits_cross_entropy(grad):
    logits, target = _randn(8, 64, grad=grad), torch.randint(0, 64, (8,))
    target[3] = -100
    weight = torch.rand(64)
    return lambda: llm_speed.cross_entropy(logits, target, weight=weight, lse_square_scale=1e-4)


def _grouped_gemm(grad):
    a, b = _randn(24, 16, grad=grad), _randn(3, 40, 16, grad=grad)
    offsets = torch.tensor([5, 5, 24], dtype=torch.int32)
    return lambda: llm_speed.grouped_gemm(a, b, offsets, trans_b=True)


def _moe_route(grad):
    logits, bias = _randn(10, 16, grad=grad), torch.randn(16)
    return lambda: llm_speed.moe_route(logits, 4, scoring="sigmoid", bias=bias, n_group=4, topk_group=2)[0]


def _moe_sort(grad):
    ids = torch.randint(0, 8, (10, 2), dtype=torch.int32)
    return lambda: llm_speed.moe_sort(ids, 8)[0]


def _fused_moe(grad):
    x, w_down = _randn(10, 32, grad=grad), _randn(8, 32, 24, grad=grad)
    w_gate_up = _randn(8, 48, 32, grad=grad)
    weights, ids = _randn(10, 2, grad=grad), torch.randint(0, 8, (10, 2))
    return lambda: llm_speed.fused_moe(x, w_gate_up, w_down, weights, ids)


def _moe_module(grad):
    layer = llm_speed.nn.MoE(32, 24, 8, 2).requires_grad_(grad)
    x = _randn(2, 5, 32, grad=grad)
    return lambda: layer(x)


def _quantize_fp8(granularity):
    def make(grad):
        x = torch.randn(40, 300)
        return lambda: llm_speed.quantize_fp8(x, granularity=granularity)

    return make


def _gemm_fp8(grad):
    a, w = torch.randn(24, 16).to(torch.float8_e4m3fn), torch.randn(40, 16).to(torch.float8_e4m3fn)
    scale_a, scale_b = torch.rand(24, 1), torch.rand(40, 1)
    return lambda: llm_speed.gemm_fp8(a, w, scale_a, scale_b, trans_b=True, bias=torch.randn(40))


def _float8_linear(granularity):
    def make(grad):
        layer = llm_speed.nn.Float8Linear(16, 40, granularity=granularity).requires_grad_(grad)
        x = _randn(3, 8, 16, grad=grad)
        return lambda: layer(x)

    return make


CASES = {
    "flash_attention": lambda grad: _attention("flash_attention", grad),
    "tiled_attention": lambda grad: _attention("tiled_attention", grad),
    "flash_attention_varlen": _varlen,
    "kvcache-dense": _kvcache(paged=False, append=False),
    "kvcache-dense-append": _kvcache(paged=False, append=True),
    "kvcache-paged": _kvcache(paged=True, append=False),
    "kvcache-paged-append": _kvcache(paged=True, append=True),
    "gemm": _gemm,
    "tensor_core_gemm_int8": _int8,
    "rms_norm": _rms_norm,
    "swiglu": _swiglu,
    "apply_rotary": _rotary,
    **{f"fused_linear_cross_entropy-{r}": _cross_entropy(r) for r in ("mean", "sum", "none")},
    "geglu": _geglu,
    "apply_rotary_qk": _rotary_qk,
    "cross_entropy": _logits_cross_entropy,
    "grouped_gemm": _grouped_gemm,
    "moe_route": _moe_route,
    "moe_sort": _moe_sort,
    "fused_moe": _fused_moe,
    "nn.MoE": _moe_module,
    **{f"quantize_fp8-{g}": _quantize_fp8(g) for g in ("tensor", "row", (1, 128), (128, 128))},
    "gemm_fp8": _gemm_fp8,
    **{f"nn.Float8Linear-{g}": _float8_linear(g) for g in ("tensor", "row")},
}
NOT_DIFFERENTIABLE = {"tensor_core_gemm_int8", "moe_sort", "gemm_fp8"}
NOT_DIFFERENTIABLE |= {name for name in CASES if name.startswith("quantize_fp8")}
NOT_DIFFERENTIABLE |= {name for name in CASES if name.startswith("kvcache")}


@pytest.mark.parametrize("name", CASES)
def test_default_path_reads_nothing_on_the_host(name, monkeypatch):
    grad = name not in NOT_DIFFERENTIABLE
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    call = CASES[name](grad)
    before = runtime.launch_counts()
    with launch.simulated_gpu():
        for _ in range(2):  # the first call makes the plans, the second takes the direct path
            with host_reads_raise(monkeypatch):
                out = call()
                out = out[0] if isinstance(out, tuple) else out
                if grad:
                    torch.autograd.backward(out, torch.ones_like(out) if out.dim() else None)
    launched = runtime.launch_counts() - before
    assert launched, f"{name}: no Triton kernel launched"


def test_the_guard_catches_a_read(monkeypatch):
    with host_reads_raise(monkeypatch), pytest.raises(HostRead, match="Tensor.item"):
        torch.ones(2).sum().item()
