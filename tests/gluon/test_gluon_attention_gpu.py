"""GPU only (sm_90: H100, H200), run by the proof command: the Gluon forward attention itself against
float64, under the 2x rule against plain PyTorch in the inputs' dtype, over head dims 64, 128 and 256,
causal or not, MHA and GQA, ragged lengths both ways, fp16 and bf16, outputs poisoned with NaN first; the
LSE against float64; rows that see no key. fp8 (e4m3 with descales of each shape): against float64 over the
dequantized inputs, under the 2x rule against the fp8 reference (P rounded to e4m3 as the kernel does). A
broken mbarrier protocol (the ping-pong turns, the rings) hangs the GPU process: run it in its own process
with a timeout."""

from __future__ import annotations

import pytest
import torch
from gluon_cases import HOPPER_ONLY, SHAPES

from accuracy_rule import OUTPUT_FACTOR, assert_error_rule, expect_launches, max_error
from llm_speed.attention.reference import (
    dequantize_attention_inputs,
    reference_attention,
    reference_forward,
)

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


DESCALES = {"none": None, "tensor": lambda b, h: (), "head": lambda b, h: (h,), "batch": lambda b, h: (b, h)}
# (batch, heads, heads_kv, seq_q, seq_kv, descale shape): fp8's ragged keys (not a multiple of V^T's 16-byte
# rows) included; each shape with one kind of descale (the family's time cap)
FP8_SHAPES = [(2, 16, 16, 2048, 2048, "head"), (1, 8, 2, 300, 1000, "batch"), (3, 4, 1, 113, 127, "tensor"),
              (2, 4, 2, 129, 17, "none"), (1, 4, 2, 400, 50, "head")]  # fmt: skip  (the last: no-key tiles)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("batch", "heads", "heads_kv", "seq_q", "seq_kv", "descale"), FP8_SHAPES)
def test_fp8_against_float64(batch, heads, heads_kv, seq_q, seq_kv, descale, head_dim, is_causal):
    from llm_speed.gluon.attention import forward

    shape = DESCALES[descale]
    descales = tuple(None if shape is None else torch.rand(shape(batch, heads_kv), device="cuda") + 0.5
                     for _ in range(3))  # fmt: skip
    q = (torch.randn(batch, heads, seq_q, head_dim, device="cuda") * 2).to(torch.float8_e4m3fn)
    k, v = ((torch.randn(batch, heads_kv, seq_kv, head_dim, device="cuda") * 2).to(torch.float8_e4m3fn)
            for _ in range(2))  # fmt: skip
    with expect_launches("gluon_attention_fwd", device=q.device):
        out, lse = forward(q, k, v, is_causal=is_causal, descale_q=descales[0], descale_k=descales[1],
                           descale_v=descales[2])  # fmt: skip
    torch.cuda.synchronize()
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    scale = head_dim**-0.5  # (the references on the GPU too: float64 and float32 maths, e4m3 rounding)
    truth, truth_lse = reference_attention(*dequantize_attention_inputs(q, k, v, descales, torch.float64),
                                           is_causal=is_causal, scale=scale, return_lse=True)  # fmt: skip
    same, _ = reference_forward(q, k, v, is_causal=is_causal, window=None, softcap=None, scale=scale,
                                descales=descales)  # fmt: skip
    assert_error_rule("gluon fp8 attention", out, same, truth, OUTPUT_FACTOR, torch.bfloat16)
    # the fp8 tensor cores' accumulation keeps about 14 bits below the largest addend (tests/attention's fp8
    # tests): about 1e-4 of a score of 1
    assert max_error(lse, truth_lse) <= 1e-3 * max(1.0, truth_lse.nan_to_num(0, 0, 0).abs().max().item())


def test_fp8_a_negative_descale_gives_its_heads_nan(monkeypatch):
    # (not named "bad_": the proof leaves out tests matching benchmarks/proof_correctness.HOST_ONLY)
    from llm_speed.core import runtime
    from llm_speed.gluon.attention import forward

    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)  # no host read of the values

    q, k, v = ((torch.randn(2, 4, 100, 128, device="cuda")).to(torch.float8_e4m3fn) for _ in range(3))
    descale_k = torch.tensor([1.0, 1.0, -1.0, 1.0], device="cuda")  # per K/V head: the third is bad
    out, lse = forward(q, k, v, descale_k=descale_k)
    torch.cuda.synchronize()
    assert out[:, 2].isnan().all() and not out[:, [0, 1, 3]].isnan().any()


@pytest.mark.parametrize("is_causal", [False, True])
def test_a_neighbouring_heads_non_finite_values_stay_out(is_causal):
    # 100 rows: head 0's last query and key blocks are partial; through the 3-D descriptors they read zeros,
    # not head 1's rows (through a [B H S, D] view its weight-0 keys' inf values made head 0's rows NaN)
    from llm_speed.gluon.attention import forward

    q, k, v = (torch.randn(1, 2, 100, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    alone = forward(q[:, :1].contiguous(), k[:, :1].contiguous(), v[:, :1].contiguous(), is_causal=is_causal)
    q[:, 1], k[:, 1], v[:, 1] = float("nan"), float("inf"), float("inf")
    mixed = forward(q, k, v, is_causal=is_causal)
    torch.cuda.synchronize()
    for got, want in zip(mixed, alone, strict=True):
        assert torch.equal(got[:, :1], want)
