"""rms_norm: float64 truth with the 2x/3x rule, ragged sizes, offsets, no weight, both castings, the in-place
backward, strides, registration, bad input."""

import pytest
import torch
from fused_testing import DTYPES, GRAD_FACTOR, OUTPUT_FACTOR, assert_error_rule, expect_launches, leaves

import llm_speed.fused.rms_norm as rms_module
from call_records import record_checks
from llm_speed import rms_norm
from llm_speed.core import runtime
from llm_speed.fused.reference import rms_norm_reference

KERNELS = (rms_module.FORWARD.name, rms_module.BACKWARD.name)
WEIGHTED = (*KERNELS, rms_module.WEIGHT_GRAD.name)  # with a weight: its gradient's reduction too


def _run(fn, x, w, dy, **kw):
    if fn is rms_norm:
        x, w = leaves(x, w) if w is not None else (leaves(x)[0], None)
    y = fn(x, w, **kw)
    (y.double() * dy.to(y.device).double()).sum().backward()  # float64 truth runs on the CPU
    return y.detach(), x.grad, (w.grad if w is not None else None)


def _check(x, w, *, scale=1.0, **kw):
    dtype = x.dtype
    dy = torch.randn(x.shape).to(dtype).to(x.device)
    if w is None:
        truth = _run(rms_norm_reference, leaves(x, dtype=torch.float64)[0], None, dy, **kw)
        same = _run(rms_norm_reference, leaves(x)[0], None, dy, **kw)
    else:
        truth = _run(rms_norm_reference, *leaves(x, w, dtype=torch.float64), dy, **kw)
        same = _run(rms_norm_reference, *leaves(x, w, dtype=None), dy, **kw)
    with expect_launches(*(KERNELS if w is None else WEIGHTED), device=x.device):
        got = _run(rms_norm, x, w, dy, **kw)
    assert got[0].dtype == dtype and got[0].shape == x.shape and (w is None or got[2].dtype == w.dtype)
    for i, name in enumerate(("y", "dx", "dw")[: 2 if w is None else 3]):
        # dx scales like 1 / |x|; dw sums |dy * xhat| over rows
        s = (1.0 if i == 0 else scale) * (max(1, x.numel() // x.shape[-1]) if i == 2 else 1)
        assert_error_rule(name, got[i], same[i], truth[i], OUTPUT_FACTOR if i == 0 else GRAD_FACTOR, dtype, s)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 40), (3, 5, 72), (17, 96)])
def test_accuracy_ragged_shapes(shape, dtype, device):
    x = torch.randn(shape).to(dtype).to(device)
    w = (1 + 0.3 * torch.randn(shape[-1])).to(dtype).to(device)
    _check(x, w, eps=1e-6)


def test_weight_gradient_reduction_over_many_partial_rows(monkeypatch, device):
    """The weight gradient's reduction in several tiles of partial rows and columns, the last ones ragged
    (on a GPU one partial row per SM: 132 rows on an H100, in tiles of 64)."""
    from llm_speed.core import launch

    monkeypatch.setattr(rms_module, "INTERPRETER_PROGRAMS", 37)
    monkeypatch.setattr(rms_module, "WEIGHT_GRAD_COLUMNS", 16)
    rms_module.backward_config.cache_clear()
    launch.clear_plans()
    try:
        x = torch.randn(75, 40).to(torch.bfloat16).to(device)
        w = (1 + 0.3 * torch.randn(40)).to(torch.bfloat16).to(device)
        _check(x, w, eps=1e-6)
        if runtime.triton_runs_on(x.device):
            dtypes = (x.dtype, x.dtype, w.dtype, torch.float32)
            _, weight_grad = rms_module._backward_plan(75, 40, (40, 40, 40), dtypes, False, x.device)
            # 40 columns in 3 programs of 16; 25 partial rows (3 rows each) in 2 tiles of 16
            assert weight_grad.grid[0] == 3 and weight_grad.fixed["BLOCK_P"] == 16
    finally:
        rms_module.backward_config.cache_clear()
        launch.clear_plans()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_offset_fp32_weight_large_magnitude_and_positive_inputs(dtype, device):
    x = (torch.rand(2, 7, 56) * 3e3).to(dtype).to(device)
    w = (0.1 * torch.randn(56)).to(device)  # float32 weight with a 16-bit x, stored minus 1
    _check(x, w, offset=1.0, eps=1e-5, scale=1.0)


def test_non_contiguous_input_and_zero_rows(device):
    base = torch.randn(6, 4, 48).to(device)
    x = base.transpose(0, 1)  # [4, 6, 48], rows not flattenable in place
    w = torch.randn(48).to(device)
    torch.testing.assert_close(rms_norm(x, w), rms_norm_reference(x, w), rtol=1e-6, atol=1e-6)
    empty = torch.randn(0, 48, device=device, requires_grad=True)
    out = rms_norm(empty, w)
    out.sum().backward()
    assert out.shape == (0, 48) and empty.grad.shape == (0, 48)


def test_opcheck_and_compile_fullgraph(device):
    x = torch.randn(5, 40, device=device, requires_grad=True)
    w = torch.randn(40, device=device, requires_grad=True)
    for llama, weight in ((False, w), (True, w), (False, None)):
        args = (x, weight, 1e-6, 1.0, llama, False)
        torch.library.opcheck(torch.ops.llm_speed.rms_norm_forward.default, args)
        y, rstd = torch.ops.llm_speed.rms_norm_forward(x.detach(), w.detach(), 1e-6, 1.0, llama, False)
        weight = None if weight is None else weight.detach()
        args = (torch.randn_like(y), x.detach(), weight, rstd, 1.0, llama)
        torch.library.opcheck(torch.ops.llm_speed.rms_norm_backward.default, args)
        torch.library.opcheck(torch.ops.llm_speed.rms_norm_backward_in_place.default, args)
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda a, b: rms_norm(a, b, offset=1.0).square().sum(), fullgraph=True, backend="aot_eager"
    )
    with expect_launches(*WEIGHTED, device=device):
        compiled(x, w).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    rms_norm(x, w, offset=1.0).square().sum().backward()
    torch.testing.assert_close((gx, gw), (x.grad, w.grad), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("x", "w", "kw", "error", "match"),
    [
        ([1.0], torch.ones(1), {}, TypeError, "x must be a torch.Tensor"),
        (torch.ones(2, 4, dtype=torch.float64), torch.ones(4), {}, TypeError, "x has dtype"),
        (torch.ones(2, 4), torch.ones(4, dtype=torch.int32), {}, TypeError, "weight has dtype"),
        (torch.ones(2, 4), torch.ones(5), {}, ValueError, "weight has 5 elements"),
        (torch.ones(2, 4), torch.ones(1, 4), {}, ValueError, "weight must have 1 dims"),
        (torch.ones(2, 4), torch.ones(4), {"eps": -1.0}, ValueError, "eps must be >= 0"),
        (torch.ones(2, 4), torch.ones(4), {"eps": float("nan")}, ValueError, "eps must be finite"),
        (torch.ones(2, 4), torch.ones(4), {"offset": True}, TypeError, "offset must be a real number"),
        (torch.ones(2, 0), torch.ones(0), {}, ValueError, "hidden"),
        (torch.ones(2, 4), None, {"offset": 1.0}, ValueError, "without a weight it must be 0.0"),
        (torch.ones(2, 4), torch.ones(4), {"casting": "gemma"}, ValueError, "casting is 'gemma'"),
        (torch.ones(2, 4), torch.ones(4), {"in_place": 1}, TypeError, "in_place must be a bool"),
    ],
)
def test_bad_input(x, w, kw, error, match):
    with pytest.raises(error, match=match):
        rms_norm(x, w, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_weight(dtype, device):
    x = (torch.randn(5, 3, 40) * 4).to(dtype).to(device)
    _check(x, None, eps=1e-5, scale=0.25)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_llama_casting(offset, dtype, device):
    # the normalised x rounded to x's dtype before the weight, as Llama's module; float64 truth of that
    # formula
    x = torch.randn(4, 6, 56).to(dtype).to(device)
    w = (1 + 0.3 * torch.randn(56)).to(dtype).to(device)
    _check(x, w, casting="llama", offset=offset, eps=1e-6)


def test_llama_casting_is_llamas_module_bit_for_bit(device):
    # Hugging Face's LlamaRMSNorm: weight * (x.float() * rsqrt(mean(x^2) + eps)).to(bf16), weight bf16
    x = torch.randn(8, 64).bfloat16().to(device)
    w = (1 + 0.3 * torch.randn(64)).bfloat16().to(device)
    xf = x.float()
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    got = rms_norm(x, w, eps=1e-6, casting="llama")
    # rsqrt and the mean may differ from PyTorch's by an ulp of float32 before the rounding to bfloat16
    assert (got.float() - expected.float()).abs().max() <= 2 ** -7 * expected.float().abs().max()
    assert (got != expected).float().mean() < 0.02
    assert not torch.equal(rms_norm(x, w, eps=1e-6), got)  # float32 casting rounds once: another result


@pytest.mark.parametrize("weighted", [True, False])
def test_in_place_backward_writes_dx_over_dy_with_the_same_gradients(weighted, device):
    x = torch.randn(6, 48, device=device, requires_grad=True)
    w = (1 + 0.1 * torch.randn(48, device=device)).requires_grad_() if weighted else None
    results = []
    for in_place in (False, True):
        x.grad = None
        if w is not None:
            w.grad = None
        seen = []
        y = rms_norm(x * 1.0, w, in_place=in_place)  # x * 1.0: the norm's input is not a leaf
        y.register_hook(seen.append)
        (y * torch.linspace(-1, 1, 48, device=device)).sum().backward()
        results.append((x.grad.clone(), None if w is None else w.grad.clone(), seen[0]))
    (dx, dw, dy), (dx_in_place, dw_in_place, dy_in_place) = results
    torch.testing.assert_close(dx_in_place, dx, rtol=0, atol=0)
    if weighted:
        torch.testing.assert_close(dw_in_place, dw, rtol=0, atol=0)
    assert not torch.equal(dy, dx) and torch.equal(dy_in_place, dx)  # dy's memory now holds dx


def test_a_repeated_inference_call_skips_the_checks(device, monkeypatch):
    """The second inference call with the same metadata is served from the calls checked before (one
    launch, no check, values as float64 says); every bad argument still gets its error."""
    checked = record_checks(monkeypatch, device, rms_module, "_validate")
    x = torch.randn(3, 5, 96, device=device, dtype=torch.bfloat16)
    w = torch.randn(96, device=device, dtype=torch.float32)
    with torch.no_grad():
        rms_norm(x, w, eps=1e-5, offset=1.0)
        before = runtime.launch_count(rms_module.FORWARD.name)
        y = rms_norm(x.clone(), w, eps=1e-5, offset=1.0)
        assert runtime.launch_count(rms_module.FORWARD.name) == before + 1 and len(checked) == 1
        assert y.shape == x.shape
        truth = rms_norm_reference(x.double(), w.double(), eps=1e-5, offset=1.0)
        same = rms_norm_reference(x, w, eps=1e-5, offset=1.0)
        assert_error_rule("rms_norm", y, same, truth, OUTPUT_FACTOR, torch.bfloat16)
        with pytest.raises(ValueError, match="eps"):
            rms_norm(x, w, eps=-1e-5, offset=1.0)
        with pytest.raises(ValueError, match="casting"):
            rms_norm(x, w, eps=1e-5, offset=1.0, casting="LLAMA")
        with pytest.raises(TypeError, match="in_place"):
            rms_norm(x, w, eps=1e-5, offset=1.0, in_place=1)
        plain = rms_norm(x, None)
        truth, same = rms_norm_reference(x.double(), None), rms_norm_reference(x, None)
        assert_error_rule("rms_norm", plain, same, truth, OUTPUT_FACTOR, torch.bfloat16)
        with pytest.raises(ValueError, match="offset"):
            rms_norm(x, None, offset=1.0)  # without a weight the offset must be 0
    assert len(checked) == 6
    # inference plans store no rstd (no backward reads it): the pointer is compiled out
    plans = rms_module._RMS_NORM_CALLS.values()
    assert [plan.fixed.get("rstd_ptr", "stored") for plan in plans] == [None, None]


@pytest.mark.parametrize("in_place", [False, True], ids=["new-dx", "in-place"])
def test_a_repeated_call_with_grad_records_the_node_around_the_kept_launch(in_place, device, monkeypatch):
    """With grad, the second call with the same metadata skips the checks and the op's layers and records the
    op's autograd node around the kept launch (a plan that stores rstd): the same output and gradients as
    the checked call, as float64 says; ``in_place`` still writes dx over dy."""
    checked = record_checks(monkeypatch, device, rms_module, "_validate")
    x = torch.randn(2, 3, 64, device=device, dtype=torch.bfloat16)
    w = torch.randn(64, device=device, dtype=torch.float32)
    results = []
    for _ in range(2):
        leaves = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = rms_norm(leaves[0] * 1.0, leaves[1], offset=1.0, casting="llama", in_place=in_place)
        seen = []
        y.register_hook(seen.append)
        (y.float() * torch.linspace(-1, 1, 64, device=device)).sum().backward()
        results.append((y.detach(), leaves[0].grad, leaves[1].grad, seen[0]))
    assert len(checked) == 1
    for first, second in zip(*results, strict=True):
        assert torch.equal(first, second)
    dx, dy = results[1][1], results[1][3]
    assert torch.equal(dy, dx) == in_place  # in place: dy's memory holds dx
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    ref = rms_norm_reference(x64, w64, offset=1.0)
    (ref * torch.linspace(-1, 1, 64, device=device, dtype=torch.float64)).sum().backward()
    assert (dx.double() - x64.grad).abs().max() <= 2e-2 * x64.grad.abs().max()
    assert (results[1][2].double() - w64.grad).abs().max() <= 2e-2 * w64.grad.abs().max()


def test_a_module_weight_is_served_too(device, monkeypatch):
    """An nn.Parameter weight (a module's) in inference takes the calls already checked, as a plain tensor."""
    checked = record_checks(monkeypatch, device, rms_module, "_validate")
    weight = torch.nn.Parameter(torch.randn(64, device=device))
    x = torch.randn(4, 64, device=device)
    with torch.no_grad():
        first = rms_norm(x, weight)
        assert torch.equal(rms_norm(x, weight), first)
    assert len(checked) == 1
    rms_norm(x, weight).sum().backward()  # with grad: checked, through the op
    assert len(checked) == 2 and weight.grad is not None
    weight.grad = None
    rms_norm(x, weight).sum().backward()  # with grad again: kept
    assert len(checked) == 2 and weight.grad is not None
