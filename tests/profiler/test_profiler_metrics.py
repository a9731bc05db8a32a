"""llm_speed.profiler: real figures where measurable, None with a reason where not, roofline bottlenecks."""

from __future__ import annotations

import time

import pytest
import torch

import cuda_llm_ops
from llm_speed import profiler as prof
from llm_speed.bench.timing import CUDA_TIMER, HOST_TIMER
from llm_speed.core.gpus import get_gpu
from llm_speed.perf.kernel_costs import attention_cost, gemm_cost

H100 = get_gpu("h100-sxm")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def sleeper(ms: float):
    def run(*args, **kwargs):
        time.sleep(ms / 1e3)

    return run


def test_profile_block_with_recorded_calls_on_cpu():
    q = torch.randn(1, 2, 16, 16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    profiler = prof.CUDAProfiler("cpu")
    with profiler.profile("two calls"):
        cuda_llm_ops.flash_attention(q, k, v, 0.0, True)
        cuda_llm_ops.naive_attention(q, k, v)
    metrics = profiler.get_metrics()
    causal = attention_cost(1, 2, 16, 16, 16, dtype=torch.float32, causal=True, impl="flash")
    full = attention_cost(1, 2, 16, 16, 16, dtype=torch.float32, causal=False, impl="naive")
    assert metrics.name == "two calls" and metrics.timer == HOST_TIMER and metrics.iterations == 1
    assert metrics.flops == causal.flops + full.flops
    assert metrics.bytes_moved == causal.bytes_moved + full.bytes_moved
    assert metrics.elapsed_ms > 0
    assert metrics.tflops == pytest.approx(metrics.flops / (metrics.elapsed_ms * 1e-3) / 1e12)
    assert metrics.memory_bandwidth_gb == pytest.approx(
        metrics.bytes_moved / (metrics.elapsed_ms * 1e-3) / 1e9
    )
    assert metrics.arithmetic_intensity == pytest.approx(metrics.flops / metrics.bytes_moved)
    assert metrics.dtype == "fp32" and metrics.device == "cpu"
    # No GPU peaks on a CPU: None, each with the reason; never a 0.
    for field in ("compute_utilization", "bandwidth_utilization", "roofline_fraction", "bottleneck", "gpu"):
        assert getattr(metrics, field) is None
        assert "cpu" in metrics.unavailable[field]
    for field in ("sm_occupancy", "l2_hit_rate"):
        assert getattr(metrics, field) is None and "Nsight Compute" in metrics.unavailable[field]
    assert any("host clock" in note for note in metrics.notes)


def test_profile_block_without_cost_and_with_explicit_cost():
    profiler = prof.CUDAProfiler("cpu")
    with profiler.profile("opaque"):
        torch.randn(64, 64) @ torch.randn(64, 64)
    opaque = profiler.get_metrics("opaque")
    assert opaque.elapsed_ms > 0 and opaque.tflops is None and opaque.flops is None
    assert opaque.unavailable["tflops"] == prof.NO_COST_REASON
    with profiler.profile("declared", flops=2 * 64**3, bytes_moved=3 * 64 * 64 * 4, dtype=torch.float32):
        torch.randn(64, 64) @ torch.randn(64, 64)
    declared = profiler.get_metrics()
    assert declared.name == "declared" and declared.flops == 2 * 64**3 and declared.tflops > 0
    assert profiler.get_metrics("opaque") is opaque
    assert [m.name for m in profiler.history] == ["opaque", "declared"]


def test_profile_blocks_nest_and_failed_blocks_record_nothing():
    q = torch.randn(1, 1, 8, 16)
    profiler = prof.CUDAProfiler("cpu")
    with profiler.profile("outer"):
        cuda_llm_ops.naive_attention(q, q, q)
        with profiler.profile("inner"):
            cuda_llm_ops.naive_attention(q, q, q)
    single = attention_cost(1, 1, 8, 8, 16, dtype=torch.float32, impl="naive").flops
    assert profiler.get_metrics("inner").flops == single
    assert profiler.get_metrics("outer").flops == 2 * single
    with pytest.raises(ZeroDivisionError):
        with profiler.profile("broken"):
            raise ZeroDivisionError
    assert not prof.is_recording()
    with pytest.raises(ValueError, match="no metrics called 'broken'"):
        profiler.get_metrics("broken")
    with pytest.raises(ValueError, match="nothing profiled yet"):
        prof.CUDAProfiler("cpu").get_metrics()
    # Outside any block, calls report nothing and cost nothing.
    cuda_llm_ops.naive_attention(q, q, q)


def test_gemm_calls_report_their_cost():
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    profiler = prof.CUDAProfiler("cpu")
    with profiler.profile("gemm"):
        cuda_llm_ops.gemm(a, b)
        cuda_llm_ops.tensor_core_gemm(a.half(), b.half())
    expected = gemm_cost(16, 8, 32, dtype="fp32").bytes_moved
    expected += gemm_cost(16, 8, 32, dtype="fp16", out_dtype="fp32").bytes_moved
    metrics = profiler.get_metrics()
    assert metrics.flops == 2 * 2 * 16 * 8 * 32 and metrics.bytes_moved == expected
    assert metrics.dtype is None  # an fp32 and an fp16 call: no single peak would apply


def test_direct_calls_are_counted_once_through_the_launchers():
    """llm_speed's own functions report their cost from the Triton launchers; cuda_llm_ops adds nothing."""
    import llm_speed
    from llm_speed.core import runtime

    if not runtime.triton_runs_on(torch.device("cpu")):
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    q = torch.randn(1, 2, 16, 16)
    k, v = torch.randn(1, 1, 16, 16), torch.randn(1, 1, 16, 16)
    a, b = torch.randn(2, 16, 32), torch.randn(32, 8)
    a8, b8 = torch.randint(-8, 8, (16, 32), dtype=torch.int8), torch.randint(-8, 8, (32, 8), dtype=torch.int8)
    flash = attention_cost(1, 2, 16, 16, 16, heads_kv=1, dtype=torch.float32, causal=True, impl="flash")
    tiled = attention_cost(1, 2, 16, 16, 16, heads_kv=1, dtype=torch.float32, impl="tiled")
    batched = gemm_cost(16, 8, 32, dtype="fp32", batch=2)
    int8 = gemm_cost(16, 8, 32, dtype="int8", out_dtype="fp32")
    profiler = prof.CUDAProfiler("cpu")
    with profiler.profile("direct"):
        llm_speed.flash_attention(q, k, v, is_causal=True)
        llm_speed.tiled_attention(q, k, v)
        llm_speed.gemm(a, b)
        llm_speed.tensor_core_gemm_int8(a8, b8)
    with profiler.profile("old api"):
        cuda_llm_ops.flash_attention(q, k, v, 0.0, True)
        cuda_llm_ops.tiled_attention(q, k, v)
        cuda_llm_ops.gemm(a, b)
        cuda_llm_ops.tensor_core_gemm_int8(a8, b8)
    for name in ("direct", "old api"):
        metrics = profiler.get_metrics(name)
        assert metrics.flops == flash.flops + tiled.flops + batched.flops + int8.flops, name
        assert metrics.bytes_moved == (
            flash.bytes_moved + tiled.bytes_moved + batched.bytes_moved + int8.bytes_moved
        ), name
        assert metrics.tflops is not None and metrics.memory_bandwidth_gb is not None


def test_backward_launches_add_the_backward_cost():
    import llm_speed
    from llm_speed.core import runtime

    if not runtime.triton_runs_on(torch.device("cpu")):
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)")
    q, k, v = (torch.randn(1, 1, 16, 16, requires_grad=True) for _ in range(3))
    profiler = prof.CUDAProfiler("cpu")
    with profiler.profile("train step"):
        llm_speed.flash_attention(q, k, v).sum().backward()
    forward = attention_cost(1, 1, 16, 16, 16, dtype=torch.float32, mode="fwd", impl="flash")
    backward = attention_cost(1, 1, 16, 16, 16, dtype=torch.float32, mode="bwd", impl="flash")
    metrics = profiler.get_metrics()
    assert metrics.flops == forward.flops + backward.flops
    assert metrics.bytes_moved == forward.bytes_moved + backward.bytes_moved


def test_fallback_paths_are_reported_by_the_wrappers(monkeypatch):
    """Where no Triton kernel runs (a CPU without the interpreter), cuda_llm_ops reports the cost itself."""
    from llm_speed.core import runtime

    monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    q = torch.randn(1, 2, 16, 16)
    a, b = torch.randn(16, 32), torch.randn(32, 8)
    profiler = prof.CUDAProfiler("cpu")
    with profiler.profile("fallbacks"):
        cuda_llm_ops.flash_attention(q, q, q)
        cuda_llm_ops.gemm(a, b)
    expected = attention_cost(1, 2, 16, 16, 16, dtype=torch.float32, impl="flash")
    metrics = profiler.get_metrics()
    assert metrics.flops == expected.flops + gemm_cost(16, 8, 32, dtype="fp32").flops


def test_naive_attention_is_costed_with_fp32_scores():
    q = torch.randn(1, 2, 16, 16, dtype=torch.float16)
    profiler = prof.CUDAProfiler("cpu")
    with profiler.profile("naive"):
        cuda_llm_ops.naive_attention(q, q, q)
    expected = attention_cost(1, 2, 16, 16, 16, dtype="fp16", impl="naive", score_dtype="fp32")
    assert expected.bytes_moved > attention_cost(1, 2, 16, 16, 16, dtype="fp16", impl="naive").bytes_moved
    assert profiler.get_metrics().bytes_moved == expected.bytes_moved
    metrics = profiler.profile_attention(
        cuda_llm_ops.naive_attention, 1, 2, 16, 16, dtype=torch.float16, warmup=0, iterations=1, impl="naive"
    )
    assert metrics.bytes_moved == expected.bytes_moved


def test_kernel_metrics_against_gpu_peaks(monkeypatch):
    monkeypatch.setattr(prof, "_gpu_spec", lambda device: (H100, None))
    device = torch.device("cuda")
    # A GEMM-like problem far right of the ridge, running at half the roofline speed: compute-bound.
    flops, bytes_moved = 2 * 4096.0**3, 3 * 4096 * 4096 * 2.0
    floor_s = max(flops / H100.peak_flops("fp16"), bytes_moved / H100.memory_bandwidth)
    metrics = prof.kernel_metrics(
        2 * floor_s * 1e3,
        flops=flops,
        bytes_moved=bytes_moved,
        dtype=torch.float16,
        device=device,
        timer=CUDA_TIMER,
        iterations=10,
        name="gemm",
    )
    assert metrics.bottleneck is prof.Bottleneck.COMPUTE_BOUND and metrics.gpu == "h100-sxm"
    assert metrics.roofline_fraction == pytest.approx(0.5)
    assert metrics.compute_utilization == pytest.approx(0.5)
    assert metrics.bandwidth_utilization == pytest.approx(bytes_moved / (2 * floor_s) / H100.memory_bandwidth)
    # A copy-like problem (intensity 0.25) at 80% of its floor: memory-bound.
    flops, bytes_moved = 1e9, 4e9
    floor_ms = bytes_moved / H100.memory_bandwidth * 1e3
    metrics = prof.kernel_metrics(
        floor_ms / 0.8,
        flops=flops,
        bytes_moved=bytes_moved,
        dtype="bf16",
        device=device,
        timer=CUDA_TIMER,
        iterations=10,
    )
    assert metrics.bottleneck is prof.Bottleneck.MEMORY_BOUND
    assert metrics.bandwidth_utilization == pytest.approx(0.8)
    # The same work taking 20x its floor keeps neither unit busy: latency-bound.
    metrics = prof.kernel_metrics(
        20 * floor_ms,
        flops=flops,
        bytes_moved=bytes_moved,
        dtype="bf16",
        device=device,
        timer=CUDA_TIMER,
        iterations=10,
    )
    assert metrics.bottleneck is prof.Bottleneck.LATENCY_BOUND
    assert metrics.roofline_fraction == pytest.approx(0.05)
    # A dtype without a peak on this GPU, or mixed dtypes: utilisation None with the reason.
    metrics = prof.kernel_metrics(
        1.0, flops=flops, bytes_moved=bytes_moved, dtype="int4", device=device, timer=CUDA_TIMER, iterations=1
    )
    assert (
        metrics.compute_utilization is None
        and "no peak for int4" in metrics.unavailable["compute_utilization"]
    )
    assert metrics.bandwidth_utilization is not None and metrics.bottleneck is None
    metrics = prof.kernel_metrics(
        1.0, flops=flops, bytes_moved=bytes_moved, dtype=None, device=device, timer=CUDA_TIMER, iterations=1
    )
    assert "several dtypes" in metrics.unavailable["compute_utilization"]


def test_zero_time_gives_no_rates():
    metrics = prof.kernel_metrics(
        0.0,
        flops=1e6,
        bytes_moved=1e6,
        dtype="fp16",
        device=torch.device("cpu"),
        timer=HOST_TIMER,
        iterations=1,
    )
    assert metrics.tflops is None and "0.0 ms" in metrics.unavailable["tflops"]


def test_profile_attention_and_gemm_on_cpu():
    profiler = prof.CUDAProfiler("cpu")
    metrics = profiler.profile_attention(
        cuda_llm_ops.naive_attention, 1, 2, 16, 16, torch.float32, 1, 3, is_causal=True, impl="naive"
    )
    cost = attention_cost(1, 2, 16, 16, 16, dtype="fp32", causal=True, impl="naive")
    assert metrics.name == "naive_attention" and metrics.flops == cost.flops and metrics.iterations == 3
    assert metrics.elapsed_ms == profiler.last_timing.median_ms and metrics.tflops > 0
    metrics = profiler.profile_gemm(cuda_llm_ops.tensor_core_gemm, 16, 8, 32, torch.float16, 1, 3)
    assert metrics.bytes_moved == gemm_cost(16, 8, 32, dtype="fp16", out_dtype="fp32").bytes_moved
    metrics = profiler.profile_gemm(cuda_llm_ops.tensor_core_gemm_int8, 16, 8, 32, torch.int8, 1, 2)
    assert metrics.dtype == "int8" and metrics.tflops > 0
    assert metrics.bytes_moved == 16 * 32 + 32 * 8 + 16 * 8 * 4  # int8 in, int32 out
    assert profiler.get_metrics() is metrics
    with pytest.raises(ValueError, match="seq_len must be a positive int, got 0"):
        profiler.profile_attention(cuda_llm_ops.naive_attention, 1, 2, 0, 16)
    with pytest.raises(ValueError, match="iterations"):
        profiler.measure_time(sleeper(0), iterations=0)
    with pytest.raises(TypeError, match="func"):
        profiler.measure_time("not callable")


def test_measure_time_and_compare_with_reference():
    profiler = prof.CUDAProfiler("cpu")  # the host timer: a GPU's would time the sleep's launches only
    assert profiler.measure_time(sleeper(2), warmup=0, iterations=3) >= 2
    assert profiler.last_timing.iterations == 3 and profiler.last_timing.timer == HOST_TIMER
    result = profiler.compare_with_reference(sleeper(1), sleeper(10), torch.zeros(1), warmup=0, iterations=3)
    assert result["reference_ms"] >= 10 and result["custom_ms"] >= 1
    assert result["speedup"] == pytest.approx(result["reference_ms"] / result["custom_ms"])
    assert result["relative_perf"] == pytest.approx(1 / result["speedup"])
    assert result["speedup"] > 1 and result["timer"] == HOST_TIMER


def test_old_benchmark_functions_and_printout(capsys):
    from cuda_llm_ops.profiler import benchmark_attention, benchmark_gemm, print_benchmark_results

    rows = benchmark_attention([16], 1, 1, 16, torch.float32, warmup=0, iterations=2, device="cpu")
    assert list(rows[0]) == [
        "seq_len",
        "custom_ms",
        "custom_tflops",
        "reference_ms",
        "reference_tflops",
        "speedup",
        "bottleneck",
    ]
    assert rows[0]["bottleneck"] is None and rows[0]["custom_tflops"] > 0
    gemm_rows = benchmark_gemm([(16, 16, 16)], torch.float32, warmup=0, iterations=2, device="cpu")
    assert gemm_rows[0]["relative_perf"] > 0
    print_benchmark_results(rows + gemm_rows, title="CPU")
    printed = capsys.readouterr().out
    assert "CPU".center(60) in printed and "Speedup: " in printed and "% of cuBLAS" in printed
    assert "Bottleneck: unknown" in printed


@pytest.mark.gpu
@needs_cuda
def test_profile_block_on_gpu_has_every_figure():
    q = torch.randn(2, 8, 1024, 64, device="cuda", dtype=torch.float16)
    cuda_llm_ops.flash_attention(q, q, q)
    profiler = prof.CUDAProfiler()
    with profiler.profile("flash"):
        cuda_llm_ops.flash_attention(q, q, q)
    metrics = profiler.get_metrics()
    assert metrics.timer == CUDA_TIMER and metrics.elapsed_ms > 0
    # Counted once (by the launcher), not again by the cuda_llm_ops wrapper.
    assert metrics.flops == attention_cost(2, 8, 1024, 1024, 64, dtype="fp16").flops
    if metrics.gpu is not None:
        assert 0 < metrics.compute_utilization < 1 and 0 < metrics.bandwidth_utilization < 1.5
        assert isinstance(metrics.bottleneck, prof.Bottleneck)
    metrics = profiler.profile_attention(cuda_llm_ops.flash_attention, 2, 8, 1024, 64)
    assert metrics.timer == CUDA_TIMER and metrics.tflops > 0


# --- bad arguments: an error naming the argument and what is accepted, before any work ----------------------


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"flops": -1.0}, ValueError, r"flops must be >= 0"),
        ({"flops": float("nan")}, ValueError, r"flops must be finite, got nan"),
        ({"flops": float("inf")}, ValueError, r"flops must be finite"),
        ({"flops": "abc"}, TypeError, r"flops must be a real number, got str 'abc' \(or None"),
        ({"flops": True}, TypeError, r"flops must be a real number, got bool"),
        ({"bytes_moved": -5.0}, ValueError, r"bytes_moved must be >= 0"),
        ({"bytes_moved": float("nan")}, ValueError, r"bytes_moved must be finite"),
        ({"bytes_moved": [1]}, TypeError, r"bytes_moved must be a real number"),
        ({"dtype": "nonsense"}, ValueError, r"dtype 'nonsense' is not understood; accepted: "),
    ],
)
def test_profile_refuses_bad_cost_before_the_block_runs(kwargs, error, match):
    profiler = prof.CUDAProfiler("cpu")
    ran = []
    with pytest.raises(error, match=match):
        with profiler.profile("bad", **kwargs):
            ran.append(True)
    assert not ran and not profiler.history and not prof.is_recording()


def test_profile_accepts_zero_ints_and_numpy_costs():
    np = pytest.importorskip("numpy", reason="NumPy scalars need numpy")
    profiler = prof.CUDAProfiler("cpu")
    with profiler.profile("zero", flops=0, bytes_moved=np.float32(1024.0), dtype="fp32"):
        torch.zeros(4) + 1
    metrics = profiler.get_metrics()
    assert metrics.flops == 0.0 and metrics.bytes_moved == 1024.0 and metrics.tflops == 0.0
    assert type(metrics.flops) is float and type(metrics.bytes_moved) is float


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "fp8", "int8", "nonsense", None, 16])
def test_profile_attention_refuses_other_dtypes(dtype):
    calls = []
    accepted = r"dtype: expected one of float16, bfloat16, float32 \(a torch.dtype, or its name: "
    with pytest.raises(TypeError, match=accepted + r"'fp16', 'bf16', 'fp32'\), got "):
        prof.CUDAProfiler("cpu").profile_attention(
            lambda *a, **k: calls.append(a), 1, 2, 8, 16, dtype=dtype, warmup=0, iterations=1
        )
    assert not calls


@pytest.mark.parametrize("dtype", [torch.float64, "fp8", "nonsense", None])
def test_profile_gemm_refuses_other_dtypes(dtype):
    calls = []
    accepted = r"dtype: expected one of float16, bfloat16, float32, int8 \(a torch.dtype, or its name: "
    with pytest.raises(TypeError, match=accepted + r"'fp16', 'bf16', 'fp32', 'int8'\), got "):
        prof.CUDAProfiler("cpu").profile_gemm(lambda a, b: calls.append(a), 8, 8, 8, dtype=dtype, warmup=0,
                                              iterations=1)  # fmt: skip
    with pytest.raises(TypeError, match="out_dtype: expected None or a torch.dtype, got 'fp32'"):
        prof.CUDAProfiler("cpu").profile_gemm(torch.matmul, 8, 8, 8, out_dtype="fp32", warmup=0, iterations=1)
    assert not calls


def test_profile_gemm_takes_the_profilers_dtype_names():
    profiler = prof.CUDAProfiler("cpu")
    metrics = profiler.profile_gemm(torch.matmul, 8, 8, 8, dtype="fp32", warmup=0, iterations=1)
    assert metrics.dtype == "fp32" and metrics.flops == 2 * 8 * 8 * 8


def test_profile_attention_takes_the_profilers_dtype_names():
    profiler = prof.CUDAProfiler("cpu")
    common = dict(warmup=0, iterations=1, impl="naive")
    by_name = profiler.profile_attention(cuda_llm_ops.naive_attention, 1, 2, 8, 16, dtype="fp16", **common)
    by_dtype = profiler.profile_attention(cuda_llm_ops.naive_attention, 1, 2, 8, 16, torch.float16, **common)
    assert by_name.dtype == by_dtype.dtype == "fp16"
    assert (by_name.flops, by_name.bytes_moved) == (by_dtype.flops, by_dtype.bytes_moved)
    long_name = profiler.profile_attention(cuda_llm_ops.naive_attention, 1, 2, 8, 16, "bfloat16", **common)
    assert long_name.dtype == "bf16"


@pytest.mark.parametrize("method", ["profile_gemm", "profile_attention"])
def test_profile_gemm_and_attention_check_func_and_counts_first(method):
    profiler = prof.CUDAProfiler("cpu")
    sizes = (8, 8, 8) if method == "profile_gemm" else (1, 2, 8, 16)
    with pytest.raises(TypeError, match=r"^func: expected a callable, got NoneType$"):
        getattr(profiler, method)(None, *sizes, torch.float32, 0, 1)
    calls = []
    for kwargs, match in (({"iterations": 0}, "iterations must be a positive int"),
                          ({"warmup": -1}, r"warmup must be an int >= 0")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            getattr(profiler, method)(lambda *a, **k: calls.append(a), *sizes, torch.float32, **kwargs)
    assert not calls and not profiler.history


@pytest.mark.parametrize(
    ("device", "error", "match"),
    [
        (5, TypeError, r"device: expected None, 'cpu', 'cuda' or 'cuda:N' .*got int 5 \(for CUDA device 5 "
         r"pass 'cuda:5'\)"),
        (True, TypeError, r"device: expected .*got bool True"),
        (0.0, TypeError, r"device: expected .*got float 0.0"),
        ("bogus", ValueError, r"device: expected None, 'cpu', 'cuda' or 'cuda:N' .*got 'bogus'"),
        ("cuda:x", ValueError, r"device: expected .*got 'cuda:x'"),
        ("meta", ValueError, r"device: expected .*got 'meta'"),
        (torch.device("meta"), ValueError, r"device: expected .*got device\(type='meta'\)"),
    ],
)
def test_profiler_refuses_other_devices_at_construction(device, error, match):
    with pytest.raises(error, match=match):
        prof.CUDAProfiler(device)


def test_profiler_device_spellings_still_accepted():
    assert prof.CUDAProfiler("cpu").device == torch.device("cpu")
    assert prof.CUDAProfiler(torch.device("cpu")).device == torch.device("cpu")
    prof.CUDAProfiler("cuda:0")  # whether a GPU is visible is asked on first use, not at construction
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: cuda was requested but no CUDA device is visible"):
            _ = prof.CUDAProfiler("cuda").device
