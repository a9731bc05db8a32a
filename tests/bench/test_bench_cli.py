"""The ``bench``, ``doctor`` and ``demo`` commands: flags (the old project's included), bad input, outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llm_speed.bench.cli import attention_settings, gemm_settings
from llm_speed.cli import build_parser, main
from llm_speed.core.runtime import INTERPRETED

REPO = Path(__file__).resolve().parents[2]
NO_GPU = not torch.cuda.is_available()


def parse(*argv):
    return build_parser().parse_args(list(argv))


def fast_env() -> dict[str, str]:
    """Subprocess environment: llm-speed's CPU fallbacks instead of the (slow) Triton interpreter."""
    return {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO / "src")}


def test_old_project_attention_flags():
    args = parse(
        "bench",
        "attention",
        "--seq-lengths",
        "512",
        "1024",
        "2048",
        "4096",
        "8192",
        "--batch-size",
        "4",
        "--num-heads",
        "16",
        "--head-dim",
        "64",
        "--dtype",
        "fp16",
        "--warmup",
        "50",
        "--iterations",
        "200",
        "--output",
        "results.json",
        "--device",
        "cpu",
    )
    settings = attention_settings(args)
    assert settings.seq_lengths == (512, 1024, 2048, 4096, 8192)
    assert (settings.batch_size, settings.num_heads, settings.num_kv_heads, settings.head_dim) == (
        4,
        16,
        16,
        64,
    )
    assert (settings.dtype, settings.warmup, settings.iterations) == ("fp16", 50, 200)
    assert args.output == "results.json"
    assert settings.mode == "fwd" and not settings.causal


def test_new_attention_flags():
    args = parse(
        "bench",
        "attention",
        "--causal",
        "--num-heads",
        "8",
        "--num-kv-heads",
        "2",
        "--mode",
        "fwd+bwd",
        "--impl",
        "flash",
        "sdpa-flash",
        "--plot",
        "x.png",
        "--device",
        "cpu",
    )
    settings = attention_settings(args)
    assert settings.causal and settings.num_kv_heads == 2 and settings.mode == "fwd+bwd"
    assert settings.impls == ("flash", "sdpa-flash") and args.plot == "x.png"


def test_cpu_defaults_are_small():
    settings = attention_settings(parse("bench", "attention", "--device", "cpu"))
    assert max(settings.seq_lengths) <= 128 and settings.dtype == "fp32"
    gemm = gemm_settings(parse("bench", "gemm", "--device", "cpu"))
    assert max(case.m for case in gemm.cases) <= 128


def test_old_project_gemm_flags_and_model_shapes():
    args = parse(
        "bench",
        "gemm",
        "--sizes",
        "512x512x512",
        "1024x1024x1024",
        "--dtype",
        "fp16",
        "--output",
        "g.json",
        "--device",
        "cpu",
    )
    settings = gemm_settings(args)
    assert [(c.m, c.n, c.k) for c in settings.cases] == [(512, 512, 512), (1024, 1024, 1024)]
    model = gemm_settings(parse("bench", "gemm", "--model", "llama-3-8b", "--tokens", "8", "--device", "cpu"))
    assert {case.name for case in model.cases} >= {"qkv", "o", "down", "lm_head"}
    assert all(case.m == 8 for case in model.cases)


def test_gemm_model_takes_a_config_json_path(tmp_path):
    # --model said it took a config.json path but looked the name up in the zoo only.
    from llm_speed.demo import attention_settings as demo_attention
    from llm_speed.demo import gemm_settings as demo_gemm

    config = {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000,
              "max_position_embeddings": 128}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    for model in (str(tmp_path), str(tmp_path / "config.json")):
        settings = gemm_settings(parse("bench", "gemm", "--model", model, "--tokens", "8", "--device", "cpu"))
        assert {(case.name, case.n, case.k) for case in settings.cases} >= {("down", 256, 512)}
    # demo on a GPU takes the model's shapes the same way (only read here, nothing runs).
    cuda = torch.device("cuda")
    assert demo_attention(cuda, str(tmp_path)).head_dim == 64
    assert demo_gemm(cuda, str(tmp_path)).cases == gemm_settings(
        parse("bench", "gemm", "--model", str(tmp_path), "--tokens", "2048", "--device", "cpu")
    ).cases


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "gemm", "--sizes", "12x34"], "MxNxK"),
        (["bench", "gemm", "--dtype", "fp64"], "--dtype"),
        (["bench", "gemm", "--impl", "cutlass"], "--impl"),
        (["bench", "attention", "--impl", "xformers"], "--impl"),
        (["bench", "attention", "--dtype", "int8"], "--dtype"),
        (["bench", "attention", "--batch-size", "0"], "--batch-size"),
        (
            ["bench", "attention", "--device", "cpu", "--num-heads", "4", "--num-kv-heads", "3"],
            "llm-speed bench attention: error: --num-kv-heads: must divide",
        ),
        (["bench", "gemm", "--device", "cpu", "--tokens", "4"], "--model"),
        (["bench", "gemm", "--device", "cpu", "--dtype", "int8", "--epilogue", "bias"], ": --epilogue: "),
        (["bench", "gemm", "--device", "cpu", "--model", "no-such-model"], "no-such-model"),
        # nothing asked for can run: a usage error before the calibration, not a run of "not run" rows
        (["bench", "attention", "--device", "cpu", "--mode", "bwd", "--impl", "flash-fp8"],
         "--impl: none of the implementations asked for can run here (flash-fp8: fp8 attention is forward"),
        (["bench", "attention", "--device", "cpu", "--impl", "sdpa-cudnn"],
         "(sdpa-cudnn: SDPA's cuDNN backend runs on CUDA devices only)"),
        (["bench", "attention", "--device", "cpu", "--impl", "sdpa-efficient"],  # not PyTorch's raw error
         "(sdpa-efficient: SDPA's memory-efficient backend runs on CUDA devices only)"),
        (["bench", "ops", "--device", "cpu", "--impl", "liger"], "--impl: none of the implementations asked"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as parse_exit:
        code = main(argv)
        raise SystemExit(code)
    assert parse_exit.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not NO_GPU, reason="checks the message given when no GPU is there")
def test_cuda_requested_without_a_gpu(capsys):
    assert main(["bench", "gemm", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_bench_gemm_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "g.json", tmp_path / "g.png"
    code = main(
        [
            "bench",
            "gemm",
            "--device",
            "cpu",
            "--sizes",
            "16x16x16",
            "--warmup",
            "0",
            "--iterations",
            "1",
            "--min-time",
            "0",
            "--output",
            str(out),
            "--plot",
            str(png),
            "--no-progress",
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "GEMM BENCHMARK RESULTS" in text and "CPU timings" in text
    payload = json.loads(out.read_text())
    assert payload["benchmark"] == "gemm" and len(payload["results"]) == 2
    assert png.stat().st_size > 0


def test_bench_attention_json_to_stdout(capsys):
    code = main(
        [
            "bench",
            "attention",
            "--device",
            "cpu",
            "--seq-lengths",
            "16",
            "--num-heads",
            "2",
            "--head-dim",
            "16",
            "--impl",
            "naive",
            "sdpa",
            "--warmup",
            "0",
            "--iterations",
            "1",
            "--min-time",
            "0",
            "--json",
            "--no-progress",
        ]
    )
    assert code == 0
    payload = json.loads(capsys.readouterr().out)
    assert [r["impl"] for r in payload["results"]] == ["naive", "sdpa"]
    assert payload["settings"]["seq_lengths"] == [16]


@pytest.fixture
def efficient_tried_on_cpu(monkeypatch):
    """SDPA's memory-efficient backend tried on the CPU, where PyTorch has none: known once tried (the bench
    refuses it before any work, so these tests let it through to fail as it runs)."""
    from llm_speed.bench import attention as attention_bench

    refuse = attention_bench.unavailable_reason
    def tried(impl, *rest):
        return None if impl == "sdpa-efficient" else refuse(impl, *rest)

    monkeypatch.setattr(attention_bench, "unavailable_reason", tried)


def test_nothing_runnable_exits_1(capsys, efficient_tried_on_cpu):
    code = main(
        [
            "bench",
            "attention",
            "--device",
            "cpu",
            "--seq-lengths",
            "16",
            "--impl",
            "sdpa-efficient",  # no CPU kernel, known once tried (efficient_tried_on_cpu)
            "--no-progress",
        ]
    )
    assert code == 1
    assert "not run: sdpa-efficient" in capsys.readouterr().out


def test_a_run_where_nothing_ran_keeps_an_earlier_results_file(tmp_path, capsys, efficient_tried_on_cpu):
    """Exit 1 and the earlier run's files left as they were: a run of "not run" rows replaced them."""
    earlier = tmp_path / "results.json"
    earlier.write_text('{"earlier": true}')
    table = tmp_path / "results.csv"
    table.write_text("earlier,rows\n")
    argv = ["bench", "attention", "--device", "cpu", "--seq-lengths", "16", "--impl", "sdpa-efficient",
            "--no-progress", "--output", str(earlier), "--csv", str(table)]  # fmt: skip
    assert main(argv) == 1
    assert earlier.read_text() == '{"earlier": true}' and table.read_text() == "earlier,rows\n"
    assert f"nothing ran: {earlier} not written" in capsys.readouterr().out  # (stderr with --json)


def test_doctor_reports_dispatch_and_backends(capsys):
    assert main(["doctor", "--device", "cpu", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["torch_version"] == torch.__version__ and info["triton_interpret"] == INTERPRETED
    assert info["sdpa_backends"]["math"]["usable"] is True
    # CUDA-only backends on CPU tensors: the reason says so (torch's own message blames "turning off").
    assert "no CPU kernel" in info["sdpa_backends"]["efficient"]["reason"]
    flash = info["dispatch"]["flash_attention (forward)"]
    if INTERPRETED:
        assert flash["runs"] == "Triton interpreter" and flash["kernels"]
    else:
        assert flash["runs"].startswith("PyTorch fallback")
    assert info["dispatch"]["naive_attention"]["runs"] == "PyTorch (plain ops, by design)"
    if NO_GPU:
        assert info["gpu"]["available"] is False and info["gpu"]["reason"]


def test_doctor_table(capsys):
    assert main(["doctor", "--device", "cpu"]) == 0
    text = capsys.readouterr().out
    for expected in (
        "llm-speed doctor",
        "TRITON_INTERPRET",
        "torch SDPA backends",
        "What llm-speed runs here",
    ):
        assert expected in text


def test_demo_names_an_unknown_model_before_making_its_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--model", "nope", "--output-dir", "out", "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert "unknown model 'nope'" in err and out == ""
    assert not (tmp_path / "out").exists()


def test_demo_runs_end_to_end(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "llm_speed.cli", "demo", "--device", "cpu", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=fast_env(),
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for expected in ("1/4", "llama-3-8b", "h100-sxm", "2/4", "3/4", "4/4", "CPU timings"):
        assert expected in result.stdout
    assert (tmp_path / "roofline.png").stat().st_size > 0
    payload = json.loads((tmp_path / "demo.json").read_text())
    assert payload["attention"]["results"] and payload["gemm"]["results"]


def test_wrapper_script_accepts_the_old_flags(tmp_path):
    out = tmp_path / "gemm_results.json"
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "benchmark_gemm.py"),
            "--sizes",
            "16x16x16",
            "--dtype",
            "fp32",
            "--output",
            str(out),
            "--device",
            "cpu",
            "--iterations",
            "1",
            "--warmup",
            "0",
        ],
        capture_output=True,
        text=True,
        env=fast_env(),
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(out.read_text())["benchmark"] == "gemm"


def test_attention_wrapper_script_runs_the_old_flags(tmp_path, monkeypatch, capsys):
    """benchmarks/benchmark_attention.py with the old project's custom-configuration flags (small, CPU)."""
    import runpy

    out = tmp_path / "results.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "benchmark_attention.py",
            "--seq-lengths",
            "16",
            "32",
            "--batch-size",
            "1",
            "--num-heads",
            "2",
            "--head-dim",
            "16",
            "--dtype",
            "fp32",
            "--warmup",
            "0",
            "--iterations",
            "1",
            "--output",
            str(out),
            "--device",
            "cpu",
            "--impl",
            "flash",
            "sdpa",
            "--no-progress",
        ],
    )
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(REPO / "benchmarks" / "benchmark_attention.py"), run_name="__main__")
    assert exit_info.value.code == 0
    assert "ATTENTION BENCHMARK RESULTS" in capsys.readouterr().out  # the old project's table
    results = json.loads(out.read_text())["results"]
    assert [(r["config"], r["impl"]) for r in results] == [
        ("1x2x16x16", "flash"),
        ("1x2x16x16", "sdpa"),
        ("1x2x32x16", "flash"),
        ("1x2x32x16", "sdpa"),
    ]
    assert all(r["latency_ms"] > 0 and r["throughput_tflops"] > 0 for r in results)
