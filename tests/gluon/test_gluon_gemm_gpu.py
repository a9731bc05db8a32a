"""GPU only (sm_90: H100, H200), run by the proof command: the Gluon GEMM itself against float64, under the
2x rule against ``torch.matmul``'s own error, over ragged and square shapes, both dtypes and both layouts of
``b``, with its output poisoned with NaN first (an element no program writes fails). A kernel that hangs
(a broken mbarrier protocol) hangs this process: run it in its own process with a timeout."""

from __future__ import annotations

import pytest
import torch

from accuracy_rule import OUTPUT_FACTOR, assert_error_rule, expect_launches, matmul_cap

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs a compute capability 9.0 GPU (H100, H200)",
    ),
]

# square, one element row, ragged on every side, and N of one 128-column tile (four ring slots)
SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (1, 8, 8), (127, 136, 72), (1000, 4104, 520),
          (4096, 128, 64)]  # fmt: skip


@pytest.fixture(autouse=True)
def _poison_outputs(nan_poisoned):
    """Kernel outputs start as NaN (tests/conftest.py)."""


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_against_float64(m, n, k, dtype, trans_b):
    from llm_speed.gluon.gemm import gemm

    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(*((n, k) if trans_b else (k, n)), device="cuda", dtype=dtype)
    b_ = b.T if trans_b else b
    with expect_launches("gluon_gemm", device=a.device):
        out = gemm(a, b, trans_b=trans_b)
    torch.cuda.synchronize()
    truth = a.double() @ b_.double()
    assert not out.isnan().any(), "an output element no program wrote"
    assert_error_rule("gluon gemm", out, a @ b_, truth, OUTPUT_FACTOR, cap=matmul_cap(dtype, truth, k))


def test_positive_inputs_and_repeatable():
    from llm_speed.gluon.gemm import gemm

    a = torch.rand(2048, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.rand(1024, 3072, device="cuda", dtype=torch.bfloat16)
    first = gemm(a, b)
    truth = a.double() @ b.double()
    assert_error_rule("gluon gemm", first, a @ b, truth, OUTPUT_FACTOR, cap=matmul_cap(a.dtype, truth, 1024))
    for _ in range(10):  # one program per tile and a fixed K order: bitwise the same every time
        assert torch.equal(gemm(a, b), first)
