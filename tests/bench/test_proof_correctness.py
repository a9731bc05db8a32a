"""benchmarks/proof_correctness.py's runner stopped from outside (audit 10, L4), its exit code (M7) and its
use of pytest-xdist (W4), with tiny test families on the CPU."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import proof_correctness  # noqa: E402 - a script of benchmarks/, not a package

# a kernel that never returns: SIGINT does not stop it, only SIGKILL does; MARK says it has started
HUNG = """import os, pathlib, signal, time

def test_hang():
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pathlib.Path(os.environ["MARK"]).touch()
    time.sleep(600)
"""
GRACE_S = 3.0


def _tree(tmp_path: Path, **files: str) -> tuple[Path, Path]:
    """(tests folder with test_<name>.py for each of ``files``, a raw folder with its summary's header)."""
    tests, raw = tmp_path / "tests", tmp_path / "raw"
    tests.mkdir()
    raw.mkdir()
    for name, text in files.items():
        (tests / f"test_{name}.py").write_text(text)
    (raw / "summary.tsv").write_text("step\texit_code\tseconds\tcap_s\n")
    return tests, raw


def _hung_jobs(tests: Path, marks: Path, count: int = 3) -> list:
    family = proof_correctness.Family
    return [proof_correctness.Job(f"correct_h{i}", family(f"h{i}", "", (str(tests / "test_hung.py"),)),
                                  {"MARK": str(marks / f"h{i}")}) for i in range(count)]  # fmt: skip


def _rows(raw: Path) -> dict[str, str]:
    """Each job's last row's status (a later row replaces its `running` row)."""
    lines = (raw / "summary.tsv").read_text().splitlines()[1:]
    return {line.split("\t")[0]: line.split("\t")[1] for line in lines}


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def reaper():
    """Process groups to SIGKILL after the test, whatever it found: a failing test leaves no hung family."""
    pgids: list[int] = []
    yield pgids
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def _wait_for(marks: Path, count: int) -> None:
    deadline = time.monotonic() + 60
    while len(list(marks.iterdir())) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(list(marks.iterdir())) == count, "the hung families did not start"


def test_an_error_in_the_runner_stops_every_family_within_one_grace_period(tmp_path, reaper):
    """Any exception in Runner.run: SIGINT to every family, one shared grace period (it was one per job, in
    turn: with >= 2 hung families the suite killed the runner first and they ran on in their sessions),
    then SIGKILL to every group left; each recorded as cut, the pgid file emptied."""
    tests, raw = _tree(tmp_path, hung=HUNG)
    marks = tmp_path / "marks"
    marks.mkdir()
    seen = {}

    class Broken(proof_correctness.Runner):
        def _poll(self, running):
            bad = super()._poll(running)
            if len(list(marks.iterdir())) == 3:
                seen["pgids"] = [int(pgid) for pgid in (raw / "correctness_pgids.txt").read_text().split()]
                reaper.extend(seen["pgids"])
                seen["raised"] = time.monotonic()
                raise RuntimeError("a bug in the runner")
            return bad

    runner = Broken(raw, sys.executable, budget_s=60, parallel=3, workers=1, grace_s=GRACE_S, min_start_s=1)
    with pytest.raises(RuntimeError, match="a bug"):
        runner.run(_hung_jobs(tests, marks))
    stopped_in = time.monotonic() - seen["raised"]
    assert stopped_in < GRACE_S + 4, stopped_in  # one grace period for the three, not three in turn
    pgids = seen["pgids"]
    assert len(pgids) == 3 and not any(_alive(pgid) for pgid in pgids)
    assert _rows(raw) == {"correct_h0": "124", "correct_h1": "124", "correct_h2": "124"}
    assert (raw / "correctness_pgids.txt").read_text() == ""


DRIVER = """import signal, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import proof_correctness as pc
raw, tests, marks = (Path(a) for a in sys.argv[2:5])
jobs = [pc.Job(f"correct_h{i}", pc.Family(f"h{i}", "", (str(tests / "test_hung.py"),)),
               {"MARK": str(marks / f"h{i}")}) for i in range(3)]
signal.signal(signal.SIGTERM, pc.raise_terminated)  # as main() does
runner = pc.Runner(raw, sys.executable, budget_s=60, parallel=3, workers=1, grace_s=float(sys.argv[5]),
                   min_start_s=1)
try:
    runner.run(jobs)
except pc.Terminated:
    sys.exit(143)
"""


def test_sigterm_stops_every_family_and_leaves_none_running(tmp_path, reaper):
    """The suite stopped (the lease's end): the part stops its families as on SIGINT, and exits 143."""
    tests, raw = _tree(tmp_path, hung=HUNG)
    marks = tmp_path / "marks"
    marks.mkdir()
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(REPO / "benchmarks"), str(raw), str(tests),
                               str(marks), str(GRACE_S)])  # fmt: skip
    try:
        _wait_for(marks, 3)
        pgids = [int(pgid) for pgid in (raw / "correctness_pgids.txt").read_text().split()]
        reaper.extend(pgids)
        assert len(pgids) == 3 and all(_alive(pgid) for pgid in pgids)
        sent = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=30) == 143
        assert time.monotonic() - sent < GRACE_S + 5
    finally:
        driver.kill()
    assert not any(_alive(pgid) for pgid in pgids)
    assert _rows(raw) == {"correct_h0": "124", "correct_h1": "124", "correct_h2": "124"}


def test_candidate_jobs_do_not_fail_the_part_and_no_xdist_runs_without_n(tmp_path, monkeypatch, capsys):
    """A candidate's failing family is its verdict, not the part's failure (M7); without pytest-xdist the
    families run with -p no:xdist and the log says why (every family failed on `-n 2` before, W4)."""
    tests, raw = _tree(tmp_path, ok="def test_ok():\n    pass\n", bad="def test_bad():\n    assert False\n")
    family = proof_correctness.Family
    jobs = [
        proof_correctness.Job("correct_ok", family("ok", "", (str(tests / "test_ok.py"),))),
        proof_correctness.Job("cand_x_ok", family("ok", "", (str(tests / "test_bad.py"),)),
                              {"LLM_SPEED_POLICY": "x"}),
    ]  # fmt: skip
    monkeypatch.setattr(proof_correctness, "xdist_available", lambda python: False)
    runner = proof_correctness.Runner(raw, sys.executable, budget_s=60, parallel=2, workers=2, min_start_s=1)
    assert runner.run(jobs) == 0
    assert _rows(raw) == {"correct_ok": "0", "cand_x_ok": "1"}
    lines = (raw / "summary.tsv").read_text().splitlines()
    assert sum(line.startswith("correct_ok\trunning\t") for line in lines) == 1  # written when it started
    printed = capsys.readouterr().out
    assert "[proof] pytest-xdist does not import in" in printed
    commands = [line for line in printed.splitlines() if "-m pytest" in line]
    assert len(commands) == 2 and all(c.endswith("-p no:xdist") and " -n " not in c for c in commands)
    assert (raw / "correctness_pgids.txt").read_text() == ""
    # a shipped family's failure still counts
    jobs = [proof_correctness.Job("correct_bad", family("bad", "", (str(tests / "test_bad.py"),)))]
    runner = proof_correctness.Runner(raw, sys.executable, budget_s=60, parallel=1, workers=1, min_start_s=1)
    assert runner.run(jobs) == 1


def test_xdist_is_asked_for_only_where_it_imports(monkeypatch):
    assert proof_correctness.xdist_available("/bin/false") is False
    here = importlib.util.find_spec("xdist") is not None
    assert proof_correctness.xdist_available(sys.executable) is here
    job = proof_correctness.Job("correct_x", proof_correctness.Family("x", "", ("tests/x.py",)))
    command = proof_correctness.pytest_command("py", Path("raw"), job, 2, False)
    assert command[-2:] == ["-n", "2"] and "xdist.plugin" not in command
    assert proof_correctness.pytest_command("py", Path("raw"), job, 1, False)[-2:] == ["-p", "no:xdist"]
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")  # -n exists only once the plugin is named
    assert proof_correctness.pytest_command("py", Path("raw"), job, 2, False)[-4:] == [
        "-p", "xdist.plugin", "-n", "2"]  # fmt: skip


def test_the_parts_end_counts_from_the_process_start(tmp_path, monkeypatch):
    """main's budget counts from the import (reading the candidates took seconds of it, uncounted), and main
    installs the SIGTERM handler."""
    tests, raw = _tree(tmp_path, ok="def test_ok():\n    pass\n")
    family = proof_correctness.Family("ok", "", (str(tests / "test_ok.py"),))
    job = proof_correctness.Job("correct_ok", family)
    monkeypatch.setattr(proof_correctness, "plan", lambda python, check, only: ([job], {"candidates": {},
                        "skipped_reason": "none here"}))  # fmt: skip
    monkeypatch.setattr(proof_correctness, "STARTED", time.monotonic() - 100)
    installed = []
    monkeypatch.setattr(proof_correctness.signal, "signal", lambda *args: installed.append(args))
    # 105 s from a start 100 s ago: under the 10 s a family needs to start
    assert proof_correctness.main([str(raw), "--budget-s", "105", "--workers", "1"]) == 1
    assert _rows(raw) == {"correct_ok": "skipped"}
    assert (signal.SIGTERM, proof_correctness.raise_terminated) in installed


def test_the_int8_gemm_candidate_reruns_only_the_int8_tests(tmp_path):
    """A candidate that changes one op's launches reruns the tests of its family that call that op: the int8
    GEMM's reran the whole gemm family, ~110 tests of kernels it leaves unchanged."""
    jobs, record = proof_correctness.plan(sys.executable, False, ["gemm"])
    assert record["candidates"]["gluon-gemm-int8"]["keyword"] == "int8"
    job = next(j for j in jobs if j.name == "cand_gluon-gemm-int8_gemm")
    command = proof_correctness.pytest_command(sys.executable, tmp_path, job, 1, True)
    listed = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
                            env=proof_correctness.child_env())  # fmt: skip
    tests = [line for line in listed.stdout.splitlines() if "::" in line]
    assert tests and all("int8" in test for test in tests), listed.stdout[-2000:]
    shipped = next(j for j in jobs if j.name == "correct_gemm")
    assert shipped.keyword == "" and "and (int8)" not in " ".join(
        proof_correctness.pytest_command(sys.executable, tmp_path, shipped, 1, True)
    )


MANY = "".join(f"def test_{i:02d}():\n    pass\n\n" for i in range(7))


def test_the_shard_plugin_splits_the_selection_into_contiguous_disjoint_slices(tmp_path):
    """LLM_SPEED_PROOF_SHARD=i/n keeps the i-th of n contiguous slices of what -k left: every selected test
    in exactly one slice; a malformed value is an error naming the variable."""
    sys.path.insert(0, str(proof_correctness.SITE))
    try:
        import proof_shard
    finally:
        sys.path.remove(str(proof_correctness.SITE))
    for size in range(12):
        for count in range(1, 6):
            slices = [proof_shard.pick(list(range(size)), index, count) for index in range(1, count + 1)]
            assert sum(slices, []) == list(range(size))
            assert max(map(len, slices)) - min(map(len, slices)) <= 1
    for bad in ("2", "0/3", "4/3", "a/b", "1/0"):
        with pytest.raises(ValueError, match="LLM_SPEED_PROOF_SHARD"):
            proof_shard.parse(bad)
    # in pytest: after -k's deselection
    tests, _ = _tree(tmp_path, many=MANY)
    command = [sys.executable, "-m", "pytest", str(tests / "test_many.py"), "-p", "proof_shard", "-p",
               "no:cacheprovider", "--collect-only", "-q", "-k", "not test_03"]  # fmt: skip
    env = proof_correctness.child_env({"LLM_SPEED_PROOF_SHARD": "2/3"})
    listed = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)
    assert [line.split("::")[1] for line in listed.stdout.splitlines() if "::" in line] == [
        "test_02", "test_04"], listed.stdout  # fmt: skip
    assert "2/7 tests collected (5 deselected)" in listed.stdout


def test_a_family_split_across_processes_is_one_row_one_log_and_one_junit(tmp_path, capsys):
    """A family of n parts: n processes, each its slice of the tests; one summary.tsv row once the last has
    ended, one log (each part's under a header), one junit holding every part's tests; a candidate's part
    starts after the shipped part of the same slice where another part can start instead."""
    tests, raw = _tree(tmp_path, many=MANY, bad="def test_bad():\n    assert False\n")
    family = proof_correctness.Family("many", "", (str(tests / "test_many.py"),), shards=2)
    other = proof_correctness.Family("other", "", (str(tests / "test_bad.py"),))
    jobs = [proof_correctness.Job("correct_many", family),
            proof_correctness.Job("cand_x_many", family, {"LLM_SPEED_POLICY": "x"}),
            proof_correctness.Job("correct_other", other)]  # fmt: skip
    runner = proof_correctness.Runner(raw, sys.executable, budget_s=120, parallel=3, workers=1, min_start_s=1)
    assert runner.run(jobs) == 1  # the failing shipped family, once
    assert _rows(raw) == {"correct_many": "0", "cand_x_many": "0", "correct_other": "1"}
    lines = (raw / "summary.tsv").read_text().splitlines()
    assert sum(line.startswith("correct_many\t") for line in lines) == 2  # running, then its result
    junit = (raw / "pytest_correct_many.xml").read_text()
    assert 'tests="7"' in junit and junit.count("<testcase") == 7, junit
    assert sorted(p.name for p in (raw / "parts").iterdir()) == sorted(
        [f"pytest_{job}.{i}of2.xml" for job in ("correct_many", "cand_x_many") for i in (1, 2)]
        + ["pytest_correct_other.1of1.xml"]
    )  # the parts' logs were taken into their jobs'
    log = (raw / "correct_many.log").read_text()
    assert "=== part 1 of 2: exit 0" in log and "=== part 2 of 2: exit 0" in log, log
    started = [line.split("]")[0].removeprefix("[proof/") for line in capsys.readouterr().out.splitlines()
               if "(cap " in line]  # fmt: skip
    # the third slot: not the candidate's first part (its shipped twin has just started) but the next family
    assert started[:3] == ["correct_many.1of2", "correct_many.2of2", "correct_other.1of1"], started


def test_a_part_cut_at_its_cap_cuts_its_family_and_keeps_the_other_parts_results(tmp_path):
    """One part of three hangs: it is cut at the cap; the family's row says timed out (124), its junit holds
    the tests the other parts ran, and a part with no time left to start is counted in the log."""
    body = MANY + "def test_zz():\n    import time\n    time.sleep(600)\n"
    tests, raw = _tree(tmp_path, many=body)
    family = proof_correctness.Family("many", "", (str(tests / "test_many.py"),), cap_s=5, shards=2)
    runner = proof_correctness.Runner(raw, sys.executable, budget_s=60, parallel=2, workers=1, grace_s=3,
                                      min_start_s=1)  # fmt: skip
    assert runner.run([proof_correctness.Job("correct_many", family)]) == 1
    assert _rows(raw) == {"correct_many": "124"}
    junit = (raw / "pytest_correct_many.xml").read_text()
    assert junit.count("<testcase") >= 4, junit  # part 1's four tests at least (pytest writes on SIGINT)
    assert "=== part 2 of 2: exit 124" in (raw / "correct_many.log").read_text()
    # no time for the second part: the family is cut, not skipped, and the log says which part did not run
    raw2 = tmp_path / "raw2"
    raw2.mkdir()
    (raw2 / "summary.tsv").write_text("step\texit_code\tseconds\tcap_s\n")
    # part 1 (the first of two tests) takes 2 s at least, so fewer than 3 s of the 4 are left after it
    nap = tests / "test_nap.py"
    nap.write_text("def test_0():\n    import time\n    time.sleep(2)\n\ndef test_1():\n    pass\n")
    quick = proof_correctness.Family("quick", "", (str(nap),), shards=2)
    runner = proof_correctness.Runner(raw2, sys.executable, budget_s=4, parallel=1, workers=1, min_start_s=3)
    assert runner.run([proof_correctness.Job("correct_quick", quick)]) == 1
    assert _rows(raw2) == {"correct_quick": "124"}
    assert "=== part 2 of 2: not started (budget spent) ===" in (raw2 / "correct_quick.log").read_text()


def test_a_candidates_parts_wait_for_the_shipped_parts_of_their_tests():
    """A candidate reruns its family in half as many processes (most kernels come from the cache); each of
    its parts waits (where another can start) for the shipped parts whose slices overlap its own."""
    family = proof_correctness.Family("f", "", ("t.py",), shards=3)
    jobs = [proof_correctness.Job("correct_f", family),
            proof_correctness.Job("cand_x_f", family, {"LLM_SPEED_POLICY": "x"}, shards=2)]  # fmt: skip
    parts = proof_correctness.Runner._parts(jobs)
    after = {p.label: [a.label for a in p.after] for p in parts if p.job.name == "cand_x_f"}
    assert after == {"cand_x_f.1of2": ["correct_f.1of3", "correct_f.2of3"],
                     "cand_x_f.2of2": ["correct_f.2of3", "correct_f.3of3"]}  # fmt: skip
    assert all(not p.after for p in parts if p.job.name == "correct_f")
    planned, _ = proof_correctness.plan(sys.executable, False, ["flash", "gemm"])
    counts = {job.name: job.count for job in planned}
    assert counts["correct_flash"] == 8 and counts["cand_forward-overlap_flash"] == 4
    assert counts["cand_gluon-gemm-int8_gemm"] == 1  # narrowed to its 13 int8 tests
