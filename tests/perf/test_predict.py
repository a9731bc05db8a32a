"""llm_speed.perf.predict: calibrated predictions for every op-table row, their breakdown, and the accuracy on
the committed H100 measurements (fitted on one split, checked on the other)."""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import pytest

from llm_speed.perf import calibrate, measurements
from llm_speed.perf.predict import (
    BOUNDS,
    NOT_FITTED,
    OPS,
    SDPA_BACKENDS,
    UNMEASURED_OPS,
    UNMODELLED,
    compiled_key,
    elementwise_cost,
    gemm_config_choice,
    implementations,
    launch_order,
    list_schedule,
    load_calibration,
    makespan,
    predict,
    predict_work,
    resolve_implementation,
)

REPO = Path(__file__).resolve().parents[2]
H100 = REPO / "benchmarks" / "results" / "h100-sxm"

# One representative problem per op (every row of llm_speed.ops must have one: see the next test).
PROBLEMS = {
    "gemm": dict(m=4096, n=4096, k=4096),
    "tensor_core_gemm": dict(m=2048, n=4096, k=1024, dtype="fp16"),
    "tensor_core_gemm_int8": dict(m=2048, n=4096, k=4096),
    "gemm_fp8": dict(m=4096, n=4096, k=4096),
    "flash_attention": dict(batch=2, heads_q=16, seq_q=4096, head_dim=128, heads_kv=2, causal=True),
    "flash_attention_fp8": dict(batch=2, heads_q=16, seq_q=4096, head_dim=128, heads_kv=2, causal=True),
    "flash_attention_backward": dict(batch=2, heads_q=16, seq_q=4096, head_dim=128, causal=True),
    "tiled_attention": dict(batch=2, heads_q=16, seq_q=2048, head_dim=64),
    "naive_attention": dict(batch=1, heads_q=8, seq_q=1024, head_dim=64),
    "sdpa_attention": dict(batch=1, heads_q=8, seq_q=1024, head_dim=64),
    "flash_attention_varlen": dict(lengths_q=[100, 2048, 513], heads_q=16, head_dim=128, causal=True),
    "flash_attention_varlen_backward": dict(lengths_q=[100, 2048], heads_q=16, head_dim=128, heads_kv=4),
    "attention_kvcache_fwd": dict(batch=8, heads_q=32, heads_kv=8, seq_kv=4096, head_dim=128),
    "rms_norm": dict(rows=8192, hidden=4096),
    "rms_norm_backward": dict(rows=8192, hidden=4096),
    "swiglu": dict(rows=8192, width=14336),
    "swiglu_backward": dict(rows=8192, width=14336),
    "apply_rotary": dict(batch=1, heads=32, seq=8192, head_dim=128),
    "fused_linear_cross_entropy": dict(tokens=8192, hidden=4096, vocab=128256),
    "fused_linear_cross_entropy_backward": dict(tokens=8192, hidden=4096, vocab=128256),
    "geglu": dict(rows=8192, width=14336),
    "geglu_backward": dict(rows=8192, width=14336),
    "apply_rotary_qk": dict(batch=1, heads_q=32, heads_kv=8, seq=8192, head_dim=128),
    "apply_rotary_qk_backward": dict(batch=1, heads_q=32, heads_kv=8, seq=8192, head_dim=128),
    "cross_entropy": dict(tokens=8192, vocab=128256),
    "cross_entropy_backward": dict(tokens=8192, vocab=128256),
    "moe_route": dict(tokens=8192, experts=64, top_k=8),
    "moe_route_backward": dict(tokens=8192, experts=64, top_k=8),
    "moe_sort": dict(tokens=8192, top_k=8, experts=64),
    "grouped_gemm": dict(tokens=65536, groups=64, n=2048, k=4096),
    "grouped_gemm_backward": dict(tokens=65536, groups=64, n=2048, k=4096),
    "fused_moe": dict(tokens=8192, hidden=4096, intermediate=1408, experts=64, top_k=8),
    "fused_moe_backward": dict(tokens=8192, hidden=4096, intermediate=1408, experts=64, top_k=8),
    "all_reduce": dict(size_bytes=2**30, num_gpus=8),
}


@pytest.fixture(scope="module")
def results():
    return measurements.load_results(H100)


def test_every_op_table_row_has_a_prediction():
    from llm_speed import ops

    # Every row is modelled or listed as not modelled (with the reason the error gives): never silent.
    unlisted = set(ops.names()) - set(OPS) - set(UNMODELLED)
    assert not unlisted, (
        f"op-table rows need a model in llm_speed.perf.predict or an UNMODELLED entry: {unlisted}"
    )
    assert set(PROBLEMS) == set(OPS)
    for op, problem in PROBLEMS.items():
        for implementation in implementations(op):
            prediction = predict(op, "h100-sxm", implementation=implementation, **problem)
            assert prediction.seconds > 0 and prediction.bound in BOUNDS, (op, implementation)
            assert prediction.implementation == implementation
            assert prediction.seconds >= prediction.floor_s * (1 - 1e-9), (op, implementation)
            json.dumps(prediction.to_dict())  # plain JSON values
    for op, reason in UNMODELLED.items():
        with pytest.raises(ValueError, match=f"no prediction for '{op}'.*{reason}"):
            predict(op, "h100-sxm")


def test_rows_without_measurements_say_uncalibrated():
    """Only the 16-bit GEMM and attention kernels and the fp8 GEMM were fitted on the H100: everything else is
    labelled, the other 8-bit kernels measured but not fitted with the reason. The fp8 GEMM's current
    block-scaled kernel has not run on a GPU, so its prediction is labelled too."""
    for op in OPS:
        if op == "all_reduce":
            continue
        prediction = predict(op, "h100-sxm", **PROBLEMS[op])
        measured = op in ("gemm", "tensor_core_gemm", "tensor_core_gemm_int8", "gemm_fp8")
        measured = measured or "attention" in op
        assert prediction.calibrated == (measured and op not in UNMEASURED_OPS and op not in NOT_FITTED), op
        if not prediction.calibrated:
            assert prediction.source.startswith(f"UNCALIBRATED for {op}"), op
        if op in NOT_FITTED:
            assert f"({NOT_FITTED[op]})" in prediction.source
    shape = dict(m=4096, n=4096, k=4096)
    block = predict("gemm_fp8", "h100-sxm", **shape, scaling="block")
    assert not block.calibrated and "alternating column halves (5c18b0d) has not run on a GPU" in block.source
    assert predict("gemm_fp8", "h100-sxm", **shape, scaling="block", build="eafec86").calibrated
    assert predict("gemm_fp8", "h100-sxm", implementation="vendor", **shape, scaling="block").calibrated
    assert not predict("gemm_fp8", "h100-sxm", **shape, layout="NN", build="d1b0227").calibrated
    older = predict("gemm_fp8", "h100-sxm", **shape, build="af147ec")  # before any fp8 kernel was measured
    assert not older.calibrated and "does not say which fp8 GEMM kernels it ran" in older.source


def test_an_unknown_row_names_the_modelled_ones():
    with pytest.raises(ValueError, match="no prediction for 'mla_attention'; modelled: gemm, .*all_reduce"):
        predict("mla_attention", "h100-sxm")


def test_implementation_names():
    assert resolve_implementation("gemm", "vendor") == "cublas"
    assert resolve_implementation("gemm", "torch") == "cublas"
    assert resolve_implementation("flash_attention", "vendor") == "sdpa-flash"
    assert resolve_implementation("flash_attention", "flash") == "llm-speed"
    assert resolve_implementation("rms_norm", "vendor") == "pytorch"
    assert resolve_implementation("all_reduce", "vendor") == "nvls"
    with pytest.raises(ValueError, match="accepted: llm-speed, sdpa-flash"):
        resolve_implementation("flash_attention", "cublas")
    with pytest.raises(ValueError, match="no prediction for 'softmax'.*predict_work"):
        predict("softmax", "h100-sxm")
    with pytest.raises(ValueError, match="unknown problem argument"):
        predict("gemm", "h100-sxm", m=1, n=1, k=1, q=3)
    with pytest.raises(ValueError, match="context"):
        predict("gemm", "h100-sxm", context="warm", m=1, n=1, k=1)
    for op in OPS:  # a missing argument names itself, whatever the row
        if op != "all_reduce":
            with pytest.raises(ValueError, match=f"{op}: missing problem argument"):
                predict(op, "h100-sxm")
    with pytest.raises(ValueError, match="m must be a positive int"):
        predict("gemm", "h100-sxm", m=0, n=1, k=1)


def test_gemm_breakdown_names_the_bound_and_the_waves():
    big = predict("gemm", "h100-sxm", implementation="cublas", m=8192, n=8192, k=8192)
    assert big.bound == "compute"
    b = big.breakdown
    # 8192^2 in 128x256 tiles: 2048 tiles, 15.5 waves on 132 SMs, the last one 52% full.
    assert b.tile[:2] == (128, 256) and b.programs == 2048 and b.waves == pytest.approx(2048 / 132)
    assert b.wave_efficiency == pytest.approx(2048 / (16 * 132), rel=1e-6)
    assert 0.5 < b.tensor_core_efficiency < 0.8
    assert big.seconds == pytest.approx(b.latency_s + b.compute_s)
    # A decode GEMV streams its weights: memory-bound near the measured copy bandwidth.
    gemv = predict("gemm", "h100-sxm", implementation="cublas", m=1, n=57344, k=8192)
    assert gemv.bound == "memory"
    assert 2.5e12 < gemv.breakdown.achievable_bandwidth <= 3.0e12
    assert gemv.floor_s < gemv.seconds < 1.4 * gemv.floor_s


def test_fixed_cost_and_context():
    """The host path shows where it outlasts what hides it: the L2 flush under bench timing, the device time
    back to back; added in isolation; gone under CUDA-graph replay."""
    problem = dict(m=512, n=512, k=512)
    old = predict("gemm", "h100-sxm", build="af147ec", **problem)
    assert old.bound == "latency"
    flush = 2 * 50e6 / 3.0e12  # 2 x L2 written at the measured copy rate
    assert old.breakdown.host_exposed_s == pytest.approx(218e-6 - 104857600 / 3.0002e12, rel=1e-3)
    assert old.seconds == pytest.approx(old.breakdown.host_exposed_s)
    assert flush > 0
    seconds = {c: predict("gemm", "h100-sxm", implementation="cublas", context=c, **problem).seconds
               for c in ("graph", "bench", "stream", "isolated")}  # fmt: skip
    assert seconds["graph"] == seconds["bench"] < seconds["stream"] < seconds["isolated"]
    # cuBLAS's host path: torch.matmul's wall time per call on the H100 (0cce093-tests-bench/overhead.json)
    assert seconds["isolated"] == pytest.approx(seconds["graph"] + 17.434e-6, rel=1e-4)


def test_attention_tiles_change_the_prediction():
    shape = dict(batch=1, heads_q=16, seq_q=16384, head_dim=128)
    old = predict("flash_attention", "h100-sxm", build="af147ec", **shape)
    new = predict("flash_attention", "h100-sxm", **shape)
    assert old.breakdown.tile == (128, 32, 8, 2) and new.breakdown.tile == (128, 64, 8, 3)
    assert new.seconds < 0.75 * old.seconds  # the LARGE tier's tiles (measured: 292 -> 481 TFLOP/s)
    forced = predict("flash_attention", "h100-sxm", build="af147ec", config=[128, 32, 8, 2], **shape)
    assert forced.seconds == pytest.approx(old.seconds)
    causal = predict("flash_attention", "h100-sxm", causal=True, **shape)
    assert 0.45 < causal.seconds / new.seconds < 0.65
    assert new.breakdown.exp_s > 0 and new.bound == "compute"


def test_launch_order_and_list_schedule():
    # Causal query blocks of 1..4 key blocks, 3 pairs: row order (each pair's blocks in turn) against longest
    # first in sections of 2 pairs (llm_speed.attention.flash._longest_first).
    per_pair = [1, 2, 3, 4]
    assert launch_order(per_pair, 3, None) == (1, 2, 3, 4) * 3
    assert launch_order(per_pair, 3, 2) == (4, 4, 3, 3, 2, 2, 1, 1, 4, 3, 2, 1)
    # 2 SMs, 2 pairs of blocks [1, 3]: in row order the second pair's 3-block program starts last, at 2,
    # and ends alone at 5; longest first, (3, 3, 1, 1) ends at 4, the 8 blocks over 2 SMs.
    assert list_schedule(launch_order([1, 3], 2, None), 2) == 5.0
    assert list_schedule(launch_order([1, 3], 2, 2), 2) == 4.0
    assert list_schedule((3,) * 9, 4) == 9.0  # equal programs: ceil(9 / 4) waves


def test_causal_launch_order_and_backward_paths_in_the_prediction():
    shape = dict(batch=1, heads_q=16, seq_q=16384, head_dim=128, causal=True)
    calibration = copy.deepcopy(load_calibration())
    current = predict("flash_attention", "h100-sxm", **shape)
    calibration["builds"]["llm-speed"]["current"]["attention_launch"] = "row"
    row = predict("flash_attention", "h100-sxm", calibration=calibration, **shape)
    assert 1.03 < row.seconds / current.seconds < 1.12  # the last head's diagonal blocks no longer run alone
    # The atomic backward runs 5 matmuls per tile, the dQ kernel's path 7: ~2.5x and ~3.5x the forward's
    # FLOPs on the same tensor cores, but the atomic one adds BM x d fp32 atomics per block (``atomic_s``,
    # fitted): measured on the H100 SXM (2026-11-25, this shape) the dQ kernel's path took 0.60x the atomic
    # one's time at 64x64 x 4 warps. The H100 build takes the dQ kernel by default, so its default is the
    # deterministic path; a build that adds dQ by atomics by default differs.
    deterministic = predict("flash_attention_backward", "h100-sxm", deterministic=True, **shape)
    assert predict("flash_attention_backward", "h100-sxm", **shape).seconds == deterministic.seconds
    atomic = copy.deepcopy(load_calibration())
    atomic["builds"]["llm-speed"]["current"]["attention_backward"] = "atomic_dq"
    default = predict("flash_attention_backward", "h100-sxm", calibration=atomic, **shape)
    assert 0.5 < deterministic.seconds / default.seconds < 0.9  # more FLOPs, no atomics
    assert default.breakdown.kernels == 3 and deterministic.breakdown.kernels == 3
    with pytest.raises(ValueError, match="deterministic"):
        predict("flash_attention_backward", "h100-sxm", implementation="sdpa-flash", deterministic=1, **shape)


@pytest.mark.parametrize("flag", ["causal", "is_causal", "deterministic", "atomic_dq"])
def test_attention_flags_must_be_bools(flag):
    # Truthiness read causal="false" (or 2) as causal.
    shape = dict(batch=1, heads_q=16, seq_q=1024, head_dim=128)
    with pytest.raises(TypeError, match=f"{flag} must be a bool"):
        predict("flash_attention_backward", "h100-sxm", **shape, **{flag: "false"})
    with pytest.raises(TypeError, match="with_c must be a bool"):
        predict("gemm", "h100-sxm", m=64, n=64, k=64, with_c=2)


def test_compiled_kernels_replace_the_estimates():
    # af147ec's forward at 128x128 with 4 warps, as compiled for sm_90a (benchmarks/results/h100-sxm/
    # compiled-af147ec.json): 255 registers and 10 spill instructions in its loop; the same tile on a build
    # without compiled kernels is estimated (no spill: the kernel budgets hold shipped configurations to
    # none).
    calibration = load_calibration()
    key = compiled_key("forward", False, 128, "fp16", (128, 128, 4, 3))
    assert calibration["compiled"]["af147ec"]["kernels"][key]["loop_spills"] == 10
    shape = dict(batch=1, heads_q=16, seq_q=16384, head_dim=128, config=[128, 128, 4, 3])
    compiled = predict("flash_attention", "h100-sxm", build="af147ec", **shape)
    estimated = predict("flash_attention", "h100-sxm", **shape)
    assert compiled.seconds > estimated.seconds
    spilled = copy.deepcopy(calibration)
    spilled["compiled"]["af147ec"]["kernels"][key]["loop_spills"] = 0
    assert predict("flash_attention", "h100-sxm", build="af147ec", calibration=spilled, **shape).seconds < (
        compiled.seconds
    )


def test_uncalibrated_gpus_say_so():
    prediction = predict("gemm", "a100-sxm-80gb", implementation="cublas", m=4096, n=4096, k=4096)
    assert not prediction.calibrated and "no a100-sxm-80gb measurements" in prediction.source
    assert predict("gemm", "h100-sxm", m=64, n=64, k=64).calibrated
    # A slower GPU by its own datasheet: the A100's peak is 312 of the H100's 989 TFLOP/s.
    h100 = predict("gemm", "h100-sxm", implementation="cublas", m=8192, n=8192, k=8192)
    a100 = predict("gemm", "a100-sxm-80gb", implementation="cublas", m=8192, n=8192, k=8192)
    assert 2.5 < a100.seconds / h100.seconds < 3.5


def test_makespan_counts_the_last_wave():
    assert makespan([1.0] * 132, 132)[0] == pytest.approx(1.0)
    assert makespan([1.0] * 133, 132)[0] == pytest.approx(2.0)
    time, programs, waves, efficiency = makespan([1.0] * 264, 132)
    assert (time, programs, waves, efficiency) == (pytest.approx(2.0), 264, 2.0, pytest.approx(1.0))


def test_elementwise_costs_are_the_op_tables():
    import torch

    from llm_speed import ops

    x, w = torch.empty(64, 96, device="meta", dtype=torch.bfloat16), torch.empty(96, device="meta")
    for name in ("rms_norm", "rms_norm_backward"):
        work = ops.get(name).work(x=x, weight=w.to(torch.bfloat16))
        assert elementwise_cost(name, {"rows": 64, "hidden": 96})[:2] == (work.flops, work.bytes_moved)
    for name in ("swiglu", "swiglu_backward"):
        work = ops.get(name).work(gate=x)
        assert elementwise_cost(name, {"rows": 64, "width": 96})[:2] == (work.flops, work.bytes_moved)
    q = torch.empty(2, 4, 64, 32, device="meta", dtype=torch.bfloat16)
    cos = torch.empty(64, 16, device="meta", dtype=torch.bfloat16)
    work = ops.get("apply_rotary").work(x=q, cos=cos)
    cost = elementwise_cost("apply_rotary", {"batch": 2, "heads": 4, "seq": 64, "head_dim": 32})
    assert cost[:2] == (work.flops, work.bytes_moved)


def test_new_row_costs_are_the_op_tables():
    """The MoE rows (and the fused rows of the other branches, where this table has them): predict's FLOPs
    and bytes are the op table's work functions on the same problem."""
    import torch

    from llm_speed import ops

    meta = dict(device="meta", dtype=torch.bfloat16)
    names = set(ops.names())
    cases = {
        "grouped_gemm": (dict(a=torch.empty(96, 32, **meta), b=torch.empty(4, 32, 48, **meta),
                              out=torch.empty(96, 48, **meta)), dict(tokens=96, groups=4, n=48, k=32)),
        "moe_route": (dict(router_logits=torch.empty(40, 16, **meta), top_k=4),
                      dict(tokens=40, experts=16, top_k=4)),
        "moe_sort": (dict(topk_ids=torch.empty(40, 4, device="meta", dtype=torch.int32), num_experts=16),
                     dict(tokens=40, top_k=4, experts=16)),
        "fused_moe": (dict(hidden=torch.empty(40, 32, **meta), w_gate_up=torch.empty(8, 2 * 24, 32, **meta),
                           w_down=torch.empty(8, 32, 24, **meta),
                           topk_ids=torch.empty(40, 2, device="meta", dtype=torch.int32)),
                      dict(tokens=40, hidden=32, intermediate=24, experts=8, top_k=2)),
        "geglu": (dict(gate=torch.empty(64, 96, **meta)), dict(rows=64, width=96)),
        "apply_rotary_qk": (dict(q=torch.empty(2, 4, 64, 32, **meta), k=torch.empty(2, 2, 64, 32, **meta),
                                 cos=torch.empty(64, 32, **meta)),
                            dict(batch=2, heads_q=4, heads_kv=2, seq=64, head_dim=32)),
        "cross_entropy": (dict(logits=torch.empty(64, 1000, **meta)), dict(tokens=64, vocab=1000)),
    }  # fmt: skip
    checked = 0
    for base, (tensors, problem) in cases.items():
        for op in (base, f"{base}_backward"):
            if op not in names:
                continue
            work = ops.get(op).work(**tensors)
            prediction = predict(op, "h100-sxm", **problem)
            assert prediction.breakdown.flops == pytest.approx(work.flops), op
            assert prediction.breakdown.bytes_moved == pytest.approx(work.bytes_moved), op
            checked += 1
    assert checked >= 7  # grouped_gemm, moe_route, fused_moe (each with a backward) and moe_sort at least


def test_grouped_gemm_tile_rule_is_the_launchers():
    from llm_speed.core.hardware import Hardware
    from llm_speed.moe.grouped_gemm import grouped_config
    from llm_speed.perf.predict import grouped_tile

    hardware = Hardware.from_spec("h100-sxm")
    for rows, n, swiglu in [(1, 4096, False), (16, 2816, True), (48, 4096, False), (128, 4096, True),
                            (1024, 7168, False), (8, 24, False)]:  # fmt: skip
        rows_pow2 = 1 << (rows - 1).bit_length()
        config = grouped_config(rows_pow2, n, 2, swiglu, hardware)
        assert grouped_tile(rows, n, swiglu) == (
            config.block_m,
            config.block_n,
            config.block_k,
            config.num_warps,
        )


def test_moe_predictions_scale_as_the_experts_hit():
    """Decode (few tokens) streams the hit experts' weights: memory-bound; prefill is compute-bound."""
    shape = dict(hidden=4096, intermediate=1408, experts=64, top_k=8)
    decode = predict("fused_moe", "h100-sxm", context="graph", tokens=1, **shape)
    prefill = predict("fused_moe", "h100-sxm", tokens=16384, **shape)
    assert decode.bound == "memory" and prefill.bound == "compute"
    weights = 8 * 3 * 1408 * 4096 * 2  # the 8 experts one token hits
    assert weights / 3.0e12 < decode.seconds < 3 * weights / 3.0e12
    backward = predict("fused_moe_backward", "h100-sxm", tokens=16384, **shape)
    assert 2.0 < backward.seconds / prefill.seconds < 4.0  # 16 of 6 matmul FLOPs per element
    # A decode-sized backward writes every expert's weight gradients, zeros for the experts no token picked
    # (the wgrad kernels run over all experts): not faster than its floor, which counts those bytes.
    for problem in (dict(tokens=1, hidden=4096, intermediate=14336, experts=128, top_k=8),
                    dict(tokens=2, hidden=4089, intermediate=807, experts=128, top_k=4)):  # fmt: skip
        for gpu in ("h100-sxm", "l4"):
            few = predict("fused_moe_backward", gpu, **problem)
            assert few.seconds >= few.floor_s, (gpu, problem)
    with pytest.raises(ValueError, match="top_k = 9 exceeds experts = 8: a token picks top_k distinct"):
        predict("fused_moe", "h100-sxm", tokens=4, hidden=64, intermediate=64, experts=8, top_k=9)
    for op in ("moe_route", "moe_route_backward", "moe_sort"):
        with pytest.raises(ValueError, match="top_k = 100 exceeds experts = 8"):
            predict(op, "h100-sxm", tokens=4, experts=8, top_k=100)


def test_gemm_tile_rule_is_the_launchers():
    """predict restates llm_speed.matmul.gemm.gemm_config's rule without torch: the two must agree."""
    import torch

    from llm_speed.core.hardware import Hardware
    from llm_speed.matmul.gemm_configs import LARGE, gemm_config

    hardware = Hardware.from_spec("h100-sxm")
    tiles, decode = ([(c.block_m, c.block_n, c.block_k, c.num_warps) for c in listed]
                     for listed in (LARGE.persistent_tma, LARGE.persistent_tma_decode))  # fmt: skip
    shipped = load_calibration()["gpus"]["h100-sxm"]["implementations"]["llm-speed"]["gemm"]
    assert [tuple(t) for t in shipped["tiles"]] == tiles
    assert [tuple(t) for t in shipped["decode_tiles"]] == decode
    shapes = [(1, 4096, 4096), (16, 57344, 8192), (128, 6144, 4096), (1024, 1024, 1024), (8192, 8192, 64),
              (2048, 28672, 4096), (3, 5, 7), (128, 4096, 4096), (64, 128256, 4096)]  # fmt: skip
    for m, n, k in shapes:
        config = gemm_config(m, n, k, torch.bfloat16, "persistent_tma", True, hardware)
        chosen = gemm_config_choice(m, n, k, tiles, hardware.sm_count, decode_tiles=decode)
        assert chosen == (config.block_m, config.block_n, config.block_k, config.num_warps), (m, n, k)


def test_fp8_gemm_terms_scaling_layout_and_build():
    """gemm_fp8: the fp8 kernel's own tiles and rule (llm_speed.matmul.fp8.gemm_fp8_config, block scaling
    its smaller accumulators), a fitted cost per K step for block scaling and for the per-tensor kernel
    ptxas serialized (builds before eafec86), one copy kernel per operand that is not K-major (builds since
    6abe431); bad scaling or layout names the argument."""
    from llm_speed.core import tile_choice
    from llm_speed.core.hardware import Hardware
    from llm_speed.matmul import fp8

    hardware = Hardware.from_spec("h100-sxm")
    shipped = load_calibration()["gpus"]["h100-sxm"]["implementations"]["llm-speed"]["gemm fp8"]
    assert [tuple(t) for t in shipped["tiles"]] == [
        (c.block_m, c.block_n, c.block_k, c.num_warps) for c in fp8.GEMM_CONFIGS]
    assert fp8.fits_block_scaling is tile_choice.fits_block_scaling  # one rule: launcher and model
    names = {"tensor": fp8.TENSOR, "row": fp8.ROW, "block": fp8.BLOCKWISE}
    for m, n, k in ((4096, 4096, 4096), (8192, 8192, 4096), (16, 4096, 4096), (512, 1024, 4096)):
        for scaling, mode in names.items():
            config = fp8.gemm_fp8_config(m, n, k, mode, hardware)
            tile = predict("gemm_fp8", "h100-sxm", m=m, n=n, k=k, scaling=scaling).breakdown.tile
            expected = (config.block_m, config.block_n, config.block_k, config.num_warps)
            assert tile == expected, (m, n, k, scaling)

    def ms(**problem):
        shape = dict(m=4096, n=4096, k=4096)
        return predict("gemm_fp8", "h100-sxm", context="graph", **shape, **problem).milliseconds

    row, block, serial = ms(scaling="row"), ms(scaling="block"), ms(scaling="block", build="eafec86")
    assert ms(scaling="tensor") == row and serial > 2 * row  # the 128x128 tile and its rescale per step
    # this checkout's halves hide half of the rescale (halves_hidden: not fitted)
    assert row < block < serial and block - row == pytest.approx((serial - row) * 0.5, rel=0.05)
    assert ms(scaling="tensor", build="0cce093") > row == ms(scaling="row", build="0cce093")
    assert ms(scaling="tensor", build="eafec86") == row
    copied = predict("gemm_fp8", "h100-sxm", context="graph", m=4096, n=4096, k=4096, layout="NN")
    assert copied.breakdown.kernels == 2 and "33.6 MB of K-major operand copies" in copied.breakdown.notes[-1]
    assert ms(layout="TT") == pytest.approx(copied.milliseconds)  # A [K, M] copied: as many bytes as B's
    assert ms(layout="TN") > copied.milliseconds > row  # both
    with pytest.raises(ValueError, match="scaling is 'blockwise'; accepted: 'tensor', 'row', 'block'"):
        predict("gemm_fp8", "h100-sxm", m=64, n=64, k=64, scaling="blockwise")
    with pytest.raises(ValueError, match="layout is 'nt'; accepted: 'NN', 'NT', 'TN', 'TT'"):
        predict("gemm_fp8", "h100-sxm", m=64, n=64, k=64, layout="nt")
    with pytest.raises(ValueError, match="gemm: unknown problem argument"):
        predict("gemm", "h100-sxm", m=64, n=64, k=64, scaling="row")  # fp8's keys only


def test_attention_tile_tables_match_the_kernels():
    """The calibration's current tile table is the H100's attention tier (LARGE) as the code ships it; the
    baseline build's table (af147ec, measured on the H100) is a record of that build: it has a row for
    every row of the tier, and its 16-bit rows are FULL's (the float32 rows changed after it, issue 33)."""
    import torch

    from llm_speed.attention import flash

    cal = load_calibration()
    current = cal["gpus"]["h100-sxm"]["implementations"]["llm-speed"]["attention"]["tiles"]
    baseline = cal["builds"]["llm-speed"]["af147ec"]["attention_tiles"]
    for direction in ("forward", "backward"):
        for dtype, key in ((torch.float16, "fp16"), (torch.float32, "fp32")):
            for dim, config in flash.LARGE.table[direction][dtype].items():
                expected = [config.block_m, config.block_n, config.num_warps, config.num_stages]
                assert current[direction][key][str(dim)] == expected, (direction, key, dim)
            assert set(baseline[direction][key]) == {str(d) for d in flash.FULL.table[direction][dtype]}
            if dtype == torch.float16:
                for dim, config in flash.FULL.table[direction][dtype].items():
                    expected = [config.block_m, config.block_n, config.num_warps, config.num_stages]
                    assert baseline[direction][key][str(dim)] == expected, (direction, key, dim)


# --- accuracy on the committed H100 measurements ----------------------------------------------------------


def test_the_held_out_rule(results):
    """Every second size of each group is held out: 1k, 4k, 16k of the attention grid, tokens 16 and 2048
    of the model GEMMs (and 8192 since 2026-11-25's 4096 tokens joined Llama-3 8B's groups), squares 1024 and
    4096; every second tile of the sweeps. Points of kinds no fit uses (8-bit, eager attention, forward and
    backward under one timer) are always held out."""
    flags = dict(
        zip(
            (p.source + p.implementation for p in results.points),
            calibrate.held_out(results.points),
            strict=True,
        )
    )
    assert flags["af147ec-baseline/attn_fp16_fwd_d128_full_mha_s1024.json: seq=1024sdpa-cudnn"]
    assert not flags["af147ec-baseline/attn_fp16_fwd_d128_full_mha_s2048.json: seq=2048llm-speed"]
    assert flags["af147ec-baseline/gemm_bf16_llama-3-8b_t2048.json: qkv 2048x6144x4096cublas"]
    assert not flags["d1b0227-quick-tests-bench/gemm_llama3_8b_bf16.json: qkv 4096x6144x4096llm-speed"]
    assert flags["af147ec-baseline/gemm_bf16_llama-3-8b_t8192.json: qkv 8192x6144x4096llm-speed"]
    assert not flags["af147ec-baseline/gemm_bf16_llama-3-70b_t8192.json: qkv 8192x10240x8192llm-speed"]
    assert flags["af147ec-baseline/gemm_bf16_square.json: 4096x4096x4096cublas"]
    assert flags["d1b0227-quick-tests-bench/gemm_fp16_2048.json: 2048x2048x2048cublas"]
    assert flags["d1b0227-quick-tests-bench/gemm_int8_2048.json: 2048x2048x2048llm-speed"]  # 8-bit: unfitted
    # fp8 GEMMs in NT: per granularity, 4096^3 fitted and 8192x8192x4096 held out; NN (b read N-major by the
    # kernel of d1b0227) never fitted
    assert not flags["eafec86-fp8/gemm_fp8_4096.json: 4096x4096x4096 blockllm-speed"]
    assert flags["eafec86-fp8/gemm_fp8_8192.json: 8192x8192x4096 blockllm-speed"]
    assert not flags["2b2a055-ab-fp8-decode/gemm_fp8_nt.json: 4096x4096x4096 tensorcublas"]
    assert flags["d1b0227-quick-tests-bench/gemm_fp8_4096.json: 4096x4096x4096 rowllm-speed"]
    train, test = calibrate.split(results.points)
    # 2026-11-22: 188 and 149; the 2026-11-25 suite adds 30 training points, 28 held out and 34 of kinds no
    # fit uses; its calls 4 and 5 (A/B runs, fp8 GEMMs in NT, decode) 34, 11 and 76 (decode: 72); the second
    # lease's suite (0cce093) 38 training points, 20 held out and 98 unfitted (decode 60, fwd+bwd, 8-bit), its
    # fp8 calls 3 and 7 (call3/, call7/) 12 training points (bf16 torch.matmul) and 24 unfitted. The fp8 GEMMs
    # in NT (49 points of 232 unfitted until the "gemm fp8" fit): 27 training, 22 held out.
    assert (len(train), len(test)) == (329, 413)
    assert sum(not p.fitted for p in test) == 183 and all(p.fitted for p in train)
    # cuBLAS and llm-speed are held out on the same shapes.
    gemm = {p.source for p in test if p.op == "gemm"}
    assert gemm == {p.source for p in test if p.op == "gemm" and p.implementation == "cublas"}


# Reached on the held-out points (docs/performance-model.md, "Calibrated predictions"): median, worst.
HELD_OUT = {
    ("cublas", "gemm"): (0.05, 0.20),
    ("llm-speed", "gemm"): (0.05, 0.30),
    ("sdpa-cudnn", "attention"): (0.06, 0.15),
    ("sdpa-flash", "attention"): (0.06, 0.15),
    ("sdpa-efficient", "attention"): (0.05, 0.10),
    ("llm-speed", "attention"): (0.10, 0.45),  # the worst is a spilling sweep tile: over the 35% target
    # fp8 GEMMs in NT at 8192x8192x4096 (4096^3 fitted): the per-row kernels run 2-11% slower than predicted
    ("cublas", "gemm fp8"): (0.05, 0.10),
    ("llm-speed", "gemm fp8"): (0.05, 0.12),
}


# Held-out points beyond their family's worst above, with why (docs/guides/model-calibration.md, "The first
# 2026-11-25 lease (L2)"): the thresholds stand; each miss is named, and must still miss (fixed: remove it
# here).
KNOWN_MISSES = {
    # llm-speed's GEMM at 1024^3 and 2048^3 takes ~54 us more than the model, the same at both sizes and gone
    # from 4096^3 on: a per-call host cost at these shapes (~85-90 us) far above the tiny problem's (32 us,
    # the build's host path the model reads from the overhead run: it does not explain this point). Build
    # 0cce093 (the second 2026-11-25 suite) ran the same points in 11.4 and 29.3 us.
    "d1b0227-quick-tests-bench/gemm_fp16_2048.json: 2048x2048x2048 [llm-speed]": -0.67,
    # SDPA's memory-efficient kernel at d = 64 (batch 2, 8 heads): a quarter slower than the model, which its
    # d = 128 points set (both suites).
    "d1b0227-quick-tests-bench/attn_fwd_fp16_s8192.json: seq=8192 [sdpa-efficient]": -0.236,
    "0cce093-tests-bench/attn_fwd_fp16_s8192.json: seq=8192 [sdpa-efficient]": -0.235,
}


def test_held_out_errors_on_the_h100(results):
    train, test = calibrate.split(results.points)
    missed = {}
    for (implementation, family), (median, worst) in HELD_OUT.items():
        # the points of the family the fit describes (not 8-bit, eager, or forward+backward: their own rows)
        points = [p for p in test if p.implementation == implementation and measurements.kind_of(p) == family]
        errors = calibrate.errors(points, None)
        assert statistics.median(map(abs, errors)) <= median, (implementation, family)
        assert statistics.median(map(abs, errors)) <= 0.15  # the target for the median
        for point, error in zip(points, errors, strict=True):
            if abs(error) > worst:
                missed[point.label] = round(error, 3)
    assert missed == KNOWN_MISSES
    # On the attention grids alone (the 2026-11-22 baseline's, both 2026-11-25 suites'), llm-speed's attention
    # meets both targets but at one point: the d = 64 forward at 2 x 8 x 2048, held out, +35.4% in the second
    # suite (+32% in the first): the model prices d = 64's 128 x 64 tiles too slow at 2048-8192 (+35%, +26%,
    # +16%), a miss it must own (docs/guides/model-calibration.md, "The second 2026-11-25 lease (L3)").
    grid = [p for p in test if p.implementation == "llm-speed" and "attn_" in p.source and p.fitted]
    errors = {p.label: e for p, e in zip(grid, calibrate.errors(grid, None), strict=True)}
    over = {label: round(e, 3) for label, e in errors.items() if abs(e) > 0.35}
    assert over == {"0cce093-tests-bench/attn_fwd_fp16_s2048.json: seq=2048 [llm-speed]": 0.354}


def test_shipped_calibration_records_its_fit(results):
    """calibration.json's recorded errors are those of its own parameters (it is not stale)."""
    cal = load_calibration()
    train, test = calibrate.split(results.points)
    for key, fit in cal["last_fit"]["entries"].items():
        gpu, implementation, family = key.split("/")
        held = [p for p in test if p.implementation == implementation and measurements.kind_of(p) == family]
        summary = calibrate.summarize(held, None)
        assert summary.count == fit["held_out"]["points"]
        assert summary.median == pytest.approx(fit["held_out"]["median_abs_error"], rel=1e-6), key


def test_refit_from_a_results_directory(tmp_path):
    """calibrate() reads a results directory, fits on its training split and reports the held-out errors:
    times generated by known cuBLAS parameters are predicted again from a wrong start."""
    truth = copy.deepcopy(load_calibration())
    entry = truth["gpus"]["h100-sxm"]["implementations"]["cublas"]["gemm"]
    entry["eta"] = 0.6
    sizes = [(m, 6144, 4096) for m in (256, 1024, 2048, 4096, 8192)]  # one group: 1024 and 4096 held out
    rows = []
    for m, n, k in sizes:
        seconds = predict(
            "gemm", "h100-sxm", implementation="cublas", calibration=truth, m=m, n=n, k=k
        ).seconds
        rows.append({"case": f"{m}x{n}x{k}", "impl": "torch", "available": True, "m": m, "n": n, "k": k,
                     "timing": {"median_ms": seconds * 1e3}})  # fmt: skip
    document = {"benchmark": "gemm", "environment": {"gpu_spec_id": "h100-sxm", "git_commit": None},
                "settings": {"dtype": "bf16", "epilogue": "none"}, "results": rows}  # fmt: skip
    folder = tmp_path / "h100-sxm" / "session"
    folder.mkdir(parents=True)
    (folder / "gemm.json").write_text(json.dumps(document))
    (folder / "ceilings.txt").write_text("copy TB/s (read+write) 3.0\n")
    start = copy.deepcopy(load_calibration())
    start["gpus"]["h100-sxm"]["implementations"]["cublas"]["gemm"]["eta"] = 0.9
    new = calibrate.calibrate(tmp_path, base=start, iterations=80)
    fitted = new["gpus"]["h100-sxm"]["implementations"]["cublas"]["gemm"]
    # Moved off the wrong start (eta 0.9 against the truth's 0.6; with three points eta trades off against the
    # tile efficiency, so the times are checked, not eta itself).
    assert fitted["eta"] != 0.9
    report = new["last_fit"]["entries"]["h100-sxm/cublas/gemm"]
    assert report["training"]["points"] == 3 and report["held_out"]["points"] == 2
    assert report["training"]["worst_abs_error"] < 0.02 and report["held_out"]["worst_abs_error"] < 0.08
    assert new["gpus"]["h100-sxm"]["ceilings"]["copy_bytes_per_s"] == 3.0e12
    assert fitted["fitted"]["files"] == ["session/gemm.json"]


def test_a_results_directory_carries_compiled_kernels(tmp_path):
    # benchmarks/compile_measured_tiles.py's output beside the measurements: read, keyed as predict looks it
    # up; a kernel that could not launch (an error) is left out.
    row = {"direction": "fwd", "kernel": "forward", "causal": True, "head_dim": 64, "dtype": "fp16",
           "config": [128, 64, 4, 3], "registers": 237, "loop_spill_instructions": 5,
           "inner_loop_spill_instructions": 3, "blocks_per_sm": 2,
           "tensor_cores": "HGMMA", "error": None}  # fmt: skip
    broken = dict(row, config=[128, 128, 8, 4], error="OutOfResources: shared memory")
    document = {"commit": "abc1234", "target": "sm_90a", "triton": "3.6.0", "kernels": [row, broken],
                "generated_by": measurements.COMPILED_BY}  # fmt: skip
    (tmp_path / "compiled-abc1234.json").write_text(json.dumps(document))
    table = measurements.load_results(tmp_path, gpu="h100-sxm").compiled["abc1234"]
    key = compiled_key("forward", True, 64, "fp16", (128, 64, 4, 3))
    assert list(table["kernels"]) == [key]
    assert table["kernels"][key] == {"registers": 237, "loop_spills": 3, "blocks_per_sm": 2,
                                     "tensor_cores": "HGMMA"}  # fmt: skip


def test_a_cpu_run_is_not_a_measurement(tmp_path):
    document = {"benchmark": "gemm", "environment": {"device_type": "cpu", "gpu_spec_id": None},
                "settings": {"dtype": "fp32"}, "results": []}  # fmt: skip
    (tmp_path / "cpu.json").write_text(json.dumps(document))
    with pytest.raises(ValueError, match="no GPU measurements"):
        calibrate.calibrate(tmp_path)


def test_predict_work_for_ops_without_a_row():
    small = predict_work("h100-sxm", flops=0.0, bytes_moved=1e6)
    big = predict_work("h100-sxm", flops=0.0, bytes_moved=1e9)
    assert small.bound == "latency" and big.bound == "memory"
    assert big.seconds == pytest.approx(1e9 / big.breakdown.achievable_bandwidth, rel=0.05)
    gemm = predict_work("h100-sxm", flops=1e13, bytes_moved=1e8, family="gemm", implementation="vendor")
    assert gemm.bound == "compute" and gemm.implementation == "cublas"


def test_sdpa_backends_rank_as_measured():
    shape = dict(batch=1, heads_q=16, seq_q=16384, head_dim=128)
    times = {impl: predict("flash_attention", "h100-sxm", implementation=impl, **shape).seconds
             for impl in SDPA_BACKENDS}  # fmt: skip
    assert times["sdpa-cudnn"] < times["sdpa-flash"] < times["sdpa-efficient"]


@pytest.mark.parametrize("impl", [*SDPA_BACKENDS, "vendor"])
def test_sdpa_attention_on_a_backend_is_that_backends_fused_kernel(impl):
    """sdpa_attention is F.scaled_dot_product_attention: on a backend it is that backend's fused kernel, the
    call whose measurements set the backend's parameters (flash_attention's), not the eager 3-kernel path."""
    shape = dict(batch=2, heads_q=16, seq_q=4096, head_dim=128, causal=True)
    sdpa = predict("sdpa_attention", "h100-sxm", implementation=impl, context="graph", **shape)
    fused = predict("flash_attention", "h100-sxm", implementation=impl, context="graph", **shape)
    assert sdpa.seconds == fused.seconds and sdpa.breakdown.kernels == fused.breakdown.kernels == 1
    assert sdpa.breakdown.bytes_moved == fused.breakdown.bytes_moved
    assert sdpa.calibrated == fused.calibrated is True
    # "llm-speed" (the default) is torch's default backend: llm_speed.helpers.sdpa_attention calls SDPA
    default = predict("sdpa_attention", "h100-sxm", context="graph", **shape)
    assert default.implementation == "sdpa-flash" and default.breakdown.kernels == 1
    eager = predict("naive_attention", "h100-sxm", context="graph", **shape)  # the eager path is naive's
    assert eager.breakdown.kernels > 1 and eager.seconds > 5 * default.seconds


@pytest.mark.parametrize("op", ["flash_attention_fp8", "tiled_attention", "naive_attention"])
def test_vendor_is_not_listed_where_it_is_refused(op):
    with pytest.raises(ValueError, match="vendor") as refusal:
        predict(op, "h100-sxm", implementation="vendor", batch=1, heads_q=8, seq_q=128, head_dim=64)
    message = str(refusal.value)
    assert message.endswith("accepted: llm-speed") and "vendor means sdpa-flash" in message
    with pytest.raises(ValueError, match="nvls, which implementation 'vendor' means for all_reduce"):
        predict("all_reduce", "a100-sxm", implementation="vendor", size_bytes=2**20, num_gpus=8)
    assert resolve_implementation("flash_attention", "vendor") == "sdpa-flash"


def test_gemm_rows_price_only_the_dtypes_they_compute_in():
    """llm_speed.gemm refuses int8 and fp8 operands: its row is not an 8-bit GEMM at the 16-bit fit (it was,
    labelled calibrated), and a dtype no row takes is refused before any work; fp32 and tf32 are priced at
    their peaks with the 16-bit parameters and say so; an analysis in an 8-bit dtype prices its GEMMs as the
    row that computes in it."""
    from llm_speed.core.gpus import get_gpu
    from llm_speed.perf.inference import Predictor
    from llm_speed.perf.kernel_costs import KernelCost
    from llm_speed.perf.prediction.names import GEMM_OP_DTYPES, gemm_op_for

    shape = dict(m=4096, n=4096, k=4096)
    refused = r"dtype 'int8' is not one gemm \(llm-speed\) computes in; accepted: fp16, bf16, fp32, tf32; "
    with pytest.raises(ValueError, match=refused + "int8 is tensor_core_gemm_int8's"):
        predict("gemm", "h100-sxm", dtype="int8", **shape)
    with pytest.raises(ValueError, match="accepted: fp16, bf16; fp32 is gemm's"):
        predict("tensor_core_gemm", "h100-sxm", dtype="fp32", **shape)
    with pytest.raises(ValueError, match="accepted: fp8; bf16 is gemm's"):
        predict("gemm_fp8", "h100-sxm", dtype="bf16", **shape)
    with pytest.raises(ValueError, match="accepted: fp16, bf16, fp32, tf32$"):
        predict("gemm", "h100-sxm", dtype="fp64", **shape)  # llm_speed.gemm has no fp64 kernel; cuBLAS has
    assert predict("gemm", "h100-sxm", implementation="cublas", dtype="fp64", **shape).milliseconds > 0
    for op, dtypes in GEMM_OP_DTYPES.items():
        for dtype in dtypes:
            prediction = predict(op, "h100-sxm", dtype=dtype, **shape)
            fitted = dtype in ("fp16", "bf16", "fp8")  # int8: NOT_FITTED
            assert prediction.calibrated is fitted, (op, dtype, prediction.source)
    assert "the GEMM fit uses fp16 and bf16 points only: fp32 priced at its peak" in predict(
        "gemm", "h100-sxm", dtype="fp32", **shape).source
    assert [gemm_op_for(d) for d in ("fp8", "int8", "bf16", "fp4")] == [
        "gemm_fp8", "tensor_core_gemm_int8", "gemm", "gemm"]
    predictor = Predictor(get_gpu("h100-sxm"))  # as analyze builds it
    cost = KernelCost(2.0 * 4096**3, 3 * 4096**2)
    for dtype, op in (("int8", "tensor_core_gemm_int8"), ("fp8", "gemm_fp8"), ("bf16", "gemm")):
        assert predictor(dtype, cost, ("gemm", dict(shape), "gemm")).op == op


def test_attention_rows_price_only_the_dtypes_they_compute_in():
    """q, k, v in a dtype the row's kernel does not take are refused by name (int8 attention, fp8 through the
    16-bit row, fp32 on SDPA's flash backend), fp8 pointing at flash_attention_fp8 and a decode's kv_dtype;
    fp32 is priced with the 16-bit parameters and says so; flash_attention_fp8's floor is at the fp8 peak.
    An fp8 analysis prices its prefill attention as flash_attention_fp8 and its decode as a bfloat16 query
    over an fp8 cache."""
    from llm_speed.perf.inference import analysed_row

    shape = dict(batch=1, heads_q=16, seq_q=4096, head_dim=128)
    refused = r"dtype 'int8' is not one flash_attention \(llm-speed\) computes in; accepted: fp16, bf16, fp32"
    with pytest.raises(ValueError, match=refused + "$"):
        predict("flash_attention", "h100-sxm", dtype="int8", **shape)
    with pytest.raises(ValueError, match="fp8 q, k, v are flash_attention_fp8's$"):
        predict("flash_attention_backward", "h100-sxm", dtype="fp8", **shape)
    with pytest.raises(ValueError, match=r"\(sdpa-flash\) computes in; accepted: fp16, bf16$"):
        predict("flash_attention", "h100-sxm", implementation="sdpa-flash", dtype="fp32", **shape)
    decode = dict(batch=1, heads_q=32, heads_kv=8, seq_kv=4096, head_dim=128)
    with pytest.raises(ValueError, match="an fp8 cache is kv_dtype$"):
        predict("attention_kvcache_fwd", "h100-sxm", dtype="fp8", **decode)
    assert predict("attention_kvcache_fwd", "h100-sxm", kv_dtype="fp8", **decode).milliseconds > 0
    fp32 = predict("flash_attention", "h100-sxm", dtype="fp32", **shape)
    assert not fp32.calibrated and "the attention fit uses fp16 and bf16 points only: fp32" in fp32.source
    assert predict("flash_attention", "h100-sxm", implementation="sdpa-efficient", dtype="fp32", **shape)
    asked = (("flash_attention", "vendor"), ("flash_attention", "sdpa"), ("sdpa_attention", "llm-speed"))
    for op, implementation in asked:
        # SDPA's default backend: flash for 16-bit inputs, memory-efficient for fp32 (flash has no fp32)
        backends = [predict(op, "h100-sxm", implementation=implementation, dtype=dtype, **shape)
                    for dtype in ("bf16", "fp32")]  # fmt: skip
        backends = [prediction.implementation for prediction in backends]
        assert backends == ["sdpa-flash", "sdpa-efficient"], (op, implementation)
    assert predict("flash_attention", "h100-sxm", dtype="bf16", **shape).calibrated
    fp8 = predict("flash_attention_fp8", "h100-sxm", **shape)
    assert fp8.floor_s == pytest.approx(predict("flash_attention", "h100-sxm", **shape).floor_s / 2, rel=0.01)
    problem = dict(shape, seq_kv=4096, causal=True)
    fp8_row = ("flash_attention_fp8", dict(problem, dtype="fp8"))
    assert analysed_row("flash_attention", "fp8", problem) == fp8_row
    assert analysed_row("attention_kvcache_fwd", "fp8", decode) == (
        "attention_kvcache_fwd", dict(decode, dtype="bf16", kv_dtype="fp8"))
    bf16_row = ("flash_attention", dict(problem, dtype="bf16"))
    assert analysed_row("flash_attention", "bf16", problem) == bf16_row
    assert analysed_row("gemm", "int8", {"m": 1}) == ("tensor_core_gemm_int8", {"m": 1, "dtype": "int8"})


def test_gradients_is_a_flag_and_page_size_a_positive_int():
    """gradients=1 passed as True (a membership test), and page_size was popped unchecked, whatever it was."""
    ce = dict(tokens=8, hidden=64, vocab=128)
    with pytest.raises(TypeError, match="gradients must be a bool"):
        predict("fused_linear_cross_entropy", "h100-sxm", gradients=1, **ce)
    assert predict("fused_linear_cross_entropy", "h100-sxm", gradients=True, **ce).milliseconds > 0
    decode = dict(batch=1, heads_q=8, seq_kv=64, head_dim=64)
    dense = predict("attention_kvcache_fwd", "h100-sxm", **decode).milliseconds
    assert predict("attention_kvcache_fwd", "h100-sxm", page_size=16, **decode).milliseconds == dense
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        predict("attention_kvcache_fwd", "h100-sxm", page_size=0, **decode)


@pytest.mark.parametrize("op, problem", [
    ("rms_norm", dict(rows=64, hidden=64)), ("cross_entropy", dict(tokens=8, vocab=64)),
    ("fused_linear_cross_entropy", dict(tokens=8, hidden=64, vocab=128)),
    ("fused_moe", dict(tokens=64, hidden=64, intermediate=32, experts=8, top_k=2)),
])  # fmt: skip
def test_streaming_cross_entropy_and_moe_rows_compute_in_float_dtypes(op, problem):
    """Their kernels take float16, bfloat16 and float32: an 8-bit dtype was priced at one byte an element."""
    assert predict(op, "h100-sxm", dtype="fp32", **problem).milliseconds > 0
    with pytest.raises(ValueError, match=f"dtype 'int8' is not one {op}( \\(llm-speed\\))? computes in; "
                                         "accepted: fp16, bf16, fp32$"):  # fmt: skip
        predict(op, "h100-sxm", dtype="int8", **problem)
