"""Block configurations for the GEMM kernels, all in one place.

A configuration is a tile shape (BLOCK_M x BLOCK_N, stepping BLOCK_K along the reduction), the width of the
grouped launch order (GROUP_M), and the launch parameters num_warps and num_stages (the depth of Triton's
software pipeline: how many K-tiles are loaded ahead of the tensor-core work).

On a GPU the launcher autotunes over the list for the device's architecture, keyed on the problem
(M, N, K, the strides that decide the layout, and the dtypes). Under the Triton interpreter one pinned
configuration runs: the interpreter ignores num_warps/num_stages and autotuning there would only cost time.

Nothing here touches the GPU; the launcher passes the device capability in.
"""

from __future__ import annotations

import dataclasses

import triton


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """One tile shape plus launch parameters."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def meta(self) -> dict[str, int]:
        """The constexpr arguments of the kernels, as keyword arguments."""
        return {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "GROUP_M": self.group_m,
        }

    def to_triton(self, pre_hook=None) -> triton.Config:
        """This configuration as a ``triton.Config`` for ``triton.autotune``."""
        return triton.Config(
            self.meta(), num_warps=self.num_warps, num_stages=self.num_stages, pre_hook=pre_hook
        )


# Hopper (sm90): 228 KB of shared memory per SM allows big tiles with 3-4 pipeline stages.
HOPPER_TILED = (
    BlockConfig(128, 256, 64, 8, num_warps=8, num_stages=3),
    BlockConfig(128, 128, 64, 8, num_warps=8, num_stages=4),
    BlockConfig(128, 128, 32, 8, num_warps=4, num_stages=4),
    BlockConfig(128, 64, 64, 8, num_warps=4, num_stages=4),
    BlockConfig(64, 128, 64, 8, num_warps=4, num_stages=4),
    BlockConfig(64, 64, 64, 8, num_warps=4, num_stages=4),
    BlockConfig(64, 32, 32, 8, num_warps=2, num_stages=5),
)

# Hopper persistent kernel fed by tensor descriptors (TMA); fp16/bf16 only.
HOPPER_PERSISTENT_TMA = (
    BlockConfig(128, 256, 64, 8, num_warps=8, num_stages=3),
    BlockConfig(128, 128, 64, 8, num_warps=8, num_stages=4),
    BlockConfig(128, 128, 64, 8, num_warps=4, num_stages=3),
    BlockConfig(128, 64, 64, 8, num_warps=4, num_stages=4),
    BlockConfig(64, 128, 64, 8, num_warps=4, num_stages=4),
)

# Ampere (sm80): 164 KB of shared memory; the classic Triton matmul tiles.
AMPERE_TILED = (
    BlockConfig(128, 256, 32, 8, num_warps=8, num_stages=3),
    BlockConfig(128, 128, 32, 8, num_warps=4, num_stages=4),
    BlockConfig(128, 64, 32, 8, num_warps=4, num_stages=4),
    BlockConfig(64, 128, 32, 8, num_warps=4, num_stages=4),
    BlockConfig(64, 64, 32, 8, num_warps=4, num_stages=4),
    BlockConfig(64, 32, 32, 8, num_warps=2, num_stages=5),
    BlockConfig(32, 64, 32, 8, num_warps=2, num_stages=5),
)

# Any other GPU (Volta, Turing, Ada, consumer Blackwell, ...): smaller tiles that fit about 100 KB of
# shared memory. Configurations that do not fit are skipped by the autotuner (out of resources).
GENERIC_TILED = (
    BlockConfig(128, 128, 32, 8, num_warps=4, num_stages=3),
    BlockConfig(128, 64, 32, 8, num_warps=4, num_stages=3),
    BlockConfig(64, 128, 32, 8, num_warps=4, num_stages=3),
    BlockConfig(64, 64, 32, 8, num_warps=4, num_stages=3),
    BlockConfig(32, 64, 32, 8, num_warps=2, num_stages=3),
)

# The Triton interpreter: one configuration. Big tiles mean few programs, and the interpreter's cost is per
# program and per loop step, not per element.
INTERPRETER = BlockConfig(64, 64, 64, 4, num_warps=4, num_stages=1)

# The number of persistent programs the interpreter launches. Fewer programs than tiles, so each program
# walks several tiles and the persistent loop is really exercised on the CPU.
INTERPRETER_PERSISTENT_PROGRAMS = 3

HOPPER_MAJOR = 9
AMPERE_MAJOR = 8


def tiled_configs(capability: tuple[int, int]) -> tuple[BlockConfig, ...]:
    """The autotuning list of the tiled kernel for a CUDA device of compute ``capability`` (major, minor)."""
    if capability[0] == HOPPER_MAJOR:
        return HOPPER_TILED
    if capability == (AMPERE_MAJOR, 0):
        return AMPERE_TILED
    return GENERIC_TILED


def has_tma(capability: tuple[int, int]) -> bool:
    """Whether the persistent tensor-descriptor (TMA) kernel is used on a device of this capability.

    Only Hopper (sm90): that is the architecture the kernel's configurations are written for.
    """
    return capability[0] == HOPPER_MAJOR
