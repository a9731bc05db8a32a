"""``llm-speed bench moe``: tokens x experts x top_k cases, three implementations (the fused layer, a
torch._grouped_mm version, Hugging Face's loop) as report.Measurement rows with the op table's costs; the
torch._grouped_mm version is right; bad settings refused before any work."""

import json

import pytest
import torch

from llm_speed import ops
from llm_speed.bench import moe as moe_bench
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
