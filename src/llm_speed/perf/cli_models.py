"""CLI commands on model configs: ``models``, ``kv-cache``, ``analyze`` and ``train-memory``.

Tables go through :func:`llm_speed._output.print_table`, JSON through :func:`llm_speed._output.dump_json`.
``--model`` takes a zoo id or a path to a Hugging Face config.json (or its directory).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict

from rich.console import Console

from llm_speed._cli import console as new_console
from llm_speed._cli import non_negative_float, positive_int
from llm_speed._output import dump_json, prepare_plot_path, print_table
from llm_speed.core.gpus import dtype_bytes, normalize_dtype
from llm_speed.perf._checks import size_warnings
from llm_speed.perf._cli_common import (
    DEFAULT_GPU_HELP,
    DTYPE_DEFAULT_HELP,
    add_efficiency_arguments,
    add_gpu_arguments,
    check_predictable,
    dtype_for_gpu,
    efficiency_from_args,
    gpu_from_args,
)
from llm_speed.perf.distributed import LINKS, PIPELINE_SCHEDULES, ZERO_STAGES, train_memory
from llm_speed.perf.efficiency import ALGORITHMS
from llm_speed.perf.inference import InferenceAnalysis, analyze_inference, decode_batch_sweep
from llm_speed.perf.kv_cache import kv_cache_size
from llm_speed.perf.models import get_model, list_models, param_count, resolve_model
from llm_speed.perf.training import RECOMPUTE_MODES

GB = 1e9  # decimal, like the GPU table's capacities
MS = 1e3


def _models(args: argparse.Namespace) -> int:
    rows = []
    for name in list_models():
        config = get_model(name)
        counts = param_count(config)
        rows.append(
            {
                "id": name,
                "attention": config.attention_type,
                "layers": config.num_layers,
                "hidden_size": config.hidden_size,
                "heads": config.num_attention_heads,
                "kv_heads": config.num_kv_heads,
                "head_dim": config.head_dim,
                "intermediate_size": config.intermediate_size,
                "vocab_size": config.vocab_size,
                "experts": f"{config.experts_per_token}/{config.num_experts}" if config.is_moe else None,
                "sliding_window": config.sliding_window,
                "params_total": counts.total,
                "params_active": counts.active,
                "source": config.source,
            }
        )
    if args.json:
        dump_json(rows)
        return 0
    print_table(
        "Model zoo",
        ["id", "attn q/kv", "layers", "hidden", "k/E", "params B", "active B"],
        [
            [
                r["id"],
                f"{r['attention']} {r['heads']}/{r['kv_heads']}",
                r["layers"],
                r["hidden_size"],
                r["experts"],
                r["params_total"] / 1e9,
                r["params_active"] / 1e9,
            ]
            for r in rows
        ],
        caption="k/E: experts per token / experts. --json has every field and its config.json source.",
    )
    return 0


def _kv_cache(args: argparse.Namespace) -> int:
    # Scales belong to a quantized cache: on a 16/32-bit one they added bytes no cache stores.
    if args.quant_group_size is not None and dtype_bytes(normalize_dtype(args.dtype)) >= 2:
        raise ValueError(
            "--quant-group-size only applies to a quantized cache (--dtype fp8, int8 or int4), "
            f"not --dtype {args.dtype}"
        )
    if args.scale_bytes is not None and args.quant_group_size is None:
        raise ValueError("--scale-bytes only applies with --quant-group-size (the bytes of a group's scale)")
    args.scale_bytes = 2.0 if args.scale_bytes is None else args.scale_bytes
    config = resolve_model(args.model)
    size = kv_cache_size(
        config,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        dtype=args.dtype,
        quant_group_size=args.quant_group_size,
        scale_bytes=args.scale_bytes,
    )
    warnings = size_warnings(args.seq_len, max_position_embeddings=config.max_position_embeddings)
    if args.json:
        dump_json({**asdict(size), "warnings": warnings})
        return 0
    print_table(
        f"KV cache of {size.model} ({size.attention_type}), {size.dtype}",
        [
            "seq_len",
            "batch",
            "cached tokens/seq",
            "elements/token/layer",
            "bytes/token/layer",
            "bytes/token",
            "per sequence (GB)",
            "total (GB)",
        ],
        [
            [
                size.seq_len,
                size.batch_size,
                size.cached_tokens,
                size.elements_per_token_per_layer,
                size.bytes_per_token_per_layer,
                size.bytes_per_token,
                size.bytes_per_sequence / GB,
                size.total_bytes / GB,
            ]
        ],
        caption=(
            f"Scales: {size.scale_bytes_per_token_per_layer:g} bytes/token/layer "
            f"(--quant-group-size {args.quant_group_size}, --scale-bytes {args.scale_bytes:g})"
            if args.quant_group_size
            else "No quantization scales counted (see --quant-group-size)"
        )
        + "; a sliding window caps the cached tokens."
        + "".join(f" {note}" for note in warnings),
    )
    return 0


def print_inference_analysis(analysis: InferenceAnalysis, console: Console | None = None) -> None:
    """Render an :class:`InferenceAnalysis`: one op table per phase, then totals and speed bounds."""
    console = console or new_console()
    for phase in ("prefill", "decode"):
        ops = [op for op in analysis.ops if op.phase == phase]
        if phase == "prefill":
            what = f"{analysis.batch_size} x {analysis.seq_len} prompt tokens"
        else:
            what = f"one step, batch {analysis.batch_size}, context {analysis.decode_context}"
        print_table(
            f"{analysis.model} on {analysis.gpu} ({analysis.dtype}): {phase}, {what}",
            ["op", "count", "GFLOP", "MB", "FLOP/B", "bound", "floor (ms)", "predicted (ms)", "predicted"],
            [
                [
                    op.name,
                    op.count,
                    op.flops / 1e9,
                    op.bytes_moved / 1e6,
                    op.intensity,
                    op.bound,
                    op.time_floor_s * MS,
                    op.predicted_time_s * MS if analysis.implementation else None,
                    op.predicted_bound or None,
                ]
                for op in ops
            ],
            console=console,
        )
    totals = [(name, getattr(analysis, name)) for name in ("prefill", "decode")]
    print_table(
        "Totals",
        ["phase", "GFLOP", "MB", "FLOP/B", "compute-bound ms", "memory-bound ms", "floor (ms)", "bound"],
        [
            [
                name,
                t.flops / 1e9,
                t.bytes_moved / 1e6,
                t.intensity,
                t.compute_bound_time_s * MS,
                t.memory_bound_time_s * MS,
                t.time_floor_s * MS,
                t.bound,
            ]
            for name, t in totals
        ],
        console=console,
    )
    per_gpu = analysis.tp * analysis.pp
    layout = f"TP {analysis.tp} x PP {analysis.pp} = {per_gpu} GPUs, " if per_gpu > 1 else ""
    print_table(
        f"Speed: floor (datasheet peaks, line rates) and realistic estimate ({layout}weights "
        f"{analysis.weight_dtype})",
        [
            "estimate",
            "TTFT (ms)",
            "decode step (ms)",
            "tokens/s (batch)",
            "collectives/step (ms)",
            "total (s)",
        ],
        [
            [
                "floor",
                analysis.ttft_s * MS,
                analysis.decode_step_s * MS,
                analysis.decode_tokens_per_s,
                analysis.decode_communication.floor_s * MS if analysis.decode_communication else 0.0,
                analysis.total_time_s,
            ],
            [
                "realistic",
                analysis.ttft_realistic_s * MS,
                analysis.decode_step_realistic_s * MS,
                analysis.decode_tokens_per_s_realistic,
                analysis.decode_communication.realistic_s * MS if analysis.decode_communication else 0.0,
                analysis.total_time_realistic_s,
            ],
            *(
                [[
                    f"predicted ({analysis.implementation})",
                    analysis.ttft_predicted_s * MS,
                    analysis.decode_step_predicted_s * MS,
                    analysis.decode_tokens_per_s_predicted,
                    analysis.decode_communication.realistic_s * MS if analysis.decode_communication else 0.0,
                    analysis.total_time_predicted_s,
                ]]
                if analysis.implementation
                else []
            ),
        ],
        caption=f"Realistic: {analysis.efficiency_source}; collectives: {analysis.collective_algorithm}."
        + (_prediction_caption(analysis) if analysis.implementation else ""),
        console=console,
    )
    if analysis.implementation:
        for phase in ("prefill", "decode"):
            totals = getattr(analysis, phase)
            mfu = getattr(analysis, f"{phase}_mfu_predicted")
            console.print(
                f"{phase}: bound by {totals.bounding_op} ({totals.bounding_op_bound}-bound, "
                f"{totals.bounding_op_share:.0%} of the predicted {totals.predicted_time_s * MS:.4g} ms); "
                f"predicted MFU {mfu:.1%}",
                highlight=False,
                markup=False,
            )
    notes = size_warnings(
        analysis.seq_len + analysis.decode_tokens, max_position_embeddings=analysis.max_position_embeddings
    )
    print_table(
        "Memory per GPU (the busiest pipeline stage)",
        ["weights (GB)", "KV cache (GB)", "needs (GB)", "GPU (GB)", "fits", "all GPUs (GB)"],
        [
            [
                analysis.weights_bytes_per_gpu / GB,
                analysis.kv_cache_bytes_per_gpu / GB,
                analysis.memory_per_gpu_bytes / GB,
                analysis.gpu_memory_bytes / GB,
                analysis.fits_in_memory,
                analysis.memory_required_bytes / GB,
            ]
        ],
        caption=f"{analysis.decode_tokens} decode tokens; KV cache in {analysis.kv_dtype}; weights "
        f"{analysis.weight_dtype} ({analysis.weight_bytes_per_element:g} bytes each with scales). GPU: the "
        "memory the device reports where we measured one, else the datasheet's."
        + "".join(f" {note}" for note in notes),
        console=console,
    )


def _prediction_caption(analysis: InferenceAnalysis) -> str:
    calibrated = "calibrated on this GPU" if analysis.prediction_calibrated else "NOT calibrated on this GPU"
    return (
        f" Predicted: llm_speed.perf.predict, {analysis.implementation}'s kernels, context "
        f"{analysis.prediction_context} ({calibrated}; `llm-speed predict` explains each op)."
    )


def _plot_analysis(analysis: InferenceAnalysis, gpu, path) -> None:
    from llm_speed.perf.plot import PlotPoint, plot_roofline

    points = [
        PlotPoint(op.name, op.flops, op.bytes_moved, group=op.phase) for op in analysis.ops if op.flops > 0
    ]
    plot_roofline(
        gpu,
        points,
        path,
        dtype=analysis.dtype,
        title=f"{analysis.model} on {analysis.gpu}: batch {analysis.batch_size}, seq {analysis.seq_len}",
    )


def _analyze(args: argparse.Namespace) -> int:
    plot_path = prepare_plot_path(args.plot) if args.plot else None
    gpu = gpu_from_args(args, default=True)
    check_predictable(gpu, args.implementation)
    args.dtype = dtype_for_gpu(gpu, args.dtype)
    config = resolve_model(args.model)
    analysis = analyze_inference(
        config,
        gpu,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        decode_tokens=args.decode_tokens,
        dtype=args.dtype,
        kv_dtype=args.kv_dtype,
        weight_dtype=args.weight_dtype,
        weight_group_size=args.weight_group_size,
        weight_scale_bytes=args.weight_scale_bytes,
        tp=args.tp,
        pp=args.pp,
        link=args.link,
        collective_algorithm=args.collective,
        efficiency=efficiency_from_args(args),
        implementation=None if args.implementation == "none" else args.implementation,
        prediction_context=args.prediction_context,
        calibration=args.calibration_file,
    )
    sweep = None
    if args.sweep:
        if args.tp * args.pp > 1 or args.weight_dtype:
            raise ValueError("--sweep models one GPU with unquantized weights; drop --tp/--pp/--weight-dtype")
        sweep = decode_batch_sweep(
            config, gpu, seq_len=args.seq_len, dtype=args.dtype, kv_dtype=args.kv_dtype
        )
    if plot_path is not None:
        _plot_analysis(analysis, gpu, plot_path)
    if args.json:
        payload = asdict(analysis)
        if sweep is not None:
            payload["decode_batch_sweep"] = [asdict(row) for row in sweep]
        dump_json(payload)
        return 0
    console = new_console()
    print_inference_analysis(analysis, console)
    if sweep is not None:
        print_table(
            f"Decode step vs batch size (context {args.seq_len})",
            ["batch", "FLOP/B", "GEMM FLOP/B", "bound", "step (ms)", "tokens/s", "needs (GB)", "fits"],
            [
                [
                    r.batch_size,
                    r.intensity,
                    r.gemm_intensity,
                    r.bound,
                    r.step_time_s * MS,
                    r.tokens_per_s,
                    r.memory_required_bytes / GB,
                    r.fits_in_memory,
                ]
                for r in sweep
            ],
            caption="Weight GEMMs' intensity grows with batch; attention over each own cache does not.",
            console=console,
        )
    if plot_path is not None:
        console.print(f"roofline plot written to {plot_path}")
    return 0


def _train_memory(args: argparse.Namespace) -> int:
    config = resolve_model(args.model)
    result = train_memory(
        config,
        gpus=args.gpus,
        tp=args.tp,
        pp=args.pp,
        dp=args.dp,
        ep=args.ep,
        cp=args.cp,
        zero=args.zero,
        micro_batch_size=args.micro_batch_size,
        seq_len=args.seq_len,
        num_microbatches=args.num_microbatches,
        schedule=args.schedule,
        virtual_stages=args.virtual_stages,
        recompute=args.recompute,
        sequence_parallel=False if args.no_sequence_parallel else None,
        gpu=args.gpu,
    )
    if args.json:
        dump_json(result)
        return 0
    print_table(
        f"Training memory per GPU: {result.model} on {result.gpus} GPUs "
        f"(TP {result.tp}, PP {result.pp}, DP {result.dp}, EP {result.ep}, CP {result.cp}, "
        f"ZeRO {result.zero_stage})",
        [
            "heaviest stage (layers)",
            "params/GPU (B)",
            "weights (GB)",
            "grads (GB)",
            "optimizer (GB)",
            "activations (GB)",
            "total (GB)",
            "GPU (GB)",
            "fits",
        ],
        [
            [
                f"{result.stage} ({result.stage_layers})",
                result.params_per_gpu / 1e9,
                result.params_bytes / GB,
                result.grads_bytes / GB,
                result.optimizer_bytes / GB,
                result.activation_bytes / GB,
                result.total_bytes / GB,
                None if result.gpu_memory_bytes is None else result.gpu_memory_bytes / GB,
                result.fits,
            ]
        ],
        caption=(
            f"micro-batch {result.micro_batch_size} x {result.seq_len} tokens, {result.num_microbatches} "
            f"micro-batches, {result.schedule}, recompute {result.recompute}, sequence parallel "
            f"{'on' if result.sequence_parallel else 'off'}; mixed-precision Adam (16 bytes/param)."
        ),
    )
    print_table(
        "Communication and bubble",
        [
            "pipeline bubble",
            "TP bytes/layer/micro-batch (MB)",
            "DP grad sync/step (GB)",
            "MoE all-to-all/layer (MB)",
        ],
        [
            [
                result.bubble_fraction,
                result.tp_bytes_per_layer / 1e6,
                result.dp_grad_sync_bytes / GB,
                result.moe_all_to_all_bytes_per_layer / 1e6,
            ]
        ],
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``models``, ``kv-cache``, ``analyze`` and ``train-memory``."""
    model_help = "zoo id (see `llm-speed models`) or path to a Hugging Face config.json"

    parser = subparsers.add_parser("models", help="list the built-in model configs")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_models)

    parser = subparsers.add_parser("kv-cache", help="KV-cache size (MHA/MQA/GQA/MLA, sliding window)")
    parser.add_argument("--model", required=True, help=model_help)
    parser.add_argument("--seq-len", type=positive_int, required=True)
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--dtype", default="bf16", help="cache dtype: fp32, bf16, fp16, fp8, int8, int4")
    parser.add_argument(
        "--quant-group-size", type=positive_int, default=None,
        help="quantized --dtype: elements sharing one quantization scale",
    )
    parser.add_argument(
        "--scale-bytes", type=non_negative_float, default=None,
        help="with --quant-group-size: bytes per group (default 2: fp16 scale; 4: + zero point)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_kv_cache)

    parser = subparsers.add_parser(
        "analyze", help="prefill and decode of a model on one or more GPUs, op by op: floors and estimates"
    )
    parser.add_argument("--model", required=True, help=model_help)
    add_gpu_arguments(parser, gpu_help=DEFAULT_GPU_HELP)
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--seq-len", type=positive_int, default=2048, help="prompt length")
    parser.add_argument("--decode-tokens", type=positive_int, default=256)
    parser.add_argument(
        "--dtype", default=None,
        help=f"activations/compute dtype (and weights by default; {DTYPE_DEFAULT_HELP})",
    )
    parser.add_argument("--kv-dtype", default=None, help="KV-cache dtype (default: --dtype)")
    parser.add_argument(
        "--weight-dtype", default=None, help="weight storage: int8, int4, fp8 (weight-only quantization)"
    )
    parser.add_argument(
        "--weight-group-size", type=positive_int, default=None,
        help="weights sharing one scale (default: per channel)",
    )
    parser.add_argument(
        "--weight-scale-bytes",
        type=non_negative_float,
        default=2.0,
        help="bytes per group (2: fp16 scale; 4: + zero point)",
    )
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor-parallel GPUs (2 all-reduces per layer)")
    parser.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    parser.add_argument("--link", default="nvlink", choices=LINKS, help="GPU-to-GPU link for --tp/--pp")
    parser.add_argument(
        "--collective", default="ring", choices=ALGORITHMS, help="all-reduce algorithm (nvls: NVLink SHARP)"
    )
    add_efficiency_arguments(parser)
    group = parser.add_argument_group("calibrated prediction (llm_speed.perf.predict)")
    group.add_argument(
        "--implementation", default="llm-speed", choices=("llm-speed", "vendor", "none"),
        help="whose kernels: llm-speed, vendor (cuBLAS, torch SDPA, eager PyTorch), or none (no prediction)",
    )  # fmt: skip
    group.add_argument(
        "--prediction-context", default="stream", choices=("stream", "graph", "isolated"),
        help="stream: kernels back to back (host path shows where longer); graph: CUDA-graph replay",
    )  # fmt: skip
    group.add_argument("--calibration-file", default=None, metavar="FILE", help="another calibration JSON")
    parser.add_argument("--sweep", action="store_true", help="also sweep the decode batch size")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the roofline with the ops on it")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=_analyze)

    parser = subparsers.add_parser("train-memory", help="per-GPU training memory for a TP/PP/DP/EP/CP layout")
    parser.add_argument("--model", required=True, help=model_help)
    parser.add_argument("--gpus", type=positive_int, required=True)
    parser.add_argument("--tp", type=positive_int, default=1)
    parser.add_argument("--pp", type=positive_int, default=1)
    parser.add_argument("--dp", type=positive_int, default=None, help="default: gpus / (tp*pp*cp)")
    parser.add_argument("--ep", type=positive_int, default=1)
    parser.add_argument("--cp", type=positive_int, default=1)
    parser.add_argument("--zero", type=int, default=0, choices=ZERO_STAGES)
    parser.add_argument("--micro-batch-size", type=positive_int, default=1)
    parser.add_argument("--seq-len", type=positive_int, default=4096)
    parser.add_argument("--num-microbatches", type=positive_int, default=None, help="default: pp")
    parser.add_argument("--schedule", default="1f1b", choices=PIPELINE_SCHEDULES)
    parser.add_argument("--virtual-stages", type=positive_int, default=1)
    parser.add_argument("--recompute", default="none", choices=RECOMPUTE_MODES)
    parser.add_argument(
        "--no-sequence-parallel", action="store_true", help="TP without sequence parallelism (default: on)"
    )
    parser.add_argument("--gpu", default=None, help="GPU id to check the total against its memory")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=_train_memory)
