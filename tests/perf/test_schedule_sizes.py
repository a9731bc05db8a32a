"""The wave and launch-order arithmetic of the cost models at any size: the GEMM's equal tiles and the
attention kernels' programs, counted rather than listed, give the listed schedule's answer where a list fits,
and sizes past what the model schedules are refused by name."""

from __future__ import annotations

import random
import time

import pytest
from cli_exit import exit_code, one_error_line

from llm_speed.perf.predict import launch_order, list_schedule, predict
from llm_speed.perf.prediction.attention import MAX_CAUSAL_BLOCKS, _block_runs, launch_runs
from llm_speed.perf.prediction.terms import (
    MAX_SCHEDULED_PROGRAMS,
    makespan,
    order_schedule,
    uniform_makespan,
)


@pytest.mark.parametrize("programs", [1, 5, 131, 132, 133, 263, 264, 265, 1000, 12345])
@pytest.mark.parametrize("program_s", [1.0, 3.7e-6, 0.1])
def test_uniform_makespan_is_the_listed_one(programs, program_s):
    listed = makespan([program_s] * programs, 132)
    counted = uniform_makespan(program_s, programs, 132)
    assert counted[:3] == listed[:3]  # time (ragged last waves included), programs, waves: identical
    # The list's efficiency summed the times one by one; the product differs in rounding only.
    assert counted[3] == pytest.approx(listed[3], rel=1e-12, abs=0)


def test_uniform_makespan_of_no_programs():
    assert uniform_makespan(1.0, 0, 132) == makespan([], 132) == (0.0, 0, 0.0, 1.0)


@pytest.mark.parametrize("seed", range(40))
def test_order_schedule_is_list_schedule(seed):
    # Random per-pair blocks (zeros, repeats, long runs past the SM count), pairs, sections and SMs: the
    # counted schedule ends exactly when the listed one does.
    rng = random.Random(seed)
    slots = rng.choice([1, 2, 3, 7, 16, 132])
    per_pair = []
    for _ in range(rng.randint(1, 12)):
        per_pair += [rng.randint(0, 9)] * rng.choice([1, 1, 2, 5, 40, 300])
    pairs = rng.randint(1, 60)
    section = rng.choice([None, 1, 2, 3, 7, 64])
    listed = list_schedule(launch_order(per_pair, pairs, section), slots)
    assert order_schedule(launch_runs(_block_runs(per_pair), pairs, section), slots) == listed


def test_launch_runs_is_launch_order():
    per_pair = [1, 2, 2, 4]
    for pairs, section in [(3, None), (3, 2), (5, 2), (4, 4), (2, 8)]:
        order = launch_runs(_block_runs(per_pair), pairs, section)
        flat = tuple(n for unit, repeats in order for _ in range(repeats) for n, c in unit for _ in range(c))
        assert flat == launch_order(per_pair, pairs, section)


def test_order_schedule_gives_up_past_its_limit():
    ramp = tuple((n, 1) for n in range(1, 101))  # no two programs alike
    assert order_schedule(((ramp, 3),), 7, limit=250) is None
    assert order_schedule(((ramp, 2),), 7, limit=250) == list_schedule(tuple(range(1, 101)) * 2, 7)


def _quick(op, **problem):
    start = time.perf_counter()
    result = predict(op, "h100-sxm", **problem)
    assert time.perf_counter() - start < 1.0
    return result


def test_huge_gemm_and_full_attention_are_counted_quickly():
    gemm = _quick("gemm", m=99_999_999_999, n=4096, k=4096)
    assert gemm.breakdown.programs == 781_250_000 * 16  # ceil(m / 128) x 4096 / 256 tiles of 128x256
    forward = _quick("flash_attention", batch=1, heads_q=16, seq_q=99_999_999_999, head_dim=128)
    assert forward.breakdown.programs == 16 * -(-99_999_999_999 // forward.breakdown.tile[0])
    _quick("flash_attention_backward", batch=1, heads_q=16, seq_q=99_999_999_999, head_dim=128)


def test_a_causal_sequence_past_the_limit_is_refused_by_name():
    with pytest.raises(ValueError) as error:
        predict("flash_attention", "h100-sxm", batch=1, heads_q=16, seq_q=99_999_999_999, head_dim=128,
                causal=True)  # fmt: skip
    assert str(error.value) == (
        f"seq_q=99,999,999,999 is past the longest causal sequence the model schedules: 781,250,000 blocks "
        f"of 128 (at most {MAX_CAUSAL_BLOCKS:,} a sequence: {MAX_CAUSAL_BLOCKS * 128:,} tokens)"
    )


def test_too_many_unequal_programs_are_refused_naming_the_sizes(capsys):
    argv = ["predict", "flash_attention", "batch=8", "heads_q=64", "seq_q=10000000", "head_dim=128",
            "causal=true", "--gpu", "h100-sxm"]  # fmt: skip
    assert exit_code(argv) == 2
    assert one_error_line(capsys.readouterr().err) == (
        "llm-speed predict: error: flash_attention: batch=8, heads_q=64, seq_q=10000000: 40,000,000 programs "
        f"of unequal length in no repeating pattern: more than the {MAX_SCHEDULED_PROGRAMS:,} the model "
        "schedules one by one; fewer (batch, head) pairs or shorter sequences"
    )


def test_analyze_at_huge_sizes_answers(capsys):
    for flag in ("--seq-len", "--batch-size"):
        start = time.perf_counter()
        assert exit_code(["analyze", "--model", "llama-3-8b", flag, "99999999999", "--gpu", "h100-sxm"]) == 0
        assert time.perf_counter() - start < 2.0
    capsys.readouterr()
