"""Fit the parameters of :mod:`llm_speed.perf.predict` to measurements, honestly: on part of them, checked
on the rest.

``load_results(directory)`` reads every measurement under a results directory: the JSON files of
``llm-speed bench attention|gemm|decode`` (each timed row; the GPU from the file's
``environment.gpu_spec_id``, llm-speed's build from its ``git_commit``: a ``builds`` entry of that name or
commit; a forward+backward row is one point of two ops), the JSON lines of ``benchmarks/attention_sweep.py``
(a tile per row), the ceilings a GPU session records (``ceilings.txt``: the measured copy bandwidth;
``host_overhead.txt``: host time per call), a GPU run of ``llm-speed bench overhead`` (the host path per
call of every op of the build it ran, and of PyTorch's equivalents: :func:`overhead_host_s`), and what the
compiler made of the measured commit's kernels (``benchmarks/compile_measured_tiles.py``'s JSON: programs
per SM and spills in loops per tile, copied to the calibration's ``compiled`` tables).

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
import json
import math
import re
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_speed.core.args import positive_int
from llm_speed.core.gpus import get_gpu, normalize_dtype
from llm_speed.perf._checks import missing_path
from llm_speed.perf.predict import (
    ALIASES,
    FP8_GEMM_SECTION,
    OPS,
    REFERENCE_GPU,
    SDPA_BACKENDS,
    Prediction,
    build_entry,
    compiled_key,
    family_of,
    load_calibration,
    predict_call,
    same_commit,
)
from llm_speed.perf.prediction.names import FITTED_DTYPES

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
# The kinds of point (:func:`kind_of`) a fit uses; every other kind is checked, never fitted.
FITTED_KINDS = ("gemm", "attention", FP8_GEMM_SECTION)
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
# Where the op names of the bench JSON map to the op table (attention: by --mode).
ATTENTION_IMPLEMENTATIONS = {"flash": "llm-speed", "tiled": "llm-speed", "naive": "llm-speed",
                             "flash-fp8": "llm-speed"}  # fmt: skip
BENCH_ATTENTION_OPS = {"flash": "flash_attention", "tiled": "tiled_attention", "naive": "naive_attention",
                 "flash-fp8": "flash_attention_fp8"}  # fmt: skip
# FITTED_DTYPES (prediction.names): the dtypes whose points the 16-bit families use. 8-bit kernels run other
# instructions: fp8 GEMMs with both operands K-major (layout NT) have their own family ("gemm fp8"); fp8
# GEMMs with b N-major (2026-11-25, layout NN, read N-major by the kernel of that build: 8-bit wgmma takes
# K-major operands only), int8 GEMMs and fp8 attention are checked, never fitted.


@dataclass(frozen=True)
class Point:
    """One measured call: ``op`` of the op table with ``problem`` (predict's keywords), run by
    ``implementation`` on ``gpu`` in ``measured_s`` (median), from ``source`` (file: case). ``then``: the op
    that ran after ``op`` under the same timer on the same problem (a forward+backward row: the backward).
    ``case`` and ``row``: the bench file's case and implementation names (``row`` "tiled" for llm-speed's
    tiled attention, "torch" for cuBLAS)."""

    op: str
    implementation: str
    gpu: str
    problem: dict[str, Any]
    measured_s: float
    source: str
    build: str | None = None
    group: tuple = ()
    size: tuple = ()
    then: str | None = None
    case: str = ""
    row: str = ""

    @property
    def label(self) -> str:
        # The bench's own name where it says more than the implementation (tiled, naive, flash-fp8).
        row = f" {self.row}" if self.row and ALIASES.get(self.row, self.row) != self.implementation else ""
        return f"{self.source} [{self.implementation}{row}]"

    @property
    def fitted(self) -> bool:
        """Whether a fit may use this point: its kind (:func:`kind_of`) is one of :data:`FITTED_KINDS`: one
        op (not a forward and its backward under one timer, whose backward's host path no GPU run has
        measured), of a dtype of :data:`FITTED_DTYPES` (or an fp8 GEMM with K-major operands), and not the
        eager attention (no parameter of its own)."""
        return kind_of(self) in FITTED_KINDS


@dataclass
class Results:
    """What a results directory holds: points, and per GPU the ceilings and host times it recorded."""

    points: list[Point] = field(default_factory=list)
    ceilings: dict[str, dict[str, Any]] = field(default_factory=dict)
    # gpu -> implementation -> op (or "default") -> seconds, and "source": the files
    host_s: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    # llm-speed's host path per build (the git commit a file names): build -> op -> seconds, "source"
    build_host_s: dict[str, dict[str, Any]] = field(default_factory=dict)
    compiled: dict[str, dict[str, Any]] = field(default_factory=dict)  # commit -> compiled kernels
    files: list[str] = field(default_factory=list)


# --- reading results ----------------------------------------------------------------------------------------


def display_path(path: Path) -> str:
    """``path`` relative to the working directory when it is below it (provenance stays readable and the same
    on every machine), else as given."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _gpu_of_directory(path: Path) -> str | None:
    """The GPU a directory's name says (benchmarks/results/<gpu>/...), if it names one of the table."""
    for part in reversed(path.parts):
        try:
            return get_gpu(part).id
        except ValueError:
            continue
    return None


def _timed_rows(document: dict):
    """(row, median seconds) of each result row of a bench JSON that ran and was timed."""
    for row in document.get("results", []):
        timing = row.get("timing") or {}
        if row.get("available") and timing.get("median_ms"):
            yield row, timing["median_ms"] / 1e3


def _point(op, implementation, gpu, problem, measured_s, source, build, group, size, **more) -> Point:
    """A :class:`Point`; the build (git revision) is llm-speed's own, so only its points keep it."""
    return Point(op, implementation, gpu, problem, measured_s, source,
                 build if implementation == "llm-speed" else None, group, size, **more)  # fmt: skip


def _attention_points(document: dict, path: Path, gpu: str, build: str | None) -> list[Point]:
    settings = document.get("settings") or {}
    mode = settings.get("mode", "fwd")
    if mode not in ("fwd", "bwd", "fwd+bwd"):
        return []
    points = []
    for row, seconds in _timed_rows(document):
        impl = row["impl"]
        op = BENCH_ATTENTION_OPS.get(impl)
        implementation = ATTENTION_IMPLEMENTATIONS.get(impl, impl)
        if op is None:
            if impl not in SDPA_BACKENDS:
                continue
            op = "flash_attention"
        then = None
        if mode != "fwd":
            # flash's and tiled's backward is flash's kernels; naive's PyTorch's autograd (not modelled)
            if op not in ("flash_attention", "tiled_attention"):
                continue
            if mode == "bwd":
                op = "flash_attention_backward"
            else:
                then = "flash_attention_backward"
        seq = int(row.get("seq_len") or settings["seq_lengths"][0])
        problem = dict(
            batch=settings["batch_size"],
            heads_q=settings["num_heads"],
            heads_kv=settings["num_kv_heads"],
            seq_q=seq,
            seq_kv=seq,
            head_dim=settings["head_dim"],
            dtype="fp8" if op == "flash_attention_fp8" else settings["dtype"],
            causal=bool(settings["causal"]),
        )
        group = (
            "attention",
            f"{op}+{then}" if then else op,
            settings["num_heads"],
            settings["num_kv_heads"],
            settings["head_dim"],
            problem["causal"],
            problem["dtype"],
        )
        points.append(
            _point(op, implementation, gpu, problem, seconds, f"{_short(path)}: {row['case']}", build, group,
                   (seq,), then=then, case=row["case"], row=impl)  # fmt: skip
        )
    return points


# (op, dtype) of each row of an fp8 GEMM file: ours and torch._scaled_mm run gemm_fp8, "torch" bf16
# torch.matmul of the same values (llm_speed.bench.gemm).
FP8_FILE_ROWS = {
    "llm-speed": ("gemm_fp8", "fp8"),
    "torch-scaled-mm": ("gemm_fp8", "fp8"),
    "torch": ("gemm", "bf16"),
}


def _gemm_points(document: dict, path: Path, gpu: str, build: str | None) -> list[Point]:
    settings = document.get("settings") or {}
    dtype = normalize_dtype(settings.get("dtype", "bf16"))
    points = []
    for row, seconds in _timed_rows(document):
        impl = row["impl"]
        implementation = "llm-speed" if impl == "llm-speed" else "cublas"
        op, row_dtype = "tensor_core_gemm_int8" if dtype == "int8" else "gemm", dtype
        if dtype == "fp8":
            op, row_dtype = FP8_FILE_ROWS[impl]
        m, n, k = int(row["m"]), int(row["n"]), int(row["k"])
        problem = dict(m=m, n=n, k=k, dtype=row_dtype, with_bias=settings.get("epilogue", "none") != "none")
        square = m == n == k
        group = ("gemm", row_dtype, "square") if square else ("gemm", row_dtype, n, k)
        size: tuple = (m,)
        source = f"{_short(path)}: {row['case']}"
        if dtype == "fp8":
            granularity = row["case"].split()[-1]  # "4096x4096x4096 row": the granularity
            # each granularity its own group (a different kernel); the bf16 rows apart from every bf16 GEMM
            group = (*group, "fp8 file", granularity)
            if row_dtype != dtype:
                source += f" ({row_dtype})"
        if op == "gemm_fp8":
            layout = settings.get("layout", "NN")
            problem.update(out_dtype="bf16", scaling=granularity, layout=layout)
            # one group per granularity and layout, sized by the FLOPs: 4096^3 fitted, 8192x8192x4096 held out
            group, size = ("gemm", "fp8", granularity, layout), (m * n * k,)
        points.append(
            _point(op, implementation, gpu, problem, seconds, source, build, group, size, case=row["case"],
                   row=impl)  # fmt: skip
        )
    return points


def _decode_points(document: dict, path: Path, gpu: str, build: str | None) -> list[Point]:
    settings = document.get("settings") or {}
    points = []
    for row, seconds in _timed_rows(document):
        implementation = "sdpa-flash" if row["impl"] == "sdpa" else "llm-speed"
        problem = dict(
            batch=row["batch"],
            heads_q=settings["num_heads"],
            heads_kv=settings["num_kv_heads"],
            seq_kv=row["context"],
            head_dim=settings["head_dim"],
            dtype=settings["dtype"],
        )
        if row["impl"].endswith("-fp8"):  # "kvcache-fp8", "kvcache-paged-fp8": e4m3 caches, 1 byte each
            problem["kv_dtype"] = "fp8"
        group = ("decode", row["impl"], settings["num_heads"], settings["num_kv_heads"], row["batch"])
        points.append(
            _point("attention_kvcache_fwd", implementation, gpu, problem, seconds,
                   f"{_short(path)}: {row['case']} {row['impl']}", build, group, (row["context"],))
        )
    return points


def _short(path: Path) -> str:
    """``<folder>/<file>``: how a point names the file it came from."""
    return f"{path.parent.name}/{path.name}"


READERS: dict[str, Callable[[dict, Path, str, str | None], list[Point]]] = {
    "attention": _attention_points,
    "gemm": _gemm_points,
    "decode": _decode_points,
}


def _sweep_points(path: Path, gpu: str, build: str | None) -> list[Point]:
    """``benchmarks/attention_sweep.py`` JSON lines: one tile (or an SDPA backend) per line."""
    points = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line:
            continue
        row = json.loads(line)
        if "ms" not in row or "direction" not in row:
            continue
        impl = row["impl"]
        implementation = "llm-speed" if impl == "flash" else impl
        if implementation not in ("llm-speed", *SDPA_BACKENDS):
            continue
        op = "flash_attention" if row["direction"] == "fwd" else "flash_attention_backward"
        problem = dict(
            batch=row["batch"],
            heads_q=row["heads"],
            heads_kv=row["heads"],
            seq_q=row["seq"],
            seq_kv=row["seq"],
            head_dim=row["head_dim"],
            dtype="fp16",
            causal=bool(row["causal"]),
        )
        config = tuple(row.get("config") or ())
        if config:
            problem["config" if row["direction"] == "fwd" else "backward_config"] = list(config)
        group = ("sweep", op, row["head_dim"], implementation)
        points.append(
            _point(op, implementation, gpu, problem, row["ms"] / 1e3, f"{_short(path)}:{number}", build,
                   group, config)
        )
    return points


# ``benchmarks/attention_ab.py``: variants of one launcher choice timed in one process, at 16 heads, d=128.
_AB_FORWARD = re.compile(r"^causal fwd (?P<batch>\d+)x(?P<seq>\d+) (?P<order>lpt|row)$")
_AB_BACKWARD = re.compile(
    r"^backward (?P<mask>full|causal) (?P<batch>\d+)x(?P<seq>\d+) (?:d(?P<head_dim>\d+) )?(?P<dtype>\w+) "
    r"(?:(?P<vendor>sdpa-\w+)|(?P<tile>shipped|(?P<bm>\d+)x(?P<bn>\d+) w(?P<warps>\d+))"
    r"(?: (?P<path>atomic-dq|atomic|deterministic))?)$"
)
AB_HEADS, AB_HEAD_DIM = 16, 128
# attention_ab.py replaces BM, BN and warps of the shipped backward tile: the stages stay its (d=128 fp16: 2)
AB_BACKWARD_STAGES = 2


def is_attention_ab(document: Any, path: Path) -> bool:
    """Whether ``document`` is ``benchmarks/attention_ab.py``'s output (its "benchmark" key, or, as the runs
    of 2026-11-25 wrote it without one, the file name and the "results" table of medians)."""
    if not isinstance(document, dict):
        return False
    if document.get("benchmark") == "attention_ab":
        return True
    return path.stem.startswith("attention_ab") and isinstance(document.get("results"), dict)


def attention_ab_points(document: dict, path: Path, gpu: str, build: str | None) -> list[Point]:
    """The points of an A/B file: the causal forward in longest-first (the build's own order) and in row
    order (``launch_order="row"``, the patch), bf16; the backward (fp16; ``torch.autograd.grad`` of one
    output) at the build's tile ("shipped") or a patched one (``backward_config``), by the build's default
    path ("atomic": d1b0227's, and call 4's unnamed rows; on later builds, whose Hopper tier computes dQ in
    its own kernel, the same path as "deterministic"), the five-matmul path forced ("atomic-dq": dQ by
    atomics whatever the build's default, ``atomic_dq``) or the dQ kernel ("deterministic"), and cuDNN's
    beside them. Groups: one per variant but its size (the sequence; the tile), held out as elsewhere."""
    points = []
    for case, timing in document["results"].items():
        seconds = float(timing["median_ms"]) / 1e3
        source = f"{_short(path)}: {case}"
        forward, backward = _AB_FORWARD.match(case), _AB_BACKWARD.match(case)
        if forward:
            batch, seq = int(forward["batch"]), int(forward["seq"])
            problem = dict(batch=batch, heads_q=AB_HEADS, heads_kv=AB_HEADS, seq_q=seq, seq_kv=seq,
                           head_dim=AB_HEAD_DIM, dtype="bf16", causal=True)  # fmt: skip
            if forward["order"] == "row":
                problem["launch_order"] = "row"
            group = ("attention_ab", "flash_attention", forward["order"])
            points.append(_point("flash_attention", "llm-speed", gpu, problem, seconds, source, build, group,
                                 (seq,), case=case, row="flash"))  # fmt: skip
        elif backward:
            seq = int(backward["seq"])
            head_dim = int(backward["head_dim"] or AB_HEAD_DIM)  # named in the row when not 128 ("d64")
            problem = dict(batch=int(backward["batch"]), heads_q=AB_HEADS, heads_kv=AB_HEADS, seq_q=seq,
                           seq_kv=seq, head_dim=head_dim, dtype=backward["dtype"],
                           causal=backward["mask"] == "causal")  # fmt: skip
            implementation = backward["vendor"] or "llm-speed"
            size: tuple = ()
            if backward["bm"]:
                tile = (int(backward["bm"]), int(backward["bn"]), int(backward["warps"]), AB_BACKWARD_STAGES)
                problem["backward_config"] = list(tile)
                size = tile
            elif backward["tile"]:
                size = (0,)  # the build's own tile sorts first
            path_name = backward["path"] or "atomic"
            if backward["path"] == "deterministic":
                problem["deterministic"] = True
            elif backward["path"] == "atomic-dq":
                problem["atomic_dq"] = True
            group = ("attention_ab", "flash_attention_backward", backward["mask"], implementation,
                     path_name if implementation == "llm-speed" else "")  # fmt: skip
            row = "flash" if implementation == "llm-speed" else implementation
            points.append(_point("flash_attention_backward", implementation, gpu, problem, seconds, source,
                                 build, group, size, case=case, row=row))  # fmt: skip
    return points


def _folder_environment(path: Path) -> dict[str, Any]:
    """The environment the bench JSON files beside ``path`` share (one GPU call ran them all): GPU and git
    commit, when they agree; empty otherwise."""
    found: set[tuple[str | None, str | None]] = set()
    for sibling in sorted(path.parent.glob("*.json")):
        if sibling == path:
            continue
        try:
            environment = (json.loads(sibling.read_text()) or {}).get("environment") or {}
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            continue
        if environment.get("git_commit") and environment.get("device_type") == "cuda":
            found.add((environment.get("gpu_spec_id"), environment["git_commit"]))
    if len(found) != 1:
        return {}
    gpu, commit = found.pop()
    return {"gpu_spec_id": gpu, "git_commit": commit, "device_type": "cuda"}


_HOST_LINE = re.compile(r"^(?P<what>[\w.]+) (?P<shape>\S+): (?P<us>[\d.]+) us per call")
_HOST_NAMES = {
    "llm_speed.gemm": ("llm-speed", "gemm"),
    "llm_speed.flash_attention": ("llm-speed", "flash_attention"),
    "torch.matmul": ("cublas", "gemm"),
    "sdpa": ("sdpa", "default"),
}

# ``llm-speed bench overhead`` (llm_speed.bench.overhead): its cases -> the op-table rows whose host path they
# measure. llm-speed's ops (the cases with a PyTorch baseline), then PyTorch's: (implementation, ops); "sdpa"
# stands for every SDPA backend (the backend is chosen after the host path).
OVERHEAD_OURS = {
    "flash_attention": ("flash_attention",),
    "tiled_attention": ("tiled_attention",),
    "naive_attention": ("naive_attention",),
    "flash_attention_varlen": ("flash_attention_varlen",),
    "flash_attention_with_kvcache": ("attention_kvcache_fwd",),
    "gemm": ("gemm", "tensor_core_gemm"),
    "tensor_core_gemm_int8": ("tensor_core_gemm_int8",),
    "rms_norm": ("rms_norm",),
    "swiglu": ("swiglu",),
    "apply_rotary": ("apply_rotary",),
    "fused_linear_cross_entropy": ("fused_linear_cross_entropy",),
}
OVERHEAD_THEIRS = {
    "sdpa": ("sdpa", ("default", "flash_attention")),
    "sdpa (3 sequences)": ("sdpa", ("flash_attention_varlen",)),
    "sdpa (decode)": ("sdpa", ("attention_kvcache_fwd",)),
    "torch.matmul": ("cublas", ("gemm", "tensor_core_gemm", "default")),
    "torch._int_mm": ("cublas", ("tensor_core_gemm_int8",)),
    "F.rms_norm": ("pytorch", ("rms_norm", "default")),
    "silu(gate) * up": ("pytorch", ("swiglu",)),
    "rotary (eager)": ("pytorch", ("apply_rotary",)),
    "cross_entropy(linear)": ("pytorch", ("fused_linear_cross_entropy",)),
}
# A figure is a host path only where the calls' kernels took well under it (the stream was host-bound).
HOST_BOUND_FRACTION = 0.5


def overhead_host_s(document: dict) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The host path per call that a GPU run of ``llm-speed bench overhead`` measured: (llm-speed's op ->
    seconds, PyTorch's implementation -> op -> seconds).

    Each figure is the wall time of many back-to-back calls over their number (one synchronisation at the
    end). The device runs call i's kernels while the host prepares call i+1, so a call costs max(host,
    device) (the model's ``stream`` context): where the kernels took well under the wall time (the
    profiler's ``kernel_us``), the wall time per call IS the host path, the kernel time hidden under it (not
    to subtract). A backward's host path is what a training call (forward and backward) adds to an inference
    call, where the run has the training mode: forward + backward then add up to the training call."""
    by_mode: dict[str, dict[str, float]] = {}
    for row in document.get("results", []):
        wall, kernel = row.get("us_per_call"), row.get("kernel_us")
        if not wall or kernel is None or kernel > HOST_BOUND_FRACTION * wall:
            continue
        by_mode.setdefault(row["mode"], {})[row["case"]] = wall * 1e-6
    inference, training = by_mode.get("inference", {}), by_mode.get("training", {})
    ours: dict[str, float] = {}
    theirs: dict[str, dict[str, float]] = {}
    for case, seconds in inference.items():
        if case in OVERHEAD_OURS:
            for op in OVERHEAD_OURS[case]:
                ours[op] = seconds
            backward = f"{OVERHEAD_OURS[case][0]}_backward"
            if case in training and backward in OPS:
                ours[backward] = training[case] - seconds
        elif case in OVERHEAD_THEIRS:
            implementation, ops = OVERHEAD_THEIRS[case]
            for op in ops:
                theirs.setdefault(implementation, {})[op] = seconds
    if "flash_attention" in ours:
        ours["default"] = ours["flash_attention"]
    return ours, theirs


def _add_host(table: dict[str, Any], values: dict[str, float], source: str) -> None:
    """Set ``values`` (op -> seconds) in a results host table, each op's file under "source"."""
    table.update(values)
    table.setdefault("source", {}).update(dict.fromkeys(values, source))


def load_results(directory: str | Path, *, gpu: str | None = None) -> Results:
    """Every measurement under ``directory`` (recursively). ``gpu``: the GPU of files that do not say (the
    sweeps' JSON lines, the ceilings); default the GPU the directory's path names."""
    root = Path(directory)
    if not root.is_dir():
        why = missing_path(root, "folder")
        raise ValueError(f"results directory {str(root)!r}: {why} (expected a folder of results)")
    results = Results()
    fallback = get_gpu(gpu).id if gpu is not None else _gpu_of_directory(root.resolve())
    for path in sorted(root.rglob("*")):
        if not path.is_file():
            continue
        folder_gpu = fallback or _gpu_of_directory(path.parent.resolve())
        if path.suffix == ".json":
            try:
                document = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(document, dict) and document.get("generated_by") == COMPILED_BY:
                results.compiled[document["commit"]] = _compiled_table(document, path)
                results.files.append(display_path(path))
                continue
            if isinstance(document, dict) and document.get("benchmark") == "overhead":
                environment = document.get("environment") or {}
                if environment.get("device_type") != "cuda" or not environment.get("gpu_spec_id"):
                    continue  # a CPU run's figures are simulated (llm_speed.bench.overhead)
                overhead_gpu = get_gpu(environment["gpu_spec_id"]).id
                ours, theirs = overhead_host_s(document)
                commit = environment.get("git_commit")
                if ours and commit:
                    table = results.build_host_s.setdefault(commit[:7], {})
                    _add_host(table, ours, display_path(path))
                for implementation, values in theirs.items():
                    _add_host(results.host_s.setdefault(overhead_gpu, {}).setdefault(implementation, {}),
                              values, display_path(path))  # fmt: skip
                results.files.append(display_path(path))
                continue
            if is_attention_ab(document, path):
                # the runs of 2026-11-25 wrote no environment: the GPU call's other bench files say it
                environment = document.get("environment") or _folder_environment(path)
                ab_gpu = environment.get("gpu_spec_id") or folder_gpu
                commit = environment.get("git_commit")
                if ab_gpu is None or commit is None or environment.get("device_type") != "cuda":
                    continue  # a build that no file names: nothing to compare with
                try:
                    found = attention_ab_points(document, path, get_gpu(ab_gpu).id, commit[:7])
                except (KeyError, TypeError, ValueError):
                    continue
                if found:
                    results.points.extend(found)
                    results.files.append(display_path(path))
                continue
            if not isinstance(document, dict) or document.get("benchmark") not in READERS:
                continue
            environment = document.get("environment") or {}
            file_gpu = environment.get("gpu_spec_id") or (
                folder_gpu if environment.get("device_type") == "cuda" else None
            )
            if file_gpu is None:  # a CPU run says nothing about a GPU
                continue
            build = environment.get("git_commit")
            build = build[:7] if build else None
            try:
                found = READERS[document["benchmark"]](document, path, get_gpu(file_gpu).id, build)
            except (KeyError, TypeError, ValueError):  # not a complete bench result: nothing to learn from
                continue
            if found:
                results.points.extend(found)
                results.files.append(display_path(path))
        elif path.suffix == ".jsonl" and folder_gpu:
            found = _sweep_points(path, folder_gpu, _sweep_build(path))
            if found:
                results.points.extend(found)
                results.files.append(display_path(path))
        elif path.name == "ceilings.txt" and folder_gpu:
            text = path.read_text()
            match = re.search(r"copy TB/s[^\d]*([\d.]+)", text)
            if match:
                entry = results.ceilings.setdefault(folder_gpu, {})
                entry["copy_bytes_per_s"] = float(match.group(1)) * 1e12
                entry["copy_fraction_of_datasheet"] = (
                    entry["copy_bytes_per_s"] / get_gpu(folder_gpu).memory_bandwidth
                )
                entry["source"] = display_path(path)
                results.files.append(display_path(path))
        elif path.name == "host_overhead.txt" and folder_gpu:
            for line in path.read_text().splitlines():
                match = _HOST_LINE.match(line.strip())
                if match and match.group("what") in _HOST_NAMES:
                    impl, op = _HOST_NAMES[match.group("what")]
                    table = results.host_s.setdefault(folder_gpu, {}).setdefault(impl, {})
                    _add_host(table, {op: float(match.group("us")) * 1e-6}, display_path(path))
            results.files.append(display_path(path))
    return results


COMPILED_BY = "benchmarks/compile_measured_tiles.py"


def _compiled_table(document: dict, path: Path) -> dict[str, Any]:
    """A commit's kernels as compiled at measured tiles (``benchmarks/compile_measured_tiles.py``), keyed as
    the model looks them up (``predict.compiled_key``): programs per SM and spill instructions inside the
    innermost loops.
    Kernels that cannot launch (an ``error``: out of shared memory) have no timing to explain."""
    kernels = {}
    for row in document["kernels"]:
        if row.get("error"):
            continue
        key = compiled_key(row["kernel"], row["causal"], row["head_dim"], row["dtype"], row["config"])
        kernels[key] = {
            "registers": row["registers"],
            # spills in the loops that run once per block (an outer loop's run once per GQA head)
            "loop_spills": row["inner_loop_spill_instructions"],
            "blocks_per_sm": row["blocks_per_sm"],
            "tensor_cores": row["tensor_cores"],
        }
    return {
        "source": display_path(path),
        "target": f"{document.get('target')} (Triton {document.get('triton')})",
        "kernels": kernels,
    }


def _sweep_build(path: Path) -> str | None:
    """Sweep lines carry no commit: the build they ran is recorded in the calibration by the file's folder
    name (``builds.llm-speed.<folder>``), if at all."""
    return path.parent.name


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


def _family_of(op: str) -> str:
    family = family_of(op)
    return "elementwise" if family == "cross_entropy" else family


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


def kind_of(point: Point) -> str:
    """The family a point is checked in: its op's ("gemm", "attention"), "eager attention" for the plain
    PyTorch one (naive_attention: cuBLAS and PyTorch parameters, nothing of llm-speed's kernels), "attention
    decode" for a decode over a KV cache (another kernel: split-KV streaming, whose only GPU figures, of
    2026-11-25, are host-bound up to batch 8), with " fwd+bwd" for a forward and its backward under one
    timer and the dtype for 8-bit kernels and caches ("gemm int8", "attention fp8", "attention decode
    fp8"); an fp8 GEMM is "gemm fp8" with both operands K-major (layout NT), else "gemm fp8 N-major". Only
    :data:`FITTED_KINDS` are fitted (:attr:`Point.fitted`)."""
    if point.op == "gemm_fp8":
        k_major = point.problem.get("layout", "NT") == "NT"
        return FP8_GEMM_SECTION if k_major else f"{FP8_GEMM_SECTION} N-major"
    if point.op == "naive_attention":
        family = "eager attention"
    elif point.op == "attention_kvcache_fwd":
        family = "attention decode"
    else:
        family = _family_of(point.op)
    if point.then:
        family += " fwd+bwd"
    dtype = normalize_dtype(point.problem.get("kv_dtype") or point.problem.get("dtype", "fp16"))
    if dtype not in FITTED_DTYPES:
        family += f" {dtype}"
    return family


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
