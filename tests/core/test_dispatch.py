"""core.dispatch: which path a call takes (plain_call) and the autograd node Op.checked records around a kept
launch, on a small pure-PyTorch op (no kernel needed)."""

from __future__ import annotations

import pytest
import torch

from llm_speed.core.dispatch import AUTOGRAD, INFERENCE, Op, plain_call, plain_inference


@torch.library.custom_op("llm_speed_test::scaled_product", mutates_args=())
def _scaled_product_op(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    return x * y * scale


@_scaled_product_op.register_fake
def _(x, y, scale):
    return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
    x, y, scale = inputs
    ctx.save_for_backward(x, y)
    ctx.scale = scale


def _backward(ctx, grad):
    x, y = ctx.saved_tensors
    need_x, need_y = ctx.needs_input_grad[:2]  # indices of the op's own arguments
    return (grad * y * ctx.scale if need_x else None), (grad * x * ctx.scale if need_y else None), None


def _impl(x, y, scale):
    return x * y * scale


_op = Op(_scaled_product_op, _impl, setup_context=_setup_context, backward=_backward)


def test_plain_call_tells_inference_autograd_and_the_rest():
    x, y = torch.randn(3), torch.randn(3)
    leaf = torch.randn(3, requires_grad=True)
    assert plain_call(x, y) == INFERENCE and plain_call(x, optional=(None,)) == INFERENCE
    assert plain_inference(x, optional=(None,))
    # a required tensor that is None: the op's full path, whose checks name it
    assert plain_call(x, None) == 0 and not plain_inference(None, optional=(x,))
    assert plain_call(x, leaf) == AUTOGRAD and not plain_inference(x, leaf)
    assert plain_call(x, optional=(leaf,)) == AUTOGRAD and plain_call(x, optional=(3,)) == 0
    with torch.no_grad():
        assert plain_call(x, leaf) == INFERENCE
    assert plain_call(x, torch.nn.Parameter(torch.randn(3))) == AUTOGRAD
    assert plain_call(x, 3) == 0  # not a tensor
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert plain_call(x, y) == 0
    assert torch.func.grad(lambda t: (plain_call(t) == 0) * t.sum())(x).eq(1).all()  # a transform is active


@pytest.mark.parametrize("needs", [(True, True), (False, True), (True, False)], ids=["both", "y", "x"])
def test_checked_records_the_ops_node_around_run(needs):
    """Op.checked runs the given function for the forward and records the op's own backward: gradients as
    the op's full path gives them, for exactly the inputs that require grad; the run function gets none."""
    ran = []

    def run(x, y, scale):
        ran.append(scale)
        return x * y * scale

    x, y = (torch.randn(4, dtype=torch.float64, requires_grad=need) for need in needs)
    out = _op.checked(run, x, y, 0.5)
    out.backward(torch.ones(4, dtype=torch.float64))
    assert ran == [0.5]
    x2, y2 = (t.detach().requires_grad_(t.requires_grad) for t in (x, y))
    _op(x2, y2, 0.5).backward(torch.ones(4, dtype=torch.float64))
    for got, expected in ((x.grad, x2.grad), (y.grad, y2.grad)):
        assert (got is None and expected is None) or torch.equal(got, expected)
    inputs = x.detach().requires_grad_(), y.detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: _op.checked(run, a, b, 0.5), inputs)


def _product_and_statistic_op(name: str, statistic):
    """A custom op ``llm_speed_test::<name>`` of two outputs: x * y and ``statistic(x * y)`` as [1]."""

    @torch.library.custom_op(f"llm_speed_test::{name}", mutates_args=())
    def op(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * y, statistic(x * y).reshape(1)

    @op.register_fake
    def _(x, y):
        return torch.empty_like(x), x.new_empty(1)

    return op


_product_and_norm_op = _product_and_statistic_op("product_and_norm", torch.linalg.vector_norm)


def _two_outputs_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)
    ctx.mark_non_differentiable(output[1])


_backward_grads = []


def _two_outputs_backward(ctx, grad, grad_norm):
    _backward_grads.append((grad, grad_norm))
    x, y = ctx.saved_tensors
    return grad * y, grad * x


_two_outputs = Op(_product_and_norm_op, lambda x, y: _product_and_norm_op._init_fn(x, y),
                  setup_context=_two_outputs_setup, backward=_two_outputs_backward)  # fmt: skip


class _NoGradient(torch.autograd.Function):
    """Identity whose backward gives its input no gradient (None), as a backward may."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


@pytest.mark.parametrize("checked", [False, True], ids=["op", "checked"])
def test_outputs_nobody_differentiates_get_none_not_zeros(checked):
    """An output no gradient reaches (an op's statistics: an LSE, an rstd) reaches the backward as None,
    never as a tensor of zeros (an allocation and a memset launch per backward on a GPU); when no output's
    gradient is defined, the op's backward is not called and no input gets a gradient."""
    _backward_grads.clear()
    x, y = (torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    out, norm = _two_outputs.checked(_product_and_norm_op._init_fn, x, y) if checked else _two_outputs(x, y)
    assert not norm.requires_grad
    out.backward(torch.ones(4, dtype=torch.float64))
    [(grad, grad_norm)] = _backward_grads
    assert grad_norm is None and torch.equal(grad, torch.ones(4, dtype=torch.float64))
    assert torch.equal(x.grad, y.detach()) and torch.equal(y.grad, x.detach())

    _backward_grads.clear()
    x2, y2 = (t.detach().requires_grad_() for t in (x, y))
    out2, _ = _two_outputs.checked(_product_and_norm_op._init_fn, x2, y2) if checked else _two_outputs(x2, y2)
    other = torch.randn(4, dtype=torch.float64, requires_grad=True)
    (_NoGradient.apply(out2) + other).sum().backward()
    assert _backward_grads == [] and x2.grad is None and y2.grad is None and other.grad is not None


# An op of its own: Op(...) registers its autograd with the library op, which would replace _two_outputs'.
_product_and_sum_op = _product_and_statistic_op("product_and_sum", torch.sum)


def test_checked_outputs_returns_the_leading_outputs_only():
    """Op(checked_outputs=k): Op.checked returns the first k outputs (setup_context still sees them all and
    may mark the others), the backward gets their gradients alone; the op's full path returns every
    output."""
    seen, grads_seen = [], []

    def setup(ctx, inputs, output):
        seen.append(len(output))
        _two_outputs_setup(ctx, inputs, output)

    def backward(ctx, *grads):
        grads_seen.append(len(grads))
        x, y = ctx.saved_tensors
        return grads[0] * y, grads[0] * x

    op = Op(_product_and_sum_op, lambda x, y: _product_and_sum_op._init_fn(x, y), setup_context=setup,
            backward=backward, checked_outputs=1)  # fmt: skip
    x, y = (torch.randn(4, dtype=torch.float64, requires_grad=True) for _ in range(2))
    (out,) = op.checked(_product_and_sum_op._init_fn, x, y)
    out.sum().backward()
    assert seen == [2] and grads_seen == [1]
    assert torch.equal(x.grad, y.detach()) and torch.equal(y.grad, x.detach())
    assert len(op(x.detach().requires_grad_(), y)) == 2


def test_differentiations_without_a_rule_are_refused_by_name():
    """Forward-mode AD gave zero tangents with no error (a custom op's default), and torch.func.grad failed
    inside PyTorch naming neither the op nor why (audit of 2026-12-07): both refused, naming the op; vmap
    and backward-mode autograd still work."""
    import torch.autograd.forward_ad as forward_ad

    import llm_speed

    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with pytest.raises(NotImplementedError, match=r"gemm has no rule for torch.func.jvp / jacfwd"):
        torch.func.jvp(lambda x: llm_speed.gemm(x, b), (a,), (torch.ones_like(a),))
    with pytest.raises(NotImplementedError, match=r"gemm has no rule for torch.func.grad"):
        torch.func.grad(lambda x: llm_speed.gemm(x, b).sum())(a)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(a, torch.ones_like(a))
        with pytest.raises(NotImplementedError, match="gemm has no rule for forward-mode AD"):
            llm_speed.gemm(dual, b)
        assert llm_speed.gemm(a, b).shape == (4, 3)  # tensors without tangents are served as before
    batched = torch.randn(2, 4, 8)
    torch.testing.assert_close(torch.vmap(lambda x: llm_speed.gemm(x, b))(batched), batched @ b)
