"""``llm-speed bench ops``: each fused op (forward + backward) against eager PyTorch and ``torch.compile`` of
the same expression, with GB/s against the device's HBM peak and peak memory.

Bytes are the minimum HBM traffic of a forward + backward (every input read once, every output written
once), so GB/s / peak says how close an op comes to the memory roofline. Fused linear cross-entropy is
GEMM-bound: it reports time and peak memory, not GB/s. On the CPU, times are host-clock times of whatever
ran (the Triton interpreter or the PyTorch fallback), useful only to check that the command works; peak
memory is measured on CUDA only.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from llm_speed.bench import report, timing
from llm_speed.bench.options import OPS_DTYPES as DTYPES
from llm_speed.bench.options import OPS_IMPLS as IMPLS
from llm_speed.fused.cross_entropy import fused_linear_cross_entropy
from llm_speed.fused.rms_norm import rms_norm
from llm_speed.fused.rotary import apply_rotary
from llm_speed.fused.swiglu import swiglu

# Problem sizes: Llama-3-8B's layers at 8192 tokens on a GPU; tiny ones on the CPU.
SIZES = {
    "cuda": {"rows": 8192, "hidden": 4096, "intermediate": 14336, "heads": 32, "seq": 2048, "head_dim": 128,
             "batch": 4, "vocab": 128256},
    "cpu": {"rows": 64, "hidden": 96, "intermediate": 160, "heads": 2, "seq": 16, "head_dim": 32, "batch": 1,
            "vocab": 300},
}  # fmt: skip


@dataclasses.dataclass
class OpRow:
    op: str
    impl: str
    shape: str
    bytes_moved: int | None
    median_ms: float | None = None
    gbps: float | None = None
    hbm_fraction: float | None = None
    peak_mib: float | None = None
    unavailable: str | None = None


def _eager_rms_norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6) * w.float()).to(x.dtype)


def _eager_swiglu(gate, up):
    return F.silu(gate) * up


def _eager_rotary(x, cos, sin):
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def _eager_cross_entropy(hidden, weight, target):
    return F.cross_entropy((hidden @ weight.t()).float(), target)


def _cases(sizes: dict[str, int], dtype: torch.dtype, device: torch.device):
    """(op, shape, bytes of forward + backward, inputs maker, {impl: fn}) for each op."""
    b = torch.tensor([], dtype=dtype).element_size()
    r, h, i = sizes["rows"], sizes["hidden"], sizes["intermediate"]
    bb, nh, s, d, v = sizes["batch"], sizes["heads"], sizes["seq"], sizes["head_dim"], sizes["vocab"]

    def randn(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    def rotary_inputs():
        theta = torch.arange(s, device=device)[:, None] * 1e-2 * torch.arange(d // 2, device=device)
        return randn(bb, nh, s, d), theta.cos().to(dtype), theta.sin().to(dtype)

    return [
        ("rms_norm", f"{r}x{h}", 5 * r * h * b, lambda: (randn(r, h), randn(h)),
         {"llm_speed": rms_norm, "eager": _eager_rms_norm}),
        ("swiglu", f"{r}x{i}", 8 * r * i * b, lambda: (randn(r, i), randn(r, i)),
         {"llm_speed": swiglu, "eager": _eager_swiglu}),
        ("rotary", f"{bb}x{nh}x{s}x{d}", 4 * bb * nh * s * d * b, rotary_inputs,
         {"llm_speed": apply_rotary, "eager": _eager_rotary}),
        ("linear_cross_entropy", f"N={r} H={h} V={v}", None,
         lambda: (randn(r, h), randn(v, h), torch.randint(0, v, (r,), device=device)),
         {"llm_speed": fused_linear_cross_entropy, "eager": _eager_cross_entropy}),
    ]  # fmt: skip


def _step(fn: Callable, inputs: tuple) -> Callable[[], Any]:
    def run():
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
        return out

    return run


def run_ops(*, dtype: str, device: torch.device, impls=IMPLS, warmup: int, iterations: int, sizes=None):
    """Measure every op with every implementation in ``impls``; returns OpRow's (unavailable ones say why)."""
    torch_dt = report.torch_dtype(dtype, DTYPES)
    sizes = sizes or SIZES["cuda" if device.type == "cuda" else "cpu"]
    gpu, _ = report.prediction_gpu(device)
    rows = []
    for op, shape, bytes_moved, make_inputs, fns in _cases(sizes, torch_dt, device):
        for impl in impls:
            row = OpRow(op, impl, shape, bytes_moved)
            rows.append(row)
            fn = fns["eager"] if impl == "torch.compile" else fns[impl]
            try:
                if impl == "torch.compile":
                    torch._dynamo.reset()
                    fn = torch.compile(fn)
                step = _step(fn, make_inputs())
                t = timing.measure(step, warmup=max(warmup, 1 if impl == "torch.compile" else 0),
                                   iterations=iterations, device=device)  # fmt: skip
                memory = timing.peak_memory(step, device)
            except Exception as error:  # noqa: BLE001 - one failing implementation must not end the run
                row.unavailable = unavailable_reason(error)
                continue
            row.median_ms = t.median_ms
            row.peak_mib = report.mib(memory.peak_bytes)
            if bytes_moved is not None:
                row.gbps = bytes_moved / (t.median_ms * 1e-3) / 1e9
                if gpu is not None:
                    row.hbm_fraction = bytes_moved / (t.median_ms * 1e-3) / gpu.memory_bandwidth()
    return rows


def unavailable_reason(error: BaseException) -> str:
    """One line saying why an implementation could not be measured."""
    first_line = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {first_line}"


def start(args: argparse.Namespace) -> torch.device:
    """The device to run on, after checking the output path (before any work)."""
    from llm_speed._cli import resolve_device
    from llm_speed._output import prepare_output_path

    device = resolve_device(args.device)
    if args.output:
        prepare_output_path(args.output, argument="--output")
    return device


def finish(table, device: torch.device, payload: dict[str, Any], output: str | None) -> None:
    """Print the table and what the timings mean; write the JSON (with the provenance) when asked."""
    console = report.output_console()
    console.print(table)
    for note in report.timing_notes(device, ["llm_speed"]):
        console.print(note, highlight=False)
    if output:
        from llm_speed._output import dump_json

        dump_json({"environment": report.environment(device), **payload}, output)
        console.print(f"results written to {output}", highlight=False)


def run_command(args: argparse.Namespace) -> int:
    from rich.table import Table

    device = start(args)
    gpu_run = device.type == "cuda"
    warmup = args.warmup if args.warmup is not None else (10 if gpu_run else 1)
    iterations = args.iterations if args.iterations is not None else (50 if gpu_run else 3)
    rows = run_ops(dtype=args.dtype, device=device, impls=tuple(args.impl or IMPLS), warmup=warmup,
                   iterations=iterations)  # fmt: skip
    device_name = report.environment_device_name(device)
    table = Table(title=f"fused ops, forward + backward, {args.dtype}, {device_name}")
    for column in ("op", "impl", "shape", "median ms", "GB/s", "% HBM peak", "peak MiB"):
        table.add_column(column)
    for row in rows:
        if row.unavailable:
            table.add_row(row.op, row.impl, row.shape, f"unavailable: {row.unavailable}", "", "", "")
            continue
        table.add_row(
            row.op, row.impl, row.shape, f"{row.median_ms:.3f}",
            f"{row.gbps:.1f}" if row.gbps is not None else "-",
            f"{100 * row.hbm_fraction:.0f}%" if row.hbm_fraction is not None else "-",
            f"{row.peak_mib:.0f}" if row.peak_mib is not None else "-",
        )  # fmt: skip
    finish(table, device, {"rows": [dataclasses.asdict(r) for r in rows]}, args.output)
    return 0 if any(r.median_ms is not None for r in rows if r.impl == "llm_speed") else 1
