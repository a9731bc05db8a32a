"""GPU only (sm_90: H100, H200), run by the proof command: the Gluon forward attention itself against
float64, under the 2x rule against plain PyTorch in the inputs' dtype, over head dims 64, 128 and 256, causal or
not, MHA and GQA, ragged lengths both ways, fp16 and bf16, outputs poisoned with NaN first; the LSE against
float64; rows that see no key. A broken mbarrier protocol (the ping-pong turns, the rings) hangs the GPU
process: run it in its own process with a timeout."""

from __future__ import annotations

import pytest
import torch
from gluon_cases import HOPPER_ONLY, SHAPES

from accuracy_rule import OUTPUT_FACTOR, assert_error_rule, expect_launches, max_error
from llm_speed.attention.reference import reference_attention

pytestmark = HOPPER_ONLY


@pytest.fixture(autouse=True)
def _poison_outputs(nan_poisoned):
    """Kernel outputs start as NaN (tests/conftest.py)."""


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("batch", "heads", "heads_kv", "seq_q", "seq_kv"), SHAPES)
def test_against_float64(batch, heads, heads_kv, seq_q, seq_kv, head_dim, is_causal, dtype):
    from llm_speed.gluon.attention import forward

    q = torch.randn(batch, heads, seq_q, head_dim, device="cuda", dtype=dtype)
    k, v = (torch.randn(batch, heads_kv, seq_kv, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    with expect_launches("gluon_attention_fwd", device=q.device):
        out, lse = forward(q, k, v, is_causal=is_causal)
    torch.cuda.synchronize()
    truth, truth_lse = reference_attention(q.double(), k.double(), v.double(), is_causal=is_causal,
                                           return_lse=True)  # fmt: skip
    same_precision = reference_attention(q, k, v, is_causal=is_causal)
    assert not out.isnan().any(), "an output row no program wrote"
    assert_error_rule("gluon attention", out, same_precision, truth, OUTPUT_FACTOR, dtype)
    assert max_error(lse, truth_lse) <= 1e-3 * max(1.0, truth_lse.nan_to_num(0, 0, 0).abs().max().item())
