"""The Gluon GEMM compiled for sm_90a on this CPU, exactly as :func:`llm_speed.gluon.gemm.gemm` launches it
on an H100 (the kernel report's capture and compile), by the GPU machine's Triton 3.6 and by the installed
one: it keeps every budget (:mod:`llm_speed.kernel_report.budgets`) and has the structure it is built for:
a one-warp TMA producer at <= 56 registers beside two consumer warpgroups at >= 224 (``setmaxnreg``),
warpgroup MMAs with one product kept in flight in the K loop, TMA loads and store, mbarrier waits, no
spills. The int8 variant too (int32 accumulator), beside the reason it exists: Triton's own int8 GEMM waits
for each product at once."""

from __future__ import annotations

import pytest

from llm_speed.kernel_report import budgets, report

pytestmark = pytest.mark.xdist_group("kernel_report")


@pytest.fixture(scope="module", params=["installed", "triton-3.6.0"])
def rows(request):
    build = None
    if request.param != "installed":
        build = report.gpu_build()
        if build is None:
            pytest.skip(
                f"the GPU machine's Triton is not unpacked ({report.GPU_BUILD_ENV} unset): `make test`"
            )
    result = report.run_report(gpu="h100-sxm", ops=["gluon_gemm", "gluon_gemm_int8"], workers=1, build=build,
                               timeout=300)  # fmt: skip
    if request.param != "installed":
        assert result["triton"] == "3.6.0"
    return result["rows"]


def test_it_keeps_every_budget(rows):
    failing, _ = budgets.check(rows)
    assert not failing, "\n".join(str(breach) for breach in failing)
    assert {problem for row in rows for problem in row["problems"]} == {
        "gluon_gemm: 4096^3 fp16",
        "gluon_gemm: 4096^3 bf16 b^T",
        "gluon_gemm_int8: 4096^3 int8 b^T -> int32",
    }


def test_a_producer_warp_and_two_consumer_warpgroups(rows):
    for row in rows:
        consumers, producer = row["partitions"]
        assert (consumers["name"], consumers["warps"]) == ("default", 8)
        assert consumers["registers"] >= budgets.CONSUMER_MIN_REGISTERS
        assert (producer["warps"], producer["registers"]) == (1, 24)
        assert "dec 24" in row["setmaxnreg"] and f"inc {consumers['registers']}" in row["setmaxnreg"]
        assert row["launched_warps"] == 12  # the producer's warp is launched as a whole warpgroup


def test_wgmma_fed_by_tma_with_a_product_in_flight(rows):
    for row in rows:
        int8 = row["problems"][0].startswith("gluon_gemm_int8")
        assert row["tensor_cores"] == ("IGMMA" if int8 else "HGMMA") and row["wgmma"]
        assert row["wgmma_wait"] == 1  # the K loop keeps one product in flight while it waits for a slot
        assert row["wgmma_in_flight"] > 0
        assert row["tma"] and row["tma_loads"] >= 2
        assert row["mbarrier_waits"] >= 2  # the producer's wait for an empty slot, the consumers' for data
        assert row["spill_instructions"] == 0 and row["spill_store_bytes"] == 0
        assert row["shared_bytes"] <= row["shared_limit"]
        assert row["config"] == ("M128 N128 K128 w8 s4" if int8 else "M128 N256 K64 w8 s3")


def test_triton_keeps_no_int32_product_in_flight():
    """Why the int8 variant exists: the same problem through llm-speed's Triton int8 GEMM waits for every
    product at once (Triton's pipeliner makes a dot async only with an fp32 accumulator: "Rule 2.1" of its
    WGMMAPipeline.cpp), where the Gluon kernel above keeps one in flight. If a Triton release lifts the rule,
    this fails: then the Triton kernel is to be measured again before the candidate."""
    build = report.gpu_build()
    if build is None:
        pytest.skip(f"the GPU machine's Triton is not unpacked ({report.GPU_BUILD_ENV} unset): `make test`")
    result = report.run_report(gpu="h100-sxm", ops=["tensor_core_gemm_int8"], workers=1, build=build,
                               timeout=300)  # fmt: skip
    (row,) = result["rows"]
    assert row["tensor_cores"] == "IGMMA" and row["wgmma_wait"] == 0 and not row["tma"]
