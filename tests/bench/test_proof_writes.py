"""What the proof's benchmarks write: fused_kernel_time.py's lines when the profiler saw no kernel (audit 10,
M4) and its JSON, and the bench commands' dump_json, each replaced whole or not at all (C5)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from llm_speed._output import dump_json

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import fused_kernel_time  # noqa: E402 - a script of benchmarks/, not a package


def test_a_row_without_kernel_time_prints_a_dash():
    """measure_row sets kernel_gbps to None when the profiler saw no kernel (kernel time 0): formatting it
    as a number stopped the step at its first row, before the JSON was written."""
    row = {"available": True, "wall_ms": 1.0, "kernel_ms": 0.0, "kernel_gbps": None}
    line = fused_kernel_time.row_line("rms_norm", "llm_speed", row)
    assert line.endswith("kernel    0.000 ms        - GB/s (kernel)") and "wall    1.000 ms" in line
    row = {"available": True, "wall_ms": 1.0, "kernel_ms": 0.5, "kernel_gbps": 2000.0}
    assert fused_kernel_time.row_line("rms_norm", "llm_speed", row).endswith("   2000 GB/s (kernel)")
    line = fused_kernel_time.row_line("rms_norm", "liger", {"available": False, "reason": "not installed"})
    assert line == "rms_norm  liger          not run: not installed"


def _failing_replace(monkeypatch):
    def replace(source, target):
        raise OSError("cut here")

    monkeypatch.setattr(os, "replace", replace)


def test_a_json_rewrite_replaces_the_file_whole_or_not_at_all(tmp_path, monkeypatch):
    # (the bench commands' and fused_kernel_time.py's writes: dump_json)
    def rewrite(path: Path, document: dict) -> None:
        dump_json(document, path)

    path = tmp_path / "rows.json"
    rewrite(path, {"results": [1]})
    assert json.loads(path.read_text()) == {"results": [1]}
    _failing_replace(monkeypatch)  # a run cut between the write and the rename
    with pytest.raises(OSError, match="cut here"):
        rewrite(path, {"results": [1, 2]})
    assert json.loads(path.read_text()) == {"results": [1]}  # the earlier rows, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]  # no temporary left beside it
    monkeypatch.undo()
    rewrite(path, {"results": [1, 2]})
    assert json.loads(path.read_text()) == {"results": [1, 2]}


def test_dump_json_writes_through_a_link(tmp_path):
    target = tmp_path / "target.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    dump_json({"a": 1}, link)
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}
