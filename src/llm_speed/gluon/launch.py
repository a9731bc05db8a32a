"""How a Gluon kernel is launched: a :class:`GluonPlan` (kernel, grid, fixed arguments, warps, the layouts of
its TMA descriptors) per problem class, made once, launched with the call's tensors.

A launch goes through Triton's own path (``kernel[grid](...)``: binding, specialisation and cache lookup on
every call, 13-30 us of host time; the direct launch of :mod:`llm_speed.core.launch` does not know Gluon's
descriptors, which carry a shared-memory layout). Under :func:`llm_speed.core.launch.simulated_gpu` nothing
is launched: the launch is counted and shown to the observers (the kernel report's capture records it, to
compile exactly what would run).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..core import runtime
from ..core.hardware import hardware_of
from ..core.launch import TMA_ALIGN_BYTES, Kernel

# The capability the Gluon kernels are built for: wgmma and setmaxnreg exist on sm_90a only (Blackwell has
# neither).
CAPABILITY = (9, 0)


def device_refusal(device: torch.device) -> str | None:
    """Why the Gluon kernels do not run on ``device`` (not CUDA, or not compute capability 9.0), or None.
    Under :func:`llm_speed.core.launch.simulated_gpu` a CPU device stands for the stand-in GPU (as
    :func:`llm_speed.gluon.launch.check_device` takes it): the A/B's ``--check`` and the kernel report see
    the launch a GPU would make."""
    if device.type == "cpu" and runtime.SIMULATED_GPU:
        capability = tuple(hardware_of(device).compute_capability)
    elif device.type != "cuda":
        return f"tensors on {device}, not CUDA"
    else:
        capability = tuple(torch.cuda.get_device_capability(device))
    if capability != CAPABILITY:
        return f"compute capability {capability}, not {CAPABILITY} (sm_90a)"
    return None


def launch_refusal(device: torch.device) -> str | None:
    """Why a Gluon kernel is not launched for tensors on ``device``: :func:`device_refusal`'s reasons, or
    Triton's interpreter running the kernels (Gluon has none); None where it is."""
    why = device_refusal(device)
    if why is None and runtime.INTERPRETED:
        return "Triton's interpreter runs the kernels (Gluon has none)"
    return why


def check_device(name: str, tensor: torch.Tensor, function: str) -> None:
    """ValueError naming ``name`` unless ``tensor`` is on a CUDA device of compute capability
    :data:`CAPABILITY` (or, under :func:`llm_speed.core.launch.simulated_gpu`, a CPU tensor standing for one
    of the stand-in GPU)."""
    device = tensor.device
    wanted = f"{CAPABILITY[0]}.{CAPABILITY[1]}"
    if device.type != "cuda" and not (runtime.SIMULATED_GPU and device.type == "cpu"):
        raise ValueError(f"{name} is on {device}: {function} runs on CUDA devices of compute capability "
                         f"{wanted} only (sm_90a: H100, H200)")  # fmt: skip
    capability = tuple(hardware_of(device).compute_capability)
    if capability != CAPABILITY:
        raise ValueError(f"{name} is on {device} of compute capability {capability[0]}.{capability[1]}: "
                         f"{function} runs on {wanted} only (sm_90a: H100, H200)")  # fmt: skip


def tma_matrix(x: torch.Tensor) -> bool:
    """Whether a TMA descriptor reads the 2-D tensor ``x`` as it is: unit stride along its last dim, rows and
    base address :data:`~llm_speed.core.launch.TMA_ALIGN_BYTES`-byte aligned (the Gluon GEMMs' operands)."""
    rows = x.stride(0) * x.element_size()
    return x.stride(1) == 1 and not rows % TMA_ALIGN_BYTES and not x.data_ptr() % TMA_ALIGN_BYTES


# Called with (plan, per-call arguments) for every launch under a simulated GPU (the kernel report's capture).
_observers: list[Callable[[GluonPlan, dict], None]] = []


def add_observer(observer: Callable[[GluonPlan, dict], None]) -> Callable[[], None]:
    """Show every simulated launch to ``observer``; returns the function that removes it."""
    _observers.append(observer)
    return lambda: _observers.remove(observer)


@dataclasses.dataclass(frozen=True)
class DescriptorLayout:
    """A TMA descriptor parameter: the tile it moves (``block_shape``) and its shared-memory layout (an
    ``NVMMASharedLayout``); the tensor is given per call."""

    block_shape: tuple[int, ...]
    layout: Any

    def over(self, base: torch.Tensor) -> Any:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        shape, strides = list(base.shape), list(base.stride())
        return TensorDescriptor(base, shape, strides, list(self.block_shape), self.layout)


@dataclasses.dataclass(frozen=True)
class GluonPlan:
    """One Gluon kernel's launch for a problem class. ``fixed``: constexprs and integers (a plan holds no
    tensor); ``descriptors``: the descriptor parameters, each given its tensor per call; ``num_stages`` is
    passed to Triton as given (Gluon runs no software pipeliner; kernels take their ring depth as a
    constexpr and pass the same number here, so the kernel report names the stages)."""

    kernel: Kernel
    grid: tuple[int, int, int]
    fixed: dict
    descriptors: dict
    num_warps: int
    num_stages: int

    def arguments(self, per_call: dict) -> dict:
        """Every argument as Triton's launch takes them: descriptors made over the per-call tensors."""
        arguments = dict(self.fixed)
        for name, value in per_call.items():
            layout = self.descriptors.get(name)
            arguments[name] = value if layout is None else layout.over(value)
        return arguments

    def launch(self, **per_call: Any) -> None:
        if runtime.SIMULATED_GPU:
            for observer in list(_observers):
                observer(self, per_call)
        else:
            with runtime.on_device_of(next(iter(per_call.values()))):
                self.kernel.fn[self.grid](**self.arguments(per_call), num_warps=self.num_warps,
                                          num_stages=self.num_stages)  # fmt: skip
        runtime.record_launch(self.kernel.name)

    def __repr__(self) -> str:
        return f"GluonPlan({self.kernel.name}, grid={self.grid}, warps={self.num_warps})"
