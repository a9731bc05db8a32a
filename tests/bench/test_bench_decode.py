"""``llm-speed bench decode``: a CPU dry run with tiny sizes, its flags and its refusals."""

import json

import pytest
import torch

from llm_speed.bench import cpu_budget
from llm_speed.bench import decode as decode_bench
from llm_speed.bench.timing import HOST_TIMER, summarize
from llm_speed.cli import build_parser, main


def test_dry_run_measures_every_impl(device, capsys, tmp_path):
    out = tmp_path / "decode.json"
    argv = (
        f"bench decode --device {device.type} --batch-sizes 2 --contexts 20 --num-heads 4 --num-kv-heads 2 "
        "--head-dim 16"
    )
    argv = [*argv.split(), *"--warmup 0 --iterations 1 --no-progress --json --output".split(), str(out)]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document == json.loads(out.read_text())
    rows = document["results"]
    assert [r["impl"] for r in rows] == list(decode_bench.IMPLS)
    assert all(r["batch"] == 2 and r["context"] == 20 for r in rows)
    assert all(r["bytes_moved"] > 0 and r["flops"] > 0 for r in rows)
    assert all(r["available"] for r in rows), [r["reason"] for r in rows]  # Triton runs on CPU in the tests
    assert all(r["bandwidth_gb_s"] > 0 for r in rows)
    # a GPU's HBM peak comes from the spec table; a CPU has none
    assert all((r["hbm_peak_fraction"] is None) == (device.type == "cpu") for r in rows)
    # the fp8 caches: half the cache bytes (1 byte per element against fp32's 4 here), their tokens/s
    # against the 16-bit cache of the same layout; no such ratio on the other rows
    by_impl = {r["impl"]: r for r in rows}
    for fp8, sixteen in decode_bench.FP8_IMPLS.items():
        assert by_impl[fp8]["bytes_moved"] < by_impl[sixteen]["bytes_moved"]
        ratio = by_impl[sixteen]["timing"]["median_ms"] / by_impl[fp8]["timing"]["median_ms"]
        assert by_impl[fp8]["vs_16bit_cache"] == pytest.approx(ratio)
    assert all(r["vs_16bit_cache"] is None for r in rows if r["impl"] not in decode_bench.FP8_IMPLS)
    # llm-speed's rows against SDPA's, whichever row is the fastest other
    sdpa = by_impl["sdpa"]
    assert sdpa["vs_sdpa"] is None and sdpa["graph_vs_sdpa"] is None
    for r in rows:
        if r["impl"] != "sdpa":
            assert r["vs_sdpa"] == pytest.approx(sdpa["timing"]["median_ms"] / r["timing"]["median_ms"])
    # each step replayed from a CUDA graph on a GPU (every implementation captures: no host sync in a step)
    if device.type == "cuda":
        assert all(r["graph_ms"] > 0 and r["graph_bandwidth_gb_s"] > 0 for r in rows), rows
        assert all(r["graph_reason"] is None for r in rows)
        for r in rows:
            if r["impl"] != "sdpa":
                assert r["graph_vs_sdpa"] == pytest.approx(sdpa["graph_ms"] / r["graph_ms"])
    else:
        assert all(r["graph_vs_sdpa"] is None for r in rows)
        assert all(r["graph_ms"] is None and r["graph_bandwidth_gb_s"] is None for r in rows)
        assert all(r["graph_reason"] == "CUDA graphs need a CUDA device (ran on cpu)" for r in rows)


def test_no_graph_skips_the_replay_and_says_so(capsys):
    argv = (
        "bench decode --device cpu --batch-sizes 1 --contexts 16 --num-heads 2 --num-kv-heads 1 "
        "--head-dim 16 --impl sdpa --warmup 0 --iterations 1 --no-graph --no-progress --json"
    ).split()
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["settings"]["graph"] is False
    [row] = document["results"]
    assert row["available"] and row["graph_ms"] is None
    assert row["graph_reason"] == "not asked for (--no-graph)"


def test_a_refused_capture_keeps_the_eager_figures(monkeypatch):
    """A capture that raises (a step that synchronises with the host, say) leaves graph_ms None with the
    capture's error, and the row's eager timing stands."""
    args = build_parser().parse_args("bench decode --device cpu --impl sdpa".split())
    settings = decode_bench.decode_settings(args, decode_bench.torch.device("cpu"))
    row = decode_bench.DecodeMeasurement(
        case="c", impl="sdpa", available=True, batch=1, context=16, flops=1.0, bytes_moved=1.0
    )

    def refuse(*args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")

    monkeypatch.setattr(decode_bench.timing, "measure", refuse)
    replay = decode_bench._graph_timer(row, settings, decode_bench.torch.device("cuda"))
    replay(lambda: None)
    assert row.graph_ms is None and row.available
    reason = "capture failed: RuntimeError: operation not permitted when stream is capturing"
    assert row.graph_reason == reason


def test_fp8_rows_alone_and_their_prediction(device, capsys):
    """--impl kvcache-fp8 alone runs (no 16-bit row to compare with: no ratio); the predictor counts the fp8
    cache at 1 byte per element, labelled uncalibrated. On the device fixture's device: the fp8 cache is a
    Triton-only row, which a CPU runs under the interpreter only (not set on a GPU machine)."""
    argv = (f"bench decode --device {device.type} --batch-sizes 1 --contexts 16 --num-heads 2 "
            "--num-kv-heads 1 --head-dim 16 --dtype bf16 --impl kvcache-fp8 --warmup 0 --iterations 1 "
            "--no-progress --json").split()  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["impl"] for r in rows] == ["kvcache-fp8"] and rows[0]["available"], rows
    assert rows[0]["vs_16bit_cache"] is None
    settings = decode_bench.decode_settings(
        build_parser().parse_args(["bench", "decode", "--device", "cpu", "--dtype", "bf16"]),
        decode_bench.torch.device("cpu"),
    )
    predict_row = decode_bench.predictor(settings, "h100-sxm")
    row = {impl: decode_bench.DecodeMeasurement(case="c", impl=impl, available=True, batch=64, context=4096,
                                                flops=1.0, bytes_moved=1.0)
           for impl in ("kvcache", "kvcache-fp8")}  # fmt: skip
    fp8, sixteen = predict_row(row["kvcache-fp8"]), predict_row(row["kvcache"])
    assert not fp8.calibrated and fp8.breakdown.bytes_moved < 0.55 * sixteen.breakdown.bytes_moved


def test_defaults_and_flags():
    args = build_parser().parse_args(["bench", "decode", "--device", "cpu", "--page-size", "32"])
    settings = decode_bench.decode_settings(args, decode_bench.torch.device("cpu"))
    assert settings.page_size == 32 and settings.batch_sizes == decode_bench.CPU_DEFAULTS["batch_sizes"]
    assert settings.impls == decode_bench.IMPLS


@pytest.mark.parametrize(
    "flags, match",
    [(["--page-size", "24"], "page_size"), (["--num-heads", "4", "--num-kv-heads", "3"], "num_kv_heads")],
)
def test_bad_settings_are_refused(flags, match):
    args = build_parser().parse_args(["bench", "decode", "--device", "cpu", *flags])
    with pytest.raises(ValueError, match=match):
        decode_bench.decode_settings(args, decode_bench.torch.device("cpu"))


DECODE = "bench decode --device cpu --num-heads 4 --num-kv-heads 2 --head-dim 16 --page-size 16".split()
RUNS = "--warmup 0 --iterations 1 --no-progress --json".split()
CPU = torch.device("cpu")


def test_memory_floor_is_the_caches_with_whole_pages_and_the_fp8_draw():
    settings = decode_bench.decode_settings(build_parser().parse_args([*DECODE, "--dtype", "fp16"]), CPU)
    elements = 2 * 20 * 2 * 16  # batch 2, context 20, 2 key/value heads of 16
    assert decode_bench.memory_floor(settings, 2, 20, "kvcache") == 2 * elements * 2  # K and V, fp16
    assert decode_bench.memory_floor(settings, 2, 20, "sdpa") == 2 * elements * 2
    assert decode_bench.memory_floor(settings, 2, 20, "kvcache-paged") == 2 * (elements // 20 * 32) * 2
    assert decode_bench.memory_floor(settings, 2, 20, "kvcache-fp8") == 2 * elements + 4 * elements


def test_rows_that_cannot_fit_a_cpu_are_not_run_and_a_sweep_of_none_is_refused(monkeypatch, capsys):
    from llm_speed.bench import report

    argv = [*DECODE, "--batch-sizes", "1", "--contexts", "16", "64", "--impl", "kvcache", *RUNS]
    settings = decode_bench.decode_settings(build_parser().parse_args(argv), CPU)
    small = decode_bench.memory_floor(settings, 1, 16, "kvcache")
    monkeypatch.setattr(report, "cpu_memory", lambda device: small)  # the 16-token cache fits, no other
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["context"], r["available"]) for r in rows] == [(16, True), (64, False)]
    assert rows[1]["reason"].startswith("needs at least ") and rows[1]["reason"].endswith("on this CPU")
    monkeypatch.setattr(report, "cpu_memory", lambda device: small - 1)
    ran = []
    monkeypatch.setattr(cpu_budget, "calibrate_decode", lambda *a, **k: ran.append(1))
    monkeypatch.setattr(decode_bench, "run_decode", lambda *a, **k: ran.append(1))
    assert main([*argv, "--full-size"]) == 2  # the sizes final: refused before the calibration calls
    err = capsys.readouterr().err
    assert "llm-speed bench decode: error: --batch-sizes/--contexts: no case fits in the memory" in err
    assert not ran


# Costs per step at batch 1 as the interpreter gives them: ~30 ms of a sequence's programs, then ~25 MB/s.
STEP = cpu_budget.CallCost(3e-2, 4e-8)


def test_gpu_sized_decode_is_scaled_batch_then_context_on_a_cpu():

    argv = [*DECODE, "--batch-sizes", "1", "8", "128", "--contexts", "1024", "4096", "16384"]
    settings = decode_bench.decode_settings(build_parser().parse_args(argv), CPU)
    costs = {impl: STEP for impl in settings.impls}
    scaled, notes = cpu_budget.scale_decode(settings, costs)
    slowest = {(b, c): max(cpu_budget.decode_seconds(scaled, STEP, b, c, impl) for impl in scaled.impls)
               for b in scaled.batch_sizes for c in scaled.contexts}  # fmt: skip
    assert max(slowest.values()) <= cpu_budget.CALL_SECONDS  # every case fits the budget
    # 128 sequences at 30 ms each cannot fit at any context: the batch goes first, then the contexts
    assert max(scaled.batch_sizes) < 128 and scaled.batch_sizes[:2] == (1, 8)
    batch, longer = max(scaled.batch_sizes), 2 * max(scaled.contexts)
    doubled = max(cpu_budget.decode_seconds(scaled, STEP, batch, longer, i) for i in scaled.impls)
    assert doubled > cpu_budget.CALL_SECONDS  # halved no further than needed
    assert [note.split(" (")[0] for note in notes] == [
        "CPU run: contexts scaled", "CPU run: contexts merged", "CPU run: batch sizes scaled"
    ]  # fmt: skip
    assert cpu_budget.decode_estimate(settings, costs) > 10 * cpu_budget.decode_estimate(scaled, costs)
    assert cpu_budget.scale_decode(scaled, costs) == (scaled, [])


def test_decode_is_calibrated_at_batch_1_and_two_contexts():

    argv = [*DECODE, "--batch-sizes", "4", "--contexts", "100", "4096"]
    settings = decode_bench.decode_settings(build_parser().parse_args(argv), CPU)
    calls = []

    def fake_run(small, show_progress):
        calls.append(small)
        rows = []
        for c in small.contexts:
            for impl in small.impls:
                moved = cpu_budget.decode_bytes(small, 1, c, impl)  # as run_decode's rows carry it
                rows.append(decode_bench.DecodeMeasurement(
                    case="", impl=impl, available=True, batch=1, context=c, flops=0, bytes_moved=moved,
                    timing=summarize([1e3 * (1e-4 + 1e-6 * moved)], HOST_TIMER),
                ))  # fmt: skip
        return rows

    costs = cpu_budget.calibrate_decode(settings, run=fake_run)
    (small,) = calls
    top = cpu_budget.CALIBRATION_CONTEXT
    assert (small.batch_sizes, small.contexts, small.graph) == ((1,), (top // 2, top), False)
    assert (small.warmup, small.iterations) == (0, 1)
    assert set(costs) == set(small.impls)
    assert all(cost.fixed_s == pytest.approx(1e-4) for cost in costs.values())
    assert all(cost.seconds_per_flop == pytest.approx(1e-6) for cost in costs.values())


def test_a_gpu_sized_cpu_decode_prints_its_scaling_and_estimate_first(monkeypatch, capsys):

    monkeypatch.setattr(cpu_budget, "calibrate_decode", lambda settings: {"sdpa": STEP})
    argv = [*DECODE, "--batch-sizes", "2", "--contexts", "999999", "--impl", "sdpa", *RUNS]
    assert main(argv) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["results"]
    assert "CPU run: contexts scaled (999999 -> " in captured.err and "estimated run time" in captured.err
    assert len(rows) == 1 and rows[0]["context"] < 999999 and rows[0]["available"]
