"""Shared tools for the fused-op tests: the float64 2x/3x error rule with a scaled cap, launch proof."""

from __future__ import annotations

import torch

import accuracy_rule
from accuracy_rule import GRAD_FACTOR, OUTPUT_FACTOR, expect_launches  # noqa: F401 - re-exported to the tests

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def assert_error_rule(name, kernel, same_precision, truth, factor, dtype, scale=1.0):
    """The suite's rule (tests/accuracy_rule.py) with its cap scaled by ``scale``, the magnitude of the
    values compared (the cap is one rounding unit at that magnitude)."""
    accuracy_rule.assert_error_rule(
        name, kernel, same_precision, truth, factor, cap=accuracy_rule.ERROR_CAP[dtype] * scale
    )


def leaves(*tensors, dtype=None):
    """Detached leaf copies that require grad (floating ones), optionally cast to ``dtype`` on the CPU."""
    out = []
    for t in tensors:
        t = t.detach().clone()
        if dtype is not None:
            t = t.cpu().to(dtype)
        out.append(t.requires_grad_() if t.is_floating_point() else t)
    return out
