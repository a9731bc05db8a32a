"""Roofline plots a person reads at a glance, checked on the figure's structure (no image comparison)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from llm_speed.bench import plots, report  # noqa: E402
from llm_speed.bench.timing import HOST_TIMER, summarize  # noqa: E402
from llm_speed.core.gpus import get_gpu  # noqa: E402
from llm_speed.perf.plot import PlotPoint, roofline_figure  # noqa: E402
from llm_speed.perf.roofline import roofline  # noqa: E402

# The demo's CPU plot: flash and SDPA share a point, GEMMs sit beside attention near the ridge, and a
# bf16 run's fp8 attention (all at H100 predictions).
ATTENTION = 4 * 4 * 128 * 128 * 32 / 2
POINTS = [
    PlotPoint("seq=128 [flash, sdpa]", ATTENTION, 2 * 4 * 128 * 32 * 2),
    PlotPoint("seq=128 [tiled]", ATTENTION, 4 * 4 * 128 * 32 * 2),
    PlotPoint("seq=128 [naive]", ATTENTION, 4 * 4 * 128 * 128 * 2),
    PlotPoint("128x128x128 [llm-speed, torch]", 2 * 128**3, 3 * 128 * 128 * 2),
    PlotPoint("256x256x256 [llm-speed, torch]", 2 * 256**3, 3 * 256 * 256 * 2),
    PlotPoint("seq=128 [flash-fp8]", ATTENTION, 2 * 4 * 128 * 32 * 1.5, dtype="fp8"),
    PlotPoint("gemm measured", 2 * 4096**3, 3 * 4096**2 * 2, achieved_flops_per_s=6e14),
    PlotPoint("twin a", 2 * 1024**3, 3 * 1024**2 * 2),
    PlotPoint("twin b", 2 * 1024**3, 3 * 1024**2 * 2),  # exactly on top of twin a
    PlotPoint("fp8 gemm", 2 * 4096**3, 3 * 4096**2, dtype="fp8"),  # compute-bound: above the bf16 peak
]


@pytest.fixture
def figure():
    figure = roofline_figure("h100-sxm", POINTS, dtype="bf16", title="readability")
    figure.canvas.draw()
    yield figure
    plt.close(figure)


def _by_gid(figure, prefix):
    axes = figure.axes[0]
    artists = [*axes.get_lines(), *axes.texts]
    return {str(a.get_gid()): a for a in artists if str(a.get_gid()).startswith(prefix)}


def test_each_point_sits_under_its_own_dtype_s_roof(figure):
    spec = get_gpu("h100-sxm")
    roofs = _by_gid(figure, "roof ")
    assert set(roofs) == {"roof bf16", "roof fp8"}
    assert max(roofs["roof fp8"].get_ydata()) == pytest.approx(spec.peak_flops("fp8") / 1e12)
    assert max(roofs["roof bf16"].get_ydata()) == pytest.approx(spec.peak_flops("bf16") / 1e12)
    markers = _by_gid(figure, "point ")
    for index, point in enumerate(POINTS):
        (y,) = markers[f"point {index}"].get_ydata()
        own = point.dtype or "bf16"
        roof = roofline(point.flops, point.bytes_moved, own, spec).attainable_flops
        expected = point.achieved_flops_per_s or roof
        assert y == pytest.approx(expected / 1e12), point.label
    # drawn against the plot's bf16 roof, the fp8 GEMM would sit at the bf16 peak: half its own
    (fp8_y,) = markers[f"point {len(POINTS) - 1}"].get_ydata()
    assert fp8_y == pytest.approx(spec.peak_flops("fp8") / 1e12) and fp8_y > spec.peak_flops("bf16") / 1e12


def test_the_legend_is_outside_the_axes(figure):
    axes = figure.axes[0]
    renderer = figure.canvas.get_renderer()
    legend = axes.get_legend().get_window_extent(renderer)
    assert not legend.overlaps(axes.get_window_extent(renderer))
    # and no wider than the figure: it does not take a third of the width beside the plot
    assert legend.width <= figure.get_window_extent(renderer).width


def test_every_point_is_labelled_once_and_no_label_covers_another_or_a_marker(figure):
    labels = _by_gid(figure, "label ")
    named = [int(i) for gid in labels for i in gid.split()[1:]]
    assert sorted(named) == list(range(len(POINTS)))
    for gid, text in labels.items():
        for i in gid.split()[1:]:
            assert POINTS[int(i)].label in text.get_text()
    renderer = figure.canvas.get_renderer()
    boxes = {gid: text.get_window_extent(renderer) for gid, text in labels.items()}
    gids = list(boxes)
    for i, first in enumerate(gids):
        for second in gids[i + 1 :]:
            assert not boxes[first].overlaps(boxes[second]), (first, second)
    for marker in _by_gid(figure, "point ").values():
        assert not any(box.overlaps(marker.get_window_extent(renderer)) for box in boxes.values())


def test_markers_on_top_of_each_other_are_drawn_apart(figure):
    renderer = figure.canvas.get_renderer()
    markers = _by_gid(figure, "point ")
    a, b = (markers[f"point {i}"].get_window_extent(renderer) for i in (7, 8))
    assert a.width > 0 and (a.x0, a.y0) != (b.x0, b.y0)


def test_predictions_are_hollow_measurements_filled_and_the_legend_says_so(figure):
    markers = _by_gid(figure, "point ")
    for index, point in enumerate(POINTS):
        face = markers[f"point {index}"].get_markerfacecolor()
        assert (face == "none") == (point.achieved_flops_per_s is None), point.label
    texts = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert any("predicted" in text for text in texts) and "measured" in texts


def test_a_bench_plot_puts_an_fp8_row_under_the_fp8_roof(tmp_path, monkeypatch):
    drawn = {}

    def capture(gpu, points, path, *, dtype, title):
        drawn.update(points=points, dtype=dtype)
        return path

    monkeypatch.setattr("llm_speed.perf.plot.plot_roofline", capture)
    rows = [
        report.Measurement(case="seq=128", impl=impl, available=True, flops=ATTENTION, bytes_moved=moved,
                           dtype=dtype, timing=summarize([1.0], HOST_TIMER))
        for impl, moved, dtype in (("flash", 4096.0, None), ("flash-fp8", 3072.0, "fp8"))
    ]  # fmt: skip
    plots.plot_rows(rows, tmp_path / "r.png", device=torch.device("cpu"), dtype="bf16", title="t",
                    console=report.output_console())  # fmt: skip
    assert drawn["dtype"] == "bf16" and [p.dtype for p in drawn["points"]] == [None, "fp8"]


def test_the_bar_chart_legend_is_under_the_bars_and_names_the_predictions(tmp_path, monkeypatch):
    kept = []
    monkeypatch.setattr(plt, "close", kept.append)  # keep the figure to look at it
    rows = [
        report.Measurement(case=name, impl="torch", available=True, flops=2 * 16 * 4096 * 4096,
                           bytes_moved=2 * (2 * 16 * 4096 + 4096 * 4096), timing=summarize([1.0], HOST_TIMER))
        for name in ("qkv", "o", "gate_up", "down")
    ]  # fmt: skip
    assert plots.plot_rows(rows, tmp_path / "bars.png", device=torch.device("cpu"), dtype="bf16", title="t",
                           console=report.output_console())  # fmt: skip
    (figure,) = kept
    axes = figure.axes[0]
    renderer = figure.canvas.get_renderer()
    legend = axes.get_legend()
    assert not legend.get_window_extent(renderer).overlaps(axes.get_window_extent(renderer))
    assert any("prediction" in text.get_text() for text in legend.get_texts())
    monkeypatch.undo()
    plt.close(figure)
