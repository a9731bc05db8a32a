"""Patched models generating with a static cache, as transformers' own tests do
(``test_generate_with_static_cache``, ``test_generate_compile_model_forward_fullgraph``, chunked prefill): the
same greedy tokens as the unpatched model, logits by the 2x rule against float64, eager and compiled."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_families import CONFIGS, VOCAB, finite_float64_masks, models  # noqa: E402

from llm_speed.attention import decode, flash  # noqa: E402
from llm_speed.core import runtime  # noqa: E402
from llm_speed.integrations import transformers as hf  # noqa: E402

CAP = 1e-6
NEW = 3  # tokens generated per test: few, the interpreter runs every launch in Python


def _assert_rule(name, got, same, truth, factor=2.0):
    scale = max(1.0, truth.abs().max().item())
    error = (got.double() - truth).abs().max().item()
    bound = factor * (same.double() - truth).abs().max().item() + CAP * scale
    assert error <= bound, f"{name}: {error:.3e} > {bound:.3e}"


def _prompt(device="cpu"):
    """Two rows of 5 tokens, the second left-padded by 2 (as a tokenizer pads for generation)."""
    ids = torch.randint(1, VOCAB, (2, 5), device=device)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return ids, mask


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_static_cache_generation_matches_unpatched(model_type, monkeypatch):
    """Eager: each forward crops the static cache's keys to the last query (the 4-D mask says where), so the
    empty slots are neither refused nor attended; left padding runs the varlen kernel."""
    patched, same, truth = models(model_type, layers=1)
    finite_float64_masks(monkeypatch)
    hf.apply(patched)
    ids, mask = _prompt()
    options = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   cache_implementation="static", return_dict_in_generate=True,
                   output_logits=True)  # fmt: skip
    before = runtime.launch_count(flash.FORWARD.name)
    with torch.no_grad():
        got = patched.generate(ids, **options)
        assert runtime.launch_count(flash.FORWARD.name) - before == NEW  # one layer, each step on the kernel
        outs = [model.generate(ids, **options) for model in (same, truth)]
    assert torch.equal(got.sequences, outs[0].sequences) and torch.equal(got.sequences, outs[1].sequences)
    for step in range(NEW):
        _assert_rule(f"{model_type} logits of step {step}", got.logits[step], outs[0].logits[step],
                     outs[1].logits[step])  # fmt: skip


@pytest.mark.parametrize("model_type", ["llama", "mistral"])
def test_chunked_prefill_into_a_static_cache(model_type):
    """A prompt fed in chunks of 3 into a StaticCache of 16 slots, then one step: each chunk's queries sit
    at the cache's length, the slots after them empty (mistral: a window of 4 across the chunks)."""
    patched, same, truth = models(model_type, layers=1)
    hf.apply(patched)
    ids = torch.randint(1, VOCAB, (2, 8))
    logits = []
    with torch.no_grad():
        for model in (patched, same, truth):
            cache = transformers.StaticCache(config=model.config, max_cache_len=16)
            chunks = [model(input_ids=ids[:, i : i + 3], cache=cache).logits for i in range(0, 8, 3)]
            logits.append(torch.cat(chunks, 1))
    _assert_rule(f"{model_type} chunked prefill logits", *logits)
    with torch.no_grad():
        whole = patched(input_ids=ids).logits
    torch.testing.assert_close(logits[0], whole, rtol=0, atol=1e-5)  # the same as in one piece, no cache


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_compiled_static_cache_generation_in_one_graph(model_type, monkeypatch):
    """generate's compiled decode (fullgraph=True, as test_generate_compile_model_forward_fullgraph): the
    decode steps run flash_attention_with_kvcache with each row's valid keys read from the mask on the device
    (no host read, so the CPU's value checks, which read tensors, are off); the same tokens as unpatched."""
    patched, same, _ = models(model_type, layers=1)
    hf.apply(patched)
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    config = transformers.CompileConfig(fullgraph=True, backend="eager")  # dynamo's graph, no C++ build
    config._compile_all_devices = True  # generate compiles only on accelerators unless told
    ids, mask = _prompt()
    options = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   cache_implementation="static")  # fmt: skip
    torch._dynamo.reset()
    before = runtime.launch_count(decode.FORWARD.name)
    with torch.no_grad():
        got = patched.generate(ids, compile_config=config, **options)
        expected = same.generate(ids, **options)
    assert runtime.launch_count(decode.FORWARD.name) - before == NEW - 1  # the compiled decode steps
    assert torch.equal(got, expected)
