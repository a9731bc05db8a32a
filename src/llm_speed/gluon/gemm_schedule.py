"""A PyTorch model of the Gluon GEMM's schedule (:mod:`llm_speed.gluon.gemm`), run on a CPU where Gluon has
no interpreter: the same persistent programs over the same tiles in the same grouped order, the same ring of
``STAGES`` slots with its "ready" and "empty" mbarriers and their phase parities, the same producer and
consumer steps (one wgmma kept in flight, a slot released once the product reading it has retired), the same
split of each tile's rows between the two consumer warpgroups, fp32 accumulation and the output rounded once
(int8 operands: exact integer accumulation, the int32 output wrapping as the kernel's int32 accumulator does).

The producer and the consumers of each program run as two agents interleaved by a seeded random scheduler,
so a protocol fault shows on a CPU: a consumer reading a slot the producer has refilled (the product
retires against another tile's data), or both agents blocked (a hang on the GPU); either raises
:class:`~llm_speed.gluon.protocol.ScheduleError`. A product reads its slot when it retires (the latest a
wgmma may read shared memory), which is the worst case for a slot released too early.

What it does not model: wgmma's order of additions inside one K step, and timing.
"""

from __future__ import annotations

import dataclasses
import random
from collections import deque
from collections.abc import Iterator

import torch

from ..core.launch import cdiv
from . import protocol

WARPGROUPS = 2  # the consumers: two warpgroups, each owning half of a tile's rows


@dataclasses.dataclass(frozen=True)
class Schedule:
    """What fixes the schedule, as the launch fixes it (:func:`from_plan` reads it off a ``GluonPlan``)."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    group_m: int
    programs: int
    trans_b: bool = False


def from_plan(plan) -> Schedule:
    """The :class:`Schedule` of a Gluon GEMM plan (:func:`llm_speed.gluon.gemm._plan`): its tile, ring depth,
    grouping, persistent grid and layout of ``b``."""
    f = plan.fixed
    return Schedule(f["BLOCK_M"], f["BLOCK_N"], f["BLOCK_K"], f["STAGES"], f["GROUP_M"], plan.grid[0],
                    f["TRANS_B"])  # fmt: skip


def tile_coordinates(tile: int, tiles_m: int, tiles_n: int, group_m: int) -> tuple[int, int]:
    """(tile row, tile column) of linear tile ``tile``: column by column inside bands of ``group_m`` tile rows
    (the kernel's ``llm_speed.gluon.gemm.tile_coordinates``)."""
    per_band = group_m * tiles_n
    first_row = (tile // per_band) * group_m
    rows = min(tiles_m - first_row, group_m)
    return first_row + (tile % per_band) % rows, (tile % per_band) // rows


def program_tiles(program: int, programs: int, tiles: int) -> range:
    """The tiles of persistent program ``program``: program, program + programs, ... (the kernel's loop)."""
    return range(program, tiles, programs)


def _padded(x: torch.Tensor, rows: slice, columns: slice, shape: tuple[int, int]) -> torch.Tensor:
    """A TMA load: the box at (rows, columns), zero where it lies past the tensor."""
    box = torch.zeros(shape, dtype=x.dtype)
    part = x[rows, columns]
    box[: part.shape[0], : part.shape[1]] = part
    return box


class Program:
    """One persistent program: its ring, barriers, and the two partitions as agents (generators yielding
    whether they progressed)."""

    def __init__(self, a, b, out, schedule: Schedule, program: int):
        s = self.s = schedule
        self.a, self.b, self.out, self.program = a, b, out, program
        self.m, k = a.shape
        self.n = out.shape[1]
        self.tiles_m, self.tiles_n = cdiv(self.m, s.block_m), cdiv(self.n, s.block_n)
        self.k_steps = cdiv(k, s.block_k)
        self.tiles = program_tiles(program, s.programs, self.tiles_m * self.tiles_n)
        self.ring: list[tuple | None] = [None] * s.stages  # (tag, A box [BM, BK], B box [BK, BN])
        self.ready = [protocol.Barrier() for _ in range(s.stages)]
        self.empty = [protocol.Barrier() for _ in range(s.stages)]

    def _load(self, row: int, column: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.s
        rows = slice(row * s.block_m, (row + 1) * s.block_m)
        ks = slice(step * s.block_k, (step + 1) * s.block_k)
        columns = slice(column * s.block_n, (column + 1) * s.block_n)
        box_a = _padded(self.a, rows, ks, (s.block_m, s.block_k))
        if s.trans_b:  # the kernel loads [BN, BK] and hands wgmma its transposed view
            return box_a, _padded(self.b, columns, ks, (s.block_n, s.block_k)).T
        return box_a, _padded(self.b, ks, columns, (s.block_k, s.block_n))

    def producer(self) -> Iterator[bool]:
        s, filled = self.s, 0
        for tile in self.tiles:
            row, column = tile_coordinates(tile, self.tiles_m, self.tiles_n, s.group_m)
            for step in range(self.k_steps):
                slot = filled % s.stages
                yield from protocol.wait(self.empty[slot], ((filled // s.stages) & 1) ^ 1)
                self.ring[slot] = ((tile, step), *self._load(row, column, step))
                self.ready[slot].arrive()  # the TMA's bytes have landed
                filled += 1
                yield True

    def consumers(self) -> Iterator[bool]:
        s, used = self.s, 0
        half = s.block_m // WARPGROUPS
        in_flight: deque = deque()  # (slot, tag) of each product issued and not yet retired
        # int8: exact in int64; the kernel's int32 sums wrap, and the int32 output of these wraps the same
        # (addition modulo 2**32 does not depend on the order)
        exact = self.a.dtype == torch.int8
        acc = torch.zeros(WARPGROUPS, half, s.block_n, dtype=torch.int64 if exact else torch.float32)

        def retire() -> None:  # a product reads its slot when it retires: the latest it may
            slot, tag = in_flight.popleft()
            got, box_a, box_b = self.ring[slot] or (None, None, None)
            if got != tag:
                raise protocol.ScheduleError(
                    f"program {self.program}: the product of (tile, step) {tag} read slot {slot} refilled "
                    f"with {got}"
                )
            for w in range(WARPGROUPS):  # each warpgroup its own rows, one shared B box
                rows = box_a[w * half : (w + 1) * half]
                acc[w] += rows.long() @ box_b.long() if exact else rows.float() @ box_b.float()

        for tile in self.tiles:
            row, column = tile_coordinates(tile, self.tiles_m, self.tiles_n, s.group_m)
            acc.zero_()
            for step in range(self.k_steps):
                slot = used % s.stages
                yield from protocol.wait(self.ready[slot], (used // s.stages) & 1)
                in_flight.append((slot, (tile, step)))
                while len(in_flight) > 1:  # warpgroup_mma_wait(1)
                    retire()
                if step > 0:  # the previous slot's product has retired
                    self.empty[(used + s.stages - 1) % s.stages].arrive()
                used += 1
                yield True
            while in_flight:  # warpgroup_mma_wait(0)
                retire()
            self.empty[(used + s.stages - 1) % s.stages].arrive()
            rows = slice(row * s.block_m, min((row + 1) * s.block_m, self.m))
            columns = slice(column * s.block_n, min((column + 1) * s.block_n, self.n))
            tile_out = acc.reshape(s.block_m, s.block_n).to(self.out.dtype)  # the TMA store clips
            self.out[rows, columns] = tile_out[: rows.stop - rows.start, : columns.stop - columns.start]
            yield True


# What an entry no program writes holds: NaN, or for int8's int32 output its most negative value.
UNWRITTEN_INT32 = torch.iinfo(torch.int32).min


def gemm(a: torch.Tensor, b: torch.Tensor, schedule: Schedule, *, seed: int = 0) -> torch.Tensor:
    """``a @ b`` (``a @ b.T`` with ``schedule.trans_b``) computed as the kernel's schedule computes it, on the
    CPU, in the operands' dtype (int8: int32); the two partitions of each program interleaved by
    ``random.Random(seed)``. Entries no program writes stay NaN (int32: :data:`UNWRITTEN_INT32`)."""
    n = b.shape[0] if schedule.trans_b else b.shape[1]
    if a.dtype == torch.int8:
        out = torch.full((a.shape[0], n), UNWRITTEN_INT32, dtype=torch.int32)
    else:
        out = torch.full((a.shape[0], n), float("nan"), dtype=a.dtype)
    rng = random.Random(seed)
    for program in range(schedule.programs):
        state = Program(a, b, out, schedule, program)
        protocol.interleave([state.producer(), state.consumers()], rng, program)
    return out
