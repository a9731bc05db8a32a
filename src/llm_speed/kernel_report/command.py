"""``llm-speed kernels``: every op's kernels compiled for a GPU that is not there, as their launchers launch
them, and what the compiler made of each (docs/guides/kernel-report.md)."""

from __future__ import annotations

import argparse
import math
import sys
import time

from llm_speed import _cli
from llm_speed.core.intmath import MAX_TENSOR_BYTES

COLUMNS = (
    "#", "kernel", "op", "config", "variant", "regs", "spill B (st/ld)", "LDL/STL in loops (inner)",
    "smem KiB / limit", "blocks x warps /SM", "tensor cores", "wgmma wait (overlap)", "TMA",
    "partitions warps x regs",
)  # fmt: skip


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``llm-speed kernels``."""
    parser = subparsers.add_parser(
        "kernels",
        help="compile every kernel for a GPU (no GPU needed): registers, spills, shared memory, tensor cores",
        description="Compile every op's kernels for a GPU of the table, exactly as the ops' launchers would "
        "launch them for the given problems (no GPU needed: Triton's compiler and the ptxas/nvdisasm of its "
        "wheel), and report per kernel: configuration, registers, spills (and LDL/STL inside loops), shared "
        "memory against the per-block limit, blocks and warps per SM, tensor-core instructions, the deepest "
        "wgmma wait inside loops, and TMA.",
    )
    from llm_speed.kernel_report.problems import DTYPE_NAMES, GLUON_BUILDERS, GLUON_DEFAULT  # torch-free

    parser.add_argument("--op", action="append", metavar="NAME",
                        help=f"an op-table row or a Gluon kernel ({', '.join(GLUON_BUILDERS)}) (repeat; "
                        f"default: every row with a kernel, and {', '.join(GLUON_DEFAULT)})")  # fmt: skip
    parser.add_argument("--gpu", default="h100-sxm",
                        help="GPU table entry to compile for and to choose configurations for "
                        "(default h100-sxm: sm_90a)")  # fmt: skip
    parser.add_argument("--dtype", action="append", choices=DTYPE_NAMES,
                        help="operand dtype (repeat for several; default fp16; one the GPU has a peak for: "
                        "no bf16 on a T4)")  # fmt: skip
    parser.add_argument("--head-dim", action="append", type=_cli.positive_int, metavar="D",
                        help="attention head dim (repeat; default 64 and 128)")  # fmt: skip
    parser.add_argument("--seq", type=_cli.positive_int,
                        help="attention tokens per sequence, decode cache length (default 4096)")  # fmt: skip
    parser.add_argument("--heads", type=_cli.positive_int, help="attention heads (default 16)")
    parser.add_argument("--size", type=_cli.positive_int,
                        help="GEMM M=N=K and fused ops' rows and hidden size (default 4096)")  # fmt: skip
    parser.add_argument("--backward", action="append", choices=("default", "deterministic"),
                        help="attention backward path (repeat; default both)")  # fmt: skip
    parser.add_argument("--shipped", action="store_true",
                        help="also every shipped attention configuration of the GPU's tier, in rotating "
                        "mask variants, and the candidate launch choices' problems (`make test` checks this "
                        "set on the H100; on the L4 only the attention tier)")  # fmt: skip
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a kernel breaks a budget (llm_speed.kernel_report.budgets)",
    )
    parser.add_argument("--triton", metavar="DIR",
                        help="directory holding the Triton build to compile with (default: "
                        "$LLM_SPEED_TRITON_GPU when it holds one, else the installed Triton)")  # fmt: skip
    parser.add_argument("--workers", type=_cli.positive_int,
                        help="compile processes (default: CPU count; never more than there are kernels)")
    parser.add_argument("--sass", metavar="DIR", help="keep each kernel's PTX and SASS in DIR")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--output", metavar="FILE.json", help="also write the report as JSON to this file")
    parser.set_defaults(func=run_kernels_command)


def run_kernels_command(args: argparse.Namespace) -> int:
    """``llm-speed kernels``: exit 0, 1 when ``--check`` finds a breach, 2 on bad input."""
    import pathlib

    from llm_speed import ops
    from llm_speed._output import dump_json, prepare_output_folder, prepare_output_path
    from llm_speed.core.gpus import get_gpu
    from llm_speed.kernel_report import budgets, problems, report

    spec = get_gpu(args.gpu)  # ValueError naming the known GPUs
    gpu = spec.id
    if spec.vendor != "NVIDIA":
        raise _cli.CommandError(f"--gpu: {gpu} is an {spec.vendor} GPU ({spec.name}); kernels compiles for "
                                "NVIDIA GPUs only (Triton's NVIDIA backend, ptxas and nvdisasm)")  # fmt: skip
    # As roofline and analyze do: a dtype the GPU has no peak for (bf16 on a T4: no bf16 tensor cores) is
    # refused, not compiled into kernels that GPU cannot run.
    accepted = [name for name in problems.DTYPE_NAMES if name in spec.peak_tflops]
    for dtype in args.dtype or ():
        if dtype not in spec.peak_tflops:
            raise _cli.CommandError(f"--dtype {dtype}: {gpu} ({spec.name}) has no {dtype} peak: it does not "
                                    f"run {dtype}; accepted on {gpu}: {', '.join(accepted)}")  # fmt: skip
    gluon = [name for name in args.op or () if name in problems.GLUON_BUILDERS]
    if gluon and tuple(spec.compute_capability) != (9, 0):
        major, minor = spec.compute_capability
        raise _cli.CommandError(f"--op {gluon[0]}: the Gluon kernels are built for sm_90a only; --gpu {gpu} "
                                f"is sm_{major}{minor} (use h100-sxm, h200, ...)")  # fmt: skip
    for name in args.op or ():
        if name not in problems.BUILDERS and name not in problems.GLUON_BUILDERS:
            row = ops.get(name)  # ValueError listing the rows for an unknown name
            raise _cli.CommandError(f"--op: {name} has no kernel to compile"
                                    + (" (plain PyTorch)" if row.plain_pytorch else ""))  # fmt: skip
    refusal = inapplicable_options(args)
    if refusal:
        raise _cli.CommandError(refusal)
    for name in SIZE_OPTIONS:  # None in the parser, to tell an option given from one left alone
        if getattr(args, name) is None:
            setattr(args, name, getattr(problems.Options, name))
    if args.output:
        prepare_output_path(args.output, argument="--output")
    if args.sass:
        prepare_output_folder(args.sass, argument="--sass")
    build = args.triton or report.gpu_build()
    if args.triton and not (pathlib.Path(args.triton) / "triton").is_dir():
        raise _cli.CommandError(f"--triton: {args.triton} holds no triton package")
    size_refusal = unrepresentable_sizes(args)
    if size_refusal:
        raise _cli.CommandError(size_refusal)
    options = dict(seq=args.seq, heads=args.heads, size=args.size)
    if args.dtype:
        options["dtypes"] = list(dict.fromkeys(args.dtype))
    if args.head_dim:
        options["head_dims"] = list(dict.fromkeys(args.head_dim))
    options["backward"] = list(dict.fromkeys(args.backward or ("default", "deterministic")))
    result = report.run_report(
        gpu=gpu, ops=args.op, options=options, problem_set="shipped" if args.shipped else "default",
        workers=args.workers, build=build, sass_dir=args.sass, progress=Progress(gpu),
    )  # fmt: skip
    failing, _ = budgets.check(result["rows"])
    result["breaches"] = [str(b) for b in failing]
    if args.output:
        dump_json(result, args.output)
    if args.json:
        dump_json(result)
    else:
        print_report(result)
    if args.check and failing:
        print(f"llm-speed kernels: {len(failing)} budget breaches", file=sys.stderr)
        return 1
    return 0


# The size options whose defaults are problems.Options'.
SIZE_OPTIONS = ("seq", "heads", "size")
# Options field -> its flag, in the order of the help.
OPTION_FLAGS = {"dtypes": "--dtype", "head_dims": "--head-dim", "seq": "--seq", "heads": "--heads",
                "size": "--size", "backward": "--backward"}  # fmt: skip


def inapplicable_options(args: argparse.Namespace) -> str | None:
    """Why options given do not apply to the ``--op`` chosen (None when each is read by one of them): an
    attention option for a GEMM, ``--size`` for attention, ``--dtype`` for the int8 GEMM, would otherwise be
    ignored without a word. Without ``--op`` every row runs and every option applies; ``--shipped`` reads
    ``--backward`` (its attention tier runs both paths by default)."""
    from llm_speed.kernel_report import problems  # torch-free

    if not args.op:
        return None
    values = {"dtypes": args.dtype, "head_dims": args.head_dim, "seq": args.seq, "heads": args.heads,
              "size": args.size, "backward": args.backward}  # fmt: skip
    chosen = list(dict.fromkeys(args.op))
    read = set().union(*(problems.OPTIONS_READ[name] for name in chosen))
    if args.shipped:
        read.add("backward")
    unread = [flag for name, flag in OPTION_FLAGS.items() if values[name] is not None and name not in read]
    if not unread:
        return None
    taken = [flag for name, flag in OPTION_FLAGS.items() if name in read]
    takes = ", ".join(taken) if taken else "no size or dtype option: fixed shapes"
    return (f"{', '.join(unread)}: {'does' if len(unread) == 1 else 'do'} not apply to --op "
            f"{', '.join(chosen)} (whose problems take {takes})")


# A problem tensor past PyTorch's byte count is refused before anything is allocated; 4 bytes an element
# (fp32, the widest operand).
MAX_ELEMENTS = MAX_TENSOR_BYTES // 4
MAX_SIZE = math.isqrt(MAX_ELEMENTS)  # the GEMM and fused problems' [size, size] tensors
# The decode problem's KV cache: 8 sequences x 8 KV heads over --seq tokens (problems.decode_problem).
DECODE_CACHE_HEADS = 64


def unrepresentable_sizes(args: argparse.Namespace) -> str | None:
    """Why the size options make a problem tensor too large for PyTorch to describe at all (None when they
    do not): refused here, before the workers start. Sizes that are representable but do not fit this CPU's
    memory are found by the workers when they allocate (their tensors are real: the launches are captured
    with them)."""
    from llm_speed.kernel_report import problems  # torch-free

    if args.size > MAX_SIZE:
        return (f"--size: {args.size} is too large: the GEMM and fused ops' [size, size] tensors would take "
                f"over 2^63 bytes, more than PyTorch can represent; accepted: 1 to {MAX_SIZE} (and what fits "
                "this machine's memory)")  # fmt: skip
    head_dim = max(args.head_dim or problems.Options.head_dims)
    elements = max(args.heads, DECODE_CACHE_HEADS) * args.seq * head_dim
    if elements > MAX_ELEMENTS:
        return (f"--seq {args.seq}, --heads {args.heads}, --head-dim {head_dim}: the attention problems' "
                f"tensors (max(heads, {DECODE_CACHE_HEADS}) x seq x head dim = {elements} elements) would "
                "take over 2^63 bytes, more than PyTorch can represent; accepted: max(--heads, "
                f"{DECODE_CACHE_HEADS}) x --seq x --head-dim up to {MAX_ELEMENTS}")  # fmt: skip
    return None


class Progress:
    """The report's progress on stderr (stdout may be JSON): what runs now, then each kernel compiled; on a
    terminal one line rewritten in place, elsewhere a line per tenth of the kernels."""

    def __init__(self, gpu: str, stream=None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.perf_counter()
        self.in_place = self.stream.isatty()
        self.shown = -1
        self._say(f"llm-speed kernels: capturing the ops' launches for {gpu} (no GPU needed)...")

    def __call__(self, compiled: int, total: int | None) -> None:
        if total is None:
            return
        step = 1 if self.in_place else max(1, total // 10)
        due = compiled in (0, total) or compiled >= self.shown + step
        if compiled == self.shown or not due:
            return
        self.shown = compiled
        elapsed = time.perf_counter() - self.started
        self._say(f"llm-speed kernels: {compiled}/{total} kernels compiled ({elapsed:.0f} s)",
                  last=compiled == total)  # fmt: skip

    def _say(self, text: str, last: bool = False) -> None:
        if self.in_place:
            self.stream.write("\r\033[K" + text + ("\n" if last else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def table_row(row: dict) -> tuple:
    if row.get("error"):
        return (row["index"], row["kernel"], row["op"], row["config"], row["variant"], "error",
                row["error"].splitlines()[0][:80], *("",) * 7)  # fmt: skip
    spills = f"{row['spill_store_bytes']}/{row['spill_load_bytes']}" if row["spill_store_bytes"] else "0"
    smem = f"{row['shared_bytes'] / 1024:.1f} / {row['shared_limit'] // 1024}"
    return (
        row["index"], row["kernel"], row["op"], row["config"], row["variant"], row["registers"], spills,
        f"{row['loop_spill_instructions']} ({row['inner_loop_spill_instructions']})", smem,
        f"{row['blocks_per_sm']} x {row.get('launched_warps') or row['num_warps']}",
        row["tensor_cores"],
        wgmma_text(row), row["tma"], partitions_text(row),
    )  # fmt: skip


def partitions_text(row: dict) -> str:
    """``8x240 + 1x24, 2 mbarrier waits, 49 in flight``: a warp-specialized kernel's partitions, default
    first (warps x registers per thread, ``?`` where no setmaxnreg sets them), its mbarrier waits and the most
    instructions a loop issues after a ``wgmma.wait_group N >= 1`` (the report's ``wgmma_in_flight``); - for
    any other kernel."""
    parts = row.get("partitions")
    if not parts:
        return "-"
    text = " + ".join(f"{p['warps']}x{p['registers'] if p['registers'] is not None else '?'}" for p in parts)
    return f"{text}, {row['mbarrier_waits']} mbarrier waits, {row.get('wgmma_in_flight')} in flight"


def wgmma_text(row: dict) -> str:
    """``0 (208)``: the deepest wgmma wait in loops and the most instructions issued beside a product in
    flight; ``serialized`` where ptxas serialized the wgmma (then neither number holds on the GPU)."""
    if row.get("wgmma_wait") is None and row.get("wgmma_overlap") is None:
        return "-"
    text = f"{row['wgmma_wait']} ({row.get('wgmma_overlap')})"
    return f"{text} serialized" if row.get("wgmma_serialized") else text


def print_report(result: dict) -> None:
    from llm_speed._output import print_table

    rows = result["rows"]
    target = rows[0]["target"] if rows else "?"
    print_table(
        f"Kernels compiled for {result['gpu']} ({target}), Triton {result['triton']} "
        f"({result['triton_build']})",
        COLUMNS, [table_row(row) for row in rows],
        caption=(
            "regs: per thread; wgmma wait (overlap): the deepest wgmma.wait_group N inside loops (0: each"
            " wait retires every product in flight) and, in brackets, the most instructions a loop issues"
            " while a product is in flight (a few dozen: addresses and loads only; hundreds: softmax or "
            "gradient maths beside the tensor cores); - : no wgmma in a loop; serialized: ptxas "
            "serialized the wgmma whatever the PTX says, its reason in the JSON's wgmma_serialized); "
            "LDL/STL in loops: spill instructions in any loop (inner: in loops that hold no other loop, "
            "run once per block); blocks x warps: resident per SM (occupancy); partitions: a "
            "warp-specialized (Gluon) kernel's default partition and workers, warps x registers per thread "
            "after setmaxnreg, its mbarrier waits, and the most instructions a loop issues after a wgmma "
            "wait that leaves a product in flight (the softmax beside the PV: hundreds)."
        ),
    )  # fmt: skip
    for breach in result["breaches"]:
        _cli.console().print(f"budget: {breach}")
