"""Shared tools for the fused-op tests: the float64 2x/3x error rule with a scaled cap, launch proof."""

from __future__ import annotations

import contextlib

import torch

import accuracy_rule
from accuracy_rule import GRAD_FACTOR, OUTPUT_FACTOR  # noqa: F401 - re-exported to the tests
from llm_speed import _runtime

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def assert_error_rule(name, kernel, same_precision, truth, factor, dtype, scale=1.0):
    """The suite's rule (tests/accuracy_rule.py) with its cap scaled by ``scale``, the magnitude of the
    values compared (the cap is one rounding unit at that magnitude)."""
    accuracy_rule.assert_error_rule(
        name, kernel, same_precision, truth, factor, cap=accuracy_rule.ERROR_CAP[dtype] * scale
    )


@contextlib.contextmanager
def expect_launches(*kernel_names, device):
    """Assert each named Triton kernel ran inside the block, when Triton can run on ``device``."""
    before = {name: _runtime.launch_count(name) for name in kernel_names}
    yield
    if _runtime.triton_runs_on(device):
        for name in kernel_names:
            assert _runtime.launch_count(name) > before[name], f"Triton kernel {name} did not run"


def leaves(*tensors, dtype=None):
    """Detached leaf copies that require grad (floating ones), optionally cast to ``dtype`` on the CPU."""
    out = []
    for t in tensors:
        t = t.detach().clone()
        if dtype is not None:
            t = t.cpu().to(dtype)
        out.append(t.requires_grad_() if t.is_floating_point() else t)
    return out
