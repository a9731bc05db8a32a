"""The Gluon attention backward compiled for sm_90a on this CPU, exactly as
:func:`llm_speed.gluon.attention_bwd.backward` launches it on an H100 (the kernel report), by the GPU
machine's Triton 3.6: one variant (d = 128, not causal, bf16; 2-4 s of compile), which keeps every budget and
has the structure it is built for: a producer warpgroup (the default partition) at 24 registers beside two
consumer warpgroups at 240, within the block's register pool; S and dP issued together with dP kept in
flight (``wait_group 1``) over the softmax; TMA loads of K, V, Q and dO; mbarrier waits; no spills.
``llm-speed kernels --op gluon_attention_bwd`` reports the other variants."""

from __future__ import annotations

import pytest
from gluon_cases import compiled_row

from llm_speed.kernel_report import budgets

pytestmark = pytest.mark.xdist_group("kernel_report")


@pytest.fixture(scope="module")
def row():
    return compiled_row("gluon_attention_bwd", 128, False, "bf16")


def test_it_keeps_every_budget(row):
    failing, _ = budgets.check([row])
    assert not failing, "\n".join(str(breach) for breach in failing)
    assert row["problems"] == ["gluon_attention_bwd: d128 bf16 s4096 h16"]
    assert row["config"] == "M64 N128 w4 s2" and row["variant"] == ""


def test_a_producer_and_two_consumer_warpgroups(row):
    producer, first, second = row["partitions"]
    assert (producer["warps"], first["warps"], second["warps"]) == (4, 4, 4)
    assert producer["registers"] == 24  # what the pool leaves the default partition
    assert first["registers"] == second["registers"] == 240
    assert row["launched_warps"] == 12 and 24 + 2 * 240 <= row["registers"] * 3


def test_wgmma_fed_by_tma_with_dp_in_flight(row):
    assert row["tensor_cores"] == "HGMMA" and row["wgmma"] and not row["wgmma_serialized"]
    assert row["wgmma_wait"] == 1  # S retires while dP stays in flight over the softmax
    assert row["wgmma_in_flight"] >= 80  # exp2, the masks and the LSE loads beside dP
    assert row["tma"] and row["tma_loads"] >= 4  # K and V halves, Q, dO
    assert row["mbarrier_waits"] >= 4  # K/V ready, Q ready, dO ready, empty
    assert row["spill_instructions"] == 0 and row["shared_bytes"] <= row["shared_limit"]
