"""GPU only (sm_90: H100, H200), run by the proof command: the Gluon int8 GEMM (:func:`llm_speed.gluon.gemm.
gemm_int8`) exact against the integer product over ragged and square shapes, its output poisoned first (an
element no program writes fails); int32 wraparound as ``torch._int_mm``'s; and ``tensor_core_gemm_int8``
under the candidate ``gluon-gemm-int8`` launching it. A kernel that hangs (a broken mbarrier protocol) hangs
this process: run it in its own process with a timeout."""

from __future__ import annotations

import pytest
import torch
from gluon_cases import HOPPER_ONLY

from accuracy_rule import expect_launches

pytestmark = HOPPER_ONLY

# square, one row, ragged on every side, K of one 128-wide step and of many, N of one 128-column tile
SHAPES = [(4096, 4096, 4096), (1, 4, 16), (127, 132, 400), (1000, 4104, 528), (4096, 128, 128),
          (300, 520, 8192)]  # fmt: skip


def _int8(*shape):
    return torch.randint(-128, 128, shape, dtype=torch.int8, device="cuda")


def _exact(a, b_nk):
    """The integer product, wrapped to int32 (float64 holds every partial sum exactly below 2**53)."""
    return (a.double() @ b_nk.double().T).to(torch.int64).to(torch.int32)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_exact(m, n, k, nan_poisoned):
    """The output starts as int32's minimum (tests/conftest.py), which no exact product here reaches."""
    from llm_speed.gluon.gemm import gemm_int8

    a, b = _int8(m, k), _int8(n, k)
    with expect_launches("gluon_gemm", device=a.device):
        out = gemm_int8(a, b)
    torch.cuda.synchronize()
    assert torch.equal(out, _exact(a, b))


def test_wraps_as_int_mm_and_is_repeatable():
    """(Not poisoned: the wrapped sum is int32's minimum itself.)"""
    from llm_speed.gluon.gemm import gemm_int8

    # (32 rows: torch._int_mm on CUDA takes more than 16)
    a = torch.full((32, 131072), -128, dtype=torch.int8, device="cuda")
    b = torch.full((16, 131072), -128, dtype=torch.int8, device="cuda")
    out = gemm_int8(a, b)
    assert torch.equal(out, torch._int_mm(a, b.T.contiguous().T))  # 2**31 wraps to -2**31 in both
    a, b = _int8(2048, 1024), _int8(3072, 1024)
    first = gemm_int8(a, b)
    for _ in range(10):
        assert torch.equal(gemm_int8(a, b), first)


def test_the_candidate_routes_tensor_core_gemm_int8():
    """Under ``gluon-gemm-int8`` an nn.Linear-layout call (b = w.T) runs the Gluon kernel, exactly, also when
    repeated (no kept Triton call); a batched call stays on Triton."""
    from llm_speed.core.policy import use_policy
    from llm_speed.matmul.gemm import tensor_core_gemm_int8

    a, w = _int8(1000, 528), _int8(4104, 528)
    with use_policy("gluon-gemm-int8"):
        for _ in range(2):
            with expect_launches("gluon_gemm", device=a.device):
                out = tensor_core_gemm_int8(a, w.T)
            assert torch.equal(out, _exact(a, w))
        batched = _int8(2, 64, 32), _int8(2, 32, 48)
        with expect_launches("matmul.gemm_tiled", device=a.device):
            tensor_core_gemm_int8(*batched)
