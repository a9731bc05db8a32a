"""The proof's headline and A/B calls (``run_gpu_suite.sh proof``) as kernel-report problems, so that the
Triton cache carried to the GPU (``triton_cache.py``) holds the kernels those steps compile there.

The report's problems (``llm_speed.kernel_report.problems``) stand for the headline's sizes only where a
launcher picks the same kernels at both; the headline's own calls differ in ways a kernel's cache key sees:
bf16 where the report has fp16, a GQA 4:1 or a head dim of 80, 96 or 111, a weight [N, K] read transposed at
M = 1 and 16, a dense or 16-token-paged decode cache at batch 1, 8 and 64 (its split count a constexpr), the
fused ops at 65536 tokens. So each problem here is one headline command line (``gpu_bench.proof_lines``,
the same text the GPU runs), parsed by llm-speed's own parser into the benchmark's settings, its sizes the
GPU defaults where the line leaves one out, and run by the benchmark's own loop (``run_attention``,
``run_gemm``, ``run_decode``, ``run_ops``) over llm-speed's implementations only, each workload built by the
benchmark's builder on CPU tensors and called once (``report.run_measurement`` replaced: no timing). Under
``capture`` (``simulated_gpu``: the CUDA code path with every launch a no-op, the H100 standing in) that
records the launches the GPU run makes. ``bench train-step`` builds its Hugging Face model (Llama-3-8B's
first two layers) on this CPU, its linear layers shape-only (:func:`shape_only_linear`: their matmuls are
cuBLAS's on a GPU, minutes of CPU here). The A/B's problems are each candidate's target made by
``attention_ab.make_call`` at its full size, under the shipped policy and under the candidate's.

Left out: the rows of other libraries (SDPA, cuBLAS, ``torch.compile``, Liger, the unpatched model), whose
kernels are not in Triton's cache. The linear cross-entropy's own matmuls (``torch.mm`` over ``[N, V]``
chunks, cuBLAS on a GPU) are shape-only while its problems run (:func:`shape_only_matmuls`): 26 TFLOP on
two cores otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT / "src", ROOT / "benchmarks"):  # this checkout's llm_speed and its sibling scripts
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

# The headline's sets in gpu_bench.py, in the proof's order.
HEADLINE_SETS = ("proof-attention", "proof-gemm", "proof-fp8", "proof-decode", "proof-ce", "proof-train-step")
# Problems that hold GBs of CPU tensors while captured (fused ops at 65536 tokens ~11 GB, the train step's
# model ~8 GB): a build gives them to one worker, one after the other.
HEAVY = ("fused_kernel_time", "proof-train-step")
FUSED_TOKENS = 65536  # fused_kernel_time.py's default (run_gpu_suite.sh runs it without --tokens)


class NotCaptured(RuntimeError):
    """A headline row that did not reach its kernels on this CPU (its builder or op raised, or the
    benchmark skipped it): the archive would miss its kernels, so the build says so instead."""


@contextlib.contextmanager
def shape_only_matmuls() -> Iterator[None]:
    """Inside the block, ``torch.mm``, ``torch.addmm`` and ``Tensor.addmm_`` return a tensor of the product's
    shape (``out`` where given) without computing it: the cross-entropy's chunked GEMMs are cuBLAS's on a
    GPU (no Triton kernel of theirs to cache), and its Triton kernels read only their shapes and strides."""
    saved = torch.mm, torch.addmm, torch.Tensor.addmm_

    def mm(a, b, *, out=None):
        return out if out is not None else a.new_empty(a.shape[0], b.shape[1])

    def addmm(bias, a, b, *, beta=1, alpha=1, out=None):
        return out if out is not None else a.new_empty(a.shape[0], b.shape[1])

    def addmm_(self, a, b, *, beta=1, alpha=1):
        return self

    torch.mm, torch.addmm, torch.Tensor.addmm_ = mm, addmm, addmm_
    try:
        yield
    finally:
        torch.mm, torch.addmm, torch.Tensor.addmm_ = saved


class ShapeOnlyLinear(torch.autograd.Function):
    """``F.linear`` that computes nothing: its output and gradients have the shapes and dtypes of the real
    ones."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.inputs = x, weight, bias
        return x.new_empty(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight, bias = ctx.inputs
        return torch.empty_like(x), torch.empty_like(weight), None if bias is None else torch.empty_like(bias)


@contextlib.contextmanager
def shape_only_linear() -> Iterator[None]:
    """Inside the block, ``torch.nn.functional.linear`` (what ``nn.Linear`` calls) returns and back-propagates
    tensors of the right shapes without computing them: a model's projections are cuBLAS's on a GPU."""
    functional = torch.nn.functional
    saved = functional.linear
    functional.linear = lambda x, weight, bias=None: ShapeOnlyLinear.apply(x, weight, bias)
    try:
        yield
    finally:
        functional.linear = saved


@contextlib.contextmanager
def call_once(calls: list, errors: list) -> Iterator[None]:
    """Inside the block, ``llm_speed.bench.report.run_measurement`` builds a row's workload and calls it once
    (no timing, no peak memory, no graph replay); ``calls`` counts the rows it ran, ``errors`` what raised."""
    from llm_speed.bench import report

    saved = report.run_measurement

    def once(row, build, *, context=contextlib.nullcontext, **_):
        calls.append(row)
        try:
            with context():
                build()()
        except Exception as error:  # said by the problem after its loop (one raise would hide the others)
            errors.append(f"{row.case} {row.impl}: {type(error).__name__}: {error}"[:500])
        return row

    report.run_measurement = once
    try:
        yield
    finally:
        report.run_measurement = saved


def _settings(line: str):
    """(benchmark, settings) of one ``llm-speed bench ...`` line, on CPU tensors, llm-speed's rows only."""
    from llm_speed import cli
    from llm_speed.bench import cli as bench_cli
    from llm_speed.bench import decode, ops, options, train_step

    args = cli.build_parser().parse_args(shlex.split(line))
    args.device = "cpu"
    gpu = torch.device("cuda")  # the GPU's defaults for what the line leaves out (settings only: no tensor)
    kind = args.benchmark
    if kind == "attention":
        settings, ours = bench_cli.attention_settings(args), options.ATTENTION_LLM_SPEED_IMPLS
    elif kind == "gemm":
        settings, ours = bench_cli.gemm_settings(args), options.GEMM_TRITON_IMPLS
    elif kind == "decode":
        settings, ours = decode.decode_settings(args, gpu), options.DECODE_TRITON_IMPLS
    elif kind == "ops":
        settings, ours = ops.ops_settings(args, gpu), ("llm_speed",)
    elif kind == "train-step":
        settings, ours = train_step.train_step_settings(args, gpu), ("llm_speed",)
    else:
        raise ValueError(f"{line!r}: no capture for bench {kind}")
    impls = tuple(impl for impl in settings.impls if impl in ours)
    if not impls:
        raise ValueError(f"{line!r}: none of llm-speed's implementations ({', '.join(ours)}) is asked for")
    return kind, dataclasses.replace(settings, impls=impls, device="cpu")


def _run(kind: str, settings) -> None:
    from llm_speed.bench import attention, decode, gemm, ops, train_step

    calls: list = []
    errors: list[str] = []
    runner = {"attention": attention.run_attention, "gemm": gemm.run_gemm, "decode": decode.run_decode,
              "ops": ops.run_ops, "train-step": train_step.run_train_step}[kind]  # fmt: skip
    matmuls = shape_only_matmuls() if kind in ("ops", "train-step") else contextlib.nullcontext()
    linear = shape_only_linear() if kind == "train-step" else contextlib.nullcontext()
    with call_once(calls, errors), matmuls, linear:
        rows = runner(settings, show_progress=False)
    skipped = [f"{row.case} {row.impl}: {row.reason}" for row in rows if row not in calls]
    if errors or skipped:
        raise NotCaptured("; ".join(errors + skipped))


def bench_problem(line: str, label: str):
    """The problem of one headline line: its llm-speed rows, each workload called once."""
    from llm_speed.kernel_report.problems import Problem

    kind, settings = _settings(line)

    def run(recording) -> None:
        with recording():
            _run(kind, settings)

    return Problem(f"bench {kind}", label, run)


def fused_problem(tokens: int = FUSED_TOKENS):
    """fused_kernel_time.py's rows (rms_norm, SwiGLU, rotary forward + backward at ``tokens``): the
    ``bench ops`` steps it times, at its settings."""
    import argparse

    import fused_kernel_time

    from llm_speed.kernel_report.problems import Problem

    args = argparse.Namespace(ops=list(fused_kernel_time.OPS), tokens=tokens, impl=["llm_speed"], warmup=1,
                              iterations=1)  # fmt: skip
    settings = dataclasses.replace(fused_kernel_time.settings_for(args), device="cpu")

    def run(recording) -> None:
        with recording():
            _run("ops", settings)

    return Problem("bench ops", f"fused_kernel_time {' '.join(settings.ops)} tokens={tokens}", run)


def ab_problems() -> list:
    """Each A/B candidate's target at its full size, under the shipped policy and under the candidate's
    (``attention_ab.make_call``: the call it times)."""
    import attention_ab

    from llm_speed.core.policy import CANDIDATES, SHIPPED, use_policy
    from llm_speed.kernel_report.problems import Problem

    def problem(name: str, policy, target: dict):
        def run(recording) -> None:
            with use_policy(policy), recording():  # the inputs' own kernels too (quantize_fp8)
                attention_ab.make_call(target, "cpu")()

        return Problem(target["op"], f"A/B {name} ({target['pass']})", run)

    made = []
    for candidate in CANDIDATES.values():
        made += [problem("shipped at " + candidate.name, SHIPPED, candidate.target),
                 problem(candidate.name, candidate.policy, candidate.target)]  # fmt: skip
    return made


def proof_problems() -> list:
    """Every problem of the proof's headline (its llm-speed rows) and A/B, in the proof's order."""
    import gpu_bench

    made = []
    for name in HEADLINE_SETS:
        for line in gpu_bench.proof_lines(name, "OUT"):
            words = shlex.split(line)
            label = words[words.index("--output") + 1].removeprefix("OUT/") if "--output" in words else line
            made.append(bench_problem(line, f"{name} {label}"))
        if name == "proof-decode":
            made.append(fused_problem())  # run_gpu_suite.sh: headline_fused after headline_decode
    return made + ab_problems()


def heavy(problem) -> bool:
    """Whether ``problem`` holds GBs of CPU tensors while captured (:data:`HEAVY`)."""
    return any(text in problem.label for text in HEAVY)
