"""CLI: ``llm-speed gpus`` (``--show ID``, ``--live``), ``roofline``, ``vram``, ``mfu`` and ``waves``
(the hardware side of the model)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from llm_speed._cli import gemm_size, positive_float, positive_int
from llm_speed._output import dump_json, prepare_plot_path, print_table
from llm_speed.core.gpus import get_gpu, list_gpus, live_device_properties
from llm_speed.perf._checks import divisors_text, size_warnings
from llm_speed.perf._cli_common import DTYPE_DEFAULT_HELP, add_gpu_arguments, dtype_for_gpu, gpu_from_args
from llm_speed.perf.gemm_tiling import wave_quantization
from llm_speed.perf.kernel_costs import ATTENTION_MODES, attention_cost, gemm_cost
from llm_speed.perf.memory import attention_memory
from llm_speed.perf.mfu import (
    MFU_CONVENTIONS,
    achieved_flops_per_s,
    convention_not_applicable,
    mfu,
    throughput_mfu,
    training_flops_per_token,
)
from llm_speed.perf.models import resolve_model
from llm_speed.perf.roofline import roofline

GPU_HELP = "GPU id or alias (see `llm-speed gpus`)"


def _gpu_detail(gpu_name: str, as_json: bool) -> int:
    spec = get_gpu(gpu_name)
    if as_json:
        dump_json(spec)
        return 0
    rows = [
        [field.name, getattr(spec, field.name), spec.sources.get(field.name, "")]
        for field in dataclasses.fields(spec)
        if field.name not in ("sources", "peak_tflops")
    ]
    rows += [
        [f"peak_tflops {name}", value, spec.sources["peak_tflops"] if i == 0 else "(same)"]
        for i, (name, value) in enumerate(spec.peak_tflops.items())
    ]
    print_table(f"{spec.name} ({spec.id})", ["field", "value", "source"], rows)
    return 0


# (live_device_properties key, GPUSpec attribute) pairs that the live-device table compares.
_LIVE_VS_TABLE = (
    ("name", "name"),
    ("compute_capability", "compute_capability"),
    ("sm_count", "sm_count"),
    ("memory_gb", "hbm_capacity_gb"),
    ("memory_bandwidth_gbs", "hbm_bandwidth_gbs"),
    ("l2_cache_mb", "l2_cache_mb"),
    ("smem_per_sm_kb", "smem_per_sm_kb"),
    ("smem_per_block_optin_kb", None),
    ("register_file_per_sm_kb", "register_file_per_sm_kb"),
    ("sm_clock_mhz", "boost_clock_mhz"),
)


def _live_gpu(as_json: bool) -> int:
    """The current CUDA device's own properties next to its table entry (peaks come from the table)."""
    live = live_device_properties()
    if live is None:
        raise ValueError("--live needs a CUDA device; none is available (the table: `llm-speed gpus`)")
    spec = get_gpu(live["table_id"]) if live["table_id"] else None
    if as_json:
        dump_json({"live": live, "table": spec})
        return 0
    rows = [
        [key, live.get(key), getattr(spec, attribute) if spec and attribute else None]
        for key, attribute in _LIVE_VS_TABLE
        if key in live
    ]
    if spec:
        rows += [[f"peak {dtype} TFLOP/s", None, value] for dtype, value in spec.peak_tflops.items()]
    print_table(
        f"Live device: {live['name']}",
        ["property", "device reports", f"table ({spec.id})" if spec else "table (not in it)"],
        rows,
        caption="memory_gb: usable memory the device reports, decimal GB (the datasheet capacity is "
        "nominal); L2 in MiB; bandwidth from the memory clock and bus width; peaks only from the table.",
    )
    return 0


def _gpus(args: argparse.Namespace) -> int:
    if args.live:
        return _live_gpu(args.json)
    if args.show is not None:
        return _gpu_detail(args.show, args.json)
    gpus = list_gpus()
    if args.json:
        dump_json(gpus)
        return 0
    rows = []
    for gpu in gpus:
        rows.append(
            [
                gpu.id,
                gpu.architecture,
                gpu.sm_count,
                gpu.hbm_capacity_gb,
                gpu.hbm_bandwidth_gbs / 1000,
                gpu.peak_tflops.get("fp32"),
                gpu.peak_tflops.get("tf32"),
                gpu.peak_tflops.get("bf16"),
                gpu.peak_tflops.get("fp8"),
                gpu.ridge_point("bf16") if "bf16" in gpu.peak_tflops else None,
                gpu.l2_cache_mb,
                gpu.smem_per_sm_kb,
                gpu.nvlink_bandwidth_gbs,
            ]
        )
    print_table(
        "GPU spec table (dense peaks)",
        [
            "id",
            "arch",
            "SMs",
            "mem GB",
            "TB/s",
            "fp32 TF",
            "tf32 TF",
            "bf16 TF",
            "fp8 TF",
            "ridge bf16",
            "L2 MB",
            "smem/SM KB",
            "NVLink GB/s",
        ],
        rows,
        caption="TF = dense TFLOP/s (sparse datasheet figures halved); ridge in FLOP/byte; "
        "NVLink bidirectional. Sources: `llm-speed gpus --json`.",
    )
    return 0


MFU_SEQ_LEN = 2048  # mfu --model's default --seq-len


def _attention_only(args: argparse.Namespace) -> None:
    """Refuse --causal and --mode without --attention (they were silently ignored), then default --mode."""
    if args.attention is None:
        given = [flag for flag, value in (("--causal", args.causal), ("--mode", args.mode)) if value]
        if given:
            verb = "apply" if len(given) > 1 else "applies"
            raise ValueError(f"{' and '.join(given)} only {verb} with --attention {ATTENTION_SPEC}")
    args.mode = args.mode or "fwd"


def _roofline_kernels(args: argparse.Namespace, dtype: str) -> list[tuple[str, float, float]]:
    """(label, FLOPs, bytes) of the kernels the roofline command should place."""
    given = [
        args.flops is not None or args.bytes is not None,
        args.gemm is not None,
        args.attention is not None,
    ]
    if sum(given) > 1:
        raise ValueError("give only one of --flops/--bytes, --gemm, --attention")
    _attention_only(args)
    if args.gemm is not None:
        m, n, k = args.gemm
        cost = gemm_cost(m, n, k, dtype=dtype)
        return [(f"gemm {m}x{n}x{k}", cost.flops, cost.bytes_moved)]
    if args.attention is not None:
        spec = args.attention
        kernels = []
        for impl in ("flash", "tiled", "naive"):
            cost = _attention_spec_cost(spec, dtype=dtype, causal=args.causal, mode=args.mode, impl=impl)
            kernels.append(
                (
                    f"attention {impl} {spec.text} {args.mode}{' causal' if args.causal else ''}",
                    cost.flops,
                    cost.bytes_moved,
                )
            )
        return kernels
    if (args.flops is None) != (args.bytes is None):
        raise ValueError("--flops and --bytes go together")
    return [] if args.flops is None else [("kernel", args.flops, args.bytes)]


def _roofline(args: argparse.Namespace) -> int:
    plot_path = prepare_plot_path(args.plot) if args.plot else None
    spec = gpu_from_args(args)
    dtype = dtype_for_gpu(spec, args.dtype)  # one this GPU has no peak for is an error, even without a kernel
    kernels = _roofline_kernels(args, dtype)
    points = [(label, roofline(flops, bytes_moved, dtype, spec)) for label, flops, bytes_moved in kernels]
    if plot_path is not None:
        from llm_speed.perf.plot import PlotPoint, plot_roofline

        written = plot_roofline(
            spec, [PlotPoint(label, p.flops, p.bytes_moved) for label, p in points], plot_path, dtype=dtype
        )
        if not args.json:
            print(f"wrote {written}")
    if args.json:
        ridges = {name: spec.ridge_point(name) for name in spec.peak_tflops}
        dump_json(
            {
                "gpu": spec.id,
                "dtype": dtype,
                "peak_flops": spec.peak_flops(dtype),
                "memory_bandwidth": spec.memory_bandwidth,
                "ridge_points": ridges,
                "points": [{"label": label, **vars(point)} for label, point in points],
            }
        )
        return 0
    print_table(
        f"Roofline of {spec.name}",
        ["dtype", "peak TFLOP/s", "TB/s", "ridge FLOP/byte"],
        [
            [name, spec.peak_tflops[name], spec.hbm_bandwidth_gbs / 1000, spec.ridge_point(name)]
            for name in spec.peak_tflops
        ],
    )
    if points:
        print_table(
            f"Kernels on {spec.id} ({dtype})",
            ["kernel", "FLOPs", "bytes", "FLOP/byte", "bound", "attainable TFLOP/s", "time floor us"],
            [
                [
                    label,
                    p.flops,
                    p.bytes_moved,
                    p.intensity,
                    p.bound,
                    p.attainable_flops / 1e12,
                    p.time_floor_s * 1e6,
                ]
                for label, p in points
            ],
            caption=f"ridge point {spec.ridge_point(dtype):.0f} FLOP/byte; bytes are minimum DRAM traffic",
        )
    return 0


def _vram(args: argparse.Namespace) -> int:
    if args.num_kv_heads is not None and args.num_heads % args.num_kv_heads:  # named by the options
        h, kv = args.num_heads, args.num_kv_heads
        raise ValueError(f"--num-kv-heads {kv} must divide --num-heads {h}; valid: {divisors_text(h)}")
    common: dict[str, Any] = {"heads_kv": args.num_kv_heads, "dtype": args.dtype, "training": args.training}
    shape = (args.batch_size, args.num_heads, args.seq_len, args.seq_len, args.head_dim)
    standard = attention_memory(*shape, impl="standard", **common)
    flash = attention_memory(*shape, impl="flash", **common)
    if args.json:
        dump_json(
            {
                "standard": standard,
                "flash": flash,
                "saving": standard.peak_bytes / flash.peak_bytes,
            }
        )
        return 0
    gb = 1e9
    rows = [
        [
            "Q + K + V",
            (standard.q_bytes + standard.k_bytes + standard.v_bytes) / gb,
            (flash.q_bytes + flash.k_bytes + flash.v_bytes) / gb,
        ],
        [
            "K, V repeated per query head (eager GQA)",
            standard.kv_repeated_bytes / gb,
            flash.kv_repeated_bytes / gb,
        ],
        ["output O", standard.output_bytes / gb, flash.output_bytes / gb],
        ["scores S (all heads)", standard.scores_bytes / gb, flash.scores_bytes / gb],
        ["probabilities P", standard.probs_bytes / gb, flash.probs_bytes / gb],
        ["softmax stats (fp32 LSE)", standard.softmax_stats_bytes / gb, flash.softmax_stats_bytes / gb],
    ]
    if args.training:
        rows += [
            ["forward peak", standard.forward_peak_bytes / gb, flash.forward_peak_bytes / gb],
            [
                "saved for backward",
                standard.saved_for_backward_bytes / gb,
                flash.saved_for_backward_bytes / gb,
            ],
            ["backward peak", standard.backward_peak_bytes / gb, flash.backward_peak_bytes / gb],
        ]
    rows.append(["peak", standard.peak_bytes / gb, flash.peak_bytes / gb])
    print_table(
        f"Attention memory, GB: batch {args.batch_size}, {args.num_heads} heads"
        f"{'' if args.num_kv_heads is None else f' ({args.num_kv_heads} KV)'}, seq {args.seq_len}, "
        f"head_dim {args.head_dim}, {standard.dtype}, {'training' if args.training else 'inference'}",
        ["item", "standard", "flash"],
        rows,
        caption=f"FlashAttention needs {standard.peak_bytes / flash.peak_bytes:.1f}x less at peak."
        + "".join(f" {note}" for note in size_warnings(args.seq_len)),
    )
    return 0


def _mfu(args: argparse.Namespace) -> int:
    spec = gpu_from_args(args)
    dtype = dtype_for_gpu(spec, args.dtype)
    if args.model is not None or args.tokens_per_second is not None:
        return _training_mfu(args, spec, dtype)
    sizes = (("--gpus", args.gpus), ("--seq-len", args.seq_len))
    given = [flag for flag, value in sizes if value is not None]
    if given:  # they size a model's training step; a kernel's MFU silently ignored them
        verb = "apply" if len(given) > 1 else "applies"
        raise ValueError(f"{' and '.join(given)} only {verb} with --model and --tokens-per-second")
    _attention_only(args)
    if args.ms is None:
        raise ValueError("give --ms with --flops/--gemm/--attention, or --model with --tokens-per-second")
    flops, label = args.flops, "kernel"
    if args.gemm is not None:
        if flops is not None:
            raise ValueError("give either --gemm or --flops, not both")
        m, n, k = args.gemm
        flops, label = gemm_cost(m, n, k).flops, f"gemm {m}x{n}x{k}"
    elif args.attention is not None:
        if flops is not None:
            raise ValueError("give only one of --flops, --gemm, --attention")
        flops = _attention_spec_cost(args.attention, dtype=dtype, causal=args.causal, mode=args.mode).flops
        label = f"attention {args.attention.text} {args.mode}{' causal' if args.causal else ''}"
    if flops is None:
        raise ValueError("give --flops, --gemm M,N,K or --attention B,H,S,D")
    seconds = args.ms / 1e3
    achieved = achieved_flops_per_s(flops, seconds)
    utilisation = mfu(flops, seconds, spec, dtype)
    floor_ms = flops / spec.peak_flops(dtype) * 1e3
    _warn_above_peak(utilisation, f"--ms {args.ms:g} is below the {floor_ms:.4g} ms the FLOPs take at the")
    result = {
        "label": label,
        "gpu": spec.id,
        "dtype": dtype,
        "flops": flops,
        "seconds": seconds,
        "achieved_flops_per_s": achieved,
        "peak_flops": spec.peak_flops(dtype),
        "mfu": utilisation,
    }
    if args.json:
        dump_json(result)
        return 0
    print_table(
        f"MFU of {label} on {spec.id}",
        ["FLOPs", "time ms", "achieved TFLOP/s", f"peak {dtype} TFLOP/s", "MFU %"],
        [[flops, args.ms, achieved / 1e12, spec.peak_flops(dtype) / 1e12, utilisation * 100]],
    )
    return 0


def _warn_above_peak(utilisation: float, why: str) -> None:
    """MFU over 100% is physically impossible (mfu promises [0, 1] unless the inputs are wrong): say so on
    stderr, keeping the figure, so a wrong time, throughput or FLOP count is not read as a result."""
    if utilisation > 1:
        print(
            f"llm-speed mfu: warning: MFU {utilisation:.0%} is above 100%: {why} dense peak; "
            "check the measured time or throughput and the FLOPs",
            file=sys.stderr,
        )


def _training_mfu(args: argparse.Namespace, spec, dtype: str) -> int:
    """Training MFU of --model at --tokens-per-second under every counting convention."""
    if args.model is None or args.tokens_per_second is None:
        raise ValueError("--model and --tokens-per-second go together")
    if args.ms is not None or args.flops is not None or args.gemm is not None or args.attention is not None:
        raise ValueError("--model/--tokens-per-second replace --ms/--flops/--gemm/--attention; give one set")
    given = [flag for flag, value in (("--causal", args.causal), ("--mode", args.mode)) if value]
    if given:
        raise ValueError(f"{' and '.join(given)}: with --attention only, which --model replaces")
    args.gpus = 1 if args.gpus is None else args.gpus
    args.seq_len = MFU_SEQ_LEN if args.seq_len is None else args.seq_len
    config = resolve_model(args.model)
    rows = []
    for convention in MFU_CONVENTIONS:
        # A convention that does not apply (the dense-only Megatron formulas on a mixture of experts) is
        # reported as None with the reason, not as a number.
        note = convention_not_applicable(config, convention)
        if note is not None:
            rows.append(
                {"convention": convention, "flops_per_token": None, "utilisation": None, "note": note}
            )
            continue
        rows.append(
            {
                "convention": convention,
                "flops_per_token": training_flops_per_token(config, args.seq_len, convention),
                "utilisation": throughput_mfu(
                    config,
                    args.tokens_per_second,
                    spec,
                    seq_len=args.seq_len,
                    num_gpus=args.gpus,
                    dtype=dtype,
                    convention=convention,
                ),
                "note": None,
            }
        )
    top = max((row for row in rows if row["utilisation"] is not None), key=lambda row: row["utilisation"])
    _warn_above_peak(
        top["utilisation"],
        f"--tokens-per-second {args.tokens_per_second:g} ({top['convention']}) is above what {args.gpus} "
        f"x {spec.id} reach at the",
    )
    if args.json:
        dump_json(
            {
                "model": config.name,
                "gpu": spec.id,
                "dtype": dtype,
                "gpus": args.gpus,
                "seq_len": args.seq_len,
                "tokens_per_second": args.tokens_per_second,
                "conventions": rows,
            }
        )
        return 0
    print_table(
        f"Training MFU of {config.name}: {args.tokens_per_second:g} tokens/s on {args.gpus} x {spec.id} "
        f"({dtype}), sequences of {args.seq_len}",
        ["convention", "GFLOP/token", "MFU/HFU %"],
        [
            [r["convention"], r["flops_per_token"] / 1e9, r["utilisation"] * 100]
            if r["note"] is None
            else [f"{r['convention']} (n/a: MoE)", None, None]
            for r in rows
        ],
        caption="causal counts only the attention pairs a causal kernel computes; Megatron, MosaicML and "
        "most papers count all s x s pairs (non_causal). *_hfu*: hardware FLOPs with recomputation. "
        "MosaicML's N is the active parameters for a mixture of experts (MoE); the Megatron formulas are for "
        "dense models only.",
    )
    return 0


def _waves(args: argparse.Namespace) -> int:
    m, n, _k = args.gemm
    spec = get_gpu(args.gpu)
    result = wave_quantization(m, n, args.tile_m, args.tile_n, spec.sm_count, tiles_per_sm=args.tiles_per_sm)
    if args.json:
        dump_json({"gpu": spec.id, **vars(result)})
        return 0
    print_table(
        f"Wave quantization of {m}x{n} output, {args.tile_m}x{args.tile_n} tiles, on {spec.id}",
        ["tiles", "SMs", "tiles/SM", "waves", "tail tiles", "SM efficiency %", "tile padding efficiency %"],
        [
            [
                result.tiles,
                result.sm_count,
                result.tiles_per_sm,
                result.waves,
                result.tail_tiles,
                result.efficiency * 100,
                result.padding_efficiency * 100,
            ]
        ],
    )
    return 0


def register(subparsers: Any) -> None:
    """Add ``gpus``, ``roofline``, ``vram``, ``mfu`` and ``waves`` to the ``llm-speed`` parser."""
    parser = subparsers.add_parser("gpus", help="the GPU spec table (dense peaks, with sources in --json)")
    parser.add_argument("--show", metavar="ID", help="one GPU, every field with its source")
    parser.add_argument(
        "--live", action="store_true", help="the current CUDA device's properties next to its table entry"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (every field and its source)")
    parser.set_defaults(func=_gpus)

    parser = subparsers.add_parser("roofline", help="a GPU's roofline, optionally with one kernel on it")
    add_gpu_arguments(parser, gpu_help=GPU_HELP)
    parser.add_argument(
        "--dtype", default=None, help=f"fp64, fp32, tf32, fp16, bf16, fp8, int8 ({DTYPE_DEFAULT_HELP})"
    )
    parser.add_argument("--flops", type=positive_float, help="the kernel's FLOPs")
    parser.add_argument("--bytes", type=positive_float, help="the kernel's DRAM bytes")
    parser.add_argument("--gemm", type=gemm_size, metavar="M,N,K", help="place a GEMM (minimum traffic)")
    parser.add_argument(
        "--attention",
        type=_attention_dims,
        metavar=ATTENTION_SPEC,
        help="place attention's flash, tiled and naive implementations; " + ATTENTION_HELP,
    )
    parser.add_argument("--causal", action="store_true", help="with --attention: causal mask")
    parser.add_argument("--mode", default=None, choices=ATTENTION_MODES,
                        help="with --attention (default fwd)")  # fmt: skip
    parser.add_argument("--plot", metavar="FILE.png", help="draw the roofline (and the kernels) to FILE")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.set_defaults(func=_roofline)

    parser = subparsers.add_parser("vram", help="attention memory: standard vs FlashAttention")
    parser.add_argument("--seq-len", type=positive_int, required=True)
    parser.add_argument("--num-heads", type=positive_int, required=True)
    parser.add_argument("--head-dim", type=positive_int, required=True)
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--num-kv-heads", type=positive_int, default=None, help="GQA/MQA key-value heads")
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--training", action="store_true", help="include saved tensors and the backward")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_vram)

    parser = subparsers.add_parser(
        "mfu", help="model FLOP utilisation from a measured time, or of a model's training throughput"
    )
    add_gpu_arguments(parser, gpu_help=GPU_HELP)
    parser.add_argument("--ms", type=positive_float, default=None, help="measured time in milliseconds")
    parser.add_argument("--model", default=None, help="training MFU of this model (zoo id or config.json)")
    parser.add_argument(
        "--tokens-per-second", type=positive_float, default=None, help="with --model: measured, all GPUs"
    )
    parser.add_argument("--gpus", type=positive_int, default=None,
                        help="with --model: GPUs sharing the throughput (default 1)")
    parser.add_argument("--seq-len", type=positive_int, default=None,
                        help=f"with --model: training sequence length (default {MFU_SEQ_LEN})")
    parser.add_argument(
        "--dtype", default=None, help=f"dtype whose dense peak is the denominator ({DTYPE_DEFAULT_HELP})"
    )
    parser.add_argument("--flops", type=positive_float, help="model FLOPs of the timed work")
    parser.add_argument("--gemm", type=gemm_size, metavar="M,N,K", help="FLOPs of an M,N,K GEMM (2MNK)")
    parser.add_argument("--attention", type=_attention_dims, metavar=ATTENTION_SPEC, help=ATTENTION_HELP)
    parser.add_argument("--causal", action="store_true", help="with --attention: causal mask")
    parser.add_argument("--mode", default=None, choices=ATTENTION_MODES,
                        help="with --attention (default fwd)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_mfu)

    parser = subparsers.add_parser("waves", help="tiles and wave quantization of a GEMM on a GPU's SMs")
    parser.add_argument("--gpu", required=True, help=GPU_HELP)
    parser.add_argument("--gemm", type=gemm_size, required=True, metavar="M,N,K")
    parser.add_argument("--tile-m", type=positive_int, default=128)
    parser.add_argument("--tile-n", type=positive_int, default=128)
    parser.add_argument("--tiles-per-sm", type=positive_int, default=1, help="thread blocks resident per SM")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.set_defaults(func=_waves)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """An --attention argument: batch, query heads, KV length, head dim, KV heads (GQA/MQA) and query length
    (1 for one decode step; default: the KV length)."""

    batch: int
    heads: int
    seq_kv: int
    head_dim: int
    heads_kv: int
    seq_q: int
    text: str


ATTENTION_SPEC = "B,H,S,D[,kv=HKV][,q=SQ]"
ATTENTION_HELP = (
    "attention shape B,H,S,D: batch, query heads, sequence (keys) and head dim; add kv=N for GQA/MQA "
    "key-value heads and q=1 for one decode step against S cached keys (e.g. 8,64,32768,128,kv=8,q=1)"
)


def _attention_dims(text: str) -> AttentionSpec:
    """Parse 'B,H,S,D' with optional 'kv=HKV' and 'q=SQ' items (GQA and decode)."""
    parts = [part.strip() for part in text.split(",")]
    positional = [part for part in parts if "=" not in part]
    keys = [part.split("=", 1)[0] for part in parts if "=" in part]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:  # the last one silently won
        raise argparse.ArgumentTypeError(f"{', '.join(twice)} given twice in {text!r}; give each once")
    named = dict(part.split("=", 1) for part in parts if "=" in part)
    unknown = sorted(set(named) - {"kv", "q"})
    if len(positional) != 4 or unknown:
        raise argparse.ArgumentTypeError(f"expected {ATTENTION_SPEC}, got {text!r}")
    try:
        batch, heads, seq, head_dim = (int(p) for p in positional)
        heads_kv = int(named.get("kv", heads))
        seq_q = int(named.get("q", seq))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected integers in {ATTENTION_SPEC}, got {text!r}") from error
    return AttentionSpec(batch, heads, seq, head_dim, heads_kv, seq_q, text)


def _attention_spec_cost(spec: AttentionSpec, *, dtype: str, causal: bool, mode: str, impl: str = "flash"):
    """attention_cost for a parsed --attention (its argument checks name what is wrong)."""
    return attention_cost(
        spec.batch,
        spec.heads,
        spec.seq_q,
        spec.seq_kv,
        spec.head_dim,
        heads_kv=spec.heads_kv,
        dtype=dtype,
        causal=causal,
        mode=mode,
        impl=impl,
    )
