"""A warp-specialized persistent Gluon GEMM for Hopper (sm_90a) over block-scaled fp8:
``out = (a * scale_a) @ (b * scale_b).T (+ bias)`` for e4m3 ``a`` [M, K] with one scale per row and 128-wide K
group (``scale_a`` [M, cdiv(K, 128)]) and e4m3 ``b`` [N, K] (an ``nn.Linear`` weight) with one scale per
128 x 128 block (``scale_b`` [cdiv(N, 128), cdiv(K, 128)]): the 1x128 / 128x128 scaling of DeepSeek-V3
(arXiv:2412.19437, section 3.3.2) and of :func:`llm_speed.matmul.fp8.gemm_fp8` with ``trans_b=True``.

The structure is :mod:`llm_speed.gluon.gemm`'s: a one-warp TMA **producer** (the same
:func:`~llm_speed.gluon.gemm.tma_producer`) fills a ring of A and B tiles, two consumer warpgroups own 64 of a
tile's 128 rows each, and the grid is persistent over the same grouped tile order. Here each consumer
warpgroup is a partition of its own (the default one, and a worker), freeing each slot by its own arrival (the
"empty" barriers count two) and storing its own rows: Triton puts a barrier across a partition's warps at
every mbarrier wait and arrive, so in one 8-warp partition the two warpgroups would promote in lockstep, with
no product of theirs in flight; apart, one may promote while the other's product runs (the overlap
DeepSeek-V3's section 3.3.2 counts on for two warpgroups on the H800). What differs from the GEMM is the
**promotion** (DeepSeek-V3, section 3.3.2, "Increasing Accumulation Precision"; deepseek-ai/DeepGEMM's
README): Hopper's fp8 wgmma accumulates in fewer bits than fp32, so each K step of 128 (one scaling group)
runs as its own wgmma into a fresh product, and once it has retired the consumers add it, times ``scale_a[row,
step] * scale_b[n block, step]``, into a separate fp32 accumulator in registers (an FMA per element). A tile
is 128 x 128, so its columns lie in one block of ``b``'s scales: one ``scale_b`` value per step.

The scales are not in the ring: they are a few hundred bytes per tile, read by the consumers themselves
with plain loads (two ``scale_a`` values and one ``scale_b`` per thread and step, from L2), issued before
the step's mbarrier wait so that their latency hides behind the wait and the product. ``scale_a`` is
[M, K/128] with K groups along its rows, which a TMA box cannot take (its inner dimension would be one
4-byte value; DeepGEMM's README requires that scale "TMA-aligned and transposed" instead).

TMA zero-fills past M, N and K and clips the store, so M, N and K need no padding; K need not be a multiple
of 128 (its last group is partial, as :func:`llm_speed.matmul.fp8.gemm_fp8` allows). TMA needs 16-byte rows:
K a multiple of 16, N a multiple of 8 (the 16-bit output).

Not selected as shipped (no GPU proof: docs/gluon.md, "GEMM fp8"); :mod:`llm_speed.gluon.gemm_fp8_select` says
which calls it takes when the launch policy's ``gluon_gemm_fp8`` is on (``matmul.fp8.gemm_forward`` asks). The
schedule's maths is tested on CPU by :mod:`llm_speed.gluon.gemm_fp8_schedule`; the build by the kernel report
(``llm-speed kernels --op gluon_gemm_fp8``).

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
from ..core.tensors import FLOAT_DTYPES, check_same_device, check_tensor, dtype_names
from . import compat
from .gemm import PRODUCER_REGISTERS, PRODUCER_WARPS, tile_coordinates, tma_producer
from .gemm_fp8_select import FP8_DTYPE, OUT_DTYPES
from .launch import DescriptorLayout, GluonPlan, check_device, tma_matrix

# --- kernels --------------------------------------------------------------------------------------------

# The side of a scaling group along K and of a block of b's scales (DeepSeek-V3's 1x128 and 128x128).
SCALE_BLOCK = 128
_SCALE_BLOCK = gl.constexpr(SCALE_BLOCK)  # the same, as the kernels read it
# Each consumer warpgroup is a partition of its own (the default one and a worker), so that neither waits
# for the other at its mbarrier waits and arrives (Triton syncs a partition's warps there).
WARPGROUP_WARPS = 4
CONSUMER_WARPS = gl.constexpr(WARPGROUP_WARPS)
# The worker consumer's registers: the default partition runs with what the block's pool (12 warps x 168 =
# 504 a lane) leaves after the workers: 504 - 224 - 24 = 256 (docs/gluon.md, the forward attention's split).
WORKER_CONSUMER_REGISTERS = gl.constexpr(224)


@gluon.jit
def _consumer(c_desc, a_ring, b_ring, ready, empty, c_tiles, sa_ptr, sb_ptr, bias_ptr, M, N, tiles_m, tiles_n,
              k_steps, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_bias, GROUP_M: gl.constexpr,
              HAS_BIAS: gl.constexpr, WARPGROUP: gl.constexpr):  # fmt: skip
    """One consumer warpgroup, rows [WARPGROUP * 64, + 64) of each tile: per K step one wgmma into a fresh
    product, waited for, its slot freed (the other warpgroup frees it too: the barrier counts both), then
    promoted into the fp32 accumulator at the step's scales; after a tile, the bias and a TMA store of its
    rows."""
    STAGES: gl.constexpr = a_ring.shape[0]
    ROWS: gl.constexpr = c_desc.block_type.shape[0]  # a warpgroup's rows of the tile
    BLOCK_M: gl.constexpr = a_ring.shape[1]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    K_WIDTH: gl.constexpr = 256 // a_ring.dtype.primitive_bitwidth  # wgmma's K per instruction: 32 for fp8
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_N, K_WIDTH])  # fmt: skip
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    c_tile = c_tiles.index(WARPGROUP)
    used = 0  # slots consumed so far by this program
    for tile in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
        row, column = tile_coordinates(tile, tiles_m, tiles_n, GROUP_M)
        first = row * BLOCK_M + WARPGROUP * ROWS
        rows = first + gl.arange(0, ROWS, layout=row_layout)
        # Rows past M (zero-filled A, clipped by the store) read row M - 1's scales rather than none.
        sa_rows = sa_ptr + gl.minimum(rows, M - 1).to(gl.int64) * stride_sam
        sb_block = sb_ptr + column * stride_sbn  # BLOCK_N == SCALE_BLOCK: the tile's one block of b's scales
        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout)
        for step in range(k_steps):
            slot = used % STAGES
            scale = gl.load(sa_rows + step * stride_sak) * gl.load(sb_block + step * stride_sbk)  # [ROWS]
            mbarrier.wait(ready.index(slot), (used // STAGES) & 1)
            product = warpgroup_mma(a_ring.index(slot).slice(WARPGROUP * ROWS, ROWS),
                                    b_ring.index(slot).permute((1, 0)),
                                    gl.zeros([ROWS, BLOCK_N], gl.float32, acc_layout), use_acc=False,
                                    is_async=True)  # fmt: skip
            product = warpgroup_mma_wait(0, deps=(product,))
            mbarrier.arrive(empty.index(slot))  # this warpgroup's product has read the slot
            acc += product * gl.expand_dims(scale, 1)
            used += 1
        if HAS_BIAS:
            columns = column * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            bias = gl.load(bias_ptr + columns.to(gl.int64) * stride_bias, mask=columns < N, other=0.0)
            acc += gl.expand_dims(bias.to(gl.float32), 0)
        tma.store_wait(0)  # the previous tile's store has left c_tile
        c_tile.store(acc.to(c_desc.dtype))
        fence_async_shared()
        compat.tma_store(c_desc, [first, column * BLOCK_N], c_tile)
    tma.store_wait(0)


@gluon.jit
def gluon_gemm_fp8_kernel(a_desc, b_desc, c_desc, sa_ptr, sb_ptr, bias_ptr, M, N, K, stride_sam, stride_sak,
                          stride_sbn, stride_sbk, stride_bias, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                          HAS_BIAS: gl.constexpr):  # fmt: skip
    gl.static_assert(BLOCK_K == _SCALE_BLOCK and BLOCK_N == _SCALE_BLOCK,
                     "a K step is one scaling group and a tile's columns one block of b's scales")
    gl.static_assert(c_desc.block_type.shape[0] * 2 == BLOCK_M and c_desc.block_type.shape[1] == BLOCK_N)
    gl.static_assert(a_desc.block_type.shape[1] == BLOCK_K and b_desc.block_type.shape[0] == BLOCK_N)
    a_ring = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_ring = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_tiles = gl.allocate_shared_memory(c_desc.dtype, [2] + c_desc.block_type.shape, c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=2)  # both consumer warpgroups free each slot
    fence_async_shared()
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    k_steps = gl.cdiv(K, BLOCK_K)
    gl.warp_specialize([
        (_consumer, (c_desc, a_ring, b_ring, ready, empty, c_tiles, sa_ptr, sb_ptr, bias_ptr, M, N, tiles_m,
                     tiles_n, k_steps, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_bias, GROUP_M,
                     HAS_BIAS, 0)),
        (_consumer, (c_desc, a_ring, b_ring, ready, empty, c_tiles, sa_ptr, sb_ptr, bias_ptr, M, N, tiles_m,
                     tiles_n, k_steps, stride_sam, stride_sak, stride_sbn, stride_sbk, stride_bias, GROUP_M,
                     HAS_BIAS, 1)),
        (tma_producer, (a_desc, b_desc, a_ring, b_ring, ready, empty, tiles_m, tiles_n, k_steps, GROUP_M,
                        True)),
    ], [CONSUMER_WARPS, PRODUCER_WARPS], [WORKER_CONSUMER_REGISTERS, PRODUCER_REGISTERS])  # fmt: skip
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(slot))
        mbarrier.invalidate(empty.index(slot))


GEMM_FP8 = Kernel(gluon_gemm_fp8_kernel, "gluon_gemm_fp8")

# --- launcher -------------------------------------------------------------------------------------------

_BARRIER_BYTES = 8
MAX_STAGES = 8


@functools.cache
def gemm_fp8_config(hardware: Hardware) -> KernelConfig:
    """The tile on ``hardware``: 128 x 128 x 128 (two 64-row consumer warpgroups; one scaling group per K
    step; the tile's columns in one block of b's scales) and as many ring slots (2 to :data:`MAX_STAGES`) as
    shared memory holds beside the 16-bit output tile: 6 on an H100 (6 x 32 KiB + 32 KiB). DeepGEMM's
    fp8 kernels pick among several N widths per shape; this one is fixed, untuned (docs/gluon.md)."""
    block_m = block_n = block_k = SCALE_BLOCK
    slot = (block_m + block_n) * block_k + 2 * _BARRIER_BYTES  # one byte per fp8 element
    out = block_m * block_n * 2
    fits = [s for s in range(1, MAX_STAGES + 1) if out + s * slot <= hardware.smem_per_block_bytes]
    if len(fits) < 2:
        raise ValueError(
            f"{hardware.name}: {hardware.smem_per_block_bytes} B of shared memory per block do "
            f"not hold two {block_m}x{block_n}x{block_k} fp8 ring slots and the output tile"
        )
    return KernelConfig(block_m, block_n, WARPGROUP_WARPS, max(fits), block_k=block_k, group_m=8)


@functools.cache
def _plan(m: int, n: int, k: int, out_dtype: torch.dtype, has_bias: bool, scale_strides: tuple,
          bias_stride: int, hardware: Hardware) -> GluonPlan:  # fmt: skip
    config = gemm_fp8_config(hardware)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    out_gl = gl.bfloat16 if out_dtype == torch.bfloat16 else gl.float16

    def layout(shape, dtype):
        return DescriptorLayout(shape, gl.NVMMASharedLayout.get_default_for(list(shape), dtype))

    (stride_sam, stride_sak), (stride_sbn, stride_sbk) = scale_strides
    tiles = cdiv(m, bm) * cdiv(n, bn)
    return GluonPlan(
        GEMM_FP8, (min(tiles, hardware.sm_count), 1, 1),
        dict(M=m, N=n, K=k, stride_sam=stride_sam, stride_sak=stride_sak, stride_sbn=stride_sbn,
             stride_sbk=stride_sbk, stride_bias=bias_stride, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
             STAGES=config.num_stages, GROUP_M=config.group_m, HAS_BIAS=has_bias),
        dict(a_desc=layout((bm, bk), gl.float8e4nv), b_desc=layout((bn, bk), gl.float8e4nv),
             c_desc=layout((bm // 2, bn), out_gl)),  # each warpgroup stores its rows
        config.num_warps, config.num_stages,
    )  # fmt: skip


# --- public function ------------------------------------------------------------------------------------


def _check(a, b, scale_a, scale_b, out_dtype, bias) -> tuple[int, int, int]:
    check_tensor("a", a, dtypes=(FP8_DTYPE,), dims=2, what="[M, K]")
    check_tensor("b", b, dtypes=(FP8_DTYPE,), dims=2, what="[N, K] (an nn.Linear weight)")
    m, k = a.shape
    n = b.shape[0]
    if b.shape[1] != k:
        raise ValueError(f"b must be [N, K] with K = {k} (a's columns), got shape {tuple(b.shape)}")
    groups = cdiv(k, SCALE_BLOCK)
    for name, scale, shape, what in (
        ("scale_a", scale_a, (m, groups), "[M, cdiv(K, 128)]: one per row and 128-wide K group"),
        ("scale_b", scale_b, (cdiv(n, SCALE_BLOCK), groups),
         "[cdiv(N, 128), cdiv(K, 128)]: one per 128x128 block"),
    ):  # fmt: skip
        check_tensor(name, scale, dtypes=(torch.float32,), dims=2, what=what)
        if tuple(scale.shape) != shape:
            raise ValueError(f"{name} must be {what}, i.e. {list(shape)}, got shape {tuple(scale.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be one of {dtype_names(OUT_DTYPES)}, got {out_dtype}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES, dims=1, what="[N]")
        if bias.shape[0] != n:
            raise ValueError(f"bias has {bias.shape[0]} elements; it must have N = {n}")
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, bias=bias)
    for name, x in (("a", a), ("b", b)):
        if x.numel() and not tma_matrix(x):
            raise ValueError(
                f"{name} must suit a TMA descriptor: K contiguous (unit stride along its last dim), rows and "
                f"base address {TMA_ALIGN_BYTES}-byte aligned (K a multiple of 16 for a dense tensor); got "
                f"strides {tuple(x.stride())}"
            )
    if n * 2 % TMA_ALIGN_BYTES:
        raise ValueError(f"b: N = {n} output columns must be a multiple of 8 (the output's TMA store)")
    check_device("a", a, "llm_speed.gluon.gemm_fp8")
    return m, n, k


def gemm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b).T + bias`` by the warp-specialized persistent Gluon kernel, each
    128-wide K group's product promoted into an fp32 accumulator at its scales.

    ``a`` [M, K] and ``b`` [N, K] float8_e4m3fn, K contiguous; ``scale_a`` [M, cdiv(K, 128)] and ``scale_b``
    [cdiv(N, 128), cdiv(K, 128)] float32, any strides (what :func:`llm_speed.matmul.fp8.quantize_fp8`
    returns at granularities (1, 128) and (128, 128)); ``bias`` [N] float16, bfloat16 or float32, added in
    fp32; ``out_dtype`` bfloat16 or float16. CUDA tensors on a compute capability 9.0 GPU only (anything
    else: ValueError, before any work); no autograd. Not used by any other llm-speed function as shipped
    (unproven on a GPU: docs/gluon.md)."""
    m, n, k = _check(a, b, scale_a, scale_b, out_dtype, bias)
    if k == 0:  # the empty sum (no scaling group to read)
        out = torch.zeros(m, n, dtype=out_dtype, device=a.device)
        return out if bias is None else out.add_(bias.to(out_dtype))
    out = tensors.new_output((m, n), out_dtype, a.device)
    if m == 0 or n == 0:
        return out
    scale_strides = ((scale_a.stride(0), scale_a.stride(1)), (scale_b.stride(0), scale_b.stride(1)))
    plan = _plan(m, n, k, out_dtype, bias is not None, scale_strides, 0 if bias is None else bias.stride(0),
                 hardware_of(a.device))  # fmt: skip
    plan.launch(a_desc=a, b_desc=b, c_desc=out, sa_ptr=scale_a, sb_ptr=scale_b,
                bias_ptr=out if bias is None else bias)  # fmt: skip
    return out
