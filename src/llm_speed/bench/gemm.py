"""The GEMM benchmark: ``llm_speed.gemm`` (fused epilogue) against ``torch.matmul`` (cuBLAS on a GPU)
followed by separate bias and activation ops, ``tensor_core_gemm_int8`` against ``torch._int_mm`` for
int8, and ``gemm_fp8`` for fp8 (``--dtype fp8``): each shape at each scaling granularity (tensor, row, 1x128
x 128x128 blocks) against ``torch._scaled_mm`` / ``F.scaled_mm`` with the same scaling (the baseline of the
percentages; tensor and row: ``use_fast_accum``, the kernel's accumulation) and against bf16 ``torch.matmul``
of the same values. The fp8 operands are quantized once, before timing (``quantize_fp8``'s own cost is not in
these rows).

Each row's FLOPs and bytes are its own implementation's, in the dtype it computes in (:func:`row_cost`): an
fp8 run's bf16 ``torch.matmul`` moves bf16 operands, and ``torch.matmul``'s bias and activation, separate
passes over the output, add their bytes where ``llm_speed.gemm`` fuses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from rich.console import Console

from llm_speed._cli import parse_gemm_size
from llm_speed._output import print_table
from llm_speed.bench import report
from llm_speed.bench.options import GEMM_DTYPES as DTYPES
from llm_speed.bench.options import GEMM_EPILOGUES as EPILOGUES
from llm_speed.bench.options import GEMM_FLOAT_IMPLS as FLOAT_IMPLS
from llm_speed.bench.options import GEMM_FP8_GRANULARITIES as FP8_GRANULARITIES
from llm_speed.bench.options import GEMM_FP8_IMPLS as FP8_IMPLS
from llm_speed.bench.options import GEMM_IMPLS as IMPLS  # noqa: F401  (part of this module's API)
from llm_speed.bench.options import GEMM_INT8_IMPLS as INT8_IMPLS
from llm_speed.bench.options import GEMM_LAYOUTS as LAYOUTS
from llm_speed.bench.options import GEMM_TRITON_IMPLS as TRITON_IMPLS
from llm_speed.bench.report import Measurement

GPU_DEFAULTS = {
    "sizes": ((512, 512, 512), (1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096)),
    "dtype": "fp16",
    "warmup": 10,
    "iterations": 50,
    "min_time": 0.2,
    "tokens": 4096,
}
CPU_DEFAULTS = {
    "sizes": ((64, 64, 64), (128, 128, 128)),
    "dtype": "fp32",
    "warmup": 1,
    "iterations": 5,
    "min_time": 1.0,
    "tokens": 16,
}


@dataclasses.dataclass(frozen=True)
class GemmCase:
    """One GEMM shape: out[m, n] = A[m, k] @ B[k, n], ``count`` times per forward pass (model shapes)."""

    name: str
    m: int
    n: int
    k: int
    count: int = 1
    granularity: str | None = None  # fp8 only: "tensor", "row" or "block"


@dataclasses.dataclass(frozen=True)
class GemmSettings:
    """One GEMM benchmark run."""

    cases: tuple[GemmCase, ...]
    dtype: str
    layout: str
    epilogue: str
    impls: tuple[str, ...]
    warmup: int
    iterations: int
    device: str
    model: str | None = None
    tokens: int | None = None
    min_time_s: float = 0.0  # keep timing each row until its runs add up to this (see bench.timing)


@dataclasses.dataclass(kw_only=True)
class GemmMeasurement(Measurement):
    """A :class:`Measurement` of one GEMM implementation on one shape."""

    name: str
    m: int
    n: int
    k: int
    count: int
    percent_of_baseline: float | None = None  # baseline median / this median * 100 (torch.matmul or _int_mm)
    # Its range over the two p20–p80 intervals, and whether that range contains 100% (no real difference).
    percent_of_baseline_range: tuple[float, float] | None = None
    percent_within_noise: bool | None = None
    RATIO_FIELDS: ClassVar[tuple[str, ...]] = (
        *report.Measurement.RATIO_FIELDS,
        "percent_of_baseline", "percent_of_baseline_range", "percent_within_noise",
    )  # fmt: skip


def parse_size(text: str) -> tuple[int, int, int]:
    """'MxNxK' -> (M, N, K); ValueError naming --sizes and the accepted form otherwise."""
    return parse_gemm_size(text, argument="--sizes")


def model_cases(model: str, tokens: int) -> tuple[GemmCase, ...]:
    """The weight GEMMs of one forward pass of a model (a zoo id or a config.json path, as every --model
    takes) over ``tokens`` tokens."""
    from llm_speed.perf.models import gemm_shapes, resolve_model

    return tuple(GemmCase(s.name, s.m, s.n, s.k, s.count) for s in gemm_shapes(resolve_model(model), tokens))


def baseline_impl(dtype: str) -> str:
    """The implementation the others are compared with: torch._int_mm for int8, torch._scaled_mm (same
    scaling) for fp8, torch.matmul otherwise."""
    return {"int8": "torch-int-mm", "fp8": "torch-scaled-mm"}.get(dtype, "torch")


def accepted_impls(dtype: str) -> tuple[str, ...]:
    """The ``--impl`` values ``dtype`` takes, all the default (fp8: ours, ``torch._scaled_mm``, bf16)."""
    return {"int8": INT8_IMPLS, "fp8": FP8_IMPLS}.get(dtype, FLOAT_IMPLS)


def row_dtype(impl: str, dtype: str) -> str:
    """The dtype ``impl`` computes in in a run of ``dtype``: the run's, but bf16 for an fp8 run's
    ``torch.matmul`` (of the same values, in bf16)."""
    return "bf16" if dtype == "fp8" and impl == "torch" else dtype


def unfused_epilogue_bytes(m: int, n: int, epilogue: str, element: int) -> float:
    """DRAM bytes of ``torch.matmul``'s epilogue done as separate ops after it: ``+ bias`` reads the [m, n]
    product and the bias and writes the sum; an activation reads that and writes its result."""
    if epilogue == "none":
        return 0.0
    passes = 1 + ("+" in epilogue)
    return float(passes * 2 * m * n * element + n * element)


def row_cost(impl: str, case: GemmCase, settings: GemmSettings):
    """FLOPs and minimum bytes (``KernelCost``) of ``impl`` on ``case``: ``gemm_cost`` in the row's dtype
    (:func:`row_dtype`; int8 returns int32, 4 bytes like fp32; fp8 GEMMs return bf16), the bias read by a
    fused epilogue, or ``torch.matmul``'s separate epilogue passes (:func:`unfused_epilogue_bytes`). FLOPs
    are the GEMM's ``2 m n k`` for every row (the epilogue's O(m n) are not counted)."""
    from llm_speed.core.gpus import dtype_bytes
    from llm_speed.perf.kernel_costs import KernelCost, gemm_cost

    dtype = row_dtype(impl, settings.dtype)
    out_dtype = {"int8": "fp32", "fp8": "bf16"}.get(dtype)
    fused = impl != "torch"  # llm_speed.gemm, gemm_fp8 and torch._scaled_mm take the bias in their epilogue
    epilogue = settings.epilogue != "none"
    cost = gemm_cost(case.m, case.n, case.k, dtype=dtype, out_dtype=out_dtype, with_bias=epilogue and fused)
    if fused:
        return cost
    element = dtype_bytes(out_dtype or dtype)
    extra = unfused_epilogue_bytes(case.m, case.n, settings.epilogue, element)
    return KernelCost(cost.flops, cost.bytes_moved + extra)


def check_settings(settings: GemmSettings) -> None:
    """ValueError naming the setting when a value is out of range or a combination is not supported."""
    report.check_choice("dtype", settings.dtype, DTYPES)
    report.check_choice("layout", settings.layout, LAYOUTS)
    report.check_choice("epilogue", settings.epilogue, EPILOGUES)
    if settings.dtype == "int8" and settings.epilogue != "none":
        raise ValueError("epilogue: int8 GEMMs (tensor_core_gemm_int8) have no epilogue; use --epilogue none")
    if settings.dtype == "fp8":
        if settings.epilogue not in ("none", "bias"):
            raise ValueError("epilogue: fp8 GEMMs (gemm_fp8) fuse a bias only; use --epilogue none or bias")
        if settings.layout not in ("NN", "NT"):
            raise ValueError(
                "layout: fp8 GEMMs take A row-major (as torch._scaled_mm); use --layout NN or NT"
            )
    accepted = accepted_impls(settings.dtype)
    wrong = [impl for impl in settings.impls if impl not in accepted]
    if wrong or not settings.impls:
        raise ValueError(
            f"impl: {wrong or 'empty list'} not available for dtype {settings.dtype}; "
            f"accepted: {', '.join(accepted)}"
        )
    if not settings.cases:
        raise ValueError("sizes: no GEMM shape to benchmark")
    report.check_counts(settings)


def _operands(case: GemmCase, settings: GemmSettings, device: torch.device):
    """A and B stored as the layout says, plus the bias; returns (a, b, trans_a, trans_b, bias)."""
    dtype = report.TORCH_DTYPES[settings.dtype]
    trans_a, trans_b = settings.layout[0] == "T", settings.layout[1] == "T"
    shape_a = (case.k, case.m) if trans_a else (case.m, case.k)
    shape_b = (case.n, case.k) if trans_b else (case.k, case.n)
    if dtype == torch.int8:
        a = torch.randint(-128, 128, shape_a, dtype=dtype, device=device)
        b = torch.randint(-128, 128, shape_b, dtype=dtype, device=device)
    else:
        a = torch.randn(shape_a, dtype=dtype, device=device)
        b = torch.randn(shape_b, dtype=dtype, device=device)
    bias = torch.randn(case.n, dtype=dtype, device=device) if settings.epilogue != "none" else None
    return a, b, trans_a, trans_b, bias


def _torch_activation(name: str | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    functional = torch.nn.functional
    return {
        None: None,
        "relu": torch.relu,
        "gelu": functional.gelu,
        "gelu_tanh": lambda x: functional.gelu(x, approximate="tanh"),
        "silu": functional.silu,
    }[name]


def _fp8_workload(impl: str, case: GemmCase, settings: GemmSettings, device: torch.device):
    """gemm_fp8, torch._scaled_mm / F.scaled_mm at the same scaling, or bf16 torch.matmul of the same values
    (b stored [N, K] for layout NT, else [K, N]; the bias is bf16)."""
    import llm_speed

    m, n, k, gran = case.m, case.n, case.k, case.granularity
    trans_b = settings.layout == "NT"
    a_hp = torch.randn(m, k, device=device)
    w_hp = torch.randn(n, k, device=device)  # b as an nn.Linear weight [N, K]
    names = {"tensor": ("tensor", "tensor"), "row": ("row", "row"), "block": ((1, 128), (128, 128))}[gran]
    a, scale_a = llm_speed.quantize_fp8(a_hp, granularity=names[0])
    w, scale_w = llm_speed.quantize_fp8(w_hp, granularity=names[1])
    # b as stored, and its scale against b as stored (gemm_fp8's convention)
    if trans_b:
        b, scale_b = w, scale_w
    else:
        b, scale_b = w.mT.contiguous(), (scale_w if gran == "tensor" else scale_w.mT.contiguous())
    bias = torch.randn(n, dtype=torch.bfloat16, device=device) if settings.epilogue == "bias" else None
    if impl == "llm-speed":
        return lambda: llm_speed.gemm_fp8(a, b, scale_a, scale_b, bias=bias, trans_b=trans_b)
    b_kn = b.mT if trans_b else b  # torch's [K, N] (cuBLAS wants it column-major: layout NT)
    if impl == "torch":
        a16, b16 = a.to(torch.bfloat16), b_kn.to(torch.bfloat16)
        return (lambda: torch.matmul(a16, b16)) if bias is None else (lambda: torch.matmul(a16, b16) + bias)
    if gran == "block":
        from torch.nn.functional import ScalingType, scaled_mm

        scale_kn = scale_w.mT  # [K/128, N/128]: blocks of the [K, N] operand
        # cuBLAS takes the 1x128 scales M-major (strides (1, M)): torch 2.11 refused our row-major [M, K/128]
        scale_a_m_major = scale_a.mT.contiguous().mT
        return lambda: scaled_mm(
            a, b_kn, scale_a_m_major, ScalingType.BlockWise1x128, scale_kn, ScalingType.BlockWise128x128,
            bias=bias, output_dtype=torch.bfloat16,
        )  # fmt: skip
    scale_kn = scale_w.reshape(1, n) if gran == "row" else scale_w
    # use_fast_accum: the tensor cores' own fp8 accumulation, as gemm_fp8's tl.dot (Triton's default on
    # sm_90) and the forward GEMM of torchao's Float8Linear; cuBLAS's default promotes to float32 registers.
    return lambda: torch._scaled_mm(
        a, b_kn, scale_a, scale_kn, bias=bias, out_dtype=torch.bfloat16, use_fast_accum=True
    )


def _workload_builder(impl: str, case: GemmCase, settings: GemmSettings, device: torch.device):
    def build() -> Callable[[], Any]:
        if settings.dtype == "fp8":
            return _fp8_workload(impl, case, settings, device)
        a, b, trans_a, trans_b, bias = _operands(case, settings, device)
        activation = settings.epilogue.split("+")[1] if "+" in settings.epilogue else None
        # The transposed views are what torch.matmul / _int_mm see: no copy, cuBLAS reads them in place.
        op_a = a.t() if trans_a else a
        op_b = b.t() if trans_b else b
        if impl == "llm-speed":
            import llm_speed

            if settings.dtype == "int8":
                return lambda: llm_speed.tensor_core_gemm_int8(op_a, op_b)
            return lambda: llm_speed.gemm(
                a, b, trans_a=trans_a, trans_b=trans_b, bias=bias, activation=activation
            )
        if impl == "torch-int-mm":
            return lambda: torch._int_mm(op_a, op_b)
        act = _torch_activation(activation)
        if bias is None:
            return lambda: torch.matmul(op_a, op_b)
        if act is None:
            return lambda: torch.matmul(op_a, op_b) + bias
        return lambda: act(torch.matmul(op_a, op_b) + bias)

    return build


def run_gemm(
    settings: GemmSettings,
    *,
    show_progress: bool = True,
    on_case: Callable[[list[GemmMeasurement]], None] | None = None,
) -> list[GemmMeasurement]:
    """Measure every implementation in ``settings.impls`` on every case.

    ``on_case(rows_so_far)`` is called after each case (the commands write partial results there, so an
    interrupted run keeps what it measured).
    """
    check_settings(settings)
    device = torch.device(settings.device)
    rows: list[GemmMeasurement] = []
    cases = settings.cases
    if settings.dtype == "fp8":  # each shape at each granularity
        cases = tuple(dataclasses.replace(c, granularity=g) for c in cases for g in FP8_GRANULARITIES)
    total = len(cases) * len(settings.impls)
    progress = report.progress(total, "gemm") if show_progress else contextlib.nullcontext(None)
    with progress as advance:
        for case in cases:
            label = f"{case.name} {case.m}x{case.n}x{case.k}" if case.name else f"{case.m}x{case.n}x{case.k}"
            if case.granularity:
                label = f"{label} {case.granularity}"
            case_rows = []
            for impl in settings.impls:
                cost = row_cost(impl, case, settings)
                row = GemmMeasurement(
                    case=label,
                    impl=impl,
                    dtype=row_dtype(impl, settings.dtype),  # an fp8 run's torch.matmul computes in bf16
                    available=False,
                    name=case.name,
                    m=case.m,
                    n=case.n,
                    k=case.k,
                    count=case.count,
                    flops=cost.flops,
                    bytes_moved=cost.bytes_moved,
                )
                report.run_measurement(
                    row,
                    _workload_builder(impl, case, settings, device),
                    device=device,
                    warmup=settings.warmup,
                    iterations=settings.iterations,
                    min_time_s=settings.min_time_s,
                )
                case_rows.append(row)
                if advance is not None:
                    advance(f"{label} {impl}")
            baseline = next((r for r in case_rows if r.impl == baseline_impl(settings.dtype)), None)
            for row in case_rows:
                if baseline is not None and baseline.median_ms is not None and row.median_ms is not None:
                    row.percent_of_baseline = 100.0 * baseline.median_ms / row.median_ms
                    low, high = report.ratio_range(baseline.timing, row.timing)
                    row.percent_of_baseline_range = (100.0 * low, 100.0 * high)
                    row.percent_within_noise = report.within_noise((low, high))
            rows.extend(case_rows)
            if on_case is not None:
                on_case(rows)
    gpu, reason = report.prediction_gpu(device)
    report.add_comparisons(rows, gpu, settings.dtype, reason, predictor(settings, gpu))
    return rows


def predictor(settings: GemmSettings, gpu) -> Callable[[GemmMeasurement], Any] | None:
    """Row -> the calibrated prediction of its implementation on ``gpu``: llm-speed's fused epilogue is part
    of its kernel; torch.matmul's bias and activation are each one more elementwise pass over the output."""
    if gpu is None:
        return None
    from llm_speed.core.gpus import dtype_bytes
    from llm_speed.perf.predict import predict, predict_work

    gpu_id = report.prediction_gpu_id(gpu)

    def predict_row(row: GemmMeasurement):
        dtype = row_dtype(row.impl, settings.dtype)
        epilogue = settings.epilogue != "none"
        if dtype == "fp8":  # gemm_fp8 and torch._scaled_mm at the row's scaling (the bias fused)
            implementation = "llm-speed" if row.impl == "llm-speed" else "cublas"
            scaling = row.case.split()[-1]  # "4096x4096x4096 row": the case's granularity
            return predict("gemm_fp8", gpu_id, implementation=implementation, m=row.m, n=row.n, k=row.k,
                           with_bias=epilogue, scaling=scaling, layout=settings.layout)  # fmt: skip
        # an fp8 run's torch.matmul is a bf16 GEMM, its bias added after it as any torch row's
        op = "tensor_core_gemm_int8" if dtype == "int8" else "gemm"
        implementation = "llm-speed" if row.impl == "llm-speed" else "cublas"
        fused = epilogue and implementation == "llm-speed"
        prediction = predict(op, gpu_id, implementation=implementation, m=row.m, n=row.n, k=row.k,
                             dtype=dtype, with_bias=fused)  # fmt: skip
        if implementation == "cublas" and epilogue:
            passes = 1 + ("+" in settings.epilogue)
            element = dtype_bytes(dtype)  # (no int8 epilogue: the settings refuse it)
            extra = predict_work(gpu_id, flops=float(row.m * row.n * passes),
                                 bytes_moved=unfused_epilogue_bytes(row.m, row.n, settings.epilogue, element),
                                 dtype=dtype, implementation="vendor", kernels=passes)  # fmt: skip
            from dataclasses import replace

            prediction = replace(prediction, seconds=prediction.seconds + extra.seconds,
                                 calibrated=prediction.calibrated and extra.calibrated)  # fmt: skip
        return prediction

    return predict_row


def summary(settings: GemmSettings, rows: Sequence[GemmMeasurement]) -> dict[str, Any]:
    """Per implementation: geometric mean of % of the baseline over the shapes, and the total time of all
    shapes weighted by their count (one forward pass's weight GEMMs for ``--model``)."""
    result: dict[str, Any] = {"baseline": baseline_impl(settings.dtype), "per_impl": {}}
    for impl in settings.impls:
        mine = [r for r in rows if r.impl == impl]
        percents = [r.percent_of_baseline for r in mine if r.percent_of_baseline is not None]
        measured = [r for r in mine if r.median_ms is not None]
        complete = len(measured) == len(mine)
        result["per_impl"][impl] = {
            "shapes_measured": len(measured),
            "shapes_total": len(mine),
            "geomean_percent_of_baseline": (
                math.exp(sum(math.log(p) for p in percents) / len(percents)) if percents else None
            ),
            # Only meaningful when every shape ran; None otherwise rather than a partial sum.
            "weighted_total_ms": sum(r.median_ms * r.count for r in measured)
            if complete and measured
            else None,
        }
    return result


def results_payload(settings: GemmSettings, rows: Sequence[GemmMeasurement]) -> dict[str, Any]:
    """The JSON document: provenance, settings, notes, every row and the summary."""
    return report.results_document(
        "gemm",
        settings,
        rows,
        lambda row: f"{row.m}x{row.n}x{row.k}",  # the old benchmark scripts' field
        TRITON_IMPLS,
        summary=summary(settings, rows),
    )


def baseline_label(settings: GemmSettings) -> str:
    """How the baseline is called in tables: cuBLAS on a GPU, the torch op name on a CPU."""
    on_gpu = torch.device(settings.device).type == "cuda"
    if settings.dtype == "int8":
        return "torch._int_mm" + (" (cuBLAS)" if on_gpu else "")
    if settings.dtype == "fp8":
        return "torch._scaled_mm" + (" (cuBLAS)" if on_gpu else "")
    return "cuBLAS" if on_gpu else "torch.matmul"


def percent_cell(row: GemmMeasurement) -> str | None:
    """ "97.3% [85–110%] within noise": the row's speed as a percentage of the baseline's, with its range."""
    if row.percent_of_baseline is None:
        return None
    interval = row.percent_of_baseline_range
    fraction = (interval[0] / 100.0, interval[1] / 100.0) if interval is not None else None
    return report.ratio_text(row.percent_of_baseline / 100.0, fraction, percent=True)


def print_gemm(settings: GemmSettings, rows: Sequence[GemmMeasurement], console: Console) -> None:
    """The old scripts' size / cuBLAS / ours table, the full table, and the summary."""
    device = torch.device(settings.device)
    base = baseline_label(settings)
    config = (
        f"dtype={settings.dtype}, layout={settings.layout}, epilogue={settings.epilogue}, "
        f"device={report.environment_device_name(device)}"
        + (f", model={settings.model}, tokens={settings.tokens}" if settings.model else "")
    )
    baseline_name = baseline_impl(settings.dtype)
    by_key = {(r.case, r.impl): r for r in rows}
    cases = list(dict.fromkeys(r.case for r in rows))
    short_rows = []
    for case in cases:
        ours, theirs = by_key.get((case, "llm-speed")), by_key.get((case, baseline_name))
        if ours is None or theirs is None or ours.percent_of_baseline is None:
            continue
        short_rows.append([case, theirs.median_ms, ours.median_ms, percent_cell(ours)])
    if short_rows:
        print_table(
            "GEMM BENCHMARK RESULTS",
            ["Size", f"{base} (ms)", "llm-speed (ms)", f"% of {base} [range]"],
            short_rows,
            caption=config,
            console=console,
        )
    columns = ["shape", "count per pass", "impl", *report.COMMON_COLUMNS, f"% of {base} [range]"]
    full_rows = [
        [
            row.case,
            row.count if settings.model else None,
            row.impl,
            *report.common_cells(row),
            percent_cell(row),
        ]
        for row in rows
        if row.available
    ]
    report.print_rows("GEMM: every implementation", columns, full_rows, caption=config, console=console)
    report.print_unavailable(rows, console)
    totals = summary(settings, rows)["per_impl"]
    # (a CPU run scales the model's shapes: their weighted total is then no forward pass of the model)
    whole_pass = bool(settings.model) and settings.cases == model_cases(settings.model, settings.tokens)
    for impl, figures in totals.items():
        parts = [f"{figures['shapes_measured']}/{figures['shapes_total']} shapes ran"]
        if figures["geomean_percent_of_baseline"] is not None:
            parts.append(f"geometric mean {figures['geomean_percent_of_baseline']:.1f}% of {base}")
        if figures["weighted_total_ms"] is not None and settings.model:
            what = "one forward pass's weight GEMMs" if whole_pass else "the scaled shapes x their counts"
            parts.append(f"{figures['weighted_total_ms']:.3g} ms for {what}")
        console.print(f"summary {impl}: " + ", ".join(parts), highlight=False, markup=False)
    for note in report.timing_notes(device, TRITON_IMPLS, rows):
        console.print(f"note: {note}", highlight=False, markup=False)
    if rows and rows[0].prediction_reason:
        console.print(f"note: {rows[0].prediction_reason}", highlight=False, markup=False)
