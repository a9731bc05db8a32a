"""Hugging Face integration: tiny random models patched in one line match the unpatched float64 model."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llm_speed import _runtime  # noqa: E402
from llm_speed.attention import launch  # noqa: E402
from llm_speed.fused import cross_entropy, rms_norm, rotary  # noqa: E402
from llm_speed.integrations import transformers as hf  # noqa: E402

CAP = 1e-6  # about one float32 rounding unit at the size of the compared values
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=32),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=32),
}


def _models(model_type):
    torch.manual_seed(0)
    config = CONFIGS[model_type]()
    base = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random, not tiny, norm weights so a wrong offset or weight gradient shows
        for name, p in base.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return base, copy.deepcopy(base), copy.deepcopy(base).double()


def _loss_and_grads(model, ids, labels):
    model.zero_grad()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _error(x, truth):
    return (x.double() - truth).abs().max().item()


def _assert_rule(name, got, same, truth, factor):
    scale = max(1.0, truth.abs().max().item())
    bound = factor * _error(same, truth) + CAP * scale
    assert _error(got, truth) <= bound, f"{name}: {_error(got, truth):.3e} > {bound:.3e}"


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_patched_model_matches_float64(model_type):
    patched, same, truth = _models(model_type)
    report = hf.apply(patched)
    assert report["rms_norm"] == 2 * 2 + 1 + (2 * 2 if model_type == "gemma2" else 0)
    assert report["swiglu"] == (0 if model_type == "gemma2" else 2)
    assert report["rotary"] and report["cross_entropy"]
    assert report["attention"] == (model_type != "gemma2")  # Gemma-2 softcaps attention logits
    ids = torch.randint(0, 97, (1, 10))
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt that is not trained on
    kernels = [rms_norm.KERNEL_FORWARD, rms_norm.KERNEL_BACKWARD, rotary.KERNEL]
    kernels += [cross_entropy.KERNEL_FORWARD, cross_entropy.KERNEL_BACKWARD]
    if report["attention"]:
        kernels.append(launch.KERNEL_FORWARD)
    before = _runtime.launch_counts()
    got_loss, got_grads = _loss_and_grads(patched, ids, labels)
    ran = _runtime.launch_counts() - before
    assert all(ran[k] > 0 for k in kernels), ran
    same_loss, same_grads = _loss_and_grads(same, ids, labels)
    assert _runtime.launch_counts() - before == ran, "the unpatched model ran llm_speed kernels"
    truth_loss, truth_grads = _loss_and_grads(truth, ids, labels)
    _assert_rule("loss", got_loss, same_loss, truth_loss, 2.0)
    for name, grad in truth_grads.items():
        _assert_rule(name, got_grads[name], same_grads[name], grad, 3.0)
    with torch.no_grad():
        logits = [m(input_ids=ids).logits for m in (patched, same, truth)]
    _assert_rule("logits", *logits, 2.0)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_llama_like_families_loss_matches_float64(model_type):
    # the same layers as Llama under other names: one forward with labels exercises every patched part
    patched, same, truth = _models(model_type)
    report = hf.apply(patched)
    assert report["rms_norm"] == 5 and report["swiglu"] == 2 and report["attention"]
    ids = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        out = patched(input_ids=ids, labels=ids)
        losses = [m(input_ids=ids, labels=ids).loss for m in (same, truth)]
    assert out.logits is None  # the [tokens, vocab] logits are never built
    _assert_rule("loss", out.loss, *losses, 2.0)


def test_padding_mask_is_refused_and_plain_mask_accepted():
    patched, _, _ = _models("llama")
    hf.apply(patched)
    ids = torch.randint(0, 97, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    assert patched(input_ids=ids, attention_mask=mask).logits.shape == (2, 6, 97)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match="padding"):
        patched(input_ids=ids, attention_mask=mask)
    assert hf._running[0] == 0  # the failed forward left no patched-model state behind


def test_attn_implementation_name_and_apply_checks():
    config = transformers.LlamaConfig(**SMALL)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="llm_speed")
    before = _runtime.launch_count(launch.KERNEL_FORWARD)
    model(input_ids=torch.randint(0, 97, (1, 5)))
    assert _runtime.launch_count(launch.KERNEL_FORWARD) > before
    report = hf.apply(model)
    assert hf.apply(model) is report  # a second call patches nothing more
    with pytest.raises(TypeError, match="rotary must be a bool"):
        hf.apply(model, rotary=1)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        hf.apply(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)))
