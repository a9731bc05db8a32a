"""benchmarks/results_tables.py: the docs' GPU records are the script's output from the committed JSON."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import results_tables  # noqa: E402 - a script of benchmarks/, not a package


def test_the_committed_docs_are_the_scripts_output(capsys):
    """README.md, docs/h100-results.md, docs/benchmarks.md's step table and the results index match
    `python benchmarks/results_tables.py` (run it after adding results or changing the suite script)."""
    assert results_tables.main(["--check"]) == 0, capsys.readouterr().out


def test_every_results_folder_is_indexed_and_its_old_name_rewritten():
    folders = {p.name for p in results_tables.H100.iterdir() if p.is_dir()}
    assert folders == {folder for folder, *_ in results_tables.INDEX}
    rules = dict(
        re.findall(r"^s#(.+?)#(.+?)#g$", (results_tables.H100 / "renamed.sed").read_text(), re.MULTILINE)
    )
    assert rules == {old: folder for folder, _, _, old in results_tables.INDEX}
    for folder, commit, _, _ in results_tables.INDEX:
        assert folder.startswith(f"{commit}-"), folder  # named by its commit ("unrecorded" where none is)


def test_a_run_with_a_cut_chunk_did_not_finish_and_ratios_use_every_round(tmp_path):
    run = tmp_path / "abc1234-tests"
    run.mkdir()
    steps = [
        {"step": "pytest_attention", "status": "failed"},
        {"step": "pytest_rest", "status": "timed out after 130 s"},
    ]
    counts = {"passed": 10, "failures": 1, "errors": 0, "skipped": 2}
    summary = {"git_commit": "abc1234def", "steps": steps, "pytest": counts}
    (run / "tests-summary.json").write_text(json.dumps(summary))
    (run / "attention_ab.json").write_text(json.dumps({"results": {
        "backward full 1x16384 fp16 sdpa-cudnn": {"median_ms": 10.0, "runs": [10.0, 10.0]},
        "backward full 1x16384 fp16 shipped atomic": {"median_ms": 12.0, "runs": [12.0, 20.0, 16.0]},
    }}))  # fmt: skip
    [found] = results_tables.suite_runs(tmp_path)
    assert not found["finished"] and found["cut"] == "pytest_rest timed out after 130 s"
    assert (found["commit"], found["passed"], found["failed"]) == ("abc1234", 10, 1)
    [row] = results_tables.ab_rows(tmp_path)  # the cuDNN row is the reference, not a row of its own
    assert row["rounds"] == 3 and row["median_ms"] == 16.0 and row["vs_cudnn"] == 10.0 / 16.0


def test_each_ab_row_names_the_backward_path_it_timed():
    """A label names the option a row set: the second lease's "atomic" rows (deterministic=False) kept the
    H100's dQ kernel, the first lease's added dQ by atomics; forced paths are named by their labels."""
    path = results_tables.backward_path
    assert path("unrecorded-ab-overhead", "backward full 1x16384 fp16 shipped atomic") == "dQ kernel"
    assert path("unrecorded-ab-overhead", "backward causal 1x16384 fp16 64x64 w4 s3 atomic") == "dQ kernel"
    tma = path("unrecorded-ab-overhead", "backward full 1x16384 fp16 shipped tma-dq-add")
    assert tma == "dQ by TMA tile adds"
    assert path("4c378d4-ab-fp8", "backward full 1x16384 fp16 shipped atomic") == "dQ by atomics"
    assert path("4c378d4-ab-fp8", "backward full 1x16384 fp16 shipped deterministic") == "dQ kernel"
    assert path("2b2a055-ab-fp8-decode", "backward full 1x16384 fp16 64x64 w4") == "dQ by atomics"
    assert path("abc1234-tests", "backward full 1x16384 fp16 shipped atomic-dq") == "dQ by atomics"
    assert path("abc1234-tests", "causal fwd 1x16384 lpt") == ""
    rows = {(r["file"], r["label"]): r["path"] for r in results_tables.ab_rows()}
    second_lease = ("unrecorded-ab-overhead/attention_ab.json", "backward full 1x16384 fp16 shipped atomic")
    assert rows[second_lease] == "dQ kernel"
