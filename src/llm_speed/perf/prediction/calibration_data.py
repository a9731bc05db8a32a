"""The calibration data the predictions read: ``calibration.json`` (beside :mod:`llm_speed.perf.predict`), per
(GPU, implementation) parameters, host paths and build entries, and the constants of a GPU (its clock's
special-function and conversion rates, Hopper's wgmma shape)."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_speed.core.gpus import GPUSpec, get_gpu, prediction_gaps
from llm_speed.perf._checks import missing_path

CALIBRATION_FILE = Path(__file__).parent.parent / "calibration.json"  # beside llm_speed/perf/predict.py
CALIBRATION_ENV = "LLM_SPEED_CALIBRATION"  # a calibration JSON that replaces the shipped one


# The GPU whose fitted efficiencies stand in for a GPU without its own calibration.
REFERENCE_GPU = "h100-sxm"


# Special-function unit throughput (exp2, rcp, ...) and type conversions: 16 per clock per SM on compute
# capability 5.x-9.0 (CUDA C++ Programming Guide, "Arithmetic Instructions" throughput table).
SFU_OPS_PER_CLOCK_PER_SM = 16
CONVERSIONS_PER_CLOCK_PER_SM = 16
# Hopper's warpgroup MMA (wgmma) works on 64-row slices per warpgroup of 4 warps.
WGMMA_ROWS = 64
WARPS_PER_WARPGROUP = 4
THREADS_PER_WARP = 32


@functools.lru_cache(maxsize=8)
def _read_calibration(path: str) -> dict[str, Any]:
    file = Path(path)
    if not file.is_file():
        why = missing_path(file, "file")
        raise ValueError(f"calibration {path!r}: {why} (expected a calibration JSON file)")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"calibration {path!r} is not valid JSON: {error}") from error
    if not isinstance(data, dict) or "gpus" not in data:
        raise ValueError(f"calibration {path!r}: expected an object with a 'gpus' entry")
    return data


def load_calibration(calibration: str | Path | dict | None = None) -> dict[str, Any]:
    """The calibration data: ``calibration`` itself (a dict), the JSON file it names, the file named by
    ``$LLM_SPEED_CALIBRATION``, or the shipped ``calibration.json``."""
    if isinstance(calibration, dict):
        if "gpus" not in calibration:
            raise ValueError("calibration: expected an object with a 'gpus' entry")
        return calibration
    if calibration is None:
        calibration = os.environ.get(CALIBRATION_ENV) or CALIBRATION_FILE
    return _read_calibration(str(Path(calibration)))


@dataclass(frozen=True)
class GPUConstants:
    """What the model reads about a GPU: datasheet figures and the ceilings measured on it."""

    spec: GPUSpec
    copy_bytes_per_s: float  # device-to-device copy (read + write), measured, else 0.9 x datasheet
    l2_bytes_per_s: float  # L2 bandwidth (fitted where calibrated)
    l2_flush_bytes: float  # what llm-speed bench writes before each timed call (2 x L2)
    clock_hz: float  # the clock the dense tensor peak is quoted at
    sfu_per_s: float  # exponentials per second (all SMs)
    conversions_per_s: float  # int -> float conversions per second (all SMs)
    alu_per_s: float  # fp32 (non-FMA) lane operations per second (all SMs)
    calibrated: bool
    source: str


def _gpu_entry(cal: dict[str, Any], spec: GPUSpec) -> tuple[dict[str, Any], bool]:
    entry = cal["gpus"].get(spec.id)
    if entry is not None:
        return entry, True
    return cal["gpus"].get(REFERENCE_GPU, {}), False


def gpu_constants(gpu: str | GPUSpec, calibration: Any = None) -> GPUConstants:
    """The :class:`GPUConstants` of ``gpu`` under ``calibration`` (see :func:`load_calibration`); ValueError
    when ``gpu`` (a user spec without based_on) leaves a field the model divides by unknown."""
    spec = get_gpu(gpu)
    gaps = prediction_gaps(spec)
    if gaps:
        raise ValueError(
            f"GPU {spec.id}: the prediction model needs {', '.join(gaps)} (unknown without based_on); "
            "give them, or based_on=<table id>"
        )
    cal = load_calibration(calibration)
    entry, calibrated = _gpu_entry(cal, spec)
    ceilings = entry.get("ceilings", {}) if calibrated else {}
    reference = entry.get("ceilings", {})
    if calibrated and "copy_bytes_per_s" in ceilings:
        copy = float(ceilings["copy_bytes_per_s"])
    else:
        # The reference GPU's measured copy as a fraction of its datasheet figure, on this GPU's figure.
        ratio = reference.get("copy_fraction_of_datasheet", 0.9)
        copy = float(ratio) * spec.memory_bandwidth
    l2_ratio = float(reference.get("l2_bandwidth_over_copy", 3.0))
    l2 = float(ceilings["l2_bytes_per_s"]) if "l2_bytes_per_s" in ceilings else l2_ratio * copy
    clock = spec.boost_clock_mhz * 1e6
    lanes = spec.peak_tflops.get("fp32", 0.0) * 1e12 / (2 * spec.sm_count * clock) if clock else 0.0
    return GPUConstants(
        spec=spec,
        copy_bytes_per_s=copy,
        l2_bytes_per_s=l2,
        l2_flush_bytes=float(ceilings.get("l2_flush_bytes", 2 * spec.l2_cache_mb * 1e6)),
        clock_hz=clock,
        sfu_per_s=SFU_OPS_PER_CLOCK_PER_SM * spec.sm_count * clock,
        conversions_per_s=CONVERSIONS_PER_CLOCK_PER_SM * spec.sm_count * clock,
        alu_per_s=lanes * spec.sm_count * clock,
        calibrated=calibrated,
        source=str(ceilings.get("source") or reference.get("source") or "datasheet"),
    )


def parameters(
    gpu: str | GPUSpec, implementation: str, family: str, calibration: Any = None
) -> tuple[dict[str, Any], bool, str]:
    """(parameters, calibrated, source) of ``implementation``'s ``family`` ("gemm", "attention",
    "elementwise", "host") on ``gpu``: its own entry, else the reference GPU's (calibrated=False)."""
    spec = get_gpu(gpu)
    cal = load_calibration(calibration)
    entry, calibrated = _gpu_entry(cal, spec)
    impl = entry.get("implementations", {}).get(implementation)
    if impl is None or family not in impl:
        reference = cal["gpus"].get(REFERENCE_GPU, {}).get("implementations", {}).get(implementation, {})
        if family not in reference:
            raise ValueError(f"calibration: no {family!r} parameters for {implementation!r}")
        params = reference[family]
        calibrated = False
    else:
        params = impl[family]
    source = str(params.get("source", "calibration.json"))
    if not calibrated:
        source = f"{REFERENCE_GPU} parameters on {spec.id}'s datasheet (no {spec.id} measurements): {source}"
    return params, calibrated, source


def host_table(gpu: str | GPUSpec, implementation: str, calibration: Any = None) -> dict[str, Any]:
    """The host path per call of ``implementation``'s ops measured with ``gpu`` (op -> seconds, "default"),
    else the reference GPU's; empty when none was measured."""
    spec = get_gpu(gpu)
    cal = load_calibration(calibration)
    entry, _ = _gpu_entry(cal, spec)
    table = entry.get("implementations", {}).get(implementation, {}).get("host_s")
    if table is None:
        reference = cal["gpus"].get(REFERENCE_GPU, {}).get("implementations", {})
        table = reference.get(implementation, {}).get("host_s", {})
    return table


def build_entry(implementation: str, build: str | None, calibration: Any = None) -> dict[str, Any]:
    """What a build of ``implementation`` runs (tiles, host path, defaults): the calibration's ``builds``
    entry named ``build`` (exactly, or a commit hash the name abbreviates), else the one entry that lists
    ``build`` in its ``runs`` (later commits measured that ran the same kernels and defaults: a results file
    names the git commit it ran); ``build`` None means "current" (this checkout). An entry's ``commit`` is
    the commit whose compiled kernels it runs (the ``compiled`` tables); it does not make that commit's
    measurements the entry's: "current" runs the kernels of d1b0227 with later defaults."""
    cal = load_calibration(calibration)
    builds = cal.get("builds", {}).get(implementation, {})
    name = build or "current"
    if name in builds:
        return builds[name]
    if build is None:
        return {}
    same = [entry for key, entry in builds.items() if same_commit(key, build)]
    if not same:
        same = [e for e in builds.values() if any(same_commit(c, build) for c in e.get("runs", ()))]
    if len(same) == 1:
        return same[0]
    known = ", ".join(
        key + (f" ({', '.join(entry['runs'])})" if entry.get("runs") else "") for key, entry in builds.items()
    )
    why = "described by several entries" if same else "not described"
    raise ValueError(f"build {build!r} of {implementation} is {why}; known: {known or 'none'}")


def same_commit(commit: str | None, build: str) -> bool:
    """Whether ``build`` (a commit hash, short or full) names ``commit`` (the same, at the shorter's
    length; at least 7 hex digits as git abbreviates)."""
    if not commit or min(len(commit), len(build)) < 7:
        return False
    size = min(len(commit), len(build))
    return commit[:size].lower() == build[:size].lower()
