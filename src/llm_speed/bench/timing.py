"""Timing and peak-memory measurement shared by the benchmarks and the profiler.

On a CUDA device every iteration is timed with its own pair of CUDA events, after a warm-up, with the L2
cache flushed before each run (so every run reads its inputs from HBM, as in a real model where other layers
ran in between). On the CPU the host clock (``time.perf_counter``) is used and the result says so.
Runs repeat until both a minimum count and a minimum total measured time are reached (as
``torch.utils.benchmark.Timer.blocked_autorange`` and Google Benchmark's ``--benchmark_min_time`` do): a
fixed handful of runs on a busy machine gives a median that is mostly noise.
Nothing here touches the GPU until a function is called.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from llm_speed.bench.cpu_load import CPU_TIMING_THREADS, pinned_threads
from llm_speed.bench.options import MAX_ITERATIONS
from llm_speed.core.runtime import resolve_device

CUDA_TIMER = "cuda-events"
GRAPH_TIMER = "cuda-events, CUDA graph replay"
HOST_TIMER = "host (CPU timer)"


# Writing twice the L2's capacity evicts every line even though the replacement policy is not a strict LRU.
L2_FLUSH_FACTOR = 2


@dataclasses.dataclass(frozen=True)
class Timing:
    """Statistics of repeated runs of one function, in milliseconds."""

    median_ms: float
    mean_ms: float
    min_ms: float
    max_ms: float
    p20_ms: float
    p80_ms: float
    iterations: int
    timer: str  # CUDA_TIMER or HOST_TIMER
    times_ms: list[float]
    # Bytes written to evict the L2 before each run; None when no flush happened (CPU, or flush_l2=False).
    l2_flush_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """Device memory during one call. Figures are None, with ``reason`` saying why, when not measurable."""

    peak_bytes: int | None  # torch.cuda.max_memory_allocated during the call (inputs included)
    above_baseline_bytes: int | None  # peak minus what was allocated just before the call
    reason: str | None = None


def _percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Linear-interpolated percentile of an already sorted list (``fraction`` in [0, 1])."""
    position = fraction * (len(sorted_values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    weight = position - low
    return sorted_values[low] * (1.0 - weight) + sorted_values[high] * weight


def summarize(times_ms: Sequence[float], timer: str, l2_flush_bytes: int | None = None) -> Timing:
    """Build a :class:`Timing` from per-iteration times in milliseconds."""
    if not times_ms:
        raise ValueError("times_ms: need at least one measured time")
    ordered = sorted(times_ms)
    return Timing(
        median_ms=statistics.median(ordered),
        mean_ms=statistics.fmean(ordered),
        min_ms=ordered[0],
        max_ms=ordered[-1],
        p20_ms=_percentile(ordered, 0.2),
        p80_ms=_percentile(ordered, 0.8),
        iterations=len(ordered),
        timer=timer,
        times_ms=list(times_ms),
        l2_flush_bytes=l2_flush_bytes,
    )


def l2_cache_bytes(device: torch.device) -> int:
    """The L2 cache size of a CUDA device, read from the live device properties."""
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def check_run_counts(warmup: int, iterations: int, min_time_s: float) -> None:
    """ValueError naming the count when warmup, iterations or min_time_s is out of range (the counts at most
    :data:`MAX_ITERATIONS`, which caps the timed runs whatever is asked)."""
    if isinstance(warmup, bool) or not isinstance(warmup, int) or not 0 <= warmup <= MAX_ITERATIONS:
        raise ValueError(f"warmup: expected an integer from 0 to {MAX_ITERATIONS}, got {warmup!r}")
    if (
        isinstance(iterations, bool)
        or not isinstance(iterations, int)
        or not 1 <= iterations <= MAX_ITERATIONS
    ):
        raise ValueError(f"iterations: expected an integer from 1 to {MAX_ITERATIONS}, got {iterations!r}")
    if (
        isinstance(min_time_s, bool)
        or not isinstance(min_time_s, (int, float))
        or not 0 <= min_time_s < math.inf
    ):
        raise ValueError(f"min_time_s: expected a finite number of seconds >= 0, got {min_time_s!r}")


def runs_still_needed(times_ms: Sequence[float], iterations: int, min_time_s: float) -> int:
    """How many more runs reach both ``iterations`` runs and ``min_time_s`` seconds measured (0: done).

    The count for the time is estimated from the mean so far, and capped at :data:`MAX_ITERATIONS` in all.
    """
    done = len(times_ms)
    total_ms = sum(times_ms)
    if done >= MAX_ITERATIONS or (done >= iterations and total_ms >= min_time_s * 1e3):
        return 0
    more = max(iterations - done, 1)
    if total_ms < min_time_s * 1e3 and done:
        mean_ms = max(total_ms / done, 1e-6)
        more = max(more, math.ceil((min_time_s * 1e3 - total_ms) / mean_ms))
    return min(more, MAX_ITERATIONS - done)


def measure(
    fn: Callable[[], Any],
    *,
    warmup: int = 10,
    iterations: int = 50,
    device: torch.device | str | None = None,
    flush_l2: bool = True,
    min_time_s: float = 0.0,
    graph: bool = False,
    threads: int | None = CPU_TIMING_THREADS,
) -> Timing:
    """Time ``fn()`` (called with no arguments) at least ``iterations`` times after ``warmup`` untimed calls,
    and on until the timed runs add up to ``min_time_s`` seconds (at most :data:`MAX_ITERATIONS` runs).

    ``device`` picks the timer: CUDA events on a CUDA device (the L2 cache is flushed before every timed run
    when ``flush_l2``; the flush itself is not timed), the host clock on the CPU. ``None`` means the current
    CUDA device when there is one, else the CPU. On the CPU the warm-up and the timed runs use ``threads``
    threads (:data:`llm_speed.bench.cpu_load.CPU_TIMING_THREADS` by default; the previous count is restored
    after; None keeps the current count).

    ``graph`` (a CUDA device only; ValueError naming ``device`` otherwise): capture one call of ``fn`` in a
    CUDA graph and time its replays instead: the device time without the host's launch path, as a serving
    engine that replays its decode step sees it. ``fn`` first runs ``warmup`` times (at least once) on a side
    stream, as ``torch.cuda.graphs`` asks (lazy initialisation, compiles and allocator growth stay out of the
    capture); a call that cannot be captured (a host synchronisation) raises what the capture raised.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    check_run_counts(warmup, iterations, min_time_s)
    device = resolve_device(device)
    if graph and device.type != "cuda":
        raise ValueError(f"device: CUDA graphs need a CUDA device, got {device}")
    if device.type == "cuda":
        if graph:
            with torch.cuda.device(device):
                replay = _captured(fn, warmup, device).replay
                timing = _measure_cuda(replay, warmup=warmup, iterations=iterations, device=device,
                                       flush_l2=flush_l2, min_time_s=min_time_s)  # fmt: skip
            return dataclasses.replace(timing, timer=GRAPH_TIMER)
        return _measure_cuda(
            fn, warmup=warmup, iterations=iterations, device=device, flush_l2=flush_l2, min_time_s=min_time_s
        )
    if device.type != "cpu":
        raise ValueError(f"device: expected a cuda or cpu device, got {device}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads: expected an integer >= 1 or None, got {threads!r}")
    with pinned_threads(threads):
        return _measure_host(fn, warmup=warmup, iterations=iterations, min_time_s=min_time_s)


def _captured(fn: Callable[[], Any], warmup: int, device: torch.device) -> torch.cuda.CUDAGraph:
    """A CUDA graph of one call of ``fn``, after ``warmup`` (at least one) calls on a side stream."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _measure_host(fn: Callable[[], Any], *, warmup: int, iterations: int, min_time_s: float) -> Timing:
    for _ in range(warmup):
        fn()
    times_ms: list[float] = []
    while more := runs_still_needed(times_ms, iterations, min_time_s):
        for _ in range(more):
            start = time.perf_counter()
            fn()
            times_ms.append((time.perf_counter() - start) * 1e3)
    return summarize(times_ms, HOST_TIMER)


def _measure_cuda(
    fn: Callable[[], Any],
    *,
    warmup: int,
    iterations: int,
    device: torch.device,
    flush_l2: bool,
    min_time_s: float,
) -> Timing:
    with torch.cuda.device(device):
        flush_buffer = None
        if flush_l2:
            flush_bytes = L2_FLUSH_FACTOR * l2_cache_bytes(device)
            flush_buffer = torch.empty(flush_bytes // 4, dtype=torch.int32, device=device)
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize(device)
        times_ms: list[float] = []
        # Batches of runs, each synchronised once: the next batch's size comes from the times so far.
        while more := runs_still_needed(times_ms, iterations, min_time_s):
            starts = [torch.cuda.Event(enable_timing=True) for _ in range(more)]
            ends = [torch.cuda.Event(enable_timing=True) for _ in range(more)]
            for start, end in zip(starts, ends, strict=True):
                if flush_buffer is not None:
                    flush_buffer.zero_()
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(device)
            times_ms += [start.elapsed_time(end) for start, end in zip(starts, ends, strict=True)]
    l2_flush_bytes = flush_buffer.numel() * flush_buffer.element_size() if flush_buffer is not None else None
    return summarize(times_ms, CUDA_TIMER, l2_flush_bytes)


def peak_memory(fn: Callable[[], Any], device: torch.device | str | None = None) -> PeakMemory:
    """Peak device memory allocated by PyTorch while ``fn()`` runs once.

    Only CUDA devices have an allocator that records peaks; on the CPU both figures are None and ``reason``
    says so.
    """
    if not callable(fn):
        raise TypeError(f"fn: expected a callable, got {type(fn).__name__}")
    device = resolve_device(device)
    if device.type != "cuda":
        reason = f"peak memory is only measured on CUDA devices (ran on {device.type})"
        return PeakMemory(None, None, reason=reason)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    result = fn()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del result
    return PeakMemory(peak_bytes=int(peak), above_baseline_bytes=int(peak - baseline))
