"""``warp_uniform``: a value every thread holds, made visible to ptxas as one (``redux.sync``), and the switch
that says where that compiles."""

import pytest
import torch
import triton
import triton.language as tl

from llm_speed.core import runtime
from llm_speed.core.hardware import Hardware, hardware_of
from llm_speed.core.kernel_math import uniform_switch, warp_uniform


@triton.jit
def _bounded_sum_kernel(X, N, Y, REDUX: tl.constexpr, BLOCK: tl.constexpr):
    # a loop bound that comes out of a reduction across lanes, as a packed sequence's length does
    o = tl.arange(0, BLOCK)
    n = warp_uniform(tl.sum(tl.load(N + o), 0), REDUX=REDUX)
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n, BLOCK):
        acc += tl.load(X + start + o, mask=start + o < n, other=0.0)
    tl.store(Y + o, acc)


@pytest.mark.skipif(
    not torch.cuda.is_available() and not runtime.INTERPRETED,
    reason="needs a CUDA GPU or TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)
def test_a_reduced_loop_bound_is_kept(device):
    x = torch.arange(100, dtype=torch.float32, device=device)
    lengths = torch.tensor([30, 40, 27, 0], dtype=torch.int32, device=device)  # 97 of the 100
    y = torch.full((4,), float("nan"), dtype=torch.float32, device=device)  # only the kernel writes it
    _bounded_sum_kernel[(1,)](x, lengths, y, REDUX=uniform_switch(hardware_of(device)), BLOCK=4)
    torch.testing.assert_close(y.sum().cpu(), x[:97].sum().cpu(), rtol=0, atol=0)


def test_the_switch_needs_compiled_ptx_on_sm_80_or_later(monkeypatch):
    h100, t4 = Hardware("h100", (9, 0), 227 * 1024, 132), Hardware("t4", (7, 5), 64 * 1024, 40)
    monkeypatch.setattr(runtime, "INTERPRETED", False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert uniform_switch(h100) and not uniform_switch(t4)
    monkeypatch.setattr(torch.version, "hip", "6.2")  # no PTX on ROCm
    assert not uniform_switch(h100)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(runtime, "INTERPRETED", True)  # the interpreter runs no inline assembly
    assert not uniform_switch(h100)
