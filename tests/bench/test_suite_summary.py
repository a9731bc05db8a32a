"""benchmarks/suite_summary.py on hand-made RAW folders (audit 10's feed cases): what a cut, failed, skipped
or broken run's summary says, and that no input makes it fail."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import suite_summary  # noqa: E402 - a script of benchmarks/, not a package
from summary_runs import raw_run, summarise  # noqa: E402


def _junit(tests: int, failures: int = 0, errors: int = 0, skipped: int = 0) -> str:
    cases = "".join(f'<testcase classname="t" name="t{i}"/>' for i in range(tests))
    return (f'<testsuite tests="{tests}" failures="{failures}" errors="{errors}" skipped="{skipped}">{cases}'
            "</testsuite>")  # fmt: skip


def _timed(shipped: list, candidate: list, ratio: object = None) -> dict:
    shipped_median = sorted(shipped)[len(shipped) // 2]
    candidate_median = sorted(candidate)[len(candidate) // 2]
    return {"shipped_ms": shipped, "candidate_ms": candidate, "shipped_median_ms": shipped_median,
            "candidate_median_ms": candidate_median,
            "ratio": shipped_median / candidate_median if ratio is None else ratio}  # fmt: skip


def test_a_candidate_is_proven_only_correct_to_the_end_and_faster_in_every_round(tmp_path):
    """Audit 10: a job cut at its cap left a clean junit and the candidate was "proven" (M1); 1 passed and
    176 skipped was "proven" (M2, C7); a NaN ratio was "proven" (M3); a 1.00x tie was "proven" (M8)."""
    nan = float("nan")
    cases = {  # name: (its job's row in summary.tsv or None, its junit or None, its A/B)
        "fast": ("0", _junit(3), _timed([2.0, 2.0], [1.6, 1.6])),
        "cut": ("124", _junit(1), _timed([2.0, 2.0], [1.5, 1.5])),
        "killed": ("137", _junit(1), _timed([2.0, 2.0], [1.5, 1.5])),
        "skipped": ("skipped", None, _timed([2.0, 2.0], [1.5, 1.5])),
        "running": ("running", _junit(1), _timed([2.0, 2.0], [1.5, 1.5])),
        "norow": (None, _junit(3), _timed([2.0, 2.0], [1.5, 1.5])),
        "idle": ("0", _junit(5, skipped=5), _timed([2.0, 2.0], [1.0, 1.0])),
        "thin": ("0", _junit(177, skipped=176), _timed([2.0, 2.0], [1.0, 1.0])),
        "tie": ("0", _junit(3), _timed([1.000, 1.003], [1.002, 1.000], ratio=1.0015 / 1.001)),
        "one_slow_round": ("0", _junit(3), _timed([2.0, 2.0, 1.9], [1.5, 1.5, 2.0])),
        "nan": ("0", _junit(3), _timed([nan, nan], [1.0, 1.0], ratio=nan)),
        "broken": ("1", _junit(3, failures=1), _timed([2.0, 2.0], [1.0, 1.0])),
        "slow": ("0", _junit(3), _timed([2.0, 2.0], [2.5, 2.5])),
        "raises": ("0", _junit(3), {"shipped_ms": [], "candidate_ms": [], "error": {"type": "RuntimeError"}}),
        "once": ("0", _junit(3), _timed([2.0], [1.0])),
        "late": ("0", _junit(3), {"shipped_ms": [], "candidate_ms": []}),
    }
    steps = "correct_flash\t0\t40\t120\n"
    files: dict[str, object] = {}
    for name, (code, junit, _) in cases.items():
        if code is not None:
            steps += f"cand_{name}_flash\t{code}\t{2 if name == 'killed' else 30}\t30\n"
        if junit is not None:
            files[f"pytest_cand_{name}_flash__xml"] = junit
    candidates = {name: {"target": {}, "families": ["flash"]} for name in cases}
    candidates["half"] = {"target": {}, "families": ["flash", "flash_bwd"]}  # its second family never ran
    steps += "cand_half_flash\t0\t30\t30\ncorrectness\t0\t140\t150\nab\t0\t60\t75\n"
    files["pytest_cand_half_flash__xml"] = _junit(3)
    ab = {name: timed for name, (_, _, timed) in cases.items()} | {"half": _timed([2.0, 2.0], [1.0, 1.0])}
    raw, out = raw_run(tmp_path, steps, candidates__json={"skipped_reason": None, "candidates": candidates},
                        attention_ab__json={"candidates": ab}, **files)  # fmt: skip
    summary = summarise(raw, out)
    verdicts = {v["name"]: v["verdict"] for v in summary["candidate_verdicts"]}
    assert verdicts == {
        "fast": "proven: correct, 1.25x over 2 rounds (>= 1.02x, every round faster; record its Proof)",
        "cut": "unproven: correctness cut/failed/skipped (flash: timed out after 30 s)",
        "killed": "unproven: correctness cut/failed/skipped (flash: killed (SIGKILL: out of memory?))",
        "skipped": "unproven: correctness cut/failed/skipped (flash: skipped (budget spent))",
        "running": "unproven: correctness cut/failed/skipped (flash: still running when the run ended (cut))",
        "norow": "unproven: correctness cut/failed/skipped (flash: no row in summary.tsv)",
        "idle": "unproven: ran no test in flash (every test skipped)",
        "thin": "unproven: skipped more tests than it passed in flash (1 passed, 176 skipped)",
        "tie": "unproven: within noise (1.00x)",
        "one_slow_round": "unproven: within noise (1.33x)",
        "nan": "unproven: its A/B ratio is not a number",
        "broken": "off: fails correctness",
        "slow": "off: slower (0.80x)",
        "raises": "off: its A/B raised",
        "once": "unproven: 2.00x in one round",
        "late": "unproven: not timed",
        "half": "unproven: correctness not run on every family it changes",
    }
    assert list(verdicts) == [*cases, "half"]  # in the proof's order
    # a candidate's jobs are its verdict's business: neither its rows nor its failed test are PROBLEMS, but
    # a family that ran no test is, and the A/B's error
    assert summary["problems"] == [
        "cand_idle_flash: ran no test: 5 skipped",
        "A/B of raises: {'type': 'RuntimeError'}",
    ]
    text = (out / "summary.txt").read_text()
    assert ("  nan                      unproven: its A/B ratio is not a number; correctness 3 passed, 0 "
            "failed; - -> 1 ms, -x, 2 rounds") in text  # fmt: skip
    assert "correctness 1 passed, 0 failed, 176 skipped" in text


def test_families_that_ran_no_test_are_problems(tmp_path):
    """All skipped (a capability probe that said no) "passed" and was no problem (audit 10, M2)."""
    steps = "".join(f"correct_{name}\t0\t10\t120\n" for name in ("flash", "gemm", "decode", "moe", "fused"))
    raw, out = raw_run(
        tmp_path, steps + "correctness\t0\t40\t150\n",
        pytest_correct_flash__xml=_junit(5, skipped=5),
        pytest_correct_gemm__xml=_junit(0),
        pytest_correct_decode__xml=_junit(3, skipped=2),  # ran one: not this finding's problem
        pytest_correct_moe__xml='<testsuite tests="3" fail',
        pytest_correct_fused__xml='<testsuite tests="1" failures="0" errors="1" skipped="0"><testcase '
        'classname="" name="tests.fused"><error message="collection failure"/></testcase></testsuite>',
    )  # fmt: skip
    summary = summarise(raw, out)
    assert summary["problems"] == [
        "FAILED ::tests.fused",
        "correct_flash: ran no test: 5 skipped",
        "correct_gemm: ran no test: 0 skipped",
        "correct_moe: its junit (pytest_correct_moe.xml) is unreadable",
    ]
    assert summary["families"]["correct_fused"]["passed"] == 0  # its error is not a passed test


def test_exit_codes_are_named():
    """137 was always "timed out" (a host OOM kill too) and a segfault plain "failed" (audit 10, M5)."""
    status = suite_summary.exit_status
    assert status("124", 40, 40) == "timed out after 40 s"
    assert status("137", 54, 40 + 15) == status("137", 54, 55) == "timed out after 55 s"
    assert status("137", 2, 40) == "killed (SIGKILL: out of memory?)"
    assert status("-9", 2, 40) == "killed (SIGKILL: out of memory?)"
    assert status("139", 3, 25) == "crashed (SIGSEGV)"
    assert status("-11", 3, 25) == "crashed (SIGSEGV)"  # Popen's returncode of a signalled process
    assert status("134", 3, 25) == "crashed (SIGABRT)"
    assert status("1", 3, 25) == status("2", 3, 25) == "failed"
    assert status("skipped", 0, 3) == "skipped (budget spent)"
    assert status("124", 40, None) == "timed out after - s"


def test_a_cut_run_says_so_first_and_names_what_it_did_not_reach(tmp_path):
    """The shell writes a `running` row before each sub-step, a `cut-by-SIG*` row when it is stopped and the
    planned steps before anything runs: the last row of a step is its status (duplicates listed once, C3)."""
    planned = "correctness\nheadline_attention\nheadline_gemm\nab\n"
    steps = (
        "correctness\trunning\t0\t150\ncorrect_flash\t0\t40\t120\ncorrect_flash\t124\t120\t120\n"
        "correctness\t0\t140\t150\nheadline_attention\trunning\t0\t85\nrun\tcut-by-SIGTERM\t260\t480\n"
    )
    raw, out = raw_run(tmp_path, steps, planned_steps__txt=planned)
    summary = summarise(raw, out)
    assert summary["problems"] == [
        "the run was stopped by SIGTERM after 260 s of its 480 s budget",
        "correct_flash: timed out after 120 s",
        "headline_attention: still running when the run ended (cut)",
        "not reached: headline_gemm, ab",
    ]
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [
        ("correct_flash", "timed out after 120 s"), ("correctness", "passed"),
        ("headline_attention", "still running when the run ended (cut)"), ("run", "stopped by SIGTERM"),
    ]  # fmt: skip


def test_no_gpu_is_the_first_problem(tmp_path):
    raw, out = raw_run(tmp_path, "cuda\tno-gpu\t0\t0\n", planned_steps__txt="correctness\nab\n")
    summary = summarise(raw, out)
    assert summary["problems"] == [
        "no CUDA GPU visible: nothing ran; see nvidia-smi and versions in the archive",
        "not reached: correctness, ab",
    ]


def test_candidate_results_are_counted_apart_from_the_shipped_code(tmp_path):
    """An off-by-default candidate failing its tests turned the shipped correctness red, its failed test
    unnamed (audit 10, M7 with feed2's case)."""
    ok = ('<testsuite tests="2" failures="0" errors="0" skipped="0"><testcase classname="tests.a" name="t1"/>'
          '<testcase classname="tests.a" name="t2"/></testsuite>')  # fmt: skip
    bad = ok.replace('failures="0"', 'failures="1"').replace('name="t1"/>', 'name="t1"><failure/></testcase>')
    candidates = {"gluon-forward": {"target": {}, "families": ["flash"]},
                  "gluon": {"target": {}, "families": ["flash"]}}  # a name that prefixes another  # fmt: skip
    steps = ("correct_flash\t0\t60\t120\ncand_gluon-forward_flash\t1\t60\t120\ncand_gluon_flash\t0\t9\t120\n"
             "correctness\t0\t140\t150\n")  # fmt: skip
    files = {"pytest_correct_flash__xml": ok, "pytest_cand_gluon-forward_flash__xml": bad,
             "pytest_cand_gluon_flash__xml": ok,
             "candidates__json": {"skipped_reason": None, "candidates": candidates}}  # fmt: skip
    raw, out = raw_run(tmp_path, steps, **files)
    summary = summarise(raw, out)
    assert summary["problems"] == []
    assert summary["pytest"]["passed"] == 2 and summary["pytest"]["failed_tests"] == []
    assert summary["candidate_pytest"]["failed_tests"] == ["gluon-forward: tests.a::t1"]
    text = (out / "summary.txt").read_text()
    assert "pytest: 2 passed, 0 failed, 0 errors, 0 skipped" in text
    assert "  FAILED gluon-forward: tests.a::t1" in text
    assert summary["candidate_verdicts"][0]["verdict"] == "off: fails correctness"


def test_an_unreadable_ab_json_is_a_problem(tmp_path):
    """A truncated attention_ab.json disappeared: no problem, candidates "not timed" (audit 10, M9)."""
    truncated = '{"candidates": {"x": {"shipped_ms": [2.'
    raw, out = raw_run(tmp_path, "ab\t0\t60\t75\n", attention_ab__json=truncated)
    summary = summarise(raw, out)
    (problem,) = summary["problems"]
    assert problem.startswith("attention_ab.json unreadable: ")


def test_a_partial_benchmark_file_is_named(tmp_path):
    """``complete: false`` (cut between cases) was never read (audit 10, M11)."""
    rows = [{"case": "c", "impl": "llm-speed", "available": True, "timing": {"median_ms": 0.01}}]
    raw, out = raw_run(tmp_path, "headline_gemm\t124\t35\t35\n",
                        gemm_bf16_512__json={"results": rows, "complete": False})  # fmt: skip
    summary = summarise(raw, out)
    assert summary["problems"] == ["headline_gemm: timed out after 35 s",
                                   "gemm_bf16_512.json: partial file: cut before its last case"]  # fmt: skip
    assert summary["benchmarks"]["gemm_bf16_512.json"]["partial"] is True
    text = (out / "summary.txt").read_text()
    assert "  gemm_bf16_512: partial file: cut before its last case" in text  # the headline rows
    assert "partial file: cut before its last case (gemm_bf16_512.json)" in text  # the targets


NAN = float("nan")
BROKEN = {  # audit 10's feed cases that crashed the writer (M4), and their kin
    "no summary.tsv": (None, {}),
    "a JSON list": ("", {"gemm_bf16_512__json": "[]"}),
    "results null": ("", {"gemm_bf16_512__json": {"results": None}}),
    "a row not a dict": ("", {"gemm_bf16_512__json": {"results": ["oops", None, 3]}}),
    "a partial tsv row": ("correct_fl", {}),
    "a tsv row without its seconds": ("correctness\t0\n", {}),
    "float seconds": ("correctness\t0\t100.5\tnan\n", {}),
    "negative and string medians": ("headline_gemm\t0\t3\t35\n", {"gemm_bf16_512__json": {"results": [
        {"case": "c", "impl": "llm-speed", "available": True, "timing": {"median_ms": -0.01}},
        {"case": "c", "impl": "torch", "available": True, "timing": {"median_ms": "0.01"}}]}}),
    "fused figures null": ("headline_fused\t0\t30\t40\n", {"fused_kernel_time__json": {"results": [
        {"op": "rms_norm", "impl": "llm_speed", "available": True, "wall_ms": None, "kernel_ms": 0.0,
         "kernel_gbps": None}], "copy": {"error": "x"}}}),
    "NaN headline figures": ("", {"decode__json": {"results": [
        {"case": "c", "impl": "kvcache", "available": True, "timing": {"median_ms": 1.0},
         "speedup_vs_fastest_other": NAN, "graph_ms": NAN, "prediction_ms": 1.0, "prediction_error": "x"}]}}),
    "A/B ratio null with rounds": ("", {"candidates__json": {"candidates": {"a": {"families": ["flash"]}}},
                                        "attention_ab__json": {"candidates": {"a": {
                                            "shipped_ms": [2.0], "candidate_ms": [1.0], "ratio": None}}}}),
    "A/B medians null, error a dict": ("", {
        "candidates__json": {"candidates": {"a": {"families": "flash"}, "b": None}},
        "attention_ab__json": {"candidates": {"a": {"shipped_ms": [2.0, 2.0], "candidate_ms": [1.0, 1.0],
                                                    "shipped_median_ms": None, "ratio": 2.0},
                                              "b": {"error": {"type": "RuntimeError"}}}}}),
    "roots that are lists or null": ("", {"candidates__json": "[]", "attention_ab__json": "null",
                                          "versions__json": "[1, 2]",
                                          "triton_compiles__jsonl": "3\n[]\n{}\n"}),
    "junit counts not numbers": ("", {"pytest_correct_flash__xml": '<testsuite tests="x" failures="-1"/>'}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BROKEN))
def test_no_input_makes_the_summary_fail(tmp_path, case):
    """Any exception in the writer left the last summary standing, saying "no failures" (audit 10, M4)."""
    steps, files = BROKEN[case]
    raw, out = raw_run(tmp_path, steps, **files)
    summary = summarise(raw, out)
    assert not [p for p in summary["problems"] if p.startswith("summary section")], summary["problems"]
    assert not re.search(r"\bnan\b", (out / "summary.txt").read_text(), re.IGNORECASE)  # '-': not measured


def test_a_section_that_fails_is_a_problem_and_costs_only_itself(tmp_path, monkeypatch):
    raw, out = raw_run(tmp_path, "correctness\t0\t100\t150\n", triton_compiles__jsonl="{}\n")

    def broken(raw: Path) -> dict:
        raise RuntimeError("boom")

    monkeypatch.setattr(suite_summary, "compiles", broken)
    assert suite_summary.main(str(raw), str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["problems"] == ["summary section triton compiles failed: RuntimeError: boom"]
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[1:3] == ["PROBLEMS (1):", "  summary section triton compiles failed: RuntimeError: boom"]
    assert any(line.startswith("  correctness ") for line in lines)  # the rest is there


def test_numbers_print_through_one_helper():
    assert [suite_summary.fmt(v, ".2f") for v in (1.234, None, NAN, float("inf"), "1.2", True)] == [
        "1.23", "-", "-", "-", "-", "-"]  # fmt: skip


def test_an_unknown_commit_is_a_problem(tmp_path):
    # results that name no commit cannot be filed under <commit>-proof (audit 10, M10)
    raw, out = raw_run(tmp_path, "correctness\t0\t100\t150\n",
                        environment__txt="git_commit: unknown (no .git here: pass LLM_SPEED_GIT_COMMIT)\n")
    assert "commit unknown: these results name no commit (pass LLM_SPEED_GIT_COMMIT)" in summarise(raw, out)[
        "problems"
    ]
