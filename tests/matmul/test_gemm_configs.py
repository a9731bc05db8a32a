"""Every shipped GEMM configuration run directly (``launch_gemm(..., config=...)``), on a ragged shape with
far more tiles than SMs (GPU) or than persistent programs (CPU), into a NaN-poisoned output; and the pure
rule (``gemm_config``) that chooses one of them per problem.

``gemm_config`` picks one configuration per problem: a configuration it never picks at the test shapes
would otherwise go unseen. On the CPU the interpreter ignores warps and stages, so each tile shape runs once.
"""

import dataclasses

import pytest
import torch
from matmul_helpers import assert_gemm_accurate

from llm_speed.core import launch, runtime, tensors
from llm_speed.core.gpus import list_gpus
from llm_speed.core.hardware import Hardware, hardware_of
from llm_speed.matmul import gemm_config
from llm_speed.matmul.gemm_configs import (
    INTERPRETER_PERSISTENT_PROGRAMS,
    LARGE,
    MEDIUM,
    SMALL,
    TIERS,
    candidate_configs,
    has_tma,
    shared_bytes,
    shipped_configs,
)
from llm_speed.matmul.gemm_kernels import PERSISTENT_TMA_KERNEL, TILED_KERNEL
from llm_speed.matmul.gemm_launch import launch_gemm, planned_launch

TILES_PER_SM = 4  # on a GPU: at least this many tiles per SM, so persistent programs loop
H100 = Hardware.from_spec("h100-sxm")


def _to_run():
    shipped = shipped_configs()
    if not runtime.INTERPRETED:
        return shipped
    unique = {}
    for path, config in shipped:
        unique.setdefault((path, tuple(config.meta().items())), (path, config))
    return tuple(unique.values())


@pytest.mark.parametrize("path, config", _to_run(), ids=lambda x: x if isinstance(x, str) else x.name())
def test_each_shipped_config_directly(device, path, config):
    hardware = hardware_of(device)
    if path == "persistent_tma" and device.type == "cuda" and not has_tma(hardware):
        pytest.skip(f"the TMA kernel is not used on {hardware.name}")
    programs = hardware.sm_count if device.type == "cuda" else INTERPRETER_PERSISTENT_PROGRAMS
    if device.type == "cuda":
        per_side = max(3, int((TILES_PER_SM * programs) ** 0.5) + 1)
    else:
        per_side = 3 if path == "persistent_tma" else 2
    # Ragged in every dimension: partial last tiles in M and N, a partial last step along K.
    m = per_side * config.block_m - 5
    n = per_side * config.block_n - 24  # a multiple of 8: 16-byte rows for tensor descriptors
    k = 2 * config.block_k + 8
    tiles = -(-m // config.block_m) * -(-n // config.block_n)
    if device.type == "cuda":
        assert tiles >= TILES_PER_SM * programs
    else:  # persistent programs walk at least two tiles each; tiled programs are one per tile
        assert tiles >= (2 * programs if path == "persistent_tma" else 4)
    dtype = torch.bfloat16 if path == "persistent_tma" else torch.float16
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype).mT  # x @ W^T: the layout of a linear layer
    bias = torch.randn(n, device=device, dtype=dtype)
    out = tensors.new_output((m, n), dtype, device)  # NaN: poisoned by tests/matmul/conftest.py
    assert out.isnan().all()
    plan, _ = planned_launch(a, b, out, bias=bias, activation="gelu_tanh", path=path, config=config)
    assert plan.fixed["BLOCK_M"] == config.block_m and plan.num_stages == config.num_stages
    kernel = PERSISTENT_TMA_KERNEL if path == "persistent_tma" else TILED_KERNEL
    before = runtime.launch_count(kernel)
    launch_gemm(a, b, out, bias=bias, activation="gelu_tanh", path=path, config=config)
    assert runtime.launch_count(kernel) == before + 1
    assert_gemm_accurate(out, a, b, bias=bias, activation="gelu_tanh")


# --- the choice -------------------------------------------------------------------------------------------


def test_the_choice_is_pure_and_cached():
    first = gemm_config(4096, 4096, 4096, torch.float16, "tiled", False, H100)
    assert gemm_config(4096, 4096, 4096, torch.float16, "tiled", False, H100) is first
    gemm_config.cache_clear()
    assert gemm_config(4096, 4096, 4096, torch.float16, "tiled", False, H100) == first
    assert first in LARGE.tiled


@pytest.mark.parametrize("path", ["tiled", "persistent_tma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_large_square_problems_take_the_largest_tile(path, dtype):
    for size in (2048, 4096, 8192, 16384):
        config = gemm_config(size, size, size, dtype, path, True, H100)
        assert (config.block_m, config.block_n) == (128, 256), (size, config)


def test_fp32_takes_the_largest_tile_that_fits_its_shared_memory():
    config = gemm_config(8192, 8192, 8192, torch.float32, "tiled", False, H100)
    assert (config.block_m, config.block_n) == (128, 128)
    assert shared_bytes(config, 4) <= H100.smem_per_block_bytes < shared_bytes(LARGE.tiled[0], 4)


@pytest.mark.parametrize("m", [1, 2, 16, 17, 64])
@pytest.mark.parametrize("path", ["tiled", "persistent_tma"])
def test_skinny_m_takes_the_smallest_block_m(m, path):
    """Decode (M = tokens <= 64): BLOCK_M is the tier's smallest, never a 128-row tile of masked rows."""
    smallest = min(c.block_m for c in candidate_configs(path, torch.float16, H100))
    for n in (128, 4096, 14336, 128256):
        config = gemm_config(m, n, 4096, torch.float16, path, True, H100)
        assert config.block_m == smallest == 64, (m, n, config)


def test_decode_spreads_the_weights_over_every_sm():
    """With one row tile, the columns are split as finely as one wave of SMs allows, and no finer."""
    for n, block_n in ((4096, 32), (8192, 64), (16384, 128)):
        config = gemm_config(16, n, 4096, torch.float16, "tiled", False, H100)
        assert config.block_n == block_n, (n, config)
        assert -(-n // block_n) <= H100.sm_count < -(-n // (block_n // 2))


@pytest.mark.parametrize("m", [1, 16, 64])
def test_decode_on_the_tma_kernel_reads_the_weights_from_every_sm(m):
    """Llama-3-8B's weights at decode (x @ W^T, M <= 64): the persistent kernel's decode tile (64x32) gives
    4096-row weights 128 programs (its 64x128 tile gave 32 of the H100's 132 SMs), and the widest tile
    wins where the narrow one would only add tile starts (the 128256-row head: 64x128, 1002 tiles)."""
    decode = LARGE.persistent_tma_decode
    for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)):
        config = gemm_config(m, n, k, torch.bfloat16, "persistent_tma", True, H100)
        assert config in decode, (n, k, config)
        assert -(-n // config.block_n) >= 0.9 * H100.sm_count
    head = gemm_config(m, 128256, 4096, torch.bfloat16, "persistent_tma", True, H100)
    assert (head.block_m, head.block_n) == (64, 128)


@pytest.mark.parametrize("m", [65, 128, 1024])
def test_the_decode_tile_is_for_decode_only(m):
    """Past one row block the compute rule chooses as before: 64x32's many programs would re-read the
    activations through L2 (M = 128 x 4096 x 4096 stays 128x64, 64 programs)."""
    for n in (4096, 6144, 14336):
        config = gemm_config(m, n, 4096, torch.bfloat16, "persistent_tma", True, H100)
        assert config not in LARGE.persistent_tma_decode, (m, n, config)


def test_a_few_waves_fill_the_sms_with_smaller_tiles():
    """1024^3 on an H100: 128x256 makes 32 tiles for 132 SMs; 128x64 makes 128, one nearly full wave."""
    config = gemm_config(1024, 1024, 1024, torch.float16, "tiled", False, H100)
    assert (config.block_m, config.block_n) == (128, 64)
    # the model counts SMs: the same problem on a 16-SM part takes the big tiles (2 waves of 128x256)
    few_sms = dataclasses.replace(H100, sm_count=16)
    assert (gemm_config(1024, 1024, 1024, torch.float16, "tiled", False, few_sms).block_n) == 256


def test_batch_counts_in_the_waves():
    single = gemm_config(256, 256, 1024, torch.float16, "tiled", False, H100)
    batched = gemm_config(256, 256, 1024, torch.float16, "tiled", False, H100, batch=64)
    assert single.block_m * single.block_n < batched.block_m * batched.block_n


@pytest.mark.parametrize("gpu", [spec.id for spec in list_gpus()])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.int8])
def test_no_tile_larger_than_the_padded_problem_unless_nothing_fits(gpu, dtype):
    hardware = Hardware.from_spec(gpu)
    paths = ["tiled"] + (["persistent_tma"] if has_tma(hardware) and dtype == torch.float16 else [])
    for path in paths:
        pool = candidate_configs(path, dtype, hardware)
        for m in (1, 16, 33, 64, 100, 128, 300, 4096):
            for n in (1, 16, 48, 64, 200, 4096):
                config = gemm_config(m, n, 512, dtype, path, False, hardware)
                assert config in pool
                padded_m, padded_n = max(16, 1 << (m - 1).bit_length()), max(16, 1 << (n - 1).bit_length())
                fits = [c for c in pool if c.block_m <= padded_m and c.block_n <= padded_n]
                if fits:
                    assert config.block_m <= padded_m and config.block_n <= padded_n, (m, n, config)
                else:  # only the smallest side the candidates have may exceed the problem
                    assert config.block_m <= max(padded_m, min(c.block_m for c in pool)), (m, n, config)
                assert shared_bytes(config, dtype.itemsize) <= hardware.smem_per_block_bytes


def test_each_tier_offers_the_model_its_whole_list_for_16_bit_operands():
    for tier, hardware in ((LARGE, H100), (MEDIUM, Hardware.from_spec("a100-sxm-80gb")),
                           (SMALL, Hardware("ada", (8, 9), 99 * 1024, 128))):  # fmt: skip
        assert candidate_configs("tiled", torch.float16, hardware) == tier.tiled
    assert TIERS == (LARGE, MEDIUM, SMALL)
    assert candidate_configs("persistent_tma", torch.bfloat16, H100) == LARGE.persistent_tma_shipped
    with pytest.raises(ValueError, match="not used on"):
        candidate_configs("persistent_tma", torch.float16, Hardware.from_spec("a100-sxm-80gb"))
    with pytest.raises(ValueError, match="path must be"):
        gemm_config(64, 64, 64, torch.float16, "fast", False, H100)


def test_simulated_gpu_launches_the_chosen_config():
    """On the GPU code path (simulated on the CPU), the plan runs gemm_config's pick for the problem."""
    a, b = torch.randn(16, 4096, dtype=torch.float16), torch.randn(4096, 4096, dtype=torch.float16)
    expected = gemm_config(16, 4096, 4096, torch.float16, "persistent_tma", False, H100)
    with launch.simulated_gpu():
        out = torch.empty(16, 4096, dtype=torch.float16)
        plan, per_call = planned_launch(a, b, out)
        assert plan.kernel.name == PERSISTENT_TMA_KERNEL
        assert (plan.fixed["BLOCK_M"], plan.fixed["BLOCK_N"], plan.fixed["BLOCK_K"]) == (
            expected.block_m, expected.block_n, expected.block_k,
        )  # fmt: skip
        assert (plan.num_warps, plan.num_stages) == (expected.num_warps, expected.num_stages)
        assert plan.grid[0] == min(H100.sm_count, -(-4096 // expected.block_n))
        # the plan fixes the descriptors' layouts (the configuration's blocks); a call passes a and b
        assert plan.descriptors["a_desc"] == ((16, 4096), (4096, 1), (expected.block_m, expected.block_k))
        assert plan.descriptors["b_desc"] == ((4096, 4096), (4096, 1), (expected.block_k, expected.block_n))
        assert per_call["a_desc"] is a and per_call["b_desc"] is b
