"""Benchmarks on a CPU: scale problems that would take minutes per call, and estimate the run time first.

GPU-sized problems on a CPU take hours: Triton's interpreter runs a kernel at roughly 0.02-0.1 GFLOP/s
(measured on a 2-core machine: a 256^3 fp32 GEMM in 0.25 s, causal attention at seq 512 in 0.9 s), so
``bench attention --seq-lengths 4096 --head-dim 128 --mode fwd+bwd`` would run for more than an hour. On a CPU
the commands halve the largest dimension until one call fits :data:`CALL_FLOP_BUDGET` (about a second),
print what they changed, and print the estimated run time before starting. ``--full-size`` keeps the sizes.
"""

from __future__ import annotations

import dataclasses
import math

from llm_speed.bench.attention import COST_CLASS, SCORE_DTYPES, AttentionSettings
from llm_speed.bench.gemm import GemmCase, GemmSettings
from llm_speed.bench.options import ATTENTION_TRITON_IMPLS, GEMM_TRITON_IMPLS
from llm_speed.core.runtime import INTERPRETED

# Throughput assumed for the estimate: the interpreter's (measured as above, rounded down) for the Triton
# kernels, PyTorch's CPU kernels on a few cores for everything else (and for llm-speed's CPU fallbacks). CPU
# attention is ten times slower than a CPU GEMM (measured on 2 cores: bf16 fwd+bwd at seq 2048, head_dim 128,
# about 0.5 GFLOP/s across the implementations; a bf16 GEMM of 1024x2048x2048 about 10 GFLOP/s), and an fp16
# GEMM fifty times slower than that (PyTorch has no fast fp16 CPU matmul: 0.24 GFLOP/s at the same size).
INTERPRETER_FLOP_S = 5e7
TORCH_CPU_FLOP_S = {"gemm": 1e10, "attention": 5e8, "gemm fp16": 2e8}
# One call of the slowest implementation should take about a second at those rates.
CALL_SECONDS = 1.0
# The smallest size a dimension is scaled to (tl.dot's smallest tile side).
MIN_SIZE = 16
TRITON_IMPLS = (*ATTENTION_TRITON_IMPLS, *GEMM_TRITON_IMPLS)


def _flop_rate(impls: tuple[str, ...], kind: str) -> float:
    """The throughput of the slowest implementation in ``impls`` here; ``kind`` is "gemm", "gemm fp16" or
    "attention"."""
    interpreted = INTERPRETED and any(impl in TRITON_IMPLS for impl in impls)
    return INTERPRETER_FLOP_S if interpreted else TORCH_CPU_FLOP_S[kind]


def _gemm_kind(settings: GemmSettings) -> str:
    return "gemm fp16" if settings.dtype == "fp16" else "gemm"


def call_flop_budget(impls: tuple[str, ...], kind: str) -> float:
    """The FLOPs one call may take on this CPU: about :data:`CALL_SECONDS` of the slowest implementation."""
    return CALL_SECONDS * _flop_rate(impls, kind)


def _halved(size: int) -> int:
    """Half of ``size``, rounded down to a multiple of 16, at least :data:`MIN_SIZE`."""
    return max(MIN_SIZE, size // 2 // MIN_SIZE * MIN_SIZE)


def estimate_seconds(call_flops: list[float], impls: tuple[str, ...], settings, kind: str) -> float:
    """Estimated run time: per case and implementation, warm-up plus timed runs (at least ``min_time_s``),
    at the slowest implementation's throughput (an upper estimate for the faster ones)."""
    rate = _flop_rate(impls, kind)
    total = 0.0
    for flops in call_flops:
        call = flops / rate
        timed = max(settings.iterations * call, settings.min_time_s)
        # + the availability check and the peak-memory run
        total += len(impls) * (settings.warmup * call + timed + 2 * call)
    return total


def _attention_flops(settings: AttentionSettings, seq_len: int) -> float:
    from llm_speed.perf.kernel_costs import attention_cost

    return max(
        attention_cost(
            settings.batch_size, settings.num_heads, seq_len, seq_len, settings.head_dim,
            heads_kv=settings.num_kv_heads, dtype=settings.dtype, causal=settings.causal, mode=settings.mode,
            impl=COST_CLASS[impl], score_dtype=SCORE_DTYPES.get(impl),
        ).flops
        for impl in settings.impls
    )  # fmt: skip


def scale_attention(settings: AttentionSettings) -> tuple[AttentionSettings, list[str]]:
    """Sequence lengths halved until one call fits the CPU budget (then the heads, when the shortest length
    is not enough); the notes say what changed."""
    budget = call_flop_budget(settings.impls, "attention")
    scaled = []
    for seq_len in settings.seq_lengths:
        new = seq_len
        while new > MIN_SIZE and _attention_flops(settings, new) > budget:
            new = _halved(new)
        scaled.append(new)
    notes = []
    if scaled != list(settings.seq_lengths):
        changes = ", ".join(
            f"{old} -> {new}" for old, new in zip(settings.seq_lengths, scaled, strict=True) if old != new
        )
        notes.append(
            f"CPU run: sequence lengths scaled ({changes}) so one call takes about {CALL_SECONDS:g} s here "
            f"(estimated {_flop_rate(settings.impls, 'attention') / 1e9:g} GFLOP/s); --full-size keeps them"
        )
    scaled_settings = dataclasses.replace(settings, seq_lengths=tuple(dict.fromkeys(scaled)))
    # Still too big at the shortest length: halve the heads, keeping the query heads per K/V head.
    while _attention_flops(scaled_settings, max(scaled)) > budget:
        kv_heads = max(1, scaled_settings.num_kv_heads // 2)
        heads = max(kv_heads, scaled_settings.num_heads // 2 // kv_heads * kv_heads)
        if (heads, kv_heads) == (scaled_settings.num_heads, scaled_settings.num_kv_heads):
            break  # one head of each: nothing left to halve
        scaled_settings = dataclasses.replace(scaled_settings, num_heads=heads, num_kv_heads=kv_heads)
    heads, kv_heads = scaled_settings.num_heads, scaled_settings.num_kv_heads
    if (heads, kv_heads) != (settings.num_heads, settings.num_kv_heads):
        notes.append(
            f"CPU run: heads scaled ({settings.num_heads}/{settings.num_kv_heads} -> {heads}/{kv_heads} "
            "query/key-value heads) as well; --full-size keeps them"
        )
    return scaled_settings, notes


def _scale_gemm_case(case: GemmCase, budget: float) -> GemmCase:
    m, n, k = case.m, case.n, case.k
    while 2.0 * m * n * k > budget and max(m, n, k) > MIN_SIZE:
        largest = max(m, n, k)
        if m == largest:
            m = _halved(m)
        elif n == largest:
            n = _halved(n)
        else:
            k = _halved(k)
    return dataclasses.replace(case, m=m, n=n, k=k)


def scale_gemm(settings: GemmSettings) -> tuple[GemmSettings, list[str]]:
    """GEMM sizes whose largest dimension is halved until one call fits the CPU budget; notes say so."""
    budget = call_flop_budget(settings.impls, _gemm_kind(settings))
    cases = tuple(_scale_gemm_case(case, budget) for case in settings.cases)
    notes = []
    changed = [(old, new) for old, new in zip(settings.cases, cases, strict=True) if old != new]
    if changed:
        changes = ", ".join(
            f"{old.name + ' ' if old.name else ''}{old.m}x{old.n}x{old.k} -> {new.m}x{new.n}x{new.k}"
            for old, new in changed
        )
        notes.append(
            f"CPU run: GEMM sizes scaled ({changes}) so one call takes about {CALL_SECONDS:g} s here "
            f"(estimated {_flop_rate(settings.impls, _gemm_kind(settings)) / 1e9:g} GFLOP/s); "
            "--full-size keeps them"
        )
    # Two sizes scaled to the same one are measured once.
    return dataclasses.replace(settings, cases=tuple(dict.fromkeys(cases))), notes


def attention_estimate(settings: AttentionSettings) -> float:
    """Estimated seconds for an attention benchmark on this CPU."""
    flops = [_attention_flops(settings, seq_len) for seq_len in settings.seq_lengths]
    return estimate_seconds(flops, settings.impls, settings, "attention")


def gemm_estimate(settings: GemmSettings) -> float:
    """Estimated seconds for a GEMM benchmark on this CPU."""
    flops = [2.0 * case.m * case.n * case.k for case in settings.cases]
    return estimate_seconds(flops, settings.impls, settings, _gemm_kind(settings))


def duration_text(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.2 h``."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if math.isfinite(seconds) else "forever"
