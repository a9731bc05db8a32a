"""The topic guides (docs/guides/) are where measurements and predictions are written down: every reference to
a guide names one that exists, nothing refers to the retired docs/notes/, each guide is indexed, and every
results folder a guide cites exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GUIDES = REPO / "docs" / "guides"
# What may cite a guide: the docs, the README, the benchmarks, the tests and the package.
SEARCHED = ("README.md", "Makefile", "docs", "benchmarks", "tests", "src")
SUFFIXES = {".md", ".py", ".sh", ".toml", ""}
GUIDE_REF = re.compile(r"(?:docs/)?guides/([\w.-]+\.md)")
NOTES_REF = re.compile(r"docs/notes\b")
# Results folders as the guides' tables give them (`b9171ef-fused/`), relative to the results root.
RESULTS_ROOT = REPO / "benchmarks" / "results"
RESULTS_ROW = re.compile(r"^\| [\w.-]+ \| `([^`]+)`", re.MULTILINE)


def _files():
    for top in SEARCHED:
        path = REPO / top
        candidates = [path] if path.is_file() else sorted(path.rglob("*"))
        for file in candidates:
            generated = any(part == "__pycache__" or part.endswith(".egg-info") for part in file.parts)
            if file.is_file() and file.suffix in SUFFIXES and not generated:
                if "results" in file.relative_to(REPO).parts[:2]:
                    continue  # measurement files, not prose
                yield file


def test_every_guide_reference_names_a_guide_that_exists():
    missing = {}
    for file in _files():
        text = file.read_text(encoding="utf-8", errors="replace")
        for name in GUIDE_REF.findall(text):
            if not (GUIDES / name).is_file():
                missing.setdefault(str(file.relative_to(REPO)), set()).add(name)
    assert not missing, f"references to guides that do not exist: {missing}"


def test_nothing_refers_to_docs_notes():
    found = {}
    for file in _files():
        if file == Path(__file__):
            continue
        count = len(NOTES_REF.findall(file.read_text(encoding="utf-8", errors="replace")))
        if count:
            found[str(file.relative_to(REPO))] = count
    assert not (REPO / "docs" / "notes").exists()
    assert found == {}, found


def test_the_index_lists_every_guide_and_every_guide_has_its_parts():
    index = (GUIDES / "README.md").read_text()
    guides = sorted(p.name for p in GUIDES.glob("*.md") if p.name != "README.md")
    assert guides, "no guides"
    for name in guides:
        assert f"]({name})" in index, f"docs/guides/README.md does not list {name}"
    for name in ("attention-hopper.md", "decode.md", "gemm.md", "fused-ops.md", "fp8.md", "host-path.md"):
        text = (GUIDES / name).read_text()
        for part in ("## Reproduce", "## Measured on an H100 SXM", "## Predicted, and what the GPU said"):
            assert part in text, f"{name} lacks {part!r}"


def test_every_cited_results_folder_exists():
    cited = 0
    for guide in GUIDES.glob("*.md"):
        text = guide.read_text()
        table = text.split("\n## Results f", 1)[1] if "\n## Results f" in text else ""
        for path in RESULTS_ROW.findall(table):
            if path.startswith("h100-sxm/") or path.startswith("cpu-simulated/"):
                target = RESULTS_ROOT / path
            else:
                target = RESULTS_ROOT / "h100-sxm" / path
            assert target.exists(), f"{guide.name} cites {path}, which is not under benchmarks/results/"
            cited += 1
        for label in set(re.findall(r"\[(L\d-[\w-]+)\]", text)):
            assert re.search(rf"^\| {re.escape(label)} \| `", table, re.MULTILINE), (
                f"{guide.name} cites [{label}] without a row in its results table"
            )
    assert cited >= 20
