"""GeGLU activation (Shazeer, "GLU Variants Improve Transformer", 2020, arXiv:2002.05202) in Triton:
``gelu_tanh(gate) * up``, Gemma's MLP (``hidden_activation="gelu_pytorch_tanh"``).

The kernels are SwiGLU's (:mod:`llm_speed.fused.swiglu`) with the activation switched to GELU's tanh
approximation, ``0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))`` (``torch.nn.functional.gelu(...,
approximate="tanh")``), through the accurate float32 tanh of :mod:`llm_speed.core.kernel_math`; the backward
recomputes the activation and its derivative from gate, as Liger-Kernel's ``ops/geglu.py`` does.

Its kernels, launcher, op registration and autograd are ``swiglu.py``'s (:func:`gated_activation`); the
plain-PyTorch spec is :func:`llm_speed.fused.reference.geglu_reference`.
"""

from __future__ import annotations

import torch

from .swiglu import gated_activation

_forward_call = gated_activation(gelu=True)  # the kernels, ops and autograd are swiglu.py's


# --- public function ------------------------------------------------------------------------------------


def geglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GeGLU activation ``gelu(gate, approximate="tanh") * up`` (Gemma 1, 2 and 3 MLPs), one Triton kernel
    each way.

    Args:
        gate, up: the same shape (any) and dtype (float16, bfloat16, float32), on one device. Non-contiguous
            inputs are copied to contiguous ones first.

    Returns a contiguous tensor of gate's shape and dtype, computed in float32. Differentiable in gate and up;
    the backward recomputes the activation rather than saving it. Devices as :func:`llm_speed.rms_norm`.
    Reference: :func:`llm_speed.fused.reference.geglu_reference`.
    """
    return _forward_call(gate, up)
