"""The one rule for output paths: folders are created only inside the working directory, errors come first."""

import pytest

from llm_speed._output import prepare_output_path


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
