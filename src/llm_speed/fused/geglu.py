"""GeGLU activation (Shazeer, "GLU Variants Improve Transformer", 2020, arXiv:2002.05202) in Triton:
``gelu_tanh(gate) * up``, Gemma's MLP (``hidden_activation="gelu_pytorch_tanh"``).

The kernels are SwiGLU's (:mod:`llm_speed.fused.swiglu`) with the activation switched to GELU's tanh
approximation, ``0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3)))`` (``torch.nn.functional.gelu(...,
approximate="tanh")``), through the accurate float32 tanh of :mod:`llm_speed.core.kernel_math`; the backward
recomputes the activation and its derivative from gate, as Liger-Kernel's ``ops/geglu.py`` does.

Layout as :mod:`llm_speed.fused.rms_norm` (its kernels and launcher in ``swiglu.py``); the plain-PyTorch spec
is :func:`llm_speed.fused.reference.geglu_reference`.
"""

from __future__ import annotations

import torch

from ..core import autocast, runtime
from ..core.dispatch import Op
from .swiglu import _validate, launch_backward, launch_forward

# --- launcher (the kernels and plans are swiglu.py's) -------------------------------------------------------


def forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` of contiguous ``gate`` and ``up`` of one shape; reports its work."""
    if gate.numel():
        runtime.report_work("geglu", gate=gate)
    return launch_forward(gate, up, True)


def backward(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of :func:`forward`; reports its work."""
    if gate.numel():
        runtime.report_work("geglu_backward", gate=gate)
    return launch_backward(dout, gate, up, True)


# --- op registration ------------------------------------------------------------------------------------


@torch.library.custom_op("llm_speed::geglu_forward", mutates_args=())
def _forward_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return forward(gate, up)


@_forward_op.register_fake
def _forward_fake(gate, up):
    return torch.empty_like(gate)


@torch.library.custom_op("llm_speed::geglu_backward", mutates_args=())
def _backward_op(
    dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return backward(dout, gate, up)


@_backward_op.register_fake
def _backward_fake(dout, gate, up):
    return torch.empty_like(gate), torch.empty_like(up)


# Under torch.autocast (core.autocast): no cast (gelu and mul are on none of autocast's lists).
_backward_call = autocast.dispatch(Op(_backward_op, backward), autocast.KEEP)


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, dout):
    gate, up = ctx.saved_tensors
    return _backward_call(dout, gate, up)


_forward_call = autocast.dispatch(
    Op(_forward_op, forward, setup_context=_setup_context, backward=_backward), autocast.KEEP
)


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
    _validate(gate, up)
    return _forward_call(gate.contiguous(), up.contiguous())
