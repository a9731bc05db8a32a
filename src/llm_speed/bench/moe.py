"""``llm-speed bench moe``: a mixture-of-experts layer's experts, tokens x experts x top_k, three ways.

- ``llm_speed``: :func:`llm_speed.fused_moe` (sort on the device, grouped gate/up GEMM with SwiGLU in its
  epilogue, grouped down GEMM, weighted combine; its own backward);
- ``grouped_mm``: the same algorithm in PyTorch around ``torch._grouped_mm`` (CUTLASS on a GPU): a stable
  ``argsort`` of the expert ids, the gathered rows, the gate/up grouped GEMM, ``silu(gate) * up``, the down
  grouped GEMM, the weighted ``index_add`` (what transformers' ``grouped_mm`` experts implementation does);
  autograd for the backward;
- ``hf-loop``: Hugging Face's eager loop over experts (``MixtralExperts.forward``,
  :func:`llm_speed.moe.reference.fused_moe_reference`).

Every implementation gets the same hidden states, weights and routing (top-k of a softmax over random
logits: the routing itself is not timed). ``--mode fwd`` times the forward (no autograd graph);
``fwd+bwd`` the forward and the backward for the hidden states, both weights and the routing weights.
FLOPs and bytes are the op table's ``fused_moe`` (+ ``fused_moe_backward``) costs for every row, one
yardstick, with the weights of the experts this routing hits (``experts_hit``) where the op table, which
reads no ids, counts the expected number; peak memory is measured on CUDA. On a CPU the times are of the
interpreter (llm_speed) and of PyTorch's CPU kernels and say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from rich.console import Console

from llm_speed import ops
from llm_speed.bench import report
from llm_speed.bench.options import MOE_DTYPES as DTYPES
from llm_speed.bench.options import MOE_IMPLS as IMPLS
from llm_speed.bench.options import MOE_MODES as MODES
from llm_speed.bench.options import MOE_TRITON_IMPLS as TRITON_IMPLS
from llm_speed.bench.report import Measurement

# GPU: Qwen3-30B-A3B's expert shapes (hidden 2048, expert width 768) from Mixtral's 8 experts to 128, top-2
# and top-8, at 2k and 8k tokens. CPU: sizes the interpreter runs in well under a second per case.
GPU_DEFAULTS = {
    "tokens": (2048, 8192), "experts": (8, 64, 128), "top_k": (2, 8), "hidden": 2048, "intermediate": 768,
    "dtype": "bf16", "warmup": 3, "iterations": 10, "min_time": 0.2,
}  # fmt: skip
CPU_DEFAULTS = {
    "tokens": (16,), "experts": (4, 8), "top_k": (2,), "hidden": 32, "intermediate": 16, "dtype": "fp32",
    "warmup": 1, "iterations": 2, "min_time": 0.0,
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class MoeSettings:
    """One ``bench moe`` run: every (tokens, experts, top_k) with top_k <= experts is a case."""

    tokens: tuple[int, ...]
    experts: tuple[int, ...]
    top_k: tuple[int, ...]
    hidden: int
    intermediate: int
    dtype: str
    mode: str
    impls: tuple[str, ...]
    warmup: int
    iterations: int
    min_time_s: float
    device: str

    def cases(self) -> list[tuple[int, int, int]]:
        return [(t, e, k) for t in self.tokens for e in self.experts for k in self.top_k if k <= e]


@dataclasses.dataclass(kw_only=True)
class MoeMeasurement(Measurement):
    """A :class:`Measurement` of one implementation on one (tokens, experts, top_k)."""

    tokens: int
    experts: int
    top_k: int
    experts_hit: int  # the experts the case's routing sends at least one token to: their weights are read


def check_settings(settings: MoeSettings) -> None:
    """ValueError naming the setting when a value is out of range, before any work."""
    report.check_lengths(settings, "tokens", "experts", "top_k")
    report.check_counts(settings, "hidden", "intermediate")
    report.check_choice("dtype", settings.dtype, DTYPES)
    report.check_choice("mode", settings.mode, MODES)
    report.check_choices("impl", settings.impls, IMPLS)
    if not settings.cases():
        raise ValueError(
            f"top_k: every value ({list(settings.top_k)}) exceeds every experts value "
            f"({list(settings.experts)})"
        )


def moe_settings(args: argparse.Namespace, device: torch.device) -> MoeSettings:
    """Settings from parsed flags, defaults filled for the device."""
    defaults = GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS

    def pick(name: str, flag: str | None = None) -> Any:
        value = getattr(args, flag or name)
        return defaults[name] if value is None else value

    settings = MoeSettings(
        tokens=tuple(pick("tokens")),
        experts=tuple(pick("experts")),
        top_k=tuple(pick("top_k")),
        hidden=pick("hidden"),
        intermediate=pick("intermediate"),
        dtype=pick("dtype"),
        mode=args.mode,
        impls=tuple(args.impl or IMPLS),
        warmup=pick("warmup"),
        iterations=pick("iterations"),
        min_time_s=pick("min_time"),
        device=str(device),
    )
    check_settings(settings)
    return settings


# --- the implementations ------------------------------------------------------------------------------------


def grouped_mm_moe(hidden, w_gate_up, w_down, topk_weights, topk_ids):
    """The experts in PyTorch around ``torch._grouped_mm``: sort the copies by expert, gather, two grouped
    GEMMs with SwiGLU between, weight and ``index_add`` back (no host read: ``histc`` counts the copies)."""
    tokens, top_k = topk_ids.shape
    experts = w_gate_up.shape[0]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.float(), bins=experts, min=0, max=experts - 1)
    offsets = counts.cumsum(0).to(torch.int32)
    token = order // top_k
    gate_up = torch._grouped_mm(hidden[token], w_gate_up.transpose(1, 2), offs=offsets)
    gate, up = gate_up.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(gate) * up, w_down.transpose(1, 2), offs=offsets)
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(hidden).index_add(0, token, y)


def _function(impl: str) -> Callable[..., torch.Tensor]:
    if impl == "llm_speed":
        from llm_speed.moe.fused_moe import fused_moe

        return fused_moe
    if impl == "grouped_mm":
        return grouped_mm_moe
    from llm_speed.moe.reference import fused_moe_reference

    return fused_moe_reference


def _inputs(case: tuple[int, int, int], s: MoeSettings, device: torch.device, grad: bool) -> tuple:
    tokens, experts, top_k = case
    dtype = report.TORCH_DTYPES[s.dtype]
    generator = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    hidden = randn(tokens, s.hidden)
    w_gate_up = randn(experts, 2 * s.intermediate, s.hidden, scale=s.hidden**-0.5)
    w_down = randn(experts, s.hidden, s.intermediate, scale=s.intermediate**-0.5)
    weights, ids = routing(case)
    weights = weights.to(device).requires_grad_(grad)
    return hidden, w_gate_up, w_down, weights, ids.to(device=device, dtype=torch.int32)


def routing(case: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's routing on the CPU, (weights, ids) [tokens, top_k]: the top-k of a softmax over random
    logits, renormalized. Drawn from a generator of its own, so the cost can count the experts it hits
    without drawing the weights."""
    tokens, experts, top_k = case
    logits = torch.randn(tokens, experts, generator=torch.Generator(device="cpu").manual_seed(1))
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def experts_hit(case: tuple[int, int, int]) -> int:
    """How many experts the case's routing (:func:`routing`) sends at least one token to."""
    return int(routing(case)[1].unique().numel())


def memory_floor(case: tuple[int, int, int], s: MoeSettings) -> int:
    """Bytes a case holds at least: the tokens, both expert weights and the output (with their gradients and
    the output's in fwd+bwd), and the float32 draw the larger weight is made from."""
    tokens, experts, _ = case
    activations = 2 * tokens * s.hidden  # hidden, out
    weights = 3 * experts * s.intermediate * s.hidden  # w_gate_up, w_down
    elements = (activations + weights) * (2 if s.mode == "fwd+bwd" else 1)
    if s.mode == "fwd+bwd":
        elements += tokens * s.hidden  # dout
    return elements * report.TORCH_DTYPES[s.dtype].itemsize + 4 * 2 * experts * s.intermediate * s.hidden


def memory_needs(settings: MoeSettings) -> list[int]:
    """:func:`memory_floor` of every case the run makes."""
    return [memory_floor(case, settings) for case in settings.cases()]


def case_cost(case: tuple[int, int, int], s: MoeSettings) -> tuple[float, float]:
    """(FLOPs, bytes) of the op table's ``fused_moe`` (+ ``fused_moe_backward`` in fwd+bwd) rows, read off
    meta tensors of the case's shapes, with the experts the case's routing hits (:func:`experts_hit`) in the
    weights each call reads: the op table reads no ids and counts the expected number
    (:func:`llm_speed.perf.kernel_costs.expected_experts_hit`), a fraction; this run's routing is known."""
    from llm_speed.perf.kernel_costs import expected_experts_hit

    tokens, experts, top_k = case
    dtype = report.TORCH_DTYPES[s.dtype]
    meta = dict(
        hidden=torch.empty(tokens, s.hidden, dtype=dtype, device="meta"),
        w_gate_up=torch.empty(experts, 2 * s.intermediate, s.hidden, dtype=dtype, device="meta"),
        w_down=torch.empty(experts, s.hidden, s.intermediate, dtype=dtype, device="meta"),
        topk_ids=torch.empty(tokens, top_k, dtype=torch.int32, device="meta"),
    )
    names = ("fused_moe", "fused_moe_backward") if s.mode == "fwd+bwd" else ("fused_moe",)
    works = [ops.get(name).work(**meta) for name in names]
    # each call reads the gate/up and down weights [3 I H] of the experts hit once
    expert_bytes = 3 * s.intermediate * s.hidden * dtype.itemsize
    hit_minus_expected = experts_hit(case) - expected_experts_hit(experts, top_k, tokens)
    moved = sum(w.bytes_moved for w in works) + len(works) * hit_minus_expected * expert_bytes
    return sum(w.flops for w in works), float(round(moved))  # whole bytes: the fraction was the expectation's


def _builder(impl: str, case, s: MoeSettings, device: torch.device) -> Callable[[], Callable[[], Any]]:
    def build() -> Callable[[], Any]:
        fn = _function(impl)
        grad = s.mode == "fwd+bwd"
        inputs = _inputs(case, s, device, grad)
        if not grad:

            def forward():
                with torch.no_grad():
                    return fn(*inputs)

            return forward
        dout = torch.randn(case[0], s.hidden, device=device, dtype=inputs[0].dtype)

        def step():
            out = fn(*inputs)
            out.backward(dout)
            return out

        return step

    return build


def case_label(row: MoeMeasurement) -> str:
    return f"T={row.tokens} E={row.experts} k={row.top_k}"


def run_moe(
    settings: MoeSettings,
    *,
    show_progress: bool = True,
    on_case: Callable[[list[MoeMeasurement]], None] | None = None,
) -> list[MoeMeasurement]:
    """Measure every implementation on every case; ``on_case(rows_so_far)`` after each row."""
    check_settings(settings)
    device = torch.device(settings.device)
    gpu, reason = report.prediction_gpu(device)
    available = report.cpu_memory(device)  # a case that cannot fit there is not run
    rows: list[MoeMeasurement] = []
    cases = settings.cases()
    progress = report.progress(len(cases) * len(settings.impls), "moe") if show_progress else None
    with progress if progress is not None else contextlib.nullcontext(None) as advance:
        for case in cases:
            flops, moved = case_cost(case, settings)
            tokens, experts, top_k = case
            hit = experts_hit(case)
            for impl in settings.impls:
                row = MoeMeasurement(
                    case=f"T={tokens} E={experts} k={top_k}", impl=impl, dtype=settings.dtype,
                    available=False, flops=flops, bytes_moved=moved, tokens=tokens, experts=experts,
                    top_k=top_k, experts_hit=hit,
                )  # fmt: skip
                shortfall = report.memory_shortfall(memory_floor(case, settings), available)
                if shortfall:
                    row.reason = shortfall
                else:
                    report.run_measurement(
                        row, _builder(impl, case, settings, device), device=device, warmup=settings.warmup,
                        iterations=settings.iterations, min_time_s=settings.min_time_s,
                    )  # fmt: skip
                rows.append(row)
                report.add_comparisons(rows, gpu, settings.dtype, reason, predictor(settings, gpu))
                if on_case is not None:
                    on_case(rows)
                if advance is not None:
                    advance(f"{row.case} {impl}")
    return rows


# bench moe's implementation names in llm_speed.perf.predict (HF's per-expert loop is not modelled).
PREDICTED_AS = {"llm_speed": "llm-speed", "grouped_mm": "cublas"}


def predictor(settings: MoeSettings, gpu) -> Callable[[MoeMeasurement], Any] | None:
    """Row -> the calibrated prediction of its fused MoE call (forward, or forward + backward added)."""
    if gpu is None:
        return None
    from dataclasses import replace

    from llm_speed.perf.predict import predict

    names = ("fused_moe", "fused_moe_backward") if settings.mode == "fwd+bwd" else ("fused_moe",)

    def predict_row(row: MoeMeasurement):
        if row.impl not in PREDICTED_AS:
            return None
        predictions = [
            predict(
                name,
                report.prediction_gpu_id(gpu),
                implementation=PREDICTED_AS[row.impl],
                dtype=settings.dtype,
                tokens=row.tokens,
                hidden=settings.hidden,
                intermediate=settings.intermediate,
                experts=row.experts,
                top_k=row.top_k,
            )  # fmt: skip
            for name in names
        ]
        longest = max(predictions, key=lambda p: p.seconds)
        return replace(longest, seconds=sum(p.seconds for p in predictions),
                       calibrated=all(p.calibrated for p in predictions))  # fmt: skip

    return predict_row


def results_payload(settings: MoeSettings, rows: Sequence[MoeMeasurement]) -> dict[str, Any]:
    """The JSON document: provenance, settings, notes and every row."""
    return report.results_document("moe", settings, rows, case_label, TRITON_IMPLS)


def print_moe(settings: MoeSettings, rows: Sequence[MoeMeasurement], console: Console) -> None:
    """One table of the rows that ran, then what did not run and the notes."""
    device = torch.device(settings.device)
    caption = (
        f"{settings.mode}, hidden {settings.hidden}, expert width {settings.intermediate}, "
        f"dtype={report.TORCH_DTYPES[settings.dtype]}, device={report.environment_device_name(device)}"
    )
    table = [[row.case, row.impl, *report.common_cells(row)] for row in rows if row.available]
    report.print_rows("MoE experts", ["case", "impl", *report.COMMON_COLUMNS], table, caption=caption,
                      console=console)  # fmt: skip
    report.print_unavailable(rows, console)
    for note in report.timing_notes(device, TRITON_IMPLS, rows):
        console.print(f"note: {note}", highlight=False, markup=False)
    if rows and rows[0].prediction_reason:
        console.print(f"note: {rows[0].prediction_reason}", highlight=False, markup=False)
