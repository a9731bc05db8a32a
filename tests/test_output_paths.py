"""The one rule for output paths: folders are created only inside the working directory, errors come first."""

import argparse
import re
from pathlib import Path

import pytest

from llm_speed import cli
from llm_speed._output import prepare_output_folder, prepare_output_path


def test_missing_folder_inside_the_working_directory_is_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = prepare_output_path("results/run.json", argument="--output")
    assert out == tmp_path / "results" / "run.json"
    assert out.parent.is_dir() and not out.exists()


def test_missing_folder_outside_the_working_directory_is_an_error(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(ValueError, match="--plot: folder .* does not exist"):
        prepare_output_path(tmp_path / "elsewhere" / "x.png", argument="--plot")
    assert not (tmp_path / "elsewhere").exists()
    assert prepare_output_path(tmp_path / "elsewhere" / "x.png", argument="--plot", create_parents=True)
    assert (tmp_path / "elsewhere").is_dir()


def test_a_folder_is_not_a_file_name(tmp_path):
    with pytest.raises(ValueError, match="--output: .* is a folder"):
        prepare_output_path(tmp_path, argument="--output")


def test_an_unwritable_file_is_an_error_even_for_root():
    # os.access says yes to root everywhere; only opening the file tells.
    with pytest.raises(ValueError, match=r"^--csv: cannot write /proc/x\.csv: "):
        prepare_output_path("/proc/x.csv", argument="--csv")


def test_the_check_leaves_no_file_behind_and_an_existing_file_whole(tmp_path):
    fresh = tmp_path / "fresh.json"
    assert prepare_output_path(fresh, argument="--output") == fresh
    assert not fresh.exists()
    kept = tmp_path / "kept.json"
    kept.write_text("earlier results")
    prepare_output_path(kept, argument="--output")
    assert kept.read_text() == "earlier results"


def test_an_output_folder_is_made_and_probed(tmp_path):
    folder = prepare_output_folder(tmp_path / "sass", argument="--sass")
    assert folder.is_dir() and not any(folder.iterdir())
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--sass: .* is a file; give a folder"):
        prepare_output_folder(tmp_path / "file", argument="--sass")
    with pytest.raises(ValueError, match="^--output-dir: cannot create folder /proc/x"):
        prepare_output_folder("/proc/x", argument="--output-dir")


# Every option of every command, found in the parsers: an option whose name or metavar looks like a path
# is either written (and must be checked before any work) or read; a new one must be put in one of the sets.
_PATH_WORDS = re.compile(r"output|\bout\b|csv|plot|dir|file|path|save|dump|export|write|trace|sass|json|png")
OUTPUT_FILES = {"--output", "--csv", "--plot"}
OUTPUT_FOLDERS = {"--output-dir", "--sass"}
INPUTS = {"--calibration-file", "--calibration", "--calibrate", "--check", "--gpu-spec", "--triton"}
# What a command needs besides the output option to get as far as its output check.
REQUIRED = {
    "bench op": ["rms_norm"],
    "bench train-step": ["--model", "llama-3-8b"],
    "analyze": ["--model", "llama-3-8b", "--gpu", "h100-sxm"],
    "roofline": ["--gpu", "h100-sxm"],
    "predict": ["--calibrate", "benchmarks/results"],
}


def _options(parser, command=()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*command, name))
        elif action.option_strings and action.nargs != 0:
            yield " ".join(command), action


def _path_options():
    found = []
    for command, action in _options(cli.build_parser()):
        text = " ".join([*action.option_strings, str(action.metavar or "")])
        if _PATH_WORDS.search(text.lower()):
            found.append((command, action))
    return found


def test_every_path_option_is_known_as_written_or_read():
    unknown = [
        (command, action.option_strings)
        for command, action in _path_options()
        if not set(action.option_strings) & (OUTPUT_FILES | OUTPUT_FOLDERS | INPUTS)
    ]
    assert not unknown, f"path-like options; add each to OUTPUT_FILES, OUTPUT_FOLDERS or INPUTS: {unknown}"


def _written_options():
    return [
        (command, action.option_strings[0])
        for command, action in _path_options()
        if set(action.option_strings) & (OUTPUT_FILES | OUTPUT_FOLDERS)
    ]


@pytest.mark.parametrize(("command", "option"), _written_options())
def test_an_unwritable_output_stops_the_command_before_any_work(command, option, capsys, monkeypatch):
    from llm_speed.bench import timing

    def no_work(*args, **kwargs):
        raise AssertionError("a measurement started before the output paths were checked")

    monkeypatch.setattr(timing, "measure", no_work)
    path = "/proc/llm-speed-x" if option in OUTPUT_FOLDERS else "/proc/llm-speed-x.out"
    argv = [*command.split(), *REQUIRED.get(command, []), option, path]
    if any(c == command and "--device" in a.option_strings for c, a in _options(cli.build_parser())):
        argv += ["--device", "cpu"]
    assert cli.main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert out == "", f"{argv}: work started before the check: {out[:500]}"
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"llm-speed {command}: error: {option}: "), err
    assert not Path(path).exists()


@pytest.mark.parametrize("command", sorted({c for c, option in _written_options() if option == "--plot"}))
def test_a_plot_file_type_matplotlib_does_not_write_stops_the_command_before_any_work(
    command, capsys, monkeypatch, tmp_path
):
    """``--plot x.txt`` was refused by matplotlib at the end, after the whole benchmark or analysis."""
    from llm_speed.bench import timing

    def no_work(*args, **kwargs):
        raise AssertionError("a measurement started before --plot was checked")

    monkeypatch.setattr(timing, "measure", no_work)
    monkeypatch.chdir(tmp_path)
    argv = [*command.split(), *REQUIRED.get(command, []), "--plot", "x.txt"]
    if any(c == command and "--device" in a.option_strings for c, a in _options(cli.build_parser())):
        argv += ["--device", "cpu"]
    assert cli.main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert out == "" and "--plot: x.txt ends in .txt, a file type matplotlib does not write" in err, err
    assert not (tmp_path / "x.txt").exists()


@pytest.mark.parametrize(("command", "option"), _written_options())
def test_an_empty_output_path_is_an_error_not_silence(command, option, capsys, monkeypatch, tmp_path):
    """``--plot ''`` wrote and said nothing; ``demo --output-dir ''`` wrote into the working folder."""
    monkeypatch.chdir(tmp_path)
    argv = [*command.split(), *REQUIRED.get(command, []), option, ""]
    assert cli.main(argv) == 2, argv
    out, err = capsys.readouterr()
    assert out == "" and f"error: {option}: an empty path" in err, err
    assert not any(tmp_path.iterdir())


def test_the_empty_path_check_knows_every_written_option():
    assert {option for _, option in _written_options()} == {f"--{name.replace('_', '-')}"
                                                          for name in cli.OUTPUT_OPTIONS}  # fmt: skip


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_doctor_refuses_a_device_that_is_not_here_before_making_a_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["doctor", "--device", "cuda", "--output", "new/report.json"]) == 2
    assert "no CUDA device is visible" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
