"""CLI pieces shared by the perf commands: the GPU (a table id or a user spec) and the efficiency options."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from llm_speed._cli import fraction, non_negative_float
from llm_speed.core.gpus import GPUSpec, get_gpu, load_gpu_spec, normalize_dtype, prediction_gaps
from llm_speed.perf.efficiency import Efficiency, calibrate_from_bench

GPU_SPEC_HELP = (
    "your own GPU instead of --gpu: a JSON file of GPUSpec fields or an inline list such as "
    "based_on=h100-sxm,bf16=800,bandwidth_gbs=3000,memory_gb=96"
)


# What a command that can default its GPU models when this machine has none the table knows (as the demo).
FALLBACK_GPU = "h100-sxm"
# The NVIDIA kernel driver's folder per GPU (Linux); each holds an ``information`` file with a "Model:" line.
NVIDIA_DRIVER_GPUS = Path("/proc/driver/nvidia/gpus")
DEFAULT_GPU_HELP = f"GPU id (see `llm-speed gpus`; default: this machine's GPU, else {FALLBACK_GPU})"


def add_gpu_arguments(parser: argparse.ArgumentParser, *, gpu_help: str) -> None:
    """``--gpu ID`` or ``--gpu-spec FILE|k=v,...`` (at most one of them)."""
    parser.add_argument("--gpu", default=None, help=gpu_help)
    parser.add_argument("--gpu-spec", default=None, metavar="FILE|K=V,...", help=GPU_SPEC_HELP)


def gpu_from_args(args: argparse.Namespace, *, default: bool = False) -> GPUSpec:
    """The GPU named by ``--gpu`` or described by ``--gpu-spec``; ValueError when both are given, and when
    neither is unless ``default`` (then :func:`default_gpu`)."""
    if args.gpu is not None and args.gpu_spec is not None:
        raise ValueError("give one of --gpu ID and --gpu-spec FILE|K=V,..., not both")
    if args.gpu is None and args.gpu_spec is None:
        if not default:
            raise ValueError("give one of --gpu ID and --gpu-spec FILE|K=V,...")
        return get_gpu(default_gpu(args.command))
    if args.gpu is not None:
        return get_gpu(args.gpu)
    if Path(args.gpu_spec).expanduser().is_dir():  # else the spec's own message says "not found"
        raise ValueError(f"--gpu-spec: {args.gpu_spec!r} is a folder; expected a JSON file or K=V,... list")
    try:
        return load_gpu_spec(args.gpu_spec)
    except ValueError as error:  # name the flag: the spec's own messages name only its keys
        raise ValueError(f"--gpu-spec: {error}") from error


# --dtype's default: the first of these the GPU has a peak for (T4 and other pre-Ampere GPUs have no bf16).
DEFAULT_DTYPES = ("bf16", "fp16", "fp32")
DTYPE_DEFAULT_HELP = "default: bf16, or fp16 on a GPU without bf16 (T4)"


def dtype_for_gpu(spec: GPUSpec, dtype: str | None) -> str:
    """``--dtype`` (normalized), or when not given the first of :data:`DEFAULT_DTYPES` ``spec`` has a peak
    for; ValueError naming ``--dtype`` and the GPU's dtypes when ``spec`` has no peak for the one given."""
    if dtype is None:
        fallback = next(iter(spec.peak_tflops))  # a user spec may give none of the defaults
        return next((name for name in DEFAULT_DTYPES if name in spec.peak_tflops), fallback)
    name = normalize_dtype(dtype)
    if name not in spec.peak_tflops:
        raise ValueError(
            f"--dtype {dtype}: {spec.id} has no peak for it; accepted on {spec.id}: "
            + ", ".join(spec.peak_tflops)
        )
    return name


def check_predictable(spec: GPUSpec, implementation: str) -> None:
    """ValueError, before any work, when ``--implementation`` asks for predictions on a ``--gpu-spec`` GPU
    whose microarchitecture or fp32 peak the model needs but the spec leaves unknown (no based_on)."""
    gaps = prediction_gaps(spec)
    if implementation != "none" and gaps:
        raise ValueError(
            f"--gpu-spec: predictions (--implementation {implementation}) need {', '.join(gaps)}, which a "
            "spec without based_on leaves unknown (the model's per-SM rates and the fp32 rate of elementwise "
            "ops); "
            "give them as KEY=VALUE (fp32 in TFLOP/s), or based_on=<table id>, or --implementation none"
        )


def driver_gpu_name(folder: Path | None = None) -> str | None:
    """The model name of this machine's first NVIDIA GPU (in PCI bus order) as its driver reports it, e.g.
    "NVIDIA H100 80GB HBM3" (the name torch.cuda.get_device_name gives), else None. Read from the driver's
    files rather than through torch, so that the model commands start without importing torch."""
    try:
        devices = sorted((folder or NVIDIA_DRIVER_GPUS).iterdir())
    except OSError:
        return None
    for device in devices:
        try:
            text = (device / "information").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Model" and value.strip():
                return value.strip()
    return None


def default_gpu(command: str, folder: Path | None = None) -> str:
    """The GPU id a command models when given none: this machine's GPU when the table has it, else
    :data:`FALLBACK_GPU`. Says which on stderr (stdout may be JSON)."""
    name = driver_gpu_name(folder)
    try:
        gpu, why = get_gpu(name).id, f"the GPU in this machine, {name}"
    except (TypeError, ValueError):
        gpu = FALLBACK_GPU
        why = f"{name} is not in the GPU table, so the default" if name else "no GPU here, so the default"
    print(f"llm-speed {command}: --gpu {gpu} ({why}; --gpu ID to choose another)", file=sys.stderr)
    return gpu


def add_efficiency_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that turn floors into realistic estimates (see llm_speed.perf.efficiency)."""
    defaults = Efficiency()
    group = parser.add_argument_group("realistic estimate (llm_speed.perf.efficiency)")
    group.add_argument(
        "--compute-efficiency",
        type=fraction,
        default=None,
        help=f"share of peak FLOP/s (default {defaults.compute})",
    )
    group.add_argument(
        "--memory-efficiency",
        type=fraction,
        default=None,
        help=f"share of DRAM bandwidth (default {defaults.memory})",
    )
    group.add_argument(
        "--collective-efficiency",
        type=fraction,
        default=None,
        help=f"ring/tree bus bandwidth / line rate (default {defaults.collective}, NCCL on NVLink)",
    )
    group.add_argument(
        "--collective-latency-us",
        type=non_negative_float,
        default=None,
        help=f"fixed cost per collective call (default {defaults.collective_latency_s * 1e6:g} us)",
    )
    group.add_argument(
        "--calibrate",
        metavar="BENCH.json",
        default=None,
        help="take compute and memory efficiency from an `llm-speed bench ... --output` run on the GPU",
    )


def efficiency_from_args(args: argparse.Namespace) -> Efficiency:
    """Efficiency from --calibrate (if given), then the explicit factors on top."""
    efficiency = Efficiency()
    if args.calibrate is not None:
        try:
            efficiency = calibrate_from_bench(args.calibrate).apply(efficiency)
        except ValueError as error:  # name the flag: the bench reader's messages name only the file
            raise ValueError(f"--calibrate: {error}") from error
    changes = {
        "compute": args.compute_efficiency,
        "memory": args.memory_efficiency,
        "collective": args.collective_efficiency,
        "collective_latency_s": None
        if args.collective_latency_us is None
        else args.collective_latency_us * 1e-6,
    }
    changes = {key: value for key, value in changes.items() if value is not None}
    if changes:
        efficiency = replace(efficiency, **changes, source=efficiency.source + " + command-line factors")
    return efficiency
