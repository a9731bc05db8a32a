"""GEMM with a fused epilogue in Triton: ``out = act(alpha * op(a) @ op(b) + beta * c + bias)``.

Two kernels share one epilogue: a tiled kernel (every dtype, layout and batch; int8 accumulates in int32) and
a persistent kernel fed by tensor descriptors (TMA; Hopper and later, 2-D fp16/bf16). Operands are read in
place through their strides: a transposed, column-major or broadcast (stride 0) operand is never copied.

Dispatch: tensors Triton runs on (CUDA; CPU under ``TRITON_INTERPRET=1``) take the Triton kernels. On a GPU
with tensor descriptors whose shared memory holds the large tiles (H100, H200, B200; :func:`tier_for`), 2-D
fp16/bf16 problems whose operands suit tensor descriptors take the persistent TMA kernel, everything else
the tiled kernel; the interpreter runs the tiled kernel (tests force the other). CPU tensors without the
interpreter run :func:`llm_speed.matmul.reference.gemm_reference` in float32, the same function.

fp32 inputs use TF32 tensor cores only when PyTorch allows TF32 for ``torch.matmul``
(``torch.backends.cuda.matmul.fp32_precision = "tf32"``, the legacy ``allow_tf32 = True``, or
``torch.set_float32_matmul_precision("high")``); by default they are computed in full fp32 ("ieee").

Split by role (docs/architecture.md): the kernels in :mod:`llm_speed.matmul.gemm_kernels`, the configuration
in :mod:`llm_speed.matmul.gemm_configs`, the launch in :mod:`llm_speed.matmul.gemm_launch`, and here the op
registration, autograd and public functions. Argument checks: :mod:`llm_speed.matmul.checks`; the
plain-PyTorch spec: :mod:`llm_speed.matmul.reference`. Design notes: docs/gemm.md.
"""
from __future__ import annotations

import math

import torch

from ..core import autocast, runtime
from ..core.dispatch import INFERENCE, Op, plain_call, plain_inference
from ..core.launch import (
    CallCache,
    tma_aligned,
)  # fmt: skip
from ..core.policy import current_number
from .checks import FLOAT_DTYPES, INT8_DTYPES, TENSOR_CORE_DTYPES, check_epilogue, check_operands
from .gemm_configs import fp32_input_precision, gemm_config
from .gemm_launch import GemmCall, forward, forward_int8, gluon_takes_int8, k_major_int8, launch_gemm

# --- op registration ------------------------------------------------------------------------------------


def _output_shape(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool) -> tuple[int, ...]:
    m = a.shape[-1] if trans_a else a.shape[-2]
    n = b.shape[-2] if trans_b else b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return (m, n)
    batch_a = a.shape[0] if a.dim() == 3 else 1
    batch_b = b.shape[0] if b.dim() == 3 else 1
    return (batch_b if batch_a == 1 else batch_a, m, n)


@torch.library.custom_op("llm_speed::gemm", mutates_args=())
def _gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: float,
    beta: float,
    trans_a: bool,
    trans_b: bool,
    activation: str | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return forward(a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype)


@_gemm_op.register_fake
def _gemm_fake(a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype):
    return a.new_empty(_output_shape(a, b, trans_a, trans_b), dtype=out_dtype)


@torch.library.custom_op("llm_speed::gemm_int8", mutates_args=())
def _gemm_int8_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return forward_int8(a, b)


@_gemm_int8_op.register_fake
def _gemm_int8_fake(a, b):
    return a.new_empty(_output_shape(a, b, False, False), dtype=torch.int32)


_gemm_int8_call = Op(_gemm_int8_op, forward_int8)


# --- autograd -------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype = inputs
    ctx.save_for_backward(a, b, c, bias)
    ctx.alpha, ctx.beta, ctx.trans_a, ctx.trans_b, ctx.activation = alpha, beta, trans_a, trans_b, activation


def _sum_to_shape(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a gradient over the dims that were broadcast to reach it from ``shape``."""
    extra = grad.dim() - len(shape)
    if extra > 0:
        grad = grad.sum(dim=tuple(range(extra)))
    dims = tuple(i for i, size in enumerate(shape) if size == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def _operand_grad(x, y, trans_x, trans_y, like, alpha):
    """``alpha * op(x) @ op(y)`` in like's dtype and shape. Where like was broadcast over the batch the
    gradient is a sum over it, done on fp32 products, so it is rounded to like's dtype once."""
    if x.dim() == 2 and y.dim() == 2:  # no batch: nothing was broadcast
        return _gemm_call(x, y, None, None, alpha, 0.0, trans_x, trans_y, None, like.dtype)
    summed = _output_shape(x, y, trans_x, trans_y) != tuple(like.shape)
    out_dtype = torch.float32 if summed else like.dtype
    grad = _gemm_call(x, y, None, None, alpha, 0.0, trans_x, trans_y, None, out_dtype)
    return _sum_to_shape(grad, like.shape).to(like.dtype)


# grad * act'(z) in one PyTorch kernel each (the derivative spelled out in tensor ops took about ten passes
# over the fp32 [M, N] gradient for GELU); reference.apply_activation is what they differentiate.
_ACTIVATION_BACKWARD = {
    "relu": lambda grad, z: torch.ops.aten.threshold_backward(grad, z, 0.0),
    "gelu": lambda grad, z: torch.ops.aten.gelu_backward(grad, z),
    "gelu_tanh": lambda grad, z: torch.ops.aten.gelu_backward(grad, z, approximate="tanh"),
    "silu": lambda grad, z: _silu_backward(grad, z),
}


def _silu_backward(grad, z):
    """grad * silu'(z). Under ``create_graph`` (a gradient that requires grad) spelled in tensor ops: aten's
    silu_backward has no derivative of its own, so a double backward failed there naming neither op."""
    if torch.is_grad_enabled() and (grad.requires_grad or z.requires_grad):
        s = torch.sigmoid(z)
        return grad * s * (1 + z * (1 - s))
    return torch.ops.aten.silu_backward(grad, z)


def _backward(ctx, grad_out):
    """Gradients with the same GEMM kernel. With an activation, the pre-activation z is recomputed by one
    more forward GEMM (in fp32, no activation) instead of being saved: the forward keeps its single write.
    """
    a, b, c, bias = ctx.saved_tensors
    alpha, beta, trans_a, trans_b, activation = ctx.alpha, ctx.beta, ctx.trans_a, ctx.trans_b, ctx.activation
    grad_z = grad_out  # without an activation, used as is: no copy when it has the operands' dtype
    if activation is not None:
        z = _gemm_call(a, b, c, bias, alpha, beta, trans_a, trans_b, None, torch.float32)
        grad_z = _ACTIVATION_BACKWARD[activation](grad_out.float(), z)
    grad_z_in = grad_z if grad_z.dtype == a.dtype else grad_z.to(a.dtype)  # operands share one dtype

    need_a, need_b, need_c, need_bias = ctx.needs_input_grad[:4]
    grad_a = grad_b = grad_c = grad_bias = None
    if need_a:
        if trans_a:  # a holds op(a)^T: grad = op(b) @ grad_z^T
            grad_a = _operand_grad(b, grad_z_in, trans_b, True, a, alpha)
        else:  # grad = grad_z @ op(b)^T
            grad_a = _operand_grad(grad_z_in, b, False, not trans_b, a, alpha)
    if need_b:
        if trans_b:  # b holds op(b)^T: grad = grad_z^T @ op(a)
            grad_b = _operand_grad(grad_z_in, a, True, trans_a, b, alpha)
        else:  # grad = op(a)^T @ grad_z
            grad_b = _operand_grad(a, grad_z_in, not trans_a, False, b, alpha)
    if need_c and c is not None:
        grad_c = _sum_to_shape(beta * grad_z.float(), c.shape).to(c.dtype)
    if need_bias and bias is not None:
        grad_bias = grad_z.sum(dim=tuple(range(grad_z.dim() - 1)), dtype=torch.float32).to(bias.dtype)
    return grad_a, grad_b, grad_c, grad_bias, None, None, None, None, None, None


_gemm_call = Op(_gemm_op, forward, setup_context=_setup_context, backward=_backward)
# Under torch.autocast (core.autocast): a, b, c and bias take the autocast dtype, as mm, addmm and linear do.
_gemm_autocast = autocast.dispatch(_gemm_call, autocast.LOWER, (0, 1, 2, 3))


# --- public functions -----------------------------------------------------------------------------------


def _checked_gemm(a, b, dtypes, *, alpha, beta, c, trans_a, trans_b, bias, activation, out_dtype):
    """Check the arguments of a float GEMM (operand dtypes in ``dtypes``) and run the op."""
    if isinstance(a, torch.Tensor):  # (as torch.mm: mixed float dtypes meet under autocast)
        a, b, c, bias = autocast.cast_inputs(autocast.LOWER, a, b, c, bias)
    shape = check_operands(a, b, trans_a, trans_b, dtypes)
    alpha, beta = check_epilogue(
        shape, a, alpha=alpha, beta=beta, c=c, bias=bias, activation=activation, out_dtype=out_dtype
    )
    trans_a, trans_b = bool(trans_a), bool(trans_b)  # numpy bools: the op's schema takes Python bools
    c_used = c if beta != 0 else None  # with beta == 0, c is not an input: never read, no gradient
    return _gemm_autocast(a, b, c_used, bias, alpha, beta, trans_a, trans_b, activation, out_dtype or a.dtype)


# gemm calls already checked, by what the checks and the recipe read (the operands' 16-byte alignment too:
# it picks the TMA kernel): a repeated call skips the checks and the op's layers (with grad, it records the
# op's autograd node around the kept launch: Op.checked).
_GEMM_CALLS = CallCache()


def _gemm_call_key(a, b, trans_a, trans_b, bias, activation) -> tuple:
    # the launch policy's number: a call kept under one policy is not served under another (int8: the Gluon
    # kernel of the candidate gluon-gemm-int8)
    return (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, a.device, b.device, trans_a, trans_b,
            tma_aligned(a, b), activation,
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.device),
            current_number())  # fmt: skip


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    trans_a: bool = False,
    trans_b: bool = False,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``activation(alpha * op(a) @ op(b) + beta * c + bias)`` in one Triton kernel; differentiable.

    a, b: 2-D [M, K] @ [K, N] or 3-D batched (a batch of 1, or a 2-D operand, broadcasts like
    ``torch.matmul``);
    op(x) is x, or its transpose over the last two dims when ``trans_x``. Any strides are read in place.
    dtypes float16, bfloat16, float32 (a and b equal), accumulated in fp32; fp32 uses TF32 only when
    PyTorch allows it for CUDA matmuls (:func:`fp32_input_precision`). ``c`` (broadcastable to the output)
    is required when beta != 0 and never read when beta == 0. ``bias`` has shape [N] (any stride);
    ``activation`` is None, "relu", "gelu", "gelu_tanh" or "silu". The output has ``out_dtype`` (default:
    the dtype of a). M, N or K of 0 is allowed: an empty output, or with K == 0 the epilogue applied to a
    zero product.
    """
    known = None  # the key of a call that _GEMM_CALLS may serve: 16-bit, no c, the default out_dtype
    if (
        c is None and out_dtype is None and (activation is None or type(activation) is str)
        and type(alpha) is float and -math.inf < alpha < math.inf and type(beta) is float and beta == 0.0
        and (trans_a is True or trans_a is False) and (trans_b is True or trans_b is False)
        and (mode := plain_call(a, b, optional=(bias,))) and a.dtype in TENSOR_CORE_DTYPES
    ):  # fmt: skip
        known = _gemm_call_key(a, b, trans_a, trans_b, bias, activation)
        call = _GEMM_CALLS.get(known)
        if call is not None and mode == INFERENCE:
            return call(a, b, bias, alpha)
        if call is not None:  # with grad: the op's autograd node around the kept launch
            return _gemm_call.checked(call.forward, a, b, None, bias, alpha, 0.0, trans_a, trans_b,
                                      activation, call.dtype)  # fmt: skip
    out = _checked_gemm(
        a, b, FLOAT_DTYPES, alpha=alpha, beta=beta, c=c, trans_a=trans_a, trans_b=trans_b, bias=bias,
        activation=activation, out_dtype=out_dtype,
    )  # fmt: skip
    if known is not None and runtime.triton_runs_on(a.device):
        _GEMM_CALLS.put(known, GemmCall(a, b, a.dtype, trans_a, trans_b, bias, activation))
    return out


def tensor_core_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
) -> torch.Tensor:
    """``alpha * a @ b + beta * c`` for float16/bfloat16 a and b, returned in float32 (tensor-core GEMM).

    Same shapes, strides, batching and c rules as :func:`gemm`; differentiable.
    """
    return _checked_gemm(
        a, b, TENSOR_CORE_DTYPES, alpha=alpha, beta=beta, c=c, trans_a=False, trans_b=False, bias=None,
        activation=None, out_dtype=torch.float32,
    )  # fmt: skip


def tensor_core_gemm_int8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 a and b (2-D or 3-D batched, any strides), accumulated and returned in int32.

    Exact whenever the true result fits in int32, which is guaranteed for K <= 131071 (|a*b| <= 2**14 per
    product); int32 arithmetic wraps, so overflowing partial sums do not spoil a representable result.
    """
    known = None
    if plain_inference(a, b):  # (int8 tensors never require grad)
        known = _gemm_call_key(a, b, None, None, None, None)  # flags None: never a float call's key
        call = _GEMM_CALLS.get(known)
        if call is not None:
            return call(*k_major_int8(a, b), None, 1.0) if call.copies else call(a, b, None, 1.0)
    check_operands(a, b, False, False, INT8_DTYPES)
    given = a, b
    if runtime.triton_runs_on(a.device):
        a, b = k_major_int8(a, b)  # once here: the op's forward and the kept call see them K-major
    out = _gemm_int8_call(a, b)
    # (a call the Gluon kernel takes is not kept: the kept call would launch the Triton kernel)
    if known is not None and runtime.triton_runs_on(a.device) and not gluon_takes_int8(a, b):
        copies = a is not given[0] or b is not given[1]
        _GEMM_CALLS.put(known, GemmCall(a, b, torch.int32, copies=copies))
    return out


__all__ = [
    "fp32_input_precision",
    "gemm",
    "gemm_config",
    "launch_gemm",
    "tensor_core_gemm",
    "tensor_core_gemm_int8",
]
