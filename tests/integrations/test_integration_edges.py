"""Hugging Face integration at its edges (audit 8, 2026-12-07): a window only the module knows, tuple outputs
and MoE's auxiliary loss, logits_to_keep beside labels, a mask buffer reused in place, Gemma-1's activation
field, float64 models. Each against the unpatched model."""

import copy

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install -e '.[hf]' (in .[dev] too)"
)

from hf_families import SMALL, VOCAB, finite_float64_masks, models  # noqa: E402

from llm_speed.integrations import transformers as hf  # noqa: E402


def _pair(config):
    torch.manual_seed(0)
    unpatched = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random norm weights, and scores far from uniform, so a lost window shows
        for name, p in unpatched.named_parameters():
            p.mul_(3.0) if "proj" in name else p.add_(0.2 * torch.randn_like(p))
    patched = copy.deepcopy(unpatched)
    hf.apply(patched)
    return patched, unpatched


def test_a_window_the_layer_leaves_to_the_mask_is_applied():
    # Qwen2-MoE's attention does not pass sliding_window= (its mask carries the window); the mask function
    # builds no windowed mask, so the attention takes the module's own sliding_window. It ran full causal
    # attention before (logits off by 6.1 at window 4 over 12 tokens).
    config = transformers.Qwen2MoeConfig(**{**SMALL, "num_hidden_layers": 2}, num_experts=4,
                                         moe_intermediate_size=24, num_experts_per_tok=2,
                                         shared_expert_intermediate_size=40, use_sliding_window=True,
                                         sliding_window=4, max_window_layers=2)  # fmt: skip
    patched, unpatched = _pair(config)
    assert config.layer_types[0] == "sliding_attention"
    ids = torch.randint(0, VOCAB, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        for attention_mask in (None, mask):
            got = patched(input_ids=ids, attention_mask=attention_mask).logits
            want = unpatched(input_ids=ids, attention_mask=attention_mask).logits
            real = slice(None) if attention_mask is None else attention_mask.bool()
            assert (got - want)[real].abs().max() < 1e-4


def test_tuple_outputs_keep_their_places_and_the_router_loss():
    patched, unpatched, _ = models("mixtral")
    patched.config.router_aux_loss_coef = unpatched.config.router_aux_loss_coef = 0.1
    hf.apply(patched)
    ids = torch.randint(0, VOCAB, (2, 10))
    options = dict(input_ids=ids, labels=ids, output_router_logits=True)
    with torch.no_grad():
        want = unpatched(**options, return_dict=False)
        got = patched(**options, return_dict=False)
        as_dict = patched(**options)
    # (loss, aux_loss, logits, cache, router_logits): the load-balancing term was dropped before (4.17
    # against 4.37) and the logits' place held an empty tensor
    assert len(got) == len(want) and got[2] is None and want[2].shape[1] == 10
    assert torch.allclose(got[0], want[0], atol=1e-5) and torch.allclose(got[0], as_dict.loss)
    assert torch.allclose(got[1], want[1]) and torch.allclose(got[1], as_dict.aux_loss)


def test_logits_to_keep_beside_labels():
    patched, unpatched, _ = models("llama")
    hf.apply(patched)
    ids = torch.randint(0, VOCAB, (2, 10))
    with torch.no_grad():
        want = unpatched(input_ids=ids, labels=ids, logits_to_keep=0).loss
        # 0 keeps every position: the fused loss (it was "got multiple values for 'logits_to_keep'")
        got = patched(input_ids=ids, labels=ids, logits_to_keep=0)
        assert got.logits is None and torch.allclose(got.loss, want, atol=1e-5)
        # other values: the original forward, which scores the kept positions alone (and so refuses labels
        # of every position, as unpatched)
        for model in (patched, unpatched):
            with pytest.raises(ValueError, match="batch_size"):
                model(input_ids=ids, labels=ids, logits_to_keep=3)


def test_a_mask_buffer_changed_in_place_is_read_again():
    patched, unpatched, _ = models("llama")
    hf.apply(patched)
    batch, seq = 2, 10
    ids = torch.randint(0, VOCAB, (batch, seq))

    def mask4(valid):
        return (torch.ones(seq, seq, dtype=torch.bool).tril()[None] & valid[:, None, :])[:, None]

    first, second = torch.ones(batch, seq, dtype=torch.bool), torch.ones(batch, seq, dtype=torch.bool)
    first[1, :4] = False
    second[0, :2] = False
    buffer = mask4(first)
    with torch.no_grad():
        patched(input_ids=ids, attention_mask=buffer)
        buffer.copy_(mask4(second))  # the next batch in the same buffer: stale attention before (off by 4.6)
        got = patched(input_ids=ids, attention_mask=buffer).logits
        want = unpatched(input_ids=ids, attention_mask=mask4(second)).logits
    assert (got - want)[second].abs().max() < 1e-4


def test_gemma_mlp_activation_is_hidden_act():
    # GemmaMLP reads config.hidden_act (Gemma-2/3: hidden_activation); where the two differ, the patched MLP
    # computed the other activation (logits off by 0.88)
    config = transformers.GemmaConfig(**SMALL, head_dim=16)
    config.hidden_act, config.hidden_activation = "silu", "gelu_pytorch_tanh"
    patched, unpatched = _pair(config)
    assert patched.model.layers[0].mlp.activation == "silu"
    ids = torch.randint(0, VOCAB, (1, 8))
    with torch.no_grad():
        assert (patched(input_ids=ids).logits - unpatched(input_ids=ids).logits).abs().max() < 1e-4


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_a_float64_model_runs_its_original_code(model_type, monkeypatch):
    # the docs' promise: dtypes the kernels do not take run the model's original code (each part raised a
    # TypeError naming float64 before; Gemma-2's eager fallback overflowed building its float64 mask)
    monkeypatch.setattr(hf, "_WARNED", set())  # the fallback warns once per reason per process
    if model_type == "gemma2":
        finite_float64_masks(monkeypatch)
    patched, _, truth = models(model_type)
    hf.apply(patched)
    patched.double()
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with torch.no_grad(), pytest.warns(UserWarning, match="torch.float64 inputs"):
        got = patched(input_ids=ids, attention_mask=mask, labels=ids)
    with torch.no_grad():
        want = truth(input_ids=ids, attention_mask=mask, labels=ids)
    assert got.logits is not None and torch.allclose(got.logits, want.logits, rtol=0, atol=1e-12)
    assert torch.allclose(got.loss, want.loss, rtol=0, atol=1e-12)
