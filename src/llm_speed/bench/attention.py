"""The attention benchmark: llm-speed's flash, tiled and naive kernels against torch SDPA (each backend on its
own) and the ``flash_attn`` package, on one device, with the performance model's prediction beside each row.
``flash-fp8`` is llm-speed's fp8 forward (e4m3 q, k, v quantized per tensor from the same random draws,
bfloat16 output) whatever ``--dtype``; its ``vs_flash`` is its speed over the ``flash`` row of the same case
(issue 35's H100 target: >= 1.4x at d=128, 16k tokens).

SDPA's ``is_causal`` aligns the mask top-left and llm-speed's bottom-right; the two agree when
seq_q == seq_kv, which is the only case benchmarked here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from rich.console import Console

from llm_speed._output import print_table
from llm_speed.bench import report
from llm_speed.bench.options import ATTENTION_DTYPES as DTYPES
from llm_speed.bench.options import ATTENTION_FP8_IMPL as FP8_IMPL
from llm_speed.bench.options import ATTENTION_IMPLS as IMPLS
from llm_speed.bench.options import ATTENTION_LLM_SPEED_IMPLS as LLM_SPEED_IMPLS
from llm_speed.bench.options import ATTENTION_MODES as MODES
from llm_speed.bench.options import ATTENTION_TRITON_IMPLS as TRITON_IMPLS
from llm_speed.bench.report import Measurement
from llm_speed.ops import ATTENTION_SCORE_DTYPES as SCORE_DTYPES

SDPA_BACKENDS = {
    "sdpa-flash": "FLASH_ATTENTION",
    "sdpa-efficient": "EFFICIENT_ATTENTION",
    "sdpa-cudnn": "CUDNN_ATTENTION",
    "sdpa-math": "MATH",
}
# "sdpa" (in IMPLS, from the op table) lets torch pick the backend, as a user calling
# F.scaled_dot_product_attention gets.

# The performance model's traffic class for each implementation (kernel_costs.attention_cost's ``impl``):
# fused kernels keep scores on chip like flash; the math backend materialises them like naive. Plain "sdpa" is
# costed as fused because torch picks a fused backend whenever one accepts the inputs; when it falls back to
# math (e.g. fp32 on some GPUs) the measured/model column shows a large gap.
COST_CLASS = {
    "flash": "flash",
    "flash-fp8": "flash",
    "tiled": "tiled",
    "naive": "naive",
    "sdpa": "flash",
    "sdpa-flash": "flash",
    "sdpa-efficient": "flash",
    "sdpa-cudnn": "flash",
    "sdpa-math": "naive",
    "flash_attn": "flash",
}


@dataclasses.dataclass(frozen=True)
class AttentionSettings:
    """One attention benchmark run: shapes, dtype, what to time and how often."""

    seq_lengths: tuple[int, ...]
    batch_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    mode: str
    impls: tuple[str, ...]
    warmup: int
    iterations: int
    device: str
    min_time_s: float = 0.0  # keep timing each row until its runs add up to this (see bench.timing)


# Defaults: the old benchmark scripts' configuration on a GPU; shapes small enough for a CPU (and Triton's
# interpreter).
GPU_DEFAULTS = {
    "seq_lengths": (512, 1024, 2048, 4096, 8192),
    "batch_size": 2,
    "num_heads": 8,
    "head_dim": 64,
    "dtype": "fp16",
    "warmup": 10,
    "iterations": 50,
    "min_time": 0.2,
}
CPU_DEFAULTS = {
    "seq_lengths": (64, 128),
    "batch_size": 1,
    "num_heads": 2,
    "head_dim": 32,
    "dtype": "fp32",
    "warmup": 1,
    "iterations": 5,
    "min_time": 0.5,
}


@dataclasses.dataclass(kw_only=True)
class AttentionMeasurement(Measurement):
    """A :class:`Measurement` of one attention implementation at one sequence length."""

    seq_len: int
    memory_saved_vs_naive_bytes: int | None = None  # naive's peak minus this one's (CUDA, when naive ran)
    vs_flash: float | None = None  # fp8 rows: the flash row's median over this one's (same case)
    RATIO_FIELDS: ClassVar[tuple[str, ...]] = (*Measurement.RATIO_FIELDS, "vs_flash")


def check_settings(settings: AttentionSettings) -> None:
    """ValueError naming the setting when a value is out of range."""
    report.check_counts(settings, "batch_size", "num_heads", "num_kv_heads", "head_dim")
    report.check_lengths(settings, "seq_lengths")
    report.check_kv_heads(settings)
    report.check_choice("dtype", settings.dtype, DTYPES)
    report.check_choice("mode", settings.mode, MODES)
    report.check_choices("impl", settings.impls, IMPLS)


def _forward(impl: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Callable[[], Any]:
    """A no-argument function computing attention with ``impl`` on [B, H, S, D] inputs."""
    if impl == FP8_IMPL:
        import llm_speed

        # per-tensor e4m3 (quantize_fp8's scale is the descale), made before timing starts
        (q8, dq), (k8, dk), (v8, dv) = (llm_speed.quantize_fp8(x.reshape(-1, x.shape[-1])) for x in (q, k, v))
        q8, k8, v8 = q8.view(q.shape), k8.view(k.shape), v8.view(v.shape)
        return lambda: llm_speed.flash_attention(q8, k8, v8, is_causal=causal, descale_q=dq, descale_k=dk,
                                                 descale_v=dv)  # fmt: skip
    if impl in LLM_SPEED_IMPLS:
        import llm_speed

        function = getattr(llm_speed, f"{impl}_attention")
        return lambda: function(q, k, v, is_causal=causal)
    if impl == "sdpa" or impl in SDPA_BACKENDS:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        if k.shape[1] != q.shape[1]:
            return lambda: sdpa(q, k, v, is_causal=causal, enable_gqa=True)
        return lambda: sdpa(q, k, v, is_causal=causal)
    if impl == "flash_attn":
        from flash_attn import flash_attn_func

        # flash_attn takes [B, S, H, D]; the transposed views keep the last dim contiguous, as it requires.
        q_t, k_t, v_t = (x.transpose(1, 2) for x in (q, k, v))
        return lambda: flash_attn_func(q_t, k_t, v_t, causal=causal)
    raise ValueError(f"impl: unknown {impl!r}; accepted: {', '.join(IMPLS)}")


def _backend_context(impl: str) -> Callable[[], contextlib.AbstractContextManager]:
    """The SDPA backend restriction for ``impl`` (none for the others)."""
    if impl not in SDPA_BACKENDS:
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, SDPA_BACKENDS[impl])
    return lambda: sdpa_kernel(backend)


def _workload_builder(impl: str, settings: AttentionSettings, seq_len: int, device: torch.device):
    """A function that makes the inputs and returns the no-argument function to time for ``settings.mode``."""

    def build() -> Callable[[], Any]:
        dtype = report.TORCH_DTYPES[settings.dtype]
        needs_grad = settings.mode != "fwd"
        shape_q = (settings.batch_size, settings.num_heads, seq_len, settings.head_dim)
        shape_kv = (settings.batch_size, settings.num_kv_heads, seq_len, settings.head_dim)
        q = torch.randn(shape_q, device=device, dtype=dtype, requires_grad=needs_grad)
        k = torch.randn(shape_kv, device=device, dtype=dtype, requires_grad=needs_grad)
        v = torch.randn(shape_kv, device=device, dtype=dtype, requires_grad=needs_grad)
        forward = _forward(impl, q, k, v, settings.causal)
        if settings.mode == "fwd":
            return forward
        inputs = (q, k, v)
        if settings.mode == "bwd":
            # Time the backward alone: one forward now, its graph kept for every timed backward.
            out = forward()
            grad_out = torch.randn_like(out)
            return lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
        with torch.no_grad():
            grad_out = torch.randn_like(forward())
        return lambda: torch.autograd.grad(forward(), inputs, grad_out)

    return build


def refusal_on_every_device(impl: str, settings: AttentionSettings) -> str | None:
    """Why ``impl`` cannot run in these settings on any device, a GPU's included, or None."""
    if impl == FP8_IMPL and settings.mode != "fwd":
        return "fp8 attention is forward-only (as FlashAttention-3's)"
    if impl == "flash_attn" and settings.dtype == "fp32":
        return "flash_attn supports fp16 and bf16 only"
    return None


def refused_everywhere(impl: str, settings: AttentionSettings) -> bool:
    """Whether ``impl`` cannot run in these settings on any device (:func:`refusal_on_every_device`): a CPU
    run's plot draws no GPU prediction of it."""
    return refusal_on_every_device(impl, settings) is not None


def unavailable_reason(impl: str, device: torch.device, settings: AttentionSettings) -> str | None:
    """Why ``impl`` cannot run here at all (before trying), or None."""
    if impl == "flash_attn":
        if importlib.util.find_spec("flash_attn") is None:
            return "the flash_attn package is not installed"
        if device.type != "cuda":
            return "flash_attn runs on CUDA devices only"
    if impl == "sdpa-cudnn" and device.type != "cuda":
        return "SDPA's cuDNN backend runs on CUDA devices only"
    if impl == "sdpa-efficient" and device.type != "cuda":  # PyTorch has no CPU build of it
        return "SDPA's memory-efficient backend runs on CUDA devices only"
    return refusal_on_every_device(impl, settings)


def fill_memory_saved(case_rows: Sequence[AttentionMeasurement]) -> None:
    """Memory saved vs naive for the rows of one case: naive's peak minus each row's, where both were
    measured (CUDA only; on a CPU, or when naive did not run, it stays None)."""
    naive = next((r for r in case_rows if r.impl == "naive" and r.peak_memory_bytes is not None), None)
    if naive is None:
        return
    for row in case_rows:
        if row.peak_memory_bytes is not None:
            row.memory_saved_vs_naive_bytes = naive.peak_memory_bytes - row.peak_memory_bytes


def run_attention(
    settings: AttentionSettings,
    *,
    show_progress: bool = True,
    on_case: Callable[[list[AttentionMeasurement]], None] | None = None,
) -> list[AttentionMeasurement]:
    """Measure every implementation in ``settings.impls`` at every sequence length.

    ``on_case(rows_so_far)`` is called after each sequence length (the commands write partial results there,
    so an interrupted run keeps what it measured).
    """
    from llm_speed.perf.kernel_costs import attention_cost

    check_settings(settings)
    device = torch.device(settings.device)
    rows: list[AttentionMeasurement] = []
    total = len(settings.seq_lengths) * len(settings.impls)
    progress = report.progress(total, "attention") if show_progress else contextlib.nullcontext(None)
    with progress as advance:
        for seq_len in settings.seq_lengths:
            case_rows = []
            for impl in settings.impls:
                cost = attention_cost(
                    settings.batch_size,
                    settings.num_heads,
                    seq_len,
                    seq_len,
                    settings.head_dim,
                    heads_kv=settings.num_kv_heads,
                    dtype="fp8" if impl == FP8_IMPL else settings.dtype,
                    causal=settings.causal,
                    mode=settings.mode,
                    impl=COST_CLASS[impl],
                    score_dtype=SCORE_DTYPES.get(impl),
                    out_dtype="bf16" if impl == FP8_IMPL else None,
                )
                row = AttentionMeasurement(
                    case=f"seq={seq_len}",
                    impl=impl,
                    dtype="fp8" if impl == FP8_IMPL else settings.dtype,  # the dtype of its cost above
                    available=False,
                    seq_len=seq_len,
                    flops=cost.flops,
                    bytes_moved=cost.bytes_moved,
                    refused_everywhere=refused_everywhere(impl, settings),
                )
                reason = unavailable_reason(impl, device, settings)
                if reason is not None:
                    row.reason = reason
                else:
                    report.run_measurement(
                        row,
                        _workload_builder(impl, settings, seq_len, device),
                        device=device,
                        warmup=settings.warmup,
                        iterations=settings.iterations,
                        min_time_s=settings.min_time_s,
                        context=_backend_context(impl),
                    )
                case_rows.append(row)
                if advance is not None:
                    advance(f"seq={seq_len} {impl}")
            fill_memory_saved(case_rows)
            rows.extend(case_rows)
            if on_case is not None:
                on_case(rows)
    gpu, reason = report.prediction_gpu(device)
    report.add_comparisons(rows, gpu, settings.dtype, reason, predictor(settings, gpu))
    add_fp8_ratios(rows)
    return rows


def add_fp8_ratios(rows: Sequence[AttentionMeasurement]) -> None:
    """Each fp8 row's ``vs_flash``: the 16-bit flash row's median (same case) over its own."""
    medians = {(row.impl, row.case): row.median_ms for row in rows}
    for row in rows:
        flash = medians.get(("flash", row.case))
        if row.impl == FP8_IMPL and row.median_ms and flash:
            row.vs_flash = flash / row.median_ms


# The implementation name of each --impl in llm_speed.perf.predict (flash_attn: FlashAttention-2 itself,
# modelled by SDPA's FlashAttention-2 backend). None: not predicted.
PREDICTED_AS = {
    "flash": ("flash_attention", "llm-speed"),
    "tiled": ("tiled_attention", "llm-speed"),
    "naive": ("naive_attention", "llm-speed"),
    "sdpa": ("flash_attention", "vendor"),
    "sdpa-flash": ("flash_attention", "sdpa-flash"),
    "sdpa-efficient": ("flash_attention", "sdpa-efficient"),
    "sdpa-cudnn": ("flash_attention", "sdpa-cudnn"),
    "flash_attn": ("flash_attention", "sdpa-flash"),
    "flash-fp8": ("flash_attention_fp8", "llm-speed"),  # uncalibrated: never measured
}


def predictor(settings: AttentionSettings, gpu) -> Callable[[AttentionMeasurement], Any] | None:
    """Row -> the calibrated prediction of its implementation at its sequence length on ``gpu`` (fwd+bwd:
    the two added; the backward of tiled and naive rows is flash's kernels)."""
    if gpu is None:
        return None
    from llm_speed.perf.predict import predict

    def predict_row(row: AttentionMeasurement):
        if row.impl not in PREDICTED_AS:
            return None
        op, implementation = PREDICTED_AS[row.impl]
        fp8 = row.impl == FP8_IMPL
        if fp8 and settings.mode != "fwd":  # forward only: the row did not run
            return None
        problem = dict(
            batch=settings.batch_size, heads_q=settings.num_heads, heads_kv=settings.num_kv_heads,
            seq_q=row.seq_len, seq_kv=row.seq_len, head_dim=settings.head_dim,
            dtype="fp8" if fp8 else settings.dtype, causal=settings.causal,
        )  # fmt: skip
        backward_op = "flash_attention_backward"
        ops = {"fwd": [op], "bwd": [backward_op], "fwd+bwd": [op, backward_op]}[settings.mode]
        predictions = [predict(name, report.prediction_gpu_id(gpu), implementation=implementation, **problem)
                       for name in ops]  # fmt: skip
        return _sum_predictions(predictions)

    return predict_row


def _sum_predictions(predictions):
    """One prediction standing for calls made one after the other (times add; the longer names the bound)."""
    if len(predictions) == 1:
        return predictions[0]
    import dataclasses as _dc

    longest = max(predictions, key=lambda p: p.seconds)
    return _dc.replace(longest, seconds=sum(p.seconds for p in predictions),
                       calibrated=all(p.calibrated for p in predictions))  # fmt: skip


def results_payload(settings: AttentionSettings, rows: Sequence[AttentionMeasurement]) -> dict[str, Any]:
    """The JSON document: provenance, settings, notes and every row (also with the old scripts' names)."""
    return report.results_document(
        "attention",
        settings,
        rows,
        lambda row: f"{settings.batch_size}x{settings.num_heads}x{row.seq_len}x{settings.head_dim}",
        TRITON_IMPLS,
    )


def print_attention(
    settings: AttentionSettings, rows: Sequence[AttentionMeasurement], console: Console
) -> None:
    """The old scripts' summary table (when PyTorch SDPA and flash both ran), then the full table."""
    device = torch.device(settings.device)
    config = (
        f"Config: batch={settings.batch_size}, heads={settings.num_heads}, kv_heads={settings.num_kv_heads}, "
        f"head_dim={settings.head_dim}, dtype={report.TORCH_DTYPES[settings.dtype]}, "
        f"causal={settings.causal}, mode={settings.mode}, device={report.environment_device_name(device)}"
    )
    by_key = {(r.seq_len, r.impl): r for r in rows}
    short_rows = []
    for seq_len in settings.seq_lengths:
        torch_row, flash_row = by_key.get((seq_len, "sdpa")), by_key.get((seq_len, "flash"))
        if torch_row is None or flash_row is None or None in (torch_row.median_ms, flash_row.median_ms):
            continue
        saved = None
        if torch_row.peak_memory_bytes is not None and flash_row.peak_memory_bytes is not None:
            saved = f"{(torch_row.peak_memory_bytes - flash_row.peak_memory_bytes) / report.MIB:.1f}MB"
        speedup = None  # withheld (a busy CPU: llm_speed.bench.cpu_load) when the full table has none
        if flash_row.speedup_vs_fastest_other is not None:
            interval = report.ratio_range(torch_row.timing, flash_row.timing)
            speedup = report.ratio_text(torch_row.median_ms / flash_row.median_ms, interval)
        short_rows.append([seq_len, torch_row.median_ms, flash_row.median_ms, speedup, saved])
    if short_rows:
        print_table(
            "ATTENTION BENCHMARK RESULTS",
            ["Seq len", "PyTorch(ms)", "Flash(ms)", "Speedup [range]", "Memory saved"],
            short_rows,
            caption=config,
            console=console,
        )
    full_rows = [
        [row.seq_len, row.impl, *report.common_cells(row), report.mib(row.memory_saved_vs_naive_bytes),
         report.ratio_cell(row.vs_flash)]
        for row in rows
        if row.available
    ]  # fmt: skip
    report.print_rows(
        "Attention: every implementation",
        ["seq", "impl", *report.COMMON_COLUMNS, "saved vs naive MiB", "fp8 vs flash"],
        full_rows,
        caption=config,
        console=console,
    )
    report.print_unavailable(rows, console)
    for note in report.timing_notes(device, TRITON_IMPLS, rows):
        console.print(f"note: {note}", highlight=False, markup=False)
    if rows and rows[0].prediction_reason:
        console.print(f"note: {rows[0].prediction_reason}", highlight=False, markup=False)
