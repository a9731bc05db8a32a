"""The timing module on the CPU (host clock), and its statistics."""

import time

import pytest
import torch

from llm_speed.bench import timing as timing_module
from llm_speed.bench.timing import (
    GRAPH_TIMER,
    HOST_TIMER,
    measure,
    peak_memory,
    runs_still_needed,
    summarize,
)


def test_host_timer_measures_a_sleep():
    calls = []

    def sleep_one_ms():
        calls.append(1)
        time.sleep(0.001)

    timing = measure(sleep_one_ms, warmup=2, iterations=5, device="cpu")
    assert len(calls) == 7  # warm-up runs are not timed but do run
    assert timing.timer == HOST_TIMER
    assert timing.iterations == 5 and len(timing.times_ms) == 5
    assert timing.min_ms >= 1.0  # a 1 ms sleep cannot take less
    assert timing.min_ms <= timing.p20_ms <= timing.median_ms <= timing.p80_ms <= timing.max_ms
    assert timing.l2_flush_bytes is None


def test_summary_statistics_are_exact_on_known_values():
    timing = summarize([5.0, 1.0, 2.0, 4.0, 3.0], HOST_TIMER)
    assert timing.median_ms == 3.0
    assert timing.mean_ms == 3.0
    assert (timing.min_ms, timing.max_ms) == (1.0, 5.0)
    assert timing.p20_ms == pytest.approx(1.8)  # position 0.8 between 1 and 2
    assert timing.p80_ms == pytest.approx(4.2)
    assert timing.times_ms == [5.0, 1.0, 2.0, 4.0, 3.0]  # kept in run order


def test_runs_continue_until_the_minimum_time():
    calls = []

    def sleep_one_ms():
        calls.append(1)
        time.sleep(0.001)

    timing = measure(sleep_one_ms, warmup=0, iterations=3, device="cpu", min_time_s=0.03)
    assert sum(timing.times_ms) >= 30.0  # the minimum time, not 3 runs
    assert timing.iterations == len(calls) >= 4
    assert timing.iterations <= 31  # each run takes at least 1 ms: the estimate does not overshoot wildly


def test_runs_still_needed():
    assert runs_still_needed([], 5, 0.0) == 5
    assert runs_still_needed([1.0] * 5, 5, 0.0) == 0
    assert runs_still_needed([2.0] * 5, 5, 0.1) == 45  # 90 ms more at 2 ms a run
    assert runs_still_needed([2.0] * 50, 5, 0.1) == 0
    capped = [1e-6] * (timing_module.MAX_ITERATIONS - 3)
    assert runs_still_needed(capped, 5, 10.0) == 3  # never past MAX_ITERATIONS


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"iterations": 0}, "iterations"),
        ({"warmup": -1}, "warmup"),
        ({"iterations": 2.5}, "iterations"),
        ({"min_time_s": -1.0}, "min_time_s"),
        ({"min_time_s": float("inf")}, "min_time_s"),
    ],
)
def test_bad_counts_are_rejected_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        measure(lambda: None, device="cpu", **kwargs)


def test_not_callable_is_a_type_error():
    with pytest.raises(TypeError, match="fn"):
        measure(42, device="cpu")


def test_graph_timer_refuses_a_cpu_device_by_name():
    calls = []
    with pytest.raises(ValueError, match="device: CUDA graphs need a CUDA device"):
        measure(lambda: calls.append(1), device="cpu", graph=True)
    assert not calls  # refused before any work
    with pytest.raises(ValueError, match="iterations"):
        measure(lambda: None, device="cpu", graph=True, iterations=0)


def test_peak_memory_on_cpu_is_none_with_a_reason():
    result = peak_memory(lambda: torch.ones(4), device="cpu")
    assert result.peak_bytes is None and result.above_baseline_bytes is None
    assert "CUDA" in result.reason


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_timer_and_peak_memory():
    a = torch.randn(1024, 1024, device="cuda")
    timing = measure(lambda: a @ a, warmup=2, iterations=5, device="cuda")
    assert timing.timer == "cuda-events" and timing.median_ms > 0
    assert timing.l2_flush_bytes >= torch.cuda.get_device_properties(0).L2_cache_size
    memory = peak_memory(lambda: torch.empty(256, 1024, 1024, dtype=torch.uint8, device="cuda"), "cuda")
    assert memory.above_baseline_bytes >= 256 * 1024 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replays_are_timed_and_compute():
    """Every replay runs the captured call: one eager warm-up, the capture (which runs nothing), one
    untimed replay and the timed ones each add ``a`` once."""
    a = torch.ones(1024, device="cuda")
    out = torch.zeros_like(a)
    timing = measure(lambda: out.add_(a), warmup=1, iterations=5, device="cuda", graph=True)
    assert timing.timer == GRAPH_TIMER and timing.iterations >= 5 and timing.median_ms > 0
    torch.cuda.synchronize()
    assert torch.all(out == 2 + timing.iterations)


def test_timing_notes_name_only_the_triton_ops_that_were_timed():
    """A kernel that could not run (kvcache on CPU without the interpreter) has no times to explain."""
    from llm_speed.bench import report

    cpu = torch.device("cpu")
    ran = report.Measurement(case="c", impl="flash", available=True, flops=1.0, bytes_moved=1.0)
    refused = report.Measurement(case="c", impl="tiled", available=False, reason="no", flops=1, bytes_moved=1)
    notes = " ".join(report.timing_notes(cpu, ["flash", "tiled"], [ran, refused]))
    assert "flash" in notes and "tiled" not in notes
    assert "tiled" in " ".join(report.timing_notes(cpu, ["flash", "tiled"]))
    assert not any("flash" in n for n in report.timing_notes(cpu, ["flash"], [refused]))
