"""llm_speed.nn.MoE: the router, routing and fused experts of one layer against the same layer in plain
PyTorch, Hugging Face's parameter names, DeepSeek-V3's routing options, bad arguments."""

import pytest
import torch

from llm_speed.moe.reference import fused_moe_reference, moe_route_reference
from llm_speed.nn import MoE


def _reference(layer, x):
    hidden = x.reshape(-1, x.shape[-1])
    logits = hidden @ layer.gate.weight.T
    weights, ids = moe_route_reference(
        logits, layer.top_k, scoring=layer.scoring, renormalize=layer.renormalize,
        bias=getattr(layer.gate, "e_score_correction_bias", None), n_group=layer.n_group,
        topk_group=layer.topk_group, routed_scaling_factor=layer.routed_scaling_factor,
    )  # fmt: skip
    out = fused_moe_reference(hidden, layer.experts.gate_up_proj, layer.experts.down_proj, weights, ids)
    return out.reshape(x.shape), logits


@pytest.mark.parametrize(
    "options",
    [{}, dict(scoring="sigmoid", correction_bias=True, n_group=2, topk_group=1, routed_scaling_factor=2.5)],
    ids=["mixtral", "deepseek-v3"],
)
def test_layer_matches_plain_pytorch_with_gradients(options, device):
    layer = MoE(32, 24, 8, 2, device=device, **options)
    if "correction_bias" in options:
        layer.gate.e_score_correction_bias.normal_(0, 0.1)
    x = torch.randn(2, 7, 32, device=device, requires_grad=True)
    out, logits = layer.forward_with_logits(x)
    dout = torch.randn_like(out)
    out.backward(dout)
    got = [x.grad] + [p.grad for p in layer.parameters()]
    layer.zero_grad()
    x2 = x.detach().clone().requires_grad_()
    ref_out, ref_logits = _reference(layer, x2)
    ref_out.backward(dout)
    want = [x2.grad] + [p.grad for p in layer.parameters()]
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_parameter_names_follow_hugging_face():
    layer = MoE(16, 8, 4, 2, scoring="sigmoid", correction_bias=True)
    assert set(layer.state_dict()) == {
        "gate.weight", "gate.e_score_correction_bias", "experts.gate_up_proj", "experts.down_proj",
    }  # fmt: skip
    assert layer.experts.gate_up_proj.shape == (4, 16, 16) and layer.experts.down_proj.shape == (4, 16, 8)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(top_k=5), ValueError, "top_k \\(5\\) must be at most num_experts \\(4\\)"),
        (dict(scoring="tanh"), ValueError, "scoring"),
        (dict(n_group=3, topk_group=1), ValueError, "n_group \\(3\\) must divide"),
        (dict(renormalize="yes"), TypeError, "renormalize must be a bool"),
        (dict(routed_scaling_factor=-1.0), ValueError, "routed_scaling_factor must be > 0"),
    ],
)
def test_bad_arguments(kwargs, error, message):
    arguments = dict(hidden_size=16, intermediate_size=8, num_experts=4, top_k=2) | kwargs
    with pytest.raises(error, match=message):
        MoE(**arguments)


def test_layer_runs_under_autocast_as_the_expert_loop_would(device):
    """AMP training: float32 parameters beside the 16-bit activations an autocast model hands the layer. The
    router's and experts' products take the autocast dtype (as F.linear in the loop the layer replaces);
    before, fused_moe refused float32 weights beside bfloat16 hidden states."""
    torch.manual_seed(0)
    layer = MoE(16, 8, 4, 2, device=device)
    x = torch.randn(6, 16, device=device, requires_grad=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = layer(x.to(torch.bfloat16))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and x.grad.dtype == torch.float32
    assert layer.experts.gate_up_proj.grad.dtype == torch.float32
    with torch.no_grad():  # the same layer on operands cast by hand, outside autocast
        bf16 = MoE(16, 8, 4, 2, device=device).to(torch.bfloat16)
        bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in layer.state_dict().items()})
        torch.testing.assert_close(out.detach(), bf16(x.detach().to(torch.bfloat16)), rtol=0, atol=0)
