"""Whether an int8 GEMM call may run the Gluon kernel (:func:`llm_speed.gluon.gemm.gemm_int8`): a pure choice
over the call's operands and the launch policy, with no launch. ``tensor_core_gemm_int8``'s forward
(:func:`llm_speed.matmul.gemm_launch.forward_int8`, under a policy with ``gluon_gemm_int8`` on) asks
:func:`gluon_gemm_int8_applies` with its operands already K-major and runs its Triton kernel wherever the
answer is False: the policy's ``gluon_gemm_int8`` off (as shipped: no GPU has proven the kernel; candidate
``gluon-gemm-int8``), batched (3-D) operands, rows TMA cannot read (K not a multiple of 16, N not of 4),
empty problems, the interpreter, and every device but a compute capability 9.0 GPU.
:func:`gluon_gemm_int8_refusal` says why not."""

from __future__ import annotations

import torch

from ..core.policy import LaunchPolicy, current_policy
from .launch import launch_refusal, tma_matrix


def gluon_gemm_int8_refusal(a: torch.Tensor, b: torch.Tensor, *,
                            policy: LaunchPolicy | None = None) -> str | None:  # fmt: skip
    """Why the Gluon kernel does not take ``a @ b`` (int8 ``a`` [M, K] and ``b`` [K, N], checked by
    :func:`llm_speed.tensor_core_gemm_int8` and made K-major) under ``policy`` (None: the current one), or
    None when it does (it reads ``b.mT``, [N, K] row-major)."""
    policy = current_policy() if policy is None else policy
    if not policy.gluon_gemm_int8:
        return "the policy's gluon_gemm_int8 is off"
    if a.dim() != 2 or b.dim() != 2:
        return "batched operands: the kernel takes 2-D a and b"
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        return f"dtypes {a.dtype}, {b.dtype}: int8 operands only"
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0 or k == 0:
        return "an empty problem"
    for name, x in (("a", a), ("b", b.mT)):
        if not tma_matrix(x):
            return f"{name} is not K-contiguous with 16-byte aligned rows and base (TMA)"
    if n % 4:
        return f"N = {n}: the int32 output's TMA store needs a multiple of 4"
    return launch_refusal(a.device)


def gluon_gemm_int8_applies(a: torch.Tensor, b: torch.Tensor, *, policy: LaunchPolicy | None = None) -> bool:
    """True when the int8 GEMM should run the Gluon kernel (:func:`gluon_gemm_int8_refusal` finds no reason
    not to)."""
    return gluon_gemm_int8_refusal(a, b, policy=policy) is None
