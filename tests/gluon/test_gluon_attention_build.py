"""The Gluon forward attention compiled for sm_90a on this CPU, exactly as
:func:`llm_speed.gluon.attention.forward` launches it on an H100 (the kernel report), by the GPU machine's
Triton 3.6: one variant (d = 128, causal; 4-20 s of compile), which keeps every budget and has the
structure it is built for: a producer warpgroup (the default partition) at 24 registers and two consumer
warpgroups (4-warp workers) at 240, within the block's register pool; wgmma with the PV kept in flight
(``wait_group 1``) over the softmax; TMA loads; mbarrier waits; no spills."""

from __future__ import annotations

import pytest
from gluon_cases import compiled_row

from llm_speed.kernel_report import budgets

pytestmark = pytest.mark.xdist_group("kernel_report")


@pytest.fixture(scope="module")
def row():
    return compiled_row("gluon_attention_fwd", 128, True, "bf16")


def test_it_keeps_every_budget(row):
    failing, _ = budgets.check([row])
    assert not failing, "\n".join(str(breach) for breach in failing)
    assert row["problems"] == ["gluon_attention_fwd: d128 bf16 s4096 h16 causal"]
    assert row["config"] == "M128 N64 w4 s2" and row["variant"] == "IS_CAUSAL"


def test_two_consumer_warpgroups_and_a_producer(row):
    producer, first, second = row["partitions"]
    assert (producer["warps"], first["warps"], second["warps"]) == (4, 4, 4)
    assert first["registers"] == second["registers"] == 240 >= budgets.CONSUMER_MIN_REGISTERS
    assert producer["registers"] == 24
    assert row["launched_warps"] == 12


def test_wgmma_fed_by_tma_with_the_pv_in_flight(row):
    assert row["tensor_cores"] == "HGMMA" and row["wgmma"]
    assert row["wgmma_wait"] == 1  # S retires while the PV stays in flight over the softmax
    assert row["wgmma_in_flight"] >= budgets.OVERLAP_MIN_INSTRUCTIONS  # the softmax beside it, not addresses
    assert row["tma"] and row["tma_loads"] >= 3  # Q, K, V
    assert row["mbarrier_waits"] >= 8  # ready, empty, Q and turn barriers
    assert row["spill_instructions"] == 0 and row["shared_bytes"] <= row["shared_limit"]
