"""The ``llm-speed`` switchboard: commands, --version, typo suggestions, errors, start-up without torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import llm_speed
from llm_speed import _cli, cli
from llm_speed.perf import cli_hardware
from test_layers import SRC, imports_of

REPO = Path(__file__).resolve().parents[1]

# Commands that need no kernel: they must not import torch (it takes seconds to import).
MODEL_COMMANDS = (
    ["gpus", "--json"],
    ["models", "--json"],
    ["roofline", "--gpu", "h100-sxm", "--gemm", "4096x4096x4096", "--json"],
    ["vram", "--seq-len", "1024", "--num-heads", "8", "--head-dim", "64", "--json"],
    ["kv-cache", "--model", "llama-3-8b", "--seq-len", "1024", "--json"],
    ["analyze", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--json"],
    ["mfu", "--gpu", "h100-sxm", "--ms", "1", "--gemm", "1024,1024,1024", "--json"],
    ["waves", "--gpu", "h100-sxm", "--gemm", "4096x4096x4096", "--json"],
    ["train-memory", "--model", "llama-3-8b", "--gpus", "8", "--json"],
)


def run_python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, *args] + (["-c", code] if code else []),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


def test_model_commands_do_not_import_torch():
    code = f"""
import contextlib, io, sys
from llm_speed.cli import main
for argv in {[list(argv) for argv in MODEL_COMMANDS]!r}:
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(argv) == 0, argv
    assert "torch" not in sys.modules, argv
print("ok")
"""
    result = run_python(code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_python_dash_m_and_version():
    result = run_python("", "-m", "llm_speed", "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"llm-speed {llm_speed.__version__}"


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["bench", "attention", "--casual"], "did you mean --causal?"),
        (["bench", "gemm", "--epilouge", "bias"], "did you mean --epilogue?"),
        (["gpu"], "did you mean gpus?"),
        (["bench", "atention"], "did you mean attention?"),
        (["bench", "attention", "--mode", "fwdbwd"], "did you mean fwd+bwd?"),
    ],
)
def test_typos_get_a_suggestion(argv, suggestion, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert suggestion in capsys.readouterr().err


def test_no_suggestion_for_a_word_far_from_every_option(capsys):
    with pytest.raises(SystemExit):
        cli.main(["gpus", "--zzzzzz"])
    assert "did you mean" not in capsys.readouterr().err


def test_bad_input_exits_2_but_bugs_keep_their_traceback(monkeypatch, capsys):
    assert cli.main(["roofline", "--gpu", "no-such-gpu"]) == 2
    assert "no-such-gpu" in capsys.readouterr().err

    def bug(args):
        raise TypeError("a bug, not bad input")

    monkeypatch.setattr(cli_hardware, "_gpus", bug)
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["gpus"])


def test_gemm_sizes_are_one_parser():
    assert _cli.parse_gemm_size("512x256X128") == (512, 256, 128)
    assert _cli.parse_gemm_size(" 2,3,4 ") == (2, 3, 4)
    for bad in ("1024x1024", "0x4x4", "axbxc", "4x4x4x4", ""):
        with pytest.raises(ValueError, match="--sizes"):
            _cli.parse_gemm_size(bad, argument="--sizes")


def test_zero_gemm_dims_are_refused_at_parse_time(capsys):
    with pytest.raises(SystemExit):
        cli.main(["waves", "--gpu", "h100-sxm", "--gemm", "0,4,4"])
    assert "zero dimension" in capsys.readouterr().err


def test_every_command_module_registers_itself():
    names = [registrar.__module__ for registrar in cli.REGISTRARS]
    assert names == [
        "llm_speed.bench.cli",
        "llm_speed.doctor",
        "llm_speed.kernel_report.command",
        "llm_speed.demo",
        "llm_speed.perf.cli_models",
        "llm_speed.perf.cli_hardware",
        "llm_speed.perf.cli_predict",
        "llm_speed.distributed.cli",
    ]
    assert all(registrar.__name__ == "register" for registrar in cli.REGISTRARS)


def test_shared_cli_module_imports_no_command():
    edges = imports_of(SRC / "llm_speed" / "_cli.py", "llm_speed._cli")
    assert all(edge.startswith(("llm_speed._output", "llm_speed.core.")) for edge in edges), edges
