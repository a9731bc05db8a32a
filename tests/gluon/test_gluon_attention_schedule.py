"""The schedule planned for the Gluon forward attention (issue 73, stage 1), modelled in PyTorch
(:mod:`llm_speed.gluon.attention_schedule`), against float64: K/V rings filled by a producer, two consumer
warpgroups in ping-pong, the next QK^T issued before this block's softmax, exp2 with the scale folded in,
a persistent grid in longest-first causal order; ragged lengths both ways, GQA, head dims 64 / 128 / 256
(each with the kernel's own plan), fp16 and bf16, rows that see no key; and the protocol checks failing where the barriers are broken."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from accuracy_rule import ERROR_CAP, OUTPUT_FACTOR, assert_error_rule, max_error
from llm_speed.attention.reference import reference_attention
from llm_speed.core.hardware import Hardware
from llm_speed.gluon import attention, protocol
from llm_speed.gluon import attention_schedule as model

SMALL = model.Schedule(block_m=64, block_n=32, stages=2, programs=5, section=2)


def _inputs(batch, heads, heads_kv, seq_q, seq_kv, head_dim, dtype, positive=False):
    draw = torch.rand if positive else torch.randn
    q = draw(batch, heads, seq_q, head_dim, dtype=torch.float64).to(dtype)
    k, v = (draw(batch, heads_kv, seq_kv, head_dim, dtype=torch.float64).to(dtype) for _ in range(2))
    return q, k, v


def _check(q, k, v, is_causal, schedule, seed=0):
    out, lse = model.forward(q, k, v, is_causal=is_causal, schedule=schedule, seed=seed)
    truth, truth_lse = reference_attention(q.double(), k.double(), v.double(), is_causal=is_causal,
                                           return_lse=True)  # fmt: skip
    assert not out.isnan().any() and not lse.isnan().any(), "an output row no program wrote"
    same_precision = reference_attention(q, k, v, is_causal=is_causal)
    assert_error_rule("attention schedule", out, same_precision, truth, OUTPUT_FACTOR, q.dtype)
    assert max_error(lse, truth_lse) <= 1e-4 * max(1.0, truth_lse.nan_to_num(0, 0, 0).abs().max().item())
    return out, lse


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("seq_q", "seq_kv"), [(1, 1), (17, 129), (129, 17), (113, 127), (200, 200)])
def test_ragged_lengths_both_ways(seq_q, seq_kv, is_causal):
    _check(*_inputs(1, 4, 2, seq_q, seq_kv, 64, torch.bfloat16), is_causal, SMALL)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("head_dim", "heads_kv"), [(64, 1), (128, 4), (256, 2)])
def test_head_dims_gqa_and_dtypes(head_dim, heads_kv, dtype):
    _check(*_inputs(2, 4, heads_kv, 96, 80, head_dim, dtype), True, SMALL)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_the_kernels_plan_and_positive_inputs(head_dim):
    # the kernel's own plan (128 query rows, 64 per warpgroup; 128 keys at d = 64, 64 at d = 128 and 256;
    # two ring slots), its grid cut to 3 programs so that each runs several work items
    plan = attention._plan(1, 2, 1, 300, 260, head_dim, torch.bfloat16, True, Hardware.from_spec("h100-sxm"))
    planned = dataclasses.replace(model.from_plan(plan), programs=3)
    _check(*_inputs(1, 2, 1, 300, 260, head_dim, torch.bfloat16, positive=True), True, planned)
    _check(*_inputs(1, 2, 2, 300, 260, head_dim, torch.float16), False, planned, seed=1)


def test_rows_that_see_no_key_give_zero_and_minus_infinity():
    out, lse = _check(*_inputs(1, 2, 1, 70, 20, 64, torch.bfloat16), True, SMALL)
    assert torch.equal(out[:, :, :50], torch.zeros_like(out[:, :, :50]))  # query i sees keys <= i - 50
    assert torch.isinf(lse[:, :, :50]).all() and (lse[:, :, :50] < 0).all()
    assert torch.isfinite(lse[:, :, 50:]).all()


@pytest.mark.parametrize("seed", range(3))
def test_interleavings_do_not_change_the_result(seed):
    q, k, v = _inputs(1, 2, 1, 100, 100, 64, torch.bfloat16)
    first = model.forward(q, k, v, is_causal=True, schedule=SMALL, seed=0)
    again = model.forward(q, k, v, is_causal=True, schedule=SMALL, seed=seed)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))


@pytest.mark.parametrize(("n_blocks", "pairs", "section"), [(5, 7, 2), (8, 3, 8), (1, 9, 4), (4, 1, 8)])
def test_work_items_each_once_longest_first(n_blocks, pairs, section):
    everything = sorted((b, p) for b in range(n_blocks) for p in range(pairs))
    for longest_first in (False, True):
        items = model.work_items(n_blocks, pairs, longest_first=longest_first, section=section)
        assert sorted(items) == everything
    rows = model.work_items(n_blocks, pairs, longest_first=False, section=section)
    assert rows[:n_blocks] == [(b, 0) for b in range(n_blocks)]  # a pair's blocks adjacent, in row order
    items = model.work_items(n_blocks, pairs, longest_first=True, section=section)
    per_section = section * n_blocks
    for start in range(0, len(items), per_section):  # inside a section: the heaviest (last) block first
        blocks = [b for b, _ in items[start : start + per_section]]
        assert blocks == sorted(blocks, reverse=True)


def test_causal_key_blocks():
    # 128-row query blocks over 128-key blocks, seq_q == seq_kv: block i reads i + 1 key blocks
    assert [model.key_blocks(i, 128, 128, 512, 512, True) for i in range(4)] == [1, 2, 3, 4]
    assert [model.key_blocks(i, 128, 128, 512, 512, False) for i in range(4)] == [4] * 4
    assert model.key_blocks(0, 64, 32, 70, 20, True) == 1  # rows 50..63 see the first 14 keys
    assert model.key_blocks(0, 32, 32, 70, 20, True) == 0  # rows 0..31: no key


def test_a_broken_protocol_is_caught(monkeypatch):
    q, k, v = _inputs(1, 2, 1, 64, 160, 64, torch.float16)

    def never_blocks(barrier, parity):  # no partition waits: the producer overruns the rings
        yield True

    with monkeypatch.context() as patch:
        patch.setattr(protocol, "wait", never_blocks)
        with pytest.raises(protocol.ScheduleError, match="read [KV] slot"):
            model.forward(q, k, v, schedule=SMALL)
    with monkeypatch.context() as patch:  # no arrival completes a phase: every partition waits forever
        patch.setattr(protocol.Barrier, "arrive", lambda self: None)
        with pytest.raises(protocol.ScheduleError, match="a hang"):
            model.forward(q, k, v, schedule=SMALL)


def test_the_exponent_is_base_2_with_the_scale_folded_in():
    # a scale other than 1/sqrt(d) reaches the model through the one folded multiply
    q, k, v = _inputs(1, 1, 1, 40, 40, 64, torch.bfloat16)
    out, lse = model.forward(q, k, v, scale=0.3, schedule=SMALL)
    truth, truth_lse = reference_attention(q.double(), k.double(), v.double(), scale=0.3, return_lse=True)
    assert max_error(out, truth) <= 4 * ERROR_CAP[torch.bfloat16]
    assert max_error(lse, truth_lse) <= 1e-4 * max(1.0, truth_lse.abs().max().item())
    assert math.isclose(model.LOG2E * model.LN2, 1.0)
