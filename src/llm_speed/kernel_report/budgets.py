"""What every shipped kernel must be, as compiled for the GPU it is shipped for (``make test`` checks it from
the kernel report; ``llm-speed kernels --check`` exits 1 when one fails):

- **compiles**: the Triton build of the GPU machine compiles it;
- **shared memory**: it fits the shared memory one block may use on the target (the tier's smallest device:
  a configuration that does not fit is refused at launch, "out of resources");
- **no spills in loops**: no local-memory instruction (register spill) inside a loop body, where it would
  run once per iteration;
- **wgmma**: on sm_90a, a kernel that uses tensor cores on tiles of 64 rows or more (both BLOCK_M and
  BLOCK_N) issues warpgroup MMAs (HGMMA / QGMMA / IGMMA), not Ampere's mma.sync;
- **wgmma not serialized**: ptxas keeps a kernel's warpgroup MMAs pipelined (no C7515-style advisory: a
  serialized kernel waits for every MMA, as gemm_fp8's per-tensor kernel did at 0.81x its per-row twin);
- **softmax overlaps wgmma**: an attention forward built to overlap (``OVERLAP``) keeps a product in flight
  over at least :data:`OVERLAP_MIN_INSTRUCTIONS` PTX instructions of its loop (the report's
  ``wgmma_overlap``): the softmax, not only the next block's addresses.
- **consumer registers**, **producer registers**, **register pool**, **tma loads**: a warp-specialized
  kernel (the Gluon kernels, :mod:`llm_speed.gluon`) runs every partition above
  :data:`PRODUCER_MAX_REGISTERS` (and its default partition, unless that is the lean one) at
  :data:`CONSUMER_MIN_REGISTERS` registers or more, has a producer partition at
  :data:`PRODUCER_MAX_REGISTERS` or fewer (``setmaxnreg``, read from the TTGIR and PTX), holds no more
  registers in all than its launch gave it, and loads by TMA (``UTMALDG``).

A shipped configuration that breaks one is changed (a smaller tile, fewer stages), or, for a real trade-off,
listed in :data:`EXCEPTIONS` with its reason. Nothing is excused silently, and an exception that excuses
nothing over every shipped configuration fails ``make test`` (tests/kernel_report), so the table stays true.
"""

from __future__ import annotations

import dataclasses

BUDGETS = ("compiles", "shared memory", "no spills in loops", "wgmma", "wgmma not serialized",
           "softmax overlaps wgmma", "consumer registers", "producer registers", "register pool",
           "tma loads")  # fmt: skip

# A warp-specialized kernel (Gluon's ``warp_specialize``; issue 73's targets: FlashAttention-3 gives its
# consumer warpgroups more registers than the producer's, arXiv:2407.08608 section 3.1): the consumers (the
# default partition, whose warpgroups issue the wgmma) take back at least this many registers per thread by
# ``setmaxnreg``...
CONSUMER_MIN_REGISTERS = 224
# ... and a producer (a worker that only issues TMA copies) gives its registers up to at most this many. A
# worker above it is a consumer (the forward's second warpgroup), held to CONSUMER_MIN_REGISTERS.
PRODUCER_MAX_REGISTERS = 56
# setmaxnreg moves registers within the block's pool (PTX ISA, "setmaxnreg"): what the partitions hold, each
# in whole warpgroups, must fit what the block was launched with, or a TRY_ALLOC spins for ever (a hang).
# Triton 3.6 gave the forward's default partition 256 beside workers at 240 and 24: 520 per lane > 504.
WARPGROUP_WARPS = 4

# The forward's loops issue 70-120 PTX instructions beside a product in flight without the overlap (the PV
# product over the next block's addresses and loads: sm_90a, Triton 3.6, d = 64 and 128, 2026-11-25) and
# 203-208 with it (the next block's QK^T over the softmax).
OVERLAP_MIN_INSTRUCTIONS = 150


@dataclasses.dataclass(frozen=True)
class Exception_:
    """A kernel excused from one budget: ``kernel`` (its launch name), the ``gpu`` it is compiled for
    (None: any), the constexprs it must have (``match``), and why."""

    kernel: str
    budget: str
    reason: str
    gpu: str | None = None
    match: tuple[tuple[str, object], ...] = ()
    variant: tuple[str, ...] = ()  # words the row's variant must hold (``GQA``: not a constexpr)

    def covers(self, row: dict, budget: str) -> bool:
        if budget != self.budget or row["kernel"] != self.kernel:
            return False
        if self.gpu is not None and row["gpu"] != self.gpu:
            return False
        if not set(self.variant) <= set(row["variant"].split()):
            return False
        return all(row["constexprs"].get(name) == value for name, value in self.match)


# Named, reasoned exceptions (none is silent). Keep each one's evidence in its reason.
_MASKED_DKDV = (
    "the 16-bit dK/dV kernel with per-element masks (packed sequences: ragged bounds read on device; a "
    "window with softcap: both window edges and the cap's derivative tile) sits at 255 registers on sm_90a "
    "and spills at every 64-key configuration tried (64x64 with 4 and 8 warps, 1 and 2 stages; Triton 3.6; "
    "docs/guides/attention-hopper.md). Where (2026-11-26, d=128, 4 warps, the H100's backward with dQ in "
    "its own kernel, packed scalars in uniform registers): packed sequences spill 207 LDL/STL in the loop "
    "over the GQA group's query heads (between its per-block loops) and 85 in the per-block loops (4 in the"
    " interior loop, which runs without row bounds: a ragged last query block goes to the masked edge "
    "loops; d=64: 112 in the group loop, none in the per-block ones); a window with softcap 81, of which 40"
    " in the per-block loops (2026-11-26 report of the shipped set, bf16 d=128 GQA 8 on 4; 374 and 91 on "
    "2026-11-25; 231 in the per-block loops before P took the cap's derivative and dP^T started from "
    "-delta). The dense and causal MHA kernels of the shipped rows (whole blocks) do not spill in loops (the "
    "dense GQA kernel: its own entry); "
    "dense ragged lengths do (4000 tokens, causal, 16 heads on 4: 141, 44 in the per-block loops); "
    "32-key tiles would not, but cost the dense path (measured 150 against 391 TFLOP/s on an H100, "
    "docs/guides/attention-hopper.md), and the configuration is chosen per head dim, not per mask. To fix in"
    " the kernel (fewer values live across the group loop; fewer live mask tiles), then drop this entry."
)
_DROPOUT_DKDV = (
    "attention dropout recomputes its mask in the dK/dV kernel's loop, one Philox-4x32-10 draw per (query, "
    "key): its counter tiles beside dK, dV, K, V and the P/dP tiles take the kernel to 255 registers on "
    "sm_90a, which spills inside the loop (Triton 3.6, 2026-11-25, causal fp16 d=128 with ALiBi: 48 LDL/STL "
    "with atomic dQ, 10 on the deterministic path). Tried: dP before dV (70 and 0); scalar and vector "
    "counters (no change); one draw per four queries interleaved by join/reshape (worse, the interleave's "
    "layout conversion). Since the H100's backward went to 4 warps with the dQ kernel (2026-11-25) the "
    "causal ALiBi+dropout dK/dV kernel spills 263 LDL/STL, 151 in its loops (126 and 25 in its two "
    "per-block loops; fp16 d=128, 4096 tokens, 2026-12-07 report, Triton 3.6). Not measured on a GPU with "
    "dropout. To fix in the kernel (fewer bits per entry, as flash-attn's "
    "8-bit threshold, or a smaller query block for this variant, measured first), then drop this entry."
)
_HALVES_CAUSAL_DKDV = (
    "the backward-atomic-dq candidate (dQ by atomics from the dK/dV kernel, the d = 128 head dim in halves, "
    "two 4-warp blocks per SM) spills 26 LDL/STL in its two per-block loops when causal (13 + 13; 255 "
    "registers, 212/236 B; the non-causal one none; Triton 3.6, 2026-12-07 report, as "
    "docs/guides/attention-hopper.md's table of the halves gives it). A candidate, off as shipped; its A/B "
    "times the non-causal problem: before it ships, time the causal one too or take the spill out of the "
    "kernel, then drop this entry."
)
_GQA_DKDV = (
    "the dense 16-bit dK/dV kernel with a GQA group (query heads per KV head > 1) loops over the group's "
    "query heads around its per-block loops (MHA's group of 1 is specialised away, and its loop with it). At "
    "d=128 (64x64, 4 warps, sm_90a, Triton 3.6, 2026-12-07; fp16, 16 query heads on 4 KV heads; 4096 and "
    "16384 tokens alike) it sits at 255 registers and spills: causal 460/480 B, 118 LDL/STL in loops, 5 of "
    "them in the per-block loops (about 600 and 494 instructions a block: ~1%); non-causal 276/272 B, 53 "
    "in the group loop (once per key block and query head), none per block. Tried on the sm_90a build: the "
    "group loop inside each of the three per-block loops (9 and 14 spill instructions per block: worse), "
    "the group a constexpr and unrolled (non-causal none in loops; causal 82 per block: worse). Not timed "
    "on a GPU: the proof's d=128 GQA rows (16k tokens, causal and not, and the train step's Llama "
    "attention) time it. To fix in the kernel (fewer values live across the group loop), then drop this "
    "entry."
)
EXCEPTIONS: tuple[Exception_, ...] = (
    Exception_(
        "flash_attention_bwd_dkdv",
        "no spills in loops",
        _GQA_DKDV,
        gpu="h100-sxm",
        match=(("IS_VARLEN", False), ("DOT_PRECISION", "tf32")),
        variant=("GQA",),
    ),  # fmt: skip
    Exception_(
        "flash_attention_bwd_dkdv",
        "no spills in loops",
        _MASKED_DKDV,
        gpu="h100-sxm",
        match=(("IS_VARLEN", True), ("DOT_PRECISION", "tf32")),
    ),  # fmt: skip
    Exception_(
        "flash_attention_bwd_dkdv",
        "no spills in loops",
        _MASKED_DKDV,
        gpu="h100-sxm",
        match=(("HAS_LEFT", True), ("SOFTCAP", True), ("DOT_PRECISION", "tf32")),
    ),  # fmt: skip
    Exception_(
        "flash_attention_bwd_dkdv",
        "no spills in loops",
        _HALVES_CAUSAL_DKDV,
        gpu="h100-sxm",
        match=(("D_HALVES", True), ("HAS_RIGHT", True), ("HAS_LEFT", False), ("SOFTCAP", False),
               ("HAS_ALIBI", False), ("DROPOUT", False), ("IS_VARLEN", False)),
    ),  # fmt: skip
    Exception_(
        "flash_attention_bwd_dkdv",
        "no spills in loops",
        _DROPOUT_DKDV,
        gpu="h100-sxm",
        match=(("DROPOUT", True),),
    ),  # fmt: skip
)


@dataclasses.dataclass(frozen=True)
class Breach:
    row: dict
    budget: str
    detail: str

    def __str__(self) -> str:
        row = self.row
        return (f"{row['kernel']} [{row['config']}{' ' + row['variant'] if row['variant'] else ''}] on "
                f"{row['gpu']} ({row['target']}): {self.budget}: {self.detail}")  # fmt: skip


def breaches(row: dict) -> list[Breach]:
    """The budgets ``row`` (a kernel report row) breaks, exceptions not applied."""
    if row.get("error"):
        return [Breach(row, "compiles", row["error"].splitlines()[0][:300])]
    found = []
    # what Triton's launcher lets the kernel's (dynamic) shared memory take: the per-block limit less the
    # cubin's static part; Triton's own compile-time check compares with the whole limit, so a kernel in
    # between compiles and then fails to launch
    launchable = row["shared_limit"] - (row.get("static_shared_bytes") or 0)
    if row["shared_bytes"] > launchable:
        static = f" less {row['static_shared_bytes']} B static" if row.get("static_shared_bytes") else ""
        found.append(Breach(
            row, "shared memory", f"{row['shared_bytes']} B > {row['shared_limit']} B per block{static}"
        ))  # fmt: skip
    if row["loop_spill_instructions"]:
        found.append(Breach(
            row, "no spills in loops",
            f"{row['loop_spill_instructions']} LDL/STL inside loops ({row['registers']} registers, "
            f"{row['spill_store_bytes']} B spill stores, {row['spill_load_bytes']} B spill loads)",
        ))  # fmt: skip
    rows = row.get("tile_rows")
    if (
        row["target"] == "sm_90a"
        and row["tensor_cores"] != "none"
        and rows
        and rows >= 64
        and not row["wgmma"]
    ):
        found.append(Breach(row, "wgmma", f"tiles of {rows} rows on {row['tensor_cores']}, not wgmma"))
    if row.get("wgmma_serialized"):
        reason = row["wgmma_serialized"]
        found.append(Breach(row, "wgmma not serialized", f"ptxas: serialized due to {reason}"))
    overlap = row.get("wgmma_overlap")
    if row["constexprs"].get("OVERLAP") is True and (overlap or 0) < OVERLAP_MIN_INSTRUCTIONS:
        found.append(Breach(
            row, "softmax overlaps wgmma",
            f"{overlap} PTX instructions beside a product in flight (< {OVERLAP_MIN_INSTRUCTIONS})",
        ))  # fmt: skip
    parts = row.get("partitions")
    if parts:
        found += _partition_breaches(row, parts)
    return found


def _partition_breaches(row: dict, parts: list[dict]) -> list[Breach]:
    found = []
    # the default partition is a consumer unless it is known to run lean (the backward's producer)
    lean = [p for p in parts if p["registers"] is not None and p["registers"] <= PRODUCER_MAX_REGISTERS]
    consumers = [p for p in parts if p not in lean and (p is parts[0] or p["registers"] is not None)]
    for part in consumers:
        if (part["registers"] or 0) < CONSUMER_MIN_REGISTERS:
            found.append(Breach(
                row, "consumer registers",
                f"{part['name']} ({part['warps']} warps) runs at {part['registers']} registers "
                f"(< {CONSUMER_MIN_REGISTERS})",
            ))  # fmt: skip
    if not lean:
        detail = f"no partition at {PRODUCER_MAX_REGISTERS} registers or fewer (setmaxnreg)"
        found.append(Breach(row, "producer registers", detail))
    launched = row.get("launched_warps")
    if launched and row["registers"] and all(p["registers"] for p in parts):
        held = sum(-(-p["warps"] // WARPGROUP_WARPS) * WARPGROUP_WARPS * p["registers"] for p in parts)
        pool = launched * row["registers"]
        if held > pool:
            split = " + ".join(f"{p['warps']}x{p['registers']}" for p in parts)
            found.append(Breach(
                row, "register pool",
                f"partitions ({split} warps x registers, in whole warpgroups) hold {held} x 32 registers > "
                f"the {pool} x 32 launched ({launched} warps x {row['registers']})",
            ))  # fmt: skip
    if not row.get("tma_loads"):
        found.append(Breach(row, "tma loads", "no UTMALDG in the SASS"))
    return found


def check(rows: list[dict], exceptions: tuple[Exception_, ...] = EXCEPTIONS) -> tuple[list[Breach], list]:
    """(breaches not excused, exceptions that excused nothing) over a report's rows."""
    failing, used = [], set()
    for row in rows:
        for breach in breaches(row):
            excusing = [e for e in exceptions if e.covers(row, breach.budget)]
            if excusing:
                used.update(excusing)
            else:
                failing.append(breach)
    unused = [e for e in exceptions if e not in used]
    return failing, unused
