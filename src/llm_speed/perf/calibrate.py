"""Fit the parameters of :mod:`llm_speed.perf.predict` to measurements, honestly: on part of them, checked
on the rest. The measurements are read by :func:`llm_speed.perf.measurements.load_results`.

``split(points)``: the held-out rule, the same for every implementation so that cuBLAS, SDPA and llm-speed
are checked on the same shapes. Points that differ only in their size (a sequence length, a token count,
a square GEMM's side) or in their tile form a group; sorted by that size, every second one is held out
(the 2nd, 4th, ...). On the 2026-11-22 H100 baseline that holds out the sequence lengths 1k, 4k and 16k of
every attention group, the token counts 16 and 2048 of every model GEMM, the 1024^3 and 4096^3 squares, and
every second tile of the block-size sweeps; of the fp8 GEMMs in NT (their own family, "gemm fp8"),
8192x8192x4096 of each scaling. Points of kinds the parameters do not describe (:func:`kind_of`: int8
kernels, fp8 attention, fp8 GEMMs with b N-major, the eager attention, a forward and its backward under one
timer) are always held out: checked, never fitted.

``fit(points, calibration)``: per (implementation, family) the parameters listed in :data:`FITTED` are
moved (Nelder-Mead on the log of each, minimising the squared log error over the training points); the rest
keep their stated values. ``calibrate(directory)`` does all of it and returns the new calibration data with,
for every fitted entry, the files it came from and the median and worst error on the training and the
held-out points. Pure Python (no NumPy, no torch).
"""

from __future__ import annotations

import copy
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_speed.core.args import positive_int
from llm_speed.perf.measurements import (
    FITTED_KINDS,
    Point,
    kind_of,
    load_results,
)
from llm_speed.perf.predict import (
    FP8_GEMM_SECTION,
    REFERENCE_GPU,
    SDPA_BACKENDS,
    Prediction,
    build_entry,
    load_calibration,
    predict_call,
    same_commit,
)

# What each fit moves, per (family, whose kernel); every other parameter keeps its stated value. llm-speed's
# GEMM latencies are not fitted: at the build measured on the H100 (af147ec) its host path (~218 us per
# call) hid them on every small shape, so its device latency and memory ramp keep cuBLAS's fitted values.
# Tile effects (wgmma rows, spills in loops) are fitted only for llm-speed's kernels, whose tiles vary in
# the sweeps; a vendor kernel's tiles are fixed, so its efficiency is one number.
FITTED: dict[tuple[str, str], tuple[str, ...]] = {
    ("gemm", "vendor"): (
        "eta",
        "tile_half",
        "bandwidth_efficiency",
        "sm_bandwidth",
        "memory_latency_s",
        "latency_s",
        "l2_bytes_per_s",
    ),
    ("gemm", "llm-speed"): ("eta", "tile_half", "bandwidth_efficiency", "l2_bytes_per_s"),
    ("attention", "vendor"): (
        "eta",
        "overlap_single",
        "overlap_multi",
        "alu_per_score",
        "block_s",
        "load_s",
        "program_s",
        "latency_s",
        "memory_overlap",
        "l2_miss",
    ),
    ("attention", "llm-speed"): (
        "eta",
        "n_half",
        "sync",
        "spill_s",
        "atomic_s",
        "overlap_single",
        "overlap_multi",
        "alu_per_score",
        "block_s",
        "load_s",
        "program_s",
        "memory_overlap",
        "l2_miss",
    ),
    # fp8 GEMMs (gemm_fp8, torch._scaled_mm): the tensor cores' fraction of the fp8 peak, and the seconds per
    # K step of block scaling (the product waited for and rescaled); llm-speed's builds before eafec86 also
    # ptxas's serialized per-tensor kernel (prediction.gemm.fp8_step_seconds). Memory and latency terms are
    # the 16-bit GEMM's (the fp8 points are all compute-bound).
    ("gemm fp8", "vendor"): ("eta", "block_step_s"),
    ("gemm fp8", "llm-speed"): ("eta", "block_step_s", "serialized_step_s"),
}
# Parameters an llm-speed fit takes from the vendor's fit on the same GPU (not identifiable from the measured
# build, whose host path hid them; the hardware they describe is the same): (family) -> (vendor, names).
_CUBLAS_HARDWARE = ("cublas", ("latency_s", "memory_latency_s", "sm_bandwidth"))
SHARED: dict[str, tuple[str, tuple[str, ...]]] = {"gemm": _CUBLAS_HARDWARE,
                                                  FP8_GEMM_SECTION: _CUBLAS_HARDWARE}
# Nelder-Mead restarts from the best point so far (the simplex collapses on long valleys).
RESTARTS = 2
# Parameters that are fractions (fitted through a logistic map, kept in (0, 1)).
FRACTIONS = (
    "eta",
    "sync",
    "bandwidth_efficiency",
    "overlap_single",
    "overlap_multi",
    "l2_miss",
    "memory_overlap",
)


# --- the held-out split -------------------------------------------------------------------------------------


def held_out(points: Sequence[Point]) -> list[bool]:
    """For each point, whether it is held out (see the module docstring): within each group, every second
    distinct size in sorted order."""
    sizes: dict[tuple, set] = {}
    for point in points:
        sizes.setdefault(point.group, set()).add(point.size)
    rank = {group: {size: i for i, size in enumerate(sorted(values))} for group, values in sizes.items()}
    return [rank[p.group][p.size] % 2 == 1 or not p.fitted for p in points]


def split(points: Sequence[Point]) -> tuple[list[Point], list[Point]]:
    """(training points, held-out points)."""
    flags = held_out(points)
    return [p for p, h in zip(points, flags, strict=True) if not h], [
        p for p, h in zip(points, flags, strict=True) if h
    ]


# --- errors -------------------------------------------------------------------------------------------------


def prediction_of(point: Point, calibration: Any) -> Prediction:
    return predict_call(
        (point.op, point.then) if point.then else (point.op,),
        point.gpu,
        implementation=point.implementation,
        build=point.build,
        calibration=calibration,
        **copy.deepcopy(point.problem),
    )


@dataclass(frozen=True)
class ErrorSummary:
    """|predicted / measured - 1| over a set of points: count, median, worst (and which point)."""

    count: int
    median: float
    worst: float
    worst_point: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "points": self.count,
            "median_abs_error": self.median,
            "worst_abs_error": self.worst,
            "worst_point": self.worst_point,
        }


def errors(points: Sequence[Point], calibration: Any) -> list[float]:
    """Signed relative errors predicted / measured - 1, one per point."""
    return [prediction_of(p, calibration).seconds / p.measured_s - 1.0 for p in points]


def summarize(points: Sequence[Point], calibration: Any) -> ErrorSummary:
    if not points:
        return ErrorSummary(0, math.nan, math.nan, "")
    values = [abs(e) for e in errors(points, calibration)]
    worst = max(range(len(values)), key=values.__getitem__)
    return ErrorSummary(len(points), statistics.median(values), values[worst], points[worst].label)


# --- fitting ------------------------------------------------------------------------------------------------


def _to_free(name: str, value: float) -> float:
    if name in FRACTIONS:
        value = min(max(value, 1e-6), 1 - 1e-6)
        return math.log(value / (1 - value))
    return math.log(max(value, 1e-15))


def _from_free(name: str, value: float) -> float:
    if name in FRACTIONS:
        return 1.0 / (1.0 + math.exp(-max(-50.0, min(50.0, value))))
    return math.exp(max(-60.0, min(60.0, value)))


def nelder_mead(
    function: Callable[[list[float]], float],
    start: Sequence[float],
    *,
    step: float = 0.3,
    iterations: int = 400,
    tolerance: float = 1e-7,
) -> tuple[list[float], float]:
    """Minimise ``function`` from ``start`` (the standard simplex method: reflect, expand, contract,
    shrink)."""
    n = len(start)
    simplex = [list(start)]
    for i in range(n):
        vertex = list(start)
        vertex[i] += step
        simplex.append(vertex)
    values = [function(v) for v in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) <= tolerance * (abs(values[0]) + tolerance):
            break
        centroid = [sum(v[i] for v in simplex[:-1]) / n for i in range(n)]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centroid, worst, strict=True)]
        value = function(reflected)
        if value < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centroid, worst, strict=True)]
            expanded_value = function(expanded)
            simplex[-1], values[-1] = (
                (expanded, expanded_value) if expanded_value < value else (reflected, value)
            )
        elif value < values[-2]:
            simplex[-1], values[-1] = reflected, value
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centroid, worst, strict=True)]
            contracted_value = function(contracted)
            if contracted_value < values[-1]:
                simplex[-1], values[-1] = contracted, contracted_value
            else:
                best = simplex[0]
                simplex = [best] + [
                    [b + 0.5 * (x - b) for b, x in zip(best, v, strict=True)] for v in simplex[1:]
                ]
                values = [values[0]] + [function(v) for v in simplex[1:]]
    best = min(range(n + 1), key=values.__getitem__)
    return simplex[best], values[best]


def _entry(calibration: dict, gpu: str, implementation: str, family: str) -> dict[str, Any]:
    gpus = calibration["gpus"]
    if gpu not in gpus:
        gpus[gpu] = copy.deepcopy(gpus[REFERENCE_GPU])
        gpus[gpu]["ceilings"] = {}
        gpus[gpu]["source"] = f"fitted from measurements on {gpu}; started from {REFERENCE_GPU}'s"
    impls = gpus[gpu].setdefault("implementations", {})
    if implementation not in impls or family not in impls[implementation]:
        reference = gpus[REFERENCE_GPU]["implementations"].get(implementation, {})
        impls.setdefault(implementation, {})[family] = copy.deepcopy(reference.get(family, {}))
    return impls[implementation][family]


def _loss(values: Iterable[float]) -> float:
    # Squared log error, softened past a factor of e (a few points the model cannot explain must not
    # drag every parameter: robust like scipy's soft_l1).
    total = 0.0
    for value in values:
        total += 2.0 * (math.sqrt(1.0 + value * value) - 1.0)
    return total


def fit_entry(
    points: Sequence[Point],
    calibration: dict,
    gpu: str,
    implementation: str,
    family: str,
    *,
    names: Sequence[str] | None = None,
    iterations: int = 400,
) -> float:
    """Move ``names`` (default :data:`FITTED` of the family, those present) of one entry to minimise the loss
    over ``points`` (all of this GPU and implementation); returns the final loss. Edits ``calibration``."""
    entry = _entry(calibration, gpu, implementation, family)
    kind = "llm-speed" if implementation == "llm-speed" else "vendor"
    names = [n for n in (names or FITTED.get((family, kind), ())) if n in entry]
    if not names or not points:
        return math.nan

    def objective(free: list[float]) -> float:
        for name, value in zip(names, free, strict=True):
            entry[name] = _from_free(name, value)
        try:
            logs = [math.log(prediction_of(p, calibration).seconds / p.measured_s) for p in points]
        except (ValueError, ZeroDivisionError, OverflowError):
            return math.inf
        return _loss(logs)

    value = math.inf
    for _ in range(1 + RESTARTS):
        start = [_to_free(n, float(entry[n])) for n in names]
        best, value = nelder_mead(objective, start, iterations=iterations)
        for name, free in zip(names, best, strict=True):
            entry[name] = _from_free(name, free)
    return value


def _set_host(host: dict[str, Any], measured: dict[str, Any]) -> None:
    """Update a calibration's host table with what a results directory measured (op -> seconds, "source": op
    -> file). Ops it did not measure keep their values; "source" lists each file (or description) with the
    ops it set."""
    values = {op: value for op, value in measured.items() if op != "source"}
    previous = host.get("source")
    if isinstance(previous, dict):
        by_op = {op: origin for origin, ops in previous.items() for op in ops}
    else:  # one description for the whole table
        by_op = {op: str(previous or "unnamed") for op in host if op != "source"}
    by_op.update(measured["source"])
    host.pop("source", None)
    host.update(values)
    sources: dict[str, list[str]] = {}
    for op in host:
        sources.setdefault(by_op.get(op, "unnamed"), []).append(op)
    host["source"] = sources


def calibrate(
    directory: str | Path,
    *,
    base: Any = None,
    gpu: str | None = None,
    iterations: int = 400,
    families: Sequence[str] = FITTED_KINDS,
) -> dict[str, Any]:
    """Refit the calibration from the measurements under ``directory``: start from ``base`` (default: the
    current calibration), set the ceilings and host times the directory records, fit every (GPU,
    implementation, family) with points on the training split, and record each entry's provenance and its
    errors on both splits. Returns the new calibration data (write it with ``json.dump``)."""
    # No simplex step would leave every entry at its start and still record it as refitted.
    iterations = positive_int("iterations", iterations)
    results = load_results(directory, gpu=gpu)
    if not results.points:
        raise ValueError(f"results directory {str(directory)!r}: no GPU measurements found")
    calibration = copy.deepcopy(load_calibration(base))
    for gpu_id, ceilings in results.ceilings.items():
        entry = calibration["gpus"].setdefault(gpu_id, copy.deepcopy(calibration["gpus"][REFERENCE_GPU]))
        entry.setdefault("ceilings", {}).update(ceilings)
    for commit, table in results.compiled.items():
        calibration.setdefault("compiled", {})[commit] = table
    for gpu_id, tables in results.host_s.items():
        impls = calibration["gpus"].get(gpu_id, {}).get("implementations", {})
        for name, table in tables.items():
            targets = list(SDPA_BACKENDS) if name == "sdpa" else [name]
            for target in targets:
                if target == "llm-speed" or target not in impls:
                    continue  # llm-speed's host path belongs to a build (calibration "builds"), not a GPU
                _set_host(impls[target].setdefault("host_s", {}), table)
    for build, table in results.build_host_s.items():
        measured = build_entry("llm-speed", build, calibration)
        _set_host(measured.setdefault("host_s", {}), table)
        # builds that run the measured one's launcher path ("current": d1b0227's, with other defaults)
        for entry in calibration.get("builds", {}).get("llm-speed", {}).values():
            if entry is not measured and same_commit(entry.get("host_path_of"), build):
                _set_host(entry.setdefault("host_s", {}), table)
    train, test = split(results.points)
    groups: dict[tuple[str, str, str], list[Point]] = {}
    for point in train:
        family = kind_of(point)
        if family in families and point.fitted:
            groups.setdefault((point.gpu, point.implementation, family), []).append(point)
    # Vendors first: llm-speed's fits take the SHARED parameters from theirs.
    order = sorted(groups, key=lambda key: (key[1] == "llm-speed", key))
    for gpu_id, implementation, family in order:
        if implementation == "llm-speed" and family in SHARED:
            vendor, names = SHARED[family]
            source = _entry(calibration, gpu_id, vendor, family)
            target = _entry(calibration, gpu_id, implementation, family)
            target.update({name: source[name] for name in names if name in source})
        fit_entry(
            groups[(gpu_id, implementation, family)],
            calibration,
            gpu_id,
            implementation,
            family,
            iterations=iterations,
        )
    report = {}
    for (gpu_id, implementation, family), points in sorted(groups.items()):
        # held out of this fit: the points of its kind (not 8-bit, eager or forward+backward ones)
        held = [p for p in test if (p.gpu, p.implementation, kind_of(p)) == (gpu_id, implementation, family)]
        entry = _entry(calibration, gpu_id, implementation, family)
        entry["fitted"] = {
            "files": sorted({p.source.split(":")[0] for p in points + held}),
            "training": summarize(points, calibration).to_dict(),
            "held_out": summarize(held, calibration).to_dict(),
        }
        report[f"{gpu_id}/{implementation}/{family}"] = entry["fitted"]
    calibration["last_fit"] = {"directory": str(directory), "entries": report}
    return calibration


def fit_report(points: Sequence[Point], calibration: Any) -> list[dict[str, Any]]:
    """One record per point: where it is, its family (:func:`kind_of`), split ("training", "held-out", or
    "unfitted" for kinds no fit uses), measured and predicted ms, error, bound."""
    flags = held_out(points)
    records = []
    for point, held in zip(points, flags, strict=True):
        prediction = prediction_of(point, calibration)
        records.append(
            {
                "point": point.label,
                "op": point.op,
                "then": point.then,
                "family": kind_of(point),
                "implementation": point.implementation,
                "held_out": held,
                "split": "unfitted" if not point.fitted else ("held-out" if held else "training"),
                "measured_ms": point.measured_s * 1e3,
                "predicted_ms": prediction.milliseconds,
                "error": prediction.seconds / point.measured_s - 1.0,
                "bound": prediction.bound,
            }
        )
    return records
