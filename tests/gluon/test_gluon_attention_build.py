"""The Gluon forward attention compiled for sm_90a on this CPU, exactly as
:func:`llm_speed.gluon.attention.forward` launches it on an H100 (the kernel report), by the GPU machine's
Triton 3.6: the two d = 128 variants at 4096 tokens (4-20 s of compile each), which keep every budget and
have the structure they are built for: a producer warpgroup (the default partition) at 24 registers and
two consumer warpgroups (4-warp workers) at 240, within the block's register pool; wgmma with the PV kept
in flight (``wait_group 1``) over the softmax; TMA loads; mbarrier waits; no spills. Not causal: 128 keys a
block, one key-block loop, no mask (the keys fill whole blocks: ``WHOLE_BLOCKS``); causal: 64 keys a
block, the blocks every row sees whole in a loop of their own without the mask (``SPLIT_MASK``), then the
masked ones."""

from __future__ import annotations

import pytest
from gluon_cases import compiled_rows

from llm_speed.kernel_report import budgets

pytestmark = pytest.mark.xdist_group("kernel_report")


@pytest.fixture(scope="module")
def rows():
    return compiled_rows("gluon_attention_fwd", 128, (False, True), "bf16")


@pytest.mark.parametrize("is_causal", [False, True])
def test_it_keeps_every_budget(rows, is_causal):
    row = rows[is_causal]
    failing, _ = budgets.check([row])
    assert not failing, "\n".join(str(breach) for breach in failing)
    assert row["problems"] == ["gluon_attention_fwd: d128 bf16 s4096 h16" + (" causal" if is_causal else "")]


def test_the_tiles_and_the_split_masking(rows):
    plain, causal = rows[False], rows[True]
    assert plain["config"] == "M128 N128 w4 s2" and plain["variant"] == "WHOLE_BLOCKS"  # 4096 keys: no mask
    assert causal["config"] == "M128 N64 w4 s2" and causal["variant"] == "IS_CAUSAL SPLIT_MASK"
    # one key-block loop a consumer (and the producer's) against two a consumer: the unmasked one shorter
    assert len(plain["inner_loop_instructions"]) == 3 and len(causal["inner_loop_instructions"]) == 5
    unmasked, masked = sorted(causal["inner_loop_instructions"])[2:4]
    assert unmasked + 50 < masked  # the causal mask's compares and selects: in the second loop only
    # not causal over whole blocks: no mask at all, under 4.5 instructions a key (4.8 masked, 6.1 at 64 keys)
    assert max(plain["inner_loop_instructions"]) < 4.5 * 128


@pytest.mark.parametrize("is_causal", [False, True])
def test_two_consumer_warpgroups_and_a_producer(rows, is_causal):
    producer, first, second = rows[is_causal]["partitions"]
    assert (producer["warps"], first["warps"], second["warps"]) == (4, 4, 4)
    assert first["registers"] == second["registers"] == 240 >= budgets.CONSUMER_MIN_REGISTERS
    assert producer["registers"] == 24
    assert rows[is_causal]["launched_warps"] == 12


@pytest.mark.parametrize("is_causal", [False, True])
def test_wgmma_fed_by_tma_with_the_pv_in_flight(rows, is_causal):
    row = rows[is_causal]
    assert row["tensor_cores"] == "HGMMA" and row["wgmma"]
    assert row["wgmma_wait"] == 1  # S retires while the PV stays in flight over the softmax
    assert row["wgmma_in_flight"] >= budgets.OVERLAP_MIN_INSTRUCTIONS  # the softmax beside it, not addresses
    assert row["tma"] and row["tma_loads"] >= 3  # Q, K, V
    assert row["mbarrier_waits"] >= 8  # ready, empty, Q and turn barriers
    assert row["spill_instructions"] == 0 and row["shared_bytes"] <= row["shared_limit"]
