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
