"""CLI pieces shared by the perf commands: the GPU (a table id or a user spec) and the efficiency options."""

from __future__ import annotations

import argparse
from dataclasses import replace

from llm_speed.core.gpus import GPUSpec, get_gpu, load_gpu_spec
from llm_speed.perf.efficiency import Efficiency, calibrate_from_bench

GPU_SPEC_HELP = (
    "your own GPU instead of --gpu: a JSON file of GPUSpec fields or an inline list such as "
    "based_on=h100-sxm,bf16=800,bandwidth_gbs=3000,memory_gb=96"
)


def add_gpu_arguments(parser: argparse.ArgumentParser, *, gpu_help: str) -> None:
    """``--gpu ID`` or ``--gpu-spec FILE|k=v,...`` (one of them is required)."""
    parser.add_argument("--gpu", default=None, help=gpu_help)
    parser.add_argument("--gpu-spec", default=None, metavar="FILE|K=V,...", help=GPU_SPEC_HELP)


def gpu_from_args(args: argparse.Namespace) -> GPUSpec:
    """The GPU named by ``--gpu`` or described by ``--gpu-spec``; ValueError when both or neither is given."""
    if (args.gpu is None) == (args.gpu_spec is None):
        raise ValueError("give exactly one of --gpu ID and --gpu-spec FILE|K=V,...")
    return get_gpu(args.gpu) if args.gpu is not None else load_gpu_spec(args.gpu_spec)


def add_efficiency_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that turn floors into realistic estimates (see llm_speed.perf.efficiency)."""
    defaults = Efficiency()
    group = parser.add_argument_group("realistic estimate (llm_speed.perf.efficiency)")
    group.add_argument(
        "--compute-efficiency",
        type=float,
        default=None,
        help=f"share of peak FLOP/s (default {defaults.compute})",
    )
    group.add_argument(
        "--memory-efficiency",
        type=float,
        default=None,
        help=f"share of DRAM bandwidth (default {defaults.memory})",
    )
    group.add_argument(
        "--collective-efficiency",
        type=float,
        default=None,
        help=f"ring/tree bus bandwidth / line rate (default {defaults.collective}, NCCL on NVLink)",
    )
    group.add_argument(
        "--collective-latency-us",
        type=float,
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
        efficiency = calibrate_from_bench(args.calibrate).apply(efficiency)
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
