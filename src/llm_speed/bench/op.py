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
from llm_speed.bench.timing import measure
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
    def gb_per_s(self) -> float | None:
        return (
            self.bytes_moved / (self.median_ms * 1e-3) / 1e9
            if self.bytes_moved and self.median_ms > 0
            else None
        )


def examples() -> tuple[str, ...]:
    """The ops ``bench op`` can time (their row has an ``example``)."""
    return tuple(op.name for op in ops.OPS if op.example is not None)


def run_op(
    name: str, *, size: int, dtype: Any, device: torch.device, warmup: int, iterations: int
) -> list[OpMeasurement]:
    """Time the op ``name`` (and its baseline, when the row has one) on its example problem of ``size``."""
    row = ops.get(name)
    if row.example is None:
        raise ValueError(f"op: {name} has no example problem to benchmark; ops that have one: {examples()}")
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


def results_payload(rows: Sequence[OpMeasurement]) -> dict[str, Any]:
    """The JSON document: every measurement with its derived rates."""
    return {
        "results": [
            {**dataclasses.asdict(row), "tflops": row.tflops, "gb_per_s": row.gb_per_s} for row in rows
        ]
    }


def print_op(rows: Sequence[OpMeasurement], console: Any, *, ratios: bool = True) -> None:
    """One table: time (median, p20-p80), rates from the row's cost, and the speed-up over the baseline
    (with ``ratios``: not after a busy CPU run)."""
    baseline = next((row.median_ms for row in rows if row.impl != LLM_SPEED), None)
    first = rows[0]
    table = []
    for row in rows:
        cells = [row.impl, row.median_ms, f"{row.p20_ms:.3g}-{row.p80_ms:.3g}", row.tflops, row.gb_per_s]
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
