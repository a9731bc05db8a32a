"""``cuda_llm_ops.profiler``: the old project's profiler module, backed by :mod:`llm_speed.profiler`.

``Bottleneck``, ``KernelMetrics`` and ``CUDAProfiler`` are llm_speed's (the old API, with None and a
reason where the old module reported a constant 0). ``benchmark_attention``, ``benchmark_gemm`` and
``print_benchmark_results`` keep the old module's result dictionaries and printout.
"""

from __future__ import annotations

from typing import Any

import torch

from llm_speed.profiler import Bottleneck, CUDAProfiler, KernelMetrics

__all__ = ["Bottleneck", "CUDAProfiler", "KernelMetrics", "benchmark_attention", "benchmark_gemm",
           "print_benchmark_results"]

# The old module's defaults, kept so that calls without arguments measure the same problems.
DEFAULT_SEQ_LENGTHS = (512, 1024, 2048, 4096)
DEFAULT_GEMM_SIZES = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 4096, 4096))
RULE_WIDTH = 60


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.matmul(a, b)


def _bottleneck_value(metrics: KernelMetrics) -> str | None:
    return metrics.bottleneck.value if metrics.bottleneck is not None else None


def benchmark_attention(
    seq_lengths: list[int] | tuple[int, ...] = DEFAULT_SEQ_LENGTHS,
    batch_size: int = 1,
    num_heads: int = 32,
    head_dim: int = 128,
    dtype: torch.dtype = torch.float16,
    *,
    warmup: int = 10,
    iterations: int = 100,
    device: torch.device | str | None = None,
) -> list[dict[str, Any]]:
    """``cuda_llm_ops.flash_attention`` against PyTorch SDPA for each sequence length (the old rows).

    Each row: seq_len, custom_ms, custom_tflops, reference_ms, reference_tflops, speedup (reference time /
    custom time) and bottleneck (None, as everywhere in this profiler, when it cannot be known, e.g. on CPU).
    """
    from cuda_llm_ops import flash_attention

    profiler = CUDAProfiler(device)
    results = []
    for seq_len in seq_lengths:
        common = dict(dtype=dtype, warmup=warmup, iterations=iterations)
        custom = profiler.profile_attention(
            flash_attention, batch_size, num_heads, seq_len, head_dim, **common
        )
        reference = profiler.profile_attention(
            _sdpa, batch_size, num_heads, seq_len, head_dim, name="scaled_dot_product_attention", **common
        )
        results.append({
            "seq_len": seq_len,
            "custom_ms": custom.elapsed_ms,
            "custom_tflops": custom.tflops,
            "reference_ms": reference.elapsed_ms,
            "reference_tflops": reference.tflops,
            "speedup": reference.elapsed_ms / custom.elapsed_ms,
            "bottleneck": _bottleneck_value(custom),
        })
    return results


def benchmark_gemm(
    sizes: list[tuple[int, int, int]] | tuple[tuple[int, int, int], ...] = DEFAULT_GEMM_SIZES,
    dtype: torch.dtype = torch.float16,
    *,
    warmup: int = 10,
    iterations: int = 100,
    device: torch.device | str | None = None,
) -> list[dict[str, Any]]:
    """``cuda_llm_ops.gemm`` against ``torch.matmul`` for each (M, N, K) (the old rows).

    Each row: M, N, K, custom_ms, custom_tflops, reference_ms, reference_tflops, relative_perf (custom
    TFLOP/s / reference TFLOP/s, i.e. reference time / custom time) and bottleneck.
    """
    from cuda_llm_ops import gemm

    profiler = CUDAProfiler(device)
    results = []
    for m, n, k in sizes:
        common = dict(dtype=dtype, warmup=warmup, iterations=iterations)
        custom = profiler.profile_gemm(gemm, m, n, k, **common)
        reference = profiler.profile_gemm(_matmul, m, n, k, name="torch.matmul", **common)
        results.append({
            "M": m,
            "N": n,
            "K": k,
            "custom_ms": custom.elapsed_ms,
            "custom_tflops": custom.tflops,
            "reference_ms": reference.elapsed_ms,
            "reference_tflops": reference.tflops,
            "relative_perf": reference.elapsed_ms / custom.elapsed_ms,
            "bottleneck": _bottleneck_value(custom),
        })
    return results


def print_benchmark_results(results: list[dict[str, Any]], title: str = "Benchmark Results") -> None:
    """Print result rows in the old module's layout: a title rule, then each row with its key figures."""
    print(f"\n{'=' * RULE_WIDTH}")
    print(f"{title:^{RULE_WIDTH}}")
    print(f"{'=' * RULE_WIDTH}")
    for row in results:
        print(f"\nConfiguration: {row}")
        if row.get("speedup") is not None:
            print(f"  Speedup: {row['speedup']:.2f}x")
        if row.get("relative_perf") is not None:
            print(f"  Relative Performance: {row['relative_perf'] * 100:.1f}% of cuBLAS")
        if "bottleneck" in row:
            bottleneck = row["bottleneck"]
            print(f"  Bottleneck: {bottleneck if bottleneck is not None else 'unknown'}")
