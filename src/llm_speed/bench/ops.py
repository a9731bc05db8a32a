"""``llm-speed bench ops``: forward + backward of each fused op with llm-speed's kernels, the same expression
in eager PyTorch, that expression under ``torch.compile``, and Liger-Kernel's kernel when it is installed.

The ops are those of a Llama layer and its head: RMSNorm ``[tokens, hidden]``, SwiGLU ``[tokens,
intermediate]``, rotary on q ``[1, heads, tokens, head_dim]`` and k ``[1, kv_heads, tokens, head_dim]``, and
the linear cross-entropy of ``[tokens, hidden]`` against a ``[vocab, hidden]`` head. FLOPs and bytes of
every row are the op table's forward and backward costs (``llm_speed.ops`` rows ``rms_norm`` +
``rms_norm_backward``, ``swiglu`` + ``swiglu_backward``, ``apply_rotary`` for q and k, forward and backward,
``fused_linear_cross_entropy`` + ``..._backward``): the figures the profiler records, the same for every
implementation, so GB/s and TFLOP/s compare the implementations on one yardstick (the minimum traffic, not
what each one moves). For the linear cross-entropy the analytic peak-memory saving
(:func:`llm_speed.fused.cross_entropy.memory_estimate`) is reported next to the measured CUDA peaks.

Liger-Kernel (github.com/linkedin/Liger-Kernel) runs through its public API: ``liger_rms_norm``,
``liger_swiglu`` (``LigerSiLUMulFunction``), ``liger_rotary_pos_emb`` (q and k together, cos/sin
``[1, seq, head_dim]`` with both halves equal, as Hugging Face passes them) and
``LigerFusedLinearCrossEntropyLoss`` (``(weight, hidden, target)``). Its kernels need CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.util
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console

from llm_speed import ops
from llm_speed.bench import report
from llm_speed.bench.options import OPS_DTYPES as DTYPES
from llm_speed.bench.options import OPS_IMPLS as IMPLS
from llm_speed.bench.options import OPS_NAMES as OP_NAMES
from llm_speed.bench.options import OPS_TRITON_IMPLS as TRITON_IMPLS
from llm_speed.bench.report import Measurement, bytes_text

# GPU: a Llama-3-8B layer and head at 8192 tokens. CPU: sizes the interpreter runs in about a second.
GPU_DEFAULTS = {
    "tokens": 8192, "hidden": 4096, "intermediate": 14336, "num_heads": 32, "num_kv_heads": 8,
    "head_dim": 128, "vocab": 128256, "dtype": "bf16", "warmup": 10, "iterations": 50, "min_time": 0.2,
}  # fmt: skip
CPU_DEFAULTS = {
    "tokens": 16, "hidden": 64, "intermediate": 96, "num_heads": 2, "num_kv_heads": 1, "head_dim": 32,
    "vocab": 300, "dtype": "fp32", "warmup": 1, "iterations": 3, "min_time": 0.0,
}  # fmt: skip
SIZE_FIELDS = ("tokens", "hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim", "vocab")
LIGER_NOT_INSTALLED = "liger_kernel is not installed (pip install liger-kernel)"
EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class OpsSettings:
    """One ``bench ops`` run."""

    ops: tuple[str, ...]
    tokens: int
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    dtype: str
    impls: tuple[str, ...]
    warmup: int
    iterations: int
    min_time_s: float
    device: str


@dataclasses.dataclass(kw_only=True)
class OpsMeasurement(Measurement):
    """A :class:`Measurement` of one implementation of one op (forward + backward)."""

    op: str
    shape: str
    hbm_peak_fraction: float | None = None  # achieved GB/s over the GPU's HBM peak (GPUs in the table only)


def check_settings(settings: OpsSettings) -> None:
    """ValueError naming the setting when a value is out of range."""
    report.check_counts(settings, *SIZE_FIELDS)
    if settings.head_dim % 2:
        raise ValueError(f"head_dim: rotary needs an even head_dim, got {settings.head_dim}")
    report.check_choice("dtype", settings.dtype, DTYPES)
    report.check_choices("impl", settings.impls, IMPLS)
    report.check_choices("ops", settings.ops, OP_NAMES)


def ops_settings(args: argparse.Namespace, device: torch.device) -> OpsSettings:
    """Settings from parsed flags, defaults filled for the device."""
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS

    def pick(name: str) -> Any:
        value = getattr(args, name)
        return defaults[name] if value is None else value

    settings = OpsSettings(
        ops=tuple(args.ops or OP_NAMES),
        **{name: pick(name) for name in SIZE_FIELDS},
        dtype=pick("dtype"),
        impls=tuple(args.impl or IMPLS),
        warmup=pick("warmup"),
        iterations=pick("iterations"),
        min_time_s=pick("min_time"),
        device=str(device),
    )
    check_settings(settings)
    return settings


# --- Liger-Kernel ------------------------------------------------------------------------------------------


def liger_installed() -> bool:
    """Whether ``liger_kernel`` can be imported (found on the path; its import is tried when it runs)."""
    try:
        return importlib.util.find_spec("liger_kernel") is not None
    except (ImportError, ValueError):
        return False


def liger_unavailable(device: torch.device) -> str | None:
    """Why Liger-Kernel cannot run here, or None when it can be tried."""
    if not liger_installed():
        return LIGER_NOT_INSTALLED
    if device.type != "cuda":
        return f"Liger-Kernel's Triton kernels need a CUDA device (this run is on {device.type})"
    return None


# --- the ops: eager expressions, inputs, costs -------------------------------------------------------------


def eager_rms_norm(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + EPS) * weight.float()).to(x.dtype)


def eager_swiglu(gate, up):
    return F.silu(gate) * up


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def eager_rotary(q, k, cos, sin):
    """Hugging Face Llama's ``apply_rotary_pos_emb`` (cos/sin ``[seq, head_dim]``, both halves equal)."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def eager_cross_entropy(hidden, weight, target):
    """The unfused loss as Hugging Face computes it: full logits, upcast to float32, cross-entropy."""
    return F.cross_entropy(F.linear(hidden, weight).float(), target)


def _llm_speed_fn(op: str) -> Callable[..., Any]:
    from llm_speed.fused.cross_entropy import fused_linear_cross_entropy
    from llm_speed.fused.rms_norm import rms_norm
    from llm_speed.fused.rotary import apply_rotary
    from llm_speed.fused.swiglu import swiglu

    def rotary(q, k, cos, sin):
        half = cos.shape[-1] // 2
        c, s = cos[:, :half], sin[:, :half]
        return apply_rotary(q, c, s), apply_rotary(k, c, s)

    return {
        "rms_norm": lambda x, w: rms_norm(x, w, eps=EPS),
        "swiglu": swiglu,
        "rotary": rotary,
        "linear_cross_entropy": fused_linear_cross_entropy,
    }[op]


def _liger_fn(op: str) -> Callable[..., Any]:
    """Liger-Kernel's implementation of ``op`` through its public API (imported here: it needs CUDA)."""
    if op == "rms_norm":
        from liger_kernel.transformers.functional import liger_rms_norm

        return lambda x, w: liger_rms_norm(x, w, EPS)
    if op == "swiglu":
        from liger_kernel.transformers.functional import liger_swiglu

        return liger_swiglu
    if op == "rotary":
        from liger_kernel.transformers.rope import liger_rotary_pos_emb

        # Liger takes cos/sin [1 or batch, seq, head_dim]
        return lambda q, k, cos, sin: liger_rotary_pos_emb(q, k, cos[None], sin[None])
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda hidden, weight, target: loss(weight, hidden, target)  # Liger's order: weight first


EAGER = {
    "rms_norm": eager_rms_norm,
    "swiglu": eager_swiglu,
    "rotary": eager_rotary,
    "linear_cross_entropy": eager_cross_entropy,
}


def shapes(op: str, s: OpsSettings) -> dict[str, tuple[int, ...]]:
    """The shape of each input of ``op``."""
    t, d = s.tokens, s.head_dim
    return {
        "rms_norm": {"x": (t, s.hidden), "weight": (s.hidden,)},
        "swiglu": {"gate": (t, s.intermediate), "up": (t, s.intermediate)},
        "rotary": {"q": (1, s.num_heads, t, d), "k": (1, s.num_kv_heads, t, d), "cos": (t, d), "sin": (t, d)},
        "linear_cross_entropy": {"hidden": (t, s.hidden), "weight": (s.vocab, s.hidden), "target": (t,)},
    }[op]


def shape_label(op: str, s: OpsSettings) -> str:
    if op == "rms_norm":
        return f"{s.tokens}x{s.hidden}"
    if op == "swiglu":
        return f"{s.tokens}x{s.intermediate}"
    if op == "rotary":
        return f"q 1x{s.num_heads}x{s.tokens}x{s.head_dim}, k 1x{s.num_kv_heads}x{s.tokens}x{s.head_dim}"
    return f"N={s.tokens} H={s.hidden} V={s.vocab}"


def op_cost(op: str, s: OpsSettings) -> tuple[float, float]:
    """(FLOPs, bytes) of one forward + backward of ``op``: the op table's rows, summed as the profiler sums
    them (costs read only shapes and dtypes, so meta tensors stand in for the inputs)."""
    dtype = report.TORCH_DTYPES[s.dtype]
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, shape in shapes(op, s).items()}
    if op == "rms_norm":
        works = [
            ops.get(n).work(x=meta["x"], weight=meta["weight"]) for n in ("rms_norm", "rms_norm_backward")
        ]
    elif op == "swiglu":
        works = [ops.get(n).work(gate=meta["gate"]) for n in ("swiglu", "swiglu_backward")]
    elif op == "rotary":
        # apply_rotary's cos is [seq, head_dim / 2]; forward and backward run the same kernel, for q and k
        half = meta["cos"][:, : s.head_dim // 2]
        works = [ops.get("apply_rotary").work(x=meta[x], cos=half) for x in ("q", "k")] * 2
    else:  # a reduced loss with grad: the gradients made in the forward, scaled by the backward
        hidden, weight = meta["hidden"], meta["weight"]
        works = [
            ops.get("fused_linear_cross_entropy").work(hidden=hidden, weight=weight, gradients=(True, True)),
            ops.get("fused_linear_cross_entropy_backward").work(scaled=(hidden, weight)),
        ]
    return sum(w.flops for w in works), sum(w.bytes_moved for w in works)


# The inputs of each op that take a gradient (cos, sin and the targets do not).
GRAD_INPUTS = {
    "rms_norm": ("x", "weight"), "swiglu": ("gate", "up"), "rotary": ("q", "k"),
    "linear_cross_entropy": ("hidden", "weight"),
}  # fmt: skip
# Each op's outputs, by the input whose shape they have (the loss is one number).
OUTPUT_LIKE = {"rms_norm": ("x",), "swiglu": ("gate",), "rotary": ("q", "k"), "linear_cross_entropy": ()}
# The size options each op's memory depends on, for the message that refuses a size too large.
SIZE_OPTIONS = {
    "rms_norm": ("tokens", "hidden"), "swiglu": ("tokens", "intermediate"),
    "rotary": ("tokens", "num_heads", "num_kv_heads", "head_dim"),
    "linear_cross_entropy": ("tokens", "hidden", "vocab"),
}  # fmt: skip


def memory_floor(op: str, s: OpsSettings, impl: str | None = None) -> int:
    """Bytes one forward + backward of ``op`` holds at least: its inputs, their gradients, its outputs and
    theirs (the ones the step passes). With ``impl``, the linear cross-entropy's memory beyond those too, by
    :func:`llm_speed.fused.cross_entropy.memory_estimate` (eager's logits, llm-speed's chunk); a floor, not
    the peak (eager's float32 copies and the allocator's slack come on top)."""
    from llm_speed.fused.cross_entropy import memory_estimate

    itemsize = report.TORCH_DTYPES[s.dtype].itemsize
    numel = {name: math.prod(shape) for name, shape in shapes(op, s).items()}
    total = sum(count * (8 if name == "target" else itemsize) for name, count in numel.items())
    total += sum(numel[name] for name in (*GRAD_INPUTS[op], *OUTPUT_LIKE[op], *OUTPUT_LIKE[op])) * itemsize
    if op == "linear_cross_entropy" and impl in ("llm_speed", "eager", "torch.compile"):
        estimate = memory_estimate(s.tokens, s.hidden, s.vocab, itemsize)
        total += estimate["fused_bytes" if impl == "llm_speed" else "unfused_bytes"]
    return total


def memory_refusal(s: OpsSettings, available: int | None) -> str | None:
    """Why the run cannot start on a CPU with ``available`` bytes free (None when it can): an op whose
    inputs, outputs and gradients alone exceed them. (A process that asks a CPU for more than it has is
    killed by the system, results and all; a GPU's out-of-memory error is reported in the row.)"""
    if available is None:
        return None
    for op in s.ops:
        need = memory_floor(op, s)
        if need > available:
            sizes = " ".join(f"--{name.replace('_', '-')} {getattr(s, name)}" for name in SIZE_OPTIONS[op])
            return (
                f"sizes: {op} at {sizes} needs at least {bytes_text(need)} (its inputs, outputs and their "
                f"gradients), {bytes_text(available)} of memory is available here; give smaller sizes"
            )
    return None


def _inputs(op: str, s: OpsSettings, device: torch.device) -> tuple:
    dtype = report.TORCH_DTYPES[s.dtype]
    shape = shapes(op, s)

    def randn(name: str, scale: float = 1.0):
        return (torch.randn(shape[name], device=device, dtype=dtype) * scale).requires_grad_(True)

    if op == "rms_norm":
        return randn("x"), randn("weight")
    if op == "swiglu":
        return randn("gate"), randn("up")
    if op == "rotary":
        half = s.head_dim // 2
        positions = torch.arange(s.tokens, device=device, dtype=torch.float32)[:, None]
        angles = positions * 10000.0 ** (-torch.arange(half, device=device, dtype=torch.float32) / half)
        angles = torch.cat((angles, angles), -1)  # Hugging Face's layout: both halves equal
        return randn("q"), randn("k"), angles.cos().to(dtype), angles.sin().to(dtype)
    target = torch.randint(0, s.vocab, shape["target"], device=device)
    return randn("hidden"), randn("weight", s.hidden**-0.5), target


def _function(op: str, impl: str) -> Callable[..., Any]:
    if impl == "llm_speed":
        return _llm_speed_fn(op)
    if impl == "eager":
        return EAGER[op]
    if impl == "torch.compile":
        torch._dynamo.reset()  # each row compiles its own graphs, none reused from an earlier row
        return torch.compile(EAGER[op])
    return _liger_fn(op)


def step_builder(op: str, impl: str, s: OpsSettings, device: torch.device) -> Callable[[], Callable[[], Any]]:
    """A function that makes the inputs and returns one forward + backward step to time."""

    def build() -> Callable[[], Any]:
        fn = _function(op, impl)
        inputs = _inputs(op, s, device)

        def step():
            out = fn(*inputs)
            outs = out if isinstance(out, tuple) else (out,)
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
            return out

        return step

    return build


def run_ops(
    settings: OpsSettings,
    *,
    show_progress: bool = True,
    on_case: Callable[[list[OpsMeasurement]], None] | None = None,
) -> list[OpsMeasurement]:
    """Measure every implementation of every op; ``on_case(rows_so_far)`` after each row (partial writes)."""
    check_settings(settings)
    device = torch.device(settings.device)
    gpu, reason = report.prediction_gpu(device)
    liger_reason = liger_unavailable(device) if "liger" in settings.impls else None
    available = report.cpu_memory(device)  # a row that cannot fit there is not run
    rows: list[OpsMeasurement] = []
    total = len(settings.ops) * len(settings.impls)
    progress = report.progress(total, "ops") if show_progress else contextlib.nullcontext(None)
    with progress as advance:
        for op in settings.ops:
            flops, moved = op_cost(op, settings)
            for impl in settings.impls:
                row = OpsMeasurement(
                    case=op, impl=impl, available=False, flops=flops, bytes_moved=moved, op=op,
                    shape=shape_label(op, settings),
                )  # fmt: skip
                if impl == "liger" and liger_reason is not None:
                    row.reason = liger_reason
                elif shortfall := report.memory_shortfall(memory_floor(op, settings, impl), available):
                    row.reason = shortfall
                else:
                    report.run_measurement(
                        row,
                        step_builder(op, impl, settings, device),
                        device=device,
                        warmup=settings.warmup,
                        iterations=settings.iterations,
                        min_time_s=settings.min_time_s,
                    )
                rows.append(row)
                _compare(rows, gpu, settings.dtype, reason, predictor(settings, gpu))
                if on_case is not None:
                    on_case(rows)
                if advance is not None:
                    advance(f"{op} {impl}")
    return rows


def _compare(rows: Sequence[OpsMeasurement], gpu, dtype: str, reason: str | None, predict_row=None) -> None:
    report.add_comparisons(rows, gpu, dtype, reason, predict_row)
    report.add_hbm_peak_fraction(rows, gpu)


# The op-table rows one forward + backward of each benchmarked op runs, with predict's problem for them.
def predicted_calls(op: str, s: OpsSettings, impl: str) -> list[tuple[str, dict[str, Any]]]:
    """The calls (op table row, problem) one forward + backward of ``op`` by ``impl`` (a bench ops
    implementation name) makes (rotary: q and k, each forward and backward)."""
    if op == "rms_norm":
        return [(name, {"rows": s.tokens, "hidden": s.hidden}) for name in ("rms_norm", "rms_norm_backward")]
    if op == "swiglu":
        return [(name, {"rows": s.tokens, "width": s.intermediate}) for name in ("swiglu", "swiglu_backward")]
    if op == "rotary":
        calls = [("apply_rotary", {"batch": 1, "heads": heads, "seq": s.tokens, "head_dim": s.head_dim})
                 for heads in (s.num_heads, s.num_kv_heads)]  # fmt: skip
        return calls * 2
    # llm-speed's reduced loss with grad makes the gradients in the forward; eager's backward makes them
    problem = {"tokens": s.tokens, "hidden": s.hidden, "vocab": s.vocab, "gradients": impl == "llm_speed"}
    return [(name, problem) for name in ("fused_linear_cross_entropy", "fused_linear_cross_entropy_backward")]


# bench ops' implementation names in llm_speed.perf.predict (torch.compile and Liger are not modelled).
PREDICTED_AS = {"llm_speed": "llm-speed", "eager": "pytorch"}


def predictor(settings: OpsSettings, gpu):
    """Row -> the calibrated prediction of its forward + backward (the calls added), or None."""
    if gpu is None:
        return None
    from llm_speed.perf.predict import predict

    def predict_row(row: OpsMeasurement):
        if row.impl not in PREDICTED_AS:
            return None
        predictions = [
            predict(name, report.prediction_gpu_id(gpu), implementation=PREDICTED_AS[row.impl],
                    dtype=settings.dtype, **problem)  # fmt: skip
            for name, problem in predicted_calls(row.op, settings, row.impl)
        ]
        from dataclasses import replace

        longest = max(predictions, key=lambda p: p.seconds)
        return replace(longest, seconds=sum(p.seconds for p in predictions),
                       calibrated=all(p.calibrated for p in predictions))  # fmt: skip

    return predict_row


def cross_entropy_memory(settings: OpsSettings, rows: Sequence[OpsMeasurement]) -> dict[str, Any] | None:
    """The linear cross-entropy's analytic memory (eager ``2 N V b`` against llm-speed's ``C V b + 8 N``
    beyond inputs and gradients) beside the measured CUDA peaks of its rows; None when it was not run."""
    from llm_speed.fused.cross_entropy import memory_estimate

    if "linear_cross_entropy" not in settings.ops:
        return None
    itemsize = report.TORCH_DTYPES[settings.dtype].itemsize
    estimate = memory_estimate(settings.tokens, settings.hidden, settings.vocab, itemsize)
    peaks = {r.impl: r.peak_memory_bytes for r in rows if r.op == "linear_cross_entropy"}
    fused, eager = peaks.get("llm_speed"), peaks.get("eager")
    measured = eager - fused if fused is not None and eager is not None else None
    ce_rows = [r for r in rows if r.op == "linear_cross_entropy"]
    return {
        "estimate": estimate,
        "estimated_saving_bytes": estimate["unfused_bytes"] - estimate["fused_bytes"],
        "measured_peak_bytes": peaks,
        "measured_saving_bytes": measured,  # eager's peak minus llm-speed's (same inputs and gradients)
        "measured_reason": None
        if measured is not None
        else next((r.peak_memory_reason or r.reason for r in ce_rows if r.peak_memory_bytes is None), None),
    }


def _memory_caption(memory: dict[str, Any] | None) -> str | None:
    if memory is None:
        return None
    est = memory["estimate"]
    text = (
        f"linear cross-entropy memory beyond inputs and gradients, by the formula: eager "
        f"{bytes_text(est['unfused_bytes'])}, llm-speed {bytes_text(est['fused_bytes'])} "
        f"(chunks of {est['chunk_rows']} rows, {est['saving']:.3g}x less)"
    )
    if memory["measured_saving_bytes"] is not None:
        peaks = memory["measured_peak_bytes"]
        text += (
            f"; measured CUDA peaks (inputs and gradients included): eager {bytes_text(peaks['eager'])}, "
            f"llm-speed {bytes_text(peaks['llm_speed'])} (difference "
            f"{bytes_text(memory['measured_saving_bytes'])} against "
            f"{bytes_text(memory['estimated_saving_bytes'])} by the formula)"
        )
    elif memory["measured_reason"]:
        text += f"; not measured: {memory['measured_reason']}"
    return text


def results_payload(settings: OpsSettings, rows: Sequence[OpsMeasurement]) -> dict[str, Any]:
    """The JSON document: provenance, settings, notes, every row and the cross-entropy memory figures."""
    return report.results_document(
        "ops",
        settings,
        rows,
        lambda row: f"{row.op} {row.shape}",
        TRITON_IMPLS,
        cross_entropy_memory=cross_entropy_memory(settings, rows),
    )


def print_ops(settings: OpsSettings, rows: Sequence[OpsMeasurement], console: Console) -> None:
    """One table of every row that ran, then what did not run, the notes and the cross-entropy memory."""
    device = torch.device(settings.device)
    caption = (
        f"forward + backward, dtype={report.TORCH_DTYPES[settings.dtype]}, "
        f"device={report.environment_device_name(device)}"
    )
    table = [
        [
            row.op,
            row.impl,
            row.shape,
            report.hbm_peak_cell(row),
            *report.common_cells(row),
        ]
        for row in rows
        if row.available
    ]
    report.print_rows(
        "Fused ops", ["op", "impl", "shape", "% HBM peak", *report.COMMON_COLUMNS], table, caption=caption,
        console=console,
    )  # fmt: skip
    report.print_unavailable(rows, console)
    notes = report.timing_notes(device, TRITON_IMPLS, rows)
    memory = _memory_caption(cross_entropy_memory(settings, rows))
    for note in [*notes, *([memory] if memory else [])]:
        console.print(f"note: {note}", highlight=False, markup=False)
    if rows and rows[0].prediction_reason:
        console.print(f"note: {rows[0].prediction_reason}", highlight=False, markup=False)
