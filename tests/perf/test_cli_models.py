"""The models, kv-cache, analyze and train-memory commands, run in-process."""

import json

import pytest
from cli_exit import exit_code, one_error_line

from llm_speed.cli import main
from llm_speed.perf.kv_cache import kv_cache_size
from llm_speed.perf.models import list_models


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_models(capsys):
    rows = _json(capsys, ["models", "--json"])
    assert [row["id"] for row in rows] == list_models()
    llama = next(row for row in rows if row["id"] == "llama-3-8b")
    assert llama["params_total"] == 8_030_261_248 and llama["attention"] == "GQA"
    assert main(["models"]) == 0
    assert "deepseek-v3" in capsys.readouterr().out


def test_kv_cache(capsys):
    payload = _json(
        capsys,
        [
            "kv-cache",
            "--model",
            "llama-2-7b",
            "--seq-len",
            "4096",
            "--batch-size",
            "2",
            "--dtype",
            "fp8",
            "--json",
        ],
    )
    expected = kv_cache_size("llama-2-7b", seq_len=4096, batch_size=2, dtype="fp8")
    assert payload["total_bytes"] == expected.total_bytes == 2 * 1024**3
    assert main(["kv-cache", "--model", "deepseek-v3", "--seq-len", "128"]) == 0
    assert "MLA" in capsys.readouterr().out
    argv = ["kv-cache", "--model", "llama-3-8b", "--seq-len", "16", "--dtype", "int4"]
    argv += ["--quant-group-size", "32"]
    grouped = _json(capsys, [*argv, "--json"])
    assert grouped["bytes_per_token_per_layer"] == 1024 + 64 * 2  # int4 values + one fp16 scale per 32
    assert main(argv) == 0
    assert "Scales: 128 bytes/token/layer" in capsys.readouterr().out


def test_kv_cache_from_config_path(tmp_path, capsys):
    config = {
        "model_type": "llama",
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 512,
        "vocab_size": 1000,
        "max_position_embeddings": 512,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    payload = _json(capsys, ["kv-cache", "--model", str(tmp_path), "--seq-len", "10", "--json"])
    assert payload["bytes_per_token"] == 2 * 2 * 64 * 2 * 2


def test_analyze(capsys):
    payload = _json(
        capsys,
        [
            "analyze",
            "--model",
            "llama-3-8b",
            "--gpu",
            "h100",
            "--batch-size",
            "4",
            "--seq-len",
            "512",
            "--decode-tokens",
            "32",
            "--sweep",
            "--json",
        ],
    )
    assert payload["gpu"] == "h100-sxm" and payload["batch_size"] == 4
    assert {op["phase"] for op in payload["ops"]} == {"prefill", "decode"}
    assert payload["decode_tokens_per_s"] == pytest.approx(4 / payload["decode_step_s"])
    assert len(payload["decode_batch_sweep"]) > 3
    assert main(["analyze", "--model", "mixtral-8x7b", "--gpu", "h200", "--seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert "expert_gate_up" in out and "TTFT" in out


def test_analyze_plot(tmp_path, capsys):
    pytest.importorskip("llm_speed.perf.plot", reason="draws the plot: needs matplotlib")
    path = tmp_path / "roofline.png"
    assert (
        main(["analyze", "--model", "llama-3-8b", "--gpu", "h100", "--seq-len", "256", "--plot", str(path)])
        == 0
    )
    assert path.stat().st_size > 1000


def test_train_memory(capsys):
    payload = _json(
        capsys,
        [
            "train-memory",
            "--model",
            "llama-3-70b",
            "--gpus",
            "64",
            "--tp",
            "8",
            "--pp",
            "2",
            "--dp",
            "4",
            "--zero",
            "1",
            "--micro-batch-size",
            "1",
            "--seq-len",
            "4096",
            "--gpu",
            "h100",
            "--json",
        ],
    )
    assert (payload["tp"], payload["pp"], payload["dp"], payload["zero_stage"]) == (8, 2, 4, 1)
    assert payload["total_bytes"] == pytest.approx(
        payload["params_bytes"]
        + payload["grads_bytes"]
        + payload["optimizer_bytes"]
        + payload["activation_bytes"]
    )
    assert (
        main(
            [
                "train-memory",
                "--model",
                "deepseek-v3",
                "--gpus",
                "64",
                "--tp",
                "8",
                "--ep",
                "8",
                "--recompute",
                "full",
            ]
        )
        == 0
    )
    assert "Training memory per GPU" in capsys.readouterr().out
    # 61 layers on 16 stages: uneven stages; the heaviest (stage 1: 4 MoE layers) is reported.
    uneven = ["train-memory", "--model", "deepseek-v3", "--gpus", "16", "--pp", "16", "--json"]
    payload = _json(capsys, uneven)
    assert (payload["stage"], payload["stage_layers"]) == (1, 4)
    tp_sp = ["train-memory", "--model", "llama-3-8b", "--gpus", "2", "--tp", "2", "--json"]
    assert _json(capsys, tp_sp)["sequence_parallel"] is True
    assert _json(capsys, [*tp_sp, "--no-sequence-parallel"])["sequence_parallel"] is False
    # the interleaved schedule's chunks per stage are in the record beside the bubble they shrink
    interleaved = ["train-memory", "--model", "llama-3-8b", "--gpus", "8", "--pp", "4", "--json"]
    plain = _json(capsys, interleaved)
    chunked = _json(capsys, [*interleaved, "--schedule", "interleaved", "--virtual-stages", "2"])
    assert (plain["virtual_stages"], chunked["virtual_stages"]) == (1, 2)
    assert chunked["bubble_fraction"] < plain["bubble_fraction"]


@pytest.mark.parametrize("command", [["kv-cache", "--seq-len", "8"], ["analyze", "--gpu", "h100-sxm"],
                                     ["train-memory", "--gpus", "8"]])  # fmt: skip
def test_config_path_with_a_wrong_typed_key_is_one_line(tmp_path, capsys, command):
    config = {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
              "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 128,
              "sliding_window": "4096"}  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert main([*command, "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert "sliding_window must be an integer >= 0 (or null), got '4096'" in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv,message",
    [
        (["kv-cache", "--model", "gpt-9", "--seq-len", "8"], "valid ids: llama-2-7b"),
        (["kv-cache", "--model", "llama-3-8b", "--seq-len", "0"],
         "argument --seq-len: expected a positive integer, got '0'"),  # fmt: skip
        # a bad number is named by its option (the models' own checks named their parameters: cp, latency_s)
        (["kv-cache", "--model", "llama-3-8b", "--seq-len", "8", "--scale-bytes", "-1"],
         "argument --scale-bytes: expected a finite number >= 0, got '-1'"),  # fmt: skip
        (["analyze", "--model", "llama-3-8b", "--tp", "0"],
         "argument --tp: expected a positive integer, got '0'"),  # fmt: skip
        (["analyze", "--model", "llama-3-8b", "--collective-latency-us", "-3"],
         "argument --collective-latency-us: expected a finite number >= 0, got '-3'"),  # fmt: skip
        (["analyze", "--model", "llama-3-8b", "--compute-efficiency", "nan"],
         "argument --compute-efficiency: expected a number in (0, 1], got 'nan'"),  # fmt: skip
        (["ring-plan", "--model", "llama-3-8b", "--seq-len", "64", "--world-size", "0", "--gpu", "h100"],
         "argument --world-size: expected a positive integer, got '0'"),  # fmt: skip
        (["ring-plan", "--model", "llama-3-8b", "--seq-len", "64", "--world-size", "2", "--gpu", "h100",
          "--latency-us", "-5"],
         "argument --latency-us: expected a finite number >= 0, got '-5'"),  # fmt: skip
        (["roofline", "--gpu", "h100", "--flops", "-1", "--bytes", "5"],
         "argument --flops: expected a finite number > 0, got '-1'"),  # fmt: skip
        (["train-memory", "--model", "llama-3-8b", "--gpus", "8", "--virtual-stages", "0"],
         "argument --virtual-stages: expected a positive integer, got '0'"),  # fmt: skip
        (["analyze", "--model", "llama-3-8b", "--gpu", "v100x"], "h100"),
        (["train-memory", "--model", "llama-3-70b", "--gpus", "64", "--tp", "3"], "valid tp: 1, 2, 4, 8"),
        (
            ["train-memory", "--model", "llama-3-8b", "--gpus", "8", "--pp", "2", "--schedule", "interleaved",
             "--virtual-stages", "32"],
            "pp*virtual_stages (2*32 = 64) must be at most num_layers (32) of llama-3-8b",
        ),
        (
            ["train-memory", "--model", "llama-3-8b", "--gpus", "8", "--pp", "8", "--schedule", "interleaved",
             "--virtual-stages", "5"],
            "valid virtual_stages for pp 8: 1..4",
        ),
    ],
)
def test_errors_are_one_line(capsys, argv, message):
    assert exit_code(argv) == 2  # argparse's (a bad number) or the command's
    assert message in one_error_line(capsys.readouterr().err)
