"""A user's first hour with ``bench`` and the demo on a CPU: honest ratios, no lost results, fitting sizes."""

import csv
import dataclasses
import json

import pytest
import torch

from llm_speed import demo
from llm_speed.bench import cpu_budget, plots, report
from llm_speed.bench import gemm as gemm_bench
from llm_speed.bench.cli import attention_settings, gemm_settings
from llm_speed.bench.options import MAX_ITERATIONS
from llm_speed.bench.timing import HOST_TIMER, summarize
from llm_speed.cli import build_parser, main

FAST = ["--device", "cpu", "--warmup", "0", "--iterations", "1", "--min-time", "0", "--no-progress"]


def timing(*times_ms):
    return summarize(list(times_ms), HOST_TIMER)


def row(impl, times, case="16x16x16"):
    return report.Measurement(
        case=case,
        impl=impl,
        available=True,
        flops=2 * 16**3,
        bytes_moved=3 * 16 * 16 * 4,
        timing=timing(*times),
    )


def test_speedup_within_the_spread_is_flagged_as_noise():
    # 10% faster by the median, but the two p20–p80 intervals overlap: the claim is noise.
    noisy = [row("llm-speed", [0.8, 0.9, 1.0, 1.1, 1.2]), row("torch", [0.9, 1.0, 1.1, 1.2, 1.3])]
    report.add_comparisons(noisy, None, "fp32", "cpu")
    ours = noisy[0]
    assert ours.speedup_vs_fastest_other == pytest.approx(1.1)
    low, high = ours.speedup_range
    assert low < 1.0 < high and ours.speedup_within_noise is True
    assert "within noise" in report.speedup_cell(ours)
    # A clear difference: the range stays above 1 and carries no flag.
    clear = [row("llm-speed", [1.0, 1.0, 1.01, 1.02, 1.02]), row("torch", [2.0, 2.0, 2.02, 2.04, 2.04])]
    report.add_comparisons(clear, None, "fp32", "cpu")
    assert clear[0].speedup_range[0] > 1.0 and clear[0].speedup_within_noise is False
    assert report.speedup_cell(clear[0]).startswith("2x torch [1.96–2.04x]")
    assert "noise" not in report.speedup_cell(clear[0])


def test_gemm_percent_of_baseline_has_a_range_and_a_noise_flag(monkeypatch):
    times = {"llm-speed": [1.0, 1.1, 1.2, 1.3, 1.4], "torch": [1.0, 1.1, 1.2, 1.3, 1.4]}

    def fake_run(measurement, build, **kwargs):
        measurement.available, measurement.timing = True, timing(*times[measurement.impl])
        return measurement

    monkeypatch.setattr(report, "run_measurement", fake_run)
    settings = gemm_bench.GemmSettings(
        cases=(gemm_bench.GemmCase("", 16, 16, 16),), dtype="fp32", layout="NN", epilogue="none",
        impls=("llm-speed", "torch"), warmup=0, iterations=1, device="cpu",
    )  # fmt: skip
    ours = gemm_bench.run_gemm(settings, show_progress=False)[0]
    assert ours.percent_of_baseline == pytest.approx(100.0)
    assert ours.percent_within_noise is True
    assert gemm_bench.percent_cell(ours).startswith("100% [")
    assert gemm_bench.percent_cell(ours).endswith("within noise")


def test_bad_output_path_fails_before_any_work(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(gemm_bench, "run_gemm", lambda *args, **kwargs: ran.append(1))
    for flag, name in (("--output", "x.json"), ("--csv", "x.csv"), ("--plot", "x.png")):
        path = f"/nonexistent-llm-speed/dir/{name}"
        code = main(["bench", "gemm", *FAST, "--sizes", "16x16x16", flag, path])
        assert code == 2
        err = capsys.readouterr().err
        assert f"{flag}: folder /nonexistent-llm-speed/dir does not exist" in err
        assert "Traceback" not in err
    assert not ran


def test_an_interrupted_run_keeps_the_finished_cases_in_json_and_csv(tmp_path, monkeypatch):
    out, table = tmp_path / "g.json", tmp_path / "g.csv"
    real_run = report.run_measurement
    calls = []

    def run_then_interrupt(measurement, build, **kwargs):
        calls.append(measurement.case)
        if len(calls) > 2:  # the second case: the user presses Ctrl-C
            raise KeyboardInterrupt
        return real_run(measurement, build, **kwargs)

    monkeypatch.setattr(report, "run_measurement", run_then_interrupt)
    # the calibration calls before the run are not the cases counted here
    monkeypatch.setattr(cpu_budget, "calibrate_gemm", lambda settings: {"torch": TORCH_COST})
    argv = [
        "bench",
        "gemm",
        *FAST,
        "--sizes",
        "16x16x16",
        "32x16x16",
        "--output",
        str(out),
        "--csv",
        str(table),
    ]
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    payload = json.loads(out.read_text())
    assert payload["complete"] is False
    assert [r["case"] for r in payload["results"]] == ["16x16x16", "16x16x16"]
    assert payload["results"][0]["timing"]["median_ms"] > 0
    with table.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [r["impl"] for r in rows] == ["llm-speed", "torch"]


def test_csv_next_to_json(tmp_path, capsys):
    out, table = tmp_path / "a.json", tmp_path / "a.csv"
    argv = ["bench", "attention", *FAST, "--seq-lengths", "16", "32", "--num-heads", "2", "--head-dim", "16"]
    assert main([*argv, "--impl", "naive", "sdpa", "--output", str(out), "--csv", str(table)]) == 0
    assert f"results written to {table}" in capsys.readouterr().out
    payload = json.loads(out.read_text())
    assert payload["complete"] is True
    with table.open() as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["case"], r["impl"]) for r in rows] == [
        ("seq=16", "naive"), ("seq=16", "sdpa"), ("seq=32", "naive"), ("seq=32", "sdpa"),
    ]  # fmt: skip
    columns = list(rows[0])
    assert columns[:4] == ["case", "impl", "median_ms", "p20_ms"]
    assert {"speedup_range_low", "speedup_range_high", "speedup_within_noise", "tflops"} <= set(columns)
    for record, full in zip(rows, payload["results"], strict=True):
        assert float(record["median_ms"]) == pytest.approx(full["timing"]["median_ms"])
        assert float(record["speedup_range_low"]) == pytest.approx(full["speedup_range"][0])


def test_model_gemms_use_the_nn_linear_layout_by_default():
    parser = build_parser()
    model = gemm_settings(parser.parse_args(["bench", "gemm", "--device", "cpu", "--model", "llama-3-8b"]))
    assert model.layout == "NT"  # x @ W^T, W stored [N, K] as nn.Linear keeps it
    sizes = gemm_settings(parser.parse_args(["bench", "gemm", "--device", "cpu", "--sizes", "16x16x16"]))
    assert sizes.layout == "NN"
    explicit = parser.parse_args(
        ["bench", "gemm", "--device", "cpu", "--model", "llama-3-8b", "--layout", "NN"]
    )
    assert gemm_settings(explicit).layout == "NN"


def test_timing_defaults_are_a_minimum_time_not_three_runs():
    parser = build_parser()
    for argv in (["bench", "gemm", "--device", "cpu"], ["bench", "attention", "--device", "cpu"]):
        settings = (gemm_settings if argv[1] == "gemm" else attention_settings)(parser.parse_args(argv))
        assert settings.iterations >= 5 and settings.min_time_s >= 0.5
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "gemm", "--min-time", "-1"])


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "attention", "--iterations", "10001"],
        ["bench", "gemm", "--warmup", "99999999999"],
        ["bench", "ops", "--iterations", "0"],
        ["bench", "overhead", "--calls", "100001"],
        ["bench", "overhead", "--repeats", "10001"],
    ],
)
def test_run_counts_past_the_timer_s_cap_are_refused(argv, capsys):
    # the timer stops at MAX_ITERATIONS timed runs: more was cut silently, and estimated at 250,000 hours
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert f"argument {argv[2]}: expected an integer from " in capsys.readouterr().err
    largest = 100_000 if argv[2] == "--calls" else MAX_ITERATIONS  # the bound itself is taken
    parsed = build_parser().parse_args([*argv[:2], argv[2], str(largest)])
    assert getattr(parsed, argv[2][2:]) == largest


def test_the_estimate_counts_no_more_timed_runs_than_the_timer_makes():
    argv = ["bench", "gemm", "--device", "cpu", "--sizes", "64x64x64"]
    gemm = gemm_settings(build_parser().parse_args(argv))
    cost = cpu_budget.CallCost(fixed_s=1e-3, seconds_per_flop=0.0)  # 1 ms a call
    long = dataclasses.replace(gemm, min_time_s=1e9)  # asks for 30 years of runs
    per_impl = (1 + gemm.warmup) * 1e-3 + MAX_ITERATIONS * 1e-3
    assert cpu_budget.gemm_estimate(long, {"torch": cost}) == pytest.approx(per_impl)


README_ATTENTION = [
    "bench", "attention", "--seq-lengths", "1024", "4096", "--head-dim", "128", "--dtype", "bf16", "--causal",
    "--mode", "fwd+bwd", "--device", "cpu",
]  # fmt: skip
README_GEMM = ["bench", "gemm", "--sizes", "4096x4096x4096", "--dtype", "bf16", "--epilogue", "bias+gelu"]


# Costs per call as a 2-core machine measured them: the interpreter's kernels at 0.05 GFLOP/s after 2 ms of
# launch, PyTorch's CPU GEMM at 100 GFLOP/s, its fp16 GEMM at 0.24 GFLOP/s.
INTERPRETED_COST = cpu_budget.CallCost(fixed_s=2e-3, seconds_per_flop=1 / 5e7)
TORCH_COST = cpu_budget.CallCost(fixed_s=1e-5, seconds_per_flop=1 / 1e11)
FP16_COST = cpu_budget.CallCost(fixed_s=1e-5, seconds_per_flop=1 / 2.4e8)


def test_gpu_sized_problems_are_scaled_on_a_cpu_with_a_note():
    settings = attention_settings(build_parser().parse_args(README_ATTENTION))
    costs = {impl: INTERPRETED_COST for impl in settings.impls}
    scaled, notes = cpu_budget.scale_attention(settings, costs)
    assert max(scaled.seq_lengths) <= 256 and scaled.head_dim == 128
    assert "1024 -> " in notes[0] and "4096 -> " in notes[0] and "--full-size" in notes[0]
    assert "GFLOP/s" in notes[0]
    # The README's 36-minute run, as given, is estimated at more than an hour; scaled, at about a minute.
    assert cpu_budget.attention_estimate(settings, costs) > 3600
    assert cpu_budget.attention_estimate(scaled, costs) < 120
    gemm = gemm_settings(build_parser().parse_args([*README_GEMM, "--device", "cpu"]))
    gemm_costs = {"llm-speed": TORCH_COST, "torch": TORCH_COST}
    small, notes = cpu_budget.scale_gemm(gemm, gemm_costs)
    case = small.cases[0]
    assert TORCH_COST.seconds(2 * case.m * case.n * case.k) <= cpu_budget.CALL_SECONDS
    assert TORCH_COST.seconds(8 * case.m * case.n * case.k) > cpu_budget.CALL_SECONDS  # halved only as needed
    assert "4096x4096x4096 -> " in notes[0] and "llm-speed 1e+02, torch 1e+02 GFLOP/s" in notes[0]
    # A slower implementation (fp16 has no fast CPU matmul) scales further; two sizes that become the same
    # are measured once.
    argv = ["bench", "gemm", "--sizes", "4096x4096x4096", "1024x1024x1024", "--dtype", "fp16"]
    fp16 = gemm_settings(build_parser().parse_args([*argv, "--device", "cpu"]))
    half, _ = cpu_budget.scale_gemm(fp16, {"torch": FP16_COST})
    assert len(half.cases) == 1
    fp16_case = half.cases[0]
    assert FP16_COST.seconds(2 * fp16_case.m * fp16_case.n * fp16_case.k) <= cpu_budget.CALL_SECONDS
    # Small problems are left alone.
    tiny = gemm_settings(
        build_parser().parse_args(["bench", "gemm", "--device", "cpu", "--sizes", "64x64x64"])
    )
    assert cpu_budget.scale_gemm(tiny, gemm_costs) == (tiny, [])


def test_the_cost_per_call_is_fitted_from_two_measured_calls():
    cost = cpu_budget.fit_cost([(1e6, 0.003), (8e6, 0.010)])  # 1 ms per MFLOP after 2 ms
    assert cost.fixed_s == pytest.approx(0.002) and cost.seconds_per_flop == pytest.approx(1e-9)
    # one call: through the origin
    assert cpu_budget.fit_cost([(8e6, 0.010)]) == cpu_budget.CallCost(0.0, 0.010 / 8e6)
    # a smaller call slowed by noise (here as slow as the larger): the time per FLOP stays at least half the
    # larger call's average, so a large problem never looks cheap
    noisy = cpu_budget.fit_cost([(1e6, 0.012), (8e6, 0.010)])
    assert noisy.seconds_per_flop == pytest.approx(0.5 * 0.010 / 8e6)
    assert noisy.seconds(8e6) == pytest.approx(0.010) and noisy.seconds(8e9) > 0.5 * 0.010 * 1000


def test_the_estimate_comes_from_calibration_calls_measured_here():
    """The old estimate assumed 10 GFLOP/s for PyTorch's GEMM and said "about 62 s" for a 15 s run; now two
    calls per implementation are timed at small sizes of the problem asked for (the benchmark itself)."""
    ran = []

    def fake_run(settings, show_progress):
        ran.append(settings)
        rows = []
        for case in settings.cases:
            for impl, rate in (("llm-speed", 5e10), ("torch", 1e11)):
                flops = 2.0 * case.m * case.n * case.k
                rows.append(gemm_bench.GemmMeasurement(
                    case=f"{case.m}x{case.n}x{case.k}", impl=impl, available=True, flops=flops,
                    bytes_moved=1.0, timing=timing(flops / rate * 1e3), name="", m=case.m, n=case.n, k=case.k,
                    count=1,
                ))  # fmt: skip
        return rows

    gemm = gemm_settings(build_parser().parse_args([*README_GEMM, "--device", "cpu", "--dtype", "fp32"]))
    costs = cpu_budget.calibrate_gemm(gemm, run=fake_run)
    (small,) = ran
    side = cpu_budget.CALIBRATION_GEMM_SIDE
    assert [(c.m, c.n, c.k) for c in small.cases] == [(side // 2,) * 3, (side,) * 3]
    assert (small.warmup, small.iterations, small.min_time_s) == (0, 1, 0.0)
    assert costs["torch"].seconds_per_flop == pytest.approx(1e-11)
    assert costs["llm-speed"].seconds(2 * 4096**3) == pytest.approx(2 * 4096**3 / 5e10)
    # 5 timed runs + 1 warm-up + the availability check of each, at the measured rates
    per_round = 2 * 4096**3 / 5e10 + 2 * 4096**3 / 1e11
    assert cpu_budget.gemm_estimate(gemm, costs) == pytest.approx(7 * per_round, rel=1e-6)


def test_attention_is_calibrated_on_one_head_group_at_short_lengths():
    seen = []

    def fake_run(settings, show_progress):
        seen.append(settings)
        return []

    settings = attention_settings(build_parser().parse_args(
        [*README_ATTENTION, "--num-heads", "32", "--num-kv-heads", "8", "--batch-size", "2"]
    ))  # fmt: skip
    assert cpu_budget.calibrate_attention(settings, run=fake_run) == {}
    # one head group at the calibration length, and twice as many heads (batch 2) at half of it: the cost
    # per head and the cost per FLOP apart
    longest, shorter = seen
    assert (longest.seq_lengths, longest.batch_size) == ((cpu_budget.CALIBRATION_SEQ,), 1)
    assert (shorter.seq_lengths, shorter.batch_size) == ((cpu_budget.CALIBRATION_SEQ // 2,), 2)
    for small in seen:
        assert (small.num_heads, small.num_kv_heads, small.head_dim) == (4, 1, 128)
        assert (small.mode, small.causal, small.dtype) == (settings.mode, settings.causal, settings.dtype)


def test_the_readme_gemm_command_prints_the_scaling_and_estimate_first(capsys):
    argv = [*README_GEMM, *FAST, "--impl", "torch"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "note: CPU run: GEMM sizes scaled (4096x4096x4096 -> " in out
    assert "note: estimated run time on this CPU: about" in out
    assert out.index("estimated run time") < out.index("GEMM: every implementation")


def _captured_plot(monkeypatch):
    drawn = {}
    monkeypatch.setattr(
        "llm_speed.perf.plot.plot_roofline",
        lambda gpu, points, path, **kwargs: drawn.update(gpu=gpu, points=points, title=kwargs["title"]),
    )
    monkeypatch.setattr(
        plots, "_plot_bars", lambda rows, labels, achieved, path, **kw: drawn.update(bars=labels)
    )
    return drawn


def test_a_cpu_run_plots_the_model_s_predictions_not_cpu_timings(monkeypatch, tmp_path):
    drawn = _captured_plot(monkeypatch)
    rows = [
        row("llm-speed", [1.0], case="16x16x16"),
        row("torch", [2.0], case="16x16x16"),
        report.Measurement(case="64x64x64", impl="llm-speed", available=True, flops=2 * 64**3,
                           bytes_moved=3 * 64 * 64 * 4, timing=timing(3.0)),
    ]  # fmt: skip
    console = report.output_console()
    assert plots.plot_rows(rows, tmp_path / "r.png", device=torch.device("cpu"), dtype="fp32", title="t",
                           console=console)  # fmt: skip
    assert drawn["gpu"].id == "h100-sxm"
    assert all(point.achieved_flops_per_s is None for point in drawn["points"])  # predictions only
    assert [point.label for point in drawn["points"]] == [
        "16x16x16 [llm-speed, torch]",
        "64x64x64 [llm-speed]",
    ]
    assert "predictions for" in drawn["title"] and "not plotted" in drawn["title"]


def test_crowded_model_gemms_become_a_bar_chart(monkeypatch, tmp_path):
    drawn = _captured_plot(monkeypatch)
    cases = gemm_bench.model_cases("llama-3-8b", 16)
    rows = [
        report.Measurement(case=c.name, impl="llm-speed", available=True, flops=2 * c.m * c.n * c.k,
                           bytes_moved=2 * (c.m * c.k + c.k * c.n + c.m * c.n), timing=timing(1.0))
        for c in cases
    ]  # fmt: skip
    plots.plot_rows(rows, tmp_path / "m.png", device=torch.device("cpu"), dtype="bf16", title="t",
                    console=report.output_console())  # fmt: skip
    assert "points" not in drawn and len(drawn["bars"]) == len({c.name for c in cases})


def test_bar_chart_is_written(tmp_path):
    rows = [row("llm-speed", [1.0], case=f"s{i}") for i in range(5)]
    path = tmp_path / "bars.png"
    assert plots.plot_rows(rows, path, device=torch.device("cpu"), dtype="fp32", title="t",
                           console=report.output_console())  # fmt: skip
    assert path.stat().st_size > 0


def test_demo_on_cpu_claims_no_speed_ratio():
    gemm_rows = [row("llm-speed", [1.0]), row("torch", [85.49])]
    gemm_rows[0].percent_of_baseline = 8549.0
    lines = demo._takeaways([], gemm_rows, torch.device("cpu"))
    assert not any("%" in line for line in lines)
    assert any("not comparable" in line for line in lines)


def test_demo_checks_its_output_folder_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr("llm_speed.perf.inference.analyze_inference", lambda *a, **k: pytest.fail("work ran"))
    assert main(["demo", "--device", "cpu", "--output-dir", "/nonexistent-llm-speed/demo"]) == 2
    assert "--output-dir: folder /nonexistent-llm-speed/demo does not exist" in capsys.readouterr().err


def test_demo_makes_the_folder_it_is_given_where_its_parent_exists(monkeypatch, tmp_path):
    """--output-dir outside the current directory (the GPU suite's /tmp folder): the named folder is made
    when its parent exists, before any work (the work stops here: the check passed)."""
    target, elsewhere = tmp_path / "demo", tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)

    def stop(*args, **kwargs):
        assert target.is_dir()
        raise SystemExit(7)

    monkeypatch.setattr("llm_speed.perf.inference.analyze_inference", stop)
    with pytest.raises(SystemExit):
        main(["demo", "--device", "cpu", "--output-dir", str(target)])
    assert target.is_dir()


def test_heads_are_scaled_when_the_shortest_sequence_is_not_enough(monkeypatch):
    monkeypatch.setattr(cpu_budget, "CALL_SECONDS", 1e-6)
    argv = [
        "bench",
        "attention",
        "--device",
        "cpu",
        "--num-heads",
        "32",
        "--num-kv-heads",
        "8",
        "--head-dim",
        "128",
    ]
    costs = {"flash": cpu_budget.CallCost(0.0, 1 / 5e7)}
    scaled, notes = cpu_budget.scale_attention(attention_settings(build_parser().parse_args(argv)), costs)
    assert scaled.seq_lengths == (cpu_budget.MIN_SIZE,)
    assert (scaled.num_heads, scaled.num_kv_heads) == (1, 1)
    assert "heads scaled (32/8 -> 1/1" in notes[-1]
