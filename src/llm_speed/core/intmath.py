"""Integer helpers of launch grids and tile rules, torch-free: the launchers (:mod:`llm_speed.core.launch`
re-exports them) and the analytic model (:mod:`llm_speed.perf`) share one definition."""

from __future__ import annotations

# PyTorch counts a tensor's bytes in an int64: a tensor past this cannot be made on any device ("Storage size
# calculation overflowed"); the benchmarks and the kernel report refuse such sizes before any work.
MAX_TENSOR_BYTES = 2**63 - 1


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, b > 0."""
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
