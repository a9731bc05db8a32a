"""llm_speed.nn modules: same results as the plain PyTorch layers they replace, bad arguments refused."""

import pytest
import torch
from fused_testing import expect_launches

import llm_speed.fused.rms_norm as rms_module
import llm_speed.fused.swiglu as swiglu_module
from llm_speed.fused.reference import rms_norm_reference
from llm_speed.nn import RMSNorm, SwiGLUMLP


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
    ],
)
def test_bad_arguments(make, error, match):
    with pytest.raises(error, match=match):
        make()
