"""llm_speed.flash_attn_interface refuses bad input as flash-attn's caller wrote it: flash-attn's argument
names (``causal``, ``softmax_scale``, ``return_attn_probs``, ``return_softmax_lse``, not llm-speed's), its
layout ``[batch, seq, heads, head_dim]`` and the shapes as given, before any tensor is transposed or any
kernel runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llm_speed import flash_attn_interface as fa

Q = torch.randn(1, 8, 4, 16)
K, V = torch.randn(1, 8, 2, 16), torch.randn(1, 8, 2, 16)
KV = torch.stack((K, V), dim=2)  # [1, 8, 2, 2, 16]
QKV = torch.randn(1, 8, 3, 2, 16)
CU = torch.tensor([0, 3, 8], dtype=torch.int32)
CACHE = torch.randn(1, 16, 2, 16)
FLAG = r"must be a bool \(True or False\) or a numpy.bool_, got str 'yes'"

# each drop-in function on valid inputs, called with extra keywords
CALLS = {
    "flash_attn_func": lambda **kw: fa.flash_attn_func(Q, K, V, **kw),
    "flash_attn_kvpacked_func": lambda **kw: fa.flash_attn_kvpacked_func(Q, KV, **kw),
    "flash_attn_qkvpacked_func": lambda **kw: fa.flash_attn_qkvpacked_func(QKV, **kw),
    "flash_attn_varlen_func": lambda **kw: fa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 5, 5, **kw),
    "flash_attn_varlen_kvpacked_func": lambda **kw: fa.flash_attn_varlen_kvpacked_func(
        Q[0], KV[0], CU, CU, 5, 5, **kw
    ),
    "flash_attn_varlen_qkvpacked_func": lambda **kw: fa.flash_attn_varlen_qkvpacked_func(QKV[0], CU, 5, **kw),
}


@pytest.fixture
def no_kernel(monkeypatch):
    """The llm-speed entry points behind the drop-in fail the test if a refused call reaches them."""

    def reached(*args, **kwargs):
        raise AssertionError("a refused call reached llm-speed's entry point")

    for name in ("flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache"):
        monkeypatch.setattr(fa, name, reached)


@pytest.mark.parametrize("function", list(CALLS))
@pytest.mark.parametrize(
    "keywords, error, match",
    [
        (dict(causal="yes"), TypeError, f"^causal {FLAG}"),
        (dict(return_attn_probs="yes"), TypeError, f"^return_attn_probs {FLAG}"),
        (dict(softmax_scale=float("nan")), ValueError, "^softmax_scale must be finite, got nan"),
        (dict(softmax_scale="0.5"), TypeError, "^softmax_scale must be a real number, got str"),
    ],
    ids=["causal", "return_attn_probs", "softmax_scale-nan", "softmax_scale-str"],
)
def test_options_are_named_as_flash_attn_names_them(function, keywords, error, match, no_kernel):
    with pytest.raises(error, match=match):
        CALLS[function](**keywords)


@pytest.mark.parametrize(
    "keywords, error, match",
    [
        (dict(causal="yes"), TypeError, f"^causal {FLAG}"),
        (dict(return_softmax_lse="yes"), TypeError, f"^return_softmax_lse {FLAG}"),
        (dict(softmax_scale=float("inf")), ValueError, "^softmax_scale must be finite, got inf"),
    ],
    ids=["causal", "return_softmax_lse", "softmax_scale"],
)
def test_kvcache_options_are_named_as_flash_attn_names_them(keywords, error, match, no_kernel):
    with pytest.raises(error, match=match):
        fa.flash_attn_with_kvcache(Q[:, :1], CACHE, CACHE, cache_seqlens=8, **keywords)


LAYOUT_Q = r"\[batch, seq_q, heads_q, head_dim\] \(flash-attn's layout\)"


@pytest.mark.parametrize("packed", [False, True], ids=["flash_attn_func", "flash_attn_kvpacked_func"])
@pytest.mark.parametrize(
    "q, error, match",
    [
        (Q[0, 0], ValueError, rf"q must have 4 dims {LAYOUT_Q}, got shape \(4, 16\)"),
        (Q[0], ValueError, rf"q must have 4 dims {LAYOUT_Q}, got shape \(8, 4, 16\)"),
        (Q.numpy(), TypeError, rf"q must be a torch.Tensor {LAYOUT_Q}, got numpy.ndarray"),
        (Q.tolist(), TypeError, rf"q must be a torch.Tensor {LAYOUT_Q}, got list"),
        (None, TypeError, rf"q must be a torch.Tensor {LAYOUT_Q}, got NoneType"),
    ],
    ids=["2-D", "3-D", "numpy", "list", "None"],
)
def test_q_is_checked_in_flash_attn_layout_before_it_is_transposed(packed, q, error, match, no_kernel):
    with pytest.raises(error, match=match):
        fa.flash_attn_kvpacked_func(q, KV) if packed else fa.flash_attn_func(q, K, V)


def test_k_and_v_shapes_are_reported_as_given(no_kernel):
    layout = r"\[batch, seq_k, heads_k, head_dim\] \(flash-attn's layout\)"
    shapes = r"got k \(1, 8, 2, 16\), v \(1, 7, 2, 16\)"
    with pytest.raises(ValueError, match=rf"k and v must have the same shape {layout}, {shapes}"):
        fa.flash_attn_func(Q, K, V[:, :7])
    with pytest.raises(ValueError, match=r"k must have 4 dims \[batch, seq_k, heads_k, head_dim\]"):
        fa.flash_attn_func(Q, K[0], V)


def test_numpy_flags_and_scales_are_the_python_ones():
    """What the shared checkers accept (NumPy bools and reals) gives the same call as Python's values."""
    expected = fa.flash_attn_func(Q, K, V, softmax_scale=0.3, causal=True)
    got = fa.flash_attn_func(Q, K, V, softmax_scale=np.float32(0.3), causal=np.bool_(True))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    out, lse, probs = fa.flash_attn_func(Q, K, V, causal=True, return_attn_probs=np.bool_(True))
    torch.testing.assert_close(out, fa.flash_attn_func(Q, K, V, causal=True), rtol=0, atol=0)
    assert lse.shape == (1, 4, 8) and probs is None
    expected = fa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 5, 5, causal=True)
    got = fa.flash_attn_varlen_func(Q[0], K[0], V[0], CU, CU, 5, 5, causal=np.bool_(True))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    out, lse = fa.flash_attn_with_kvcache(Q[:, :1], CACHE, CACHE, cache_seqlens=8,
                                          return_softmax_lse=np.bool_(True))  # fmt: skip
    assert out.shape == (1, 1, 4, 16) and lse.shape == (1, 4, 1)


@pytest.mark.parametrize("cache_seqlens", [None, 20], ids=["no-cache_seqlens", "cache_seqlens"])
def test_a_block_table_that_is_no_tensor_is_refused_with_or_without_cache_seqlens(cache_seqlens):
    pages = torch.randn(4, 16, 2, 16)
    with pytest.raises(TypeError, match="^block_table must be a torch.Tensor, got list"):
        fa.flash_attn_with_kvcache(torch.randn(2, 1, 4, 16), pages, pages, cache_seqlens=cache_seqlens,
                                   block_table=[[0, 1], [2, 3]])  # fmt: skip


def test_a_block_table_of_the_wrong_rank_is_refused_without_cache_seqlens():
    pages = torch.randn(4, 16, 2, 16)
    with pytest.raises(ValueError, match=r"^block_table must be \[batch, max_pages\], got shape \(2,\)"):
        fa.flash_attn_with_kvcache(torch.randn(2, 1, 4, 16), pages, pages,
                                   block_table=torch.tensor([0, 1], dtype=torch.int32))  # fmt: skip
