#!/usr/bin/env python3
"""The fused ops at sizes where the kernels, not the host, set the time: forward + backward of rms_norm,
SwiGLU and rotary with llm-speed, eager PyTorch, ``torch.compile`` and Liger-Kernel (when its wheel is
installed), each row with its wall time beside the profiler's kernel time and GB/s of both.

``bench ops`` at a Llama-3-8B layer (8192 tokens) timed the host path: rms_norm forward + backward took
0.527 ms of wall time, its per-call cost in training mode (``bench overhead``), so its ratios compared Python
overheads. Here the tokens are 8x that, and the kernel time (``torch.profiler``: the device time of every
CUDA kernel the step launched, per step) says what the kernels did; bytes are the op table's (each input
read once, each output written once, as ``bench ops`` counts them). First, the yardstick of the targets
(issue 74: the fused kernels and the large-batch decode at >= 85% of it): the device's copy bandwidth,
``dst.copy_(src)`` of 1 GiB, bytes read plus written over the median time, in the same process.

    python benchmarks/fused_kernel_time.py --output fused.json [--tokens 65536] [--impl llm_speed eager]
    python benchmarks/fused_kernel_time.py --check           parse and size the problems, run nothing

Writes the JSON after every row (a cut run keeps its rows). Needs CUDA except with --check.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

OPS = ("rms_norm", "swiglu", "rotary")
IMPLS = ("llm_speed", "eager", "torch.compile", "liger")
COPY_BYTES = 1 << 30  # the copy's source: 1 GiB, hundreds of microseconds on an H100 (~3 TB/s read + write)


def settings_for(args: argparse.Namespace):
    from llm_speed.bench.ops import GPU_DEFAULTS, OpsSettings, check_settings

    sizes = {
        name: GPU_DEFAULTS[name]
        for name in ("hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim", "vocab")
    }
    settings = OpsSettings(
        ops=tuple(args.ops),
        tokens=args.tokens,
        **sizes,
        dtype="bf16",
        impls=tuple(args.impl),
        warmup=args.warmup,
        iterations=args.iterations,
        min_time_s=0.0,
        device="cuda",
    )
    check_settings(settings)
    return settings


def _wall_ms(step, iterations: int) -> float:
    """Median over ``iterations`` of one step between CUDA events."""
    import torch

    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure_copy(device, iterations: int, warmup: int, source_bytes: int = COPY_BYTES) -> dict:
    """The device's copy bandwidth: ``dst.copy_(src)`` of ``source_bytes``, read + written bytes over the
    median wall time (CUDA events) and over the profiler's kernel time."""
    import torch

    from llm_speed.bench.overhead import kernel_us

    src = torch.empty(source_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    step = functools.partial(torch.empty_like(src).copy_, src)
    for _ in range(warmup):
        step()
    wall = _wall_ms(step, iterations)
    kernel = kernel_us(step, iterations) / 1000.0
    del src, step
    torch.cuda.empty_cache()
    moved = 2 * source_bytes
    return {"what": "dst.copy_(src), bytes read + written", "bytes": moved, "wall_ms": wall,
            "kernel_ms": kernel, "wall_gbps": moved / wall / 1e6,
            "kernel_gbps": moved / kernel / 1e6 if kernel > 0 else None}  # fmt: skip


def measure_row(op: str, impl: str, settings, device) -> dict:
    import torch

    from llm_speed.bench.ops import liger_unavailable, op_cost, shape_label, step_builder
    from llm_speed.bench.overhead import kernel_us

    flops, moved = op_cost(op, settings)
    row = {"op": op, "impl": impl, "shape": shape_label(op, settings), "bytes": moved, "flops": flops}
    reason = liger_unavailable(device) if impl == "liger" else None
    if reason is not None:
        return {**row, "available": False, "reason": reason}
    try:
        began = time.perf_counter()
        step = step_builder(op, impl, settings, device)()
        for _ in range(settings.warmup):  # the first runs compile (Triton, torch.compile)
            step()
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - began
        wall = _wall_ms(step, settings.iterations)
        kernel = kernel_us(step, settings.iterations) / 1000.0  # the profiler's CUDA kernel time per step
    except Exception as error:  # noqa: BLE001 - one implementation's failure must not cost the others
        return {**row, "available": False, "reason": f"{type(error).__name__}: {error}"}
    finally:
        torch.cuda.empty_cache()
    return {
        **row,
        "available": True,
        "wall_ms": wall,
        "kernel_ms": kernel,
        "warmup_s": warm_s,
        "wall_gbps": moved / wall / 1e6,
        "kernel_gbps": moved / kernel / 1e6 if kernel > 0 else None,
        "kernel_share_of_wall": kernel / wall if wall > 0 else None,
    }


def row_line(op: str, impl: str, row: dict) -> str:
    """A row's printed line; '-' for a figure not measured (``kernel_gbps`` is None when the profiler saw
    no kernel: formatting it as a number stopped the step at its first row, before the row was written)."""
    if not row["available"]:
        return f"{op:<9} {impl:<14} not run: {row['reason']}"

    def figure(key: str, spec: str) -> str:
        return "-".rjust(int(spec.split(".")[0])) if row.get(key) is None else format(row[key], spec)

    times = f"wall {figure('wall_ms', '8.3f')} ms  kernel {figure('kernel_ms', '8.3f')} ms"
    return f"{op:<9} {impl:<14} {times}  {figure('kernel_gbps', '7.0f')} GB/s (kernel)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
    parser.add_argument("--impl", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--tokens", type=int, default=65536, help="rows of every op (default 8 x 8192)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--output", type=Path, help="JSON, rewritten after every row")
    parser.add_argument("--check", action="store_true", help="check the settings and costs; run nothing")
    args = parser.parse_args(argv)
    for name in ("tokens", "warmup", "iterations"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name} must be positive, got {getattr(args, name)}")
    settings = settings_for(args)
    if args.check:
        from llm_speed.bench.ops import op_cost, shape_label

        print(f"copy {COPY_BYTES >> 30} GiB: {2 * COPY_BYTES / 1e9:.2f} GB read + written (the yardstick)")
        for op in settings.ops:
            flops, moved = op_cost(op, settings)
            print(f"{op} {shape_label(op, settings)}: {moved / 1e9:.2f} GB, {flops / 1e9:.1f} GFLOP per step")
        return 0
    import torch

    from llm_speed._output import dump_json
    from llm_speed.bench.report import environment

    if not torch.cuda.is_available():
        print("fused_kernel_time.py: needs a CUDA GPU (or --check)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    document = {
        "environment": environment(device),
        "tokens": settings.tokens,
        "dtype": settings.dtype,
        "what": "forward + backward per step; kernel_ms from torch.profiler (CUDA kernels' device "
        "time per step), wall_ms between CUDA events (median)",
        "results": [],
        "complete": False,  # true after the last row: a cut run's file says it is partial
    }
    try:  # never run on a GPU yet: a failure here must not cost the ops' rows
        document["copy"] = measure_copy(device, settings.iterations, settings.warmup)
        print(f"copy      {COPY_BYTES >> 30} GiB      wall {document['copy']['wall_ms']:8.3f} ms  "
              f"{document['copy']['wall_gbps']:7.0f} GB/s (read + write)", flush=True)  # fmt: skip
    except Exception as error:  # noqa: BLE001
        document["copy"] = {"error": f"{type(error).__name__}: {error}"}
        print(f"copy not measured: {document['copy']['error']}", flush=True)
    failed = 0
    # implementations outer: every op's own kernels are timed before torch.compile's compiles (the slowest
    # rows) start, so a run cut by its cap keeps them
    for impl in settings.impls:
        for op in settings.ops:
            row = measure_row(op, impl, settings, device)
            document["results"].append(row)
            failed += not row["available"] and impl != "liger"
            print(row_line(op, impl, row), flush=True)
            if args.output is not None:  # (whole or not at all: a run cut during the write keeps the last)
                dump_json(document, args.output)
    document["complete"] = True
    if args.output is not None:
        dump_json(document, args.output)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
