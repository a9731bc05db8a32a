"""The schedule planned for the Gluon forward attention (issue 73, stage 1), modelled in PyTorch
(:mod:`llm_speed.gluon.attention_schedule`), against float64: K/V rings filled by a producer, two consumer
warpgroups in ping-pong, the next QK^T issued before this block's softmax, exp2 with the scale folded in,
a persistent grid in longest-first causal order; ragged lengths both ways, GQA, head dims 64 / 128 / 256
(each with the kernel's own plan), fp16 and bf16, rows that see no key; fp8 (e4m3 with descales, V^T
tiles, P rounded to e4m3 at 2**8) against float64 over the dequantized inputs, under the 2x rule against
the fp8 reference; and the protocol checks failing where the barriers are broken."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from accuracy_rule import ERROR_CAP, OUTPUT_FACTOR, assert_error_rule, max_error
from llm_speed.attention.reference import (
    dequantize_attention_inputs,
    descale_rows,
    reference_attention,
    reference_forward,
)
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
    # the kernel's own plans (128 query rows, 64 per warpgroup; 128 keys at d = 64 and at d = 128 without a
    # causal mask, else 64; two ring slots; the split masking, or none over whole blocks), each grid cut to 3
    # programs so that each runs several work items
    h100 = Hardware.from_spec("h100-sxm")

    def planned(heads_kv, seq_kv, is_causal):
        plan = attention._plan(1, 2, heads_kv, 300, seq_kv, head_dim, torch.bfloat16, is_causal, h100)
        return dataclasses.replace(model.from_plan(plan), programs=3)

    _check(*_inputs(1, 2, 1, 300, 260, head_dim, torch.bfloat16, positive=True), True, planned(1, 260, True))
    _check(*_inputs(1, 2, 2, 300, 260, head_dim, torch.float16), False, planned(2, 260, False), seed=1)
    whole = planned(2, 256, False)  # 256 keys: whole blocks, nothing masked
    blocks = 256 // whole.block_n
    assert whole.split_mask and model.first_masked_block(0, whole.block_n, 300, 256, False) == blocks
    _check(*_inputs(1, 2, 2, 300, 256, head_dim, torch.float16), False, whole, seed=2)


def test_rows_that_see_no_key_give_zero_and_minus_infinity():
    out, lse = _check(*_inputs(1, 2, 1, 70, 20, 64, torch.bfloat16), True, SMALL)
    assert torch.equal(out[:, :, :50], torch.zeros_like(out[:, :, :50]))  # query i sees keys <= i - 50
    assert torch.isinf(lse[:, :, :50]).all() and (lse[:, :, :50] < 0).all()
    assert torch.isfinite(lse[:, :, 50:]).all()


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_neighbouring_heads_non_finite_values_stay_out(is_causal):
    # head 0's partial query and key blocks (100 rows of 64 x 2 and 32 x 4) read zeros past its end, as the
    # kernel's 3-D descriptors do: its next head's inf and NaN never meet a zero weight (0 x inf = NaN)
    q, k, v = _inputs(1, 2, 2, 100, 100, 64, torch.bfloat16)
    alone = model.forward(q[:, :1], k[:, :1], v[:, :1], is_causal=is_causal, schedule=SMALL)
    q[:, 1], k[:, 1], v[:, 1] = math.nan, math.inf, math.inf
    mixed = model.forward(q, k, v, is_causal=is_causal, schedule=SMALL)
    for got, want in zip(mixed, alone, strict=True):
        assert torch.equal(got[:, :1], want)


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


def _needs_mask(j, block_n, first_row, seq_q, seq_kv, is_causal):
    last_seen = first_row + seq_kv - seq_q if is_causal else seq_kv - 1
    return any(key >= seq_kv or key > last_seen for key in range(j * block_n, (j + 1) * block_n))


@pytest.mark.parametrize("is_causal", [False, True])
def test_only_the_blocks_that_need_a_mask_are_masked(is_causal):
    # against brute force: every block before first_masked_block is whole and visible to the warpgroup's
    # first row (so to all its rows), and the block it names needs the mask
    for seq_q, seq_kv, block_n in [(129, 17, 32), (300, 260, 64), (260, 300, 64), (1, 129, 128),
                                   (512, 512, 128), (200, 200, 64), (64, 64, 64)]:  # fmt: skip
        blocks = -(-seq_kv // block_n)
        for first_row in range(0, seq_q, 16):
            first = model.first_masked_block(first_row, block_n, seq_q, seq_kv, is_causal)
            case = (block_n, first_row, seq_q, seq_kv, is_causal)
            assert not any(_needs_mask(j, *case) for j in range(min(first, blocks))), case
            assert first >= blocks or _needs_mask(first, *case), (case, first)


def test_an_arrival_then_a_wait_in_one_step_is_progress():
    # an agent that arrives and blocks in one step (a consumer freeing Q, then waiting on the next item's)
    # has made progress: the other agent passes that barrier next; no hang is reported
    import random

    done, freed = protocol.Barrier(), protocol.Barrier()

    def first():
        done.arrive()
        yield from protocol.wait(freed, 0)

    def second():
        yield from protocol.wait(done, 0)
        freed.arrive()
        yield True

    for seed in range(20):
        done, freed = protocol.Barrier(), protocol.Barrier()
        protocol.interleave([first(), second()], random.Random(seed), 0)


@pytest.mark.parametrize("is_causal", [False, True])
def test_q_is_freed_after_the_items_last_qk_and_reloaded_under_its_last_pv(is_causal):
    # one program, items of 0, 1 and several key blocks (causal 129 over 17 keys: none, then one; 200 x 200:
    # up to 7): the next item's Q is loaded once both warpgroups' last QK^T has retired, over many
    # interleavings
    for seed in range(4):
        one = dataclasses.replace(SMALL, programs=1)
        _check(*_inputs(1, 4, 2, 129, 17, 64, torch.bfloat16), is_causal, one, seed=seed)
        _check(*_inputs(1, 2, 1, 200, 200, 64, torch.float16), is_causal, one, seed=seed)


def test_q_overwritten_under_a_warpgroup_is_caught(monkeypatch):
    # a producer that does not wait for Q's "empty" barrier loads the next item's Q under a QK^T still to
    # retire: the read finds the wrong item's tile
    q, k, v = _inputs(1, 2, 1, 200, 200, 64, torch.float16)

    class NeverFull(protocol.Barrier):
        def passed(self, parity):
            return True

    original = model._Program.__init__

    def no_q_wait(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.q_empty = NeverFull(model.WARPGROUPS)

    monkeypatch.setattr(model._Program, "__init__", no_q_wait)
    with pytest.raises(protocol.ScheduleError, match="read Q holding"):
        model.forward(q, k, v, schedule=dataclasses.replace(SMALL, programs=1))


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


# --- fp8 (e4m3 q, k, v with descales) ---------------------------------------------------------------------

E4M3 = torch.float8_e4m3fn


def _fp8_inputs(batch, heads, heads_kv, seq_q, seq_kv, head_dim, descale_shape):
    """e4m3 q, k, v of values drawn in float64 and quantized by their descales (None: 1), and the descales."""
    descales = []
    for _ in range(3):
        if descale_shape is None:
            descales.append(None)
        else:
            descales.append(torch.rand(descale_shape(batch, heads_kv), dtype=torch.float64).float() + 0.5)
    tensors = []
    for shape, descale in zip([(batch, heads, seq_q, head_dim)] + [(batch, heads_kv, seq_kv, head_dim)] * 2,
                              descales, strict=True):  # fmt: skip
        x = torch.randn(shape, dtype=torch.float64) * 2
        if descale is not None:
            rows = descale_rows(descale, batch, heads_kv).double()
            x = x / rows.repeat_interleave(shape[1] // heads_kv, dim=1)[:, :, None, None]
        tensors.append(x.to(E4M3))
    return (*tensors, tuple(descales))


def _check_fp8(q, k, v, descales, is_causal, schedule, scale=None):
    out, lse = model.forward(q, k, v, is_causal=is_causal, schedule=schedule, descales=descales, scale=scale)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    assert out.dtype == torch.bfloat16 and not out.isnan().any() and not lse.isnan().any()
    wide = dequantize_attention_inputs(q, k, v, descales, torch.float64)
    truth, truth_lse = reference_attention(*wide, is_causal=is_causal, scale=scale, return_lse=True)
    same, _ = reference_forward(q, k, v, is_causal=is_causal, window=None, softcap=None, scale=scale,
                                descales=descales)  # fmt: skip
    assert_error_rule("fp8 attention schedule", out, same, truth, OUTPUT_FACTOR, torch.bfloat16)
    assert max_error(lse, truth_lse) <= 1e-4 * max(1.0, truth_lse.nan_to_num(0, 0, 0).abs().max().item())
    return out, lse


DESCALE_SHAPES = {"none": None, "tensor": lambda b, h: (), "head": lambda b, h: (h,),
                  "batch": lambda b, h: (b, h)}  # fmt: skip


@pytest.mark.parametrize(("descale", "is_causal"), [("none", True), ("tensor", False), ("head", True),
                                                    ("batch", False)])  # fmt: skip
def test_fp8_descales_ragged_and_gqa(descale, is_causal):
    _check_fp8(*_fp8_inputs(2, 4, 2, 77, 93, 64, DESCALE_SHAPES[descale]), is_causal, SMALL)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_fp8_the_kernels_plan(head_dim):
    # the kernel's fp8 plan (V^T tiles [D, block_n]), its grid cut to 3 programs; keys not a multiple of 16
    plan = attention._plan(1, 2, 1, 200, 139, head_dim, E4M3, True, Hardware.from_spec("h100-sxm"))
    planned = dataclasses.replace(model.from_plan(plan), programs=3)
    _check_fp8(*_fp8_inputs(1, 2, 1, 200, 139, head_dim, DESCALE_SHAPES["head"]), True, planned)


def test_fp8_rows_that_see_no_key_and_the_weights_offset(monkeypatch):
    out, lse = _check_fp8(*_fp8_inputs(1, 2, 1, 70, 20, 64, DESCALE_SHAPES["batch"]), True, SMALL, scale=0.4)
    assert torch.equal(out[:, :, :50].float(), torch.zeros(1, 2, 50, 64))
    assert torch.isinf(lse[:, :, :50]).all() and (lse[:, :, :50] < 0).all()
    # one key scores 7 above 255 others, whose weights e**-7 < 2**-10 round to 0 in e4m3 (its smallest
    # subnormal is 2**-9) unless taken at 2**8 times their value: without the offset the output is 0, not 0.19
    q = torch.ones(1, 1, 1, 64).to(E4M3)
    k, v = torch.zeros(1, 1, 256, 64), torch.ones(1, 1, 256, 64)
    k[:, :, 0], v[:, :, 0] = 7.0, 0.0
    k, v = k.to(E4M3), v.to(E4M3)
    out, _ = _check_fp8(q, k, v, (None, None, None), False, SMALL, scale=1 / 64)
    assert out.float().mean().item() == pytest.approx(255 * math.exp(-7) / (1 + 255 * math.exp(-7)), rel=0.02)
    monkeypatch.setattr(model, "P8_OFFSET", 0)
    with pytest.raises(AssertionError, match="fp8 attention schedule"):
        _check_fp8(q, k, v, (None, None, None), False, SMALL, scale=1 / 64)
