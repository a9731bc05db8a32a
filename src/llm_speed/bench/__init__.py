"""Benchmarks: timing helpers, the attention and GEMM benchmark harnesses, and the ``bench`` command.

The timing helpers are loaded on first use (PEP 562), so building the ``llm-speed`` parser imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PeakMemory", "Timing", "measure", "peak_memory"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("llm_speed.bench.timing"), name)
    raise AttributeError(f"module 'llm_speed.bench' has no attribute {name!r}")
