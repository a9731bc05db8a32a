"""Reading a compiled kernel (``llm_speed.kernel_report.analysis``) on small hand-written listings: loops
from backward branches, spills inside them, tensor-core kinds, TMA, wgmma waits in PTX loops, occupancy."""

from llm_speed.kernel_report import analysis

SASS = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1], R2 ;
        /*0020*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ ;
        /*0030*/                   LDL R3, [R1+0x4] ;
        /*0040*/              @P0  BRA 0x20 ;
        /*0050*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0060*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0070*/                   EXIT ;
"""

PTX = """
$L__BB0_1:
	wgmma.commit_group.sync.aligned;
	wgmma.wait_group.sync.aligned 1;
	cp.async.wait_group 2;
	@%p1 bra 	$L__BB0_1;
	wgmma.wait_group.sync.aligned 0;
"""


def test_sass_loops_spills_and_instruction_kinds():
    code = analysis.Sass.parse(SASS)
    assert code.loops() == [(0x20, 0x40)]
    assert code.spill_instructions() == 2 and code.spills_in_loops() == 1  # the STL is before the loop
    assert code.innermost_loops() == [(0x20, 0x40)]
    assert code.tensor_cores() == ["HGMMA", "HMMA"]  # wgmma kinds first
    assert code.uses_tma()


def test_spills_between_nested_loops_are_not_inner():
    # An outer loop (0x10-0x60) around an inner one (0x20-0x40): the STL/LDL around the inner loop run once
    # per outer iteration, the LDL inside it once per inner iteration.
    code = analysis.Sass.parse("""
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   STL [R1], R2 ;
        /*0020*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ ;
        /*0030*/                   LDL R3, [R1+0x4] ;
        /*0040*/              @P0  BRA 0x20 ;
        /*0050*/                   LDL R2, [R1] ;
        /*0060*/              @P1  BRA 0x10 ;
        /*0070*/                   EXIT ;
""")
    assert sorted(code.loops()) == [(0x10, 0x60), (0x20, 0x40)]
    assert code.innermost_loops() == [(0x20, 0x40)]
    assert code.spills_in_loops() == 3 and code.spills_in_loops(code.innermost_loops()) == 1
    assert code.innermost_loop_lengths() == [3]  # what one inner iteration issues


def test_the_closing_self_branch_is_no_loop():
    # every kernel ends so; it was counted as a loop (a loop-free rms_norm read "loops: 1"; audit 11)
    closing = "        /*0080*/                   BRA 0x80 ;\n"
    code = analysis.Sass.parse(SASS + closing)
    assert code.loops() == code.innermost_loops() == [(0x20, 0x40)]
    assert code.innermost_loop_lengths() == [3]


def test_a_retry_block_after_a_predicated_exit_is_no_loop_and_spins_are_not_work():
    # The persistent TMA GEMM's layout (audit 11): its tile loop ends in a predicated EXIT and a branch back,
    # the K loop's mbarrier retry sits after it and jumps back into the K loop. It was a "loop" spanning the
    # K loop's second half and the whole epilogue (spills there would have read as in a loop), and the retry
    # spin was listed among the innermost loops.
    code = analysis.Sass.parse("""
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0020*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], RZ ;
        /*0030*/              @!P3 BRA 0x90 ;
        /*0040*/                   HGMMA.64x128x16.F32 R24, gdesc[UR4], R24 ;
        /*0050*/              @P3  BRA 0x20 ;
        /*0060*/                   STL [R1], R24 ;
        /*0070*/              @P4  EXIT ;
        /*0080*/                   BRA 0x10 ;
        /*0090*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR4], R2 ;
        /*00a0*/              @!P3 BRA 0x90 ;
        /*00b0*/                   BRA 0x40 ;
        /*00c0*/                   BRA 0xc0 ;
""")
    assert code.loops() == [(0x10, 0x80), (0x20, 0x50), (0x90, 0xA0)]
    assert code.is_spin((0x90, 0xA0)) and not code.is_spin((0x20, 0x50))
    assert code.innermost_loops() == [(0x20, 0x50)] and code.innermost_loop_lengths() == [4]
    assert code.spills_in_loops() == 1 and code.spills_in_loops(code.innermost_loops()) == 0


def test_out_of_line_blocks_jumping_back_are_not_loops():
    # A TMA load's mbarrier wait retries in a block after EXIT (0x80-0x90) that jumps back into the loop
    # (0x10-0x40): not a loop spanning the rest of the function; its own retry (0x80) is one. A predicated
    # EXIT inside a loop keeps the loop.
    code = analysis.Sass.parse("""
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0020*/              @!P2 BRA 0x80 ;
        /*0030*/              @P3  EXIT ;
        /*0040*/              @P0  BRA 0x10 ;
        /*0050*/                   LDL R2, [R1] ;
        /*0060*/                   STG.E [R4], R2 ;
        /*0070*/                   EXIT ;
        /*0080*/              @!P2 BRA 0x80 ;
        /*0090*/                   BRA 0x30 ;
""")
    assert sorted(code.loops()) == [(0x10, 0x40), (0x80, 0x80)]
    assert code.spills_in_loops() == 0  # the LDL after the loop


def test_ptx_waits_inside_loops():
    waits = analysis.ptx_waits(PTX)
    assert (waits.wgmma, waits.cp_async, waits.wgmma_outside) == (1, 2, 1)
    assert analysis.ptx_waits("wgmma.wait_group.sync.aligned 0;").wgmma is None  # no loop


OVERLAPPED = """
$L__BB0_1:
	wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%r1}, %rd1, %rd2, 0, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;
	wgmma.wait_group.sync.aligned 0;
	wgmma.fence.sync.aligned;
	wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {%r2}, %rd3, %rd4, 0, 1, 1, 0, 0;
	wgmma.commit_group.sync.aligned;
	.loc	1 2 3
	ex2.approx.ftz.f32 	%r3, %r4;
	ex2.approx.ftz.f32 	%r5, %r6;
	// a comment
	add.s32 	%r7, %r7, 1;
	@%p1 bra 	$L__BB0_1;
	wgmma.wait_group.sync.aligned 0;
"""


def test_wgmma_overlap_counts_instructions_beside_a_product_in_flight():
    # The second product stays in flight over the two exp2s, the add and the branch, round the back edge
    # to the first product's wait; the first is waited for at once. Directives, comments and wgmma
    # instructions do not count.
    assert analysis.wgmma_overlap(OVERLAPPED) == 4
    assert analysis.wgmma_overlap(PTX) == 0  # committed, then waited for
    assert analysis.wgmma_overlap("wgmma.commit_group.sync.aligned;") is None  # no loop


def test_ptxas_log_and_occupancy():
    log = "ptxas info : Used 255 registers, 48 bytes stack frame, 44 bytes spill stores, 52 bytes spill loads"
    assert analysis.ptxas_usage(log) == {
        "registers": 255, "stack_bytes": 48, "spill_store_bytes": 44, "spill_load_bytes": 52,
    }  # fmt: skip
    assert analysis.wgmma_serialized(log) is None
    # ptxas 12.8's advisory for gemm_fp8's per-tensor kernel before eafec86 (sm_90a), verbatim
    advisory = (
        "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due "
        "to non wgmma instructions defining accumulator registers of a wgmma between start and end of the "
        "pipeline stage in the function '_gemm_fp8_kernel'\n"
        "ptxas info    : Used 185 registers, used 1 barriers"
    )
    assert analysis.wgmma_serialized(advisory) == (
        "non wgmma instructions defining accumulator registers of a wgmma between start and end of the "
        "pipeline stage"
    )
    assert analysis.ptxas_usage(advisory)["registers"] == 185
    # H100: 255 registers x 8 warps fill the 64K register file; 224 KiB of shared memory fits once in 228.
    assert analysis.occupancy(255, 224 * 1024, 8, 228 * 1024, (9, 0)) == analysis.Occupancy(1, 8, "registers")
    assert analysis.occupancy(128, 64 * 1024, 8, 228 * 1024, (9, 0)).blocks == 2
    assert analysis.occupancy(64, 300 * 1024, 4, 228 * 1024, (9, 0)).blocks == 0  # does not fit


# A warp-specialized kernel as Triton 3.6 writes it (sm_90a, the Gluon GEMM; argument lists shortened).
TTGIR = """
module attributes {"ttg.num-ctas" = 1 : i32, "ttg.num-warps" = 8 : i32, ttg.target = "cuda:90"} {
    ttg.warp_specialize(%a_desc, %b_desc) attributes {requestedRegisters = array<i32: 24, 32>}
    default {
      ttg.warp_yield loc(#loc)
    }
    partition0(%arg18: !tt.tensordesc<tensor<128x64xf16, #shared>> loc(unknown)) num_warps(1) {
      ttg.warp_return loc(#loc1)
    }
    partition1(%arg19: i32 loc(unknown)) num_warps(4) {
      ttg.warp_return loc(#loc1)
    }
"""
WS_PTX = """
.maxnreg 168
.reqntid 416
	setmaxnreg.inc.sync.aligned.u32 	240;
	mbarrier.try_wait.parity.shared::cta.b64 	%p1, [%r1], %r2;
	setmaxnreg.dec.sync.aligned.u32 	24;
	mbarrier.try_wait.parity.shared::cta.b64 	%p2, [%r3], %r4;
	setmaxnreg.inc.sync.aligned.u32 	240;
"""


def test_partitions_registers_and_waits_of_a_warp_specialized_kernel():
    assert analysis.partitions(TTGIR, WS_PTX) == [
        analysis.Partition("default", 8, 240),
        analysis.Partition("worker0", 1, 24),
        analysis.Partition("worker1", 4, 32),
    ]
    assert analysis.setmaxnreg(WS_PTX) == ["inc 240", "dec 24"]
    assert analysis.mbarrier_waits(WS_PTX) == 2
    assert analysis.launched_warps(WS_PTX) == 13
    # no setmaxnreg above the workers' requests: the default partition's count is not known from the PTX
    assert analysis.partitions(TTGIR, "")[0] == analysis.Partition("default", 8, None)
    assert analysis.partitions("module {}", WS_PTX) is None  # not warp-specialized
    assert analysis.launched_warps("") is None
    assert analysis.tma_loads(analysis.Sass.parse(SASS)) == 1


def test_instructions_beside_a_product_left_in_flight_by_a_wait():
    # two products committed, S retired at once (wait 1), the softmax, then the PV retired (wait 0)
    ptx = """
$L__BB0_1:
	wgmma.commit_group.sync.aligned;
	wgmma.commit_group.sync.aligned;
	wgmma.wait_group.sync.aligned 1;
	max.f32 	%f1, %f2, %f3;
	ex2.approx.f32 	%f4, %f1;
	add.f32 	%f5, %f5, %f4;
	wgmma.wait_group.sync.aligned 0;
	@%p1 bra 	$L__BB0_1;
"""
    assert analysis.wgmma_overlap(ptx) == 0  # commit -> the next wait: nothing between
    assert analysis.wgmma_in_flight(ptx) == 3  # the softmax runs beside the PV
    assert analysis.wgmma_in_flight(PTX) == 2  # the cp.async wait and the branch, round to the same wait
    assert analysis.wgmma_in_flight("") is None


def test_in_flight_follows_one_arm_of_an_if_else():
    # S masked on some blocks only: the masked arm (3 selects and its branch) or the unmasked one (a move),
    # never both; 1 + 4 + 1 along the masked arm (counting both arms read 7).
    ptx = """
$L__BB0_1:
	wgmma.commit_group.sync.aligned;
	wgmma.commit_group.sync.aligned;
	wgmma.wait_group.sync.aligned 1;
	@%p2 bra 	$L__BB0_3;
	selp.f32 	%f1, %f1, %f9, %p3;
	selp.f32 	%f2, %f2, %f9, %p4;
	selp.f32 	%f3, %f3, %f9, %p5;
	bra.uni 	$L__BB0_4;
$L__BB0_3:
	mov.f32 	%f1, %f5;
$L__BB0_4:
	ex2.approx.f32 	%f4, %f1;
	wgmma.wait_group.sync.aligned 0;
	@%p1 bra 	$L__BB0_1;
	ret;
"""
    assert analysis.wgmma_in_flight(ptx) == 6
    assert analysis.wgmma_overlap(ptx) == 0


def test_a_predicated_branch_may_skip_a_wait():
    # taken, the branch skips the first wait: 1 + the two adds before the second
    ptx = """
$L__BB0_1:
	wgmma.commit_group.sync.aligned;
	@%p2 bra 	$L__BB0_2;
	wgmma.wait_group.sync.aligned 0;
$L__BB0_2:
	add.f32 	%f1, %f1, %f2;
	add.f32 	%f3, %f3, %f2;
	wgmma.wait_group.sync.aligned 0;
	@%p1 bra 	$L__BB0_1;
"""
    assert analysis.wgmma_overlap(ptx) == 3


def test_round_the_back_edge_once_and_not_out_of_the_loop():
    # Triton's layout: the latch above the header. From the commit: the exp2 and the branch, the latch's
    # add and branch, back to the header's wait: 4. Leaving the loop (to the wait after it) is not counted.
    ptx = """
	bra.uni 	$L__BB0_2;
$L__BB0_1:
	add.s32 	%r1, %r1, 1;
	@%p1 bra 	$L__BB0_2;
	bra.uni 	$L__BB0_3;
$L__BB0_2:
	wgmma.wait_group.sync.aligned 0;
	wgmma.commit_group.sync.aligned;
	ex2.approx.f32 	%f4, %f1;
	bra.uni 	$L__BB0_1;
$L__BB0_3:
	wgmma.wait_group.sync.aligned 0;
	ret;
"""
    assert analysis.wgmma_overlap(ptx) == 4


def test_an_mbarrier_retry_loop_counts_once():
    # Two inline-asm waits, each with its own local ``waitLoop`` label: each retry counts its two
    # instructions once, and neither hides the wgmma wait after it.
    retry = """
	{
	.reg .pred complete;
	waitLoop:
	mbarrier.try_wait.parity.shared.b64 complete, [%r1], %r2;
	@!complete bra.uni waitLoop;
	}
"""
    ptx = f"""
$L__BB0_1:
	wgmma.commit_group.sync.aligned;
	wgmma.wait_group.sync.aligned 1;
	add.s32 	%r2, %r2, 1;
{retry}{retry}
	ex2.approx.f32 	%f4, %f1;
	wgmma.wait_group.sync.aligned 0;
	@%p1 bra 	$L__BB0_1;
"""
    assert analysis.wgmma_in_flight(ptx) == 6
    assert analysis.mbarrier_waits(ptx) == 2


def test_no_wait_in_the_loop():
    ptx = """
$L__BB0_1:
	wgmma.commit_group.sync.aligned;
	add.s32 	%r2, %r2, 1;
	@%p1 bra 	$L__BB0_1;
	wgmma.wait_group.sync.aligned 0;
"""
    assert analysis.wgmma_overlap(ptx) is None  # waited for after the loop only
