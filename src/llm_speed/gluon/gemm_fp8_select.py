"""Whether an fp8 GEMM call may run the block-scaled Gluon kernel (:mod:`llm_speed.gluon.gemm_fp8`): a pure
choice over the call's arguments and the launch policy, with no launch. The fp8 GEMM's forward
(:func:`llm_speed.matmul.fp8.gemm_forward`, under a policy with ``gluon_gemm_fp8`` on) asks
:func:`gluon_gemm_fp8_applies` and runs its Triton kernel wherever the answer is False: the policy's
``gluon_gemm_fp8`` off (as shipped: no GPU has proven the kernel; candidate ``gluon-gemm-fp8``), per-tensor or
per-row scaling, b stored [K, N], e5m2 operands, a float32 output, layouts TMA cannot read, empty problems,
the interpreter, and every device but a compute capability 9.0 GPU. :func:`gluon_gemm_fp8_refusal` says why
not."""

from __future__ import annotations

import torch

from ..core.policy import LaunchPolicy, current_policy
from .launch import launch_refusal, tma_matrix

# The kernel's operand and output dtypes (llm_speed.gluon.gemm_fp8 reads them here: this module stays light)
FP8_DTYPE = torch.float8_e4m3fn
OUT_DTYPES = (torch.bfloat16, torch.float16)


def gluon_gemm_fp8_refusal(a, b, scale_a, scale_b, out_dtype: torch.dtype, trans_b: bool, *,
                           policy: LaunchPolicy | None = None) -> str | None:  # fmt: skip
    """Why the Gluon kernel does not take ``gemm_fp8(a, b, scale_a, scale_b, out_dtype=out_dtype,
    trans_b=trans_b, bias=...)`` (arguments as :func:`llm_speed.matmul.fp8.gemm_fp8` has checked them; any
    bias it accepts, the kernel takes) under ``policy`` (None: the current one), or None when it does."""
    policy = current_policy() if policy is None else policy
    if not policy.gluon_gemm_fp8:
        return "the policy's gluon_gemm_fp8 is off"
    if not trans_b:
        return "b is [K, N]: fp8 wgmma reads B K-major, the kernel takes b [N, K] (trans_b) only"
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        return f"dtypes {a.dtype}, {b.dtype}: e4m3 operands only"
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype {out_dtype}: bfloat16 or float16 only"
    (m, k), n = a.shape, b.shape[0]
    if m == 0 or n == 0 or k == 0:
        return "an empty problem"
    groups = -(-k // 128)
    # (where these shapes also read as per-tensor scaling, M = 1 and N, K <= 128, both readings agree)
    if tuple(scale_a.shape) != (m, groups) or tuple(scale_b.shape) != (-(-n // 128), groups):
        return "not 1x128 x 128x128 block scaling"
    for name, x in (("a", a), ("b", b)):
        if not tma_matrix(x):
            return f"{name} is not K-contiguous with 16-byte aligned rows and base (TMA)"
    if n % 8:
        return f"N = {n}: the output's TMA store needs a multiple of 8"
    return launch_refusal(a.device)


def gluon_gemm_fp8_applies(a, b, scale_a, scale_b, out_dtype: torch.dtype, trans_b: bool, *,
                           policy: LaunchPolicy | None = None) -> bool:  # fmt: skip
    """True when the fp8 GEMM should run the Gluon kernel (:func:`gluon_gemm_fp8_refusal` finds no reason
    not to)."""
    return gluon_gemm_fp8_refusal(a, b, scale_a, scale_b, out_dtype, trans_b, policy=policy) is None
