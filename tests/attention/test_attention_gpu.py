"""GPU-scale checks (seq 1k-16k, head_dim 64/128, fp16/bf16, causal and not). Run only with CUDA.

Long sequences cannot have a full float64 reference, so the forward is checked on a sample of query rows
(exact float64 for those rows against every key) with the 2x rule against PyTorch SDPA in the same dtype.
SDPA's causal mask is top-left; with seq_q == seq_kv it equals ours. The backward is checked in full at
1k-2k against float64 (computed on the GPU), and for bitwise determinism over 50 repeats.
"""

import pytest
import torch
from attention_testing import ERROR_CAP, check_against_reference, make_qkv, max_error, run_with_grads

from llm_speed import flash_attention
from llm_speed.attention.reference import reference_attention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SAMPLED_ROWS = 256


@pytest.mark.parametrize("seq", [1024, 4096, 16384])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_long_sequence_forward_on_sampled_rows(seq, head_dim, dtype, is_causal):
    q, k, v = make_qkv(1, 8, 2, seq, seq, head_dim, dtype, "cuda")
    out, lse = flash_attention(q, k, v, is_causal=is_causal, return_lse=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    rows = torch.randperm(seq, device="cuda")[:SAMPLED_ROWS].sort().values
    rows[-1] = seq - 1  # always include the last row (sees every key)
    # float64 truth for the sampled rows only: query row i with its causal limit (seq_q == seq_kv here).
    q64, k64, v64 = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k64, v64 = k64.repeat_interleave(group, 1), v64.repeat_interleave(group, 1)
    scores = (q64[:, :, rows] @ k64.transpose(-1, -2)) * head_dim**-0.5
    if is_causal:
        scores = scores.masked_fill(torch.arange(seq, device="cuda")[None, :] > rows[:, None], float("-inf"))
    truth = torch.softmax(scores, -1) @ v64
    err = max_error(out[:, :, rows], truth)
    err_sdpa = max_error(sdpa[:, :, rows], truth)
    assert err <= 2 * err_sdpa + ERROR_CAP[dtype], (err, err_sdpa)
    assert max_error(lse[:, :, rows], torch.logsumexp(scores, -1)) < 1e-3


@pytest.mark.parametrize("seq", [1024, 2048])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward_at_scale_matches_float64(seq, head_dim, dtype, is_causal):
    q, k, v = make_qkv(1, 4, 2, seq, seq, head_dim, dtype, "cuda")
    # float64 on the GPU: the CPU references took up to 60 s per case here (bf16 matmuls on the CPU)
    check_against_reference(flash_attention, q, k, v, is_causal=is_causal, reference_device="cuda")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("is_causal", [False, True])
def test_backward_with_tma_dq_additions_matches_float64(head_dim, is_causal, policy):
    """The policy's ``backward_tma_dq_add`` (measured slower, off by default): the five-matmul path with
    each dQ tile added by one TMA bulk reduction, checked as the shipped backward is."""
    policy(backward_tma_dq_add=True)
    q, k, v = make_qkv(2, 4, 2, 1024, 1024, head_dim, torch.bfloat16, "cuda")
    check_against_reference(flash_attention, q, k, v, is_causal=is_causal, reference_device="cuda")


def test_rectangular_causal_prefill_at_scale():
    # KV-cache prefill shape: 512 new queries against 4096 cached keys, bottom-right aligned.
    q, k, v = make_qkv(2, 8, 1, 512, 4096, 128, torch.bfloat16, "cuda")
    out = flash_attention(q, k, v, is_causal=True)
    truth = reference_attention(q[:1].double(), k[:1].double(), v[:1].double(), is_causal=True)
    same = reference_attention(q[:1], k[:1], v[:1], is_causal=True)
    assert max_error(out[:1], truth) <= 2 * max_error(same, truth) + ERROR_CAP[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_is_bitwise_deterministic_over_50_runs(dtype):
    # deterministic=True: every gradient element one writer; the default path adds dQ by float32 atomics, so
    # only its dQ may differ from run to run, by float32 reordering (well under one rounding of q's dtype).
    q, k, v = make_qkv(2, 8, 2, 1024, 1024, 128, dtype, "cuda")
    dout = torch.randn_like(q)
    for deterministic in (True, False):
        options = dict(is_causal=True, deterministic=deterministic)
        first = run_with_grads(flash_attention, q, k, v, dout, **options)
        for _ in range(50):
            again = run_with_grads(flash_attention, q, k, v, dout, **options)
            for i, (a, b) in enumerate(zip(first, again, strict=True)):
                if deterministic or i != 2:
                    assert torch.equal(a, b)
                else:
                    assert (a.float() - b.float()).abs().max() <= 2 * ERROR_CAP[dtype] * a.float().abs().max()
