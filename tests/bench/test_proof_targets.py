"""benchmarks/proof_targets.py: issue 74's target table from a proof run's JSON, and its place at the end of
the proof's summary (benchmarks/suite_summary.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import gpu_bench  # noqa: E402 - scripts of benchmarks/, not a package
import proof_targets  # noqa: E402

from llm_speed.cli import main  # noqa: E402


def _write(raw: Path, name: str, rows: list[dict]) -> None:
    (raw / name).write_text(json.dumps({"results": rows}))


def _timed(impl: str, ms: float, case: str = "seq=16384", **extra) -> dict:
    return {"case": case, "impl": impl, "available": True, "timing": {"median_ms": ms}, **extra}


def test_every_file_it_reads_is_one_the_proof_writes():
    written = {"fused_kernel_time.json"}  # run_gpu_suite.sh's headline_fused writes it (below)
    assert '--output "$RAW/fused_kernel_time.json"' in (REPO / "benchmarks" / "run_gpu_suite.sh").read_text()
    for name in gpu_bench.PROOF_SETS:
        for line in gpu_bench.proof_lines(name, "OUT"):
            written |= set(re.findall(r"--output OUT/(\S+\.json)", line))
    assert proof_targets.files_read() <= written, proof_targets.files_read() - written


def _attention(raw: Path, *, flash_fwd: float, cudnn_fwd: float, flash_both: float, cudnn_both: float):
    _write(raw, "attn_d128_fwd_full_mha_s16384.json", [
        _timed("flash", flash_fwd, tflops=650.0 * 1.0 / flash_fwd, fastest_other="sdpa-cudnn",
               speedup_vs_fastest_other=cudnn_fwd / flash_fwd),
        _timed("sdpa-cudnn", cudnn_fwd),
    ])  # fmt: skip
    _write(raw, "attn_d128_fwd_bwd_full_mha_s16384.json", [
        _timed("flash", flash_both), _timed("sdpa-cudnn", cudnn_both),
    ])  # fmt: skip


def test_attention_rows_hold_fail_or_say_what_was_not_measured(tmp_path):
    # forward 1.0 ms at 650 TFLOP/s, cuDNN 1.1 ms; backward (fwd+bwd - fwd) 2.5 ms against cuDNN's 2.5
    _attention(tmp_path, flash_fwd=1.0, cudnn_fwd=1.1, flash_both=3.5, cudnn_both=3.6)
    rows = {row.what: row for row in proof_targets.table(tmp_path)}
    forward = rows["attention forward, d=128, 16k tokens, non-causal"]
    assert forward.holds is True and "650 TFLOP/s, 1.10x cuDNN" in forward.measured
    backward = rows["attention backward, d=128, 16k"]
    # 2.5 x the forward's FLOPs (650 TFLOP/s x 1 ms) in 2.5 ms: 650 TFLOP/s; cuDNN's backward 2.5 ms too
    assert backward.holds is True and "650 TFLOP/s, 1.00x cuDNN" in backward.measured
    # one point of nine measured, above 1x: not every point, so not "yes"
    points = rows["attention forward, every point (d 64/128, seq 512-16k, causal or not, MHA/GQA)"]
    assert points.holds is None and "1 of 9 points" in points.measured
    # slower than cuDNN: the measured part fails the row
    _attention(tmp_path, flash_fwd=1.2, cudnn_fwd=1.0, flash_both=4.0, cudnn_both=3.0)
    rows = {row.what: row for row in proof_targets.table(tmp_path)}
    assert rows["attention forward, d=128, 16k tokens, non-causal"].holds is False
    assert rows["attention backward, d=128, 16k"].holds is False
    every = "attention forward, every point (d 64/128, seq 512-16k, causal or not, MHA/GQA)"
    assert rows[every].holds is False
    # a row whose files the run did not write says so and holds nothing
    guide = rows["attention forward + backward, guide's points (b2 h8 d64 fp16)"]
    assert guide.holds is None and guide.measured.startswith("not measured (no attn_d64_fwd_bwd_s512.json")


def test_gemm_geomean_and_lowest_shape(tmp_path):
    names = [f"gemm_bf16_{size}.json" for size in proof_targets.GEMM_SQUARES]
    names += [f"gemm_bf16_llama3_8b_m{tokens}.json" for tokens in proof_targets.GEMM_TOKENS]
    for name in names:  # ours 1.0 ms against torch's 1.0 everywhere, one shape at 0.8x
        slow = name == "gemm_bf16_512.json"
        _write(tmp_path, name, [_timed("llm-speed", 1.25 if slow else 1.0, case="c"),
                                _timed("torch", 1.0, case="c")])  # fmt: skip
    (row,) = [r for r in proof_targets.table(tmp_path) if r.what.startswith("bf16 GEMM")]
    assert row.holds is False and "lowest 0.80x (gemm_bf16_512 c)" in row.measured
    _write(tmp_path, "gemm_bf16_512.json", [_timed(impl, 1.0, case="c") for impl in ("llm-speed", "torch")])
    (row,) = [r for r in proof_targets.table(tmp_path) if r.what.startswith("bf16 GEMM")]
    assert row.holds is True and "geomean 1.00x" in row.measured and "8 shapes" in row.measured
    (tmp_path / "gemm_bf16_8192.json").unlink()  # a cut run: the geomean is not judged
    (row,) = [r for r in proof_targets.table(tmp_path) if r.what.startswith("bf16 GEMM")]
    assert row.holds is None and "not measured: gemm_bf16_8192.json" in row.measured


def test_decode_fused_ce_and_train_step_rows(tmp_path):
    for batch, ours in ((1, 0.02), (8, 0.03)):
        rows = [_timed(impl, ours, case="c", graph_ms=0.01) for impl in ("kvcache", "kvcache-paged")]
        _write(tmp_path, f"decode_bf16_b{batch}_c4096.json", [*rows, _timed("sdpa", 0.03, case="c")])
    _write(tmp_path, "fused_kernel_time.json", [
        {"op": op, "impl": impl, "available": True, "wall_ms": ms, "kernel_gbps": 2500.0}
        for op in proof_targets.FUSED_OPS for impl, ms in (("llm_speed", 1.0), ("torch.compile", 1.2))
    ])  # fmt: skip
    _write(tmp_path, "linear_cross_entropy.json", [
        _timed("llm_speed", 40.0, peak_memory_bytes=1), _timed("torch.compile", 38.0, peak_memory_bytes=9),
        _timed("eager", 60.0, peak_memory_bytes=5),
    ])  # fmt: skip
    _write(tmp_path, "train_step_llama3_8b_2layers.json", [
        _timed("llm_speed", 20.0, peak_memory_bytes=5), _timed("transformers", 28.0, peak_memory_bytes=10),
    ])  # fmt: skip
    rows = {row.what: row for row in proof_targets.table(tmp_path)}
    decode = rows["decode, batch 1-8"]
    assert decode.holds is True and "1.00-1.50x over 4 of 4 points" in decode.measured
    assert "b1 kvcache 10.0 us" in decode.measured
    fused = rows["rms_norm, rotary, swiglu fwd+bwd at kernel-dominated sizes"]
    # faster than torch.compile; Liger not run and the copy bandwidth not measured: "-", not "yes"
    assert fused.holds is None and "rms_norm 2500 GB/s (kernel), 1.20x torch.compile" in fused.measured
    assert fused.measured.endswith("(copy not measured, kernel time)")
    ce = rows["linear cross-entropy, V 128256, N 8192, H 4096"]
    assert ce.holds is False and "0.95x torch.compile; peak 0.200 of eager's" in ce.measured
    step = rows["train step, llama-3-8b 2 layers"]
    assert step.holds is None and "1.40x transformers, not measured Liger, peak 0.50x" in step.measured


def test_per_call_rows_from_the_bench_steps_overhead_json(tmp_path):
    def overhead(device: str, rows: list[dict]) -> None:
        document = {"environment": {"device_type": device}, "results": rows}
        (tmp_path / "overhead.json").write_text(json.dumps(document))

    def row(case, mode, meets, vs):
        return {"case": case, "mode": mode, "meets_target": meets, "vs_baseline": vs}

    overhead("cuda", [
        row("sdpa", "inference", None, None), row("gemm", "inference", True, 1.0),
        row("rms_norm", "inference", False, 1.5), row("rms_norm", "autograd", True, 1.2),
        row("flash_attn_func", "inference", True, 0.9), row("flash_attn_func", "training", True, 1.05),
    ])  # fmt: skip
    rows = {row.what: row for row in proof_targets.table(tmp_path)}
    calls = rows["per call, tiny problems (inference / autograd / training)"]
    # the wrappers are judged against the entry point, not counted with PyTorch's equivalents
    assert calls.holds is False and calls.measured == "inference 1/2 rows, autograd 1/1 rows meet it"
    wrapped = rows["flash-attn interface wrappers; head dims 80/96/111"]
    assert wrapped.holds is None and "0.90-1.05x over 2 of 2 points" in wrapped.measured  # head dims not run
    assert "head dims d80 not measured, d96 not measured, d111 not measured" in wrapped.measured
    overhead("cuda", [row("flash_attn_func", "autograd", False, 1.3)])
    rows = {row.what: row for row in proof_targets.table(tmp_path)}
    assert rows["flash-attn interface wrappers; head dims 80/96/111"].holds is False
    overhead("cpu", [row("gemm", "inference", True, 1.0)])  # a CPU run judges no GPU target
    rows = {row.what: row for row in proof_targets.table(tmp_path)}
    calls = rows["per call, tiny problems (inference / autograd / training)"]
    assert calls.holds is None and "measured on cpu, not a GPU" in calls.measured


def test_a_real_benchmark_json_reads(tmp_path, monkeypatch):
    """The bench command's own JSON (run on the CPU, tiny), read as the proof's GEMM row reads it."""
    from llm_speed.bench import cpu_budget

    monkeypatch.setattr(cpu_budget, "CALL_SECONDS", 0.002)
    code = main(["bench", "gemm", "--dtype", "bf16", "--sizes", "32x32x32", "--impl", "llm-speed", "torch",
                 "--warmup", "0", "--iterations", "1", "--min-time", "0", "--no-progress", "--device", "cpu",
                 "--output", str(tmp_path / "gemm_bf16_512.json")])  # fmt: skip
    assert code == 0
    (row,) = [r for r in proof_targets.table(tmp_path) if r.what.startswith("bf16 GEMM")]
    assert row.measured.endswith("measured on cpu, not a GPU") and row.holds is None, row  # judges nothing
    path = tmp_path / "gemm_bf16_512.json"  # the same document as a GPU's: its rows are read
    document = json.loads(path.read_text())
    document["environment"]["device_type"] = "cuda"
    path.write_text(json.dumps(document))
    (row,) = [r for r in proof_targets.table(tmp_path) if r.what.startswith("bf16 GEMM")]
    assert "1 shapes" in row.measured and "not measured: gemm_bf16_1024.json" in row.measured, row


def test_the_proof_summary_ends_with_the_targets(tmp_path):
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    out.mkdir()
    (raw / "summary.tsv").write_text("step\tcode\tseconds\tcap\nheadline_gemm\t0\t3\t35\n")
    _attention(raw, flash_fwd=1.0, cudnn_fwd=1.1, flash_both=3.5, cudnn_both=3.6)
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "suite_summary.py"), str(raw), str(out)],
                   check=True, timeout=60)  # fmt: skip
    text = (out / "summary.txt").read_text()
    assert "issue 74's targets" in text and "yes attention forward, d=128, 16k tokens, non-causal" in text
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["targets"]) == 17 and summary["targets"][0]["holds"] is True


@pytest.mark.parametrize("flag", [[], ["--markdown"]])
def test_the_command_prints_the_table(tmp_path, flag, capsys):
    assert proof_targets.main([*flag, str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "train step, llama-3-8b 2 layers" in printed and ("| what |" in printed) == bool(flag)
    with pytest.raises(SystemExit):
        proof_targets.main([str(tmp_path / "missing")])


def test_head_dims_each_against_the_next_multiple_of_16(tmp_path):
    """80 -> 96, 96 -> 112, 111 -> 112, from the proof's attention set; not slower: a median no higher than
    the other's 80th percentile. The wrappers' half (bench overhead) is not in the proof: "-" at best."""
    what = "flash-attn interface wrappers; head dims 80/96/111"

    def hdim(head_dim: int, ms: float, p80: float | None = None) -> None:
        timing = {"median_ms": ms, "p80_ms": p80 if p80 is not None else ms * 1.01}
        _write(tmp_path, f"attn_hdim{head_dim}_fwd_s4096.json", [
            {"case": "seq=4096", "impl": "flash", "available": True, "timing": timing},
            _timed("sdpa-flash", ms * 0.9, case="seq=4096"),  # another implementation's row is not ours
        ])  # fmt: skip

    for head_dim, ms in ((80, 0.30), (96, 0.30), (111, 0.302), (112, 0.30)):
        hdim(head_dim, ms)
    text, holds = proof_targets.head_dims(tmp_path)
    assert holds is True, text  # 111 at 0.302 ms is within 112's spread (p80 0.303)
    assert text == "d80 1.00x d96, d96 1.00x d112, d111 0.99x d112"
    row = {row.what: row for row in proof_targets.table(tmp_path)}[what]
    assert row.holds is None and "head dims d80 1.00x d96" in row.measured  # no overhead.json: wrappers "-"
    hdim(111, 0.40)  # padded and slower than 112 beyond the spread
    text, holds = proof_targets.head_dims(tmp_path)
    assert holds is False and "d111 0.75x d112" in text
    assert {row.what: row for row in proof_targets.table(tmp_path)}[what].holds is False
    (tmp_path / "attn_hdim112_fwd_s4096.json").unlink()  # cut before the last line: 96 and 111 unjudged
    text, holds = proof_targets.head_dims(tmp_path)
    assert holds is None and text == "d80 1.00x d96, d96 not measured, d111 not measured"


def test_a_cpu_run_of_the_suite_judges_no_target(tmp_path):
    """SUITE_ALLOW_CPU=1 writes the same files with CPU times and CPU-scaled sizes: they were judged as if a
    GPU had measured them ("no: 0.34-0.59x"). Rows measured elsewhere than on a GPU say so, "-"."""
    def document(device):
        ours = _timed("flash", 2.0, case="seq=512", fastest_other="sdpa-flash", speedup_vs_fastest_other=0.5)
        rows = [ours, _timed("sdpa-flash", 1.0, case="seq=512")]
        return {"environment": {"device_type": device}, "results": rows}

    what = "attention forward, every point (d 64/128, seq 512-16k, causal or not, MHA/GQA)"
    (tmp_path / "attn_d64_fwd_s512.json").write_text(json.dumps(document("cpu")))
    row = {row.what: row for row in proof_targets.table(tmp_path)}[what]
    assert row.holds is None
    assert row.measured == "attn_d64_fwd_s512.json ... (9 files) measured on cpu, not a GPU"
    (tmp_path / "attn_d64_fwd_s512.json").write_text(json.dumps(document("cuda")))
    row = {row.what: row for row in proof_targets.table(tmp_path)}[what]
    assert row.holds is False and "0.50-0.50x over 1 of 9 points" in row.measured


def test_memory_bound_rows_against_the_copy_the_proof_measured(tmp_path):
    """fused_kernel_time.py measures the device's copy bandwidth first (read + written bytes): the decode at
    batch 64 (its wall GB/s against the copy's wall GB/s) and the fused kernels (kernel GB/s against the
    copy's kernel GB/s) are judged at >= 85% of it; without it they stay "-"."""
    def fused(copy: dict | None, gbps: float) -> None:
        rows = []
        for op in proof_targets.FUSED_OPS:
            rows += [{"op": op, "impl": "llm_speed", "available": True, "wall_ms": 1.0, "kernel_gbps": gbps},
                     {"op": op, "impl": "torch.compile", "available": True, "wall_ms": 1.2},
                     {"op": op, "impl": "liger", "available": True, "wall_ms": 1.1}]  # fmt: skip
        document = {"environment": {"device_type": "cuda"}, "results": rows}
        if copy is not None:
            document["copy"] = copy
        (tmp_path / "fused_kernel_time.json").write_text(json.dumps(document))

    def rows() -> dict:
        return {row.what: row for row in proof_targets.table(tmp_path)}

    fused_what = "rms_norm, rotary, swiglu fwd+bwd at kernel-dominated sizes"
    decode_what = "decode, bf16, batch >= 64 x 4k, dense and 16-token pages"
    _write(tmp_path, "decode_bf16_b64_c4096.json", [
        {"case": "b64", "impl": "kvcache", "available": True, "timing": {"median_ms": 1.0},
         "bandwidth_gb_s": 2900},
        {"case": "b64", "impl": "kvcache-paged", "available": True, "timing": {"median_ms": 1.0},
         "bandwidth_gb_s": 2400},
    ])  # fmt: skip
    fused(None, 2800.0)
    assert rows()[fused_what].holds is None and "copy not measured" in rows()[fused_what].measured
    assert rows()[decode_what].holds is None and "kvcache 2900 GB/s;" in rows()[decode_what].measured
    fused({"wall_gbps": 3000.0, "kernel_gbps": 3100.0}, 2800.0)
    assert rows()[fused_what].holds is True, rows()[fused_what]  # 90% of the copy's kernel GB/s, faster
    assert "rms_norm 2800 GB/s, 90% of copy (kernel)" in rows()[fused_what].measured
    decode = rows()[decode_what]
    assert decode.holds is False
    assert "kvcache 2900 GB/s, 97% of copy; kvcache-paged 2400 GB/s, 80% of copy" in decode.measured
    fused({"wall_gbps": 3000.0, "kernel_gbps": 3100.0}, 2500.0)  # 81%: misses however fast against the others
    assert rows()[fused_what].holds is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_copy_bandwidth_is_measured_on_a_gpu():
    import fused_kernel_time  # benchmarks/, on the path above

    copy = fused_kernel_time.measure_copy(torch.device("cuda"), iterations=3, warmup=1, source_bytes=64 << 20)
    assert copy["bytes"] == 128 << 20 and copy["wall_ms"] > 0 and copy["kernel_ms"] > 0
    assert 10 < copy["wall_gbps"] < 20_000 and 10 < copy["kernel_gbps"] < 20_000  # GB/s of any GPU


def test_fp8_attention_and_the_fp8_cache_from_their_own_files(tmp_path):
    """Both were "not measured by the proof"; the proof now times them beside our 16-bit kernels in their
    own files (beside the SDPA rows, an fp8 row would be the 16-bit row's "fastest other")."""
    rows = lambda: {row.what: row for row in proof_targets.table(tmp_path)}  # noqa: E731
    fp8, cache = "fp8 attention forward, d=128 16k", "fp8-cache decode, batch >= 64 x 4k"
    assert rows()[fp8].measured == "not measured (no attn_d128_fp8_fwd_full_mha_s16384.json)"
    assert rows()[cache].holds is None
    _write(tmp_path, "attn_d128_fp8_fwd_full_mha_s16384.json", [
        _timed("flash", 4.0), _timed("flash-fp8", 2.5, vs_flash=1.6, tflops=880.0),
    ])  # fmt: skip
    _write(tmp_path, "decode_fp8_cache_b64_c4096.json", [
        _timed("kvcache", 1.0, case="b64"), _timed("kvcache-fp8", 0.55, case="b64", vs_16bit_cache=1.82),
        _timed("kvcache-paged", 1.1, case="b64"),
        _timed("kvcache-paged-fp8", 0.8, case="b64", vs_16bit_cache=1.38),
    ])  # fmt: skip
    assert rows()[fp8].holds is True and rows()[fp8].measured == "1.60x our bf16 forward (880 TFLOP/s)"
    assert rows()[cache].holds is False  # the paged fp8 cache misses 1.7x
    assert rows()[cache].measured == "kvcache-fp8 1.82x, kvcache-paged-fp8 1.38x the 16-bit cache (batch 64)"
    assert len(proof_targets.table(tmp_path)) == 17


def test_values_that_are_not_finite_numbers_are_not_measured(tmp_path):
    """NaN compares False both ways: a NaN ratio passed `< 1.0` and read "yes ... nan-nanx" (audit 10, M3);
    a negative or string median crashed the geomean (math.log). Each is a part not measured, "-"."""
    nan, inf = float("nan"), float("inf")
    every = "attention forward, every point (d 64/128, seq 512-16k, causal or not, MHA/GQA)"
    names = [f"attn_d64_fwd_s{seq}.json" for seq in proof_targets.GUIDE_SEQS]
    names += [f"attn_d128_fwd_{label}_s16384.json" for label in proof_targets.D128_LABELS]
    for name in names:  # every point 1.2x but one NaN
        speedup = nan if name == names[0] else 1.2
        _write(tmp_path, name, [_timed("flash", 1.0, speedup_vs_fastest_other=speedup, tflops=700.0),
                                _timed("sdpa-cudnn", 1.2)])  # fmt: skip
    rows = {row.what: row for row in proof_targets.table(tmp_path)}
    assert rows[every].holds is None and "1.20-1.20x over 8 of 9 points" in rows[every].measured
    forward = "attention forward, d=128, 16k tokens, non-causal"
    for cudnn, tflops in ((nan, 700.0), (inf, nan), ("1.2", 700.0), (-1.0, 700.0)):
        _write(tmp_path, "attn_d128_fwd_full_mha_s16384.json",
               [_timed("flash", 1.0, tflops=tflops), _timed("sdpa-cudnn", cudnn)])  # fmt: skip
        row = {row.what: row for row in proof_targets.table(tmp_path)}[forward]
        assert row.holds is None and "not measured cuDNN" in row.measured and "nan" not in row.measured, row
    for ours in (nan, -0.01, "0.01", None):  # the geomean's log never sees them
        rows = [_timed("llm-speed", ours, case="c"), _timed("torch", 0.01, case="c")]
        _write(tmp_path, "gemm_bf16_512.json", rows)
        (row,) = [r for r in proof_targets.table(tmp_path) if r.what.startswith("bf16 GEMM")]
        assert row.holds is None and row.measured == "not measured", row


def test_a_file_cut_before_its_last_case_is_named_and_never_yes(tmp_path):
    """The bench commands write ``complete: false`` after every case (true after the last): a file cut
    between cases is judged on the cases it has (a failing one still fails), but says so, and is never "yes"
    (audit 10, M11)."""
    what = "fp8 attention forward, d=128 16k"
    name = "attn_d128_fp8_fwd_full_mha_s16384.json"
    for vs_flash, complete, holds in ((1.6, True, True), (1.6, False, None), (1.2, False, False)):
        rows = [_timed("flash", 4.0), _timed("flash-fp8", 2.5, vs_flash=vs_flash, tflops=880.0)]
        (tmp_path / name).write_text(json.dumps({"results": rows, "complete": complete}))
        row = {row.what: row for row in proof_targets.table(tmp_path)}[what]
        assert row.holds is holds, row
        assert ("partial file: cut before its last case (" + name + ")" in row.measured) == (not complete)
