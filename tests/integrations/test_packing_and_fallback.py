"""Padding-free packing (position_ids that restart inside a row, or the block-diagonal 4-D mask) against the
padded batch, as transformers' ``test_*_padding_matches_padding_free_with_position_ids`` and
``test_custom_4d_attention_mask``; ``output_attentions=True`` and an explicit eager model, as its
``test_attention_outputs``, ``test_retain_grad_hidden_states_attentions`` and
``test_can_set_attention_dynamically``."""

import re

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install -e '.[hf]' (in .[dev] too)"
)

from hf_families import VOCAB, config, finite_float64_masks, models  # noqa: E402

from llm_speed.attention import flash  # noqa: E402
from llm_speed.core import runtime  # noqa: E402
from llm_speed.integrations import transformers as hf  # noqa: E402

CAP = 1e-6
LENGTHS = (5, 3, 4)  # three sequences; mistral's window of 4 is shorter than the first


def _assert_rule(name, got, same, truth, factor):
    scale = max(1.0, truth.abs().max().item())
    error = (got.double() - truth).abs().max().item()
    bound = factor * (same.double() - truth).abs().max().item() + CAP * scale
    assert error <= bound, f"{name}: {error:.3e} > {bound:.3e}"


def _batches():
    """The same sequences padded (right, one per row) and packed into one row (TRL's
    DataCollatorWithFlattening: position_ids restart at 0, each sequence's first label -100)."""
    sequences = [torch.randint(0, VOCAB, (n,)) for n in LENGTHS]
    longest = max(LENGTHS)
    ids = torch.zeros(len(LENGTHS), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, : len(s)], mask[row, : len(s)] = s, 1
    padded = dict(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    labels = torch.cat([torch.cat([torch.tensor([-100]), s[1:]]) for s in sequences])[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    # no cache: transformers reads packing from position_ids only then (as in training)
    packed = dict(input_ids=torch.cat(sequences)[None], position_ids=positions, labels=labels,
                  use_cache=False)  # fmt: skip
    return padded, packed


def _loss_and_grads(model, batch):
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3"])
def test_packed_batch_runs_varlen_and_matches_the_padded_one(model_type, monkeypatch):
    patched, same, truth = models(model_type, layers=1)
    hf.apply(patched)
    padded, packed = _batches()
    ops = []
    monkeypatch.setattr(runtime, "_work_observers", [lambda op, _problem: ops.append(op)])
    got_loss, got_grads = _loss_and_grads(patched, packed)
    assert ops.count("flash_attention_varlen") == 1 and ops.count("flash_attention_varlen_backward") == 1
    assert "flash_attention" not in ops  # the packed row never ran as one causal sequence
    same_loss, same_grads = _loss_and_grads(same, padded)
    truth_loss, truth_grads = _loss_and_grads(truth, padded)
    _assert_rule("loss", got_loss, same_loss, truth_loss, 2.0)
    assert set(got_grads) == set(truth_grads)
    for name, grad in truth_grads.items():
        _assert_rule(name, got_grads[name], same_grads[name], grad, 3.0)


def test_block_diagonal_4d_mask_is_the_packed_batch():
    """The 4-D mask of the packed sequences (bool, and additive in the model's dtype) gives the loss that
    the restarting position_ids give."""
    patched, _, _ = models("llama", layers=1)
    hf.apply(patched)
    _, packed = _batches()
    total = sum(LENGTHS)
    sequence = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    block = (sequence[:, None] == sequence[None, :]) & torch.ones(total, total, dtype=torch.bool).tril()
    additive = torch.zeros(total, total).masked_fill(~block, torch.finfo(torch.float32).min)
    with torch.no_grad():
        expected = patched(**packed).loss
        for mask in (block, additive):
            got = patched(**packed, attention_mask=mask[None, None]).loss
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def _one_warning(record, match):
    ours = [str(w.message) for w in record if "llm_speed attention" in str(w.message)]
    assert len(ours) == 1 and re.search(match, ours[0]), ours


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_output_attentions_runs_eager_with_one_warning(model_type, monkeypatch):
    patched, same, truth = models(model_type)
    finite_float64_masks(monkeypatch, model_type)
    hf.apply(patched)
    for model in (same, truth):
        model.set_attn_implementation("eager")
    monkeypatch.setattr(hf, "_WARNED", set())
    ids = torch.randint(0, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with pytest.warns(UserWarning) as record:
        out = patched(input_ids=ids, attention_mask=mask, output_attentions=True)
    _one_warning(record, r"output_attentions=True.*original attention \(eager\)")
    with torch.no_grad():
        references = [m(input_ids=ids, attention_mask=mask, output_attentions=True) for m in (same, truth)]
    assert len(out.attentions) == patched.config.num_hidden_layers
    for layer, weights in enumerate(out.attentions):
        assert weights.shape == (2, patched.config.num_attention_heads, 6, 6)
        _assert_rule(f"attention weights of layer {layer}", weights.detach(),
                     *(r.attentions[layer] for r in references), 2.0)  # fmt: skip
    out.attentions[0].retain_grad()
    out.logits.sum().backward()
    assert out.attentions[0].grad is not None


def test_apply_keeps_an_explicit_eager_attention_unless_asked():
    eager = transformers.AutoModelForCausalLM.from_config(config("llama", 1), attn_implementation="eager")
    report = hf.apply(eager)
    assert not report["attention"] and report["attention_replaced"] is None
    assert "attn_implementation='eager'" in report["skipped"]["attention"]
    assert eager.config._attn_implementation == "eager"
    before = runtime.launch_count(flash.FORWARD.name)
    with torch.no_grad():
        eager(input_ids=torch.randint(0, VOCAB, (1, 5)))
    assert runtime.launch_count(flash.FORWARD.name) == before  # the other kernels, not the attention
    forced = transformers.AutoModelForCausalLM.from_config(config("llama", 1), attn_implementation="eager")
    report = hf.apply(forced, attention=True)
    assert report["attention"] and report["attention_replaced"] == "eager"
    assert forced.config._attn_implementation == hf.ATTENTION_NAME
    default = transformers.AutoModelForCausalLM.from_config(config("llama", 1))
    assert hf.apply(default)["attention_replaced"] == "sdpa"
    gemma2 = transformers.AutoModelForCausalLM.from_config(config("gemma2", 1))  # eager: it has no SDPA
    assert hf.apply(gemma2)["attention_replaced"] == "eager"
    off = transformers.AutoModelForCausalLM.from_config(config("llama", 1))
    report = hf.apply(off, attention=False)
    assert not report["attention"] and off.config._attn_implementation == "sdpa"
