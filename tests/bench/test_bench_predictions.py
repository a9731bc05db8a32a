"""Every ``bench`` puts the calibrated prediction (llm_speed.perf.predict) and its error beside each measured
time. A CPU run has no GPU to predict for, so these tests make the benches believe they run on an H100 (the
times are the CPU's: the errors are meaningless, their presence and arithmetic are what is checked)."""

import importlib
import json

import pytest

from llm_speed.bench import report
from llm_speed.cli import main
from llm_speed.core.gpus import get_gpu
from llm_speed.perf.predict import predict

TIMING = ["--warmup", "0", "--iterations", "1", "--no-progress"]
BENCHES = {
    "gemm": ["--sizes", "16x16x16", "--min-time", "0"],
    "attention": [
        "--seq-lengths",
        "16",
        "--num-heads",
        "2",
        "--head-dim",
        "16",
        "--impl",
        "flash",
        "sdpa",
        "--min-time",
        "0",
    ],  # fmt: skip
    "decode": [
        "--batch-sizes",
        "2",
        "--contexts",
        "20",
        "--num-heads",
        "4",
        "--num-kv-heads",
        "2",
        "--head-dim",
        "16",
    ],  # fmt: skip
    "ops": [
        "--tokens",
        "3",
        "--hidden",
        "40",
        "--intermediate",
        "24",
        "--num-heads",
        "2",
        "--num-kv-heads",
        "1",
        "--head-dim",
        "16",
        "--vocab",
        "50",
        "--dtype",
        "fp32",
        "--impl",
        "llm_speed",
        "eager",
    ],  # fmt: skip
    "moe": [
        "--tokens",
        "5",
        "--experts",
        "4",
        "--top-k",
        "2",
        "--hidden",
        "16",
        "--intermediate",
        "16",
        "--dtype",
        "fp32",
        "--impl",
        "llm_speed",
        "grouped_mm",
        "hf-loop",
    ],  # fmt: skip
}
# Implementations the model does not cover (no prediction cell, by design).
NOT_MODELLED = {"hf-loop"}


@pytest.fixture
def on_h100(monkeypatch):
    monkeypatch.setattr(report, "prediction_gpu", lambda device: (get_gpu("h100-sxm"), None))
    monkeypatch.setenv("COLUMNS", "400")  # rich: no wrapped header cells


@pytest.mark.parametrize("bench", sorted(BENCHES))
def test_every_measured_row_has_its_prediction_and_error(bench, on_h100, capsys, device):
    # on the device fixture's device: the CPU runs Triton-only rows (decode's caches) under the interpreter
    # only, which a GPU machine's test run does not set
    assert main(["bench", bench, "--device", device.type, *BENCHES[bench], *TIMING, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert rows
    for row in rows:
        assert row["available"], row["reason"]
        if row["impl"] in NOT_MODELLED:
            assert row["prediction_ms"] is None and row["prediction_error"] is None
            continue
        assert row["prediction_ms"] > 0 and row["prediction_bound"] in ("compute", "memory", "latency"), row
        measured = row["timing"]["median_ms"]
        assert row["prediction_error"] == pytest.approx(row["prediction_ms"] / measured - 1.0)
        assert isinstance(row["prediction_calibrated"], bool)


def test_the_table_prints_them(on_h100, capsys):
    assert main(["bench", "gemm", "--device", "cpu", *BENCHES["gemm"], *TIMING]) == 0
    text = capsys.readouterr().out
    assert "predicted ms (bound)" in text and "prediction error" in text
    cublas = predict("gemm", "h100-sxm", implementation="cublas", dtype="fp32", m=16, n=16, k=16)
    assert f"{cublas.milliseconds:.3g} ({cublas.bound})" in text


def test_the_gemm_prediction_is_the_models(on_h100, capsys):
    assert main(["bench", "gemm", "--device", "cpu", *BENCHES["gemm"], *TIMING, "--json"]) == 0
    rows = {r["impl"]: r for r in json.loads(capsys.readouterr().out)["results"]}
    for impl, name in (("torch", "cublas"), ("llm-speed", "llm-speed")):
        expected = predict("gemm", "h100-sxm", implementation=name, dtype="fp32", m=16, n=16, k=16)
        assert rows[impl]["prediction_ms"] == pytest.approx(expected.milliseconds)


@pytest.mark.parametrize("layout", ["NN", "NT"])
def test_the_fp8_gemm_prediction_takes_the_rows_scaling_and_layout(layout, on_h100, capsys, monkeypatch):
    """An fp8 file's rows are predicted at their own granularity and the run's layout (gemm_fp8's model:
    block scaling its own kernel, a b that is not K-major copied first), bf16 torch.matmul as a bf16 GEMM."""
    predict_module = importlib.import_module("llm_speed.perf.predict")  # the package exports the function
    asked = []

    def spy(op, gpu, **kwargs):
        asked.append((op, kwargs.get("implementation"), kwargs.get("scaling"), kwargs.get("layout")))
        return predict(op, gpu, **kwargs)

    monkeypatch.setattr(predict_module, "predict", spy)
    args = ["--dtype", "fp8", "--sizes", "32x32x128", "--layout", layout, "--min-time", "0"]
    assert main(["bench", "gemm", "--device", "cpu", *args, *TIMING, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    ours = {r["case"].split()[-1]: r for r in rows if r["impl"] == "llm-speed"}
    assert set(ours) == {"tensor", "row", "block"}
    assert {("gemm_fp8", "llm-speed", s, layout) for s in ours} <= set(asked)
    for scaling, row in ours.items():
        expected = predict("gemm_fp8", "h100-sxm", m=32, n=32, k=128, scaling=scaling, layout=layout)
        assert row["prediction_ms"] == pytest.approx(expected.milliseconds)
        assert row["prediction_calibrated"] == expected.calibrated == (scaling != "block")
    bf16 = next(r for r in rows if r["impl"] == "torch")
    expected = predict("gemm", "h100-sxm", implementation="cublas", dtype="bf16", m=32, n=32, k=128)
    assert bf16["prediction_ms"] == pytest.approx(expected.milliseconds)
