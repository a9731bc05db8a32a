"""swiglu and geglu (the same kernels): float64 truth with the 2x/3x rule, ragged sizes, magnitudes, strides,
registration, bad input."""

import pytest
import torch
from fused_testing import DTYPES, GRAD_FACTOR, OUTPUT_FACTOR, assert_error_rule, expect_launches, leaves

import llm_speed.fused.swiglu as swiglu_module
from llm_speed import geglu, swiglu
from llm_speed.fused.reference import geglu_reference, swiglu_reference

KERNELS = (swiglu_module.FORWARD.name, swiglu_module.BACKWARD.name)
OPS = {"swiglu": (swiglu, swiglu_reference), "geglu": (geglu, geglu_reference)}


def _run(fn, gate, up, dout):
    if fn in (swiglu, geglu):
        gate, up = leaves(gate, up)
    out = fn(gate, up)
    (out.double() * dout.to(out.device).double()).sum().backward()  # float64 truth runs on the CPU
    return out.detach(), gate.grad, up.grad


# sigmoid(g) = 1 / (1 + exp(-g)): numpy warns when exp(-g) overflows to inf under the interpreter; the
# result (0) is right.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("shape", "magnitude"), [((1,), 1.0), ((3, 37), 4.0), ((2, 5, 113), 1.0), ((1031,), 30.0), ((4099,), 2.0)]
)
def test_accuracy(shape, magnitude, dtype, op, device):
    fn, reference = OPS[op]
    gate = (torch.randn(shape) * magnitude).to(dtype).to(device)
    up = torch.randn(shape).to(dtype).to(device)
    dout = torch.randn(shape).to(dtype).to(device)
    truth = _run(reference, *leaves(gate, up, dtype=torch.float64), dout)
    same = _run(reference, *leaves(gate, up), dout)
    with expect_launches(*KERNELS, device=device):
        got = _run(fn, gate, up, dout)
    assert got[0].dtype == dtype and got[0].shape == gate.shape
    for i, name in enumerate(("out", "dgate", "dup")):
        factor = OUTPUT_FACTOR if i == 0 else GRAD_FACTOR
        assert_error_rule(name, got[i], same[i], truth[i], factor, dtype, scale=magnitude)


def test_non_contiguous_and_empty(device):
    gate = torch.randn(40, 6).to(device).t()
    up = torch.randn(6, 40).to(device)
    torch.testing.assert_close(swiglu(gate, up), swiglu_reference(gate, up), rtol=1e-6, atol=1e-6)
    empty = torch.randn(0, 3, device=device, requires_grad=True)
    swiglu(empty, empty.detach()).sum().backward()
    assert empty.grad.shape == (0, 3)


@pytest.mark.parametrize("op", OPS)
def test_opcheck_and_compile_fullgraph(op, device):
    fn = OPS[op][0]
    gate = torch.randn(3, 45, device=device, requires_grad=True)
    up = torch.randn(3, 45, device=device, requires_grad=True)
    torch.library.opcheck(getattr(torch.ops.llm_speed, f"{op}_forward").default, (gate, up))
    args = (torch.randn(3, 45, device=device), gate.detach(), up.detach())
    torch.library.opcheck(getattr(torch.ops.llm_speed, f"{op}_backward").default, args)
    torch._dynamo.reset()
    compiled = torch.compile(lambda g, u: fn(g, u).square().sum(), fullgraph=True, backend="aot_eager")
    with expect_launches(*KERNELS, device=device):
        compiled(gate, up).backward()
    grads = gate.grad.clone(), up.grad.clone()
    gate.grad = up.grad = None
    fn(gate, up).square().sum().backward()
    torch.testing.assert_close(grads, (gate.grad, up.grad), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("gate", "up", "error", "match"),
    [
        ("x", torch.ones(2), TypeError, "gate must be a torch.Tensor"),
        (torch.ones(2), torch.ones(2, dtype=torch.int64), TypeError, "up has dtype"),
        (torch.ones(2), torch.ones(3), ValueError, "same shape"),
        (torch.ones(2), torch.ones(2, dtype=torch.float16), TypeError, "share one dtype"),
    ],
)
def test_bad_input(gate, up, error, match):
    for fn in (swiglu, geglu):
        with pytest.raises(error, match=match):
            fn(gate, up)


@pytest.mark.parametrize("op", OPS)
def test_a_repeated_call_skips_the_checks(op, device, monkeypatch):
    """A repeated call with the metadata of one checked before (and copied nothing) launches the kept plan:
    in inference directly, with grad inside the op's autograd node; the same outputs and gradients, as
    float64 says; a non-contiguous call (copied) and bad input are still checked."""
    from call_records import record_checks

    fn, reference = OPS[op]
    checked = record_checks(monkeypatch, device, swiglu_module, "_validate")
    gate, up, dout = (torch.randn(4, 37, device=device, dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        first = fn(gate, up)
        with expect_launches(KERNELS[0], device=device):
            again = fn(gate.clone(), up.clone())
    results = [_run(fn, gate, up, dout) for _ in range(2)]
    assert len(checked) == 1  # the first call: the others (with grad too: the same launch) were kept
    assert torch.equal(first, again) and torch.equal(first, results[0][0])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    truth = _run(reference, *leaves(gate, up, dtype=torch.float64), dout)
    same = _run(reference, *leaves(gate, up), dout)
    for i, name in enumerate(("out", "dgate", "dup")):
        factor = OUTPUT_FACTOR if i == 0 else GRAD_FACTOR
        assert_error_rule(name, results[1][i], same[i], truth[i], factor, torch.bfloat16)
    with torch.no_grad():
        fn(gate.t(), up.t())  # copied to contiguous: checked every time
        fn(gate.t(), up.t())
        with pytest.raises(TypeError, match="dtype"):
            fn(gate, up.float())
    assert len(checked) == 4
