"""``llm-speed demo`` (what ``make demo`` runs): the performance model's view of a model on a GPU, a short
attention and GEMM benchmark on the device at hand, and a roofline plot: on a GPU with the measured kernels
on its own roofline, on a CPU with the model's predictions for the modelled GPU (CPU timings do not belong).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llm_speed import _cli
from llm_speed._output import dump_json, prepare_output_folder, prepare_output_path
from llm_speed.perf._cli_common import FALLBACK_GPU  # analysed when no GPU is detected

if TYPE_CHECKING:  # torch and the benchmarks are imported when the demo runs, not when the parser is built
    import torch
    from rich.console import Console

    from llm_speed.bench import attention as attention_bench
    from llm_speed.bench import gemm as gemm_bench
    from llm_speed.bench import report

DEFAULT_MODEL = "llama-3-8b"
DEFAULT_OUTPUT_DIR = "llm-speed-demo"
# Inference scenario of the analysis: one request, a 2048-token prompt, 256 generated tokens.
ANALYSIS = {"batch_size": 1, "seq_len": 2048, "decode_tokens": 256, "dtype": "bf16"}
GPU_GEMM_TOKENS = 2048
# Each row runs at least ITERATIONS times and until its runs add up to MIN_TIME_S (see bench.timing).
GPU_REPETITIONS = {"warmup": 5, "iterations": 20, "min_time_s": 0.2}
CPU_REPETITIONS = {"warmup": 2, "iterations": 5, "min_time_s": 0.2}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``llm-speed demo``."""
    parser = subparsers.add_parser("demo", help="model analysis, a short benchmark and a roofline plot")
    parser.add_argument(
        "--output-dir",
        default=DEFAULT_OUTPUT_DIR,
        help=f"where roofline.png and demo.json go (default: ./{DEFAULT_OUTPUT_DIR})",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model to analyse: a zoo id or a config.json path (default {DEFAULT_MODEL})",
    )
    _cli.add_device_argument(parser)
    parser.set_defaults(func=run_demo_command)


def attention_settings(device: torch.device, model_id: str) -> attention_bench.AttentionSettings:
    """The model's own attention shape on a GPU (heads, kv heads, head dim); a small GQA shape on a CPU."""
    from llm_speed.bench import attention as attention_bench
    from llm_speed.perf.models import resolve_model

    if device.type == "cuda":
        config = resolve_model(model_id)  # a config.json path too, as step 1 (analyze_inference) takes
        shape = {
            "seq_lengths": (1024, 4096),
            "num_heads": config.num_attention_heads,
            "num_kv_heads": config.num_kv_heads,
            "head_dim": config.head_dim,
            "dtype": "bf16",
        }
    else:
        shape = {"seq_lengths": (128,), "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "dtype": "fp32"}
    return attention_bench.AttentionSettings(
        **shape,
        batch_size=1,
        causal=True,
        mode="fwd",
        impls=("flash", "tiled", "naive", "sdpa"),
        device=str(device),
        **_repetitions(device),
    )


def _repetitions(device: torch.device) -> dict[str, Any]:
    return dict(GPU_REPETITIONS if device.type == "cuda" else CPU_REPETITIONS)


def gemm_settings(device: torch.device, model_id: str) -> gemm_bench.GemmSettings:
    """The model's weight GEMMs (nn.Linear layout, NT) on a GPU; two small square GEMMs on a CPU."""
    from llm_speed.bench import gemm as gemm_bench

    if device.type == "cuda":
        cases = gemm_bench.model_cases(model_id, GPU_GEMM_TOKENS)
        workload = {"cases": cases, "dtype": "bf16", "model": model_id, "tokens": GPU_GEMM_TOKENS}
    else:
        cases = (gemm_bench.GemmCase("", 128, 128, 128), gemm_bench.GemmCase("", 256, 256, 256))
        workload = {"cases": cases, "dtype": "fp32"}
    return gemm_bench.GemmSettings(
        **workload,
        layout="NT",
        epilogue="none",
        impls=("llm-speed", "torch"),
        device=str(device),
        **_repetitions(device),
    )


def _compact_table(
    title: str, rows: Sequence[report.Measurement], device: torch.device, console: Console
) -> None:
    """The rows' times; the ratio column only on a GPU (on a CPU the takeaways say no ratio is drawn)."""
    from llm_speed.bench import report

    columns = [
        "shape",
        "impl",
        "median ms [p20–p80]",
        "TFLOP/s",
        "GB/s",
        "vs fastest other [range]",
        "model floor ms",
        "measured/model",
    ]
    cells = []
    for row in rows:
        if not row.available:
            cells.append([row.case, row.impl, f"not run: {row.reason}", None, None, None, None, None])
            continue
        cells.append(
            [
                row.case,
                row.impl,
                f"{row.median_ms:.3g} [{report.spread(row.timing)}]",
                row.tflops,
                row.bandwidth_gb_s,
                report.speedup_cell(row) if device.type == "cuda" else None,
                row.predicted_ms,
                f"{row.measured_over_predicted:.1f}x" if row.measured_over_predicted is not None else None,
            ]
        )
    report.print_rows(title, columns, cells, caption=report.environment_device_name(device), console=console)


def _takeaways(attention_rows, gemm_rows, device: torch.device, busy: bool = False) -> list[str]:
    """Two or three sentences computed from the measurements (no ranking from a busy CPU's times)."""
    lines = []
    measured = [r for r in attention_rows if r.median_ms is not None]
    if measured and not busy:
        longest = max(r.seq_len for r in measured)
        at_longest = sorted((r for r in measured if r.seq_len == longest), key=lambda r: r.median_ms)
        ranking = ", ".join(f"{r.impl} {r.median_ms:.3g} ms" for r in at_longest)
        lines.append(f"Attention at seq={longest}, fastest first: {ranking}.")
    if device.type != "cuda":
        # Interpreted Triton (or a PyTorch fallback) against compiled PyTorch: a ratio would teach nothing.
        lines.append(
            "On a CPU the llm-speed kernels run in Triton's interpreter (or as PyTorch fallbacks): their "
            "times are not comparable with PyTorch's, so no speed ratio is drawn from them. "
            "The shapes are tiny: the demo shows that the harness works, nothing more."
        )
        return lines
    ours = [r for r in gemm_rows if r.impl == "llm-speed" and r.percent_of_baseline is not None]
    clear = [r for r in ours if not r.percent_within_noise]
    if ours:
        parts = [f"{r.case} {gemm_bench.percent_cell(r)}" for r in ours]
        lines.append(f"llm_speed.gemm's speed as a percentage of cuBLAS's, per shape: {'; '.join(parts)}.")
        if len(clear) < len(ours):
            lines.append(
                f"{len(ours) - len(clear)} of {len(ours)} GEMM comparisons are within noise: the runs' "
                "spread (p20–p80) is wider than the difference."
            )
    return lines


def _print_load(verdict, console: Console) -> None:
    if verdict is not None:
        console.print(f"• {verdict.note()}", highlight=False, markup=False)


def run_demo(output_dir: str | Path, model_id: str, device: torch.device, console: Console) -> dict[str, Any]:
    """Run the four demo steps, print them, write ``roofline.png`` and ``demo.json``; returns the JSON."""
    import torch

    from llm_speed.bench import attention as attention_bench
    from llm_speed.bench import cpu_load, report
    from llm_speed.bench import gemm as gemm_bench
    from llm_speed.bench.plots import plot_rows
    from llm_speed.core.gpus import detect_gpu
    from llm_speed.perf.cli_models import print_inference_analysis
    from llm_speed.perf.inference import analyze_inference
    from llm_speed.perf.models import resolve_model

    started = time.perf_counter()
    output_dir = Path(output_dir)
    resolve_model(model_id)  # an unknown model named before any folder is made or any step runs
    # The folder and both files checked (the folder made where allowed) before any work starts.
    prepare_output_folder(output_dir, argument="--output-dir")
    plot_path, json_path = (
        prepare_output_path(output_dir / name, argument="--output-dir")
        for name in ("roofline.png", "demo.json")
    )
    detected = detect_gpu() if device.type == "cuda" else None
    gpu_id = detected.id if detected is not None else FALLBACK_GPU
    if detected is not None:
        why_gpu = "the GPU in this machine"
    elif device.type == "cuda":
        why_gpu = f"{torch.cuda.get_device_name(device)} is not in the GPU spec table, so the default"
    else:
        why_gpu = "no GPU here, so the default"

    console.rule(f"1/4  Performance model: {model_id} on {gpu_id}")
    scenario = (
        f"one request of {ANALYSIS['seq_len']} prompt tokens and {ANALYSIS['decode_tokens']} generated "
        f"tokens, {ANALYSIS['dtype']}"
    )
    console.print(f"The model's time floors on {gpu_id} ({why_gpu}); {scenario}.", highlight=False)
    analysis = analyze_inference(model_id, gpu_id, **ANALYSIS)
    print_inference_analysis(analysis, console=console)

    console.rule("2/4  Attention measured on this device")
    attention = attention_settings(device, model_id)
    run = attention_bench.run_attention
    attention_rows, attention_load = cpu_load.watched_run(device, lambda: run(attention))
    _compact_table(
        f"causal attention, batch {attention.batch_size}, "
        f"heads {attention.num_heads}/{attention.num_kv_heads} "
        f"(q/kv), head_dim {attention.head_dim}, {attention.dtype}",
        attention_rows,
        device,
        console,
    )
    _print_load(attention_load, console)

    console.rule("3/4  GEMM measured on this device")
    gemm = gemm_settings(device, model_id)
    gemm_rows, gemm_load = cpu_load.watched_run(device, lambda: gemm_bench.run_gemm(gemm))
    shapes = f"{model_id} weight GEMMs, {gemm.tokens} tokens" if gemm.model else "square GEMMs"
    _compact_table(f"{shapes}, {gemm.dtype}, layout {gemm.layout}", gemm_rows, device, console)
    _print_load(gemm_load, console)

    console.rule("4/4  Roofline")
    plotted = plot_rows(
        [*attention_rows, *gemm_rows],
        plot_path,
        device=device,
        dtype=attention.dtype,
        title="llm-speed demo: attention and GEMM kernels",
        console=console,
    )
    notes = report.timing_notes(device, ["flash", "tiled", "llm-speed gemm"])
    busy = any(load is not None and load.busy for load in (attention_load, gemm_load))
    for line in [*_takeaways(attention_rows, gemm_rows, device, busy), *notes]:
        console.print(f"• {line}", highlight=False, markup=False)
    payload = {
        "analysis": analysis,
        "attention": attention_bench.results_payload(attention, attention_rows),
        "gemm": gemm_bench.results_payload(gemm, gemm_rows),
        "cpu_load": {"attention": cpu_load.verdict_record(attention_load),
                     "gemm": cpu_load.verdict_record(gemm_load)},  # fmt: skip
        "roofline_png": str(plot_path) if plotted else None,
        "elapsed_s": time.perf_counter() - started,
    }
    dump_json(payload, json_path)
    console.print(f"Wrote {json_path} in {payload['elapsed_s']:.1f} s.", highlight=False)
    return payload


def run_demo_command(args: argparse.Namespace) -> int:
    """``llm-speed demo``."""
    run_demo(args.output_dir, args.model, _cli.resolve_device(args.device), _cli.console())
    return 0
