"""Bad input to ``llm-speed kernels``: one line naming the option and what it accepts, exit 2, before any
worker starts (a worker imports torch and Triton, captures every problem, and compiles)."""

from __future__ import annotations

import argparse

import pytest

from llm_speed import cli
from llm_speed.kernel_report import command, report


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if the report starts: the refusal must come first."""

    def run_report(**kwargs):
        raise AssertionError("the report started")

    monkeypatch.setattr(report, "run_report", run_report)


def _refused(argv, capsys) -> str:
    assert cli.main(["kernels", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("llm-speed kernels: error: "), err
    return err


def test_a_size_past_what_pytorch_can_represent_is_refused_naming_size_and_the_range(no_workers, capsys):
    err = _refused(["--op", "gemm", "--size", "99999999999"], capsys)
    assert "--size: 99999999999 is too large" in err and f"accepted: 1 to {command.MAX_SIZE}" in err, err


def test_attention_sizes_past_what_pytorch_can_represent_are_refused(no_workers, capsys):
    err = _refused(["--op", "flash_attention", "--seq", str(10**17)], capsys)
    assert "--seq" in err and "--heads" in err and "--head-dim" in err and "accepted" in err, err


def _args(**sizes) -> argparse.Namespace:
    return argparse.Namespace(**{"size": 4096, "seq": 4096, "heads": 16, "head_dim": None, **sizes})


def test_the_size_bounds_are_the_largest_representable_tensors():
    # The bound itself is accepted, one past it refused: [size, size] fp32 and the decode cache's 64 heads.
    assert command.MAX_SIZE**2 * 4 <= 2**63 - 1 < (command.MAX_SIZE + 1) ** 2 * 4
    assert command.unrepresentable_sizes(_args(size=command.MAX_SIZE)) is None
    assert "--size" in command.unrepresentable_sizes(_args(size=command.MAX_SIZE + 1))
    seq = command.MAX_ELEMENTS // (64 * 256)
    assert command.unrepresentable_sizes(_args(seq=seq, head_dim=[256])) is None
    assert "--seq" in command.unrepresentable_sizes(_args(seq=seq + 1, head_dim=[256]))


def test_a_worker_reports_a_tensor_pytorch_cannot_represent_as_bad_input():
    # The safety net behind the command's bounds: an overflowing storage size is the problem's fault (exit
    # 2 through ProblemError), not a worker crash with a traceback.
    from llm_speed.kernel_report import worker

    request = {"gpu": "h100-sxm", "set": "default", "ops": ["gemm"], "options": {"size": 99999999999}}
    with pytest.raises(worker.ProblemError, match="overflow"):
        worker.kernels(request)
