"""torch.library registration: opcheck (schema, fake tensors, autograd registration) and torch.compile,
for the flash operators and the tiled forward operator."""

import pytest
import torch
from attention_testing import BACKWARD_KERNELS, FORWARD_KERNELS, expect_launches, make_qkv

import llm_speed  # noqa: F401  (registers the llm_speed:: operators)
from llm_speed import flash_attention, tiled_attention
from llm_speed.attention import flash


@pytest.mark.parametrize("is_causal", [False, True])
def test_opcheck_forward_and_backward_ops(is_causal, device):
    q, k, v = make_qkv(1, 2, 1, 9, 13, 16, torch.float32, device)
    for t in (q, k, v):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.llm_speed.flash_attention_forward.default, (q, k, v, is_causal, 0.3))
    torch.library.opcheck(torch.ops.llm_speed.tiled_attention_forward.default, (q, k, v, is_causal, 0.3))
    out, lse = torch.ops.llm_speed.flash_attention_forward(q.detach(), k.detach(), v.detach(), is_causal, 0.3)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    args = (dout, q.detach(), k.detach(), v.detach(), out, lse, dlse, is_causal, 0.3)
    torch.library.opcheck(torch.ops.llm_speed.flash_attention_backward.default, args)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_forward_and_backward(backend, device):
    # aot_eager checks the capture alone; Inductor (the default backend) also plans the ops around ours.
    torch._dynamo.reset()

    def attention_loss(q, k, v):
        out, lse = flash_attention(q, k, v, is_causal=True, return_lse=True)
        return out.float().square().sum() + lse[torch.isfinite(lse)].sum()

    compiled = torch.compile(attention_loss, fullgraph=True, backend=backend)
    q, k, v = make_qkv(1, 2, 2, 7, 5, 16, torch.float16, device)
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention_loss(*eager_leaves).backward()
    with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=device):
        compiled(*compiled_leaves).backward()
    for a, b in zip(eager_leaves, compiled_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_torch_compile_fullgraph_tiled_attention(device):
    torch._dynamo.reset()

    def attention_loss(q, k, v):
        return tiled_attention(q, k, v, is_causal=True).float().square().sum()

    compiled = torch.compile(attention_loss, fullgraph=True, backend="aot_eager")
    q, k, v = make_qkv(1, 2, 1, 9, 6, 16, torch.bfloat16, device)
    eager_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    attention_loss(*eager_leaves).backward()
    with expect_launches(flash.TILED.name, *BACKWARD_KERNELS, device=device):
        compiled(*compiled_leaves).backward()
    for a, b in zip(eager_leaves, compiled_leaves, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)
