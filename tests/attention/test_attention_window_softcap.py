"""Dense attention options: local windows and softcapping (forward and backward), block skipping outside the
window, real-bool flags, flash-attn / SDPA argument names, and bfloat16 rounding under the interpreter.
Small blocks are pinned so that a 40-row sequence spans several blocks on both sides."""

import inspect

import numpy as np
import pytest
import torch
from attention_testing import (
    BACKWARD_KERNELS,
    FORWARD_KERNELS,
    assert_error_rule,
    expect_launches,
    fresh_plans,
    make_qkv,
    max_error,
    pin_configs,
    reference_with_grads,
    run_with_grads,
)

from llm_speed import flash_attention, naive_attention, tiled_attention
from llm_speed.attention import flash, flash_attention_varlen, plans
from llm_speed.attention.reference import reference_attention
from llm_speed.core import runtime
from llm_speed.core.config import KernelConfig

ALL_FUNCTIONS = [flash_attention, tiled_attention, naive_attention]
SMALL = KernelConfig(16, 16, 4, 1)


@pytest.fixture
def small_blocks(monkeypatch):
    pin_configs(monkeypatch, forward=SMALL, backward=SMALL)


def check_rule(fn, q, k, v, dout=None, dlse=None, **options):
    """Forward and backward of ``fn`` against the float64 reference with the 2x (out, lse) / 3x (grads) rule.
    Output and LSE gradients are drawn from randn unless given."""
    dout = torch.randn(q.shape, dtype=q.dtype).to(q.device) if dout is None else dout
    dlse = torch.randn(q.shape[:3]).to(q.device) if dlse is None else dlse
    truth = reference_with_grads(q, k, v, dout, dlse, torch.float64, **options)
    same = reference_with_grads(q, k, v, dout, dlse, q.dtype, **options)
    got = run_with_grads(fn, q, k, v, dout, dlse, **options)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_error_rule(name, got[i], same[i], truth[i], 2.0 if i < 2 else 3.0, q.dtype)
    return got


@pytest.mark.parametrize(
    "seq_q, seq_kv, is_causal, window",
    [
        (40, 40, False, (0, 0)),  # each query sees its own key only
        (40, 40, True, (1, None)),  # causal: right is 0 whatever is given
        (40, 40, False, (17, 17)),
        (33, 50, True, (17, 0)),  # Mistral-style sliding window of 18 tokens, seq_q < seq_kv
        (50, 33, False, (None, 1)),  # one side unbounded, seq_q > seq_kv: early rows see nothing
        (40, 40, False, (17, None)),
        (40, 40, False, (100, 100)),  # larger than the sequence: plain attention
    ],
)
def test_flash_window_matches_reference(seq_q, seq_kv, is_causal, window, device, small_blocks):
    q, k, v = make_qkv(1, 2, 1, seq_q, seq_kv, 16, torch.float32, device)
    with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=device):
        check_rule(flash_attention, q, k, v, is_causal=is_causal, window=window)


@pytest.mark.parametrize("fn", [tiled_attention, naive_attention], ids=lambda f: f.__name__)
def test_tiled_and_naive_window_and_softcap(fn, device, small_blocks):
    q, k, v = make_qkv(1, 2, 2, 37, 45, 16, torch.float16, device, scale_q=4.0)
    check_rule(fn, q, k, v, is_causal=True, window=(9, None), softcap=3.0)
    check_rule(fn, q, k, v, window=(None, 5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_softcap_with_large_logits(dtype, device, small_blocks):
    # Scores of a few hundred: without the cap softmax would be one-hot; capped at 5 they are not.
    q, k, v = make_qkv(1, 4, 2, 40, 24, 32, dtype, device, scale_q=8.0, scale_k=8.0)
    out = check_rule(flash_attention, q, k, v, softcap=5.0, window=(20, 3))[0]
    uncapped = reference_attention(q.double(), k.double(), v.double(), window=(20, 3))
    assert max_error(out, uncapped) > 0.1  # the cap changed the answer


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")
def test_blocks_outside_the_window_are_skipped(device, small_blocks):
    # Causal sliding window of 9 keys: the query block of rows 48..63 needs keys 40..63 only. Poison keys
    # 0..31 (two whole blocks): forward, dQ and dK/dV for those rows and keys must never read them.
    q, k, v = make_qkv(1, 1, 1, 64, 64, 16, torch.float32, device)
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[:, :, :32] = float("nan")
    v_bad[:, :, :32] = float("nan")
    dout = torch.randn(q.shape, device=device)
    options = dict(is_causal=True, window=(8, 0))
    out, _, dq, dk, dv = run_with_grads(flash_attention, q, k_bad, v_bad, dout, **options)
    truth = reference_with_grads(q, k, v, dout, None, torch.float64, **options)
    rows = slice(48, 64)
    for got, expected in ((out, truth[0]), (dq, truth[2]), (dk, truth[3]), (dv, truth[4])):
        assert max_error(got[:, :, rows], expected[:, :, rows]) < 1e-5


def test_window_zero_sees_only_the_aligned_key(device):
    q, k, v = make_qkv(1, 1, 1, 5, 8, 16, torch.float32, device)
    out = flash_attention(q, k, v, window=(0, 0))
    torch.testing.assert_close(out, v[:, :, 3:], rtol=0, atol=1e-6)  # query i sees key i + 3 alone


@pytest.mark.parametrize("fn", [*ALL_FUNCTIONS, flash_attention_varlen], ids=lambda f: f.__name__)
def test_flags_must_be_real_bools(fn, device):
    q, k, v = make_qkv(1, 2, 2, 4, 4, 16, torch.float32, device)
    if fn is flash_attention_varlen:
        cu = torch.tensor([0, 4], dtype=torch.int32, device=device)
        q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))
        args = (q, k, v, cu, cu, 4, 4)
    else:
        args = (q, k, v)
    before = runtime.launch_count(flash.FORWARD.name)
    with pytest.raises(TypeError, match="is_causal must be a bool.*got str"):
        fn(*args, is_causal="no")
    with pytest.raises(TypeError, match="return_lse must be a bool.*got int"):
        fn(*args, return_lse=1)
    assert runtime.launch_count(flash.FORWARD.name) == before  # rejected before any work
    causal = fn(*args, is_causal=np.bool_(True))
    torch.testing.assert_close(causal, fn(*args, is_causal=True), rtol=0, atol=0)


@pytest.mark.parametrize("fn", [*ALL_FUNCTIONS, flash_attention_varlen], ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "keyword, hint",
    [
        ("causal", "did you mean is_causal="),
        ("softmax_scale", "did you mean scale="),
        ("window_size", "did you mean window="),
        ("attn_mask", "arbitrary masks are not supported; use is_causal= and/or window="),
        ("dropout_p", "attention dropout is in flash_attention and flash_attention_varlen"),
        ("casual", "accepted keywords: .*is_causal"),
    ],
)
def test_foreign_argument_names_get_ours(fn, keyword, hint):
    if keyword in inspect.signature(fn).parameters:
        pytest.skip(f"{fn.__name__} accepts {keyword}= itself: there it is not a foreign name")
    positional = [p for p in inspect.signature(fn).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{keyword}': {hint}"):
        fn(*[None] * len(positional), **{keyword: True})  # refused before any argument is read


def test_bad_window_and_softcap_are_named():
    q, k, v = make_qkv(1, 1, 1, 4, 4, 16, torch.float32, "cpu")
    with pytest.raises(TypeError, match="window must be None or a pair"):
        flash_attention(q, k, v, window=5)
    with pytest.raises(ValueError, match="window left must be >= 0"):
        tiled_attention(q, k, v, window=(-1, 0))
    with pytest.raises(ValueError, match="softcap must be a finite number > 0"):
        naive_attention(q, k, v, softcap=0.0)


def test_bf16_positive_inputs_round_to_nearest_even(device, monkeypatch):
    # Positive inputs and output gradient (torch.rand, as PyTorch's SDPA tests use): truncating P and dS to
    # bfloat16 biases every tile low, and dK shows it: 5.3x PyTorch's own bf16 error with truncation, 0.4x
    # with round-to-nearest-even, at this seed. The fixed cap of the 2x/3x rule (8e-3) would hide the
    # difference at this size, so dK is also held to 3x PyTorch's error with no cap.
    q, k, v, dout = (torch.rand(1, 2, 64, 32, dtype=torch.bfloat16, device=device) for _ in range(4))
    dlse = torch.zeros(q.shape[:3], device=device)
    truth = reference_with_grads(q, k, v, dout, dlse, torch.float64)
    same = reference_with_grads(q, k, v, dout, dlse, torch.bfloat16)

    def dk_error_ratio():
        got = check_rule(flash_attention, q, k, v, dout, dlse)
        return max_error(got[3], truth[3]) / max_error(same[3], truth[3])

    assert dk_error_ratio() <= 3.0
    if runtime.INTERPRETED:  # compiled Triton rounds to nearest even by itself
        real = plans.dot_switches
        fresh_plans(monkeypatch)
        monkeypatch.setattr(plans, "dot_switches", lambda dtype: dict(real(dtype), RNE_BY_HAND=False))
        assert dk_error_ratio() > 3.0  # truncation: the check above catches it


def test_opcheck_and_compile_with_window_and_softcap(device):
    q, k, v = make_qkv(1, 2, 1, 9, 13, 16, torch.float32, device)
    for t in (q, k, v):
        t.requires_grad_()
    args = (q, k, v, True, 0.3, 4, None, 2.5)
    torch.library.opcheck(torch.ops.llm_speed.flash_attention_forward.default, args)
    torch.library.opcheck(torch.ops.llm_speed.tiled_attention_forward.default, args)

    torch._dynamo.reset()

    def loss(q, k, v):
        return flash_attention(q, k, v, window=(3, 2), softcap=2.0).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    traced = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    loss(*eager).backward()
    compiled(*traced).backward()
    for a, b in zip(eager, traced, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)


def test_cpu_without_interpreter_runs_the_reference_with_options(monkeypatch):
    # CPU tensors when Triton cannot run: the float32 reference, its backward written out (autograd does
    # not record inside an operator), with window, softcap, GQA and LSE gradients; no kernel launches.
    monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    before = {name: runtime.launch_count(name) for name in (*FORWARD_KERNELS, *BACKWARD_KERNELS)}
    q, k, v = make_qkv(2, 4, 2, 30, 45, 16, torch.float16, "cpu", scale_q=4.0)
    check_rule(flash_attention, q, k, v, is_causal=True, window=(9, None), softcap=3.0)
    check_rule(tiled_attention, q, k, v, window=(None, 2))
    assert all(runtime.launch_count(name) == count for name, count in before.items())
