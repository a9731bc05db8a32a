"""Model zoo, Hugging Face config loading, parameter counts and GEMM shapes."""

import dataclasses
import json

import pytest

from llm_speed.perf.models import (
    GemmShape,
    ModelConfig,
    gemm_shapes,
    get_model,
    list_models,
    load_hf_config,
    param_count,
    resolve_model,
)
from llm_speed.perf.training import forward_layer_flops

# Totals published on each model's Hugging Face page (safetensors parameter count) or paper.
PUBLISHED_TOTALS = {
    "llama-2-7b": 6_738_415_616,
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3-8b": 8_030_261_248,
    "llama-3-70b": 70_553_706_496,
    "llama-3.1-405b": 405_853_388_800,
    "mistral-7b": 7_241_732_096,
    "mixtral-8x7b": 46_702_792_704,
    "qwen2.5-7b": 7_615_616_512,
    "qwen2.5-72b": 72_706_203_648,
}


def test_zoo_has_the_required_models():
    required = {
        "llama-2-7b",
        "llama-2-13b",
        "llama-2-70b",
        "llama-3-8b",
        "llama-3-70b",
        "llama-3.1-405b",
        "mistral-7b",
        "mixtral-8x7b",
        "qwen2.5-7b",
        "qwen2.5-72b",
        "deepseek-v3",
    }
    assert required <= set(list_models())
    for name in list_models():
        assert get_model(name).source.startswith("https://huggingface.co/")


@pytest.mark.parametrize("name", sorted(PUBLISHED_TOTALS))
def test_param_count_matches_published_totals(name):
    assert param_count(get_model(name)).total == PUBLISHED_TOTALS[name]


def test_llama3_8b_count_by_hand():
    # Independent arithmetic: embeddings and head 2*V*h; per layer q/o 2h^2, k/v 2*h*1024,
    # MLP 3*h*14336, 2 norms.
    h, v, layers = 4096, 128256, 32
    per_layer = 2 * h * h + 2 * h * 1024 + 3 * h * 14336 + 2 * h
    assert param_count(get_model("llama-3-8b")).total == 2 * v * h + layers * per_layer + h


def test_moe_totals_and_active():
    mixtral = param_count(get_model("mixtral-8x7b"))
    assert mixtral.active == 12_879_925_248  # 12.9B active (Mixtral paper: 13B)
    assert mixtral.routed_experts == 8 * 3 * 4096 * 14336 * 32
    deepseek = param_count(get_model("deepseek-v3"))
    assert deepseek.total == pytest.approx(671e9, rel=0.005)  # DeepSeek-V3 report: 671B total
    assert deepseek.active == pytest.approx(37e9, rel=0.02)  # and 37B activated
    assert param_count(get_model("llama-3-8b")).active == param_count(get_model("llama-3-8b")).total


def test_attention_types():
    assert get_model("llama-2-7b").attention_type == "MHA"
    assert get_model("llama-3-8b").attention_type == "GQA"
    assert get_model("deepseek-v3").attention_type == "MLA"
    mqa = dataclasses.replace(get_model("llama-2-7b"), num_kv_heads=1)
    assert mqa.attention_type == "MQA"


@pytest.mark.parametrize(
    "alias,expected",
    [
        ("meta-llama/Meta-Llama-3-8B-Instruct", "llama-3-8b"),
        ("Llama_2_7b_HF", "llama-2-7b"),
        ("MIXTRAL", "mixtral-8x7b"),
        ("Qwen/Qwen2.5-72B-Instruct", "qwen2.5-72b"),
        ("deepseek-ai/DeepSeek-V3", "deepseek-v3"),
    ],
)
def test_aliases(alias, expected):
    assert get_model(alias).name == expected


def test_unknown_model_lists_valid_ids():
    with pytest.raises(ValueError, match="llama-3-8b.*deepseek-v3"):
        get_model("gpt-5")
    with pytest.raises(TypeError):
        get_model(7)


def test_model_config_validation():
    base = get_model("llama-3-8b")
    with pytest.raises(ValueError, match="valid num_kv_heads: 1, 2, 4, 8, 16, 32"):
        dataclasses.replace(base, num_kv_heads=5)
    with pytest.raises(ValueError, match="hidden_size"):
        dataclasses.replace(base, hidden_size=-1)
    with pytest.raises(ValueError, match="experts_per_token"):
        dataclasses.replace(base, num_experts=4, experts_per_token=5, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="MLA"):
        dataclasses.replace(base, kv_lora_rank=512)


def _write(tmp_path, name, data):
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(data))
    return directory


def _same_shape(loaded: ModelConfig, zoo: ModelConfig) -> bool:
    return dataclasses.replace(loaded, name=zoo.name, source=zoo.source) == zoo


def test_load_hf_llama_mixtral_qwen(tmp_path):
    llama = {
        "model_type": "llama",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "_name_or_path": "meta-llama/Meta-Llama-3-8B",
    }
    loaded = load_hf_config(_write(tmp_path, "llama", llama))
    assert _same_shape(loaded, get_model("llama-3-8b"))
    assert loaded.name == "meta-llama/Meta-Llama-3-8B"

    mixtral = {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "sliding_window": None,
        "hidden_act": "silu",
    }
    assert _same_shape(
        load_hf_config(_write(tmp_path, "mixtral", mixtral) / "config.json"), get_model("mixtral-8x7b")
    )

    qwen = {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    assert _same_shape(load_hf_config(_write(tmp_path, "qwen", qwen)), get_model("qwen2.5-7b"))


def test_load_hf_deepseek_v3(tmp_path):
    deepseek = {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "topk_method": "noaux_tc",
        "vocab_size": 129280,
        "max_position_embeddings": 163840,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    path = _write(tmp_path, "dsv3", deepseek)
    assert _same_shape(load_hf_config(path), get_model("deepseek-v3"))
    assert resolve_model(str(path)).attention_type == "MLA"


# Released configs (the keys that matter) and their published parameter counts (total, active), in
# billions: the model cards of Qwen/Qwen3-30B-A3B (30.5, 3.3), Qwen/Qwen1.5-MoE-A2.7B (14.3, 2.7),
# allenai/OLMo-2-1124-7B (7.30), google/gemma-7b (8.54), ibm-granite/granite-3.1-8b-base (8.17); Gemma-3 4B's
# 4.3B less its 0.42B vision encoder (google/gemma-3-4b-pt; the text model alone: 3.88).
FAMILY_CONFIGS = {
    "qwen3_moe": (dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                       head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                       num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
                       tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[]), (30.5, 3.3)),
    "qwen2_moe": (dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16,
                       intermediate_size=5632, moe_intermediate_size=1408,
                       shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
                       vocab_size=151936, max_position_embeddings=8192, tie_word_embeddings=False),
                  (14.3, 2.7)),
    "olmo2": (dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=11008,
                   vocab_size=100352, max_position_embeddings=4096, tie_word_embeddings=False), (7.30, 7.30)),
    "gemma": (dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=16,
                   head_dim=256, intermediate_size=24576, vocab_size=256000, max_position_embeddings=8192,
                   hidden_activation="gelu_pytorch_tanh"), (8.54, 8.54)),
    "granite": (dict(hidden_size=4096, num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=12800, vocab_size=49155, max_position_embeddings=131072,
                     tie_word_embeddings=True), (8.17, 8.17)),
    "gemma3_text": (dict(hidden_size=2560, num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4,
                         head_dim=256, intermediate_size=10240, vocab_size=262208,
                         max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh"),
                    (3.88, 3.88)),
}  # fmt: skip


@pytest.mark.parametrize("model_type", FAMILY_CONFIGS)
def test_load_hf_families_match_published_parameter_counts(model_type, tmp_path):
    keys, (total, active) = FAMILY_CONFIGS[model_type]
    keys = {"model_type": model_type, "hidden_act": "silu", **keys}
    config = load_hf_config(_write(tmp_path, model_type, keys))
    count = param_count(config)
    assert count.total / 1e9 == pytest.approx(total, rel=0.01)
    assert count.active / 1e9 == pytest.approx(active, rel=0.03)
    assert config.tie_embeddings == (model_type in ("gemma", "gemma3_text", "granite"))
    assert config.attention_bias == (model_type == "qwen2_moe")


def test_load_hf_qwen_moe_refuses_what_it_cannot_model(tmp_path):
    keys = dict(FAMILY_CONFIGS["qwen2_moe"][0], model_type="qwen2_moe")
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        load_hf_config(_write(tmp_path, "a", {**keys, "decoder_sparse_step": 2}))
    with pytest.raises(ValueError, match="mlp_only_layers"):
        load_hf_config(_write(tmp_path, "b", {**keys, "mlp_only_layers": [0]}))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size 1000 is not a multiple"):
        load_hf_config(_write(tmp_path, "c", {**keys, "shared_expert_intermediate_size": 1000}))


def test_load_hf_bad_input(tmp_path):
    with pytest.raises(ValueError, match="no such"):
        load_hf_config(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_hf_config(bad)
    with pytest.raises(ValueError, match="supported: llama, mistral"):
        load_hf_config(_write(tmp_path, "gpt2", {"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="lacks the key 'intermediate_size'"):
        load_hf_config(
            _write(
                tmp_path,
                "partial",
                {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2},
            )
        )


@pytest.mark.parametrize(
    ("field", "value"), [("num_attention_heads", 0), ("hidden_size", "4096"), ("num_hidden_layers", 2.5)]
)
def test_load_hf_rejects_non_positive_int_fields(tmp_path, field, value):
    with pytest.raises(ValueError, match=f"{field} must be a positive integer"):
        load_hf_config(_write(tmp_path, "bad_field", {**_SMALL_LLAMA, field: value}))


_SMALL_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 128,
}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"model_type": "mistral", "sliding_window": "4096"}, "sliding_window must be an integer >= 0"),
        ({"model_type": "mistral", "sliding_window": -1}, "sliding_window must be an integer >= 0"),
        (
            {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
             "max_window_layers": "x"},
            "max_window_layers must be an integer >= 0",
        ),
        ({"model_type": "qwen2", "use_sliding_window": "yes"}, "use_sliding_window must be true or false"),
        (
            {"model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "shared_expert_intermediate_size": "64"},
            "shared_expert_intermediate_size must be an integer >= 0",
        ),
        ({"num_key_value_heads": "2"}, "num_key_value_heads must be a positive integer"),
        ({"head_dim": 0}, "head_dim must be a positive integer"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
        ({"attention_bias": 1}, "attention_bias must be true or false"),
        ({"hidden_act": 5}, "hidden_act must be a string"),
        (
            {"model_type": "deepseek_v3", "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
             "v_head_dim": 16, "n_routed_experts": "4"},
            "n_routed_experts must be an integer >= 0",
        ),
    ],
)  # fmt: skip
def test_load_hf_rejects_wrong_typed_optional_keys(tmp_path, extra, message):
    # These were used unchecked: a TypeError deep inside, or a string silently taken as true.
    path = _write(tmp_path, "bad_optional", {**_SMALL_LLAMA, **extra})
    with pytest.raises(ValueError, match=f"config '.*bad_optional.*': {message}"):
        load_hf_config(path)


def test_load_hf_optional_keys_null_or_ignored(tmp_path):
    # null means absent; Llama ignores sliding_window, so its value is not checked.
    nulls = {"num_key_value_heads": None, "head_dim": None, "tie_word_embeddings": None, "sliding_window": -1}
    config = load_hf_config(_write(tmp_path, "nulls", {**_SMALL_LLAMA, **nulls}))
    assert (config.num_kv_heads, config.head_dim, config.sliding_window) == (4, 16, None)
    mistral = {**_SMALL_LLAMA, "model_type": "mistral", "sliding_window": None}
    assert load_hf_config(_write(tmp_path, "mistral", mistral)).sliding_window is None


def test_load_hf_not_utf8_names_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=f"config path '{path}' is not UTF-8"):
        load_hf_config(path)


def test_load_hf_qwen2_sliding_window_layers(tmp_path):
    raw = {
        "model_type": "qwen2",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 4,
        "intermediate_size": 128,
        "vocab_size": 100,
        "max_position_embeddings": 128,
        "use_sliding_window": True,
        "sliding_window": 16,
    }
    # Layers from index max_window_layers on are windowed: 0 windows all, >= num_layers none.
    assert load_hf_config(_write(tmp_path, "all", {**raw, "max_window_layers": 0})).sliding_window == 16
    assert load_hf_config(_write(tmp_path, "none", {**raw, "max_window_layers": 4})).sliding_window is None
    off = {**raw, "use_sliding_window": False, "max_window_layers": 0}
    assert load_hf_config(_write(tmp_path, "off", off)).sliding_window is None
    with pytest.raises(ValueError, match="max_window_layers"):
        load_hf_config(_write(tmp_path, "mixed", {**raw, "max_window_layers": 2}))


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen2.5-7b", "deepseek-v3"])
def test_gemm_tiling_agree_with_forward_flops(name):
    # 4096 tokens: DeepSeek's 256 experts get exactly 4096*8/256 = 128 tokens each, so balanced m is exact.
    config = get_model(name)
    shapes = gemm_shapes(config, 4096)
    layers = forward_layer_flops(config, batch_size=1, seq_len=4096)
    weight_flops = sum(layer.count * (layer.attention_projections + layer.mlp) for layer in layers)
    lm_head = 2 * 4096 * config.hidden_size * config.vocab_size
    assert sum(shape.flops for shape in shapes) == weight_flops + lm_head


def test_gemm_tiling_of_llama():
    shapes = {s.name: s for s in gemm_shapes(get_model("llama-3-8b"), 16, lm_head_tokens=2)}
    assert shapes["qkv"] == GemmShape("qkv", 16, (32 + 2 * 8) * 128, 4096, 32)
    assert shapes["gate_up"] == GemmShape("gate_up", 16, 2 * 14336, 4096, 32)
    assert shapes["down"] == GemmShape("down", 16, 4096, 14336, 32)
    assert shapes["lm_head"] == GemmShape("lm_head", 2, 128256, 4096, 1)
    assert gemm_shapes("llama-3-8b", 16, lm_head_tokens=2) == list(shapes.values())
    assert param_count("llama-3-8b") == param_count(get_model("llama-3-8b"))
    moe = {s.name: s for s in gemm_shapes(get_model("mixtral-8x7b"), 1)}
    assert moe["expert_gate_up"].count == 2 * 32 and moe["expert_gate_up"].m == 1  # top-2 experts, 1 token
    with pytest.raises(ValueError, match="num_tokens"):
        gemm_shapes(get_model("llama-3-8b"), 0)


def test_perf_package_exports_every_area():
    import llm_speed.perf as perf

    for name in ("analyze_inference", "kv_cache_size", "train_memory", "training_flops", "load_hf_config"):
        assert name in perf.__all__
    assert all(hasattr(perf, name) for name in perf.__all__)
