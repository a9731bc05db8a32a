"""``llm-speed bench attention|gemm|decode|ops|moe|train-step|op``.

The flags follow the old CUDA project's benchmark scripts (``--seq-lengths``, ``--batch-size``,
``--num-heads``, ``--head-dim``, ``--dtype``, ``--warmup``, ``--iterations``, ``--output``, ``--sizes``).
Unset sizes take the GPU defaults on a CUDA device and small CPU defaults otherwise; on a CPU, sizes that
would take minutes per call are scaled down with a printed note (``--full-size`` keeps them), and the
estimated run time is printed before the work starts; the JSON keeps those notes and the sizes asked for
(``settings.requested``). Output paths are checked before the work starts (a folder made for them is removed
again when the command is then refused), and results are written after every case, so a failed or
interrupted run keeps what it measured. The parser is
built from the torch-free vocabulary in :mod:`llm_speed.bench.options`; the benchmarks (and torch) are
imported when a command runs.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING, Any

from llm_speed import _cli, ops
from llm_speed._cli import bounded_int, non_negative_int, positive_int
from llm_speed.bench import options
from llm_speed.bench.options import MAX_ITERATIONS

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from llm_speed.bench import attention as attention_bench
    from llm_speed.bench import gemm as gemm_bench


# bench overhead: calls per timed run at most (100k calls of a host path of ~50 us: 5 s per run).
MAX_OVERHEAD_CALLS = 100_000


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _add_common(
    parser: argparse.ArgumentParser,
    min_time: str | None,
    *,
    full_size: bool = True,
    plot: bool = True,
    runs: tuple[str, str] = ("GPU 10, CPU 1", "GPU 50, CPU 5"),
) -> None:
    """The flags every benchmark shares; ``min_time`` (the defaults' text) adds ``--min-time``, and
    ``full_size`` ``--full-size``, for the benchmarks that scale their sizes on a CPU. ``plot`` adds
    ``--plot`` (benchmarks whose rows have a roofline); ``runs`` is the text of the warm-up and iteration
    defaults."""
    # Run counts up to the timer's cap on timed runs: more would be cut there, or only burn time.
    parser.add_argument(
        "--warmup", type=bounded_int(0, MAX_ITERATIONS), help=f"untimed runs first ({runs[0]})"
    )
    parser.add_argument(
        "--iterations", type=bounded_int(1, MAX_ITERATIONS), help=f"timed runs, at least ({runs[1]})"
    )
    if min_time is not None:
        parser.add_argument(
            "--min-time",
            type=_seconds,
            metavar="SECONDS",
            help=f"and keep timing each row until its runs add up to this ({min_time})",
        )
    parser.add_argument("--output", metavar="FILE.json", help="write every figure and the provenance as JSON")
    parser.add_argument("--csv", metavar="FILE.csv", help="write one CSV row per implementation and case")
    if plot:
        parser.add_argument(
            "--plot",
            metavar="FILE.png",
            help="roofline of the GPU with the measured kernels (CPU runs: the model's GPU predictions)",
        )
    if full_size:
        parser.add_argument(
            "--full-size",
            action="store_true",
            help="on a CPU, run the sizes as given (by default, sizes over ~1 s per call are scaled down)",
        )
    _cli.add_device_argument(parser)
    parser.add_argument("--json", action="store_true", help="print the JSON document instead of the tables")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on standard error")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``bench`` with its ``attention`` and ``gemm`` benchmarks."""
    bench = subparsers.add_parser("bench", help="benchmark llm-speed's kernels against PyTorch and others")
    kinds = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)

    attention = kinds.add_parser(
        "attention",
        help="flash/tiled/naive vs torch SDPA backends and flash_attn",
        description="Time attention implementations at several sequence lengths (seq_q == seq_kv).",
    )
    attention.add_argument(
        "--seq-lengths", type=positive_int, nargs="+", help="GPU: 512 ... 8192; CPU: 64 128"
    )
    attention.add_argument("--batch-size", type=positive_int, help="GPU 2, CPU 1")
    attention.add_argument("--num-heads", type=positive_int, help="query heads (GPU 8, CPU 2)")
    attention.add_argument("--num-kv-heads", type=positive_int, help="key/value heads (default: --num-heads)")
    attention.add_argument("--head-dim", type=positive_int, help="GPU 64, CPU 32")
    attention.add_argument("--dtype", choices=options.ATTENTION_DTYPES, help="GPU fp16, CPU fp32")
    attention.add_argument(
        "--causal", action="store_true", help="causal mask (FLOPs count visible pairs only)"
    )
    attention.add_argument("--mode", choices=options.ATTENTION_MODES, default="fwd", help="what is timed")
    attention.add_argument("--impl", nargs="+", choices=options.ATTENTION_IMPLS, help="default: all of them")
    _add_common(attention, "GPU 0.2, CPU 0.5")
    attention.set_defaults(func=_refusal_leaves_no_folder(run_attention_command))

    gemm = kinds.add_parser(
        "gemm",
        help="llm_speed.gemm vs torch.matmul (cuBLAS), int8 vs torch._int_mm",
        description="Time GEMMs of given sizes, or of a zoo model's weight GEMMs (--model).",
    )
    shapes = gemm.add_mutually_exclusive_group()
    shapes.add_argument(
        "--sizes", type=_cli.gemm_size, nargs="+", metavar="MxNxK", help="GPU: 512^3 ... 4096^3"
    )
    shapes.add_argument(
        "--model",
        help="benchmark this model's weight GEMM shapes: a zoo id (e.g. llama-3-8b) or a config.json path",
    )
    gemm.add_argument("--tokens", type=positive_int, help="tokens (M) for --model: GPU 4096, CPU 16")
    gemm.add_argument("--dtype", choices=options.GEMM_DTYPES, help="GPU fp16, CPU fp32")
    gemm.add_argument(
        "--layout",
        choices=options.GEMM_LAYOUTS,
        help="operand storage: T = stored transposed (NT: B is [N, K], x @ W^T like nn.Linear); "
        "default NT with --model, else NN",
    )
    gemm.add_argument(
        "--epilogue",
        choices=options.GEMM_EPILOGUES,
        default="none",
        help="fused in llm-speed; separate ops after torch.matmul",
    )
    gemm.add_argument(
        "--impl",
        nargs="+",
        choices=options.GEMM_IMPLS,
        help="default: llm-speed and torch (int8: llm-speed and torch-int-mm)",
    )
    _add_common(gemm, "GPU 0.2, CPU 1")
    gemm.set_defaults(func=_refusal_leaves_no_folder(run_gemm_command))
    decode = kinds.add_parser(
        "decode",
        help="flash_attention_with_kvcache (dense and paged, 16-bit and fp8 caches) vs torch SDPA over a "
        "dense cache",
        description="Time one decode step (one query token per sequence) over a KV cache, batch x context: "
        "dense and paged caches in --dtype, the same over fp8 (e4m3) caches (their tokens/s against the "
        "16-bit cache's), and SDPA over a dense cache; on a GPU each step also replayed from a CUDA graph.",
    )
    decode.add_argument("--batch-sizes", type=positive_int, nargs="+", help="GPU: 1 8 32 128; CPU: 1 2")
    decode.add_argument(
        "--contexts", type=positive_int, nargs="+", help="cached tokens (GPU: 1024 4096 16384; CPU: 32 64)"
    )
    decode.add_argument("--num-heads", type=positive_int, help="query heads (GPU 32, CPU 4)")
    decode.add_argument("--num-kv-heads", type=positive_int, help="key/value heads (GPU 8, CPU 2)")
    decode.add_argument("--head-dim", type=positive_int, help="GPU 128, CPU 32")
    decode.add_argument(
        "--page-size", type=positive_int, help="tokens per page, a multiple of 16 (GPU 256, CPU 16)"
    )
    decode.add_argument("--dtype", choices=options.DECODE_DTYPES, help="GPU fp16, CPU fp32")
    decode.add_argument("--impl", nargs="+", choices=options.DECODE_IMPLS, help="default: all of them")
    decode.add_argument(
        "--no-graph",
        action="store_true",
        help="skip timing each step replayed from a CUDA graph (the 'graph ms' column; GPU only)",
    )
    # The run counts of bench/decode.py's GPU_DEFAULTS and CPU_DEFAULTS, as text: importing them here would
    # import torch to build the parser.
    _add_common(decode, None, runs=("GPU 10, CPU 1", "GPU 50, CPU 3"))
    decode.set_defaults(func=_refusal_leaves_no_folder(run_decode_command))
    ops_parser = kinds.add_parser(
        "ops",
        help="fused ops (rms_norm, swiglu, rotary, linear cross-entropy) vs eager, torch.compile and Liger",
        description="Forward + backward of each fused op with llm-speed, eager PyTorch, torch.compile of the "
        "eager expression and Liger-Kernel (when installed): time, GB/s against the HBM peak, the roofline, "
        "peak memory. Default sizes: a Llama-3-8B layer and head at 8192 tokens on a GPU, tiny on a CPU.",
    )
    ops_parser.add_argument("--ops", nargs="+", choices=options.OPS_NAMES, help="default: all of them")
    ops_parser.add_argument("--tokens", type=positive_int, help="rows of every op (GPU 8192, CPU 16)")
    ops_parser.add_argument("--hidden", type=positive_int, help="hidden size (GPU 4096, CPU 64)")
    ops_parser.add_argument("--intermediate", type=positive_int, help="SwiGLU width (GPU 14336, CPU 96)")
    ops_parser.add_argument("--num-heads", type=positive_int, help="rotary query heads (GPU 32, CPU 2)")
    ops_parser.add_argument("--num-kv-heads", type=positive_int, help="rotary key heads (GPU 8, CPU 1)")
    ops_parser.add_argument("--head-dim", type=positive_int, help="even (GPU 128, CPU 32)")
    ops_parser.add_argument(
        "--vocab", type=positive_int, help="cross-entropy vocabulary (GPU 128256, CPU 300)"
    )
    ops_parser.add_argument("--dtype", choices=options.OPS_DTYPES, help="GPU bf16, CPU fp32")
    ops_parser.add_argument("--impl", nargs="+", choices=options.OPS_IMPLS, help="default: all of them")
    _add_common(ops_parser, "GPU 0.2, CPU 0", runs=("GPU 10, CPU 1", "GPU 50, CPU 3"))
    ops_parser.set_defaults(func=_refusal_leaves_no_folder(run_ops_command))
    train = kinds.add_parser(
        "train-step",
        help="tokens/s and peak memory of a training step: transformers, llm-speed and Liger patches",
        description="Training step (forward with labels, backward, SGD) of a random model of one of the "
        "families llm-speed patches, unpatched, patched by llm-speed and patched by Liger-Kernel (when "
        "installed), on the same weights and tokens.",
    )
    train.add_argument("--model", required=True, help="zoo name (llm-speed models) or a config.json path")
    train.add_argument(
        "--family", choices=options.TRAIN_STEP_FAMILIES,
        help="the model's sizes in this family's layers (default: the config.json's model_type, else llama, "
        "mixtral for MoE, deepseek_v3 for MLA)",
    )  # fmt: skip
    train.add_argument("--layers", type=positive_int, help="keep the first N layers (default: all)")
    train.add_argument("--batch", type=positive_int, default=1)
    train.add_argument(
        "--seq", type=positive_int, default=None, help="tokens per sequence (GPU 2048, CPU 16)"
    )
    train.add_argument("--dtype", choices=options.OPS_DTYPES, help="GPU bf16, CPU fp32")
    train.add_argument(
        "--impl", nargs="+", choices=options.TRAIN_STEP_VARIANTS, help="variants (default: all of them)"
    )
    _add_common(train, "GPU 0, CPU 0", full_size=False, plot=False, runs=("GPU 3, CPU 1", "GPU 10, CPU 2"))
    train.set_defaults(func=_refusal_leaves_no_folder(run_train_step_command))

    moe = kinds.add_parser(
        "moe",
        help="fused MoE layer vs a torch._grouped_mm version and Hugging Face's loop over experts",
        description="Time a mixture-of-experts layer's experts (routing given), tokens x experts x top_k: "
        "llm_speed.fused_moe, the same algorithm around torch._grouped_mm, and Hugging Face's eager loop; "
        "forward, or forward + backward; TFLOP/s from the op table's fused_moe cost and peak memory.",
    )
    moe.add_argument("--tokens", type=positive_int, nargs="+", help="GPU: 2048 8192; CPU: 16")
    moe.add_argument("--experts", type=positive_int, nargs="+", help="GPU: 8 64 128; CPU: 4 8")
    moe.add_argument("--top-k", type=positive_int, nargs="+", help="experts per token (GPU: 2 8; CPU: 2)")
    moe.add_argument("--hidden", type=positive_int, help="hidden size (GPU 2048, CPU 32)")
    moe.add_argument("--intermediate", type=positive_int, help="expert width I (GPU 768, CPU 16)")
    moe.add_argument("--dtype", choices=options.MOE_DTYPES, help="GPU bf16, CPU fp32")
    moe.add_argument("--mode", choices=options.MOE_MODES, default="fwd+bwd", help="what is timed (fwd+bwd)")
    moe.add_argument("--impl", nargs="+", choices=options.MOE_IMPLS, help="default: all of them")
    _add_common(moe, "GPU 0.2, CPU 0", runs=("GPU 3, CPU 1", "GPU 10, CPU 2"))
    moe.set_defaults(func=_refusal_leaves_no_folder(run_moe_command))

    overhead = kinds.add_parser(
        "overhead",
        help="per-call cost of every public op on a tiny problem beside PyTorch's equivalent",
        description=(
            "Time one call of every public op on a tiny problem next to PyTorch's nearest equivalent and "
            "SDPA. On a CPU llm-speed's ops take the CUDA code path with the launch stubbed (the host cost "
            "of a GPU call)."
        ),
    )
    overhead.add_argument("--ops", nargs="+", choices=options.OVERHEAD_OPS, help="default: all of them")
    overhead.add_argument(
        "--modes", nargs="+", choices=options.OVERHEAD_MODES, help="default: inference autograd"
    )
    overhead.add_argument(
        "--calls", type=bounded_int(1, MAX_OVERHEAD_CALLS), help="calls per timed run (GPU 1000, CPU 2000)"
    )
    overhead.add_argument(
        "--repeats", type=bounded_int(1, MAX_ITERATIONS), default=5, help="timed runs; the fastest counts (5)"
    )
    _cli.add_device_argument(overhead)
    overhead.add_argument("--json", action="store_true", help="print the results as JSON")
    overhead.add_argument("--output", metavar="PATH", help="also write the JSON results here")
    overhead.set_defaults(func=_refusal_leaves_no_folder(run_overhead_command))

    op = kinds.add_parser(
        "op",
        help="any op of the table with an example problem, against its PyTorch baseline",
        description="Time one op of llm_speed.ops on its example problem against its baseline.",
    )
    op.add_argument("name", choices=[row.name for row in ops.OPS if row.example is not None], help="the op")
    op.add_argument("--size", type=positive_int, default=None, help="the example's scale (GPU 4096, CPU 64)")
    op.add_argument("--dtype", choices=options.ATTENTION_DTYPES, help="GPU fp16, CPU fp32")
    op.add_argument("--warmup", type=non_negative_int, help="untimed runs first (GPU 10, CPU 1)")
    op.add_argument("--iterations", type=positive_int, help="timed runs (GPU 50, CPU 3)")
    _cli.add_device_argument(op)
    op.add_argument("--json", action="store_true", help="print the JSON document instead of the table")
    op.set_defaults(func=run_op_command)


def _pick(value: Any, device: torch.device, key: str, gpu: dict, cpu: dict) -> Any:
    if value is not None:
        return value
    return (gpu if device.type == "cuda" else cpu)[key]


def attention_settings(args: argparse.Namespace) -> attention_bench.AttentionSettings:
    """Settings from parsed flags, defaults filled for the device."""
    from llm_speed.bench import attention as attention_bench
    from llm_speed.bench import report

    device = _cli.resolve_device(args.device)
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
        min_time_s=_pick(args.min_time, device, "min_time", gpu, cpu),
    )
    attention_bench.check_settings(settings)
    _refuse_head_dim(settings.head_dim, settings.impls, options.ATTENTION_LLM_SPEED_IMPLS)
    report.refuse_when_no_impl_can_run(
        settings.impls, lambda impl: attention_bench.unavailable_reason(impl, device, settings)
    )
    return settings


def _refuse_head_dim(head_dim: int, impls, ours) -> None:
    """ValueError naming --head-dim when one of llm-speed's implementations (``ours``) is asked for at a
    head_dim none of them accepts: refused before any work (its inputs at such a head_dim were made, and
    flash-fp8's quantized, before the kernel refused them: minutes of setup for a row that cannot run)."""
    from llm_speed.attention.checks import MAX_HEAD_DIM

    asked = [impl for impl in impls if impl in ours]
    if asked and head_dim > MAX_HEAD_DIM:
        others = [impl for impl in impls if impl not in ours]
        alternative = f" (a larger one with --impl naming only others: {', '.join(others)})" if others else ""
        raise ValueError(
            f"head_dim: {head_dim} is more than llm-speed's {', '.join(asked)} accept; accepted: 1 to "
            f"{MAX_HEAD_DIM}{alternative}"
        )


def gemm_settings(args: argparse.Namespace) -> gemm_bench.GemmSettings:
    """Settings from parsed flags, defaults filled for the device."""
    from llm_speed.bench import gemm as gemm_bench

    device = _cli.resolve_device(args.device)
    gpu, cpu = gemm_bench.GPU_DEFAULTS, gemm_bench.CPU_DEFAULTS
    dtype = _pick(args.dtype, device, "dtype", gpu, cpu)
    tokens = None
    if args.model:
        tokens = _pick(args.tokens, device, "tokens", gpu, cpu)
        cases = gemm_bench.model_cases(args.model, tokens)
    else:
        if args.tokens is not None:
            raise _cli.CommandError("tokens: --tokens only applies with --model")
        sizes = _pick(args.sizes, device, "sizes", gpu, cpu)
        cases = tuple(gemm_bench.GemmCase("", m, n, k) for m, n, k in sizes)
    default_impls = gemm_bench.accepted_impls(dtype)
    # A model's weights multiply as nn.Linear does, x @ W^T: W stored [N, K] (layout NT).
    layout = args.layout or ("NT" if args.model else "NN")
    settings = gemm_bench.GemmSettings(
        cases=cases,
        dtype=dtype,
        layout=layout,
        epilogue=args.epilogue,
        impls=tuple(args.impl or default_impls),
        warmup=_pick(args.warmup, device, "warmup", gpu, cpu),
        iterations=_pick(args.iterations, device, "iterations", gpu, cpu),
        device=str(device),
        model=args.model,
        tokens=tokens,
        min_time_s=_pick(args.min_time, device, "min_time", gpu, cpu),
    )
    gemm_bench.check_settings(settings)
    return settings


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output path checked (and its folder made where allowed) before any work starts; two flags
    naming one file are refused (the later write would replace the earlier: the JSON lost under the CSV)."""
    from pathlib import Path

    from llm_speed._output import prepare_output_path, prepare_plot_path

    given = {flag: getattr(args, flag, None) for flag in ("output", "csv", "plot")}
    given = {flag: path for flag, path in given.items() if path is not None}
    by_file: dict[Path, list[str]] = {}
    for flag, path in given.items():
        by_file.setdefault(Path(path).expanduser().resolve(), []).append(flag)
    for flags in by_file.values():
        if len(flags) > 1:
            raise ValueError(
                f"{' and '.join(f'--{flag}' for flag in flags)} both name {given[flags[0]]}: each would "
                "overwrite the other's file; give each its own path"
            )
    for flag, path in given.items():
        prepare = prepare_plot_path if flag == "plot" else prepare_output_path
        prepare(path, argument=f"--{flag}", made=_made_folders(args))


def _made_folders(args: argparse.Namespace) -> list | None:
    """The list the output checks record the folders they create in (:func:`_refusal_leaves_no_folder`)."""
    return getattr(args, "made_folders", None)


def _refusal_leaves_no_folder(command):
    """``command`` run so that a refusal (a ValueError: exit 2) after its output check removes the folders
    that check created, where still empty: the check comes first, so that a bad path is named before any
    other work, and may have made a folder for a run that then never happens."""
    import functools

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from llm_speed._output import remove_made_folders

        args.made_folders = []
        try:
            return command(args)
        except ValueError:
            remove_made_folders(args.made_folders)
            raise

    return run


@dataclasses.dataclass
class _Scaling:
    """What a CPU run changed of the sizes asked for: its notes, and the settings' values as asked where they
    changed (the JSON's ``settings.requested``; the other settings are the measured ones)."""

    notes: list[str] = dataclasses.field(default_factory=list)
    requested: dict[str, Any] = dataclasses.field(default_factory=dict)


def _fit_to_cpu(args: argparse.Namespace, settings, calibrate, scale, estimate, console: Console):
    """On a CPU: time each implementation's calibration calls, scale the sizes to them (unless --full-size),
    and print what changed and the estimated run time. Returns the settings to run and the :class:`_Scaling`
    the results must carry (a JSON that does not say its sizes were scaled reads as the sizes asked for)."""
    from llm_speed.bench import cpu_budget

    if not settings.device.startswith("cpu"):
        return settings, _Scaling()
    costs = calibrate(settings)
    notes: list[str] = []
    asked = settings
    if not args.full_size:
        settings, notes = scale(settings, costs)
    for note in notes:
        console.print(f"note: {note}", highlight=False, markup=False)
    console.print(
        f"note: estimated run time on this CPU: about {cpu_budget.duration_text(estimate(settings, costs))} "
        "(from calibration calls timed here)",
        highlight=False,
        markup=False,
    )
    requested = {
        field.name: getattr(asked, field.name)
        for field in dataclasses.fields(asked)
        if getattr(asked, field.name) != getattr(settings, field.name)
    }
    return settings, _Scaling(list(notes), requested)


class _Writer:
    """Runs the benchmark (on a CPU between two yardstick timings, :mod:`llm_speed.bench.cpu_load`) and writes
    the JSON and CSV files after every case (``complete: false``) and once at the end; never rows of which
    none ran (an earlier run's file at that path is kept: a failed run loses no result)."""

    def __init__(
        self, args: argparse.Namespace, settings, payload_fn, scaling: _Scaling | None = None
    ) -> None:
        self.args, self.settings, self.payload_fn = args, settings, payload_fn
        self.scaling = scaling or _Scaling()
        self.verdict = None
        self.written = False

    def run(self, benchmark, *, partial: bool = True):
        """``benchmark(settings, ...)``'s rows (written after every case where ``partial``); on a busy CPU
        with every ratio between them withheld."""
        import torch

        from llm_speed.bench import cpu_load

        options: dict[str, Any] = {"show_progress": not self.args.no_progress}
        if partial:
            options["on_case"] = self.partial
        device = torch.device(self.settings.device)
        rows, self.verdict = cpu_load.watched_run(device, lambda: benchmark(self.settings, **options))
        return rows

    def partial(self, rows) -> None:
        if self.args.output or self.args.csv:
            self.write(rows, complete=False)

    def write(self, rows, *, complete: bool) -> dict[str, Any]:
        from llm_speed._output import dump_json
        from llm_speed.bench import cpu_load, report

        payload = {
            **self.payload_fn(self.settings, rows),
            "cpu_load": cpu_load.verdict_record(self.verdict),
            "complete": complete,
        }
        if self.scaling.notes:
            payload["notes"] = [*payload.get("notes", []), *self.scaling.notes]
        if self.scaling.requested:
            payload["settings"] = {**payload["settings"], "requested": self.scaling.requested}
        if not any(row.available for row in rows):
            return payload
        if self.args.output:
            dump_json(payload, self.args.output)
        if self.args.csv:
            report.write_csv(rows, self.args.csv)
        self.written = True
        return payload


def run_decode_command(args: argparse.Namespace) -> int:
    """``llm-speed bench decode``."""
    import torch

    from llm_speed.bench import cpu_budget, report
    from llm_speed.bench import decode as decode_bench

    _check_outputs(args)
    settings = decode_bench.decode_settings(args, _cli.resolve_device(args.device))
    _refuse_head_dim(settings.head_dim, settings.impls, options.DECODE_TRITON_IMPLS)
    available = report.cpu_memory(torch.device(settings.device))
    sizes = "--batch-sizes/--contexts"
    if args.full_size:  # the sizes are final: refused before the calibration calls
        report.refuse_when_nothing_fits(decode_bench.memory_needs(settings), available, sizes)
    settings, scaling = _fit_to_cpu(
        args, settings, cpu_budget.calibrate_decode, cpu_budget.scale_decode, cpu_budget.decode_estimate,
        _side_console(args),
    )  # fmt: skip
    report.refuse_when_nothing_fits(decode_bench.memory_needs(settings), available, sizes)
    writer = _Writer(args, settings, decode_bench.results_payload, scaling)
    rows = writer.run(decode_bench.run_decode, partial=False)
    return _finish(args, settings, rows, writer, decode_bench.print_decode, f"decode, {settings.dtype}")


def run_attention_command(args: argparse.Namespace) -> int:
    """``llm-speed bench attention``."""
    from llm_speed.bench import attention as attention_bench
    from llm_speed.bench import cpu_budget

    _check_outputs(args)
    settings = attention_settings(args)
    settings, scaling = _fit_to_cpu(
        args,
        settings,
        cpu_budget.calibrate_attention,
        cpu_budget.scale_attention,
        cpu_budget.attention_estimate,
        _side_console(args),
    )
    writer = _Writer(args, settings, attention_bench.results_payload, scaling)
    rows = writer.run(attention_bench.run_attention)
    return _finish(
        args,
        settings,
        rows,
        writer,
        attention_bench.print_attention,
        f"attention {settings.mode}, {settings.dtype}",
    )


def run_gemm_command(args: argparse.Namespace) -> int:
    """``llm-speed bench gemm``."""
    from llm_speed.bench import cpu_budget
    from llm_speed.bench import gemm as gemm_bench

    _check_outputs(args)
    settings = gemm_settings(args)
    settings, scaling = _fit_to_cpu(
        args,
        settings,
        cpu_budget.calibrate_gemm,
        cpu_budget.scale_gemm,
        cpu_budget.gemm_estimate,
        _side_console(args),
    )
    after = []
    if settings.model and "cases" in scaling.requested:
        # the summary's Σ median x count is no longer the time of a forward pass of the model asked for
        after.append(
            "the summary's weighted total (each shape's median x its count per pass) is of the shapes "
            f"scaled on this CPU, not the time of one forward pass of {settings.model} at {settings.tokens} "
            "tokens"
        )
        scaling.notes.extend(after)
    writer = _Writer(args, settings, gemm_bench.results_payload, scaling)
    rows = writer.run(gemm_bench.run_gemm)
    return _finish(
        args,
        settings,
        rows,
        writer,
        gemm_bench.print_gemm,
        f"GEMM {settings.dtype} {settings.layout} {settings.epilogue}",
        notes_after=after,
    )


def _side_console(args: argparse.Namespace) -> Console:
    """Where notes and messages about written files go: stderr when stdout carries the JSON."""
    return _cli.console(stderr=True) if args.json else _cli.console()


def _finish(args, settings, rows, writer: _Writer, print_fn, title: str, notes_after=()) -> int:
    """Write and print the results (``notes_after``: printed under the table, about how to read it)."""
    import torch

    from llm_speed._output import dump_json
    from llm_speed.bench.plots import plot_rows

    payload = writer.write(rows, complete=True)
    console = _cli.console()
    if args.json:
        dump_json(payload)
    else:
        print_fn(settings, rows, console)
        for note in notes_after:
            console.print(f"note: {note}", highlight=False, markup=False)
    side = _side_console(args)
    if writer.verdict is not None:
        side.print(f"note: {writer.verdict.note()}", highlight=False, markup=False)
    for flag in ("output", "csv"):
        path = getattr(args, flag)
        if path:
            said = f"results written to {path}" if writer.written else f"nothing ran: {path} not written"
            side.print(said, highlight=False)
    if getattr(args, "plot", None):
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


# bench op defaults: (GPU, CPU)
_OP_DEFAULTS = {"size": (4096, 64), "warmup": (10, 1), "iterations": (50, 3)}


def run_op_command(args: argparse.Namespace) -> int:
    """``llm-speed bench op NAME``."""
    from llm_speed._output import dump_json
    from llm_speed.bench import cpu_load
    from llm_speed.bench import op as op_bench

    device = _cli.resolve_device(args.device)
    on_gpu = device.type == "cuda"
    chosen = {key: getattr(args, key) for key in _OP_DEFAULTS}
    chosen = {
        key: value if value is not None else _OP_DEFAULTS[key][0 if on_gpu else 1]
        for key, value in chosen.items()
    }
    refusal = op_bench.size_refusal(args.name, size=chosen["size"], dtype=args.dtype, device=device)
    if refusal:  # before the CPU's load check, the first work the command does
        raise ValueError(refusal)
    rows, verdict = cpu_load.watched_run(
        device, lambda: op_bench.run_op(args.name, dtype=args.dtype, device=device, **chosen)
    )
    busy = verdict is not None and verdict.busy
    if args.json:
        settings = {"op": args.name, **chosen, "dtype": rows[0].dtype, "device": str(device)}
        dump_json({**op_bench.results_payload(rows, settings), "cpu_load": cpu_load.verdict_record(verdict)})
    else:
        op_bench.print_op(rows, _cli.console(), ratios=not busy)
    if verdict is not None:
        _side_console(args).print(f"note: {verdict.note()}", highlight=False, markup=False)
    return 0


def _refuse_oversized_ops(settings) -> None:
    """On a CPU, a ValueError naming the sizes when an op's inputs, outputs and gradients alone would not fit
    in the memory available (the system would kill the run, and its results with it)."""
    import torch

    from llm_speed.bench import ops as ops_bench
    from llm_speed.bench import report

    reason = ops_bench.memory_refusal(settings, report.cpu_memory(torch.device(settings.device)))
    if reason is not None:
        raise ValueError(reason)


def run_ops_command(args: argparse.Namespace) -> int:
    """``llm-speed bench ops``."""
    import torch

    from llm_speed.bench import cpu_budget, report
    from llm_speed.bench import ops as ops_bench

    _check_outputs(args)
    settings = ops_bench.ops_settings(args, _cli.resolve_device(args.device))
    liger = ops_bench.liger_unavailable(torch.device(settings.device))
    report.refuse_when_no_impl_can_run(settings.impls, lambda impl: liger if impl == "liger" else None)
    if args.full_size:  # the sizes are final: refused before the calibration calls
        _refuse_oversized_ops(settings)
    scaling = None
    if cpu_budget.ops_calibrated(settings):
        settings, scaling = _fit_to_cpu(
            args, settings, cpu_budget.calibrate_ops, cpu_budget.scale_ops, cpu_budget.ops_estimate,
            _side_console(args),
        )  # fmt: skip
    _refuse_oversized_ops(settings)
    writer = _Writer(args, settings, ops_bench.results_payload, scaling)
    rows = writer.run(ops_bench.run_ops)
    return _finish(args, settings, rows, writer, ops_bench.print_ops, f"fused ops fwd+bwd, {settings.dtype}")


def run_moe_command(args: argparse.Namespace) -> int:
    """``llm-speed bench moe``."""
    import torch

    from llm_speed.bench import cpu_budget, report
    from llm_speed.bench import moe as moe_bench

    _check_outputs(args)
    settings = moe_bench.moe_settings(args, _cli.resolve_device(args.device))
    available = report.cpu_memory(torch.device(settings.device))
    sizes = "--tokens/--experts/--hidden/--intermediate"
    if args.full_size:  # the sizes are final: refused before the calibration calls
        report.refuse_when_nothing_fits(moe_bench.memory_needs(settings), available, sizes)
    settings, scaling = _fit_to_cpu(
        args, settings, cpu_budget.calibrate_moe, cpu_budget.scale_moe, cpu_budget.moe_estimate,
        _side_console(args),
    )  # fmt: skip
    report.refuse_when_nothing_fits(moe_bench.memory_needs(settings), available, sizes)
    writer = _Writer(args, settings, moe_bench.results_payload, scaling)
    rows = writer.run(moe_bench.run_moe)
    title = f"MoE experts {settings.mode}, {settings.dtype}"
    return _finish(args, settings, rows, writer, moe_bench.print_moe, title)


def run_train_step_command(args: argparse.Namespace) -> int:
    """``llm-speed bench train-step``."""
    import torch

    from llm_speed.bench import cpu_load, report
    from llm_speed.bench import train_step as train_step_bench

    _check_outputs(args)
    settings = train_step_bench.train_step_settings(args, _cli.resolve_device(args.device))
    device = torch.device(settings.device)
    report.refuse_when_no_impl_can_run(
        settings.impls, lambda impl: train_step_bench.unavailable_reason(impl, device, settings.family)
    )
    refusal = train_step_bench.memory_refusal(settings, cpu_load.available_memory())
    if refusal:
        raise ValueError(refusal)
    writer = _Writer(args, settings, train_step_bench.results_payload)
    rows = writer.run(train_step_bench.run_train_step)
    return _finish(
        args, settings, rows, writer, train_step_bench.print_train_step, f"training step, {settings.model}"
    )


def run_overhead_command(args: argparse.Namespace) -> int:
    """``llm-speed bench overhead``."""
    import contextlib

    from llm_speed._output import dump_json, prepare_output_path
    from llm_speed.bench import cpu_load, overhead

    device = _cli.resolve_device(args.device)
    if args.output is not None:
        prepare_output_path(args.output, argument="--output", made=_made_folders(args))
    settings = {
        "ops": list(args.ops or overhead.OPS),
        "modes": list(args.modes or ("inference", "autograd")),
        "calls": args.calls,
        "repeats": args.repeats,
        "device": str(device),
    }
    overhead.refuse_when_nothing_runs(settings["ops"], settings["modes"])
    with cpu_load.pinned_threads() if device.type == "cpu" else contextlib.nullcontext():
        rows, verdict = cpu_load.watched_run(device, lambda: overhead.measure(
            device, ops=settings["ops"], modes=settings["modes"], calls=args.calls, repeats=args.repeats
        ))  # fmt: skip
    payload = overhead.results_payload(rows, device, settings)
    payload["cpu_load"] = cpu_load.verdict_record(verdict)
    if args.output is not None:
        dump_json(payload, args.output)
    if args.json:
        dump_json(payload)
    else:
        console = _cli.console()
        overhead.print_rows(rows, console, device=device)
        for skipped in payload["not_run"]:
            console.print(f"  not run: {overhead.not_run_text(skipped)}", highlight=False, markup=False)
        for note in payload["notes"]:  # what the figures are (on a CPU: no GPU launch, no GPU timing)
            console.print(f"note: {note}", highlight=False, markup=False)
    if verdict is not None:
        _side_console(args).print(f"note: {verdict.note()}", highlight=False, markup=False)
    return 0
