"""No fused op reads tensor values on the host on the CUDA path (CUDA-graph ready): with the launches
stubbed (core.launch.simulated_gpu) and the value checks off, as on CUDA by default, every op runs forward
and backward with Tensor.item/tolist/bool/int/float/cpu/numpy/nonzero raising."""

import pytest
import torch

from llm_speed import apply_rotary, fused_linear_cross_entropy, rms_norm, swiglu
from llm_speed.core import launch, runtime

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero")


def _refuse(name):
    def read(self, *args, **kwargs):
        raise AssertionError(f"host read: Tensor.{name}")

    return read


def _ops():
    hidden, weight = torch.randn(8, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    target = torch.randint(0, 64, (8,))
    x = torch.randn(1, 2, 16, 16, requires_grad=True)
    cos, sin = torch.randn(16, 8), torch.randn(16, 8)
    gate, up = torch.randn(4, 64, requires_grad=True), torch.randn(4, 64, requires_grad=True)
    w = torch.randn(64, requires_grad=True)
    return {
        "swiglu": lambda: swiglu(gate, up),
        "apply_rotary": lambda: apply_rotary(x, cos, sin),
        "rms_norm": lambda: rms_norm(gate, w),
        **{
            f"fused_linear_cross_entropy[{r}]": (
                lambda r=r: fused_linear_cross_entropy(hidden, weight, target, reduction=r, chunk_rows=3)
            )
            for r in ("mean", "sum", "none")
        },
    }


@pytest.mark.parametrize("name", list(_ops()))
def test_no_host_reads_forward_and_backward(name, monkeypatch):
    call = _ops()[name]
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    with launch.simulated_gpu():
        out = call()  # the first call makes the plans
        grad = torch.ones_like(out)
        with monkeypatch.context() as reads:
            for read in READS:
                reads.setattr(torch.Tensor, read, _refuse(read))
            with torch.no_grad():
                call()
            call().backward(grad)
