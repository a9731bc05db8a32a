"""Gradients of gemm (vs float64 autograd), torch.library opcheck, and torch.compile(fullgraph=True)."""

import pytest
import torch
from matmul_helpers import assert_error_rule, matmul_cap, torch_same_precision

import llm_speed
from llm_speed.core import runtime
from llm_speed.matmul import gemm_reference
from llm_speed.matmul.gemm_kernels import TILED_KERNEL
from llm_speed.matmul.reference import ACTIVATIONS

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def leaf(x: torch.Tensor, dtype=None) -> torch.Tensor:
    return x.detach().to(dtype or x.dtype).requires_grad_(True)


def check_gradients(a, b, *, c=None, bias=None, factor=3.0, transposed_grad=False, **kwargs):
    """Kernel gradients vs float64: at most ``factor`` x PyTorch's same-precision gradient error + a cap."""
    named = {"a": a, "b": b, "c": c, "bias": bias}
    present = {name: x for name, x in named.items() if x is not None}

    kernel_in = {name: leaf(x) for name, x in present.items()}
    out = llm_speed.gemm(
        kernel_in["a"], kernel_in["b"], c=kernel_in.get("c"), bias=kernel_in.get("bias"), **kwargs
    )
    grad_out = torch.randn_like(out, dtype=torch.float32).to(out.dtype)
    if transposed_grad:  # a non-contiguous output gradient (a column-major view)
        grad_out = grad_out.mT.contiguous().mT
    out.backward(grad_out)

    ref_in = {name: leaf(x, torch.float64) for name, x in present.items()}
    ref_kwargs = {key: v for key, v in kwargs.items() if key != "out_dtype"}
    expected = gemm_reference(ref_in["a"], ref_in["b"], c=ref_in.get("c"), bias=ref_in.get("bias"),
                              out_dtype=torch.float64, **ref_kwargs)  # fmt: skip
    expected.backward(grad_out.double())

    same_in = {name: leaf(x) for name, x in present.items()}
    same = torch_same_precision(
        same_in["a"], same_in["b"], c=same_in.get("c"), bias=same_in.get("bias"), **kwargs
    )
    same.backward(grad_out)

    reduction = max(max(a.shape), max(b.shape)) * (a.shape[0] if a.dim() == 3 else 1)
    for name in present:
        if name == "c" and kwargs.get("beta", 0.0) == 0:
            continue
        got, want, torch_grad = kernel_in[name].grad, ref_in[name].grad, same_in[name].grad
        assert got is not None and got.dtype == present[name].dtype and got.shape == present[name].shape, name
        assert got.isfinite().all(), name
        cap = matmul_cap(got.dtype, want, reduction)
        assert_error_rule(f"grad {name}", got, torch_grad, want, factor, cap=cap)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_gradients_all_layouts(device, trans_a, trans_b):
    m, n, k = 21, 18, 35
    a = torch.randn(*((k, m) if trans_a else (m, k)), device=device)
    b = torch.randn(*((n, k) if trans_b else (k, n)), device=device)
    c, bias = torch.randn(m, n, device=device), torch.randn(n, device=device)
    check_gradients(a, b, c=c, bias=bias, alpha=0.75, beta=-1.5, trans_a=trans_a, trans_b=trans_b,
                    activation="gelu")  # fmt: skip


@pytest.mark.parametrize("activation", (None,) + ACTIVATIONS)
def test_gradients_each_activation(device, activation):
    a, b = torch.randn(19, 26, device=device) * 2, torch.randn(26, 23, device=device)
    check_gradients(a, b, bias=torch.randn(23, device=device), activation=activation)


@pytest.mark.parametrize(
    "a_shape, b_shape, c_shape",
    [
        ((3, 12, 20), (20, 14), (14,)),
        ((1, 12, 20), (3, 20, 14), (3, 1, 14)),
        ((12, 20), (2, 20, 14), (12, 14)),
    ],
)
def test_gradients_batched_broadcast(device, a_shape, b_shape, c_shape):
    a, b = torch.randn(*a_shape, device=device), torch.randn(*b_shape, device=device)
    c, bias = torch.randn(*c_shape, device=device), torch.randn(14, device=device)
    check_gradients(a, b, c=c, beta=0.5, bias=bias, activation="silu")


def test_gradients_with_non_contiguous_output_gradient(device):
    a, b = torch.randn(22, 31, device=device), torch.randn(31, 27, device=device)
    check_gradients(a, b, bias=torch.randn(27, device=device), activation="gelu", transposed_grad=True)


@pytest.mark.parametrize("activation", [None, "relu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gradients_half_precision(device, dtype, activation):
    a, b = torch.randn(24, 40, device=device).to(dtype), torch.randn(40, 17, device=device).to(dtype)
    c, bias = torch.randn(24, 17, device=device).to(dtype), torch.randn(17, device=device).to(dtype)
    check_gradients(a, b, c=c, beta=0.75, bias=bias, activation=activation)


@pytest.mark.parametrize("a_shape, b_shape", [((12, 40), (6, 40, 17)), ((6, 40, 12), (1, 40, 17))])
def test_gradients_half_precision_broadcast(device, a_shape, b_shape):
    """The broadcast operand's gradient is a sum over the batch (done on fp32 products, rounded once)."""
    a = torch.randn(*a_shape, device=device).bfloat16()
    b = torch.randn(*b_shape, device=device).bfloat16()
    check_gradients(a, b, trans_a=len(a_shape) == 3, bias=torch.randn(17, device=device).bfloat16(),
                    activation="silu")  # fmt: skip


def test_gradients_with_fp32_output_of_half_inputs(device):
    a, b = torch.randn(16, 30, device=device).half(), torch.randn(30, 12, device=device).half()
    check_gradients(
        a, b, out_dtype=torch.float32, activation="gelu_tanh", bias=torch.randn(12, device=device)
    )


@pytest.mark.parametrize("m, n, k", [(0, 5, 6), (4, 0, 6), (4, 5, 0)])
def test_gradients_of_empty_problems(device, m, n, k):
    """Zero-size problems have zero-size or all-zero gradients (K == 0: the product is 0 for any a, b)."""
    a = torch.randn(m, k, device=device, requires_grad=True)
    b = torch.randn(k, n, device=device, requires_grad=True)
    bias = torch.randn(n, device=device, requires_grad=True)
    llm_speed.gemm(a, b, bias=bias).sum().backward()
    assert a.grad.shape == (m, k) and b.grad.shape == (k, n)
    assert (a.grad == 0).all() or k == 0 or n == 0
    assert (b.grad == 0).all() or k == 0 or m == 0
    torch.testing.assert_close(bias.grad, torch.full((n,), float(m), device=device))


def test_backward_runs_the_kernel(device):
    a = torch.randn(10, 12, device=device, requires_grad=True)
    b = torch.randn(12, 8, device=device, requires_grad=True)
    out = llm_speed.gemm(a, b, activation="relu", bias=torch.randn(8, device=device))
    before = runtime.launch_count(TILED_KERNEL)
    out.sum().backward()
    # one recomputation of the pre-activation, one GEMM for each of grad a and grad b
    assert runtime.launch_count(TILED_KERNEL) == before + 3


def test_beta_zero_gives_c_no_gradient(device):
    a, b = torch.randn(6, 7, device=device, requires_grad=True), torch.randn(7, 5, device=device)
    c = torch.randn(6, 5, device=device, requires_grad=True)
    llm_speed.gemm(a, b, beta=0.0, c=c).sum().backward()
    assert c.grad is None and a.grad is not None


def test_opcheck(device):
    a = torch.randn(9, 12, device=device, requires_grad=True)
    b = torch.randn(5, 12, device=device, requires_grad=True)  # used transposed
    c = torch.randn(9, 5, device=device, requires_grad=True)
    bias = torch.randn(5, device=device, requires_grad=True)
    args = (a, b, c, bias, 1.5, 0.5, False, True, "silu", torch.float32)
    torch.library.opcheck(torch.ops.llm_speed.gemm.default, args)
    a8, b8 = (
        torch.randint(-128, 128, (7, 20), dtype=torch.int8),
        torch.randint(-128, 128, (20, 6), dtype=torch.int8),
    )
    torch.library.opcheck(torch.ops.llm_speed.gemm_int8.default, (a8.to(device), b8.to(device)))


def test_torch_compile_fullgraph(device):
    def layer(x, weight, bias):
        return llm_speed.gemm(x, weight, trans_b=True, bias=bias, activation="gelu_tanh")

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 8, 16, device=device, requires_grad=True)
    weight = torch.randn(12, 16, device=device, requires_grad=True)
    bias = torch.randn(12, device=device, requires_grad=True)
    before = runtime.launch_count(TILED_KERNEL)
    out = compiled(x, weight, bias)
    assert runtime.launch_count(TILED_KERNEL) > before  # the graph called the Triton op
    torch.testing.assert_close(out, layer(x, weight, bias), rtol=0, atol=0)
    out.sum().backward()
    assert x.grad is not None and weight.grad is not None and bias.grad is not None


def test_torch_compile_inductor_forward(device):
    """The default backend (Inductor) captures the op in one graph too; forward only, to keep it short."""
    compiled = torch.compile(lambda x, w: llm_speed.gemm(x, w, alpha=2.0, activation="relu"), fullgraph=True)
    x, w = torch.randn(8, 16, device=device), torch.randn(16, 12, device=device)
    torch.testing.assert_close(
        compiled(x, w), llm_speed.gemm(x, w, alpha=2.0, activation="relu"), rtol=0, atol=0
    )


@pytest.mark.parametrize("activation", [None, *ACTIVATIONS])
def test_double_backward_matches_float64(device, activation):
    # create_graph=True through every activation (silu's failed in aten's silu_backward, which has no
    # derivative), then a gradient of the gradients, against float64 autograd of the reference.
    torch.manual_seed(0)
    a, b, bias = (torch.randn(*shape, device=device) for shape in ((7, 12), (9, 12), (9,)))

    def second_order(gemm, a, b, bias):
        y = gemm(a, b, bias=bias, trans_b=True, activation=activation)
        ga, gb = torch.autograd.grad(y.pow(2).sum(), (a, b), create_graph=True)
        return torch.autograd.grad((ga.sin().sum() + gb.pow(2).sum()), (a, b, bias))

    ours = second_order(llm_speed.gemm, *(leaf(x) for x in (a, b, bias)))
    truth = second_order(gemm_reference, *(leaf(x, torch.float64) for x in (a, b, bias)))
    same = second_order(gemm_reference, *(leaf(x) for x in (a, b, bias)))
    for name, got, want, torch_grad in zip("a b bias".split(), ours, truth, same, strict=True):
        assert got.isfinite().all(), name
        cap = 1e-5 * want.abs().max()
        assert_error_rule(f"second-order grad {name}", got, torch_grad, want, 3.0, cap=cap)

