"""The schedule of the Gluon attention backward (issue 73, stage 2), modelled in PyTorch
(:mod:`llm_speed.gluon.attention_bwd_schedule`), against float64 under the 3x gradient rule: a producer
filling Q/dO rings, two consumer warpgroups of 64 keys each, dK and dV summed over the GQA group, dQ added
in fp32, the LSE as the forward's schedule writes it; ragged lengths both ways, causal or not, head dims 64
and 128, fp16 and bf16 (positive inputs too), rows that see no key and keys no row sees, the causal mask on
the blocks that cross the diagonal only, negative and zero scales; and the protocol checks failing where
the barriers are broken."""

from __future__ import annotations

import math

import pytest
import torch

from accuracy_rule import GRAD_FACTOR, assert_error_rule, max_error
from llm_speed.attention.reference import reference_attention
from llm_speed.gluon import attention_bwd, protocol
from llm_speed.gluon import attention_bwd_schedule as model
from llm_speed.gluon import attention_schedule as forward_model

SMALL = model.Schedule(block_m=64, block_n=128, stages=2)
FORWARD = forward_model.Schedule(block_m=64, block_n=32, stages=2, programs=3, section=2)


def _inputs(batch, heads, heads_kv, seq_q, seq_kv, head_dim, dtype, positive=False):
    draw = torch.rand if positive else torch.randn
    q = draw(batch, heads, seq_q, head_dim, dtype=torch.float64).to(dtype)
    k, v = (draw(batch, heads_kv, seq_kv, head_dim, dtype=torch.float64).to(dtype) for _ in range(2))
    dout = torch.randn(batch, heads, seq_q, head_dim, dtype=torch.float64).to(dtype)
    return q, k, v, dout


def _gradients(q, k, v, dout, is_causal, scale=None):
    """dq, dk, dv of the plain PyTorch attention in q's precision (float64 inputs: the truth)."""
    leaves = [x.detach().clone().requires_grad_(True) for x in (q, k, v)]
    out = reference_attention(*leaves, is_causal=is_causal, scale=scale)
    out.backward(dout.to(out.dtype))
    return [x.grad for x in leaves]


def _check(q, k, v, dout, is_causal, schedule=SMALL, seed=0, scale=None):
    # out and the LSE as the Gluon forward writes them (its schedule model: natural log, float32)
    out, lse = forward_model.forward(q, k, v, is_causal=is_causal, scale=scale, schedule=FORWARD)
    grads = model.backward(q, k, v, out, lse, dout, is_causal=is_causal, scale=scale, schedule=schedule,
                           seed=seed)  # fmt: skip
    truth = _gradients(q.double(), k.double(), v.double(), dout.double(), is_causal, scale)
    same_precision = _gradients(q, k, v, dout, is_causal, scale)
    for name, got, torch_grad, exact in zip("qkv", grads, same_precision, truth, strict=True):
        assert not got.isnan().any(), f"d{name}: an entry no program wrote"
        assert got.dtype == q.dtype
        assert_error_rule(f"d{name} schedule", got, torch_grad, exact, GRAD_FACTOR, q.dtype)
    return grads


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("seq_q", "seq_kv"), [(1, 1), (17, 129), (129, 17), (130, 260)])
def test_ragged_lengths_both_ways(seq_q, seq_kv, is_causal):
    _check(*_inputs(1, 4, 2, seq_q, seq_kv, 64, torch.float16), is_causal)


@pytest.mark.parametrize(("head_dim", "heads_kv", "dtype"),
                         [(64, 1, torch.float16), (64, 1, torch.bfloat16), (128, 4, torch.float16),
                          (128, 2, torch.bfloat16)])  # fmt: skip
def test_head_dims_gqa_and_dtypes(head_dim, heads_kv, dtype):
    # dK and dV of a K/V head are summed over its query group (4 / heads_kv query heads here)
    _check(*_inputs(2, 4, heads_kv, 70, 130, head_dim, dtype), True)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_kernels_plan_and_positive_inputs(head_dim):
    # the kernel's own plan (128 keys per program, 64 per warpgroup; 64 query rows per step; two slots)
    plan = attention_bwd._plan(1, 2, 1, 150, 200, head_dim, torch.bfloat16, True)
    planned = model.from_plan(plan)
    assert planned == model.Schedule(64, 128, 2)
    assert plan.grid == (2, 1, 1)  # two key blocks of one K/V head
    _check(*_inputs(1, 2, 1, 150, 200, head_dim, torch.bfloat16, positive=True), True, planned,
           seed=head_dim)  # fmt: skip


def test_rows_that_see_no_key_get_zero_gradients():
    # causal, 70 queries over 20 keys (bottom-right): queries 0..49 see no key; their dQ is 0 and finite,
    # and the key block skips the query block of rows 0..63 only where no row of it sees a key
    dq, dk, dv = _check(*_inputs(1, 2, 1, 70, 20, 64, torch.bfloat16), True)
    assert torch.equal(dq[:, :, :50], torch.zeros_like(dq[:, :, :50]))
    dq, dk, dv = _check(*_inputs(1, 2, 1, 200, 20, 64, torch.float16), True)
    assert torch.equal(dq[:, :, :180], torch.zeros_like(dq[:, :, :180]))
    assert model.query_blocks(0, 64, 128, 200, 20, True) == (2, 2)  # rows 128.. (block 2) hold row 180


@pytest.mark.parametrize("offset", [61, 62, 63, 126, 127])
def test_causal_blocks_are_masked_where_they_cross_the_diagonal(offset):
    # only query blocks where row 0 misses a warpgroup's last key are masked (seq_kv - seq_q - key0 + start
    # < 63): at offsets 62 and 126 a block sits one key short of needing none, for warpgroup 0 and 1
    _check(*_inputs(1, 2, 1, 140, 140 + offset, 64, torch.float16), True)


@pytest.mark.parametrize("scale", [-0.3, 0.0])
@pytest.mark.parametrize("is_causal", [False, True])
def test_hidden_keys_stay_hidden_under_any_scale(scale, is_causal):
    # a hidden key's score is +inf under a negative scale (-inf once scaled), and a zero scale reads Q as
    # zeros: -inf * 0 would be NaN; the causal cases hold rows that see no key (LSE -inf)
    q, k, v, dout = _inputs(1, 2, 1, 100, 70, 64, torch.bfloat16)
    dq, dk, _ = _check(q, k, v, dout, is_causal, scale=scale)
    if scale == 0:
        assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk))


@pytest.mark.parametrize(("seq_q", "seq_kv", "is_causal"),
                         [(300, 260, True), (260, 300, True), (100, 100, False), (1, 129, True),
                          (400, 20, True)])  # fmt: skip
def test_query_blocks_are_those_that_see_a_key(seq_q, seq_kv, is_causal):
    for key_block in range(math.ceil(seq_kv / 128)):
        keys = torch.arange(key_block * 128, min((key_block + 1) * 128, seq_kv))
        wanted = []
        for block in range(math.ceil(seq_q / 64)):
            rows = torch.arange(block * 64, min((block + 1) * 64, seq_q))
            if not is_causal or bool((keys[None, :] <= rows[:, None] + (seq_kv - seq_q)).any()):
                wanted.append(block)
        first, count = model.query_blocks(key_block, 64, 128, seq_q, seq_kv, is_causal)
        assert list(range(first, first + count)) == wanted


@pytest.mark.parametrize("seq_kv", [1, 5, 70])
def test_keys_past_the_end_stay_masked_where_fp16_would_overflow(seq_kv):
    # fp16, delta = rowsum(dO * O) = 64 * 300 * 4 = 76800: a key past seq_kv left unmasked (score 0 on TMA's
    # zero K row) gets P = exp(-LSE) and dS = -P delta, which fp16 rounds to -inf, and -inf x the zero K row
    # is NaN in dQ (audit 18); masked, its P and dS are 0. The true dQ is 0: every key has the same V row.
    q = torch.full((1, 1, 3, 64), 0.5, dtype=torch.float16)
    k = torch.full((1, 1, seq_kv, 64), -0.5, dtype=torch.float16)
    v = torch.full((1, 1, seq_kv, 64), 4.0, dtype=torch.float16)
    dout = torch.full((1, 1, 3, 64), 300.0, dtype=torch.float16)
    out, lse = forward_model.forward(q, k, v, schedule=FORWARD)
    dq, dk, dv = model.backward(q, k, v, out, lse, dout)
    assert torch.equal(dq, torch.zeros_like(dq)), dq
    assert dk.isfinite().all() and dv.isfinite().all()


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_neighbouring_heads_non_finite_values_stay_out(is_causal):
    # partial query and key blocks (100 of 64 x 2, of 128) read TMA's zeros past a head's end, as the
    # kernel's 3-D descriptors do: read as rows of [B H S, D], head 0's last blocks held head 1's NaN rows,
    # and P = 0 (or dS = 0) times NaN made head 0's dV and dQ NaN
    q, k, v, dout = _inputs(1, 2, 2, 100, 100, 64, torch.bfloat16)
    out, lse = forward_model.forward(q, k, v, is_causal=is_causal, schedule=FORWARD)
    alone = model.backward(*(x[:, :1] for x in (q, k, v, out, lse, dout)), is_causal=is_causal)
    for x in (q, k, v, dout):
        x[:, 1] = math.nan
    mixed = model.backward(q, k, v, out, lse, dout, is_causal=is_causal)
    for name, got, want in zip("qkv", mixed, alone, strict=True):
        assert torch.equal(got[:, :1], want), f"d{name}: head 1's NaN reached head 0"


@pytest.mark.parametrize("seed", range(3))
def test_interleavings_do_not_change_the_result(seed):
    q, k, v, dout = _inputs(1, 2, 1, 100, 140, 64, torch.bfloat16)
    out, lse = forward_model.forward(q, k, v, is_causal=True, schedule=FORWARD)
    first = model.backward(q, k, v, out, lse, dout, is_causal=True, seed=0)
    again = model.backward(q, k, v, out, lse, dout, is_causal=True, seed=seed)
    assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True))


def test_a_broken_protocol_is_caught(monkeypatch):
    q, k, v, dout = _inputs(1, 2, 1, 300, 100, 64, torch.float16)
    out, lse = forward_model.forward(q, k, v, schedule=FORWARD)

    def never_blocks(barrier, parity):  # no partition waits: the producer overruns the ring
        yield True

    with monkeypatch.context() as patch:
        patch.setattr(protocol, "wait", never_blocks)
        with pytest.raises(protocol.ScheduleError, match="read (q slot|do slot|K/V)"):
            model.backward(q, k, v, out, lse, dout)
    waits = protocol.wait

    def refills_freely(barrier, parity):  # the producer does not wait for "empty": it overruns the ring
        if barrier.count == model.WARPGROUPS:
            yield True
        else:
            yield from waits(barrier, parity)

    with monkeypatch.context() as patch:
        patch.setattr(protocol, "wait", refills_freely)
        with pytest.raises(protocol.ScheduleError, match="read (q|do) slot"):
            model.backward(q, k, v, out, lse, dout)
    with monkeypatch.context() as patch:  # no arrival completes a phase: every partition waits forever
        patch.setattr(protocol.Barrier, "arrive", lambda self: None)
        with pytest.raises(protocol.ScheduleError, match="a hang"):
            model.backward(q, k, v, out, lse, dout)


def test_the_exponent_is_base_2_with_the_scale_folded_in():
    # a scale other than 1/sqrt(d) reaches P through the one folded multiply, dK and dQ through one more
    _check(*_inputs(1, 2, 1, 50, 70, 64, torch.bfloat16), False, scale=0.3)
    q, k, v, dout = _inputs(1, 1, 1, 40, 40, 64, torch.float16)
    out, lse = forward_model.forward(q, k, v, scale=0.3, schedule=FORWARD)
    truth = _gradients(q.double(), k.double(), v.double(), dout.double(), False, 0.3)
    dq, _, _ = model.backward(q, k, v, out, lse, dout, scale=0.3)
    assert max_error(dq, truth[0]) <= 0.05 * truth[0].abs().max().item()


def test_the_lse_gradient_enters_through_delta():
    # loss = sum(out * dout) + sum(lse * dlse): dS = P (dP - (rowsum(dO * O) - dLSE))
    q, k, v, dout = _inputs(1, 2, 1, 70, 90, 64, torch.float16)
    dlse = torch.randn(1, 2, 70)
    out, lse = forward_model.forward(q, k, v, is_causal=True, schedule=FORWARD)
    grads = model.backward(q, k, v, out, lse, dout, is_causal=True, dlse=dlse)

    def gradients(dtype):
        leaves = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
        o, m = reference_attention(*leaves, is_causal=True, return_lse=True)
        ((o * dout.to(dtype)).sum() + (m * dlse.to(m.dtype)).sum()).backward()
        return [x.grad for x in leaves]

    for name, got, torch_grad, exact in zip("qkv", grads, gradients(q.dtype), gradients(torch.float64),
                                            strict=True):  # fmt: skip
        assert_error_rule(f"d{name} with dLSE", got, torch_grad, exact, GRAD_FACTOR, q.dtype)
