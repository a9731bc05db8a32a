"""Whether CPU timings can be read: a pinned thread count, and a busy machine detected instead of reported.

On a shared CPU the times of a benchmark say more about the other jobs than about the code: on a 2-core
machine with another job running, PyTorch's default of one thread per core made every attention
implementation take exactly 40 ms (threads spin-waiting for a core), and the demo printed a "476x" ratio
between two implementations that take the same time on one thread. Two measures keep that from reaching a
reader:

- the timed region runs on :data:`CPU_TIMING_THREADS` threads (``torch.set_num_threads``; the previous count
  is restored after), so a run does not depend on how many cores happen to be free;
- a fixed yardstick workload is timed before and after the run, on the wall clock and on this thread's CPU
  clock. The machine counts as busy when the yardstick got less than :data:`MIN_CPU_SHARE` of a core
  (another process held it), when its time moved by more than :data:`MAX_DRIFT` between before and after, or
  when a measured row's runs spread more than :data:`MAX_ROW_SPREAD` (p80 over p20). A busy run prints its
  times with the reasons, and no ratio between them (:func:`withhold_ratios`).

The clocks and the workload are arguments, so a test can simulate a busy machine without one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

# One thread: a CPU run is about whether the code works and how its parts compare, not about PyTorch's
# intra-op parallelism, and one thread is the count that a loaded machine can still give a process whole.
CPU_TIMING_THREADS = 1
# The yardstick: YARDSTICK_CALLS products of two YARDSTICK_SIZE^2 float32 matrices per round (0.4 GFLOP:
# about 5 ms on one core of the 2-core development machine, long enough for the scheduler to take the core
# away when another job wants it), timed YARDSTICK_ROUNDS times; the median round counts.
YARDSTICK_SIZE = 128
YARDSTICK_CALLS = 96
YARDSTICK_ROUNDS = 7
# Busy when the yardstick's thread ran less than this share of the wall-clock time (an idle core gives it
# 0.95-1.0; the rest was spent waiting for a core) ...
MIN_CPU_SHARE = 0.8
# ... when its median time after the run differs from the one before by more than this factor ...
MAX_DRIFT = 1.3
# ... or when a row's p80 time is more than this factor of its p20 time.
MAX_ROW_SPREAD = 1.5


@dataclasses.dataclass(frozen=True)
class Yardstick:
    """One timing of the yardstick: the median round's wall time and the share of it this thread ran."""

    wall_ms: float
    cpu_share: float  # thread CPU time / wall time of the rounds (1.0: the thread never waited for a core)
    rounds: int


@dataclasses.dataclass(frozen=True)
class LoadVerdict:
    """What the yardstick and the rows said about the machine during one run."""

    threads: int
    before: Yardstick
    after: Yardstick
    busy: bool
    reasons: tuple[str, ...]

    def note(self) -> str:
        """The sentence printed under the run's table: busy (no ratios printed), or quiet."""
        if self.busy:
            return (
                f"this machine was busy during the run ({'; '.join(self.reasons)}): the times are of a "
                "contended CPU, so no ratio between them is printed; rerun on an idle machine to compare"
            )
        return (
            f"timed on {self.threads} thread(s); a fixed workload took {self.before.wall_ms:.3g} ms before "
            f"and {self.after.wall_ms:.3g} ms after the run, at {self.before.cpu_share:.0%} and "
            f"{self.after.cpu_share:.0%} of a core: the machine was quiet"
        )


def _yardstick_workload() -> Callable[[], Any]:
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(YARDSTICK_SIZE, YARDSTICK_SIZE, generator=generator)
    b = torch.randn(YARDSTICK_SIZE, YARDSTICK_SIZE, generator=generator)

    def run() -> None:
        for _ in range(YARDSTICK_CALLS):
            torch.mm(a, b)

    return run


def measure_yardstick(
    workload: Callable[[], Any] | None = None,
    *,
    clock: Callable[[], float] = time.perf_counter,
    cpu_clock: Callable[[], float] = time.thread_time,
    rounds: int = YARDSTICK_ROUNDS,
) -> Yardstick:
    """Time ``workload`` (default: the fixed matrix products) ``rounds`` times on both clocks (seconds)."""
    run = workload if workload is not None else _yardstick_workload()
    run()  # first call: allocations and lazy initialisation stay out of the rounds
    walls, cpus = [], []
    for _ in range(rounds):
        wall, cpu = clock(), cpu_clock()
        run()
        walls.append(clock() - wall)
        cpus.append(cpu_clock() - cpu)
    total_wall = sum(walls)
    share = min(1.0, sum(cpus) / total_wall) if total_wall > 0 else 1.0
    return Yardstick(wall_ms=statistics.median(walls) * 1e3, cpu_share=share, rounds=rounds)


def assess(before: Yardstick, after: Yardstick, rows: Sequence[Any] = (), threads: int = CPU_TIMING_THREADS):
    """The verdict on a run from the yardstick before and after it and the spread of its rows' times."""
    reasons = []
    for when, stick in (("before", before), ("after", after)):
        if stick.cpu_share < MIN_CPU_SHARE:
            reasons.append(f"a fixed workload got {stick.cpu_share:.0%} of a core {when} the run")
    low, high = sorted((before.wall_ms, after.wall_ms))
    if low > 0 and high / low > MAX_DRIFT:
        reasons.append(
            f"a fixed workload took {before.wall_ms:.3g} ms before the run and {after.wall_ms:.3g} ms after"
        )
    spread = [
        (row.timing.p80_ms / row.timing.p20_ms, row)
        for row in rows
        if getattr(row, "timing", None) is not None and row.timing.p20_ms > 0
    ]
    wide = [(ratio, row) for ratio, row in spread if ratio > MAX_ROW_SPREAD]
    if wide:
        ratio, row = max(wide, key=lambda item: item[0])
        reasons.append(
            f"{len(wide)} of {len(spread)} rows spread more than {MAX_ROW_SPREAD:g}x across their runs "
            f"(widest: {row.impl} {row.case}, p80 {ratio:.3g}x p20)"
        )
    busy = bool(reasons)
    return LoadVerdict(threads=threads, before=before, after=after, busy=busy, reasons=tuple(reasons))


@contextlib.contextmanager
def pinned_threads(threads: int | None = CPU_TIMING_THREADS) -> Iterator[None]:
    """``torch.set_num_threads(threads)`` inside the block, the previous count restored after (None: no
    change)."""
    if threads is None:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class Watch:
    """The yardstick before and after a CPU run (see :func:`watch`); ``verdict(rows)`` once it is over."""

    def __init__(self) -> None:
        self.before: Yardstick | None = None
        self.after: Yardstick | None = None

    def verdict(self, rows: Sequence[Any] = ()) -> LoadVerdict | None:
        """None when nothing was watched (a GPU run) or the run did not finish."""
        if self.before is None or self.after is None:
            return None
        return assess(self.before, self.after, rows)


@contextlib.contextmanager
def watch(device: torch.device) -> Iterator[Watch]:
    """On a CPU, time the yardstick (on the pinned thread count) before and after the block; on a GPU,
    nothing (its timings come from CUDA events on the device)."""
    watched = Watch()
    if device.type != "cpu":
        yield watched
        return
    watched.before = probe()
    yield watched
    watched.after = probe()


def probe() -> Yardstick:
    """The yardstick on the pinned thread count: what :func:`watch` times (looked up when called, so a test
    can put a yardstick with simulated clocks in its place)."""
    with pinned_threads():
        return measure_yardstick()


def watched_run(device: torch.device, run: Callable[[], Any]) -> tuple[Any, LoadVerdict | None]:
    """``run()``'s rows between two yardstick timings (:func:`watch`), and the verdict; on a busy CPU every
    ratio between the rows is withheld (:func:`withhold_ratios`)."""
    with watch(device) as watched:
        rows = run()
    verdict = watched.verdict(rows)
    if verdict is not None and verdict.busy:
        withhold_ratios(rows)
    return rows, verdict


def withhold_ratios(rows: Sequence[Any]) -> None:
    """Clear every field that compares one row's time with another's (each row class lists them in
    ``RATIO_FIELDS``): a busy machine's times are printed, their ratios are not."""
    for row in rows:
        for name in getattr(row, "RATIO_FIELDS", ()):
            setattr(row, name, None)


def verdict_record(verdict: LoadVerdict | None) -> dict[str, Any] | None:
    """The verdict as JSON values (None for a GPU run)."""
    return None if verdict is None else dataclasses.asdict(verdict)


def available_memory(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Bytes of memory this process can still take: the kernel's MemAvailable, or less where a cgroup (v2)
    limits the process; the free pages where there is no /proc/meminfo; None when neither says."""
    found = []
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path(cgroup, "memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path(cgroup, "memory.current").read_text()))
    except (OSError, ValueError):
        pass
    if not found:
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, AttributeError):
            return None
    return max(0, min(found))
