"""A PyTorch model of the Gluon forward attention's schedule (:mod:`llm_speed.gluon.attention`, issue 73,
stage 1), run on a CPU: the structure FlashAttention-3 describes (Shah et al. 2024, arXiv:2407.08608,
sections 3.1-3.2), block by block, checked against float64 where the kernel itself cannot run.

Per persistent program, three partitions run as agents interleaved by a seeded random scheduler:

- a **producer** loads each work item's Q tile (both warpgroups' halves, one buffer with a "ready"
  mbarrier and an "empty" one both warpgroups arrive on) and its K and V blocks into two rings of ``stages``
  slots (TMA), each slot with a "ready" mbarrier and an "empty" one that both consumer warpgroups must
  arrive on before it is refilled. A warpgroup frees Q once its item's last QK^T has retired, before the
  last PV and the stores, so the next item's Q loads under them;
- two **consumer warpgroups**, each owning half of the query tile's rows (64 of 128), in **ping-pong**: a
  warpgroup issues its pair of products for a block only on its turn, then hands the turn to the other
  (FA3's inter-warpgroup schedule), through the kernel's two turn mbarriers and parity rule (warpgroup w
  waits on its own with parity ``(turns & 1) ^ (1 - w)`` and arrives on the other's), so one warpgroup's
  softmax runs under the other's matrix products;
- within a warpgroup (FA3's Algorithm 2, intra-warpgroup overlap): the **next block's QK^T is issued before
  this block's softmax** is finished with, beside the previous block's PV; the softmax of block j then
  runs while PV of block j - 1 is in flight, and O is rescaled once that product has retired;
- the softmax is in base 2 with the **scale folded** into one multiply (``s2 = (q.k) * scale * log2(e)``,
  ``p = exp2(s2 - m)``, as llm-speed's Triton forward), P is rounded to the inputs' dtype for the PV
  product (wgmma's A operand from registers), O and l accumulate in fp32, and the LSE is stored in natural
  log units (``(m + log2 l) * ln 2``); a row that sees no key gets output 0 and LSE -inf;
- the grid is **persistent**: work items (query block, batch-head pair) in row order, or under a causal
  mask **longest first** (llm-speed's ``_longest_first``: sections of ``section`` pairs, block-major, the
  last query block first), program p taking items p, p + P, ...
- **fp8** (e4m3 q, k, v with descales, FA3's forward-only fp8): the producer loads V^T's [D, block_n]
  tiles (the host's transposed copy, zero past the keys), the scores take descale_q descale_k in the folded
  scale, P is computed at 2**8 times its value (``P8_OFFSET``, the sum likewise) and rounded to e4m3 for
  the PV product, the output is O / l times descale_v in bfloat16, and the LSE drops the 2**8 again.

A slot read by a product is checked when the product retires (the latest a wgmma may read shared memory):
a slot refilled too early, or every agent blocked (a hang on the GPU), raises
:class:`~llm_speed.gluon.protocol.ScheduleError`.
Not modelled: wgmma's order of additions inside a block, timing.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterator

import torch

from ..core.launch import cdiv
from . import protocol

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
# fp8: the weights' offset in the exponent (FA3's Max_offset; llm-speed's fp8 attention's)
P8_OFFSET = 8
WARPGROUPS = 2


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The forward's tile (``block_m`` query rows per program, split between the two warpgroups;
    ``block_n`` keys per K/V block), ring depth, persistent grid and longest-first section width;
    ``split_mask``: only the key blocks from :func:`first_masked_block` on are masked (the kernel's
    ``SPLIT_MASK``), else every block."""

    block_m: int = 128
    block_n: int = 128
    stages: int = 2
    programs: int = 132
    section: int = 8
    split_mask: bool = True


def from_plan(plan) -> Schedule:
    """The :class:`Schedule` of a Gluon forward plan (:func:`llm_speed.gluon.attention._plan`): its tile,
    ring depth, persistent grid and section width."""
    f = plan.fixed
    # WHOLE_BLOCKS: no block needs the mask, which is what masking from first_masked_block on does there
    split = f["SPLIT_MASK"] or f["WHOLE_BLOCKS"]
    return Schedule(f["BLOCK_M"], f["BLOCK_N"], f["STAGES"], plan.grid[0], f["section"], split)


def work_items(n_blocks: int, pairs: int, *, longest_first: bool, section: int) -> list[tuple[int, int]]:
    """(query block, batch-head pair) of each work item in launch order: row order (the blocks of one pair
    adjacent), or longest first (``_longest_first`` of llm-speed's Triton forward: sections of ``section``
    pairs, block-major inside a section, from the last block)."""
    items = []
    for index in range(n_blocks * pairs):
        if longest_first:
            per_section = section * n_blocks
            first = (index // per_section) * section
            width = min(section, pairs - first)
            rest = index % per_section
            items.append((n_blocks - 1 - rest // width, first + rest % width))
        else:
            items.append((index % n_blocks, index // n_blocks))
    return items


def key_blocks(block: int, block_m: int, block_n: int, seq_q: int, seq_kv: int, is_causal: bool) -> int:
    """How many key blocks query block ``block`` reads (from the first): all of them, or under a causal mask
    (bottom-right aligned) those up to its last row's last visible key; 0 when no row sees a key."""
    blocks = cdiv(seq_kv, block_n)
    if not is_causal:
        return blocks
    last_row = min((block + 1) * block_m, seq_q) - 1
    last_key = last_row + seq_kv - seq_q
    return max(0, min(blocks, cdiv(last_key + 1, block_n)))


def first_masked_block(first_row: int, block_n: int, seq_q: int, seq_kv: int, is_causal: bool) -> int:
    """The first key block whose scores a warpgroup whose rows start at ``first_row`` must mask: every key
    of every earlier block is below ``seq_kv`` and, under a causal mask (bottom-right aligned), visible to
    the warpgroup's first row, hence to all of its rows (FlashAttention-3 masks only the blocks that need
    it). The mask's compares and selects are left out of the other blocks."""
    first = seq_kv // block_n  # a partial last block
    if is_causal:
        # block j is wholly visible to row r iff (j + 1) block_n - 1 <= r + seq_kv - seq_q
        first = min(first, max(0, first_row + seq_kv - seq_q + 1) // block_n)
    return first


def tma_rows(x: torch.Tensor, pair: int, first: int, count: int) -> torch.Tensor:
    """Rows [first, first + count) of (batch x head) ``pair`` of ``x`` [B, H, S, D], zeros past S: the box
    the kernels' TMA reads through the [B * H, S, D] view (never the next head's rows)."""
    box = torch.zeros(count, x.shape[-1], dtype=x.dtype)
    part = x.flatten(0, 1)[pair, first : first + count]
    box[: part.shape[0]] = part
    return box


class _Program:
    """One persistent program's rings, barriers and partitions."""

    def __init__(self, q, k, v, out, lse, items, schedule: Schedule, is_causal: bool, scale: float, program,
                 descales=None):  # fmt: skip
        self.q, self.k, self.v, self.out, self.lse = q, k, v, out, lse
        # fp8: (descale_q descale_k, descale_v), float32 [B, H_kv] each; V is then V^T [B, H_kv, D, Skv]
        self.descales = descales
        self.items, self.s, self.is_causal, self.program = items, schedule, is_causal, program
        self.scale2 = scale * LOG2E  # the scale folded into the base-2 exponent
        self.heads, self.seq_q, self.seq_kv = q.shape[1], q.shape[2], k.shape[2]
        self.group = q.shape[1] // k.shape[1]
        s = schedule
        self.rings = {name: [None] * s.stages for name in ("k", "v")}  # (tag, block) per slot
        self.ready = {name: [protocol.Barrier() for _ in range(s.stages)] for name in ("k", "v")}
        self.empty = {name: [protocol.Barrier(WARPGROUPS) for _ in range(s.stages)] for name in ("k", "v")}
        self.q_tiles = None  # (tag, [each warpgroup's half]) once loaded
        self.q_ready, self.q_empty = protocol.Barrier(), protocol.Barrier(WARPGROUPS)
        self.turns = [protocol.Barrier() for _ in range(WARPGROUPS)]  # warpgroup w waits on turns[w]

    def _blocks(self, block: int) -> int:
        s = self.s
        return key_blocks(block, s.block_m, s.block_n, self.seq_q, self.seq_kv, self.is_causal)

    def _kv(self, x, pair: int, j: int) -> torch.Tensor:
        b, h = divmod(pair, self.heads)
        n = self.s.block_n
        if x is self.v and self.descales is not None:  # V^T's [D, block_n] tile, zero past seq_kv
            box = torch.zeros(x.shape[2], n, dtype=x.dtype)
            part = x[b, h // self.group, :, j * n : (j + 1) * n]
            box[:, : part.shape[1]] = part
            return box
        return tma_rows(x, b * x.shape[1] + h // self.group, j * n, n)

    def _q_halves(self, block: int, pair: int) -> list[torch.Tensor]:
        half = self.s.block_m // WARPGROUPS
        return [tma_rows(self.q, pair, block * self.s.block_m + w * half, half) for w in range(WARPGROUPS)]

    def producer(self) -> Iterator[bool]:
        s, filled = self.s, 0
        for done, (block, pair) in enumerate(self.items):
            yield from protocol.wait(self.q_empty, (done & 1) ^ 1)  # both warpgroups are done with Q
            self.q_tiles = ((block, pair), self._q_halves(block, pair))
            self.q_ready.arrive()
            yield True
            for j in range(self._blocks(block)):
                slot, parity = filled % s.stages, ((filled // s.stages) & 1) ^ 1
                for name, x in (("k", self.k), ("v", self.v)):  # K first: QK^T needs it first
                    yield from protocol.wait(self.empty[name][slot], parity)
                    self.rings[name][slot] = ((block, pair, j), self._kv(x, pair, j))
                    self.ready[name][slot].arrive()
                    yield True
                filled += 1

    def _read(self, name: str, slot: int, tag: tuple) -> torch.Tensor:
        """The block in ``name``'s ring slot, which must be ``tag``'s (read as the product retires)."""
        got, block = self.rings[name][slot] or (None, None)
        if got != tag:
            raise protocol.ScheduleError(
                f"program {self.program}: a product of {tag} read {name.upper()} slot {slot} holding {got}"
            )
        return block

    def _read_q(self, w: int, tag: tuple) -> torch.Tensor:
        """Warpgroup ``w``'s half of the Q buffer, which must hold item ``tag``'s tile (read as a QK^T
        retires)."""
        got, halves = self.q_tiles or (None, None)
        if got != tag:
            raise protocol.ScheduleError(f"program {self.program}: a QK^T of item {tag} read Q holding {got}")
        return halves[w]

    def consumer(self, w: int) -> Iterator[bool]:
        """Warpgroup ``w``: rows [w * block_m / 2, (w + 1) * block_m / 2) of each query tile."""
        s, used = self.s, 0  # used: K/V blocks this warpgroup has taken from the rings
        turns = 0  # turns taken: the turn barriers' phases
        half = s.block_m // WARPGROUPS
        for done, (block, pair) in enumerate(self.items):
            b, h = divmod(pair, self.heads)
            scale2, offset = self.scale2, 0
            if self.descales is not None:  # fp8: the item's K/V head's descale_q descale_k in the scale
                scale2, offset = scale2 * self.descales[0][b, h // self.group].item(), P8_OFFSET
            first = block * s.block_m + w * half
            rows = torch.arange(first, first + half)
            masked_from = first_masked_block(first, s.block_n, self.seq_q, self.seq_kv, self.is_causal)
            yield from protocol.wait(self.q_ready, done & 1)
            m = torch.full((half,), -math.inf)
            l = torch.zeros(half)
            o = torch.zeros(half, self.q.shape[-1])
            p = None  # the weights of the block whose PV is next
            blocks = self._blocks(block)
            for j in range(blocks + 1):  # step j: QK^T of block j (j < blocks) beside PV of block j - 1
                here, before = used % s.stages, (used - 1) % s.stages
                if j == blocks and blocks > 0:  # every QK^T has retired: Q is free for the next item
                    self.q_empty.arrive()
                    yield True
                if j < blocks:
                    yield from protocol.wait(self.ready["k"][here], (used // s.stages) & 1)
                if j > 0:
                    yield from protocol.wait(self.ready["v"][before], ((used - 1) // s.stages) & 1)
                # ping-pong: wait for the other warpgroup to have issued its products
                yield from protocol.wait(self.turns[w], (turns & 1) ^ (1 - w))
                issued_s = (here, (block, pair, j)) if j < blocks else None
                issued_pv = (before, (block, pair, j - 1), p) if j > 0 else None
                self.turns[1 - w].arrive()
                turns += 1
                yield True
                alpha = None
                if issued_s is not None:  # S retires first (the PV stays in flight): then the softmax
                    k_block = self._read("k", *issued_s)
                    q = self._read_q(w, (block, pair))
                    self.empty["k"][issued_s[0]].arrive()
                    scores = (q.float() @ k_block.float().T) * scale2
                    if j >= masked_from or not s.split_mask:  # the blocks that need it only
                        keys = torch.arange(j * s.block_n, (j + 1) * s.block_n)
                        seen = (keys < self.seq_kv)[None, :] & self._visible(rows, keys)
                        scores = scores.masked_fill(~seen, -math.inf)
                    m_new = torch.maximum(m, scores.amax(dim=1))
                    base = torch.where(m_new == -math.inf, 0.0, m_new)  # no key seen yet: no inf - inf
                    alpha = torch.exp2(m - base)
                    p_next = torch.exp2(scores - (base - offset)[:, None])  # fp8: 2**8 times the weights
                    l = l * alpha + p_next.sum(dim=1)
                    m = m_new
                    yield True
                if issued_pv is not None:  # then the PV, and only then O's rescale to the new maximum
                    at, tag, weights = issued_pv
                    v_block = self._read("v", at, tag)
                    if self.descales is not None:  # V^T's tile read transposed
                        v_block = v_block.T
                    o += weights.to(self.v.dtype).float() @ v_block.float()
                    self.empty["v"][at].arrive()
                if alpha is not None:
                    o *= alpha[:, None]
                    p = p_next
                    used += 1
                yield True
            if blocks == 0:  # no key for any row: Q freed after the one turn
                self.q_empty.arrive()
                yield True
            self._store(b, h, first, o, l, m, offset)

    def _visible(self, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        if not self.is_causal:
            return torch.ones(len(rows), len(keys), dtype=torch.bool)
        return keys[None, :] <= rows[:, None] + (self.seq_kv - self.seq_q)

    def _store(self, b, h, first, o, l, m, offset) -> None:
        rows = slice(first, min(first + o.shape[0], self.seq_q))
        count = rows.stop - rows.start
        if count <= 0:
            return
        seen = l > 0
        inverse = torch.where(seen, 1.0 / torch.where(seen, l, 1.0), 0.0)
        if self.descales is not None:  # fp8: descale_v on the output
            inverse = inverse * self.descales[1][b, h // self.group]
        self.out[b, h, rows] = (o * inverse[:, None])[:count].to(self.out.dtype)
        lse = torch.where(seen, (m + torch.log2(torch.where(seen, l, 1.0)) - offset) * LN2, -math.inf)
        self.lse[b, h, rows] = lse[:count]


def forward(q, k, v, *, is_causal: bool = False, scale: float | None = None, schedule: Schedule = Schedule(),
            seed: int = 0, descales=None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, lse) of attention over q [B, H, Sq, D], k and v [B, H_kv, Skv, D] (H a multiple of H_kv) as the
    schedule computes them on the CPU, ``out`` in q's dtype, ``lse`` float32 in natural-log units; causal
    masks aligned bottom-right (as :func:`llm_speed.attention.reference.visible`). Entries no program writes
    stay NaN. fp8: e4m3 q, k, v and ``descales`` = (descale_q, descale_k, descale_v), each None (1) or a
    float32 descale of ``llm_speed.gluon.attention.forward``'s shapes; ``out`` bfloat16."""
    batch, heads, seq_q, _ = q.shape
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if descales is not None:  # as the kernel's launcher passes them: folded per K/V head, V transposed
        from ..attention.reference import descale_rows

        rows = [torch.ones(batch, k.shape[1]) if d is None else descale_rows(d, batch, k.shape[1])
                for d in descales]  # fmt: skip
        descales = (rows[0] * rows[1], rows[2])
        v = v.transpose(2, 3)
    out = torch.full(q.shape, math.nan, dtype=q.dtype if descales is None else torch.bfloat16)
    lse = torch.full((batch, heads, seq_q), math.nan)
    n_blocks = cdiv(seq_q, schedule.block_m)
    items = work_items(n_blocks, batch * heads, longest_first=is_causal, section=schedule.section)
    rng = random.Random(seed)
    for program in range(min(schedule.programs, len(items))):
        mine = items[program :: schedule.programs]
        state = _Program(q, k, v, out, lse, mine, schedule, is_causal, scale, program, descales)
        protocol.interleave([state.producer(), state.consumer(0), state.consumer(1)], rng, program)
    return out, lse
