"""The mbarrier protocol of the Gluon kernels' schedule models (:mod:`llm_speed.gluon.gemm_schedule`,
:mod:`llm_speed.gluon.attention_schedule`): barriers with phase parities, waits, and a seeded random
interleaving of a program's partitions that reports a hang instead of spinning."""

from __future__ import annotations

import random
from collections.abc import Iterator

# Arrivals on any barrier so far: a step that arrived made progress, whatever it yielded after (an agent may
# arrive and then block in one step).
_arrivals = 0


class ScheduleError(RuntimeError):
    """The schedule broke its protocol: data overwritten before use, or every agent blocked."""


class Barrier:
    """An mbarrier: arrivals complete a phase; ``passed(parity)`` is ``mbarrier.try_wait.parity`` (true once
    the phase of that parity has completed, so a fresh barrier passes parity 1 at once)."""

    def __init__(self, count: int = 1):
        self.count = count
        self.pending = count
        self.completed = 0

    def arrive(self) -> None:
        global _arrivals
        _arrivals += 1
        self.pending -= 1
        if self.pending == 0:
            self.completed += 1
            self.pending = self.count

    def passed(self, parity: int) -> bool:
        return self.completed % 2 != parity


def wait(barrier: Barrier, parity: int) -> Iterator[bool]:
    """``mbarrier.wait(barrier, parity)`` as an agent's steps: False while blocked, then True."""
    while not barrier.passed(parity):
        yield False  # blocked
    yield True


def interleave(agents: list[Iterator[bool]], rng: random.Random, program: int) -> None:
    """Step randomly chosen agents until all finish; ScheduleError when every live agent is blocked."""
    live = list(agents)
    blocked: set[int] = set()
    while live:
        index = rng.randrange(len(live))
        before = _arrivals
        try:
            progressed = next(live[index]) or _arrivals != before
        except StopIteration:
            live.pop(index)
            blocked = set()
            continue
        if progressed:
            blocked = set()
        else:
            blocked.add(id(live[index]))
            if len(blocked) == len(live):
                raise ScheduleError(f"program {program}: every partition is waiting on an mbarrier (a hang)")
