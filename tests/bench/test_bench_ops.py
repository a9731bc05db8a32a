"""``llm-speed bench ops``: every op x implementation as report.Measurement rows, costs from the op table,
Liger reported as not run with the reason, refusals before any work, partial results kept."""

import csv
import json

import pytest
import torch

from llm_speed import fused_linear_cross_entropy, ops
from llm_speed.bench import ops as ops_bench
from llm_speed.bench import report
from llm_speed.cli import build_parser, main
from llm_speed.core import runtime
from llm_speed.fused import cross_entropy, cross_entropy_kernels, rms_norm, rotary, swiglu
from llm_speed.profiler import CUDAProfiler

TINY = (
    "--tokens 3 --hidden 40 --intermediate 24 --num-heads 2 --num-kv-heads 1 --head-dim 16 --vocab 50".split()
)
FAST = [*TINY, "--device", "cpu", "--dtype", "fp32", "--warmup", "0", "--iterations", "1", "--no-progress"]


def _settings(*flags):
    args = build_parser().parse_args(["bench", "ops", *FAST, *flags])
    return ops_bench.ops_settings(args, torch.device("cpu"))


def test_cli_writes_every_op_and_impl_to_json_and_csv(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ops_bench, "liger_installed", lambda: False)
    out, table = tmp_path / "ops.json", tmp_path / "ops.csv"
    before = runtime.launch_counts()
    impls = ("llm_speed", "eager", "liger")  # torch.compile (seconds per op on a CPU): the next test
    argv = ["bench", "ops", *FAST, "--impl", *impls, "--json", "--output", str(out), "--csv", str(table)]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document == json.loads(out.read_text()) and document["complete"] is True
    assert document["benchmark"] == "ops" and document["environment"]["device_type"] == "cpu"
    rows = document["results"]
    assert [(r["op"], r["impl"]) for r in rows] == [(op, impl) for op in ops_bench.OP_NAMES for impl in impls]
    for row in rows:
        if row["impl"] == "liger":
            assert not row["available"] and row["reason"] == ops_bench.LIGER_NOT_INSTALLED
        else:
            assert row["available"], row["reason"]
            assert row["timing"]["median_ms"] > 0 and row["bandwidth_gb_s"] > 0
            assert (
                row["hbm_peak_fraction"] is None and row["predicted_ms"] is None
            )  # no GPU: no peak, no model
            assert row["fastest_other"] is not None and row["speedup_range"] is not None
    memory = document["cross_entropy_memory"]
    assert memory["estimate"] == cross_entropy.memory_estimate(3, 40, 50, 4)
    assert memory["measured_saving_bytes"] is None and "CUDA" in memory["measured_reason"]
    with table.open() as handle:
        records = list(csv.DictReader(handle))
    assert [(r["op"], r["impl"]) for r in records] == [(r["op"], r["impl"]) for r in rows]
    assert records[0]["median_ms"] and records[-1]["reason"] == ops_bench.LIGER_NOT_INSTALLED
    if runtime.INTERPRETED:  # the llm_speed rows ran the Triton kernels, forward and backward
        ran = runtime.launch_counts() - before
        kernels = (rms_norm.FORWARD.name, rms_norm.BACKWARD.name, swiglu.BACKWARD.name, rotary.KERNEL.name,
                   cross_entropy_kernels.BACKWARD.name)  # fmt: skip
        assert all(ran[k] for k in kernels), ran


def test_costs_are_the_op_table_s_forward_plus_backward():
    settings = _settings()
    x, w = torch.empty(3, 40), torch.empty(40)
    expected = [ops.get(n).work(x=x, weight=w) for n in ("rms_norm", "rms_norm_backward")]
    assert ops_bench.op_cost("rms_norm", settings) == (
        sum(e.flops for e in expected),
        sum(e.bytes_moved for e in expected),
    )
    gate = torch.empty(3, 24)
    expected = [ops.get(n).work(gate=gate) for n in ("swiglu", "swiglu_backward")]
    assert ops_bench.op_cost("swiglu", settings) == (
        sum(e.flops for e in expected),
        sum(e.bytes_moved for e in expected),
    )
    cos = torch.empty(3, 8)
    q, k = torch.empty(1, 2, 3, 16), torch.empty(1, 1, 3, 16)
    once = [ops.get("apply_rotary").work(x=t, cos=cos) for t in (q, k)]
    assert ops_bench.op_cost("rotary", settings) == (
        2 * sum(e.flops for e in once),
        2 * sum(e.bytes_moved for e in once),
    )
    # the linear cross-entropy: what the profiler records of a mean loss's forward + backward, which makes
    # the gradients in the forward (6NVH) and scales them in the backward
    h, v = torch.randn(3, 40, requires_grad=True), torch.randn(50, 40, requires_grad=True)
    profiler = CUDAProfiler(torch.device("cpu"))
    with profiler.profile("ce"):
        fused_linear_cross_entropy(h, v, torch.tensor([1, 7, 49])).backward()
    recorded = profiler.get_metrics("ce")
    flops, moved = ops_bench.op_cost("linear_cross_entropy", settings)
    assert (flops, moved) == (recorded.flops, recorded.bytes_moved)
    assert flops == 6 * 3 * 50 * 40 + 8 * 3 * 50 + (3 + 50) * 40


def test_torch_compile_runs_and_liger_installed_without_cuda_is_not_run(monkeypatch):
    monkeypatch.setattr(ops_bench, "liger_installed", lambda: True)
    settings = _settings("--impl", "liger", "eager", "torch.compile", "--ops", "swiglu")
    liger, eager, compiled = ops_bench.run_ops(settings, show_progress=False)
    assert not liger.available and "need a CUDA device" in liger.reason and liger.flops == eager.flops
    assert compiled.available and compiled.timing.median_ms > 0, compiled.reason
    assert eager.fastest_other == "torch.compile" and compiled.fastest_other == "eager"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--head-dim", "15"], "head_dim"),
        (["--output", "/nonexistent-llm-speed/dir/o.json"], "--output: folder /nonexistent-llm-speed/dir"),
        (["--csv", "/nonexistent-llm-speed/dir/o.csv"], "--csv: folder /nonexistent-llm-speed/dir"),
    ],
)
def test_bad_values_are_refused_before_any_work(flags, message, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(ops_bench, "run_ops", lambda *a, **k: ran.append(1))
    assert main(["bench", "ops", *FAST, *flags]) == 2
    assert message in capsys.readouterr().err and not ran


@pytest.mark.parametrize("flags", [["--ops", "softmax"], ["--impl", "triton"], ["--tokens", "0"], ["--impl"]])
def test_bad_flags_are_refused_by_the_parser(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["bench", "ops", *flags])
    assert exit_info.value.code == 2 and flags[0] in capsys.readouterr().err


def test_a_failing_implementation_is_reported_and_an_interrupt_keeps_the_finished_rows(tmp_path, monkeypatch):
    def broken(gate, up):
        raise RuntimeError("no kernel for this shape")

    monkeypatch.setitem(ops_bench.EAGER, "swiglu", broken)
    out, table = tmp_path / "o.json", tmp_path / "o.csv"
    real_run, calls = report.run_measurement, []

    def run_then_interrupt(row, build, **kwargs):
        calls.append(row.impl)
        if len(calls) > 4:  # Ctrl-C during the third op
            raise KeyboardInterrupt
        return real_run(row, build, **kwargs)

    monkeypatch.setattr(report, "run_measurement", run_then_interrupt)
    argv = ["bench", "ops", *FAST, "--impl", "llm_speed", "eager", "--output", str(out), "--csv", str(table)]
    with pytest.raises(KeyboardInterrupt):
        main(argv)
    payload = json.loads(out.read_text())
    assert payload["complete"] is False
    rows = payload["results"]
    assert [(r["op"], r["impl"], r["available"]) for r in rows] == [
        ("rms_norm", "llm_speed", True), ("rms_norm", "eager", True),
        ("swiglu", "llm_speed", True), ("swiglu", "eager", False),
    ]  # fmt: skip
    assert rows[3]["reason"] == "RuntimeError: no kernel for this shape"
    with table.open() as handle:
        assert len(list(csv.DictReader(handle))) == 4


def test_gpu_defaults_are_a_llama_3_8b_layer_at_8192_tokens():
    args = build_parser().parse_args(["bench", "ops"])
    settings = ops_bench.ops_settings(args, torch.device("cuda"))
    assert (settings.tokens, settings.hidden, settings.intermediate, settings.vocab) == (
        8192,
        4096,
        14336,
        128256,
    )
    assert (settings.num_heads, settings.num_kv_heads, settings.head_dim, settings.dtype) == (
        32,
        8,
        128,
        "bf16",
    )
    assert settings.ops == ops_bench.OP_NAMES and settings.impls == ops_bench.IMPLS
