"""The decode benchmark: ``flash_attention_with_kvcache`` over a dense and a paged cache, each in the 16-bit
dtype and in fp8 (e4m3, per-tensor descales), against torch SDPA over a dense cache, for one new token per
sequence, swept over batch x context.

Decode is bound by memory bandwidth: each step reads the whole visible K/V cache once. Every row reports the
achieved GB/s of the model's minimum traffic (``kernel_costs.kvcache_decode_cost``, the cache at its own
element size) and, on a GPU in the table, that figure as a fraction of the HBM peak
(``llm_speed.core.gpus``). An fp8 row also reports its tokens/s over the 16-bit cache's of the same layout
(``vs_16bit_cache``; issue 35's target: >= 1.7x at batch x context >= 64 x 4096 on an H100).

On a GPU each row is also timed replayed from a CUDA graph (``graph_ms``; ``--no-graph`` skips it): the
same step without the host's launch path, as a serving engine that captures its decode step runs it. At
small batches an eagerly launched step can take longer to launch than to run, so the two columns differ
most there; a row that cannot be captured says why in ``graph_reason``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from rich.console import Console

from llm_speed.bench import report, timing
from llm_speed.bench.options import DECODE_DTYPES as DTYPES
from llm_speed.bench.options import DECODE_FP8_IMPLS as FP8_IMPLS
from llm_speed.bench.options import DECODE_IMPLS as IMPLS
from llm_speed.bench.options import DECODE_TRITON_IMPLS as TRITON_IMPLS
from llm_speed.bench.report import Measurement

GPU_DEFAULTS = {
    "batch_sizes": (1, 8, 32, 128),
    "contexts": (1024, 4096, 16384),
    "num_heads": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "dtype": "fp16",
    "page_size": 256,
    "warmup": 10,
    "iterations": 50,
}
CPU_DEFAULTS = {
    "batch_sizes": (1, 2),
    "contexts": (32, 64),
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 32,
    "dtype": "fp32",
    "page_size": 16,
    "warmup": 1,
    "iterations": 3,
}


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """One decode benchmark run."""

    batch_sizes: tuple[int, ...]
    contexts: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    page_size: int
    impls: tuple[str, ...]
    warmup: int
    iterations: int
    device: str
    graph: bool = True  # also time each step replayed from a CUDA graph (CUDA devices)


@dataclasses.dataclass(kw_only=True)
class DecodeMeasurement(Measurement):
    """A :class:`Measurement` of one implementation at one (batch, context)."""

    batch: int
    context: int
    hbm_peak_fraction: float | None = None  # achieved GB/s over the GPU's HBM peak (GPUs in the table only)
    # fp8-cache rows: the 16-bit cache's median over this one (= tokens/s ratio; > 1: the fp8 cache is faster)
    vs_16bit_cache: float | None = None
    # The step replayed from a CUDA graph (no host launch path): median ms and GB/s of the same minimum
    # traffic; None with ``graph_reason`` where not measured (a CPU run, --no-graph, a capture refused).
    graph_ms: float | None = None
    graph_bandwidth_gb_s: float | None = None
    graph_reason: str | None = None
    # llm-speed's rows against SDPA over a dense cache (issue 39's ">= 1.0x SDPA"): SDPA's median over this
    # row's, eager and replayed from a graph (> 1: this row is faster); None on SDPA's own row or without it
    vs_sdpa: float | None = None
    graph_vs_sdpa: float | None = None
    RATIO_FIELDS: ClassVar[tuple[str, ...]] = (
        *Measurement.RATIO_FIELDS, "vs_16bit_cache", "vs_sdpa", "graph_vs_sdpa",
    )  # fmt: skip


def check_settings(settings: DecodeSettings) -> None:
    """ValueError naming the setting when a value is out of range."""
    report.check_counts(settings, "num_heads", "num_kv_heads", "head_dim", "page_size")
    report.check_lengths(settings, "batch_sizes", "contexts")
    report.check_kv_heads(settings)
    if settings.page_size % 16:
        raise ValueError(f"page_size: expected a multiple of 16, got {settings.page_size}")
    report.check_choice("dtype", settings.dtype, DTYPES)
    report.check_choices("impl", settings.impls, IMPLS)


def _workload_builder(impl: str, settings: DecodeSettings, batch: int, context: int, device: torch.device):
    """A function that fills a cache of ``context`` tokens per sequence and returns a decode step to time."""

    def build() -> Callable[[], Any]:
        from llm_speed.attention import flash_attention_with_kvcache

        dtype = report.TORCH_DTYPES[settings.dtype]
        heads, heads_kv, dim = settings.num_heads, settings.num_kv_heads, settings.head_dim
        q = torch.randn(batch, 1, heads, dim, device=device, dtype=dtype)
        if impl == "sdpa":
            # SDPA's layout [B, H, S, D]; no is_causal: its top-left mask would show the query key 0 only.
            k = torch.randn(batch, heads_kv, context, dim, device=device, dtype=dtype)
            v = torch.randn_like(k)
            q_t = q.transpose(1, 2)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            return lambda: sdpa(q_t, k, v, enable_gqa=heads_kv != heads)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        table = None
        if impl.startswith("kvcache-paged"):  # pages shuffled as a serving engine's allocator leaves them
            pages = -(-context // settings.page_size)
            shape = (batch * pages, settings.page_size, heads_kv, dim)
            table = torch.randperm(batch * pages, device=device).to(torch.int32).reshape(batch, pages)
        else:
            shape = (batch, context, heads_kv, dim)
        if impl in FP8_IMPLS:  # randn quantized to e4m3 with one descale (|x| < 4.5: amax / 448)
            descale = torch.tensor(4.5 / 448, device=device)
            k_cache, v_cache = (
                (torch.randn(shape, device=device) / descale).clamp(-448, 448).to(torch.float8_e4m3fn)
                for _ in range(2)
            )
            return lambda: flash_attention_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=lens, block_table=table, k_descale=descale,
                v_descale=descale,
            )  # fmt: skip
        k_cache = torch.randn(shape, device=device, dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        return lambda: flash_attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, block_table=table
        )

    return build


def step_cost(settings: DecodeSettings, batch: int, context: int, impl: str):
    """The op table's cost (FLOPs, bytes) of one decode step of ``impl`` at (batch, context)."""
    from llm_speed.perf.kernel_costs import kvcache_decode_cost

    return kvcache_decode_cost(
        batch, settings.num_heads, 1, context, settings.head_dim, heads_kv=settings.num_kv_heads,
        dtype=settings.dtype, kv_dtype="fp8" if impl in FP8_IMPLS else None,
    )  # fmt: skip


def memory_floor(settings: DecodeSettings, batch: int, context: int, impl: str) -> int:
    """Bytes a (batch, context) row of ``impl`` holds at least: its K and V caches (whole pages for a paged
    cache), and for an fp8 cache the float32 draw it is quantized from."""
    tokens = context
    if impl.startswith("kvcache-paged"):
        tokens = -(-context // settings.page_size) * settings.page_size
    elements = batch * tokens * settings.num_kv_heads * settings.head_dim
    if impl in FP8_IMPLS:
        return 2 * elements + 4 * elements
    return 2 * elements * report.TORCH_DTYPES[settings.dtype].itemsize


def memory_needs(settings: DecodeSettings) -> list[int]:
    """:func:`memory_floor` of every row the run makes."""
    return [memory_floor(settings, b, c, impl) for b in settings.batch_sizes for c in settings.contexts
            for impl in settings.impls]  # fmt: skip


def run_decode(settings: DecodeSettings, *, show_progress: bool = True) -> list[DecodeMeasurement]:
    """Measure every implementation at every (batch, context)."""
    check_settings(settings)
    device = torch.device(settings.device)
    available = report.cpu_memory(device)  # a row that cannot fit there is not run
    rows: list[DecodeMeasurement] = []
    cases = [(b, c) for b in settings.batch_sizes for c in settings.contexts]
    total = len(cases) * len(settings.impls)
    progress = report.progress(total, "decode") if show_progress else contextlib.nullcontext(None)
    with progress as advance:
        for batch, context in cases:
            for impl in settings.impls:
                cost = step_cost(settings, batch, context, impl)
                row = DecodeMeasurement(
                    case=f"batch={batch} context={context}",
                    impl=impl,
                    # an fp8 cache too: its keys and values are upcast to q's dtype, the dtype of the
                    # products (its bytes count the cache at 1 byte: step_cost)
                    dtype=settings.dtype,
                    available=False,
                    batch=batch,
                    context=context,
                    flops=cost.flops,
                    bytes_moved=cost.bytes_moved,
                )
                shortfall = report.memory_shortfall(memory_floor(settings, batch, context, impl), available)
                if shortfall:
                    row.reason = shortfall
                else:
                    report.run_measurement(
                        row,
                        _workload_builder(impl, settings, batch, context, device),
                        device=device,
                        warmup=settings.warmup,
                        iterations=settings.iterations,
                        then=_graph_timer(row, settings, device),
                    )
                rows.append(row)
                if advance is not None:
                    advance(f"{row.case} {impl}")
    gpu, reason = report.prediction_gpu(device)
    report.add_comparisons(rows, gpu, settings.dtype, reason, predictor(settings, gpu))
    report.add_hbm_peak_fraction(rows, gpu)
    add_fp8_ratios(rows)
    add_sdpa_ratios(rows)
    return rows


def add_sdpa_ratios(rows: Sequence[DecodeMeasurement]) -> None:
    """Each llm-speed row's ``vs_sdpa`` and ``graph_vs_sdpa``: SDPA's median (same case) over its own, eager
    and replayed from a CUDA graph. The speedup column compares with the fastest other row, which may be
    another of llm-speed's caches; this one answers "faster than SDPA?"."""
    sdpa = {row.case: row for row in rows if row.impl == "sdpa"}
    for row in rows:
        other = sdpa.get(row.case)
        if row.impl == "sdpa" or other is None:
            continue
        if row.median_ms and other.median_ms:
            row.vs_sdpa = other.median_ms / row.median_ms
        if row.graph_ms and other.graph_ms:
            row.graph_vs_sdpa = other.graph_ms / row.graph_ms


def _graph_timer(row: DecodeMeasurement, settings: DecodeSettings, device: torch.device):
    """The ``then`` of :func:`report.run_measurement`: time the row's step replayed from a CUDA graph, or
    say why not. A capture that fails leaves the eager figures standing."""
    if not settings.graph:
        row.graph_reason = "not asked for (--no-graph)"
        return None
    if device.type != "cuda":
        row.graph_reason = f"CUDA graphs need a CUDA device (ran on {device.type})"
        return None

    def replay(workload: Callable[[], Any]) -> None:
        try:
            replayed = timing.measure(
                workload, warmup=settings.warmup, iterations=settings.iterations, device=device, graph=True
            )
        except Exception as error:  # a refused capture is reported on the row, not raised
            row.graph_reason = f"capture failed: {report.refusal_reason(error, ())}"
            return
        row.graph_ms = replayed.median_ms
        seconds = replayed.median_ms * 1e-3
        row.graph_bandwidth_gb_s = row.bytes_moved / seconds / 1e9 if seconds > 0 else None

    return replay


def add_fp8_ratios(rows: Sequence[DecodeMeasurement]) -> None:
    """Each fp8-cache row's ``vs_16bit_cache``: the 16-bit cache's median (same layout and case) over its
    own, i.e. its tokens/s over the 16-bit cache's."""
    medians = {(row.impl, row.case): row.median_ms for row in rows}
    for row in rows:
        sixteen = medians.get((FP8_IMPLS.get(row.impl), row.case))
        if row.median_ms and sixteen:
            row.vs_16bit_cache = sixteen / row.median_ms


def predictor(settings: DecodeSettings, gpu) -> Callable[[DecodeMeasurement], Any] | None:
    """Row -> the calibrated prediction of one decode step: llm-speed's split-KV kernel (dense or paged
    cache alike: pages are whole rows; an fp8 cache at 1 byte per element, uncalibrated) or SDPA's default
    backend over the dense cache."""
    if gpu is None:
        return None
    from llm_speed.perf.predict import predict

    def predict_row(row: DecodeMeasurement):
        implementation = "vendor" if row.impl == "sdpa" else "llm-speed"
        fp8 = {"kv_dtype": "fp8"} if row.impl in FP8_IMPLS else {}
        return predict(
            "attention_kvcache_fwd", report.prediction_gpu_id(gpu), implementation=implementation,
            batch=row.batch, heads_q=settings.num_heads, heads_kv=settings.num_kv_heads, seq_q=1,
            seq_kv=row.context, head_dim=settings.head_dim, dtype=settings.dtype, **fp8,
        )  # fmt: skip

    return predict_row


def results_payload(settings: DecodeSettings, rows: Sequence[DecodeMeasurement]) -> dict[str, Any]:
    """The JSON document: provenance, settings, notes and every row."""
    return report.results_document(
        "decode",
        settings,
        rows,
        lambda row: f"{row.batch}x{settings.num_heads}x{row.context}x{settings.head_dim}",
        TRITON_IMPLS,
    )


def print_decode(settings: DecodeSettings, rows: Sequence[DecodeMeasurement], console: Console) -> None:
    """One table of every row that ran (GB/s and % of the HBM peak first), then what did not run."""
    device = torch.device(settings.device)
    caption = (
        f"Config: heads={settings.num_heads}, kv_heads={settings.num_kv_heads}, "
        f"head_dim={settings.head_dim}, dtype={report.TORCH_DTYPES[settings.dtype]}, "
        f"page_size={settings.page_size}, fp8 rows: e4m3 cache, one new token, "
        f"device={report.environment_device_name(device)}"
    )
    table = [
        [
            row.batch,
            row.context,
            row.impl,
            report.hbm_peak_cell(row),
            report.ratio_cell(row.vs_16bit_cache),
            report.ratio_cell(row.vs_sdpa),
            f"{row.graph_ms:.4g}" if row.graph_ms is not None else None,
            report.ratio_cell(row.graph_vs_sdpa),
            *report.common_cells(row),
        ]
        for row in rows
        if row.available
    ]
    report.print_rows(
        "Decode over a KV cache",
        [
            "batch",
            "context",
            "impl",
            "% HBM peak",
            "tokens/s vs 16-bit cache",
            "vs SDPA",
            "graph ms",
            "graph vs SDPA",
            *report.COMMON_COLUMNS,
        ],
        table,
        caption=caption,
        console=console,
    )
    report.print_unavailable(rows, console)
    for note in report.timing_notes(device, TRITON_IMPLS, rows):
        console.print(f"note: {note}", highlight=False, markup=False)
    if rows and rows[0].prediction_reason:
        console.print(f"note: {rows[0].prediction_reason}", highlight=False, markup=False)


def decode_settings(args: argparse.Namespace, device: torch.device) -> DecodeSettings:
    """Settings from parsed flags, defaults filled for the device."""
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    settings = DecodeSettings(
        batch_sizes=tuple(pick("batch_sizes")),
        contexts=tuple(pick("contexts")),
        num_heads=pick("num_heads"),
        num_kv_heads=pick("num_kv_heads"),
        head_dim=pick("head_dim"),
        dtype=pick("dtype"),
        page_size=pick("page_size"),
        impls=tuple(args.impl or IMPLS),
        warmup=pick("warmup"),
        iterations=pick("iterations"),
        device=str(device),
        graph=not args.no_graph,
    )
    check_settings(settings)
    return settings
