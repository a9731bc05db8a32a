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


def test_the_compile_processes_never_outnumber_the_kernels_nor_the_first_ones_the_cpus():
    assert report.shards(99999, 1) == 1 and report.shards(64, 121) == 64 and report.shards(3, 0) == 1
    assert report.first_workers(99999, cpus=2) == 2 and report.first_workers(64, cpus=64) == 64
    assert report.first_workers(1, cpus=16) == 1


def test_a_worker_past_the_shard_count_it_is_told_compiles_nothing(tmp_path):
    """Started before the kernels were counted (``"shards": null``), a worker reads the count on stdin once
    it has captured them: past it, it exits having printed only the count."""
    import json
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia", reason="compiles for sm_90a: no NVIDIA backend here")
    request = {"gpu": "h100-sxm", "ops": ["gemm"], "options": {"dtypes": ["fp16"]}, "shard": 1,
               "shards": None}
    done = subprocess.run(
        [sys.executable, "-m", "llm_speed.kernel_report.worker", json.dumps(request)],
        input=json.dumps({"shards": 1}) + "\n", capture_output=True, text=True, timeout=300,
        env=report.worker_environment(report.gpu_build(), str(tmp_path)),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert [json.loads(line) for line in done.stdout.splitlines()] == [{"kernels": 1}], done.stdout


def test_the_report_starts_no_more_workers_than_the_cpus_and_compiles_in_no_more_than_the_kernels(
    monkeypatch,
):
    """``--workers 99999`` for one kernel: the workers started before the count are the CPUs' (2 here), one
    of them compiles, none is started after (the sweep found 136 processes for 1 kernel on 2 cores)."""
    import subprocess

    pytest.importorskip("triton.backends.nvidia", reason="compiles for sm_90a: no NVIDIA backend here")
    started = []

    class Popen(subprocess.Popen):
        def __init__(self, args, **kwargs):
            started.append(args)
            super().__init__(args, **kwargs)

    monkeypatch.setattr(report.subprocess, "Popen", Popen)
    monkeypatch.setattr(report.os, "cpu_count", lambda: 2)
    result = report.run_report(gpu="h100-sxm", ops=["gemm"], options={"dtypes": ["fp16"]}, workers=99999,
                               build=report.gpu_build(), timeout=300)  # fmt: skip
    assert len(started) == 2 and result["workers"] == 1, (len(started), result["workers"])
    (row,) = result["rows"]
    assert row["error"] is None, row["error"]


def test_a_dtype_the_gpu_has_no_peak_for_is_refused_as_roofline_refuses_it(no_workers, capsys):
    # T4 has no bf16 tensor cores: roofline and analyze refuse bf16 there, and so does the kernel report.
    err = _refused(["--gpu", "t4", "--dtype", "bf16", "--op", "gemm"], capsys)
    assert "--dtype bf16: t4" in err and "accepted on t4: fp16, fp32" in err, err
    assert cli.main(["roofline", "--gpu", "t4", "--dtype", "bf16"]) == 2
    assert "--dtype bf16" in capsys.readouterr().err


def test_the_options_each_op_reads_are_those_its_builder_reads():
    """problems.OPTIONS_READ (restated to keep the command torch-free) against the Options fields each
    builder reads while making its problems."""
    from llm_speed.kernel_report import problems

    read: set[str] = set()

    class Reading(problems.Options):
        def __getattribute__(self, name):
            if name in command.OPTION_FLAGS:
                read.add(name)
            return super().__getattribute__(name)

    builders = {**problems.BUILDERS, **problems.GLUON_BUILDERS}
    assert set(problems.OPTIONS_READ) == set(builders)
    for name, builder in builders.items():
        read.clear()
        assert list(builder(name, Reading())), name
        # Read and then not used: _fused hands the cross-entropies --size, fused_problem gives them fixed
        # shapes; _gluon_attention lists the 16-bit dtypes, its fp8 forward takes e4m3 whatever they are.
        if "cross_entropy" in name:
            read.discard("size")
        if name == "gluon_attention_fwd_fp8":
            read.discard("dtypes")
        assert read == problems.OPTIONS_READ[name], name


def test_options_no_chosen_op_reads_are_refused_naming_them(no_workers, capsys):
    # The sweep's case: attention-only options beside a GEMM were ignored without a word.
    err = _refused(["--op", "gemm", "--backward", "deterministic", "--head-dim", "64"], capsys)
    assert "--head-dim, --backward: do not apply to --op gemm (whose problems take --dtype, --size)" in err
    err = _refused(["--op", "flash_attention", "--size", "1024"], capsys)
    assert "--size: does not apply to --op flash_attention" in err and "--head-dim, --seq" in err, err


def test_options_one_chosen_op_reads_are_accepted():
    def args(*argv):
        parser = argparse.ArgumentParser()
        command.register(parser.add_subparsers())
        return parser.parse_args(["kernels", *argv])

    assert command.inapplicable_options(args("--size", "64", "--head-dim", "64")) is None  # every op
    assert command.inapplicable_options(args("--op", "gemm", "--op", "flash_attention_backward", "--size",
                                             "64", "--backward", "default")) is None  # fmt: skip
    assert command.inapplicable_options(args("--op", "gemm", "--shipped", "--backward", "default")) is None
    assert "--heads" in command.inapplicable_options(args("--op", "attention_kvcache_fwd", "--heads", "8"))
