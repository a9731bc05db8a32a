"""The GEMM family in Triton: ``gemm`` (fused epilogue, autograd), ``tensor_core_gemm``,
``tensor_core_gemm_int8``.

Layout: ``kernels.py`` (Triton kernels), ``configs.py`` (block configurations per architecture),
``ops.py`` (launchers, torch.library ops, autograd, public functions), ``reference.py`` (plain PyTorch),
``validation.py`` (argument checks). Design notes: docs/gemm.md.
"""

from llm_speed.matmul.ops import (
    fp32_input_precision,
    gemm,
    launch_gemm,
    tensor_core_gemm,
    tensor_core_gemm_int8,
)
from llm_speed.matmul.reference import gemm_int8_reference, gemm_reference
from llm_speed.matmul.validation import GemmShape, validate_gemm_inputs

__all__ = [
    "GemmShape",
    "fp32_input_precision",
    "gemm",
    "gemm_int8_reference",
    "gemm_reference",
    "launch_gemm",
    "tensor_core_gemm",
    "tensor_core_gemm_int8",
    "validate_gemm_inputs",
]
