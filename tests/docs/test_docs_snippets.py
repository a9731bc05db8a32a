"""Every command and snippet in the README and the benchmark and compatibility docs runs, on a CPU.

Python snippets run in order, one namespace per page (a later snippet may use an earlier one's names).
Shell commands run in-process (``llm_speed.cli.main``) in a temporary working directory. The benchmark
commands are made cheap the way a CPU user's run is made bearable: the CPU budget per call
(``cpu_budget.CALL_SECONDS``) is lowered, so the same scaling code shrinks the problems further, and each row
is timed once; an attention command's query heads are cut to :data:`HEADS` (the group ratio kept), as the
scaler keeps the heads asked for (32 heads at d = 128 took 22 s of ``make test`` in three interpreted calls
per implementation). Commands that need what a test cannot have (a fresh virtual environment, a GPU) are
listed in ``NOT_RUN`` with the reason, and the test fails if a page gains a command it does not know.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from llm_speed.bench import cpu_budget
from llm_speed.cli import main

REPO = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/benchmarks.md", "docs/compat.md")
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)
CHEAP = ["--warmup", "0", "--iterations", "1", "--min-time", "0", "--no-progress"]
HEADS = 4
NOT_RUN = {
    "make demo": "creates a virtual environment; `llm-speed demo` is what it runs (below)",
    "make test": "creates a virtual environment and runs this suite",
    "llm-speed demo": "covered by tests/bench/test_bench_cli.py::test_demo_runs_end_to_end (a subprocess)",
    "LLM_SPEED_GIT_COMMIT=$(git rev-parse HEAD) PYTHON=python3 "
    "benchmarks/run_gpu_suite.sh quick gpu-results": (
        "the GPU suite refuses to run without a GPU; tests/bench/test_gpu_suite_script.py tests the script"
    ),
    "make gpu-quick": "runs the GPU suite's quick step, which refuses to run without a GPU (see above)",
    "LLM_SPEED_GIT_COMMIT=$(git rev-parse HEAD) PYTHON=python3 "
    "benchmarks/run_gpu_suite.sh proof gpu-results": (
        "the GPU suite refuses to run without a GPU; tests/bench/test_gpu_suite_script.py checks it"
    ),
    "make gpu-proof": "runs the GPU suite's proof step, which refuses to run without a GPU (see above)",
}


def blocks(page: str, language: str) -> list[str]:
    text = (REPO / page).read_text(encoding="utf-8")
    return [body for lang, body in FENCE.findall(text) if lang == language]


def shell_commands(page: str) -> list[str]:
    """The commands of a page's bash blocks: continuations joined, comments dropped, ``;`` split."""
    commands = []
    for body in blocks(page, "bash"):
        for line in body.replace("\\\n", " ").splitlines():
            line = line.split("  #")[0].split(" # ")[0].strip()
            commands += [part.strip() for part in line.split(";") if part.strip()]
    return commands


def _first_appearances() -> list[tuple[str, str]]:
    """(page, command) of each command on the first page that shows it: the same call on a second page
    tests nothing more."""
    seen: dict[str, str] = {}
    for page in PAGES:
        for command in shell_commands(page):
            seen.setdefault(command, page)
    return [(page, command) for command, page in seen.items()]


COMMANDS = _first_appearances()


def test_the_pages_have_snippets_to_test():
    assert len(COMMANDS) >= 15
    assert all(blocks(page, "python") for page in ("README.md", "docs/compat.md"))


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p, "python")])
def test_python_snippets_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__"}
    for snippet in blocks(page, "python"):
        exec(compile(snippet, f"{page} snippet", "exec"), namespace)  # noqa: S102 - our own docs


def _fewer_heads(argv: list[str]) -> list[str]:
    """``argv`` with ``--num-heads N`` above :data:`HEADS` cut to it, and ``--num-kv-heads`` by the same
    factor (at least 1): the same kind of problem (MHA, GQA or MQA), fewer interpreted programs."""
    flags = {name: argv.index(name) + 1 for name in ("--num-heads", "--num-kv-heads") if name in argv}
    if "--num-heads" not in flags or int(argv[flags["--num-heads"]]) <= HEADS:
        return argv
    argv, factor = list(argv), int(argv[flags["--num-heads"]]) // HEADS
    argv[flags["--num-heads"]] = str(HEADS)
    if "--num-kv-heads" in flags:
        argv[flags["--num-kv-heads"]] = str(max(1, int(argv[flags["--num-kv-heads"]]) // factor))
    return argv


def test_fewer_heads_keeps_the_kind_of_problem():
    assert _fewer_heads(["bench", "attention", "--num-heads", "32", "--num-kv-heads", "8"]) == [
        "bench", "attention", "--num-heads", "4", "--num-kv-heads", "1"]  # fmt: skip
    small = ["bench", "attention", "--num-heads", "2"]
    assert _fewer_heads(small) == small
    assert _fewer_heads(["bench", "gemm", "--dtype", "bf16"]) == ["bench", "gemm", "--dtype", "bf16"]


@pytest.mark.parametrize(("page", "command"), COMMANDS, ids=[f"{p}: {c[:60]}" for p, c in COMMANDS])
def test_shell_commands_run(page, command, tmp_path, monkeypatch, capsys):
    if command in NOT_RUN:
        pytest.skip(f"`{command}` is not run here: {NOT_RUN[command]}")
    argv = shlex.split(command)
    assert argv[0] == "llm-speed", f"{page}: unknown command {command!r}; run it here or list it in NOT_RUN"
    argv = argv[1:]
    if argv[0] == "bench":
        monkeypatch.setattr(cpu_budget, "CALL_SECONDS", 0.002)
        argv = _fewer_heads(argv) + [*CHEAP, "--device", "cpu"]
    monkeypatch.chdir(tmp_path)
    try:
        code = main(argv)
    except SystemExit as exit_:  # --help
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 0, captured.out[-2000:] + captured.err[-2000:]
    if argv[0] == "bench":
        assert "note: estimated run time on this CPU" in captured.out
