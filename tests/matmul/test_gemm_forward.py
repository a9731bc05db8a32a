"""Forward GEMM through the Triton kernels (the interpreter on CPU): values, layouts, batching, epilogue."""

import importlib

import pytest
import torch
from matmul_helpers import assert_gemm_accurate, record_gemm_launches

import llm_speed
from call_records import record_checks
from host_reads import host_reads_raise
from llm_speed.core import launch, runtime, tensors
from llm_speed.core.hardware import Hardware, hardware_of
from llm_speed.matmul.reference import ACTIVATIONS, gemm_reference

gemm_op = importlib.import_module("llm_speed.matmul.gemm")
gemm_configs = importlib.import_module("llm_speed.matmul.gemm_configs")
gemm_kernels = importlib.import_module("llm_speed.matmul.gemm_kernels")
gemm_launch = importlib.import_module("llm_speed.matmul.gemm_launch")

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


HOPPER = Hardware.from_spec("h100-sxm")


def rand(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


@pytest.mark.parametrize(
    "m, n, k, dtype",
    [
        (1, 1, 32, torch.float32),
        (1, 1, 32, torch.float16),
        (1, 1, 32, torch.bfloat16),
        (17, 3, 113, torch.float32),
        (15, 160, 1024, torch.float32),
        (495, 533, 71, torch.float16),
        (129, 65, 257, torch.bfloat16),
    ],
)
def test_shapes_and_dtypes(device, m, n, k, dtype):
    a, b = rand(m, k, dtype=dtype, device=device), rand(k, n, dtype=dtype, device=device)
    out = llm_speed.gemm(a, b)
    assert out.shape == (m, n) and out.dtype == dtype
    assert_gemm_accurate(out, a, b)


def test_outputs_are_really_poisoned(device):
    # Guards the NaN fixture (tests/matmul/conftest.py): the launchers allocate through
    # core.tensors.new_output.
    out = llm_speed.gemm(rand(0, 5, device=device), rand(5, 4, device=device))
    assert out.shape == (0, 4)
    assert tensors.new_output((3, 4), torch.float16, device).isnan().all()
    assert (tensors.new_output((3,), torch.int32, device) == torch.iinfo(torch.int32).min).all()


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_four_layouts_through_flags(device, trans_a, trans_b, dtype):
    m, n, k = 33, 47, 70
    a = rand(*((k, m) if trans_a else (m, k)), dtype=dtype, device=device)
    b = rand(*((n, k) if trans_b else (k, n)), dtype=dtype, device=device)
    out = llm_speed.gemm(a, b, trans_a=trans_a, trans_b=trans_b)
    assert out.shape == (m, n)
    assert_gemm_accurate(out, a, b, trans_a=trans_a, trans_b=trans_b)


def test_strided_operands_are_read_in_place(device, monkeypatch):
    """Column-major, transposed-view and stride-0 operands reach the kernel as the same memory, not copies:
    the launch gets the tensors themselves, the plan their strides."""
    launches = record_gemm_launches(monkeypatch)
    m, n, k = 40, 36, 50
    cases = [
        (rand(k, m, device=device).mT, rand(n, k, device=device).mT),  # both column-major
        (rand(1, k, device=device).expand(m, k), rand(k, 1, device=device).expand(k, n)),  # stride 0
        (rand(m, 2 * k, device=device)[:, ::2], rand(k, n + 5, device=device)[:, 2 : n + 2]),  # sliced
    ]
    for a, b in cases:
        out = llm_speed.gemm(a, b)
        assert_gemm_accurate(out, a, b)
        plan, per_call = launches[-1]
        assert per_call["a_ptr"] is a and per_call["b_ptr"] is b
        assert (plan.fixed["stride_am"], plan.fixed["stride_ak"]) == a.stride()
        assert (plan.fixed["stride_bk"], plan.fixed["stride_bn"]) == b.stride()
    launch.clear_plans()  # the plans' launch functions were wrapped


def test_transposes_are_strides_not_views(device):
    """trans_a / trans_b swap the strides in the plan: the kernel gets a and b as given."""
    a, b = rand(50, 40, device=device), rand(36, 50, device=device)
    out = llm_speed.gemm(a, b, trans_a=True, trans_b=True)
    assert_gemm_accurate(out, a, b, trans_a=True, trans_b=True)
    recipe = gemm_launch._recipe_of(a, b, a.dtype, True, True, None, None, None, None, None, None, a.device)
    plan, per_call = recipe.arguments(a, b, None, None, out, 1.0, 0.0)
    assert per_call["a_ptr"] is a and per_call["b_ptr"] is b
    assert (plan.fixed["M"], plan.fixed["N"], plan.fixed["K"]) == (40, 36, 50)
    assert (plan.fixed["stride_am"], plan.fixed["stride_ak"]) == (1, 40)
    assert (plan.fixed["stride_bk"], plan.fixed["stride_bn"]) == (1, 50)


@pytest.mark.parametrize("path", ["tiled", "persistent_tma"])
def test_a_launch_passes_what_planned_launch_reports(device, path, monkeypatch):
    """``planned_launch`` (what the sm90 compile test compiles) and the launch agree on every argument."""
    if path == "persistent_tma" and device.type == "cuda" and not gemm_configs.has_tma(hardware_of(device)):
        pytest.skip("the TMA kernel is not used on this GPU")
    a, w = rand(40, 48, dtype=torch.float16, device=device), rand(32, 48, dtype=torch.float16, device=device)
    b = w.mT  # the x @ W^T layout
    bias, out = rand(32, device=device), torch.empty(40, 32, dtype=torch.float16, device=device)
    plan, planned = gemm_launch.planned_launch(a, b, out, alpha=0.5, bias=bias, activation="silu", path=path)
    launched = []
    monkeypatch.setattr(plan, "launch", lambda **per_call: launched.append(per_call))
    gemm_launch.launch_gemm(a, b, out, alpha=0.5, bias=bias, activation="silu", path=path)
    assert launched and launched[0].keys() == planned.keys()
    for name, value in planned.items():
        got = launched[0][name]
        if isinstance(value, torch.Tensor):  # descriptor parameters take their tensor too
            assert got.data_ptr() == value.data_ptr() and got.stride() == value.stride(), name
        else:
            assert isinstance(value, float) and got == value, name


def test_batches_beyond_the_grid_limit_launch_in_chunks(device, monkeypatch):
    """CUDA caps grid dim 1 at 65535: a larger batch runs in chunks (here the cap is lowered to 4, so a
    batch of 6 runs as 4 + 2: a full chunk and the remainder's plan), every operand layout sliced or
    broadcast as it must be."""
    monkeypatch.setattr(gemm_launch, "MAX_GRID_Y", 4)  # read where the batch is chunked
    launch.clear_plans()
    a, b = rand(6, 20, 30, device=device), rand(30, 25, device=device)  # b broadcast over the batch
    c = rand(6, 1, 25, device=device)  # c sliced per chunk, broadcast over rows
    bias = rand(25, device=device)
    before = runtime.launch_count(gemm_kernels.TILED_KERNEL)
    kwargs = dict(beta=0.5, c=c, bias=bias, activation="relu")
    out = llm_speed.gemm(a, b, **kwargs)
    assert runtime.launch_count(gemm_kernels.TILED_KERNEL) == before + 2
    assert_gemm_accurate(out, a, b, **kwargs)
    a1, b3 = rand(1, 20, 30, device=device), rand(6, 30, 25, device=device).mT.contiguous().mT
    out = llm_speed.gemm(a1, b3)  # a broadcast, b column-major per batch
    assert runtime.launch_count(gemm_kernels.TILED_KERNEL) == before + 4
    assert_gemm_accurate(out, a1, b3)
    launch.clear_plans()


@pytest.mark.parametrize(
    "a_shape, b_shape, out_shape",
    [
        ((3, 20, 30), (3, 30, 25), (3, 20, 25)),
        ((3, 20, 30), (30, 25), (3, 20, 25)),  # 2-D b broadcast over a's batch
        ((20, 30), (2, 30, 25), (2, 20, 25)),  # 2-D a broadcast over b's batch
        ((1, 20, 30), (3, 30, 25), (3, 20, 25)),  # batch of 1 broadcasts
    ],
)
def test_batched_and_broadcast(device, a_shape, b_shape, out_shape):
    a, b = rand(*a_shape, device=device), rand(*b_shape, device=device)
    out = llm_speed.gemm(a, b)
    assert out.shape == out_shape
    assert_gemm_accurate(out, a, b)


def test_batched_transposed_with_epilogue(device):
    a = rand(2, 30, 20, dtype=torch.float16, device=device)  # op(a) = a^T per batch: [2, 20, 30]
    b = rand(25, 30, dtype=torch.float16, device=device)  # op(b) = b^T: [30, 25]
    c = rand(25, device=device)  # broadcasts over batch and rows
    bias = rand(25, device=device)
    kwargs = dict(alpha=0.75, beta=-1.25, c=c, trans_a=True, trans_b=True, bias=bias, activation="gelu")
    out = llm_speed.gemm(a, b, **kwargs)
    assert out.shape == (2, 20, 25)
    assert_gemm_accurate(out, a, b, **kwargs)


@pytest.mark.parametrize("c_shape", [(31, 45), (45,), (31, 1)])
def test_alpha_beta_with_c(device, c_shape):
    a, b = rand(31, 52, device=device), rand(52, 45, device=device)
    c = rand(*c_shape, device=device)
    out = llm_speed.gemm(a, b, alpha=0.5, beta=-1.5, c=c)
    assert_gemm_accurate(out, a, b, alpha=0.5, beta=-1.5, c=c)


def test_c_of_other_dtype(device):
    a, b = rand(31, 52, dtype=torch.float16, device=device), rand(52, 45, dtype=torch.float16, device=device)
    c = rand(31, 45, device=device)  # fp32 c with fp16 operands is read in fp32
    out = llm_speed.gemm(a, b, beta=2.0, c=c)
    assert_gemm_accurate(out, a, b, beta=2.0, c=c)


def test_nan_in_c_does_not_leak_when_beta_is_zero(device):
    a, b = rand(20, 33, device=device), rand(33, 17, device=device)
    c = torch.full((20, 17), float("nan"), device=device)
    out = llm_speed.gemm(a, b, beta=0.0, c=c, alpha=2.0)
    assert out.isfinite().all()
    assert_gemm_accurate(out, a, b, alpha=2.0)


@pytest.mark.parametrize("path", gemm_configs.PATHS)
def test_strided_bias_and_c(device, path):
    """A bias view with a stride (a column of a matrix) and a transposed c are read through their strides."""
    if path == "persistent_tma" and device.type == "cuda" and not gemm_configs.has_tma(hardware_of(device)):
        pytest.skip("the TMA kernel is not used on this GPU")
    m, n, k = 70, 40, 48
    a, b = rand(m, k, dtype=torch.float16, device=device), rand(k, n, dtype=torch.float16, device=device)
    bias = rand(n, 3, device=device)[:, 1]  # stride 3
    c = rand(n, m, device=device).mT  # column-major
    kwargs = dict(beta=0.5, c=c, bias=bias, activation="relu")
    out = torch.full((m, n), float("nan"), dtype=torch.float16, device=device)
    gemm_launch.launch_gemm(a, b, out, path=path, **kwargs)
    assert_gemm_accurate(out, a, b, **kwargs)


@pytest.mark.parametrize("activation", (None,) + ACTIVATIONS)
def test_each_activation_with_bias(device, activation):
    a, b = rand(37, 41, device=device) * 2, rand(41, 29, device=device)
    bias = rand(29, device=device)
    out = llm_speed.gemm(a, b, bias=bias, activation=activation)
    assert_gemm_accurate(out, a, b, bias=bias, activation=activation)


def test_bf16_epilogue_and_bias(device):
    a, b = (
        rand(45, 70, dtype=torch.bfloat16, device=device),
        rand(70, 38, dtype=torch.bfloat16, device=device),
    )
    bias = rand(38, dtype=torch.bfloat16, device=device)
    out = llm_speed.gemm(a, b, bias=bias, activation="silu", alpha=1.5)
    assert out.dtype == torch.bfloat16
    assert_gemm_accurate(out, a, b, bias=bias, activation="silu", alpha=1.5)


def test_bf16_really_exercised():
    # Integers up to 2**8 are exact in bf16 and so are their products and fp32 sums: any result differing from
    # the integer product means the bf16 dot went wrong (the interpreter's raw-bits bug, if not avoided).
    a = torch.randint(-16, 17, (40, 64)).to(torch.bfloat16)
    b = torch.randint(-16, 17, (64, 24)).to(torch.bfloat16)
    out = llm_speed.gemm(a, b, out_dtype=torch.float32)
    assert torch.equal(out, (a.double() @ b.double()).float())


def test_out_dtype(device):
    a, b = rand(26, 40, dtype=torch.float16, device=device), rand(40, 22, dtype=torch.float16, device=device)
    out = llm_speed.gemm(a, b, out_dtype=torch.float32)
    assert out.dtype == torch.float32
    assert_gemm_accurate(out, a, b, out_dtype=torch.float32)
    a32, b32 = a.float(), b.float()
    out_bf16 = llm_speed.gemm(a32, b32, out_dtype=torch.bfloat16)
    assert out_bf16.dtype == torch.bfloat16
    assert_gemm_accurate(out_bf16, a32, b32, out_dtype=torch.bfloat16)


def test_large_magnitudes_fp16(device):
    a = rand(64, 96, dtype=torch.float16, device=device) * 5
    b = rand(96, 40, dtype=torch.float16, device=device) * 3
    bias = rand(40, device=device) * 10
    out = llm_speed.gemm(a, b, bias=bias, activation="gelu")
    assert_gemm_accurate(out, a, b, bias=bias, activation="gelu")


def test_batch_entries_are_independent(device):
    """A batched call gives, bit for bit, what each entry alone gives."""
    a, b, bias = rand(3, 20, 30, device=device), rand(3, 30, 25, device=device), rand(25, device=device)
    out = llm_speed.gemm(a, b, bias=bias, activation="silu")
    for i in range(3):
        assert torch.equal(out[i], llm_speed.gemm(a[i], b[i], bias=bias, activation="silu"))


def test_fp16_near_its_largest_value(device):
    # 100 * 9 * 64 = 57600 is exact in fp16 (max 65504): the fp32 accumulator must not overflow or round.
    a = torch.full((16, 64), 100.0, dtype=torch.float16, device=device)
    b = torch.full((64, 8), 9.0, dtype=torch.float16, device=device)
    assert (llm_speed.gemm(a, b) == 57600).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tensor_core_gemm_returns_fp32(device, dtype):
    a, b = rand(2, 23, 48, dtype=dtype, device=device), rand(48, 19, dtype=dtype, device=device)
    c = rand(2, 23, 19, device=device)
    out = llm_speed.tensor_core_gemm(a, b, alpha=2.0, beta=0.5, c=c)
    assert out.dtype == torch.float32 and out.shape == (2, 23, 19)
    assert_gemm_accurate(out, a, b, alpha=2.0, beta=0.5, c=c, out_dtype=torch.float32)


def test_zero_sizes(device):
    """M or N of 0: an empty output, no launch. K of 0: the product is 0, so out = act(beta*c + bias)."""
    before = runtime.launch_count(gemm_kernels.TILED_KERNEL)
    assert llm_speed.gemm(rand(0, 5, device=device), rand(5, 7, device=device)).shape == (0, 7)
    assert llm_speed.gemm(rand(4, 5, device=device), rand(5, 0, device=device)).shape == (4, 0)
    assert llm_speed.gemm(rand(0, 4, 5, device=device), rand(5, 7, device=device)).shape == (0, 4, 7)
    assert runtime.launch_count(gemm_kernels.TILED_KERNEL) == before
    c, bias = rand(4, 7, device=device), rand(7, device=device)
    out = llm_speed.gemm(rand(4, 0, device=device), rand(0, 7, device=device), beta=2.0, c=c, bias=bias,
                         activation="relu")  # fmt: skip
    torch.testing.assert_close(out, torch.relu(2.0 * c + bias))
    assert runtime.launch_count(gemm_kernels.TILED_KERNEL) == before + 1


def test_inputs_are_not_modified(device):
    a, b = rand(20, 30, device=device), rand(30, 10, device=device)
    c, bias = rand(20, 10, device=device), rand(10, device=device)
    copies = [x.clone() for x in (a, b, c, bias)]
    llm_speed.gemm(a, b, beta=1.0, c=c, bias=bias, activation="relu")
    for original, copy in zip((a, b, c, bias), copies, strict=True):
        assert torch.equal(original, copy)


def test_repeated_calls_are_bitwise_identical(device):
    a, b = rand(70, 90, device=device), rand(90, 66, device=device)
    assert torch.equal(llm_speed.gemm(a, b), llm_speed.gemm(a, b))


def test_dispatch_runs_the_triton_kernel(device):
    assert runtime.triton_runs_on(device)
    before = runtime.launch_count(gemm_kernels.TILED_KERNEL)
    llm_speed.gemm(rand(8, 8, device=device), rand(8, 8, device=device))
    ones = torch.ones(8, 8, dtype=torch.int8, device=device)
    llm_speed.tensor_core_gemm_int8(ones, ones)
    assert runtime.launch_count(gemm_kernels.TILED_KERNEL) == before + 2


def test_cpu_fallback_without_triton(monkeypatch):
    """Where Triton cannot run (CPU without the interpreter), the PyTorch path computes the same function."""
    monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    before = runtime.launch_count(gemm_kernels.TILED_KERNEL)
    a, b, bias = rand(12, 20), rand(20, 9), rand(9)
    out = llm_speed.gemm(a, b, bias=bias, activation="gelu_tanh")
    assert runtime.launch_count(gemm_kernels.TILED_KERNEL) == before
    assert_gemm_accurate(out, a, b, bias=bias, activation="gelu_tanh")
    a8, b8 = (
        torch.randint(-128, 128, (5, 40), dtype=torch.int8),
        torch.randint(-128, 128, (40, 6), dtype=torch.int8),
    )
    assert torch.equal(llm_speed.tensor_core_gemm_int8(a8, b8), (a8.long() @ b8.long()).int())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_k_major", [False, True])
def test_persistent_tma_kernel(device, dtype, b_k_major):
    """The Hopper kernel (tensor descriptors, persistent loop), run directly; programs walk several tiles."""
    if device.type == "cuda" and not gemm_configs.has_tma(hardware_of(device)):
        pytest.skip("the TMA kernel is not used on this GPU")
    m, n, k = 150, 72, 136  # 3 x 2 tiles of 64 for 3 programs; K and M not multiples of the block
    a = rand(m, k, dtype=dtype, device=device)
    b = rand(n, k, dtype=dtype, device=device).mT if b_k_major else rand(k, n, dtype=dtype, device=device)
    c, bias = rand(m, n, device=device), rand(n, device=device)
    out = torch.full((m, n), float("nan"), dtype=dtype, device=device)
    before = runtime.launch_count(gemm_kernels.PERSISTENT_TMA_KERNEL)
    kwargs = dict(alpha=1.5, beta=0.5, c=c, bias=bias, activation="gelu_tanh")
    gemm_launch.launch_gemm(a, b, out, path="persistent_tma", **kwargs)
    assert runtime.launch_count(gemm_kernels.PERSISTENT_TMA_KERNEL) == before + 1
    assert_gemm_accurate(out, a, b, **kwargs)


def test_path_choice_without_a_gpu():
    a, b = rand(64, 64, dtype=torch.float16), rand(64, 64, dtype=torch.float16)
    out = torch.empty(64, 64, dtype=torch.float16)
    if runtime.INTERPRETED:  # the interpreter runs the tiled kernel unless a test forces the other
        assert gemm_launch.planned_launch(a, b, out)[0].kernel is gemm_kernels.TILED
    with launch.simulated_gpu():  # the GPU code path, on an H100 (the stand-in hardware): TMA
        assert gemm_launch.planned_launch(a, b, out)[0].kernel is gemm_kernels.PERSISTENT_TMA
        shifted = rand(64 * 64 + 1, dtype=torch.float16)[1:].view(64, 64)  # base 2 bytes past alignment
        assert gemm_launch.planned_launch(shifted, b, out)[0].kernel is gemm_kernels.TILED
        assert gemm_launch.planned_launch(a.float(), b.float(), out.float())[0].kernel is gemm_kernels.TILED
    assert gemm_launch._tma_layout(a, b) is False
    assert gemm_launch._tma_layout(a, b.T.contiguous().mT) is True
    assert gemm_launch._tma_layout(a.mT, b) is None  # A must be row-major
    unaligned_a = rand(64, 71, dtype=torch.float16)[:, :64]  # rows of 71 fp16 values: not 16-byte aligned
    assert gemm_launch._tma_layout(unaligned_a, b) is None
    overlapping_rows = rand(64 * 8 + 64, dtype=torch.float16).as_strided((64, 64), (8, 1))
    assert gemm_launch._tma_layout(overlapping_rows, b) is None
    assert gemm_launch._tma_layout(a, overlapping_rows) is None
    assert gemm_launch._tma_layout(a, overlapping_rows.mT) is None


def test_tma_path_rules():
    """Which problems the TMA kernel would take (decided without a GPU from the hardware description)."""
    hopper, ampere = HOPPER, Hardware.from_spec("a100-sxm-80gb")
    a, b = rand(64, 48, dtype=torch.float16), rand(48, 32, dtype=torch.float16)
    assert gemm_launch._tma_suits(a, b, hopper)
    assert gemm_launch._tma_suits(a, rand(32, 48, dtype=torch.float16).mT, hopper)
    assert not gemm_launch._tma_suits(a, b, ampere)
    assert not gemm_launch._tma_suits(a.float(), b.float(), hopper)  # fp32 takes the tiled kernel
    assert not gemm_launch._tma_suits(a.unsqueeze(0), b, hopper)  # batched
    assert not gemm_launch._tma_suits(a[:, :0], b[:0], hopper)  # K == 0
    assert not gemm_launch._tma_suits(rand(48, 64, dtype=torch.float16).mT, b, hopper)  # column-major A


def test_simulated_gpu_calls_reuse_one_plan_and_read_no_tensor(monkeypatch):
    """On the GPU code path (CPU tensors, launches stubbed), a second call of a problem class makes no new
    plan, and no call reads a tensor's values on the host (CUDA-graph ready)."""
    with launch.simulated_gpu():
        for dtype, kernel in ((torch.float32, gemm_kernels.TILED_KERNEL),
                              (torch.bfloat16, gemm_kernels.PERSISTENT_TMA_KERNEL)):
            a, b = rand(16, 16, dtype=dtype), rand(16, 16, dtype=dtype)
            before = runtime.launch_count(kernel)
            llm_speed.gemm(a, b)
            misses = gemm_launch._recipe.cache_info().misses
            with host_reads_raise(monkeypatch):
                llm_speed.gemm(rand(16, 16, dtype=dtype), rand(16, 16, dtype=dtype), alpha=0.5)
            assert gemm_launch._recipe.cache_info().misses == misses
            assert runtime.launch_count(kernel) == before + 2
        a, b = rand(16, 16).requires_grad_(), rand(16, 16).requires_grad_()
        llm_speed.gemm(a, b).sum().backward()
        assert a.grad is not None and b.grad is not None
        i8 = torch.ones(16, 16, dtype=torch.int8)
        before = runtime.launch_count(gemm_kernels.TILED_KERNEL)
        assert llm_speed.tensor_core_gemm_int8(i8, i8).dtype == torch.int32
        assert runtime.launch_count(gemm_kernels.TILED_KERNEL) == before + 1


def test_plan_key_follows_what_fixes_the_launch(device):
    """Another M, another stride, another alignment: another plan; the same problem: the same plan."""

    def plan_of(a, b, **kwargs):
        out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=device)
        return gemm_launch.planned_launch(a, b, out, **kwargs)[0]

    a, b = rand(32, 48, dtype=torch.float16, device=device), rand(48, 40, dtype=torch.float16, device=device)
    first = plan_of(a, b)
    assert plan_of(rand(32, 48, dtype=torch.float16, device=device), b) is first
    assert plan_of(rand(33, 48, dtype=torch.float16, device=device), b) is not first
    assert plan_of(rand(32, 64, dtype=torch.float16, device=device)[:, :48], b) is not first
    assert plan_of(a, b, alpha=2.0) is first  # alpha and beta are per-call floats
    bias = rand(40, device=device)
    assert plan_of(a, b, bias=bias) is not first


def test_fp32_precision_follows_torch_switch():
    matmul = torch.backends.cuda.matmul
    previous = matmul.fp32_precision
    try:
        for setting, expected in [
            (lambda: setattr(matmul, "allow_tf32", False), "ieee"),
            (lambda: setattr(matmul, "allow_tf32", True), "tf32"),
            (lambda: torch.set_float32_matmul_precision("highest"), "ieee"),
            (lambda: torch.set_float32_matmul_precision("high"), "tf32"),
            (lambda: setattr(matmul, "fp32_precision", "ieee"), "ieee"),
            # the new API: reading allow_tf32 now raises, so it must not be read
            (lambda: setattr(matmul, "fp32_precision", "tf32"), "tf32"),
            (lambda: setattr(matmul, "fp32_precision", "none"), "ieee"),  # PyTorch's default
        ]:
            setting()
            assert gemm_configs.fp32_input_precision() == expected
    finally:
        matmul.fp32_precision = previous


def test_reference_matches_torch_matmul():
    a, b = torch.randn(5, 7, dtype=torch.float64), torch.randn(7, 3, dtype=torch.float64)
    assert torch.equal(gemm_reference(a, b), a @ b)


def test_a_repeated_inference_call_skips_the_checks(device, monkeypatch):
    """The second 16-bit inference call with the same metadata (and alignment) is served from the calls
    checked before: no check, one launch, the same values; a call with another alignment, autograd or
    fp32 is checked."""
    checked = record_checks(monkeypatch, device, gemm_op, "check_operands")
    x, w = (rand(rows, 48, dtype=torch.bfloat16, device=device) for rows in (33, 40))
    bias = rand(40, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        llm_speed.gemm(x, w, trans_b=True, bias=bias, activation="silu")
        before = runtime.launch_counts()
        again = llm_speed.gemm(x.clone(), w, trans_b=True, bias=bias, activation="silu", alpha=0.5)
        assert sum((runtime.launch_counts() - before).values()) == 1
        assert len(checked) == 1 and len(gemm_op._GEMM_CALLS) == 1
        assert_gemm_accurate(again, x, w, trans_b=True, bias=bias, activation="silu", alpha=0.5)
        shifted = torch.empty(33 * 48 + 4, dtype=torch.bfloat16, device=device)[4:].view(33, 48).copy_(x)
        llm_speed.gemm(shifted, w, trans_b=True, bias=bias, activation="silu")  # 8-byte aligned: another key
        llm_speed.gemm(x.float(), w.float(), trans_b=True)  # fp32: always checked
    leaves = x.clone().requires_grad_(), w.clone().requires_grad_()
    llm_speed.gemm(*leaves, trans_b=True, bias=bias, activation="silu").float().sum().backward()
    assert len(checked) == 3 and leaves[0].grad is not None  # with grad, the same metadata: kept too


def test_a_repeated_call_with_grad_records_the_node_around_the_kept_launch(device, monkeypatch):
    """With grad, the second call with the same metadata skips the checks and the op's layers and records the
    op's autograd node around the kept launch: the same output and gradients as the checked call, and only
    the inputs that require grad get one."""
    checked = record_checks(monkeypatch, device, gemm_op, "check_operands")
    x, w = (rand(rows, 32, dtype=torch.float16, device=device) for rows in (24, 40))
    bias = rand(40, dtype=torch.float16, device=device)
    dy = rand(24, 40, dtype=torch.float16, device=device)
    results = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (x, w, bias)]
        out = llm_speed.gemm(leaves[0], leaves[1], trans_b=True, bias=leaves[2], activation="gelu", alpha=0.5)
        out.backward(dy)
        results.append((out.detach(), *(leaf.grad for leaf in leaves)))
    assert len(checked) == 1 and len(gemm_op._GEMM_CALLS) == 1  # the second call was not checked
    for first, second in zip(*results, strict=True):
        assert torch.equal(first, second)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, bias))
    ref = torch.nn.functional.gelu(0.5 * x64 @ w64.T + b64)
    ref.backward(dy.double())
    for got, truth in zip(results[1][1:], (x64.grad, w64.grad, b64.grad), strict=True):
        assert (got.double() - truth).abs().max() <= 2e-2 * truth.abs().max()
    w_only = w.clone().requires_grad_()
    llm_speed.gemm(x, w_only, trans_b=True, bias=bias, activation="gelu", alpha=0.5).backward(dy)
    assert len(checked) == 1 and torch.equal(w_only.grad, results[1][2])  # x needs none: not computed


def test_the_checked_calls_never_skip_a_check(device):
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    a, b = rand(16, 24, dtype=torch.float16, device=device), rand(24, 8, dtype=torch.float16, device=device)
    with torch.no_grad():
        llm_speed.gemm(a, b)
        with pytest.raises(TypeError, match="trans_a"):
            llm_speed.gemm(a, b, trans_a=0)  # equal to False as a key, not a bool
        with pytest.raises(ValueError, match="alpha"):
            llm_speed.gemm(a, b, alpha=float("inf"))
        with pytest.raises(ValueError, match="activation"):
            llm_speed.gemm(a, b, activation="swish")
        with pytest.raises(ValueError, match="bias"):
            llm_speed.gemm(a, b, bias=rand(9, dtype=torch.float16, device=device))


def test_a_repeated_int8_call_skips_the_checks(device, monkeypatch):
    checked = record_checks(monkeypatch, device, gemm_op, "check_operands")
    a = torch.randint(-128, 128, (17, 40), dtype=torch.int8, device=device)
    b = torch.randint(-128, 128, (40, 24), dtype=torch.int8, device=device)
    expected = (a.cpu().long() @ b.cpu().long()).int().to(device)  # (no int64 matmul on CUDA)
    assert torch.equal(llm_speed.tensor_core_gemm_int8(a, b), expected)
    assert torch.equal(llm_speed.tensor_core_gemm_int8(a.clone(), b), expected)
    assert len(checked) == 1
    with pytest.raises(TypeError, match="dtype"):
        llm_speed.tensor_core_gemm_int8(a.half(), b.half())  # same shapes and strides: still checked
