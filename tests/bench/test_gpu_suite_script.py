"""benchmarks/run_gpu_suite.sh and its summary writer, run on the CPU (SUITE_ALLOW_CPU=1 tests plumbing)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "run_gpu_suite.sh"
needs_bash = pytest.mark.skipif(
    shutil.which("bash") is None or shutil.which("timeout") is None, reason="needs bash and coreutils timeout"
)


STEPS = ("quick", "tests", "bench", "fused", "probe")
# A device command may run 600 s; the machine's start (about 90 s) is not counted in it (it is in the
# session's 30 device minutes). 540 s keeps a minute of margin.
DEVICE_COMMAND_LIMIT_S = 540


def _suite(tmp_path, *args):
    env = {**os.environ, "PYTHON": sys.executable, "LLM_SPEED_GIT_COMMIT": "0123abc", "TMPDIR": str(tmp_path)}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300,
                          check=False)  # fmt: skip


@needs_bash
@pytest.mark.parametrize("step", STEPS)
def test_every_device_command_completes_in_cpu_check_mode(tmp_path, step):
    """The CPU dry run of each device command: doctor and versions run, every pytest command collects, every
    benchmark line parses with the real CLI; the output is three flat files, as a device command returns."""
    out = tmp_path / "out"
    result = _suite(tmp_path, "--check", step, str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "summary.json", "summary.txt"]
    assert all(
        p.stat().st_size < 16 * 2**20 for p in out.iterdir()
    )  # a device command returns <= 16 MiB each
    summary = json.loads((out / "summary.json").read_text())
    assert summary["git_commit"] == "0123abc" and summary["versions"]["torch"]
    assert summary["steps"] and all(s["status"] == "passed" for s in summary["steps"]), summary["steps"]
    assert not list(tmp_path.glob("llm-speed-suite.*"))  # the raw folder is removed once packed
    with tarfile.open(out / "results.tar.gz") as archive:
        logs = {
            Path(n).name: archive.extractfile(n).read().decode()
            for n in archive.getnames()
            if n.endswith(".log")
        }
    assert {f"{s['step']}.log" for s in summary["steps"]} <= set(logs)
    if step == "quick":
        assert {s["step"] for s in summary["steps"]} == {"doctor", "pytest_quick"}
        collected = re.search(r"(\d+)/\d+ tests collected", logs["pytest_quick.log"])
        assert collected and 25 <= int(collected.group(1)) <= 40, logs["pytest_quick.log"][-500:]
    elif step == "tests":
        for name in ("pytest_attention", "pytest_matmul", "pytest_rest"):
            assert (
                re.search(r"\d+ tests collected", logs[f"{name}.log"]) and "ERROR" not in logs[f"{name}.log"]
            )
    elif step == "bench":
        assert "does not parse" not in result.stdout and result.stdout.count("parses: llm-speed") >= 15
    elif step == "probe":  # the scripts import and parse their options (they need CUDA to run)
        assert {s["step"] for s in summary["steps"]} == {"host_in_bench", "attention_ab"}
        assert "--output" in logs["host_in_bench.log"] and "--backward-tiles" in logs["attention_ab.log"]
    else:
        assert {s["step"] for s in summary["steps"]} == {"bench_ops", "bench_train_step", "bench_moe"}
        assert "does not parse" not in result.stdout
        assert "parses: llm-speed bench ops" in logs["bench_ops.log"]
        assert "parses: llm-speed bench train-step --model llama-3-8b" in logs["bench_train_step.log"]


@needs_bash
def test_sub_step_caps_fit_each_device_command(tmp_path):
    """Each step's caps (dry run) sum to at most its budget, which fits one device command with margin."""
    for step in STEPS:
        result = _suite(tmp_path, "--dry-run", step)
        assert result.returncode == 0, result.stderr
        caps = [int(cap) for cap in re.findall(r"\] cap (\d+)s:", result.stdout)]
        assert caps, result.stdout
        background = 60 if step == "quick" else 0  # quick's doctor runs beside its tests
        # + the kill grace and the versions/packing around them
        assert sum(caps) - background + 30 <= DEVICE_COMMAND_LIMIT_S, (step, caps)
    assert _suite(tmp_path, "--dry-run", "everything").returncode == 2
    assert not list(tmp_path.glob("llm-speed-suite.*"))  # a dry run writes nothing


@needs_bash
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_a_real_run_without_a_gpu_is_refused(tmp_path):
    result = _suite(tmp_path, "quick", str(tmp_path / "out"))
    assert result.returncode == 2 and "no CUDA GPU" in result.stderr


def test_summary_names_failed_timed_out_and_skipped_steps(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    out.mkdir()
    (raw / "summary.tsv").write_text(
        "step\texit_code\tseconds\tcap_s\n"
        "doctor\t0\t9\t60\npytest\t1\t150\t200\nattention_fwd\t124\t45\t45\ndemo\tskipped\t0\t3\n"
    )
    (raw / "environment.txt").write_text("date_utc: 2026-01-01T00:00:00Z\ngit_commit: abc\n")
    (raw / "versions.json").write_text('{"torch": "2.11.0"}')
    (raw / "pytest.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.a" name="test_skip"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    (raw / "gemm_int8.json").write_text(
        json.dumps(
            {
                "results": [
                    {"impl": "llm-speed", "available": True},
                    {"impl": "torch._int_mm", "available": False, "reason": "not on this GPU"},
                ]
            }
        )
    )
    (raw / "decode_gqa_b1.json").write_text(
        json.dumps(
            {
                "results": [
                    {"impl": "kvcache", "available": True, "graph_reason": None},
                    {"impl": "sdpa", "available": True, "graph_reason": "capture failed: RuntimeError: x"},
                    {"impl": "kvcache-fp8", "available": True, "graph_reason": "not asked for (--no-graph)"},
                ]
            }
        )
    )
    (raw / "pytest.log").write_text("FAILED tests/a.py::test_bad\n1 failed, 1 passed, 1 skipped\n")
    subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "suite_summary.py"), str(raw), str(out)],
        check=True,
        timeout=60,
    )
    summary = json.loads((out / "summary.json").read_text())
    statuses = {s["step"]: s["status"] for s in summary["steps"]}
    assert statuses == {
        "doctor": "passed",
        "pytest": "failed",
        "attention_fwd": "timed out after 45 s",
        "demo": "skipped (budget spent)",
    }
    assert summary["pytest"]["passed"] == 1 and summary["pytest"]["failed_tests"] == ["tests.a::test_bad"]
    assert summary["benchmarks"]["gemm_int8.json"] == {
        "rows": 2,
        "rows_run": 1,
        "not_run": {"torch._int_mm": "not on this GPU"},
    }
    assert summary["benchmarks"]["decode_gqa_b1.json"] == {
        "rows": 3,
        "rows_run": 3,
        "not_run": {},
        "graph_failed": {"sdpa": "capture failed: RuntimeError: x"},
    }
    text = (out / "summary.txt").read_text()
    assert "FAILED tests.a::test_bad" in text and "timed out" in text and "1 failed, 1 passed" in text


def test_git_commit_from_the_environment_wins(monkeypatch):
    from llm_speed.bench.report import git_commit

    monkeypatch.setenv("LLM_SPEED_GIT_COMMIT", "feedbeef")
    assert git_commit() == ("feedbeef", None)
    monkeypatch.delenv("LLM_SPEED_GIT_COMMIT")
    commit, reason = git_commit(Path("/"))
    assert commit is None and "git" in reason


def test_plan_lists_each_command_with_a_timeout_that_fits():
    """docs/guides/gpu-plan.md gives each step's device command and timeout_s: each timeout covers the
    step's budget with margin, and the correctness sequence (quick, tests, bench) with three cold starts fits
    25 of the 30 device minutes; the optional fused step fits one command on its own."""
    plan = (REPO / "docs" / "guides" / "gpu-plan.md").read_text()
    script = SCRIPT.read_text()
    start_s, overhead_s = 90, 30  # a cold machine's start; versions, kill grace and packing
    total = 0
    for step in STEPS:
        row = re.search(rf"run_gpu_suite\.sh {step} \$OUT` \| (\d+) \|", plan)
        budget = re.search(rf"{step}\) BUDGET=(\d+);", script)
        assert row and budget, step
        timeout_s, budget_s = int(row.group(1)), int(budget.group(1))
        assert budget_s + overhead_s + 30 <= timeout_s <= 600, step
        assert budget_s + overhead_s <= DEVICE_COMMAND_LIMIT_S, step
        if step not in ("fused", "probe"):  # (optional steps: each fits one command on its own)
            total += start_s + budget_s + overhead_s
    assert total <= 25 * 60
