"""The block-scaled fp8 Gluon GEMM's schedule, modelled in PyTorch (:mod:`llm_speed.gluon.gemm_fp8_schedule`),
against float64 of the dequantized operands under the 2x rule: the shipped plan's tile, ring and persistent
grid on ragged shapes, a few programs taking many tiles (the ring wrapping across tiles), small tiles, bias,
both output dtypes; and the checks failing where the protocol (also a slot freed by one of the two consumer
warpgroups) or the promotion is broken."""

from __future__ import annotations

import pytest
import torch

from accuracy_rule import OUTPUT_FACTOR, assert_error_rule, matmul_cap
from llm_speed.core.hardware import Hardware
from llm_speed.gluon import gemm_fp8 as gluon_fp8
from llm_speed.gluon import gemm_fp8_schedule as model
from llm_speed.gluon import protocol
from llm_speed.gluon.gemm_schedule import Schedule
from llm_speed.matmul.reference import gemm_fp8_reference, quantize_fp8_reference

H100 = Hardware.from_spec("h100-sxm")
E4M3 = torch.float8_e4m3fn


def _operands(m, n, k, seed=0, positive=False):
    """e4m3 a [M, K] (1x128 scales) and b [N, K] (128x128 scales), as quantize_fp8 makes them; rows of a
    at magnitudes 1e-2 to 1e2 so that the per-group scales differ."""
    g = torch.Generator().manual_seed(seed)
    draw = torch.rand if positive else torch.randn
    a = draw(m, k, generator=g) * torch.logspace(-2, 2, m).reshape(m, 1)
    w = draw(n, k, generator=g)
    a_q, s_a = quantize_fp8_reference(a, E4M3, (1, 128))
    b_q, s_b = quantize_fp8_reference(w, E4M3, (128, 128))
    return a_q, b_q, s_a, s_b


def _same_precision(a, b, s_a, s_b, bias, out_dtype):
    """Each 128-wide K group's product in float32, scaled by its groups' scales and summed in float32 (as
    ``torch._scaled_mm`` would be called per group), plus the bias, rounded once."""
    (m, k), n = a.shape, b.shape[0]
    out = torch.zeros(m, n)
    for g in range(-(-k // 128)):
        ks = slice(g * 128, (g + 1) * 128)
        s_col = s_b[:, g].repeat_interleave(128)[:n]
        out += (a[:, ks].float() @ b[:, ks].float().T) * s_a[:, g : g + 1] * s_col
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


def _check(out, a, b, s_a, s_b, bias=None, out_dtype=torch.bfloat16):
    truth = gemm_fp8_reference(a, b, s_a, s_b, bias=bias, out_dtype=torch.float64, trans_b=True)
    assert out.dtype == out_dtype and not out.isnan().any(), "an output element no program wrote"
    same = _same_precision(a, b, s_a, s_b, bias, out_dtype)
    assert_error_rule("gluon gemm fp8 schedule", out, same, truth, OUTPUT_FACTOR,
                      cap=matmul_cap(out_dtype, truth, a.shape[1]))  # fmt: skip


@pytest.mark.parametrize(
    ("m", "n", "k", "out_dtype", "bias"),
    [(300, 264, 400, torch.bfloat16, False),  # K: 3 groups + 16
     (1, 8, 16, torch.float16, True),  # one row, a partial group
     (129, 136, 128, torch.bfloat16, True),  # one row and 8 columns past a tile
     (64, 392, 1040, torch.float16, False)],  # 9 K steps: the ring of 6 wraps
)  # fmt: skip
def test_the_shipped_plan_against_float64(m, n, k, out_dtype, bias):
    plan = gluon_fp8._plan(m, n, k, out_dtype, bias, ((1, 1), (1, 1)), 1, H100)
    schedule = model.from_plan(plan)
    assert (schedule.block_m, schedule.block_n, schedule.block_k, schedule.stages) == (128, 128, 128, 6)
    a, b, s_a, s_b = _operands(m, n, k)
    bias_t = torch.randn(n).to(out_dtype) if bias else None
    out = model.gemm_fp8(a, b, s_a, s_b, schedule, out_dtype=out_dtype, bias=bias_t)
    _check(out, a, b, s_a, s_b, bias_t, out_dtype)


def test_few_programs_take_many_tiles():
    # 3 x 4 tiles of the shipped size over 2 programs, 4 K steps a tile through a ring of 3: slots and
    # parities carry across tiles; positive inputs too (rounding biased one way would show)
    schedule = Schedule(128, 128, 128, 3, group_m=2, programs=2, trans_b=True)
    for positive in (False, True):
        a, b, s_a, s_b = _operands(300, 392, 400, positive=positive)
        _check(model.gemm_fp8(a, b, s_a, s_b, schedule, seed=int(positive)), a, b, s_a, s_b)


@pytest.mark.parametrize("stages", [2, 3])
def test_small_tiles_over_many_programs(stages):
    # 32 x 16 tiles with K steps of 32 (four per scaling group): 3 x 9 tiles over 5 programs
    schedule = Schedule(32, 16, 32, stages, group_m=2, programs=5, trans_b=True)
    a, b, s_a, s_b = _operands(70, 136, 272)
    _check(model.gemm_fp8(a, b, s_a, s_b, schedule, seed=stages), a, b, s_a, s_b)


def test_a_broken_protocol_is_caught(monkeypatch):
    schedule = Schedule(128, 128, 128, 2, group_m=2, programs=2, trans_b=True)
    a, b, s_a, s_b = _operands(256, 256, 512)
    model.gemm_fp8(a, b, s_a, s_b, schedule)  # the real protocol passes

    def never_blocks(barrier, parity):  # no partition waits: a product reads a slot not yet or re-filled
        yield True

    with monkeypatch.context() as patch:
        patch.setattr(protocol, "wait", never_blocks)
        with pytest.raises(protocol.ScheduleError, match="read slot"):
            model.gemm_fp8(a, b, s_a, s_b, schedule)
    with monkeypatch.context() as patch:  # no arrival completes a phase: every partition waits forever
        patch.setattr(protocol.Barrier, "arrive", lambda self: None)
        with pytest.raises(protocol.ScheduleError, match="a hang"):
            model.gemm_fp8(a, b, s_a, s_b, schedule)
    # "empty" counting one warpgroup's arrival: the producer refills a slot the other warpgroup still reads
    # (or, the other's arrival completing a phase early, the parities go astray: a hang)
    monkeypatch.setattr(model, "EMPTY_ARRIVALS", 1)
    caught = []
    for seed in range(5):
        try:
            model.gemm_fp8(a, b, s_a, s_b, schedule, seed=seed)
        except protocol.ScheduleError as error:
            caught.append(str(error))
    assert len(caught) == 5 and any("read slot" in text for text in caught)


@pytest.mark.parametrize("fault", ["first group's scales", "scales once per tile"])
def test_a_wrong_promotion_fails_the_rule(monkeypatch, fault):
    """The float64 check sees the promotion: every step at the first group's scales, or the tile's summed
    products scaled once at the last step's (what one accumulator without promotion could do), fail."""
    schedule = Schedule(128, 128, 128, 3, group_m=2, programs=1, trans_b=True)
    a, b, s_a, s_b = _operands(128, 128, 384)
    right = model.Program.step_scale
    if fault == "first group's scales":
        patch = lambda self, rows, column, step: right(self, rows, column, 0)  # noqa: E731
    else:
        patch = lambda self, rows, column, step: right(self, rows, column, self.k_steps - 1)  # noqa: E731
    monkeypatch.setattr(model.Program, "step_scale", patch)
    out = model.gemm_fp8(a, b, s_a, s_b, schedule)
    with pytest.raises(AssertionError, match="gluon gemm fp8 schedule: error"):
        _check(out, a, b, s_a, s_b)
