"""FP8: quantize_fp8 (bit-exact against PyTorch's correctly rounding cast), gemm_fp8 (float64 of the
dequantized operands as truth; at most 2x the error of the same product in float32, computed as
torch._scaled_mm defines it, plus the matmul cap), float8_linear's gradients, Float8Linear /
convert_to_float8, and the argument checks. The GEMM tests run on the ``device`` fixture's device.

Every kernel output starts as NaN (tests/matmul/conftest.py); the kernels are proved to have run.
"""

from __future__ import annotations

import copy

import pytest
import torch

from accuracy_rule import GRAD_FACTOR, OUTPUT_FACTOR, assert_error_rule, expect_launches, matmul_cap
from llm_speed.matmul import fp8
from llm_speed.matmul.reference import FP8_BLOCK, gemm_fp8_reference, quantize_fp8_reference

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BLOCK = (1, 128), (128, 128)


def _quantize_checked(x, dtype, granularity):
    kernels = [fp8.QUANTIZE_KERNEL] + ([fp8.AMAX_KERNEL] if granularity == "tensor" else [])
    with expect_launches(*kernels, device=x.device):
        q, scale = fp8.quantize_fp8(x, dtype=dtype, granularity=granularity)
    q_ref, scale_ref = quantize_fp8_reference(x, dtype, granularity)
    assert q.dtype == dtype and scale.dtype == torch.float32 and scale.shape == scale_ref.shape
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float()), (q.float() - q_ref.float()).abs().max()
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))  # the bytes too: -0 stays -0
    return q, scale


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", ["tensor", "row", *BLOCK], ids=str)
def test_quantize_matches_pytorch_exactly(granularity, dtype, device):
    """Ragged rows and columns (last 128-group partial), values far beyond 448, an all-zero 128x128 block and
    an all-zero row, subnormal results, negative zeros: the same bytes and scales as PyTorch's correctly
    rounding cast."""
    x = torch.randn(200, 300) * torch.logspace(-6, 1, 300)  # many results land among the subnormals
    x[3, 7], x[150, 290] = 5000.0, -1e5
    x[:128, 128:256] = 0.0
    x[190] = 0.0
    x[7, :4] = torch.tensor([-0.0, -1e-30, 1e-30, -0.0])  # negative zeros and ones the rounding makes -0
    x = x.to(device)
    q, scale = _quantize_checked(x, dtype, granularity)
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= torch.finfo(dtype).max
    if granularity != "tensor":  # a zero group: the floored scale and exact zeros
        assert (q[190].float() == 0).all()
    if granularity == (128, 128):
        assert scale[0, 1] == fp8.AMAX_FLOOR / torch.finfo(dtype).max
    # the round trip is as close as the format allows: half an ulp of the group's largest value
    deq = q.float() * quantize_fp8_reference(x, dtype, granularity)[1].reshape(-1, 1) if granularity in (
        "tensor", "row") else None  # fmt: skip
    if deq is not None:
        ulp = 2.0 ** -(3 if dtype == E4M3 else 2)
        bound = (x.abs().amax(1, keepdim=True) if granularity == "row" else x.abs().max()) * ulp
        assert ((deq - x).abs() <= bound).all()


def test_quantize_strided_views_and_many_partials(device):
    """A transposed bfloat16 view is read in place; per-tensor scaling with more row blocks than pass-1
    programs (each program walks several)."""
    x = torch.randn(96, 40, dtype=torch.bfloat16).to(device)
    _quantize_checked(x.mT, E4M3, "row")
    tall = torch.randn(3000, 3)
    tall[2999, 1] = 77.0  # the amax in the last row block
    tall = tall.to(device)
    _, scale = _quantize_checked(tall, E5M2, "tensor")
    assert scale == torch.full((), 77.0, device=device) / 57344.0  # as the device divides (CUDA: reciprocal)


def test_quantize_empty(device):
    q, scale = fp8.quantize_fp8(torch.randn(0, 5, device=device), granularity="tensor")
    assert q.shape == (0, 5) and scale.shape == () and scale > 0


def _operands(m, n, k, granularity, trans_b, dtype_a=E4M3, dtype_b=E4M3, device="cpu"):
    """fp8 a [M, K] and b (stored [N, K] when trans_b, else [K, N]) with their scales at ``granularity``,
    quantized on ``device`` (the same values on every device: drawn on the CPU)."""
    a = (torch.randn(m, k) * 3).to(device)
    w = torch.randn(n, k).to(device)  # b as an nn.Linear weight
    g_a, g_b = (granularity, granularity) if not isinstance(granularity, tuple) else BLOCK
    a_q, s_a = fp8.quantize_fp8(a, dtype=dtype_a, granularity=g_a)
    if trans_b:
        b_q, s_b = fp8.quantize_fp8(w, dtype=dtype_b, granularity=g_b)
    elif g_b == "row":  # per column of b [K, N]: rows of w, transposed
        w_q, w_s = fp8.quantize_fp8(w, dtype=dtype_b, granularity="row")
        b_q, s_b = w_q.mT, w_s.reshape(1, n)
    else:  # b [K, N] quantized as stored
        b_q, s_b = fp8.quantize_fp8(w.mT.contiguous(), dtype=dtype_b, granularity=g_b)
    return a_q, b_q, s_a, s_b


def _padded(x, rows, cols):
    out = torch.zeros(rows, cols, dtype=x.dtype, device=x.device)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def _fp8_product(a, b_kn):
    """``a @ b_kn`` of unscaled fp8 operands, float32, in the precision of the device's own fp8 matrix
    product. CPU: float32 (each fp8 product is exact in float32; the sums are float32's). CUDA:
    torch._scaled_mm with unit scales and ``use_fast_accum`` (cuBLASLt: the tensor cores' fp8 accumulation,
    which keeps fewer bits than float32's, never promoted to float32 registers: as the kernel's ``tl.dot``,
    whose ``max_num_imprecise_acc`` Triton sets to 2**30 on sm_90; cuBLAS's default promotes, and at K = 300
    the kernel's error was 2.3-3.9x that one's, H100 2026-11-25), the operands padded with zeros to its
    multiples of 16 along K and N and b made column-major, as it requires; it multiplies no two e5m2
    matrices, so there b goes to e4m3 times 2**-7 (e5m2's max 57344 is e4m3's 448 there; only values below 2
    lose bits, far below the product's rounding)."""
    if a.device.type != "cuda":
        return a.float() @ b_kn.float()
    factor = 1.0
    if a.dtype == b_kn.dtype == E5M2:
        b_kn, factor = (b_kn.float() * 2.0**-7).to(E4M3), 2.0**7
    (m, k), n = a.shape, b_kn.shape[1]
    k16, n16 = -(-k // 16) * 16, -(-n // 16) * 16
    one = torch.ones((), device=a.device)
    a16, b16 = _padded(a, m, k16), _padded(b_kn.mT, n16, k16).mT
    return torch._scaled_mm(a16, b16, one, one, out_dtype=torch.float32, use_fast_accum=True)[:, :n] * factor


def _same_precision(a, b, s_a, s_b, bias, out_dtype, trans_b, granularity):
    """The same product in the device's fp8 precision (:func:`_fp8_product`), scaled as torch._scaled_mm
    scales: the unscaled product times scale_a per row of a and scale_b per column of b (tensor: one each),
    in float32, plus the bias. torch._scaled_mm is not called with the scales: it takes row scales on some
    devices and versions only (the CPU's before torch 2.13: per-tensor only; cuBLASLt: bf16 output only).
    Block scaling: one such product per 128-wide K group, each scaled by its group's scales, summed in
    float32 (as the kernel scales each K step's product)."""
    b_kn = b.mT if trans_b else b
    if isinstance(granularity, tuple):
        m, k = a.shape
        n = b_kn.shape[1]
        s_b_kn = s_b.mT if trans_b else s_b  # [K groups, N blocks]
        out = torch.zeros(m, n, device=a.device)
        for g in range(-(-k // FP8_BLOCK)):
            ks = slice(g * FP8_BLOCK, (g + 1) * FP8_BLOCK)
            s_col = s_b_kn[g].repeat_interleave(FP8_BLOCK)[:n]
            out += _fp8_product(a[:, ks], b_kn[ks]) * s_a[:, g : g + 1] * s_col
    else:
        row = granularity == "row"
        s_row, s_col = (s_a, s_b.reshape(1, -1)) if row else (s_a.reshape(()), s_b.reshape(()))
        out = _fp8_product(a, b_kn) * s_row * s_col
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


CASES = [  # (m, n, k, granularity, trans_b, out_dtype, bias)
    (1, 130, 257, "tensor", True, torch.bfloat16, True),
    (70, 45, 300, "tensor", False, torch.float32, False),
    (70, 45, 300, "row", True, torch.float32, True),
    (1, 72, 96, "row", False, torch.float16, False),
    (70, 130, 300, BLOCK, True, torch.bfloat16, False),  # K = 2 full groups + 44
    (1, 45, 257, BLOCK, False, torch.float32, True),
    (65, 129, 64, BLOCK, True, torch.float32, False),  # K below one group
]


@pytest.mark.parametrize(("m", "n", "k", "granularity", "trans_b", "out_dtype", "bias"), CASES,
                         ids=lambda v: str(v).replace("torch.", "").replace(" ", ""))  # fmt: skip
def test_gemm_fp8_accuracy(m, n, k, granularity, trans_b, out_dtype, bias, device):
    a, b, s_a, s_b = _operands(m, n, k, granularity, trans_b, device=device)
    bias_t = (
        torch.randn(n, dtype=out_dtype if out_dtype != torch.float32 else torch.bfloat16).to(device)
        if bias else None
    )  # fmt: skip
    with expect_launches(fp8.GEMM_KERNEL, device=device):
        out = fp8.gemm_fp8(a, b, s_a, s_b, out_dtype=out_dtype, bias=bias_t, trans_b=trans_b)
    assert out.dtype == out_dtype and out.shape == (m, n) and out.device == a.device
    truth = gemm_fp8_reference(a, b, s_a, s_b, bias=bias_t, out_dtype=torch.float64, trans_b=trans_b)
    same = _same_precision(a, b, s_a, s_b, bias_t, out_dtype, trans_b, granularity)
    assert_error_rule("gemm_fp8", out, same, truth, OUTPUT_FACTOR, cap=matmul_cap(out_dtype, truth, k))


@pytest.mark.parametrize(("dtype_a", "dtype_b"), [(E5M2, E4M3), (E5M2, E5M2)], ids=["e5m2xe4m3", "e5m2xe5m2"])
def test_gemm_fp8_e5m2(dtype_a, dtype_b, device):
    a, b, s_a, s_b = _operands(40, 70, 200, "row", True, dtype_a, dtype_b, device=device)
    with expect_launches(fp8.GEMM_KERNEL, device=device):
        out = fp8.gemm_fp8(a, b, s_a, s_b, out_dtype=torch.float32, trans_b=True)
    truth = gemm_fp8_reference(a, b, s_a, s_b, out_dtype=torch.float64, trans_b=True)
    same = _same_precision(a, b, s_a, s_b, None, torch.float32, True, "row")
    assert_error_rule("gemm_fp8", out, same, truth, OUTPUT_FACTOR, cap=matmul_cap(torch.float32, truth, 200))


@pytest.mark.parametrize("granularity", ["tensor", "row", BLOCK])
def test_gemm_fp8_operands_reach_the_kernel_k_major(granularity, device, monkeypatch):
    """wgmma reads fp8 tiles K-major only (Triton 3.6 moves any other layout through registers at every K
    step: 107 against 1002-1219 TFLOP/s on an H100): b [K, N] row-major and a column-major a are copied
    K-major before the plan is made; b [N, K] (``trans_b``) and a row-major a go as they are. Same values."""
    seen = []
    planned = fp8.planned_gemm

    def recording(a, b, scale_a, scale_b, bias, out_dtype, trans_b, config=None):
        seen.append((a, b, trans_b))
        return planned(a, b, scale_a, scale_b, bias, out_dtype, trans_b, config)

    monkeypatch.setattr(fp8, "planned_gemm", recording)
    m, n, k = 40, 72, 160
    for trans_b in (False, True):
        a, b, s_a, s_b = _operands(m, n, k, granularity, trans_b, device=device)
        for a_given in (a, a.mT.contiguous().mT):  # row-major, then column-major
            out = fp8.gemm_fp8(a_given, b, s_a, s_b, out_dtype=torch.float32, trans_b=trans_b)
            a_run, b_run, t = seen[-1]
            assert t == trans_b and a_run.stride(1) == 1 and b_run.stride(1 if trans_b else 0) == 1
            assert (a_run is a_given) == (a_given.stride(1) == 1)
            assert (b_run is b) == (b.stride(1 if trans_b else 0) == 1)
            truth = gemm_fp8_reference(a, b, s_a, s_b, out_dtype=torch.float64, trans_b=trans_b)
            same = _same_precision(a, b, s_a, s_b, None, torch.float32, trans_b, granularity)
            assert_error_rule("gemm_fp8", out, same, truth, OUTPUT_FACTOR,
                              cap=matmul_cap(torch.float32, truth, k))  # fmt: skip


def test_gemm_fp8_zero_sizes(device):
    a = torch.zeros(3, 0, dtype=E4M3, device=device)
    b = torch.zeros(0, 5, dtype=E4M3, device=device)
    one = torch.ones((), device=device)
    bias = torch.randn(5).to(device)
    out = fp8.gemm_fp8(a, b, one, one, bias=bias, out_dtype=torch.float32)
    assert torch.equal(out, bias.expand(3, 5))
    assert fp8.gemm_fp8(a[:0], b, one, one).shape == (0, 5)
    # block scales of K = 0 have no K group: nothing is launched (the kernel would read group 0)
    s_a, s_b = torch.ones(3, 0, device=device), torch.ones(0, 1, device=device)
    assert fp8.planned_gemm(a, b, s_a, s_b, None, torch.float32, False) is None
    assert torch.equal(fp8.gemm_fp8(a, b, s_a, s_b, bias=bias, out_dtype=torch.float32), bias.expand(3, 5))
    assert torch.equal(fp8.gemm_fp8(a, b, s_a, s_b, out_dtype=torch.bfloat16), torch.zeros(3, 5).to(device))


def test_gemm_fp8_matches_scaled_mm_semantics_exactly_on_grid(device):
    """Small integers and power-of-two scales: every product and sum is exact, so llm-speed and
    torch._scaled_mm agree bit for bit. Per-tensor scales: torch._scaled_mm itself (every device takes
    them; K and N multiples of 16 and B column-major, as cuBLASLt needs). Row scales, a different one for
    each row of a and each column of b: torch._scaled_mm's meaning, ``(a @ b) * scale_a[M, 1] *
    scale_b[1, N]``, on its unscaled product (row scales are not taken by every device's _scaled_mm)."""
    a = torch.randint(-4, 5, (33, 48)).to(E4M3).to(device)
    w = torch.randint(-4, 5, (32, 48)).to(E4M3).to(device)  # b = w.mT: [K, N] column-major
    one = torch.ones((), device=device)
    unscaled = torch._scaled_mm(a, w.mT, one, one, out_dtype=torch.float32)
    s_a, s_b = torch.tensor(0.5, device=device), torch.tensor(4.0, device=device)
    with expect_launches(fp8.GEMM_KERNEL, device=device):
        out = fp8.gemm_fp8(a, w.mT, s_a, s_b, out_dtype=torch.float32)
    assert torch.equal(out, torch._scaled_mm(a, w.mT, s_a, s_b, out_dtype=torch.float32))
    assert torch.equal(out, unscaled * 2.0)
    s_a = (2.0 ** torch.randint(-3, 4, (33, 1))).to(device)
    s_b = (2.0 ** torch.randint(-3, 4, (1, 32))).to(device)
    out = fp8.gemm_fp8(a, w.mT, s_a, s_b, out_dtype=torch.float32)
    assert torch.equal(out, unscaled * s_a * s_b)
    out_t = fp8.gemm_fp8(a, w, s_a, s_b.reshape(32, 1), out_dtype=torch.float32, trans_b=True)
    assert torch.equal(out_t, out)


@pytest.mark.parametrize("shape", [(1,), (1, 1)])
@pytest.mark.parametrize("trans_b", [False, True])
def test_per_tensor_scales_of_one_element_any_shape(shape, trans_b, device):
    """A per-tensor scale given as [1] or [1, 1] (a view into storage whose other elements are NaN) is read
    once, whatever its strides: the kernel reads per-tensor scales through the row-wise epilogue with the
    plan's strides 0, never the scale's own."""
    a = torch.randint(-4, 5, (33, 48)).to(E4M3).to(device)
    w = torch.randint(-4, 5, (32, 48)).to(E4M3).to(device)
    b = w if trans_b else w.mT.contiguous()

    def scale(value):
        storage = torch.full((64,), float("nan"), device=device)
        storage[0] = value
        return storage[:1].reshape(shape)  # strides 1: a per-row reading would walk into the NaNs

    s_a, s_b = scale(0.5), scale(4.0)
    with expect_launches(fp8.GEMM_KERNEL, device=device):
        out = fp8.gemm_fp8(a, b, s_a, s_b, out_dtype=torch.float32, trans_b=trans_b)
    one = torch.ones((), device=device)
    assert torch.equal(out, fp8.gemm_fp8(a, b, one, one, out_dtype=torch.float32, trans_b=trans_b) * 2.0)


BAD = [  # (what to change, error type, message fragment)
    ("a_dtype", TypeError, "a has dtype"),
    ("scale_dtype", TypeError, "scale_a has dtype"),
    ("scale_3d", ValueError, "scale_b must have at most 2 dims"),
    ("mixed", ValueError, "match no granularity"),
    ("row_b_wrong", ValueError, "match no granularity"),
    ("block_b_wrong", ValueError, "match no granularity"),
    ("k", ValueError, "do not share K"),
    ("bias", ValueError, "bias has 3 elements"),
    ("out_dtype", TypeError, "out_dtype must be"),
    ("trans_b", TypeError, "trans_b must be a bool"),
]


@pytest.mark.parametrize(("case", "error", "match"), BAD, ids=[c[0] for c in BAD])
def test_gemm_fp8_bad_arguments(case, error, match):
    a, w = torch.zeros(4, 256, dtype=E4M3), torch.zeros(200, 256, dtype=E4M3)
    args = dict(a=a, b=w, scale_a=torch.ones(4, 1), scale_b=torch.ones(200, 1), trans_b=True)
    if case == "a_dtype":
        args["a"] = torch.zeros(4, 256)
    elif case == "scale_dtype":
        args["scale_a"] = torch.ones(4, 1, dtype=torch.float16)
    elif case == "scale_3d":
        args["scale_b"] = torch.ones(1, 1, 1)
    elif case == "mixed":  # tensor x row
        args["scale_a"] = torch.ones(())
    elif case == "row_b_wrong":  # [1, N] is the [K, N] layout's row scale, not trans_b's
        args["scale_b"] = torch.ones(1, 200)
    elif case == "block_b_wrong":  # N = 200: 2 blocks of b's rows, K = 256: 2 groups
        args["scale_a"], args["scale_b"] = torch.ones(4, 2), torch.ones(2, 3)
    elif case == "k":
        args["b"] = torch.zeros(200, 255, dtype=E4M3)
    elif case == "bias":
        args["bias"] = torch.zeros(3)
    elif case == "out_dtype":
        args["out_dtype"] = E4M3
    elif case == "trans_b":
        args["trans_b"] = 1
    with pytest.raises(error, match=match):
        fp8.gemm_fp8(**args)


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(granularity=(1, 64)), ValueError, "granularity must be one of"),
    (dict(granularity="block"), ValueError, "granularity must be one of"),
    (dict(dtype=torch.bfloat16), TypeError, "dtype must be one of"),
], ids=["1x64", "block", "bf16"])  # fmt: skip
def test_quantize_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        fp8.quantize_fp8(torch.randn(4, 8), **kwargs)
    with pytest.raises(ValueError, match="x must have 2 dims"):
        fp8.quantize_fp8(torch.randn(2, 4, 8))


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_float8_linear_gradients(granularity, device):
    """Forward and both gradients against float64 products of the operands quantized as the recipe says
    (e4m3 forward, e5m2 output gradient; per row: each product's operands scaled along its reduction dim),
    at most 3x (gradients) the error of the same product in the device's fp8 precision, plus the matmul
    cap."""
    x = torch.randn(2, 37, 96, dtype=torch.bfloat16).to(device).requires_grad_()
    weight = torch.randn(72, 96).to(device).requires_grad_()
    bias = torch.randn(72).to(device).requires_grad_()
    kernels = (fp8.GEMM_KERNEL, fp8.QUANTIZE_KERNEL)
    with expect_launches(*kernels, device=x.device):
        out = fp8.float8_linear(x, weight, bias, granularity=granularity)
    grad = torch.randn_like(out)
    with expect_launches(*kernels, device=x.device):
        out.backward(grad)
    x2d, g = x.detach().reshape(-1, 96), grad.reshape(-1, 72)
    w = weight.detach()

    def product(a_hp, b_hp, dtype_a, out_dtype, trans_b):  # a_hp @ b_hp (b_hp stored as used), quantized
        rows = granularity == "row"
        a_q, s_a = quantize_fp8_reference(a_hp, dtype_a, granularity)
        if trans_b:
            b_q, s_b = quantize_fp8_reference(b_hp, E4M3, granularity)
        elif rows:
            raise AssertionError("per-row products take b as [N, K]")
        else:
            b_q, s_b = quantize_fp8_reference(b_hp, E4M3, "tensor")
        truth = gemm_fp8_reference(a_q, b_q, s_a, s_b, out_dtype=torch.float64, trans_b=trans_b)
        same = _same_precision(a_q, b_q, s_a, s_b, None, out_dtype, trans_b, granularity)
        return truth, same

    truth, same = product(x2d, w, E4M3, torch.bfloat16, True)
    truth, same = truth + bias.detach().double(), (same.float() + bias.detach()).to(torch.bfloat16)
    assert_error_rule(
        "out", out.reshape(-1, 72), same, truth, OUTPUT_FACTOR, cap=matmul_cap(out.dtype, truth, 96)
    )
    if granularity == "row":
        truth_x, same_x = product(g, w.mT, E5M2, torch.bfloat16, True)
        truth_w, same_w = product(g.mT, x2d.mT, E5M2, torch.float32, True)
    else:
        truth_x, same_x = product(g, w, E5M2, torch.bfloat16, False)
        truth_w, same_w = product(g.mT, x2d, E5M2, torch.float32, False)
    assert_error_rule("grad_x", x.grad.reshape(-1, 96), same_x, truth_x, GRAD_FACTOR,
                      cap=matmul_cap(torch.bfloat16, truth_x, 72))  # fmt: skip
    assert_error_rule("grad_w", weight.grad, same_w, truth_w, GRAD_FACTOR,
                      cap=matmul_cap(torch.float32, truth_w, 74))  # fmt: skip
    assert torch.allclose(bias.grad, g.float().sum(0), rtol=0, atol=1e-4)


def test_float8_linear_takes_autocasts_dtype_and_no_input_features(device):
    """As nn.Linear: under autocast the output has the autocast dtype (x is cast, as torchao does; the weight
    keeps its dtype and gets its gradient in it); in_features = 0 gives the bias rows and a bias gradient
    (a reshape(-1, 0) failed there)."""
    x = torch.randn(5, 32).to(device).requires_grad_()
    weight = torch.randn(8, 32).to(device).requires_grad_()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = fp8.float8_linear(x, weight)
        assert out.dtype == torch.bfloat16 == torch.nn.functional.linear(x, weight).dtype
    out.float().sum().backward()
    assert x.grad.dtype == weight.grad.dtype == torch.float32 and torch.isfinite(weight.grad).all()
    empty = torch.randn(2, 3, 0).to(device).requires_grad_()
    bias = torch.randn(4).to(device).requires_grad_()
    out = fp8.float8_linear(empty, torch.randn(4, 0).to(device), bias)
    assert out.shape == (2, 3, 4) and torch.equal(out, bias.detach().expand(2, 3, 4))
    out.sum().backward()
    assert torch.equal(bias.grad, torch.full((4,), 6.0, device=device)) and empty.grad.shape == (2, 3, 0)


def test_convert_to_float8_swaps_and_skips():
    from llm_speed.nn import Float8Linear, convert_to_float8

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Sequential(
        torch.nn.Linear(16, 16), torch.nn.Linear(16, 4, bias=False)))  # fmt: skip
    before = copy.deepcopy(model.state_dict())
    swapped = convert_to_float8(model, granularity="row", skip={"2.1"})
    assert swapped == ["0", "2.0"]
    assert isinstance(model[0], Float8Linear) and model[0].granularity == "row"
    assert type(model[2][1]) is torch.nn.Linear
    assert model.state_dict().keys() == before.keys()
    assert convert_to_float8(model, skip=lambda name, module: name == "2.1") == []  # already converted
    with pytest.raises(ValueError, match="granularity"):
        convert_to_float8(model, granularity=(1, 128))


def test_float8_llama_trains_like_bf16():
    """A one-layer Llama from a config, its MLP in fp8 (gate, up and down projections, per-row scaling; the
    attention projections stay bf16 to keep the interpreter's time down, lm_head too as torchao advises),
    learns a fixed batch for 20 AdamW steps next to its bf16 copy: from ln(64) down to about 0.3, the two
    losses stay within 0.02 + 5% of the bf16 loss at every step (with all seven linears in fp8: 0.014 at
    most)."""
    transformers = pytest.importorskip(
        "transformers", reason="needs transformers: pip install -e '.[hf]' (in .[dev] too)"
    )
    from llm_speed.nn import convert_to_float8

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    base = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    fp8_model = copy.deepcopy(base)
    swapped = convert_to_float8(fp8_model, granularity="row", skip=lambda name, _: "mlp" not in name)
    assert swapped == [f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")]
    ids = torch.randint(0, 64, (4, 16))

    def train(model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for _ in range(20):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    reference = train(base)
    with expect_launches(fp8.GEMM_KERNEL, fp8.QUANTIZE_KERNEL, device=ids.device):
        losses = train(fp8_model)
    assert reference[-1] < 0.5 * reference[0]
    for step, (ours, theirs) in enumerate(zip(losses, reference, strict=True)):
        assert abs(ours - theirs) <= 0.02 + 0.05 * theirs, (step, ours, theirs)


def test_opcheck():
    a, b, s_a, s_b = _operands(8, 16, 32, "row", True)
    # test_schema compares fp8 tensors with ops PyTorch has no fp8 kernel for; the rest run
    utils = ("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic")
    args = (a, b, s_a, s_b, None, torch.bfloat16, True)
    torch.library.opcheck(torch.ops.llm_speed.gemm_fp8.default, args, test_utils=utils)
    torch.library.opcheck(torch.ops.llm_speed.quantize_fp8.default, (torch.randn(8, 32), E4M3, "1x128"))


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_the_scales_product_comes_first_as_scaled_mm(granularity):
    """a near float32's top (amax 1e37) times a tiny b: acc * scale_a alone overflows, the true products do
    not; the epilogue multiplies by scale_a * scale_b, as torch._scaled_mm (found by the edge-value audit of
    2026-12-07: 372 of 384 outputs were inf)."""
    torch.manual_seed(0)
    a, b = torch.randn(16, 48) * 1e37, torch.randn(24, 48) * 1e-10
    qa, sa = fp8.quantize_fp8(a, granularity=granularity)
    qb, sb = fp8.quantize_fp8(b, granularity=granularity)
    out = fp8.gemm_fp8(qa, qb, sa, sb, trans_b=True, out_dtype=torch.float32)  # b [N, K]: scale_b [N, 1]
    truth = gemm_fp8_reference(qa, qb, sa, sb, trans_b=True, out_dtype=torch.float32)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), truth.double(), rtol=1e-5, atol=0)
