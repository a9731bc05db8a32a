"""Tile counts, wave quantization (seed 001's 108-SM example), HBM traffic, Tensor Core alignment."""

import numpy as np
import pytest
import torch

from llm_speed.core.gpus import get_gpu
from llm_speed.perf.gemm_tiling import (
    check_alignment,
    gemm_hbm_traffic,
    pad_to_alignment,
    tensor_core_alignment,
    tile_count,
    wave_quantization,
)


def test_tile_count_rounds_partial_tiles_up():
    assert tile_count(128, 128, 128, 128) == 1
    assert tile_count(129, 128, 128, 128) == 2
    assert tile_count(2049, 2049, 128, 128) == 17 * 17


def test_seed_001_wave_quantization_on_108_sms():
    # Seed 001: 108 tiles on 108 SMs run in one wave; 109 need a second wave in which 107 SMs idle.
    full = wave_quantization(108 * 128, 128, 128, 128, 108)
    assert (full.tiles, full.waves, full.tail_tiles, full.efficiency) == (108, 1, 0, 1.0)
    tail = wave_quantization(109 * 128, 128, 128, 128, 108)
    assert (tail.tiles, tail.waves, tail.tail_tiles) == (109, 2, 1)
    assert tail.efficiency == pytest.approx(109 / 216)
    # The same through the spec table: A100 has 108 SMs.
    assert wave_quantization(109 * 128, 128, 128, 128, "a100").waves == 2
    assert get_gpu("a100").sm_count == 108


def test_wave_quantization_sawtooth_and_padding():
    # 2048 -> 2049 adds a row and a column of tiles: 256 -> 289 tiles on 132 SMs (H100).
    at_2048 = wave_quantization(2048, 2048, 128, 128, "h100-sxm")
    at_2049 = wave_quantization(2049, 2049, 128, 128, "h100-sxm")
    assert (at_2048.tiles, at_2048.waves) == (256, 2)
    assert (at_2049.tiles, at_2049.waves) == (289, 3)
    assert at_2049.padding_efficiency == pytest.approx(2049**2 / (289 * 128 * 128))
    two_per_sm = wave_quantization(2049, 2049, 128, 128, 132, tiles_per_sm=2)
    assert two_per_sm.waves == 2 and two_per_sm.efficiency == pytest.approx(289 / 528)


def test_hbm_traffic_tiling_cuts_reads_by_about_the_tile_size():
    n = 4096
    traffic = gemm_hbm_traffic(n, n, n, dtype="fp16", tile_m=128, tile_n=128)
    assert traffic.untiled_bytes == 2 * n**3 * 2 + n * n * 2
    assert traffic.tiled_bytes == (2 * n * n * (n // 128)) * 2 + n * n * 2
    assert traffic.minimum_bytes == 3 * n * n * 2
    assert traffic.reduction == pytest.approx(traffic.untiled_bytes / traffic.tiled_bytes)
    assert 120 < traffic.reduction < 128  # ~tile size (seed 001: "memory access reduced T times")
    single = gemm_hbm_traffic(128, 128, 64, tile_m=128, tile_n=128)
    assert single.tiled_bytes == single.minimum_bytes  # one tile reads each operand once


def test_tensor_core_alignment_by_dtype():
    # Seed 003: multiples of 8 for FP16, 16 for INT8.
    assert tensor_core_alignment("fp16") == 8
    assert tensor_core_alignment(torch.bfloat16) == 8
    assert tensor_core_alignment("int8") == 16
    assert tensor_core_alignment("tf32") == 4
    advice = check_alignment(4095, 4096, 1000, "fp16")
    assert advice.misaligned == ("m",)
    assert advice.padded_shape == (4096, 4096, 1000)
    assert advice.extra_flops_fraction == pytest.approx(4096 / 4095 - 1)
    assert check_alignment(1000, 24, 8, alignment=16).padded_shape == (1008, 32, 16)


def test_pad_to_alignment_sizes_and_shapes():
    assert pad_to_alignment(100) == 112
    assert pad_to_alignment(112) == 112
    assert pad_to_alignment(0) == 0
    assert pad_to_alignment(100, alignment=8) == 104
    assert pad_to_alignment((3, 100, 17)) == (3, 112, 32)
    assert pad_to_alignment([5]) == [16]
    assert pad_to_alignment(torch.Size([3, 100])) == (16, 112)
    assert pad_to_alignment((np.int64(17), 3)) == (32, 16) and pad_to_alignment(np.int64(17)) == 32


def test_pad_to_alignment_tensor_as_seed_002():
    a = torch.randn(2, 30, 17)
    original = a.clone()
    padded = pad_to_alignment(a, 16)
    assert padded.shape == (2, 32, 32)
    assert torch.equal(padded[:, :30, :17], a)
    assert torch.count_nonzero(padded[:, 30:, :]) == 0 and torch.count_nonzero(padded[:, :, 17:]) == 0
    assert torch.equal(a, original)  # input untouched
    aligned = torch.randn(32, 16)
    assert pad_to_alignment(aligned) is aligned  # nothing to pad: the input itself, as seed 002
    vector = pad_to_alignment(torch.arange(5.0), 8)
    assert torch.equal(vector, torch.tensor([0.0, 1, 2, 3, 4, 0, 0, 0]))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: tile_count(0, 128, 128, 128), ValueError, "m"),
        (lambda: wave_quantization(128, 128, 128, 128, 0), ValueError, "sm_count"),
        (lambda: wave_quantization(128, 128, 128, 128, "mi300"), ValueError, "valid ids"),
        (lambda: gemm_hbm_traffic(128, 128, -5), ValueError, "k"),
        (lambda: pad_to_alignment(-3), ValueError, "size"),
        (lambda: pad_to_alignment(10, alignment=0), ValueError, "alignment"),
        (lambda: pad_to_alignment("abc"), TypeError, "tensor_or_size"),
        # shape entries: 16.5 was truncated to 16 (padded to 16, not 32); True and "16" read as sizes
        (lambda: pad_to_alignment((16.5, 3)), TypeError, r"tensor_or_size must be an int, a shape \(a tuple "
         r"or list of ints\) or a torch.Tensor, got float 16.5 in \(16.5, 3\)"),
        (lambda: pad_to_alignment((True, 3)), TypeError, "tensor_or_size must be .* got bool True"),
        (lambda: pad_to_alignment(["16", "3"]), TypeError, "tensor_or_size must be .* got str '16'"),
        (lambda: pad_to_alignment(16.0), TypeError, "tensor_or_size must be .* got float"),
        (lambda: pad_to_alignment(torch.tensor(3.0)), ValueError, "dimension"),
        (lambda: tensor_core_alignment("fp9"), ValueError, "dtype"),
    ],
)
def test_bad_inputs(call, error, match):
    with pytest.raises(error, match=match):
        call()
