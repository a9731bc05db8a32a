"""The accuracy rule of every kernel test (attention, GEMM, fused ops), the NaN poisoning of kernel
outputs, and the proof that a Triton kernel ran.

Rule (as PyTorch's test/test_transformers.py and flash-attention's tests/test_flash_attn.py test fused
attention): against a float64 truth,
the kernel's error is at most ``factor`` times the error of plain PyTorch in the kernel's own precision
(2 for outputs, 3 for gradients), plus a small fixed cap. Infinities must match exactly, and a value the
truth has finite must be finite.
"""

from __future__ import annotations

import contextlib

import torch

from llm_speed.core import runtime

OUTPUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
# Fixed cap added to the rule: about one unit of rounding at 1.0 in the kernel's dtype, so a same-precision
# reference that happens to be almost exact does not demand more than the dtype can hold.
ERROR_CAP = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
FLOAT32_EPS = torch.finfo(torch.float32).eps


def max_error(x: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest |x - truth| over the finite entries of truth; infinities and NaN must agree with it."""
    x, truth = x.detach().cpu().double(), truth.detach().cpu().double()
    assert x.shape == truth.shape, (x.shape, truth.shape)
    assert torch.equal(torch.isinf(truth), torch.isinf(x) & (x == truth)), "inf pattern differs"
    finite = torch.isfinite(truth)
    assert torch.isfinite(x[finite]).all(), "non-finite value where the reference is finite"
    return (x[finite] - truth[finite]).abs().max().item() if finite.any() else 0.0


def assert_error_rule(name, kernel, same_precision, truth, factor, dtype=None, *, cap=None) -> None:
    """kernel error <= factor * (same-precision PyTorch error) + cap, all against the float64 ``truth``.

    ``cap`` defaults to :data:`ERROR_CAP` of ``dtype``.
    """
    cap = ERROR_CAP[dtype] if cap is None else cap
    err_kernel = max_error(kernel, truth)
    err_torch = max_error(same_precision, truth)
    bound = factor * err_torch + cap
    assert err_kernel <= bound, f"{name}: error {err_kernel:.3e} > {factor} x {err_torch:.3e} + {cap:.3e}"


def matmul_cap(out_dtype: torch.dtype, truth: torch.Tensor, k: int) -> float:
    """The cap of a matrix product: one output ulp at the result's magnitude plus K fp32 ulps (the sum)."""
    magnitude = truth.abs().max().item() if truth.numel() else 0.0
    return torch.finfo(out_dtype).eps * magnitude + k * FLOAT32_EPS


def nan_poisoned_outputs(monkeypatch) -> None:
    """Make every attention, GEMM and fused-op kernel output start as NaN, so an element a kernel forgets to
    write fails the test (the launchers allocate through their module's ``new_output``)."""
    from llm_speed.core import tensors

    def poisoned(shape, dtype, device):
        if dtype.is_floating_point:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        # integer outputs (int8 GEMM's int32) have no NaN: a value no exact product of the tests reaches
        return torch.full(shape, torch.iinfo(dtype).min, dtype=dtype, device=device)

    monkeypatch.setattr(tensors, "new_output", poisoned)


@contextlib.contextmanager
def expect_launches(*kernel_names, device, only: bool = False):
    """Assert each named Triton kernel ran inside the block (with ``only``, and no other kernel), when
    Triton can run on ``device``."""
    before = runtime.launch_counts()
    yield
    if runtime.triton_runs_on(device):
        ran = runtime.launch_counts() - before
        for name in kernel_names:
            assert ran[name] > 0, f"Triton kernel {name} did not run"
        if only:
            assert set(ran) == set(kernel_names), f"expected only {sorted(set(kernel_names))} to run: {ran}"
