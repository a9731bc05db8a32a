"""Semantics beyond accuracy: masks, rows with no key, strides, padding, magnitudes, metamorphic properties,
determinism, dispatch, zero sizes. Shapes are small: the kernels run through the Triton interpreter on CPU."""

import numpy as np
import pytest
import torch
from attention_testing import (
    BACKWARD_KERNELS,
    FORWARD_KERNELS,
    assert_error_rule,
    check_against_reference,
    fresh_plans,
    make_qkv,
    max_error,
    pin_configs,
    reference_with_grads,
    run_with_grads,
)

from llm_speed import flash_attention, flash_attention_varlen, naive_attention, tiled_attention
from llm_speed.attention import flash, launcher, plans
from llm_speed.attention.checks import prepare_attention_inputs
from llm_speed.attention.reference import causal_visible, reference_attention
from llm_speed.core import runtime
from llm_speed.core.config import KernelConfig
from llm_speed.core.hardware import hardware_of
from llm_speed.core.policy import current_policy

ALL_FUNCTIONS = [flash_attention, tiled_attention, naive_attention]


def test_causal_mask_is_bottom_right_and_differs_from_sdpa():
    visible = causal_visible(2, 4)
    assert visible.tolist() == [[True, True, True, False], [True, True, True, True]]
    q, k, v = make_qkv(1, 1, 1, 3, 5, 16, torch.float64, "cpu")
    ours = reference_attention(q, k, v, is_causal=True)
    sdpa_top_left = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(ours, sdpa_top_left)  # SDPA aligns top-left when seq_q != seq_kv
    square = make_qkv(1, 1, 1, 5, 5, 16, torch.float64, "cpu")
    sdpa_square = torch.nn.functional.scaled_dot_product_attention(*square, is_causal=True)
    torch.testing.assert_close(reference_attention(*square, is_causal=True), sdpa_square)


@pytest.mark.parametrize("fn", ALL_FUNCTIONS, ids=lambda f: f.__name__)
def test_rows_that_see_no_key_give_zero_and_minus_inf(fn, device):
    # seq_q 70 > seq_kv 5 with causal: query i sees keys j <= i - 65, so rows 0..64 see nothing.
    q, k, v = make_qkv(1, 2, 1, 70, 5, 32, torch.float16, device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=device)
    out, lse, dq, dk, dv = run_with_grads(fn, q, k, v, dout, is_causal=True)
    blind = slice(0, 65)
    assert (out[:, :, blind] == 0).all() and (lse[:, :, blind] == float("-inf")).all()
    assert (dq[:, :, blind] == 0).all()
    assert torch.isfinite(out).all() and torch.isfinite(dq).all()
    assert torch.isfinite(dk).all() and torch.isfinite(dv).all()
    assert torch.isfinite(lse[:, :, 65:]).all()


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # later query blocks do read the NaNs
def test_causal_skips_fully_masked_blocks(device, monkeypatch):
    # Pin small blocks, then poison every key block that no query of the first block may see: the skipped
    # blocks' NaNs cannot reach the output of rows that never look at them.
    q, k, v = make_qkv(1, 1, 1, 64, 64, 16, torch.float32, device)
    k_poisoned, v_poisoned = k.clone(), v.clone()
    k_poisoned[:, :, 32:] = float("nan")
    v_poisoned[:, :, 32:] = float("nan")
    small = KernelConfig(16, 16, 4, 1)
    pin_configs(monkeypatch, forward=small)
    out = flash_attention(q, k_poisoned, v_poisoned, is_causal=True)
    ref = reference_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert torch.isfinite(out[:, :, :32]).all()
    assert max_error(out[:, :, :32], ref[:, :, :32]) < 1e-5


def test_non_contiguous_inputs_and_grad(device):
    # q from a [B, S, H, D] tensor viewed as [B, H, S, D]; k and v sliced out of a packed QKV buffer;
    # the output gradient is a strided slice. All must be read in place, with the same results.
    batch, seq, heads, dim = 2, 37, 4, 48
    bshd = torch.randn(batch, seq, heads, dim, dtype=torch.float16, device=device)
    q = bshd.transpose(1, 2)
    packed = torch.randn(batch, seq, 3, 2, dim, dtype=torch.float16, device=device)  # [B, S, qkv, Hkv, D]
    k, v = packed[:, :, 1].transpose(1, 2), packed[:, :, 2].transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous() and k.stride(-1) == 1
    dout = torch.randn(batch, heads, seq, 2 * dim, dtype=torch.float16, device=device)[..., ::2]
    assert dout.stride(-1) == 2  # not contiguous in the last dim: copied inside the backward
    got = run_with_grads(flash_attention, q, k, v, dout, is_causal=True)
    contiguous = run_with_grads(
        flash_attention, q.contiguous(), k.contiguous(), v.contiguous(), dout.contiguous(), is_causal=True
    )
    for a, b in zip(got, contiguous, strict=True):
        assert torch.equal(a, b)
    truth = reference_with_grads(q, k, v, dout, None, torch.float64, is_causal=True)
    same = reference_with_grads(q, k, v, dout, None, torch.float16, is_causal=True)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_error_rule(name, got[i], same[i], truth[i], 2.0 if i < 2 else 3.0, torch.float16)


def test_non_contiguous_last_dim_is_copied_not_rejected(device):
    q, k, v = make_qkv(1, 2, 2, 17, 17, 32, torch.float32, device)
    q_strided = torch.stack([q, q], dim=-1).flatten(-2)[..., ::2]  # same values, last-dim stride 2
    assert q_strided.stride(-1) == 2 and torch.equal(q_strided, q)
    for fn in ALL_FUNCTIONS:
        assert torch.equal(fn(q_strided, k, v), fn(q, k, v))


@pytest.mark.parametrize("poison", [float("nan"), 1e10])
def test_values_in_padding_do_not_leak(poison, device):
    # Real data is a slice of a larger buffer whose extra sequence rows and head_dim columns hold poison.
    # The kernels mask those loads, so the result must equal the clean one exactly.
    seq_q, seq_kv, dim = 19, 23, 40
    q_buf = torch.full((1, 2, seq_q + 5, 64), poison, device=device)
    k_buf = torch.full((1, 1, seq_kv + 9, 64), poison, device=device)
    v_buf = torch.full((1, 1, seq_kv + 9, 64), poison, device=device)
    q, k, v = make_qkv(1, 2, 1, seq_q, seq_kv, dim, torch.float32, device)
    q_buf[:, :, :seq_q, :dim], k_buf[:, :, :seq_kv, :dim], v_buf[:, :, :seq_kv, :dim] = q, k, v
    q_view, k_view, v_view = q_buf[:, :, :seq_q, :dim], k_buf[:, :, :seq_kv, :dim], v_buf[:, :, :seq_kv, :dim]
    for fn in (flash_attention, tiled_attention):
        for causal in (False, True):
            assert torch.equal(fn(q_view, k_view, v_view, is_causal=causal), fn(q, k, v, is_causal=causal))
    dout = torch.randn(q.shape, device=device)
    grads_view = run_with_grads(flash_attention, q_view, k_view, v_view, dout, is_causal=True)
    grads_clean = run_with_grads(flash_attention, q, k, v, dout, is_causal=True)
    for a, b in zip(grads_view, grads_clean, strict=True):
        assert torch.equal(a, b)


def test_large_magnitudes_fp16(device):
    # Logits scaled by 5 x 3 (peaked softmax) and values near the fp16 limit of 6.5e4.
    q, k, _ = make_qkv(1, 2, 2, 65, 65, 64, torch.float16, device, scale_q=5.0, scale_k=3.0)
    v = (torch.rand(1, 2, 65, 64) * 1.2e5 - 6e4).to(torch.float16).to(device)
    out = check_against_reference(flash_attention, q, k, v, is_causal=False, grads=False)[0]
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_negative_scale_in_16_bit_dtypes(dtype, device):
    """A negative scale (its sign moved into q: ``NEG_SCALE``), dense forward and backward and a packed call:
    the 2x/3x rule against float64. bfloat16 was 4.2 off in the output, its LSE 2.7e3, under the interpreter,
    whose unary minus on a bfloat16 tile negates the raw bits as an integer (0.31 became -14.1)."""
    q, k, v = make_qkv(1, 2, 2, 9, 11, 64, dtype, device)
    check_against_reference(flash_attention, q, k, v, is_causal=True, scale=-0.2, dlse=True)
    cu_q, cu_k = (torch.tensor([0, 4, n], dtype=torch.int32, device=device) for n in (9, 11))
    packed = flash_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu_q,
                                    cu_k, 5, 7, is_causal=True, scale=-0.2)  # fmt: skip
    for i, ((q0, q1), (k0, k1)) in enumerate(zip(((0, 4), (4, 9)), ((0, 4), (4, 11)), strict=True)):
        part = [q[:, :, q0:q1].cpu(), k[:, :, k0:k1].cpu(), v[:, :, k0:k1].cpu()]
        truth = reference_attention(*(t.double() for t in part), is_causal=True, scale=-0.2)
        same = reference_attention(*part, is_causal=True, scale=-0.2)
        got = packed[q0:q1].transpose(0, 1)[None]
        assert_error_rule(f"packed sequence {i}", got, same, truth, 2.0, dtype)


def test_adding_a_constant_to_a_rows_logits_changes_nothing(device):
    # k + u adds q_i . u to every logit of row i: softmax is shift invariant, so the output is unchanged.
    q, k, v = make_qkv(2, 2, 2, 33, 41, 32, torch.float32, device)
    shift = torch.randn(1, 1, 1, 32, device=device) * 4
    shifted = flash_attention(q, k + shift, v, is_causal=True)
    truth = reference_attention(q.double().cpu(), k.double().cpu(), v.double().cpu(), is_causal=True)
    same = reference_attention(q.cpu(), (k + shift).cpu(), v.cpu(), is_causal=True)
    assert_error_rule("out", shifted, same, truth, 2.0, torch.float32)


def test_permuting_keys_and_values_together_changes_nothing(device):
    q, k, v = make_qkv(1, 2, 1, 50, 77, 24, torch.float32, device)
    perm = torch.randperm(77, device=device)
    out = flash_attention(q, k, v)
    permuted = flash_attention(q, k[:, :, perm], v[:, :, perm])
    truth = reference_attention(q.double().cpu(), k.double().cpu(), v.double().cpu())
    same = reference_attention(q.cpu(), k.cpu(), v.cpu())
    assert_error_rule("permuted", permuted, same, truth, 2.0, torch.float32)
    assert_error_rule("original", out, same, truth, 2.0, torch.float32)


def test_batch_rows_are_independent(device):
    q, k, v = make_qkv(3, 2, 1, 21, 30, 16, torch.bfloat16, device)
    whole = flash_attention(q, k, v, is_causal=True)
    alone = flash_attention(q[1:2], k[1:2], v[1:2], is_causal=True)
    assert torch.equal(whole[1:2], alone)


def test_identical_value_rows_give_zero_dq_and_dk(device):
    # If every V row is the same, the output does not depend on the attention weights at all.
    q, k, v = make_qkv(1, 2, 1, 33, 45, 32, torch.float32, device)
    v = v[:, :, :1].expand_as(v).contiguous()
    dout = torch.randn(q.shape, device=device)
    _, _, dq, dk, dv = run_with_grads(flash_attention, q, k, v, dout, is_causal=True)
    assert dq.abs().max() < 1e-5 and dk.abs().max() < 1e-5
    assert dv.abs().max() > 0.1


def test_forward_and_backward_are_bitwise_deterministic(device):
    # deterministic=True: everything; the default path: everything but dQ (float32 atomics on a GPU).
    q, k, v = make_qkv(2, 4, 2, 45, 70, 40, torch.bfloat16, device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=device)
    for deterministic in (True, False):
        options = dict(is_causal=True, deterministic=deterministic)
        first = run_with_grads(flash_attention, q, k, v, dout, **options)
        for _ in range(2):
            again = run_with_grads(flash_attention, q, k, v, dout, **options)
            for i, (a, b) in enumerate(zip(first, again, strict=True)):
                if deterministic or i != 2 or device.type == "cpu":
                    assert torch.equal(a, b)


def test_inputs_are_not_modified(device):
    q, k, v = make_qkv(1, 2, 1, 17, 9, 16, torch.float16, device)
    copies = [t.clone() for t in (q, k, v)]
    dout = torch.randn(q.shape, dtype=q.dtype, device=device)
    for fn in ALL_FUNCTIONS:
        run_with_grads(fn, q, k, v, dout, is_causal=True)
        fn(q, k, v)
    for original, copy in zip((q, k, v), copies, strict=True):
        assert torch.equal(original, copy)


def test_dispatch_runs_the_triton_kernels(device):
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    q, k, v = make_qkv(1, 1, 1, 5, 5, 16, torch.float32, device)
    before = {name: runtime.launch_count(name) for name in (*FORWARD_KERNELS, *BACKWARD_KERNELS)}
    q.requires_grad_()
    flash_attention(q, k, v).sum().backward()
    for name, count in before.items():
        assert runtime.launch_count(name) == count + 1, name


def test_cpu_without_interpreter_runs_the_reference(monkeypatch):
    # With Triton unavailable for CPU tensors, the PyTorch reference runs in float32 (no launch).
    monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    before = {name: runtime.launch_count(name) for name in (*FORWARD_KERNELS, *BACKWARD_KERNELS)}
    q, k, v = make_qkv(2, 4, 2, 70, 150, 40, torch.float16, "cpu")
    with pytest.MonkeyPatch.context() as patch:
        calls = []
        real = launcher.reference_forward
        patch.setattr(launcher, "reference_forward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        check_against_reference(flash_attention, q, k, v, is_causal=True, dlse=True)
        assert calls
    check_against_reference(tiled_attention, q, k, v, is_causal=True)
    assert all(runtime.launch_count(name) == count for name, count in before.items())


@pytest.mark.parametrize("fn", ALL_FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "batch, seq_q, seq_kv",
    [(0, 5, 7), (2, 0, 7), (2, 5, 0), (0, 0, 0)],
    ids=["batch0", "seq_q0", "seq_kv0", "all0"],
)
def test_zero_sizes(fn, batch, seq_q, seq_kv, device):
    # Documented: empty batch or query sequence -> empty results; no key at all -> output 0, LSE -inf;
    # gradients are zeros of the input shapes.
    q, k, v = make_qkv(batch, 4, 2, seq_q, seq_kv, 16, torch.float16, device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=device)
    for causal in (False, True):
        out, lse, dq, dk, dv = run_with_grads(fn, q, k, v, dout, is_causal=causal)
        assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
        assert (out == 0).all() and (lse == float("-inf")).all()
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_every_launch_uses_a_one_dimensional_grid(device, monkeypatch):
    # CUDA caps grid axis 1 at 65535: batch * heads must not live there (large-batch decode passes it).
    grids = []
    real_grid = plans._grid
    fresh_plans(monkeypatch)
    monkeypatch.setattr(plans, "_grid", lambda *args: grids.append(args) or real_grid(*args))
    q, k, v = make_qkv(3, 4, 2, 37, 21, 16, torch.float16, device)
    dout = torch.randn(q.shape, dtype=q.dtype, device=device)
    run_with_grads(flash_attention, q, k, v, dout)
    run_with_grads(flash_attention, q, k, v, dout, deterministic=True)
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    # forward and dK/dV (default path with dQ by atomics), and the deterministic path's dK/dV and dQ kernels
    # (the preprocess and dQ conversion grids are one block per row block, or per element block, too); where
    # the tier computes dQ in its own kernel by default (the H100) both calls share those plans
    dq_kernel = flash.tier_dq_kernel(flash.tier_for(hardware_of(device)), current_policy())
    assert len(grids) == (3 if dq_kernel else 4)
    for n_rows, block, batch, heads, varlen in grids:
        assert batch == 3 and heads in (4, 2) and n_rows in (37, 21) and not varlen
        grid, _ = real_grid(n_rows, block, batch, heads, False)
        assert grid == (-(-n_rows // block) * batch * heads,)


def test_strided_views_are_read_in_place_without_a_copy():
    # A [B, S, H, D] tensor viewed as [B, H, S, D], and K/V sliced from a packed buffer, reach the kernels as
    # they are (same memory, same strides); only a non-contiguous last dim is copied.
    bshd = torch.randn(2, 9, 4, 16)
    packed = torch.randn(2, 9, 3, 2, 16)
    q, k, v = bshd.transpose(1, 2), packed[:, :, 1].transpose(1, 2), packed[:, :, 2].transpose(1, 2)
    prepared = prepare_attention_inputs(q, k, v, None)[:3]
    for original, ready in zip((q, k, v), prepared, strict=True):
        assert ready.data_ptr() == original.data_ptr() and ready.stride() == original.stride()
    strided_last = torch.randn(1, 2, 5, 32)[..., ::2]
    copied = prepare_attention_inputs(strided_last, strided_last, strided_last, None)[0]
    assert copied.stride(-1) == 1 and torch.equal(copied, strided_last)


def test_window_mask_is_bottom_right_aligned_and_causal_forces_right_zero():
    from llm_speed.attention.reference import visible

    # seq_q 2, seq_kv 5: query 0 sits at key position 3, query 1 at 4.
    mask = visible(2, 5, window=(1, 0))
    assert mask.tolist() == [[False, False, True, True, False], [False, False, False, True, True]]
    assert torch.equal(visible(2, 5, is_causal=True, window=(None, 3)), causal_visible(2, 5))
    assert torch.equal(visible(2, 5, is_causal=True, window=(1, 7)), mask)
    assert visible(3, 3, window=(None, None)).all()
    assert visible(3, 3, window=(0, 0)).equal(torch.eye(3, dtype=torch.bool))


def test_window_and_softcap_checks_name_the_argument():
    from llm_speed.attention.checks import check_softcap, check_window

    assert check_window([np.int64(3), None]) == (3, None)
    for bad, error in (
        ((1,), TypeError),
        ((-1, 0), ValueError),
        ((1.5, 0), TypeError),
        ((True, 0), TypeError),
    ):
        with pytest.raises(error, match="window"):
            check_window(bad)
    assert check_softcap(30) == 30.0
    for bad, error in ((0.0, ValueError), (float("inf"), ValueError), ("30", TypeError), (True, TypeError)):
        with pytest.raises(error, match="softcap"):
            check_softcap(bad)
