"""``llm-speed bench op NAME --size N`` with a size whose example problem cannot be made: one line naming
--size and the sizes accepted, exit 2, before the example's tensors are allocated (they are counted on the
meta device)."""

from __future__ import annotations

import pytest
import torch

from llm_speed import cli, ops
from llm_speed.bench import cpu_load
from llm_speed.bench import op as op_bench


@pytest.fixture
def built_on(monkeypatch) -> list[str]:
    """The device types the example problems are built on."""
    devices: list[str] = []
    original = ops.Op.example_problem

    def example_problem(self, device, dtype, size):
        devices.append(torch.device(device).type)
        return original(self, device, dtype, size)

    monkeypatch.setattr(ops.Op, "example_problem", example_problem)
    return devices


@pytest.mark.parametrize("name", ["gemm", "rms_norm", "flash_attention"])
def test_a_size_past_what_can_be_made_is_refused_before_anything_is_allocated(name, built_on, capsys):
    # The sweep: gemm and rms_norm overflowed PyTorch's storage size (a traceback), flash_attention's
    # [1, 8, size, 64] tensors failed to allocate.
    assert cli.main(["bench", "op", name, "--size", "99999999999", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--size" in err and "99999999999" in err, err
    assert "accepted here: 1 to" in err, err
    assert set(built_on) == {"meta"}, built_on


def test_the_memory_refusal_names_the_largest_size_that_fits():
    # gemm on a CPU: fp32 a and b of size^2, and as much again for the outputs: 16 size^2 bytes.
    cpu = torch.device("cpu")
    available = 16 * 100**2
    message = op_bench.size_refusal("gemm", size=101, dtype=None, device=cpu, available=available)
    assert message.startswith("--size: gemm at 101 needs") and message.endswith("accepted here: 1 to 100")
    assert op_bench.size_refusal("gemm", size=100, dtype=None, device=cpu, available=available) is None


def test_the_memory_available_on_this_cpu_is_what_bounds_the_run(monkeypatch, built_on, capsys):
    monkeypatch.setattr(cpu_load, "available_memory", lambda: 16 * 100**2)
    assert cli.main(["bench", "op", "gemm", "--size", "128", "--device", "cpu"]) == 2
    assert "accepted here: 1 to 100" in capsys.readouterr().err
    assert set(built_on) == {"meta"}, built_on


def test_on_a_gpu_only_sizes_past_what_pytorch_can_count_are_refused():
    # A GPU's out-of-memory error is the harness's to report: only an overflow is refused there.
    cuda = torch.device("cuda")
    assert op_bench.size_refusal("gemm", size=100_000, dtype="fp16", device=cuda, available=1) is None
    message = op_bench.size_refusal("gemm", size=99999999999, dtype="fp16", device=cuda)
    assert "--size: 99999999999 is too large" in message and message.endswith("accepted: 1 to 2147483647")
