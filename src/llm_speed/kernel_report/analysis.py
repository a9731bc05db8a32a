"""Reading a compiled kernel: the ptxas log (registers, spills), the SASS (loops, spill instructions inside
them, tensor-core instructions, TMA), the PTX (how deep the asynchronous waits in the loops are) and the
occupancy that registers, shared memory and warps allow. Pure text processing, no Triton and no torch.

Loops are found in SASS as ``cuobjdump -sass`` prints it: a branch back to an instruction on the path of a
depth-first walk of the control flow from the function's entry (``@P0 BRA 0x2af0`` at 0x4a60) closes a loop
whose body is ``[target, branch]``; wait loops of a few instructions (an mbarrier's try-wait) are loops, not
work loops. In PTX a branch to a label defined above it does the same. Local-memory instructions (``LDL``,
``STL``) in a Triton kernel are register spills: Triton never puts arrays in local memory.
"""

from __future__ import annotations

import dataclasses
import functools
import re

# --- the ptxas log ------------------------------------------------------------------------------------------

_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_usage(log: str) -> dict[str, int | None]:
    """Registers per thread, stack frame and spill bytes from ``ptxas -v`` output (None where absent)."""
    registers = _REGISTERS.findall(log)
    spills = _SPILLS.findall(log)
    stack, stores, loads = (int(v) for v in spills[-1]) if spills else (None, None, None)
    return {
        "registers": int(registers[-1]) if registers else None,
        "stack_bytes": stack,
        "spill_store_bytes": stores,
        "spill_load_bytes": loads,
    }


# ptxas's performance advisory (C7515 and its kin) when it gives up pipelining a kernel's warpgroup MMAs:
# every wgmma then gets its own arrive and a wait for zero, whatever wait depth the PTX asked for.
_WGMMA_SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized due to (.+?) in the function")


def wgmma_serialized(log: str) -> str | None:
    """Why ``ptxas -v`` serialized the kernel's wgmma instructions (its words), or None when it did not. Seen
    on sm_90a (Triton 3.6): gemm_fp8 with per-tensor scales, "non wgmma instructions defining accumulator
    registers of a wgmma between start and end of the pipeline stage", 0.81x the per-row kernel on an H100."""
    found = _WGMMA_SERIALIZED.findall(log)
    return found[-1] if found else None


def resource_usage(text: str) -> dict[str, int]:
    """``cuobjdump -res-usage`` fields (REG, STACK, SHARED, LOCAL, ...) of the first function listed."""
    return {key: int(value) for key, value in re.findall(r"\b([A-Z]+):(\d+)", text)}


# --- SASS ---------------------------------------------------------------------------------------------------

_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"\bBRA(?:\.[A-Z.]+)?\s+(?:`\(\.L_x_\d+\)|(0x[0-9a-f]+))")
_OPCODE = re.compile(r"^(?:@!?U?P[T0-9]+\s+)?([A-Z0-9_]+)(?:\.[A-Za-z0-9_.]+)?")
TENSOR_CORE_OPCODES = ("HGMMA", "QGMMA", "IGMMA", "BGMMA", "HMMA", "IMMA", "QMMA", "DMMA")
WGMMA_OPCODES = ("HGMMA", "QGMMA", "IGMMA", "BGMMA")
TMA_OPCODES = ("UTMALDG", "UTMASTG", "UTMAREDG", "UBLKCP")


@dataclasses.dataclass(frozen=True)
class Sass:
    """The instructions of one kernel: (address, text) in order."""

    instructions: tuple[tuple[int, str], ...]

    @classmethod
    def parse(cls, text: str) -> Sass:
        """From ``cuobjdump -sass`` output (one kernel; a second function's addresses would restart at 0 and
        are kept apart by :meth:`loops`, which only pairs a branch with targets of its own function)."""
        return cls(tuple((int(a, 16), body) for a, body in _SASS_LINE.findall(text)))

    def opcodes(self) -> list[str]:
        return list(self._opcodes)

    # Each listing is read by several of the questions below: its opcodes and loops are worked out once.
    @functools.cached_property
    def _opcodes(self) -> tuple[str, ...]:
        return tuple(opcode(body) for _, body in self.instructions)

    def _functions(self) -> list[tuple[tuple[int, str], ...]]:
        """The instructions of each function (its addresses restart at 0)."""
        functions, start = [], 0
        for i in range(1, len(self.instructions) + 1):
            if i == len(self.instructions) or self.instructions[i][0] <= self.instructions[i - 1][0]:
                functions.append(self.instructions[start:i])
                start = i
        return functions

    def loops(self) -> list[tuple[int, int]]:
        """(first, last) address of each loop body: the back edges of a depth-first walk of each function's
        control flow from its entry (a branch to an instruction on the walk's path). So a block placed after
        the function's end (TMA's mbarrier wait retries) that jumps back into it is no loop, whatever ends the
        function (counted as one, it spanned the rest of the main loop and the epilogue), and neither is the
        function's closing branch to itself (never reached; an unconditional self-branch is never a loop)."""
        return list(self._loops)

    @functools.cached_property
    def _loops(self) -> tuple[tuple[int, int], ...]:
        loops = []
        for code in self._functions():
            index = {address: i for i, (address, _) in enumerate(code)}
            successors = [_successors(i, body, index, len(code)) for i, (_, body) in enumerate(code)]
            state = [0] * len(code)  # 0: not seen, 1: on the walk's path, 2: done
            if not code:
                continue
            state[0], path = 1, [(0, iter(successors[0]))]
            while path:
                node, following = path[-1]
                nxt = next(following, None)
                if nxt is None:
                    state[node] = 2
                    path.pop()
                elif state[nxt] == 1:
                    first, last = code[nxt][0], code[node][0]
                    conditional = code[node][1].lstrip().startswith("@")
                    if first <= last and (first < last or conditional):
                        loops.append((first, last))
                elif state[nxt] == 0:
                    state[nxt] = 1
                    path.append((nxt, iter(successors[nxt])))
        return tuple(sorted(loops))

    def is_spin(self, loop: tuple[int, int]) -> bool:
        """A wait loop (an mbarrier's try-wait, setmaxnreg's retry): at most 4 instructions, one of them a
        wait. Real loops, but not where a kernel spends its work."""
        lo, hi = loop
        body = [op for (address, _), op in zip(self.instructions, self._opcodes, strict=True)
                if lo <= address <= hi]  # fmt: skip
        return len(body) <= 4 and any(op in _SPIN_OPCODES for op in body)

    def innermost_loops(self) -> list[tuple[int, int]]:
        """The work loops (not :meth:`is_spin`) that hold no other work loop: where a kernel spends its
        iterations (an attention kernel's loops over blocks, inside its loop over a GQA group's heads)."""
        loops = [loop for loop in self.loops() if not self.is_spin(loop)]

        def holds_another(lo: int, hi: int) -> bool:
            return any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops)

        return [(lo, hi) for lo, hi in loops if not holds_another(lo, hi)]

    def innermost_loop_lengths(self) -> list[int]:
        """The SASS instructions of each innermost loop body, in address order: what one iteration issues
        per warp."""
        return [
            sum(1 for address, _ in self.instructions if lo <= address <= hi)
            for lo, hi in sorted(self.innermost_loops())
        ]

    def spills_in_loops(self, loops: list[tuple[int, int]] | None = None) -> int:
        """Local-memory instructions (register spills) inside any loop body (or inside ``loops``)."""
        loops = self.loops() if loops is None else loops
        return sum(
            1
            for (address, _), op in zip(self.instructions, self._opcodes, strict=True)
            if op in ("LDL", "STL") and any(lo <= address <= hi for lo, hi in loops)
        )

    def spill_instructions(self) -> int:
        return sum(1 for op in self._opcodes if op in ("LDL", "STL"))

    def tensor_cores(self) -> list[str]:
        """The tensor-core opcodes used, wgmma kinds first (HGMMA: fp16/bf16 wgmma; QGMMA: fp8 wgmma;
        IGMMA: int8 wgmma; HMMA / IMMA: mma.sync)."""
        used = set(self._opcodes)
        return [op for op in TENSOR_CORE_OPCODES if op in used]

    def uses_tma(self) -> bool:
        return any(op in TMA_OPCODES for op in self._opcodes)


# Opcodes of a wait that spins: an mbarrier's try-wait, setmaxnreg's allocation retry, a back-off.
_SPIN_OPCODES = ("SYNCS", "USETMAXREG", "NANOSLEEP", "YIELD")


def _successors(i: int, body: str, index: dict[int, int], count: int) -> list[int]:
    """The instructions control can reach from instruction ``i`` (``index``: address -> position): a branch's
    target, and the next one unless ``i`` is an unconditional branch or exit."""
    op, conditional = opcode(body), body.lstrip().startswith("@")
    following = [i + 1] if i + 1 < count else []
    if op in ("EXIT", "RET"):
        return following if conditional else []
    if op == "BRA":
        match = _BRANCH.search(body)
        target = index.get(int(match.group(1), 16)) if match and match.group(1) else None
        taken = [] if target is None else [target]
        return taken + following if conditional else taken
    return following


def opcode(body: str) -> str:
    """The opcode of a SASS instruction's text, without its predicate and modifiers (``@P0 BRA.DIV`` ->
    ``BRA``)."""
    match = _OPCODE.match(body.strip())
    return match.group(1) if match else ""


# --- PTX ----------------------------------------------------------------------------------------------------

_WGMMA_WAIT = re.compile(r"\bwgmma\.wait_group\.sync\.aligned\s+(\d+);")
_CP_ASYNC_WAIT = re.compile(r"\bcp\.async\.wait_group\s+(\d+);")


@dataclasses.dataclass(frozen=True)
class PtxWaits:
    """The deepest asynchronous waits inside loops: ``wgmma.wait_group N`` (N wgmma groups left in flight
    while the loop goes on: 0 waits for every one at once) and ``cp.async.wait_group N`` (loads kept in
    flight). None: no such wait inside a loop."""

    wgmma: int | None
    cp_async: int | None
    wgmma_outside: int | None  # deepest wgmma wait anywhere (a kernel with no loop)


def ptx_waits(ptx: str) -> PtxWaits:
    cfg = _Cfg.of(ptx)
    lines = cfg.lines
    looping = set().union(*cfg.loops.values())  # the blocks of every loop (:class:`_Cfg`)

    def deepest(pattern: re.Pattern, inside: bool) -> int | None:
        found = [
            int(m.group(1))
            for i, line in enumerate(lines)
            for m in [pattern.search(line)]
            if m and (not inside or cfg.block_of.get(i) in looping)
        ]
        return max(found) if found else None

    return PtxWaits(deepest(_WGMMA_WAIT, True), deepest(_CP_ASYNC_WAIT, True), deepest(_WGMMA_WAIT, False))


_WGMMA_COMMIT = re.compile(r"\bwgmma\.commit_group\.sync\.aligned;")


def _is_instruction(line: str) -> bool:
    stripped = line.strip()
    return stripped.endswith(";") and not stripped.startswith((".", "//", "{", "}"))


def wgmma_overlap(ptx: str) -> int | None:
    """The most PTX instructions a loop issues while one of its wgmma groups is in flight: from a
    ``wgmma.commit_group`` to the first ``wgmma.wait_group`` after it, along one path of the loop's control
    flow, round its back edge at most once (:class:`_Cfg`); wgmma instructions themselves are not counted.
    None: no wgmma commit inside a loop, or none waited for in it.

    This is what ``wgmma.wait_group N`` alone does not show: a product waited for with ``wait_group 0`` one
    iteration later (issued, then the softmax, then the wait) overlaps as much as one kept in flight with
    N = 1. A few dozen (the next block's addresses and loads) means the tensor cores wait while the rest of
    the loop runs; hundreds mean softmax or gradient maths run beside a product."""
    return _most_before_a_wait(ptx, lambda line: bool(_WGMMA_COMMIT.search(line)))


def _most_before_a_wait(ptx: str, starts) -> int | None:
    """The most non-wgmma PTX instructions a loop issues on one path from a line where ``starts(line)`` to
    the first ``wgmma.wait_group`` on that path (see :class:`_Cfg`); None: no such line in a loop, or no
    path from one reaches a wait."""
    cfg = _Cfg.of(ptx)
    lines = cfg.lines
    best = None
    for line, block in cfg.block_of.items():
        if starts(lines[line]):
            found = cfg.most_before_a_wait(line, block)
            if found is not None:
                best = found if best is None else max(best, found)
    return best


_PTX_ANY_LABEL = re.compile(r"^([$\w]+):")
_PTX_ANY_BRANCH = re.compile(r"^(@!?%?\w+\s+)?bra(?:\.uni)?\s+([$\w]+)\s*;")
_PTX_RETURN = re.compile(r"^(@!?%?\w+\s+)?(?:ret|exit|trap)\s*;")


@dataclasses.dataclass(frozen=True)
class _Cfg:
    """The basic blocks of a PTX listing: runs of lines that start at a label (``$L__BB0_12:``, or a label
    local to an inline-asm ``{ }`` such as the ``waitLoop:`` of an mbarrier wait) or after a branch or a
    return, and end at a ``bra`` (``@%p bra``: taken or falls through) or ``ret``/``exit``.

    A loop is a branch back to a block on the depth-first search's path (a back edge: LLVM's PTX is
    reducible) with the blocks that reach it without passing its header. The layout in the text does not
    matter: Triton places a loop's header after its latch and an if/else's join above both arms.

    The count from a start line follows the innermost loop holding it, along one path at a time: forward
    through the loop's blocks (the if/else arm that issues more, never both), round its back edge at most
    once and then no further than the start line, through any loop nested in it once (an mbarrier wait's
    retry counts its two instructions once), and it ends at the first ``wgmma.wait_group`` on the path.
    A path that leaves the loop, or comes back to its start line with no wait on the way, is not counted:
    the product is not waited for in the loop."""

    lines: tuple[str, ...]
    blocks: tuple[tuple[int, ...], ...]  # the line numbers of each block's instructions, in order
    successors: tuple[tuple[int, ...], ...]
    block_of: dict[int, int]  # instruction line -> block

    @staticmethod
    @functools.lru_cache(maxsize=2)
    def of(ptx: str) -> _Cfg:
        """The graph of a listing, parsed once for the several questions asked of one kernel's PTX."""
        return _Cfg.parse(ptx.splitlines())

    @classmethod
    def parse(cls, lines: list[str]) -> _Cfg:
        scopes, opened, labels, branches = [0], 0, {}, []
        blocks: list[list[int]] = [[]]
        ends: list[str] = [""]  # how each block ends: "bra", "cbra" (may fall through), "ret" or "" (falls)

        def new_block() -> None:
            blocks.append([])
            ends.append("")

        for i, line in enumerate(lines):
            text = line.strip()
            if text == "{":
                opened += 1
                scopes.append(opened)
                continue
            if text == "}":
                if len(scopes) > 1:
                    scopes.pop()
                continue
            label = _PTX_ANY_LABEL.match(text)
            if label:
                if blocks[-1]:
                    new_block()
                labels[(scopes[-1], label.group(1))] = len(blocks) - 1
                continue
            if not _is_instruction(line):
                continue
            if ends[-1]:
                new_block()
            blocks[-1].append(i)
            branch, returns = _PTX_ANY_BRANCH.match(text), _PTX_RETURN.match(text)
            if branch:
                branches.append((len(blocks) - 1, branch.group(2), tuple(scopes)))
                ends[-1] = "cbra" if branch.group(1) else "bra"
            elif returns:
                ends[-1] = "cbra" if returns.group(1) else "ret"
        successors: list[list[int]] = [[] for _ in blocks]
        for block, name, scope in branches:
            target = next((labels[(s, name)] for s in reversed(scope) if (s, name) in labels), None)
            if target is not None:
                successors[block].append(target)
        for block, end in enumerate(ends):
            if end in ("", "cbra") and block + 1 < len(blocks):
                successors[block].append(block + 1)
        block_of = {line: b for b, block in enumerate(blocks) for line in block}
        return cls(tuple(lines), tuple(map(tuple, blocks)), tuple(map(tuple, successors)), block_of)

    @functools.cached_property
    def back_edges(self) -> set[tuple[int, int]]:
        """Edges to a block on the depth-first path (from each block not yet reached, in text order)."""
        return _depth_first(range(len(self.blocks)), self.successors)[1]

    @functools.cached_property
    def loops(self) -> dict[int, set[int]]:
        """Header -> the blocks of its loop."""
        predecessors: list[list[int]] = [[] for _ in self.blocks]
        for block, following in enumerate(self.successors):
            for f in following:
                predecessors[f].append(block)
        loops: dict[int, set[int]] = {}
        for latch, header in self.back_edges:
            body = loops.setdefault(header, {header})
            todo = [latch]
            while todo:
                block = todo.pop()
                if block not in body:
                    body.add(block)
                    todo.extend(predecessors[block])
        return loops

    def most_before_a_wait(self, start: int, block: int) -> int | None:
        holding = [(len(body), header, body) for header, body in self.loops.items() if block in body]
        if not holding:
            return None
        _, header, body = min(holding, key=lambda loop: loop[0])
        back = self.back_edges
        forward = {b: [f for f in self.successors[b] if f in body and (b, f) not in back] for b in body}

        def walk(b: int, lines) -> tuple[int, bool | None]:
            """Instructions issued along ``lines`` of block b before a wait (True), the start line (None)
            or the block's end (False)."""
            count = 0
            for i in lines:
                if _WGMMA_WAIT.search(self.lines[i]):
                    return count, True
                if i == start:
                    return count, None
                count += "wgmma." not in self.lines[i]
            return count, False

        def most(values: list[int | None]) -> int | None:
            found = [v for v in values if v is not None]
            return max(found) if found else None

        # the loop's blocks with no back edge form a DAG: each block's value from its successors' values
        order = _depth_first(sorted(body), forward)[0]

        def values(turn: int | None) -> dict[int, int | None]:
            """From each block's top to a wait; ``turn``: the value of taking the back edge."""
            found: dict[int, int | None] = {}
            for b in order:
                count, stopped = walk(b, self.blocks[b])
                turns = [turn] if (b, header) in back else []
                if stopped is False:
                    found[b] = _plus(count, most([found[f] for f in forward[b]] + turns))
                else:
                    found[b] = count if stopped else None
            return found

        again = values(None)  # after the back edge: no second turn
        first = values(again[header])
        lines = self.blocks[block]
        count, stopped = walk(block, lines[lines.index(start) + 1 :])
        if stopped:
            return count
        turns = [again[header]] if (block, header) in back else []
        return _plus(count, most([first[f] for f in forward[block]] + turns))


def _depth_first(roots, successors) -> tuple[list[int], set[tuple[int, int]]]:
    """Blocks in post-order (each after every block it reaches, back edges aside) and the back edges: those
    to a block on the search's path, searching from each root not yet reached."""
    state: dict[int, int] = {}  # 1: on the path, 2: done
    order, back = [], set()
    for root in roots:
        if root in state:
            continue
        state[root] = 1
        stack = [(root, iter(successors[root]))]
        while stack:
            block, rest = stack[-1]
            following = next(rest, None)
            if following is None:
                state[block] = 2
                order.append(block)
                stack.pop()
            elif state.get(following) == 1:
                back.add((block, following))
            elif following not in state:
                state[following] = 1
                stack.append((following, iter(successors[following])))
    return order, back


def _plus(count: int, more: int | None) -> int | None:
    return None if more is None else count + more


def wgmma_in_flight(ptx: str) -> int | None:
    """The most PTX instructions a loop issues after a ``wgmma.wait_group N`` with N >= 1 (a product left in
    flight) and before the next ``wgmma.wait_group``, along one path of the loop's control flow, round its
    back edge at most once (:class:`_Cfg`); wgmma instructions themselves are not counted. None: no such
    wait inside a loop.

    :func:`wgmma_overlap` counts from a commit to the first wait after it; a kernel that commits two
    products and at once waits for all but the last (FlashAttention-3's intra-warpgroup overlap: S retired,
    the PV kept in flight) runs its softmax after that wait, which only this count sees."""

    def leaves_one(line: str) -> bool:
        waited = _WGMMA_WAIT.search(line)
        return bool(waited) and int(waited.group(1)) >= 1

    return _most_before_a_wait(ptx, leaves_one)


def ptx_uses_tma(ptx: str) -> bool:
    return "cp.async.bulk.tensor" in ptx


# --- warp specialization (Gluon's ``warp_specialize``) ------------------------------------------------------

_MODULE_WARPS = re.compile(r'"ttg\.num-warps" = (\d+)')
_REQUESTED = re.compile(r"ttg\.warp_specialize\(.*requestedRegisters = array<i32: ([\d, ]+)>")
_PARTITION = re.compile(r"^\s*partition(\d+)\(.*\) num_warps\((\d+)\)", re.MULTILINE)
_SETMAXNREG = re.compile(r"\bsetmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+);")
_MBARRIER_WAIT = re.compile(r"\bmbarrier\.try_wait\b")


@dataclasses.dataclass(frozen=True)
class Partition:
    """One partition of a warp-specialized kernel: its warps and the registers per thread it runs with
    (None: no ``setmaxnreg`` for it, the launch's count applies)."""

    name: str
    warps: int
    registers: int | None


def partitions(ttgir: str, ptx: str) -> list[Partition] | None:
    """The partitions of a warp-specialized kernel (None for any other): the default one (the kernel's
    ``num_warps``) first, then each worker as its TTGIR ``ttg.warp_specialize`` declares it (warps, and the
    registers it requests, which Triton sets by ``setmaxnreg``). The default partition runs with what the
    launch's pool (``.reqntid`` x ``.maxnreg``) leaves after the workers (whole warpgroups), rounded down
    to 8, where the PTX sets that count by ``setmaxnreg`` (Triton 3.6's split: 256 beside workers at 224 and
    24, 24 beside two at 240); else the largest ``setmaxnreg.inc`` (what the workers gave up, taken back),
    when it exceeds every worker's request; ptxas's own count otherwise."""
    if "ttg.warp_specialize" not in ttgir:
        return None
    module = _MODULE_WARPS.search(ttgir)
    requested = _REQUESTED.search(ttgir)
    registers = [int(r) for r in requested.group(1).split(",")] if requested else []
    workers = sorted((int(i), int(w)) for i, w in _PARTITION.findall(ttgir))
    warps = int(module.group(1)) if module else 0
    counts = [int(v) for _, v in _SETMAXNREG.findall(ptx)]
    raised = [int(v) for kind, v in _SETMAXNREG.findall(ptx) if kind == "inc"]
    default = max(raised) if raised and max(raised) > max(registers, default=0) else None
    launched, limit = launched_warps(ptx), _MAXNREG.search(ptx)
    if launched and limit and warps and len(registers) == len(workers):
        given = sum(-(-w // 4) * 4 * r for (_, w), r in zip(workers, registers, strict=True))
        left = (launched * int(limit.group(1)) - given) // warps // 8 * 8
        default = left if left in counts else default
    found = [Partition("default", warps, default)]
    for index, warps in workers:
        found.append(Partition(f"worker{index}", warps, registers[index] if index < len(registers) else None))
    return found


_REQNTID = re.compile(r"^\s*\.reqntid\s+(\d+)", re.MULTILINE)
_MAXNREG = re.compile(r"^\s*\.maxnreg\s+(\d+)", re.MULTILINE)


def launched_warps(ptx: str) -> int | None:
    """The warps a block launches with (PTX ``.reqntid``, which Triton sets), None where absent."""
    found = _REQNTID.search(ptx)
    return int(found.group(1)) // 32 if found else None


def setmaxnreg(ptx: str) -> list[str]:
    """The distinct ``setmaxnreg`` of the PTX, in order: ``dec 24``, ``inc 240``."""
    return list(dict.fromkeys(f"{kind} {value}" for kind, value in _SETMAXNREG.findall(ptx)))


def mbarrier_waits(ptx: str) -> int:
    """mbarrier waits in the PTX (``mbarrier.try_wait``, each in its retry loop)."""
    return len(_MBARRIER_WAIT.findall(ptx))


def tma_loads(code: Sass) -> int:
    """TMA loads (``UTMALDG``) in the SASS."""
    return sum(1 for op in code.opcodes() if op == "UTMALDG")


# --- occupancy ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SmLimits:
    """Per-SM limits of a compute capability: CUDA C++ Programming Guide, "Compute Capabilities", table
    "Technical Specifications per Compute Capability" (resident warps and blocks per SM, 32-bit registers per
    SM, register allocation unit per warp, shared memory reserved per block by the system)."""

    max_warps: int
    max_blocks: int
    registers: int = 64 * 1024
    register_unit: int = 256  # registers are allocated per warp in units of 256
    reserved_smem_per_block: int = 1024  # 1 KB per block from compute capability 8.0 (0 before)


SM_LIMITS: dict[tuple[int, int], SmLimits] = {
    (7, 5): SmLimits(max_warps=32, max_blocks=16, reserved_smem_per_block=0),
    (8, 0): SmLimits(max_warps=64, max_blocks=32),
    (8, 6): SmLimits(max_warps=48, max_blocks=16),
    (8, 7): SmLimits(max_warps=48, max_blocks=16),
    (8, 9): SmLimits(max_warps=48, max_blocks=24),
    (9, 0): SmLimits(max_warps=64, max_blocks=32),
    (10, 0): SmLimits(max_warps=64, max_blocks=32),
    (12, 0): SmLimits(max_warps=48, max_blocks=32),
}


def sm_limits(capability: tuple[int, int]) -> SmLimits:
    """The limits of ``capability`` (the closest listed one at or below it)."""
    known = sorted(c for c in SM_LIMITS if c <= tuple(capability))
    return SM_LIMITS[known[-1] if known else min(SM_LIMITS)]


@dataclasses.dataclass(frozen=True)
class Occupancy:
    blocks: int  # resident blocks per SM (0: the block does not fit at all)
    warps: int
    limited_by: str  # "registers", "shared memory", "warps" or "blocks"


def occupancy(
    registers: int, shared_bytes: int, num_warps: int, smem_per_sm: int, capability: tuple[int, int]
) -> Occupancy:
    """Blocks and warps per SM a kernel of ``registers`` per thread, ``shared_bytes`` per block and
    ``num_warps`` per block can keep resident (the CUDA occupancy calculator's rule)."""
    limits = sm_limits(capability)
    per_warp = -(-max(registers, 1) * 32 // limits.register_unit) * limits.register_unit
    bounds = {
        "registers": limits.registers // (per_warp * num_warps),
        "shared memory": smem_per_sm // (shared_bytes + limits.reserved_smem_per_block),
        "warps": limits.max_warps // num_warps,
        "blocks": limits.max_blocks,
    }
    limited_by = min(bounds, key=bounds.__getitem__)  # the first of the tightest, in this order
    blocks = max(0, bounds[limited_by])
    return Occupancy(blocks, blocks * num_warps, limited_by)
