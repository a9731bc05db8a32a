"""``llm-speed bench op NAME``: any op of the table (:mod:`llm_speed.ops`) with an ``example`` problem, timed
against its ``baseline`` (the PyTorch function with the same call), with FLOPs and bytes from the row's cost.

The cost is what the op itself reports while it runs (``report_work``, read through a profiler block), so a
new op is benchmarked with no code here: its row's ``example`` and ``baseline`` are enough.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from llm_speed import ops
from llm_speed._output import print_table
from llm_speed.bench import report
from llm_speed.bench.report import bytes_text, cpu_memory
from llm_speed.bench.timing import measure
from llm_speed.core.intmath import MAX_TENSOR_BYTES
from llm_speed.profiler import CUDAProfiler

LLM_SPEED = "llm-speed"


@dataclasses.dataclass(frozen=True)
class OpMeasurement:
    """One implementation of one op at one size."""

    op: str
    impl: str  # "llm-speed" or the baseline's "module:attribute"
    size: int
    dtype: str
    device: str
    median_ms: float
    p20_ms: float
    p80_ms: float
    iterations: int
    timer: str
    flops: float | None  # the row's analytic cost of one call (None: the op reported no work)
    bytes_moved: float | None

    @property
    def tflops(self) -> float | None:
        return self.flops / (self.median_ms * 1e-3) / 1e12 if self.flops and self.median_ms > 0 else None

    @property
    def bandwidth_gb_s(self) -> float | None:
        return (
            self.bytes_moved / (self.median_ms * 1e-3) / 1e9
            if self.bytes_moved and self.median_ms > 0
            else None
        )


def examples() -> tuple[str, ...]:
    """The ops ``bench op`` can time (their row has an ``example``)."""
    return tuple(op.name for op in ops.OPS if op.example is not None)


def input_bytes(name: str, size: int, dtype: torch.dtype) -> int | None:
    """Bytes of the example problem's tensors at ``size``, counted on the meta device (nothing allocated);
    None when a tensor's size overflows what PyTorch can count."""
    try:
        args, kwargs = ops.get(name).example_problem(torch.device("meta"), dtype, size)
    except RuntimeError as error:  # "numel: integer multiplication overflow", "Storage size ... overflowed"
        if "overflow" not in str(error):
            raise
        return None
    # Counted here, in Python's integers: some meta factories (randn) skip the storage size's check.
    sizes = [t.numel() * t.element_size() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
    return None if any(n > MAX_TENSOR_BYTES for n in sizes) else sum(sizes)


def _needed_bytes(name: str, size: int, dtype: torch.dtype) -> int | None:
    """What the run needs at least: the inputs, and outputs as large as them (the op's and its baseline's
    results, a GEMM's C beside A and B); None when a tensor's size overflows."""
    inputs = input_bytes(name, size, dtype)
    return None if inputs is None else 2 * inputs


def _largest_size(name: str, dtype: torch.dtype, available: int | None) -> int:
    """The largest ``--size`` whose tensors PyTorch can represent and (``available`` not None) fit in it:
    the needed bytes grow with the size, so a bisection of meta-device problems (a millisecond each)."""

    def fits(size: int) -> bool:
        need = _needed_bytes(name, size, dtype)
        return need is not None and (available is None or need <= available)

    low, high = 0, 1
    while fits(high):
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def size_refusal(name: str, *, size: int, dtype: Any, device: torch.device,
                 available: int | None = None) -> str | None:  # fmt: skip
    """Why the example problem of ``size`` cannot run (None when it can): a tensor whose size PyTorch cannot
    count, or, on a CPU, more than the ``available`` bytes of memory (default: what
    :func:`llm_speed.bench.report.cpu_memory` finds; the system kills a process that takes more,
    while a GPU's out-of-memory error is reported by the harness)."""
    torch_dtype = ops.default_dtype(device, dtype)
    need = _needed_bytes(name, size, torch_dtype)
    if device.type != "cpu":
        available = None
    elif available is None:
        available = cpu_memory(device)
    if need is not None and (available is None or need <= available):
        return None
    largest = _largest_size(name, torch_dtype, available)
    accepted = f"accepted{' here' if available is not None else ''}: 1 to {largest}"
    if need is None:
        return (f"--size: {size} is too large: {name}'s example tensors would not be representable (their "
                f"sizes overflow PyTorch's 64-bit byte counts); {accepted}")  # fmt: skip
    return (f"--size: {name} at {size} needs at least {bytes_text(need)} (its inputs and outputs), "
            f"{bytes_text(available)} of memory is available here; {accepted}")


def run_op(
    name: str, *, size: int, dtype: Any, device: torch.device, warmup: int, iterations: int
) -> list[OpMeasurement]:
    """Time the op ``name`` (and its baseline, when the row has one) on its example problem of ``size``;
    ValueError, before anything is allocated, when the problem cannot be made (:func:`size_refusal`)."""
    row = ops.get(name)
    if row.example is None:
        raise ValueError(f"op: {name} has no example problem to benchmark; ops that have one: {examples()}")
    refusal = size_refusal(name, size=size, dtype=dtype, device=device)
    if refusal:
        raise ValueError(refusal)
    torch_dtype = ops.default_dtype(device, dtype)
    args, kwargs = row.example_problem(device, torch_dtype, size)
    function = row.load()
    profiler = CUDAProfiler(device)
    function(*args, **kwargs)  # warm up (compilation) before the costed run
    with profiler.profile(name):
        function(*args, **kwargs)
    cost = profiler.get_metrics(name)
    candidates = [(LLM_SPEED, function)]
    if row.baseline:
        candidates.append((row.baseline, row.load_baseline()))
    results = []
    for impl, fn in candidates:
        timing = measure(
            lambda fn=fn: fn(*args, **kwargs), warmup=warmup, iterations=iterations, device=device
        )
        results.append(
            OpMeasurement(
                op=name,
                impl=impl,
                size=size,
                dtype=str(torch_dtype).removeprefix("torch."),
                device=str(device),
                median_ms=timing.median_ms,
                p20_ms=timing.p20_ms,
                p80_ms=timing.p80_ms,
                iterations=timing.iterations,
                timer=timing.timer,
                flops=cost.flops,
                bytes_moved=cost.bytes_moved,
            )  # fmt: skip
        )
    return results


def timing_notes(rows: Sequence[OpMeasurement]) -> list[str]:
    """What the times mean where they were taken (:func:`llm_speed.bench.report.timing_notes`, as every
    benchmark says it): on a CPU, that they say nothing about a GPU, and whether llm-speed's row ran Triton's
    interpreter or the PyTorch fallback."""
    first = rows[0]
    plain = ops.get(first.op).plain_pytorch  # naive_attention: plain PyTorch on purpose, no kernel
    # (bench op measures no peak memory and predicts nothing: the other benchmarks' note on those is not its)
    notes = report.timing_notes(torch.device(first.device), [] if plain else [f"{LLM_SPEED}'s {first.op}"],
                                memory_and_predictions=False)  # fmt: skip
    if plain:
        notes.append(f"{first.op} is plain PyTorch by design: no Triton kernel runs in its row.")
    return notes


def results_payload(rows: Sequence[OpMeasurement], settings: dict[str, Any]) -> dict[str, Any]:
    """The JSON document, as the other benchmarks': provenance, ``settings``, what the times mean, and every
    measurement with its derived rates."""
    return {
        "benchmark": "op",
        "environment": report.environment(torch.device(rows[0].device)),
        "settings": settings,
        "notes": timing_notes(rows),
        "results": [
            {**dataclasses.asdict(row), "tflops": row.tflops, "bandwidth_gb_s": row.bandwidth_gb_s}
            for row in rows
        ],
    }


def print_op(rows: Sequence[OpMeasurement], console: Any, *, ratios: bool = True) -> None:
    """One table: time (median, p20-p80), rates from the row's cost, and the speed-up over the baseline
    (with ``ratios``: not after a busy CPU run)."""
    baseline = next((row.median_ms for row in rows if row.impl != LLM_SPEED), None)
    first = rows[0]
    table = []
    for row in rows:
        spread = f"{row.p20_ms:.3g}-{row.p80_ms:.3g}"
        cells = [row.impl, row.median_ms, spread, row.tflops, row.bandwidth_gb_s]
        if ratios:
            cells.append(f"{baseline / row.median_ms:.3g}x" if baseline and row.median_ms > 0 else None)
        table.append(cells)
    print_table(
        f"{first.op}: size {first.size}, {first.dtype}, {first.device}",
        ["impl", "median ms", "p20-p80 ms", "TFLOP/s", "GB/s", *(["speed-up vs baseline"] if ratios else [])],
        table,
        caption=f"{first.iterations} timed runs ({first.timer}); FLOPs and bytes from llm_speed.ops",
        console=console,
    )
    for note in timing_notes(rows):
        console.print(f"note: {note}", highlight=False, markup=False)
