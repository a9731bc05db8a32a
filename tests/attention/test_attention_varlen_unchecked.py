"""Packed sequences whose ``cu_seqlens`` are invalid, with the host-side value check off (as on a GPU by
default, where reading them would wait for the device): the kernels find every sequence's rows on the device,
never read or write outside the tensors, write NaN over the output and LSE rows of each sequence whose bounds
are invalid, and leave the other sequences exactly as a call on them alone computes them.

"Outside" is checked with guard bands: every kernel output and every input is the middle of a larger buffer
whose margins hold a sentinel, compared after the call; kernel outputs start as NaN, so a row nobody wrote
shows too.
"""

import pytest
import torch
from attention_testing import atomic_by_default

from llm_speed.attention import flash, flash_attention_varlen
from llm_speed.core import runtime, tensors

MARGIN = 64  # elements of guard band on each side of every buffer (256 bytes of float32: alignment kept)
SENTINEL = 12345.0
HEADS_Q, HEADS_KV, HEAD_DIM = 2, 1, 16
LENGTHS_Q, LENGTHS_K = [5, 7, 4, 6], [6, 3, 8, 5]  # valid bounds: q [0, 5, 12, 16, 22], k [0, 6, 9, 17, 22]


def _guarded(shape, dtype, device, fill):
    """A tensor of ``shape`` filled with ``fill``, in the middle of a buffer whose margins hold SENTINEL (or,
    for integers, a value no index reaches), and the buffer."""
    numel = 1
    for size in shape:
        numel *= size
    sentinel = SENTINEL if dtype.is_floating_point else torch.iinfo(dtype).min
    buffer = torch.full((numel + 2 * MARGIN,), sentinel, dtype=dtype, device=device)
    view = buffer[MARGIN : MARGIN + numel].view(shape)
    view.copy_(fill if isinstance(fill, torch.Tensor) else torch.full(shape, fill, dtype=dtype))
    return view, buffer


def _margins_intact(buffer) -> bool:
    sentinel = SENTINEL if buffer.dtype.is_floating_point else torch.iinfo(buffer.dtype).min
    return bool((buffer[:MARGIN] == sentinel).all() and (buffer[-MARGIN:] == sentinel).all())


@pytest.fixture
def guarded_outputs(monkeypatch):
    """Every kernel output NaN inside guard bands; yields the list of their buffers. The value check of
    cu_seqlens is off, as on a GPU."""
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    buffers = []

    def new_output(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
        view, buffer = _guarded(tuple(shape), dtype, device, fill)
        buffers.append(buffer)
        return view

    monkeypatch.setattr(tensors, "new_output", new_output)
    return buffers


def _inputs(device, dtype=torch.float32):
    total_q, total_k = sum(LENGTHS_Q), sum(LENGTHS_K)
    made = [
        _guarded((total, heads, HEAD_DIM), dtype, device, torch.randn(total, heads, HEAD_DIM).to(dtype))
        for total, heads in ((total_q, HEADS_Q), (total_k, HEADS_KV), (total_k, HEADS_KV))
    ]
    return [view for view, _ in made], [buffer for _, buffer in made]


def _cu(values, device):
    return _guarded((len(values),), torch.int32, device, torch.tensor(values, dtype=torch.int32))


def _alone(q, k, v, rows, keys, dout, **options):
    """(out, lse, dq, dk, dv) of one sequence run on its own (valid cu_seqlens), detached."""
    leaves = [t[s].detach().clone().requires_grad_() for t, s in ((q, rows), (k, keys), (v, keys))]
    device = q.device
    cu_q = torch.tensor([0, rows.stop - rows.start], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, keys.stop - keys.start], dtype=torch.int32, device=device)
    out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, 64, 64, return_lse=True, **options)
    grads = torch.autograd.grad(out, leaves, dout[rows])
    return out.detach(), lse.detach(), *grads


# (id, cu_seqlens_q, cu_seqlens_k, is_causal, query rows that must be NaN, sequences that must be exact)
CASES = [
    # entry 3 of cu_q (9) goes back: sequence 2 ([12, 9)) owns nothing, sequence 3 ([9, 22)) overlaps
    # sequence 1 and is invalid: it owns rows 12..21
    ("decreasing", [0, 5, 12, 9, 22], [0, 6, 9, 17, 22], True, range(12, 22), (0, 1)),
    # the last entry of cu_q is past the 22 rows: sequence 3 owns rows 16..21
    ("last-past-total", [0, 5, 12, 16, 30], [0, 6, 9, 17, 22], False, range(16, 22), (0, 1, 2)),
    # a negative entry of cu_k: sequences 0 ([0, -3)) and 1 ([-3, 9)) are invalid, their queries 0..11 NaN
    ("negative", [0, 5, 12, 16, 22], [0, -3, 9, 17, 22], True, range(0, 12), (2, 3)),
    # cu_q starts at 2: sequence 0 owns rows 0..4
    ("first-not-zero", [2, 5, 12, 16, 22], [0, 6, 9, 17, 22], False, range(0, 5), (1, 2, 3)),
    # the last entry of cu_k is short of the 22 keys and an entry is past it
    ("k-past-and-short", [0, 5, 12, 16, 22], [0, 6, 40, 17, 20], True, range(5, 22), (0,)),
    # the last entry of cu_q (20) is short of the 22 rows, all else valid: sequence 3 owns rows 16..21
    ("q-short", [0, 5, 12, 16, 20], [0, 6, 9, 17, 22], False, range(16, 22), (0, 1, 2)),
    # the last entry of cu_k (20) is short of the 22 keys, all else valid: sequence 3's queries are NaN
    ("k-short", [0, 5, 12, 16, 22], [0, 6, 9, 17, 20], True, range(16, 22), (0, 1, 2)),
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic-dq", "dq-kernel"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_invalid_bounds_give_nan_rows_and_nothing_out_of_bounds(
    case, deterministic, device, guarded_outputs, monkeypatch, policy
):
    if not deterministic:
        atomic_by_default(policy)
    _, values_q, values_k, is_causal, nan_rows, exact = case
    (q, k, v), input_buffers = _inputs(device)
    (cu_q, cu_q_buffer), (cu_k, cu_k_buffer) = _cu(values_q, device), _cu(values_k, device)
    before = [b.clone() for b in (*input_buffers, cu_q_buffer, cu_k_buffer)]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    dout = torch.randn(q.shape, device=device)
    launches = runtime.launch_counts()

    options = dict(is_causal=is_causal, deterministic=deterministic)
    out, lse = flash_attention_varlen(*leaves, cu_q, cu_k, 64, 64, return_lse=True, **options)
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)

    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    ran = runtime.launch_counts() - launches
    dq_kernel = flash.BACKWARD_DQ if deterministic else flash.BACKWARD_DQ_CONVERT
    assert ran[flash.FORWARD.name] == 1 and ran[dq_kernel.name] == 1
    # nothing written outside any output, nothing written to the inputs or cu_seqlens
    assert guarded_outputs and all(_margins_intact(b) for b in guarded_outputs)
    for a, b in zip(before, (*input_buffers, cu_q_buffer, cu_k_buffer), strict=True):
        assert torch.equal(a, b)
    # NaN over the rows of the invalid sequences, forward
    nan = torch.zeros(q.shape[0], dtype=torch.bool)
    nan[list(nan_rows)] = True
    assert torch.isnan(out[nan]).all() and torch.isnan(lse[:, nan]).all()
    assert not torch.isnan(out[~nan]).any() and not torch.isnan(lse[:, ~nan]).any()
    # every other sequence exactly as computed on its own, forward and backward
    for b in exact:
        rows, keys = slice(*values_q[b : b + 2]), slice(*values_k[b : b + 2])
        alone = _alone(q, k, v, rows, keys, dout, **options)
        assert torch.equal(out[rows], alone[0]) and torch.equal(lse[:, rows], alone[1]), b
        assert torch.equal(dq[rows], alone[2]), b
        assert torch.equal(dk[keys], alone[3]) and torch.equal(dv[keys], alone[4]), b


def test_rows_without_any_sequence_are_nan(device, guarded_outputs):
    # cu_seqlens [0] describes no sequence; 5 packed rows cannot belong to any: NaN, nothing launched.
    (q, k, v), _ = _inputs(device)
    cu = torch.zeros(1, dtype=torch.int32, device=device)
    out, lse = flash_attention_varlen(q, k, v, cu, cu, 0, 0, return_lse=True)
    assert torch.isnan(out).all() and torch.isnan(lse).all()


def test_no_key_at_all_still_marks_invalid_query_bounds(device, guarded_outputs):
    # 22 queries and no key: valid sequences give 0 and -inf; sequence 1 of cu_q ([5, 30)) is invalid.
    (q, _, _), _ = _inputs(device)
    k = v = torch.empty(0, HEADS_KV, HEAD_DIM, device=device)
    cu_q = torch.tensor([0, 5, 30], dtype=torch.int32, device=device)
    cu_k = torch.zeros(3, dtype=torch.int32, device=device)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, 64, 0, return_lse=True)
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    assert (out[:5] == 0).all() and (lse[:, :5] == float("-inf")).all()
    assert torch.isnan(out[5:]).all() and torch.isnan(lse[:, 5:]).all()


def test_the_value_check_runs_where_check_values_says(device, monkeypatch):
    (q, k, v), _ = _inputs(device)
    bad = torch.tensor([0, 5, 12, 9, 22], dtype=torch.int32, device=device)
    good = torch.tensor([0, 6, 9, 17, 22], dtype=torch.int32, device=device)
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        flash_attention_varlen(q, k, v, bad, good, 64, 64)
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    out = flash_attention_varlen(q, k, v, bad, good, 64, 64)  # no check: NaN rows instead
    if runtime.triton_runs_on(device):
        assert torch.isnan(out[12:]).all() and not torch.isnan(out[:12]).any()


def test_max_seqlen_is_checked_where_values_are_and_otherwise_unused(device, monkeypatch):
    # max_seqlen_q/k (flash-attn's arguments) below the longest sequence: a ValueError where the values are
    # checked; unchecked (CUDA's default) nothing depends on them (the grid comes from the totals), so the
    # call gives exactly the result of one with the right values.
    (q, k, v), _ = _inputs(device)
    cu_q = torch.tensor([0, 5, 12, 16, 22], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 6, 9, 17, 22], dtype=torch.int32, device=device)
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)
    with pytest.raises(ValueError, match="max_seqlen_q is 4 but cu_seqlens_q has a sequence of length 7"):
        flash_attention_varlen(q, k, v, cu_q, cu_k, 4, 8)
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    want = flash_attention_varlen(q, k, v, cu_q, cu_k, 7, 8, is_causal=True, return_lse=True)
    got = flash_attention_varlen(q, k, v, cu_q, cu_k, 4, 1, is_causal=True, return_lse=True)
    assert not want[0].isnan().any()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
