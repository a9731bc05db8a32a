"""llm_speed.nn modules: same results as the plain PyTorch layers they replace, bad arguments refused."""

import pytest
import torch
from fused_testing import expect_launches

import llm_speed.fused.rms_norm as rms_module
import llm_speed.fused.swiglu as swiglu_module
from llm_speed import cross_entropy, fused_linear_cross_entropy
from llm_speed.fused.reference import rms_norm_reference
from llm_speed.nn import (
    CrossEntropyLoss,
    FusedLinearCrossEntropyLoss,
    GatedMLP,
    GeGLUMLP,
    MoE,
    MoEExperts,
    RMSNorm,
    SwiGLUMLP,
)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_module(offset, device):
    norm = RMSNorm(40, eps=1e-5, offset=offset, device=device)
    assert torch.allclose(norm.weight + offset, torch.ones(40, device=device))  # initial scale 1
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(40, device=device))
    x = torch.randn(2, 3, 40, device=device)
    with expect_launches(rms_module.FORWARD.name, device=device):
        out = norm(x)
    torch.testing.assert_close(out, rms_norm_reference(x, norm.weight, eps=1e-5, offset=offset))
    assert "40, eps=1e-05" in repr(norm)


def test_swiglu_mlp_matches_plain_mlp_and_trains(device):
    mlp = SwiGLUMLP(40, 72, device=device)
    x = torch.randn(3, 40, device=device, requires_grad=True)
    with expect_launches(swiglu_module.FORWARD.name, swiglu_module.BACKWARD.name, device=device):
        out = mlp(x)
        out.square().sum().backward()
    plain = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-6)
    assert x.grad is not None and all(p.grad is not None for p in mlp.parameters())
    assert set(mlp.state_dict()) == {"gate_proj.weight", "up_proj.weight", "down_proj.weight"}


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: RMSNorm(0), ValueError, "hidden_size must be a positive int"),
        (lambda: RMSNorm(8, eps=-1.0), ValueError, "eps must be >= 0"),
        (lambda: SwiGLUMLP(8, 2.5), TypeError, "intermediate_size must be an int"),
        (lambda: SwiGLUMLP(8, 16, bias=1), TypeError, "bias must be a bool"),
        (lambda: RMSNorm(8, init="one"), ValueError, "init is 'one'"),
        (lambda: RMSNorm(8, casting="none"), ValueError, "casting is 'none'"),
        (lambda: RMSNorm(8, offset=1.0, elementwise_affine=False), ValueError, "has none"),
        (lambda: GatedMLP(8, 16, activation="relu"), ValueError, "activation is 'relu'"),
    ],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()


LINEAR = torch.nn.Linear
DTYPES = r"dtype must be None or one of \(float16, bfloat16, float32\), got torch"


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        # dtypes the fused ops refuse: torch's own error (int32), or the first forward's (float64; after two
        # GEMMs for the MLP, after the router GEMM for MoE)
        (lambda: RMSNorm(16, dtype=torch.int32), TypeError, DTYPES + ".int32"),
        (lambda: RMSNorm(16, dtype=torch.float64), TypeError, DTYPES + ".float64"),
        (lambda: GatedMLP(16, 32, dtype=torch.float64), TypeError, DTYPES),
        (lambda: SwiGLUMLP(16, 32, dtype=torch.float64), TypeError, DTYPES),
        (lambda: GeGLUMLP(16, 32, dtype=torch.float64), TypeError, DTYPES),
        (lambda: MoE(16, 32, 4, 2, dtype=torch.float64), TypeError, DTYPES),
        (lambda: MoEExperts(4, 16, 32, dtype=torch.float64), TypeError, DTYPES),
        (lambda: RMSNorm(16, dtype="float32"), TypeError, "dtype must be None or one of .* got 'float32'"),
        # wrap: AttributeError on a list; a GatedMLP without gate_proj failed only at forward
        (lambda: RMSNorm.wrap([1.0] * 16, 1e-6), TypeError,
         r"weight must be None or a torch.Tensor \[hidden\], got list"),
        (lambda: RMSNorm.wrap(torch.ones(2, 8), 1e-6), ValueError, r"weight must have 1 dim \[hidden\]"),
        (lambda: GatedMLP.wrap(LINEAR(32, 16), up_proj=LINEAR(16, 32)), TypeError,
         "gate_proj missing: GatedMLP.wrap takes gate_proj and up_proj, or gate_up_proj"),
        (lambda: GatedMLP.wrap(LINEAR(32, 16)), TypeError, "gate_proj and up_proj missing"),
        (lambda: GatedMLP.wrap(LINEAR(32, 16), gate_up_proj=LINEAR(16, 64),
                               gate_proj=LINEAR(16, 32)), ValueError, "gate_up_proj given with"),
        (lambda: GatedMLP.wrap(None, gate_up_proj=LINEAR(16, 64)), TypeError,
         r"down_proj must be a torch.nn.Module \(nn.Linear\), got NoneType"),
        (lambda: GatedMLP.wrap(LINEAR(32, 16), gate_proj=torch.ones(32, 16), up_proj=LINEAR(16, 32)),
         TypeError, "gate_proj must be a torch.nn.Module"),
        # loss options: refused only at the first forward before
        (lambda: CrossEntropyLoss(reduction="avg"), ValueError, "reduction is 'avg'; accepted: 'mean'"),
        (lambda: CrossEntropyLoss(ignore_idx=-1), TypeError,
         "CrossEntropyLoss has no option 'ignore_idx'; accepted: ignore_index, reduction, label_smoothing"),
        (lambda: CrossEntropyLoss(chunk_rows=4), TypeError, "no option 'chunk_rows'"),
        (lambda: CrossEntropyLoss(ignore_index=True), TypeError, "ignore_index must be an int, got bool"),
        (lambda: CrossEntropyLoss(label_smoothing=1.5), ValueError, "label_smoothing must be <= 1.0"),
        (lambda: CrossEntropyLoss(softcap=0.0), ValueError, "softcap must be > 0"),
        (lambda: CrossEntropyLoss(lse_square_scale=-1.0), ValueError, "lse_square_scale must be >= 0"),
        (lambda: CrossEntropyLoss(return_z_loss="yes"), TypeError, "return_z_loss must be a bool"),
        (lambda: CrossEntropyLoss(loss_dtype=torch.float64), TypeError, "loss_dtype is torch.float64;"),
        (lambda: FusedLinearCrossEntropyLoss(chunk_rows=0), ValueError, "chunk_rows must be a positive int"),
        (lambda: FusedLinearCrossEntropyLoss(accum_dtype=torch.float16), TypeError, "accum_dtype is torch"),
        (lambda: FusedLinearCrossEntropyLoss(weight=torch.ones(8)), TypeError,
         "weight is forward's argument here .* pass the class weights \\[V\\] as ce_weight="),
        (lambda: FusedLinearCrossEntropyLoss(bias=torch.ones(8)), TypeError, "bias is forward's argument"),
        (lambda: FusedLinearCrossEntropyLoss(ignore_idx=-1), TypeError,
         "FusedLinearCrossEntropyLoss has no option 'ignore_idx'; accepted: .*chunk_rows, accum_dtype"),
    ],
)
def test_bad_arguments_refused_at_construction(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_default_dtype_checked_and_valid_arguments_accepted():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with pytest.raises(TypeError, match="dtype is None, i.e. torch's default dtype, now torch.float64"):
            RMSNorm(16)
    finally:
        torch.set_default_dtype(previous)
    for dtype in (None, torch.float16, torch.bfloat16, torch.float32):
        assert RMSNorm(16, dtype=dtype).weight.dtype == (dtype or torch.float32)
        assert GatedMLP(16, 32, dtype=dtype).down_proj.weight.dtype == (dtype or torch.float32)
    wrapped = GatedMLP.wrap(LINEAR(32, 16), gate_proj=LINEAR(16, 32), up_proj=LINEAR(16, 32))
    assert wrapped(torch.randn(2, 16)).shape == (2, 16)
    options = dict(ignore_index=-1, reduction="sum", label_smoothing=0.1, softcap=30.0, lse_square_scale=1e-4,
                   return_z_loss=True, loss_dtype=torch.bfloat16)  # fmt: skip
    assert CrossEntropyLoss(**options).options == options
    fused = FusedLinearCrossEntropyLoss(chunk_rows=None, accum_dtype=torch.float32, **options)
    assert fused.options == dict(options, chunk_rows=None, accum_dtype=torch.float32)


@pytest.mark.parametrize(("offset", "init", "start"), [(0.0, None, 1.0), (1.0, None, 0.0), (1.0, "ones", 1.0),
                                                       (0.0, "zeros", 0.0)])  # fmt: skip
def test_rms_norm_init_choice(offset, init, start):
    # default: scale 1 whatever the offset (Hugging Face's Llama: ones; Gemma: zeros with offset 1);
    # init="ones" with offset=1 is LigerRMSNorm(h, offset=1.0)'s start (scale 2)
    norm = RMSNorm(16, offset=offset, init=init)
    assert torch.equal(norm.weight, torch.full((16,), start))


def test_rms_norm_module_options(device):
    x = torch.randn(3, 24, device=device, requires_grad=True)
    plain = RMSNorm(24, elementwise_affine=False, device=device)
    assert plain.weight is None and list(plain.parameters()) == []
    assert "elementwise_affine=False" in repr(plain)
    torch.testing.assert_close(plain(x), rms_norm_reference(x, None))
    llama = RMSNorm(24, casting="llama", in_place=True, device=device, dtype=torch.bfloat16)
    assert "casting='llama', in_place=True" in repr(llama)
    xb = x.detach().bfloat16()
    expected = rms_norm_reference(xb, llama.weight, casting="llama")
    torch.testing.assert_close(llama(xb), expected, rtol=0, atol=0)
    (llama(x.bfloat16()).float() * 2).sum().backward()  # in-place backward into a fresh gradient
    assert x.grad is not None and llama.weight.grad is not None


@pytest.mark.parametrize("fused_gate_up", [False, True])
@pytest.mark.parametrize("cls", [SwiGLUMLP, GeGLUMLP])
def test_gated_mlps_match_their_plain_expressions(cls, fused_gate_up, device):
    mlp = cls(24, 40, fused_gate_up=fused_gate_up, device=device)
    x = torch.randn(2, 3, 24, device=device, requires_grad=True)
    out = mlp(x)
    out.sum().backward()
    if fused_gate_up:  # Phi-3's layout: gate first
        gate, up = mlp.gate_up_proj(x).chunk(2, -1)
        assert set(mlp.state_dict()) == {"gate_up_proj.weight", "down_proj.weight"}
    else:
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    act = torch.nn.functional.silu if cls is SwiGLUMLP else (
        lambda g: torch.nn.functional.gelu(g, approximate="tanh"))  # fmt: skip
    torch.testing.assert_close(out, mlp.down_proj(act(gate) * up), rtol=1e-5, atol=1e-6)


def test_loss_modules(device):
    logits = torch.randn(5, 30, device=device)
    target = torch.randint(0, 30, (5,), device=device)
    weight = torch.rand(30, device=device) + 0.5
    loss = CrossEntropyLoss(weight, label_smoothing=0.1)
    expected = cross_entropy(logits, target, weight=weight, label_smoothing=0.1)
    assert torch.equal(loss(logits, target), expected)
    hidden, head = torch.randn(5, 8, device=device), torch.randn(30, 8, device=device)
    fused = FusedLinearCrossEntropyLoss(lse_square_scale=1e-3)
    expected = fused_linear_cross_entropy(hidden, head, target, lse_square_scale=1e-3)
    assert torch.equal(fused(hidden, head, target), expected)


def test_every_loss_option_has_a_construction_check():
    """A new keyword of the loss functions needs its check in cross_entropy.check_loss_options too (what the
    loss modules check their options with at construction)."""
    import inspect

    from llm_speed.fused.cross_entropy import check_loss_options

    checked = set(inspect.signature(check_loss_options).parameters)
    for function in (cross_entropy, fused_linear_cross_entropy):
        options = {name for name, parameter in inspect.signature(function).parameters.items()
                   if parameter.kind is inspect.Parameter.KEYWORD_ONLY}  # fmt: skip
        assert options - {"weight", "ce_weight", "bias"} <= checked
