"""``llm-speed bench ops``: every op x implementation as report.Measurement rows, costs from the op table,
Liger reported as not run with the reason, refusals before any work, partial results kept."""

import csv
import dataclasses
import json

import pytest
import torch

from llm_speed import fused_linear_cross_entropy, ops
from llm_speed.bench import cpu_budget, cpu_load, report
from llm_speed.bench import ops as ops_bench
from llm_speed.bench.timing import HOST_TIMER, summarize
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


# --- on a CPU: sizes scaled to the calibration calls' costs, and sizes that cannot fit refused -----------

INTERPRETED = cpu_budget.CallCost(fixed_s=0.02, seconds_per_flop=4e-8)  # the interpreter: ~25 MB/s
EAGER = cpu_budget.CallCost(fixed_s=1e-4, seconds_per_flop=2e-10)
COMPILED = cpu_budget.CallCost(fixed_s=1.5, seconds_per_flop=2e-10)  # a fixed cost over the budget


def _gpu_sized():
    """The GPU's default sizes asked for on a CPU (the CPU's dtype and run counts)."""
    sizes = ops_bench.ops_settings(build_parser().parse_args(["bench", "ops"]), torch.device("cuda"))
    flags = [f"--{name.replace('_', '-')}={getattr(sizes, name)}" for name in ops_bench.SIZE_FIELDS]
    return ops_bench.ops_settings(build_parser().parse_args(["bench", "ops", *flags]), torch.device("cpu"))


def test_gpu_sized_ops_are_scaled_tokens_first_then_each_op_s_widths():
    settings = _gpu_sized()
    costs = {op: {"llm_speed": INTERPRETED, "eager": EAGER, "torch.compile": COMPILED} for op in settings.ops}
    assert cpu_budget.ops_calibrated(settings)
    scaled, notes = cpu_budget.scale_ops(settings, costs)
    assert scaled.tokens == cpu_budget.MIN_SIZE  # every op's rows first
    def growing_part(op, sizes):
        return INTERPRETED.seconds_per_flop * cpu_budget.ops_work(op, sizes)

    # then each op's own sizes, until the part of a call that grows with them fits the budget
    assert all(growing_part(op, scaled) <= cpu_budget.CALL_SECONDS for op in settings.ops)
    # halved no further than needed: twice the tokens, or twice SwiGLU's width (its own), would not fit
    twice = dataclasses.replace(scaled, tokens=2 * scaled.tokens)
    assert any(growing_part(op, twice) > cpu_budget.CALL_SECONDS for op in settings.ops)
    # an op's own width: SwiGLU's alone, at a slower rate
    swiglu = dataclasses.replace(settings, ops=("swiglu",))
    slow = cpu_budget.CallCost(fixed_s=0.0, seconds_per_flop=1e-6)
    narrow, (note,) = cpu_budget.scale_ops(swiglu, {"swiglu": {"llm_speed": slow}})
    assert narrow.tokens == cpu_budget.MIN_SIZE and narrow.intermediate < settings.intermediate
    assert slow.seconds(cpu_budget.ops_work("swiglu", narrow)) <= cpu_budget.CALL_SECONDS
    wider = dataclasses.replace(narrow, intermediate=2 * narrow.intermediate)
    assert slow.seconds(cpu_budget.ops_work("swiglu", wider)) > cpu_budget.CALL_SECONDS
    assert f"intermediate {settings.intermediate} -> {narrow.intermediate}" in note
    assert scaled.num_heads >= scaled.num_kv_heads and scaled.head_dim % 2 == 0
    assert scaled.dtype == settings.dtype and scaled.impls == settings.impls
    (note,) = notes
    assert "tokens 8192 -> 16" in note and "vocab 128256 -> " in note and "--full-size keeps them" in note
    assert cpu_budget.ops_estimate(settings, costs) > 3600 > 60 > cpu_budget.ops_estimate(scaled, costs)
    # torch.compile's fixed 1.5 s is no reason to shrink a problem: halving cannot make it smaller
    assert cpu_budget.scale_ops(scaled, {"rms_norm": {"torch.compile": COMPILED}}) == (scaled, [])


def test_the_heads_are_halved_key_heads_first_on_a_tie():
    settings = dataclasses.replace(_gpu_sized(), ops=("rotary",), num_heads=8, num_kv_heads=8, tokens=16)
    assert cpu_budget._width_to_halve("rotary", settings) == "num_kv_heads"
    one_each = dataclasses.replace(settings, num_heads=1, num_kv_heads=1)
    assert cpu_budget._width_to_halve("rotary", one_each) == "head_dim"
    smallest = dataclasses.replace(one_each, head_dim=cpu_budget.MIN_SIZE)
    assert cpu_budget._width_to_halve("rotary", smallest) is None
    # nothing left to halve: the run keeps its sizes rather than looping
    slow = {"rotary": {"llm_speed": cpu_budget.CallCost(0, 1.0)}}
    assert cpu_budget.scale_ops(smallest, slow)[0] == smallest


def test_ops_are_calibrated_at_capped_sizes_and_two_token_counts():
    settings = _gpu_sized()
    calls = []

    def fake_run(small, show_progress):
        calls.append(small)
        seconds = {"llm_speed": 1e-8, "eager": 1e-12}
        return [
            ops_bench.OpsMeasurement(
                case=op, impl=impl, available=True, op=op, shape="", flops=0, bytes_moved=0,
                timing=summarize([1e3 * (1e-3 + per * cpu_budget.ops_work(op, small))], HOST_TIMER),
            )
            for op in small.ops for impl, per in seconds.items()
        ]  # fmt: skip

    costs = cpu_budget.calibrate_ops(settings, run=fake_run)
    caps = cpu_budget.CALIBRATION_OPS
    assert [c.tokens for c in calls] == [caps["tokens"] // 2, caps["tokens"]]
    assert all(c.hidden == caps["hidden"] and c.vocab == caps["vocab"] and c.iterations == 1 for c in calls)
    assert set(costs) == set(settings.ops)
    for op in settings.ops:  # the fixed cost and the cost per unit of work, fitted (their rows: 1 ms + ...)
        assert costs[op]["llm_speed"].seconds_per_flop == pytest.approx(1e-8)
        assert costs[op]["llm_speed"].fixed_s == pytest.approx(1e-3)
        # a call that is mostly fixed cost is fitted with at least half its time growing with the work
        work = cpu_budget.ops_work(op, calls[-1])
        assert costs[op]["eager"].seconds(work) == pytest.approx(1e-3 + 1e-12 * work)
        assert costs[op]["eager"].seconds_per_flop * work >= (1e-3 + 1e-12 * work) / 2
    # the CPU defaults are smaller than the calibration call: not calibrated, not scaled
    assert not cpu_budget.ops_calibrated(_settings())


def test_the_memory_floor_is_inputs_outputs_and_gradients():
    s = _settings()  # 3 tokens, hidden 40, intermediate 24, heads 2/1 x 16, vocab 50, fp32
    assert ops_bench.memory_floor("rms_norm", s) == 4 * (3 * 40 * 4 + 40 * 2)  # x, dx, y, dy; w, dw
    assert ops_bench.memory_floor("swiglu", s) == 6 * 3 * 24 * 4  # gate, up, their gradients, out, dout
    assert ops_bench.memory_floor("rotary", s) == 4 * (4 * 3 * 3 * 16 + 2 * 3 * 16)  # q, k x4; cos, sin
    ce = 4 * (3 * 40 + 50 * 40) * 2 + 8 * 3
    assert ops_bench.memory_floor("linear_cross_entropy", s) == ce
    estimate = cross_entropy.memory_estimate(3, 40, 50, 4)
    assert ops_bench.memory_floor("linear_cross_entropy", s, "eager") == ce + estimate["unfused_bytes"]
    assert ops_bench.memory_floor("linear_cross_entropy", s, "llm_speed") == ce + estimate["fused_bytes"]
    assert ops_bench.memory_floor("rms_norm", s, "eager") == ops_bench.memory_floor("rms_norm", s)
    assert ops_bench.memory_refusal(s, None) is None
    assert ops_bench.memory_refusal(s, ce) is None
    reason = ops_bench.memory_refusal(s, ce - 1)
    assert reason.startswith("sizes: linear_cross_entropy at --tokens 3 --hidden 40 --vocab 50 needs at ")


def test_a_size_that_cannot_fit_is_refused_before_any_work(monkeypatch, capsys):
    monkeypatch.setattr(cpu_load, "available_memory", lambda: 10**6)
    ran = []
    monkeypatch.setattr(cpu_budget, "calibrate_ops", lambda *a, **k: ran.append("calibration"))
    monkeypatch.setattr(ops_bench, "run_ops", lambda *a, **k: ran.append("run"))
    argv = ["bench", "ops", *FAST, "--hidden", "99999", "--full-size"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "sizes: rms_norm at --tokens 3 --hidden 99999 needs at least 5.6 MB" in err and "1 MB" in err
    assert not ran


def test_on_a_cpu_a_row_that_cannot_fit_is_not_run_and_the_others_are(monkeypatch):
    s = dataclasses.replace(_settings(), ops=("linear_cross_entropy",), impls=("llm_speed", "eager"))
    fused = ops_bench.memory_floor("linear_cross_entropy", s, "llm_speed")
    assert fused < ops_bench.memory_floor("linear_cross_entropy", s, "eager")
    monkeypatch.setattr(report, "cpu_memory", lambda device: fused)
    ours, eager = ops_bench.run_ops(s, show_progress=False)
    assert ours.available, ours.reason
    assert not eager.available and eager.reason.startswith("needs at least ")
    assert eager.reason.endswith("available on this CPU")


def test_a_gpu_sized_cpu_run_prints_its_scaling_and_estimate_first(monkeypatch, capsys):
    monkeypatch.setattr(ops_bench, "liger_installed", lambda: False)
    costs = {op: {"llm_speed": INTERPRETED, "eager": EAGER} for op in ops_bench.OP_NAMES}
    monkeypatch.setattr(cpu_budget, "calibrate_ops", lambda settings: costs)
    argv = ["bench", "ops", "--device", "cpu", "--tokens", "4096", "--hidden", "4096", "--impl", "eager",
            "--ops", "rms_norm", "--warmup", "0", "--iterations", "1", "--no-progress", "--json"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    asked = ops_bench.ops_settings(build_parser().parse_args(argv), torch.device("cpu"))
    scaled, _ = cpu_budget.scale_ops(asked, costs)
    assert scaled.tokens < 4096 and scaled.hidden == 4096
    assert [row["shape"] for row in document["results"]] == [f"{scaled.tokens}x4096"]
    assert f"tokens 4096 -> {scaled.tokens}" in captured.err
    assert "estimated run time on this CPU" in captured.err


def test_available_memory_is_the_smaller_of_the_system_s_and_the_cgroup_s(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       32000000 kB\nMemAvailable:   2000000 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert cpu_load.available_memory(str(meminfo), str(cgroup)) == 2000000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    assert cpu_load.available_memory(str(meminfo), str(cgroup)) == 2000000 * 1024
    (cgroup / "memory.max").write_text("1000000000\n")
    (cgroup / "memory.current").write_text("400000000\n")
    assert cpu_load.available_memory(str(meminfo), str(cgroup)) == 600000000
    assert cpu_load.available_memory(str(tmp_path / "none"), str(tmp_path / "none")) > 0  # sysconf's
