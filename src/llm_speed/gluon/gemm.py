"""A warp-specialized persistent GEMM in Gluon for Hopper (sm_90a): ``c = a @ b`` (or ``a @ b.T``), fp16 or
bf16 operands, fp32 accumulation, the output in the operands' dtype; and ``c = a @ b.T`` of int8 operands,
int32 accumulation and output (:func:`gemm_int8`, candidate ``gluon-gemm-int8``).

Why int8 is here: Triton's software pipeliner keeps a wgmma in flight across loop iterations only when its
accumulator is fp32 (Triton 3.6, ``WGMMAPipeline.cpp``, "Rule 2.1: We don't make the dot async if the
accumulator is not fp32"), so every int32-accumulating ``tl.dot`` on Hopper is waited for at once
(``wgmma.wait_group 0`` in the loop: ``llm-speed kernels --op tensor_core_gemm_int8``), which llm-speed's
Triton int8 GEMM pays at about a quarter of the int8 peak (0cce093, H100: 461 TOPS at 4096^3). Gluon issues
and waits for its wgmma itself, so the int8 product stays in flight like the 16-bit one.

The structure is the one CUTLASS calls "warp-specialized cooperative" (CUTLASS 3.x,
``include/cutlass/gemm/kernel/sm90_gemm_tma_warpspecialized_cooperative.hpp``) and FlashAttention-3 builds on
(Shah et al. 2024, arXiv:2407.08608, section 3.1):

- a **producer** partition of one warp, its registers cut to :data:`PRODUCER_REGISTERS` by ``setmaxnreg``,
  issues the TMA loads of A and B tiles into a ring of ``STAGES`` shared-memory slots; per slot a "ready"
  mbarrier (the TMA's bytes arrived) and an "empty" one (the consumers are done with it);
- the **consumers**, the default partition of two warpgroups (8 warps, the registers the producer gave
  up), wait on "ready", issue asynchronous wgmma over the slot and keep one product in flight while they
  wait for the next slot; warpgroup 0 owns rows [0, BLOCK_M / 2) of the tile, warpgroup 1 the rest (the
  accumulator's layout splits M over the 8 warps); after a tile they write it through shared memory by
  a TMA store, while the producer is already loading the next tile's first slots;
- the grid is **persistent**: one program per SM (at most one per tile), program p taking tiles p, p + P,
  p + 2P, ... of a grouped order (``GROUP_M`` tile rows per band, so programs running together share B
  tiles in L2).

TMA zero-fills what lies past M, N and K on loads and clips the store, so any M, N, K works; TMA needs
16-byte aligned rows (K and N multiples of 8 elements) and a 16-byte aligned base.

Not selected anywhere (no GPU proof yet: docs/gluon.md): reached only through :func:`gemm` here, which
refuses anything but CUDA tensors on a compute capability 9.0 device. The maths of the schedule is tested on
CPU by :mod:`llm_speed.gluon.gemm_schedule`; the build by the kernel report's budgets (tests/gluon).

Layout: kernels, launcher (configuration, launch), public function.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..core import tensors
from ..core.config import KernelConfig
from ..core.hardware import Hardware, hardware_of
from ..core.launch import TMA_ALIGN_BYTES, Kernel, cdiv
from ..core.tensors import check_same_device, check_tensor
from . import compat
from .launch import DescriptorLayout, GluonPlan, check_device, tma_matrix

# --- kernels --------------------------------------------------------------------------------------------

# setmaxnreg bounds (PTX ISA, "setmaxnreg": 24 to 256, a multiple of 8). The producer only computes TMA
# coordinates; what it gives up goes to the consumers' accumulators.
PRODUCER_REGISTERS = gl.constexpr(24)
PRODUCER_WARPS = gl.constexpr(1)
CONSUMER_WARPS = 8  # two warpgroups: the kernel's num_warps


@gluon.jit
def tile_coordinates(tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """(row, column) of tile ``tile`` in the grouped order: column by column inside bands of ``GROUP_M`` tile
    rows (the same order :func:`llm_speed.gluon.gemm_schedule.tile_coordinates` models)."""
    per_band = GROUP_M * tiles_n
    band = tile // per_band
    first_row = band * GROUP_M
    rows = gl.minimum(tiles_m - first_row, GROUP_M)
    return first_row + (tile % per_band) % rows, (tile % per_band) // rows


@gluon.jit
def tma_producer(a_desc, b_desc, a_ring, b_ring, ready, empty, tiles_m, tiles_n, k_steps,
              GROUP_M: gl.constexpr, TRANS_B: gl.constexpr):  # fmt: skip
    """Load A and B tiles by TMA into the ring, slot after slot, across every tile of this program."""
    STAGES: gl.constexpr = a_ring.shape[0]
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0] if TRANS_B else b_desc.block_type.shape[1]
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    filled = 0  # slots filled so far by this program: slot filled % STAGES, round filled // STAGES
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        row, column = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        for step in range(k_steps):
            slot = filled % STAGES
            # A slot's first round finds it free: waiting on the phase before the barrier's first passes.
            mbarrier.wait(empty.index(slot), ((filled // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(slot), nbytes)
            compat.tma_load(a_desc, [row * BLOCK_M, step * BLOCK_K], ready.index(slot),
                                            a_ring.index(slot))  # fmt: skip
            if TRANS_B:
                compat.tma_load(b_desc, [column * BLOCK_N, step * BLOCK_K], ready.index(slot),
                                                b_ring.index(slot))  # fmt: skip
            else:
                compat.tma_load(b_desc, [step * BLOCK_K, column * BLOCK_N], ready.index(slot),
                                                b_ring.index(slot))  # fmt: skip
            filled += 1


@gluon.jit
def _consumers(c_desc, a_ring, b_ring, ready, empty, c_tile, tiles_m, tiles_n, k_steps,
               GROUP_M: gl.constexpr, TRANS_B: gl.constexpr, INSTR_N: gl.constexpr,
               ACC_INT32: gl.constexpr):  # fmt: skip
    """Two warpgroups: wgmma over each slot with one product in flight, then the tile out by TMA. The
    accumulator is int32 for int8 operands (``ACC_INT32``: exact, wrapping as int32 does), else fp32."""
    STAGES: gl.constexpr = a_ring.shape[0]
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    K_WIDTH: gl.constexpr = 256 // a_ring.dtype.primitive_bitwidth  # wgmma's K per instruction
    # Warps stacked along M: warpgroup w holds rows [w * BLOCK_M / 2, (w + 1) * BLOCK_M / 2) of the tile.
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, INSTR_N, K_WIDTH])  # fmt: skip
    used = 0  # slots consumed so far by this program (the producer's count, one behind or more)
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        row, column = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        if ACC_INT32:
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, acc_layout)
        else:
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
        for step in range(k_steps):
            slot = used % STAGES
            mbarrier.wait(ready.index(slot), (used // STAGES) & 1)
            if TRANS_B:
                b = b_ring.index(slot).permute((1, 0))
            else:
                b = b_ring.index(slot)
            acc = warpgroup_mma(a_ring.index(slot), b, acc, is_async=True)
            # One product stays in flight: the one before it has finished, so its slot goes back.
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((used + STAGES - 1) % STAGES), pred=step > 0)
            used += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((used + STAGES - 1) % STAGES))
        tma.store_wait(0)  # the previous tile's store has left c_tile
        c_tile.store(acc.to(c_desc.dtype))
        fence_async_shared()
        compat.tma_store(c_desc, [row * BLOCK_M, column * BLOCK_N], c_tile)
    tma.store_wait(0)


@gluon.jit
def gluon_gemm_kernel(a_desc, b_desc, c_desc, M, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                      TRANS_B: gl.constexpr, INSTR_N: gl.constexpr, ACC_INT32: gl.constexpr):  # fmt: skip
    gl.static_assert(c_desc.block_type.shape[0] == BLOCK_M and c_desc.block_type.shape[1] == BLOCK_N)
    gl.static_assert(a_desc.block_type.shape[1] == BLOCK_K)
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_tile = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=1)
    fence_async_shared()
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    gl.warp_specialize([
        (_consumers, (c_desc, a_ring, b_ring, ready, empty, c_tile, tiles_m, tiles_n, k_steps, GROUP_M,
                      TRANS_B, INSTR_N, ACC_INT32)),
        (tma_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, tiles_m, tiles_n, k_steps, GROUP_M,
                     TRANS_B)),
    ], [PRODUCER_WARPS], [PRODUCER_REGISTERS])  # fmt: skip
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(slot))
        mbarrier.invalidate(empty.index(slot))


GEMM = Kernel(gluon_gemm_kernel, "gluon_gemm")

# --- launcher -------------------------------------------------------------------------------------------

DTYPES = (torch.float16, torch.bfloat16)
INT8_DTYPES = (torch.int8,)
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.int8: gl.int8,
              torch.int32: gl.int32}  # fmt: skip
_BARRIER_BYTES = 8
# The output of each operand dtype (int8: int32, the exact accumulator).
OUT_DTYPES = {torch.float16: torch.float16, torch.bfloat16: torch.bfloat16, torch.int8: torch.int32}


def _stages(block_m: int, block_n: int, block_k: int, in_bytes: int, out_bytes: int,
            hardware: Hardware) -> int:  # fmt: skip
    """Ring slots (1 to 4) that shared memory holds beside the output tile."""
    slot = (block_m + block_n) * block_k * in_bytes + 2 * _BARRIER_BYTES
    out = block_m * block_n * out_bytes
    return max(s for s in (1, 2, 3, 4) if s == 1 or out + s * slot <= hardware.smem_per_block_bytes)


@functools.cache
def gemm_config(n: int, hardware: Hardware, dtype: torch.dtype = torch.float16) -> KernelConfig:
    """The tile of a problem with ``n`` output columns on ``hardware``: 128 rows (64 per consumer warpgroup)
    by 256 columns (128 where N is that small), 128 bytes along K (64 16-bit elements, 128 int8 ones), and as
    many ring slots (2 to 4) as shared memory holds beside the output tile. 128 x 256 x 64 is CUTLASS's
    default tile for its Hopper cooperative fp16/bf16 kernels; int8's int32 output tile is twice as large,
    so there 256 columns leave two slots and the tile is 128 x 128 x 128 with four. Untimed here
    (docs/gluon.md)."""
    in_bytes, out_bytes = dtype.itemsize, OUT_DTYPES[dtype].itemsize
    block_m, block_k = 128, 128 // in_bytes
    block_n = 256 if n > 128 else 128
    if block_n == 256 and _stages(block_m, block_n, block_k, in_bytes, out_bytes, hardware) < 3 <= _stages(
            block_m, 128, block_k, in_bytes, out_bytes, hardware):  # fmt: skip
        block_n = 128
    stages = _stages(block_m, block_n, block_k, in_bytes, out_bytes, hardware)
    if stages < 2:
        raise ValueError(
            f"{hardware.name}: {hardware.smem_per_block_bytes} B of shared memory per block do "
            f"not hold two {block_m}x{block_n}x{block_k} ring slots and the output tile"
        )
    return KernelConfig(block_m, block_n, CONSUMER_WARPS, stages, block_k=block_k, group_m=8)


def instruction_n(block_n: int) -> int:
    """wgmma's N per instruction: the largest multiple of 8 up to 256 dividing ``block_n`` (PTX ISA,
    "wgmma.mma_async": N is 8 to 256 in steps of 8 for 16-bit operands; int8 takes 128 and 256 too, the only
    widths its tiles have)."""
    return max(n for n in range(8, 257, 8) if block_n % n == 0)


@functools.cache
def _plan(m: int, n: int, k: int, dtype: torch.dtype, trans_b: bool, hardware: Hardware) -> GluonPlan:
    config = gemm_config(n, hardware, dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k

    def layout(shape, of=dtype):
        return DescriptorLayout(shape, gl.NVMMASharedLayout.get_default_for(list(shape), _GL_DTYPES[of]))

    tiles = cdiv(m, bm) * cdiv(n, bn)
    return GluonPlan(
        GEMM, (min(tiles, hardware.sm_count), 1, 1),
        dict(M=m, N=n, K=k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=config.num_stages,
             GROUP_M=config.group_m, TRANS_B=trans_b, INSTR_N=instruction_n(bn),
             ACC_INT32=dtype == torch.int8),
        dict(a_desc=layout((bm, bk)), b_desc=layout((bn, bk) if trans_b else (bk, bn)),
             c_desc=layout((bm, bn), OUT_DTYPES[dtype])),
        config.num_warps, config.num_stages,
    )  # fmt: skip


# --- public function ------------------------------------------------------------------------------------


def _check(a, b, trans_b, dtypes=DTYPES, function: str = "llm_speed.gluon.gemm") -> tuple[int, int, int]:
    check_tensor("a", a, dtypes=dtypes, dims=2, what="[M, K]")
    check_tensor("b", b, dtypes=dtypes, dims=2, what="[N, K]" if trans_b else "[K, N]")
    if type(trans_b) is not bool:
        raise TypeError(f"trans_b must be a bool, got {type(trans_b).__name__}")
    if b.dtype != a.dtype:
        raise TypeError(f"b has dtype {b.dtype}; it must match a's ({a.dtype})")
    check_same_device(a=a, b=b)
    m, k = a.shape
    n, k_b = (b.shape[0], b.shape[1]) if trans_b else (b.shape[1], b.shape[0])
    if k_b != k:
        raise ValueError(f"b must have K = {k} (a's columns) along its {'columns' if trans_b else 'rows'}, "
                         f"got shape {tuple(b.shape)}")  # fmt: skip
    for name, x in (("a", a), ("b", b)):
        if x.numel() and not tma_matrix(x):
            raise ValueError(
                f"{name} must suit a TMA descriptor: unit stride along its last dim, rows and base address "
                f"{TMA_ALIGN_BYTES}-byte aligned (rows a multiple of {TMA_ALIGN_BYTES // x.element_size()} "
                f"elements apart); got strides {tuple(x.stride())}"
            )
    out_bytes = OUT_DTYPES[a.dtype].itemsize
    if n * out_bytes % TMA_ALIGN_BYTES:
        raise ValueError(f"b: N = {n} output columns must be a multiple of {TMA_ALIGN_BYTES // out_bytes} "
                         "(the output's TMA store)")  # fmt: skip
    check_device("a", a, function)
    return m, n, k


def _run(a, b, trans_b: bool, m: int, n: int, k: int) -> torch.Tensor:
    """The checked call: the output (zeros for K = 0), and the launch unless it is empty."""
    out_dtype = OUT_DTYPES[a.dtype]
    if k == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=a.device)
    out = tensors.new_output((m, n), out_dtype, a.device)
    if m and n:
        _plan(m, n, k, a.dtype, trans_b, hardware_of(a.device)).launch(a_desc=a, b_desc=b, c_desc=out)
    return out


def gemm(a: torch.Tensor, b: torch.Tensor, *, trans_b: bool = False) -> torch.Tensor:
    """``a @ b`` (``a @ b.T`` with ``trans_b``: ``b`` an ``nn.Linear`` weight [N, K]) by the warp-specialized
    persistent Gluon kernel: fp16 or bf16 operands of one dtype, fp32 accumulation, the output [M, N] in the
    operands' dtype. CUDA tensors on a compute capability 9.0 GPU only (anything else: ValueError, before
    any work); no autograd. Not used by any other llm-speed function (unproven on a GPU: docs/gluon.md)."""
    return _run(a, b, trans_b, *_check(a, b, trans_b))


def gemm_int8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b.T`` of int8 ``a`` [M, K] and int8 ``b`` [N, K] (an ``nn.Linear`` weight: 8-bit wgmma reads
    both operands K-major) by the same warp-specialized persistent kernel, int32 accumulation, the int32
    output [M, N]: exact, wrapping as ``torch._int_mm``'s int32 does. K a multiple of 16 and N of 4 (TMA's
    16-byte rows), 16-byte aligned bases. CUDA tensors on a compute capability 9.0 GPU only (anything else:
    ValueError, before any work); no autograd. Selected by ``tensor_core_gemm_int8`` only under a launch
    policy with ``gluon_gemm_int8`` (candidate ``gluon-gemm-int8``; unproven on a GPU: docs/gluon.md)."""
    return _run(a, b, True, *_check(a, b, True, INT8_DTYPES, "llm_speed.gluon.gemm.gemm_int8"))
