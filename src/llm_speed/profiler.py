"""Kernel profiler with the API of ``cuda_llm_ops.profiler`` (the CUDA project LLM-Speed), explained by the
roofline model.

``CUDAProfiler`` times a function (``measure_time``), a whole block (``with profiler.profile(name):``), a
freshly made attention or GEMM problem (``profile_attention`` / ``profile_gemm``) or a kernel against a
reference (``compare_with_reference``), and turns each time into :class:`KernelMetrics`: TFLOP/s and GB/s
from the analytic cost model (:mod:`llm_speed.perf.kernel_costs`), utilisation against the detected GPU's
peaks (:mod:`llm_speed.core.gpus`) and the bottleneck from the roofline (:mod:`llm_speed.perf.roofline`).

Every timing goes through :func:`llm_speed.bench.timing.measure` (CUDA events on a GPU, the host clock on
the CPU). A figure that cannot be known is None, and ``KernelMetrics.unavailable`` says why; nothing is
reported as 0 because it was not measured.

A ``profile`` block does not see inside arbitrary code: its FLOPs and bytes come from ``flops=`` /
``bytes_moved=`` when given, else from the llm-speed ops run inside the block. Every path that computes an
op of the op table (:mod:`llm_speed.ops`), the Triton launchers and the plain-PyTorch paths alike (naive
attention, the SDPA fallback of ``safe_flash_attention``, the fallbacks on a CPU without the interpreter),
reports its problem once per call through :func:`llm_speed.core.runtime.report_work`, however it was called
(``llm_speed.flash_attention``, ``cuda_llm_ops``, autograd); the profiler costs it with the row's cost
function. Nothing touches the GPU at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from llm_speed import ops
from llm_speed.bench.timing import CUDA_TIMER, HOST_TIMER, Timing, measure
from llm_speed.core import runtime
from llm_speed.core.args import check_real, positive_int, type_name
from llm_speed.core.gpus import GPUSpec, get_gpu, normalize_dtype
from llm_speed.core.runtime import resolve_device
from llm_speed.core.tensors import FLOAT_DTYPES, dtype_names
from llm_speed.perf.kernel_costs import attention_cost
from llm_speed.perf.roofline import roofline

# A kernel reaching less than this fraction of the speed its roofline allows keeps neither the arithmetic
# units nor DRAM busy: launch latency, synchronisation or too little parallel work set its time.
LATENCY_BOUND_FRACTION = 0.1

HARDWARE_COUNTER_REASON = (
    "a hardware counter: read it with Nsight Compute (ncu); this profiler times kernels and reads no counters"
)
NO_COST_REASON = (
    "no FLOP/byte count for this block: no llm-speed kernel ran in it (other code is not seen); pass flops= "
    "and bytes_moved= to profile()"
)


class Bottleneck(enum.Enum):
    """What limits a kernel (the names and values of ``cuda_llm_ops.profiler``)."""

    COMPUTE_BOUND = "compute_bound"
    MEMORY_BOUND = "memory_bound"
    LATENCY_BOUND = "latency_bound"


@dataclasses.dataclass
class KernelMetrics:
    """Measured figures of one kernel or block. None means "not measurable here"; ``unavailable`` says why.

    The first six fields keep ``cuda_llm_ops.profiler``'s order. Rates use the analytic FLOPs and bytes of
    the operation (:mod:`llm_speed.perf.kernel_costs`; causal attention counts only the visible half), not
    counters.
    """

    elapsed_ms: float  # median of the timed runs (one run for a ``profile`` block)
    tflops: float | None = None  # achieved TFLOP/s (TOP/s for int8)
    memory_bandwidth_gb: float | None = None  # achieved GB/s (1e9 bytes/s) of the minimum DRAM traffic
    sm_occupancy: float | None = None  # always None here: a hardware counter (see ``unavailable``)
    l2_hit_rate: float | None = None  # always None here: a hardware counter (see ``unavailable``)
    bottleneck: Bottleneck | None = None  # from the roofline of the detected GPU
    compute_utilization: float | None = None  # achieved FLOP/s / the GPU's dense peak for the dtype
    bandwidth_utilization: float | None = None  # achieved bytes/s / the GPU's DRAM bandwidth
    roofline_fraction: float | None = None  # roofline time floor / measured time (1.0 = at the roof)
    arithmetic_intensity: float | None = None  # FLOP per byte of the analytic cost
    flops: float | None = None
    bytes_moved: float | None = None
    dtype: str | None = None  # canonical name ("fp16", "bf16", "fp32", "int8")
    name: str | None = None
    device: str | None = None
    gpu: str | None = None  # id of the spec-table entry the peaks came from
    timer: str | None = None  # "cuda-events" or "host (CPU timer)"
    iterations: int | None = None
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)  # field -> why it is None
    notes: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        for field in ("sm_occupancy", "l2_hit_rate"):
            if getattr(self, field) is None:
                self.unavailable.setdefault(field, HARDWARE_COUNTER_REASON)
        for field in _MEASURED_FIELDS:
            if getattr(self, field) is None:
                self.unavailable.setdefault(field, "not provided")


# The figures a None must be explained for (the others are labels).
_MEASURED_FIELDS = (
    "tflops", "memory_bandwidth_gb", "bottleneck", "compute_utilization", "bandwidth_utilization",
    "roofline_fraction", "arithmetic_intensity", "flops", "bytes_moved",
)


# --- cost reports from the entry points that know their shapes ----------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecordedCall:
    """One kernel call reported to the ``profile`` blocks that are open while it runs."""

    name: str
    flops: float
    bytes_moved: float
    dtype: str
    device: torch.device


# The open ``profile`` blocks of this thread / task, innermost last; each collects the calls made inside it.
_open_blocks: contextvars.ContextVar[tuple[list[RecordedCall], ...]] = contextvars.ContextVar(
    "llm_speed_profile_blocks", default=()
)


def is_recording() -> bool:
    """True inside a ``CUDAProfiler.profile`` block (callers skip the cost arithmetic otherwise)."""
    return bool(_open_blocks.get())


def record_call(name: str, flops: float, bytes_moved: float, dtype: Any, device: torch.device) -> None:
    """Report one kernel call's analytic cost to every open ``profile`` block."""
    blocks = _open_blocks.get()
    if not blocks:
        return
    call = RecordedCall(name, float(flops), float(bytes_moved), normalize_dtype(dtype), torch.device(device))
    for calls in blocks:
        calls.append(call)


def _observe_work(op: str, problem: dict[str, Any]) -> None:
    """The :func:`llm_speed.core.runtime.report_work` observer: the op table's cost of each call made while a
    ``profile`` block is open (no work at all otherwise)."""
    if not is_recording():
        return
    row = ops.get(op)
    work = row.work(**problem)
    if work is not None:
        record_call(row.title, work.flops, work.bytes_moved, work.dtype, work.device)


runtime.add_work_observer(_observe_work)


# --- turning a time into metrics ----------------------------------------------------------------------------


def _gpu_spec(device: torch.device) -> tuple[GPUSpec | None, str | None]:
    """The spec-table entry for ``device``, or None and the reason there is none."""
    if device.type != "cuda":
        return None, (
            f"ran on {device.type}: utilisation and bottleneck need a GPU's peak figures, and the spec table "
            "(llm_speed/core/gpus.py) has GPUs only"
        )
    device_name = torch.cuda.get_device_name(device)
    try:
        return get_gpu(device_name), None
    except ValueError:
        return None, f"GPU {device_name!r} is not in llm_speed/core/gpus.py, so its peaks are unknown"


def kernel_metrics(
    elapsed_ms: float,
    *,
    flops: float | None,
    bytes_moved: float | None,
    dtype: Any,
    device: torch.device,
    timer: str,
    iterations: int,
    name: str | None = None,
    cost_reason: str = NO_COST_REASON,
) -> KernelMetrics:
    """Build :class:`KernelMetrics` from a measured time and the analytic cost (None where unknown)."""
    unavailable: dict[str, str] = {}
    notes: list[str] = []
    dtype_name = normalize_dtype(dtype) if dtype is not None else None
    if timer == HOST_TIMER:
        notes.append("CPU timings from the host clock (time.perf_counter), not GPU events")
    elapsed_s = elapsed_ms * 1e-3
    tflops = bandwidth_gb = achieved_flops = achieved_bytes = None
    if elapsed_s <= 0:
        rate_reason = f"measured time is {elapsed_ms} ms: no rate can be derived from it"
    else:
        rate_reason = cost_reason
    if flops is not None and elapsed_s > 0:
        achieved_flops = flops / elapsed_s
        tflops = achieved_flops / 1e12
    else:
        unavailable["tflops"] = rate_reason
    if bytes_moved is not None and elapsed_s > 0:
        achieved_bytes = bytes_moved / elapsed_s
        bandwidth_gb = achieved_bytes / 1e9
    else:
        unavailable["memory_bandwidth_gb"] = rate_reason
    intensity = flops / bytes_moved if flops is not None and bytes_moved else None
    if intensity is None:
        unavailable["arithmetic_intensity"] = cost_reason

    compute_util = bandwidth_util = fraction = bottleneck = None
    spec, gpu_reason = _gpu_spec(device)
    if spec is None:
        for field in (
            "compute_utilization", "bandwidth_utilization", "roofline_fraction", "bottleneck", "gpu"
        ):
            unavailable[field] = gpu_reason
    else:
        if achieved_bytes is not None:
            bandwidth_util = achieved_bytes / spec.memory_bandwidth
        else:
            unavailable["bandwidth_utilization"] = rate_reason
        peak_reason = None
        if dtype_name is None:
            peak_reason = "the block's calls used several dtypes (or none): no single peak applies"
        elif dtype_name not in spec.peak_tflops:
            peak_reason = f"{spec.id} has no peak for {dtype_name} in llm_speed/core/gpus.py"
        if achieved_flops is not None and peak_reason is None:
            compute_util = achieved_flops / spec.peak_flops(dtype_name)
        else:
            unavailable["compute_utilization"] = peak_reason or rate_reason
        if peak_reason is None and achieved_flops is not None and bytes_moved is not None:
            point = roofline(flops, bytes_moved, dtype_name, spec)
            fraction = point.time_floor_s / elapsed_s
            if fraction < LATENCY_BOUND_FRACTION:
                bottleneck = Bottleneck.LATENCY_BOUND
            elif point.bound == "memory":
                bottleneck = Bottleneck.MEMORY_BOUND
            else:
                bottleneck = Bottleneck.COMPUTE_BOUND
        else:
            reason = peak_reason or rate_reason
            unavailable["roofline_fraction"] = reason
            unavailable["bottleneck"] = reason
        if dtype_name == "fp32":
            notes.append("fp32 is compared with the CUDA-core FP32 peak (kernels using TF32 can exceed 100%)")
    if flops is None:
        unavailable["flops"] = cost_reason
    if bytes_moved is None:
        unavailable["bytes_moved"] = cost_reason
    return KernelMetrics(
        elapsed_ms=elapsed_ms,
        tflops=tflops,
        memory_bandwidth_gb=bandwidth_gb,
        bottleneck=bottleneck,
        compute_utilization=compute_util,
        bandwidth_utilization=bandwidth_util,
        roofline_fraction=fraction,
        arithmetic_intensity=intensity,
        flops=flops,
        bytes_moved=bytes_moved,
        dtype=dtype_name,
        name=name,
        device=str(device),
        gpu=spec.id if spec is not None else None,
        timer=timer,
        iterations=iterations,
        unavailable=unavailable,
        notes=notes,
    )


# --- the profiler -------------------------------------------------------------------------------------------


# The devices a profiler times on (what llm_speed.bench.timing.measure can time).
DEVICE_TYPES = ("cpu", "cuda")
ACCEPTED_DEVICES = "None, 'cpu', 'cuda' or 'cuda:N' (a str or a torch.device)"

# The inputs profile_attention and profile_gemm make: a torch.dtype, or the name the rest of the profiler uses
# ("fp16", "bf16", "fp32", "int8", or any spelling normalize_dtype reads, e.g. "float16").
ATTENTION_INPUT_DTYPES = FLOAT_DTYPES
GEMM_INPUT_DTYPES = (*FLOAT_DTYPES, torch.int8)


def _check_device(device: Any) -> torch.device | None:
    """``device`` as a torch.device (None kept: resolved when first needed), or an error naming ``device``.

    Only the type is checked here: whether a CUDA device is visible is asked on first use, so creating a
    profiler touches no GPU.
    """
    if device is None:
        return None
    if not isinstance(device, (str, torch.device)):
        index = type(device) is int and device >= 0
        hint = f" (for CUDA device {device} pass 'cuda:{device}')" if index else ""
        raise TypeError(f"device: expected {ACCEPTED_DEVICES}, got {type_name(device)} {device!r}{hint}")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in DEVICE_TYPES:
        raise ValueError(f"device: expected {ACCEPTED_DEVICES}, got {device!r}")
    return parsed


def _check_func(func: Any) -> None:
    if not callable(func):
        raise TypeError(f"func: expected a callable, got {type(func).__name__}")


def _check_cost(name: str, value: Any) -> float | None:
    """``flops`` / ``bytes_moved`` of a ``profile`` block: None (counted from the block's calls) or a finite
    real number >= 0, as a float."""
    if value is None:
        return None
    try:
        return check_real(name, value, minimum=0.0)
    except TypeError as error:
        raise TypeError(f"{error} (or None: counted from the llm-speed calls made in the block)") from None


def _input_dtype(dtype: Any, accepted: tuple[torch.dtype, ...]) -> torch.dtype:
    """The torch.dtype of a ``profile_*`` method's random inputs (``dtype`` a torch.dtype or its name, e.g.
    ``'fp16'``); TypeError naming ``dtype`` and what is accepted."""
    if isinstance(dtype, torch.dtype) and dtype in accepted:
        return dtype
    names = {normalize_dtype(d): d for d in accepted}
    if isinstance(dtype, str):
        try:
            name = normalize_dtype(dtype)
        except ValueError:
            name = None
        if name in names:
            return names[name]
    listed = f"{dtype_names(accepted)} (a torch.dtype, or its name: {', '.join(map(repr, names))})"
    raise TypeError(f"dtype: expected one of {listed}, got {dtype!r}")


def _first_tensor_device(args: tuple, kwargs: dict) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


class CUDAProfiler:
    """The profiler of ``cuda_llm_ops``: time kernels, explain the time with the detected GPU's roofline.

    ``device`` (default: the current CUDA device when there is one, else the CPU) is where ``profile_*``
    create their inputs and which clock ``profile`` blocks use; ``measure_time`` and
    ``compare_with_reference`` time on the device of their first tensor argument. On the CPU times come
    from the host clock and every metric says so. Creating a profiler touches no GPU.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._device = _check_device(device)
        self.history: list[KernelMetrics] = []  # every metric this profiler produced, oldest first
        self.last_timing: Timing | None = None  # the full statistics behind the last timed call

    @property
    def device(self) -> torch.device:
        """The device inputs are created on and blocks are timed on (resolved when first needed)."""
        return resolve_device(self._device)

    def _remember(self, metrics: KernelMetrics) -> KernelMetrics:
        self.history.append(metrics)
        return metrics

    def get_metrics(self, name: str | None = None) -> KernelMetrics:
        """The latest metrics (of the block or call called ``name`` when given)."""
        for metrics in reversed(self.history):
            if name is None or metrics.name == name:
                return metrics
        known = sorted({m.name for m in self.history if m.name is not None})
        if name is None:
            raise ValueError("get_metrics: nothing profiled yet; use profile(name) or profile_* first")
        raise ValueError(f"name: no metrics called {name!r}; profiled so far: {known}")

    @contextlib.contextmanager
    def profile(
        self,
        name: str,
        *,
        flops: float | None = None,
        bytes_moved: float | None = None,
        dtype: Any = None,
    ) -> Iterator[None]:
        """Time the ``with`` block once and store its :class:`KernelMetrics` (read them with ``get_metrics``).

        One un-warmed run: a first call may include Triton compilation, so warm up before the block or use
        ``profile_attention`` / ``profile_gemm`` / ``measure_time`` for steady-state figures. FLOPs and bytes
        come from ``flops`` / ``bytes_moved`` (and ``dtype`` for the peak) when given, else from the calls
        made in the block (llm-speed's kernels report their cost, see the module docstring). On a GPU the
        block is bounded by CUDA events (work queued before it is finished first); when every reported call
        ran on the CPU, or there is no GPU, the host clock is used.
        """
        if not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        flops = _check_cost("flops", flops)
        bytes_moved = _check_cost("bytes_moved", bytes_moved)
        if dtype is not None:
            normalize_dtype(dtype)  # ValueError naming dtype and the accepted names, before the block runs
        device = self.device
        calls: list[RecordedCall] = []
        token = _open_blocks.set((*_open_blocks.get(), calls))
        try:
            start_event = end_event = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                start_event = torch.cuda.Event(enable_timing=True)
                end_event = torch.cuda.Event(enable_timing=True)
                start_event.record(torch.cuda.current_stream(device))
            host_start = time.perf_counter()
            yield
            if end_event is not None:
                end_event.record(torch.cuda.current_stream(device))
                end_event.synchronize()
            host_ms = (time.perf_counter() - host_start) * 1e3
        finally:
            _open_blocks.reset(token)

        if calls and all(call.device.type == "cpu" for call in calls):
            device = torch.device("cpu")
        if device.type == "cuda":
            elapsed_ms, timer = start_event.elapsed_time(end_event), CUDA_TIMER
        else:
            elapsed_ms, timer = host_ms, HOST_TIMER

        if flops is None and calls:
            flops = sum(call.flops for call in calls)
        if bytes_moved is None and calls:
            bytes_moved = sum(call.bytes_moved for call in calls)
        if dtype is None and calls:
            dtypes = {call.dtype for call in calls}
            dtype = dtypes.pop() if len(dtypes) == 1 else None
        metrics = kernel_metrics(
            elapsed_ms, flops=flops, bytes_moved=bytes_moved, dtype=dtype, device=device, timer=timer,
            iterations=1, name=name,
        )
        metrics.notes.append(
            "one un-warmed run of the block"
            + (f"; cost from {len(calls)} reported call(s)" if calls else "")
        )
        self._remember(metrics)

    def measure_time(
        self, func: Callable, *args: Any, warmup: int = 10, iterations: int = 100, **kwargs: Any
    ) -> float:
        """Median time of ``func(*args, **kwargs)`` in milliseconds, after ``warmup`` untimed calls.

        Timed on the device of the first tensor argument (else the profiler's device) with
        :func:`llm_speed.bench.timing.measure`; the full statistics are kept in ``last_timing``.
        """
        _check_func(func)
        positive_int("warmup", warmup, allow_zero=True)
        positive_int("iterations", iterations)
        device = _first_tensor_device(args, kwargs) or self.device
        self.last_timing = measure(
            lambda: func(*args, **kwargs), warmup=warmup, iterations=iterations, device=device
        )
        return self.last_timing.median_ms

    def _timed_metrics(self, func: Callable, args: tuple, kwargs: dict, *, warmup: int, iterations: int,
                       flops: float, bytes_moved: float, dtype: Any, name: str) -> KernelMetrics:
        elapsed_ms = self.measure_time(func, *args, warmup=warmup, iterations=iterations, **kwargs)
        timing = self.last_timing
        device = args[0].device
        metrics = kernel_metrics(
            elapsed_ms, flops=flops, bytes_moved=bytes_moved, dtype=dtype, device=device,
            timer=timing.timer, iterations=timing.iterations, name=name,
        )
        return self._remember(metrics)

    def profile_attention(
        self,
        func: Callable,
        batch_size: int,
        num_heads: int,
        seq_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        warmup: int = 10,
        iterations: int = 100,
        *,
        is_causal: bool = False,
        num_kv_heads: int | None = None,
        impl: str = "flash",
        name: str | None = None,
    ) -> KernelMetrics:
        """Time ``func(q, k, v)`` on random ``[batch_size, num_heads, seq_len, head_dim]`` inputs.

        With ``is_causal`` the call is ``func(q, k, v, is_causal=True)`` and only visible pairs count as
        FLOPs. ``num_kv_heads`` gives k and v fewer heads (GQA). ``impl`` ("flash", "tiled" or "naive") picks
        the DRAM-traffic model of :func:`llm_speed.perf.kernel_costs.attention_cost` ("naive" is
        ``llm_speed.naive_attention``, whose score matrices are fp32). ``dtype`` is torch.float16,
        torch.bfloat16 or torch.float32, or the name the profiler reports it by ("fp16", "bf16", "fp32").
        """
        _check_func(func)
        positive_int("warmup", warmup, allow_zero=True)
        positive_int("iterations", iterations)
        for arg, value in (("batch_size", batch_size), ("num_heads", num_heads), ("seq_len", seq_len),
                           ("head_dim", head_dim)):
            positive_int(arg, value)
        num_kv_heads = num_heads if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        dtype = _input_dtype(dtype, ATTENTION_INPUT_DTYPES)
        cost = attention_cost(
            batch_size, num_heads, seq_len, seq_len, head_dim,
            heads_kv=num_kv_heads, dtype=dtype, causal=bool(is_causal), mode="fwd", impl=impl,
            score_dtype=ops.ATTENTION_SCORE_DTYPES.get(impl),
        )
        device = self.device
        q = torch.randn(batch_size, num_heads, seq_len, head_dim, device=device, dtype=dtype)
        k = torch.randn(batch_size, num_kv_heads, seq_len, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        kwargs = {"is_causal": True} if is_causal else {}
        return self._timed_metrics(
            func, (q, k, v), kwargs, warmup=warmup, iterations=iterations, flops=cost.flops,
            bytes_moved=cost.bytes_moved, dtype=dtype, name=name or getattr(func, "__name__", "attention"),
        )

    def profile_gemm(
        self,
        func: Callable,
        M: int,
        N: int,
        K: int,
        dtype: torch.dtype = torch.float16,
        warmup: int = 10,
        iterations: int = 100,
        *,
        out_dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> KernelMetrics:
        """Time ``func(a, b)`` on random ``a [M, K]``, ``b [K, N]`` of ``dtype`` (int8: random integers).

        ``out_dtype`` (default: what the first call returns) sets the bytes written in the cost model.
        """
        _check_func(func)
        positive_int("warmup", warmup, allow_zero=True)
        positive_int("iterations", iterations)
        for arg, value in (("M", M), ("N", N), ("K", K)):
            positive_int(arg, value)
        dtype = _input_dtype(dtype, GEMM_INPUT_DTYPES)
        if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
            raise TypeError(f"out_dtype: expected None or a torch.dtype, got {out_dtype!r}")
        device = self.device
        if dtype == torch.int8:
            a = torch.randint(-128, 128, (M, K), device=device, dtype=dtype)
            b = torch.randint(-128, 128, (K, N), device=device, dtype=dtype)
        else:
            a = torch.randn(M, K, device=device, dtype=dtype)
            b = torch.randn(K, N, device=device, dtype=dtype)
        if out_dtype is None:
            out_dtype = func(a, b).dtype
        cost = ops.gemm_work(op_a=a, op_b=b, out=torch.empty((M, N), dtype=out_dtype, device="meta"))
        return self._timed_metrics(
            func, (a, b), {}, warmup=warmup, iterations=iterations, flops=cost.flops,
            bytes_moved=cost.bytes_moved, dtype=dtype, name=name or getattr(func, "__name__", "gemm"),
        )

    def compare_with_reference(
        self,
        custom_func: Callable,
        reference_func: Callable,
        *args: Any,
        warmup: int = 10,
        iterations: int = 100,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """Time both functions on the same arguments; ``speedup`` = reference time / custom time.

        Returns ``custom_ms``, ``reference_ms`` (medians), ``speedup``, ``relative_perf`` (custom / reference
        time, ``cuda_llm_ops.profiler``'s key) and ``timer``.
        """
        custom_ms = self.measure_time(custom_func, *args, warmup=warmup, iterations=iterations, **kwargs)
        reference_ms = self.measure_time(
            reference_func, *args, warmup=warmup, iterations=iterations, **kwargs
        )
        if custom_ms <= 0 or reference_ms <= 0:
            raise ValueError(
                f"custom_func/reference_func: a measured time is not positive (custom {custom_ms} ms, "
                f"reference {reference_ms} ms); give them more work"
            )
        return {
            "custom_ms": custom_ms,
            "reference_ms": reference_ms,
            "speedup": reference_ms / custom_ms,
            "relative_perf": custom_ms / reference_ms,
            "timer": self.last_timing.timer,
        }
