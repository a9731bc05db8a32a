"""The Gluon GEMM's schedule, modelled in PyTorch (:mod:`llm_speed.gluon.gemm_schedule`), against float64:
the shipped plan's tile, ring and persistent grid, small tiles over many programs, every tile exactly once,
and the protocol checks failing where the barriers are broken (so a pass means something)."""

from __future__ import annotations

import pytest
import torch

from accuracy_rule import OUTPUT_FACTOR, assert_error_rule, matmul_cap
from llm_speed.core.hardware import Hardware
from llm_speed.gluon import gemm as gluon_gemm
from llm_speed.gluon import gemm_schedule as model
from llm_speed.gluon import protocol

H100 = Hardware.from_spec("h100-sxm")


def _operands(m, n, k, dtype, trans_b, positive=False):
    draw = torch.rand if positive else torch.randn
    a = draw(m, k, dtype=torch.float64).to(dtype)
    b = draw(*((n, k) if trans_b else (k, n)), dtype=torch.float64).to(dtype)
    return a, b


def _check(out, a, b, trans_b):
    b_ = b.T if trans_b else b
    truth = a.double() @ b_.double()
    assert not out.isnan().any(), "an output element no program wrote"
    same_precision = (a.float() @ b_.float()).to(a.dtype)  # fp32 accumulation, one rounding: the kernel's
    assert_error_rule("gluon gemm schedule", out, same_precision, truth, OUTPUT_FACTOR,
                      cap=matmul_cap(a.dtype, truth, a.shape[1]))  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [(300, 520, 200), (128, 256, 64), (1, 8, 8), (129, 136, 72)])
def test_the_shipped_plan_against_float64(m, n, k, dtype, trans_b):
    plan = gluon_gemm._plan(m, n, k, dtype, trans_b, H100)
    schedule = model.from_plan(plan)
    assert (schedule.block_m, schedule.stages, schedule.trans_b) == (128, 3 if n > 128 else 4, trans_b)
    a, b = _operands(m, n, k, dtype, trans_b)
    _check(model.gemm(a, b, schedule), a, b, trans_b)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("trans_b", [False, True])
def test_small_tiles_over_many_programs(seed, stages, trans_b):
    # 32x16 tiles with K steps of 8: 3 x 4 tiles, ragged on every side, 5 K steps, over 3 programs; positive
    # inputs too (rounding biased one way would show there)
    schedule = model.Schedule(32, 16, 8, stages, group_m=2, programs=3, trans_b=trans_b)
    for positive in (False, True):
        a, b = _operands(70, 50, 40, torch.bfloat16, trans_b, positive)
        _check(model.gemm(a, b, schedule, seed=seed), a, b, trans_b)


@pytest.mark.parametrize(("tiles_m", "tiles_n", "group_m"), [(5, 7, 2), (8, 3, 8), (1, 9, 8), (13, 1, 4)])
@pytest.mark.parametrize("programs", [1, 3, 132])
def test_every_tile_once_in_the_grouped_order(tiles_m, tiles_n, group_m, programs):
    tiles = tiles_m * tiles_n
    seen = [t for p in range(programs) for t in model.program_tiles(p, programs, tiles)]
    assert sorted(seen) == list(range(tiles))
    coordinates = [model.tile_coordinates(t, tiles_m, tiles_n, group_m) for t in range(tiles)]
    assert sorted(coordinates) == [(r, c) for r in range(tiles_m) for c in range(tiles_n)]
    # inside a band of group_m tile rows, consecutive tiles walk down a column before moving right
    for t in range(tiles - 1):
        (r0, c0), (r1, c1) = coordinates[t], coordinates[t + 1]
        if r0 // group_m == r1 // group_m:
            assert (c1 == c0 and r1 == r0 + 1) or (c1 == c0 + 1 and r1 % group_m == 0)


def test_a_broken_protocol_is_caught(monkeypatch):
    schedule = model.Schedule(32, 16, 8, 2, group_m=2, programs=2)
    a, b = _operands(64, 32, 64, torch.float16, False)
    model.gemm(a, b, schedule)  # the real protocol passes

    def never_blocks(barrier, parity):  # no partition waits: the producer overruns the ring
        yield True

    with monkeypatch.context() as patch:
        patch.setattr(protocol, "wait", never_blocks)
        with pytest.raises(protocol.ScheduleError, match="read slot"):
            model.gemm(a, b, schedule)
    with monkeypatch.context() as patch:  # no arrival completes a phase: every partition waits forever
        patch.setattr(protocol.Barrier, "arrive", lambda self: None)
        with pytest.raises(protocol.ScheduleError, match="a hang"):
            model.gemm(a, b, schedule)


def test_the_schedule_reads_what_the_launch_fixes():
    plan = gluon_gemm._plan(1000, 4096, 512, torch.bfloat16, False, H100)
    schedule = model.from_plan(plan)
    tiles = -(-1000 // 128) * (4096 // 256)
    assert schedule == model.Schedule(128, 256, 64, 3, 8, min(tiles, H100.sm_count), False)
    assert plan.fixed["INSTR_N"] == 256 and plan.num_warps == 8


def _int8(*shape, generator):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=generator)


@pytest.mark.parametrize(("m", "n", "k"), [(300, 520, 272), (128, 128, 128), (1, 4, 16), (129, 132, 400)])
def test_int8_the_shipped_plan_is_exact(m, n, k):
    """int8 (:func:`llm_speed.gluon.gemm.gemm_int8`): the plan's 128 x 128 x 128 tile over four slots, b
    [N, K], every output the exact integer product (int32 accumulation is exact where the sum fits)."""
    plan = gluon_gemm._plan(m, n, k, torch.int8, True, H100)
    schedule = model.from_plan(plan)
    assert (schedule.block_m, schedule.block_n, schedule.block_k, schedule.stages, schedule.trans_b) == (
        128, 128, 128, 4, True)
    assert plan.fixed["ACC_INT32"] and plan.fixed["INSTR_N"] == 128
    generator = torch.Generator().manual_seed(m * n + k)
    a, b = _int8(m, k, generator=generator), _int8(n, k, generator=generator)
    out = model.gemm(a, b, schedule)
    assert out.dtype == torch.int32
    assert torch.equal(out, (a.long() @ b.long().T).to(torch.int32))


@pytest.mark.parametrize("seed", range(3))
def test_int8_small_tiles_over_many_programs_and_int32_wraparound(seed):
    """Ragged 32 x 16 tiles over 3 programs; and sums past int32 wrap as the kernel's int32 accumulator
    (and torch._int_mm) does: -128 * -128 * 131072 = 2**31 comes out as -2**31."""
    schedule = model.Schedule(32, 16, 16, 3, group_m=2, programs=3, trans_b=True)
    generator = torch.Generator().manual_seed(seed)
    a, b = _int8(70, 48, generator=generator), _int8(50, 48, generator=generator)
    assert torch.equal(model.gemm(a, b, schedule, seed=seed), (a.long() @ b.long().T).to(torch.int32))
    k = 131072
    a, b = torch.full((1, k), -128, dtype=torch.int8), torch.full((4, k), -128, dtype=torch.int8)
    wide = model.Schedule(32, 16, 4096, 2, group_m=1, programs=1, trans_b=True)
    assert model.gemm(a, b, wide).tolist() == [[-(2**31)] * 4]
