"""Ring attention on 2 and 4 CPU processes (gloo on localhost), against float64 and single-device flash.

Each spawn runs several cases (starting a rank costs seconds: it imports torch and Triton), every spawn has a
timeout. The cases cover both layouts, causal and not, MHA/GQA/MQA, fp32/bf16/fp16, sequence lengths that
split evenly and lengths that do not (13 over 4 zigzag chunks, 19 over 8), gradients through the LSE too.
"""

import pytest
import torch
from ring_checks import Case, accuracy_and_subgroups, accuracy_bad_input_overlap
from ring_workers import run_ranks

from llm_speed.distributed import gather_sequence, ring_attention, shard_sequence


def test_ring_attention_two_ranks_then_bad_input_and_overlap():
    """Accuracy, then bad input raising on every rank without a hang (a good call still works after it),
    then each transfer started before a kernel and waited on after it."""
    cases = (
        Case("zigzag", True, torch.float32, heads_q=4, heads_kv=2, seq=13),
        Case("contiguous", False, torch.bfloat16, heads_q=2, heads_kv=2, seq=16),
        Case("zigzag", False, torch.float16, heads_q=2, heads_kv=1, seq=8),
    )
    run_ranks(accuracy_bad_input_overlap, 2, cases)


def test_ring_attention_four_ranks_then_two_subgroup_rings():
    cases = (
        Case("zigzag", True, torch.bfloat16, heads_q=4, heads_kv=1, seq=19),
        Case("contiguous", True, torch.float32, heads_q=4, heads_kv=2, seq=16),
    )
    run_ranks(accuracy_and_subgroups, 4, cases)


@pytest.mark.parametrize(
    "call",
    [
        lambda x: ring_attention(x, x, x),
        lambda x: shard_sequence(x),
        lambda x: gather_sequence(x),
    ],
)
def test_no_process_group_is_a_clear_error(call):
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="init_process_group"):
        call(torch.randn(1, 1, 4, 8))
