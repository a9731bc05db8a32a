#!/usr/bin/env python3
"""Summaries of a run_gpu_suite.sh run: RAW_DIR's step table and results -> OUT_DIR/summary.{json,txt}.

Standard library only, so the summary is written even when torch or llm_speed is broken on the machine.
Each section is built on its own: a broken input costs its section (a PROBLEMS line says which), never the
summary; a number that is missing, not a number, NaN or infinite counts as not measured and prints as '-'.

    python benchmarks/suite_summary.py RAW_DIR OUT_DIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proof_targets  # noqa: E402 - a script beside this one, not a package
from proof_targets import number  # noqa: E402 - a finite float, or None: not measured

PYTEST_LOG_TAIL_LINES = 25
PROVEN_RATIO = 1.02  # a candidate's median speed-up below this is within the A/B's round-to-round noise
NOT_BENCHMARKS = ("versions.json", "doctor.json", "candidates.json", "attention_ab.json")
CARRIED_CACHE = "carried_cache_*.json"  # benchmarks/triton_cache.py install's manifests


def is_benchmark(path: Path) -> bool:
    """Whether a JSON file of RAW holds benchmark rows (not the run's records, not a carried cache's)."""
    return path.name not in NOT_BENCHMARKS and not path.match(CARRIED_CACHE)


def fmt(value: object, spec: str = "") -> str:
    """``value`` formatted with ``spec``, or '-' where it is not a finite number (not measured)."""
    value = number(value)
    return "-" if value is None else format(value, spec)


def _int(text: str) -> int | None:
    try:
        return int(float(text))
    except (ValueError, OverflowError):  # not a number, NaN, infinite
        return None


def read_json(path: Path) -> tuple[object, str | None]:
    """(the document, None), or (None, why it could not be read)."""
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as error:  # (UnicodeDecodeError is a ValueError)
        return None, str(error)


def exit_status(code: str, seconds: int | None, cap: int | None) -> str:
    """A summary.tsv exit code in words. 124: timeout's; 137: SIGKILL, timeout's a grace period after its
    SIGINT (at the cap) or, earlier, the kernel's (out of memory); 128+n and Popen's -n: signal n."""
    words = {"0": "passed", "skipped": "skipped (budget spent)", "no-gpu": "no CUDA GPU visible",
             "running": "still running when the run ended (cut)"}  # fmt: skip
    if code in words:
        return words[code]
    if code.startswith("cut-by-"):  # a run stopped by a signal: its `run` row and the step in flight
        return f"stopped by {code.removeprefix('cut-by-')}"
    timed_out = f"timed out after {fmt(cap, '.0f')} s"
    try:
        value = int(code)
    except ValueError:
        return "failed"
    if value == 124:
        return timed_out
    if value in (137, -signal.SIGKILL):
        at_cap = seconds is not None and cap is not None and seconds >= cap - 1
        return timed_out if at_cap else "killed (SIGKILL: out of memory?)"
    signum = value - 128 if value > 128 else -value
    if 0 < signum < 65:
        try:
            return f"crashed ({signal.Signals(signum).name})"
        except ValueError:
            return f"crashed (signal {signum})"
    return "failed"


def read_steps(raw: Path) -> tuple[list[dict], list[str]]:
    """The rows of summary.tsv with a status word (one per step: a later row of a step replaces an earlier
    one, as a finished step's row replaces the `running` row written when it started), and PROBLEMS lines
    for the file itself (missing, or a row cut short)."""
    path = raw / "summary.tsv"
    if not path.exists():
        return [], ["summary.tsv missing: no step was recorded"]
    steps, notes = {}, []
    for line in path.read_text(errors="replace").splitlines()[1:]:  # (after its header)
        fields = line.split("\t")
        if not line.strip():
            continue
        if len(fields) < 2 or not fields[0]:  # a process killed while it appended its row
            notes.append(f"summary.tsv: unreadable row {line[:80]!r}")
            continue
        name, code = fields[0], fields[1]
        seconds, cap = (_int(field) for field in (fields + ["", ""])[2:4])
        if code == "absent":  # the step's script lacks what it needs; its log says what
            log = raw / f"{name}.log"
            status = (
                "not run: " + (log.read_text(errors="replace").strip().splitlines() or ["?"])[0]
                if log.exists()
                else "not run"
            )
        else:
            status = exit_status(code, seconds, cap)
        steps.pop(name, None)  # at its last row's place: where a step's one row stood before `running` rows
        steps[name] = {"step": name, "status": status, "exit_code": code, "seconds": seconds, "cap_s": cap,
                       "log": f"{name}.log"}  # fmt: skip
    return list(steps.values()), notes


def not_reached(raw: Path, steps: list[dict]) -> list[str]:
    """The steps RAW/planned_steps.txt lists (written before anything ran) with no row at all."""
    path = raw / "planned_steps.txt"
    if not path.exists():  # an older run's folder
        return []
    seen = {s["step"] for s in steps}
    planned = dict.fromkeys(line.strip() for line in path.read_text(errors="replace").splitlines())
    return [name for name in planned if name and name not in seen]


def pytest_counts(raw: Path) -> dict | None:
    """Test counts summed over the shipped code's junit files (every pytest*.xml but the candidates'
    pytest_cand_*), or None when pytest wrote none (not run)."""
    shipped = [p for p in sorted(raw.glob("pytest*.xml")) if not p.name.startswith("pytest_cand_")]
    return pytest_counts_of(shipped)


def candidate_pytest_counts(raw: Path, candidates: dict) -> dict | None:
    """The same over the candidates' reruns (pytest_cand_<name>_<family>.xml), each failed test prefixed with
    its candidate: a candidate failing is its verdict's business, not the shipped code's."""
    names = sorted(candidates, key=len, reverse=True)  # the longest first: a name may prefix another

    def label(path: Path) -> str:
        stem = path.stem.removeprefix("pytest_cand_")
        return next((name for name in names if stem.startswith(f"{name}_")), stem)

    return pytest_counts_of(sorted(raw.glob("pytest_cand_*.xml")), label)


def pytest_counts_of(paths: list[Path], label=None) -> dict | None:
    """Test counts summed over these junit files, or None when there are none; ``label(path)`` prefixes each
    of a file's failed tests."""
    if not paths:
        return None
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "passed": 0, "failed_tests": [],
              "files": []}  # fmt: skip
    for path in paths:
        try:
            root = ElementTree.parse(path).getroot()
        except (ElementTree.ParseError, OSError):
            counts["files"].append(f"{path.name} (unreadable)")
            continue
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is None:
            continue
        counts["files"].append(path.name)
        keys = ("tests", "failures", "errors", "skipped")
        found = {key: max(0, _int(suite.get(key, "0")) or 0) for key in keys}
        for key, value in found.items():
            counts[key] += value
        # (a collection error is counted in tests too, and a hand-made file may count it apart: never below 0)
        counts["passed"] += max(0, found["tests"] - found["failures"] - found["errors"] - found["skipped"])
        prefix = f"{label(path)}: " if label else ""
        counts["failed_tests"] += [
            f"{prefix}{case.get('classname')}::{case.get('name')}"
            for case in suite.iter("testcase")
            if case.find("failure") is not None or case.find("error") is not None
        ]
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
            if not counts["files"] or counts["files"][0].endswith("(unreadable)"):
                found[name]["unreadable"] = True
    return found


def compiles(raw: Path) -> dict | None:
    """Triton's compiles in every process (RAW/triton_compiles.jsonl, benchmarks/proof_site): kernels built
    here and their compiler seconds (summed over processes, which compile side by side), and kernels loaded
    from the file cache (a kernel another process of the run had built first, or a carried cache's: with
    RAW/carried_cache_*.json, the manifests benchmarks/triton_cache.py install wrote, how many of its kernels
    were loaded, whether its builder's Triton and kernel sources were this run's, and why one was not
    installed)."""
    path = raw / "triton_compiles.jsonl"
    manifests = sorted(raw.glob(CARRIED_CACHE))
    if not path.exists() and not manifests:
        return None  # (a carried cache is reported even where no process compiled or loaded a kernel)
    carried, carried_keys_match, carried_sources_match, carried_errors = set(), [], [], []
    for manifest_path in manifests:
        manifest, why = read_json(manifest_path)
        if not isinstance(manifest, dict):
            carried_errors.append(f"{manifest_path.name}: {why or 'not an object'}")
            continue
        if manifest.get("error"):
            carried_errors.append(f"{manifest_path.name}: not installed: {manifest['error']}")
            continue
        carried |= {str(k.get("hash")) for k in manifest.get("kernels", []) if isinstance(k, dict)}
        carried_keys_match.append(manifest.get("key_matches"))
        carried_sources_match.append(manifest.get("sources_match"))
    built, loaded, seconds, unreadable, served = 0, 0, 0.0, 0, set()
    kernels = set()
    for line in path.read_text(errors="replace").splitlines() if path.exists() else ():
        try:
            entry = json.loads(line)
        except ValueError:
            unreadable += 1
            continue
        if not isinstance(entry, dict):
            unreadable += 1
            continue
        kernels.add(str(entry.get("hash")))
        if entry.get("cache_hit"):
            loaded += 1
            if str(entry.get("hash")) in carried:
                served.add(str(entry.get("hash")))
        else:
            built += 1
            seconds += (number(entry.get("compile_us")) or 0) / 1e6
    return {
        "compiled_here": built,
        "compile_seconds_summed": round(seconds, 1),
        "loaded_from_cache": loaded,
        "distinct_kernels": len(kernels),
        "unreadable_lines": unreadable,
        # a Triton cache compiled before the lease (benchmarks/triton_cache.py): its kernels, how many of them
        # this run loaded, and whether its builder's Triton (version, triton_key, ptxas) was this machine's
        **({"carried_kernels": len(carried), "served_by_carried": len(served),
            "carried_keys_match": carried_keys_match, "carried_sources_match": carried_sources_match,
            "carried_errors": carried_errors} if carried_keys_match or carried_errors else {}),  # fmt: skip
    }


def _rows(document: object) -> list[dict]:
    """A benchmark document's result rows that are rows (dicts); none when it has no list of them."""
    results = document.get("results") if isinstance(document, dict) else None
    return [row for row in results if isinstance(row, dict)] if isinstance(results, list) else []


def benchmark_files(raw: Path) -> dict:
    """Per benchmark JSON: how many rows ran and which implementations did not (with the first reason); for
    decode rows, which implementations' CUDA-graph capture failed (``graph_failed``, first reason); whether
    it was cut before its last case (``partial``: the bench commands write ``complete: false`` until then)."""
    found = {}
    for path in sorted(raw.glob("*.json")):
        if not is_benchmark(path):
            continue
        document, error = read_json(path)
        if error is None and not isinstance(document, dict):
            error = f"a JSON {type(document).__name__}, not an object"
        if error is not None:
            found[path.name] = {"error": f"unreadable: {error}"}
            continue
        results = _rows(document)
        not_run, graph_failed = {}, {}
        for row in results:
            if not row.get("available", True):
                not_run.setdefault(str(row.get("impl")), row.get("reason"))
            elif str(row.get("graph_reason") or "").startswith("capture failed"):
                graph_failed.setdefault(str(row.get("impl")), row["graph_reason"])
        found[path.name] = {
            "rows": len(results),
            "rows_run": sum(1 for r in results if r.get("available")),
            "not_run": not_run,
        }
        if graph_failed:
            found[path.name]["graph_failed"] = graph_failed
        if document.get("complete") is False:
            found[path.name]["partial"] = True
    return found


def read_candidates(raw: Path) -> tuple[dict | None, dict]:
    """candidates.json (None: not written or unreadable) and its {candidate: info} table, whatever the file
    holds (each info a dict, its families a list of names)."""
    document, _ = read_json(raw / "candidates.json")
    if not isinstance(document, dict):
        return None, {}
    listed = document.get("candidates")
    table = {}
    for name, info in listed.items() if isinstance(listed, dict) else ():
        info = info if isinstance(info, dict) else {}
        families = info.get("families")
        families = [str(f) for f in families] if isinstance(families, list) else []
        table[str(name)] = {**info, "families": families}
    return document, table


def read_ab(raw: Path) -> tuple[dict, str | None]:
    """attention_ab.json's {candidate: entry} and, when the file is there but cannot be read, why."""
    path = raw / "attention_ab.json"
    if not path.exists():
        return {}, None
    document, error = read_json(path)
    if error is None and not isinstance(document, dict):
        error = f"a JSON {type(document).__name__}, not an object"
    if error is not None:
        return {}, error
    timed = document.get("candidates")
    return (timed if isinstance(timed, dict) else {}), None


def round_ratios(entry: dict) -> list[float | None]:
    """Each A/B round's own ratio, shipped ms over candidate ms (None: a round not measured)."""
    shipped, candidate = entry.get("shipped_ms"), entry.get("candidate_ms")
    if not isinstance(shipped, list) or not isinstance(candidate, list):
        return []
    ratios = []
    for index, ms in enumerate(candidate):
        a, b = number(shipped[index]) if index < len(shipped) else None, number(ms)
        ratios.append(a / b if a is not None and b is not None and a > 0 and b > 0 else None)
    return ratios


def candidate_verdicts(table: dict, steps: list[dict], timed: dict, raw: Path) -> list[dict]:
    """Per candidate launch choice (in the order the proof ran them): its families' junit counts under
    ``LLM_SPEED_POLICY=<name>``, its jobs' rows in summary.tsv, and its A/B (RAW/attention_ab.json: rounds,
    medians, ratio, error), and what they say together: a choice goes on in ``SHIPPED`` only correct on every
    family it changes (each job ran to its end and passed at least as many tests as it skipped) and faster
    beyond the noise, in every round (core.policy: record its ``Proof``)."""
    rows = {s["step"]: s for s in steps}
    verdicts = []
    for name, info in table.items():
        families = info["families"]
        paths = [raw / f"pytest_cand_{name}_{family}.xml" for family in families]
        counts = pytest_counts_of([p for p in paths if p.exists()])
        missing = [f for f, p in zip(families, paths, strict=True) if not p.exists()]
        each = {f: pytest_counts_of([p]) for f, p in zip(families, paths, strict=True) if p.exists()}
        idle = [f for f, c in each.items() if c["passed"] == 0]
        thin = [f"{f} ({c['passed']} passed, {c['skipped']} skipped)" for f, c in each.items()
                if 0 < c["passed"] < c["skipped"]]  # fmt: skip
        # a job cut at its cap still leaves a clean-looking junit (pytest writes it on SIGINT): its row says
        cut = [f"{f}: {rows[f'cand_{name}_{f}']['status']}" for f in families
               if rows.get(f"cand_{name}_{f}", {}).get("exit_code", "0") != "0"]  # fmt: skip
        no_row = [f"{f}: no row in summary.tsv" for f in families if f"cand_{name}_{f}" not in rows]
        entry = timed.get(name) if isinstance(timed.get(name), dict) else {}
        rounds = len(entry.get("candidate_ms")) if isinstance(entry.get("candidate_ms"), list) else 0
        ratios = round_ratios(entry)
        ratio = number(entry.get("ratio"))
        error = entry.get("error")
        verdict = {"name": name, "families": families, "families_not_run": missing,
                   "passed": None if counts is None else counts["passed"],
                   "failed": None if counts is None else counts["failures"] + counts["errors"],
                   "skipped": None if counts is None else counts["skipped"],
                   "rounds": rounds, "round_ratios": ratios,
                   "shipped_median_ms": number(entry.get("shipped_median_ms")),
                   "candidate_median_ms": number(entry.get("candidate_median_ms")), "ratio": ratio,
                   "ab_error": None if error in (None, "") else str(error)}  # fmt: skip
        if verdict["failed"]:
            word = "off: fails correctness"
        elif cut:
            word = f"unproven: correctness cut/failed/skipped ({'; '.join(cut)})"
        elif not families or missing:
            word = "unproven: correctness not run on every family it changes"
        elif no_row:
            word = f"unproven: correctness cut/failed/skipped ({'; '.join(no_row)})"
        elif idle:
            word = f"unproven: ran no test in {', '.join(idle)} (every test skipped)"
        elif thin:
            word = f"unproven: skipped more tests than it passed in {', '.join(thin)}"
        elif verdict["ab_error"]:
            word = "off: its A/B raised"
        elif not rounds:
            word = "unproven: not timed"
        elif ratio is None:
            word = "unproven: its A/B ratio is not a number"
        elif ratio < 1.0:
            word = f"off: slower ({ratio:.2f}x)"
        elif rounds < 2:
            word = f"unproven: {ratio:.2f}x in one round"
        elif ratio < PROVEN_RATIO or not all(r is not None and r > 1.0 for r in ratios):
            word = f"unproven: within noise ({ratio:.2f}x)"
        else:
            word = (f"proven: correct, {ratio:.2f}x over {rounds} rounds (>= {PROVEN_RATIO}x, every round "
                    "faster; record its Proof)")  # fmt: skip
        verdict["verdict"] = word
        verdicts.append(verdict)
    return verdicts


def verdict_lines(verdicts: list[dict]) -> list[str]:
    lines = []
    for v in verdicts:
        correct = "not run" if v["passed"] is None else f"{v['passed']} passed, {v['failed']} failed"
        if v.get("skipped"):
            correct += f", {v['skipped']} skipped"
        if v["ab_error"]:
            timing = f"A/B error: {v['ab_error'][:160]}"
        elif v["rounds"]:
            timing = (f"{fmt(v['shipped_median_ms'], '.4g')} -> {fmt(v['candidate_median_ms'], '.4g')} ms, "
                      f"{fmt(v['ratio'], '.2f')}x, {v['rounds']} rounds")  # fmt: skip
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
    profiler's kernel time and GB/s. A file cut before its last case says so first."""
    lines = []
    for path in sorted(raw.glob("*.json")):
        document, _ = read_json(path)
        partial = isinstance(document, dict) and document.get("complete") is False
        if partial and is_benchmark(path):
            lines.append(f"  {path.stem}: partial file: cut before its last case")
        for row in _rows(document):
            if not row.get("available"):
                continue
            timing = row.get("timing") if isinstance(row.get("timing"), dict) else {}
            if "kernel_ms" in row:  # fused_kernel_time.py
                times = f"wall {fmt(row.get('wall_ms'), '.3f')} ms, kernel {fmt(row.get('kernel_ms'), '.3f')}"
                lines.append(
                    f"  {path.stem}: {row.get('op')} {row.get('impl')}: {times} ms, "
                    f"{fmt(row.get('kernel_gbps'), '.0f')} GB/s"
                )
            elif row.get("impl") in OURS and number(timing.get("median_ms")) is not None:
                text = f"  {path.stem}: {row.get('case')} {row['impl']}: {fmt(timing['median_ms'], '.4g')} ms"
                if number(row.get("speedup_vs_fastest_other")) is not None:
                    text += f", {fmt(row['speedup_vs_fastest_other'], '.2f')}x {row.get('fastest_other')}"
                if number(row.get("graph_ms")):
                    text += f"; graph {fmt(row['graph_ms'], '.4g')} ms"
                predicted, error = row.get("prediction_ms"), row.get("prediction_error")
                if number(predicted) is not None and number(error) is not None:
                    text += f"; predicted {fmt(predicted, '.4g')} ms ({fmt(error, '+.0%')}"
                    text += ")" if row.get("prediction_calibrated", True) else ", uncalibrated)"
                lines.append(text)
    return lines


def problems(summary: dict) -> list[str]:
    """Every step that did not pass and every failed test, named: the summary's first lines. A run stopped
    by a signal, or with no GPU, says so first; a candidate's jobs are its verdict's business, not here."""
    lead, found = [], []
    for s in summary["steps"]:
        if s["exit_code"].startswith("cut-by-") and s["step"] == "run":
            lead.append(f"the run was stopped by {s['exit_code'].removeprefix('cut-by-')} after "
                        f"{fmt(s['seconds'], '.0f')} s of its {fmt(s['cap_s'], '.0f')} s budget")  # fmt: skip
        elif s["exit_code"] == "no-gpu":
            lead.append("no CUDA GPU visible: nothing ran; see nvidia-smi and versions in the archive")
        elif s["status"] != "passed" and not s["step"].startswith("cand_"):
            found.append(f"{s['step']}: {s['status']}")
    if str(summary.get("git_commit") or "unknown").startswith("unknown"):
        found.append("commit unknown: these results name no commit (pass LLM_SPEED_GIT_COMMIT)")
    found += summary.get("steps_notes") or []
    if summary.get("not_reached"):
        found.append(f"not reached: {', '.join(summary['not_reached'])}")
    if summary["pytest"] is not None:
        found += [f"FAILED {name}" for name in summary["pytest"]["failed_tests"]]
    # a family whose every test skipped (a capability probe that said no) proved nothing
    for name, c in summary["families"].items():
        if c.get("unreadable"):
            found.append(f"{name}: its junit (pytest_{name}.xml) is unreadable")
        elif c["passed"] == 0 and c["failures"] + c["errors"] == 0:
            found.append(f"{name}: ran no test: {c['skipped']} skipped")
    for name, info in (summary["benchmarks"] or {}).items():
        if "error" in info:
            found.append(f"{name}: {info['error']}")
        if info.get("partial"):
            found.append(f"{name}: partial file: cut before its last case")
    if summary.get("attention_ab_error"):
        found.append(f"attention_ab.json unreadable: {summary['attention_ab_error'][:200]}")
    found += [f"A/B of {v['name']}: {v['ab_error'][:200]}" for v in summary.get("candidate_verdicts") or []
              if v["ab_error"]]  # fmt: skip
    return lead + summary.get("section_failures", []) + found


def proof_text(summary: dict, table: dict) -> list[str]:
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
        text += [f"candidate {name}: families {', '.join(info['families']) or 'none'}"
                 for name, info in table.items()]  # fmt: skip
    c = summary["triton_compiles"]
    if c is not None:
        text += ["", (
            f"Triton: {c['compiled_here']} kernels compiled here ({c['compile_seconds_summed']} s of "
            f"compiler time, summed over processes), {c['loaded_from_cache']} loaded from the run's file "
            f"cache, {c['distinct_kernels']} distinct"
        )]  # fmt: skip
        if "carried_kernels" in c:
            matched = ", ".join(str(m) for m in c["carried_keys_match"]) or "-"
            sources = ", ".join(str(m) for m in c.get("carried_sources_match", [])) or "-"
            text.append(f"Triton cache carried from the CPU: {c['served_by_carried']} of its "
                        f"{c['carried_kernels']} kernels served here; its builder's Triton matched this "
                        f"one's: {matched}; built from these kernel sources: {sources}")  # fmt: skip
            text += [f"Triton cache carried from the CPU: {error}" for error in c.get("carried_errors", [])]
    return text


def write_atomically(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


def _read_header(raw: Path) -> dict:
    path = raw / "environment.txt"
    environment = path.read_text(errors="replace") if path.exists() else ""
    return dict(line.split(": ", 1) for line in environment.splitlines()[:2] if ": " in line)


def _read_versions(raw: Path) -> dict:
    versions, _ = read_json(raw / "versions.json")
    if not isinstance(versions, dict):
        return {"error": "versions.json missing or unreadable (see it in results.tar.gz)"}
    return versions


def _count_lines(title: str, counts: dict) -> list[str]:
    line = (f"{title}: {counts['passed']} passed, {counts['failures']} failed, {counts['errors']} errors, "
            f"{counts['skipped']} skipped")  # fmt: skip
    return ["", line, *(f"  FAILED {name}" for name in counts["failed_tests"])]


def _step_lines(steps: list[dict]) -> list[str]:
    return [f"  {s['step']:<28} {s['status']:<26} {fmt(s['seconds'], '>4.0f')} s "
            f"(cap {fmt(s['cap_s'], '.0f')} s)" for s in steps]  # fmt: skip


def _benchmark_lines(benchmarks: dict) -> list[str]:
    lines = []
    for name, info in benchmarks.items():
        if "rows" in info:
            not_run = "".join(f"; not run: {impl} ({reason})" for impl, reason in info["not_run"].items())
            partial = "; partial file: cut before its last case" if info.get("partial") else ""
            lines.append(f"{name}: {info['rows_run']}/{info['rows']} rows ran{not_run}{partial}")
    return lines


def _log_tails(raw: Path) -> list[str]:
    lines = []
    for pytest_log in sorted(raw.glob("pytest*.log")):
        lines.append("")
        lines.append(f"--- last {PYTEST_LOG_TAIL_LINES} lines of {pytest_log.name} ---")
        lines.extend(pytest_log.read_text(errors="replace").splitlines()[-PYTEST_LOG_TAIL_LINES:])
    return lines


def main(raw_dir: str, out_dir: str) -> int:
    raw, out = Path(raw_dir), Path(out_dir)
    failures: list[str] = []

    def section(name: str, build, default=None):
        """build(), or ``default`` and a PROBLEMS line: one broken input costs its section, not the summary
        (an exception here once left the last summary standing, saying "no failures")."""
        try:
            return build()
        except Exception as error:  # noqa: BLE001
            failures.append(f"summary section {name} failed: {type(error).__name__}: {error}")
            return default

    header = section("environment", lambda: _read_header(raw), {})
    versions = section("versions", lambda: _read_versions(raw), {})
    steps, notes = section("steps", lambda: read_steps(raw), ([], []))
    candidates, table = section("candidates", lambda: read_candidates(raw), (None, {}))
    timed, ab_error = section("attention_ab", lambda: read_ab(raw), ({}, None))
    summary = {
        "date_utc": header.get("date_utc"),
        "git_commit": header.get("git_commit"),
        "versions": versions,
        "steps": steps,
        "steps_notes": notes,
        "not_reached": section("planned steps", lambda: not_reached(raw, steps), []),
        "pytest": section("pytest", lambda: pytest_counts(raw)),
        "candidate_pytest": section("candidate pytest", lambda: candidate_pytest_counts(raw, table)),
        "families": section("families", lambda: pytest_by_file(raw), {}),
        "candidates": candidates,
        "triton_compiles": section("triton compiles", lambda: compiles(raw)),
        "benchmarks": section("benchmarks", lambda: benchmark_files(raw), {}),
        "attention_ab_error": ab_error,
        "candidate_verdicts": section(
            "candidate verdicts", lambda: candidate_verdicts(table, steps, timed, raw), []
        ),
        "archive": "results.tar.gz (every log, benchmark JSON and plot, pytest*.xml, demo/, environment.txt)",
    }
    # the proof's headline: issue 74's targets as this run measured them (benchmarks/proof_targets.py)
    targets = section("targets", lambda: proof_targets.table(raw)
                      if any(s["step"].startswith("headline_") for s in steps) else None)  # fmt: skip
    summary["targets"] = None if targets is None else [dataclasses.asdict(t) for t in targets]

    # the text's body first (its failures are PROBLEMS too), then the problems, then both files from them
    body = section("versions", lambda: ["versions: " + ", ".join(f"{k}={v}" for k, v in versions.items())],
                   [])  # fmt: skip
    body += [""] + section("step table", lambda: _step_lines(steps), [])
    if summary["pytest"] is not None:
        body += section("pytest counts", lambda: _count_lines("pytest", summary["pytest"]), [])
    if summary["candidate_pytest"] is not None:
        title = "candidates' pytest (each under LLM_SPEED_POLICY=<candidate>)"
        body += section("candidate pytest", lambda: _count_lines(title, summary["candidate_pytest"]), [])
    body += section("proof", lambda: proof_text(summary, table), [])
    if summary["candidate_verdicts"]:
        body += ["", "candidate launch choices: verdict; correctness; A/B (shipped -> candidate):"]
        body += section("verdict lines", lambda: verdict_lines(summary["candidate_verdicts"]), [])
    if targets is not None:
        body += ["", "issue 74's targets, from this run's JSON (yes / no; -: a part not measured):"]
        body += section("targets text", lambda: proof_targets.text_lines(targets), [])
    rows = section("headline", lambda: headline(raw), [])
    if rows:
        body += [
            "",
            "ours against the fastest other row of its case (each JSON's ratio; above 1x: ours faster):",
        ]
        body += rows
    body += section("benchmark files", lambda: _benchmark_lines(summary["benchmarks"]), [])
    body += section("pytest logs", lambda: _log_tails(raw), [])

    summary["section_failures"] = failures
    found = section("problems", lambda: problems(summary))
    summary["problems"] = list(failures) if found is None else found
    write_atomically(out / "summary.json", json.dumps(summary, indent=1, default=str) + "\n")
    lines = [f"llm-speed GPU suite, {summary['date_utc']}, commit {summary['git_commit']}"]
    if summary["problems"]:
        lines.append(f"PROBLEMS ({len(summary['problems'])}):")
        lines.extend(f"  {problem}" for problem in summary["problems"])
    else:
        lines.append("no failures: every step passed")
    write_atomically(out / "summary.txt", "\n".join(lines + body) + "\n")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1], sys.argv[2]))
