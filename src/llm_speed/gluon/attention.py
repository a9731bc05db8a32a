"""The forward attention in Gluon for Hopper (sm_90a), written to the schedule of
:mod:`llm_speed.gluon.attention_schedule` (issue 73, stage 1): FlashAttention-3's structure (Shah et al.
2024, arXiv:2407.08608, sections 3.1-3.2).

- a **producer** warpgroup, the default partition (one warp's work), loads each work item's Q tile and its
  K and V blocks by TMA into rings of ``STAGES`` slots ("ready" / "empty" mbarriers per slot; a slot is
  refilled once both consumer warpgroups have arrived on its "empty" one). Q's buffer is freed once both
  warpgroups' last QK^T of the item has retired, so the next item's Q loads under the last PV and stores;
- two **consumer warpgroups**, 4-warp workers at :data:`CONSUMER_REGISTERS` each (Triton gives the default
  partition what the block's pool leaves, 24: FA3's 240 / 240 / 24 split, docs/gluon.md "register pool"),
  each own 64 of a tile's 128 query rows and take turns (**ping-pong**) to issue their products, passing the
  turn through a pair of mbarriers (Gluon has no named-barrier API), so one warpgroup's softmax runs under
  the other's wgmma;
- within a warpgroup, the next block's QK^T is issued beside the previous block's PV, **before this
  block's softmax** (``warpgroup_mma_wait(1)`` retires S and keeps the PV in flight); O is rescaled once the
  PV has retired; the softmax is base 2 with the scale folded into one multiply; P goes to wgmma from
  registers in the inputs' dtype;
- a **persistent** grid, work items in row order or, under a causal mask, longest first;
- only the key blocks that need it are masked where the build allows (``SPLIT_MASK``: the blocks every
  row sees whole in a loop of their own, then the rest; :func:`split_mask`), and none without a causal
  mask where the keys fill whole blocks (``WHOLE_BLOCKS``: a plan value, as the plan is per length).

Q, K and V are read through 3-D descriptors over [B H, S, D] views: a head's partial last block is TMA's
zeros, never the next head's rows (a weight of 0 times an inf there is NaN). The output and the LSE
(natural log) are stored with masked stores.

fp8 (``FP8``: e4m3 q, k, v, FA3's forward-only fp8, section 3.3): an fp8 wgmma reads both shared-memory
operands K-major, so the PV product takes V^T: the host transposes V by one copy
(:func:`llm_speed.attention.plans.transposed_values`) and the producer loads [D, BLOCK_N] tiles of it. P is
computed at 2**8 times its value and converted to e4m3 in registers for the PV product; descale_q descale_k
multiply the exp2's folded scale and descale_v the output (bfloat16), as llm-speed's Triton fp8 attention
does.

Compiled for sm_90a by the kernel report (tests/gluon); a candidate launch choice (off as shipped), not yet
run on a GPU.

Layout: kernels, launcher, public function.
"""

from __future__ import annotations

import functools
import math

import torch
from triton import constexpr_function
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

from ..attention.plans import transposed_values
from ..attention.reference import FP8_WEIGHTS_OFFSET
from ..core import runtime, tensors
from ..core.hardware import Hardware, hardware_of
from ..core.launch import Kernel, cdiv
from . import compat
from .launch import DescriptorLayout, GluonPlan, check_device

# --- kernels --------------------------------------------------------------------------------------------

# Both consumers at 240: 240 + 240 + 24 (the default partition, the producer warpgroup) = 504 = 12 warps x
# 168, the block's pool. With a consumer as the default partition (256, Triton's choice) the other was held
# to 224, where d = 256 spilled (17 LDL/STL in loops, 26 causal; sm_90a, Triton 3.6).
CONSUMER_REGISTERS = gl.constexpr(240)
LOG2E = gl.constexpr(math.log2(math.e))
LN2 = gl.constexpr(math.log(2.0))
P8_OFFSET = gl.constexpr(float(FP8_WEIGHTS_OFFSET))
WARPGROUP_ROWS = 64  # one warpgroup's rows: wgmma's M
_HALF = gl.constexpr(WARPGROUP_ROWS)


@constexpr_function
def warpgroup_layout(columns, k=16):
    """The register layout of one warpgroup's wgmma accumulator (64 rows x ``columns``; ``k``: the
    instruction's K, 16 for 16-bit operands, 32 for fp8)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, columns, k])


@gluon.jit
def _work_item(index, n_blocks, pairs, section, LONGEST_FIRST: gl.constexpr):
    """(query block, batch-head pair) of work item ``index`` (``attention_schedule.work_items``)."""
    if LONGEST_FIRST:
        per_section = section * n_blocks
        first = (index // per_section) * section
        width = gl.minimum(section, pairs - first)
        rest = index % per_section
        block = n_blocks - 1 - rest // width
        pair = first + rest % width
    else:
        block = index % n_blocks
        pair = index // n_blocks
    return block, pair


@gluon.jit
def _key_blocks(block, seq_q, seq_kv, kv_blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                IS_CAUSAL: gl.constexpr):  # fmt: skip
    """Key blocks query block ``block`` reads (``attention_schedule.key_blocks``); ``kv_blocks``: all of
    them, cdiv(seq_kv, BLOCK_N), an argument (computed in the kernel, it was hoisted above the partitions'
    split, held over ``setmaxnreg`` and spilled: d = 256, causal)."""
    blocks = kv_blocks
    if IS_CAUSAL:
        last_key = gl.minimum((block + 1) * BLOCK_M, seq_q) - 1 + seq_kv - seq_q
        blocks = gl.maximum(0, gl.minimum(blocks, gl.cdiv(last_key + 1, BLOCK_N)))
    return blocks


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_tiles, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready,
              v_empty, seq_q, seq_kv, kv_blocks, heads, heads_kv, n_blocks, pairs, section,
              IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              V_TRANSPOSED: gl.constexpr):  # fmt: skip
    """``V_TRANSPOSED`` (fp8): ``v_desc`` is over V^T's [B H_kv D, Skv] rows, its tiles [D, BLOCK_N]."""
    STAGES: gl.constexpr = k_ring.shape[0]
    HEAD_DIM: gl.constexpr = k_ring.shape[3]
    filled = 0
    done = 0
    for index in range(gl.program_id(0), n_blocks * pairs, gl.num_programs(0)):
        block, pair = _work_item(index, n_blocks, pairs, section, IS_CAUSAL)
        kv_pair = (pair // heads) * heads_kv + (pair % heads) // (heads // heads_kv)
        mbarrier.wait(q_empty, (done & 1) ^ 1)  # both warpgroups' QK^Ts of the last item have retired
        mbarrier.expect(q_ready, 2 * q_desc.block_type.nbytes)
        for w in gl.static_range(2):  # each warpgroup's half of the tile
            compat.tma_load(q_desc, [pair, block * BLOCK_M + w * (BLOCK_M // 2), 0], q_ready,
                            q_tiles.index(w))  # fmt: skip
        for j in range(_key_blocks(block, seq_q, seq_kv, kv_blocks, BLOCK_M, BLOCK_N, IS_CAUSAL)):
            slot = filled % STAGES
            parity = ((filled // STAGES) & 1) ^ 1
            mbarrier.wait(k_empty.index(slot), parity)
            mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
            compat.tma_load(k_desc, [kv_pair, j * BLOCK_N, 0], k_ready.index(slot), k_ring.index(slot))
            mbarrier.wait(v_empty.index(slot), parity)
            mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
            if V_TRANSPOSED:
                compat.tma_load(v_desc, [kv_pair * HEAD_DIM, j * BLOCK_N], v_ready.index(slot),
                                v_ring.index(slot))  # fmt: skip
            else:
                compat.tma_load(v_desc, [kv_pair, j * BLOCK_N, 0], v_ready.index(slot), v_ring.index(slot))
            filled += 1
        done += 1


@gluon.jit
def _first_masked_block(first_row, seq_q, seq_kv, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """The first key block a warpgroup whose rows start at ``first_row`` masks
    (``attention_schedule.first_masked_block``): the earlier ones are whole and visible to all its rows."""
    first = seq_kv // BLOCK_N
    if IS_CAUSAL:
        first = gl.minimum(first, gl.maximum(0, first_row + seq_kv - seq_q + 1) // BLOCK_N)
    return first


@gluon.jit
def _softmax_step(s, m, l, rows, key0, masked, seq_q, seq_kv, scale2, s_layout: gl.constexpr,
                  BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, P_OFFSET: gl.constexpr):  # fmt: skip
    """One block's base-2 online softmax: (weights, new maximum, rescale factor, new sum). ``masked``: the
    block needs the mask (keys past ``seq_kv``, or under a causal mask keys some row does not see); the other
    blocks skip its compares and selects (FA3 masks only these). ``P_OFFSET`` (fp8): the weights times
    2**P_OFFSET, in (0, 256] for e4m3 (FA3's Max_offset); the sum carries it."""
    if masked:
        keys = key0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        seen = gl.expand_dims(keys < seq_kv, 0)
        if IS_CAUSAL:
            seen = seen & (gl.expand_dims(keys, 0) <= gl.expand_dims(rows + (seq_kv - seq_q), 1))
        s = gl.where(seen, s * scale2, -float("inf"))
    else:
        s = s * scale2
    m_new = gl.maximum(m, gl.max(s, axis=1))
    base = gl.where(m_new == -float("inf"), 0.0, m_new)  # no key seen yet: no inf - inf
    alpha = gl.exp2(m - base)
    if P_OFFSET != 0:
        p = gl.exp2(s - gl.expand_dims(base - P_OFFSET, 1))
    else:
        p = gl.exp2(s - gl.expand_dims(base, 1))
    return p, m_new, alpha, l * alpha + gl.sum(p, axis=1)


@gluon.jit
def tile_matrix(tile):
    """A [1, rows, D] tile of a 3-D (batch x heads, seq, D) descriptor as the [rows, D] matrix wgmma reads
    (the same bytes and swizzle)."""
    return tile.reshape([tile.shape[1], tile.shape[2]])


@gluon.jit
def _values(v_ring, slot, FP8: gl.constexpr):
    """The PV product's B operand, [BLOCK_N, D]: V's tile, or under ``FP8`` V^T's tile read transposed."""
    if FP8:
        return v_ring.index(slot).permute((1, 0))
    else:
        return tile_matrix(v_ring.index(slot))


@gluon.jit
def _key_block(j, q, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, turn, w, used, turns, p, m, l, o,
               rows, seq_q, seq_kv, scale2, s_layout: gl.constexpr, p_layout: gl.constexpr,
               o_layout: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, P_OFFSET: gl.constexpr,
               FP8: gl.constexpr, MASKED: gl.constexpr):  # fmt: skip
    """Key block ``j`` >= 1 of warpgroup ``w``'s item: its QK^T issued beside the previous block's PV, both
    before this block's softmax; ``MASKED``: the block needs the mask (``_first_masked_block``). Returns
    the state carried to the next block (weights, maximum, sum, O, ring blocks used, turns taken)."""
    STAGES: gl.constexpr = k_ring.shape[0]
    slot = used % STAGES
    before = (used - 1) % STAGES
    mbarrier.wait(k_ready.index(slot), (used // STAGES) & 1)
    mbarrier.wait(v_ready.index(before), ((used - 1) // STAGES) & 1)
    mbarrier.wait(turn.index(w), (turns & 1) ^ (1 - w))
    s = hopper.warpgroup_mma(q, tile_matrix(k_ring.index(slot)).permute((1, 0)),
                             gl.zeros([_HALF, BLOCK_N], gl.float32, s_layout), use_acc=False,
                             is_async=True)  # fmt: skip
    weights = gl.convert_layout(p.to(q.dtype), p_layout)
    o = hopper.warpgroup_mma(weights, _values(v_ring, before, FP8), o, is_async=True)
    mbarrier.arrive(turn.index(1 - w))
    s = hopper.warpgroup_mma_wait(1, deps=(s,))  # S retires; the PV stays in flight
    mbarrier.arrive(k_empty.index(slot))
    p, m, alpha, l = _softmax_step(s, m, l, rows, j * BLOCK_N, MASKED, seq_q, seq_kv, scale2, s_layout,
                                   BLOCK_N, IS_CAUSAL, P_OFFSET)  # fmt: skip
    o = hopper.warpgroup_mma_wait(0, deps=(o,))
    mbarrier.arrive(v_empty.index(before))
    o = o * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    return p, m, l, o, used + 1, turns + 1


@gluon.jit
def _consumer(w, q_tiles, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
              turn, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, seq_q, seq_kv, kv_blocks, heads,
              heads_kv, n_blocks, pairs, section, scale2, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, FP8: gl.constexpr,
              SPLIT_MASK: gl.constexpr, WHOLE_BLOCKS: gl.constexpr):  # fmt: skip
    """Warpgroup ``w``: rows [64 w, 64 w + 64) of each query tile. ``FP8``: e4m3 Q, K and V^T (V's ring
    holds [D, BLOCK_N] tiles, K-major as an fp8 wgmma's B operand must be), P rounded to e4m3 at 2**8
    times its value, the descales of the item's K/V head (``qk_descale_ptr``: descale_q descale_k, folded
    into the exp2's scale; ``v_descale_ptr``: descale_v, on the output), the output in ``out_ptr``'s
    dtype."""
    STAGES: gl.constexpr = k_ring.shape[0]
    HALF: gl.constexpr = _HALF
    dtype: gl.constexpr = q_tiles.dtype
    MMA_K: gl.constexpr = 32 if FP8 else 16
    P_OFFSET: gl.constexpr = P8_OFFSET if FP8 else 0.0
    MASK_REST: gl.constexpr = SPLIT_MASK or not WHOLE_BLOCKS  # the blocks past the unmasked loop
    s_layout: gl.constexpr = warpgroup_layout(BLOCK_N, MMA_K)
    o_layout: gl.constexpr = warpgroup_layout(HEAD_DIM, MMA_K)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q = tile_matrix(q_tiles.index(w))
    used = 0
    turns = 0  # turns taken: the turn barriers' phases
    done = 0
    for index in range(gl.program_id(0), n_blocks * pairs, gl.num_programs(0)):
        block, pair = _work_item(index, n_blocks, pairs, section, IS_CAUSAL)
        item_scale2 = scale2
        if FP8:
            kv_pair = (pair // heads) * heads_kv + (pair % heads) // (heads // heads_kv)
            item_scale2 = scale2 * gl.load(qk_descale_ptr + kv_pair)
        rows = block * BLOCK_M + w * HALF + gl.arange(0, HALF, layout=row_layout)
        n = _key_blocks(block, seq_q, seq_kv, kv_blocks, BLOCK_M, BLOCK_N, IS_CAUSAL)
        masked_from = _first_masked_block(block * BLOCK_M + w * HALF, seq_q, seq_kv, BLOCK_N, IS_CAUSAL)
        m = gl.full([HALF], -float("inf"), gl.float32, row_layout)
        l = gl.zeros([HALF], gl.float32, row_layout)
        o = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
        mbarrier.wait(q_ready, done & 1)
        if n == 0:  # no key for any row: one turn, as every tile takes n + 1
            mbarrier.wait(turn.index(w), (turns & 1) ^ (1 - w))
            mbarrier.arrive(turn.index(1 - w))
            turns += 1
            mbarrier.arrive(q_empty)
        else:
            # block 0: QK^T alone
            slot = used % STAGES
            mbarrier.wait(k_ready.index(slot), (used // STAGES) & 1)
            mbarrier.wait(turn.index(w), (turns & 1) ^ (1 - w))
            s = hopper.warpgroup_mma(q, tile_matrix(k_ring.index(slot)).permute((1, 0)),
                              gl.zeros([HALF, BLOCK_N], gl.float32, s_layout),
                              use_acc=False, is_async=True)  # fmt: skip
            mbarrier.arrive(turn.index(1 - w))
            turns += 1
            s = hopper.warpgroup_mma_wait(0, deps=(s,))
            mbarrier.arrive(k_empty.index(slot))
            if SPLIT_MASK:
                p, m, alpha, l = _softmax_step(s, m, l, rows, 0, masked_from == 0, seq_q, seq_kv, item_scale2,
                                               s_layout, BLOCK_N, IS_CAUSAL, P_OFFSET)  # fmt: skip
            else:
                p, m, alpha, l = _softmax_step(s, m, l, rows, 0, MASK_REST, seq_q, seq_kv, item_scale2,
                                               s_layout, BLOCK_N, IS_CAUSAL, P_OFFSET)  # fmt: skip
            used += 1
            # SPLIT_MASK: the blocks every row sees whole in a loop without the mask, then the rest masked;
            # else one loop (a second spilled in the item loop at d = 64 causal and d = 256: its bounds are
            # then constants, and the first loop folds away), every block masked or, over WHOLE_BLOCKS, none
            whole = 1
            if SPLIT_MASK:
                whole = gl.maximum(1, gl.minimum(masked_from, n))
            for j in range(1, whole):
                p, m, l, o, used, turns = _key_block(
                    j, q, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, turn, w, used, turns, p, m,
                    l, o, rows, seq_q, seq_kv, item_scale2, s_layout, p_layout, o_layout, BLOCK_N,
                    IS_CAUSAL, P_OFFSET, FP8, False)  # fmt: skip
            for j in range(whole, n):
                p, m, l, o, used, turns = _key_block(
                    j, q, k_ring, v_ring, k_ready, k_empty, v_ready, v_empty, turn, w, used, turns, p, m,
                    l, o, rows, seq_q, seq_kv, item_scale2, s_layout, p_layout, o_layout, BLOCK_N,
                    IS_CAUSAL, P_OFFSET, FP8, MASK_REST)  # fmt: skip
            # every QK^T has retired: Q's buffer is free, and the next item's Q loads under this last PV
            # and the stores
            mbarrier.arrive(q_empty)
            # the last block's PV
            before = (used - 1) % STAGES
            mbarrier.wait(v_ready.index(before), ((used - 1) // STAGES) & 1)
            mbarrier.wait(turn.index(w), (turns & 1) ^ (1 - w))
            weights = gl.convert_layout(p.to(dtype), p_layout)
            o = hopper.warpgroup_mma(weights, _values(v_ring, before, FP8), o, is_async=True)
            mbarrier.arrive(turn.index(1 - w))
            turns += 1
            o = hopper.warpgroup_mma_wait(0, deps=(o,))
            mbarrier.arrive(v_empty.index(before))
        done += 1
        # out = O / l (0 where no key), LSE = (m + log2 l) ln 2 (-inf where no key)
        seen = l > 0
        inverse = gl.where(seen, 1.0 / gl.where(seen, l, 1.0), 0.0)
        if FP8:
            inverse = inverse * gl.load(v_descale_ptr + kv_pair)
        o = o * gl.expand_dims(gl.convert_layout(inverse, gl.SliceLayout(1, o_layout)), 1)
        out_rows = block * BLOCK_M + w * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
        columns = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        offsets = (pair * seq_q + gl.expand_dims(out_rows, 1)).to(gl.int64) * HEAD_DIM + gl.expand_dims(
            columns, 0
        )
        gl.store(out_ptr + offsets, o.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(out_rows < seq_q, 1))
        lse = gl.where(seen, (m + gl.log2(gl.where(seen, l, 1.0)) - P_OFFSET) * LN2, -float("inf"))
        gl.store(lse_ptr + pair.to(gl.int64) * seq_q + rows, lse, mask=rows < seq_q)


@gluon.jit
def gluon_attention_fwd_kernel(q_desc, k_desc, v_desc, out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, seq_q,
                               seq_kv, kv_blocks, heads, heads_kv, n_blocks, pairs, section, scale2,
                               IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, FP8: gl.constexpr,
                               SPLIT_MASK: gl.constexpr, WHOLE_BLOCKS: gl.constexpr):  # fmt: skip
    gl.static_assert(BLOCK_M == 2 * 64)
    q_tiles = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    mbarrier.init(q_empty, count=2)  # both warpgroups
    for slot in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(slot), count=1)
        mbarrier.init(v_ready.index(slot), count=1)
        mbarrier.init(k_empty.index(slot), count=2)
        mbarrier.init(v_empty.index(slot), count=2)
    for w in gl.static_range(2):
        mbarrier.init(turn.index(w), count=1)
    fence_async_shared()
    # (the argument tuples are written out: a tuple held in a variable turns its constexprs into tensors)
    gl.warp_specialize([
        (_producer, (q_desc, k_desc, v_desc, q_tiles, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty,
                     v_ready, v_empty, seq_q, seq_kv, kv_blocks, heads, heads_kv, n_blocks, pairs, section,
                     IS_CAUSAL, BLOCK_M, BLOCK_N, FP8)),
        (_consumer, (0, q_tiles, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                       out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, seq_q, seq_kv, kv_blocks, heads,
                       heads_kv, n_blocks, pairs, section, scale2, IS_CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM,
                       FP8, SPLIT_MASK, WHOLE_BLOCKS)),
        (_consumer, (1, q_tiles, k_ring, v_ring, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, turn,
                       out_ptr, lse_ptr, qk_descale_ptr, v_descale_ptr, seq_q, seq_kv, kv_blocks, heads,
                       heads_kv, n_blocks, pairs, section, scale2, IS_CAUSAL, BLOCK_M, BLOCK_N, HEAD_DIM,
                       FP8, SPLIT_MASK, WHOLE_BLOCKS)),
    ], [4, 4], [CONSUMER_REGISTERS, CONSUMER_REGISTERS])  # fmt: skip


ATTENTION_FWD = Kernel(gluon_attention_fwd_kernel, "gluon_attention_fwd")

# --- launcher -------------------------------------------------------------------------------------------

DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
# The backward's (llm_speed.gluon.attention_bwd): its dK and dV accumulators do not fit registers at 256.
BACKWARD_HEAD_DIMS = (64, 128)
# fp8 (FlashAttention-3's forward-only fp8): e4m3 q, k, v with descales, output bfloat16.
FP8_DTYPE = torch.float8_e4m3fn
FORWARD_DTYPES = (*DTYPES, FP8_DTYPE)
_GL_DTYPES = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, FP8_DTYPE: gl.float8e4nv}
BLOCK_M = 2 * WARPGROUP_ROWS
STAGES = 2
# Batch-head pairs per longest-first section (as the Triton forward's default section).
SECTION = 8


def key_block(head_dim: int, is_causal: bool) -> int:
    """Keys per K/V block: 128 at d = 64; at d = 128, 128 without a causal mask and 64 with one (split
    masking, :func:`split_mask`); 64 at d = 256. FA3 takes 128 x 176 (not causal) and 128 x 128 (causal)
    tiles at d = 128 and 80 keys at d = 256 (its ``hopper/tile_size.h``); Gluon's ``arange`` wants a power
    of two. At 64 keys and d = 256 the two ring slots of K and V (128 KiB) and Q (64 KiB) take 192 KiB of
    the 227. The sm_90a builds (Triton 3.6, 2026-12-07; instructions of the key-block loop per key): d = 128
    not causal, 128 keys 617 / 128 = 4.8 (533 / 128 = 4.2 where the keys fill whole blocks, no mask), 64
    keys 390 / 64 = 6.1 (5.4 with split masking), all without a spill; causal, 64 keys split 347 / 64 = 5.4
    in the unmasked loop, 128 keys 764 / 128 = 6.0 with 2 LDL/STL in the loop (split at 128 keys: 235)."""
    if head_dim <= 64:
        return 128
    return 128 if head_dim <= 128 and not is_causal else 64


def split_mask(head_dim: int, is_causal: bool) -> bool:
    """Whether the forward runs the key blocks every row sees whole in a loop of their own, without the
    mask's compares and selects, and masks the rest in a second loop (FA3 masks only the blocks that need
    it): at d = 128 under a causal mask only, where it builds without a spill (sm_90a, Triton 3.6); the
    second loop spilled in the item loop at d = 64 causal and d = 256, and at 128 keys."""
    return head_dim == 128 and is_causal


@functools.cache
def _plan(batch: int, heads: int, heads_kv: int, seq_q: int, seq_kv: int, head_dim: int, dtype: torch.dtype,
          is_causal: bool, hardware: Hardware) -> GluonPlan:  # fmt: skip
    gl_dtype = _GL_DTYPES[dtype]
    fp8 = dtype == FP8_DTYPE

    def layout(shape):
        return DescriptorLayout(shape, gl.NVMMASharedLayout.get_default_for(list(shape), gl_dtype))

    block_n = key_block(head_dim, is_causal)
    n_blocks = cdiv(seq_q, BLOCK_M)
    items = n_blocks * batch * heads
    return GluonPlan(
        ATTENTION_FWD, (min(items, hardware.sm_count), 1, 1),
        dict(seq_q=seq_q, seq_kv=seq_kv, kv_blocks=cdiv(seq_kv, block_n), heads=heads, heads_kv=heads_kv,
             n_blocks=n_blocks, pairs=batch * heads,
             section=SECTION, IS_CAUSAL=is_causal, BLOCK_M=BLOCK_M, BLOCK_N=block_n, HEAD_DIM=head_dim,
             STAGES=STAGES, FP8=fp8, SPLIT_MASK=split_mask(head_dim, is_causal),
             WHOLE_BLOCKS=not is_causal and seq_kv % block_n == 0),
        dict(q_desc=layout((1, WARPGROUP_ROWS, head_dim)), k_desc=layout((1, block_n, head_dim)),
             v_desc=layout((head_dim, block_n) if fp8 else (1, block_n, head_dim))),
        4, STAGES,
    )  # fmt: skip


# --- public function ------------------------------------------------------------------------------------


def check_arguments(q, k, v, is_causal, scale, head_dims: tuple[int, ...] = HEAD_DIMS,
                    dtypes: tuple[torch.dtype, ...] = DTYPES) -> float:  # fmt: skip
    """The softmax scale (``1/sqrt(D)`` for None) once q, k, v, ``is_causal`` and ``scale`` are what the
    Gluon attention kernels take (:func:`forward` passes its ``dtypes``, the backward its ``head_dims``);
    TypeError / ValueError naming the argument otherwise. The device is checked apart
    (:func:`llm_speed.gluon.launch.check_device`)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        tensors.check_tensor(name, x, dtypes=dtypes, dims=4, what="[B, H, S, D]")
        if x.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {x.dtype}; it must match q's ({q.dtype})")
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous [B, H, S, D] (TMA reads its [B H, S, D] view)")
        if x.data_ptr() % 16:
            raise ValueError(f"{name} must start 16-byte aligned (a TMA descriptor's base)")
    if type(is_causal) is not bool:
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    tensors.check_same_device(q=q, k=k, v=v)
    batch, heads, seq_q, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"k and v must both be [{batch}, H_kv, Skv, {head_dim}], got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}")  # fmt: skip
    heads_kv = k.shape[1]
    if heads_kv == 0 or heads % heads_kv:
        raise ValueError(f"q's {heads} heads must be a multiple of k's {heads_kv}")
    if head_dim not in head_dims:
        raise ValueError(f"head dim {head_dim} is not supported; accepted: {', '.join(map(str, head_dims))}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if not (isinstance(scale, (int, float)) and math.isfinite(scale)):
        raise ValueError(f"scale must be a finite number, got {scale!r}")
    return float(scale)


def _descales(q, k, descale_q, descale_k, descale_v) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fp8's descales as the kernel reads them, float32 [B, H_kv] each: descale_q * descale_k (folded into
    the scores' scale) and descale_v (on the output); None for 16-bit q. Bad ones: an error naming them;
    values not finite and > 0 where values are not checked (a GPU): both NaN for that K/V head, so that its
    output is NaN, as the Triton fp8 path's rows."""
    from ..attention.checks import check_descale
    from ..attention.reference import descale_rows
    from ..matmul.fp8 import check_scale_values

    named = {"descale_q": descale_q, "descale_k": descale_k, "descale_v": descale_v}
    if q.dtype != FP8_DTYPE:
        for name, t in named.items():
            if t is not None:
                raise ValueError(f"{name} is for fp8 (e4m3) q, k and v only; q is {q.dtype}")
        return None
    batch, heads_kv = q.shape[0], k.shape[1]
    rows = []
    for name, t in named.items():
        if t is None:
            rows.append(torch.ones((batch, heads_kv), dtype=torch.float32, device=q.device))
        else:
            check_descale(name, t, batch, heads_kv, q.device)
            rows.append(descale_rows(t, batch, heads_kv))
    if runtime.check_values(q.device):
        check_scale_values(*named.items())
    good = rows[0].isfinite() & (rows[0] > 0)
    for row in rows[1:]:
        good = good & row.isfinite() & (row > 0)
    return (torch.where(good, rows[0] * rows[1], math.nan).contiguous(),
            torch.where(good, rows[2], math.nan).contiguous())  # fmt: skip


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, is_causal: bool = False,
            scale: float | None = None, descale_q: torch.Tensor | None = None,
            descale_k: torch.Tensor | None = None,
            descale_v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse) of softmax(q k^T * scale) v by the warp-specialized Gluon forward: q [B, H, Sq, D], k and v
    [B, H_kv, Skv, D] contiguous, H a multiple of H_kv, fp16 or bf16, D 64, 128 or 256; causal masks aligned
    bottom-right; ``lse`` float32 [B, H, Sq] in natural-log units. fp8 (FlashAttention-3's, forward only): q,
    k, v ``float8_e4m3fn`` and ``descale_q`` / ``descale_k`` / ``descale_v`` each None (1) or float32 ``[]``,
    ``[1]``, ``[H_kv]`` or ``[B, H_kv]`` (dequantized = fp8 value * descale); the weights go to the PV product
    as e4m3 at 2**8 times their value, V is transposed by one copy first
    (:func:`llm_speed.attention.plans.transposed_values`), and ``out`` is bfloat16. CUDA tensors on a compute
    capability 9.0 GPU only (anything else: ValueError before any work). Unproven on a GPU;
    ``flash_attention`` launches it only under a launch policy naming it (candidate ``gluon-forward``; fp8:
    ``gluon_fp8_forward_head_dims``)."""
    scale = check_arguments(q, k, v, is_causal, scale, dtypes=FORWARD_DTYPES)
    descales = _descales(q, k, descale_q, descale_k, descale_v)
    batch, heads, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    check_device("q", q, "llm_speed.gluon.attention")
    device = q.device
    out = tensors.new_output(q.shape, q.dtype if descales is None else torch.bfloat16, device)
    lse = tensors.new_output((batch, heads, seq_q), torch.float32, device)
    if out.numel() == 0:
        return out, lse
    if seq_kv == 0:
        return out.zero_(), lse.fill_(-math.inf)
    plan = _plan(batch, heads, heads_kv, seq_q, seq_kv, head_dim, q.dtype, is_causal, hardware_of(device))
    # 3-D views (batch x heads, seq, D): a head's partial last block reads TMA's zeros, not the next head's
    # rows (0 weight x an inf there would be NaN). fp8: V^T [B H_kv D, Skv] by the Triton fp8 path's copy
    # (rows 16-byte aligned, as TMA's strides must be), its partial blocks past Skv in the last dim: zeros.
    values = v.flatten(0, 1) if descales is None else transposed_values(v).flatten(0, 2)
    qk_descale, v_descale = (None, None) if descales is None else descales
    plan.launch(q_desc=q.flatten(0, 1), k_desc=k.flatten(0, 1), v_desc=values, out_ptr=out,
                lse_ptr=lse, qk_descale_ptr=qk_descale, v_descale_ptr=v_descale,
                scale2=float(scale) * math.log2(math.e))  # fmt: skip
    return out, lse
