"""Shared tools for the attention tests: inputs, the float64 reference, the 2x/3x rule applied, launch proof.

The rule itself, the NaN poisoning and the launch proof live in ``tests/accuracy_rule.py``, shared with the
GEMM and fused-op tests.
"""

from __future__ import annotations

import torch

from accuracy_rule import (  # noqa: F401  (re-exported: the attention tests import them from here)
    ERROR_CAP,
    GRAD_FACTOR,
    OUTPUT_FACTOR,
    assert_error_rule,
    expect_launches,
    max_error,
    nan_poisoned_outputs,
)
from llm_speed.attention import flash, launcher, plans
from llm_speed.attention.reference import reference_attention
from llm_speed.core import launch
from llm_speed.core.policy import use_policy

FORWARD_KERNELS = (flash.FORWARD.name,)
# The default backward's kernels on the device the tests run on (the H100 stand-in under the interpreter).
BACKWARD_KERNELS = tuple(
    kernel.name for kernel in flash.default_backward_kernels("cuda" if torch.cuda.is_available() else "cpu")
)


def atomic_by_default(policy) -> None:
    """Make every device's tier add dQ by atomics by default (the ``policy`` fixture: no tier in the
    policy's ``backward_dq_kernel_tiers``), as the tiers below Hopper's do (the H100 that stands in under the
    interpreter computes dQ in its own kernel)."""
    policy(backward_dq_kernel_tiers=())


def fresh_plans(monkeypatch) -> None:
    """Give the attention launchers plan caches of their own for this test, so that what it patches (a
    configuration, a switch, a grid) reaches the plans it makes, and no plan made under a patch outlives
    it."""
    import functools

    from llm_speed.attention import varlen

    for name in ("forward_plan", "backward_plans"):
        original = getattr(launcher, name).__wrapped__
        monkeypatch.setattr(launcher, name, functools.lru_cache(maxsize=None)(original))
    dense_calls = launch.CallCache()  # they hold plans
    monkeypatch.setattr(launcher, "DENSE_CALLS", dense_calls)
    monkeypatch.setattr(flash, "DENSE_CALLS", dense_calls)
    monkeypatch.setattr(varlen, "_VARLEN_CALLS", launch.CallCache())


def forward_with_choice(q, k, v, is_causal: bool, **changes) -> tuple:
    """(out and LSE under the current launch policy, out and LSE with ``changes`` to it), each from plans of
    its own (plans are keyed on the policy)."""
    from llm_speed import flash_attention

    shipped = flash_attention(q, k, v, is_causal=is_causal, return_lse=True)
    with use_policy(**changes):
        return shipped, flash_attention(q, k, v, is_causal=is_causal, return_lse=True)


def pin_configs(monkeypatch, *, forward=None, backward=None) -> None:
    """Launch the forward/dQ kernels with ``forward`` and the dK/dV kernel with ``backward`` (the shipped
    configuration where None) instead of ``flash.attention_config``'s choice."""
    fresh_plans(monkeypatch)
    real = flash.attention_config
    pinned = {"forward": forward, "backward": backward}

    def config(direction, block_d, dtype, hardware):
        return pinned[direction] or real(direction, block_d, dtype, hardware)

    monkeypatch.setattr(plans, "attention_config", config)


def record_backward_plans(monkeypatch) -> list:
    """A list that receives the (preprocess, dK/dV, dQ or dQ conversion) plans of every backward launched
    from here on, in call order (read at the launch: a later :func:`fresh_plans` keeps it working)."""
    made = []
    launch_backward = launcher.launch_backward

    def spy(plans, *args, **kwargs):
        made.append(plans)
        return launch_backward(plans, *args, **kwargs)

    monkeypatch.setattr(launcher, "launch_backward", spy)
    return made


def seq_major(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a [B, S, H, D] tensor, viewed as [B, H, S, D] (flash-attn's and Hugging Face's)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def make_qkv(batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, dtype, device, scale_q=1.0, scale_k=1.0):
    q = (torch.randn(batch, heads_q, seq_q, head_dim) * scale_q).to(dtype).to(device)
    k = (torch.randn(batch, heads_kv, seq_kv, head_dim) * scale_k).to(dtype).to(device)
    v = torch.randn(batch, heads_kv, seq_kv, head_dim).to(dtype).to(device)
    return q, k, v


def run_with_grads(fn, q, k, v, dout, dlse=None, **kwargs):
    """Forward + backward of ``fn`` on leaf copies; returns (out, lse, dq, dk, dv) detached.

    The loss is <out, dout> (+ <lse, dlse> over rows that see a key); ``dout`` may be any strided tensor.
    """
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, return_lse=True, **kwargs)
    loss = (out.to(dout.dtype) * dout).sum()
    if dlse is not None:
        finite = torch.isfinite(lse)
        loss = loss + (torch.where(finite, lse, torch.zeros_like(lse)).to(dlse.dtype) * dlse).sum()
    loss.backward()
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def reference_with_grads(q, k, v, dout, dlse=None, dtype=torch.float64, device="cpu", **kwargs):
    """The PyTorch reference on ``device`` in ``dtype`` (float64: the truth; q's dtype: the same-precision
    run). The CPU by default; GPU-scale tests use the GPU, where float64 at seq 2048 takes milliseconds."""
    cast = [t.detach().to(device=device, dtype=dtype) for t in (q, k, v)]
    dout = dout.detach().to(device=device, dtype=dtype)
    dlse = dlse.detach().to(device=device, dtype=dtype) if dlse is not None else None
    return run_with_grads(reference_attention, *cast, dout, dlse, **kwargs)


def check_against_reference(
    fn, q, k, v, *, is_causal, scale=None, grads=True, dlse=False, reference_device="cpu"
):
    """Run ``fn`` (forward, and backward when ``grads``) and apply the 2x/3x rule to out, lse, dq, dk, dv.

    The references run on ``reference_device``."""
    dtype = q.dtype
    dout = torch.randn(q.shape, dtype=dtype).to(q.device)
    dlse_t = torch.randn(q.shape[:3], dtype=torch.float32).to(q.device) if dlse else None
    kwargs = dict(is_causal=is_causal, scale=scale)
    truth = reference_with_grads(q, k, v, dout, dlse_t, torch.float64, reference_device, **kwargs)
    same = reference_with_grads(q, k, v, dout, dlse_t, dtype, reference_device, **kwargs)
    if grads:
        got = run_with_grads(fn, q, k, v, dout, dlse_t, **kwargs)
    else:
        got = fn(q, k, v, return_lse=True, **kwargs)
    assert got[0].dtype == dtype and got[0].shape == q.shape
    assert got[1].dtype == torch.float32 and got[1].shape == q.shape[:3]
    names = ("out", "lse", "dq", "dk", "dv")
    for i, (name, value) in enumerate(zip(names[: len(got)], got, strict=True)):
        factor = OUTPUT_FACTOR if i < 2 else GRAD_FACTOR
        assert_error_rule(name, value, same[i], truth[i], factor, dtype)
    return got


def decode_kernels(q, heads_kv: int, seq_new: int, split: bool = False) -> list[str]:
    """The kernels a flash_attention_with_kvcache call of query ``q`` launches: the attention kernel, the
    combine kernel when ``split``, and the append kernel when there are new tokens that the attention kernel
    does not write itself (more query rows per KV head than one tile)."""
    from llm_speed.attention import decode

    _, seq_q, heads_q, head_dim = q.shape
    names = [decode.KERNEL_DECODE] + [decode.KERNEL_COMBINE] * split
    if seq_new and not decode.appends_in_attention(heads_q // heads_kv * seq_q, head_dim, q.dtype):
        names.append(decode.KERNEL_APPEND)
    return names


def repeat_decode_step(call: dict, checked: list) -> None:
    """Run the decode step ``call`` (keywords of flash_attention_with_kvcache, one token appended) twice, on
    equal copies of its caches: the second is served from the calls already checked (no new entry in
    ``checked``, the kernels of :func:`decode_kernels` launched), with the first's output and cache bytes."""
    from llm_speed.attention import decode

    again = dict(call, k_cache=call["k_cache"].clone(), v_cache=call["v_cache"].clone())
    first = decode.flash_attention_with_kvcache(**call)
    seen = len(checked)
    q, heads_kv = call["q"], call["k_cache"].shape[2]
    with expect_launches(*decode_kernels(q, heads_kv, call["k"].shape[1]), device=q.device, only=True):
        out = decode.flash_attention_with_kvcache(**again)
    assert len(checked) == seen and len(decode._DECODE_CALLS) == 1
    assert torch.equal(out, first)
    for name in ("k_cache", "v_cache"):  # bitwise (an fp8 cache compared as bytes)
        assert torch.equal(again[name].view(torch.uint8), call[name].view(torch.uint8))
