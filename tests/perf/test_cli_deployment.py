"""The deployment side of the CLI and its inputs: analyze across GPUs with quantized weights, user GPU specs,
training MFU from a throughput, the --attention spec for GQA and decode, warnings, output paths, and the
config loader's Gemma-2 / Qwen3 / Phi-3 support (configs shaped like their Hugging Face config.json files)."""

import json

import pytest

from llm_speed.cli import main
from llm_speed.core.gpus import custom_gpu, get_gpu, list_gpus, load_gpu_spec
from llm_speed.perf.models import load_hf_config, param_count, resolve_model


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_analyze_across_gpus_with_quantized_weights(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich would fold the table titles at 80 columns
    argv = ["analyze", "--model", "llama-3-70b", "--gpu", "h100", "--seq-len", "4096", "--batch-size", "8"]
    payload = _json(capsys, [*argv, "--kv-dtype", "fp8", "--tp", "8", "--weight-dtype", "fp8", "--json"])
    assert (payload["tp"], payload["weight_dtype"], payload["kv_dtype"]) == (8, "fp8", "fp8")
    assert payload["fits_in_memory"] and payload["decode_communication"]["all_reduces"] == 160
    assert payload["decode_tokens_per_s_realistic"] < payload["decode_tokens_per_s"]
    assert main([*argv, "--tp", "4", "--pp", "2", "--collective", "nvls", "--memory-efficiency", "0.9"]) == 0
    out = capsys.readouterr().out
    assert "TP 4 x PP 2 = 8 GPUs" in out and "realistic" in out and "command-line factors" in out
    assert main([*argv, "--tp", "3"]) == 2
    assert "valid tp: 1, 2, 4, 8" in capsys.readouterr().err
    assert main([*argv, "--tp", "2", "--sweep"]) == 2
    with pytest.raises(SystemExit, match="2"):
        main([*argv, "--memory-efficiency", "1.5"])
    assert "argument --memory-efficiency: expected a number in (0, 1], got '1.5'" in capsys.readouterr().err


def test_analyze_plot_path_checked_before_work(tmp_path, capsys):
    outside = tmp_path.parent / "llm-speed-missing-folder" / "x.png"
    argv = ["analyze", "--model", "llama-3-8b", "--gpu", "h100", "--seq-len", "128", "--plot", str(outside)]
    assert main(argv) == 2
    assert "--plot" in capsys.readouterr().err and not outside.parent.exists()
    assert main(["roofline", "--gpu", "h100", "--plot", str(outside)]) == 2
    assert not outside.parent.exists()


def test_missing_config_file_says_file_not_found(capsys):
    assert main(["kv-cache", "--model", "/nonexistent/config.json", "--seq-len", "8"]) == 2
    err = capsys.readouterr().err
    assert "file not found" in err and "unknown model" not in err
    with pytest.raises(ValueError, match="file not found"):
        resolve_model("./no-such-dir/config.json")
    assert resolve_model("meta-llama/Llama-3.1-8B").name == "llama-3.1-8b"  # a Hub id is not a path


def test_warnings_past_context_and_absurd_sizes(capsys):
    payload = _json(capsys, ["kv-cache", "--model", "llama-3-8b", "--seq-len", "16384", "--json"])
    assert any("8,192-token context" in note for note in payload["warnings"])
    payload = _json(capsys, ["kv-cache", "--model", "llama-3.1-8b", "--seq-len", "16384", "--json"])
    assert payload["warnings"] == []
    argv = ["vram", "--seq-len", str(10**14), "--num-heads", "32", "--head-dim", "128"]
    assert main(argv) == 0
    assert "beyond any published model's context" in capsys.readouterr().out


def test_gpu_spec_json_and_inline(tmp_path, capsys):
    spec_file = tmp_path / "gpu.json"
    spec_file.write_text(json.dumps({"based_on": "h100-sxm", "id": "h100-capped", "hbm_bandwidth_gbs": 2000}))
    spec = load_gpu_spec(str(spec_file))
    assert spec.id == "h100-capped" and spec.memory_bandwidth == 2e12 and spec.peak_flops("bf16") == 989.4e12
    assert "user GPU spec" in spec.sources["hbm_bandwidth_gbs"]
    inline = load_gpu_spec("bf16=400,fp8=800,bandwidth_gbs=1000,memory_gb=48,nvlink_gbs=200")
    assert inline.ridge_point("bf16") == 400 and inline.memory_capacity_bytes == 48e9
    with pytest.raises(ValueError, match="unknown key 'bandwidth'"):
        load_gpu_spec("bf16=400,bandwidth=1000")
    with pytest.raises(ValueError, match="missing hbm_capacity_gb"):
        custom_gpu({"id": "x", "peak_tflops": {"bf16": 1}, "hbm_bandwidth_gbs": 1})
    with pytest.raises(ValueError, match="peak_tflops"):
        custom_gpu({"based_on": "h100", "peak_tflops": {"bf16": -1}})
    with pytest.raises(ValueError, match="file not found"):
        load_gpu_spec(str(tmp_path / "missing.json"))
    payload = _json(
        capsys,
        ["analyze", "--model", "llama-3-8b", "--gpu-spec", str(spec_file), "--seq-len", "64", "--json"],
    )
    assert payload["gpu"] == "h100-capped"
    assert main(["roofline", "--gemm", "64x64x64"]) == 2
    assert "give one of --gpu ID and --gpu-spec" in capsys.readouterr().err
    assert main(["roofline", "--gpu", "h100", "--gpu-spec", str(spec_file), "--gemm", "64x64x64"]) == 2
    assert "not both" in capsys.readouterr().err


def test_gpu_spec_unknown_key_named_before_its_value():
    # "sms=abc" said "sms needs a number", although sms is no key at all
    for item in ("sms=abc", "sms=-4"):
        with pytest.raises(ValueError, match=r"unknown key 'sms'; accepted: id, based_on, .*sm_count"):
            load_gpu_spec(f"based_on=h100-sxm,{item}")
    with pytest.raises(ValueError, match="sm_count needs a number"):
        load_gpu_spec("based_on=h100-sxm,sm_count=abc")
    with pytest.raises(ValueError, match="bf16 needs a number"):
        load_gpu_spec("based_on=h100-sxm,bf16=abc")


def test_gpu_spec_sm_count_and_model_fields_checked_up_front(tmp_path, capsys):
    # sm_count 0 or negative crashed analyze deep in a prediction; 1.5 was accepted.
    for bad in ("0", "-3", "1.5"):
        with pytest.raises(ValueError, match="sm_count must be a positive integer"):
            load_gpu_spec(f"based_on=h100-sxm,sm_count={bad}")
    with pytest.raises(ValueError, match="boost_clock_mhz must be a number > 0"):
        custom_gpu({"based_on": "h100", "boost_clock_mhz": 0})
    assert load_gpu_spec("based_on=h100-sxm,sm_count=100").sm_count == 100
    spec_file = tmp_path / "sm0.json"
    spec_file.write_text(json.dumps({"based_on": "h100-sxm", "sm_count": 0}))
    argv = ["analyze", "--model", "llama-3-8b", "--seq-len", "64", "--json", "--gpu-spec"]
    for spec in (str(spec_file), "based_on=h100-sxm,sm_count=-3"):
        assert main([*argv, spec]) == 2
        assert "--gpu-spec: " in capsys.readouterr().err
    # Without based_on the microarchitecture is unknown: predictions name what they need, before any work.
    bare = "bf16=800,memory_gb=80,bandwidth_gbs=3000"
    assert main([*argv, bare]) == 2
    err = capsys.readouterr().err
    assert "--gpu-spec: predictions" in err and "sm_count" in err and "fp32" in err and "based_on" in err
    assert _json(capsys, [*argv, bare, "--implementation", "none"])["gpu"] == "user-gpu"
    assert main(["roofline", "--gpu-spec", bare, "--json"]) == 0
    capsys.readouterr()
    full = f"{bare},fp32=60,sm_count=132,boost_clock_mhz=1980,l2_cache_mb=50,smem_per_sm_kb=228,"
    payload = _json(capsys, [*argv, full + "register_file_per_sm_kb=256"])
    assert payload["ttft_predicted_s"] > 0


def test_analyze_on_a_gpu_without_bf16(capsys):
    # The calibration probe ignored --dtype and asked for bf16, which a T4 has no peak for.
    argv = ["analyze", "--model", "llama-3-8b", "--gpu", "t4", "--seq-len", "64", "--json"]
    payload = _json(capsys, [*argv, "--dtype", "fp16"])
    assert payload["dtype"] == "fp16" and payload["ttft_predicted_s"] > 0
    assert _json(capsys, argv)["dtype"] == "fp16"  # the default: bf16 where the GPU has it, else fp16
    assert main([*argv, "--dtype", "bf16"]) == 2
    assert "--dtype bf16: t4 has no peak for it; accepted on t4: fp64, fp32, fp16" in capsys.readouterr().err


def test_analyze_implementation_checked_by_argparse(capsys):
    # 'nope' failed inside the calibration with a message naming neither the flag nor the accepted values.
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "--model", "llama-3-8b", "--gpu", "h100", "--implementation", "nope"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--implementation: invalid choice: 'nope'" in err and "'llm-speed', 'vendor', 'none'" in err


def test_new_gpus_are_sourced():
    for gpu_id in ("h800", "h100-nvl", "h100-pcie", "gh200", "l4", "t4", "mi300x"):
        spec = get_gpu(gpu_id)
        assert spec.sources["peak_tflops"] and spec.sources["hbm_bandwidth_gbs"]
    assert get_gpu("h800").nvlink_bandwidth_gbs == 400 and get_gpu("h800").peak_tflops["bf16"] == 989.4
    assert get_gpu("h100 nvl").hbm_capacity_gb == 94 and get_gpu("mi300x").peak_tflops["bf16"] == 1307.4
    assert "bf16" not in get_gpu("Tesla T4").peak_tflops  # Turing has no bf16 tensor cores
    assert len({gpu.id for gpu in list_gpus()}) == len(list_gpus())


def test_mfu_from_model_throughput(capsys):
    argv = ["mfu", "--gpu", "h100", "--model", "llama-3-8b", "--tokens-per-second", "64000", "--gpus", "8"]
    payload = _json(capsys, [*argv, "--seq-len", "8192", "--json"])
    by_name = {row["convention"]: row["utilisation"] for row in payload["conventions"]}
    assert by_name["causal"] < by_name["non_causal"] < by_name["mosaicml_hfu"]
    assert main([*argv, "--ms", "3"]) == 2
    assert main(["mfu", "--gpu", "h100", "--model", "llama-3-8b"]) == 2
    assert all(row["note"] is None for row in payload["conventions"])  # all conventions apply to dense models


def test_mfu_of_a_mixture_of_experts_counts_active_parameters(capsys):
    # Audit 7 item 1: mosaicml was 6 x total parameters (286.7 GFLOP/token for Mixtral, 160% MFU for
    # DeepSeek-V3); the dense-only Megatron formulas read Mixtral 45% low.
    argv = ["mfu", "--gpu", "h100", "--model", "mixtral-8x7b", "--tokens-per-second", "10000", "--gpus", "8"]
    payload = _json(capsys, [*argv, "--seq-len", "4096", "--json"])
    rows = {row["convention"]: row for row in payload["conventions"]}
    active = param_count("mixtral-8x7b").active
    expected = 6 * active + 12 * 32 * 4096 * 4096
    assert rows["mosaicml"]["flops_per_token"] == pytest.approx(expected, rel=0.01)
    non_causal = rows["non_causal"]["flops_per_token"]
    assert rows["mosaicml"]["flops_per_token"] == pytest.approx(non_causal, rel=0.03)
    for convention in ("megatron", "megatron_hfu_selective", "megatron_hfu_full"):
        assert rows[convention]["flops_per_token"] is None and rows[convention]["utilisation"] is None
        assert "mixture of experts" in rows[convention]["note"]
    argv = ["mfu", "--gpu", "h100", "--model", "deepseek-v3", "--tokens-per-second", "1e5", "--gpus", "256"]
    payload = _json(capsys, [*argv, "--seq-len", "4096", "--json"])
    assert all(row["utilisation"] is None or row["utilisation"] < 1 for row in payload["conventions"])
    assert "above 100%" not in capsys.readouterr().err
    assert main([*argv, "--seq-len", "4096"]) == 0  # the table prints the n/a rows
    out = capsys.readouterr().out
    assert "megatron (n/a: MoE)" in out and "mosaicml_hfu" in out


def test_attention_spec_gqa_and_decode(capsys):
    decode = _json(
        capsys, ["mfu", "--gpu", "h100", "--ms", "1", "--attention", "8,64,32768,128,kv=8,q=1", "--json"]
    )
    assert decode["flops"] == 4 * 8 * 64 * 1 * 32768 * 128  # one query row per sequence and head
    gqa = _json(capsys, ["roofline", "--gpu", "h100", "--attention", "1,32,4096,128,kv=8", "--json"])
    mha = _json(capsys, ["roofline", "--gpu", "h100", "--attention", "1,32,4096,128", "--json"])
    assert gqa["points"][0]["bytes_moved"] < mha["points"][0]["bytes_moved"]
    assert main(["roofline", "--gpu", "h100", "--attention", "1,32,4096,128,kv=5"]) == 2
    assert "heads_kv" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: usage and the accepted form
        main(["roofline", "--gpu", "h100", "--attention", "1,32,4096,128,heads=5"])
    assert "B,H,S,D[,kv=HKV][,q=SQ]" in capsys.readouterr().err


def _config(tmp_path, name, data):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(data))
    return path


def test_load_gemma2_qwen3_phi3(tmp_path):
    gemma2 = {  # google/gemma-2-9b
        "model_type": "gemma2",
        "hidden_size": 3584,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "intermediate_size": 14336,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "hidden_activation": "gelu_pytorch_tanh",
        "sliding_window": 4096,
    }
    config = load_hf_config(_config(tmp_path, "gemma2", gemma2))
    assert config.tie_embeddings and config.gated_mlp and config.sliding_window is None
    assert param_count(config).total == pytest.approx(9.24e9, rel=0.01)  # Gemma 2 report: 9.24B (9B model)
    qwen3 = {  # Qwen/Qwen3-8B
        "model_type": "qwen3",
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "use_sliding_window": False,
    }
    config = load_hf_config(_config(tmp_path, "qwen3", qwen3))
    assert not config.attention_bias and param_count(config).total == pytest.approx(8.19e9, rel=0.01)
    phi3 = {  # microsoft/Phi-3-mini-4k-instruct
        "model_type": "phi3",
        "hidden_size": 3072,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "intermediate_size": 8192,
        "vocab_size": 32064,
        "max_position_embeddings": 4096,
        "hidden_act": "silu",
        "sliding_window": 2047,
    }
    config = load_hf_config(_config(tmp_path, "phi3", phi3))
    assert config.sliding_window == 2047 and param_count(config).total == pytest.approx(3.82e9, rel=0.01)


def test_analyze_calibrated_from_bench_json(tmp_path, capsys):
    bandwidth = get_gpu("h100-sxm").memory_bandwidth
    gemv_bytes = 2.0 * 8192 * 8192
    row = {"case": "gemv", "flops": 2.0 * 8192**2, "bytes_moved": gemv_bytes}
    bench = {
        "environment": {"gpu_spec_id": "h100-sxm"},
        "settings": {"dtype": "bf16"},
        "results": [{**row, "latency_ms": 1e3 * gemv_bytes / (0.9 * bandwidth)}],
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    argv = ["analyze", "--model", "llama-3-8b", "--gpu", "h100", "--seq-len", "64", "--json"]
    default = _json(capsys, argv)
    calibrated = _json(capsys, [*argv, "--calibrate", str(path)])
    assert "calibrated from bench on h100-sxm" in calibrated["efficiency_source"]
    ratio = calibrated["decode_tokens_per_s_realistic"] / default["decode_tokens_per_s_realistic"]
    assert ratio == pytest.approx(0.9 / 0.7, rel=0.02)  # decode is memory-bound: 0.9 instead of 0.7


def test_docs_deployment_example(capsys):
    # docs/performance-model.md, "Answering deployment questions": the command and the figures it quotes.
    argv = ["analyze", "--model", "llama-3.1-70b", "--gpu", "h100", "--seq-len", "32768", "--batch-size", "8"]
    payload = _json(capsys, [*argv, "--decode-tokens", "1024", "--kv-dtype", "fp8", "--tp", "8", "--json"])
    gb, ms = 1e9, 1e3
    assert payload["fits_in_memory"]
    assert payload["weights_bytes"] / gb == pytest.approx(141, abs=0.5)
    assert payload["weights_bytes_per_gpu"] / gb == pytest.approx(17.6, abs=0.05)
    assert payload["kv_cache_bytes"] / gb == pytest.approx(44.3, abs=0.05)
    assert payload["kv_cache_bytes_per_gpu"] / gb == pytest.approx(5.54, abs=0.01)
    assert payload["memory_per_gpu_bytes"] / gb == pytest.approx(23.2, abs=0.05)
    assert payload["decode_step_s"] * ms == pytest.approx(6.96, abs=0.05)
    assert payload["decode_step_realistic_s"] * ms == pytest.approx(14.4, abs=0.1)
    assert payload["decode_communication"]["realistic_s"] * ms == pytest.approx(4.6, abs=0.05)
    assert payload["decode_tokens_per_s"] == pytest.approx(1150, rel=0.01)
    assert payload["decode_tokens_per_s_realistic"] == pytest.approx(554, rel=0.01)
    assert payload["ttft_s"] == pytest.approx(9.8, abs=0.05)
    assert payload["ttft_realistic_s"] == pytest.approx(13.6, abs=0.05)
    one_gpu = _json(capsys, [*argv, "--decode-tokens", "1024", "--kv-dtype", "fp8", "--json"])
    assert not one_gpu["fits_in_memory"] and one_gpu["memory_per_gpu_bytes"] / gb == pytest.approx(
        185, abs=0.5
    )
    assert main([*argv, "--tp", "8", "--collective", "nvls"]) == 0
    capsys.readouterr()
    assert (
        main(["analyze", "--model", "llama-3-8b", "--gpu", "a100", "--tp", "2", "--collective", "nvls"]) == 2
    )
    assert "NVSwitch" in capsys.readouterr().err
