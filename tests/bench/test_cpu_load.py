"""CPU timings worth reading: a pinned thread count, and a busy machine said so instead of ratios printed.

The machine's real load is never under test: the yardstick's clocks are simulated (a thread that gets half
of each wall-clock millisecond is a busy machine), so these tests pass on an idle and on a loaded CPU.
"""

import functools
import json

import pytest
import torch

from llm_speed import demo
from llm_speed.bench import cpu_load, report
from llm_speed.bench.timing import HOST_TIMER, measure, summarize
from llm_speed.cli import main

FAST = ["--device", "cpu", "--warmup", "0", "--iterations", "1", "--min-time", "0", "--no-progress"]


class FakeClocks:
    """A wall clock and a thread CPU clock; each yardstick round advances them by ``wall_ms`` and
    ``cpu_share * wall_ms``."""

    def __init__(self, wall_ms: float, cpu_share: float) -> None:
        self.wall, self.cpu, self.wall_ms, self.cpu_share = 0.0, 0.0, wall_ms, cpu_share

    def workload(self) -> None:
        self.wall += self.wall_ms * 1e-3
        self.cpu += self.cpu_share * self.wall_ms * 1e-3

    def yardstick(self) -> cpu_load.Yardstick:
        return cpu_load.measure_yardstick(self.workload, clock=lambda: self.wall, cpu_clock=lambda: self.cpu)


def simulate(monkeypatch, *, cpu_share: float, wall_ms: float = 5.0) -> None:
    monkeypatch.setattr(cpu_load, "probe", FakeClocks(wall_ms, cpu_share).yardstick)


def row(impl, times, case="16x16x16"):
    return report.Measurement(case=case, impl=impl, available=True, flops=1.0, bytes_moved=1.0,
                              timing=summarize(list(times), HOST_TIMER))  # fmt: skip


def test_the_yardstick_reads_both_clocks():
    busy = FakeClocks(10.0, 0.5).yardstick()
    assert busy.wall_ms == pytest.approx(10.0) and busy.cpu_share == pytest.approx(0.5)
    assert busy.rounds == cpu_load.YARDSTICK_ROUNDS
    real = cpu_load.measure_yardstick(rounds=2)  # the real workload and clocks: a time, a share in (0, 1]
    assert real.wall_ms > 0 and 0 < real.cpu_share <= 1


def test_a_quiet_machine_is_not_busy_and_each_sign_of_load_is_named():
    quiet = cpu_load.Yardstick(wall_ms=5.0, cpu_share=0.98, rounds=7)
    steady = [row("a", [1.0, 1.01, 1.02, 1.03, 1.05])]
    verdict = cpu_load.assess(quiet, quiet, steady)
    assert not verdict.busy and verdict.reasons == () and "quiet" in verdict.note()
    starved = cpu_load.Yardstick(wall_ms=5.0, cpu_share=0.5, rounds=7)
    assert cpu_load.assess(starved, quiet).reasons == ("a fixed workload got 50% of a core before the run",)
    slower = cpu_load.Yardstick(wall_ms=8.0, cpu_share=0.98, rounds=7)
    (drift,) = cpu_load.assess(quiet, slower).reasons
    assert "5 ms before the run and 8 ms after" in drift
    wide = [row("naive", [1.0, 1.0, 2.0, 3.0, 3.0], case="seq=128"), *steady]
    (spread,) = cpu_load.assess(quiet, quiet, wide).reasons
    assert spread.startswith("1 of 2 rows spread more than 1.5x") and "naive seq=128" in spread
    busy = cpu_load.assess(starved, slower, wide)
    assert busy.busy and len(busy.reasons) == 3 and "no ratio between them is printed" in busy.note()


def test_timed_runs_use_the_pinned_thread_count_and_restore_it():
    seen = []
    before = torch.get_num_threads()
    other = 2 if cpu_load.CPU_TIMING_THREADS != 2 else 3
    torch.set_num_threads(other)
    try:
        measure(lambda: seen.append(torch.get_num_threads()), warmup=1, iterations=2, device="cpu")
        assert set(seen) == {cpu_load.CPU_TIMING_THREADS} and torch.get_num_threads() == other
        seen.clear()
        measure(lambda: seen.append(torch.get_num_threads()), iterations=1, device="cpu", threads=None)
        assert set(seen) == {other}
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="threads: expected an integer >= 1 or None"):
        measure(lambda: None, device="cpu", threads=0)


def _bench_gemm(tmp_path, capsys):
    out = tmp_path / "gemm.json"
    assert main(["bench", "gemm", *FAST, "--sizes", "16x16x16", "--output", str(out)]) == 0
    return capsys.readouterr().out, json.loads(out.read_text())


def test_a_busy_machine_is_said_so_and_no_ratio_is_printed(tmp_path, capsys, monkeypatch):
    simulate(monkeypatch, cpu_share=0.45)
    printed, document = _bench_gemm(tmp_path, capsys)
    assert "machine was busy during the run (a fixed workload got 45% of a core before the run" in printed
    assert "vs fastest other" not in printed and "% [" not in printed and "within noise" not in printed
    assert document["cpu_load"]["busy"] is True and document["cpu_load"]["threads"] == 1
    for record in document["results"]:
        assert record["timing"]["median_ms"] > 0  # the times are kept ...
        for name in ("speedup_vs_fastest_other", "speedup_range", "percent_of_baseline", "fastest_other"):
            assert record[name] is None, name  # ... their ratios are not


def test_a_quiet_machine_prints_its_ratios(tmp_path, capsys, monkeypatch):
    simulate(monkeypatch, cpu_share=1.0)
    printed, document = _bench_gemm(tmp_path, capsys)
    assert "the machine was quiet" in printed and "busy" not in printed
    assert "vs fastest other" in printed
    assert document["cpu_load"]["busy"] is False
    assert all(record["speedup_vs_fastest_other"] is not None for record in document["results"])


def test_the_demo_on_a_cpu_prints_no_ratio_column(capsys):
    rows = [row("flash", [79.9]), row("naive", [0.397])]
    report.add_comparisons(rows, None, "fp32", "cpu")
    assert rows[1].speedup_vs_fastest_other == pytest.approx(79.9 / 0.397)  # the "201x" of a busy CPU
    demo._compact_table("t", rows, torch.device("cpu"), report.output_console())
    printed = capsys.readouterr().out
    assert "79.9" in printed and "vs fastest other" not in printed and "201" not in printed


def test_the_demo_on_a_busy_cpu_withholds_ratios_and_ranks_nothing(monkeypatch):
    simulate(monkeypatch, cpu_share=0.3)
    rows = [row("flash", [79.9]), row("naive", [0.397])]

    def run():
        report.add_comparisons(rows, None, "fp32", "cpu")
        return rows

    measured, verdict = cpu_load.watched_run(torch.device("cpu"), run)
    assert verdict.busy and all(r.speedup_vs_fastest_other is None for r in measured)
    for r in measured:
        r.seq_len = 128
    lines = demo._takeaways(measured, [], torch.device("cpu"), busy=verdict.busy)
    assert not any("fastest first" in line for line in lines)
    assert any("fastest first" in line for line in demo._takeaways(measured, [], torch.device("cpu")))


def test_a_gpu_run_is_not_watched(monkeypatch):
    monkeypatch.setattr(cpu_load, "probe", functools.partial(pytest.fail, "the yardstick ran for a GPU"))
    with cpu_load.watch(torch.device("cuda")) as watched:
        pass
    assert watched.verdict([]) is None


def test_bench_op_and_overhead_print_no_ratio_on_a_busy_machine(capsys, monkeypatch):
    simulate(monkeypatch, cpu_share=0.4)
    assert main(["bench", "op", "rms_norm", "--device", "cpu", "--size", "16", "--warmup", "0",
                 "--iterations", "1"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert "machine was busy" in printed and "speed-up vs baseline" not in printed
    assert main(["bench", "overhead", "--device", "cpu", "--ops", "rms_norm", "--modes", "inference",
                 "--calls", "2", "--repeats", "1", "--json"]) == 0  # fmt: skip
    captured = capsys.readouterr()
    document = json.loads(captured.out)
    assert document["cpu_load"]["busy"] is True and "machine was busy" in captured.err
    assert all(row["vs_baseline"] is None and row["vs_sdpa"] is None for row in document["results"])
