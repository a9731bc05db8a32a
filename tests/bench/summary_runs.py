"""Hand-made RAW folders of a GPU-suite run and benchmarks/suite_summary.py run on them as the suite runs it:
what tests/bench/test_suite_summary.py and test_gpu_suite_script.py feed the summary writer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEADER = "step\texit_code\tseconds\tcap_s\n"


def raw_run(tmp_path: Path, steps: str | None, **files: object) -> tuple[Path, Path]:
    """(RAW, OUT) of a run whose summary.tsv holds ``steps`` (None: no summary.tsv) and RAW/``files``
    (str as is, anything else as JSON; ``__`` in a keyword stands for '.'); environment.txt names a commit
    unless ``files`` says otherwise."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    out.mkdir()
    if steps is not None:
        (raw / "summary.tsv").write_text(HEADER + steps)
    files.setdefault("environment__txt", "date_utc: 2026-12-07T00:00:00Z\ngit_commit: 0123abc\n")
    for name, content in files.items():
        text = content if isinstance(content, str) else json.dumps(content)
        (raw / name.replace("__", ".")).write_text(text)
    return raw, out


def summarise(raw: Path, out: Path) -> dict:
    """The summary writer run as the suite runs it (its own process): it must exit 0 and write both files,
    which say the same problems; its summary.json."""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "suite_summary.py"), str(raw), str(out)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    lines = (out / "summary.txt").read_text().splitlines()
    if summary["problems"]:
        assert lines[1] == f"PROBLEMS ({len(summary['problems'])}):", lines[:3]
        assert lines[2 : 2 + len(summary["problems"])] == [f"  {p}" for p in summary["problems"]]
    else:
        assert lines[1] == "no failures: every step passed"
    return summary
