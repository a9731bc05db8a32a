"""The building blocks every cost model shares: the terms of a kernel's time (:class:`Terms`), programs
spread over SMs (:func:`list_schedule`, :func:`makespan`), tensor-core efficiency, memory time, a kernel pass
on the SMs (:class:`KernelPass`, :func:`occupancy`, :func:`block_time`), the host path's exposure, and the
problem arguments (:class:`Problem`)."""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from llm_speed.core.args import check_flag
from llm_speed.core.gpus import GPUSpec
from llm_speed.perf.prediction.calibration_data import (
    THREADS_PER_WARP,
    WARPS_PER_WARPGROUP,
    WGMMA_ROWS,
    GPUConstants,
)
from llm_speed.perf.prediction.names import CONTEXTS


@functools.lru_cache(maxsize=256)
def list_schedule(costs: tuple[float, ...], slots: int) -> float:
    """When the last of programs of ``costs`` (in launch order) ends on ``slots`` SMs that each take the next
    program as they free (the hardware's block scheduler, one program at a time per SM at the SM's full
    rate), in cost units. Equal costs: ``ceil(n / slots)`` of them; unequal ones depend on the order, which
    is why a causal kernel launches its longest programs first."""
    if not costs:
        return 0.0
    if len(set(costs)) == 1:
        return float(math.ceil(len(costs) / slots) * costs[0])
    free = [0] * min(slots, len(costs))
    for cost in costs:
        heapq.heapreplace(free, free[0] + cost)
    return float(max(free))


# A launch order too long to list: segments of (unit, repeats), a unit a tuple of runs (blocks, count) of
# programs of equal length (:func:`order_schedule`); a dense attention's order repeats one unit per pair.
Runs = tuple[tuple[int, int], ...]
ProgramOrder = tuple[tuple[Runs, int], ...]

# The most programs :func:`order_schedule` places one by one (unequal ones that no repeated pattern covers);
# past it the caller's problem is refused (about a second of Python).
MAX_SCHEDULED_PROGRAMS = 2**22


class ScheduleTooLong(ValueError):
    """A launch order :func:`order_schedule` would place past :data:`MAX_SCHEDULED_PROGRAMS` programs."""


def order_programs(order: ProgramOrder) -> int:
    return sum(repeats * sum(count for _, count in unit) for unit, repeats in order)


def order_blocks(order: ProgramOrder) -> int:
    return sum(repeats * sum(blocks * count for blocks, count in unit) for unit, repeats in order)


def _place_run(free: list[int], blocks: int, count: int) -> None:
    """Programs ``count`` of ``blocks`` each onto the heap ``free`` as :func:`list_schedule` places them one
    by one: they start at the ``count`` earliest of the times ``f + j * blocks`` (the SMs' free times ``f``);
    which of tied SMs takes one does not change the free times' multiset."""
    if blocks == 0 or count == 0:
        return  # a program of no blocks frees its SM at once
    if count <= len(free):
        for _ in range(count):
            heapq.heapreplace(free, free[0] + blocks)
        return

    def starts(t: int) -> int:  # programs that start at or before t
        return sum((t - f) // blocks + 1 for f in free if f <= t)

    low, high = free[0], free[0] + count * blocks
    while low < high:  # the last program's start: the first t with count starts by then
        mid = (low + high) // 2
        if starts(mid) >= count:
            high = mid
        else:
            low = mid + 1
    before = [(low - 1 - f) // blocks + 1 if f < low else 0 for f in free]
    left = count - sum(before)
    new = []
    for f, k in zip(free, before, strict=True):
        end = f + k * blocks
        if left and end == low:  # an SM free exactly at the last start takes one of the rest
            end, left = end + blocks, left - 1
        new.append(end)
    free[:] = new
    heapq.heapify(free)


@functools.lru_cache(maxsize=256)
def order_schedule(order: ProgramOrder, slots: int, limit: int = MAX_SCHEDULED_PROGRAMS) -> int | None:
    """:func:`list_schedule` of a :data:`ProgramOrder`, exactly (integer block counts), without listing it:
    equal programs in bulk, and a unit repeated until the SMs' free times, less their minimum, come back
    to a pattern seen before, then the rest of the repeats by that period's shift. None when more than
    ``limit`` programs would be placed one by one."""
    free = [0] * slots
    placed = 0
    replace = heapq.heapreplace
    for unit, repeats in order:
        cost = sum(min(count, slots + 1) for _, count in unit)  # a long run is placed in bulk
        seen: dict[tuple[int, ...], tuple[int, int]] = {}
        done = 0
        while done < repeats:
            key = tuple(f - free[0] for f in sorted(free))
            if key in seen:
                first, low = seen[key]
                period, shift = done - first, free[0] - low
                jumps = (repeats - done) // period
                free[:] = [f + jumps * shift for f in free]
                done += jumps * period
                seen.clear()
                if done >= repeats:
                    break
            seen[key] = (done, free[0])
            placed += cost
            if placed > limit:
                return None
            for blocks, count in unit:
                if count == 1:  # a causal kernel's programs: mostly one of each length
                    replace(free, free[0] + blocks)
                else:
                    _place_run(free, blocks, count)
            done += 1
    return max(free)


def makespan(program_times: Iterable[float], slots: int) -> tuple[float, int, float, float]:
    """(time, programs, waves, wave efficiency) of programs of the given durations on ``slots`` SMs taken in
    launch order by whichever SM frees first (:func:`list_schedule`; equal programs: ``ceil(programs /
    slots)`` program times, the wave quantization)."""
    times = tuple(program_times)
    if not times:
        return 0.0, 0, 0.0, 1.0
    time = list_schedule(times, slots)
    efficiency = sum(times) / (slots * time) if time > 0 else 1.0
    return time, len(times), len(times) / slots, efficiency


def uniform_makespan(program_s: float, programs: int, slots: int) -> tuple[float, int, float, float]:
    """:func:`makespan` of ``programs`` programs of ``program_s`` each, by arithmetic: a GEMM's tile count
    can be far too large to list (the list's efficiency summed the times; the product differs from that sum
    only in rounding)."""
    if programs <= 0:
        return 0.0, 0, 0.0, 1.0
    time = float(-(-programs // slots) * program_s)  # whole waves, in integers (exact at any count)
    efficiency = programs * program_s / (slots * time) if time > 0 else 1.0
    return time, programs, programs / slots, efficiency


def tensor_core_efficiency(params: dict[str, Any], rows: float, width: float, warps: int) -> float:
    """Fraction of the dense peak one tensor-core matmul of a program reaches: ``eta * N / (N + n_half)``
    for the instruction's N. Hopper's wgmma takes 64 rows per warpgroup: with fewer than 64 ``rows`` (or
    under 4 warps) the product runs Ampere's mma.sync instead (times ``sync``, N = ``width``); with fewer
    than 64 rows per warpgroup, Triton splits the ``width`` across the warpgroups (its warpsPerCTA layout),
    each issuing a narrower wgmma (N = width x rows / (64 x warpgroups))."""
    warpgroups = max(1, warps // WARPS_PER_WARPGROUP)
    n = float(width)
    factor = 1.0
    if rows < WGMMA_ROWS or warps < WARPS_PER_WARPGROUP:
        factor = float(params.get("sync", 1.0))
    elif rows < WGMMA_ROWS * warpgroups:
        n = width * rows / (WGMMA_ROWS * warpgroups)
    return factor * float(params["eta"]) * n / (n + float(params.get("n_half", 0.0)))


def host_exposed(host_s: float, device_s: float, context: str, flush_s: float) -> float:
    """The host time a call shows: beyond the device time and (bench) the L2 flush it overlaps."""
    if context == "isolated":
        return host_s
    if context == "graph":
        return 0.0
    hidden = flush_s if context == "bench" else 0.0
    return max(0.0, host_s - hidden)


def _combine(
    compute_s: float, memory_s: float, latency_s: float, host_s: float, context: str, flush_s: float
) -> tuple[float, str, float]:
    """(seconds, bound, host exposed) of a call from its terms (see the module docstring)."""
    device = latency_s + max(compute_s, memory_s)
    exposed = host_exposed(host_s, device, context, flush_s)
    seconds = device + exposed if context == "isolated" else max(device, exposed)
    if exposed >= device or latency_s >= max(compute_s, memory_s):
        bound = "latency"
    else:
        bound = "compute" if compute_s >= memory_s else "memory"
    return seconds, bound, exposed


def check_context(context: str) -> str:
    if context not in CONTEXTS:
        raise ValueError(f"context must be one of {', '.join(CONTEXTS)}, got {context!r}")
    return context


def host_path_seconds(impl_host: dict[str, Any], op: str) -> float:
    """The host path per call of ``op`` from an implementation's host table (0 when not listed)."""
    if not impl_host:
        return 0.0
    value = impl_host.get(op, impl_host.get("default", 0.0))
    return float(value)


@dataclass(frozen=True)
class Terms:
    compute_s: float
    memory_s: float
    latency_s: float
    dram_bytes: float
    l2_bytes: float
    bandwidth: float
    eta: float
    tile: tuple[int, ...] | None = None
    split_k: int = 1
    programs: int = 0
    waves: float = 0.0
    wave_efficiency: float = 1.0
    kernels: int = 1
    exp_s: float = 0.0
    dequant_s: float = 0.0
    notes: tuple[str, ...] = ()
    device_s: float | None = None  # several kernels in sequence: the sum of each one's time
    memory_overlap: float = 1.0  # how much of the shorter of compute and memory hides under the longer

    @property
    def device(self) -> float:
        if self.device_s is not None:
            return self.device_s
        longer, shorter = max(self.compute_s, self.memory_s), min(self.compute_s, self.memory_s)
        return self.latency_s + longer + (1.0 - self.memory_overlap) * shorter


def _bandwidth(params: dict[str, Any], consts: GPUConstants, active_programs: int) -> float:
    """Achievable DRAM bytes/s: the measured copy rate times the implementation's efficiency, capped by what
    the SMs that run a program can pull (``sm_bandwidth`` each)."""
    rate = consts.copy_bytes_per_s * float(params.get("bandwidth_efficiency", 1.0))
    per_sm = float(params.get("sm_bandwidth", 0.0))
    if per_sm:
        rate = min(rate, per_sm * min(active_programs, consts.spec.sm_count))
    return rate


def memory_time(params, consts, dram_bytes, l2_bytes, active_programs) -> tuple[float, float]:
    """(seconds, DRAM bytes/s) of a kernel's traffic: DRAM at the achievable rate plus the ramp, and the
    traffic the L2 serves at the L2's rate; the slower sets the time."""
    rate = _bandwidth(params, consts, active_programs)
    dram = dram_bytes / rate + float(params.get("memory_latency_s", 0.0)) if dram_bytes else 0.0
    # The rate the implementation's tiles reach the L2 at (TMA multicast across a cluster counts once).
    l2_rate = float(params.get("l2_bytes_per_s", consts.l2_bytes_per_s))
    l2 = (dram_bytes + l2_bytes) / l2_rate if l2_rate else 0.0
    return max(dram, l2), rate


class Problem(dict):
    """predict's problem arguments: taking one that was not given (and has no default) is a ValueError
    naming it and the op."""

    def __init__(self, op: str, problem: dict[str, Any]) -> None:
        super().__init__(problem)
        self.op = op

    _MISSING = object()

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self and default is Problem._MISSING:
            raise ValueError(f"{self.op}: missing problem argument {key!r}")
        return super().pop(key) if key in self else default


def pop_flag(problem: dict[str, Any], key: str, default: bool = False) -> bool:
    """A boolean problem argument: a real bool (TypeError naming it otherwise). Truthiness would read
    ``causal="false"`` or ``causal=2`` as causal."""
    return check_flag(key, problem.pop(key, default))


def no_more(problem: dict[str, Any], op: str) -> None:
    if problem:
        raise ValueError(f"{op}: unknown problem argument(s) {', '.join(sorted(problem))}")


@dataclass(frozen=True)
class KernelPass:
    """One kernel of an attention call, as the model sees it: its programs (``programs``: the block
    iterations of each, in launch order, a :data:`ProgramOrder`), what one block iteration does (tensor-core
    matmuls as (rows, width, FLOPs), exponentials), the registers its fp32 tiles need per thread, and its
    traffic (the minimum DRAM bytes it must move, the bytes one block iteration loads, which the L2 serves
    when they are re-reads). What the compiler made of it, where the calibration has the build compiled
    (``compiled_resources``): ``resident`` programs per SM and ``loop_spills``, the local-memory
    instructions (register spills) inside its loops; without, the occupancy is estimated from ``regs`` and
    no spill is assumed (the kernel budgets of ``make test`` hold every shipped configuration to none)."""

    name: str
    programs: ProgramOrder
    matmuls: tuple[tuple[float, float, float], ...]
    exps: float
    warps: int
    regs: float
    dram_bytes: float
    block_load_bytes: float
    unique_load_bytes: float  # the part of the block loads that is the minimum (read once from DRAM)
    tile: tuple[int, ...] = ()
    smem_bytes: float = 0.0  # shared memory one program holds (resident tiles + stages x streamed tiles)
    resident: int = 0  # programs per SM as compiled (0: estimated by occupancy())
    loop_spills: int = 0


def occupancy(spec: GPUSpec, kernel: KernelPass, params: dict[str, Any]) -> int:
    """Programs one SM holds at once: the compiled kernel's, else limited by shared memory
    (``smem_per_sm_kb``) and by the register file (64K registers: threads x (the tile's fp32 registers +
    ``regs_base``), at most 255 per thread)."""
    if kernel.resident:
        return kernel.resident
    smem = max(1.0, kernel.smem_bytes)
    by_smem = int(spec.smem_per_sm_kb * 1024 // smem)
    threads = kernel.warps * THREADS_PER_WARP
    regs = min(255.0, kernel.regs + float(params.get("regs_base", 40.0)))
    by_regs = int(spec.register_file_per_sm_kb * 1024 // 4 // (threads * regs))
    return max(1, min(by_smem, by_regs, int(params.get("max_programs_per_sm", 8))))


def block_time(
    params: dict[str, Any], consts: GPUConstants, peak: float, kernel: KernelPass
) -> tuple[float, float, float]:
    """(seconds, matmul seconds, softmax seconds) of one block iteration of ``kernel`` on one SM.

    Tensor cores: each matmul's FLOPs at :func:`tensor_core_efficiency` of its rows and width. Softmax: the
    block's exponentials on the special-function units plus ``alu_per_score`` CUDA-core operations per score
    (max, scale, subtract, convert). With two or more warpgroups one warpgroup's softmax runs while another's
    matmuls do (``overlap_multi`` of the shorter hidden), with one only the scheduler's interleaving
    (``overlap_single``). Plus ``block_s`` of bookkeeping, and ``spill_s`` for each register spill
    instruction in the loop, over the program's warpgroups (the others run while one waits). The K/V (or
    Q/dO) tile loads are prefetched ``stages - 1`` blocks ahead: a block cannot take less than ``load_s /
    (stages - 1)`` (one stage: the load is not hidden at all); the SM's other programs (:func:`occupancy`)
    add their warpgroups to the overlap and their stages to the prefetch depth."""
    sms = consts.spec.sm_count
    per_sm = peak / sms
    matmul_s = 0.0
    for rows, width, flops in kernel.matmuls:
        matmul_s += flops / (per_sm * tensor_core_efficiency(params, rows, width, kernel.warps))
    softmax_s = kernel.exps / (consts.sfu_per_s / sms)
    if consts.alu_per_s:
        softmax_s += kernel.exps * float(params.get("alu_per_score", 0.0)) / (consts.alu_per_s / sms)
    resident = occupancy(consts.spec, kernel, params)
    warpgroups = resident * max(1, kernel.warps // WARPS_PER_WARPGROUP)
    overlap = float(params.get("overlap_multi" if warpgroups >= 2 else "overlap_single", 0.0))
    seconds = max(matmul_s, softmax_s) + (1.0 - overlap) * min(matmul_s, softmax_s)
    seconds += float(params.get("block_s", 0.0))
    # Each spill in the loop stalls its warpgroup on local memory; another warpgroup hides part of it.
    warpgroups = max(1, kernel.warps // WARPS_PER_WARPGROUP)
    seconds += float(params.get("spill_s", 0.0)) * kernel.loop_spills / warpgroups
    load = float(params.get("load_s", 0.0))
    stages = kernel.tile[3] if len(kernel.tile) > 3 else 2
    depth = resident * stages - 1  # tiles in flight beyond the one being consumed, over the SM's programs
    seconds = max(seconds, load / depth) if depth > 0 else seconds + load
    return seconds, matmul_s, softmax_s


def pass_terms(params, consts: GPUConstants, peak: float, kernel: KernelPass) -> Terms:
    sms = consts.spec.sm_count
    per_sm = peak / sms
    block_s, matmul_s, exp_s = block_time(params, consts, peak, kernel)
    program_s = float(params.get("program_s", 0.0))
    count = order_programs(kernel.programs)
    blocks = order_blocks(kernel.programs)
    total = blocks * block_s + count * program_s
    waves = count / sms
    last = order_schedule(kernel.programs, sms)
    if last is None:
        raise ScheduleTooLong(
            f"{count:,} programs of unequal length in no repeating pattern: more than the "
            f"{MAX_SCHEDULED_PROGRAMS:,} the model schedules one by one"
        )
    compute = float(last) * block_s + math.ceil(waves) * program_s
    loads = blocks * kernel.block_load_bytes
    rereads = max(0.0, loads - kernel.unique_load_bytes)
    miss = float(params.get("l2_miss", 0.0))
    dram = kernel.dram_bytes + miss * rereads
    memory, rate = memory_time(params, consts, dram, (1.0 - miss) * rereads, min(count, sms))
    flops = sum(f for _, _, f in kernel.matmuls)
    eta = flops / (per_sm * matmul_s) if matmul_s else 0.0
    return Terms(
        compute_s=compute,
        memory_s=memory,
        latency_s=float(params.get("latency_s", 0.0)),
        dram_bytes=dram,
        l2_bytes=(1.0 - miss) * rereads,
        bandwidth=rate,
        eta=eta,
        tile=kernel.tile,
        programs=count,
        waves=waves,
        wave_efficiency=(total / (sms * compute)) if compute else 1.0,
        exp_s=exp_s * blocks / sms,
        memory_overlap=float(params.get("memory_overlap", 1.0)),
    )


def memory_pass_terms(params, consts: GPUConstants, name: str, dram_bytes: float, programs: int) -> Terms:
    """A streaming kernel (no matmul): its bytes at the achievable bandwidth."""
    memory, rate = memory_time(params, consts, dram_bytes, 0.0, programs)
    return Terms(
        compute_s=0.0,
        memory_s=memory,
        latency_s=float(params.get("latency_s", 0.0)),
        dram_bytes=dram_bytes,
        l2_bytes=0.0,
        bandwidth=rate,
        eta=0.0,
        programs=programs,
    )


def in_sequence(terms: Sequence[Terms]) -> Terms:
    """Kernels launched one after the other: times add; the first kernel with matmuls names the tile."""
    main = next((t for t in terms if t.eta), terms[0])
    device = sum(t.device for t in terms)
    return Terms(
        compute_s=sum(t.compute_s for t in terms),
        memory_s=sum(t.memory_s for t in terms),
        latency_s=sum(t.latency_s for t in terms),
        dram_bytes=sum(t.dram_bytes for t in terms),
        l2_bytes=sum(t.l2_bytes for t in terms),
        bandwidth=main.bandwidth,
        eta=main.eta,
        tile=main.tile,
        programs=main.programs,
        waves=main.waves,
        wave_efficiency=main.wave_efficiency,
        kernels=len(terms),
        exp_s=sum(t.exp_s for t in terms),
        device_s=device,
    )
