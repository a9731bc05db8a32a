"""Roofline placement against hand-computed figures (seed 003's H100 numbers)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llm_speed.core.gpus import get_gpu, list_gpus
from llm_speed.perf.roofline import arithmetic_intensity, roofline


def test_seed_003_h100_memory_and_compute_bound_examples():
    # Seed 003: H100 SXM, 989 TFLOP/s fp16, 3.35 TB/s, ridge ~295 FLOP/byte.
    below = roofline(flops=100e9, bytes_moved=1e9, dtype="fp16", gpu="h100-sxm")  # I = 100 < 295
    assert below.bound == "memory"
    assert below.intensity == pytest.approx(100.0)
    assert below.attainable_flops == pytest.approx(3.35e12 * 100)
    assert below.time_floor_s == pytest.approx(1e9 / 3.35e12)
    above = roofline(flops=1000e9, bytes_moved=1e9, dtype="fp16", gpu=get_gpu("H100"))  # I = 1000 > 295
    assert above.bound == "compute"
    assert above.attainable_flops == pytest.approx(989.4e12)
    assert above.time_floor_s == pytest.approx(1000e9 / 989.4e12)
    assert above.ridge_point == pytest.approx(989.4 / 3.35)  # 295.34


def test_square_gemm_4096_is_compute_bound_on_h100():
    n = 4096
    point = roofline(2 * n**3, 3 * n * n * 2, "bf16", "h100-sxm")  # read A, B, write C once in bf16
    assert point.intensity == pytest.approx(2 * n / 6)
    assert point.bound == "compute"
    assert point.time_floor_s == pytest.approx(point.compute_time_s)
    assert point.memory_time_s < point.compute_time_s


def test_at_the_ridge_both_limits_agree():
    gpu = get_gpu("a100-sxm-80gb")
    ridge = gpu.ridge_point("bf16")
    point = roofline(ridge * 1e9, 1e9, "bf16", gpu)
    assert point.compute_time_s == pytest.approx(point.memory_time_s)
    assert point.attainable_flops == pytest.approx(gpu.peak_flops("bf16"))


def test_degenerate_and_bad_inputs():
    assert arithmetic_intensity(0, 0) == 0.0
    assert arithmetic_intensity(10, 0) == float("inf")
    assert roofline(10, 0, "bf16", "h100").bound == "compute"
    with pytest.raises(ValueError, match="flops"):
        roofline(-1, 10, "bf16", "h100")
    with pytest.raises(ValueError, match="bytes_moved"):
        roofline(1, -10, "bf16", "h100")
    with pytest.raises(ValueError, match="valid ids"):
        roofline(1, 1, "bf16", "tpu-v5")
    with pytest.raises(ValueError, match="dtype"):
        roofline(1, 1, "fp7", "h100")
    with pytest.raises(TypeError, match="flops"):
        roofline("1", 1, "bf16", "h100")


def test_plot_places_predicted_and_measured_points(tmp_path, monkeypatch):
    from llm_speed.perf.plot import PlotPoint, plot_roofline

    monkeypatch.chdir(tmp_path)  # a missing folder is created only inside the working directory

    points = [
        PlotPoint("gemv", 2 * 4096 * 4096, 4096 * 4096 * 2),
        PlotPoint("gemm", 2 * 4096**3, 6 * 4096**2, 5e14),
    ]
    path = plot_roofline("h200", points, tmp_path / "sub" / "roof.png", dtype="fp16", title="test")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="bytes_moved"):
        plot_roofline("h200", [PlotPoint("empty", 1.0, 0.0)], tmp_path / "x.png")
    with pytest.raises(ValueError, match="achieved_flops_per_s"):
        plot_roofline("h200", [PlotPoint("bad", 1.0, 1.0, -3.0)], tmp_path / "x.png")
    with pytest.raises(TypeError, match="PlotPoint"):
        plot_roofline("h200", [(1.0, 1.0)], tmp_path / "x.png")
    grouped = [PlotPoint(f"op{i}", 2e9 * (i + 1), 1e9, group=("prefill", "decode")[i % 2]) for i in range(20)]
    assert plot_roofline("h200", grouped, tmp_path / "grouped.png").stat().st_size > 0
    outside = tmp_path.parent / "llm-speed-no-such-folder" / "x.png"
    with pytest.raises(ValueError, match="does not exist"):
        plot_roofline("h200", points, outside)
    assert not outside.parent.exists()


@settings(max_examples=60, deadline=None)
@given(
    flops=st.floats(1.0, 1e18),
    bytes_moved=st.floats(1.0, 1e15),
    gpu=st.sampled_from([gpu.id for gpu in list_gpus() if "bf16" in gpu.peak_tflops]),  # T4 has no bf16
)
def test_roofline_invariants(flops, bytes_moved, gpu):
    point = roofline(flops, bytes_moved, "bf16", gpu)
    assert point.attainable_flops <= point.peak_flops * (1 + 1e-12)
    assert point.time_floor_s >= max(point.compute_time_s, point.memory_time_s) * (1 - 1e-12)
    # The time floor is the work done at the attainable rate.
    assert point.time_floor_s == pytest.approx(flops / point.attainable_flops)
    assert (point.bound == "memory") == (point.intensity < point.ridge_point)
