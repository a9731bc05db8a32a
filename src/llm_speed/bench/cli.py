"""``llm-speed bench attention|gemm``, ``llm-speed doctor`` and ``llm-speed demo``.

Flags follow seed 002's benchmark scripts (``--seq-lengths``, ``--batch-size``, ``--num-heads``,
``--head-dim``, ``--dtype``, ``--warmup``, ``--iterations``, ``--output``, ``--sizes``). Unset sizes take the
GPU defaults on a CUDA device and small CPU defaults otherwise.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from rich.console import Console

from llm_speed.bench import attention as attention_bench
from llm_speed.bench import gemm as gemm_bench
from llm_speed.bench import ops as ops_bench
from llm_speed.bench import report
from llm_speed.bench import train_step as train_step_bench


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _size(text: str) -> tuple[int, int, int]:
    try:
        return gemm_bench.parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--sizes: ")) from None


def resolve_device(name: str | None) -> torch.device:
    """--device: the GPU when there is one (default), or the CPU; asking for cuda without one is an error."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was requested but no CUDA device is visible; use --device cpu")
    return torch.device(name)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--warmup", type=_non_negative_int, help="untimed runs first (GPU 10, CPU 1)")
    parser.add_argument("--iterations", type=_positive_int, help="timed runs (GPU 50, CPU 3)")
    parser.add_argument("--output", metavar="FILE.json", help="write every figure and the provenance as JSON")
    parser.add_argument("--plot", metavar="FILE.png", help="roofline plot with the measured kernels on it")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available, else cpu")
    parser.add_argument("--json", action="store_true", help="print the JSON document instead of the tables")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` (with ``attention`` and ``gemm``), ``doctor`` and ``demo``."""
    from llm_speed import demo, doctor

    bench = subparsers.add_parser("bench", help="benchmark llm-speed's kernels against PyTorch and others")
    kinds = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)

    attention = kinds.add_parser(
        "attention",
        help="flash/tiled/naive vs torch SDPA backends and flash_attn",
        description="Time attention implementations at several sequence lengths (seq_q == seq_kv).",
    )
    attention.add_argument(
        "--seq-lengths", type=_positive_int, nargs="+", help="GPU: 512 ... 8192; CPU: 64 128"
    )
    attention.add_argument("--batch-size", type=_positive_int, help="GPU 2, CPU 1")
    attention.add_argument("--num-heads", type=_positive_int, help="query heads (GPU 8, CPU 2)")
    attention.add_argument(
        "--num-kv-heads", type=_positive_int, help="key/value heads (default: --num-heads)"
    )
    attention.add_argument("--head-dim", type=_positive_int, help="GPU 64, CPU 32")
    attention.add_argument("--dtype", choices=attention_bench.DTYPES, help="GPU fp16, CPU fp32")
    attention.add_argument(
        "--causal", action="store_true", help="causal mask (FLOPs count visible pairs only)"
    )
    attention.add_argument("--mode", choices=attention_bench.MODES, default="fwd", help="what is timed")
    attention.add_argument("--impl", nargs="+", choices=attention_bench.IMPLS, help="default: all of them")
    _add_common(attention)
    attention.set_defaults(func=run_attention_command)

    gemm = kinds.add_parser(
        "gemm",
        help="llm_speed.gemm vs torch.matmul (cuBLAS), int8 vs torch._int_mm",
        description="Time GEMMs of given sizes, or of a zoo model's weight GEMMs (--model).",
    )
    shapes = gemm.add_mutually_exclusive_group()
    shapes.add_argument("--sizes", type=_size, nargs="+", metavar="MxNxK", help="GPU: 512^3 ... 4096^3")
    shapes.add_argument("--model", help="benchmark this zoo model's weight GEMM shapes (e.g. llama-3-8b)")
    gemm.add_argument("--tokens", type=_positive_int, help="tokens (M) for --model: GPU 4096, CPU 16")
    gemm.add_argument("--dtype", choices=gemm_bench.DTYPES, help="GPU fp16, CPU fp32")
    gemm.add_argument(
        "--layout",
        choices=gemm_bench.LAYOUTS,
        default="NN",
        help="operand storage: T = stored transposed (NT: B is [N, K] like nn.Linear)",
    )
    gemm.add_argument(
        "--epilogue",
        choices=gemm_bench.EPILOGUES,
        default="none",
        help="fused in llm-speed; separate ops after torch.matmul",
    )
    gemm.add_argument(
        "--impl",
        nargs="+",
        choices=gemm_bench.IMPLS,
        help="default: llm-speed and torch (int8: llm-speed and torch-int-mm)",
    )
    _add_common(gemm)
    gemm.set_defaults(func=run_gemm_command)
    ops_bench.register(kinds)  # bench ops (llm_speed.bench.ops)
    train_step_bench.register(kinds)  # bench train-step (llm_speed.bench.train_step)

    doctor.add_parser(subparsers)
    demo.add_parser(subparsers)


def _pick(value: Any, device: torch.device, key: str, gpu: dict, cpu: dict) -> Any:
    if value is not None:
        return value
    return (gpu if device.type == "cuda" else cpu)[key]


def attention_settings(args: argparse.Namespace) -> attention_bench.AttentionSettings:
    """Settings from parsed flags, defaults filled for the device."""
    device = resolve_device(args.device)
    gpu, cpu = attention_bench.GPU_DEFAULTS, attention_bench.CPU_DEFAULTS
    num_heads = _pick(args.num_heads, device, "num_heads", gpu, cpu)
    settings = attention_bench.AttentionSettings(
        seq_lengths=tuple(_pick(args.seq_lengths, device, "seq_lengths", gpu, cpu)),
        batch_size=_pick(args.batch_size, device, "batch_size", gpu, cpu),
        num_heads=num_heads,
        num_kv_heads=args.num_kv_heads if args.num_kv_heads is not None else num_heads,
        head_dim=_pick(args.head_dim, device, "head_dim", gpu, cpu),
        dtype=_pick(args.dtype, device, "dtype", gpu, cpu),
        causal=args.causal,
        mode=args.mode,
        impls=tuple(args.impl or attention_bench.IMPLS),
        warmup=_pick(args.warmup, device, "warmup", gpu, cpu),
        iterations=_pick(args.iterations, device, "iterations", gpu, cpu),
        device=str(device),
    )
    attention_bench.check_settings(settings)
    return settings


def gemm_settings(args: argparse.Namespace) -> gemm_bench.GemmSettings:
    """Settings from parsed flags, defaults filled for the device."""
    device = resolve_device(args.device)
    gpu, cpu = gemm_bench.GPU_DEFAULTS, gemm_bench.CPU_DEFAULTS
    dtype = _pick(args.dtype, device, "dtype", gpu, cpu)
    tokens = None
    if args.model:
        tokens = _pick(args.tokens, device, "tokens", gpu, cpu)
        cases = gemm_bench.model_cases(args.model, tokens)
    else:
        if args.tokens is not None:
            raise ValueError("tokens: --tokens only applies with --model")
        sizes = _pick(args.sizes, device, "sizes", gpu, cpu)
        cases = tuple(gemm_bench.GemmCase("", m, n, k) for m, n, k in sizes)
    default_impls = gemm_bench.INT8_IMPLS if dtype == "int8" else gemm_bench.FLOAT_IMPLS
    settings = gemm_bench.GemmSettings(
        cases=cases,
        dtype=dtype,
        layout=args.layout,
        epilogue=args.epilogue,
        impls=tuple(args.impl or default_impls),
        warmup=_pick(args.warmup, device, "warmup", gpu, cpu),
        iterations=_pick(args.iterations, device, "iterations", gpu, cpu),
        device=str(device),
        model=args.model,
        tokens=tokens,
    )
    gemm_bench.check_settings(settings)
    return settings


def plot_rows(
    rows: Sequence[report.Measurement],
    path: str | Path,
    *,
    device: torch.device,
    dtype: str,
    title: str,
    console: Console,
) -> bool:
    """Roofline PNG of the detected GPU (h100-sxm for CPU runs, said in the title) with the measured rows.

    Returns False, saying why, when there is nothing to plot on.
    """
    from llm_speed.perf.gpus import detect_gpu, get_gpu
    from llm_speed.perf.plot import PlotPoint, plot_roofline

    if device.type == "cuda":
        gpu = detect_gpu()
        if gpu is None:
            console.print(
                f"no roofline plot: {torch.cuda.get_device_name(device)} is not in the GPU spec table"
            )
            return False
    else:
        gpu = get_gpu("h100-sxm")
        title += "\n(CPU timings, drawn on the H100 roofline for reference only)"
    points = [
        PlotPoint(f"{row.impl} {row.case}", row.flops, row.bytes_moved, row.flops / (row.median_ms * 1e-3))
        for row in rows
        if row.median_ms
    ]
    if not points:
        console.print("no roofline plot: no implementation ran")
        return False
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    plot_roofline(gpu, points, path, dtype=dtype, title=title)
    console.print(f"roofline plot written to {path}", highlight=False)
    return True


def run_attention_command(args: argparse.Namespace) -> int:
    """``llm-speed bench attention``."""
    settings = attention_settings(args)
    rows = attention_bench.run_attention(settings, show_progress=not args.no_progress)
    return _finish(
        args,
        settings,
        rows,
        attention_bench.results_payload,
        attention_bench.print_attention,
        f"attention {settings.mode}, {settings.dtype}",
    )


def run_gemm_command(args: argparse.Namespace) -> int:
    """``llm-speed bench gemm``."""
    settings = gemm_settings(args)
    rows = gemm_bench.run_gemm(settings, show_progress=not args.no_progress)
    return _finish(
        args,
        settings,
        rows,
        gemm_bench.results_payload,
        gemm_bench.print_gemm,
        f"GEMM {settings.dtype} {settings.layout} {settings.epilogue}",
    )


def _finish(args, settings, rows, payload_fn, print_fn, title: str) -> int:
    from llm_speed._output import dump_json

    payload = payload_fn(settings, rows)
    console = report.output_console()
    if args.json:
        dump_json(payload)
    else:
        print_fn(settings, rows, console)
    # Messages about written files go to stderr when stdout carries the JSON.
    side = Console(stderr=True) if args.json else console
    report.write_results(payload, args.output, side)
    if args.plot:
        plot_rows(
            rows,
            args.plot,
            device=torch.device(settings.device),
            dtype=settings.dtype,
            title=title,
            console=side,
        )
    # Exit 1 when nothing at all could run: a benchmark with no figure is a failure, not a result.
    return 0 if any(row.available for row in rows) else 1
