"""Every shipped GEMM configuration run directly (not through the autotuner), on a ragged shape with far more
tiles than SMs (GPU) or than persistent programs (CPU), into a NaN-poisoned output.

The autotuner only ever runs its pick at the test shapes: a configuration that is wrong but never wins
would go unseen. Here each one runs as a one-entry autotuner (Triton runs a single configuration without
timing it). On the CPU the interpreter ignores warps and stages, so each tile shape runs once.
"""

import dataclasses

import pytest
import torch
import triton
from matmul_helpers import assert_gemm_accurate

from llm_speed.core import runtime, tensors
from llm_speed.core.hardware import hardware_of
from llm_speed.matmul import configs, kernels, ops

CPU_PERSISTENT_PROGRAMS = 2  # on the CPU each persistent program walks several tiles
TILES_PER_SM = 4  # on a GPU: at least this many tiles per SM, so persistent programs loop


def _to_run():
    shipped = configs.shipped_configs()
    if not runtime.INTERPRETED:
        return shipped
    unique = {}
    for path, config in shipped:
        unique.setdefault((path, tuple(config.meta().items())), (path, config))
    return tuple(unique.values())


@pytest.fixture
def one_config(monkeypatch, device):
    """Make the launchers' GPU branch run exactly the configuration given (also under the interpreter)."""
    hardware = hardware_of(device)
    if device.type != "cuda":
        hardware = dataclasses.replace(hardware, sm_count=CPU_PERSISTENT_PROGRAMS)
        monkeypatch.setattr(runtime, "INTERPRETED", False)  # the kernels still run interpreted
    monkeypatch.setattr(ops, "_hardware", lambda _device: hardware)

    def use(path, config):
        if path == "persistent_tma":
            tuner = triton.autotune([ops._to_triton(config, ops._set_descriptor_blocks)], key=[])
            monkeypatch.setattr(ops, "_autotuned_persistent_tma",
                                lambda _hw: tuner(kernels.gemm_persistent_tma_kernel))  # fmt: skip
        else:
            tuner = triton.autotune([ops._to_triton(config)], key=[])
            monkeypatch.setattr(ops, "_autotuned_tiled", lambda _hw: tuner(kernels.gemm_tiled_kernel))
        return hardware

    return use


@pytest.mark.parametrize("path, config", _to_run(), ids=lambda x: x if isinstance(x, str) else x.name())
def test_each_shipped_config_directly(one_config, device, path, config):
    hardware = one_config(path, config)
    if path == "persistent_tma" and not configs.has_tma(hardware):
        pytest.skip(f"the TMA kernel is not used on {hardware.name}")
    if device.type == "cuda":
        per_side = max(3, int((TILES_PER_SM * hardware.sm_count) ** 0.5) + 1)
    else:
        per_side = 3 if path == "persistent_tma" else 2
    # Ragged in every dimension: partial last tiles in M and N, a partial last step along K.
    m = per_side * config.block_m - 5
    n = per_side * config.block_n - 24  # a multiple of 8: 16-byte rows for tensor descriptors
    k = 2 * config.block_k + 8
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    assert tiles >= (TILES_PER_SM * hardware.sm_count if device.type == "cuda" else 2 * hardware.sm_count)
    # bf16 through the TMA kernel on a GPU; not on the CPU, where the launcher (told it runs compiled) would
    # not widen bf16 dots around the interpreter's bf16 bug.
    dtype = torch.bfloat16 if path == "persistent_tma" and device.type == "cuda" else torch.float16
    a = torch.randn(m, k, device=device, dtype=dtype)
    b = torch.randn(n, k, device=device, dtype=dtype).mT  # x @ W^T: the layout of a linear layer
    bias = torch.randn(n, device=device, dtype=dtype)
    out = tensors.new_output((m, n), dtype, device)  # NaN: poisoned by tests/matmul/conftest.py
    assert out.isnan().all()
    kernel = ops.PERSISTENT_TMA_KERNEL if path == "persistent_tma" else ops.TILED_KERNEL
    before = runtime.launch_count(kernel)
    ops.launch_gemm(a, b, out, bias=bias, activation="gelu_tanh", path=path)
    assert runtime.launch_count(kernel) == before + 1
    assert_gemm_accurate(out, a, b, bias=bias, activation="gelu_tanh")
