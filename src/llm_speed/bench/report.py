"""What every benchmark shares: the result row, provenance of a run, the model's prediction and the output.

A benchmark produces :class:`Measurement` rows (one per implementation and case); this module fills in the
figures that compare rows with each other (speedup vs the fastest other implementation) and with the
performance model (roofline time floor on the detected GPU), and writes the table and the JSON.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import platform
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from llm_speed import __version__
from llm_speed._output import write_text_atomic
from llm_speed.bench.cpu_load import CPU_TIMING_THREADS
from llm_speed.bench.timing import PeakMemory, Timing, check_run_counts, measure, peak_memory
from llm_speed.core.runtime import INTERPRETED

# Names accepted by --dtype, and the torch dtype each one means.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "int8": torch.int8,
}
MIB = 2**20


# The checks every benchmark's settings share; each ValueError names the setting, before any work.
def check_counts(settings: Any, *positive: str) -> None:
    """Each field named in ``positive`` an integer >= 1, and the run counts (``warmup``, ``iterations``,
    ``min_time_s`` where the settings have it) as :func:`llm_speed.bench.timing.measure` takes them."""
    for name in positive:
        value = getattr(settings, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected an integer >= 1, got {value!r}")
    check_run_counts(settings.warmup, settings.iterations, getattr(settings, "min_time_s", 0.0))


def check_lengths(settings: Any, *names: str) -> None:
    """Each field named a non-empty sequence of integers >= 1 (the swept sizes)."""
    for name in names:
        values = getattr(settings, name)
        if not values or min(values) < 1:
            raise ValueError(f"{name}: expected integers >= 1, got {list(values)}")


def check_kv_heads(settings: Any) -> None:
    """``num_kv_heads`` divides ``num_heads`` (GQA/MQA)."""
    if settings.num_heads % settings.num_kv_heads:
        raise ValueError(
            f"num_kv_heads: must divide num_heads ({settings.num_heads}), got {settings.num_kv_heads}"
        )


def check_choice(name: str, value: str, accepted: Sequence[str]) -> None:
    """``value`` one of ``accepted``."""
    if value not in accepted:
        raise ValueError(f"{name}: {value!r} is not supported; accepted: {', '.join(accepted)}")


def check_choices(name: str, values: Sequence[str], accepted: Sequence[str]) -> None:
    """``values`` non-empty, each one of ``accepted``."""
    unknown = [value for value in values if value not in accepted]
    if unknown or not values:
        raise ValueError(f"{name}: unknown {unknown or 'empty list'}; accepted: {', '.join(accepted)}")


@dataclasses.dataclass(kw_only=True)
class Measurement:
    """One implementation on one case. A figure that could not be obtained is None, with a reason field."""

    # The fields that compare this row's time with another row's (withheld when the machine was busy).
    RATIO_FIELDS: ClassVar[tuple[str, ...]] = (
        "fastest_other", "speedup_vs_fastest_other", "speedup_range", "speedup_within_noise",
    )  # fmt: skip
    # The fields a bench's JSON and CSV rows leave out: internal ones, and ones its rows can never fill (a
    # field null whatever the input says nothing).
    NOT_WRITTEN: ClassVar[tuple[str, ...]] = ("refused_everywhere",)
    case: str  # short label of the shape, e.g. "seq=512" or "qkv 4096x6144x4096"
    impl: str
    available: bool
    reason: str | None = None  # why the implementation did not run (unavailable, refused the shape, OOM)
    flops: float
    bytes_moved: float  # the performance model's minimum DRAM traffic for this implementation
    # The dtype the implementation computes in: the run's unless the row sets its own (an fp8 row of a bf16
    # run, an fp8 GEMM run's bf16 baseline). Its FLOPs and bytes are of that dtype, the roofline floor takes
    # that dtype's peak and a plot puts the row under its roof. None until add_comparisons fills the run's.
    dtype: str | None = None
    # Refused for a reason that holds on every device (fp8 attention's backward), so no GPU prediction of it
    # is drawn either; not written (``reason`` says why).
    refused_everywhere: bool = False
    timing: Timing | None = None
    tflops: float | None = None
    bandwidth_gb_s: float | None = None
    peak_memory_bytes: int | None = None
    peak_memory_reason: str | None = None
    fastest_other: str | None = None
    speedup_vs_fastest_other: float | None = None  # fastest other's median / this median (>1: this is faster)
    # The speedup's uncertainty: from (other's p20 / this p80) to (other's p80 / this p20). When it contains 1
    # the runs' spread is wider than the difference claimed, and ``speedup_within_noise`` says so.
    speedup_range: tuple[float, float] | None = None
    speedup_within_noise: bool | None = None
    predicted_ms: float | None = None  # roofline time floor on the detected GPU
    predicted_bound: str | None = None
    prediction_reason: str | None = None
    measured_over_predicted: float | None = None  # how many times the floor the measurement took
    # The calibrated prediction (llm_speed.perf.predict) of this implementation on the detected GPU, its
    # bound, and its error against the measurement: predicted / measured - 1 (+0.10: predicted 10% slower).
    prediction_ms: float | None = None
    prediction_bound: str | None = None
    prediction_error: float | None = None
    prediction_calibrated: bool | None = None  # False: the GPU has no calibration of its own

    @property
    def median_ms(self) -> float | None:
        """Median time, or None when the implementation did not run."""
        return self.timing.median_ms if self.timing is not None else None


def git_commit(source_dir: str | Path | None = None) -> tuple[str | None, str | None]:
    """(commit hash, None) when ``source_dir`` (default: llm_speed's own directory) is tracked by a git
    checkout, else (None, reason): an installed copy inside another repository's work tree is not.
    Uncommitted changes to tracked files add "+uncommitted-changes" to the hash.

    ``LLM_SPEED_GIT_COMMIT`` in the environment wins: a working tree copied to another machine has no .git,
    so whoever copied it says which commit it is (benchmarks/run_gpu_suite.sh passes it on)."""
    if os.environ.get("LLM_SPEED_GIT_COMMIT"):
        return os.environ["LLM_SPEED_GIT_COMMIT"], None
    source_dir = Path(__file__).resolve().parent if source_dir is None else Path(source_dir)
    try:
        result = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=source_dir,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"git could not be run: {error}"
    if result.returncode != 0:
        return None, "llm_speed is not running from a git checkout"
    # A wheel installed in a venv inside the user's own repository sits in that work tree (ignored): its
    # HEAD is the user's commit, not llm_speed's. Only a checkout that tracks the source is llm_speed's.
    tracked = subprocess.run(
        ["git", "ls-files", "--error-unmatch", "--", "."],
        cwd=source_dir,
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    if tracked.returncode != 0:
        return None, "llm_speed is installed inside another git work tree, not running from its own checkout"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        cwd=source_dir,
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    commit = result.stdout.strip()
    return (commit + "+uncommitted-changes" if dirty.stdout.strip() else commit), None


def environment(device: torch.device) -> dict[str, Any]:
    """Provenance of a run: device, versions, interpreter mode, git commit and a UTC timestamp."""
    import triton

    from llm_speed.core.gpus import detect_gpu

    commit, commit_reason = git_commit()
    info: dict[str, Any] = {
        "timestamp_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device_type": device.type,
        "llm_speed_version": __version__,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "triton_version": triton.__version__,
        "python_version": platform.python_version(),
        "triton_interpret": INTERPRETED,
        "git_commit": commit,
        "git_commit_reason": commit_reason,
    }
    info["device_name"] = environment_device_name(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = detect_gpu()
        info["compute_capability"] = f"{props.major}.{props.minor}"
        info["gpu_spec_id"] = gpu.id if gpu is not None else None
    else:
        info["compute_capability"] = None
        info["gpu_spec_id"] = None
    return info


def environment_device_name(device: torch.device) -> str:
    """The GPU's name, or a description of the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.machine()}, timed on {CPU_TIMING_THREADS} of {os.cpu_count()} cores)"


def timing_notes(
    device: torch.device,
    triton_ops: Sequence[str],
    rows: Sequence[Measurement] | None = None,
    *,
    memory_and_predictions: bool = True,
) -> list[str]:
    """Plain statements about what the timings mean on this device (printed and stored in the JSON).
    With ``rows``, only the Triton ops that were timed are named (one not asked for, or that could not run,
    has no times); ``memory_and_predictions=False`` for a benchmark that reports neither."""
    if rows is not None:
        timed = {row.impl for row in rows if row.available}
        triton_ops = [op for op in triton_ops if op in timed]
    notes = []
    if device.type == "cpu":
        notes.append("CPU timings (host clock, CPU tensors): they say nothing about GPU performance.")
        if INTERPRETED and triton_ops:
            notes.append(
                f"TRITON_INTERPRET=1: the times of {', '.join(triton_ops)} are of Triton's interpreter, "
                "not of a compiled kernel."
            )
        elif triton_ops:
            notes.append(
                f"Without TRITON_INTERPRET, the times of {', '.join(triton_ops)} are of llm-speed's PyTorch "
                "fallback for CPU tensors, not of the Triton kernels."
            )
        if memory_and_predictions:
            notes.append("Peak memory is only measured on CUDA devices; the predictions are for GPUs only.")
    elif INTERPRETED:
        notes.append("TRITON_INTERPRET=1 on a GPU: Triton kernels are interpreted; their times mean nothing.")
    return notes


def prediction_gpu(device: torch.device):
    """The GPU whose roofline predicts the times: the detected one on CUDA, else None with the reason."""
    from llm_speed.core.gpus import detect_gpu

    if device.type != "cuda":
        return None, "no prediction for CPU runs: the performance model describes GPUs"
    gpu = detect_gpu()
    if gpu is None:
        name = torch.cuda.get_device_name(device)
        return None, f"{name} is not in the GPU spec table (llm_speed.core.gpus)"
    return gpu, None


def refuse_when_no_impl_can_run(impls: Sequence[str], reason: Callable[[str], str | None]) -> None:
    """ValueError naming --impl when not one implementation asked for can run here, each for a reason known
    before any work (``reason(impl)``: fp8 attention's backward, a package not installed, a CUDA-only
    backend on a CPU): a run would only list them as not run."""
    reasons = {impl: reason(impl) for impl in impls}
    if impls and all(reasons.values()):
        said = "; ".join(f"{impl}: {why}" for impl, why in reasons.items())
        raise ValueError(f"impl: none of the implementations asked for can run here ({said})")


def bytes_text(value: float) -> str:
    """``38.4 TB``, ``4.2 GB``, ``263 MB``, ``12 kB``, ``512 B`` (decimal units)."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def cpu_memory(device: torch.device) -> int | None:
    """Bytes a run on ``device`` may still take when it is the CPU (None elsewhere, or when unknown). A
    process that asks a CPU for more than there is gets killed by the system, every result with it; a GPU's
    out-of-memory error is caught and reported in the row."""
    if device.type != "cpu":
        return None
    from llm_speed.bench import cpu_load

    return cpu_load.available_memory()


def memory_shortfall(need: int, available: int | None) -> str | None:
    """Why a row needing at least ``need`` bytes is not run with ``available`` free (None: it can run)."""
    if available is None or need <= available:
        return None
    return f"needs at least {bytes_text(need)} of memory, {bytes_text(available)} available on this CPU"


def refuse_when_nothing_fits(needs: Sequence[int], available: int | None, sizes: str) -> None:
    """ValueError naming the size options (``sizes``) when not one case of a sweep, each needing at least
    ``needs[i]`` bytes, fits in ``available`` (a sweep where some do runs those, the others reported)."""
    if available is not None and needs and min(needs) > available:
        raise ValueError(
            f"{sizes}: no case fits in the memory available here (the smallest needs at least "
            f"{bytes_text(min(needs))}, {bytes_text(available)} available); give smaller sizes"
        )


def run_measurement(
    row: Measurement,
    build: Callable[[], Callable[[], Any]],
    *,
    device: torch.device,
    warmup: int,
    iterations: int,
    min_time_s: float = 0.0,
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    then: Callable[[Callable[[], Any]], None] | None = None,
) -> Measurement:
    """Time the workload that ``build()`` returns; a failure marks ``row`` unavailable with the reason.

    ``build`` prepares the workload (e.g. runs the forward once for a backward timing) and returns the
    no-argument function to time. ``context`` is entered around everything (e.g. an SDPA backend choice), so
    its own cost is not timed. The first call of the workload doubles as the availability check; warnings
    raised by a refusal (SDPA explains why a backend cannot run through warnings) join the reason.
    ``then(workload)``, where given, runs after the timing, in the same context and with the same inputs
    (the decode benchmark's CUDA-graph replay); it records its own figures and failures on the row.
    """
    caught: list[warnings.WarningMessage] = []
    try:
        with context(), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            workload = build()
            workload()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            row.timing = measure(
                workload, warmup=warmup, iterations=iterations, device=device, min_time_s=min_time_s
            )
            memory: PeakMemory = peak_memory(workload, device)
            if then is not None:
                then(workload)
    except Exception as error:  # any refusal (shape, dtype, OOM, missing backward) is reported, not raised
        row.available = False
        row.timing = None
        row.reason = refusal_reason(error, caught)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return row
    row.available = True
    row.peak_memory_bytes = memory.peak_bytes
    row.peak_memory_reason = memory.reason
    seconds = row.timing.median_ms * 1e-3
    row.tflops = row.flops / seconds / 1e12 if seconds > 0 else None
    row.bandwidth_gb_s = row.bytes_moved / seconds / 1e9 if seconds > 0 else None
    return row


def refusal_reason(error: BaseException, caught: Sequence[warnings.WarningMessage]) -> str:
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".strip()
    if isinstance(error, torch.cuda.OutOfMemoryError):
        text = "out of memory"
    # SDPA explains a refused backend in UserWarnings; other categories (deprecations) are noise here.
    explanations = [w for w in caught if issubclass(w.category, UserWarning) and str(w.message).strip()]
    details = [str(w.message).strip().splitlines()[0] for w in explanations]
    if details:
        text += " (" + "; ".join(dict.fromkeys(details)) + ")"
    return text


def add_comparisons(
    rows: Sequence[Measurement],
    gpu,
    dtype: Any,
    prediction_reason: str | None,
    predictor: Callable[[Measurement], Any] | None = None,
) -> None:
    """Fill speedup vs the fastest other implementation of the same case, the roofline floor and, with a
    ``predictor`` (row -> :class:`llm_speed.perf.predict.Prediction` or None for an implementation the
    model does not cover), the calibrated prediction and its error. ``dtype`` is the run's: a row without a
    dtype of its own gets it."""
    from llm_speed.perf.roofline import roofline

    for row in rows:
        if row.dtype is None:
            row.dtype = dtype
        if gpu is None:
            row.prediction_reason = prediction_reason
        else:
            # the row's own dtype: its FLOPs and bytes are of it (a bf16 row of an fp8 run is no fp8 GEMM)
            point = roofline(row.flops, row.bytes_moved, row.dtype, gpu)
            row.predicted_ms = point.time_floor_s * 1e3
            row.predicted_bound = point.bound
            if row.median_ms:
                row.measured_over_predicted = row.median_ms / row.predicted_ms
            if predictor is not None:
                add_prediction(row, predictor)
        others = [o for o in rows if o is not row and o.case == row.case and o.median_ms is not None]
        if row.median_ms is not None and others:
            fastest = min(others, key=lambda o: o.median_ms)
            row.fastest_other = fastest.impl
            row.speedup_vs_fastest_other = fastest.median_ms / row.median_ms
            row.speedup_range = ratio_range(fastest.timing, row.timing)
            row.speedup_within_noise = within_noise(row.speedup_range)


def add_prediction(row: Measurement, predictor: Callable[[Measurement], Any]) -> None:
    """The calibrated prediction of ``row`` and its error against the median (none when the model does not
    cover the implementation or the problem: ``predictor`` returns None or raises ValueError)."""
    try:
        prediction = predictor(row)
    except ValueError:
        prediction = None
    if prediction is None:
        return
    row.prediction_ms = prediction.seconds * 1e3
    row.prediction_bound = prediction.bound
    row.prediction_calibrated = prediction.calibrated
    if row.median_ms:
        row.prediction_error = row.prediction_ms / row.median_ms - 1.0


def prediction_gpu_id(gpu) -> str | None:
    """The id the predictions use for ``gpu`` (a GPUSpec, an id, or None)."""
    if gpu is None:
        return None
    return gpu if isinstance(gpu, str) else gpu.id


def add_hbm_peak_fraction(rows: Sequence[Any], gpu) -> None:
    """For the memory-bound benches (rows with a ``hbm_peak_fraction`` field): achieved GB/s over the GPU's
    HBM peak, where the GPU is in the table."""
    if gpu is None:
        return
    for row in rows:
        if row.bandwidth_gb_s is not None:
            row.hbm_peak_fraction = row.bandwidth_gb_s / gpu.hbm_bandwidth_gbs


def hbm_peak_cell(row: Any) -> str | None:
    """ "82%": the row's ``hbm_peak_fraction`` as a whole percentage."""
    return f"{100 * row.hbm_peak_fraction:.0f}%" if row.hbm_peak_fraction is not None else None


def ratio_range(numerator: Timing, denominator: Timing) -> tuple[float, float]:
    """The range of ``numerator / denominator`` over the two p20–p80 intervals: (low, high).

    For a speedup (other's time / this time): the other's p20 over this p80, to the other's p80 over this p20.
    """
    return numerator.p20_ms / denominator.p80_ms, numerator.p80_ms / denominator.p20_ms


def within_noise(interval: tuple[float, float] | None) -> bool | None:
    """Whether a ratio's range contains 1: the runs' spread is wider than the difference the ratio claims."""
    if interval is None:
        return None
    return interval[0] <= 1.0 <= interval[1]


def ratio_text(
    ratio: float, interval: tuple[float, float] | None, *, percent: bool = False, label: str = ""
) -> str:
    """``1.35x sdpa [1.2–1.5x]`` (or ``135% [120–150%]``), "within noise" added when the range contains 1."""
    scale, unit = (100.0, "%") if percent else (1.0, "x")
    text = f"{ratio * scale:.3g}{unit}" + (f" {label}" if label else "")
    if interval is not None:
        text += f" [{interval[0] * scale:.3g}–{interval[1] * scale:.3g}{unit}]"
        if within_noise(interval):
            text += " within noise"
    return text


def ratio_cell(ratio: float | None) -> str | None:
    """A table's ratio cell, ``1.35x``: :func:`ratio_text` without a range (3 significant digits, so a much
    slower row reads 0.000318x, not 0.00x), None where there is no ratio."""
    return None if ratio is None else ratio_text(ratio, None)


def to_record(row: Measurement) -> dict[str, Any]:
    """One row as JSON values, with the old scripts' ``latency_ms`` and ``throughput_tflops`` keys added."""
    record = written_fields(row)
    record["latency_ms"] = row.median_ms
    record["throughput_tflops"] = row.tflops
    return record


def written_fields(row: Measurement) -> dict[str, Any]:
    """The row's fields as JSON values, less those its class does not write (``NOT_WRITTEN``)."""
    from llm_speed._output import to_jsonable

    return {key: value for key, value in to_jsonable(row).items() if key not in row.NOT_WRITTEN}


def results_document(
    benchmark: str,
    settings: Any,
    rows: Sequence[Measurement],
    config: Callable[[Any], str],
    triton_ops: Sequence[str],
    **extra: Any,
) -> dict[str, Any]:
    """A benchmark's JSON: provenance, settings, notes and every row, each with the old scripts' ``config``
    label (``config(row)``) besides its own fields; ``extra`` adds top-level entries (e.g. a summary)."""
    device = torch.device(settings.device)
    return {
        "benchmark": benchmark,
        "environment": environment(device),
        "settings": dataclasses.asdict(settings),
        "notes": timing_notes(device, triton_ops, rows),
        "results": [{**to_record(row), "config": config(row)} for row in rows],
        **extra,
    }


def mib(value: int | None) -> float | None:
    """Bytes to MiB, keeping None."""
    return None if value is None else value / MIB


def spread(timing: Timing | None) -> str | None:
    """The p20–p80 interval of a timing as text."""
    if timing is None:
        return None
    return f"{timing.p20_ms:.3g}–{timing.p80_ms:.3g}"


def common_cells(row: Measurement) -> list[Any]:
    """The cells every benchmark table shows, in the order of :data:`COMMON_COLUMNS`."""
    model = None
    if row.predicted_ms is not None:
        model = f"{row.predicted_ms:.3g} ({row.predicted_bound})"
    median = None
    if row.timing is not None:
        median = f"{row.timing.median_ms:.3g} [{spread(row.timing)}]"
    predicted = None
    if row.prediction_ms is not None:
        predicted = f"{row.prediction_ms:.3g} ({row.prediction_bound})"
        if row.prediction_calibrated is False:
            predicted += " uncalibrated"
    return [
        median,
        row.tflops,
        row.bandwidth_gb_s,
        mib(row.peak_memory_bytes),
        speedup_cell(row),
        model,
        f"{row.measured_over_predicted:.2f}x" if row.measured_over_predicted is not None else None,
        predicted,
        f"{row.prediction_error:+.0%}" if row.prediction_error is not None else None,
    ]


def speedup_cell(row: Measurement) -> str | None:
    """ "1.35x sdpa [1.2–1.5x]": this row's speedup over the fastest other implementation and its range over
    the two p20–p80 intervals, "within noise" when that range contains 1 (3 significant digits, so a much
    slower row reads 0.0123x, not 0.00x)."""
    if row.speedup_vs_fastest_other is None:
        return None
    return ratio_text(row.speedup_vs_fastest_other, row.speedup_range, label=row.fastest_other or "")


COMMON_COLUMNS = (
    "median ms [p20–p80]",
    "TFLOP/s",
    "GB/s",
    "peak MiB",
    "vs fastest other [range]",
    "model ms (bound)",
    "measured/model",
    "predicted ms (bound)",
    "prediction error",
)


def print_rows(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], *, caption: str, console: Console
) -> None:
    """A table without the columns that are empty in every row (peak memory and the model on a CPU run)."""
    from llm_speed._output import print_table

    keep = [i for i in range(len(columns)) if any(row[i] is not None for row in rows)] if rows else []
    print_table(
        title,
        [columns[i] for i in keep],
        [[row[i] for i in keep] for row in rows],
        caption=caption,
        console=console,
    )


def output_console() -> Console:
    """The console for result tables: the terminal's width, or wide enough for logs when not a terminal."""
    from llm_speed._cli import console

    return console()


def print_unavailable(rows: Sequence[Measurement], console: Console) -> None:
    """List the implementations that did not run, with the reason (one line per implementation and reason)."""
    grouped: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        if not row.available:
            grouped.setdefault((row.impl, row.reason or "unknown"), []).append(row.case)
    for (impl, reason), cases in grouped.items():
        console.print(f"  not run: {impl} [{', '.join(cases)}] — {reason}", highlight=False, markup=False)


# The CSV columns before a row's own fields: what a spreadsheet user sorts and compares by.
CSV_TIMING_FIELDS = ("median_ms", "p20_ms", "p80_ms", "min_ms", "max_ms", "iterations", "timer")


def csv_records(rows: Sequence[Measurement]) -> list[dict[str, Any]]:
    """One flat record per row: the row's scalar fields, its timing statistics, ranges as low/high columns."""
    records = []
    for row in rows:
        record: dict[str, Any] = {}
        for key, value in written_fields(row).items():
            if key == "timing":
                record.update({f: (value or {}).get(f) for f in CSV_TIMING_FIELDS})
            elif isinstance(value, list) and len(value) == 2:  # a (low, high) range
                record[f"{key}_low"], record[f"{key}_high"] = value
            elif value is None or isinstance(value, (str, int, float, bool)):
                record[key] = value
            if key == "impl":
                record.update({f: None for f in CSV_TIMING_FIELDS})  # keep the timing columns near the front
        records.append(record)
    return records


def write_csv(rows: Sequence[Measurement], path: str | Path) -> None:
    """Write one CSV line per row (the header from the first row's fields; empty cells for None).

    The file is rewritten after every case, atomically (``llm_speed._output.write_text_atomic``, as the
    JSON): a run cut during the write keeps the previous file whole, not a truncated one."""
    import csv
    import io

    records = csv_records(rows)
    fields = list(dict.fromkeys(key for record in records for key in record))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fields)
    writer.writeheader()
    writer.writerows(records)
    write_text_atomic(path, text.getvalue())


@contextlib.contextmanager
def progress(total: int, description: str) -> Iterator[Callable[[str], None]]:
    """A progress bar on standard error; yields ``advance(label)`` to call after each measurement."""
    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    )
    with bar:
        task = bar.add_task(description, total=total)

        def advance(label: str) -> None:
            bar.update(task, advance=1, description=f"{description}: {label}")

        yield advance
