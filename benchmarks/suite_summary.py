#!/usr/bin/env python3
"""Summaries of a run_gpu_suite.sh run: RAW_DIR's step table and results -> OUT_DIR/summary.{json,txt}.

Standard library only, so the summary is written even when torch or llm_speed is broken on the machine.

    python benchmarks/suite_summary.py RAW_DIR OUT_DIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proof_targets  # noqa: E402 - a script beside this one, not a package

TIMED_OUT = {"124", "137"}  # timeout's exit code, and SIGKILL's after the grace period
PYTEST_LOG_TAIL_LINES = 25


def read_steps(raw: Path) -> list[dict]:
    """The rows of summary.tsv with a status word: passed, failed, timed out or skipped."""
    lines = (raw / "summary.tsv").read_text().splitlines()[1:]
    steps = []
    for line in lines:
        name, code, seconds, cap = line.split("\t")
        if code == "skipped":
            status = "skipped (budget spent)"
        elif code == "absent":  # the step's script lacks what it needs; its log says what
            log = raw / f"{name}.log"
            status = (
                "not run: " + (log.read_text().strip().splitlines() or ["?"])[0]
                if log.exists()
                else "not run"
            )
        elif code == "0":
            status = "passed"
        elif code in TIMED_OUT:
            status = f"timed out after {cap} s"
        else:
            status = "failed"
        steps.append(
            {
                "step": name,
                "status": status,
                "exit_code": code,
                "seconds": int(seconds),
                "cap_s": int(cap),
                "log": f"{name}.log",
            }
        )
    return steps


def pytest_counts(raw: Path) -> dict | None:
    """Test counts summed over every pytest*.xml junit file, or None when pytest wrote none (not run)."""
    return pytest_counts_of(sorted(raw.glob("pytest*.xml")))


def pytest_counts_of(paths: list[Path]) -> dict | None:
    """Test counts summed over these junit files, or None when there are none."""
    if not paths:
        return None
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed_tests": [], "files": []}
    for path in paths:
        try:
            root = ElementTree.parse(path).getroot()
        except ElementTree.ParseError:
            counts["files"].append(f"{path.name} (unreadable)")
            continue
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is None:
            continue
        counts["files"].append(path.name)
        for key in ("tests", "failures", "errors", "skipped"):
            counts[key] += int(suite.get(key, 0))
        counts["failed_tests"] += [
            f"{case.get('classname')}::{case.get('name')}"
            for case in suite.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def pytest_by_file(raw: Path) -> dict:
    """{junit file stem: {passed, failed, skipped}} for the proof's per-family files (pytest_correct_*,
    pytest_cand_*): one line per family in the summary."""
    found = {}
    for path in sorted(raw.glob("pytest_c*.xml")):
        counts = pytest_counts_of([path])
        if counts is not None:
            name = path.stem.removeprefix("pytest_")
            found[name] = {key: counts[key] for key in ("passed", "failures", "errors", "skipped")}
    return found


def compiles(raw: Path) -> dict | None:
    """Triton's compiles in every process (RAW/triton_compiles.jsonl, benchmarks/proof_site): kernels built
    here and their compiler seconds (summed over processes, which compile side by side), and kernels loaded
    from the file cache (a kernel another process of the run had built first)."""
    path = raw / "triton_compiles.jsonl"
    if not path.exists():
        return None
    built, loaded, seconds, unreadable = 0, 0, 0.0, 0
    kernels = set()
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            unreadable += 1
            continue
        kernels.add(entry.get("hash"))
        if entry.get("cache_hit"):
            loaded += 1
        else:
            built += 1
            seconds += entry.get("compile_us", 0) / 1e6
    return {
        "compiled_here": built,
        "compile_seconds_summed": round(seconds, 1),
        "loaded_from_cache": loaded,
        "distinct_kernels": len(kernels),
        "unreadable_lines": unreadable,
    }


def benchmark_files(raw: Path) -> dict:
    """Per benchmark JSON: how many rows ran and which implementations did not (with the first reason); for
    decode rows, which implementations' CUDA-graph capture failed (``graph_failed``, first reason)."""
    found = {}
    for path in sorted(raw.glob("*.json")):
        if path.name in ("versions.json", "doctor.json", "candidates.json", "attention_ab.json"):
            continue
        try:
            results = json.loads(path.read_text()).get("results", [])
        except (OSError, ValueError) as error:
            found[path.name] = {"error": f"unreadable: {error}"}
            continue
        not_run, graph_failed = {}, {}
        for row in results:
            if not row.get("available", True):
                not_run.setdefault(row.get("impl"), row.get("reason"))
            elif str(row.get("graph_reason") or "").startswith("capture failed"):
                graph_failed.setdefault(row.get("impl"), row["graph_reason"])
        found[path.name] = {
            "rows": len(results),
            "rows_run": sum(1 for r in results if r.get("available")),
            "not_run": not_run,
        }
        if graph_failed:
            found[path.name]["graph_failed"] = graph_failed
    return found


def candidate_verdicts(raw: Path, candidates: dict | None) -> list[dict]:
    """Per candidate launch choice (in the order the proof ran them): its families' junit counts under
    ``LLM_SPEED_POLICY=<name>`` and its A/B (RAW/attention_ab.json: rounds, medians, ratio, error), and what
    they say together: a choice goes on in ``SHIPPED`` only correct on every family it changes and not slower
    (core.policy: record its ``Proof``)."""
    try:
        ab = json.loads((raw / "attention_ab.json").read_text())
    except (OSError, ValueError):
        ab = {}
    timed = ab.get("candidates") if isinstance(ab.get("candidates"), dict) else {}
    verdicts = []
    for name, info in ((candidates or {}).get("candidates") or {}).items():
        families = info.get("families") or []
        paths = [raw / f"pytest_cand_{name}_{family}.xml" for family in families]
        counts = pytest_counts_of([p for p in paths if p.exists()])
        missing = [f for f, p in zip(families, paths, strict=True) if not p.exists()]
        entry = timed.get(name) or {}
        rounds = len(entry.get("candidate_ms") or [])
        verdict = {"name": name, "families": families, "families_not_run": missing,
                   "passed": None if counts is None else counts["passed"],
                   "failed": None if counts is None else counts["failures"] + counts["errors"],
                   "rounds": rounds, "shipped_median_ms": entry.get("shipped_median_ms"),
                   "candidate_median_ms": entry.get("candidate_median_ms"), "ratio": entry.get("ratio"),
                   "ab_error": entry.get("error")}  # fmt: skip
        if verdict["failed"]:
            word = "off: fails correctness"
        elif not families or missing or not verdict["passed"]:
            word = "unproven: correctness not run on every family it changes"
        elif entry.get("error"):
            word = "off: its A/B raised"
        elif not rounds:
            word = "unproven: not timed"
        elif verdict["ratio"] < 1.0:
            word = f"off: slower ({verdict['ratio']:.2f}x)"
        elif rounds < 2:
            word = f"unproven: {verdict['ratio']:.2f}x in one round"
        else:
            word = f"proven: correct, {verdict['ratio']:.2f}x over {rounds} rounds (record its Proof)"
        verdict["verdict"] = word
        verdicts.append(verdict)
    return verdicts


def verdict_lines(verdicts: list[dict]) -> list[str]:
    lines = []
    for v in verdicts:
        correct = "not run" if v["passed"] is None else f"{v['passed']} passed, {v['failed']} failed"
        if v["ab_error"]:
            timing = f"A/B error: {v['ab_error'][:160]}"
        elif v["rounds"]:
            timing = (f"{v['shipped_median_ms']:.4g} -> {v['candidate_median_ms']:.4g} ms, "
                      f"{v['ratio']:.2f}x, {v['rounds']} rounds")  # fmt: skip
        else:
            timing = "not timed"
        lines.append(f"  {v['name']:<24} {v['verdict']}; correctness {correct}; {timing}")
    return lines


OURS = ("flash", "flash-fp8", "llm-speed", "llm_speed", "kvcache", "kvcache-paged", "kvcache-fp8",
        "kvcache-paged-fp8")  # fmt: skip


def headline(raw: Path) -> list[str]:
    """One line per row of ours in every benchmark JSON: its median, and how it compares with the fastest
    other implementation of the same case (the bench commands' own ``speedup_vs_fastest_other``); decode rows
    also replayed from a CUDA graph; the performance model's prediction and its error where the bench gave
    one ("uncalibrated" where the model says so: predict, then confirm); the fused kernels with the
    profiler's kernel time and GB/s."""
    lines = []
    for path in sorted(raw.glob("*.json")):
        try:
            results = json.loads(path.read_text()).get("results", [])
        except (OSError, ValueError, AttributeError):
            continue
        for row in results if isinstance(results, list) else []:
            if not row.get("available"):
                continue
            if "kernel_ms" in row:  # fused_kernel_time.py
                times = f"wall {row['wall_ms']:.3f} ms, kernel {row['kernel_ms']:.3f} ms"
                lines.append(
                    f"  {path.stem}: {row['op']} {row['impl']}: {times}, {row['kernel_gbps']:.0f} GB/s"
                )
            elif row.get("impl") in OURS and (row.get("timing") or {}).get("median_ms") is not None:
                text = f"  {path.stem}: {row['case']} {row['impl']}: {row['timing']['median_ms']:.4g} ms"
                if row.get("speedup_vs_fastest_other") is not None:
                    text += f", {row['speedup_vs_fastest_other']:.2f}x {row['fastest_other']}"
                if row.get("graph_ms"):
                    text += f"; graph {row['graph_ms']:.4g} ms"
                if row.get("prediction_ms") is not None and row.get("prediction_error") is not None:
                    text += f"; predicted {row['prediction_ms']:.4g} ms ({row['prediction_error']:+.0%}"
                    text += ")" if row.get("prediction_calibrated", True) else ", uncalibrated)"
                lines.append(text)
    return lines


def problems(summary: dict) -> list[str]:
    """Every step that did not pass and every failed test, named: the summary's first lines."""
    found = [f"{s['step']}: {s['status']}" for s in summary["steps"] if s["status"] != "passed"]
    if summary["pytest"] is not None:
        found += [f"FAILED {name}" for name in summary["pytest"]["failed_tests"]]
    for name, info in summary["benchmarks"].items():
        if "error" in info:
            found.append(f"{name}: {info['error']}")
    found += [f"A/B of {v['name']}: {v['ab_error'][:200]}" for v in summary.get("candidate_verdicts") or []
              if v["ab_error"]]  # fmt: skip
    return found


def proof_text(summary: dict) -> list[str]:
    """The proof's lines: junit counts per family, the candidates' families, Triton's compiles."""
    text = []
    if summary["families"]:
        text += ["", "correctness by family (junit):"]
        for name, c in summary["families"].items():
            failed = c["failures"] + c["errors"]
            text.append(f"  {name:<40} {c['passed']:>4} passed {failed:>3} failed {c['skipped']:>3} skipped")
    candidates = summary["candidates"]
    if candidates is not None:
        text.append("")
        if candidates.get("skipped_reason"):
            text.append(f"candidate launch choices: none run ({candidates['skipped_reason']})")
        text += [
            f"candidate {name}: families {', '.join(info['families']) or 'none'}"
            for name, info in (candidates.get("candidates") or {}).items()
        ]
    c = summary["triton_compiles"]
    if c is not None:
        text += ["", (
            f"Triton: {c['compiled_here']} kernels compiled here ({c['compile_seconds_summed']} s of "
            f"compiler time, summed over processes), {c['loaded_from_cache']} loaded from the run's file "
            f"cache, {c['distinct_kernels']} distinct"
        )]  # fmt: skip
    return text


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def main(raw_dir: str, out_dir: str) -> int:
    raw, out = Path(raw_dir), Path(out_dir)
    environment = (raw / "environment.txt").read_text() if (raw / "environment.txt").exists() else ""
    header = dict(line.split(": ", 1) for line in environment.splitlines()[:2] if ": " in line)
    try:
        versions = json.loads((raw / "versions.json").read_text())
    except (OSError, ValueError):
        versions = {"error": "versions.json missing or unreadable (see it in results.tar.gz)"}
    steps = read_steps(raw)
    try:
        candidates = json.loads((raw / "candidates.json").read_text())
    except (OSError, ValueError):
        candidates = None
    summary = {
        "date_utc": header.get("date_utc"),
        "git_commit": header.get("git_commit"),
        "versions": versions,
        "steps": steps,
        "pytest": pytest_counts(raw),
        "families": pytest_by_file(raw),
        "candidates": candidates,
        "triton_compiles": compiles(raw),
        "benchmarks": benchmark_files(raw),
        "candidate_verdicts": candidate_verdicts(raw, candidates),
        "archive": "results.tar.gz (every log, benchmark JSON and plot, pytest*.xml, demo/, environment.txt)",
    }
    summary["problems"] = problems(summary)
    # the proof's headline: issue 74's targets as this run measured them (benchmarks/proof_targets.py)
    targets = proof_targets.table(raw) if any(s["step"].startswith("headline_") for s in steps) else None
    summary["targets"] = None if targets is None else [dataclasses.asdict(t) for t in targets]
    write_atomically(out / "summary.json", json.dumps(summary, indent=1) + "\n")

    lines = [f"llm-speed GPU suite, {summary['date_utc']}, commit {summary['git_commit']}"]
    if summary["problems"]:
        lines.append(f"PROBLEMS ({len(summary['problems'])}):")
        lines.extend(f"  {problem}" for problem in summary["problems"])
    else:
        lines.append("no failures: every step passed")
    lines.append("versions: " + ", ".join(f"{k}={v}" for k, v in versions.items()))
    lines.append("")
    for s in steps:
        lines.append(f"  {s['step']:<28} {s['status']:<26} {s['seconds']:>4} s (cap {s['cap_s']} s)")
    if summary["pytest"] is not None:
        counts = summary["pytest"]
        lines.append("")
        lines.append(
            f"pytest: {counts['passed']} passed, {counts['failures']} failed, "
            f"{counts['errors']} errors, {counts['skipped']} skipped"
        )
        lines.extend(f"  FAILED {name}" for name in counts["failed_tests"])
    lines += proof_text(summary)
    if summary["candidate_verdicts"]:
        lines += ["", "candidate launch choices: verdict; correctness; A/B (shipped -> candidate):"]
        lines += verdict_lines(summary["candidate_verdicts"])
    if targets is not None:
        lines += ["", "issue 74's targets, from this run's JSON (yes / no; -: a part not measured):"]
        lines += proof_targets.text_lines(targets)
    rows = headline(raw)
    if rows:
        lines += [
            "",
            "ours against the fastest other row of its case (each JSON's ratio; above 1x: ours faster):",
        ]
        lines += rows
    for name, info in summary["benchmarks"].items():
        if "rows" in info:
            not_run = "".join(f"; not run: {impl} ({reason})" for impl, reason in info["not_run"].items())
            lines.append(f"{name}: {info['rows_run']}/{info['rows']} rows ran{not_run}")
    for pytest_log in sorted(raw.glob("pytest*.log")):
        lines.append("")
        lines.append(f"--- last {PYTEST_LOG_TAIL_LINES} lines of {pytest_log.name} ---")
        lines.extend(pytest_log.read_text(errors="replace").splitlines()[-PYTEST_LOG_TAIL_LINES:])
    write_atomically(out / "summary.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
