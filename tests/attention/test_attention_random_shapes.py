"""Random shapes beyond the hand-picked covering set: the same 2x/3x rule on shapes drawn by hypothesis."""

import torch
from attention_testing import (
    BACKWARD_KERNELS,
    FORWARD_KERNELS,
    check_against_reference,
    expect_launches,
    make_qkv,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llm_speed import flash_attention

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    batch=st.integers(1, 2),
    heads_kv=st.integers(1, 2),
    group=st.integers(1, 3),
    seq_q=st.integers(1, 70),
    seq_kv=st.integers(1, 70),
    head_dim=st.sampled_from([8, 16, 24, 40, 56, 80, 104, 136]),
    is_causal=st.booleans(),
    dtype_index=st.integers(0, 2),
)
def test_random_shapes_match_float64(
    batch, heads_kv, group, seq_q, seq_kv, head_dim, is_causal, dtype_index, device
):
    torch.manual_seed(seq_q * 1000 + seq_kv)
    dtype = DTYPES[dtype_index]
    q, k, v = make_qkv(batch, heads_kv * group, heads_kv, seq_q, seq_kv, head_dim, dtype, device)
    with expect_launches(*FORWARD_KERNELS, *BACKWARD_KERNELS, device=device):
        check_against_reference(flash_attention, q, k, v, is_causal=is_causal)
