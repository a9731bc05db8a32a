"""Hugging Face integration: tiny random models patched in one line match the unpatched float64 model."""

import copy
import re

import numpy as np
import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers: pip install -e '.[hf]' (in .[dev] too)"
)

from hf_families import finite_float64_masks  # noqa: E402

from llm_speed.attention import flash  # noqa: E402
from llm_speed.core import runtime  # noqa: E402
from llm_speed.integrations import transformers as hf  # noqa: E402

FLAG = r"a bool \(True or False\) or a numpy.bool_"  # core.args.check_flag's wording
CAP = 1e-6  # about one float32 rounding unit at the size of the compared values
SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)  # fmt: skip
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=32),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=32),
}


def _models(model_type, device="cpu"):
    """The model to patch, the same unpatched, and a float64 copy; on ``device``, where the kernels run."""
    torch.manual_seed(0)
    config = CONFIGS[model_type]()
    base = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random, not tiny, norm weights so a wrong offset or weight gradient shows
        for name, p in base.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    base.to(device)
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


# Every family's patched model against float64 (loss, logits, every gradient) and in a training run:
# tests/integrations/test_families.py.


# Padded batches: a full row, a left-padded row and a right-padded one, of different lengths.
PAD_LEFT, PAD_RIGHT, SEQ = 3, 5, 11
PADDED = {  # model_type: config with a sliding window shorter than the sequence where the family has one
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=4),
    "gemma2": lambda: transformers.Gemma2Config(**SMALL, head_dim=32, sliding_window=4),
}


def _padded_batch(device="cpu"):
    ids = torch.randint(0, 97, (3, SEQ))
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[1, :PAD_LEFT] = 0
    mask[2, SEQ - PAD_RIGHT :] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :2] = -100  # a prompt that is not trained on
    # nor a token predicted at a padded position (attention outputs zeros there, as flash-attention-2 does;
    # eager attention averages all keys there, so such a prediction would differ)
    labels[:, 1:] = labels[:, 1:].masked_fill(mask[:, :-1] == 0, -100)
    return ids.to(device), mask.to(device), labels.to(device)


def _padded_models(model_type, device="cpu"):
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(PADDED[model_type]())
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    base.to(device)
    return base, copy.deepcopy(base), copy.deepcopy(base).double()


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2"])
def test_padded_batch_runs_varlen_and_matches_float64(model_type, device, monkeypatch):
    # the 2-D padding mask; mistral and gemma2 with windows of 4 < 11 tokens, which the layers apply
    # (gemma2 also softcaps attention logits and mixes full layers)
    patched, same, truth = _padded_models(model_type, device)
    finite_float64_masks(monkeypatch)
    assert hf.apply(patched)["attention"]
    ids, mask, labels = _padded_batch(device)
    ops = []
    monkeypatch.setattr(runtime, "_work_observers", [lambda op, _problem: ops.append(op)])
    kernels = [flash.FORWARD.name, *(kernel.name for kernel in flash.default_backward_kernels(device))]
    before = runtime.launch_counts()
    patched.zero_grad()
    got_loss = patched(input_ids=ids, attention_mask=mask, labels=labels).loss
    got_loss.backward()
    ran = runtime.launch_counts() - before
    assert all(ran[k] >= 2 for k in kernels), ran  # the Triton kernels, not the PyTorch reference
    assert ops.count("flash_attention_varlen") == 2 and ops.count("flash_attention_varlen_backward") == 2
    assert "flash_attention" not in ops  # no layer took the dense path
    got_grads = {n: p.grad for n, p in patched.named_parameters()}
    references = []
    for model in (same, truth):
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        references.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (same_loss, same_grads), (truth_loss, truth_grads) = references
    _assert_rule("loss", got_loss.detach(), same_loss, truth_loss, 2.0)
    for name, grad in truth_grads.items():
        _assert_rule(name, got_grads[name], same_grads[name], grad, 3.0)
    with torch.no_grad():
        logits = [m(input_ids=ids, attention_mask=mask).logits for m in (patched, same, truth)]
    real = mask.bool()
    _assert_rule("logits of real tokens", *(x[real] for x in logits), 2.0)


def test_padding_at_either_end_gives_the_unpadded_result():
    # a row's real tokens give the same logits alone, left-padded and right-padded (positions from the mask)
    patched, _, _ = _padded_models("mistral")
    hf.apply(patched)
    ids = torch.randint(0, 97, (1, 6))
    filler = torch.randint(0, 97, (1, 3))
    batch = torch.cat([torch.cat([filler, ids], 1), torch.cat([ids, filler], 1)])
    mask = torch.tensor([[0] * 3 + [1] * 6, [1] * 6 + [0] * 3])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        alone = patched(input_ids=ids).logits[0]
        padded = patched(input_ids=batch, attention_mask=mask, position_ids=positions).logits
    torch.testing.assert_close(padded[0, 3:], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(padded[1, :6], alone, rtol=0, atol=1e-5)


def test_left_padded_generation_with_a_cache_matches_float64(monkeypatch):
    # prefill with a padding mask, then decode steps of one real query against the cached keys
    patched, same, truth = _padded_models("gemma2")  # sliding-window layers keep a shorter cache
    finite_float64_masks(monkeypatch)
    hf.apply(patched)
    ids = torch.randint(1, 97, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    options = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_logits=True)
    with torch.no_grad():
        outs = [m.generate(input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **options)
                for m in (patched, same, truth)]  # fmt: skip
    assert torch.equal(outs[0].sequences, outs[2].sequences)
    for step in range(3):
        _assert_rule(f"logits of step {step}", *(out.logits[step] for out in outs), 2.0)


def test_padding_mask_is_checked_once_per_forward(monkeypatch):
    patched, _, _ = _models("llama")
    hf.apply(patched)
    calls = []
    classify = hf._classify_mask
    monkeypatch.setattr(hf, "_classify_mask", lambda *args: calls.append(1) or classify(*args))
    ids, mask, _ = _padded_batch()
    with torch.no_grad():
        patched(input_ids=ids, attention_mask=mask)
    assert len(calls) == 1  # two layers, one mask: one check, one host sync


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gemma2"])
def test_no_4d_mask_and_one_compiled_graph(model_type, monkeypatch):
    """Plain causal and the config's sliding window (4 < 11 tokens: the layers apply it) build no
    [batch, 1, q, kv] mask, and torch.compile traces the patched model in one graph, as the unpatched one:
    no hook registered per call (the loss's), no host sync in the mask."""
    patched, _, _ = _padded_models(model_type)
    hf.apply(patched)
    built = []
    sdpa_mask = hf.sdpa_mask
    monkeypatch.setattr(hf, "sdpa_mask", lambda *a, **k: built.append(1) or sdpa_mask(*a, **k))
    ids = torch.randint(0, 97, (2, SEQ))
    with torch.no_grad():
        patched(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert built == []
    torch._dynamo.reset()
    explained = torch._dynamo.explain(patched)(input_ids=ids, labels=ids)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_window_agrees_is_the_kernels_window_over_real_tokens():
    # brute force: the real keys a query sees through the model's window (positions) and the kernel's (ranks)
    torch.manual_seed(0)
    key_valid = torch.rand(64, 12) < 0.7
    for left in (0, 1, 3, 20):
        got = hf._window_agrees(key_valid, left)
        for row, valid in enumerate(key_valid.tolist()):
            real = [p for p, v in enumerate(valid) if v]
            for p, v in enumerate(valid):
                if v:
                    rank = real.index(p)
                    by_position = [k for k in real if p - left <= k <= p]
                    assert bool(got[row, p]) == (by_position == real[max(0, rank - left) : rank + 1])
                else:
                    assert bool(got[row, p])


def _one_fallback_warning(record, match):
    ours = [str(w.message) for w in record if "llm_speed attention" in str(w.message)]
    assert len(ours) == 1 and re.search(match, ours[0]), ours  # one warning for the call, not one per layer


def test_a_window_spanning_an_inner_pad_runs_the_original_attention(monkeypatch):
    patched, same, _ = _padded_models("mistral")  # window 4
    hf.apply(patched)
    monkeypatch.setattr(hf, "_WARNED", set())
    ids = torch.randint(0, 97, (1, SEQ))
    mask = torch.ones(1, SEQ, dtype=torch.long)
    mask[0, 5] = 0  # the query at position 8 sees positions 5-8 by position, 4 real tokens by rank
    with torch.no_grad(), pytest.warns(UserWarning) as record:
        got = patched(input_ids=ids, attention_mask=mask).logits
    _one_fallback_warning(record, r"a window that spans a pad.*original attention \(sdpa\)")
    with torch.no_grad():
        torch.testing.assert_close(got, same(input_ids=ids, attention_mask=mask).logits, rtol=0, atol=1e-5)
    assert not hf._active()


def test_masks_the_kernels_cannot_compute_fall_back_and_malformed_ones_are_refused(monkeypatch):
    patched, same, _ = _models("llama")
    hf.apply(patched)
    monkeypatch.setattr(hf, "_WARNED", set())
    ids = torch.randint(0, 97, (2, 6))
    ones = torch.ones(2, 6, dtype=torch.long)
    assert patched(input_ids=ids, attention_mask=ones).logits.shape == (2, 6, 97)
    causal = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6)
    assert patched(input_ids=ids, attention_mask=causal).logits.shape == (2, 6, 97)
    bias = torch.zeros(2, 1, 6, 6).masked_fill(~causal, float("-inf"))
    bias[..., 0] = -0.5  # an additive bias is not a mask
    bidirectional = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    for mask, reason in ((bias, "a bias"), (bidirectional, "bidirectional")):
        with torch.no_grad(), pytest.warns(UserWarning) as record:
            got = patched(input_ids=ids, attention_mask=mask).logits
        _one_fallback_warning(record, reason)
        with torch.no_grad():
            expected = same(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match=r"shape \(2, 1, 6, 5\), expected \[2, 1, 6, 6\]"):
        patched(input_ids=ids, attention_mask=causal[..., :5])
    assert not hf._active()  # the failed forward left no patched-attention state behind
    with pytest.raises(ValueError, match="sliding_window must be a positive int"):
        hf.llm_speed_attention(None, *(torch.randn(1, 2, 4, 16) for _ in range(3)), None, sliding_window=0)


def test_attn_implementation_name_and_apply_checks(device):
    config = transformers.LlamaConfig(**SMALL)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="llm_speed").to(device)
    before = runtime.launch_count(flash.FORWARD.name)
    model(input_ids=torch.randint(0, 97, (1, 5), device=device))
    assert runtime.launch_count(flash.FORWARD.name) > before
    report = hf.apply(model)
    assert hf.apply(model) is report  # a second call patches nothing more
    with pytest.raises(TypeError, match=rf"rotary must be {FLAG}, got int 1"):
        hf.apply(model, rotary=1)
    with pytest.raises(TypeError, match=rf"attention must be None \(the default\) or {FLAG}, got str"):
        hf.apply(model, attention="eager")
    with pytest.raises(TypeError, match="rotary must be a bool"):
        hf.apply(model, rotary=1)
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        hf.apply(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2)))


def test_cross_entropy_accum_dtype_reaches_the_fused_loss(device, monkeypatch):
    """``apply(model, cross_entropy_accum_dtype=torch.float32)``: the fused loss gets ``accum_dtype`` (the
    lm_head gradient summed in float32 over the chunks), the report says so, and loss and gradients stay
    those of the default patch (one chunk here: the same sums); bad values are refused before anything is
    patched."""
    seen = []
    real = hf.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs.get("accum_dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "fused_linear_cross_entropy", spy)
    plain, accum, _ = _models("llama", device)
    ids = torch.randint(0, 97, (2, 7), device=device)
    assert hf.apply(plain)["cross_entropy_accum_dtype"] is None
    assert hf.apply(accum, cross_entropy_accum_dtype=torch.float32)["cross_entropy_accum_dtype"] == "float32"
    loss, grads = _loss_and_grads(plain, ids, ids)
    loss32, grads32 = _loss_and_grads(accum, ids, ids)
    assert seen == [None, torch.float32]
    torch.testing.assert_close(loss32, loss, rtol=0, atol=0)
    torch.testing.assert_close(grads32["lm_head.weight"], grads["lm_head.weight"], rtol=1e-6, atol=1e-7)
    fresh = _models("llama", device)[0]
    with pytest.raises(TypeError, match="cross_entropy_accum_dtype is torch.bfloat16; accepted: None"):
        hf.apply(fresh, cross_entropy_accum_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cross_entropy_accum_dtype needs cross_entropy=True"):
        hf.apply(fresh, cross_entropy=False, cross_entropy_accum_dtype=torch.float32)
    assert getattr(fresh, "_llm_speed_report", None) is None  # refused before anything was patched


def test_apply_takes_numpy_bools_as_the_package_does():
    """apply's switches go through core.args.check_flag: NumPy bools are bools, other values its error."""
    model = _models("llama")[0]
    with pytest.raises(TypeError, match=rf"^rms_norm must be {FLAG}, got str 'no'"):
        hf.apply(model, rms_norm="no")
    report = hf.apply(model, rms_norm=np.bool_(False), attention=np.bool_(True), rotary=np.True_)
    assert report["rms_norm"] == 0 and report["attention"] is True and report["rotary"] is True


_LAYOUT = r"\[batch, heads, q_len, head_dim\]"


@pytest.mark.parametrize(
    "query, mask, error, match",
    [
        (torch.randn(2, 8, 16), None, ValueError, rf"^query must have 4 dims {_LAYOUT}, got shape \(2, 8,"),
        (None, None, TypeError, rf"^query must be a torch.Tensor {_LAYOUT}, got NoneType"),
        (torch.randn(1, 2, 8, 16), [[1] * 8], TypeError,
         r"^attention_mask must be None or a torch.Tensor, got list; accepted: None, a 2-D padding mask"),
        (torch.randn(1, 2, 8, 16), torch.ones(1, 8, dtype=torch.bool, device="meta"), ValueError,
         r"attention_mask it cannot read \(a mask on the meta device.*accepted: None, a 2-D padding mask"),
    ],
    ids=["3-D query", "query None", "mask list", "mask on meta"],
)  # fmt: skip
def test_attention_refuses_bad_query_and_mask_before_any_work(query, mask, error, match):
    key = value = torch.randn(1, 1, 8, 16)
    before = runtime.launch_count(flash.FORWARD.name)
    with pytest.raises(error, match=match):
        hf.llm_speed_attention(None, query, key, value, mask)
    assert runtime.launch_count(flash.FORWARD.name) == before
