"""The benchmark harness on CPU tensors with tiny shapes: rows, derived figures, unavailability, JSON."""

import json
import math

import pytest
import torch

from llm_speed._output import to_jsonable
from llm_speed.bench import attention as attention_bench
from llm_speed.bench import gemm as gemm_bench
from llm_speed.bench import report
from llm_speed.bench.timing import HOST_TIMER, summarize
from llm_speed.core.runtime import INTERPRETED
from llm_speed.perf.kernel_costs import attention_cost, gemm_cost
from llm_speed.perf.roofline import roofline


def tiny_attention(**overrides) -> attention_bench.AttentionSettings:
    values = dict(
        seq_lengths=(16,),
        batch_size=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        dtype="fp32",
        causal=True,
        mode="fwd",
        impls=("flash", "naive", "sdpa-math", "sdpa-efficient", "flash_attn"),
        warmup=0,
        iterations=2,
        device="cpu",
    )
    values.update(overrides)
    return attention_bench.AttentionSettings(**values)


def tiny_gemm(**overrides) -> gemm_bench.GemmSettings:
    values = dict(
        cases=(gemm_bench.GemmCase("", 16, 24, 32),),
        dtype="fp32",
        layout="NT",
        epilogue="bias+relu",
        impls=("llm-speed", "torch"),
        warmup=0,
        iterations=2,
        device="cpu",
    )
    values.update(overrides)
    return gemm_bench.GemmSettings(**values)


def test_attention_rows_on_cpu():
    settings = tiny_attention()
    rows = attention_bench.run_attention(settings, show_progress=False)
    by_impl = {row.impl: row for row in rows}
    assert list(by_impl) == list(settings.impls)
    expected = attention_cost(
        1, 2, 16, 16, 16, heads_kv=1, dtype="fp32", causal=True, mode="fwd", impl="flash"
    )
    flash = by_impl["flash"]
    assert flash.available and flash.timing.timer == HOST_TIMER and flash.timing.iterations == 2
    assert flash.flops == expected.flops and flash.bytes_moved == expected.bytes_moved
    assert flash.tflops == pytest.approx(flash.flops / (flash.median_ms * 1e-3) / 1e12)
    assert flash.bandwidth_gb_s == pytest.approx(flash.bytes_moved / (flash.median_ms * 1e-3) / 1e9)
    # The math backend materialises the scores: it is costed like naive.
    assert by_impl["sdpa-math"].bytes_moved == by_impl["naive"].bytes_moved > flash.bytes_moved
    # On a CPU: no peak memory, no prediction, each with its reason, never a zero.
    assert flash.peak_memory_bytes is None and "CUDA" in flash.peak_memory_reason
    assert flash.predicted_ms is None and "CPU" in flash.prediction_reason
    assert flash.memory_saved_vs_naive_bytes is None
    # Refusals are rows with a reason, not crashes.
    assert not by_impl["sdpa-efficient"].available and by_impl["sdpa-efficient"].reason
    assert not by_impl["flash_attn"].available and "flash_attn" in by_impl["flash_attn"].reason
    # Speedups compare with the fastest other row that ran.
    ran = [r for r in rows if r.available]
    for row in ran:
        fastest = min((o for o in ran if o is not row), key=lambda o: o.median_ms)
        assert row.fastest_other == fastest.impl
        assert row.speedup_vs_fastest_other == pytest.approx(fastest.median_ms / row.median_ms)


@pytest.mark.skipif(
    not INTERPRETED, reason="proves the Triton kernel is what gets timed under the interpreter"
)
def test_attention_bench_times_the_triton_kernel_under_the_interpreter():
    from llm_speed.attention.flash import FORWARD
    from llm_speed.core.runtime import launch_count

    before = launch_count(FORWARD.name)
    attention_bench.run_attention(tiny_attention(impls=("flash",), iterations=1), show_progress=False)
    assert launch_count(FORWARD.name) > before


def test_attention_backward_modes_run():
    for mode in ("bwd", "fwd+bwd"):
        rows = attention_bench.run_attention(
            tiny_attention(mode=mode, impls=("naive", "sdpa-math"), iterations=1), show_progress=False
        )
        assert all(row.available for row in rows), [row.reason for row in rows]
        expected = attention_cost(
            1, 2, 16, 16, 16, heads_kv=1, dtype="fp32", causal=True, mode=mode, impl="naive"
        )
        assert rows[0].flops == expected.flops


def test_gemm_rows_on_cpu_with_epilogue_and_layout():
    rows = gemm_bench.run_gemm(tiny_gemm(), show_progress=False)
    ours, torch_row = rows
    assert ours.impl == "llm-speed" and torch_row.impl == "torch"
    assert all(row.available for row in rows), [row.reason for row in rows]
    assert ours.flops == gemm_cost(16, 24, 32, dtype="fp32", with_bias=True).flops
    assert ours.percent_of_baseline == pytest.approx(100 * torch_row.median_ms / ours.median_ms)
    assert torch_row.percent_of_baseline == pytest.approx(100.0)


def test_gemm_int8_against_int_mm():
    settings = tiny_gemm(
        dtype="int8",
        epilogue="none",
        layout="NN",
        impls=("llm-speed", "torch-int-mm"),
        cases=(gemm_bench.GemmCase("", 32, 32, 32),),
    )
    rows = gemm_bench.run_gemm(settings, show_progress=False)
    assert [row.impl for row in rows] == ["llm-speed", "torch-int-mm"]
    assert rows[0].available, rows[0].reason
    assert rows[0].bytes_moved == gemm_cost(32, 32, 32, dtype="int8", out_dtype="fp32").bytes_moved


def test_gemm_summary_geometric_mean():
    def row(impl, case, median, percent):
        return gemm_bench.GemmMeasurement(
            case=case,
            impl=impl,
            available=True,
            name="",
            m=1,
            n=1,
            k=1,
            count=2,
            flops=1.0,
            bytes_moved=1.0,
            timing=summarize([median], HOST_TIMER),
            percent_of_baseline=percent,
        )

    rows = [
        row("llm-speed", "a", 1.0, 50.0),
        row("llm-speed", "b", 2.0, 200.0),
        row("torch", "a", 1.0, 100.0),
    ]
    settings = tiny_gemm(impls=("llm-speed", "torch"))
    figures = gemm_bench.summary(settings, rows)["per_impl"]
    assert figures["llm-speed"]["geomean_percent_of_baseline"] == pytest.approx(100.0)  # sqrt(50 * 200)
    assert figures["llm-speed"]["weighted_total_ms"] == pytest.approx(2 * 1.0 + 2 * 2.0)


def test_prediction_and_speedup_from_the_roofline():
    rows = [
        report.Measurement(
            case="c",
            impl=impl,
            available=True,
            flops=2e12,
            bytes_moved=1e9,
            timing=summarize([ms], HOST_TIMER),
        )
        for impl, ms in (("a", 40.0), ("b", 10.0))
    ]
    rows.append(
        report.Measurement(
            case="c", impl="off", available=False, reason="refused", flops=2e12, bytes_moved=1e9
        )
    )
    report.add_comparisons(rows, "h100-sxm", "fp16", None)
    floor_ms = roofline(2e12, 1e9, "fp16", "h100-sxm").time_floor_s * 1e3
    assert rows[0].predicted_ms == pytest.approx(floor_ms) and rows[0].predicted_bound == "compute"
    assert rows[0].measured_over_predicted == pytest.approx(40.0 / floor_ms)
    assert (rows[0].fastest_other, rows[0].speedup_vs_fastest_other) == ("b", pytest.approx(0.25))
    assert (rows[1].fastest_other, rows[1].speedup_vs_fastest_other) == ("a", pytest.approx(4.0))
    assert rows[2].speedup_vs_fastest_other is None and rows[2].measured_over_predicted is None


def test_memory_saved_vs_naive_uses_measured_peaks_only():
    def row(impl, peak):
        return attention_bench.AttentionMeasurement(
            case="seq=8",
            impl=impl,
            available=True,
            seq_len=8,
            flops=1.0,
            bytes_moved=1.0,
            peak_memory_bytes=peak,
        )

    rows = [row("naive", 1000), row("flash", 300), row("tiled", None)]
    attention_bench.fill_memory_saved(rows)
    assert [r.memory_saved_vs_naive_bytes for r in rows] == [0, 700, None]
    without_naive = [row("flash", 300)]
    attention_bench.fill_memory_saved(without_naive)
    assert without_naive[0].memory_saved_vs_naive_bytes is None


def test_json_payload_has_provenance_and_every_figure():
    settings = tiny_gemm(iterations=1)
    rows = gemm_bench.run_gemm(settings, show_progress=False)
    payload = json.loads(json.dumps(to_jsonable(gemm_bench.results_payload(settings, rows)), allow_nan=False))
    environment = payload["environment"]
    for key in (
        "device_name",
        "compute_capability",
        "torch_version",
        "triton_version",
        "git_commit",
        "timestamp_utc",
        "triton_interpret",
    ):
        assert key in environment
    assert environment["torch_version"] == torch.__version__
    assert environment["git_commit"] or environment["git_commit_reason"]
    assert any("CPU timings" in note for note in payload["notes"])
    record = payload["results"][0]
    for key in (
        "timing",
        "tflops",
        "bandwidth_gb_s",
        "peak_memory_bytes",
        "peak_memory_reason",
        "predicted_ms",
        "prediction_reason",
        "speedup_vs_fastest_other",
        "percent_of_baseline",
        "latency_ms",
        "throughput_tflops",
        "config",
    ):
        assert key in record
    assert record["latency_ms"] == record["timing"]["median_ms"]
    assert record["config"] == "16x24x32"
    assert len(record["timing"]["times_ms"]) == 1
    assert payload["summary"]["baseline"] == "torch"


def test_git_commit_outside_a_checkout_is_none_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("LLM_SPEED_GIT_COMMIT", raising=False)  # the GPU suite sets it for a tree with no .git
    commit, reason = report.git_commit(tmp_path)
    assert commit is None and reason


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"dtype": "int8"}, "dtype"),
        ({"mode": "both"}, "mode"),
        ({"impls": ("fast",)}, "impl"),
        ({"num_kv_heads": 3}, "num_kv_heads"),
        ({"seq_lengths": ()}, "seq_lengths"),
        ({"head_dim": True}, "head_dim"),
        ({"warmup": -1}, "warmup"),
        ({"iterations": 0}, "iterations"),
        ({"min_time_s": -1.0}, "min_time_s"),
    ],
)
def test_attention_bad_settings_name_the_argument(change, argument):
    with pytest.raises(ValueError, match=argument):
        attention_bench.check_settings(tiny_attention(**change))


@pytest.mark.parametrize(
    ("change", "argument"),
    [
        ({"dtype": "fp4"}, "dtype"),
        ({"dtype": "fp8", "epilogue": "bias+relu"}, "epilogue"),
        ({"dtype": "fp8", "layout": "TN", "epilogue": "none"}, "layout"),
        ({"layout": "NX"}, "layout"),
        ({"epilogue": "bias+tanh"}, "epilogue"),
        ({"dtype": "int8", "epilogue": "bias"}, "epilogue"),
        ({"dtype": "int8", "epilogue": "none", "impls": ("torch",)}, "impl"),
        ({"warmup": -1}, "warmup"),
        ({"iterations": 0}, "iterations"),
    ],
)
def test_gemm_bad_settings_name_the_argument(change, argument):
    with pytest.raises(ValueError, match=argument):
        gemm_bench.check_settings(tiny_gemm(**change))


@pytest.mark.parametrize("text", ["1024x1024", "axbxc", "0x4x4", "4x4x4x4", ""])
def test_parse_size_rejects_malformed_sizes(text):
    with pytest.raises(ValueError, match="--sizes"):
        gemm_bench.parse_size(text)


def test_parse_size_accepts_the_seed_form():
    assert gemm_bench.parse_size("512x256X128") == (512, 256, 128)
    assert math.prod(gemm_bench.parse_size(" 2x3x4 ")) == 24


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_attention_and_gemm_on_the_gpu():
    from llm_speed.core.gpus import detect_gpu

    settings = tiny_attention(
        seq_lengths=(256,),
        head_dim=64,
        dtype="fp16",
        impls=("flash", "naive", "sdpa"),
        iterations=5,
        device="cuda",
    )
    rows = attention_bench.run_attention(settings, show_progress=False)
    assert all(row.available for row in rows), [row.reason for row in rows]
    for row in rows:
        assert row.timing.timer == "cuda-events" and row.timing.l2_flush_bytes > 0
        assert row.peak_memory_bytes > 0 and row.memory_saved_vs_naive_bytes is not None
        if detect_gpu() is not None:
            assert row.predicted_ms > 0 and row.measured_over_predicted > 0
    gemm_rows = gemm_bench.run_gemm(
        tiny_gemm(cases=(gemm_bench.GemmCase("", 256, 256, 256),), dtype="fp16", device="cuda"),
        show_progress=False,
    )
    assert all(row.available for row in gemm_rows), [row.reason for row in gemm_rows]
    assert gemm_rows[0].percent_of_baseline > 0


def test_git_commit_of_a_copy_inside_another_repository_is_none(tmp_path, monkeypatch):
    """A wheel installed in a venv inside the user's own repository (``project/.venv``, ignored) is in that
    work tree: its HEAD is the user's commit, not llm_speed's (audit 21)."""
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("git is not installed: the test makes a repository of its own")
    monkeypatch.delenv("LLM_SPEED_GIT_COMMIT", raising=False)

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True,
                       capture_output=True)  # fmt: skip

    git("init", "-q")
    (tmp_path / ".gitignore").write_text(".venv/\n")
    (tmp_path / "tracked").mkdir()
    (tmp_path / "tracked" / "a.py").write_text("x = 1\n")
    installed = tmp_path / ".venv" / "site-packages" / "llm_speed"
    installed.mkdir(parents=True)
    (installed / "report.py").write_text("x = 1\n")
    git("add", ".")
    git("commit", "-q", "-m", "user's project")
    commit, reason = report.git_commit(installed)
    assert commit is None and "another git work tree" in reason
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout
    assert report.git_commit(tmp_path / "tracked") == (head.strip(), None)
