"""The three pieces issue 38 added to the model, each against the published figure it reproduces:

* NVLink SHARP all-reduce: NVIDIA/nccl issue #1455 (8 x H100 SXM, NCCL_ALGO=NVLS, 2-4 GiB): busBw
  365-370 GB/s on 2-4 GPUs, then 420, 440, 460 and 480 GB/s on 5, 6, 7 and 8 (the 8-GPU figure, ~275 GB/s
  algbw, NVIDIA/nccl-tests #212, is the one the efficiency was fitted to).
* Selective activation recomputation: Korthikanti et al. 2022 (arXiv:2205.05198), section 4.2: 2.7% FLOPs
  overhead for GPT-3 175B, 1.6% for MT-NLG 530B.
* Weight-only decode dequantization: gpt-fast's Llama-2-7B on an A100 (pytorch-labs/gpt-fast README): weights
  read at 1,397 GB/s in bf16, 1,069 int8 (fitted), 863 int4 with group-32 scales (held out); Marlin
  (IST-DASLab/marlin README): 3.87x over fp16 at group 128 "up to batchsizes around 16-32" on an A10. The
  same model in ``analyze_inference``'s realistic decode, against gpt-fast's int4 tokens/s (held out).
"""

from __future__ import annotations

import copy

import pytest

from llm_speed.core.gpus import custom_gpu, get_gpu
from llm_speed.perf import all_reduce_time, korthikanti_selective_recompute_flops, link_bandwidth
from llm_speed.perf.efficiency import Efficiency
from llm_speed.perf.inference import analyze_inference
from llm_speed.perf.models import gemm_shapes, get_model
from llm_speed.perf.predict import (
    REFERENCE_GPU,
    all_reduce_figures,
    dequant_model,
    load_calibration,
    predict,
    with_dequant,
)

NCCL_1455_BUSBW = {5: 420e9, 6: 440e9, 7: 460e9, 8: 480e9}


@pytest.mark.parametrize(("gpus", "published"), sorted(NCCL_1455_BUSBW.items()))
def test_nvls_bus_bandwidth_grows_with_the_gpus_as_measured(gpus, published):
    link = link_bandwidth("h100-sxm", "nvlink")
    estimate = all_reduce_time(4 * 2**30, gpus, link, algorithm="nvls")
    assert estimate.busbw_bytes_per_s == pytest.approx(published, rel=0.05)
    prediction = predict("all_reduce", "h100-sxm", implementation="nvls", size_bytes=4 * 2**30, num_gpus=gpus)
    assert all_reduce_figures(prediction)["busbw_bytes_per_s"] == pytest.approx(published, rel=0.05)


def test_nccl_picks_the_ring_below_four_gpus():
    """#1455: busBw stays at the ring's 365-370 GB/s on 2-4 GPUs; NVLS wins from 4-5 on."""
    for gpus, expected in ((2, "ring"), (3, "ring"), (8, "nvls")):
        prediction = predict("all_reduce", "h100-sxm", implementation="auto", size_bytes=2**31, num_gpus=gpus)
        assert prediction.breakdown.notes == (f"auto: {expected}",)
        if expected == "ring":
            assert all_reduce_figures(prediction)["busbw_bytes_per_s"] == pytest.approx(367e9, rel=0.03)
    with pytest.raises(ValueError, match="NVLink SHARP"):
        predict("all_reduce", "a100-sxm-80gb", implementation="nvls", size_bytes=2**20, num_gpus=8)


@pytest.mark.parametrize(
    ("name", "hidden", "layers", "published"),
    [("GPT-3 175B", 12288, 96, 0.027), ("MT-NLG 530B", 20480, 105, 0.016)],
)
def test_selective_recompute_overhead_as_korthikanti_count_it(name, hidden, layers, published):
    flops = korthikanti_selective_recompute_flops(
        batch_size=1, seq_len=2048, num_layers=layers, hidden_size=hidden, vocab_size=51200
    )
    assert round(flops.overhead, 3) == published, name
    assert flops.recompute_flops == pytest.approx(12 * 2048**2 * layers * hidden)


def test_selective_recompute_executed_work_is_a_third_of_the_papers_count():
    from llm_speed.perf import training_flops
    from llm_speed.perf.models import ModelConfig

    gpt3 = ModelConfig(
        name="gpt3-175b", hidden_size=12288, num_layers=96, num_attention_heads=96, num_kv_heads=96,
        head_dim=128, intermediate_size=4 * 12288, vocab_size=51200, max_position_embeddings=2048,
        gated_mlp=False,
    )  # fmt: skip
    none = training_flops(
        gpt3, batch_size=1, seq_len=2048, causal=False, recompute="none", flash_attention=False
    )
    selective = training_flops(
        gpt3, batch_size=1, seq_len=2048, causal=False, recompute="selective", flash_attention=False
    )
    paper = korthikanti_selective_recompute_flops(
        batch_size=1, seq_len=2048, num_layers=96, hidden_size=12288, vocab_size=51200
    )
    assert selective.recompute_flops - none.recompute_flops == pytest.approx(paper.recompute_flops / 3)


def _weight_stream_rate(gpu, weight_dtype=None, group=None, scale_bytes=2.0, dequant=None, m=1):
    """Weight bytes per second of one decode GEMV of Llama-2-7B's scale (CUDA graphs: no host path)."""
    n, k = 4 * 11008, 4096
    problem = dict(m=m, n=n, k=k, dtype="fp16")
    bytes_per_weight = 2.0
    if weight_dtype is not None:
        problem.update(weight_dtype=weight_dtype, group_size=group, scale_bytes=scale_bytes, dequant=dequant)
        bytes_per_weight = {"int8": 1.0, "int4": 0.5}[weight_dtype] + (scale_bytes / group if group else 0.0)
    prediction = predict("gemm", gpu, implementation="cublas", context="graph", **problem)
    return n * k * bytes_per_weight / prediction.seconds, prediction


def test_gpt_fast_weight_only_decode_on_a100():
    bf16, _ = _weight_stream_rate("a100-sxm-80gb")
    int8, p8 = _weight_stream_rate("a100-sxm-80gb", "int8", dequant="convert")
    int4, p4 = _weight_stream_rate("a100-sxm-80gb", "int4", group=32, scale_bytes=4.0, dequant="convert")
    assert int8 / bf16 == pytest.approx(1069 / 1397, rel=0.02)  # the fitted row
    assert int4 / bf16 == pytest.approx(863 / 1397, rel=0.10)  # held out: +5%
    assert p8.breakdown.dequant_s > 0 and p4.breakdown.dequant_s == pytest.approx(p8.breakdown.dequant_s)


A10 = custom_gpu(
    {
        "based_on": "l4", "id": "a10", "name": "NVIDIA A10", "sm_count": 72, "boost_clock_mhz": 1695,
        "peak_tflops": {"fp16": 125.0, "bf16": 125.0, "fp32": 31.2}, "hbm_bandwidth_gbs": 600.0,
        "l2_cache_mb": 6.0, "hbm_capacity_gb": 24.0,
    },
    origin="NVIDIA A10 datasheet",
)  # fmt: skip


def test_marlin_speedup_is_the_byte_ratio_up_to_batch_32_on_an_a10():
    speedups = {}
    for batch in (1, 16, 32, 128):
        fp16, dense = _weight_stream_rate(A10, m=batch)
        int4, quant = _weight_stream_rate(A10, "int4", group=128, scale_bytes=2.0, dequant="lop3", m=batch)
        speedups[batch] = dense.seconds / quant.seconds
    # 3.72x at batch 1, 3.63x at 16 (-6%: the ramp and latency the fp16 GEMV hides better; 3.71x and 3.67x
    # before the refit with the second 2026-11-25 H100 suite moved cuBLAS's fitted latency terms), then the
    # tensor cores take over: the A10's 125 TFLOP/s meet the int4 weight stream at ~50 tokens (~30 at the
    # efficiency reached), so the speedup falls from there (2.3x at 32, 1.3x at 128).
    assert speedups[1] == pytest.approx(3.87, rel=0.07) and speedups[16] == pytest.approx(3.87, rel=0.07)
    assert speedups[128] < speedups[32] < speedups[16]
    assert speedups[128] < 2.0


# gpt-fast's Llama-2-7B on one A100-80GB (pytorch-labs/gpt-fast README, "Benchmarks"; batch 1, A100s
# power-limited to 330 W): int4 weight-only with group size 32, 196.80 tokens/s (862.69 GB/s); int8, 155.58.
GPT_FAST_INT4_TOKENS_PER_S = 196.80
GPT_FAST_INT8_TOKENS_PER_S = 155.58


def _llama_decode(weight_dtype, group=None, calibration=None):
    return analyze_inference(
        "llama-2-7b", "a100-sxm-80gb", seq_len=5, decode_tokens=200, weight_dtype=weight_dtype,
        weight_group_size=group, weight_scale_bytes=4.0 if weight_dtype == "int4" else 2.0,
        implementation="vendor", calibration=calibration,
    )  # fmt: skip


def test_int4_weight_only_decode_of_analyze_inference_against_gpt_fast():
    """analyze_inference's realistic int4 decode dequantizes as perf.predict models it; gpt-fast's measured
    int4 row is held out (predict's overlap is fitted to the int8 row). Tolerance 15%: the model lands at
    +14% (224 tokens/s), int8 at +7%; the bandwidth ceiling is 2.4x the measurement."""
    int4 = _llama_decode("int4", 32)
    assert int4.decode_tokens_per_s_realistic == pytest.approx(GPT_FAST_INT4_TOKENS_PER_S, rel=0.15)
    assert int4.decode_tokens_per_s > 2 * GPT_FAST_INT4_TOKENS_PER_S  # the floor alone is far off
    int8 = _llama_decode("int8")
    assert int8.decode_tokens_per_s_realistic == pytest.approx(GPT_FAST_INT8_TOKENS_PER_S, rel=0.10)


def test_analyze_inference_takes_its_dequantization_from_predict():
    """Each weight GEMM's realistic time is its weight stream (at the memory efficiency) with predict's
    dequantization of that GEMM as a share of predict's DRAM time, overlapped as predict overlaps it; a
    calibration that makes int4 conversions dearer slows the realistic decode, and only where weights are
    quantized."""
    gpu = get_gpu("a100-sxm-80gb")
    int4 = _llama_decode("int4", 32)
    overlap = dequant_model(gpu, "int4")["overlap"]
    shapes = {s.name: s for s in gemm_shapes(get_model("llama-2-7b"), 1, lm_head_tokens=1)}
    checked = 0
    for op in int4.ops:
        if op.phase != "decode" or op.name not in shapes:
            continue
        shape = shapes[op.name]
        terms = predict("gemm", gpu, implementation="vendor", context="graph", m=1, n=shape.n, k=shape.k,
                        weight_dtype="int4", group_size=32, scale_bytes=4.0).breakdown  # fmt: skip
        assert terms.dequant_s > 0
        stream = op.bytes_moved / (gpu.memory_bandwidth * Efficiency().memory)
        share = terms.dequant_s / (terms.dram_bytes / terms.achievable_bandwidth)
        assert op.realistic_time_s == pytest.approx(with_dequant(stream, share * stream, overlap), rel=1e-9)
        checked += 1
    assert checked == len(shapes)

    dearer = copy.deepcopy(load_calibration())
    vendor = dearer["gpus"][REFERENCE_GPU]["implementations"]["cublas"]["gemm"]["dequant"]["convert"]
    vendor["ops_per_weight"]["int4"] = 3.0
    slower = _llama_decode("int4", 32, calibration=dearer)
    assert slower.decode_step_realistic_s > 1.2 * int4.decode_step_realistic_s
    bf16, bf16_dearer = _llama_decode(None), _llama_decode(None, calibration=dearer)
    assert bf16_dearer.decode_step_realistic_s == pytest.approx(bf16.decode_step_realistic_s)
