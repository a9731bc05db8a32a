"""GPU only (sm_90: H100, H200), run by the proof command: the Gluon attention backward itself, and
``flash_attention`` (the Gluon forward and backward under autograd), against float64 under the 3x gradient
rule against plain PyTorch in the inputs' dtype: head dims 64 and 128, causal or not, MHA and GQA (dK and dV
summed over the group), ragged lengths both ways, fp16 and bf16, gradients poisoned with NaN first; rows
that see no key get dQ 0; negative and zero scales. A broken mbarrier protocol (the Q/dO ring) hangs the
GPU process: run it in its own process with a timeout."""

from __future__ import annotations

import pytest
import torch
from gluon_cases import HOPPER_ONLY, SHAPES

from accuracy_rule import GRAD_FACTOR, assert_error_rule, expect_launches
from llm_speed.attention.reference import reference_attention

pytestmark = HOPPER_ONLY


@pytest.fixture(autouse=True)
def _poison_outputs(nan_poisoned):
    """Kernel outputs start as NaN (tests/conftest.py)."""


def _gradients(q, k, v, dout, is_causal, scale=None):
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    reference_attention(*leaves, is_causal=is_causal, scale=scale).backward(dout.to(leaves[0].dtype))
    return [x.grad for x in leaves]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("batch", "heads", "heads_kv", "seq_q", "seq_kv"), [*SHAPES, (1, 4, 1, 2000, 300)])
def test_against_float64(batch, heads, heads_kv, seq_q, seq_kv, head_dim, is_causal, dtype):
    from llm_speed.gluon.attention import forward
    from llm_speed.gluon.attention_bwd import backward

    q = torch.randn(batch, heads, seq_q, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, heads_kv, seq_kv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = forward(q, k, v, is_causal=is_causal)
    with expect_launches("gluon_attention_bwd", device=q.device):
        grads = backward(q, k, v, out, lse, dout, is_causal=is_causal)
    torch.cuda.synchronize()
    truth = _gradients(q.double(), k.double(), v.double(), dout.double(), is_causal)
    same_precision = _gradients(q, k, v, dout, is_causal)
    for name, got, torch_grad, exact in zip("qkv", grads, same_precision, truth, strict=True):
        assert not got.isnan().any(), f"d{name}: an entry no program wrote"
        assert_error_rule(f"gluon d{name}", got, torch_grad, exact, GRAD_FACTOR, dtype)
    if is_causal and seq_q > seq_kv:  # rows that see no key: dQ 0
        assert not grads[0][:, :, : seq_q - seq_kv].any()


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("is_causal", [False, True])
def test_hidden_keys_stay_hidden_under_any_scale(is_causal, scale):
    # the kernel hides a key by its score (+inf under a negative scale); a zero scale is launched as a zero
    # Q; 300 queries over 200 keys: under the causal mask rows 0..99 see no key (LSE -inf)
    from llm_speed.gluon.attention import forward
    from llm_speed.gluon.attention_bwd import backward

    q = torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 1, 200, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    dout = torch.randn_like(q)
    out, lse = forward(q, k, v, is_causal=is_causal, scale=scale)
    with expect_launches("gluon_attention_bwd", device=q.device):
        grads = backward(q, k, v, out, lse, dout, is_causal=is_causal, scale=scale)
    torch.cuda.synchronize()
    truth = _gradients(q.double(), k.double(), v.double(), dout.double(), is_causal, scale)
    same_precision = _gradients(q, k, v, dout, is_causal, scale)
    for name, got, torch_grad, exact in zip("qkv", grads, same_precision, truth, strict=True):
        assert not got.isnan().any(), f"d{name}: NaN"
        assert_error_rule(f"gluon d{name}", got, torch_grad, exact, GRAD_FACTOR, torch.bfloat16)


@pytest.mark.parametrize("seq_kv", [1, 5, 70])
def test_keys_past_the_end_stay_masked_where_fp16_would_overflow(seq_kv):
    # fp16 with delta = 76800: an unmasked key past seq_kv would round dS = -exp(-LSE) delta to -inf, and
    # -inf x its zero K row is NaN in dQ (tests/gluon/test_gluon_attention_bwd_schedule.py); the true dQ is 0
    from llm_speed.gluon.attention import forward
    from llm_speed.gluon.attention_bwd import backward

    q = torch.full((1, 1, 3, 64), 0.5, device="cuda", dtype=torch.float16)
    k = torch.full((1, 1, seq_kv, 64), -0.5, device="cuda", dtype=torch.float16)
    v = torch.full((1, 1, seq_kv, 64), 4.0, device="cuda", dtype=torch.float16)
    dout = torch.full((1, 1, 3, 64), 300.0, device="cuda", dtype=torch.float16)
    out, lse = forward(q, k, v)
    dq, dk, dv = backward(q, k, v, out, lse, dout)
    torch.cuda.synchronize()
    assert torch.equal(dq, torch.zeros_like(dq)), dq
    assert dk.isfinite().all() and dv.isfinite().all()


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_neighbouring_heads_non_finite_values_stay_out(is_causal):
    # 100 queries and keys: head 0's partial blocks read zeros through the 3-D descriptors, not head 1's NaN
    # rows (P = 0 or dS = 0 times NaN would make head 0's dV and dQ NaN). One key block per head, so dQ's
    # atomics add two values into zero: the same bits in either order
    from llm_speed.gluon.attention import forward
    from llm_speed.gluon.attention_bwd import backward

    q, k, v, dout = (torch.randn(1, 2, 100, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = forward(q, k, v, is_causal=is_causal)
    alone = backward(*(x[:, :1].contiguous() for x in (q, k, v, out, lse, dout)), is_causal=is_causal)
    for x in (q, k, v, dout):
        x[:, 1] = float("nan")
    mixed = backward(q, k, v, out, lse, dout, is_causal=is_causal)
    torch.cuda.synchronize()
    for name, got, want in zip("qkv", mixed, alone, strict=True):
        assert torch.equal(got[:, :1], want), f"d{name}: head 1's NaN reached head 0"


@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_attention_pairs_them_under_autograd(is_causal):
    from llm_speed.gluon.flash import flash_attention

    q = torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))  # fmt: skip
    dout = torch.randn_like(q)
    with expect_launches("gluon_attention_fwd", "gluon_attention_bwd", device=q.device):
        flash_attention(q, k, v, is_causal=is_causal).backward(dout)
    truth = _gradients(q.double(), k.double(), v.double(), dout.double(), is_causal)
    same_precision = _gradients(q, k, v, dout, is_causal)
    for name, x, torch_grad, exact in zip("qkv", (q, k, v), same_precision, truth, strict=True):
        assert_error_rule(f"flash_attention d{name}", x.grad, torch_grad, exact, GRAD_FACTOR, torch.bfloat16)
