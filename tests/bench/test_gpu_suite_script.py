"""benchmarks/run_gpu_suite.sh and its summary writer, run on the CPU (SUITE_ALLOW_CPU=1 tests plumbing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "run_gpu_suite.sh"
needs_bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils timeout")


@needs_bash
def test_suite_leaves_three_files_with_summaries_and_archive(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "SUITE_ALLOW_CPU": "1", "SUITE_STEPS": "doctor",
           "LLM_SPEED_GIT_COMMIT": "0123abc", "TMPDIR": str(tmp_path)}
    result = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    # Few files at the top (a leased machine sends back at most 8), none of them deeper.
    assert sorted(p.name for p in out.iterdir()) == ["results.tar.gz", "summary.json", "summary.txt"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["git_commit"] == "0123abc"
    assert summary["versions"]["torch"] and "cuda_available" in summary["versions"]
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [("doctor", "passed")]
    with tarfile.open(out / "results.tar.gz") as archive:
        names = {Path(n).name for n in archive.getnames()}
        doctor = json.load(archive.extractfile("./doctor.json"))
    assert {"doctor.json", "doctor.log", "environment.txt", "versions.json", "summary.tsv"} <= names
    assert doctor  # the step's own output travelled
    assert "doctor" in (out / "summary.txt").read_text()
    assert not list(tmp_path.glob("llm-speed-suite.*"))  # the raw folder is removed once packed


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
    (raw / "gemm_int8.json").write_text(json.dumps({"results": [
        {"impl": "llm-speed", "available": True},
        {"impl": "torch._int_mm", "available": False, "reason": "not on this GPU"},
    ]}))
    (raw / "pytest.log").write_text("FAILED tests/a.py::test_bad\n1 failed, 1 passed, 1 skipped\n")
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "suite_summary.py"), str(raw), str(out)],
                   check=True, timeout=60)
    summary = json.loads((out / "summary.json").read_text())
    statuses = {s["step"]: s["status"] for s in summary["steps"]}
    assert statuses == {"doctor": "passed", "pytest": "failed", "attention_fwd": "timed out after 45 s",
                        "demo": "skipped (budget spent)"}
    assert summary["pytest"]["passed"] == 1 and summary["pytest"]["failed_tests"] == ["tests.a::test_bad"]
    assert summary["benchmarks"]["gemm_int8.json"] == {
        "rows": 2, "rows_run": 1, "not_run": {"torch._int_mm": "not on this GPU"}
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
