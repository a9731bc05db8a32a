"""``llm-speed bench overhead``: what one call of every public op costs on a tiny problem, beside PyTorch's
nearest equivalent, in one run.

On a tiny problem a kernel takes a few microseconds; what a caller waits for is the host path: argument
checks, dispatch, allocation, and the launch. Three modes per op:

- ``inference``: a call under ``torch.no_grad()``;
- ``autograd``: a forward call whose inputs require grad (it records the autograd node);
- ``training``: forward and backward (``torch.autograd.backward`` with a ready gradient).

On a GPU each figure is the wall time of many calls divided by their number (one synchronisation at the end),
next to the kernel time per call that ``torch.profiler`` saw. On a CPU the ops run under
:func:`llm_speed.core.launch.simulated_gpu`: the code path of CUDA tensors with every launch a no-op, so the
figure is the host cost of a call on a GPU, minus the driver's launch (about 2-4 us on an H100 host), and CI
can track it. The PyTorch rows on a CPU run for real (their tiny kernels take well under a microsecond more
than their dispatch). Each figure is the fastest of ``--repeats`` runs of ``--calls`` calls.

Targets (the launch-path issue), same run: on a CPU, each op's own per-call cost at most 2.5x SDPA's in
inference (3x for the packed and KV-cache ones), 5x with autograd; on a GPU at most 1.3x PyTorch's equivalent.
flash-attn's interface (``llm_speed.flash_attn_interface``) is measured against llm-speed's own entry point on
the same tensors (``flash_attention`` on the ``transpose(1, 2)`` views of flash-attn's ``[batch, seq, heads,
dim]``, the packed and KV-cache ops as they are): at most 1.1x it, on a CPU and on a GPU (issue 74).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from llm_speed.bench.options import OVERHEAD_MODES as MODES
from llm_speed.bench.options import OVERHEAD_OPS

# The yardstick every op is measured against on a CPU, and the ratio each op family must stay under.
YARDSTICK = "sdpa"
CPU_TARGETS = {"inference": 2.5, "autograd": 5.0}
# flash_attention_varlen, flash_attention_with_kvcache
CPU_TARGETS_PACKED = {"inference": 3.0, "autograd": 5.0}
GPU_TARGET = 1.3  # at most this times PyTorch's equivalent, wall time per call
WRAPPER_TARGET = 1.1  # flash-attn's interface: at most this times llm-speed's entry point, CPU and GPU


@dataclasses.dataclass(frozen=True)
class Case:
    """One public op (or PyTorch's equivalent) on a tiny problem: ``make(device, dtype, requires_grad)``
    returns ``(call, tensors)``; ``call()`` runs it once and returns what a backward starts from."""

    name: str
    baseline: str | None  # the name of PyTorch's equivalent case (None: this is a PyTorch case)
    make: Callable[[torch.device, torch.dtype, bool], Callable[[], Any]]
    differentiable: bool = True
    packed: bool = False  # varlen / KV cache: the 3x target
    # naive_attention is plain PyTorch on purpose (the materialising algorithm the others improve on): its
    # cost is a dozen PyTorch ops, with no launch path of llm-speed's to hold to a target.
    has_target: bool = True
    # one of llm-speed's own calls that a flash-attn wrapper is measured against (it runs as llm-speed's ops
    # do: on a CPU on the simulated GPU path), itself without a baseline
    entry_point: bool = False
    # a flash-attn wrapper (llm_speed.flash_attn_interface): its baseline is llm-speed's entry point
    wrapper: bool = False

    @property
    def ours(self) -> bool:
        return self.baseline is not None or self.entry_point


def _randn(*shape, device, dtype, grad=False):
    return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)


def _qkv(device, dtype, grad):
    return [_randn(1, 2, 16, 16, device=device, dtype=dtype, grad=grad) for _ in range(3)]


def _attention(fn_name: str):
    def make(device, dtype, grad):
        import llm_speed

        fn = getattr(llm_speed, fn_name)
        q, k, v = _qkv(device, dtype, grad)
        return lambda: fn(q, k, v)

    return make


def _sdpa(device, dtype, grad):
    q, k, v = _qkv(device, dtype, grad)
    return lambda: F.scaled_dot_product_attention(q, k, v)


def _packed(device, dtype, grad):
    """Three packed sequences (5, 0 and 11 tokens): q, k, v and their offsets."""
    cu = torch.tensor([0, 5, 5, 16], dtype=torch.int32, device=device)
    return (*(_randn(16, 2, 16, device=device, dtype=dtype, grad=grad) for _ in range(3)), cu)


def _varlen(device, dtype, grad):
    import llm_speed

    q, k, v, cu = _packed(device, dtype, grad)
    return lambda: llm_speed.flash_attention_varlen(q, k, v, cu, cu, 11, 11, is_causal=True)


def _flash_attn_layout(device, dtype, grad):
    """q, k, v in flash-attn's [batch, seq, heads, dim] layout (the tiny problem of ``_qkv``, GQA 2:1)."""
    return [_randn(1, 16, h, 16, device=device, dtype=dtype, grad=grad) for h in (2, 1, 1)]


def _attention_views(device, dtype, grad):
    import llm_speed

    q, k, v = (t.transpose(1, 2) for t in _flash_attn_layout(device, dtype, grad))
    return lambda: llm_speed.flash_attention(q, k, v, is_causal=True)


def _flash_attn_func(device, dtype, grad):
    from llm_speed import flash_attn_interface

    q, k, v = _flash_attn_layout(device, dtype, grad)
    return lambda: flash_attn_interface.flash_attn_func(q, k, v, causal=True)


def _varlen_wrapper(device, dtype, grad):
    from llm_speed import flash_attn_interface

    q, k, v, cu = _packed(device, dtype, grad)
    return lambda: flash_attn_interface.flash_attn_varlen_func(q, k, v, cu, cu, 11, 11, causal=True)


def _sdpa_batch(device, dtype, grad):
    q, k, v = (_randn(3, 2, 11, 16, device=device, dtype=dtype, grad=grad) for _ in range(3))
    return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _decode_step(device, dtype):
    """One decode step over a paged cache: q, the caches, the new k and v, the lengths, the block table."""
    k_cache, v_cache = (torch.randn(8, 16, 2, 32, device=device, dtype=dtype) for _ in range(2))
    block_table = torch.arange(8, dtype=torch.int32, device=device).reshape(2, 4)
    q = torch.randn(2, 1, 4, 32, device=device, dtype=dtype)
    k, v = (torch.randn(2, 1, 2, 32, device=device, dtype=dtype) for _ in range(2))
    seqlens = torch.tensor([40, 25], dtype=torch.int32, device=device)
    return q, k_cache, v_cache, k, v, seqlens, block_table


def _kvcache(device, dtype, grad):
    import llm_speed

    q, k_cache, v_cache, k, v, seqlens, block_table = _decode_step(device, dtype)
    return lambda: llm_speed.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, k=k, v=v, block_table=block_table, is_causal=True
    )


def _kvcache_wrapper(device, dtype, grad):
    from llm_speed import flash_attn_interface

    q, k_cache, v_cache, k, v, seqlens, block_table = _decode_step(device, dtype)
    return lambda: flash_attn_interface.flash_attn_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=seqlens, block_table=block_table, causal=True
    )


def _sdpa_decode(device, dtype, grad):
    q = torch.randn(2, 4, 1, 32, device=device, dtype=dtype)
    k, v = (torch.randn(2, 2, 64, 32, device=device, dtype=dtype) for _ in range(2))
    return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _matrices(device, dtype, grad, size=16):
    return [_randn(size, size, device=device, dtype=dtype, grad=grad) for _ in range(2)]


def _gemm(fn_name: str):
    def make(device, dtype, grad):
        import llm_speed

        fn = getattr(llm_speed, fn_name)
        a, b = _matrices(device, dtype, grad)
        return lambda: fn(a, b)

    return make


def _matmul(device, dtype, grad):
    a, b = _matrices(device, dtype, grad)
    return lambda: torch.matmul(a, b)


def _int8(device, dtype, grad):
    import llm_speed

    a, b = (torch.randint(-128, 128, (32, 32), dtype=torch.int8, device=device) for _ in range(2))
    return lambda: llm_speed.tensor_core_gemm_int8(a, b)


def _int_mm(device, dtype, grad):
    a, b = (torch.randint(-128, 128, (32, 32), dtype=torch.int8, device=device) for _ in range(2))
    return lambda: torch._int_mm(a, b)


def _rms_norm(device, dtype, grad):
    import llm_speed

    x = _randn(4, 64, device=device, dtype=dtype, grad=grad)
    w = _randn(64, device=device, dtype=dtype, grad=grad)
    return lambda: llm_speed.rms_norm(x, w)


def _f_rms_norm(device, dtype, grad):
    x = _randn(4, 64, device=device, dtype=dtype, grad=grad)
    w = _randn(64, device=device, dtype=dtype, grad=grad)
    return lambda: F.rms_norm(x, (64,), w, eps=1e-6)


def _swiglu(device, dtype, grad):
    import llm_speed

    g, u = (_randn(4, 64, device=device, dtype=dtype, grad=grad) for _ in range(2))
    return lambda: llm_speed.swiglu(g, u)


def _eager_swiglu(device, dtype, grad):
    g, u = (_randn(4, 64, device=device, dtype=dtype, grad=grad) for _ in range(2))
    return lambda: F.silu(g) * u


def _angles(device, dtype):
    angles = torch.arange(16, device=device, dtype=torch.float32)[:, None] * torch.rand(8, device=device)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotary(device, dtype, grad):
    import llm_speed

    x = _randn(1, 2, 16, 16, device=device, dtype=dtype, grad=grad)
    cos, sin = _angles(device, dtype)
    return lambda: llm_speed.apply_rotary(x, cos, sin)


def _eager_rotary(device, dtype, grad):
    """Hugging Face's ``apply_rotary_pos_emb`` for one tensor: ``x * cos + rotate_half(x) * sin``."""
    x = _randn(1, 2, 16, 16, device=device, dtype=dtype, grad=grad)
    cos, sin = (torch.cat((t, t), -1) for t in _angles(device, dtype))

    def call():
        x1, x2 = x[..., :8], x[..., 8:]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    return call


def _linear_ce(device, dtype, grad):
    import llm_speed

    h = _randn(8, 16, device=device, dtype=dtype, grad=grad)
    w = _randn(64, 16, device=device, dtype=dtype, grad=grad)
    target = torch.randint(0, 64, (8,), device=device)
    return lambda: llm_speed.fused_linear_cross_entropy(h, w, target)


def _eager_linear_ce(device, dtype, grad):
    h = _randn(8, 16, device=device, dtype=dtype, grad=grad)
    w = _randn(64, 16, device=device, dtype=dtype, grad=grad)
    target = torch.randint(0, 64, (8,), device=device)
    return lambda: F.cross_entropy(F.linear(h, w).float(), target)


CASES: tuple[Case, ...] = (
    Case("sdpa", None, _sdpa),
    Case("flash_attention", "sdpa", _attention("flash_attention")),
    Case("tiled_attention", "sdpa", _attention("tiled_attention")),
    Case("naive_attention", "sdpa", _attention("naive_attention"), has_target=False),
    Case("sdpa (3 sequences)", None, _sdpa_batch),
    Case("flash_attention_varlen", "sdpa (3 sequences)", _varlen, packed=True),
    Case("sdpa (decode)", None, _sdpa_decode, differentiable=False),
    Case("flash_attention_with_kvcache", "sdpa (decode)", _kvcache, differentiable=False, packed=True),
    Case("torch.matmul", None, _matmul),
    Case("gemm", "torch.matmul", _gemm("gemm")),
    Case("torch._int_mm", None, _int_mm, differentiable=False),
    Case("tensor_core_gemm_int8", "torch._int_mm", _int8, differentiable=False),
    Case("F.rms_norm", None, _f_rms_norm),
    Case("rms_norm", "F.rms_norm", _rms_norm),
    Case("silu(gate) * up", None, _eager_swiglu),
    Case("swiglu", "silu(gate) * up", _swiglu),
    Case("rotary (eager)", None, _eager_rotary),
    Case("apply_rotary", "rotary (eager)", _rotary),
    Case("cross_entropy(linear)", None, _eager_linear_ce),
    Case("fused_linear_cross_entropy", "cross_entropy(linear)", _linear_ce),
    Case("flash_attention (views)", None, _attention_views, entry_point=True),
    Case("flash_attn_func", "flash_attention (views)", _flash_attn_func, wrapper=True),
    Case("flash_attn_varlen_func", "flash_attention_varlen", _varlen_wrapper, wrapper=True),
    Case("flash_attn_with_kvcache", "flash_attention_with_kvcache", _kvcache_wrapper, differentiable=False,
         wrapper=True),  # fmt: skip
)
OPS = tuple(case.name for case in CASES if case.baseline is not None)
assert OPS == OVERHEAD_OPS, "bench.options.OVERHEAD_OPS lists the cases with a baseline, in order"


@dataclasses.dataclass
class Row:
    """One case in one mode: microseconds per call (and, on a GPU, kernel microseconds per call)."""

    case: str
    mode: str
    us_per_call: float
    baseline: str | None = None
    baseline_us: float | None = None
    kernel_us: float | None = None
    vs_baseline: float | None = None  # us_per_call / the baseline's
    vs_sdpa: float | None = None  # us_per_call / SDPA's inference us_per_call (CPU yardstick)
    target: float | None = None
    target_of: str | None = None  # what the target is a multiple of: "PyTorch", "SDPA" or the entry point
    meets_target: bool | None = None
    # what compares this row's time with another's (withheld when the machine was busy)
    RATIO_FIELDS: ClassVar[tuple[str, ...]] = ("vs_baseline", "vs_sdpa", "meets_target")


def _runner(call: Callable[[], Any], mode: str) -> Callable[[], Any]:
    if mode == "training":

        def train():
            out = call()
            out = out[0] if isinstance(out, tuple) else out
            torch.autograd.backward(out, torch.ones_like(out) if out.dim() else None)

        return train
    return call


def _time(
    fn: Callable[[], Any], calls: int, repeats: int, device: torch.device, clock: Callable[[], float]
) -> float:
    """Fastest of ``repeats`` runs of ``calls`` calls, in microseconds per call of ``clock`` (GPU:
    synchronised)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(max(3, calls // 10)):
        fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        began = clock()
        for _ in range(calls):
            fn()
        sync()
        best = min(best, (clock() - began) / calls)
    return best * 1e6


def kernel_us(fn: Callable[[], Any], calls: int) -> float:
    """Device time per call of the CUDA kernels ``fn`` runs (``torch.profiler``)."""
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in profile.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sum(e.device_time_total for e in events) / calls


def measure(
    device: torch.device,
    *,
    ops: Sequence[str] = OPS,
    modes: Sequence[str] = ("inference", "autograd"),
    calls: int | None = None,
    repeats: int = 5,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Row]:
    """Every op of ``ops`` and its PyTorch equivalent (and SDPA, the yardstick) in every mode of ``modes``.
    ``clock``: wall time by default; ``time.thread_time`` counts only this thread's CPU time, which other
    processes on a busy machine do not inflate (the CPU regression guard of tests/bench uses it)."""
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise ValueError(f"ops: unknown {', '.join(unknown)}; accepted: {', '.join(OPS)}")
    bad_modes = sorted(set(modes) - set(MODES))
    if bad_modes:
        raise ValueError(f"modes: unknown {', '.join(bad_modes)}; accepted: {', '.join(MODES)}")
    from llm_speed.core import launch

    on_gpu = device.type == "cuda"
    calls = calls or (1000 if on_gpu else 2000)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    by_name = {case.name: case for case in CASES}
    wanted = [by_name[name] for name in ops]
    names = list(dict.fromkeys([YARDSTICK, *(c.baseline for c in wanted), *(c.name for c in wanted)]))
    rows: list[Row] = []
    times: dict[tuple[str, str], float] = {}
    for mode in modes:
        for name in names:
            case = by_name[name]
            if mode != "inference" and not case.differentiable:
                continue
            grad = mode != "inference"
            ours = case.ours
            # Our ops run the CUDA path with the launch stubbed on a CPU; PyTorch's run for real.
            simulated = ours and not on_gpu
            path = launch.simulated_gpu() if simulated else contextlib.nullcontext()
            with path, torch.set_grad_enabled(grad):
                fn = _runner(case.make(device, dtype, grad), mode)
                us = _time(fn, calls if mode != "training" else max(1, calls // 4), repeats, device, clock)
                kernel = kernel_us(fn, min(calls, 100)) if on_gpu else None
            times[(name, mode)] = us
            rows.append(Row(name, mode, us, kernel_us=kernel))
    sdpa = times.get((YARDSTICK, "inference"))
    for row in rows:
        case = by_name[row.case]
        if case.baseline is None:
            continue
        row.baseline = case.baseline
        row.baseline_us = times.get((case.baseline, row.mode))
        if row.baseline_us:
            row.vs_baseline = row.us_per_call / row.baseline_us
        if sdpa:
            row.vs_sdpa = row.us_per_call / sdpa
        if not case.has_target:
            continue
        if case.wrapper:  # flash-attn's interface against llm-speed's entry point, CPU and GPU alike
            row.target, row.target_of = WRAPPER_TARGET, case.baseline
            row.meets_target = None if row.vs_baseline is None else row.vs_baseline <= WRAPPER_TARGET
        elif on_gpu:
            row.target, row.target_of = GPU_TARGET, "PyTorch"
            row.meets_target = None if row.vs_baseline is None else row.vs_baseline <= GPU_TARGET
        else:
            row.target = (CPU_TARGETS_PACKED if case.packed else CPU_TARGETS).get(row.mode)
            row.target_of = None if row.target is None else "SDPA"
            if row.target is not None and row.vs_sdpa is not None:
                row.meets_target = row.vs_sdpa <= row.target
    return rows


def not_run(ops: Sequence[str], modes: Sequence[str]) -> list[dict[str, str]]:
    """Each op asked for in a mode it cannot run in (no gradient: inference only), with the reason:
    :func:`measure` skips those pairs, and the run must say so."""
    by_name = {case.name: case for case in CASES}
    return [
        {"op": name, "mode": mode, "reason": "no gradient: it runs in inference only"}
        for mode in dict.fromkeys(modes)
        for name in dict.fromkeys(ops)
        if mode != "inference" and not by_name[name].differentiable
    ]


def not_run_text(skipped: dict[str, str]) -> str:
    """``tensor_core_gemm_int8 (autograd): no gradient: ...``."""
    return f"{skipped['op']} ({skipped['mode']}): {skipped['reason']}"


def refuse_when_nothing_runs(ops: Sequence[str], modes: Sequence[str]) -> None:
    """ValueError naming --ops and --modes when not one op asked for runs in a mode asked for: the run would
    time only the SDPA yardstick."""
    skipped = not_run(ops, modes)
    if len(skipped) == len(dict.fromkeys(ops)) * len(dict.fromkeys(modes)):
        said = "; ".join(not_run_text(pair) for pair in skipped)
        raise ValueError(f"--ops/--modes: none of the ops asked for runs in the modes asked for ({said})")


def results_payload(rows: Sequence[Row], device: torch.device, settings: dict[str, Any]) -> dict[str, Any]:
    """The run's JSON: provenance, settings, what the figures mean, every row, and each (op, mode) asked for
    that did not run (``not_run``)."""
    from llm_speed.bench.report import environment

    meaning = (
        "wall time per call (synchronised at the end) and CUDA kernel time per call from torch.profiler"
        if device.type == "cuda"
        else "host time per call; llm-speed's ops on the CUDA code path with every launch a no-op "
        "(core.launch.simulated_gpu), PyTorch's ops run for real on the CPU"
    )
    return {
        "benchmark": "overhead",
        "environment": environment(device),
        "settings": settings,
        "notes": [meaning, f"targets: {'GPU' if device.type == 'cuda' else 'CPU'}, llm_speed.bench.overhead"],
        "results": [dataclasses.asdict(row) for row in rows],
        "not_run": not_run(settings["ops"], settings["modes"]),
    }


def print_rows(rows: Sequence[Row], console: Any, *, device: torch.device | None = None) -> None:
    """The table (titled with the device that ran it, when given)."""
    from llm_speed._output import print_table
    from llm_speed.bench.report import environment_device_name

    on_gpu = any(row.kernel_us is not None for row in rows)
    columns = ["op", "mode", "us/call", *(["kernel us/call"] if on_gpu else []), "vs baseline", "vs SDPA",
               "target", "meets"]  # fmt: skip
    table = []
    for row in rows:
        cells = [row.case, row.mode, row.us_per_call, *([row.kernel_us] if on_gpu else [])]
        vs = f"{row.vs_baseline:.2f}x {row.baseline}" if row.vs_baseline is not None else None
        sdpa = f"{row.vs_sdpa:.2f}x" if row.vs_sdpa is not None else None
        target = None if row.target is None else f"<= {row.target}x {row.target_of}"
        table.append([*cells, vs, sdpa, target, row.meets_target])
    title = "per-call cost on a tiny problem" + (f", {environment_device_name(device)}" if device else "")
    print_table(title, columns, table, console=console)
