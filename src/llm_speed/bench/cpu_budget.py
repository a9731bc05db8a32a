"""Benchmarks on a CPU: scale problems that would take minutes per call, and estimate the run time first.

GPU-sized problems on a CPU take hours: Triton's interpreter runs a kernel at roughly 0.02-0.1 GFLOP/s, so
``bench attention --seq-lengths 4096 --head-dim 128 --mode fwd+bwd`` would run for more than an hour. How
fast each implementation runs here is measured, not assumed (an assumed 10 GFLOP/s for PyTorch's GEMM
estimated "about 62 s" for a run that took 15 s): :func:`calibrate_attention` and :func:`calibrate_gemm` time
one call of every implementation at two small sizes of the problem asked for, and fit a fixed cost plus a
cost per FLOP (:class:`CallCost`; for attention a cost per batch x head in place of the fixed cost, the
interpreter's cost per program). On a CPU the commands then halve the largest dimension until one call of
the slowest implementation takes about :data:`CALL_SECONDS`, print what they changed, and print the
estimated run time before starting. ``--full-size`` keeps the sizes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping

from llm_speed.bench.attention import COST_CLASS, SCORE_DTYPES, AttentionSettings
from llm_speed.bench.gemm import GemmCase, GemmSettings
from llm_speed.bench.options import MAX_ITERATIONS

# One call of the slowest implementation should take about this long.
CALL_SECONDS = 1.0
# The smallest size a dimension is scaled to (tl.dot's smallest tile side).
MIN_SIZE = 16
# The calibration calls: the problem asked for at these sizes (or its own, when smaller) and at half of them;
# large enough to span several of the interpreter's tiles, small enough to take well under a second.
CALIBRATION_SEQ = 128
CALIBRATION_GEMM_SIDE = 128


@dataclasses.dataclass(frozen=True)
class CallCost:
    """Seconds one call of an implementation takes on this CPU: ``fixed_s + flops * seconds_per_flop +
    heads * per_head_s`` (``heads``: attention's batch x query heads, :func:`fit_attention_cost`)."""

    fixed_s: float
    seconds_per_flop: float
    per_head_s: float = 0.0

    def seconds(self, flops: float, heads: float = 0.0) -> float:
        return self.fixed_s + flops * self.seconds_per_flop + heads * self.per_head_s


def fit_cost(points: list[tuple[float, float]]) -> CallCost:
    """The cost line through measured (flops, seconds) calls: through the two largest, its time per FLOP at
    least half the largest call's time over its FLOPs (noise on the smaller call must not make the line so
    flat that a large problem looks cheap: that error would cost hours, the other way only a smaller
    problem); through the origin and the only call when there is one."""
    ordered = sorted(points)
    f_large, t_large = ordered[-1]
    through_origin = t_large / f_large
    if len(ordered) > 1:
        f_small, t_small = ordered[-2]
        if f_large > f_small:
            per_flop = max((t_large - t_small) / (f_large - f_small), through_origin / 2)
            return CallCost(fixed_s=max(0.0, t_large - per_flop * f_large), seconds_per_flop=per_flop)
    return CallCost(fixed_s=0.0, seconds_per_flop=through_origin)


def fit_attention_cost(points: list[tuple[float, float, float]]) -> CallCost:
    """The cost through measured attention calls ``[(heads, flops, seconds)]`` (``heads``: batch x query
    heads) at two problems whose FLOPs are not proportional to their heads: a cost per head and a cost per
    FLOP, no fixed cost. Triton's interpreter runs every (batch, head)'s programs one after another at a cost
    per program that outweighs the FLOPs at the lengths a CPU runs (2 cores, fwd+bwd at head_dim 128: 32
    heads at seq 32 took 3.8 s a call, 4 heads at seq 128 0.7 s): a cost per FLOP alone, fitted at one
    head group, put the 32 heads at 0.4 s. Each cost is the line's through the two calls, the cost per
    FLOP at least :func:`fit_cost`'s floor (half the call with the most FLOPs per head over its FLOPs: noise
    must not make a long problem look cheap) and the cost per head at least 0."""
    if len(points) > 1:
        (h1, f1, t1), (h2, f2, t2) = sorted(points, key=lambda p: p[1] / p[0])[:: len(points) - 1]
        determinant = h1 * f2 - h2 * f1
        if determinant > 0:
            per_flop = (h1 * t2 - h2 * t1) / determinant
            per_head = (t1 * f2 - t2 * f1) / determinant
            per_flop, per_head = max(per_flop, t2 / f2 / 2), max(0.0, per_head)
            return CallCost(fixed_s=0.0, seconds_per_flop=per_flop, per_head_s=per_head)
    # one call, or calls of one problem: the FLOPs carry it all (as fit_cost through the origin)
    return CallCost(fixed_s=0.0, seconds_per_flop=max(t / f for _, f, t in points))


def merged_note(what: str, asked, scaled) -> list[str]:
    """A note when two or more sizes asked for (``asked``, in order) scale to one size (``scaled``, the same
    order): that size is measured once, so the results hold fewer cases than were asked for."""
    sources: dict[str, list[str]] = {}
    for old, new in zip(asked, scaled, strict=True):
        found = sources.setdefault(str(new), [])
        if str(old) not in found:
            found.append(str(old))
    merged = [f"{', '.join(olds[:-1])} and {olds[-1]} -> {new}"
              for new, olds in sources.items() if len(olds) > 1]  # fmt: skip
    if not merged:
        return []
    return [f"CPU run: {what} merged ({'; '.join(merged)}): scaled to the same size, each is measured once"]


# Implementation -> its measured cost per call.
Costs = Mapping[str, CallCost]


def _calibrated(rows, work: Callable[[object], float]) -> dict[str, CallCost]:
    """Per implementation that ran, the cost line through its rows' medians (``work(row)``: its FLOPs)."""
    points: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        if row.median_ms is not None:
            points.setdefault(row.impl, []).append((work(row), row.median_ms * 1e-3))
    return {impl: fit_cost(found) for impl, found in points.items()}


# One timed call per size and implementation (the availability check is the warm-up).
_CALIBRATION_RUNS = {"warmup": 0, "iterations": 1, "min_time_s": 0.0}


def calibrate_attention(settings: AttentionSettings, run: Callable | None = None) -> dict[str, CallCost]:
    """Each implementation's cost per call here (:func:`fit_attention_cost`), from one timed call at
    :data:`CALIBRATION_SEQ` (or the longest length asked for, when shorter) with batch 1, and one at half of
    it with batch 2, both with one key/value head (its query heads, head_dim, dtype, mode and mask as
    asked): two head counts, so the cost per head is measured too. ``run``: the benchmark (default:
    run_attention)."""
    from llm_speed.bench.attention import run_attention

    longest = min(max(settings.seq_lengths), CALIBRATION_SEQ)
    group = dataclasses.replace(
        settings, num_heads=settings.num_heads // settings.num_kv_heads, num_kv_heads=1, **_CALIBRATION_RUNS
    )
    calls = (dataclasses.replace(group, seq_lengths=(longest,), batch_size=1),
             dataclasses.replace(group, seq_lengths=(max(1, longest // 2),), batch_size=2))  # fmt: skip
    points: dict[str, list[tuple[float, float, float]]] = {}
    for small in calls:
        for row in (run or run_attention)(small, show_progress=False):
            if row.median_ms is not None:
                work = _attention_work(small, row.seq_len)
                points.setdefault(row.impl, []).append((*work, row.median_ms * 1e-3))
    return {impl: fit_attention_cost(found) for impl, found in points.items()}


def calibrate_gemm(settings: GemmSettings, run: Callable | None = None) -> dict[str, CallCost]:
    """Each implementation's cost per call here, from one timed call of the largest case asked for with each
    side cut to :data:`CALIBRATION_GEMM_SIDE`, and of half of that. ``run``: the benchmark (default:
    run_gemm)."""
    from llm_speed.bench.gemm import run_gemm

    largest = max(settings.cases, key=lambda case: case.m * case.n * case.k)
    sides = [min(side, CALIBRATION_GEMM_SIDE) for side in (largest.m, largest.n, largest.k)]
    cases = tuple(dict.fromkeys(
        GemmCase("", *(max(1, side // divisor) for side in sides)) for divisor in (2, 1)
    ))  # fmt: skip
    small = dataclasses.replace(settings, cases=cases, model=None, tokens=None, **_CALIBRATION_RUNS)
    rows = (run or run_gemm)(small, show_progress=False)
    return _calibrated(rows, lambda row: 2.0 * row.m * row.n * row.k)


def slowest_seconds(costs: Costs, flops: float) -> float:
    """One call's time of the slowest implementation (0 when none ran in the calibration)."""
    return max((cost.seconds(flops) for cost in costs.values()), default=0.0)


def rates_text(costs: Costs, flops: float, heads: float = 0.0) -> str:
    """``flash 0.05, torch 90 GFLOP/s``: each implementation's measured rate at ``flops`` per call (of
    ``heads`` attention heads)."""
    rates = [f"{impl} {flops / cost.seconds(flops, heads) / 1e9:.2g}" for impl, cost in costs.items()
             if cost.seconds(flops, heads) > 0]  # fmt: skip
    return f"{', '.join(rates)} GFLOP/s" if rates else "no implementation ran"


def _halved(size: int) -> int:
    """Half of ``size``, rounded down to a multiple of 16, at least :data:`MIN_SIZE`."""
    return max(MIN_SIZE, size // 2 // MIN_SIZE * MIN_SIZE)


def row_seconds(call: float, settings) -> float:
    """One row's time at ``call`` seconds a call: the availability call, the warm-up and the timed runs (at
    least ``min_time_s`` where the benchmark has one, at most :data:`MAX_ITERATIONS` of them)."""
    timed = max(settings.iterations * call, getattr(settings, "min_time_s", 0.0))
    return (1 + settings.warmup) * call + min(timed, MAX_ITERATIONS * call)


def estimate_seconds(call_flops: list[float], costs: Costs, settings) -> float:
    """Estimated run time: :func:`row_seconds` per case and implementation, at each implementation's
    measured cost."""
    return sum(row_seconds(cost.seconds(flops), settings) for flops in call_flops for cost in costs.values())


def _attention_flops(settings: AttentionSettings, seq_len: int) -> float:
    from llm_speed.perf.kernel_costs import attention_cost

    return max(
        attention_cost(
            settings.batch_size, settings.num_heads, seq_len, seq_len, settings.head_dim,
            heads_kv=settings.num_kv_heads, dtype=settings.dtype, causal=settings.causal, mode=settings.mode,
            impl=COST_CLASS[impl], score_dtype=SCORE_DTYPES.get(impl),
        ).flops
        for impl in settings.impls
    )  # fmt: skip


def _attention_work(settings: AttentionSettings, seq_len: int) -> tuple[float, float]:
    """(batch x query heads, FLOPs) of one call at ``seq_len``: what its time here grows with."""
    return settings.batch_size * settings.num_heads, _attention_flops(settings, seq_len)


def _attention_slowest(costs: Costs, settings: AttentionSettings, seq_len: int) -> float:
    heads, flops = _attention_work(settings, seq_len)
    return max((cost.seconds(flops, heads) for cost in costs.values()), default=0.0)


def _too_slow(costs: Costs, flops: float) -> bool:
    return slowest_seconds(costs, flops) > CALL_SECONDS


def scale_attention(settings: AttentionSettings, costs: Costs) -> tuple[AttentionSettings, list[str]]:
    """Sequence lengths halved until one call of the slowest implementation (``costs``, measured with
    :func:`calibrate_attention`) takes about :data:`CALL_SECONDS` (then the heads, when the shortest length
    is not enough); the notes say what changed."""
    scaled = []
    for seq_len in settings.seq_lengths:
        new = seq_len
        while new > MIN_SIZE and _attention_slowest(costs, settings, new) > CALL_SECONDS:
            new = _halved(new)
        scaled.append(new)
    notes = []
    if scaled != list(settings.seq_lengths):
        changes = ", ".join(
            f"{old} -> {new}" for old, new in zip(settings.seq_lengths, scaled, strict=True) if old != new
        )
        rates = rates_text(costs, *reversed(_attention_work(settings, max(scaled))))
        notes.append(
            f"CPU run: sequence lengths scaled ({changes}) so one call takes about {CALL_SECONDS:g} s here "
            f"(measured at seq {max(scaled)}: {rates}); --full-size keeps them"
        )
        notes += merged_note("sequence lengths", settings.seq_lengths, scaled)
    scaled_settings = dataclasses.replace(settings, seq_lengths=tuple(dict.fromkeys(scaled)))
    # Still too big at the shortest length: halve the heads, keeping the query heads per K/V head.
    while _attention_slowest(costs, scaled_settings, max(scaled)) > CALL_SECONDS:
        kv_heads = max(1, scaled_settings.num_kv_heads // 2)
        heads = max(kv_heads, scaled_settings.num_heads // 2 // kv_heads * kv_heads)
        if (heads, kv_heads) == (scaled_settings.num_heads, scaled_settings.num_kv_heads):
            break  # one head of each: nothing left to halve
        scaled_settings = dataclasses.replace(scaled_settings, num_heads=heads, num_kv_heads=kv_heads)
    heads, kv_heads = scaled_settings.num_heads, scaled_settings.num_kv_heads
    if (heads, kv_heads) != (settings.num_heads, settings.num_kv_heads):
        notes.append(
            f"CPU run: heads scaled ({settings.num_heads}/{settings.num_kv_heads} -> {heads}/{kv_heads} "
            "query/key-value heads) as well; --full-size keeps them"
        )
    return scaled_settings, notes


def _scale_gemm_case(case: GemmCase, costs: Costs) -> GemmCase:
    m, n, k = case.m, case.n, case.k
    while _too_slow(costs, 2.0 * m * n * k) and max(m, n, k) > MIN_SIZE:
        largest = max(m, n, k)
        if m == largest:
            m = _halved(m)
        elif n == largest:
            n = _halved(n)
        else:
            k = _halved(k)
    return dataclasses.replace(case, m=m, n=n, k=k)


def scale_gemm(settings: GemmSettings, costs: Costs) -> tuple[GemmSettings, list[str]]:
    """GEMM sizes whose largest dimension is halved until one call of the slowest implementation (``costs``,
    measured with :func:`calibrate_gemm`) takes about :data:`CALL_SECONDS`; notes say so."""
    cases = tuple(_scale_gemm_case(case, costs) for case in settings.cases)
    notes = []
    changed = [(old, new) for old, new in zip(settings.cases, cases, strict=True) if old != new]
    if changed:
        changes = ", ".join(
            f"{old.name + ' ' if old.name else ''}{old.m}x{old.n}x{old.k} -> {new.m}x{new.n}x{new.k}"
            for old, new in changed
        )
        largest = max(2.0 * case.m * case.n * case.k for case in cases)
        notes.append(
            f"CPU run: GEMM sizes scaled ({changes}) so one call takes about {CALL_SECONDS:g} s here "
            f"(measured: {rates_text(costs, largest)}); --full-size keeps them"
        )
        notes += merged_note("GEMM sizes", [_case_text(case) for case in settings.cases],
                             [_case_text(case) for case in cases])  # fmt: skip
    # Two sizes scaled to the same one are measured once.
    return dataclasses.replace(settings, cases=tuple(dict.fromkeys(cases))), notes


def _case_text(case: GemmCase) -> str:
    """``qkv 512x384x512``: a case as the notes name it (two named cases are never one size)."""
    return f"{case.name + ' ' if case.name else ''}{case.m}x{case.n}x{case.k}"


def attention_estimate(settings: AttentionSettings, costs: Costs) -> float:
    """Estimated seconds for an attention benchmark on this CPU at the measured ``costs``."""
    works = [_attention_work(settings, seq_len) for seq_len in settings.seq_lengths]
    return sum(row_seconds(cost.seconds(flops, heads), settings)
               for heads, flops in works for cost in costs.values())  # fmt: skip


def gemm_estimate(settings: GemmSettings, costs: Costs) -> float:
    """Estimated seconds for a GEMM benchmark on this CPU at the measured ``costs``."""
    flops = [2.0 * case.m * case.n * case.k for case in settings.cases]
    return estimate_seconds(flops, costs, settings)


def duration_text(seconds: float) -> str:
    """``45 s``, ``12 min``, ``3.2 h``."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if math.isfinite(seconds) else "forever"


# --- bench ops ---------------------------------------------------------------------------------------------

# The calibration calls of ``bench ops``: each size cut to this (the tokens also at half of it). The widths
# stay near a model's, so that the cost per byte is measured where the kernels' blocks are as wide as the
# runs' (a 128-wide row costs the interpreter mostly its per-program overhead); about 0.1 s per call there.
CALIBRATION_OPS = {
    "tokens": 16, "hidden": 2048, "intermediate": 4096, "num_heads": 4, "num_kv_heads": 2, "head_dim": 128,
    "vocab": 1024,
}  # fmt: skip
# What is halved of each op once the tokens are down to MIN_SIZE and one call is still too slow: the first
# group with a size left to halve, its largest size first (the heads before the head dimension).
OPS_WIDTHS = {
    "rms_norm": (("hidden",),),
    "swiglu": (("intermediate",),),
    "rotary": (("num_heads", "num_kv_heads"), ("head_dim",)),
    "linear_cross_entropy": (("vocab", "hidden"),),
}
HEAD_FIELDS = ("num_heads", "num_kv_heads")
# bench ops' costs: op -> implementation -> its measured cost per unit of ops_work.
OpsCosts = Mapping[str, Costs]


def ops_work(op: str, settings) -> float:
    """The measure a call of ``op`` is costed by: FLOPs for the linear cross-entropy (its matmuls), bytes
    for the memory-bound rest (both the op table's forward + backward figures)."""
    from llm_speed.bench.ops import op_cost

    flops, moved = op_cost(op, settings)
    return flops if op == "linear_cross_entropy" else moved


def calibrate_ops(settings, run: Callable | None = None) -> dict[str, dict[str, CallCost]]:
    """Each op's and implementation's cost per call here, from one timed call with every size cut to
    :data:`CALIBRATION_OPS` and one at half the tokens. ``run``: the benchmark (default: run_ops)."""
    from llm_speed.bench.ops import run_ops

    capped = {name: min(getattr(settings, name), cap) for name, cap in CALIBRATION_OPS.items()}
    points: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for tokens in dict.fromkeys((max(1, capped["tokens"] // 2), capped["tokens"])):
        small = dataclasses.replace(settings, **{**capped, "tokens": tokens}, **_CALIBRATION_RUNS)
        for row in (run or run_ops)(small, show_progress=False):
            if row.median_ms is not None:
                found = points.setdefault(row.op, {}).setdefault(row.impl, [])
                found.append((ops_work(row.op, small), row.median_ms * 1e-3))
    return {op: {impl: fit_cost(found) for impl, found in impls.items()} for op, impls in points.items()}


def _halvable(name: str, value: int) -> bool:
    return value > 1 if name in HEAD_FIELDS else value > MIN_SIZE


def _halved_field(name: str, value: int) -> int:
    return max(1, value // 2) if name in HEAD_FIELDS else _halved(value)


def _width_to_halve(op: str, settings) -> str | None:
    """The size of ``op`` halved next (:data:`OPS_WIDTHS`), None when each is at its smallest."""
    for names in OPS_WIDTHS[op]:
        left = [name for name in names if _halvable(name, getattr(settings, name))]
        if left:
            # ties: the key heads first, so the query heads never fall below them
            return max(left, key=lambda name: (getattr(settings, name), name == "num_kv_heads"))
    return None


def scale_ops(settings, costs: OpsCosts) -> tuple[object, list[str]]:
    """``bench ops`` sizes scaled until the part of a call that grows with them takes about
    :data:`CALL_SECONDS` for each op's slowest implementation (``costs``, measured with
    :func:`calibrate_ops`): the tokens halved first (every op has them), then each op's own widths
    (:data:`OPS_WIDTHS`); the note says what changed."""

    def too_slow(op: str, current) -> bool:
        # the part of a call that shrinks with the sizes (torch.compile's fixed cost here is about a second)
        work = ops_work(op, current)
        return any(cost.seconds_per_flop * work > CALL_SECONDS for cost in costs.get(op, {}).values())

    scaled = settings
    while scaled.tokens > MIN_SIZE and any(too_slow(op, scaled) for op in scaled.ops):
        scaled = dataclasses.replace(scaled, tokens=_halved(scaled.tokens))
    for op in scaled.ops:
        while too_slow(op, scaled) and (name := _width_to_halve(op, scaled)) is not None:
            scaled = dataclasses.replace(scaled, **{name: _halved_field(name, getattr(scaled, name))})
    widths = dict.fromkeys(name for groups in OPS_WIDTHS.values() for names in groups for name in names)
    fields = ("tokens", *widths)
    changes = [f"{name} {getattr(settings, name)} -> {getattr(scaled, name)}" for name in fields
               if getattr(settings, name) != getattr(scaled, name)]  # fmt: skip
    notes = []
    if changes:
        notes.append(
            f"CPU run: sizes scaled ({', '.join(changes)}) so one call of each op takes about "
            f"{CALL_SECONDS:g} s here beyond its fixed cost (both measured by calibration calls); "
            "--full-size keeps them"
        )
    return scaled, notes


def ops_calibrated(settings) -> bool:
    """Whether ``bench ops`` on a CPU calibrates (and may scale) ``settings``: only when a size is larger
    than the calibration call's (:data:`CALIBRATION_OPS`); a problem within them takes a fraction of a
    second per call even in the interpreter, and calibrating it (torch.compile compiles each of its rows,
    seconds apiece) would take longer than the run."""
    return any(getattr(settings, name) > cap for name, cap in CALIBRATION_OPS.items())


def ops_estimate(settings, costs: OpsCosts) -> float:
    """Estimated seconds for a ``bench ops`` run on this CPU at the measured ``costs``."""
    return sum(estimate_seconds([ops_work(op, settings)], costs.get(op, {}), settings) for op in settings.ops)


# --- bench decode ------------------------------------------------------------------------------------------

# The calibration calls of ``bench decode``: batch 1, the longest context asked for cut to this, and half
# of it.
CALIBRATION_CONTEXT = 256


def decode_bytes(settings, batch: int, context: int, impl: str) -> float:
    """The bytes one decode step of ``impl`` reads and writes (:func:`llm_speed.bench.decode.step_cost`, as
    the benchmark's rows carry it): what its time here grows with (the cache)."""
    from llm_speed.bench.decode import step_cost

    return step_cost(settings, batch, context, impl).bytes_moved


def calibrate_decode(settings, run: Callable | None = None) -> dict[str, CallCost]:
    """Each implementation's cost per call here, from one timed step at batch 1 with the longest context
    asked for cut to :data:`CALIBRATION_CONTEXT`, and at half of it (no CUDA-graph replay). ``run``: the
    benchmark (default: run_decode)."""
    from llm_speed.bench.decode import run_decode

    longest = min(max(settings.contexts), CALIBRATION_CONTEXT)
    small = dataclasses.replace(
        settings, batch_sizes=(1,), contexts=tuple(dict.fromkeys((max(1, longest // 2), longest))),
        warmup=0, iterations=1, graph=False,
    )  # fmt: skip
    rows = (run or run_decode)(small, show_progress=False)
    return _calibrated(rows, lambda row: row.bytes_moved)  # decode_bytes of the row's step


def decode_seconds(settings, cost: CallCost, batch: int, context: int, impl: str) -> float:
    """One step's time here: ``batch`` times a sequence's, the interpreter running every sequence's programs
    one after another (calibrated at batch 1: its fixed cost is a sequence's, not only the launch's)."""
    return batch * cost.seconds(decode_bytes(settings, 1, context, impl))


def _decode_slowest(settings, costs: Costs, batch: int, context: int) -> float:
    seconds = (decode_seconds(settings, cost, batch, context, impl) for impl, cost in costs.items())
    return max(seconds, default=0.0)


def _halve_batches(settings, costs: Costs, batches: list[int], context: int, budget: float) -> list[int]:
    halved = []
    for size in batches:
        while size > 1 and _decode_slowest(settings, costs, size, context) > budget:
            size //= 2
        halved.append(size)
    return halved


def scale_decode(settings, costs: Costs) -> tuple[object, list[str]]:
    """Sizes scaled until one step of the slowest implementation (``costs``, measured with
    :func:`calibrate_decode`) takes about :data:`CALL_SECONDS` in every case: first the batch sizes that
    would not fit even at the shortest context (half the budget: the contexts keep the other half), then
    the contexts at the largest batch left, then the batch sizes again; the notes say what changed."""
    shortest = min(MIN_SIZE, *settings.contexts)
    batches = _halve_batches(settings, costs, list(settings.batch_sizes), shortest, CALL_SECONDS / 2)
    contexts = []
    for context in settings.contexts:
        while context > MIN_SIZE and _decode_slowest(settings, costs, max(batches), context) > CALL_SECONDS:
            context = _halved(context)
        contexts.append(context)
    batches = _halve_batches(settings, costs, batches, max(contexts), CALL_SECONDS)
    notes = []
    swept = (("contexts", settings.contexts, contexts), ("batch sizes", settings.batch_sizes, batches))
    for name, old, new in swept:
        if list(old) != new:
            changes = ", ".join(f"{a} -> {b}" for a, b in zip(old, new, strict=True) if a != b)
            notes.append(
                f"CPU run: {name} scaled ({changes}) so one step takes about {CALL_SECONDS:g} s here "
                "(measured by calibration calls); --full-size keeps them"
            )
            notes += merged_note(name, old, new)
    scaled = dataclasses.replace(
        settings, contexts=tuple(dict.fromkeys(contexts)), batch_sizes=tuple(dict.fromkeys(batches))
    )
    return scaled, notes


def decode_estimate(settings, costs: Costs) -> float:
    """Estimated seconds for a decode benchmark on this CPU at the measured ``costs`` (the availability
    call, the warm-up and the timed steps of every case and implementation)."""
    return sum(
        row_seconds(decode_seconds(settings, cost, batch, context, impl), settings)
        for batch in settings.batch_sizes for context in settings.contexts for impl, cost in costs.items()
    )  # fmt: skip


# --- bench moe ---------------------------------------------------------------------------------------------

# The calibration calls of ``bench moe``: tokens, experts, hidden and intermediate cut to these; the tokens
# also at half, the experts also at twice. The interpreter runs the fused layer's programs over every
# expert's weights whatever few tokens reach it (and the Hugging Face loop visits every expert): a cost per
# weight element beside the cost per FLOP.
CALIBRATION_MOE = {"tokens": 32, "experts": 8, "hidden": 256, "intermediate": 256}


@dataclasses.dataclass(frozen=True)
class MoeCost:
    """Seconds one call of an implementation takes here: ``fixed_s + weights * per_weight_s + flops *
    seconds_per_flop`` (``weights``: the experts' weight elements, experts x 3 x hidden x intermediate)."""

    fixed_s: float
    per_weight_s: float
    seconds_per_flop: float

    def seconds(self, weights: float, flops: float) -> float:
        return self.fixed_s + self.per_weight_s * weights + self.seconds_per_flop * flops


def moe_work(settings, case: tuple[int, int, int]) -> tuple[float, float]:
    """(weight elements, FLOPs) of a case: what its time here grows with."""
    from llm_speed.bench.moe import case_cost

    return 3.0 * case[1] * settings.hidden * settings.intermediate, case_cost(case, settings)[0]


def fit_moe_cost(points: list[tuple[float, float, float]]) -> MoeCost:
    """The cost through measured calls ``[(weights, flops, seconds)]``: the cost per weight element from the
    calls with the most FLOPs at two weight counts (none when only one count ran), then the cost per FLOP
    and the fixed cost through the calls with the fewest weights, less their weights' cost
    (:func:`fit_cost`, with its floor against noise)."""
    fewest = min(w for w, _, _ in points)
    same = sorted((f, t) for w, f, t in points if w == fewest)
    (f_first, t_first), (f_last, t_last) = same[0], same[-1]
    slope = max(0.0, (t_last - t_first) / (f_last - f_first)) if f_last > f_first else 0.0
    most = max(f for _, f, _ in points)
    by_weights = sorted((w, f, t) for w, f, t in points if f == most)
    per_weight = 0.0
    if len(by_weights) > 1:
        (w_small, f_small, t_small), (w_large, f_large, t_large) = by_weights[0], by_weights[-1]
        per_weight = max(0.0, (t_large - t_small - slope * (f_large - f_small)) / (w_large - w_small))
    line = fit_cost([(f, max(0.0, t - per_weight * fewest)) for f, t in same])
    return MoeCost(fixed_s=line.fixed_s, per_weight_s=per_weight, seconds_per_flop=line.seconds_per_flop)


def calibrate_moe(settings, run: Callable | None = None) -> dict[str, MoeCost]:
    """Each implementation's cost per call here (:class:`MoeCost`), from one timed call at the sizes cut to
    :data:`CALIBRATION_MOE`, one at half the tokens and one at twice the experts (when more were asked for),
    with the largest top_k that fits. ``run``: the benchmark (default: run_moe)."""
    from llm_speed.bench.moe import run_moe

    caps = CALIBRATION_MOE
    tokens = min(max(settings.tokens), caps["tokens"])
    experts = min(max(settings.experts), caps["experts"])
    more = min(max(settings.experts), 2 * caps["experts"])
    base = dataclasses.replace(
        settings, hidden=min(settings.hidden, caps["hidden"]),
        intermediate=min(settings.intermediate, caps["intermediate"]),
        top_k=(min(max(settings.top_k), experts),), **_CALIBRATION_RUNS,
    )  # fmt: skip
    calls = [dataclasses.replace(base, tokens=tuple(dict.fromkeys((max(1, tokens // 2), tokens))),
                                 experts=(experts,))]  # fmt: skip
    if more > experts:
        calls.append(dataclasses.replace(base, tokens=(tokens,), experts=(more,)))
    points: dict[str, list[tuple[float, float, float]]] = {}
    for small in calls:
        for row in (run or run_moe)(small, show_progress=False):
            if row.median_ms is not None:
                weights, flops = moe_work(small, (row.tokens, row.experts, row.top_k))
                points.setdefault(row.impl, []).append((weights, flops, row.median_ms * 1e-3))
    return {impl: fit_moe_cost(found) for impl, found in points.items()}


def _moe_too_slow(settings, costs: Mapping[str, MoeCost]) -> bool:
    for case in settings.cases():
        weights, flops = moe_work(settings, case)
        if any(cost.seconds(weights, flops) > CALL_SECONDS for cost in costs.values()):
            return True
    return False


def scale_moe(settings, costs: Mapping[str, MoeCost]) -> tuple[object, list[str]]:
    """``bench moe`` sizes scaled until one call of the slowest implementation (``costs``, measured with
    :func:`calibrate_moe`) takes about :data:`CALL_SECONDS` in every case: the token counts first (to 16),
    then the larger of hidden and intermediate (to the calibration's widths), then the expert counts (never
    below the largest top_k, so every top_k keeps its cases); the note says what changed."""
    scaled, tokens = settings, []
    for count in settings.tokens:
        while count > MIN_SIZE and _moe_too_slow(dataclasses.replace(settings, tokens=(count,)), costs):
            count = _halved(count)
        tokens.append(count)
    scaled = dataclasses.replace(scaled, tokens=tuple(dict.fromkeys(tokens)))
    # The widths no narrower than the calibration's: below it a call's cost per expert no longer shrinks
    # with them (the programs' fixed share), so the model would promise what halving cannot give.
    floor = {name: CALIBRATION_MOE[name] for name in ("hidden", "intermediate")}
    while _moe_too_slow(scaled, costs):
        wide = [name for name in floor if getattr(scaled, name) // 2 >= floor[name]]
        if not wide:
            break
        name = max(wide, key=lambda name: getattr(scaled, name))
        scaled = dataclasses.replace(scaled, **{name: getattr(scaled, name) // 2})
    least = max(settings.top_k)
    experts = list(settings.experts)  # each count asked for, as scaled (the notes say which ones merged)
    while _moe_too_slow(scaled, costs) and max(experts) // 2 >= least:
        experts = [max(least, count // 2) for count in experts]
        scaled = dataclasses.replace(scaled, experts=tuple(dict.fromkeys(experts)))
    changes = [f"{name} {_sizes_text(getattr(settings, name))} -> {_sizes_text(getattr(scaled, name))}"
               for name in ("tokens", "experts", "hidden", "intermediate")
               if getattr(settings, name) != getattr(scaled, name)]  # fmt: skip
    notes = []
    if changes:
        notes.append(
            f"CPU run: sizes scaled ({', '.join(changes)}) so one call takes about {CALL_SECONDS:g} s here "
            "(measured by calibration calls); --full-size keeps them"
        )
        notes += merged_note("token counts", settings.tokens, tokens)
        notes += merged_note("expert counts", settings.experts, experts)
    return scaled, notes


def _sizes_text(value) -> str:
    return "/".join(map(str, value)) if isinstance(value, tuple) else str(value)


def moe_estimate(settings, costs: Mapping[str, MoeCost]) -> float:
    """Estimated seconds for a ``bench moe`` run on this CPU at the measured ``costs``."""
    works = [moe_work(settings, case) for case in settings.cases()]
    return sum(row_seconds(cost.seconds(*work), settings) for work in works for cost in costs.values())
