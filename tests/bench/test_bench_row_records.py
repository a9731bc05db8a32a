"""Audit 14's findings on the bench rows: each row priced in its own dtype and by its own implementation's
bytes, the CSV replaced whole, decode's ratio cells, the CPU plot's predictions, no always-null JSON fields,
MoE bytes from the run's routing. Tiny sizes on the CPU (Triton's interpreter where a kernel runs)."""

import csv
import io
import json

import pytest
import torch
from rich.console import Console

from llm_speed.bench import attention as attention_bench
from llm_speed.bench import decode as decode_bench
from llm_speed.bench import gemm as gemm_bench
from llm_speed.bench import moe as moe_bench
from llm_speed.bench import plots, report
from llm_speed.bench.timing import HOST_TIMER, summarize
from llm_speed.cli import main
from llm_speed.core.gpus import get_gpu
from llm_speed.perf.kernel_costs import attention_cost, gemm_cost
from llm_speed.perf.roofline import roofline

H100 = get_gpu("h100-sxm")


@pytest.fixture
def on_h100(monkeypatch):
    monkeypatch.setattr(report, "prediction_gpu", lambda device: (H100, None))


def _floor_ms(cost, dtype) -> float:
    return roofline(cost.flops, cost.bytes_moved, dtype, H100).time_floor_s * 1e3


# --- #1: the floor, FLOPs and bytes of a row are of its own dtype ------------------------------------------


def test_the_floor_takes_each_rows_own_dtype():
    c8 = gemm_cost(4096, 4096, 4096, dtype="fp8", out_dtype="bf16")
    cb = gemm_cost(4096, 4096, 4096, dtype="bf16")
    bf16 = report.Measurement(case="x", impl="torch", dtype="bf16", available=True, flops=cb.flops,
                              bytes_moved=cb.bytes_moved)  # fmt: skip
    fp8 = report.Measurement(case="x", impl="flash-fp8", dtype="fp8", available=True, flops=c8.flops,
                             bytes_moved=c8.bytes_moved)  # fmt: skip
    plain = report.Measurement(case="x", impl="llm-speed", available=True, flops=c8.flops,
                               bytes_moved=c8.bytes_moved)  # fmt: skip
    report.add_comparisons([bf16], H100, "fp8", None)  # a bf16 row of an fp8 run: bf16's peak
    report.add_comparisons([fp8], H100, "bf16", None)  # an fp8 row of a bf16 run: fp8's peak
    report.add_comparisons([plain], H100, "fp8", None)  # no dtype of its own: the run's, recorded
    assert bf16.predicted_ms == pytest.approx(_floor_ms(cb, "bf16"))  # 0.139 ms, not fp8's 0.0695
    assert fp8.predicted_ms == pytest.approx(_floor_ms(c8, "fp8"))
    assert plain.predicted_ms == pytest.approx(_floor_ms(c8, "fp8")) and plain.dtype == "fp8"


def test_an_fp8_gemm_runs_torch_row_is_a_bf16_gemm(on_h100):
    """``bench gemm --dtype fp8``'s torch row, a bf16 torch.matmul: bf16 operands and output (24576 B at 64^3,
    not fp8's 16384), floored at bf16's peak; with a bias, the separate ``+ bias`` pass too."""
    for epilogue, extra in (("none", 0), ("bias", 2 * 64 * 64 * 2 + 64 * 2)):
        settings = gemm_bench.GemmSettings(
            cases=(gemm_bench.GemmCase("", 64, 64, 64),), dtype="fp8", layout="NT", epilogue=epilogue,
            impls=("torch",), warmup=0, iterations=1, device="cpu",
        )  # fmt: skip
        rows = gemm_bench.run_gemm(settings, show_progress=False)
        assert [row.case.split()[-1] for row in rows] == list(gemm_bench.FP8_GRANULARITIES)
        bf16 = gemm_cost(64, 64, 64, dtype="bf16")
        assert bf16.bytes_moved == 24576
        for row in rows:
            assert row.available, row.reason
            assert (row.dtype, row.flops, row.bytes_moved) == ("bf16", bf16.flops, bf16.bytes_moved + extra)
            assert row.predicted_ms == pytest.approx(_floor_ms(row, "bf16"))


def test_the_torch_rows_epilogue_is_counted_as_the_separate_passes_it_makes():
    """``torch.matmul(a, b) + bias`` then gelu: the product written, read and written by the add (the bias
    read once), read and written by the activation; llm_speed.gemm reads the bias in its epilogue."""
    m, n, k, e = 16, 24, 32, 4
    settings = gemm_bench.GemmSettings(
        cases=(gemm_bench.GemmCase("", m, n, k),), dtype="fp32", layout="NN", epilogue="bias+gelu",
        impls=("llm-speed", "torch"), warmup=0, iterations=1, device="cpu",
    )  # fmt: skip
    ours, torch_row = gemm_bench.run_gemm(settings, show_progress=False)
    gemm = (m * k + k * n + m * n) * e
    assert ours.bytes_moved == gemm + n * e
    assert torch_row.bytes_moved == gemm + (2 * m * n * e + n * e) + 2 * m * n * e
    assert ours.flops == torch_row.flops == 2 * m * n * k
    assert ours.available and torch_row.available, (ours.reason, torch_row.reason)


def test_an_fp8_attention_row_of_a_16bit_run_is_floored_at_fp8s_peak(on_h100):
    # compute-bound (8k tokens, d=128), where the peak decides the floor; refused before any work (fwd+bwd)
    settings = attention_bench.AttentionSettings(
        seq_lengths=(8192,), batch_size=1, num_heads=2, num_kv_heads=1, head_dim=128, dtype="bf16",
        causal=True, mode="fwd+bwd", impls=("flash-fp8",), warmup=0, iterations=1, device="cpu",
    )  # fmt: skip
    (row,) = attention_bench.run_attention(settings, show_progress=False)
    assert not row.available
    cost = attention_cost(1, 2, 8192, 8192, 128, heads_kv=1, dtype="fp8", causal=True, mode="fwd+bwd",
                          impl="flash", out_dtype="bf16")  # fmt: skip
    assert (row.dtype, row.bytes_moved, row.predicted_bound) == ("fp8", cost.bytes_moved, "compute")
    assert row.predicted_ms == pytest.approx(_floor_ms(cost, "fp8"))  # half bf16's floor


# --- #11: the CSV is replaced whole ------------------------------------------------------------------------


def _rows(count: int) -> list[report.Measurement]:
    return [report.Measurement(case=f"c{i}", impl="x", available=True, flops=1.0, bytes_moved=1.0,
                               timing=summarize([1.0], HOST_TIMER)) for i in range(count)]  # fmt: skip


def test_a_csv_write_cut_short_keeps_the_previous_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "rows.csv"
    report.write_csv(_rows(2), path)
    before = path.read_bytes()

    def cut(self, rows):
        raise KeyboardInterrupt  # an interrupt in the middle of the rewrite

    monkeypatch.setattr(csv.DictWriter, "writerows", cut)
    with pytest.raises(KeyboardInterrupt):
        report.write_csv(_rows(3), path)
    assert path.read_bytes() == before  # it was truncated to the header by an in-place write
    assert [p.name for p in tmp_path.iterdir()] == ["rows.csv"]  # no temporary file left behind
    monkeypatch.undo()
    report.write_csv(_rows(3), path)
    with path.open(newline="") as handle:
        assert [r["case"] for r in csv.DictReader(handle)] == ["c0", "c1", "c2"]


# --- #14: decode's ratio cells ----------------------------------------------------------------------------


def test_decode_ratio_cells_keep_three_significant_digits():
    settings = decode_bench.DecodeSettings(
        batch_sizes=(1,), contexts=(16,), num_heads=2, num_kv_heads=1, head_dim=16, dtype="fp32",
        page_size=16, impls=("kvcache-fp8",), warmup=0, iterations=1, device="cpu",
    )  # fmt: skip
    row = decode_bench.DecodeMeasurement(
        case="c", impl="kvcache-fp8", available=True, batch=1, context=16, flops=1.0, bytes_moved=1.0,
        timing=summarize([1.0], HOST_TIMER), vs_sdpa=0.000318, vs_16bit_cache=0.0123,
    )  # fmt: skip
    console = Console(record=True, width=400)
    decode_bench.print_decode(settings, [row], console)
    text = console.export_text()
    assert "0.000318x" in text and "0.0123x" in text and "0.00x" not in text
    # attention's fp8-vs-flash column alike
    attention = attention_bench.AttentionSettings(
        seq_lengths=(16,), batch_size=1, num_heads=1, num_kv_heads=1, head_dim=16, dtype="fp32", causal=True,
        mode="fwd", impls=("flash-fp8",), warmup=0, iterations=1, device="cpu",
    )  # fmt: skip
    fp8 = attention_bench.AttentionMeasurement(
        case="seq=16", impl="flash-fp8", available=True, seq_len=16, flops=1.0, bytes_moved=1.0,
        timing=summarize([1.0], HOST_TIMER), vs_flash=0.00123,
    )  # fmt: skip
    console = Console(record=True, width=400)
    attention_bench.print_attention(attention, [fp8], console)
    text = console.export_text()
    assert "0.00123x" in text and "0.00x" not in text


# --- #17: the CPU plot draws no prediction of a row refused on every device ---------------------------------


def test_the_cpu_plot_leaves_out_a_row_refused_on_every_device(monkeypatch, tmp_path):
    settings = attention_bench.AttentionSettings(
        seq_lengths=(16,), batch_size=1, num_heads=1, num_kv_heads=1, head_dim=16, dtype="fp32", causal=True,
        mode="fwd+bwd", impls=("sdpa-math", "flash-fp8"), warmup=0, iterations=1, device="cpu",
    )  # fmt: skip
    rows = attention_bench.run_attention(settings, show_progress=False)
    math_row, fp8 = rows
    assert math_row.available and not fp8.available and "forward-only" in fp8.reason
    assert fp8.refused_everywhere and not math_row.refused_everywhere
    drawn = []

    def plot_roofline(gpu, points, path, **kwargs):
        drawn.extend(points)

    monkeypatch.setattr("llm_speed.perf.plot.plot_roofline", plot_roofline)
    assert plots.plot_rows(rows, tmp_path / "p.png", device=torch.device("cpu"), dtype="fp32", title="t",
                           console=Console(file=io.StringIO()))  # fmt: skip
    assert [p.label for p in drawn] == ["seq=16 [sdpa-math]"]  # flash-fp8's fp8 point was drawn too
    # internal: not in the JSON row
    assert "refused_everywhere" not in attention_bench.results_payload(settings, rows)["results"][1]


# --- #18 and #12: bench moe's rows ------------------------------------------------------------------------


def test_moe_bytes_count_the_experts_the_measured_routing_hits(capsys):
    argv = (
        "bench moe --tokens 5 --experts 8 --top-k 2 --hidden 16 --intermediate 8 --dtype fp32 --mode fwd "
        "--impl grouped_mm --device cpu --warmup 0 --iterations 1 --no-progress --json"
    ).split()
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["available"], row["reason"]
    case = (5, 8, 2)
    ids = moe_bench.routing(case)[1]
    settings = moe_bench.MoeSettings(
        tokens=(5,), experts=(8,), top_k=(2,), hidden=16, intermediate=8, dtype="fp32", mode="fwd",
        impls=("grouped_mm",), warmup=0, iterations=1, min_time_s=0.0, device="cpu",
    )  # fmt: skip
    # the routing counted is the one the rows are timed with
    assert torch.equal(moe_bench._inputs(case, settings, torch.device("cpu"), False)[4], ids.to(torch.int32))
    hit = ids.unique().numel()
    assert row["experts_hit"] == hit
    tokens, hidden, inter, copies, e = 5, 16, 8, 10, 4
    # hidden read, out written; the hit experts' gate/up and down weights; act and y written and read
    expected = 2 * tokens * hidden * e + hit * 3 * inter * hidden * e + 2 * copies * (inter + hidden) * e
    assert row["bytes_moved"] == expected and float(row["bytes_moved"]).is_integer()
    assert row["dtype"] == "fp32"


# --- #18: decode's rows carry their dtype -------------------------------------------------------------------


def test_decode_rows_carry_the_dtype_they_compute_in(capsys):
    argv = (
        "bench decode --device cpu --batch-sizes 1 --contexts 16 --num-heads 2 --num-kv-heads 1 "
        "--head-dim 16 --impl sdpa --warmup 0 --iterations 1 --no-progress --json"
    ).split()
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["dtype"] == "fp32"
