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
    ["analyze", "--model", "llama-3-8b", "--json"],  # the GPU detected without torch
    ["predict", "gemm", "m=64", "n=64", "k=64", "--json"],
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


def test_a_word_sharing_letters_with_a_command_gets_no_suggestion(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bogus"])  # "gpus" shares three letters; a suggestion of it misleads
    assert "did you mean" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["analyze", "--model", ""], "llm-speed analyze: error: --model: an empty name; give a zoo id ("),
        (["analyze", "--model", "llama-3-8b", "--plot", "/tmp"],
         "llm-speed analyze: error: --plot: /tmp is a folder; give a file name in it, e.g. /tmp/plot.png"),
    ],
)
def test_an_empty_model_and_a_folder_for_a_plot_are_named_as_such(argv, line, capsys):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(line)


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        # the command the word was given to reports it, with its own options only: --op is kernels', and
        # predict takes the op as a word (the top parser suggested --op to predict, from every command)
        (["predict", "--op", "gemm"], "llm-speed predict: error: unrecognized arguments: --op"),
        (["kernels", "--gpu", "h100", "--ops", "gemm"],
         "llm-speed kernels: error: unrecognized arguments: --ops gemm (did you mean --op?)"),  # fmt: skip
        (["bench", "overhead", "--iterations", "3"],
         "llm-speed bench overhead: error: unrecognized arguments: --iterations 3"),  # fmt: skip
    ],
)
def test_an_unknown_option_is_reported_by_its_command(argv, line, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == line


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


def _driver_folder(tmp_path: Path, model: str | None) -> Path:
    """A stand-in for /proc/driver/nvidia/gpus holding one GPU of ``model`` (None: no GPU)."""
    folder = tmp_path / "gpus"
    if model is not None:
        (folder / "0000:18:00.0").mkdir(parents=True)
        (folder / "0000:18:00.0" / "information").write_text(f"Model: \t\t {model}\nIRQ:  \t\t 42\n")
    return folder


@pytest.mark.parametrize(
    ("model", "gpu", "why"),
    [
        (None, "h100-sxm", "no GPU here, so the default"),
        ("NVIDIA H200", "h200", "the GPU in this machine, NVIDIA H200"),
        ("NVIDIA Quadro Z9", "h100-sxm", "NVIDIA Quadro Z9 is not in the GPU table, so the default"),
    ],
)
def test_predict_and_analyze_default_to_this_machines_gpu_and_say_which(
    tmp_path, monkeypatch, capsys, model, gpu, why
):
    from llm_speed.perf import _cli_common

    monkeypatch.setattr(_cli_common, "NVIDIA_DRIVER_GPUS", _driver_folder(tmp_path, model))
    assert cli.main(["predict", "gemm", "m=4096", "n=4096", "k=4096"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"gemm on {gpu},") and f"--gpu {gpu} ({why};" in err
    assert cli.main(["analyze", "--model", "llama-3-8b", "--seq-len", "64", "--json"]) == 0
    out, err = capsys.readouterr()
    assert f'"gpu": "{gpu}"' in out and f"llm-speed analyze: --gpu {gpu} ({why};" in err
    assert cli.main(["predict", "gemm", "m=64", "n=64", "k=64", "--gpu", "a100"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("gemm on a100") and not err  # a GPU given is used as is, without a word


@pytest.mark.parametrize(
    ("argv", "missing"),
    [
        (["gemm", "m=64"], "gemm: missing problem arguments n, k"),
        (["flash_attention"], "flash_attention: missing problem arguments batch, heads_q, seq_q, head_dim"),
        (["flash_attention_varlen"], "missing problem arguments lengths_q, heads_q, head_dim"),
        (["fused_moe", "tokens=8"], "missing problem arguments hidden, intermediate, experts, top_k"),
        (["gemm", "m=64", "n=64"], "gemm: missing problem argument 'k'"),
    ],
)
def test_predict_names_every_missing_problem_argument_at_once(argv, missing, capsys):
    assert cli.main(["predict", *argv, "--gpu", "h100"]) == 2
    assert missing in capsys.readouterr().err


def test_predict_rejects_a_value_of_the_wrong_kind_without_a_traceback(capsys):
    assert cli.main(["predict", "gemm", "m=x", "n=64", "k=64", "--gpu", "h100"]) == 2
    assert "gemm: m must be an int" in capsys.readouterr().err


def test_predict_prints_a_launch_figure_only_where_the_calibration_fitted_one(capsys):
    assert cli.main(["predict", "gemm", "m=4096", "n=4096", "k=4096", "--gpu", "h100"]) == 0
    fixed = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("fixed")]
    # The GEMM fit put its fixed cost elsewhere (latency_s at the fit's floor, 1e-15 s): no "1e-12 ms".
    assert fixed and "e-" not in fixed[0] and "no launch term (1 kernel" in fixed[0], fixed
    argv = ["flash_attention", "batch=1", "heads_q=16", "seq_q=4096", "head_dim=128", "--gpu", "h100"]
    assert cli.main(["predict", *argv]) == 0
    fixed = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("fixed")]
    assert fixed and " us launch and start/end on the device (1 kernel)" in fixed[0], fixed


@pytest.mark.parametrize("terminal", [False, True])
def test_kernels_progress_goes_to_stderr_as_the_workers_report(terminal):
    import io

    from llm_speed.kernel_report.command import Progress

    class Stream(io.StringIO):
        def isatty(self):
            return terminal

    stream = Stream()
    progress = Progress("h100-sxm", stream)
    progress(0, None)  # a worker has not counted its kernels yet
    for compiled in range(31):
        progress(compiled, 30)
    lines = stream.getvalue().replace("\r\033[K", "\n").split("\n")
    lines = [line for line in lines if line]
    assert lines[0] == "llm-speed kernels: capturing the ops' launches for h100-sxm (no GPU needed)..."
    counts = [line.split(": ")[1].split(" ")[0] for line in lines[1:]]
    assert counts == ([f"{n}/30" for n in range(31)] if terminal else [f"{n}/30" for n in range(0, 31, 3)])
    assert stream.getvalue().endswith("30/30 kernels compiled (0 s)\n")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu", "mi300x", "--op", "rms_norm"], "--gpu: mi300x is an AMD GPU"),
        (["--gpu", "a100-sxm-80gb", "--op", "gluon_gemm"], "--op gluon_gemm: the Gluon kernels are built"),
        (["--op", "flash_attention", "--head-dim", "512", "--seq", "64", "--heads", "1"],
         "the problems cannot be made: ValueError: q head_dim is 512"),
        (["--op", "rms_norm", "--size", "99999999"], "CPU tensors do not fit this machine's memory"),
    ],
)
def test_kernels_refuses_what_it_cannot_compile_in_one_line(argv, message, capsys):
    """A GPU that is not NVIDIA's, a Gluon kernel off sm_90, a problem an op refuses or whose tensors do not
    fit: one line and exit 2, not an LLVM crash or the workers' traceback (the report found all four)."""
    assert cli.main(["kernels", "--workers", "1", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_readme_attention_table_states_the_head_dims_the_code_accepts():
    from llm_speed.attention.checks import MAX_HEAD_DIM

    (row,) = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| sizes |")]
    assert f"`head_dim` any integer from 1 to {MAX_HEAD_DIM}" in row, row


def test_readme_model_commands_stay_within_the_models_context(capsys):
    # A README example that warns (e.g. a KV cache past the model's context) teaches the wrong thing.
    import shlex

    lines = [line.split("#")[0].strip() for line in (REPO / "README.md").read_text().splitlines()]
    commands = [line for line in lines if line.startswith(("llm-speed kv-cache", "llm-speed analyze"))]
    assert any("kv-cache" in command for command in commands), commands
    for command in commands:
        argv = [a for a in shlex.split(command)[1:] if not a.endswith(".png")]
        if "--plot" in argv:
            argv.remove("--plot")
        assert cli.main(argv) == 0, command
        out, err = capsys.readouterr()
        assert "exceed" not in out + err and "Warning" not in out + err, (command, out[-800:], err)


def test_a_library_error_names_the_option_and_the_command_it_was_given_to(capsys):
    assert cli.main(["bench", "decode", "--device", "cpu", "--page-size", "17"]) == 2
    err = capsys.readouterr().err
    assert err == "llm-speed bench decode: error: --page-size: expected a multiple of 16, got 17\n"
    parser = cli._command_parser(cli.build_parser(), ["bench", "attention"])
    assert parser.prog == "llm-speed bench attention"
    assert cli.in_option_terms("min_time_s: expected seconds", parser) == "--min-time: expected seconds"
    assert cli.in_option_terms("num_kv_heads: must divide", parser) == "--num-kv-heads: must divide"
    # no such option, or no leading name: the message as the library wrote it
    assert cli.in_option_terms("sizes: too large", parser) == "sizes: too large"
    assert cli.in_option_terms("gemm: m must be an int", parser) == "gemm: m must be an int"
    assert cli.in_option_terms("--output: folder x", parser) == "--output: folder x"


RING_PLAN = ["ring-plan", "--model", "llama-3-8b", "--world-size", "8"]


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (
            ["train-memory", "--model", "llama-3-8b", "--gpus", "8", "--pp", "2", "--virtual-stages", "2"],
            "llm-speed train-memory: error: --virtual-stages > 1 needs --schedule interleaved, got "
            "--schedule 1f1b",
        ),
        (
            ["train-memory", "--model", "llama-3-8b", "--gpus", "8", "--tp", "3"],
            "llm-speed train-memory: error: --tp (3) must divide num_attention_heads (32)",
        ),
        (
            ["train-memory", "--model", "mixtral-8x7b", "--gpus", "8", "--ep", "3"],
            "llm-speed train-memory: error: --ep (3) must divide dp*cp (8)",  # a product's terms stay
        ),
        (
            [*RING_PLAN, "--seq-len", "8", "--gpu", "h100-sxm"],
            "llm-speed ring-plan: error: --seq-len (8) must be at least 16",
        ),
        (
            [*RING_PLAN, "--seq-len", "8192", "--gpu", "l4"],
            "llm-speed ring-plan: error: l4 has no NVLink; use --link pcie",
        ),
    ],
)
def test_a_model_s_error_names_the_options_of_the_command(argv, error, capsys):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.startswith(error)
