"""Every skip in the test suite says why, in words a reader of `pytest -rs` understands: pytest.skip,
skipif and importorskip each carry a reason of a few words written in the test (a literal or an f-string),
never pytest's bare "could not import 'x'" or a two-word "needs Triton"."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MIN_WORDS = 3


def _skips(tree: ast.AST):
    """(line, kind, reason node or None) of every pytest.skip / skipif / importorskip call."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        name = node.func.attr
        if name not in ("skip", "skipif", "importorskip"):
            continue
        reason = next((k.value for k in node.keywords if k.arg in ("reason", "msg")), None)
        if reason is None and name == "skip" and node.args:
            reason = node.args[0]
        yield node.lineno, name, reason


def _words(reason: ast.expr) -> int | None:
    """Words in a literal or f-string reason (a placeholder counts as one), None for anything else."""
    if isinstance(reason, ast.Constant) and isinstance(reason.value, str):
        return len(reason.value.split())
    if isinstance(reason, ast.JoinedStr):
        return sum(
            len(part.value.split()) if isinstance(part, ast.Constant) else 1 for part in reason.values
        )
    return None


def test_every_skip_says_why_in_words():
    unclear = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, kind, reason in _skips(tree):
            where = f"{path.relative_to(TESTS)}:{line} {kind}"
            if reason is None:
                unclear.append(f"{where}: no reason")
            elif (words := _words(reason)) is None:
                unclear.append(f"{where}: the reason is not written here ({ast.unparse(reason)})")
            elif words < MIN_WORDS:
                unclear.append(f"{where}: {ast.unparse(reason)} says too little")
    assert not unclear, "\n".join(unclear)
