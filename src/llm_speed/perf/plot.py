"""Draw a GPU's roofline with kernels placed on it (matplotlib, Agg backend, imported only when drawing).

Made to be read at a glance: the legend sits under the axes (never over a point, never a third of the
width); every point carries its name beside it, and points that would hide each other are drawn side by side
with one label for all of them; each point is placed against the roof of its own dtype (an fp8 kernel under
the fp8 peak, not the plot's bf16 one), every roof drawn and named; predicted points are hollow and measured
ones filled, and the legend says which is which.
"""

from __future__ import annotations

import math
import textwrap
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
    group: str | None = None  # points of one group share a colour
    dtype: Any = None  # the dtype the kernel computes in, whose roof it sits under (None: the plot's)


MARKER_SIZE = 8  # points
# Markers this close (in points on the page) would hide one another: they are spread on a small ring.
COINCIDENT_POINTS = 3.0
RING_POINTS = 5.0
# Points of one group this close share one label (written at their centre).
LABEL_JOIN_POINTS = 10.0
FIGURE_SIZE = (9.0, 5.5)
# The axes' share of the figure, for turning a distance in decades into one on the page before drawing.
AXES_WIDTH_SHARE, AXES_HEIGHT_SHARE = 0.8, 0.7
ROOF_STYLES = ("-", "--", "-.", ":")
TITLE_WIDTH = 100  # characters per title line


@dataclass(frozen=True)
class _Placed:
    point: PlotPoint
    dtype: str
    x: float  # intensity, FLOP/byte
    y: float  # TFLOP/s: the roof of the point's dtype at x (predicted) or the measured rate
    bound: str
    predicted: bool
    color: str


def _placed(spec: GPUSpec, points: Sequence[PlotPoint], dtype_name: str) -> list[_Placed]:
    for point in points:
        if not isinstance(point, PlotPoint):
            raise TypeError(f"points must be PlotPoint instances, got {type(point).__name__}")
    groups = list(dict.fromkeys(point.group for point in points if point.group is not None))
    placed = []
    for index, point in enumerate(points):
        if point.bytes_moved <= 0:
            raise ValueError(f"point {point.label!r}: bytes_moved must be > 0 to have an intensity")
        if point.achieved_flops_per_s is not None and not point.achieved_flops_per_s > 0:
            raise ValueError(f"point {point.label!r}: achieved_flops_per_s must be > 0")
        own = normalize_dtype(point.dtype) if point.dtype is not None else dtype_name
        result = roofline(point.flops, point.bytes_moved, own, spec)
        predicted = point.achieved_flops_per_s is None
        y = result.attainable_flops if predicted else point.achieved_flops_per_s
        slot = groups.index(point.group) if point.group is not None else index
        color = f"C{slot % 10}"
        placed.append(_Placed(point, own, result.intensity, y / 1e12, result.bound, predicted, color))
    return placed


def _page(placed: list[_Placed], x_range, y_range) -> list[tuple[float, float]]:
    """Each point's position on the page, in points from the axes' lower left corner."""
    width, height = FIGURE_SIZE[0] * AXES_WIDTH_SHARE * 72, FIGURE_SIZE[1] * AXES_HEIGHT_SHARE * 72

    def scaled(value: float, low: float, high: float, size: float) -> float:
        return math.log10(max(value, low) / low) / math.log10(high / low) * size

    return [(scaled(p.x, *x_range, width), scaled(p.y, *y_range, height)) for p in placed]


def _chains(indices: list[int], where: list[tuple[float, float]], distance: float) -> list[list[int]]:
    """``indices`` gathered into chains: a point joins a chain with a member closer than ``distance``."""
    chains: list[list[int]] = []
    for i in sorted(indices, key=lambda i: where[i]):
        joined = [chain for chain in chains if any(math.dist(where[i], where[j]) < distance for j in chain)]
        merged = [i] + [j for chain in joined for j in chain]
        chains = [chain for chain in chains if chain not in joined] + [sorted(merged)]
    return chains


def _ring_offsets(where: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Offsets (points) that spread markers sitting on top of one another on a ring around their place."""
    offsets = [(0.0, 0.0)] * len(where)
    for chain in _chains(list(range(len(where))), where, COINCIDENT_POINTS):
        if len(chain) > 1:
            for slot, i in enumerate(chain):
                angle = 2 * math.pi * slot / len(chain)  # two: side by side, at their true height
                offsets[i] = (RING_POINTS * math.cos(angle), RING_POINTS * math.sin(angle))
    return offsets


@dataclass(frozen=True)
class _Label:
    text: str
    xy: tuple[float, float]
    color: str
    gid: str
    above: bool


def _label(items: list[_Placed], indices: list[int], dtype_name: str, *, above: bool, x_low: float) -> _Label:
    """One label for points that sit close together: their names (each with its dtype where it is not the
    plot's) in the order of their intensity, at their centre."""
    names = list(dict.fromkeys(
        item.point.label + (f" ({item.dtype})" if item.dtype != dtype_name else "") for item in items
    ))  # fmt: skip
    per_line = 3 if max(map(len, names)) <= 16 else 1  # short op names share a line; long ones get their own
    text = "\n".join(", ".join(names[i : i + per_line]) for i in range(0, len(names), per_line))
    colors = {item.color for item in items}
    x = math.exp(sum(math.log(max(item.x, x_low)) for item in items) / len(items))
    y = math.exp(sum(math.log(item.y) for item in items) / len(items))
    color = items[0].color if len(colors) == 1 else "dimgray"  # one label for points of several colours
    return _Label(text, (x, y), color, "label " + " ".join(map(str, indices)), above)


def _spots(above: bool) -> list[tuple[float, float, str, str]]:
    """Where a label may go around its points, nearest first: (dx, dy in points, ha, va)."""
    gap = 3 + MARKER_SIZE / 2 + RING_POINTS
    spots = []
    for level in (1, 2.5, 4):
        for sign in (1, -1) if above else (-1, 1):
            va = "bottom" if sign > 0 else "top"
            dy = sign * gap * level
            spots += [(0.0, dy, "center", va), (gap, dy, "left", va), (-gap, dy, "right", va)]
        if level == 1:
            spots += [(gap, 0.0, "left", "center"), (-gap, 0.0, "right", "center")]
    return spots


def _place_labels(figure: Any, axes: Any, labels: list[_Label]) -> None:
    """Each label at the first of its :func:`_spots` where it covers no marker and no label placed before
    it (the nearest spot when every one is taken)."""
    renderer = figure.canvas.get_renderer()
    markers = [line for line in axes.get_lines() if str(line.get_gid()).startswith("point")]
    taken = [line.get_window_extent(renderer) for line in markers]
    for label in labels:
        spots = _spots(label.above)
        for dx, dy, ha, va in spots:
            box = _annotate(axes, label, dx, dy, ha, va).get_window_extent(renderer)
            if not any(box.overlaps(other) for other in taken):
                break
            axes.texts[-1].remove()
        else:
            box = _annotate(axes, label, *spots[0]).get_window_extent(renderer)
        taken.append(box)


def _annotate(axes: Any, label: _Label, dx: float, dy: float, ha: str, va: str) -> Any:
    return axes.annotate(label.text, label.xy, textcoords="offset points", xytext=(dx, dy), ha=ha, va=va,
                         fontsize=7, color=label.color, gid=label.gid)  # fmt: skip


def roofline_figure(
    gpu: str | GPUSpec, points: Sequence[PlotPoint], *, dtype: Any = "bf16", title: str | None = None
):
    """The figure :func:`plot_roofline` writes (a matplotlib Figure; close it with ``plt.close``).

    Artists carry a ``gid`` a test can find: ``roof <dtype>`` for each roof line, ``point <i>`` for the
    i-th point's marker (``i`` its index in ``points``), ``label <i> <j> ...`` for the label of the points
    ``i, j, ...``.
    """
    spec = get_gpu(gpu)
    dtype_name = normalize_dtype(dtype)
    placed = _placed(spec, points, dtype_name)
    bandwidth = spec.memory_bandwidth
    dtypes = list(dict.fromkeys([dtype_name, *(p.dtype for p in placed)]))
    peaks = {name: spec.peak_flops(name) for name in dtypes}

    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.transforms import offset_copy

    ridges = [peak / bandwidth for peak in peaks.values()]
    intensities = [p.x for p in placed if p.x > 0] + ridges
    x_range = (
        10 ** math.floor(math.log10(min(intensities) / 4)),
        10 ** math.ceil(math.log10(max(intensities) * 4)),
    )
    steps = 200
    xs = [x_range[0] * (x_range[1] / x_range[0]) ** (i / steps) for i in range(steps + 1)]
    lowest = min([bandwidth * x_range[0] / 1e12, *(p.y for p in placed)])
    # room above the highest roof for the labels written over the points
    y_range = (lowest / 2, max(peaks.values()) / 1e12 * 6)

    figure, axes = plt.subplots(figsize=FIGURE_SIZE)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlim(*x_range)
    axes.set_ylim(*y_range)
    for index, (name, peak) in enumerate(peaks.items()):
        style = ROOF_STYLES[index % len(ROOF_STYLES)]
        roof = [min(peak, bandwidth * x) / 1e12 for x in xs]
        # the ridge point named in the legend, not on the plot where the labels of points go
        axes.plot(xs, roof, color="black", linewidth=1.5, linestyle=style, gid=f"roof {name}",
                  label=f"{name} roof: {peak / 1e12:g} TFLOP/s, {bandwidth / 1e12:g} TB/s, "
                  f"ridge {peak / bandwidth:.0f} FLOP/B")  # fmt: skip
    where = _page(placed, x_range, y_range)
    for i, (item, (dx, dy)) in enumerate(zip(placed, _ring_offsets(where), strict=True)):
        transform = offset_copy(axes.transData, fig=figure, x=dx, y=dy, units="points")
        axes.plot([max(item.x, x_range[0])], [item.y], marker="o" if item.predicted else "s",
                  markersize=MARKER_SIZE, markerfacecolor="none" if item.predicted else item.color,
                  color=item.color, linestyle="none", transform=transform, gid=f"point {i}")  # fmt: skip
    labels: list[_Label] = []
    groups = list(dict.fromkeys(p.point.group for p in placed))
    for slot, group in enumerate(groups):
        members = [i for i, p in enumerate(placed) if p.point.group == group]
        for number, chain in enumerate(_chains(members, where, LABEL_JOIN_POINTS)):
            labels.append(_label([placed[i] for i in chain], chain, dtype_name,
                                 above=(slot if group is not None else number) % 2 == 0, x_low=x_range[0]))
    handles, _ = axes.get_legend_handles_labels()
    kinds = {p.predicted for p in placed}
    if True in kinds:
        handles.append(Line2D([], [], marker="o", markerfacecolor="none", color="gray", linestyle="none",
                              label="predicted by the model (on its roof)"))  # fmt: skip
    if False in kinds:
        handles.append(Line2D([], [], marker="s", color="gray", linestyle="none", label="measured"))
    for group in dict.fromkeys(p.point.group for p in placed if p.point.group is not None):
        color = next(p.color for p in placed if p.point.group == group)
        handles.append(Line2D([], [], color=color, linewidth=5, label=group))
    axes.set_xlabel("arithmetic intensity (FLOP / byte of DRAM traffic)")
    axes.set_ylabel("TFLOP/s")
    heading = title or f"Roofline: {spec.name}, {dtype_name}"
    axes.set_title("\n".join(textwrap.fill(line, TITLE_WIDTH) for line in heading.split("\n")), fontsize=9)
    axes.grid(True, which="both", linewidth=0.3)
    # under the axes, below the x-axis label: out of the data's way, as wide as the plot
    axes.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13),
                ncol=min(3, len(handles)), frameon=False)  # fmt: skip
    figure.tight_layout()
    _place_labels(figure, axes, labels)  # after the layout: the boxes are where they will be drawn
    return figure


def plot_roofline(
    gpu: str | GPUSpec,
    points: Sequence[PlotPoint],
    path: str | Path,
    *,
    dtype: Any = "bf16",
    title: str | None = None,
) -> Path:
    """Write a log-log roofline of ``gpu`` for ``dtype`` to ``path`` (PNG, SVG or PDF by suffix).

    The roof is ``min(peak, bandwidth * intensity)``, one per dtype among ``dtype`` and the points' own
    (:attr:`PlotPoint.dtype`), each with its ridge point marked. Each point sits at its intensity
    (``flops / bytes_moved``): predicted points on their dtype's roof (hollow circles), measured ones at
    ``achieved_flops_per_s`` (filled squares); each is named beside it (points that would overlap are drawn
    side by side and named together); points with a ``group`` (e.g. "prefill", "decode") share a colour
    and the legend names the groups. Returns the written path, checked first with
    :func:`llm_speed._output.prepare_output_path`.
    """
    from llm_speed._output import prepare_output_path

    out = prepare_output_path(path, argument="path")
    figure = roofline_figure(gpu, points, dtype=dtype, title=title)
    import matplotlib.pyplot as plt

    figure.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return out
