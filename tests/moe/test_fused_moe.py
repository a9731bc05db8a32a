"""fused_moe: Hugging Face's loop over experts in float64 as the truth, the same loop in the kernel's dtype
as the 2x/3x baseline; tokens per expert 0/1/17/129, every token to one expert, 1/8/64 experts, top-1/2/8,
ragged hidden and intermediate sizes, gradients of every input; what the autograd graph keeps; bad input."""

import importlib

import pytest
import torch
from moe_testing import GRAD_FACTOR, OUTPUT_FACTOR, expect_launches, grads, leaves, rule

from llm_speed import fused_moe, moe_route
from llm_speed.core import runtime
from llm_speed.moe import routing
from llm_speed.moe.reference import fused_moe_reference

# the modules (the package's attributes of these names are the functions)
module = importlib.import_module("llm_speed.moe.fused_moe")
grouped = importlib.import_module("llm_speed.moe.grouped_gemm")
FORWARD_KERNELS = (routing.SORT_COUNT.name, routing.SORT_PLACE.name, grouped.GROUPED.name,
                   module.COMBINE.name)  # fmt: skip
BACKWARD_KERNELS = (module.BACKWARD.name, grouped.GROUPED.name, grouped.WGRAD.name, module.COMBINE.name)


def _weights(experts, hidden, inter, dtype):
    w_gate_up = (torch.randn(experts, 2 * inter, hidden) * hidden**-0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter) * inter**-0.5).to(dtype)
    return w_gate_up, w_down


def _routing(tokens, experts, top_k):
    weights, ids = torch.randn(tokens, experts).softmax(-1).topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _ids_with_counts(counts):
    """top-1 ids giving expert e exactly counts[e] tokens, shuffled."""
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    return ids[torch.randperm(ids.numel())][:, None]


def _run(fn, inputs, ids, dout):
    out = fn(*inputs, ids)
    (out.double() * dout.double()).sum().backward()
    return [out.detach(), *grads(inputs)]


RUNS = {  # tokens, experts, top_k, hidden, intermediate, dtype; or counts (top-1) instead of tokens
    "E1-top1": (20, 1, 1, 48, 33, torch.float32),
    "E8-top2": (13, 8, 2, 40, 24, torch.float32),
    "E8-top2-bf16": (13, 8, 2, 72, 40, torch.bfloat16),
    "E64-top8": (5, 64, 8, 40, 24, torch.float32),
    "E64-top8-fp16": (4, 64, 8, 24, 16, torch.float16),
    "counts-0-1-17-129": ([0, 1, 17, 129], None, 1, 32, 72, torch.float32),
    "all-to-one-bf16": ([0, 0, 0, 0, 0, 45, 0, 0], None, 1, 40, 24, torch.bfloat16),
}


@pytest.mark.parametrize("name", RUNS)
def test_accuracy_forward_and_backward(name, device):
    tokens, experts, top_k, hidden, inter, dtype = RUNS[name]
    if isinstance(tokens, list):
        ids = _ids_with_counts(tokens)
        experts, tokens = len(tokens), ids.shape[0]
        weights = torch.rand(tokens, 1) + 0.5
    else:
        weights, ids = _routing(tokens, experts, top_k)
    x = torch.randn(tokens, hidden).to(dtype)
    w_gate_up, w_down = _weights(experts, hidden, inter, dtype)
    dout = torch.randn(tokens, hidden)
    truth = _run(fused_moe_reference, leaves(x, w_gate_up, w_down, weights, dtype=torch.float64), ids, dout)
    same = _run(fused_moe_reference, leaves(x, w_gate_up, w_down, weights.to(dtype)), ids, dout)
    with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=device):
        got = _run(fused_moe, leaves(x, w_gate_up, w_down, weights, device=device), ids.to(device),
                   dout.to(device))  # fmt: skip
    assert got[0].dtype == dtype and got[0].shape == (tokens, hidden)
    k = hidden + inter
    rule("out", got[0], same[0], truth[0], OUTPUT_FACTOR, dtype, k)
    for i, label in enumerate(("dhidden", "dw_gate_up", "dw_down", "dtopk_weights"), start=1):
        rule(label, got[i], same[i], truth[i], GRAD_FACTOR, dtype, k + tokens * top_k)


def test_int32_ids_row_strides_and_no_tokens(device):
    storage = torch.randn(11, 70, device=device)
    x = storage[:, 5:45]  # [11, 40] with a row stride of 70: read in place
    w_gate_up, w_down = (w.to(device) for w in _weights(4, 40, 24, torch.float32))
    weights, ids = (t.to(device) for t in _routing(11, 4, 2))
    out = fused_moe(x, w_gate_up, w_down, weights, ids.to(torch.int32))
    expected = fused_moe_reference(x.double(), w_gate_up.double(), w_down.double(), weights.double(), ids)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    empty = torch.randn(0, 40, device=device, requires_grad=True)
    w = w_gate_up.clone().requires_grad_()
    out = fused_moe(empty, w, w_down, weights[:0], ids[:0])
    assert out.shape == (0, 40)
    out.sum().backward()
    assert empty.grad.shape == (0, 40) and w.grad.abs().sum() == 0


@pytest.mark.parametrize("layout", ["column stride 2", "transposed"])
def test_hidden_with_a_non_unit_last_stride_forward_and_backward(layout, device):
    """``hidden`` strided along its last dim (a slice every other column, a transposed view): the forward and
    every gradient as for a contiguous one (the backward kernel steps hidden's columns by 1; it read this
    layout's neighbours: dhidden off by 4, dW1 by 17, against float64)."""
    storage = torch.randn(13, 64, device=device)
    x = storage[:, ::2] if layout == "column stride 2" else torch.randn(32, 13, device=device).t()
    w_gate_up, w_down = (w.to(device) for w in _weights(4, 32, 16, torch.float32))
    weights, ids = (t.to(device) for t in _routing(13, 4, 2))
    leaves = [t.detach().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
    exact = [t.detach().double().requires_grad_() for t in leaves]
    dout = torch.randn(13, 32, device=device)
    out = fused_moe(*leaves, ids)
    expected = fused_moe_reference(*exact, ids)
    got = torch.autograd.grad(out, leaves, dout)
    truth = torch.autograd.grad(expected, exact, dout.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    for grad, true in zip(got, truth, strict=True):
        torch.testing.assert_close(grad.double(), true, rtol=1e-4, atol=1e-4)


def test_the_graph_keeps_no_activation(device):
    """What the autograd graph saves: the inputs and the int32 sort, nothing of [tokens * top_k, I] or 2I."""
    tokens, experts, top_k, hidden, inter = 16, 4, 2, 32, 24
    inputs = leaves(torch.randn(tokens, hidden), *_weights(experts, hidden, inter, torch.float32),
                    _routing(tokens, experts, top_k)[0], device=device)  # fmt: skip
    ids = _routing(tokens, experts, top_k)[1].to(device)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        fused_moe(*inputs, ids)
    floats = [t for t in saved if t.is_floating_point()]
    assert {t.data_ptr() for t in floats} <= {t.data_ptr() for t in inputs}, [t.shape for t in floats]
    indices = [t for t in saved if not t.is_floating_point() and t.data_ptr() != ids.data_ptr()]
    assert sorted(t.numel() for t in indices) == [experts, tokens * top_k, tokens * top_k]
    assert all(t.dtype == torch.int32 for t in indices)


def test_only_some_inputs_require_grad(device):
    x, w_gate_up, w_down = (t.to(device) for t in (torch.randn(10, 32), *_weights(4, 32, 16, torch.float32)))
    weights, ids = (t.to(device) for t in _routing(10, 4, 2))
    w = w_down.clone().requires_grad_()
    fused_moe(x, w_gate_up, w, weights, ids).square().sum().backward()
    w64 = w_down.double().requires_grad_()
    fused_moe_reference(x.double(), w_gate_up.double(), w64, weights.double(), ids).square().sum().backward()
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-4, atol=1e-5)


def test_opcheck(device):
    x = torch.randn(3, 16, device=device, requires_grad=True)
    w_gate_up, w_down = (w.to(device).requires_grad_() for w in _weights(2, 16, 16, torch.float32))
    weights, ids = (t.to(device) for t in _routing(3, 2, 1))
    weights.requires_grad_()
    torch.library.opcheck(torch.ops.llm_speed.fused_moe.default, (x, w_gate_up, w_down, weights, ids))


def test_compile_fullgraph_forward_and_backward(device):
    """``torch.compile(fullgraph=True)`` of a routing and the layer, forward and backward, as eager. The
    expert ids' value check (a host read on CPU tensors) made it fail: "Could not guard on data-dependent
    expression"; while the call is traced it is skipped (``runtime.check_values``), as for CUDA tensors."""

    def layer(x, w_gate_up, w_down, logits):
        weights, ids = moe_route(logits, 2)
        return fused_moe(x, w_gate_up, w_down, weights, ids)

    x = torch.randn(6, 32, device=device)
    w_gate_up, w_down = (w.to(device) for w in _weights(4, 32, 16, torch.float32))
    logits = torch.randn(6, 4, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (layer, compiled):
        inputs = [t.clone().requires_grad_() for t in (x, w_gate_up, w_down, logits)]
        out = fn(*inputs)
        out.square().sum().backward()
        results.append((out.detach(), *(t.grad for t in inputs)))
    for eager, traced in zip(*results, strict=True):
        torch.testing.assert_close(traced, eager, rtol=1e-6, atol=1e-6)


def _problem(device):
    x = torch.randn(6, 32, device=device)
    w_gate_up, w_down = (w.to(device) for w in _weights(4, 32, 16, torch.float32))
    weights, ids = (t.to(device) for t in _routing(6, 4, 2))
    return [x, w_gate_up, w_down, weights, ids]


BAD = [
    (lambda p: p.__setitem__(0, p[0].double()), TypeError, "hidden has dtype"),
    (lambda p: p.__setitem__(1, p[1].half()), TypeError, "w_gate_up must have hidden's dtype"),
    (lambda p: p.__setitem__(1, p[1][:, :31]), ValueError, "even 2 \\* intermediate"),
    (lambda p: p.__setitem__(1, p[1][:, :, :16]), ValueError, "with hidden's last dim \\(32\\)"),
    (lambda p: p.__setitem__(2, p[2][:3]), ValueError, "w_down must be \\[experts, hidden, intermediate\\]"),
    (lambda p: p.__setitem__(2, p[2].mT), ValueError, "w_down must be"),
    (lambda p: p.__setitem__(3, p[3][:, :1]), ValueError, "must have one shape"),
    (lambda p: p.__setitem__(4, p[4].float()), TypeError, "topk_ids has dtype"),
    (lambda p: p.__setitem__(4, p[4] + 3), ValueError, "topk_ids must be in \\[0, 4\\)"),
    (lambda p: p.__setitem__(4, p[4] - 5), ValueError, "topk_ids must be in \\[0, 4\\)"),
    (lambda p: (p.__setitem__(3, p[3][:5]), p.__setitem__(4, p[4][:5])), ValueError, "one per token \\(6\\)"),
]


@pytest.mark.parametrize(("change", "error", "message"), BAD)
def test_bad_input_is_a_clear_error_before_any_work(change, error, message, device, monkeypatch):
    # the values of topk_ids are checked where runtime.check_values allows a host read (CPU tensors by
    # default, CUDA ones under LLM_SPEED_CHECK_INPUTS=1): on, so every device tests the check; off, the
    # kernels make the rows NaN (test_unchecked_ids_out_of_range_make_their_token_nan)
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)
    problem = _problem(device)
    change(problem)
    before = runtime.launch_counts()
    with pytest.raises(error, match=message):
        fused_moe(*problem)
    assert runtime.launch_counts() == before
    with pytest.raises(ValueError, match="activation"):
        fused_moe(*_problem(device), activation="gelu")


def test_unchecked_ids_out_of_range_make_their_token_nan(monkeypatch, device):
    """With the value checks off, an expert id out of range turns its token's output row (and gradient row)
    into NaN; the other tokens are untouched and right; nothing outside a tensor is read or written."""
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    x, w_gate_up, w_down, weights, ids = _problem(device)
    ids = ids.clone()
    ids[2, 1] = 7
    ids[4, 0] = -2
    x.requires_grad_()
    out = fused_moe(x, w_gate_up, w_down, weights, ids)
    out.sum().backward()
    bad = torch.tensor([False, False, True, False, True, False], device=device)
    assert out[bad].isnan().all() and not out[~bad].isnan().any()
    assert x.grad[bad].isnan().all() and not x.grad[~bad].isnan().any()
    good = ~bad.cpu()
    expected = fused_moe_reference(*(t.detach().cpu().double() for t in (x, w_gate_up, w_down, weights)),
                                   ids.cpu().clamp(0, 3))  # fmt: skip
    torch.testing.assert_close(out.detach().cpu()[good].double(), expected[good], rtol=1e-5, atol=1e-5)
