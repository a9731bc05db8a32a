"""A PyTorch model of the block-scaled fp8 Gluon GEMM's schedule (:mod:`llm_speed.gluon.gemm_fp8`), run on a
CPU where Gluon has no interpreter. The producer, ring, barriers, persistent programs and grouped tile order
are :mod:`llm_speed.gluon.gemm_schedule`'s (the kernel shares its producer); what this adds is the
consumers' promotion, at the kernel's points, in each of the two consumer warpgroups (partitions of their
own in the kernel, agents of their own here; a slot is refilled once both have freed it):

- per K step one product of the slot's A and B boxes, from zero (the kernel's ``use_acc=False`` wgmma),
  over the warpgroup's 64 rows, read when it retires, the slot freed at once (``warpgroup_mma_wait(0)``, then
  the warpgroup's "empty" arrive);
- then ``acc = fma(product, scale_a[row, group] * scale_b[n block, group], acc)`` in fp32; rows past M take
  row M - 1's scale (their A is zero, their output clipped);
- after the tile, the bias added in fp32 and one rounding to the output dtype, the warpgroup's rows
  stored, clipped at M and N.

The product of one step is summed in fp32 here; Hopper's fp8 wgmma keeps fewer bits inside a step
(DeepSeek-V3, arXiv:2412.19437 section 3.3.2), which is why the kernel promotes every 128-wide step: the GPU
test compares the kernel itself with float64. The model also takes tiles smaller than the kernel's (tests:
many programs, ring wraps); their K steps must divide a scaling group and their columns a block of b's
scales, so each step reads one ``scale_a`` column and one ``scale_b`` value.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch

from . import gemm_schedule, protocol
from .gemm_schedule import WARPGROUPS, Schedule, tile_coordinates

SCALE_BLOCK = 128  # the kernel's: a K group of scale_a, a block side of scale_b


def from_plan(plan) -> Schedule:
    """The :class:`~llm_speed.gluon.gemm_schedule.Schedule` of a Gluon fp8 GEMM plan
    (:func:`llm_speed.gluon.gemm_fp8._plan`): tile, ring depth, grouping and persistent grid; b is [N, K]."""
    f = plan.fixed
    return Schedule(f["BLOCK_M"], f["BLOCK_N"], f["BLOCK_K"], f["STAGES"], f["GROUP_M"], plan.grid[0], True)


# The kernel's "empty" barriers count an arrival from each consumer warpgroup: a slot is refilled only once
# both products reading it have retired.
EMPTY_ARRIVALS = WARPGROUPS


class Program(gemm_schedule.Program):
    """One persistent program: the GEMM model's producer and ring, and the two consumer warpgroups as agents
    of their own (the kernel's two consumer partitions), each promoting its rows."""

    def __init__(self, a, b, out, schedule: Schedule, program: int, scale_a, scale_b, bias):
        if not schedule.trans_b or SCALE_BLOCK % schedule.block_k or SCALE_BLOCK % schedule.block_n:
            raise ValueError(f"{schedule}: b must be [N, K] (trans_b) and block_k, block_n must divide "
                             f"{SCALE_BLOCK}")  # fmt: skip
        super().__init__(a, b, out, schedule, program)
        self.empty = [protocol.Barrier(EMPTY_ARRIVALS) for _ in range(schedule.stages)]
        self.scale_a, self.scale_b, self.bias = scale_a, scale_b, bias

    def step_scale(self, rows: torch.Tensor, column: int, step: int) -> torch.Tensor:
        """The fp32 scale of each row's product at K step ``step`` of tile column ``column``."""
        s = self.s
        group = step * s.block_k // SCALE_BLOCK
        block = column * s.block_n // SCALE_BLOCK
        return self.scale_a[rows, group] * self.scale_b[block, group]

    def consumer(self, warpgroup: int) -> Iterator[bool]:
        """Consumer warpgroup ``warpgroup``: rows [warpgroup * BM / 2, + BM / 2) of every tile."""
        s, used = self.s, 0
        half = s.block_m // WARPGROUPS
        mine = slice(warpgroup * half, (warpgroup + 1) * half)
        acc = torch.zeros(half, s.block_n)
        for tile in self.tiles:
            row, column = tile_coordinates(tile, self.tiles_m, self.tiles_n, s.group_m)
            first = row * s.block_m + warpgroup * half
            rows = (first + torch.arange(half)).clamp(max=self.m - 1)
            acc.zero_()
            for step in range(self.k_steps):
                slot = used % s.stages
                scale = self.step_scale(rows, column, step).reshape(half, 1)
                yield from protocol.wait(self.ready[slot], (used // s.stages) & 1)
                yield True  # the product issued; it reads its slot when it retires
                got, box_a, box_b = self.ring[slot] or (None, None, None)
                if got != (tile, step):
                    raise protocol.ScheduleError(
                        f"program {self.program}: warpgroup {warpgroup}'s product of (tile, step) "
                        f"{(tile, step)} read slot {slot} refilled with {got}"
                    )
                product = box_a[mine].float() @ box_b.float()
                self.empty[slot].arrive()  # warpgroup_mma_wait(0): retired, this warpgroup frees the slot
                # one FMA per element: the exact product rounded once with the sum
                acc.copy_((acc.double() + product.double() * scale.double()).float())
                used += 1
                yield True
            out = acc
            columns = slice(column * s.block_n, min((column + 1) * s.block_n, self.n))
            if self.bias is not None:
                bias = torch.zeros(s.block_n)
                bias[: columns.stop - columns.start] = self.bias[columns].float()
                out = out + bias
            out_rows = slice(first, max(first, min(first + half, self.m)))  # the TMA store clips
            self.out[out_rows, columns] = out.to(self.out.dtype)[: out_rows.stop - out_rows.start,
                                                                 : columns.stop - columns.start]  # fmt: skip
            yield True


def gemm_fp8(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
             schedule: Schedule, *, out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
             seed: int = 0) -> torch.Tensor:  # fmt: skip
    """``(a * scale_a) @ (b * scale_b).T + bias`` (fp8 ``a`` [M, K], ``b`` [N, K], scales [M, cdiv(K, 128)]
    and [cdiv(N, 128), cdiv(K, 128)]) computed as the kernel's schedule computes it, on the CPU, the two
    partitions of each program interleaved by ``random.Random(seed)``. Entries no program writes stay NaN."""
    out = torch.full((a.shape[0], b.shape[0]), float("nan"), dtype=out_dtype)
    rng = random.Random(seed)
    for program in range(schedule.programs):
        state = Program(a, b, out, schedule, program, scale_a.float(), scale_b.float(), bias)
        agents = [state.producer()] + [state.consumer(w) for w in range(WARPGROUPS)]
        protocol.interleave(agents, rng, program)
    return out
