"""Draw a GPU's roofline with kernels placed on it (matplotlib, Agg backend, imported only when drawing)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llm_speed.core.gpus import GPUSpec, get_gpu, normalize_dtype
from llm_speed.perf.roofline import roofline


@dataclass(frozen=True)
class PlotPoint:
    """One kernel to place: predicted (on the roof) unless ``achieved_flops_per_s`` was measured."""

    label: str
    flops: float
    bytes_moved: float
    achieved_flops_per_s: float | None = None
    group: str | None = None  # points of one group share a colour; each point is then labelled in place


def plot_roofline(
    gpu: str | GPUSpec,
    points: Sequence[PlotPoint],
    path: str | Path,
    *,
    dtype: Any = "bf16",
    title: str | None = None,
) -> Path:
    """Write a log-log roofline of ``gpu`` for ``dtype`` to ``path`` (PNG, SVG or PDF by suffix).

    The roof is ``min(peak, bandwidth * intensity)``; the ridge point is marked. Each point sits at its
    intensity (``flops / bytes_moved``): predicted points on the roof (attainable FLOP/s, hollow markers),
    measured ones at ``achieved_flops_per_s`` (filled markers). Points with a ``group`` (e.g. "prefill",
    "decode") get one colour per group and their label written beside them, so twenty ops stay readable;
    the legend then lists the groups. Returns the written path, checked first with
    :func:`llm_speed._output.prepare_output_path`.
    """
    from llm_speed._output import prepare_output_path

    out = prepare_output_path(path, argument="path")
    spec = get_gpu(gpu)
    dtype_name = normalize_dtype(dtype)
    peak = spec.peak_flops(dtype_name)
    bandwidth = spec.memory_bandwidth
    ridge = peak / bandwidth
    placed = []
    for point in points:
        if not isinstance(point, PlotPoint):
            raise TypeError(f"points must be PlotPoint instances, got {type(point).__name__}")
        if point.bytes_moved <= 0:
            raise ValueError(f"point {point.label!r}: bytes_moved must be > 0 to have an intensity")
        if point.achieved_flops_per_s is not None and not point.achieved_flops_per_s > 0:
            raise ValueError(f"point {point.label!r}: achieved_flops_per_s must be > 0")
        placed.append((point, roofline(point.flops, point.bytes_moved, dtype_name, spec)))

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    intensities = [r.intensity for _, r in placed if r.intensity > 0] + [ridge]
    low = 10 ** math.floor(math.log10(min(intensities) / 4))
    high = 10 ** math.ceil(math.log10(max(intensities) * 4))
    steps = 200
    xs = [low * (high / low) ** (i / steps) for i in range(steps + 1)]
    roof = [min(peak, bandwidth * x) for x in xs]

    # The legend sits right of the axes so it never hides a point.
    figure, axes = plt.subplots(figsize=(11, 5.5))
    axes.loglog(
        xs,
        [y / 1e12 for y in roof],
        color="black",
        linewidth=2,
        label=f"roof: {peak / 1e12:g} TFLOP/s, {bandwidth / 1e12:g} TB/s",
    )
    axes.axvline(ridge, color="gray", linestyle="--", linewidth=1)
    axes.annotate(
        f"ridge {ridge:.0f} FLOP/B",
        (ridge, peak / 1e12),
        textcoords="offset points",
        xytext=(5, -15),
        fontsize=8,
        color="gray",
    )
    markers = "osD^v"  # matplotlib cycles 10 colours; a new marker shape for every 10 points keeps them apart
    groups = list(dict.fromkeys(point.group for point, _ in placed if point.group is not None))
    legend_done: set[str] = set()
    labelled: dict[str, list[tuple[float, float, str, str]]] = {}
    for index, (point, result) in enumerate(placed):
        if point.group is not None:
            slot = groups.index(point.group)
            color, marker = f"C{slot % 10}", markers[slot % len(markers)]
        else:
            color, marker = f"C{index % 10}", markers[(index // 10) % len(markers)]
        if point.achieved_flops_per_s is None:
            y, marker_face, kind = result.attainable_flops, "none", "predicted"
        else:
            y, marker_face, kind = point.achieved_flops_per_s, color, "measured"
        x = max(result.intensity, low)
        if point.group is None:
            label = f"{point.label} ({kind}, {result.bound}-bound)"
        elif point.group not in legend_done:
            legend_done.add(point.group)
            label = f"{point.group} ({kind})"
        else:
            label = None
        axes.plot(
            [x],
            [y / 1e12],
            marker=marker,
            markersize=8,
            markerfacecolor=marker_face,
            color=color,
            linestyle="none",
            label=label,
        )
        if point.group is not None:
            labelled.setdefault(point.group, []).append((x, y / 1e12, point.label, color))
    for slot, group in enumerate(groups):
        _label_clusters(axes, labelled.get(group, []), above=slot % 2 == 0)
    if groups:  # headroom for the labels written above the points on the flat roof
        axes.set_ylim(top=peak / 1e12 * 6)
    axes.set_xlabel("arithmetic intensity (FLOP / byte of DRAM traffic)")
    axes.set_ylabel("TFLOP/s")
    axes.set_title(title or f"Roofline: {spec.name}, {dtype_name}")
    axes.grid(True, which="both", linewidth=0.3)
    axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    figure.tight_layout()
    figure.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return out


def _label_clusters(axes: Any, points: list[tuple[float, float, str, str]], *, above: bool) -> None:
    """Write the labels of one group's points: points within 2x of each other in intensity share one label
    ("qkv, o, gate_up"), three names per line; one group's labels go above the points, the next's below."""
    clusters: list[list[tuple[float, float, str, str]]] = []
    for point in sorted(points):
        if clusters and point[0] <= clusters[-1][0][0] * 2:
            clusters[-1].append(point)
        else:
            clusters.append([point])
    for cluster in clusters:
        names = list(dict.fromkeys(name for _, _, name, _ in cluster))
        lines = [", ".join(names[i : i + 3]) for i in range(0, len(names), 3)]
        x = math.exp(sum(math.log(p[0]) for p in cluster) / len(cluster))
        y = math.exp(sum(math.log(p[1]) for p in cluster) / len(cluster))
        axes.annotate(
            "\n".join(lines),
            (x, y),
            textcoords="offset points",
            xytext=(-8, 10) if above else (8, -10),
            ha="right" if above else "left",
            va="bottom" if above else "top",
            fontsize=7,
            color=cluster[0][3],
        )
