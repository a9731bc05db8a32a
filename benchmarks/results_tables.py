#!/usr/bin/env python3
"""The tables the docs quote from the GPU records, made from the committed JSON (and the suite script) so
that the docs say what was measured and no more:

- benchmarks/results/h100-sxm/README.md: every results folder, its commit, the suite step(s) that filled it
  and its former date-and-call name (``renamed.sed`` beside it rewrites old citations);
- docs/h100-results.md, block "records": each GPU test-suite run with its counts and whether every chunk
  finished (a chunk cut by its cap means the suite did not finish), and every A/B of ``attention_ab.py``
  as the median over every round with its ratio to cuDNN;
- README.md, block "gpu-records": the same two facts for the latest run, one line each;
- docs/benchmarks.md, block "suite-steps": each step of ``run_gpu_suite.sh`` with its budget and sub-steps'
  caps, read from the script's own ``--dry-run``.

    python benchmarks/results_tables.py            rewrite them
    python benchmarks/results_tables.py --check    exit 1 when a committed file differs (a test runs this)

A block sits between ``<!-- results_tables.py: NAME -->`` and ``<!-- end results_tables.py: NAME -->``.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
H100 = REPO / "benchmarks" / "results" / "h100-sxm"
STEPS = ("proof", "quick", "tests", "bench", "fused", "probe")

# (folder, commit, what filled it, former name): commit "unrecorded" where no file of the folder names one.
INDEX = (
    ("af147ec-baseline", "af147ec", "bench grid: bf16 GEMM squares 512-8192 and Llama-3 8B/70B weights, fp16 "
     "attention d=128 512-16k; copy ceiling", "2026-11-22-baseline"),
    ("de6b100-quick-tests", "de6b100", "suite quick and tests", "2026-11-22-call1"),
    ("eaeac89-doctor-tests", "eaeac89", "doctor; suite tests", "2026-11-22-call2"),
    ("unrecorded-tile-sweep-1", "unrecorded", "attention block-size sweep at 16k; host path per call",
     "2026-11-22-call4"),
    ("unrecorded-tile-sweep-2", "unrecorded", "attention block-size sweep at 16k", "2026-11-22-call5"),
    ("d1b0227-quick-tests-bench", "d1b0227", "suite quick, tests and bench", "2026-11-25-suite"),
    ("2b2a055-ab-fp8-decode", "2b2a055", "attention_ab.py, fp8 attention at 16k, decode, fp8 GEMM NT",
     "2026-11-25-call4"),
    ("4c378d4-ab-fp8", "4c378d4", "attention_ab.py, fp8 GEMM NT 4096", "2026-11-25-call5"),
    ("0cce093-tests-bench", "0cce093", "suite tests and bench", "2026-11-25-suite2"),
    ("5e051eb-tests-fp8-overhead", "5e051eb", "the 7 failed tests again, fp8 GEMM, training overhead",
     "2026-11-25-suite2/call3"),
    ("unrecorded-ab-overhead", "unrecorded", "attention_ab.py backward paths, tiles and sweep (between "
     "5e051eb and eafec86); training overhead", "2026-11-25-suite2/call4-6"),
    ("eafec86-fp8", "eafec86", "fp8 GEMM 4096 and 8192", "2026-11-25-suite2/call7"),
    ("b9171ef-fused", "b9171ef", "suite fused: bench ops, train-step, moe", "2026-11-25-suite2/call8"),
    ("f4de76f-ce-train-step", "f4de76f", "linear cross-entropy and train-step after the chunk change",
     "2026-11-25-suite2/call10"),
)  # fmt: skip


# The backward path each attention_ab.py row of the old format ("results") timed. Its JSON holds only the
# device, torch and the row labels, and a label names the option the row set, not the path that ran: a row
# that forced no path (no suffix, or "atomic": deterministic=False) ran the build's default, which moved
# between the leases. The first 2026-11-25 lease ran the kernels of d1b0227, where it was dQ by atomics; by
# the second lease's A/B (unrecorded-ab-overhead) the H100's tier kept its dQ kernel, so those "atomic" rows
# timed the dQ kernel (docs/h100-results.md, the correction under that lease's backward A/B; 6a2b66b).
DEFAULT_BACKWARD_PATH = {
    "2b2a055-ab-fp8-decode": "dQ by atomics",
    "4c378d4-ab-fp8": "dQ by atomics",
    "unrecorded-ab-overhead": "dQ kernel",
}


def backward_path(folder: str, label: str) -> str:
    """The backward path an ``attention_ab.py`` row timed ('' for a forward row)."""
    words = label.split()
    if words[0] != "backward":
        return ""
    if "tma-dq-add" in words:
        return "dQ by TMA tile adds"
    if "atomic-dq" in words:  # forced since 6a2b66b
        return "dQ by atomics"
    if "deterministic" in words:
        return "dQ kernel"
    return DEFAULT_BACKWARD_PATH.get(folder, "the build's default for deterministic=False")


def _display(path: Path) -> str:
    return str(path.relative_to(H100))


def index_readme() -> str:
    lines = [
        "# H100 SXM results (NVIDIA H100 80GB HBM3, torch 2.11.0+cu130, Triton 3.6.0)",
        "",
        "Each folder is named by the commit that ran and the suite step(s) or script that filled it; a",
        "folder whose files record no commit says `unrecorded`. Written by",
        "`python benchmarks/results_tables.py`.",
        "Citations of the former names: `sed -i -f benchmarks/results/h100-sxm/renamed.sed FILE...`.",
        "`compiled-af147ec.json`: the measured tiles compiled for sm_90a at af147ec",
        "(`benchmarks/compile_measured_tiles.py`).",
        "",
        "| folder | commit | what filled it | former name |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| `{folder}/` | {commit} | {what} | `{old}` |" for folder, commit, what, old in INDEX]
    return "\n".join(lines) + "\n"


def _oldest_first(root: Path, pattern: str) -> list[Path]:
    """Files under ``root`` matching ``pattern``, folders in INDEX's (chronological) order."""
    order = {folder: i for i, (folder, *_) in enumerate(INDEX)}
    return sorted(root.rglob(pattern), key=lambda p: (order.get(p.relative_to(root).parts[0], -1), p))


def suite_runs(root: Path = H100) -> list[dict]:
    """Every summary a suite step wrote (``*summary.json`` with steps): its counts and whether it finished."""
    runs = []
    for path in _oldest_first(root, "*summary.json"):
        document = json.loads(path.read_text())
        steps, counts = document.get("steps") or [], document.get("pytest")
        if not steps or counts is None:
            continue
        cut = [s for s in steps if s["status"].startswith(("timed out", "skipped"))]
        runs.append({
            "file": _display(path) if root == H100 else str(path.relative_to(root)),
            "commit": (document.get("git_commit") or "unrecorded")[:7],
            "passed": counts["passed"], "failed": counts["failures"] + counts["errors"],
            "skipped": counts["skipped"],
            "finished": not cut,
            "cut": ", ".join(f"{s['step']} {s['status']}" for s in cut),
        })  # fmt: skip
    return runs


def ab_rows(root: Path = H100) -> list[dict]:
    """Every ``attention_ab.py`` median over every round, beside the same case's cuDNN median."""
    rows = []
    for path in _oldest_first(root, "attention_ab*.json"):
        results = json.loads(path.read_text()).get("results") or {}
        medians = {}
        for label, value in results.items():
            if isinstance(value, dict) and value.get("runs"):
                medians[label] = (statistics.median(value["runs"]), len(value["runs"]))
        for label, (median, rounds) in medians.items():
            if "sdpa-cudnn" in label:
                continue
            # "backward full 1x16384 fp16 <variant>": the case is its first four words, cuDNN's row its own
            case = " ".join(label.split()[:4])
            cudnn = medians.get(f"{case} sdpa-cudnn", (None,))[0]
            rows.append({
                "file": _display(path) if root == H100 else str(path.relative_to(root)),
                "label": label, "path": backward_path(path.parent.name, label), "rounds": rounds,
                "median_ms": median,
                "vs_cudnn": cudnn / median if cudnn else None,
            })  # fmt: skip
    return rows


def records_block() -> str:
    lines = [
        "GPU test-suite runs (every `*summary.json` under `benchmarks/results/h100-sxm/`): a run finished",
        "only when none of its chunks was cut by its cap or skipped.",
        "",
        "| summary | commit | passed | failed | skipped | finished |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for run in suite_runs():
        finished = "yes" if run["finished"] else f"no: {run['cut']}"
        counts = f"{run['passed']} | {run['failed']} | {run['skipped']}"
        lines.append(f"| `{run['file']}` | {run['commit']} | {counts} | {finished} |")
    lines += [
        "",
        "`benchmarks/attention_ab.py` (every `attention_ab*.json` with its rounds): median over every round,",
        "ms, and the same case's cuDNN median over this one (above 1x: faster than cuDNN). The variant is",
        "the JSON's label, which names the option a row set; \"path timed\" is the backward that ran: on",
        "the second lease's build `deterministic=False` (\"atomic\") kept the dQ kernel.",
        "",
        "| file | variant | path timed | rounds | median ms | vs cuDNN |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for row in ab_rows():
        ratio = f"{row['vs_cudnn']:.2f}x" if row["vs_cudnn"] else ""
        time = f"{row['rounds']} | {row['median_ms']:.2f}"
        lines.append(f"| `{row['file']}` | {row['label']} | {row['path']} | {time} | {ratio} |")
    return "\n".join(lines)


def readme_block() -> str:
    latest = [r for r in suite_runs() if r["file"].endswith("tests-summary.json")][-1]
    state = "finished" if latest["finished"] else f"did not finish ({latest['cut']})"
    # the latest A/B of the shipped backward paths over several rounds (rows come oldest first)
    shipped = [r for r in ab_rows() if r["vs_cudnn"] and r["rounds"] > 1 and " shipped " in r["label"]
               and "tma-dq-add" not in r["label"]]  # fmt: skip
    latest_file = shipped[-1]["file"]
    backward = [r for r in shipped if r["file"] == latest_file]
    low, high = min(r["vs_cudnn"] for r in backward), max(r["vs_cudnn"] for r in backward)
    files = [latest_file]
    paths = " and ".join(sorted({r["path"] for r in backward}))
    return (
        f"> - The whole test suite on the GPU, latest run (`{latest['file']}`, commit {latest['commit']}): "
        f"{latest['passed']} passed, {latest['failed']} failed, {latest['skipped']} skipped; {state}.\n"
        f"> - The d = 128 backward at 1 x 16 x 16384 (the shipped tile; path timed: {paths}) against cuDNN: "
        f"{low:.2f}-{high:.2f}x, medians over every round ({', '.join(f'`{f}`' for f in files)})."
    )


def steps_block() -> str:
    lines = ["| STEP | budget | sub-steps (cap, s) |", "| --- | --- | --- |"]
    for step in STEPS:
        out = subprocess.run(["bash", str(REPO / "benchmarks" / "run_gpu_suite.sh"), "--dry-run", step],
                             capture_output=True, text=True, check=True, timeout=60).stdout  # fmt: skip
        budget = re.search(r"^\[\w+\] budget (\d+)s$", out, re.MULTILINE)
        subs = re.findall(r"^\[\w+/(\w+)\] cap (\d+)s:", out, re.MULTILINE)
        lines.append(f"| `{step}` | {budget.group(1)} s | {', '.join(f'{n} {c}' for n, c in subs)} |")
    return "\n".join(lines)


def with_block(text: str, name: str, body: str, path: Path) -> str:
    begin, end = f"<!-- results_tables.py: {name} -->", f"<!-- end results_tables.py: {name} -->"
    pattern = re.compile(re.escape(begin) + r"\n(?:.*?\n)?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no block {begin} ... {end}")
    return pattern.sub(lambda _: f"{begin}\n{body}\n{end}", text)


def outputs() -> dict[Path, str]:
    """Each file's text as this script writes it."""
    files = {H100 / "README.md": index_readme()}
    for relative, name, body in (
        ("docs/h100-results.md", "records", records_block()),
        ("README.md", "gpu-records", readme_block()),
        ("docs/benchmarks.md", "suite-steps", steps_block()),
    ):
        path = REPO / relative
        files[path] = with_block(files.get(path, path.read_text()), name, body, path)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare, write nothing; exit 1 when stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(str(path.relative_to(REPO)))
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print("stale (run python benchmarks/results_tables.py): " + ", ".join(stale))
        return 1
    print(("rewrote: " + ", ".join(stale)) if stale else "all up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
