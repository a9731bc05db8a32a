"""Bad input to the performance-model commands is refused before any work, naming the flag or KEY and what
is accepted: an op next to a refit, repeated keys, paths of the wrong kind."""

from __future__ import annotations

import pytest
from cli_exit import exit_code, one_error_line

from llm_speed.perf.cli_predict import parse_problem

H100 = "benchmarks/results/h100-sxm"


def _refused(capsys, argv) -> str:
    assert exit_code(argv) == 2
    captured = capsys.readouterr()
    assert not captured.out
    return one_error_line(captured.err)


@pytest.mark.parametrize("mode", ["--calibrate", "--check"])
def test_an_op_next_to_a_refit_is_refused(capsys, tmp_path, mode):
    # The op was dropped while the refit walked the whole folder.
    line = _refused(capsys, ["predict", "gemm", "m=4096", "n=4096", "k=4096", mode, str(tmp_path)])
    assert line == (
        f"llm-speed predict: error: {mode} DIR and an op (got 'gemm m=4096 n=4096 k=4096'): {mode} takes no "
        "op or KEY=VALUE problem; run `predict OP KEY=VALUE ...` on its own"
    )


def test_a_repeated_problem_key_is_refused(capsys):
    line = _refused(capsys, ["predict", "gemm", "m=4096", "m=8", "n=4096", "k=4096", "--gpu", "h100-sxm"])
    assert line == "llm-speed predict: error: problem: m given twice ('m=8' after m=4096)"
    with pytest.raises(ValueError, match="causal given twice"):
        parse_problem(["causal=true", "causal=false"])


def test_a_repeated_attention_item_is_refused(capsys):
    line = _refused(capsys, ["roofline", "--gpu", "h100-sxm", "--attention", "1,8,1024,128,kv=2,kv=4"])
    assert line.endswith("argument --attention: kv given twice in '1,8,1024,128,kv=2,kv=4'; give each once")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["predict", "--calibrate", "/etc/passwd"],
         "llm-speed predict: error: --calibrate: '/etc/passwd' is a file, not a folder "
         "(expected a results folder)"),
        (["predict", "--check", "/nonexistent/results"],
         "llm-speed predict: error: --check: '/nonexistent/results' folder not found "
         "(expected a results folder)"),
        (["analyze", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--calibrate", "/tmp"],
         "llm-speed analyze: error: --calibrate: bench JSON '/tmp': is a folder, not a file "
         "(expected a bench JSON file)"),
        (["analyze", "--model", "llama-3-8b", "--gpu-spec", "/tmp"],
         "llm-speed analyze: error: --gpu-spec: '/tmp' is a folder; expected a JSON file or K=V,... list"),
        (["predict", "gemm", "m=1", "n=1", "k=1", "--gpu", "h100-sxm", "--calibration", "/tmp"],
         "llm-speed predict: error: calibration '/tmp': is a folder, not a file "
         "(expected a calibration JSON file)"),
    ],
)  # fmt: skip
def test_a_path_of_the_wrong_kind_says_what_it_is(capsys, argv, expected):
    assert _refused(capsys, argv) == expected


ATTENTION = "--attention B,H,S,D[,kv=HKV][,q=SQ]"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["roofline", "--gpu", "h100-sxm", "--causal", "--mode", "bwd"],
         f"llm-speed roofline: error: --causal and --mode only apply with {ATTENTION}"),
        (["roofline", "--gpu", "h100-sxm", "--gemm", "64,64,64", "--causal"],
         f"llm-speed roofline: error: --causal only applies with {ATTENTION}"),
        (["mfu", "--gpu", "h100-sxm", "--ms", "1", "--flops", "1e12", "--gpus", "8", "--seq-len", "8"],
         "llm-speed mfu: error: --gpus and --seq-len only apply with --model and --tokens-per-second"),
        (["mfu", "--gpu", "h100-sxm", "--ms", "1", "--gemm", "64,64,64", "--mode", "fwd"],
         f"llm-speed mfu: error: --mode only applies with {ATTENTION}"),
        (["mfu", "--gpu", "h100-sxm", "--model", "llama-3-8b", "--tokens-per-second", "1000", "--causal"],
         "llm-speed mfu: error: --causal: with --attention only, which --model replaces"),
    ],
)  # fmt: skip
def test_options_of_an_absent_input_are_refused(capsys, argv, expected):
    assert _refused(capsys, argv) == expected


def test_the_options_still_apply_with_their_input(capsys):
    assert exit_code(["roofline", "--gpu", "h100-sxm", "--attention", "1,8,1024,128", "--causal", "--mode",
                      "bwd", "--json"]) == 0  # fmt: skip
    assert "bwd causal" in capsys.readouterr().out
    assert exit_code(["mfu", "--gpu", "h100-sxm", "--model", "llama-3-8b", "--tokens-per-second", "1000",
                      "--gpus", "8", "--json"]) == 0  # fmt: skip
    assert '"gpus": 8' in capsys.readouterr().out and exit_code(["mfu", "--gpu", "h100-sxm", "--ms", "1",
                                                                 "--flops", "1e12"]) == 0  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--dtype", "bf16", "--quant-group-size", "64"],
         "llm-speed kv-cache: error: --quant-group-size only applies to a quantized cache "
         "(--dtype fp8, int8 or int4), not --dtype bf16"),
        (["--dtype", "bf16", "--scale-bytes", "3"],
         "llm-speed kv-cache: error: --scale-bytes only applies with --quant-group-size "
         "(the bytes of a group's scale)"),
    ],
)  # fmt: skip
def test_kv_cache_scales_only_on_a_quantized_cache(capsys, extra, expected):
    assert _refused(capsys, ["kv-cache", "--model", "llama-3-8b", "--seq-len", "10", *extra]) == expected
    assert exit_code(["kv-cache", "--model", "llama-3-8b", "--seq-len", "10", "--dtype", "int4",
                      "--quant-group-size", "64", "--scale-bytes", "4"]) == 0  # fmt: skip
    assert "--scale-bytes 4" in capsys.readouterr().out


ATTENTION_PROBLEM = ["batch=1", "heads_q=8", "seq_q=128", "head_dim=64"]


@pytest.mark.parametrize(
    ("problem", "expected"),
    [
        (["gemm", "m=64", "n=64", "k=64", "tile=0,0,0,0"],
         "tile must be 3 or 4 positive ints (BM, BN, BK[, warps]), got 0 in (0, 0, 0, 0)"),
        (["gemm", "m=64", "n=64", "k=64", "tile=128,128"],
         "tile must be 3 or 4 positive ints (BM, BN, BK[, warps]), got 2: [128, 128]"),
        (["flash_attention", *ATTENTION_PROBLEM, "config=64,64"],
         "config must be 3 or 4 positive ints (BM, BN, warps[, stages]), got 2: [64, 64]"),
        (["attention_kvcache_fwd", "batch=1", "heads_q=8", "seq_kv=16", "head_dim=64", "seq_new=17"],
         "seq_new (17) cannot exceed seq_kv (16): appended keys are attended"),  # not the --context option
        (["flash_attention", *ATTENTION_PROBLEM, "causal=true", "launch_order=fifo"],
         "launch_order is 'fifo'; accepted: 'lpt', 'row'"),
        (["flash_attention", *ATTENTION_PROBLEM, "window=-1,none"],
         "window left must be >= 0 or None, got -1"),
        (["all_reduce", "size_bytes=nan", "num_gpus=8", "--implementation", "ring", "--json"],
         "size_bytes must be a finite number >= 0, got nan"),
    ],
)  # fmt: skip
def test_a_malformed_problem_value_is_one_line_naming_its_key(capsys, problem, expected):
    line = _refused(capsys, ["predict", *problem, "--gpu", "h100-sxm"])
    assert line == f"llm-speed predict: error: {expected}"


def test_none_and_one_int_are_problem_values():
    assert parse_problem(["window=128,none", "lengths_q=4096"]) == {"window": [128, None], "lengths_q": 4096}
