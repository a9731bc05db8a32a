"""Every fused op, attention and matrix product under torch.autocast: the inputs cast as PyTorch's own
counterpart would (llm_speed.core.autocast), the same result whether the call runs the implementation directly
(no grad), through the eager autograd function, through the registered op (torch.compile, a dispatch mode)
or on inputs cast by hand outside autocast; the backward the same inside and outside the autocast region."""

import pytest
import torch
from fused_testing import GRAD_FACTOR, OUTPUT_FACTOR, assert_error_rule
from torch.utils._python_dispatch import TorchDispatchMode

import llm_speed
from llm_speed.core import autocast

BF16 = torch.bfloat16


def _f32(*shape, scale=1.0):
    return torch.randn(*shape) * scale


def _varlen(q, k, v, cu):
    return llm_speed.flash_attention_varlen(q, k, v, cu, cu, 9, 9, is_causal=True)


# name: (fp32 inputs maker, call, the policy's cast of each input, the outputs' dtypes)
CASES = {
    "rms_norm": (lambda: [_f32(6, 32).to(BF16), _f32(32)], lambda x, w: llm_speed.rms_norm(x, w),
                 (torch.float32, torch.float32), (torch.float32,)),
    "swiglu": (lambda: [_f32(4, 40), _f32(4, 40)], llm_speed.swiglu, (None, None), (torch.float32,)),
    "geglu": (lambda: [_f32(4, 40).to(BF16), _f32(4, 40).to(BF16)], llm_speed.geglu, (None, None), (BF16,)),
    "apply_rotary": (lambda: [_f32(1, 2, 5, 16), _f32(5, 8).cos(), _f32(5, 8).sin()],
                     llm_speed.apply_rotary, (None, "const", "const"), (torch.float32,)),
    "apply_rotary_qk": (lambda: [_f32(1, 2, 5, 16), _f32(1, 1, 5, 16), _f32(1, 5, 16).cos(),
                                 _f32(1, 5, 16).sin()],
                        llm_speed.apply_rotary_qk, (None, None, "const", "const"),
                        (torch.float32, torch.float32)),
    "fused_linear_cross_entropy": (
        lambda: [_f32(12, 16), _f32(40, 16, scale=0.3), _f32(40), torch.randint(0, 40, (12,))],
        lambda h, w, b, t: llm_speed.fused_linear_cross_entropy(h, w, t, bias=b, lse_square_scale=1e-3),
        (BF16, BF16, BF16, None), (torch.float32,)),
    "cross_entropy": (lambda: [_f32(12, 40, scale=3.0), torch.randint(0, 40, (12,))],
                      lambda x, t: llm_speed.cross_entropy(x, t, label_smoothing=0.1), (None, None),
                      (torch.float32,)),
    "flash_attention": (lambda: [_f32(1, 2, 16, 16), _f32(1, 1, 16, 16), _f32(1, 1, 16, 16)],
                        lambda q, k, v: llm_speed.flash_attention(q, k, v, is_causal=True), (BF16,) * 3,
                        (BF16,)),
    # Qwen3's and OLMo-2's q/k norms: float32 q and k beside a bfloat16 v, cast to meet (as SDPA does)
    "flash_attention_mixed": (lambda: [_f32(1, 2, 16, 16), _f32(1, 1, 16, 16), _f32(1, 1, 16, 16).to(BF16)],
                              lambda q, k, v: llm_speed.flash_attention(q, k, v, is_causal=True), (BF16,) * 3,
                              (BF16,)),
    "tiled_attention": (lambda: [_f32(1, 2, 16, 16), _f32(1, 1, 16, 16), _f32(1, 1, 16, 16)],
                        lambda q, k, v: llm_speed.tiled_attention(q, k, v, is_causal=True), (BF16,) * 3,
                        (BF16,)),
    "flash_attention_varlen": (
        lambda: [_f32(14, 2, 16), _f32(14, 1, 16), _f32(14, 1, 16),
                 torch.tensor([0, 5, 14], dtype=torch.int32)],
        _varlen, (BF16, BF16, BF16, None), (BF16,)),
    # the matrix products, as mm / linear: every float operand to the autocast dtype (mixed ones meet)
    "gemm": (lambda: [_f32(8, 16), _f32(16, 12), _f32(12)],
             lambda a, b, bias: llm_speed.gemm(a, b, bias=bias), (BF16, BF16, BF16), (BF16,)),
    "gemm_mixed": (lambda: [_f32(8, 16), _f32(16, 12).to(BF16)], llm_speed.gemm, (BF16, BF16), (BF16,)),
    "grouped_gemm": (lambda: [_f32(10, 16), _f32(2, 12, 16), torch.tensor([4, 10], dtype=torch.int32)],
                     lambda a, b, offsets: llm_speed.grouped_gemm(a, b, offsets, trans_b=True),
                     (BF16, BF16, None), (BF16,)),
    # nn.MoE's case: float32 expert weights beside the 16-bit activations of an autocast model
    "fused_moe": (lambda: [_f32(6, 16).to(BF16), _f32(3, 16, 16, scale=0.3), _f32(3, 16, 8, scale=0.3),
                           _f32(6, 2).softmax(-1), torch.randint(0, 3, (6, 2), dtype=torch.int32)],
                  llm_speed.fused_moe, (BF16, BF16, BF16, None, None), (BF16,)),
}  # fmt: skip


def _inputs(name, device):
    torch.manual_seed(1)
    tensors = [t.to(device) for t in CASES[name][0]()]
    return [t.requires_grad_() if t.is_floating_point() and cast != "const" else t
            for t, cast in zip(tensors, CASES[name][2], strict=True)]  # fmt: skip


def _outputs(out):
    return out if isinstance(out, tuple) else (out,)


def _run(name, device, *, autocast_on=True, backward_inside=True, compiled=False, grad=True, by_hand=False):
    """(outputs, gradients of the float inputs) of one way of calling the op."""
    make, call, casts, _ = CASES[name]
    inputs = _inputs(name, device)
    fn = call
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(call, fullgraph=True, backend="aot_eager")
    args = inputs
    if by_hand:  # the policy's casts done outside autocast
        args = [t.to(c) if isinstance(c, torch.dtype) else t for t, c in zip(inputs, casts, strict=True)]
    region = torch.autocast(device.type, dtype=BF16, enabled=autocast_on)
    with torch.set_grad_enabled(grad):
        with region:
            outs = _outputs(fn(*args))
            weights = [torch.linspace(-1, 1, o.numel(), device=device).reshape(o.shape) for o in outs]
            if grad and backward_inside:
                sum((o.float() * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
        if grad and not backward_inside:
            sum((o.float() * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
    grads = [t.grad for t in inputs if t.requires_grad] if grad else []
    return [o.detach() for o in outs], grads


@pytest.mark.parametrize("name", CASES)
def test_every_kind_of_call_agrees_under_autocast(name, device):
    expected_dtypes = CASES[name][3]
    by_hand = _run(name, device, autocast_on=False, by_hand=True)
    ways = {
        "direct (no grad)": _run(name, device, grad=False),
        "autograd, backward inside": _run(name, device),
        "autograd, backward outside": _run(name, device, backward_inside=False),
        "compiled": _run(name, device, compiled=True),
    }
    assert tuple(o.dtype for o in by_hand[0]) == expected_dtypes
    for way, (outs, grads) in ways.items():
        assert tuple(o.dtype for o in outs) == expected_dtypes, way
        for got, expected in zip(outs, by_hand[0], strict=True):
            assert torch.equal(got, expected), f"{name}, {way}: output"
        if grads:
            for got, expected in zip(grads, by_hand[1], strict=True):
                assert got.dtype == expected.dtype and torch.equal(got, expected), f"{name}, {way}: gradient"


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "name", ["fused_linear_cross_entropy", "flash_attention", "flash_attention_mixed", "rms_norm", "gemm",
             "grouped_gemm", "fused_moe"]
)
def test_the_registered_op_applies_the_same_rule(name, device):
    # under a dispatch mode the call goes through the registered op, whose Autocast kernel casts
    by_hand, _ = _run(name, device, autocast_on=False, by_hand=True, grad=False)
    with _Passthrough():
        outs, _ = _run(name, device, grad=False)
    for got, expected in zip(outs, by_hand, strict=True):
        assert torch.equal(got, expected)


def test_fused_linear_cross_entropy_backward_in_autocast_is_as_accurate_as_pytorchs(device):
    # The case: the backward inside torch.autocast. PyTorch's linear + cross_entropy under autocast
    # against the float64 truth of the same bfloat16 operands; ours within the rule of it.
    torch.manual_seed(0)
    h32, w32 = torch.randn(64, 48, device=device), torch.randn(300, 48, device=device) * 0.2
    target = torch.randint(0, 300, (64,), device=device)
    h64, w64 = (t.to(BF16).double().cpu().requires_grad_() for t in (h32, w32))
    truth_loss = torch.nn.functional.cross_entropy(h64 @ w64.t(), target.cpu())
    truth_loss.backward()
    runs = []
    for fn in (lambda h, w: torch.nn.functional.cross_entropy(torch.nn.functional.linear(h, w), target),
               lambda h, w: llm_speed.fused_linear_cross_entropy(h, w, target, chunk_rows=16)):  # fmt: skip
        h, w = h32.clone().requires_grad_(), w32.clone().requires_grad_()
        with torch.autocast(device.type, dtype=BF16):
            loss = fn(h, w)
            loss.backward()
        runs.append((loss.detach(), h.grad, w.grad))
    same, got = runs
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.float32
    assert_error_rule("loss", got[0], same[0], truth_loss.detach(), OUTPUT_FACTOR, BF16)
    assert_error_rule("dhidden", got[1], same[1], h64.grad, GRAD_FACTOR, BF16)
    assert_error_rule("dweight", got[2], same[2], w64.grad, GRAD_FACTOR, BF16)


def test_policies_and_an_autocast_of_another_device(device):
    with pytest.raises(ValueError, match="policy is 'upcast'"):
        autocast.AutocastOp(lambda x: x, "upcast")
    # autocast on for another device type than the inputs': nothing is cast
    other = "cuda" if device.type == "cpu" else "cpu"
    x = torch.randn(4, 16, device=device)
    w = torch.randn(16, device=device)
    with torch.autocast(other, dtype=BF16, enabled=torch.amp.is_autocast_available(other)):
        assert llm_speed.rms_norm(x.to(BF16), w.to(BF16)).dtype == BF16
