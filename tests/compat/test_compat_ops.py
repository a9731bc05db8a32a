"""cuda_llm_ops: the old signatures and semantics on llm-speed's kernels, and the old error classes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import cuda_llm_ops
import llm_speed
from llm_speed.attention.reference import reference_attention

OLD_NAMES = [
    "flash_attention",
    "tiled_attention",
    "naive_attention",
    "gemm",
    "tensor_core_gemm",
    "tensor_core_gemm_int8",
    "__version__",
]
ATTENTION = [
    (cuda_llm_ops.flash_attention, llm_speed.flash_attention),
    (cuda_llm_ops.tiled_attention, llm_speed.tiled_attention),
    (cuda_llm_ops.naive_attention, llm_speed.naive_attention),
]


def qkv(device, shape=(2, 2, 24, 16), dtype=torch.float32):
    return tuple(torch.randn(shape, device=device, dtype=dtype) for _ in range(3))


def test_old_module_listing_and_version():
    assert set(OLD_NAMES) <= set(dir(cuda_llm_ops))
    assert cuda_llm_ops.__version__ == llm_speed.__version__
    from cuda_llm_ops.profiler import Bottleneck, CUDAProfiler, KernelMetrics, print_benchmark_results

    assert (
        CUDAProfiler is llm_speed.profiler.CUDAProfiler and KernelMetrics is llm_speed.profiler.KernelMetrics
    )
    assert [b.value for b in Bottleneck] == ["compute_bound", "memory_bound", "latency_bound"]
    assert callable(print_benchmark_results)


@pytest.mark.parametrize("old, new", ATTENTION, ids=["flash", "tiled", "naive"])
def test_attention_old_signature_equals_llm_speed(device, old, new):
    q, k, v = qkv(device)
    inputs = [t.clone() for t in (q, k, v)]
    # scale=0.0 (the old default) means 1/sqrt(head_dim), positionally or by keyword.
    assert torch.equal(old(q, k, v), new(q, k, v))
    assert torch.equal(old(q, k, v, 0.0, True), new(q, k, v, is_causal=True))
    assert torch.equal(old(q, k, v, scale=0.3, is_causal=True), new(q, k, v, scale=0.3, is_causal=True))
    assert torch.equal(old(q, k, v, -0.5), new(q, k, v, scale=-0.5))
    for before, after in zip(inputs, (q, k, v), strict=True):
        assert torch.equal(before, after)


def test_attention_scale_zero_is_the_default_scale_against_float64(device):
    q, k, v = qkv(device)
    expected = reference_attention(q.double(), k.double(), v.double(), scale=1 / math.sqrt(16))
    torch.testing.assert_close(
        cuda_llm_ops.flash_attention(q, k, v, 0.0).double(), expected, rtol=0, atol=1e-5
    )
    # A real scale of 0 is not expressible in the old API: 0 always meant "default". The output differs
    # from uniform averaging, which is what scale 0 would give.
    uniform = v.mean(dim=2, keepdim=True).expand_as(v)
    assert not torch.allclose(cuda_llm_ops.flash_attention(q, k, v, 0.0), uniform, atol=1e-3)


@pytest.mark.parametrize("trans_a, trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_old_signature(device, trans_a, trans_b):
    m, n, k = 24, 40, 32
    a = torch.randn((k, m) if trans_a else (m, k), device=device)
    b = torch.randn((n, k) if trans_b else (k, n), device=device)
    out = cuda_llm_ops.gemm(a, b, 1.5, 0.0, trans_a, trans_b)
    assert out.dtype == a.dtype and out.shape == (m, n)
    assert torch.equal(out, llm_speed.gemm(a, b, alpha=1.5, trans_a=trans_a, trans_b=trans_b))
    op_a = a.double().T if trans_a else a.double()
    op_b = b.double().T if trans_b else b.double()
    torch.testing.assert_close(out.double(), 1.5 * op_a @ op_b, rtol=0, atol=k * 1e-6)


def test_tensor_core_gemms(device):
    a = torch.randn(16, 32, device=device, dtype=torch.float16)
    b = torch.randn(32, 24, device=device, dtype=torch.float16)
    out = cuda_llm_ops.tensor_core_gemm(a, b, 0.5)
    assert out.dtype == torch.float32
    assert torch.equal(out, llm_speed.tensor_core_gemm(a, b, alpha=0.5))
    a8 = torch.randint(-128, 128, (16, 64), device=device, dtype=torch.int8)
    b8 = torch.randint(-128, 128, (64, 8), device=device, dtype=torch.int8)
    out8 = cuda_llm_ops.tensor_core_gemm_int8(a8, b8)
    # the int32 reference on the CPU: CUDA has no int32 matmul
    assert out8.dtype == torch.int32 and torch.equal(out8.cpu(), a8.cpu().int() @ b8.cpu().int())


def test_gemm_beta_without_c_is_refused(device):
    a, b = torch.randn(4, 8, device=device), torch.randn(8, 4, device=device)
    for call in (
        lambda: cuda_llm_ops.gemm(a, b, 1.0, 0.5),
        lambda: cuda_llm_ops.tensor_core_gemm(a.half(), b.half(), beta=1.0),
    ):
        with pytest.raises(cuda_llm_ops.InvalidInputError, match="beta must be 0"):
            call()


def _assert_old_and_new(error_info, kind):
    error = error_info.value
    assert isinstance(error, RuntimeError) and isinstance(error, kind)
    assert isinstance(error, cuda_llm_ops.CudaLlmOpsError)


def _bad_attention_cases(device):
    q, k, v = qkv(device)
    return [
        ("rank", lambda: cuda_llm_ops.flash_attention(q[0], k, v), ValueError, "q must have 4 dims"),
        ("dtype", lambda: cuda_llm_ops.tiled_attention(q.int(), k.int(), v.int()), TypeError, "q has dtype"),
        ("mixed dtype", lambda: cuda_llm_ops.naive_attention(q, k.half(), v), TypeError, "share one dtype"),
        (
            "head_dim",
            lambda: cuda_llm_ops.flash_attention(q[..., :0], k[..., :0], v[..., :0]),
            ValueError,
            "head_dim",
        ),
        ("k/v shape", lambda: cuda_llm_ops.flash_attention(q, k, v[:, :, :5]), ValueError, "k and v"),
        (
            "not a tensor",
            lambda: cuda_llm_ops.flash_attention(q.tolist(), k, v),
            TypeError,
            "q must be a torch",
        ),
        ("scale type", lambda: cuda_llm_ops.flash_attention(q, k, v, "1"), TypeError, "scale"),
        ("is_causal type", lambda: cuda_llm_ops.flash_attention(q, k, v, 0.0, 1), TypeError, "is_causal"),
        ("validate", lambda: cuda_llm_ops.validate_attention_inputs(q, k[:1], v[:1]), ValueError, "batch"),
    ]


def test_attention_errors_are_old_runtime_errors_and_new_value_or_type_errors(device):
    for _label, call, kind, message in _bad_attention_cases(device):
        with pytest.raises(kind, match=message) as info:
            call()
        _assert_old_and_new(info, kind)


def test_gemm_errors_are_old_runtime_errors_and_new_value_or_type_errors(device):
    a, b = torch.randn(4, 8, device=device), torch.randn(8, 4, device=device)
    cases = [
        (lambda: cuda_llm_ops.gemm(a, b.T.contiguous()[:3]), ValueError),
        (lambda: cuda_llm_ops.gemm(a[0], b), ValueError),
        (lambda: cuda_llm_ops.gemm(a, b.double()), TypeError),
        (lambda: cuda_llm_ops.tensor_core_gemm(a, b), TypeError),
        (lambda: cuda_llm_ops.tensor_core_gemm_int8(a, b), TypeError),
        (lambda: cuda_llm_ops.validate_gemm_inputs(a, b, True, False), ValueError),
    ]
    for call, kind in cases:
        with pytest.raises(kind) as info:
            call()
        _assert_old_and_new(info, kind)
        assert "a" in str(info.value) or "b" in str(info.value)
    # A passing case right at the boundary: the transposes make the shapes fit.
    assert cuda_llm_ops.validate_gemm_inputs(a, a, False, True) is None


def test_out_of_memory_passes_through_unchanged(device, monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(llm_speed.attention.flash, "flash_attention", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        cuda_llm_ops.flash_attention(*qkv(device))


def test_empty_batch_gives_empty_output(device):
    q, k, v = qkv(device, shape=(0, 2, 8, 16))
    assert cuda_llm_ops.flash_attention(q, k, v).shape == (0, 2, 8, 16)


def test_messages_contain_the_old_phrases(device):
    # Code written for the old module matched these phrases; our clearer words come with them.
    q, k, v = qkv(device)
    a, b = torch.randn(4, 8, device=device), torch.randn(8, 4, device=device)
    cases = [
        (lambda: cuda_llm_ops.flash_attention(q[0], k, v), "must be 4D"),
        (lambda: cuda_llm_ops.validate_attention_inputs(q, k, v[0]), "must be 4D"),
        (lambda: cuda_llm_ops.naive_attention(q.double(), k, v), "Only float32 and float16"),
        (lambda: cuda_llm_ops.gemm(a.double(), b.double()), "Only float32 and float16 supported"),
        (lambda: cuda_llm_ops.gemm(a, a), "Inner dimensions must match"),
        (lambda: cuda_llm_ops.validate_gemm_inputs(a, b, True, False), "Inner dimensions must match"),
        (lambda: cuda_llm_ops.tensor_core_gemm(a.half(), a.half()), "Inner dimensions must match"),
    ]
    for call, phrase in cases:
        with pytest.raises(RuntimeError, match=phrase) as info:
            call()
        assert isinstance(info.value, (ValueError, TypeError))
    with pytest.raises(ValueError, match=r"q must have 4 dims .*\(q must be 4D\), got shape \("):
        cuda_llm_ops.tiled_attention(q[0], k, v)


def test_numpy_bools_are_flags_and_messages_name_the_real_type(device):
    q, k, v = qkv(device)
    expected = cuda_llm_ops.flash_attention(q, k, v, 0.0, True)
    assert torch.equal(cuda_llm_ops.flash_attention(q, k, v, 0.0, np.bool_(True)), expected)
    # (a short sequence: optimal_attention takes the naive kernel, equal up to rounding)
    torch.testing.assert_close(cuda_llm_ops.optimal_attention(q, k, v, np.bool_(True)), expected)
    a, b = torch.randn(4, 8, device=device), torch.randn(4, 8, device=device)
    out = cuda_llm_ops.gemm(a, b, 1.0, 0.0, np.bool_(False), np.bool_(True))
    torch.testing.assert_close(out, cuda_llm_ops.gemm(a, b, 1.0, 0.0, False, True))
    assert cuda_llm_ops.validate_gemm_inputs(a, b, np.bool_(False), np.bool_(True)) is None
    for call, name, shown in (
        (lambda: cuda_llm_ops.flash_attention(q, k, v, 0.0, "no"), "is_causal", "str"),
        (lambda: cuda_llm_ops.flash_attention(q, k, v, 0.0, np.int64(1)), "is_causal", "numpy.int64"),
        (lambda: cuda_llm_ops.gemm(a, b, 1.0, 0.0, False, 1), "trans_b", "int"),
    ):
        with pytest.raises(TypeError, match=rf"{name} must be a bool.*got {shown}\b") as info:
            call()
        assert isinstance(info.value, RuntimeError)
