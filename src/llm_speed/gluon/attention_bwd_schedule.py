"""A PyTorch model of the Gluon attention backward's schedule (:mod:`llm_speed.gluon.attention_bwd`, issue
73, stage 2), run on a CPU: FlashAttention-3's backward structure (Shah et al. 2024, arXiv:2407.08608), block
by block, checked against float64 where the kernel itself cannot run.

One program per (key block, K/V head); per program three partitions run as agents interleaved by a seeded
random scheduler:

- a **producer** loads the key block's K and V once (two 64-key halves), then, for each query head of the
  K/V head's group and each query block that sees a key of the block, the Q and dO tiles into rings of
  ``stages`` slots, each slot with "ready" mbarriers and an "empty" one that both consumer warpgroups must
  arrive on before it is refilled;
- two **consumer warpgroups**, each owning half of the key block (64 of 128 keys), keep dK and dV in fp32
  over the whole walk. Per query block: S = Q K^T and dP = dO V^T; P = exp2(S * scale * log2(e) - LSE *
  log2(e)) (the LSE as the forward writes it, natural log; rows past the query length take LSE +inf, so
  P = 0 there); dS = P (dP - delta); P and dS rounded to the inputs' dtype (the kernel stores them to
  shared memory for the transposed products); dV += P^T dO, dK += dS^T Q; dQ += scale * dS K, this
  warpgroup's keys' share, added in fp32 (atomics in the kernel); the slot is freed once dV and dK retire;
- the tiles are read as the kernel's TMA reads them: boxes of the [B * H, S, D] view, so rows past a head's
  length are zeros (never the next head's: 0 x an inf there would be NaN); rows past seq_q take LSE +inf
  (P = 0); without a causal mask only a warpgroup holding keys past seq_kv masks them (a zero score would
  give P = exp(-LSE), and dS = -P delta rounded to fp16 can be inf: inf x a zero K row is NaN in dQ);
- causal masks are bottom-right aligned: row r sees key c iff c <= r + seq_kv - seq_q; a key block starts
  at the first query block that sees any of its keys. A hidden key's score is replaced (-inf, or +inf
  under a negative scale) before the exp2, under a causal mask only in the query blocks that cross the
  diagonal (the others see all 64 keys); a row that sees no key (LSE -inf) takes LSE +inf.

A slot read by a product is checked when the product retires (the latest a wgmma may read shared memory):
a slot refilled too early, or every agent blocked (a hang on the GPU), raises
:class:`~llm_speed.gluon.protocol.ScheduleError`.
Not modelled: wgmma's order of additions inside a block, the order of the atomic adds, timing.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator

import torch

from ..core.launch import cdiv
from . import protocol
from .attention_schedule import tma_rows

LOG2E = math.log2(math.e)
WARPGROUPS = 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The backward's tile (``block_n`` keys per program, split between the two warpgroups; ``block_m``
    query rows per step) and ring depth."""

    block_m: int = 64
    block_n: int = 128
    stages: int = 2


def from_plan(plan) -> Schedule:
    """The :class:`Schedule` of a Gluon backward plan (:func:`llm_speed.gluon.attention_bwd._plan`)."""
    f = plan.fixed
    return Schedule(f["BLOCK_M"], f["BLOCK_N"], f["STAGES"])


def query_blocks(key_block: int, block_m: int, block_n: int, seq_q: int, seq_kv: int,
                 is_causal: bool) -> tuple[int, int]:  # fmt: skip
    """(first query block, how many) key block ``key_block`` is read by: every query block, or under a
    causal mask (bottom-right aligned) those from the first whose last row sees the block's first key."""
    n_q = cdiv(seq_q, block_m)
    first = 0
    if is_causal:
        first = min(max(key_block * block_n - (seq_kv - seq_q), 0) // block_m, n_q)
    return first, n_q - first


class _Program:
    """One program's rings, barriers and partitions: key block ``key_block`` of K/V pair ``kv_pair``."""

    def __init__(self, tensors, grads, key_block, kv_pair, schedule: Schedule, is_causal, scale):
        self.q, self.k, self.v, self.dout, self.lse, self.delta = tensors
        self.dq, self.dk, self.dv = grads
        self.key_block, self.kv_pair, self.s, self.is_causal = key_block, kv_pair, schedule, is_causal
        # a zero scale runs as a zero Q (every score 0) with a positive scale2, so hidden keys' scores can be
        # -inf; a negative one hides them as +inf (times scale2: -inf), as the kernel's launcher does
        self.scale, self.scale2 = scale, (scale if scale != 0 else 1.0) * LOG2E
        self.masked = -math.inf if scale >= 0 else math.inf
        heads, heads_kv = self.q.shape[1], self.k.shape[1]
        self.seq_q, self.seq_kv, self.group = self.q.shape[2], self.k.shape[2], heads // heads_kv
        self.q_pair0 = (kv_pair // heads_kv) * heads + (kv_pair % heads_kv) * self.group
        self.first, self.per_head = query_blocks(key_block, schedule.block_m, schedule.block_n, self.seq_q,
                                                 self.seq_kv, is_causal)  # fmt: skip
        self.half = schedule.block_n // WARPGROUPS
        self.kv: list | None = None  # the two warpgroups' (K, V) halves once loaded
        self.kv_ready = protocol.Barrier()
        self.rings = {name: [None] * schedule.stages for name in ("q", "do")}  # (tag, tile) per slot
        self.ready = {name: [protocol.Barrier() for _ in range(schedule.stages)] for name in ("q", "do")}
        self.empty = [protocol.Barrier(WARPGROUPS) for _ in range(schedule.stages)]

    def steps(self) -> list[tuple[int, int]]:
        """(query pair, query block) of each step, in the kernel's order."""
        return [(self.q_pair0 + g, self.first + i) for g in range(self.group) for i in range(self.per_head)]

    def producer(self) -> Iterator[bool]:
        s = self.s
        halves = [self.key_block * s.block_n + w * self.half for w in range(WARPGROUPS)]
        self.kv = [tuple(tma_rows(x, self.kv_pair, at, self.half) for x in (self.k, self.v)) for at in halves]
        self.kv_ready.arrive()
        yield True
        for t, (q_pair, block) in enumerate(self.steps()):
            slot, parity = t % s.stages, ((t // s.stages) & 1) ^ 1
            yield from protocol.wait(self.empty[slot], parity)
            for name, x in (("q", self.q), ("do", self.dout)):  # Q first: S needs it first
                self.rings[name][slot] = ((q_pair, block), tma_rows(x, q_pair, block * s.block_m, s.block_m))
                self.ready[name][slot].arrive()
                yield True

    def _read(self, name: str, slot: int, tag: tuple) -> torch.Tensor:
        """The tile in ``name``'s ring slot, which must be ``tag``'s (read as the product retires)."""
        got, tile = self.rings[name][slot] or (None, None)
        if got != tag:
            raise protocol.ScheduleError(f"program {(self.key_block, self.kv_pair)}: a product of {tag} read "
                                         f"{name} slot {slot} holding {got}")  # fmt: skip
        return tile

    def consumer(self, w: int) -> Iterator[bool]:
        """Warpgroup ``w``: keys [w * block_n / 2, (w + 1) * block_n / 2) of the key block."""
        s, dtype = self.s, self.q.dtype
        key0 = self.key_block * s.block_n + w * self.half
        key_index = torch.arange(self.half)
        rows = torch.arange(s.block_m)
        d = self.q.shape[-1]
        dk = torch.zeros(self.half, d)
        dv = torch.zeros(self.half, d)
        yield from protocol.wait(self.kv_ready, 0)
        if self.kv is None:
            raise protocol.ScheduleError(f"program {(self.key_block, self.kv_pair)}: a consumer read K/V "
                                         "before its load")  # fmt: skip
        k_tile, v_tile = self.kv[w]
        for t, (q_pair, block) in enumerate(self.steps()):
            slot, phase = t % s.stages, (t // s.stages) & 1
            start = block * s.block_m
            yield from protocol.wait(self.ready["q"][slot], phase)
            yield from protocol.wait(self.ready["do"][slot], phase)
            tag = (q_pair, block)
            q_tile, do_tile = self._read("q", slot, tag), self._read("do", slot, tag)
            b, h = divmod(q_pair, self.q.shape[1])
            count = max(0, min(s.block_m, self.seq_q - start))
            lse2 = torch.full((s.block_m,), math.inf)  # rows past seq_q: P = 0 with no mask
            lse2[:count] = self.lse[b, h, start : start + count] * LOG2E
            lse2[lse2 == -math.inf] = math.inf  # a row that sees no key: P = 0, never exp2(-inf + inf)
            delta = torch.zeros(s.block_m)
            delta[:count] = self.delta[b, h, start : start + count]
            scores = q_tile.float() @ k_tile.float().T
            dp = do_tile.float() @ v_tile.float().T
            diagonal = self.seq_kv - self.seq_q - key0  # row r sees key index <= r + start + diagonal
            if self.is_causal:
                if start + diagonal < self.half - 1:  # only blocks crossing the diagonal are masked
                    seen = key_index[None, :] <= (rows + (start + diagonal))[:, None]
                    scores = torch.where(seen, scores, self.masked)
            elif key0 + self.half > self.seq_kv:  # only a warpgroup holding keys past seq_kv masks them
                scores = torch.where((key0 + key_index < self.seq_kv)[None, :], scores, self.masked)
            p = torch.exp2(scores * self.scale2 - lse2[:, None]).clamp(max=1.0)
            ds = p * (dp - delta[:, None])
            yield True  # S and dP retired: the softmax, and P and dS to shared memory
            p16, ds16 = p.to(dtype).float(), ds.to(dtype).float()
            dv += p16.T @ self._read("do", slot, tag).float()
            dk += ds16.T @ self._read("q", slot, tag).float()
            self.empty[slot].arrive()  # dV and dK retired: the slot is free
            yield True
            dq = ds16 @ k_tile.float() * self.scale
            self.dq[b, h, start : start + count] += dq[:count]
            yield True
        b, hk = divmod(self.kv_pair, self.k.shape[1])
        keys = slice(key0, max(key0, min(key0 + self.half, self.seq_kv)))
        count = keys.stop - keys.start
        self.dk[b, hk, keys] = (dk[:count] * self.scale).to(dtype)
        self.dv[b, hk, keys] = dv[:count].to(dtype)


def backward(q, k, v, out, lse, dout, *, is_causal: bool = False, scale: float | None = None, dlse=None,
             schedule: Schedule = Schedule(), seed: int = 0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(dq, dk, dv) of attention over q [B, H, Sq, D], k and v [B, H_kv, Skv, D] (H a multiple of H_kv) as
    the schedule computes them on the CPU from the forward's ``out`` and ``lse`` (float32, natural log) and
    the output gradient ``dout`` (and ``dlse``, the LSE's, where it was used: delta = rowsum(dO * O) -
    dLSE); each in its input's dtype. dK and dV entries no program writes stay NaN."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    delta = (dout.float() * out.float()).sum(-1)  # as llm_speed.gluon.attention_bwd.backward
    if dlse is not None:
        delta = delta - dlse
    dq = torch.zeros(q.shape)  # the fp32 buffer the atomics add into
    dk = torch.full(k.shape, math.nan, dtype=k.dtype)
    dv = torch.full(v.shape, math.nan, dtype=v.dtype)
    kv_pairs = k.shape[0] * k.shape[1]
    scores_q = torch.zeros_like(q) if scale == 0 else q  # as the launcher (the consumer's scale2)
    rng = random.Random(seed)
    for index in range(cdiv(k.shape[2], schedule.block_n) * kv_pairs):  # key-block major, as the grid
        key_block, kv_pair = divmod(index, kv_pairs)
        state = _Program((scores_q, k, v, dout, lse, delta), (dq, dk, dv), key_block, kv_pair, schedule,
                         is_causal, scale)  # fmt: skip
        protocol.interleave([state.producer(), state.consumer(0), state.consumer(1)], rng, index)
    return dq.to(q.dtype), dk, dv
