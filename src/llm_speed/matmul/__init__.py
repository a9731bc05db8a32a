"""The GEMM family in Triton: ``gemm`` (fused epilogue, autograd), ``tensor_core_gemm``,
``tensor_core_gemm_int8``.

Layout: the GEMM by role, ``gemm_kernels.py`` (the kernels), ``gemm_configs.py`` (tiers and the tile
choice), ``gemm_launch.py`` (recipes, plans, launch, the implementations) and ``gemm.py`` (torch.library ops,
autograd, public functions); ``checks.py`` (argument checks), ``reference.py`` (plain PyTorch), ``fp8.py``.
Design notes: docs/gemm.md.

The package's ``gemm`` attribute is the function (``llm_speed.gemm`` reads it from here), which hides the
submodule of the same name from attribute access: reach the module with
``from llm_speed.matmul.gemm import ...`` or ``importlib.import_module("llm_speed.matmul.gemm")``.
"""

from llm_speed.matmul.checks import GemmShape, validate_gemm_inputs
from llm_speed.matmul.gemm import (
    fp32_input_precision,
    gemm,
    gemm_config,
    launch_gemm,
    tensor_core_gemm,
    tensor_core_gemm_int8,
)
from llm_speed.matmul.reference import gemm_int8_reference, gemm_reference

__all__ = [
    "GemmShape",
    "fp32_input_precision",
    "gemm",
    "gemm_config",
    "gemm_int8_reference",
    "gemm_reference",
    "launch_gemm",
    "tensor_core_gemm",
    "tensor_core_gemm_int8",
    "validate_gemm_inputs",
]
