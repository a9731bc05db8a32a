"""The attention kernels' row offsets (row * stride inside a tile), forward and backward: 32-bit where every
row of every tensor fits (``ROWS32``, fewer instructions a block on sm_90a), else 64-bit; both meet the
float64 rule."""

import functools

import pytest
import torch
from attention_testing import atomic_by_default, check_against_reference, make_qkv, record_backward_plans

from llm_speed import flash_attention
from llm_speed.attention import flash, launcher
from llm_speed.attention.options import MaskKey
from llm_speed.core import launch, runtime
from llm_speed.core.policy import current_policy


@pytest.fixture(autouse=True)
def _rows32(policy):
    """The launch choice these tests are about, unproven on a GPU and so off as shipped: selected here."""
    policy(rows32=True)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
LIMIT = 2**31 - 1


def test_rows_fit_32_counts_the_last_row_and_the_tile():
    """A [B, S, H, D] tensor steps H * D elements a row: its last row, the rows a ragged last tile reaches
    past it and the tile's columns must stay below 2**31; packed [T, H, D] tensors step stride[0] a row."""
    heads_dim, block_rows, block_d = 32 * 128, 128, 128
    fits = (LIMIT - block_d) // heads_dim - block_rows  # the most rows that fit
    dense = (fits * heads_dim, 128, heads_dim, 1)  # [B, H, S, D] strides of a seq-major view
    assert flash.rows_fit_32(False, [(fits, dense)], block_rows, block_d)
    assert not flash.rows_fit_32(False, [(fits + 1, dense)], block_rows, block_d)
    assert not flash.rows_fit_32(False, [(fits, dense)], block_rows + 1, block_d)  # a taller tile
    assert flash.rows_fit_32(True, [(fits, (heads_dim, 128, 1))], block_rows, block_d)
    assert not flash.rows_fit_32(True, [(fits + 1, (heads_dim, 128, 1))], block_rows, block_d)
    # one tensor past the bound is enough
    assert not flash.rows_fit_32(False, [(16, dense), (fits + 1, dense)], block_rows, block_d)
    assert flash.rows_fit_32(False, [], block_rows, block_d)  # no tensor: nothing to overflow


def _plans(seq: int, dtype: torch.dtype, varlen: bool = False):
    """The backward plans of a seq-major problem of ``seq`` tokens, 32 heads of 128 (shapes only)."""
    heads, d = 32, 128
    if varlen:
        shape, stride = (seq, heads, d), (heads * d, d, 1)
    else:
        shape, stride = (1, heads, seq, d), (seq * heads * d, d, heads * d, 1)
    batch = 1
    dtypes = (dtype, dtype, dtype, F32, None)
    return launcher.backward_plans(
        shape, shape, stride, stride, stride, stride, stride, batch, dtypes, False, MaskKey(True, None, 0),
        varlen, False, torch.device("cpu"), policy=current_policy(),
    )  # fmt: skip


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "packed"])
def test_the_backward_takes_32_bit_rows_only_where_they_fit(varlen):
    launch.clear_plans()
    try:
        # 16k tokens x 4096 elements a row: 2**26, far inside
        assert all(plan.fixed["ROWS32"] for plan in _plans(16384, BF16, varlen) if "ROWS32" in plan.fixed)
        assert sum("ROWS32" in plan.fixed for plan in _plans(16384, BF16, varlen)) >= 2
        # 2**19 tokens x 4096: 2**31, past it
        assert not any(plan.fixed.get("ROWS32") for plan in _plans(2**19, BF16, varlen))
        # float32 keeps 64-bit offsets (its packed dK/dV kernel fit one block per SM instead of two with them)
        assert not any(plan.fixed.get("ROWS32") for plan in _plans(16384, F32, varlen))
    finally:
        launch.clear_plans()


def _forward_plan(seq: int, dtype: torch.dtype, varlen: bool = False, two_pass: bool = False):
    """The forward plan of a seq-major problem like :func:`_plans`'."""
    heads, d = 32, 128
    if varlen:
        shape, stride = (seq, heads, d), (heads * d, d, 1)
    else:
        shape, stride = (1, heads, seq, d), (seq * heads * d, d, heads * d, 1)
    return launcher.forward_plan(
        shape, shape, stride, stride, stride, 1, dtype, MaskKey(True, None, 0), two_pass, varlen, False,
        torch.device("cpu"), lse=True, policy=current_policy(),
    )  # fmt: skip


@pytest.mark.parametrize(("varlen", "two_pass"), [(False, False), (True, False), (False, True)],
                         ids=["dense", "packed", "tiled"])  # fmt: skip
def test_the_forward_takes_32_bit_rows_only_where_they_fit(varlen, two_pass):
    launch.clear_plans()
    try:
        assert _forward_plan(16384, F16, varlen, two_pass).fixed["ROWS32"]
        assert not _forward_plan(2**19, F16, varlen, two_pass).fixed["ROWS32"]
        # float32: 64-bit (its packed kernels spilled in their loops with 32-bit offsets on sm_90a)
        assert not _forward_plan(16384, F32, varlen, two_pass).fixed["ROWS32"]
    finally:
        launch.clear_plans()


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_64_bit_rows_meet_the_rule_at_16_bit(deterministic, device, monkeypatch, policy):
    """16-bit problems small enough for 32-bit offsets, run with 64-bit ones (the path of sequences past
    2**31 / stride rows, and of the policy without ``rows32``), forward and both backward paths: the same
    float64 rule."""
    atomic_by_default(policy)
    policy(rows32=False)
    backward_plans = record_backward_plans(monkeypatch)
    forward_flags = []
    forward_plan = launcher.forward_plan

    def spy_forward(*args, **kwargs):
        plan = forward_plan(*args, **kwargs)
        forward_flags.append(plan.fixed["ROWS32"])
        return plan

    monkeypatch.setattr(launcher, "forward_plan", spy_forward)
    launch.clear_plans()
    try:
        q, k, v = make_qkv(1, 4, 2, 70, 70, 64, F16, device)
        before = runtime.launch_count(flash.BACKWARD_DKDV.name)
        check_against_reference(
            functools.partial(flash_attention, deterministic=deterministic), q, k, v, is_causal=True
        )
        ran = runtime.launch_count(flash.BACKWARD_DKDV.name) - before
    finally:
        launch.clear_plans()
    dkdv_flags = [plans[1].fixed["ROWS32"] for plans in backward_plans]  # the dK/dV kernel's
    assert forward_flags and dkdv_flags and not any(forward_flags + dkdv_flags)
    if runtime.triton_runs_on(device):
        assert ran > 0
