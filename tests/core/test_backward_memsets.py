"""A backward zeroes no tensor nobody reads: an output no gradient reaches (an LSE, an rstd, a z-loss) gets
None rather than a tensor of zeros, and an op without a bias returns no zeroed bias gradient. On a GPU each
such tensor is an allocation and a memset launch per backward.

Every differentiable public op of tests/core/test_no_host_reads.py runs forward and backward on CPU tensors
taking the CUDA code path with the launches stubbed (``core.launch.simulated_gpu``), under torch.profiler.
"""

from __future__ import annotations

import pytest
import torch
from test_no_host_reads import CASES, NOT_DIFFERENTIABLE
from torch.profiler import ProfilerActivity, profile

from llm_speed.core import launch, runtime

ZEROING = {"aten::zeros", "aten::zeros_like", "aten::new_zeros"}


@pytest.mark.parametrize("name", [name for name in CASES if name not in NOT_DIFFERENTIABLE])
def test_backward_zeroes_nothing_nobody_reads(name, monkeypatch):
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    call = CASES[name](True)
    with launch.simulated_gpu():
        for _ in range(2):  # the first call makes the plans, the second takes the direct path
            out = call()
            out = out[0] if isinstance(out, tuple) else out
            grad = torch.ones_like(out) if out.dim() else None
            before = runtime.launch_counts()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                torch.autograd.backward(out, grad)
            zeroing = sorted({event.name for event in prof.events()} & ZEROING)
            assert not zeroing, f"{name}: the backward ran {zeroing}"
    assert runtime.launch_counts() - before, f"{name}: no backward kernel launched"
