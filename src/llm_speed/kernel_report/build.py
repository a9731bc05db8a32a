"""Compile a captured launch for a GPU that is not there, and read what the compiler made of it.

Triton's own launch path does the specialisation: the launch is replayed through ``JITFunction.run`` with a
stand-in driver that reports the target GPU, so Triton binds the plan's fixed and per-call arguments,
specialises them (dtypes, 16-byte alignment, integers equal to 1 or divisible by 16) and builds its cache
key exactly as on a GPU; where it would compile, the source, target and options it would compile with are
taken, and :func:`triton.compile` builds them for real (``ptxas -v`` logging registers and spills). This
runs in the worker process of the Triton build being checked (:mod:`llm_speed.kernel_report.worker`).
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import io
import pathlib
import re
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from llm_speed.core.gpus import get_gpu
from llm_speed.core.hardware import Hardware
from llm_speed.kernel_report import analysis
from llm_speed.kernel_report.capture import Launch


@dataclasses.dataclass(frozen=True)
class Target:
    """The GPU compiled for: its table entry, what its launchers see, and what its SMs hold."""

    gpu: str
    capability: tuple[int, int]
    hardware: Hardware
    smem_per_sm: int

    @property
    def arch(self) -> str:
        major, minor = self.capability
        suffix = "a" if self.capability >= (9, 0) else ""  # Triton builds sm_90a / sm_100a for wgmma, tcgen05
        return f"sm_{major}{minor}{suffix}"


def target_of(gpu: str) -> Target:
    """The :class:`Target` of a GPU table entry (``llm_speed.core.gpus``), e.g. "h100-sxm"."""
    spec = get_gpu(gpu)
    return Target(
        spec.id, tuple(spec.compute_capability), Hardware.from_spec(spec), spec.smem_per_sm_kb * 1024
    )


class _StandInDriver:
    """What Triton's launch path asks of the active driver, for a GPU that is not there."""

    def __init__(self, capability: tuple[int, int]):
        self.capability = capability[0] * 10 + capability[1]

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.capability, 32)

    def get_current_device(self):
        return 0

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


@contextlib.contextmanager
def stand_in_driver(target: Target) -> Iterator[None]:
    """Triton's active driver reports ``target`` inside the block."""
    from triton.runtime import driver

    saved = getattr(driver, "_active", None)  # None until first used; the real one needs a GPU to exist
    driver.set_active(_StandInDriver(target.capability))
    try:
        yield
    finally:
        driver._active = saved


@dataclasses.dataclass
class Build:
    """What Triton would compile for a launch: its cache key, source, target and options."""

    key: str
    source: Any
    target: Any
    options: dict


class _Specialised(Exception):
    def __init__(self, build: Build):
        super().__init__("specialised")
        self.build = build


def specialise(launch: Launch) -> Build:
    """The :class:`Build` of a launch: replayed through Triton's launch path up to the compile (inside
    :func:`stand_in_driver`)."""
    from triton.runtime.jit import JITFunction

    def take(self, key, signature, device, constexprs, options, attrs, warmup):
        target = self.device_caches[device][2]
        raise _Specialised(Build(repr(key), self.ASTSource(self, signature, constexprs, attrs), target,
                                 dict(options.__dict__)))  # fmt: skip

    plan = launch.plan
    saved = JITFunction._do_compile
    JITFunction._do_compile = take
    try:
        plan.kernel.fn[plan.grid](**plan.arguments(launch.per_call), num_warps=plan.num_warps,
                                  num_stages=plan.num_stages)  # fmt: skip
    except _Specialised as taken:
        return taken.build
    finally:
        JITFunction._do_compile = saved
    raise RuntimeError(f"{plan!r}: Triton's launch path did not reach a compile")


def _tool(name: str) -> str:
    import triton

    try:
        from triton import knobs

        return getattr(knobs.nvidia, name).path
    except (ImportError, AttributeError):  # pragma: no cover - older Triton
        return str(pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_build(build: Build) -> tuple[Any, str, float]:
    """(compiled kernel, ptxas log, seconds) of a :class:`Build`; the log is empty when Triton's cache
    served it (the worker runs with a fresh cache, so it is not)."""
    import triton
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(build.source, target=build.target, options=build.options)
    finally:
        knobs.nvidia.dump_ptxas_log = False
    return compiled, log.getvalue(), time.perf_counter() - start


def disassemble(cubin: bytes, arch: str) -> tuple[str, str]:
    """(SASS, ``cuobjdump -res-usage``) of one cubin built for ``arch`` ("sm_90a"): :func:`disassemble_all`
    of one."""
    return disassemble_all([cubin], arch)[0]


def disassemble_all(cubins: Sequence[bytes], arch: str) -> list[tuple[str, str]]:
    """(SASS, ``cuobjdump -res-usage``) of each cubin built for ``arch``, with the tools Triton ships.

    The SASS of all of them comes from one ``nvdisasm`` run over their code laid end to end (raw mode): its
    start-up costs ~0.33 s of CPU whatever the kernel's size, which paid once a kernel by ``cuobjdump -sass``
    was 44 of the 160 s of compiling the H100's 121 shipped kernels, and 5 s for all of them at once. Each
    kernel's text is then put back as ``cuobjdump -sass`` prints it (addresses from 0, branch targets its
    own, the encodings beside each instruction). A cubin whose code is not one function, or a batch that
    ``nvdisasm`` refuses, is read by ``cuobjdump -sass`` a cubin at a time."""
    codes = [_function_code(cubin) for cubin in cubins]
    batch = [i for i, code in enumerate(codes) if code is not None]
    sass: dict[int, str] = {}
    if batch:
        try:
            sass = dict(zip(batch, _nvdisasm_raw([codes[i] for i in batch], arch), strict=True))
        except (OSError, subprocess.CalledProcessError, ValueError):  # no nvdisasm, or it refused
            sass = {}
    results = []
    for i, cubin in enumerate(cubins):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
            file.write(cubin)
            file.flush()
            if i not in sass:
                sass[i] = _run_tool("cuobjdump", "-sass", file.name)
            results.append((sass[i], _run_tool("cuobjdump", "-res-usage", file.name)))
    return results


def _run_tool(name: str, *args: str) -> str:
    return subprocess.run([_tool(name), *args], capture_output=True, text=True, check=True).stdout


def _function_code(cubin: bytes) -> tuple[str, bytes] | None:
    """(name, machine code) of a cubin's one function (its one ``.text.<name>`` section of the ELF64
    image), or None where it has another count of them or is not such an image."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return None
    try:
        start = struct.unpack_from("<Q", cubin, 0x28)[0]  # the section header table
        entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
        headers = [struct.unpack_from("<IIQQQQ", cubin, start + i * entry_size) for i in range(count)]
        names = headers[names_index][4]
        texts = []
        for name_at, _, _, _, offset, size in headers:
            name = cubin[names + name_at : cubin.index(b"\0", names + name_at)].decode()
            if name.startswith(".text."):
                texts.append((name.removeprefix(".text."), cubin[offset : offset + size]))
    except (struct.error, IndexError, ValueError):  # a truncated or malformed image
        return None
    return texts[0] if len(texts) == 1 else None


# Instructions whose hexadecimal operands are code addresses (the rest are immediates and offsets).
_CODE_ADDRESS_OPCODES = ("BRA", "BRX", "BSSY", "CALL", "JMP", "JMX", "RET", "WARPSYNC")
_RAW_LINE = re.compile(r"^\s*/\*([0-9a-f]+)\*/(\s+)(.*?)(\s*;.*)$")


def _nvdisasm_raw(codes: list[tuple[str, bytes]], arch: str) -> list[str]:
    """The ``cuobjdump -sass`` text of each (name, code), from one ``nvdisasm -b`` run over them all."""
    blob, spans = bytearray(), []
    for _, code in codes:
        blob += bytes(-len(blob) % 128)  # functions start 128-byte aligned, as in a cubin
        spans.append((len(blob), len(blob) + len(code)))
        blob += code
    with tempfile.NamedTemporaryFile(suffix=".bin") as file:
        file.write(blob)
        file.flush()
        text = _run_tool("nvdisasm", "-hex", "-b", "SM" + arch.removeprefix("sm_"), file.name)
    lines: list[list[str]] = [[] for _ in codes]
    starts = [lo for lo, _ in spans]
    current = None
    for line in text.splitlines():
        match = _RAW_LINE.match(line)
        if match is None:
            if current is not None and line.strip().startswith("/* 0x"):  # an encoding's second half
                lines[current].append(line)
            continue
        address = int(match.group(1), 16)
        current = bisect.bisect_right(starts, address) - 1
        lo, hi = spans[current]
        if address >= hi:
            current = None
            continue  # the padding between functions
        body = match.group(3)
        if analysis.opcode(body) in _CODE_ADDRESS_OPCODES:
            body = _rebase_addresses(body, lo, hi)
        lines[current].append(f"        /*{address - lo:04x}*/{match.group(2)}{body}{match.group(4)}")
    counts = [len(code) // 16 for _, code in codes]
    for (name, _), found, count in zip(codes, lines, counts, strict=True):
        if sum(1 for line in found if _RAW_LINE.match(line)) != count:
            raise ValueError(f"nvdisasm gave {name} another instruction count than its {count}")
    return [
        f"\n\tcode for {arch}\n\t\tFunction : {name}\n" + "\n".join(found) + "\n"
        for (name, _), found in zip(codes, lines, strict=True)
    ]


def _rebase_addresses(body: str, lo: int, hi: int) -> str:
    """A control-flow instruction's targets in ``[lo, hi]`` made relative to ``lo``."""

    def rebase(literal: re.Match) -> str:
        value = int(literal.group(0), 16)
        return f"{value - lo:#x}" if lo <= value <= hi else literal.group(0)

    return re.sub(r"0x[0-9a-f]+", rebase, body)


def config_text(plan) -> str:
    """``M128 N128 D128 w8 s3``: the tile constexprs of a plan (BLOCK_X as X), warps and stages."""
    order = {"BLOCK_M": 0, "BLOCK_N": 1, "BLOCK_K": 2, "BLOCK_D": 3}
    names = sorted((n for n in plan.fixed if n.startswith("BLOCK_")), key=lambda n: (order.get(n, 4), n))
    tiles = [
        f"{name.removeprefix('BLOCK_')}{plan.fixed[name]}"
        for name in names
        if type(plan.fixed[name]) is int and not (name == "BLOCK_B" and plan.fixed[name] == 1)
    ]
    return " ".join([*tiles, f"w{plan.num_warps}", f"s{plan.num_stages}"])


# Switches not worth a column: layout and rounding details every variant has.
_QUIET_SWITCHES = ("EVEN_", "RNE_BY_HAND", "DOT_IN_FP32")


def variant_text(plan) -> str:
    """The constexpr switches that are on (``HAS_RIGHT SOFTCAP``), string constexprs (``ieee``), and ``GQA``
    where the kernel's ``group`` of query heads per KV head is not 1 (Triton specialises an integer equal
    to 1: the group's loop is gone from the MHA kernel)."""
    words = []
    for name, value in plan.fixed.items():
        if name.startswith(_QUIET_SWITCHES) or not name.isupper():
            continue
        if value is True:
            words.append(name)
        elif isinstance(value, str) and name != "DOT_PRECISION":
            words.append(f"{name}={value}")
        elif name == "DOT_PRECISION" and value == "ieee":
            words.append("ieee")
    group = plan.fixed.get("group")
    if isinstance(group, int) and group != 1:
        words.append("GQA")
    return " ".join(words)


def tile_rows(plan) -> int | None:
    """The rows of the kernel's smallest matrix-product tile: min(BLOCK_M, BLOCK_N) (attention kernels
    multiply with both as the M side; GEMMs with BLOCK_M), None for a kernel with neither."""
    sizes = [plan.fixed[name] for name in ("BLOCK_M", "BLOCK_N") if isinstance(plan.fixed.get(name), int)]
    return min(sizes) if sizes else None


def analyse(compiled: Any, log: str, sass: str, usage: str, target: Target, plan) -> dict:
    """The report's fields of one compiled kernel."""
    from_log = analysis.ptxas_usage(log)
    res = analysis.resource_usage(usage)
    registers = from_log["registers"] if from_log["registers"] is not None else res.get("REG")
    code = analysis.Sass.parse(sass)
    ptx = compiled.asm.get("ptx", "")
    waits = analysis.ptx_waits(ptx)
    shared = int(compiled.metadata.shared)
    # A warp-specialized kernel launches its workers' warps too (PTX .reqntid), in whole warpgroups.
    warps = analysis.launched_warps(ptx) or plan.num_warps
    occupancy = analysis.occupancy(registers or 0, shared, warps, target.smem_per_sm,
                                   target.capability)  # fmt: skip
    tensor_cores = code.tensor_cores()
    return {
        "registers": registers,
        "stack_bytes": from_log["stack_bytes"] if from_log["stack_bytes"] is not None else res.get("STACK"),
        "spill_store_bytes": from_log["spill_store_bytes"],
        "spill_load_bytes": from_log["spill_load_bytes"],
        "spill_instructions": code.spill_instructions(),
        "loop_spill_instructions": code.spills_in_loops(),
        "inner_loop_spill_instructions": code.spills_in_loops(code.innermost_loops()),
        "loops": len(code.loops()),
        "inner_loop_instructions": code.innermost_loop_lengths(),
        "shared_bytes": shared,
        "shared_limit": target.hardware.smem_per_block_bytes,
        # the cubin's static shared memory (cuobjdump -res-usage; 1 KB on every sm_90a kernel read so far):
        # Triton's launcher allows the dynamic part the per-block limit less this (driver.c's
        # cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES, optin - static))
        "static_shared_bytes": res.get("SHARED"),
        "launched_warps": warps,
        "blocks_per_sm": occupancy.blocks,
        "warps_per_sm": occupancy.warps,
        "occupancy_limited_by": occupancy.limited_by,
        "tensor_cores": "+".join(tensor_cores) or "none",
        "wgmma": any(op in analysis.WGMMA_OPCODES for op in tensor_cores),
        "wgmma_wait": waits.wgmma,
        "wgmma_overlap": analysis.wgmma_overlap(ptx),
        "wgmma_in_flight": analysis.wgmma_in_flight(ptx),
        "wgmma_serialized": analysis.wgmma_serialized(log),
        "cp_async_wait": waits.cp_async,
        "tma": code.uses_tma() or analysis.ptx_uses_tma(ptx),
        "tile_rows": tile_rows(plan),
        **warp_specialization(compiled, ptx, code),
    }


def warp_specialization(compiled: Any, ptx: str, code: analysis.Sass) -> dict:
    """The fields of a warp-specialized kernel (empty for any other): each partition's warps and registers,
    the ``setmaxnreg`` it issues, its mbarrier waits and its TMA loads."""
    parts = analysis.partitions(compiled.asm.get("ttgir", ""), ptx)
    if parts is None:
        return {}
    return {
        "partitions": [dataclasses.asdict(part) for part in parts],
        "setmaxnreg": analysis.setmaxnreg(ptx),
        "mbarrier_waits": analysis.mbarrier_waits(ptx),
        "tma_loads": analysis.tma_loads(code),
    }
