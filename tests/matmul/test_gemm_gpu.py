"""GPU-only: the compiled kernels at sizes 512-8192, vs float64 and vs torch.matmul's own error."""

import importlib

import pytest
import torch
import triton
from matmul_helpers import OUTPUT_FACTOR, assert_error_rule, matmul_cap, torch_same_precision

import llm_speed
from llm_speed.core import runtime
from llm_speed.core.hardware import hardware_of
from llm_speed.matmul import gemm_int8_reference
from llm_speed.matmul.reference import gemm_reference

gemm_configs = importlib.import_module("llm_speed.matmul.gemm_configs")
gemm_kernels = importlib.import_module("llm_speed.matmul.gemm_kernels")
gemm_launch = importlib.import_module("llm_speed.matmul.gemm_launch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SIZES = [512, 1024, 2048, 4096, 8192]
EPS32 = torch.finfo(torch.float32).eps


def assert_as_accurate_as_torch(out, expected, torch_out, k):
    """The shared 2x rule against a float64 ``expected`` computed on the GPU (fast at these sizes)."""
    assert_error_rule("gemm", out, torch_out, expected, OUTPUT_FACTOR, cap=matmul_cap(out.dtype, expected, k))


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_square_sizes(size, dtype):
    a = torch.randn(size, size, device="cuda", dtype=dtype)
    b = torch.randn(size, size, device="cuda", dtype=dtype)
    out = llm_speed.gemm(a, b)
    assert_as_accurate_as_torch(out, a.double() @ b.double(), torch.matmul(a, b), size)


@pytest.mark.parametrize("m, n, k", [(512, 8192, 1024), (8192, 512, 4096), (1000, 3000, 777)])
@pytest.mark.parametrize("trans_b", [False, True])
def test_rectangular_linear_layer(m, n, k, trans_b):
    """x @ W^T + bias, GELU: the layout of a linear layer (B K-major), which takes the TMA path on Hopper."""
    x = torch.randn(m, k, device="cuda", dtype=torch.float16)
    w = torch.randn(n, k, device="cuda", dtype=torch.float16)
    w_op = w if trans_b else w.T.contiguous()
    bias = torch.randn(n, device="cuda", dtype=torch.float16)
    out = llm_speed.gemm(x, w_op, trans_b=trans_b, bias=bias, activation="gelu")
    expected = gemm_reference(x, w_op, trans_b=trans_b, bias=bias, activation="gelu", out_dtype=torch.float64)
    torch_out = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, bias).float()).half()
    assert_as_accurate_as_torch(out, expected, torch_out, k)


@pytest.mark.parametrize("path", gemm_configs.PATHS)
def test_both_paths_agree_with_float64(path):
    if path == "persistent_tma" and not has_tma():
        pytest.skip("the TMA kernel is not used on this GPU")
    a = torch.randn(2048, 1536, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1536, 2560, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(2048, 2560, device="cuda", dtype=torch.bfloat16)
    name = gemm_kernels.PERSISTENT_TMA_KERNEL if path == "persistent_tma" else gemm_kernels.TILED_KERNEL
    before = runtime.launch_count(name)
    gemm_launch.launch_gemm(a, b, out, path=path)
    assert runtime.launch_count(name) == before + 1
    assert_as_accurate_as_torch(out, a.double() @ b.double(), torch.matmul(a, b), 1536)


def has_tma():
    return gemm_configs.has_tma(hardware_of(torch.device("cuda")))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b_k_major", [False, True])
def test_persistent_tma_with_edges_and_epilogue(dtype, b_k_major):
    """The TMA kernel where descriptor loads cross every edge (M, N, K not multiples of any block)."""
    if not has_tma():
        pytest.skip("the TMA kernel is not used on this GPU")
    m, n, k = 1000, 3000, 776  # K a multiple of 8 (16-byte rows), not of 32 or 64
    a = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype)
    b = b.mT if b_k_major else b.reshape(k, n)
    c, bias = torch.randn(m, n, device="cuda"), torch.randn(n, device="cuda", dtype=dtype)
    kwargs = dict(alpha=0.5, beta=-1.5, c=c, bias=bias, activation="gelu_tanh")
    out = torch.full((m, n), float("nan"), device="cuda", dtype=dtype)
    before = runtime.launch_count(gemm_kernels.PERSISTENT_TMA_KERNEL)
    gemm_launch.launch_gemm(a, b, out, path="persistent_tma", **kwargs)
    assert runtime.launch_count(gemm_kernels.PERSISTENT_TMA_KERNEL) == before + 1
    expected = gemm_reference(a, b, out_dtype=torch.float64, **kwargs)
    torch_out = torch_same_precision(a, b, **kwargs)
    assert not out.isnan().any()
    assert_as_accurate_as_torch(out, expected, torch_out, k)


def test_linear_layer_layout_takes_the_tma_kernel_on_hopper():
    if not has_tma():
        pytest.skip("the TMA kernel is not used on this GPU")
    x = torch.randn(777, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(384, 512, device="cuda", dtype=torch.bfloat16)
    before = runtime.launch_count(gemm_kernels.PERSISTENT_TMA_KERNEL)
    out = llm_speed.gemm(x, w, trans_b=True)
    assert runtime.launch_count(gemm_kernels.PERSISTENT_TMA_KERNEL) == before + 1
    assert_as_accurate_as_torch(out, x.double() @ w.double().T, x @ w.T, 512)


def test_one_plan_per_problem_class():
    """The second call of a shape makes no plan (no autotuner, no search): one lookup, then the launch."""
    b = torch.randn(512, 640, device="cuda", dtype=torch.float32)
    x = torch.randn(1500, 512, device="cuda")
    llm_speed.gemm(x, b)
    misses = gemm_launch._recipe.cache_info().misses
    x2 = torch.randn(1500, 512, device="cuda")
    out = llm_speed.gemm(x2, b)
    assert gemm_launch._recipe.cache_info().misses == misses
    assert_as_accurate_as_torch(out, x2.double() @ b.double(), x2 @ b, 512)
    llm_speed.gemm(torch.randn(1900, 512, device="cuda"), b)  # another M: another plan
    assert gemm_launch._recipe.cache_info().misses == misses + 1


def test_native_launch_over_many_addresses():
    """Triton 3.6's launcher is called natively (its C function, each descriptor's CUtensorMap made once per
    address): a plan launched on more operand addresses than it keeps maps for, and on earlier addresses
    again, is right on every call."""
    if not has_tma():
        pytest.skip("the TMA kernel is not used on this GPU")
    from llm_speed.core import launch

    w = torch.randn(256, 512, device="cuda", dtype=torch.float16)
    count = launch.DESCRIPTORS_PER_PLAN + 6
    xs = [torch.randn(200, 512, device="cuda", dtype=torch.float16) for _ in range(count)]
    for x in [*xs, *xs[:8]]:  # past the bound (the maps start again), then addresses seen before
        out = llm_speed.gemm(x, w, trans_b=True)
        assert_as_accurate_as_torch(out, x.double() @ w.double().T, x @ w.T, 512)
    # the recipe of the calls above (the public call's key: b with trans_b, a fresh output)
    recipe = gemm_launch._recipe_of(xs[0], w, out.dtype, False, True, None, None, None, None, None, None,
                                    out.device)
    plan = recipe.plan
    assert plan.direct and plan.native == triton.__version__.startswith("3.6.")


@pytest.mark.parametrize("path", gemm_configs.PATHS)
def test_the_chosen_config_of_every_tile_runs(path):
    """Problems that make gemm_config pick each of its tiles on this GPU, run and checked."""
    hardware = hardware_of(torch.device("cuda"))
    if path == "persistent_tma" and not has_tma():
        pytest.skip("the TMA kernel is not used on this GPU")
    seen = set()
    for m, n in [(16, 4096), (16, 8192), (16, 16384), (128, 4096), (1024, 1024), (2048, 2048), (4096, 4096)]:
        config = gemm_configs.gemm_config(m, n, 1024, torch.float16, path, True, hardware)
        if config in seen:
            continue
        seen.add(config)
        x = torch.randn(m, 1024, device="cuda", dtype=torch.float16)
        w = torch.randn(n, 1024, device="cuda", dtype=torch.float16)
        out = torch.empty(m, n, device="cuda", dtype=torch.float16)
        plan, _ = gemm_launch.planned_launch(x, w.mT, out, path=path)
        assert (plan.fixed["BLOCK_M"], plan.fixed["BLOCK_N"]) == (config.block_m, config.block_n)
        gemm_launch.launch_gemm(x, w.mT, out, path=path)
        assert_as_accurate_as_torch(out, x.double() @ w.double().T, x @ w.T, 1024)
    assert len(seen) >= 3


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_tensors_on_a_device_that_is_not_current():
    a = torch.randn(300, 200, device="cuda:1", dtype=torch.float16)
    b = torch.randn(200, 100, device="cuda:1", dtype=torch.float16)
    with torch.cuda.device(0):
        out = llm_speed.gemm(a, b)
    assert out.device == a.device
    assert_as_accurate_as_torch(out, a.double() @ b.double(), a @ b, 200)


def test_batched_broadcast():
    a = torch.randn(8, 1024, 512, device="cuda", dtype=torch.float16)
    b = torch.randn(512, 768, device="cuda", dtype=torch.float16)
    out = llm_speed.gemm(a, b)
    assert_as_accurate_as_torch(out, a.double() @ b.double(), torch.matmul(a, b), 512)


@pytest.mark.parametrize("size", [512, 4096])
def test_int8_exact(size):
    a = torch.randint(-128, 128, (size, size), device="cuda", dtype=torch.int8)
    b = torch.randint(-128, 128, (size, size), device="cuda", dtype=torch.int8)
    # float64 products and sums of int8 values are exact far beyond this K (|sum| < 2**53)
    expected = (a.double() @ b.double()).to(torch.int32)
    assert torch.equal(llm_speed.tensor_core_gemm_int8(a, b), expected)
    small_a, small_b = a[:100, :300], b[:300, :50]
    assert torch.equal(llm_speed.tensor_core_gemm_int8(small_a, small_b).cpu(),
                       gemm_int8_reference(small_a.cpu(), small_b.cpu()))  # fmt: skip


def test_forward_is_deterministic():
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    b = torch.randn(2048, 2048, device="cuda", dtype=torch.float16)
    first = llm_speed.gemm(a, b)
    for _ in range(50):
        assert torch.equal(llm_speed.gemm(a, b), first)


def test_gradients_at_1024():
    a = torch.randn(1024, 1024, device="cuda")
    b = torch.randn(1024, 1024, device="cuda")
    grads = {}
    for name, dtype, fn in [
        ("kernel", torch.float32, lambda x, y: llm_speed.gemm(x, y, activation="silu")),
        ("torch", torch.float32, lambda x, y: torch.nn.functional.silu(x @ y)),
        ("float64", torch.float64, lambda x, y: torch.nn.functional.silu(x @ y)),
    ]:
        # fresh leaves each time: a.to(float32) is a itself, and a.to(float64) of a leaf is no leaf
        x, y = (t.to(dtype).clone().requires_grad_() for t in (a, b))
        fn(x, y).sum().backward()
        grads[name] = (x.grad.double(), y.grad.double())
    for i in range(2):
        kernel_error = (grads["kernel"][i] - grads["float64"][i]).abs().max().item()
        torch_error = (grads["torch"][i] - grads["float64"][i]).abs().max().item()
        assert kernel_error <= 3 * torch_error + 1024 * EPS32
