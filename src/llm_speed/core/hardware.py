"""The hardware facts that choose a kernel configuration (:mod:`llm_speed.core.config`).

:class:`Hardware` holds what the choice depends on: the shared memory one block may use (the CUDA opt-in
maximum per block), the number of SMs, the compute capability (which says whether tensor descriptors, TMA,
exist: compute capability 9.0 and later, CUDA C++ Programming Guide, "Tensor Memory Access") and the L2 size
(how many heads' keys and values a launch order may keep resident). It comes from
the live device (``torch.cuda.get_device_properties``) or from an entry of the GPU table
(``llm_speed.core.gpus``), so a GPU is served by what it has, not by its name. Without a GPU (the Triton
interpreter) the H100 SXM entry stands in: the interpreter ignores warps and stages, and its tiles then match
what the H100 runs.

Nothing here touches the GPU at import time; a live device is read once, on first use, and cached.
"""

from __future__ import annotations

import dataclasses
import functools

from llm_speed.core.gpus import GPUSpec, get_gpu

KIB = 1024
# Compute capability from which tensor descriptors (TMA, the bulk tensor copy engine) exist.
TMA_CAPABILITY = (9, 0)
# The GPU whose table entry stands in when no CUDA device is involved (the interpreter, ahead-of-time checks).
DEFAULT_GPU = "h100-sxm"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What a block configuration must fit: shared memory per block, SMs, the compute capability, and the
    L2 cache (0: unknown)."""

    name: str
    compute_capability: tuple[int, int]
    smem_per_block_bytes: int
    sm_count: int
    l2_bytes: int = 0

    @property
    def has_tma(self) -> bool:
        """Whether the device has tensor descriptors (TMA): compute capability 9.0 or later."""
        return tuple(self.compute_capability) >= TMA_CAPABILITY

    @classmethod
    def from_spec(cls, spec: GPUSpec | str) -> Hardware:
        """From a GPU table entry; the opt-in maximum per block is 1 KB less than the SM's carve-out."""
        spec = get_gpu(spec)
        return cls(spec.id, tuple(spec.compute_capability), (spec.smem_per_sm_kb - 1) * KIB, spec.sm_count,
                   int(spec.l2_cache_mb * KIB * KIB))  # fmt: skip

    @classmethod
    def from_properties(cls, props) -> Hardware:
        """From ``torch.cuda.get_device_properties(...)``; the GPU table fills in a field torch lacks."""
        smem = getattr(props, "shared_memory_per_block_optin", None)
        if not smem:
            try:
                smem = cls.from_spec(props.name).smem_per_block_bytes
            except ValueError:
                smem = 48 * KIB  # the per-block default every CUDA GPU since Kepler grants without opt-in
        l2 = int(getattr(props, "L2_cache_size", 0) or 0)
        return cls(props.name, (props.major, props.minor), int(smem), props.multi_processor_count, l2)


@functools.cache
def default_hardware() -> Hardware:
    """The stand-in when no CUDA device is involved (see the module docstring)."""
    return Hardware.from_spec(DEFAULT_GPU)


@functools.cache
def _cuda_hardware(index: int) -> Hardware:
    import torch

    return Hardware.from_properties(torch.cuda.get_device_properties(index))


def hardware_of(device=None) -> Hardware:
    """The :class:`Hardware` of a torch device; a non-CUDA device (or None) gets :func:`default_hardware`."""
    if device is None:
        return default_hardware()
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return default_hardware()
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_hardware(index)
