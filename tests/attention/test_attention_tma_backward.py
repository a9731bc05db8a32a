"""The dense 16-bit backward at d = 128 loads its streamed tiles through tensor descriptors (TMA) where their
layout allows: Q and dO in the dK/dV kernel, K and V in the dQ kernel (``flash.TMA_BACKWARD_HEAD_DIMS``);
elsewhere the pointer loads. The descriptors' gradients equal the pointer loads' bit for bit and meet the
float64 rule; layouts a descriptor cannot read keep the pointer loads."""

from __future__ import annotations

import functools

import pytest
import torch
from attention_testing import (
    BACKWARD_KERNELS,
    check_against_reference,
    expect_launches,
    fresh_plans,
    make_qkv,
)

from llm_speed import flash_attention, flash_attention_varlen
from llm_speed.attention import flash


def _record_plans(monkeypatch) -> list:
    """The (preprocess, dK/dV, dQ) plans of every backward launched from here on."""
    made = []
    launch_backward = flash._launch_backward

    def spy(plans, *args, **kwargs):
        made.append(plans)
        return launch_backward(plans, *args, **kwargs)

    monkeypatch.setattr(flash, "_launch_backward", spy)
    return made


def _descriptors(plans) -> tuple[set, set]:
    """(the dK/dV plan's descriptor parameters, the dQ plan's)."""
    return set(plans[1].descriptors), set(plans[2].descriptors)


def _gradients(q, k, v, **kwargs) -> tuple:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))  # (views: the same addresses)
    out = flash_attention(q, k, v, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out))
    return q.grad, k.grad, v.grad


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backward_loads_by_descriptor_keep_the_rule(device, monkeypatch, dtype, is_causal):
    fresh_plans(monkeypatch)
    made = _record_plans(monkeypatch)
    # 2 sequences, 2 query heads on 1 KV head, 256 queries on 384 keys: whole blocks everywhere
    q, k, v = make_qkv(2, 2, 1, 256, 384, 128, dtype, device)
    with expect_launches(*BACKWARD_KERNELS, device=device):
        check_against_reference(
            functools.partial(flash_attention, deterministic=True), q, k, v, is_causal=is_causal
        )
    assert made and _descriptors(made[-1]) == ({"Q_DESC", "DO_DESC"}, {"K_DESC", "V_DESC"})


@pytest.mark.parametrize("is_causal", [False, True])
def test_descriptor_loads_equal_pointer_loads(device, monkeypatch, is_causal):
    """Ragged sequences (200 queries, 333 keys: neither a whole number of blocks) take the descriptors in the
    interior loops and the pointer loads at the ragged edges; the gradients equal the pointer path's."""
    made = _record_plans(monkeypatch)
    q, k, v = make_qkv(1, 2, 2, 200, 333, 128, torch.float16, device)
    fresh_plans(monkeypatch)
    with_tma = _gradients(q, k, v, is_causal=is_causal, deterministic=True)
    assert _descriptors(made[-1]) == ({"Q_DESC", "DO_DESC"}, {"K_DESC", "V_DESC"})
    fresh_plans(monkeypatch)
    monkeypatch.setattr(flash, "TMA_BACKWARD_HEAD_DIMS", ())
    without = _gradients(q, k, v, is_causal=is_causal, deterministic=True)
    assert _descriptors(made[-1]) == (set(), set())
    for got, expected in zip(with_tma, without, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_layouts_a_descriptor_cannot_read_keep_pointer_loads(device, monkeypatch):
    fresh_plans(monkeypatch)
    made = _record_plans(monkeypatch)
    q, k, v = make_qkv(1, 2, 2, 128, 256, 128, torch.float16, device)
    expected = _gradients(q, k, v, deterministic=True)
    assert _descriptors(made[-1]) == ({"Q_DESC", "DO_DESC"}, {"K_DESC", "V_DESC"})
    # sequence-major Q ([B, S, H, D] viewed as [B, H, S, D]): a query block is not a run of rows; K and V
    # are, so the dQ kernel keeps its descriptors
    q_s = q.transpose(1, 2).contiguous().transpose(1, 2)
    torch.testing.assert_close(_gradients(q_s, k, v, deterministic=True), expected, rtol=0, atol=0)
    assert _descriptors(made[-1]) == (set(), {"K_DESC", "V_DESC"})
    # a K 2 bytes past a 16-byte boundary: no descriptor for either kernel (one alignment key per call)
    k_off = torch.empty(k.numel() + 1, dtype=k.dtype, device=device)[1:].view(k.shape).copy_(k)
    torch.testing.assert_close(_gradients(q, k_off, v, deterministic=True), expected, rtol=0, atol=0)
    assert _descriptors(made[-1]) == (set(), set())
    # d = 64: no gain in the report
    _gradients(*make_qkv(1, 2, 2, 128, 256, 64, torch.float16, device), deterministic=True)
    assert _descriptors(made[-1]) == (set(), set())
    # ALiBi: the dK/dV kernel keeps its descriptors, the dQ kernel takes pointer loads (the report: with
    # dropout too, 9 spill instructions in its loops)
    slopes = torch.tensor([0.5, 0.25], device=device)
    _gradients(q, k, v, is_causal=True, alibi_slopes=slopes, deterministic=True)
    assert _descriptors(made[-1]) == ({"Q_DESC", "DO_DESC"}, set())


def test_packed_sequences_keep_pointer_loads(device, monkeypatch):
    fresh_plans(monkeypatch)
    made = _record_plans(monkeypatch)
    q, k, v = (torch.randn(256, 2, 128, dtype=torch.float16, device=device).requires_grad_() for _ in "qkv")
    cu = torch.tensor([0, 128, 256], dtype=torch.int32, device=device)
    flash_attention_varlen(q, k, v, cu, cu, 128, 128, deterministic=True).sum().backward()
    assert made and _descriptors(made[-1]) == (set(), set())
