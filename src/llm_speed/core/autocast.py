"""The ops under ``torch.autocast``: each op casts its inputs as PyTorch's own counterpart would, then runs
with autocast off, the same way in every kind of call.

PyTorch's autocast casts the inputs of the ops on its lists (``aten/src/ATen/autocast_mode.h``) at the
dispatcher's ``Autocast`` key and runs the op with autocast off; ops on no list run on their inputs as they
are. A custom op, by default, is on no list *and* runs its body with the caller's autocast still on, so every
``torch.mm`` inside it is autocast on its own (Hugging Face's and Liger's fused cross-entropy backward inside
an autocast region crashed this way, ``out=`` tensors no longer matching). Here each op has a policy:

- :data:`LOWER`: floating tensors other than float64 go to the autocast dtype (``torch.get_autocast_dtype``),
  as for ``linear``, ``mm`` and ``scaled_dot_product_attention`` (the lower-precision list):
  ``fused_linear_cross_entropy``'s hidden, weight and bias; ``flash_attention``'s q, k, v; ``gemm``'s
  operands, addend and bias; ``grouped_gemm``'s operands; ``fused_moe``'s hidden and expert weights.
- :data:`FLOAT32`: 16-bit floating tensors go to float32, as for ``layer_norm`` and ``rms_norm`` (the CUDA
  float32 list): ``rms_norm``'s x and weight.
- :data:`KEEP`: no cast; autocast is only turned off inside: elementwise ops, which autocast leaves alone
  (``swiglu``, the rotary embeddings), ``cross_entropy`` (PyTorch's float32 policy would upcast the logits,
  whose values the kernel reads in float32 anyway: the same loss and gradient without the float32 copy), and
  every backward op, which runs in the dtypes its forward saved whether ``backward()`` is called inside or
  outside the autocast region.

The same rule is applied twice, so that every call agrees: :func:`dispatch` registers it with the dispatcher
for the op's ``AutocastCPU`` and ``AutocastCUDA`` keys (what ``torch.compile``, dispatch modes and direct
``torch.ops.llm_speed`` calls go through), and returns an :class:`AutocastOp` that applies it before a
:class:`llm_speed.core.dispatch.Op`, whose cheap eager paths (the implementation called directly, or through
an ``autograd.Function``) never reach the dispatcher. Outside autocast an :class:`AutocastOp` costs one check
(``torch._C._is_any_autocast_enabled``, about 0.2 us).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

LOWER = "lower"
FLOAT32 = "float32"
KEEP = "keep"
POLICIES = (LOWER, FLOAT32, KEEP)

_is_compiling = torch.compiler.is_compiling
_any_autocast = torch._C._is_any_autocast_enabled
_enabled = torch.is_autocast_enabled
_autocast_dtype = torch.get_autocast_dtype
_Exclude = torch._C._ExcludeDispatchKeyGuard
_Tensor = torch.Tensor
# The device types whose autocast the ops follow, with the dispatch key of each.
_KEY_NAMES = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_KEYS = {
    device: torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, k)) for device, k in _KEY_NAMES.items()
}
_SIXTEEN_BITS = (torch.float16, torch.bfloat16)
_CASTABLE = (torch.float16, torch.bfloat16, torch.float32)
_LIBRARY = torch.library.Library("llm_speed", "IMPL")


def enabled(device_type: str) -> bool:
    """Whether autocast is on for ``device_type`` (and not being traced by ``torch.compile``, which applies
    the dispatcher's rule)."""
    return not _is_compiling() and _any_autocast() and _enabled(device_type)


def target_dtype(policy: str, device_type: str) -> torch.dtype | None:
    """The dtype ``policy`` casts to under the current autocast of ``device_type`` (None: no cast)."""
    if policy == LOWER:
        return _autocast_dtype(device_type)
    return torch.float32 if policy == FLOAT32 else None


def _cast(args: tuple, positions: tuple[int, ...], policy: str, device_type: str) -> tuple:
    if policy == KEEP or not positions:
        return args
    dtype = target_dtype(policy, device_type)
    eligible = _SIXTEEN_BITS if policy == FLOAT32 else _CASTABLE
    out = list(args)
    for i in positions:
        t = out[i]
        if (
            isinstance(t, _Tensor)
            and t.dtype in eligible
            and t.dtype != dtype
            and t.device.type == device_type
        ):
            out[i] = t.to(dtype)
    return tuple(out)


def cast_inputs(policy: str, *tensors: torch.Tensor) -> tuple:
    """``tensors`` as ``policy`` casts them under the current autocast of their device (themselves outside
    it), for a public function to call before its dtype checks: SDPA under autocast takes float32 q and k
    beside a bfloat16 v (Qwen3's and OLMo-2's q/k norms make them), so the op's own check must see what
    the op will run on. Applied while ``torch.compile`` traces too (the casts are traced)."""
    if not _any_autocast() or not tensors:
        return tensors
    device_type = tensors[0].device.type
    if device_type not in _KEYS or not _enabled(device_type):
        return tensors
    return _cast(tensors, tuple(range(len(tensors))), policy, device_type)


class AutocastOp:
    """``op`` (a :class:`llm_speed.core.dispatch.Op` or any callable taking positional arguments) called the
    way the dispatcher calls the op under autocast: the arguments at ``positions`` cast by ``policy``, then
    the op run with autocast off. Outside autocast (or while ``torch.compile`` traces: the dispatcher applies
    the rule there) it is ``op`` itself. ``device_arg``: the position of a tensor argument whose device type
    selects the autocast state."""

    __slots__ = ("op", "policy", "positions", "device_arg")

    def __init__(
        self, op: Callable[..., Any], policy: str, positions: tuple[int, ...] = (), device_arg: int = 0
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy is {policy!r}; accepted: {', '.join(POLICIES)}")
        self.op = op
        self.policy = policy
        self.positions = tuple(positions)
        self.device_arg = device_arg

    def __call__(self, *args: Any) -> Any:
        if _is_compiling() or not _any_autocast():
            return self.op(*args)
        device_type = args[self.device_arg].device.type
        keys = _KEYS.get(device_type)
        if keys is None or not _enabled(device_type):
            return self.op(*args)
        with _Exclude(keys):
            return self.op(*_cast(args, self.positions, self.policy, device_type))

    def __getattr__(self, name: str) -> Any:  # impl, library_op, function of the wrapped Op
        if name in AutocastOp.__slots__:  # not set yet
            raise AttributeError(name)
        return getattr(self.op, name)


def register(library_op: Any, policy: str, positions: tuple[int, ...] = ()) -> None:
    """Register ``policy`` for the custom op ``library_op`` (a ``torch.library.custom_op``) at the
    dispatcher's ``AutocastCPU`` and ``AutocastCUDA`` keys: the arguments at ``positions`` cast, then the op
    redispatched with autocast off."""
    overload = library_op._opoverload
    for device_type, key in _KEY_NAMES.items():

        def kernel(_keyset, *args, _device_type=device_type, _keys=_KEYS[device_type], **kwargs):
            with _Exclude(_keys):
                return overload(*_cast(args, positions, policy, _device_type), **kwargs)

        _LIBRARY.impl(library_op._name, kernel, key, with_keyset=True)


def dispatch(op: Any, policy: str, positions: tuple[int, ...] = (), device_arg: int = 0) -> AutocastOp:
    """Register ``policy`` for ``op.library_op`` (:func:`register`) and return ``op`` wrapped in an
    :class:`AutocastOp` with the same rule: one line next to an op's ``Op(...)``."""
    register(op.library_op, policy, positions)
    return AutocastOp(op, policy, positions, device_arg)
