"""GPU only (sm_90: H100, H200), run by the proof command: the block-scaled fp8 Gluon GEMM itself against
float64 of the dequantized operands, under the 2x rule against the same product in the tensor cores' own
fp8 precision (``torch._scaled_mm`` per 128-wide K group with fast accumulation, each group scaled and
summed in fp32: what the kernel's promotion computes), and against llm-speed's Triton block-scaled path
(``llm_speed.matmul.fp8.gemm_fp8``); over square, ragged and one-row shapes, a long K, both output dtypes
and a bias, with the output poisoned with NaN first, and bitwise repeatable. A kernel that hangs (a broken
mbarrier protocol) hangs this process: run it in its own process with a timeout."""

from __future__ import annotations

import pytest
import torch

from accuracy_rule import OUTPUT_FACTOR, assert_error_rule, expect_launches, matmul_cap

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs a compute capability 9.0 GPU (H100, H200)",
    ),
]

E4M3 = torch.float8_e4m3fn
# square, one row, ragged on every side (K: 4 groups + 16), N of one tile, a long K (64 steps: the ring of 6
# wraps many times per tile)
SHAPES = [(4096, 4096, 4096), (1, 8, 16), (1000, 4104, 528), (127, 136, 272), (4096, 128, 8192)]


@pytest.fixture(autouse=True)
def _poison_outputs(nan_poisoned):
    """Kernel outputs start as NaN (tests/conftest.py)."""


def _operands(m, n, k, positive=False):
    from llm_speed.matmul.fp8 import quantize_fp8

    g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
    draw = torch.rand if positive else torch.randn
    a = draw(m, k, device="cuda", generator=g) * torch.logspace(-2, 2, m, device="cuda").reshape(m, 1)
    w = draw(n, k, device="cuda", generator=g)
    a_q, s_a = quantize_fp8(a, dtype=E4M3, granularity=(1, 128))
    b_q, s_b = quantize_fp8(w, dtype=E4M3, granularity=(128, 128))
    return a_q, b_q, s_a, s_b


def _group_product(a_g, b_g):
    """``a_g @ b_g.T`` of unscaled fp8 operands by cuBLASLt's fp8 GEMM with fast accumulation (the tensor
    cores' own accumulation inside the group, as the kernel's wgmma), in fp32; N padded to 16 as it needs."""
    n = b_g.shape[0]
    n16 = -(-n // 16) * 16
    padded = torch.zeros(n16, b_g.shape[1], dtype=E4M3, device=b_g.device)
    padded[:n] = b_g
    one = torch.ones((), device=a_g.device)
    return torch._scaled_mm(a_g.contiguous(), padded.T, one, one, out_dtype=torch.float32,
                            use_fast_accum=True)[:, :n]  # fmt: skip


def _same_precision(a, b, s_a, s_b, bias, out_dtype):
    (m, k), n = a.shape, b.shape[0]
    out = torch.zeros(m, n, device=a.device)
    for g in range(-(-k // 128)):
        ks = slice(g * 128, (g + 1) * 128)
        out += _group_product(a[:, ks], b[:, ks]) * s_a[:, g : g + 1] * s_b[:, g].repeat_interleave(128)[:n]
    if bias is not None:
        out += bias.float()
    return out.to(out_dtype)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_against_float64(m, n, k, out_dtype, bias):
    from llm_speed.gluon.gemm_fp8 import gemm_fp8
    from llm_speed.matmul.reference import gemm_fp8_reference

    a, b, s_a, s_b = _operands(m, n, k)
    bias_t = torch.randn(n, device="cuda").to(out_dtype) if bias else None
    with expect_launches("gluon_gemm_fp8", device=a.device):
        out = gemm_fp8(a, b, s_a, s_b, out_dtype=out_dtype, bias=bias_t)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "an output element no program wrote"
    truth = gemm_fp8_reference(a, b, s_a, s_b, bias=bias_t, out_dtype=torch.float64, trans_b=True)
    same = _same_precision(a, b, s_a, s_b, bias_t, out_dtype)
    assert_error_rule("gluon gemm fp8", out, same, truth, OUTPUT_FACTOR, cap=matmul_cap(out_dtype, truth, k))


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_against_the_triton_block_path(m, n, k):
    """The 2x rule with llm-speed's Triton block-scaled kernel (as shipped) as the same-precision product:
    the Gluon kernel is no less accurate than the path it would replace (bf16 out, no bias: the Triton
    kernel's compiles kept few)."""
    from llm_speed.core.policy import use_policy
    from llm_speed.gluon.gemm_fp8 import gemm_fp8
    from llm_speed.matmul import fp8
    from llm_speed.matmul.reference import gemm_fp8_reference

    a, b, s_a, s_b = _operands(m, n, k)
    out = gemm_fp8(a, b, s_a, s_b)
    with use_policy("shipped"), expect_launches(fp8.GEMM_KERNEL, device=a.device):
        triton = fp8.gemm_fp8(a, b, s_a, s_b, trans_b=True)
    truth = gemm_fp8_reference(a, b, s_a, s_b, out_dtype=torch.float64, trans_b=True)
    assert_error_rule("gluon gemm fp8 vs the Triton block path", out, triton, truth, OUTPUT_FACTOR,
                      cap=matmul_cap(torch.bfloat16, truth, k))  # fmt: skip


def test_positive_inputs_and_repeatable():
    from llm_speed.gluon.gemm_fp8 import gemm_fp8
    from llm_speed.matmul.reference import gemm_fp8_reference

    a, b, s_a, s_b = _operands(2048, 3072, 1024, positive=True)
    first = gemm_fp8(a, b, s_a, s_b)
    truth = gemm_fp8_reference(a, b, s_a, s_b, out_dtype=torch.float64, trans_b=True)
    same = _same_precision(a, b, s_a, s_b, None, torch.bfloat16)
    assert_error_rule("gluon gemm fp8", first, same, truth, OUTPUT_FACTOR,
                      cap=matmul_cap(torch.bfloat16, truth, 1024))  # fmt: skip
    for _ in range(10):  # one program per tile at a time and a fixed K order: bitwise the same every time
        assert torch.equal(gemm_fp8(a, b, s_a, s_b), first)


def test_the_build_that_ran_keeps_no_local_memory():
    """The GPU machine's own build of each variant launched (bf16 out; fp16 with a bias), as its driver
    loaded it: no local memory (no spill: what `llm-speed kernels --op gluon_gemm_fp8` shows on a CPU) and
    the default partition of one warpgroup."""
    from llm_speed.gluon.gemm_fp8 import GEMM_FP8, gemm_fp8

    a, b, s_a, s_b = _operands(256, 256, 512)
    gemm_fp8(a, b, s_a, s_b)
    gemm_fp8(a, b, s_a, s_b, out_dtype=torch.float16, bias=torch.zeros(256, device="cuda"))
    torch.cuda.synchronize()
    built = list(GEMM_FP8.fn.device_caches[torch.cuda.current_device()][0].values())
    assert len(built) >= 2
    for kernel in built:
        # (Triton 3.6 records a warp-specialized kernel's warps over every partition: 4 + 4 + a producer
        # warpgroup, 12; the default partition's 4 are in its TTGIR)
        assert kernel.n_spills == 0 and kernel.metadata.num_warps == 12
