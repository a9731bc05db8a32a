"""Tiny configs of every family llm_speed.integrations.transformers patches (no download), and the models the
tests compare: the one to patch, the same unpatched, and a float64 copy."""

from __future__ import annotations

import copy

import torch

transformers = __import__("pytest").importorskip(
    "transformers", reason="needs transformers: pip install -e '.[hf]' (in .[dev] too)"
)

VOCAB = 64
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
MOE = dict(num_experts_per_tok=2)
# model_type: (config class name, extra config), 2 layers: MoE families have a dense layer and a sparse one,
# Gemma-3 a sliding and a full one; the odd features of each family switched on
CONFIGS = {
    "llama": ("LlamaConfig", dict(head_dim=16)),
    "mistral": ("MistralConfig", dict(head_dim=16, sliding_window=4)),
    "mixtral": ("MixtralConfig", dict(head_dim=16, num_local_experts=4, sliding_window=4, **MOE)),
    "qwen2": ("Qwen2Config", dict()),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=4, moe_intermediate_size=24, mlp_only_layers=[0],
                                         shared_expert_intermediate_size=40, **MOE)),  # fmt: skip
    "qwen3_moe": ("Qwen3MoeConfig", dict(head_dim=16, num_experts=4, moe_intermediate_size=24,
                                         mlp_only_layers=[0], **MOE)),  # fmt: skip
    "gemma": ("GemmaConfig", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16)),
    "gemma3_text": ("Gemma3TextConfig", dict(
        head_dim=16, sliding_window=4, query_pre_attn_scalar=16, final_logit_softcapping=20.0,
        layer_types=["sliding_attention", "full_attention"])),  # fmt: skip
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, pad_token_id=0)),
    "olmo2": ("Olmo2Config", dict()),
    "granite": ("GraniteConfig", dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                                      attention_multiplier=0.2)),  # fmt: skip
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=2, moe_intermediate_size=16, n_routed_experts=4, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, rope_interleave=True, **MOE)),  # fmt: skip
}


ONE_LAYER = dict(mlp_only_layers=[], first_k_dense_replace=0)


def config(model_type: str, layers: int = 2):
    """The family's tiny config with ``layers`` layers (with 1, an MoE family's one layer is sparse)."""
    name, extra = CONFIGS[model_type]
    cls = getattr(transformers, name, None)
    if cls is None:  # never silently: the installed transformers lacks the family
        raise AssertionError(f"transformers {transformers.__version__} has no {name}")
    if layers == 1:  # MoE families: the one layer sparse; Gemma-3: the sliding one
        extra = {**extra, **{k: v for k, v in ONE_LAYER.items() if k in extra}}
        if "layer_types" in extra:
            extra["layer_types"] = extra["layer_types"][:1]
    return cls(**{**SMALL, **extra, "num_hidden_layers": layers})


def models(model_type: str, layers: int = 2, device="cpu", seed: int = 0):
    """The model to patch, the same unpatched, and a float64 copy; random, not unit, norm weights so a wrong
    offset or weight gradient shows; MoE experts in plain PyTorch (grouped_mm has no float64)."""
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_config(config(model_type, layers))
    if hasattr(base, "set_experts_implementation") and getattr(base.config, "_experts_implementation", None):
        base.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    base.to(device)
    return base, copy.deepcopy(base), copy.deepcopy(base).double()


def finite_float64_masks(monkeypatch, model_type: str = "gemma2"):
    """Eager attention (Gemma-2's default) takes its softmax in float32: float64's finfo.min in the mask
    becomes -inf there, and a row that sees no key (padding) NaN, which reaches real tokens through 0 * NaN.
    Clamped to float32's min, the float64 model computes what the float32 one does, without NaN."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    original = modeling.eager_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        if attention_mask is not None and attention_mask.dtype == torch.float64:
            attention_mask = attention_mask.clamp(min=torch.finfo(torch.float32).min)
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling, "eager_attention_forward", attention)
