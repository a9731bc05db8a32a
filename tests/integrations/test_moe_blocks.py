"""patch_moe_blocks: tiny Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3 models (2 layers) patched onto the
fused MoE kernels match the unpatched float64 model as closely as the unpatched float32 one (logits, loss
with the router aux loss, every parameter's gradient: the 2x/3x rule), keep the router logits, and train
alike."""

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install -e '.[hf]' (in .[dev] too)"
)

from llm_speed.core import runtime  # noqa: E402
from llm_speed.fused import swiglu  # noqa: E402
from llm_speed.integrations.moe_blocks import BLOCKS, patch_moe_blocks  # noqa: E402
from llm_speed.moe import routing  # noqa: E402

CAP = 1e-6  # about one float32 rounding unit at the size of the compared values
SMALL = dict(vocab_size=61, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=32)  # fmt: skip
MOE = dict(moe_intermediate_size=24, num_experts_per_tok=2, intermediate_size=40)
CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **SMALL, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.1
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SMALL, **MOE, num_experts=8, shared_expert_intermediate_size=40, norm_topk_prob=False,
        router_aux_loss_coef=0.1,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL, **MOE, num_experts=8, norm_topk_prob=True, head_dim=16, router_aux_loss_coef=0.1
    ),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **SMALL, **MOE, n_routed_experts=8, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=0, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, routed_scaling_factor=2.5,
    ),
}  # fmt: skip
KERNELS = [routing.ROUTE_FORWARD.name, routing.ROUTE_BACKWARD.name, routing.SORT_PLACE.name,
           "moe.grouped_gemm", "moe.combine", "moe.fused_moe_bwd", "moe.grouped_wgrad"]  # fmt: skip


def _models(model_type, device="cpu"):
    """The model to patch (Hugging Face's eager loop over experts), the same unpatched, a float64 copy."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(
        CONFIGS[model_type](), experts_implementation="eager"
    )
    with torch.no_grad():  # a correction bias that changes the choice, norms that are not all ones
        for name, buffer in base.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.normal_(0, 0.05)
        for name, p in base.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    base.to(device)
    return base, copy.deepcopy(base), copy.deepcopy(base).double()


def _step(model, ids, labels):
    """(output, router logits of each MoE layer, gradients). The router logits are read off the routers'
    outputs (their first element), as transformers' ``output_router_logits`` records them: not every version
    returns them (5.17's DeepSeek-V3 causal LM does not); where the output has them, they are these."""
    model.zero_grad()
    routers = [block.gate for block in model.modules() if type(block).__name__ in BLOCKS]
    router_logits = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: router_logits.append(out[0])) for r in routers]
    try:
        out = model(input_ids=ids, labels=labels, output_router_logits=True)
    finally:
        for hook in hooks:
            hook.remove()
    assert len(router_logits) == len(routers) == 2
    if getattr(out, "router_logits", None) is not None:
        assert len(out.router_logits) == 2
        assert all(torch.equal(a, b) for a, b in zip(out.router_logits, router_logits, strict=True))
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, router_logits, grads


def _error(x, truth):
    return (x.double() - truth).abs().max().item()


def _assert_rule(name, got, same, truth, factor):
    scale = max(1.0, truth.abs().max().item())
    bound = factor * _error(same, truth) + CAP * scale
    assert _error(got, truth) <= bound, f"{name}: {_error(got, truth):.3e} > {bound:.3e}"


@pytest.mark.parametrize("model_type", CONFIGS)
def test_patched_model_matches_float64(model_type, device):
    patched, same, truth = _models(model_type, device)
    names = patch_moe_blocks(patched)
    assert names == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert patch_moe_blocks(patched) == names  # a second call patches nothing more
    ids = torch.randint(0, 61, (1, 9), device=device)
    labels = ids.clone()
    labels[:, :2] = -100
    kernels = KERNELS + ([swiglu.FORWARD.name] if model_type in ("qwen2_moe", "deepseek_v3") else [])
    before = runtime.launch_counts()
    got, got_router, got_grads = _step(patched, ids, labels)
    ran = runtime.launch_counts() - before
    assert all(ran[k] > 0 for k in kernels), ran
    want, want_router, same_grads = _step(same, ids, labels)
    assert runtime.launch_counts() - before == ran, "the unpatched model ran llm_speed kernels"
    exact, exact_router, truth_grads = _step(truth, ids, labels)
    # the first layer's router sees the same input: the same logits, bit for bit
    assert torch.equal(got_router[0], want_router[0])
    for i, logits in enumerate(exact_router):
        _assert_rule(f"router_logits[{i}]", got_router[i].detach(), want_router[i].detach(), logits, 2.0)
    if model_type != "deepseek_v3":  # DeepSeek-V3's causal LM has no load-balancing loss
        _assert_rule("aux_loss", got.aux_loss.detach(), want.aux_loss.detach(), exact.aux_loss.detach(), 2.0)
    _assert_rule("logits", got.logits.detach(), want.logits.detach(), exact.logits.detach(), 2.0)
    _assert_rule("loss", got.loss.detach(), want.loss.detach(), exact.loss.detach(), 2.0)
    assert set(got_grads) == set(truth_grads)
    for name, grad in truth_grads.items():
        _assert_rule(name, got_grads[name], same_grads[name], grad, 3.0)


def test_short_training_run_matches_unpatched(device):
    """DeepSeek-V3: sigmoid routing with a correction bias and grouped top-k, shared experts, MLA."""
    patched, same, _ = _models("deepseek_v3", device)
    patch_moe_blocks(patched)
    ids = torch.randint(0, 61, (1, 9), device=device)
    losses = {}
    for label, model in (("patched", patched), ("unpatched", same)):
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[label] = []
        for _ in range(3):
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=ids, output_router_logits=True).loss
            loss.backward()
            optimizer.step()
            losses[label].append(loss.item())
    assert losses["patched"][-1] < losses["patched"][0]  # it learns
    torch.testing.assert_close(losses["patched"], losses["unpatched"], rtol=1e-4, atol=0)


def test_float64_falls_back_and_other_models_are_left_alone(device):
    _, _, truth = _models("mixtral", device)
    patch_moe_blocks(truth)
    before = runtime.launch_counts()
    truth(input_ids=torch.randint(0, 61, (1, 5), device=device))
    assert runtime.launch_counts() == before  # float64: the original code (the kernels take fp16/bf16/fp32)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, intermediate_size=40))
    assert patch_moe_blocks(llama) == []
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        patch_moe_blocks("mixtral")
