"""Cross-entropy in Triton: on logits (``cross_entropy``) and fused with the LM head
(``fused_linear_cross_entropy``: the loss of ``cross_entropy(hidden @ weight.T + bias, target)`` without the
full ``[N, V]`` logits). Both run the same three kernels.

A row's kernel computes its log-sum-exp with an online softmax over vocabulary blocks (Milakov & Gimelshein,
"Online normalizer calculation for softmax", 2018, arXiv:1805.02867) and its loss: PyTorch's
``cross_entropy`` per row, with class weights and label smoothing as PyTorch defines them, plus the z-loss
``lse_square_scale * lse^2`` (PaLM, Chowdhery et al. 2022, arXiv:2204.02311, section 5; Liger-Kernel's
``lse_square_scale``). A "mean" or "sum" is taken by a second kernel (one launch, where PyTorch's reduction
takes four to six), which keeps its divisors for the backward. The backward kernel writes ``d loss / d
logits`` row by row, recomputing the softmax from the logits and the saved log-sum-exp (kept as the row's
largest logit and the log of its sum of exponentials, so that a logit's difference to the largest is what
rounds, as in PyTorch's ``log_softmax``: see :mod:`llm_speed.fused.cross_entropy_kernels`).

The fused linear version processes rows in chunks of ``C``: a chunk's logits ``[C, V]`` come from one GEMM,
the forward kernel turns them into per-row losses and log-sum-exps, and the chunk is dropped. A reduced loss
with grad (every training loss) makes its gradients in the forward while each chunk's logits exist, as
Liger-Kernel does (linkedin/Liger-Kernel ``ops/fused_linear_cross_entropy.py``, Hsu et al. 2024,
arXiv:2410.10989): the backward kernel overwrites the logits in place with their gradient for a loss
gradient of 1 and two GEMMs add the chunk's share to the hidden and weight gradients; the backward scales
them by the loss gradient, read on the device. ``reduction="none"`` (a gradient per row, unknown in the
forward) recomputes each chunk's logits in the backward instead: one more ``N x H x V`` GEMM.

Memory (itemsize ``b``, bias ignored): eager PyTorch holds at least two ``[N, V]`` tensors at once (logits and
log-probabilities in the forward, log-probabilities and their gradient in the backward): ``2 N V b``. Here the
extra memory is one ``[C, V]`` chunk plus ``O(N)`` fp32 statistics: ``C V b + 8 N``. The default ``C`` makes
the chunk as large as ``hidden`` itself, ``C = next_pow2(ceil(N / ceil(V / H)))``, but never below 2^16
logits (a smaller chunk's launches cost more than it saves) nor 1024 rows (each chunk's GEMMs read the whole
weight: fewer rows leave them memory-bound; :func:`default_chunk_rows`). For Llama-3-8B's head (H = 4096,
V = 128256) with N = 8192 tokens in bfloat16: unfused ``2 * 8192 * 128256 * 2 B = 4.20 GB``; fused ``C =
1024``, ``1024 * 128256 * 2 B + 64 KiB = 263 MB``, 16x less (:func:`memory_estimate`; a formula, not a
measurement). Hugging Face's loss also upcasts the logits to float32, which adds ``4 N V`` bytes more.

Split by role as :mod:`llm_speed.fused.rms_norm`'s sections: the kernels in
:mod:`llm_speed.fused.cross_entropy_kernels`, the launcher in :mod:`llm_speed.fused.cross_entropy_launch`,
and here the op registration, autograd and public functions; the plain-PyTorch specs are
:func:`llm_speed.fused.reference.cross_entropy_reference` and
:func:`llm_speed.fused.reference.fused_linear_cross_entropy_reference`.
"""

from __future__ import annotations

import math

import torch

from ..core import autocast, tensors
from ..core.args import check_choice, check_flag, check_int, check_real, positive_int
from ..core.chunking import linear_cross_entropy_chunk_rows
from ..core.dispatch import INFERENCE, Op, plain_call
from ..core.launch import CallCache
from ..core.tensors import FLOAT_DTYPES, check_same_device, check_tensor, dtype_names
from .cross_entropy_launch import (
    REDUCTIONS,
    LinearCall,
    backward,
    default_chunk_rows,
    forward,
    linear_backward,
    linear_forward,
    linear_forward_grads,
    memory_estimate,
    scale_grads,
    stats_size,
    zero_bias_grad,
)

# the public names (memory_estimate and default_chunk_rows live with the launcher)
__all__ = ["REDUCTIONS", "check_accum_dtype", "check_loss_options", "cross_entropy", "default_chunk_rows",
           "fused_linear_cross_entropy", "memory_estimate"]  # fmt: skip

# --- op registration ------------------------------------------------------------------------------------


def _loss_fake(n, reduced, return_z, loss_dtype, like, z_scale):
    loss = like.new_empty(() if reduced else (n,), dtype=loss_dtype)
    z = like.new_empty((() if reduced else (n,)) if return_z else (0,), dtype=loss_dtype)
    stats = like.new_empty((stats_size(n, reduced, z_scale > 0),), dtype=torch.float32)
    return loss, z, stats


@torch.library.custom_op("llm_speed::fused_linear_cross_entropy_forward", mutates_args=())
def _linear_forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_scale: float,
    chunk_rows: int,
    reduction: str,
    loss_dtype: torch.dtype,
    return_z: bool,
    need_dhidden: bool,
    need_dweight: bool,
    need_dbias: bool,
    accum_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return linear_forward_grads(
        hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap, z_scale,
        chunk_rows, reduction, loss_dtype, return_z, need_dhidden, need_dweight, need_dbias, accum_float32,
    )  # fmt: skip


@_linear_forward_op.register_fake
def _linear_forward_fake(hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap,
                         z_scale, chunk_rows, reduction, loss_dtype, return_z, need_dhidden, need_dweight,
                         need_dbias, accum_float32=False):  # fmt: skip
    loss = _loss_fake(hidden.shape[0], reduction != "none", return_z, loss_dtype, hidden, z_scale)
    dhidden = torch.empty_like(hidden) if need_dhidden else hidden.new_empty(0)
    dweight = torch.empty_like(weight) if need_dweight else weight.new_empty(0)
    dbias = weight.new_empty((weight.shape[0],) if need_dbias else (0,), dtype=torch.float32)
    return (*loss, dhidden, dweight, dbias)


@torch.library.custom_op("llm_speed::fused_linear_cross_entropy_backward", mutates_args=())
def _linear_backward_op(
    grad: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    stats: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_scale: float,
    chunk_rows: int,
    reduction: str,
    accum_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return linear_backward(
        grad, hidden, weight, target, bias, class_weight, stats, ignore_index, label_smoothing, softcap,
        z_scale, chunk_rows, reduction, accum_float32,
    )  # fmt: skip


@_linear_backward_op.register_fake
def _linear_backward_fake(grad, hidden, weight, target, bias, *_):
    return torch.empty_like(hidden), torch.empty_like(weight), zero_bias_grad(weight, bias)


@torch.library.custom_op("llm_speed::fused_linear_cross_entropy_scale_grads", mutates_args=())
def _scale_grads_op(
    grad: torch.Tensor, dhidden: torch.Tensor, dweight: torch.Tensor, dbias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    return scale_grads(grad, dhidden, dweight, dbias)


@_scale_grads_op.register_fake
def _scale_grads_fake(grad, dhidden, dweight, dbias):
    dbias = dbias.new_empty(dbias.shape, dtype=dweight.dtype)
    return torch.empty_like(dhidden), torch.empty_like(dweight), dbias


@torch.library.custom_op("llm_speed::cross_entropy_forward", mutates_args=())
def _forward_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_scale: float,
    reduction: str,
    loss_dtype: torch.dtype,
    return_z: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return forward(
        logits, target, class_weight, ignore_index, label_smoothing, softcap, z_scale, reduction, loss_dtype,
        return_z,
    )  # fmt: skip


@_forward_op.register_fake
def _forward_fake(logits, target, class_weight, ignore_index, label_smoothing, softcap, z_scale, reduction,
                  loss_dtype, return_z):  # fmt: skip
    return _loss_fake(logits.shape[0], reduction != "none", return_z, loss_dtype, logits, z_scale)


@torch.library.custom_op("llm_speed::cross_entropy_backward", mutates_args=())
def _backward_op(
    grad: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    class_weight: torch.Tensor | None,
    stats: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: float,
    z_scale: float,
    reduction: str,
) -> torch.Tensor:
    return backward(
        grad, logits, target, class_weight, stats, ignore_index, label_smoothing, softcap, z_scale, reduction
    )


@_backward_op.register_fake
def _backward_fake(grad, logits, *_):
    return logits.new_empty(logits.shape)


# Under torch.autocast (core.autocast): the head's GEMMs take the autocast dtype, as F.linear would; the loss
# reads any dtype and computes in float32; the backward runs in the dtypes the forward saved.
_linear_backward_call = autocast.dispatch(Op(_linear_backward_op, linear_backward), autocast.KEEP)
_scale_grads_call = autocast.dispatch(Op(_scale_grads_op, scale_grads), autocast.KEEP)
_backward_call = autocast.dispatch(Op(_backward_op, backward), autocast.KEEP)


# --- autograd -------------------------------------------------------------------------------------------


def _linear_setup_context(ctx, inputs, output):
    hidden, weight, target, bias, class_weight, ignore_index, smoothing, softcap, z_scale, chunk_rows, \
        reduction, _loss_dtype, _return_z, *needs = inputs  # fmt: skip
    # (a kept call, Op.checked, passes the op's arguments without the trailing accum_float32: False)
    needs, accum_float32 = needs[:3], len(needs) > 3 and needs[3]
    ctx.mark_non_differentiable(*output[1:])
    ctx.args = (ignore_index, smoothing, softcap, z_scale, chunk_rows, reduction, accum_float32)
    grads = output[3:] if any(needs) else None  # the gradients made in the forward (a reduced loss)
    if grads is None or all(type(t) is torch.Tensor for t in grads):
        # Eager: the gradients are kept for one backward, which scales them in place and hands them over (no
        # copy of the head's gradient); a second backward (retain_graph) makes them again from the inputs.
        ctx.save_for_backward(hidden, weight, target, bias, class_weight, output[2])
        ctx.grads = grads
    else:  # traced (torch.compile, opcheck): saved, scaled into new tensors (the tracer's functional rule)
        ctx.save_for_backward(hidden, weight, target, bias, class_weight, output[2], *grads)
        ctx.grads = None


def _linear_backward(ctx, grad, *_):
    saved = ctx.saved_tensors
    grads, ctx.grads = ctx.grads, None
    if grads is not None and plain_call(grad, optional=grads) == INFERENCE:
        dhidden, dweight, dbias = scale_grads(grad, *grads, in_place=True)
    elif grads is not None or len(saved) > 6:
        dhidden, dweight, dbias = _scale_grads_call(grad, *(grads or saved[6:]))
    else:  # no gradients made in the forward, or already handed over: each chunk's logits made again
        dhidden, dweight, dbias = _linear_backward_call(grad, *saved, *ctx.args)
    need = ctx.needs_input_grad
    return (dhidden if need[0] else None, dweight if need[1] else None, None,
            dbias if need[3] else None, *((None,) * (len(need) - 4)))  # fmt: skip


def _setup_context(ctx, inputs, output):
    logits, target, class_weight, ignore_index, smoothing, softcap, z_scale, reduction, _dtype, _z = inputs
    ctx.save_for_backward(logits, target, class_weight, output[2])
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.args = (ignore_index, smoothing, softcap, z_scale, reduction)


def _backward(ctx, grad, _dz, _dstats):
    logits, target, class_weight, stats = ctx.saved_tensors
    return _backward_call(grad, logits, target, class_weight, stats, *ctx.args), *((None,) * 9)


# A checked call returns (loss, z) alone: fused_linear_cross_entropy reads nothing else.
_linear_forward_plain = Op(_linear_forward_op, linear_forward_grads, setup_context=_linear_setup_context,
                           backward=_linear_backward, checked_outputs=2)  # fmt: skip
_linear_forward_call = autocast.dispatch(_linear_forward_plain, autocast.LOWER, (0, 1, 3))
_forward_call = autocast.dispatch(
    Op(_forward_op, forward, setup_context=_setup_context, backward=_backward), autocast.KEEP
)


# --- public functions -----------------------------------------------------------------------------------


def _validate_loss(target, n, vocab, class_weight, weight_name, ignore_index, reduction, label_smoothing,
                   softcap, lse_square_scale, return_z_loss, loss_dtype):  # fmt: skip
    """The arguments both losses share, checked; returns the numbers as the ops take them."""
    check_tensor("target", target, dtypes=(torch.int64,), dims=1, what="[N]")
    if target.shape[0] != n:
        raise ValueError(f"target has {target.shape[0]} entries; the loss has {n} rows")
    if class_weight is not None:
        check_tensor(weight_name, class_weight, dims=1, what="[V] (one weight per class)")
        if class_weight.shape[0] != vocab:
            raise ValueError(f"{weight_name} has {class_weight.shape[0]} entries; it must have V = {vocab}")
        if torch.is_grad_enabled() and class_weight.requires_grad:  # (as PyTorch's cross_entropy refuses it)
            raise ValueError(f"{weight_name} gets no gradient here; pass it detached "
                             f"({weight_name}.detach())")  # fmt: skip
    return check_loss_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                              softcap=softcap, lse_square_scale=lse_square_scale, return_z_loss=return_z_loss,
                              loss_dtype=loss_dtype)  # fmt: skip


def check_loss_options(*, ignore_index=-100, reduction="mean", label_smoothing=0.0, softcap=None,
                       lse_square_scale=0.0, return_z_loss=False, loss_dtype=torch.float32, chunk_rows=None,
                       accum_dtype=None) -> tuple:  # fmt: skip
    """The losses' options that need no tensor (the fused one's ``chunk_rows`` and ``accum_dtype`` too),
    checked, each error naming its option; returns ``(ignore_index, label_smoothing, softcap, z_scale,
    return_z_loss)`` as the ops take them. :mod:`llm_speed.nn`'s loss modules check their options here at
    construction."""
    ignore_index = check_int("ignore_index", ignore_index)  # any sign: -100 by default
    check_choice("reduction", reduction, REDUCTIONS)
    label_smoothing = check_real("label_smoothing", label_smoothing, minimum=0.0, maximum=1.0)
    softcap = 0.0 if softcap is None else check_real("softcap", softcap, positive=True)
    z_scale = check_real("lse_square_scale", lse_square_scale, minimum=0.0)
    return_z_loss = check_flag("return_z_loss", return_z_loss)
    if loss_dtype not in FLOAT_DTYPES:
        raise TypeError(f"loss_dtype is {loss_dtype!r}; accepted: {dtype_names(FLOAT_DTYPES)}")
    if chunk_rows is not None:  # (None: the rule of default_chunk_rows)
        positive_int("chunk_rows", chunk_rows)
    check_accum_dtype("accum_dtype", accum_dtype)
    return ignore_index, label_smoothing, softcap, z_scale, return_z_loss


def _validate_linear(hidden, weight, target, bias, ce_weight, chunk_rows, *loss_args):
    check_tensor("hidden", hidden, dims=2, what="[N, H]")
    check_tensor("weight", weight, dims=2, what="[V, H] (the nn.Linear layout)")
    if bias is not None:
        check_tensor("bias", bias, dims=1, what="[V]")
    shared = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(shared) > 1 and not autocast.enabled(hidden.device.type):  # autocast casts them to one dtype
        raise TypeError(f"hidden, weight and bias must share one dtype, got {sorted(map(str, shared))}")
    n, h = hidden.shape
    vocab = weight.shape[0]
    if weight.shape[1] != h:
        raise ValueError(
            f"weight is {tuple(weight.shape)}; it must be [V, H] with H = hidden's last dim ({h})"
        )
    if vocab < 1 or h < 1:
        raise ValueError(f"V ({vocab}) and H ({h}) must be at least 1")
    if bias is not None and bias.shape[0] != vocab:
        raise ValueError(f"bias has {bias.shape[0]} entries; it must have V = {vocab}")
    numbers = _validate_loss(target, n, vocab, ce_weight, "ce_weight", *loss_args)
    check_same_device(hidden=hidden, weight=weight, target=target, bias=bias, ce_weight=ce_weight)
    if chunk_rows is None:
        # Traced by torch.compile, the cached wrapper makes dynamo warn users about lru_cache (it traces the
        # function under it anyway): there the plain rule, the same number.
        rule = linear_cross_entropy_chunk_rows if torch.compiler.is_compiling() else default_chunk_rows
        chunk_rows = rule(n, h, vocab)
    return (*numbers, positive_int("chunk_rows", chunk_rows))


def check_accum_dtype(name: str, accum_dtype) -> None:
    """:func:`fused_linear_cross_entropy`'s ``accum_dtype`` (passed on as ``name``): None or torch.float32,
    else a TypeError naming it."""
    if accum_dtype not in (None, torch.float32):
        raise TypeError(f"{name} is {accum_dtype!r}; accepted: None (the weight's dtype) or torch.float32")


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    ce_weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
    loss_dtype: torch.dtype = torch.float32,
    chunk_rows: int | None = None,
    accum_dtype: torch.dtype | None = None,
):
    """``cross_entropy(hidden @ weight.T + bias, target)`` computed in row chunks, never holding ``[N, V]``.

    Args:
        hidden: ``[N, H]`` (flatten batch and sequence first), float16, bfloat16 or float32.
        weight: ``[V, H]``, the ``nn.Linear`` layout (an LM head's ``.weight``), hidden's dtype.
        target: int64 ``[N]``; each entry in ``[0, V)`` or ``ignore_index``. Checked before any work where
            :func:`llm_speed.core.runtime.check_values` allows reading it on the host (CPU tensors, or
            ``LLM_SPEED_CHECK_INPUTS=1``): a ValueError. Unchecked (CUDA by default), an invalid entry makes
            its row's loss NaN (so a reduced loss is NaN) and its row of the hidden gradient NaN.
        bias: optional ``[V]``, hidden's dtype.
        ce_weight: optional class weights ``[V]`` (any float dtype), ``cross_entropy``'s ``weight``
            (Liger's name: ``weight`` here is the LM head).
        ignore_index, reduction, label_smoothing, softcap, lse_square_scale, return_z_loss, loss_dtype: as
            :func:`cross_entropy`.
        chunk_rows: rows per chunk ``C``; default ``next_pow2(ceil(N / ceil(V / H)))``, a chunk of logits as
            large as ``hidden``, at least 2^16 logits and 1024 rows (:func:`default_chunk_rows`).
        accum_dtype: what the weight gradient is summed in over the chunks (Liger's ``accum_dtype``):
            ``None``, the weight's dtype (each chunk's GEMM adds into it, the sum rounded at every chunk: with
            16-bit weights its error grows with the number of chunks, 4x PyTorch's at 64), or
            ``torch.float32`` (each chunk's product rounded once and added to a float32 sum, rounded once at
            the end: PyTorch's precision, for V x H x 4 bytes more while the gradient is made and one
            elementwise add a chunk). The bias gradient is summed in float32 either way.

    Returns the loss in ``loss_dtype`` (float32 by default): a scalar, or ``[N]`` for ``reduction="none"``;
    with ``return_z_loss``, ``(loss, z_loss)``. Logits come from GEMMs in the inputs' dtype (under
    ``torch.autocast``, the autocast dtype, as ``F.linear`` would); log-sum-exp, loss and ``d loss / d
    logits`` in float32. Differentiable in hidden, weight and bias; the weight gradient is accumulated as
    ``accum_dtype`` says, one GEMM per chunk. A "mean" or "sum" with grad makes the gradients in the forward
    (three GEMMs a chunk, none for a frozen input; the backward multiplies them by the loss gradient, and a
    second backward of the same graph makes them again), so they are held from the forward to the backward;
    ``"none"``'s backward makes each chunk's logits again (four GEMMs a chunk in all).

    Memory: ``O(C x V)`` beyond inputs and gradients, against at least ``2 N V`` elements unfused; for
    Llama-3-8B's head (H = 4096, V = 128256, N = 8192, bfloat16) 263 MB against 4.20 GB by
    :func:`memory_estimate` (a formula, not a measurement). Devices as :func:`llm_speed.rms_norm`.
    Reference: :func:`llm_speed.fused.reference.fused_linear_cross_entropy_reference`.
    """
    known = None  # the key of a call that _LINEAR_CALLS may serve: no bias, class weights or softcap
    if (
        bias is None and ce_weight is None and softcap is None and accum_dtype is None
        and type(ignore_index) is int
        and type(reduction) is str and type(label_smoothing) is float and 0.0 <= label_smoothing <= 1.0
        and type(lse_square_scale) is float and 0.0 <= lse_square_scale < math.inf
        and (return_z_loss is True or return_z_loss is False) and type(loss_dtype) is torch.dtype
        and (chunk_rows is None or type(chunk_rows) is int) and (mode := plain_call(hidden, weight, target))
    ):  # fmt: skip
        known = (hidden.shape, hidden.stride(), hidden.dtype, hidden.device, weight.shape, weight.stride(),
                 weight.dtype, weight.device, target.shape, target.stride(), target.dtype, target.device,
                 ignore_index, reduction, label_smoothing, lse_square_scale, return_z_loss, loss_dtype,
                 chunk_rows)  # fmt: skip
        call = _LINEAR_CALLS.get(known)
        if call is not None:  # (the implementation checks the targets' values where it may read them)
            if call.forward_plan is not None and mode == INFERENCE:
                return call(hidden, weight, target)
            args = (hidden, weight, target, None, None, *call.numbers, reduction, loss_dtype, return_z_loss)
            if mode == INFERENCE:
                loss, z, _ = linear_forward(*args)
            else:  # with grad: the op's autograd node around its implementation
                needs = _NO_GRADS
                if reduction != "none":
                    needs = (hidden.requires_grad, weight.requires_grad, False)
                lean = call.gradient_plan is not None and (needs[0] or needs[1])  # one chunk, reduced
                run = call.forward if lean else linear_forward_grads
                loss, z = _linear_forward_plain.checked(run, *args, *needs)
            return (loss, z) if return_z_loss else loss
    ignore_index, label_smoothing, softcap, z_scale, return_z_loss, chunk_rows = _validate_linear(
        hidden, weight, target, bias, ce_weight, chunk_rows, ignore_index, reduction, label_smoothing,
        softcap, lse_square_scale, return_z_loss, loss_dtype,
    )  # fmt: skip
    check_accum_dtype("accum_dtype", accum_dtype)
    args = (hidden, weight, target, bias, ce_weight, ignore_index, label_smoothing, softcap, z_scale,
            chunk_rows, reduction, loss_dtype, return_z_loss)  # fmt: skip
    needs = _NO_GRADS  # the gradients the forward makes (a reduced loss with grad: see the docstring)
    if reduction != "none" and torch.is_grad_enabled():
        needs = (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    loss, z, *_ = _linear_forward_call(*args, *needs, accum_dtype is not None)
    if known is not None:
        numbers = (ignore_index, label_smoothing, softcap, z_scale, chunk_rows)
        call = LinearCall(hidden, weight, target, numbers, reduction, loss_dtype, return_z_loss)
        _LINEAR_CALLS.put(known, call)
    return (loss, z) if return_z_loss else loss


_NO_GRADS = (False, False, False)
# fused_linear_cross_entropy calls already checked, by what the checks read: a repeated call goes straight to
# the implementation or the lean one-chunk path (with grad inside the op's autograd node).
_LINEAR_CALLS = CallCache()


def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    softcap: float | None = None,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
    loss_dtype: torch.dtype = torch.float32,
):
    """``torch.nn.functional.cross_entropy(logits, target)`` in Triton, with a z-loss and a logit softcap.

    Args:
        logits: ``[N, V]``, float16, bfloat16 or float32, any row stride (a non-contiguous last dim is
            copied).
            Read in place, never upcast: the maths is float32 whatever the dtype.
        target: int64 ``[N]``, each entry in ``[0, V)`` or ``ignore_index`` (checked as
            :func:`fused_linear_cross_entropy` says).
        weight: optional class weights ``[V]`` (any float dtype), as PyTorch's: row i counts ``weight[t_i]``
            times, and ``"mean"`` divides by the sum of the weights of the rows not ignored; with label
            smoothing the smoothing term weighs class j by ``weight[j]`` (PyTorch's definition).
        ignore_index: rows with this target add nothing to the loss or the gradients.
        reduction: ``"mean"`` (over the rows not ignored; weighted as above), ``"sum"``, or ``"none"``
            (``[N]``, 0 at ignored rows; differentiable with any output gradient). **A "mean" whose divisor
            is 0 (every row ignored, N = 0, or class weights of the kept rows adding up to 0) gives loss 0
            and zero gradients** (the z-loss part aside), where PyTorch gives NaN or +-inf.
        label_smoothing: in ``[0, 1]``, as ``torch.nn.functional.cross_entropy`` defines it.
        softcap: ``None`` or ``c > 0``: logits become ``c * tanh(logits / c)`` first (Gemma-2's final logit
            softcapping), with the accurate float32 tanh of :mod:`llm_speed.core.kernel_math`.
        lse_square_scale: z-loss weight ``s >= 0``: each row not ignored adds ``s * lse^2`` (``lse`` the
            log-sum-exp of its logits; PaLM's auxiliary loss, Liger's ``lse_square_scale``), unweighted by
            class weights; ``"mean"`` divides the z-loss part by the number of rows not ignored.
        return_z_loss: also return the z-loss part of the loss (reduced the same way), for logging: it is
            included in the loss and carries no gradient of its own.
        loss_dtype: the loss's dtype, float32 by default (as Hugging Face's and Liger's losses; a bfloat16
            loss keeps 3 significant digits); pass the inputs' dtype for the old behaviour.

    Returns the loss (a scalar, or ``[N]`` for ``"none"``), or ``(loss, z_loss)`` with ``return_z_loss``.
    Under ``torch.autocast`` the logits are read as they are (PyTorch's float32 policy for cross_entropy would
    upcast them first: same values, same float32 maths, without the float32 copy). The gradient comes back in
    logits' dtype, computed in float32. Devices as :func:`llm_speed.rms_norm`. One launch over the rows each
    way, plus one for a "mean" or "sum". Reference: :func:`llm_speed.fused.reference.cross_entropy_reference`.
    """
    check_tensor("logits", logits, dims=2, what="[N, V]")
    n, vocab = logits.shape
    if vocab < 1:
        raise ValueError(f"logits must have at least 1 class (V = {vocab})")
    ignore_index, label_smoothing, softcap, z_scale, return_z_loss = _validate_loss(
        target, n, vocab, weight, "weight", ignore_index, reduction, label_smoothing, softcap,
        lse_square_scale, return_z_loss, loss_dtype,
    )  # fmt: skip
    check_same_device(logits=logits, target=target, weight=weight)
    logits = tensors.last_dim_contiguous(logits)
    loss, z, _ = _forward_call(
        logits, target, weight, ignore_index, label_smoothing, softcap, z_scale, reduction, loss_dtype,
        return_z_loss,
    )  # fmt: skip
    return (loss, z) if return_z_loss else loss
