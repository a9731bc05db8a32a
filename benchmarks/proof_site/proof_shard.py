"""A pytest plugin (``-p proof_shard``) for ``benchmarks/proof_correctness.py``: with
LLM_SPEED_PROOF_SHARD=i/n a run keeps the i-th of n contiguous slices of the tests its ``-k`` selected
(1-based), so a family's tests spread over n processes, each with its own deadline. Contiguous, not every
n-th: neighbouring tests mostly launch the same kernels, which one process then compiles once. Without the
variable it changes nothing.
"""

from __future__ import annotations

import os

import pytest

VARIABLE = "LLM_SPEED_PROOF_SHARD"


def parse(text: str) -> tuple[int, int]:
    """(i, n) of 'i/n', 1 <= i <= n; ValueError naming the variable otherwise."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"{VARIABLE} must be 'i/n' with integers, got {text!r}") from None
    if not 1 <= index <= count:
        raise ValueError(f"{VARIABLE} must be 'i/n' with 1 <= i <= n, got {text!r}")
    return index, count


def pick(items: list, index: int, count: int) -> list:
    """The i-th of n contiguous slices of ``items`` (sizes differ by at most one; all n: each item once)."""
    size = len(items)
    return items[(index - 1) * size // count : index * size // count]


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected theirs
def pytest_collection_modifyitems(config, items):
    text = os.environ.get(VARIABLE)
    if not text:
        return
    kept = pick(items, *parse(text))
    chosen = {id(item) for item in kept}
    dropped = [item for item in items if id(item) not in chosen]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept
