"""bf16 GEMM outputs round to nearest even, under the interpreter as compiled on a GPU.

On positive inputs every product is positive, so an output rounded by truncation (the interpreter's
float32 -> bfloat16 conversion) is low by half a bf16 ulp on average: a bias the 2x rule alone misses.
"""

import torch
from matmul_helpers import assert_gemm_accurate

from llm_speed import gemm
from llm_speed.core import runtime
from llm_speed.matmul.gemm_kernels import PERSISTENT_TMA_KERNEL, TILED_KERNEL


def test_bf16_output_rounds_to_nearest_even_on_positive_inputs(device):
    a = torch.rand(64, 96, device=device).to(torch.bfloat16)
    b = torch.rand(96, 80, device=device).to(torch.bfloat16)
    kernels = (TILED_KERNEL, PERSISTENT_TMA_KERNEL)  # a Hopper GPU takes the TMA kernel

    def launches():
        return sum(runtime.launch_counts().get(name, 0) for name in kernels)

    before = launches()
    out = gemm(a, b)
    assert launches() == before + 1
    assert_gemm_accurate(out, a, b)
    exact = a.double() @ b.double()
    # Rounded to nearest, almost every element equals float64's product rounded once (the fp32
    # accumulation can move a value that sits on a rounding boundary); truncation gets about half.
    same = (out.cpu() == exact.cpu().to(torch.bfloat16)).float().mean().item()
    assert same > 0.95, f"only {same:.0%} of the outputs are the float64 product rounded to nearest"
    # And no bias: the mean signed error is a small fraction of an ulp (truncation: about -1/2 ulp).
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs().mean().item()
    bias = (out.cpu().double() - exact.cpu()).mean().item()
    assert abs(bias) < 0.1 * ulp, f"mean error {bias:.3g} is {bias / ulp:.2f} ulp"
