"""Shared helpers of the GEMM tests: the accuracy rule (``tests/accuracy_rule.py``) for matrix products, and
a recorder of the GEMM launches."""

from __future__ import annotations

import importlib

import torch

from accuracy_rule import FLOAT32_EPS, OUTPUT_FACTOR, assert_error_rule, matmul_cap  # noqa: F401
from llm_speed.matmul.reference import apply_activation, gemm_reference


def torch_same_precision(a, b, *, alpha=1.0, beta=0.0, c=None, trans_a=False, trans_b=False, bias=None,
                         activation=None, out_dtype=None):  # fmt: skip
    """Plain PyTorch at the kernel's own precision: matmul in the input dtype, epilogue in fp32."""
    op_a = a.mT if trans_a else a
    op_b = b.mT if trans_b else b
    z = alpha * torch.matmul(op_a, op_b).float()
    if beta != 0:
        z = z + beta * c.float()
    if bias is not None:
        z = z + bias.float()
    return apply_activation(z, activation).to(out_dtype or a.dtype)


def assert_gemm_accurate(out: torch.Tensor, a, b, *, factor: float = OUTPUT_FACTOR, **kwargs) -> None:
    """The kernel's error vs float64 is at most ``factor`` x PyTorch's same-precision error plus
    :func:`accuracy_rule.matmul_cap` (one output ulp at the result's magnitude plus K fp32 ulps)."""
    assert not out.isnan().any(), "output has NaN (an element was not written, or NaN leaked in)"
    cpu_args = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in kwargs.items()}
    a, b = a.cpu(), b.cpu()
    expected_args = {key: v for key, v in cpu_args.items() if key != "out_dtype"}
    expected = gemm_reference(a, b, out_dtype=torch.float64, **expected_args)
    same_precision = torch_same_precision(a, b, **cpu_args)
    k = a.shape[-2] if kwargs.get("trans_a") else a.shape[-1]
    cap = matmul_cap(out.dtype, expected, k)
    assert_error_rule("gemm", out, same_precision, expected, factor, cap=cap)


def record_gemm_launches(monkeypatch) -> list:
    """(plan, per-call arguments) of every ``llm_speed.matmul.gemm`` launch from here on: each recipe's plan
    gets its launch wrapped (call ``launch.clear_plans()`` afterwards, so no later test launches a wrapped
    plan); the kept calls are forgotten first, so the next call of each makes its recipe here."""
    gemm_op = importlib.import_module("llm_speed.matmul.gemm")  # (the package's ``gemm`` is the function)
    gemm_launch = importlib.import_module("llm_speed.matmul.gemm_launch")
    launches = []
    recipe_of = gemm_launch._recipe_of

    def recording(*args):
        recipe = recipe_of(*args)
        plan, _ = recipe.arguments(*(None,) * 7)
        original = plan.launch

        def launch(**per_call):
            launches.append((plan, per_call))
            original(**per_call)

        plan.launch = launch
        return recipe

    monkeypatch.setattr(gemm_launch, "_recipe_of", recording)
    gemm_op._GEMM_CALLS.clear()
    return launches
