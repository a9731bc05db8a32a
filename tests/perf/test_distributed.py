"""Collectives, ZeRO, TP/PP/EP costs and the per-GPU training memory, with seed 003's worked examples."""

import pytest

from llm_speed.perf.distributed import (
    MIXED_PRECISION_ADAM_BYTES_PER_PARAM,
    _stage_params,
    collective_cost,
    context_parallel_kv_bytes_per_layer,
    gradient_accumulation_steps,
    link_bandwidth,
    model_state_memory,
    moe_all_to_all,
    pipeline_bubble,
    tp_communication_per_layer,
    train_memory,
    zero_communication_bytes,
)
from llm_speed.perf.models import attention_params_per_layer, get_model, param_count
from llm_speed.perf.training import activation_bytes_per_layer

MIB = 2**20


def test_ring_all_reduce_seed_003():
    # 2(N-1) steps of D/N: 2(N-1)D/N per GPU, -> 2D, independent of N; time 2(N-1)(a + D/(N*B)).
    d, bandwidth, latency = 1e9, 100e9, 5e-6
    cost = collective_cost("all_reduce", d, 8, bandwidth, latency_s=latency)
    assert cost.steps == 14 and cost.bytes_per_step == d / 8
    assert cost.bytes_sent_per_gpu == 2 * 7 / 8 * d
    assert cost.time_s == pytest.approx(14 * (latency + d / (8 * bandwidth)))
    big = collective_cost("all_reduce", d, 1024, bandwidth)
    assert big.bytes_sent_per_gpu == pytest.approx(2 * d, rel=1e-3)
    assert collective_cost("all_reduce", d, 1, bandwidth).time_s == 0


@pytest.mark.parametrize("op", ["reduce_scatter", "all_gather", "all_to_all"])
def test_half_collectives(op):
    cost = collective_cost(op, 800.0, 4, 100.0)
    assert cost.steps == 3 and cost.bytes_sent_per_gpu == 600.0 and cost.time_s == pytest.approx(6.0)


def test_collective_bad_input():
    with pytest.raises(ValueError, match="all_reduce, reduce_scatter"):
        collective_cost("broadcast", 1, 2, 1)
    with pytest.raises(ValueError, match="num_gpus"):
        collective_cost("all_reduce", 1, 0, 1)
    with pytest.raises(ValueError, match="bandwidth"):
        collective_cost("all_reduce", 1, 2, 0)
    with pytest.raises(ValueError, match="size_bytes"):
        collective_cost("all_reduce", -1, 2, 1)


def test_link_bandwidth():
    assert link_bandwidth("h100-sxm") == 450e9  # 900 GB/s bidirectional NVLink 4
    assert link_bandwidth("h100-sxm", "pcie") == pytest.approx(64e9)
    with pytest.raises(ValueError, match="no NVLink"):
        link_bandwidth("l4")
    with pytest.raises(ValueError, match="nvlink, pcie"):
        link_bandwidth("h100-sxm", "infiniband")


def test_16_bytes_per_param():
    assert MIXED_PRECISION_ADAM_BYTES_PER_PARAM == 16
    assert model_state_memory(1e9).bytes_per_param == 16


@pytest.mark.parametrize("stage,gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage, gb):
    # ZeRO paper, Figure 1: 7.5B parameters, 64 GPUs, K = 12.
    assert model_state_memory(7.5e9, dp=64, zero_stage=stage).total_bytes / 1e9 == pytest.approx(gb, abs=0.05)


def test_zero_communication_seed_003():
    base = zero_communication_bytes(1e9, dp=64, zero_stage=2)
    assert base == pytest.approx(2 * 63 / 64 * 2e9)
    assert zero_communication_bytes(1e9, dp=64, zero_stage=3) / base == 1.5  # "1.5x communication"
    with pytest.raises(ValueError, match="zero_stage"):
        model_state_memory(1e9, zero_stage=4)


def test_pipeline_bubbles_seed_003():
    p, m = 4, 8
    gpipe = pipeline_bubble(p, m, schedule="gpipe")
    assert gpipe.bubble_fraction == pytest.approx(3 / 11)  # (p-1)/(m+p-1)
    assert gpipe.bubble_to_ideal == pytest.approx(3 / 8)  # Megatron's (p-1)/m
    one_f_one_b = pipeline_bubble(p, m)
    assert one_f_one_b.bubble_fraction == gpipe.bubble_fraction
    assert (gpipe.microbatches_in_flight, one_f_one_b.microbatches_in_flight) == (8, 4)
    interleaved = pipeline_bubble(p, m, schedule="interleaved", virtual_stages=2)
    assert interleaved.bubble_fraction == pytest.approx(3 / 19)  # (p-1)/(m*v+p-1)
    assert interleaved.bubble_to_ideal == pytest.approx(3 / 16)  # Megatron's (p-1)/(v*m)
    # Interleaving stashes more on the first stage: 4 * (1 + 3/8) (Korthikanti et al. 2022, section 4.2.3).
    assert interleaved.microbatches_in_flight == pytest.approx(4 * (1 + 3 / 8))
    with pytest.raises(ValueError, match="multiple of pp"):
        pipeline_bubble(4, 6, schedule="interleaved", virtual_stages=2)
    with pytest.raises(ValueError, match="needs schedule='interleaved'"):
        pipeline_bubble(4, 8, virtual_stages=2)
    with pytest.raises(ValueError, match="gpipe, 1f1b, interleaved"):
        pipeline_bubble(4, 8, schedule="zero-bubble")


def test_moe_all_to_all_seed_003():
    # B=4096 tokens, top_k=2, d=4096, fp16, EP=8: 64 MB per all-to-all, 128 MB per layer, 64 layers 8.2 "GB".
    result = moe_all_to_all(tokens_per_gpu=4096, hidden_size=4096, experts_per_token=2, ep=8, dtype="fp16")
    assert result.bytes_per_all_to_all == 64 * MIB
    assert result.forward_bytes_per_layer == 128 * MIB
    assert 64 * result.forward_bytes_per_layer == 8192 * MIB
    assert result.remote_bytes_per_all_to_all == 64 * MIB * 7 / 8
    assert result.training_bytes_per_layer == 256 * MIB
    timed = moe_all_to_all(
        tokens_per_gpu=4096,
        hidden_size=4096,
        experts_per_token=2,
        ep=8,
        dtype="fp16",
        bandwidth_bytes_per_s=100e9,
    )
    assert timed.forward_time_per_layer_s == pytest.approx(2 * 7 / 8 * 64 * MIB / 100e9)


def test_seed_003_trillion_moe_weights():
    # Seed 003's 1T MoE plan: dense 50B / TP8 / PP16 * 2 bytes = 0.78 GB;
    # experts 950B / TP8 / EP16 * 2 bytes = 14.8 GB.
    assert model_state_memory(50e9 / (8 * 16)).params_bytes == pytest.approx(0.78e9, rel=0.01)
    assert model_state_memory(950e9 / (8 * 16)).params_bytes == pytest.approx(14.8e9, rel=0.01)


def test_tp_communication():
    comm = tp_communication_per_layer(
        "llama-3-70b", seq_len=4096, micro_batch_size=1, tp=8, bandwidth_bytes_per_s=450e9
    )
    message = 4096 * 8192 * 2
    assert comm.message_bytes == message
    assert comm.bytes_sent_per_gpu == 4 * 2 * 7 / 8 * message
    assert comm.time_s == pytest.approx(comm.bytes_sent_per_gpu / 450e9)


def test_context_parallel_and_accumulation():
    assert context_parallel_kv_bytes_per_layer("llama-3-8b", seq_len=8192, micro_batch_size=1, cp=4) == (
        3 * 2048 * 2 * 8 * 128 * 2
    )
    with pytest.raises(ValueError, match="divide seq_len"):
        context_parallel_kv_bytes_per_layer("llama-3-8b", seq_len=100, micro_batch_size=1, cp=3)
    assert gradient_accumulation_steps(1024, 4, 8) == 32
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        gradient_accumulation_steps(1000, 4, 8)


def test_train_memory_single_gpu_is_16_bytes_per_param():
    result = train_memory("llama-3-8b", gpus=1, seq_len=1024)
    assert (
        result.params_bytes + result.grads_bytes + result.optimizer_bytes
        == 16 * param_count(get_model("llama-3-8b")).total
    )
    assert result.activation_bytes == 32 * activation_bytes_per_layer(
        "llama-3-8b", seq_len=1024, micro_batch_size=1
    )
    assert result.bubble_fraction == 0 and result.dp_grad_sync_bytes == 0


def test_train_memory_tp_pp_dp_by_hand():
    config = get_model("llama-3-70b")
    result = train_memory(
        config, gpus=64, tp=8, pp=2, dp=4, zero=1, num_microbatches=8, seq_len=4096, gpu="h100-sxm"
    )
    h, v = 8192, 128256
    layer = attention_params_per_layer(config) / 8 + 3 * h * 28672 / 8 + 2 * h
    stage0 = 40 * layer + v * h / 8
    stage1 = 40 * layer + v * h / 8 + h
    # Stage 1 has the final norm on top, but stage 0 stashes 2 micro-batches of activations (1F1B) against 1.
    per_layer = activation_bytes_per_layer(
        config, seq_len=4096, micro_batch_size=1, tp=8, sequence_parallel=True
    )
    assert 7 * stage1 + 40 * per_layer < 7 * stage0 + 2 * 40 * per_layer  # ZeRO-1 over dp 4: 2+2+12/4 B/param
    assert result.stage == 0 and result.params_per_gpu == pytest.approx(stage0)
    assert result.activation_bytes == pytest.approx(2 * 40 * per_layer)
    assert result.optimizer_bytes == pytest.approx(12 * stage0 / 4)
    assert result.params_bytes == pytest.approx(2 * stage0) and result.grads_bytes == pytest.approx(
        2 * stage0
    )
    assert result.bubble_fraction == pytest.approx(1 / 9)
    assert result.sequence_parallel and result.fits is True


def test_train_memory_moe():
    result = train_memory("mixtral-8x7b", gpus=16, tp=2, ep=8, zero=1, seq_len=2048)
    assert result.dp == 8 and result.moe_all_to_all_bytes_per_layer > 0
    dense = train_memory("mixtral-8x7b", gpus=16, tp=2, ep=1, zero=1, seq_len=2048)
    assert result.params_per_gpu < dense.params_per_gpu / 4


@pytest.mark.parametrize(
    ("model", "pp", "heaviest_stage"),
    [("deepseek-v3", 16, 1), ("llama-3.1-405b", 16, 0), ("llama-3-8b", 5, 0)],
)
def test_uneven_pipeline_stages_hold_every_parameter_once(model, pp, heaviest_stage):
    # 61 and 126 layers do not split evenly over 16 stages; the stages together still hold the whole model.
    config = get_model(model)
    held = sum(sum(_stage_params(config, stage, pp, 1, 1)) for stage in range(pp))
    assert held == param_count(config).total
    result = train_memory(model, gpus=pp, pp=pp, seq_len=1024)
    # Dense: the first stage (most layers, the embedding, most stashed micro-batches). DeepSeek-V3: stage 1,
    # whose 4 MoE layers outweigh stage 0's 3 dense + 1 MoE layers.
    assert result.stage == heaviest_stage


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(model="llama-3-70b", gpus=64, tp=3), "valid tp: 1, 2, 4, 8"),
        (dict(model="llama-3-8b", gpus=8, tp=2, pp=2, dp=3), "must equal gpus"),
        (dict(model="llama-3-8b", gpus=10, tp=4), "multiple of tp"),
        (dict(model="llama-3-8b", gpus=64, pp=64), r"pp \(64\) must be at most num_layers \(32\)"),
        (dict(model="llama-3-8b", gpus=2, ep=2), "needs an MoE model"),
        (dict(model="mixtral-8x7b", gpus=6, ep=3), "ep"),
        (dict(model="llama-3-8b", gpus=1, zero=4), "zero must be one of"),
        (dict(model="llama-3-8b", gpus=2, cp=2, seq_len=101), "cp"),
        (dict(model="nope", gpus=1), "valid ids"),
    ],
)
def test_train_memory_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        train_memory(kwargs.pop("model"), **kwargs)
