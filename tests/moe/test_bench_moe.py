"""``llm-speed bench moe``: tokens x experts x top_k cases, three implementations (the fused layer, a
torch._grouped_mm version, Hugging Face's loop) as report.Measurement rows with the op table's costs; the
torch._grouped_mm version is right; bad settings refused before any work."""

import json

import pytest
import torch

from llm_speed import ops
from llm_speed.bench import cpu_budget
from llm_speed.bench import moe as moe_bench
from llm_speed.bench.timing import HOST_TIMER, summarize
from llm_speed.cli import build_parser, main
from llm_speed.core import runtime
from llm_speed.moe.reference import fused_moe_reference

FAST = ("--tokens 5 --experts 2 4 --top-k 1 3 --hidden 16 --intermediate 16 --device cpu --dtype fp32 "
        "--warmup 0 --iterations 1 --no-progress").split()  # fmt: skip


def test_cli_times_every_case_and_impl(capsys, tmp_path):
    out = tmp_path / "moe.json"
    before = runtime.launch_counts()
    assert main(["bench", "moe", *FAST, "--json", "--output", str(out)]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["benchmark"] == "moe" and document["complete"] is True
    rows = document["results"]
    cases = [(2, 1), (4, 1), (4, 3)]  # top_k 3 > 2 experts is no case
    assert [(r["experts"], r["top_k"], r["impl"]) for r in rows] == [
        (e, k, impl) for e, k in cases for impl in moe_bench.IMPLS
    ]
    for row in rows:
        assert row["available"], row["reason"]
        assert row["timing"]["median_ms"] > 0 and row["speedup_vs_fastest_other"] is not None
    settings = moe_bench.moe_settings(build_parser().parse_args(["bench", "moe", *FAST]), torch.device("cpu"))
    flops, moved = moe_bench.case_cost((5, 4, 3), settings)
    row = rows[-1]
    assert (row["flops"], row["bytes_moved"]) == (flops, moved)
    meta = dict(
        hidden=torch.empty(5, 16, device="meta"), w_gate_up=torch.empty(4, 32, 16, device="meta"),
        w_down=torch.empty(4, 16, 16, device="meta"), topk_ids=torch.empty(5, 3, device="meta"),
    )  # fmt: skip
    forward, backward = ops.get("fused_moe").work(**meta), ops.get("fused_moe_backward").work(**meta)
    assert flops == forward.flops + backward.flops == 22 * 5 * 3 * 16 * 16 + 4 * 5 * 3 * 16
    if runtime.INTERPRETED:
        assert (runtime.launch_counts() - before)["moe.fused_moe_bwd"] > 0


def test_grouped_mm_version_is_right():
    x, w_gate_up, w_down = torch.randn(7, 16), torch.randn(4, 32, 16) / 4, torch.randn(4, 16, 16) / 4
    weights, ids = torch.randn(7, 4).softmax(-1).topk(2, dim=-1)
    got = moe_bench.grouped_mm_moe(x, w_gate_up, w_down, weights, ids)
    torch.testing.assert_close(
        got, fused_moe_reference(x, w_gate_up, w_down, weights, ids), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize(
    ("flags", "message"),
    [(["--top-k", "5"], "--top-k: every value"), (["--dtype", "int8"], "invalid choice"),
     (["--mode", "bwd"], "invalid choice")],
)  # fmt: skip
def test_bad_settings_are_refused_before_any_work(flags, message, capsys):
    before = runtime.launch_counts()
    try:
        code = main(["bench", "moe", *FAST, *flags])
    except SystemExit as exit_:  # argparse refuses a choice
        code = exit_.code
    assert code != 0 and message in capsys.readouterr().err
    assert runtime.launch_counts() == before


def test_a_case_that_cannot_fit_a_cpu_is_not_run_and_a_sweep_of_none_is_refused(monkeypatch, capsys):
    from llm_speed.bench import report

    settings = moe_bench.moe_settings(build_parser().parse_args(["bench", "moe", *FAST]), torch.device("cpu"))
    weights = 3 * 2 * 16 * 16  # 2 experts' gate/up and down, 16 x 16
    draw = 4 * 2 * 2 * 16 * 16  # the float32 gate/up weight drawn first
    # fp32 tokens, output and weights with their gradients (fwd+bwd), the output's gradient
    floor = ((2 * 5 * 16 + weights) * 2 + 5 * 16) * 4 + draw
    assert moe_bench.memory_floor((5, 2, 1), settings) == floor
    monkeypatch.setattr(report, "cpu_memory", lambda device: floor)  # 2 experts fit, 4 do not
    assert main(["bench", "moe", *FAST, "--impl", "llm_speed", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [(r["experts"], r["available"]) for r in rows] == [(2, True), (4, False), (4, False)]
    assert rows[1]["reason"].startswith("needs at least ")
    monkeypatch.setattr(report, "cpu_memory", lambda device: floor - 1)
    assert main(["bench", "moe", *FAST, "--impl", "llm_speed"]) == 2
    assert "--tokens/--experts/--hidden/--intermediate: no case fits" in capsys.readouterr().err


# --- on a CPU: GPU-sized sweeps scaled to the calibration calls' costs -----------------------------------

# The interpreter's fused layer as measured here: ~1 us per expert weight element, ~1.6 ns per FLOP.
FUSED = cpu_budget.MoeCost(fixed_s=0.0, per_weight_s=1e-6, seconds_per_flop=1.6e-9)
GPU_SIZED = ("--tokens 2048 8192 --experts 8 64 128 --top-k 2 8 --hidden 2048 --intermediate 768 "
             "--device cpu --no-progress").split()  # fmt: skip


def _gpu_sized():
    args = build_parser().parse_args(["bench", "moe", *GPU_SIZED])
    return moe_bench.moe_settings(args, torch.device("cpu"))


def test_the_cost_per_flop_and_per_weight_are_fitted_from_three_calls():
    truth = cpu_budget.MoeCost(fixed_s=2e-3, per_weight_s=1e-6, seconds_per_flop=2e-9)
    points = [(w, f, truth.seconds(w, f)) for w, f in ((1e6, 1e8), (1e6, 2e8), (2e6, 2e8))]
    fitted = cpu_budget.fit_moe_cost(points)
    assert fitted.per_weight_s == pytest.approx(1e-6) and fitted.seconds_per_flop == pytest.approx(2e-9)
    assert fitted.fixed_s == pytest.approx(2e-3)
    one_count = cpu_budget.fit_moe_cost(points[:2])  # one weight count: its cost is all fixed
    assert one_count.per_weight_s == 0 and one_count.seconds(1e6, 2e8) == pytest.approx(points[1][2])


def test_moe_is_calibrated_at_capped_sizes_two_token_counts_and_two_expert_counts():
    settings = _gpu_sized()
    calls = []

    def fake_run(small, show_progress):
        calls.append(small)
        rows = []
        for tokens, experts, top_k in small.cases():
            weights, flops = cpu_budget.moe_work(small, (tokens, experts, top_k))
            seconds = FUSED.seconds(weights, flops)
            rows.append(moe_bench.MoeMeasurement(
                case="", impl="llm_speed", available=True, flops=flops, bytes_moved=0, tokens=tokens,
                experts=experts, top_k=top_k, experts_hit=experts,
                timing=summarize([1e3 * seconds], HOST_TIMER),
            ))  # fmt: skip
        return rows

    costs = cpu_budget.calibrate_moe(settings, run=fake_run)
    caps = cpu_budget.CALIBRATION_MOE
    assert [(c.tokens, c.experts, c.top_k) for c in calls] == [((16, 32), (8,), (8,)), ((32,), (16,), (8,))]
    widths = {(c.hidden, c.intermediate, c.iterations) for c in calls}
    assert widths == {(caps["hidden"], caps["intermediate"], 1)}
    assert costs["llm_speed"].per_weight_s == pytest.approx(1e-6)
    assert costs["llm_speed"].seconds_per_flop == pytest.approx(1.6e-9)


def test_gpu_sized_moe_is_scaled_tokens_widths_then_experts():
    settings = _gpu_sized()
    costs = {"llm_speed": FUSED}
    scaled, (note, *merged) = cpu_budget.scale_moe(settings, costs)
    caps = cpu_budget.CALIBRATION_MOE
    assert scaled.tokens == (16,) and scaled.top_k == settings.top_k
    # the widths stop at the calibration's, the experts at the largest top_k: every top_k keeps its cases
    assert (scaled.hidden, scaled.intermediate) == (caps["hidden"], 384) and min(scaled.experts) >= 8
    assert {k for _, _, k in scaled.cases()} == {2, 8}
    assert note.startswith("CPU run: sizes scaled (tokens 2048/8192 -> 16, experts 8/64/128 -> ")
    # counts that became one are measured once, and the notes say so
    assert merged[0].startswith("CPU run: token counts merged (2048 and 8192 -> 16)")
    assert merged[1].startswith("CPU run: expert counts merged (8, 64 and 128 -> ") and len(merged) == 2
    assert cpu_budget.moe_estimate(settings, costs) > 100 * cpu_budget.moe_estimate(scaled, costs)
    # a sweep that fits is left as it is
    tiny = moe_bench.moe_settings(build_parser().parse_args(["bench", "moe", *FAST]), torch.device("cpu"))
    assert cpu_budget.scale_moe(tiny, costs) == (tiny, [])


def test_a_gpu_sized_cpu_moe_prints_its_scaling_and_estimate_first(monkeypatch, capsys):
    slow = cpu_budget.MoeCost(fixed_s=0.0, per_weight_s=0.0, seconds_per_flop=1e-6)
    monkeypatch.setattr(cpu_budget, "calibrate_moe", lambda settings: {"grouped_mm": slow})
    argv = ["bench", "moe", "--tokens", "4096", "--experts", "4", "--top-k", "2", "--hidden", "64",
            "--intermediate", "32", "--device", "cpu", "--impl", "grouped_mm", "--warmup", "0",
            "--iterations", "1", "--no-progress", "--json"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    rows = json.loads(captured.out)["results"]
    assert "CPU run: sizes scaled (tokens 4096 -> " in captured.err and "estimated run time" in captured.err
    assert len(rows) == 1 and rows[0]["tokens"] < 4096 and rows[0]["available"]
