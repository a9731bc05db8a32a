"""The one configuration type of every kernel: tile sizes and launch parameters.

Each op chooses its :class:`KernelConfig` with one pure function of the problem and the
:class:`~llm_speed.core.hardware.Hardware` (shared memory per block, SMs, compute capability), cached, never
by timing candidates on a call (a call's cost must not depend on a first-call search): flash-attention does
the same (``flash_attn/cute/interface.py``, ``_tile_size_fwd_sm90``; ``num_splits_heuristic``). The launcher
passes the fields to its kernel by keyword, under the kernel's own constexpr names.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch parameters of one kernel launch.

    ``block_m`` x ``block_n`` is a program's tile: query rows x keys (attention), output rows x columns
    (GEMM), rows x columns (fused ops: tokens x hidden or vocabulary entries). Keyword-only and None where a
    kernel has no such tile: ``block_k`` (GEMM: the step along the reduction), ``block_d`` (attention:
    head_dim padded to a power of two), ``group_m`` (GEMM: the width of the grouped launch order). ``splits``:
    programs that share one reduction and whose partial results are merged afterwards (split-KV decode; the
    per-program weight-gradient partials of the fused ops).
    """

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    _: dataclasses.KW_ONLY
    block_k: int | None = None
    block_d: int | None = None
    group_m: int | None = None
    splits: int = 1

    def meta(self) -> dict[str, int]:
        """The tile constexprs in the kernels' usual names (BLOCK_M, BLOCK_N, and those set of BLOCK_K,
        BLOCK_D, GROUP_M)."""
        meta = {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n}
        for field, name in (("block_k", "BLOCK_K"), ("block_d", "BLOCK_D"), ("group_m", "GROUP_M")):
            value = getattr(self, field)
            if value is not None:
                meta[name] = value
        return meta

    def name(self) -> str:
        """A short readable id, e.g. ``128x256x64_g8_w8_s3`` (test ids, logs, benchmark notes)."""
        tile = f"{self.block_m}x{self.block_n}" + (f"x{self.block_k}" if self.block_k is not None else "")
        extras = "".join(
            f"_{letter}{value}"
            for letter, value in (("d", self.block_d), ("g", self.group_m), ("split", self.splits))
            if value is not None and not (letter == "split" and value == 1)
        )
        return f"{tile}{extras}_w{self.num_warps}_s{self.num_stages}"
