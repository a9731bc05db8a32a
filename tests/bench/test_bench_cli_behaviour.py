"""Audit 14's findings on the ``bench`` command line: outputs that overwrite each other, a head_dim no kernel
takes, scaled sizes the JSON must record, refusals before work, what overhead and op say was timed, the CPU
estimate of attention's heads, and the docs of decode and op."""

import argparse
import dataclasses
import json
import re
import types
from pathlib import Path

import pytest
import torch

from llm_speed import cli
from llm_speed.attention.checks import MAX_HEAD_DIM
from llm_speed.bench import cpu_budget, overhead, report, timing
from llm_speed.bench import decode as decode_bench
from llm_speed.bench import gemm as gemm_bench
from llm_speed.bench.cli import attention_settings

FAST = ["--device", "cpu", "--warmup", "0", "--iterations", "1", "--no-progress"]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_work(monkeypatch):
    """Any timed run fails the test: the command must refuse before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("a measurement started before the arguments were checked")

    monkeypatch.setattr(timing, "measure", refuse)


# --- 2: two output flags naming one file ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("first", "second", "name"),
    [("--output", "--csv", "same.json"), ("--csv", "--plot", "same.png"), ("--output", "--plot", "r.png")],
)
def test_two_outputs_naming_one_file_are_refused_before_work(
    first, second, name, tmp_path, monkeypatch, capsys, no_work
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text("earlier results")
    argv = ["bench", "attention", "--seq-lengths", "16", *FAST, first, name, second, f"./{name}"]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and f"error: {first} and {second} both name {name}" in err
    assert (tmp_path / name).read_text() == "earlier results"


# --- 3: a head_dim none of llm-speed's attention kernels takes ----------------------------------------


@pytest.mark.parametrize("command", ["attention", "decode"])
def test_a_head_dim_above_the_kernels_limit_is_refused_before_work(command, capsys, no_work):
    argv = ["bench", command, "--head-dim", str(MAX_HEAD_DIM + 1), *FAST]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert f"error: --head-dim: {MAX_HEAD_DIM + 1} is more than llm-speed's" in err
    assert f"accepted: 1 to {MAX_HEAD_DIM}" in err and "sdpa" in err  # what still takes it


def test_the_head_dim_limit_is_the_kernels_own(monkeypatch, capsys, no_work):
    """The refusal reads the kernels' constant, not a copy of it."""
    from llm_speed.attention import checks

    monkeypatch.setattr(checks, "MAX_HEAD_DIM", 64)
    assert cli.main(["bench", "attention", "--head-dim", "65", "--impl", "flash", *FAST]) == 2
    err = capsys.readouterr().err
    assert "--head-dim: 65 is more than llm-speed's flash accept; accepted: 1 to 64" in err


def test_a_large_head_dim_for_other_implementations_only_is_accepted():
    argv = ["bench", "attention", "--head-dim", "512", "--impl", "sdpa-math", "--device", "cpu"]
    assert attention_settings(cli.build_parser().parse_args(argv)).head_dim == 512
    argv = ["bench", "attention", "--head-dim", str(MAX_HEAD_DIM), "--device", "cpu"]
    assert attention_settings(cli.build_parser().parse_args(argv)).head_dim == MAX_HEAD_DIM


# --- 4 and 16: the JSON says what a CPU run scaled and merged ------------------------------------------


def test_scaled_and_merged_sizes_are_in_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpu_budget, "CALL_SECONDS", 1e-7)  # every size scaled to the smallest
    out = tmp_path / "g.json"
    argv = ["bench", "gemm", "--sizes", "64x64x64", "128x128x128", "--impl", "torch", "--min-time", "0"]
    assert cli.main([*argv, *FAST, "--output", str(out)]) == 0
    document = json.loads(out.read_text())
    side = cpu_budget.MIN_SIZE
    assert [(c["m"], c["n"], c["k"]) for c in document["settings"]["cases"]] == [(side, side, side)]
    requested = document["settings"]["requested"]
    assert [(c["m"], c["n"], c["k"]) for c in requested["cases"]] == [(64, 64, 64), (128, 128, 128)]
    notes = document["notes"]
    assert any(note.startswith("CPU run: GEMM sizes scaled (64x64x64 -> ") for note in notes)
    merged = f"CPU run: GEMM sizes merged (64x64x64 and 128x128x128 -> {side}x{side}x{side})"
    assert any(note.startswith(merged) for note in notes), notes
    assert merged in capsys.readouterr().out  # printed before the run, as the other scaling notes


def test_a_scaled_model_s_total_is_not_called_a_forward_pass(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cpu_budget, "CALL_SECONDS", 1e-7)
    out = tmp_path / "g.json"
    argv = ["bench", "gemm", "--model", "llama-3-8b", "--tokens", "64", "--impl", "torch", "--min-time", "0"]
    assert cli.main([*argv, *FAST, "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    document = json.loads(out.read_text())
    assert document["settings"]["tokens"] == 64
    assert {case["m"] for case in document["settings"]["requested"]["cases"]} == {64}
    said = "not the time of one forward pass of llama-3-8b at 64 tokens"
    assert any(said in note for note in document["notes"])
    table_end = printed.rindex("summary torch:")
    assert said in printed[table_end:]  # under the summary line it qualifies
    assert "for the scaled shapes x their counts" in printed and "for one forward pass's" not in printed


def test_a_run_at_the_sizes_asked_for_records_no_request():
    settings = gemm_bench.GemmSettings(
        cases=(gemm_bench.GemmCase("", 16, 16, 16),), dtype="fp32", layout="NN", epilogue="none",
        impls=("torch",), warmup=0, iterations=1, device="cpu",
    )  # fmt: skip
    costs = {"torch": cpu_budget.CallCost(0.0, 1e-12)}
    assert cpu_budget.scale_gemm(settings, costs) == (settings, [])


def test_merged_note_names_only_sizes_that_became_one():
    assert cpu_budget.merged_note("contexts", (32, 64, 128), (32, 64, 128)) == []
    (note,) = cpu_budget.merged_note("contexts", (1024, 4096, 16384, 64), (256, 256, 256, 64))
    assert note.startswith("CPU run: contexts merged (1024, 4096 and 16384 -> 256)")


# --- 5: Liger asked for alone, not installed -------------------------------------------------------------


def test_train_step_liger_not_installed_is_refused_before_the_model_is_built(tmp_path, monkeypatch, capsys):
    pytest.importorskip("transformers", reason="bench train-step needs transformers (pip install -e '.[hf]')")
    from llm_speed.bench import ops as ops_bench
    from llm_speed.bench import train_step

    monkeypatch.setattr(ops_bench, "liger_installed", lambda: False)
    monkeypatch.setattr(train_step, "run_train_step", pytest.fail)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
        "num_hidden_layers": 1, "intermediate_size": 96, "vocab_size": 101, "max_position_embeddings": 64,
    }))  # fmt: skip
    assert cli.main(["bench", "train-step", "--model", str(config), "--impl", "liger", *FAST]) == 2
    err = capsys.readouterr().err
    assert "--impl: none of the implementations asked for can run here (liger: " in err
    assert ops_bench.LIGER_NOT_INSTALLED in err


# --- 6 and 7: bench overhead says what did not run, and what its figures are ----------------------------


def test_overhead_refuses_when_no_op_runs_in_the_modes_asked_for(capsys, monkeypatch):
    monkeypatch.setattr(overhead, "measure", pytest.fail)
    argv = ["bench", "overhead", "--ops", "tensor_core_gemm_int8", "flash_attention_with_kvcache",
            "--modes", "autograd", "training", "--device", "cpu"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: --ops/--modes: none of the ops asked for runs in the modes asked for" in err
    assert "tensor_core_gemm_int8 (autograd): no gradient" in err


def test_overhead_lists_what_did_not_run_and_prints_its_notes(tmp_path, capsys):
    out = tmp_path / "o.json"
    argv = ["bench", "overhead", "--ops", "tensor_core_gemm_int8", "gemm", "--modes", "inference", "autograd",
            "--calls", "2", "--repeats", "1", "--device", "cpu", "--output", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    document = json.loads(out.read_text())
    reason = "no gradient: it runs in inference only"
    assert document["not_run"] == [{"op": "tensor_core_gemm_int8", "mode": "autograd", "reason": reason}]
    assert ("gemm", "autograd") in {(row["case"], row["mode"]) for row in document["results"]}
    assert "not run: tensor_core_gemm_int8 (autograd): no gradient" in printed
    for note in document["notes"]:  # on a CPU: the launch stubbed (simulated_gpu), no GPU time
        assert f"note: {note}" in printed
    assert "simulated_gpu" in printed and report.environment_device_name(torch.device("cpu")) in printed


# --- 8: bench op says what was timed, as the others do -----------------------------------------------


@pytest.mark.parametrize("interpreted", [True, False])
def test_bench_op_records_and_prints_what_was_timed(interpreted, monkeypatch, capsys):
    monkeypatch.setattr(report, "INTERPRETED", interpreted)
    argv = ["bench", "op", "rms_norm", "--size", "16", *FAST[:-1]]
    assert cli.main([*argv, "--json"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["benchmark"] == "op" and document["environment"]["device_type"] == "cpu"
    assert document["settings"] == {"op": "rms_norm", "size": 16, "warmup": 0, "iterations": 1,
                                    "dtype": "float32", "device": "cpu"}  # fmt: skip
    notes = document["notes"]
    assert notes[0].startswith("CPU timings (host clock, CPU tensors): they say nothing about GPU")
    path = "are of Triton's interpreter" if interpreted else "PyTorch fallback"
    assert any("llm-speed's rms_norm" in note and path in note for note in notes), notes
    assert not any("Peak memory" in note for note in notes)  # bench op measures none
    for row in document["results"]:
        assert "gb_per_s" not in row and row["bandwidth_gb_s"] > 0
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert all(f"note: {note}" in printed for note in notes)


def test_no_reader_uses_the_old_bandwidth_name():
    for folder in ("src", "benchmarks", "tests/bench", "docs"):
        for path in (REPO / folder).rglob("*"):
            if path.suffix in {".py", ".md", ".sh"} and path != Path(__file__):
                assert "gb_per_s" not in path.read_text(encoding="utf-8"), path


# --- 9: attention's CPU estimate counts the heads ---------------------------------------------------------

# The interpreter on 2 cores (fwd+bwd, head_dim 128): ~0.1 s per (batch, query head) and 5 ns per FLOP.
PER_HEAD, PER_FLOP = 0.1, 5e-9


def _interpreter_like(settings, show_progress):
    """Rows timed as the interpreter times them: a cost per head that outweighs the FLOPs."""
    rows = []
    for seq in settings.seq_lengths:
        heads, flops = settings.batch_size * settings.num_heads, cpu_budget._attention_flops(settings, seq)
        median_ms = (PER_HEAD * heads + PER_FLOP * flops) * 1e3
        rows.append(types.SimpleNamespace(impl="flash", seq_len=seq, median_ms=median_ms))
    return rows


def test_attention_is_estimated_per_head_not_only_per_flop():
    argv = ["bench", "attention", "--causal", "--num-heads", "32", "--num-kv-heads", "8", "--head-dim", "128",
            "--dtype", "bf16", "--mode", "fwd+bwd", "--impl", "flash", "--device", "cpu"]  # fmt: skip
    settings = attention_settings(cli.build_parser().parse_args(argv))
    costs = cpu_budget.calibrate_attention(settings, run=_interpreter_like)
    for seq in (16, 32, 128):
        one = dataclasses.replace(settings, seq_lengths=(seq,))
        call = PER_HEAD * 32 + PER_FLOP * cpu_budget._attention_flops(one, seq)
        truth = cpu_budget.row_seconds(call, one)
        estimate = cpu_budget.attention_estimate(one, costs)
        assert truth <= estimate < 1.5 * truth  # never below: a low estimate costs the user the wait
    scaled, notes = cpu_budget.scale_attention(settings, costs)
    # 32 heads cost 3.2 s a call at any length: the heads are halved until a call fits the budget
    assert scaled.num_heads * PER_HEAD <= cpu_budget.CALL_SECONDS and scaled.num_heads < 32
    assert any("heads scaled (32/8 ->" in note for note in notes)


def test_the_attention_fit_recovers_both_costs_and_falls_back_on_one_problem():
    points = [(4, 6e7, 4 * 0.01 + 6e7 * 5e-9), (8, 3e7, 8 * 0.01 + 3e7 * 5e-9)]
    cost = cpu_budget.fit_attention_cost(points)
    assert cost.per_head_s == pytest.approx(0.01) and cost.seconds_per_flop == pytest.approx(5e-9)
    assert cost.fixed_s == 0.0
    # a flat cost per FLOP (noise, or heads outweighing the FLOPs) is floored as fit_cost's; the cost per
    # head stays the line's
    points = [(4, 6e7, 4 * 0.1 + 6e7 * 1e-10), (8, 3e7, 8 * 0.1 + 3e7 * 1e-10)]
    cost = cpu_budget.fit_attention_cost(points)
    assert cost.seconds_per_flop == pytest.approx(points[0][2] / 6e7 / 2)
    assert cost.per_head_s == pytest.approx(0.1)
    # one problem at two head counts (seq 1): no way to part them, the FLOPs carry it all
    same = cpu_budget.fit_attention_cost([(4, 1e3, 0.4), (8, 2e3, 0.8)])
    assert same.per_head_s == 0.0 and same.seconds(4e3) == pytest.approx(1.6)


# --- 19: the library's words for a missing CUDA device ------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_missing_cuda_device_is_named_in_each_caller_s_terms(capsys):
    import llm_speed
    from llm_speed.profiler import CUDAProfiler

    with pytest.raises(ValueError, match=r"no CUDA device is visible; use device='cpu'$"):
        CUDAProfiler("cuda").profile_gemm(llm_speed.gemm, 16, 16, 16, dtype=torch.float32)
    assert cli.main(["bench", "op", "rms_norm", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("no CUDA device is visible; use --device cpu")


# --- 20: a refused command leaves no folder behind ----------------------------------------------------


def test_a_refused_command_removes_the_folder_its_output_check_made(tmp_path, monkeypatch, capsys, no_work):
    monkeypatch.chdir(tmp_path)
    argv = ["bench", "attention", "--output", "new/deeper/a.json", "--num-heads", "4", "--num-kv-heads", "3"]
    assert cli.main([*argv, *FAST]) == 2
    assert "--num-kv-heads: must divide" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
    # a later bad path: the folder the earlier flag's check made goes too
    argv = ["bench", "gemm", "--sizes", "16x16x16", "--output", "made/g.json", "--plot", "other/g.txt"]
    assert cli.main([*argv, *FAST]) == 2
    assert not (tmp_path / "made").exists() and not (tmp_path / "other").exists()
    # a folder that was there, or holds something, stays
    (tmp_path / "kept").mkdir()
    assert cli.main(["bench", "overhead", "--output", "kept/o.json", "--ops", "tensor_core_gemm_int8",
                     "--modes", "training", "--device", "cpu"]) == 2  # fmt: skip
    assert (tmp_path / "kept").is_dir()


def test_made_folders_are_recorded_outermost_first_and_only_empty_ones_removed(tmp_path, monkeypatch):
    from llm_speed._output import prepare_output_path, remove_made_folders

    monkeypatch.chdir(tmp_path)
    made: list = []
    prepare_output_path("a/b/c.json", argument="--output", made=made)
    root = tmp_path.resolve()
    assert made == [root / "a", root / "a" / "b"]
    (root / "a" / "keep.txt").write_text("")
    remove_made_folders(made)
    assert (root / "a").is_dir() and not (root / "a" / "b").exists() and made == []


# --- 21: docs/benchmarks.md documents decode and op -----------------------------------------------------


def _section(title: str) -> str:
    text = (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    start = text.index(f"\n## `{title}`\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def _subcommand(parser, name: str):
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return commands.choices[name]


def _subparser(name: str):
    return _subcommand(_subcommand(cli.build_parser(), "bench"), name)


@pytest.mark.parametrize("name", ["decode", "op"])
def test_decode_and_op_have_a_docs_section_with_every_flag(name):
    section = _section(f"llm-speed bench {name}")
    for action in _subparser(name)._actions:
        for option in action.option_strings:
            if option not in {"-h", "--help"}:
                assert f"`{option}" in section or f"[{option}" in section, (name, option)


def test_the_op_section_names_every_op_bench_op_takes():
    from llm_speed.bench import op as op_bench

    section = _section("llm-speed bench op")
    assert all(f"`{name}`" in section for name in op_bench.examples())


def test_decode_s_cpu_defaults_are_in_its_help_and_docs():
    contexts = " ".join(map(str, decode_bench.CPU_DEFAULTS["contexts"]))
    (action,) = [a for a in _subparser("decode")._actions if "--contexts" in a.option_strings]
    assert f"CPU: {contexts}" in action.help
    lines = _section("llm-speed bench decode").splitlines()
    (row,) = [line for line in lines if line.startswith("| `--contexts")]
    assert re.search(rf"\| {contexts} \|$", row)
