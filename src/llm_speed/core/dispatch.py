"""How a call reaches an op's implementation: directly, through an autograd function, or through its
registered ``torch.library`` op, whichever is the cheapest that serves the call.

Every op registers its implementation with ``torch.library.custom_op`` (and ``register_fake``,
``register_autograd``): that is what ``torch.compile``, ``torch.library.opcheck``, tensor subclasses and
dispatch modes see. Its dispatch costs host time, though: about 10 us per call, and about 35 us more when it
records an autograd node (the custom op wraps a generated ``autograd.Function`` in two redispatches; measured
on a CPU, ``docs/guides/host-path.md``). :class:`Op` keeps the registered op for the calls that need it and
serves the others cheaper:

- nothing is being compiled or traced (no dispatch mode, no functorch transform), every tensor is a plain
  ``torch.Tensor`` or ``nn.Parameter``, and no autograd graph is to be recorded (grad mode off, or no input
  requires grad): the implementation is called directly;
- the same, but an input requires grad: an ``autograd.Function`` built from the same ``setup_context`` and
  ``backward`` as the registered op's autograd (the semantics of ``register_autograd``);
- anything else: the registered op.

An op that keeps the calls it has checked (:class:`llm_speed.core.launch.CallCache`) asks
:func:`plain_call` which of the first two a call is, and serves a repeated one itself: directly, or through
:meth:`Op.checked`, the same autograd function around the launch it kept.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.autograd.forward_ad as _forward_ad
from torch._C._functorch import TransformType as _TransformType

_is_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled
_any_autocast = torch._C._is_any_autocast_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_level = torch._C._functorch.peek_interpreter_stack
_functorch_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_Tensor = torch.Tensor


class Op:
    """An op's implementation ``impl``, its registered ``torch.library`` op ``library_op`` (a custom op
    defined with the same arguments), and, for a differentiable op, ``setup_context(ctx, inputs, output)``
    and ``backward(ctx, *grads)`` (registered with the library op here). Call it like the implementation,
    with positional arguments. ``checked_outputs``: how many leading outputs :meth:`checked` returns (an
    op whose public function reads only those; ``setup_context`` still sees them all): autograd wraps each
    output it returns, ~0.6 us apiece on the development CPU."""

    __slots__ = ("impl", "library_op", "function", "apply", "apply_checked")

    def __init__(
        self,
        library_op: Any,
        impl: Callable[..., Any],
        *,
        setup_context: Callable[..., None] | None = None,
        backward: Callable[..., Any] | None = None,
        checked_outputs: int | None = None,
    ):
        self.impl = impl
        self.library_op = library_op
        self.function = self.apply = self.apply_checked = None
        if backward is not None:
            library_op.register_autograd(backward, setup_context=setup_context)
            self.function = _autograd_function(library_op, impl, setup_context, backward)
            # The C++ apply under Function.apply: what it adds in Python (unwrapping functorch wrappers whose
            # transform has exited, a check for active transforms, which send a call to the library op here)
            # costs 2.6 us a call on the development CPU; a call with a wrapper takes Function.apply.
            self.apply = super(torch.autograd.Function, self.function).apply
            checked = _autograd_function(
                library_op, impl, setup_context, backward, run_last=True, outputs=checked_outputs
            )  # fmt: skip
            self.apply_checked = super(torch.autograd.Function, checked).apply

    def __call__(self, *args: Any) -> Any:
        if _is_compiling() or _dispatch_modes():
            return self.library_op(*args)
        transformed = _functorch_level() is not None
        if transformed or _forward_ad._current_level >= 0:
            if self.function is not None:  # (an op without gradients has no rule to lack)
                check_differentiation(self.library_op, args)
            if transformed:
                return self.library_op(*args)
        grad = _grad_enabled()
        needs_grad = wrapped = False
        for arg in args:
            if isinstance(arg, _Tensor):
                if type(arg) not in _PLAIN_TENSORS:
                    return self.library_op(*args)
                if grad:
                    needs_grad = needs_grad or arg.requires_grad
                    wrapped = wrapped or _functorch_wrapped(arg)
        if not needs_grad:
            return self.impl(*args)
        if self.function is None:  # no gradient formula: the registered op says so
            return self.library_op(*args)
        return self.function.apply(*args) if wrapped else self.apply(*args)

    def checked(self, run: Callable[..., Any], *args: Any) -> Any:
        """A call that :func:`plain_call` finds ``AUTOGRAD`` and whose checks an op has kept: the output of
        ``run(*args)`` (what the implementation does for ``args``, minus what the op already knows of such a
        call) with the op's autograd node recorded, as its autograd function would."""
        return self.apply_checked(*args, run)


# The differentiations the ops have no rule for. A custom op under forward-mode AD returns zero tangents with
# no error (torch 2.13), and under torch.func.grad fails inside PyTorch naming neither the op nor why: both
# are refused here, by name. vmap (PyTorch's per-sample fallback) and functionalization are fine.
_UNSUPPORTED_TRANSFORMS = {
    _TransformType.Grad: "torch.func.grad / vjp / jacrev / hessian",
    _TransformType.Jvp: "torch.func.jvp / jacfwd (forward-mode AD)",
}


def check_differentiation(library_op: Any, args: tuple) -> None:
    """NotImplementedError naming the op when the call is under a differentiation it does not implement:
    a ``torch.func`` grad or jvp transform, or dual tensors of ``torch.autograd.forward_ad``. Backward-mode
    autograd (``.backward()``, ``torch.autograd.grad``) and ``torch.func.vmap`` serve every op."""
    name = getattr(library_op, "_name", "this op")
    level = _functorch_level()
    what = None if level is None else _UNSUPPORTED_TRANSFORMS.get(level.key())
    if what is None and _forward_ad._current_level >= 0:
        if any(isinstance(a, _Tensor) and _forward_ad.unpack_dual(a).tangent is not None for a in args):
            what = "forward-mode AD (dual tensors of torch.autograd.forward_ad)"
    if what is not None:
        raise NotImplementedError(
            f"{name} has no rule for {what}; its gradients come from backward-mode autograd: loss.backward() "
            "or torch.autograd.grad (torch.func.vmap works too)"
        )


def _autograd_function(library_op: Any, impl: Callable, setup_context: Callable | None, backward: Callable,
                       run_last: bool = False, outputs: int | None = None):  # fmt: skip
    """The op's ``autograd.Function``; ``run_last``: its forward runs the function passed after the
    implementation's arguments instead (:meth:`Op.checked`; last, so that ``ctx.needs_input_grad`` keeps its
    indices), and its backward gives that argument no gradient. ``outputs``: it returns only that many
    leading outputs (the backward receives their gradients alone)."""

    def forward(ctx, *args):
        run = impl
        if run_last:
            run, args = args[-1], args[:-1]
        output = run(*args)
        # An output nobody differentiates (an LSE, an rstd, a z-loss) gets None, not a tensor of zeros:
        # materialising one costs an allocation and a memset launch per backward.
        ctx.set_materialize_grads(False)
        if setup_context is not None:
            setup_context(ctx=ctx, inputs=args, output=output)
        return output if outputs is None else output[:outputs]

    def backward_(ctx, *grads):
        for grad in grads:
            if grad is not None:
                break
        else:  # no output's gradient is defined: no input gets one
            return (None,) * len(ctx.needs_input_grad)
        given = backward(ctx, *grads)
        if not run_last:
            return given
        return (*given, None) if type(given) is tuple else (given, None)

    name = getattr(library_op, "_name", getattr(impl, "__name__", "op")).replace("::", "_")
    return type(
        f"Eager_{name}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward_)},
    )


INFERENCE = 1  # plain_call: a plain call with no autograd graph to record
AUTOGRAD = 2  # ... one that records one


def plain_call(*tensors: Any, optional: tuple = ()) -> int:
    """What :class:`Op` and :class:`llm_speed.core.autocast.AutocastOp` would do with a call on ``tensors``
    (each required) and ``optional`` (None where not given), where an op's calls already checked
    (:class:`llm_speed.core.launch.CallCache`) may serve it: :data:`INFERENCE`, run the implementation with
    nothing around it (nothing compiled or traced, no dispatch mode, no functorch transform, no autocast,
    plain tensors, no autograd graph to record); :data:`AUTOGRAD`, the same but an input requires grad (none
    a functorch wrapper): :meth:`Op.checked`; 0, anything else (the op's full path, whose checks name a
    required tensor that is None or not a tensor)."""
    if (_is_compiling() or _dispatch_modes() or _functorch_level() is not None or _any_autocast()
            or _forward_ad._current_level >= 0):  # fmt: skip
        return 0
    grad = _grad_enabled()
    mode = INFERENCE
    # two loops, not one with a flag per tensor: this runs before every kept call (host time is the point)
    for tensor in tensors:
        if type(tensor) not in _PLAIN_TENSORS:
            return 0
        if grad and tensor.requires_grad:
            if _functorch_wrapped(tensor):
                return 0
            mode = AUTOGRAD
    for tensor in optional:
        if type(tensor) not in _PLAIN_TENSORS:
            if tensor is None:  # not given
                continue
            return 0
        if grad and tensor.requires_grad:
            if _functorch_wrapped(tensor):
                return 0
            mode = AUTOGRAD
    return mode


def plain_inference(*tensors: Any, optional: tuple = ()) -> bool:
    """Whether :func:`plain_call` finds a call on ``tensors`` (and ``optional``) :data:`INFERENCE` (for the
    ops whose calls already checked serve inference only)."""
    return plain_call(*tensors, optional=optional) == INFERENCE
