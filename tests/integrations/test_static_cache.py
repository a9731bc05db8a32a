"""Patched models generating with a static cache, as transformers' own tests do
(``test_generate_with_static_cache``, ``test_generate_compile_model_forward_fullgraph``, chunked prefill): the
same greedy tokens as the unpatched model, logits by the 2x rule against float64, eager and compiled."""

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install -e '.[hf]' (in .[dev] too)"
)

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
def test_compiled_static_cache_generation_in_one_graph(model_type, device, monkeypatch):
    """generate's compiled decode (fullgraph=True, as test_generate_compile_model_forward_fullgraph): the
    decode steps run flash_attention_with_kvcache with each row's valid keys read from the mask on the device
    (no host read, so the CPU's value checks, which read tensors, are off); the same tokens as unpatched. On
    a GPU through inductor, as generate compiles there by default."""
    patched, same, _ = models(model_type, layers=1, device=device)
    hf.apply(patched)
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    backend = "eager" if device.type == "cpu" else "inductor"  # the CPU: dynamo's graph, no C++ build
    config = transformers.CompileConfig(fullgraph=True, backend=backend)
    config._compile_all_devices = True  # generate compiles only on accelerators unless told
    ids, mask = _prompt(device)
    options = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   cache_implementation="static")  # fmt: skip
    torch._dynamo.reset()
    before = runtime.launch_count(decode.KERNEL_DECODE)
    with torch.no_grad():
        got = patched.generate(ids, compile_config=config, **options)
        expected = same.generate(ids, **options)
    assert runtime.launch_count(decode.KERNEL_DECODE) - before == NEW - 1  # the compiled decode steps
    assert torch.equal(got, expected)


def _reference(query, key, value, visible, scale, softcap):
    """Masked softmax attention in the inputs' precision (GQA by repeating the KV heads); rows that see no
    key give 0."""
    group = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(group, 1) for t in (key, value))
    scores = query @ key.transpose(-1, -2) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1).nan_to_num(0.0)
    return (weights @ value).transpose(1, 2)


@pytest.mark.parametrize(("window", "softcap"), [(None, None), (3, 5.0)])
def test_both_static_cache_paths_match_float64(window, softcap, monkeypatch):
    """The compiled path (flash_attention_with_kvcache from the mask, no host read) and the eager one (keys
    cropped, varlen) on a left-padded static cache with 2 queries after 5 cached tokens, GQA, a window and a
    softcap; the empty slots hold 1e4 (none may leak). Row 0's second query is padding: eager outputs zeros
    there; the compiled path, whose rows must hold one run of real keys, NaN in that row."""
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    torch.manual_seed(0)
    batch, heads, kv_heads, slots, dim, q_len, offset = 2, 4, 2, 12, 16, 2, 5
    query = torch.randn(batch, heads, q_len, dim)
    key, value = (torch.randn(batch, kv_heads, slots, dim) for _ in range(2))
    key[:, :, offset + q_len :], value[:, :, offset + q_len :] = 1e4, 1e4
    real = torch.ones(batch, slots, dtype=torch.bool)
    real[1, :3] = False  # left padding
    real[0, offset + 1] = False  # and a padded query (its key hidden from every query)
    real[0, :2] = False
    position = torch.arange(offset, offset + q_len)[:, None]
    keys = torch.arange(slots)[None, :]
    visible = (keys <= position) & real[:, None, :]
    if window is not None:
        visible &= keys > position - window
    mask = visible[:, None]  # [batch, 1, q_len, slots], as transformers' sdpa_mask
    scale = dim**-0.5
    options = dict(scale=scale, window=None if window is None else (window - 1, 0), softcap=softcap)
    before = runtime.launch_count(decode.KERNEL_DECODE)
    compiled = hf._static_cache_attention(query, key, value, mask, options)
    assert runtime.launch_count(decode.KERNEL_DECODE) > before  # the Triton kernel, not a fallback
    eager, _ = hf.llm_speed_attention(None, query, key, value, mask, scaling=scale, sliding_window=window,
                                      softcap=softcap)  # fmt: skip
    query_real = real[:, offset : offset + q_len]
    same = _reference(query, key, value, mask, scale, softcap)
    truth = _reference(*(t.double() for t in (query, key, value)), mask, scale, softcap)
    assert torch.all(eager[~query_real] == 0)
    _assert_rule("eager", eager[query_real], same[query_real], truth[query_real])
    assert compiled[0].isnan().all()  # a pad after the row's first real key
    _assert_rule("compiled", compiled[1], same[1], truth[1])


def test_compiled_generation_with_all_outputs(monkeypatch):
    """As test_generate_compilation_all_outputs: output_attentions=True under the compiled decode
    (fullgraph) runs the model's eager attention for those calls (one warning) and returns its weights."""
    patched, same, _ = models("llama", layers=1)
    hf.apply(patched)
    same.set_attn_implementation("eager")
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    monkeypatch.setattr(hf, "_WARNED", set())
    config = transformers.CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True
    ids, mask = _prompt()
    options = dict(attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                   cache_implementation="static", return_dict_in_generate=True, output_attentions=True,
                   output_logits=True)  # fmt: skip
    torch._dynamo.reset()
    with torch.no_grad(), pytest.warns(UserWarning, match="output_attentions=True") as record:
        got = patched.generate(ids, compile_config=config, **options)
        expected = same.generate(ids, **options)
    assert sum("llm_speed attention" in str(w.message) for w in record) == 1
    assert torch.equal(got.sequences, expected.sequences) and len(got.attentions) == NEW
    for step in range(NEW):
        torch.testing.assert_close(got.attentions[step][0], expected.attentions[step][0], rtol=0, atol=1e-6)
