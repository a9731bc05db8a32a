"""benchmarks/attention_ab.py's timing loop on the CPU, its calls and timer stood in: what it records when it
runs to the end, when its budget runs out, when a candidate raises and when the suite's cap interrupts it.
Before, the JSON was written once per round of every candidate: a first round cut by the cap (the round that
compiles every candidate's kernels) left nothing, and a short budget left no candidate with two rounds."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from llm_speed.core.policy import CANDIDATES, SHIPPED, current_policy

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "attention_ab.py"


@pytest.fixture
def ab(monkeypatch):
    spec = importlib.util.spec_from_file_location("attention_ab_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    made = []
    monkeypatch.setattr(module, "make_call", lambda target, _: made.append(target["op"]) or (lambda: None))
    module.made = made
    return module


def _timer(ms_shipped=2.0, ms_candidate=1.0, interrupt_at=None):
    calls = []

    def timer(fn):
        calls.append(1)
        if interrupt_at is not None and len(calls) >= interrupt_at:
            raise KeyboardInterrupt
        return ms_shipped if current_policy() == SHIPPED else ms_candidate

    return timer


def _clock(step):
    now = [0.0]

    def clock():
        now[0] += step
        return now[0]

    return clock


def test_every_round_of_every_candidate(ab, tmp_path):
    names = ["forward-overlap", "rows32", "backward-atomic-dq"]
    path = tmp_path / "ab.json"
    order = []

    def timer(fn):
        order.append("shipped" if current_policy() == SHIPPED else "candidate")
        return 2.0 if order[-1] == "shipped" else 1.0

    code = ab.run([CANDIDATES[n] for n in names], 3, float("inf"), str(path), device="cpu", timer=timer,
                  clock=_clock(0.0))  # fmt: skip
    record = json.loads(path.read_text())
    assert code == 0 and record["stopped"] is None and record["device"] == "cpu"
    for name in names:
        entry = record["candidates"][name]
        assert entry["shipped_ms"] == [2.0] * 3 and entry["candidate_ms"] == [1.0] * 3
        assert entry["ratio"] == 2.0
    assert len(ab.made) == 3  # each target's inputs made once, when its candidate starts
    # one candidate's rounds after the other, the pairs alternating which policy runs first
    assert order[:6] == ["shipped", "candidate", "candidate", "shipped", "shipped", "candidate"]


def test_the_budget_stops_between_candidates_and_keeps_what_was_timed(ab, tmp_path):
    names = ["forward-overlap", "rows32", "backward-atomic-dq"]
    path = tmp_path / "ab.json"
    # every clock read advances 10 s: the first candidate always runs (all its rounds), the budget of 5 s
    # stops the second from starting
    code = ab.run([CANDIDATES[n] for n in names], 3, 5.0, str(path), device="cpu", timer=_timer(),
                  clock=_clock(10.0))  # fmt: skip
    record = json.loads(path.read_text())
    assert code == 0
    first = record["candidates"]["forward-overlap"]
    assert first["ratio"] == 2.0 and len(first["candidate_ms"]) == 3
    assert record["candidates"]["rows32"]["candidate_ms"] == []
    assert record["stopped"] == "budget of 5 s spent; not timed: rows32, backward-atomic-dq"
    assert len(ab.made) == 1


def test_an_interrupt_writes_what_was_timed(ab, tmp_path):
    path = tmp_path / "ab.json"
    names = ["forward-overlap", "rows32"]
    # the seventh timing (rows32's first, after forward-overlap's three pairs) is interrupted by the cap
    code = ab.run([CANDIDATES[n] for n in names], 3, float("inf"), str(path), device="cpu",
                  timer=_timer(interrupt_at=7), clock=_clock(1.0))  # fmt: skip
    record = json.loads(path.read_text())
    assert code == 124 and record["stopped"].startswith("interrupted after")
    assert record["candidates"]["forward-overlap"]["ratio"] == 2.0
    assert record["candidates"]["rows32"]["shipped_ms"] == []


def test_a_candidate_that_raises_is_recorded_and_the_rest_go_on(ab, tmp_path):
    path = tmp_path / "ab.json"
    names = ["gluon-forward", "rows32"]
    base = _timer()

    def timer(fn):  # the Gluon candidate's kernel fails to build: a compile error on its first call
        if current_policy() == CANDIDATES["gluon-forward"].policy:
            raise RuntimeError("PassManager::run failed")
        return base(fn)

    code = ab.run([CANDIDATES[n] for n in names], 2, float("inf"), str(path), device="cpu", timer=timer,
                  clock=_clock(0.0))  # fmt: skip
    record = json.loads(path.read_text())
    assert code == 0 and record["stopped"] is None
    failed = record["candidates"]["gluon-forward"]
    assert failed["error"] == "round 1: RuntimeError: PassManager::run failed"
    assert failed["shipped_ms"] == [] and failed["candidate_ms"] == []  # no half-timed pair kept
    assert record["candidates"]["rows32"]["candidate_ms"] == [1.0, 1.0]
