"""The attention backward in Gluon for Hopper (sm_90a), written to the schedule of
:mod:`llm_speed.gluon.attention_bwd_schedule` (issue 73, stage 2): FlashAttention-3's backward structure
(Shah et al. 2024, arXiv:2407.08608, section 3 and appendix B; the dK/dV main loop of its
``hopper/mainloop_bwd_sm90_tma_gmma_ws.hpp``), one program per key block of 128 keys:

- a **producer** warpgroup, the default partition (one warp's work), loads the program's K and V block once,
  then each query block's Q and dO tiles by TMA into rings of ``STAGES`` slots (a slot is refilled once
  both consumer warpgroups have arrived on its "empty" mbarrier). It walks every query head of the K/V
  head's group, so dK and dV are summed over the group in registers (GQA without atomics);
- two **consumer warpgroups** (4-warp workers at :data:`BWD_CONSUMER_REGISTERS`; Triton gives the default
  partition what the block's pool leaves, 24: FA3's 240 / 240 / 24 split) own 64 of the block's keys each
  and keep their dK and dV in fp32 registers over the whole loop. Per query block of 64 rows: S = Q K^T
  and dP = dO V^T issued together; P = exp2(S scale log2 e - LSE log2 e) while dP is in flight;
  dS = P (dP - delta); P and dS go to shared memory, from which dV += P^T dO and dK += dS^T Q read them
  transposed, and dQ = dS K (in 64-column halves at d = 128) is a third product;
- **dQ is added by fp32 atomics** into a float32 buffer by each warpgroup (its 64 keys' share), scaled
  first. Triton 3.6's Gluon has no TMA reduction (``tma.async_atomic_add`` appears by 3.9): hence atomics,
  and a dQ that is not bitwise repeatable. The deterministic backward stays llm-speed's Triton kernel;
- delta = rowsum(dO * O) is computed by PyTorch before the launch (two elementwise ops).

Causal masks are aligned bottom-right and applied, as FA3 does, only to the query blocks that cross the
diagonal (a hidden key's score -inf before the exp2); without one only the warpgroup whose keys run past
the end masks them (the others see whole blocks). A key block starts at the first query block that sees
any of its keys. Key blocks are launched first to last over every K/V head: under a causal mask the
longest first. Compiled for sm_90a by the kernel report (tests/gluon); a candidate launch choice (off as
shipped), not yet run on a GPU.

Layout: kernels, launcher, public function.
"""

from __future__ import annotations

import functools
import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ..core import tensors
from ..core.launch import Kernel, cdiv
from . import compat
from .attention import (
    BACKWARD_HEAD_DIMS,
    DTYPES,
    WARPGROUP_ROWS,
    check_arguments,
    tile_matrix,
    warpgroup_layout,
)
from .launch import DescriptorLayout, GluonPlan, check_device

# --- kernels --------------------------------------------------------------------------------------------

LOG2E = gl.constexpr(math.log2(math.e))
_HALF = gl.constexpr(WARPGROUP_ROWS)
# Both consumers at 240: 240 + 240 + 24 (the default partition, the producer) = 504 = 12 warps x 168, the
# block's pool. At 224 dK, dV, S and dP (192 fp32 a lane) spilled.
BWD_CONSUMER_REGISTERS = gl.constexpr(240)


@gluon.jit
def _query_blocks(key_block, seq_q, seq_kv, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  IS_CAUSAL: gl.constexpr):  # fmt: skip
    """(first query block, how many) key block ``key_block`` is seen by
    (``attention_bwd_schedule.query_blocks``)."""
    n_q = gl.cdiv(seq_q, BLOCK_M)
    first = 0
    if IS_CAUSAL:
        first = gl.minimum(gl.maximum(key_block * BLOCK_N - (seq_kv - seq_q), 0) // BLOCK_M, n_q)
    return first, n_q - first


@gluon.jit
def _producer(q_desc, k_desc, v_desc, do_desc, k_tiles, v_tiles, q_ring, do_ring, kv_ready, q_ready,
              do_ready, empty, seq_q, seq_kv, heads, heads_kv, kv_pairs, IS_CAUSAL: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    STAGES: gl.constexpr = q_ring.shape[0]
    key_block = gl.program_id(0) // kv_pairs
    kv_pair = gl.program_id(0) % kv_pairs
    group = heads // heads_kv
    mbarrier.expect(kv_ready, 2 * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for w in gl.static_range(2):  # each warpgroup's 64 keys
        key = key_block * BLOCK_N + w * (BLOCK_N // 2)
        compat.tma_load(k_desc, [kv_pair, key, 0], kv_ready, k_tiles.index(w))
        compat.tma_load(v_desc, [kv_pair, key, 0], kv_ready, v_tiles.index(w))
    first, per_head = _query_blocks(key_block, seq_q, seq_kv, BLOCK_M, BLOCK_N, IS_CAUSAL)
    q_pair0 = (kv_pair // heads_kv) * heads + (kv_pair % heads_kv) * group
    for t in range(group * per_head):
        slot = t % STAGES
        mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
        q_pair = q_pair0 + t // per_head
        row = (first + t % per_head) * BLOCK_M
        mbarrier.expect(q_ready.index(slot), q_desc.block_type.nbytes)
        compat.tma_load(q_desc, [q_pair, row, 0], q_ready.index(slot), q_ring.index(slot))
        mbarrier.expect(do_ready.index(slot), do_desc.block_type.nbytes)
        compat.tma_load(do_desc, [q_pair, row, 0], do_ready.index(slot), do_ring.index(slot))


@gluon.jit
def _consumer(w, k_tiles, v_tiles, q_ring, do_ring, p_tiles, ds_tiles, kv_ready, q_ready, do_ready, empty,
              dq_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, seq_q, seq_kv, heads, heads_kv, kv_pairs, scale,
              scale2, masked, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              HEAD_DIM: gl.constexpr):  # fmt: skip
    """Warpgroup ``w``: keys [64 w, 64 w + 64) of the program's key block, against every query block.
    ``masked``: the score a hidden key gets, -inf or +inf as the scale is positive or negative (then
    ``masked * scale2`` is -inf and P 0; a zero scale is launched as a zero Q, positive ``scale2``)."""
    STAGES: gl.constexpr = q_ring.shape[0]
    HALF: gl.constexpr = _HALF
    dtype: gl.constexpr = q_ring.dtype
    # S and dP are [queries, this warpgroup's keys]: the LSE and delta are per row (2 registers a lane)
    s_layout: gl.constexpr = warpgroup_layout(HALF)
    acc_layout: gl.constexpr = warpgroup_layout(HEAD_DIM)
    DQ_SPLIT: gl.constexpr = HEAD_DIM // 64
    DQ_COLUMNS: gl.constexpr = HEAD_DIM // DQ_SPLIT
    dq_layout: gl.constexpr = warpgroup_layout(DQ_COLUMNS)
    key_block = gl.program_id(0) // kv_pairs
    kv_pair = gl.program_id(0) % kv_pairs
    group = heads // heads_kv
    k_tile = tile_matrix(k_tiles.index(w))
    v_tile = tile_matrix(v_tiles.index(w))
    p_tile = p_tiles.index(w)
    ds_tile = ds_tiles.index(w)
    key_index = gl.arange(0, HALF, layout=gl.SliceLayout(0, s_layout))
    keys = key_block * BLOCK_N + w * HALF + key_index
    partial = key_block * BLOCK_N + w * HALF + HALF > seq_kv  # this warpgroup holds keys past seq_kv
    rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    dq_rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
    dq_columns = gl.arange(0, DQ_COLUMNS, layout=gl.SliceLayout(0, dq_layout))
    dk = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    dv = gl.zeros([HALF, HEAD_DIM], gl.float32, acc_layout)
    first, per_head = _query_blocks(key_block, seq_q, seq_kv, BLOCK_M, BLOCK_N, IS_CAUSAL)
    q_pair0 = (kv_pair // heads_kv) * heads + (kv_pair % heads_kv) * group
    mbarrier.wait(kv_ready, 0)
    q_pair = q_pair0
    start = first * BLOCK_M
    diagonal = seq_kv - seq_q - (key_block * BLOCK_N + w * HALF)  # row r sees key index <= r + diagonal
    for t in range(group * per_head):  # each query head of the group, its query blocks in order
        slot = t % STAGES
        phase = (t // STAGES) & 1
        q_tile = tile_matrix(q_ring.index(slot))
        do_tile = tile_matrix(do_ring.index(slot))
        # S = Q K^T and dP = dO V^T issued together; the softmax runs while dP is in flight
        mbarrier.wait(q_ready.index(slot), phase)
        s = hopper.warpgroup_mma(q_tile, k_tile.permute((1, 0)),
                                 gl.zeros([BLOCK_M, HALF], gl.float32, s_layout), use_acc=False,
                                 is_async=True)  # fmt: skip
        mbarrier.wait(do_ready.index(slot), phase)
        dp = hopper.warpgroup_mma(do_tile, v_tile.permute((1, 0)),
                                  gl.zeros([BLOCK_M, HALF], gl.float32, s_layout), use_acc=False,
                                  is_async=True)  # fmt: skip
        # scalar bases and int32 offsets within them (64-bit addresses per row spilled at d = 128)
        first_row = q_pair.to(gl.int64) * seq_q + start
        in_q = rows < seq_q - start
        # rows past seq_q (TMA's zeros) get LSE +inf: P = 0 there with no mask
        lse2 = gl.load(lse_ptr + first_row + rows, mask=in_q, other=float("inf")) * LOG2E
        # a row that sees no key (LSE -inf) takes +inf too: its hidden scores' exponent is not -inf - -inf
        lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
        delta = gl.load(delta_ptr + first_row + rows, mask=in_q, other=0.0)
        if IS_CAUSAL:  # a visible key is below seq_kv for every row below seq_q
            # (key - key0) <= row + (start + seq_kv - seq_q - key0), everything variable on the rows' side:
            # [rows, keys] of key - row would be hoisted out of the loop (32 registers a lane, spilled)
            last = rows + (start + diagonal)
        s = hopper.warpgroup_mma_wait(1, deps=(s,))  # S retires; dP stays in flight
        # The mask replaces S before the one multiply-add, and under a causal mask only on the blocks that
        # cross the diagonal (FlashAttention-3 masks those alone): elsewhere (where(P) after the exp2, on
        # S * scale2, on every block) it spilled 4-10 LDL/STL in the loop at d = 128 (docs/gluon.md)
        # Without a causal mask only the warpgroup holding keys past seq_kv masks: there S = 0 (TMA's zero
        # K rows) would give P = exp(-LSE) and dS = -P delta, which fp16 rounds to inf past 65504, and
        # inf x the zero K row is NaN in dQ (audit 18)
        if IS_CAUSAL:
            if start + diagonal < HALF - 1:  # row 0 misses the last key: a block on the diagonal
                s = gl.where(gl.expand_dims(key_index, 0) <= gl.expand_dims(last, 1), s, masked)
        else:
            if partial:
                s = gl.where(gl.expand_dims(keys < seq_kv, 0), s, masked)
        p = gl.exp2(gl.minimum(s * scale2 - gl.expand_dims(lse2, 1), 0.0))  # as the Triton backward: <= 1
        dp = hopper.warpgroup_mma_wait(0, deps=(dp,))
        ds = p * (dp - gl.expand_dims(delta, 1))
        # P and dS reach the dK/dV products transposed, through shared memory
        p_tile.store(p.to(dtype))
        ds_tile.store(ds.to(dtype))
        fence_async_shared()
        dv = hopper.warpgroup_mma(p_tile.permute((1, 0)), do_tile, dv, is_async=True)
        dk = hopper.warpgroup_mma(ds_tile.permute((1, 0)), q_tile, dk, is_async=True)
        dv, dk = hopper.warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(empty.index(slot))
        # dQ = dS K over this warpgroup's keys, in column halves at d = 128 (32 fp32 registers a lane beside
        # dK and dV), each added by atomics from one scalar base (per-element 64-bit addresses spilled)
        dq_block = dq_ptr + first_row * HEAD_DIM
        in_rows = gl.expand_dims(dq_rows < seq_q - start, 1)
        for c in gl.static_range(DQ_SPLIT):
            dq = hopper.warpgroup_mma(ds_tile, k_tile.slice(c * DQ_COLUMNS, DQ_COLUMNS, dim=1),
                                      gl.zeros([BLOCK_M, DQ_COLUMNS], gl.float32, dq_layout), use_acc=False,
                                      is_async=True)  # fmt: skip
            dq = hopper.warpgroup_mma_wait(0, deps=(dq,))
            inside = gl.expand_dims(dq_rows * HEAD_DIM, 1) + gl.expand_dims(c * DQ_COLUMNS + dq_columns, 0)
            gl.atomic_add(dq_block + inside, dq * scale, mask=in_rows, sem="relaxed")
        start += BLOCK_M  # the next block, or the next head's first (no division in the loop)
        if start >= seq_q:
            q_pair += 1
            start = first * BLOCK_M
    # dK = scale dS^T Q (the scale left out of dS above); keys past seq_kv are not stored
    out_keys = key_block * BLOCK_N + w * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, acc_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    rows_out = (kv_pair.to(gl.int64) * seq_kv + out_keys) * HEAD_DIM
    offsets = gl.expand_dims(rows_out, 1) + gl.expand_dims(dims, 0)
    mask = gl.expand_dims(out_keys < seq_kv, 1)
    gl.store(dk_ptr + offsets, (dk * scale).to(dtype), mask=mask)
    gl.store(dv_ptr + offsets, dv.to(dtype), mask=mask)


@gluon.jit
def gluon_attention_bwd_kernel(q_desc, k_desc, v_desc, do_desc, dq_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr,
                               seq_q, seq_kv, heads, heads_kv, kv_pairs, scale, scale2, masked,
                               IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
    gl.static_assert(BLOCK_N == 2 * 64)
    k_tiles = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
    v_tiles = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
    q_ring = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N // 2], q_desc.dtype)
    p_tiles = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, BLOCK_N // 2], ds_layout)
    ds_tiles = gl.allocate_shared_memory(q_desc.dtype, [2, BLOCK_M, BLOCK_N // 2], ds_layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready, count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(slot), count=1)
        mbarrier.init(do_ready.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=2)  # both warpgroups
    fence_async_shared()
    # (the argument tuples are written out: a tuple held in a variable turns its constexprs into tensors)
    gl.warp_specialize([
        (_producer, (q_desc, k_desc, v_desc, do_desc, k_tiles, v_tiles, q_ring, do_ring, kv_ready, q_ready,
                     do_ready, empty, seq_q, seq_kv, heads, heads_kv, kv_pairs, IS_CAUSAL, BLOCK_M, BLOCK_N)),
        (_consumer, (0, k_tiles, v_tiles, q_ring, do_ring, p_tiles, ds_tiles, kv_ready, q_ready, do_ready,
                     empty, dq_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, seq_q, seq_kv, heads, heads_kv,
                     kv_pairs, scale, scale2, masked, IS_CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM)),
        (_consumer, (1, k_tiles, v_tiles, q_ring, do_ring, p_tiles, ds_tiles, kv_ready, q_ready, do_ready,
                     empty, dq_ptr, dk_ptr, dv_ptr, lse_ptr, delta_ptr, seq_q, seq_kv, heads, heads_kv,
                     kv_pairs, scale, scale2, masked, IS_CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM)),
    ], [4, 4], [BWD_CONSUMER_REGISTERS, BWD_CONSUMER_REGISTERS])  # fmt: skip


ATTENTION_BWD = Kernel(gluon_attention_bwd_kernel, "gluon_attention_bwd")

# --- launcher -------------------------------------------------------------------------------------------

_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}
BLOCK_M = 64  # queries per block: wgmma's M for S, dP and dQ
BLOCK_N = 2 * WARPGROUP_ROWS  # keys per program, 64 per consumer warpgroup
STAGES = 2


@functools.cache
def _plan(batch: int, heads: int, heads_kv: int, seq_q: int, seq_kv: int, head_dim: int, dtype: torch.dtype,
          is_causal: bool) -> GluonPlan:  # fmt: skip
    gl_dtype = _GL_DTYPES[dtype]

    def layout(shape):
        return DescriptorLayout(shape, gl.NVMMASharedLayout.get_default_for(list(shape), gl_dtype))

    kv_pairs = batch * heads_kv
    # one program per key block and K/V head, key-block major (the longest first under a causal mask)
    return GluonPlan(
        ATTENTION_BWD, (cdiv(seq_kv, BLOCK_N) * kv_pairs, 1, 1),
        dict(seq_q=seq_q, seq_kv=seq_kv, heads=heads, heads_kv=heads_kv, kv_pairs=kv_pairs,
             IS_CAUSAL=is_causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, HEAD_DIM=head_dim, STAGES=STAGES),
        dict(q_desc=layout((1, BLOCK_M, head_dim)), k_desc=layout((1, WARPGROUP_ROWS, head_dim)),
             v_desc=layout((1, WARPGROUP_ROWS, head_dim)), do_desc=layout((1, BLOCK_M, head_dim))),
        4, STAGES,
    )  # fmt: skip


# --- public function ------------------------------------------------------------------------------------


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
             dout: torch.Tensor, *, is_causal: bool = False, scale: float | None = None,
             dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(dq, dk, dv) of softmax(q k^T * scale) v by the warp-specialized Gluon backward, from the forward's
    ``out`` and ``lse`` (float32 [B, H, Sq], natural log, as :func:`llm_speed.gluon.attention.forward`
    returns it) and the output gradient ``dout``: q, out, dout [B, H, Sq, D], k and v [B, H_kv, Skv, D],
    contiguous (``dout`` is made contiguous), H a multiple of H_kv, fp16 or bf16, D 64 or 128; causal masks
    aligned bottom-right. ``dlse``: the gradient of ``lse`` where the LSE was used too (float32 like it; it
    enters delta = rowsum(dO * O) - dLSE). dk and dv are summed over each K/V head's query group. dq is
    added by fp32 atomics: not bitwise repeatable. CUDA tensors on a compute capability 9.0 GPU only
    (anything else: ValueError before any work). Unproven on a GPU; ``flash_attention``'s backward launches
    it only under a launch policy naming it (candidate ``gluon-backward``)."""
    scale = check_arguments(q, k, v, is_causal, scale, BACKWARD_HEAD_DIMS)
    batch, heads, seq_q, head_dim = q.shape
    for name, x in (("out", out), ("dout", dout)):
        tensors.check_tensor(name, x, dtypes=DTYPES, dims=4, what="[B, H, Sq, D]")
        if x.shape != q.shape or x.dtype != q.dtype:
            raise ValueError(f"{name} must be {tuple(q.shape)} {q.dtype} like q, got {tuple(x.shape)} "
                             f"{x.dtype}")  # fmt: skip
    if not out.is_contiguous():
        raise ValueError("out must be contiguous [B, H, Sq, D]")
    tensors.check_tensor("lse", lse, dtypes=(torch.float32,), dims=3, what="[B, H, Sq]")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"lse must be {tuple(q.shape[:3])} (q's [B, H, Sq]), got {tuple(lse.shape)}")
    if dlse is not None:
        tensors.check_tensor("dlse", dlse, dtypes=(torch.float32,), dims=3, what="[B, H, Sq]")
        if dlse.shape != lse.shape:
            raise ValueError(f"dlse must be {tuple(lse.shape)} like lse, got {tuple(dlse.shape)}")
    tensors.check_same_device(q=q, k=k, v=v, out=out, lse=lse, dout=dout, dlse=dlse)
    check_device("q", q, "llm_speed.gluon.attention_bwd")
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    device = q.device
    dk = tensors.new_output(k.shape, k.dtype, device)
    dv = tensors.new_output(v.shape, v.dtype, device)
    if seq_kv == 0 or q.numel() == 0:  # no key, or no query: every gradient is zero
        return torch.zeros_like(q), dk.zero_(), dv.zero_()
    dout = dout.contiguous()
    lse = lse.contiguous()
    delta = (dout.float() * out.float()).sum(-1)
    if dlse is not None:
        delta = delta - dlse
    dq = torch.zeros(q.shape, dtype=torch.float32, device=device)
    plan = _plan(batch, heads, heads_kv, seq_q, seq_kv, head_dim, q.dtype, is_causal)
    # the kernel hides a key by its score (-inf or +inf, as the scale's sign turns it into -inf); a zero scale
    # makes every score 0 whatever Q is, so Q is read as zeros with a positive scale2 (dQ and dK still take
    # the zero scale)
    scores_q = torch.zeros_like(q) if scale == 0 else q
    # 3-D views (batch x heads, seq, D): a partial block reads TMA's zeros, not the next head's rows (0 x an
    # inf there would be NaN in this head's gradients)
    plan.launch(q_desc=scores_q.flatten(0, 1), k_desc=k.flatten(0, 1), v_desc=v.flatten(0, 1),
                do_desc=dout.flatten(0, 1), dq_ptr=dq, dk_ptr=dk, dv_ptr=dv,
                lse_ptr=lse, delta_ptr=delta, scale=scale,
                scale2=(scale if scale != 0 else 1.0) * math.log2(math.e),
                masked=-math.inf if scale >= 0 else math.inf)  # fmt: skip
    return dq.to(q.dtype), dk, dv
