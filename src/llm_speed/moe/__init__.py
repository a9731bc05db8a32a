"""Mixture of experts: grouped GEMM, routing, and the fused MoE layer, forward and backward (docs/moe.md).

- :func:`grouped_gemm`: rows grouped by cumulative ``offsets``, group g times ``b[g]``, one persistent launch;
- :func:`moe_route`: top-k routing (softmax or sigmoid, renormalised, correction bias, grouped top-k);
- :func:`moe_sort`: the token copies grouped by expert (order, offsets, inverse permutation) on the device;
- :func:`fused_moe`: gather, grouped gate/up GEMM with SwiGLU in its epilogue, grouped down GEMM, combine.

Plain-PyTorch specs: :mod:`llm_speed.moe.reference`.
"""

from .fused_moe import fused_moe
from .grouped_gemm import grouped_gemm
from .routing import moe_route, moe_sort

__all__ = ["fused_moe", "grouped_gemm", "moe_route", "moe_sort"]
