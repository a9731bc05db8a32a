"""The GPU spec table: dense peaks, aliases, ridge points against independently published figures."""

import math

import pytest
import torch

from llm_speed.core.gpus import GPUSpec, detect_gpu, dtype_bytes, get_gpu, list_gpus, live_device_properties

REQUIRED_IDS = {
    "a100-sxm-40gb", "a100-sxm-80gb", "a100-pcie-40gb", "a100-pcie-80gb", "h100-sxm", "h100-pcie", "h200",
    "b200", "l40s", "l4", "rtx-4090",
}
ALL_DTYPES = {"fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8"}


def test_table_covers_required_gpus_with_sources():
    gpus = list_gpus()
    assert REQUIRED_IDS <= {gpu.id for gpu in gpus}
    for gpu in gpus:
        assert set(gpu.peak_tflops) <= ALL_DTYPES
        assert all(value > 0 for value in gpu.peak_tflops.values()), gpu.id
        for name in ("peak_tflops", "hbm_capacity_gb", "hbm_bandwidth_gbs", "sm_count", "boost_clock_mhz",
                     "l2_cache_mb", "smem_per_sm_kb", "register_file_per_sm_kb", "nvlink_bandwidth_gbs",
                     "pcie_bandwidth_gbs"):
            assert gpu.sources.get(name), f"{gpu.id}: no source for {name}"
        assert gpu.sm_count > 0 and gpu.hbm_bandwidth_gbs > 0 and gpu.l2_cache_mb > 0


@pytest.mark.parametrize(
    ("gpu_id", "dtype", "dense_tflops"),
    [
        # Dense = datasheet sparse figure / 2 (A100: 624*, H100 PCIe: 1513*, B200 4.5 PF*); H100 SXM/H200: the
        # H100 whitepaper's exact dense figures (989.4 / 1978.9; the datasheets round them to 989 / 1,979).
        ("a100-sxm-80gb", "bf16", 312.0),
        ("a100-pcie-40gb", "tf32", 156.0),
        ("a100-sxm-80gb", "int8", 624.0),
        ("h100-sxm", "fp16", 989.4),
        ("h100-sxm", "fp8", 1978.9),
        ("h100-pcie", "bf16", 756.5),
        ("h200", "bf16", 989.4),
        ("h200", "fp8", 1978.9),
        ("b200", "bf16", 2250.0),
        ("l40s", "fp16", 362.05),
        ("l4", "bf16", 121.0),
        ("rtx-4090", "fp16", 165.2),
    ],
)
def test_dense_peaks_are_half_the_sparse_marketing_figures(gpu_id, dtype, dense_tflops):
    assert get_gpu(gpu_id).peak_flops(dtype) == pytest.approx(dense_tflops * 1e12)


@pytest.mark.parametrize(
    ("gpu_id", "ridge"),
    [
        # Independently computed from the datasheets: peak / bandwidth.
        ("a100-sxm-80gb", 312e12 / 2039e9),  # ~153 FLOP/byte
        ("a100-sxm-40gb", 312e12 / 1555e9),  # ~201 FLOP/byte
        ("h100-sxm", 989.4e12 / 3.35e12),  # ~295 FLOP/byte (seed 003: 989 / 3.35 = 295)
        ("h200", 989.4e12 / 4.8e12),  # ~206 FLOP/byte
    ],
)
def test_ridge_points(gpu_id, ridge):
    assert get_gpu(gpu_id).ridge_point("bf16") == pytest.approx(ridge)


def test_seed_003_h100_ridge_point_is_295():
    assert round(get_gpu("h100-sxm").ridge_point("fp16")) == 295


def test_fp32_is_the_cuda_core_peak_and_tf32_its_own_key():
    h100 = get_gpu("h100-sxm")
    assert h100.peak_flops(torch.float32) == h100.peak_flops("fp32") == pytest.approx(66.9e12)
    assert h100.peak_flops("tf32") == 494.7e12
    assert h100.peak_flops(torch.bfloat16) == h100.peak_flops("bfloat16")
    assert h100.peak_flops(torch.float16) == h100.peak_flops("half")


def test_missing_dtype_is_absent_and_raises_naming_the_accepted_ones():
    a100 = get_gpu("a100")
    assert "fp8" not in a100.peak_tflops
    with pytest.raises(ValueError, match="fp8.*accepted dtypes: fp64, fp32"):
        a100.peak_flops("fp8")
    with pytest.raises(ValueError, match="not understood; accepted"):
        a100.peak_flops("float13")


@pytest.mark.parametrize(
    ("alias", "gpu_id"),
    [
        ("H100", "h100-sxm"), ("h100_sxm5", "h100-sxm"), ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("H100 PCIe", "h100-pcie"), ("NVIDIA A100-SXM4-80GB", "a100-sxm-80gb"), ("A100", "a100-sxm-80gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-pcie-40gb"), ("NVIDIA H200", "h200"), ("B200", "b200"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("L40S", "l40s"), ("nvidia l4", "l4"),
    ],
)
def test_forgiving_aliases(alias, gpu_id):
    assert get_gpu(alias).id == gpu_id


def test_unknown_gpu_lists_valid_ids():
    with pytest.raises(ValueError, match="unknown GPU 'v100'.*valid ids: .*h100-sxm"):
        get_gpu("v100")
    with pytest.raises(TypeError):
        get_gpu(100)
    spec = get_gpu("h200")
    assert get_gpu(spec) is spec and isinstance(spec, GPUSpec)
    assert {spec: 1}[get_gpu("H200")] == 1  # hashable, usable as a cache key


def test_units_and_link_directions():
    h100 = get_gpu("h100-sxm")
    assert h100.memory_bandwidth == 3.35e12
    assert h100.nvlink_unidirectional_bytes_per_s() == 450e9
    l4 = get_gpu("l4")
    assert l4.nvlink_bandwidth_gbs is None and l4.nvlink_unidirectional_bytes_per_s() is None
    assert dtype_bytes("bf16") == 2 and dtype_bytes(torch.float32) == 4 and dtype_bytes("int4") == 0.5


def test_live_device_matches_the_table_when_a_gpu_is_present():
    if not torch.cuda.is_available():
        assert detect_gpu() is None and live_device_properties() is None
        return
    live = live_device_properties()
    spec = detect_gpu()
    assert live is not None and live["sm_count"] > 0
    if spec is not None:
        assert live["table_id"] == spec.id
        assert live["sm_count"] == spec.sm_count
        assert math.isclose(live["l2_cache_mb"], spec.l2_cache_mb, rel_tol=0.05)
        if "memory_bandwidth_gbs" in live:
            assert math.isclose(live["memory_bandwidth_gbs"], spec.hbm_bandwidth_gbs, rel_tol=0.05)


def test_h100_nvl_clock_agrees_with_its_fp32_peak():
    """The NVL's datasheet FP32 peak (60 TFLOP/s) at 132 SMs x 128 lanes x 2 FLOP is 1,776 MHz; the SXM5's
    1980 carried over gave 66.9 (audit of 2026-12-07), and the model derived 114.8 FP32 lanes per SM."""
    from llm_speed.core.gpus import get_gpu

    nvl = get_gpu("h100-nvl")
    assert nvl.sm_count * 128 * 2 * nvl.boost_clock_mhz * 1e6 == pytest.approx(nvl.peak_tflops["fp32"] * 1e12,
                                                                             rel=2e-3)  # fmt: skip
