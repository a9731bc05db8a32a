"""The backward's two paths: dQ added in float32 by atomics from the dK/dV kernel (five matmuls,
FlashAttention-2's) and converted by a small kernel; or a dQ kernel of its own that recomputes S and dP (seven
matmuls, every dQ element one writer), taken with ``deterministic=True``, PyTorch's deterministic mode, and by
default on devices whose tier says so (Hopper's 227 KB per block: the H100 that stands in under the
interpreter). The rest of the attention tests run the default path; here each path meets the same float64
rule on dense GQA, ragged and causal shapes, windows with softcap and packed sequences, and each test proves
which kernels ran. (Under the interpreter programs run one at a time, so atomics cannot race here: the GPU
tests check the run-to-run spread.)"""

import functools

import pytest
import torch
from attention_testing import (
    assert_error_rule,
    atomic_by_default,
    check_against_reference,
    make_qkv,
    pin_configs,
    record_backward_plans,
)
from test_attention_varlen import dense_per_sequence, packed_inputs
from test_attention_window_softcap import SMALL, check_rule

from llm_speed import flash_attention, tiled_attention
from llm_speed.attention import flash, flash_attention_varlen
from llm_speed.core import runtime
from llm_speed.core.hardware import Hardware, hardware_of
from llm_speed.core.policy import current_policy

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DETERMINISTIC = tuple(kernel.name for kernel in flash.DETERMINISTIC_BACKWARD_KERNELS)
ATOMIC = tuple(kernel.name for kernel in flash.ATOMIC_BACKWARD_KERNELS)
DQ, CONVERT = flash.BACKWARD_DQ.name, flash.BACKWARD_DQ_CONVERT.name


class Ran:
    """The kernels launched inside the block (by name: how many times)."""

    def __enter__(self):
        self.before = {name: runtime.launch_count(name) for name in (*DETERMINISTIC, *ATOMIC)}
        return self

    def __exit__(self, *exc):
        self.counts = {name: runtime.launch_count(name) - before for name, before in self.before.items()}

    def path(self) -> str:
        dq, convert = self.counts[DQ], self.counts[CONVERT]
        assert self.counts[flash.BACKWARD_DKDV.name] > 0
        assert (dq > 0) != (convert > 0), self.counts
        return "deterministic" if dq else "atomic"


def test_default_path_follows_the_tier(device):
    """Hopper-class devices compute dQ in a kernel of their own by default (measured faster on an H100); the
    other tiers add it by atomics."""
    h100, l4 = Hardware.from_spec("h100-sxm"), Hardware.from_spec("l4")
    policy = current_policy()
    assert flash.tier_dq_kernel(flash.tier_for(h100), policy)
    assert not flash.tier_dq_kernel(flash.tier_for(l4), policy)
    expected = flash.tier_dq_kernel(flash.tier_for(hardware_of(device)), policy)
    assert flash.deterministic_backward(False, device) == expected
    assert flash.deterministic_backward(True, device)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 1, 17, 33, 16, F16, device))
    with Ran() as ran:
        flash_attention(q, k, v, is_causal=True).sum().backward()
    if runtime.triton_runs_on(device):
        assert ran.path() == ("deterministic" if expected else "atomic")


# (batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, is_causal, dtype)
CASES = [
    (2, 4, 2, 113, 129, 64, True, F16),  # GQA, ragged, seq_q < seq_kv
    (1, 2, 1, 129, 17, 40, True, F32),  # MQA: rows with no key
    (1, 2, 2, 33, 47, 128, False, BF16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"s{c[3]}x{c[4]}-d{c[5]}-{str(c[7])[6:]}")
def test_deterministic_path_matches_float64(case, device):
    b, hq, hkv, sq, skv, d, causal, dtype = case
    q, k, v = make_qkv(b, hq, hkv, sq, skv, d, dtype, device)
    with Ran() as ran:
        check_against_reference(
            functools.partial(flash_attention, deterministic=True), q, k, v, is_causal=causal
        )
    if runtime.triton_runs_on(device):
        assert ran.path() == "deterministic"


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_both_paths_with_small_blocks_window_and_softcap(deterministic, device, monkeypatch, policy):
    # 16 x 16 blocks: masked edges, unmasked interiors and skipped blocks on both sides of the window.
    atomic_by_default(policy)
    pin_configs(monkeypatch, forward=SMALL, backward=SMALL)
    q, k, v = make_qkv(1, 4, 2, 45, 40, 32, F16, device, scale_q=4.0)
    fn = functools.partial(flash_attention, deterministic=deterministic)
    with Ran() as ran:
        check_rule(fn, q, k, v, is_causal=True, window=(9, None), softcap=5.0)
        check_rule(fn, q, k, v, window=(None, 3))
    if runtime.triton_runs_on(device):
        assert ran.path() == ("deterministic" if deterministic else "atomic")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_both_paths_on_packed_sequences(deterministic, device, monkeypatch, policy):
    atomic_by_default(policy)
    # GQA over packed sequences (one with no query, lengths off the block), causal window with softcap.
    q, k, v, cu_q, cu_k = packed_inputs([40, 0, 23, 5], [33, 9, 23, 70], 4, 2, 32, F32, device)
    options = dict(is_causal=True, window=(7, None), softcap=4.0)
    dout = torch.randn(q.shape, dtype=q.dtype).to(device)
    dlse = torch.randn(q.shape[1], q.shape[0]).to(device)
    truth = dense_per_sequence(q, k, v, cu_q, cu_k, dout, dlse, torch.float64, **options)
    same = dense_per_sequence(q, k, v, cu_q, cu_k, dout, dlse, q.dtype, **options)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with Ran() as ran:
        out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, 40, 70, return_lse=True,
                                          deterministic=deterministic, **options)  # fmt: skip
        ((out * dout).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0).sum()).backward()
    got = (out.detach(), lse.detach(), *(t.grad for t in leaves))
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_error_rule(name, got[i], same[i], truth[i], 2.0 if i < 2 else 3.0, q.dtype)
    if runtime.triton_runs_on(device):
        assert ran.path() == ("deterministic" if deterministic else "atomic")


def test_torch_deterministic_mode_takes_the_deterministic_path(device, monkeypatch, policy):
    atomic_by_default(policy)
    q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 1, 17, 33, 16, F32, device))
    was = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    paths = []
    for fn in (flash_attention, tiled_attention):
        for mode in (False, True):
            torch.use_deterministic_algorithms(mode)
            try:
                with Ran() as ran:
                    fn(q, k, v, is_causal=True).sum().backward()
            finally:
                torch.use_deterministic_algorithms(was, warn_only=warn_only)
            paths.append(ran.path() if runtime.triton_runs_on(device) else None)
    if runtime.triton_runs_on(device):
        assert paths == ["atomic", "deterministic"] * 2


def test_deterministic_must_be_a_real_bool(device):
    q, k, v = make_qkv(1, 1, 1, 4, 4, 16, F32, device)
    with pytest.raises(TypeError, match="deterministic"):
        flash_attention(q, k, v, deterministic=1)


# (batch, heads_q, heads_kv, seq_q, seq_kv, head_dim, is_causal, dtype, halves): the atomic path takes the
# head dim in halves at 16-bit head dims padded to 128 (the H100's 64-row tiles), not at 64 or in float32
HALVES_CASES = [
    (1, 4, 2, 70, 75, 128, False, F16, True),  # GQA, ragged query and key blocks
    (1, 2, 2, 65, 130, 96, True, BF16, True),  # padded head dim: the second half is partly masked
    (2, 2, 1, 33, 40, 64, True, F16, False),
    (1, 2, 1, 20, 24, 128, False, F32, False),
]


@pytest.mark.parametrize("case", HALVES_CASES, ids=lambda c: f"d{c[5]}-{str(c[7])[6:]}-{'causal' * c[6]}")
def test_the_atomic_path_with_the_head_dim_in_halves_matches_float64(case, device, monkeypatch, policy):
    """With dQ by atomics the dK/dV kernel may take K, Q, dK and dQ's product in two halves of the head dim
    (``D_HALVES``: half the shared memory and registers for dQ's tile on its way to the atomics); gradients
    as float64 says either way."""
    b, hq, hkv, sq, skv, d, causal, dtype, halves = case
    atomic_by_default(policy)
    made = record_backward_plans(monkeypatch)
    q, k, v = make_qkv(b, hq, hkv, sq, skv, d, dtype, device)
    with Ran() as ran:
        check_against_reference(flash_attention, q, k, v, is_causal=causal)
    if runtime.triton_runs_on(device):
        assert ran.path() == "atomic"
        assert made[-1][1].fixed["ATOMIC_DQ"] and made[-1][1].fixed["D_HALVES"] == halves


def test_the_atomic_path_in_halves_on_packed_sequences(device, monkeypatch, policy):
    """Packed sequences (one with no query, lengths off the 64-row blocks, causal GQA) through the halves: the
    ragged rows' masks and the invalid-bounds NaN apply to both halves of dK."""
    atomic_by_default(policy)
    made = record_backward_plans(monkeypatch)
    q, k, v, cu_q, cu_k = packed_inputs([40, 0, 23, 70], [33, 9, 23, 70], 4, 2, 128, F16, device)
    dout = torch.randn(q.shape, dtype=q.dtype).to(device)
    dlse = torch.randn(q.shape[1], q.shape[0]).to(device)
    truth = dense_per_sequence(q, k, v, cu_q, cu_k, dout, dlse, torch.float64, is_causal=True)
    same = dense_per_sequence(q, k, v, cu_q, cu_k, dout, dlse, q.dtype, is_causal=True)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    with Ran() as ran:
        out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, 70, 70, return_lse=True, is_causal=True)
        ((out * dout).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0).sum()).backward()
    got = (out.detach(), lse.detach(), *(t.grad for t in leaves))
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert_error_rule(name, got[i], same[i], truth[i], 2.0 if i < 2 else 3.0, q.dtype)
    if runtime.triton_runs_on(device):
        assert ran.path() == "atomic" and made[-1][1].fixed["D_HALVES"] and made[-1][1].fixed["IS_VARLEN"]


def test_only_the_atomic_path_takes_the_head_dim_in_halves(monkeypatch, policy):
    """The dQ kernel's path (no dQ tile in the dK/dV kernel) and TMA's reductions keep the head dim whole."""
    from llm_speed.core import launch

    made = record_backward_plans(monkeypatch)
    with launch.simulated_gpu():
        q, k, v = (t.requires_grad_() for t in make_qkv(1, 2, 2, 128, 128, 128, F16, "cpu"))
        for deterministic in (True, False):  # the H100's tier: the dQ kernel either way
            flash_attention(q, k, v, deterministic=deterministic).sum().backward()
        policy(backward_tma_dq_add=True)
        flash_attention(q, k, v, is_causal=True).sum().backward()
    dkdv = [plans[1] for plans in made]
    assert [plan.fixed["ATOMIC_DQ"] for plan in dkdv] == [False, False, True]
    assert not any(plan.fixed["D_HALVES"] for plan in dkdv)
