"""``llm-speed predict``: one op's prediction (text and JSON), the list of ops, refusals, the refit from a
results directory (a temporary copy of committed measurements), and the calibration note being the output of
``--check``."""

import json
import shutil
from pathlib import Path

import pytest

from llm_speed.cli import main
from llm_speed.perf import calibrate
from llm_speed.perf.predict import OPS, load_calibration, predict

REPO = Path(__file__).resolve().parents[2]
H100 = REPO / "benchmarks" / "results" / "h100-sxm"
NOTE = REPO / "docs" / "guides" / "model-calibration.md"


def _run(capsys, argv):
    code = main(["predict", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_json_is_the_functions_prediction(capsys):
    code, out, _ = _run(capsys, ["gemm", "m=4096", "n=4096", "k=4096", "--gpu", "h100", "--implementation",
                                 "vendor", "--json"])  # fmt: skip
    assert code == 0
    record = json.loads(out)
    expected = predict("gemm", "h100-sxm", implementation="cublas", m=4096, n=4096, k=4096)
    assert record["seconds"] == expected.seconds and record["bound"] == expected.bound == "compute"
    assert record["implementation"] == "cublas" and record["calibrated"] is True
    assert record["breakdown"]["tile"] == list(expected.breakdown.tile)


def test_text_names_the_bound_and_the_terms(capsys):
    argv = ["flash_attention", "batch=1", "heads_q=16", "seq_q=16384", "head_dim=128", "causal=true",
            "--gpu", "h100-sxm"]  # fmt: skip
    code, out, _ = _run(capsys, argv)
    assert code == 0
    assert "compute-bound" in out and "tensor-core efficiency" in out and "exp units" in out
    code, out, _ = _run(capsys, ["moe_sort", "tokens=64", "top_k=8", "experts=64", "--gpu", "h100-sxm"])
    assert code == 0 and "NOT calibrated" in out and "UNCALIBRATED for moe_sort" in out


def test_list_has_every_op(capsys):
    code, out, _ = _run(capsys, ["--list", "--json"])
    assert code == 0 and list(json.loads(out)["ops"]) == list(OPS)


def test_bad_input_exits_2_naming_it(capsys):
    code, _, err = _run(capsys, ["softmax", "--gpu", "h100-sxm"])
    assert code == 2 and "no prediction for 'softmax'" in err and "modelled: gemm" in err
    code, _, err = _run(capsys, ["gemm", "m=1", "n=1", "--gpu", "h100-sxm"])
    assert code == 2 and "gemm: missing problem argument 'k'" in err
    code, _, err = _run(capsys, ["gemm", "m", "--gpu", "h100-sxm"])
    assert code == 2 and "KEY=VALUE" in err


def test_a_flag_that_is_not_true_or_false_is_refused(capsys):
    # A misspelt flag was kept as a string and read by its truthiness: causal=flase predicted the causal time.
    attention = ["flash_attention", "batch=1", "heads_q=16", "seq_q=4096", "head_dim=128"]
    for word in ("flase", "maybe", "2", "1"):
        code, out, err = _run(capsys, [*attention, f"causal={word}", "--gpu", "h100-sxm"])
        assert code == 2 and not out
        assert f"causal: expected true or false (or yes/no, on/off), got '{word}'" in err
    code, _, err = _run(capsys, ["gemm", "m=64", "n=64", "k=64", "with_bias=ture", "--gpu", "h100-sxm"])
    assert code == 2 and "with_bias: expected true or false" in err
    code, out, _ = _run(capsys, [*attention, "causal=no", "--gpu", "h100-sxm", "--json"])
    assert code == 0 and json.loads(out)["problem"]["causal"] is False


def test_options_of_another_mode_are_refused(tmp_path, capsys):
    # They were silently ignored: --output without --calibrate wrote nothing, --iterations -3 "refitted".
    gemm = ["gemm", "m=64", "n=64", "k=64", "--gpu", "h100-sxm"]
    out = tmp_path / "x.json"
    for extra, message in (
        (["--output", str(out)], "--output only applies with --calibrate DIR"),
        (["--iterations", "5"], "--iterations only applies with --calibrate DIR"),
        (["--points"], "--points only applies with --check DIR"),
        (["--check", str(H100), "--output", str(out)], "--output only applies with --calibrate DIR"),
        (["--calibrate", str(H100), "--check", str(H100)], "--calibrate and --check: give one"),
    ):
        code, text, err = _run(capsys, [*gemm, *extra])
        assert code == 2 and not text and message in err and err.count("\n") == 1
    assert not out.exists()
    for bad in ("0", "-3"):
        with pytest.raises(SystemExit) as parse_exit:
            _run(capsys, ["--calibrate", str(H100), "--iterations", bad])
        err = capsys.readouterr().err
        assert parse_exit.value.code == 2 and "--iterations: expected a positive integer" in err
    with pytest.raises(ValueError, match="iterations must be a positive int"):
        calibrate.calibrate(H100, iterations=0)


def test_calibrate_refits_from_a_results_directory(tmp_path, capsys):
    """A copy of the square GEMMs and the ceilings: the cuBLAS and llm-speed GEMM entries are refitted, the
    new file records which files set them and the held-out errors, and predictions read it."""
    folder = tmp_path / "h100-sxm" / "session"
    folder.mkdir(parents=True)
    for name in ("gemm_bf16_square.json", "ceilings.txt"):
        shutil.copy(H100 / "af147ec-baseline" / name, folder / name)
    out = tmp_path / "calibration.json"
    code, text, _ = _run(capsys, ["--calibrate", str(tmp_path), "--output", str(out), "--iterations", "20"])
    assert code == 0 and "h100-sxm/cublas/gemm" in text and f"written to {out}" in text
    new = json.loads(out.read_text())
    entries = new["last_fit"]["entries"]
    assert set(entries) == {"h100-sxm/cublas/gemm", "h100-sxm/llm-speed/gemm"}
    for fit in entries.values():
        assert fit["files"] == ["session/gemm_bf16_square.json"]
        assert (fit["training"]["points"], fit["held_out"]["points"]) == (3, 2)  # 1024 and 4096 held out
    # The attention entries were not in the directory: kept as they were.
    old = load_calibration()["gpus"]["h100-sxm"]["implementations"]["sdpa-cudnn"]["attention"]
    assert new["gpus"]["h100-sxm"]["implementations"]["sdpa-cudnn"]["attention"] == old
    code, text, _ = _run(capsys, ["gemm", "m=4096", "n=4096", "k=4096", "--gpu", "h100-sxm", "--json",
                                  "--calibration", str(out)])  # fmt: skip
    assert code == 0 and json.loads(text)["seconds"] > 0


def test_the_calibration_note_is_the_check_output(capsys):
    """docs/guides/model-calibration.md quotes ``--check`` (and its held-out points) exactly."""
    code, out, _ = _run(capsys, ["--check", str(H100), "--points"])
    assert code == 0
    table, points = out.rstrip("\n").split("\n\n", 1)
    note = NOTE.read_text()
    assert f"```\n{table}\n```" in note and f"```\n{points}\n```" in note
    # A header line and every point no fit used: 188 held out by the split rule (149 of 2026-11-22's data,
    # 28 of the 2026-11-25 suite's net, its 4096-token Llama-3 8B GEMMs moving the 8192-token ones out of the
    # fit, 11 of its A/B runs; 20 of the second 2026-11-25 suite's; 22 fp8 GEMMs in NT at 8192x8192x4096) and
    # 183 of families never fitted (int8, fp8 GEMMs in NN, fp8 attention, eager attention, forward+backward,
    # decode; measurements.kind_of).
    assert points.count("\n") == 230 + 183


@pytest.mark.parametrize(
    ("words", "problem"),
    [
        (["flash_attention", "batch=1", "heads_q=8", "seq_q=4096", "head_dim=64", "window=128,none"],
         dict(batch=1, heads_q=8, seq_q=4096, head_dim=64, window=(128, None))),
        (["flash_attention_varlen", "lengths_q=4096", "heads_q=8", "head_dim=64"],
         dict(lengths_q=[4096], heads_q=8, head_dim=64)),
    ],
)  # fmt: skip
def test_a_left_window_and_one_packed_sequence_are_written_as_such(capsys, words, problem):
    code, out, _ = _run(capsys, [*words, "--gpu", "h100-sxm", "--json"])
    assert code == 0
    assert json.loads(out)["seconds"] == predict(words[0], "h100-sxm", **problem).seconds
