"""The hardware commands run in-process: tables, JSON, plots and one-line errors."""

import json
import re

import pytest
from cli_exit import exit_code, one_error_line

from llm_speed.cli import main
from llm_speed.core.gpus import list_gpus


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_gpus_table_and_json(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # rich folds a 13-column table on the 80-column default
    assert main(["gpus"]) == 0
    table = capsys.readouterr().out
    assert "h100-sxm" in table and "rtx-4090" in table and "dense" in table
    data = _json(capsys, ["gpus", "--json"])
    assert [row["id"] for row in data] == [gpu.id for gpu in list_gpus()]
    h100 = next(row for row in data if row["id"] == "h100-sxm")
    assert h100["peak_tflops"]["bf16"] == 989.4
    assert "sparsity" in h100["sources"]["peak_tflops"]


def test_gpus_live(capsys, monkeypatch):
    import torch

    if not torch.cuda.is_available():
        assert main(["gpus", "--live"]) == 2
        assert "--live needs a CUDA device" in capsys.readouterr().err
    # What an H100 SXM reports (torch.cuda.get_device_properties), beside its table entry.
    fake = {
        "name": "NVIDIA H100 80GB HBM3",
        "compute_capability": (9, 0),
        "sm_count": 132,
        "memory_gb": 85.0,
        "l2_cache_mb": 50.0,
        "smem_per_sm_kb": 228.0,
        "memory_bandwidth_gbs": 3352.3,
        "table_id": "h100-sxm",
    }
    monkeypatch.setattr("llm_speed.perf.cli_hardware.live_device_properties", lambda: fake)
    monkeypatch.setenv("COLUMNS", "160")
    assert main(["gpus", "--live"]) == 0
    table = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in table and "table (h100-sxm)" in table and "3,352" in table
    data = _json(capsys, ["gpus", "--live", "--json"])
    assert data["live"]["sm_count"] == data["table"]["sm_count"] == 132
    monkeypatch.setattr(
        "llm_speed.perf.cli_hardware.live_device_properties", lambda: {**fake, "table_id": None}
    )
    assert main(["gpus", "--live"]) == 0
    assert "not in it" in capsys.readouterr().out


def test_roofline_point_json(capsys):
    data = _json(
        capsys,
        ["roofline", "--gpu", "H100", "--dtype", "fp16", "--flops", "1e11", "--bytes", "1e9", "--json"],
    )
    assert data["gpu"] == "h100-sxm"
    assert data["ridge_points"]["fp16"] == pytest.approx(989.4 / 3.35)
    (point,) = data["points"]
    assert point["label"] == "kernel"
    assert point["bound"] == "memory" and point["intensity"] == pytest.approx(100)
    assert point["time_floor_s"] == pytest.approx(1e9 / 3.35e12)


def test_roofline_gemm_table_and_plot(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    plot = tmp_path / "roof.png"
    assert main(["roofline", "--gpu", "a100-sxm-80gb", "--gemm", "4096x4096x4096", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "compute" in out and "gemm 4096x4096x4096" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000


def test_roofline_attention_places_three_implementations(capsys):
    data = _json(capsys, ["roofline", "--gpu", "h100", "--attention", "1,32,4096,128", "--causal", "--json"])
    by_impl = {point["label"].split()[1]: point for point in data["points"]}
    assert set(by_impl) == {"flash", "tiled", "naive"}
    assert by_impl["flash"]["flops"] == by_impl["naive"]["flops"] == 4 * 32 * 128 * (4096 * 4097 // 2)
    assert by_impl["flash"]["bound"] == "compute" and by_impl["naive"]["bound"] == "memory"
    assert by_impl["flash"]["intensity"] > by_impl["tiled"]["intensity"] > by_impl["naive"]["intensity"]


def test_gpus_show_lists_every_field_with_its_source(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["gpus", "--show", "NVIDIA H100 80GB HBM3"]) == 0
    out = capsys.readouterr().out
    assert "h100-sxm" in out and "peak_tflops bf16" in out and "sparsity" in out and "HBM3" in out
    assert _json(capsys, ["gpus", "--show", "h200", "--json"])["hbm_bandwidth_gbs"] == 4800.0


def test_vram_standard_vs_flash(capsys):
    data = _json(capsys, ["vram", "--seq-len", "4096", "--num-heads", "32", "--head-dim", "128", "--json"])
    standard, flash = data["standard"], data["flash"]
    assert standard["scores_bytes"] == 32 * 4096 * 4096 * 2
    assert flash["scores_bytes"] == 0 and flash["softmax_stats_bytes"] == 32 * 4096 * 4
    assert data["saving"] == pytest.approx(standard["peak_bytes"] / flash["peak_bytes"])
    assert set(data) == {"standard", "flash", "saving"}  # no more one-matrix formulas (issue 14)
    assert (
        main(
            [
                "vram",
                "--seq-len",
                "1024",
                "--num-heads",
                "16",
                "--head-dim",
                "64",
                "--batch-size",
                "2",
                "--num-kv-heads",
                "4",
                "--training",
                "--dtype",
                "bf16",
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "backward peak" in table and "(4 KV)" in table


def test_mfu_seed_003_example(capsys):
    data = _json(
        capsys,
        ["mfu", "--gpu", "h100-sxm", "--gemm", "4096,4096,4096", "--ms", "0.5", "--dtype", "fp16", "--json"],
    )
    assert round(data["mfu"] * 100, 1) == 27.8
    assert round(data["achieved_flops_per_s"] / 1e12, 1) == 274.9
    data = _json(
        capsys, ["mfu", "--gpu", "h100", "--attention", "1,8,1024,64", "--causal", "--ms", "1", "--json"]
    )
    assert data["flops"] == 4 * 8 * 64 * (1024 * 1025 // 2)


def test_default_dtype_is_one_the_gpu_has(capsys):
    # The hidden default was bf16, which a T4 lacks: roofline --gpu t4 with no --dtype failed.
    data = _json(capsys, ["roofline", "--gpu", "t4", "--json"])
    assert data["dtype"] == "fp16"
    assert _json(capsys, ["roofline", "--gpu", "h100", "--json"])["dtype"] == "bf16"
    data = _json(capsys, ["mfu", "--gpu", "t4", "--ms", "1", "--flops", "65e9", "--json"])
    assert round(data["mfu"], 3) == 1.0


@pytest.mark.parametrize("ms", ["0", "-1", "inf", "nan"])
def test_mfu_time_must_be_finite_and_positive(capsys, ms):
    # --ms inf was accepted and gave an MFU of 0.
    with pytest.raises(SystemExit) as exit_info:
        main(["mfu", "--gpu", "h100", "--ms", ms, "--flops", "1e12"])
    assert exit_info.value.code == 2
    assert "argument --ms: expected a finite number > 0" in capsys.readouterr().err


def test_mfu_above_peak_warns(capsys):
    # 5e11 FLOPs in 0.01 ms on an H100 is 5,054% of its dense peak: printed with no warning before.
    assert main(["mfu", "--gpu", "h100", "--ms", "0.01", "--flops", "5e11", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["mfu"] > 50  # the figure is kept, with the warning beside it
    assert "warning: MFU 5054% is above 100%: --ms 0.01 is below the 0.5054 ms" in captured.err
    argv = ["mfu", "--gpu", "h100", "--model", "llama-3-8b", "--gpus", "8", "--json", "--tokens-per-second"]
    assert main([*argv, "400000"]) == 0
    assert "warning: MFU 346% is above 100%: --tokens-per-second 400000" in capsys.readouterr().err
    assert main([*argv, "64000"]) == 0 and capsys.readouterr().err == ""
    assert main(["mfu", "--gpu", "h100", "--ms", "0.5", "--gemm", "4096,4096,4096"]) == 0
    assert capsys.readouterr().err == ""


def test_waves_seed_001(capsys):
    data = _json(capsys, ["waves", "--gpu", "a100", "--gemm", f"{109 * 128},128,64", "--json"])
    assert (data["tiles"], data["waves"], data["sm_count"]) == (109, 2, 108)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["roofline", "--gpu", "v100"], "valid ids: a100-sxm-80gb"),
        (["roofline", "--gpu", "h100", "--flops", "10"], "--flops and --bytes go together"),
        (["roofline", "--gpu", "h100", "--gemm", "8,8,8", "--attention", "1,1,8,8"], "only one of"),
        (["gpus", "--show", "tpu"], "valid ids"),
        (["roofline", "--gpu", "h100", "--flops", "-1", "--bytes", "2"], "argument --flops: expected a"),
        (["roofline", "--gpu", "a100", "--dtype", "fp8"], "^llm-speed roofline: error: --dtype fp8:"),
        (["mfu", "--gpu", "t4", "--ms", "1", "--flops", "1e9", "--dtype", "bf16"], "--dtype bf16: .*fp16"),
        (["vram", "--seq-len", "-5", "--num-heads", "8", "--head-dim", "64"], "--seq-len: expected a pos"),
        (
            ["vram", "--seq-len", "64", "--num-heads", "8", "--head-dim", "64", "--num-kv-heads", "3"],
            "--num-kv-heads 3 must divide --num-heads 8; valid: 1, 2, 4, 8",
        ),
        (["mfu", "--gpu", "h100", "--ms", "1"], "give --flops"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, argv, message):
    assert exit_code(argv) == 2
    assert re.search(message, one_error_line(capsys.readouterr().err))
