"""None for a required tensor is named by the op's own checks, not an AttributeError from its fast path
(``core.dispatch.plain_call`` told apart required and optional tensors); values that have no meaning (NaN
or infinite ALiBi slopes, fp8 scales, router logits, a quantized tensor's inf) are refused where values are
checked (CPU tensors), before any work; the packed layout needs its keys' bounds. Found by the bad-input
audit of 2026-12-07, each a bare AttributeError or a silent NaN / wrong result before."""

from __future__ import annotations

import pytest
import torch

import llm_speed

I32 = torch.int32


def _qkv():
    return torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)


def _packed():
    return torch.randn(12, 4, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)


CU = torch.tensor([0, 5, 12], dtype=I32)
V_CACHE = torch.randn(2, 32, 2, 16)
LENGTHS = torch.tensor([3, 4], dtype=I32)

NONE_CALLS = {
    "q": lambda: llm_speed.flash_attention(None, *_qkv()[1:]),
    "v": lambda: llm_speed.flash_attention(*_qkv()[:2], None),
    "cu_seqlens_q": lambda: llm_speed.flash_attention_varlen(*_packed(), None, CU, 7, 7),
    "k_cache": lambda: llm_speed.flash_attention_with_kvcache(torch.randn(2, 1, 4, 16), None, V_CACHE,
                                                              cache_seqlens=LENGTHS),  # fmt: skip
    "a": lambda: llm_speed.gemm(None, torch.randn(16, 12)),
    "x": lambda: llm_speed.rms_norm(None, torch.randn(32)),
    "gate": lambda: llm_speed.swiglu(None, torch.randn(4, 8)),
    "cos": lambda: llm_speed.apply_rotary_qk(torch.randn(1, 2, 8, 16), torch.randn(1, 1, 8, 16), None,
                                             torch.randn(1, 8, 16)),  # fmt: skip
    "target": lambda: llm_speed.fused_linear_cross_entropy(torch.randn(4, 16), torch.randn(8, 16), None),
}


@pytest.mark.parametrize("name", list(NONE_CALLS))
def test_none_for_a_required_tensor_is_named(name):
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor"):
        NONE_CALLS[name]()


def test_int8_gemm_names_a_missing_operand():
    with pytest.raises(TypeError, match="^a must be a torch.Tensor"):
        llm_speed.tensor_core_gemm_int8(None, torch.randint(-5, 5, (16, 12), dtype=torch.int8))


def test_packed_keys_need_their_bounds_without_a_block_table():
    q, k, v = _packed()
    with pytest.raises(TypeError, match="cu_seqlens_k must be a torch.Tensor .*None only with a block_table"):
        llm_speed.flash_attention_varlen(q, k, v, CU, None, 7, 7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_alibi_slopes_must_be_finite(bad):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=f"alibi_slopes must be finite, got {bad}"):
        llm_speed.flash_attention(q, k, v, alibi_slopes=torch.full((4,), bad))
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        llm_speed.flash_attention_varlen(*_packed(), CU, CU, 7, 7, alibi_slopes=torch.full((4,), bad))


@pytest.mark.parametrize("bad", [float("nan"), 0.0, -1.0, float("inf")])
def test_fp8_gemm_scales_must_be_finite_and_positive(bad):
    a, scale_a = llm_speed.quantize_fp8(torch.randn(8, 16))
    b, scale_b = llm_speed.quantize_fp8(torch.randn(12, 16))
    with pytest.raises(ValueError, match="scale_a must be finite and > 0"):
        llm_speed.gemm_fp8(a, b, torch.tensor(bad), scale_b, trans_b=True)
    np = pytest.importorskip("numpy", reason="numpy flags need numpy")
    out = llm_speed.gemm_fp8(a, b, scale_a, scale_b, trans_b=np.bool_(True))  # a NumPy flag, as elsewhere
    assert out.shape == (8, 12)


def test_quantize_fp8_refuses_an_infinite_input():
    with pytest.raises(ValueError, match=r"x must be finite \(its amax sets the scale\), got inf"):
        llm_speed.quantize_fp8(torch.tensor([[1.0, float("inf")], [2.0, 3.0]]))


def test_router_logits_must_rank_every_row():
    logits = torch.randn(3, 8)
    logits[0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"router_logits must not hold NaN or \+inf .*, got nan"):
        llm_speed.moe_route(logits, 2)
    logits[0, 3] = float("-inf")  # masks expert 3 out of row 0: allowed
    weights, ids = llm_speed.moe_route(logits, 2)
    assert 3 not in ids[0].tolist() and torch.isfinite(weights).all()
    logits[1] = float("-inf")
    with pytest.raises(ValueError, match="router_logits row 1 is -inf for every expert"):
        llm_speed.moe_route(logits, 2)
