"""Training FLOPs (6ND, Megatron's formula) and activation memory (Korthikanti et al.)."""

import dataclasses

import pytest

from llm_speed.perf.models import ModelConfig, get_model, param_count
from llm_speed.perf.training import (
    RECOMPUTE_MODES,
    activation_bytes_per_layer,
    activation_memory,
    attention_pairs,
    forward_layer_flops,
    korthikanti_activation_bytes_per_layer,
    megatron_training_flops,
    microbatches_in_flight,
    pipeline_stage_layers,
    stage_layer_mix,
    training_flops,
    training_flops_6nd,
)

# GPT-3 175B as in Megatron-LM's papers: MHA, 4h GeLU MLP, vocabulary 51200.
GPT3 = ModelConfig(
    "gpt3-175b", 12288, 96, 96, 96, 128, 4 * 12288, 51200, 2048, gated_mlp=False, activation="gelu"
)


def test_6nd():
    assert training_flops_6nd(70e9, 1.4e12) == pytest.approx(5.88e23)  # Chinchilla
    assert training_flops_6nd(175e9, 300e9) == pytest.approx(3.15e23)  # GPT-3 (paper: 3.14e23)
    with pytest.raises(ValueError):
        training_flops_6nd(-1, 1)


def test_megatron_formula_by_hand():
    # B=1, s=4, l=1, h=8, V=16: 72*4*64*(1 + 4/48 + 16/96) = 18432 * 1.25; with recompute 96*256*(1+1/12+1/8).
    assert megatron_training_flops(
        batch_size=1, seq_len=4, num_layers=1, hidden_size=8, vocab_size=16, recompute=False
    ) == pytest.approx(23040)
    assert megatron_training_flops(
        batch_size=1, seq_len=4, num_layers=1, hidden_size=8, vocab_size=16
    ) == pytest.approx(24576 * (1 + 1 / 12 + 1 / 8))


@pytest.mark.parametrize("recompute", [False, True])
def test_exact_count_equals_megatron_for_gpt3(recompute):
    expected = megatron_training_flops(
        batch_size=1536, seq_len=2048, num_layers=96, hidden_size=12288, vocab_size=51200, recompute=recompute
    )
    result = training_flops(
        GPT3,
        batch_size=1536,
        seq_len=2048,
        causal=False,
        recompute="full" if recompute else "none",
        flash_attention=False,
    )
    assert result.hardware_flops == pytest.approx(expected, rel=1e-12)
    assert result.model_flops == pytest.approx(expected * (3 / 4 if recompute else 1), rel=0.01)


def test_per_layer_forward_flops_gpt():
    (layer,) = forward_layer_flops(GPT3, batch_size=2, seq_len=2048, causal=False)
    b, s, h = 2, 2048, 12288
    assert layer.attention_projections == 8 * b * s * h * h
    assert layer.mlp == 16 * b * s * h * h
    assert layer.attention_core == 4 * b * s * s * h  # Megatron: 24Bsh^2 + 4Bs^2h in total


def test_causal_halving_and_window():
    assert attention_pairs(4, causal=False) == 16
    assert attention_pairs(4, causal=True) == 10
    assert attention_pairs(5, causal=True, sliding_window=2) == 1 + 2 + 2 + 2 + 2
    full = forward_layer_flops("llama-3-8b", batch_size=1, seq_len=1024, causal=False)[0].attention_core
    causal = forward_layer_flops("llama-3-8b", batch_size=1, seq_len=1024, causal=True)[0].attention_core
    assert causal / full == pytest.approx(1025 / 2048)


def test_6nd_close_to_exact_for_llama3_8b():
    result = training_flops("llama-3-8b", batch_size=1, seq_len=2048, causal=True)
    # 6ND with the FLOP-doing parameters (no embedding lookup) misses only the attention core: ~3.5% here.
    params = param_count(get_model("llama-3-8b"))
    assert result.six_nd == 6 * (params.total - params.embedding) * 2048
    core = sum(layer.attention_core * layer.count for layer in result.layers)
    # ... and counts the norm weights, which do no matmul work.
    assert result.model_flops == pytest.approx(result.six_nd - 6 * params.norms * 2048 + 3 * core, rel=1e-12)


def test_recompute_modes():
    none = training_flops("llama-3-8b", batch_size=1, seq_len=512, flash_attention=False)
    selective = training_flops(
        "llama-3-8b", batch_size=1, seq_len=512, recompute="selective", flash_attention=False
    )
    full = training_flops("llama-3-8b", batch_size=1, seq_len=512, recompute="full", flash_attention=False)
    core = sum(layer.attention_core * layer.count for layer in none.layers)
    assert none.hardware_flops == none.model_flops
    assert selective.hardware_flops - none.hardware_flops == pytest.approx(core)
    assert full.hardware_flops - none.hardware_flops == pytest.approx(none.forward - none.lm_head)
    flash = training_flops("llama-3-8b", batch_size=1, seq_len=512)
    scores = sum(layer.attention_scores * layer.count for layer in flash.layers)
    assert flash.recompute_flops == pytest.approx(scores)  # FlashAttention's backward recomputes QK^T
    with pytest.raises(ValueError, match="recompute must be one of"):
        training_flops("llama-3-8b", batch_size=1, seq_len=8, recompute="sometimes")


def test_moe_forward_counts_only_routed_experts():
    (layer,) = forward_layer_flops("mixtral-8x7b", batch_size=1, seq_len=100)
    assert layer.mlp == 2 * 100 * 4096 * 8 + 2 * 100 * 2 * 3 * 4096 * 14336


def test_korthikanti_numbers():
    # sbh(34 + 5as/h) for GPT-3, s = 2048, b = 1: 2048*12288*(34 + 80) bytes.
    assert (
        korthikanti_activation_bytes_per_layer(
            seq_len=2048, micro_batch_size=1, hidden_size=12288, num_heads=96
        )
        == 2048 * 12288 * 114
    )
    # TP = 8 with SP and selective recompute: sbh * 34/8.
    assert (
        korthikanti_activation_bytes_per_layer(
            seq_len=2048,
            micro_batch_size=1,
            hidden_size=12288,
            num_heads=96,
            tp=8,
            sequence_parallel=True,
            recompute="selective",
        )
        == 2048 * 12288 * 34 / 8
    )


@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("recompute", RECOMPUTE_MODES)
def test_itemised_activations_reproduce_korthikanti_table2(tp, sequence_parallel, recompute):
    kwargs = dict(
        seq_len=2048, micro_batch_size=2, tp=tp, sequence_parallel=sequence_parallel, recompute=recompute
    )
    itemised = activation_bytes_per_layer(GPT3, flash_attention=False, dropout=True, **kwargs)
    paper = korthikanti_activation_bytes_per_layer(hidden_size=12288, num_heads=96, **kwargs)
    assert itemised == pytest.approx(paper, rel=1e-12)


def test_flash_attention_drops_the_quadratic_term():
    small = activation_bytes_per_layer("llama-3-8b", seq_len=1024, micro_batch_size=1)
    large = activation_bytes_per_layer("llama-3-8b", seq_len=4096, micro_batch_size=1)
    assert large / small == pytest.approx(4.0)  # linear in s with FlashAttention


def test_pipeline_activation_memory():
    one = activation_memory("llama-3-8b", seq_len=2048, micro_batch_size=1, pp=1, num_microbatches=8)
    four = activation_memory("llama-3-8b", seq_len=2048, micro_batch_size=1, pp=4, num_microbatches=8)
    # 1F1B: the first stage holds p micro-batches of L/p layers = L layers' worth, whatever p.
    assert four.total_bytes == pytest.approx(one.total_bytes)  # pp=1 holds 1 micro-batch of all L layers
    assert four.microbatches_in_flight == 4 and four.layers_per_stage == 8
    gpipe = activation_memory(
        "llama-3-8b", seq_len=2048, micro_batch_size=1, pp=4, num_microbatches=8, schedule="gpipe"
    )
    assert gpipe.total_bytes == pytest.approx(four.total_bytes * 2)
    interleaved = activation_memory(
        "llama-3-8b",
        seq_len=2048,
        micro_batch_size=1,
        pp=4,
        num_microbatches=8,
        schedule="interleaved",
        virtual_stages=2,
    )
    assert interleaved.total_bytes == pytest.approx(four.total_bytes * (1 + 3 / 8))
    with pytest.raises(ValueError, match=r"pp \(33\) must be at most num_layers \(32\)"):
        activation_memory("llama-3-8b", seq_len=2048, micro_batch_size=1, pp=33)
    # 2 x 32 model chunks for 32 layers: half a layer per chunk, a layout no framework builds.
    with pytest.raises(ValueError, match=r"virtual_stages \(2\*32 = 64\) must be at most num_layers \(32\)"):
        activation_memory("llama-3-8b", seq_len=2048, micro_batch_size=1, pp=2, schedule="interleaved",
                          virtual_stages=32)  # fmt: skip
    most = activation_memory("llama-3-8b", seq_len=2048, micro_batch_size=1, pp=2, schedule="interleaved",
                             virtual_stages=16)  # fmt: skip
    assert most.layers_per_stage == 16


def test_microbatches_in_flight_by_stage():
    # 1F1B: stage s runs p - s forwards before its first backward; GPipe keeps every micro-batch.
    assert [microbatches_in_flight("1f1b", 4, 8, stage=s) for s in range(4)] == [4, 3, 2, 1]
    assert microbatches_in_flight("1f1b", 4, 2) == 2  # fewer micro-batches than stages
    assert microbatches_in_flight("gpipe", 4, 8, stage=3) == 8
    assert microbatches_in_flight("interleaved", 4, 8, virtual_stages=2) == pytest.approx(4 * 11 / 8)
    with pytest.raises(ValueError, match="stage must be in 0..3"):
        microbatches_in_flight("1f1b", 4, 8, stage=4)


def test_uneven_pipeline_stages():
    # 61 layers (DeepSeek-V3) on 16 stages: 13 stages of 4, 3 of 3; the extra layers go to the first stages.
    assert pipeline_stage_layers(61, 16) == (4,) * 13 + (3,) * 3
    assert pipeline_stage_layers(126, 16) == (8,) * 14 + (7,) * 2  # Llama-3.1-405B
    assert pipeline_stage_layers(32, 4) == (8, 8, 8, 8)
    assert sum(pipeline_stage_layers(37, 5)) == 37
    deepseek = get_model("deepseek-v3")
    assert stage_layer_mix(deepseek, 0, 16) == (3, 1)  # the 3 leading dense layers + 1 MoE layer
    assert stage_layer_mix(deepseek, 15, 16) == (0, 3)
    # pp = 5 on 32 layers: the first stage holds 7 layers, 5 micro-batches of them under 1F1B.
    five = activation_memory("llama-3-8b", seq_len=2048, micro_batch_size=1, pp=5, num_microbatches=8)
    per_layer = activation_bytes_per_layer("llama-3-8b", seq_len=2048, micro_batch_size=1)
    assert five.layers_per_stage == 7
    assert five.total_bytes == pytest.approx(7 * 5 * per_layer)
    with pytest.raises(ValueError, match="pp"):
        pipeline_stage_layers(4, 0)
    with pytest.raises(ValueError, match="schedule must be one of"):
        activation_memory("llama-3-8b", seq_len=2048, micro_batch_size=1, schedule="zb")


def test_bad_sizes():
    with pytest.raises(ValueError, match="seq_len"):
        training_flops("llama-3-8b", batch_size=1, seq_len=0)
    with pytest.raises(ValueError, match="tp"):
        activation_bytes_per_layer("llama-3-8b", seq_len=8, micro_batch_size=1, tp=0)
    tiny = dataclasses.replace(GPT3, num_layers=2)
    assert activation_memory(tiny, seq_len=8, micro_batch_size=1, pp=2).layers_per_stage == 1
