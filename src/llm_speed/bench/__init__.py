"""Benchmarks: timing helpers, the attention and GEMM benchmark harnesses, and the ``bench`` command."""

from llm_speed.bench.timing import PeakMemory, Timing, measure, peak_memory

__all__ = ["PeakMemory", "Timing", "measure", "peak_memory"]
