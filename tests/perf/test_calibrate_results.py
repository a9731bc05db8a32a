"""llm_speed.perf.calibrate on what a GPU run leaves beyond timed kernels: the build a results file names (a
commit whose kernels the calibration describes), the per-call host path of ``llm-speed bench overhead``, rows
that time a forward and its backward together, and the fp8 and int8 GEMM files (checked, never fitted)."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from llm_speed.perf import calibrate, measurements
from llm_speed.perf.predict import build_entry, load_calibration, predict, predict_call

REPO = Path(__file__).resolve().parents[2]
SUITE = REPO / "benchmarks" / "results" / "h100-sxm" / "d1b0227-quick-tests-bench"


def test_a_results_commit_is_the_build_that_names_it():
    """Results of a commit are the build entry of that name (full hash or abbreviated), or the one that lists
    the commit in its ``runs`` (later commits that ran the same kernels and defaults); another commit is
    refused with the known ones listed. "current" runs d1b0227's kernels with today's defaults, so
    d1b0227's measurements are not the current build's."""
    current = build_entry("llm-speed", None)
    measured = build_entry("llm-speed", "d1b0227")
    assert measured is not current and measured["commit"] == current["commit"] == "d1b0227"
    assert build_entry("llm-speed", "d1b022730df471f8fc3e19ed108f4539c5a20740") is measured
    assert build_entry("llm-speed", "2b2a055") is build_entry("llm-speed", "4c378d4eb0b3e9a2") is measured
    assert (measured["attention_backward"], current["attention_backward"]) == ("atomic_dq", "dq_kernel")
    assert measured["attention_tiles"]["backward"]["fp16"]["128"] == [64, 64, 8, 2]
    assert current["host_path_of"] == "0cce093"  # the second 2026-11-25 lease measured this launch path
    second = build_entry("llm-speed", "0cce093")
    assert second is not current and second["commit"] == "d1b0227" and "host_path_of" not in second
    assert build_entry("llm-speed", "5e051eb") is second and build_entry("llm-speed", "f4de76f") is current
    # eafec86 ran 0cce093's build but for gemm_fp8's per-tensor kernel (its wgmma no longer serialized)
    fixed = build_entry("llm-speed", "eafec86")
    assert build_entry("llm-speed", "b9171ef") is fixed and fixed is not second
    assert {key: value for key, value in fixed.items() if key not in ("fp8_gemm", "runs", "source")} == {
        key: value for key, value in second.items() if key not in ("fp8_gemm", "runs", "source")}
    assert (second["fp8_gemm"]["tensor"], fixed["fp8_gemm"]["tensor"]) == ("serialized", "pipelined")
    assert build_entry("llm-speed", "af147ec")["attention_backward"] == "dq_kernel"
    with pytest.raises(ValueError, match=r"build '1234567' of llm-speed is not described; known: current "
                                         r"\(f4de76f\), 0cce093 \(5e051eb\), eafec86 \(b9171ef\), d1b0227 "
                                         r"\(2b2a055, 4c378d4\), af147ec"):  # fmt: skip
        build_entry("llm-speed", "1234567")
    twice = copy.deepcopy(load_calibration())
    twice["builds"]["llm-speed"]["copy"] = dict(twice["builds"]["llm-speed"]["d1b0227"])
    with pytest.raises(ValueError, match="described by several entries"):
        build_entry("llm-speed", "2b2a055", twice)


def test_the_builds_of_2026_11_25_launch_and_run_their_backward():
    """d1b0227 launched causal query blocks longest first at every length and added dQ by atomics at 64x64 x
    8 warps; the current build launches longest first from LPT_MIN_ROWS rows only and computes dQ in its own
    kernel at 64x64 x 4 warps: the A/B runs' "64x64 w4 deterministic" variant."""
    short = dict(batch=4, heads_q=16, seq_q=4096, head_dim=128, dtype="bf16", causal=True)
    current = predict("flash_attention", "h100-sxm", **short)
    assert current.seconds == predict("flash_attention", "h100-sxm", launch_order="row", **short).seconds
    old = predict("flash_attention", "h100-sxm", build="d1b0227", **short)
    assert old.seconds == predict("flash_attention", "h100-sxm", build="d1b0227", launch_order="lpt",
                                  **short).seconds  # fmt: skip
    assert old.seconds != current.seconds
    shape = dict(batch=1, heads_q=16, seq_q=16384, head_dim=128, dtype="fp16")
    ab = dict(backward_config=[64, 64, 4, 2], deterministic=True)
    for causal in (False, True):
        default = predict("flash_attention_backward", "h100-sxm", causal=causal, **shape)
        variant = predict("flash_attention_backward", "h100-sxm", build="4c378d4", causal=causal, **ab,
                          **shape)  # fmt: skip
        assert variant.seconds == pytest.approx(default.seconds)
        atomic = predict("flash_attention_backward", "h100-sxm", build="d1b0227", causal=causal, **shape)
        assert atomic.breakdown.tile == (64, 64, 8, 2) and atomic.breakdown.kernels == 3


def test_atomics_priced_per_dq_element():
    """The atomic path pays ``atomic_s`` per fp32 dQ addition: BM x d per block iteration of the dK/dV
    kernel; the dQ kernel's path pays none."""
    shape = dict(batch=1, heads_q=16, seq_q=16384, head_dim=128, dtype="fp16", build="d1b0227")
    calibration = copy.deepcopy(load_calibration())
    params = calibration["gpus"]["h100-sxm"]["implementations"]["llm-speed"]["attention"]
    with_atomics = predict("flash_attention_backward", "h100-sxm", calibration=calibration, **shape)
    deterministic = predict("flash_attention_backward", "h100-sxm", calibration=calibration,
                            deterministic=True, **shape)  # fmt: skip
    rate = params["atomic_s"]
    params["atomic_s"] = 0.0
    without = predict("flash_attention_backward", "h100-sxm", calibration=calibration, **shape)
    additions = 16 * (16384 // 64) ** 2 * 64 * 128  # block iterations x BM x d
    assert with_atomics.seconds - without.seconds == pytest.approx(additions * rate, rel=1e-6)
    assert predict("flash_attention_backward", "h100-sxm", calibration=calibration, deterministic=True,
                   **shape).seconds == pytest.approx(deterministic.seconds)  # fmt: skip


def test_an_atomic_dq_row_is_the_five_matmul_path_whatever_the_build():
    """attention_ab.py's "atomic-dq" rows force dQ by atomics where the build computes it in its own kernel by
    default (the current one on the H100): the model prices them as the five-matmul path (``atomic_dq``), a
    build whose default it is unchanged; the file's row names say so."""
    shape = dict(batch=1, heads_q=16, seq_q=16384, head_dim=128, dtype="fp16", causal=False)
    default = predict("flash_attention_backward", "h100-sxm", **shape)
    forced = predict("flash_attention_backward", "h100-sxm", atomic_dq=True, **shape)
    assert forced.seconds != default.seconds
    old = dict(shape, build="d1b0227")
    assert predict("flash_attention_backward", "h100-sxm", atomic_dq=True, **old).seconds == pytest.approx(
        predict("flash_attention_backward", "h100-sxm", **old).seconds)
    document = {"results": {f"backward full 1x16384 fp16 shipped {path}": {"median_ms": 12.0}
                            for path in ("atomic-dq", "atomic", "deterministic")}}  # fmt: skip
    document["results"]["backward causal 1x16384 d64 fp16 shipped atomic-dq"] = {"median_ms": 3.0}
    points = measurements.attention_ab_points(document, Path("attention_ab.json"), "h100-sxm", None)
    problems = {p.case.removeprefix("backward full 1x16384 fp16 shipped "): p.problem for p in points}
    assert problems["atomic-dq"].get("atomic_dq") and "deterministic" not in problems["atomic-dq"]
    assert "atomic_dq" not in problems["atomic"] and problems["deterministic"]["deterministic"]
    assert {p["head_dim"] for p in problems.values() if not p["causal"]} == {128}
    d64 = problems["backward causal 1x16384 d64 fp16 shipped atomic-dq"]  # d = 128 unless the row names one
    assert (d64["head_dim"], d64["causal"], d64["atomic_dq"], d64["dtype"]) == (64, True, True, "fp16")


def test_attention_ab_files_as_points_of_the_build_that_ran_them():
    """benchmarks/attention_ab.py's JSON of 2026-11-25 has no environment: its GPU and commit are the bench
    files' beside it (the same GPU call). Each variant is its patch: row order, a backward tile, the dQ
    kernel; cuDNN's rows are sdpa-cudnn's."""
    points = measurements.load_results(REPO / "benchmarks" / "results" / "h100-sxm" / "4c378d4-ab-fp8").points
    by_case = {p.case: p for p in points if p.source.endswith(p.case) and "attention_ab" in p.source}
    assert len(by_case) == 24
    row = by_case["causal fwd 2x8192 row"]
    assert (row.op, row.build, row.problem["launch_order"], row.problem["dtype"]) == (
        "flash_attention", "4c378d4", "row", "bf16")
    assert "launch_order" not in by_case["causal fwd 2x8192 lpt"].problem
    dq = by_case["backward causal 1x16384 fp16 64x64 w4 deterministic"]
    assert (dq.op, dq.problem["backward_config"], dq.problem["deterministic"], dq.problem["causal"]) == (
        "flash_attention_backward", [64, 64, 4, 2], True, True)
    shipped = by_case["backward full 1x16384 fp16 shipped atomic"]
    assert "backward_config" not in shipped.problem and "deterministic" not in shipped.problem
    cudnn = by_case["backward full 1x16384 fp16 sdpa-cudnn"]
    assert (cudnn.implementation, cudnn.build) == ("sdpa-cudnn", None)
    assert all(p.fitted for p in by_case.values())


def test_decode_points_are_their_own_kind():
    """Decode over a KV cache is checked in its own family, fp8 caches apart, never fitted."""
    points = measurements.load_results(SUITE.parent / "2b2a055-ab-fp8-decode").points
    decode = [p for p in points if p.op == "attention_kvcache_fwd"]
    assert decode and not any(p.fitted for p in decode)
    kinds = {p.row or p.source.rsplit(" ", 1)[-1]: measurements.kind_of(p) for p in decode}
    assert kinds["kvcache"] == "attention decode" and kinds["kvcache-paged-fp8"] == "attention decode fp8"


def test_overhead_wall_time_is_the_host_path():
    """Back-to-back calls with one synchronisation: a call costs max(host, device), so where the kernels took
    well under the wall time, the wall time per call is the host path (the kernel hidden under it); a
    backward's is what a training call adds to an inference one; a kernel-bound figure is no host path."""
    rows = [
        {"case": "flash_attention", "mode": "inference", "us_per_call": 40.0, "kernel_us": 3.0},
        {"case": "flash_attention", "mode": "autograd", "us_per_call": 60.0, "kernel_us": 3.0},
        {"case": "flash_attention", "mode": "training", "us_per_call": 150.0, "kernel_us": 20.0},
        {"case": "gemm", "mode": "inference", "us_per_call": 30.0, "kernel_us": 20.0},  # kernel-bound
        {"case": "sdpa", "mode": "inference", "us_per_call": 20.0, "kernel_us": 5.0},
        {"case": "torch.matmul", "mode": "inference", "us_per_call": 18.0, "kernel_us": 2.0},
    ]
    ours, theirs = measurements.overhead_host_s({"results": rows})
    assert ours == pytest.approx({"flash_attention": 40e-6, "flash_attention_backward": 110e-6,
                                  "default": 40e-6})  # fmt: skip
    assert theirs["sdpa"]["default"] == theirs["sdpa"]["flash_attention"] == pytest.approx(20e-6)
    assert theirs["cublas"]["gemm"] == pytest.approx(18e-6)


def test_calibrate_reads_the_host_path_of_the_build_measured(tmp_path):
    """An overhead run on a GPU sets the host table of the build its commit names (ops it did not measure
    keep their values, each op's source named) and the vendors'; a CPU run (simulated launches) sets none."""
    folder = tmp_path / "h100-sxm" / "run"
    folder.mkdir(parents=True)
    (folder / "gemm.json").write_text((SUITE / "gemm_fp16_4096.json").read_text())
    document = json.loads((SUITE / "overhead.json").read_text())
    document["environment"] = dict(document["environment"], git_commit="0cce093")
    (folder / "overhead.json").write_text(json.dumps(document))
    cpu = dict(document, environment=dict(document["environment"], device_type="cpu", gpu_spec_id=None))
    (folder / "overhead-cpu.json").write_text(json.dumps(cpu))
    start = copy.deepcopy(load_calibration())
    host = start["builds"]["llm-speed"]["current"]["host_s"]
    host["flash_attention"] = 1.0
    host["source"] = "a description"
    new = calibrate.calibrate(tmp_path, base=start, iterations=5)
    table = new["builds"]["llm-speed"]["current"]["host_s"]
    assert table["flash_attention"] == pytest.approx(42.52006700005495e-6)
    assert table["gemm"] == table["tensor_core_gemm"] == pytest.approx(31.976287000020424e-6)
    assert table["flash_attention_backward"] == host["flash_attention_backward"]  # not measured on the GPU
    assert "flash_attention_backward" in table["source"]["a description"]
    (measured,) = [ops for origin, ops in table["source"].items() if origin.endswith("run/overhead.json")]
    assert "flash_attention" in measured and "flash_attention_backward" not in measured
    cublas = new["gpus"]["h100-sxm"]["implementations"]["cublas"]["host_s"]
    assert cublas["gemm"] == pytest.approx(18.322234999914144e-6)
    prediction = predict("flash_attention", "h100-sxm", calibration=new, batch=1, heads_q=2, seq_q=16,
                         head_dim=16)  # fmt: skip
    assert prediction.breakdown.host_s == table["flash_attention"]


def test_a_later_run_sets_the_host_path_whatever_its_folder_is_called(tmp_path):
    """Folders are named by commit (benchmarks/results), so their names say nothing of time: the host table
    takes the latest run's figures, by the times their JSON record (the rename of 2026-12-06 had made the
    2026-11-25 morning's run, d1b0227, replace the evening's, 0cce093)."""
    document = json.loads((SUITE / "overhead.json").read_text())
    for name, stamp, scale in (("a-late", "2026-11-25T17:00:00+00:00", 1.0),
                               ("z-early", "2026-11-25T07:00:00+00:00", 3.0)):  # fmt: skip
        folder = tmp_path / "h100-sxm" / name
        folder.mkdir(parents=True)
        rows = [dict(row, us_per_call=row["us_per_call"] * scale) for row in document["results"]]
        environment = dict(document["environment"], timestamp_utc=stamp)
        run = dict(document, results=rows, environment=environment)
        (folder / "overhead.json").write_text(json.dumps(run))
    (tmp_path / "h100-sxm" / "no-time").mkdir()
    (tmp_path / "h100-sxm" / "no-time" / "host_overhead.txt").write_text("")
    order = [path.parent.name for path, _ in measurements._in_run_order(tmp_path)]
    assert order == ["no-time", "z-early", "a-late"]
    results = measurements.load_results(tmp_path)
    late, _ = measurements.overhead_host_s(json.loads((tmp_path / "h100-sxm" / "a-late" / "overhead.json")
                                                      .read_text()))  # fmt: skip
    assert results.build_host_s[document["environment"]["git_commit"][:7]]["flash_attention"] == (
        pytest.approx(late["flash_attention"]))


def test_forward_and_backward_under_one_timer():
    """A fwd+bwd row: device times add, host paths add and overlap the device once (one L2 flush)."""
    shape = dict(batch=2, heads_q=8, seq_q=4096, head_dim=64)
    both = predict_call(("flash_attention", "flash_attention_backward"), "h100-sxm", **shape)
    forward = predict("flash_attention", "h100-sxm", context="graph", **shape)
    backward = predict("flash_attention_backward", "h100-sxm", context="graph", **shape)
    assert both.op == "flash_attention+flash_attention_backward"
    assert both.seconds == pytest.approx(forward.seconds + backward.seconds)  # device-bound at 4k
    assert both.breakdown.host_s == pytest.approx(forward.breakdown.host_s + backward.breakdown.host_s)
    assert both.breakdown.kernels == forward.breakdown.kernels + backward.breakdown.kernels
    ops = ("flash_attention", "flash_attention_backward")
    graph = predict_call(ops, "h100-sxm", context="graph", **shape)
    isolated = predict_call(ops, "h100-sxm", context="isolated", **shape)
    assert isolated.seconds == pytest.approx(graph.seconds + both.breakdown.host_s)


def test_the_suite_files_as_points():
    """2026-11-25: fwd+bwd rows are one point of two ops; tiled, naive and fp8 attention rows say so in their
    label; the fp8 GEMM file's rows are gemm_fp8 (ours) and bf16 torch.matmul; 8-bit, eager and fwd+bwd
    points are checked in their own families and never fitted."""
    points = measurements.load_results(SUITE, gpu="h100-sxm").points
    by_label = {p.label: p for p in points}
    both = by_label["d1b0227-quick-tests-bench/attn_fwd_bwd_fp16_s4096.json: seq=4096 [llm-speed]"]
    assert (both.op, both.then, both.build) == ("flash_attention", "flash_attention_backward", "d1b0227")
    assert measurements.kind_of(both) == "attention fwd+bwd" and not both.fitted
    tiled = by_label["d1b0227-quick-tests-bench/attn_fwd_fp16_s2048.json: seq=2048 [llm-speed tiled]"]
    assert tiled.op == "tiled_attention" and tiled.fitted
    naive = by_label["d1b0227-quick-tests-bench/attn_fwd_fp16_s2048.json: seq=2048 [llm-speed naive]"]
    assert measurements.kind_of(naive) == "eager attention" and not naive.fitted
    fp8 = by_label["d1b0227-quick-tests-bench/attn_fwd_fp16_s2048.json: seq=2048 [llm-speed flash-fp8]"]
    assert (fp8.op, fp8.problem["dtype"], measurements.kind_of(fp8)) == ("flash_attention_fp8", "fp8",
                                                                      "attention fp8")  # fmt: skip
    ours = by_label["d1b0227-quick-tests-bench/gemm_fp8_4096.json: 4096x4096x4096 row [llm-speed]"]
    bf16 = by_label["d1b0227-quick-tests-bench/gemm_fp8_4096.json: 4096x4096x4096 row (bf16) [cublas]"]
    assert (ours.op, ours.problem["dtype"], ours.fitted) == ("gemm_fp8", "fp8", False)
    assert (bf16.op, bf16.problem["dtype"], bf16.fitted) == ("gemm", "bf16", True)
    int8 = by_label["d1b0227-quick-tests-bench/gemm_int8_4096.json: 4096x4096x4096 [cublas]"]
    assert measurements.kind_of(int8) == "gemm int8" and int8.op == "tensor_core_gemm_int8"
    assert not any(p.source.startswith("d1b0227-quick-tests-bench/attn_fwd_bwd") and p.op == "naive_attention"
                   for p in points)  # fmt: skip


def test_h100_results_page_has_the_2026_11_25_summary():
    """docs/h100-results.md holds the exact output of summarize over the 2026-11-25 suite too, and of the
    per-call overhead table of its overhead.json."""
    script = REPO / "benchmarks" / "predict_targets.py"
    spec = importlib.util.spec_from_file_location("predict_targets", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = "\n".join(module.summarize(str(SUITE)))
    # the header's two lines, 16 attention rows (flash and its fp8 forward), 18 GEMM rows
    assert table.count("\n") + 1 == 2 + 16 + 18
    page = (REPO / "docs" / "h100-results.md").read_text()
    assert table in page
    overhead = module.overhead_table(str(SUITE / "overhead.json"))
    assert len(overhead) == 2 + 20 and "\n".join(overhead) in page  # 11 ops inference, 9 with autograd
