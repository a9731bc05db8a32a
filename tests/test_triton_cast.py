"""float32 -> bfloat16 casts in kernels round to nearest even, under the interpreter as on a GPU."""

import pytest
import torch
import triton
import triton.language as tl

from llm_speed.core import runtime
from llm_speed.core.kernel_math import cast, rne_by_hand


@triton.jit
def _cast_kernel(X, Y, n, RNE_BY_HAND: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + o, mask=o < n)
    tl.store(Y + o, cast(x, Y.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=o < n)


@pytest.mark.skipif(
    not torch.cuda.is_available() and not runtime.INTERPRETED,
    reason="needs a CUDA GPU or TRITON_INTERPRET=1 (set by tests/conftest.py without a GPU)",
)
def test_bfloat16_cast_matches_torch_round_to_nearest_even(device):
    torch.manual_seed(0)
    x = torch.cat(
        [
            torch.randn(4000) * torch.logspace(-30, 30, 4000),
            # ties (exactly half an ulp) both ways, the largest finite values, infinities and NaN
            torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.3895e38, -3.3895e38]),
            torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0]),
        ]
    ).to(device)
    x[-1] = torch.tensor(-0.0)
    # a negative NaN whose high mantissa bits would carry past 32 bits when rounded
    x = torch.cat(
        [x, torch.tensor([0xFFFFFFFF], dtype=torch.int64).to(torch.int32).view(torch.float32).to(device)]
    )
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _cast_kernel[(triton.cdiv(x.numel(), 256),)](
        x, y, x.numel(), RNE_BY_HAND=rne_by_hand(torch.bfloat16), BLOCK=256
    )
    expected = x.to(torch.bfloat16)
    nan = expected.isnan()
    assert torch.equal(y.isnan(), nan)
    assert torch.equal(y[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_switch_is_on_for_bfloat16_under_the_interpreter_only():
    assert rne_by_hand(torch.bfloat16) == runtime.INTERPRETED
    assert not rne_by_hand(torch.float16)
    assert not rne_by_hand(torch.float32)
