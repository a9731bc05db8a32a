"""The overlapped forward (``OVERLAP``: the next key block's QK^T issued before this block's softmax,
``forward_kernels._accumulate_overlapped``): where the plan turns it on, that its peeled first block,
pipelined loop and peeled last two blocks add up for every count of interior blocks (0 to 7, with and without
a causal mask, GQA, softcap, ALiBi, a two-sided window, packed sequences) under the 2x/3x rule, and that it
computes what the one-product loop computes."""

from __future__ import annotations

import pytest
import torch
from attention_testing import (
    FORWARD_KERNELS,
    assert_error_rule,
    check_against_reference,
    expect_launches,
    forward_with_choice,
    fresh_plans,
    make_qkv,
)

from llm_speed import flash_attention
from llm_speed.attention import flash, flash_attention_varlen, launcher
from llm_speed.attention.options import MaskKey
from llm_speed.attention.reference import reference_attention
from llm_speed.core import launch
from llm_speed.core.gpus import get_gpu
from llm_speed.core.hardware import Hardware, hardware_of
from llm_speed.core.policy import current_policy, use_policy


@pytest.fixture(autouse=True)
def _overlap(policy):
    """The launch choice these tests are about, unproven on a GPU and so off as shipped: selected here (with
    the TMA K/V loads the overlapped loop was built beside)."""
    policy("forward-overlap-tma-kv")


def _reference(q, k, v, dtype, **options):
    """The PyTorch reference on the CPU in ``dtype`` (float64: the truth; q's dtype: the same precision)."""
    return reference_attention(*(t.detach().cpu().to(dtype) for t in (q, k, v)), **options)


def _plan(q, k, v, is_causal=False, alibi=0, dropout=False, two_pass=False):
    key = launcher.dense_plan_key(q, k, v, MaskKey(is_causal, alibi=alibi, dropout=dropout), False, two_pass)
    return launcher.forward_plan(*key, aligned=launch.tma_aligned(k, v), lse=True, policy=current_policy())


def test_the_plan_overlaps_16_bit_d128_on_hopper_only(device, monkeypatch):
    fresh_plans(monkeypatch)
    q, k, v = make_qkv(1, 2, 2, 128, 256, 128, torch.float16, device)
    hopper = hardware_of(device).has_tma
    assert _plan(q, k, v).fixed["OVERLAP"] is hopper
    assert _plan(q, k, v, is_causal=True, alibi=1).fixed["OVERLAP"] is hopper
    # off: the tiled forward, dropout, float32, d = 64 (two 8-warp blocks per SM without it) and d = 256
    assert _plan(q, k, v, two_pass=True).fixed["OVERLAP"] is False
    assert _plan(q, k, v, dropout=True).fixed["OVERLAP"] is False
    assert _plan(*(t.float() for t in (q, k, v))).fixed["OVERLAP"] is False
    for head_dim in (64, 256):
        assert _plan(*make_qkv(1, 2, 2, 128, 256, head_dim, torch.float16, device)).fixed["OVERLAP"] is False
    with use_policy(forward_overlap_head_dims=()):
        assert _plan(q, k, v).fixed["OVERLAP"] is False


def test_hardware_below_hopper_does_not_overlap():
    l4 = Hardware.from_spec(get_gpu("l4"))
    cfg = flash.attention_config("forward", 128, torch.float16, l4)
    assert not l4.has_tma and cfg.block_m >= 128  # the tile alone would allow it: the capability decides


@pytest.fixture
def overlapping(device, monkeypatch):
    fresh_plans(monkeypatch)
    if not hardware_of(device).has_tma:
        pytest.skip("the device's tier does not overlap (below Hopper)")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 7])
def test_every_count_of_interior_blocks_keeps_the_rule(device, overlapping, dtype, blocks):
    # 128 queries on 64 * blocks keys (64-key blocks at d = 128): every block is an interior one, so the
    # peeled first block, the loop (blocks - 3 iterations) and the peeled tail each run or not.
    q, k, v = make_qkv(1, 2, 1, 128, 64 * blocks, 128, dtype, device)
    assert _plan(q, k, v).fixed["OVERLAP"]
    with expect_launches(*FORWARD_KERNELS, device=device):
        check_against_reference(flash_attention, q, k, v, is_causal=False, grads=False)


@pytest.mark.parametrize("seq", [128, 320, 512])
def test_causal_query_blocks_with_0_to_7_interior_blocks(device, overlapping, seq):
    # Causal at 128-row query blocks: query block i has 2i interior 64-key blocks and a masked diagonal;
    # seq 320 ends in a ragged query block and a ragged key block. GQA: 4 query heads on 2 KV heads.
    q, k, v = make_qkv(2, 4, 2, seq, seq, 128, torch.float16, device)
    with expect_launches(*FORWARD_KERNELS, device=device):
        check_against_reference(flash_attention, q, k, v, is_causal=True)


@pytest.mark.parametrize(
    "options",
    [dict(softcap=30.0), dict(alibi=True), dict(window=(200, 100)), dict(softcap=5.0, window=(150, 0))],
    ids=["softcap", "alibi", "window", "softcap-window"],
)
def test_softcap_alibi_and_windows_keep_the_rule(device, overlapping, options):
    q, k, v = make_qkv(1, 2, 2, 256, 448, 128, torch.bfloat16, device, scale_q=2.0)
    extra = dict(options)
    if extra.pop("alibi", False):
        extra["alibi_slopes"] = torch.tensor([0.25, 0.0625], device=device)
    got = flash_attention(q, k, v, return_lse=True, **extra)
    if "alibi_slopes" in extra:
        extra_cpu = dict(extra, alibi_slopes=extra["alibi_slopes"].cpu())
    else:
        extra_cpu = extra
    truth = _reference(q, k, v, torch.float64, return_lse=True, **extra_cpu)
    same = _reference(q, k, v, q.dtype, return_lse=True, **extra_cpu)
    for name, value, expected, exact in zip(("out", "lse"), got, same, truth, strict=True):
        assert_error_rule(name, value.cpu(), expected, exact, 2.0, q.dtype)


def test_packed_sequences_overlap_too(device, overlapping):
    lengths = [130, 64, 400]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, 2, 128, dtype=torch.float16, device=device) for _ in range(3))
    out = flash_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True)
    for b in range(len(lengths)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        one = [t[rows].transpose(0, 1)[None] for t in (q, k, v)]
        truth = _reference(*one, torch.float64, is_causal=True)
        same = _reference(*one, q.dtype, is_causal=True)
        assert_error_rule(f"out[{b}]", out[rows].transpose(0, 1)[None].cpu(), same, truth, 2.0, q.dtype)


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_overlapped_loop_computes_what_the_one_product_loop_computes(device, is_causal):
    q, k, v = make_qkv(1, 2, 2, 256, 512, 128, torch.float16, device)
    overlapped, one_product = forward_with_choice(q, k, v, is_causal, forward_overlap_head_dims=())
    with use_policy(forward_overlap_head_dims=()):
        assert not _plan(q, k, v).fixed["OVERLAP"]
    # the same maths in another order of float32 sums (P V in two halves of keys): close, not bitwise
    for got, expected in zip(overlapped, one_product, strict=True):
        torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
