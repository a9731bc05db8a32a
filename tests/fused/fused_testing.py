"""Shared tools for the fused-op tests: the float64 2x/3x error rule, NaN-poisoned outputs, launch proof."""

from __future__ import annotations

import contextlib

import torch

from llm_speed import _runtime
from llm_speed.fused import _common

# Fixed error cap added to the 2x/3x rule: about one unit of rounding at 1.0 in the kernel's dtype.
ERROR_CAP = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
OUTPUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def max_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    x, truth = x.detach().cpu().double(), truth.detach().cpu().double()
    assert x.shape == truth.shape, (x.shape, truth.shape)
    assert torch.isfinite(x).all(), "non-finite value in the result"
    return (x - truth).abs().max().item() if x.numel() else 0.0


def assert_error_rule(name, kernel, same_precision, truth, factor, dtype, scale=1.0):
    """kernel error <= factor * (same-precision PyTorch error) + cap * scale, against the float64 truth.

    ``scale`` is the magnitude of the values compared (the cap is one rounding unit at that magnitude)."""
    err_kernel = max_error(kernel, truth)
    err_torch = max_error(same_precision, truth)
    bound = factor * err_torch + ERROR_CAP[dtype] * scale
    assert err_kernel <= bound, f"{name}: error {err_kernel:.3e} > {factor} x {err_torch:.3e} + cap"


def nan_poisoned_outputs(monkeypatch):
    """Make every fused kernel output start as NaN, so an element a kernel forgets to write shows."""

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    monkeypatch.setattr(_common, "new_output", poisoned)


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
