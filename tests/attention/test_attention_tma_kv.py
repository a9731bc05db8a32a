"""The dense 16-bit forward's interior loop loads K and V through tensor descriptors (TMA, ``TMA_KV``) where
their layout allows, and keeps its pointer loads elsewhere: the descriptors' output equals the pointer
loads' bit for bit, under the 2x/3x rule, and layouts a descriptor cannot read take the pointer loads."""

from __future__ import annotations

import pytest
import torch
from attention_testing import (
    FORWARD_KERNELS,
    check_against_reference,
    expect_launches,
    forward_with_choice,
    fresh_plans,
    make_qkv,
    seq_major,
)

from llm_speed import flash_attention
from llm_speed.attention import launcher
from llm_speed.attention.options import MaskKey
from llm_speed.core import launch
from llm_speed.core.policy import current_policy, use_policy


@pytest.fixture(autouse=True)
def _tma_kv_loads(policy):
    """The launch choice these tests are about, unproven on a GPU and so off as shipped: selected here."""
    policy(forward_tma_kv_head_dims=(128, 256))


def _plan(q, k, v, is_causal=False):
    key = launcher.dense_plan_key(q, k, v, MaskKey(is_causal), False)
    return launcher.forward_plan(*key, aligned=launch.tma_aligned(k, v), lse=True, policy=current_policy())


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_interior_loads_by_descriptor_keep_the_rule(device, monkeypatch, dtype, is_causal):
    fresh_plans(monkeypatch)
    # 2 sequences, 2 query heads on 1 KV head, 256 queries on 384 keys at d = 128 (128-key blocks): whole
    # interior blocks for every query block without a mask, and for the second with a causal one.
    q, k, v = make_qkv(2, 2, 1, 256, 384, 128, dtype, device)
    assert _plan(q, k, v, is_causal).descriptors.keys() == {"K_DESC", "V_DESC"}
    with expect_launches(*FORWARD_KERNELS, device=device):
        check_against_reference(flash_attention, q, k, v, is_causal=is_causal, grads=False)


@pytest.mark.parametrize("is_causal", [False, True])
def test_descriptor_loads_equal_pointer_loads(device, is_causal):
    q, k, v = make_qkv(1, 2, 2, 128, 384, 128, torch.float16, device)
    with_tma, without = forward_with_choice(q, k, v, is_causal, forward_tma_kv_head_dims=())
    with use_policy(forward_tma_kv_head_dims=()):
        assert not _plan(q, k, v, is_causal).descriptors
    for got, expected in zip(with_tma, without, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)



@pytest.mark.parametrize("is_causal", [False, True])
def test_sequence_major_descriptors_equal_pointer_loads(device, is_causal):
    """[B, S, H, D] K and V (and a packed QKV's slices, rows 3 H D long) take descriptors over their
    [B * S, H * D] rows, each head a block of columns (DESC_SEQ_MAJOR): the output equals the pointer
    loads' bit for bit."""
    q, k, v = make_qkv(2, 4, 2, 128, 256, 128, torch.float16, device)
    # a fused projection's [B, S, (4 + 2 + 2) * 128] output, split into q, k and v heads
    fused = torch.randn(2, 256, 8 * 128, dtype=torch.float16, device=device)
    packed = [fused[..., a * 128 : b * 128].view(2, 256, b - a, 128).transpose(1, 2)
              for a, b in ((0, 4), (4, 6), (6, 8))]  # fmt: skip
    for q_, k_, v_ in ((q, *map(seq_major, (k, v))), packed):
        with_tma, without = forward_with_choice(q_, k_, v_, is_causal, forward_tma_kv_head_dims=())
        plan = _plan(q_, k_, v_, is_causal)
        assert plan.descriptors.keys() == {"K_DESC", "V_DESC"} and plan.fixed["DESC_SEQ_MAJOR"]
        for got, expected in zip(with_tma, without, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with expect_launches(*FORWARD_KERNELS, device=device):
        check_against_reference(flash_attention, *packed, is_causal=is_causal, grads=False)


def test_layouts_a_descriptor_cannot_read_keep_pointer_loads(device, monkeypatch):
    fresh_plans(monkeypatch)
    q, k, v = make_qkv(1, 2, 2, 128, 256, 128, torch.float16, device)
    # K head-major, V sequence-major: one kind of descriptor origin per kernel
    k_s, v_s = (seq_major(t) for t in (k, v))
    assert not _plan(q, k, v_s).descriptors
    # a sequence-major padded head dim (96 of 128): a block's columns would reach the next head
    q96, k96, v96 = (seq_major(t) for t in make_qkv(1, 2, 2, 128, 256, 96, torch.float16, device))
    assert not _plan(q96, k96, v96).descriptors
    # a base address 2 bytes past a 16-byte boundary
    k_off = torch.empty(k.numel() + 1, dtype=k.dtype, device=device)[1:].view(k.shape).copy_(k)
    assert not launch.tma_aligned(k_off, v) and not _plan(q, k_off, v).descriptors
    # d = 64, dropout and ALiBi: no gain or more spills in the report (the candidate's head dims)
    q64, k64, v64 = make_qkv(1, 2, 2, 128, 256, 64, torch.float16, device)
    assert not _plan(q64, k64, v64).descriptors
    key = launcher.dense_plan_key(q, k, v, MaskKey(True, alibi=1, dropout=True), False)
    assert not launcher.forward_plan(*key, aligned=True, lse=True, policy=current_policy()).descriptors
    expected = flash_attention(q, k, v)
    for k_other, v_other in ((k_s, v_s), (k, v_s), (k_off, v)):
        torch.testing.assert_close(flash_attention(q, k_other, v_other), expected, rtol=0, atol=0)
