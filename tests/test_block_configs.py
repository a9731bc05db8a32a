"""Block configurations follow the hardware (shared memory per block, SMs, TMA), not the GPU's name."""

import dataclasses
import importlib
import types

import pytest
import torch

from llm_speed.attention import flash as attention_configs
from llm_speed.core.config import KernelConfig
from llm_speed.core.gpus import list_gpus
from llm_speed.core.hardware import KIB, Hardware, default_hardware, hardware_of

# the module: the package's attribute ``gemm`` is the function
gemm_configs = importlib.import_module("llm_speed.matmul.gemm_configs")


def test_b200_gets_the_large_tiles_and_tma_like_the_h100():
    h100, b200 = Hardware.from_spec("h100-sxm"), Hardware.from_spec("b200")
    assert b200.compute_capability[0] == 10 and b200.sm_count == 148
    for hardware in (h100, b200):
        assert gemm_configs.tier_for(hardware) is gemm_configs.LARGE
        assert gemm_configs.has_tma(hardware)
        assert gemm_configs.persistent_tma_configs(hardware) == gemm_configs.LARGE.persistent_tma_shipped


@pytest.mark.parametrize("gpu", list_gpus(), ids=lambda spec: spec.id)
def test_every_table_gpu_gets_configs_that_fit_its_shared_memory(gpu):
    hardware = Hardware.from_spec(gpu)
    assert hardware.smem_per_block_bytes == (gpu.smem_per_sm_kb - 1) * KIB
    for config in gemm_configs.tiled_configs(hardware) + gemm_configs.persistent_tma_configs(hardware):
        assert gemm_configs.shared_bytes(config) <= hardware.smem_per_block_bytes, config
    # TMA only where the chip has tensor descriptors (compute capability >= 9.0)
    assert gemm_configs.has_tma(hardware) <= (gpu.compute_capability >= (9, 0))
    # the H100-measured tiles with Hopper's 227 KB per block, FULL from 99 KB, the compact table below (T4)
    smem = hardware.smem_per_block_bytes
    expected = (
        attention_configs.LARGE
        if smem >= 227 * KIB
        else attention_configs.FULL
        if smem >= 99 * KIB
        else attention_configs.COMPACT
    )
    assert attention_configs.tier_for(hardware) is expected


def test_tiers_by_shared_memory():
    def device(kib, capability=(9, 0)):
        return Hardware("test", capability, kib * KIB, 100)

    assert gemm_configs.tier_for(device(227)) is gemm_configs.LARGE
    assert gemm_configs.tier_for(device(163, (8, 0))) is gemm_configs.MEDIUM
    assert gemm_configs.tier_for(device(99, (12, 0))) is gemm_configs.SMALL
    assert gemm_configs.tier_for(device(48, (7, 5))) is gemm_configs.SMALL  # the smallest is the fallback
    assert not gemm_configs.has_tma(device(99, (12, 0)))  # TMA hardware, but no TMA tiles fit its tier
    assert not gemm_configs.has_tma(device(227, (8, 0)))  # room for the tiles, but no TMA on the chip
    assert attention_configs.tier_for(device(64, (7, 5))) is attention_configs.COMPACT
    assert attention_configs.tier_for(device(163, (8, 0))) is attention_configs.FULL  # A100
    assert attention_configs.tier_for(device(227)) is attention_configs.LARGE
    default = attention_configs.attention_config("forward", 128, torch.float16, hardware_of(None))
    large = attention_configs.LARGE.table["forward"][torch.float16][128]  # the interpreter: the H100 entry
    assert default == dataclasses.replace(large, block_d=128)


def test_each_tier_fits_its_own_minimum():
    for tier in gemm_configs.TIERS:
        for config in tier.tiled + tier.persistent_tma:
            assert gemm_configs.shared_bytes(config) <= tier.min_smem_bytes, (tier.name, config)
            assert min(config.block_m, config.block_n, config.block_k) >= 16  # tl.dot's smallest tile
    for entry in attention_configs.shipped_configs():
        assert min(entry.config.block_m, entry.config.block_n) >= 16 and entry.config.block_k is None


def test_shipped_configs_list_every_config_once():
    gemm = gemm_configs.shipped_configs()
    assert len(gemm) == len(set(gemm))
    for tier in gemm_configs.TIERS:
        listed = [("tiled", c) for c in tier.tiled] + [("persistent_tma", c) for c in tier.persistent_tma]
        assert set(listed) <= set(gemm)
    attention = attention_configs.shipped_configs()
    # tiers x directions x dtype classes x head dims
    assert len(attention) == len(attention_configs.TIERS) * 2 * 2 * 3


def test_hardware_from_device_properties():
    props = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132,
                                  shared_memory_per_block_optin=232448, L2_cache_size=52428800)  # fmt: skip
    assert Hardware.from_properties(props) == Hardware("NVIDIA H100 80GB HBM3", (9, 0), 232448, 132, 52428800)
    assert Hardware.from_spec("h100-sxm").l2_bytes == 50 * KIB * KIB
    # an older torch without the opt-in field: the GPU table fills it in, else CUDA's 48 KB default
    del props.shared_memory_per_block_optin
    assert Hardware.from_properties(props).smem_per_block_bytes == 227 * KIB
    props.name = "Some Future GPU"
    assert Hardware.from_properties(props).smem_per_block_bytes == 48 * KIB


def test_devices_without_cuda_get_the_default():
    assert hardware_of(None) is default_hardware() and hardware_of(torch.device("cpu")) is default_hardware()
    assert hardware_of("cpu") is default_hardware()
    assert default_hardware() == Hardware.from_spec("h100-sxm")


def test_one_config_type_for_both_families():
    gemm = gemm_configs.LARGE.tiled[0]
    attention = attention_configs.FULL.table["forward"][torch.float16][64]
    assert type(gemm) is type(attention) is KernelConfig
    assert gemm.meta() == {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}
    assert attention.meta() == {"BLOCK_M": 128, "BLOCK_N": 64}
    assert gemm.num_warps == 8 and gemm.name() == "128x256x64_g8_w8_s3"
    with pytest.raises(TypeError):
        KernelConfig(64, 64, 4, 2, 32)  # block_k and group_m are keyword-only


def test_compact_attention_tiles_never_need_more_than_full_ones():
    """COMPACT is not compiled by the budgets (tests/kernel_report covers FULL and LARGE): its tiles and
    stages are each at most FULL's, so its shared memory is at most FULL's measured 98 KiB."""
    for direction, by_dtype in attention_configs.COMPACT.table.items():
        for dtype, row in by_dtype.items():
            for block_d, compact in row.items():
                full = attention_configs.FULL.table[direction][dtype][block_d]
                assert compact.block_m <= full.block_m and compact.block_n <= full.block_n
                assert compact.num_stages <= full.num_stages
    assert attention_configs.COMPACT.table != attention_configs.FULL.table
