"""From roofline floors to realistic estimates: efficiency factors, collective algorithms, and calibration.

A floor (:mod:`llm_speed.perf.roofline`) assumes every kernel runs at the datasheet peak and every link at
its line rate. Real kernels and links do not. :class:`Efficiency` holds the fractions they reach; a realistic
time is ``max(flops / (peak * compute), bytes / (bandwidth * memory))`` per op, plus collectives at
``line rate * collective`` and a fixed latency per collective.

Where the defaults come from (each a published measurement, none fitted to the figures the tests check,
except where said):

* ``memory = 0.7``: gpt-fast's bf16 Llama-2-7B decode reads its weights at 1,397 GB/s on an A100-80GB
  (2,039 GB/s datasheet), 0.685 (pytorch-labs/gpt-fast README, "Benchmarks" table; A100s power-limited to
  330 W). The golden tests fit nothing else to that table's other rows.
* Weight-only quantized weights (int8, int4) carry no factor of their own: :func:`llm_speed.perf.inference.
  analyze_inference` dequantizes them with :mod:`llm_speed.perf.predict`'s model (conversions on the CUDA
  cores, overlapped with the weight stream), whose share of the stream's time the ``memory`` factor slows
  alike.
* ``compute = 0.7``: a round figure for large bf16 GEMMs (no published table is fitted); measure your own
  with ``llm-speed bench gemm --output FILE`` and :func:`calibrate_from_bench`.
* ``collective = 0.8``: NCCL's ring protocol carries a 128-byte payload per NVLink packet, so the effective
  bus bandwidth is about 80% of the line rate: ~240 of 300 GB/s on A100 (~230 measured) and ~370 of 450 GB/s
  on H100 (NCCL maintainer S. Jeaugey in NVIDIA/nccl-tests issues #149 and #212).
* ``nvls = 0.6875``: NVLink SHARP (NCCL's default all-reduce on H100 NVSwitch systems, NCCL >= 2.17) reduces
  in the switch: the reduce-scatter reads the buffer out of every GPU (D per GPU) and returns each GPU its
  reduced D/n, the all-gather pushes that D/n once and the switch multicasts the whole D back, so each GPU
  moves D (1 + 1/n) through its link. Fitted to one figure, the peak algorithm bandwidth on 8 H100s,
  ~275 GB/s of the 450 GB/s line rate (busBw ~480 GB/s; S. Jeaugey in nccl-tests issue #212):
  275 x 9/8 / 450 = 0.6875. Held out: NCCL issue #1455 (8 x H100 SXM, NCCL_ALGO=NVLS, 2-4 GiB) measured
  busBw 420, 440, 460 and 480 GB/s on 5, 6, 7 and 8 GPUs; this gives 409, 439, 460 and 478 (within 3%).
* ``collective_latency_s = 28e-6``: a fixed cost per collective call (kernel launch, synchronisation) that
  dominates the small all-reduces of tensor-parallel decode. Fitted to one row, gpt-fast's Llama-2-7B on 8
  A100s (328 tokens/s, 64 all-reduces and one logits all-gather per token); every other tensor-parallel row
  is held out.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from llm_speed.core.args import non_negative_number, positive_int
from llm_speed.core.gpus import GPUSpec, get_gpu, normalize_dtype
from llm_speed.perf._checks import missing_path

ALGORITHMS = ("ring", "tree", "nvls")


def _fraction(name: str, value: Any) -> float:
    value = non_negative_number(name, value)
    if not 0 < value <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return value


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet peaks that kernels and links reach (see the module docstring)."""

    compute: float = 0.7
    memory: float = 0.7
    collective: float = 0.8
    nvls: float = 0.6875
    collective_latency_s: float = 28e-6
    source: str = "defaults (llm_speed.perf.efficiency)"

    def __post_init__(self) -> None:
        for name in ("compute", "memory", "collective", "nvls"):
            _fraction(name, getattr(self, name))
        non_negative_number("collective_latency_s", self.collective_latency_s)


FLOOR = Efficiency(
    compute=1.0,
    memory=1.0,
    collective=1.0,
    nvls=1.0,
    collective_latency_s=0.0,
    source="floor: datasheet peaks, line rates, no latency",
)


def realistic_time(
    flops: float, bytes_moved: float, peak_flops: float, bandwidth: float, *, compute: float, memory: float
) -> float:
    """``max(flops / (peak * compute), bytes / (bandwidth * memory))``: the roofline, both roofs lowered."""
    return max(flops / (peak_flops * compute), bytes_moved / (bandwidth * memory))


# --- collectives ---


@dataclass(frozen=True)
class AllReduceEstimate:
    """One all-reduce of ``size_bytes`` among ``num_gpus``: its time and the nccl-tests figures it implies
    (algbw = size / time; busbw = algbw * 2(n-1)/n, nccl-tests' PERFORMANCE.md)."""

    algorithm: str
    num_gpus: int
    size_bytes: float
    link_bytes_per_s: float
    time_s: float
    algbw_bytes_per_s: float
    busbw_bytes_per_s: float


def all_reduce_time(
    size_bytes: float,
    num_gpus: int,
    link_bytes_per_s: float,
    *,
    algorithm: str = "ring",
    efficiency: Efficiency | None = None,
) -> AllReduceEstimate:
    """Time of one all-reduce of D bytes among N GPUs whose links carry B bytes/s per direction (line rate).

    * ring (Patarasuk & Yuan 2009): each GPU sends 2(N-1)/N * D at B * collective.
    * tree (NCCL's double binary tree, pipelined): each GPU sends D up and D down, 2D at B * collective, plus
      2*ceil(log2 N) latency hops (counted in ``collective_latency_s``); it beats the ring only on latency
      across nodes.
    * nvls (NVLink SHARP): the switch reduces and multicasts; each GPU moves D (1 + 1/n) through its link
      at B * nvls (see the module docstring).

    Each call adds ``collective_latency_s`` once (tree: per hop of 2*ceil(log2 N)). N = 1 costs nothing.
    Pass :data:`FLOOR` for the line-rate floor.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    size = non_negative_number("size_bytes", size_bytes)
    n = positive_int("num_gpus", num_gpus)
    link = non_negative_number("link_bytes_per_s", link_bytes_per_s)
    if link == 0:
        raise ValueError("link_bytes_per_s must be > 0")
    eff = Efficiency() if efficiency is None else efficiency
    if n == 1:
        time = 0.0
    elif algorithm == "ring":
        time = eff.collective_latency_s + 2 * (n - 1) / n * size / (link * eff.collective)
    elif algorithm == "tree":
        hops = 2 * math.ceil(math.log2(n))
        time = hops * eff.collective_latency_s + 2 * size / (link * eff.collective)
    else:
        time = eff.collective_latency_s + size * (1 + 1 / n) / (link * eff.nvls)
    algbw = size / time if time > 0 else math.inf
    return AllReduceEstimate(algorithm, n, size, link, time, algbw, algbw * 2 * (n - 1) / n)


# --- calibration from measurements ---


@dataclass(frozen=True)
class Calibration:
    """Efficiencies measured by one ``llm-speed bench`` run: per-row ratios floor / measured time."""

    gpu: str
    dtype: str
    compute: float | None  # median over compute-bound rows (None: no such row)
    memory: float | None
    compute_rows: int
    memory_rows: int

    def apply(self, base: Efficiency | None = None) -> Efficiency:
        """``base`` (default :class:`Efficiency`) with the measured compute and memory factors put in."""
        base = Efficiency() if base is None else base
        changes: dict[str, Any] = {"source": f"calibrated from bench on {self.gpu} ({self.dtype})"}
        if self.compute is not None:
            changes["compute"] = min(1.0, self.compute)
        if self.memory is not None:
            changes["memory"] = min(1.0, self.memory)
        return replace(base, **changes)


def calibrate_from_bench(path: str | Path, gpu: str | GPUSpec | None = None) -> Calibration:
    """Compute and memory efficiency measured by ``llm-speed bench ... --output FILE`` (its JSON).

    For every case the fastest implementation that ran is kept (the best kernel is what a deployment uses);
    its floor on the roofline (the model's FLOPs and bytes at the GPU's peaks) divided by its median time is
    one sample of the efficiency of its bound. The median sample per bound is returned. The GPU is the run's
    ``environment.gpu_spec_id`` unless ``gpu`` is given; a CPU run (no GPU id) is refused.
    """
    from llm_speed.perf.roofline import roofline

    file = Path(path)
    if not file.is_file():
        why = missing_path(file, "file")
        raise ValueError(f"bench JSON {str(file)!r}: {why} (expected a bench JSON file)")
    try:
        document = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"bench JSON {str(file)!r} is not valid JSON: {error}") from error
    if not isinstance(document, dict) or not isinstance(document.get("results"), list):
        raise ValueError(
            f"bench JSON {str(file)!r}: expected an object with a 'results' list (llm-speed bench)"
        )
    environment = document.get("environment") or {}
    gpu_name = gpu if gpu is not None else environment.get("gpu_spec_id")
    if gpu_name is None:
        raise ValueError(
            f"bench JSON {str(file)!r} was not measured on a GPU of the spec table "
            f"(device {environment.get('device_name')!r}); pass gpu= to name the GPU it ran on"
        )
    spec = get_gpu(gpu_name)
    dtype = normalize_dtype((document.get("settings") or {}).get("dtype", "bf16"))
    best: dict[str, dict[str, Any]] = {}
    for row in document["results"]:
        if not isinstance(row, dict) or not row.get("latency_ms") or not row.get("bytes_moved"):
            continue
        case = str(row.get("case"))
        if case not in best or row["latency_ms"] < best[case]["latency_ms"]:
            best[case] = row
    samples: dict[str, list[float]] = {"compute": [], "memory": []}
    for row in best.values():
        point = roofline(float(row["flops"]), float(row["bytes_moved"]), dtype, spec)
        samples[point.bound].append(point.time_floor_s / (row["latency_ms"] / 1e3))
    if not samples["compute"] and not samples["memory"]:
        raise ValueError(f"bench JSON {str(file)!r} has no timed rows to calibrate from")
    return Calibration(
        gpu=spec.id,
        dtype=dtype,
        compute=statistics.median(samples["compute"]) if samples["compute"] else None,
        memory=statistics.median(samples["memory"]) if samples["memory"] else None,
        compute_rows=len(samples["compute"]),
        memory_rows=len(samples["memory"]),
    )
