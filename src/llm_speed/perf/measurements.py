"""Measurements, read for the performance model: the points and ceilings a results directory holds.

``load_results(directory)`` reads every measurement under a results directory: the JSON files of
``llm-speed bench attention|gemm|decode`` (each timed row; the GPU from the file's
``environment.gpu_spec_id``, llm-speed's build from its ``git_commit``: a ``builds`` entry of that name or
commit; a forward+backward row is one point of two ops), the JSON lines of ``benchmarks/attention_sweep.py``
(a tile per row), the ceilings a GPU session records (``ceilings.txt``: the measured copy bandwidth;
``host_overhead.txt``: host time per call), a GPU run of ``llm-speed bench overhead`` (the host path per
call of every op of the build it ran, and of PyTorch's equivalents: :func:`overhead_host_s`), and what the
compiler made of the measured commit's kernels (``benchmarks/compile_measured_tiles.py``'s JSON: programs
per SM and spills in loops per tile, copied to the calibration's ``compiled`` tables). :func:`kind_of` names
the family a point is checked in; :mod:`llm_speed.perf.calibrate` fits on some of them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llm_speed.core.gpus import get_gpu, normalize_dtype
from llm_speed.perf._checks import missing_path
from llm_speed.perf.predict import (
    ALIASES,
    FP8_GEMM_SECTION,
    OPS,
    SDPA_BACKENDS,
    compiled_key,
    family_of,
)
from llm_speed.perf.prediction.names import FITTED_DTYPES

# The kinds of point (:func:`kind_of`) a fit uses; every other kind is checked, never fitted.
FITTED_KINDS = ("gemm", "attention", FP8_GEMM_SECTION)
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


_UNREADABLE = object()  # a .json file that is no JSON: skipped


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return _UNREADABLE


def _in_run_order(root: Path) -> list[tuple[Path, Any]]:
    """Every file under ``root`` with its JSON document (read once; None for other files), the oldest run's
    folder first, so that a later run's figures replace an earlier one's (the host times per call): folders
    by the latest ``environment.timestamp_utc`` their bench JSON record (a folder with none is older than
    any the bench commands wrote), files by path within each. Folder names say nothing of time
    (benchmarks/results: a commit's hash, then its steps)."""
    files = [(path, _read_json(path) if path.suffix == ".json" else None)
             for path in sorted(root.rglob("*")) if path.is_file()]  # fmt: skip
    folder_latest: dict[Path, str] = {}
    for path, document in files:
        environment = document.get("environment") if isinstance(document, dict) else None
        stamp = environment.get("timestamp_utc") if isinstance(environment, dict) else None
        stamp = stamp if isinstance(stamp, str) else ""
        folder_latest[path.parent] = max(folder_latest.get(path.parent, ""), stamp)
    return sorted(files, key=lambda item: (folder_latest[item[0].parent], str(item[0])))


def load_results(directory: str | Path, *, gpu: str | None = None) -> Results:
    """Every measurement under ``directory`` (recursively). ``gpu``: the GPU of files that do not say (the
    sweeps' JSON lines, the ceilings); default the GPU the directory's path names."""
    root = Path(directory)
    if not root.is_dir():
        why = missing_path(root, "folder")
        raise ValueError(f"results directory {str(root)!r}: {why} (expected a folder of results)")
    results = Results()
    fallback = get_gpu(gpu).id if gpu is not None else _gpu_of_directory(root.resolve())
    for path, document in _in_run_order(root):
        folder_gpu = fallback or _gpu_of_directory(path.parent.resolve())
        if path.suffix == ".json":
            if document is _UNREADABLE:
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



def _family_of(op: str) -> str:
    family = family_of(op)
    return "elementwise" if family == "cross_entropy" else family


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
