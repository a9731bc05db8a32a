"""``llm-speed bench overhead``: every public op's per-call cost beside PyTorch's, on the CUDA code path with
the launch stubbed; the CLI, its JSON, and a regression guard on the per-call cost."""

from __future__ import annotations

import json
import time

import pytest
import torch

from llm_speed import cli
from llm_speed.bench import overhead
from llm_speed.bench.options import OVERHEAD_OPS

# CI's 2 shared cores are noisy: the guard allows this much over the targets (2.5x / 3x SDPA). A
# regression to Triton's generic launch path or to the custom-op dispatch costs 3-10x, far past it.
NOISE = 1.6
ROUNDS = 5
CPU = torch.device("cpu")


def test_every_public_op_has_a_case_with_a_pytorch_baseline():
    import llm_speed
    from llm_speed import flash_attn_interface

    assert overhead.OPS == OVERHEAD_OPS
    by_name = {case.name: case for case in overhead.CASES}
    for case in overhead.CASES:
        if case.wrapper:  # flash-attn's interface, against llm-speed's own entry point on the same tensors
            baseline = by_name[case.baseline]
            assert hasattr(flash_attn_interface, case.name) and case.name in flash_attn_interface.__all__
            assert baseline.ours and (baseline.entry_point or hasattr(llm_speed, baseline.name))
        elif case.baseline is not None:
            assert not by_name[case.baseline].ours and hasattr(llm_speed, case.name)
    wrapped = {"flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"}
    assert wrapped == {case.name for case in overhead.CASES if case.wrapper}


def test_the_wrappers_are_measured_against_the_entry_point_on_the_cpu_path(monkeypatch):
    """flash-attn's interface and the entry point it is held to both run on the simulated GPU path (launch
    stubbed), their target 1.1x the entry point's time, in every mode they have."""
    from llm_speed.core import launch

    simulated = []
    original = launch.simulated_gpu

    def watched():
        simulated.append(True)
        return original()

    monkeypatch.setattr(launch, "simulated_gpu", watched)
    rows = overhead.measure(CPU, ops=("flash_attn_func",), modes=("inference", "autograd", "training"),
                            calls=20, repeats=1)  # fmt: skip
    by_case = {(row.case, row.mode): row for row in rows}
    for mode in ("inference", "autograd", "training"):
        row = by_case[("flash_attn_func", mode)]
        assert row.baseline == "flash_attention (views)" and row.target == overhead.WRAPPER_TARGET
        assert row.target_of == "flash_attention (views)" and row.vs_baseline is not None
        assert ("flash_attention (views)", mode) in by_case
    # SDPA's three rows run for real; the wrapper's and its entry point's on the simulated path
    assert len(simulated) == 6


def test_per_call_cost_stays_near_the_targets():
    # Busy neighbours (the other xdist worker, the kernel budgets' compile processes) slow wall time several-
    # fold; a regression costs CPU time. So the guard counts this thread's CPU time, measures each op right
    # after its yardstick (SDPA) and baseline, and measures an op over its limit again, up to ROUNDS rounds:
    # its best ratio counts (three rounds failed once on a machine running a make test beside this one; a
    # regression fails every round).
    seen = set()
    for op in OVERHEAD_OPS:
        best = float("inf")
        for _ in range(ROUNDS):
            rows = overhead.measure(
                CPU, ops=(op,), modes=("inference",), calls=300, repeats=3, clock=time.thread_time
            )
            (row,) = [row for row in rows if row.case == op]
            assert row.us_per_call > 0 and row.vs_sdpa is not None and row.baseline is not None
            if row.target is None:
                break
            # the CPU targets are multiples of SDPA's time; flash-attn's interface, of the entry point's
            best = min(best, row.vs_sdpa if row.target_of == "SDPA" else row.vs_baseline)
            if best <= NOISE * row.target:
                break
        else:
            limit = NOISE * row.target
            pytest.fail(f"{op}: {best:.2f}x {row.target_of} a call in each of {ROUNDS} rounds "
                        f"(limit {limit:.2f}x)")
        seen.add(op)
    assert seen == set(OVERHEAD_OPS)


def test_cli_writes_json_with_provenance(tmp_path, capsys):
    path = tmp_path / "overhead.json"
    argv = ["bench", "overhead", "--ops", "rms_norm", "gemm", "--modes", "inference", "autograd", "training"]
    assert cli.main([*argv, "--calls", "20", "--repeats", "1", "--device", "cpu", "--output", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["benchmark"] == "overhead" and doc["environment"]["device_type"] == "cpu"
    cases = {(row["case"], row["mode"]) for row in doc["results"]}
    for mode in ("inference", "autograd", "training"):
        assert {("rms_norm", mode), ("gemm", mode), ("F.rms_norm", mode), ("sdpa", mode)} <= cases
    assert "per-call cost" in capsys.readouterr().out


def test_bad_choices_are_refused_before_any_work():
    with pytest.raises(ValueError, match="ops: unknown nope"):
        overhead.measure(torch.device("cpu"), ops=("nope",))
    with pytest.raises(ValueError, match="modes: unknown fast"):
        overhead.measure(torch.device("cpu"), modes=("fast",))
