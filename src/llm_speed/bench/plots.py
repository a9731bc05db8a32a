"""Plots of benchmark rows: measured points on the roofline of the GPU that measured them, or the model's
predictions for a GPU (labelled as such) after a CPU run; a grouped bar chart when a roofline would pile the
points on one spot (a model's weight GEMMs at a few tokens all have nearly the same arithmetic intensity).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from rich.console import Console

from llm_speed.bench.report import Measurement

# The GPU whose predictions a CPU run plots.
MODELLED_GPU = "h100-sxm"
# Points whose intensities all lie within this factor of each other would overlap on a log-log roofline.
CROWDED_INTENSITY_SPAN = 2.0
CROWDED_MIN_POINTS = 4


def _crowded(rows: Sequence[Measurement]) -> bool:
    intensities = [row.flops / row.bytes_moved for row in rows if row.bytes_moved > 0]
    if len(intensities) < CROWDED_MIN_POINTS:
        return False
    return max(intensities) / min(intensities) < CROWDED_INTENSITY_SPAN


def plot_rows(
    rows: Sequence[Measurement],
    path: str | Path,
    *,
    device: torch.device,
    dtype: str,
    title: str,
    console: Console,
) -> bool:
    """Write the plot of ``rows`` to ``path`` (already checked with ``prepare_output_path``).

    On a GPU in the spec table: the measured rows on its roofline. On a CPU: the performance model's
    predictions for :data:`MODELLED_GPU`, one point per distinct problem, labelled as predictions, none for a
    row refused on every device (``refused_everywhere``); the CPU's own timings are not drawn (they do not
    belong on a GPU's roofline). Crowded points become a bar chart.
    Returns False, saying why, when there is nothing to plot.
    """
    from llm_speed.core.gpus import detect_gpu, get_gpu
    from llm_speed.perf.plot import PlotPoint, plot_roofline

    if device.type == "cuda":
        gpu = detect_gpu()
        if gpu is None:
            console.print(
                f"no roofline plot: {torch.cuda.get_device_name(device)} is not in the GPU spec table"
            )
            return False
        plotted = [row for row in rows if row.median_ms]
        if not plotted:
            console.print("no roofline plot: no implementation ran")
            return False
        labels = [f"{row.impl} {row.case}" for row in plotted]
        achieved = [row.flops / (row.median_ms * 1e-3) for row in plotted]
        title += f"\n(measured on {gpu.name})"
    else:
        gpu = get_gpu(MODELLED_GPU)
        # One prediction per distinct problem: implementations with the same cost and dtype share a point.
        # None for a row refused on every device (fp8 attention's backward): no GPU would run it either.
        distinct: dict[tuple[str, float, float, str | None], list[str]] = {}
        for row in rows:
            if row.bytes_moved > 0 and not row.refused_everywhere:
                distinct.setdefault((row.case, row.flops, row.bytes_moved, row.dtype), []).append(row.impl)
        firsts = {(r.case, r.flops, r.bytes_moved, r.dtype): r for r in reversed(rows)}
        plotted = [firsts[key] for key in distinct]
        labels = [f"{case} [{', '.join(impls)}]" for (case, _, _, _), impls in distinct.items()]
        achieved = [None] * len(plotted)
        title += (
            f"\n(the model's predictions for {gpu.name}; this CPU's timings are not plotted: they belong on "
            "a CPU's roofline, not a GPU's)"
        )
    if not plotted:
        console.print("no plot: no problem to place")
        return False
    if _crowded(plotted):
        _plot_bars(plotted, labels, achieved, path, gpu=gpu, dtype=dtype, title=title)
        console.print(f"bar chart written to {path} (points would overlap on a roofline)", highlight=False)
        return True
    points = [
        PlotPoint(label, row.flops, row.bytes_moved, flops_per_s, dtype=row.dtype)
        for label, row, flops_per_s in zip(labels, plotted, achieved, strict=True)
    ]
    plot_roofline(gpu, points, path, dtype=dtype, title=title)
    console.print(f"roofline plot written to {path}", highlight=False)
    return True


def _plot_bars(rows, labels, achieved, path, *, gpu, dtype: str, title: str) -> None:
    """Horizontal bars, one per row: measured TFLOP/s (when measured) beside the roofline's attainable TFLOP/s
    for the same problem on ``gpu`` (the model's prediction), so a model's GEMMs read at a glance."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from llm_speed.perf.roofline import roofline

    predicted = [
        roofline(row.flops, row.bytes_moved, row.dtype or dtype, gpu).attainable_flops / 1e12 for row in rows
    ]
    height = 0.4
    figure, axes = plt.subplots(figsize=(10, 1.0 + 0.45 * len(rows)))
    positions = list(range(len(rows)))
    axes.barh(
        [p + height / 2 for p in positions], predicted, height=height, color="none", edgecolor="C0",
        hatch="//", label=f"model's prediction for {gpu.name} (roofline)",
    )  # fmt: skip
    if any(value is not None for value in achieved):
        measured = [value / 1e12 if value is not None else 0.0 for value in achieved]
        axes.barh([p - height / 2 for p in positions], measured, height=height, color="C1", label="measured")
    axes.set_yticks(positions, labels, fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("TFLOP/s")
    axes.set_title(title, fontsize=9)
    # under the axes: out of the bars' way, not a third of the width beside them
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.6 / (1.0 + 0.45 * len(rows))), ncol=2,
                frameon=False)  # fmt: skip
    axes.grid(True, axis="x", linewidth=0.3)
    figure.tight_layout()
    figure.savefig(Path(path), dpi=120, bbox_inches="tight")
    plt.close(figure)
