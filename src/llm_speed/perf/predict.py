"""Calibrated predictions: what a kernel will take on a GPU, which resource bounds it, and why.

The roofline (:mod:`llm_speed.perf.roofline`) gives floors: datasheet peaks, every byte read once. A floor
does not say what a kernel takes. :func:`predict` does, for every row of the op table (``llm_speed.ops``)
and a few operations outside it (``all_reduce``), for llm-speed's implementation and the vendor's (cuBLAS,
each SDPA backend, eager PyTorch). Its time is built from four terms, each a piece of hardware:

* **achievable compute**: the work of each program (a GEMM output tile, an attention query block) on one
  SM's tensor cores at an efficiency that depends on the tile: ``eta * N / (N + n_half)`` for a tensor-core
  instruction of width N (narrower when Triton splits N across warpgroups of fewer than 64 rows each),
  times ``sync`` below 64 rows (Hopper's wgmma needs 64; narrower tiles run mma.sync); where the
  calibration has the kernel compiled (``compiled``: registers, spills, occupancy from the sm_90a build),
  ``spill_s`` per register spill instruction in its loop and the compiler's programs per SM; plus, for
  attention, the exponentials on
  the SM's special-function units (16 per clock per SM, CUDA C++ Programming Guide, arithmetic instruction
  throughput: 3.9 TFLOP/s on an H100 SXM beside 989 of tensor cores, FlashAttention-3 paper, section 3)
  with its CUDA-core bookkeeping (``alu_per_score``), of which the part not overlapped with the matmuls
  (``overlap_single`` with one warpgroup per SM, ``overlap_multi`` with more: :func:`occupancy`) adds;
  each block waits at least for its prefetched tile loads (``load_s`` over the pipeline depth); plus a
  fixed cost per block iteration and per program. Programs are spread over the SMs in waves
  (:func:`makespan`: the last wave's idle SMs count, the wave quantization of
  :mod:`llm_speed.perf.gemm_tiling`); attention's programs of unequal length (causal masks) in their
  launch order, each SM taking the next as it frees (:func:`list_schedule`, :func:`launch_order`).
* **achievable bandwidth**: DRAM traffic (the minimum bytes of :mod:`llm_speed.perf.kernel_costs`, plus
  the tile re-reads that miss the L2: ``l2_miss``) at the *measured* copy bandwidth times
  ``bandwidth_efficiency``, capped by what the SMs that have a program can pull (``sm_bandwidth`` each);
  plus a ramp ``memory_latency_s``. Tile re-reads that hit the L2 still cross it: ``l2_bytes_per_s`` bounds
  them.
* **fixed per-call cost**: ``latency_s`` (launch and the kernel's own start and end on the device) and the
  host path ``host_s`` (Python, argument checks, the driver call). Under ``llm-speed bench`` timing (an L2
  flush runs before each timed call, ``context="bench"``) the host path overlaps the flush and the device
  time: the call takes ``max(device, host - flush)``; back to back (``context="stream"``) ``max(device,
  host)``; alone (``context="isolated"``) their sum; replayed from a CUDA graph (``context="graph"``) the
  device time alone.
* whichever term is largest names the **bound**: "compute", "memory" or "latency".

The parameters are per (GPU, implementation) in one data file, ``calibration.json`` next to this module,
with the measurements that set each one (:mod:`llm_speed.perf.calibrate` fits them from a results
directory: ``llm-speed predict --calibrate benchmarks/results/h100-sxm``). A GPU without its own entry gets
the H100's efficiencies applied to its own datasheet figures, and the prediction says so
(``calibrated=False``). Nothing here imports torch.
"""

from __future__ import annotations

import functools
import heapq
import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from llm_speed.core.args import positive_int
from llm_speed.core.chunking import linear_cross_entropy_chunk_rows
from llm_speed.core.gpus import GPUSpec, dtype_bytes, get_gpu, normalize_dtype
from llm_speed.core.intmath import cdiv, next_power_of_2
from llm_speed.core.tile_choice import SMALLEST_TILE_SIDE, choose_tile
from llm_speed.perf._checks import attention_shape
from llm_speed.perf.kernel_costs import (
    attention_cost,
    expected_experts_hit,
    gemm_cost,
    kvcache_decode_cost,
    varlen_attention_cost,
    visible_pairs,
    window_visible_pairs,
)
from llm_speed.perf.roofline import roofline

CALIBRATION_FILE = Path(__file__).with_name("calibration.json")
CALIBRATION_ENV = "LLM_SPEED_CALIBRATION"  # a calibration JSON that replaces the shipped one
CONTEXTS = ("bench", "stream", "isolated", "graph")
BOUNDS = ("compute", "memory", "latency")
# The GPU whose fitted efficiencies stand in for a GPU without its own calibration.
REFERENCE_GPU = "h100-sxm"

# Special-function unit throughput (exp2, rcp, ...) and type conversions: 16 per clock per SM on compute
# capability 5.x-9.0 (CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table).
SFU_OPS_PER_CLOCK_PER_SM = 16
CONVERSIONS_PER_CLOCK_PER_SM = 16
# Hopper's warpgroup MMA (wgmma) works on 64-row slices per warpgroup of 4 warps.
WGMMA_ROWS = 64
WARPS_PER_WARPGROUP = 4
THREADS_PER_WARP = 32

# Ops of the table, by family.
GEMM_OPS = ("gemm", "tensor_core_gemm", "tensor_core_gemm_int8", "gemm_fp8")
ATTENTION_OPS = (
    "flash_attention",
    "flash_attention_fp8",
    "flash_attention_backward",
    "tiled_attention",
    "naive_attention",
    "sdpa_attention",
    "flash_attention_varlen",
    "flash_attention_varlen_backward",
    "attention_kvcache_fwd",
)
ELEMENTWISE_OPS = (
    "rms_norm",
    "rms_norm_backward",
    "swiglu",
    "swiglu_backward",
    "apply_rotary",
    "geglu",
    "geglu_backward",
    "apply_rotary_qk",
    "apply_rotary_qk_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "moe_route",
    "moe_route_backward",
    "moe_sort",
)
CROSS_ENTROPY_OPS = ("fused_linear_cross_entropy", "fused_linear_cross_entropy_backward")
MOE_OPS = ("grouped_gemm", "grouped_gemm_backward", "fused_moe", "fused_moe_backward")
COLLECTIVE_OPS = ("all_reduce",)
OPS = GEMM_OPS + ATTENTION_OPS + ELEMENTWISE_OPS + CROSS_ENTROPY_OPS + MOE_OPS + COLLECTIVE_OPS
# Op-table rows predict knows it has no model for, with the reason (the error names it). Every row of
# ``llm_speed.ops`` is in OPS or here (tests/perf/test_predict.py checks it): a new row gets a model or an
# entry, never silence.
UNMODELLED: dict[str, str] = {
    "quantize_fp8": "a streaming pass over its input, not fitted on any GPU",
}
# Rows modelled with the parameters of other kernels, never measured themselves on any GPU: their
# predictions say ``calibrated=False`` (the streaming rows without a fitted entry say it too).
UNMEASURED_OPS = (
    "geglu",
    "geglu_backward",
    "apply_rotary_qk",
    "apply_rotary_qk_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "moe_route",
    "moe_route_backward",
    "moe_sort",
) + MOE_OPS
# Rows measured on a GPU but modelled with the 16-bit kernels' parameters, no fit using their points
# (llm_speed.perf.calibrate.FITTED_DTYPES): ``calibrated=False`` too, with the reason.
NOT_FITTED: dict[str, str] = {
    "gemm_fp8": "the GEMM model at fp8 peaks and bytes; measured on the H100 2026-11-25 with b N-major (NN), "
    "which the kernel transposes every K step, at 9-13x the model's time: not fitted",
    "flash_attention_fp8": "the flash forward's model at fp8 peaks and 1-byte inputs; measured on the H100 "
    "2026-11-25 at 2-4x the model's time (slower than the 16-bit kernel from seq 2048 on): not fitted",
    "tensor_core_gemm_int8": "the GEMM model at int8 peaks; measured on the H100 2026-11-25 with b N-major "
    "(NN), llm-speed's and torch._int_mm alike at about a tenth of the model's rate: not fitted",
}

# Implementation names, and what each alias means.
SDPA_BACKENDS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
ALIASES = {
    "flash": "llm-speed",
    "llm_speed": "llm-speed",
    "kvcache": "llm-speed",
    "kvcache-paged": "llm-speed",
    "torch": "cublas",
    "torch-int-mm": "cublas",
    "eager": "pytorch",
}
# "vendor": cuBLAS for GEMMs; for attention the backend F.scaled_dot_product_attention picks by default on
# Hopper for fp16/bf16 (the FlashAttention-2 kernel: cuDNN's has a lower priority in torch's dispatcher).
# MoE GEMMs: torch._grouped_mm (cuBLAS/CUTLASS grouped kernels) modelled with cuBLAS's GEMM parameters.
VENDOR = {
    "gemm": "cublas",
    "attention": "sdpa-flash",
    "elementwise": "pytorch",
    "collective": "nvls",
    "moe": "cublas",
}


def family_of(op: str) -> str:
    """The model family of an op: gemm, cross_entropy, attention, elementwise, moe or collective."""
    if op in GEMM_OPS or op in CROSS_ENTROPY_OPS:
        return "gemm" if op in GEMM_OPS else "cross_entropy"
    if op in ATTENTION_OPS:
        return "attention"
    if op in ELEMENTWISE_OPS:
        return "elementwise"
    if op in MOE_OPS:
        return "moe"
    if op in COLLECTIVE_OPS:
        return "collective"
    if op in UNMODELLED:
        raise ValueError(
            f"op: no prediction for {op!r} ({UNMODELLED[op]}); predict_work(gpu, flops=, bytes_moved=) "
            f"gives an uncalibrated estimate from its FLOPs and bytes; modelled: {', '.join(OPS)}"
        )
    raise ValueError(
        f"op: no prediction for {op!r}; modelled: {', '.join(OPS)} (predict_work(gpu, flops=, "
        "bytes_moved=) gives an uncalibrated estimate of any kernel from its FLOPs and bytes)"
    )


def implementations(op: str) -> tuple[str, ...]:
    """The implementation names :func:`predict` accepts for ``op`` (aliases and "vendor" not listed)."""
    family = family_of(op)
    if family in ("gemm", "cross_entropy", "moe"):
        return ("llm-speed", "pytorch") if family == "cross_entropy" else ("llm-speed", "cublas")
    if family == "attention":
        if op in ("flash_attention", "flash_attention_backward", "sdpa_attention"):
            return ("llm-speed", *SDPA_BACKENDS)
        if op in ("flash_attention_varlen", "flash_attention_varlen_backward", "attention_kvcache_fwd"):
            return ("llm-speed", "sdpa-flash")
        return ("llm-speed",)
    if family == "elementwise":
        return ("llm-speed", "pytorch")
    return ("ring", "tree", "nvls", "auto")


def resolve_implementation(op: str, implementation: str) -> str:
    """The canonical implementation name for ``op`` ("vendor" and aliases resolved); ValueError listing the
    accepted names otherwise."""
    if not isinstance(implementation, str):
        raise TypeError(f"implementation must be a string, got {type(implementation).__name__}")
    family = family_of(op)
    name = implementation.strip().lower()
    if name == "vendor":
        name = VENDOR["gemm" if family == "cross_entropy" else family]
        if family == "cross_entropy":
            name = "pytorch"
    elif name == "sdpa":
        name = VENDOR["attention"]
    name = ALIASES.get(name, name)
    accepted = implementations(op)
    if name not in accepted:
        raise ValueError(
            f"implementation {implementation!r} is not modelled for {op}; accepted: "
            f"{', '.join(accepted)}, vendor"
        )
    return name


# --- results ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Breakdown:
    """Every term of a prediction (seconds unless named otherwise)."""

    flops: float  # the model FLOPs of the op (kernel_costs)
    bytes_moved: float  # the minimum DRAM bytes (kernel_costs)
    dram_bytes: float  # modelled DRAM traffic: the minimum plus tile re-reads that miss the L2
    compute_s: float  # tensor cores (and exp units), over the programs' waves
    memory_s: float  # DRAM traffic at the achievable bandwidth, and L2 traffic at the L2's
    latency_s: float  # launch and the kernels' start/end on the device (all kernels of the call)
    host_s: float  # the host path per call (Python, checks, driver)
    host_exposed_s: float  # the part of the host path the call's time shows (see ``context``)
    achievable_flops_per_s: float  # flops / compute_s
    tensor_core_efficiency: float  # of the (first) kernel's tile, 0..1 of the dense peak
    achievable_bandwidth: float  # bytes/s the DRAM term runs at
    l2_bytes: float  # traffic served by the L2 (tile re-reads that hit)
    exp_s: float = 0.0  # exponentials on the special-function units (attention), before overlap
    dequant_s: float = 0.0  # weight-only dequantization on the CUDA cores (decode GEMMs)
    tile: tuple[int, ...] | None = None  # the (first) kernel's tile: (BM, BN, BK|warps, stages...) or None
    split_k: int = 1
    programs: int = 0  # programs (CTAs) of the main kernel
    waves: float = 0.0  # programs / SMs, before rounding up
    wave_efficiency: float = 1.0  # busy fraction of the SM-time over the waves (1: no idle SM)
    kernels: int = 1  # kernel launches per call
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prediction:
    """What ``implementation`` of ``op`` takes on ``gpu``: ``seconds`` and the ``bound`` ("compute",
    "memory" or "latency"), with the terms in ``breakdown``, the roofline floor beside it, and where the
    parameters came from (``source``; ``calibrated`` is False when the GPU has no calibration of its
    own, or when no GPU measurement of this op set its parameters: :data:`UNMEASURED_OPS`,
    :data:`NOT_FITTED`, the streaming rows, the fused cross-entropy)."""

    op: str
    gpu: str
    implementation: str
    seconds: float
    bound: str
    breakdown: Breakdown
    floor_s: float
    context: str
    calibrated: bool
    source: str
    problem: dict[str, Any] = field(default_factory=dict)

    @property
    def milliseconds(self) -> float:
        return self.seconds * 1e3

    def error(self, measured_s: float) -> float:
        """Signed relative error of this prediction against a measured time: predicted / measured - 1."""
        if not measured_s or measured_s <= 0:
            raise ValueError(f"measured_s must be > 0, got {measured_s!r}")
        return self.seconds / measured_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (``llm-speed predict --json``)."""
        record = asdict(self)
        record["milliseconds"] = self.milliseconds
        return record


# --- calibration data ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _read_calibration(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"calibration {path!r}: file not found")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"calibration {path!r} is not valid JSON: {error}") from error
    if not isinstance(data, dict) or "gpus" not in data:
        raise ValueError(f"calibration {path!r}: expected an object with a 'gpus' entry")
    return data


def load_calibration(calibration: str | Path | dict | None = None) -> dict[str, Any]:
    """The calibration data: ``calibration`` itself (a dict), the JSON file it names, the file named by
    ``$LLM_SPEED_CALIBRATION``, or the shipped ``calibration.json``."""
    if isinstance(calibration, dict):
        if "gpus" not in calibration:
            raise ValueError("calibration: expected an object with a 'gpus' entry")
        return calibration
    if calibration is None:
        calibration = os.environ.get(CALIBRATION_ENV) or CALIBRATION_FILE
    return _read_calibration(str(Path(calibration)))


@dataclass(frozen=True)
class GPUConstants:
    """What the model reads about a GPU: datasheet figures and the ceilings measured on it."""

    spec: GPUSpec
    copy_bytes_per_s: float  # device-to-device copy (read + write), measured, else 0.9 x datasheet
    l2_bytes_per_s: float  # L2 bandwidth (fitted where calibrated)
    l2_flush_bytes: float  # what llm-speed bench writes before each timed call (2 x L2)
    clock_hz: float  # the clock the dense tensor peak is quoted at
    sfu_per_s: float  # exponentials per second (all SMs)
    conversions_per_s: float  # int -> float conversions per second (all SMs)
    alu_per_s: float  # fp32 (non-FMA) lane operations per second (all SMs)
    calibrated: bool
    source: str


def _gpu_entry(cal: dict[str, Any], spec: GPUSpec) -> tuple[dict[str, Any], bool]:
    entry = cal["gpus"].get(spec.id)
    if entry is not None:
        return entry, True
    return cal["gpus"].get(REFERENCE_GPU, {}), False


def gpu_constants(gpu: str | GPUSpec, calibration: Any = None) -> GPUConstants:
    """The :class:`GPUConstants` of ``gpu`` under ``calibration`` (see :func:`load_calibration`)."""
    spec = get_gpu(gpu)
    cal = load_calibration(calibration)
    entry, calibrated = _gpu_entry(cal, spec)
    ceilings = entry.get("ceilings", {}) if calibrated else {}
    reference = entry.get("ceilings", {})
    if calibrated and "copy_bytes_per_s" in ceilings:
        copy = float(ceilings["copy_bytes_per_s"])
    else:
        # The reference GPU's measured copy as a fraction of its datasheet figure, on this GPU's figure.
        ratio = reference.get("copy_fraction_of_datasheet", 0.9)
        copy = float(ratio) * spec.memory_bandwidth
    l2_ratio = float(reference.get("l2_bandwidth_over_copy", 3.0))
    l2 = float(ceilings["l2_bytes_per_s"]) if "l2_bytes_per_s" in ceilings else l2_ratio * copy
    clock = spec.boost_clock_mhz * 1e6
    lanes = spec.peak_tflops.get("fp32", 0.0) * 1e12 / (2 * spec.sm_count * clock) if clock else 0.0
    return GPUConstants(
        spec=spec,
        copy_bytes_per_s=copy,
        l2_bytes_per_s=l2,
        l2_flush_bytes=float(ceilings.get("l2_flush_bytes", 2 * spec.l2_cache_mb * 1e6)),
        clock_hz=clock,
        sfu_per_s=SFU_OPS_PER_CLOCK_PER_SM * spec.sm_count * clock,
        conversions_per_s=CONVERSIONS_PER_CLOCK_PER_SM * spec.sm_count * clock,
        alu_per_s=lanes * spec.sm_count * clock,
        calibrated=calibrated,
        source=str(ceilings.get("source") or reference.get("source") or "datasheet"),
    )


def parameters(
    gpu: str | GPUSpec, implementation: str, family: str, calibration: Any = None
) -> tuple[dict[str, Any], bool, str]:
    """(parameters, calibrated, source) of ``implementation``'s ``family`` ("gemm", "attention",
    "elementwise", "host") on ``gpu``: its own entry, else the reference GPU's (calibrated=False)."""
    spec = get_gpu(gpu)
    cal = load_calibration(calibration)
    entry, calibrated = _gpu_entry(cal, spec)
    impl = entry.get("implementations", {}).get(implementation)
    if impl is None or family not in impl:
        reference = cal["gpus"].get(REFERENCE_GPU, {}).get("implementations", {}).get(implementation, {})
        if family not in reference:
            raise ValueError(f"calibration: no {family!r} parameters for {implementation!r}")
        params = reference[family]
        calibrated = False
    else:
        params = impl[family]
    source = str(params.get("source", "calibration.json"))
    if not calibrated:
        source = f"{REFERENCE_GPU} parameters on {spec.id}'s datasheet (no {spec.id} measurements): {source}"
    return params, calibrated, source


def host_table(gpu: str | GPUSpec, implementation: str, calibration: Any = None) -> dict[str, Any]:
    """The host path per call of ``implementation``'s ops measured with ``gpu`` (op -> seconds, "default"),
    else the reference GPU's; empty when none was measured."""
    spec = get_gpu(gpu)
    cal = load_calibration(calibration)
    entry, _ = _gpu_entry(cal, spec)
    table = entry.get("implementations", {}).get(implementation, {}).get("host_s")
    if table is None:
        reference = cal["gpus"].get(REFERENCE_GPU, {}).get("implementations", {})
        table = reference.get(implementation, {}).get("host_s", {})
    return table


def build_entry(implementation: str, build: str | None, calibration: Any = None) -> dict[str, Any]:
    """What a build of ``implementation`` runs (tiles, host path, defaults): the calibration's ``builds``
    entry named ``build`` (exactly, or a commit hash the name abbreviates), else the one entry that lists
    ``build`` in its ``runs`` (later commits measured that ran the same kernels and defaults: a results file
    names the git commit it ran); ``build`` None means "current" (this checkout). An entry's ``commit`` is
    the commit whose compiled kernels it runs (the ``compiled`` tables); it does not make that commit's
    measurements the entry's: "current" runs the kernels of d1b0227 with later defaults."""
    cal = load_calibration(calibration)
    builds = cal.get("builds", {}).get(implementation, {})
    name = build or "current"
    if name in builds:
        return builds[name]
    if build is None:
        return {}
    same = [entry for key, entry in builds.items() if same_commit(key, build)]
    if not same:
        same = [e for e in builds.values() if any(same_commit(c, build) for c in e.get("runs", ()))]
    if len(same) == 1:
        return same[0]
    known = ", ".join(
        key + (f" ({', '.join(entry['runs'])})" if entry.get("runs") else "") for key, entry in builds.items()
    )
    why = "described by several entries" if same else "not described"
    raise ValueError(f"build {build!r} of {implementation} is {why}; known: {known or 'none'}")


def same_commit(commit: str | None, build: str) -> bool:
    """Whether ``build`` (a commit hash, short or full) names ``commit`` (the same, at the shorter's
    length; at least 7 hex digits as git abbreviates)."""
    if not commit or min(len(commit), len(build)) < 7:
        return False
    size = min(len(commit), len(build))
    return commit[:size].lower() == build[:size].lower()


# --- building blocks -------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def list_schedule(costs: tuple[float, ...], slots: int) -> float:
    """When the last of programs of ``costs`` (in launch order) ends on ``slots`` SMs that each take the next
    program as they free (the hardware's block scheduler, one program at a time per SM at the SM's full
    rate), in cost units. Equal costs: ``ceil(n / slots)`` of them; unequal ones depend on the order, which
    is why a causal kernel launches its longest programs first."""
    if not costs:
        return 0.0
    if len(set(costs)) == 1:
        return float(math.ceil(len(costs) / slots) * costs[0])
    free = [0] * min(slots, len(costs))
    for cost in costs:
        heapq.heapreplace(free, free[0] + cost)
    return float(max(free))


def makespan(program_times: Iterable[float], slots: int) -> tuple[float, int, float, float]:
    """(time, programs, waves, wave efficiency) of programs of the given durations on ``slots`` SMs taken in
    launch order by whichever SM frees first (:func:`list_schedule`; equal programs: ``ceil(programs /
    slots)`` program times, the wave quantization)."""
    times = tuple(program_times)
    if not times:
        return 0.0, 0, 0.0, 1.0
    time = list_schedule(times, slots)
    efficiency = sum(times) / (slots * time) if time > 0 else 1.0
    return time, len(times), len(times) / slots, efficiency


def tensor_core_efficiency(params: dict[str, Any], rows: float, width: float, warps: int) -> float:
    """Fraction of the dense peak one tensor-core matmul of a program reaches: ``eta * N / (N + n_half)``
    for the instruction's N. Hopper's wgmma takes 64 rows per warpgroup: with fewer than 64 ``rows`` (or
    under 4 warps) the product runs Ampere's mma.sync instead (times ``sync``, N = ``width``); with fewer
    than 64 rows per warpgroup, Triton splits the ``width`` across the warpgroups (its warpsPerCTA layout),
    each issuing a narrower wgmma (N = width x rows / (64 x warpgroups))."""
    warpgroups = max(1, warps // WARPS_PER_WARPGROUP)
    n = float(width)
    factor = 1.0
    if rows < WGMMA_ROWS or warps < WARPS_PER_WARPGROUP:
        factor = float(params.get("sync", 1.0))
    elif rows < WGMMA_ROWS * warpgroups:
        n = width * rows / (WGMMA_ROWS * warpgroups)
    return factor * float(params["eta"]) * n / (n + float(params.get("n_half", 0.0)))


def _host_exposed(host_s: float, device_s: float, context: str, flush_s: float) -> float:
    """The host time a call shows: beyond the device time and (bench) the L2 flush it overlaps."""
    if context == "isolated":
        return host_s
    if context == "graph":
        return 0.0
    hidden = flush_s if context == "bench" else 0.0
    return max(0.0, host_s - hidden)


def _combine(
    compute_s: float, memory_s: float, latency_s: float, host_s: float, context: str, flush_s: float
) -> tuple[float, str, float]:
    """(seconds, bound, host exposed) of a call from its terms (see the module docstring)."""
    device = latency_s + max(compute_s, memory_s)
    exposed = _host_exposed(host_s, device, context, flush_s)
    seconds = device + exposed if context == "isolated" else max(device, exposed)
    if exposed >= device or latency_s >= max(compute_s, memory_s):
        bound = "latency"
    else:
        bound = "compute" if compute_s >= memory_s else "memory"
    return seconds, bound, exposed


def _check_context(context: str) -> str:
    if context not in CONTEXTS:
        raise ValueError(f"context must be one of {', '.join(CONTEXTS)}, got {context!r}")
    return context


def _host_s(impl_host: dict[str, Any], op: str) -> float:
    """The host path per call of ``op`` from an implementation's host table (0 when not listed)."""
    if not impl_host:
        return 0.0
    value = impl_host.get(op, impl_host.get("default", 0.0))
    return float(value)


# --- GEMM --------------------------------------------------------------------------------------------------

def gemm_config_choice(m: int, n: int, k: int, tiles: Sequence[Sequence[int]], sms: int, batch: int = 1,
                       element_bytes: int = 2, decode_tiles: Sequence[Sequence[int]] = ()):  # fmt: skip
    """The tile llm-speed's launcher picks among ``tiles`` and its ``decode_tiles``
    (``llm_speed.matmul.gemm.gemm_config``'s rule, :func:`llm_speed.core.tile_choice.choose_tile`)."""
    pool = [tuple(t) for t in tiles] + [tuple(t) for t in decode_tiles]
    decode_only = range(len(tiles), len(pool))
    return pool[choose_tile(m, n, k, pool, sms, batch=batch, element_bytes=element_bytes,
                            decode_only=decode_only)]  # fmt: skip


@dataclass(frozen=True)
class _Terms:
    compute_s: float
    memory_s: float
    latency_s: float
    dram_bytes: float
    l2_bytes: float
    bandwidth: float
    eta: float
    tile: tuple[int, ...] | None = None
    split_k: int = 1
    programs: int = 0
    waves: float = 0.0
    wave_efficiency: float = 1.0
    kernels: int = 1
    exp_s: float = 0.0
    dequant_s: float = 0.0
    notes: tuple[str, ...] = ()
    device_s: float | None = None  # several kernels in sequence: the sum of each one's time
    memory_overlap: float = 1.0  # how much of the shorter of compute and memory hides under the longer

    @property
    def device(self) -> float:
        if self.device_s is not None:
            return self.device_s
        longer, shorter = max(self.compute_s, self.memory_s), min(self.compute_s, self.memory_s)
        return self.latency_s + longer + (1.0 - self.memory_overlap) * shorter


def _bandwidth(params: dict[str, Any], consts: GPUConstants, active_programs: int) -> float:
    """Achievable DRAM bytes/s: the measured copy rate times the implementation's efficiency, capped by what
    the SMs that run a program can pull (``sm_bandwidth`` each)."""
    rate = consts.copy_bytes_per_s * float(params.get("bandwidth_efficiency", 1.0))
    per_sm = float(params.get("sm_bandwidth", 0.0))
    if per_sm:
        rate = min(rate, per_sm * min(active_programs, consts.spec.sm_count))
    return rate


def _memory_time(params, consts, dram_bytes, l2_bytes, active_programs) -> tuple[float, float]:
    """(seconds, DRAM bytes/s) of a kernel's traffic: DRAM at the achievable rate plus the ramp, and the
    traffic the L2 serves at the L2's rate; the slower sets the time."""
    rate = _bandwidth(params, consts, active_programs)
    dram = dram_bytes / rate + float(params.get("memory_latency_s", 0.0)) if dram_bytes else 0.0
    # The rate the implementation's tiles reach the L2 at (TMA multicast across a cluster counts once).
    l2_rate = float(params.get("l2_bytes_per_s", consts.l2_bytes_per_s))
    l2 = (dram_bytes + l2_bytes) / l2_rate if l2_rate else 0.0
    return max(dram, l2), rate


def _gemm_terms(
    params: dict[str, Any],
    consts: GPUConstants,
    *,
    m: int,
    n: int,
    k: int,
    batch: int,
    peak: float,
    in_bytes: float,
    b_bytes: float,
    out_bytes: float,
    extra_bytes: float,
    tile: Sequence[int],
    split: int,
    dequant: dict[str, float] | None,
) -> _Terms:
    """One GEMM (one tile shape, split-K ``split``): the tiles' waves on the tensor cores, the DRAM and L2
    traffic, and (weight-only quantized B) the dequantization on the CUDA cores."""
    bm, bn, bk = int(tile[0]), int(tile[1]), int(tile[2])
    warps = int(tile[3]) if len(tile) > 3 else 8
    sms = consts.spec.sm_count
    tiles = cdiv(m, bm) * cdiv(n, bn) * batch * split
    k_steps = cdiv(cdiv(k, split), bk)
    intensity = bm * bn / (bm + bn)
    eta = (
        tensor_core_efficiency(params, bm, bn, warps)
        * intensity
        / (intensity + float(params.get("tile_half", 0.0)))
    )
    per_sm = peak / sms
    tile_s = 2.0 * bm * bn * bk * (k_steps + float(params.get("tile_steps", 0.0))) / (per_sm * eta)
    tile_s += float(params.get("tile_s", 0.0))
    compute, programs, waves, wave_eff = makespan([tile_s] * tiles, sms) if tiles else (0.0, 0, 0.0, 1.0)
    # Traffic: A and B once, the output once (the minimum); A re-read per column of tiles, B per row of
    # tiles: what misses the L2 goes to DRAM, the rest is served by the L2.
    a_bytes = batch * m * k * in_bytes
    w_bytes = batch * k * n * b_bytes if batch > 1 else k * n * b_bytes
    minimum = a_bytes + w_bytes + batch * m * n * out_bytes + extra_bytes
    rereads = a_bytes * (cdiv(n, bn) - 1) + w_bytes * (cdiv(m, bm) - 1)
    miss = float(params.get("l2_miss", 0.0))
    dram = minimum + miss * rereads
    l2 = (1.0 - miss) * rereads
    kernels = 1
    if split > 1:  # fp32 partial tiles written and read back by a second (reduce) kernel
        partial = 2.0 * split * batch * m * n * 4
        dram += partial
        kernels = 2
    memory, rate = _memory_time(params, consts, dram, l2, min(tiles, sms))
    dequant_s = 0.0
    if dequant:
        # Each tile row of B is dequantized once per row of tiles (once for a decode GEMV).
        weights = batch * k * n * cdiv(m, bm) if batch > 1 else k * n * cdiv(m, bm)
        dequant_s = weights * dequant["ops_per_weight"] / dequant["ops_per_s"]
        memory = with_dequant(memory, dequant_s, dequant["overlap"])
    latency = kernels * float(params.get("latency_s", 0.0))
    return _Terms(
        compute_s=compute,
        memory_s=memory,
        latency_s=latency,
        dram_bytes=dram,
        l2_bytes=l2,
        bandwidth=rate,
        eta=eta,
        tile=(bm, bn, bk, warps),
        split_k=split,
        programs=programs,
        waves=waves,
        wave_efficiency=wave_eff,
        kernels=kernels,
        dequant_s=dequant_s,
    )


def _split_choices(params: dict[str, Any], m: int, n: int, k: int, batch: int, tile, sms: int) -> list[int]:
    """Split-K factors an implementation may use: 1, and (``split_k``) the powers of two that bring the
    tile count up to about the SM count while each part keeps at least ``min_split_k`` of K."""
    if not params.get("split_k"):
        return [1]
    tiles = cdiv(m, tile[0]) * cdiv(n, tile[1]) * batch
    minimum = int(params.get("min_split_k", 256))
    choices, split = [1], 2
    while split <= 32 and tiles * split <= 2 * sms and k // split >= minimum:
        choices.append(split)
        split *= 2
    return choices


# Weight-only quantized GEMMs (the B operand stored as int8/int4, dequantized to the compute dtype).
# "convert": each weight goes through an int->float conversion instruction (16 per clock per SM: the
# torch.compile / gpt-fast kernels); "lop3": Marlin's bit tricks (int4 -> fp16 with LOP3 and one fp16
# subtract/FMA per pair, ~1 full-rate CUDA-core op per weight; Frantar & Alistarh, IST-DASLab/marlin).
DEQUANT_METHODS = ("convert", "lop3")


def _dequant(
    consts: GPUConstants, params: dict[str, Any], method: str, weight_dtype: str
) -> dict[str, float]:
    table = params.get("dequant", {}).get(method)
    if table is None:
        raise ValueError(f"dequant {method!r} has no parameters; accepted: {', '.join(DEQUANT_METHODS)}")
    ops = float(table.get("ops_per_weight", {}).get(weight_dtype, table.get("ops_per_weight_default", 1.0)))
    rate = consts.conversions_per_s if method == "convert" else consts.alu_per_s
    return {"ops_per_weight": ops, "ops_per_s": rate, "overlap": float(table["overlap"])}


def with_dequant(memory_s: float, dequant_s: float, overlap: float) -> float:
    """A quantized weight stream's time with its dequantization on the CUDA cores: the longer of the two,
    plus the part of the shorter that does not overlap it (``overlap`` in [0, 1])."""
    return max(memory_s, dequant_s) + (1.0 - overlap) * min(memory_s, dequant_s)


def dequant_model(
    gpu: str | GPUSpec, weight_dtype: str, *, implementation: str = "vendor", method: str | None = None,
    calibration: Any = None,
) -> dict[str, float]:  # fmt: skip
    """The dequantization model :func:`predict` gives ``implementation``'s GEMMs with weights stored in
    ``weight_dtype`` on ``gpu``: ``ops_per_weight``, ``ops_per_s`` (the units that run them) and
    ``overlap`` with the weight stream (:func:`with_dequant`); ``method`` as predict's ``dequant``."""
    params, _, _ = parameters(gpu, resolve_implementation("gemm", implementation), "gemm", calibration)
    method = method or params.get("dequant_default", "convert")
    return _dequant(gpu_constants(gpu, calibration), params, method, normalize_dtype(weight_dtype))


def _predict_gemm(op, spec, consts, impl, params, build, problem) -> tuple[_Terms, float, float, dict]:
    m = positive_int("m", problem.pop("m"))
    n = positive_int("n", problem.pop("n"))
    k = positive_int("k", problem.pop("k"))
    batch = positive_int("batch", problem.pop("batch", 1))
    default_dtype = {"tensor_core_gemm_int8": "int8", "gemm_fp8": "fp8"}.get(op, "bf16")
    dtype = normalize_dtype(problem.pop("dtype", default_dtype))
    out_dtype = problem.pop("out_dtype", None)
    if dtype == "int8" and out_dtype is None:
        out_dtype = "fp32"  # int32 results: 4 bytes
    if dtype == "fp8" and out_dtype is None:
        out_dtype = "bf16"  # scaled fp8 GEMMs return bf16 by default
    with_bias, with_c = bool(problem.pop("with_bias", False)), bool(problem.pop("with_c", False))
    weight_dtype = problem.pop("weight_dtype", None)
    group_size = problem.pop("group_size", None)
    scale_bytes = float(problem.pop("scale_bytes", 2.0))
    dequant_method = problem.pop("dequant", None)
    tile_override = problem.pop("tile", None)
    _no_more(problem, op)
    cost = gemm_cost(
        m, n, k, dtype=dtype, batch=batch, out_dtype=out_dtype, with_c=with_c, with_bias=with_bias
    )
    in_bytes = dtype_bytes(dtype)
    out_bytes = in_bytes if out_dtype is None else dtype_bytes(out_dtype)
    b_bytes, dequant = in_bytes, None
    if weight_dtype is not None and normalize_dtype(weight_dtype) != dtype:
        weight_dtype = normalize_dtype(weight_dtype)
        b_bytes = dtype_bytes(weight_dtype) + (
            scale_bytes / positive_int("group_size", group_size) if group_size is not None else 0.0
        )
        method = dequant_method or params.get("dequant_default", "convert")
        dequant = _dequant(consts, params, method, weight_dtype)
        cost_bytes = cost.bytes_moved - k * n * in_bytes * (batch if batch > 1 else 1) + k * n * b_bytes
        cost = type(cost)(cost.flops, cost_bytes)
    extra = 0.0
    if with_bias:
        extra += n * out_bytes
    if with_c:
        extra += batch * m * n * out_bytes
    peak = spec.peak_flops(dtype)
    sms = spec.sm_count
    candidates = [tuple(t) for t in params["tiles"]]
    rule = build.get("gemm_tile_rule", params.get("tile_rule", "best"))
    if tile_override is not None:
        candidates = [tuple(int(x) for x in tile_override)]
    elif rule == "gemm_config":
        candidates = [gemm_config_choice(m, n, k, candidates, sms, batch, element_bytes=in_bytes,
                                         decode_tiles=params.get("decode_tiles", ()))]
    best = None
    for tile in candidates:
        for split in _split_choices(params, m, n, k, batch, tile, sms):
            terms = _gemm_terms(
                params,
                consts,
                m=m,
                n=n,
                k=k,
                batch=batch,
                peak=peak,
                in_bytes=in_bytes,
                b_bytes=b_bytes,
                out_bytes=out_bytes,
                extra_bytes=extra,
                tile=tile,
                split=split,
                dequant=dequant,
            )
            total = terms.device
            if best is None or total < best[0]:
                best = (total, terms)
    return best[1], cost.flops, cost.bytes_moved, {"dtype": dtype}


class _Problem(dict):
    """predict's problem arguments: taking one that was not given (and has no default) is a ValueError
    naming it and the op."""

    def __init__(self, op: str, problem: dict[str, Any]) -> None:
        super().__init__(problem)
        self.op = op

    _MISSING = object()

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        if key not in self and default is _Problem._MISSING:
            raise ValueError(f"{self.op}: missing problem argument {key!r}")
        return super().pop(key) if key in self else default


def _no_more(problem: dict[str, Any], op: str) -> None:
    if problem:
        raise ValueError(f"{op}: unknown problem argument(s) {', '.join(sorted(problem))}")


# --- attention ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelPass:
    """One kernel of an attention call, as the model sees it: its programs (``programs``: the block
    iterations of each, in launch order), what one block iteration does (tensor-core matmuls as (rows,
    width, FLOPs), exponentials), the registers its fp32 tiles need per thread, and its traffic (the minimum
    DRAM bytes it must move, the bytes one block iteration loads, which the L2 serves when they are
    re-reads). What the compiler made of it, where the calibration has the build compiled
    (``compiled_resources``): ``resident`` programs per SM and ``loop_spills``, the local-memory
    instructions (register spills) inside its loops; without, the occupancy is estimated from ``regs`` and
    no spill is assumed (the kernel budgets of ``make test`` hold every shipped configuration to none)."""

    name: str
    programs: tuple[int, ...]
    matmuls: tuple[tuple[float, float, float], ...]
    exps: float
    warps: int
    regs: float
    dram_bytes: float
    block_load_bytes: float
    unique_load_bytes: float  # the part of the block loads that is the minimum (read once from DRAM)
    tile: tuple[int, ...] = ()
    smem_bytes: float = 0.0  # shared memory one program holds (resident tiles + stages x streamed tiles)
    resident: int = 0  # programs per SM as compiled (0: estimated by occupancy())
    loop_spills: int = 0


def occupancy(spec: GPUSpec, kernel: KernelPass, params: dict[str, Any]) -> int:
    """Programs one SM holds at once: the compiled kernel's, else limited by shared memory
    (``smem_per_sm_kb``) and by the register file (64K registers: threads x (the tile's fp32 registers +
    ``regs_base``), at most 255 per thread)."""
    if kernel.resident:
        return kernel.resident
    smem = max(1.0, kernel.smem_bytes)
    by_smem = int(spec.smem_per_sm_kb * 1024 // smem)
    threads = kernel.warps * THREADS_PER_WARP
    regs = min(255.0, kernel.regs + float(params.get("regs_base", 40.0)))
    by_regs = int(spec.register_file_per_sm_kb * 1024 // 4 // (threads * regs))
    return max(1, min(by_smem, by_regs, int(params.get("max_programs_per_sm", 8))))


def block_time(
    params: dict[str, Any], consts: GPUConstants, peak: float, kernel: KernelPass
) -> tuple[float, float, float]:
    """(seconds, matmul seconds, softmax seconds) of one block iteration of ``kernel`` on one SM.

    Tensor cores: each matmul's FLOPs at :func:`tensor_core_efficiency` of its rows and width. Softmax: the
    block's exponentials on the special-function units plus ``alu_per_score`` CUDA-core operations per score
    (max, scale, subtract, convert). With two or more warpgroups one warpgroup's softmax runs while another's
    matmuls do (``overlap_multi`` of the shorter hidden), with one only the scheduler's interleaving
    (``overlap_single``). Plus ``block_s`` of bookkeeping, and ``spill_s`` for each register spill
    instruction in the loop, over the program's warpgroups (the others run while one waits). The K/V (or
    Q/dO) tile loads are prefetched ``stages - 1`` blocks ahead: a block cannot take less than ``load_s /
    (stages - 1)`` (one stage: the load is not hidden at all); the SM's other programs (:func:`occupancy`)
    add their warpgroups to the overlap and their stages to the prefetch depth."""
    sms = consts.spec.sm_count
    per_sm = peak / sms
    matmul_s = 0.0
    for rows, width, flops in kernel.matmuls:
        matmul_s += flops / (per_sm * tensor_core_efficiency(params, rows, width, kernel.warps))
    softmax_s = kernel.exps / (consts.sfu_per_s / sms)
    if consts.alu_per_s:
        softmax_s += kernel.exps * float(params.get("alu_per_score", 0.0)) / (consts.alu_per_s / sms)
    resident = occupancy(consts.spec, kernel, params)
    warpgroups = resident * max(1, kernel.warps // WARPS_PER_WARPGROUP)
    overlap = float(params.get("overlap_multi" if warpgroups >= 2 else "overlap_single", 0.0))
    seconds = max(matmul_s, softmax_s) + (1.0 - overlap) * min(matmul_s, softmax_s)
    seconds += float(params.get("block_s", 0.0))
    # Each spill in the loop stalls its warpgroup on local memory; another warpgroup hides part of it.
    warpgroups = max(1, kernel.warps // WARPS_PER_WARPGROUP)
    seconds += float(params.get("spill_s", 0.0)) * kernel.loop_spills / warpgroups
    load = float(params.get("load_s", 0.0))
    stages = kernel.tile[3] if len(kernel.tile) > 3 else 2
    depth = resident * stages - 1  # tiles in flight beyond the one being consumed, over the SM's programs
    seconds = max(seconds, load / depth) if depth > 0 else seconds + load
    return seconds, matmul_s, softmax_s


def _pass_terms(params, consts: GPUConstants, peak: float, kernel: KernelPass) -> _Terms:
    sms = consts.spec.sm_count
    per_sm = peak / sms
    block_s, matmul_s, exp_s = block_time(params, consts, peak, kernel)
    program_s = float(params.get("program_s", 0.0))
    count = len(kernel.programs)
    blocks = sum(kernel.programs)
    total = blocks * block_s + count * program_s
    waves = count / sms
    compute = list_schedule(kernel.programs, sms) * block_s + math.ceil(waves) * program_s
    loads = blocks * kernel.block_load_bytes
    rereads = max(0.0, loads - kernel.unique_load_bytes)
    miss = float(params.get("l2_miss", 0.0))
    dram = kernel.dram_bytes + miss * rereads
    memory, rate = _memory_time(params, consts, dram, (1.0 - miss) * rereads, min(count, sms))
    flops = sum(f for _, _, f in kernel.matmuls)
    eta = flops / (per_sm * matmul_s) if matmul_s else 0.0
    return _Terms(
        compute_s=compute,
        memory_s=memory,
        latency_s=float(params.get("latency_s", 0.0)),
        dram_bytes=dram,
        l2_bytes=(1.0 - miss) * rereads,
        bandwidth=rate,
        eta=eta,
        tile=kernel.tile,
        programs=count,
        waves=waves,
        wave_efficiency=(total / (sms * compute)) if compute else 1.0,
        exp_s=exp_s * blocks / sms,
        memory_overlap=float(params.get("memory_overlap", 1.0)),
    )


def _memory_pass_terms(params, consts: GPUConstants, name: str, dram_bytes: float, programs: int) -> _Terms:
    """A streaming kernel (no matmul): its bytes at the achievable bandwidth."""
    memory, rate = _memory_time(params, consts, dram_bytes, 0.0, programs)
    return _Terms(
        compute_s=0.0,
        memory_s=memory,
        latency_s=float(params.get("latency_s", 0.0)),
        dram_bytes=dram_bytes,
        l2_bytes=0.0,
        bandwidth=rate,
        eta=0.0,
        programs=programs,
    )


def _sequence(terms: Sequence[_Terms]) -> _Terms:
    """Kernels launched one after the other: times add; the first kernel with matmuls names the tile."""
    main = next((t for t in terms if t.eta), terms[0])
    device = sum(t.device for t in terms)
    return _Terms(
        compute_s=sum(t.compute_s for t in terms),
        memory_s=sum(t.memory_s for t in terms),
        latency_s=sum(t.latency_s for t in terms),
        dram_bytes=sum(t.dram_bytes for t in terms),
        l2_bytes=sum(t.l2_bytes for t in terms),
        bandwidth=main.bandwidth,
        eta=main.eta,
        tile=main.tile,
        programs=main.programs,
        waves=main.waves,
        wave_efficiency=main.wave_efficiency,
        kernels=len(terms),
        exp_s=sum(t.exp_s for t in terms),
        device_s=device,
    )


def query_blocks(seq_q: int, seq_kv: int, rows: int, cols: int, causal: bool) -> list[int]:
    """Key blocks of ``cols`` that each program of ``rows`` query rows walks, by query block in row order.
    Causal (bottom-right aligned): a block of rows walks the key blocks up to its last row's last visible key
    (the diagonal blocks whole, masked inside)."""
    blocks = cdiv(seq_q, rows)
    if not causal:
        return [cdiv(seq_kv, cols)] * blocks
    offset = seq_kv - seq_q
    ends = (min(seq_kv, min((i + 1) * rows, seq_q) + offset) for i in range(blocks))
    return [cdiv(end, cols) if end > 0 else 0 for end in ends]


def key_blocks(seq_q: int, seq_kv: int, rows: int, cols: int, causal: bool) -> list[int]:
    """Query blocks of ``rows`` that each program of ``cols`` keys walks (the dK/dV kernel), by key block in
    row order. Causal: the blocks from the first query row that sees the program's first key."""
    blocks = cdiv(seq_kv, cols)
    if not causal:
        return [cdiv(seq_q, rows)] * blocks
    offset = seq_kv - seq_q
    firsts = (max(0, j * cols - offset) for j in range(blocks))
    return [cdiv(seq_q - first, rows) if first < seq_q else 0 for first in firsts]


def _thinned(blocks: list[int], fraction: float) -> list[int]:
    """Block counts scaled by ``fraction`` (a sliding window's share of the visible pairs), at least 1."""
    if fraction >= 1.0:
        return blocks
    return [max(1, math.ceil(n * fraction)) if n else 0 for n in blocks]


def launch_order(per_pair: Sequence[int], pairs: int, section: int | None) -> tuple[int, ...]:
    """The programs of ``pairs`` (batch, head) pairs of blocks ``per_pair`` each, in launch order: row order
    (``section`` None: a pair's blocks adjacent), or longest first as llm-speed's causal query-block kernels
    launch (``llm_speed.attention.flash._longest_first``): sections of ``section`` pairs, block index major
    within one, from the last block."""
    if section is None:
        return tuple(per_pair) * pairs
    order: list[int] = []
    for first in range(0, pairs, section):
        width = min(section, pairs - first)
        for n in reversed(per_pair):
            order.extend([n] * width)
    return tuple(order)


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    element: float
    causal: bool
    sequences: tuple[tuple[int, int], ...]  # (seq_q, seq_kv) of each sequence (dense: one, times batch)
    window_fraction: float = 1.0

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def per_sequence(self):
        """(seq_q, seq_kv, multiplicity) per distinct sequence: a dense problem has one, ``batch`` times."""
        counts: dict[tuple[int, int], int] = {}
        for pair in self.sequences:
            counts[pair] = counts.get(pair, 0) + (self.batch if len(self.sequences) == 1 else 1)
        return [(q, kv, c) for (q, kv), c in counts.items()]

    @property
    def q_elems(self) -> int:
        return sum(q * c for q, _, c in self.per_sequence()) * self.heads_q * self.head_dim

    @property
    def kv_elems(self) -> int:
        return sum(kv * c for _, kv, c in self.per_sequence()) * self.heads_kv * self.head_dim

    @property
    def rows(self) -> int:
        return sum(q * c for q, _, c in self.per_sequence()) * self.heads_q


def _pad_dim(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _query_programs(shape: AttentionShape, rows: int, cols: int, section: int | None) -> tuple[int, ...]:
    """Programs of ``rows`` query rows per (sequence, query head) over key blocks of ``cols``, in launch
    order (:func:`launch_order`; packed sequences: a head's blocks run over the sequences in turn)."""
    per_pair = [
        n for q, kv in shape.sequences for n in _thinned(query_blocks(q, kv, rows, cols, shape.causal),
                                                         shape.window_fraction)
    ]  # fmt: skip
    return launch_order(per_pair, shape.batch * shape.heads_q, section)


def _forward_pass(
    shape: AttentionShape, tile: Sequence[int], *, passes: int = 1, section: int | None = None
) -> KernelPass:
    """The forward kernel: programs of BM query rows per (sequence, query head) walk key blocks of BN:
    S = QK^T and O += PV per block (``passes=2``: the two-pass tiled kernel, which computes QK^T twice);
    ``section``: launched longest first (:func:`launch_order`)."""
    bm, bn, warps = int(tile[0]), int(tile[1]), int(tile[2])
    d, e = _pad_dim(shape.head_dim), shape.element
    one = 2.0 * bm * bn * d
    matmuls = ((bm, bn, one), (bm, d, one)) + (((bm, bn, one),) if passes == 2 else ())
    regs = (bm * d + bm * bn) / (THREADS_PER_WARP * warps)
    dram = e * (2 * shape.q_elems + 2 * shape.kv_elems * (1.5 if passes == 2 else 1)) + 4 * shape.rows
    stages = int(tile[3]) if len(tile) > 3 else 2
    return KernelPass(
        "forward",
        _query_programs(shape, bm, bn, section),
        matmuls,
        exps=float(bm * bn) * passes,
        warps=warps,
        regs=regs,
        dram_bytes=dram,
        block_load_bytes=(2 + (passes - 1)) * bn * d * e,
        unique_load_bytes=2 * shape.kv_elems * e,
        tile=tuple(int(x) for x in tile),
        smem_bytes=e * d * (bm + stages * 2 * bn),
    )


def _dkdv_pass(
    shape: AttentionShape, tile: Sequence[int], matmuls_per_block: int, per_query_head: bool = False
) -> KernelPass:
    """The dK/dV kernel (or a vendor's one-kernel backward with ``matmuls_per_block`` 5): programs own BN keys
    of one (sequence, kv head) and walk the query blocks of BM rows of every query head of the group:
    S and dP (rows BM), dV and dK (rows BN) per block, and dQ (rows BM, atomics) for a one-kernel backward."""
    bm, bn, warps = int(tile[0]), int(tile[1]), int(tile[2])
    d, e = _pad_dim(shape.head_dim), shape.element
    # Programs of BN keys per (sequence, kv head), in row order, each walking the group's query heads
    # (llm-speed's); ``per_query_head``: one per query head instead, dK/dV summed over the group after.
    group = 1 if per_query_head else shape.group
    per_pair = [
        n * group
        for q, kv in shape.sequences
        for n in _thinned(key_blocks(q, kv, bm, bn, shape.causal), shape.window_fraction)
    ]
    one = 2.0 * bm * bn * d
    matmuls = [(bm, bn, one), (bm, bn, one), (bn, d, one), (bn, d, one)]
    if matmuls_per_block == 5:
        matmuls.append((bm, d, one))
    regs = (2 * bn * d + 2 * bm * bn) / (THREADS_PER_WARP * warps)
    # Q, dO, LSE and delta of each query block; K, V read and dK, dV written once.
    dram = e * (2 * shape.q_elems + 4 * shape.kv_elems) + 8 * shape.rows
    load = 2 * bm * d * e + 8 * bm + (2 * 4 * bm * d if matmuls_per_block == 5 else 0)
    stages = int(tile[3]) if len(tile) > 3 else 2
    return KernelPass(
        "dkdv",
        launch_order(per_pair, shape.batch * shape.heads_kv * shape.group // group, None),
        tuple(matmuls),
        exps=float(bm * bn),
        warps=warps,
        regs=regs,
        dram_bytes=dram,
        block_load_bytes=load,
        unique_load_bytes=2 * shape.q_elems * e + 8 * shape.rows,
        tile=tuple(int(x) for x in tile),
        smem_bytes=e * d * (2 * bn + stages * 2 * bm),
    )


def _dq_pass(shape: AttentionShape, tile: Sequence[int], section: int | None = None) -> KernelPass:
    """llm-speed's dQ kernel: the backward tile transposed (programs own BN query rows, walk BM keys):
    S, dP (rows BN) and dQ = dS K (rows BN) per block; Q, dO, LSE, delta read once, dQ written."""
    bm, bn, warps = int(tile[0]), int(tile[1]), int(tile[2])
    d, e = _pad_dim(shape.head_dim), shape.element
    one = 2.0 * bm * bn * d
    matmuls = ((bn, bm, one), (bn, bm, one), (bn, d, one))
    regs = (bn * d + 2 * bm * bn) / (THREADS_PER_WARP * warps)
    dram = e * (3 * shape.q_elems + 2 * shape.kv_elems) + 8 * shape.rows
    return KernelPass(
        "dq",
        _query_programs(shape, bn, bm, section),
        matmuls,
        exps=float(bm * bn),
        warps=warps,
        regs=regs,
        dram_bytes=dram,
        block_load_bytes=2 * bm * d * e,
        unique_load_bytes=2 * shape.kv_elems * e,
        tile=(bn, bm, warps, *tile[3:4]),
        smem_bytes=e * d * (2 * bn + (int(tile[3]) if len(tile) > 3 else 2) * 2 * bm),
    )


def _attention_tiles(
    params: dict[str, Any], build: dict[str, Any], head_dim: int, dtype: str, problem: dict[str, Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(forward tile, backward tile) as (BM, BN, warps, stages): the problem's override, else the build's
    table (llm-speed: by padded head_dim and dtype class), else the implementation's."""
    forward, backward = problem.pop("config", None), problem.pop("backward_config", None)
    table = build.get("attention_tiles") or params.get("tiles")
    key = str(max(64, _pad_dim(head_dim)))
    dtype_class = "fp32" if dtype == "fp32" else "fp16"

    def lookup(direction: str) -> tuple[int, ...]:
        entry = table[direction]
        entry = entry.get(dtype_class, entry) if isinstance(entry, dict) else entry
        if isinstance(entry, dict):
            entry = entry.get(key) or entry[max(entry, key=int)]
        return tuple(int(x) for x in entry)

    return (
        tuple(int(x) for x in forward) if forward is not None else lookup("forward"),
        tuple(int(x) for x in backward) if backward is not None else lookup("backward"),
    )


def _attention_shape(op: str, dtype: str, problem: dict[str, Any]) -> tuple[AttentionShape, Any]:
    """The checked shape of an attention problem, and its cost (kernel_costs) in the op's mode."""
    mode = "bwd" if op.endswith("_backward") else "fwd"
    causal = bool(problem.pop("causal", problem.pop("is_causal", False)))
    window = problem.pop("window", None)
    if window is not None:
        window = tuple(window)
    if op.startswith("flash_attention_varlen"):
        lengths_q = [positive_int("lengths_q entry", x) for x in problem.pop("lengths_q")]
        lengths_k = problem.pop("lengths_k", None)
        lengths_k = (
            lengths_q if lengths_k is None else [positive_int("lengths_k entry", x) for x in lengths_k]
        )
        if len(lengths_k) != len(lengths_q):
            raise ValueError("lengths_k must have one entry per sequence of lengths_q")
        heads_q = positive_int("heads_q", problem.pop("heads_q"))
        head_dim = positive_int("head_dim", problem.pop("head_dim"))
        heads_kv = problem.pop("heads_kv", None)
        _, heads_q, _, _, head_dim, heads_kv = attention_shape(1, heads_q, 1, 1, head_dim, heads_kv)
        cost = varlen_attention_cost(
            lengths_q,
            lengths_k,
            heads_q,
            head_dim,
            heads_kv=heads_kv,
            dtype=dtype,
            is_causal=causal,
            window=window,
            mode=mode,
        )
        pairs_full = sum(
            window_visible_pairs(q, k, is_causal=causal) for q, k in zip(lengths_q, lengths_k, strict=True)
        )
        fraction = (
            1.0
            if window is None
            else (cost.flops / (4 * heads_q * head_dim) / (BACKWARD_FACTOR[mode] * max(pairs_full, 1)))
        )
        shape = AttentionShape(
            1,
            heads_q,
            heads_kv,
            head_dim,
            dtype_bytes(dtype),
            causal,
            tuple(zip(lengths_q, lengths_k, strict=True)),
            min(1.0, fraction),
        )
        return shape, cost
    batch, heads_q, seq_q = problem.pop("batch"), problem.pop("heads_q"), problem.pop("seq_q")
    seq_kv = problem.pop("seq_kv", None)
    head_dim, heads_kv = problem.pop("head_dim"), problem.pop("heads_kv", None)
    batch, heads_q, seq_q, seq_kv, head_dim, heads_kv = attention_shape(
        batch, heads_q, seq_q, seq_q if seq_kv is None else seq_kv, head_dim, heads_kv
    )
    impl_class = {"tiled_attention": "tiled", "naive_attention": "naive", "sdpa_attention": "naive"}
    cost = attention_cost(
        batch,
        heads_q,
        seq_q,
        seq_kv,
        head_dim,
        heads_kv=heads_kv,
        dtype=dtype,
        causal=causal,
        mode=mode,
        impl=impl_class.get(op, "flash"),
        score_dtype="fp32" if op == "naive_attention" else None,
        out_dtype="bf16" if op == "flash_attention_fp8" else None,  # e4m3 in, bfloat16 out
    )
    fraction = 1.0
    if window is not None:
        pairs = window_visible_pairs(seq_q, seq_kv, is_causal=causal, window=window)
        fraction = pairs / max(1, visible_pairs(seq_q, seq_kv, causal))
        cost = type(cost)(cost.flops * fraction, cost.bytes_moved)
    shape = AttentionShape(
        batch, heads_q, heads_kv, head_dim, dtype_bytes(dtype), causal, ((seq_q, seq_kv),), min(1.0, fraction)
    )
    return shape, cost


BACKWARD_FACTOR = {"fwd": 1.0, "bwd": 2.5}
# Longest first only from this many query rows per sequence (packed: in all); llm_speed.attention.flash's
# LPT_MIN_ROWS restated without torch (tests/attention/test_launch_order.py holds them equal).
LPT_MIN_ROWS = 16384


def _lpt_section(
    spec: GPUSpec, order: str, shape: AttentionShape, min_rows: int = LPT_MIN_ROWS
) -> int | None:
    """The (batch, head) pairs per section of a longest-first launch of the query-block kernels (llm-speed's
    as ``llm_speed.attention.flash._launch_order`` does it), or None where they launch in row order:
    ``order`` "row" (llm-speed's builds before it; a vendor's kernel that launches so), masks that are
    not causal-like (a window's left bound), and sequences shorter than ``min_rows`` (:data:`LPT_MIN_ROWS`;
    a build's ``attention_lpt_min_rows``: d1b0227 launched longest first at every length)."""
    rows = sum(sq for sq, _ in shape.sequences)  # dense: the one sequence's; packed: all of them
    if order != "lpt" or not shape.causal or shape.window_fraction < 1.0 or rows < min_rows:
        return None
    kv_bytes = 2 * shape.kv_elems * shape.element / (shape.batch * shape.heads_kv)
    return max(1, int(spec.l2_cache_mb * 2**20 * shape.group // max(1.0, kv_bytes)))


def compiled_key(kernel: str, causal: bool, head_dim: int, dtype: str, tile: Sequence[int]) -> str:
    """How the calibration's ``compiled`` tables name a kernel as compiled: ``forward/causal/128/fp16/
    128,32,8,2`` (kernel, mask, head_dim, dtype, the tile as the op's configuration names it)."""
    mask = "causal" if causal else "full"
    return f"{kernel}/{mask}/{head_dim}/{dtype}/{','.join(str(int(x)) for x in tile)}"


def _as_compiled(
    kernel: KernelPass, calibration: Any, build: dict[str, Any], shape: AttentionShape, dtype: str, tile
) -> KernelPass:
    """``kernel`` with what the compiler made of it, where the calibration has its build's commit compiled
    at this tile (``compiled`` tables: ``benchmarks/compile_measured_tiles.py``; registers, spills and
    occupancy read from the sm_90a build, not guessed)."""
    table = load_calibration(calibration).get("compiled", {}).get(build.get("commit") or "", {})
    row = table.get("kernels", {}).get(compiled_key(kernel.name, shape.causal, shape.head_dim, dtype, tile))
    if row is None:
        return kernel
    return replace(kernel, resident=int(row["blocks_per_sm"]), loop_spills=int(row["loop_spills"]))


def _attention_peak(spec: GPUSpec, dtype: str) -> float:
    # fp32 attention runs an IEEE product on the CUDA cores (no TF32): the fp32 peak.
    return spec.peak_flops("fp32" if dtype == "fp32" else dtype)


def _predict_kvcache(spec, consts, impl, params, problem) -> tuple[_Terms, float, float]:
    """Decode over a KV cache: the visible cache streamed once by ``batch * heads_kv * splits`` programs
    (split-KV: enough splits to give every SM work), then (splits > 1) a small combine kernel."""
    dtype = normalize_dtype(problem.pop("dtype", "fp16"))
    batch, heads_q = problem.pop("batch"), problem.pop("heads_q")
    seq_q = problem.pop("seq_q", 1)
    context, head_dim = problem.pop("seq_kv"), problem.pop("head_dim")
    heads_kv, seq_new = problem.pop("heads_kv", None), problem.pop("seq_new", 0)
    kv_dtype = problem.pop("kv_dtype", None)
    problem.pop("page_size", None)
    cost = kvcache_decode_cost(
        batch, heads_q, seq_q, context, head_dim, heads_kv=heads_kv, dtype=dtype, seq_new=seq_new,
        kv_dtype=kv_dtype,
    )
    heads_kv = heads_q if heads_kv is None else heads_kv
    sms = spec.sm_count
    block = int(params.get("decode_block", 64))
    splits = max(1, min(cdiv(context, block), cdiv(2 * sms, batch * heads_kv)))
    programs = batch * heads_kv * splits
    main = _memory_pass_terms(params, consts, "decode", cost.bytes_moved, programs)
    peak = _attention_peak(spec, dtype)
    compute = cost.flops / (peak * float(params.get("eta", 1.0)) * min(1.0, programs / sms))
    main = _Terms(
        **{
            **main.__dict__,
            "compute_s": compute,
            "tile": (seq_q, block),
            "split_k": splits,
            "waves": programs / sms,
            "device_s": None,
        }
    )
    if splits > 1:
        partial = 2.0 * batch * heads_q * seq_q * splits * (head_dim + 1) * 4
        return (
            _sequence([main, _memory_pass_terms(params, consts, "combine", partial, batch * heads_q)]),
            cost.flops,
            cost.bytes_moved,
        )
    return main, cost.flops, cost.bytes_moved


def _predict_attention(
    op, spec, consts, impl, params, build, problem, calibration
) -> tuple[_Terms, float, float]:
    if op == "attention_kvcache_fwd":
        return _predict_kvcache(spec, consts, impl, params, problem)
    dtype = normalize_dtype(problem.pop("dtype", "fp8" if op == "flash_attention_fp8" else "fp16"))
    peak = _attention_peak(spec, dtype)
    shape, cost = _attention_shape(op, dtype, problem)
    forward_tile, backward_tile = _attention_tiles(params, build, shape.head_dim, dtype, problem)
    backward = op.endswith("_backward")
    e = shape.element
    if op in ("naive_attention", "sdpa_attention"):
        return (
            _predict_eager_attention(op, spec, consts, shape, dtype, calibration),
            cost.flops,
            cost.bytes_moved,
        )
    llm_speed = impl == "llm-speed"
    # llm-speed's launch order is its build's; a vendor's is stated with its parameters.
    # ``launch_order`` ("lpt", "row") forces one (an A/B run that patched the launcher's choice).
    launch = build if llm_speed else params
    order = problem.pop("launch_order", None) or launch.get("attention_launch", "lpt")
    section = _lpt_section(spec, order, shape, int(launch.get("attention_lpt_min_rows", LPT_MIN_ROWS)))

    def terms(kernel: KernelPass, tile: Sequence[int]) -> _Terms:
        if llm_speed:
            kernel = _as_compiled(kernel, calibration, build, shape, dtype, tile)
        return _pass_terms(params, consts, peak, kernel)

    if not backward:
        passes = 2 if op == "tiled_attention" else 1
        forward = _forward_pass(shape, forward_tile, passes=passes, section=section)
        return terms(forward, forward_tile), cost.flops, cost.bytes_moved
    deterministic = bool(problem.pop("deterministic", False)) if llm_speed else False
    # ``atomic_dq``: the five-matmul path forced where the build's default is the dQ kernel (an A/B row)
    atomic_dq = bool(problem.pop("atomic_dq", False)) if llm_speed else False
    # Backward: delta = rowsum(dO * O) first (O, dO read, delta written). Its copy of the LSE in base 2 (8
    # more bytes a row) is not priced yet: it moves the shipped fit's attention errors by 0.02%; the next
    # refit takes it in.
    preprocess_bytes = 2 * e * shape.q_elems + 4 * shape.rows
    if llm_speed and (deterministic or (build.get("attention_backward") == "dq_kernel" and not atomic_dq)):
        # The dQ kernel path (7 matmuls per tile): dK/dV, then dQ recomputing S and dP.
        preprocess = _memory_pass_terms(params, consts, "preprocess", preprocess_bytes, cdiv(shape.rows, 128))
        dkdv = terms(_dkdv_pass(shape, backward_tile, 4), backward_tile)
        dq = terms(_dq_pass(shape, backward_tile, section), backward_tile)
        return _sequence([preprocess, dkdv, dq]), cost.flops, cost.bytes_moved
    if llm_speed:
        # The default path (5 matmuls, FlashAttention-2's): the preprocess also zeroes an fp32 dQ, the dK/dV
        # kernel adds dS K to it with atomics, a conversion writes dQ (GQA's dK/dV summed in the kernel).
        preprocess = _memory_pass_terms(
            params, consts, "preprocess", preprocess_bytes + 4 * shape.q_elems, cdiv(shape.rows, 128)
        )
        dkdv = _dkdv_pass(shape, backward_tile, 5)
        main = terms(dkdv, backward_tile)
        # Every block iteration adds its BM x d share of dQ with fp32 atomics (one red.global.add per
        # element: Triton's tl.atomic_add): ``atomic_s`` each, device-wide, on top of the kernel's matmuls
        # (measured on the H100 SXM 2026-11-25: the atomic path 23.8 ms at 64x64 x 4 warps, 1 x 16 x 16384
        # d=128 fp16, against 14.3 for the dQ kernel's seven matmuls).
        atomic_s = float(params.get("atomic_s", 0.0)) * sum(dkdv.programs) * backward_tile[0] * _pad_dim(
            shape.head_dim
        )
        if atomic_s:
            main = replace(main, latency_s=main.latency_s + atomic_s,
                           device_s=None if main.device_s is None else main.device_s + atomic_s)  # fmt: skip
        convert = _memory_pass_terms(
            params, consts, "dq_convert", (4 + e) * shape.q_elems, cdiv(shape.q_elems, 1024)
        )
        return _sequence([preprocess, main, convert]), cost.flops, cost.bytes_moved
    preprocess = _memory_pass_terms(params, consts, "preprocess", preprocess_bytes, cdiv(shape.rows, 128))
    # A vendor's one-kernel backward: dQ accumulated in fp32 with atomics, zeroed first and converted after;
    # GQA's dK/dV computed per query head and summed over the group afterwards.
    main = _pass_terms(params, consts, peak, _dkdv_pass(shape, backward_tile, 5, per_query_head=True))
    extra = 4 * shape.q_elems + (4 + e) * shape.q_elems  # zero the fp32 dQ, read it, write dQ
    if shape.group > 1:
        extra += 2 * e * shape.kv_elems * shape.group * 2  # expanded dK, dV written and read back
    convert = _memory_pass_terms(params, consts, "dq_convert", extra, cdiv(shape.rows, 128))
    return _sequence([preprocess, main, convert]), cost.flops, cost.bytes_moved


# Eager (plain PyTorch) attention: two batched cuBLAS GEMMs around a softmax that makes several passes over
# the score matrix (scale, max, subtract and exp, sum, divide: ~EAGER_SOFTMAX_PASSES reads and writes).
EAGER_SOFTMAX_PASSES = 5


def _predict_eager_attention(op, spec, consts, shape: AttentionShape, dtype, calibration) -> _Terms:
    cublas, _, _ = parameters(spec, "cublas", "gemm", calibration)
    eager, _, _ = parameters(spec, "pytorch", "elementwise", calibration)
    ((seq_q, seq_kv, count),) = shape.per_sequence()
    heads = count * shape.heads_q
    peak = spec.peak_flops("tf32" if dtype == "fp32" else dtype)
    e = shape.element
    score = 4.0 if op == "naive_attention" else e
    common = dict(batch=heads, peak=peak, in_bytes=e, b_bytes=e, extra_bytes=0.0, split=1, dequant=None)
    tile = tuple(cublas["tiles"][0])
    qk = _gemm_terms(
        cublas, consts, m=seq_q, n=seq_kv, k=shape.head_dim, out_bytes=score, tile=tile, **common
    )
    pv = _gemm_terms(cublas, consts, m=seq_q, n=shape.head_dim, k=seq_kv, out_bytes=e, tile=tile, **common)
    scores = heads * seq_q * seq_kv * score
    softmax = _memory_pass_terms(
        eager, consts, "softmax", 2 * EAGER_SOFTMAX_PASSES * scores, consts.spec.sm_count
    )
    passes = [qk, softmax, pv]
    passes += [_memory_pass_terms(eager, consts, "elementwise", 0.0, 1)] * (EAGER_SOFTMAX_PASSES - 1)
    return _sequence(passes)


# --- elementwise ops, the fused cross-entropy --------------------------------------------------------------


def elementwise_cost(op: str, problem: dict[str, Any]) -> tuple[float, float, str]:
    """(FLOPs, minimum bytes, dtype) of an elementwise row, by the op table's formulas (``llm_speed.ops``:
    ``rms_norm_work``, ``swiglu_work``, ``rotary_work``; restated here without torch, tests compare them)."""
    dtype = normalize_dtype(problem.pop("dtype", "bf16"))
    e = dtype_bytes(dtype)
    if op in ("cross_entropy", "cross_entropy_backward"):  # logits_cross_entropy_work
        tokens, vocab = (
            positive_int("tokens", problem.pop("tokens")),
            positive_int("vocab", problem.pop("vocab")),
        )
        data = tokens * vocab * e
        if op == "cross_entropy_backward":
            return 6.0 * tokens * vocab, 2 * data + 4 * tokens, dtype
        return 4.0 * tokens * vocab, data + 8 * tokens, dtype
    if op.startswith("moe_route"):  # moe_route_work
        tokens = positive_int("tokens", problem.pop("tokens"))
        experts = positive_int("experts", problem.pop("experts"))
        top_k = positive_int("top_k", problem.pop("top_k"))
        logits = tokens * experts * e
        if op == "moe_route_backward":
            return 6.0 * tokens * experts, 2.0 * logits + 8.0 * tokens * top_k, dtype
        return (4.0 + top_k) * tokens * experts, logits + 8.0 * tokens * top_k, dtype
    if op == "moe_sort":  # moe_sort_work: int32 ids by default
        copies = positive_int("tokens", problem.pop("tokens")) * positive_int("top_k", problem.pop("top_k"))
        experts = positive_int("experts", problem.pop("experts"))
        id_bytes = positive_int("id_bytes", problem.pop("id_bytes", 4))
        return 0.0, 2.0 * copies * id_bytes + 8.0 * copies + 4.0 * experts, dtype
    if op.startswith("rms_norm"):
        rows, hidden = (
            positive_int("rows", problem.pop("rows")),
            positive_int("hidden", problem.pop("hidden")),
        )
        act, weight = e * rows * hidden, e * hidden
        if op == "rms_norm_backward":
            return 9.0 * rows * hidden, 3 * act + 2 * weight + 4 * rows, dtype
        return 4.0 * rows * hidden, 2 * act + weight + 4 * rows, dtype
    if op.startswith(("swiglu", "geglu")):
        if "elements" in problem:
            n = positive_int("elements", problem.pop("elements"))
        else:
            n = positive_int("rows", problem.pop("rows")) * positive_int("width", problem.pop("width"))
        # swiglu_work's activation FLOPs per element: SiLU 4, GeGLU's tanh form about 12.
        activation = 12.0 if op.startswith("geglu") else 4.0
        if op.endswith("_backward"):
            return (2 * activation + 2) * n, 5 * n * e, dtype
        return (activation + 1) * n, 3 * n * e, dtype
    if op.startswith("apply_rotary_qk"):  # rotary_qk_work: cos and sin [seq, rotary_dim]
        batch, seq = positive_int("batch", problem.pop("batch", 1)), positive_int("seq", problem.pop("seq"))
        heads_q = positive_int("heads_q", problem.pop("heads_q"))
        heads_kv = positive_int("heads_kv", problem.pop("heads_kv", heads_q))
        head_dim = positive_int("head_dim", problem.pop("head_dim"))
        rotary_dim = positive_int("rotary_dim", problem.pop("rotary_dim", head_dim))
        rows = batch * (heads_q + heads_kv) * seq
        return 6.0 * rows * (rotary_dim // 2), 2 * rows * head_dim * e + 2 * seq * rotary_dim * e, dtype
    batch, heads = positive_int("batch", problem.pop("batch", 1)), positive_int("heads", problem.pop("heads"))
    seq, head_dim = positive_int("seq", problem.pop("seq")), positive_int("head_dim", problem.pop("head_dim"))
    rotary_dim = positive_int("rotary_dim", problem.pop("rotary_dim", head_dim))
    pairs = batch * heads * seq * (rotary_dim // 2)
    return 6.0 * pairs, 2 * batch * heads * seq * head_dim * e + 2 * seq * (rotary_dim // 2) * e, dtype


def _predict_elementwise(op, spec, consts, impl, params, problem) -> tuple[_Terms, float, float, str]:
    flops, moved, dtype = elementwise_cost(op, problem)
    _no_more(problem, op)
    table = params.get("kernels", {}).get(op, {})
    kernels = int(table.get("kernels", params.get("kernels_default", 1)))
    traffic = float(table.get("traffic", 1.0))
    rows_per_program = int(params.get("rows_per_program", 1))
    programs = max(1, int(moved / max(1.0, float(params.get("bytes_per_program", 65536)))))
    del rows_per_program
    passes = [_memory_pass_terms(params, consts, op, moved * traffic / kernels, programs)] * kernels
    return _sequence(passes), flops, moved, dtype


def _predict_cross_entropy(op, spec, consts, impl, params, problem, calibration):
    """The linear cross-entropy: the logits GEMM(s), the softmax's exponentials, and the logits' traffic
    (llm-speed: chunks in the dtype of rows, the weight read once per chunk; eager: the whole [N, V] logits
    in the dtype, then in fp32). Forward 2NVH. Backward: llm-speed 6NVH (logits again, dhidden, dweight),
    eager 4NVH (it kept the logits). ``gradients=True`` (llm-speed, a reduced loss with grad): the forward
    makes dhidden and dweight with the logits (6NVH) and the backward only scales them by the loss
    gradient (one pass over them)."""
    dtype = normalize_dtype(problem.pop("dtype", "bf16"))
    tokens = positive_int("tokens", problem.pop("tokens"))
    hidden = positive_int("hidden", problem.pop("hidden"))
    vocab = positive_int("vocab", problem.pop("vocab"))
    gradients = problem.pop("gradients", False)
    _no_more(problem, op)
    if gradients not in (True, False):
        raise TypeError(f"gradients is {gradients!r}; accepted: True or False")
    if gradients and impl != "llm-speed":
        raise ValueError(f"gradients=True is llm-speed's forward (a reduced loss with grad), not {impl}'s")
    e = dtype_bytes(dtype)
    backward = op.endswith("_backward")
    operands = (tokens + vocab) * hidden * e
    if backward and gradients:  # the gradients made in the forward, read, scaled and written once
        flops, moved = float((tokens + vocab) * hidden), 2 * operands
        return _memory_pass_terms(params, consts, "elementwise", moved, spec.sm_count), flops, moved, dtype
    made = backward or gradients  # this call makes dhidden and dweight
    # the logits (but eager's backward kept them), then dhidden and dweight
    gemms = (0 if backward and impl != "llm-speed" else 1) + (2 if made else 0)
    flops = gemms * 2.0 * tokens * vocab * hidden + 4.0 * tokens * vocab * (2 if gradients else 1)
    moved = operands * (2 if made else 1)
    gemm_impl = "llm-speed" if impl == "llm-speed" else "cublas"
    gparams, _, _ = parameters(spec, gemm_impl, "gemm", calibration)
    peak = spec.peak_flops(dtype)
    if impl == "llm-speed":
        # the op's own chunk rule; the weight is read once per chunk, the chunk's logits written and read back
        # (and, making the gradients, read and written by the gradient kernel and read by the two GEMMs)
        chunk = linear_cross_entropy_chunk_rows(tokens, hidden, vocab)
        logits_bytes = (4 if made else 2) * tokens * vocab * e
    else:
        # Eager: the [N, V] logits in the dtype, upcast to fp32, log-softmax and the loss over them.
        chunk = tokens
        logits_bytes = (2 if backward else 1) * tokens * vocab * (2 * e + 12)
    chunks = cdiv(tokens, chunk)
    terms = []
    for _ in range(gemms):
        terms.append(
            _gemm_terms(
                gparams,
                consts,
                m=tokens,
                n=vocab,
                k=hidden,
                batch=1,
                peak=peak,
                in_bytes=e,
                b_bytes=e,
                out_bytes=e,
                extra_bytes=(chunks - 1) * vocab * hidden * e,
                tile=tuple(gparams["tiles"][0]),
                split=1,
                dequant=None,
            )
        )
    softmax = _memory_pass_terms(params, consts, "softmax", logits_bytes, spec.sm_count)
    exps = tokens * vocab * (2 if gradients else 1) / consts.sfu_per_s
    softmax = _Terms(**{**softmax.__dict__, "compute_s": exps, "exp_s": exps})
    return _sequence([*terms, softmax]), flops, moved, dtype


# --- mixture of experts ---------------------------------------------------------------------------------


def grouped_tile(rows_per_group: int, n: int, swiglu: bool = False) -> tuple[int, int, int, int]:
    """llm-speed's grouped-GEMM tile (``llm_speed.moe.grouped_gemm.grouped_config``'s rule restated without
    torch; tests/perf checks the two agree): BLOCK_M the rows per group as a power of two (16 to 128),
    BLOCK_N 128 (64 with the SwiGLU epilogue or row tiles of 32 or less), BLOCK_K 64, 8 warps from
    128x128 accumulator elements on."""
    block_m = min(128, max(SMALLEST_TILE_SIDE, next_power_of_2(rows_per_group)))
    block_n = 64 if swiglu or block_m <= 32 else 128
    block_n = min(block_n, max(SMALLEST_TILE_SIDE, next_power_of_2(n)))
    warps = 8 if block_m * block_n * (2 if swiglu else 1) >= 128 * 128 else 4
    return (block_m, block_n, 64, warps)


def _grouped_terms(params, consts, impl, *, groups, rows, n, k, peak, e, swiglu=False) -> _Terms:
    """One grouped GEMM of ``groups`` equal groups of ``rows`` rows (balanced routing: the model does not
    see the ids), out[rows, n] = a[rows, k] @ w_g[k, n] per group: llm-speed's tile rule, or the best of
    cuBLAS's tiles (torch._grouped_mm)."""
    common = dict(m=rows, n=n, k=k, batch=groups, peak=peak, in_bytes=e, b_bytes=e, out_bytes=e,
                  extra_bytes=0.0, split=1, dequant=None)  # fmt: skip
    if impl == "llm-speed":
        return _gemm_terms(params, consts, tile=grouped_tile(rows, n, swiglu), **common)
    options = [_gemm_terms(params, consts, tile=tuple(t), **common) for t in params["tiles"]]
    return min(options, key=lambda terms: terms.device)


def _predict_moe(op, spec, consts, impl, params, problem) -> tuple[_Terms, float, float, str]:
    """grouped_gemm(_backward): ``tokens`` rows (all groups), ``groups``, ``n``, ``k``; fused_moe(_backward):
    ``tokens, hidden, intermediate, experts, top_k``. FLOPs and bytes are the op table's
    (``grouped_gemm_work``, ``fused_moe_work``); the time is the kernels' sequence: forward the SwiGLU
    gate/up GEMM, the down GEMM and the combine; backward the gate/up GEMM again, d(act), d(hidden) and the
    two weight gradients (a GEMM over each expert's rows). The forward also sorts the copies by expert
    (two short kernels)."""
    dtype = normalize_dtype(problem.pop("dtype", "bf16"))
    e = dtype_bytes(dtype)
    peak = spec.peak_flops(dtype)
    backward = op.endswith("_backward")
    if op.startswith("grouped_gemm"):
        total = positive_int("tokens", problem.pop("tokens"))
        groups = positive_int("groups", problem.pop("groups"))
        n, k = positive_int("n", problem.pop("n")), positive_int("k", problem.pop("k"))
        _no_more(problem, op)
        rows = cdiv(total, groups)
        flops = (4.0 if backward else 2.0) * total * n * k
        moved = (total * k + groups * k * n + total * n) * e
        passes = [_grouped_terms(params, consts, impl, groups=groups, rows=rows, n=n, k=k, peak=peak, e=e)]
        if backward:
            moved += (total * k + groups * k * n) * e
            passes = [
                _grouped_terms(params, consts, impl, groups=groups, rows=rows, n=k, k=n, peak=peak, e=e),
                _grouped_terms(params, consts, impl, groups=groups, rows=k, n=n, k=rows, peak=peak, e=e),
            ]
        return _sequence(passes), flops, moved, dtype
    tokens = positive_int("tokens", problem.pop("tokens"))
    size = positive_int("hidden", problem.pop("hidden"))
    inter = positive_int("intermediate", problem.pop("intermediate"))
    experts = positive_int("experts", problem.pop("experts"))
    top_k = positive_int("top_k", problem.pop("top_k"))
    _no_more(problem, op)
    copies = tokens * top_k
    hit = expected_experts_hit(experts, top_k, tokens)
    groups = max(1, min(experts, round(hit)))
    rows = cdiv(copies, groups)
    expert_bytes = 3.0 * inter * size * e
    weights = hit * expert_bytes
    if backward:
        flops = 16.0 * copies * size * inter + 2.0 * copies * size
        moved = (
            3.0 * tokens * size * e + weights + experts * expert_bytes + 2.0 * copies * (3 * inter + size) * e
        )
    else:
        flops = 6.0 * copies * size * inter + 2.0 * copies * size
        moved = 2.0 * tokens * size * e + weights + 2.0 * copies * (inter + size) * e

    def grouped(rows_, n, k, swiglu=False):
        return _grouped_terms(params, consts, impl, groups=groups, rows=rows_, n=n, k=k, peak=peak, e=e,
                              swiglu=swiglu)  # fmt: skip

    combine = _memory_pass_terms(params, consts, "combine", (copies + tokens) * size * e, spec.sm_count)
    # Grouping the copies by expert (moe_sort: count, then place; not in the op table's fused_moe bytes).
    sort = _memory_pass_terms(params, consts, "sort", 8.0 * copies, 1)
    if not backward:
        passes = [
            sort,
            sort,
            grouped(rows, 2 * inter, size, swiglu=True),
            grouped(rows, size, inter),
            combine,
        ]
    else:
        passes = [
            grouped(rows, 2 * inter, size, swiglu=True),  # gate/up again (the activations were not kept)
            grouped(rows, inter, size),  # d(act) = dy @ W_down
            grouped(size, inter, rows),  # dW_down = dy^T @ act, per expert
            grouped(rows, size, 2 * inter),  # d(hidden) = dh @ W_gate_up
            grouped(2 * inter, size, rows),  # dW_gate_up = dh^T @ hidden, per expert
            combine,
        ]
    return _sequence(passes), flops, moved, dtype


# --- collectives -------------------------------------------------------------------------------------------


def _predict_all_reduce(spec, consts, impl, params, problem) -> tuple[_Terms, float, float, list[str]]:
    """One all-reduce of ``size_bytes`` among ``num_gpus`` over ``link``: ring (2(n-1)/n of the buffer
    through each GPU's link), tree (2x, plus 2 ceil(log2 n) latencies), NVLink SHARP (nvls: the switch
    reduces what every GPU pushes and multicasts the result, so each GPU moves D(1 + 1/n) through its link:
    the reduce-scatter reads D out of each GPU and returns D/n, the all-gather pushes D/n and multicasts
    D back), or "auto" (the faster of ring and nvls, as NCCL's tuner picks)."""
    from llm_speed.perf.distributed import link_bandwidth

    size = float(problem.pop("size_bytes"))
    if size < 0:
        raise ValueError(f"size_bytes must be >= 0, got {size}")
    n = positive_int("num_gpus", problem.pop("num_gpus"))
    link = problem.pop("link", "nvlink")
    _no_more(problem, "all_reduce")
    line = link_bandwidth(spec, link)
    latency = float(params.get("latency_s", 0.0))
    ring_rate = line * float(params["ring_efficiency"])
    nvls_ok = (
        link == "nvlink"
        and spec.architecture in ("Hopper", "Blackwell")
        and not spec.id.startswith(("h100-pcie", "h100-nvl"))
    )

    def ring() -> float:
        return latency + 2 * (n - 1) / n * size / ring_rate

    def nvls() -> float:
        return latency + size * (1 + 1 / n) / (line * float(params["nvls_efficiency"]))

    notes = []
    if n == 1:
        seconds = 0.0
    elif impl == "ring":
        seconds = ring()
    elif impl == "tree":
        seconds = 2 * math.ceil(math.log2(n)) * latency + 2 * size / ring_rate
    elif impl == "nvls":
        if not nvls_ok:
            raise ValueError(
                f"NVLink SHARP (nvls) needs third-generation NVSwitch (H100/H200/B200 SXM systems) and "
                f"link='nvlink'; {spec.id} over {link} has none: use ring, tree or auto"
            )
        seconds = nvls()
    else:
        seconds = min(ring(), nvls()) if nvls_ok else ring()
        notes.append("auto: " + ("nvls" if nvls_ok and nvls() < ring() else "ring"))
    busy = max(0.0, seconds - (latency if n > 1 else 0.0))
    terms = _Terms(
        compute_s=0.0,
        memory_s=busy,
        latency_s=latency if n > 1 else 0.0,
        dram_bytes=size,
        l2_bytes=0.0,
        bandwidth=size / busy if busy else 0.0,
        eta=0.0,
        notes=tuple(notes),
    )
    return terms, 0.0, size, notes


def all_reduce_figures(prediction: Prediction) -> dict[str, float]:
    """nccl-tests' figures of an all-reduce prediction: algbw = size / time, busbw = algbw x 2(n-1)/n."""
    size = prediction.problem["size_bytes"]
    n = prediction.problem["num_gpus"]
    algbw = size / prediction.seconds if prediction.seconds else math.inf
    return {"algbw_bytes_per_s": algbw, "busbw_bytes_per_s": algbw * 2 * (n - 1) / n}


# --- the entry point ---------------------------------------------------------------------------------------


def predict(
    op: str,
    gpu: str | GPUSpec,
    *,
    implementation: str = "llm-speed",
    context: str = "bench",
    build: str | None = None,
    calibration: Any = None,
    **problem: Any,
) -> Prediction:
    """The time ``implementation`` of ``op`` takes on ``gpu`` for ``problem``, its bound and why.

    ``op``: a row of the op table (``llm_speed.ops.names()``) or "all_reduce". ``implementation``:
    "llm-speed", "vendor" (cuBLAS for GEMMs, torch's default SDPA backend for attention, eager PyTorch for
    the fused ops, NCCL's NVLS for all-reduce), or a name of :func:`implementations`. ``context``: "bench"
    (as ``llm-speed bench`` times it: L2 flushed before each call), "stream" (back-to-back calls),
    "isolated" (one call, host path and device time added) or "graph" (replayed from a CUDA graph: no host
    path). ``build``: which llm-speed build (the
    calibration's ``builds``; None: this checkout). ``problem``, by op:

    * gemm, tensor_core_gemm, tensor_core_gemm_int8, gemm_fp8 (dtype fp8, out bf16): ``m, n, k``
      (out[m, n] = A[m, k] @ B[k, n]), ``batch``,
      ``dtype`` (bf16), ``out_dtype``, ``with_bias``, ``with_c``; weight-only quantized B: ``weight_dtype``
      ("int8", "int4"), ``group_size``, ``scale_bytes`` (2), ``dequant`` ("convert" or "lop3"); ``tile``
      (BM, BN, BK, warps) to force one.
    * attention rows: ``batch, heads_q, seq_q, seq_kv`` (= seq_q), ``head_dim``, ``heads_kv``, ``dtype``
      (fp16), ``causal``, ``window``; ``config`` / ``backward_config`` (BM, BN, warps, stages) to force
      tiles, ``launch_order`` ("lpt", "row") the query-block kernels' order, ``deterministic`` the dQ
      kernel's backward, ``atomic_dq`` the five-matmul backward where the build's default is the dQ
      kernel. Varlen: ``lengths_q``, ``lengths_k`` instead of batch and sequence lengths.
      KV-cache decode: ``batch, heads_q, seq_q`` (1), ``seq_kv`` (the keys each sequence attends to: cached
      + new), ``head_dim, heads_kv, seq_new``, ``kv_dtype`` (the cache's, default ``dtype``; "fp8": 1 byte
      per cache element, labelled uncalibrated).
    * rms_norm(_backward): ``rows, hidden``; swiglu(_backward): ``rows, width`` (or ``elements``);
      apply_rotary: ``batch, heads, seq, head_dim, rotary_dim``; fused_linear_cross_entropy(_backward):
      ``tokens, hidden, vocab``; geglu(_backward): as swiglu; apply_rotary_qk(_backward): ``batch,
      heads_q, heads_kv, seq, head_dim, rotary_dim``; cross_entropy(_backward) (on logits): ``tokens,
      vocab``; moe_route(_backward): ``tokens, experts, top_k``; moe_sort: ``tokens, top_k, experts,
      id_bytes`` (4); all each with ``dtype`` (bf16).
    * grouped_gemm(_backward): ``tokens`` (rows of all groups), ``groups, n, k``; fused_moe(_backward):
      ``tokens, hidden, intermediate, experts, top_k``; ``dtype`` (bf16). Routing is taken as balanced.
    * all_reduce: ``size_bytes, num_gpus``, ``link`` ("nvlink"); implementation "ring", "tree", "nvls",
      "auto" ("vendor" = nvls).
    """
    if not isinstance(op, str):
        raise TypeError(f"op must be a string, got {type(op).__name__}")
    family = family_of(op)
    impl = resolve_implementation(op, implementation)
    context = _check_context(context)
    spec = get_gpu(gpu)
    consts = gpu_constants(spec, calibration)
    recorded = {key: (list(value) if isinstance(value, tuple) else value) for key, value in problem.items()}
    work = _Problem(op, problem)
    host_s = 0.0
    dtype = "bf16"
    if family == "collective":
        params, calibrated, source = parameters(spec, "nccl", "collective", calibration)
        terms, flops, moved, _ = _predict_all_reduce(spec, consts, impl, params, work)
        return Prediction(
            op=op,
            gpu=spec.id,
            implementation=impl,
            seconds=terms.device,
            bound="latency" if terms.latency_s >= terms.memory_s else "memory",
            breakdown=_breakdown(terms, flops, moved, 0.0, 0.0),
            floor_s=0.0,
            context=context,
            calibrated=calibrated,
            source=source,
            problem=recorded,
        )
    section = {"cross_entropy": "elementwise", "moe": "gemm"}.get(family, family)
    params, calibrated, source = parameters(spec, impl, section, calibration)
    built = build_entry(impl, build, calibration)
    if family == "gemm":
        terms, flops, moved, info = _predict_gemm(op, spec, consts, impl, params, built, work)
        dtype = info["dtype"]
    elif family == "attention":
        dtype = normalize_dtype(work.get("dtype", "fp16"))
        terms, flops, moved = _predict_attention(op, spec, consts, impl, params, built, work, calibration)
        _no_more(work, op)
    elif family == "elementwise":
        terms, flops, moved, dtype = _predict_elementwise(op, spec, consts, impl, params, work)
    elif family == "moe":
        terms, flops, moved, dtype = _predict_moe(op, spec, consts, impl, params, work)
    else:
        terms, flops, moved, dtype = _predict_cross_entropy(op, spec, consts, impl, params, work, calibration)
    host_s = _host_s(built.get("host_s") or host_table(spec, impl, calibration), op)
    flush_s = consts.l2_flush_bytes / consts.copy_bytes_per_s if consts.copy_bytes_per_s else 0.0
    device = terms.device
    exposed = _host_exposed(host_s, device, context, flush_s)
    seconds = device + exposed if context == "isolated" else max(device, exposed)
    if exposed >= device or terms.latency_s >= max(terms.compute_s, terms.memory_s):
        bound = "latency"
    else:
        bound = "compute" if terms.compute_s >= terms.memory_s else "memory"
    floor_dtype = "fp32" if dtype == "fp32" and family == "attention" else dtype
    floor = roofline(flops, moved, floor_dtype, spec).time_floor_s if moved else 0.0
    if built.get("source"):
        source = f"{source}; build {build or 'current'}: {built['source']}"
    measured = (
        "fitted" in params and family != "cross_entropy" and op not in UNMEASURED_OPS and op not in NOT_FITTED
    )
    if not measured:
        why = NOT_FITTED.get(op, "no measurement of it on any GPU")
        source = f"UNCALIBRATED for {op} ({why}): {source}"
    elif op == "attention_kvcache_fwd" and normalize_dtype(problem.get("kv_dtype") or "fp16") == "fp8":
        measured = False  # the fitted decode parameters are a 16-bit cache's (issue 35: no fp8 figure yet)
        source = f"UNCALIBRATED for {op} over an fp8 cache (no measurement of it on any GPU): {source}"
    return Prediction(
        op=op,
        gpu=spec.id,
        implementation=impl,
        seconds=seconds,
        bound=bound,
        breakdown=_breakdown(terms, flops, moved, host_s, exposed),
        floor_s=floor,
        context=context,
        calibrated=calibrated and consts.calibrated and measured,
        source=source,
        problem=recorded,
    )


def predict_call(
    ops: Sequence[str],
    gpu: str | GPUSpec,
    *,
    implementation: str = "llm-speed",
    context: str = "bench",
    build: str | None = None,
    calibration: Any = None,
    **problem: Any,
) -> Prediction:
    """Several ops run back to back under one timer on the same ``problem`` (a forward and its backward, as
    ``llm-speed bench attention --mode fwd+bwd`` times them): their device times add, and so do their host
    paths, which overlap the device as one call's would (``context``: one L2 flush before the whole call in
    "bench"). One op: :func:`predict` itself."""
    if len(ops) == 1:
        return predict(ops[0], gpu, implementation=implementation, context=context, build=build,
                       calibration=calibration, **problem)  # fmt: skip
    context = _check_context(context)
    parts = [
        predict(op, gpu, implementation=implementation, context="graph", build=build, calibration=calibration,
                **problem)
        for op in ops
    ]  # fmt: skip
    spec = get_gpu(gpu)
    consts = gpu_constants(spec, calibration)
    device = sum(p.seconds for p in parts)
    host = sum(p.breakdown.host_s for p in parts)
    flush_s = consts.l2_flush_bytes / consts.copy_bytes_per_s if consts.copy_bytes_per_s else 0.0
    exposed = _host_exposed(host, device, context, flush_s)
    seconds = device + exposed if context == "isolated" else max(device, exposed)
    longest = max(parts, key=lambda p: p.seconds)
    b = [p.breakdown for p in parts]
    breakdown = replace(
        longest.breakdown,
        flops=sum(x.flops for x in b),
        bytes_moved=sum(x.bytes_moved for x in b),
        dram_bytes=sum(x.dram_bytes for x in b),
        compute_s=sum(x.compute_s for x in b),
        memory_s=sum(x.memory_s for x in b),
        latency_s=sum(x.latency_s for x in b),
        host_s=host,
        host_exposed_s=exposed,
        exp_s=sum(x.exp_s for x in b),
        kernels=sum(x.kernels for x in b),
        notes=tuple(note for x in b for note in x.notes),
    )
    return replace(
        longest,
        op="+".join(ops),
        seconds=seconds,
        bound="latency" if exposed >= device else longest.bound,
        breakdown=breakdown,
        floor_s=sum(p.floor_s for p in parts),
        context=context,
        calibrated=all(p.calibrated for p in parts),
        source="; ".join(dict.fromkeys(p.source for p in parts)),
    )


def _breakdown(terms: _Terms, flops: float, moved: float, host_s: float, exposed: float) -> Breakdown:
    return Breakdown(
        flops=flops,
        bytes_moved=moved,
        dram_bytes=terms.dram_bytes,
        compute_s=terms.compute_s,
        memory_s=terms.memory_s,
        latency_s=terms.latency_s,
        host_s=host_s,
        host_exposed_s=exposed,
        achievable_flops_per_s=flops / terms.compute_s if terms.compute_s else 0.0,
        tensor_core_efficiency=terms.eta,
        achievable_bandwidth=terms.bandwidth,
        l2_bytes=terms.l2_bytes,
        exp_s=terms.exp_s,
        dequant_s=terms.dequant_s,
        tile=terms.tile,
        split_k=terms.split_k,
        programs=terms.programs,
        waves=terms.waves,
        wave_efficiency=terms.wave_efficiency,
        kernels=terms.kernels,
        notes=terms.notes,
    )


def predict_work(
    gpu: str | GPUSpec,
    *,
    flops: float,
    bytes_moved: float,
    dtype: str = "bf16",
    family: str = "elementwise",
    implementation: str = "llm-speed",
    context: str = "bench",
    kernels: int = 1,
    calibration: Any = None,
) -> Prediction:
    """A kernel known only by its FLOPs and bytes (an op the model has no row for: an embedding gather, a
    residual add, MoE dispatch, MLA attention): the compute at the family's large-tile tensor-core efficiency
    (``family`` "gemm" or "attention"; "elementwise": no tensor cores, the CUDA cores' fp32 rate), the bytes
    at the achievable bandwidth, ``kernels`` launches, and the host path of the implementation's default."""
    context = _check_context(context)
    spec = get_gpu(gpu)
    consts = gpu_constants(spec, calibration)
    vendor = {"gemm": "cublas", "attention": VENDOR["attention"], "elementwise": "pytorch"}[family]
    impl = vendor if implementation == "vendor" else implementation
    params, calibrated, source = parameters(spec, impl, family, calibration)
    dtype = normalize_dtype(dtype)
    if family == "elementwise":
        rate = consts.alu_per_s or spec.peak_flops("fp32")
    else:
        width = 128.0
        rate = (
            spec.peak_flops("tf32" if dtype == "fp32" else dtype)
            * float(params["eta"])
            * width
            / (width + float(params.get("n_half", 0.0)))
        )
        if family == "gemm":
            intensity = 128 * 256 / (128 + 256)
            rate *= intensity / (intensity + float(params.get("tile_half", 0.0)))
    compute = flops / rate if flops else 0.0
    memory, bandwidth = _memory_time(params, consts, bytes_moved, 0.0, spec.sm_count)
    terms = _Terms(
        compute_s=compute,
        memory_s=memory,
        latency_s=kernels * float(params.get("latency_s", 0.0)),
        dram_bytes=bytes_moved,
        l2_bytes=0.0,
        bandwidth=bandwidth,
        eta=rate
        / spec.peak_flops("fp32" if family == "elementwise" else ("tf32" if dtype == "fp32" else dtype)),
        kernels=kernels,
    )
    host = (
        _host_s(host_table(spec, impl, calibration), "default")
        if impl != "llm-speed"
        else _host_s(build_entry(impl, None, calibration).get("host_s", {}), "default")
    )
    flush_s = consts.l2_flush_bytes / consts.copy_bytes_per_s if consts.copy_bytes_per_s else 0.0
    device = terms.device
    exposed = _host_exposed(host * kernels, device, context, flush_s)
    seconds = device + exposed if context == "isolated" else max(device, exposed)
    if exposed >= device or terms.latency_s >= max(compute, memory):
        bound = "latency"
    else:
        bound = "compute" if compute >= memory else "memory"
    floor_dtype = "fp32" if family == "elementwise" else dtype
    floor = roofline(flops, bytes_moved, floor_dtype, spec).time_floor_s if bytes_moved else 0.0
    return Prediction(
        op="work",
        gpu=spec.id,
        implementation=impl,
        seconds=seconds,
        bound=bound,
        breakdown=_breakdown(terms, flops, bytes_moved, host * kernels, exposed),
        floor_s=floor,
        context=context,
        calibrated=calibrated and consts.calibrated,
        source=source,
        problem={"flops": flops, "bytes_moved": bytes_moved, "dtype": dtype, "family": family},
    )
