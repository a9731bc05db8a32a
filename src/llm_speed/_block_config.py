"""The block-configuration type of the attention and GEMM kernels, and the hardware facts that choose one.

A :class:`BlockConfig` is a tile shape plus Triton's launch parameters. :class:`Hardware` holds what the
choice depends on: the shared memory one block may use (the CUDA opt-in maximum per block), the number of
SMs and the compute capability (which says whether tensor descriptors, TMA, exist: compute capability 9.0
and later, CUDA C++ Programming Guide, "Tensor Memory Access"). It comes from the live device
(``torch.cuda.get_device_properties``) or from an entry of the GPU table (``llm_speed.perf.gpus``), so a GPU
is served by what it has, not by its name. Without a GPU (the Triton interpreter) the H100 SXM entry stands
in: the interpreter ignores warps and stages, and its tiles then match what the H100 runs.

Per-family tables live in ``llm_speed.attention.configs`` and ``llm_speed.matmul.configs``.
"""

from __future__ import annotations

import dataclasses
import functools

from llm_speed.perf.gpus import GPUSpec, get_gpu

KIB = 1024
# Compute capability from which tensor descriptors (TMA, the bulk tensor copy engine) exist.
TMA_CAPABILITY = (9, 0)
# The GPU whose table entry stands in when no CUDA device is involved (the interpreter, ahead-of-time checks).
DEFAULT_GPU = "h100-sxm"


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """One tile shape plus launch parameters, for either kernel family.

    block_m x block_n is the output tile (GEMM) or the query x key block (attention). ``block_k`` (the step
    along the reduction) and ``group_m`` (the width of the grouped launch order) are GEMM-only, keyword-only,
    and None for attention, whose reduction step is the padded head dim.
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    _: dataclasses.KW_ONLY
    block_k: int | None = None
    group_m: int | None = None

    def meta(self) -> dict[str, int]:
        """The tile constexprs of the kernels, as keyword arguments (the GEMM-only ones when set)."""
        meta = {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}
        if self.block_k is not None:
            meta["BLOCK_K"] = self.block_k
        if self.group_m is not None:
            meta["GROUP_M"] = self.group_m
        return meta

    def to_triton(self, pre_hook=None):
        """This configuration as a ``triton.Config`` for ``triton.autotune``."""
        import triton

        return triton.Config(
            self.meta(), num_warps=self.num_warps, num_stages=self.num_stages, pre_hook=pre_hook
        )

    def name(self) -> str:
        """A short readable id, e.g. ``128x256x64_g8_w8_s3`` (test ids, logs)."""
        tile = f"{self.block_m}x{self.block_n}" + (f"x{self.block_k}" if self.block_k is not None else "")
        group = f"_g{self.group_m}" if self.group_m is not None else ""
        return f"{tile}{group}_w{self.num_warps}_s{self.num_stages}"


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What a block configuration must fit: shared memory per block, SMs, and the compute capability."""

    name: str
    compute_capability: tuple[int, int]
    smem_per_block_bytes: int
    sm_count: int

    @property
    def has_tma(self) -> bool:
        """Whether the device has tensor descriptors (TMA): compute capability 9.0 or later."""
        return tuple(self.compute_capability) >= TMA_CAPABILITY

    @classmethod
    def from_spec(cls, spec: GPUSpec | str) -> Hardware:
        """From a GPU table entry; the opt-in maximum per block is 1 KB less than the SM's carve-out."""
        spec = get_gpu(spec)
        return cls(spec.id, tuple(spec.compute_capability), (spec.smem_per_sm_kb - 1) * KIB, spec.sm_count)

    @classmethod
    def from_properties(cls, props) -> Hardware:
        """From ``torch.cuda.get_device_properties(...)``; the GPU table fills in a field torch lacks."""
        smem = getattr(props, "shared_memory_per_block_optin", None)
        if not smem:
            try:
                smem = cls.from_spec(props.name).smem_per_block_bytes
            except ValueError:
                smem = 48 * KIB  # the per-block default every CUDA GPU since Kepler grants without opt-in
        return cls(props.name, (props.major, props.minor), int(smem), props.multi_processor_count)


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
